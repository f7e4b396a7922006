"""Reliability stress of the real pipeline: random kill -9, a stalled reader, a soak.

    python bench/stress.py [--frames 10000] [--fps 20] [--seed 0] [--json out.json]
                           [--stall-s 24] [--soak-s 0] [--kill-every 1.0,4.0]

Runs camerad -> modeld -> controlsd under the real Supervisor (in this process, under
trio, every worker in its bubblewrap sandbox), with the control domain's
``failure_policy = "restart"``, ``restart = "always"`` and a budget no run exhausts.
This process attaches as one more reader of every channel and checks every message.
Phases, in order:

1. kills (until ``--frames`` camera frames were seen; 0 = skip): once the pipeline is
   back to engaged, wait a random ``--kill-every`` interval, then SIGKILL the outer
   bwrap pid (``sup.runs[name].pid``) of a random worker.
2. stall (``--stall-s``, 0 = skip): paced phases of ``--stall-phase-s``, alternately
   unstalled and stalled; in a stalled phase one extra reader of each of road_frames
   and model_out receives one message and holds it (never releases) until the phase
   ends. Camera->control latency (control_cmd publish - capture time in the receipt of
   the model output it followed) and control_cmd inter-arrival gaps, per phase kind.
3. soak (``--soak-s``, 0 = skip): no faults; per-worker memory (VmRSS and RssAnon of
   every process of its sandbox, /proc/PID/status) sampled every ``--rss-every-s``;
   growth = median of the last minute - median of the first minute.

Counted throughout (see `analyse`):

* torn reads accepted: a model_out/control_cmd message whose copy, taken while the
  lease was held and confirmed by ``with msg:`` (release passed), fails its CRC-32 (the
  channels carry one) or a payload consistency check (control_cmd: reason a SafeReason,
  engaged in {0, 1} and engaged iff reason OK, |steer| <= 0.3, engaged => model age
  <= 150 ms; model_out: finite, receipt frame/capture = stamp's); plus, after the run,
  model outputs re-computed here from the same synthetic frame with the same signed
  artifact (`--verify`): a mismatch means modeld accepted a torn frame. LeaseLost is a
  detected torn read and is counted separately.
* slots leaked: at the end, every reader's lease table (mapped read-only here, as the
  writer sees it) holding an entry past its own deadline, sampled repeatedly; a slot
  whose generation stays odd (a loan abandoned by a killed writer, never reclaimed);
  and a fresh reader attached on a spare index must receive from every channel.
* writer blocks: gaps between road_frames publishes longer than 2.5 frame periods, and
  1 s windows below 90 % of ``--fps``, outside camerad's own restarts (kill -> first
  frame + 1 s).
* restarts against kills: every kill is exactly one ``exit`` event of that worker and
  pid with ``signal: SIGKILL``, followed by a ``restart``; no other exit happens.
* engaged while the model was down: control_cmd with engaged=1 published more than
  ``--timeout-ms`` (controlsd's, 150) + ``--grace-ms`` after modeld died (or camerad:
  no frames, no outputs) and before it is back (its next ``ready`` event or the first
  model output published after it died, whichever is first). "Died": every process of
  its sandbox gone (pidfds of bwrap, bwrap's init and the worker, opened before the
  kill); the sandbox outlives the SIGKILL of its bwrap by a moment, reported too.
* kill -> first output per worker: camerad: first road_frames frame published after
  the old sandbox is gone; modeld: first model_out; controlsd: first control_cmd.
  Also kill -> ``ready`` event, and kill -> sandbox gone.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import mmap
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from supervisor.config import loads  # noqa: E402
from supervisor.events import EventLog  # noqa: E402
from supervisor.ipc import LeaseLost, Reader, Rejected  # noqa: E402
from supervisor.ipc import layout as L  # noqa: E402
from supervisor.lifecycle import Supervisor  # noqa: E402
from workers.controlsd.law import SafeReason  # noqa: E402

WORKERS = ("camerad", "modeld", "controlsd")
# Reader indices: the workers' come first (readers_of order), then ours. No monitor runs
# (status_out=None), so no index is taken by it.
IDX = {"road_frames": {"follow": 1, "stall": 2, "fresh": 3},
       "model_out": {"follow": 1, "stall": 2, "fresh": 3},
       "control_cmd": {"follow": 0, "fresh": 1}}
MAX_STEER = 0.3
OK, VALID_REASONS = 0, {int(r) for r in SafeReason}

CONFIG = """
[domains.control]
failure_policy = "restart"
actuates = true

[channels.road_frames]
kind = "frame"
pixel_formats = ["nv12"]
slot_size = "3.5MiB"
slot_count = 6
max_age_ms = 100
max_readers = 4

[channels.model_out]
dtype = "float32"
slot_size = "4KiB"
slot_count = 8
max_age_ms = 200
payload = "model_out"
crc = true
max_readers = 4

[channels.control_cmd]
dtype = "float32"
slot_size = "4KiB"
slot_count = 64
max_age_ms = 100
payload = "control_cmd"
crc = true
max_readers = 2

[workers.camerad]
domain = "control"
module = "workers.camerad"
publishes = {{ frames = "road_frames" }}
args = ["--fps", "{fps}", "--seed", "{seed}"]
{restart}

[models.lane-offset]
artifact = "models/demo/lane-offset"          # relative to the project root
public_key = "models/demo/demo_ed25519.pub"
expect_name = "lane-offset-demo"
min_version = "1.0.0"

[workers.modeld]
domain = "control"
module = "workers.modeld"
model = "lane-offset"
subscribes = {{ frames = "road_frames" }}
publishes = {{ model = "model_out" }}
ready_timeout_ms = 30000
jit_kernels = true
{restart}

