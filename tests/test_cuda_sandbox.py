"""The sandbox's device view (issue 28): a worker gets the GPU's nodes only when it
declares ``device = "cuda"``, control and research the same three; device-code compiler
libraries (NVRTC, nvJitLink, the driver's PTX JIT) are whited out of control like
compilers, shown in a real control sandbox with planted fakes; the audit shows it."""
from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from supervisor.audit import fsview, review
from supervisor.sandbox import launch, policy as P
from supervisor.sandbox.bwrap import build_bwrap_argv

from .conftest import bwrap_unusable
from .test_config import base, load_doc, problems

ROOT = Path(__file__).resolve().parents[1]
CUDA_DEMO = ROOT / "models" / "demo" / "lane-offset-cuda"
DEMO_PUB = ROOT / "models" / "demo" / "demo_ed25519.pub"
FAKE_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm")

_why = bwrap_unusable()
needs_bwrap = pytest.mark.skipif(_why is not None, reason=_why or "")


def _dev_binds(argv: list[str]) -> list[str]:
    return [argv[i + 2] for i, a in enumerate(argv) if a == "--dev-bind"]


def _cfg(**workers_device):
    doc = base()
    doc["models"] = {"lane": {"artifact": str(CUDA_DEMO), "public_key": str(DEMO_PUB),
                            "expect_name": "lane-offset-demo"}}
    doc["workers"]["model"]["model"] = "lane"
    for name, dev in workers_device.items():
        doc["workers"][name]["device"] = dev
    return doc


# ------------------------------------------------------------------ config

def test_device_is_cpu_by_default_and_cuda_when_declared():
    cfg = load_doc(_cfg(model="cuda", lab="cuda"))
    assert cfg.workers["cam"].device == "cpu"
    assert cfg.workers["model"].device == "cuda" and cfg.workers["lab"].device == "cuda"


def test_device_rules():
    ps = problems(_cfg(ctl="cuda"))          # control without a model
    assert any(p.key == "workers.ctl.device" and "only to run a signed model" in p.reason
               for p in ps), ps
    ps = problems(_cfg(model="tpu"))
    assert any(p.key == "workers.model.device" for p in ps), ps


def test_check_matches_the_models_device_with_the_workers():
    from supervisor.model.trust import verify_models

    trusted, probs = verify_models(load_doc(_cfg(model="cuda")))
    assert [t.name for t in trusted] == ["lane-offset-demo"] and probs == [], probs
    _, probs = verify_models(load_doc(_cfg()))
    assert probs == [("workers.model.device", "model 'lane' is a CUDA artifact "
                      "(CUDA:sm_90,sm_89,sm_80): the worker needs device = \"cuda\" "
                      "(it has 'cpu')")], probs


# ------------------------------------------------------------------ the plan

def test_only_a_cuda_worker_gets_the_gpu_nodes_and_research_no_more(monkeypatch):
    """The nodes there are (none on this machine: a stand-in list) go to the declared
    workers, the same for control and research; nobody else gets any."""
    monkeypatch.setattr(P, "cuda_device_nodes", lambda: list(FAKE_NODES))
    cfg = load_doc(_cfg(model="cuda", lab="cuda"))
    pols = {n: P.for_worker(cfg, w) for n, w in cfg.workers.items()}
    assert pols["model"].dev_binds == list(FAKE_NODES) and pols["model"].device == "cuda"
    assert pols["lab"].dev_binds == pols["model"].dev_binds          # never more
    for n in ("cam", "ctl"):
        assert pols[n].dev_binds == [] and pols[n].device == "cpu"
    # the bwrap command lines: --dev-bind for the declared worker's nodes only
    assert _dev_binds(build_bwrap_argv(pols["model"], ["true"])) == list(FAKE_NODES)
    assert _dev_binds(build_bwrap_argv(pols["cam"], ["true"])) == []


def test_only_existing_nodes_are_bound():
    assert P.cuda_device_nodes() == [n for n in FAKE_NODES if os.path.exists(n)]


def _fake_toolkit(root: Path) -> dict[str, Path]:
    """Device-code compilers where a GPU machine has them: a CUDA toolkit's lib, the
    loader's directory, an nvidia wheel's lib (no dist-info: copied in), and harmless
    neighbours that must stay visible."""
    files = {
        "toolkit_nvrtc": root / "prefix" / "local" / "cuda-13.0" / "lib64" / "libnvrtc.so.13",
        "loader_ptxjit": root / "prefix" / "lib" / "x86_64-linux-gnu" / "libnvidia-ptxjitcompiler.so.1",
        "loader_jitlink": root / "prefix" / "lib" / "x86_64-linux-gnu" / "libnvJitLink.so.13",
        "wheel_nvrtc": root / "venv" / "lib" / "python3.11" / "site-packages" / "nvidia" /
                       "cuda_nvrtc" / "lib" / "libnvrtc.so.12",
        "ok_cuda": root / "prefix" / "lib" / "x86_64-linux-gnu" / "libcuda.so.1",
        "ok_cublas": root / "prefix" / "local" / "cuda-13.0" / "lib64" / "libcublas.so.13",
    }
    for p in files.values():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"\x7fELF fake")
    (files["toolkit_nvrtc"].parent / "libnvrtc.so").symlink_to("libnvrtc.so.13")
    return files


