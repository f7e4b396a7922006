"""bench/ipcbench/paired.py: the bridge and iceoryx2 (event) in the same two forked
children, message by message (real sockets, real shared memory, real iceoryx2): every
message of both arrives, each transport's latencies are positive and in its own row,
and the send order alternates A B B A so each follows each equally often."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

pytest.importorskip("iceoryx2")
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
from ipcbench import BridgeTransport, Iox2Transport  # noqa: E402
from ipcbench.harness import iox2_cleanup  # noqa: E402
from ipcbench.paired import order, run_paired  # noqa: E402


def test_order_alternates_rounds():
    assert [order(g, 2) for g in range(8)] == [0, 1, 1, 0, 0, 1, 1, 0]
    seq = [order(g, 3) for g in range(12)]
    assert all(seq.count(j) == 4 for j in range(3))


def test_both_transports_deliver_every_message_in_one_pair_of_children():
    got = run_paired([Iox2Transport, BridgeTransport], 4096,
                     {"count": 120, "warmup": 10, "period_s": 5e-4, "fill": True})
    iox2_cleanup()
    assert "error" not in got, got
    assert set(got["lat"]) == {"iox2", "bridge"}
    for lat in got["lat"].values():
        assert lat.shape == (120,) and (lat > 0).all()
        assert np.median(lat) < 50_000_000     # ns: a wake-up, not a timeout
    assert set(got["same_cpu"]) == {"iox2", "bridge"}
    assert all(0.0 <= v <= 1.0 for v in got["same_cpu"].values())


def test_bursts_alternate_and_each_is_timed():
    """Throughput mode: every burst of both transports arrives whole (no sequence gaps
    at window 4 in an 8-deep ring), in rounds A B, B A, each with a positive duration."""
    got = run_paired([Iox2Transport, BridgeTransport], 4096,
                     {"rounds": 3, "burst": 60, "window": 4, "warmup": 5,
                      "warmup_stream": 16, "period_s": 5e-4, "fill": True},
                     mode="throughput")
    iox2_cleanup()
    assert "error" not in got, got
    assert got["gaps"] == 0
    for bursts in got["bursts"].values():
        assert len(bursts) == 3
        assert all(n == 59 and 0 < ns < 5_000_000_000 for n, ns in bursts)
    # What the bursts cost each child, per message: both children did real work on
    # both transports, and the placement share is a share.
    assert set(got["cost"]) == {"iox2", "bridge"}
    for c in got["cost"].values():
        assert c["wall_us"] > 0 and c["tx_cpu_us"] > 0 and c["rx_cpu_us"] > 0, c
        assert 0.0 <= c["same_cpu"] <= 1.0 and c["tx_faults"] >= 0.0, c
        assert 0.0 <= c["tx_full"] <= 1.0, c
