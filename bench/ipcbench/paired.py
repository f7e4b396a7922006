"""Paired runs: two transports in the same two children, latency message by message,
throughput in alternating bursts (run_paired's ``mode``).

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

Throughput: bursts of ``burst`` messages, each on one transport (rounds A B, B A, ...),
streamed at ``window`` in flight as the matrix streams, each begun once the one before
is drained (the bursts never overlap); after a warm-up of each transport (paced, then
streamed: children.warmup_of). The receiver times each burst from its first message
taken to its last.

Per burst, each child also notes what the burst cost it (getrusage around the burst):
CPU time (user + system) and, for the sender, minor page faults; and the receiver
counts the messages it took on the CPU the sender sent them from (P_TX_CPU, stored
just before each send: a receiver woken on that CPU takes the message within the send). Why: at NV12 a message is ~200 us, the sender's copy ~150 us of
it, and the receiver, woken on the sender's CPU (a socket's sync wake-up), runs between
the sender's sends; a burst's wall time per message then equals sender CPU + receiver
CPU, where a receiver on the other CPU would overlap them. These columns say which
regime a run measured, for each transport.
"""
from __future__ import annotations

import gc
import mmap
import os
import resource
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
P_TX_CPU = 15     # throughput: the CPU the sender is on as it sends (stored just before)
# Columns of a burst's row (_run_stream): the receiver's, then the sender's.
B_TRANSPORT, B_MSGS, B_NS, B_GAPS, B_RX_CPU_NS, B_SAME_CPU, B_TX_CPU_NS, B_TX_FAULTS, \
    B_TX_FULL = range(9)
B_COLS = 9
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


def _open_senders(ts: list[Transport], ctrl: np.ndarray) -> list:
    _wait_word(ctrl, P_RX_FIRST, 15, "the first receivers")
    ends = [t.open_sender() for t in ts]
    ctrl[P_TX_OPEN] = 1
    _wait_word(ctrl, P_RX_OPEN, 15, "every receiver")
    return ends


def _open_receivers(ts: list[Transport], ctrl: np.ndarray) -> list:
    rx: list = [None] * len(ts)
    for j, t in enumerate(ts):          # those that create their service first
        if t.open_first == "receiver":
            rx[j] = t.open_receiver()
    ctrl[P_RX_FIRST] = 1
    _wait_word(ctrl, P_TX_OPEN, 15, "every sender")
    for j, t in enumerate(ts):          # then those that attach to a live sender
        if rx[j] is None:
            rx[j] = t.open_receiver()
    ctrl[P_RX_OPEN] = 1
    return rx


def _take(rx, ts: list[Transport], j: int, g: int, ctrl: np.ndarray):
    """Message ``g``, expected on transport ``j``; fails rather than hangs."""
    end = time.monotonic() + LOST_S
    while (got := rx[j].recv(0.05)) is None:
        if ctrl[C_ABORT]:
            raise RuntimeError("aborted")
        if time.monotonic() > end:
            raise TimeoutError(f"paired: message {g} never came on {ts[j].key}")
    return got


def _taken(ctrl: np.ndarray, g: int, addr: int) -> None:
    """Message ``g`` taken: the sender's credit, and its wake-up if it sleeps for it."""
    ctrl[C_LAST_SEQ] = g
    if ctrl[C_TX_WAITING]:
        ctrl[C_TX_WAITING] = 0
        credit.wake(addr)


def _sender(ts: list[Transport], ctrl: np.ndarray, rec: np.ndarray, p: dict) -> None:
    ends = _open_senders(ts, ctrl)
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
    rx = _open_receivers(ts, ctrl)
    warmup, count = p["warmup"], p["count"]
    addr = credit.word_address(ctrl, C_LAST_SEQ)
    gc.collect()
    gc.disable()
    for g in range(k * (warmup + count)):
        j = order(g, k)
        t_send, seq, t_got, _ = _take(rx, ts, j, g, ctrl)
        i = seq - warmup
        if 0 <= i < count:
            lat[j, i] = t_got - t_send
            rec[2, j, i] = getcpu()
        _taken(ctrl, g, addr)
    gc.enable()
    ctrl[P_DONE] = 1
    for r in rx:
        r.close()


def _warm(ends, rx, ts, ctrl, p: dict, addr: int | None) -> tuple[int, list[int]]:
    """Both sides of a stream's warm-up, each transport in turn: ``p["warmup"]``
    messages one in flight, then ``p["warmup_stream"]`` streamed (as children.warmup_of).
    ``ends`` for the sender, ``rx`` for the receiver. Returns (next g, next seq each)."""
    g, per = 0, [0] * len(ts)
    src = (np.random.default_rng(1).integers(0, 256, ts[0].nbytes, dtype=np.uint8)
           if ends is not None else None)
    for j in range(len(ts)):
        for i in range(p["warmup"] + p["warmup_stream"]):
            if ends is not None:
                paced = i < p["warmup"]
                _wait_credit(ctrl, g, 1 if paced else p["window"], 0.5, False,
                             credit.SPIN_NS_PACED if paced else credit.SPIN_NS_STREAM)
                ends[j].send(per[j], src, p["fill"])
                if paced:
                    time.sleep(p["period_s"])
            else:
                _take(rx, ts, j, g, ctrl)
                _taken(ctrl, g, addr)
            per[j] += 1
            g += 1
    return g, per


