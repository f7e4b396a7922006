"""``supervisor check --start``: start every worker's sandbox exactly as ``run`` would,
wait for READY, stop, and say per worker what happened.

Whatever would make ``run`` fail makes this fail, with the cause: it IS ``run`` (the same
`Supervisor`, admission, runtime checks, cgroups, sandboxes, research included), with
three differences that keep it off the car: a scratch state dir (a failure here never
writes the vehicle's fail-safe latch), no live status line, and it stops at the first
worker failure or once all are READY. While a worker is not READY its processes are
sampled from /proc (state, system call, threads, memory), so one that prints nothing
before its ready timeout is reported with the last thing it was seen doing, not just
"not ready".
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import TextIO

import trio

from supervisor.config import Config
from supervisor.events import EventLog
from supervisor.exits import Exit
from supervisor.protocol import printable

# Events that end a worker's first start as a failure (before its READY).
_FAILED = ("exit", "ready_timeout", "refused", "start_failed", "standby_failed")
SAMPLE_S = 0.25


@dataclass
class Sample:
    """What one process of a sandbox was doing, from outside (/proc)."""

    pid: int
    state: str
    syscall: str
    threads: int
    rss_mib: float

    def text(self) -> str:
        return (f"pid {self.pid} state {self.state}, in {self.syscall}, "
                f"{self.threads} thread(s), {self.rss_mib:.0f} MiB resident")


@dataclass
class WorkerCheck:
    name: str
    domain: str
    ready_ms: float | None = None
    failure: str = ""                  # the first event that ended its start, as a line
    last_output: str = ""
    last_seen: Sample | None = None
    started_ns: int = 0
    events: list[str] = field(default_factory=list)

    def line(self) -> str:
        if self.ready_ms is not None and not self.failure:
            return f"{self.name} ({self.domain}): READY in {self.ready_ms:.0f} ms"
        if not self.failure and self.started_ns:
            waited = (time.monotonic_ns() - self.started_ns) / 1e6
            return (f"{self.name} ({self.domain}): started, not READY {waited:.0f} ms later "
                    f"when the check stopped")
        if not self.failure:
            return f"{self.name} ({self.domain}): not started (the check stopped first)"
        out = f"{self.name} ({self.domain}): FAILED: {self.failure}"
        if self.last_output:
            # a `log` record's msg is the worker's text too: never raw to the terminal
            out += f"; last output: {printable(self.last_output)[:200]}"
        elif self.ready_ms is None:
            waited = (time.monotonic_ns() - self.started_ns) / 1e6 if self.started_ns else 0
            out += f"; no output in {waited:.0f} ms"
            if self.last_seen is not None:
                out += f"; last seen: {self.last_seen.text()}"
        return out


def _syscall_name(nr: int) -> str:
    try:
        import pyseccomp

        name = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, nr)
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:   # no libseccomp here: the number still says something
        return f"syscall {nr}"


def sample(pid: int) -> Sample | None:
    """One look at a process from outside; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/syscall") as f:
            sc = f.read().split()
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    state = stat.rsplit(")", 1)[1].split()[0]
    if not sc or sc[0] == "running":
        call = "user space (running)"
    elif sc[0].lstrip("-").isdigit() and int(sc[0]) >= 0:
        call = _syscall_name(int(sc[0]))
    else:
        call = "user space"
    rss_kib = int(status.get("VmRSS", "0 kB").split()[0] or 0)
    return Sample(pid, state, call, int(status.get("Threads", "1").strip() or 1), rss_kib / 1024)


