"""The broker's wire: typed requests and replies, their Cap'n Proto encoding
(schemas/broker.capnp), and one datagram per message over a SOCK_SEQPACKET socket with
fds beside it (SCM_RIGHTS).

Decoding is the broker's whole attack surface towards the supervisor proper, so it is
small and closed: a datagram over MAX_MESSAGE or with more than MAX_FDS fds is cut by
the kernel and refused whole; the capnp reader runs under a traversal and nesting limit;
every field is copied into a frozen dataclass and bounded here (names, lengths, enum
values, pids), and any exception of the capnp reader becomes `Malformed`. Nothing past
`decode_request` ever sees a capnp object."""
from __future__ import annotations

import array
import os
import re
import select
import signal as _signal
import socket
from dataclasses import dataclass
from typing import Union

import capnp

from schemas import load as _load_schema

from ._errors import ERRORS, BadFds, BrokerError, Malformed, TooLarge

_S = _load_schema("broker")

MAX_MESSAGE = 8192          # bytes: a start with 64 grants is ~2 KiB
MAX_FDS = 64                # per message, either way
MAX_GRANTS = 32
MAX_REASON = 1024           # characters of a latch reason
_TRAVERSAL_WORDS = 4 * MAX_MESSAGE // 8   # no amplification beyond 4x the message
_NESTING = 8
# Worker and channel names as the config allows them, bounded for the log.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")

SIGNALS: dict[str, int] = {"term": _signal.SIGTERM, "kill": _signal.SIGKILL,
                           "int": _signal.SIGINT, "hup": _signal.SIGHUP,
                           "usr1": _signal.SIGUSR1, "usr2": _signal.SIGUSR2}
SIGNAL_NAMES = {v: k for k, v in SIGNALS.items()}
PROC_FILES = ("status", "stat", "maps", "mountinfo", "cgroup", "mem", "pagemap")
MAX_FD = 1 << 20            # fs.nr_open cannot be set higher: no fd number reaches it
PAGE = 4096


# ---------------------------------------------------------------- requests

@dataclass(frozen=True)
class Grant:
    channel: str
    role: str            # "writer" | "reader"
    fd_count: int


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class Start:
    worker: str
    incarnation: int
    standby: bool = False
    channels: tuple[Grant, ...] = ()


@dataclass(frozen=True)
class Adopt:
    """A warm standby's hand-over: its channels, judged as a start's, sent to it by the
    broker (red team 10 row 9)."""

    worker: str
    incarnation: int
    channels: tuple[Grant, ...] = ()


@dataclass(frozen=True)
class SignalPid:
    pid: int
    signal: str          # a key of SIGNALS


@dataclass(frozen=True)
class KillSandbox:
    worker: str
    incarnation: int


@dataclass(frozen=True)
class Reap:
    worker: str
    incarnation: int


@dataclass(frozen=True)
class Pids:
    worker: str
    incarnation: int


@dataclass(frozen=True)
class OpenProc:
    pid: int
    files: tuple[str, ...]


@dataclass(frozen=True)
class OpenFd:
    pid: int
    fd: int


@dataclass(frozen=True)
class OpenMapFile:
    pid: int
    start: int
    end: int


@dataclass(frozen=True)
class OpenMapFiles:
    pid: int
    ranges: tuple[tuple[int, int], ...]     # (start, end), page-aligned, 1..MAX_FDS


@dataclass(frozen=True)
class SignalThread:
    pid: int
    tid: int
    stop: bool           # SIGSTOP, else SIGCONT


@dataclass(frozen=True)
class OpenPidNs:
    pid: int


@dataclass(frozen=True)
class ReadFilters:
    pid: int


@dataclass(frozen=True)
class SetLatch:
    reason: str


@dataclass(frozen=True)
class ClearLatch:
    pass


@dataclass(frozen=True)
class ReadLatch:
    pass


@dataclass(frozen=True)
class ReserveLatch:
    pass


@dataclass(frozen=True)
class Realtime:
    worker: str
    incarnation: int


