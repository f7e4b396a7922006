"""`supervisor audit`: the config's promises, and (--live) the evidence of real sandboxes
started by the real supervisor, including sandboxes broken on purpose."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from supervisor.audit import EXIT_DIFFERENCES, SCHEMA_VERSION, audit, render
from supervisor.audit.evidence import resolve_in_root
from supervisor.config import load, loads

NEEDS_ROOT_SANDBOX = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="live audits start real sandboxes: bubblewrap and root (host uids, cgroups)")

TORCH_LIB = None
try:   # a torch shared object to map (read-only) from a control worker on purpose
    import importlib.util

    _spec = importlib.util.find_spec("torch")
    if _spec and _spec.submodule_search_locations:
        _lib = Path(list(_spec.submodule_search_locations)[0]) / "lib"
        TORCH_LIB = next((str(p) for p in sorted(_lib.glob("libtorch*.so*"))), None)
except (ImportError, ValueError):
    pass


def _probe(name: str, domain: str, *, args: list[str], publishes=(), subscribes=(),
           extra: str = "") -> str:
    return f"""
    [workers.{name}]
    domain = "{domain}"
    module = "workers.probe"
    publishes = {json.dumps(list(publishes))}
    subscribes = {json.dumps(list(subscribes))}
    args = {json.dumps(args)}
    {extra}
    """


CLEAN = textwrap.dedent("""
    [domains.control]
    failure_policy = "restart"
    actuates = true
    [domains.research]
    [channels.frames]
    slot_size = "4KiB"
    dtype = "uint8"
    """) + textwrap.dedent(
    _probe("src", "control", publishes=["frames"],
           args=["--publish", "frames", "--period-ms", "20", "--ping-ms", "20"],
           extra='memory_max = "256MiB"\n    pids_max = 32\n    cpu_quota = 50')
    + _probe("sink", "control", subscribes=["frames"], args=["--read", "frames"],
             extra="nofile = 256\n    realtime_priority = 20\n    realtime_budget_pct = 5"
                   "\n    warm_standby = true")   # a standby is normal class until READY
    + _probe("lab", "research", subscribes=["frames"], args=["--read", "frames"]))


# --------------------------------------------------------------------------- config mode


def _demo_key_id() -> str:
    """The key id of the public key the default config trusts for its driving model."""
    from supervisor.model.keys import key_id, load_public_key

    cfg = load()
    return key_id(load_public_key(cfg.models[cfg.workers["modeld"].model].public_key))


@pytest.fixture(scope="module")
def default_report():
    return audit(load())


def test_default_config_promises(default_report):
    r = default_report
    assert r["schema_version"] == SCHEMA_VERSION == 1
    assert r["mode"] == "config" and r["result"] == "promise" and r["exit_code"] == 0
    assert r["differences"] == []
    rows = {w["worker"]: w for w in r["workers"]}
    control = ["camerad", "camerad_wide", "camerad_driver", "modeld", "dmonitoringd", "controlsd"]
    assert list(rows) == [*control, "research"]          # the car, in start order
    for name in control:
        w = rows[name]
        assert w["profile"] == "control" and w["host"]["user"] == "trio-control"
        assert w["namespaces"] == {ns: "private" for ns in
                                   ("user", "pid", "ipc", "uts", "cgroup", "mnt", "net")}
        assert not w["network"] and not w["compilers_visible"]
        assert not w["exec_after_start"] and not w["new_exec_memory_after_ready"]
        # launch + runtime + exec watch, and W^X from READY where this tree has it
        assert w["seccomp"]["filters"] == 3 + int(w["seccomp"]["wx_from_ready"])
        assert {"ptrace", "execve"} <= set(w["seccomp"]["launch"]["kill"]
                                           + w["seccomp"]["after_start_kill"])
        assert w["torch"] == "refused" and w["admission"] == {
            "checked": True, "admitted": True, "chains": []}
        assert all(v == [] for v in w["capabilities"].values())
    assert rows["modeld"]["jit_kernels"] and not rows["camerad"]["jit_kernels"]
    assert rows["dmonitoringd"]["jit_kernels"]
    for worker, named in (("modeld", "lane-offset-wide"), ("dmonitoringd", "driver-monitor")):
        (model,) = rows[worker]["models"]
        assert model["name"] == f"{named}-demo" and model["version"] == "1.0.0"
        assert model["signature"] == "verified"
        assert model["key_id"] == _demo_key_id()
        assert model["artifact"].endswith(f"models/demo/{named}")
        # the trust record comes from the config's [models.NAME]
        trusted = load().models[named]
        assert model["model"] == named and model["min_version"] == trusted.min_version
        assert model["expect_name"] == trusted.expect_name == model["name"]
    read = {"shadow": False, "log_only": False, "access": "read-only"}
    assert rows["controlsd"]["channels"] == {
        "writes": [{"channel": "control_cmd", "access": "read-write"}],
        "reads": [{"channel": "model_out", **read}, {"channel": "driver_state", **read}]}
    res = rows["research"]
    assert res["host"]["user"] == "trio-research" and res["torch"] == "allowed"
    assert res["compilers_visible"] and res["exec_after_start"]
    assert res["seccomp"]["filters"] == 1 and res["seccomp"]["launch"]["eperm"]
    assert res["limits"] == {"memory_max": 8 * 2**30, "pids_max": 256, "cpu_quota_pct": 200.0,
                             "cpu_weight": 100, "nofile": None}
    assert rows["controlsd"]["limits"]["cpu_weight"] == 1000   # control waits for no one

    chans = {c["channel"]: c for c in r["channels"]}
    assert chans["control_cmd"]["actuation"] and chans["control_cmd"]["crc"]
    assert chans["control_cmd"]["max_age_ms"] == 50
    assert chans["shadow_out"]["shadow"] and chans["shadow_out"]["research_data"]
    for cam in ("road_frames", "wide_frames", "driver_frames"):
        assert chans[cam]["feeds_actuation"] == ["control_cmd"]
    assert [x["worker"] for x in chans["road_frames"]["readers"]] == ["modeld", "research"]
    t = r["trust"]
    assert t["holds"] and t["actuating_domains"] == ["control"]
    (path,) = t["actuation_paths"]
    assert path["workers"] == ["controlsd", "modeld", "dmonitoringd", "camerad_driver",
                               "camerad", "camerad_wide"]
    assert path["research_data_upstream"] == [] and "shadow_out" in t["research_data"]
    assert any("shadow_subscribes" in rule for rule in t["rules"])


def test_formats(default_report):
    as_json = json.loads(render(default_report, "json"))
    assert as_json["workers"][0]["worker"] == "camerad"
    md = render(default_report, "markdown")
    assert md.startswith("# Isolation audit (config promises)")
    assert "| camerad (control) |" in md and "## Channels" in md and "## Trust rules" in md
    # narrow enough to read: no table wider than 6 columns
    assert max(line.count("|") - 1 for line in md.splitlines() if line.startswith("|")) <= 6
    assert f"lane-offset-wide-demo 1.0.0 key {_demo_key_id()[:16]}" in md
    assert f"driver-monitor-demo 1.0.0 key {_demo_key_id()[:16]}" in md
    txt = render(default_report, "text")
    assert "research  [research]" in txt and "exec after start" in txt
    with pytest.raises(ValueError):
        render(default_report, "yaml")


def test_reviewer_sections_of_the_default_config(default_report):
    """Issue 25: provenance and verdict first, every byte path between domains (the
    research-written lease table camerad reads among them), failure behaviour, each
    worker's files, the whole syscall policy, in every format."""
    r = default_report
    prov = r["provenance"]
    assert prov["time_utc"].endswith("Z") and prov["kernel"].startswith("Linux")
    assert len(prov["config"]["sha256"]) == 64 and prov["git"]["commit"]
    assert [a["name"] for a in prov["artifacts"]] == ["lane-offset-wide-demo", "driver-monitor-demo"]
    for art in prov["artifacts"]:
        assert art["key_id"] == _demo_key_id() and len(art["manifest_sha256"]) == 64
        assert art["files_match_manifest"] is True and "jit.pkl" in art["files"]
    v = r["verdict"]
    assert v["holds"] and v["counts"]["workers"] == 7
    into = {p["id"]: p for p in v["into_actuating"]}
    assert "road_frames.lease.research" in into and "lease_ms (100 ms)" in \
        into["road_frames.lease.research"]["bound"]
    paths = {p["id"]: p for p in r["interference_paths"]}
    mon = paths["control_cmd.data.supervisor"]          # the monitor reads control_cmd
    assert (mon["writer"], mon["reader"]) == ("controlsd", "supervisor")
    fail = {f["worker"]: f for f in r["failure"]}
    assert fail["controlsd"]["failure_policy"] == "fail_safe" and fail["controlsd"]["warm_standby"]
    assert "max_age_ms 50 ms" in fail["controlsd"]["actuation_meanwhile"]
    assert "FAIL-SAFE" in fail["camerad"]["on_give_up"]
    assert "optional" in fail["research"]["on_give_up"]
    fs = r["filesystem"]["camerad"]
    if not fs["error"]:
        assert fs["writable"] == ["/tmp", "/dev/shm"]
        assert any("torch" in names for names in fs["whiteouts"].values())
        assert "torch" not in str(r["filesystem"]["research"]["whiteouts"])
    sc = r["syscalls"]
    if not sc["error"]:
        control = sc["classes"][sc["by_domain"]["control"]]
        assert {"ptrace", "execve", "bpf"} <= set(control["killed"])
        assert "read" in control["allowed"] and "mmap" in control["notified"]
        research = sc["classes"][sc["by_domain"]["research"]]
        assert research["errno"]["ptrace"] == "EPERM"
    md = render(r, "markdown")
    first_table = md.index("\n|")
    assert md.index("VERDICT:") < first_table             # the verdict before any table
    assert "## Interference paths" in md and "**road_frames.lease.research**" in md
    assert "## Failure behaviour per worker" in md and "## Filesystem view per worker" in md
    if not sc["error"]:
        assert "### Appendix A:" in md and "### Appendix B:" in md
        txt = render(r, "text")
        # the whole list, never cut: every killed syscall of the control class
        assert all(n in txt for n in control["killed"]) and ", ..." not in txt


