"""A configurable worker for exercising the supervisor: readiness, crashes, watchdog
misses, channel traffic, forbidden imports. Used by tests/ and bench/, never shipped in
a vehicle config.

    args: --ready-delay-ms N   --exit-after-ms N --exit-code C   --ping-ms N
          --stop-pinging-after-ms N   --publish CH --period-ms N [--announce] [--loan-ahead]
          --read CH
          --import MODULE (after ready)   --map-file PATH (after ready)
          --attack NAME [--attack-before-ready]   (workers/probe/attacks.py)
          --write-file PATH (after ready; the result is logged)
          --exec PATH (after ready: run it, log its exit status)
"""
from __future__ import annotations

import argparse
import importlib
import mmap
import os
import sys
import time

import numpy as np

from supervisor.ipc import NextLoan
from supervisor.worker import WorkerContext


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workers.probe")
    p.add_argument("--ready-delay-ms", type=int, default=0)
    p.add_argument("--exit-after-ms", type=int, default=-1)
    p.add_argument("--exit-code", type=int, default=1)
    p.add_argument("--ping-ms", type=int, default=50)
    p.add_argument("--stop-pinging-after-ms", type=int, default=-1)
    p.add_argument("--publish", action="append", default=[])
    p.add_argument("--read", action="append", default=[])
    p.add_argument("--period-ms", type=int, default=20)
    p.add_argument("--announce", action="store_true",
                   help="announce each next publish (Writer.announce)")
    p.add_argument("--loan-ahead", action="store_true",
                   help="publish through NextLoan (the next slot loaned ahead)")
    p.add_argument("--import", dest="import_", default=None)
    p.add_argument("--map-file", default=None)
    p.add_argument("--alloc-mb", type=int, default=0, help="after ready: allocate this much")
    p.add_argument("--open-files", type=int, default=0, help="after ready: open this many fds")
    p.add_argument("--attack", action="append", default=[], help="see workers/probe/attacks.py")
    p.add_argument("--attack-before-ready", action="store_true")
    p.add_argument("--attack-arg", default="")
    p.add_argument("--write-file", default=None, help="after ready: create PATH and write it")
    p.add_argument("--exec", dest="exec_", default=None, help="after ready: run PATH")
    return p.parse_args(argv)


def _attack(ctx: WorkerContext, names: list[str]) -> None:
    import json

    from . import attacks

    for name in names:
        try:
            res = attacks.ATTACKS[name](ctx)
        except Exception as e:     # an attack that crashed is reported, not hidden
            res = {"denied": None, "crashed": f"{type(e).__name__}: {e}"}
        print("ATTACK " + json.dumps({"attack": name, **res}), flush=True)


def main(ctx: WorkerContext) -> int:
    a = _args(sys.argv[1:])
    writers = {ch: ctx.writer(ch) for ch in a.publish}
    readers = {ch: ctx.reader(ch) for ch in a.read}
    ahead = {ch: NextLoan(w, 4, w.spec.np_dtype) for ch, w in writers.items()
             if a.loan_ahead}
    if a.ready_delay_ms:
        time.sleep(a.ready_delay_ms / 1000)
    if a.attack:
        from . import attacks

        attacks.ARG = a.attack_arg
    if a.attack_before_ready:
        _attack(ctx, a.attack)
    ctx.ready(status=f"probe pid {os.getpid()}")
    print(f"probe {ctx.name}: ready", flush=True)
    if a.attack and not a.attack_before_ready:
        _attack(ctx, a.attack)
    if a.import_:
        try:
            importlib.import_module(a.import_)
            print(f"probe {ctx.name}: imported {a.import_}", flush=True)
        except ImportError as e:
            print(f"probe {ctx.name}: ImportError: {e}", flush=True)
            return 7
    if a.write_file:
        try:
            with open(a.write_file, "w") as f:
                f.write(ctx.name)
            ctx.log("write", path=a.write_file, result="ok")
        except OSError as e:
            ctx.log("write", path=a.write_file, result=f"errno:{e.errno}")
    if a.exec_:
        import subprocess

        try:
            rc = subprocess.run([a.exec_], timeout=10).returncode
            ctx.log("exec", path=a.exec_, result=f"exit:{rc}")
        except OSError as e:
            ctx.log("exec", path=a.exec_, result=f"errno:{e.errno}")
    if a.alloc_mb:
        try:
            blob = np.ones(a.alloc_mb << 20, np.uint8)
            print(f"probe {ctx.name}: allocated {blob.nbytes >> 20} MiB", flush=True)
        except MemoryError:
            print(f"probe {ctx.name}: MemoryError at {a.alloc_mb} MiB", flush=True)
            return 8
    if a.open_files:
        fds = []
        try:
            for _ in range(a.open_files):
                fds.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as e:
            print(f"probe {ctx.name}: {e.strerror} after {len(fds)} fds", flush=True)
            return 9
    kept = None
    if a.map_file:
        with open(a.map_file, "rb") as f:
            kept = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        print(f"probe {ctx.name}: mapped {a.map_file}", flush=True)
    t0 = time.monotonic()
    n = 0
    while True:
        ms = (time.monotonic() - t0) * 1000
        if 0 <= a.exit_after_ms <= ms:
            print(f"probe {ctx.name}: exiting with {a.exit_code}", flush=True)
            return a.exit_code
        if a.stop_pinging_after_ms < 0 or ms < a.stop_pinging_after_ms:
            ctx.watchdog()
        for ch, w in writers.items():
            n += 1
            if ch in ahead:
                ahead[ch].array[:] = n % 100
                ahead[ch].publish()
            else:
                w.publish_array(np.full(4, n % 100, w.spec.np_dtype))
            if a.announce:
                w.announce(time.monotonic_ns() + min(a.ping_ms, a.period_ms) * 1_000_000)
        for r in readers.values():
            while (m := r.try_receive()) is not None:
                m.release()
        time.sleep(min(a.ping_ms, a.period_ms) / 1000)
    del kept
