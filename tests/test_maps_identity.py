"""/proc/PID/maps judged by identity (ELF SONAME / build-id through map_files),
executable-mapping accounting after READY, and the guard's REFUSED report.

Real processes throughout: a child maps things, the test scans it from outside.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from importlib.machinery import PathFinder
from pathlib import Path

import pytest

from supervisor.admission import guard, maps
from supervisor.admission.rules import forbidden_soname

REPO = Path(__file__).resolve().parents[1]


def _torch_lib(name: str) -> Path | None:
    spec = PathFinder.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "lib" / name
    return path if path.is_file() else None


LIBC10 = _torch_lib("libc10.so")
needs_torch_libs = pytest.mark.skipif(LIBC10 is None, reason="torch not installed (research extra)")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="/proc/PID/map_files needs root")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


# A child that maps what it is told to, one command per stdin line, and
# answers one line (an address, or "ok") on stdout.
AGENT = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
R, W, X = 1, 2, 4
SHARED, PRIVATE, ANON, MAYMOVE = 0x01, 0x02, 0x20, 1
libc.mremap.restype = ctypes.c_void_p
keep = []

def mmap(size, prot, flags, fd):
    addr = libc.mmap(None, size, prot, flags, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    return addr

for mod in sys.argv[1:]:
    __import__(mod)
print("ready", flush=True)
for line in sys.stdin:
    cmd, _, arg = line.rstrip("\n").partition(" ")
    if cmd == "memfd-dlopen":   # copy a library into a memfd with a harmless name, dlopen it
        fd = os.memfd_create("harmless")
        with open(arg, "rb") as f:
            os.write(fd, f.read())
        keep.append(ctypes.CDLL(f"/proc/self/fd/{fd}"))
        out = str(fd)
    elif cmd == "dlopen":
        keep.append(ctypes.CDLL(arg))
        out = "ok"
    elif cmd == "anon":         # arg: "rx" or "rwx"
        out = hex(mmap(4096, R | X | (W if "w" in arg else 0), PRIVATE | ANON, -1))
    elif cmd == "memfd-x":      # a memfd holding the bytes of a file, mapped executable
        fd = os.memfd_create("harmless")
        with open(arg, "rb") as f:
            os.write(fd, f.read())
        keep.append(fd)
        out = hex(mmap(os.fstat(fd).st_size, R | X, PRIVATE, fd))
    elif cmd == "rewrite-x":    # arg: "FD PATH": same memfd (same inode), new bytes, mapped again
        fd, path = arg.split(" ", 1)
        fd = int(fd)
        os.ftruncate(fd, 0)
        with open(path, "rb") as f:
            os.pwrite(fd, f.read(), 0)
        out = hex(mmap(os.fstat(fd).st_size, R | X, PRIVATE, fd))
    elif cmd in ("file-x", "deleted-x"):
        fd = os.open(arg, os.O_RDONLY)
        out = hex(mmap(4096, R | X, PRIVATE, fd))
        os.close(fd)
        if cmd == "deleted-x":
            os.unlink(arg)
    elif cmd == "memfd-shared-x":  # pwrite() into the memfd changes the code
        fd = os.memfd_create("harmless")
        os.write(fd, b"\xc3" * 4096)
        keep.append(fd)
        out = hex(mmap(4096, R | X, SHARED, fd))
    elif cmd == "alias-x":   # B2: a second view of shared anonymous memory, made R+X
        rw = mmap(4096, R | W, SHARED | ANON, -1)
        rx = libc.mremap(ctypes.c_void_p(rw), ctypes.c_size_t(0), ctypes.c_size_t(4096), MAYMOVE)
        if rx in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mremap")
        if libc.mprotect(ctypes.c_void_p(rx), ctypes.c_size_t(4096), R | X) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
        ctypes.memset(rw, 0xC3, 16)
        out = hex(rx) + " " + hex(rw) + " " + str(ctypes.c_ubyte.from_address(rx).value)
    elif cmd == "patch-x":   # a private file mapping r-x, one page patched (copy on write)
        fd = os.open(arg, os.O_RDONLY)
        at = mmap(3 * 4096, R | X, PRIVATE, fd)
        os.close(fd)
        if libc.mprotect(ctypes.c_void_p(at + 4096), ctypes.c_size_t(4096), R | W) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
        ctypes.memset(at + 4096, 0xC3, 1)
        if libc.mprotect(ctypes.c_void_p(at + 4096), ctypes.c_size_t(4096), R | X) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
        out = hex(at)
    elif cmd == "moved-x":   # a patched copy of a page moved (mremap) onto the file's code
        fd = os.open(arg, os.O_RDONLY)
        code = mmap(2 * 4096, R | X, PRIVATE, fd)
        copy = mmap(4096, R | W, PRIVATE, fd)
        os.close(fd)
        ctypes.memset(copy, 0xC3, 1)
        libc.mprotect(ctypes.c_void_p(copy), ctypes.c_size_t(4096), R | X)
        moved = libc.mremap(ctypes.c_void_p(copy), ctypes.c_size_t(4096), ctypes.c_size_t(4096),
                            MAYMOVE | 2, ctypes.c_void_p(code + 4096))   # MREMAP_FIXED
        if moved in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mremap")
        out = hex(code)
    else:
        out = "?"
    print(out, flush=True)
"""


