"""Red team, round 7: the attack whose attacker is a control worker, run from inside a
real sandbox (``module = "workers.probe.attacks_redteam7"``, args ``--attack NAME``).

* ``vfork_hold`` (control): right after READY the worker's only thread posix_spawns a
  child whose first file action opens a FIFO no one writes. glibc's posix_spawn is a
  CLONE_VFORK clone: the parent thread waits for the child's exec in a killable sleep,
  which PTRACE_INTERRUPT does not end, so the supervisor's W^X read-back (sandbox/wx.py
  `verify`, through the broker's readFilters under --privsep) waits its whole
  VERIFY_WALL_S for a thread that will not stop. The question is what a control
  worker's death costs meanwhile: is its SAFE still on time?

The spawn is made through ctypes before READY (os.posix_spawn holds the GIL through
the call: the whole worker would stop); ``ATTACK {json}`` says the thread's state.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from supervisor.worker import WorkerContext


def _spawn_blocked(fifo: str) -> None:
    """posix_spawn through ctypes (which lets the GIL go, unlike os.posix_spawn): this
    thread waits in the kernel for a child that never execs; the others run on."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    actions = ctypes.create_string_buffer(256)          # posix_spawn_file_actions_t
    libc.posix_spawn_file_actions_init(actions)
    libc.posix_spawn_file_actions_addopen(actions, 3, fifo.encode(), os.O_RDONLY, 0)
    argv = (ctypes.c_char_p * 2)(b"true", None)
    envp = (ctypes.c_char_p * 1)(None)
    pid = ctypes.c_int()
    rc = libc.posix_spawn(ctypes.byref(pid), b"/bin/true", actions, None, argv, envp)
    HELD["spawn_returned"] = os.strerror(rc) if rc else 0    # only if it came back


def vfork_hold(ctx: WorkerContext, a: argparse.Namespace) -> dict:
    return {"denied": False, "held": HELD}


HELD: dict = {}


def _hold_before_ready() -> None:
    import threading

    fifo = "/tmp/rt7.fifo"
    os.mkfifo(fifo)
    threading.Thread(target=_spawn_blocked, args=(fifo,), daemon=True).start()
    time.sleep(0.2)                  # the thread is in the vfork wait before READY
    states = []
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        with open(f"/proc/self/task/{tid}/stat") as f:
            st = f.read()
        states.append(st[st.rindex(")") + 2])
    HELD["thread_states"] = "".join(states)
    print("ATTACK " + json.dumps({"attack": "vfork_hold", "pid": os.getpid(), **HELD}),
          flush=True)


ATTACKS = {"vfork_hold": vfork_hold}


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="attacks_redteam7")
    p.add_argument("--attack", action="append", default=[], choices=sorted(ATTACKS))
    return p.parse_args(argv)


def main(ctx: WorkerContext) -> int:
    a = _args(sys.argv[1:])
    if "vfork_hold" in a.attack:
        _hold_before_ready()
    ctx.ready(status=f"redteam7 pid {os.getpid()}")
    for name in a.attack:
        try:
            res = ATTACKS[name](ctx, a)
        except Exception as e:       # an attack that failed is reported, not hidden
            res = {"denied": True, "error": f"{type(e).__name__}: {e}"}
        print(f"RESULT {name} " + json.dumps(res), flush=True)
    while True:
        time.sleep(0.05)


# -- the measurement (not a worker): `python -m workers.probe.attacks_redteam7 [attack]`
# runs `supervisor run --privsep` (as root) on a two-worker control domain, kills the
# probe `v` -9 while `slow` runs (with the attack: its READY read-back under way) and
# prints kill -> fail_safe in ms (the events' mono_ns against this process's monotonic
# clock), once without and once with the attack.
import queue  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402

TOML = """
[domains.control]
failure_policy = "fail_safe"
actuates = true
[channels.v_out]
slot_size = "4KiB"
dtype = "float32"
[workers.v]
domain = "control"
module = "workers.probe"
publishes = ["v_out"]
args = ["--publish", "v_out"]
max_restarts = 0
[workers.slow]
domain = "control"
module = "workers.probe.attacks_redteam7"
args = [{args}]
"""

def measure_one(attack: bool) -> dict:
    d = tempfile.mkdtemp(prefix="rt7m-")
    cfg = os.path.join(d, "c.toml")
    open(cfg, "w").write(TOML.format(args='"--attack", "vfork_hold"' if attack else ""))
    env = dict(os.environ, TRIO_STATE_DIR=os.path.join(d, "state"))
    p = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run", "--privsep", "--quiet",
                          "--config", cfg], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    q = queue.Queue(); evs = []
    threading.Thread(target=lambda: [q.put(l) for l in p.stderr], daemon=True).start()
    def until(pred, t=90):
        end = time.monotonic() + t
        while time.monotonic() < end:
            try: l = q.get(timeout=0.5)
            except queue.Empty: continue
            try: e = json.loads(l)
            except ValueError: continue
            evs.append(e)
            if pred(e): return e
        raise TimeoutError(f"{[x['event'] for x in evs][-20:]}")
    try:
        return _drive(p, q, evs, attack)
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try: p.wait(20)
            except subprocess.TimeoutExpired: p.kill(); p.wait()
        import shutil
        shutil.rmtree(d, ignore_errors=True)

def _drive(p, q, evs, attack):
    def until(pred, t=90):
        end = time.monotonic() + t
        while time.monotonic() < end:
            try: l = q.get(timeout=0.5)
            except queue.Empty: continue
            try: e = json.loads(l)
            except ValueError: continue
            evs.append(e)
            if pred(e): return e
        raise TimeoutError(f"{[x['event'] for x in evs][-20:]}")
    vstart = until(lambda e: e["event"] == "start" and e.get("worker") == "v")
    until(lambda e: e["event"] == "ready" and e.get("worker") == "v")
    if attack:
        until(lambda e: e["event"] == "status" and e.get("worker") == "slow")
    else:
        until(lambda e: e["event"] == "ready" and e.get("worker") == "slow")
    time.sleep(0.3)                       # the read-back is under way
    from supervisor.sandbox import sandbox_main_pid
    from supervisor.sandbox.launch import descendant_pids
    wpid = sandbox_main_pid(sorted(descendant_pids(vstart["pid"]))) or vstart["pid"]
    t_kill = time.monotonic_ns()
    os.kill(wpid, signal.SIGKILL)
    fs = until(lambda e: e["event"] == "fail_safe")
    try:
        until(lambda e: e["event"] == "supervisor_exit", 30)
    except TimeoutError:
        pass
    p.wait(30)
    refused = [e for e in evs if e["event"] in ("refused", "ready") and e.get("worker") == "slow"]
    return {"attack": attack, "kill_to_fail_safe_ms": round((fs["mono_ns"] - t_kill) / 1e6, 1),
            "fail_safe": {k: fs.get(k) for k in ("reason", "worker", "cause") if k in fs},
            "slow_out": [e.get("line") for e in evs if e["event"] == "output" and e.get("worker") == "slow"][:3],
            "slow": [{k: e.get(k) for k in ("event", "reason", "wx_check_ms") if k in e} for e in refused],
            "mono_after_kill_ms": {e["event"] + ":" + str(e.get("worker")): round((e["mono_ns"] - t_kill) / 1e6, 1)
                                   for e in evs if e.get("mono_ns", 0) > t_kill}}



if __name__ == "__main__":
    for attack in [x == "attack" for x in sys.argv[1:]] or (False, True):
        print(json.dumps(measure_one(attack)), flush=True)
