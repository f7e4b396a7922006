"""Start workers under bubblewrap (plain subprocess; trio wrapping is separate).

Thread trap: bwrap --die-with-parent uses PR_SET_PDEATHSIG, which fires when
the *thread* that forked bwrap exits, not the process. trio.open_process runs
Popen in a trio worker thread that exits after ~10 s idle, so a sandbox
started that way is SIGKILLed ~10 s later (measured with trio 0.35: killed
within 13 s; the same via spawn() survived). `spawn()` therefore forks from the
main thread or from one long-lived daemon spawner thread. From trio, call
`spawn()` directly (it blocks for a few ms) or via trio.to_thread.run_sync
(it hops to the spawner thread), and wait with os.pidfd_open(p.pid) +
trio.lowlevel.wait_readable. If you use open_process yourself with
`prepare()`, do it from the main thread.

Start-up trap: --die-with-parent does not cover a sandbox's first milliseconds (see
"Orphans" below): a process that spawns sandboxes becomes a child subreaper and kills
what a dead bwrap leaves behind (`SandboxPopen`, `reap_orphans`).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import glob
import os
import queue
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, TypeVar

from . import sched, seccomp, staging
from .bwrap import build_bwrap_argv
from .policy import SandboxPolicy, for_worker

if TYPE_CHECKING:
    from supervisor.config import Config

T = TypeVar("T")

# Environment of the bwrap process itself (it runs outside the sandbox, as
# us): nothing inherited, so no LD_PRELOAD & co. reach it. The sandbox env is
# set by --clearenv/--setenv from the policy.
_BWRAP_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
_RESERVED_POPEN_KW = {"pass_fds", "close_fds", "env", "preexec_fn", "cwd", "executable", "shell"}


@dataclass
class LaunchSpec:
    """Everything needed to start one sandbox with any Popen-like API."""

    argv: list[str]
    pass_fds: tuple[int, ...]
    env: dict[str, str] = field(default_factory=lambda: dict(_BWRAP_ENV))
    # fds created for this launch (seccomp memfd): close once spawned.
    owned_fds: list[int] = field(default_factory=list)
    # Run bwrap as this host uid/gid, inside this mount namespace (staging); None: as is.
    host_uid: int | None = None
    host_gid: int | None = None
    mntns_fd: int = -1

    def close(self) -> None:
        while self.owned_fds:
            os.close(self.owned_fds.pop())

    def child_setup(self, rlimits: Mapping[str, int] | None = None,
                    cgroup_fds: Sequence[int] = ()) -> Callable[[], None]:
        """The preexec_fn any Popen of `argv` needs (cgroup, limits, staging, host uid)."""
        return _child_setup(self, rlimits or {}, tuple(cgroup_fds))


def prepare(
    policy: SandboxPolicy,
    argv: list[str],
    pass_fds: Iterable[int] = (),
    cwd: str | None = None,
    env_extra: Mapping[str, str] | None = None,
    *,
    json_status_fd: int | None = None,
) -> LaunchSpec:
    """Build argv + fd list; compiles the launch seccomp filter if enabled.

    Raises seccomp.SeccompUnavailableError for a strict domain without
    libseccomp rather than launching it unfiltered.
    """
    fds = list(dict.fromkeys(pass_fds))
    if json_status_fd is not None and json_status_fd not in fds:
        fds.append(json_status_fd)
    owned: list[int] = []
    sfd = None
    # Only root can switch to the domain's host uid (and must stage what it cannot reach).
    switch = policy.host_uid is not None and os.geteuid() == 0
    st = (staging.staging_for([*policy.ro_binds, *policy.rw_binds, *policy.dev_binds],
                              policy.hidden, writable=policy.rw_binds) if switch else None)
    if policy.seccomp_at_launch:
        sfd = seccomp.launch_filter_fd(policy.rules, network=policy.network)
        owned.append(sfd)
        fds.append(sfd)
    try:
        full = build_bwrap_argv(
            policy, argv, fds, cwd, env_extra=env_extra, seccomp_fd=sfd,
            json_status_fd=json_status_fd,
            **({"source": st.source_for, "views": st.views} if st else {}),
        )
    except BaseException:
        for fd in owned:
            os.close(fd)
        raise
    return LaunchSpec(argv=full, pass_fds=tuple(fds), owned_fds=owned,
                      host_uid=policy.host_uid if switch else None,
                      host_gid=policy.host_gid if switch else None,
                      mntns_fd=st.mntns_fd if st else -1)


_RLIMITS = {"data": resource.RLIMIT_DATA, "nofile": resource.RLIMIT_NOFILE,
            "as": resource.RLIMIT_AS, "nproc": resource.RLIMIT_NPROC,
            "core": resource.RLIMIT_CORE, "stack": resource.RLIMIT_STACK}
_libc = ctypes.CDLL(None, use_errno=True)


def _child_setup(spec: LaunchSpec, rlimits: Mapping[str, int], cgroup_fds: Sequence[int]) -> Callable[[], None]:
    """What runs between fork and exec of bwrap, still as the supervisor's uid.

    Order matters: join the cgroup and set limits while still privileged, enter the
    staging mount namespace, then drop to the domain's host uid for good (setgroups
    first: supplementary groups of root must not survive).
    """
    limits = [(_RLIMITS[k], v) for k, v in sorted(rlimits.items())]

    def setup() -> None:
        for fd in cgroup_fds:
            os.write(fd, b"0")            # "0" = the writing process
        for res, v in limits:
            resource.setrlimit(res, (v, v))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))   # no core files from sandboxes
        # No real-time class of its own making, whatever the supervisor's limit: only
        # the supervisor grants it (sandbox/sched.py), and a worker may only lower it.
        resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))
        resource.setrlimit(resource.RLIMIT_NICE, (0, 0))       # nor a nice below 0
        sched.rank_ordinary()         # never the supervisor's OOM rank (inherited)
        if spec.mntns_fd >= 0 and _libc.setns(spec.mntns_fd, staging.CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "setns(staging mount namespace)")
        if spec.host_uid is not None:
            os.setgroups([])
            os.setresgid(spec.host_gid, spec.host_gid, spec.host_gid)
            os.setresuid(spec.host_uid, spec.host_uid, spec.host_uid)
    return setup


class _SpawnerThread:
    """One daemon thread that outlives every sandbox it forks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] | None = None
        self._pid = 0

    def call(self, fn: Callable[[], T]) -> T:
        with self._lock:
            if self._q is None or self._pid != os.getpid():  # first use, or after fork
                self._q = queue.SimpleQueue()
                self._pid = os.getpid()
                threading.Thread(target=self._loop, args=(self._q,), name="sandbox-spawner", daemon=True).start()
            q = self._q
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        q.put((fn, fut))
        return fut.result()

    @staticmethod
    def _loop(q: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]) -> None:
        while True:
            fn, fut = q.get()
            try:
                fut.set_result(fn())
            except BaseException as exc:  # delivered to the caller
                fut.set_exception(exc)