def test_refused_worker_shows_its_chain(tmp_path):
    """A control worker that imports torch: admission's chain is in its row."""
    pkg = tmp_path / "torchy_worker"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import torch\n\ndef main(ctx):\n    return 0\n")
    sys.path.insert(0, str(tmp_path))
    try:
        cfg = loads(textwrap.dedent("""
            [domains.control]
            [workers.bad]
            domain = "control"
            module = "torchy_worker"
            optional = true
            """), "refused.toml")
        (row,) = audit(cfg)["workers"]
    finally:
        sys.path.remove(str(tmp_path))
    assert row["admission"]["admitted"] is False
    assert any("torch" in c for c in row["admission"]["chains"])


def test_resolve_in_root_never_leaves_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "usr/bin").mkdir(parents=True)
    (root / "etc/alternatives").mkdir(parents=True)
    (root / "usr/bin/gcc-12").write_text("")
    (root / "usr/bin/gcc").symlink_to("gcc-12")
    (root / "usr/bin/cc").symlink_to("/etc/alternatives/cc")   # absolute: stays inside
    (root / "usr/bin/up").symlink_to("../../../../../../etc/passwd")
    assert resolve_in_root(str(root), "/usr/bin/gcc")[0] == "/usr/bin/gcc-12"
    final, st = resolve_in_root(str(root), "/usr/bin/cc")
    assert final == "/etc/alternatives/cc" and st is None       # host's /etc not consulted
    final, st = resolve_in_root(str(root), "/usr/bin/up")
    assert final == "/etc/passwd" and st is None


