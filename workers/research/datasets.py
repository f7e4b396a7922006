"""Verified dataset ingress for the research domain: MNIST / Fashion-MNIST (IDX) and
CIFAR-10 (binary version), from a LOCAL directory or cache only. Nothing here downloads.

Unlike tinygrad's ``nn.datasets`` (which fetches over the network and slices fixed byte
offsets without looking at the bytes), every load here:

* reads each source file ONCE into private memory, hashes exactly those bytes with
  sha256 and compares with a pinned (or explicitly passed) digest, then parses the same
  bytes: no time-of-check/time-of-use gap, and no trust in a cache hit (no size/mtime
  shortcut, no memo: the hash is computed on every load);
* checks IDX magic numbers (``0x00000803`` images, ``0x00000801`` labels, element type
  byte ``0x08`` = uint8), that the declared dimensions match the bytes actually present
  (truncated or trailing data are refused), the image shape, image/label count
  agreement and the expected sample count, and that every label is in ``0..9``;
* opens CIFAR-10's ``.tar.gz`` as a stream and reads only whitelisted regular-file
  members, each with a size cap checked before its data is read: symlinks, hard links,
  devices, FIFOs, sparse files, absolute paths, ``..``, duplicates and unexpected
  members are refused (``tarfile.extractall`` is never used; nothing touches the disk);
  then checks record size (3073 bytes), record and batch counts (5 train + 1 test) and
  labels;
* returns read-only numpy arrays with a `DatasetSpec` declaring pixel range and dtype,
  channel layout (``NHW`` for MNIST, ``NCHW`` RGB for CIFAR), label dtype, sample count
  and the sha256 of every source file.

Every refusal is a `DatasetError` subclass with a message naming the file and the fault.

Pinned digests (`PINS`): the sha256 of the archives as distributed. The dataset authors
publish MD5 only (CIFAR-10, Fashion-MNIST) or nothing (MNIST); the sha256 values below
are the ones independently recorded by many projects (TensorFlow Datasets mirror files,
torchvision-equivalent loaders, published checksum tables), cross-checked against each
other and, where published, against the authors' MD5 (kept in `Pin.md5` for reference).
A file with no pin (e.g. an uncompressed Fashion-MNIST file) needs ``expected_sha256``.
"""
from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np

# ----------------------------------------------------------------------------- errors


class DatasetError(Exception):
    """Base of every refusal of dataset ingress."""


class MissingFile(DatasetError):
    """A required file or archive member is absent."""


class NotPinned(DatasetError):
    """No pinned sha256 and none passed: an unverifiable file is never used."""


class HashMismatch(DatasetError):
    """The bytes read do not have the expected sha256."""


class BadMagic(DatasetError):
    """An IDX header has the wrong magic number, element type or dimension count."""


class SizeMismatch(DatasetError):
    """The bytes present disagree with the size the header or spec declares."""


class Truncated(SizeMismatch):
    """Fewer bytes than declared."""


class TrailingData(SizeMismatch):
    """More bytes than declared."""


class RecordSizeMismatch(SizeMismatch):
    """A CIFAR batch is not a whole number of 3073-byte records."""


class CountMismatch(DatasetError):
    """Sample counts disagree (images vs labels, or vs the expected count)."""


class ShapeMismatch(DatasetError):
    """Image dimensions differ from the expected ones."""


class BadLabel(DatasetError):
    """A label is outside ``0..num_classes-1``."""


class CorruptFile(DatasetError):
    """The file could not be decompressed or parsed at all."""


class TooLarge(DatasetError):
    """A file or declared payload exceeds its size cap."""


class UnsafeArchive(DatasetError):
    """A tar member that must never be read: link, device, traversal, oversize..."""


class UnexpectedMember(UnsafeArchive):
    """A tar member not on the whitelist."""


class MemberTooLarge(UnsafeArchive):
    """A whitelisted tar member larger than its cap."""


# ----------------------------------------------------------------------------- pins


@dataclass(frozen=True)
class Pin:
    """The published identity of one distributed file."""

    filename: str
    size: int
    sha256: str
    md5: str | None = None            # authors' published MD5, for reference only
    raw_sha256: str | None = None     # sha256 of the decompressed file (gz only)
    raw_size: int | None = None


