"""Publish-to-receive latency of one 1928x1208 NV12 frame slot between two processes,
as the bridge's own clock sees it: the writer stamps SlotHeader.publishTsNs inside
publish() (after the loan was filled), the reader takes the time once it holds the
read-only view. Paced at 0.5 ms so it measures latency, not queueing.

    python bench/bridge_frame_latency.py [--n 2000] [--path both|native|python]

``--path both`` (default) measures the pure-Python path (the hot path before the native
module, x86-64 only) and the native one in the same run, one after the other.

bench/ipc_latency.py measures the same path with the stamp taken by the harness just
before publish() is called (so the publish work itself is included), next to peers.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from supervisor.ipc import Channel, ChannelSpec, Reader, Writer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--path", choices=("both", "native", "python"), default="both")
    args = ap.parse_args()
    paths = {"both": (False, True), "native": (True,), "python": (False,)}[args.path]
    for native in paths:
        run(args.n, native)
    return 0


def run(n: int, native: bool) -> None:
    spec = ChannelSpec(name="frames", slot_size=1928 * 1208 * 3 // 2, slot_count=4,
                       kind="frame", pixel_formats=("nv12",))
    ch = Channel.create(spec)
    w = Writer(ch.writer_handle(), domain="control", native=native)
    ready_r, ready_w = os.pipe()
    res_r, res_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        r = Reader(ch.reader_handle(0), native=native)
        os.write(ready_w, b"r")
        lat = np.zeros(n, np.int64)
        got, last = 0, 0
        while last < n:          # up to the last frame; a frame reused under load is a drop
            m = r.receive(timeout=5)
            m.array
            lat[got] = time.monotonic_ns() - m.publish_ts_ns
            last = m.stamp.frame_id
            got += 1
            m.release()
        lat[got:] = -1
        data = lat.tobytes()
        while data:
            data = data[os.write(res_w, data):]
        os._exit(0)
    os.read(ready_r, 1)
    for i in range(n):
        loan = w.loan()
        loan.frame("nv12", 1928, 1208)
        loan.publish(frame_id=i + 1, capture_ts_ns=time.monotonic_ns())
        time.sleep(0.0005)
    buf = b""
    while len(buf) < n * 8:
        buf += os.read(res_r, 1 << 20)
    os.waitpid(pid, 0)
    lat = np.frombuffer(buf, np.int64)
    drops = int((lat < 0).sum())
    lat = lat[lat >= 0] / 1e3
    p50, p99, p999 = np.percentile(lat, [50, 99, 99.9])
    print(f"NV12 1928x1208 publish->receive  {'native' if native else 'python'}  n={n}  "
          f"p50 {p50:.1f} us  p99 {p99:.1f} us  p99.9 {p999:.1f} us   "
          f"(targets: p50 <= 20 us, p99 <= 100 us){f'  drops {drops}' if drops else ''}")
    w.close()
    ch.close()
    for fd in (ready_r, ready_w, res_r, res_w):
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
