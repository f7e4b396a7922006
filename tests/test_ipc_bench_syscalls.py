"""bench/ipcbench/syscalls.py: the system-call counter behind ``ipc_latency.py
--syscalls``, against the real strace: attached to a running process, it counts what
that process calls while attached and nothing from before."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

from ipcbench import syscalls  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="strace missing")

# Calls getppid 500 times before a go byte on stdin (not to be counted), then 300 times
# after it, then waits for stdin to close.
_CHILD = textwrap.dedent("""
    import os, sys
    for _ in range(500):
        os.getppid()
    print("ready", flush=True)
    sys.stdin.buffer.read(1)
    for _ in range(300):
        os.getppid()
    print("done", flush=True)
    sys.stdin.buffer.read()
""")


def test_counts_what_a_process_calls_while_attached():
    p = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline() == b"ready\n"
        t = syscalls.Tracer(p.pid)
        t.attach()
        p.stdin.write(b"g")
        p.stdin.flush()
        assert p.stdout.readline() == b"done\n"
        counts = t.detach()
    finally:
        p.stdin.close()
        p.wait(10)
    assert counts.calls.get("getppid") == 300, counts
    row = syscalls.per_message(counts, 300)
    assert row["by_name"]["getppid"] == 1.0 and row["per_msg"] >= 1.0


def test_the_summary_table_is_read_with_and_without_errors():
    text = textwrap.dedent("""\
        % time     seconds  usecs/call     calls    errors syscall
        ------ ----------- ----------- --------- --------- ----------------
         60.00    0.000060           2        30           sendto
         40.00    0.000040           1        40        12 recvfrom
        ------ ----------- ----------- --------- --------- ----------------
        100.00    0.000100           1        70        12 total
    """)
    c = syscalls.parse_summary(text)
    assert c.calls == {"sendto": 30, "recvfrom": 40} and c.errors == {"recvfrom": 12}
    assert c.total == 70


def test_a_process_that_is_gone_is_refused_in_one_line():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(10)
    t = syscalls.Tracer(p.pid)
    with pytest.raises(syscalls.TracerError, match="did not attach"):
        t.attach()