# Like a sandbox: the agent's own mount namespace with "/" read-only (so its code is
# on no writable mount of its own; /dev, /dev/shm, /proc stay writable). Same pid:
# unshare and sh exec the interpreter.
RO_ROOT = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
           'mount -o remount,bind,ro / && exec "$0" "$@"']


class Agent:
    def __init__(self, *modules: str, ro_root: bool = False) -> None:
        self.proc = subprocess.Popen(
            [*(RO_ROOT if ro_root else []), sys.executable, "-c", AGENT, *modules],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(),
        )
        assert self.read() == "ready"
        self.pid = self.proc.pid

    def read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"agent exited with {self.proc.wait()}")
        return line.strip()

    def do(self, cmd: str, arg: str = "") -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{cmd} {arg}\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def agent():
    agents: list[Agent] = []

    def start(*modules: str, ro_root: bool = False) -> Agent:
        agents.append(Agent(*modules, ro_root=ro_root))
        return agents[-1]

    yield start
    for a in agents:
        a.close()


def disk_identity(path: Path) -> maps.ElfIdentity:
    got = maps.identity_of(str(path))
    assert got is not None and got[1] is not None
    return got[1]


def at(hit: maps.MapsHit, addr: str) -> bool:
    return int(hit.address.split("-")[0], 16) == int(addr, 16)


# ---------------------------------------------------------------------------
# identity, not name


@needs_root
@needs_torch_libs
@pytest.mark.torch
def test_memfd_copy_of_libc10_is_found_by_soname_and_build_id(agent) -> None:
    a = agent()
    a.do("memfd-dlopen", str(LIBC10))
    assert maps.scan_pid(a.pid, identify=False) == []  # by name it is invisible
    hits = maps.scan_pid(a.pid)
    [hit] = hits
    assert hit.kind == "forbidden-library" and hit.backing == "memfd"
    assert hit.path == "/memfd:harmless" and forbidden_soname(hit.path) is None
    assert hit.soname == "libc10.so"
    assert hit.build_id == disk_identity(LIBC10).build_id
    assert hit.distribution == "torch"
    text = hit.describe()
    assert text.startswith(f"pid {a.pid} maps memfd:harmless (deleted) executable at ")
    assert "ELF SONAME libc10.so" in text and "refused distribution torch" in text
    assert str(hit) == text  # lifecycle logs str(h)


@needs_root
@needs_torch_libs
@pytest.mark.torch
def test_renamed_copy_is_found(agent, tmp_path: Path) -> None:
    copy = tmp_path / "libfoo.so"
    shutil.copy(LIBC10, copy)
    a = agent()
    a.do("dlopen", str(copy))
    assert maps.scan_pid(a.pid, identify=False) == []
    [hit] = maps.scan_pid(a.pid)
    assert (hit.path, hit.backing, hit.soname, hit.distribution) == (str(copy), "file", "libc10.so", "torch")
    assert hit.pattern == "libc10*"