class _Watch:
    """Follows the supervisor's own event log: per worker, READY or the first failure."""

    def __init__(self, cfg: Config) -> None:
        self.workers = {n: WorkerCheck(n, w.domain) for n, w in cfg.workers.items()}
        self.all_ready = False
        self.exit: dict | None = None
        self.failed = False
        self.interrupted = ""          # SIGTERM/SIGINT seen: the check was stopped, not passed
        self._seen = 0

    def update(self, events: list[dict]) -> None:
        for ev in events[self._seen:]:
            self._one(ev)
        self._seen = len(events)

    def _one(self, ev: dict) -> None:
        kind, name = ev.get("event"), ev.get("worker")
        if kind == "all_ready":
            self.all_ready = True
        elif kind == "supervisor_exit":
            self.exit = ev
        elif kind == "signal" and not self.interrupted:
            self.interrupted = str(ev.get("signal") or "a signal")
        w = self.workers.get(name or "")
        if w is None:
            return
        if kind == "start" and not w.started_ns:
            w.started_ns = ev.get("mono_ns", time.monotonic_ns())
        elif kind == "ready" and w.ready_ms is None:
            w.ready_ms = float(ev.get("start_to_ready_ms", 0.0))
        elif kind in ("output", "log"):
            w.last_output = str(ev.get("line") or ev.get("msg") or "")
        elif kind in _FAILED and not w.failure and not ev.get("standby"):
            if kind == "exit" and ev.get("code") == 0 and w.ready_ms is not None:
                return
            w.failure = _describe(ev)
            self.failed = True


def _describe(ev: dict) -> str:
    kind = ev["event"]
    if kind == "exit":
        why = ev.get("cause") or ev.get("reason") or ""
        return f"exited with code {ev.get('code')}" + (f" ({printable(str(why))})" if why else "")
    if kind == "ready_timeout":
        return "not ready within its ready_timeout_ms"
    return printable(f"{kind}: {ev.get('reason') or ev.get('error') or ''}".rstrip(": "))


async def _drive(cfg: Config, log: EventLog, watch: _Watch, timeout_s: float,
                 progress: TextIO | None) -> Exit:
    from supervisor.lifecycle import Supervisor

    sup = Supervisor(cfg, log=log, status_out=None)
    code: list[Exit] = []

    async def run() -> None:
        code.append(await sup.run())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        deadline = trio.current_time() + timeout_s
        shown = 0
        while not code:
            watch.update(log.events)
            for w in watch.workers.values():        # the last thing a silent worker did
                run_ = sup.runs.get(w.name)
                if run_ is not None and w.ready_ms is None and not w.failure:
                    pids = sup.worker_pids(run_)
                    seen = sample(pids[-1]) if pids else None
                    w.last_seen = seen or w.last_seen
            ready = sum(1 for w in watch.workers.values() if w.ready_ms is not None)
            if progress is not None and ready != shown:
                shown = ready
                progress.write(f"check --start: {ready}/{len(watch.workers)} ready\n")
                progress.flush()
            if watch.all_ready or watch.failed or trio.current_time() > deadline:
                nursery.cancel_scope.cancel()      # the ordered shutdown runs in sup.run
                break
            await trio.sleep(SAMPLE_S)
    watch.update(log.events)
    if watch.failed or not watch.all_ready:
        if code and code[0] not in (Exit.SHUTDOWN,):
            return code[0]
        return Exit.START_FAILED
    return Exit.SHUTDOWN


def _ancestors(pid: int) -> set[int]:
    """`pid` and the processes above it (parent, its parent, ... up to pid 1), from
    /proc/PID/stat; a process gone or unreadable ends the chain."""
    chain: set[int] = set()
    while pid > 0 and pid not in chain:
        chain.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return chain


def other_supervisors(me: int | None = None) -> list[tuple[int, str]]:
    """Other supervisors running on this machine, from /proc: (pid, command line) of each
    `supervisor run` and `supervisor check --start` (not a broker, `python -m
    supervisor.broker`: it runs no pipeline, and the `supervisor run` it serves is named;
    review 7 finding 10 saw it called a second pipeline). A check started beside a live
    one runs a second pipeline next to it (its cameras, CPU, the real-time slot): worth a
    line. Found by command line, of root's or trio-supervisor's processes only: a
    process that hides its name is not found.
    `me`'s ancestors are not others: `sudo supervisor check --start` (or `timeout 300
    ...`, `nice ...`) has a parent whose command line is the check's own, and the check
    named its own sudo as a second pipeline beside it."""
    from supervisor.audit.running import run_by_supervisor_user

    mine = _ancestors(os.getpid() if me is None else me)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:
            continue
        # Only root's or trio-supervisor's: any local user's process may read like one,
        # and its command line must never reach the operator's terminal raw (review 9
        # finding 10); printable below for what is left.
        if not run_by_supervisor_user(int(entry)):
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        for i, a in enumerate(argv[:6]):
            rest = argv[i + 1:]
            if ((a == "supervisor.cli" or os.path.basename(a) == "supervisor") and rest
                    and (rest[0] == "run" or rest[0] == "check" and "--start" in rest)):
                found.append((int(entry), printable(" ".join(x for x in argv if x))[:120]))
                break
    return found


