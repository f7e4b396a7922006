"""Launch workers under bubblewrap + seccomp.

Cheap to import (stdlib only): pyseccomp is loaded lazily by `seccomp`, so
the in-sandbox probe and the supervisor import this without it.
"""

from .bwrap import build_bwrap_argv, bwrap_path, bwrap_supports, compiler_masks
from .launch import (LaunchSpec, descendant_pids, on_stable_thread, prepare, run,
                     sandbox_main_pid, spawn)
from .policy import CONTROL, RESEARCH, SandboxPolicy, policy_for_domain
from .seccomp import SeccompUnavailableError, lock_down

__all__ = [
    "CONTROL",
    "RESEARCH",
    "LaunchSpec",
    "SandboxPolicy",
    "SeccompUnavailableError",
    "build_bwrap_argv",
    "bwrap_path",
    "bwrap_supports",
    "compiler_masks",
    "descendant_pids", "sandbox_main_pid",
    "lock_down",
    "on_stable_thread",
    "policy_for_domain",
    "prepare",
    "run",
    "spawn",
]
