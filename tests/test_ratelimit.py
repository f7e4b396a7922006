"""The one token bucket behind every per-worker rate (output lines, status lines and
events, exec-watch requests): its arithmetic, driven by a passed-in clock."""
from __future__ import annotations

from supervisor.ratelimit import TokenBucket


def test_full_at_first_look_then_refills_at_rate_up_to_depth():
    b = TokenBucket(rate=10.0, depth=5.0)
    assert b.level(100.0) == 5.0
    assert [b.take(100.0) for _ in range(6)] == [True] * 5 + [False]
    assert b.level(100.25) == 2.5                  # 10/s for a quarter second
    assert b.level(200.0) == 5.0                   # never more than its depth


def test_take_takes_nothing_when_it_cannot_pay():
    b = TokenBucket(rate=1.0, depth=3.0)
    assert not b.take(0.0, cost=4.0)
    assert b.level(0.0) == 3.0                     # a refused take took nothing


def test_charge_goes_into_debt_down_to_its_floor():
    b = TokenBucket(rate=1000.0, depth=100.0, tokens=10.0, at=0.0)
    assert b.charge(0.0, 50.0) == -40.0            # work already done is paid for
    assert b.charge(0.01, 5.0) == -35.0            # 10 tokens back in 10 ms
    assert b.charge(0.01, 99.0, floor=0.0) == 0.0


def test_a_clock_that_goes_back_refills_nothing():
    b = TokenBucket(rate=10.0, depth=5.0, tokens=1.0, at=50.0)
    assert b.level(40.0) == 1.0
