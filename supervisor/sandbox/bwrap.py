"""Turn a SandboxPolicy into a bubblewrap command line.

Design notes:
* New user/pid/ipc/uts/cgroup (and, unless allowed, net) namespaces; the
  root is an empty tmpfs into which only the policy's paths are bound
  read-only, so anything not listed (home dirs, /work, host /tmp, /etc/shadow,
  other workers' files) simply does not exist inside.
* No --as-pid-1: bwrap's tiny init stays pid 1 and reaps zombies; the worker
  is pid 2 and gets normal signal semantics (pid 1 ignores unhandled signals).
  Killing the outer bwrap (Popen.pid) takes the whole sandbox down through
  --die-with-parent once bwrap's init has armed it (after the mounts; before that
  launch.SandboxPopen's orphan sweep does it, see launch "Orphans"); there is no
  signal forwarding, so graceful shutdown must go through the worker's IPC channel.
* bwrap itself sets PR_SET_NO_NEW_PRIVS in the sandbox (tests assert it).
* Inherited fds keep their numbers: bwrap does not close them.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import os
import re
import shutil
import subprocess
from typing import Callable, Iterable, Mapping, Sequence

from .policy import SandboxPolicy, minimize

# Never in a sandbox's environment: dynamic-loader hooks (load code into
# every process, bwrap included).
_LOADER_ENV = re.compile(r"^(LD_.*|GCONV_PATH)$")
# Not overridable by env_extra either: interpreter knobs that would make the
# environment run code or pick other modules (the policy sets its own).
_FORBIDDEN_ENV = re.compile(
    r"^(LD_.*|GCONV_PATH|PYTHONHOME|PYTHONPATH|PYTHONSTARTUP|PYTHONUSERBASE|"
    r"PYTHONNOUSERSITE|PYTHONSAFEPATH|PYTHONINSPECT|PYTHONBREAKPOINT|"
    r"PYTHONEXECUTABLE|PYTHONPLATLIBDIR)$"
)
_HOSTNAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")

# Executable names of compilers, assemblers, linkers and JIT drivers, with or
# without a target triplet prefix (x86_64-linux-gnu-gcc) or version suffix
# (gcc-12, clang-15). Matched against bin directories inside the bound tree.
_TOOL_NAMES = (
    "cc", "c++", "c89", "c99", "c89-gcc", "c99-gcc", "gcc", "g++", "cpp", "gfortran",
    "gcc-ar", "gcc-nm", "gcc-ranlib",
    "gccgo", "as", "ld", "ld.bfd", "ld.gold", "ld.lld", "ld.mold", "gold", "lld",
    "mold", "clang", "clang++", "clang-cpp", "tcc", "llc", "lli", "cicc",
    "nvcc", "ptxas", "nvlink", "fatbinary", "cudafe++", "bin2c", "zig", "rustc",
    "go", "ccache", "sccache", "distcc",
)
_TOOL_GLOBS = tuple(
    g
    for n in _TOOL_NAMES
    for g in (n, f"{n}-[0-9]*", f"*-linux-gnu*-{n}", f"*-linux-gnu*-{n}-[0-9]*")
) + ("clang-*", "clang++-*", "lld-*", "cc1*", "collect2", "lto1", "lto-wrapper")
_TOOL_RE = re.compile("|".join(fnmatch.translate(g) for g in _TOOL_GLOBS))

# Whole directories that only hold toolchain internals (cc1, collect2, crt*.o,
# cross binutils, LLVM/CUDA drivers): covered by an empty tmpfs.
_TOOL_DIR_GLOBS = (
    "/usr/lib/gcc", "/usr/libexec/gcc", "/usr/lib/gcc-cross", "/usr/lib/llvm-*/bin",
    "/usr/*-linux-gnu*/bin", "/usr/local/cuda*/bin", "/usr/local/cuda*/nvvm/bin",
    "/usr/lib/nvidia-cuda-toolkit/bin",
)
# Same, relative to each bound site-packages (pip-shipped toolchains).
_SITE_TOOL_DIR_GLOBS = (
    "triton/backends/*/bin", "nvidia/cuda_nvcc/bin", "nvidia/cuda_nvcc/nvvm/bin",
    "ziglang",
)


# Machine-wide activity a sandbox could read off its own /proc (counts of threads,
# forks, interrupts, memory, pressure stalls, open files): another domain's starts,
# stops and load, timed. Covered by /dev/null (files) or an empty read-only tmpfs.
PROC_MACHINE_FILES = (
    "/proc/loadavg", "/proc/stat", "/proc/vmstat", "/proc/meminfo", "/proc/schedstat",
    "/proc/interrupts", "/proc/softirqs", "/proc/diskstats", "/proc/locks",
    "/proc/sys/fs/file-nr", "/proc/sys/fs/inode-nr", "/proc/sys/kernel/random/entropy_avail",
)
PROC_MACHINE_DIRS = ("/proc/pressure",)


def bwrap_path() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise FileNotFoundError("bubblewrap (bwrap) not found; apt-get install bubblewrap")
    return path


@functools.lru_cache(maxsize=None)
def _bwrap_help() -> str:
    res = subprocess.run([bwrap_path(), "--help"], capture_output=True, text=True, timeout=10)
    return res.stdout + res.stderr


def bwrap_supports(option: str) -> bool:
    """True if the installed bwrap knows `option` (e.g. --disable-userns, 0.8+)."""
    return re.search(rf"(^|\s){re.escape(option)}\b", _bwrap_help()) is not None


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _visible(path: str, roots: Sequence[str]) -> bool:
    return any(_under(path, r) for r in roots)


@functools.lru_cache(maxsize=16)
def compiler_masks(ro_binds: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(files, dirs) inside the bound tree to hide from a strict domain.

    Files are real paths (symlinks resolved: masking the target hides every
    alias such as gcc -> gcc-12 -> x86_64-linux-gnu-gcc-12). Shared libraries
    and the dynamic loader are never touched.
    """
    real_roots = [os.path.realpath(r) for r in ro_binds if os.path.isdir(r)]

    dirs: set[str] = set()
    for g in _TOOL_DIR_GLOBS:
        for d in glob.glob(g):
            dirs.add(os.path.realpath(d))
    for r in real_roots:
        if os.path.basename(r) in ("site-packages", "dist-packages"):
            sites = [r]
        else:
            sites = glob.glob(os.path.join(r, "lib", "python3*", "site-packages"))
        for sp in sites:
            for g in _SITE_TOOL_DIR_GLOBS:
                dirs.update(os.path.realpath(d) for d in glob.glob(os.path.join(sp, g)))
    dirs = {d for d in dirs if os.path.isdir(d) and _visible(d, real_roots)}

    bin_dirs: set[str] = set()
    for r in real_roots:
        for sub in ("bin", "sbin", "local/bin", "local/sbin"):
            b = os.path.join(r, sub)
            if os.path.isdir(b):
                bin_dirs.add(b)
    files: set[str] = set()
    for b in sorted(bin_dirs):
        try:
            names = os.listdir(b)
        except OSError:
            continue
        for n in names:
            if not _TOOL_RE.match(n):
                continue
            real = os.path.realpath(os.path.join(b, n))
            base = os.path.basename(real)
            if (
                ".so" in base  # ld.so and friends: never mask a library
                or not os.path.isfile(real)
                or not _visible(real, real_roots)
                or any(_under(real, d) for d in dirs)
            ):
                continue
            files.add(real)
    return tuple(sorted(files)), tuple(sorted(dirs))