[workers.controlsd]
domain = "control"
module = "workers.controlsd"
subscribes = {{ model = "model_out" }}
publishes = {{ command = "control_cmd" }}
args = ["--timeout-ms", "{timeout_ms}"]
{restart}
"""
RESTART = """restart = "always"
max_restarts = 100000
restart_window_s = 60
backoff_initial_ms = 20
backoff_max_ms = 200"""


def config_text(fps: float, seed: int, timeout_ms: float) -> str:
    return CONFIG.format(fps=f"{fps:g}", seed=seed, timeout_ms=f"{timeout_ms:g}",
                         restart=RESTART)


@dataclass
class Options:
    frames: int = 10_000          # kill phase: until this many camera frames were seen
    fps: float = 20.0
    seed: int = 0
    kill_every: tuple[float, float] = (1.0, 4.0)   # s, after the pipeline is engaged again
    victims: tuple[str, ...] = ()  # the first kills, in this order; then random ones
    max_kills: int = 0            # end the kill phase after this many kills (0: frames only)
    stall_s: float = 24.0
    stall_phase_s: float = 3.0
    soak_s: float = 0.0
    rss_every_s: float = 2.0
    timeout_ms: float = 150.0     # controlsd --timeout-ms (its max age is 150 too)
    grace_ms: float = 10.0        # controlsd's step -> publish, on a shared machine
    recover_timeout_s: float = 60.0
    verify: int = -1              # model outputs re-computed here; -1 = all
    events: str | None = None     # write the supervisor's event log here
    progress: bool = True


@dataclass
class Record:
    """What this process saw, as plain lists (analysed after the run)."""

    frames: list = field(default_factory=list)     # (publish, capture, frame_id, seq)
    outs: list = field(default_factory=list)       # (publish, capture, frame_id, values)
    out_seq: dict = field(default_factory=dict)    # publish -> sequence, of those outputs
    cmds: list = field(default_factory=list)       # (publish, steer, engaged, reason, age)
    torn: Counter = field(default_factory=Counter)           # accepted, by check
    torn_examples: list = field(default_factory=list)
    lease_lost: Counter = field(default_factory=Counter)     # detected, by channel
    rejected: Counter = field(default_factory=Counter)       # "channel:reason"
    # (worker, bwrap pid, kill_ns, dead_ns: every process of the sandbox gone, or None)
    kills: list = field(default_factory=list)
    recover_failures: list = field(default_factory=list)
    phases: list = field(default_factory=list)     # (kind, start_ns, end_ns)
    stall_held: list = field(default_factory=list)  # (channel, outcome at release)
    rss: list = field(default_factory=list)        # (t_ns, phase, worker, pid, rss_kb, anon_kb)
    leases: dict = field(default_factory=dict)
    fresh: dict = field(default_factory=dict)
    reader_stats: dict = field(default_factory=dict)
    statuses: dict = field(default_factory=dict)
    t0: int = 0
    t_end: int = 0


# ------------------------------------------------------------------ checks per message

def check_cmd(v: np.ndarray) -> str | None:
    """Why a control_cmd payload cannot be what controlsd published, or None."""
    if v.shape != (4,) or not np.all(np.isfinite(v)):
        return "cmd_not_finite"
    steer, engaged, reason, age = (float(x) for x in v)
    if engaged not in (0.0, 1.0):
        return "cmd_engaged_not_0_1"
    if reason != int(reason) or int(reason) not in VALID_REASONS:
        return "cmd_reason_invalid"
    if (engaged == 1.0) != (int(reason) == OK):
        return "cmd_engaged_vs_reason"
    if abs(steer) > MAX_STEER + 1e-6:
        return "cmd_steer_out_of_range"
    if engaged == 1.0 and not -5.0 <= age <= 150.0 + 1e-3:
        return "cmd_engaged_with_old_model"
    return None


def check_out(v: np.ndarray, stamp, receipt) -> str | None:
    if v.shape != (4,) or not np.all(np.isfinite(v)):
        return "out_not_finite"
    if receipt is None:
        return "out_no_receipt"
    if receipt.frame_id != stamp.frame_id or receipt.capture_ts_ns != stamp.capture_ts_ns:
        return "out_receipt_vs_stamp"
    if receipt.bytes_out != 16 or receipt.completion != "hostVisible":
        return "out_receipt_fields"
    return None


def _torn(rec: Record, what: str, detail) -> None:
    rec.torn[what] += 1
    if len(rec.torn_examples) < 20:
        rec.torn_examples.append({"check": what, "detail": str(detail)[:300]})


# ------------------------------------------------------------------ readers

async def follow_frames(r: Reader, rec: Record) -> None:
    while True:
        try:
            msg = await r.receive_async()
        except Rejected as e:
            rec.rejected[f"road_frames:{e.reason}"] += 1
            continue
        try:
            with msg:
                s = msg.stamp
                row = (s.publish_ts_ns, s.capture_ts_ns, s.frame_id, s.sequence)
            rec.frames.append(row)
        except LeaseLost:
            rec.lease_lost["road_frames"] += 1


async def follow_outs(r: Reader, rec: Record) -> None:
    while True:
        try:
            msg = await r.receive_async()
        except Rejected as e:
            rec.rejected[f"model_out:{e.reason}"] += 1
            continue
        try:
            with msg:
                v = np.array(msg.array)        # the copy, taken under the lease
                stamp, receipt = msg.stamp, msg.receipt
        except LeaseLost:
            rec.lease_lost["model_out"] += 1   # detected: not accepted
            continue
        except Rejected as e:                 # a receipt that does not decode
            rec.rejected[f"model_out:{e.reason}"] += 1
            continue
        # Accepted (release passed): the copy must be what the writer published.
        if stamp.crc32 is None or zlib.crc32(v.tobytes()) != stamp.crc32:
            _torn(rec, "model_out_crc", (stamp.sequence, v.tolist()))
            continue
        bad = check_out(v, stamp, receipt)
        if bad:
            _torn(rec, bad, (stamp.sequence, v.tolist()))
            continue
        rec.outs.append((stamp.publish_ts_ns, stamp.capture_ts_ns, stamp.frame_id,
                         v.tolist()))
        rec.out_seq[stamp.publish_ts_ns] = stamp.sequence


async def follow_cmds(r: Reader, rec: Record) -> None:
    while True:
        try:
            msg = await r.receive_async()
        except Rejected as e:
            rec.rejected[f"control_cmd:{e.reason}"] += 1
            continue
        try:
            with msg:
                v = np.array(msg.array)
                stamp = msg.stamp
        except LeaseLost:
            rec.lease_lost["control_cmd"] += 1
            continue
        if stamp.crc32 is None or zlib.crc32(v.tobytes()) != stamp.crc32:
            _torn(rec, "control_cmd_crc", (stamp.sequence, v.tolist()))
            continue
        bad = check_cmd(v)
        if bad:
            _torn(rec, bad, (stamp.sequence, v.tolist()))
            continue
        rec.cmds.append((stamp.publish_ts_ns, float(v[0]), int(v[1]), int(v[2]), float(v[3])))


async def stall_hold(r: Reader, channel: str, until_ns: int, rec: Record) -> None:
    """Receive one message and hold it (never release) until ``until_ns``; then see
    what became of it: LeaseLost means the writer reused the slot (it did not wait)."""
    msg = None
    while msg is None and time.monotonic_ns() < until_ns:
        try:
            with trio.move_on_at((until_ns - time.monotonic_ns()) / 1e9 + trio.current_time()):
                msg = await r.receive_async()
        except Rejected:
            continue
    if msg is None:
        return
    await trio.sleep_until(trio.current_time() + max(until_ns - time.monotonic_ns(), 0) / 1e9)
    try:
        msg.release()
        rec.stall_held.append((channel, "still_valid"))
    except LeaseLost:
        rec.stall_held.append((channel, "lease_lost"))
    # Skip what queued up meanwhile: the next stalled phase starts with a fresh message.
    while True:
        try:
            m = r.try_receive()
        except Rejected:
            continue
        if m is None:
            break
        try:
            m.release()
        except LeaseLost:
            pass


# ------------------------------------------------------------------ /proc and leases

def proc_mem(pid: int) -> tuple[int, int] | None:
    """(VmRSS, RssAnon) in kB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        return None
    got = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon"):
            got[k] = int(v.split()[0])
    return got.get("VmRSS", 0), got.get("RssAnon", 0)