@needs_root
@needs_torch_libs
@pytest.mark.torch
def test_build_id_alone_is_enough(agent, tmp_path: Path) -> None:
    # the SONAME rewritten in .dynstr (same length): only the build-id is left to tell
    data = LIBC10.read_bytes()
    assert b"libc10.so\0" in data
    copy = tmp_path / "libxyz.so"
    copy.write_bytes(data.replace(b"libc10.so\0", b"libxyz.so\0"))
    ident = disk_identity(copy)
    assert ident.soname == "libxyz.so" and ident.build_id == disk_identity(LIBC10).build_id
    a = agent()
    a.do("dlopen", str(copy))
    [hit] = maps.scan_pid(a.pid)
    assert hit.pattern == "build-id" and hit.soname == "libxyz.so" and hit.distribution == "torch"
    assert "ELF SONAME" not in hit.describe()
    assert f"as {LIBC10}" in hit.describe()


@needs_root
@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_soname_alone_is_enough(agent, tmp_path: Path) -> None:
    # not torch's bytes at all: a library that calls itself libtorch_cpu.so
    src = tmp_path / "bar.c"
    src.write_text("int bar(void){return 1;}\n")
    lib = tmp_path / "libbar.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libtorch_cpu.so", "-o", str(lib), str(src)], check=True)
    a = agent()
    a.do("dlopen", str(lib))
    [hit] = maps.scan_pid(a.pid)
    assert (hit.soname, hit.pattern, hit.distribution) == ("libtorch_cpu.so", "libtorch*", None)


@needs_root
@needs_torch_libs
@pytest.mark.torch
def test_rewritten_memfd_is_read_again(agent, tmp_path: Path) -> None:
    # the identity cache is per (device, inode): same memfd, new content must not hide behind it
    a = agent()
    harmless = Path(sys.executable).resolve()
    a.do("memfd-x", str(harmless))
    assert maps.scan_pid(a.pid) == []
    fd = next(n for n in os.listdir(f"/proc/{a.pid}/fd") if os.readlink(f"/proc/{a.pid}/fd/{n}").startswith("/memfd:"))
    a.do("rewrite-x", f"{fd} {LIBC10}")
    hits = maps.scan_pid(a.pid)
    assert [(h.backing, h.soname) for h in hits] == [("memfd", "libc10.so")]


