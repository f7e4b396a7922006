"""Red team, round 5: the attacks whose attacker is a worker, run from inside a real
sandbox (``module = "workers.probe.attacks_redteam5"``, args ``--attack NAME`` and the
attack's own). tests/test_redteam_round5.py starts them through a real broker, as
`run --privsep` does.

* ``sparse_log`` (research, like the recorder): the worker owns a drive log's
  directory (the recorder's RUN/log or record OUT, an rw bind); it makes its own
  messages file sparse, ``--size`` bytes of apparent size and no new blocks on disk
  (ftruncate), for whoever reads the log next (the root replay or record, a developer).

Each attack prints one line ``ATTACK {json}``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable

from supervisor.worker import WorkerContext


def sparse_log(ctx: WorkerContext, a: argparse.Namespace) -> dict:
    before = os.stat(a.path)
    os.truncate(a.path, a.size)
    after = os.stat(a.path)
    return {"denied": False, "size": after.st_size, "blocks_before": before.st_blocks,
            "blocks_after": after.st_blocks}


ATTACKS: dict[str, Callable[[WorkerContext, argparse.Namespace], dict]] = {
    f.__name__: f for f in (sparse_log,)
}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workers.probe.attacks_redteam5")
    p.add_argument("--attack", required=True, choices=sorted(ATTACKS))
    p.add_argument("--path", default="")
    p.add_argument("--size", type=int, default=0)
    return p.parse_args(argv)


def main(ctx: WorkerContext) -> int:
    a = _args(sys.argv[1:])
    ctx.ready(status=f"redteam5 pid {os.getpid()}")
    try:
        res = ATTACKS[a.attack](ctx, a)
    except Exception as e:           # an attack that failed is reported, not hidden
        res = {"denied": True, "error": f"{type(e).__name__}: {e}"}
    print("ATTACK " + json.dumps({"attack": a.attack, **res}), flush=True)
    while True:
        ctx.watchdog()
        time.sleep(0.05)