def sample_rss(sup: Supervisor, rec: Record, phase: str) -> None:
    now = time.monotonic_ns()
    for name in WORKERS:
        run = sup.runs.get(name)
        if run is None or run.proc is None or run.proc.poll() is not None:
            continue
        pids = sup.worker_pids(run)
        rss = anon = 0
        for pid in [run.pid, *pids]:
            m = proc_mem(pid)
            if m:
                rss += m[0]
                anon += m[1]
        rec.rss.append((now, phase, name, run.pid, rss, anon))
    m = proc_mem(os.getpid())
    if m:
        rec.rss.append((now, phase, "supervisor+stress", os.getpid(), m[0], m[1]))


def lease_snapshot(sup: Supervisor) -> dict:
    """Every reader's lease table and every slot's generation, as the writer sees them."""
    now = time.monotonic_ns()
    out = {}
    for name, ch in sup.channels.items():
        h = ch.writer_handle()
        spec = h.spec
        held = []
        for idx, fd in enumerate(h.lease_fds):
            with mmap.mmap(fd, spec.lease_size, prot=mmap.PROT_READ) as mm:
                for k in range(spec.max_leases):
                    slot, gen, deadline = L.LEASE_ENTRY.unpack_from(mm, L.lease_offset(k))
                    if gen:
                        held.append((idx, k, slot, gen, deadline, deadline < now))
        with mmap.mmap(ch.reader_handle(0).data_fd, spec.segment_size,
                       prot=mmap.PROT_READ) as mm:
            odd = [(i, L.U64.unpack_from(mm, L.control_offset(i))[0])
                   for i in range(spec.slot_count)
                   if L.U64.unpack_from(mm, L.control_offset(i))[0] & 1]
        out[name] = {"held": held, "odd": odd}
    return out


async def check_leaks(sup: Supervisor, rec: Record, samples: int = 10) -> None:
    """A lease entry past its deadline, or an odd (being written) slot, seen unchanged
    in every sample over ~1 s, is leaked: live endpoints hold either for microseconds
    to milliseconds."""
    snaps = []
    for _ in range(samples):
        snaps.append(lease_snapshot(sup))
        await trio.sleep(0.1)
    result = {}
    for name in snaps[0]:
        expired = [set((i, k, s, g) for i, k, s, g, d, past in sn[name]["held"] if past)
                   for sn in snaps]
        odd = [set(sn[name]["odd"]) for sn in snaps]
        result[name] = {"leases_leaked": sorted(set.intersection(*expired)),
                        "slots_leaked": sorted(set.intersection(*odd)),
                        "leases_seen": max(len(sn[name]["held"]) for sn in snaps)}
    rec.leases = result
    # A fresh reader on a spare index receives from every channel.
    for name, idx in IDX.items():
        r = Reader(sup.channels[name].reader_handle(idx["fresh"]))
        got = 0
        with trio.move_on_after(5):
            while got < 5:
                try:
                    m = await r.receive_async()
                except Rejected:
                    continue
                try:
                    with m:
                        pass
                    got += 1
                except LeaseLost:
                    pass
        rec.fresh[name] = got
        r.close()


