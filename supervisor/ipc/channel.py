"""Creating a channel and handing it out as file descriptors.

The creator (the supervisor) allocates every segment and wake-up socket, but writes none of
them: the channel segment is written only by the writer, each lease table only by its
reader. Endpoints get fds, never names: nothing here has a name to open.
"""
from __future__ import annotations

import json
import mmap
import os
import socket
from dataclasses import asdict, dataclass

from . import layout, shm
from .errors import ConfigError
from .spec import ChannelSpec

ENV_PREFIX = "TRIO_BRIDGE_"


def _spec_from(d: dict) -> ChannelSpec:
    d = dict(d)
    d["pixel_formats"] = tuple(d.get("pixel_formats", ()))
    d.pop("extra", None)
    return ChannelSpec(**d)


@dataclass(frozen=True)
class WriterHandle:
    """What the single writer of a channel needs: the segment read-write, every
    reader's lease table read-only, and every reader's wake-up socket (its own end)."""

    spec: ChannelSpec
    data_fd: int
    lease_fds: tuple[int, ...]
    event_fds: tuple[int, ...]
    # Whose positions a (re)started writer numbers above (layout.resume_point): the
    # readers the supervisor trusts on this channel, and its own monitor's index.
    resume_above: tuple[int, ...] = ()
    anchor: int | None = None

    def fds(self) -> list[int]:
        return [self.data_fd, *self.lease_fds, *self.event_fds]

    def to_json(self) -> str:
        return json.dumps({"role": "writer", "spec": _spec_dict(self.spec),
                           "data_fd": self.data_fd, "lease_fds": list(self.lease_fds),
                           "event_fds": list(self.event_fds),
                           "resume_above": list(self.resume_above), "anchor": self.anchor})

    @classmethod
    def from_json(cls, text: str) -> WriterHandle:
        d = _load(text, "writer")
        anchor = d.get("anchor")
        return cls(_spec_from(d["spec"]), d["data_fd"], tuple(d["lease_fds"]),
                   tuple(d["event_fds"]), tuple(int(i) for i in d.get("resume_above", ())),
                   None if anchor is None else int(anchor))


@dataclass(frozen=True)
class ReaderHandle:
    """What reader ``index`` needs: the segment read-only, its own lease table
    read-write, and its own end of its wake-up socket."""

    spec: ChannelSpec
    index: int
    data_fd: int
    lease_fd: int
    event_fd: int

    def fds(self) -> list[int]:
        return [self.data_fd, self.lease_fd, self.event_fd]

    def to_json(self) -> str:
        return json.dumps({"role": "reader", "spec": _spec_dict(self.spec),
                           "index": self.index, "data_fd": self.data_fd,
                           "lease_fd": self.lease_fd, "event_fd": self.event_fd})

    @classmethod
    def from_json(cls, text: str) -> ReaderHandle:
        d = _load(text, "reader")
        return cls(_spec_from(d["spec"]), d["index"], d["data_fd"], d["lease_fd"],
                   d["event_fd"])


def _spec_dict(spec: ChannelSpec) -> dict:
    d = asdict(spec)
    d.pop("extra", None)
    return d


def _load(text: str, role: str) -> dict:
    try:
        d = json.loads(text)
        if d.get("role") != role:
            raise ConfigError(f"handle is for a {d.get('role')!r}, not a {role}")
        return d
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"bad {role} handle: {e}") from None


def env_name(channel: str) -> str:
    return ENV_PREFIX + channel.upper()


