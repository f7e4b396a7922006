"""The exec watch before READY: the worker stopped while a request is judged, and the
kernel's result checked after the call (supervisor/sandbox/execwatch.py, issue 21).
The races run in a real control sandbox, served here by an ExecWatch that refuses
without killing (bench/wx_race.py's harness), so every try counts."""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import mmap
import os
from pathlib import Path

import pytest

from supervisor.sandbox import execwatch as ew

from .conftest import bwrap_unusable

REPO = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("wx_race", REPO / "bench" / "wx_race.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


def _watch() -> ew.ExecWatch:
    return ew.ExecWatch(os.open("/dev/null", os.O_RDONLY))     # a listener is not needed here


def test_the_result_check_names_what_was_not_judged():
    """_mismatch on this very process: a file mapping other than the judged file, a page
    copied on write, anonymous memory where a file was judged; and what passes."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    P = mmap.PAGESIZE
    lib = os.path.realpath(glob.glob("/usr/lib/*-linux-gnu/libexpat.so.1")[0])
    fd = os.open(lib, os.O_RDONLY)
    base = libc.mmap(None, 2 * P, 1 | 2, 0x02, fd, 0)            # private, read-write
    anon = libc.mmap(None, P, 1, 0x22, -1, 0)
    w = _watch()
    try:
        pid = os.getpid()
        ctypes.c_char.from_address(base).value                     # the file's page
        ctypes.memset(base + P, 0xCC, 1)                           # a private copy
        [v] = ew.vmas_between(pid, base, base + 2 * P)
        key = (v.dev, v.inode)
        as_x = v._replace(perms="r-xp")                            # as if the call made it X
        w._judged, w._judged_anon = {key}, False
        assert w._mismatch(pid, set(), [as_x], (base, base + P), None) is None
        got = w._mismatch(pid, set(), [as_x], (base, base + 2 * P), None)
        assert got is not None and f"page {base + P:#x} is not the file's" in got and lib in got
        assert w._mismatch(pid, {as_x}, [as_x], None, None) is None          # unchanged
        w._judged = {((0, 1), 1)}
        got = w._mismatch(pid, set(), [as_x], (base, base + P), None)
        assert got is not None and "not the file judged" in got and f"inode {v.inode}" in got
        [a] = ew.vmas_between(pid, anon, anon + P)
        a_x = a._replace(perms="r-xp")
        assert "but a file was judged" in (w._mismatch(pid, set(), [a_x], None, None) or "")
        w._judged_anon = True
        assert w._mismatch(pid, set(), [a_x], None, None) is None
        assert w._mismatch(pid, set(), [as_x._replace(perms="rwxp")], None, None) is not None
    finally:
        libc.munmap(base, 2 * P)
        libc.munmap(anon, P)
        os.close(fd)
        w.close()


@pytest.mark.sandbox
def test_races_never_win_with_the_worker_stopped():
    """Both races of issue 21, and the first with a thread born during the stop, 40 tries
    each with both threads racing: no win, and the judgements were made with the worker
    stopped. (Before the fix the same tries won: bench/wx_race.py, freeze off.)"""
    why = bwrap_unusable()
    if why:
        pytest.skip(why)
    if os.geteuid() != 0:
        pytest.skip("reading the worker's /proc needs root")
    bench = _bench()
    # cow_newthread: the mremap made by a thread born as thread 1 enters the kernel,
    # i.e. while the supervisor stops the worker (it must be stopped too)
    for race in ("cow", "fd", "cow_newthread"):
        w = bench.Worker(freeze=True)
        try:
            got = w.do(f"{race} 40 1500")
            assert got.get("tries") == 40, got
            assert got["wins"] == 0, got
            assert w.served.watch.stops >= 40, w.served.watch.stops
            refused = [v for v in w.served.verdicts if not v.allowed]
            assert len(refused) >= got["refused"], (len(refused), got)   # each one answered
        finally:
            w.close()
