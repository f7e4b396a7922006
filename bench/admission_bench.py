"""Static admission of a fleet, as `Supervisor.admit` runs it: a fresh walk per worker
(what every admission did before the cache), the walk cached in memory, and the next
supervisor process finding the walk on disk (TRIO_ADMISSION_CACHE).

    python bench/admission_bench.py [--config F] [--control 41] [--research 17] [--repeat 1]

Without --config the fleet is the attack fleet's shape (tests/test_attacks.py: 41
control and 17 research workers of `workers.probe`, the `src`/`sink` pair included).
Each mode runs in a fresh interpreter, so the first walk is cold (every source file
parsed), as in a supervisor that has just started; "disk" runs after "cached" wrote
its walk to a fresh directory. Prints one JSON line per mode:
first worker's admission, the rest's total and p50, and the whole fleet.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fleet(config: str | None, control: int, research: int) -> list[tuple[str, str, str | None, list[str] | None]]:
    """(name, profile, module, argv) per worker, in the config's order."""
    if config is None:
        return ([(f"c{i}", "control", "workers.probe", None) for i in range(control)]
                + [(f"r{i}", "research", "workers.probe", None) for i in range(research)])
    from supervisor.config import load

    cfg = load(config)
    return [(name, cfg.profile_of(name), w.module, None if w.module else list(w.command or ()))
            for name, w in cfg.workers.items()]


def _measure(mode: str, config: str | None, control: int, research: int) -> dict[str, object]:
    from supervisor.admission import check as admission

    fleet = _fleet(config, control, research)
    times: list[float] = []
    refused = 0
    for name, profile, module, argv in fleet:
        if mode == "per-worker":
            admission.clear_cache()
        t0 = time.perf_counter()
        report = admission.check_worker(name, profile, module, argv, sys.path)
        times.append(time.perf_counter() - t0)
        refused += not report.ok
    rest = times[1:] or [0.0]
    return {"mode": mode, "workers": len(fleet), "refused": refused,
            "first_s": round(times[0], 3), "rest_total_s": round(sum(rest), 3),
            "rest_p50_ms": round(statistics.median(rest) * 1e3, 2),
            "fleet_s": round(sum(times), 3), "walks": admission.CACHE_STATS.walks,
            "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config")
    ap.add_argument("--control", type=int, default=41)
    ap.add_argument("--research", type=int, default=17)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--mode", choices=("per-worker", "cached", "disk"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.mode:  # the child: one mode, fresh interpreter
        print(json.dumps(_measure(a.mode, a.config, a.control, a.research)))
        return
    for _ in range(a.repeat):
        with tempfile.TemporaryDirectory() as cache:
            for mode in ("per-worker", "cached", "disk"):
                cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode,
                       "--control", str(a.control), "--research", str(a.research)]
                if a.config:
                    cmd += ["--config", a.config]
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
                env.pop("TRIO_ADMISSION_CACHE", None)
                if mode != "per-worker":
                    env["TRIO_ADMISSION_CACHE"] = os.path.join(cache, "admission")
                out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO, env=env).stdout
                print(out.strip(), flush=True)

if __name__ == "__main__":
    main()
