"""The hostile reader again, now from inside a real control-domain sandbox, against a
writer that did NOT seal its segment: the sandbox alone (O_RDONLY fd, 0400 inode, no
capabilities) must deny every write, as it does for a restartable writer in a vehicle."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from supervisor.ipc import Reader, Writer

pytestmark = pytest.mark.sandbox
if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)

TESTS = Path(__file__).resolve().parent


def test_sandboxed_hostile_reader_against_unsealed_writer(make_channel):
    import sys

    from supervisor.sandbox import policy_for_domain, spawn

    ch = make_channel(name="victim", slot_count=3, max_readers=2)
    w = Writer(ch.writer_handle(), seal=False)
    assert not ch.writer_sealed()
    w.publish_array(np.arange(256, dtype=np.uint8))
    before = os.pread(ch.writer_handle().data_fd, ch.spec.segment_size, 0)
    h = ch.reader_handle(0)
    pol = policy_for_domain("control", extra_ro_binds=[str(TESTS)])
    p = spawn(pol, [sys.executable, str(TESTS / "ipc_peer.py"), "hostile"], h.fds(),
              env_extra={"PEER_HANDLE": h.to_json(), "PEER_SKIP": "fchmod_then_reopen"},
              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert lines and "ready" in lines[0], err
    result = lines[-1]
    attacks = {k: v for k, v in result.items() if isinstance(v, dict)}
    assert len(attacks) == 10
    for name, outcome in attacks.items():
        assert outcome["denied"], f"attack {name} was not denied inside the sandbox"
    assert "Permission denied" in attacks["reopen_rw_and_map"]["error"]
    assert result["still_valid"]
    # The chmod route is not even attempted to the end: seccomp kills the reader (SIGSYS,
    # reported by bwrap as 128+31), and the segment is untouched.
    p = spawn(pol, [sys.executable, str(TESTS / "ipc_peer.py"), "hostile"], h.fds(),
              env_extra={"PEER_HANDLE": h.to_json(), "PEER_SKIP": ",".join(
                  n for n in attacks if n != "fchmod_then_reopen")},
              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.communicate(timeout=60)
    assert p.returncode == 128 + 31
    assert os.pread(ch.writer_handle().data_fd, ch.spec.segment_size, 0) == before
    with Reader(ch.reader_handle(1)).receive(timeout=1) as msg:
        assert np.array_equal(msg.array, np.arange(256, dtype=np.uint8))