def masks_to_mount(policy: SandboxPolicy) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The compiler masks (files, dirs) that still need a mount once the refused
    distributions are hidden.

    A mask at or below a hidden entry is skipped: there is nothing left to mask, and
    bwrap would have to create its mount point's parents in a directory that no longer
    exists, on a read-only mount (GPU machine: triton ships its own ptxas in
    triton/backends/nvidia/bin, and triton is hidden: "Can't mkdir parents ... Read-only
    file system", every control sandbox dead at start). A directory mask below another
    one is skipped too: the outer tmpfs is read-only by then and hides it anyway.
    Compared on both spellings, as given and resolved (masks are real paths).
    """
    files, dirs = compiler_masks(tuple(policy.ro_binds))
    gone = {*policy.hidden, *(os.path.realpath(h) for h in policy.hidden)}
    kept_dirs = tuple(d for d in minimize(dirs) if not _visible(d, tuple(gone)))
    kept_files = tuple(f for f in files
                       if not _visible(f, tuple(gone)) and not _visible(f, kept_dirs))
    return kept_files, kept_dirs


def check_env(env: Mapping[str, str], forbidden: re.Pattern[str] = _FORBIDDEN_ENV) -> None:
    for k, v in env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise ValueError(f"invalid environment entry {k!r}")
        if forbidden.match(k):
            raise ValueError(f"environment variable {k} may not be passed into a sandbox")


def _same(p: str) -> str:
    return p


def _fs_args(policy: SandboxPolicy, source: Callable[[str], str] = _same) -> list[str]:
    roots = [p for p in policy.ro_binds if not os.path.islink(p)]
    real_roots = [os.path.realpath(p) for p in roots]
    args: list[str] = []
    links: list[str] = []
    for p in policy.ro_binds:
        if os.path.islink(p) and _visible(os.path.realpath(p), real_roots):
            # Merged-/usr (/bin -> usr/bin) and /etc/localtime: keep the
            # symlink so paths inside match the host's.
            links += ["--symlink", os.readlink(p), p]
        else:
            args += ["--ro-bind", source(p), p]
    for p in policy.rw_binds:
        args += ["--bind", source(p), p]
    return args + links


def _hide_args(hidden: Sequence[str], source: Callable[[str], str] = _same,
               views: Mapping[str, str] | None = None) -> list[str]:
    """Make hidden entries absent: bind the directory's filtered view (staging's
    overlay) over it, or else rebuild the directory from its other entries.

    A masked directory would still import as an empty namespace package; an absent
    one gives "No module named 'torch'" and ENOENT for every file below it.
    """
    by_dir: dict[str, set[str]] = {}
    # Only the outermost: an entry below another hidden one is gone with it, and its
    # directory cannot be rebuilt where nothing exists.
    for h in minimize(hidden):
        by_dir.setdefault(os.path.dirname(h), set()).add(os.path.basename(h))
    a: list[str] = []
    # Parents before children: a directory rebuilt later would cover an earlier view.
    for d, names in sorted(by_dir.items(), key=lambda kv: (kv[0].count("/"), kv[0])):
        if views and d in views:
            a += ["--ro-bind", views[d], d]
            continue
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        a += ["--tmpfs", d]
        for e in entries:
            if e.name in names:
                continue
            if e.is_symlink():
                a += ["--symlink", os.readlink(e.path), e.path]
            else:
                a += ["--ro-bind", source(e.path), e.path]
        a += ["--remount-ro", d]
    return a


def build_bwrap_argv(
    policy: SandboxPolicy,
    argv: list[str],
    pass_fds: Iterable[int] = (),
    cwd: str | None = None,
    *,
    env_extra: Mapping[str, str] | None = None,
    seccomp_fd: int | None = None,
    json_status_fd: int | None = None,
    source: Callable[[str], str] = _same,
    views: Mapping[str, str] | None = None,
) -> list[str]:
    """Full command line: bwrap options, then `--`, then the worker argv.

    `pass_fds` are the fds the caller will pass to Popen; they are only
    validated here (bwrap keeps inherited fds at the same numbers).
    `seccomp_fd`/`json_status_fd` must be in the caller's pass_fds too.
    `source` maps a host path to where bwrap finds it (staging.Staging.source_for);
    `views` maps a directory with hidden entries to its filtered view (Staging.views).
    """
    if not argv:
        raise ValueError("empty argv")
    fds = set(pass_fds)
    if any((not isinstance(fd, int)) or fd < 3 for fd in fds):
        raise ValueError(f"pass_fds must be ints >= 3, got {sorted(fds)!r}")
    for name, fd in (("seccomp_fd", seccomp_fd), ("json_status_fd", json_status_fd)):
        if fd is not None and fd not in fds:
            raise ValueError(f"{name}={fd} must also be listed in pass_fds")
    if not _HOSTNAME_RE.match(policy.hostname or policy.domain):
        raise ValueError(f"domain/hostname {policy.hostname or policy.domain!r} is not a valid hostname")

    env = dict(policy.env)
    if env_extra:
        check_env(env_extra)
        env.update(env_extra)
    check_env(env, _LOADER_ENV)  # also catches a hand-edited policy.env

    a: list[str] = [bwrap_path()]
    a += ["--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not policy.network:
        a.append("--unshare-net")
    if bwrap_supports("--disable-userns"):
        a.append("--disable-userns")  # no nested user namespaces (bwrap >= 0.8)
    a += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    a += ["--uid", str(policy.uid), "--gid", str(policy.gid)]
    a += ["--hostname", policy.hostname or policy.domain]
    a.append("--clearenv")
    for k, v in env.items():
        a += ["--setenv", k, v]

    # Fresh /proc, /dev, /tmp first, so binds that live below them (a venv in
    # /tmp, a device node) are mounted on top instead of being shadowed.
    # /proc read-only as a whole: no sysctl, sysrq-trigger, /proc/self/mem (writes to
    # it patch executable pages without mprotect) or oom_score_adj writes, whatever
    # the uid. /dev is made read-only below, after device binds: no /dev/shm to fill.
    a += ["--proc", "/proc", "--remount-ro", "/proc"]
    # The machine's counters are not the pid namespace's: /proc/loadavg's thread count
    # and /proc/stat's fork count moved with every control sandbox start and end, and
    # research timed them within ~2 ms (red team 14 row 3). Empty in every sandbox;
    # nothing we run reads them (cpu_count is sched_getaffinity's here: no /sys).
    for f in PROC_MACHINE_FILES:
        if os.path.isfile(f):
            a += ["--ro-bind", "/dev/null", f]
    for d in PROC_MACHINE_DIRS:
        if os.path.isdir(d):
            a += ["--tmpfs", d, "--remount-ro", d]
    a += ["--dev", "/dev"]
    if policy.tmp_size_bytes and bwrap_supports("--size"):
        a += ["--size", str(policy.tmp_size_bytes)]
    a += ["--tmpfs", "/tmp"]
    # Read-only binds that live under /tmp (a checkout or venv there) get their parent
    # directory as a tmpfs made read-only after the binds: otherwise the parent is a
    # writable directory of the private /tmp standing where the project root should be.
    parents = sorted({os.path.dirname(p) for p in policy.ro_binds
                      if _under(p, "/tmp") and os.path.dirname(p) != "/tmp"},
                     key=lambda d: d.count("/"))
    for d in parents:
        a += ["--tmpfs", d]
    a += _fs_args(policy, source)
    for d in reversed(parents):
        a += ["--remount-ro", d]
    a += _hide_args(policy.hidden, source, views)
    for d in policy.dev_binds:
        a += ["--dev-bind", source(d), d]
    # POSIX semaphores (multiprocessing.SemLock, used by tinygrad's CPU runtime) need
    # /dev/shm: a small private tmpfs; everything else of /dev is read-only.
    if bwrap_supports("--size"):
        a += ["--size", str(16 << 20)]
    a += ["--tmpfs", "/dev/shm", "--remount-ro", "/dev"]

    if policy.hide_compilers:
        files, dirs = masks_to_mount(policy)
        for d in dirs:
            a += ["--tmpfs", d, "--remount-ro", d]  # empty and unwritable
        for f in files:
            # A char device cannot be executed: execve -> EACCES, also via sh.
            a += ["--ro-bind", "/dev/null", f]

    # The root is bwrap's scratch tmpfs (mount points for the binds): make it
    # read-only too, leaving /tmp (+ rw_binds, /dev) the only writable places.
    a += ["--remount-ro", "/"]

    if seccomp_fd is not None:
        a += ["--seccomp", str(seccomp_fd)]
    if json_status_fd is not None:
        a += ["--json-status-fd", str(json_status_fd)]
    a += ["--chdir", cwd or "/tmp", "--", *argv]
    return a
