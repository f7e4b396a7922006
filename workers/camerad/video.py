"""camerad's recorded sources: a drive log (supervisor/replay) and a plain video file.

Both hand out `Recorded` frames as tightly packed NV12 bytes, with the frame id and the
capture time of the recording (the log's index, never the video container: a raw
H.264 stream has no timestamps; a plain file's frames get ids 0, 1, ... and times
from its frame rate). camerad stamps what it publishes with this boot's clock, as a
live camera would; the recorded times travel on only through the log itself.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from supervisor.protocol import ENV_SANDBOXED


class SourceError(Exception):
    """The recording cannot be played (one line: what and why)."""


@dataclass(frozen=True)
class Recorded:
    frame_id: int
    capture_ts_ns: int            # of the recording (log time)
    exposure_us: int | None
    data: bytes                   # NV12, tightly packed


class LogSource:
    """The frames of one channel of a drive log, in recorded order."""

    def __init__(self, path: str | os.PathLike, channel: str = "road_frames") -> None:
        from supervisor.replay.drivelog import EXPOSURE_MAX, DriveLog
        from supervisor.replay.logfmt import LogError

        try:
            self.log = DriveLog.open(path)
            if channel not in self.log.video_channels():
                have = ", ".join(self.log.video_channels()) or "none"
                raise SourceError(f"{path}: no video of channel {channel!r} (videos: {have})")
            self.video = self.log.video(channel)
        except LogError as e:
            raise SourceError(str(e)) from None
        info = self.video.info
        self.width, self.height, self.format = info.width, info.height, info.pixel_format
        self.fps = info.fps
        self.channel = channel
        # (DriveLog skips a record whose exposure the bridge cannot carry; None is
        # "unknown", what a frame with no record plays with)
        self._exposure = {f.frame_id: f.exposure_us for f in self.log.frames.get(channel, [])
                          if f.exposure_us is None or 0 <= f.exposure_us <= EXPOSURE_MAX}
        self.total = len(self.video)

    @property
    def loss_text(self) -> str:
        loss = self.log.full_loss()
        return loss.text()

    @property
    def lost_records(self) -> int:
        loss = self.log.full_loss()
        return loss.truncated_records + loss.corrupt_records

    def __iter__(self) -> Iterator[Recorded]:
        for e, data in self.video.frames():
            yield Recorded(e.frame_id, e.capture_ts_ns, self._exposure.get(e.frame_id), data)


class VideoFileSource:
    """A plain video file (a dashcam clip: MP4, MKV, ...) decoded with PyAV, converted
    to NV12 at its own size or ``width``x``height``, at its own frame rate."""

    def __init__(self, path: str | os.PathLike, width: int | None = None,
                 height: int | None = None) -> None:
        from supervisor.replay.logfmt import LogError, need_av

        self.path = os.fspath(path)
        try:
            need_av(f"{self.path}: playing a video clip")
        except LogError as e:
            raise SourceError(str(e)) from None
        import av

        # Judged before PyAV opens it: inside a sandbox a file that exists on the host
        # but lies outside every bind is simply absent, and "[Errno 2] No such file"
        # about a file the user can see sends them the wrong way.
        if not os.path.lexists(self.path) and os.environ.get(ENV_SANDBOXED) == "1":
            raise SourceError(f"{self.path}: not visible inside the sandbox (a clip must be "
                              f"bound read-only into the camera's domain: add its directory to "
                              f"the domain's extra_ro_binds)")
        try:
            self._container = av.open(self.path)
        except (av.error.FFmpegError, OSError) as e:
            raise SourceError(f"{self.path}: not a playable video ({e})") from None
        if not self._container.streams.video:
            raise SourceError(f"{self.path}: has no video stream")
        st = self._container.streams.video[0]
        self.width = width or st.codec_context.width
        self.height = height or st.codec_context.height
        if self.width % 2 or self.height % 2:
            raise SourceError(f"{self.path}: {self.width}x{self.height}: NV12 needs even "
                              f"sizes (give --width/--height)")
        rate = st.average_rate or st.guessed_rate
        self.fps = float(rate) if rate else 20.0
        self.format = "nv12"
        self.total = st.frames or None
        self._stream = st
        self.loops = 0

    def __iter__(self) -> Iterator[Recorded]:
        from supervisor.replay.logfmt import nv12_bytes

        period = 1e9 / self.fps
        self._container.seek(0)
        for k, fr in enumerate(self._container.decode(self._stream)):
            if (fr.width, fr.height) != (self.width, self.height):
                fr = fr.reformat(width=self.width, height=self.height, format="nv12")
            yield Recorded(k, int(round(k * period)), None, nv12_bytes(fr, self.width, self.height))
