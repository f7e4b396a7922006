"""What a hostile worker tries from inside its sandbox (``workers.probe --attack NAME``).

Each attack returns ``{"denied": bool, ...detail}``; the probe prints it as one line
``ATTACK {json}``. Attacks the kernel answers by killing the process print nothing:
the supervisor's exit/refused event is the evidence. Attacks on kernel knobs open the
file for writing and never write, so a regression cannot change the machine.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import socket
import sys
import termios
import time
from typing import Callable

from supervisor.worker import ENV_STATUS_FD, WorkerContext

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.fsetxattr.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_int)
# A computed name: the static admission walk cannot see it, as a hostile worker knows.
_TORCH = "".join(("to", "rch"))
ARG = ""                              # --attack-arg (the probe sets it)
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
PROT_RX = mmap.PROT_READ | mmap.PROT_EXEC


def _err(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno:
        return errno.errorcode.get(e.errno, str(e.errno))
    return f"{type(e).__name__}: {e}"


def _open_for_write(path: str) -> dict:
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as e:
        return {"denied": True, "error": _err(e)}
    os.close(fd)                      # opened but never written
    return {"denied": False}


def core_pattern(ctx: WorkerContext) -> dict:
    """The host-root escape: a pipe in kernel.core_pattern runs as host root."""
    return _open_for_write("/proc/sys/kernel/core_pattern")


def sysrq(ctx: WorkerContext) -> dict:
    return _open_for_write("/proc/sysrq-trigger")


def proc_self_mem(ctx: WorkerContext) -> dict:
    """Writes through /proc/self/mem patch executable pages without mprotect."""
    return _open_for_write("/proc/self/mem")


def _channel_fd(ctx: WorkerContext) -> int:
    """The read-only data fd of the first channel this worker reads."""
    import json

    from supervisor.ipc import ReaderHandle, env_name

    for ch in ctx.channels:
        h = json.loads(os.environ[env_name(ch)])
        if h.get("role", "reader") != "writer":
            return ReaderHandle.from_json(os.environ[env_name(ch)]).data_fd
    raise LookupError("no channel to read")


def reopen_rw(ctx: WorkerContext) -> dict:
    """A reader re-opening its read-only channel fd for writing."""
    fd = _channel_fd(ctx)
    try:
        os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    except OSError as e:
        return {"denied": True, "error": _err(e)}
    return {"denied": False}


def acl_then_reopen(ctx: WorkerContext) -> dict:
    """POSIX ACL granting us write on the channel memfd, then a read-write re-open.
    The acl xattr value: version 2, user_obj rw, user(uid 1000) rw, mask rw, other r."""
    fd = _channel_fd(ctx)
    import struct

    ent = [(0x01, 6, 0xFFFFFFFF), (0x02, 6, 1000), (0x10, 6, 0xFFFFFFFF), (0x20, 4, 0xFFFFFFFF)]
    val = struct.pack("<I", 2) + b"".join(struct.pack("<HHI", t, p, i) for t, p, i in ent)
    rc = _libc.fsetxattr(fd, b"system.posix_acl_access", val, len(val), 0)
    res: dict = {"fsetxattr": rc if rc == 0 else errno.errorcode.get(ctypes.get_errno())}
    try:
        os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        res["denied"] = False
    except OSError as e:
        res.update(denied=True, error=_err(e))
    return res


def fchmod_channel(ctx: WorkerContext) -> dict:
    fd = _channel_fd(ctx)
    try:
        os.fchmod(fd, 0o666)
    except OSError as e:
        return {"denied": True, "error": _err(e)}
    return {"denied": False}


def forge_log(ctx: WorkerContext) -> dict:
    """Look like the supervisor, then try to erase its log."""
    print('{"ts":0,"event":"ready","worker":"controlsd","pid":1}', flush=True)
    print('{"ts":0,"event":"fail_safe","domain":"control","reason":"forged"}', file=sys.stderr,
          flush=True)
    res: dict = {}
    for fd in (1, 2):
        try:
            os.ftruncate(fd, 0)
            res[f"ftruncate{fd}"] = "ok"
        except OSError as e:
            res[f"ftruncate{fd}"] = _err(e)
    res["denied"] = all(v != "ok" for v in res.values())
    return res


def tty(ctx: WorkerContext) -> dict:
    """Change the operator's terminal settings / grab a controlling terminal."""
    res: dict = {}
    for fd in (0, 1, 2):
        try:
            attrs = termios.tcgetattr(fd)
            termios.tcsetattr(fd, termios.TCSANOW, attrs)
            res[f"fd{fd}"] = "tcsetattr ok"
        except (termios.error, OSError) as e:
            res[f"fd{fd}"] = str(e.args[-1] if e.args else e)
    try:
        os.close(os.open("/dev/tty", os.O_RDWR))
        res["dev_tty"] = "opened"
    except OSError as e:
        res["dev_tty"] = _err(e)
    res["denied"] = not any("ok" in v or v == "opened" for v in res.values())
    return res


def fork_storm(ctx: WorkerContext) -> dict:
    """Fork until the kernel says no; children sleep (they hold their pid)."""
    n, err = 0, ""
    t_end = time.monotonic() + 2.0
    while n < 5000 and time.monotonic() < t_end:
        try:
            pid = os.fork()
        except OSError as e:
            err = _err(e)
            break
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
    return {"denied": bool(err), "forks": n, "error": err}


def memory_hog(ctx: WorkerContext) -> dict:
    """Fill memory that RLIMIT_DATA never counted: a shared anonymous mapping (shmem,
    like a memfd), touched page by page up to 4 GiB."""
    size = 4 << 30
    m = mmap.mmap(-1, size)                        # MAP_SHARED: shmem-backed
    step = 1 << 20
    for off in range(0, size, step):
        m[off:off + step] = b"\xa5" * step
    return {"denied": False, "mib": size >> 20}


def dev_shm(ctx: WorkerContext) -> dict:
    """Fill /dev/shm: a private, size-capped tmpfs (the old /dev was 12 GiB of host RAM)."""
    import glob

    res: dict = {"host_names": glob.glob("/dev/shm/*")}
    n = 0
    try:
        with open("/dev/shm/hog", "wb") as f:
            for n in range(1, 257):
                f.write(b"\xa5" * (1 << 20))
                f.flush()
    except OSError as e:
        res.update(error=_err(e), mib=n)
    res["denied"] = "error" in res and not res["host_names"]
    return res


def ptrace(ctx: WorkerContext) -> dict:
    """Killed by seccomp (SIGSYS) in control: nothing printed."""
    rc = _libc.ptrace(16, os.getppid(), None, None)   # PTRACE_ATTACH
    return {"denied": rc != 0, "errno": errno.errorcode.get(ctypes.get_errno())}


