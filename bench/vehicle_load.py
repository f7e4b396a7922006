"""The car-shaped pipeline under the real supervisor, for N seconds: what it holds.

    python bench/vehicle_load.py [--config FILE] [--seconds 60] [--warmup 5] [--json FILE]

Without --config: the embedded default (supervisor/default.toml), which is the car.

Runs the config with `supervisor.lifecycle.Supervisor` (the class `supervisor run` uses:
sandboxes, cgroups, admission, standbys), waits for every worker to be READY, lets it
settle ``--warmup`` s, then measures ``--seconds`` s. This process attaches one more
reader to every channel (the spare reader slot each channel has), each in its own thread
so that its CPU is kept apart from the supervisor's.

Printed (markdown tables, for bench/RESULTS.md):

* per channel: messages/s, the writer's sequence gaps this reader saw (its own misses,
  not the pipeline's), and the pipeline's drops: a frame no model output came from, a
  model output no command followed before the next output, a camera's skipped slots
  (camerad's own ``dropped=`` count), a command gap longer than two periods at 100 Hz;
* per hop p50/p99 (ms): capture -> frame publish (render), frame publish -> inference
  start (bridge hop, checks), model (receipt: input copy, kernels incl. preprocessing,
  output copy), inference end -> output publish, model_out publish -> next command;
* e2e p50/p99 per camera: capture -> command (road), capture -> driver_state (driver),
  capture -> publish (a frame channel no model reads), and for a further camera of a
  model the driving camera's (its frames are paired with those);
* CPU per worker (% of one CPU, from its cgroup's cpu.stat, standbys included in their
  worker's cgroup where they share it) and the supervisor's (this process's threads
  less the bench's reader threads), with the load average before and after; and per
  worker the time its threads were runnable but waiting for a CPU (schedstat, its
  current process tree): where that is large against its CPU, the worker's misses are
  the machine's contention, not its own cost;
* a model of several cameras (input ABI 3): per further camera, the capture skew to the
  driving camera's frame of the same id, its publish -> inference start, and its frames
  no output came from;
* the verdict: no drops on control channels and every control deadline met (model
  receipts' deadline misses, command gaps, watchdog misses, restarts, fail-safe).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from supervisor.config import load  # noqa: E402
from supervisor.events import EventLog  # noqa: E402
from supervisor.ipc import ChannelTimeout, Reader, Rejected  # noqa: E402
from supervisor.lifecycle import Supervisor  # noqa: E402

CMD_PERIOD_NS = 10_000_000          # controlsd --hz 100
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Seen:
    """What the bench's reader of one channel saw (publish-ordered)."""
    seq: list[int] = field(default_factory=list)
    pub: list[int] = field(default_factory=list)
    recv: list[int] = field(default_factory=list)
    frame: list[int] = field(default_factory=list)
    capture: list[int] = field(default_factory=list)
    receipts: list[object] = field(default_factory=list)
    rejected: int = 0


def follow(reader: Reader, seen: Seen, stop: threading.Event, tids: list[int]) -> None:
    """One channel's reader, in its own thread: stamps only, no pixel is touched."""
    tids.append(threading.get_native_id())
    while not stop.is_set():
        try:
            m = reader.receive(timeout=0.1)
        except ChannelTimeout:
            continue
        except Rejected:
            seen.rejected += 1
            continue
        with m:
            st = m.stamp
            seen.seq.append(m.sequence)
            seen.pub.append(st.publish_ts_ns)
            seen.recv.append(time.monotonic_ns())
            seen.frame.append(st.frame_id)
            seen.capture.append(st.capture_ts_ns)
            try:
                seen.receipts.append(m.receipt)
            except Rejected:
                seen.receipts.append(None)


def pct(xs, q=(50, 99)) -> tuple[float, ...]:
    if not len(xs):
        return tuple(float("nan") for _ in q)
    return tuple(float(np.percentile(np.asarray(xs, float), p)) for p in q)


def _cg_cpu_ns(run) -> int | None:
    """CPU of a worker's cgroup (all its processes) in ns, or None."""
    cg = getattr(run, "cgroup", None)
    for p in getattr(cg, "paths", ()) or ():
        try:
            with open(os.path.join(p, "cpu.stat")) as f:
                for line in f:
                    if line.startswith("usage_usec"):
                        return int(line.split()[1]) * 1000
        except OSError:
            pass
        try:
            with open(os.path.join(p, "cpuacct.usage")) as f:
                return int(f.read())
        except OSError:
            pass
    return None


