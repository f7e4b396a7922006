"""Issue 25: the audit a safety reviewer signs. The sections derived from the code
(interference paths, failure behaviour, filesystem views, the whole syscall policy),
`audit diff`, the signature round trip, and `audit --live` against a running
`supervisor run` (read-only: nothing started, the running system undisturbed)."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from supervisor.audit import fsview, paths, syscalls
from supervisor.config import loads
from tests.test_audit import CLEAN, NEEDS_ROOT_SANDBOX

AUDIT = [sys.executable, "-m", "supervisor.audit"]


def _audit(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*AUDIT, *args], capture_output=True, text=True, timeout=timeout)


def _main(capsys, *args: str) -> subprocess.CompletedProcess:
    """The same command in this process (cheap): its exit code and output."""
    from supervisor.audit.command import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


# --------------------------------------------------------------------------- derived sections


def test_paths_follow_the_channel_table():
    """A research reader of a control channel writes its lease table, which the control
    writer reads: the one byte path from research into control, bounded by lease_ms."""
    cfg = loads(CLEAN.replace('slot_size = "4KiB"', 'slot_size = "4KiB"\n    lease_ms = 40'),
                "c.toml")
    ps = {p["id"]: p for p in paths.interference_paths(cfg)}
    lease = ps["frames.lease.lab"]
    assert (lease["from"], lease["to"], lease["writer"], lease["reader"]) == (
        "research", "control", "lab", "src")
    assert "lease_ms (40 ms)" in lease["bound"]
    data = ps["frames.data.lab"]
    assert (data["direction"], data["writer"], data["reader"]) == ("control -> research",
                                                                   "src", "lab")
    # the monitor: the supervisor reads every channel at the spare reader index
    assert ps["frames.data.supervisor"]["reader"] == "supervisor"
    assert {"status.src", "output.lab", "execwatch.sink", "standby.sink", "state-dir",
            "resources.research.control", "frames.wakeup-back.lab"} <= set(ps)
    assert "execwatch.lab" not in ps          # research keeps exec memory after READY
    # one reader more: its four paths appear, nothing is listed by hand
    more = loads((CLEAN + textwrap.dedent("""
        [workers.lab2]
        domain = "research"
        module = "workers.probe"
        subscribes = ["frames"]
        """)).replace('slot_size = "4KiB"', 'slot_size = "4KiB"\n    slot_count = 8'),
        "more.toml")
    ids = {p["id"] for p in paths.interference_paths(more)}
    assert {"frames.data.lab2", "frames.lease.lab2", "frames.wakeup.lab2",
            "frames.wakeup-back.lab2"} <= ids


def test_filesystem_view_is_the_bwrap_command_line(tmp_path):
    """Binds come from the policy: a research domain's rw bind is a writable mount and a
    written-files path; the control view has only /tmp and /dev/shm writable."""
    if fsview.view_of(loads(CLEAN, "c.toml"), loads(CLEAN, "c.toml").workers["src"])["error"]:
        pytest.skip("no bwrap here")
    logs = tmp_path / "logs"
    logs.mkdir()
    cfg = loads(CLEAN.replace("[domains.research]",
                              f'[domains.research]\nextra_rw_binds = ["{logs}"]'), "c.toml")
    views = fsview.views(cfg)
    src = {m["path"]: m for m in views["src"]["mounts"]}
    assert src["/"]["access"] == "ro" and src["/tmp"]["what"] == "tmpfs"
    assert src["/tmp"]["size"] == 64 << 20 and src["/dev/shm"]["size"] == 16 << 20
    assert views["src"]["writable"] == ["/tmp", "/dev/shm"]
    assert views["lab"]["writable"] == ["/tmp", str(logs), "/dev/shm"]
    # Research keeps its compilers: nothing is masked there; /proc's machine-wide
    # counters, which every sandbox has empty (bwrap.PROC_MACHINE_FILES), are listed
    # apart from the compilers, as "hidden" (gate 9 finding 11).
    from supervisor.sandbox.bwrap import PROC_MACHINE_FILES

    assert views["lab"]["masked"] == [], views["lab"]["masked"]
    assert not any(p.startswith("/proc/") for p in views["src"]["masked"]), views["src"]
    assert set(views["lab"]["hidden"]) <= set(PROC_MACHINE_FILES), views["lab"]["hidden"]
    assert "/proc/loadavg" in views["lab"]["hidden"] and "/proc/loadavg" in views["src"]["hidden"]
    ps = {p["id"]: p for p in paths.interference_paths(cfg)}
    assert ps[f"files.research.{logs}"]["writer"] == "lab"


def test_syscall_policy_is_what_libseccomp_compiles(tmp_path):
    """The recorded rules are the filter's: every syscall the audit says the control
    class kills unconditionally at launch is a KILL_PROCESS rule in the real filter's
    pseudo code (libseccomp's own export), and what it calls allowed is in none."""
    pytest.importorskip("pyseccomp")
    from supervisor.sandbox import seccomp as sc

    cls = syscalls.SeccompClass("control", None, False, False)
    pol = syscalls.policy_of(cls)
    assert {"ptrace", "bpf", "mount", "chmod"} <= set(pol["killed"])
    assert "read" in pol["allowed"] and "ptrace" not in pol["allowed"]
    out = tmp_path / "pfc"
    with open(out, "w") as f:
        sc.build_filter("control", stage="launch").export_pfc(f)
    pfc = out.read_text()
    import pyseccomp

    def nr(name: str) -> int:
        n = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, name)
        return n if n >= 0 else sc._FALLBACK_NR[name]   # newer than this libseccomp

    for name in pol["killed"]:
        assert f"if ($syscall == {nr(name)})\n    action KILL_PROCESS;" in pfc, name
    for name in ("read", "write", "openat"):
        assert f"($syscall == {nr(name)})" not in pfc
    # the full runtime class adds the exec ban and the process ban; W^X only after READY
    full = syscalls.policy_of(syscalls.SeccompClass("control", "control", True, False))
    assert {"execve", "execveat"} <= set(full["killed"])
    assert full["errno"]["fork"] == "EPERM" and "mmap" in full["notified"]
    research = syscalls.policy_of(syscalls.SeccompClass("research", None, False, False))
    assert research["errno"]["ptrace"] == "EPERM" and "fchmod" in research["killed"]