# ------------------------------------------------------------------ the run

def _alive_ready(sup: Supervisor, name: str) -> bool:
    run = sup.runs.get(name)
    return (run is not None and run.proc is not None and run.proc.poll() is None
            and run.ready.is_set())


async def _wait_engaged(sup: Supervisor, rec: Record, since_ns: int, timeout_s: float) -> bool:
    with trio.move_on_after(timeout_s):
        while True:
            if (all(_alive_ready(sup, n) for n in WORKERS) and rec.cmds
                    and rec.cmds[-1][0] > since_ns and rec.cmds[-1][2] == 1):
                return True
            await trio.sleep(0.02)
    return False


def _say(opts: Options, text: str) -> None:
    if opts.progress:
        print(text, file=sys.stderr, flush=True)


async def _run(opts: Options, rec: Record, log: EventLog) -> Supervisor:
    cfg = loads(config_text(opts.fps, opts.seed, opts.timeout_ms), "bench/stress.py")
    sup = Supervisor(cfg, log=log, status_out=None)
    rng = random.Random(opts.seed)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        rec.t0 = time.monotonic_ns()
        readers = {ch: {role: Reader(sup.channels[ch].reader_handle(i))
                        for role, i in IDX[ch].items() if role != "fresh"}
                   for ch in IDX}
        nursery.start_soon(follow_frames, readers["road_frames"]["follow"], rec)
        nursery.start_soon(follow_outs, readers["model_out"]["follow"], rec)
        nursery.start_soon(follow_cmds, readers["control_cmd"]["follow"], rec)
        phase = ["start"]

        async def rss_sampler():
            while True:
                sample_rss(sup, rec, phase[0])
                await trio.sleep(opts.rss_every_s)

        nursery.start_soon(rss_sampler)
        if not await _wait_engaged(sup, rec, 0, opts.recover_timeout_s):
            raise RuntimeError("the pipeline never engaged")
        _say(opts, f"stress: pipeline engaged {(time.monotonic_ns() - rec.t0) / 1e9:.1f} s "
                   f"after all ready")

        # 1. kills
        phase[0] = "kills"
        start = time.monotonic_ns()
        n0 = len(rec.frames)
        last_say = time.monotonic()
        while (opts.frames and len(rec.frames) - n0 < opts.frames
               and not (opts.max_kills and len(rec.kills) >= opts.max_kills)):
            await trio.sleep(rng.uniform(*opts.kill_every))
            k = len(rec.kills)
            victim = opts.victims[k] if k < len(opts.victims) else rng.choice(WORKERS)
            run = sup.runs[victim]
            if not _alive_ready(sup, victim):
                continue
            pid = run.pid
            # The sandbox outlives its bwrap by a moment (its init gets SIGKILL as a
            # parent-death signal): watch every process of it, to know when it is gone.
            pidfds = []
            for p in (pid, *sup.worker_pids(run)):
                try:
                    pidfds.append(os.pidfd_open(p))
                except ProcessLookupError:
                    pass
            t = time.monotonic_ns()
            os.kill(pid, signal.SIGKILL)
            dead = None
            try:
                with trio.move_on_after(10):
                    for fd in pidfds:
                        await trio.lowlevel.wait_readable(fd)
                    dead = time.monotonic_ns()
            finally:
                for fd in pidfds:
                    os.close(fd)
            rec.kills.append((victim, pid, t, dead))
            if not await _wait_engaged(sup, rec, t, opts.recover_timeout_s):
                rec.recover_failures.append((victim, pid, t))
                _say(opts, f"stress: no recovery within {opts.recover_timeout_s:g} s "
                           f"after killing {victim}")
                break
            if time.monotonic() - last_say > 15:
                last_say = time.monotonic()
                _say(opts, f"stress: {len(rec.frames) - n0}/{opts.frames} frames, "
                           f"{len(rec.kills)} kills, torn accepted {sum(rec.torn.values())}")
        rec.phases.append(("kills", start, time.monotonic_ns()))

        # 2. stalled reader, paced against unstalled phases
        if opts.stall_s > 0:
            phase[0] = "stall"
            await _wait_engaged(sup, rec, 0, opts.recover_timeout_s)
            n = max(2, int(round(opts.stall_s / opts.stall_phase_s)))
            for i in range(n):
                kind = "unstalled" if i % 2 == 0 else "stalled"
                a = time.monotonic_ns()
                b = a + int(opts.stall_phase_s * 1e9)
                if kind == "stalled":
                    async with trio.open_nursery() as inner:
                        for ch in ("road_frames", "model_out"):
                            inner.start_soon(stall_hold, readers[ch]["stall"], ch, b, rec)
                else:
                    await trio.sleep(opts.stall_phase_s)
                rec.phases.append((kind, a, time.monotonic_ns()))
            _say(opts, f"stress: stall phases done ({n} x {opts.stall_phase_s:g} s)")

        # 3. soak
        if opts.soak_s > 0:
            phase[0] = "soak"
            a = time.monotonic_ns()
            sample_rss(sup, rec, "soak")
            end = trio.current_time() + opts.soak_s
            while trio.current_time() < end:
                await trio.sleep(min(30.0, end - trio.current_time()))
                _say(opts, f"stress: soak {(time.monotonic_ns() - a) / 1e9:.0f}/"
                           f"{opts.soak_s:g} s")
            sample_rss(sup, rec, "soak")
            rec.phases.append(("soak", a, time.monotonic_ns()))

        phase[0] = "end"
        # Let the followers catch up, then look for leaks while everything still runs.
        await trio.sleep(0.3)
        await check_leaks(sup, rec)
        rec.reader_stats = {f"{ch}:{role}": dataclasses.asdict(r.stats)
                            for ch, rs in readers.items() for role, r in rs.items()}
        rec.statuses = {n: sup.runs[n].status for n in WORKERS if n in sup.runs}
        rec.t_end = time.monotonic_ns()
        nursery.cancel_scope.cancel()
    return sup


