"""Red team, round 5: the attacks whose attacker is a worker, run from inside a real
sandbox (``module = "workers.probe.attacks_redteam5"``, args ``--attack NAME`` and the
attack's own). tests/test_redteam_round5.py starts them through a real broker, as
`run --privsep` does.

* ``sparse_log`` (research, like the recorder): the worker owns a drive log's
  directory (the recorder's RUN/log or record OUT, an rw bind); it makes its own
  messages file sparse, ``--size`` bytes of apparent size and no new blocks on disk
  (ftruncate), for whoever reads the log next (the root replay or record, a developer).

* ``lastword_bound`` (control, the actuation writer): engaged commands until a reader
  has consumed one (its position in its lease table, which every writer maps
  read-only), then its own header's ``last_seq`` set to ``SEQ_HONEST - 1`` (below the
  bound a restarted writer still continues), and it dies (exit 1): the supervisor's
  SAFE follows (round 4's ``honest_reader`` says whether it heard it).

Each attack prints one line ``ATTACK {json}``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable

from schemas.payloads import CONTROL_CMD
from supervisor.ipc import layout as L
from supervisor.worker import WorkerContext


def sparse_log(ctx: WorkerContext, a: argparse.Namespace) -> dict:
    before = os.stat(a.path)
    os.truncate(a.path, a.size)
    after = os.stat(a.path)
    return {"denied": False, "size": after.st_size, "blocks_before": before.st_blocks,
            "blocks_after": after.st_blocks}


def lastword_bound(ctx: WorkerContext, a: argparse.Namespace) -> dict:
    w = ctx.writer(a.pub)
    end = time.monotonic() + 120.0
    taken = False
    while time.monotonic() < end and not taken:
        ctx.watchdog()
        w.publish_array(CONTROL_CMD.encode(steer_rad=0.25, engaged=1.0, reason=0.0,
                                           model_age_ms=5.0))
        taken = any(L.U64.unpack_from(mm, 0)[0] == L.LEASE_MAGIC
                    and L.U64.unpack_from(mm, L.OFF_TAKEN)[0] > 0 for mm in w._leases)
        time.sleep(0.01)
    L.U64.pack_into(w._buf, L.OFF_LAST_SEQ, L.SEQ_HONEST - 1)
    print("ATTACK " + json.dumps({"attack": "lastword_bound", "denied": None, "taken": taken,
                                  "last_seq": w.last_sequence}), flush=True)
    os._exit(1)


ATTACKS: dict[str, Callable[[WorkerContext, argparse.Namespace], dict]] = {
    f.__name__: f for f in (sparse_log, lastword_bound)
}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workers.probe.attacks_redteam5")
    p.add_argument("--attack", required=True, choices=sorted(ATTACKS))
    p.add_argument("--path", default="")
    p.add_argument("--size", type=int, default=0)
    p.add_argument("--pub", default="")
    return p.parse_args(argv)


def main(ctx: WorkerContext) -> int:
    a = _args(sys.argv[1:])
    if a.pub:                        # mapped before READY: nothing new is mapped after it
        ctx.writer(a.pub)
    ctx.ready(status=f"redteam5 pid {os.getpid()}")
    try:
        res = ATTACKS[a.attack](ctx, a)
    except Exception as e:           # an attack that failed is reported, not hidden
        res = {"denied": True, "error": f"{type(e).__name__}: {e}"}
    print("ATTACK " + json.dumps({"attack": a.attack, **res}), flush=True)
    while True:
        ctx.watchdog()
        time.sleep(0.05)