# --------------------------------------------------------------------------- diff, signature


@pytest.fixture(scope="module")
def two_reports(tmp_path_factory):
    d = tmp_path_factory.mktemp("diff")
    tight, loose = d / "tight.toml", d / "loose.toml"
    tight.write_text(CLEAN)
    # research gets the network: a loosened domain
    loose.write_text(CLEAN.replace("[domains.research]", "[domains.research]\nnetwork = true"))
    from supervisor.model.keys import generate_private_key

    generate_private_key(d / "review.key")
    out = []
    for cfg in (tight, loose):
        rep = d / f"{cfg.stem}.json"
        # the first one signed as a reviewer would (--sign writes REPORT.sig)
        sign = ["--sign", str(d / "review.key")] if cfg is tight else []
        # in this process: admission's import walk is cached for the second config
        from supervisor.audit.command import main

        assert main(["--config", str(cfg), "--format", "json", "--output", str(rep),
                     *sign]) == 0
        out.append(rep)
    return out


def test_diff_sees_a_loosened_domain(two_reports, capsys):
    tight, loose = two_reports
    p = _audit("diff", str(tight), str(loose), "--format", "json")
    assert p.returncode == 6, p.stdout + p.stderr
    d = json.loads(p.stdout)
    weak = {(c["subject"], c["key"]) for c in d["changes"] if c["effect"] == "weakened"}
    assert {("lab", "namespaces.net"), ("lab", "network"), ("research", "connect"),
            ("network.research", "added")} <= weak       # a path from outside, new
    assert not any(c["subject"] in ("src", "sink", "control") for c in d["changes"])
    same = _main(capsys, "diff", str(tight), str(tight))
    assert same.returncode == 0 and "0 weakened" in same.stdout
    back = _main(capsys, "diff", str(loose), str(tight), "--format", "markdown")
    assert back.returncode == 0 and "| tightened | worker | lab | network |" in back.stdout
    bad = _main(capsys, "diff", str(tight), "/nonexistent.json")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_signature_round_trip(two_reports, tmp_path, capsys):
    from supervisor.audit.sign import sign_file
    from supervisor.model.keys import key_id, load_private_key, public_key_text

    signed = two_reports[0]
    key = load_private_key(signed.parent / "review.key")
    pub = tmp_path / "review.pub"
    pub.write_text(public_key_text(key.public_key()))
    kid = key_id(key.public_key())
    ok = _audit("verify", str(signed), f"{signed}.sig", str(pub))      # made by --sign
    assert ok.returncode == 0 and kid in ok.stdout, ok.stderr
    rep = tmp_path / "copy.json"
    rep.write_bytes(signed.read_bytes())
    sig, kid2 = sign_file(str(rep), str(signed.parent / "review.key"))
    assert kid2 == kid and len(Path(sig).read_bytes()) == 64
    assert _main(capsys, "verify", str(rep), sig, str(pub)).returncode == 0
    data = bytearray(rep.read_bytes())
    data[len(data) // 2] ^= 1                 # one bit of one byte
    rep.write_bytes(bytes(data))
    bad = _main(capsys, "verify", str(rep), sig, str(pub))
    assert bad.returncode == 6 and "FAILED" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    other = tmp_path / "other.pub"            # the right report, someone else's key
    other.write_text("00" * 32)
    assert _main(capsys, "verify", str(signed), f"{signed}.sig", str(other)).returncode == 6
    p = _main(capsys, "--sign", str(signed.parent / "review.key"))
    assert p.returncode == 2 and "--output" in p.stderr and "Traceback" not in p.stderr


# --------------------------------------------------------------------------- live


def _read_events(proc: subprocess.Popen, q: queue.Queue) -> None:
    for line in proc.stderr:
        if line.startswith("{"):
            q.put(json.loads(line))


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    """One small `supervisor run`, shared: a 'vehicle' one (no TRIO_STATE_DIR override;
    its config's state_dir is a temporary directory)."""
    d = tmp_path_factory.mktemp("running")
    cfg = d / "run.toml"
    cfg.write_text(CLEAN + f'\n[supervisor]\nstate_dir = "{d / "state"}"\n')
    env = {k: v for k, v in os.environ.items() if k != "TRIO_STATE_DIR"}
    proc = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run", "--config",
                             str(cfg), "--quiet"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env)
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_read_events, args=(proc, q), daemon=True).start()
    events: list[dict] = []
    deadline = time.monotonic() + 90
    while not any(e["event"] == "all_ready" for e in events):
        try:
            events.append(q.get(timeout=max(0.1, deadline - time.monotonic())))
        except queue.Empty:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail(f"supervisor not ready: {[e['event'] for e in events]}")
    time.sleep(1.0)       # the standby's READY and the maps snapshots settle
    yield proc, cfg, events, q
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _drain(q: queue.Queue, events: list[dict]) -> list[dict]:
    new = []
    while True:
        try:
            new.append(q.get_nowait())
        except queue.Empty:
            events += new
            return new