_spawner = _SpawnerThread()


def on_stable_thread(fn: Callable[[], T]) -> T:
    """Run `fn` (which forks) on a thread that lives as long as the process."""
    if threading.current_thread() is threading.main_thread():
        return fn()
    return _spawner.call(fn)


def worker_argv(w: Any, python: str) -> list[str]:
    """The argv of worker `w` (a config WorkerConfig): a module through the runner, or
    its command. One home for the supervisor's launches and the broker's."""
    if w.module:
        return [python, "-m", "supervisor.runner", w.module, *w.args]
    return [*w.command, *w.args]


def worker_rlimits(w: Any) -> dict[str, int]:
    """rlimits of worker `w`'s sandbox: open fds. No RLIMIT_DATA stand-in for a
    memory_max the cgroups cannot enforce: it counts address space reserved, not memory
    used (a numpy import with 16 OpenBLAS threads hung under 512 MiB on a GPU machine),
    and misses shared memory and tmpfs; the limit is reported off instead (one
    `limits_not_enforced` event, see sandbox.cgroups.LimitsOff)."""
    return {"nofile": w.nofile} if w.nofile else {}


def spawn(
    policy: SandboxPolicy,
    argv: list[str],
    pass_fds: Iterable[int] = (),
    cwd: str | None = None,
    env_extra: Mapping[str, str] | None = None,
    *,
    json_status_fd: int | None = None,
    rlimits: Mapping[str, int] | None = None,
    cgroup_fds: Sequence[int] = (),
    **popen_kwargs: Any,
) -> subprocess.Popen[Any]:
    """Start `argv` in a sandbox for `policy`; returns the outer bwrap's Popen.

    `rlimits`: resource names ("data", "nofile", ...) -> limit, set on bwrap before it
    starts and so inherited by everything in the sandbox. `cgroup_fds`: open
    cgroup.procs files (cgroups.WorkerCgroup.open_join_fds) that bwrap joins before
    exec, so no process of the sandbox ever runs outside its cgroup.

    Popen.pid is bwrap outside the sandbox; SIGKILL it to kill the sandbox: the sandbox's
    init dies with it (--die-with-parent) once set up, and is killed when this Popen sees
    bwrap's exit if bwrap died before that (see "Orphans"). The caller must poll() or
    wait() it, as for any child.
    `json_status_fd`: bwrap writes {"child-pid": ...} / {"exit-code": ...} there.
    Extra keyword args (stdin/stdout/stderr/text/...) go to Popen.
    """
    bad = _RESERVED_POPEN_KW & popen_kwargs.keys()
    if bad:
        raise TypeError(f"spawn() manages {sorted(bad)} itself")
    unknown = set(rlimits or {}) - _RLIMITS.keys()
    if unknown:
        raise ValueError(f"unknown rlimit(s) {sorted(unknown)}; known: {sorted(_RLIMITS)}")
    spec = prepare(policy, argv, pass_fds, cwd, env_extra, json_status_fd=json_status_fd)
    setup = spec.child_setup(rlimits, cgroup_fds)
    become_subreaper()
    reap_orphans()                        # any left by a bwrap reaped without SandboxPopen
    try:
        return on_stable_thread(
            lambda: SandboxPopen(spec.argv, pass_fds=spec.pass_fds, env=spec.env, close_fds=True,
                                 cwd="/", preexec_fn=setup, **popen_kwargs)
        )
    finally:
        spec.close()  # the child holds its own copy of the seccomp memfd


