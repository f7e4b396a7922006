"""Domains are data: a domain's isolation is typed fields with its profile's defaults,
overridable (control only ever tighter), and enforced inside the sandbox; every line of
the log is one event naming its source."""
from __future__ import annotations

import errno
import json
import os
import pwd
import shutil

import pytest

from supervisor.config import loads
from supervisor.events import EventLog, render
from supervisor.output import parse_log_record
from supervisor.protocol import Isolation, StatusLine, format_line, parse_line


BASE = """
[domains.control]
actuates = true
[channels.x]
slot_size = "4KiB"
[workers.cam]
domain = "control"
module = "workers.probe"
publishes = {{ frames = "x" }}
args = ["--publish", "x"]
{extra}
"""


def problems(text: str) -> list[str]:
    from supervisor.config import ConfigFileError

    try:
        loads(text, "d.toml")
    except ConfigFileError as e:
        return [str(p) for p in e.problems]
    return []


def test_profiles_set_every_isolation_field_and_control_only_tightens():
    cfg = loads(BASE.format(extra="[domains.lab]\nprofile = \"research\"\nrefuse_torch = true\n"
                            "exec_after_start = false"), "d.toml")
    c, lab = cfg.domains["control"], cfg.domains["lab"]
    assert (c.network, c.hide_compilers, c.exec_after_start, c.refuse_torch,
            c.exec_memory_after_ready, c.seccomp) == (False, True, False, True, False, "control")
    # research defaults, with two fields tightened
    assert (lab.hide_compilers, lab.exec_after_start, lab.refuse_torch,
            lab.exec_memory_after_ready, lab.seccomp) == (False, False, True, True, "research")
    assert lab.isolation() == Isolation(refuse_torch=True, exec_after_start=False,
                                        exec_memory_after_ready=True, seccomp="research")
    for key, value, why in [("exec_after_start", "true", "must not start processes"),
                            ("refuse_torch", "false", "must refuse torch"),
                            ("hide_compilers", "false", "must not see compilers"),
                            ("exec_memory_after_ready", "true", "new executable memory"),
                            ("seccomp", '"research"', "control syscall filter")]:
        got = problems(BASE.format(extra="").replace("actuates = true",
                                                     f"actuates = true\n{key} = {value}"))
        assert len(got) == 1 and f"domains.control.{key}:" in got[0] and why in got[0], got
    got = problems(BASE.format(extra="").replace("actuates = true",
                                                 'actuates = true\nextra_rw_binds = ["/srv"]'))
    assert len(got) == 1 and "no writable binds" in got[0], got
    got = problems(BASE.format(extra="[domains.lab]\nprofile = \"research\"\nseccomp = \"strict\""))
    assert len(got) == 1 and "domains.lab.seccomp" in got[0] and "'control'" in got[0], got


def test_a_writable_bind_is_never_read_outside_the_bridge():
    """Research writing where control (or the model trust) reads would be a channel
    around the bridge: refused, like writable OS trees and the supervisor's state."""
    text = BASE.format(extra="""
[domains.lab]
profile = "research"
extra_rw_binds = ["/srv/shared/out", "/etc/x", "/var/lib/trio-supervisor", "/srv/lab"]
[models.m]
artifact = "/srv/lab/model"
public_key = "/srv/key.pub"
expect_name = "m"
""").replace("actuates = true", 'actuates = true\nextra_ro_binds = ["/srv/shared"]')
    got = problems(text)
    assert len(got) == 4, got
    assert "extra_rw_binds[0]: /srv/shared/out overlaps domains.control (/srv/shared)" in got[0]
    assert "extra_rw_binds[1]: /etc/x overlaps /etc: never writable" in got[1]
    assert "extra_rw_binds[2]: /var/lib/trio-supervisor overlaps" in got[2]
    assert "extra_rw_binds[3]: /srv/lab overlaps models.m (/srv/lab/model)" in got[3]


def test_an_alias_of_a_writable_bind_is_that_bind(tmp_path):
    """bubblewrap follows symlinks: control reading research's output directory through
    a symlink is the same channel around the bridge (found by the red team). The file
    alone cannot show it; `check_runtime` (check and run) resolves the paths."""
    from supervisor.config import check_runtime

    (tmp_path / "out").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "out")
    text = BASE.format(extra=f"""
[domains.lab]
profile = "research"
extra_rw_binds = ["{tmp_path / 'out'}"]
""").replace("actuates = true", f'actuates = true\nextra_ro_binds = ["{tmp_path / "alias"}"]')
    assert problems(text) == []
    got = [str(p) for p in check_runtime(loads(text, "d.toml"), sandboxed=False)
           if "overlaps" in p.reason]
    assert len(got) == 1 and f"{tmp_path / 'out'} overlaps domains.control ({tmp_path / 'alias'})" \
        in got[0], got


def test_roles_bind_channels_and_a_role_bound_twice_is_an_error():
    cfg = loads(BASE.format(extra=""), "d.toml")
    assert cfg.workers["cam"].roles == (("frames", "x"),)
    assert cfg.workers["cam"].publishes == ("x",)
    got = problems(BASE.format(extra='subscribes = { frames = "x" }'))
    assert any("role 'frames' is bound twice" in p for p in got), got
    got = problems(BASE.format(extra="").replace('{ frames = "x" }', '{ frames = 3 }'))
    assert any("role 'frames': expected a channel name" in p for p in got), got


