"""The generated systemd unit: systemd's own offline checks, the committed copy, and the
supervisor actually working under the unit's restrictions (simulated without systemd:
the capability bounding set, no_new_privs, the system-call and address-family filters,
the umask, ProtectProc=invisible, ProtectSystem=strict's read-only root and PrivateTmp)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from supervisor.config import derive, dumps, load, loads, minimal_doc
from supervisor.units import (BROKER_UNIT, DEFAULT_PREFIX, EXPOSURE, PROPER_EXPOSURE,
                             PROPER_UNIT, SPLIT_UNITS, UNIT_NAME, render, unit_cgroup,
                             v1_mounts, write_split_units, write_units)

ROOT = Path(__file__).resolve().parents[1]
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed")
# Measured for a config without real-time workers (the one-camera config); supervisor/units.py
# (docstring and EXPOSURE) says what each remaining exposure item pays for, and why 1.0 is
# out of reach while the sandboxes run inside this unit. Raise it only with a reason.
MAX_EXPOSURE = 3.3
# The default config (the car) runs controlsd in SCHED_FIFO: its unit pays REALTIME_EXPOSURE
# on top (CAP_SYS_NICE, RestrictRealtime=no, sched_setscheduler); measured 3.3 + those.
MAX_REALTIME_EXPOSURE = 3.6


def _plain():
    """The one-camera config: the car's tables, no real-time worker."""
    return loads(dumps(minimal_doc()), "minimal.toml")


def _directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            k, _, v = line.partition("=")
            out.setdefault(k, []).append(v)
    return out


def _fake_prefix(tmp_path: Path) -> Path:
    """An install prefix whose bin/python3 exists (verify checks ExecStart), standing in
    for the car's /opt/trio-supervisor, whose interpreter is the system's: a link into a
    home (pyenv's, under /root) would rightly make the unit ProtectHome=read-only. Only
    verify and security read it: any executable outside the homes does."""
    prefix = tmp_path / "opt" / "trio-supervisor"
    (prefix / "bin").mkdir(parents=True)
    system = next(p for p in ("/usr/bin/python3", "/usr/local/bin/python3", "/bin/sh")
                  if os.access(p, os.X_OK))
    (prefix / "bin" / "python3").symlink_to(system)
    return prefix


def test_renders_for_the_install_target():
    d = _directives(render(load(), config_path=None))
    assert d["ExecStart"] == [f"{DEFAULT_PREFIX}/bin/python3 -m supervisor.cli run --quiet"]
    assert "/root" not in render(load(), config_path=None)
    assert d["RestartPreventExitStatus"] == ["2 3 4"]      # config, refusal, fail-safe latch
    assert d["Delegate"] == ["yes"] and d["Type"] == ["notify"] and d["WatchdogSec"]
    assert d["PrivateNetwork"] == ["yes"]                   # no domain has a network
    assert d["ProtectHome"] == ["yes"] and d["ProtectSystem"] == ["strict"]
    # the cgroup file system read-only but for the unit's own (delegated) cgroup
    assert d["ProtectControlGroups"] == ["yes"] and d["Delegate"] == ["yes"]
    assert f"-{unit_cgroup()}" in d["ReadWritePaths"]
    assert unit_cgroup() == f"/sys/fs/cgroup/{d['Slice'][0]}/{UNIT_NAME}"
    # the car's controlsd runs in SCHED_FIFO, set by the supervisor: CAP_SYS_NICE, last
    assert d["CapabilityBoundingSet"] == ["CAP_SETUID CAP_SETGID CAP_SYS_ADMIN CAP_SYS_CHROOT "
                                          "CAP_SYS_PTRACE CAP_DAC_READ_SEARCH CAP_KILL CAP_SYS_NICE"]
    assert d["AmbientCapabilities"] == [""] and d["NoNewPrivileges"] == ["yes"]
    assert d["StateDirectory"] == ["trio-supervisor"]       # the fail-safe latch
    # last for the OOM killer: its death ends every sandbox unsaid (red team 10 row 11)
    assert d["OOMScoreAdjust"] == ["-900"]
    assert d["RuntimeDirectory"] == ["trio-staging"]
    d2 = _directives(render(load(), config_path=None, python="/usr/bin/python3"))
    assert d2["ExecStart"] == ["/usr/bin/python3 -m supervisor.cli run --quiet"]
    d3 = _directives(render(load(), config_path=None, prefix="/opt/venv"))
    assert d3["ExecStart"] == ["/opt/venv/bin/python3 -m supervisor.cli run --quiet"]
    # systemd takes no relative ExecStart: --prefix venv is the venv here, absolute
    rel = _directives(render(load(), config_path=None, prefix="venv"))
    assert rel["ExecStart"] == [f"{os.getcwd()}/venv/bin/python3 -m supervisor.cli run --quiet"]
    # an interpreter under /root (development) keeps home directories readable
    d4 = _directives(render(load(), config_path=None, python="/root/.pyenv/bin/python"))
    assert d4["ProtectHome"] == ["read-only"]