def _usage() -> tuple[int, int]:
    """(CPU ns, user + system, minor page faults) of this process so far."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return int((ru.ru_utime + ru.ru_stime) * 1e9), ru.ru_minflt


def _stream_sender(ts: list[Transport], ctrl: np.ndarray, bursts: np.ndarray,
                   p: dict) -> None:
    ends = _open_senders(ts, ctrl)
    k, m, window = len(ts), p["burst"], p["window"]
    src = np.random.default_rng(1).integers(0, 256, ts[0].nbytes, dtype=np.uint8)
    getcpu = _getcpu()
    gc.collect()
    gc.disable()
    g, per = _warm(ends, None, ts, ctrl, p, None)
    for b in range(len(bursts)):
        j = order(b, k)
        cpu0, flt0 = _usage()
        full = 0
        for i in range(m):
            # Which end bounds the stream: a sender that finds the window full waits
            # for the receiver (the receiver is the slower end); one that never does
            # is the slower end itself.
            full += i > 0 and g - ctrl[C_LAST_SEQ] > window
            # A burst starts once the last one is drained: bursts never overlap.
            _wait_credit(ctrl, g, 1 if i == 0 else window, 0.5, False,
                         credit.SPIN_NS_STREAM)
            ctrl[P_TX_CPU] = getcpu()     # before: the receiver runs within the send
            ends[j].send(per[j], src, p["fill"])
            per[j] += 1
            g += 1
        cpu1, flt1 = _usage()
        bursts[b, B_TX_CPU_NS:] = cpu1 - cpu0, flt1 - flt0, full
        if ctrl[C_ABORT]:
            raise RuntimeError("aborted")
    gc.enable()
    _wait_word(ctrl, P_DONE, 30, "the receiver's end")
    for e in ends:
        e.close()


def _stream_receiver(ts: list[Transport], ctrl: np.ndarray, bursts: np.ndarray,
                     p: dict) -> None:
    rx = _open_receivers(ts, ctrl)
    k, m = len(ts), p["burst"]
    addr = credit.word_address(ctrl, C_LAST_SEQ)
    getcpu = _getcpu()
    gc.collect()
    gc.disable()
    g, per = _warm(None, rx, ts, ctrl, p, addr)
    for b in range(len(bursts)):
        j = order(b, k)
        t_first = gaps = same = 0
        cpu0 = _usage()[0]
        for i in range(m):
            _, seq, t_got, _ = _take(rx, ts, j, g, ctrl)
            same += getcpu() == ctrl[P_TX_CPU]
            if seq != per[j]:
                gaps += 1
            per[j] = seq + 1
            if i == 0:
                t_first = t_got
            _taken(ctrl, g, addr)
            g += 1
        bursts[b, :B_TX_CPU_NS] = (j, m - 1, t_got - t_first, gaps, _usage()[0] - cpu0,
                                   same)
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


def run_paired(tclasses: list[type[Transport]], nbytes: int, p: dict,
               mode: str = "latency") -> dict:
    """``mode`` "latency": ``p`` count (per transport), warmup (per transport),
    period_s, fill; returns {"lat": {key: latencies in ns, in sending order},
    "same_cpu": {key: share}, "busy_cpu_pct", "wall_s"}. "throughput": p rounds,
    burst (messages a burst), window, warmup, warmup_stream, period_s, fill: bursts of
    ``burst`` messages streamed on one transport at a time (rounds A B, B A, ...), each
    started once the one before is drained; returns {"bursts": {key: [(messages - 1,
    ns from the first message taken to the last), ...] in round order}, ...}. Or
    {"error": one line}."""
    if mode == "throughput":
        return _run_stream(tclasses, nbytes, p)
    ts = [c() for c in tclasses]
    k, count = len(ts), p["count"]
    shm = mmap.mmap(-1, 8 * (C_WORDS + 3 * k * count))
    ctrl = np.frombuffer(shm, dtype=np.int64, count=C_WORDS)
    # Per transport and message: latency (ns), the sender's CPU after its send returned,
    # the receiver's once it held the message.
    rec = np.frombuffer(shm, dtype=np.int64, offset=8 * C_WORDS).reshape(3, k, count)
    ctrl[:] = 0
    ctrl[C_LAST_SEQ] = -1
    rec[0] = -1
    out = _supervise(ts, nbytes, ctrl, _receiver, _sender, rec, p,
                     limit_s=30 + k * (p["warmup"] + count) * (p["period_s"] + 0.005))
    if "error" not in out:
        if (rec[0] < 0).any():
            out["error"] = f"{int((rec[0] < 0).sum())} messages without a latency"
        else:
            out["lat"] = {t.key: rec[0, j].copy() for j, t in enumerate(ts)}
            # Woken on the CPU the sender sent from (a sync wake-up's placement): one
            # receiver process for both, so both share its CPU history.
            out["same_cpu"] = {t.key: float((rec[1, j] == rec[2, j]).mean())
                               for j, t in enumerate(ts)}
    del ctrl, rec
    shm.close()
    return out


def _run_stream(tclasses: list[type[Transport]], nbytes: int, p: dict) -> dict:
    ts = [c() for c in tclasses]
    k = len(ts)
    nb = k * p["rounds"]
    shm = mmap.mmap(-1, 8 * (C_WORDS + B_COLS * nb))
    ctrl = np.frombuffer(shm, dtype=np.int64, count=C_WORDS)
    # Per burst (B_*): transport index, messages - 1, ns first -> last taken, sequence
    # gaps, receiver CPU ns, messages taken on the sender's CPU; sender CPU ns, faults,
    # messages the sender found the window full for.
    bursts = np.frombuffer(shm, dtype=np.int64, offset=8 * C_WORDS).reshape(nb, B_COLS)
    ctrl[:] = 0
    ctrl[C_LAST_SEQ] = -1
    bursts[:] = -1
    out = _supervise(ts, nbytes, ctrl, _stream_receiver, _stream_sender, bursts, p,
                     limit_s=30 + nb * p["burst"] * 0.01
                     + k * (p["warmup"] + p["warmup_stream"]) * (p["period_s"] + 0.01))
    if "error" not in out:
        if (bursts[:, B_NS] <= 0).any():
            out["error"] = "a burst without a duration"
        else:
            out["bursts"] = {t.key: [(int(b[B_MSGS]), int(b[B_NS])) for b in bursts
                                     if b[B_TRANSPORT] == j] for j, t in enumerate(ts)}
            out["gaps"] = int(bursts[:, B_GAPS].sum())
            out["cost"] = {t.key: _burst_cost(bursts[bursts[:, B_TRANSPORT] == j])
                           for j, t in enumerate(ts)}
    del ctrl, bursts
    shm.close()
    return out


def _burst_cost(rows: np.ndarray) -> dict:
    """A transport's bursts, medians over them, per message: wall us (first -> last
    taken), sender and receiver CPU us; sender minor faults (mean); the share of messages
    the receiver took on the CPU the sender sent them from. wall ~ tx + rx
    with same_cpu ~ 1: the two ran one after the other on one CPU."""
    n = rows[:, B_MSGS] + 1
    med = lambda a: round(float(np.median(a)), 2)   # noqa: E731
    return {"wall_us": med(rows[:, B_NS] / rows[:, B_MSGS] / 1e3),
            "tx_cpu_us": med(rows[:, B_TX_CPU_NS] / n / 1e3),
            "rx_cpu_us": med(rows[:, B_RX_CPU_NS] / n / 1e3),
            # All bursts' faults over all their messages: a first touch of a fresh
            # slot (853 faults at NV12) lands in one burst, which a median would hide.
            "tx_faults": round(float(rows[:, B_TX_FAULTS].sum() / n.sum()), 3),
            "same_cpu": med(rows[:, B_SAME_CPU] / n),
            # The share of messages (after each burst's first) the sender found the
            # window full for: ~1, the receiver bounds the stream; ~0, the sender does.
            "tx_full": med(rows[:, B_TX_FULL] / rows[:, B_MSGS])}


def _supervise(ts: list[Transport], nbytes: int, ctrl: np.ndarray, receiver, sender,
               shared: np.ndarray, p: dict, limit_s: float) -> dict:
    """Set up, fork the two children, wait for them (kill both past ``limit_s`` or
    once one fails), tear down. {"wall_s", "busy_cpu_pct"} and "error" if any."""
    run_id = f"{os.getpid()}-{uuid.uuid4().hex[:10]}"
    t0, busy0 = time.monotonic(), busy_cpu_s()
    out: dict = {}
    try:
        for t in ts:
            t.setup(nbytes, run_id)
        pids = [_fork(receiver, ts, ctrl, shared, p), _fork(sender, ts, ctrl, shared, p)]
        codes: dict[int, int] = {}
        while len(codes) < len(pids):
            for pid in pids:
                if pid not in codes:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            late = time.monotonic() > t0 + limit_s
            if any(c != 0 for c in codes.values()) or late:
                ctrl[C_ABORT] = 1
                time.sleep(0.5)
                for pid in pids:
                    if pid not in codes:
                        os.kill(pid, signal.SIGKILL)
                        codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                out["error"] = ("paired run took too long" if late
                                else f"a child failed (exit codes {sorted(codes.values())})")
                break
            time.sleep(0.2)   # the parent only watches: rarely awake beside the two
    finally:
        for t in ts:
            try:
                t.teardown()
            except Exception:  # noqa: BLE001 - best-effort cleanup
                pass
    wall = time.monotonic() - t0
    out["wall_s"] = round(wall, 2)
    busy1 = busy_cpu_s()
    if busy0 is not None and busy1 is not None and wall > 0.2:
        # Everything that ran meanwhile, ours included (2 children ~ their work).
        out["busy_cpu_pct"] = round((busy1 - busy0) / (wall * (os.cpu_count() or 1)) * 100, 1)
    return out
