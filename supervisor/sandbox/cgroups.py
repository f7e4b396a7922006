"""Per-worker cgroups: a memory limit that counts shared memory, a pids limit, a CPU quota
and a CPU weight (who waits when workers compete for a core).

Why cgroups and not rlimits: RLIMIT_DATA/RLIMIT_AS see only the address space of one
process. Pages of a memfd or a tmpfs file are charged to the memory cgroup of whoever
faults them in, whichever process maps them and however the fd travels, so only a memory
cgroup can bound a worker that fills shared memory. Likewise pids.max bounds a fork storm
across the whole sandbox (RLIMIT_NPROC counts per uid, and every sandbox of a domain may
share a uid), and a CFS quota bounds CPU time rather than just priority.

Layout (one tree per supervisor run, one leaf per worker run):

  v2: <mount>/<own>/supervisor         this process, moved here if <own> held processes
      <mount>/<own>/<name>/<leaf>      +memory +pids +cpu enabled in <own> and <name>
  v1: <mount>/{memory,pids,cpu}/<own in that hierarchy>/<name>/<leaf>

The child joins its leaf between fork and exec by writing "0" to cgroup.procs fds that the
parent opened (`WorkerCgroup.open_join_fds` / `join`), so no process of a sandbox ever runs
outside its cgroup, and the child needs no path lookups or allocations to do it.

Stdlib only. Linux >= 5.3 (pidfd); v2 `cgroup.kill` is used when present (>= 5.14).
"""

from __future__ import annotations

import errno
import os
import re
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["CGROUP_ROOT", "CgroupTree", "CgroupUnavailable", "Limits", "LimitsOff",
           "WorkerCgroup", "kill_listed", "limits_off"]

CGROUP_ROOT = "/sys/fs/cgroup"
CONTROLLERS = ("memory", "pids", "cpu")
# The worker config's limit keys each controller enforces (what an operator reads).
LIMITS_OF = {"memory": ("memory_max",), "pids": ("pids_max",), "cpu": ("cpu_quota", "cpu_weight")}
CPU_PERIOD_US = 100_000
# v1 prints "no limit" as PAGE_COUNTER_MAX * PAGE_SIZE (9223372036854771712 with 4 KiB
# pages); anything this large is no limit in practice.
_V1_UNLIMITED = 1 << 62
# No dots: a directory named like an interface file ("memory.max") cannot be created,
# and "." / ".." would escape. "supervisor" is where v2 parks this process.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,63}$")
_RESERVED = {"supervisor"}
_KILL_TIMEOUT = 5.0


@dataclass(frozen=True)
class Limits:
    # bytes; counts anon, page cache, shmem/tmpfs/memfd; swap disabled where the kernel lets us
    memory_max: int | None = None
    pids_max: int | None = None        # tasks (threads count)
    cpu_quota_pct: float | None = None  # percent of one CPU (200 = two CPUs)
    # Share of the CPUs under contention against the other workers' runs (all siblings
    # below the tree): v2 cpu.weight 1..10000 (default 100); v1 cpu.shares = weight x
    # 1024 / 100. Unlike the quota it costs nothing when the machine is idle.
    cpu_weight: int | None = None

    def __post_init__(self) -> None:
        # Reject here, not as an EINVAL from a kernel file halfway through a leaf set-up.
        if self.memory_max is not None and (type(self.memory_max) is not int or self.memory_max < 4096):
            raise ValueError(f"memory_max must be >= 4096 bytes, got {self.memory_max!r}")
        if self.pids_max is not None and (type(self.pids_max) is not int or self.pids_max < 1):
            raise ValueError(f"pids_max must be >= 1, got {self.pids_max!r}")
        if self.cpu_quota_pct is not None and not self.cpu_quota_pct >= 1:
            # CFS refuses quotas under 1 ms; at a 100 ms period that is 1 %.
            raise ValueError(f"cpu_quota_pct must be >= 1, got {self.cpu_quota_pct!r}")
        if self.cpu_weight is not None and (type(self.cpu_weight) is not int
                                            or not 1 <= self.cpu_weight <= 10000):
            raise ValueError(f"cpu_weight must be 1..10000, got {self.cpu_weight!r}")

    @property
    def cpu_quota_us(self) -> int | None:
        return None if self.cpu_quota_pct is None else round(self.cpu_quota_pct * CPU_PERIOD_US / 100)