def limits_text(off: list[str] | tuple[str, ...], reason: str) -> str:
    """The one wording of limits a machine cannot enforce, for `check` and `check
    --start` alike: which are off, why, and what it means (review 9 finding 7: the
    --start line named the cause only)."""
    which = ", ".join(off) or "some limits"
    return f"limits not enforced: {which} ({reason}); workers run without them"


def _bug_line(e: BaseException) -> str:
    """The innermost exception of a (trio) exception group, where it was raised."""
    import traceback

    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    tb = traceback.extract_tb(e.__traceback__)
    where = f" ({tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


# v1's "no limit" (PAGE_COUNTER_MAX pages): anything this large is no limit.
_NO_LIMIT = 1 << 60


def enclosing_memory_limit(proc_cgroup: str = "/proc/self/cgroup",
                           mount: str = "/sys/fs/cgroup") -> tuple[int, str] | None:
    """(bytes, cgroup) of the smallest memory limit over this process's own cgroup and
    its ancestors: a container's (`docker run -m`) or a unit's MemoryMax=, which bounds
    every worker below whatever its own memory_max says. None when there is none, or it
    cannot be read. v1: the cgroup's `hierarchical_memory_limit` (the kernel's minimum
    over its ancestors); v2: each `memory.max` from the cgroup up to the mount.
    `proc_cgroup` and `mount` are a fake tree in tests."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    v1 = next((path for _, ctrls, path in lines if "memory" in ctrls.split(",")), None)
    if v1 is not None:
        try:
            with open(os.path.join(mount, "memory", v1.lstrip("/"), "memory.stat")) as f:
                stat = dict(line.split() for line in f if line.count(" ") == 1)
            limit = int(stat["hierarchical_memory_limit"])
        except (OSError, KeyError, ValueError):
            return None
        return (limit, v1) if limit < _NO_LIMIT else None
    v2 = next((path for hid, ctrls, path in lines if hid == "0" and ctrls == ""), None)
    if v2 is None:
        return None
    best: tuple[int, str] | None = None
    path = v2
    while True:
        try:
            with open(os.path.join(mount, path.lstrip("/"), "memory.max")) as f:
                text = f.read().strip()
            if text != "max" and (best is None or int(text) < best[0]):
                best = (int(text), path)
        except (OSError, ValueError):
            pass                          # the root, or memory not enabled there
        if path in ("/", ""):
            return best
        path = os.path.dirname(path)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def memory_lines(cfg: Config, failed: list[str],
                 limit: tuple[int, str] | None) -> list[str]:
    """For each worker in `failed` whose own memory_max is above `limit` (the enclosing
    one): the kill came from there, not from its memory_max. In a 700 MiB container the
    car's modeld said 'out of memory: killed by the kernel at the cgroup limit
    memory_max=4294967296', which sends the operator to raise a limit that was not hit."""
    if limit is None:
        return []
    size, where = limit
    out = []
    for name in failed:
        mm = cfg.workers[name].memory_max
        if mm is None or mm > size:
            out.append(f"memory: {name} was killed at {_mib(size)}, the memory limit of the "
                       f"supervisor's own cgroup {where} (a container's -m or a unit's "
                       f"MemoryMax=), below its memory_max "
                       f"{_mib(mm) if mm is not None else '(none)'}: give the machine more "
                       f"memory, or lower memory_max to fit")
    return out


