"""What the hostile-fleet test modules share (tests/test_attacks.py, test_attacks_net.py,
test_redteam_round2.py ...): one `supervisor run` whose JSON events go to a file, read
back as they come, stopped by SIGTERM; a wait that ends when the fleet is done or stops
making progress; and the readers of an attacker's evidence in the supervisor's log.

Not a test module (no `test_` prefix): nothing here is collected, so each module that
uses it stays runnable alone (`pytest tests/test_x.py::test_y`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import IO

Events = list[dict]


# ---------------------------------------------------------------- the evidence


def of(ev: Events, worker: str, event: str | None = None) -> Events:
    """`worker`'s events (of one kind, if `event` is given), in log order."""
    return [e for e in ev if e.get("worker") == worker and (event is None or e["event"] == event)]


def attack_result(ev: Events, worker: str) -> dict | None:
    """The JSON an attacker printed as its `ATTACK ...` line, as the supervisor logged it
    (an `output` event in the worker's name): None if it printed none."""
    for e in of(ev, worker, "output"):
        if e["line"].startswith("ATTACK "):
            return json.loads(e["line"][7:])
    return None


def assert_denied(ev: Events, worker: str) -> dict:
    """The attack's result, from the supervisor's log, and it was denied."""
    res = attack_result(ev, worker)
    assert res is not None, f"{worker} printed no result: {of(ev, worker)}"
    assert res["denied"] is True, f"{worker}: attack succeeded: {res}"
    return res


def killed_by(ev: Events, worker: str) -> dict:
    """`worker`'s first exit event (it must have one)."""
    ex = of(ev, worker, "exit")
    assert ex, f"no exit event for {worker}: {of(ev, worker)}"
    return ex[0]


def ended(ev: Events, pred: Callable[[dict], bool] = lambda e: False) -> set[str]:
    """Workers whose attack is over: exited, refused, given up, printed their `ATTACK`
    line, or (`pred`) left whatever other mark the caller counts as the end."""
    return {e.get("worker") for e in ev
            if e["event"] in ("exit", "refused", "gave_up")
            or (e["event"] == "output" and e["line"].startswith("ATTACK ")) or pred(e)}


# ---------------------------------------------------------------- the supervisor


class LoggedRun:
    """`supervisor run --config CFG`, its events (stderr) in `log_path`, its fail-safe
    latch in a state dir of its own (never the machine's, never the test's), stdout
    where `stdout` says. The file, not a pipe: a fleet's events pass a pipe's 64 KiB
    long before it is READY, and a supervisor blocked on its log goes no further."""

    def __init__(self, tmp: Path, name: str, toml: str, *, args: Sequence[str] = (),
                 stdout: int | IO = subprocess.DEVNULL, log_head: str = "",
                 **popen) -> None:
        cfg = tmp / f"{name}.toml"
        cfg.write_text(toml)
        self.log_path = tmp / "supervisor.log"
        self.log = open(self.log_path, "w+")
        if log_head:                      # what was in the log before: must survive it
            self.log.write(log_head)
            self.log.flush()
        state = tmp / "state"
        state.mkdir()
        # subprocess.Popen looked up at call time: test_privsep wraps it to add --privsep.
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", "run", "--config", str(cfg), *args],
            stdout=stdout, stderr=self.log, env=dict(os.environ, TRIO_STATE_DIR=str(state)),
            **popen)
        self.t0 = time.monotonic()

    def events(self, strict: bool = True) -> Events:
        """Every event so far; `strict=False` passes over a line not (yet) whole JSON."""
        out = []
        with open(self.log_path) as f:
            for x in f:
                if not strict:
                    try:
                        out.append(json.loads(x))
                    except ValueError:
                        pass
                elif x.startswith("{"):
                    out.append(json.loads(x))
        return out

    def settle(self, workers: Collection[str], *, stall_s: float, admission_s: float,
               cap_s: float, tail_s: float, done: Callable[[Events], set[str]] = ended,
               finished: Callable[[Events], bool] = lambda ev: True) -> Events:
        """Until every one of `workers` is `done` (and `finished(ev)`), then `tail_s` more.
        Not a fixed deadline: a loaded 2-core machine starts a fleet in minutes, not
        seconds. It gives up when the fleet stops making progress (no worker started,
        ready or done for `stall_s`; before any channel exists, admission of the whole
        fleet may take `admission_s`), at `cap_s`, or when the supervisor is gone."""
        start = last_change = time.monotonic()
        seen = -1
        while time.monotonic() - start < cap_s:
            ev = self.events()
            admitted = any(e["event"] == "channels_created" for e in ev)
            if time.monotonic() - last_change >= (stall_s if admitted else admission_s):
                break
            gone = done(ev)
            if set(workers) <= gone and finished(ev):
                time.sleep(tail_s)
                return self.events()
            if self.proc.poll() is not None:
                break
            progress = sum(e["event"] in ("start", "ready") for e in ev) + len(gone) + admitted
            if progress != seen:
                seen, last_change = progress, time.monotonic()
            time.sleep(0.2)
        return self.events()

    def terminate(self, timeout: float = 60) -> None:
        """SIGTERM (the orderly stop), SIGKILL if it is not gone in `timeout`; the log
        closed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def kill(self) -> None:
        """The fixture's last resort: never leave a supervisor running."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` so far."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def until(run: "LoggedRun", cond: Callable[[Events], bool], timeout_s: float) -> Events:
    """The log once `cond(events)` holds (or the supervisor is gone, or the time is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ev = run.events(strict=False)
        if cond(ev) or run.proc.poll() is not None or time.monotonic() > deadline:
            return ev
        time.sleep(0.05)
