"""Real-time class for READY control workers (config ``realtime_priority``; the kernel
side and the why are in supervisor/sandbox/sched.py)."""
from __future__ import annotations

import os

from supervisor.sandbox.cgroups import rt_budget_of

from ._incarnation import BrokerIncarnation
from ._run import WorkerRun


class _Realtime:
    """RT bandwidth for the tree, SCHED_FIFO at READY (mixed into `Supervisor`)."""

    def _reserve_realtime(self) -> None:
        """The tree's RT bandwidth: every RT worker's budget plus the largest once more
        (a restarted or adopted run may be READY before the dead run's cgroup is gone)."""
        from supervisor.sandbox.sched import RT_PERIOD_US

        budgets = [w.realtime().budget_pct for w in self.config.workers.values()
                   if w.realtime_priority is not None]
        self.rt_grouped = False
        if not budgets or self.cgroups is None:
            return
        # The kernel keeps sched_rt_runtime_us (95 % by default) for all RT groups:
        # with the spare if it fits, else exactly the budgets.
        err: OSError | None = None
        for pct in dict.fromkeys((min(sum(budgets) + max(budgets), 90), sum(budgets))):
            try:
                self.rt_grouped = self.cgroups.reserve_rt(pct * RT_PERIOD_US // 100,
                                                          RT_PERIOD_US)
                return
            except OSError as e:
                err = e
        # The parent cgroup has less RT bandwidth than that: each grant fails below,
        # and each worker runs in the normal class with an event saying why.
        self.log.emit("realtime_unavailable", worker=None,
                      reason=f"reserving {sum(budgets)} % of a CPU for RT workers: {err} "
                             "(the supervisor's own cgroup has less RT runtime: give it "
                             "cpu.rt_runtime_us, or run the workers in the normal class)")
        self.rt_grouped = True          # the leaves have RT files: SCHED_FIFO needs them

    def _make_realtime(self, run: WorkerRun) -> None:
        """SCHED_FIFO for the worker's main thread, once READY; a refusal is an event,
        not a failure (the worker runs on in the normal class)."""
        from supervisor.sandbox.sched import RT_PERIOD_US, RealtimeUnavailable

        rt = run.cfg.realtime()
        if rt is None:
            return
        name = run.cfg.name
        bound = "global sched_rt_runtime_us only (no RT group scheduling)"
        try:
            if not self.sandboxed:
                # Its own rlimits and capabilities would be the supervisor's.
                raise RealtimeUnavailable("not sandboxed: the worker could raise it itself")
            pid = self._worker_pid(run)
            if pid == run.pid:
                raise RealtimeUnavailable("no worker process in the sandbox")
            grouped = self.rt_grouped and run.cgroup is not None
            if not grouped and isinstance(run.current, BrokerIncarnation) \
                    and run.current.in_cgroup:
                # Through the broker, which holds the tree (self.cgroups is None here):
                # its `realtime` grants the leaf's budget where the kernel has RT group
                # scheduling for the worker's cpu cgroup, which we can read.
                grouped = rt_budget_of(pid) is not None
            if not grouped:
                # Nothing bounds a runaway but the kernel's 95 % of each CPU: one CPU at
                # least stays outside the real-time class, the supervisor's included.
                cpus = len(os.sched_getaffinity(0))
                held = [r.cfg.name for r in self.runs.values()
                        if r is not run and r.realtime_pid and r.alive]
                if len(held) + 1 >= cpus:
                    raise RealtimeUnavailable(
                        f"no per-cgroup RT budget here and {len(held)} real-time worker(s) "
                        f"({', '.join(held) or 'none'}) on {cpus} CPU(s): one CPU always "
                        "stays outside the real-time class")
            # Through the incarnation: this process (its cgroup's RT budget, then
            # sched_setscheduler) or the broker's `realtime` request.
            run.current.make_fifo(pid, rt.priority, rt.runtime_us if grouped else None,
                                  lambda: pid == self._worker_pid(run))
        except (RealtimeUnavailable, OSError) as e:
            self.log.emit("realtime_unavailable", worker=name, reason=str(e))
            return
        if grouped:
            # The budget as the kernel has it now (whoever granted it), else as asked.
            got = rt_budget_of(pid)
            runtime, period = got if got and got[0] > 0 and got[1] > 0 \
                else (rt.runtime_us, RT_PERIOD_US)
            bound = f"{runtime * 100 // period} % of a CPU per {period // 1000} ms (cgroup)"
        run.realtime_pid = pid
        self.log.emit("realtime", worker=name, pid=pid, policy="fifo",
                      priority=rt.priority, reset_on_fork=True, bound=bound)