# --- Orphans: no sandbox outlives its bwrap -----------------------------------------
#
# Why a sandbox could: bwrap clones the sandbox's init (pid 1 of its new pid namespace)
# and that init arms PR_SET_PDEATHSIG (--die-with-parent) only in do_init, after all the
# mounts, the pivot_root and the fork of the worker. A SIGKILL of the outer bwrap in
# that window (the first milliseconds) reparents the init and it runs the worker
# unsupervised; /tmp/h3/orphan_launch.py left 5-8 of 10 so, PPID 1. (prctl after the
# parent is gone arms it against the new parent, which is why it never fires then.)
#
# What closes it, on every cgroup layout: the spawning process (supervisor, broker) is
# a child subreaper, so that init is reparented to *us*, not to pid 1, and a child of
# ours in a pid namespace below our own can only be such an orphan (we never clone into
# a new pid namespace ourselves; bwrap's own child is bwrap's while bwrap lives).
# `SandboxPopen` kills and reaps those when it sees bwrap's exit (poll/wait: the
# supervisor's pidfd wait and the broker's reap both go through it); the kill of a
# namespace's init takes everything in it. As a side effect an init orphaned this way
# arms its PDEATHSIG against us, so it also dies with the supervisor.
#
# Rejected: (1) the cgroup alone: bwrap already joins the worker's cgroup before exec
# (`_child_setup`), so where there is one the cgroup kill covers the window, but a
# machine with limits_not_enforced (no cgroup of ours, e.g. v2 with only memory
# delegated) has nothing. (2) --block-fd/--sync-fd handshakes: bwrap reads --block-fd
# in the init *before* do_init arms PDEATHSIG and proceeds on EOF, so the window stays
# open and a dead holder releases it. (3) Our own pid namespace around bwrap: bwrap's
# CLONE_NEWPID fails with EINVAL after unshare(CLONE_NEWPID).
# Not covered here: the supervisor itself killed in a sandbox's first milliseconds (its
# bwrap dies by PDEATHSIG, the init goes to the next subreaper up or pid 1): the cgroup
# covers that where there is one, and under systemd the unit's own cgroup, whose leftovers
# are killed when its main process ends (KillMode=mixed).

_PR_SET_CHILD_SUBREAPER = 36
_orphan_lock = threading.Lock()


def become_subreaper() -> None:
    """Make this process the reaper of its descendants' orphans (a process attribute,
    not inherited across fork: called at every spawn)."""
    if _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def _ns_depth(status: bytes) -> int:
    """How many pid namespaces deep a process is (NSpid: one pid per level)."""
    for line in status.splitlines():
        if line.startswith(b"NSpid:"):
            return len(line.split()) - 1
    return 1


