"""The two forked children of a case: the sender paces or streams messages, the
receiver takes them, measures latency and rate, and both report to the parent.

Parent, sender and receiver share one small int64 control block (``ctrl``, C_* below):
the receiver's progress is the sender's credit, so no transport queues up.
"""
from __future__ import annotations

import gc
import os
import resource
import time
import traceback

import numpy as np

from . import credit
from .transport import Transport, now_ns

# Indices into the int64 control block shared by parent, sender and receiver.
C_LAST_SEQ = 0   # highest sequence number the receiver has taken (-1: none)
C_RX_READY = 1   # receiver endpoint open
C_TX_DONE = 2    # sender finished sending
C_TX_LAST = 3    # last sequence number sent (valid once C_TX_DONE)
C_RX_DONE = 4    # receiver finished (sender may close its endpoint)
C_ABORT = 5      # parent asks both children to stop
C_TX_READY = 6   # sender endpoint open
# Syscall counting (``p["trace"]``, bench/ipcbench/syscalls.py): the sender, warmed up,
# sets C_TX_ARMED and spins until the parent has attached a tracer to both children and
# set C_TRACE = TRACE_GO; the receiver, done, sets C_RX_END and spins until the parent
# has detached (C_TRACE = TRACE_STOPPED). Every wait of the harness inside that window
# spins instead of sleeping, so every system call counted is the transport's.
C_TRACE = 7
C_TX_ARMED = 8
C_RX_END = 9
C_TX_WAITING = 10  # the sender sleeps on a futex on C_LAST_SEQ for credit (credit.py)
C_WORDS = 16
TRACE_GO = 1
TRACE_STOPPED = 2


