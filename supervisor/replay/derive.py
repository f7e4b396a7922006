"""Derived configs for `supervisor record` and `supervisor replay`.

The user's config (a TOML file, or the embedded default) is read as a plain dict, the
recorder (and for a replay the camera's log source) is added to it, and the result is
written as TOML into a directory of the run and loaded by the normal loader: every rule
of a normal config holds for the derived one, and a problem is reported as usual.
"""
from __future__ import annotations

import copy
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.config import SIMULATION, ConfigError, dumps, load, minimal_doc

RECORDER_DOMAIN = "recorder"
RECORDER = "recorder"
ACK = "replay_ack"       # the recorder's "recorded the command of frame N" (lockstep)
REPLAY_READY_TIMEOUT_MS = 30000   # the least READY deadline of a replay's workers
REPLAY_WATCHDOG_MS = 5000        # the least watchdog of a lockstep replay's workers (the step timeout)
CLIP_RESTART_MS = 3_600_000       # record --clip: the camera's restart after the clip ended
CAMERA = "workers.camerad"
CONTROLS = "workers.controlsd"
MODEL = "workers.modeld"


class DeriveError(ConfigError):
    """The user's config does not have what record/replay needs (one line)."""


# What `record` (live or --clip) derives from without --config: the vehicle's default is
# the car, whose three cameras a replay cannot play yet (_the_camera); the one-camera
# pipeline has the car's supervisor, domains and channel settings (test_vehicle_config).
MINIMAL_SOURCE = "<embedded supervisor/configs/minimal.toml>"


def read_doc(path: str | os.PathLike | None) -> tuple[dict[str, Any], str]:
    """The user's config as a dict, and its name (no path: the one-camera pipeline)."""
    if path is None:
        return minimal_doc(), MINIMAL_SOURCE
    try:
        return parse_doc(Path(path).read_bytes(), str(path)), str(path)
    except OSError as e:
        raise DeriveError(f"{path}: cannot read the config: {e.strerror}") from None


