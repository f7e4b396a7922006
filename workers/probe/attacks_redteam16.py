"""Red team round 16 workers (tests/test_redteam_round16.py, docs/redteam16.md).

`module = "workers.probe.attacks_redteam16"`, `args = [ROLE, ...]`. Each prints its
evidence as `RT16 {json}` lines on stdout, which the supervisor logs as `output` events
(stamped with the supervisor's CLOCK_MONOTONIC, which every sandbox shares).

    act     an actuation writer (role `out`, control_cmd) publishing every 2 ms,
            each command tagged with a number of this process's own (steer_rad): a
            reader tells which process wrote a message, across a standby's hand-over
    wedge   an actuation writer that publishes engaged=1 for N s (1.5), then wedges its
            main loop for ever while a thread goes on pinging the watchdog
    frozen  an actuation writer that publishes engaged=1 for N s, then the same command
            with the same capture time for ever, its main loop pinging
    model   a model_out writer (role `out`) walking through phases on its own clock:
            silent after READY (N s, 1.2), good, frozen (same capture time), good, future capture
            times, good, writer closed and reopened, silent
    spy     a control reader of several channels (roles `a`, `b`, `c`, `d`, `m`): what each
            message was, as compact lines (hand-overs, gaps, reasons per window)
    crash   research: READY, then exit 1 after 0.3 s, every time
    oom     research: READY, then touch more memory than its memory_max
"""
from __future__ import annotations

import json
import os
import random
import sys
import threading
import time

import numpy as np

from schemas.payloads import CONTROL_CMD
from supervisor.ipc import NextLoan


def _say(row: str, **data) -> None:
    print("RT16 " + json.dumps({"row": row, **data}), flush=True)


def act(ctx) -> int:
    tag = float(random.randint(1, 60000))     # exact in float32: who wrote a message
    w = ctx.writer("out")                       # a standby blocks here until adopted
    ctx.ready(status=f"rt16 act tag {tag:g}")
    _say("act", tag=tag, mono_ns=time.monotonic_ns())
    # As controlsd: the next slot always on loan (NextLoan), so a kill always leaves a
    # loan in flight, half written: the hand-over must never show it.
    out = NextLoan(w, CONTROL_CMD.shape, np.float32)
    n, next_ping = 0, 0
    while True:
        now = time.monotonic_ns()
        if now >= next_ping:
            ctx.watchdog()
            next_ping = now + 20_000_000
        n += 1
        a = out.array
        a[0] = tag
        a[1] = 1.0
        a[2] = 0.0
        a[3] = float(n % 4096)
        out.publish()
        time.sleep(0.002)


def wedge(ctx) -> int:
    w = ctx.writer("out")
    ctx.ready(status="rt16 wedge")
    cmd = np.array([0.01, 1.0, 0.0, 0.0], np.float32)    # engaged, reason OK
    # Long enough for the fleet's readers to start and see it engaged.
    until = time.monotonic() + (float(sys.argv[2]) if len(sys.argv) > 2 else 1.5)
    while time.monotonic() < until:
        ctx.watchdog()
        w.publish_array(cmd)
        time.sleep(0.01)

    def pinger() -> None:        # the only sign of life the supervisor asks for
        while True:
            ctx.watchdog()
            time.sleep(0.05)
    threading.Thread(target=pinger, daemon=True).start()
    _say("wedged", mono_ns=time.monotonic_ns())
    threading.Event().wait()     # the main loop never comes back
    return 0


def frozen(ctx) -> int:
    """An actuation writer whose law froze but whose loop goes on: for N s good commands
    (engaged, stamped with the step time), then the same command again every 10 ms with
    the capture time of its last step, pinging from the main loop all along. The
    sequence moves; the command is no younger."""
    w = ctx.writer("out")
    ctx.ready(status="rt16 frozen")
    cmd = np.array([0.02, 1.0, 0.0, 0.0], np.float32)
    until = time.monotonic() + (float(sys.argv[2]) if len(sys.argv) > 2 else 1.5)
    ts = time.monotonic_ns()
    while time.monotonic() < until:
        ctx.watchdog()
        ts = time.monotonic_ns()
        w.publish_array(cmd, frame_id=1, capture_ts_ns=ts)
        time.sleep(0.01)
    _say("frozen", mono_ns=time.monotonic_ns(), capture_ts_ns=ts)
    while True:
        ctx.watchdog()
        w.publish_array(cmd, frame_id=1, capture_ts_ns=ts)
        time.sleep(0.01)


PHASES = ("silent", "good", "frozen", "good2", "future", "good3", "reopen", "quiet")
PHASE_S = 1.2


def model(ctx) -> int:
    from supervisor.ipc import Writer, WriterHandle

    w = ctx.writer("out")
    ctx.ready(status="rt16 model")
    out = np.array([0.05, 0.0, 0.9, 0.0], np.float32)   # small offset, confident
    frozen_ts = None
    fid = 0
    for phase in PHASES:
        _say("phase", phase=phase, mono_ns=time.monotonic_ns(), seq=w.last_sequence)
        if phase == "reopen":
            # The worker's own writer closed and a new one made on the same handle (a
            # library re-initialised, a reconnect path): what do its readers see?
            before = w.last_sequence
            w.close()
            w = Writer(WriterHandle.from_json(ctx._handle_json("out")), domain=ctx.domain,
                       seal=False)
            _say("reopened", before=before, after=w.last_sequence,
                 mono_ns=time.monotonic_ns())
        # The first phase lasts until the readers are up (`model SILENT_S`).
        until = time.monotonic() + (PHASE_S if phase != "silent" or len(sys.argv) < 3
                                    else float(sys.argv[2]))
        while time.monotonic() < until:
            ctx.watchdog()
            now = time.monotonic_ns()
            if phase not in ("silent", "quiet"):
                fid += 1
                if phase == "frozen":
                    ts = frozen_ts                     # the same instant, again and again
                elif phase == "future":
                    ts = now + 1_000_000_000           # a second ahead
                else:
                    ts = frozen_ts = now
                w.publish_array(out, frame_id=fid, capture_ts_ns=ts)
            time.sleep(0.02)
    _say("phase", phase="end", mono_ns=time.monotonic_ns(), seq=w.last_sequence)
    while True:
        ctx.watchdog()
        time.sleep(0.05)


