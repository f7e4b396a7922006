"""Kill -9 to first output again, per worker: cold restart against a warm standby,
side by side in one run.

    python bench/recovery.py [--kills 5] [--workers camerad,modeld,controlsd] [--json]
                             [--privsep]

The real pipeline (camerad -> modeld -> controlsd, sandboxed) runs in this process's
supervisor; each kill is SIGKILL of the worker's sandbox; the clock stops at the first
message its output channel carries afterwards (road_frames / model_out / control_cmd).

--trace: for each warm kill, a timeline (ms after the kill) of the supervisor's events
and, under --privsep, of every broker request (from the call to its reply, with the
time spent waiting for the client's lock), printed to stderr: where the recovery's
milliseconds go.

--privsep: the same, once more with every sandbox started, signalled, listed and reaped
by the privileged broker (issue 27; `BrokerClient.spawn` and the lifecycle's
BrokerLauncher, as `supervisor run --privsep` does; this bench process keeps root, the
requests and their round trips are the same), before/after in one run.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from supervisor.config import derive, dumps, loads, minimal_doc  # noqa: E402
from supervisor.events import EventLog  # noqa: E402
from supervisor.ipc import LeaseLost, Reader, Rejected  # noqa: E402
from supervisor.lifecycle import Supervisor  # noqa: E402

PIPE = ("camerad", "modeld", "controlsd")


def _config_text(warm: bool) -> str:
    """The vehicle's own control pipeline (the one-camera config without research),
    each worker restarting freely so repeated kills are measured, not capped; the
    standby on (as on the vehicle) or off (the cold path)."""
    return dumps(derive(minimal_doc(), drop=("workers.research", "channels.shadow_out"),
                        set={"domains.control.failure_policy": "restart",
                             **{f"workers.{w}.{k}": v for w in PIPE for k, v in (
                                 ("restart", "always"), ("max_restarts", 100),
                                 ("backoff_initial_ms", 100), ("warm_standby", warm))}}))


def _config(warm: bool):
    return loads(_config_text(warm), f"recovery ({'warm' if warm else 'cold'}, one-camera config)")
OUT = {"camerad": "road_frames", "modeld": "model_out", "controlsd": "control_cmd"}


def _drain(r: Reader) -> None:
    """Receive and release whatever is there (the timing starts from an empty ring)."""
    while True:
        try:
            m = r.try_receive()
        except Rejected:
            continue
        if m is None:
            return
        try:
            m.release()
        except LeaseLost:       # reused while we held it: nothing of it was read
            pass


async def _arrival(r: Reader) -> None:
    """The next message arrived. Only its arrival is timed, its content is never read:
    under load this task may hold it past its lease, and the writer reusing the slot
    (LeaseLost on release) does not undo the arrival (it ended the bench, issue 22)."""
    while True:
        try:
            m = await r.receive_async()
        except Rejected:        # stale leftovers of the dead instance
            continue
        try:
            m.release()
        except LeaseLost:
            pass
        return


class _Trace:
    """Timestamps (time.monotonic) of broker calls and supervisor events around kills."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float, float, str, str]] = []
        self.kills: list[tuple[str, float, float]] = []     # worker, t0, t_arrival

    def wrap(self, client) -> None:
        import threading

        from supervisor.broker import _protocol as P

        real, lock = client.call, client._send_lock

        class TimedLock:
            """The client's lock, noting how long each acquire waited."""

            def __enter__(self_) -> None:
                t = time.monotonic()
                lock.acquire()
                threading.current_thread()._trace_wait = time.monotonic() - t

            def __exit__(self_, *a) -> None:
                lock.release()

        client._send_lock = TimedLock()

        def call(req, fds=()):
            t = time.monotonic()
            try:
                return real(req, fds)
            finally:
                th = threading.current_thread()
                where = "loop" if th is threading.main_thread() else "thread"
                self.calls.append((t, time.monotonic(), getattr(th, "_trace_wait", 0.0),
                                   P.kind_of(req), where))

        client.call = call

    def report(self, log_text: str, mode: str) -> None:
        events = [json.loads(ln) for ln in log_text.splitlines() if ln.startswith("{")]
        for w, t0, t1 in self.kills:
            print(f"--- {mode}: {w} killed, first output at {(t1 - t0) * 1e3:.1f} ms",
                  file=sys.stderr)
            rows = [((e["mono_ns"] / 1e9 - t0) * 1e3, f"event {e['event']} "
                     f"{e.get('worker', '')}") for e in events
                    if t0 - 0.001 <= e["mono_ns"] / 1e9 <= t1 + 0.02]
            rows += [((a - t0) * 1e3, f"broker {k:<12} {(b - a) * 1e3:6.1f} ms "
                      f"(lock wait {wait * 1e3:.1f}) [{where}]")
                     for a, b, wait, k, where in self.calls if t0 <= a <= t1 + 0.02]
            for at, what in sorted(rows):
                print(f"  {at:7.1f}  {what}", file=sys.stderr)