def seccomp_scout(ctx: WorkerContext) -> dict:
    """Map the seccomp filter without dying for it: a child tries each forbidden call
    (ptrace, then execve) and the worker reads the child's fate. Was a silent probe (a
    child killed by seccomp died unseen by the supervisor); now no child can be made
    (EPERM), so every forbidden call would be the worker's own, and kill it, logged."""
    seen = {}
    for name, call in (("ptrace", lambda: _libc.ptrace(16, 1, None, None)),
                       ("execve", lambda: os.execv("/bin/true", ["/bin/true"]))):
        try:
            pid = os.fork()
        except OSError as e:
            seen[name] = f"no child: {_err(e)}"
            continue
        if pid == 0:
            call()
            os._exit(0)
        st = os.waitpid(pid, 0)[1]
        seen[name] = f"signal:{os.WTERMSIG(st)}" if os.WIFSIGNALED(st) else "survived"
    return {"denied": all(v.startswith("no child") for v in seen.values()), "mapped": seen}


def personality(ctx: WorkerContext) -> dict:
    """READ_IMPLIES_EXEC would make every later PROT_READ mapping executable."""
    rc = _libc.personality(0x0400000)
    return {"denied": rc == -1, "errno": errno.errorcode.get(ctypes.get_errno())}


def unix_connect(ctx: WorkerContext) -> dict:
    """ARG: a host unix socket path that lies inside an extra_ro_binds directory."""
    path = ARG
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError as e:
        return {"denied": True, "error": _err(e)}
    finally:
        s.close()
    return {"denied": False}


def _anon_rx() -> dict:
    # Private anonymous memory, as tinygrad maps its kernels (shared memory could be
    # aliased writable and is refused outright).
    m = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=PROT_RW)
    m.write(b"\xc3")                                   # ret
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    rc = _libc.mprotect(addr, mmap.PAGESIZE, PROT_RX)
    return {"denied": rc != 0, "errno": errno.errorcode.get(ctypes.get_errno()) if rc else None}


def mprotect_exec(ctx: WorkerContext) -> dict:
    """Machine code written into anonymous memory, then made executable."""
    return _anon_rx()


def memfd_exec(ctx: WorkerContext) -> dict:
    try:
        fd = os.memfd_create("harmless")
    except OSError as e:
        return {"denied": True, "error": _err(e)}
    os.write(fd, b"\0" * mmap.PAGESIZE)
    try:
        mmap.mmap(fd, mmap.PAGESIZE, prot=PROT_RX)
    except OSError as e:
        return {"denied": True, "error": _err(e)}
    return {"denied": False}


def dlopen_tmp(ctx: WorkerContext) -> dict:
    """A shared library dropped in the writable /tmp (a copy of a system one)."""
    import glob

    src = (glob.glob("/usr/lib/x86_64-linux-gnu/libz.so.1*") + glob.glob("/usr/lib/*/libz.so.1*")
           + glob.glob("/lib/*/libz.so.1*"))[0]
    with open(src, "rb") as f, open("/tmp/libharmless.so", "wb") as g:
        g.write(f.read())
    try:
        ctypes.CDLL("/tmp/libharmless.so")
    except OSError as e:
        return {"denied": True, "error": str(e)[:200]}
    return {"denied": False}


def torch_files(ctx: WorkerContext) -> dict:
    """Torch on the control domain's filesystem at all (with the guard removed)."""
    import importlib.util
    import site

    # As the attacker did: remove the guard's finder and clear its state.
    from supervisor.admission import guard

    sys.meta_path[:] = [f for f in sys.meta_path
                        if "guard" not in (getattr(f, "__module__", "") + type(f).__module__)]
    for k, v in vars(guard).items():
        if k.startswith("_") and not k.startswith("__") and isinstance(v, (set, dict, list)):
            v.clear()
    res: dict = {"spec": importlib.util.find_spec(_TORCH) is not None}
    found = []
    for sp in site.getsitepackages():
        for name in (_TORCH, f"{_TORCH}/lib/lib{_TORCH}_cpu.so", f"{_TORCH}/lib/libc10.so",
                     f"func{_TORCH}"):
            if os.path.exists(os.path.join(sp, name)):
                found.append(name)
    res["found"] = found
    try:
        __import__(_TORCH)
        res["import"] = "imported"
    except ImportError as e:
        res["import"] = str(e)
    res["denied"] = not res["spec"] and not found and res["import"] != "imported"
    return res


def swallow_guard(ctx: WorkerContext) -> dict:
    """Import torch through the guard and swallow the refusal."""
    try:
        __import__(_TORCH)
    except ImportError as e:
        return {"denied": True, "error": str(e)[:200]}
    return {"denied": False}


def fake_ready(ctx: WorkerContext) -> dict:
    """Announce READY by hand (no ctx.ready), then make memory executable."""
    os.write(int(os.environ[ENV_STATUS_FD]), b"READY=1\n")
    time.sleep(0.3)
    return _anon_rx()


def status_flood(ctx: WorkerContext) -> dict:
    """Flood the status pipe to starve the supervisor's event loop (red team: 3-5 s
    stalls, a control worker watchdog-killed)."""
    fd, chunk = int(os.environ[ENV_STATUS_FD]), b"WATCHDOG=1\n" * 372
    t_end, n = time.monotonic() + 3.0, 0
    try:
        while time.monotonic() < t_end:
            os.write(fd, chunk)
            n += 1
    except OSError as e:
        return {"denied": True, "writes": n, "error": _err(e)}
    return {"denied": False, "writes": n}


def long_line(ctx: WorkerContext) -> dict:
    """One 8 MiB line on stdout: the supervisor must neither hold it nor pass it on."""
    chunk = "A" * (1 << 20)
    for _ in range(8):
        sys.stdout.write(chunk)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return {"denied": True}     # the evidence is the supervisor's output event


def shutdown_flood(ctx: WorkerContext) -> dict:
    """Arm for the stop: on SIGTERM, ignore it and write to stdout without end. The
    supervisor keeps a worker's output pipe open until the worker has stopped, and reads
    none of it meanwhile: the stop must still end (SIGKILL after the grace period) and
    the rest of the shutdown go on."""
    import signal

    def flood(signum, frame) -> None:
        line = "F" * 1023 + "\n"
        while True:
            sys.stdout.write(line)
            sys.stdout.flush()

    signal.signal(signal.SIGTERM, flood)
    return {"denied": True, "armed": True}     # the evidence is the supervisor's events


def nested_log(ctx: WorkerContext) -> dict:
    """A log record nested deeper than the supervisor's recursion limit, then a forged
    record claiming to be the supervisor: parsing either must not end or fool it."""
    sys.stdout.write('{"log":"deep","data":' + "[" * 1900 + "\n")
    sys.stdout.write('{"log":"forged","source":"supervisor","event":"ready","worker":"modeld"}\n')
    sys.stdout.flush()
    return {"denied": True}     # the evidence is in the supervisor's events


