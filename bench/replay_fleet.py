"""Replay speed and fleet scale, with ratios measured in the same run.

    python bench/replay_fleet.py [--logs 20] [--seconds 3] [--width 1928 --height 1208]
                                 [--skip-ray] [--out DIR]

1. records one drive (``supervisor record``, the synthetic camera at WxH, 20 fps) and
   copies it into ``--logs`` logs;
2. replays one log deterministically (lockstep) and reports frames/s against the
   recorded rate (real time = 1.0x), and checks a second replay is bit-identical;
3. with ``--gate-runs K``: the CI gate under load, K more replays compared with the
   first while ``--hogs H`` CPU hogs (default 2: both cores here) run, counting verdicts
   (``--research`` keeps the research worker and its shadow channel: reported, not gated);
4. replays all logs one by one (``--jobs 1``), with ``--jobs 2``, and on a local Ray
   cluster (``--ray local``), and reports each wall time against one-by-one.

Every replay is a whole sandboxed pipeline (camerad, modeld, controlsd, recorder).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PIPE = ("camerad", "modeld", "controlsd")


def model_for(work: Path, w: int, h: int) -> dict[str, str]:
    """The demo model built and signed for WxH frames (a test key): the shipped
    artifact takes the car's 1928x1208 Y plane only and refuses smaller frames
    (`too_small`), so a bench at another size would replay a pipeline whose model
    never ran. Config keys to set."""
    out = work / "model"
    env = {k: v for k, v in os.environ.items() if k not in ("CACHEDB", "DEV", "PARALLEL")}
    subprocess.run([sys.executable, "-m", "workers.modelbuild", "--out", str(out / "m"),
                    "--key", str(out / "k.key"), "--seed", "0", "--frames", "40",
                    "--val-frames", "8", "--width", str(w), "--height", str(h)],
                   check=True, cwd=ROOT, env=env, capture_output=True)
    name = json.loads((out / "m" / "manifest.json").read_text())["model"]["name"]
    return {"models.lane-offset.artifact": str(out / "m"),
            "models.lane-offset.public_key": str(out / "k.pub"),
            "models.lane-offset.expect_name": name}


def bench_config(w: int, h: int, slot: int, research: bool = False,
                 model: dict[str, str] | None = None) -> str:
    """The vehicle's own pipeline (the one-camera config, without research unless asked)
    at WxH, no standbys: what a developer replays."""
    from supervisor.config import derive, dumps, minimal_doc

    drop = () if research else ("workers.research", "channels.shadow_out")
    return dumps(derive(minimal_doc(), drop=drop, set={
        **(model or {}),
        "workers.camerad.args": ["--width", str(w), "--height", str(h), "--fps", "20"],
        "channels.road_frames.slot_size": slot,
        "channels.model_out.slot_count": 8,
        "channels.control_cmd.slot_count": 16,
        **{f"workers.{n}.warm_standby": False for n in PIPE}}))


def cli(*args: str, cwd: Path) -> tuple[int, str, float]:
    t0 = time.monotonic()
    env = {**os.environ, "TRIO_STATE_DIR": str(cwd / "state")}   # never the machine's latch
    p = subprocess.run([sys.executable, "-m", "supervisor.cli", *args], cwd=cwd, env=env,
                       capture_output=True, text=True)
    if p.returncode not in (0, 6):
        print(p.stderr[-2000:], file=sys.stderr)
    return p.returncode, p.stdout, time.monotonic() - t0


def gate_under_load(rec: Path, work: Path, runs: int, hogs: int) -> None:
    """K replays vs the first while `hogs` busy loops compete for the cores: verdicts
    (exit 0 within tolerance, 6 differs, else failed) and the recorder's drops."""
    verdicts: dict[str, int] = {}
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    try:
        for k in range(runs):
            out_dir = work / f"gate{k}"
            code, _, wall = cli("replay", str(rec), "--out", str(out_dir), "--ref",
                                str(work / "one0"), "--time-p99", "50", "--time-max", "50",
                                "--no-progress", cwd=work)
            v = {0: "within tolerance", 6: "DIFFERS"}.get(code, f"failed ({code})")
            verdicts[v] = verdicts.get(v, 0) + 1
            try:
                s = json.loads((out_dir / "summary.json").read_text())
                drops = {c: sum(d.values()) for c, d in s.get("drops", {}).items()}
            except (OSError, ValueError):
                drops = {}
            print(f"gate {k + 1}/{runs} under {hogs} hogs: {v} in {wall:.1f} s, recorder "
                  f"drops {drops or 'none'}")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    print("gate under load: " + ", ".join(f"{n} {v}" for v, n in verdicts.items())
          + f" of {runs}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--logs", type=int, default=20, help="0: replay speed only, no fleet")
    ap.add_argument("--seconds", type=float, default=3.0)
    # The demo model's kernels take the car's 1928x1208 Y plane as it is (input ABI 2):
    # at another size the demo model is built for it first (`model_for`, ~1 min).
    ap.add_argument("--width", type=int, default=1928)
    ap.add_argument("--height", type=int, default=1208)
    ap.add_argument("--skip-ray", action="store_true")
    ap.add_argument("--gate-runs", type=int, default=0,
                    help="replays compared with the first under --hogs CPU hogs")
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--research", action="store_true",
                    help="keep the research worker (shadow_out: reported, not gated)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    work = Path(a.out or tempfile.mkdtemp(prefix="replay-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    slot = max(256 << 10, a.width * a.height * 3 // 2 + 4096)
    model = None if (a.width, a.height) == (1928, 1208) else model_for(work, a.width, a.height)
    (work / "bench.toml").write_text(bench_config(a.width, a.height, slot, a.research, model))
    rec = work / "rec"
    code, out, wall = cli("record", str(rec), "--config", str(work / "bench.toml"),
                          "--seconds", str(a.seconds), "--quiet", "--video", "raw", cwd=work)
    if code != 0:
        print(f"record failed ({code}): {out}")
        return 1
    print(out.strip())
    from supervisor.replay.drivelog import DriveLog

    log = DriveLog.open(rec)
    nframes = len(log.video("road_frames"))
    outputs = len(log.messages.get("model_out", []))
    print(f"recorded log: {nframes} frames of {a.width}x{a.height}, "
          f"{a.seconds:g} s at 20 fps, {outputs} model outputs")
    if outputs == 0:        # a replay without a model is not what a developer replays
        print("no model output was recorded (the model refused the frames?): not measured")
        return 1

    # Replay speed, deterministic mode, and bit-identity of two replays.
    runs = []
    for k in range(2):
        code, out, wall = cli("replay", str(rec), "--out", str(work / f"one{k}"),
                              "--no-progress", cwd=work)
        if not (work / f"one{k}" / "summary.json").is_file():
            print(f"replay {k + 1}: exit {code}, no summary (its error is above): stopped")
            return 1
        s = json.loads((work / f"one{k}" / "summary.json").read_text())
        runs.append(s)
        print(f"replay {k + 1}: exit {code}, {s['frames']['replayed']} frames "
              f"({s['frames']['model_outputs']} model outputs) in "
              f"{s['wall_s']:.2f} s (pipeline start included) -> {s['frames_per_s']} "
              f"frames/s = {s['speed_vs_realtime']}x real time")
    code, out, _ = cli("replay", str(rec), "--out", str(work / "one2"), "--ref",
                       str(work / "one0"), "--no-progress", cwd=work)
    d = json.loads((work / "one2" / "diff.json").read_text())
    same = all(c["ok"] for c in d["channels"] if c["channel"] in d["gated"])
    g = d["gate"]
    print(f"third replay vs first: model outputs and commands "
          f"{'bit-identical' if same else 'DIFFER'} "
          f"({', '.join(str(c['channel']) + ' ' + str(c['compared']) for c in d['channels'])}"
          f" compared); "
          f"time gate {'ok' if g['ok'] else 'failed: ' + g['why']} (exit {code})")

    if a.gate_runs:
        gate_under_load(rec, work, a.gate_runs, a.hogs)
    if a.logs == 0:
        return 0
    logs = work / "logs"
    logs.mkdir()
    for i in range(a.logs):
        shutil.copytree(rec, logs / f"drive{i:03d}")
    results = {}
    modes = [("one by one", ["--jobs", "1"]), ("--jobs 2", ["--jobs", "2"])]
    if not a.skip_ray:
        modes.append(("ray local", ["--ray", "local"]))
    for name, extra in modes:
        out_dir = work / f"fleet-{name.replace(' ', '_').replace('-', '')}"
        code, out, wall = cli("replay", str(logs), "--out", str(out_dir), *extra, cwd=work)
        rep = json.loads((out_dir / "fleet.json").read_text())
        results[name] = wall
        print(f"fleet {name:10s}: {a.logs} logs, {rep['frames']} frames, exit {code}, "
              f"ok {rep['ok']} failed {rep['failed']} retried {rep['retried']}, "
              f"wall {wall:.1f} s")
    base = results["one by one"]
    for name, wall in results.items():
        print(f"  {name:10s} {wall:7.1f} s  = {base / wall:.2f}x the one-by-one speed")
    print(f"(work dir: {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
