"""Portable sandboxes (issue 23): each condition met on another machine, recreated here in a
test that names it.

* GPU machine: torch, triton (with its own ptxas) and nvidia-* wheels nested in a
  read-only site-packages: every control sandbox died at start ("Can't mkdir parents
  for .../triton/backends/nvidia/bin: Read-only file system"), and `check` had passed.
* Ubuntu 24.04: AppArmor's kernel.apparmor_restrict_unprivileged_userns (a fake /proc).
* cgroup v2 with no controller delegated (this machine's empty cgroup2 at
  /sys/fs/cgroup/unified), cgroup v1 with a controller unusable (read-only, in a private
  mount namespace): limits degrade with one report naming which are off; the rest runs.
* an interpreter under a 0700 home, run by sandboxes as other host uids.
* a worker's math libraries sized to the machine's core count (OpenBLAS: 16 threads).

Real sandboxes throughout; kernel knobs are only read.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from supervisor.sandbox import cgroups, launch, probe
from supervisor.sandbox.bwrap import build_bwrap_argv, compiler_masks, masks_to_mount
from supervisor.sandbox.policy import THREAD_ENV, for_worker, policy_for_domain, thread_count

from .conftest import bwrap_unusable

ROOT = str(Path(__file__).resolve().parents[1])
UNIFIED = "/sys/fs/cgroup/unified"
_why = bwrap_unusable()
needs_bwrap = pytest.mark.skipif(_why is not None, reason=_why or "")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="host uids and staging need root")


# --------------------------------------------------------------- nested refused distributions

def _dist(site: Path, name: str, version: str, files: dict[str, str]) -> None:
    """A distribution as pip leaves it: its files plus a dist-info whose RECORD lists them."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    for rel, body in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(body)
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in [*files, f"{info.name}/METADATA"]))


@pytest.fixture
def gpu_site(tmp_path):
    """A read-only site-packages laid out like the GPU machine's venv: torch, triton with
    backends/*/bin toolchains, nvidia-* wheels sharing the `nvidia` namespace (one with
    its own nvcc/ptxas), and one harmless package that must stay visible."""
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    _dist(site, "torch", "2.5.0", {"torch/__init__.py": "", "torch/lib/libtorch_cpu.so": ""})
    _dist(site, "triton", "3.1.0", {"triton/__init__.py": "",
                                     "triton/backends/nvidia/bin/ptxas": "#!/bin/sh\n",
                                     "triton/backends/amd/bin/ld.lld": ""})
    _dist(site, "nvidia-cuda-nvcc-cu12", "12.4", {"nvidia/cuda_nvcc/bin/ptxas": "",
                                                  "nvidia/cuda_nvcc/nvvm/bin/cicc": ""})
    _dist(site, "nvidia-cublas-cu12", "12.4", {"nvidia/cublas/lib/libcublas.so.12": ""})
    _dist(site, "okpkg", "1.0", {"okpkg/__init__.py": "X = 1\n"})
    for p in (tmp_path, *tmp_path.rglob("*")):     # read-only for everyone, root included
        os.chmod(p, 0o555 if p.is_dir() else 0o444)
    yield site
    for p in (tmp_path, *tmp_path.rglob("*")):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


_LIST = textwrap.dedent("""
    import json, os, sys
    site = sys.argv[1]
    sys.path.insert(0, site)
    out = {"entries": sorted(os.listdir(site))}
    for mod in ("torch", "triton", "nvidia", "okpkg"):
        try:
            __import__(mod)
            out[mod] = "imported"
        except ImportError as e:
            out[mod] = type(e).__name__
    out["ptxas"] = [os.path.exists(os.path.join(site, p)) for p in
                    ("triton/backends/nvidia/bin/ptxas", "nvidia/cuda_nvcc/bin/ptxas")]
    print(json.dumps(out))
""")


