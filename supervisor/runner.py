"""Entry point inside every sandbox: ``python -m supervisor.runner <module> [args...]``.

Trusted start-up, before any of the worker's own code is imported:
* control-grade domains: the import guard, the exec ban (seccomp), and the exec watch:
  a seccomp filter that asks the supervisor about every executable mapping, whose
  listener goes to the supervisor before the worker can touch it;
* every sandbox: Landlock, so nothing but the private /tmp (and /dev/null) can be
  opened for writing, and no signal or abstract socket reaches outside the sandbox.
The worker's exit status is kept within 0..127: bwrap reports a death by signal N as
128+N, and the supervisor must be able to tell the two apart.
"""
from __future__ import annotations

import importlib
import os
import socket
import sys


def _secure_start(name: str) -> None:
    from supervisor.protocol import (ENV_EXECWATCH_FD, ENV_NETWORK, ENV_SANDBOXED,
                                     ENV_WRITABLE, Isolation)

    iso = Isolation.from_env(os.environ)   # the domain's knobs (fail closed: control's)
    if os.environ.get(ENV_SANDBOXED) == "1":
        # First, while this is the only thread: Landlock binds the calling thread and
        # the threads it creates later (numpy's BLAS pool starts at import).
        from supervisor.sandbox import landlock

        extra = [p for p in os.environ.get(ENV_WRITABLE, "").split(":") if p]
        landlock.restrict(("/tmp", "/dev", *extra))
    if iso.refuse_torch:
        from supervisor.admission import guard

        guard.install(name)
    # The exec watch's listener goes to the supervisor before the lock-down: a strict
    # domain's runtime filter kills sendmsg, the one way a descriptor leaves (seccomp.
    # FD_SEND_DENY). No worker code has run yet either way.
    sock_fd = os.environ.pop(ENV_EXECWATCH_FD, None)
    if not iso.exec_memory_after_ready and sock_fd is not None:
        from supervisor.sandbox.seccomp import install_exec_watch

        sock = socket.socket(fileno=int(sock_fd))
        listener = install_exec_watch()
        try:
            socket.send_fds(sock, [b"L"], [listener])
        finally:
            os.close(listener)   # only the supervisor may answer for this process
            sock.close()
    if not iso.exec_after_start:
        from supervisor.sandbox.seccomp import lock_down

        # No exec from here on, not even during the worker's own start-up: nothing it
        # imports can start a process that escapes the guard or the seccomp filter.
        lock_down(iso.seccomp, network=os.environ.get(ENV_NETWORK) == "1")


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m supervisor.runner <module> [args...]", file=sys.stderr)
        return 2
    from supervisor.protocol import ENV_NAME

    _secure_start(os.environ.get(ENV_NAME, argv[0]))
    module = importlib.import_module(argv[0])
    from supervisor.worker import WorkerContext

    sys.argv = [argv[0], *argv[1:]]
    ctx = WorkerContext.from_env()
    try:
        rc = module.main(ctx)
    except SystemExit as e:
        rc = e.code
    if rc is None:
        return 0
    if not isinstance(rc, int):
        print(rc, file=sys.stderr)
        return 1
    return rc if 0 <= rc <= 127 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