class CgroupUnavailable(RuntimeError):
    """cgroups cannot be used here; str() is a one-line reason for a log or config error."""


@dataclass(frozen=True)
class LimitsOff:
    """What this machine's cgroups cannot enforce, for ONE event per supervisor run (not
    a line per worker): the limits that are off, those still on, and why.

    The rest runs: a worker whose memory_max cannot be enforced still starts. No
    RLIMIT_DATA/RLIMIT_AS stand-in is recommended (see `fallback`): both count address
    space reserved, not memory used (OpenBLAS's per-thread buffers, glibc's 64 MiB
    arenas), so a limit sized to memory hangs or kills a worker that uses little of it
    (GPU machine: `import numpy` with 16 OpenBLAS threads hung under RLIMIT_DATA =
    512 MiB), while shared memory and tmpfs, which a worker can fill, are not counted.
    """

    version: int | None                  # 1, 2, or None when no cgroup could be used
    controllers: tuple[str, ...]         # controllers off: memory, pids, cpu
    reason: str

    @property
    def limits(self) -> tuple[str, ...]:
        return tuple(k for c in self.controllers for k in LIMITS_OF.get(c, ()))

    def event(self, fallback: str = "none") -> dict[str, object]:
        """Fields of the one `limits_not_enforced` event (level warning). `fallback`:
        what the caller puts in the limits' place, if anything (e.g. "RLIMIT_DATA")."""
        on = tuple(k for c in CONTROLLERS if c not in self.controllers for k in LIMITS_OF[c])
        return {"off": list(self.limits), "enforced": list(on),
                "cgroup": f"v{self.version}" if self.version else "none",
                "reason": self.reason, "fallback": fallback}


def limits_off(tree: "CgroupTree | None", error: str = "") -> LimitsOff | None:
    """The one report for a run: `tree.off` for a partial tree, every limit when there is
    no tree (`error`: the CgroupUnavailable text), None when everything is enforced."""
    if tree is None:
        return LimitsOff(None, CONTROLLERS, error or "cgroups unavailable")
    return tree.off


# --- small file helpers ---------------------------------------------------------------

def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _write(path: str, text: str) -> None:
    # One write() per value: cgroup files parse each write as a whole.
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    except OSError as e:
        raise OSError(e.errno, f"{e.strerror}: writing {text!r} to {path}") from None
    finally:
        os.close(fd)


def _set_rt(cpu_dir: str | None, runtime_us: int, period_us: int) -> bool:
    """RT bandwidth of a v1 cpu cgroup; False where there is no such file (v2, or a
    kernel without RT group scheduling)."""
    if cpu_dir is None or not os.path.exists(f"{cpu_dir}/cpu.rt_runtime_us"):
        return False
    _write(f"{cpu_dir}/cpu.rt_period_us", str(period_us))
    _write(f"{cpu_dir}/cpu.rt_runtime_us", str(runtime_us))
    return True


def v1_hierarchies(mountinfo: str) -> dict[str, tuple[str, str, bool]]:
    """controller -> (mount point, root, read-only) of each cgroup v1 hierarchy in a
    /proc/PID/mountinfo text: the first mount of each, paths unescaped (a space is
    \\040 there)."""
    mounts: dict[str, tuple[str, str, bool]] = {}
    for ln in mountinfo.splitlines():
        pre, _, post = ln.partition(" - ")
        f, p = pre.split(), post.split()
        if len(f) < 6 or len(p) < 3 or p[0] != "cgroup":
            continue
        for c in p[2].split(","):
            mounts.setdefault(c, (_unescape(f[4]), _unescape(f[3]), "ro" in f[5].split(",")))
    return mounts


