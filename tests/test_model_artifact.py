"""Signed model artifacts: every tamper is refused with its typed error, before anything
from the bundle is unpickled, imported or mapped executable. Real files, real keys, real
tinygrad (where a test needs it), no mocks."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.model import (AbiMismatch, BadSignature, HashMismatch, HostIncompatible,
                              ManifestError, MissingFile, RuntimeMismatch, UnlistedFile,
                              UnsafePickle, UnsignedArtifact, WrongVersion, load_verified)
from supervisor.model import artifact as A
from supervisor.model import keys as K

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo" / "lane-offset"
DEMO_PUB = ROOT / "models" / "demo" / "demo_ed25519.pub"


# ------------------------------------------------------------------ helpers (shared)

@pytest.fixture(scope="session")
def test_key(tmp_path_factory):
    """A throwaway signing key (private key only ever in a temp dir) and its .pub file."""
    d = tmp_path_factory.mktemp("keys")
    key = K.generate_private_key(d / "test_ed25519.key")
    pub = d / "test_ed25519.pub"
    pub.write_text(K.public_key_text(key.public_key()))
    return key, pub


def copy_bundle(dst: Path, src: Path = DEMO) -> Path:
    shutil.copytree(src, dst)
    return dst


def resign(bundle: Path, key, mutate=None) -> dict:
    """Apply ``mutate`` to the manifest, re-hash the listed files, sign with ``key``."""
    m = A.read_manifest_unverified(bundle)
    m.pop("signing", None)
    if mutate is not None:
        mutate(m)
    m = A.refresh_file_entries(bundle, m)
    A.write_signed(bundle, m, key)
    return m


def flip_byte(path: Path, offset: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def evil_pickle(marker: Path) -> bytes:
    """A pickle whose loading creates ``marker`` (builtins.open(marker, 'w'))."""

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    return pickle.dumps(Evil())


def drop_kernel(bundle: Path, name: str, key) -> None:
    """Remove kernel ``name`` from kernels.db and the manifest, re-sign (a well-signed
    artifact that simply lacks the object)."""
    m = A.read_manifest_unverified(bundle)
    ent = next(k for k in m["kernels"] if k["name"] == name)
    table = m["runtime"]["cache_table"]
    con = sqlite3.connect(bundle / A.KERNELS_FILE)
    srcs = [r[0] for r in con.execute(f"SELECT key FROM '{table}'")]
    src = next(s for s in srcs if hashlib.sha256(s.encode()).hexdigest() == ent["source_sha256"])
    con.execute(f"DELETE FROM '{table}' WHERE key = ?", (src,))
    con.commit()
    con.execute("VACUUM")
    con.close()
    resign(bundle, key, lambda mm: mm.__setitem__(
        "kernels", [k for k in mm["kernels"] if k["name"] != name]))


# ------------------------------------------------------------------ the shipped demo

def test_demo_bundle_verifies_into_private_copies():
    with load_verified(DEMO, DEMO_PUB) as v:
        assert v.name == "lane-offset-demo" and v.version
        assert v.manifest_sha256 == hashlib.sha256((DEMO / "manifest.json").read_bytes()).digest()
        assert v.manifest_bytes == A.canonical_json(v.manifest)
        assert set(v.files) == {"jit.pkl", "kernels.db", "golden.bin"}
        assert oct(v.workdir.stat().st_mode & 0o777) == "0o700"
        for name, p in v.files.items():
            assert p.parent == v.workdir and p != DEMO / name
            assert oct(p.stat().st_mode & 0o777) == "0o400"
            assert hashlib.sha256(p.read_bytes()).hexdigest() == v.manifest["files"][name]["sha256"]
        names = {k["name"] for k in v.manifest["kernels"]}
        assert {"signal_prog", "wait_prog", "timestamp_prog", "worker_prog"} <= names
        assert b"\x7fELF" not in v.jit_bytes           # no machine code in the pickle
        assert len(v.kernels) == len(names)
        abi = v.manifest["abi"]
        assert abi["input"]["frame"] == {**abi["input"]["frame"], "pixel_format": "nv12",
                                         "plane": "y", "pixel_range": "full", "dtype": "uint8"}
        # input ABI 2: the Y plane as it lies in the frame, preprocessed in the artifact
        assert abi["version"] == 2 and abi["input"]["takes"] == "y_plane"
        assert abi["input"]["tensor"]["shape"] == [1208, 1936]
        assert abi["input"]["tensor"]["strides"] == [1936, 1]
        assert abi["input"]["preprocess"]["tolerance"]["max_abs"] == 0.0
        assert abi["output"]["fields"] == ["offset_m", "heading_rad", "confidence", "reserved"]
        assert v.manifest["host"]["required_cpu_flags"]
        work = v.workdir
    assert not work.exists()                          # close() removes the copies
    # golden.bin holds a whole Y plane (1208 x 1936 bytes) since input ABI 2
    size = sum(p.stat().st_size for p in DEMO.rglob("*") if p.is_file())
    assert size < 3 * 1024 * 1024


def test_verification_never_imports_tinygrad():
    code = ("import sys; from supervisor.model import load_verified; "
            f"v = load_verified({str(DEMO)!r}, {str(DEMO_PUB)!r}); v.close(); "
            "print('tinygrad' in sys.modules, 'pickle' in sys.modules and "
            "any(m.startswith('tinygrad') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_copies_are_immune_to_later_changes(tmp_path):
    b = copy_bundle(tmp_path / "b")
    with load_verified(b, DEMO_PUB) as v:
        (b / "jit.pkl").write_bytes(b"changed after verification")
        assert v.files["jit.pkl"].read_bytes() == v.jit_bytes
        assert hashlib.sha256(v.jit_bytes).hexdigest() == v.manifest["files"]["jit.pkl"]["sha256"]


# ------------------------------------------------------------------ tampering

@pytest.mark.parametrize("name", ["jit.pkl", "kernels.db", "golden.bin"])
def test_flipped_byte_in_a_file_is_a_hash_mismatch(tmp_path, name):
    b = copy_bundle(tmp_path / "b")
    flip_byte(b / name)
    with pytest.raises(HashMismatch, match=name.replace(".", r"\.")):
        load_verified(b, DEMO_PUB)


def test_flipped_byte_in_manifest_is_a_bad_signature(tmp_path):
    b = copy_bundle(tmp_path / "b")
    data = (b / "manifest.json").read_bytes()
    i = data.index(b'"version":"') + 11
    flip_byte(b / "manifest.json", i)
    with pytest.raises(BadSignature, match="manifest.sig"):
        load_verified(b, DEMO_PUB)


def test_wrong_key_is_a_bad_signature(test_key):
    _key, pub = test_key
    with pytest.raises(BadSignature, match="does not verify"):
        load_verified(DEMO, pub)


def test_missing_or_empty_signature_is_unsigned(tmp_path):
    b = copy_bundle(tmp_path / "b")
    (b / "manifest.sig").unlink()
    with pytest.raises(UnsignedArtifact, match="manifest.sig"):
        load_verified(b, DEMO_PUB)
    (b / "manifest.sig").write_bytes(b"")
    with pytest.raises(UnsignedArtifact, match="unsigned"):
        load_verified(b, DEMO_PUB)
    (b / "manifest.sig").write_bytes(b"\0" * 64)
    with pytest.raises(BadSignature):
        load_verified(b, DEMO_PUB)


def test_resigned_by_another_key_is_refused_with_the_trusted_one(tmp_path, test_key):
    key, pub = test_key
    b = copy_bundle(tmp_path / "b")
    resign(b, key)
    with pytest.raises(BadSignature):
        load_verified(b, DEMO_PUB)
    load_verified(b, pub).close()     # and fine with the key that signed it


def test_unlisted_extra_file_or_directory_is_refused(tmp_path):
    b = copy_bundle(tmp_path / "b")
    (b / "extra_weights.npy").write_bytes(b"\x93NUMPY")
    with pytest.raises(UnlistedFile, match="extra_weights.npy"):
        load_verified(b, DEMO_PUB)
    (b / "extra_weights.npy").unlink()
    (b / "plugins").mkdir()
    with pytest.raises(UnlistedFile, match="plugins"):
        load_verified(b, DEMO_PUB)


def test_missing_listed_file_and_symlink_are_refused(tmp_path):
    b = copy_bundle(tmp_path / "b")
    (b / "golden.bin").unlink()
    with pytest.raises(MissingFile, match="golden.bin"):
        load_verified(b, DEMO_PUB)
    shutil.copy(DEMO / "golden.bin", b / "golden.bin")
    (b / "jit.pkl").unlink()
    (b / "jit.pkl").symlink_to(DEMO / "jit.pkl")      # same bytes, but a symlink
    with pytest.raises(MissingFile, match="symlink"):
        load_verified(b, DEMO_PUB)


def test_non_canonical_manifest_is_refused_even_when_signed(tmp_path, test_key):
    key, pub = test_key
    b = copy_bundle(tmp_path / "b")
    pretty = json.dumps(A.read_manifest_unverified(b), indent=2, sort_keys=True).encode()
    (b / "manifest.json").write_bytes(pretty)
    (b / "manifest.sig").write_bytes(key.sign(pretty))
    with pytest.raises(ManifestError, match="not canonical"):
        load_verified(b, pub)


def test_wrong_model_version_or_name(tmp_path):
    with pytest.raises(WrongVersion, match="model.version"):
        load_verified(DEMO, DEMO_PUB, expect_version="9.9.9")
    with pytest.raises(WrongVersion, match="model.name"):
        load_verified(DEMO, DEMO_PUB, expect_name="some-other-model")
    load_verified(DEMO, DEMO_PUB, expect_name="lane-offset-demo",
                  expect_version=A.read_manifest_unverified(DEMO)["model"]["version"]).close()


def test_other_tinygrad_version_is_refused(tmp_path, test_key):
    key, pub = test_key
    b = copy_bundle(tmp_path / "b")
    resign(b, key, lambda m: m["runtime"].__setitem__("tinygrad_version", "0.13.0"))
    with pytest.raises(RuntimeMismatch, match="tinygrad_version"):
        load_verified(b, pub)


def test_other_device_is_refused(tmp_path, test_key):
    key, pub = test_key
    b = copy_bundle(tmp_path / "b")

    def cuda(m):
        m["runtime"]["device"] = "CUDA"
        m["runtime"]["renderer"] = "PTX"
    resign(b, key, cuda)
    with pytest.raises(RuntimeMismatch, match="CUDA/PTX"):
        load_verified(b, pub)


def test_host_without_the_cpu_features_or_arch_is_refused(tmp_path, test_key):
    key, pub = test_key
    b = copy_bundle(tmp_path / "b")
    resign(b, key, lambda m: m["host"]["required_cpu_flags"].append("avx512_imaginary"))
    with pytest.raises(HostIncompatible, match="avx512_imaginary"):
        load_verified(b, pub)

    def arm(m):
        m["host"]["arch"] = "arm64"
        m["host"]["required_cpu_flags"] = []
        m["runtime"]["target"] = f"CPU:CLANG:arm64,{m['host']['cpu']}"
    resign(b, key, arm)
    with pytest.raises(HostIncompatible, match="host.arch"):
        load_verified(b, pub)


def test_abi_mismatch_names_the_field(tmp_path, test_key):
    with pytest.raises(AbiMismatch, match=r"abi\.input\.frame\.pixel_format"):
        load_verified(DEMO, DEMO_PUB, expect_abi={"input": {"frame": {"pixel_format": "rgb888"}}})
    with pytest.raises(AbiMismatch, match=r"abi\.output\.shape"):
        load_verified(DEMO, DEMO_PUB, expect_abi={"output": {"shape": [8]}})
    key, pub = test_key
    b = copy_bundle(tmp_path / "b")
    resign(b, key, lambda m: m["abi"]["input"]["tensor"].__setitem__("strides", [4, 4, 4, 4]))
    with pytest.raises(AbiMismatch, match=r"abi\.input\.tensor\.strides"):
        load_verified(b, pub)


def test_kernels_db_must_match_the_listed_objects(tmp_path, test_key):
    key, pub = test_key
    b = copy_bundle(tmp_path / "b")
    m = A.read_manifest_unverified(b)
    table = m["runtime"]["cache_table"]
    victim = next(k for k in m["kernels"] if k["role"] == "model")
    con = sqlite3.connect(b / "kernels.db")
    for (src,) in con.execute(f"SELECT key FROM '{table}'").fetchall():
        if hashlib.sha256(src.encode()).hexdigest() == victim["source_sha256"]:
            con.execute(f"UPDATE '{table}' SET val = ? WHERE key = ?",
                        (pickle.dumps(b"\xcc" * 64), src))    # int3 sled instead
    con.commit()
    con.close()
    resign(b, key)          # file hashes re-signed, kernel list untouched
    with pytest.raises(HashMismatch, match=victim["name"]):
        load_verified(b, pub)


# ------------------------------------------------------------------ nothing is unpickled

def test_evil_payload_is_live(tmp_path):
    probe = tmp_path / "payload-works"
    pickle.loads(evil_pickle(probe))
    assert probe.exists()


def test_tampered_pickle_is_refused_before_unpickling(tmp_path, test_key):
    marker = tmp_path / "PWNED"
    b = copy_bundle(tmp_path / "b")
    (b / "jit.pkl").write_bytes(evil_pickle(marker))
    with pytest.raises(HashMismatch, match=r"jit\.pkl"):
        load_verified(b, DEMO_PUB)
    assert not marker.exists()
    key, _pub = test_key                 # re-signed, but not by the trusted key
    resign(b, key)
    with pytest.raises(BadSignature):
        load_verified(b, DEMO_PUB)
    assert not marker.exists()


def test_evil_object_in_kernels_db_is_never_unpickled(tmp_path, test_key):
    key, pub = test_key
    marker = tmp_path / "PWNED-db"
    b = copy_bundle(tmp_path / "b")
    m = A.read_manifest_unverified(b)
    table = m["runtime"]["cache_table"]
    con = sqlite3.connect(b / "kernels.db")
    src = con.execute(f"SELECT key FROM '{table}' LIMIT 1").fetchone()[0]
    con.execute(f"UPDATE '{table}' SET val = ? WHERE key = ?", (evil_pickle(marker), src))
    con.commit()
    con.close()
    resign(b, key)           # even signed by the key in use: refused, payload not run
    with pytest.raises(HashMismatch, match="only plain bytes"):
        load_verified(b, pub)
    assert not marker.exists()


def test_signed_evil_pickle_is_still_not_executed(tmp_path, test_key):
    """Defence in depth: a compromised build key signs an evil jit.pkl; the runtime's
    allow-list unpickler refuses it before any payload runs."""
    key, pub = test_key
    marker = tmp_path / "PWNED-signed"
    b = copy_bundle(tmp_path / "b")
    (b / "jit.pkl").write_bytes(evil_pickle(marker))
    resign(b, key)
    code = ("import sys, json\n"
            "from supervisor.model import load_verified, ArtifactError\n"
            "from supervisor.model.runtime import load_model\n"
            f"v = load_verified({str(b)!r}, {str(pub)!r})\n"
            "try:\n    load_model(v, exclusive=True)\nexcept ArtifactError as e:\n"
            "    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(UnsafePickle.__name__), out.stdout
    assert "open is outside the allow-list" in out.stdout
    assert not marker.exists()


# ------------------------------------------------------------------ the build tool

def test_modelbuild_refuses_a_key_inside_the_repository(tmp_path):
    out = subprocess.run([sys.executable, "-m", "workers.modelbuild", "--out", str(tmp_path / "o"),
                          "--key", str(ROOT / "models" / "demo" / "oops.key")],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode != 0
    assert "inside the repository" in out.stderr
    assert not (ROOT / "models" / "demo" / "oops.key").exists()


@pytest.mark.skipif(shutil.which("clang") is None, reason="building needs clang")
def test_modelbuild_produces_an_artifact_that_verifies(tmp_path):
    """The build of the two-camera kind (input ABI 3; the one-camera build runs in
    tests/test_replay.py's small demo models): each camera's preprocessing kernels and
    the output bit-identical to numpy preprocessing + the same network on every
    validation frame (the build refuses otherwise), signed, rehearsed in a fresh
    process, and the fit is real."""
    from workers.modeld.engine import ENGINE_ABIS

    out, key = tmp_path / "bundle", tmp_path / "keys" / "build.key"
    env = dict(os.environ)
    for k in ("CACHEDB", "DEV", "PARALLEL"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "workers.modelbuild", "--kind", "lane_wide",
                        "--out", str(out), "--key", str(key), "--seed", "3", "--frames", "160",
                        "--val-frames", "24", "--width", "256", "--height", "160",
                        "--version", "0.0.1-test"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert ("24 validation frames bit-identical to the numpy reference (preprocessed "
            "inputs and output)") in r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["rehearsal"] == {"ok": True, "golden_ok": True, "served": len(summary["kernels"])}
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    pub = Path(summary["pubkey"])
    with load_verified(out, pub, expect_version="0.0.1-test", expect_abi=ENGINE_ABIS) as v:
        assert [i["tensor"]["shape"] for i in v.input_abis] == [[160, 256], [160, 256]]
        assert v.manifest["golden"]["input_bytes"] == 2 * 160 * 256
        assert v.manifest["training"]["seed"] == 3
        assert v.manifest["training"]["val_rmse_offset_m"] < 0.5 * v.manifest["training"]["val_std_offset_m"]
        assert v.key_id == summary["key_id"]
    with pytest.raises(BadSignature):        # not signed by the demo key
        load_verified(out, DEMO_PUB)
