"""What the broker checks before it acts, as pure functions of its own config (no
request data reaches a decision without passing one of these).

* `check_plan`: the sandbox a start would build: never host uid 0 (nor the broker's own
  uid when it is root), never "/" or the state dir bound, read-write and device binds
  exactly those the config names for the domain.
* `check_channel_fds`: the fds a start hands the worker are the channel's own kind,
  name, size and access: memfds named for the channel (`ipc.shm.memfd_label`) of the
  spec's sizes, read-only where the role reads (a reader's segment, a writer's view of
  the lease tables), each the one the channel's first start brought (`ChannelPins`);
  wake-ups that are stream socketpair ends (unnamed, connected to no address, or
  labelled for their own place: `wake_label`). Never a
  directory, a device, a pipe or a file of the host (an fd of a host directory in a
  sandbox is a way out of its mount namespace), never a connection to anything else
  (the broker's own socket, a host daemon's): a compromised client cannot hand a
  reader the writer's segment, nor a research writer a control channel's (red team 10
  rows 1-3, 6).
* `StateDir`: the latch is written only inside the state directory the broker opened at
  start (by dir fd, O_NOFOLLOW, O_EXCL): a symlink planted there by anyone cannot make
  it write elsewhere.
"""
from __future__ import annotations

import fcntl
import os
import re
import socket
import stat
from dataclasses import dataclass, field

from supervisor.failsafe import (LATCH_NAME, latch_text, read_latch_text, reserve_latch,
                                 write_latch)
from supervisor.ipc.shm import wake_label  # noqa: F401  (the label's one home)

from ._errors import BadFds, Failed, Refused

# ---------------------------------------------------------------- the sandbox plan


def _covers(bind: str, path: str) -> bool:
    """`bind` is `path` or one of its ancestors (binding it shows `path`)."""
    b = bind.rstrip("/") or "/"
    return b == "/" or path == b or path.startswith(b + "/")


def check_plan(policy, *, domain_rw: tuple[str, ...], domain_dev: tuple[str, ...],
               state_dir: str, root: bool) -> None:
    """Refuse a sandbox policy the broker would not start (see the module doc)."""
    if root:
        if policy.host_uid is None or policy.host_gid is None:
            raise Refused(f"domain {policy.domain}: no host user to run as (never as root)")
        if policy.host_uid == 0 or policy.host_gid == 0:
            raise Refused(f"domain {policy.domain}: host uid/gid 0 (never as root)")
    for kind, binds in (("ro", policy.ro_binds), ("rw", policy.rw_binds),
                        ("dev", policy.dev_binds)):
        for b in binds:
            if os.path.abspath(b) == "/":
                raise Refused(f"domain {policy.domain}: {kind} bind of / (never the whole host)")
            if _covers(os.path.abspath(b), state_dir):
                raise Refused(f"domain {policy.domain}: {kind} bind {b} shows the "
                              f"broker's state dir {state_dir}")
    rw_named = {os.path.abspath(p) for p in domain_rw}
    extra = [b for b in policy.rw_binds if os.path.abspath(b) not in rw_named]
    if extra:
        raise Refused(f"domain {policy.domain}: rw binds not named by the config: {extra}")
    dev_named = {os.path.abspath(p) for p in domain_dev}
    extra = [b for b in policy.dev_binds if os.path.abspath(b) not in dev_named]
    if extra:
        raise Refused(f"domain {policy.domain}: device binds not named by the config: {extra}")


# ---------------------------------------------------------------- channel fds


@dataclass(frozen=True)
class _Fd:
    kind: str                  # "memfd" | "socket" | what else it is
    size: int = 0
    name: str = ""             # a memfd's label (ipc.shm.memfd_label)
    access: str = ""           # "r" | "rw" | "w" (the open file's mode)
    inode: tuple[int, int] = (0, 0)
    sock_type: int = 0
    listening: bool = False
    own: bytes = b""           # its own address (a labelled pair's writer end: wake_label)
    peer: bytes = b""          # its peer's (a labelled pair's reader end: wake_label)
    connected: bool = True

    @property
    def named(self) -> str:
        """Its own or its peer's address, for a refusal's line."""
        return "" if self.connected and not (self.own or self.peer) else \
            repr(self.own or self.peer or "(not connected)")[:80]


_ACCESS = {os.O_RDONLY: "r", os.O_RDWR: "rw", os.O_WRONLY: "w"}


