"""`supervisor run --privsep` and `--broker SOCKET`: the supervisor proper, unprivileged,
with the privileged broker doing what needs root (issue 27, docs/broker.md).

--privsep (a developer's single command, as root): the broker is started as our child
(`BrokerClient.spawn`, it loads the config itself), then this process drops to the
user `trio-supervisor` if it exists, else nobody (65534): supplementary groups
cleared, gid and uid set (real, effective, saved), the capability bounding set dropped,
ambient, inheritable, permitted and effective sets empty, no_new_privs, not dumpable.
What is checked afterwards is what the kernel says (/proc/self/status), not what we
asked for: any capability left or uid 0 is a refusal to run.

--broker SOCKET (the split units): connect to a running broker (trio-broker.socket);
this process is already unprivileged (the unit's User=), and root is refused.

Two things root could reach that the supervisor proper cannot:
  - the interpreter and its modules: /root is 0700 here (NOTES.md), so after the drop
    no new module could be imported from it. Each sys.path directory is opened first
    (O_PATH) and put on sys.path as /proc/self/fd/N: a lookup through that magic link
    starts at the directory itself, not at /, so no ancestor is traversed (the
    directories themselves are world-readable). The lifecycle's lazily imported
    modules are imported before the drop all the same.
  - the latch: in vehicle mode it lives in the broker's state dir (root, 0700) and
    goes through the broker (`BrokerLatch`). A simulation run's per-run directory is
    made here before the drop, owned by the supervisor proper, and reached by fd.
"""
from __future__ import annotations

import ctypes
import importlib
import json
import os
import pwd
import socket
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from supervisor.failsafe import LATCH_NAME, FailSafeLatch

PROPER_USER = "trio-supervisor"
NOBODY = 65534

_PR_CAPBSET_DROP = 24
_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_NR_CAPSET = {"x86_64": 126, "aarch64": 91}.get(os.uname().machine, -1)

# Imported before the drop: modules the supervisor proper imports lazily, at its first
# start, fail-safe, scan or monitor line (an import after the drop would need the
# interpreter's directories, reached by fd below; these make the common paths not
# depend on it).
_PRELOAD = (
    "supervisor.admission", "supervisor.admission.maps", "supervisor.sandbox",
    "supervisor.sandbox.execwatch", "supervisor.sandbox.wx", "supervisor.sandbox.sched",
    "supervisor.sandbox.policy", "supervisor.failsafe", "supervisor.monitor",
    "supervisor.config", "supervisor.broker", "supervisor.ipc", "supervisor.output",
    "supervisor.notify", "schemas.payloads", "json", "traceback", "tomllib",
    "importlib.metadata", "email.parser", "concurrent.futures.thread",
)


class PrivsepError(Exception):
    """Privilege separation cannot be set up: one line, the run does not start."""


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int = 0, arg3: int = 0) -> None:
    if _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(arg3),
                   ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        e = ctypes.get_errno()
        raise PrivsepError(f"prctl({option}, {arg}): {os.strerror(e)}")


# Where trio-supervisor does not exist: a uid of this run's own, from systemd's dynamic
# range, that no passwd or group entry names and no process runs as. Never nobody: other
# daemons share it and could signal (SIGSTOP) the proper (red team round 5).
_PRIVATE_IDS = range(61184, 65520)