def test_status_grammar_is_one_parser():
    assert parse_line("READY=1 STATUS=fps=20 frames=3") == [
        StatusLine("READY"), StatusLine("STATUS", "fps=20 frames=3")]
    assert parse_line("WATCHDOG=1") == [StatusLine("WATCHDOG")]
    assert parse_line("REFUSED=import torch via x") == [StatusLine("REFUSED", "import torch via x")]
    assert parse_line("READY=2")[0].kind == "UNKNOWN" and parse_line("hello")[0].kind == "UNKNOWN"
    assert parse_line(format_line("STATUS", "a\nREADY=1")) == [StatusLine("STATUS", "a READY=1")]
    assert parse_line(format_line("READY", "up")) == [StatusLine("READY"), StatusLine("STATUS", "up")]
    # a garbled isolation variable fails closed: control's rules
    assert Isolation.decode("refuse_torch=0,seccomp=bogus").seccomp == "control"
    assert Isolation.decode("") == Isolation()


def test_a_worker_log_record_cannot_claim_another_source():
    forged = json.dumps({"log": "hi", "data": {"a": 1}, "source": "supervisor",
                         "event": "ready", "worker": "modeld"})
    assert parse_log_record(forged) == {"msg": "hi", "data": {"a": 1}}
    assert parse_log_record('{"event":"ready","worker":"modeld"}') is None
    assert parse_log_record('{"log": 5}') is None and parse_log_record('{"log":') is None
    # nesting deeper than the interpreter's recursion limit: a plain line, not a crash
    assert parse_log_record('{"log":"x","data":' + "[" * 1900) is None
    import io
    buf = io.StringIO()
    log = EventLog(stream=buf)
    rec = log.emit("log", source="cam", worker="cam", **parse_log_record(forged))
    assert rec["source"] == "cam" and rec["event"] == "log"
    line = render(rec, "text")
    assert " cam log " in line and "msg=hi" in line


needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap missing")


@pytest.mark.sandbox
@needs_bwrap
def test_overridden_domain_fields_hold_inside_the_sandbox(sup, tmp_path):
    """A research-profile domain tightened to refuse torch is refused torch at runtime;
    its writable bind is writable, nothing else outside /tmp is; workers' own log
    records arrive as events whose source is the worker."""
    out = tmp_path / "out"
    out.mkdir()
    try:
        u = pwd.getpwnam("trio-research")
        os.chown(out, u.pw_uid, u.pw_gid)
    except KeyError:
        pytest.skip("user trio-research missing (scripts/install.sh creates it)")
    os.chmod(tmp_path, 0o755)
    cfg = f"""
        [domains.lab]
        profile = "research"
        refuse_torch = true
        exec_after_start = false
        extra_rw_binds = ["{out}"]
        [domains.research]
        [workers.importer]
        domain = "lab"
        module = "workers.probe"
        args = ["--import", "torch"]
        restart = "never"
        optional = true
        [workers.writer]
        domain = "lab"
        module = "workers.probe"
        args = ["--write-file", "{out}/ok.txt"]
        restart = "never"
        [workers.execer]
        domain = "lab"
        module = "workers.probe"
        args = ["--exec", "/bin/true"]
        restart = "never"
        optional = true
        [workers.exec-ok]
        domain = "research"
        module = "workers.probe"
        args = ["--exec", "/bin/true"]
        restart = "never"
        [workers.outsider]
        domain = "research"
        module = "workers.probe"
        args = ["--write-file", "{out}/no.txt"]
        restart = "never"
        """
    r = sup(cfg)
    ref = r.wait_for("refused", worker="importer", timeout=60)[0]
    assert ref["kind"] == "guard:import" and "torch" in ref["reason"], ref
    ok = r.wait_for("log", worker="writer", msg="write", timeout=60)[0]
    assert ok["source"] == "writer" and ok["data"] == {"path": f"{out}/ok.txt", "result": "ok"}
    assert (out / "ok.txt").read_text() == "writer"
    no = r.wait_for("log", worker="outsider", msg="write", timeout=60)[0]
    assert no["data"]["result"].startswith("errno:"), no        # not bound: not even visible
    assert not (out / "no.txt").exists()
    # exec_after_start = false holds in a research-profile domain too: the worker
    # cannot even start the process (EPERM at the fork: nothing to exec in), where
    # plain research runs the program
    no = r.wait_for("log", worker="execer", msg="exec", timeout=60)[0]
    assert no["data"]["result"] == f"errno:{errno.EPERM}", no
    ok = r.wait_for("log", worker="exec-ok", msg="exec", timeout=60)[0]
    assert ok["data"]["result"] == "exit:0", ok
    assert all(e["source"] == "supervisor" for e in r.events if e["event"] in ("start", "ready"))


def test_renaming_every_channel_of_the_default_config_needs_nothing_else():
    """Channel names live in the config only: rename them all (payload kinds are not
    channel names) and the config loads, binds every role and passes the role check."""
    from importlib import resources

    from supervisor.config import check_runtime

    text = resources.files("supervisor").joinpath("default.toml").read_text("utf-8")
    new = {"road_frames": "cam0", "wide_frames": "cam1", "driver_frames": "cam2",
           "model_out": "lanes", "driver_state": "eyes", "control_cmd": "steer",
           "shadow_out": "lab"}
    lines = []
    for line in text.splitlines():
        if not line.startswith("payload"):
            for a, b in new.items():
                line = line.replace(a, b)
        lines.append(line)
    cfg = loads("\n".join(lines), "renamed.toml")
    assert sorted(cfg.channels) == sorted(new.values())
    assert dict(cfg.workers["modeld"].roles) == {"frames": "cam0", "wide": "cam1",
                                                 "model": "lanes"}
    assert dict(cfg.workers["dmonitoringd"].roles) == {"frames": "cam2", "model": "eyes"}
    assert dict(cfg.workers["controlsd"].roles) == {"model": "lanes", "driver": "eyes",
                                                    "command": "steer"}
    assert not [p for p in check_runtime(cfg, sandboxed=False) if "role" in p.reason]
