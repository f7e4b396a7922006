"""What a worker's sandbox may see and do, derived from its domain.

The policy is plain data so the supervisor can log/audit it; `bwrap.py`
turns it into a command line and `seccomp.py` into syscall filters.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import math
import os
import pwd
import re
import site
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from supervisor.config import Config, WorkerConfig

CONTROL = "control"
RESEARCH = "research"

# Project root = the directory holding the `supervisor` package.
PROJECT_ROOT = str(Path(__file__).resolve().parents[2])

# Host directories that make up the base OS view. On merged-/usr systems the
# top-level ones are symlinks; bwrap.py recreates those as symlinks.
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")

# Only the /etc files a Python worker actually touches: the loader cache,
# name-service files (getpwuid, 'localhost') and the time zone.
_ETC_BASE = (
    "/etc/ld.so.cache",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/hosts",
    "/etc/localtime",
)
# Name resolution / TLS, only for a domain that actually has a network.
_ETC_NETWORK = (
    "/etc/resolv.conf",
    "/etc/host.conf",
    "/etc/gai.conf",
    "/etc/ssl",
    "/etc/ca-certificates",
)
# The GPU's device nodes a worker with device = "cuda" gets (those that exist), the
# same for control and research: the CUDA driver needs these three to run a kernel
# (the control node, the GPU, unified memory). Never nvidia-modeset, nvidia-caps or
# another GPU's node.
CUDA_DEVICE_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm")
DEVICES = ("cpu", "cuda")

# Device-code compilers as shared libraries (bwrap.py masks the executables: nvcc,
# ptxas, cicc): NVRTC, nvJitLink, the PTX compiler library, and the driver's own PTX
# JIT. A control worker loads cubin through the driver alone; none of these may be
# openable there. Searched in the bound tree's library directories, the CUDA toolkit's
# and pip's nvidia/* wheels' (a wheel with dist-info is hidden whole as a refused
# distribution; these catch one copied in without it).
CUDA_COMPILER_LIBS = ("libnvrtc.so*", "libnvrtc-builtins*.so*", "libnvrtc.alt.so*",
                      "libnvJitLink.so*", "libnvptxcompiler*", "libnvidia-ptxjitcompiler.so*")
_CUDA_LIB_DIRS = ("lib", "lib64", "lib/*-linux-gnu", "lib64/*-linux-gnu",
                  "local/lib", "local/cuda*/lib64", "local/cuda*/targets/*/lib",
                  "local/cuda*/nvvm/lib64", "lib/nvidia-cuda-toolkit/lib64")
_SITE_CUDA_LIB_DIRS = ("nvidia/*/lib", "nvidia/cu*/lib")

# Debian routes cc/c++ etc. through /etc/alternatives: research may compile
# (e.g. torch.compile); control never gets it, so those links dangle there.
_ETC_RESEARCH = ("/etc/alternatives",)


@dataclass
class SandboxPolicy:
    domain: str
    # The domain's profile ("control" or "research"): what rules apply. Anything but
    # research is control-grade (fail closed). Empty: the domain's name is its profile.
    profile: str = ""
    network: bool = False
    hide_compilers: bool = True
    # Worker calls seccomp.lock_down() once its imports are done (adds the
    # execve ban on top of the launch filter).
    seccomp_after_start: bool = True
    # Filter installed by bwrap before the worker's first instruction
    # (everything except the execve ban, which start-up still needs).
    seccomp_at_launch: bool = True
    ro_binds: list[str] = field(default_factory=list)
    rw_binds: list[str] = field(default_factory=list)
    # Device nodes (e.g. /dev/nvidia0) bound with device access; opt-in only.
    dev_binds: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    python_path: list[str] = field(default_factory=list)
    hostname: str = ""
    # Fixed non-root id inside the user namespace, same for root and users.
    uid: int = 1000
    gid: int = 1000
    # The host uid/gid the sandbox runs as (bwrap is started with them): a stranger to
    # every file and process of the host. None: the caller's own (only when it is not
    # root; a root caller always switches, see host_ids()).
    host_uid: int | None = None
    host_gid: int | None = None
    # Paths below ro_binds that must not exist inside (refused distributions and
    # device-code compiler libraries in a strict domain): whited out (staging) or their
    # directory rebuilt from every other entry.
    hidden: list[str] = field(default_factory=list)
    # "cuda": dev_binds holds the GPU nodes of CUDA_DEVICE_NODES that exist here.
    device: str = "cpu"
    # Private /tmp is RAM; cap it so a worker cannot eat the host's memory.
    tmp_size_bytes: int | None = 64 * 1024 * 1024

    @property
    def rules(self) -> str:
        return self.profile or self.domain

    @property
    def strict(self) -> bool:
        """Control-grade rules: anything that is not explicitly research."""
        return self.rules != RESEARCH


def project_python_path() -> list[str]:
    """The workers' PYTHONPATH: the project root, unless it is installed inside
    site-packages already."""
    return [] if any(_under(PROJECT_ROOT, p) for p in python_dirs()) else [PROJECT_ROOT]


def worker_sys_path(sandboxed: bool = True, python_path: Iterable[str] = ()) -> list[str]:
    """Where a worker's imports are looked up, for admission and the config check to
    find the same files. Sandboxed: this interpreter's sys.path as it starts under the
    sandbox's environment (`base_env`: the project root and the domain's `python_path`
    on PYTHONPATH, no user site, no cwd),
    asked of the interpreter itself, so the operator's PYTHONPATH and ~/.local, which the
    sandbox clears, never point the walk at a file the worker will not import.
    Unsandboxed, a worker inherits this process's environment: its path, less the cwd.
    An editable install finds `workers` through a meta-path hook, not a directory, which
    is why the project root is on the workers' PYTHONPATH: without it, from outside the
    checkout, the walk found no entry module and admitted a control worker unwalked."""
    if sandboxed:
        key = tuple(python_path)
        if key not in _SANDBOX_PATHS:
            path = _sandbox_sys_path(key)
            if path is None:         # not cached: the next admission asks again
                raise OSError(f"cannot learn a sandboxed worker's sys.path from "
                              f"{sys.executable}: admission cannot tell what it imports")
            _SANDBOX_PATHS[key] = path
        return list(_SANDBOX_PATHS[key])
    own = list(sys.path)
    if own and (own[0] in ("", ".") or os.path.abspath(own[0]) == os.getcwd()):
        own = own[1:]                   # `python -m`/`-c` put the cwd first
    return list(dict.fromkeys([*project_python_path(), *(p for p in own if p)]))


_SANDBOX_PATHS: dict[tuple[str, ...], tuple[str, ...]] = {}


def _sandbox_sys_path(python_path: tuple[str, ...]) -> tuple[str, ...] | None:
    import json
    import subprocess

    # site.main() without its start-up hooks (-S, then the same steps by hand): the
    # probe runs as root outside any sandbox, and a sitecustomize in a python_path
    # would be code of the config's choosing run right here (review).
    probe = ("import json, site, sys\n"
             "known = site.removeduppaths()\n"
             "site.abs_paths()\n"
             "site.addsitepackages(site.venv(known))\n"
             "print(json.dumps(sys.path))\n")
    try:
        out = subprocess.run([sys.executable, "-S", "-c", probe], env=base_env(python_path),
                             cwd="/",
                             capture_output=True, text=True, timeout=30, check=True).stdout
        path = [p for p in json.loads(out) if isinstance(p, str) and p]
    except (OSError, subprocess.SubprocessError, ValueError):
        # No guess: this process's path holds the operator's PYTHONPATH in another
        # order, the very files admission must not walk instead (review).
        return None
    return tuple(dict.fromkeys(path))


def base_env(python_path: Iterable[str] = ()) -> dict[str, str]:
    """The environment every sandboxed worker starts with (bwrap --clearenv, then this),
    before its domain's thread counts: the one home for it, shared by the launch and by
    admission's `worker_sys_path`."""
    env = {
        "PATH": ":".join(
            dict.fromkeys([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"])
        ),
        "HOME": "/tmp",
        # getpass.getuser() reads these first; without them glibc's getpwuid tries
        # nscd's socket, and connect() kills a control worker.
        "USER": "worker",
        "LOGNAME": "worker",
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",  # tree is read-only anyway; avoid EROFS noise
        "PYTHONNOUSERSITE": "1",
        "PYTHONSAFEPATH": "1",  # don't put cwd/script dir first on sys.path
    }
    pp = ":".join(dict.fromkeys([*project_python_path(), *python_path]))
    if pp:
        env["PYTHONPATH"] = pp
    return env


def python_dirs() -> list[str]:
    """Interpreter prefix + site-packages, as the parent sees them."""
    cands: list[str] = [
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
    ]
    try:
        cands += site.getsitepackages()
    except AttributeError:  # some embedded/virtualenv site modules lack it
        pass
    out: list[str] = []
    for p in cands:
        # Bind both spellings if the prefix itself is reached via a symlink.
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if os.path.isdir(q):
                out.append(q)
    return out


# Packages that exist in the checkout but are not worker code.
_NOT_SHIPPED = frozenset({"tests", "test", "bench", "benchmarks", "docs", "build", "dist"})


def project_packages(root: str = PROJECT_ROOT) -> list[str]:
    """Top-level packages of the project (supervisor, workers, schemas...).

    Only these are bound, not the whole checkout: .git, tests, benches and
    local config stay invisible to workers.
    """
    return [
        os.path.join(root, n)
        for n in sorted(os.listdir(root))
        if not n.startswith(".")
        and n not in _NOT_SHIPPED
        and os.path.isfile(os.path.join(root, n, "__init__.py"))
    ]


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def minimize(paths: Iterable[str]) -> list[str]:
    """Drop duplicates and paths already covered by another entry."""
    uniq = sorted(set(paths), key=lambda p: (p.count("/"), p))
    kept: list[str] = []
    for p in uniq:
        if not any(_under(p, k) for k in kept):
            kept.append(p)
    return kept


def default_user(domain: str) -> str:
    """The system user `scripts/install.sh` creates for a domain's rules: research, or
    control for every strict domain (fail closed)."""
    return "trio-research" if domain == RESEARCH else "trio-control"


def host_ids(domain: str, user: str | None = None) -> tuple[int | None, int | None]:
    """(uid, gid) on the host for a sandbox of `domain`.

    As root: the named user (default trio-<domain>), never uid 0; a missing user is an
    error, not a silent fallback to root. Not root: None (bwrap runs as the caller,
    which cannot switch).
    """
    if os.geteuid() != 0:
        return None, None
    name = user or default_user(domain)
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        # A wheel has no scripts/install.sh: the command itself.
        raise LookupError(f"no system user {name!r} for domain {domain!r}: create it "
                          f"(useradd --system --no-create-home --shell /usr/sbin/nologin "
                          f"{name}), as scripts/install.sh does")
    if pw.pw_uid == 0 or pw.pw_gid == 0:
        raise LookupError(f"user {name!r} for domain {domain!r} is root; sandboxes never run as root")
    return pw.pw_uid, pw.pw_gid


def refused_paths(ro_binds: Iterable[str]) -> list[str]:
    """Files of refused distributions (torch & co) in every site-packages bound."""
    from supervisor.admission.distributions import refused_entries

    out: list[str] = []
    for r in ro_binds:
        if os.path.basename(r) in ("site-packages", "dist-packages"):
            sites = [r]
        else:
            sites = glob.glob(os.path.join(r, "lib", "python3*", "*-packages"))
        for sp in sites:
            out += [os.path.join(sp, name) for name, _ in refused_entries(sp)]
    return sorted(set(out))


_CUDA_LIB_RE = re.compile("|".join(fnmatch.translate(p) for p in CUDA_COMPILER_LIBS))


def cuda_compiler_paths(ro_binds: Iterable[str]) -> list[str]:
    """Device-code compiler libraries (CUDA_COMPILER_LIBS) visible through ``ro_binds``:
    every spelling found (a symlink and its target are both hidden: a whiteout hides a
    name, not a file). Cached per set of binds, as bwrap.compiler_masks is: a policy is
    built at every worker start, and listing /usr/lib's big directories each time cost
    ~80 ms here."""
    return list(_cuda_compiler_paths(tuple(ro_binds)))


@functools.lru_cache(maxsize=16)
def _cuda_compiler_paths(ro_binds: tuple[str, ...]) -> tuple[str, ...]:
    dirs: set[str] = set()
    for r in ro_binds:
        if not os.path.isdir(r):
            continue
        dirs.add(r)
        for sub in _CUDA_LIB_DIRS:
            dirs.update(glob.glob(os.path.join(r, sub)))
        if os.path.basename(r) in ("site-packages", "dist-packages"):
            sites = [r]
        else:
            sites = glob.glob(os.path.join(r, "lib", "python3*", "*-packages"))
        for sp in sites:
            for sub in _SITE_CUDA_LIB_DIRS:
                dirs.update(glob.glob(os.path.join(sp, sub)))
    out: set[str] = set()
    for d in dirs:
        try:
            names = os.listdir(d)           # one listing per directory, one regex per name
        except OSError:
            continue
        out.update(os.path.join(d, n) for n in names if _CUDA_LIB_RE.match(n))
    return tuple(sorted(out))


def cuda_device_nodes() -> list[str]:
    """The GPU nodes a device = "cuda" worker gets: CUDA_DEVICE_NODES that exist."""
    return [n for n in CUDA_DEVICE_NODES if os.path.exists(n)]


# Thread pools that size themselves from the machine's core count (OpenBLAS, OpenMP,
# MKL, numexpr): set to the worker's CPU share instead.
THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
              "NUMEXPR_NUM_THREADS")


def thread_count(cpu_quota_pct: float | None, strict: bool) -> int | None:
    """Threads for a worker's math libraries: its CPU share, at least 1.

    Why (GPU machine, 16 cores): OpenBLAS starts one thread per core at `import numpy`
    and reserves a buffer per thread; under a 512 MiB memory limit enforced as
    RLIMIT_DATA (no cgroup) the import hung and camerad never printed a line. Threads
    beyond the worker's quota only queue for the same CPU time anyway. A control worker
    without a quota gets 1: its work is one frame pipeline, and a pool of spinning BLAS
    threads is jitter for every other control worker. Research without a quota keeps the
    libraries' own choice (None).
    """
    if cpu_quota_pct:
        return max(1, min(os.cpu_count() or 1, math.ceil(cpu_quota_pct / 100)))
    return 1 if strict else None


def policy_for_domain(
    domain: str,
    network: bool = False,
    extra_ro_binds: Iterable[str] = (),
    *,
    python_path: Iterable[str] = (),
    extra_rw_binds: Iterable[str] = (),
    extra_dev_binds: Iterable[str] = (),
    user: str | None = None,
    profile: str | None = None,
    hide_compilers: bool | None = None,
    refuse_torch: bool | None = None,
    exec_after_start: bool | None = None,
    cpu_quota_pct: float | None = None,
    device: str = "cpu",
) -> SandboxPolicy:
    """Build the policy for `domain` from its isolation fields (see
    `supervisor.config.DomainConfig`); a field left None takes the profile's value.

    Anything other than "research" gets the control rules (fail closed).
    Asking for a network in a strict domain is a configuration error.
    """
    rules = profile or domain
    strict = rules != RESEARCH
    if strict and network:
        raise ValueError(f"domain {domain!r} may never have network access")
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    hide_compilers = strict if hide_compilers is None else hide_compilers or strict
    refuse_torch = strict if refuse_torch is None else refuse_torch or strict
    exec_after_start = (not strict) if exec_after_start is None else exec_after_start and not strict

    etc = list(_ETC_BASE)
    if network:
        etc += _ETC_NETWORK
    if not hide_compilers:
        etc += _ETC_RESEARCH

    py = python_dirs()
    # Importable project code: its packages bound read-only and the root put
    # on PYTHONPATH, unless it is installed inside site-packages already.
    project_path = project_python_path()
    project = project_packages() if project_path else []

    ro = [p for p in (*_SYSTEM_DIRS, *etc) if os.path.lexists(p)]
    ro += minimize([*py, *project,
                    *(os.path.abspath(p) for p in (*extra_ro_binds, *python_path))])
    # Python dirs living under /usr are covered by the /usr bind already.
    ro = [p for p in ro if p in _SYSTEM_DIRS or not _under(p, "/usr")]

    env = base_env(python_path)
    threads = thread_count(cpu_quota_pct, strict)
    if threads is not None:
        env.update(dict.fromkeys(THREAD_ENV, str(threads)))

    host_uid, host_gid = host_ids(rules, user)
    return SandboxPolicy(
        domain=domain,
        profile=rules,
        host_uid=host_uid,
        host_gid=host_gid,
        # Outermost only: a refused tree nested in another one is hidden with it.
        hidden=minimize([*(refused_paths(ro) if refuse_torch else ()),
                         *(cuda_compiler_paths(ro) if hide_compilers else ())]),
        network=bool(network),
        hide_compilers=hide_compilers,
        seccomp_after_start=not exec_after_start,
        seccomp_at_launch=True,
        ro_binds=ro,
        rw_binds=[os.path.abspath(p) for p in extra_rw_binds],
        # the GPU's nodes only for a worker that declares device = "cuda"
        dev_binds=list(dict.fromkeys([os.path.abspath(p) for p in extra_dev_binds]
                                     + (cuda_device_nodes() if device == "cuda" else []))),
        device=device,
        env=env,
        python_path=list(dict.fromkeys([*project_path, *python_path])),
        hostname=domain,
    )


def for_worker(config: "Config", w: "WorkerConfig") -> SandboxPolicy:
    """The sandbox policy of worker `w`: its domain's isolation fields, its model's
    files bound read-only, its math libraries' threads sized to its CPU quota. A pure
    function of the config, for the supervisor, `check` and the audit alike."""
    d = config.domains[w.domain]
    m = config.models.get(w.model or "")
    ro = (*d.extra_ro_binds, *((m.artifact, m.public_key) if m else ()))
    return policy_for_domain(w.domain, network=d.network, extra_ro_binds=ro,
                             python_path=d.python_path,
                             extra_rw_binds=d.extra_rw_binds, user=d.user,
                             profile=d.profile, hide_compilers=d.hide_compilers,
                             refuse_torch=d.refuse_torch,
                             exec_after_start=d.exec_after_start,
                             cpu_quota_pct=w.cpu_quota,
                             device=getattr(w, "device", "cpu"))