# --------------------------------------------------------------------------- live


@NEEDS_ROOT_SANDBOX
def test_live_audit_of_a_clean_system(tmp_path):
    """`--live --start`: a system of the audit's own (the running one is inspected
    without starting anything: tests/test_audit_review.py)."""
    r = json.loads(render(audit(loads(CLEAN, "clean.toml"), live=True, settle_s=0.5,
                                timeout_s=120), "json"))
    assert r["exit_code"] == 0, json.dumps(r["differences"])[-3000:]
    assert r["mode"] == "live" and r["result"] == "matches" and r["differences"] == []
    rows = {w["worker"]: w for w in r["workers"]}
    control = pwd.getpwnam("trio-control")
    mine = {ns: os.stat(f"/proc/self/ns/{ns}").st_ino for ns in ("user", "pid", "net", "mnt")}
    seen: dict[str, set[int]] = {}
    for name, w in rows.items():
        e = w["evidence"]
        assert w["running"] and e["status"]["Seccomp"] == "2"
        assert e["status"]["CapEff"] == e["status"]["CapBnd"] == "0000000000000000"
        assert e["status"]["NoNewPrivs"] == "1"
        assert e["interfaces"] == ["lo"]
        for ns, ino in e["namespaces"].items():
            assert ino != mine.get(ns)
            assert ino not in seen.setdefault(ns, set()), f"{name} shares its {ns} namespace"
            seen[ns].add(ino)
        assert e["cgroup"]["member"]
    for name in ("src", "sink"):
        e = rows[name]["evidence"]
        assert rows[name]["host"]["uid"] == control.pw_uid
        assert e["uid_map"] == [[1000, control.pw_uid, 1]]
        assert e["status"]["Seccomp_filters"] == str(rows[name]["seccomp"]["filters"])
        assert rows[name]["seccomp"]["filters"] in (3, 4)     # 4: W^X from READY
        assert e["exec_watch"] == {"listener_held": True, "closed_at_ready": True,
                                   "ready_snapshot": e["exec_watch"]["ready_snapshot"]}
        assert "executable" not in e["compilers"].values()
    assert rows["lab"]["host"]["user"] == "trio-research"
    if shutil.which("gcc"):
        assert rows["lab"]["evidence"]["compilers"]["/usr/bin/gcc"] == "executable"
        assert rows["src"]["evidence"]["compilers"]["/usr/bin/gcc"] in ("char-device", "missing")
    # the writer maps its segment rw-s, every reader r--s (and only its own lease rw)
    assert rows["src"]["evidence"]["channel_mappings"]["frames"]["data"] == ["rw-s"]
    assert rows["src"]["evidence"]["channel_fds"]["frames"]["data"] == ["O_RDWR"]
    for reader in ("sink", "lab"):
        m = rows[reader]["evidence"]["channel_mappings"]["frames"]
        assert m["data"] == ["r--s"] and list(m["leases"].values()) == [["rw-s"]]
        assert rows[reader]["evidence"]["channel_fds"]["frames"]["data"] == ["O_RDONLY"]
    lim = rows["src"]["limits"]
    assert (lim["memory_max"], lim["pids_max"], lim["cpu_quota_pct"]) == (256 * 2**20, 32, 50.0)
    assert lim["cpu_weight"] == 1000 and rows["lab"]["limits"]["cpu_weight"] == 100  # in force
    assert rows["sink"]["limits"]["nofile"] == 256 and rows["sink"]["limits"]["pids_max"] == 64
    # the real-time grant, read back from the kernel (and the cgroup's RT budget on v1)
    sch = rows["sink"]["scheduling"]
    assert (sch["policy"], sch["priority"], sch["reset_on_fork"]) == ("fifo", 20, True)
    assert sch["rt_budget_pct"] in (5, None)         # None: no per-cgroup RT budget (v2)
    assert rows["src"]["scheduling"]["policy"] == rows["lab"]["scheduling"]["policy"] == "other"
    assert rows["sink"]["standby"]["scheduling"]["policy"] == "other"