def spy(ctx) -> int:
    """Reads every bound role. Per command channel: each change of writer tag (`a`),
    the reasons seen per 100 ms window (`b`, `c`), sequence regressions (all)."""
    from supervisor.ipc import Rejected

    roles = [r for r in ("a", "b", "c", "d", "m") if ctx.has(r)]
    readers = {r: ctx.reader(r) for r in roles}
    ctx.ready(status="rt16 spy")
    last_seq = dict.fromkeys(roles, 0)
    rejected: dict[str, dict[str, int]] = {r: {} for r in roles}
    # role a: the hand-over's evidence
    tag = None
    retired: set[float] = set()
    last_pub = None           # publish time of the last non-SAFE message of `tag`
    safe_since_switch = 0
    gap_max, gap_t0 = 0.0, time.monotonic()
    # windows for b, c: reasons and engaged flags seen
    win: dict[str, list] = {r: [] for r in roles}
    win_t0 = time.monotonic_ns()
    newest: dict[str, tuple] = {}
    next_ping = 0
    while True:
        now = time.monotonic_ns()
        if now >= next_ping:
            ctx.watchdog()
            next_ping = now + 20_000_000
        for r, rd in readers.items():
            for _ in range(256):
                try:
                    m = rd.try_receive()
                except Rejected as e:
                    rejected[r][e.reason] = rejected[r].get(e.reason, 0) + 1
                    continue
                if m is None:
                    break
                with m:
                    st = m.stamp
                    vals = m.tolist()
                seq, pub = st.sequence, st.publish_ts_ns
                if seq <= last_seq[r]:
                    _say("regress", role=r, seq=seq, last=last_seq[r])
                last_seq[r] = seq
                newest[r] = (seq, pub, vals)
                if r == "a":
                    t, reason = vals[0], int(vals[2])
                    # The supervisor's word: FAIL_SAFE (10), or WRITER_LOST (14)
                    # where the payload has a `lost` value (a writer that died).
                    if reason in (10, 14):
                        safe_since_switch += 1
                        _say("safe", seq=seq, pub=pub, after=tag, reason=reason, since_ms=None
                             if last_pub is None else (pub - last_pub) / 1e6)
                        continue
                    if t in retired:
                        _say("old_after_new", seq=seq, tag=t, current=tag, pub=pub)
                    elif t != tag:
                        if tag is not None:
                            retired.add(tag)
                        _say("switch", old=tag, new=t, seq=seq, pub=pub,
                             gap_ms=None if last_pub is None else (pub - last_pub) / 1e6,
                             safe_between=safe_since_switch)
                        tag, safe_since_switch = t, 0
                    elif last_pub is not None:
                        gap_max = max(gap_max, (pub - last_pub) / 1e6)
                    last_pub = pub
                elif r in ("b", "c", "d"):
                    win[r].append((int(vals[2]), int(vals[1])))
                else:
                    win[r].append((seq, st.capture_ts_ns))
        if time.monotonic() - gap_t0 >= 0.5 and "a" in readers:
            _say("gaps", max_ms=round(gap_max, 2), mono_ns=time.monotonic_ns())
            gap_max, gap_t0 = 0.0, time.monotonic()
        now = time.monotonic_ns()
        if now - win_t0 >= 100_000_000:
            for r in ("b", "c", "d"):
                if r in readers:
                    got = win[r]
                    age = None
                    if r in newest:
                        age = round((now - newest[r][1]) / 1e6, 1)
                    _say("win", role=r, t0=win_t0, t1=now,
                         reasons=sorted({x for x, _ in got}),
                         engaged=sorted({e for _, e in got}), n=len(got),
                         newest=None if r not in newest else [round(v, 4) for v in newest[r][2]],
                         newest_age_ms=age, rejected=rejected[r])
                    win[r] = []
            if "m" in readers:
                _say("mwin", t1=now, n=len(win["m"]), rejected=rejected["m"],
                     seqs=[s for s, _ in win["m"]][:1] + [s for s, _ in win["m"]][-1:])
                win["m"] = []
            win_t0 = now
        time.sleep(0.001)


def crash(ctx) -> int:
    ctx.ready(status="rt16 crash")
    time.sleep(0.3)
    return 1


def oom(ctx) -> int:
    ctx.ready(status="rt16 oom")
    blobs = []
    while True:                     # 16 MiB at a time, every page touched
        blobs.append(np.ones(16 << 20, np.uint8))
        time.sleep(0.01)


def main(ctx) -> int:
    return {"act": act, "wedge": wedge, "frozen": frozen, "model": model, "spy": spy,
            "crash": crash, "oom": oom}[sys.argv[1]](ctx)
