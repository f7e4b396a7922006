"""The bridge's per-message CPU cost, pure-Python path ("before") against the native
module ("after"), measured in one process so that no scheduling or wake-up latency is
in it, only the work:

* send:    ``loan()``, ``array()``, the stamp (``--fill stamp``: 16 bytes; ``copy``: the
           whole payload), ``publish()`` (header encode, control block, the release
           stores, the wake-up byte);
* receive: ``receive()`` (wake-up drain, seqlock read, lease, layout/header decode and
           every check), ``msg.array``, the stamp read, ``release()`` (seqlock check).

The two paths alternate in batches (ABAB...) so drift in the machine's speed lands on
both. Per-message times are medians over all messages of a path.
"""
from __future__ import annotations

import gc
import importlib
import os
import time

import numpy as np

from .transport import read_stamp, stamp

PATHS = (("pure Python (before)", False), ("native (after)", True))


def _run_batch(w, r, n: int, nbytes: int, src: np.ndarray | None, seq0: int,
               send: np.ndarray, recv: np.ndarray, at: int) -> None:
    pc = time.perf_counter_ns
    shape = (nbytes,)
    for i in range(n):
        t0 = pc()
        with w.loan() as loan:
            a = loan.array(shape, "uint8")
            if src is not None:
                np.copyto(a, src)
            t = stamp(a, seq0 + i)
            del a
            loan.publish(publish_ts_ns=t)
        t1 = pc()
        msg = r.receive(timeout=1.0)
        arr = msg.array
        _, seq = read_stamp(arr)
        del arr
        msg.release()
        t2 = pc()
        if seq != seq0 + i:
            raise RuntimeError(f"received seq {seq}, sent {seq0 + i}")
        send[at + i] = t1 - t0
        recv[at + i] = t2 - t1


def per_message_cost(nbytes: int, count: int, *, fill: bool, module: str = "supervisor.ipc",
                     batches: int = 10, warmup: int = 500) -> dict:
    """{path label: {"send": stats, "recv": stats, "total_p50_us": x}} plus "ratio"
    (after / before of the summed medians), or {"error": ...}."""
    m = importlib.import_module(module)
    chans, ends = {}, {}
    out: dict = {}
    try:
        for label, native in PATHS:
            spec = m.ChannelSpec(name=f"cost_{os.getpid()}_{int(native)}", slot_size=nbytes,
                                 slot_count=8, dtype="uint8", max_readers=1, max_leases=1)
            ch = chans[label] = m.Channel.create(spec)
            ends[label] = (m.Writer(ch.writer_handle(), native=native),
                           m.Reader(ch.reader_handle(0), native=native))
    except Exception as e:  # noqa: BLE001 - e.g. no pure-Python path on this machine
        for w, r in ends.values():
            w.close()
            r.close()
        for ch in chans.values():
            ch.close()
        return {"error": f"{type(e).__name__}: {e}"}
    src = np.random.default_rng(0).integers(0, 256, nbytes, np.uint8) if fill else None
    per = max(1, count // batches)
    times = {label: (np.empty(per * batches, np.int64), np.empty(per * batches, np.int64))
             for label, _ in PATHS}
    seqs = {label: 0 for label, _ in PATHS}
    gc.collect()
    gc.disable()
    try:
        for label, _ in PATHS:                       # warm both (plans, caches)
            w, r = ends[label]
            scratch = np.empty(warmup, np.int64)
            _run_batch(w, r, warmup, nbytes, src, 1, scratch, scratch.copy(), 0)
            seqs[label] = warmup + 1
        for b in range(batches):
            for label, _ in (PATHS if b % 2 == 0 else PATHS[::-1]):
                w, r = ends[label]
                _run_batch(w, r, per, nbytes, src, seqs[label], *times[label], b * per)
                seqs[label] += per
    finally:
        gc.enable()
        for w, r in ends.values():
            r.close()
            w.close()
        for ch in chans.values():
            ch.close()
    for label, _ in PATHS:
        send, recv = (t / 1e3 for t in times[label])
        out[label] = {
            "send": {"p50": float(np.median(send)), "mean": float(send.mean())},
            "recv": {"p50": float(np.median(recv)), "mean": float(recv.mean())},
            "total_p50_us": float(np.median(send) + np.median(recv)),
            "n": int(send.size),
        }
    before, after = (out[label]["total_p50_us"] for label, _ in PATHS)
    out["ratio"] = after / before
    return out


def print_cost(results: dict[str, dict], fill: str) -> None:
    print()
    print(f"Per-message cost of the bridge, in-process, --fill {fill} "
          f"(median us per message; send = loan+array+stamp+publish+wake, "
          f"receive = receive+array+release)")
    hdr = (f"{'size':<15} {'path':<22} {'send':>8} {'receive':>8} {'total':>8} "
           f"{'after/before':>13}")
    print(hdr)
    print("-" * len(hdr))
    for size, res in results.items():
        if "error" in res:
            print(f"{size:<15} ERROR {res['error'][:160]}")
            continue
        for label, _ in PATHS:
            c = res[label]
            tail = f"{res['ratio']:>12.2f}x" if label == PATHS[-1][0] else ""
            print(f"{size:<15} {label:<22} {c['send']['p50']:>8.2f} {c['recv']['p50']:>8.2f} "
                  f"{c['total_p50_us']:>8.2f} {tail:>13}")
    print()