def test_committed_unit_is_what_units_renders(tmp_path):
    p = subprocess.run([sys.executable, "-m", "supervisor.cli", "units", "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 0, p.stderr
    assert _as_on_v2((tmp_path / UNIT_NAME).read_text()) == \
        (ROOT / "systemd" / UNIT_NAME).read_text(), \
        "systemd/ is stale: run `supervisor units` (default config) and commit the result"


def test_a_simulation_config_gets_no_vehicle_unit(tmp_path):
    """A replay's config (recorded frames and time into control) must never become the
    car's unit: `supervisor units` refuses it in one line."""
    from supervisor.config import default_doc

    cfg = tmp_path / "sim.toml"
    cfg.write_text(dumps(derive(default_doc(), set={"supervisor.mode": "simulation"})))
    p = subprocess.run([sys.executable, "-m", "supervisor.cli", "units", "--config", str(cfg),
                        "--out", str(tmp_path / "u")], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "supervisor.mode" in p.stderr and "'simulation'" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "u").exists()



def _systemd_argv(exec_start: str) -> list[str]:
    """ExecStart= split as systemd splits it (double quotes, C escapes), then `%%` (and,
    after the command, `$$`) undone: what the service's argv would be."""
    import shlex

    words = [w.replace("%%", "%") for w in shlex.split(exec_start)]
    return words[:1] + [w.replace("$$", "$") for w in words[1:]]


def test_an_install_path_with_spaces_and_percent_survives_the_units(tmp_path):
    """A prefix or config path with a space, `%` or non-ASCII in it used to go into
    ExecStart= bare: systemd ran `/opt/trio` ("not executable"). Every unit quotes it."""
    prefix = tmp_path / "opt x %h $HOME é"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "python3").symlink_to(sys.executable)
    conf = tmp_path / "car 1 %i.toml"
    conf.write_text(dumps(minimal_doc()))
    units = [*write_units(_plain(), tmp_path / "u", config_path=str(conf), prefix=str(prefix)),
             *write_split_units(_plain(), tmp_path / "u", config_path=str(conf),
                                prefix=str(prefix))]
    starts = [_directives(u.read_text()).get("ExecStart") for u in units]
    for (start,) in [x for x in starts if x]:
        argv = _systemd_argv(start)
        assert argv[0] == str(prefix / "bin" / "python3"), start
        assert argv[argv.index("--config") + 1] == str(conf), start
    assert len([x for x in starts if x]) == 3
    if ANALYZE is not None:        # systemd itself finds the interpreter at that path
        v = subprocess.run([ANALYZE, "verify", *(str(u) for u in units)],
                           capture_output=True, text=True)
        assert v.returncode == 0 and "not executable" not in v.stdout + v.stderr, \
            v.stdout + v.stderr

@needs_analyze
def test_unit_verifies_and_is_hardened(tmp_path):
    (unit,) = write_units(_plain(), tmp_path, config_path=None,
                          prefix=str(_fake_prefix(tmp_path)))
    v = subprocess.run([ANALYZE, "verify", str(unit)], capture_output=True, text=True)
    assert v.returncode == 0 and not v.stderr.strip() and not v.stdout.strip(), \
        v.stdout + v.stderr
    s = subprocess.run([ANALYZE, "security", "--offline=true", str(unit)],
                       capture_output=True, text=True, env=dict(os.environ, LC_ALL="C.UTF-8"))
    score = float(re.search(r"Overall exposure level for \S+: ([0-9.]+)", s.stdout).group(1))
    assert score <= MAX_EXPOSURE, s.stdout[-4000:]
    # every item still exposed is one the unit documents a reason for, and each
    # documented one is still exposed (a stale reason would hide a regression's cause)
    exposed = set(re.findall(r"^\s*\u2717 (\S+)", s.stdout, re.M))
    assert exposed, s.stdout[-4000:]
    assert exposed - set(EXPOSURE) == set(), s.stdout[-4000:]
    assert set(EXPOSURE) - exposed == set()
    # the committed unit: clean but for the interpreter this machine lacks
    v = subprocess.run([ANALYZE, "verify", str(ROOT / "systemd" / UNIT_NAME)],
                       capture_output=True, text=True)
    lines = [x for x in (v.stdout + v.stderr).splitlines() if x.strip()]
    if os.path.exists(f"{DEFAULT_PREFIX}/bin/python3"):
        assert not lines, lines
    else:
        assert all(f"{DEFAULT_PREFIX}/bin/python3 is not executable" in x for x in lines), lines


@needs_analyze
def test_a_realtime_config_costs_the_unit_sys_nice_and_sched_setscheduler_only(tmp_path):
    """Real-time workers need the supervisor to set SCHED_FIFO: the unit gains
    CAP_SYS_NICE, RestrictRealtime=no and sched_setscheduler (the rest of @resources
    stays denied), exactly the three checks REALTIME_EXPOSURE names; a config without
    real-time workers (the one-camera config) keeps them closed."""
    from supervisor.units import REALTIME_EXPOSURE

    # The default, the car: controlsd alone real-time. It then waits to be woken (a
    # busy-polling real-time reader must rank below its writer, and modeld stays in the
    # normal class).
    cfg = load()
    assert cfg.workers["controlsd"].realtime_priority and not cfg.workers["controlsd"].busy_poll_us
    (unit,) = write_units(cfg, tmp_path, config_path=None, prefix=str(_fake_prefix(tmp_path)))
    d = _directives(unit.read_text())
    assert d["CapabilityBoundingSet"][0].split()[-1] == "CAP_SYS_NICE"
    assert d["RestrictRealtime"] == ["no"]
    (deny,) = d["SystemCallFilter"]
    assert "sched_setscheduler" not in deny and "@resources" not in deny
    assert {"setpriority", "sched_setattr", "sched_setaffinity", "setrlimit"} <= set(deny.split())
    assert subprocess.run([ANALYZE, "verify", str(unit)], capture_output=True).returncode == 0
    s = subprocess.run([ANALYZE, "security", "--offline=true", str(unit)],
                       capture_output=True, text=True, env=dict(os.environ, LC_ALL="C.UTF-8"))
    exposed = set(re.findall(r"^\s*\u2717 (\S+)", s.stdout, re.M))
    assert exposed - set(EXPOSURE) == set(REALTIME_EXPOSURE), s.stdout[-3000:]
    score = float(re.search(r"Overall exposure level for \S+: ([0-9.]+)", s.stdout).group(1))
    assert score <= MAX_REALTIME_EXPOSURE, s.stdout[-3000:]
    plain = _directives(render(_plain(), config_path=None))
    assert plain["RestrictRealtime"] == ["yes"] and "CAP_SYS_NICE" not in plain["CapabilityBoundingSet"][0]


# --------------------------------------------------------------------------- the split

# Issue 27: the supervisor proper holds no privilege; measured 0.2 (PROPER_EXPOSURE names
# what is left). The broker hosts the sandboxes and costs what the one unit costs.
MAX_PROPER_EXPOSURE = 1.5


def _as_on_v2(text: str) -> str:
    """A rendered unit without the lines `units` adds on a cgroup v1 machine only
    (review 9 finding 6: ReadWritePaths= of each v1 hierarchy, and with RT groups the
    ExecStartPre= that gives the slice and the unit RT runtime, with its comment), each
    naming a v1 mount: systemd/ holds the vehicle's (cgroup v2) units, and this machine
    may be v1."""
    v1 = [f"{m}{end}" for m in v1_mounts() for end in ("/", ")")]
    return "".join(ln for ln in text.splitlines(keepends=True)
                   if not any(m in ln for m in v1))


def _security(unit: Path) -> tuple[float, set[str], str]:
    s = subprocess.run([ANALYZE, "security", "--offline=true", str(unit)],
                       capture_output=True, text=True, env=dict(os.environ, LC_ALL="C.UTF-8"))
    score = float(re.search(r"Overall exposure level for \S+: ([0-9.]+)", s.stdout).group(1))
    return score, set(re.findall(r"^\s*\u2717 (\S+)", s.stdout, re.M)), s.stdout[-4000:]


def test_committed_split_units_are_what_renders(tmp_path):
    write_split_units(load(), tmp_path, config_path=None)
    for name in SPLIT_UNITS:
        assert _as_on_v2((tmp_path / name).read_text()) == \
            (ROOT / "systemd" / name).read_text(), \
            f"systemd/{name} is stale: rerun supervisor.units.write_split_units (default config)"


@needs_analyze
def test_split_units_verify_and_the_supervisor_proper_holds_no_privilege(tmp_path):
    paths = write_split_units(load(), tmp_path, config_path=None,
                              prefix=str(_fake_prefix(tmp_path)))
    for unit in paths:
        v = subprocess.run([ANALYZE, "verify", str(unit)], capture_output=True, text=True)
        assert v.returncode == 0 and not (v.stdout + v.stderr).strip(), v.stdout + v.stderr
    proper = _directives((tmp_path / PROPER_UNIT).read_text())
    assert proper["User"] == ["trio-supervisor"] and proper["CapabilityBoundingSet"] == [""]
    assert proper["AmbientCapabilities"] == [""] and proper["NoNewPrivileges"] == ["yes"]
    assert proper["RestrictNamespaces"] == ["yes"] and proper["RestrictAddressFamilies"] == ["AF_UNIX"]
    score, exposed, out = _security(tmp_path / PROPER_UNIT)
    assert score <= MAX_PROPER_EXPOSURE, out
    assert exposed == set(PROPER_EXPOSURE), out
    # the broker: the sandbox host, exactly the one unit's documented exposure (the
    # default's: the car's SCHED_FIFO controlsd adds REALTIME_EXPOSURE)
    from supervisor.units import REALTIME_EXPOSURE

    broker = _directives((tmp_path / BROKER_UNIT).read_text())
    assert "--listen-fd 3 --peer-user trio-supervisor" in broker["ExecStart"][0]
    assert broker["ReadWritePaths"][0] == f"-{unit_cgroup(BROKER_UNIT)}"
    score, exposed, out = _security(tmp_path / BROKER_UNIT)
    assert score <= MAX_REALTIME_EXPOSURE, out
    assert exposed == set(EXPOSURE) | set(REALTIME_EXPOSURE), out


# --------------------------------------------------------------------------- simulation

_SECCOMP = textwrap.dedent(r"""
    import errno, os, sys
    import pyseccomp as sc
    deny, families, umask, *argv = sys.argv[1:]
    flt = sc.SyscallFilter(sc.ALLOW)
    flt.set_attr(sc.Attr.ACT_BADARCH, sc.KILL_PROCESS)        # SystemCallArchitectures=native
    for name in deny.split(","):                              # SystemCallFilter=~... + EPERM
        nr = sc.resolve_syscall(sc.Arch.NATIVE, name)
        if nr >= 0:
            flt.add_rule(sc.ERRNO(errno.EPERM), nr)
    allowed = {int(f) for f in families.split(",")}           # RestrictAddressFamilies=
    nr = sc.resolve_syscall(sc.Arch.NATIVE, "socket")
    for fam in range(64):
        if fam not in allowed:
            flt.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), nr, sc.Arg(0, sc.EQ, fam))
    flt.load()
    st = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
    print("unit-sim:", st["CapBnd"], st["NoNewPrivs"], st["Seccomp"], file=sys.stderr, flush=True)
    os.umask(int(umask, 8))                                   # UMask=
    os.execv(sys.executable, [sys.executable, *argv])
    """)

_MOUNTS = textwrap.dedent("""
    set -e
    mount -t proc -o hidepid=invisible proc /proc    # ProtectProc=invisible
    mkdir -p /run/trio-staging                       # RuntimeDirectory=
    # A checkout under /tmp (a CI clone) stands in for the install under /opt that a
    # vehicle has: keep it visible through the private /tmp.
    # So is a virtual environment under /tmp (KEEP2: the interpreter's prefix).
    if [ -n "$KEEP" ]; then mkdir -p /run/unit-sim-keep; mount --bind "$KEEP" /run/unit-sim-keep; fi
    if [ -n "$KEEP2" ]; then mkdir -p /run/unit-sim-keep2; mount --bind "$KEEP2" /run/unit-sim-keep2; fi
    mount -t tmpfs -o mode=1777 tmpfs /tmp           # PrivateTmp=yes
    if [ -n "$KEEP" ]; then mkdir -p "$KEEP"; mount --bind /run/unit-sim-keep "$KEEP"; fi
    if [ -n "$KEEP2" ]; then mkdir -p "$KEEP2"; mount --bind /run/unit-sim-keep2 "$KEEP2"; fi
    mount -o remount,bind,ro /                       # ProtectSystem=strict (the root fs)
    # Delegate=yes, ProtectControlGroups=yes, ReadWritePaths=<the unit's cgroup>: the
    # supervisor's own cgroup stays writable (root-owned, 0755, as systemd makes it),
    # the rest of the cgroup file system is read-only (v2, the vehicle's). On v1 the
    # hierarchy roots are 0555, so a fresh cgroup per controller stands in for the
    # unit's, and only the hierarchies the supervisor does not use become read-only
    # (its v1 code refuses a read-only hierarchy mount).
    if [ -e /sys/fs/cgroup/cgroup.controllers ]; then
      own=$(sed -n 's/^0:://p' /proc/self/cgroup)
      if [ "$own" != / ]; then
        mount --bind "/sys/fs/cgroup$own" "/sys/fs/cgroup$own"
        mount -o remount,bind,ro /sys/fs/cgroup
      fi
    else
      for c in memory pids cpu; do
        own=$(awk -F: -v c=$c '{n=split($2,a,","); for(i=1;i<=n;i++) if(a[i]==c) print $3}' /proc/self/cgroup)
        d="/sys/fs/cgroup/$c${own%/}/$SIMCG"
        mkdir -p "$d"
        # RT runtime for the default's (the car's) SCHED_FIFO controlsd: a fresh v1 cpu
        # cgroup has none, so the supervisor could reserve none (realtime_unavailable).
        # The supervisor reserves min(sum + max of the budgets, 90) % = 20 % of a CPU.
        if [ $c = cpu ] && [ -e "$d/cpu.rt_runtime_us" ]; then
          echo 1000000 > "$d/cpu.rt_period_us"; echo 200000 > "$d/cpu.rt_runtime_us"
        fi
        echo $$ > "$d/cgroup.procs"
      done
      for m in /sys/fs/cgroup/*; do
        case "${m##*/}" in memory|pids|cpu) continue;; esac
        if [ ! -L "$m" ] && mountpoint -q "$m"; then mount -o remount,bind,ro "$m"; fi
      done
      mount -o remount,bind,ro /sys/fs/cgroup
    fi
    exec setpriv --bounding-set "$CAPS" --inh-caps -all --no-new-privs "$@"
    """)


def _remove_sim_cgroups(name: str) -> None:
    """The v1 stand-ins for the unit's cgroup (empty once the supervisor has ended)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, ctrls, own = line.split(":", 2)
        for c in set(ctrls.split(",")) & {"memory", "pids", "cpu"}:
            d = Path(f"/sys/fs/cgroup/{c}{own.rstrip('/')}/{name}")
            if d.is_dir():
                if (d / "cpu.rt_runtime_us").exists():
                    # A removed group's RT runtime counts against its parent's for seconds.
                    (d / "cpu.rt_runtime_us").write_text("0")
                d.rmdir()


def _expand(group: str, seen: set[str] | None = None) -> set[str]:
    seen = set() if seen is None else seen
    if not group.startswith("@"):
        return {group}
    if group in seen:
        return set()
    seen.add(group)
    out = subprocess.run([ANALYZE, "syscall-filter", group], capture_output=True,
                         text=True, check=True).stdout
    names: set[str] = set()
    for line in out.splitlines()[1:]:
        tok = line.strip()
        if tok and not tok.startswith("#"):
            names |= _expand(tok, seen)
    return names


@needs_analyze
@pytest.mark.sandbox
@pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("setpriv") is None
                    or shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs root, bubblewrap, setpriv and unshare")
def test_supervisor_works_under_the_units_restrictions():
    """`supervisor audit --live` of the default config (what the unit's ExecStart runs:
    camerad, modeld with its verified kernels, controlsd, research with torch), under
    the unit's restrictions: every worker becomes READY and the audit, which reads every
    sandbox's /proc from outside, matches the config."""
    import socket

    d = _directives(render(load(), config_path=None))
    caps = [c.lower().removeprefix("cap_") for c in d["CapabilityBoundingSet"][0].split()]
    (deny_spec,) = d["SystemCallFilter"]
    assert deny_spec.startswith("~")
    deny: set[str] = set()
    for item in deny_spec[1:].split():
        deny |= _expand(item)
    for needed in ("mount", "setresuid", "unshare", "setns", "seccomp", "prlimit64",
                   "pivot_root", "sethostname", "capset", "clone"):
        assert needed not in deny, needed
    families = [getattr(socket, f) for f in d["RestrictAddressFamilies"][0].split()]
    from supervisor.audit.promise import NAMESPACES

    assert set(d["RestrictNamespaces"][0].split()) >= set(NAMESPACES)
    simcg = f"trio-unit-sim-{os.getpid()}"
    env = dict(os.environ, CAPS="-all," + ",".join(f"+{c}" for c in caps),
               PYTHONPATH=str(ROOT), SIMCG=simcg,
               KEEP=str(ROOT) if str(ROOT).startswith("/tmp/") else "",
               KEEP2=sys.prefix if sys.prefix.startswith("/tmp/") else "")
    try:
        p = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", _MOUNTS, "sh",
             sys.executable, "-c", _SECCOMP, ",".join(sorted(deny)),
             ",".join(str(int(f)) for f in families), d["UMask"][0],
             "-m", "supervisor.cli", "audit", "--live", "--start", "--format", "json", "--settle", "0.5"],
            capture_output=True, text=True, env=env, cwd=ROOT, timeout=150)
    finally:
        _remove_sim_cgroups(simcg)
    assert p.stdout, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert p.returncode == 0 and r["result"] == "matches", \
        json.dumps({"supervisor": r.get("supervisor"), "differences": r.get("differences")},
                   indent=1)[-4000:] + p.stderr[-2000:]
    assert [w["worker"] for w in r["workers"] if w["running"]] == list(load().workers)
    # and it really ran with the unit's bounding set, no_new_privs and a filter
    from supervisor.audit.evidence import CAPABILITIES

    mask = sum(1 << CAPABILITIES.index(c) for c in caps)
    assert f"unit-sim: {mask:016x} 1 2" in p.stderr, p.stderr[-2000:]