def _listing(policy, site: Path) -> dict:
    r = launch.run(policy, [sys.executable, "-c", _LIST, str(site)], timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_gpu_condition_is_recreated(gpu_site):
    """The collision itself: without the skip, compiler masking would mount over paths
    inside distributions that the whiteout removes."""
    pol = policy_for_domain("control", extra_ro_binds=[str(gpu_site)])
    files, dirs = compiler_masks(tuple(pol.ro_binds))
    nested = [d for d in dirs if d.startswith(str(gpu_site))]
    assert {os.path.relpath(d, gpu_site) for d in nested} >= {
        "triton/backends/nvidia/bin", "triton/backends/amd/bin", "nvidia/cuda_nvcc/bin",
        "nvidia/cuda_nvcc/nvvm/bin"}, nested
    assert {os.path.basename(h) for h in pol.hidden if h.startswith(str(gpu_site))} >= {
        "torch", "triton", "nvidia", "triton-3.1.0.dist-info"}, pol.hidden
    kept_files, kept_dirs = masks_to_mount(pol)
    assert not [d for d in kept_dirs if d.startswith(str(gpu_site))], kept_dirs
    argv = build_bwrap_argv(pol, ["/bin/true"])
    assert not [a for a in argv if "/triton/" in a or "/nvidia/" in a], argv


@needs_bwrap
@pytest.mark.parametrize("staged", [True, False], ids=["root-staged", "unstaged"])
def test_nested_refused_distributions_on_a_read_only_site_packages(gpu_site, staged):
    """A control sandbox starts (it died at start on the GPU machine) and sees none of
    the refused distributions, through the staging overlay (root: host uid switch) and
    through the directory rebuild (no switch)."""
    if staged and os.geteuid() != 0:
        pytest.skip("staging needs root")
    pol = policy_for_domain("control", extra_ro_binds=[str(gpu_site)])
    if not staged:
        pol = dataclasses.replace(pol, host_uid=None, host_gid=None)
    out = _listing(pol, gpu_site)
    assert out["entries"] == ["okpkg", "okpkg-1.0.dist-info"], out
    assert out["okpkg"] == "imported", out
    assert out["torch"] == out["triton"] == out["nvidia"] == "ModuleNotFoundError", out
    assert out["ptxas"] == [False, False], out


@needs_bwrap
@needs_root
def test_compiler_masks_still_apply_where_nothing_is_hidden(gpu_site):
    """The same tree with the whiteout off (a domain that tightens hide_compilers but not
    refuse_torch is not allowed for control, so the policy is edited by hand): triton's
    ptxas is masked by a read-only tmpfs, and the sandbox starts."""
    pol = dataclasses.replace(policy_for_domain("control", extra_ro_binds=[str(gpu_site)]),
                              hidden=[])
    out = _listing(pol, gpu_site)
    assert "triton" in out["entries"] and out["ptxas"] == [False, False], out


@needs_bwrap
@needs_root
def test_check_rehearses_the_sandbox_run_would_build(gpu_site, tmp_path):
    """`launch.rehearse` builds the sandbox exactly as run does: ok for the nested tree,
    and bwrap's own line for a sandbox that cannot be built (what `check` must print)."""
    ok = launch.rehearse(policy_for_domain("control", extra_ro_binds=[str(gpu_site)]), "camerad")
    assert ok.ok, ok
    missing = f"/nonexistent-trio-port-{os.getpid()}"      # reachable: bwrap itself refuses
    broken = dataclasses.replace(policy_for_domain("control"),
                                 ro_binds=[*policy_for_domain("control").ro_binds, missing])
    bad = launch.rehearse(broken, "camerad")
    assert not bad.ok and bad.error.startswith("bwrap: ") and missing in bad.error, bad
    assert "\n" not in bad.line() and bad.line().startswith("camerad: sandbox cannot start: ")


@needs_bwrap
@needs_root
def test_rehearse_config_covers_every_worker_of_the_default_config():
    from supervisor.config import load

    cfg = load()
    checks = launch.rehearse_config(cfg)
    assert [c.worker for c in checks] == list(cfg.workers), checks
    assert all(c.ok for c in checks), [c.line() for c in checks]


# --------------------------------------------------------------- Ubuntu 24.04: AppArmor

def _fake_proc(tmp_path: Path, **knobs: str) -> str:
    for rel, value in knobs.items():
        p = tmp_path / "proc" / "sys" / rel.replace(".", "/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(value + "\n")
    (tmp_path / "proc" / "sys").mkdir(parents=True, exist_ok=True)
    return str(tmp_path / "proc")


def test_ubuntu_apparmor_userns_restriction_is_named_with_the_fix(tmp_path):
    proc = _fake_proc(tmp_path, **{"kernel.apparmor_restrict_unprivileged_userns": "1"})
    line = probe.userns_advice(proc)
    assert line and "\n" not in line, line
    assert line.startswith("kernel.apparmor_restrict_unprivileged_userns = 1: AppArmor"), line
    assert "/etc/apparmor.d/bwrap" in line and "userns" in line, line


@pytest.mark.parametrize("knobs", [
    {}, {"kernel.apparmor_restrict_unprivileged_userns": "0"},
    {"kernel.unprivileged_userns_clone": "1", "user.max_user_namespaces": "63000"}])
def test_no_advice_where_user_namespaces_are_allowed(tmp_path, knobs):
    assert probe.userns_advice(_fake_proc(tmp_path, **knobs)) is None


def test_other_userns_knobs_are_named(tmp_path):
    proc = _fake_proc(tmp_path, **{"kernel.unprivileged_userns_clone": "0",
                                   "user.max_user_namespaces": "0"})
    names = [b[0] for b in probe.userns_blockers(proc)]
    assert names == ["kernel.unprivileged_userns_clone", "user.max_user_namespaces"], names


@pytest.mark.parametrize("line", [
    "bwrap: setting up uid map: Permission denied",                   # Ubuntu 24.04
    "bwrap: No permissions to create new namespace, likely because the kernel does not "
    "allow non-privileged user namespaces."])
def test_a_refused_user_namespace_gets_the_fix_appended(tmp_path, line):
    proc = _fake_proc(tmp_path, **{"kernel.apparmor_restrict_unprivileged_userns": "1"})
    out = probe.explain_bwrap_error(line, proc)
    assert out.startswith(line + " -> kernel.apparmor_restrict_unprivileged_userns = 1"), out
    other = "bwrap: Can't find source path /x: No such file or directory"
    assert probe.explain_bwrap_error(other, proc) == other


def test_this_machines_knobs_are_read_not_written():
    """The real /proc, read only: nothing here blocks bwrap (the sandbox tests run)."""
    before = {p: os.stat(p).st_mtime for p in ("/proc/sys/user/max_user_namespaces",)
              if os.path.exists(p)}
    assert probe.userns_advice() is None or _why is not None
    assert before == {p: os.stat(p).st_mtime for p in before}


# --------------------------------------------------------------- cgroups, degraded

PARTIAL_V2_CHILD = r"""
import json, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
from supervisor.sandbox.cgroups import CgroupTree, CgroupUnavailable, Limits, WorkerCgroup
res = {}
try:
    CgroupTree._create("strict", root=sys.argv[2])
except CgroupUnavailable as e:
    res["strict"] = str(e)
t = CgroupTree._create("t", root=sys.argv[2], partial=True)
res["version"] = t.version
res["event"] = t.off.event()
# limits asked for all the same: skipped (reported once by the tree), the worker runs
w = t.leaf("w", Limits(memory_max=256 << 20, pids_max=16, cpu_quota_pct=50, cpu_weight=100))
fds = w.open_join_fds()
p = subprocess.Popen([sys.executable, "-c", "print('ran')"], stdout=subprocess.PIPE, text=True,
                     preexec_fn=lambda: WorkerCgroup.join(fds))
for fd in fds:
    os.close(fd)
res["worker"] = p.communicate(timeout=30)[0].strip()
res["rc"] = p.returncode
res["in_force"] = {k: w.in_force()[k] for k in ("memory_max", "pids_max", "cpu_quota_us")}
t.close()
print(json.dumps(res))
"""


@pytest.fixture
def v2_outer():
    """A cgroup in this hybrid machine's controller-less cgroup2, standing in for a
    service's cgroup on a machine where nothing was delegated."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        pytest.skip("/sys/fs/cgroup is cgroup2 here")
    if not os.path.exists(f"{UNIFIED}/cgroup.controllers"):
        pytest.skip(f"no cgroup2 mounted at {UNIFIED}")
    outer = f"{UNIFIED}/trio-port-{os.getpid()}"
    os.mkdir(outer)
    try:
        yield outer
    finally:
        for d in [c for c, _d, _f in os.walk(outer, topdown=False)]:
            try:
                os.rmdir(d)
            except OSError:
                pass


def test_cgroup_v2_with_no_controller_delegated_degrades_with_one_report(v2_outer):
    fd = os.open(f"{v2_outer}/cgroup.procs", os.O_WRONLY | os.O_CLOEXEC)
    try:
        p = subprocess.Popen([sys.executable, "-I", "-c", PARTIAL_V2_CHILD, ROOT, UNIFIED],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: os.write(fd, b"0"))
    finally:
        os.close(fd)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    res = json.loads(out)
    assert "not delegated" in res["strict"], res           # without partial: refused, as before
    ev = res["event"]
    assert res["version"] == 2 and ev["cgroup"] == "v2", res
    assert ev["off"] == ["memory_max", "pids_max", "cpu_quota", "cpu_weight"], ev
    assert ev["enforced"] == [] and "not delegated" in ev["reason"] and "\n" not in ev["reason"]
    assert res["worker"] == "ran" and res["rc"] == 0, res
    assert res["in_force"] == {"memory_max": None, "pids_max": None, "cpu_quota_us": None}, res


PARTIAL_V1_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from supervisor.sandbox.cgroups import CgroupTree, Limits
t = CgroupTree.create("trio-port-v1", partial=True)
w = t.leaf("w", Limits(memory_max=256 << 20, pids_max=16, cpu_quota_pct=50))
f = w.in_force()
print(json.dumps({"event": t.off.event() if t.off else None, "memory_max": f["memory_max"],
                  "pids_max": f["pids_max"], "cpu_quota_us": f["cpu_quota_us"]}))
t.close()
"""


def test_cgroup_v1_with_one_controller_unusable_keeps_the_others(tmp_path):
    """The cpu hierarchy remounted read-only in a private mount namespace (as a container
    runtime leaves it): memory and pids limits are enforced, cpu's are reported off."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1)")
    if not os.path.isdir("/sys/fs/cgroup/cpu") or os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        pytest.skip("no cgroup v1 cpu hierarchy here")
    script = 'set -e; mount -o remount,bind,ro /sys/fs/cgroup/cpu; exec "$0" -I -c "$1" "$2"'
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                        sys.executable, PARTIAL_V1_CHILD, ROOT],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["event"]["off"] == ["cpu_quota", "cpu_weight"], res
    assert res["event"]["enforced"] == ["memory_max", "pids_max"], res
    assert "read-only" in res["event"]["reason"], res
    assert res["memory_max"] == 256 << 20 and res["pids_max"] == 16, res


def test_plain_check_says_which_limits_are_off(tmp_path):
    """`supervisor check` (no --start) on a machine whose cpu hierarchy is read-only: it
    said "all admitted" and nothing of the limits `run` would not enforce. (Its last
    line, `cli._limits_line`, in the private mount namespace: the whole check is a
    minute here under load.)"""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1)")
    if not os.path.isdir("/sys/fs/cgroup/cpu") or os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        pytest.skip("no cgroup v1 cpu hierarchy here")
    script = 'set -e; mount -o remount,bind,ro /sys/fs/cgroup/cpu; exec "$0" -c "$1"'
    code = "from supervisor.cli import _limits_line; print(_limits_line())"
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                        sys.executable, code], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    line = r.stdout.strip()
    assert line.startswith("supervisor check: limits not enforced: cpu_quota, cpu_weight ("), line
    assert "read-only" in line and line.endswith("workers run without them"), line


def test_no_cgroups_at_all_is_one_report_of_every_limit():
    off = cgroups.limits_off(None, "cgroup v2: no '0::' line in /proc/self/cgroup")
    ev = off.event()
    assert ev["off"] == ["memory_max", "pids_max", "cpu_quota", "cpu_weight"]
    assert ev["cgroup"] == "none" and ev["reason"].startswith("cgroup v2: no '0::'")
    assert ev["enforced"] == [] and ev["fallback"] == "none"


# --------------------------------------------------------------- math threads

def test_math_libraries_get_the_workers_cpu_share():
    """GPU machine: OpenBLAS's 16 threads at `import numpy` hung camerad under its
    memory limit. Control gets its CPU quota's worth, 1 without a quota; research keeps
    the libraries' choice unless it has a quota."""
    assert thread_count(None, strict=True) == 1
    assert thread_count(None, strict=False) is None
    assert thread_count(50, strict=True) == 1
    assert thread_count(200, strict=False) == min(2, os.cpu_count() or 1)
    assert thread_count(10_000, strict=True) == (os.cpu_count() or 1)
    env = policy_for_domain("control").env
    assert all(env[k] == "1" for k in THREAD_ENV), env
    assert not set(THREAD_ENV) & set(policy_for_domain("research").env)


def test_for_worker_sizes_threads_from_the_config():
    from supervisor.config import load

    cfg = load()
    research = for_worker(cfg, cfg.workers["research"])      # cpu_quota = 200 by default
    assert research.env["OPENBLAS_NUM_THREADS"] == str(thread_count(200, strict=False))
    assert for_worker(cfg, cfg.workers["camerad"]).env["OMP_NUM_THREADS"] == "1"


@needs_bwrap
def test_numpy_imports_in_a_control_sandbox_under_a_data_limit():
    """What camerad does first, under the RLIMIT_DATA the supervisor falls back to without
    a memory cgroup: the thread variables reach the sandbox, and the import completes."""
    code = "import os, numpy; print(os.environ['OPENBLAS_NUM_THREADS'])"
    p = launch.spawn(policy_for_domain("control"), [sys.executable, "-c", code],
                     rlimits={"data": 512 << 20}, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and out.strip() == "1", err[-2000:]


# --------------------------------------------------------------- interpreter under 0700 home

def _interpreter_home() -> str | None:
    """The 0700 directory above this interpreter, if there is one (here /root)."""
    parts = Path(os.path.realpath(sys.executable)).parents
    for d in parts:
        try:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return str(d)
        except OSError:
            return None
    return None


@needs_bwrap
@needs_root
def test_an_interpreter_under_a_0700_home_starts_in_every_domain():
    """/root is 0700 and sandboxes run as trio-control / trio-research: the staging
    namespace makes the interpreter reachable without loosening the home, and the home's
    other files stay out of sight."""
    home = _interpreter_home()
    if home is None:
        pytest.skip("this interpreter is not under a 0700 directory")
    code = (f"import os, json; print(json.dumps([os.getuid(), "
            f"os.path.exists({os.path.join(home, '.bash_history')!r}), "
            f"sorted(os.listdir({home!r}))]))")
    for domain in ("control", "research"):
        pol = policy_for_domain(domain)
        r = launch.run(pol, [sys.executable, "-c", code], timeout=60)
        assert r.returncode == 0, (domain, r.stderr[-2000:])
        uid, history, listing = json.loads(r.stdout)
        assert uid == pol.uid and not history, (domain, r.stdout)
        real = Path(os.path.realpath(sys.executable)).relative_to(home).parts[0]
        assert real in listing and len(listing) <= 3, (domain, listing)   # only what is bound


@needs_bwrap
@needs_root
def test_a_venv_under_a_fresh_0700_home(tmp_path):
    """A venv (its python a symlink into the 0700 /root) inside another 0700 directory, as
    a vehicle install might place it: the supervisor run from it starts a control sandbox
    as trio-control."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    os.chmod(home, 0o700)
    venv = home / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=120)
    if sys.prefix != sys.base_prefix:
        # The suite itself runs from a venv (README's development set-up; the Python 3.13
        # run): --system-site-packages reaches the base interpreter's site-packages, not
        # this venv's, which holds the dependencies ('seccomp unavailable: ... No module
        # named pyseccomp'). Chain this venv's in, as a .pth line.
        import site
        pth = (venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
               / "site-packages" / "outer-venv.pth")
        pth.write_text("".join(f"{d}\n" for d in site.getsitepackages()))
    code = ("import sys; from supervisor.sandbox import launch, policy; "
            "c = launch.rehearse(policy.policy_for_domain('control'), 'w'); "
            "print(c.line()); sys.exit(0 if c.ok else 1)")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, (r.stdout, r.stderr[-2000:])
    assert r.stdout.startswith("w: sandbox ok"), r.stdout
