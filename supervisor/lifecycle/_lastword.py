"""The writer of last resort: SAFE on an actuation channel the moment its writer is dead.

When the writer of an actuation channel dies (any cause: crash, kill -9, refused,
watchdog), the supervisor publishes the payload's safe value as the channel's writer of
last resort; that is the last word until the next writer (standby or restart)
publishes. One writer at a time still holds: the supervisor writes only once no process
of the dead writer's sandbox can write (its memory is released: a zombie, see
_procstate.process_dead), and every path that hands the channel to a new writer
(_adopt_standby, _spawn) runs after `_last_word` in the same task, which returns only
once the word is said (or given up, logged). The new writer attaches to the segment
after our Writer is closed and continues the sequence and generations our publish
left (ipc.Writer._attach): readers see no step back.

Who says it: a thread of its own (`LastWordThread`), blocked in poll() on the pidfds of
every actuation writer (the worker process itself, and its sandbox's bwrap). Measured
on the 2-core machine (issue 22, ftrace of kill -9 -> SAFE): the event loop's share was
0.3-11 ms (the loop's wake-up, a 1 ms sleep loop of /proc reads that competed with the
dying worker for the CPU, a publish queued behind other tasks); the thread's is a poll()
wake-up and one check. The rest is the dying process's own teardown (exit_mmap of its
~45 MB, 2-5 ms of CPU, more when preempted), which must be over before anyone may write:
inside do_exit() the kernel still writes the process's memory (clear_child_tid, the
robust futex list), and pending AIO completes in the last mmput.

When bwrap dies first (kill -9 of the sandbox), the worker is killed at once from the
thread (by pidfd: never a recycled pid) instead of waiting for bwrap -> init -> worker.
The event loop's path (`_last_word` without a watch) stays for the cases the thread
does not see: a worker that died before its pidfd was found, an unsandboxed run.
"""
from __future__ import annotations

import os
import select
import threading
import time
from dataclasses import dataclass, field

import trio

from supervisor.config import WorkerConfig

from ._incarnation import Incarnation
from ._procstate import live_in_sandbox
from ._run import WorkerRun

# While a sandbox dies the thread waits on the pidfd of each process left; it looks again
# this often anyway (a process it could not open a pidfd for, a new one in the cgroup),
# sooner when some process has no pidfd.
_RECHECK_S = 0.02
_RECHECK_BLIND_S = 0.002
# The thread's own scheduling: SCHED_FIFO at the lowest real-time priority where the
# supervisor may (root, or CAP_SYS_NICE and RT runtime in its cgroup): above every normal
# task, below every real-time worker. Else nice -10. Measured under load 20 on the 2-core
# machine (ftrace): at nice -10 the woken thread waited 1.5-9 ms for a CPU and was
# preempted mid-publish for up to 12 ms. It runs for about a millisecond per death.
_RT_PRIORITY = 1
_NICE = -10