def start_check(cfg: Config, *, timeout_s: float | None = None,
                progress: TextIO | None = None) -> tuple[Exit, list[str]]:
    """Start `cfg` as `run` would, stop it, and return (exit code, one line per worker
    plus the supervisor's own reason when it stopped before starting workers)."""
    if timeout_s is None:
        timeout_s = 30.0 + sum(w.ready_timeout_ms for w in cfg.workers.values()) / 1000
    beside = [f"note: another supervisor runs here (pid {pid}: {cmd}); this check ran a "
              f"second pipeline beside it" for pid, cmd in other_supervisors()]
    # The scratch state dir: with no usable temporary directory (TMPDIR missing, /tmp and
    # /var/tmp read-only, an unwritable cwd) a config without models got this far and
    # ended in a 20-line traceback from mkdtemp.
    try:
        scratch = tempfile.TemporaryDirectory(prefix="trio-check-start-")
    except OSError as e:
        return Exit.CONFIG, [*beside, f"supervisor: no scratch state dir for the check "
                             f"({e.strerror or e}): set TMPDIR to a writable directory"]
    with scratch as state, open(os.devnull, "w") as devnull:
        old = os.environ.get("TRIO_STATE_DIR")
        os.environ["TRIO_STATE_DIR"] = state          # never the vehicle's latch
        try:
            log = EventLog(stream=devnull, keep=True)
            watch = _Watch(cfg)
            try:
                code = trio.run(_drive, cfg, log, watch, timeout_s, progress)
            except Exception as e:     # a bug in the start or the stop: a line, not a traceback
                code, crash = Exit.ERROR, _bug_line(e)
            else:
                crash = ""
        finally:
            if old is None:
                os.environ.pop("TRIO_STATE_DIR", None)
            else:
                os.environ["TRIO_STATE_DIR"] = old
    watch.update(log.events)
    lines = [w.line() for w in watch.workers.values()]
    ex = watch.exit or {}
    if watch.interrupted:
        # systemd's or the operator's stop (the ordered stop ran): not a pass.
        lines.append(f"supervisor: stopped by {watch.interrupted} before the check ended")
        if code == Exit.SHUTDOWN:
            code = Exit.START_FAILED
    if crash:
        lines.append(f"supervisor: internal error: {crash}")
    elif (code != Exit.SHUTDOWN and not watch.interrupted
          and not any(w.failure for w in watch.workers.values())):
        lines.append(f"supervisor: {ex.get('reason', 'stopped')} (exit {int(code)})")
    for ev in log.of("config_problem"):
        lines.append(f"config: {ev.get('problem')}")
    for ev in log.of("limits_not_enforced"):
        lines.append(limits_text(ev.get("off") or [], str(ev.get("reason") or ev.get("detail")
                                                          or ev)))
    # run goes on with such a worker in the normal class (exit 0 is right), but the car's
    # owner must hear it: "all READY" alone hid a controlsd refused SCHED_FIFO (review 9
    # finding 5). The tree's reservation (worker None) first, then each worker.
    for ev in log.of("realtime_unavailable"):
        why = printable(str(ev.get("reason") or "refused"))
        who = ev.get("worker")
        lines.append(f"realtime: {who} runs in the normal class, not SCHED_FIFO ({why})"
                     if who else f"realtime: no RT budget for the real-time workers ({why})")
    oom = [w.name for w in watch.workers.values() if "out of memory" in w.failure]
    if oom:
        lines += memory_lines(cfg, oom, enclosing_memory_limit())
    return code, beside + lines


# --- The installation as the sandboxes see it (`python -m supervisor.startcheck
# --installed`, the last step of scripts/install.sh). Each sandbox runs as a domain user
# (trio-control, trio-research): to the kernel a stranger to root's files. A checkout, a
# venv or a pip install made under umask 077 is mode 0700/0600, which `supervisor check`
# reports per worker as "bwrap: execvp ...: Permission denied" and `run` as a worker that
# never starts; here it is one line per tree, with the command that fixes it.

# Walking a tree stops after this many entries (a full venv with torch is ~20k files):
# a umask mistake shows on the tree's first entries.
_WALK_LIMIT = 50_000