def rt_budget_of(pid: int) -> tuple[int, int] | None:
    """(cpu.rt_runtime_us, cpu.rt_period_us) of `pid`'s v1 cpu cgroup as the kernel has
    them; None where it has none (cgroup v2, no RT group scheduling, cpu not mounted) or
    they cannot be read (the process gone). For whoever did not make the cgroup: the
    supervisor proper, whose sandboxes' leaves are the broker's. Both files and
    /proc/PID/cgroup are world-readable."""
    try:
        proc_cgroup = _read(f"/proc/{pid}/cgroup")
        mountinfo = _read("/proc/self/mountinfo")
    except OSError:
        return None
    path = next((ln.split(":", 2)[2] for ln in proc_cgroup.splitlines()
                 if ln.count(":") >= 2 and "cpu" in ln.split(":", 2)[1].split(",")), None)
    if path is None:
        return None
    cpu = v1_hierarchies(mountinfo).get("cpu")
    if cpu is None:
        return None
    mountpoint, mroot, _ = cpu
    if mroot != "/":                    # a container's view of a sub-tree
        if path != mroot and not path.startswith(mroot + "/"):
            return None
        path = path[len(mroot):]
    d = os.path.normpath(f"{mountpoint}/{path}")
    try:
        return int(_read(f"{d}/cpu.rt_runtime_us")), int(_read(f"{d}/cpu.rt_period_us"))
    except (OSError, ValueError):
        return None


def _procs(directory: str) -> list[int]:
    try:
        return [int(x) for x in _read(os.path.join(directory, "cgroup.procs")).split()]
    except FileNotFoundError:
        return []


def _subtree(top: str) -> list[str]:
    """top and every cgroup below it, deepest first (the order rmdir needs)."""
    if not os.path.isdir(top):
        return []
    return [cur for cur, _dirs, _files in os.walk(top, topdown=False)]


def _members(tops: list[str]) -> set[int]:
    return {pid for top in tops for d in _subtree(top) for pid in _procs(d)}


def kill_listed(pids: Iterable[int], listed: Callable[[], set[int]]) -> None:
    """SIGKILL each of `pids` that `listed()` still lists once its pidfd is open.

    A pidfd opened while its pid is still listed (in a cgroup) refers to that very
    process, so: open pidfds, re-read the listing, signal only those still listed:
    never a recycled pid.
    """
    fds: dict[int, int] = {}
    try:
        for pid in pids:
            try:
                fds[pid] = os.pidfd_open(pid)
            except OSError:
                pass
        still = listed()
        for pid, fd in fds.items():
            if pid in still:
                try:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                except OSError:
                    pass
    finally:
        for fd in fds.values():
            os.close(fd)


def _kill_members(tops: list[str]) -> None:
    """SIGKILL every process listed under tops, without hitting a recycled pid."""
    kill_listed(_members(tops), lambda: _members(tops))


def _kill_once(tops: list[str], version: int) -> None:
    """One round of _kill_tree's signals, no wait."""
    for top in tops:
        kill = os.path.join(top, "cgroup.kill")
        if version == 2 and os.path.exists(kill):
            # Kernel-side kill of the whole subtree: no fork race, no pid reuse race.
            _write(kill, "1")
        else:
            _kill_members([top])


def _kill_tree(tops: list[str], version: int, timeout: float = _KILL_TIMEOUT) -> None:
    """Kill everything under tops and wait until no process is listed (zombies are not)."""
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        left = _members(tops)
        if not left:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes {sorted(left)} survived SIGKILL in {tops}")
        _kill_once(tops, version)     # v1: every round, a task may fork while we signal
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def _release_rt(d: str) -> None:
    """Give a v1 cgroup's RT bandwidth back before its rmdir: a removed group keeps
    counting against its parent's until the kernel frees it, seconds later, so a
    supervisor restarted at once (systemd's Restart=) could reserve none and ran every
    real-time worker in the normal class (measured: each second bench run here)."""
    try:
        _write(f"{d}/cpu.rt_runtime_us", "0")
    except OSError:
        pass          # no RT groups, gone, or still busy: rmdir decides