def _private_id() -> int:
    import grp

    taken = {pw.pw_uid for pw in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f:
                    taken.update(int(ln.split()[1]) for ln in f if ln.startswith("Uid:"))
            except (OSError, ValueError, IndexError):
                continue
    n = len(_PRIVATE_IDS)
    start = os.getpid() % n                 # two runs starting together differ
    for k in range(n):
        uid = _PRIVATE_IDS[(start + k) % n]
        if uid not in taken:
            return uid
    raise PrivsepError("no free private uid for the supervisor proper: make its user "
                       f"with `scripts/install.sh --system` ({PROPER_USER})")


def proper_ids() -> tuple[int, int, str]:
    """(uid, gid, name) the supervisor proper runs as: trio-supervisor (made by
    scripts/install.sh --system), else a private uid of this run's own."""
    try:
        pw = pwd.getpwnam(PROPER_USER)
    except KeyError:
        uid = _private_id()
        return uid, uid, f"private uid {uid}"
    if pw.pw_uid == 0 or pw.pw_gid == 0:
        raise PrivsepError(f"user {PROPER_USER!r} is root: the supervisor proper never is")
    return pw.pw_uid, pw.pw_gid, PROPER_USER


def drop_privileges(uid: int, gid: int) -> dict[str, str]:
    """Become uid/gid with no capability in any set; returns the kernel's view
    (/proc/self/status: Uid, Gid, Groups, Cap*, NoNewPrivs). PrivsepError if any
    capability or uid 0 is left."""
    if uid == 0 or gid == 0:
        raise PrivsepError("refusing to 'drop' to uid or gid 0")
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    os.setgroups([])
    for cap in range(last + 1):          # needs CAP_SETPCAP: before the uid changes
        _prctl(_PR_CAPBSET_DROP, cap)
    _prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)          # permitted and effective go with uid 0
    hdr = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()              # all zero: inheritable too
    if _libc.syscall(ctypes.c_long(_NR_CAPSET), ctypes.byref(hdr), ctypes.byref(data)) != 0:
        raise PrivsepError(f"capset: {os.strerror(ctypes.get_errno())}")
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    # Not dumpable (setresuid made it so already; said here on purpose): a process of
    # the same uid (a sandbox mapped to it) may neither ptrace us nor read our /proc.
    _prctl(_PR_SET_DUMPABLE, 0)
    return check_unprivileged()


def check_unprivileged() -> dict[str, str]:
    """This process's status fields of interest; PrivsepError unless uid and gid are
    not 0 and every capability set is empty."""
    st: dict[str, str] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb",
                   "NoNewPrivs"):
            st[key] = value.strip()
    if "0" in st["Uid"].split() or "0" in st["Gid"].split():
        raise PrivsepError(f"still uid/gid 0 after the drop (Uid {st['Uid']}, Gid {st['Gid']})")
    left = {k: v for k, v in st.items() if k.startswith("Cap") and int(v, 16)}
    if left:
        raise PrivsepError(f"capabilities left after the drop: {left}")
    return st


