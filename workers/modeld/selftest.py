"""Load a signed artifact exactly as modeld does and run it on synthetic frames; one JSON
line on stdout (outputs as hex bytes, for bit-exact comparison).

    python -m workers.modeld.selftest --artifact DIR --pubkey FILE [--frames N]
        [--width W --height H --seed S] [--lock-down] [--probe-compilers]

Exit 0 with ``"ok": true``; exit 3 with ``"ok": false, "error": <ArtifactError type>`` when
the artifact is refused (e.g. ``KernelNotInArtifact`` naming the kernel). Also runs as a
worker module (``python -m supervisor.runner workers.modeld.selftest ...``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="workers.modeld.selftest")
    p.add_argument("--artifact", required=True)
    p.add_argument("--pubkey", required=True)
    p.add_argument("--frames", type=int, default=5)
    p.add_argument("--width", type=int, default=1928)
    p.add_argument("--height", type=int, default=1208)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--scene", choices=("road", "wide", "driver"), default="road",
                   help="the synthetic camera the frames come from")
    p.add_argument("--first-frame", type=int, default=0)
    p.add_argument("--deadline-ms", type=float, default=50.0)
    p.add_argument("--lock-down", action="store_true",
                   help="install the control seccomp filter (no exec, no new process) "
                        "before inference")
    p.add_argument("--probe-compilers", action="store_true",
                   help="report what clang/gcc/cc are here (looked at, not run)")
    return p.parse_args(argv)


def probe_compilers() -> dict[str, str]:
    """What each compiler is in this process's filesystem ("executable", "char-device"
    where the sandbox masked it, "missing"...), looked at, not run: a locked-down
    control process may not start one even to see it die."""
    from supervisor.audit.evidence import compiler_probe

    return compiler_probe(os.getpid(), [f"/usr/bin/{n}" for n in ("clang", "gcc", "cc")])


def frames(n: int, width: int, height: int, seed: int, first: int, scene: str = "road",
           row_stride: int | None = None):
    """(frame id, Y plane view at ``row_stride`` as in a camera frame, truth values)."""
    from dataclasses import astuple

    from workers.modelbuild.synthetic import driver_class, road_class

    if scene == "wide":
        from workers.camerad.synthetic import scene as camera_scene

        road = camera_scene("wide", width, height, seed)
    else:
        cls, _name = road_class() if scene == "road" else driver_class()
        road = cls(width, height, seed=seed)
    for i in range(first, first + n):
        y, _uv, truth = road.render(i)
        if row_stride and row_stride != width:
            buf = np.zeros((height, row_stride), np.uint8)
            buf[:, :width] = y
            y = buf[:, :width]
        yield i, y, [float(v) for v in astuple(truth)]


def run(a: argparse.Namespace) -> dict[str, Any]:
    from supervisor.model import ArtifactError, load_verified
    from supervisor.model import runtime as R
    from workers.modeld.engine import ENGINE_ABIS, Engine

    rep: dict[str, Any] = {"ok": False, "pid": os.getpid(),
                           "tinygrad_imported_before_load": R.tinygrad_imported()}
    if a.probe_compilers:
        rep["compilers"] = probe_compilers()
    home_cache = os.path.join(os.path.expanduser("~"), ".cache", "tinygrad")
    rep["home_cache_before"] = sorted(os.listdir(home_cache)) if os.path.isdir(home_cache) else None
    try:
        t0 = time.monotonic()
        verified = load_verified(a.artifact, a.pubkey, expect_abi=ENGINE_ABIS)
        rep["verify_ms"] = round((time.monotonic() - t0) * 1e3, 2)
        engine = Engine(verified, deadline_ms=a.deadline_ms, exclusive=True)
    except ArtifactError as exc:
        rep.update(error=type(exc).__name__, message=str(exc), compile=R.compile_stats())
        return rep
    rep["info"] = engine.info
    cuda = verified.cuda is not None
    if cuda:
        # the driver loader: no tinygrad, no compiler module in this process
        rep["tinygrad_imported_after_load"] = R.tinygrad_imported()
        rep["golden_max_abs"] = engine.model.golden_max_abs
    else:
        import tinygrad.helpers as TH

        rep["cachedb"] = TH.CACHEDB
        rep["cachedb_is_verified_copy"] = TH.CACHEDB == str(verified.kernels_db)
    if a.lock_down:
        from supervisor.sandbox.seccomp import installed_domains, lock_down

        lock_down("control")        # no exec, no new process (a no-op under the runner)
        rep["locked_down"] = sorted(installed_domains())
    outs, vals, truths, receipts, lat = [], [], [], [], []
    # One stream of frames per input: the first --scene, the others the sensor their
    # input declares (input ABI 3: the same frame ids, one instant of one drive).
    scenes = [a.scene] + [i.sensor or i.role for i in engine.inputs[1:]]
    for shots in zip(*(frames(a.frames, a.width, a.height, a.seed, a.first_frame, sc,
                              i.row_stride) for sc, i in zip(scenes, engine.inputs))):
        fid, _y, truth = shots[0]
        out, r = engine.infer(*(y for _f, y, _t in shots), frame_id=fid,
                              capture_ts_ns=time.monotonic_ns())
        outs.append(out.tobytes().hex())
        vals.append([float(v) for v in out])
        truths.append(truth)
        receipts.append(r.as_dict())
        lat.append(r.latency_ns)
    # model-only timing on the golden input (preprocessing included: it is in the
    # artifact; the input copy through the allocator too), for the record
    model_ns = []
    if verified.golden is not None:
        x = engine.model.golden_inputs()
        for _ in range(20):
            t = time.monotonic_ns()
            engine.model.run(x)
            model_ns.append(time.monotonic_ns() - t)
    # tinygrad only read the verified cache copy: unchanged, no journal/WAL beside it
    import hashlib

    if not cuda:
        kdb = verified.kernels_db
        rep["kernels_db_unchanged"] = (hashlib.sha256(kdb.read_bytes()).hexdigest()
                                       == verified.manifest["files"]["kernels.db"]["sha256"])
    rep["workdir_files"] = sorted(os.listdir(verified.workdir))
    lat_ms = sorted(v / 1e6 for v in lat)
    rep.update(
        ok=True, outputs=outs, values=vals, truth=truths, receipts=receipts,
        latency_ms={"min": lat_ms[0], "median": lat_ms[len(lat_ms) // 2], "max": lat_ms[-1]}
        if lat_ms else {},
        model_only_ms={"min": min(model_ns) / 1e6, "median": sorted(model_ns)[10] / 1e6}
        if model_ns else {},
        compile=R.compile_stats(),
        home_cache_after=sorted(os.listdir(home_cache)) if os.path.isdir(home_cache) else None,
    )
    verified.close()
    return rep


def main(ctx: Any = None) -> int:
    a = _args(sys.argv[1:])
    rep = run(a)
    if ctx is not None:
        rep["worker"] = {"name": ctx.name, "domain": ctx.domain}
    print(json.dumps(rep, sort_keys=True), flush=True)
    return 0 if rep.get("ok") else 3


if __name__ == "__main__":
    sys.exit(main())
