"""systemd unit for the supervisor, generated from the config, for the install target.

One unit runs the supervisor; the supervisor runs the workers in their own sandboxes
(systemd cannot express the per-worker bubblewrap + seccomp + fd hand-off). The unit
adds what systemd does best around it: notify/watchdog, a restart policy that does not
loop on a bad config, an admission refusal or a latched fail-safe, resource caps, a
delegated cgroup subtree, and every hardening option that still lets the supervisor do
its root work and bubblewrap build its sandboxes.

The interpreter is the install target's, never the developer's: ``--prefix`` (a venv,
default `DEFAULT_PREFIX`, ExecStart uses PREFIX/bin/python3) or ``--python``.

What the supervisor needs, and so what the unit cannot take away (each measured by
running ``supervisor audit --live`` under these restrictions, see tests/test_units.py):

* root (User=root), with exactly these capabilities, each shown necessary by taking it
  away: CAP_SETUID/CAP_SETGID (a sandbox drops to its domain's host user between fork
  and exec), CAP_SYS_ADMIN (the staging mount namespace: ``unshare`` fails with EPERM;
  /proc/PID/map_files), CAP_SYS_CHROOT (setns into the staging mount namespace: every
  start fails in the pre-exec step), CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH (the
  workers' /proc: without either the exec watch "cannot inspect" the first mmap of a
  control worker, whose /proc/PID/fd is mode 0500 and owned by its domain user, and
  refuses it), CAP_KILL (an orderly stop fails with EPERM and leaves the sandboxes of
  other uids running);
* its own cgroup writable (Delegate=yes): ProtectControlGroups=yes makes the cgroup
  file system read-only and ReadWritePaths= gives back exactly the unit's own cgroup
  (`unit_cgroup`), where the supervisor parks itself in ``supervisor/`` and makes one
  leaf per worker run (supervisor/sandbox/cgroups.py, v2);
* user, pid, net, mnt, ipc, uts and cgroup namespaces for bwrap, and the mount family of
  system calls (bwrap, the staging helper);
* a /proc that a user namespace may mount again: ProtectKernelTunables=,
  ProtectKernelLogs= and ProcSubset=pid cover parts of /proc with mounts, after which
  the kernel refuses bwrap's ``--proc`` (EPERM; measured); ProtectProc=invisible is fine;
* sethostname inside the sandbox's UTS namespace: ProtectHostname= forbids it by seccomp;
* AF_NETLINK besides AF_UNIX: bwrap brings up the loopback interface of each new network
  namespace over rtnetlink, and fails without it (measured);
* UMask=0022: the staging helper's directories (the filtered site-packages views) are
  created under the supervisor's umask, and with 0077 the domain users cannot traverse
  them (every control worker then fails to start; measured).

The exposure score (``systemd-analyze security``, systemd 252). It is
ceil(100 * sum(weight * badness / range) / sum(weight)) / 10 over 78 checks, sum(weight)
= 56135 for a root service (56435 otherwise), so 1.0 allows at most 5613 points of
exposure. This unit has 18085 (3.3); `EXPOSURE` names every item and what pays for it.
Hosting these sandboxes alone costs 8185 (1.5): the seven namespace types 4100, @mount
1000, @privileged 700 (capset, pivot_root, sethostname), ProtectKernelTunables= and
ProtectKernelLogs= off 2000 (bwrap's --proc), MemoryDenyWriteExecute= off 100 (modeld's
kernels; the filter is inherited), AF_NETLINK/AF_UNIX 225, ProtectHostname= 50, ProcSubset=
10. So no unit that runs bwrap --proc sandboxes inside itself reaches 1.0, root or not;
the 1.0 measured for "a unit that runs bubblewrap" (only user/mnt/pid namespaces, no
capabilities, ProtectKernel*=yes) is a score for a unit whose bwrap could not mount
/proc. The supervisor's own part is 9900: root 2000, CAP_SETUID/SETGID 1500, SYS_ADMIN
1500, SYS_PTRACE 1500, DAC_READ_SEARCH 1000, KILL 500, SYS_CHROOT 50, PrivateUsers= off
1000 (the host users must exist in its user namespace), DeviceAllow=char-rtc 500 (added by
ProtectClock=yes, which is worth 1000), RootDirectory= 200, Delegate= 100, UMask= 50.

What would lower it (measured with variants of this unit): a thread that takes a
sandbox's host uid as its effective uid reads its /proc and signals it with only
CAP_SETUID/CAP_SETGID (+ CAP_CHECKPOINT_RESTORE for map_files, which systemd does not
score; supervisor/audit/asuser.py, tests/test_units.py). With the exec watch, maps scan
and stop doing that, and the staging namespace replaced by bwrap-level hiding (a vehicle
install is world-readable under /opt), the bounding set is CAP_SETUID CAP_SETGID
CAP_CHECKPOINT_RESTORE: 2.5; as a non-root User= with those as ambient capabilities: 2.2.
Below 1.5 only by moving the sandboxes out of this unit: a supervisor unit that hosts
none (no capabilities, PrivateUsers=yes, no namespaces, @mount/@privileged denied,
ProtectKernel*=yes) scores 0.2.

The split (issue 27, supervisor/broker, docs/broker.md) renders three more units beside
this one (`write_split_units`; phase 2 makes them the install): `trio-broker.socket`
(SOCK_SEQPACKET, root:trio-supervisor 0660), `trio-broker.service`, the sandbox host
with this unit's capabilities and exposure (3.3, `EXPOSURE`) and none of the
supervisor's own work, and `trio-supervisor-proper.service`, which parses everything
hostile as trio-supervisor with no capabilities, no namespaces, PrivateUsers=yes and
AF_UNIX only: 0.2 (`PROPER_EXPOSURE` names the three items left).
"""
from __future__ import annotations

