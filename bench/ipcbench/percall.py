"""Per-call medians of the bridge's hot path in one process (docs/ipc-wakeups.md round 8):
the reader's take / view / release and a look for nothing, the bench's send in parts
(loan, array, stamp, publish, exit), and the bench's own ``send()``/``recv()`` for the
bridge and iceoryx2 (if installed), alternating. One process, the reader awake (as in a
stream): no wake-up. Medians are robust to a loaded machine; compare only runs of the
same minutes.

    python bench/ipcbench/percall.py [--n 20000] [--rounds 2]

To compare two trees (old/new), run it from each with ``PYTHONPATH=<tree>``: the package
is imported from there.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

if __package__ in (None, ""):          # run as a script: bench/ on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ipcbench.bridge import BridgeTransport          # noqa: E402
from ipcbench.iox2 import Iox2Transport              # noqa: E402
from ipcbench.transport import Skip, stamp           # noqa: E402

_pc = time.perf_counter_ns


def _med(xs: list[int]) -> float:
    """Median in us, the first tenth (warm-up) left out."""
    return statistics.median(xs[len(xs) // 10:]) / 1e3


def reader_parts(n: int) -> dict[str, float]:
    from supervisor.ipc import Channel, ChannelSpec, Reader, Writer
    spec = ChannelSpec(name=f"percall_{os.getpid()}", slot_size=64, slot_count=8,
                       dtype="uint8", max_readers=1, max_leases=1)
    ch = Channel.create(spec)
    try:
        w, r = Writer(ch.writer_handle()), Reader(ch.reader_handle(0))
        shape = (64,)
        parts: dict[str, list[int]] = {k: [] for k in (
            "loan", "array", "stamp", "publish", "exit", "take", "view", "release")}
        tr = r.try_receive
        for i in range(n):
            t0 = _pc()
            loan = w.loan()
            t1 = _pc()
            loan.__enter__()
            a = loan.array(shape, "uint8")
            t2 = _pc()
            t = stamp(a, i)
            del a
            t3 = _pc()
            loan.publish(publish_ts_ns=t)
            t4 = _pc()
            loan.__exit__(None, None, None)
            t5 = _pc()
            m = tr()
            t6 = _pc()
            v = m.array
            t7 = _pc()
            del v
            m.release()
            t8 = _pc()
            for k, d in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5,
                                    t7 - t6, t8 - t7)):
                parts[k].append(d)
        look = []
        for _ in range(n // 4):
            t0 = _pc()
            tr()
            look.append(_pc() - t0)
        out = {k: _med(v) for k, v in parts.items()}
        out["look"] = _med(look)
        r.close()
        w.close()
        return out
    finally:
        ch.close()


def bench_ends(cls: type, n: int, run_id: str) -> tuple[float, float] | None:
    """Median (send, recv) of a transport's bench ends, one process."""
    t = cls()
    try:
        t.check()
    except Skip:
        return None
    t.setup(64, run_id)
    try:
        if t.open_first == "receiver":
            rx = t.open_receiver()
            tx = t.open_sender()
        else:
            tx = t.open_sender()
            rx = t.open_receiver()
        src = np.zeros(64, np.uint8)
        sd, rc = [], []
        for i in range(n):
            t0 = _pc()
            tx.send(i, src, False)
            t1 = _pc()
            rx.recv(1.0)
            rc.append(_pc() - t1)
            sd.append(t1 - t0)
        rx.close()
        tx.close()
        return _med(sd), _med(rc)
    finally:
        t.teardown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000, help="messages per measurement")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two")
    args = ap.parse_args(argv)
    import supervisor.ipc
    print(f"supervisor.ipc from {os.path.dirname(supervisor.ipc.__file__)}; "
          f"load {os.getloadavg()[0]:.1f}")
    p = reader_parts(args.n)
    print("bridge, per call (us): " + "  ".join(f"{k} {v:.3f}" for k, v in p.items()))
    print(f"  send parts sum {sum(p[k] for k in ('loan', 'array', 'stamp', 'publish', 'exit')):.3f}"
          f"  receive sum {p['take'] + p['view'] + p['release']:.3f}")
    for k in range(args.rounds):
        for cls in (BridgeTransport, Iox2Transport):
            got = bench_ends(cls, args.n, f"percall_{os.getpid()}_{k}_{cls.key}")
            if got is not None:
                print(f"bench {cls.key:7s} send {got[0]:.2f}  recv {got[1]:.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
