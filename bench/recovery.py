"""Kill -9 to first output again, per worker: cold restart against a warm standby,
side by side in one run.

    python bench/recovery.py [--kills 5] [--workers camerad,modeld,controlsd] [--json]
                             [--privsep]

The real pipeline (camerad -> modeld -> controlsd, sandboxed) runs in this process's
supervisor; each kill is SIGKILL of the worker's sandbox; the clock stops at the first
message its output channel carries afterwards (road_frames / model_out / control_cmd).

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


async def _measure(warm: bool, workers: list[str], kills: int,
                   privsep: bool = False) -> dict[str, list[float]]:
    cfg = _config(warm)
    log = EventLog(stream=io.StringIO())
    client = None
    if privsep:
        from supervisor.broker import BrokerClient
        from supervisor.lifecycle import BrokerLatch, BrokerLauncher

        path = Path(tempfile.mkdtemp(prefix="recovery-")) / "recovery.toml"
        path.write_text(_config_text(warm))
        state = Path(os.environ["TRIO_STATE_DIR"])
        client = BrokerClient.spawn(state_dir=state, config=path, stderr=subprocess.DEVNULL)
        sup = Supervisor(cfg, log=log, launcher=BrokerLauncher(client),
                         latch=BrokerLatch(client, state / "failsafe.latch"))
    else:
        sup = Supervisor(cfg, log=log)
    res: dict[str, list[float]] = {w: [] for w in workers}
    try:
        await _kills(sup, cfg, warm, workers, kills, res)
    finally:
        if client is not None:
            client.close()
    return res


async def _kills(sup, cfg, warm: bool, workers: list[str], kills: int,
                 res: dict[str, list[float]]) -> None:
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
                os.kill(pid, signal.SIGKILL)
                with trio.fail_after(60):
                    while True:
                        await _arrival(r)
                        if sup.runs[w].pid != pid:
                            break
                res[w].append((time.monotonic() - t0) * 1000)
        nursery.cancel_scope.cancel()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--workers", default="camerad,modeld,controlsd")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--privsep", action="store_true",
                    help="also through the broker (before/after in one run)")
    a = ap.parse_args()
    os.environ.setdefault("TRIO_STATE_DIR", tempfile.mkdtemp(prefix="trio-state-"))
    workers = a.workers.split(",")
    out = {}
    for via in (("direct", "privsep") if a.privsep else ("direct",)):
        for mode in ("cold", "warm"):
            key = mode if via == "direct" else f"{mode} privsep"
            out[key] = trio.run(_measure, mode == "warm", workers, a.kills, via == "privsep")
    if a.json:
        print(json.dumps(out))
        return 0
    print("| worker | cold p50 / max (ms) | warm standby p50 / max (ms) | p50 ratio |")
    print("|---|---:|---:|---:|")
    for w in workers:
        for via in ("", " privsep"):
            if f"cold{via}" not in out:
                continue
            c, h = out[f"cold{via}"][w], out[f"warm{via}"][w]
            print(f"| {w}{via} | {statistics.median(c):.0f} / {max(c):.0f} | "
                  f"{statistics.median(h):.0f} / {max(h):.0f} | "
                  f"{statistics.median(c) / statistics.median(h):.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