class Channel:
    """Owns the fds of one channel (in the supervisor or a test)."""

    def __init__(self, spec: ChannelSpec, data_fd: int, lease_fds: list[int],
                 event_fds: list[int], reader_event_fds: list[int] | None = None) -> None:
        self.spec = spec
        self._data_fd = data_fd
        # One read-only open file description per reader index, made when first handed
        # out: readers of different domains must not share flags, offset or locks (a
        # research reader's fcntl/lseek would otherwise be visible to a control reader).
        self._data_ro: dict[int, int] = {}
        self._lease_fds = lease_fds
        self._lease_ro = [shm.reopen_read_only(fd) for fd in lease_fds]
        self._event_fds = event_fds
        # The reader's end of each wake-up socket (the writer holds the other end): no
        # open file description is shared, so nothing a reader does to its fd (flags,
        # filling it) can make the writer block.
        self._reader_event_fds = reader_event_fds if reader_event_fds is not None else event_fds
        self._closed = False
        # Whose positions a restarted writer numbers above: every reader and no monitor
        # until the supervisor says which it trusts (trust()).
        self._resume_above: tuple[int, ...] = tuple(range(spec.max_readers))
        self._anchor: int | None = None
        self._head: mmap.mmap | None = None       # the header, read-only (last_sequence)

    def trust(self, readers: tuple[int, ...], anchor: int | None) -> None:
        """The reader indexes whose positions a (re)started writer continues above, and
        the supervisor's own monitor's (failsafe.trusted_readers, Config.monitor_index)."""
        self._resume_above = tuple(i for i in readers if 0 <= i < self.spec.max_readers)
        self._anchor = anchor if anchor is not None and 0 <= anchor < self.spec.max_readers \
            else None

    @classmethod
    def create(cls, spec: ChannelSpec) -> Channel:
        data = shm.create_segment(shm.memfd_label(spec.name), spec.segment_size)
        leases = [shm.create_segment(shm.memfd_label(spec.name, i), spec.lease_size)
                  for i in range(spec.max_readers)]
        # Wake-ups: one stream socketpair per reader. The writer writes a byte to its
        # end (non-blocking, its own description); the reader's end blocks, so that the
        # reader sleeps in one read that also drains it (Reader._wait).
        # The writer's end is bound to the pair's label (shm.wake_label): whose end it
        # is, for the broker (red team 10 row 8).
        writer_ends, reader_ends = [], []
        nonce = os.urandom(8).hex()
        for i in range(spec.max_readers):
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            a.bind(shm.wake_label(spec.name, i, nonce))
            a.setblocking(False)
            b.setblocking(True)
            writer_ends.append(a.detach())
            reader_ends.append(b.detach())
        return cls(spec, data, leases, writer_ends, reader_ends)

    def writer_handle(self) -> WriterHandle:
        return WriterHandle(self.spec, self._data_fd, tuple(self._lease_ro),
                            tuple(self._event_fds), self._resume_above, self._anchor)

    def reader_handle(self, index: int) -> ReaderHandle:
        if not 0 <= index < self.spec.max_readers:
            raise ConfigError(f"channel {self.spec.name!r} has reader slots "
                              f"0..{self.spec.max_readers - 1}, not {index}")
        if index not in self._data_ro:
            self._data_ro[index] = shm.reopen_read_only(self._data_fd)
        return ReaderHandle(self.spec, index, self._data_ro[index], self._lease_fds[index],
                            self._reader_event_fds[index])

    def last_sequence(self) -> int:
        """The sequence number of the newest message published (0: none yet), from the
        channel header, whoever writes it: the supervisor's proof that an actuation
        writer still writes (its watchdog, red team 16 row 5). One aligned 8-byte load."""
        if self._head is None:
            self._head = mmap.mmap(self._data_fd, min(mmap.PAGESIZE, self.spec.segment_size),
                                   flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        return layout.U64.unpack_from(self._head, layout.OFF_LAST_SEQ)[0]

    def writer_sealed(self) -> bool:
        """True once the writer has mapped the segment and sealed out other writers."""
        return shm.is_write_sealed(self._data_fd)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._head is not None:
            self._head.close()
        ends = [*self._event_fds, *(fd for fd in self._reader_event_fds
                                    if fd not in self._event_fds)]
        for fd in [self._data_fd, *self._data_ro.values(), *self._lease_fds, *self._lease_ro,
                   *ends]:
            try:
                os.close(fd)
            except OSError:
                pass

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
