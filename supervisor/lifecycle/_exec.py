"""The exec window of a control-grade worker: every executable mapping it asks for is
judged by the exec watch until READY; READY is accepted only after a snapshot of its
executable mappings (admission.maps), and from then on nothing new may execute."""
from __future__ import annotations

import functools
import socket

import trio

from supervisor.admission.maps import task_exited
from supervisor.config import RESEARCH
from supervisor.sandbox.wx import filter_count, kernel_has_mdwe

from ._procstate import live_in_sandbox
from ._run import WorkerRun


class _ExecWindow:
    """READY verification and the exec watch of each run (mixed into `Supervisor`)."""

    def _strict(self, run: WorkerRun) -> bool:
        return self.sandboxed and run.current is not None and run.current.watch_sock is not None

    def _set_ready(self, run: WorkerRun, now: int, **fields) -> None:
        run.ready_ns = now
        run.ready.set()
        self.log.emit("ready", worker=run.cfg.name, pid=run.pid,
                      start_to_ready_ms=round((now - run.started_ns) / 1e6, 3),
                      exec_mappings_admitted=run.current.exec_allowed, **fields)
        self._make_realtime(run)

    async def _verify_wx(self, run: WorkerRun, pid: int) -> dict | None:
        """The W^X lock the worker says it took at READY (sandbox/wx.py), checked from
        outside: its filter read back from every thread. The fields of the `ready` event,
        or None once refused. MDWE has no outside view: the worker's word for it and
        whether this kernel has it at all (`mdwe_kernel`: false means only the filter
        holds) are reported, nothing more."""
        from supervisor.sandbox import wx

        inc = run.current
        said = wx.parse_line(run.status or "")
        baseline = getattr(inc.watch, "filters_at_listener", None)
        try:
            got = await trio.to_thread.run_sync(functools.partial(
                wx.verify, pid, baseline=baseline, opener=inc.opener))
        except OSError as e:
            # Killed meanwhile (a kill at its adoption, CI): dying is not refusal, and a
            # refused control worker is not restarted. Its exit, with its own cause, is
            # what gets reported; a SIGKILLed process is gone within milliseconds.
            with trio.move_on_after(_DYING_S):
                while not task_exited(pid, opener=inc.opener):
                    await trio.sleep(0.005)
            if not task_exited(pid, opener=inc.opener):
                self._refuse(run, "wx_lock", f"READY, but its W^X lock cannot be checked: {e}")
            return None
        if not got.ok:
            self._refuse(run, "wx_lock", f"READY without the W^X lock: {got.reason}",
                         checked_by=got.how, worker_says=said or None)
            return None
        out = {"wx_lock": got.how, "wx_check_ms": round(got.ms, 3),
               "mdwe": said.get("mdwe"), "mdwe_kernel": _kernel_has_mdwe()}
        if inc.watch is not None:       # what judging its start-up cost (issue 21)
            out["exec_judged_ms"] = round(getattr(inc.watch, "busy_s", 0.0) * 1e3, 1)
            out["exec_stops"] = getattr(inc.watch, "stops", 0)
        if got.reason:             # why the filter was only counted, not read back
            out["wx_note"] = got.reason
        return out

    def _close_exec_window(self, run: WorkerRun) -> bool:
        """READY ends start-up. For a control-grade worker the supervisor, not the
        worker, makes it true: from this moment every new executable mapping is refused."""
        inc = run.current
        if inc.watch is None:
            self._take_listener(run)
        if inc.watch is None:
            self._refuse(run, "exec_watch", "READY before the exec watch was installed")
            return False
        inc.watch.ready = True
        return True

    async def _verify_ready(self, run: WorkerRun, now: int) -> None:
        """What is executable at READY is recorded, and none of it may still be able to
        change (writable, shared, memfd, deleted, on a writable mount) or be torch."""
        from supervisor.admission import maps

        inc = run.current
        opener = inc.opener
        pid = self._worker_pid(run)
        # A worker that died right after READY (a control worker killed by seccomp, CI:
        # refusing it overwrote its SIGSYS with our SIGKILL) takes its sandbox with it:
        # wait for either, so that its own exit is what is reported.
        deadline = trio.current_time() + _FIND_WORKER_S
        while self.sandboxed and pid == run.pid and trio.current_time() < deadline:
            if task_exited(run.pid, opener=opener):
                return                        # its exit is reported, with its cause
            await trio.sleep(0.01)
            pid = self._worker_pid(run)
        if self.sandboxed and pid == run.pid:
            if task_exited(run.pid, opener=opener):
                return
            # The sandbox lives on without a pid 2, or this /proc shows no NSpid.
            self._refuse(run, "protocol", "READY, but no worker process (pid 2 of the "
                         "sandbox's pid namespace) to check")
            return
        if self.sandboxed and self.config.profile_of(run.cfg.name) != RESEARCH:
            extra = await trio.to_thread.run_sync(self._others_in_sandbox, run, pid)
            if extra:
                self._refuse(run, "extra_process", "READY with a process besides the worker "
                             f"in its sandbox: {', '.join(extra)}")
                return
        wx_fields = await self._verify_wx(run, pid)
        if wx_fields is None:
            return
        try:
            snap = await trio.to_thread.run_sync(functools.partial(
                maps.exec_snapshot, pid, opener=opener))
        except (maps.ProcessGone, OSError):   # gone between READY and now: its exit is reported
            return
        if snap.hits:
            self._refuse(run, snap.hits[0].kind, f"at READY: {snap.hits[0].describe()}",
                         mappings=[h.describe() for h in snap.hits])
            return
        run.exec_snapshot = snap
        if not run.refused:
            self._set_ready(run, now, **wx_fields)
        # A request answered just before READY may complete after the snapshot: one more
        # look shortly after, not only at the next periodic scan.
        await trio.sleep(0.1)
        try:
            late = await trio.to_thread.run_sync(functools.partial(
                maps.scan_pid, pid, snapshot=snap, opener=opener))
        except (maps.ProcessGone, OSError, ValueError):
            return
        if late:
            self._refuse(run, late[0].kind, f"just after READY: {late[0].describe()}",
                         mappings=[h.describe() for h in late])

    def _others_in_sandbox(self, run: WorkerRun, pid: int) -> list[str]:
        """Live processes of a control-grade sandbox besides its init and the worker.
        None may exist at READY: the runner's lock-down makes fork and clone fail before
        any worker code runs, so one that does was started by code that ran before it
        (a start-up hook the interpreter imported: review of python_path), under the
        start-up filter only and holding the worker's channel fds."""
        out = []
        for other in live_in_sandbox(set(self.worker_pids(run)) - {pid}):
            try:
                with open(f"/proc/{other}/comm") as f:
                    comm = f.read().strip()
            except OSError:
                comm = "?"
            out.append(f"pid {other} ({comm})")
        return sorted(out)

    def _take_listener(self, run: WorkerRun) -> None:
        """Non-blocking: the exec-watch listener fd, if the runner has sent it."""
        from supervisor.sandbox.execwatch import ExecWatch

        inc = run.current
        sock = inc.watch_sock
        if sock is None or inc.watch is not None:
            return
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 16, 1, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return
        if not fds:
            return
        inc.watch = ExecWatch(fds[0], allow_anonymous_exec=run.cfg.jit_kernels, opener=inc.opener)
        # The filters the worker holds now (launch, exec watch; the runtime filter comes
        # right after): at READY the W^X filter must be among those added after these
        # (_verify_wx).
        pid = self._worker_pid(run)
        if pid != run.pid or not self.sandboxed:
            try:
                inc.watch.filters_at_listener = filter_count(pid, opener=inc.opener)
            except (OSError, ValueError):
                pass

    async def _watch_exec(self, run: WorkerRun) -> None:
        """Judge every executable mapping the control worker asks for (seccomp user
        notification): allowed before READY only from read-only files (and, for a worker
        declared jit_kernels, anonymous memory); refused always after READY."""
        inc = run.current
        sock = inc.watch_sock
        if sock is None:
            return
        while inc.watch is None:
            await trio.lowlevel.wait_readable(sock.fileno())
            self._take_listener(run)
            if inc.watch is None:
                await trio.sleep(0.005)   # hang-up without a listener: the exit follows
        watch = inc.watch
        while True:
            await trio.lowlevel.wait_readable(watch.fileno())
            self._poll_status(run)
            if run.refused:
                return
            # A bounded batch per wakeup, off the event loop: before READY each judgement
            # stops the worker and waits for its threads to stop (and for the call's
            # result), which must never hold other workers' watchdogs. The status pipe
            # is still read on the loop, before each judgement.
            verdicts = await trio.to_thread.run_sync(functools.partial(
                watch.handle_pending, max_requests=16,
                before_judging=lambda: trio.from_thread.run_sync(self._poll_status, run)))
            # The verdicts are acted on before any checkpoint: a worker that exits right
            # after its denied request cancels this task at the next one, and a denial
            # dropped there was an ordinary exit, restarted (red team 8 row 12).
            for v in verdicts:
                if v.allowed:
                    inc.exec_allowed += 1
                    continue
                rq = v.request
                self._refuse(run, "exec_memory", f"{rq.syscall}: {v.reason}",
                             syscall=rq.syscall, pid_in_host=rq.pid,
                             prot=rq.prot, target=rq.target)
            await trio.sleep(0)
            if not verdicts:
                if watch.hung_up:         # every watched task is gone: the exit follows
                    return
                await trio.sleep(0.005)


@functools.lru_cache(maxsize=1)
def _kernel_has_mdwe() -> bool:
    return kernel_has_mdwe()


_FIND_WORKER_S = 0.5   # how long a sandbox may show no worker before READY is refused
_DYING_S = 1.0        # how long a worker that could not be checked may take to be gone
