"""Warm standby: a second instance of a worker, started and waiting in its own sandbox,
handed the channels when the active one dies (recovery without a cold start)."""
from __future__ import annotations

import json
import socket
import subprocess
import time

import trio

from ._run import WorkerRun


class _WarmStandby:
    """Keeping and adopting standbys (mixed into `Supervisor`)."""

    async def _keep_standby(self, run: WorkerRun) -> None:
        """Start a standby instance of `run`'s worker and serve it (status, output, exec
        watch) while it waits; if it dies waiting, that is logged and the next READY of
        the active instance starts another."""
        sb = WorkerRun(run.cfg, is_standby=True)
        try:
            self._spawn(sb)
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
            self.log.emit("standby_failed", worker=run.cfg.name, error=f"{type(e).__name__}: {e}")
            return
        run.standby = sb
        code = None
        try:
            with trio.CancelScope() as sb.scope:
                async with trio.open_nursery() as n:
                    sb.nursery = n
                    n.start_soon(self._read_status, sb)
                    n.start_soon(self._read_output, sb)
                    n.start_soon(self._watch_exec, sb)
                    code = await self._wait_exit(sb)
                    n.cancel_scope.cancel()
        finally:
            sb.handed_over.set()
        if sb.adopted or code is None:
            return
        if run.standby is sb:
            run.standby = None
        sig, cause = self._exit_cause(sb, code)
        self._release_cgroup(sb)
        self._close_run_fds(sb)
        if not self._stopping:
            self.log.emit("standby_exit", worker=run.cfg.name, pid=sb.pid, code=code,
                          signal=sig, cause=cause or sb.refused or None)

    async def _adopt_standby(self, run: WorkerRun) -> bool:
        """Hand the channels to the waiting standby and make it the run: no cold start.
        False when there is none fit to take over (then the caller spawns as usual)."""
        sb, run.standby = run.standby, None
        if sb is None:
            return False
        usable = (sb.proc is not None and sb.proc.poll() is None and not sb.refused
                  and sb.ctl_sock is not None and (sb.watch is not None or not self._strict(sb)))
        if not usable:
            if sb.proc is not None and sb.proc.poll() is None:
                self._kill(sb)
            return False
        handles = self._handles(run.cfg)
        chans = {ch: h.to_json() for ch, h in handles.items()}
        fds = [fd for h in handles.values() for fd in h.fds()]
        try:
            socket.send_fds(sb.ctl_sock, [json.dumps({"channels": chans, "fds": fds}).encode()], fds)
        except OSError as e:
            self.log.emit("standby_failed", worker=run.cfg.name, error=f"hand-over: {e}")
            self._kill(sb)
            return False
        sb.adopted = True
        sb.scope.cancel()               # its tasks stop; ours take over its pipes
        await sb.handed_over.wait()
        for f in ("proc", "pid", "status_r", "status_buf", "status_tokens", "status_ts",
                  "out_r", "output", "cgroup", "oom_before", "watch_sock", "watch",
                  "exec_allowed", "ctl_sock"):
            setattr(run, f, getattr(sb, f))
        run.started_ns = run.last_ping_ns = time.monotonic_ns()
        run.ready_ns, run.ready, run.ready_claimed = 0, trio.Event(), False
        run.exec_snapshot, run.kill_reason, run.realtime_pid = None, "", 0
        self.log.emit("standby_adopted", worker=run.cfg.name, pid=run.pid,
                      waited_ms=round((run.started_ns - sb.started_ns) / 1e6, 1))
        return True
