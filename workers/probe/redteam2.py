"""Red-team round 2 probes (warm standby, fail-safe last word, staging, status, signals).
args: MODE [params...]"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np


def out(**kw) -> None:
    print("RT2 " + json.dumps(kw), flush=True)


def _pub(w, steer: float, engaged: float = 1.0) -> None:
    with w.loan() as loan:
        loan.array((4,), np.float32)[:] = [steer, engaged, 0.0, 0.0]
        loan.publish()


def spin(ctx, ch, nchild="4", nomask=""):
    """Publish engaged=1 as fast as possible from the worker and N forked children."""
    w = ctx.writer(ch)
    ctx.ready()
    kids = []
    for i in range(int(nchild)):
        pid = os.fork()
        if pid == 0:
            # each child keeps publishing; tag steer with child id
            k = 0
            while True:
                try:
                    _pub(w, 100.0 + i)
                except Exception:
                    pass
                k += 1
        kids.append(pid)
    out(mode="spin", kids=kids)
    t = time.monotonic()
    while True:
        _pub(w, 1.0)
        if time.monotonic() - t > 0.05:
            ctx.watchdog()
            t = time.monotonic()


def die(ctx, ms="1500", code="3"):
    ctx.ready()
    time.sleep(int(ms) / 1000)
    return int(code)


def fds(ctx):
    """What a process can see: its fds, /proc, other pids."""
    res = {}
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            res[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError as e:
            res[fd] = str(e)
    out(mode="fds", fds=res, pids=[p for p in os.listdir("/proc") if p.isdigit()],
        env={k: v for k, v in os.environ.items() if k.startswith("TRIO")})
    # try opening parent's fds via /proc/1/fd
    got = {}
    for pid in ("1", str(os.getppid())):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    x = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
                    got[f"{pid}/{fd}"] = os.readlink(f"/proc/self/fd/{x}")
                except OSError as e:
                    got[f"{pid}/{fd}"] = f"E:{e.errno}"
        except OSError as e:
            got[pid] = f"E:{e.errno}"
    out(mode="procfd", got=got)


def standby_act(ctx, what="ready"):
    """Runs in a standby before activation (the module body runs before ctx.writer)."""
    sfd = os.environ.get("TRIO_STANDBY_FD")
    out(mode="standby_pre", standby_fd=sfd, status_fd=ctx.status_fd)
    fds(ctx)
    if sfd is None:
        # active instance: be a normal publisher, then die after a while
        w = ctx.writer("x")
        ctx.ready()
        for _ in range(100):
            _pub(w, 1.0)
            ctx.watchdog()
            time.sleep(0.02)
        return 5
    if what == "ready":
        os.write(ctx.status_fd, b"READY=1\n")
    elif what == "watchdog_forge":
        # forge lines: REFUSED for guard, STATUS etc.
        os.write(ctx.status_fd, b"STATUS=hello\nREFUSED=import torch\n")
    elif what == "flood_ctl":
        import socket
        s = socket.socket(fileno=int(sfd))
        s.setblocking(False)
        n = 0
        try:
            while True:
                s.send(b"A" * 60000)
                n += 1
        except OSError as e:
            out(mode="flood_ctl", sent=n, err=str(e))
        s.detach()
    elif what == "nul":
        os.write(ctx.status_fd, b"\x00\xff\xfe STATUS=\xc3\x28\r\n" + b"READY=1\x00\n")
    elif what == "stay":
        pass
    time.sleep(30)
    return 0


def status_odd(ctx, kind="mix"):
    ctx.ready()
    if kind == "mix":
        os.write(ctx.status_fd, b"STATUS=a\x00b\nSTATUS=" + bytes(range(1, 256)) + b"\n")
        os.write(ctx.status_fd, b"WATCHDOG=1 STATUS=x STATUS=y STATUS=z\n")
        os.write(ctx.status_fd, b"READY=1 STATUS= READY=1\n")
        os.write(ctx.status_fd, b"REFUSED=" + b"x" * 40 + b" " + b"\n")
        os.write(ctx.status_fd, b"REFUSED=\n")
        os.write(ctx.status_fd, b" STATUS=" * 400 + b"\n")
    elif kind == "recursion":
        # nested " STATUS=" partition: recursion depth?
        os.write(ctx.status_fd, b"A" + b" STATUS=" * 500 + b"\n")
    elif kind == "forge_other":
        os.write(ctx.status_fd, b'STATUS=x", "worker": "controlsd", "event": "refused\n')
    for _ in range(20):
        ctx.watchdog()
        time.sleep(0.05)
    out(mode="status_odd", alive=True)
    return 0


def signals_probe(ctx):
    ctx.ready()
    res = {}
    for pid in (1, 0, -1):
        try:
            os.kill(pid, 0)
            res[pid] = "ok"
        except OSError as e:
            res[pid] = e.errno
    # pidfd of anything outside? parent pid from inside is 1 (bwrap init)
    try:
        res["getppid"] = os.getppid()
    except Exception as e:
        res["getppid"] = str(e)
    out(mode="signals", res=res)
    return 0


def staging_probe(ctx, modname=""):
    ctx.ready()
    import glob
    res = {}
    for p in ("/run", "/run/trio-staging", "/proc/1/root/run", "/proc/self/mountinfo"):
        try:
            res[p] = os.listdir(p) if os.path.isdir(p) else open(p).read()[-3000:]
        except OSError as e:
            res[p] = f"E:{e.errno}"
    sp = [p for p in sys.path if p.endswith("site-packages")]
    res["sys.path"] = sys.path
    for s in sp:
        try:
            ents = os.listdir(s)
            res[s] = [e for e in ents if "torch" in e.lower() or "triton" in e.lower()
                      or "nvidia" in e.lower() or e.endswith(".pth")]
        except OSError as e:
            res[s] = f"E:{e.errno}"
        for name in ("torch", "torch/__init__.py", "torch/lib", "functorch", "torchgen"):
            res[f"{s}/{name}"] = os.path.exists(os.path.join(s, name))
    for b in glob.glob(sys.prefix + "/bin/torch*") + glob.glob(sys.prefix + "/bin/*"):
        if "torch" in b or "convert" in b:
            try:
                res[b] = open(b).read()[:300]
            except OSError as e:
                res[b] = f"E:{e.errno}"
    # torch .so anywhere readable?
    found = []
    for root in ("/usr/lib", "/usr/local/lib", sys.prefix):
        for dp, dn, fn in os.walk(root):
            for f in fn:
                if "libtorch" in f or f.startswith("libc10") or "libshm" in f:
                    found.append(os.path.join(dp, f))
            if len(found) > 20:
                break
    res["torch_libs_found"] = found[:20]
    # writable?
    for p in ("/", "/usr", sys.prefix, "/run/trio-staging", "/work/main"):
        try:
            fd = os.open(os.path.join(p, ".rt2"), os.O_CREAT | os.O_WRONLY, 0o600)
            os.close(fd)
            res["write:" + p] = "WRITABLE"
        except OSError as e:
            res["write:" + p] = e.errno
    for k, v in res.items():
        if k != "/proc/self/mountinfo":
            out(k=k, v=v if not isinstance(v, str) else v[:600])
    try:
        __import__(modname or "json")
        out(import_torch="OK")
    except BaseException as e:
        out(import_torch=f"{type(e).__name__}: {e}"[:200])
    return 0


MODES = {f.__name__: f for f in (spin, die, fds, standby_act, status_odd, signals_probe,
                                 staging_probe)}


def main(ctx) -> int:
    argv = sys.argv[1:]
    return MODES[argv[0]](ctx, *argv[1:]) or 0


def poison(ctx, ch, how="count"):
    """A hostile writer leaves its channel header so that the supervisor's fail-safe
    writer cannot (or readers will not) accept the safe word, then dies."""
    import struct
    w = ctx.writer(ch)
    ctx.ready()
    for _ in range(20):
        _pub(w, 0.7)
        time.sleep(0.01)
    buf = w._buf
    if how == "count":
        struct.pack_into("<I", buf, 8, 7777)     # slot_count field region
        out(mode="poison", hdr=bytes(buf[:64]).hex())
    elif how == "seq":
        struct.pack_into("<Q", buf, 48, (1 << 64) - 1)
    elif how == "magic":
        buf[0:8] = b"\0" * 8
    out(mode="poison", how=how, hdr=bytes(buf[:64]).hex())
    time.sleep(0.2)
    return 3


MODES["poison"] = poison


def efd_block(ctx, ch, delay="1.0"):
    """A reader makes its writer's eventfd write block: saturate the counter, then clear
    O_NONBLOCK on the open file description it shares with the writer."""
    import fcntl
    r = ctx.reader(ch)
    ctx.ready()
    time.sleep(float(delay))
    efd = r._efd
    res = {}
    try:
        try:
            os.eventfd_read(efd)
        except BlockingIOError:
            pass
        os.eventfd_write(efd, 0xfffffffffffffffe - 1000)
        n = 0
        while True:
            try:
                os.eventfd_write(efd, 1)
                n += 1
            except BlockingIOError:
                break
        res["saturate"] = f"ok topped up {n}"
    except OSError as e:
        res["saturate"] = str(e)
    try:
        fl = fcntl.fcntl(efd, fcntl.F_GETFL)
        fcntl.fcntl(efd, fcntl.F_SETFL, fl & ~os.O_NONBLOCK)
        res["clear_nonblock"] = hex(fcntl.fcntl(efd, fcntl.F_GETFL))
    except OSError as e:
        res["clear_nonblock"] = str(e)
    out(mode="efd_block", **res)
    t = time.monotonic()
    while time.monotonic() - t < 30:
        ctx.watchdog()
        time.sleep(0.1)
    return 0


MODES["efd_block"] = efd_block