def _readable(fd: int) -> bool:
    """A pidfd is readable once its process has exited (all threads, a zombie or reaped)."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


@dataclass(eq=False)
class _Watch:
    """One process of an actuation writer, watched by the thread until its last word."""
    run: WorkerRun
    pid: int                        # bwrap (run.pid) of this process's sandbox
    worker_fd: int                  # the thread's own dup of the worker's pidfd
    sandbox_fd: int | None          # pidfd of bwrap
    inc: Incarnation                # the run's process when the watch began
    finished: trio.Event = field(default_factory=trio.Event)   # set from the thread
    dying: bool = False             # worker or bwrap exited: waiting for the rest
    blind: bool = False             # a process left without a pidfd: look again soon
    killed: bool = False            # what was left got its SIGKILL
    since_ns: int = 0               # when it was first seen dying
    wait_fds: list[int] = field(default_factory=list)   # pidfds of what is left (ours)
    outcome: str = ""               # "said", "error", "forgotten"


class LastWordThread:
    """Blocks in poll() on the pidfds of actuation writers and publishes SAFE as soon as
    a writer's sandbox can no longer write (see the module doc). The Supervisor's
    methods do the judging and the publishing; this class owns the fds and the thread."""

    def __init__(self, sup: _LastResort, token: trio.lowlevel.TrioToken) -> None:
        self.sup = sup
        self.token = token
        self._lock = threading.Lock()
        self._watches: dict[int, _Watch] = {}          # by id(run)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop = False
        self._to_close: list[int] = []                  # fds only the thread closes
        self.scheduling = ""                            # what _prioritize() got
        self._thread = threading.Thread(target=self._main, name="last-word", daemon=True)
        self._thread.start()
        self.scheduling = _prioritize(self._thread.native_id)

    # ------------------------------------------------------------ trio side

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def watch(self, run: WorkerRun, worker_pidfd: int) -> _Watch | None:
        """Watch the run's current process (its worker's pidfd is duplicated: the run
        may close its own). None when the thread is not running."""
        if not self.alive():
            return None
        try:
            sandbox_fd = os.pidfd_open(run.pid)
        except OSError:             # bwrap already gone: the worker's pidfd is enough
            sandbox_fd = None
        w = _Watch(run, run.pid, os.dup(worker_pidfd), sandbox_fd, run.current)
        with self._lock:
            old = self._watches.pop(id(run), None)
            self._watches[id(run)] = w
        if old is not None:
            self._finish(old, "forgotten")
        self._wake()
        return w

    def current(self, run: WorkerRun) -> _Watch | None:
        with self._lock:
            w = self._watches.get(id(run))
        return w if w is not None and w.pid == run.pid else None

    def forget(self, run: WorkerRun) -> None:
        """The run's process is done with (its fds close): no word from the thread."""
        with self._lock:
            w = self._watches.pop(id(run), None)
        if w is not None:
            self._finish(w, "forgotten")
        self._wake()

    def stop(self) -> None:
        self._stop = True
        self._wake()
        self._thread.join(timeout=5)
        with self._lock:
            left, self._watches = list(self._watches.values()), {}
        for w in left:
            self._finish(w, "forgotten")
        if not self._thread.is_alive():     # (a stuck thread keeps its fds: never reused)
            self._close_deferred()
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)

    # ------------------------------------------------------------ the thread

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _main(self) -> None:
        while not self._stop:
            self._close_deferred()
            with self._lock:
                watches = list(self._watches.values())
            p = select.poll()
            p.register(self._wake_r, select.POLLIN)
            owner: dict[int, _Watch] = {}
            timeout = None
            for w in watches:
                fds = w.wait_fds if w.dying else [w.worker_fd, w.sandbox_fd]
                for fd in fds:
                    if fd is not None:
                        p.register(fd, select.POLLIN)
                        owner[fd] = w
                if w.dying:
                    ms = (_RECHECK_BLIND_S if w.blind else _RECHECK_S) * 1000
                    timeout = ms if timeout is None else min(timeout, ms)
            ready = p.poll(timeout)
            try:
                while os.read(self._wake_r, 64):
                    pass
            except OSError:
                pass
            hit = {owner[fd] for fd, _ in ready if fd in owner}
            for w in watches:
                if w in hit or w.dying:
                    try:
                        self._step(w)
                    except Exception as e:     # never the thread's end: the loop's path
                        self._report("last_word_error", w, reason=f"{type(e).__name__}: {e}")
                        self._finish(w, "error")
                    if w.outcome:              # forgotten by the loop during the step
                        self._close_wait(w)

    def _step(self, w: _Watch) -> None:
        """The watched writer (or its sandbox) exited: kill what is left, and once
        nothing of it can write, say the last word."""
        with self._lock:
            if self._watches.get(id(w.run)) is not w:
                return                     # forgotten meanwhile
        if not w.dying:
            w.dying, w.since_ns = True, time.monotonic_ns()
        left = self.sup._writer_left(w.run, worker_fd=w.worker_fd, inc=w.inc)
        if not left:
            self._close_wait(w)
            said = self.sup._say_last_word(w.run, since_ns=w.since_ns, by="thread")
            self._finish(w, "said" if said else "error")
            return
        if time.monotonic_ns() - w.since_ns > self.sup.grace_s * 1e9:
            self._report("last_word_error", w, reason=(
                f"its processes outlived it by {self.sup.grace_s:g} s; not writing "
                "(the readers' max age still guards)"))
            self._finish(w, "error")
            return
        if not w.killed:
            # What is left of a sandbox whose bwrap or worker died is dying anyway (its
            # pid namespace goes): SIGKILL now saves the chain bwrap -> init -> worker.
            w.killed = True
            w.inc.kill_rest([p for p in left if p > 0], w.worker_fd if -1 in left else None)
        # Wait on what is left, each by pidfd (readable once dead), not by polling /proc.
        self._close_wait(w)
        w.blind = False
        for pid in left:
            if pid == -1:
                w.wait_fds.append(os.dup(w.worker_fd))
                continue
            try:
                w.wait_fds.append(os.pidfd_open(pid))
            except OSError:
                w.blind = True             # gone already, most likely: the next check says

    def _close_wait(self, w: _Watch) -> None:
        for fd in w.wait_fds:
            os.close(fd)
        w.wait_fds = []

    def _close_deferred(self) -> None:
        with self._lock:
            fds, self._to_close = self._to_close, []
        for fd in fds:
            os.close(fd)

    def _report(self, event: str, w: _Watch, **fields) -> None:
        run = w.run
        self._soon(lambda: self.sup.log.emit(event, worker=run.cfg.name, pid=w.pid, **fields))

    def _soon(self, fn) -> None:
        try:
            self.token.run_sync_soon(fn)
        except trio.RunFinishedError:
            pass

    def _finish(self, w: _Watch, outcome: str) -> None:
        """Done with a watch (once): its fds close, the loop's `_last_word` goes on."""
        with self._lock:
            if w.outcome:
                return
            w.outcome = outcome
            if self._watches.get(id(w.run)) is w:
                del self._watches[id(w.run)]
        fds = [fd for fd in (w.worker_fd, w.sandbox_fd, *w.wait_fds) if fd is not None]
        w.wait_fds = []
        if threading.current_thread() is self._thread:
            for fd in fds:
                os.close(fd)
            self._soon(w.finished.set)
        else:
            # The thread may be polling them right now: it closes them (a number closed
            # under it could be reused by another fd and be misread).
            with self._lock:
                self._to_close.extend(fds)
            self._wake()
            w.finished.set()               # called from the loop itself