BROKEN = CLEAN + textwrap.dedent(
    """
    [supervisor]
    maps_scan_interval_s = 3600      # let the audit, not the supervisor, find c-torch
    [channels.spare]
    slot_size = "4KiB"
    dtype = "uint8"
    """
    + _probe("spare-w", "control", publishes=["spare"], args=[])
    + _probe("c-rw", "control", subscribes=["spare"], args=["--publish", "spare"])
    + _probe("c-net", "control", args=[])
    + _probe("c-cc", "control", args=[])
    + _probe("c-root", "control", args=[])
    + _probe("r-bare", "research", args=[])
    + _probe("c-bare", "control", args=[])
    + (_probe("c-torch", "control", args=["--map-file", TORCH_LIB]) if TORCH_LIB else ""))


def _breaker(cfg, log):
    """The real Supervisor, with one isolation property broken per worker."""
    from supervisor.ipc import env_name
    from supervisor.lifecycle import Supervisor
    from supervisor.notify import Notifier

    class Breaker(Supervisor):
        def _policy(self, w):
            pol = super()._policy(w)
            if w.name == "c-net":
                pol.network = True                  # no --unshare-net
            elif w.name == "c-cc":
                pol.hide_compilers = False          # compilers bound in
            elif w.name == "c-root":
                pol.host_uid = pol.host_gid = None  # bwrap stays host root
            elif w.name == "r-bare":
                pol.seccomp_at_launch = False       # research: then no filter at all
            elif w.name == "c-bare":
                pol.seccomp_at_launch = False       # control: exec ban + watch only
            elif w.name == "c-torch":
                pol.hidden = []                     # torch's files visible
            return pol

        async def _verify_ready(self, run, now):
            if run.cfg.name == "c-torch":         # READY without the maps snapshot
                self._set_ready(run, now)
                return
            await super()._verify_ready(run, now)

        # A reader handed the writer's fd. Two spellings of the same hook: the channel
        # handles by name (`_handles`), or the older env + fds (`_endpoint_env`).
        def _handles(self, w):
            out = super()._handles(w)
            if w.name == "c-rw":
                out["spare"] = self.channels["spare"].writer_handle()
            return out

        def _endpoint_env(self, w):
            env, fds = super()._endpoint_env(w)
            if w.name == "c-rw":                    # a reader handed the writer's fd
                h = self.channels["spare"].writer_handle()
                env[env_name("spare")] = h.to_json()
                fds = h.fds()
            return env, fds

    return Breaker(cfg, log=log, notifier=Notifier({}))


