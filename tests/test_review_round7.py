"""Review round 7: the product on first contact with its users (the car's units, a
developer's CI replaying drives, a safety reviewer signing an audit). Each finding runs
the CLI as that user does (a subprocess; a private mount namespace for "another
machine") and asserts what the user should see; a finding still broken is a strict
xfail the lead's fix turns green. docs/review7.md has the table.

1. A reviewer signs the audit of an install; another install of the same code (the same
   bytes at another path: a CI runner's checkout, the car's /opt) fails `audit verify`:
   "worker dmonitoringd's model /A/models/demo/driver-monitor is gone", though its
   manifest, key and signature are the report's. Models are matched by absolute path
   (the packages were already matched by name).
2. `audit diff` of those two reports says "35 weakened, 35 tightened: ISOLATION
   WEAKENED", exit 6: each sandbox's bind of the project's tree at its new path is
   "absent -> bind ro", the old one "bind ro -> absent". Nothing about isolation moved.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOT_NS = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                             reason="root and unshare: another install path in a mount ns")


def _at(where: Path, args: list[str], cwd: Path,
        over: tuple[Path, str] | None = None) -> tuple[list[str], dict]:
    """argv and env of `supervisor ARGS` run from the project's tree bind-mounted at
    WHERE (another install of the same bytes), in a private mount namespace of its own;
    `over`: (a file, the tree's path it is bind-mounted over there), the host untouched."""
    where.mkdir(parents=True, exist_ok=True)
    script = ('mount --bind "$1" "$2" && shift 2 && '
              '{ [ -z "$OVER" ] || mount --bind "$OVER" "$WHERE/$OVER_AT"; } && cd "$CWD" && '
              'exec env PYTHONPATH="$WHERE" "$PY" -m supervisor.cli "$@"')
    env = dict(os.environ, WHERE=str(where), CWD=str(cwd), PY=sys.executable,
               OVER=str(over[0]) if over else "", OVER_AT=over[1] if over else "")
    return (["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
             str(REPO), str(where), *args], env)


def _cli_at(where: Path, args: list[str], cwd: Path, timeout: float = 120,
            over: tuple[Path, str] | None = None) -> subprocess.CompletedProcess:
    argv, env = _at(where, args, cwd, over)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def _synthetic_drive(path: Path, n: int = 6) -> None:
    """A drive log at the car camera's size, as the recorder writes it (LogWriter, raw)."""
    from schemas.payloads import CONTROL_CMD, MODEL_OUT
    from supervisor.replay.drivelog import LogWriter
    from workers.camerad.synthetic import SyntheticRoad

    road = SyntheticRoad(1928, 1208, seed=1)
    w = LogWriter(path, ["road_frames", "model_out", "control_cmd"], video_codec="raw")
    for k in range(n):
        t = 1_000_000_000 + k * 50_000_000
        y, uv, _ = road.render(k)
        w.frame("road_frames", k + 1, t + 1, 11, k, t, 9000, 1928, 1208, "nv12", "road",
                (y, uv))
        w.message("model_out", k + 1, t + 2, 12, k, t,
                  MODEL_OUT.encode(offset_m=0.01 * k, heading_rad=0.0, confidence=0.9))
        w.message("control_cmd", k + 1, t + 3, 13, k, t,
                  CONTROL_CMD.encode(steer_rad=-0.01 * k, engaged=1.0))
    w.close({"frames": n})


@pytest.fixture(scope="module", autouse=True)
def slow_runner_replay(tmp_path_factory):
    """The module's one pipeline: `supervisor replay LOG --ref self` on a runner too slow
    for its step timeout (`--step-timeout 0.001`: every frame's command is late), started
    at the module's first test and waited for by the test that reads it (~13 s loaded,
    mostly the pipeline's start-up, while the audit tests run)."""
    import tomllib

    from supervisor.config import dumps

    tmp = tmp_path_factory.mktemp("rv7-replay")
    _synthetic_drive(tmp / "drive")
    # The one-camera pipeline without research and standbys: a third of the start-up.
    doc = tomllib.loads((REPO / "supervisor" / "configs" / "minimal.toml").read_text())
    del doc["workers"]["research"], doc["channels"]["shadow_out"]
    for w in doc["workers"].values():
        w["warm_standby"] = False
    (tmp / "lean.toml").write_text(dumps(doc))
    p = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "replay", str(tmp / "drive"),
                          "--config", str(tmp / "lean.toml"),
                          "--out", str(tmp / "run"), "--ref", "self", "--step-timeout", "0.001",
                          "--no-progress"],
                         cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done: dict = {}

    def result() -> tuple[int, str, str, Path]:
        if not done:
            out, err = p.communicate(timeout=300)
            done.update(rc=p.returncode, out=out, err=err)
        return done["rc"], done["out"], done["err"], tmp / "run"
    yield result
    if p.poll() is None:
        p.terminate()
        p.communicate(timeout=60)