def _prioritize(tid: int | None) -> str:
    """Thread `tid` first to a CPU when it wakes (see _RT_PRIORITY); what it got."""
    if tid is None:
        return "normal"
    try:
        os.sched_setscheduler(tid, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK,
                              os.sched_param(_RT_PRIORITY))
        return f"SCHED_FIFO {_RT_PRIORITY}"
    except OSError:
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, _NICE)
        return f"nice {_NICE}"
    except OSError:
        return "normal"     # (a unit without CAP_SYS_NICE / with RestrictRealtime=yes)


class _LastResort:
    """The writer of last resort (mixed into `Supervisor`; see the module doc)."""

    _lastword: LastWordThread | None = None

    def _start_last_word_thread(self) -> None:
        if self.sandboxed and any(self._actuation_of(w) for w in self.config.workers.values()):
            from supervisor.failsafe import prepare

            prepare()                      # imports done now, not at the first death
            self._lastword = LastWordThread(self, trio.lowlevel.current_trio_token())
            # how soon it can run when a writer dies: an operator reads it here
            self.log.emit("last_word_thread", scheduling=self._lastword.scheduling,
                          workers=[w.name for w in self.config.workers.values()
                                   if self._actuation_of(w)])

    def _stop_last_word_thread(self) -> None:
        lw, self._lastword = self._lastword, None
        if lw is not None:
            lw.stop()

    def _actuation_of(self, w: WorkerConfig) -> list[str]:
        """The actuation channels (with a safe payload) that worker `w` writes."""
        return [ch for ch in w.publishes if ch in self.channels
                and self.config.channels[ch].actuation and self.config.channels[ch].payload]

    async def _guard_writer(self, run: WorkerRun) -> None:
        """Watch the worker process itself (not bwrap: bwrap learns of the death through
        its own child, later): the thread says the last word the moment it dies."""
        if not self.sandboxed or run.is_standby or not self._actuation_of(run.cfg):
            return
        fd = await self._open_worker_pidfd(run)
        if fd is None:
            return                     # died before it was found: the exit path speaks
        if self._lastword is not None and self._lastword.watch(run, fd) is not None:
            return
        await trio.lowlevel.wait_readable(fd)    # no thread: the loop's own path
        await self._last_word(run)

    async def _open_worker_pidfd(self, run: WorkerRun) -> int | None:
        """A pidfd of the run's worker process, once its sandbox shows one."""
        while run.alive:
            pid = self._worker_pid(run)
            if pid != run.pid:
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    fd = None
                if fd is not None:
                    if pid in self.worker_pids(run):   # still ours, not a recycled pid
                        run.current.worker_pidfd = fd
                        return fd
                    os.close(fd)
            await trio.sleep(0.01)
        return None

    def _writer_left(self, run: WorkerRun, *, worker_fd: int | None = None,
                     inc: Incarnation | None = None) -> list[int]:
        """The processes of the run's sandbox that could still write a channel: the
        worker until it is dead (its pidfd readable; -1 here), and every other process
        of the sandbox but bwrap's own two (the outer bwrap and its init, pid 1 inside),
        which never map a segment. A process inside do_exit() is not dead enough (see
        _procstate.process_dead). Empty: the writer is gone. Called from the
        last-word thread too (with its own fds and the incarnation the watch began with)."""
        inc = run.current if inc is None else inc
        if worker_fd is None:
            worker_fd = inc.worker_pidfd if inc is not None else None
        if inc is None:
            return []
        if not self.sandboxed:
            return [inc.pid] if inc.alive else []
        # Its cgroup's members (bwrap gone or not), else bwrap's descendants; through the
        # broker, its `pids` request (empty once reaped: the reap killed what was left).
        left = live_in_sandbox(inc.members() - {inc.pid})
        if worker_fd is not None and not _readable(worker_fd):
            left.append(-1)
        return left

    async def _last_word(self, run: WorkerRun) -> None:
        """Publish SAFE on each actuation channel `run` writes, once its writer is dead
        (once per process of the run). Returns only when it is said or given up."""
        names = self._actuation_of(run.cfg)
        if not names or run.last_word_said or run.is_standby:
            return
        lw = self._lastword
        watch = lw.current(run) if lw is not None else None
        if watch is not None:
            # The thread says it; a thread that died says nothing, hence the bound.
            with trio.move_on_after(self.grace_s + 1.0):
                await watch.finished.wait()
            if watch.outcome != "said" and not run.last_word_said:
                lw.forget(run)
            if run.last_word_said or watch.outcome == "error":
                return
        died_ns = time.monotonic_ns()
        deadline = died_ns + int(self.grace_s * 1e9)
        left = self._writer_left(run)
        if left and run.current is not None and (not run.alive or -1 not in left):
            run.current.kill_rest([p for p in left if p > 0], None)
        while self._writer_left(run):
            if time.monotonic_ns() > deadline:
                self.log.emit("last_word_error", worker=run.cfg.name, pid=run.pid,
                              reason=f"its processes outlived it by {self.grace_s:g} s; "
                                     "not writing (the readers' max age still guards)")
                return
            await trio.sleep(0.001)
        self._say_last_word(run, since_ns=died_ns, by="loop")

    def _say_last_word(self, run: WorkerRun, *, since_ns: int, by: str) -> bool:
        """Publish SAFE on the run's actuation channels (its writer is dead: the caller
        checked), once per process; from the loop or the thread. The events are the
        loop's: from the thread they are queued to it, ahead of the thread's `finished`."""
        from supervisor.failsafe import publish_safe, trusted_readers

        with run.last_word_lock:
            if run.last_word_said:     # the other path said it meanwhile
                return True
            run.last_word_said = True
            events = []
            for name in self._actuation_of(run.cfg):
                payload = self.config.channels[name].payload
                said_ns = time.monotonic_ns()      # (just before: no reader takes it earlier)
                try:
                    # A stop's word is SHUTDOWN, a death's WRITER_LOST: neither reads
                    # as the domain failed safe (red team 16 row 4).
                    values = publish_safe(self.channels[name], payload,
                                          trusted_readers(self.config, name), lost=True,
                                          stopped=self._stopping)
                except Exception as e:   # logged: the reader-side max age still guards it
                    events.append(("last_word_error", dict(
                        worker=run.cfg.name, channel=name, reason=f"{type(e).__name__}: {e}")))
                else:
                    # said_ns: when SAFE was published (the thread's event is emitted
                    # later, from the loop: its own mono_ns can follow a reader's take).
                    events.append(("last_word", dict(
                        worker=run.cfg.name, pid=run.pid, channel=name, payload=payload,
                        waited_ms=round((time.monotonic_ns() - since_ns) / 1e6, 3), by=by,
                        said_ns=said_ns, **values)))
        lw = self._lastword
        for event, fields in events:
            if by == "thread" and lw is not None:
                lw._soon(lambda e=event, f=fields: self.log.emit(e, **f))
            else:
                self.log.emit(event, **fields)
        return True
