"""Red team, round 10 (docs/redteam10.md): an attacker who knows the code, and the
ordinary world a car lives in.

Themes, each with one shared fixture:

* the broker (privsep): the supervisor proper compromised (it reads every hostile
  byte) asks a real root broker to start a real research sandbox with channel fds that
  are the right kind and size but not what the config gives a reader;
* the ordinary world under one real `supervisor run`: a research worker that freezes
  itself (its cgroup's freezer, then SIGSTOP) must cost control nothing and trip no
  fail-safe; the clock stepped at boot where the code reads the wall clock.

Each test asserts the claim the way it should hold. A claim that fails today is an
``xfail(strict=True)`` whose reason starts with "redteam10 row N"; the lead's fix turns
it into a plain pass. ``--runxfail`` shows the evidence of each break.

The attack workers live in a small package written at run time into a root-owned
``python_path`` directory (``rt10w``, below), bound read-only into the sandboxes.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.sandbox
if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the supervisor's isolation (host uids, cgroups) needs root", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]

_RT10W = '''
"""Red team round 10 workers (tests/test_redteam_round10.py writes this file)."""
import json
import mmap
import os
import select
import socket
import sys
import time


def _err(e):
    return "errno %d" % e.errno if isinstance(e, OSError) else "%s: %s" % (type(e).__name__, e)


def _handle(ctx):
    from supervisor.ipc import env_name
    return next(json.loads(os.environ[env_name(ch)]) for ch in ctx.channels)


def broker_fds(ctx):
    """A research reader, started by the broker with whatever fds the (compromised)
    supervisor proper sent: write its channel's segment through a shared writable
    mapping; if its wake-up socket is a SOCK_SEQPACKET (the broker's own connection),
    speak the broker's protocol on it."""
    from supervisor.broker import _protocol as P
    ctx._activate()                   # a warm standby: blocks here for its channels
    h = _handle(ctx)
    res = {}
    try:
        m = mmap.mmap(h["data_fd"], 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        m[len(m) - 4:] = b"RT10"
        res["segment_write"] = "ok"
    except Exception as e:
        res["segment_write"] = _err(e)
    s = socket.socket(fileno=os.dup(h["event_fd"]))
    res["wake_type"] = int(s.type)
    if s.type == socket.SOCK_SEQPACKET:
        for rid, req in ((4241, P.Ping()), (4242, P.SetLatch("rt10w: latched by research")),
                         (4243, P.ReadLatch())):
            try:
                s.send(P.encode_request(rid, req))
                if not select.select([s], [], [], 5)[0]:
                    res[type(req).__name__] = "no reply"
                    continue
                got, rep = P.decode_reply(s.recv(P.MAX_MESSAGE + 1))
                res[type(req).__name__] = "%d %s" % (got, type(rep).__name__)
            except Exception as e:
                res[type(req).__name__] = _err(e)
    if s.type == socket.SOCK_STREAM:
        try:                 # whoever holds the other end hears the sandbox
            res["stream_send"] = s.send(b"RT10 hello from a research sandbox\\n")
        except Exception as e:
            res["stream_send"] = _err(e)
    print("RT10 " + json.dumps(res), flush=True)
    ctx.ready(status="rt10 broker_fds")
    while True:
        ctx.watchdog()
        time.sleep(0.05)


def freeze_self(ctx):
    """Research: once told, try to freeze its own cgroup (v2 cgroup.freeze, v1
    freezer.state, wherever the sandbox shows a cgroup file system), then stop itself
    with SIGSTOP: a frozen research worker must cost control nothing."""
    ctx.ready(status="rt10 freeze_self")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    while not os.path.exists(os.path.join(here, "go-freeze")):
        ctx.watchdog()
        time.sleep(0.02)
    res = {}
    for path in ("/sys/fs/cgroup/cgroup.freeze", "/sys/fs/cgroup/freezer/freezer.state",
                 "/sys/fs/cgroup/unified/cgroup.freeze"):
        try:
            with open(path, "w") as f:
                f.write("1" if path.endswith("freeze") else "FROZEN")
            res[path] = "written"
        except Exception as e:
            res[path] = _err(e)
    print("RT10 " + json.dumps(res), flush=True)
    os.kill(os.getpid(), 19)      # SIGSTOP: never caught, never ignored
    while True:
        ctx.watchdog()
        time.sleep(0.05)


def publish(ctx):
    """Research: publish 20 messages of 77.0 on its own channel (`out`), as any writer."""
    import numpy as np
    w = ctx.writer(next(iter(ctx.channels)))
    for _ in range(20):
        w.publish_array(np.full(4, 77.0, w.spec.np_dtype))
    print("RT10 " + json.dumps({"published": 20}), flush=True)
    ctx.ready(status="rt10 publish")
    while True:
        ctx.watchdog()
        time.sleep(0.05)


def wake_steal(ctx):
    """Research: read whatever arrives on its wake-up socket for 2 s (bytes meant for
    whoever else holds that end), then say how many."""
    s = socket.socket(fileno=os.dup(_handle(ctx)["event_fd"]))
    got, end = 0, time.monotonic() + 2.0
    while time.monotonic() < end:
        if select.select([s], [], [], 0.1)[0]:
            got += len(s.recv(4096))
    print("RT10 " + json.dumps({"stolen_bytes": got}), flush=True)
    ctx.ready(status="rt10 wake_steal")
    while True:
        ctx.watchdog()
        time.sleep(0.05)


def crash_loop(ctx):
    """Research: READY, then, while the test's trigger file exists, exit 1 after 200 ms
    (a research model that crashes on every start: an ordinary bug, for hours)."""
    ctx.ready(status="rt10 crash_loop")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    t0 = time.monotonic()
    while True:
        if os.path.exists(os.path.join(here, "go-crash")) and time.monotonic() - t0 > 0.2:
            os._exit(1)
        ctx.watchdog()
        time.sleep(0.02)


def exec_requests(ctx):
    """Control, before READY: once told, map this (read-only, admitted) file R|X again
    and again (at most 600 times, until told to stop), each a request the supervisor's
    exec watch judges with the worker stopped (a second thread keeps the worker from
    being alone: the watch then stops its threads); then READY. Honest lazy loading,
    as modeld's imports and kernels make at start."""
    import ctypes
    import threading
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    while not os.path.exists(os.path.join(here, "go-exec")):
        time.sleep(0.02)
    threading.Thread(target=lambda: time.sleep(3600), daemon=True).start()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    # Each request a library not mapped before (what an import does): the watch
    # identifies each new file (ELF, build-id) as it judges.
    import glob
    import sysconfig

    import numpy
    libs = sorted(glob.glob(os.path.join(sysconfig.get_paths()["platstdlib"], "lib-dynload",
                                         "*.so"))
                  + glob.glob(os.path.join(os.path.dirname(numpy.__file__), "**", "*.so"),
                              recursive=True))
    n, t0 = 0, time.monotonic()
    while n < 600 and not os.path.exists(os.path.join(here, "stop-exec")):
        with open(libs[n] if n < len(libs) else __file__, "rb") as f:
            at = libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_EXEC, mmap.MAP_PRIVATE,
                           f.fileno(), 0)
        if at in (None, ctypes.c_void_p(-1).value):
            break
        n += 1
        libc.munmap(at, 4096)
        time.sleep(0.005)
    print("RT10 " + json.dumps({"exec_mappings": n, "s": round(time.monotonic() - t0, 3)}),
          flush=True)
    ctx.ready(status="rt10 exec_requests")
    while True:
        ctx.watchdog()
        time.sleep(0.05)


def main(ctx):
    return {"broker_fds": broker_fds, "freeze_self": freeze_self, "crash_loop": crash_loop,
            "exec_requests": exec_requests,
            "publish": publish, "wake_steal": wake_steal}[sys.argv[1]](ctx)
'''


def _package(prefix: str) -> tuple[Path, Path]:
    """(tmp, python_path): a root-owned 0755 directory holding ``rt10w`` (every parent
    root's or sticky /tmp), as a control domain's python_path must be."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    tmp.chmod(0o755)
    pp = tmp / "lib"
    (pp / "rt10w").mkdir(parents=True)
    for d in (pp, pp / "rt10w"):
        d.chmod(0o755)
    init = pp / "rt10w" / "__init__.py"
    init.write_text(_RT10W)
    init.chmod(0o644)
    return tmp, pp


# ================================================================ the broker (privsep)

_BROKER_TOML = """
[domains.control]
[domains.research]
python_path = ["{pp}"]
[channels.a_out]
slot_size = "4KiB"
dtype = "float32"
slot_count = 8
[workers.a]
domain = "control"
module = "workers.probe"
publishes = ["a_out"]
args = ["--publish", "a_out"]
[workers.r]
domain = "research"
module = "rt10w"
subscribes = ["a_out"]
args = ["broker_fds"]
[workers.rsb]
domain = "research"
module = "rt10w"
subscribes = ["a_out"]
args = ["broker_fds"]
warm_standby = true
[workers.k]
domain = "control"
module = "workers.probe"
subscribes = ["a_out"]
args = ["--read", "a_out"]
[workers.rs]
domain = "research"
module = "rt10w"
subscribes = ["a_out"]
args = ["wake_steal"]
[channels.s_out]
slot_size = "4KiB"
dtype = "float32"
slot_count = 8
[workers.s]
domain = "research"
module = "rt10w"
publishes = ["s_out"]
args = ["publish"]
[workers.sr]
domain = "research"
module = "workers.probe"
subscribes = ["s_out"]
args = ["--read", "s_out"]
[workers.sr2]
domain = "research"
module = "workers.probe"
subscribes = ["s_out"]
[workers.sr3]
domain = "research"
module = "workers.probe"
subscribes = ["s_out"]
[workers.sr4]
domain = "research"
module = "workers.probe"
subscribes = ["s_out"]
"""


class RootBroker:
    """A real broker (python -m supervisor.broker, root) and this process as the
    supervisor proper, its client; its events (stderr) in a file."""

    def __init__(self) -> None:
        from supervisor.broker import BrokerClient
        from supervisor.config import load
        from supervisor.ipc import Channel

        self.tmp, pp = _package("rt10b-")
        try:
            cfg = self.tmp / "broker.toml"
            cfg.write_text(_BROKER_TOML.format(pp=pp))
            self.config = load(cfg)
            self.err_path = self.tmp / "broker.err"
            self._err = open(self.err_path, "w")
            self.client = BrokerClient.spawn(state_dir=self.tmp / "state", config=cfg,
                                             stderr=self._err)
            self.client.ping()
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)      # nothing left behind
            raise
        self.channel = Channel.create(self.config.channel_specs()["a_out"])
        self._incarnation = 0

    def events(self, name: str) -> list[dict]:
        lines = self.err_path.read_text().splitlines()
        return [e for e in (json.loads(ln) for ln in lines if ln.startswith("{"))
                if e["event"] == name]

    def start_reader(self, handle, worker: str = "r", channel: str = "a_out"
                     ) -> tuple[object | None, str]:
        """Start research worker `worker` with `handle` as its `channel`; (refusal or
        None, what the worker printed, if it started: then it is killed and reaped)."""
        from supervisor.broker import BrokerError

        self._incarnation += 1
        inc = self._incarnation
        try:
            sb = self.client.start(worker, inc, handles={channel: handle})
        except BrokerError as e:
            return e, ""
        out = b""
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and b"\n" not in out.partition(b"RT10 ")[2]:
                if select.select([sb.out_r], [], [], 0.5)[0]:
                    try:
                        chunk = os.read(sb.out_r, 65536)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        break
                    out += chunk
        finally:
            self.client.kill_sandbox(worker, inc)
            select.select([sb.pidfd], [], [], 20)
            self.client.reap(worker, inc)
            sb.close()
        return None, out.decode(errors="replace")

    def close(self) -> int | None:
        self.channel.close()
        code = self.client.close()
        self._err.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return code


@pytest.fixture(scope="module")
def root_broker():
    b = RootBroker()
    yield b
    assert b.close() == 0


def _printed(out: str) -> dict:
    line = out.partition("RT10 ")[2].splitlines()
    return json.loads(line[0]) if line else {"printed": out[-500:]}


def test_a_research_reader_is_never_started_with_a_writable_segment(root_broker):
    """The compromised proper hands research reader `r` the channel's read-write segment
    fd (the writer's: a memfd of the segment's size, as the check wants) instead of the
    read-only re-open. The config makes `r` a reader; the bridge's rule is "readers get
    an O_RDONLY re-open: their mappings can never become writable". The broker must
    refuse (badFds) and say so naming the worker; it started it, and the worker wrote."""
    from supervisor.broker import BadFds
    from supervisor.ipc.channel import ReaderHandle

    b = root_broker
    ch = b.channel
    good = ch.reader_handle(0)
    rw = ReaderHandle(good.spec, 0, ch._data_fd, good.lease_fd, good.event_fd)
    os.pwrite(ch._data_fd, b"\0" * 4, ch.spec.segment_size - 4)
    n = len(b.events("broker_refused"))
    refusal, out = b.start_reader(rw)
    tail = os.pread(ch._data_fd, 4, ch.spec.segment_size - 4)
    assert isinstance(refusal, BadFds), (
        f"started; the research worker printed {_printed(out)}; the control segment's "
        f"last bytes now {tail!r}")
    new = b.events("broker_refused")[n:]
    assert new and "r" in (new[-1].get("worker"), *new[-1]["reason"].split()), new
    assert tail == b"\0" * 4


def test_the_brokers_own_connection_is_never_a_sandboxs_wake_up_socket(root_broker):
    """The compromised proper hands research reader `r`, as its wake-up socket, its own
    connection to the broker (a dup of the SOCK_SEQPACKET end). The sandbox then holds a
    live channel to root: every request of the vocabulary (start, signal and kill of any
    sandbox, openProc maps/mem of a control worker, setLatch), and the broker's end of
    stream (kill every sandbox when the proper is gone) never comes while it lives. A
    wake-up socket is a SOCK_STREAM socketpair end; the broker must refuse (badFds)."""
    from supervisor.broker import BadFds
    from supervisor.ipc.channel import ReaderHandle

    b = root_broker
    good = b.channel.reader_handle(0)
    own = ReaderHandle(good.spec, 0, good.data_fd, good.lease_fd, b.client.sock.fileno())
    try:
        n = len(b.events("broker_refused"))
        refusal, out = b.start_reader(own)
        # (the sandbox shared the connection's file description: its own flags too)
        os.set_blocking(b.client.sock.fileno(), True)
        assert isinstance(refusal, BadFds), (
            f"started; the research worker printed {_printed(out)}; the latch now "
            f"{b.client.read_latch()}")
        new = b.events("broker_refused")[n:]
        assert new and "r" in (new[-1].get("worker"), *new[-1]["reason"].split()), new
    finally:
        os.set_blocking(b.client.sock.fileno(), True)


def test_a_wake_up_socket_is_never_a_connection_to_a_host_service(root_broker, tmp_path):
    """The compromised proper connects to a host service (here a root listener the
    test runs in a 0700 directory, as a system daemon's socket would be: the sandbox
    could never reach its path) and hands the connected end to research reader `r` as
    its wake-up socket. A wake-up fd is the proper's own socketpair end: its peer is the
    proper (SO_PEERCRED), never a daemon. The broker must refuse (badFds)."""
    import socket as _socket

    from supervisor.broker import BadFds
    from supervisor.ipc.channel import ReaderHandle

    b = root_broker
    d = tmp_path / "daemon"
    d.mkdir(mode=0o700)
    srv = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    srv.bind(str(d / "host.sock"))
    srv.listen(1)
    cli = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    cli.connect(str(d / "host.sock"))
    conn, _ = srv.accept()
    try:
        good = b.channel.reader_handle(0)
        h = ReaderHandle(good.spec, 0, good.data_fd, good.lease_fd, cli.fileno())
        n = len(b.events("broker_refused"))
        refusal, out = b.start_reader(h)
        conn.settimeout(0.5)
        try:
            heard = conn.recv(4096)
        except OSError:
            heard = b""
        assert isinstance(refusal, BadFds), (
            f"started; the research worker printed {_printed(out)}; the host service "
            f"heard {heard!r}")
        new = b.events("broker_refused")[n:]
        assert new and "r" in (new[-1].get("worker"), *new[-1]["reason"].split()), new
    finally:
        for s in (conn, cli, srv):
            s.close()


def test_a_research_writer_is_never_handed_a_control_channels_segment(root_broker):
    """Two channels of one spec (a control model's output and a research shadow output
    often are). The compromised proper hands research worker `s`, the writer of
    `s_out`, the writer handle of `a_out` (read-write segment, lease tables, wake-up
    ends: every kind, size and mode right for a writer). `s` then publishes on control's
    channel as its writer; control readers take it (the layout is all a writer checks).
    Kind, size and access checks cannot see this; only the broker owning the channels
    (or pinning each channel's inodes) can. The broker must refuse."""
    from supervisor.broker import BrokerError
    from supervisor.ipc import layout as L
    from supervisor.ipc.channel import WriterHandle

    b = root_broker
    ch = b.channel
    wh = ch.writer_handle()
    as_s = WriterHandle(b.config.channel_specs()["s_out"], *[getattr(wh, f) for f in
                        ("data_fd", "lease_fds", "event_fds", "resume_above", "anchor")])
    seq0 = L.U64.unpack_from(os.pread(ch._data_fd, 4096, 0), L.OFF_LAST_SEQ)[0]
    n = len(b.events("broker_refused"))
    refusal, out = b.start_reader(as_s, worker="s", channel="s_out")
    seq1 = L.U64.unpack_from(os.pread(ch._data_fd, 4096, 0), L.OFF_LAST_SEQ)[0]
    assert isinstance(refusal, BrokerError), (
        f"started; the research worker printed {_printed(out)}; a_out's last_seq "
        f"{seq0} -> {seq1}")
    new = b.events("broker_refused")[n:]
    assert new and "s" in (new[-1].get("worker"), *new[-1]["reason"].split()), new


def test_a_broker_whose_proper_died_ends_its_sandboxes_and_frees_the_state_dir():
    """Row 2's consequence, measured as `run --privsep` arranges it: the proper holds the
    state dir's lock and passes it to the broker (`statelock.held_fds`); then it hands
    a research sandbox its broker connection (row 2) and dies (its socket and lock fd
    closed). The broker must see end of stream, kill the sandbox, exit, and the next
    `supervisor run` must be able to take the state dir."""
    from supervisor import statelock
    from supervisor.broker import BrokerClient, BrokerError
    from supervisor.config import load
    from supervisor.ipc import Channel
    from supervisor.ipc.channel import ReaderHandle

    tmp, pp = _package("rt10d-")
    cfg = tmp / "broker.toml"
    cfg.write_text(_BROKER_TOML.format(pp=pp))
    state = tmp / "state"
    lock = statelock.acquire(state)
    err = open(tmp / "broker.err", "w")
    client = BrokerClient.spawn(state_dir=state, config=cfg, stderr=err, keep_fds=(lock.fd,))
    broker = client.proc
    ch = Channel.create(load(cfg).channel_specs()["a_out"])
    sandbox_pid = 0
    try:
        client.ping()
        good = ch.reader_handle(0)
        try:
            sb = client.start("r", 1, handles={"a_out": ReaderHandle(
                good.spec, 0, good.data_fd, good.lease_fd, client.sock.fileno())})
        except BrokerError:
            pass                                  # row 2 fixed: nothing holds it
        else:
            sandbox_pid = sb.pid
            time.sleep(1.0)                       # its worker has the fd by now
            sb.close()
        # The proper dies: every fd of its own goes (the lock, the connection).
        lock.release()
        client.sock.close()
        deadline = time.monotonic() + 10
        while broker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = broker.poll() is None
        try:
            statelock.acquire(state).release()
            locked = False
        except statelock.Held:
            locked = True
        assert not alive and not locked, (
            f"10 s after the proper's death: broker alive {alive}, sandbox (bwrap "
            f"{sandbox_pid}) alive {os.path.exists(f'/proc/{sandbox_pid}')}, state dir "
            f"still locked {locked} (the next run: exit 9)")
    finally:
        if broker.poll() is None:                 # ours: end it (its sandboxes die with it)
            broker.kill()
            broker.wait(10)
        err.close()
        ch.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_research_reader_never_holds_a_control_readers_wake_up_end(root_broker):
    """An attacker who knows the fix under way for rows 1-3 (access, socket type, peer
    pid, memfd labels and first-start pins): a wake-up end the proper itself made, of
    the right type and peer, but control reader `k`'s, handed to research reader `rs`
    as its own (its segment and lease table its own: every memfd check passes). `rs`
    then reads the bytes the writer sends to wake `k`: `k` sleeps through its messages
    until its receive times out (a control deadline miss research decides). No socket
    may stand for two places: the broker must refuse."""
    from supervisor.broker import BrokerError
    from supervisor.ipc.channel import ReaderHandle

    b = root_broker
    ch = b.channel
    k = b.config.reader_index("a_out", "k")
    rs = b.config.reader_index("a_out", "rs")
    own = ch.reader_handle(rs)
    h = ReaderHandle(own.spec, rs, own.data_fd, own.lease_fd, ch.reader_handle(k).event_fd)
    n = len(b.events("broker_refused"))
    for _ in range(5):                # five wake-ups for k, from the writer's end of k's pair
        os.write(ch._event_fds[k], b"\x01")
    refusal, out = b.start_reader(h, worker="rs")
    assert isinstance(refusal, BrokerError), (
        f"started; the research worker printed {_printed(out)} (k's wake-ups)")
    new = b.events("broker_refused")[n:]
    assert new and "rs" in (new[-1].get("worker"), *new[-1]["reason"].split()), new


def test_a_research_standby_is_never_handed_fds_the_broker_has_not_checked(root_broker):
    """Research worker `rsb` has `warm_standby = true`. The broker starts its standby
    with no channels (as the request table requires) and hands the proper the standby's
    control socket; adoption is the proper sending the channel handles over it
    (`_standby.py`, `socket.send_fds`), which the broker never sees. The compromised
    proper sends a read-write a_out segment and its own broker connection as the
    wake-up. The research sandbox must never get them: hand-over through the broker
    (checked like a start), or no hand-over socket in the proper's hands."""
    import socket as _socket

    b = root_broker
    ch = b.channel
    idx = b.config.reader_index("a_out", "rsb")
    good = ch.reader_handle(idx)
    b._incarnation += 1
    inc = b._incarnation
    sb = b.client.start("rsb", inc, standby=True)
    out = b""
    try:
        if sb.ctl_sock is None:
            return                                  # nothing to hand over with
        text = json.dumps({"role": "reader", "spec": json.loads(good.to_json())["spec"],
                           "index": idx, "data_fd": 0, "lease_fd": 1, "event_fd": 2})
        fds = [ch._data_fd, good.lease_fd, b.client.sock.fileno()]
        _socket.send_fds(sb.ctl_sock, [json.dumps(
            {"channels": {"a_out": text}, "fds": [0, 1, 2]}).encode()], fds)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and b"\n" not in out.partition(b"RT10 ")[2]:
            if select.select([sb.out_r], [], [], 0.5)[0]:
                try:
                    chunk = os.read(sb.out_r, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    break
                out += chunk
    finally:
        os.set_blocking(b.client.sock.fileno(), True)
        b.client.kill_sandbox("rsb", inc)
        select.select([sb.pidfd], [], [], 20)
        b.client.reap("rsb", inc)
        sb.close()
    got = _printed(out.decode(errors="replace"))
    assert got.get("segment_write") != "ok" and "Ping" not in got, (
        f"the research standby printed {got}; the latch now {b.client.read_latch()}")


def test_restarts_through_the_broker_cost_neither_side_an_fd(root_broker):
    """Row 12 through the broker (`run --privsep`): a research sandbox started, killed
    and reaped 6 times with honest handles. Whatever a start opens on either side (the
    broker's pidfd, pipes, sockets, the cgroup; the client's ends) is closed by the reap
    and the client's close: a leak is EMFILE after a long drive of research restarts."""
    b = root_broker
    counts = []
    for _ in range(6):
        idx = b.config.reader_index("a_out", "r")
        b._incarnation += 1
        inc = b._incarnation
        sb = b.client.start("r", inc, handles={"a_out": b.channel.reader_handle(idx)})
        b.client.kill_sandbox("r", inc)
        select.select([sb.pidfd], [], [], 20)
        b.client.reap("r", inc)
        sb.close()
        time.sleep(0.2)                 # the broker empties the cgroup off its main thread
        counts.append((len(os.listdir(f"/proc/{b.client.proc.pid}/fd")),
                       len(os.listdir("/proc/self/fd"))))
    print(f"rt10 broker restarts: (broker fds, client fds) after each reap {counts}")
    assert counts[-1][0] - counts[0][0] <= 1 and counts[-1][1] - counts[0][1] <= 1, counts


# ================================================================ the ordinary world

_FLEET_TOML = """
[supervisor]
status_interval_s = 0.5
maps_scan_interval_s = 1.0
[domains.control]
actuates = true
python_path = ["{pp}"]
[domains.research]
python_path = ["{pp}"]
[channels.cmd]
slot_size = "4KiB"
dtype = "float32"
payload = "control_cmd"
max_age_ms = 50
[workers.c]
domain = "control"
module = "workers.probe"
publishes = ["cmd"]
args = ["--publish", "cmd", "--period-ms", "10", "--ping-ms", "20"]
watchdog_ms = 1000
restart = "always"
ready_timeout_ms = 30000
[workers.r-freeze]
domain = "research"
module = "rt10w"
args = ["freeze_self"]
watchdog_ms = {research_watchdog_ms}
restart = "never"
optional = true
ready_timeout_ms = 30000
[workers.r-crash]
domain = "research"
module = "rt10w"
args = ["crash_loop"]
restart = "always"
optional = true
max_restarts = 1000
backoff_initial_ms = 10
backoff_max_ms = 20
ready_timeout_ms = 30000
[workers.c-exec]
domain = "control"
module = "rt10w"
args = ["exec_requests"]
restart = "never"
optional = true
ready_timeout_ms = 90000
"""
RESEARCH_WATCHDOG_MS = 500


class Fleet:
    """`supervisor run` (simulation mode: a per-run latch, no state-dir lock) with its
    events (stderr) in a file; stdout (the live row) to /dev/null."""

    def __init__(self) -> None:
        self.tmp, self.pp = _package("rt10f-")
        state = self.tmp / "state"
        state.mkdir(mode=0o700)
        cfg = self.tmp / "rt10.toml"
        cfg.write_text(_FLEET_TOML.format(pp=self.pp, research_watchdog_ms=RESEARCH_WATCHDOG_MS))
        self.log_path = self.tmp / "supervisor.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", "run", "--config", str(cfg),
             "--log-level", "debug", "--quiet"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log, cwd=REPO,
            env=dict(os.environ, TRIO_STATE_DIR=str(state)))

    def events(self) -> list[dict]:
        out = []
        with open(self.log_path) as f:
            for line in f:
                if line.startswith("{"):
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass          # a line being written right now
        return out

    def of(self, event: str, worker: str | None = None) -> list[dict]:
        return [e for e in self.events() if e.get("event") == event
                and (worker is None or e.get("worker", e.get("source")) == worker)]

    def wait_for(self, pred, timeout_s: float) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = [e for e in self.events() if pred(e)]
            if got or self.proc.poll() is not None:
                return got
            time.sleep(0.05)
        return [e for e in self.events() if pred(e)]

    def trigger(self, name: str) -> None:
        p = self.pp / name
        p.write_text("go")
        p.chmod(0o644)

    def tail(self, n: int = 40) -> str:
        return "\n".join(json.dumps(e)[:400] for e in self.events()[-n:])

    def close(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        code = self.proc.returncode
        shutil.rmtree(self.tmp, ignore_errors=True)
        return code


@pytest.fixture(scope="module")
def fleet():
    f = Fleet()
    try:
        # c-exec waits (before READY) for its test: the others must be up, it started
        up = {"c", "r-freeze", "r-crash"}
        got = f.wait_for(lambda e: e.get("event") == "supervisor_exit" or (
            {x.get("worker") for x in f.of("ready")} >= up
            and f.of("start", "c-exec")), 120)
        if not got or f.proc.poll() is not None:
            pytest.fail("the fleet never became ready:\n" + f.tail())
        yield f
    finally:
        code = f.close()
    assert code == 0, f"supervisor run exited {code}"


def _worker_pid(f: Fleet, marker: bytes) -> int | None:
    """The host pid of the fleet worker whose command line holds `marker` (the
    interpreter inside the sandbox, not bwrap)."""
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                argv = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in argv and not argv[0].endswith(b"bwrap") and str(f.tmp).encode() \
                    not in b"".join(argv):
                return int(p.name)
    return None


def _stopped_thread(pid: int) -> bool:
    """Some thread of `pid` stopped (state T/t): the exec watch holds it frozen while it
    judges one of its requests."""
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            if t.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return True
        except (OSError, IndexError):
            continue
    return False


def test_a_supervisor_stopped_while_it_judges_refuses_no_honest_start(fleet):
    """The supervisor is stopped for 2.3 s (SIGSTOP: a debugger on the car, an
    engineer's `kill -STOP`, a supervisor stalled in reclaim under memory pressure)
    while it judges one of a starting control worker's exec requests (honest R|X
    mappings of an admitted file before READY; the test sends the stop the moment it
    sees the worker frozen for a judgement). The watch's wall budget (`JUDGE_WALL_S`,
    2 s) and freeze deadline bound a hostile worker's cost to us; our own stop must
    never be charged to the worker: no `refused` "too slow to judge" (for a required
    control worker that is no restart, and a fail-safe). Up to 3 tries: each stop lands
    inside a judgement (about 1 ms of every 6) only by the test's timing, so the mark is
    not strict (docs/redteam10.md row 14 gives how often it was refused)."""
    f = fleet
    assert f.of("start", "c-exec") and not f.of("ready", "c-exec"), f.tail()
    f.trigger("go-exec")
    pid = None
    deadline = time.monotonic() + 20
    while pid is None and time.monotonic() < deadline:
        pid = _worker_pid(f, b"exec_requests")
        time.sleep(0.05)
    assert pid, f.tail()
    tries = 0
    try:
        for _ in range(3):
            # The edge: from running to frozen, the start of a judgement.
            t_end = time.monotonic() + 3
            while time.monotonic() < t_end and _stopped_thread(pid):
                pass
            while time.monotonic() < t_end and not _stopped_thread(pid):
                pass
            if time.monotonic() >= t_end:
                continue
            f.proc.send_signal(signal.SIGSTOP)
            try:
                tries += 1
                time.sleep(2.3)
            finally:
                f.proc.send_signal(signal.SIGCONT)
            time.sleep(0.3)
            if f.of("refused", "c-exec"):
                break
    finally:
        f.trigger("stop-exec")
    done = f.wait_for(lambda e: e.get("worker") == "c-exec" and e.get("event") in (
        "ready", "refused", "exit"), 60)
    refused = f.of("refused", "c-exec")
    said = [e for e in f.of("output", "c-exec") if "RT10" in str(e.get("line", ""))]
    print(f"rt10 exec watch: {tries} stop(s); "
          f"{said[0].get('line') if said else None}; refused {len(refused)}")
    assert not refused, "\n".join(json.dumps(e)[:400] for e in refused)
    assert done and done[0]["event"] == "ready", f.tail()


def test_a_research_worker_that_freezes_itself_costs_control_nothing(fleet):
    """A research worker tries to freeze its own cgroup (v2 cgroup.freeze, v1
    freezer.state: wherever its sandbox might show a cgroup file system), then stops
    itself with SIGSTOP (what a freezer or a debugger does to it from outside). The
    supervisor must conclude "research stopped answering": its watchdog, then its kill,
    named; control keeps running, nothing fails safe."""
    f = fleet
    t0 = time.monotonic()
    f.trigger("go-freeze")
    printed = f.wait_for(lambda e: e.get("event") == "output" and e.get("source") == "r-freeze"
                         and "RT10 " in str(e.get("line", e.get("text", ""))), 30)
    assert printed, f.tail()
    tried = json.loads(str(printed[0].get("line", printed[0].get("text"))).partition("RT10 ")[2])
    assert not [p for p, r in tried.items() if r == "written"], tried
    missed = f.wait_for(lambda e: e.get("event") == "watchdog_missed"
                        and e.get("worker") == "r-freeze", 30)
    exited = f.wait_for(lambda e: e.get("event") == "exit" and e.get("worker") == "r-freeze", 30)
    took = time.monotonic() - t0
    assert missed and exited, f.tail()
    assert not f.of("fail_safe"), f.tail()
    assert not f.of("watchdog_missed", "c"), f.tail()
    assert not f.of("exit", "c"), f.tail()
    assert f.proc.poll() is None
    print(f"rt10 freeze: cgroup writes {tried}; watchdog_missed then exit after {took:.1f} s; "
          f"exit cause {exited[0].get('cause')!r}")


# ================================================================ the wall clock

YEARS_10_NS = 10 * 365 * 86400 * 10**9


@pytest.mark.parametrize("step_ns", [-YEARS_10_NS, YEARS_10_NS], ids=["back", "forward"])
def test_a_stepped_wall_clock_never_keeps_a_stale_admission_verdict(step_ns, tmp_path,
                                                                      monkeypatch):
    """The one wall-clock read on a decision path (every other deadline, age and window
    is CLOCK_MONOTONIC or trio's clock; events.py's `ts` is only printed): admission's
    "racy" rule, `check._static_check` keeping a walk only if every file it read was
    changed before `time.time_ns() - RACY_NS`. A car without an RTC boots with the clock
    years behind its files and NTP steps it forward once the modem is up (or the other
    way: a clock saved at shutdown, a GPS fix). The step is injected where the code reads
    it. A module rewritten after the walk (same size, its mtime put back, as `touch -d`
    would) must be walked again whatever the clock said; a clock behind the files keeps
    nothing (a walk per admission: the cost, below)."""
    from supervisor.admission import _store
    from supervisor.admission import check as C

    monkeypatch.setattr(_store, "load", lambda key: None)       # memory cache only
    monkeypatch.setattr(_store, "save", lambda *a, **k: None)
    real = time.time_ns
    monkeypatch.setattr(C.time, "time_ns", lambda: real() + step_ns)
    pkg = tmp_path / "rt10clk"
    pkg.mkdir()
    init = pkg / "__init__.py"
    init.write_text("import json \n")
    sys_path = [str(tmp_path), *sys.path]
    C.clear_cache()
    before = (C.CACHE_STATS.walks, C.CACHE_STATS.hits)
    first = C._static_check("rt10clk", None, sys_path, None)
    again = C._static_check("rt10clk", None, sys_path, None)
    walks, hits = C.CACHE_STATS.walks - before[0], C.CACHE_STATS.hits - before[1]
    assert not first.walks[0].hits and not again.walks[0].hits
    # forward: the walk is kept (a hit); back: every file looks changed "in the future",
    # nothing is kept (two walks): slower, never wrong
    assert (walks, hits) == ((2, 0) if step_ns < 0 else (1, 1))
    st = init.stat()
    init.write_text("import torch\n")                # same size
    os.utime(init, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = C._static_check("rt10clk", None, sys_path, None)
    assert [h.forbidden for h in after.walks[0].hits] == ["torch"], after
    C.clear_cache()


def test_the_supervisor_stopped_for_seconds_blames_no_worker(fleet):
    """The supervisor itself is stopped for 3 s and continued (a debugger attached to
    it on the car, `kill -STOP` by an engineer, a cgroup freezer on its unit that thaws
    it first): three times control worker c's 1000 ms watchdog. Its workers ran on and
    pinged into their status pipes. Our own stop must never be blamed on a worker: no
    watchdog_missed, no refusal, no fail-safe."""
    f = fleet
    assert f.proc.poll() is None
    n_events = len(f.events())
    f.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(3.0)
    finally:
        f.proc.send_signal(signal.SIGCONT)
    time.sleep(2.0)                     # what a watchdog would say, it says within this
    new = f.events()[n_events:]
    blamed = [e for e in new if e.get("event") in ("watchdog_missed", "refused", "fail_safe",
                                                   "gave_up", "restart")
              and not (e.get("worker") == "r-freeze" and (f.pp / "go-freeze").exists())
              and e.get("worker") != "c-exec"]
    assert not blamed, "\n".join(json.dumps(e)[:300] for e in blamed)
    assert f.proc.poll() is None
    assert not f.of("exit", "c"), f.tail()


# ================================================================ memory: the unit and the OOM killer

def test_the_units_memory_limit_holds_every_sandbox_within_its_own_limit():
    """`supervisor units` for the car (the embedded default): MemoryMax= bounds the whole
    unit: the supervisor, the broker, every sandbox. Each sandbox has its own
    `memory_max` (its cgroup), a warm standby too ("under every rule a fresh worker
    has"), and a worker with `warm_standby` keeps `STANDBY_DEPTH` of them. A unit limit
    below the sum of what each sandbox may use turns an ordinary state (every worker
    within its own limit, standbys warm with their model loaded) into a unit-wide OOM
    kill of whichever process is largest, chosen by the kernel, not by the config."""
    import re

    from supervisor import units
    from supervisor.config import load
    from supervisor.lifecycle._standby import _WarmStandby

    cfg = load(None)
    text = units.render(cfg, config_path=None)
    unit_max = int(re.search(r"^MemoryMax=(\d+)$", text, re.M).group(1))
    depth = _WarmStandby.STANDBY_DEPTH
    sandboxes = sum((w.memory_max or 0) * (1 + (depth if w.warm_standby else 0))
                    for w in cfg.workers.values())
    assert unit_max > sandboxes, (
        f"MemoryMax={unit_max / 2**30:.1f} GiB; the sandboxes alone may use "
        f"{sandboxes / 2**30:.1f} GiB (warm standbys x{depth}: "
        f"{[w.name for w in cfg.workers.values() if w.warm_standby]}), the supervisor's "
        f"own memory besides")


def test_the_supervisor_is_never_the_oom_killers_first_choice(fleet):
    """When memory runs out (the unit's MemoryMax, a container's limit, the machine), the
    kernel kills the process with the highest oom_score. The supervisor is the one
    process whose death takes every control worker with it (--die-with-parent) with no
    SAFE said and no latch written (systemd then restarts it: the car drives on). It
    must rank below every worker (oom_score_adj < 0), research highest."""
    cap_eff = next(int(ln.split()[1], 16) for ln in
                   Path("/proc/self/status").read_text().splitlines()
                   if ln.startswith("CapEff:"))
    if not cap_eff >> 24 & 1:      # CAP_SYS_RESOURCE: lowering oom_score_adj needs it
        pytest.skip("this root cannot lower an oom_score_adj (no CAP_SYS_RESOURCE: a "
                    "container); on the car the unit's OOMScoreAdjust= is systemd's "
                    "(tests/test_units.py)")
    f = fleet
    sup = f.proc.pid

    def score(pid: int) -> tuple[int, int]:
        return (int(Path(f"/proc/{pid}/oom_score").read_text()),
                int(Path(f"/proc/{pid}/oom_score_adj").read_text()))

    def children(pid: int) -> list[int]:
        out = []
        for t in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                out += [int(x) for x in t.read_text().split()]
            except OSError:
                continue
        return out

    mine, todo = {}, children(sup)
    while todo:                      # the supervisor's own tree: bwrap, init, worker
        pid = todo.pop()
        todo += children(pid)
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"supervisor.runner" in argv and not argv[0].endswith(b"bwrap"):
                mine[pid] = score(pid)        # the worker's interpreter, not bwrap
        except OSError:
            continue
    sup_score = score(sup)
    rss = next(ln.split()[1] for ln in Path(f"/proc/{sup}/status").read_text().splitlines()
               if ln.startswith("VmRSS"))
    assert mine
    assert sup_score[1] < 0 and sup_score[0] < min(s for s, _ in mine.values()), (
        f"supervisor oom_score {sup_score[0]} (adj {sup_score[1]}, RSS {rss} kB); "
        f"its workers' {sorted(mine.values())}")


def test_a_research_worker_in_a_crash_loop_costs_the_supervisor_no_fds(fleet):
    """An ordinary long drive: a research model that crashes at every start, restarted
    again and again for hours (here 6 times in a row, as fast as it starts). Whatever a
    start opens (pipes, sockets, pidfds, the cgroup, the exec watch) must be closed at
    its exit: a leak of k fds a restart is EMFILE after 1024/k restarts, and then no
    control worker can be restarted either (a fail-safe on an ordinary day)."""
    f = fleet
    sup = f.proc.pid

    def fds() -> int:
        return len(os.listdir(f"/proc/{sup}/fd"))

    def readies() -> int:
        return len([e for e in f.of("ready", "r-crash")])

    samples: list[int] = []
    f.trigger("go-crash")
    try:
        seen = readies()
        deadline = time.monotonic() + 40
        while len(samples) < 7 and time.monotonic() < deadline:
            n = readies()
            if n > seen:
                seen = n
                time.sleep(0.1)                 # the same moment of each start
                samples.append(fds())
            time.sleep(0.02)
    finally:
        (f.pp / "go-crash").unlink()
    assert len(samples) >= 4, f"only {len(samples)} restarts seen:\n" + f.tail()
    assert not f.of("fail_safe") and not f.of("exit", "c"), f.tail()
    grown = samples[-1] - samples[0]
    print(f"rt10 crash loop: supervisor fds at each READY {samples}")
    assert grown <= 2, f"supervisor fds at each READY of r-crash: {samples}"


# ---------------------------------------------------------------- the OOM rank, from inside

_OOM_SELF = r"""
import json
out = {}
for value in ("-1000", "-900", "-1"):
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(value)
        out[value] = "written"
    except OSError as e:
        out[value] = e.strerror
out["now"] = open("/proc/self/oom_score_adj").read().strip()
print(json.dumps(out))
"""


@pytest.mark.sandbox
@pytest.mark.parametrize("domain", ["research", "control"])
def test_a_sandbox_can_never_rank_itself_below_the_supervisor_for_the_oom_killer(domain):
    """Lead's check of this round's OOM ranking (red team 10 row 11's fix): a worker that
    knows the supervisor ranks itself at -900 tries to rank itself lower still, so that
    under memory pressure the kernel kills the supervisor (and with it every control
    worker, unsaid) before it. Every sandbox starts at 0 (`sched.rank_ordinary`) and
    has no CAP_SYS_RESOURCE: lowering is refused, it stays at 0."""
    import json

    if shutil.which("bwrap") is None or os.geteuid() != 0:
        pytest.skip("real sandboxes need bubblewrap and root")
    from supervisor.sandbox.launch import spawn
    from supervisor.sandbox.policy import policy_for_domain

    p = spawn(policy_for_domain(domain), [sys.executable, "-c", _OOM_SELF],
              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    got = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    assert got, err[-2000:]
    assert got["now"] == "0", got
    assert all(v != "written" for k, v in got.items() if k != "now"), got