@needs_root
@needs_torch_libs
@pytest.mark.torch
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
def test_without_map_files_capability_falls_back_to_fd_and_root(agent, tmp_path: Path) -> None:
    # the generated systemd unit gives the supervisor no capabilities, and map_files
    # needs CAP_SYS_ADMIN/CAP_CHECKPOINT_RESTORE: the scan must still see the memfd
    copy = tmp_path / "libfoo.so"
    shutil.copy(LIBC10, copy)
    a = agent()
    a.do("memfd-dlopen", str(LIBC10))
    a.do("dlopen", str(copy))
    code = textwrap.dedent(
        """
        import json, os, sys
        from supervisor.admission import maps
        pid = int(sys.argv[1])
        first = open(f"/proc/{pid}/maps").readline().split()[0]
        lo, hi = (int(x, 16) for x in first.split("-"))
        try:
            os.stat(f"/proc/{pid}/map_files/{lo:x}-{hi:x}")
            denied = False
        except PermissionError:
            denied = True
        hits = maps.scan_pid(pid)
        print(json.dumps({"denied": denied, "hits": [[h.backing, h.path, h.soname] for h in hits]}))
        """
    )
    out = subprocess.run(
        ["setpriv", "--bounding-set", "-sys_admin,-checkpoint_restore", sys.executable, "-c", code, str(a.pid)],
        capture_output=True, text=True, env=_env(), timeout=60,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["denied"] is True
    assert sorted(map(tuple, got["hits"])) == [
        ("file", str(copy), "libc10.so"),
        ("memfd", "/memfd:harmless", "libc10.so"),
    ]


# ---------------------------------------------------------------------------
# after READY


needs_ro_root = pytest.mark.skipif(
    shutil.which("unshare") is None or subprocess.run(
        [*RO_ROOT, "true"], capture_output=True).returncode != 0,
    reason="needs unshare and mount (a read-only root in a private mount namespace)")


@needs_root
@needs_ro_root
def test_new_exec_after_ready_and_writable_exec(agent, tmp_path: Path) -> None:
    a = agent(ro_root=True)
    snap = maps.exec_snapshot(a.pid)
    assert snap.hits == () and len(snap) > 5
    assert maps.scan_pid(a.pid, snapshot=snap) == []

    rx = a.do("anon", "rx")
    [hit] = maps.scan_pid(a.pid, snapshot=snap)
    assert (hit.kind, hit.backing, hit.perms) == ("new-exec-after-ready", "anonymous", "r-xp") and at(hit, rx)
    assert hit.describe().startswith(f"pid {a.pid} maps anonymous memory executable (r-xp) at ")
    assert "after READY" in hit.describe()
    assert maps.scan_pid(a.pid) == []  # without a snapshot it is no library, so no refusal

    rwx = a.do("anon", "rwx")
    hits = maps.scan_pid(a.pid, snapshot=snap)
    assert {h.kind for h in hits if at(h, rwx)} == {"writable-exec", "new-exec-after-ready"}
    assert hits[0].kind == "writable-exec"  # W^X first, then the new mappings
    # the snapshot itself reports W^X, so READY can be refused
    again = maps.exec_snapshot(a.pid)
    assert [(h.kind, h.perms) for h in again.hits] == [("writable-exec", "rwxp")] and at(again.hits[0], rwx)
    assert maps.scan_pid(a.pid, snapshot=again) == list(again.hits)  # still W^X, nothing new

    # every kind of backing is told apart
    data = tmp_path / "blob.bin"
    data.write_bytes(b"\xc3" * 4096)
    gone = tmp_path / "gone.bin"
    gone.write_bytes(b"\xc3" * 4096)
    addrs = {
        "memfd": a.do("memfd-x", str(data)),
        "file": a.do("file-x", str(data)),
        "deleted": a.do("file-x", str(gone)),
    }
    gone.unlink()  # from here: the agent's root is read-only
    new = [h for h in maps.scan_pid(a.pid, snapshot=again) if h.kind == "new-exec-after-ready"]
    assert {h.backing: h.address.split("-")[0] for h in new} == {k: v[2:] for k, v in addrs.items()}
    by = {h.backing: h for h in new}
    assert by["file"].path == str(data) and by["deleted"].path == str(gone) and by["deleted"].deleted
    assert "memfd:harmless (deleted)" in by["memfd"].describe()


# ---------------------------------------------------------------------------
# unsafe-exec: code that can still change after READY (red-team B1/B2)


def _unsafe_at(hits: list[maps.MapsHit] | tuple[maps.MapsHit, ...], addr: str) -> list[maps.MapsHit]:
    return [h for h in hits if h.kind == maps.KIND_UNSAFE_EXEC and at(h, addr)]


@needs_root
@needs_ro_root
def test_code_that_can_still_change_is_refused_at_ready_and_on_scan(agent, tmp_path: Path) -> None:
    a = agent(ro_root=True)
    before = maps.exec_snapshot(a.pid)
    assert before.hits == ()  # interpreter and libraries: all on the read-only root
    ro_file = tmp_path / "ro.bin"   # on "/" too: read-only for the agent
    ro_file.write_bytes(b"\xc3" * 4096)
    shm = Path("/dev/shm") / f"trio-test-{os.getpid()}.bin"  # a tmpfs the agent can write
    shm.write_bytes(b"\xc3" * 4096)
    gone = Path("/dev/shm") / f"trio-test-gone-{os.getpid()}.bin"   # deleted, writable device
    gone.write_bytes(b"\xc3" * 4096)
    upgraded = tmp_path / "upgraded.bin"   # a library a host upgrade replaced: read-only device
    upgraded.write_bytes(b"\xc3" * 4096)
    try:
        alias_rx, alias_rw, first = a.do("alias-x").split()
        assert int(first) == 0xC3  # written through the RW view, visible through the R+X one
        addrs = {
            "memfd": a.do("memfd-x", str(ro_file)),
            "memfd-shared": a.do("memfd-shared-x"),
            "alias": alias_rx,
            "tmpfs": a.do("file-x", str(shm)),
            "deleted": a.do("file-x", str(gone)),
        }
        replaced = a.do("file-x", str(upgraded))
        gone.unlink()
        upgraded.unlink()
        fine = a.do("file-x", str(ro_file))
        snap = maps.exec_snapshot(a.pid)
        for what, addr in addrs.items():
            [hit] = _unsafe_at(snap.hits, addr)
            assert "can still change after READY" in hit.describe(), (what, hit.describe())
        assert not _unsafe_at(snap.hits, alias_rw)  # not executable: only data
        assert not [h for h in snap.hits if at(h, fine)]
        assert not [h for h in snap.hits if at(h, replaced)]   # deleted, but nobody can write it
        assert {h.kind for h in snap.hits} == {maps.KIND_UNSAFE_EXEC}
        by = {what: _unsafe_at(snap.hits, addr)[0] for what, addr in addrs.items()}
        assert "memfd" in by["memfd"].describe() and "memfd" in by["memfd-shared"].describe()
        assert "shared memory" in by["alias"].describe() and by["alias"].perms == "r-xs"
        assert "writable mount" in by["tmpfs"].describe() and "/dev/shm" in by["tmpfs"].describe()
        assert "writable mount" in by["deleted"].describe() and by["deleted"].deleted
        # the scans after READY (snapshot taken before all this) say the same, besides "new"
        scan = maps.scan_pid(a.pid, snapshot=before)
        for what, addr in addrs.items():
            assert _unsafe_at(scan, addr), what
        # and so does a scan without a snapshot that asks for it (a worker's child)
        assert {h.address for h in maps.scan_pid(a.pid, immutable_code=True)} == {h.address for h in snap.hits}
        assert maps.scan_pid(a.pid) == []  # by default, without a snapshot: libraries only
    finally:
        shm.unlink(missing_ok=True)
        gone.unlink(missing_ok=True)


@needs_root
@needs_ro_root
def test_a_code_page_no_file_holds_is_refused_at_ready_and_on_scan(agent, tmp_path: Path) -> None:
    """Issue 21: a private file mapping whose page was patched (copied on write) and made
    executable again, or a patched copy moved onto the file's code by mremap: maps names
    the file, but the page is not the file's. READY and every scan refuse it, naming the
    mapping and the page; the untouched pages around it are not blamed."""
    a = agent(ro_root=True)
    before = maps.exec_snapshot(a.pid)
    assert before.hits == ()
    lib = tmp_path / "lib.bin"
    lib.write_bytes(b"\x90" * (3 * 4096))
    patched = int(a.do("patch-x", str(lib)), 16)
    moved = int(a.do("moved-x", str(lib)), 16)
    snap = maps.exec_snapshot(a.pid)
    hits = [h for h in snap.hits if h.kind == maps.KIND_FOREIGN_PAGE]
    assert {int(h.address.split("-")[0], 16) for h in hits} == {patched + 4096, moved + 4096}, \
        [h.describe() for h in snap.hits]
    for h in hits:
        assert h.path == str(lib) and f"page {int(h.address.split('-')[0], 16):#x}" in h.describe()
        assert "not the file's" in h.describe() and f"pid {a.pid}" in h.describe()
    scan = maps.scan_pid(a.pid, snapshot=before)
    assert {h.address for h in scan if h.kind == maps.KIND_FOREIGN_PAGE} == {h.address for h in hits}
    # the text alone cannot tell: only the pagemap does
    text = open(f"/proc/{a.pid}/maps").read()
    assert not [h for h in maps.scan_maps_text(a.pid, text, immutable_code=True)
                if h.kind == maps.KIND_FOREIGN_PAGE]


@needs_root
def test_foreign_page_scan_cost_is_bounded(agent) -> None:
    """The pagemap is read only for executable private file ranges: a numpy process's
    whole code costs a few hundred microseconds (printed; bounded loosely here)."""
    import time

    a = agent("numpy")
    text = open(f"/proc/{a.pid}/maps").read()
    mappings = [ln.mapping for ln in maps._parse(text) if ln.mapping is not None]
    t0 = time.perf_counter()
    for _ in range(20):
        assert maps.foreign_pages(a.pid, mappings) == {}
    per = (time.perf_counter() - t0) / 20
    pages = sum((m.end - m.start) // 4096 for m in mappings if m.backing == maps.FILE)
    print(f"\npagemap check: {len(mappings)} executable mappings, {pages} pages: {per * 1e6:.0f} us")
    assert per < 0.05


@needs_root
def test_code_on_a_writable_root_is_unsafe(agent) -> None:
    # The same interpreter, without a read-only root: its own mounts let it be rewritten.
    a = agent()
    if not maps.read_mounts(a.pid).writable:
        pytest.skip("no writable mount here")
    snap = maps.exec_snapshot(a.pid)
    paths = {h.path for h in snap.hits if h.kind == maps.KIND_UNSAFE_EXEC}
    assert os.path.realpath(sys.executable) in paths or any("libpython" in p or "libc.so" in p for p in paths)
    assert all("writable mount" in h.describe() for h in snap.hits)


def test_unsafe_exec_from_maps_text() -> None:
    mountinfo = "\n".join([
        "20 1 254:0 / / ro,relatime - ext4 /dev/vda rw",
        "21 20 0:40 / /tmp rw,nosuid - tmpfs tmpfs rw,size=1024k",
        "22 20 254:0 /srv /srv rw,relatime - ext4 /dev/vda rw",  # same device, writable bind
        "23 20 7:1 / /opt ro - squashfs /dev/loop1 ro",
        "24 20 0:41 / /sq rw - squashfs /dev/loop2 ro",  # read-only superblock
    ])
    mounts = maps.MountTable.parse(mountinfo)
    assert mounts.known == {(254, 0), (0, 40), (7, 1), (0, 41)}
    assert mounts.writable == {(254, 0): "/srv", (0, 40): "/tmp"}
    text = "\n".join([
        "7f0000000000-7f0000001000 r-xp 00000000 fe:00 11 /usr/lib/libx.so",
        "7f0000001000-7f0000002000 r-xp 00000000 00:28 12 /tmp/liby.so",
        "7f0000002000-7f0000003000 r-xp 00000000 07:01 13 /opt/libz.so",
        "7f0000003000-7f0000004000 r-xs 00000000 00:01 14 /dev/zero (deleted)",
        "7f0000004000-7f0000005000 r-xs 00000000 00:01 15 /SYSV00000000 (deleted)",
        "7f0000005000-7f0000006000 r-xs 00000000 00:01 16 [anon_shmem:jit]",
        "7f0000006000-7f0000007000 r-xp 00000000 00:01 17 /memfd:x (deleted)",
        "7f0000007000-7f0000008000 r-xp 00000000 07:01 18 /opt/libw.so (deleted)",
        "7f0000008000-7f0000009000 r-xp 00000000 00:00 0 ",
        "7f0000009000-7f000000a000 r-xp 00000000 00:00 0 [anon:tinygrad]",
        "7f000000a000-7f000000b000 r-xp 00000000 00:63 19 /elsewhere/liba.so",
        "7f000000b000-7f000000c000 r-xp 00000000 00:29 20 /sq/libb.so",
        "7f000000c000-7f000000d000 rw-s 00000000 00:01 21 /dev/zero (deleted)",
        "ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0 [vsyscall]",
    ])
    hits = maps.scan_maps_text(1, text, immutable_code=True, mounts=mounts)
    assert {h.kind for h in hits} == {maps.KIND_UNSAFE_EXEC}
    got = {h.address.split("-")[0][-4:]: h.reasons[0] for h in hits}
    # 7000 (a deleted file on the read-only /opt) is no risk: nobody in there can write it
    assert sorted(got) == ["0000", "1000", "3000", "4000", "5000", "6000", "a000"], got
    # /usr is read-only here, but /srv is a writable bind of the same device
    assert got["0000"] == "a file on a writable mount (device fe:00 is writable at /srv)"
    assert got["1000"] == "a file on a writable mount (device 00:28 is writable at /tmp)"  # 0x28 = 40
    assert all(got[k].startswith("shared memory") for k in ("3000", "4000", "5000"))
    assert got["6000"].startswith("a memfd")
    assert got["a000"] == "a file on device 00:63, which no mount of the process shows"
    # without the mount table: the rules that need none
    assert {h.address[-4:] for h in maps.scan_maps_text(1, text, immutable_code=True)} == {
        "4000", "5000", "6000", "7000", "8000"}
    assert maps.scan_maps_text(1, text) == []  # no snapshot, not asked: libraries only


@needs_root
def test_snapshot_belongs_to_one_process(agent) -> None:
    a, b = agent(), agent()
    snap = maps.exec_snapshot(a.pid)
    with pytest.raises(ValueError):
        maps.scan_pid(b.pid, snapshot=snap)
    a.close()
    with pytest.raises(maps.ProcessGone):
        maps.scan_pid(a.pid, snapshot=snap)


def test_snapshot_covers_split_mappings_only_of_the_same_object() -> None:
    lib = maps.ExecMapping(0x1000, 0x5000, "r-xp", 0x2000, "08:01", 42, "/lib/x.so", "file")
    snap = maps.ExecSnapshot(1, 0, frozenset({lib}))
    part = maps.ExecMapping(0x2000, 0x3000, "r-xp", 0x3000, "08:01", 42, "/lib/x.so", "file")
    assert snap.covers(part)  # mprotect split a piece off: no new code
    assert not snap.covers(maps.ExecMapping(0x2000, 0x3000, "r-xp", 0x0, "08:01", 42, "/lib/x.so", "file"))
    assert not snap.covers(maps.ExecMapping(0x2000, 0x3000, "r-xp", 0x3000, "08:01", 43, "/lib/x.so", "file"))
    assert not snap.covers(maps.ExecMapping(0x4000, 0x6000, "r-xp", 0x5000, "08:01", 42, "/lib/x.so", "file"))
    assert not snap.covers(maps.ExecMapping(0x2000, 0x3000, "r-xp", 0, "00:00", 0, "", "anonymous"))


# ---------------------------------------------------------------------------
# clean processes, and the ELF reader against pyelftools


@needs_root
@needs_ro_root
def test_clean_numpy_process_has_no_hits_and_reader_agrees_with_pyelftools(agent) -> None:
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    a = agent("numpy", ro_root=True)
    assert maps.scan_pid(a.pid) == []
    snap = maps.exec_snapshot(a.pid)
    assert snap.hits == ()
    assert maps.scan_pid(a.pid, snapshot=snap) == []
    files = {m.path for m in snap.mappings if m.backing == "file"}
    assert any("numpy" in p for p in files) and any("libc.so" in p for p in files)
    for path in sorted(files):
        mine = disk_identity(Path(path))
        with open(path, "rb") as f:
            elf = ELFFile(f)
            soname, needed, build_id = None, [], None
            for sec in elf.iter_sections():
                if isinstance(sec, DynamicSection):
                    for tag in sec.iter_tags():
                        if tag.entry.d_tag == "DT_SONAME":
                            soname = tag.soname
                        elif tag.entry.d_tag == "DT_NEEDED":
                            needed.append(tag.needed)
                elif sec["sh_type"] == "SHT_NOTE":
                    for note in sec.iter_notes():
                        # by name too: SystemTap's stapsdt notes also have type 3
                        if note["n_type"] == "NT_GNU_BUILD_ID" and note["n_name"] == "GNU":
                            build_id = note["n_desc"]
        assert (mine.soname, list(mine.needed), mine.build_id) == (soname, needed, build_id), path


def test_not_elf_and_truncated_files(tmp_path: Path) -> None:
    text = tmp_path / "x.so"
    text.write_text("INPUT(-lc)\n")
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"\x7fELF\x02\x01\x01" + b"\xff" * 120)
    assert maps.identity_of(str(text)) == ((text.stat().st_dev, text.stat().st_ino), None)
    got = maps.identity_of(str(junk))
    assert got is not None and got[1] in (None, maps.ElfIdentity(None, None))
    assert maps.identity_of("/dev/null") is None  # never opens a device
    assert maps.identity_of(str(tmp_path / "missing")) is None


# ---------------------------------------------------------------------------
# guard: a caught refusal is still reported


def test_guard_reports_caught_refusals_on_the_status_pipe(tmp_path: Path) -> None:
    pkg = tmp_path / "evilpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "evil.py").write_text(textwrap.dedent(
        """
        import ctypes
        for _ in range(3):
            try:
                import torch
            except ImportError:
                pass
        try:
            ctypes.CDLL("libtorch_cpu.so")
        except OSError:
            pass
        print("survived", flush=True)
        """
    ))
    r, w = os.pipe()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "from supervisor.admission import guard\nguard.install('evil')\nimport evilpkg.evil"],
            capture_output=True, text=True, timeout=60, pass_fds=(w,),
            env=_env(TRIO_STATUS_FD=str(w), PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path}"),
        )
        os.close(w)
        w = -1
        with os.fdopen(r, "rb") as f:
            r = -1
            lines = f.read().decode().splitlines()
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)
    assert proc.returncode == 0 and proc.stdout == "survived\n", proc.stderr
    assert lines == [
        "REFUSED=import torch (importer: evilpkg.evil)",  # once, though tried three times
        "REFUSED=library libtorch_cpu.so",
    ]