def _destroy(tops: list[str], version: int, timeout: float = _KILL_TIMEOUT) -> None:
    """Kill, then rmdir bottom-up (a worker may have made sub-cgroups if it could)."""
    _kill_tree(tops, version, timeout)
    deadline = time.monotonic() + timeout
    for top in tops:
        for d in _subtree(top):
            if version == 1:
                _release_rt(d)              # deepest first, as a parent's must cover
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    # EBUSY: a dying task not yet off the css_set; it goes within ms.
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)


_DEFAULT_PREFIX = "trio-supervisor-"


def _default_name() -> str:
    """``trio-supervisor-<pid namespace inode>-<pid>``: a PID means something only in
    its own namespace, and supervisors of other namespaces may share our parent."""
    return f"{_DEFAULT_PREFIX}{os.stat('/proc/self/ns/pid').st_ino}-{os.getpid()}"


def _sweep_stale(parent: str) -> None:
    """Remove the empty trees of supervisors of our PID namespace that died without
    cleaning up (SIGKILL, a crash): ``trio-supervisor-<our ns>-PID`` with PID gone. Only
    rmdir, never a kill: a tree that still holds a process, one of another namespace and
    a live PID's (even if reused) are left alone."""
    mine = f"{_DEFAULT_PREFIX}{os.stat('/proc/self/ns/pid').st_ino}-"
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for n in names:
        pid = n[len(mine):]
        if not (n.startswith(mine) and pid.isdigit()) or os.path.exists(f"/proc/{pid}"):
            continue
        try:
            for d in _subtree(os.path.join(parent, n)):      # deepest first
                _release_rt(d)
                os.rmdir(d)
        except OSError:
            pass          # busy or gone: not ours to fight over


def _check_name(name: str) -> None:
    if not _NAME.match(name) or name in _RESERVED:
        raise ValueError(f"bad cgroup name {name!r}: want {_NAME.pattern}, not {sorted(_RESERVED)}")


def _why(e: OSError) -> str:
    return f"{e.strerror or e}: {e.filename}" if e.filename else str(e.strerror or e)


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


# --- per-worker leaf ------------------------------------------------------------------

