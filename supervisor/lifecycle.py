"""Turning a Config into supervised, sandboxed processes (trio).

One task per worker in a nursery. Start order follows channel dependencies: a worker
starts once every worker before it in ``Config.start_order()`` reported READY. Exits
are restarted per the worker's policy with exponential backoff and a rate limit; a
worker that stops pinging its watchdog is killed and restarted; a control worker that
runs out of restarts triggers the domain's failure policy ("fail_safe" stops the whole
control domain). Every decision is one structured log line.
"""
from __future__ import annotations

import enum
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import trio

from supervisor.admission import check_worker
from supervisor.config import CONTROL, Config, WorkerConfig
from supervisor.events import EventLog
from supervisor.ipc import Channel, env_name
from supervisor.notify import Notifier
from supervisor.worker import (ENV_CHANNELS, ENV_DOMAIN, ENV_NAME, ENV_NETWORK,
                               ENV_STATUS_FD)


class Exit(enum.IntEnum):
    """Process exit status of ``supervisor run``: it says why the supervisor stopped."""

    SHUTDOWN = 0          # SIGTERM/SIGINT: orderly shutdown
    ERROR = 1             # unexpected internal error
    CONFIG = 2            # the config did not load
    REFUSED = 3           # admission refused a required worker
    FAIL_SAFE = 4         # the control domain failed safe
    START_FAILED = 5      # a required worker never became ready


@dataclass
class WorkerRun:
    cfg: WorkerConfig
    proc: subprocess.Popen | None = None
    status_r: int | None = None
    pid: int = 0                  # bwrap (or the worker itself when unsandboxed)
    started_ns: int = 0
    ready_ns: int = 0
    last_ping_ns: int = 0
    ready: trio.Event = field(default_factory=trio.Event)
    restarts: deque = field(default_factory=deque)
    refused: str | None = None
    status: str = ""
    exit_reason: str = ""


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"SIG{sig}"   # real-time signals have no name


class FailSafe(Exception):
    """The control domain must stop now."""


class StartFailed(Exception):
    """A required worker gave up before its first READY."""


