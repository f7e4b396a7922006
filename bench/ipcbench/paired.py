"""Paired latency: two transports in the same two children, message by message.

The matrix runs each transport in its own pair of children, one after the other, so a
neighbour's burst of load lands on one transport's case and not on the other's; on this
2-core VM a p99 of one case moved 110 -> 500 us between passes of the same transport.
Here one sender child holds a sender of every transport and one receiver child a
receiver of each; message g goes to transport ``order(g)`` (rounds A B, B A, A B, ...:
each transport follows each other one equally often), paced at one message a period and
never before the receiver has taken message g - 1 (children._wait_credit, as the
matrix's latency cases). Each transport's messages are the same code as in the matrix
(its ``open_sender().send`` and ``open_receiver().recv``); only their neighbours in time
change, and those are the same for both: what one transport meets, the other meets
within a period.

The receiver knows which transport the next message comes on, so it blocks on that
one's own wait (a socket read, an iceoryx2 Listener), as in the matrix.
"""
from __future__ import annotations

import gc
import mmap
import os
import signal
import time
import traceback
import uuid

import numpy as np

from . import credit
from .children import (C_ABORT, C_LAST_SEQ, C_TX_WAITING, C_WORDS, _wait_credit,
                       busy_cpu_s)
from .transport import Transport, now_ns

# Control words after the children's own (children.C_*; C_LAST_SEQ, C_ABORT and
# C_TX_WAITING mean what they mean there, so _wait_credit and credit.wake apply).
P_RX_FIRST = 11   # the receivers that create their service (iceoryx2) are open
P_TX_OPEN = 12    # every sender is open
P_RX_OPEN = 13    # every receiver is open
P_DONE = 14       # the receiver has taken the last message
LOST_S = 2.0      # no message on the expected transport for this long: fail, not hang


def order(g: int, k: int) -> int:
    """The transport message ``g`` goes to, of ``k``: rounds of k messages, every other
    round reversed (A B B A A B ...)."""
    r, pos = divmod(g, k)
    return pos if r % 2 == 0 else k - 1 - pos


