"""One process of a worker (an `Incarnation`) and the two ways to start one (launchers).

An incarnation is everything that belongs to one process of a worker and dies with it:
its sandbox (bwrap's pid), the supervisor's ends of its pipes and sockets, its cgroup,
its exec watch, the status pipe's partial line and rate-limit counters. The worker's
policy state (config, restart budget, standbys) is `WorkerRun`'s. Taking over a warm
standby hands its incarnation to the run: `run.current = sb.current`.

Two kinds, one interface (`alive`, `kill`, `signal`, `members`, `kill_rest`, `kill_all`,
`release`, `oom_kills`, `make_fifo`, `close`):
  - `PopenIncarnation`: started in this process by `DirectLauncher` (`launch.spawn`, as
    root, the cgroup tree ours; or a plain Popen with --no-sandbox);
  - `BrokerIncarnation`: started by the privileged broker (`BrokerLauncher`,
    `supervisor run --privsep` / `--broker`); every privileged act on it is a checked
    broker request, and bwrap's pidfd (readable once it exits) is all we hold of it.

Both give `poll()`, `wait()`, `pid` and `returncode` like a Popen, so that readers
outside the lifecycle (`run.proc.poll()`, audit, benches) keep working.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import trio

from supervisor.output import LineLimiter
from supervisor.protocol import ENV_EXECWATCH_FD, ENV_STANDBY_FD, endpoint_for, worker_env
from supervisor.ratelimit import TokenBucket
from supervisor.sandbox.procfs import DIRECT, ProcOpener


def _os_error(e: Exception) -> OSError:
    """A broker refusal as an OSError whose text is the broker's reason: with its errno
    where the kernel gave one, else none (OSError(0, reason) read "[Errno 0] ...")."""
    errno_ = getattr(e, "errno", 0)
    reason = getattr(e, "reason", str(e))
    return OSError(errno_, reason) if errno_ else OSError(reason)


def _readable(fd: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


@dataclass(eq=False)
class Incarnation:
    """One process of a worker: its sandbox and our ends of its pipes (see the module
    doc). Made by a launcher; the per-process fields below are the lifecycle's (the
    status pipe's are _io's, the exec watch's _exec's, worker_pidfd _lastword's)."""

    number: int                              # per worker, increasing (the broker checks)
    pid: int                                 # bwrap (or the worker itself, unsandboxed)
    sandboxed: bool = True
    status_r: int | None = None              # the worker's status pipe (read end)
    out_r: int | None = None                 # its stdout+stderr (a pipe)
    watch_sock: socket.socket | None = None  # receives the exec-watch listener (control)
    ctl_sock: socket.socket | None = None    # (standby) our end of the hand-over
    status_buf: bytes = b""                  # an incomplete status line
    status_skip: bool = False                # inside an over-long line: drop to its newline
    status_bucket: TokenBucket | None = None  # status lines (made at the spawn, _io's rates)
    proto_err_at: float = float("-inf")      # the last protocol_error event (monotonic s)
    proto_err_held: int = 0                  # protocol errors not logged since (1/s)
    output: LineLimiter = field(default_factory=LineLimiter)
    output_read: int = 0                     # bytes read of its stdout+stderr
    watch: Any = None                        # sandbox.execwatch.ExecWatch of this process
    exec_allowed: int = 0                    # executable mappings admitted before READY
    # The worker process itself (pid 2 of its sandbox) as a pidfd: readable the moment
    # it is dead, before bwrap has noticed (the writer of last resort waits on it).
    worker_pidfd: int | None = None
    returncode: int | None = None
    opener: ProcOpener = DIRECT              # how its /proc is read (exec watch, scans)
    main_pid: int = 0                        # the worker (pid 2 inside), once found

    # Whether the worker's host pid, once found, is kept for the incarnation's life
    # (Supervisor._worker_pid). Through the broker yes: every signal and /proc view of it
    # is checked there against the sandbox's cgroup, so a pid recycled after the worker
    # died is refused, never reached; and each lookup is a `pids` round trip that
    # waits behind the maps scan's requests (warm-standby recovery measured 20-35 ms
    # slower without it). In-process no: a signal by pid from root has no such check.
    KEEPS_MAIN_PID = False

    # ---------------------------------------------------------------- Popen-like
    @property
    def proc(self) -> Incarnation:
        """Itself: `run.proc.poll()` / `run.proc.pid` for readers outside the lifecycle."""
        return self

    @property
    def alive(self) -> bool:
        return self.poll() is None

    def poll(self) -> int | None:
        raise NotImplementedError

    def wait(self) -> int:
        raise NotImplementedError

    # ---------------------------------------------------------------- signals
    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the sandbox's outer process (bwrap): SIGKILL takes the whole sandbox,
        at any point of its start. Once set up, its init dies with bwrap
        (--die-with-parent); killed in its first milliseconds, before the init arms that,
        bwrap leaves the init to the process that spawned it (a child subreaper), which
        kills it as it sees bwrap's exit (`launch.SandboxPopen`: our `wait`/`poll`, the
        broker's reap), cgroup or none (tests/test_orphans.py). Unsandboxed: the worker
        only. Nothing once it has exited: its pid may be someone else's now."""
        raise NotImplementedError

    def signal(self, pid: int, sig: int) -> None:
        """Signal one process of the sandbox; ProcessLookupError if it is gone."""
        raise NotImplementedError

    def members(self) -> set[int]:
        """Host pids of the sandbox now, bwrap included where it lives: its cgroup's
        members (bwrap gone or not) where it has one, else bwrap and its descendants."""
        raise NotImplementedError

    def kill_rest(self, pids: list[int], worker_fd: int | None) -> None:
        """SIGKILL what is left of a dead writer's sandbox: the worker by its pidfd
        (`worker_fd`, when it is among them) and `pids`, never a recycled pid."""
        raise NotImplementedError

    def kill_all(self) -> None:
        """SIGKILL every process of the sandbox and wait until none is left (blocking:
        call off the event loop). OSError/TimeoutError if one resists."""
        raise NotImplementedError

    def release(self, log: Callable[..., None]) -> None:
        """After its exit: nothing of it survives (leftovers killed, cgroup removed)."""

    def oom_kills(self) -> int:
        """Kills by the kernel at its memory limit since it started."""
        return 0

    def make_fifo(self, pid: int, priority: int, runtime_us: int | None,
                  still_ours: Callable[[], bool]) -> None:
        """SCHED_FIFO at `priority` for `pid` (its worker), with an RT budget for its
        cgroup where it has one (`runtime_us`); OSError/RealtimeUnavailable if refused."""
        raise NotImplementedError

    def close(self) -> None:
        """Our ends of its pipes and sockets (the process may live on: the caller
        decides when it is done with it)."""
        for name in ("status_r", "out_r", "worker_pidfd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)
        for name in ("watch", "watch_sock", "ctl_sock"):
            obj = getattr(self, name)
            if obj is not None:
                obj.close()
                setattr(self, name, None)


@dataclass(eq=False)
class PopenIncarnation(Incarnation):
    """Started by this process (`DirectLauncher`): bwrap's Popen and the cgroup leaf."""

    popen: subprocess.Popen | None = None
    cgroup: Any = None                       # sandbox.cgroups.WorkerCgroup
    oom_before: int = 0

    def poll(self) -> int | None:
        self.returncode = self.popen.poll()
        return self.returncode

    def wait(self) -> int:
        self.returncode = self.popen.wait()
        return self.returncode

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def signal(self, pid: int, sig: int) -> None:
        os.kill(pid, sig)

    def members(self) -> set[int]:
        if not self.sandboxed:
            return {self.pid} if self.popen.poll() is None else set()
        if self.cgroup is not None:
            # The sandbox's own cgroup lists exactly its processes (every one was cloned
            # into it, and none can leave): one file per hierarchy, where walking all of
            # /proc took 13 ms on a loaded 2-core machine.
            try:
                return set(self.cgroup.pids())
            except OSError:                  # removed: only an empty one can be
                return set()
        if self.popen.returncode is not None:
            return set()       # reaped by us: its pid may be someone else's now
        from supervisor.sandbox import descendant_pids

        return {self.pid, *descendant_pids(self.pid)}

    def kill_rest(self, pids: list[int], worker_fd: int | None) -> None:
        if worker_fd is not None:
            try:
                signal.pidfd_send_signal(worker_fd, signal.SIGKILL)
            except OSError:
                pass
        cg = self.cgroup
        if cg is None or not pids:
            return
        from supervisor.sandbox.cgroups import kill_listed

        def listed() -> set[int]:
            try:
                return set(cg.pids())
            except OSError:
                return set()

        kill_listed(pids, listed)

    def kill_all(self) -> None:
        if self.cgroup is not None:
            self.cgroup.kill_all()

    def release(self, log: Callable[..., None]) -> None:
        cg, self.cgroup = self.cgroup, None
        if cg is not None:
            try:
                cg.kill_all()
                cg.remove()
            except OSError as e:
                log(error=str(e))

    def oom_kills(self) -> int:
        if self.cgroup is None:
            return 0
        try:
            return self.cgroup.oom_kills() - self.oom_before
        except OSError:
            return 0

    def make_fifo(self, pid: int, priority: int, runtime_us: int | None,
                  still_ours: Callable[[], bool]) -> None:
        from supervisor.sandbox.sched import RT_PERIOD_US, make_fifo

        if runtime_us is not None and self.cgroup is not None:
            self.cgroup.grant_rt(runtime_us, RT_PERIOD_US)
        make_fifo(pid, priority, still_ours)


@dataclass(eq=False)
class BrokerIncarnation(Incarnation):
    """Started by the privileged broker: we hold bwrap's pidfd and our pipe ends; every
    signal, listing and kill is a broker request, checked there against what it started.
    The broker reaps bwrap; our `poll()` asks it once the pidfd says it exited."""

    KEEPS_MAIN_PID = True

    client: Any = None                       # supervisor.broker.BrokerClient
    worker: str = ""
    pidfd: int | None = None
    in_cgroup: bool = False                  # the broker put it in a leaf of its tree
    oom: int = 0                             # from the broker's reap
    reaped: bool = False

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self.pidfd is not None and not _readable(self.pidfd):
            return None
        from supervisor.broker import BrokerError

        try:
            rep = self.client.reap(self.worker, self.number)
        except (BrokerError, ConnectionError, OSError):
            # Not the broker's any more, or the broker is gone (its sandboxes die with
            # it): exited all the same, cause unknown.
            self.returncode, self.reaped = -signal.SIGKILL, True
            return self.returncode
        if not rep.exited:                   # readable pidfd, not yet reapable: soon
            return None
        self.returncode, self.oom, self.reaped = rep.code, rep.oom_kills, True
        return self.returncode

    def wait(self) -> int:
        while self.poll() is None:
            if self.pidfd is not None:
                select.select([self.pidfd], [], [], 0.05)
            else:
                time.sleep(0.01)
        return self.returncode

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.reaped or (self.pidfd is not None and _readable(self.pidfd)):
            return
        from supervisor.broker import BrokerError

        try:
            self.client.signal(self.pid, sig)
        except BrokerError:
            pass                              # gone meanwhile (its exit is reported)

    def signal(self, pid: int, sig: int) -> None:
        from supervisor.broker import NotOurs

        try:
            self.client.signal(pid, sig)
        except NotOurs as e:
            raise ProcessLookupError(e.reason) from None

    def members(self) -> set[int]:
        if self.reaped:
            return set()
        from supervisor.broker import BrokerError

        try:
            return set(self.client.pids(self.worker, self.number))
        except (BrokerError, ConnectionError):
            return set()                      # reaped meanwhile: nothing left

    def kill_rest(self, pids: list[int], worker_fd: int | None) -> None:
        # The broker kills the whole sandbox (its cgroup, else bwrap): everything left
        # of a dead writer's sandbox is to die anyway.
        from supervisor.broker import BrokerError

        try:
            self.client.kill_sandbox(self.worker, self.number)
        except (BrokerError, ConnectionError):
            pass

    def kill_all(self) -> None:
        if self.reaped:
            return
        from supervisor.broker import Failed, NotOurs

        try:
            self.client.kill_sandbox(self.worker, self.number)
        except NotOurs:
            pass                              # reaped: nothing of it is left
        except Failed as e:
            raise _os_error(e) from None

    def release(self, log: Callable[..., None]) -> None:
        if not self.reaped:
            self.poll()                       # the broker's reap removes the cgroup

    def oom_kills(self) -> int:
        return self.oom

    def make_fifo(self, pid: int, priority: int, runtime_us: int | None,
                  still_ours: Callable[[], bool]) -> None:
        from supervisor.broker import BrokerError

        try:
            self.client.realtime(self.worker, self.number)
        except BrokerError as e:
            raise _os_error(e) from None

    def close(self) -> None:
        super().close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


# -------------------------------------------------------------------- launchers

@dataclass
class DirectLauncher:
    """Sandboxes started by this process (root): `launch.spawn` on the main thread
    (bwrap's --die-with-parent is tied to the forking thread), in a leaf of our own
    cgroup tree when there is one. Unsandboxed: a plain Popen."""

    config: Any                               # supervisor.config.Config
    python: str
    sandboxed: bool = True
    cgroups: Any = None                       # sandbox.cgroups.CgroupTree while running
    opener: ProcOpener = DIRECT
    # The sandbox of a worker (sandbox.policy.for_worker unless told otherwise: the
    # Supervisor passes its `_policy`, the seam tests use to break one property).
    policy: Callable[[Any], Any] | None = None
    _leaf_seq: int = 0

    async def start(self, w: Any, number: int, *, standby: bool,
                    handles: dict[str, object]) -> Incarnation:
        return self.start_sync(w, number, standby=standby, handles=handles)

    def start_sync(self, w: Any, number: int, *, standby: bool,
                   handles: dict[str, object]) -> Incarnation:
        from supervisor.sandbox import launch

        domain = self.config.domain_of(w.name)
        r, wfd = os.pipe2(os.O_CLOEXEC)
        # stdout+stderr: a pipe we read, never the supervisor's own streams or a tty.
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        for fd in (r, out_r):
            os.set_blocking(fd, False)
        env, fds = worker_env(endpoint_for(self.config, w, self.sandboxed), wfd, handles)
        child_fds = [*fds, wfd]
        ours = theirs = ctl_ours = ctl_theirs = None
        if standby:
            ctl_ours, ctl_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            env[ENV_STANDBY_FD] = str(ctl_theirs.fileno())
            child_fds.append(ctl_theirs.fileno())
        join_fds: list[int] = []
        cg = None
        ok = False
        try:
            if self.sandboxed:
                pol = self.policy(w) if self.policy else launch.for_worker(self.config, w)
                if not domain.exec_memory_after_ready:
                    # The runner hands us its exec-watch listener through this socket
                    # before the worker's own code runs.
                    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    env[ENV_EXECWATCH_FD] = str(theirs.fileno())
                    child_fds.append(theirs.fileno())
                cg, join_fds = self._cgroup_for(w, standby)
                # Own session: a terminal's Ctrl-C reaches the supervisor only, which
                # then stops the workers in order.
                popen = launch.spawn(pol, launch.worker_argv(w, self.python), child_fds,
                                     env_extra=env, stdin=subprocess.DEVNULL, stdout=out_w,
                                     stderr=out_w, start_new_session=True,
                                     rlimits=launch.worker_rlimits(w), cgroup_fds=join_fds)
            else:
                popen = subprocess.Popen(launch.worker_argv(w, self.python), pass_fds=child_fds,
                                         env=dict(os.environ, **env), stdin=subprocess.DEVNULL,
                                         stdout=out_w, stderr=out_w, start_new_session=True)
            ok = True
        finally:
            for fd in (wfd, out_w, *join_fds):
                os.close(fd)
            for sock in (theirs, ctl_theirs):
                if sock is not None:
                    sock.close()
            if not ok:
                os.close(r)
                os.close(out_r)
                for sock in (ours, ctl_ours):
                    if sock is not None:
                        sock.close()
                if cg is not None:
                    try:
                        cg.kill_all()
                        cg.remove()
                    except OSError:
                        pass
        inc = PopenIncarnation(number=number, pid=popen.pid, sandboxed=self.sandboxed,
                               status_r=r, out_r=out_r, watch_sock=ours, ctl_sock=ctl_ours,
                               opener=self.opener, popen=popen, cgroup=cg)
        if cg is not None:
            try:
                inc.oom_before = cg.oom_kills()
            except OSError:
                pass
        return inc

    def _cgroup_for(self, w: Any, standby: bool) -> tuple[Any, list[int]]:
        """A fresh cgroup leaf for one process of `w`, and the fds bwrap joins with."""
        if self.cgroups is None:
            return None, []
        from supervisor.sandbox.cgroups import Limits

        # Never reuse a leaf name: leaf() kills whatever a same-named leaf still holds,
        # and an adopted standby lives on in the leaf it was started in.
        self._leaf_seq += 1
        cg = self.cgroups.leaf(f"{w.name}-{'s' if standby else 'r'}{self._leaf_seq}", Limits(
            memory_max=w.memory_max, pids_max=w.pids_max, cpu_quota_pct=w.cpu_quota,
            cpu_weight=self.config.cpu_weight_of(w.name)))
        return cg, cg.open_join_fds()


@dataclass
class BrokerLauncher:
    """Sandboxes started by the privileged broker (issue 27): the request names the
    worker and incarnation and carries the channel fds; the broker builds the launch from
    the config it loaded itself. Called from trio through a thread (the client is locked;
    a start costs the broker ~10 ms of CPU plus one round trip, docs/broker.md)."""

    client: Any                               # supervisor.broker.BrokerClient
    sandboxed: bool = True
    cgroups: Any = None                       # always None: the broker holds the tree
    opener: ProcOpener = DIRECT

    def __post_init__(self) -> None:
        from supervisor.broker import BrokerProcOpener

        self.opener = BrokerProcOpener(self.client)

    async def start(self, w: Any, number: int, *, standby: bool,
                    handles: dict[str, object]) -> Incarnation:
        from supervisor.broker import BrokerError

        try:
            got = await trio.to_thread.run_sync(lambda: self.client.start(
                w.name, number, standby=standby, handles=handles))
        except BrokerError as e:               # a start the broker refused or failed
            raise RuntimeError(f"broker: {e.code}: {e.reason}") from None
        return BrokerIncarnation(number=number, pid=got.pid, status_r=got.status_r,
                                 out_r=got.out_r, watch_sock=got.watch_sock,
                                 ctl_sock=got.ctl_sock, opener=self.opener,
                                 client=self.client, worker=w.name, pidfd=got.pidfd,
                                 in_cgroup=got.cgroup)