def _own_children() -> set[int]:
    """Host pids of this process's children, all threads' (an orphan is reparented to
    one live thread of ours). Falls back to a /proc walk without CONFIG_PROC_CHILDREN."""
    files = glob.glob("/proc/self/task/*/children")
    if not files:
        me = os.getpid()
        return {p for p in descendant_pids(me) if _parent_of(p) == me}
    kids: set[int] = set()
    for f in files:
        try:
            with open(f, "rb") as fh:
                kids.update(int(x) for x in fh.read().split())
        except OSError:
            continue                      # that thread exited: its children moved on
    return kids


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def reap_orphans(timeout: float = 0.0) -> list[int]:
    """SIGKILL every child of ours that is the init of a pid namespace below our own (a
    sandbox whose bwrap died before its init armed --die-with-parent), reap those that
    are dead, and return their pids. `timeout` > 0: wait up to that long for the killed
    ones to be reaped too (a namespace's init exits once all of its members have).
    Cheap: one read per thread and one per child."""
    with _orphan_lock:                    # only we reap these pids: they cannot be reused
        try:
            with open("/proc/self/status", "rb") as f:
                mine = _ns_depth(f.read())
        except OSError:
            return []
        found: list[int] = []
        me = os.getpid()
        for pid in sorted(_own_children()):
            try:
                with open(f"/proc/{pid}/status", "rb") as f:
                    status = f.read()
            except OSError:
                continue
            ppid = next((int(ln.split()[1]) for ln in status.splitlines()
                         if ln.startswith(b"PPid:")), 0)
            if ppid != me or _ns_depth(status) <= mine:
                continue                  # our own child (bwrap, broker, a tool): not ours to reap
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            found.append(pid)
        deadline = time.monotonic() + timeout
        pending = list(found)
        while pending:
            for pid in list(pending):
                try:
                    got, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    got = pid
                if got == pid:
                    pending.remove(pid)
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(0.002)
        if pending:
            _reap_when_dead(pending)
        return found


# How long the reaper thread waits for a killed init to finish dying (it exits once every
# process of its namespace has: a worker freeing a large address space takes ms to s).
_REAP_WITHIN_S = 30.0


def _reap_when_dead(pids: list[int]) -> None:
    """Reap, on a thread, killed inits that were still dying (called under _orphan_lock).

    The usual case, not a corner: bwrap SIGKILLed (a watchdog, a fail-safe) leaves its
    init to us, already dying of its PDEATHSIG but still waiting for its namespace to
    empty, so one WNOHANG at bwrap's exit misses it and it stayed a zombie child of the
    supervisor until the next sweep (`audit --live` saw its pid as a survivor of the
    stop). A pidfd names the process, not the number, so the thread can never reap a
    newcomer that was given the pid (it is taken while the pid is still ours, unreaped)."""
    fds: dict[int, int] = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except OSError:                   # gone already, or no pidfd (kernel < 5.3):
            continue                      # the next sweep reaps it as before
    if not fds:
        return

    def reap() -> None:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + _REAP_WITHIN_S
        try:
            while fds and time.monotonic() < deadline:
                for fd, _ in poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                    with _orphan_lock:
                        try:
                            os.waitid(os.P_PIDFD, fd, os.WEXITED)
                        except ChildProcessError:      # a sweep reaped it first
                            pass
                    poller.unregister(fd)
                    os.close(fd)
                    del fds[fd]
        finally:
            for fd in fds:
                os.close(fd)

    threading.Thread(target=reap, daemon=True, name="orphan-reaper").start()


class SandboxPopen(subprocess.Popen):
    """bwrap's Popen: once bwrap is seen to have exited (poll/wait), what it left behind
    is killed and reaped (`reap_orphans`) before the caller hears of the exit."""

    # The inits the sweep at bwrap's exit found: left behind, or (the usual case, as we
    # are their subreaper) already dying of their PDEATHSIG.
    orphans_killed: tuple[int, ...] = ()

    _swept = False

    def poll(self) -> int | None:
        code = super().poll()
        if code is not None:
            self._sweep()
        return code

    def wait(self, timeout: float | None = None) -> int:
        code = super().wait(timeout)
        self._sweep()
        return code

    def _sweep(self) -> None:
        if not self._swept:
            self._swept = True
            self.orphans_killed = tuple(reap_orphans())