def _fd_kind(fd: int) -> _Fd:
    """What an fd received from the client is."""
    try:
        st = os.fstat(fd)
        access = _ACCESS.get(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE, "?")
    except OSError as e:
        raise BadFds(f"fd {fd}: {e.strerror}") from None
    inode = (st.st_dev, st.st_ino)
    if stat.S_ISSOCK(st.st_mode):
        s = socket.socket(fileno=os.dup(fd))
        try:
            fam = s.family
            kind = "socket" if fam == socket.AF_UNIX else f"socket family {int(fam)}"
            if fam != socket.AF_UNIX:
                return _Fd(kind, access=access, inode=inode)
            own, peer, connected = _address(s.getsockname()), b"", True
            try:
                peer = _address(s.getpeername())
            except OSError:                    # not connected: no peer at all
                connected = False
            return _Fd(kind, access=access, inode=inode,
                       sock_type=s.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE),
                       listening=bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)),
                       own=own, peer=peer, connected=connected)
        finally:
            s.close()
    if stat.S_ISREG(st.st_mode):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = "?"
        # A memfd (also one reopened read-only through /proc/self/fd) reads
        # "/memfd:NAME (deleted)".
        if target.startswith("/memfd:"):
            return _Fd("memfd", st.st_size, target[len("/memfd:"):].removesuffix(" (deleted)"),
                       access=access, inode=inode)
        return _Fd(f"file {target[:80]}", st.st_size, access=access, inode=inode)
    kinds = {stat.S_IFDIR: "directory", stat.S_IFCHR: "character device",
             stat.S_IFBLK: "block device", stat.S_IFIFO: "pipe", stat.S_IFLNK: "symlink"}
    return _Fd(kinds.get(stat.S_IFMT(st.st_mode), "unknown"))


def _address(a: str | bytes) -> bytes:
    """An AF_UNIX address as bytes (Python gives a path as str, an abstract one as
    bytes starting with NUL; unnamed is empty)."""
    return a if isinstance(a, bytes) else os.fsencode(a)


# A wake-up pair's label (red team 10 row 8): the writer's end bound to an abstract address
# naming its channel and reader index, with a nonce of the channel's creation (never
# listening: nothing can connect to it, and a sandbox's own network namespace does not
# see it). The reader's end reads it as its peer's address. A pair is one place's: the
# label of the writer's end and the reader's end's peer are the same, which no other pair
# can have (one abstract address, one socket). `ipc.channel.Channel.create` binds it (the
# name beside `ipc.shm.memfd_label`'s memfd names).
_WAKE = re.compile(rb"\0trio-bridge:([A-Za-z0-9_][A-Za-z0-9_.-]{0,63}):wake([0-9]{1,4}):"
                   rb"[0-9a-f]{16}")


# Every wake-up pair carries its label (Channel.create binds it).
REQUIRE_WAKE_LABELS = True


def _wake_place(label: bytes) -> tuple[str, int] | None:
    """(channel, index) a wake-up label names; None if it is not one."""
    m = _WAKE.fullmatch(label)
    return (m.group(1).decode(), int(m.group(2))) if m else None


def expected_fds(spec, role: str) -> list[tuple[str, int, str, str]]:
    """(kind, size, access, place) of each fd of a channel handle, in
    WriterHandle.fds() / ReaderHandle.fds() order; size 0: not checked. The place
    names the fd within the channel (`ChannelPins`); a reader's lease table and
    wake-up end are numbered by its index ({index})."""
    if role == "writer":
        n = spec.max_readers
        return ([("memfd", spec.segment_size, "rw", "segment")]
                + [("memfd", spec.lease_size, "r", f"lease {i}") for i in range(n)]
                + [("socket", 0, "rw", f"wake-up {i} (writer's end)") for i in range(n)])
    return [("memfd", spec.segment_size, "r", "segment"),
            ("memfd", spec.lease_size, "rw", "lease {index}"),
            ("socket", 0, "rw", "wake-up {index} (reader's end)")]


@dataclass
class ChannelPins:
    """Which fd is which channel's (segment, lease table i, wake-up end i), fixed by the
    first start that brings it: a later start must bring the same one, and no fd may
    stand for two places. A check of one fd cannot tell two channels of one spec apart
    (red team 10 row 6: a research writer handed the control channel's writer handle)."""

    by_inode: dict[tuple[int, int], tuple[str, str]] = field(default_factory=dict)
    by_place: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    # A labelled wake-up pair's label, by (channel, reader index): the reader's end and
    # the writer's end of one place are the two ends of one pair.
    pairs: dict[tuple[str, int], bytes] = field(default_factory=dict)

    def check_pair(self, channel: str, index: int, label: bytes) -> None:
        had = self.pairs.get((channel, index))
        if had is not None and had != label:
            raise BadFds(f"channel {channel}'s wake-up {index}: another pair than at its "
                         f"first start")

    def check(self, place: tuple[str, str], inode: tuple[int, int]) -> None:
        had = self.by_place.get(place)
        if had is not None and had != inode:
            raise BadFds(f"channel {place[0]}'s {place[1]} is another fd than at its "
                         f"first start")
        other = self.by_inode.get(inode)
        if other is not None and other != place:
            raise BadFds(f"channel {place[0]}'s {place[1]} is channel {other[0]}'s "
                         f"{other[1]}")

    def pin(self, place: tuple[str, str], inode: tuple[int, int]) -> None:
        self.by_place[place], self.by_inode[inode] = inode, place


