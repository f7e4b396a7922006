"""The live status line's arithmetic: frames lost to a restart are counted."""
from __future__ import annotations

from supervisor.monitor import ChannelView


def test_lost_counts_missing_intervals_after_a_gap():
    v = ChannelView("road_frames", None)
    t = 0
    for _ in range(20):
        t += 50_000_000
        v.note_capture(t)
    assert v.lost == 0
    t += 500_000_000            # a camera restart: 9 frames never published
    v.note_capture(t)
    assert v.lost == 9
    for _ in range(5):          # steady again: nothing more
        t += 50_000_000
        v.note_capture(t)
    assert v.lost == 9


def test_jitter_is_not_loss():
    v = ChannelView("x", None)
    t = 0
    for i in range(40):
        t += 50_000_000 + (10_000_000 if i % 3 else -10_000_000)
        v.note_capture(t)
    assert v.lost == 0