import os
from pathlib import Path

from supervisor.config import Config
from supervisor.exits import Exit
from supervisor.sandbox.sched import OOM_SCORE_ADJ

DEFAULT_PREFIX = "/opt/trio-supervisor"   # python3 -m venv; pip install '<pkg>[research]'
UNIT_NAME = "trio-supervisor.service"
# The split of issue 27 (supervisor/broker, docs/broker.md): rendered beside the one unit
# of today until phase 2 switches over.
BROKER_UNIT = "trio-broker.service"
BROKER_SOCKET_UNIT = "trio-broker.socket"
PROPER_UNIT = "trio-supervisor-proper.service"
SPLIT_UNITS = (BROKER_SOCKET_UNIT, BROKER_UNIT, PROPER_UNIT)
SUPERVISOR_USER = "trio-supervisor"      # the supervisor proper: no capabilities
BROKER_SOCKET = "/run/trio-broker/broker.sock"
SLICE = "system.slice"
CGROUP_MOUNT = "/sys/fs/cgroup"

CAPABILITIES = ("CAP_SETUID", "CAP_SETGID", "CAP_SYS_ADMIN", "CAP_SYS_CHROOT",
                "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_KILL")
NAMESPACES = ("user", "pid", "net", "mnt", "ipc", "uts", "cgroup")
# Denied with EPERM for the supervisor and everything below it (the workers' own filters
# stack on top). Not denied, because bwrap or the supervisor needs them: @mount,
# @privileged (setresuid, setgroups, capset, pivot_root, sethostname), @process (clone
# with namespace flags, unshare, setns), seccomp, landlock_*.
SYSCALL_DENY = ("@clock", "@cpu-emulation", "@debug", "@keyring", "@module", "@obsolete",
                "@raw-io", "@reboot", "@resources", "@swap", "bpf", "userfaultfd",
                "io_uring_setup", "io_uring_enter", "io_uring_register")
# A config with real-time workers (``realtime_priority``): the supervisor makes their
# main threads SCHED_FIFO at READY (supervisor/sandbox/sched.py), which takes
# CAP_SYS_NICE, RestrictRealtime=no and sched_setscheduler out of @resources (the rest of
# @resources stays denied). The workers themselves never get any of it.
REALTIME_CAPABILITY = "CAP_SYS_NICE"
RESOURCES_BUT_SCHED = ("ioprio_set", "mbind", "migrate_pages", "move_pages", "nice",
                       "sched_setaffinity", "sched_setattr", "sched_setparam",
                       "set_mempolicy", "set_mempolicy_home_node", "setpriority", "setrlimit")
REALTIME_EXPOSURE: dict[str, str] = {
    "CapabilityBoundingSet=~CAP_SYS_(NICE|RESOURCE)": "CAP_SYS_NICE: SCHED_FIFO for the "
                                                      "real-time workers",
    "RestrictRealtime=": "the real-time workers' SCHED_FIFO",
    "SystemCallFilter=~@resources": "sched_setscheduler (the rest of @resources is denied)",
}
_HOMES = ("/root", "/home", "/run/user")

