"""The fail-safe's two promises: a safe last word on every actuation channel, and a
latch that only an operator clears.

Last word: when the control domain fails safe, every control process is killed first
(nothing of it can publish any more), then the supervisor itself publishes the
channel payload's safe value (schemas/payloads.py, e.g. control_cmd engaged=0, reason
FAIL_SAFE) as the channel's writer of last resort. One writer at a time still holds:
the worker that owned the channel is dead when the supervisor writes. When one
actuation writer dies on its own (a crash a standby or a restart may cover), its last
word is the payload's ``lost`` value instead (control_cmd reason WRITER_LOST), and after
the supervisor stopped it, its ``stopped`` value (SHUTDOWN): as safe, but never to be
read as the domain failed safe.

Latch: a small JSON file in the state directory. While it exists `supervisor run`
starts nothing and exits 4; `supervisor clear-fail-safe` removes it. The generated
unit does not restart on exit 4 (RestartPreventExitStatus=4).

Only a vehicle-mode run reads or writes the vehicle's latch (TRIO_STATE_DIR, else the
config's state_dir). A simulation-mode run (replay, record of a clip, any
`mode = "simulation"` config) latches in a directory of its own, made for that run
when it first latches, so a simulation that fails safe stops only itself (issue 22: a
failed record under load latched the car, and every `supervisor run` after it exited 4).
"""
from __future__ import annotations

import errno
import json
import mmap
import os
import secrets
import stat
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from supervisor.ipc import Channel, Writer

LATCH_NAME = "failsafe.latch"
# Written at a vehicle run's start: the blocks a latch needs, already allocated. A state
# dir on a full file system (the recorder's logs, anything sharing it) could not take
# the latch's text when it mattered (ENOSPC: no latch, the next start ran as if nothing
# had happened; red team 8 row 8); the reserve is overwritten in place and renamed.
RESERVE_NAME = LATCH_NAME + ".reserve"
LATCH_BYTES = 4096         # a latch's text is at most this (the reason is cut to fit)
# The vehicle's state directory (config/_model.py SupervisorConfig.state_dir's default):
# a simulation run never latches in it, whatever its config or environment says.
VEHICLE_STATE_DIR = "/var/lib/trio-supervisor"


@dataclass
class FailSafeLatch:
    path: Path
    # Simulation: `path` is inside a directory made for this run (see per_run) by the
    # first set(); until then nothing exists and read() finds no latch.
    per_run_base: Path | None = None

    @classmethod
    def for_config(cls, config) -> FailSafeLatch:
        from supervisor.protocol import SIMULATION

        base = os.environ.get("TRIO_STATE_DIR") or config.supervisor.state_dir
        if getattr(config.supervisor, "mode", None) == SIMULATION:
            return cls.per_run(base)
        return cls(Path(base) / LATCH_NAME)

    @classmethod
    def per_run(cls, base: str | os.PathLike) -> FailSafeLatch:
        """A simulation run's latch: below `base` (where the state dir is, when that is
        not the vehicle's; else the system's temporary directory), in a directory no
        other run has. The name is fixed here, the directory made only by set()."""
        root = Path(base)
        if root.resolve() == Path(VEHICLE_STATE_DIR).resolve():
            root = Path(tempfile.gettempdir())
        run_dir = root / f"simulation-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-" \
                         f"{secrets.token_hex(4)}"
        return cls(run_dir / LATCH_NAME, per_run_base=root)

    def read(self) -> dict | None:
        """The latch, or None when there is none. Anything at its name that is not a
        readable latch (a symlink, a FIFO, garbage, an empty file) is a latch too."""
        try:
            with _dir_fd(self.path.parent) as d:
                text = read_latch_text(d)
        except FileNotFoundError:           # no state dir yet: nothing latched
            return None
        except PermissionError:             # not ours to read: still latched, said so
            return {"unreadable": True, "reason": (
                f"cannot read {self.path}: permission denied; the state dir is root's: "
                "run as root, or give a developer run its own with TRIO_STATE_DIR")}
        except OSError as e:
            return {"reason": f"unreadable latch file: {e.strerror}"}
        if not text:
            return None
        try:
            got = json.loads(text)
        except ValueError as e:              # unreadable latch: still latched
            return {"reason": f"unreadable latch file: {e}"}
        return got if isinstance(got, dict) else {"reason": "unreadable latch file"}

    def set(self, reason: str) -> None:
        if self.per_run_base is not None:
            self.per_run_base.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.path.parent.mkdir(mode=0o700)      # ours alone: never an existing one
            self.per_run_base = None                # made: a second set() reuses it
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with _dir_fd(self.path.parent) as d:
            write_latch(d, latch_text(reason))

    def reserve(self) -> None:
        """A vehicle run's start (simulation latches are made when they latch): the
        latch's blocks, allocated now. OSError: the state dir cannot hold a latch."""
        if self.per_run_base is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with _dir_fd(self.path.parent) as d:
            reserve_latch(d)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