class WorkerCgroup:
    """One worker run's cgroup (one directory per v1 hierarchy, one directory in v2)."""

    def __init__(self, name: str, limits: Limits, version: int, dirs: dict[str, str],
                 controllers: tuple[str, ...], off: tuple[str, ...] = ()) -> None:
        self.name = name
        self.limits = limits
        self.version = version
        self._dirs = dirs                                   # controller -> directory
        self._controllers = controllers
        # Controllers the tree already reported as off (one `limits_not_enforced` event
        # for the run): their limits are skipped here, not refused per worker.
        self._off = off
        self.paths: tuple[str, ...] = tuple(dict.fromkeys(dirs.values()))
        self._inos: tuple[int, ...] = ()

    @classmethod
    def existing(cls, version: int, dirs: dict[str, str],
                 controllers: tuple[str, ...]) -> "WorkerCgroup":
        """A handle on a leaf someone else made (the audit of a running supervisor reads
        one): its identity is its directories as they are now."""
        cg = cls(os.path.basename(next(iter(dirs.values()))), Limits(), version, dirs,
                 controllers)
        cg._remember()
        return cg

    def _remember(self) -> None:
        # kernfs inode numbers are never reused, so they tell this leaf from a later one
        # of the same name: a stale handle must not kill or remove its successor.
        self._inos = tuple(os.stat(p).st_ino for p in self.paths)

    def _create(self) -> None:
        for p in self.paths:
            os.mkdir(p)
        self._remember()
        self._apply()

    def _apply(self) -> None:
        lim = self.limits
        # Only controllers in use get written (tests run the v2 code with none enabled).
        mem, pids, cpu = (self._dirs.get(c) if c in self._controllers else None for c in CONTROLLERS)
        for c, wanted in (("memory", lim.memory_max), ("pids", lim.pids_max),
                          ("cpu", lim.cpu_quota_pct), ("cpu", lim.cpu_weight)):
            if wanted is not None and c not in self._controllers and c not in self._off:
                raise CgroupUnavailable(f"{c} limit requested but the {c} controller is not in use")
        if self.version == 1:
            if lim.memory_max is not None and mem:
                _write(f"{mem}/memory.limit_in_bytes", str(lim.memory_max))
                # memsw = memory + swap. Equal to the memory limit: no page may escape to
                # swap. Set after memory.limit_in_bytes (memsw must never be below it).
                if os.path.exists(f"{mem}/memory.memsw.limit_in_bytes"):
                    _write(f"{mem}/memory.memsw.limit_in_bytes", str(lim.memory_max))
            if lim.pids_max is not None and pids:
                _write(f"{pids}/pids.max", str(lim.pids_max))
            if cpu:
                _write(f"{cpu}/cpu.cfs_period_us", str(CPU_PERIOD_US))
                q = lim.cpu_quota_us
                _write(f"{cpu}/cpu.cfs_quota_us", "-1" if q is None else str(q))
                _write(f"{cpu}/cpu.shares", str(max(2, (lim.cpu_weight or 100) * 1024 // 100)))
            return
        if mem:
            _write(f"{mem}/memory.max", "max" if lim.memory_max is None else str(lim.memory_max))
            if os.path.exists(f"{mem}/memory.swap.max"):         # absent without swap accounting
                _write(f"{mem}/memory.swap.max", "0")
            if os.path.exists(f"{mem}/memory.oom.group"):
                # On OOM kill the whole sandbox (bwrap + worker + helpers), not one
                # process of it: a half-dead worker is worse than a restarted one.
                _write(f"{mem}/memory.oom.group", "1")
        if pids:
            _write(f"{pids}/pids.max", "max" if lim.pids_max is None else str(lim.pids_max))
        if cpu:
            q = lim.cpu_quota_us
            _write(f"{cpu}/cpu.max", f"{'max' if q is None else q} {CPU_PERIOD_US}")
            _write(f"{cpu}/cpu.weight", str(lim.cpu_weight or 100))

    def _is_current(self) -> bool:
        try:
            return bool(self._inos) and tuple(os.stat(p).st_ino for p in self.paths) == self._inos
        except FileNotFoundError:
            return False

    def _require_current(self) -> None:
        if not self._is_current():
            raise FileNotFoundError(errno.ENOENT, f"cgroup {self.name!r} was removed or replaced", self.paths[0])

    def open_join_fds(self) -> list[int]:
        """O_WRONLY|O_CLOEXEC fds of each hierarchy's cgroup.procs; the caller closes them
        after the spawn. Opened in the parent so the child needs no path lookup."""
        self._require_current()
        fds: list[int] = []
        try:
            for p in self.paths:
                fds.append(os.open(os.path.join(p, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    @staticmethod
    def join(fds: list[int]) -> None:
        """Between fork and exec (preexec_fn, still privileged): move the calling process.

        "0" means the writer itself. Nothing else here: the forked child of a threaded
        parent must not allocate or take locks. An error propagates, so Popen fails
        rather than running the worker outside its cgroup.
        """
        for fd in fds:
            os.write(fd, b"0")

    def pids(self) -> list[int]:
        """Processes in this leaf (and any sub-cgroup of it), across all hierarchies."""
        return sorted(_members(list(self.paths))) if self._is_current() else []

    def kill_all(self) -> None:
        """SIGKILL every task and wait until none is listed (TimeoutError if one resists)."""
        if self._is_current():
            _kill_tree(list(self.paths), self.version)

    def kill_now(self) -> None:
        """SIGKILL every task listed now, without waiting for them to leave: none of
        them runs a user instruction again (kill_all, later, waits and repeats for a
        task forked meanwhile)."""
        if self._is_current():
            _kill_once(list(self.paths), self.version)

    def oom_kills(self) -> int:
        self._require_current()
        mem = self._dirs.get("memory")
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        if mem is None or not os.path.exists(f"{mem}/{name}"):
            return 0
        for line in _read(f"{mem}/{name}").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def grant_rt(self, runtime_us: int, period_us: int) -> bool:
        """An RT budget for this leaf (v1 with RT group scheduling: the kernel refuses
        SCHED_FIFO in a cgroup with none). False where no such file exists (v2, or a
        kernel without RT groups): only the global sched_rt_runtime_us bounds it there."""
        self._require_current()
        cpu = self._dirs.get("cpu") if "cpu" in self._controllers else None
        return _set_rt(cpu if self.version == 1 else None, runtime_us, period_us)

    def in_force(self) -> dict[str, object]:
        """Limits as the kernel reports them (not as requested), plus the raw files."""
        self._require_current()
        files: dict[str, str] = {}

        def get(ctrl: str, fname: str) -> str | None:
            d = self._dirs.get(ctrl)
            if d is None or not os.path.exists(f"{d}/{fname}"):
                return None
            files[fname] = v = _read(f"{d}/{fname}")
            return v

        def num(v: str | None, unlimited: tuple[str, ...] = ("max",)) -> int | None:
            if v is None or v in unlimited:
                return None
            n = int(v)
            return None if n >= _V1_UNLIMITED or n < 0 else n

        out: dict[str, object] = {"version": self.version, "paths": list(self.paths)}
        if self.version == 1:
            mem = num(get("memory", "memory.limit_in_bytes"))
            memsw = num(get("memory", "memory.memsw.limit_in_bytes"))
            quota = num(get("cpu", "cpu.cfs_quota_us"))
            period = num(get("cpu", "cpu.cfs_period_us"))
            out["memory_max"] = mem
            out["swap_max"] = memsw - mem if memsw is not None and mem is not None else None
            shares = num(get("cpu", "cpu.shares"))
            out["cpu_weight"] = None if shares is None else round(shares * 100 / 1024)
            rt = num(get("cpu", "cpu.rt_runtime_us"), ("-1",))
            rt_period = num(get("cpu", "cpu.rt_period_us"))
            out["rt_budget_pct"] = (None if rt is None or not rt_period
                                    else round(rt * 100 / rt_period))
        else:
            out["memory_max"] = num(get("memory", "memory.max"))
            out["swap_max"] = num(get("memory", "memory.swap.max"))
            get("memory", "memory.oom.group")
            cpu_max = get("cpu", "cpu.max")
            quota, period = (num(x) for x in cpu_max.split()) if cpu_max else (None, None)
            out["cpu_weight"] = num(get("cpu", "cpu.weight"))
            out["rt_budget_pct"] = None      # v2 has no per-cgroup RT budget
        out["pids_max"] = num(get("pids", "pids.max"))
        out["cpu_quota_us"] = quota
        out["cpu_period_us"] = period
        out["files"] = files
        return out

    def remove(self) -> None:
        """Kill what is left and remove the directories; no-op once removed or replaced."""
        if self._is_current():
            _destroy(list(self.paths), self.version)
        self._inos = ()

    def __repr__(self) -> str:
        return f"WorkerCgroup({self.name!r}, v{self.version}, {self.paths})"


# --- the per-run tree -----------------------------------------------------------------

class CgroupTree:
    """Base cgroup of one supervisor run; leaves are created under it per worker run."""

    def __init__(self, name: str, version: int, bases: dict[str, str], controllers: tuple[str, ...],
                 off: LimitsOff | None = None) -> None:
        self.name = name
        self.version = version
        self._bases = bases                                 # controller -> base directory
        self._controllers = controllers
        # What this machine's cgroups cannot enforce (partial trees only); None: all on.
        self.off = off
        self.paths: tuple[str, ...] = tuple(dict.fromkeys(bases.values()))
        self._leaves: dict[str, WorkerCgroup] = {}
        self._closed = False

    @classmethod
    def create(cls, name: str | None = None, *, partial: bool = False) -> CgroupTree:
        """v2 when /sys/fs/cgroup is a cgroup2 mount, else v1 memory+pids+cpu; else raise.

        partial=True: where only some controllers are delegated (v2; a GPU machine had
        only `memory`) or mounted (v1), use those and record the rest in `tree.off`, so
        that the limits that can be enforced are, and the caller reports the others once
        (`LimitsOff.event()`). A v2 tree with no controller at all still gives every
        sandbox its own cgroup: membership and cgroup.kill, no limits.
        """
        return cls._create(name, partial=partial)

    @classmethod
    def _create(cls, name: str | None = None, *, root: str = CGROUP_ROOT,
                controllers: tuple[str, ...] = CONTROLLERS, partial: bool = False) -> CgroupTree:
        # root/controllers are for tests only: the v2 code can then run against a
        # hybrid system's /sys/fs/cgroup/unified, where no controller is available.
        name = name or _default_name()
        _check_name(name)
        try:
            with open("/proc/self/cgroup") as f:
                proc_cgroup = f.read()
        except OSError as e:
            raise CgroupUnavailable(f"cannot read /proc/self/cgroup: {e.strerror}") from None
        if os.path.exists(os.path.join(root, "cgroup.controllers")):
            return cls._create_v2(name, root, controllers, proc_cgroup, partial)
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
        return cls._create_v1(name, controllers, proc_cgroup, mountinfo, partial)

    @classmethod
    def _create_v2(cls, name: str, mount: str, controllers: tuple[str, ...], proc_cgroup: str,
                   partial: bool = False) -> CgroupTree:
        own = next((ln[3:] for ln in proc_cgroup.splitlines() if ln.startswith("0::")), None)
        if own is None:
            raise CgroupUnavailable("cgroup v2: no '0::' line in /proc/self/cgroup")
        own_dir = mount + own.rstrip("/") if own != "/" else mount
        off = None
        try:
            available = _read(f"{own_dir}/cgroup.controllers").split()
            missing = [c for c in controllers if c not in available]
            if missing:
                why = (f"cgroup v2: controller(s) {' '.join(missing)} not delegated to {own_dir} "
                       f"(available: {' '.join(available) or 'none'}; run under systemd with "
                       f"Delegate=yes)")
                if not partial:
                    raise CgroupUnavailable(why)
                off = LimitsOff(2, tuple(missing), why)
                controllers = tuple(c for c in controllers if c in available)
            # No-internal-process rule: a non-root cgroup holding processes cannot enable
            # controllers for its children. The real root is exempt and is the only
            # cgroup without cgroup.type (a cgroup-namespace root is not exempt).
            if os.path.exists(f"{own_dir}/cgroup.type") and _procs(own_dir):
                sup = f"{own_dir}/supervisor"
                os.makedirs(sup, exist_ok=True)
                _write(f"{sup}/cgroup.procs", str(os.getpid()))    # moves all our threads
                others = _procs(own_dir)
                if others:
                    raise CgroupUnavailable(
                        f"cgroup v2: {own_dir} still holds processes {others} besides the supervisor "
                        f"(moved to {sup}); controllers cannot be enabled below it: start it "
                        f"in a cgroup of its own (its systemd unit, or systemd-run --scope -p "
                        f"Delegate=yes supervisor run)")
            enable = " ".join(f"+{c}" for c in controllers)
            if enable:
                _write(f"{own_dir}/cgroup.subtree_control", enable)
            base = f"{own_dir}/{name}"
            _sweep_stale(own_dir)
            _destroy([base], 2)            # a fixed name reused after a crash: drop leftovers
            os.mkdir(base)
            if enable:
                _write(f"{base}/cgroup.subtree_control", enable)
        except OSError as e:
            raise CgroupUnavailable(f"cgroup v2 at {own_dir}: {_why(e)}") from None
        return cls(name, 2, {c: base for c in CONTROLLERS}, controllers, off)

    @classmethod
    def _create_v1(cls, name: str, controllers: tuple[str, ...], proc_cgroup: str, mountinfo: str,
                   partial: bool = False) -> CgroupTree:
        own: dict[str, str] = {}
        for ln in proc_cgroup.splitlines():
            _id, ctrls, path = ln.split(":", 2)
            for c in ctrls.split(","):
                own[c] = path
        mounts = v1_hierarchies(mountinfo)      # controller -> (mountpoint, root, ro)
        # A hierarchy with something mounted over it (an empty tmpfs on /sys/fs/cgroup:
        # a container without a cgroup fs) is still listed in mountinfo but not there.
        mounts = {c: m for c, m in mounts.items()
                  if os.path.exists(os.path.join(m[0], "cgroup.procs"))}
        if not mounts:
            raise CgroupUnavailable(
                f"no cgroup file system at {CGROUP_ROOT} (a container without one? "
                f"mount it, or bind the host's, read-write)")
        missing = [c for c in controllers if c not in mounts or c not in own]
        # A read-only hierarchy is as good as absent (a container's cgroupfs).
        read_only = [c for c in controllers if c not in missing and mounts[c][2]]
        off = None
        if missing or read_only:
            why = "; ".join(
                ([f"no cgroup2 at {CGROUP_ROOT} and cgroup v1 controller(s) "
                  f"{' '.join(missing)} not mounted"] if missing else [])
                + [f"cgroup v1 {c} hierarchy at {mounts[c][0]} is mounted read-only"
                   for c in read_only])
            usable = tuple(c for c in controllers if c not in missing and c not in read_only)
            if not partial or not usable:
                raise CgroupUnavailable(why)
            off = LimitsOff(1, tuple(c for c in controllers if c not in usable), why)
            controllers = usable
        bases: dict[str, str] = {}
        for c in controllers:
            mountpoint, mroot, ro = mounts[c]
            path = own[c]
            if mroot != "/":
                # The mount shows only a sub-tree (a container's bind mount of its cgroup).
                if path != mroot and not path.startswith(mroot + "/"):
                    raise CgroupUnavailable(f"cgroup v1 {c}: own cgroup {path} is outside the mounted {mroot}")
                path = path[len(mroot):]
            bases[c] = os.path.normpath(f"{mountpoint}/{path}/{name}")
        made: list[str] = []
        try:
            for b in dict.fromkeys(bases.values()):
                _sweep_stale(os.path.dirname(b))
                _destroy([b], 1)           # a fixed name reused after a crash: drop leftovers
                os.mkdir(b)
                made.append(b)
        except OSError as e:
            for b in reversed(made):
                os.rmdir(b)
            raise CgroupUnavailable(f"cgroup v1: {_why(e)}") from None
        return cls(name, 1, bases, controllers, off)

    def leaf(self, name: str, limits: Limits) -> WorkerCgroup:
        """A fresh leaf for one worker run; whatever a previous leaf of this name left is killed."""
        _check_name(name)
        if self._closed:
            raise RuntimeError("CgroupTree is closed")
        w = WorkerCgroup(name, limits, self.version,
                         {c: os.path.join(b, name) for c, b in self._bases.items()
                          if c in self._controllers or self.version == 2},
                         self._controllers, self.off.controllers if self.off else ())
        # By path, not via the old handle: also catches a leaf we lost track of.
        _destroy(list(w.paths), self.version)
        self._leaves.pop(name, None)
        try:
            w._create()
        except BaseException:
            _destroy(list(w.paths), self.version)
            raise
        self._leaves[name] = w
        return w

    def reserve_rt(self, runtime_us: int, period_us: int) -> bool:
        """RT bandwidth for the leaves below (v1 RT groups: a child's budget must fit
        in its parent's). False where the kernel has no RT groups (see grant_rt)."""
        cpu = self._bases.get("cpu") if "cpu" in self._controllers else None
        return _set_rt(cpu if self.version == 1 else None, runtime_us, period_us)

    def close(self) -> None:
        """Kill every process left in the leaves, remove leaves and base. Idempotent.

        Tries everything and raises the first error at the end, so one stuck leaf does
        not keep the others alive.
        """
        if self._closed:
            return
        first: BaseException | None = None
        for b in self.paths:
            try:
                _destroy([b], self.version)
            except OSError as e:
                first = first or e
        self._leaves.clear()
        if first is not None:
            raise first
        self._closed = True

    def __enter__(self) -> CgroupTree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CgroupTree({self.name!r}, v{self.version}, {self.paths})"
