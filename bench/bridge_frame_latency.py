"""Publish-to-receive latency of one 1928x1208 NV12 frame slot between two processes,
as the bridge's own clock sees it: the writer stamps SlotHeader.publishTsNs inside
publish() (after the loan was filled), the reader takes the time once it holds the
read-only view. Paced at 0.5 ms so it measures latency, not queueing.

    python bench/bridge_frame_latency.py [--n 2000]

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
    n = ap.parse_args().n
    spec = ChannelSpec(name="frames", slot_size=1928 * 1208 * 3 // 2, slot_count=4,
                       kind="frame", pixel_formats=("nv12",))
    ch = Channel.create(spec)
    w = Writer(ch.writer_handle(), domain="control")
    ready_r, ready_w = os.pipe()
    res_r, res_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        r = Reader(ch.reader_handle(0))
        os.write(ready_w, b"r")
        lat = np.empty(n, np.int64)
        for i in range(n):
            m = r.receive(timeout=5)
            m.array
            lat[i] = time.monotonic_ns() - m.publish_ts_ns
            m.release()
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
    lat = np.frombuffer(buf, np.int64) / 1e3
    p50, p99, p999 = np.percentile(lat, [50, 99, 99.9])
    print(f"NV12 1928x1208 publish->receive  n={n}  p50 {p50:.1f} us  p99 {p99:.1f} us  "
          f"p99.9 {p999:.1f} us   (targets: p50 <= 20 us, p99 <= 100 us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
