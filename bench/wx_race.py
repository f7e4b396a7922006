"""Races against the exec watch, before and after it stops the worker while judging;
and what the W^X lock at READY costs.

    python bench/wx_race.py [--tries 200] [--spread-us 600] [--startups 3] [--json F]

Everything runs as the supervisor runs it: a worker in a real control sandbox
(bubblewrap, launch + runtime seccomp filters, the exec watch), whose listener this
process serves with `ExecWatch`. Refusals are answered (EPERM) but, unlike the
supervisor, do not end the worker, so that every try is counted.

1. Races (issue 21): `workers/probe/attacks.py` `cow_race_tries` (thread 1 asks
   mprotect(R|X) of a clean page of libz while thread 2 mremaps a patched
   copy-on-write copy onto it) and `fd_swap_tries` (thread 1 asks mmap(R|X) of libz's
   fd while thread 2 dup2()s a /tmp copy onto that fd number), `--tries` each, thread
   2 firing 0..--spread-us after thread 1 enters the kernel. A win: the page became
   executable holding the patched byte / the new code mapping is the /tmp file.
   "before": `ExecWatch.freeze = False` (the judgement as it was: look, then CONTINUE
   while the worker runs on); "after": the default (the worker stopped while judged,
   the kernel's result checked before it runs again). The same code otherwise.
2. Start-up: importing numpy, capnp, tinygrad and trio under the watch (every
   executable mapping judged), freeze off vs on: wall time and per judgement; alone
   (nothing is stopped while the caller is the only thread) and with one more thread
   (every judgement stops the worker and checks the call's result).
3. The lock at READY: `wx.lock()` in the worker (MDWE + the filter) and `wx.verify()`
   from outside (every thread seized, its filters read back).
4. Per frame: a frame-like loop (64 bytes over a socketpair and back, poll: 5
   syscalls) and a bare syscall, before and after `wx.lock()` in the same process.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.sandbox import wx  # noqa: E402
from supervisor.sandbox.execwatch import ExecWatch  # noqa: E402
from supervisor.sandbox.launch import spawn  # noqa: E402
from supervisor.sandbox.policy import policy_for_domain  # noqa: E402

WORKER = r"""
import json, os, socket, sys, time
sock = socket.socket(fileno=int(sys.argv[1]))
from supervisor.sandbox import seccomp
lfd = seccomp.install_exec_watch()     # the runner's order: the listener leaves first,
socket.send_fds(sock, [b"L"], [lfd])   # the lock-down (which kills sendmsg) follows
os.close(lfd)
seccomp.lock_down("control")
rfile = sock.makefile("r")
def say(**kw):
    sock.sendall((json.dumps(kw) + "\n").encode())
for line in rfile:
    cmd, *args = line.split()
    if cmd in ("imports", "imports_threaded"):
        if cmd == "imports_threaded":   # a thread already there: every judgement stops it
            import threading
            threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
        t0 = time.perf_counter()
        import numpy, capnp, tinygrad, trio
        say(s=time.perf_counter() - t0)
    elif cmd in ("cow", "fd", "cow_newthread"):
        from workers.probe import attacks
        if cmd == "cow_newthread":   # thread 2 acts through a thread born just then
            say(**attacks.cow_race_tries(int(args[0]), int(args[1]), new_thread=True))
        else:
            fn = attacks.cow_race_tries if cmd == "cow" else attacks.fd_swap_tries
            say(**fn(int(args[0]), int(args[1])))
    elif cmd == "lock":
        from supervisor.sandbox import wx
        t0 = time.perf_counter()
        got = wx.lock()
        say(s=time.perf_counter() - t0, mdwe=got.mdwe, tid=os.getpid())
    elif cmd == "quit":
        break