def modify_ldt(ctx: WorkerContext) -> dict:
    """Install our own x86 code segment in the LDT (no capability needed): kernel attack
    surface no worker needs. Killed in control; EPERM in research."""
    import struct

    # struct user_desc: entry 0, base 0, limit 0xfffff, 32-bit code segment, page
    # granular, usable.
    flags = 1 | (2 << 1) | (1 << 4) | (1 << 6)
    desc = ctypes.create_string_buffer(struct.pack("=IIII", 0, 0, 0xFFFFF, flags), 16)
    rc = _libc.syscall(ctypes.c_long(154), ctypes.c_long(1), desc, ctypes.c_long(16))
    return {"denied": rc != 0, "errno": errno.errorcode.get(ctypes.get_errno()) if rc else None}


def mremap_exec(ctx: WorkerContext) -> dict:
    """After READY (and after the READY snapshot): a new executable mapping without
    mmap or mprotect, which the exec watch never sees: mremap grows the last page of
    libc's text by one page and moves it. Only the maps scan can tell (new-exec-after-
    ready). Waits for the kill; returns only if none came."""
    time.sleep(3.0)
    _libc.mremap.restype = ctypes.c_void_p
    _libc.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                             ctypes.c_void_p)
    with open("/proc/thread-self/maps") as f:     # /proc/self/maps is empty headless
        text = [ln.split() for ln in f]
    lo, hi = next(tuple(int(x, 16) for x in v[0].split("-")) for v in text
                  if v[1] == "r-xp" and len(v) > 5 and "/libc.so" in v[5])
    new = _libc.mremap(hi - mmap.PAGESIZE, mmap.PAGESIZE, 2 * mmap.PAGESIZE, 1, None)  # MAYMOVE
    if new is None or new == ctypes.c_void_p(-1).value:
        return {"denied": True, "errno": errno.errorcode.get(ctypes.get_errno())}
    time.sleep(8.0)
    return {"denied": False, "at": hex(new)}


def headless_mremap(ctx: WorkerContext) -> dict:
    """Blind the maps scan, then do what only it can see: the main thread leaves with
    exit(2), not exit_group(2), so the worker runs on in a second thread while
    /proc/PID/maps reads empty and /proc/PID/mountinfo fails; that thread runs
    mremap_exec. Was unnoticed (the scan skipped the worker as gone). Never returns:
    the thread reports only if no kill came."""
    import json
    import threading

    def body() -> None:
        res = mremap_exec(ctx)
        print("ATTACK " + json.dumps({"attack": "headless_mremap", **res}), flush=True)
        os._exit(0)
    threading.Thread(target=body).start()
    time.sleep(0.2)
    _libc.syscall({"x86_64": 60, "aarch64": 93}[os.uname().machine], 0)   # SYS_exit
    return {"denied": None, "error": "exit(2) returned"}