def stranger_cannot_read(root: str) -> str | None:
    """The first path under `root` (itself included) that a user with only the 'other'
    permission bits cannot read (a file) or list and enter (a directory); None if all
    can be. Symlinks are not followed (their targets are checked where they live)."""
    seen = 0
    for top, dirs, files in os.walk(root, onerror=None):
        dirs[:] = [d for d in dirs if d not in ("__pycache__", ".git")]
        try:
            if os.stat(top).st_mode & 0o005 != 0o005:
                return top
        except OSError:
            continue
        for f in files:
            p = os.path.join(top, f)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if not os.path.islink(p) and st.st_mode & 0o004 == 0:
                return p
        seen += len(files) + 1
        if seen > _WALK_LIMIT:
            break
    return None


def _mode(path: str) -> str:
    try:
        return f"{os.stat(path).st_mode & 0o777:04o}"
    except OSError:
        return "?"


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _build_tools_missing() -> tuple[list[str], str]:
    """What pip needed to build the native module and this machine lacks now, and the
    fix: Debian's python3.X-dev serves /usr/include/python3.X only, so an interpreter
    whose headers live elsewhere (pyenv, /usr/local) was told to apt-get install it for
    ever (review 9 finding 9). ([], "") when all are here."""
    import shutil
    import sysconfig

    missing, apt, other = [], [], []
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        missing.append(f"the C compiler {cc}")
        apt.append("gcc")
    inc = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(inc, "Python.h")):
        missing.append(f"this interpreter's headers {inc}/Python.h")
        if _within(inc, "/usr/include"):
            apt.append(f"{os.path.basename(inc)}-dev")
        else:
            other.append("install this Python's headers (pyenv: reinstall it; /usr/local: "
                         "make install from its source), or use a venv of /usr/bin/python3")
    if not os.path.exists("/usr/include/zlib.h"):
        missing.append("zlib's headers /usr/include/zlib.h")
        apt.append("zlib1g-dev")
    fix = "; ".join(([f"apt-get install {' '.join(apt)}"] if apt else []) + other)
    return missing, fix


