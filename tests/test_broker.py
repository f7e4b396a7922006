"""The privileged broker (supervisor/broker, docs/broker.md): a real broker process
started by the test, real sandboxes started through it, and a hostile client for every
refusal of the request table. After each hostile message the broker must still answer
(a ping) and must have said the refusal in one `broker_refused` line."""
from __future__ import annotations

import errno
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from supervisor.broker import (BadFds, BrokerClient, Malformed, NotOurs, Refused, TooLarge,
                               UnknownWorker)
from supervisor.broker import _protocol as P
from supervisor.config import load
from supervisor.ipc import Channel

# The decoder, the plan check and most refusals need no sandbox; the tests that start
# one are marked.
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap not installed")

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """
[domains.control]
[domains.research]
[domains.wide]
profile = "research"
user = "trio-research"
extra_rw_binds = ["{rw}"]
[channels.a_out]
slot_size = "4KiB"
dtype = "float32"
[workers.a]
domain = "control"
module = "workers.probe"
publishes = ["a_out"]
args = ["--publish", "a_out"]
[workers.r]
domain = "research"
module = "workers.probe"
subscribes = ["a_out"]
args = ["--read", "a_out"]
[workers.solo]
domain = "research"
module = "workers.probe"
warm_standby = true
[workers.rsb]
domain = "research"
module = "workers.probe"
subscribes = ["a_out"]
args = ["--read", "a_out"]
warm_standby = true
[workers.lone]
domain = "research"
module = "workers.probe"
[workers.w]
domain = "wide"
module = "workers.probe"
[workers.rt]
domain = "control"
module = "workers.probe"
realtime_priority = 10
realtime_budget_pct = 5
"""


