"""The supervisor's last word (SAFE) is numbered above where every trusted reader is,
whatever the dead writer did to its own segment (red team round 3: it rolled the header
back, zeroed the magic, or had readers reject a message numbered far ahead, then put
every word back).

A reader's position (the highest sequence it consumed, delivered or rejected) lives in
its own lease table (layout OFF_TAKEN), which no writer can write; a message numbered
past any an honest writer reaches (layout SEQ_HONEST) is refused without moving the
reader. These tests forge the dead writer's segment directly (the test holds the memfd),
on both memory-ordering paths, and read the readers' tables as the supervisor does.
The same attacks from inside real sandboxes: tests/test_redteam_round3.py."""
from __future__ import annotations

import mmap
import struct

import numpy as np
import pytest

from schemas.payloads import CONTROL_CMD
from supervisor.config import loads
from supervisor.failsafe import publish_safe, trusted_readers
from supervisor.ipc import Reader, SequenceJump, Writer
from supervisor.ipc import _geometry as G
from supervisor.ipc import layout as L
from supervisor.ipc.errors import Rejected

NATIVE = pytest.mark.parametrize("native", [True, False], ids=["native", "python"])


def _channel(make_channel, readers: int = 2):
    return make_channel(name="control_cmd", slot_size=4096, dtype="float32",
                        max_readers=readers, slot_count=8)


def _drain(r: Reader) -> list[tuple[int, dict | str]]:
    out = []
    while True:
        try:
            m = r.try_receive()
        except Rejected as e:
            out.append((e.sequence or -1, e.reason))
            continue
        if m is None:
            return out
        with m:
            out.append((m.stamp[0], CONTROL_CMD.decode(np.array(m.array))))


def _position(ch, k: int) -> int:
    with mmap.mmap(ch.reader_handle(k).lease_fd, ch.spec.lease_size,
                   prot=mmap.PROT_READ) as mm:
        return L.U64.unpack_from(mm, L.OFF_TAKEN)[0]


def _commands(w: Writer, n: int) -> None:
    for _ in range(n):
        w.publish_array(CONTROL_CMD.encode(steer_rad=0.1, engaged=1.0))


def _safe_last(seen) -> bool:
    return bool(seen) and isinstance(seen[-1][1], dict) and seen[-1][1]["engaged"] == 0.0 \
        and seen[-1][1]["reason"] == 10.0


@NATIVE
def test_a_reader_says_where_it_is_even_for_a_message_it_rejected(make_channel, native):
    ch = _channel(make_channel)
    w = Writer(ch.writer_handle(), domain="control", seal=False)
    r = Reader(ch.reader_handle(0), native=native)
    _commands(w, 3)
    assert [s for s, _ in _drain(r)] == [1, 2, 3] and _position(ch, 0) == 3
    # The writer re-stamps its next message 100,000 ahead in the control block only:
    # the slot header inside says otherwise, so the reader rejects it, and moves on.
    _commands(w, 1)
    slot = L.LAST.unpack_from(w._buf, L.OFF_LAST_SEQ)[1]
    L.U64.pack_into(w._buf, G.control_offset(slot) + L.OFF_SEQ, 100_004)
    L.U64.pack_into(w._buf, L.OFF_LAST_SEQ, 100_004)
    got = _drain(r)
    assert got and got[0][1] != "sequence_jump" and not isinstance(got[0][1], dict), got
    assert _position(ch, 0) == 100_004        # consumed, and said so in its own table


@NATIVE
@pytest.mark.parametrize("poison", ["rollback", "magic", "rejected-far-ahead"])
def test_the_last_word_reaches_a_reader_whatever_the_dead_writer_left(make_channel, native,
                                                                     poison):
    ch = _channel(make_channel)
    w = Writer(ch.writer_handle(), domain="control", seal=False)
    r = Reader(ch.reader_handle(0), native=native)
    _commands(w, 5)
    seen = _drain(r)
    if poison == "rejected-far-ahead":
        _commands(w, 1)
        slot = L.LAST.unpack_from(w._buf, L.OFF_LAST_SEQ)[1]
        L.U64.pack_into(w._buf, G.control_offset(slot) + L.OFF_SEQ, 100_006)
        L.U64.pack_into(w._buf, L.OFF_LAST_SEQ, 100_006)
        seen += _drain(r)
        L.U64.pack_into(w._buf, G.control_offset(slot) + L.OFF_SEQ, 6)   # put back
        L.U64.pack_into(w._buf, L.OFF_LAST_SEQ, 6)
    elif poison == "rollback":
        L.U64.pack_into(w._buf, L.OFF_LAST_SEQ, 0)
        for i in range(ch.spec.slot_count):
            L.U64.pack_into(w._buf, G.control_offset(i) + L.OFF_SEQ, 0)
    else:
        L.U64.pack_into(w._buf, 0, 0)                       # the magic
        L.U64.pack_into(w._buf, L.OFF_LAST_SEQ, 0)
    w.close()
    publish_safe(ch, "control_cmd", trusted_readers(_config(), "control_cmd"))
    seen += _drain(r)
    assert _safe_last(seen), seen[-3:]


@NATIVE
def test_a_message_past_any_honest_writer_is_refused_without_moving_the_reader(
        make_channel, native):
    ch = _channel(make_channel)
    w = Writer(ch.writer_handle(), domain="control", seal=False)
    r = Reader(ch.reader_handle(0), native=native)
    _commands(w, 2)
    _drain(r)
    # A valid message numbered at the limit: refused once (counted once), not consumed.
    _commands(w, 1)
    slot = L.LAST.unpack_from(w._buf, L.OFF_LAST_SEQ)[1]
    far = L.SEQ_HONEST + 5
    L.U64.pack_into(w._buf, G.control_offset(slot) + L.OFF_SEQ, far)
    L.U64.pack_into(w._buf, L.OFF_LAST_SEQ, far)
    with pytest.raises(SequenceJump):
        r.try_receive()
    assert r.try_receive() is None and r.try_receive() is None       # not again
    assert r.stats.rejected == {"sequence_jump": 1} and _position(ch, 0) == 2
    # ... so what the supervisor says next still reaches it.
    w.close()
    publish_safe(ch, "control_cmd")
    assert _safe_last(_drain(r))