class _dir_fd:
    """A directory held open by fd for the `*_latch` calls below (relative to it, never
    through a symlink planted under the latch's names)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def __enter__(self) -> int:
        return self.fd

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def latch_text(reason: str, **extra: object) -> bytes:
    """The latch's JSON: when, why, by which process; at most LATCH_BYTES, the reason
    shortened to fit (never the JSON cut: a non-ASCII reason is 6 bytes a character
    escaped, and a cut latch was unreadable, its reason lost; review)."""
    body = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "reason": reason[:2048],
            "pid": os.getpid(), **extra}
    while len(text := json.dumps(body).encode()) > LATCH_BYTES:
        body["reason"] = body["reason"][:len(body["reason"]) // 2] + "..."
    return text


def read_latch_text(dir_fd: int) -> str:
    """The latch file's text in the directory ("" when there is none), for both the
    direct path and the broker's. Opened without following a link and without blocking
    (a FIFO planted at its name hung `run`'s start; a link to /dev/zero read for ever:
    review); a link, anything but a regular file, or an empty file is a latch all the
    same, said in a JSON reason. At most LATCH_BYTES are read."""
    try:
        fd = os.open(LATCH_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     dir_fd=dir_fd)
    except FileNotFoundError:
        return ""
    except OSError as e:
        why = "a symlink" if e.errno == errno.ELOOP else e.strerror
        return json.dumps({"reason": f"unreadable latch file: {why}"})
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return json.dumps({"reason": "unreadable latch file: not a regular file"})
        data = os.read(fd, LATCH_BYTES)
    finally:
        os.close(fd)
    text = data.decode("utf-8", "replace")
    if not text.strip():                  # made, but no room for its text: latched
        return json.dumps({"reason": "empty latch file (its text could not be written)"})
    return text


def _open_new(dir_fd: int, name: str) -> int:
    """`name` created afresh in the directory: whatever was planted under it (a
    symlink, a FIFO) is removed first, never followed or opened."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                   0o600, dir_fd=dir_fd)