def own_listener(ctx: WorkerContext) -> dict:
    """Take the exec watch from the supervisor: install our own seccomp user-notification
    filter for mprotect (a newer filter's listener would be asked first), then make
    memory executable. The kernel allows one listener per filter chain (EBUSY); a
    notify filter without a listener only makes our own calls fail (ENOSYS)."""
    import struct

    # ld [0] (nr); jeq mprotect ? ret USER_NOTIF : ret ALLOW
    prog = [(0x20, 0, 0, 0), (0x15, 0, 1, 10), (0x06, 0, 0, 0x7FC00000), (0x06, 0, 0, 0x7FFF0000)]
    raw = b"".join(struct.pack("=HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class _Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = _Fprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    res: dict = {}
    for label, flags in (("new_listener", 8), ("no_listener", 0)):   # FLAG_NEW_LISTENER
        rc = _libc.syscall(ctypes.c_long(317), ctypes.c_long(1), ctypes.c_long(flags),
                           ctypes.byref(fprog))
        res[label] = "ok" if rc >= 0 else errno.errorcode.get(ctypes.get_errno())
        if rc >= 0 and flags:
            os.close(rc)
    import json

    # After READY the W^X filter kills the mprotect below outright (KILL outranks any
    # USER_NOTIF, ours or the supervisor's): say what the listener attempts got first.
    print("ATTACK-STEP own_listener " + json.dumps(res), flush=True)
    res.update(_anon_rx())
    return res


def wake_abuse(ctx: WorkerContext) -> dict:
    """A reader abusing its wake-up socket: fds sent to the writer's end, the writer's
    direction stuffed, then both directions shut down. The writer (control) must
    publish on, untouched."""
    import json

    from supervisor.ipc import env_name

    h = next(json.loads(os.environ[env_name(ch)]) for ch in ctx.channels)
    s = socket.socket(fileno=os.dup(h["event_fd"]))
    res: dict = {}
    try:
        socket.send_fds(s, [b"x"], [h["data_fd"], h["lease_fd"], h["event_fd"]])
        res["scm_rights"] = "sent"
    except OSError as e:
        res["scm_rights"] = _err(e)
    s.setblocking(False)
    n = 0
    try:
        while n < 64 << 20:
            n += s.send(b"\xff" * 65536)
    except OSError as e:
        res["flood"] = _err(e)
    res["flood_bytes"] = n
    s.shutdown(socket.SHUT_RDWR)
    time.sleep(1.0)            # the writer publishes into a shut-down socket meanwhile
    res["denied"] = True       # the evidence is the writer's health (src, sink)
    return res


def announce_sink(ctx: WorkerContext) -> dict:
    """A research reader of a channel whose control writer announces every message
    (Writer.announce) claims in its own lease table to busy-poll and to be asleep, so
    that every announcement is sent to its wake-up socket; it takes those bytes, then
    shuts the socket down. The writer (control) must announce and publish on,
    untouched: the evidence is its health (src) and the sink's traffic."""
    import json

    from supervisor.ipc import env_name, layout as L

    h = next(json.loads(os.environ[env_name(ch)]) for ch in ctx.channels)
    lease = mmap.mmap(h["lease_fd"], mmap.PAGESIZE)        # its own: writable
    L.U64.pack_into(lease, L.OFF_POLLS, L.READER_POLLS)
    L.U64.pack_into(lease, L.OFF_AWAKE, 0)
    s = socket.socket(fileno=os.dup(h["event_fd"]))
    time.sleep(0.5)                  # announcements arrive as wake-up bytes meanwhile
    s.setblocking(False)
    got = 0
    try:
        while chunk := s.recv(65536):
            got += len(chunk)
    except OSError:
        pass
    s.shutdown(socket.SHUT_RDWR)     # the writer's next wake-ups fail (EPIPE)
    time.sleep(1.0)
    return {"denied": True, "woken_bytes": got}


def lease_hoard(ctx: WorkerContext) -> dict:
    """A research reader fills its whole lease page (126 entries, not the channel's
    max_leases) with live leases on every slot at its current generation, refreshed every
    5 ms for 1.5 s, to pin the control writer's ring (whose next slot is loaned ahead:
    NextLoan) and make it take back what it just published. The writer honours only
    max_leases entries per reader: it must publish on, through more than one slot."""
    import json

    from supervisor.ipc import env_name, layout as L
    from supervisor.ipc._geometry import control_offset

    h = next(json.loads(os.environ[env_name(ch)]) for ch in ctx.channels)
    seg = mmap.mmap(h["data_fd"], 0, prot=mmap.PROT_READ)
    lease = mmap.mmap(h["lease_fd"], mmap.PAGESIZE)        # its own: writable
    count = L.CHANNEL_HDR.unpack_from(seg, 0)[2]
    entries = (mmap.PAGESIZE - L.LEASE_BASE) // L.LEASE_STRIDE
    seq0 = L.U64.unpack_from(seg, L.OFF_LAST_SEQ)[0]
    slots: set[int] = set()
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        deadline = time.monotonic_ns() + 50_000_000
        for k in range(entries):
            slot = k % count
            gen = L.GEN_SEQ.unpack_from(seg, control_offset(slot))[0]
            L.LEASE_ENTRY.pack_into(lease, L.LEASE_BASE + L.LEASE_STRIDE * k, slot, gen,
                                    deadline)
        slots.add(L.U32.unpack_from(seg, L.OFF_LAST_SLOT)[0])
        time.sleep(0.005)
    published = L.U64.unpack_from(seg, L.OFF_LAST_SEQ)[0] - seq0
    # 1.5 s at the writer's 20 ms period is ~75 messages.
    return {"denied": published >= 30 and len(slots) > 1, "entries_forged": entries,
            "published": published, "slots_used": len(slots)}


def status_churn(ctx: WorkerContext) -> dict:
    """900 distinct STATUS lines a second for 3 s: under the flood limit (1000 lines/s),
    yet each one was an event in the supervisor's log (~0.5 MB/s, enough to trip
    journald's default rate limit and so hide every other worker's events)."""
    fd, n = int(os.environ[ENV_STATUS_FD]), 0
    t_end = time.monotonic() + 3.0
    while time.monotonic() < t_end:
        os.write(fd, b"".join(f"STATUS={n + i:06d} {'x' * 500}\n".encode() for i in range(90)))
        n += 90
        time.sleep(0.1)
    return {"denied": None, "lines": n}


def status_escape(ctx: WorkerContext) -> dict:
    """Terminal control in a STATUS line: the live status line on the operator's terminal
    quotes every worker's status. A carriage return and an erase-line rewrite the
    whole line (a FAIL-SAFE shown as engaged), OSC 52 writes the operator's clipboard."""
    fd = int(os.environ[ENV_STATUS_FD])
    fake = "control_cmd  50.0/s drop 0 lost 0 | steer +0.010 rad engaged"
    for _ in range(3):
        os.write(fd, f"STATUS=ok\r\x1b[2K{fake}\x1b]52;c;ZWNobyBwd25lZAo=\x07\n".encode())
        time.sleep(1.0)
    return {"denied": None}


def shared_description(ctx: WorkerContext) -> dict:
    """Every reader of a channel holds the same read-only open file description: what a
    research reader sets on it (file status flags, the offset) a control reader sees.
    Research: set them. Control: look, a little later."""
    import fcntl

    fd = _channel_fd(ctx)
    if ctx.domain == "research":
        fcntl.fcntl(fd, fcntl.F_SETFL, os.O_NONBLOCK | os.O_APPEND)
        os.lseek(fd, 0x5EED, os.SEEK_SET)
        return {"denied": None, "set": True}
    time.sleep(3.0)
    flags = fcntl.fcntl(fd, fcntl.F_GETFL) & (os.O_NONBLOCK | os.O_APPEND)
    offset = os.lseek(fd, 0, os.SEEK_CUR)
    return {"denied": flags == 0 and offset != 0x5EED, "flags": flags, "offset": offset}


def patch_library(ctx: WorkerContext) -> dict:
    """Before READY: a shared library mapped read+execute from a read-only mount (allowed),
    made writable (mprotect without PROT_EXEC: not watched), patched, made executable
    again. The patched page is a private copy, no longer the file's: refused."""
    import glob

    path = (glob.glob("/usr/lib/x86_64-linux-gnu/libz.so.1*") + glob.glob("/usr/lib/*/libz.so.1*")
            + glob.glob("/lib/*/libz.so.1*"))[0]
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), mmap.PAGESIZE, flags=mmap.MAP_PRIVATE, prot=PROT_RX)
    # Its address, from our maps (the loader's own text of the library is not at offset 0).
    with open("/proc/self/maps") as f:
        at = next(int(ln.split("-")[0], 16) for ln in f
                  if ln.split()[1:3] == ["r-xp", "00000000"] and ln.rstrip().endswith(
                      os.path.basename(os.path.realpath(path))))
    res: dict = {"rw": _libc.mprotect(at, mmap.PAGESIZE, PROT_RW)}
    ctypes.memmove(at, b"\xc3", 1)                    # ret
    rc = _libc.mprotect(at, mmap.PAGESIZE, PROT_RX)
    res.update(denied=rc != 0, errno=errno.errorcode.get(ctypes.get_errno()) if rc else None)
    m.close()
    return res

# -- issue 21: races against the exec watch, and the W^X lock at READY --------------------
# The exec watch judges a request, then lets the kernel make the call (CONTINUE). A
# second thread that changes the memory or the fd between the two would make the
# kernel do what was never judged. Each race below is tried `tries` times, thread 2
# firing at spread delays after thread 1 enters its syscall (ctypes drops the GIL
# there, which is what wakes thread 2); `bench/wx_race.py` runs them in a sandbox
# under an ExecWatch that refuses without killing, and counts wins.

_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MAP_PRIVATE_ = 0x02
_PAGE = mmap.PAGESIZE


def _lib_path() -> str:
    import glob

    return os.path.realpath((glob.glob("/usr/lib/x86_64-linux-gnu/libz.so.1*")
                             + glob.glob("/usr/lib/*/libz.so.1*") + glob.glob("/lib/*/libz.so.1*"))[0])


def _raw() -> ctypes.CDLL:
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                         ctypes.c_long)
    lib.mremap.restype = ctypes.c_void_p
    lib.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                           ctypes.c_void_p)
    lib.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    lib.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return lib


_FAILED = ctypes.c_void_p(-1).value


class _Racer:
    """Thread 2: armed with an action and a delay, it runs the action that long after
    thread 1 lets go of the GIL (entering its syscall through ctypes)."""

    def __init__(self) -> None:
        import threading

        self.action: Callable[[], object] | None = None
        self.delay_ns = 0
        self.done = threading.Event()
        self.go = threading.Event()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            self.go.wait()
            self.go.clear()
            end = time.perf_counter_ns() + self.delay_ns
            while time.perf_counter_ns() < end:
                pass
            assert self.action is not None
            self.action()
            self.done.set()

    def arm(self, action: Callable[[], object], delay_us: int) -> None:
        self.action, self.delay_ns = action, delay_us * 1000
        self.done.clear()
        self.go.set()


def _perms_at(addr: int) -> tuple[str, str]:
    with open("/proc/self/maps") as f:
        for ln in f:
            lo, _, rest = ln.partition("-")
            hi = rest.split(None, 1)[0]
            if int(lo, 16) <= addr < int(hi, 16):
                v = ln.split(None, 5)
                return v[1], (v[5].strip() if len(v) > 5 else "")
    return "", ""