def test_control_hides_device_code_compilers_research_does_not(tmp_path):
    files = _fake_toolkit(tmp_path)
    binds = [str(tmp_path / "prefix"), str(tmp_path / "venv")]
    ctl = P.policy_for_domain("control", extra_ro_binds=binds, device="cuda")
    hidden = set(ctl.hidden)
    for k, p in files.items():
        assert (str(p) in hidden) == (not k.startswith("ok_")), (k, sorted(hidden))
    assert str(files["toolkit_nvrtc"].parent / "libnvrtc.so") in hidden   # the symlink too
    res = P.policy_for_domain("research", extra_ro_binds=binds, device="cuda")
    assert not [h for h in res.hidden if "nvrtc" in h or "JitLink" in h or "ptxjit" in h]


_PROBE = textwrap.dedent("""
    import ctypes, json, os, sys
    out = {}
    for k, p in json.loads(sys.argv[1]).items():
        try:
            ctypes.CDLL(p)
            loaded = "loaded"
        except OSError as e:
            loaded = "no such file" if "No such file" in str(e) else "not loadable"
        out[k] = [os.path.lexists(p), loaded]
    out["nvidia_nodes"] = sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))
    print(json.dumps(out))
""")


@needs_bwrap
def test_a_real_control_sandbox_cannot_see_planted_compilers(tmp_path):
    """Planted fake NVRTC/nvJitLink/PTX JIT libraries, bound into a control sandbox, do
    not exist inside (dlopen: no such file), their neighbours do; a research sandbox sees
    them all (so the check can fail); neither has a /dev/nvidia* node (none declared)."""
    files = _fake_toolkit(tmp_path)
    binds = [str(tmp_path / "prefix"), str(tmp_path / "venv")]
    arg = json.dumps({k: str(p) for k, p in files.items()})
    out = {}
    for dom in ("control", "research"):
        pol = P.policy_for_domain(dom, extra_ro_binds=binds)
        r = launch.run(pol, [sys.executable, "-c", _PROBE, arg], timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
        out[dom] = json.loads(r.stdout.strip().splitlines()[-1])
    for k in files:
        ok = k.startswith("ok_")
        assert out["control"][k] == ([True, "not loadable"] if ok else [False, "no such file"]), \
            (k, out["control"])
        assert out["research"][k] == [True, "not loadable"], (k, out["research"])
    assert out["control"]["nvidia_nodes"] == out["research"]["nvidia_nodes"] == []


# ------------------------------------------------------------------ admission

_WORKER = textwrap.dedent("""
    import nvidia.cuda_nvrtc
    def main():
        return 0
""")


def test_admission_refuses_a_control_worker_importing_nvrtc(tmp_path):
    from supervisor.admission import check_worker

    (tmp_path / "nvrtc_worker.py").write_text(_WORKER)
    site = tmp_path / "site"
    (site / "nvidia" / "cuda_nvrtc" / "lib").mkdir(parents=True)
    (site / "nvidia" / "cuda_nvrtc" / "__init__.py").write_text("")
    rep = check_worker("nv", "control", "nvrtc_worker", None, [str(tmp_path), str(site)])
    assert not rep.ok, rep
    assert "nvidia.cuda_nvrtc" in rep.format() and "NVRTC" in rep.format(), rep.format()


# ------------------------------------------------------------------ audit

def test_the_audit_shows_the_device_view(monkeypatch):
    monkeypatch.setattr(P, "cuda_device_nodes", lambda: list(FAKE_NODES))
    cfg = load_doc(_cfg(model="cuda"))
    v = fsview.view_of(cfg, cfg.workers["model"])
    if v["error"]:
        pytest.skip(v["error"])
    assert v["device"] == "cuda" and v["device_nodes"] == list(FAKE_NODES)
    assert review._device_line(v) == ("Device: cuda: GPU nodes /dev/nvidia0, /dev/nvidiactl, "
                                      "/dev/nvidia-uvm.")
    cam = fsview.view_of(cfg, cfg.workers["cam"])
    assert cam["device"] == "cpu" and cam["device_nodes"] == []
    assert review._device_line(cam).startswith("Device: cpu (no GPU node")
    lines = review.md_filesystem({"filesystem": {"model": v, "cam": cam}})
    assert any(l.startswith("Device: cuda: GPU nodes /dev/nvidia0") for l in lines), lines