VEHICLE = """
[supervisor]
mode = "vehicle"
state_dir = "{state}"
[domains.control]
user = "trio-control"
network = false
actuates = true
failure_policy = "fail_safe"
[channels.out]
kind = "tensor"
dtype = "float32"
slot_size = "4KiB"
[workers.one]
domain = "control"
module = "workers.probe"
publishes = {{ out = "out" }}
"""


@pytest.fixture(scope="module", autouse=True)
def vehicle_running(tmp_path_factory):
    """A vehicle supervisor running as the car's unit runs it (vehicle mode, its own
    state dir from the config, no TRIO_STATE_DIR): one probe worker, READY in ~7 s
    loaded. Started at the module's first test, beside the replay."""
    tmp = tmp_path_factory.mktemp("rv7-vehicle")
    paths = {}
    for name in ("car", "check"):
        (tmp / f"{name}-state").mkdir(mode=0o700)
        (tmp / f"{name}.toml").write_text(VEHICLE.format(state=tmp / f"{name}-state"))
        paths[name] = tmp / f"{name}.toml"
    env = {k: v for k, v in os.environ.items() if k != "TRIO_STATE_DIR"}
    err = open(tmp / "car.err", "w+")
    p = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run", "--quiet",
                          "--config", str(paths["car"])], cwd=tmp, env=env,
                         stdout=subprocess.DEVNULL, stderr=err)

    def ready() -> tuple[subprocess.Popen, Path, dict]:
        import time
        deadline = time.monotonic() + 90
        while '"all_ready"' not in (tmp / "car.err").read_text():
            assert p.poll() is None and time.monotonic() < deadline, \
                (tmp / "car.err").read_text()[-1500:]
            time.sleep(0.2)
        return p, paths["check"], env
    yield ready
    p.terminate()
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    err.close()