def run(
    policy: SandboxPolicy,
    argv: list[str],
    pass_fds: Iterable[int] = (),
    cwd: str | None = None,
    env_extra: Mapping[str, str] | None = None,
    *,
    timeout: float | None = None,
    input: bytes | str | None = None,
    text: bool = True,
) -> subprocess.CompletedProcess[Any]:
    """Run to completion, capturing stdout/stderr (kills the sandbox on timeout)."""
    p = spawn(
        policy, argv, pass_fds, cwd, env_extra,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text,
    )
    with p:
        try:
            out, err = p.communicate(input, timeout=timeout)
        except BaseException:
            p.kill()
            p.wait()
            raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def sandbox_main_pid(pids: list[int]) -> int | None:
    """Which of a sandbox's host ``pids`` (descendant_pids of its bwrap) is the worker:
    the one that is pid 2 in the sandbox's pid namespace (bwrap's init is 1 and forks
    the worker first). Not by host pid order: a worker that wraps the host pid counter
    can leave an orphan with a lower host pid than its own (red team), and no one else
    can be pid 2 in there while the worker lives."""
    for p in pids:
        try:
            with open(f"/proc/{p}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"NSpid:"):
                        if line.split()[-1] == b"2" and len(line.split()) > 2:
                            return p
                        break
        except OSError:
            continue
    return None


def descendant_pids(pid: int) -> list[int]:
    """Host pids of all descendants of `pid` (bwrap's init, the worker, ...)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # comm may contain spaces/parens: ppid is the 2nd field after the last ')'.
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


# --- can the sandbox be built at all? (for `supervisor check`) ----------------------

# What the rehearsal runs inside: the interpreter, its site, and the project's
# protocol module (PYTHONPATH, staging of a 0700 home, hidden distributions).
_REHEARSAL = ("-c", "import supervisor.protocol")


@dataclass(frozen=True)
class SandboxCheck:
    """Whether one worker's sandbox could be built and its interpreter started."""

    worker: str
    ok: bool
    # One line: bwrap's own message ("bwrap: Can't mkdir parents for ...") or the
    # interpreter's last line, plus what to do where the machine probe knows it.
    error: str = ""
    ms: float = 0.0

    def line(self) -> str:
        return (f"{self.worker}: sandbox ok ({self.ms:.0f} ms)" if self.ok
                else f"{self.worker}: sandbox cannot start: {self.error}")


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def rehearse(policy: SandboxPolicy, worker: str = "", *, timeout_s: float = 30.0) -> SandboxCheck:
    """Build `policy`'s sandbox exactly as spawn() does (staging namespace, host uid,
    launch seccomp filter, every bind, whiteout and compiler mask) and start the
    interpreter in it, importing the project. What makes this fail makes `run` fail the
    same way for every worker of that policy, so `supervisor check` should call it (or
    `rehearse_config`) and fail with the returned line. Not covered: what the worker's own
    code does, cgroups and limits (those need `check --start`)."""
    name = worker or policy.domain
    t0 = time.monotonic()
    try:
        r = run(policy, [sys.executable, *_REHEARSAL], timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return SandboxCheck(name, False, f"interpreter did not start within {timeout_s:.0f} s")
    except (OSError, LookupError, ValueError, RuntimeError) as e:
        # bwrap missing, staging refused, no such host user, libseccomp missing...
        return SandboxCheck(name, False, f"{type(e).__name__}: {e}")
    ms = (time.monotonic() - t0) * 1000
    if r.returncode == 0:
        return SandboxCheck(name, True, ms=ms)
    from .probe import explain_bwrap_error

    err = _last_line(r.stderr) or f"exit status {r.returncode}, no output"
    return SandboxCheck(name, False, explain_bwrap_error(err), ms)


def _build_key(p: SandboxPolicy) -> tuple:
    """What decides whether a sandbox can be built (not its environment)."""
    return (p.rules, p.network, p.hide_compilers, p.host_uid, p.host_gid, p.seccomp_at_launch,
            tuple(p.ro_binds), tuple(p.rw_binds), tuple(p.dev_binds), tuple(p.hidden))


def rehearse_config(config: "Config", *, timeout_s: float = 30.0) -> list[SandboxCheck]:
    """`rehearse` for every worker of `config` (research included), one start per
    distinct sandbox layout. A worker whose policy cannot even be made (a domain user
    missing) is a failed check, not an exception."""
    done: dict[tuple, SandboxCheck] = {}
    out: list[SandboxCheck] = []
    for name, w in config.workers.items():
        try:
            pol = for_worker(config, w)
        except (LookupError, ValueError) as e:
            out.append(SandboxCheck(name, False, str(e)))
            continue
        key = _build_key(pol)
        if key not in done:
            done[key] = rehearse(pol, name, timeout_s=timeout_s)
        c = done[key]
        out.append(SandboxCheck(name, c.ok, c.error, c.ms))
    return out