def reach_imports_by_fd() -> list[int]:
    """Put every sys.path directory on sys.path as /proc/self/fd/N, and the __path__ of
    every package imported already (its submodules are found there, not on sys.path),
    see the module doc; import what the lifecycle imports lazily first. Returns the fds
    (held for the process's life)."""
    for name in _PRELOAD:
        importlib.import_module(name)
    fds: list[int] = []
    moved: dict[str, str] = {}
    for entry in sys.path:
        if entry and os.path.isdir(entry) and not entry.startswith("/proc/self/fd/"):
            real = os.path.realpath(entry)
            if real not in moved:
                fd = os.open(real, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                fds.append(fd)
                moved[real] = f"/proc/self/fd/{fd}"

    def by_fd(path: str) -> str:
        real = os.path.realpath(path)
        for top in sorted(moved, key=len, reverse=True):
            if real == top or real.startswith(top + os.sep):
                return moved[top] + real[len(top):]
        return path

    sys.path[:] = [by_fd(p) if p else p for p in sys.path]
    for mod in list(sys.modules.values()):
        path = getattr(mod, "__path__", None)
        if isinstance(path, list):
            path[:] = [by_fd(p) for p in path]
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()
    return fds


@dataclass
class BrokerLatch:
    """FailSafeLatch through the broker (vehicle mode): the state dir is the broker's
    (root, 0700), written only by its setLatch/clearLatch requests, and read back with
    readLatch. Same interface as FailSafeLatch; a broker refusal is an OSError."""

    client: Any                          # supervisor.broker.BrokerClient
    path: Path                           # where it is (for the operator's message)
    per_run_base: Path | None = None

    def _call(self, fn, *args):
        from supervisor.broker import BrokerError

        try:
            return fn(*args)
        except BrokerError as e:
            raise OSError(e.errno or 0, f"broker: {e.code}: {e.reason}") from None

    def read(self) -> dict | None:
        text = self._call(self.client.read_latch)
        if text is None:
            return None
        try:
            got = json.loads(text)
        except ValueError as e:          # unreadable latch: still latched
            return {"reason": f"unreadable latch file: {e}"}
        return got if isinstance(got, dict) else {"reason": "unreadable latch file"}

    def reserve(self) -> None:
        """The latch's blocks, made by the broker (at each run's start, as directly)."""
        self._call(self.client.reserve_latch)

    def set(self, reason: str) -> None:
        from supervisor.protocol import printable

        # The broker takes a printable reason of at most 1024 characters.
        self._call(self.client.set_latch, printable(reason)[:1024])

    def clear(self) -> None:
        self._call(self.client.clear_latch)


@dataclass
class Privsep:
    """What `run --privsep`/`--broker` set up: the client and the latch to hand the
    Supervisor, and who we are now."""

    client: Any
    latch: Any
    status: dict[str, str]
    held_fds: list[int]

    def close(self) -> int | None:
        """Close the broker connection: a broker we started kills what is left, exits."""
        return self.client.close()


def _latch_for(cfg: Any, client: Any, uid: int, gid: int) -> tuple[Any, list[int]]:
    latch = FailSafeLatch.for_config(cfg)
    if latch.per_run_base is None:       # vehicle: the broker's state dir
        return BrokerLatch(client, latch.path), []
    # Simulation: a directory of this run's own, ours after the drop, reached by fd
    # (its ancestors may be root's 0700 directories).
    latch.per_run_base.mkdir(parents=True, exist_ok=True, mode=0o700)
    run_dir = latch.path.parent
    run_dir.mkdir(mode=0o700)
    os.chown(run_dir, uid, gid)
    fd = os.open(run_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    return FailSafeLatch(Path(f"/proc/self/fd/{fd}") / LATCH_NAME), [fd]


def broker_state_dir(cfg: Any) -> str:
    """The broker's state dir: the vehicle's (TRIO_STATE_DIR, else the config's)."""
    return os.environ.get("TRIO_STATE_DIR") or cfg.supervisor.state_dir


def start_privsep(cfg: Any, config_path: str | None,
                  before_drop: Callable[[], None] | None = None) -> Privsep:
    """As root: start the broker, then become the unprivileged supervisor proper.
    `before_drop`: what must still run as root (the static admission's walk of the
    installed code and the runtime checks, see Supervisor.judge_before_start)."""
    if os.geteuid() != 0:
        raise PrivsepError("--privsep starts the broker as root: run it as root (as a "
                           "user, plain `supervisor run` runs unprivileged already)")
    from supervisor.broker import BrokerClient, BrokerError

    uid, gid, _name = proper_ids()
    from supervisor.statelock import held_fds

    client = BrokerClient.spawn(state_dir=broker_state_dir(cfg), config=config_path,
                                keep_fds=tuple(held_fds()))
    try:
        try:
            client.ping()                # it loaded the config and holds the state dir
        except (BrokerError, ConnectionError, OSError) as e:
            code = client.close(timeout=5)
            raise PrivsepError(f"the broker did not start (exit {code}): {e}") from None
        latch, held = _latch_for(cfg, client, uid, gid)
        if before_drop is not None:
            before_drop()
        held += reach_imports_by_fd()
        status = drop_privileges(uid, gid)
    except BaseException:
        if client.sock.fileno() >= 0:
            client.close(timeout=5)
        raise
    return Privsep(client, latch, status, held)


def connect_broker(cfg: Any, path: str) -> Privsep:
    """As the unit's unprivileged user: connect to a listening broker (its socket unit
    admits only our uid, by SO_PEERCRED)."""
    from supervisor.broker import BrokerClient, BrokerError

    if os.geteuid() == 0:
        raise PrivsepError("--broker: the supervisor proper must not be root (use "
                           "--privsep to start a broker and drop privileges)")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
    except OSError as e:
        sock.close()
        raise PrivsepError(f"--broker {path}: {e.strerror or e}") from None
    # Only root's broker gets the channels: whoever could bind the path (a developer's
    # --broker /tmp/..., a socket unit not up yet) got them read-write (red team round 5).
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != 0:
        sock.close()
        raise PrivsepError(f"--broker {path}: the process listening there runs as uid "
                           f"{uid}, not root: not a broker (nothing was sent to it)")
    client = BrokerClient(sock)
    try:
        client.ping()
    except (BrokerError, ConnectionError, OSError) as e:
        client.close()
        raise PrivsepError(f"--broker {path}: no answer: {e}") from None
    latch = FailSafeLatch.for_config(cfg)   # simulation: a per-run dir, unprivileged
    if latch.per_run_base is None:
        latch = BrokerLatch(client, latch.path)
    return Privsep(client, latch, check_unprivileged(), [])