# Official file names, sizes and sha256 of the archives as distributed.
PINS: dict[str, dict[str, Pin]] = {
    "mnist": {
        "train_images": Pin("train-images-idx3-ubyte.gz", 9_912_422,
                            "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
                            "f68b3c2dcbeaaa9fbdd348bbdeb94873",
                            "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
                            47_040_016),
        "train_labels": Pin("train-labels-idx1-ubyte.gz", 28_881,
                            "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
                            "d53e105ee54ea40749a09fcbcd1e9432",
                            "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
                            60_008),
        "test_images": Pin("t10k-images-idx3-ubyte.gz", 1_648_877,
                           "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
                           "9fb629c4189551a2d022fa330f9573f3",
                           "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
                           7_840_016),
        "test_labels": Pin("t10k-labels-idx1-ubyte.gz", 4_542,
                           "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
                           "ec29112dd5afa0611ce80d1b7f02629c",
                           "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
                           10_008),
    },
    # Uncompressed Fashion-MNIST digests: fill in (not pinned here; pass expected_sha256).
    "fashion_mnist": {
        "train_images": Pin("train-images-idx3-ubyte.gz", 26_421_880,
                            "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
                            "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
        "train_labels": Pin("train-labels-idx1-ubyte.gz", 29_515,
                            "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
                            "25c81989df183df01b3e8a0aad5dffbe"),
        "test_images": Pin("t10k-images-idx3-ubyte.gz", 4_422_102,
                           "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
                           "bef4ecab320f06d8554ea6380940ec79"),
        "test_labels": Pin("t10k-labels-idx1-ubyte.gz", 5_148,
                           "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
                           "bb300cfdad3c16e7a12a480ee83cd310"),
    },
    "cifar10": {
        "archive": Pin("cifar-10-binary.tar.gz", 170_052_171,
                       "c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd",
                       "c32a1d4ab5d03f1284b67883e8d87530"),
    },
}

MNIST_COUNTS = {"train": 60_000, "test": 10_000}
CIFAR_RECORDS_PER_BATCH = 10_000
CIFAR_RECORD = 1 + 3 * 32 * 32          # 3073: label byte + R, G, B planes of 32x32
CIFAR_DIR = "cifar-10-batches-bin"
CIFAR_TRAIN = tuple(f"{CIFAR_DIR}/data_batch_{i}.bin" for i in range(1, 6))
CIFAR_TEST = (f"{CIFAR_DIR}/test_batch.bin",)
# Present in the real archive, allowed (small, capped) but never parsed.
CIFAR_EXTRA = {f"{CIFAR_DIR}/batches.meta.txt": 4096, f"{CIFAR_DIR}/readme.html": 4096}

IDX_IMAGES_MAGIC = 0x00000803
IDX_LABELS_MAGIC = 0x00000801
IDX_UBYTE = 0x08

DEFAULT_MAX_FILE_BYTES = 512 << 20      # any single source file read into memory
ENV_CACHE = "TRIO_DATASETS"


def default_cache_dir() -> Path:
    """``$TRIO_DATASETS``, else ``~/.cache/trio/datasets``. Only ever read from."""
    env = os.environ.get(ENV_CACHE)
    return Path(env) if env else Path.home() / ".cache" / "trio" / "datasets"


# ----------------------------------------------------------------------------- specs


@dataclass(frozen=True)
class SourceFile:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class DatasetSpec:
    """What a loaded split is, declared rather than implied."""

    name: str                       # e.g. "mnist/train"
    layout: str                     # "NHW" (MNIST) or "NCHW" (CIFAR, RGB planes)
    shape: tuple[int, ...]          # shape of `images`
    count: int                      # samples (== shape[0] == len(labels))
    pixel_dtype: str = "uint8"
    pixel_min: int = 0
    pixel_max: int = 255
    channels: str = "gray"          # "gray" or "RGB"
    label_dtype: str = "uint8"
    num_classes: int = 10
    sources: tuple[SourceFile, ...] = ()

    @property
    def source_sha256(self) -> tuple[str, ...]:
        return tuple(s.sha256 for s in self.sources)


@dataclass(frozen=True)
class Dataset:
    images: np.ndarray              # read-only, spec.pixel_dtype, spec.layout
    labels: np.ndarray              # read-only, spec.label_dtype, (count,)
    spec: DatasetSpec

    def __len__(self) -> int:
        return self.spec.count


@dataclass(frozen=True)
class CifarSplits:
    train: Dataset
    test: Dataset
    archive: SourceFile
    members: tuple[str, ...] = field(default=())


# ----------------------------------------------------------------------------- hashing


def _read_verified(path: Path, expected_sha256: str, *, what: str,
                   max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> tuple[bytes, SourceFile]:
    """Read ``path`` once into memory and check its sha256; the returned bytes are the
    ones hashed (parse these, never the file again)."""
    expected = _norm_hex(expected_sha256, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise MissingFile(f"{what}: {path} does not exist (nothing is downloaded; put the "
                          f"file there yourself)") from None
    except OSError as e:
        raise MissingFile(f"{what}: cannot open {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DatasetError(f"{what}: {path} is not a regular file")
        if st.st_size > max_bytes:
            raise TooLarge(f"{what}: {path} is {st.st_size} bytes, over the "
                           f"{max_bytes}-byte cap")
        chunks, total = [], 0
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            while chunk := f.read(1 << 20):
                total += len(chunk)
                if total > max_bytes:
                    raise TooLarge(f"{what}: {path} grew past the {max_bytes}-byte cap "
                                   f"while being read")
                chunks.append(chunk)
        data = b"".join(chunks)
    finally:
        if fd >= 0:
            os.close(fd)
    got = hashlib.sha256(data).hexdigest()
    if got != expected:
        raise HashMismatch(f"{what}: {path} has sha256 {got}, expected {expected} "
                           f"({len(data)} bytes); refusing it (a cached copy is re-hashed on "
                           f"every load and never trusted)")
    return data, SourceFile(str(path), len(data), got)


def _norm_hex(h: str, what: str) -> str:
    h = str(h).strip().lower()
    if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
        raise DatasetError(f"{what}: expected_sha256 {h!r} is not a 64-digit hex sha256")
    return h


# ----------------------------------------------------------------------------- IDX


def _is_gzip(data: bytes) -> bool:
    return data[:2] == b"\x1f\x8b"


def parse_idx(data: bytes, *, kind: str, what: str = "IDX file",
              max_payload: int = DEFAULT_MAX_FILE_BYTES) -> np.ndarray:
    """Parse IDX bytes (raw or gzip). ``kind`` is "images" (3 dims) or "labels" (1 dim).

    The gzip stream is decompressed only as far as the header declares (+1 byte to
    detect trailing data), so a decompression bomb costs at most ``max_payload``."""
    if kind not in ("images", "labels"):
        raise ValueError(f"kind must be 'images' or 'labels', not {kind!r}")
    want_magic = IDX_IMAGES_MAGIC if kind == "images" else IDX_LABELS_MAGIC
    ndim_want = want_magic & 0xFF
    stream = gzip.GzipFile(fileobj=io.BytesIO(data)) if _is_gzip(data) else io.BytesIO(data)
    try:
        head = stream.read(4)
        if len(head) < 4:
            raise Truncated(f"{what}: {len(head)} bytes, too short for an IDX header")
        magic = int.from_bytes(head, "big")
        if head[:2] != b"\0\0" or head[3] != ndim_want:
            raise BadMagic(f"{what}: magic 0x{magic:08x}, expected 0x{want_magic:08x} "
                           f"(IDX {kind}: {ndim_want} dimension{'s' * (ndim_want > 1)})")
        if head[2] != IDX_UBYTE:
            raise BadMagic(f"{what}: element type byte 0x{head[2]:02x}, expected 0x08 "
                           f"(unsigned byte); magic 0x{magic:08x}")
        raw_dims = stream.read(4 * ndim_want)
        if len(raw_dims) < 4 * ndim_want:
            raise Truncated(f"{what}: header declares {ndim_want} dimensions but only "
                            f"{len(raw_dims)} of {4 * ndim_want} dimension bytes are present")
        dims = tuple(int.from_bytes(raw_dims[i:i + 4], "big") for i in range(0, len(raw_dims), 4))
        if any(d == 0 for d in dims):
            raise CountMismatch(f"{what}: declared dimensions {dims} contain a zero")
        declared = int(np.prod(dims, dtype=np.int64))
        if declared > max_payload:
            raise TooLarge(f"{what}: declared dimensions {dims} mean {declared} bytes, over "
                           f"the {max_payload}-byte cap")
        payload = stream.read(declared + 1)
    except (OSError, EOFError, zlib.error) as e:   # gzip.BadGzipFile is an OSError
        raise CorruptFile(f"{what}: gzip stream is corrupt: {e}") from None
    if len(payload) < declared:
        raise Truncated(f"{what}: header declares dimensions {dims} = {declared} data "
                        f"bytes, only {len(payload)} present")
    if len(payload) > declared:
        raise TrailingData(f"{what}: data continues past the {declared} bytes that "
                           f"dimensions {dims} declare")
    arr = np.frombuffer(payload, np.uint8, count=declared).reshape(dims)
    return arr


def _check_labels(labels: np.ndarray, num_classes: int, what: str) -> None:
    bad = np.flatnonzero(labels >= num_classes)
    if bad.size:
        i = int(bad[0])
        raise BadLabel(f"{what}: label {int(labels[i])} at index {i} is outside "
                       f"0..{num_classes - 1} ({bad.size} bad label{'s' * (bad.size > 1)})")


def _find(root: Path, pin: Pin | None, filename: str) -> tuple[Path, bool]:
    """The file for a role: the archive as distributed (``.gz``) or, failing that, its
    uncompressed form. Returns (path, is_raw_name)."""
    gz = root / filename
    if gz.exists():
        return gz, False
    raw = root / filename.removesuffix(".gz")
    if raw.exists():
        return raw, True
    raise MissingFile(f"neither {gz} nor {raw} exists (nothing is downloaded: put the "
                      f"{'official ' if pin else ''}file in {root})")


def _expected_for(role: str, pin: Pin | None, is_raw: bool, data_name: str,
                  override: Mapping[str, str] | None) -> str:
    if override and role in override:
        return override[role]
    digest = (pin.raw_sha256 if is_raw else pin.sha256) if pin else None
    if digest is None:
        raise NotPinned(f"{data_name} {role}: no pinned sha256 for this "
                        f"{'uncompressed ' if is_raw else ''}file; pass expected_sha256="
                        f"{{'{role.split('_')[-1]}': ...}}")
    return digest


def load_idx_pair(images_path: str | os.PathLike, labels_path: str | os.PathLike, *,
                  images_sha256: str, labels_sha256: str, count: int | None = None,
                  image_shape: tuple[int, int] = (28, 28), num_classes: int = 10,
                  name: str = "idx", max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> Dataset:
    """Load one IDX images file and one IDX labels file, each verified against its sha256."""
    ipath, lpath = Path(images_path), Path(labels_path)
    idata, isrc = _read_verified(ipath, images_sha256, what=f"{name} images",
                                 max_bytes=max_file_bytes)
    ldata, lsrc = _read_verified(lpath, labels_sha256, what=f"{name} labels",
                                 max_bytes=max_file_bytes)
    images = parse_idx(idata, kind="images", what=f"{name} images ({ipath.name})",
                       max_payload=max_file_bytes)
    labels = parse_idx(ldata, kind="labels", what=f"{name} labels ({lpath.name})",
                       max_payload=max_file_bytes)
    if images.shape[1:] != tuple(image_shape):
        raise ShapeMismatch(f"{name} images ({ipath.name}): images are "
                            f"{images.shape[1]}x{images.shape[2]}, expected "
                            f"{image_shape[0]}x{image_shape[1]}")
    if images.shape[0] != labels.shape[0]:
        raise CountMismatch(f"{name}: {images.shape[0]} images ({ipath.name}) but "
                            f"{labels.shape[0]} labels ({lpath.name})")
    if count is not None and images.shape[0] != count:
        raise CountMismatch(f"{name}: {images.shape[0]} samples, the spec expects {count}")
    _check_labels(labels, num_classes, f"{name} labels ({lpath.name})")
    images.flags.writeable = False
    labels.flags.writeable = False
    spec = DatasetSpec(name=name, layout="NHW", shape=tuple(images.shape),
                       count=int(images.shape[0]), channels="gray", num_classes=num_classes,
                       sources=(isrc, lsrc))
    return Dataset(images, labels, spec)


def load_mnist(root: str | os.PathLike | None = None, split: str = "train", *,
               fashion: bool = False, expected_sha256: Mapping[str, str] | None = None,
               count: int | None = None) -> Dataset:
    """MNIST (or Fashion-MNIST) ``split`` from ``root`` (default: `default_cache_dir()` /
    ``mnist`` or ``fashion_mnist``). Looks for the official file names, gzipped as
    distributed or uncompressed. ``expected_sha256`` = ``{"images": hex, "labels": hex}``
    overrides the pins (required for files with no pin); ``count`` overrides the official
    sample count (60000 train / 10000 test)."""
    if split not in MNIST_COUNTS:
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    key = "fashion_mnist" if fashion else "mnist"
    root = Path(root) if root is not None else default_cache_dir() / key
    pins = PINS[key]
    override = {f"{split}_{k}": v for k, v in (expected_sha256 or {}).items()}
    paths, digests = {}, {}
    for kind in ("images", "labels"):
        role = f"{split}_{kind}"
        pin = pins.get(role)
        filename = pin.filename if pin else _default_name(split, kind)
        path, is_raw = _find(root, pin, filename)
        paths[kind] = path
        digests[kind] = _expected_for(role, pin, is_raw, key, override)
    return load_idx_pair(paths["images"], paths["labels"], images_sha256=digests["images"],
                         labels_sha256=digests["labels"],
                         count=MNIST_COUNTS[split] if count is None else count,
                         name=f"{key}/{split}")


def load_fashion_mnist(root: str | os.PathLike | None = None, split: str = "train",
                       **kw) -> Dataset:
    return load_mnist(root, split, fashion=True, **kw)


def _default_name(split: str, kind: str) -> str:
    prefix = "train" if split == "train" else "t10k"
    return f"{prefix}-{kind}-idx{3 if kind == 'images' else 1}-ubyte.gz"


# ----------------------------------------------------------------------------- CIFAR-10


def _member_problem(m: tarfile.TarInfo) -> str | None:
    if m.issym():
        return f"is a symbolic link (to {m.linkname!r})"
    if m.islnk():
        return f"is a hard link (to {m.linkname!r})"
    if m.ischr() or m.isblk():
        return "is a device node"
    if m.isfifo():
        return "is a FIFO"
    if m.issparse():
        return "is a sparse file"
    if not (m.isreg() or m.isdir()):
        return f"has tar type {m.type!r}, not a regular file"
    name = m.name
    if name.startswith("/") or name.startswith("\\") or (len(name) > 1 and name[1] == ":"):
        return "has an absolute path"
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if ".." in parts:
        return "has a '..' path component (path traversal)"
    if "\0" in name:
        return "has a NUL byte in its name"
    return None


def read_tar_members(data: bytes, allowed: Mapping[str, int], *, what: str,
                     allowed_dirs: tuple[str, ...] = (), max_members: int = 64
                     ) -> dict[str, bytes]:
    """Read whitelisted regular members of a (gzipped) tar held in memory.

    ``allowed`` maps member name -> size cap in bytes. Any member that is not a regular
    file or whitelisted directory, or whose name is absolute or has ``..``, or that is
    not whitelisted, or is larger than its cap, or is repeated, raises `UnsafeArchive`
    before any of its data is read. Nothing is extracted to disk."""
    out: dict[str, bytes] = {}
    seen: set[str] = set()
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as tf:
            for n, m in enumerate(tf):
                if n >= max_members:
                    raise UnsafeArchive(f"{what}: more than {max_members} members")
                problem = _member_problem(m)
                if problem:
                    raise UnsafeArchive(f"{what}: member {m.name!r} {problem}; refused")
                name = m.name.rstrip("/") if m.isdir() else m.name
                if name in seen:
                    raise UnsafeArchive(f"{what}: member {name!r} appears twice; refused")
                seen.add(name)
                if m.isdir():
                    if name not in allowed_dirs:
                        raise UnexpectedMember(f"{what}: unexpected directory {name!r}; "
                                               f"refused")
                    continue
                if name not in allowed:
                    raise UnexpectedMember(f"{what}: unexpected member {name!r} "
                                           f"({m.size} bytes); only {sorted(allowed)} are "
                                           f"allowed")
                cap = allowed[name]
                if m.size > cap:
                    raise MemberTooLarge(f"{what}: member {name!r} is {m.size} bytes, over "
                                         f"its {cap}-byte cap; refused")
                f = tf.extractfile(m)
                body = f.read(cap + 1) if f is not None else b""
                if len(body) != m.size:
                    raise Truncated(f"{what}: member {name!r} declares {m.size} bytes, "
                                    f"{len(body)} read")
                out[name] = body
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise CorruptFile(f"{what}: not a readable tar archive: {e}") from None
    return out


def _cifar_split(blobs: dict[str, bytes], members: tuple[str, ...], records: int,
                 name: str, sources: tuple[SourceFile, ...], num_classes: int = 10
                 ) -> Dataset:
    """Check and unpack ``members`` (popped from ``blobs`` to keep the peak down)."""
    total = records * len(members)
    images = np.empty((total, 3, 32, 32), np.uint8)
    labels = np.empty(total, np.uint8)
    for k, member in enumerate(members):
        body = blobs.pop(member)
        if len(body) % CIFAR_RECORD:
            raise RecordSizeMismatch(f"{name}: {member} is {len(body)} bytes, not a whole "
                                     f"number of {CIFAR_RECORD}-byte records "
                                     f"({len(body) % CIFAR_RECORD} bytes left over)")
        n = len(body) // CIFAR_RECORD
        if n != records:
            raise CountMismatch(f"{name}: {member} holds {n} records, the spec expects "
                                f"{records}")
        rec = np.frombuffer(body, np.uint8).reshape(n, CIFAR_RECORD)
        _check_labels(rec[:, 0], num_classes, f"{name}: {member}")
        labels[k * records:(k + 1) * records] = rec[:, 0]
        images[k * records:(k + 1) * records] = rec[:, 1:].reshape(n, 3, 32, 32)
    images.flags.writeable = False
    labels.flags.writeable = False
    spec = DatasetSpec(name=name, layout="NCHW", shape=tuple(images.shape), count=total,
                       channels="RGB", num_classes=num_classes, sources=sources)
    return Dataset(images, labels, spec)


def load_cifar10(path: str | os.PathLike | None = None, *,
                 expected_sha256: str | None = None,
                 records_per_batch: int = CIFAR_RECORDS_PER_BATCH,
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> CifarSplits:
    """CIFAR-10 from the binary-version archive ``cifar-10-binary.tar.gz`` (a path to the
    archive, or a directory holding it; default `default_cache_dir()` / ``cifar10``).

    The archive's sha256 must equal ``expected_sha256`` (default: the pin). Then exactly
    5 train batches and 1 test batch of ``records_per_batch`` 3073-byte records each are
    read from memory; train is (5*records, 3, 32, 32), test (records, 3, 32, 32)."""
    pin = PINS["cifar10"]["archive"]
    p = Path(path) if path is not None else default_cache_dir() / "cifar10"
    if p.is_dir():
        p = p / pin.filename
    data, src = _read_verified(p, expected_sha256 or pin.sha256, what="cifar10 archive",
                               max_bytes=max_file_bytes)
    batch = records_per_batch * CIFAR_RECORD
    allowed = {m: batch for m in (*CIFAR_TRAIN, *CIFAR_TEST)} | CIFAR_EXTRA
    blobs = read_tar_members(data, allowed, what=f"cifar10 archive {p.name}",
                             allowed_dirs=(CIFAR_DIR,))
    missing = [m for m in (*CIFAR_TRAIN, *CIFAR_TEST) if m not in blobs]
    if missing:
        raise MissingFile(f"cifar10 archive {p.name}: missing {', '.join(missing)} (expect "
                          f"{len(CIFAR_TRAIN)} train batches + {len(CIFAR_TEST)} test batch)")
    names = tuple(sorted(blobs))
    del data
    train = _cifar_split(blobs, CIFAR_TRAIN, records_per_batch, "cifar10/train", (src,))
    test = _cifar_split(blobs, CIFAR_TEST, records_per_batch, "cifar10/test", (src,))
    return CifarSplits(train, test, src, names)


__all__ = [
    "BadLabel", "BadMagic", "CifarSplits", "CorruptFile", "CountMismatch", "Dataset",
    "DatasetError", "DatasetSpec", "HashMismatch", "MemberTooLarge", "MissingFile",
    "NotPinned", "PINS", "Pin", "RecordSizeMismatch", "ShapeMismatch", "SizeMismatch",
    "SourceFile", "TooLarge", "TrailingData", "Truncated", "UnexpectedMember",
    "UnsafeArchive", "default_cache_dir", "load_cifar10", "load_fashion_mnist",
    "load_idx_pair", "load_mnist", "parse_idx", "read_tar_members",
]
