"""A safety reviewer's first contact with `supervisor audit` (docs/review.md), from the
command line: sign a report, verify it (and learn what was checked), see a config edited
after signing fail verify, have bad keys refused in one line, and see a control worker
that lost its real-time priority or its warm standby reported as a weakening.

One module-scoped pair of reports (the first audit in a process walks admission's
imports: ~8 s of CPU; the second reuses it: ~1 s).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from supervisor.config import PROJECT_ROOT

MINIMAL = (Path(PROJECT_ROOT) / "supervisor" / "configs" / "minimal.toml").read_text()
_CTL = """restart = "always"
busy_poll_us = 1000             # model_out: modeld announces each output; <= 2 ms CPU a frame
warm_standby = true
watchdog_ms = 200"""
# The car's controlsd: SCHED_FIFO, like default.toml's (no busy-polling then).
RT = MINIMAL.replace(_CTL, 'restart = "always"\nrealtime_priority = 50\n'
                     'realtime_budget_pct = 10\nwarm_standby = true\nwatchdog_ms = 200')
# The same controlsd in the normal class and without its standby.
PLAIN = MINIMAL.replace(_CTL, 'restart = "always"\nwarm_standby = false\nwatchdog_ms = 200')


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    from supervisor.audit.command import main

    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, Path]:
    from supervisor.audit.command import main
    from supervisor.model.keys import generate_private_key, public_key_text

    assert RT != MINIMAL and PLAIN != MINIMAL, "minimal.toml's controlsd changed: fix _CTL"
    d = tmp_path_factory.mktemp("journey_audit")
    (d / "rt.toml").write_text(RT)
    (d / "plain.toml").write_text(PLAIN)
    key = generate_private_key(d / "review.key")
    (d / "review.pub").write_text(public_key_text(key.public_key()))
    for name, sign in (("rt", ["--sign", str(d / "review.key")]), ("plain", [])):
        assert main(["--config", str(d / f"{name}.toml"), "--format", "json",
                     "--output", str(d / f"{name}.json"), *sign]) == 0
    return {"dir": d, "rt": d / "rt.json", "plain": d / "plain.json"}


def test_verify_says_what_it_checked_and_fails_on_an_edited_config(reports, capsys):
    d, rep = reports["dir"], reports["rt"]
    prov = json.loads(rep.read_text())["provenance"]
    rc, out, err = _main(capsys, "verify", str(rep), f"{rep}.sig", str(d / "review.pub"))
    assert rc == 0, err
    # which key, which config (source and hash), which code: what a reviewer signs off
    assert prov["config"]["sha256"] in out and str(d / "rt.toml") in out
    assert str((prov["git"] or {}).get("commit") or "not a checkout") in out
    assert prov["package"]["version"] in out and "the config the report covers" in out
    assert "code here: git" in out
    # The config is edited after the report was signed: the signature is still good,
    # the report no longer describes the config (before: "OK", exit 0).
    cfg = d / "rt.toml"
    cfg.write_text(RT.replace("realtime_priority = 50", "realtime_priority = 1"))
    try:
        rc, out, err = _main(capsys, "verify", str(rep), f"{rep}.sig", str(d / "review.pub"))
        assert rc == 6 and "FAILED" in err and "config changed" in err
        assert len(err.strip().splitlines()) == 1
        (d / "as-signed.toml").write_text(RT)     # the reviewed config, given by hand
        rc, out, err = _main(capsys, "verify", str(rep), f"{rep}.sig", str(d / "review.pub"),
                             "--config", str(d / "as-signed.toml"))
        assert rc == 0, err
    finally:
        cfg.write_text(RT)


def test_bad_keys_and_signatures_are_one_line(reports, capsys, tmp_path):
    d, rep = reports["dir"], reports["rt"]
    loose = tmp_path / "shared.key"                 # a signing key others can read
    loose.write_bytes((d / "review.key").read_bytes())
    os.chmod(loose, 0o644)
    out = tmp_path / "r.json"
    for key, words in ((loose, "chmod 600"), (d / "review.pub", "this is a public key")):
        rc, _, err = _main(capsys, "--config", str(d / "rt.toml"), "--format", "json",
                           "--output", str(out), "--sign", str(key))
        assert rc == 2 and words in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()        # refused before the report was made
    # before: "internal error: FileNotFoundError", after the report was made
    rc, _, err = _main(capsys, "--format", "json", "--output", str(tmp_path / "no" / "r.json"),
                       "--sign", str(d / "review.key"))
    assert rc == 2 and "no such directory" in err and "internal error" not in err
    short = tmp_path / "short.sig"
    short.write_bytes(b"not a signature\n")
    rc, _, err = _main(capsys, "verify", str(rep), str(short), str(d / "review.pub"))
    assert rc == 2 and "64" in err and len(err.strip().splitlines()) == 1


def test_diff_lost_realtime_and_standby_are_weakenings(reports, capsys):
    rc, out, _ = _main(capsys, "diff", str(reports["rt"]), str(reports["plain"]),
                       "--format", "json")
    assert rc == 6
    weak = {(c["subject"], c["key"]) for c in json.loads(out)["changes"]
            if c["effect"] == "weakened"}
    # before: "0 weakened", exit 0 (scheduling and warm_standby were not compared)
    assert {("controlsd", "scheduling"), ("controlsd", "warm_standby")} <= weak
    _, out, _ = _main(capsys, "diff", str(reports["plain"]), str(reports["rt"]))
    assert "TIGHTENED worker: controlsd: scheduling: other 0 -> fifo 50" in out


def test_diff_refuses_a_report_of_another_schema(reports, capsys, tmp_path):
    doc = json.loads(reports["rt"].read_text())
    doc["schema_version"] = doc["schema_version"] + 1      # a newer supervisor's report
    doc["workers"] = doc["workers"][:1]
    newer = tmp_path / "newer.json"
    newer.write_text(json.dumps(doc))
    # before: compared as this version ("N tightened, ... changed", workers "removed")
    rc, out, err = _main(capsys, "diff", str(reports["rt"]), str(newer))
    assert rc == 2 and "schema_version" in err and not out
    assert len(err.strip().splitlines()) == 1
