"""Which recorded config a replay may run.

A drive log carries the config it was recorded with (`source.toml`), and a replay runs
that pipeline: every worker, module, `python_path`, network and bind in it. A log is
someone else's input: copied from a colleague, unpacked from an archive, it is owned by
whoever copied it, and a config in it chose the code the replay ran, its network and
where it could write (red team 9 row 4). So a recorded config is run only if

  * this machine recorded it: `record` seals `source.toml` with a key that only this
    user can read (HMAC-SHA256 in `source.toml.seal`; the key in this user's state
    directory, 0600), and the seal verifies; or
  * it is, field for field, a config this installation ships (the embedded one-camera
    pipeline, or the car's default): nothing in it is the log's choice.

Anything else is refused in one line naming what to do: `--config F` replays the frames
through a pipeline the user chose.
"""
from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path
from typing import Any

SEAL = "source.toml.seal"
KEY_BYTES = 32
MAC_BYTES = 32          # HMAC-SHA256


class SealError(Exception):
    """The replay key cannot be made or read (one line)."""


def key_path() -> Path:
    """This user's replay key: $XDG_STATE_HOME (else ~/.local/state)/trio-supervisor."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"),
                                                            ".local", "state")
    return Path(base) / "trio-supervisor" / "replay.key"


def _read_key(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SealError(f"{path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise SealError(f"{path}: not a private file of this user (mode "
                            f"{st.st_mode & 0o777:o}, uid {st.st_uid}): a key others "
                            "could read or replace seals nothing; remove it")
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise SealError(f"{path}: {len(key)} bytes, a replay key has {KEY_BYTES}; remove it")
    return key


def _key(*, create: bool) -> bytes | None:
    path = key_path()
    key = _read_key(path)
    if key is not None or not create:
        return key
    # Written whole under a name of its own, then linked into place: a second first
    # seal at the same moment (two CI jobs, a fleet) never reads a short key (review 6
    # finding 7: "0 bytes, a replay key has 32; remove it", 13-38 rounds in 100).
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)
        except FileExistsError:        # another seal made it meanwhile: theirs
            pass
        finally:
            os.unlink(tmp)
    except OSError as e:
        raise SealError(f"{path}: {e.strerror}") from None
    return _read_key(path)


def seal(data: bytes) -> bytes:
    """The seal `record` writes beside `source.toml` (SealError if no key can be kept)."""
    key = _key(create=True)
    if key is None:
        raise SealError(f"{key_path()}: made, then gone")
    return hmac.new(key, data, hashlib.sha256).digest()


def sealed_here(data: bytes, mac: bytes | None) -> bool:
    """Whether `mac` is this machine's seal of `data`."""
    if mac is None:
        return False
    try:
        key = _key(create=False)
    except SealError:
        return False
    return key is not None and hmac.compare_digest(
        hmac.new(key, data, hashlib.sha256).digest(), mac)


def shipped_as(doc: dict[str, Any]) -> str | None:
    """The name of the config this installation ships that `doc` is, else None."""
    from supervisor.config import DEFAULT_SOURCE, default_doc, minimal_doc

    from .derive import MINIMAL_SOURCE

    for name, make in ((MINIMAL_SOURCE, minimal_doc), (DEFAULT_SOURCE, default_doc)):
        if doc == make():
            return name
    return None


def read_seal(log: str) -> bytes | None:
    """The seal file beside a log's config, if it is one (a regular file of MAC_BYTES)."""
    from .logfmt import open_regular

    try:
        fd = open_regular(os.path.join(log, SEAL))
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP, errno.EINVAL):
            return None
        raise
    with os.fdopen(fd, "rb") as f:
        mac = f.read(MAC_BYTES + 1)
    return mac if len(mac) == MAC_BYTES else None