def _delay(i: int, spread_us: int) -> int:
    return (i * 7919) % max(spread_us, 1)


def cow_race_tries(tries: int, spread_us: int = 600, pads: int = 300,
                   new_thread: bool = False) -> dict:
    """Issue 21 (1): mprotect(R|X) of a clean read-only page of a library while thread 2
    mremaps a patched copy-on-write copy of that page onto it. A win: the page is then
    executable and holds our byte. Makes `pads` read-only mappings of the library first
    (a longer judgement, a wider window)."""
    libc, path = _raw(), _lib_path()
    fd = os.open(path, os.O_RDONLY)
    kept = [libc.mmap(None, _PAGE, mmap.PROT_READ, _MAP_PRIVATE_, fd, 0) for _ in range(pads)]
    racer = _Racer()
    wins = refused = 0
    for i in range(tries):
        copy = libc.mmap(None, _PAGE, PROT_RW, _MAP_PRIVATE_, fd, 0)
        ctypes.memset(copy, 0xC3, 1)                        # copy on write: no longer the file's
        libc.mprotect(copy, _PAGE, mmap.PROT_READ)          # not watched: no PROT_EXEC
        tgt = libc.mmap(None, _PAGE, mmap.PROT_READ, _MAP_PRIVATE_, fd, 0)
        def move(c: int = copy, t: int = tgt) -> None:
            libc.mremap(c, _PAGE, _PAGE, _MREMAP_MAYMOVE | _MREMAP_FIXED, t)

        if new_thread:     # a thread born while the supervisor stops the worker
            import threading

            racer.arm(lambda: (th := threading.Thread(target=move), th.start(), th.join()),
                      _delay(i, spread_us))
        else:
            racer.arm(move, _delay(i, spread_us))
        rc = libc.mprotect(tgt, _PAGE, PROT_RX)
        racer.done.wait()
        if rc != 0:
            refused += 1
        elif _perms_at(tgt)[0].startswith("r-x") and ctypes.c_ubyte.from_address(tgt).value == 0xC3:
            wins += 1
        libc.munmap(tgt, _PAGE)
        libc.munmap(copy, _PAGE)
    for a in kept:
        libc.munmap(a, _PAGE)
    os.close(fd)
    return {"tries": tries, "wins": wins, "refused": refused}


def fd_swap_tries(tries: int, spread_us: int = 600) -> dict:
    """Issue 21 (2): mmap(R|X) of a library's fd while thread 2 dup2()s a copy in the
    writable /tmp onto that fd number. A win: the new mapping is the /tmp file."""
    libc, path = _raw(), _lib_path()
    with open(path, "rb") as f, open("/tmp/libswap.so", "wb") as g:
        g.write(f.read())
    lib, evil = os.open(path, os.O_RDONLY), os.open("/tmp/libswap.so", os.O_RDONLY)
    num = os.dup(lib)
    racer = _Racer()
    wins = refused = 0
    for i in range(tries):
        os.dup2(lib, num)
        racer.arm(lambda: libc.dup2(evil, num), _delay(i, spread_us))
        addr = libc.mmap(None, _PAGE, PROT_RX, _MAP_PRIVATE_, num, 0)
        racer.done.wait()
        if addr in (None, _FAILED):
            refused += 1
            continue
        if "/tmp/" in _perms_at(addr)[1]:
            wins += 1
        libc.munmap(addr, _PAGE)
    for x in (lib, evil, num):
        os.close(x)
    return {"tries": tries, "wins": wins, "refused": refused}


def cow_mremap_race(ctx: WorkerContext) -> dict:
    """Before READY (issue 21, 1): the copy-on-write mremap race, 30 tries, then the same
    moves one after the other (mremap, then mprotect), which is always refused. Before
    the fix a try could win silently; now the worker is stopped while judged and the
    result checked, so a win is impossible and the first refusal ends the worker."""
    res = cow_race_tries(30)
    libc, fd = _raw(), os.open(_lib_path(), os.O_RDONLY)
    copy = libc.mmap(None, _PAGE, PROT_RW, _MAP_PRIVATE_, fd, 0)
    ctypes.memset(copy, 0xC3, 1)
    libc.mprotect(copy, _PAGE, mmap.PROT_READ)
    tgt = libc.mmap(None, _PAGE, mmap.PROT_READ, _MAP_PRIVATE_, fd, 0)
    libc.mremap(copy, _PAGE, _PAGE, _MREMAP_MAYMOVE | _MREMAP_FIXED, tgt)
    res["last"] = "ok" if libc.mprotect(tgt, _PAGE, PROT_RX) == 0 else \
        errno.errorcode.get(ctypes.get_errno())
    return {"denied": res["wins"] == 0 and res["last"] != "ok", **res}


def thread_birth_race(ctx: WorkerContext) -> dict:
    """Red team (own work), before READY: the copy-on-write race, with the mremap made
    by a thread created just as thread 1 enters its syscall, so that it is born while
    the supervisor stops the worker (it must join the stop: the thread list is re-read
    and must be the same in both passes). No win; refused like c-cowrace."""
    res = cow_race_tries(30, new_thread=True)
    return {"denied": res["wins"] == 0, **res}


def shared_vm_child(ctx: WorkerContext) -> dict:
    """Red team (own work): a process that shares the worker's memory but is not in its
    thread group would run on while the thread group is stopped for a judgement:
    vfork, clone(CLONE_VM|CLONE_VFORK) without CLONE_THREAD, fork. All EPERM in
    control (the runtime filter: no new process)."""
    res: dict = {}
    nr_vfork, nr_clone = 58, 56
    for label, args in (("vfork", (nr_vfork,)),
                        ("clone_vm", (nr_clone, 0x100 | 0x4000 | 17, 0, 0, 0, 0))):
        rc = _libc.syscall(*(ctypes.c_long(a) for a in args))
        if rc == 0:                                   # the child, on our stack: leave now
            _libc.syscall(ctypes.c_long(60), ctypes.c_long(0))
        res[label] = "ok" if rc > 0 else errno.errorcode.get(ctypes.get_errno())
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        res["fork"] = "ok"
    except OSError as e:
        res["fork"] = _err(e)
    res["denied"] = all(v == "EPERM" for v in res.values())
    return res


def fd_swap_race(ctx: WorkerContext) -> dict:
    """Before READY (issue 21, 2): the dup2 fd-swap race, 30 tries, then the swap made
    first (always refused: /tmp is writable)."""
    res = fd_swap_tries(30)
    libc = _raw()
    fd = os.open("/tmp/libswap.so", os.O_RDONLY)
    addr = libc.mmap(None, _PAGE, PROT_RX, _MAP_PRIVATE_, fd, 0)
    res["last"] = "ok" if addr not in (None, _FAILED) else errno.errorcode.get(ctypes.get_errno())
    return {"denied": res["wins"] == 0 and res["last"] != "ok", **res}


def _status_fd_write(text: str) -> None:
    os.write(int(os.environ[ENV_STATUS_FD]), text.encode() + b"\n")


