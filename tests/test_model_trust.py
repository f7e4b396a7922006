"""Model trust is config: [models.NAME] names the artifact, the key, the model and its
minimum version; `supervisor check` verifies it and says what it trusts."""
from __future__ import annotations

import subprocess
import sys
from importlib import resources

from supervisor.config import ConfigFileError, load, loads

# The one-camera pipeline's text (one model, one [models] table): what each check edits. The
# car's own trust (two models) is checked by test_default_config_trusts_..., and its
# `check` output by tests/test_vehicle_config.py.
DEFAULT = resources.files("supervisor").joinpath("configs/minimal.toml").read_text("utf-8")


def check(tmp_path, text: str) -> subprocess.CompletedProcess:
    f = tmp_path / "c.toml"
    f.write_text(text)
    return subprocess.run([sys.executable, "-m", "supervisor.cli", "check", "--config", str(f)],
                          capture_output=True, text=True, timeout=180)


def test_default_config_trusts_the_demo_models_and_binds_them():
    cfg = load()                        # the car: the driving model and the driver monitor
    assert sorted(cfg.models) == ["driver-monitor", "lane-offset-wide"]
    for name, worker in (("lane-offset-wide", "modeld"), ("driver-monitor", "dmonitoringd")):
        m = cfg.models[name]
        assert m.artifact.endswith(f"models/demo/{name}") and m.min_version == "1.0.0"
        assert cfg.workers[worker].model == name
    one = loads(DEFAULT, "minimal.toml")
    assert one.models["lane-offset"].artifact.endswith("models/demo/lane-offset")
    assert one.workers["modeld"].model == "lane-offset"


def test_check_prints_what_it_trusts(tmp_path):
    r = check(tmp_path, DEFAULT)
    assert r.returncode == 0, r.stderr
    assert "trusts model 'lane-offset': lane-offset-demo 1.0.0 (>= 1.0.0), key b6cca30d" in r.stdout


def test_an_older_signed_artifact_is_a_rollback_and_refused(tmp_path):
    r = check(tmp_path, DEFAULT.replace('min_version = "1.0.0"', 'min_version = "1.0.1"'))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert lines[0].endswith("models.lane-offset: refused: WrongVersion: manifest.json: "
                             "model.version of 'lane-offset-demo' is '1.0.0', older than the "
                             "minimum '1.0.1' (rollback refused)"), lines


def test_wrong_key_or_name_is_refused(tmp_path):
    other = tmp_path / "other.pub"
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    other.write_bytes(Ed25519PrivateKey.generate().public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    r = check(tmp_path, DEFAULT.replace('public_key = "models/demo/demo_ed25519.pub"',
                                        f'public_key = "{other}"'))
    assert r.returncode == 2 and "models.lane-offset: refused: BadSignature" in r.stderr, r.stderr
    r = check(tmp_path, DEFAULT.replace('expect_name = "lane-offset-demo"',
                                        'expect_name = "lane-offset"'))
    assert r.returncode == 2 and "model.name is 'lane-offset-demo'" in r.stderr, r.stderr


def test_unknown_model_and_bad_min_version_are_config_errors():
    text = DEFAULT.replace('model = "lane-offset"', 'model = "lane-ofset"')
    try:
        loads(text, "c.toml")
        raise AssertionError("loaded")
    except ConfigFileError as e:
        msgs = [str(p) for p in e.problems]
    assert msgs == ["c.toml: workers.modeld.model: unknown model 'lane-ofset'; "
                    "did you mean 'lane-offset'?"], msgs
    try:
        loads(DEFAULT.replace('min_version = "1.0.0"', 'min_version = "latest"'), "c.toml")
        raise AssertionError("loaded")
    except ConfigFileError as e:
        assert "models.lane-offset.min_version: 'latest' is not a version" in str(e)
