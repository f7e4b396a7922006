"""Verified dataset ingress (workers/research/datasets.py) on real-format files built
here: IDX (raw and gzipped) and CIFAR-10 binary tar.gz archives. No network, no mocks."""
from __future__ import annotations

import gzip
import hashlib
import io
import os
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest

from workers.research import datasets as ds
from workers.research.datasets import (BadLabel, BadMagic, CorruptFile, CountMismatch,
                                       DatasetError, HashMismatch, MemberTooLarge,
                                       MissingFile, NotPinned, RecordSizeMismatch,
                                       ShapeMismatch, TooLarge, TrailingData, Truncated,
                                       UnexpectedMember, UnsafeArchive)

N = 24


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def idx_bytes(arr: np.ndarray, magic: int | None = None) -> bytes:
    arr = np.ascontiguousarray(arr, np.uint8)
    magic = (0x0800 | arr.ndim) if magic is None else magic
    return struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in arr.shape) \
        + arr.tobytes()


def gz(b: bytes) -> bytes:
    return gzip.compress(b, mtime=0)


def sample(n: int = N, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    images[0, 0, 0], images[1, 0, 0] = 0, 255            # full pixel range present
    labels = (np.arange(n) % 10).astype(np.uint8)
    return images, labels


def write_mnist(root: Path, split: str = "test", *, compress: bool = True,
                images: np.ndarray | None = None, labels: np.ndarray | None = None,
                img_raw: bytes | None = None, lab_raw: bytes | None = None
                ) -> dict[str, str]:
    """Official file names in ``root``; returns expected_sha256 for load_mnist."""
    root.mkdir(parents=True, exist_ok=True)
    im, lb = sample()
    im = im if images is None else images
    lb = lb if labels is None else labels
    ib = idx_bytes(im) if img_raw is None else img_raw
    lbb = idx_bytes(lb) if lab_raw is None else lab_raw
    pre = "train" if split == "train" else "t10k"
    suffix = ".gz" if compress else ""
    if compress:
        ib, lbb = gz(ib), gz(lbb)
    (root / f"{pre}-images-idx3-ubyte{suffix}").write_bytes(ib)
    (root / f"{pre}-labels-idx1-ubyte{suffix}").write_bytes(lbb)
    return {"images": sha(ib), "labels": sha(lbb)}


# ------------------------------------------------------------------------ IDX: good


@pytest.mark.parametrize("compress", [True, False], ids=["gzip", "raw"])
def test_mnist_loads_with_declared_spec(tmp_path: Path, compress: bool) -> None:
    exp = write_mnist(tmp_path, compress=compress)
    d = ds.load_mnist(tmp_path, "test", expected_sha256=exp, count=N)
    im, lb = sample()
    np.testing.assert_array_equal(d.images, im)
    np.testing.assert_array_equal(d.labels, lb)
    s = d.spec
    assert (s.name, s.layout, s.shape, s.count) == ("mnist/test", "NHW", (N, 28, 28), N)
    assert (s.pixel_dtype, s.pixel_min, s.pixel_max, s.label_dtype) == ("uint8", 0, 255, "uint8")
    assert d.images.dtype == np.uint8 and d.labels.dtype == np.uint8
    assert int(d.images.min()) == 0 and int(d.images.max()) == 255
    assert s.source_sha256 == (exp["images"], exp["labels"])
    assert [Path(x.path).name for x in s.sources][0].startswith("t10k-images")
    assert not d.images.flags.writeable and not d.labels.flags.writeable
    assert len(d) == N


def test_fashion_mnist_and_train_split(tmp_path: Path) -> None:
    exp = write_mnist(tmp_path, "train")
    d = ds.load_fashion_mnist(tmp_path, "train", expected_sha256=exp, count=N)
    assert d.spec.name == "fashion_mnist/train" and d.spec.count == N


def test_gzip_content_detected_not_extension(tmp_path: Path) -> None:
    """A gzipped file under the raw name is still parsed (by its magic bytes)."""
    im, lb = sample()
    ib, lbb = gz(idx_bytes(im)), idx_bytes(lb)
    (tmp_path / "a").write_bytes(ib)
    (tmp_path / "b").write_bytes(lbb)
    d = ds.load_idx_pair(tmp_path / "a", tmp_path / "b", images_sha256=sha(ib),
                         labels_sha256=sha(lbb), count=N)
    np.testing.assert_array_equal(d.images, im)


# ------------------------------------------------------------------------ hashes


def test_pinned_table_is_well_formed() -> None:
    seen = set()
    for dataset, pins in ds.PINS.items():
        for role, pin in pins.items():
            for h in (pin.sha256, pin.raw_sha256):
                if h is not None:
                    assert len(h) == 64 and int(h, 16) >= 0, (dataset, role)
                    assert h not in seen, (dataset, role)
                    seen.add(h)
    assert ds.PINS["cifar10"]["archive"].sha256.startswith("c4a38c50")
    assert ds.PINS["mnist"]["train_images"].sha256.startswith("440fcabf")


def test_official_name_is_checked_against_the_pin(tmp_path: Path) -> None:
    write_mnist(tmp_path)          # official names, but not the official bytes
    with pytest.raises(HashMismatch) as e:
        ds.load_mnist(tmp_path, "test", count=N)
    assert ds.PINS["mnist"]["test_images"].sha256 in str(e.value)
    assert "t10k-images-idx3-ubyte.gz" in str(e.value)


def test_unpinned_raw_fashion_needs_expected_hash(tmp_path: Path) -> None:
    write_mnist(tmp_path, compress=False)
    with pytest.raises(NotPinned, match="no pinned sha256.*expected_sha256"):
        ds.load_fashion_mnist(tmp_path, "test", count=N)


def test_wrong_hash_refused_even_from_the_cache(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv(ds.ENV_CACHE, str(cache))
    exp = write_mnist(cache / "mnist")
    assert ds.load_mnist(split="test", expected_sha256=exp, count=N).spec.count == N  # hit
    # Tamper one byte in place: same size, same mtime. A size+mtime cache check would
    # trust this file; the loader hashes it again and refuses it.
    p = cache / "mnist" / "t10k-labels-idx1-ubyte.gz"
    st = p.stat()
    raw = bytearray(p.read_bytes())
    raw[-9] ^= 0x01                # inside the gzip body
    p.write_bytes(bytes(raw))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (p.stat().st_size, p.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with pytest.raises(HashMismatch, match=r"t10k-labels-idx1-ubyte\.gz has sha256 .*"
                                           r"expected " + exp["labels"]):
        ds.load_mnist(split="test", expected_sha256=exp, count=N)


def test_missing_file_never_downloads(tmp_path: Path) -> None:
    with pytest.raises(MissingFile, match="nothing is downloaded"):
        ds.load_mnist(tmp_path / "empty", "train", count=N)


def test_not_a_regular_file_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(DatasetError, match="not a regular file"):
        ds.load_idx_pair(tmp_path / "fifo", tmp_path / "fifo", images_sha256="0" * 64,
                         labels_sha256="0" * 64)


# ------------------------------------------------------------------------ IDX: refusals


def load_bad(tmp_path: Path, **kw):
    exp = write_mnist(tmp_path, **kw)
    return ds.load_mnist(tmp_path, "test", expected_sha256=exp, count=N)


def test_bad_magic_refused(tmp_path: Path) -> None:
    im, _ = sample()
    with pytest.raises(BadMagic, match="magic 0x00000801, expected 0x00000803"):
        load_bad(tmp_path, img_raw=idx_bytes(im, magic=0x00000801))


def test_labels_file_in_images_place_refused(tmp_path: Path) -> None:
    _, lb = sample()
    with pytest.raises(BadMagic, match="expected 0x00000803"):
        load_bad(tmp_path, compress=False, img_raw=idx_bytes(lb))


def test_non_ubyte_element_type_refused(tmp_path: Path) -> None:
    im, _ = sample()
    with pytest.raises(BadMagic, match="element type byte 0x0d, expected 0x08"):
        load_bad(tmp_path, img_raw=idx_bytes(im, magic=0x00000D03))


@pytest.mark.parametrize("compress", [True, False], ids=["gzip", "raw"])
def test_truncated_payload_refused(tmp_path: Path, compress: bool) -> None:
    im, _ = sample()
    with pytest.raises(Truncated, match=rf"dimensions \({N}, 28, 28\) = {N * 784} data "
                                        rf"bytes, only {N * 784 - 300} present"):
        load_bad(tmp_path, compress=compress, img_raw=idx_bytes(im)[:-300])


def test_truncated_header_refused(tmp_path: Path) -> None:
    with pytest.raises(Truncated, match="only 2 of 12 dimension bytes"):
        load_bad(tmp_path, compress=False, img_raw=struct.pack(">I", 0x803) + b"\0\0")


def test_truncated_gzip_stream_refused(tmp_path: Path) -> None:
    im, _ = sample()
    ib = gz(idx_bytes(im))[:-40]
    (tmp_path / "i").write_bytes(ib)
    _, lb = sample()
    (tmp_path / "l").write_bytes(idx_bytes(lb))
    with pytest.raises(CorruptFile, match="gzip stream is corrupt"):
        ds.load_idx_pair(tmp_path / "i", tmp_path / "l", images_sha256=sha(ib),
                         labels_sha256=sha(idx_bytes(lb)))


def test_trailing_data_refused(tmp_path: Path) -> None:
    _, lb = sample()
    with pytest.raises(TrailingData, match=r"past the 24 bytes that dimensions \(24,\)"):
        load_bad(tmp_path, lab_raw=idx_bytes(lb) + b"\x01")


def test_declared_size_over_cap_refused_before_reading(tmp_path: Path) -> None:
    bomb = struct.pack(">IIII", 0x803, 1 << 31, 28, 28)
    with pytest.raises(TooLarge, match="over the .*-byte cap"):
        load_bad(tmp_path, img_raw=bomb)


def test_image_label_count_mismatch_refused(tmp_path: Path) -> None:
    _, lb = sample()
    with pytest.raises(CountMismatch, match=f"{N} images .* but {N - 1} labels"):
        load_bad(tmp_path, labels=lb[:-1])


def test_expected_count_enforced(tmp_path: Path) -> None:
    exp = write_mnist(tmp_path)
    with pytest.raises(CountMismatch, match=f"{N} samples, the spec expects 10000"):
        ds.load_mnist(tmp_path, "test", expected_sha256=exp)      # official count


def test_image_shape_enforced(tmp_path: Path) -> None:
    with pytest.raises(ShapeMismatch, match="images are 14x28, expected 28x28"):
        load_bad(tmp_path, images=np.zeros((N, 14, 28), np.uint8))


def test_label_out_of_range_refused(tmp_path: Path) -> None:
    _, lb = sample()
    lb = lb.copy()
    lb[7] = 10
    with pytest.raises(BadLabel, match=r"label 10 at index 7 is outside 0\.\.9"):
        load_bad(tmp_path, labels=lb)


# ------------------------------------------------------------------------ CIFAR-10

R = 12          # records per batch in the test spec
DIR = "cifar-10-batches-bin"


def cifar_batch(seed: int, n: int = R, label: int | None = None) -> bytes:
    rng = np.random.default_rng(seed)
    rec = rng.integers(0, 256, (n, 3073), dtype=np.uint8)
    rec[:, 0] = (np.arange(n) + seed) % 10 if label is None else label
    return rec.tobytes()


def standard_members() -> dict[str, bytes]:
    m = {f"{DIR}/data_batch_{i}.bin": cifar_batch(i) for i in range(1, 6)}
    m[f"{DIR}/test_batch.bin"] = cifar_batch(6)
    m[f"{DIR}/batches.meta.txt"] = b"airplane\nautomobile\nbird\n"
    return m


def make_tar(path: Path, members: dict[str, bytes], *, special: list[tarfile.TarInfo] = (),
             with_dir: bool = True) -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        if with_dir:
            d = tarfile.TarInfo(DIR)
            d.type, d.mode = tarfile.DIRTYPE, 0o755
            tf.addfile(d)
        for ti in special:
            tf.addfile(ti, io.BytesIO(b"x" * ti.size) if ti.isreg() else None)
        for name, body in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(body)
            tf.addfile(ti, io.BytesIO(body))
    data = buf.getvalue()
    path.write_bytes(data)
    return sha(data)


def test_cifar_loads_with_declared_spec(tmp_path: Path) -> None:
    members = standard_members()
    h = make_tar(tmp_path / "cifar-10-binary.tar.gz", members)
    c = ds.load_cifar10(tmp_path, expected_sha256=h, records_per_batch=R)  # dir form
    assert c.train.images.shape == (5 * R, 3, 32, 32) and c.test.images.shape == (R, 3, 32, 32)
    assert c.train.spec.layout == "NCHW" and c.train.spec.channels == "RGB"
    assert (c.train.spec.count, c.test.spec.count) == (5 * R, R)
    assert c.train.spec.source_sha256 == (h,) and c.archive.sha256 == h
    assert c.train.labels.dtype == np.uint8 and c.train.spec.label_dtype == "uint8"
    assert c.train.spec.pixel_min == 0 and c.train.spec.pixel_max == 255
    # Record layout: label byte, then 1024 R, 1024 G, 1024 B bytes, row-major.
    rec = np.frombuffer(members[f"{DIR}/data_batch_2.bin"], np.uint8).reshape(R, 3073)
    np.testing.assert_array_equal(c.train.labels[R:2 * R], rec[:, 0])
    np.testing.assert_array_equal(c.train.images[R + 3, 1, 5, 7], rec[3, 1 + 1024 + 5 * 32 + 7])
    trec = np.frombuffer(members[f"{DIR}/test_batch.bin"], np.uint8).reshape(R, 3073)
    np.testing.assert_array_equal(c.test.images.reshape(R, -1), trec[:, 1:])
    assert not c.train.images.flags.writeable


def test_cifar_wrong_hash_and_default_pin(tmp_path: Path) -> None:
    p = tmp_path / "cifar-10-binary.tar.gz"
    make_tar(p, standard_members())
    with pytest.raises(HashMismatch, match=ds.PINS["cifar10"]["archive"].sha256):
        ds.load_cifar10(p, records_per_batch=R)
    with pytest.raises(HashMismatch):
        ds.load_cifar10(p, expected_sha256="ab" * 32, records_per_batch=R)


def cifar_refused(tmp_path: Path, members: dict[str, bytes], special=(), **kw):
    p = tmp_path / "c.tar.gz"
    h = make_tar(p, members, special=list(special))
    return ds.load_cifar10(p, expected_sha256=h, records_per_batch=R, **kw)


def reg(name: str, size: int = 4) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    return ti


def test_tar_traversal_member_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsafeArchive, match=r"'\.\./evil' has a '\.\.' path component"):
        cifar_refused(tmp_path, standard_members(), [reg("../evil")])


def test_tar_absolute_member_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsafeArchive, match="'/etc/evil' has an absolute path"):
        cifar_refused(tmp_path, standard_members(), [reg("/etc/evil")])


def test_tar_symlink_member_refused(tmp_path: Path) -> None:
    ti = tarfile.TarInfo(f"{DIR}/data_batch_1.bin")
    ti.type, ti.linkname = tarfile.SYMTYPE, "/etc/passwd"
    members = standard_members()
    del members[f"{DIR}/data_batch_1.bin"]
    with pytest.raises(UnsafeArchive, match="is a symbolic link \\(to '/etc/passwd'\\)"):
        cifar_refused(tmp_path, members, [ti])


def test_tar_hardlink_and_device_refused(tmp_path: Path) -> None:
    ti = tarfile.TarInfo(f"{DIR}/test_batch.bin")
    ti.type, ti.linkname = tarfile.LNKTYPE, f"{DIR}/data_batch_1.bin"
    (tmp_path / "a").mkdir()
    with pytest.raises(UnsafeArchive, match="is a hard link"):
        cifar_refused(tmp_path / "a", standard_members(), [ti])
    dev = tarfile.TarInfo(f"{DIR}/null")
    dev.type, dev.devmajor, dev.devminor = tarfile.CHRTYPE, 1, 3
    with pytest.raises(UnsafeArchive, match="is a device node"):
        cifar_refused(tmp_path, standard_members(), [dev])


def test_tar_oversize_member_refused_before_reading(tmp_path: Path) -> None:
    members = standard_members()
    members[f"{DIR}/data_batch_3.bin"] = cifar_batch(3, n=R + 1)
    with pytest.raises(MemberTooLarge, match=rf"data_batch_3\.bin' is {(R + 1) * 3073} "
                                             rf"bytes, over its {R * 3073}-byte cap"):
        cifar_refused(tmp_path, members)


def test_tar_unexpected_member_refused(tmp_path: Path) -> None:
    members = standard_members()
    members[f"{DIR}/evil.py"] = b"import os\n"
    with pytest.raises(UnexpectedMember, match=r"unexpected member 'cifar-10-batches-bin/"
                                               r"evil\.py'"):
        cifar_refused(tmp_path, members)


def test_tar_duplicate_member_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsafeArchive, match="appears twice"):
        cifar_refused(tmp_path, standard_members(),
                      [reg(f"{DIR}/test_batch.bin", R * 3073)])