def check_channel_fds(channel: str, spec, role: str, fds: list[int], *,
                      pins: ChannelPins, index: int = 0) -> None:
    """Each fd as the role's handle has it (`expected_fds`): memfds of the channel's
    own names (`ipc.shm.memfd_label`), sizes and modes; wake-ups stream socketpair ends;
    each where `pins` says (pinned when all of them pass). A wake-up end that is the
    broker's own connection (SEQPACKET) or a connection to a host daemon (its address)
    is not one (red team 10 rows 2, 3)."""
    from supervisor.ipc.shm import memfd_label

    want = expected_fds(spec, role)
    if len(fds) != len(want):
        raise BadFds(f"channel {channel} ({role}): {len(fds)} fds, its handle has {len(want)}")
    places = []
    pairs: list[tuple[tuple[str, int], bytes]] = []
    for i, (fd, (kind, size, access, where)) in enumerate(zip(fds, want)):
        got = _fd_kind(fd)
        what = f"channel {channel} ({role}) fd #{i}"
        if got.kind != kind:
            raise BadFds(f"{what}: a {got.kind}, not a {kind}")
        if size and got.size != size:
            raise BadFds(f"{what}: {got.size} bytes, the spec says {size}")
        if kind == "memfd" and got.access != access:
            raise BadFds(f"{what}: open {got.access}, the {role}'s is {access} (a reader "
                         f"is never handed a writable segment)")
        place = (channel, where.format(index=index))
        if kind == "socket":
            # The writer's end i, or reader `index`'s end: a labelled pair's label names
            # that place (its own address for the writer's end, its peer's for the
            # reader's); an unlabelled pair has no address at either end.
            wake = i - 1 - spec.max_readers if role == "writer" else index
            label, other = (got.own, got.peer) if role == "writer" else (got.peer, got.own)
            labelled = _wake_place(label) if label and not other else None
            if (got.sock_type != socket.SOCK_STREAM or got.listening or not got.connected
                    or ((label or other) and labelled is None)):
                raise BadFds(f"{what}: not a stream socketpair end (type {got.sock_type}"
                             f"{', listening' if got.listening else ''}"
                             f"{', bound or connected to ' + got.named if got.named else ''})")
            if labelled is None and REQUIRE_WAKE_LABELS:
                raise BadFds(f"{what}: a wake-up pair without its label (made by "
                             f"Channel.create for one place, never another)")
            if labelled is not None and labelled != (channel, wake):
                raise BadFds(f"{what}: the wake-up end of channel {labelled[0]}'s reader "
                             f"{labelled[1]}, not channel {channel}'s {place[1]}")
            if labelled is not None:
                pins.check_pair(channel, wake, label)
                pairs.append(((channel, wake), label))
        if kind == "memfd":
            label = memfd_label(channel, None if where == "segment" else
                                int(place[1].split()[1]))
            if got.name != label:
                raise BadFds(f"{what}: the memfd {got.name[:80]!r}, not channel {channel}'s "
                             f"{place[1]} ({label!r})")
        # Pinned, one reader's end is never another's once seen; a labelled pair is its
        # place's from its creation (red team 10 row 8: control reader k's end, handed
        # to research reader rs before k's first start, carries k's label).
        pins.check(place, got.inode)
        places.append((place, got.inode))
    for place, inode in places:
        pins.pin(place, inode)
    for where, label in pairs:
        pins.pairs[where] = label


# ---------------------------------------------------------------- the state dir


@dataclass
class StateDir:
    """The state directory, held open by fd from the broker's start: every latch
    operation is relative to it and follows no symlink."""

    path: str
    fd: int

    @classmethod
    def open(cls, path: str) -> StateDir:
        """Made 0700 if missing; refused if it (the last component) is a symlink or not
        a directory."""
        path = os.path.abspath(path)
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise Refused(f"state dir {path}: {e.strerror}") from None
        # Only the broker's own, written by no one else: another owner, or a group or
        # world that may write it, could replace or remove the latch (red team round 4).
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o022:
            os.close(fd)
            raise Refused(f"state dir {path}: owned by uid {st.st_uid} with mode "
                          f"{st.st_mode & 0o777:o}; it must be the broker's own "
                          f"(uid {os.geteuid()}) and writable by no one else")
        try:
            reserve_latch(fd)        # the latch's blocks, before anything can fail safe
        except OSError as e:
            os.close(fd)
            raise Refused(f"state dir {path}: cannot hold the fail-safe latch: "
                          f"{e.strerror}") from None
        return cls(path, fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def set_latch(self, reason: str) -> None:
        """failsafe.write_latch in the held directory (fresh tmp file, fsync, rename;
        the reserve's blocks on a full file system)."""
        try:
            write_latch(self.fd, latch_text(reason, by="broker"))
        except OSError as e:
            raise Failed(f"latch in {self.path}: {e.strerror}") from None

    def reserve_latch(self) -> None:
        """failsafe.reserve_latch in the held directory; no room is `failed`."""
        try:
            reserve_latch(self.fd)
        except OSError as e:
            raise Failed(f"latch reserve in {self.path}: {e.strerror}", e.errno) from None

    def clear_latch(self) -> None:
        try:
            os.unlink(LATCH_NAME, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise Failed(f"latch in {self.path}: {e.strerror}") from None

    def read_latch(self) -> str:
        """The latch file's text ("" when there is none): failsafe.read_latch_text in the
        held directory. Not parsed here: the broker hands the bytes on."""
        return read_latch_text(self.fd)