def cpu_self() -> float:
    """CPU seconds of this process, all threads (zmq I/O threads included)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_cpu_s() -> float | None:
    """Machine-wide non-idle CPU seconds so far (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal ...
    return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / _HZ


def _pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        ncpu = os.cpu_count() or 1
        os.sched_setaffinity(0, {cpu % ncpu})


# Sleeps the sender took waiting for credit (the harness's own, not the transport's).
_credit_sleeps = [0]


def _wait_credit(ctrl: np.ndarray, seq: int, window: int, timeout_s: float,
                 spin: bool = False, spin_ns: int = credit.SPIN_NS_PACED) -> bool:
    """Block until fewer than ``window`` messages are in flight before ``seq``: look
    for ``spin_ns``, then sleep until the receiver moves (credit.py); ``spin``: never
    sleep (a traced run: no system call of the harness's own)."""
    if seq - ctrl[C_LAST_SEQ] <= window:
        return True
    now = time.monotonic_ns
    t_spin = now() + spin_ns
    t_end = t_spin - spin_ns + int(timeout_s * 1e9)
    addr = credit.word_address(ctrl, C_LAST_SEQ)
    while seq - ctrl[C_LAST_SEQ] > window:
        if ctrl[C_ABORT]:
            raise RuntimeError("aborted by parent")
        t = now()
        if t > t_spin:
            if not spin:
                # Asleep until the receiver moves (it wakes us: credit.py), not on a
                # timer: the flag first, then one more look, then the futex, which
                # returns at once if the word moved since that look.
                seen = int(ctrl[C_LAST_SEQ])
                ctrl[C_TX_WAITING] = 1
                if seq - seen > window:
                    _credit_sleeps[0] += 1
                    credit.wait(addr, seen)
                ctrl[C_TX_WAITING] = 0
            if t > t_end:
                return False           # message lost (lossy transport): move on
    return True


def _spin_until(ctrl: np.ndarray, word: int, value: int, timeout_s: float) -> None:
    """Spin (no system call: time.monotonic is the vDSO) until ctrl[word] >= value."""
    t_end = time.monotonic() + timeout_s
    while ctrl[word] < value:
        if ctrl[C_ABORT]:
            raise RuntimeError("aborted by parent")
        if time.monotonic() > t_end:
            raise RuntimeError(f"tracer handshake: word {word} never reached {value}")


def _switches() -> tuple[int, int, int, int]:
    """(voluntary, involuntary) context switches of this process so far (a voluntary
    one is a sleep: a blocking wait that blocked), then its (minor, major) page faults
    (a transport that maps or touches fresh pages per message pays them here)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_nvcsw, ru.ru_nivcsw, ru.ru_minflt, ru.ru_majflt


def warmup_of(p: dict, mode: str) -> int:
    """Messages sent before the measured phase: ``p["warmup"]`` paced ones (one in
    flight: a connecting transport may lose the first), then, before a stream,
    ``p["warmup_stream"]`` streamed as the measured phase streams them. Those touch the
    buffers a stream cycles through (a fresh segment's first touch of a 3.5 MB slot is
    ~850 page faults) so that the rate measured is the steady one, for every transport."""
    return p["warmup"] + (p.get("warmup_stream", 0) if mode == "throughput" else 0)


def sender_main(transport: Transport, mode: str, p: dict, ctrl: np.ndarray, conn) -> None:
    out: dict = {"role": "sender"}
    tx = None
    try:
        _pin(p["pin_tx"])
        tx = transport.open_sender()
        ctrl[C_TX_READY] = 1
        src = np.random.default_rng(1).integers(0, 256, transport.nbytes, dtype=np.uint8)
        t_end = time.monotonic() + 15
        while not ctrl[C_RX_READY]:
            if ctrl[C_ABORT] or time.monotonic() > t_end:
                raise RuntimeError("receiver never became ready")
            time.sleep(1e-3)
        fill = p["fill"]
        warmup = p["warmup"]
        stalls = 0
        seq = 0
        gc.collect()
        gc.disable()
        # Warm-up: paced, one in flight (first messages may be lost while connecting).
        for seq in range(warmup):
            if not _wait_credit(ctrl, seq, 1, 0.2):
                stalls += 1
            tx.send(seq, src, fill)
            time.sleep(p["period_s"])
        # ... then, before a stream, streamed (warmup_of).
        for seq in range(warmup, warmup_of(p, mode)):
            if not _wait_credit(ctrl, seq, p["window"], 0.5, False, credit.SPIN_NS_STREAM):
                stalls += 1
            tx.send(seq, src, fill)
        warmup = warmup_of(p, mode)
        seq = warmup
        trace = bool(p.get("trace"))
        if trace:
            ctrl[C_TX_ARMED] = 1
            _spin_until(ctrl, C_TRACE, TRACE_GO, 30.0)
        sw0 = _switches()
        cpu0, _credit_sleeps[0] = cpu_self(), 0
        if mode == "latency":
            period_ns = int(p["period_s"] * 1e9)
            nxt = now_ns() + period_ns
            give_up = now_ns() + int(p["max_latency_s"] * 1e9)
            seq = warmup
            for seq in range(warmup, warmup + p["count"]):
                if now_ns() > give_up:
                    out["truncated"] = True   # slow transport: fewer samples, not a hang
                    break
                dt = nxt - now_ns()
                if dt > 0:
                    if trace:
                        while now_ns() < nxt:     # pacing without a system call
                            pass
                    else:
                        time.sleep(dt / 1e9)
                # Never send before the receiver has taken the previous message.
                if not _wait_credit(ctrl, seq, 1, 0.5, trace):
                    stalls += 1
                tx.send(seq, src, fill)
                nxt = max(nxt + period_ns, now_ns())
                if ctrl[C_ABORT]:
                    raise RuntimeError("aborted by parent")
            else:
                seq = warmup + p["count"]
        else:
            window = p["window"]
            stop = now_ns() + int(p["duration_s"] * 1e9)
            while True:
                if not _wait_credit(ctrl, seq, window, 0.5, trace, credit.SPIN_NS_STREAM):
                    stalls += 1
                tx.send(seq, src, fill)
                seq += 1
                if not seq & 15 and (now_ns() > stop or ctrl[C_ABORT]):
                    break
        sw1 = _switches()
        out["switches"] = tuple(b - a for a, b in zip(sw0, sw1))
        out["cpu_measured_s"] = cpu_self() - cpu0
        out["credit_sleeps"] = _credit_sleeps[0]
        gc.enable()
        ctrl[C_TX_LAST] = seq - 1
        ctrl[C_TX_DONE] = 1
        out.update(sent=seq, stalls=stalls)
        if trace:       # the tracer is still attached: no system call until it is gone
            _spin_until(ctrl, C_TRACE, TRACE_STOPPED, 60.0)
        # Keep the endpoint open until the receiver has drained (zmq linger,
        # iceoryx2 publisher lifetime, bridge writer).
        t_end = time.monotonic() + 10
        while not ctrl[C_RX_DONE] and not ctrl[C_ABORT] and time.monotonic() < t_end:
            time.sleep(1e-3)
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
        ctrl[C_TX_DONE] = 1
    finally:
        try:
            if tx is not None:
                tx.close()
        except Exception as e:  # noqa: BLE001
            out.setdefault("close_error", repr(e))
        out["cpu_s"] = cpu_self()
        conn.send(out)
        conn.close()


def stats_us(lat_ns: np.ndarray) -> dict:
    if lat_ns.size == 0:
        return {"n": 0}
    us = lat_ns.astype(np.float64) / 1e3
    p50, p99, p999 = np.percentile(us, [50, 99, 99.9])
    return {"n": int(us.size), "min": float(us.min()), "mean": float(us.mean()),
            "p50": float(p50), "p99": float(p99), "p99.9": float(p999),
            "max": float(us.max())}


def _windowed_rate(t_ns: np.ndarray, overall: float) -> float:
    """Median rate over fixed windows (>= 50 ms and >= ~20 messages each).

    More robust than the overall rate against a short burst of unrelated load on a
    small machine; falls back to the overall rate when the run is too short.
    """
    if t_ns.size < 60 or not overall == overall:
        return overall
    win = max(0.05, 20.0 / overall)
    span = (t_ns[-1] - t_ns[0]) / 1e9
    nwin = int(span / win)
    if nwin < 3:
        return overall
    edges = t_ns[0] + (np.arange(nwin + 1) * win * 1e9).astype(np.int64)
    counts, _ = np.histogram(t_ns, bins=edges)
    return float(np.median(counts)) / win


def receiver_main(transport: Transport, mode: str, p: dict, ctrl: np.ndarray, conn) -> None:
    out: dict = {"role": "receiver"}
    rx = None
    try:
        _pin(p["pin_rx"])
        rx = transport.open_receiver()
        nbytes = transport.nbytes
        credit_addr = credit.word_address(ctrl, C_LAST_SEQ)
        warmup = warmup_of(p, mode)
        cap = p["count"] if mode == "latency" else p["max_msgs"]
        lat = np.empty(cap, dtype=np.int64)
        trecv = np.empty(cap if mode == "throughput" else 0, dtype=np.int64)
        n = 0
        last = -1
        drops = reorder = bad_len = 0
        t_first = t_last = 0
        grace = None
        hard_end = time.monotonic() + p["deadline_s"]
        trace = bool(p.get("trace"))
        sw0 = None
        gc.collect()
        gc.disable()
        ctrl[C_RX_READY] = 1
        while True:
            # Sleeps counted from the first measured message (traced: from the go).
            if sw0 is None and (ctrl[C_TRACE] >= TRACE_GO if trace else last >= warmup - 1):
                sw0, cpu0 = _switches(), cpu_self()
            got = rx.recv(0.05)
            if got is None:
                if ctrl[C_ABORT]:
                    raise RuntimeError("aborted by parent")
                if ctrl[C_TX_DONE] and last >= ctrl[C_TX_LAST]:
                    break
                if ctrl[C_TX_DONE]:
                    # Sender is done but messages are missing: give them a moment.
                    if grace is None:
                        grace = time.monotonic() + 0.5
                    elif time.monotonic() > grace:
                        break
                if time.monotonic() > hard_end:
                    raise TimeoutError(f"receiver deadline passed after {n} messages")
                continue
            ts, seq, t, got_n = got
            if got_n != nbytes:
                bad_len += 1
            if seq > last + 1:
                drops += seq - last - 1
            elif seq <= last:
                reorder += 1
                continue
            last = seq
            ctrl[C_LAST_SEQ] = seq
            if ctrl[C_TX_WAITING]:             # the sender sleeps for credit: wake it
                ctrl[C_TX_WAITING] = 0
                credit.wake(credit_addr)
            if seq >= warmup:
                if n == 0:
                    t_first = t
                t_last = t
                if n < cap:
                    lat[n] = t - ts
                    if mode == "throughput":
                        trecv[n] = t
                n += 1
            if ctrl[C_TX_DONE] and seq >= ctrl[C_TX_LAST]:
                break
        sw1 = _switches()
        if sw0 is not None:
            out["switches"] = tuple(b - a for a, b in zip(sw0, sw1))
            out["cpu_measured_s"] = cpu_self() - cpu0
        if trace:
            ctrl[C_RX_END] = 1    # the tracer is still attached: no system call until
            _spin_until(ctrl, C_TRACE, TRACE_STOPPED, 60.0)   # it is gone
        gc.enable()
        rec = lat[:min(n, cap)]
        out.update(received=n, drops=int(drops), reorder=reorder, bad_len=bad_len,
                   latency=stats_us(rec))
        if mode == "latency":
            out["raw_ns"] = rec.copy()
        rejected = getattr(rx, "rejected", 0)
        if rejected:
            out["rejected"] = rejected
        if mode == "throughput":
            el = (t_last - t_first) / 1e9
            overall = (n - 1) / el if n > 1 and el > 0 else float("nan")
            rate = _windowed_rate(trecv[:min(n, cap)], overall)
            out.update(elapsed_s=el, msgs_per_s=rate, msgs_per_s_overall=overall,
                       gb_per_s=rate * nbytes / 1e9)
    except BaseException as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    finally:
        ctrl[C_RX_DONE] = 1
        try:
            if rx is not None:
                rx.close()
        except Exception as e:  # noqa: BLE001
            out.setdefault("close_error", repr(e))
        out["cpu_s"] = cpu_self()
        conn.send(out)
        conn.close()
