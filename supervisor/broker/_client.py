"""The supervisor proper's side of the broker: typed calls from any thread, each reply
matched to its request by id (the broker answers readFilters from a thread of its own,
so a slow W^X read-back never holds a kill or a dying writer's `pids`), fds received as
the reply says.

A refusal comes back as the broker's exception class (supervisor.broker.Refused,
NotOurs, ...), one line. Received fds belong to the caller (`StartedSandbox.close`,
`ProcView.close`)."""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import _protocol as P
from ._errors import BadFds, BrokerError, Malformed, NotOurs


@dataclass
class StartedSandbox:
    """What a start hands back: bwrap's host pid, a pidfd of it (readable once it
    exits), and our ends of the worker's pipes and sockets."""

    worker: str
    incarnation: int
    pid: int
    host_uid: int | None
    cgroup: bool
    pidfd: int
    status_r: int
    out_r: int
    watch_sock: socket.socket | None = None
    # Always None through the broker: a standby's hand-over socket stays the broker's,
    # and its channels go through `BrokerClient.adopt` (red team 10 row 9). The field is
    # the launcher-independent shape of a started sandbox (the direct path has one).
    ctl_sock: socket.socket | None = None
    standby: bool = False                # waits for `adopt`

    def close(self) -> None:
        for fd in (self.pidfd, self.status_r, self.out_r):
            if fd >= 0:
                os.close(fd)
        self.pidfd = self.status_r = self.out_r = -1
        for s in (self.watch_sock, self.ctl_sock):
            if s is not None:
                s.close()


@dataclass
class ProcView:
    """/proc/PID of a sandboxed process as the broker opened it: the directory and
    each named file (read with os.pread / os.read; the kernel checked access at open)."""

    pid: int
    dir_fd: int
    files: dict[str, int] = field(default_factory=dict)

    def read(self, name: str, size: int = 1 << 20) -> bytes:
        return os.pread(self.files[name], size, 0)

    def close(self) -> None:
        for fd in (self.dir_fd, *self.files.values()):
            os.close(fd)
        self.dir_fd, self.files = -1, {}


def _expect(rep: P.Reply, cls: type, fds: list[int] = ()):
    if not isinstance(rep, cls):
        P.close_fds(list(fds))
        raise Malformed(f"a {type(rep).__name__} reply where a {cls.__name__} belongs")
    return rep


def _grants(handles: dict[str, object]) -> tuple[tuple[P.Grant, ...], list[int]]:
    """The grants of a start or adopt and their fds, in grant order."""
    grants, fds = [], []
    for name, h in handles.items():
        hf = h.fds()                                       # type: ignore[attr-defined]
        role = "writer" if type(h).__name__ == "WriterHandle" else "reader"
        grants.append(P.Grant(name, role, len(hf)))
        fds += hf
    return tuple(grants), fds