Request = Union[Ping, Start, SignalPid, KillSandbox, Reap, Pids, OpenProc, SetLatch,
                ClearLatch, ReadLatch, Realtime, OpenFd, OpenMapFile, SignalThread,
                OpenPidNs, ReadFilters, OpenMapFiles, ReserveLatch, Adopt]
# The requests whose fds are a worker's channels (every other request takes none).
WITH_CHANNELS = (Start, Adopt)
_SANDBOX_REQUESTS = {"killSandbox": KillSandbox, "reap": Reap, "pids": Pids,
                     "realtime": Realtime}
_KIND = {Ping: "ping", Start: "start", SignalPid: "signal", KillSandbox: "killSandbox",
         Reap: "reap", Pids: "pids", OpenProc: "openProc", SetLatch: "setLatch",
         ClearLatch: "clearLatch", ReadLatch: "readLatch", Realtime: "realtime",
         OpenFd: "openFd", OpenMapFile: "openMapFile", SignalThread: "signalThread",
         OpenPidNs: "openPidNs", ReadFilters: "readFilters",
         OpenMapFiles: "openMapFiles", ReserveLatch: "reserveLatch", Adopt: "adopt"}


def kind_of(req: Request) -> str:
    """The request's name in the schema (the `request` field of broker events)."""
    return _KIND[type(req)]


# ---------------------------------------------------------------- replies

@dataclass(frozen=True)
class Ok:
    pass


@dataclass(frozen=True)
class Started:
    pid: int
    host_uid: int
    cgroup: bool
    exec_watch: bool
    control: bool


@dataclass(frozen=True)
class Reaped:
    exited: bool
    code: int = 0
    oom_kills: int = 0


@dataclass(frozen=True)
class PidList:
    pids: tuple[int, ...]


@dataclass(frozen=True)
class Opened:
    files: tuple[str, ...]


@dataclass(frozen=True)
class Link:
    """One O_PATH fd travels with it (openFd, openMapFile, openPidNs)."""


@dataclass(frozen=True)
class Filters:
    """readFilters: the W^X program found on every thread (sandbox/wx.py `verify`, run by
    the broker); ptrace False: the broker could not read filters back either."""

    ptrace: bool
    ok: bool
    reason: str = ""
    threads: int = 0
    micros: int = 0


@dataclass(frozen=True)
class Links:
    """openMapFiles: per range, whether it was mapped (one O_PATH fd per True, in order)."""

    found: tuple[bool, ...]


@dataclass(frozen=True)
class Latch:
    text: str            # "" when not latched


@dataclass(frozen=True)
class Error:
    code: str
    reason: str
    errno: int = 0

    def exception(self) -> BrokerError:
        return ERRORS.get(self.code, ERRORS["failed"])(self.reason, self.errno)


Reply = Union[Ok, Started, Reaped, PidList, Opened, Link, Latch, Error, Filters, Links]


def reply_fd_count(rep: Reply) -> int:
    """How many fds travel with this reply (the client refuses any other count)."""
    if isinstance(rep, Started):
        return 3 + rep.exec_watch        # a standby's control socket stays the broker's
    if isinstance(rep, Opened):
        return 1 + len(rep.files)
    if isinstance(rep, Link):
        return 1
    if isinstance(rep, Links):
        return sum(rep.found)
    return 0


# ---------------------------------------------------------------- encoding

def _encode_grants(s, grants: tuple[Grant, ...]) -> None:
    gl = s.init("channels", len(grants))
    for i, g in enumerate(grants):
        gl[i].channel, gl[i].role, gl[i].fdCount = g.channel, g.role, g.fd_count