# --------------------------------------------------------------------------- fewer caps

_AS_USER = textwrap.dedent(r"""
    import json, os, signal, sys
    from supervisor.audit import asuser, evidence as ev

    pid = int(sys.argv[1])
    uid, gid = asuser.host_ids(pid)

    def read():
        mf = sorted(os.listdir(f"/proc/{pid}/map_files"))
        fds = sorted(os.listdir(f"/proc/{pid}/fd"))
        os.close(os.open(f"/proc/{pid}/map_files/{mf[0]}", os.O_RDONLY))
        return {"maps": len(ev.maps(pid)), "fds": fds,
                "fd0": os.readlink(f"/proc/{pid}/fd/{fds[0]}"),
                "net": ev.namespaces(pid)["net"], "interfaces": ev.interfaces(pid),
                "map_file": os.readlink(f"/proc/{pid}/map_files/{mf[0]}"),
                "probe": ev.compiler_probe(pid, ["/usr/bin/env"])}

    def refused(fn, *args):
        try:
            fn(*args)
        except PermissionError as e:
            return e.errno
        return None

    out = {"ptrace": asuser.can_read_any_proc(), "direct": refused(read),
           "kill_direct": refused(os.kill, pid, 0),
           "as_user": asuser.as_host_user(uid, gid, read)}
    asuser.as_host_user(uid, gid, os.kill, pid, signal.SIGTERM)
    out["after"] = open("/proc/thread-self/status").read().split("Uid:")[1].split()[:2]
    print(json.dumps(out))
    """)