def _wait_word(ctrl: np.ndarray, word: int, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not ctrl[word]:
        if ctrl[C_ABORT]:
            raise RuntimeError("aborted")
        if time.monotonic() > end:
            raise TimeoutError(f"paired: {what} not within {timeout_s:.0f} s")
        time.sleep(1e-3)


def _getcpu():
    """sched_getcpu() through libc (vDSO/rseq: no system call), else a constant -1."""
    import ctypes
    try:
        f = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return lambda: -1
    f.restype = ctypes.c_int
    return f


def _sender(ts: list[Transport], ctrl: np.ndarray, rec: np.ndarray, p: dict) -> None:
    _wait_word(ctrl, P_RX_FIRST, 15, "the first receivers")
    ends = [t.open_sender() for t in ts]
    ctrl[P_TX_OPEN] = 1
    _wait_word(ctrl, P_RX_OPEN, 15, "every receiver")
    k = len(ts)
    src = np.random.default_rng(1).integers(0, 256, ts[0].nbytes, dtype=np.uint8)
    per = [0] * k
    period_ns = int(p["period_s"] * 1e9)
    total = k * (p["warmup"] + p["count"])
    getcpu = _getcpu()
    gc.collect()
    gc.disable()
    nxt = now_ns() + period_ns
    for g in range(total):
        dt = nxt - now_ns()
        if dt > 0:
            time.sleep(dt / 1e9)
        _wait_credit(ctrl, g, 1, 0.5)
        j = order(g, k)
        ends[j].send(per[j], src, p["fill"])
        if 0 <= per[j] - p["warmup"] < p["count"]:
            rec[1, j, per[j] - p["warmup"]] = getcpu()
        per[j] += 1
        nxt = max(nxt + period_ns, now_ns())
        if ctrl[C_ABORT]:
            raise RuntimeError("aborted")
    gc.enable()
    _wait_word(ctrl, P_DONE, 30, "the receiver's end")
    for e in ends:
        e.close()


def _receiver(ts: list[Transport], ctrl: np.ndarray, rec: np.ndarray, p: dict) -> None:
    k = len(ts)
    lat = rec[0]
    getcpu = _getcpu()
    rx: list = [None] * k
    for j, t in enumerate(ts):          # those that create their service first
        if t.open_first == "receiver":
            rx[j] = t.open_receiver()
    ctrl[P_RX_FIRST] = 1
    _wait_word(ctrl, P_TX_OPEN, 15, "every sender")
    for j, t in enumerate(ts):          # then those that attach to a live sender
        if rx[j] is None:
            rx[j] = t.open_receiver()
    ctrl[P_RX_OPEN] = 1
    warmup, count = p["warmup"], p["count"]
    addr = credit.word_address(ctrl, C_LAST_SEQ)
    gc.collect()
    gc.disable()
    for g in range(k * (warmup + count)):
        j = order(g, k)
        end = time.monotonic() + LOST_S
        while (got := rx[j].recv(0.05)) is None:
            if ctrl[C_ABORT]:
                raise RuntimeError("aborted")
            if time.monotonic() > end:
                raise TimeoutError(f"paired: message {g} never came on {ts[j].key}")
        t_send, seq, t_got, _ = got
        i = seq - warmup
        if 0 <= i < count:
            lat[j, i] = t_got - t_send
            rec[2, j, i] = getcpu()
        ctrl[C_LAST_SEQ] = g
        if ctrl[C_TX_WAITING]:
            ctrl[C_TX_WAITING] = 0
            credit.wake(addr)
    gc.enable()
    ctrl[P_DONE] = 1
    for r in rx:
        r.close()


def _fork(fn, *args) -> int:
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        code = 0
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001 - a child reports and exits
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    return pid


def run_paired(tclasses: list[type[Transport]], nbytes: int, p: dict) -> dict:
    """``p``: count (per transport), warmup (per transport), period_s, fill. Returns
    {"lat": {key: latencies in ns, in sending order}, "foreign_cpu_pct", "wall_s"} or
    {"error": one line}."""
    ts = [c() for c in tclasses]
    k, count = len(ts), p["count"]
    shm = mmap.mmap(-1, 8 * (C_WORDS + 3 * k * count))
    ctrl = np.frombuffer(shm, dtype=np.int64, count=C_WORDS)
    # Per transport and message: latency (ns), the sender's CPU after its send returned,
    # the receiver's once it held the message.
    rec = np.frombuffer(shm, dtype=np.int64, offset=8 * C_WORDS).reshape(3, k, count)
    lat = rec[0]
    ctrl[:] = 0
    ctrl[C_LAST_SEQ] = -1
    lat[:] = -1
    run_id = f"{os.getpid()}-{uuid.uuid4().hex[:10]}"
    t0, busy0 = time.monotonic(), busy_cpu_s()
    pids: list[int] = []
    out: dict = {}
    try:
        for t in ts:
            t.setup(nbytes, run_id)
        pids = [_fork(_receiver, ts, ctrl, rec, p), _fork(_sender, ts, ctrl, rec, p)]
        limit = t0 + 30 + k * (p["warmup"] + count) * (p["period_s"] + 0.005)
        codes = {}
        while len(codes) < len(pids):
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            if any(c != 0 for c in codes.values()) or time.monotonic() > limit:
                ctrl[C_ABORT] = 1
                time.sleep(0.5)
                for pid in pids:
                    if pid not in codes:
                        os.kill(pid, signal.SIGKILL)
                        codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                out["error"] = ("paired run took too long" if time.monotonic() > limit
                                else f"a child failed (exit codes {sorted(codes.values())})")
                break
            time.sleep(0.2)   # the parent only watches: rarely awake beside the two
        if "error" not in out:
            if (lat < 0).any():
                out["error"] = f"{int((lat < 0).sum())} messages without a latency"
            else:
                out["lat"] = {t.key: lat[j].copy() for j, t in enumerate(ts)}
                # Woken on the CPU the sender sent from (a sync wake-up's placement):
                # one receiver process for both, so both share its CPU history.
                out["same_cpu"] = {t.key: float((rec[1, j] == rec[2, j]).mean())
                                   for j, t in enumerate(ts)}
    finally:
        for t in ts:
            try:
                t.teardown()
            except Exception:  # noqa: BLE001 - best-effort cleanup
                pass
        del ctrl, lat, rec
        shm.close()
    wall = time.monotonic() - t0
    out["wall_s"] = round(wall, 2)
    busy1 = busy_cpu_s()
    if busy0 is not None and busy1 is not None and wall > 0.2:
        # Everything that ran meanwhile, ours included (2 children ~ their latency work).
        out["busy_cpu_pct"] = round((busy1 - busy0) / (wall * (os.cpu_count() or 1)) * 100, 1)
    return out