@NEEDS_ROOT_SANDBOX
def test_live_inspects_the_running_system(running):
    from supervisor.audit.running import find_supervisors

    proc, cfg, events, q = running
    mine = [r for r in find_supervisors() if r.pid == proc.pid]
    assert mine and {s.worker for s in mine[0].sandboxes} == {"src", "sink", "lab"}
    before = sorted(s.bwrap_pid for s in mine[0].sandboxes)
    _drain(q, events)
    p = _audit("--live", "--pid", str(proc.pid), "--format", "json")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    r = json.loads(p.stdout)
    assert r["mode"] == "live" and r["result"] == "matches" and r["differences"] == []
    assert r["running"]["pid"] == proc.pid and r["running"]["config"] == str(cfg)
    checks = {(c["path"], c["check"]): c for c in r["live_paths"]}
    assert all(c["ok"] for c in r["live_paths"]), [c for c in r["live_paths"] if not c["ok"]]
    # the research-to-control path, seen on the processes: lab writes its lease table,
    # src maps it read-only
    assert checks[("frames.lease.lab", "lab (reader 1): its own lease1 only, fd O_RDWR")]
    lease = checks[("frames.lease.lab", "src (channel writer): lease1 fd O_RDONLY, mapped r--s")]
    assert "r--s" in lease["observed"]
    claims = checks[("frames.lease.lab", "lab (reader 1): the claims it wrote, as src reads them")]
    assert "lease(s) held" in claims["observed"]          # the very bytes, read back
    assert {c["path"] for c in r["live_paths"]} >= {"status.src", "output.lab",
                                                    "execwatch.sink", "state-dir"}
    rows = {w["worker"]: w for w in r["workers"]}
    assert rows["sink"].get("standbys"), "the warm standby was not inspected"
    # the filesystem check can fail: the same mount table against a policy that lacks
    # the private /tmp, or promises /usr writable
    from supervisor.audit import fsview

    seen = fsview.mountinfo(rows["src"]["pid"])
    view = fsview.view_of(loads(cfg.read_text(), str(cfg)), loads(cfg.read_text(),
                                                                  str(cfg)).workers["src"])
    assert fsview.compare("src", view, seen) == []
    lacking = dict(view, mounts=[m for m in view["mounts"] if m["path"] != "/tmp"])
    assert [d["key"] for d in fsview.compare("src", lacking, seen)] == ["filesystem./tmp"]
    rw_usr = dict(view, mounts=[dict(m, access="rw") if m["path"] == "/usr" else m
                                for m in view["mounts"]])
    assert [d["key"] for d in fsview.compare("src", rw_usr, seen)] == ["filesystem./usr"]
    # ... and so can the path check: the same evidence with lab's segment fd writable
    from supervisor.audit import pathcheck

    c = loads(cfg.read_text(), str(cfg))
    got = {"workers": {n: w["evidence"] for n, w in rows.items()}}
    clean = {d["key"] for d in pathcheck.check_paths(c, paths.interference_paths(c), got,
                                                     None)[1]}
    lab = got["workers"]["lab"]
    data_fd = lab["handles"]["frames"]["data_fd"]
    for items in lab["fds"].values():
        for i in items:
            if i["fd"] == data_fd:
                i["access"] = "O_RDWR"
    broken = {d["key"] for d in pathcheck.check_paths(c, paths.interference_paths(c), got,
                                                      None)[1]}
    assert broken - clean == {"paths.frames.data.lab"}
    # read-only: nothing started, restarted or stopped meanwhile
    after = [s.bwrap_pid for s in next(x for x in find_supervisors()
                                       if x.pid == proc.pid).sandboxes]
    assert sorted(after) == before
    new = _drain(q, events)
    assert not [e for e in new if e["event"] in ("start", "exit", "restart", "refused",
                                                 "standby_start", "fail_safe")], new
    assert proc.poll() is None


@NEEDS_ROOT_SANDBOX
def test_live_flags_what_the_running_system_does_not_keep(running, tmp_path):
    """Audited against a config that promises more than the running system does (a
    smaller open-file limit, a tighter memory limit): differences, exit 6."""
    proc, cfg, _events, _q = running
    other = tmp_path / "tighter.toml"
    other.write_text(cfg.read_text().replace("nofile = 256", "nofile = 128")
                     .replace('memory_max = "256MiB"', 'memory_max = "128MiB"'))
    p = _audit("--live", "--pid", str(proc.pid), "--config", str(other), "--format", "json")
    assert p.returncode == 6, p.stderr[-2000:]
    keys = {(d["worker"], d["key"]) for d in json.loads(p.stdout)["differences"]}
    assert {("sink", "limits.nofile"), ("src", "limits.memory_max")} <= keys


@NEEDS_ROOT_SANDBOX
def test_start_is_refused_beside_a_vehicle_supervisor(running):
    proc, cfg, _events, _q = running
    p = _audit("--live", "--start", "--config", str(cfg))
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "refused" in p.stderr and str(proc.pid) in p.stderr
    nope = _audit("--live", "--pid", "1")
    assert nope.returncode == 2 and "no running supervisor with pid 1" in nope.stderr
