"""Two stop signals ~1 ms apart at a random moment of a `supervisor run`, N times:
how many ended in an ordered stop (exit 0, supervisor_exit last, no traceback).

    python bench/signal_race.py [--trials 100] [--max-delay-s 2.5] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

SMALL = """
[domains.control]
actuates = true
[channels.x]
slot_size = "4KiB"
[workers.a]
domain = "control"
module = "workers.probe"
publishes = ["x"]
args = ["--publish", "x"]
[workers.b]
domain = "control"
module = "workers.probe"
subscribes = ["x"]
args = ["--read", "x"]
"""


def trial(cfg: str, delay: float) -> tuple[bool, str]:
    p = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run", "--config", cfg,
                          "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    time.sleep(0.001)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    events = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
    ok = (p.returncode == 0 and "Traceback" not in err and bool(events)
          and events[-1]["event"] == "supervisor_exit" and events[-1]["reason"] == "shutdown")
    if not ok and not events and not err.strip() and p.returncode in (-2, -15):
        # The signal came while the interpreter itself was starting (before any line of
        # ours ran): the default action ended it; nothing had started, nothing printed.
        return ok, f"during interpreter start-up ({delay * 1000:.0f} ms): killed, nothing started"
    return ok, "" if ok else f"rc={p.returncode} last={events[-1] if events else None}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--max-delay-s", type=float, default=2.5)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    os.environ.setdefault("TRIO_STATE_DIR", tempfile.mkdtemp(prefix="trio-state-"))
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(SMALL)
    rng = random.Random(a.seed)
    passed, failures = 0, []
    for i in range(a.trials):
        ok, why = trial(f.name, rng.uniform(0.0, a.max_delay_s))
        passed += ok
        if not ok:
            failures.append((i, why))
    print(f"signal race: {passed}/{a.trials} ordered stops")
    for i, why in failures[:10]:
        print(f"  trial {i}: {why}")
    return 0 if passed == a.trials else 1


if __name__ == "__main__":
    sys.exit(main())