# ------------------------------------------------------------------ analysis

def _pct(a, q) -> float | None:
    return None if len(a) == 0 else float(np.percentile(np.asarray(a, float), q))


def _ms(ns) -> float | None:
    return None if ns is None else round(ns / 1e6, 3)


def _first_after(ts: np.ndarray, t: int) -> int | None:
    i = int(np.searchsorted(ts, t, side="right"))
    return None if i >= len(ts) else int(ts[i])


def analyse(rec: Record, events: list[dict], opts: Options) -> dict:
    frames_pub = np.array(sorted(f[0] for f in rec.frames), np.int64)
    outs_pub = np.array(sorted(o[0] for o in rec.outs), np.int64)
    cmds = sorted(rec.cmds)
    cmds_pub = np.array([c[0] for c in cmds], np.int64)
    ev = defaultdict(list)
    for e in events:
        if e.get("worker") in WORKERS:
            ev[(e["event"], e["worker"])].append(e)

    # -- restarts against kills
    killed_pids = defaultdict(list)
    for w, pid, t, dead in rec.kills:
        killed_pids[w].append(pid)
    accounting = {}
    problems = []
    for w in WORKERS:
        exits = ev[("exit", w)]
        restarts = ev[("restart", w)]
        by_pid = Counter(e["pid"] for e in exits)
        for pid in killed_pids[w]:
            mine = [e for e in exits if e["pid"] == pid]
            if len(mine) != 1:
                problems.append(f"{w} pid {pid}: {len(mine)} exit events")
            elif mine[0].get("signal") != "SIGKILL":
                problems.append(f"{w} pid {pid}: exit signal {mine[0].get('signal')} "
                                f"code {mine[0].get('code')}")
            elif not [r for r in restarts if r["mono_ns"] >= mine[0]["mono_ns"]]:
                problems.append(f"{w} pid {pid}: no restart after its exit")
        unexpected = [e for e in exits if e["pid"] not in killed_pids[w]]
        for e in unexpected:
            problems.append(f"{w} pid {e['pid']}: exit nobody caused: code {e.get('code')} "
                            f"signal {e.get('signal')} ({e.get('reason')})")
        accounting[w] = {"kills": len(killed_pids[w]), "exits": len(exits),
                         "exits_sigkill": sum(e.get("signal") == "SIGKILL" for e in exits),
                         "restarts": len(restarts),
                         "duplicate_exits": sum(n - 1 for n in by_pid.values() if n > 1)}
    gave_up = [e for e in events if e["event"] in ("gave_up", "fail_safe", "refused")]
    for e in gave_up:
        problems.append(f"{e['event']}: {e.get('worker')} {e.get('reason')}")

    # -- kill -> first output, kill -> ready
    first_out = {"camerad": frames_pub, "modeld": outs_pub, "controlsd": cmds_pub}
    k2o = defaultdict(list)
    k2r = defaultdict(list)
    k2d = defaultdict(list)
    for w, pid, t, dead in rec.kills:
        if dead is None:
            problems.append(f"{w} pid {pid}: its sandbox still ran 10 s after the kill")
            continue
        k2d[w].append(dead - t)
        # Output after every process of the old sandbox is gone: the new instance's.
        f = _first_after(first_out[w], dead)
        if f is not None:
            k2o[w].append(f - t)
        rd = [e["mono_ns"] for e in ev[("ready", w)] if e["mono_ns"] > t]
        if rd:
            k2r[w].append(min(rd) - t)
    kill_to_output = {w: {"n": len(k2o[w]), "p50_ms": _ms(_pct(k2o[w], 50)),
                          "max_ms": _ms(max(k2o[w]) if k2o[w] else None),
                          "kill_to_dead_p50_ms": _ms(_pct(k2d[w], 50)),
                          "kill_to_dead_max_ms": _ms(max(k2d[w]) if k2d[w] else None),
                          "kill_to_ready_p50_ms": _ms(_pct(k2r[w], 50)),
                          "kill_to_ready_max_ms": _ms(max(k2r[w]) if k2r[w] else None)}
                      for w in WORKERS}

    # -- engaged while the model was down
    down = []
    for w, pid, t, dead in rec.kills:
        if w not in ("modeld", "camerad"):
            continue
        died = dead if dead is not None else t
        rd = [e["mono_ns"] for e in ev[("ready", w)] if e["mono_ns"] > t]
        back = [x for x in (min(rd) if rd else None, _first_after(outs_pub, died))
                if x is not None]
        end = min(back) if back else rec.t_end
        down.append((w, died + int((opts.timeout_ms + opts.grace_ms) * 1e6), end))
    engaged_down = []
    checked_down = 0
    for w, a, b in down:
        for c in cmds:
            if a < c[0] < b:
                checked_down += 1
                if c[2] == 1:
                    engaged_down.append({"after_kill_of": w, "ms_into_window": _ms(c[0] - a),
                                         "cmd": c})
    # Independent of the kills: an engaged command needs a model output whose frame was
    # captured at most max-age (150 ms, + grace) before it, among those seen here.
    outs_by_pub = sorted(rec.outs)
    o_pub = np.array([o[0] for o in outs_by_pub], np.int64)
    o_cap = np.array([o[1] for o in outs_by_pub], np.int64)
    o_seq = [rec.out_seq.get(o[0], -1) for o in outs_by_pub]
    unsupported = unjudged = 0
    for c in cmds:
        if c[2] != 1:
            continue
        i = int(np.searchsorted(o_pub, c[0], side="right")) - 1
        if i < 0 or c[0] - o_cap[i] > (150.0 + opts.grace_ms) * 1e6:
            # Only where this observer saw the next output too: one it missed after
            # output i (lagging under load, it drops, or refuses as stale, what
            # controlsd took in time; full suite, once) may be the one that supports it.
            if 0 <= i < len(o_seq) - 1 and o_seq[i + 1] != o_seq[i] + 1:
                unjudged += 1
                continue
            unsupported += 1

    # -- writer blocks (camerad) outside its restarts
    period = 1e9 / opts.fps
    outages = []
    for w, pid, t, dead in rec.kills:
        if w == "camerad":
            f = _first_after(frames_pub, dead if dead is not None else t)
            outages.append((t - int(period), (f if f is not None else rec.t_end) + int(1e9)))

    def outside(a, b):
        return all(b <= x or a >= y for x, y in outages)

    gaps = np.diff(frames_pub)
    long_gaps = [int(g) for a, g in zip(frames_pub[:-1], gaps)
                 if g > 2.5 * period and outside(int(a), int(a + g))]
    windows = []
    if len(frames_pub):
        t = int(frames_pub[0])
        while t + 1e9 <= frames_pub[-1]:
            if outside(t, t + int(1e9)):
                windows.append(int(np.searchsorted(frames_pub, t + 1e9) -
                                   np.searchsorted(frames_pub, t)))
            t += int(1e9)
    low = [n for n in windows if n < 0.9 * opts.fps]

    # -- stalled reader: latency per phase kind
    lat = defaultdict(list)
    gap = defaultdict(list)
    stats_phase = {}
    for kind, a, b in rec.phases:
        if kind not in ("stalled", "unstalled"):
            continue
        for pub, cap, fid, v in rec.outs:
            if a <= cap < b:
                j = int(np.searchsorted(cmds_pub, pub, side="left"))
                if j < len(cmds_pub) and cmds_pub[j] - pub <= 50e6:
                    lat[kind].append((cmds_pub[j] - cap) / 1e6)
        sel = cmds_pub[(cmds_pub >= a) & (cmds_pub < b)]
        gap[kind].extend((np.diff(sel) / 1e6).tolist())
    for kind in ("unstalled", "stalled"):
        stats_phase[kind] = {"n": len(lat[kind]), "e2e_p50_ms": _pct(lat[kind], 50),
                             "e2e_p99_ms": _pct(lat[kind], 99),
                             "e2e_max_ms": max(lat[kind]) if lat[kind] else None,
                             "cmd_gap_p50_ms": _pct(gap[kind], 50),
                             "cmd_gap_p99_ms": _pct(gap[kind], 99)}
    ratio = None
    if stats_phase["unstalled"]["e2e_p99_ms"] and stats_phase["stalled"]["e2e_p99_ms"]:
        ratio = stats_phase["stalled"]["e2e_p99_ms"] / stats_phase["unstalled"]["e2e_p99_ms"]
    gap_ratio = None
    if stats_phase["unstalled"]["cmd_gap_p99_ms"] and stats_phase["stalled"]["cmd_gap_p99_ms"]:
        gap_ratio = (stats_phase["stalled"]["cmd_gap_p99_ms"]
                     / stats_phase["unstalled"]["cmd_gap_p99_ms"])
    stall_frames = {}
    for kind, a, b in rec.phases:
        if kind in ("stalled", "unstalled"):
            n = int(np.searchsorted(frames_pub, b) - np.searchsorted(frames_pub, a))
            stall_frames.setdefault(kind, []).append(round(n / ((b - a) / 1e9), 2))

    # -- memory
    memory = {}
    soak = [p for p in rec.phases if p[0] == "soak"]
    if soak:
        _, a, b = soak[0]
        span = min(60e9, (b - a) / 3)
        for name in (*WORKERS, "supervisor+stress"):
            rows = [r for r in rec.rss if r[1] == "soak" and r[2] == name]
            pids = sorted({r[3] for r in rows})
            first = [r for r in rows if r[0] <= a + span]
            last = [r for r in rows if r[0] >= b - span]
            if not first or not last:
                continue
            f_rss, l_rss = np.median([r[4] for r in first]), np.median([r[4] for r in last])
            f_anon, l_anon = np.median([r[5] for r in first]), np.median([r[5] for r in last])
            memory[name] = {"pids": pids, "window_s": round(span / 1e9, 1),
                            "rss_first_kb": int(f_rss), "rss_last_kb": int(l_rss),
                            "rss_growth_kb": int(l_rss - f_rss),
                            "anon_first_kb": int(f_anon), "anon_last_kb": int(l_anon),
                            "anon_growth_kb": int(l_anon - f_anon),
                            "rss_max_kb": max(r[4] for r in rows)}
    rss_all = {}
    for name in (*WORKERS, "supervisor+stress"):
        rows = [r for r in rec.rss if r[2] == name]
        if rows:
            rss_all[name] = {"rss_max_kb": max(r[4] for r in rows),
                             "anon_max_kb": max(r[5] for r in rows)}

    leaked_leases = sum(len(v["leases_leaked"]) for v in rec.leases.values())
    leaked_slots = sum(len(v["slots_leaked"]) for v in rec.leases.values())
    kills_phase = [p for p in rec.phases if p[0] == "kills"]
    return {
        "frames_seen": len(rec.frames), "model_outputs_seen": len(rec.outs),
        "commands_seen": len(cmds),
        "duration_s": round((rec.t_end - rec.t0) / 1e9, 1),
        "kill_phase_s": round((kills_phase[0][2] - kills_phase[0][1]) / 1e9, 1)
        if kills_phase else 0,
        "kills": dict(Counter(k[0] for k in rec.kills)), "kills_total": len(rec.kills),
        "recover_failures": len(rec.recover_failures),
        "torn_reads_accepted": sum(rec.torn.values()), "torn_by_check": dict(rec.torn),
        "torn_examples": rec.torn_examples,
        "torn_reads_detected_lease_lost": dict(rec.lease_lost),
        "rejected": dict(rec.rejected),
        "leases_leaked": leaked_leases, "slots_leaked": leaked_slots,
        "lease_tables": rec.leases, "fresh_reader_received": rec.fresh,
        "writer": {"gaps_over_2.5_periods": len(long_gaps),
                   "max_gap_ms": _ms(max(long_gaps)) if long_gaps else None,
                   "windows_1s": len(windows),
                   "windows_below_90pct": len(low),
                   "fps_min": min(windows) if windows else None,
                   "fps_p50": _pct(windows, 50)},
        "restart_accounting": accounting, "accounting_problems": problems,
        "engaged_while_model_down": len(engaged_down),
        "engaged_while_model_down_examples": engaged_down[:10],
        "commands_checked_while_model_down": checked_down,
        "engaged_without_fresh_model_seen": unsupported,
        "engaged_unjudged_observer_missed_outputs": unjudged,
        "kill_to_first_output": kill_to_output,
        "stall": {**stats_phase, "p99_ratio_stalled_unstalled": ratio,
                  "gap_p99_ratio_stalled_unstalled": gap_ratio,
                  "held_messages": Counter(f"{c}:{o}" for c, o in rec.stall_held),
                  "camera_fps_per_phase": stall_frames},
        "memory_soak": memory, "memory_max": rss_all,
        "reader_stats": rec.reader_stats, "worker_status": rec.statuses,
    }