def encode_request(rid: int, req: Request) -> bytes:
    m = _S.Request.new_message()
    m.id = rid
    if isinstance(req, Ping):
        m.ping = None
    elif isinstance(req, Start):
        s = m.init("start")
        s.worker, s.incarnation, s.standby = req.worker, req.incarnation, req.standby
        _encode_grants(s, req.channels)
    elif isinstance(req, Adopt):
        s = m.init("adopt")
        s.worker, s.incarnation = req.worker, req.incarnation
        _encode_grants(s, req.channels)
    elif isinstance(req, SignalPid):
        s = m.init("signal")
        s.pid, s.signal = req.pid, req.signal
    elif isinstance(req, (KillSandbox, Reap, Pids, Realtime)):
        s = m.init(kind_of(req))
        s.worker, s.incarnation = req.worker, req.incarnation
    elif isinstance(req, OpenProc):
        s = m.init("openProc")
        s.pid = req.pid
        fl = s.init("files", len(req.files))
        for i, f in enumerate(req.files):
            fl[i] = f
    elif isinstance(req, OpenFd):
        s = m.init("openFd")
        s.pid, s.fd = req.pid, req.fd
    elif isinstance(req, OpenMapFile):
        s = m.init("openMapFile")
        s.pid, s.start, s.end = req.pid, req.start, req.end
    elif isinstance(req, SignalThread):
        s = m.init("signalThread")
        s.pid, s.tid, s.stop = req.pid, req.tid, req.stop
    elif isinstance(req, OpenPidNs):
        m.openPidNs = req.pid
    elif isinstance(req, ReadFilters):
        m.readFilters = req.pid
    elif isinstance(req, OpenMapFiles):
        s = m.init("openMapFiles")
        s.pid = req.pid
        rl = s.init("ranges", len(req.ranges))
        for i, (start, end) in enumerate(req.ranges):
            rl[i].start, rl[i].end = start, end
    elif isinstance(req, SetLatch):
        m.setLatch = req.reason
    elif isinstance(req, ClearLatch):
        m.clearLatch = None
    elif isinstance(req, ReadLatch):
        m.readLatch = None
    elif isinstance(req, ReserveLatch):
        m.reserveLatch = None
    else:
        raise TypeError(f"not a broker request: {req!r}")
    return m.to_bytes()


def encode_reply(rid: int, rep: Reply) -> bytes:
    m = _S.Reply.new_message()
    m.id = rid
    if isinstance(rep, Ok):
        m.ok = None
    elif isinstance(rep, Started):
        s = m.init("started")
        s.pid, s.hostUid, s.cgroup = rep.pid, rep.host_uid, rep.cgroup
        s.execWatch, s.control = rep.exec_watch, rep.control
    elif isinstance(rep, Reaped):
        s = m.init("reaped")
        s.exited, s.code, s.oomKills = rep.exited, rep.code, min(rep.oom_kills, 2**32 - 1)
    elif isinstance(rep, PidList):
        pl = m.init("pids", len(rep.pids))
        for i, p in enumerate(rep.pids):
            pl[i] = p
    elif isinstance(rep, Opened):
        fl = m.init("opened", len(rep.files))
        for i, f in enumerate(rep.files):
            fl[i] = f
    elif isinstance(rep, Link):
        m.link = None
    elif isinstance(rep, Latch):
        m.latch = rep.text
    elif isinstance(rep, Links):
        fl = m.init("links", len(rep.found))
        for i, f in enumerate(rep.found):
            fl[i] = f
    elif isinstance(rep, Filters):
        f = m.init("filters")
        f.ptrace, f.ok, f.reason = rep.ptrace, rep.ok, rep.reason[:MAX_REASON]
        f.threads = min(rep.threads, 2**32 - 1)
        f.micros = min(max(rep.micros, 0), 2**32 - 1)
    elif isinstance(rep, Error):
        e = m.init("error")
        e.code, e.reason, e.errno = rep.code, rep.reason[:MAX_REASON], rep.errno
    else:
        raise TypeError(f"not a broker reply: {rep!r}")
    return m.to_bytes()


# ---------------------------------------------------------------- decoding

# What the capnp reader (or a field read on a hostile message) may raise: all of it is
# "not a message of this schema".
_READ_ERRORS = (capnp.KjException, ValueError, UnicodeError, AttributeError, TypeError,
                IndexError, OverflowError, KeyError, RuntimeError)


def _name(v: object, what: str) -> str:
    if not isinstance(v, str) or not _NAME.match(v):
        raise Malformed(f"{what}: not a name: {str(v)[:64]!r}")
    return v


def _pid(v: int) -> int:
    if not 0 < v < 2**22 + 1:          # pid_max is at most 4194304
        raise Malformed(f"pid {v} out of range")
    return v


