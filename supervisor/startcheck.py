"""``supervisor check --start``: start every worker's sandbox exactly as ``run`` would,
wait for READY, stop, and say per worker what happened.

Whatever would make ``run`` fail makes this fail, with the cause: it IS ``run`` (the same
`Supervisor`, admission, runtime checks, cgroups, sandboxes, research included), with
three differences that keep it off the car: a scratch state dir (a failure here never
writes the vehicle's fail-safe latch), no live status line, and it stops at the first
worker failure or once all are READY. While a worker is not READY its processes are
sampled from /proc (state, system call, threads, memory), so one that prints nothing
before its ready timeout is reported with the last thing it was seen doing, not just
"not ready".
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import TextIO

import trio

from supervisor.config import Config
from supervisor.events import EventLog
from supervisor.exits import Exit

# Events that end a worker's first start as a failure (before its READY).
_FAILED = ("exit", "ready_timeout", "refused", "start_failed", "standby_failed")
SAMPLE_S = 0.25


@dataclass
class Sample:
    """What one process of a sandbox was doing, from outside (/proc)."""

    pid: int
    state: str
    syscall: str
    threads: int
    rss_mib: float

    def text(self) -> str:
        return (f"pid {self.pid} state {self.state}, in {self.syscall}, "
                f"{self.threads} thread(s), {self.rss_mib:.0f} MiB resident")


@dataclass
class WorkerCheck:
    name: str
    domain: str
    ready_ms: float | None = None
    failure: str = ""                  # the first event that ended its start, as a line
    last_output: str = ""
    last_seen: Sample | None = None
    started_ns: int = 0
    events: list[str] = field(default_factory=list)

    def line(self) -> str:
        if self.ready_ms is not None and not self.failure:
            return f"{self.name} ({self.domain}): READY in {self.ready_ms:.0f} ms"
        if not self.failure:
            return f"{self.name} ({self.domain}): not started (an earlier failure stopped the check)"
        out = f"{self.name} ({self.domain}): FAILED: {self.failure}"
        if self.last_output:
            out += f"; last output: {self.last_output[:200]}"
        elif self.ready_ms is None:
            waited = (time.monotonic_ns() - self.started_ns) / 1e6 if self.started_ns else 0
            out += f"; no output in {waited:.0f} ms"
            if self.last_seen is not None:
                out += f"; last seen: {self.last_seen.text()}"
        return out


def _syscall_name(nr: int) -> str:
    try:
        import pyseccomp

        name = pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, nr)
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:   # no libseccomp here: the number still says something
        return f"syscall {nr}"


def sample(pid: int) -> Sample | None:
    """One look at a process from outside; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/syscall") as f:
            sc = f.read().split()
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    state = stat.rsplit(")", 1)[1].split()[0]
    if not sc or sc[0] == "running":
        call = "user space (running)"
    elif sc[0].lstrip("-").isdigit() and int(sc[0]) >= 0:
        call = _syscall_name(int(sc[0]))
    else:
        call = "user space"
    rss_kib = int(status.get("VmRSS", "0 kB").split()[0] or 0)
    return Sample(pid, state, call, int(status.get("Threads", "1").strip() or 1), rss_kib / 1024)


class _Watch:
    """Follows the supervisor's own event log: per worker, READY or the first failure."""

    def __init__(self, cfg: Config) -> None:
        self.workers = {n: WorkerCheck(n, w.domain) for n, w in cfg.workers.items()}
        self.all_ready = False
        self.exit: dict | None = None
        self.failed = False
        self._seen = 0

    def update(self, events: list[dict]) -> None:
        for ev in events[self._seen:]:
            self._one(ev)
        self._seen = len(events)

    def _one(self, ev: dict) -> None:
        kind, name = ev.get("event"), ev.get("worker")
        if kind == "all_ready":
            self.all_ready = True
        elif kind == "supervisor_exit":
            self.exit = ev
        w = self.workers.get(name or "")
        if w is None:
            return
        if kind == "start" and not w.started_ns:
            w.started_ns = ev.get("mono_ns", time.monotonic_ns())
        elif kind == "ready" and w.ready_ms is None:
            w.ready_ms = float(ev.get("start_to_ready_ms", 0.0))
        elif kind in ("output", "log"):
            w.last_output = str(ev.get("line") or ev.get("msg") or "")
        elif kind in _FAILED and not w.failure and not ev.get("standby"):
            if kind == "exit" and ev.get("code") == 0 and w.ready_ms is not None:
                return
            w.failure = _describe(ev)
            self.failed = True