def fake_wx_lock(ctx: WorkerContext) -> dict:
    """Red team (own work): skip ctx.ready(), install a harmless filter so that
    Seccomp_filters grows as the lock would make it, and say READY with the lock's own
    words. The supervisor reads the filters back: refused (wx_lock) before the
    anonymous code 2 s later."""
    import struct

    prog = [(0x06, 0, 0, 0x7FFF0000)]                           # ret ALLOW
    raw = b"".join(struct.pack("=HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))

    class _Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = _Fprog(len(prog), ctypes.cast(buf, ctypes.c_void_p))
    rc = _libc.syscall(ctypes.c_long(317), ctypes.c_long(1), ctypes.c_long(1),   # TSYNC
                       ctypes.byref(fprog))
    _status_fd_write("READY=1 STATUS=[wx mdwe=1 seccomp=1] forged")
    time.sleep(2.0)
    return {"filter": rc, **_anon_rx()}


def wx_one_thread(ctx: WorkerContext) -> dict:
    """Red team (own work): the real W^X program, but on the main thread only (no
    TSYNC), with a second thread left free; READY by hand. Every thread is checked:
    refused (wx_lock) naming the thread."""
    import threading

    from supervisor.sandbox import wx

    free = threading.Event()
    t = threading.Thread(target=free.wait, daemon=True)
    t.start()
    flt = wx.build_filter()
    import pyseccomp

    flt.set_attr(pyseccomp.Attr.CTL_TSYNC, 0)
    flt.load()
    _status_fd_write("READY=1 STATUS=[wx mdwe=1 seccomp=1] one thread")
    time.sleep(2.0)
    return {"denied": None, "error": "not refused within 2 s"}


def sigcont_race(ctx: WorkerContext) -> dict:
    """Red team (own work), before READY: thread 2 wakes the stopped worker (SIGCONT)
    and stops it again (SIGSTOP to itself) in a loop, trying to run while a request of
    thread 1 is judged, and mremaps the patched copy when it can. The supervisor
    counts a stop only if two passes see the same stopped threads that did not run:
    no win; the worker is refused (too slow to judge, or the patched page seen)."""
    import signal
    import threading

    libc, fd = _raw(), os.open(_lib_path(), os.O_RDONLY)
    stop = threading.Event()
    main, pid = threading.get_native_id(), os.getpid()
    wins = tries = bounced = 0
    pair: list[int] = []

    def in_mprotect() -> bool:       # thread 1 waits in the kernel for the judgement
        try:
            with open(f"/proc/self/task/{main}/syscall") as f:
                return f.read().split(None, 1)[0] == "10"
        except OSError:
            return False

    def bounce() -> None:
        nonlocal bounced
        while not stop.is_set():
            if not (pair and in_mprotect()):
                time.sleep(0)
                continue
            os.kill(pid, signal.SIGCONT)          # undo the supervisor's stop
            libc.mremap(pair[0], _PAGE, _PAGE, _MREMAP_MAYMOVE | _MREMAP_FIXED, pair[1])
            pair.clear()
            bounced += 1
            if in_mprotect():                     # look stopped again (never strand thread 1)
                os.kill(pid, signal.SIGSTOP)
    threading.Thread(target=bounce, daemon=True).start()
    for tries in range(1, 31):
        c = libc.mmap(None, _PAGE, PROT_RW, _MAP_PRIVATE_, fd, 0)
        ctypes.memset(c, 0xC3, 1)
        libc.mprotect(c, _PAGE, mmap.PROT_READ)
        t = libc.mmap(None, _PAGE, mmap.PROT_READ, _MAP_PRIVATE_, fd, 0)
        pair[:] = [c, t]
        if libc.mprotect(t, _PAGE, PROT_RX) == 0 and _perms_at(t)[0].startswith("r-x") \
                and ctypes.c_ubyte.from_address(t).value == 0xC3:
            wins += 1
        pair.clear()
    stop.set()
    return {"denied": wins == 0, "tries": tries, "wins": wins, "bounced": bounced}


def raise_cpu_weight(ctx: WorkerContext) -> dict:
    """Research taking CPU from control: raise its own cgroup's weight (v2 cpu.weight,
    v1 cpu.shares) through any path to the cgroup file system it can find, or mount one."""
    res: dict = {}
    paths = [f"/sys/fs/cgroup{p}" for p in ("", "/cpu", "/cpu,cpuacct")]
    try:
        with open("/proc/self/cgroup") as f:
            for ln in f:
                rel = ln.rstrip("\n").split(":", 2)[2]
                paths += [f"/sys/fs/cgroup{rel}", f"/sys/fs/cgroup/cpu{rel}"]
    except OSError as e:
        res["proc_self_cgroup"] = _err(e)
    opened = []
    for d in dict.fromkeys(paths):
        for name in ("cpu.weight", "cpu.shares"):
            r = _open_for_write(f"{d}/{name}")
            if not r["denied"]:
                opened.append(f"{d}/{name}")
    res["opened"] = opened
    os.makedirs("/tmp/cg", exist_ok=True)
    libc = ctypes.CDLL(None, use_errno=True)
    for fstype, data in ((b"cgroup2", None), (b"cgroup", b"cpu")):
        rc = libc.mount(b"none", b"/tmp/cg", fstype, 0, data)
        res[f"mount_{fstype.decode()}"] = "ok" if rc == 0 else errno.errorcode.get(
            ctypes.get_errno(), str(ctypes.get_errno()))
    res["denied"] = not opened and all(v != "ok" for k, v in res.items() if k.startswith("mount"))
    return res


def raise_priority(ctx: WorkerContext) -> dict:
    """Take more CPU than granted: enter SCHED_FIFO or raise the FIFO priority the
    supervisor gave (to 98), clear SCHED_RESET_ON_FORK so that a thread or child keeps
    it (a child only where the domain may start processes), or lower its nice value. A control worker first waits for its grant (the
    supervisor sets it from outside after READY) so that the attack runs against it."""
    import threading

    fifo, reset = os.SCHED_FIFO, os.SCHED_RESET_ON_FORK
    if ctx.domain == "control":
        _await_fifo()
    pol = os.sched_getscheduler(0)
    granted = os.sched_getparam(0).sched_priority
    res: dict = {"granted": [pol & ~reset, granted, bool(pol & reset)]}

    def attempt(policy: int, prio: int) -> str:
        try:
            os.sched_setscheduler(0, policy, os.sched_param(prio))
        except OSError as e:
            return _err(e)
        return "ok"
    res["fifo_98"] = attempt(fifo | reset, 98)
    res["fifo_1_no_reset"] = attempt(fifo, max(granted, 1))
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -20)
        res["nice_-20"] = "ok"
    except OSError as e:
        res["nice_-20"] = _err(e)
    seen: list = []
    t = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0) & ~reset))
    t.start()
    t.join()
    res["thread_policy"] = seen[0]
    res["child_policy"] = os.SCHED_OTHER
    if ctx.isolation.exec_after_start:
        # Only where processes may be started: a locked-down worker's fork is itself
        # killed by seccomp (tests/test_sandbox.py), so no child could keep the class.
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, bytes([os.sched_getscheduler(0) & ~reset]))
            os._exit(0)
        os.waitpid(pid, 0)
        res["child_policy"] = os.read(r, 1)[0]
        os.close(r)
        os.close(w)
    res["denied"] = (all(res[k] != "ok" for k in ("fifo_98", "fifo_1_no_reset", "nice_-20"))
                     and res["thread_policy"] == res["child_policy"] == os.SCHED_OTHER)
    return res


