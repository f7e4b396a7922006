"""A hostile reader, in its own process, attacks the memory it was given read-only."""
from __future__ import annotations

import os

import numpy as np

from supervisor.ipc import Reader, Writer


def test_hostile_reader_cannot_write_or_open_by_name(make_channel, peers):
    ch = make_channel(name="victim", slot_count=3, max_readers=2)
    w = Writer(ch.writer_handle())
    w.publish_array(np.arange(256, dtype=np.uint8))
    before = bytes(os.pread(ch.writer_handle().data_fd, ch.spec.segment_size, 0))
    # The hostile reader attaches after the publish and gets that newest message.
    result = peers("hostile", ch.reader_handle(0)).read()
    attacks = {k: v for k, v in result.items() if isinstance(v, dict)}
    assert set(attacks) == {"numpy_write", "numpy_setflags", "memoryview_write",
                            "mmap_writable", "mprotect", "proc_self_mem", "fd_write",
                            "fd_truncate", "reopen_rw_and_map", "fchmod_then_reopen",
                            "open_by_name"}
    for name, outcome in attacks.items():
        assert outcome["denied"], f"attack {name} was not denied"
    assert result["still_valid"]
    # Not one byte of the writer's segment changed, and an honest reader still gets it.
    assert os.pread(ch.writer_handle().data_fd, ch.spec.segment_size, 0) == before
    with Reader(ch.reader_handle(1)).receive(timeout=1) as msg:
        assert np.array_equal(msg.array, np.arange(256, dtype=np.uint8))


def test_segments_have_no_names_and_are_sealed(make_channel):
    ch = make_channel(name="nameless", max_readers=1)
    Writer(ch.writer_handle())
    assert ch.writer_sealed()
    assert not [n for n in os.listdir("/dev/shm") if "nameless" in n or "trio" in n]
    st = os.fstat(ch.reader_handle(0).data_fd)
    assert st.st_mode & 0o777 == 0o400
    assert os.readlink(f"/proc/self/fd/{ch.reader_handle(0).data_fd}").startswith("/memfd:")


def test_a_reader_cannot_make_the_writer_block_through_its_wake_up(make_channel):
    """Red team: a reader that saturated the shared eventfd and cleared O_NONBLOCK on it
    made the writer's next publish block forever (camerad stalled into a fail-safe).
    Each reader now holds only its own end of a socketpair: whatever it does to it
    (blocking mode, never draining, stuffing it) the writer publishes on."""
    import fcntl
    import signal
    import time

    ch = make_channel(name="victim", slot_size=256, slot_count=4, max_readers=1)
    w = Writer(ch.writer_handle())
    fd = ch.reader_handle(0).event_fd
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    try:
        os.set_blocking(fd, False)
        while True:
            os.write(fd, b"x" * 65536)       # stuff the other direction too
    except BlockingIOError:
        pass
    os.set_blocking(fd, True)                  # and leave the reader's end blocking
    signal.alarm(20)                           # a blocked publish fails the test, not CI
    try:
        t0 = time.monotonic()
        for i in range(100_000):               # far past any socket buffer: never drained
            w.publish_array(np.full(4, i % 200, np.uint8))
        assert time.monotonic() - t0 < 15
    finally:
        signal.alarm(0)
    assert w.last_sequence == 100_000