# ------------------------------------------------------------------ reference check

def verify_outputs(rec: Record, opts: Options, limit: int) -> dict:
    """Re-run the signed artifact here on the synthetic frames the outputs claim to come
    from: bit-identical, or modeld accepted a frame that was not the camera's."""
    import models
    from supervisor.model import load_verified
    from workers.camerad.synthetic import SyntheticRoad
    from workers.modeld.engine import Engine

    outs = rec.outs
    if not outs or limit == 0:
        return {"verified": 0, "mismatches": 0}
    pick = set(range(len(outs))) if limit < 0 or limit >= len(outs) else set(
        np.linspace(0, len(outs) - 1, limit).astype(int).tolist())
    # ... and always the first outputs after each kill (the interesting ones).
    pubs = np.array([o[0] for o in outs], np.int64)
    for _, _, t, dead in rec.kills:
        i = int(np.searchsorted(pubs, dead if dead is not None else t))
        pick.update(range(i, min(i + 3, len(outs))))
    eng = Engine(load_verified(models.DEMO_ARTIFACT, models.DEMO_PUBKEY))
    road = SyntheticRoad(1928, 1208, seed=opts.seed, fps=opts.fps)
    cache: dict[int, bytes] = {}
    bad = []
    for i in sorted(pick):
        _, cap, fid, v = outs[i]
        if fid not in cache:
            y, _, _ = road.render(fid)
            want, _ = eng.infer(y, frame_id=fid, capture_ts_ns=cap)
            cache[fid] = np.asarray(want, np.float32).tobytes()
        if np.asarray(v, np.float32).tobytes() != cache[fid]:
            bad.append({"frame_id": fid, "got": v,
                        "want": np.frombuffer(cache[fid], np.float32).tolist()})
    return {"verified": len(pick), "mismatches": len(bad), "examples": bad[:5]}