def _enum(v: object, allowed: tuple[str, ...] | dict, what: str) -> str:
    try:
        s = str(v)
    except RuntimeError:       # pycapnp: a number past the schema's enumerants ("Member was null")
        raise Malformed(f"{what}: a value past the schema's") from None
    if s not in allowed:
        raise Malformed(f"{what}: unknown value {s[:32]!r}")
    return s


def _range(start: int, end: int, what: str) -> tuple[int, int]:
    if start % PAGE or end % PAGE or not start < end:
        raise Malformed(f"{what}: {start:#x}-{end:#x} is not a page-aligned range")
    return start, end


def _grants(channels) -> tuple[Grant, ...]:
    grants = list(channels)
    if len(grants) > MAX_GRANTS:
        raise Malformed(f"{len(grants)} channel grants (at most {MAX_GRANTS})")
    return tuple(Grant(_name(g.channel, "channel"), _enum(g.role, ("writer", "reader"), "role"),
                       int(g.fdCount)) for g in grants)


def _body(m) -> Request:
    which = str(m.which())
    if which == "ping":
        return Ping()
    if which == "start":
        s = m.start
        return Start(worker=_name(s.worker, "worker"), incarnation=int(s.incarnation),
                     standby=bool(s.standby), channels=_grants(s.channels))
    if which == "adopt":
        s = m.adopt
        return Adopt(worker=_name(s.worker, "worker"), incarnation=int(s.incarnation),
                     channels=_grants(s.channels))
    if which == "signal":
        return SignalPid(_pid(int(m.signal.pid)), _enum(m.signal.signal, SIGNALS, "signal"))
    if which in _SANDBOX_REQUESTS:
        s = getattr(m, which)
        return _SANDBOX_REQUESTS[which](_name(s.worker, "worker"), int(s.incarnation))
    if which == "openProc":
        files = [str(f) for f in m.openProc.files]
        if not files or len(files) > len(PROC_FILES) or len(set(files)) != len(files):
            raise Malformed(f"openProc: {len(files)} files (1..{len(PROC_FILES)}, distinct)")
        return OpenProc(_pid(int(m.openProc.pid)),
                        tuple(_enum(f, PROC_FILES, "file") for f in files))
    if which == "openFd":
        fd = int(m.openFd.fd)
        if not 0 <= fd < MAX_FD:
            raise Malformed(f"openFd: fd {fd} out of range (0..{MAX_FD - 1})")
        return OpenFd(_pid(int(m.openFd.pid)), fd)
    if which == "openMapFile":
        s = m.openMapFile
        return OpenMapFile(_pid(int(s.pid)), *_range(int(s.start), int(s.end), which))
    if which == "openMapFiles":
        s = m.openMapFiles
        ranges = list(s.ranges)
        if not 0 < len(ranges) <= MAX_FDS:
            raise Malformed(f"openMapFiles: {len(ranges)} ranges (1..{MAX_FDS})")
        return OpenMapFiles(_pid(int(s.pid)), tuple(_range(int(r.start), int(r.end), which)
                                                    for r in ranges))
    if which == "signalThread":
        s = m.signalThread
        return SignalThread(_pid(int(s.pid)), _pid(int(s.tid)), bool(s.stop))
    if which == "openPidNs":
        return OpenPidNs(_pid(int(m.openPidNs)))
    if which == "readFilters":
        return ReadFilters(_pid(int(m.readFilters)))
    if which == "setLatch":
        reason = str(m.setLatch)
        if len(reason) > MAX_REASON or not reason.isprintable():
            raise Malformed(f"latch reason: {len(reason)} characters, printable, "
                            f"at most {MAX_REASON}")
        return SetLatch(reason)
    if which == "clearLatch":
        return ClearLatch()
    if which == "readLatch":
        return ReadLatch()
    if which == "reserveLatch":
        return ReserveLatch()
    raise Malformed(f"unknown request {which[:32]!r}")