"""


class Served:
    """An ExecWatch answered from a thread; refusals are counted, never fatal."""

    def __init__(self, watch: ExecWatch) -> None:
        self.watch = watch
        self.verdicts: list = []
        self.judge_s: list[float] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while not self._stop.is_set() and not self.watch.hung_up:
            select.select([self.watch], [], [], 0.05)
            t0 = time.perf_counter()
            got = self.watch.handle_pending(max_requests=1)
            if got:
                self.judge_s.append(time.perf_counter() - t0)
                self.verdicts += got

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


class Worker:
    def __init__(self, *, freeze: bool) -> None:
        a, b = socket.socketpair()
        a.settimeout(600)
        self.proc = spawn(policy_for_domain("control"),
                          [sys.executable, "-c", WORKER, str(b.fileno())], pass_fds=[b.fileno()],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        b.close()
        _, fds, _, _ = socket.recv_fds(a, 1, 1)
        watch = ExecWatch(fds[0])
        watch.freeze = freeze
        self.served = Served(watch)
        self.sock, self.lines = a, a.makefile("r")

    def do(self, cmd: str) -> dict:
        self.sock.sendall(cmd.encode() + b"\n")
        line = self.lines.readline()
        if not line:
            err = self.proc.stderr.read()[-2000:] if self.proc.stderr else ""
            return {"died": self.proc.wait(10), "stderr": err}
        return json.loads(line)

    def close(self) -> None:
        try:
            self.sock.sendall(b"quit\n")
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.served.stop()
        self.served.watch.close()
        self.sock.close()


def races(tries: int, spread_us: int) -> dict:
    out: dict = {}
    for label, freeze in (("before", False), ("after", True)):
        for race in ("cow", "fd"):
            w = Worker(freeze=freeze)
            try:
                w.do("imports")                       # start-up out of the way
                n0 = len(w.served.verdicts)
                t0 = time.perf_counter()
                got = w.do(f"{race} {tries} {spread_us}")
                took = time.perf_counter() - t0
                vs = w.served.verdicts[n0:]
                got.update(verdicts=len(vs), caught_after_call=sum(
                    1 for v in vs if v.reason.startswith("after the call")),
                    s=round(took, 2), judge_ms_p50=round(statistics.median(
                        w.served.judge_s[n0:] or [0]) * 1e3, 3))
                out[f"{race}_{label}"] = got
                print(f"{race:3} {label:6}: {got}", flush=True)
            finally:
                w.close()
    return out


def startups(n: int) -> dict:
    out: dict = {}
    for label, freeze, cmd in (("freeze_off", False, "imports"), ("freeze_on", True, "imports"),
                               ("threaded_freeze_off", False, "imports_threaded"),
                               ("threaded_freeze_on", True, "imports_threaded")):
        runs = []
        for _ in range(n):
            w = Worker(freeze=freeze)
            try:
                got = w.do(cmd)
                js = w.served.judge_s
                runs.append({"import_s": got["s"], "judgements": len(js),
                             "judge_ms_p50": statistics.median(js) * 1e3 if js else 0.0,
                             "judge_ms_p99": sorted(js)[int(0.99 * (len(js) - 1))] * 1e3 if js else 0.0,
                             "judge_ms_sum": sum(js) * 1e3})
            finally:
                w.close()
        out[label] = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
        print(f"start-up {label}: {out[label]}", flush=True)
    return out


def lock_cost() -> dict:
    w = Worker(freeze=True)
    try:
        w.do("imports")
        got = w.do("lock")
        from supervisor.sandbox.launch import descendant_pids
        from supervisor.sandbox import sandbox_main_pid

        pid = sandbox_main_pid(descendant_pids(w.proc.pid))
        wx.program()                                   # built once per supervisor
        times = []
        for _ in range(20):
            v = wx.verify(pid, baseline=None)
            assert v.ok, v
            times.append(v.ms)
        out = {"lock_ms": round(got["s"] * 1e3, 3), "mdwe": got["mdwe"],
               "verify_ms_p50": round(statistics.median(times), 3),
               "verify_ms_max": round(max(times), 3), "verified_by": v.how, "threads": v.threads}
    finally:
        w.close()
    print(f"lock at READY: {out}", flush=True)
    return out


FRAME = r"""
import json, os, select, socket, sys, time
from supervisor.sandbox import seccomp, wx
seccomp.lock_down("control")
a, b = socket.socketpair()
p = select.poll(); p.register(b, select.POLLIN)
msg = b"x" * 64
def frame():
    a.send(msg); p.poll(0); b.recv(64); b.send(msg); a.recv(64)
def bench(fn, n):
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best
out = {}
for label in ("unlocked", "locked"):
    if label == "locked":
        wx.lock()
    out[label] = {"frame_ns": bench(frame, 20000), "getppid_ns": bench(os.getppid, 100000)}
print(json.dumps(out))
"""


def frame_cost() -> dict:
    p = spawn(policy_for_domain("control"), [sys.executable, "-c", FRAME],
              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=300)
    got = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"error": err[-2000:]}
    if "locked" in got:
        got["frame_extra_ns"] = round(got["locked"]["frame_ns"] - got["unlocked"]["frame_ns"], 1)
        got["syscall_extra_ns"] = round(got["locked"]["getppid_ns"] - got["unlocked"]["getppid_ns"], 1)
    print(f"per frame: {got}", flush=True)
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tries", type=int, default=200)
    ap.add_argument("--spread-us", type=int, default=600)
    ap.add_argument("--startups", type=int, default=3)
    ap.add_argument("--only", default="races,startup,lock,frame")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("wx_race: needs root (the supervisor's view of the worker's /proc)", file=sys.stderr)
        return 2
    parts = a.only.split(",")
    res: dict = {"kernel": os.uname().release, "tries": a.tries, "spread_us": a.spread_us}
    if "races" in parts:
        res["races"] = races(a.tries, a.spread_us)
    if "startup" in parts:
        res["startup"] = startups(a.startups)
    if "lock" in parts:
        res["lock"] = lock_cost()
    if "frame" in parts:
        res["frame"] = frame_cost()
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
