"""Sandboxed worker start-to-ready and crash-to-restarted times (targets 150 / 300 ms).

    python bench/lifecycle_bench.py [--crashes 10] [--privsep]

Runs the real CLI (`supervisor run`) on a config of probe workers in bubblewrap
sandboxes and reads the supervisor's own event lines:
  start-to-ready    = "start" (sandbox spawned) -> "ready" (worker sent READY=1)
  crash-to-restarted = "exit" (supervisor saw the crash) -> next "ready" of that worker,
                       with the configured backoff (reported separately) included.
--privsep: the same again with `supervisor run --privsep` (the broker starts every
sandbox, the supervisor proper runs unprivileged), before/after in one run.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

CONFIG = """
[domains.control]
failure_policy = "restart"
actuates = true
[channels.frames]
slot_size = "4MiB"
[workers.steady]
domain = "control"
module = "workers.probe"
publishes = ["frames"]
args = ["--publish", "frames"]
[workers.crashy]
domain = "control"
module = "workers.probe"
subscribes = ["frames"]
args = ["--read", "frames", "--exit-after-ms", "300"]
restart = "always"
backoff_initial_ms = {backoff}
backoff_max_ms = {backoff}
max_restarts = 1000
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def measure(crashes: int, backoff_ms: int, privsep: bool) -> tuple[list[float], list[float]]:
    """(start-to-ready ms of every READY, crash-to-restarted ms of crashy)."""
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(CONFIG.format(backoff=backoff_ms))
    argv = [sys.executable, "-m", "supervisor.cli", "run", *(["--privsep"] if privsep else []),
            "-c", f.name]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    events = []
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            if line.startswith("{"):
                e = json.loads(line)
                events.append(e)
                if sum(1 for x in events if x["event"] == "ready"
                       and x.get("worker") == "crashy") > crashes:
                    break
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        os.unlink(f.name)
    ready = [e["start_to_ready_ms"] for e in events if e["event"] == "ready"]
    restarts = []
    last_exit = None
    for e in events:
        if e.get("worker") != "crashy":
            continue
        if e["event"] == "exit":
            last_exit = e["mono_ns"]
        elif e["event"] == "ready" and last_exit is not None:
            restarts.append((e["mono_ns"] - last_exit) / 1e6)
            last_exit = None
    return ready, restarts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--crashes", type=int, default=10)
    ap.add_argument("--backoff-ms", type=int, default=10)
    ap.add_argument("--privsep", action="store_true",
                    help="also with `run --privsep` (before/after in one run)")
    a = ap.parse_args()
    for privsep in ((False, True) if a.privsep else (False,)):
        ready, restarts = measure(a.crashes, a.backoff_ms, privsep)
        via = " (privsep)" if privsep else ""
        print(f"sandboxed start-to-ready{via}   n={len(ready):3d}  p50 "
              f"{statistics.median(ready):7.1f} ms  p90 {pct(ready, 90):7.1f} ms  max "
              f"{max(ready):7.1f} ms   (target 150 ms)")
        if restarts:
            print(f"crash-to-restarted (ready){via} n={len(restarts):3d}  p50 "
                  f"{statistics.median(restarts):7.1f} ms  p90 {pct(restarts, 90):7.1f} ms  max "
                  f"{max(restarts):7.1f} ms   (target 300 ms; includes {a.backoff_ms} ms backoff)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