def decode_request(data: bytes) -> tuple[int, Request]:
    """(id, request) of one datagram; raises Malformed/TooLarge, never anything else."""
    if len(data) > MAX_MESSAGE:
        raise TooLarge(f"{len(data)} bytes (at most {MAX_MESSAGE})")
    if not data or len(data) % 8:
        raise Malformed(f"{len(data)} bytes: not a whole number of capnp words")
    rid = 0
    try:
        with _S.Request.from_bytes(data, traversal_limit_in_words=_TRAVERSAL_WORDS,
                                   nesting_limit=_NESTING) as m:
            rid = int(m.id)
            return rid, _body(m)
    except BrokerError as e:
        # The id was readable: the refusal answers that request by id. Id 0 (answered
        # in order by the client) is then left to datagrams the kernel cut, so a
        # malformed request never takes the place of another thread's reply.
        e.rid = rid
        raise
    except _READ_ERRORS as e:
        raise Malformed(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") \
            from None


def decode_reply(data: bytes) -> tuple[int, Reply]:
    """(id, reply) of one datagram from the broker; raises Malformed on anything else."""
    if not data or len(data) % 8 or len(data) > MAX_MESSAGE:
        raise Malformed(f"reply of {len(data)} bytes")
    try:
        with _S.Reply.from_bytes(data, traversal_limit_in_words=_TRAVERSAL_WORDS,
                                 nesting_limit=_NESTING) as m:
            rid, which = int(m.id), str(m.which())
            if which == "ok":
                return rid, Ok()
            if which == "started":
                s = m.started
                return rid, Started(int(s.pid), int(s.hostUid), bool(s.cgroup),
                                    bool(s.execWatch), bool(s.control))
            if which == "reaped":
                r = m.reaped
                return rid, Reaped(bool(r.exited), int(r.code), int(r.oomKills))
            if which == "pids":
                return rid, PidList(tuple(int(p) for p in m.pids))
            if which == "opened":
                return rid, Opened(tuple(_enum(f, PROC_FILES, "file") for f in m.opened))
            if which == "link":
                return rid, Link()
            if which == "latch":
                return rid, Latch(str(m.latch))
            if which == "links":
                found = tuple(bool(f) for f in m.links)
                if len(found) > MAX_FDS:
                    raise Malformed(f"{len(found)} links")
                return rid, Links(found)
            if which == "filters":
                f = m.filters
                return rid, Filters(bool(f.ptrace), bool(f.ok), str(f.reason)[:MAX_REASON],
                                    int(f.threads), int(f.micros))
            if which == "error":
                return rid, Error(str(m.error.code), str(m.error.reason), int(m.error.errno))
            raise Malformed(f"unknown reply {which[:32]!r}")
    except BrokerError:
        raise
    except _READ_ERRORS as e:
        raise Malformed(f"reply: {type(e).__name__}") from None


# ---------------------------------------------------------------- the socket

def send(sock: socket.socket, data: bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
    """One datagram, its fds beside it (the caller keeps and closes its own copies)."""
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendmsg([data])


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def recv(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """One datagram and the fds that came with it; None at end of stream (the peer
    closed). A datagram cut by the kernel (over MAX_MESSAGE bytes, over MAX_FDS fds) is
    refused whole, and every fd that did arrive is closed first."""
    data, anc, flags, _ = sock.recvmsg(MAX_MESSAGE + 1, socket.CMSG_SPACE(MAX_FDS * 4),
                                       socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(payload[:len(payload) - len(payload) % a.itemsize])
            fds += list(a)
    if flags & socket.MSG_TRUNC or len(data) > MAX_MESSAGE:
        close_fds(fds)
        raise TooLarge(f"a datagram over {MAX_MESSAGE} bytes")
    if flags & socket.MSG_CTRUNC:
        close_fds(fds)
        raise BadFds(f"more than {MAX_FDS} fds")
    if not data and not fds:
        # SOCK_SEQPACKET reads 0 bytes both at the peer's close and for an empty
        # datagram: only a hang-up ends the conversation.
        p = select.poll()
        p.register(sock.fileno(), select.POLLHUP | select.POLLRDHUP)
        if p.poll(0):
            return None
        raise Malformed("an empty datagram")
    return data, fds