class Broker:
    """A broker process, its client, and its event lines (stderr, one JSON a line)."""

    def __init__(self, tmp: Path, config_text: str) -> None:
        self.config_path = tmp / "broker.toml"
        self.config_path.write_text(config_text)
        self.config = load(self.config_path)
        self.state = tmp / "state"
        self.err_path = tmp / "broker.err"
        self.err = open(self.err_path, "w")
        self.client = BrokerClient.spawn(state_dir=self.state, config=self.config_path,
                                         stderr=self.err)
        self.client.ping()

    @property
    def pid(self) -> int:
        return self.client.proc.pid

    def events(self, name: str | None = None) -> list[dict]:
        lines = self.err_path.read_text().splitlines()
        evs = [json.loads(ln) for ln in lines if ln.startswith("{")]
        return [e for e in evs if name is None or e["event"] == name]

    def raw(self, data: bytes, fds: list[int] = ()) -> P.Reply:
        """A hostile client's message on the broker's own socket: its decoded reply."""
        P.send(self.client.sock, data, fds)
        got = P.recv(self.client.sock)
        assert got is not None, "the broker closed its socket"
        reply_bytes, rfds = got
        P.close_fds(rfds)
        return P.decode_reply(reply_bytes)[1]

    def fd_count(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def close(self) -> int | None:
        code = self.client.close()
        self.err.close()
        return code


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("broker")
    b = Broker(tmp, CONFIG.format(rw=tmp))       # domain `wide` may write the state dir's parent
    yield b
    assert b.close() == 0
    assert b.events("broker_exit"), b.err_path.read_text()[-2000:]


@pytest.fixture(scope="module")
def channel(broker):
    ch = Channel.create(broker.config.channel_specs()["a_out"])
    yield ch
    ch.close()


def _refused(b: Broker, before: int, code: str) -> dict:
    """The one new broker_refused line, with `code`; and the broker still answers."""
    b.client.ping()
    new = b.events("broker_refused")[before:]
    assert len(new) == 1 and new[0]["code"] == code, new
    assert "\n" not in new[0]["reason"]
    return new[0]


_counter = iter(range(1, 10**6))


def _next() -> int:
    return next(_counter)


class ExecWatchServer:
    """The supervisor proper's part of a control worker's start-up: the exec-watch
    listener comes over the socket the broker handed us, and every request is judged
    (sandbox/execwatch.py), as lifecycle/_exec.py does."""

    def __init__(self, sock: socket.socket) -> None:
        from supervisor.sandbox.execwatch import ExecWatch

        self.sock, self.stop = sock, threading.Event()
        _, fds, _, _ = socket.recv_fds(sock, 16, 1)
        assert len(fds) == 1, "no exec-watch listener from the runner"
        self.watch = ExecWatch(fds[0], allow_anonymous_exec=False)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set() and not self.watch.hung_up:
            if select.select([self.watch.fileno()], [], [], 0.05)[0]:
                self.watch.handle_pending(max_requests=16)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.watch.close()


def _status_until_ready(fd: int, timeout: float = 60.0) -> str:
    buf = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                break
            buf += chunk
            if b"READY=1" in buf:
                return buf.decode(errors="replace")
    raise AssertionError(f"no READY: {buf[-500:]!r}")


def _wait_exit(pidfd: int, timeout: float = 20.0) -> None:
    assert select.select([pidfd], [], [], timeout)[0], "the sandbox did not exit"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _gone(pid: int) -> bool:
    """Dead: no such process, or a zombie nobody has reaped yet (an orphan of a sandbox
    waits for this machine's pid 1)."""
    return _state(pid) in ("gone", "Z", "X")


def _uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


# ---------------------------------------------------------------- real sandboxes


@pytest.mark.sandbox
@needs_bwrap
def test_a_control_and_a_research_sandbox_start_run_as_their_users_and_are_reaped(broker, channel):
    """The client names the worker and incarnation only; the broker builds the sandbox
    from its config (domain user, binds, seccomp, cgroup), hands back pidfd, pipes and
    the exec-watch socket, and reads none of them itself."""
    c = broker.client
    a = c.start("a", 1, handles={"a_out": channel.writer_handle()})
    served = ExecWatchServer(a.watch_sock)            # control: the exec watch is ours
    try:
        r = c.start("r", 1, handles={"a_out": channel.reader_handle(0)})
        assert r.watch_sock is None                   # research: no exec watch
        _status_until_ready(a.status_r)
        _status_until_ready(r.status_r)
        for s in (a, r):
            assert s.host_uid not in (None, 0) and s.cgroup
            pids = c.pids(s.worker, 1)
            assert s.pid in pids and len(pids) >= 3       # bwrap, its init, the worker
            worker = pids[-1]
            assert _uid_of(worker) == s.host_uid          # the domain's user, not root
            view = c.open_proc(worker, ("status", "maps"))
            try:
                assert b"python" in view.read("maps")     # opened by the broker, read here
            finally:
                view.close()
        _unprivileged_reads(c, c.pids("r", 1)[-1])
        # SIGTERM to the worker itself (bwrap does not forward it), through the broker
        c.signal(c.pids("r", 1)[-1], signal.SIGTERM)
        _wait_exit(r.pidfd)
        got = c.reap("r", 1)
        assert got.exited and got.oom_kills == 0
        with pytest.raises(NotOurs):                  # reaped: no longer the broker's
            c.reap("r", 1)
        # The reap answers at once; the cgroup is emptied and removed just after, off
        # the broker's main thread (it held the proper's loop 20-130 ms, loaded).
        leaves = [ln.split(":", 2)[2] for ln in
                  Path(f"/proc/{a.pid}/cgroup").read_text().splitlines()]
        leaves = [Path(m) / ln.lstrip("/") for ln in leaves if ln not in ("/", "")
                  for m in Path("/sys/fs/cgroup").iterdir() if m.is_dir()]
        leaves = [d for d in leaves if d.is_dir()]
        assert leaves
        c.kill_sandbox("a", 1)
        _wait_exit(a.pidfd)
        assert c.reap("a", 1).code in (-signal.SIGKILL, 128 + signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(d.exists() for d in leaves) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not [d for d in leaves if d.exists()]
    finally:
        served.close()
        a.close()
    started = [e for e in broker.events("broker_started") if e["incarnation"] == 1]
    assert {e["worker"] for e in started} >= {"a", "r"}
    assert all(e["host_uid"] for e in started)


def _unprivileged_reads(c: BrokerClient, pid: int) -> None:
    """The basis of phase 2, measured: a process with no privilege (nobody, as the
    supervisor proper will be) is refused the worker's /proc/PID/maps, while reading the
    maps and mem fds the broker opened works. The broker's /proc/PID directory fd does
    not carry the broker's access: fd/N and map_files are checked at each lookup (the
    gaps docs/broker.md lists for the exec watch)."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    view = c.open_proc(pid, ("maps", "mem"))
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        out = {}
        try:
            os.setgroups([])
            os.setresgid(nobody.pw_gid, nobody.pw_gid, nobody.pw_gid)
            os.setresuid(nobody.pw_uid, nobody.pw_uid, nobody.pw_uid)

            def attempt(name, fn) -> None:
                try:
                    fn()
                    out[name] = "ok"
                except OSError as e:
                    out[name] = e.errno

            maps_fd = view.files["maps"]
            attempt("own maps", lambda: os.close(os.open(f"/proc/{pid}/maps", os.O_RDONLY)))
            attempt("maps fd", lambda: os.pread(maps_fd, 4096, 0))
            start = int(os.pread(maps_fd, 4096, 0).split(b"-")[0], 16)
            attempt("mem fd", lambda: os.pread(view.files["mem"], 16, start))
            attempt("fd/0 via dir fd", lambda: os.readlink("fd/0", dir_fd=view.dir_fd))
            attempt("map_files via dir fd", lambda: os.listdir(
                os.open("map_files", os.O_RDONLY | os.O_DIRECTORY, dir_fd=view.dir_fd)))
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(child, 0)
    got = json.loads(os.read(r, 65536) or b"{}")
    os.close(r)
    view.close()
    assert got == {"own maps": errno.EACCES, "maps fd": "ok", "mem fd": "ok",
                   "fd/0 via dir fd": errno.EACCES, "map_files via dir fd": errno.EACCES}, got


def _status_text(fd: int, wait_for: bytes = b"", timeout: float = 30.0) -> bytes:
    """What the status pipe holds now (until `wait_for` is in it, if given)."""
    buf = b""
    deadline = time.monotonic() + timeout
    while not (wait_for and wait_for in buf) and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.1 if wait_for else 0)[0]:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                break
            buf += chunk
        elif not wait_for:
            break
    return buf


@pytest.mark.sandbox
@needs_bwrap
def test_a_standbys_hand_over_is_the_brokers_checked_as_a_start(broker, channel):
    """Red team 10 row 9: a standby's control socket stays the broker's (never in the
    client's hands) and `adopt` hands the standby its channels, checked as a start's. A
    writer's handle for a reader, a writable segment, the broker's own connection as the
    wake-up, no channel at all, an adopt of a run (no standby) and a second adopt: each
    one `broker_refused` line naming the worker, and the standby still waits (no
    READY); the honest hand-over then makes it READY."""
    from supervisor.broker import BrokerError
    from supervisor.ipc.channel import ReaderHandle

    from supervisor.ipc import Writer

    c = broker.client
    idx = broker.config.reader_index("a_out", "rsb")
    good = channel.reader_handle(idx)
    Writer(channel.writer_handle(), domain="control", seal=False).close()   # attached
    n, run_n = _next(), _next()
    sb = c.start("rsb", n, standby=True)
    run = c.start("lone", run_n)
    try:
        assert sb.standby and sb.ctl_sock is None
        hostile = {
            "a writer's handle": ({"a_out": channel.writer_handle()}, Refused),
            "a writable segment": ({"a_out": ReaderHandle(
                good.spec, idx, channel._data_fd, good.lease_fd, good.event_fd)}, BadFds),
            "the broker's connection": ({"a_out": ReaderHandle(
                good.spec, idx, good.data_fd, good.lease_fd, c.sock.fileno())}, BadFds),
            "no channel": ({}, Refused),
        }
        for what, (handles, err) in hostile.items():
            before = len(broker.events("broker_refused"))
            with pytest.raises(err):
                c.adopt("rsb", n, handles)
            e = _refused(broker, before, err.code)
            assert (e["request"], e["worker"]) == ("adopt", "rsb"), (what, e)
        for worker, k in (("lone", run_n), ("rsb", n + 1000)):
            before = len(broker.events("broker_refused"))
            with pytest.raises(BrokerError) as got:      # a run; no such incarnation
                c.adopt(worker, k, {})
            assert got.value.code == ("refused" if worker == "lone" else "notOurs")
            assert _refused(broker, before, got.value.code)["worker"] == worker
        assert b"READY=1" not in _status_text(sb.status_r)
        c.adopt("rsb", n, {"a_out": good})
        assert b"READY=1" in _status_text(sb.status_r, b"READY=1")
        before = len(broker.events("broker_refused"))
        with pytest.raises(Refused, match="not a standby waiting"):
            c.adopt("rsb", n, {"a_out": good})
        _refused(broker, before, "refused")
    finally:
        for s, worker, k in ((sb, "rsb", n), (run, "lone", run_n)):
            c.kill_sandbox(worker, k)
            _wait_exit(s.pidfd)
            c.reap(worker, k)
            s.close()
    assert [(e["worker"], e["channels"]) for e in broker.events("broker_adopted")
            if e["incarnation"] == n] == [("rsb", ["a_out"])]


@pytest.mark.sandbox
@needs_bwrap
def test_start_request_latency_and_broker_cpu(broker, capsys):
    """The figure for docs/broker.md: a start request's round trip (staging, seccomp
    compile and fork of bwrap included; not the worker's own start-up) and the broker's
    CPU for it, beside the same sandbox spawned in this process as the lifecycle does
    today (launch.spawn): the difference is what the broker costs a start."""
    from supervisor.sandbox import launch
    from supervisor.sandbox.policy import for_worker
    from supervisor.sandbox.launch import worker_argv

    c = broker.client

    def cpu() -> float:         # the broker's own CPU time on record, ns resolution
        return int(Path(f"/proc/{broker.pid}/schedstat").read_text().split()[0]) / 1e9

    walls, cpus, direct = [], [], []
    for i in range(3):
        n = _next() + 100
        c0, t0 = cpu(), time.perf_counter()
        s = c.start("solo", n, standby=i == 0)
        walls.append(time.perf_counter() - t0)
        cpus.append(cpu() - c0)
        # A standby's control socket stays the broker's (adopt): never ours.
        assert s.standby == (i == 0) and s.ctl_sock is None
        c.kill_sandbox("solo", n)
        _wait_exit(s.pidfd)
        c.reap("solo", n)
        s.close()
    w = broker.config.workers["solo"]
    for _ in range(3):
        t0 = time.perf_counter()
        pol = for_worker(broker.config, w)
        p = launch.spawn(pol, worker_argv(w, sys.executable), stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
        direct.append(time.perf_counter() - t0)
        # bwrap's own children first: killed with the outer one only by their
        # --die-with-parent, which a kill right after the fork can outrun (orphan
        # research bwraps, PPID 1, were left after this test).
        from supervisor.sandbox import descendant_pids

        inner: list[int] = []
        deadline = time.monotonic() + 5
        while not inner and p.poll() is None and time.monotonic() < deadline:
            inner = descendant_pids(p.pid)      # its children, once forked
            time.sleep(0.005)
        for pid in inner:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.kill()
        p.wait()
    t0 = time.perf_counter()
    for _ in range(200):
        c.ping()
    ping_us = (time.perf_counter() - t0) / 200 * 1e6
    with capsys.disabled():
        print(f"\nbroker start request: wall min {min(walls) * 1e3:.0f} / max "
              f"{max(walls) * 1e3:.0f} ms (in-process launch.spawn min {min(direct) * 1e3:.0f} "
              f"ms), broker CPU min {min(cpus) * 1e3:.1f} / max {max(cpus) * 1e3:.1f} ms; "
              f"ping round trip {ping_us:.0f} us (load {os.getloadavg()[0]:.1f})")
    assert max(walls) < 30 and ping_us < 50_000


# ---------------------------------------------------------------- refusals


def test_unknown_worker_and_reused_incarnation_are_refused(broker):
    n = len(broker.events("broker_refused"))
    with pytest.raises(UnknownWorker):
        broker.client.start("root", 1)
    _refused(broker, n, "unknownWorker")
    with pytest.raises(Refused, match="already used"):
        broker.client.start("solo", 0)          # incarnations count from 1, never back
    _refused(broker, n + 1, "refused")
    with pytest.raises(Refused, match="warm_standby"):
        broker.client.start("w", _next(), standby=True)
    _refused(broker, n + 2, "refused")


@pytest.mark.sandbox
@needs_bwrap
def test_a_client_starting_sandboxes_in_a_loop_is_stopped_at_the_configs_count(broker):
    """A worker without warm_standby has its run and one predecessor not yet reaped:
    a third live sandbox is refused until one is reaped."""
    c = broker.client
    first, second = _next(), _next()
    started = [c.start("lone", first), c.start("lone", second)]
    try:
        n = len(broker.events("broker_refused"))
        with pytest.raises(Refused, match="at most 2"):
            c.start("lone", _next())
        _refused(broker, n, "refused")
        with pytest.raises(Refused, match="realtime_priority"):   # SCHED_FIFO: config's only
            c.realtime("lone", first)
        _refused(broker, n + 1, "refused")
    finally:
        for s, k in zip(started, (first, second)):
            c.kill_sandbox("lone", k)
            _wait_exit(s.pidfd)
            assert c.reap("lone", k).exited
            s.close()
    s = c.start("lone", _next())                      # reaped: room again
    c.kill_sandbox("lone", s.incarnation)
    _wait_exit(s.pidfd)
    c.reap("lone", s.incarnation)
    s.close()


@pytest.mark.sandbox
@needs_bwrap
def test_nothing_it_started_outlives_its_client(tmp_path):
    """The supervisor proper gone (its socket closed): the broker kills every sandbox
    it started, removes their cgroups and exits 0."""
    b = Broker(tmp_path, CONFIG.format(rw=tmp_path))
    s = b.client.start("solo", 1)
    pids = b.client.pids("solo", 1)
    cgroups = [ln.split(":", 2)[2] for ln in Path(f"/proc/{s.pid}/cgroup").read_text().splitlines()]
    assert b.close() == 0
    s.close()
    assert all(_gone(p) for p in pids), [(p, _state(p)) for p in pids]
    assert b.events("broker_exit")[0]["served"] >= 3
    for line in cgroups:
        if line not in ("/", ""):
            assert not any(Path(m).joinpath(line.lstrip("/")).exists()
                           for m in Path("/sys/fs/cgroup").iterdir() if m.is_dir()), line


def test_a_bind_showing_the_state_dir_is_refused(broker):
    """Domain `wide` names a read-write bind that is the state dir's parent: the config
    loader allows it, the broker never starts it (the latch must stay out of reach)."""
    n = len(broker.events("broker_refused"))
    with pytest.raises(Refused, match="state dir"):
        broker.client.start("w", _next())
    assert "state dir" in _refused(broker, n, "refused")["reason"]


def test_a_config_binding_root_or_running_as_root_never_starts_a_broker(tmp_path):
    bad = CONFIG.format(rw=tmp_path).replace('user = "trio-research"', 'user = "root"') \
        .replace(f'extra_rw_binds = ["{tmp_path}"]', 'extra_ro_binds = ["/"]')
    (tmp_path / "bad.toml").write_text(bad)
    p = subprocess.run([sys.executable, "-m", "supervisor.broker", "--config",
                        str(tmp_path / "bad.toml"), "--state-dir", str(tmp_path / "s"),
                        "--socket-fd", "0"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, stdin=subprocess.DEVNULL)
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert "never run as root" in p.stderr and "'/'" in p.stderr
    # a good config, but not a socket to serve on: one line too, never a traceback
    p = subprocess.run([sys.executable, "-m", "supervisor.broker", "--state-dir",
                        str(tmp_path / "s"), "--socket-fd", "0"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert p.returncode == 2 and p.stderr.strip() == "broker: socket fd 0: Socket operation " \
        "on non-socket", p.stderr


def test_a_listening_broker_serves_only_its_peer_user(tmp_path):
    """The units' way in (trio-broker.socket, --listen-fd): the broker accepts one
    connection, and only from --peer-user's uid (SO_PEERCRED); root is refused too."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    addr = f"\0trio-broker-test-{os.getpid()}"
    lsock.bind(addr)
    lsock.listen(4)
    err = open(tmp_path / "err", "w")
    proc = subprocess.Popen([sys.executable, "-m", "supervisor.broker", "--state-dir",
                             str(tmp_path / "state"), "--listen-fd", str(lsock.fileno()),
                             "--peer-user", "nobody"], pass_fds=[lsock.fileno()], cwd=ROOT,
                            stdin=subprocess.DEVNULL, stderr=err)
    lsock.close()
    try:
        # A standalone broker holds its state dir (statelock): a second one on the same
        # dir stops at once with one line and exit 9.
        from supervisor import statelock

        deadline = time.monotonic() + 30
        while statelock.holder(tmp_path / "state") != proc.pid:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        other = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        second = subprocess.run([sys.executable, "-m", "supervisor.broker", "--state-dir",
                                 str(tmp_path / "state"), "--listen-fd",
                                 str(other.fileno()), "--peer-user", "nobody"],
                                pass_fds=[other.fileno()], cwd=ROOT, capture_output=True,
                                text=True, timeout=60)
        other.close()
        assert second.returncode == 9, second.stderr
        assert f"another supervisor (pid {proc.pid}) holds" in second.stderr
        root = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        root.connect(addr)
        P.send(root, P.encode_request(1, P.Ping()))
        root.settimeout(30)
        try:
            got = P.recv(root)
        except ConnectionResetError:                  # closed with our ping unread
            got = None
        assert got is None                            # hung up on: not its peer
        root.close()
        ping = P.encode_request(2, P.Ping())
        child = os.fork()
        if child == 0:                                # the supervisor proper's uid
            code = 1
            try:
                os.setgroups([])
                os.setresgid(nobody.pw_gid, nobody.pw_gid, nobody.pw_gid)
                os.setresuid(nobody.pw_uid, nobody.pw_uid, nobody.pw_uid)
                c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                c.connect(addr)
                c.settimeout(30)
                c.sendmsg([ping])
                reply = c.recv(P.MAX_MESSAGE)
                code = 0 if isinstance(P.decode_reply(reply)[1], P.Ok) else 2
                c.close()
            finally:
                os._exit(code)
        assert os.waitpid(child, 0)[1] == 0
        assert proc.wait(30) == 0                     # its one client left: it ends
    finally:
        if proc.poll() is None:
            proc.kill()
        err.close()
    lines = (tmp_path / "err").read_text().splitlines()
    refused = [json.loads(x) for x in lines if '"broker_refused"' in x]
    assert len(refused) == 1 and "uid 0 is not nobody" in refused[0]["reason"], lines


def test_the_plan_check_refuses_uid_0_and_binding_root():
    """Defence in depth below the config loader: the policy the broker built is checked
    once more before it forks (check_plan), whatever produced it."""
    from supervisor.broker._checks import check_plan
    from supervisor.sandbox.policy import SandboxPolicy

    ok = dict(domain="d", host_uid=999, host_gid=999, ro_binds=["/usr"], rw_binds=["/data"])
    check_plan(SandboxPolicy(**ok), domain_rw=("/data",), domain_dev=(), state_dir="/var/s",
               root=True)
    for change, why in (({"host_uid": 0}, "uid/gid 0"), ({"host_uid": None}, "never as root"),
                        ({"ro_binds": ["/usr", "/"]}, "bind of /"),
                        ({"rw_binds": ["/data", "/etc"]}, "not named by the config"),
                        ({"ro_binds": ["/var"]}, "state dir")):
        with pytest.raises(Refused, match=why):
            check_plan(SandboxPolicy(**{**ok, **change}), domain_rw=("/data",), domain_dev=(),
                       state_dir="/var/s", root=True)


def test_signals_and_proc_views_of_pids_not_its_own_are_refused(broker):
    b, c = broker, broker.client
    stranger = subprocess.Popen(["sleep", "30"])
    try:
        n = len(b.events("broker_refused"))
        for pid in (1, os.getpid(), stranger.pid, b.pid):
            with pytest.raises(NotOurs):
                c.signal(pid, signal.SIGKILL)
            with pytest.raises(NotOurs):
                c.open_proc(pid, ("maps",))
        got = b.events("broker_refused")[n:]
        assert [e["code"] for e in got] == ["notOurs"] * 8, got
        assert stranger.poll() is None                  # nothing was signalled
        with pytest.raises(NotOurs):
            c.kill_sandbox("solo", 99_999)
        with pytest.raises(NotOurs):
            c.pids("a", 99_999)
        with pytest.raises(ValueError):
            c.signal(stranger.pid, signal.SIGSTOP)      # not in the vocabulary at all
    finally:
        stranger.kill()
        stranger.wait()


def test_channel_fds_must_be_the_channels_own(broker, channel, tmp_path):
    """fd-passing abuse: a directory of the host, a pipe, or the right count of the
    wrong things as a worker's channel; fds on a request that takes none; too many fds.
    Every one refused, and every fd the broker received is closed again."""
    b = broker
    before = b.fd_count()
    good = channel.writer_handle().fds()
    root_dir = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
    r, w = os.pipe()
    try:
        grant = (P.Grant("a_out", "writer", len(good)),)
        for fds, code in (([root_dir, *good[1:]], "badFds"),      # a way out of the sandbox
                          ([*good[:-1], r], "badFds"),             # a pipe for a socket
                          (good[:-1], "badFds")):                  # one short
            n = len(b.events("broker_refused"))
            rep = b.raw(P.encode_request(7, P.Start("a", _next(), False, grant)), fds)
            assert isinstance(rep, P.Error) and rep.code == code, rep
            _refused(b, n, code)
        n = len(b.events("broker_refused"))
        rep = b.raw(P.encode_request(8, P.Ping()), [r, w])         # fds where none belong
        assert isinstance(rep, P.Error) and rep.code == "badFds"
        _refused(b, n, "badFds")
        many = [os.dup(r) for _ in range(P.MAX_FDS + 8)]
        try:
            rep = b.raw(P.encode_request(9, P.Ping()), many)       # over MAX_FDS: cut
        finally:
            P.close_fds(many)
        assert isinstance(rep, P.Error) and rep.code == "badFds"
        _refused(b, n + 1, "badFds")
        # the wrong role for a channel: a reader's fds claimed as the writer's
        with pytest.raises((Refused, BadFds)):
            b.client.start("r", _next(), handles={"a_out": channel.writer_handle()})
    finally:
        P.close_fds([root_dir, r, w])
    assert b.fd_count() == before, "the broker kept fds it was sent"


def _labelled(ch: Channel) -> Channel:
    """Each wake-up pair's writer end bound to its label (`_checks.wake_label`), as
    `Channel.create` is to do (docs/broker.md, "Wake-up ends")."""
    from supervisor.broker._checks import wake_label

    nonce = os.urandom(8).hex()
    for i, fd in enumerate(ch._event_fds):
        with socket.socket(fileno=os.dup(fd)) as s:
            if not s.getsockname():                 # (once Channel.create binds it: as is)
                s.bind(wake_label(ch.spec.name, i, nonce))
    return ch


def test_a_wake_up_end_is_its_own_places_by_its_pairs_label(tmp_path):
    """Red team 10 row 8 at the check: reader k's wake-up end handed to reader rs before
    either ever started (no pin can know it) carries k's pair's label, and is refused;
    so are a writer handle with two pairs swapped, another channel's pair, a pair made
    after the place's first start, and a socket bound to anything but a label. Real
    memfds and sockets, the broker's own check (`check_channel_fds`)."""
    from supervisor.broker import _checks
    from supervisor.broker._checks import ChannelPins, check_channel_fds, wake_label
    from supervisor.config import loads
    from supervisor.ipc.channel import ReaderHandle, WriterHandle

    spec = loads(CONFIG.format(rw=tmp_path), "t.toml").channel_specs()["a_out"]
    pins = ChannelPins()
    ch = _labelled(Channel.create(spec))
    other = _labelled(Channel.create(spec))
    b_spec = loads(CONFIG.replace("a_out", "b_out").format(rw=tmp_path),
                   "t.toml").channel_specs()["b_out"]
    b = _labelled(Channel.create(b_spec))
    stray = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    stray[0].bind(b"\0not-a-wake-label")

    def reader(index: int, event_fd: int) -> list[int]:
        own = ch.reader_handle(index)
        return ReaderHandle(own.spec, index, own.data_fd, own.lease_fd, event_fd).fds()

    def check(fds: list[int], role: str = "reader", index: int = 1) -> str:
        try:
            check_channel_fds("a_out", spec, role, fds, pins=pins, index=index)
        except BadFds as e:
            return e.reason
        return "ok"

    try:
        wh = ch.writer_handle()
        swapped = WriterHandle(spec, wh.data_fd, wh.lease_fds,
                               (wh.event_fds[1], wh.event_fds[0], *wh.event_fds[2:]),
                               wh.resume_above, wh.anchor)
        assert "reader 0, not channel a_out's wake-up 1" in check(reader(1, ch.reader_handle(0).event_fd))
        assert "channel b_out's reader 1" in check(reader(1, b.reader_handle(1).event_fd))
        assert "not a stream socketpair end" in check(reader(1, stray[1].fileno()))
        assert "reader 1, not channel a_out's wake-up 0" in check(swapped.fds(), "writer", 0)
        assert check(reader(1, ch.reader_handle(1).event_fd)) == "ok"
        assert check(wh.fds(), "writer", 0) == "ok"
        # The place is pinned now: another pair labelled for it (a new channel's) is not it.
        assert "another pair than at its first start" in check(
            reader(1, other.reader_handle(1).event_fd))
        assert wake_label("a_out", 1, "0" * 16) != wake_label("a_out", 10, "0" * 16)
        # An unlabelled pair is checked by its pins only (it passes here: that is row 8's
        # gap); once Channel.create labels every pair, one is refused too.
        plain = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(_checks, "REQUIRE_WAKE_LABELS", False)
                assert check(reader(2, plain[1].fileno()), index=2) == "ok"
                mp.setattr(_checks, "REQUIRE_WAKE_LABELS", True)
                assert "without its label" in check(reader(0, plain[0].fileno()), index=0)
        finally:
            for end in plain:
                end.close()
    finally:
        for c in (ch, other, b):
            c.close()
        for s in stray:
            s.close()


def test_malformed_and_oversized_messages_are_refused(broker):
    b = broker
    # (datagram, the refusal, the id it answers: 0 where no id could be read)
    cases = [(b"\x00" * 7, "malformed", 0), (os.urandom(64), "malformed", 0),
             (b"\xff" * 64, "malformed", 0),
             (P.encode_reply(1, P.Error("refused", "x" * 200)), None, 0),  # another schema
             (b"\x00" * (P.MAX_MESSAGE + 8), "tooLarge", 0),
             (P.encode_request(3, P.SetLatch("x" * (P.MAX_REASON + 1))), "malformed", 3),
             (P.encode_request(7, P.SetLatch("a\nb")), "malformed", 7)]
    for data, code, want_id in cases:
        n = len(b.events("broker_refused"))
        P.send(b.client.sock, data)
        got = P.recv(b.client.sock)
        assert got is not None, "the broker closed its socket"
        rid, rep = P.decode_reply(got[0])
        if code is None:                   # may decode as some request: never a crash
            b.client.ping()
            continue
        assert isinstance(rep, P.Error) and rep.code == code, (data[:32], rep)
        # A refusal answers its request by id where the id could be read (a malformed
        # body); id 0, which the client files to its oldest request, only when not.
        assert rid == want_id, (data[:32], rid)
        _refused(b, n, code)
    # the client's own checks say the same in a typed error
    with pytest.raises(Malformed):
        P.decode_request(b"\x01" * 24)
    with pytest.raises(TooLarge):
        P.decode_request(b"\x00" * (P.MAX_MESSAGE + 8))
    assert b.client.proc.poll() is None


def test_the_latch_is_written_only_inside_the_state_dir(broker, tmp_path):
    """A symlink planted under the latch's names (by anyone who can write the state
    dir) is replaced, never written through."""
    c, state = broker.client, broker.state
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    for name in ("failsafe.latch", "failsafe.latch.tmp"):
        (state / name).unlink(missing_ok=True)
        (state / name).symlink_to(victim)
    assert "unreadable latch file: a symlink" in c.read_latch()   # a latch all the same
    c.set_latch("controlsd failed: test")
    assert victim.read_text() == "untouched"
    latch = state / "failsafe.latch"
    assert latch.is_file() and not latch.is_symlink()
    assert json.loads(c.read_latch())["reason"] == "controlsd failed: test"
    from supervisor.failsafe import FailSafeLatch

    assert FailSafeLatch(latch).read()["reason"] == "controlsd failed: test"  # same format
    # Latched: nothing starts, and only the operator clears it (never through the broker).
    with pytest.raises(Refused, match="latched"):
        c.start("a", 99)
    with pytest.raises(Refused, match="operator"):
        c.clear_latch()
    assert latch.exists() and victim.read_text() == "untouched"
    latch.unlink()                        # the operator (root, on the file)
    assert c.read_latch() is None


# ---------------------------------------------------------------- fuzz

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# The suite's run; a long run for a report: BROKER_FUZZ_EXAMPLES=20000 (the live broker
# gets a tenth of it).
_EXAMPLES = int(os.environ.get("BROKER_FUZZ_EXAMPLES", "200"))
_VALID = [P.encode_request(1, r) for r in (
    P.Ping(), P.Start("a", 3, False, (P.Grant("a_out", "writer", 5),)),
    P.SignalPid(123, "term"), P.OpenProc(5, ("maps", "mem")), P.SetLatch("why"),
    P.Reap("r", 2), P.ReadLatch(), P.OpenFd(5, 3), P.OpenMapFile(5, 0x1000, 0x3000),
    P.SignalThread(5, 6, True), P.OpenProc(5, ("pagemap",)), P.OpenPidNs(5),
    P.ReadFilters(5), P.OpenMapFiles(5, ((0x1000, 0x3000), (0x5000, 0x6000))))]


@st.composite
def _mutated(draw) -> bytes:
    """A valid message with bytes flipped, cut or extended: what gets past the framing."""
    data = bytearray(draw(st.sampled_from(_VALID)))
    for _ in range(draw(st.integers(1, 8))):
        i = draw(st.integers(0, len(data) - 1))
        data[i] = draw(st.integers(0, 255))
    cut = draw(st.integers(0, len(data)))
    return bytes(data[:cut]) + draw(st.binary(max_size=64))


@settings(max_examples=_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.one_of(st.binary(max_size=2048), _mutated()))
# Found by a 20,000-example run: a signal enum past the schema's enumerants made pycapnp
# raise RuntimeError("Member was null") out of the decoder.
@example(b"\x00\x00\x00\x00\x04\x00\x00\x00\x00\x00\x00\x00\x01\x00\x01\x00\x01\x00\x00"
         b"\x00\x02\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00{\x00\x00\x00\x00\x01\x00"
         b"\x00\x00\x00\x00\x00\x00\x00\x00\x00")
def test_fuzz_the_request_decoder_raises_only_its_own_errors(data):
    try:
        rid, req = P.decode_request(data)
    except (Malformed, TooLarge):
        return
    assert 0 <= rid < 2**32 and P.kind_of(req)


@settings(max_examples=max(100, _EXAMPLES // 10), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.one_of(st.binary(min_size=1, max_size=512), _mutated()))
def test_fuzz_the_live_broker_answers_every_datagram(broker, data):
    """Whatever arrives, one reply comes back and the broker lives (a fuzzed message
    may decode as a real request: those are judged like any other)."""
    rep = broker.raw(data)
    assert isinstance(rep, (P.Error, P.Ok, P.Latch, P.PidList, P.Reaped, P.Started,
                            P.Opened)), rep
    assert broker.client.proc.poll() is None


# ---------------------------------------------------------------- /proc for the exec watch

def test_links_and_thread_signals_of_pids_not_its_own_are_refused(broker):
    """openFd, openMapFile, openPidNs and signalThread carry numbers, never a path: the broker
    formats /proc/PID/fd/N and map_files/A-B itself, for a pid of its sandboxes only, and
    refuses numbers out of range before it looks."""
    b, c = broker, broker.client
    stranger = subprocess.Popen(["sleep", "30"])
    try:
        n = len(b.events("broker_refused"))
        for pid in (1, os.getpid(), stranger.pid, b.pid):
            with pytest.raises(NotOurs):
                c.open_fd(pid, 0)
            with pytest.raises(NotOurs):
                c.open_map_file(pid, 0x400000, 0x401000)
            with pytest.raises(NotOurs):
                c.signal_thread(pid, pid, stop=True)
            with pytest.raises(NotOurs):
                c.open_pid_ns(pid)
            with pytest.raises(NotOurs):           # nothing is seized
                c.read_filters(pid)
            with pytest.raises(NotOurs):
                c.open_map_files(pid, [(0x400000, 0x401000)])
        got = b.events("broker_refused")[n:]
        assert [e["code"] for e in got] == ["notOurs"] * 24, got
        assert "TracerPid:\t0" in Path(f"/proc/{stranger.pid}/status").read_text()
        assert _state(stranger.pid) not in ("T", "t")         # nothing was stopped
        for bad in (P.OpenFd(stranger.pid, -1), P.OpenFd(stranger.pid, P.MAX_FD),
                    P.OpenMapFile(stranger.pid, 0x1000, 0x1000),      # empty
                    P.OpenMapFile(stranger.pid, 0x2000, 0x1000),      # backwards
                    P.OpenMapFile(stranger.pid, 0x1001, 0x2000),      # not page-aligned
                    P.SignalThread(stranger.pid, 0, True), P.OpenProc(stranger.pid, ()),
                    P.OpenMapFiles(stranger.pid, ()),                  # none
                    P.OpenMapFiles(stranger.pid, ((0x1000, 0x2000),) * (P.MAX_FDS + 1)),
                    P.OpenMapFiles(stranger.pid, ((0x1000, 0x2000), (0x2000, 0x2001)))):
            before = len(b.events("broker_refused"))
            with pytest.raises(Malformed):
                c.call(bad)
            _refused(b, before, "malformed")
    finally:
        stranger.kill()
        stranger.wait()


def _as_nobody(fn) -> object:
    """fn() in a forked child that has become nobody (no capabilities: setresuid from 0
    clears them), its JSON result returned; an exception comes back as its text."""
    import pwd
    import traceback

    nobody = pwd.getpwnam("nobody")
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(nobody.pw_gid, nobody.pw_gid, nobody.pw_gid)
            os.setresuid(nobody.pw_uid, nobody.pw_uid, nobody.pw_uid)
            try:
                out = {"ok": fn()}
            except BaseException:
                out = {"error": traceback.format_exc()[-3000:]}
            data = json.dumps(out).encode()
            while data:
                data = data[os.write(w, data):]
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 1 << 16):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(child, 0)
    got = json.loads(b"".join(chunks) or b'{"error": "no result"}')
    assert "error" not in got, got["error"]
    return got["ok"]


def _watch_until_ready(a, opener, status_r: int) -> list[tuple[str, bool, str]]:
    """The real exec watch (sandbox/execwatch.py) over the listener the runner sends,
    judging every request until the worker says READY: (syscall, allowed, reason)."""
    from supervisor.sandbox.execwatch import ExecWatch

    _, fds, _, _ = socket.recv_fds(a.watch_sock, 16, 1)
    watch = ExecWatch(fds[0], allow_anonymous_exec=False, opener=opener)
    verdicts, buf = [], b""
    deadline = time.monotonic() + 60
    try:
        while b"READY=1" not in buf and time.monotonic() < deadline:
            ready = select.select([watch.fileno(), status_r], [], [], 0.2)[0]
            if watch.fileno() in ready and not watch.hung_up:
                verdicts += [(v.request.syscall, v.allowed, v.reason)
                             for v in watch.handle_pending(max_requests=16)]
            if status_r in ready:
                try:
                    buf += os.read(status_r, 65536)
                except BlockingIOError:
                    pass
        assert b"READY=1" in buf, buf[-300:]
    finally:
        watch.close()
    return verdicts


@pytest.mark.sandbox
@needs_bwrap
def test_exec_watch_and_maps_scan_as_nobody_through_the_broker_see_what_root_sees(broker, channel):
    """Phase 2's ground: the supervisor proper (nobody, no capabilities) runs the real
    exec watch, maps scan and W^X check of a sandbox the broker started, with the
    broker's opener (fd/N, map_files, maps, pagemap, mountinfo opened by the broker;
    SIGSTOP/SIGCONT per thread by its requests), and gets root's verdicts. Without the
    opener the same scan as nobody is refused by the kernel."""
    from supervisor.admission import maps
    from supervisor.broker import BrokerProcOpener
    from supervisor.sandbox import execwatch, wx
    from supervisor.sandbox.procfs import DIRECT

    c = broker.client
    opener = BrokerProcOpener(c)
    runs = {}
    for who in ("root", "nobody"):
        n = _next() + 1000
        a = c.start("a", n, handles={"a_out": channel.writer_handle()})
        try:
            if who == "root":
                runs[who] = _watch_until_ready(a, DIRECT, a.status_r)
            else:
                runs[who] = [tuple(v) for v in _as_nobody(
                    lambda: _watch_until_ready(a, opener, a.status_r))]
            worker = c.pids("a", n)[-1]
        except BaseException:
            c.kill_sandbox("a", n)
            raise
        if who == "root":
            c.kill_sandbox("a", n)
            _wait_exit(a.pidfd)
            c.reap("a", n)
            a.close()
    denied = {k: [v for v in vs if not v[1]] for k, vs in runs.items()}
    assert denied == {"root": [], "nobody": []}, denied
    # The same start-up judged the same way (a set: how often Python maps one library
    # is not the point). A single-threaded start-up is judged without a stop (_alone):
    # the stop through the broker is checked below.
    assert runs["root"] and set(runs["nobody"]) == set(runs["root"]), runs

    def look(op) -> dict:
        snap = maps.exec_snapshot(worker, opener=op)
        return {"scan": [h.describe() for h in maps.scan_pid(worker, immutable_code=True,
                                                              opener=op)],
                "snapshot": sorted(repr(m) for m in snap.mappings),
                "snapshot_hits": [h.describe() for h in snap.hits],
                "wx_maps": execwatch.writable_executable_mappings(worker, op),
                "exec_vmas": [list(v) for v in execwatch.vmas_between(
                    worker, 0, 1 << 47, exec_only=True, opener=op)],
                "wx": [wx.verify(worker, baseline=0, opener=op).ok,
                       wx.verify(worker, baseline=0, opener=op).how],
                "init": execwatch._sandbox_init(worker, op)}

    def as_nobody() -> dict:
        got = look(opener)
        try:
            maps.scan_pid(worker, immutable_code=True)
            got["direct"] = "read"
        except PermissionError:
            got["direct"] = "EACCES"
        frozen = execwatch._Frozen.stop(worker, time.monotonic() + 5, None, opener)
        # `worker` is the caller here, whose stop _Frozen never waits for (a real one is
        # held in its seccomp wait): its own SIGSTOP lands a moment later under load.
        until = time.monotonic() + 2
        while _state(worker) != "T" and time.monotonic() < until:
            time.sleep(0.005)
        got["stopped"] = _state(worker)
        frozen.resume()
        time.sleep(0.05)
        got["resumed"] = _state(worker)
        return got

    try:
        root = look(DIRECT)
        nobody = _as_nobody(as_nobody)
        assert nobody.pop("direct") == "EACCES"
        assert (nobody.pop("stopped"), nobody.pop("resumed")[0]) in (("T", "S"), ("T", "R"))
        assert nobody == json.loads(json.dumps(root)), (nobody, root)
        assert root["snapshot"] and root["exec_vmas"]
        # Nobody's W^X check is the broker's read-back (readFilters), not a count.
        assert root["wx"] == [True, "ptrace"]
        assert root["init"] is not None           # bwrap's init, found through ns/pid
    finally:
        c.kill_sandbox("a", n)
        _wait_exit(a.pidfd)
        c.reap("a", n)
        a.close()


@pytest.mark.sandbox
@needs_bwrap
def test_links_and_thread_signals_inside_a_sandbox_are_checked(broker):
    """Within its own sandbox the broker still refuses: a thread of another process (the
    sandbox's bwrap, or this test), an fd the worker does not hold, a range it has not
    mapped. The kernel's errno comes back with a `failed` (ENOENT: as a direct open)."""
    from supervisor.broker import Failed

    c = broker.client
    n = _next() + 2000
    s = c.start("lone", n)
    try:
        _status_until_ready(s.status_r)
        worker = c.pids("lone", n)[-1]
        before = len(broker.events("broker_refused"))
        for tid in (s.pid, os.getpid(), 1):
            with pytest.raises(NotOurs):
                c.signal_thread(worker, tid, stop=True)
        assert _state(worker) not in ("T", "t")
        with pytest.raises(Failed) as e:
            c.open_fd(worker, 999_999)
        assert e.value.errno == errno.ENOENT
        with pytest.raises(Failed) as e:
            c.open_map_file(worker, 0x1000, 0x2000)
        assert e.value.errno == errno.ENOENT
        got = broker.events("broker_refused")[before:]
        assert [e["code"] for e in got] == ["notOurs"] * 3 + ["failed"] * 2, got
        fd = c.open_fd(worker, 0)                       # its stdin: /dev/null, O_PATH
        try:
            assert os.readlink(f"/proc/self/fd/{fd}") == "/dev/null"
        finally:
            os.close(fd)
        c.signal_thread(worker, worker, stop=True)
        deadline = time.monotonic() + 5
        while _state(worker) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(worker) == "T"
        c.signal_thread(worker, worker, stop=False)
        # openMapFiles: each executable file mapping, one request; an unmapped range
        # is said (False), not refused. The maps scan through the broker's opener batches
        # its links (one openMapFile, then openMapFiles) and finds what root finds.
        from supervisor.admission import maps
        from supervisor.broker import BrokerProcOpener
        from supervisor.broker._client import _exec_ranges

        ranges = _exec_ranges(c, worker)
        assert len(ranges) > 3
        got_fds = c.open_map_files(worker, [*ranges, (0x1000, 0x2000)])
        try:
            assert set(got_fds) == set(ranges)
            for (a_, z_), fd in got_fds.items():
                assert os.readlink(f"/proc/self/fd/{fd}") == \
                    os.readlink(f"/proc/{worker}/map_files/{a_:x}-{z_:x}")
        finally:
            P.close_fds(list(got_fds.values()))
        kinds: list[str] = []
        real_call = c.call

        def counting(req, fds=()):
            kinds.append(P.kind_of(req))
            return real_call(req, fds)

        c.call = counting
        try:
            via = maps.scan_pid(worker, immutable_code=True, opener=BrokerProcOpener(c))
        finally:
            del c.call
        assert [h.describe() for h in via] == \
            [h.describe() for h in maps.scan_pid(worker, immutable_code=True)]
        assert kinds.count("openMapFile") <= 2 and kinds.count("openMapFiles") >= 1, kinds
        assert len(kinds) < len(ranges), kinds
        # A batch serves one burst of links: any other use of the opener in between
        # (the exec watch reads status, maps, signals between judgements) drops it, so a
        # link after that is the broker's answer of now, never one fetched earlier.
        op = BrokerProcOpener(c)
        names = [f"map_files/{a_:x}-{z_:x}" for a_, z_ in ranges[:3]]
        kinds.clear()
        c.call = counting
        try:
            for name in names[:2]:
                with op.link(worker, name):
                    pass
            os.close(op.open(worker, "status"))
            with op.link(worker, names[2]):
                pass
        finally:
            del c.call
        assert kinds == ["openMapFile", "openProc", "openMapFiles", "openProc",
                         "openMapFile"], kinds
        # After the opener's own open of maps the batch reads that (no openProc).
        kinds.clear()
        c.call = counting
        try:
            os.close(op.open(worker, "maps"))
            for name in names[:2]:
                with op.link(worker, name):
                    pass
        finally:
            del c.call
        assert kinds == ["openProc", "openMapFile", "openMapFiles"], kinds
        # readFilters reads back what is there: a research worker takes no W^X lock.
        got = c.read_filters(worker)
        assert got.ptrace and not got.ok and "none of them the W^X filter" in got.reason
        assert got.threads >= 1
        assert "TracerPid:\t0" in Path(f"/proc/{worker}/status").read_text()   # let go
    finally:
        c.kill_sandbox("lone", n)
        _wait_exit(s.pidfd)
        c.reap("lone", n)
        s.close()
    # The sandbox is gone: its pid is no longer the broker's, and the W^X check through
    # the broker's opener says gone (ProcessLookupError), as verify's own does.
    from supervisor.broker import BrokerProcOpener
    from supervisor.sandbox import wx

    before = len(broker.events("broker_refused"))
    with pytest.raises(NotOurs):
        c.read_filters(worker)
    with pytest.raises(ProcessLookupError):
        wx.verify(worker, baseline=0, opener=BrokerProcOpener(c))
    assert [e["code"] for e in broker.events("broker_refused")[before:]] == ["notOurs"] * 2


@pytest.mark.sandbox
@needs_bwrap
def test_realtime_through_the_broker_gets_the_trees_rt_bandwidth(broker):
    """On cgroup v1 with RT group scheduling a leaf's RT runtime must fit in its tree's:
    the broker reserves the tree's as the in-process supervisor does, so a `realtime`
    request makes the worker SCHED_FIFO (before: EINVAL, and the proper said
    'realtime_unavailable ... [Errno 0]')."""
    from supervisor.sandbox import sandbox_main_pid

    rt_file = Path("/sys/fs/cgroup/cpu/cpu.rt_runtime_us")
    c = broker.client
    n = _next() + 3000
    s = c.start("rt", n)
    served = ExecWatchServer(s.watch_sock)
    try:
        _status_until_ready(s.status_r)
        short = broker.events("realtime_unavailable")
        if short:       # other supervisors on this machine hold the RT bandwidth: said
            pytest.skip(f"no RT bandwidth left to reserve here: {short[0]['reason']}")
        c.realtime("rt", n)
        worker = sandbox_main_pid(sorted(set(c.pids("rt", n)) - {s.pid}))
        assert os.sched_getscheduler(worker) & 0xFF == os.SCHED_FIFO
        if rt_file.exists():              # v1 RT groups: the leaf holds the budget
            leaf = [ln.split(":", 2)[2] for ln in
                    Path(f"/proc/{worker}/cgroup").read_text().splitlines()
                    if ln.split(":")[1].split(",").count("cpu")][0]
            got = int((Path("/sys/fs/cgroup/cpu") / leaf.lstrip("/") /
                       "cpu.rt_runtime_us").read_text())
            assert got == 5 * 1_000, got       # 5 % of the 100 ms period
    finally:
        served.close()
        c.kill_sandbox("rt", n)
        _wait_exit(s.pidfd)
        c.reap("rt", n)
        s.close()


def test_the_audit_says_what_runs_as_root_and_why(broker, tmp_path):
    """supervisor/audit/privilege.py: one root supervisor that also reads hostile input
    until the split is in use; then the broker alone is root (reads no hostile input)
    and the supervisor proper has no capabilities. How it knows is said."""
    from supervisor import units
    from supervisor.audit import privilege as pv

    # The module's config without its real-time worker (that one adds CAP_SYS_NICE).
    path = tmp_path / "no-rt.toml"
    path.write_text(CONFIG.split("[workers.rt]")[0].format(rw=tmp_path))
    cfg = load(path)
    one = pv.privilege(cfg, unit_dir=tmp_path)
    assert not one["split"] and "no trio-broker.service" in one["found"]
    [sup] = one["processes"]
    assert sup["root"] and sup["reads_hostile_input"]
    assert sup["capabilities"] == list(units.CAPABILITIES) and sup["exposure"] == 3.3
    (tmp_path / units.BROKER_UNIT).write_text("[Service]\n")
    split = pv.privilege(cfg, unit_dir=tmp_path)
    assert split["split"] and "installed" in split["found"]
    brk, proper = split["processes"]
    assert (brk["user"], brk["root"], brk["reads_hostile_input"]) == ("root", True, False)
    assert any("/proc of the sandboxes" in w for w in brk["why"])
    assert (proper["user"], proper["capabilities"], proper["root"]) == \
        (units.SUPERVISOR_USER, [], False) and proper["exposure"] == 0.2
    # A live audit goes by the process that holds the sandboxes, not by files.
    assert pv.split_in_use({"pid": 7, "argv": ["python", "-m", "supervisor.broker"]},
                           tmp_path)[0]
    assert not pv.split_in_use({"pid": 7, "argv": ["supervisor", "run"]}, tmp_path)[0]
    md = "\n".join(pv.md_lines({"privilege": split}))
    assert "## What runs as root" in md and "| broker | trio-broker.service | root |" in md
    assert "| supervisor proper | trio-supervisor-proper.service | trio-supervisor | none |" in md


def test_gpu_nodes_pass_the_plan_check_only_for_a_cuda_worker():
    """A device = "cuda" worker's policy binds the GPU nodes (issue 28): the broker's
    plan check takes them only when the worker's config says cuda (_start passes
    CUDA_DEVICE_NODES then), and refuses them for any other."""
    from types import SimpleNamespace

    from supervisor.broker._checks import check_plan
    from supervisor.sandbox.policy import CUDA_DEVICE_NODES

    pol = SimpleNamespace(domain="control", host_uid=1000, host_gid=1000, ro_binds=[],
                          rw_binds=[], dev_binds=list(CUDA_DEVICE_NODES))
    check_plan(pol, domain_rw=(), domain_dev=CUDA_DEVICE_NODES, state_dir="/var/lib/x",
               root=True)
    with pytest.raises(Refused, match="device binds not named"):
        check_plan(pol, domain_rw=(), domain_dev=(), state_dir="/var/lib/x", root=True)


def test_a_slow_read_back_holds_no_other_request():
    """readFilters (the W^X read-back, up to wx.VERIFY_WALL_S on a thread that will not
    stop) is answered from a broker thread of its own, so the client matches replies by
    id: a dying control writer's `pids` (the SAFE path) and a kill go through while one
    is outstanding. Here the broker's side is scripted on a real socket: it holds the
    readFilters reply until two later requests are answered, and cuts one (id 0)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c = BrokerClient(ours)
    got: dict[str, object] = {}
    slow = threading.Thread(target=lambda: got.update(filters=c.read_filters(42)))
    slow.start()
    rid_f, req = P.decode_request(P.recv(theirs)[0])
    assert isinstance(req, P.ReadFilters) and req.pid == 42
    fast = threading.Thread(target=lambda: got.update(pids=c.pids("w", 1)))
    fast.start()
    rid_p, req = P.decode_request(P.recv(theirs)[0])
    assert isinstance(req, P.Pids)
    P.send(theirs, P.encode_reply(rid_p, P.PidList((7, 8))))
    fast.join(5)
    assert got.get("pids") == [7, 8] and "filters" not in got and slow.is_alive()
    # A request the kernel cut comes back with id 0: it is the oldest one answered in
    # order, never the outstanding readFilters.
    errs: list[BaseException] = []

    def ping() -> None:
        try:
            c.ping()
        except BaseException as e:        # noqa: BLE001 - what the caller saw
            errs.append(e)

    cut = threading.Thread(target=ping)
    cut.start()
    P.decode_request(P.recv(theirs)[0])
    P.send(theirs, P.encode_reply(0, P.Error("tooLarge", "cut by the kernel")))
    cut.join(5)
    assert len(errs) == 1 and isinstance(errs[0], TooLarge) and slow.is_alive()
    P.send(theirs, P.encode_reply(rid_f, P.Filters(True, True, "", 3, 1200)))
    slow.join(5)
    assert got["filters"] == P.Filters(True, True, "", 3, 1200)
    theirs.close()
    with pytest.raises(ConnectionError):
        c.ping()
    ours.close()


@pytest.mark.sandbox
@needs_bwrap
def test_read_backs_and_other_requests_at_once_each_get_their_own_reply(broker):
    """The real broker: read-backs on one thread while another asks pids and pings;
    every reply is its own request's."""
    c = broker.client
    n = _next() + 3000
    s = c.start("lone", n)
    errors: list[BaseException] = []
    stop = threading.Event()
    try:
        _status_until_ready(s.status_r)
        worker = c.pids("lone", n)[-1]

        def backs() -> None:
            try:
                while not stop.is_set():
                    got = c.read_filters(worker)
                    assert got.ptrace and got.threads >= 1, got
            except BaseException as e:    # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=backs)
        t.start()
        counted = 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert worker in c.pids("lone", n)
            c.ping()
            counted += 1
        stop.set()
        t.join(10)
        assert not errors, errors
        assert counted > 10
    finally:
        stop.set()
        c.kill_sandbox("lone", n)
        _wait_exit(s.pidfd)
        c.reap("lone", n)
        s.close()