def write_latch(dir_fd: int, text: bytes) -> None:
    """Latch: `text` into a fresh file, fsynced, renamed over the latch's name (atomic: a
    crash leaves the old latch or the new; a rename replaces a symlink, never writes
    through it). Where the file system has no room for the text, the reserve's blocks
    take it; failing that the file is renamed into place empty (read() takes an empty
    latch for a latch) and OSError says so. The latch exists whenever a file could be
    made or renamed at all."""
    tmp = LATCH_NAME + ".tmp"
    try:
        fd = _open_new(dir_fd, tmp)
    except OSError:
        if _into_reserve(dir_fd, text):
            return
        raise
    try:
        os.write(fd, text)
        os.fsync(fd)
    except OSError as e:
        os.close(fd)
        if _into_reserve(dir_fd, text):
            os.unlink(tmp, dir_fd=dir_fd)
            return
        if _exists(dir_fd, LATCH_NAME):      # latched already: keep that one's reason
            os.unlink(tmp, dir_fd=dir_fd)
            raise OSError(e.errno, f"{e.strerror}: the latch already there is kept "
                                   "(no room for this one's text, no reserve)") from None
        os.rename(tmp, LATCH_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        raise OSError(e.errno, f"{e.strerror}: latched with an empty latch file "
                               "(no room for its text, no reserve)") from None
    os.close(fd)
    os.rename(tmp, LATCH_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _into_reserve(dir_fd: int, text: bytes) -> bool:
    """The text over the reserve's first bytes (JSON whitespace after it), fsynced, and
    the reserve renamed to be the latch: no block is allocated. False: none, or no use."""
    try:                                  # (O_NONBLOCK: a FIFO planted there never blocks)
        fd = os.open(RESERVE_NAME, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     dir_fd=dir_fd)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != LATCH_BYTES or st.st_nlink != 1:
            return False
        os.pwrite(fd, text.ljust(LATCH_BYTES, b" "), 0)
        os.fsync(fd)
    except OSError:
        return False
    finally:
        os.close(fd)
    try:
        os.rename(RESERVE_NAME, LATCH_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        return False
    return True


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def _whole_reserve(dir_fd: int) -> bool:
    """A reserve is there, a regular file with its blocks (not a link planted there),
    on a file system that can still be written (a read-only one, e.g. ext4 after an I/O
    error, passed with a reserve and latched nothing: review)."""
    try:
        st = os.stat(RESERVE_NAME, dir_fd=dir_fd, follow_symlinks=False)
        vfs = os.fstatvfs(dir_fd)
    except OSError:
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_size == LATCH_BYTES and st.st_nlink == 1
            and st.st_blocks * 512 >= LATCH_BYTES and not vfs.f_flag & os.ST_RDONLY)


def has_reserve(state_dir: str | os.PathLike) -> bool:
    """The state dir holds a whole latch reserve (check's question: can a latch be made?)."""
    try:
        with _dir_fd(Path(state_dir)) as d:
            return _whole_reserve(d)
    except OSError:
        return False


def reserve_latch(dir_fd: int) -> None:
    """Make the reserve (LATCH_BYTES written and fsynced), unless a whole one is there."""
    if _whole_reserve(dir_fd):
        return
    tmp = RESERVE_NAME + ".tmp"
    fd = _open_new(dir_fd, tmp)
    try:
        os.write(fd, b" " * LATCH_BYTES)
        os.fsync(fd)
    except OSError:
        os.close(fd)
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.close(fd)
    os.rename(tmp, RESERVE_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _repair(channel: Channel) -> None:
    """Make the segment's header the supervisor's again: the dead writer may have left
    one that does not match the spec (the Writer refuses that: a worker's writer must
    not take over a segment of another shape). Its sequence and generation words are
    the Writer's to judge (Writer._attach): it keeps what counting could reach."""
    from supervisor.ipc import layout as L

    spec = channel.spec
    with mmap.mmap(channel.writer_handle().data_fd, spec.segment_size) as buf:
        L.CHANNEL_HDR.pack_into(buf, 0, L.MAGIC, L.LAYOUT_VERSION, spec.slot_count,
                                spec.slot_size, spec.slot_stride, spec.control_size,
                                spec.channel_id, os.getpid(), 0, 0, 0)


def _writer(channel: Channel, readers: tuple[int, ...]) -> Writer:
    """The supervisor's writer of a dead writer's channel. Its sequence continues above
    the segment's plausible words and above every position ``readers`` consumed (their
    lease tables: the dead writer could not touch them), so no reader has gone past the
    last word already, whatever the dead writer rolled back (red team round 3)."""
    try:
        return Writer(channel.writer_handle(), domain="supervisor", seal=False,
                      above_readers=readers)
    except Exception:    # a header the dead writer poisoned: take the segment back
        pass
    _repair(channel)
    return Writer(channel.writer_handle(), domain="supervisor", seal=False,
                  above_readers=readers)


# One Writer of a channel at a time inside the supervisor too: the last-word thread and
# the event loop (fail-safe, shutdown) may both come to publish SAFE on one channel.
_publishing: dict[int, threading.Lock] = {}
_publishing_guard = threading.Lock()


def _channel_lock(channel: Channel) -> threading.Lock:
    with _publishing_guard:
        return _publishing.setdefault(id(channel), threading.Lock())


def prepare() -> None:
    """Import what publish_safe needs now: the first SAFE after a death must not wait
    for imports (about 1 ms of the ~1.3 ms of a first publish, measured)."""
    import schemas.payloads  # noqa: F401
    from supervisor.ipc import _geometry, layout  # noqa: F401


def trusted_readers(config, channel: str) -> tuple[int, ...]:
    """The reader indexes of ``channel`` that get a SAFE of their own above their
    position: its control-domain readers and the supervisor's own monitor (the spare
    index). A research reader's claim is not read (its outputs are shadow-only, and a
    copy above a lying position would only push the sequence up). Indexes as the
    config gives them (Config.reader_index, Config.monitor_index)."""
    from supervisor.config import CONTROL

    return tuple(config.reader_index(channel, w) for w in config.readers_of(channel)
                 if config.profile_of(w) == CONTROL) + (config.monitor_index(channel),)


def publish_safe(channel: Channel, payload_name: str,
                 readers: Iterable[int] | None = None, *, lost: bool = False,
                 stopped: bool = False) -> dict[str, float]:
    """Publish the payload's safe value on `channel` (its worker must be dead; ``lost``:
    the value for a writer that died, `Payload.lost`; ``stopped``: for one the supervisor
    stopped, `Payload.stopped`; each where the payload has one), whatever
    state the dead writer left the segment in: once above what the segment holds, and
    once above the position of each reader in ``readers`` (default: all) that is
    further on, so each reader's next message is a SAFE (trusted_readers says which).
    Thread-safe per channel."""
    from schemas.payloads import PAYLOADS

    payload = PAYLOADS[payload_name]
    if payload.safe is None:
        raise ValueError(f"payload {payload_name} has no safe value")
    values = payload.safe
    if (lost or stopped) and payload.lost is not None:
        values = payload.lost
    if stopped and payload.stopped is not None:
        values = payload.stopped
    with _channel_lock(channel):
        w = _writer(channel, tuple(range(channel.spec.max_readers)) if readers is None
                    else tuple(readers))
        try:
            # Once just above what the segment holds, and once above each reader that
            # is further on: every reader's next message is a SAFE, whatever the dead
            # writer made it consume, and a reader lying about its position (its own
            # table) only gets a SAFE of its own, above everyone's (red team round 4).
            base = w.segment_sequence
            for at in sorted({base, *(p for p in w.reader_positions if p > base)}):
                w.continue_from(at)
                with w.loan() as loan:
                    payload.encode(loan.array(payload.shape, np.dtype(payload.dtype)),
                                   **values)
                    loan.publish()
        finally:
            w.close()
    return dict(values)
