"""`audit --live`: inspect the system that is running, read-only, without starting a
second one (a second full system doubled the load, and the running pipeline missed
deadlines while it ran).

How the running system is found: every sandbox is a bubblewrap process whose parent is
the supervisor, and bwrap's own command line carries what the supervisor gave the
sandbox (``--setenv TRIO_WORKER camerad``, ``--setenv TRIO_BRIDGE_ROAD_FRAMES {handle:
role, reader index, fd numbers}``, ``--setenv TRIO_STATUS_FD N``, ``TRIO_STANDBY_FD``
for a warm standby). bwrap keeps inherited fds at their numbers, so each handle's fds
can be looked up in the worker's /proc/PID/fd and fdinfo: which segment or lease table
each is, with which access, and how it is mapped; the status fd's pipe is matched with
the supervisor's own fds. The worker itself is pid 2 of its sandbox's pid namespace
(`sandbox.launch.sandbox_main_pid`). Limits in force come from the cgroup the worker is
in (/proc/PID/cgroup). Nothing is written, signalled or started; as root, /proc is read
directly (or as the sandbox's host user, audit/asuser.py, without CAP_SYS_PTRACE).

What cannot be seen from outside is said, not guessed: the supervisor's exec-watch
state (whether a worker has passed READY) lives in its memory; the audit infers the
watch from the worker's stacked filters and from the worker NOT holding a seccomp
listener itself, and says so (``exec_watch.inferred``).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from supervisor.ipc.channel import ENV_PREFIX
from supervisor.protocol import ENV_NAME, ENV_STANDBY_FD, ENV_STATUS_FD

from . import evidence as ev

Progress = Callable[[str], None]


@dataclass
class Sandbox:
    worker: str
    bwrap_pid: int
    standby: bool
    env: dict[str, str]                     # its --setenv pairs
    pid: int | None = None                  # the worker (pid 2 inside)


@dataclass
class RunningSupervisor:
    pid: int
    argv: list[str]
    cwd: str
    config: str | None                      # --config as given, resolved against cwd
    sandboxes: list[Sandbox] = field(default_factory=list)

    @property
    def state_dir(self) -> str | None:
        """TRIO_STATE_DIR as the supervisor got it (None: its config's state_dir)."""
        return (_environ(self.pid) or {}).get("TRIO_STATE_DIR")

    @property
    def environ_readable(self) -> bool:
        return _environ(self.pid) is not None


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return []


def _environ(pid: int) -> dict[str, str] | None:
    """Its environment at start, or None when this process may not read it (a smaller
    capability set than the target's: /proc/PID/environ needs ptrace-read access)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return None
    return dict(i.decode(errors="replace").partition("=")[::2] for i in items if b"=" in i)


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def _setenv(argv: list[str]) -> dict[str, str]:
    out = {}
    for i, a in enumerate(argv):
        if a == "--":
            break
        if a == "--setenv" and i + 2 < len(argv):
            out[argv[i + 1]] = argv[i + 2]
    return out


def _config_arg(argv: list[str], cwd: str) -> str | None:
    for i, a in enumerate(argv):
        if a in ("--config", "-c") and i + 1 < len(argv):
            return os.path.join(cwd, argv[i + 1])
        if a.startswith("--config="):
            return os.path.join(cwd, a.split("=", 1)[1])
    return None


def is_supervisor_run(argv: list[str]) -> bool:
    """``supervisor run`` or ``python -m supervisor.cli run`` (whatever the path)."""
    joined = " ".join(argv)
    return "run" in argv and ("supervisor.cli" in joined or any(
        os.path.basename(a) == "supervisor" for a in argv[:2]))


def supervisor_uids() -> set[int]:
    """The uids a vehicle's supervisor runs as: root, and trio-supervisor (the split
    units' supervisor proper) where that user exists."""
    import pwd

    uids = {0}
    try:
        uids.add(pwd.getpwnam("trio-supervisor").pw_uid)
    except KeyError:
        pass
    return uids


def process_uid(pid: int) -> int | None:
    """`pid`'s effective uid from /proc/PID/status; None if gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        pass
    return None


def run_by_supervisor_user(pid: int) -> bool:
    """Whether `pid` runs as a user a vehicle's supervisor runs as: any local user can
    start a process whose command line reads `supervisor.cli run` (review 9 findings
    10-11: `nobody`'s sleeping python3 refused root's `check --start`, and its argv,
    escape sequences and all, reached the operator's terminal)."""
    return process_uid(pid) in supervisor_uids()


def _segments(pid: int) -> ev.Segments:
    """The channel segments of the supervisor `pid` stands for: its own, and, when it is
    a broker (which hands the segments on and keeps none), those of the `supervisor
    run` processes of this host's pid namespace (its --privsep parent, or the split
    units' proper): under --privsep the live audit saw no channel at all (review)."""
    known = ev.segments_of(pid)
    if known:
        return known
    here = os.readlink("/proc/self/ns/pid")
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == pid:
            continue
        try:
            if os.readlink(f"/proc/{name}/ns/pid") != here:
                continue                       # inside a sandbox: never a supervisor
        except OSError:
            continue
        argv = _cmdline(int(name))
        if argv and is_supervisor_run(argv):
            try:
                known.update(ev.segments_of(int(name)))
            except ev.Gone:
                continue
    return known


def find_supervisors() -> list[RunningSupervisor]:
    """Every running supervisor: the parents of sandboxes, and ``supervisor run``
    processes that have none (yet)."""
    found: dict[int, RunningSupervisor] = {}
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        argv = _cmdline(pid)
        if not argv:
            continue
        parent = None
        if os.path.basename(argv[0]) == "bwrap":
            env = _setenv(argv)
            if ENV_NAME not in env:
                continue
            parent = _ppid(pid)
            if parent is None:
                continue
            pargv = _cmdline(parent)
            if pargv and os.path.basename(pargv[0]) == "bwrap":
                continue          # the sandbox's init, bwrap's own child: not a sandbox
            rs = found.get(parent) or _supervisor(parent)
            if rs is None:
                continue
            found[parent] = rs
            rs.sandboxes.append(Sandbox(env[ENV_NAME], pid, ENV_STANDBY_FD in env, env))
        elif is_supervisor_run(argv) and pid not in found:
            rs = _supervisor(pid)
            if rs is not None:
                found[pid] = rs
    for rs in found.values():
        rs.sandboxes.sort(key=lambda s: (s.worker, s.standby))
    return sorted(found.values(), key=lambda r: r.pid)


def vehicle_supervisors() -> list[RunningSupervisor]:
    """The running ``supervisor run``s that drive a vehicle: the one rule every command
    that would start a second pipeline beside them applies (``audit --live --start``,
    ``check --start``: review 7 finding 10, a check started its own cameras and a
    SCHED_FIFO controlsd beside the car's). A test or bench run is not one: a process
    holding a Supervisor in-process (not ``supervisor run``), a config in simulation
    mode, or a ``TRIO_STATE_DIR`` pointed elsewhere (the vehicle's run latches its
    config's state dir), or a process of any user but root or trio-supervisor (whose
    unreadable "config" was taken for the worst case). An environment this process may
    not read (a smaller capability set than the supervisor's) cannot be told: not
    counted."""
    from supervisor.config import ConfigError, load

    out = []
    for rs in find_supervisors():
        if not is_supervisor_run(rs.argv) or not run_by_supervisor_user(rs.pid):
            continue
        try:
            mode = load(rs.config).supervisor.mode
        except ConfigError:
            mode = "vehicle"          # unreadable: assume the worst
        if mode == "vehicle" and rs.environ_readable and rs.state_dir is None:
            out.append(rs)
    return out


def _supervisor(pid: int) -> RunningSupervisor | None:
    argv = _cmdline(pid)
    if not argv:
        return None
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        cwd = "/"
    return RunningSupervisor(pid, argv, cwd, _config_arg(argv, cwd))


# --------------------------------------------------------------------------- evidence


def _fd_info(pid: int, fd: int) -> dict[str, Any] | None:
    """{target, access, flags} of one fd of ``pid``, or None when it is not open."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        info = ev._read(f"/proc/{pid}/fdinfo/{fd}")
    except (OSError, ev.Gone):
        return None
    flags = next((int(line.split()[1], 8) for line in info.splitlines()
                  if line.startswith("flags:")), 0)
    access = {os.O_RDONLY: "O_RDONLY", os.O_WRONLY: "O_WRONLY",
              os.O_RDWR: "O_RDWR"}.get(flags & os.O_ACCMODE, "?")
    return {"target": target, "access": access, "nonblock": bool(flags & os.O_NONBLOCK)}


def _fd_targets(pid: int) -> dict[str, list[dict[str, Any]]]:
    """target ("pipe:[123]", "anon_inode:...") -> [{fd, access}] of every fd of pid."""
    out: dict[str, list[dict[str, Any]]] = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        i = _fd_info(pid, int(fd))
        if i is not None:
            out.setdefault(i["target"], []).append({"fd": int(fd), "access": i["access"],
                                                    "nonblock": i["nonblock"]})
    return out


def cgroup_in_force(pid: int) -> dict[str, Any] | None:
    """The limits in force for the cgroup ``pid`` is in (sandbox.cgroups' reader)."""
    from supervisor.sandbox.cgroups import CONTROLLERS, WorkerCgroup

    try:
        lines = ev._read(f"/proc/{pid}/cgroup").splitlines()
        mounts = ev._read("/proc/self/mountinfo").splitlines()
    except (OSError, ev.Gone):
        return None
    own: dict[str, str] = {}
    v2 = None
    for ln in lines:
        _id, ctrls, path = ln.split(":", 2)
        if ctrls == "":
            v2 = path
        for c in ctrls.split(","):
            own[c] = path
    v1_mount: dict[str, tuple[str, str]] = {}
    v2_mount = None
    for ln in mounts:
        pre, _, post = ln.partition(" - ")
        f, p = pre.split(), post.split()
        if len(p) >= 3 and p[0] == "cgroup":
            for c in p[2].split(","):
                v1_mount.setdefault(c, (f[4], f[3]))
        elif len(p) >= 1 and p[0] == "cgroup2" and v2_mount is None:
            v2_mount = (f[4], f[3])
    dirs: dict[str, str] = {}
    if all(c in own and c in v1_mount and own[c] not in ("", "/") for c in CONTROLLERS):
        version = 1
        for c in CONTROLLERS:
            mp, root = v1_mount[c]
            path = own[c][len(root):] if root != "/" and own[c].startswith(root) else own[c]
            dirs[c] = os.path.normpath(f"{mp}/{path}")
    elif v2 is not None and v2_mount is not None:
        version = 2
        dirs = {c: os.path.normpath(f"{v2_mount[0]}/{v2}") for c in CONTROLLERS}
    else:
        return None
    try:
        cg = WorkerCgroup.existing(version, {c: dirs[c] for c in CONTROLLERS}, CONTROLLERS)
        force = cg.in_force()
        force["member"] = pid in cg.pids()
    except OSError as e:
        return {"error": str(e)}
    return force


def _handles(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    out = {}
    for k, v in env.items():
        if k.startswith(ENV_PREFIX):
            try:
                out[k[len(ENV_PREFIX):].lower()] = json.loads(v)
            except ValueError:
                continue
    return out


def sandbox_evidence(sb: Sandbox, promise: dict[str, Any], candidates: list[str],
                     inherited: int, known: ev.Segments) -> dict[str, Any]:
    """The same evidence `live._worker_evidence` reads through a Supervisor object,
    read here from /proc alone."""
    from supervisor.admission import maps
    from supervisor.sandbox.launch import descendant_pids, sandbox_main_pid

    pids = descendant_pids(sb.bwrap_pid)
    pid = sandbox_main_pid(pids)
    if pid is None:
        return {"running": False, "why": "sandbox has no worker process (yet)"}
    sb.pid = pid
    try:
        begun = maps.start_time(pid)
    except maps.ProcessGone as e:
        raise ev.Gone(pid) from e
    st = ev.status(pid)
    entries = ev.maps(pid)
    fds = _fd_targets(pid)
    holds_listener = any("seccomp" in t for t in fds)
    filters = max(0, int(st.get("Seccomp_filters") or 0) - inherited)
    out: dict[str, Any] = {
        "running": True, "pid": pid, "sandbox_pids": [sb.bwrap_pid, *pids],
        "status": {k: st.get(k) for k in ("Uid", "Gid", "NoNewPrivs", "Seccomp",
                                          "Seccomp_filters", *ev._CAP_FIELDS)},
        "uid_map": ev.id_map(pid, "uid"), "gid_map": ev.id_map(pid, "gid"),
        "namespaces": ev.namespaces(pid), "interfaces": ev.interfaces(pid),
        "nofile": list(ev.nofile(pid)), "scheduling": ev.scheduling(pid),
        "exec_mappings": ev.exec_mappings(entries),
        "channel_mappings": ev.channel_mappings(entries, known),
        "channel_fds": ev.channel_fds(pid, known),
        "compilers": ev.compiler_probe(pid, candidates),
        # Inferred: the exec watch is the third stacked filter and its listener went to
        # the supervisor (a worker holding it could approve its own requests). Whether
        # the supervisor has seen READY is its own memory, not readable from here.
        "exec_watch": {"listener_held": filters >= 3 and not holds_listener,
                       "closed_at_ready": True, "ready_snapshot": None, "inferred": True,
                       "worker_holds_listener": holds_listener},
        "handles": _handles(sb.env),
        "status_fd": sb.env.get(ENV_STATUS_FD),
        "fds": fds,
    }
    try:
        hits = maps.scan_pid(pid)
    except maps.ProcessGone as e:
        raise ev.Gone(pid) from e
    out["forbidden_libraries"] = [h.describe() for h in hits]
    out["after_ready_hits"] = []
    out["cgroup"] = cgroup_in_force(pid)
    out["models"] = [{"artifact": m.get("artifact"),
                      "manifest_sha256": ev.file_sha256_in_root(
                          pid, os.path.join(m["artifact"], "manifest.json"))
                      if m.get("artifact") else None,
                      "pubkey_sha256": ev.file_sha256_in_root(pid, m["pubkey"])
                      if m.get("pubkey") else None}
                     for m in promise.get("models", [])]
    from .fsview import mountinfo

    out["mounts"] = mountinfo(pid)
    if maps.start_time(pid) != begun:
        raise ev.Gone(pid)
    return out


def _read_as_owner(fn, sb: Sandbox, *args):
    """``fn`` as root, or as the sandbox's host user without CAP_SYS_PTRACE."""
    from . import asuser

    if asuser.can_read_any_proc():
        return fn(sb, *args)
    try:
        uid, gid = asuser.host_ids(sb.bwrap_pid)
    except OSError:
        uid = 0
    return fn(sb, *args) if uid == 0 else asuser.as_host_user(uid, gid, fn, sb, *args)


def collect(rs: RunningSupervisor, promises: dict[str, dict[str, Any]],
            progress: Progress) -> dict[str, Any]:
    """Evidence of every sandbox of ``rs`` (the shape `live.run_live` returns)."""
    from .live import host_namespaces

    candidates = ev.compiler_candidates()
    sup_status = ev.status(rs.pid)
    inherited = int(sup_status.get("Seccomp_filters") or 0)
    known = _segments(rs.pid)           # the channels' segments, told by file
    workers: dict[str, Any] = {}
    for sb in rs.sandboxes:
        progress(f"reading {sb.worker}{' (standby)' if sb.standby else ''}, sandbox "
                 f"{sb.bwrap_pid}")
        e = None
        for _attempt in range(3):
            try:
                e = _read_as_owner(sandbox_evidence, sb, promises.get(sb.worker, {}),
                                   candidates, inherited, known)
                break
            except ev.Gone:
                e = {"running": False, "why": "exited while being read"}
        if sb.standby:         # a worker may have several (one starting at a time)
            if sb.worker in workers and e.get("running"):
                workers[sb.worker].setdefault("standbys", []).append(e)
                workers[sb.worker].setdefault("standby", e)
            continue
        workers[sb.worker] = e
    host = {"supervisor": ev.namespaces(rs.pid)}
    init = host_namespaces().get("init")
    if init:
        host["init"] = init
    return {"outcome": "started", "exit_code": 0, "events": [], "cgroups": None,
            "survivors": {}, "host": host, "workers": workers,
            "compiler_candidates": candidates, "inherited_seccomp_filters": inherited,
            "supervisor_pid": rs.pid,
            "supervisor_fds": _fd_targets(rs.pid),
            "supervisor_channel_mappings": ev.channel_mappings(ev.maps(rs.pid), known),
            "supervisor_nofile": list(ev.nofile(rs.pid))}


def terminal_progress() -> Progress:
    """Progress lines on stderr when it is a terminal; silent otherwise."""
    if not sys.stderr.isatty():
        return lambda msg: None
    return lambda msg: print(f"audit: {msg}", file=sys.stderr, flush=True)
