"""Per-worker cgroups on the real kernel: memory (shared memory counted), pids, CPU quota.

Every test creates its own tree under this process's cgroup and removes it, even on
failure (a safety net that does not rely on the code under test runs after close()).
Skipped with the reason when this machine cannot give us cgroups.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supervisor.sandbox.cgroups import CgroupTree, CgroupUnavailable, Limits, WorkerCgroup

MiB = 1 << 20
ROOT = str(Path(__file__).resolve().parents[1])
UNIFIED = "/sys/fs/cgroup/unified"


def _force_cleanup(paths) -> None:
    """Independent of the module under test: SIGKILL whatever is left, rmdir bottom-up."""
    for top in paths:
        for _ in range(200):
            if not os.path.isdir(top):
                break
            dirs = [cur for cur, _d, _f in os.walk(top, topdown=False)]
            alive = False
            for d in dirs:
                try:
                    pids = [int(x) for x in open(f"{d}/cgroup.procs").read().split()]
                except OSError:
                    pids = []
                for pid in pids:
                    alive = True
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            if not alive:
                for d in dirs:
                    try:
                        os.rmdir(d)
                    except OSError:
                        pass
            time.sleep(0.01)


def _dead(pid: int) -> bool:
    """Gone or a zombie (an orphan waits for whatever reaps orphans here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture
def tree():
    try:
        t = CgroupTree.create(f"trio-cgtest-{os.getpid()}-{secrets.token_hex(3)}")
    except CgroupUnavailable as e:
        pytest.skip(f"cgroups unavailable on this machine: {e}")
    try:
        yield t
    finally:
        try:
            t.close()
        finally:
            _force_cleanup(t.paths)


@pytest.fixture
def start():
    """start(leaf, code, *args) -> Popen of `python -c code` joined to leaf before exec."""
    procs: list[subprocess.Popen] = []

    def _start(leaf: WorkerCgroup, code: str, *args: object) -> subprocess.Popen:
        fds = leaf.open_join_fds()
        try:
            p = subprocess.Popen(
                [sys.executable, "-I", "-c", code, *map(str, args)],
                preexec_fn=lambda: WorkerCgroup.join(fds),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        finally:
            for fd in fds:
                os.close(fd)
        procs.append(p)
        return p

    yield _start
    for p in procs:
        if p.poll() is None:
            p.kill()
        try:
            p.communicate(timeout=10)
        except subprocess.TimeoutExpired:    # a grandchild holds the pipes; the tree fixture kills it
            pass


def test_trees_of_dead_supervisors_are_swept(tree):
    """A supervisor killed with SIGKILL leaves its empty tree behind; the next one of the
    same PID namespace removes it. A live PID's tree, another namespace's and a tree that
    still holds a process are left alone (only rmdir, never a kill)."""
    ns = os.stat("/proc/self/ns/pid").st_ino
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    names = {"dead": f"trio-supervisor-{ns}-{dead}", "live": f"trio-supervisor-{ns}-1",
             "other ns": f"trio-supervisor-{ns + 1}-{dead}",
             "busy": f"trio-supervisor-{ns}-4194303"}       # a PID nobody has
    parents = {os.path.dirname(p) for p in tree.paths}
    made = [f"{parent}/{n}" for parent in parents for n in names.values()]
    for d in made:
        os.makedirs(f"{d}/leaf", exist_ok=True)
    busy = [f"{parent}/{names['busy']}/leaf" for parent in parents]
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        for d in busy:
            with open(f"{d}/cgroup.procs", "w") as f:
                f.write(str(sleeper.pid))
        CgroupTree.create(f"trio-cgtest-{os.getpid()}-{secrets.token_hex(3)}").close()
        for parent in parents:
            assert not os.path.exists(f"{parent}/{names['dead']}")
            for kept in ("live", "other ns", "busy"):
                assert os.path.isdir(f"{parent}/{names[kept]}/leaf"), kept
        assert sleeper.poll() is None                # never a kill
    finally:
        sleeper.kill()
        sleeper.wait()
        for d in sorted(made, reverse=True):
            for sub in (f"{d}/leaf", d):
                for _ in range(100):
                    try:
                        os.rmdir(sub)
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.02)


def test_limits_are_validated():
    for bad in (dict(memory_max=0), dict(memory_max=1.5e9), dict(pids_max=0),
                dict(pids_max=True), dict(cpu_quota_pct=0.5), dict(cpu_quota_pct=float("nan"))):
        with pytest.raises(ValueError):
            Limits(**bad)
    assert Limits(cpu_quota_pct=150).cpu_quota_us == 150_000
    for bad in (dict(cpu_weight=0), dict(cpu_weight=10001), dict(cpu_weight=1.5)):
        with pytest.raises(ValueError):
            Limits(**bad)
    with pytest.raises(ValueError):
        CgroupTree.create("../escape")


def test_in_force_reads_back_the_limits(tree):
    w = tree.leaf("limits", Limits(memory_max=48 * MiB, pids_max=7, cpu_quota_pct=150))
    got = w.in_force()
    assert got["version"] == tree.version
    assert got["paths"] == list(w.paths) and all(os.path.isdir(p) for p in w.paths)
    assert got["memory_max"] == 48 * MiB
    assert got["pids_max"] == 7
    assert (got["cpu_quota_us"], got["cpu_period_us"]) == (150_000, 100_000)
    files = got["files"]
    if "memory.memsw.limit_in_bytes" in files or "memory.swap.max" in files:
        assert got["swap_max"] == 0, files          # no swap escape where the kernel has the knob
    if tree.version == 2:
        assert files.get("memory.oom.group", "1") == "1"

    assert tree.leaf("heavy", Limits(cpu_weight=1000)).in_force()["cpu_weight"] == 1000
    free = tree.leaf("free", Limits()).in_force()
    assert free["cpu_weight"] == 100                # the kernel's default share
    assert (free["memory_max"], free["pids_max"], free["cpu_quota_us"]) == (None, None, None)
    assert free["cpu_period_us"] == 100_000


FORK_STORM = r"""
import json, os, sys
r, w = os.pipe()
kids, eagain, other = [], 0, []
for _ in range(100):
    try:
        pid = os.fork()
    except BlockingIOError:          # EAGAIN: pids.max reached
        eagain += 1
        continue
    except OSError as e:
        other.append(e.errno)
        continue
    if pid == 0:
        os.close(w); os.read(r, 1); os._exit(0)
    kids.append(pid)
print(json.dumps({"forked": len(kids), "eagain": eagain, "other": other, "kids": kids}), flush=True)
sys.stdin.readline()
os.close(w)
for k in kids:
    os.waitpid(k, 0)
print("survived", flush=True)
"""


def test_pids_max_stops_a_fork_storm(tree, start):
    w = tree.leaf("storm", Limits(pids_max=16))
    p = start(w, FORK_STORM)
    res = json.loads(p.stdout.readline() or p.communicate()[1] or "{}")
    print(f"\nfork storm, pids_max=16: {res['forked']} forks succeeded, {res['eagain']} EAGAIN")
    assert res["other"] == []
    assert 1 <= res["forked"] <= 15 and res["eagain"] >= 85
    assert w.pids() == sorted([p.pid, *res["kids"]])
    p.stdin.write("\n")
    p.stdin.flush()
    out, err = p.communicate(timeout=10)
    assert p.returncode == 0 and out.strip() == "survived", err


FILL_MEMFD = r"""
import mmap, os, sys
n = int(sys.argv[1])
fd = os.memfd_create("fill")
os.ftruncate(fd, n)
m = mmap.mmap(fd, n)
print("start", flush=True)
chunk = b"\xa5" * (1 << 20)
for off in range(0, n, 1 << 20):
    m[off:off + (1 << 20)] = chunk        # shmem pages, charged on fault
print("filled", flush=True)
"""

FILL_TMPFS = r"""
import os, sys
n, path = int(sys.argv[1]), sys.argv[2]
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
print("start", flush=True)
chunk = b"\xa5" * (1 << 20)
for _ in range(n >> 20):
    os.write(fd, chunk)                   # tmpfs pages via write(), never mapped
print("filled", flush=True)
"""


def _tmpfs_dir() -> str | None:
    with open("/proc/mounts") as f:
        return next((ln.split()[1] for ln in f if ln.split()[1:3] == ["/dev/shm", "tmpfs"]), None)


@pytest.mark.parametrize("how", ["memfd-mmap", "tmpfs-write"])
def test_memory_max_counts_shared_memory(tree, start, how):
    w = tree.leaf(f"mem-{how}", Limits(memory_max=64 * MiB))
    path = None
    if how == "tmpfs-write":
        shm = _tmpfs_dir()
        if shm is None:
            pytest.skip("/dev/shm is not a tmpfs here")
        path = f"{shm}/trio-cgtest-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        p = start(w, FILL_MEMFD if path is None else FILL_TMPFS, 256 * MiB, path)
        assert p.stdout.readline() == "start\n", p.communicate()[1]
        t0 = time.monotonic()
        out, err = p.communicate(timeout=30)
        dt = time.monotonic() - t0
        print(f"\n{how}: 256 MiB into a 64 MiB cgroup -> rc {p.returncode} {dt * 1000:.0f} ms "
              f"after it started filling, oom_kills={w.oom_kills()}")
        assert p.returncode == -signal.SIGKILL, (out, err)
        assert "filled" not in out
        assert w.oom_kills() >= 1
    finally:
        if path is not None and os.path.exists(path):
            os.unlink(path)                   # tmpfs pages outlive the writer until unlinked


def test_memory_under_the_limit_survives(tree, start):
    w = tree.leaf("mem-ok", Limits(memory_max=64 * MiB))
    p = start(w, FILL_MEMFD, 16 * MiB)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0 and out.split() == ["start", "filled"], err
    assert w.oom_kills() == 0


BUSY = r"""
import sys, time
t0 = time.monotonic()
while time.monotonic() - t0 < 1.0:
    pass
print("busy done", flush=True)
sys.stdin.readline()
"""


def test_cpu_quota_throttles(tree, start):
    w = tree.leaf("cpu", Limits(cpu_quota_pct=20))
    t0 = time.monotonic()
    p = start(w, BUSY)
    assert p.stdout.readline().strip() == "busy done", p.communicate()[1]
    wall = time.monotonic() - t0
    fields = open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    stat_dir = next(d for d in w.paths if os.path.exists(f"{d}/cpu.stat"))
    stat = dict(ln.split() for ln in open(f"{stat_dir}/cpu.stat").read().splitlines())
    print(f"\ncpu_quota_pct=20: {cpu:.2f} s CPU in {wall:.2f} s wall, nr_throttled={stat['nr_throttled']}")
    assert wall >= 1.0
    assert cpu <= 0.35
    assert int(stat["nr_throttled"]) > 0
    p.stdin.write("\n")
    p.stdin.flush()
    p.communicate(timeout=10)


SPIN = r"""
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})     # both groups on one CPU: they compete
print("spinning", flush=True)
start, end = float(sys.argv[2]), float(sys.argv[3])   # CLOCK_MONOTONIC: one for both
while time.monotonic() < start:
    time.sleep(0.001)
t0 = os.times()
while time.monotonic() < end:
    pass
t = os.times()
print(t.user + t.system - t0.user - t0.system, flush=True)
"""


def test_cpu_weight_decides_who_waits_under_contention(tree, start):
    """Control's default weight (1000) against research's (100), both wanting the same
    CPU: the heavy group gets most of it; with equal weights they would split it."""
    cpu = min(os.sched_getaffinity(0))
    heavy = tree.leaf("heavy", Limits(cpu_weight=1000))
    light = tree.leaf("light", Limits(cpu_weight=100))
    t0 = time.monotonic() + 0.5                     # both started and spinning by then
    procs = [start(heavy, SPIN, cpu, t0, t0 + 1.5), start(light, SPIN, cpu, t0, t0 + 1.5)]
    assert all(p.stdout.readline().strip() == "spinning" for p in procs)
    h, li = (float(p.stdout.readline()) for p in procs)
    print(f"\ncpu_weight 1000 vs 100 on one CPU: {h:.2f} s vs {li:.2f} s CPU")
    assert h > 3 * li, (h, li)


SLEEPER = r"""
import subprocess, sys, time
kid = subprocess.Popen([sys.executable, "-I", "-c", "import time; time.sleep(60)"],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(kid.pid, flush=True)
time.sleep(60)
"""


def test_leaf_twice_gives_a_fresh_cgroup_and_kills_leftovers(tree, start):
    old = tree.leaf("again", Limits(pids_max=8))
    p = start(old, SLEEPER)
    grandchild = int(p.stdout.readline())
    assert set(old.pids()) == {p.pid, grandchild}
    inos = [os.stat(d).st_ino for d in old.paths]

    new = tree.leaf("again", Limits(pids_max=9))
    assert p.wait(timeout=5) == -signal.SIGKILL
    assert _dead(grandchild)
    assert new.paths == old.paths
    assert [os.stat(d).st_ino for d in new.paths] != inos
    assert new.pids() == [] and new.in_force()["pids_max"] == 9
    # The stale handle no longer reaches its successor.
    assert old.pids() == []
    old.remove()
    assert all(os.path.isdir(d) for d in new.paths)
    with pytest.raises(FileNotFoundError):
        old.open_join_fds()


def test_close_kills_leftovers_and_removes_everything(tree, start):
    a = tree.leaf("a", Limits(memory_max=64 * MiB, pids_max=8, cpu_quota_pct=50))
    b = tree.leaf("b", Limits())
    pa, pb = start(a, SLEEPER), start(b, SLEEPER)
    grandchild = int(pa.stdout.readline())
    pb.stdout.readline()
    dirs = [*tree.paths, *a.paths, *b.paths]
    assert all(os.path.isdir(d) for d in dirs)

    tree.close()
    assert pa.wait(timeout=5) == -signal.SIGKILL and pb.wait(timeout=5) == -signal.SIGKILL
    assert _dead(grandchild)
    assert not any(os.path.exists(d) for d in dirs)
    tree.close()                              # idempotent
    with pytest.raises(RuntimeError):
        tree.leaf("c", Limits())


READONLY_CHILD = r"""
import sys
sys.path.insert(0, sys.argv[1])
from supervisor.sandbox.cgroups import CgroupTree, CgroupUnavailable
try:
    CgroupTree.create("trio-cgtest-ro")
except CgroupUnavailable as e:
    print("UNAVAILABLE", e)
else:
    print("CREATED")
"""


def test_read_only_cgroupfs_is_a_clear_error(tree):
    # In a private mount namespace remount every cgroup mount read-only (as a container
    # runtime does) and try there; the host's mounts are not touched.
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1)")
    script = ("set -e; for m in $(awk '$3 ~ /^cgroup/ || $2 == \"/sys/fs/cgroup\" {print $2}' /proc/mounts); "
              "do mount -o remount,bind,ro \"$m\"; done; exec \"$0\" -I -c \"$1\" \"$2\"")
    r = subprocess.run([unshare, "--mount", "--propagation", "private", "sh", "-c", script,
                        sys.executable, READONLY_CHILD, ROOT], capture_output=True, text=True, timeout=30)
    print(f"\nread-only: {r.stdout.strip()}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("UNAVAILABLE") and "read-only" in r.stdout.lower(), r.stdout
    assert not os.path.exists(f"{tree.paths[0].rsplit('/', 1)[0]}/trio-cgtest-ro")


V2_CHILD = r"""
import json, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
from supervisor.sandbox.cgroups import CgroupTree, CgroupUnavailable, Limits, WorkerCgroup
def spawn(w):
    fds = w.open_join_fds()
    try:
        return subprocess.Popen(["sleep", "60"], preexec_fn=lambda: WorkerCgroup.join(fds))
    finally:
        for fd in fds:
            os.close(fd)
try:
    t = CgroupTree._create("t", root=sys.argv[2], controllers=())
except CgroupUnavailable as e:
    print(json.dumps({"unavailable": str(e)}))
    sys.exit()
res = {"version": t.version, "paths": t.paths,
       "own": [l for l in open("/proc/self/cgroup").read().splitlines() if l.startswith("0::")][0]}
w = t.leaf("w", Limits())
p = spawn(w)
res["leaf_pids"], res["sleep_pid"] = w.pids(), p.pid
res["in_force"] = w.in_force()
w.kill_all()
res["sleep_rc"], res["after_kill"] = p.wait(), w.pids()
ino = os.stat(w.paths[0]).st_ino
w2 = t.leaf("w", Limits())
res["fresh"] = os.stat(w2.paths[0]).st_ino != ino
p2 = spawn(w2)
t.close()
res["closed_rc"] = p2.wait()
res["left"] = [x for x in (*t.paths, *w2.paths) if os.path.exists(x)]
print(json.dumps(res))
"""


@pytest.fixture
def v2_outer():
    """A cgroup in the (controller-less) cgroup2 of a hybrid system, standing in for a
    service's delegated cgroup; skipped where there is none."""
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        pytest.skip("/sys/fs/cgroup is cgroup2: the other tests already run the v2 code")
    if not os.path.exists(f"{UNIFIED}/cgroup.controllers"):
        pytest.skip(f"no cgroup2 mounted at {UNIFIED}")
    outer = f"{UNIFIED}/trio-cgtest-v2-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        os.mkdir(outer)
    except OSError as e:
        pytest.skip(f"cannot create {outer}: {e}")
    try:
        yield outer
    finally:
        _force_cleanup([outer])
        assert not os.path.exists(outer)


def _run_in(outer: str, argv: list[str], **kw) -> subprocess.Popen:
    fd = os.open(f"{outer}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
    try:
        return subprocess.Popen(argv, preexec_fn=lambda: WorkerCgroup.join([fd]), **kw)
    finally:
        os.close(fd)


def test_v2_code_path_on_the_unified_hierarchy(v2_outer):
    # Runs the v2 logic (move out of an occupied cgroup, leaves, join, cgroup.kill, fresh
    # leaf, close) in a process placed in v2_outer. No controller can be enabled there (on
    # this hybrid machine memory/pids/cpu belong to v1), so limits are not exercised.
    p = _run_in(v2_outer, [sys.executable, "-I", "-c", V2_CHILD, ROOT, UNIFIED],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    res = json.loads(out)
    rel = v2_outer[len(UNIFIED):]
    assert res["version"] == 2
    assert res["own"] == f"0::{rel}/supervisor"        # moved out of the occupied cgroup first
    assert res["paths"] == [f"{v2_outer}/t"]
    assert res["leaf_pids"] == [res["sleep_pid"]]
    assert res["in_force"]["version"] == 2 and res["in_force"]["memory_max"] is None
    assert res["sleep_rc"] == -signal.SIGKILL and res["after_kill"] == []
    assert res["fresh"] and res["closed_rc"] == -signal.SIGKILL and res["left"] == []
    assert [d for d in os.listdir(v2_outer) if os.path.isdir(f"{v2_outer}/{d}")] == ["supervisor"]


def test_v2_refuses_when_other_processes_share_our_cgroup(v2_outer):
    other = _run_in(v2_outer, ["sleep", "60"])
    try:
        p = _run_in(v2_outer, [sys.executable, "-I", "-c", V2_CHILD, ROOT, UNIFIED],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(timeout=30)
        assert p.returncode == 0, err
        reason = json.loads(out)["unavailable"]
        assert "still holds processes" in reason and str(other.pid) in reason, reason
    finally:
        other.kill()
        other.wait()


def _rt_share(d: str) -> float:
    with open(f"{d}/cpu.rt_runtime_us") as f, open(f"{d}/cpu.rt_period_us") as g:
        return max(int(f.read()), 0) / int(g.read())


def test_a_closed_tree_gives_its_rt_bandwidth_back_at_once(tree):
    """A removed v1 cgroup kept its RT bandwidth counted against its parent's for
    seconds: a supervisor started right after another (systemd's Restart=, every second
    e2e bench run) could reserve none and ran its real-time workers in the normal class.
    Closing gives it back first: each tree reserves most of what is free, and the next,
    made at once after its close, reserves the same again, twice over."""
    cpu = tree._bases.get("cpu")
    if tree.version != 1 or cpu is None or not os.path.exists(f"{cpu}/cpu.rt_runtime_us"):
        pytest.skip("no cgroup v1 RT group scheduling here")
    parent = os.path.dirname(cpu)
    # What the parent has left: its share less its other children's (leftovers of other
    # runs on a shared machine hold some; the claim is about ours).
    holders = {d: _rt_share(f"{parent}/{d}") for d in os.listdir(parent)
               if f"{parent}/{d}" != cpu and os.path.exists(f"{parent}/{d}/cpu.rt_runtime_us")}
    free = _rt_share(parent) - sum(holders.values())
    runtime = int(free * 0.9 * 100_000)         # most of it: a lingering tree would block
    if runtime < 1000:
        pytest.skip(f"the parent cgroup has no RT runtime free: {holders}")
    tree.reserve_rt(runtime, 100_000)
    tree.close()
    for _ in range(2):
        t = CgroupTree.create(f"trio-cgtest-{os.getpid()}-{secrets.token_hex(3)}")
        try:
            assert t.reserve_rt(runtime, 100_000)
            assert t.leaf("w", Limits()).grant_rt(runtime // 2, 100_000)
        finally:
            try:
                t.close()
            finally:
                _force_cleanup(t.paths)
