"""The fail-safe's two promises: a safe last word on every actuation channel, and a
latch that only an operator clears.

Last word: when the control domain fails safe, every control process is killed first
(nothing of it can publish any more), then the supervisor itself publishes the
channel payload's safe value (schemas/payloads.py, e.g. control_cmd engaged=0, reason
FAIL_SAFE) as the channel's writer of last resort. One writer at a time still holds:
the worker that owned the channel is dead when the supervisor writes.

Latch: a small JSON file in the state directory. While it exists `supervisor run`
starts nothing and exits 4; `supervisor clear-fail-safe` removes it. The generated
unit does not restart on exit 4 (RestartPreventExitStatus=4).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from supervisor.ipc import Channel, Writer

LATCH_NAME = "failsafe.latch"


@dataclass
class FailSafeLatch:
    path: Path

    @classmethod
    def for_config(cls, config) -> FailSafeLatch:
        state = os.environ.get("TRIO_STATE_DIR") or config.supervisor.state_dir
        return cls(Path(state) / LATCH_NAME)

    def read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:   # unreadable latch: still latched
            return {"reason": f"unreadable latch file: {e}"}

    def set(self, reason: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                   "reason": reason, "pid": os.getpid()}))
        os.replace(tmp, self.path)    # atomic: a crash leaves the old or the new latch

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def publish_safe(channel: Channel, payload_name: str) -> dict[str, float]:
    """Publish the payload's safe value on `channel` (its worker must be dead)."""
    from schemas.payloads import PAYLOADS

    payload = PAYLOADS[payload_name]
    if payload.safe is None:
        raise ValueError(f"payload {payload_name} has no safe value")
    w = Writer(channel.writer_handle(), domain="supervisor", seal=False)
    try:
        with w.loan() as loan:
            payload.encode(loan.array(payload.shape, np.dtype(payload.dtype)), **payload.safe)
            loan.publish()
    finally:
        w.close()
    return dict(payload.safe)