async def _measure(warm: bool, workers: list[str], kills: int,
                   privsep: bool = False, trace: bool = False) -> dict[str, list[float]]:
    cfg = _config(warm)
    log = EventLog(stream=io.StringIO())
    tr = _Trace() if trace and warm else None
    client = None
    if privsep:
        from supervisor.broker import BrokerClient
        from supervisor.lifecycle import BrokerLatch, BrokerLauncher

        path = Path(tempfile.mkdtemp(prefix="recovery-")) / "recovery.toml"
        path.write_text(_config_text(warm))
        state = Path(os.environ["TRIO_STATE_DIR"])
        client = BrokerClient.spawn(state_dir=state, config=path, stderr=subprocess.DEVNULL)
        if tr is not None:
            tr.wrap(client)
        sup = Supervisor(cfg, log=log, launcher=BrokerLauncher(client),
                         latch=BrokerLatch(client, state / "failsafe.latch"))
    else:
        sup = Supervisor(cfg, log=log)
    res: dict[str, list[float]] = {w: [] for w in workers}
    try:
        await _kills(sup, cfg, warm, workers, kills, res, tr)
    finally:
        if client is not None:
            client.close()
    if tr is not None:
        tr.report(log.stream.getvalue() if hasattr(log, "stream") else "",
                  "privsep" if privsep else "direct")
    return res


async def _kills(sup, cfg, warm: bool, workers: list[str], kills: int,
                 res: dict[str, list[float]], tr: _Trace | None = None) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        readers = {ch: Reader(sup.channels[ch].reader_handle(len(cfg.readers_of(ch))))
                   for ch in OUT.values()}
        for w in workers:
            for _ in range(kills):
                if warm:   # the standby of the last restart must be up again
                    with trio.fail_after(60):
                        while sup.runs[w].standby is None or not sup.runs[w].standby.warm:
                            await trio.sleep(0.05)
                    await trio.sleep(0.5)
                else:
                    await trio.sleep(1.0)
                r = readers[OUT[w]]
                _drain(r)
                pid = sup.runs[w].pid
                t0 = time.monotonic()
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    # The run died on its own meanwhile: what the supervisor said, then out.
                    text = sup.log.stream.getvalue().splitlines()[-25:]
                    raise SystemExit(f"{w} (pid {pid}) was gone before the kill; last "
                                     "events:\n" + "\n".join(text)) from None
                with trio.fail_after(60):
                    while True:
                        await _arrival(r)
                        if sup.runs[w].pid != pid:
                            break
                res[w].append((time.monotonic() - t0) * 1000)
                if tr is not None:
                    tr.kills.append((w, t0, t0 + res[w][-1] / 1000))
        nursery.cancel_scope.cancel()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--workers", default="camerad,modeld,controlsd")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--privsep", action="store_true",
                    help="also through the broker (before/after in one run)")
    ap.add_argument("--modes", default="cold,warm", help="cold,warm or one of them")
    ap.add_argument("--trace", action="store_true",
                    help="a timeline of each warm kill on stderr (events, broker calls)")
    a = ap.parse_args()
    os.environ.setdefault("TRIO_STATE_DIR", tempfile.mkdtemp(prefix="trio-state-"))
    workers = a.workers.split(",")
    out = {}
    for via in (("direct", "privsep") if a.privsep else ("direct",)):
        for mode in a.modes.split(","):
            key = mode if via == "direct" else f"{mode} privsep"
            out[key] = trio.run(_measure, mode == "warm", workers, a.kills, via == "privsep",
                                a.trace)
    if a.json:
        print(json.dumps(out))
        return 0
    print("| worker | cold p50 / max (ms) | warm standby p50 / max (ms) | p50 ratio |")
    print("|---|---:|---:|---:|")
    for w in workers:
        for via in ("", " privsep"):
            c, h = out.get(f"cold{via}", {}).get(w), out.get(f"warm{via}", {}).get(w)
            if not c and not h:
                continue
            cs = f"{statistics.median(c):.0f} / {max(c):.0f}" if c else "-"
            hs = f"{statistics.median(h):.0f} / {max(h):.0f}" if h else "-"
            ratio = f"{statistics.median(c) / statistics.median(h):.1f}x" if c and h else "-"
            print(f"| {w}{via} | {cs} | {hs} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