def _reviewer_key(tmp: Path) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    k = Ed25519PrivateKey.generate()
    key, pub = tmp / "reviewer.key", tmp / "reviewer.pub"
    key.write_bytes(k.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    key.chmod(0o600)
    pub.write_bytes(k.public_key().public_bytes(serialization.Encoding.PEM,
                                                serialization.PublicFormat.SubjectPublicKeyInfo))
    return key, pub


# One control worker with the demo model, resolved from the project root (the install):
# the audit of the car's default walks tinygrad's ~640 files cold (10-28 s loaded).
TINY = """
[supervisor]
mode = "simulation"
[domains.control]
user = "trio-control"
network = false
actuates = true
failure_policy = "fail_safe"
[channels.out]
kind = "tensor"
dtype = "float32"
slot_size = "4KiB"
[models.lane-offset]
artifact = "models/demo/lane-offset"
public_key = "models/demo/demo_ed25519.pub"
expect_name = "lane-offset-demo"
min_version = "1.0.0"
[workers.one]
domain = "control"
module = "workers.probe"
model = "lane-offset"
publishes = { out = "out" }
"""


@pytest.fixture(scope="module")
def two_installs(tmp_path_factory):
    """One config's audit made at install A (signed) and at install B: the same bytes at
    two paths (bind mounts of this tree). Both audits run at once (~3 s)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("root and unshare: another install path in a mount ns")
    tmp = tmp_path_factory.mktemp("rv7-audit")
    key, pub = _reviewer_key(tmp)
    (tmp / "tiny.toml").write_text(TINY)
    procs = {}
    for name, extra in (("A", ["--sign", str(key)]), ("B", [])):
        argv, env = _at(tmp / "opt" / name,
                        ["audit", "--config", str(tmp / "tiny.toml"), "--format", "json",
                         "--output", str(tmp / f"{name}.json"), *extra], tmp)
        procs[name] = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    for name, p in procs.items():
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, (name, err[-2000:])
    return tmp, pub


def test_audit_verify_accepts_the_same_models_at_another_install_path(two_installs):
    tmp, pub = two_installs
    r = _cli_at(tmp / "opt" / "B", ["audit", "verify", str(tmp / "A.json"),
                                    str(tmp / "A.json.sig"), str(pub),
                                    "--config", str(tmp / "tiny.toml")], cwd=tmp)
    assert r.returncode == 0, r.stderr + r.stdout


def test_audit_diff_of_two_install_paths_is_no_weakening(two_installs):
    tmp, _ = two_installs
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "audit", "diff",
                        str(tmp / "A.json"), str(tmp / "B.json")],
                       capture_output=True, text=True, timeout=60, cwd=tmp)
    assert r.returncode == 0 and "WEAKENED" not in r.stdout, r.stdout[:1500]


def _drive(path: Path, *, frames_missing: tuple[int, ...], outputs_missing: tuple[int, ...],
           dropped: dict[str, int] | None = None) -> None:
    """A 12-frame drive log as the recorder writes it (the product's LogWriter, raw NV12):
    `frames_missing` are frames the recorder dropped (no metadata, no pixels: what a
    loaded machine gives), `outputs_missing` frames with no model output or command."""
    from schemas.payloads import CONTROL_CMD, MODEL_OUT
    from supervisor.replay.drivelog import LogWriter
    from workers.camerad.synthetic import SyntheticRoad

    w_, h_ = 160, 120
    road = SyntheticRoad(w_, h_, seed=1)
    w = LogWriter(path, ["road_frames", "model_out", "control_cmd"], video_codec="raw")
    for k in range(12):
        t = k * 50_000_000
        if k not in frames_missing:
            y, uv, _ = road.render(k)
            w.frame("road_frames", k + 1, t + 1, 11, k, t, 9000, w_, h_, "nv12", "road", (y, uv))
        if k not in outputs_missing:
            w.message("model_out", k + 1, t + 2, 12, k, t,
                      MODEL_OUT.encode(offset_m=0.01 * k, heading_rad=0.0, confidence=0.9))
            w.message("control_cmd", k + 1, t + 3, 13, k, t,
                      CONTROL_CMD.encode(steer_rad=-0.01 * k, engaged=1.0))
    for ch, n in (dropped or {}).items():
        w.drops(ch, n, 0, 0, 0)
    w.close({"frames": 12})


def test_ref_self_does_not_read_the_recorders_drops_as_a_model_change(tmp_path):
    """What `supervisor replay LOG --ref self` does once the pipeline has run (commands.py:
    edge_windows over the log that played, then compare), on the files it reads. By hand
    (loaded 2-core machine): `supervisor record d --seconds 4 --video raw` -> 'recorder
    drops: control_cmd 15, road_frames 2', `log info d` -> 'loss: nothing lost', then
    `supervisor replay d --ref self` -> exit 6, model_out removed [302, 303] (the two
    dropped frames), control_cmd added [307] (a command the recorder dropped)."""
    from supervisor.replay.diff import compare, edge_windows
    from supervisor.replay.drivelog import DriveLog

    # The recorder dropped frame 3 (the car's model did answer it) on a loaded machine;
    # the replay plays the 11 frames the log has, and its model answers each.
    _drive(tmp_path / "log", frames_missing=(3,), outputs_missing=(),
           dropped={"road_frames": 1})
    _drive(tmp_path / "run", frames_missing=(3,), outputs_missing=(3,))
    ref, run = DriveLog.open(tmp_path / "log"), DriveLog.open(tmp_path / "run")
    chans = ["model_out", "control_cmd"]
    report = compare(run, ref, channels=chans,
                     payloads={"model_out": "model_out", "control_cmd": "control_cmd"},
                     windows=edge_windows(ref, "road_frames", chans),
                     model_channel="model_out", p99_ratio=None, max_ratio=None)
    removed = {c.channel: c.removed for c in report.channels}
    assert report.ok, f"a log's own loss read as a model change: removed {removed}"


def test_audit_verify_names_what_moved_in_the_config(two_installs):
    """A reviewer holds a signed report; the config in hand differs. A comment added and
    the control domain given the network get one and the same line (the sha256 of the
    bytes); the reviewer needs to see the second one named."""
    tmp, pub = two_installs
    text = (tmp / "tiny.toml").read_text()
    outs = {}
    for name, edited in (("comment", text + "\n# reviewed 2026-12-05\n"),
                         ("net", text.replace("network = false", "network = true"))):
        (tmp / f"edit-{name}.toml").write_text(edited)
        r = _cli_at(tmp / "opt" / "A", ["audit", "verify", str(tmp / "A.json"),
                                        str(tmp / "A.json.sig"), str(pub),
                                        "--config", str(tmp / f"edit-{name}.toml")],
                    cwd=tmp)
        assert r.returncode == 6, r.stderr
        outs[name] = r.stderr + r.stdout
    assert "network" in outs["net"], outs["net"][-800:]
    assert "network" not in outs["comment"], outs["comment"][-800:]


def test_an_incomplete_replay_never_reads_as_a_difference(slow_runner_replay):
    """A slow CI runner: frames time out (exit 7, 'incomplete', the CI snippet's 'see
    summary.json'), but stdout and diff.md (what the doc's CI job posts) say 'DIFFERS'
    with the frames never waited for as 'removed': a model regression that never was.
    report.html already says 'FAILED (exit 7)'."""
    rc, out, err, run = slow_runner_replay()
    assert rc == 7, (rc, err[-1500:])
    assert "timed out" in err
    assert "DIFFERS" not in out, out[:1200]
    assert not (run / "diff.md").exists() or "differs" not in (run / "diff.md").read_text()


def test_a_drive_of_an_older_config_says_which_file_and_what_to_do(tmp_path, monkeypatch):
    """A drive this machine recorded (sealed here) with last version's config: one key
    this version no longer knows. The developer should read which file (the log's
    source.toml) and the way on (--config F: its frames through today's pipeline)."""
    from supervisor.replay.seal import seal

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    _drive(tmp_path / "old", frames_missing=(), outputs_missing=())
    doc = (REPO / "supervisor" / "configs" / "minimal.toml").read_text()
    doc = doc.replace("[supervisor]\n", "[supervisor]\nlegacy_knob = 1\n", 1)
    (tmp_path / "old" / "source.toml").write_text(doc)
    (tmp_path / "old" / "source.toml.seal").write_bytes(seal(doc.encode()))
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "replay", str(tmp_path / "old"),
                        "--out", str(tmp_path / "run"), "--no-progress"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "legacy_knob" in r.stderr
    assert "source.toml" in r.stderr and "--config" in r.stderr, r.stderr


def test_audit_exit_codes_tell_a_bad_signature_from_bad_input_and_a_bug(two_installs):
    """A reviewer's CI gates on `audit verify`. Exit 1 is README's 'internal error (a
    bug)'; audit also gives it for a typo'd path and for a report that is not what was
    signed. Bad input should be 2 as for every other command, a report that does not
    verify its own code (6, 'differs', as audit diff's weakening)."""
    tmp, pub = two_installs
    tampered = tmp / "tampered.json"
    tampered.write_bytes((tmp / "A.json").read_bytes() + b" ")
    cli = [sys.executable, "-m", "supervisor.cli", "audit"]
    bad_sig = subprocess.run([*cli, "verify", str(tampered), str(tmp / "A.json.sig"), str(pub)],
                             capture_output=True, text=True, timeout=60, cwd=tmp)
    typo = subprocess.run([*cli, "diff", str(tmp / "A.jsno"), str(tmp / "A.json")],
                          capture_output=True, text=True, timeout=60, cwd=tmp)
    assert "FAILED" in bad_sig.stderr and typo.stderr.count("\n") == 1, (bad_sig, typo)
    assert typo.returncode == 2, typo.stderr
    assert bad_sig.returncode not in (0, 1, 2), bad_sig.stderr


def test_a_fleet_says_what_it_does_with_report(tmp_path):
    """The doc's CI job (`--report artifacts/highway-01.html`) pointed at a directory of
    logs: no file is written and nothing says so; CI uploads a missing artifact. (Logs
    that are not logs: the fleet ends in a second, exit 2.)"""
    for name in ("x", "y"):
        (tmp_path / "logs" / name).mkdir(parents=True)
        (tmp_path / "logs" / name / "messages.tlog").write_bytes(b"junk\n")
    report = tmp_path / "artifacts" / "fleet.html"
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "replay", str(tmp_path / "logs"),
                        "--ref", "self", "--out", str(tmp_path / "fleet"), "--no-progress",
                        "--report", str(report)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert report.exists() or "--report" in r.stderr, r.stderr


def test_audit_verify_names_the_file_that_moved(two_installs):
    """At the install the report was signed at, one file of the project's code differs
    (a line added to workers/probe, the one worker's module). verify fails, rightly, but
    says only 'the installed package workers: the report covers code tree 83fd..., the
    files now give 1a2b...': the reviewer cannot tell a rebuilt native module (another
    compiler: every other machine) from an edited control worker."""
    tmp, pub = two_installs
    rel = "workers/probe/__init__.py"
    edited = tmp / "edited.py"
    edited.write_text((REPO / rel).read_text() + "\n# changed after the review\n")
    r = _cli_at(tmp / "opt" / "A", ["audit", "verify", str(tmp / "A.json"),
                                    str(tmp / "A.json.sig"), str(pub),
                                    "--config", str(tmp / "tiny.toml")], cwd=tmp,
                over=(edited, rel))
    assert r.returncode != 0 and "code tree" in r.stderr + r.stdout, r.stderr + r.stdout
    assert "probe/__init__.py" in r.stderr + r.stdout, r.stderr


def test_check_start_refuses_beside_a_running_vehicle(vehicle_running, tmp_path):
    """The car's user runs `check --start` as README says, with the unit already active
    (a reinstall, an upgrade): a second full pipeline starts beside the one driving, its
    own cameras and a SCHED_FIFO controlsd competing with the car's for CPU; a note says
    so afterwards. `audit --live --start` refuses exactly this in one line."""
    car, check_cfg, env = vehicle_running()
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "check", "--start",
                        "--config", str(check_cfg)], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env=env)
    said = r.stdout + r.stderr
    assert car.poll() is None
    assert r.returncode != 0 and "READY" not in said, said[-1500:]
    assert f"pid {car.pid}" in said, said[-1500:]