def _await_fifo(timeout: float = 5.0, tid: int = 0) -> bool:
    """Until the supervisor's SCHED_FIFO grant (made from outside after READY) is in
    force (for thread ``tid``: 0 is the caller)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if os.sched_getscheduler(tid) & ~os.SCHED_RESET_ON_FORK == os.SCHED_FIFO:
            return True
        time.sleep(0.02)
    return False


def realtime_runaway(ctx: WorkerContext) -> dict:
    """A real-time worker gone into a busy loop (a bug, or on purpose): with its budget
    (10 % of a CPU per 100 ms in the fleet) the kernel throttles it, and everything else,
    the supervisor included, keeps the rest of the CPU. Spins 2 s of wall time."""
    res: dict = {"fifo": _await_fifo()}
    t0, c0 = time.monotonic(), time.thread_time()
    while time.monotonic() - t0 < 2.0:
        pass
    wall, cpu = time.monotonic() - t0, time.thread_time() - c0
    res.update(wall_s=round(wall, 3), cpu_s=round(cpu, 3), share=round(cpu / wall, 3))
    res["denied"] = res["fifo"] and cpu / wall < 0.25
    return res


# ---------------------------------------------------------------- red team: real-time

_SYS_FUTEX, _SYS_GETTID, _SYS_SCHED_SETATTR, _SYS_IOPRIO_SET = 202, 186, 314, 251
_FUTEX_LOCK_PI, _FUTEX_UNLOCK_PI = 6, 7


def _spin(seconds: float) -> tuple[float, float]:
    """(wall, thread CPU) of a busy loop of ``seconds`` of wall time."""
    t0, c0 = time.monotonic(), time.thread_time()
    while time.monotonic() - t0 < seconds:
        pass
    return time.monotonic() - t0, time.thread_time() - c0


def _competitor(cpu: int, end: float) -> tuple[int, int]:
    """A normal-class child pinned to ``cpu`` spinning until monotonic ``end``: (pid,
    read fd of its CPU time in ms). What a real-time hog on that CPU leaves to everyone
    else (a child that never runs before ``end`` reports ~0)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.sched_setaffinity(0, {cpu})
            c0 = time.thread_time()
            while time.monotonic() < end:
                pass
            os.write(w, str(int((time.thread_time() - c0) * 1000)).encode())
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def realtime_pi_boost(ctx: WorkerContext) -> dict:
    """Escape the RT budget by priority inheritance: a normal thread (SCHED_RESET_ON_FORK
    made it normal) takes a PI futex, the SCHED_FIFO main thread blocks on it, and the
    kernel boosts the owner to the main thread's priority. An rt_rq holding a boosted
    task is never throttled (rt_rq_throttled() ignores rt_throttled while rt_nr_boosted),
    so the boosted thread spins at real-time priority without any budget. A normal
    child pinned to the same CPU measures what is left for everyone else."""
    import threading

    res: dict = {"fifo": _await_fifo()}
    word = ctypes.c_uint32(0)
    addr = ctypes.c_void_p(ctypes.addressof(word))
    locked, out = threading.Event(), {}
    spin_s = 1.0

    def owner() -> None:
        tid = _libc.syscall(_SYS_GETTID)
        out["policy"] = os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK
        # The lock first: the PI futex itself is what must be refused (affinity is
        # refused too, see realtime_hop, and would end the attack before it).
        if _libc.syscall(_SYS_FUTEX, addr, _FUTEX_LOCK_PI, 0, None) != 0:
            out["lock"] = errno.errorcode.get(ctypes.get_errno(), "?")
            locked.set()
            return
        out["lock"] = "ok"
        # Evidence that the lock itself went through, before the next refused call.
        print("ATTACK-STEP lock_pi ok", flush=True)
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        locked.set()
        time.sleep(0.2)                    # the main thread blocks on it meanwhile
        try:
            with open(f"/proc/self/task/{tid}/sched") as f:
                out["prio"] = next((int(x.split(":")[1]) for x in f if x.startswith("prio ")), None)
        except OSError as e:
            out["prio"] = _err(e)
        pid, rfd = _competitor(cpu, time.monotonic() + spin_s)
        wall, cpu_s = _spin(spin_s)
        out.update(wall_s=round(wall, 3), cpu_s=round(cpu_s, 3))
        _libc.syscall(_SYS_FUTEX, addr, _FUTEX_UNLOCK_PI, 0, None)
        os.waitpid(pid, 0)
        out["competitor_cpu_s"] = int(os.read(rfd, 32) or b"-1000") / 1000
        os.close(rfd)

    t = threading.Thread(target=owner)
    t.start()
    locked.wait(5)
    if out.get("lock") == "ok":
        rc = _libc.syscall(_SYS_FUTEX, addr, _FUTEX_LOCK_PI, 0, None)
        res["main_lock"] = "ok" if rc == 0 else errno.errorcode.get(ctypes.get_errno(), "?")
        if rc == 0:
            _libc.syscall(_SYS_FUTEX, addr, _FUTEX_UNLOCK_PI, 0, None)
    t.join()
    res.update(out)
    res["share"] = round(out.get("cpu_s", 0) / max(out.get("wall_s", 1), 1e-9), 3)
    # Held to the 10 % budget (or never boosted into the RT class at all).
    res["denied"] = res["fifo"] and res["share"] < 0.25
    return res


def realtime_hop(ctx: WorkerContext) -> dict:
    """Escape the RT budget by hopping CPUs: cpu.rt_runtime_us is granted per CPU, so a
    SCHED_FIFO thread that moves itself to the next CPU just before its runtime on this
    one runs out gets the budget once per CPU (nothing needs a privilege: same task)."""
    res: dict = {"fifo": _await_fifo()}
    cpus = sorted(os.sched_getaffinity(0))
    res["cpus"] = len(cpus)
    i = hops = 0
    t0, c0 = time.monotonic(), time.thread_time()
    last = c0
    while time.monotonic() - t0 < 2.0:
        c = time.thread_time()
        if c - last > 0.008:               # 8 of the 10 ms per 100 ms on this CPU
            i = (i + 1) % len(cpus)
            os.sched_setaffinity(0, {cpus[i]})
            last, hops = c, hops + 1
    wall, cpu = time.monotonic() - t0, time.thread_time() - c0
    res.update(wall_s=round(wall, 3), cpu_s=round(cpu, 3), share=round(cpu / wall, 3), hops=hops)
    res["denied"] = res["fifo"] and cpu / wall < 0.14     # 10 % budget and a margin
    return res