def run(opts: Options) -> dict:
    """The whole stress run; returns the analysis (a JSON-able dict)."""
    state = tempfile.mkdtemp(prefix="trio-stress-state-")
    old = os.environ.get("TRIO_STATE_DIR")
    os.environ["TRIO_STATE_DIR"] = state      # never latch the machine's fail-safe
    stream = open(opts.events, "w") if opts.events else io.StringIO()
    log = EventLog(stream=stream)
    rec = Record()
    t0 = time.monotonic()
    try:
        sup = trio.run(_run, opts, rec, log)
    finally:
        if old is None:
            os.environ.pop("TRIO_STATE_DIR", None)
        else:
            os.environ["TRIO_STATE_DIR"] = old
        if opts.events:
            stream.close()
        shutil.rmtree(state, ignore_errors=True)
    res = analyse(rec, log.events, opts)
    res["exit_code"] = int(sup.exit_code)
    t = time.monotonic()
    res["reference"] = verify_outputs(rec, opts, opts.verify)
    res["reference"]["seconds"] = round(time.monotonic() - t, 1)
    res["torn_reads_accepted"] += res["reference"]["mismatches"]
    if res["reference"]["mismatches"]:
        res["torn_by_check"]["model_out_vs_reference"] = res["reference"]["mismatches"]
    res["wall_s"] = round(time.monotonic() - t0, 1)
    res["options"] = {k: v for k, v in vars(opts).items()}
    return res


