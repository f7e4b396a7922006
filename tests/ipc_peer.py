"""A separate process at the other end of a channel, driven by the tests.

    python tests/ipc_peer.py writer   # reads JSON commands on stdin, publishes
    python tests/ipc_peer.py holder   # receives N messages, holds their leases, sleeps
    python tests/ipc_peer.py hostile  # attacks its read-only view and the names
    python tests/ipc_peer.py flood S  # native writer: turns the ring over for S seconds,
                                      # every uint64 of a payload its message's number

The channel handle arrives as JSON in $PEER_HANDLE; its fds are inherited.
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from supervisor.ipc import Reader, ReaderHandle, Writer, WriterHandle  # noqa: E402


def pattern(seed: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Deterministic contents both ends can compute."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    return rng.standard_normal(size=shape).astype(dt)


def frame_pattern(seed: int, fmt: str, width: int, height: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if fmt == "nv12":
        return [rng.integers(0, 256, (height, width), np.uint8),
                rng.integers(0, 256, (height // 2, width // 2, 2), np.uint8)]
    if fmt in ("rgb888", "bgr888"):
        return [rng.integers(0, 256, (height, width, 3), np.uint8)]
    return [rng.integers(0, 256, (height, width), np.uint8)]


def run_writer() -> None:
    w = Writer(WriterHandle.from_json(os.environ["PEER_HANDLE"]), domain="control")
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "tensor":
            # A strided view: allocate the base, publish base[slices] with its strides.
            base_shape, slices = tuple(cmd["base_shape"]), cmd["slices"]
            with w.loan() as loan:
                itemsize = np.dtype(cmd["dtype"]).itemsize
                base = loan.array(base_shape, cmd["dtype"])
                view = base[tuple(slice(*s) for s in slices)]
                if cmd.get("transpose"):
                    view = view.T
                view[...] = pattern(cmd["seed"], view.shape, cmd["dtype"])
                offset = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
                assert offset % itemsize == 0
                loan.array(view.shape, cmd["dtype"], view.strides, offset)
                seq = loan.publish()
        elif op == "frame":
            with w.loan() as loan:
                planes = loan.frame(cmd["format"], cmd["width"], cmd["height"],
                                    row_stride=cmd.get("row_stride"),
                                    pixel_range=cmd.get("range", "full"))
                for dst, src in zip(planes, frame_pattern(cmd["seed"], cmd["format"],
                                                          cmd["width"], cmd["height"])):
                    dst[...] = src
                seq = loan.publish(frame_id=cmd["seed"], capture_ts_ns=time.monotonic_ns(),
                                   exposure_us=cmd.get("exposure_us"))
        elif op == "fill":
            # Every byte of the payload equals the sequence number (mod 256): a torn read
            # would mix two values.
            with w.loan() as loan:
                a = loan.array((cmd["n"],), "uint8")
                a[...] = (w.last_sequence + 1) % 256
                seq = loan.publish()
        print(json.dumps({"seq": seq}), flush=True)


def run_flood() -> None:
    w = Writer(WriterHandle.from_json(os.environ["PEER_HANDLE"]), native=True)
    words = w.spec.slot_size // 8
    end = time.monotonic() + float(sys.argv[2])
    i = 0
    while time.monotonic() < end:
        i += 1
        with w.loan() as loan:
            loan.array((words,), "uint64")[...] = i
            loan.publish()
    print(i, flush=True)


def run_holder() -> None:
    r = Reader(ReaderHandle.from_json(os.environ["PEER_HANDLE"]))
    n = int(sys.argv[2])
    print(json.dumps({"ready": os.getpid()}), flush=True)
    held = [r.receive(timeout=10) for _ in range(n)]
    print(json.dumps({"holding": [m.sequence for m in held]}), flush=True)
    time.sleep(3600)


def _attempt(fn) -> dict:
    try:
        fn()
    except Exception as e:  # the attack failing is the expected outcome
        return {"denied": True, "error": f"{type(e).__name__}: {e}"}
    return {"denied": False, "error": ""}


def run_hostile() -> None:
    h = ReaderHandle.from_json(os.environ["PEER_HANDLE"])
    r = Reader(h)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    msg = r.receive(timeout=10)
    arr = msg.array
    results = {}

    def numpy_write():
        arr[...] = 0

    def numpy_setflags():
        arr.setflags(write=True)

    def memoryview_write():
        memoryview(r._mm)[0:8] = b"\xff" * 8

    def mmap_writable():
        mmap.mmap(h.data_fd, h.spec.segment_size, prot=mmap.PROT_READ | mmap.PROT_WRITE)

    libc = ctypes.CDLL(None, use_errno=True)
    addr = arr.__array_interface__["data"][0]
    page = addr - addr % mmap.PAGESIZE

    def mprotect():
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.mprotect(ctypes.c_void_p(page), mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE):
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))

    def proc_self_mem():
        with open("/proc/self/mem", "r+b", buffering=0) as f:
            f.seek(addr)
            f.write(b"\x00" * 16)

    def fd_write():
        os.pwrite(h.data_fd, b"\x00" * 16, h.spec.control_size)

    def fd_truncate():
        os.ftruncate(h.data_fd, 0)

    def reopen_rw_and_map():
        fd = os.open(f"/proc/self/fd/{h.data_fd}", os.O_RDWR)
        try:
            mm = mmap.mmap(fd, h.spec.segment_size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            mm[h.spec.control_size:h.spec.control_size + 8] = b"\x00" * 8
        finally:
            os.close(fd)

    def fchmod_then_reopen():
        # Inside its user namespace a reader owns the memfd's inode: chmod it writable,
        # then re-open read-write and write.
        os.fchmod(h.data_fd, 0o600)
        fd = os.open(f"/proc/self/fd/{h.data_fd}", os.O_RDWR)
        try:
            mm = mmap.mmap(fd, h.spec.segment_size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            mm[h.spec.control_size:h.spec.control_size + 8] = b"HACKHACK"
        finally:
            os.close(fd)

    def open_by_name():
        import posix_ipc

        found = [n for n in os.listdir("/dev/shm") if "trio-bridge" in n or h.spec.name in n]
        if found:
            raise AssertionError(f"names visible in /dev/shm: {found}")  # not denied
        for name in (f"/trio-bridge:{h.spec.name}", f"/{h.spec.name}"):
            try:
                posix_ipc.SharedMemory(name, read_only=False)
            except posix_ipc.ExistentialError:
                continue
            return  # opened: not denied
        raise PermissionError("no such name")

    for name, fn in [("numpy_write", numpy_write), ("numpy_setflags", numpy_setflags),
                     ("memoryview_write", memoryview_write), ("mmap_writable", mmap_writable),
                     ("mprotect", mprotect), ("proc_self_mem", proc_self_mem),
                     ("fd_write", fd_write), ("fd_truncate", fd_truncate),
                     ("reopen_rw_and_map", reopen_rw_and_map),
                     ("fchmod_then_reopen", fchmod_then_reopen), ("open_by_name", open_by_name)]:
        # PEER_SKIP: attacks a sandbox answers by killing the process (tested apart).
        if name in os.environ.get("PEER_SKIP", "").split(","):
            continue
        results[name] = _attempt(fn)
    results["still_valid"] = _attempt(msg.check)["denied"] is False
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    {"writer": run_writer, "holder": run_holder, "hostile": run_hostile,
     "flood": run_flood}[sys.argv[1]]()