def _proc_cpu_ns(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) * 1_000_000_000 // TICKS
    except (OSError, IndexError, ValueError):
        return 0


def _tree_cpu_ns(pid: int) -> int:
    """CPU of a process and its live descendants (bwrap, then the worker inside)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += _proc_cpu_ns(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return total


def _tree_wait_ns(pid: int) -> int:
    """Time the threads of a process and its live descendants spent runnable but not
    running (waiting for a CPU: /proc/PID/task/TID/schedstat's second field)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                try:
                    with open(f"/proc/{p}/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[1])
                    with open(f"/proc/{p}/task/{tid}/children") as f:
                        todo += [int(c) for c in f.read().split()]
                except (OSError, IndexError, ValueError):
                    pass
        except OSError:
            pass
    return total


def worker_wait(sup: Supervisor) -> dict[str, int]:
    """Per worker: run-queue wait of its current process tree (standbys not included)."""
    return {name: _tree_wait_ns(run.proc.pid) if getattr(run, "proc", None) is not None else 0
            for name, run in sup.runs.items()}


def worker_cpu(sup: Supervisor) -> dict[str, int]:
    """Per worker: its cgroup's CPU where cgroups are on, else its process tree's (the
    run's current process; a standby's own CPU is not in it then)."""
    out = {}
    for name, run in sup.runs.items():
        ns = _cg_cpu_ns(run)
        if ns is None and getattr(run, "proc", None) is not None:
            ns = _tree_cpu_ns(run.proc.pid)
        out[name] = ns or 0
    return out


def threads_cpu(exclude: set[int]) -> int:
    """CPU of this process (every thread it ever ran, exited ones included: trio's
    worker threads come and go) less that of the threads in ``exclude`` (the bench's
    readers, which live to the end)."""
    t = os.times()
    total = int((t.user + t.system) * 1e9)
    for tid in exclude:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
            total -= (int(parts[11]) + int(parts[12])) * 1_000_000_000 // TICKS
        except (OSError, IndexError, ValueError):
            pass
    return total


def _window(seen: Seen, t0: int, t1: int) -> list[int]:
    return [i for i, p in enumerate(seen.pub) if t0 <= p < t1]


def _next_after(ts: np.ndarray, t: int) -> int | None:
    i = int(np.searchsorted(ts, t, side="left"))
    return int(ts[i]) if i < len(ts) else None


def analyse(cfg, seen: dict[str, Seen], t0: int, t1: int, events: str) -> dict:
    chans = cfg.channels
    writers = {ch: w for w, wc in cfg.workers.items() for ch in wc.publishes}
    readers = defaultdict(list)
    for w, wc in cfg.workers.items():
        for ch in wc.subscribes:
            readers[ch].append(w)
    secs = (t1 - t0) / 1e9
    table, hops, e2e, drops = {}, {}, {}, {}
    # model outputs per frame channel: the channel a model worker reads -> what it writes;
    # a model of several cameras (input ABI 3): its further channels -> (the driving
    # channel, what it writes), paired by frame id
    model_of, partner_of = {}, {}
    for w, wc in cfg.workers.items():
        if wc.module == "workers.modeld":
            model_of[wc.subscribes[0]] = wc.publishes[0]
            for ch in wc.subscribes[1:]:
                partner_of[ch] = (wc.subscribes[0], wc.publishes[0])
    cmd_ts = np.array(sorted(seen["control_cmd"].pub)) if "control_cmd" in seen else np.array([])
    for name in sorted(seen):
        s = seen[name]
        idx = _window(s, t0, t1)
        seqs = [s.seq[i] for i in idx]
        gaps = sum(max(b - a - 1, 0) for a, b in zip(seqs, seqs[1:]))
        table[name] = {"writer": writers.get(name, "?"), "readers": readers.get(name, []),
                       "fps": len(idx) / secs, "messages": len(idx), "bench_missed": gaps,
                       "bench_rejected": s.rejected,
                       "bench_hop_us": pct([(s.recv[i] - s.pub[i]) / 1e3 for i in idx])}
    for frames_ch, out_ch in model_of.items():
        f, o = seen[frames_ch], seen[out_ch]
        fidx = _window(f, t0, t1 - 500_000_000)        # the last 0.5 s may still be in flight
        outs = {o.frame[i]: i for i in range(len(o.frame))}
        drops[frames_ch] = sum(1 for i in fidx if f.frame[i] not in outs)
        fpub = {f.frame[i]: (f.capture[i], f.pub[i]) for i in range(len(f.frame))}
        render, hop, model, post, tail, ee = [], [], [], [], [], []
        misses = []
        for i in _window(o, t0, t1 - 200_000_000):
            r = o.receipts[i]
            if r is None or o.frame[i] not in fpub:
                continue
            cap, fp = fpub[o.frame[i]]
            render.append((fp - cap) / 1e6)
            hop.append((r.infer_start_ns - fp) / 1e6)
            model.append(r.latency_ns / 1e6)
            post.append((o.pub[i] - r.infer_end_ns) / 1e6)
            misses.append(r.deadline_misses)
            if out_ch == "model_out" and len(cmd_ts):
                c = _next_after(cmd_ts, o.pub[i])
                if c is not None:
                    tail.append((c - o.pub[i]) / 1e6)
                    ee.append((c - cap) / 1e6)
            else:
                ee.append((o.pub[i] - cap) / 1e6)
        hops[frames_ch] = {"capture->publish": pct(render), "publish->infer start": pct(hop),
                           "model (receipt)": pct(model), "infer end->output publish": pct(post)}
        if tail:
            hops[frames_ch]["model_out->command"] = pct(tail)
        e2e[frames_ch] = {"to": "control_cmd" if out_ch == "model_out" else out_ch,
                          "ms": pct(ee), "deadline_misses": (max(misses) - min(misses)) if misses else 0}
    for ch, (drive, out_ch) in partner_of.items():
        # The wide camera: its frame of each output's id, how far its capture was from
        # the road frame's, when it was published against the inference start, and the
        # road frames not run for want of it (their outputs are missing: drops above).
        p, f, o = seen[ch], seen[drive], seen[out_ch]
        ppub = {p.frame[i]: (p.capture[i], p.pub[i]) for i in range(len(p.frame))}
        fcap = {f.frame[i]: f.capture[i] for i in range(len(f.frame))}
        outs = {o.frame[i] for i in range(len(o.frame))}
        pidx = _window(p, t0, t1 - 500_000_000)
        drops[ch] = sum(1 for i in pidx if p.frame[i] not in outs)
        skew, hop, render = [], [], []
        for i in _window(o, t0, t1 - 200_000_000):
            r, fid = o.receipts[i], o.frame[i]
            if r is None or fid not in ppub or fid not in fcap:
                continue
            cap, pub = ppub[fid]
            skew.append(abs(cap - fcap[fid]) / 1e6)
            render.append((pub - cap) / 1e6)
            hop.append((r.infer_start_ns - pub) / 1e6)
        hops[ch] = {"capture->publish": pct(render), "|capture - road capture|": pct(skew),
                    "publish->infer start": pct(hop)}
        e2e[ch] = {"to": f"{out_ch} (paired with {drive})", "ms": e2e[drive]["ms"],
                   "deadline_misses": 0}
    for name in seen:
        if chans[name].spec.kind == "frame" and name not in model_of and name not in partner_of:
            s = seen[name]
            idx = _window(s, t0, t1)
            e2e[name] = {"to": "publish (no consumer)",
                         "ms": pct([(s.pub[i] - s.capture[i]) / 1e6 for i in idx]),
                         "deadline_misses": 0}
    if "model_out" in seen and len(cmd_ts):
        o = seen["model_out"]
        idx = _window(o, t0, t1 - 200_000_000)
        unacted = 0
        for a, b in zip(idx, idx[1:]):
            c = _next_after(cmd_ts, o.pub[a])
            if c is None or c >= o.pub[b]:
                unacted += 1
        drops["model_out"] = unacted
        c = seen["control_cmd"]
        idx = _window(c, t0, t1)
        # Only between consecutive sequence numbers: where this reader missed a command,
        # the gap it sees is its own, not controlsd's.
        gaps = np.array([c.pub[j] - c.pub[i] for i, j in zip(idx, idx[1:])
                         if c.seq[j] == c.seq[i] + 1] or [0])
        drops["control_cmd"] = int((gaps > 2 * CMD_PERIOD_NS).sum())
        table["control_cmd"]["gap_ms_p50_p99_max"] = (*pct(gaps / 1e6), float(gaps.max() / 1e6))
    ev = [json.loads(ln) for ln in events.splitlines() if ln.startswith("{")]
    counts = defaultdict(int)
    for e in ev:
        if not t0 <= e.get("mono_ns", 0) < t1:        # start-up is not the window
            continue
        if e.get("event") in ("restart", "watchdog_missed", "fail_safe", "exit", "gave_up",
                              "standby_adopted", "ready_timeout", "protocol_error"):
            counts[f"{e['event']}:{e.get('worker', '')}"] += 1
    # camerad's cumulative dropped=, from its last status before the window and the
    # last in it (status lines come every few seconds: the window's edges are blurred)
    before, last = {}, {}
    for e in ev:
        if e.get("event") == "status" and str(e.get("worker", "")).startswith("camerad"):
            m = re.search(r"dropped=(\d+)", str(e.get("status", "")))
            if m:
                (before if e.get("mono_ns", 0) < t0 else last if e.get("mono_ns", 0) < t1
                 else {})[e["worker"]] = int(m.group(1))
    cam_dropped = {w: n - before.get(w, 0) for w, n in last.items()}
    return {"channels": table, "hops": hops, "e2e": e2e, "drops": drops, "events": dict(counts),
            "camera_dropped": cam_dropped}


class _Tee(io.StringIO):
    """Keeps every event; echoes the start-up and failure ones to stderr as they come."""
    SHOWN = ("ready", "all_ready", "restart", "exit", "ready_timeout", "fail_safe", "gave_up")

    def write(self, s: str) -> int:
        for ln in s.splitlines():
            if any(f'"event":"{e}"' in ln for e in self.SHOWN):
                print(ln[:300], file=sys.stderr, flush=True)
        return super().write(s)


async def _run(cfg, a, result: dict) -> None:
    events = _Tee()
    sup = Supervisor(cfg, log=EventLog(stream=events), status_out=None)
    stop = threading.Event()
    bench_tids: list[int] = []
    seen: dict[str, Seen] = {}
    async with trio.open_nursery() as nursery:
        t_start = time.monotonic()
        try:
            await nursery.start(sup.run)
        except RuntimeError:       # it stopped before all READY: say why, in its words
            for ln in events.getvalue().splitlines():
                e = json.loads(ln) if ln.startswith("{") else {}
                if e.get("level") in ("error", "warning"):
                    print(ln[:600], file=sys.stderr)
            raise SystemExit("vehicle_load: the supervisor stopped before every worker was READY")
        result["ready_s"] = time.monotonic() - t_start
        threads = []
        result["channels_at_ready"] = sorted(sup.channels)
        for name, ch in sup.channels.items():
            r = Reader(ch.reader_handle(ch.spec.max_readers - 1))
            seen[name] = Seen()
            t = threading.Thread(target=follow, args=(r, seen[name], stop, bench_tids),
                                 name=f"bench-{name}", daemon=True)
            t.start()
            threads.append(t)
        await trio.sleep(a.warmup)
        load0 = os.getloadavg()
        cpu0, sup0, t0 = worker_cpu(sup), threads_cpu(set(bench_tids)), time.monotonic_ns()
        wait0 = worker_wait(sup)
        await trio.sleep(a.seconds)
        cpu1, sup1, t1 = worker_cpu(sup), threads_cpu(set(bench_tids)), time.monotonic_ns()
        wait1 = worker_wait(sup)
        load1 = os.getloadavg()
        await trio.sleep(0.3)
        stop.set()
        for t in threads:
            await trio.to_thread.run_sync(t.join, 2.0)
        secs = (t1 - t0) / 1e9
        result["events_text"] = events.getvalue()
        if a.raw:       # what was seen, for analysing again without running again
            import pickle
            a.raw.write_bytes(pickle.dumps((seen, t0, t1, events.getvalue())))
        result.update(analyse(cfg, seen, t0, t1, events.getvalue()))
        # A worker restarted in the window has a new cgroup / process tree whose counters
        # start again from 0: its figure is not comparable, so it is None ("restarted").
        result["cpu_pct"] = {w: (cpu1[w] - cpu0.get(w, 0)) / 1e7 / secs
                             if cpu1[w] >= cpu0.get(w, 0) else None for w in cpu1}
        # A restarted worker's new tree starts from 0: clamp rather than report < 0.
        result["runq_wait_pct"] = {w: (wait1[w] - wait0.get(w, 0)) / 1e7 / secs
                                   if wait1[w] >= wait0.get(w, 0) else None for w in wait1}
        result["supervisor_cpu_pct"] = (sup1 - sup0) / 1e7 / secs
        result["restarted"] = sorted(w for w, p in result["cpu_pct"].items() if p is None)
        result["load"] = (load0[0], load1[0])
        result["seconds"] = secs
        nursery.cancel_scope.cancel()


def verdict(cfg, res: dict) -> list[str]:
    """Why the run does not hold the load (empty: it does)."""
    bad = []
    control = {n for n, c in cfg.channels.items() if not c.shadow}
    for ch, n in res["drops"].items():
        if ch in control and n:
            bad.append(f"{ch}: {n} dropped")
    for w, n in res["camera_dropped"].items():
        if n:
            bad.append(f"{w}: {n} camera slots skipped")
    for cam, e in res["e2e"].items():
        if e["deadline_misses"]:
            bad.append(f"{cam}: {e['deadline_misses']} model deadline misses")
    for k, n in res["events"].items():     # any restart, miss, exit or fail-safe
        bad.append(f"event {k} x{n}")
    return bad


def render(cfg, res: dict) -> str:
    f = lambda t: f"{t[0]:.2f} / {t[1]:.2f}"   # noqa: E731
    out = [f"{res['seconds']:.0f} s measured after {res['warmup']:.0f} s warm-up; all READY in "
           f"{res['ready_s']:.1f} s; load average {res['load'][0]:.2f} -> {res['load'][1]:.2f} "
           f"on {os.cpu_count()} CPUs", "",
           "| channel | writer -> readers | msg/s | pipeline drops | bench missed |",
           "|---|---|---|---|---|"]
    for name, c in res["channels"].items():
        out.append(f"| {name} | {c['writer']} -> {', '.join(c['readers']) or '-'} | "
                   f"{c['fps']:.2f} | {res['drops'].get(name, '-')} | {c['bench_missed']} |")
    if "gap_ms_p50_p99_max" in res["channels"].get("control_cmd", {}):
        g = res["channels"]["control_cmd"]["gap_ms_p50_p99_max"]
        out.append(f"\ncontrol_cmd interval p50/p99/max: {g[0]:.2f} / {g[1]:.2f} / {g[2]:.2f} ms "
                   f"(between consecutive commands; gaps > {2 * CMD_PERIOD_NS / 1e6:.0f} ms count as drops)")
    out += ["", "| camera | hop | p50 / p99 ms |", "|---|---|---|"]
    for cam, hs in res["hops"].items():
        for hop, t in hs.items():
            out.append(f"| {cam} | {hop} | {f(t)} |")
    out += ["", "| camera | e2e to | p50 / p99 ms | model deadline misses |", "|---|---|---|---|"]
    for cam, e in res["e2e"].items():
        out.append(f"| {cam} | {e['to']} | {f(e['ms'])} | {e['deadline_misses']} |")
    out += ["", "| worker | CPU % of one core | waiting for a CPU, % of the time |",
            "|---|---|---|"]
    waits = res.get("runq_wait_pct", {})
    def num(v) -> str:
        return "restarted" if v is None else f"{v:.1f}"

    for w, p in sorted(res["cpu_pct"].items()):
        out.append(f"| {w} | {num(p)} | {num(waits.get(w, float('nan')))} |")
    out.append(f"| supervisor (this process, less the bench's readers) | "
               f"{res['supervisor_cpu_pct']:.1f} | - |")
    if res["camera_dropped"]:
        out.append("\ncamera skipped slots in the window (camerad's dropped=): "
                   + ", ".join(f"{k}={v}" for k, v in sorted(res["camera_dropped"].items())))
    if res["events"]:
        out.append("events in the window: " + ", ".join(f"{k} x{v}" for k, v in sorted(res["events"].items())))
    bad = res["verdict"]
    out.append("\nverdict: " + ("HOLDS (no drops on control channels, every deadline met)"
                                if not bad else "DOES NOT HOLD: " + "; ".join(bad)))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="TOML config (default: the embedded one, the car)")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--raw", type=Path, default=None, help="also pickle what was seen here")
    a = ap.parse_args(argv)
    cfg = load(a.config)
    # Its own state dir: a bench run must never latch (or be stopped by) the vehicle's
    # fail-safe latch in the shared one.
    os.environ.setdefault("TRIO_STATE_DIR", tempfile.mkdtemp(prefix="vehicle-load-state-"))
    res: dict = {"config": cfg.source, "warmup": a.warmup}
    trio.run(_run, cfg, a, res)
    res["verdict"] = verdict(cfg, res)
    print(render(cfg, res))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1, default=str))
    return 0 if not res["verdict"] else 1


if __name__ == "__main__":
    sys.exit(main())