def test_cifar_record_size_mismatch_refused(tmp_path: Path) -> None:
    members = standard_members()
    members[f"{DIR}/data_batch_4.bin"] = cifar_batch(4)[:-100]
    with pytest.raises(RecordSizeMismatch, match="not a whole number of 3073-byte records"):
        cifar_refused(tmp_path, members)


def test_cifar_record_count_mismatch_refused(tmp_path: Path) -> None:
    members = standard_members()
    members[f"{DIR}/test_batch.bin"] = cifar_batch(6, n=R - 2)
    with pytest.raises(CountMismatch, match=f"test_batch.bin holds {R - 2} records, the "
                                            f"spec expects {R}"):
        cifar_refused(tmp_path, members)


def test_cifar_missing_batch_refused(tmp_path: Path) -> None:
    members = standard_members()
    del members[f"{DIR}/data_batch_5.bin"]
    with pytest.raises(MissingFile, match=r"missing cifar-10-batches-bin/data_batch_5\.bin"):
        cifar_refused(tmp_path, members)


def test_cifar_label_out_of_range_refused(tmp_path: Path) -> None:
    members = standard_members()
    members[f"{DIR}/data_batch_1.bin"] = cifar_batch(1, label=11)
    with pytest.raises(BadLabel, match=r"data_batch_1\.bin: label 11 at index 0"):
        cifar_refused(tmp_path, members)


def test_not_a_tar_refused(tmp_path: Path) -> None:
    p = tmp_path / "c.tar.gz"
    p.write_bytes(gz(b"hello" * 100))
    with pytest.raises(CorruptFile, match="not a readable tar archive"):
        ds.load_cifar10(p, expected_sha256=sha(p.read_bytes()), records_per_batch=R)


def test_datasets_module_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, workers.research.datasets; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