@needs_torch_libs
@pytest.mark.torch
def test_guard_refuses_a_memfd_copy_by_identity_and_reports_it() -> None:
    code = textwrap.dedent(
        f"""
        import ctypes, os
        from supervisor.admission import guard
        guard.install("evil")
        fd = os.memfd_create("harmless")
        with open({str(LIBC10)!r}, "rb") as f:
            os.write(fd, f.read())
        try:
            ctypes.CDLL(f"/proc/self/fd/{{fd}}")
            print("loaded")
        except guard.ForbiddenLibraryError as e:
            print("refused", fd, e)
        """
    )
    r, w = os.pipe()
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              pass_fds=(w,), env=_env(TRIO_STATUS_FD=str(w)))
        os.close(w)
        w = -1
        line = os.read(r, 4096).decode()
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    assert proc.returncode == 0, proc.stderr
    word, fd, _ = proc.stdout.split(" ", 2)
    assert word == "refused", proc.stdout
    assert line.startswith(f"REFUSED=library /proc/self/fd/{fd} (ELF SONAME libc10.so, refused distribution torch")
    assert line.endswith("\n") and line.count("\n") == 1


def test_guard_report_line_is_one_short_line_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    from supervisor.worker import ENV_STATUS_FD

    assert guard.ENV_STATUS_FD == ENV_STATUS_FD
    r, w = os.pipe()
    try:
        monkeypatch.setattr(guard, "_status_fd", [])
        monkeypatch.setenv(ENV_STATUS_FD, str(w))
        guard.report("import", "mod\nwith newline " + "é" * 2000)
        data = os.read(r, 65536)
        assert data.startswith(b"REFUSED=import mod with newline \xc3\xa9")
        assert data.endswith(b"\n") and data.count(b"\n") == 1 and len(data) < 1024
        data.decode()  # not cut inside a character
        os.close(w)
        w = -1          # never closed twice: the number may belong to someone else by now
        import resource   # an fd number no process can hold: a closed pipe, swallowed
        monkeypatch.setenv(ENV_STATUS_FD, str(resource.getrlimit(resource.RLIMIT_NOFILE)[0]))
        guard.report("library", "x")
        monkeypatch.setenv(ENV_STATUS_FD, "not-a-number")
        guard.report("library", "y")
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