@pytest.mark.parametrize("claim", [L.SEQ_HONEST - 1, L.SEQ_HONEST, L.PLAUSIBLE - 2])
def test_a_reader_lying_about_its_position_cannot_hide_the_last_word(make_channel, claim):
    """A reader of the actuation channel (research, or a compromised control reader:
    red team round 4) writes a position near the limit in its own lease table. SAFE is
    published once above the segment and once above each position further on, so the
    honest reader's next message is a SAFE whatever the liar claims, and a restarted
    writer is heard by it afterwards."""
    cfg = _config()
    trusted = trusted_readers(cfg, "control_cmd")
    research = cfg.readers_of("control_cmd").index("shadow")
    assert research not in trusted and 0 in trusted and len(cfg.readers_of("control_cmd")) in trusted
    ch = make_channel(name="control_cmd", slot_size=4096, dtype="float32",
                      max_readers=len(cfg.readers_of("control_cmd")) + 1, slot_count=8)
    w = Writer(ch.writer_handle(), domain="control", seal=False)
    honest = Reader(ch.reader_handle(0))
    liar = Reader(ch.reader_handle(research))
    _commands(w, 4)
    _drain(honest)
    _drain(liar)
    w.close()
    struct.pack_into("<Q", liar._lease_mm, L.OFF_TAKEN, claim)          # its own table
    # Every reader counted (as if the liar were a control reader): still heard.
    publish_safe(ch, "control_cmd", range(ch.spec.max_readers))
    got = _drain(honest)
    assert got and isinstance(got[0][1], dict) and _safe_last(got[:1]), got
    assert all(isinstance(x, dict) and x["engaged"] == 0.0 for _, x in got
               if isinstance(x, dict)), got
    # A restarted (clean) writer is heard after it.
    w = Writer(ch.writer_handle(), domain="control", seal=False)
    _commands(w, 2)
    w.close()
    after = [x for _, x in _drain(honest) if isinstance(x, dict)]
    assert len(after) == 2 and all(x["engaged"] == 1.0 for x in after), after


def _config():
    return loads('''
[domains.control]
profile = "control"
[domains.research]
profile = "research"
[channels.control_cmd]
kind = "tensor"
dtype = "float32"
slot_size = "4KiB"
payload = "control_cmd"
max_age_ms = 1000     # a vehicle actuation channel's age limit (config/_rules.py)
[workers.controlsd]
domain = "control"
module = "workers.controlsd"
publishes = ["control_cmd"]
[workers.logger]
domain = "control"
module = "workers.recorder"
subscribes = ["control_cmd"]
[workers.shadow]
domain = "research"
module = "workers.research"
shadow_subscribes = ["control_cmd"]
''', "lastword.toml")


# ---------------------------------------------------------------- a restarted writer

H, SPAN = L.SEQ_HONEST, 16


@pytest.mark.parametrize("segment, positions, anchor, want", [
    (7, [5, 9], None, 9),                       # honest numbers: above everyone
    (7, [5, 9], 9, 9),
    (3, [H + 4], None, H + 4),                  # walked up, the only reader: followed
    (3, [H + 4, H + 2], None, H + 4),           # two readers walked up together
    (3, [H + 4, 5], H + 3, H + 4),              # the monitor walked up with them
    (3, [H + 10**9, 5], None, 5),               # one reader's lie, not corroborated
    (3, [H + 10**9, 5], 5, 5),                  # ... nor by the monitor
    (3, [H + 10**9, H + 4], H + 4, H + 4),      # the monitor decides
    (3, [H - 10, 2], None, H - 10),             # below SEQ_HONEST: every reader hears it
    (3, [H - 1, 6], None, 6),                   # ... but not from just below it
    (3, [H - 1, 6], 6, 6),
    (3, [L.PLAUSIBLE + 5], None, 3),            # never reached by counting
])
def test_resume_point(segment, positions, anchor, want):
    assert L.resume_point(segment, positions, anchor, SPAN) == want


@NATIVE
def test_a_lying_control_reader_cannot_number_a_restarted_writer_out_of_reach(
        make_channel, native):
    """A control reader claims a position far past SEQ_HONEST; the writer restarts: it
    numbers within reach of the honest reader and the supervisor's monitor (the anchor),
    who hear it; a writer that followed the lie would be unheard by both (SequenceJump)."""
    ch = _channel(make_channel, readers=3)
    ch.trust((0, 1, 2), anchor=2)
    first = Writer(ch.writer_handle(), domain="control", seal=False, native=native)
    honest, liar, monitor = (Reader(ch.reader_handle(k), native=native) for k in range(3))
    _commands(first, 3)
    for r in (honest, liar, monitor):
        _drain(r)
    struct.pack_into("<Q", liar._lease_mm, L.OFF_TAKEN, L.SEQ_HONEST + 10**9)
    first.close()
    again = Writer(ch.writer_handle(), domain="control", seal=False, native=native)
    _commands(again, 2)
    assert again.last_sequence < L.SEQ_HONEST
    for r in (honest, monitor):
        got = _drain(r)
        assert [s for s, _ in got] == [4, 5], (got, r.stats.rejected)
    again.close()
