"""Red team, round 4: the attacks whose attacker is a worker, run from inside a real
sandbox (``module = "workers.probe.attacks_redteam4"``, args ``--attack NAME`` and
``--pub CH`` / ``--sub CH``). tests/test_redteam_round4.py runs them under one real,
embedded `Supervisor` (round 3's pattern).

The last word against a hostile *control* reader: an actuation channel with two
control-domain readers (trusted by failsafe.trusted_readers) and a writer that dies.

* ``lastword_victim`` (the writer): engaged commands at 100 Hz until every reader
  attached and one claimed a position past any honest writer (layout OFF_TAKEN, read
  from the lease tables a writer maps read-only), then dies (exit 1): the supervisor's
  SAFE follows.
* ``claim_position`` (the hostile reader): takes a command, then writes SEQ_HONEST in
  its own lease table as the position it consumed, and stops reading (each receive would
  store its true position again).
* ``honest_reader``: reads every command; says what it received after the writer's
  death (``ATTACK-STEP`` per SAFE or refusal) and, once 8 s have passed with no SAFE
  or SAFE came, ``ATTACK`` with ``saw_safe``.

Each attack prints one line ``ATTACK {json}``.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from typing import Callable

import numpy as np

from schemas.payloads import CONTROL_CMD
from supervisor.ipc import layout as L
from supervisor.ipc.errors import ChannelTimeout, Rejected
from supervisor.worker import WorkerContext

# How long the honest reader waits for SAFE once its writer went quiet.
SAFE_WAIT_S = 8.0


def _step(**fields: object) -> None:
    print("ATTACK-STEP " + json.dumps(fields), flush=True)


def _take(r, timeout: float):
    """The next message, or None when nothing came within ``timeout``."""
    try:
        return r.receive(timeout=timeout)
    except ChannelTimeout:
        return None


def lastword_victim(ctx: WorkerContext, a: argparse.Namespace) -> dict:
    w = ctx.writer(a.pub)
    n = len(w._leases)
    end = time.monotonic() + 120.0
    claimed = False
    while time.monotonic() < end and not claimed:
        ctx.watchdog()
        w.publish_array(CONTROL_CMD.encode(steer_rad=0.25, engaged=1.0, reason=0.0,
                                           model_age_ms=5.0))
        tables = [(L.U64.unpack_from(mm, 0)[0] == L.LEASE_MAGIC,
                   L.U64.unpack_from(mm, L.OFF_TAKEN)[0]) for mm in w._leases]
        claimed = any(att and pos >= L.SEQ_HONEST for att, pos in tables) and \
            sum(att and 0 < pos for att, pos in tables) >= 2
        time.sleep(0.01)
    print("ATTACK " + json.dumps({"attack": "lastword_victim", "denied": None,
                                  "claimed_seen": claimed, "readers": n,
                                  "last_seq": w.last_sequence}), flush=True)
    os._exit(1)


def claim_position(ctx: WorkerContext, a: argparse.Namespace) -> dict:
    r = ctx.reader(a.sub)
    end = time.monotonic() + 120.0
    while time.monotonic() < end:
        ctx.watchdog()
        try:
            m = _take(r, 0.1)
        except Rejected:
            continue
        if m is not None:
            with m:
                pass
            break
    # Its own table: mapped read-write by the reader, read-only by everyone else.
    struct.pack_into("<Q", r._lease_mm, L.OFF_TAKEN, L.SEQ_HONEST)
    return {"denied": False, "claimed": L.SEQ_HONEST}


def honest_reader(ctx: WorkerContext, a: argparse.Namespace) -> dict:
    r = ctx.reader(a.sub)
    got = 0
    last_msg = time.monotonic()
    while True:
        ctx.watchdog()
        try:
            m = _take(r, 0.1)
        except Rejected as e:
            _step(rejected=e.reason, sequence=e.sequence)
            continue
        now = time.monotonic()
        if m is None:
            if got and now - last_msg > SAFE_WAIT_S:
                return {"denied": None, "saw_safe": False, "received": got,
                        "rejected": dict(r.stats.rejected)}
            continue
        with m:
            cmd = CONTROL_CMD.decode(np.array(m.array))
            seq = m.sequence
        got += 1
        last_msg = now
        if cmd["engaged"] == 0.0:
            _step(safe_sequence=seq)
            return {"denied": True, "saw_safe": True, "received": got, "sequence": seq,
                    "rejected": dict(r.stats.rejected)}


ATTACKS: dict[str, Callable[[WorkerContext, argparse.Namespace], dict]] = {
    f.__name__: f for f in (lastword_victim, claim_position, honest_reader)
}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workers.probe.attacks_redteam4")
    p.add_argument("--attack", required=True, choices=sorted(ATTACKS))
    p.add_argument("--pub", default="")
    p.add_argument("--sub", default="")
    return p.parse_args(argv)


def main(ctx: WorkerContext) -> int:
    a = _args(sys.argv[1:])
    # Channels mapped before READY: nothing new is mapped after it.
    if a.pub:
        ctx.writer(a.pub)
    if a.sub:
        ctx.reader(a.sub)
    ctx.ready(status=f"redteam4 pid {os.getpid()}")
    try:
        res = ATTACKS[a.attack](ctx, a)
    except Exception as e:           # an attack that crashed is reported, not hidden
        print("ATTACK " + json.dumps({"attack": a.attack, "denied": None,
                                      "crashed": f"{type(e).__name__}: {e}"}), flush=True)
        return 2
    print("ATTACK " + json.dumps({"attack": a.attack, **res}), flush=True)
    while True:
        ctx.watchdog()
        time.sleep(0.05)
