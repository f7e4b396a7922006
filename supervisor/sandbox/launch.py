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
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, TypeVar

from . import seccomp
from .bwrap import build_bwrap_argv
from .policy import SandboxPolicy

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

    def close(self) -> None:
        while self.owned_fds:
            os.close(self.owned_fds.pop())


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
    if policy.seccomp_at_launch:
        sfd = seccomp.launch_filter_fd(policy.domain, network=policy.network)
        owned.append(sfd)
        fds.append(sfd)
    try:
        full = build_bwrap_argv(
            policy, argv, fds, cwd, env_extra=env_extra, seccomp_fd=sfd, json_status_fd=json_status_fd
        )
    except BaseException:
        for fd in owned:
            os.close(fd)
        raise
    return LaunchSpec(argv=full, pass_fds=tuple(fds), owned_fds=owned)


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


def spawn(
    policy: SandboxPolicy,
    argv: list[str],
    pass_fds: Iterable[int] = (),
    cwd: str | None = None,
    env_extra: Mapping[str, str] | None = None,
    *,
    json_status_fd: int | None = None,
    rlimits: Mapping[str, int] | None = None,
    **popen_kwargs: Any,
) -> subprocess.Popen[Any]:
    """Start `argv` in a sandbox for `policy`; returns the outer bwrap's Popen.

    `rlimits`: prlimit(1) resource names -> limit (e.g. {"nofile": 256, "data": 1<<30}),
    set on bwrap before it starts (prlimit execs it, same pid) and so inherited by
    everything in the sandbox.

    Popen.pid is bwrap outside the sandbox; kill it to kill the sandbox.
    `json_status_fd`: bwrap writes {"child-pid": ...} / {"exit-code": ...} there.
    Extra keyword args (stdin/stdout/stderr/text/...) go to Popen.
    """
    bad = _RESERVED_POPEN_KW & popen_kwargs.keys()
    if bad:
        raise TypeError(f"spawn() manages {sorted(bad)} itself")
    spec = prepare(policy, argv, pass_fds, cwd, env_extra, json_status_fd=json_status_fd)
    full = spec.argv
    if rlimits:
        prlimit = shutil.which("prlimit", path=spec.env.get("PATH")) or "/usr/bin/prlimit"
        full = [prlimit, *(f"--{k}={v}:{v}" for k, v in sorted(rlimits.items())), "--", *full]
    try:
        return on_stable_thread(
            lambda: subprocess.Popen(full, pass_fds=spec.pass_fds, env=spec.env, close_fds=True, **popen_kwargs)
        )
    finally:
        spec.close()  # the child holds its own copy of the seccomp memfd


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