class BrokerClient:
    def __init__(self, sock: socket.socket, proc: subprocess.Popen | None = None) -> None:
        self.sock = sock
        self.proc = proc
        self._id = 0
        self._send_lock = threading.Lock()
        # Replies are read by one caller at a time (`_reader`), who files each under its
        # request's id for its caller; `_sent` holds the ids still unanswered, in order.
        self._cond = threading.Condition()
        self._reader = False
        self._sent: list[int] = []
        self._async: set[int] = set()        # readFilters: answered out of order
        self._replies: dict[int, tuple[bytes, list[int]]] = {}
        self._closed = False

    @classmethod
    def spawn(cls, *, state_dir: str | os.PathLike, config: str | os.PathLike | None = None,
              python: str = sys.executable, stderr=None, env: dict | None = None,
              keep_fds: tuple[int, ...] = ()) -> BrokerClient:
        """Start `python -m supervisor.broker` as a child holding the other end of a
        socketpair (what a developer's `supervisor run` as root would do). `keep_fds`
        stay open in it (the run's state-dir lock: statelock.held_fds)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [python, "-m", "supervisor.broker", "--state-dir", str(state_dir),
                "--socket-fd", str(theirs.fileno())]
        if config is not None:
            argv[3:3] = ["--config", str(config)]
        root = str(Path(__file__).resolve().parents[2])
        full = dict(os.environ if env is None else env)
        full["PYTHONPATH"] = os.pathsep.join(filter(None, [root, full.get("PYTHONPATH")]))
        try:
            # Its own session: a terminal's Ctrl-C reaches the supervisor proper only,
            # which stops the workers in order and then closes the socket (the broker's
            # end of stream: it kills what is left and exits).
            proc = subprocess.Popen(argv, pass_fds=[theirs.fileno(), *keep_fds],
                                    stdin=subprocess.DEVNULL,
                                    stderr=stderr, env=full, cwd="/", start_new_session=True)
        finally:
            theirs.close()
        return cls(ours, proc)

    def close(self, timeout: float = 10.0) -> int | None:
        """Close our end: the broker kills what it started and exits."""
        self.sock.close()
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    # ------------------------------------------------------------ the call

    def call(self, req: P.Request, fds: list[int] = ()) -> tuple[P.Reply, list[int]]:
        """Send one request, return (reply, fds); raises the broker's error as its class."""
        with self._send_lock:
            self._id = self._id % 0xFFFFFFFF + 1         # never 0: the broker's "no id"
            rid = self._id
            with self._cond:
                self._sent.append(rid)
                if isinstance(req, P.ReadFilters):
                    self._async.add(rid)
            try:
                P.send(self.sock, P.encode_request(rid, req), fds)
            except BaseException:
                self._forget(rid)
                raise
        try:
            return self._await(rid)
        finally:
            self._forget(rid)              # sent or not, answered or not: not ours now

    def _forget(self, rid: int) -> None:
        with self._cond:
            if rid in self._sent:
                self._sent.remove(rid)
            self._async.discard(rid)

    def _await(self, rid: int) -> tuple[P.Reply, list[int]]:
        """The reply to `rid`: filed by whoever reads, or read here when no one is."""
        with self._cond:
            while rid not in self._replies:
                if self._closed:
                    raise ConnectionError("the broker closed its socket")
                if not self._reader:
                    self._reader = True
                    break
                self._cond.wait()
            else:
                return self._decode(rid, *self._take(rid))
        try:
            while True:
                got = P.recv(self.sock)
                with self._cond:
                    if got is None:
                        self._closed = True
                        raise ConnectionError("the broker closed its socket")
                    data, rfds = got
                    self._file(data, rfds)
                    self._cond.notify_all()
                    if rid in self._replies:
                        return self._decode(rid, *self._take(rid))
        finally:
            with self._cond:
                self._reader = False
                self._cond.notify_all()

    def _take(self, rid: int) -> tuple[bytes, list[int]]:
        """Our reply, and our id out of the unanswered ones in the same breath (under
        `_cond`): an id-0 error arriving after could be filed to an answered request,
        and the cut one's caller would wait for ever (review)."""
        self._sent.remove(rid)
        self._async.discard(rid)
        return self._replies.pop(rid)

    def _file(self, data: bytes, rfds: list[int]) -> None:
        """File one reply under its request's id (under `_cond`). An Error with id 0 is
        the broker's answer to a request the kernel cut (it could not read the id): the
        oldest unanswered request it answers in order. A reply to nothing asked is
        dropped with its fds."""
        try:
            got_id, _ = P.decode_reply(data)
        except BrokerError:
            got_id = 0
        if got_id == 0:
            got_id = next((r for r in self._sent
                           if r not in self._async and r not in self._replies), 0)
        if got_id == 0 or got_id not in self._sent or got_id in self._replies:
            P.close_fds(rfds)
            return
        self._replies[got_id] = (data, rfds)

    @staticmethod
    def _decode(rid: int, data: bytes, rfds: list[int]) -> tuple[P.Reply, list[int]]:
        try:
            got_id, rep = P.decode_reply(data)
            if got_id != rid and not (isinstance(rep, P.Error) and got_id == 0):
                raise Malformed(f"reply {got_id} to request {rid}")
            if len(rfds) != P.reply_fd_count(rep):
                raise BadFds(f"{len(rfds)} fds with a {type(rep).__name__} reply")
        except BaseException:
            P.close_fds(rfds)
            raise
        if isinstance(rep, P.Error):
            raise rep.exception()
        return rep, rfds

    # ------------------------------------------------------------ typed requests

    def ping(self) -> None:
        self.call(P.Ping())

    def start(self, worker: str, incarnation: int, *, standby: bool = False,
              handles: dict[str, object] | None = None) -> StartedSandbox:
        """Start `worker`'s sandbox; `handles`: its channels' WriterHandle/ReaderHandle
        by name (their fds travel, the broker checks them against its own specs)."""
        grants, fds = _grants(handles or {})
        rep, rfds = self.call(P.Start(worker, incarnation, standby, grants), fds)
        rep = _expect(rep, P.Started, rfds)
        pidfd, status_r, out_r, *rest = rfds
        watch = socket.socket(fileno=rest.pop(0)) if rep.exec_watch else None
        for fd in (status_r, out_r):
            os.set_blocking(fd, False)
        return StartedSandbox(worker, incarnation, rep.pid,
                              None if rep.host_uid < 0 else rep.host_uid, rep.cgroup,
                              pidfd, status_r, out_r, watch, None, rep.control)

    def adopt(self, worker: str, incarnation: int, handles: dict[str, object]) -> None:
        """Hand standby `incarnation` of `worker` its channels: the broker checks them as
        a start's and sends them over the standby's control socket, which only it holds."""
        grants, fds = _grants(handles)
        self.call(P.Adopt(worker, incarnation, grants), fds)

    def signal(self, pid: int, sig: int) -> None:
        name = P.SIGNAL_NAMES.get(int(sig))
        if name is None:
            raise ValueError(f"signal {sig} is not in the broker's vocabulary "
                             f"({sorted(P.SIGNALS)})")
        self.call(P.SignalPid(pid, name))

    def kill_sandbox(self, worker: str, incarnation: int) -> None:
        self.call(P.KillSandbox(worker, incarnation))

    def reap(self, worker: str, incarnation: int) -> P.Reaped:
        rep, _ = self.call(P.Reap(worker, incarnation))
        return _expect(rep, P.Reaped)

    def pids(self, worker: str, incarnation: int) -> list[int]:
        rep, _ = self.call(P.Pids(worker, incarnation))
        return list(_expect(rep, P.PidList).pids)

    def open_proc(self, pid: int, files: tuple[str, ...] = ("status",)) -> ProcView:
        rep, rfds = self.call(P.OpenProc(pid, tuple(files)))
        rep = _expect(rep, P.Opened, rfds)
        return ProcView(pid, rfds[0], dict(zip(rep.files, rfds[1:])))

    def set_latch(self, reason: str) -> None:
        self.call(P.SetLatch(reason))

    def reserve_latch(self) -> None:
        self.call(P.ReserveLatch())

    def clear_latch(self) -> None:
        self.call(P.ClearLatch())

    def read_latch(self) -> str | None:
        """The latch file's text, None when not latched."""
        rep, _ = self.call(P.ReadLatch())
        return _expect(rep, P.Latch).text or None

    def realtime(self, worker: str, incarnation: int) -> None:
        self.call(P.Realtime(worker, incarnation))

    def open_fd(self, pid: int, fd: int) -> int:
        """An O_PATH fd of what the sandboxed process's fd `fd` is (ours to close)."""
        rep, rfds = self.call(P.OpenFd(pid, fd))
        _expect(rep, P.Link, rfds)
        return rfds[0]

    def open_map_file(self, pid: int, start: int, end: int) -> int:
        """An O_PATH fd of the object mapped at start-end (ours to close)."""
        rep, rfds = self.call(P.OpenMapFile(pid, start, end))
        _expect(rep, P.Link, rfds)
        return rfds[0]

    def open_map_files(self, pid: int, ranges: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
        """O_PATH fds of the objects mapped at each (start, end), for those still mapped
        (ours to close); any number of ranges, MAX_FDS per request."""
        out: dict[tuple[int, int], int] = {}
        try:
            for at in range(0, len(ranges), P.MAX_FDS):
                part = tuple(ranges[at:at + P.MAX_FDS])
                rep, rfds = self.call(P.OpenMapFiles(pid, part))
                rep = _expect(rep, P.Links, rfds)
                it = iter(rfds)
                out.update((r, next(it)) for r, ok in zip(part, rep.found) if ok)
        except BaseException:
            P.close_fds(list(out.values()))
            raise
        return out

    def open_pid_ns(self, pid: int) -> int:
        """An O_PATH fd of the process's pid namespace (fstat: its inode; ours to close)."""
        rep, rfds = self.call(P.OpenPidNs(pid))
        _expect(rep, P.Link, rfds)
        return rfds[0]

    def signal_thread(self, pid: int, tid: int, *, stop: bool) -> None:
        self.call(P.SignalThread(pid, tid, stop))

    def read_filters(self, pid: int) -> P.Filters:
        """The broker's W^X read-back of every thread of `pid` (sandbox/wx.py)."""
        rep, _ = self.call(P.ReadFilters(pid))
        return _expect(rep, P.Filters)


# How long the map_files of one batch stay usable (_Batch): the maps scan's links follow
# one another within milliseconds; older, an object might have been remapped since.
BATCH_S = 0.25


class _Batch:
    """O_PATH fds of every executable file mapping of one process, opened by the broker
    in one request (openMapFiles), for this thread's next map_files links. Each is used
    once; what is left is closed when the batch is dropped."""

    def __init__(self, pid: int) -> None:
        self.pid, self.at, self.links = pid, time.monotonic(), 1
        self.fds: dict[str, int] | None = None

    def fresh(self, pid: int) -> bool:
        return self.pid == pid and time.monotonic() - self.at < BATCH_S

    def close(self) -> None:
        P.close_fds(list((self.fds or {}).values()))
        self.fds = {}

    __del__ = close


class _Fd:
    """One fd of a process's /proc file, closed with the holder."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid, self.fd, self.at = pid, fd, time.monotonic()

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


class BrokerProcOpener:
    """sandbox.procfs.ProcOpener over the broker, for the supervisor proper (no root,
    no capabilities). What needs privilege goes to the broker: the files of PROC_FILES
    (opened there, the fd handed over), fd/N, map_files/A-B and ns/pid (an O_PATH fd, followed
    through /proc/self/fd/M: stat, readlink and a reopen with our own permissions), and
    SIGSTOP/SIGCONT/SIGKILL. What any user may read (task/*, listing task) is read
    here. A pid the broker does not own, or one gone, reads as ProcessLookupError; a
    `failed` open carries the kernel's errno (ENOENT for a mapping gone since)."""

    def __init__(self, client: BrokerClient) -> None:
        self.client = client
        self._local = threading.local()      # this thread's map_files _Batch

    def _map_file(self, pid: int, name: str, start: int, end: int) -> int:
        """An O_PATH fd of map_files/START-END. The maps scan identifies every executable
        mapping of a process, one link after the other (25,351 requests in 45 s on the
        car, one per mapping per scan): the second link of one process within BATCH_S
        in this thread fetches all of that process's executable file mappings, from its
        maps as the broker opens it, in one openMapFiles per 64; the first link, and a
        lone one (the exec watch judging one request), stays a single openMapFile.
        A batch serves one burst of links only: any other use of this opener by the
        thread drops it (`_drop_batch`). The exec watch judges with the worker held in
        its syscall (and its other threads stopped), so a burst within one judgement
        cannot see a mapping replaced; a batch kept across judgements could (an O_PATH
        fd of the file mapped there before, taken for the one mapped there now)."""
        b = getattr(self._local, "batch", None)
        if b is None or not b.fresh(pid):
            if b is not None:
                b.close()
            self._local.batch = _Batch(pid)
            return self.client.open_map_file(pid, start, end)
        b.links += 1
        if b.fds is None:
            b.at = time.monotonic()
            b.fds = {f"map_files/{a:x}-{z:x}": fd for (a, z), fd in
                     self.client.open_map_files(pid, self._exec_ranges(pid)).items()}
        fd = b.fds.pop(name, None)
        return fd if fd is not None else self.client.open_map_file(pid, start, end)

    @staticmethod
    def _os_error(e: BrokerError) -> OSError:
        if isinstance(e, NotOurs):
            return ProcessLookupError(errno.ESRCH, e.reason)
        return OSError(e.errno or errno.EIO, e.reason)

    def _exec_ranges(self, pid: int) -> list[tuple[int, int]]:
        kept = getattr(self._local, "maps", None)
        if kept is not None and kept.pid == pid and time.monotonic() - kept.at < BATCH_S:
            return _exec_ranges_of(_pread_all(kept.fd))
        return _exec_ranges(self.client, pid)

    def _drop_batch(self) -> None:
        b = getattr(self._local, "batch", None)
        if b is not None:
            b.close()
            self._local.batch = None

    def open(self, pid: int, name: str, flags: int = os.O_RDONLY) -> int:
        self._drop_batch()
        if name not in P.PROC_FILES:
            return os.open(f"/proc/{pid}/{name}", flags | os.O_CLOEXEC)
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EPERM, f"/proc/{pid}/{name}: the broker opens read-only")
        try:
            view = self.client.open_proc(pid, (name,))
        except BrokerError as e:
            raise self._os_error(e) from None
        os.close(view.dir_fd)
        if name == "maps":
            # Kept for this thread's next map_files batch of `pid`: read there at offset
            # 0, it is the maps of then (no openProc of its own per scan).
            self._local.maps = _Fd(pid, os.dup(view.files[name]))
        return view.files[name]

    @contextlib.contextmanager
    def link(self, pid: int, name: str) -> Iterator[str]:
        kind, _, arg = name.partition("/")
        if kind != "map_files":
            self._drop_batch()
        try:
            if kind == "fd":
                fd = self.client.open_fd(pid, int(arg))
            elif kind == "map_files":
                start, _, end = arg.partition("-")
                fd = self._map_file(pid, name, int(start, 16), int(end, 16))
            elif name == "ns/pid":
                fd = self.client.open_pid_ns(pid)
            else:
                raise PermissionError(errno.EPERM, f"/proc/{pid}/{name}: not a link the "
                                      "broker opens")
        except BrokerError as e:
            raise self._os_error(e) from None
        except ValueError:
            raise FileNotFoundError(errno.ENOENT, f"/proc/{pid}/{name}") from None
        try:
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)

    def listdir(self, pid: int, name: str) -> list[str]:
        self._drop_batch()
        if name != "task":
            raise PermissionError(errno.EPERM, f"/proc/{pid}/{name}: not listed through the broker")
        return os.listdir(f"/proc/{pid}/task")

    def tgkill(self, pid: int, tid: int, sig: int) -> None:
        self._drop_batch()
        if sig not in (signal.SIGSTOP, signal.SIGCONT):
            raise ValueError(f"signal {sig} to one thread is not in the broker's vocabulary")
        try:
            self.client.signal_thread(pid, tid, stop=sig == signal.SIGSTOP)
        except NotOurs:
            pass               # gone (as ESRCH is for tgkill); a stranger is refused and logged

    def check_wx(self, pid: int):
        """wx.verify's privileged part done by the broker (readFilters): a
        `wx.Verified` with how "ptrace", or None where the broker cannot read filters
        back either (verify then counts). A process gone or killed during the check is
        ProcessLookupError, as verify's own."""
        import time

        from supervisor.sandbox.wx import Verified

        self._drop_batch()
        t0 = time.monotonic()
        try:
            got = self.client.read_filters(pid)
        except BrokerError as e:
            raise self._os_error(e) from None
        if not got.ptrace:
            return None
        return Verified(got.ok, "ptrace", got.reason, got.threads,
                        (time.monotonic() - t0) * 1e3)

    def kill(self, pid: int, sig: int) -> None:
        self._drop_batch()
        try:
            if sig == signal.SIGCONT:      # to any thread, it continues the whole group
                self.client.signal_thread(pid, pid, stop=False)
            else:
                self.client.signal(pid, sig)
        except NotOurs as e:
            raise ProcessLookupError(errno.ESRCH, e.reason) from None


def _exec_ranges(client: BrokerClient, pid: int) -> list[tuple[int, int]]:
    """(start, end) of every executable mapping of `pid` backed by an inode (those
    map_files lists), from its maps as the broker opens it."""
    view = client.open_proc(pid, ("maps",))
    try:
        return _exec_ranges_of(_pread_all(view.files["maps"]))
    finally:
        view.close()


def _pread_all(fd: int) -> bytes:
    chunks, at = [], 0
    while chunk := os.pread(fd, 1 << 16, at):
        chunks.append(chunk)
        at += len(chunk)
    return b"".join(chunks)


def _exec_ranges_of(text: bytes) -> list[tuple[int, int]]:
    out = []
    for line in text.splitlines():
        f = line.split(maxsplit=5)
        if len(f) >= 5 and f[1][2:3] == b"x" and f[4] != b"0":
            a, _, z = f[0].partition(b"-")
            out.append((int(a, 16), int(z, 16)))
    return out