# Every check `systemd-analyze security` still marks exposed on the generated unit, and
# why it cannot be closed (tests/test_units.py fails on any other). Weights are systemd
# 252's; "bwrap" = needed to run the sandboxes inside the unit at all.
EXPOSURE: dict[str, str] = {
    "User=/DynamicUser=": "2000: root; the supervisor switches to the domain users, makes "
                          "cgroups and the staging namespace, and reads other uids' /proc",
    "PrivateUsers=": "1000: trio-control/trio-research must be mapped to start sandboxes as them",
    "CapabilityBoundingSet=~CAP_SET(UID|GID|PCAP)": "1500: drop to the domain's host user",
    "CapabilityBoundingSet=~CAP_SYS_ADMIN": "1500: the staging mount namespace",
    "CapabilityBoundingSet=~CAP_SYS_PTRACE": "1500: the exec watch and maps scan read "
                                             "other uids' /proc/PID",
    "CapabilityBoundingSet=~CAP_(DAC_*|FOWNER|IPC_OWNER)": "1000: CAP_DAC_READ_SEARCH, "
                                                           "/proc/PID/fd of other uids (0500)",
    "CapabilityBoundingSet=~CAP_KILL": "500: stop sandboxes running as other uids",
    "CapabilityBoundingSet=~CAP_SYS_CHROOT": "50: setns into the staging mount namespace",
    "RestrictNamespaces=~user": "1500: bwrap",
    "RestrictNamespaces=~mnt": "500: bwrap and the staging namespace",
    "RestrictNamespaces=~pid": "500: bwrap",
    "RestrictNamespaces=~net": "500: bwrap (each worker its own network namespace)",
    "RestrictNamespaces=~ipc": "500: bwrap",
    "RestrictNamespaces=~cgroup": "500: bwrap",
    "RestrictNamespaces=~uts": "100: bwrap",
    "SystemCallFilter=~@mount": "1000: bwrap (mount, pivot_root) and the staging namespace",
    "SystemCallFilter=~@privileged": "700: bwrap (capset, pivot_root, sethostname), setresuid",
    "ProtectKernelTunables=": "1000: covering /proc/sys makes the kernel refuse bwrap's --proc",
    "ProtectKernelLogs=": "1000: covering /proc/kmsg makes the kernel refuse bwrap's --proc",
    "ProcSubset=": "10: subset=pid makes the kernel refuse bwrap's --proc",
    "ProtectHostname=": "50: bwrap --hostname (sethostname in the sandbox's UTS namespace)",
    "RestrictAddressFamilies=~AF_NETLINK": "200: bwrap brings lo up in each network namespace",
    "RestrictAddressFamilies=~AF_UNIX": "25: channels' wake-ups, status and exec-watch sockets",
    "MemoryDenyWriteExecute=": "100: inherited by modeld, whose verified kernels become "
                               "executable after they are written",
    "DeviceAllow=": "500: char-rtc r, which ProtectClock=yes adds (worth 1000)",
    "Delegate=": "100: one cgroup per worker run",
    "RootDirectory=/RootImage=": "200: the host's /usr and the install prefix are bound "
                                 "into every sandbox",
    "UMask=": "50: the domain users read the staging views (0022)",
}
_DEFAULT_NOFILE_HARD = 524288     # systemd's default hard RLIMIT_NOFILE for services


def target_python(python: str | None = None, prefix: str | None = None) -> str:
    """The install target's interpreter: ``python`` as given, else PREFIX/bin/python3.
    A relative path is made absolute (systemd refuses `ExecStart=venv/bin/python3`:
    "Neither a valid executable name nor an absolute path"); a bare name stays one."""
    if python:
        return os.path.abspath(python) if "/" in python else python
    return os.path.join(os.path.abspath(prefix or DEFAULT_PREFIX), "bin", "python3")


def unit_cgroup(unit: str = UNIT_NAME) -> str:
    """The unit's own cgroup on the vehicle (cgroup v2, the unit in `SLICE`): the one
    directory of the cgroup file system the supervisor (or the broker) may write."""
    return f"{CGROUP_MOUNT}/{SLICE}/{unit}"


# The v1 controllers the supervisor writes (sandbox/cgroups.py: memory, pids, cpu;
# cpuacct is mounted with cpu on most machines).
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")


def _v1_hierarchies(mountinfo: str = "/proc/self/mountinfo") -> dict[str, str]:
    """controller -> mount point of each cgroup v1 hierarchy in this machine's
    mountinfo (`cpu` -> `/sys/fs/cgroup/cpu,cpuacct` where they share one)."""
    from supervisor.sandbox.cgroups import v1_hierarchies

    try:
        with open(mountinfo) as f:
            return {c: m[0] for c, m in v1_hierarchies(f.read()).items()}
    except OSError:
        return {}


