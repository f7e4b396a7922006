"""Red team, round 9 (docs/redteam9.md): what the humans see (console, journald, the
reviewer's signed audit) against an attacker who knows the code.

Each test asserts the claim the way it should hold. A claim that fails today is an
``xfail(strict=True)`` whose reason starts with "redteam9 row N"; the lead's fix turns it
into a plain pass. ``--runxfail`` shows the evidence of each break.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the signed audit (row 1)


@pytest.fixture
def signed_minimal(tmp_path: Path):
    """minimal.toml with its model artifact and public key copied beside it (absolute
    paths, as a vehicle's config names them), a JSON report of it made by the audit's
    own provenance and trust readers, and a reviewer's signature over the report."""
    from supervisor.audit.promise import trusted_models
    from supervisor.audit.provenance import provenance
    from supervisor.audit.sign import sign_file
    from supervisor.config import load
    from supervisor.model.keys import generate_private_key, load_private_key, public_key_text

    shutil.copytree(REPO / "models/demo/lane-offset", tmp_path / "art")
    shutil.copy(REPO / "models/demo/demo_ed25519.pub", tmp_path / "key.pub")
    text = (REPO / "supervisor/configs/minimal.toml").read_text()
    text = text.replace('"models/demo/lane-offset"', f'"{tmp_path}/art"')
    text = text.replace('"models/demo/demo_ed25519.pub"', f'"{tmp_path}/key.pub"')
    assert f"{tmp_path}/key.pub" in text and f"{tmp_path}/art" in text
    cfg_path = tmp_path / "vehicle.toml"
    cfg_path.write_text(text)
    cfg = load(str(cfg_path))
    # What `audit --format json` puts in its provenance (the full audit takes ~20 s here;
    # verify reads only the provenance and the verdict).
    rows = [{"worker": w.name, "models": trusted_models(w, cfg)} for w in cfg.workers.values()]
    report = tmp_path / "audit.json"
    report.write_text(json.dumps({"provenance": provenance(cfg, rows), "result": "promise"},
                                 indent=1))
    key = tmp_path / "review.key"
    generate_private_key(key)
    key.chmod(0o600)
    (tmp_path / "review.pub").write_text(public_key_text(load_private_key(key).public_key()))
    sign_file(str(report), str(key))
    return tmp_path, cfg_path, report


def _resign_artifact(art: Path, pub: Path, attacker_key: Path) -> str:
    """The artifact's manifest re-signed by the attacker's key, whose public key replaces
    the file the config names: the config's bytes do not change. Returns the key id."""
    from supervisor.model.keys import (generate_private_key, key_id, load_private_key,
                                       public_key_text)

    generate_private_key(attacker_key)
    priv = load_private_key(attacker_key)
    m = json.loads((art / "manifest.json").read_bytes())
    m["signing"]["key_id"] = key_id(priv.public_key())
    mbytes = json.dumps(m, sort_keys=True, separators=(",", ":")).encode()   # canonical
    (art / "manifest.json").write_bytes(mbytes)
    (art / "manifest.sig").write_bytes(priv.sign(mbytes))
    pub.write_text(public_key_text(priv.public_key()))
    return key_id(priv.public_key())


@pytest.mark.xfail(strict=True, reason="redteam9 row 1: audit verify hashes only the "
                   "config's bytes: a swapped public key file (the trust root the config "
                   "names) verifies OK as 'the config the report covers'")
def test_a_signed_audit_never_verifies_for_a_config_that_trusts_another_key(signed_minimal):
    """A reviewer signed the audit of a vehicle config that trusts the demo key for its
    model. Then the public key file the config names is replaced (and the artifact
    re-signed with the new key): `supervisor check` now trusts another signer, with the
    config's bytes unchanged. `audit verify --config` must not say the report covers it."""
    from supervisor.config import load
    from supervisor.model.trust import verify_models

    tmp, cfg_path, report = signed_minimal
    before = json.loads(report.read_text())["provenance"]["artifacts"][0]["key_id"]
    kid = _resign_artifact(tmp / "art", tmp / "key.pub", tmp / "attacker.key")
    trusted, problems = verify_models(load(str(cfg_path)))
    # The swap is real: the system that will run trusts the attacker's key.
    assert not problems and [t.key_id for t in trusted] == [kid] and kid != before
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "audit", "verify",
                        str(report), f"{report}.sig", str(tmp / "review.pub"),
                        "--config", str(cfg_path)],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    print(r.returncode, r.stdout, r.stderr)
    assert r.returncode != 0, "verify said OK for a config that trusts another model key"
    assert "FAILED" in r.stderr
