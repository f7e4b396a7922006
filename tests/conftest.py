from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.ipc import Channel, ChannelSpec

PEER = Path(__file__).with_name("ipc_peer.py")


class Peer:
    """A real separate process holding one end of a channel."""

    def __init__(self, role: str, handle, *args: str) -> None:
        env = dict(os.environ, PEER_HANDLE=handle.to_json())
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), role, *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, pass_fds=handle.fds(), env=env)
        self.hello = self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer exited with {self.proc.wait()}")
        return json.loads(line)

    def send(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f:
                f.close()


@pytest.fixture
def make_channel():
    made: list[Channel] = []

    def make(**kw) -> Channel:
        kw.setdefault("name", "test")
        kw.setdefault("slot_size", 1 << 16)
        ch = Channel.create(ChannelSpec(**kw))
        made.append(ch)
        return ch

    yield make
    for ch in made:
        ch.close()


@pytest.fixture
def peers():
    started: list[Peer] = []

    def start(role: str, handle, *args: str) -> Peer:
        p = Peer(role, handle, *args)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


@pytest.fixture(autouse=True)
def _state_dir(tmp_path_factory, monkeypatch):
    """Each test latches its fail-safes in its own directory, never the machine's
    /var/lib/trio-supervisor: a test that fails safe must not stop the next one."""
    d = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("TRIO_STATE_DIR", str(d))
    return d