def parse_doc(data: bytes, name: str) -> dict[str, Any]:
    try:
        return tomllib.loads(data.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise DeriveError(f"{name}: not valid TOML: {e}") from None


# ---------------------------------------------------------------- TOML out


# One TOML writer for configs: supervisor.config.dumps (derived configs live there).


# ---------------------------------------------------------------- helpers


def channel_names(value: Any) -> list[str]:
    """Channels of a ``publishes``/``subscribes`` value: a list of names, or a table
    of role = name."""
    if isinstance(value, dict):
        return [str(v) for v in value.values()]
    return [str(v) for v in (value or [])]


def uses_roles(doc: dict[str, Any]) -> bool:
    """Does the config bind channels to roles (``subscribes = {frames = "..."}``)?"""
    return any(isinstance(w.get(k), dict) for w in (doc.get("workers") or {}).values()
               if isinstance(w, dict) for k in ("publishes", "subscribes", "shadow_subscribes"))


def _add_channel(doc: dict[str, Any], w: dict[str, Any], key: str, channel: str,
                 role: str) -> str:
    """Add a read of ``channel`` to worker ``w``; returns the name the worker asks for
    (the role where the config binds roles, else the channel)."""
    cur = w.get(key)
    if isinstance(cur, dict) or (cur is None and uses_roles(doc)):
        w[key] = {**(cur or {}), role: channel}
        return role
    w[key] = [*(cur or []), channel]
    return channel


def worker_by_module(doc: dict[str, Any], module: str) -> tuple[str, dict[str, Any]] | None:
    for name, w in (doc.get("workers") or {}).items():
        if isinstance(w, dict) and w.get("module") == module:
            return name, w
    return None


def _need(doc: dict[str, Any], module: str, what: str) -> tuple[str, dict[str, Any]]:
    found = worker_by_module(doc, module)
    if found is None:
        raise DeriveError(f"the config has no {what} worker (module = {module!r})")
    return found


def _the_camera(doc: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The one camera a replay or a clip plays into. A config of several cameras (the
    default, the car: road, wide, driver) is refused in one line: a log or a clip feeds
    one camera, the others would keep rendering live, and a model that pairs the road
    camera with the wide one by frame id would pair nothing."""
    cams = [n for n, w in (doc.get("workers") or {}).items()
            if isinstance(w, dict) and w.get("module") == CAMERA]
    if len(cams) > 1:
        raise DeriveError(f"the config has {len(cams)} camera workers ({', '.join(cams)}): "
                          "a replay or a clip plays into one camera; use a one-camera config "
                          "(e.g. --config supervisor/configs/minimal.toml)")
    return _need(doc, CAMERA, "camera")


def _bump_readers(doc: dict[str, Any], channels: list[str], by: int = 1) -> None:
    # A channel whose max_readers is explicit needs room for the new readers; a default
    # one is sized from its subscribers (the new ones included) by the loader.
    for ch in channels:
        spec = doc.get("channels", {}).get(ch)
        if isinstance(spec, dict) and "max_readers" in spec:
            spec["max_readers"] = int(spec["max_readers"]) + by


def add_recorder(doc: dict[str, Any], out_dir: str, *, video: str, fps: float,
                 channels: list[str] | None = None) -> dict[str, Any]:
    """A recorder domain (research profile, the output directory bound writable) and
    the recorder worker reading ``channels`` (default: all) as log-only reads."""
    chans = list(channels if channels is not None else (doc.get("channels") or {}))
    if not chans:
        raise DeriveError("the config declares no channels: nothing to record")
    domains = doc.setdefault("domains", {})
    workers = doc.setdefault("workers", {})
    if RECORDER_DOMAIN in domains or RECORDER in workers:
        raise DeriveError(f"the config already has a {RECORDER!r} domain or worker")
    domains[RECORDER_DOMAIN] = {"profile": "research", "network": False, "actuates": False,
                                "failure_policy": "restart",
                                "extra_rw_binds": [os.path.abspath(out_dir)]}
    workers[RECORDER] = {
        "domain": RECORDER_DOMAIN, "module": "workers.recorder",
        # role = channel where roles are bound: the recorder asks for channel names
        "shadow_subscribes": {c: c for c in chans} if uses_roles(doc) else chans,
        "args": ["--out", os.path.abspath(out_dir), "--video", video, "--fps", str(fps),
                 "--channels", ",".join(chans)],
        "restart": "on-failure", "ready_timeout_ms": 30000, "watchdog_ms": 5000,
        "memory_max": "1GiB", "pids_max": 64,
    }
    _bump_readers(doc, chans)
    return doc


# ---------------------------------------------------------------- record


def camera_fps(doc: dict[str, Any]) -> float:
    cam = worker_by_module(doc, CAMERA)
    args = list(cam[1].get("args") or []) if cam else []
    for i, a in enumerate(args[:-1]):
        if a == "--fps":
            try:
                return float(args[i + 1])
            except ValueError:
                break
    return 20.0


def record_doc(doc: dict[str, Any], out_dir: str, *, video: str = "h264") -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    return add_recorder(doc, out_dir, video=video, fps=camera_fps(doc))


def clip_doc(doc: dict[str, Any], clip: str, out_dir: str, *, video: str = "h264",
             loop: bool = False) -> dict[str, Any]:
    """``record --clip FILE``: the user's pipeline in simulation mode with the camera
    playing FILE (at the config camera's --width/--height when it gives them, else the
    clip's own size; at the clip's frame rate), FILE bound read-only into the camera's
    domain (a sandbox sees only what is bound: nothing else of its directory), and a
    recorder. The camera starts once the recorder's writer is attached: the recorder
    is the last worker started, so the clip plays into a pipeline that is READY (and a
    recording that is on), not into start-up."""
    doc = copy.deepcopy(doc)
    clip = os.path.abspath(clip)
    name, cam = _the_camera(doc)
    doc.setdefault("supervisor", {})["mode"] = SIMULATION   # a clip never drives a car
    for w in (doc.get("workers") or {}).values():
        # As a replay: a simulation on a developer's (loaded) machine judges what the
        # pipeline computes, not how fast it starts (`run` enforces the car's deadlines).
        if isinstance(w, dict):
            w["ready_timeout_ms"] = max(int(w.get("ready_timeout_ms", 0) or 0),
                                        REPLAY_READY_TIMEOUT_MS)
    cam["args"] = _strip(list(cam.get("args") or []), {
        "--source": 1, "--log": 1, "--loop": 0, "--format": 1, "--frames": 1, "--seed": 1,
        "--video": 1, "--log-channel": 1, "--lockstep": 1, "--realtime": 0,
        "--step-timeout-s": 1, "--wait-for": 1, "--fps": 1, "--trigger": 1}) + [
        "--source", "video", "--video", clip, *(["--loop"] if loop else [])]
    if not loop:
        # A clip that ended exits camerad (0); its restart would play it again, and a
        # camera that is never restarted fails its domain safe. So its restart waits
        # longer than any recording: `record` stops once the clip has played, or at
        # once when the camera exits before the clip's end (record.py, _clip_done).
        cam["restart"] = "always"
        cam["backoff_initial_ms"] = cam["backoff_max_ms"] = CLIP_RESTART_MS
    dom = doc.setdefault("domains", {}).setdefault(cam["domain"], {})
    if clip not in dom.get("extra_ro_binds", []):
        dom["extra_ro_binds"] = [*dom.get("extra_ro_binds", []), clip]
    if ACK in (doc.get("channels") or {}):
        raise DeriveError(f"the config already has a channel named {ACK!r}")
    chans = list(doc.get("channels") or {})
    add_recorder(doc, out_dir, video=video, fps=camera_fps(doc), channels=chans)
    doc["channels"][ACK] = {"dtype": "float32", "slot_size": "4KiB",
                            "slot_count": 16, "max_age_ms": 60000, "shadow": True}
    role = _add_channel(doc, cam, "shadow_subscribes", ACK, "lockstep")
    cam["args"] += ["--wait-for", role]
    rec = doc["workers"][RECORDER]
    ack = _add_channel(doc, rec, "publishes", ACK, "ack")
    # Attached only, as the camera's start signal: acknowledging nothing (--ack-on no
    # channel it records), the recorder records as `record` always does (no catch-up
    # per command: a slow recorder drops and counts, it never paces the pipeline).
    rec["args"] += ["--ack", ack, "--ack-on", ""]
    return doc


# ---------------------------------------------------------------- replay


@dataclass(frozen=True)
class ReplayPlan:
    """Who does what in a replay (names from the user's config)."""

    camera: str
    frames: str              # the camera's frame channel (the log's video)
    controls: str | None
    command: str | None      # controlsd's output channel
    model: str | None
    model_out: str | None


def plan_of(doc: dict[str, Any]) -> ReplayPlan:
    cam, cw = _the_camera(doc)
    pubs = channel_names(cw.get("publishes"))
    if len(pubs) != 1:
        raise DeriveError(f"camera worker {cam!r} must publish exactly one frame channel")
    ctl = worker_by_module(doc, CONTROLS)
    mod = worker_by_module(doc, MODEL)
    cmd = channel_names(ctl[1].get("publishes"))[:1] if ctl else []
    mout = channel_names(mod[1].get("publishes"))[:1] if mod else []
    return ReplayPlan(cam, pubs[0], ctl[0] if ctl else None, cmd[0] if cmd else None,
                      mod[0] if mod else None, mout[0] if mout else None)


def _strip(args: list[str], flags: dict[str, int]) -> list[str]:
    """``args`` without the given flags (flag -> how many values follow it)."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        name = a.split("=", 1)[0]
        if name in flags:
            i += 1 + (0 if "=" in a else flags[name])
            continue
        out.append(a)
        i += 1
    return out


def replay_doc(doc: dict[str, Any], log_dir: str, run_log: str, state_dir: str, *,
               realtime: bool = False, step_timeout_s: float = 5.0,
               record_channels: list[str] | None = None) -> tuple[dict[str, Any], ReplayPlan]:
    """The user's pipeline with the camera playing ``log_dir`` and a recorder writing
    ``run_log``. Deterministic (lockstep) unless ``realtime``: the camera publishes a
    frame only once the recorder has written controlsd's command for the previous one
    (the recorder acknowledges on `ACK`), and controlsd runs on log time
    (`workers.controlsd` ``--log-clock``)."""
    doc = copy.deepcopy(doc)
    plan = plan_of(doc)
    log_dir = os.path.abspath(log_dir)
    workers = doc["workers"]
    sup = doc.setdefault("supervisor", {})
    sup["state_dir"] = os.path.abspath(state_dir)    # a replay never latches the car's
    sup["mode"] = SIMULATION                         # recorded frames and time into control
    for w in workers.values():
        w["warm_standby"] = False                    # nothing to take over in a replay
        # A replay judges what the pipeline computes, not how fast it starts: on a
        # loaded machine (a CI runner, a laptop) a camera READY after 5 s must not end
        # the replay in a fail-safe. The vehicle's own deadlines are `run`'s to enforce.
        w["ready_timeout_ms"] = max(int(w.get("ready_timeout_ms", 0) or 0),
                                    REPLAY_READY_TIMEOUT_MS)
    cam = workers[plan.camera]
    args = _strip(list(cam.get("args") or []), {
        "--source": 1, "--log": 1, "--loop": 0, "--width": 1, "--height": 1, "--format": 1,
        "--frames": 1, "--seed": 1, "--video": 1, "--log-channel": 1, "--lockstep": 1,
        "--realtime": 0, "--step-timeout-s": 1, "--wait-for": 1})
    args += ["--source", "log", "--log", log_dir, "--log-channel", plan.frames]
    chans = record_channels or [c for c in (doc.get("channels") or {})]
    lock = not realtime and plan.command is not None
    # The recorder tells the camera what it has written (a channel it publishes and the
    # camera reads, log-only): lockstep waits on it per frame; --realtime only waits for
    # the recorder to be attached before the first frame, so the run's log is whole.
    if ACK in (doc.get("channels") or {}):
        raise DeriveError(f"the config already has a channel named {ACK!r}")
    doc["channels"][ACK] = {"dtype": "float32", "slot_size": "4KiB",
                            "slot_count": 16, "max_age_ms": 60000, "shadow": True}
    name = _add_channel(doc, cam, "shadow_subscribes", ACK, "lockstep")
    if lock:
        # Freshness is a wall-clock judgement: in lockstep a loaded machine only makes
        # the replay slower, so no message may be refused as stale (a missed command
        # would stall the step and break determinism). --realtime keeps the config's.
        for spec in (doc.get("channels") or {}).values():
            if isinstance(spec, dict):
                spec["max_age_ms"] = 0
        # So are the car's watchdogs (controlsd's 200 ms): on a loaded CI runner one
        # missed by a worker waiting for a CPU ended a replay in a fail-safe, or named
        # the wrong cause of a real failure. A worker that hangs is still found: by its
        # watchdog at REPLAY_WATCHDOG_MS, and by the step timeout.
        for w in workers.values():
            if int(w.get("watchdog_ms", 0) or 0):
                w["watchdog_ms"] = max(int(w["watchdog_ms"]), REPLAY_WATCHDOG_MS)
        # Lockstep closes the loop through the recorder: camerad publishes frame n+1
        # once the recorder has written controlsd's command for frame n, so nothing is
        # dropped anywhere, the recorder included, and the run is a function of the log.
        args += ["--lockstep", name, "--step-timeout-s", str(step_timeout_s)]
    else:
        args += ["--realtime", "--wait-for", name]
    cam["args"] = args
    cam["restart"] = "never"           # a camera started over would replay twice
    ro = [log_dir]
    if plan.controls is not None and not realtime:
        ctl = workers[plan.controls]
        ctl["args"] = _strip(list(ctl.get("args") or []), {"--log-clock": 1}) + [
            "--log-clock", log_dir, "--log-channel", plan.frames]
    dom = doc.setdefault("domains", {}).setdefault(cam["domain"], {})
    dom["extra_ro_binds"] = [*dom.get("extra_ro_binds", []), *ro]
    if plan.controls is not None:
        cdom = doc["domains"].setdefault(workers[plan.controls]["domain"], {})
        if log_dir not in cdom.get("extra_ro_binds", []):
            cdom["extra_ro_binds"] = [*cdom.get("extra_ro_binds", []), log_dir]
    add_recorder(doc, run_log, video="none", fps=camera_fps(doc), channels=chans)
    rec = doc["workers"][RECORDER]
    ack = _add_channel(doc, rec, "publishes", ACK, "ack")
    rec["args"] += ["--ack", ack, "--ack-on", plan.command or ""]
    return doc, plan


def write_config(doc: dict[str, Any], directory: str | os.PathLike, name: str):
    """Write the derived config and load it with the normal loader. ``directory``: a
    path (a private temporary directory) or an `OutDir` (written through its fd)."""
    from supervisor.outdir import OutDir

    if isinstance(directory, OutDir):
        directory.write_text(name, dumps(doc))
        path = Path(directory.join(name))
    else:
        path = Path(directory) / name
        path.write_text(dumps(doc))
    return load(path), path


def verdict_channels(cfg) -> set[str]:
    """The channels that decide a comparison's verdict by default: those written by a
    worker of a non-research domain and not marked shadow (the control pipeline's). A
    research model's outputs, the recorder's acknowledgements and anything shadow are
    reported but never decide (openpilot's process_replay compares each process's
    deterministic outputs; research carries its own timings)."""
    out: set[str] = set()
    for name, ch in cfg.channels.items():
        if ch.shadow or name == ACK:
            continue
        try:
            writer = cfg.writer_of(name)
        except (KeyError, StopIteration):
            continue
        if cfg.profile_of(writer) != "research":
            out.add(name)
    return out
