"""Gate 9: replay as a CI gate, and an audit a reviewer can sign (docs/gate9.md).

Two users meet the product on first contact: a developer whose CI job replays recorded
drives and fails the merge when control's outputs change (`record`, `replay`, `log`),
and a safety reviewer who signs an audit and checks it (`audit`, `--sign`, `audit
verify`). Each finding is one test that runs the CLI as that user does and asserts what
the user should see; a defect is a strict xfail that the fix turns green.

Everything runs from one fresh `git clone` of HEAD built as a checkout is built
(`setup.py build_ext --inplace`): the working tree is edited by other helpers while this
runs (their half-written controlsd made admission refuse it here once), and a reviewer
reproduces from a commit. So the marks flip when a fix is committed, not before.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("bwrap") is None,
                                reason="root and bubblewrap, as record/replay/audit run")

W, H = 1928, 1208               # the shipped demo model's frame (minimal.toml's camera)


def _cli(args: list[str], *, root: Path, cwd: Path | None = None, timeout: float = 120,
         path: str | None = None) -> subprocess.CompletedProcess:
    """`supervisor ARGS` from the clone `root`, with a state dir of its own (never the
    machine's latch), no tty (a CI job's stdin and stdout)."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1",
           "TRIO_STATE_DIR": str(root.parent / "state")}
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args], cwd=cwd or root,
                          env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def clone():
    """A fresh clone of HEAD, built. Under a 0755 directory of /tmp (the sandboxes'
    users traverse the project root a replay binds)."""
    top = Path(tempfile.mkdtemp(prefix="gate9-", dir="/tmp"))
    top.chmod(0o755)
    root = top / "c"
    subprocess.run(["git", "clone", "-q", str(REPO), str(root)], check=True, timeout=120)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=root,
                   check=True, capture_output=True, timeout=300)
    (top / "state").mkdir(mode=0o700)
    yield root
    shutil.rmtree(top, ignore_errors=True)


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
[workers.one]
domain = "control"
module = "workers.probe"
publishes = { out = "out" }
"""


@pytest.fixture(scope="module")
def bench(clone):
    """A supervisor as a bench runs it (`supervisor run` from a root shell, a state dir
    of its own), started with the module's first test so its start-up overlaps the
    others; audited `--live` by the last."""
    top = clone.parent
    (top / "tiny.toml").write_text(TINY)
    (top / "state-live").mkdir(mode=0o700)
    env = {**os.environ, "PYTHONPATH": str(clone), "PYTHONDONTWRITEBYTECODE": "1",
           "TRIO_STATE_DIR": str(top / "state-live")}
    err = open(top / "bench.err", "w")
    p = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run", "--config",
                          str(top / "tiny.toml"), "--quiet"], cwd=clone, env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    yield p
    p.send_signal(2)
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    err.close()


@pytest.fixture(scope="module")
def cfg(clone, bench) -> Path:
    """The one-camera pipeline without research (torch's start-up is not what is
    tested), no standbys: the shipped demo model and its frame size. (Derived with this
    tree's config module, as the logs are written with its LogWriter: files, which the
    clone's CLI then reads.)"""
    from supervisor.config import derive, dumps, minimal_doc

    doc = derive(minimal_doc(), drop=("workers.research", "channels.shadow_out"),
                 set={f"workers.{w}.warm_standby": False
                      for w in ("camerad", "modeld", "controlsd")})
    p = clone.parent / "pipe.toml"
    p.write_text(dumps(doc))
    return p


def _write_drive(path: Path, n: int, w: int, h: int, *, seed: int = 1,
                 t0: int = 1_000_000_000) -> None:
    """A drive log as the recorder writes one (raw video, an output and a command per
    frame), written in-process from this tree's writer: no pipeline needed."""
    from schemas.payloads import CONTROL_CMD, MODEL_OUT
    from supervisor.replay.drivelog import LogWriter
    from workers.camerad.synthetic import SyntheticRoad

    road = SyntheticRoad(w, h, seed=seed)
    lw = LogWriter(path, ["road_frames", "model_out", "control_cmd"], video_codec="raw")
    for k in range(n):
        t = t0 + k * 50_000_000
        y, uv, _ = road.render(k)
        lw.frame("road_frames", k + 1, t + 1, 11, k, t, 9000, w, h, "nv12", "road", (y, uv))
        lw.message("model_out", k + 1, t + 2, 12, k, t,
                   MODEL_OUT.encode(offset_m=0.01 * k, heading_rad=0.0, confidence=0.9))
        lw.message("control_cmd", k + 1, t + 3, 13, k, t,
                   CONTROL_CMD.encode(steer_rad=-0.01 * k, engaged=1.0))
    lw.close({"frames": n})


@pytest.fixture(scope="module")
def drive(clone) -> Path:
    p = clone.parent / "drive"
    _write_drive(p, 6, W, H)
    return p


# ------------------------------------------------------------------ the CI developer

@pytest.fixture(scope="module")
def jobs(clone, cfg, drive, keys) -> dict[str, subprocess.Popen]:
    """Every slow command of the module, started at once (a loaded machine only makes a
    lockstep replay slower; the module stays short): name -> the running command.

    'hostile': a copy of the drive with two more whole, CRC-framed records as a hostile
    recorder writes them (the recorder runs in the research profile and owns the log
    directory): a control_cmd message whose dtype is not a number type (finding 1) and
    a second frame record of frame 2 with exposure_us 2**62 (finding 13); replayed once
    `--format json` (one pipeline for both: each alone killed the replay).
    'info-dtype', 'info-exposure': `log info` of a copy with one of the two records.
    'mixup': the drive replayed against another drive's log as REF.
    'adm-replay', 'adm-record': a config whose control worker imports torch.
    'audit': the reviewer's signed report of the car's default (see `signed`)."""
    import tomllib

    from supervisor.config import dumps
    from supervisor.replay.logfmt import MESSAGES, Entry, frame_record

    def forged(name: str, *fills) -> Path:
        bad = clone.parent / f"hostile-{name}"
        shutil.copytree(drive, bad)
        for fill in fills:
            e = Entry.new_message(monoNs=time.monotonic_ns())
            fill(e)
            with open(bad / MESSAGES, "ab") as f:
                f.write(frame_record(e.to_bytes()))
        return bad

    def dtype(e) -> None:
        m = e.init("message")
        m.channel, m.sequence, m.publishTsNs, m.writerPid = "control_cmd", 99, 1, 1
        m.hasFrameId, m.frameId, m.captureTsNs = True, 2, 1_000_000_001
        m.dtype, m.shape, m.data = "bogus", [3], b"\0" * 12

    def exposure(e) -> None:
        f = e.init("frame")
        f.channel, f.sequence, f.publishTsNs, f.writerPid = "road_frames", 3, 1, 1
        f.frameId, f.captureTsNs, f.exposureUs = 2, 1_100_000_000, 2 ** 62
        f.width, f.height, f.pixelFormat, f.sensor, f.videoIndex = W, H, "nv12", "road", 2

    top = clone.parent
    key, _ = keys
    cmds: dict[str, list[str]] = {
        "hostile": ["replay", str(forged("both", dtype, exposure)), "--config", str(cfg),
                    "--out", str(top / "run-hostile"), "--no-progress", "--format", "json"],
        "info-dtype": ["log", "info", str(forged("dtype", dtype))],
        "info-exposure": ["log", "info", str(forged("exposure", exposure))],
        "audit": ["audit", "--format", "json", "-o", str(top / "A.json"), "--sign", str(key)],
    }
    other = top / "other-drive"
    _write_drive(other, 6, W, H, seed=7, t0=9_000_000_000)
    cmds["mixup"] = ["replay", str(drive), "--config", str(cfg), "--out",
                     str(top / "run-mix"), "--ref", str(other), "--no-progress"]
    mod = top / "ctl"
    mod.mkdir(mode=0o755)
    (mod / "torchctl.py").write_text("import torch  # refused in the control domain\n")
    doc = tomllib.loads(cfg.read_text())
    doc["domains"]["control"]["python_path"] = [str(mod)]
    doc["workers"]["controlsd"]["module"] = "torchctl"
    bad = top / "torchctl.toml"
    bad.write_text(dumps(doc))
    cmds["adm-replay"] = ["replay", str(drive), "--config", str(bad), "--out",
                          str(top / "run-adm"), "--no-progress"]
    cmds["adm-record"] = ["record", str(top / "rec-adm"), "--config", str(bad),
                          "--seconds", "1", "--video", "raw", "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(clone), "PYTHONDONTWRITEBYTECODE": "1",
           "TRIO_STATE_DIR": str(top / "state")}
    procs = {name: subprocess.Popen([sys.executable, "-m", "supervisor.cli", *args],
                                    cwd=clone, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, args in cmds.items()}
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


def _done(p: subprocess.Popen, timeout: float = 240) -> subprocess.CompletedProcess:
    if not hasattr(p, "_done"):
        so, se = p.communicate(timeout=timeout)
        p._done = subprocess.CompletedProcess(p.args, p.returncode, so, se)
    return p._done


@pytest.fixture(scope="module")
def runs(jobs) -> dict[str, subprocess.CompletedProcess]:
    """The developer's commands of `jobs`, finished: name -> the command's result."""
    return {name: _done(p) for name, p in jobs.items() if name != "audit"}


def test_a_record_the_reader_skips_is_skipped_by_the_log_clock_too(runs):
    """`log info` and DriveLog count a message whose dtype is not a number type as one
    corrupt record and skip it (red team 2 and 6); controlsd's `--log-clock` reads the
    same stream through `logfmt.command_steps`, which calls np.dtype() on it unguarded:
    controlsd exits 2 at start five times, the supervisor latches fail-safe, and the
    gate reads `INCOMPLETE (exit 7)` of a log whose every frame is whole."""
    r, info = runs["hostile"], runs["info-dtype"].stdout
    assert "1 corrupt record" in info, info
    doc = json.loads(r.stdout)                       # (it is one document: that holds)
    # Right: the record skipped and counted as the input's loss (exit 0), or the log
    # refused before anything starts (exit 2); never controlsd killed by it.
    assert r.returncode in (0, 2), (r.returncode, r.stderr[-600:])
    assert "controlsd exited" not in r.stderr, r.stderr[-600:]
    assert doc["exit_code"] == r.returncode


def test_a_frame_records_absurd_exposure_never_crashes_the_camera(runs):
    """camerad's LogSource takes each frame's exposure from the log's frame records
    (workers/camerad/video.py:49) and publishes it; the bridge's header holds it in 32
    bits: `struct.error: 'I' format requires 0 <= number <= 4294967295`, camerad exit 1
    (a bug's code) at frame 2, `gave_up camerad, fail_safe`, exit 7, and the result
    line `None frames/s = Nonex real time`. `log info` of the log: `nothing lost`."""
    r, info = runs["hostile"], runs["info-exposure"].stdout
    assert "nothing lost" not in info, info
    assert r.returncode in (0, 2), (r.returncode, r.stderr[-600:])
    assert "struct.error" not in r.stderr and "camerad exited" not in r.stderr, r.stderr[-600:]
    assert json.loads(r.stdout)["exit_code"] == r.returncode


def test_an_admission_refusal_is_the_supervisors_exit_3(runs):
    """docs/replay.md, exit codes of `record` and `replay`: `3, 4, 5: the supervisor's
    own: admission refused, fail-safe, start failed`. A control worker that imports torch
    (its module on the control domain's python_path): the supervisor exits 3 (`admission
    refused required worker(s): controlsd`); `replay` says exit 7 ("incomplete": the CI
    script of docs/replay.md reads it as a run that did not get through the log) and
    `record` exit 2 ("bad input"), each on two lines of stderr."""
    rp, rc = runs["adm-replay"], runs["adm-record"]
    assert "admission refused" in rp.stderr, rp.stderr[-800:]
    assert "admission refused" in rc.stderr, rc.stderr[-800:]
    assert (rp.returncode, rc.returncode) == (3, 3), (rp.returncode, rc.returncode)
    assert len(rp.stderr.strip().splitlines()) == 1, rp.stderr


def test_format_json_gives_a_document_for_a_usage_error_too(clone, drive):
    """A CI script that parses `replay ... --format json`'s stdout gets one document for
    every other bad input (missing log, bad log, --ref missing, version: checked here);
    a mistyped option (`--tol-p99` for `--time-p99`, an option of a newer version) is
    argparse's exit 2 with nothing on stdout: `json.loads('')` is the script's crash."""
    r = _cli(["replay", str(drive), "--out", str(clone.parent / "run-u"), "--format", "json",
              "--no-progress", "--tol-p99", "1.5"], root=clone)
    assert r.returncode == 2, r.stderr
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == 2 and "--tol-p99" in doc["error"]


def test_a_ref_of_another_drive_is_refused_not_a_difference(runs):
    """A CI job whose golden is mixed up (`--ref golden/highway-02` for highway-01's
    log): REF here is another drive's log (other pixels, other capture times, the same
    frame ids 0..5, as two drives of one camera restart have). Messages are matched by
    frame id only, so every model output 'changed' and the job fails as a model
    regression, exit 6 ('the model changed what the car does', docs/replay.md's CI
    step), naming no mix-up. Whether REF is of this drive is known before anything
    starts (its frames' ids and capture times, or a RUN's summary.json `log`)."""
    r = runs["mixup"]
    assert "frame" in r.stdout + r.stderr, r.stdout + r.stderr
    assert r.returncode == 2, (r.returncode, r.stdout[-800:], r.stderr[-400:])


def test_a_video_description_that_contradicts_the_frames_is_said(clone):
    """Every frame record says 64x48; the video's description says 128x24 (the same
    bytes per frame, so every index record passes). `log info`: `road_frames: 12 frames
    64x48 nv12, video raw 12 frames`, `loss: nothing lost`; a replay starts the whole
    pipeline and ends `stopped early: ... rejected=frame:too_small` (exit 7): the
    pixels were played at another stride."""
    d = clone.parent / "stride"
    _write_drive(d, 12, 64, 48)
    v = d / "road_frames.video"
    meta = json.loads(v.read_text())
    meta.update(width=128, height=24)
    v.write_text(json.dumps(meta))
    r = _cli(["log", "info", str(d)], root=clone)
    assert r.returncode in (0, 2), r.stderr
    assert "nothing lost" not in r.stdout and ("128x24" in r.stdout + r.stderr), r.stdout


# ------------------------------------------------------------------ the reviewer

@pytest.fixture(scope="module")
def keys(clone):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    k = Ed25519PrivateKey.generate()
    key, pub = clone.parent / "rev.key", clone.parent / "rev.pub"
    key.write_bytes(k.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))
    key.chmod(stat.S_IRUSR | stat.S_IWUSR)
    pub.write_bytes(k.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return key, pub


@pytest.fixture(scope="module")
def signed(clone, keys, jobs) -> Path:
    """The reviewer's signed report of the car's default config, made in the clone (as
    docs/review.md step 1: `audit --format json -o A.json --sign KEY`, started with the
    module's other slow commands in `jobs`), and checked: it verifies there."""
    _, pub = keys
    rep = clone.parent / "A.json"
    r = _done(jobs["audit"], timeout=180)
    assert r.returncode == 0, r.stderr[-1500:]
    v = _cli(["audit", "verify", str(rep), f"{rep}.sig", str(pub)], root=clone)
    assert v.returncode == 0 and "OK" in v.stdout, v.stdout + v.stderr
    return rep


def _verify(clone: Path, rep: Path, pub: Path, **kw) -> subprocess.CompletedProcess:
    return _cli(["audit", "verify", str(rep), f"{rep}.sig", str(pub)], root=clone, **kw)


def test_verify_checks_the_model_files_the_report_lists(clone, keys, signed):
    """The report lists each artifact file's sha256 (`provenance.artifacts[].files`,
    'all match the manifest'); verify compares key id, manifest sha256 and the
    signature verdict only (audit/sign.py `_models_moved`). One byte of
    models/demo/lane-offset-wide/golden.bin flipped: `verify` OK, exit 0, 'the model
    keys, manifests and control code trees it names are the report's', while
    `supervisor check` of the same tree refuses the model (HashMismatch)."""
    _, pub = keys
    p = clone / "models" / "demo" / "lane-offset-wide" / "golden.bin"
    orig = p.read_bytes()
    try:
        b = bytearray(orig)
        b[10] ^= 1
        p.write_bytes(bytes(b))
        chk = _cli(["check"], root=clone)
        assert "HashMismatch" in chk.stdout + chk.stderr, chk.stdout + chk.stderr
        v = _verify(clone, signed, pub)
        assert v.returncode == 6 and "golden.bin" in v.stdout + v.stderr, v.stdout
    finally:
        p.write_bytes(orig)


def test_the_reports_exposure_is_the_units_own_score(clone, signed):
    """What runs as root: the report's exposure is `_score(units.EXPOSURE)`, a
    hand-kept table (audit/privilege.py:72), never the unit: `systemd-analyze security
    --offline=true` of the unit `supervisor units` renders (what install.sh installs)
    says 3.6 here (docs/review.md says 3.6 too; the signed report 3.3). Nor does
    the report bind the installed unit: an edited /etc/systemd/system unit leaves it
    and `verify` unchanged."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    out = clone.parent / "units"
    r = _cli(["units", "--out", str(out)], root=clone)
    assert r.returncode == 0, r.stderr
    a = subprocess.run(["systemd-analyze", "security", "--offline=true",
                        str(out / "trio-supervisor.service")], capture_output=True, text=True,
                       timeout=60)
    line = [x for x in a.stdout.splitlines() if "Overall exposure level" in x][0]
    measured = float(line.split(":")[1].split()[0])
    doc = json.loads(signed.read_text())
    said = [p["exposure"] for p in doc["privilege"]["processes"]
            if p["unit"] == "trio-supervisor.service"]
    assert said == [measured], (said, measured)


def test_verify_names_another_bubblewrap_than_the_reports(clone, keys, signed):
    """The report's provenance names `tools.bwrap` (bubblewrap 0.8.0) and the libraries
    that enforce isolation (pyseccomp, ...); verify checks config, models and code
    trees only. A bwrap first on PATH that is another version (the one the supervisor
    would run: sandbox/bwrap.py takes PATH's): `verify` OK, exit 0, not a word."""
    _, pub = keys
    fake = clone.parent / "fakebin"
    fake.mkdir()
    real = shutil.which("bwrap")
    (fake / "bwrap").write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo "bubblewrap '
                                f'0.4.0"; exit 0; }}\nexec {real} "$@"\n')
    (fake / "bwrap").chmod(0o755)
    v = _verify(clone, signed, pub, path=f"{fake}:{os.environ.get('PATH', '')}")
    assert v.returncode in (0, 6), v.stderr
    assert "0.4.0" in v.stdout + v.stderr, v.stdout


def test_the_report_says_what_research_can_observe_of_control(signed):
    """docs/review.md, 'What research can still observe of control (known, not closed)':
    a research reader of road_frames sees in the header's last_slot which slot camerad
    chose, steered by modeld's leases (red team 14 row 9: modeld's pace guessed 20 of
    20); and its own scheduling delays move with control's load. The signed report
    lists what research can *write* (bold rows) and road_frames' data to research as
    'an input of what it publishes', but no path carries a control reader's pace to
    research, and no section says 'observable': a reviewer who signs the report signs
    a claim about research's view of control that only the prose document makes."""
    doc = json.loads(signed.read_text())
    text = json.dumps(doc)
    paths = doc["interference_paths"]
    # (the cgroups row, control -> research, is CPU contention: it is listed, and says
    # "no bytes"; what is missing is a control reader's pace seen through the ring)
    into_research = [p for p in paths if p["reader"] == "research"
                     and not p["kind"].startswith("shared CPU")
                     and "modeld" in p["writer"] + p.get("carries", "")]
    assert into_research or "last_slot" in text, [p["id"] for p in paths
                                                  if p["reader"] == "research"]


def _md_filesystem(clone: Path, report: Path) -> str:
    """The markdown filesystem view the clone renders of a JSON report."""
    r = subprocess.run([sys.executable, "-c", "import json, sys\n"
                        "from supervisor.audit.review import md_filesystem\n"
                        "print('\\n'.join(md_filesystem(json.load(open(sys.argv[1])))))",
                        str(report)], env={**os.environ, "PYTHONPATH": str(clone),
                                           "PYTHONDONTWRITEBYTECODE": "1"},
                       cwd=clone, capture_output=True, text=True, timeout=60, check=True)
    return r.stdout


def test_the_published_filesystem_view_is_heads(clone, signed):
    """docs/review.md's threat model says the machine's counters under /proc are empty
    in every sandbox (red team 14 row 3, 27331ca, 18:21); docs/audit-default.md was
    regenerated at 17:55 (69766f3) and names none of them. Review 8's guard of the
    published audit leaves the filesystem view out (it names install paths), so
    nothing noticed. Compared here: every masked or emptied path of HEAD's report
    (none of them an install path) is in the published document."""
    doc = json.loads(signed.read_text())
    published = (REPO / "docs" / "audit-default.md").read_text()
    want = sorted({p for v in doc["filesystem"].values() if isinstance(v, dict)
                   for p in v.get("masked", []) + v.get("hidden", [])
                   + [m["path"] for m in v.get("mounts", []) if m.get("what") == "emptied"]
                   if p.startswith("/proc")})
    assert want, "HEAD's report masks nothing under /proc"
    missing = [p for p in want if p not in published]
    assert missing == [], missing


def test_masked_proc_counters_are_not_called_compilers(clone, signed):
    """The markdown (and text) filesystem view prints every /dev/null bind as
    `Compilers masked (bound over by /dev/null, cannot run): /proc/loadavg, /proc/stat,
    ..., /usr/bin/c89-gcc, ...`: the JSON's `masked` list (audit/fsview.py: "a compiler
    bound over by /dev/null") holds both, and review.py:235 names them all compilers.
    A reviewer reads that the machine's counters are compilers, and cannot find them
    where the threat model says they are closed."""
    md = _md_filesystem(clone, signed)
    lines = [x for x in md.splitlines() if x.startswith("Compilers masked")]
    assert lines, md[:2000]
    assert not any("/proc/" in x for x in lines), lines[0][:400]


CAP_NAMES = ("CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP "
             "LINUX_IMMUTABLE NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK "
             "IPC_OWNER SYS_MODULE SYS_RAWIO SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN "
             "SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE "
             "AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND "
             "AUDIT_READ PERFMON BPF CHECKPOINT_RESTORE").split()


def test_live_audit_lists_the_capabilities_the_supervisor_holds(clone, bench):
    """`audit --live --pid PID` of a supervisor started from a root shell (a bench, and
    what `audit --live --start` itself starts): the report says `found: the sandboxes'
    parent is a root supervisor` and lists CAP_SETUID ... CAP_KILL (units.CAPABILITIES),
    while /proc/PID/status says CapEff 000001fffeffffff. On the car, a unit edited to
    add a capability is reported the same way: the live audit reads the capability
    table of supervisor/units.py (audit/privilege.py:71), never the process."""
    top = clone.parent
    deadline = time.monotonic() + 90
    while "ready" not in (top / "bench.err").read_text() and time.monotonic() < deadline:
        assert bench.poll() is None, (top / "bench.err").read_text()[-1500:]
        time.sleep(0.3)
    time.sleep(1.0)
    st = Path(f"/proc/{bench.pid}/status").read_text()
    eff = int([x for x in st.splitlines() if x.startswith("CapEff:")][0].split()[1], 16)
    held = sorted(f"CAP_{n}" for i, n in enumerate(CAP_NAMES) if eff >> i & 1)
    out = top / "live.json"
    r = _cli(["audit", "--live", "--pid", str(bench.pid), "--format", "json", "-o",
              str(out)], root=clone, timeout=120)
    assert r.returncode in (0, 6) and out.is_file(), r.stderr[-1500:]
    rows = json.loads(out.read_text())["privilege"]["processes"]
    said = sorted(rows[0]["capabilities"])
    assert said == held, (said, len(held))
