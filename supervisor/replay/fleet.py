"""Many logs at once: ``supervisor replay DIR... --jobs N`` or ``--ray ADDRESS``.

Each job is one whole ``supervisor replay LOG --out OUT/<name>`` in a process of its own
(its own supervisor, sandboxes and channels), here in a pool of N, or as Ray tasks on
an existing cluster (``--ray local`` starts a local one). A job that fails (the replay
exits with anything but 0, 6 = differs or 2 = bad input, or the process dies) is retried
once into a fresh directory; both attempts are in the report. Bad input (a corrupt log,
one of another schema version, a config that does not load: exit 2) is never retried:
it would fail the same way again, and a CI log would show it twice as a flaky failure.
No log is ever missing from the report, and one log that could not run loses nothing
else: the others are replayed and judged all the same.

The fleet's exit code, the most telling of its jobs' (`FleetReport.exit_code`): 6 if
any log differs (a verdict on the product), else 7 if any replay failed (incomplete, a
worker died, a timeout: a product crash reads like this too), else 2 if any log could
not run (bad input: a verdict on the input, named one line each on stderr), else 0.

A stop signal (Ctrl-C, SIGTERM: a CI job cancelled) stops the fleet: it is passed on to
every running replay (each stops in order and reports itself interrupted), nothing is
retried or started after it, every log without a verdict is listed `interrupted`, and
the fleet exits 7 (unless a log already differs: 6). Before, the fleet process only
recorded the signal: a SIGTERM was never obeyed (the fleet ran on to the end and exited
0), and a Ctrl-C's interrupted replays were retried.

On a Ray cluster each task runs ``supervisor replay`` on whichever node Ray picks: the
logs and OUT must be at the same paths on every node (a shared filesystem), and each
node needs what a replay needs here (root for the sandboxes, bubblewrap, the package).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from supervisor.outdir import OutDir, OutDirError

from .logfmt import MESSAGES
from .progress import FleetProgress
from .run import DIFFERS

RETRIES = 1
BAD_INPUT = 2                   # `supervisor replay`'s exit for a log it cannot read
NO_RETRY = (0, DIFFERS, BAD_INPUT)   # outcomes a second try would only repeat
UNJUDGED = ("failed", "bad_input", "interrupted")   # a log the fleet gives no verdict on
NOT_RUN = -1                    # exit_code of a job a stopped fleet never started

# The replays running here (local mode), for passing a stop signal on; and the stop.
_live: set[subprocess.Popen] = set()
_live_lock = threading.Lock()
_stop = threading.Event()


class FleetError(Exception):
    """One line: why the fleet cannot start."""


def expand(paths: list[str]) -> list[str]:
    """Log directories: each path is a log, or a directory whose children are logs."""
    out: list[str] = []
    for p in paths:
        d = Path(p)
        if (d / MESSAGES).is_file():
            out.append(str(d.resolve()))
        elif d.is_dir():
            kids = sorted(str(c.resolve()) for c in d.iterdir() if (c / MESSAGES).is_file())
            if not kids:
                raise FleetError(f"{p}: neither a drive log nor a directory of drive logs")
            out += kids
        else:
            raise FleetError(f"{p}: no such directory")
    names = [Path(x).name for x in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise FleetError(f"two logs named {dup[0]!r}: runs are named after their logs")
    return out


@dataclass
class Attempt:
    run_dir: str
    exit_code: int
    wall_s: float
    error: str = ""


@dataclass
class JobResult:
    log: str
    name: str
    attempts: list[Attempt] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    interrupted: bool = False        # the fleet was stopped before this log's verdict

    @property
    def final(self) -> Attempt:
        return self.attempts[-1]

    @property
    def status(self) -> str:
        code = self.final.exit_code
        if self.interrupted and code not in (0, DIFFERS, BAD_INPUT):
            return "interrupted"
        return {0: "ok", DIFFERS: "differs", BAD_INPUT: "bad_input"}.get(code, "failed")

    def line(self) -> str:
        """One line for a log that did not get a verdict (stderr, a CI log)."""
        err = self.final.error.removeprefix("supervisor replay: ") or f"exit {self.final.exit_code}"
        if self.status == "bad_input":
            return f"{self.log}: could not run (bad input, exit 2, not retried): {err}"
        return (f"{self.log}: failed (exit {self.final.exit_code}, {len(self.attempts)} "
                f"attempts): {err}")


def job_argv(log: str, run_dir: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "supervisor.cli", "replay", log, "--out", run_dir,
            "--no-progress", *extra]


def run_job(log: str, run_dir: str, extra: list[str], timeout_s: float) -> dict[str, Any]:
    """One replay in its own process; what it left behind. Runs here or on a Ray node."""
    t0 = time.monotonic()
    if _stop.is_set():
        return {"exit_code": NOT_RUN, "wall_s": 0.0, "summary": None,
                "error": "not run: the fleet was stopped"}
    p = subprocess.Popen(job_argv(log, run_dir, extra), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    with _live_lock:
        _live.add(p)
    try:
        _, stderr = p.communicate(timeout=timeout_s)
        code, err = p.returncode, stderr.strip().splitlines()[-1:]
        err_text = err[0] if err and code not in (0, DIFFERS) else ""
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        code, err_text = 124, f"no result within {timeout_s:.0f} s"
    finally:
        with _live_lock:
            _live.discard(p)
    summary = None
    try:
        summary = json.loads(Path(run_dir, "summary.json").read_text())
    except (OSError, ValueError):
        pass
    if code < 0:
        err_text = f"killed by signal {-code}"
    return {"exit_code": code, "wall_s": time.monotonic() - t0, "error": err_text,
            "summary": summary}


def _attempt_dir(out: str, name: str, k: int) -> str:
    return os.path.join(out, name if k == 0 else f"{name}.retry{k}")


def _pass_on(sig: int) -> None:
    """A stop: no replay starts after it, and each running one gets the signal (it stops
    in order and reports itself interrupted). A terminal's Ctrl-C reached them already:
    a second one changes nothing there."""
    _stop.set()
    with _live_lock:
        for p in list(_live):
            try:
                p.send_signal(sig)
            except OSError:
                pass


def _execute(logs: list[str], out: str, extra: list[str], submit, timeout_s: float,
             progress: FleetProgress | None = None,
             stop_signal=lambda: None) -> list[JobResult]:
    """``stop_signal()``: the stop signal received since the last call, or None."""
    results = {log: JobResult(log, Path(log).name) for log in logs}
    pending = {log: submit(log, _attempt_dir(out, Path(log).name, 0)) for log in logs}
    tries = {log: 0 for log in logs}
    shown = -1.0
    stopped = False
    while pending:
        if not stopped and stop_signal() is not None:
            stopped = True
            for r in results.values():
                r.interrupted = r.log in pending or not r.attempts
        if progress is not None and time.monotonic() - shown >= 1.0:
            shown = time.monotonic()
            done = [r for r in results.values() if r.attempts and r.log not in pending]
            progress.update(len(done), sum(r.status in UNJUDGED for r in done), len(pending))
        for log, fut in list(pending.items()):
            got = fut()
            if got is None:
                continue
            del pending[log]
            r = results[log]
            r.attempts.append(Attempt(got["run_dir"], got["exit_code"], round(got["wall_s"], 2),
                                      got["error"]))
            r.summary = got["summary"]
            if stopped:
                r.interrupted = True
            elif got["exit_code"] not in NO_RETRY and tries[log] < RETRIES:
                tries[log] += 1
                pending[log] = submit(log, _attempt_dir(out, r.name, tries[log]))
        time.sleep(0.05)
    if progress is not None:
        progress.update(len(logs), sum(r.status in UNJUDGED for r in results.values()), 0)
    return [results[log] for log in logs]


def run_local(logs: list[str], out: str, jobs: int, extra: list[str],
              timeout_s: float, progress: FleetProgress | None = None,
              stop_signal=lambda: None) -> list[JobResult]:
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))

    def submit(log: str, run_dir: str):
        f = pool.submit(run_job, log, run_dir, extra, timeout_s)
        return lambda: ({**f.result(), "run_dir": run_dir} if f.done() else None)

    try:
        return _execute(logs, out, extra, submit, timeout_s, progress, stop_signal)
    finally:
        pool.shutdown(wait=True)


def run_ray(logs: list[str], out: str, address: str, extra: list[str], timeout_s: float,
            cpus_per_job: float = 1.0, progress: FleetProgress | None = None,
            stop_signal=lambda: None) -> list[JobResult]:
    try:
        import ray
    except ImportError:
        raise FleetError("--ray needs the 'fleet' extra: pip install "
                         "'supervisor[fleet]' (from a checkout: pip install '.[fleet]')") from None
    started = not ray.is_initialized()
    if started:
        kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address == "local":
            kw["num_cpus"] = os.cpu_count()
        else:
            kw["address"] = address
        try:
            ray.init(**kw)
        except Exception as e:   # ConnectionError and Ray's own: one line
            raise FleetError(f"--ray {address}: cannot join the cluster: {e}") from None
    # Ray does no retry of its own: the retry (and its report) is ours.
    remote = ray.remote(num_cpus=cpus_per_job, max_retries=0)(run_job)

    def submit(log: str, run_dir: str):
        ref = remote.remote(log, run_dir, extra, timeout_s)

        def poll():
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                return None
            try:
                return {**ray.get(ref), "run_dir": run_dir}
            except Exception as e:   # the task (or its node) died
                return {"exit_code": 125, "wall_s": 0.0, "summary": None,
                        "error": f"ray task failed: {type(e).__name__}: {str(e)[:200]}",
                        "run_dir": run_dir}
        return poll

    try:
        # (a stop is not passed on to Ray's nodes: they run their replays to the end)
        return _execute(logs, out, extra, submit, timeout_s, progress, stop_signal)
    finally:
        if started:
            ray.shutdown()


@dataclass
class FleetReport:
    out: str
    mode: str
    wall_s: float
    jobs: list[JobResult]
    interrupted: str | None = None   # the stop signal that ended the fleet early

    @property
    def exit_code(self) -> int:
        """6 any differs, else 7 any failed, else 2 any bad input, else 0: a verdict on
        the product first (a log that could not run must not hide a regression in
        another), and never 0 while a log went unjudged."""
        st = {j.status for j in self.jobs}
        if self.interrupted:
            st.add("failed")                # never 0: the fleet did not finish
        for status, code in (("differs", DIFFERS), ("failed", 7), ("interrupted", 7),
                             ("bad_input", BAD_INPUT)):
            if status in st:
                return code
        return 0

    def as_dict(self) -> dict[str, Any]:
        frames = sum(((j.summary or {}).get("frames") or {}).get("replayed", 0) for j in self.jobs)
        return {"out": self.out, "mode": self.mode, "wall_s": round(self.wall_s, 2),
                "logs": len(self.jobs), "frames": frames,
                "ok": sum(j.status == "ok" for j in self.jobs),
                "differs": sum(j.status == "differs" for j in self.jobs),
                "failed": sum(j.status == "failed" for j in self.jobs),
                "bad_input": sum(j.status == "bad_input" for j in self.jobs),
                "interrupted": self.interrupted,
                "not_judged": sum(j.status == "interrupted" for j in self.jobs),
                "retried": sum(len(j.attempts) > 1 for j in self.jobs),
                "exit_code": self.exit_code,
                "jobs": [{"log": j.log, "status": j.status,
                          "attempts": [asdict(a) for a in j.attempts],
                          "frames": ((j.summary or {}).get("frames") or {}).get("replayed"),
                          "model_p99_ms": ((j.summary or {}).get("model_latency_ms") or {}
                                           ).get("p99"),
                          "diff_ok": ((j.summary or {}).get("diff") or {}).get("ok")}
                         for j in self.jobs]}

    def markdown(self) -> str:
        d = self.as_dict()
        lines = [f"### Fleet replay ({d['mode']}): {d['logs']} logs, {d['ok']} ok, "
                 f"{d['differs']} differ, {d['failed']} failed, {d['bad_input']} could not "
                 f"run (bad input), {d['retried']} retried, "
                 f"{d['wall_s']:.1f} s"
                 + (f"; INTERRUPTED by {self.interrupted}: {d['not_judged']} logs not judged"
                    if self.interrupted else ""), "",
                 "| log | status | attempts | frames | model p99 ms |", "|---|---|---:|---:|---:|"]
        for j in d["jobs"]:
            p99 = "" if j["model_p99_ms"] is None else f"{j['model_p99_ms']:.2f}"
            err = next((a["error"] for a in reversed(j["attempts"]) if a["error"]), "")
            err = err.removeprefix("supervisor replay: ")
            status = "could not run (bad input)" if j["status"] == "bad_input" else j["status"]
            why = f" ({err})" if err and j["status"] in UNJUDGED else ""
            lines.append(f"| `{Path(j['log']).name}` | {status}{why} | "
                         f"{len(j['attempts'])} | {j['frames'] or ''} | {p99} |")
        return "\n".join(lines) + "\n"


def replay_fleet(paths: list[str], out: str, *, jobs: int = 1, ray: str | None = None,
                 extra: list[str] | None = None, timeout_s: float = 1800.0,
                 progress_out=None) -> FleetReport:
    """``progress_out``: a terminal for the progress line (logs done/total, ETA)."""
    logs = expand(paths)
    out = os.path.abspath(out)
    if os.path.exists(out) and os.listdir(out):
        raise FleetError(f"{out}: exists and is not empty")
    # OUT by supervisor.outdir's rule (each run's RUN inside it is checked again by its
    # replay): another user's OUT, or one they could swap, is refused (red team round 5).
    try:
        out_dir = OutDir.open(out, what="replay --out (fleet)", mode=0o755, parents=True)
    except OutDirError as e:
        raise FleetError(str(e)) from None
    from supervisor import signals

    # The CLI's signal pipe (a stop signal is a byte there from the process's start):
    # read here, or a SIGTERM would never be obeyed. Embedded, handlers are ours to give back.
    embedded = signals._pipe is None
    pipe = signals.install()
    got: list[str] = []

    def stop_signal() -> str | None:
        stops = [x for x in (pipe.drain() if pipe is not None else [])
                 if x in signals.STOP_SIGNALS]
        if not stops:
            return None
        got.append(signal.Signals(stops[0]).name)
        _pass_on(stops[0])
        return got[0]

    _stop.clear()
    with out_dir:
        t0 = time.monotonic()
        bar = FleetProgress(len(logs), progress_out)
        try:
            if ray is not None:
                res = run_ray(logs, out, ray, extra or [], timeout_s, progress=bar,
                              stop_signal=stop_signal)
            else:
                res = run_local(logs, out, jobs, extra or [], timeout_s, progress=bar,
                                stop_signal=stop_signal)
        finally:
            bar.close()
            if embedded:
                signals.uninstall()
        rep = FleetReport(out, f"ray {ray}" if ray else f"jobs {jobs}",
                          time.monotonic() - t0, res, got[0] if got else None)
        out_dir.write_text("fleet.json", json.dumps(rep.as_dict(), indent=2))
        out_dir.write_text("fleet.md", rep.markdown())
    return rep