def v1_mounts(mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """Mount points of the cgroup v1 hierarchies holding V1_CONTROLLERS, each once."""
    found = _v1_hierarchies(mountinfo)
    return list(dict.fromkeys(found[c] for c in sorted(V1_CONTROLLERS) if c in found))


def v1_rt_lines(cfg: Config, unit: str) -> list[str]:
    """On a v1 machine with RT group scheduling (the cpu hierarchy has
    cpu.rt_runtime_us), systemd makes system.slice and the unit's cpu cgroup with no RT
    runtime, and a child's budget must fit its parent's: the supervisor's reservation
    failed (EINVAL) and controlsd ran in the normal class (review 9 finding 6). Before
    the start, with full privileges (`+`; `-`: a refusal only costs real-time, which
    the supervisor then reports), each of the two is raised to the share the supervisor
    reserves (`_reserve_realtime`: every budget plus the largest, at most 90 %) of its
    own period, never lowered. [] elsewhere (v2; no RT groups; no RT worker)."""
    budgets = [w.realtime().budget_pct for w in cfg.workers.values()
               if w.realtime_priority is not None]
    cpu = _v1_hierarchies().get("cpu")
    if (not budgets or cpu is None or os.path.exists(f"{CGROUP_MOUNT}/cgroup.controllers")
            or not os.path.exists(f"{cpu}/cpu.rt_runtime_us")):
        return []
    pct = min(sum(budgets) + max(budgets), 90)
    dirs = f"{cpu}/{SLICE} {cpu}/{SLICE}/{unit}"
    script = (f"for d in {dirs}; do p=$$(cat $$d/cpu.rt_period_us) || exit 1; "
              f"r=$$((p / 100 * {pct})); [ $$(cat $$d/cpu.rt_runtime_us) -ge $$r ] || "
              f"echo $$r > $$d/cpu.rt_runtime_us || exit 1; done")
    return [f"# cgroup v1 RT groups ({cpu}): {pct} % of a CPU for the real-time workers",
            f"ExecStartPre=-+/bin/sh -c {_quoted(script.replace('%', '%%'))}"]


def unit_cgroups(unit: str = UNIT_NAME) -> list[str]:
    """Every directory of the cgroup file system the unit may write: `unit_cgroup`,
    and on a v1 (hybrid or legacy) machine the unit's cgroup in each hierarchy the
    supervisor writes (review 9 finding 6: with the v2 path only, ProtectControlGroups=
    left every v1 hierarchy read-only: no memory, pids or cpu limit for any worker and
    no RT budget). Judged where `units` runs: the car itself."""
    paths = [unit_cgroup(unit)]
    if not os.path.exists(f"{CGROUP_MOUNT}/cgroup.controllers"):
        paths += [f"{m}/{SLICE}/{unit}" for m in v1_mounts()]
    return paths


def exec_word(arg: str, *, command: bool = False) -> str:
    """One argument of ExecStart= as systemd reads it back: `%` starts a specifier even
    inside quotes (doubled), and so does `$` a variable in the arguments after the
    command (doubled there; systemd leaves the command's own `$$` as two); a space, a
    quote, a backslash or `;` needs double quotes with C escapes. An install prefix or
    config path with a space in it (`/opt/trio sup`) otherwise became ExecStart=/opt/trio,
    "not executable"."""
    arg = arg.replace("%", "%%")
    return _quoted(arg if command else arg.replace("$", "$$"))


def path_word(path: str) -> str:
    """One entry of a path-list setting (ReadWritePaths=, with its `-` prefix inside):
    specifiers expand there too, variables do not."""
    return _quoted(path.replace("%", "%%"))


def _quoted(word: str) -> str:
    if word and not any(c in word for c in " \t\n\"'\\;"):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _text(value: str) -> str:
    """Free text (Description=): only specifiers are special."""
    return value.replace("%", "%%")


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def _reached(py: str, conf_file: str | None) -> list[str]:
    """What the unit must reach to start: the interpreter and what it links to (a venv's
    bin/python3 is a link to the interpreter it was made from), the base interpreter a
    venv names in its pyvenv.cfg (a `--copies` venv's binary is its own, its stdlib and
    libpython are the base's: under ProtectHome=yes it silently ran the system's
    Python, review 6 finding 3), and the config."""
    paths = [p for p in (py, conf_file, _venv_home(py)) if p]
    return paths + [os.path.realpath(p) for p in paths if os.path.isabs(p)]


def _venv_home(py: str) -> str | None:
    """The `home =` of the venv `py` belongs to (its base interpreter's bin), if any."""
    if not os.path.isabs(py):
        return None
    try:
        with open(os.path.join(os.path.dirname(os.path.dirname(py)), "pyvenv.cfg")) as f:
            for line in f:
                key, _, value = line.partition("=")
                if key.strip() == "home" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return None


def _in_home(py: str, conf_file: str | None) -> bool:
    """ProtectHome=read-only instead of yes: something the unit starts from is in a
    home. Judged from the link's target too: a venv in /opt made from pyenv's
    interpreter (/root/.pyenv/...) dangled under ProtectHome=yes (203/EXEC), while
    systemd-analyze verify, which builds no namespace, was clean."""
    return any(_under(p, _HOMES) for p in _reached(py, conf_file))


# Every place the units' own namespace makes new at each start, and the setting that
# does it (both units set both): a path there is gone, or empty, at the next start.
_MADE_NEW = {"/tmp": "PrivateTmp=yes", "/var/tmp": "PrivateTmp=yes",
             "/dev": "PrivateDevices=yes"}       # /dev/shm: a fresh tmpfs (red team 11 row 3)


def _made_new(path: str) -> tuple[str, str] | None:
    """(the place, the unit setting) when `path`, as written or resolved, is under a
    place the units' namespace makes new at every start."""
    for p in dict.fromkeys((path, os.path.realpath(path))):
        for root, setting in _MADE_NEW.items():
            if _under(p, (root,)):
                return root, setting
    return None


def _state_directory(state: str) -> str | None:
    """The StateDirectory= that makes ``state`` (systemd makes nested ones too, each
    level), or None outside /var/lib."""
    state = os.path.normpath(state)
    rel = state[len("/var/lib/"):] if state.startswith("/var/lib/") else ""
    return rel if rel and ".." not in rel.split("/") else None


def hidden_from_units(cfg: Config, *, config_path: str | None, python: str | None = None,
                      prefix: str | None = None) -> str | None:
    """Why units for this interpreter and config could never start, in one line (else
    None): PrivateTmp=yes gives the unit an empty /tmp and /var/tmp, PrivateDevices=yes a
    /dev of its own (a fresh /dev/shm), so an interpreter or config there is 'not found'
    (status 203/EXEC) though verify is clean, and a model, key or python_path the config
    names there is missing at every start. The car's install is /opt; the settings stay
    (the sandboxes' staging must not be shared). A state dir there is worse: a fresh one
    at every start, so a latched fail-safe is gone at the next (review 6 finding 12, red
    team 11 row 3: the car would drive on, nobody cleared it)."""
    state = cfg.supervisor.state_dir
    hit = _made_new(state)
    if hit:
        return (f"the state dir {state} is under {hit[0]}, which the units' {hit[1]} makes "
                "new at every start: a latched fail-safe would be forgotten at the next; "
                "put [supervisor] state_dir on persistent storage (the default "
                "/var/lib/trio-supervisor)")
    if _state_directory(state) is None and not os.path.isdir(state):
        # ReadWritePaths= of a missing path: ignored with '-' (the state dir read-only,
        # the supervisor exiting 2 at every start, review 8 finding 4), a failed start
        # (226/NAMESPACE) without. systemd makes only what StateDirectory= names.
        return (f"the state dir {state} does not exist, and the units can make one only "
                f"under /var/lib: make it first (install -d -m 0700 {state}), or put "
                "[supervisor] state_dir under /var/lib")
    py = target_python(python, prefix)
    conf_file = str(Path(config_path).resolve()) if config_path else None
    for p in _reached(py, conf_file):
        hit = _made_new(p)
        if hit:
            what = "config" if conf_file and p in (conf_file, os.path.realpath(conf_file)) \
                else "interpreter"
            return (f"the {what} {p} is under {hit[0]}, which the units' {hit[1]} hides from "
                    "them (they would fail with 203/EXEC or 'config not found'): install "
                    "into /opt (scripts/install.sh --system) or give --prefix/--python and "
                    "--config outside /tmp, /var/tmp and /dev")
    for key, path in _config_paths(cfg):
        hit = _made_new(path)
        if hit:
            return (f"{key} {path} is under {hit[0]}, which the units' {hit[1]} makes new "
                    "at every start: the unit would not find it; keep it on persistent "
                    "storage (under the install, /opt or /etc)")
    return None


def _config_paths(cfg: Config) -> list[tuple[str, str]]:
    """The paths a config names that the unit must reach at every start, outside the
    project's own tree (the bundled models: where the install is, judged with it)."""
    from supervisor.config import PROJECT_ROOT

    out = []
    for name, m in cfg.models.items():
        r = m.resolved()
        out += [(f"models.{name}.artifact", r.artifact), (f"models.{name}.public_key", r.public_key)]
    for name, d in cfg.domains.items():
        out += [(f"domains.{name}.python_path", p) for p in d.python_path]
        out += [(f"domains.{name}.extra_ro_binds", p) for p in d.extra_ro_binds]
    own = os.path.realpath(PROJECT_ROOT)
    return [(k, p) for k, p in out if not _under(os.path.realpath(p), (own,))]


# The unit's own processes (supervisor, broker: ~120 MB RSS each measured) beside
# every sandbox's memory_max.
OWN_MEMORY = 512 << 20


def unit_memory_max(cfg: Config) -> int:
    """MemoryMax= of the sandbox host's unit: what every sandbox may use under its own
    memory_max, warm standbys included (each its own cgroup, the same limit; up to
    STANDBY_DEPTH of them), and the unit's own processes. The workers' sum once (18 GiB
    for the car, whose sandboxes may use 28 GiB) made an ordinary state, every worker
    within its own limit and its standbys warm, a unit-wide OOM kill of whichever
    process was largest (red team 10 row 10). 0: no worker has a limit."""
    from supervisor.lifecycle._standby import _WarmStandby

    sandboxes = sum((w.memory_max or 0) * (1 + (_WarmStandby.STANDBY_DEPTH
                                                 if w.warm_standby else 0))
                    for w in cfg.workers.values())
    return sandboxes + OWN_MEMORY if sandboxes else 0


def render(cfg: Config, *, config_path: str | None, python: str | None = None,
           prefix: str | None = None) -> str:
    """The one unit of today: the supervisor and its sandboxes, as root."""
    return _render_host(cfg, config_path=config_path, python=python, prefix=prefix)


# The supervisor keeps both timeouts alive while it makes progress (EXTEND_TIMEOUT_USEC
# per admitted worker, per start, per worker stopped: lifecycle/_supervisor.py), so these
# bound only the time until its first word and a phase that hangs.
_START_STOP_TIMEOUTS = (
    "# Start and stop: each phase asks systemd for its own bound (EXTEND_TIMEOUT_USEC),",
    "# so a slow but progressing start is never stopped and restarted; these bound the",
    "# time to the supervisor's first word.",
    "TimeoutStartSec=90s",
)


def render_broker(cfg: Config, *, config_path: str | None, python: str | None = None,
                  prefix: str | None = None) -> str:
    """The broker's unit (issue 27): the sandbox host. It needs everything the one unit
    of today needs for the sandboxes (same capabilities, namespaces, /proc, delegated
    cgroup, the same `EXPOSURE`), and nothing for the supervisor proper's work: no
    notify socket, no watchdog. Socket-activated by `BROKER_SOCKET_UNIT`."""
    return _render_host(cfg, config_path=config_path, python=python, prefix=prefix,
                        broker=True)


def _render_host(cfg: Config, *, config_path: str | None, python: str | None = None,
                 prefix: str | None = None, broker: bool = False) -> str:
    from supervisor.sandbox.staging import BASE as STAGING

    py = target_python(python, prefix)
    conf_file = str(Path(config_path).resolve()) if config_path else None
    conf = f" --config {exec_word(conf_file)}" if conf_file else ""
    memory = unit_memory_max(cfg)
    needs_net = any(d.network for d in cfg.domains.values())
    nofile = max((w.nofile or 0 for w in cfg.workers.values()), default=0)
    home = _in_home(py, conf_file)
    realtime = any(w.realtime_priority is not None for w in cfg.workers.values())
    caps = (*CAPABILITIES, REALTIME_CAPABILITY) if realtime else CAPABILITIES
    deny = (tuple(x for x in SYSCALL_DENY if x != "@resources") + RESOURCES_BUT_SCHED
            if realtime else SYSCALL_DENY)
    state = cfg.supervisor.state_dir.rstrip("/")
    made = _state_directory(state)
    if made is not None:
        state_lines = [f"StateDirectory={path_word(made)}", "StateDirectoryMode=0700"]
    else:
        # Exists (hidden_from_units refuses a missing one): writable through the
        # namespace, and a start fails, naming it, if it is gone later.
        state_lines = [f"ReadWritePaths={path_word(state)}"]
    staging = ([f"RuntimeDirectory={STAGING[len('/run/'):]}", "RuntimeDirectoryMode=0755"]
               if STAGING.startswith("/run/") else [f"ReadWritePaths=-{STAGING}"])
    if broker:
        head = [
            "[Unit]",
            f"Description=trio broker: the privileged part of the supervisor, sandboxes of "
            f"{len(cfg.workers)} workers from {_text(cfg.source)}",
            f"Requires={BROKER_SOCKET_UNIT}",
            f"After=local-fs.target {BROKER_SOCKET_UNIT}",
            "",
            "[Service]",
            "Type=simple",
            "# fd 3: the listening socket of the .socket unit; the broker accepts one",
            "# connection, from the supervisor proper's user only (SO_PEERCRED).",
            f"ExecStart={exec_word(py, command=True)} -m supervisor.broker{conf} --state-dir "
            f"{exec_word(cfg.supervisor.state_dir)}"
            f" --listen-fd 3 --peer-user {SUPERVISOR_USER}",
            "# UTF-8 whatever the machine's locale: under a latin-1 one a worker whose args are",
            "# not latin-1 could not start (UnicodeEncodeError encoding its argv).",
            "Environment=PYTHONDONTWRITEBYTECODE=1 PYTHONUTF8=1",
            "Restart=on-failure",
            "RestartSec=1s",
            "# 2: its config or state dir refused; restarting does not change them.",
            f"RestartPreventExitStatus={int(Exit.CONFIG)}",
        ]
    else:
        head = [
            "[Unit]",
            f"Description=trio supervisor: {len(cfg.workers)} sandboxed workers from {_text(cfg.source)}",
            "After=local-fs.target",
            "",
            "[Service]",
            "Type=notify",
            "NotifyAccess=main",
            "# --quiet: the journal has every event; a status line per second would flood it.",
            f"ExecStart={exec_word(py, command=True)} -m supervisor.cli run --quiet{conf}",
            "# UTF-8 whatever the machine's locale: under a latin-1 one a worker whose args are",
            "# not latin-1 could not start (UnicodeEncodeError encoding its argv).",
            "Environment=PYTHONDONTWRITEBYTECODE=1 PYTHONUTF8=1",
            "WatchdogSec=2s",
            *_START_STOP_TIMEOUTS,
            "Restart=on-failure",
            "RestartSec=1s",
            "# 2 config error, 3 admission refused a required worker, 4 fail-safe latched:",
            "# none gets better by restarting (4 waits for `supervisor clear-fail-safe`).",
            f"RestartPreventExitStatus={int(Exit.CONFIG)} {int(Exit.REFUSED)} {int(Exit.FAIL_SAFE)}",
        ]
    who = "broker" if broker else "supervisor"
    lines = [
        "# Generated by `supervisor units` from the config; regenerate, do not edit.",
        *head,
        "KillMode=mixed",
        "TimeoutStopSec=15s",
        f"# The {who} makes one cgroup per worker run below its own, and may write",
        "# nothing else of the cgroup file system (ProtectControlGroups=yes below).",
        f"Slice={SLICE}",
        "Delegate=yes",
        # v1: its cgroup in each hierarchy; '-': one missing hierarchy never fails the
        # start; and the RT runtime its parents lack (v1_rt_lines).
        *(f"ReadWritePaths=-{path_word(p)}"
          for p in unit_cgroups(BROKER_UNIT if broker else UNIT_NAME)),
        *v1_rt_lines(cfg, BROKER_UNIT if broker else UNIT_NAME),
        *([f"MemoryMax={memory}"] if memory else []),
        "# Its own process last for the OOM killer: its death ends every sandbox unsaid;",
        "# the sandboxes rank as any process (supervisor/sandbox/launch.py).",
        f"OOMScoreAdjust={OOM_SCORE_ADJ}",
        *([f"LimitNOFILE=1024:{nofile}"] if nofile > _DEFAULT_NOFILE_HARD else []),
        "LimitCORE=0",
        *state_lines,
        "# The staging mount namespace's mount point (supervisor/sandbox/staging.py).",
        *staging,
        "User=root",
        "# setuid/setgid: drop to the domain user; sys_admin + sys_chroot: the staging",
        "# mount namespace; sys_ptrace + dac_read_search: the workers' /proc (maps scan,",
        "# exec watch); kill: stop sandboxes of other uids.",
        *(["# sys_nice (and RestrictRealtime=no, sched_setscheduler): SCHED_FIFO for the",
           "# real-time workers' main threads at READY."] if realtime else []),
        "CapabilityBoundingSet=" + " ".join(caps),
        "AmbientCapabilities=",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        f"ProtectHome={'read-only' if home else 'yes'}",
        "PrivateTmp=yes",
        "PrivateDevices=yes",
        "PrivateMounts=yes",
        "PrivateIPC=yes",
        "ProtectKernelModules=yes",
        "ProtectClock=yes",
        "ProtectProc=invisible",
        "ProtectControlGroups=yes",
        "# Off on purpose: each of these breaks bubblewrap inside the unit (the kernel",
        "# refuses its --proc mount once files of /proc are covered; --hostname needs",
        "# sethostname).",
        "ProtectKernelTunables=no",
        "ProtectKernelLogs=no",
        "ProtectHostname=no",
        "KeyringMode=private",
        f"RestrictRealtime={'no' if realtime else 'yes'}",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "# tinygrad maps the signed artifact's kernels executable (modeld, jit_kernels).",
        "MemoryDenyWriteExecute=no",
        "SystemCallArchitectures=native",
        "SystemCallFilter=~" + " ".join(deny),
        "SystemCallErrorNumber=EPERM",
        "# AF_NETLINK: bwrap brings up lo in each sandbox's network namespace (rtnetlink).",
        "RestrictAddressFamilies=AF_UNIX AF_NETLINK" + (" AF_INET AF_INET6" if needs_net else ""),
        *([] if needs_net else ["PrivateNetwork=yes", "IPAddressDeny=any"]),
        "# bubblewrap creates every one of these for each sandbox.",
        "RestrictNamespaces=" + " ".join(NAMESPACES),
        "UMask=0022",
        "",
        *(["# Started by its socket (trio-broker.socket), not enabled on its own."] if broker
          else ["[Install]", "WantedBy=multi-user.target"]),
        "",
    ]
    return "\n".join(lines)


# What `systemd-analyze security` still marks exposed on the supervisor proper's unit, and
# why (tests/test_units.py fails on any other, and on a stale one).
PROPER_EXPOSURE: dict[str, str] = {
    "RestrictAddressFamilies=~AF_UNIX": "25: the broker's socket, the notify socket",
    "DeviceAllow=": "500: char-rtc r, which ProtectClock=yes adds (worth 1000)",
    "RootDirectory=/RootImage=": "200: runs from the host's /usr and the install prefix",
}


def render_broker_socket() -> str:
    """The broker's listening socket: made by systemd before either service starts,
    connectable by root and the supervisor proper's group only (the broker also checks
    the peer's uid)."""
    return "\n".join([
        "# Generated by `supervisor units`; regenerate, do not edit.",
        "[Unit]",
        "Description=trio broker socket: the supervisor proper's only way to privilege",
        "",
        "[Socket]",
        f"ListenSequentialPacket={BROKER_SOCKET}",
        "SocketUser=root",
        f"SocketGroup={SUPERVISOR_USER}",
        "SocketMode=0660",
        "DirectoryMode=0750",
        "Accept=no",
        "RemoveOnStop=yes",
        "",
        "[Install]",
        "WantedBy=sockets.target",
        "",
    ])


def render_proper(cfg: Config, *, config_path: str | None, python: str | None = None,
                  prefix: str | None = None) -> str:
    """The supervisor proper's unit (issue 27, phase 2's ExecStart): config, lifecycle,
    the workers' pipes and status, events, the exec-watch judgement, the monitor. It
    reads every hostile byte and holds no privilege at all: a fixed non-root user, an
    empty capability set, no namespaces, no mounts, no network, AF_UNIX only. Everything
    privileged goes through the broker's socket."""
    py = target_python(python, prefix)
    conf_file = str(Path(config_path).resolve()) if config_path else None
    conf = f" --config {exec_word(conf_file)}" if conf_file else ""
    home = _in_home(py, conf_file)
    return "\n".join([
        "# Generated by `supervisor units` from the config; regenerate, do not edit.",
        "[Unit]",
        f"Description=trio supervisor proper: {len(cfg.workers)} workers from {_text(cfg.source)}, "
        "unprivileged",
        f"Requires={BROKER_SOCKET_UNIT}",
        f"After=local-fs.target {BROKER_SOCKET_UNIT}",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        "# The broker's socket: every privileged act is its request (docs/broker.md).",
        f"ExecStart={exec_word(py, command=True)} -m supervisor.cli run --quiet --broker {BROKER_SOCKET}{conf}",
        "# UTF-8 whatever the machine's locale: under a latin-1 one a worker whose args are",
        "# not latin-1 could not start (UnicodeEncodeError encoding its argv).",
        "Environment=PYTHONDONTWRITEBYTECODE=1 PYTHONUTF8=1",
        "WatchdogSec=2s",
        *_START_STOP_TIMEOUTS,
        "Restart=on-failure",
        "RestartSec=1s",
        f"RestartPreventExitStatus={int(Exit.CONFIG)} {int(Exit.REFUSED)} {int(Exit.FAIL_SAFE)}",
        "TimeoutStopSec=15s",
        "LimitCORE=0",
        f"OOMScoreAdjust={OOM_SCORE_ADJ}",
        f"User={SUPERVISOR_USER}",
        f"Group={SUPERVISOR_USER}",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "NoNewPrivileges=yes",
        "# Its own user (and root) mapped 1:1: the broker's SO_PEERCRED check sees the",
        "# host uid; every other uid, the sandboxes' included, is nobody in here.",
        "PrivateUsers=yes",
        "ProtectSystem=strict",
        f"ProtectHome={'read-only' if home else 'yes'}",
        "PrivateTmp=yes",
        "PrivateDevices=yes",
        "DevicePolicy=closed",
        "PrivateMounts=yes",
        "PrivateIPC=yes",
        "PrivateNetwork=yes",
        "IPAddressDeny=any",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "# Other uids' /proc stays invisible: the broker opens what the scans read.",
        "ProtectProc=invisible",
        "ProcSubset=pid",
        "KeyringMode=private",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "RemoveIPC=yes",
        "LockPersonality=yes",
        "MemoryDenyWriteExecute=yes",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service",
        "SystemCallFilter=~@privileged @resources @mount @debug @clock @cpu-emulation "
        "@module @obsolete @raw-io @reboot @swap",
        "SystemCallErrorNumber=EPERM",
        "RestrictAddressFamilies=AF_UNIX",
        "UMask=0077",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ])


def write_split_units(cfg: Config, out: Path, *, config_path: str | None,
                      python: str | None = None, prefix: str | None = None) -> list[Path]:
    """The three units of the split (socket, broker, supervisor proper), beside the one
    unit of today (`write_units`); `supervisor units` writes both."""
    kw = dict(config_path=config_path, python=python, prefix=prefix)
    texts = {BROKER_SOCKET_UNIT: render_broker_socket(), BROKER_UNIT: render_broker(cfg, **kw),
             PROPER_UNIT: render_proper(cfg, **kw)}
    return _write_unit_files(out, {name: texts[name] for name in SPLIT_UNITS})


def _write_unit_files(out: Path, texts: dict[str, str]) -> list[Path]:
    """Root units, written only where no one else can change them before `install`
    copies them (`supervisor.outdir`: OUT and every directory on its way root's or the
    caller's and writable by no one else, or sticky; each unit through OUT's fd, a fresh
    O_EXCL|O_NOFOLLOW temp name renamed over the unit's: a link planted under the name
    is replaced, never written through; red team round 5 row 2). OutDirError: one line."""
    from supervisor.outdir import OutDir

    with OutDir.open(str(out), what="units --out", empty=False, mode=0o755,
                     parents=True) as d:
        for name, text in texts.items():
            d.write_text(name, text, 0o644)
        return [Path(d.path) / name for name in texts]


def write_units(cfg: Config, out: Path, *, config_path: str | None, python: str | None = None,
                prefix: str | None = None) -> list[Path]:
    return _write_unit_files(out, {UNIT_NAME: render(cfg, config_path=config_path,
                                                     python=python, prefix=prefix)})
