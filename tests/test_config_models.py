"""One door for models (issue 21 item 3): a vehicle runs only what a [models] table trusts.

The attack: a vehicle config gives modeld ``--artifact DIR --pubkey KEY`` (a model signed by
a fresh key, version 0.0.1, that no [models] table names); `supervisor check` used to print
that it trusts lane-offset-demo 1.0.0 and controlsd engaged on the other model's outputs.
Now `check` and `run` refuse the config (also when a `command` worker runs modeld), in one
line naming the worker and the argument, and modeld refuses the argument itself in a
vehicle run: the model is never loaded. Real CLI, real sandbox.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from supervisor.config import WorkerConfig, check_runtime, loads
from supervisor.config._runtime import runs_module
from supervisor.protocol import ENV_MODE, SIMULATION, VEHICLE
from tests.test_model_artifact import DEMO, copy_bundle, resign
from supervisor.model import keys as K

DEFAULT = resources.files("supervisor").joinpath("default.toml").read_text("utf-8")   # the car
MODELD = 'module = "workers.modeld"\nmodel = "lane-offset-wide"\n'


@pytest.fixture(scope="module")
def rogue(tmp_path_factory) -> tuple[Path, Path]:
    """A model no [models] table trusts: the demo re-signed as 0.0.1 by a fresh key."""
    d = tmp_path_factory.mktemp("rogue")
    key = K.generate_private_key(d / "rogue.key")
    pub = d / "rogue.pub"
    pub.write_text(K.public_key_text(key.public_key()))
    bundle = copy_bundle(d / "model")
    resign(bundle, key, lambda m: m["model"].update(version="0.0.1"))
    return bundle, pub


def _with_modeld(rogue: tuple[Path, Path], how: str = "args", mode: str = VEHICLE) -> str:
    art, pub = rogue
    if how == "args":
        worker = MODELD + f'args = ["--artifact", "{art}", "--pubkey", "{pub}"]\n'
    else:     # a command worker running the same module through the runner
        worker = (f'command = ["{sys.executable}", "-m", "supervisor.runner", "workers.modeld", '
                  f'"--artifact={art}", "--pubkey", "{pub}"]\nmodel = "lane-offset-wide"\n')
    text = DEFAULT.replace(MODELD, worker)
    assert text != DEFAULT
    return text.replace('mode = "vehicle"', f'mode = "{mode}"')


def _cli(tmp_path: Path, cmd: str, text: str, *extra: str, timeout: int = 300):
    f = tmp_path / "car.toml"
    f.write_text(text)
    p = subprocess.run([sys.executable, "-m", "supervisor.cli", cmd, "--config", str(f), *extra],
                       capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert "Traceback" not in p.stderr + p.stdout, p.stderr
    return f, p


# ------------------------------------------------------------------ config side


def test_check_refuses_a_model_given_as_arguments_in_a_vehicle(tmp_path, rogue):
    f, p = _cli(tmp_path, "check", _with_modeld(rogue))
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith(f"{f}: ")]
    assert [ln.split(": ")[1] for ln in lines] == ["workers.modeld.args[0]",
                                                    "workers.modeld.args[2]"], p.stderr
    assert "'--artifact' (a model artifact no [models] table trusts) is for simulation only: " \
           "a vehicle config must not give it to workers.modeld" in lines[0]
    assert "'--pubkey'" in lines[1]
    assert "trusts model" not in p.stdout and "all admitted" not in p.stdout


def test_run_refuses_it_before_any_worker_starts(tmp_path, rogue):
    f, p = _cli(tmp_path, "run", _with_modeld(rogue), "--quiet", timeout=240)
    assert p.returncode == 2, p.stderr[-2000:]
    events = [json.loads(ln) for ln in p.stderr.splitlines() if ln.startswith("{")]
    problems = [e["problem"] for e in events if e["event"] == "config_problem"]
    assert any("workers.modeld.args[0]: '--artifact'" in x for x in problems), problems
    assert not [e for e in events if e["event"] in ("start", "standby_start", "ready")]


def test_a_command_worker_running_modeld_is_the_same_door():
    cfg = loads(_with_modeld(("/m", "/k"), how="command"), "car.toml")
    keys = [(p.key, p.reason.split(" (")[0]) for p in check_runtime(cfg, sandboxed=False)
            if p.key.startswith("workers.modeld")]
    assert ("workers.modeld.command[4]", "'--artifact'") in keys, keys
    assert ("workers.modeld.command[5]", "'--pubkey'") in keys, keys


@pytest.mark.parametrize("command, module, first", [
    (["python3", "-m", "workers.modeld", "--artifact", "d"], "workers.modeld", "--artifact"),
    (["/usr/bin/env", "-i", "A=1", "python3", "-I", "-m", "supervisor.runner",
      "workers.modeld", "--pubkey=k"], "workers.modeld", "--pubkey=k"),
    (["python3", "-Wignore", "-Im", "workers.controlsd", "--log-clock", "x"],
     "workers.controlsd", "--log-clock"),
    (["python3", "-X", "dev", "workers/modeld/__init__.py", "--artifact", "d"],
     "workers.modeld", "--artifact"),
    (["/bin/sh", "-c", "exec python3 -m supervisor.runner workers.modeld --artifact d"],
     "workers.modeld", "--artifact"),
    (["python3", "-c", "import workers.modeld"], None, None),
    (["/usr/bin/ffmpeg", "-m", "workers.modeld"], None, None),
])
def test_which_module_a_command_runs(command, module, first):
    got = runs_module(WorkerConfig("w", "control", command=tuple(command)))
    assert (got and got[0]) == module
    if module:
        assert got[1][0][1] == first


def test_a_package_declaration_covers_its_submodules():
    """workers.modeld.selftest loads --artifact too: modeld's declaration covers it."""
    text = DEFAULT.replace(MODELD, 'module = "workers.modeld.selftest"\n'
                           'args = ["--artifact", "/m", "--pubkey", "/k"]\n')
    problems = check_runtime(loads(text, "car.toml"), sandboxed=False)
    assert any(p.key == "workers.modeld.args[0]" and "'--artifact'" in p.reason
               for p in problems), problems