class Supervisor:
    def __init__(self, config: Config, *, log: EventLog | None = None,
                 notifier: Notifier | None = None, sandboxed: bool = True,
                 grace_s: float = 3.0, python: str = sys.executable,
                 worker_output: int | None = None, status_out=None,
                 status_interval_s: float | None = None) -> None:
        self.config = config
        self.log = log or EventLog(fmt=config.supervisor.log_format)
        self.notify = notifier or Notifier()
        self.sandboxed = sandboxed
        self.grace_s = grace_s
        self.python = python
        self.worker_output = worker_output
        self.runs: dict[str, WorkerRun] = {}
        self.channels: dict[str, Channel] = {}
        self._reader_index: dict[tuple[str, str], int] = {}
        self.exit_code: Exit = Exit.SHUTDOWN
        self._stopping = False
        self.status_out = status_out       # a stream for the live status line, or None
        self.status_interval_s = status_interval_s
        self.monitor = None

    # ---------------------------------------------------------------- admission

    def admit(self) -> list[str]:
        """Static admission of every worker; returns the names refused."""
        refused = []
        for name, w in self.config.workers.items():
            argv = None if w.module else list(w.command or ())
            report = check_worker(name, w.domain, w.module, argv, sys.path)
            if not report.ok:
                refused.append(name)
                self.log.emit("refused", worker=name, domain=w.domain, optional=w.optional,
                              reason=report.format(),
                              chains=[" -> ".join(f.chain) for f in report.findings])
        return refused

    # ---------------------------------------------------------------- channels

    def _make_channels(self) -> None:
        for name, spec in self.config.channel_specs().items():
            self.channels[name] = Channel.create(spec)
            for i, reader in enumerate(self.config.readers_of(name)):
                self._reader_index[(name, reader)] = i
        self.log.emit("channels_created", channels=sorted(self.channels))

    def _close_channels(self) -> None:
        for ch in self.channels.values():
            ch.close()
        self.log.emit("channels_closed", channels=sorted(self.channels))
        self.channels.clear()

    def _endpoint_env(self, w: WorkerConfig) -> tuple[dict[str, str], list[int]]:
        env, fds = {}, []
        for ch in w.publishes:
            h = self.channels[ch].writer_handle()
            env[env_name(ch)] = h.to_json()
            fds += h.fds()
        for ch in w.reads:
            h = self.channels[ch].reader_handle(self._reader_index[(ch, w.name)])
            env[env_name(ch)] = h.to_json()
            fds += h.fds()
        env[ENV_CHANNELS] = ",".join((*w.publishes, *w.reads))
        return env, fds

    # ---------------------------------------------------------------- processes

    def _argv(self, w: WorkerConfig) -> list[str]:
        if w.module:
            return [self.python, "-m", "supervisor.runner", w.module, *w.args]
        return [*w.command, *w.args]

    @staticmethod
    def _rlimits(w: WorkerConfig) -> dict[str, int]:
        """Per-worker limits enforced with rlimits: memory_max caps the data segment
        (heap and private anonymous mappings; shared channels are not counted), nofile
        the open fds. cpu_quota needs a cgroup: the generated systemd unit applies the
        total; per worker it is not enforced yet."""
        limits = {}
        if w.memory_max:
            limits["data"] = w.memory_max
        if w.nofile:
            limits["nofile"] = w.nofile
        return limits

    def _spawn(self, run: WorkerRun) -> None:
        w = run.cfg
        domain = self.config.domains[w.domain]
        env, fds = self._endpoint_env(w)
        r, wfd = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(r, False)
        env.update({ENV_NAME: w.name, ENV_DOMAIN: w.domain, ENV_STATUS_FD: str(wfd),
                    ENV_NETWORK: "1" if domain.network else "0"})
        out = self.worker_output
        ok = False
        try:
            if self.sandboxed:
                from supervisor.sandbox import launch, policy_for_domain

                pol = policy_for_domain(w.domain, network=domain.network,
                                        extra_ro_binds=domain.extra_ro_binds)
                # Own session: a terminal's Ctrl-C reaches the supervisor only, which
                # then stops the workers in order.
                run.proc = launch.spawn(pol, self._argv(w), [*fds, wfd], env_extra=env,
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                        start_new_session=True, rlimits=self._rlimits(w))
            else:
                full = dict(os.environ, **env)
                run.proc = subprocess.Popen(self._argv(w), pass_fds=[*fds, wfd], env=full,
                                            stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                            start_new_session=True)
            ok = True
        finally:
            os.close(wfd)
            if not ok:
                os.close(r)
        run.status_r = r
        run.pid = run.proc.pid
        run.started_ns = run.last_ping_ns = time.monotonic_ns()
        run.ready_ns = 0            # per run: backoff resets only after a run that was ready
        run.ready = trio.Event()
        self.log.emit("start", worker=w.name, domain=w.domain, pid=run.pid,
                      sandboxed=self.sandboxed)

    def worker_pids(self, run: WorkerRun) -> list[int]:
        """Host pids of the worker's processes (inside its sandbox)."""
        if run.proc is None or run.proc.poll() is not None:
            return []
        if not self.sandboxed:
            return [run.pid]
        from supervisor.sandbox import descendant_pids

        return descendant_pids(run.pid)

    def _kill(self, run: WorkerRun, sig: int = signal.SIGKILL) -> None:
        """SIGKILL goes to the outer bwrap (the whole sandbox dies with it); other
        signals to the worker itself, since bwrap does not forward them."""
        if run.proc is None or run.proc.poll() is not None:
            return                  # already reaped: its pid may belong to someone else now
        if sig == signal.SIGKILL or not self.sandboxed:
            run.proc.send_signal(sig)
            return
        targets = self.worker_pids(run)[1:2] or [run.pid]   # [bwrap's init, the worker]
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    async def _wait_exit(self, run: WorkerRun) -> int:
        pidfd = os.pidfd_open(run.pid)
        try:
            await trio.lowlevel.wait_readable(pidfd)
        finally:
            os.close(pidfd)
        return run.proc.wait()

    async def _read_status(self, run: WorkerRun) -> None:
        """READY=1 / WATCHDOG=1 / STATUS=... lines from the worker's status pipe."""
        buf = b""
        fd = run.status_r
        while True:
            await trio.lowlevel.wait_readable(fd)
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                continue
            if not chunk:
                return
            buf += chunk
            *lines, buf = buf.split(b"\n")
            if len(buf) > 4096:   # a worker may not grow our memory with an endless line
                self.log.emit("protocol_error", worker=run.cfg.name,
                              reason="status line over 4096 bytes; dropped")
                buf = b""
            for line in lines:
                self._on_status(run, line.decode(errors="replace"))

    def _on_status(self, run: WorkerRun, line: str) -> None:
        now = time.monotonic_ns()
        if line.startswith("READY=1"):
            run.last_ping_ns = now
            if not run.ready.is_set():
                run.ready_ns = now
                run.ready.set()
                self.log.emit("ready", worker=run.cfg.name, pid=run.pid,
                              start_to_ready_ms=round((now - run.started_ns) / 1e6, 3))
        elif line.startswith("WATCHDOG=1"):
            run.last_ping_ns = now
        elif line.startswith("STATUS="):
            run.status = line[7:]

    # ---------------------------------------------------------------- one worker

    def _restart_allowed(self, run: WorkerRun, code: int) -> bool:
        policy = run.cfg.restart
        return policy == "always" or (policy == "on-failure" and code != 0)

    def _budget_left(self, run: WorkerRun) -> bool:
        now = time.monotonic()
        window = run.cfg.restart_window_s
        while run.restarts and now - run.restarts[0] > window:
            run.restarts.popleft()
        return len(run.restarts) < run.cfg.max_restarts

    async def _supervise(self, run: WorkerRun, task_status=trio.TASK_STATUS_IGNORED) -> None:
        w = run.cfg
        started = False
        attempt = 0

        def on_ready() -> None:
            # The first READY lets the supervisor start the next worker in order.
            nonlocal started
            if not started:
                started = True
                task_status.started()

        while not self._stopping:
            try:
                self._spawn(run)
            except (OSError, RuntimeError, ValueError) as e:
                # bwrap/prlimit missing, seccomp unavailable, fork failing: a failed start,
                # handled by the restart policy like a crash, never a supervisor crash.
                self.log.emit("start_failed", worker=w.name, error=f"{type(e).__name__}: {e}")
                code, why = -1, f"start failed: {e}"
                run.started_ns = time.monotonic_ns()
            else:
                code, why = await self._run_once(run, on_ready)
            if self._stopping:
                return
            sig = -code if code < 0 else None
            self.log.emit("exit", worker=w.name, pid=run.pid, code=code,
                          signal=_signame(sig) if sig else None, reason=why,
                          uptime_ms=round((time.monotonic_ns() - run.started_ns) / 1e6, 3))
            if run.refused:
                return await self._give_up(run, task_status, started, "refused at runtime")
            if not self._restart_allowed(run, code):
                return await self._give_up(run, task_status, started, f"restart={w.restart}")
            if not self._budget_left(run):
                return await self._give_up(run, task_status, started,
                                           f"more than {w.max_restarts} restarts in "
                                           f"{w.restart_window_s:g}s")
            # Backoff restarts from the first retry; a worker that ran well for a
            # while starts over at the initial delay.
            if run.ready_ns and time.monotonic_ns() - run.ready_ns > w.backoff_max_ms * 4e6:
                attempt = 0
            delay = min(w.backoff_initial_ms * 2 ** attempt, w.backoff_max_ms) / 1000
            attempt += 1
            run.restarts.append(time.monotonic())
            self.log.emit("restart", worker=w.name, attempt=attempt, delay_ms=delay * 1000,
                          after=why)
            await trio.sleep(delay)

    async def _give_up(self, run: WorkerRun, task_status, started: bool, why: str) -> None:
        w = run.cfg
        self.log.emit("gave_up", worker=w.name, domain=w.domain, reason=why)
        required = not w.optional
        if w.domain == CONTROL and required:
            policy = self.config.domains[CONTROL].failure_policy
            if policy == "fail_safe":
                raise FailSafe(f"control worker {w.name} failed: {why}")
        if not started:
            if required:
                # Its dependents would start without their input: stop here, say why.
                raise StartFailed(f"required worker {w.name} never became ready: {why}")
            task_status.started()

    async def _run_once(self, run: WorkerRun, on_ready) -> tuple[int, str]:
        """Run until the process exits; returns (returncode, why it ended)."""
        try:
            return await self._run_once_inner(run, on_ready)
        finally:
            if run.status_r is not None:
                os.close(run.status_r)
                run.status_r = None

    async def _run_once_inner(self, run: WorkerRun, on_ready) -> tuple[int, str]:
        w = run.cfg
        why = "exited"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read_status, run)

            async def announce() -> None:
                await run.ready.wait()
                on_ready()

            nursery.start_soon(announce)

            async def ready_deadline() -> None:
                nonlocal why
                with trio.move_on_after(w.ready_timeout_ms / 1000):
                    await run.ready.wait()
                    return
                why = f"not ready within {w.ready_timeout_ms} ms"
                self.log.emit("ready_timeout", worker=w.name, pid=run.pid)
                self._kill(run)

            async def watchdog() -> None:
                nonlocal why
                if not w.watchdog_ms:
                    return
                await run.ready.wait()
                limit = w.watchdog_ms * 1_000_000
                while True:
                    late = time.monotonic_ns() - run.last_ping_ns
                    if late > limit:
                        why = f"watchdog: no ping for {late / 1e6:.0f} ms"
                        self.log.emit("watchdog_missed", worker=w.name, pid=run.pid,
                                      silent_ms=round(late / 1e6, 1))
                        self._kill(run)
                        return
                    await trio.sleep((limit - late) / 1e9 + 0.001)

            nursery.start_soon(ready_deadline)
            nursery.start_soon(watchdog)
            code = await self._wait_exit(run)
            nursery.cancel_scope.cancel()
        return code, why

    # ---------------------------------------------------------------- domain-wide

    async def _scan_maps(self) -> None:
        """Kill and report any control process that maps a torch library."""
        from supervisor.admission import maps

        period = self.config.supervisor.maps_scan_interval_s
        while True:
            await trio.sleep(period)
            for run in self.runs.values():
                if run.cfg.domain != CONTROL or run.refused:
                    continue
                for pid in self.worker_pids(run):
                    try:
                        hits = maps.scan_pid(pid)
                    except Exception:  # the process went away between listing and reading
                        continue
                    if hits:
                        run.refused = f"maps {hits[0]}"
                        self.log.emit("refused", worker=run.cfg.name, domain=CONTROL,
                                      kind="maps", pid=pid, reason=(
                                          f"control-domain worker {run.cfg.name} maps "
                                          f"{hits[0].path}"),
                                      chains=[str(h) for h in hits])
                        self._kill(run)
                        break

    async def _heartbeat(self) -> None:
        interval = self.config.supervisor.status_interval_s
        if self.notify.watchdog_s:
            interval = min(interval, self.notify.watchdog_s / 2)
        while True:
            up = sum(1 for r in self.runs.values() if r.proc and r.proc.poll() is None)
            text = f"{up}/{len(self.runs)} workers running"
            self.notify.send(watchdog=1, status=text) if self.notify.watchdog_s else \
                self.notify.status(text)
            await trio.sleep(interval)

    async def _shutdown_workers(self) -> None:
        """SIGTERM in reverse start order, SIGKILL after the grace period."""
        self._stopping = True
        order = [n for n in reversed(self.config.start_order()) if n in self.runs]
        for name in order:
            run = self.runs[name]
            if run.proc is None or run.proc.poll() is not None:
                continue
            self._kill(run, signal.SIGTERM)
            with trio.move_on_after(self.grace_s):
                while run.proc.poll() is None:
                    await trio.sleep(0.01)
            if run.proc.poll() is None:
                self._kill(run)
                run.proc.wait()
            self.log.emit("stopped", worker=name, code=run.proc.returncode)

    # ---------------------------------------------------------------- main

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> Exit:
        cfg = self.config
        self.log.emit("supervisor_start", config=cfg.source, pid=os.getpid(),
                      sandboxed=self.sandboxed)
        if self.sandboxed:
            missing = [t for t in ("bwrap", "prlimit") if shutil.which(t) is None]
            if missing:
                self.log.emit("supervisor_exit", code=int(Exit.ERROR),
                              reason=f"{' and '.join(missing)} not installed: run "
                                     f"scripts/install.sh (or --no-sandbox for development)")
                task_status.started(self)
                return Exit.ERROR
        refused = set(self.admit())
        hard = [n for n in refused if not cfg.workers[n].optional]
        if hard:
            self.log.emit("supervisor_exit", code=int(Exit.REFUSED),
                          reason=f"admission refused required worker(s): {', '.join(hard)}")
            task_status.started(self)
            return Exit.REFUSED
        self._make_channels()
        try:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch_signals, signals, nursery.cancel_scope)
                    try:
                        await self._start_all(nursery, refused)
                    except FailSafe as e:
                        await self._fail_safe(str(e))
                        nursery.cancel_scope.cancel()
                        return self.exit_code
                    except StartFailed as e:
                        self.exit_code = Exit.START_FAILED
                        self.log.emit("start_failed_required", reason=str(e))
                        nursery.cancel_scope.cancel()
                        return self.exit_code
                    self.notify.ready(f"{len(self.runs)} workers ready")
                    self.log.emit("all_ready", workers=list(self.runs))
                    if self.status_out is not None:
                        nursery.start_soon(self._run_monitor)
                    task_status.started(self)
        except* FailSafe as eg:
            await self._fail_safe(str(eg.exceptions[0]))
        finally:
            # A second SIGTERM/SIGINT must not cut the ordered stop short.
            for s in (signal.SIGTERM, signal.SIGINT):
                signal.signal(s, signal.SIG_IGN)
            with trio.CancelScope(shield=True):
                await self._shutdown_workers()
            self._close_channels()
            self.notify.stopping()
            self.log.emit("supervisor_exit", code=int(self.exit_code),
                          reason=self.exit_code.name.lower())
        return self.exit_code

    async def _start_all(self, nursery: trio.Nursery, refused: set[str]) -> None:
        nursery.start_soon(self._scan_maps)
        nursery.start_soon(self._heartbeat)
        for name in self.config.start_order():
            if name in refused:
                self.log.emit("skipped", worker=name, reason="refused by admission (optional)")
                continue
            run = self.runs[name] = WorkerRun(self.config.workers[name])
            await nursery.start(self._supervise, run)

    async def _run_monitor(self) -> None:
        from supervisor.monitor import Monitor

        # The spare reader index of each channel (readers_of() fills 0..n-1).
        spare = {name: len(self.config.readers_of(name)) for name in self.channels}
        self.monitor = Monitor(self.channels, spare, out=self.status_out,
                               interval_s=self.status_interval_s or 1.0)
        try:
            await self.monitor.run()
        except Exception as e:  # the status line is a convenience: never fatal
            self.log.emit("monitor_error", error=f"{type(e).__name__}: {e}")

    async def _fail_safe(self, why: str) -> None:
        if self.exit_code == Exit.FAIL_SAFE:
            return
        self.exit_code = Exit.FAIL_SAFE
        self.log.emit("fail_safe", domain=CONTROL, reason=why)
        self._stopping = True
        for name in self.config.workers_in(CONTROL):
            run = self.runs.get(name)
            if run and run.proc and run.proc.poll() is None:
                self._kill(run)

    async def _watch_signals(self, signals, scope: trio.CancelScope) -> None:
        async for sig in signals:
            self.log.emit("signal", signal=_signame(sig))
            self.notify.stopping()
            scope.cancel()
            return


def run_config(config: Config, **kw) -> int:
    sup = Supervisor(config, **kw)
    return int(trio.run(sup.run))