class _SchedAttr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32),
                ("flags", ctypes.c_uint64), ("nice", ctypes.c_int32),
                ("priority", ctypes.c_uint32), ("runtime", ctypes.c_uint64),
                ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64),
                ("util_min", ctypes.c_uint32), ("util_max", ctypes.c_uint32)]


def _setattr(tid: int, **kw) -> str:
    a = _SchedAttr(size=ctypes.sizeof(_SchedAttr), **kw)
    if _libc.syscall(_SYS_SCHED_SETATTR, tid, ctypes.byref(a), 0) == 0:
        return "ok"
    return errno.errorcode.get(ctypes.get_errno(), "?")


def realtime_sched_misc(ctx: WorkerContext) -> dict:
    """Every other door to more CPU or I/O priority for a SCHED_FIFO worker: deadline
    class, RR instead of FIFO, sched_setattr without the reset flag, real-time I/O
    priority, a thread or bwrap's init made FIFO, a higher RLIMIT_RTPRIO. uclamp (a
    frequency hint, not a class) is reported, not judged."""
    import resource
    import threading

    res: dict = {"fifo": _await_fifo()}
    prio = os.sched_getparam(0).sched_priority
    res["deadline"] = _setattr(0, policy=6, runtime=2_000_000, deadline=10_000_000,
                               period=10_000_000)
    res["setattr_no_reset"] = _setattr(0, policy=os.SCHED_FIFO, priority=prio)
    try:
        os.sched_setscheduler(0, os.SCHED_RR | os.SCHED_RESET_ON_FORK, os.sched_param(prio))
        res["rr"] = "ok"
    except OSError as e:
        res["rr"] = _err(e)
    rc = _libc.syscall(_SYS_IOPRIO_SET, 1, 0, (1 << 13) | 0)     # IOPRIO_CLASS_RT, level 0
    res["ioprio_rt"] = "ok" if rc == 0 else errno.errorcode.get(ctypes.get_errno(), "?")
    try:
        os.sched_setscheduler(1, os.SCHED_FIFO, os.sched_param(1))   # bwrap's init
        res["init_fifo"] = "ok"
    except OSError as e:
        res["init_fifo"] = _err(e)
    tids: list = []
    stop = threading.Event()
    th = threading.Thread(target=lambda: (tids.append(_libc.syscall(_SYS_GETTID)), stop.wait(5)))
    th.start()
    while not tids:
        time.sleep(0.001)
    try:
        os.sched_setscheduler(tids[0], os.SCHED_FIFO, os.sched_param(1))
        res["thread_fifo"] = "ok"
    except OSError as e:
        res["thread_fifo"] = _err(e)
    stop.set()
    th.join()
    try:
        resource.setrlimit(resource.RLIMIT_RTPRIO, (99, 99))
        res["rlimit_rtprio"] = "ok"
    except (OSError, ValueError) as e:
        res["rlimit_rtprio"] = _err(e)
    res["uclamp_min_1024"] = _setattr(0, policy=os.SCHED_FIFO, priority=prio,
                                      flags=0x01 | 0x08 | 0x10 | 0x20, util_min=1024)
    res["after"] = [os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK,
                    os.sched_getparam(0).sched_priority,
                    bool(os.sched_getscheduler(0) & os.SCHED_RESET_ON_FORK)]
    judged = ("deadline", "setattr_no_reset", "rr", "ioprio_rt", "init_fifo", "thread_fifo",
              "rlimit_rtprio")
    res["denied"] = res["fifo"] and all(res[k] != "ok" for k in judged)
    return res


def realtime_pid_wrap(ctx: WorkerContext) -> dict:
    """Choose who gets the supervisor's SCHED_FIFO grant. The supervisor takes 'the
    second descendant of bwrap' (Supervisor._worker_pid: descendant_pids() lists bwrap
    init's children in /proc order, i.e. by host pid). Before READY: churn threads
    (each takes a host pid) until the host's pid counter wraps (pid_max is small on many
    machines: 32768 here), leaving a double-forked orphan (reparented to bwrap's init)
    every few thousand pids; after the wrap an orphan has a host pid below ours and is
    listed first. Each orphan reports if it was made real-time; we report our own class."""
    import threading

    n = int(ARG or "40000")            # thread churn: pid_max + a margin
    every = max(n // 12, 1)
    r, w = os.pipe()
    orphans, fork_error = 0, ""
    for i in range(n):
        if i % every == every // 2 and not fork_error:
            try:
                pid = os.fork()
            except OSError as e:              # locked down: no new process at all
                fork_error = _err(e)
                continue
            if pid == 0:                      # the middle child: exits, orphaning the next
                if os.fork() == 0:
                    os.close(r)
                    end = time.monotonic() + 30
                    while time.monotonic() < end:
                        if os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK == os.SCHED_FIFO:
                            os.write(w, b"F")
                            _spin(0.05)            # and a little RT work to show it
                            break
                        time.sleep(0.02)
                os._exit(0)
            os.waitpid(pid, 0)
            orphans += 1
        t = threading.Thread(target=int)
        t.start()
        t.join()
    os.close(w)
    res: dict = {"threads": n, "orphans": orphans, "fork_error": fork_error}
    # READY happens when we return (attack before READY); the grant follows it. Report
    # from a thread so that the main thread goes on to READY.
    def report() -> None:
        import select
        main_fifo = _await_fifo(5.0, os.getpid())   # the main thread's class
        got = select.select([r], [], [], 0.5)[0] and os.read(r, 64)
        res.update(main_fifo=main_fifo, orphan_fifo=bool(got))
        res["denied"] = main_fifo and not got
        import json
        print("ATTACK " + json.dumps({"attack": "realtime_pid_wrap_result", **res}), flush=True)
    threading.Thread(target=report, daemon=True).start()
    res["denied"] = None
    return res


ATTACKS: dict[str, Callable[[WorkerContext], dict]] = {
    f.__name__: f for f in (
        core_pattern, sysrq, proc_self_mem, reopen_rw, acl_then_reopen, fchmod_channel,
        forge_log, tty, fork_storm, memory_hog, dev_shm, ptrace, seccomp_scout, personality,
        unix_connect,
        mprotect_exec, memfd_exec, dlopen_tmp, torch_files, swallow_guard, fake_ready,
        status_flood, long_line, shutdown_flood, nested_log, modify_ldt, mremap_exec, own_listener,
        wake_abuse, announce_sink, lease_hoard, status_churn, status_escape, headless_mremap,
        shared_description, patch_library,
        raise_cpu_weight, raise_priority, realtime_runaway,
        realtime_pi_boost, realtime_hop, realtime_sched_misc, realtime_pid_wrap,
        cow_mremap_race, fd_swap_race, fake_wx_lock, wx_one_thread, sigcont_race,
        thread_birth_race, shared_vm_child,
    )
}

from .attacks_net import ATTACKS as _NET_ATTACKS  # noqa: E402  (network rule attacks)

ATTACKS.update(_NET_ATTACKS)