@pytest.mark.sandbox
@pytest.mark.skipif(shutil.which("bwrap") is None or shutil.which("setpriv") is None
                    or os.geteuid() != 0, reason="needs root, bubblewrap and setpriv")
def test_sandbox_readable_and_stoppable_with_setuid_setgid_only():
    """The measured basis for a smaller bounding set (supervisor/audit/asuser.py): with
    only CAP_SETUID, CAP_SETGID and CAP_CHECKPOINT_RESTORE (no CAP_SYS_PTRACE,
    CAP_DAC_READ_SEARCH, CAP_SYS_ADMIN, CAP_KILL), a thread that takes a sandbox's host
    uid as its effective uid reads everything the audit and the exec watch read from
    /proc, and stops it; the same reads without the switch are refused."""
    import pwd
    import signal
    import time

    user = pwd.getpwnam("trio-control")
    sandbox = subprocess.Popen(
        ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
         "bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--ro-bind", "/", "/",
         "--proc", "/proc", "--dev", "/dev", "--uid", "1000", "--gid", "1000",
         "sleep", "60"], cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        pid = None
        for _ in range(200):      # bwrap -> its pid 1 -> sleep
            kids = [int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()
                    and _is_sleep_below(int(d.name), sandbox.pid)]
            if kids:
                pid = kids[0]
                break
            time.sleep(0.02)
        assert pid, sandbox.stderr.read1().decode() if sandbox.poll() is not None else "no sleep"
        its_net = os.stat(f"/proc/{pid}/ns/net").st_ino
        p = subprocess.run(
            ["setpriv", "--bounding-set", "-all,+setuid,+setgid,+checkpoint_restore",
             "--inh-caps", "-all", "--no-new-privs", sys.executable, "-c", _AS_USER, str(pid)],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
            env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert p.returncode == 0, p.stderr[-3000:]
        r = json.loads(p.stdout)
        assert r["ptrace"] is False and r["direct"] is not None and r["kill_direct"] is not None
        got = r["as_user"]
        assert got["maps"] > 5 and got["fds"] and got["fd0"]
        assert got["net"] == its_net
        assert got["net"] != os.stat("/proc/self/ns/net").st_ino and got["interfaces"] == ["lo"]
        assert got["map_file"].endswith("sleep")               # the ELF behind a mapping
        assert got["probe"] == {"/usr/bin/env": "executable"}   # resolved inside its root
        assert r["after"] == ["0", "0"]                         # only that thread switched
        code = sandbox.wait(timeout=10)
        assert code in (128 + signal.SIGTERM, -signal.SIGTERM), code   # bwrap reports 128+N
    finally:
        if sandbox.poll() is None:
            sandbox.kill()
            sandbox.wait()


def _is_sleep_below(pid: int, ancestor: int) -> bool:
    try:
        if Path(f"/proc/{pid}/comm").read_text().strip() != "sleep":
            return False
        while pid > 1:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
            if pid == ancestor:
                return True
    except (OSError, ValueError, IndexError):
        pass
    return False


def test_on_v1_with_rt_groups_the_unit_gives_its_cgroup_rt_runtime(tmp_path):
    """Review 9 finding 6: systemd makes system.slice and the unit's v1 cpu cgroup with
    no RT runtime, so the supervisor's reservation below them was refused (EINVAL) and
    controlsd ran in the normal class. The unit's ExecStartPre= (full privileges) raises
    both to what the supervisor reserves. Here its script runs for real against a
    scratch slice/unit pair of cgroups (made and removed), and then a child takes the
    supervisor's reservation (20 % per 100 ms) as the tree does."""
    from supervisor.units import _v1_hierarchies, v1_rt_lines

    cpu = _v1_hierarchies().get("cpu")
    if (os.geteuid() != 0 or cpu is None or os.path.exists("/sys/fs/cgroup/cgroup.controllers")
            or not os.path.exists(f"{cpu}/cpu.rt_runtime_us")):
        pytest.skip("root on a cgroup v1 machine with RT group scheduling")
    lines = v1_rt_lines(load(), UNIT_NAME)           # the car's controlsd is real-time
    (pre,) = [ln for ln in lines if ln.startswith("ExecStartPre=-+/bin/sh -c ")]
    script = pre.split(" -c ", 1)[1]
    assert script[0] == script[-1] == '"'
    script = script[1:-1].replace("$$", "$")          # as systemd hands it to sh
    assert f"{cpu}/system.slice {cpu}/system.slice/{UNIT_NAME};" in script
    slice_ = f"{cpu}/rv9-slice-{os.getpid()}"
    unit = f"{slice_}/unit"
    script = script.replace(f"{cpu}/system.slice/{UNIT_NAME}", unit) \
        .replace(f"{cpu}/system.slice", slice_)
    os.makedirs(unit)
    tree = f"{unit}/tree"
    try:
        for _ in range(2):                            # a restart: the same, no error
            r = subprocess.run(["sh", "-c", script], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            for d in (slice_, unit):
                assert Path(f"{d}/cpu.rt_runtime_us").read_text().strip() == "200000"
        os.mkdir(tree)
        Path(f"{tree}/cpu.rt_period_us").write_text("100000")
        Path(f"{tree}/cpu.rt_runtime_us").write_text("20000")   # refused before: EINVAL
    finally:
        for d in (tree, unit, slice_):
            if os.path.isdir(d):
                Path(f"{d}/cpu.rt_runtime_us").write_text("0")
                os.rmdir(d)