def _f(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def summary(res: dict) -> str:
    o = res["options"]
    k2o = res["kill_to_first_output"]
    st = res["stall"]
    w = res["writer"]
    lines = [
        f"frames {res['frames_seen']} at {o['fps']:g} fps (1928x1208 NV12), "
        f"model outputs {res['model_outputs_seen']}, commands {res['commands_seen']}, "
        f"{res['duration_s']} s (kill phase {res['kill_phase_s']} s), seed {o['seed']}",
        f"kills {res['kills_total']} ("
        + ", ".join(f"{k} {v}" for k, v in sorted(res["kills"].items()))
        + f"), recovery failures {res['recover_failures']}",
        f"torn reads accepted {res['torn_reads_accepted']} (CRC + payload checks on every "
        f"model_out/control_cmd; {res['reference']['verified']} outputs re-computed, "
        f"{res['reference']['mismatches']} mismatches); detected (LeaseLost) "
        f"{sum(res['torn_reads_detected_lease_lost'].values())}",
        f"slots leaked {res['slots_leaked']}, leases leaked {res['leases_leaked']}, "
        f"fresh reader got {res['fresh_reader_received']}",
        f"writer blocks: gaps > 2.5 periods outside camerad restarts {w['gaps_over_2.5_periods']}"
        f" (max {_f(w['max_gap_ms'])} ms); 1 s windows {w['windows_1s']}, below 90 % of fps "
        f"{w['windows_below_90pct']}, min {w['fps_min']} fps, p50 {_f(w['fps_p50'], '{:g}')}",
        "restarts vs kills: " + "; ".join(
            f"{n}: {a['kills']} kills / {a['exits_sigkill']} SIGKILL exits of {a['exits']} / "
            f"{a['restarts']} restarts" for n, a in res["restart_accounting"].items())
        + f"; problems {len(res['accounting_problems'])}",
        f"engaged while model down (> {o['timeout_ms']:g}+{o['grace_ms']:g} ms after the kill, "
        f"before it was back): {res['engaged_while_model_down']} of "
        f"{res['commands_checked_while_model_down']} commands in those windows; engaged "
        f"without a model output captured <= 150 ms before: "
        f"{res['engaged_without_fresh_model_seen']} (not judged, this observer missed "
        f"the outputs around it: {res['engaged_unjudged_observer_missed_outputs']})",
        "kill -> first output p50/max ms: " + "; ".join(
            f"{n} {_f(v['p50_ms'], '{:.0f}')}/{_f(v['max_ms'], '{:.0f}')} "
            f"(ready {_f(v['kill_to_ready_p50_ms'], '{:.0f}')}/"
            f"{_f(v['kill_to_ready_max_ms'], '{:.0f}')}, sandbox gone "
            f"{_f(v['kill_to_dead_p50_ms'], '{:.1f}')}/{_f(v['kill_to_dead_max_ms'], '{:.1f}')})"
            for n, v in k2o.items()),
    ]
    if st["unstalled"]["n"] or st["stalled"]["n"]:
        u, s = st["unstalled"], st["stalled"]
        lines.append(
            f"stalled reader (road_frames + model_out, held per phase): camera->control "
            f"p50/p99 unstalled {_f(u['e2e_p50_ms'], '{:.2f}')}/{_f(u['e2e_p99_ms'], '{:.2f}')}"
            f" ms (n {u['n']}), stalled {_f(s['e2e_p50_ms'], '{:.2f}')}/"
            f"{_f(s['e2e_p99_ms'], '{:.2f}')} ms (n {s['n']}), p99 ratio "
            f"{_f(st['p99_ratio_stalled_unstalled'], '{:.2f}')}x; control_cmd gap p99 "
            f"{_f(u['cmd_gap_p99_ms'])}/{_f(s['cmd_gap_p99_ms'])} ms; held: "
            f"{dict(st['held_messages'])}")
    for name, m in res["memory_soak"].items():
        lines.append(f"soak memory {name}: VmRSS {m['rss_first_kb'] / 1024:.1f} -> "
                     f"{m['rss_last_kb'] / 1024:.1f} MiB ({m['rss_growth_kb']:+d} kB), RssAnon "
                     f"{m['anon_first_kb'] / 1024:.1f} -> {m['anon_last_kb'] / 1024:.1f} MiB "
                     f"({m['anon_growth_kb']:+d} kB), first vs last {m['window_s']:g} s")
    lines.append(f"wall {res['wall_s']} s (reference check {res['reference']['seconds']} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=10_000,
                    help="kill phase length in camera frames (0: no kills)")
    ap.add_argument("--fps", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-every", default="1.0,4.0",
                    help="min,max seconds between recovery and the next kill")
    ap.add_argument("--victims", default="",
                    help="comma-separated workers for the first kills (then random)")
    ap.add_argument("--max-kills", type=int, default=0, help="0: until --frames")
    ap.add_argument("--stall-s", type=float, default=24.0)
    ap.add_argument("--stall-phase-s", type=float, default=3.0)
    ap.add_argument("--soak-s", type=float, default=0.0)
    ap.add_argument("--rss-every-s", type=float, default=2.0)
    ap.add_argument("--timeout-ms", type=float, default=150.0)
    ap.add_argument("--grace-ms", type=float, default=10.0)
    ap.add_argument("--verify", type=int, default=-1,
                    help="model outputs to re-compute here (-1 all, 0 none)")
    ap.add_argument("--events", default=None, help="write the supervisor's events here")
    ap.add_argument("--json", default=None, help="write the full result here ('-': stdout)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    lo, hi = (float(x) for x in a.kill_every.split(","))
    victims = tuple(v for v in a.victims.split(",") if v)
    if set(victims) - set(WORKERS):
        ap.error(f"--victims: workers are {', '.join(WORKERS)}")
    opts = Options(frames=a.frames, fps=a.fps, seed=a.seed, kill_every=(lo, hi),
                   victims=victims, max_kills=a.max_kills,
                   stall_s=a.stall_s, stall_phase_s=a.stall_phase_s, soak_s=a.soak_s,
                   rss_every_s=a.rss_every_s, timeout_ms=a.timeout_ms, grace_ms=a.grace_ms,
                   verify=a.verify, events=a.events, progress=not a.quiet)
    res = run(opts)
    print(summary(res))
    if a.json:
        text = json.dumps(res, indent=1, default=str)
        if a.json == "-":
            print(text)
        else:
            Path(a.json).write_text(text)
    bad = (res["torn_reads_accepted"] or res["engaged_while_model_down"]
           or res["accounting_problems"] or res["slots_leaked"] or res["leases_leaked"]
           or res["recover_failures"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
