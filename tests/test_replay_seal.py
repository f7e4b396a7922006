"""Which recorded config a replay runs (supervisor/replay/seal.py): one this machine
recorded (its seal verifies with this user's replay key) or one this installation
ships; never one a handed log chose (red team 9 row 4 runs the attack end to end)."""
from __future__ import annotations

import os

import pytest

from supervisor.config import dumps, minimal_doc
from supervisor.replay.run import ReplayError, trusted_source
from supervisor.replay.seal import SEAL, SealError, key_path, seal


def _log(tmp_path, doc: dict, *, sealed: bool) -> str:
    log = tmp_path / "drive"
    log.mkdir(exist_ok=True)
    data = dumps(doc).encode()
    (log / "source.toml").write_bytes(data)
    os.chmod(log / "source.toml", 0o644)
    if sealed:
        (log / SEAL).write_bytes(seal(data))
    return str(log)


def _custom() -> dict:
    doc = minimal_doc()
    doc["domains"]["research"]["network"] = True        # a choice no shipped config makes
    return doc


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """This user's state directory on one machine (where its replay key lives)."""
    def on(name: str) -> None:
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / name))
    on("here")
    return on


def test_a_config_recorded_here_replays_and_one_changed_since_does_not(tmp_path, machine):
    log = _log(tmp_path, _custom(), sealed=True)
    assert trusted_source(log) == dumps(_custom()).encode()
    assert oct(key_path().stat().st_mode & 0o777) == "0o600"
    src = os.path.join(log, "source.toml")
    with open(src, "ab") as f:
        f.write(b"\n[workers.extra]\ndomain = \"research\"\nmodule = \"evil\"\n")
    with pytest.raises(ReplayError, match="not recorded on this machine.*pass --config"):
        trusted_source(log)


def test_a_log_from_another_machine_replays_only_a_shipped_config(tmp_path, machine):
    custom = _log(tmp_path, _custom(), sealed=True)        # sealed by "here"
    machine("elsewhere")                                   # copied to another machine
    with pytest.raises(ReplayError, match="not a config this installation ships"):
        trusted_source(custom)
    plain = _log(tmp_path, minimal_doc(), sealed=False)     # the embedded pipeline
    assert trusted_source(plain) == dumps(minimal_doc()).encode()


def test_a_replay_key_others_can_read_seals_nothing(tmp_path, machine):
    seal(b"x")                                             # made, private
    key_path().chmod(0o644)
    with pytest.raises(SealError, match="not a private file of this user"):
        seal(b"x")
    log = _log(tmp_path, _custom(), sealed=False)
    (tmp_path / "drive" / SEAL).write_bytes(b"\0" * 32)
    with pytest.raises(ReplayError, match="not recorded on this machine"):
        trusted_source(log)
