"""Entry point inside every sandbox: ``python -m supervisor.runner <module> [args...]``.

For control-domain workers the import guard goes in first, before the worker's own
imports, so a torch import anywhere in the worker raises a clear ImportError.
"""
from __future__ import annotations

import importlib
import os
import sys


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m supervisor.runner <module> [args...]", file=sys.stderr)
        return 2
    from supervisor.worker import ENV_DOMAIN, ENV_NAME, ENV_NETWORK

    name = os.environ.get(ENV_NAME, argv[0])
    domain = os.environ.get(ENV_DOMAIN, "control")
    if domain != "research":
        from supervisor.admission import guard
        from supervisor.sandbox.seccomp import lock_down

        guard.install(name)
        # No exec from here on, not even during the worker's own start-up: nothing it
        # imports can start a process that escapes the guard or the seccomp filter.
        lock_down(domain, network=os.environ.get(ENV_NETWORK) == "1")
    module = importlib.import_module(argv[0])
    from supervisor.worker import WorkerContext

    sys.argv = [argv[0], *argv[1:]]
    ctx = WorkerContext.from_env()
    return int(module.main(ctx) or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
