"""The suite's leftovers check (conftest `Leftovers`) names the test that left a thread or
a bubblewrap sandbox running: a small suite that leaks both, run by a real pytest in a
child process with this suite's hooks."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

LEAKY = textwrap.dedent("""
    import subprocess, threading

    STOP = threading.Event()       # set at the session's end (conftest), after the check

    def test_leaves_a_thread():
        threading.Thread(target=STOP.wait, args=(60,), name="leaky").start()   # no daemon

    def test_leaves_a_sandbox():
        p = subprocess.Popen(["bwrap", "--ro-bind", "/", "/", "sleep", "30"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print("BWRAP", p.pid)

    def test_clean():
        pass
""")


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_the_leftovers_check_names_the_test_that_left_a_thread_or_a_sandbox(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        from tests.conftest import pytest_runtest_protocol, pytest_terminal_summary

        def pytest_unconfigure(config):
            import test_leaky
            test_leaky.STOP.set()
    """))
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                                  os.environ.get("PYTHONPATH")])))
    env.pop("TRIO_TEST_LEFTOVERS", None)          # the outer suite's file, if any
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), str(tmp_path / "test_leaky.py")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    pids = [int(x) for x in re.findall(r"BWRAP (\d+)", out)]
    try:
        assert p.returncode == 0, out[-3000:]       # report-only: nothing fails for it
        assert re.search(r"test_leaky.py::test_leaves_a_thread: left thread "
                         r"kind=non-daemon, name=leaky", out), out[-3000:]
        assert re.search(r"test_leaky.py::test_leaves_a_sandbox: left bwrap pid=%d, .*"
                         r"ours=True" % pids[0], out), out[-3000:]
        assert "test_clean" not in out.split("leftovers (")[-1], out[-3000:]
    finally:
        for pid in pids:                              # orphaned once its pytest is gone
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