def test_simulation_configs_may_name_an_artifact(rogue):
    text = _with_modeld(rogue, mode=SIMULATION)
    problems = check_runtime(loads(text, "sim.toml"), sandboxed=False)
    assert not [p for p in problems if p.key.startswith("workers.modeld.args")], problems


# ------------------------------------------------------------------ the worker itself


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
@pytest.mark.parametrize("args", [["--artifact", "{art}", "--pubkey", "{pub}"],
                                  ["--deadline-ms", "40", "--artifact={art}", "--pubkey={pub}"]])
def test_modeld_refuses_the_argument_itself_in_a_vehicle_run(rogue, args):
    """What check cannot see (a command it cannot read): the worker, in its real control
    sandbox, told it is in a vehicle, refuses before it reads any model file."""
    from supervisor.sandbox import policy_for_domain, run

    art, pub = rogue
    argv = [a.format(art=art, pub=pub) for a in args]
    pol = policy_for_domain("control", extra_ro_binds=[str(art), str(pub)])
    res = run(pol, [sys.executable, "-m", "supervisor.runner", "workers.modeld", *argv],
              timeout=120, env_extra={"TRIO_WORKER": "modeld", "TRIO_DOMAIN": "control",
                                      ENV_MODE: VEHICLE})
    assert res.returncode == 2, (res.stdout, res.stderr)
    logs = [json.loads(ln)["log"] for ln in res.stdout.splitlines() if ln.startswith('{"log"')]
    assert len(logs) == 1 and logs[0].startswith("refused: '--artifact' (a model artifact no "
                                                 "[models] table trusts) is for simulation only"), logs
    assert "0.0.1" not in res.stdout + res.stderr and "ready" not in res.stdout


def test_modeld_takes_no_abbreviation_of_a_refused_argument():
    """--art would be argparse's abbreviation of --artifact, past the exact-name check."""
    from workers.modeld import _args

    with pytest.raises(SystemExit):
        _args(["--art", "/m"])
    assert os.path.isdir(DEMO)
