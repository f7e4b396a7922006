"""The W^X lock a strict worker takes at READY (supervisor/sandbox/wx.py), and the
supervisor's check of it from outside, on real processes (forked children of this
test; the sandboxed versions are the hostile fleet's c-fakewx, c-wx1thread, c-mprotect)."""
from __future__ import annotations

import ctypes
import mmap
import os
import signal
import struct
import threading
import time

import pytest

from supervisor.sandbox import wx

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="reading another process's filters needs root")


def _child(body) -> tuple[int, int]:
    """Fork a child that runs body() then waits; returns (pid, read end of its ready pipe)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            out = body() or b"ok"
            os.write(w, out)
            time.sleep(30)
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def _reap(pid: int) -> int:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return os.waitpid(pid, 0)[1]


def _decoy() -> None:
    """A filter that allows everything: Seccomp_filters grows, nothing is locked."""
    prog = struct.pack("=HBBI", 0x06, 0, 0, 0x7FFF0000)
    buf = ctypes.create_string_buffer(prog, len(prog))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(38, 1, 0, 0, 0)                                  # no_new_privs
    assert libc.syscall(317, 1, 1, ctypes.byref(Fprog(1, ctypes.cast(buf, ctypes.c_void_p)))) == 0


def test_parse_line_reads_the_ready_words_only():
    assert wx.parse_line("[wx mdwe=1 seccomp=1] probe pid 2") == {"mdwe": True, "seccomp": True}
    assert wx.parse_line("[wx mdwe=0 seccomp=1] x") == {"mdwe": False, "seccomp": True}
    assert wx.parse_line("probe pid 2") == {}
    assert wx.parse_line("[wx mdwe=maybe] x") == {}
    assert wx.Lock(True, True).line() == "wx mdwe=1 seccomp=1"


@needs_root
def test_locked_process_passes_and_dies_at_any_new_executable_memory():
    def body() -> bytes:
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        return b"%d" % wx.lock().mdwe
    pid, r = _child(body)
    try:
        mdwe = os.read(r, 8)
        assert mdwe in (b"0", b"1")
        assert (mdwe == b"1") == wx.kernel_has_mdwe()
        got = wx.verify(pid, baseline=0)
        assert got.ok and got.how == "ptrace" and got.threads == 2, got
        assert got.ms < 500, got
    finally:
        _reap(pid)


@needs_root
@pytest.mark.parametrize("what", ["mmap_exec", "mprotect_exec", "memfd", "memfd_secret",
                                  "pkey_mprotect"])
def test_the_filter_kills_each_door(what):
    """Judged on register arguments only: no user notification, no supervisor."""
    def body() -> bytes:
        wx.lock()
        libc = ctypes.CDLL(None, use_errno=True)
        if what == "mmap_exec":
            mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_EXEC)
        elif what == "memfd":
            os.memfd_create("x")
        elif what == "memfd_secret":
            libc.syscall(447, 0)          # __NR_memfd_secret (x86-64, aarch64)
        else:
            m = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            if what == "mprotect_exec":
                libc.mprotect(ctypes.c_void_p(addr), mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC)
            else:
                libc.syscall(329, ctypes.c_void_p(addr), mmap.PAGESIZE, 5, -1)
        return b"survived"
    pid, r = _child(body)
    try:
        assert os.read(r, 16) == b""                        # died before writing
    finally:
        status = _reap(pid)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSYS, status


@needs_root
def test_mdwe_alone_refuses_exec_gain():
    """Where the kernel has MDWE, a mapping cannot gain PROT_EXEC even without the filter."""
    if not wx.kernel_has_mdwe():
        pytest.skip("no MDWE in this kernel")

    def body() -> bytes:
        assert wx.set_mdwe()
        libc = ctypes.CDLL(None, use_errno=True)
        m = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        rc = libc.mprotect(ctypes.c_void_p(addr), mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC)
        return b"%d %d" % (rc, ctypes.get_errno())
    pid, r = _child(body)
    try:
        rc, err = os.read(r, 16).split()
        assert (int(rc), int(err)) == (-1, 13), (rc, err)    # EACCES
    finally:
        _reap(pid)


@needs_root
def test_a_decoy_filter_does_not_pass_for_the_lock():
    """Red team: a harmless filter makes Seccomp_filters grow as the lock would; only the
    W^X program itself, read back from the kernel, counts."""
    pid, r = _child(_decoy)
    try:
        os.read(r, 8)
        assert wx.filter_count(pid) == 1
        got = wx.verify(pid, baseline=0)
        assert not got.ok and "none of them the W^X filter" in got.reason, got
        # the count alone would have been fooled: that is why it is only a fallback
        assert wx._by_count(pid, 0, time.monotonic(), "test").ok
    finally:
        _reap(pid)


@needs_root
def test_the_lock_on_one_thread_only_is_refused():
    """Red team: the W^X program loaded without TSYNC (main thread only), a second thread
    left free: every thread is checked, and the free one is named."""
    free: list[int] = []

    def body() -> bytes:
        import pyseccomp

        ev = threading.Event()
        t = threading.Thread(target=lambda: (free.append(threading.get_native_id()), ev.wait()),
                             daemon=True)
        t.start()
        while not free:
            time.sleep(0.001)
        flt = wx.build_filter()
        flt.set_attr(pyseccomp.Attr.CTL_TSYNC, 0)
        flt.load()
        return b"%d" % free[0]
    pid, r = _child(body)
    try:
        tid = int(os.read(r, 16))
        got = wx.verify(pid, baseline=0)
        assert not got.ok and f"thread {tid} " in got.reason, got
    finally:
        _reap(pid)


@needs_root
def test_threads_are_let_go_after_the_check():
    """The check seizes and stops every thread; afterwards the process runs on (no
    ptrace left attached, no thread left stopped)."""
    def body() -> bytes:
        wx.lock()
        threading.Thread(target=lambda: [time.sleep(0.001) for _ in range(100000)],
                         daemon=True).start()
        return b"ok"
    pid, r = _child(body)
    try:
        os.read(r, 8)
        assert wx.verify(pid, baseline=None).ok
        time.sleep(0.05)
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                st = dict(ln.split(":", 1) for ln in f.read().splitlines() if ":" in ln)
            assert st["TracerPid"].strip() == "0", st
            assert not st["State"].strip().startswith(("T", "t")), st
    finally:
        _reap(pid)


def test_count_fallback_needs_a_baseline():
    got = wx._by_count(os.getpid(), None, time.monotonic(), "no ptrace")
    assert not got.ok and "no filter count" in got.reason


@needs_root
def test_threads_exiting_during_the_check_are_not_a_refusal():
    """A locked worker whose threads come and go (a hand-over thread that ends right at
    READY): a thread that exits while it is seized is gone, not unverifiable. Seen in CI:
    an adopted standby refused "[Errno 3] PTRACE_SECCOMP_GET_FILTER" and the control
    worker given up after an ordinary kill."""
    def body() -> bytes:
        wx.lock()

        def churn() -> None:
            while True:
                t = threading.Thread(target=lambda: None)
                t.start()
                t.join()
        threading.Thread(target=churn, daemon=True).start()
        return b"ok"
    pid, r = _child(body)
    try:
        os.read(r, 8)
        refusals = [got.reason for got in (wx.verify(pid, baseline=None) for _ in range(300))
                    if not got.ok]
        assert not refusals, refusals[:3]
    finally:
        _reap(pid)


@needs_root
def test_a_worker_killed_during_the_check_is_gone_not_unverifiable():
    """The kill that makes a standby take over can land while its READY is being
    checked (CI: ESRCH from the filter read-back of a seized, stopped thread, so the
    standby was refused and the control worker given up). Killed mid-check, a worker
    is either verified (killed after) or reported gone (ProcessLookupError), never
    "cannot be checked" nor "without the lock"."""
    import random

    outcomes: dict[str, int] = {}
    for _ in range(60):
        def body() -> bytes:
            wx.lock()
            for _ in range(3):
                threading.Thread(target=lambda: time.sleep(30), daemon=True).start()
            return b"ok"
        pid, r = _child(body)
        os.read(r, 8)
        killer = threading.Timer(random.uniform(0, 0.002), os.kill, (pid, signal.SIGKILL))
        killer.start()
        try:
            got = wx.verify(pid, baseline=None)
            key = "ok" if got.ok else f"refused: {got.reason}"
        except ProcessLookupError:
            key = "gone"
        except OSError as e:
            key = f"error: {e}"
        finally:
            killer.join()
            os.close(r)
        # Its death is not held up by the check (a thread seized as it died stays a
        # traced zombie until its tracer collects it; the process's exit waits for it).
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    break
            except ChildProcessError:       # the check, as its tracer, collected it
                break
            time.sleep(0.001)
        else:
            key = "exit held up"
        outcomes[key] = outcomes.get(key, 0) + 1
    assert set(outcomes) <= {"ok", "gone"}, outcomes