def _describe(ev: dict) -> str:
    kind = ev["event"]
    if kind == "exit":
        why = ev.get("cause") or ev.get("reason") or ""
        return f"exited with code {ev.get('code')}" + (f" ({why})" if why else "")
    if kind == "ready_timeout":
        return "not ready within its ready_timeout_ms"
    return f"{kind}: {ev.get('reason') or ev.get('error') or ''}".rstrip(": ")


async def _drive(cfg: Config, log: EventLog, watch: _Watch, timeout_s: float,
                 progress: TextIO | None) -> Exit:
    from supervisor.lifecycle import Supervisor

    sup = Supervisor(cfg, log=log, status_out=None)
    code: list[Exit] = []

    async def run() -> None:
        code.append(await sup.run())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        deadline = trio.current_time() + timeout_s
        shown = 0
        while not code:
            watch.update(log.events)
            for w in watch.workers.values():        # the last thing a silent worker did
                run_ = sup.runs.get(w.name)
                if run_ is not None and w.ready_ms is None and not w.failure:
                    pids = sup.worker_pids(run_)
                    seen = sample(pids[-1]) if pids else None
                    w.last_seen = seen or w.last_seen
            ready = sum(1 for w in watch.workers.values() if w.ready_ms is not None)
            if progress is not None and ready != shown:
                shown = ready
                progress.write(f"check --start: {ready}/{len(watch.workers)} ready\n")
                progress.flush()
            if watch.all_ready or watch.failed or trio.current_time() > deadline:
                nursery.cancel_scope.cancel()      # the ordered shutdown runs in sup.run
                break
            await trio.sleep(SAMPLE_S)
    watch.update(log.events)
    if watch.failed or not watch.all_ready:
        if code and code[0] not in (Exit.SHUTDOWN,):
            return code[0]
        return Exit.START_FAILED
    return Exit.SHUTDOWN


def start_check(cfg: Config, *, timeout_s: float | None = None,
                progress: TextIO | None = None) -> tuple[Exit, list[str]]:
    """Start `cfg` as `run` would, stop it, and return (exit code, one line per worker
    plus the supervisor's own reason when it stopped before starting workers)."""
    if timeout_s is None:
        timeout_s = 30.0 + sum(w.ready_timeout_ms for w in cfg.workers.values()) / 1000
    with tempfile.TemporaryDirectory(prefix="trio-check-start-") as state, \
            open(os.devnull, "w") as devnull:
        old = os.environ.get("TRIO_STATE_DIR")
        os.environ["TRIO_STATE_DIR"] = state          # never the vehicle's latch
        try:
            log = EventLog(stream=devnull, keep=True)
            watch = _Watch(cfg)
            code = trio.run(_drive, cfg, log, watch, timeout_s, progress)
        finally:
            if old is None:
                os.environ.pop("TRIO_STATE_DIR", None)
            else:
                os.environ["TRIO_STATE_DIR"] = old
    lines = [w.line() for w in watch.workers.values()]
    ex = watch.exit or {}
    if code != Exit.SHUTDOWN and not any(w.failure for w in watch.workers.values()):
        lines.append(f"supervisor: {ex.get('reason', 'stopped')} (exit {int(code)})")
    for ev in log.of("config_problem"):
        lines.append(f"config: {ev.get('problem')}")
    for ev in log.of("limits_not_enforced"):
        lines.append(f"limits: {ev.get('reason') or ev.get('detail') or ev}")
    return code, lines