def install_problems(checkout: str | None = None) -> list[str]:
    """What would keep every sandbox from starting although the install succeeded, one
    line each, saying what to do: a tree the domain users cannot read, schemas the
    package cannot load here, a `supervisor` imported from somewhere other than
    `checkout` (an editable install: another checkout or interpreter won)."""
    import subprocess
    import sys

    from supervisor.sandbox.policy import project_packages, python_dirs

    problems: list[str] = []
    import supervisor

    root = os.path.dirname(os.path.dirname(os.path.abspath(supervisor.__file__)))
    if checkout is not None and os.path.realpath(root) != os.path.realpath(checkout):
        problems.append(f"{sys.executable} imports supervisor from {root}, not from "
                        f"{checkout}: run the install with the interpreter you will run "
                        f"(activate the venv first)")
    # Whole trees: the project's packages (the fix: the checkout), and the venv when
    # there is one (its site-packages is what pip just wrote). The base interpreter's
    # tree is not walked (large, not written by this install): its prefix directories
    # and executable are looked at alone. One line per tree to fix, its first path.
    groups: list[tuple[str, str | None]] = [
        (root, next((b for b in map(stranger_cannot_read, project_packages(root)) if b), None))]
    if sys.prefix != sys.base_prefix:
        groups.append((sys.prefix, stranger_cannot_read(sys.prefix)))
    for top in [*python_dirs(), os.path.realpath(sys.executable)]:
        if not any(_within(top, g) for g, _ in groups):
            groups.append((top, top if os.stat(top).st_mode & 0o005 != 0o005 else None))
    for tree, path in groups:
        if path is not None:
            problems.append(f"{path} is mode {_mode(path)}: the sandboxes' users "
                            f"(trio-control, trio-research) cannot read it, so no worker "
                            f"starts (made under umask 077?): chmod -R go+rX {tree}")
    # The bridge's native module is built by pip with the machine's C compiler, and a
    # failed build does not fail the install (setup.py: optional): `pip install .`
    # without gcc (a slim container) ended rc 0, silent, without
    # supervisor/ipc/_native.*.so, and this check passed. Without it the bridge runs its
    # pure-Python path on x86-64 (about 3x the CPU per message) and refuses to start on
    # any other machine (supervisor/ipc/_atomics.py).
    try:
        import supervisor.ipc._native  # noqa: F401
    except ImportError as e:
        missing, fix = _build_tools_missing()
        why = (f"{' and '.join(missing)} missing." if missing else
               "no C compiler, Python headers or zlib headers when pip built the package?")
        problems.append(f"the bridge's native module supervisor.ipc._native is not built "
                        f"({e}): {why} On x86-64 the bridge then runs its slower "
                        f"pure-Python path, on other machines it refuses to start: "
                        f"{fix or 'apt-get install gcc python3-dev zlib1g-dev'}, then "
                        f"install again")
    # Load every schema in a child: pycapnp aborts the whole process (C++ terminate, no
    # Python exception) when an import directory is not ASCII (2.2.4 cuts the path by
    # its extra UTF-8 bytes), which would otherwise first show as `supervisor check`
    # dying with SIGABRT.
    probe = ("import schemas, pathlib\n"
             "for p in sorted(schemas.SCHEMA_DIR.glob('*.capnp')): schemas.load(p.stem)\n"
             "import supervisor.replay.logfmt\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       errors="replace", cwd="/")
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        hint = ("; its path is not ASCII, which pycapnp 2.2.4 cannot import from: use a "
                "checkout path of ASCII characters" if not root.isascii() else "")
        problems.append(f"the package cannot load its Cap'n Proto schemas from {root} "
                        f"(exit {r.returncode}: {last}){hint}")
    return problems


# --- The machine as the sandboxes need it (`python -m supervisor.startcheck --machine`).
# Two layouts of a container stopped every sandbox with a line per worker that named an
# errno and not the machine: Docker's default seccomp profile (no CAP_SYS_ADMIN) refuses
# a new mount namespace ('sandbox cannot start: OSError: staging mount namespace failed:
# unshare: unshare failed: Operation not permitted', four times for minimal.toml), and a
# read-only /run (`docker run --read-only`) refuses the staging mount point ('OSError:
# [Errno 30] Read-only file system: '/run/trio-staging''; `run` restarted camerad five
# times and failed safe, exit 4). One line each here, saying what to do.

_CONTAINER_CAPS = ("run the container with --privileged, or with --cap-add SYS_ADMIN "
                   "--security-opt seccomp=unconfined --security-opt apparmor=unconfined "
                   "(a development container may instead run `supervisor run --no-sandbox`, "
                   "never the car)")


def staging_needed(cfg: Config) -> bool:
    """Whether root's sandboxes of `cfg` go through the staging mount namespace: a bound
    path the domain user cannot reach (a 0700 home holding the interpreter) or a hidden
    one (a distribution refused in a domain, torch for control: the car's install with
    its research extra). Without either, a read-only /run does not matter (a venv of
    Debian's python3 without torch started all of minimal.toml there)."""
    from supervisor.sandbox.policy import for_worker
    from supervisor.sandbox.staging import reachable_by_stranger

    for w in cfg.workers.values():
        try:
            pol = for_worker(cfg, w)
        except (LookupError, ValueError):     # no domain user: check says so itself
            continue
        if pol.host_uid is None:
            continue
        if pol.hidden or not all(map(reachable_by_stranger,
                                     [*pol.ro_binds, *pol.rw_binds, *pol.dev_binds])):
            return True
    return False


def _mapped(ids: int, map_file: str) -> bool | None:
    """Whether host-side id `ids` of this namespace is mapped in `map_file`
    (/proc/self/uid_map: 'inside outside count' lines); None if unreadable."""
    try:
        with open(map_file) as f:
            ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
    except (OSError, ValueError):
        return None
    return any(inside <= ids < inside + count for inside, _, count in ranges)


def unmapped_domain_users(cfg: Config, proc_self: str = "/proc/self") -> list[str]:
    """'name (uid N)' for each domain user of `cfg` that this root cannot become: root
    only inside a user namespace whose map leaves the user out (`unshare -r`, a rootless
    container without a subordinate id range). There `check` died with a 30-line
    traceback ending 'SubprocessError: Exception occurred in preexec_fn.', and `run`
    restarted camerad 5 times on 'start failed: Exception occurred in preexec_fn.' and
    failed safe. `proc_self` is a fake directory in tests."""
    import pwd

    from supervisor.sandbox.policy import default_user

    out: list[str] = []
    for d in sorted({w.domain for w in cfg.workers.values()}):
        name = cfg.domains[d].user or default_user(d)
        try:
            pw = pwd.getpwnam(name)
        except KeyError:                  # check says that one itself
            continue
        uid = _mapped(pw.pw_uid, f"{proc_self}/uid_map")
        gid = _mapped(pw.pw_gid, f"{proc_self}/gid_map")
        if uid is False or gid is False:
            text = f"{name} (uid {pw.pw_uid}, gid {pw.pw_gid})"
            if text not in out:
                out.append(text)
    return out


def _domain_user(cfg: Config):
    """The passwd entry of the first domain user of `cfg` that exists (check names a
    missing one itself); None when none does."""
    import pwd

    from supervisor.sandbox.policy import default_user

    for d in sorted({w.domain for w in cfg.workers.values()}):
        try:
            return pwd.getpwnam(cfg.domains[d].user or default_user(d))
        except KeyError:
            continue
    return None


def _sysctl(name: str) -> str | None:
    try:
        with open(f"/proc/sys/{name.replace('.', '/')}") as f:
            return f.read().strip()
    except OSError:
        return None


def userns_problem(cfg: Config, unshare: str) -> str | None:
    """Every sandbox's bwrap runs as its domain user with --unshare-user: a kernel that
    refuses user namespaces to unprivileged users (Debian's
    kernel.unprivileged_userns_clone=0, user.max_user_namespaces=0, Ubuntu 24.04's
    AppArmor restriction) refused each one with bwrap's words, and `run` restarted
    camerad six times and latched the fail-safe (review 9 finding 1). Probed as that
    user, `unshare --user true` (os.unshare is Python 3.12); the knob named from the
    errno. None when allowed, or when no domain user exists."""
    import subprocess

    pw = _domain_user(cfg)
    if pw is None:
        return None
    try:
        r = subprocess.run([unshare, "--user", "true"], user=pw.pw_uid, group=pw.pw_gid,
                           extra_groups=[], capture_output=True, text=True,
                           errors="replace", timeout=30, cwd="/",
                           env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError):   # cannot become it: `users` says why
        return None
    if r.returncode == 0:
        return None
    said = " ".join(r.stderr.split())
    persist = " (and persist it in /etc/sysctl.d)"
    if "No space left" in said:
        errno_, fix = "ENOSPC", f"sysctl -w user.max_user_namespaces=15000{persist}"
    elif "not permitted" in said:
        errno_ = "EPERM"
        if _sysctl("kernel.unprivileged_userns_clone") == "0":
            fix = f"sysctl -w kernel.unprivileged_userns_clone=1{persist}"
        elif _sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":
            fix = (f"sysctl -w kernel.apparmor_restrict_unprivileged_userns=0{persist}, "
                   f"or an AppArmor profile for bwrap that allows userns")
        else:
            fix = ("sysctl -w kernel.unprivileged_userns_clone=1 (Debian/Ubuntu kernels) "
                   "or user.max_user_namespaces=15000 (persist it in /etc/sysctl.d); in a "
                   f"container, its seccomp profile refuses them: {_CONTAINER_CAPS}")
    else:
        errno_, fix = said or f"exit {r.returncode}", ("allow unprivileged user namespaces "
                                                       "(user.max_user_namespaces)")
    return (f"user namespaces: the kernel refuses them to the domain users ({pw.pw_name}: "
            f"{errno_}), and every sandbox's bwrap runs as one: {fix}")


def _setuid(path: str) -> bool:
    import stat

    try:
        return bool(os.stat(path).st_mode & stat.S_ISUID)
    except OSError:
        return False


def machine_problems(cfg: Config | None = None) -> list[str]:
    """What on this machine keeps every sandbox of `cfg` (default: the embedded car
    config) from starting, one line each with what to do; [] when nothing does (or when
    not root: only root's supervisor makes the staging mount namespace). Looks only: runs
    `unshare` (as root for a mount namespace, as a domain user for a user namespace) in
    a namespace that ends at once, and creates nothing outside it."""
    import shutil
    import subprocess

    from supervisor.sandbox.staging import BASE

    if os.geteuid() != 0:
        return []
    if cfg is None:
        from supervisor.config import load

        cfg = load(None)
    problems: list[str] = []
    # Every sandbox is a bwrap: without it `check` said "all admitted", exit 0, and
    # `check --start` ended as an internal error (review 9 finding 2).
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        problems.append("bwrap: not installed (or not executable) on PATH, and every "
                        "sandbox is one: apt-get install bubblewrap (or bash "
                        "scripts/install.sh)")
    elif _setuid(bwrap):
        # Older and hardened distributions install it so; it refuses --size (and runs
        # its own privileged code for a domain user): every worker failed with
        # "--size option is not permitted in setuid mode" (review 9 finding 3).
        problems.append(f"bwrap: {bwrap} is setuid root: the sandboxes need the "
                        f"unprivileged one (chmod u-s {os.path.realpath(bwrap)}, with user "
                        f"namespaces on)")
    unshare = shutil.which("unshare")
    if unshare is None:
        problems.append("namespaces: no `unshare` here (the sandboxes' staging mount "
                        "namespace needs it): apt-get install util-linux")
    else:
        r = subprocess.run([unshare, "--mount", "--propagation", "private", "true"],
                           capture_output=True, text=True, errors="replace", timeout=30,
                           env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"})
        if r.returncode != 0:
            said = " ".join(r.stderr.split()) or f"exit {r.returncode}"
            problems.append(f"namespaces: this machine refuses a new mount namespace to root "
                            f"({said}), so no sandbox can start: a container's default "
                            f"seccomp profile without CAP_SYS_ADMIN does this; "
                            f"{_CONTAINER_CAPS}")
    users = unmapped_domain_users(cfg)
    if users:
        problems.append(f"users: this root is root only inside a user namespace whose id "
                        f"map leaves out {', '.join(users)}, so no sandbox can switch to its "
                        f"domain's user: run as real root, or give the rootless container "
                        f"a subordinate id range that holds them (/etc/subuid, /etc/subgid)")
    elif unshare is not None and not any(p.startswith("namespaces:") for p in problems):
        # (a machine that refuses root a mount namespace refuses the rest too: one line)
        userns = userns_problem(cfg, unshare)
        if userns:
            problems.append(userns)
    parent = os.path.dirname(BASE)
    if (not os.path.isdir(BASE) and not os.access(parent, os.W_OK)
            and staging_needed(cfg)):
        why = ("read-only" if os.path.isdir(parent) else "missing")
        problems.append(f"staging: {parent} is {why}, so the sandboxes' staging mount point "
                        f"{BASE} cannot be made: give the machine a writable {parent} "
                        f"(docker run --tmpfs {parent}), or make the empty directory "
                        f"{BASE} in the image")
    return problems


def main(argv: list[str] | None = None) -> int:
    """``python -m supervisor.startcheck --installed [--checkout DIR]``: the install's
    last step. Exit 0, or 2 with one line per problem on stderr. ``--machine``: this
    machine's `machine_problems`, exit 5 (as a sandbox that cannot start) when any."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m supervisor.startcheck")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--installed", action="store_true",
                      help="check the installation as the sandboxes will see it")
    what.add_argument("--machine", action="store_true",
                      help="check this machine (a container?) lets sandboxes start")
    p.add_argument("--checkout", default=None,
                   help="the checkout an editable install must import from")
    p.add_argument("--config", default=None,
                   help="with --machine: the config to judge for (default: the embedded one)")
    args = p.parse_args(argv)
    if args.machine:
        from supervisor.config import ConfigError, load

        try:
            cfg = load(args.config)
        except ConfigError as e:          # as `supervisor check` says them
            for line in getattr(e, "problems", None) or [str(e)]:
                print(f"machine: {line}", file=sys.stderr)
            return int(Exit.CONFIG)
        lines = machine_problems(cfg)
        for line in lines:
            print(f"machine: {line}", file=sys.stderr)
        return int(Exit.START_FAILED) if lines else 0
    problems = install_problems(args.checkout)
    for line in problems:
        print(f"install: {line}", file=sys.stderr)
    return int(Exit.CONFIG) if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