@NEEDS_ROOT_SANDBOX
def test_live_audit_flags_every_broken_property():
    cfg = loads(BROKEN, "broken.toml")
    r = audit(cfg, live=True, factory=_breaker, settle_s=0.7, timeout_s=120)
    assert r["result"] == "differences" and r["exit_code"] == EXIT_DIFFERENCES == 6, \
        json.dumps(r["supervisor"], indent=1)[-3000:]
    keys: dict[str, set[str]] = {}
    for d in r["differences"]:
        keys.setdefault(d["worker"], set()).add(d["key"])
    for clean in ("src", "sink", "lab", "spare-w"):
        assert clean not in keys, [d for d in r["differences"] if d["worker"] == clean]
    assert {"namespaces.net", "network"} <= keys["c-net"]
    assert keys["c-cc"] == {"compilers_visible"}
    assert "host.uid" in keys["c-root"]
    assert keys["c-rw"] == {"channels.spare"}
    assert keys["r-bare"] == {"seccomp"}
    # two filters where three are promised: which one is missing cannot be read from
    # /proc, so the audit also stops vouching for the exec ban
    assert "seccomp" in keys["c-bare"] <= {"seccomp", "exec_after_start"}
    if TORCH_LIB:
        assert keys["c-torch"] == {"torch"}
    rows = {w["worker"]: w for w in r["workers"]}
    assert rows["c-root"]["host"]["uid"] == 0
    assert rows["c-root"]["evidence"]["uid_map"] == [[1000, 0, 1]]
    assert rows["r-bare"]["evidence"]["status"]["Seccomp"] == "0"
    promised = {p["worker"]: p for p in r["promised"]}
    # the launch filter is missing: one fewer than promised (W^X or not)
    assert rows["c-bare"]["seccomp"]["filters"] == promised["c-bare"]["seccomp"]["filters"] - 1
    assert rows["c-rw"]["evidence"]["channel_mappings"]["spare"]["data"] == ["rw-s"]
    assert len(rows["c-net"]["evidence"]["interfaces"]) > 1 or \
        rows["c-net"]["namespaces"]["net"] == "host"
    txt = render(r, "text")
    assert "!! yes" in txt and "runs as host root" in txt
    md = render(r, "markdown")
    assert "## Differences" in md and "`channels.spare`" in md


def test_survivors_are_named():
    """What outlives the orderly stop is reported (a supervisor that cannot signal its
    sandboxes, e.g. without CAP_KILL, leaves them running: `audit --live` says so)."""
    from supervisor.admission import maps
    from supervisor.audit.live import survivors

    me = os.getpid()
    evidence = {"alive": {"start_times": {str(me): maps.start_time(me)}},
                "reused": {"start_times": {str(me): maps.start_time(me) - 1}},
                "gone": {"start_times": {"999999999": 1}}}
    assert survivors(evidence, grace_s=0) == {"alive": [me]}
