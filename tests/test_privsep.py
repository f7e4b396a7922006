"""The split supervisor live (issue 27, phase 2): `supervisor run --privsep` starts the
privileged broker and runs on as an unprivileged user with no capabilities; every
sandbox is the broker's; a fault-injected supervisor proper is refused by the broker."""
from __future__ import annotations

import dataclasses
import io
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import trio

from supervisor.broker import BrokerClient
from supervisor.broker import _protocol as P
from supervisor.config import load
from supervisor.events import EventLog
from supervisor.lifecycle import BrokerLatch, BrokerLauncher, Exit, Supervisor
from supervisor.sandbox.cgroups import rt_budget_of
from tests.conftest import Run
from tests.test_lifecycle import CONTROL, PIPELINE

pytestmark = pytest.mark.sandbox
if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("--privsep starts the broker as root", allow_module_level=True)

# Probes a -> b -> c in the control domain (fail_safe); b may be restarted once; c runs
# SCHED_FIFO within a 5 % budget the broker grants its leaf.
TOML = CONTROL.format(policy="fail_safe") + PIPELINE.format(a_args="", a_extra="") \
    .replace('args = ["--read", "a_out", "--publish", "b_out"]',
             'args = ["--read", "a_out", "--publish", "b_out"]\n'
             'max_restarts = 1\nrestart_window_s = 120\nbackoff_initial_ms = 10') \
    .replace('args = ["--read", "b_out"]',
             'args = ["--read", "b_out"]\nrealtime_priority = 10\nrealtime_budget_pct = 5')


class PrivsepRun(Run):
    """`supervisor run --privsep` as a child process (conftest.Run's event reading)."""

    def __init__(self, tmp_path: Path, toml: str) -> None:
        self.path = tmp_path / "sup.toml"
        self.path.write_text(textwrap.dedent(toml))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", "run", "--privsep", "--quiet",
             "--config", str(self.path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.events, self.lines = [], []
        self.admitted_at = None
        self._lines = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def test_privsep_run_holds_no_privilege_restarts_and_latches_through_the_broker(tmp_path):
    """While the pipeline runs the supervisor proper is not uid 0 and holds no
    capability in any set; its workers are the broker's children; a worker killed -9
    is restarted; killed again (budget spent) the control domain fails safe and the
    latch is written by the broker, which the next --privsep run reads: exit 4."""
    state = Path(os.environ["TRIO_STATE_DIR"])
    r = PrivsepRun(tmp_path, TOML)
    try:
        r.wait_for("all_ready", timeout=90)
        proper = r.wait_for("supervisor_start")[0]["pid"]
        broker = r.wait_for("broker_start")[0]
        st = _status(proper)
        assert "0" not in st["Uid"].split() and "0" not in st["Gid"].split(), st
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(st[cap], 16) == 0, (cap, st[cap])
        assert st["NoNewPrivs"] == "1" and st["Groups"] == ""
        assert broker["uid"] == 0 and _ppid(broker["pid"]) == proper
        # The state dir's lock is the broker's too: held until both are gone (review: a
        # SIGKILLed proper left its broker's sandboxes running with the lock free).
        lock = str(state / "supervisor.lock")
        for pid in (proper, broker["pid"]):
            assert lock in {os.path.realpath(f"/proc/{pid}/fd/{fd}")
                            for fd in os.listdir(f"/proc/{pid}/fd")}, pid
        starts = {e["worker"]: e for e in r.events if e["event"] == "start"}
        assert set(starts) == {"a", "b", "c"} and all(e["broker"] for e in starts.values())
        for e in starts.values():                 # bwrap is the broker's child, not ours
            assert _ppid(e["pid"]) == broker["pid"]
        # The `realtime` event says what the kernel bounds c by: the broker's grant to
        # its leaf, not "global sched_rt_runtime_us only" (the proper holds no tree).
        (grant,) = r.wait_for("realtime", worker="c", timeout=60)
        kernel = rt_budget_of(grant["pid"])
        if kernel is not None:                    # RT group scheduling on this kernel
            assert kernel == (5_000, 100_000), kernel
            assert grant["bound"] == "5 % of a CPU per 100 ms (cgroup)", grant
        os.kill(starts["b"]["pid"], signal.SIGKILL)
        r.wait_for("ready", count=2, worker="b", timeout=60)
        again = [e for e in r.events if e["event"] == "start" and e["worker"] == "b"][-1]
        assert again["pid"] != starts["b"]["pid"]
        os.kill(again["pid"], signal.SIGKILL)
        assert r.finish(timeout=60) == Exit.FAIL_SAFE
    finally:
        r.stop()
    latch = [e for e in r.events if e["event"] == "broker_latch"]
    assert latch and latch[0]["action"] == "set" and latch[0]["source"] == "broker"
    assert json.loads((state / "failsafe.latch").read_text())["by"] == "broker"
    assert r.events[-1]["event"] == "broker_exit"        # it outlived the proper, then went
    for e in r.events:
        if e["event"] == "start":
            assert not os.path.exists(f"/proc/{e['pid']}")
    # The next run reads the latch through its broker and starts nothing.
    r2 = PrivsepRun(tmp_path, TOML)
    try:
        assert r2.finish(timeout=60) == Exit.FAIL_SAFE
    finally:
        r2.stop()
    assert not [e for e in r2.events if e["event"] == "start"]
    assert "fail-safe latched" in [e for e in r2.events if e["event"] == "supervisor_exit"][0]["reason"]
    (state / "failsafe.latch").unlink()


class FaultInjected(BrokerLauncher):
    """A supervisor proper whose parser was subverted: before its first start it asks the
    broker for what root could do. Each ask is refused (and logged by the broker); the
    run then goes on as usual."""

    tried: dict | None = None

    async def start(self, w, number, *, standby, handles):
        if self.tried is None:
            self.tried = await trio.to_thread.run_sync(self._attacks)
        return await super().start(w, number, standby=standby, handles=handles)

    def _attacks(self) -> dict:
        c, out = self.client, {}
        for name, ask in {
            # uid 0 or a bind of /: a start names a worker of the broker's config and
            # its incarnation, nothing else; the nearest asks are a worker that is not
            # in the config and a "channel" fd that is the root directory.
            "start_root": lambda: c.call(P.Start("root", 1)),
            "bind_root": lambda: self._start_with_root_dir(),
            "kill_pid_1": lambda: c.signal(1, signal.SIGKILL),
            "proc_of_pid_1": lambda: c.open_proc(1, ("maps",)),
            # The latch request carries a reason, never a path: a path-like reason is
            # a reason; one with control characters is malformed.
            "latch_escape": lambda: c.set_latch("x\n../../../etc/cron.d/own"),
        }.items():
            try:
                ask()
                out[name] = "allowed"
            except Exception as e:                     # the broker's typed refusal
                out[name] = getattr(e, "code", type(e).__name__)
        return out

    def _start_with_root_dir(self) -> None:
        fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
        try:
            self.client.call(P.Start("a", 10_000, False, (P.Grant("a_out", "writer", 1),)),
                             [fd])
        finally:
            os.close(fd)


# One probe: the faults are the point, not the pipeline.
ONE = CONTROL.format(policy="fail_safe") + """
[channels.a_out]
slot_size = "4KiB"
dtype = "float32"
[workers.a]
domain = "control"
module = "workers.probe"
publishes = ["a_out"]
args = ["--publish", "a_out"]
"""


def test_a_fault_injected_supervisor_proper_is_refused_by_the_broker(tmp_path):
    cfg_path = tmp_path / "fault.toml"
    cfg_path.write_text(textwrap.dedent(ONE))
    cfg = load(cfg_path)
    # No uid, argv, bind or path in the start request: the vocabulary cannot say them.
    assert [f.name for f in dataclasses.fields(P.Start)] == [
        "worker", "incarnation", "standby", "channels"]
    assert [f.name for f in dataclasses.fields(P.SetLatch)] == ["reason"]
    err = tmp_path / "broker.err"
    state = Path(os.environ["TRIO_STATE_DIR"])
    with open(err, "w") as f:
        client = BrokerClient.spawn(state_dir=state, config=cfg_path, stderr=f)
    launcher = FaultInjected(client)
    log = EventLog(stream=io.StringIO())
    sup = Supervisor(cfg, log=log, launcher=launcher,
                     latch=BrokerLatch(client, state / "failsafe.latch"))

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            n.cancel_scope.cancel()

    try:
        trio.run(main)
    except BaseException:
        # Why the run ended before READY: every event but the worker's own lines in
        # full, then its last lines (a CI run lost the refusal's reason to a [-6000:]).
        lines = log.stream.getvalue().splitlines()
        print("\n".join(ln for ln in lines if '"event":"output"' not in ln)[-8000:])
        print("\n".join(ln for ln in lines if '"event":"output"' in ln)[-2000:])
        print(err.read_text()[-3000:])
        raise
    finally:
        code = client.close()
    assert code == 0
    assert launcher.tried == {"start_root": "unknownWorker", "bind_root": "badFds",
                              "kill_pid_1": "notOurs", "proc_of_pid_1": "notOurs",
                              "latch_escape": "malformed"}, launcher.tried
    events = [json.loads(ln) for ln in err.read_text().splitlines() if ln.startswith("{")]
    refused = [(e["request"], e["code"]) for e in events if e["event"] == "broker_refused"]
    assert refused == [("start", "unknownWorker"), ("start", "badFds"),
                       ("signal", "notOurs"), ("openProc", "notOurs"),
                       ("?", "malformed")], refused
    assert not (state / "failsafe.latch").exists()
    assert not Path("/etc/cron.d/own").exists()
    # The run itself went on: its worker READY, started by the broker, stopped.
    assert [e["worker"] for e in log.of("ready")] == ["a"]
    assert sup.exit_code == Exit.SHUTDOWN
    assert [e["worker"] for e in events if e["event"] == "broker_started"] == ["a"]
    assert [e["worker"] for e in events if e["event"] == "broker_reaped"] == ["a"]


# ---------------------------------------------------------------- the hostile fleet

# A subset of tests/test_attacks.py's ATTACKERS, one supervisor --privsep for all: a
# kernel knob, a forbidden syscall, the W^X lock after READY, the exec watch before READY
# (its /proc reads and thread stops through the broker), a memory hog (its OOM cause
# from the broker's reap), a status flood (the unprivileged proper's parser).
# c-fakewx: a decoy filter grows the count as the W^X lock would: only the broker's
# read-back of the programs (readFilters) refuses it.
FLEET = ("c-core", "c-ptrace", "c-mprotect", "c-dlopen", "c-hog", "r-flood", "c-fakewx")


@pytest.fixture(scope="module")
def privsep_fleet(tmp_path_factory):
    import tests.test_attacks as A

    class PrivsepFleet(A.Fleet):
        """test_attacks.Fleet's supervisor, started with --privsep."""

        def __init__(self, tmp: Path) -> None:
            real = subprocess.Popen

            def with_privsep(argv, *a, **kw):
                if argv[:4] == [sys.executable, "-m", "supervisor.cli", "run"]:
                    argv = [*argv[:4], "--privsep", *argv[4:]]
                return real(argv, *a, **kw)

            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(A.subprocess, "Popen", with_privsep)
                super().__init__(tmp)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(A, "ATTACKERS", {k: A.ATTACKERS[k] for k in FLEET})
        f = PrivsepFleet(tmp_path_factory.mktemp("privsep-hostile"))
        try:
            running = f.settle(stall_s=90, admission_s=300, cap_s=400)
            yield {"events": f.stop(), "running": running}
        finally:
            if f.proc.poll() is None:
                f.proc.kill()


def test_the_hostile_fleet_gets_the_same_verdicts_through_the_broker(privsep_fleet):
    import tests.test_attacks as A

    ev, running = privsep_fleet["events"], privsep_fleet["running"]
    privsep = [e for e in ev if e["event"] == "privsep"]
    assert privsep and privsep[0]["uid"] != 0 and privsep[0]["cap_eff"] == "0" * 16, ev[:5]
    assert all(e.get("broker") for e in ev if e["event"] == "start"), \
        [e for e in ev if e["event"] == "start" and not e.get("broker")]
    res = A.assert_denied(ev, "c-core")
    assert res["error"] in ("EROFS", "EACCES", "ENOENT"), res
    for w in ("c-ptrace", "c-mprotect"):              # seccomp, then the W^X lock
        assert A.attack_result(ev, w) is None, A.attack_result(ev, w)
        ex = A.killed_by(ev, w)
        assert ex["signal"] == "SIGSYS" and "seccomp" in ex["cause"], ex
    ref = A._of(ev, "c-dlopen", "refused")          # the exec watch, judged unprivileged
    assert ref and ref[0]["syscall"] == "mmap" and "/tmp/libharmless.so" in str(ref[0]["target"]), \
        A._of(ev, "c-dlopen")
    ex = A.killed_by(ev, "c-hog")                   # the OOM count, from the broker's reap
    assert ex["signal"] == "SIGKILL" and "out of memory" in ex["cause"], ex
    ref = A._of(ev, "r-flood", "refused")
    assert ref and ref[0]["kind"] == "protocol_flood", A._of(ev, "r-flood")[-3:]
    for w in ("src", "sink"):                        # control ran on, untouched
        assert len(A._of(running, w, "start")) == 1 and A._of(running, w, "ready")
        assert not A._of(ev, w, "watchdog_missed")
        # W^X read back by the broker (readFilters), not counted by the proper.
        assert A._of(running, w, "ready")[0]["wx_lock"] == "ptrace", A._of(running, w, "ready")
    ref = A._of(ev, "c-fakewx", "refused")
    assert ref and ref[0]["kind"] == "wx_lock" and "none of them the W^X filter" in \
        ref[0]["reason"], A._of(ev, "c-fakewx")
    assert not A._of(ev, "c-fakewx", "ready")
    assert [e for e in ev if e["event"] == "supervisor_exit"][-1]["code"] == 0
    # No broker_error, and the proper asked for nothing outside the vocabulary's checks:
    # what the broker refused were /proc views of processes that had just died (a
    # worker killed by seccomp while its exec watch or the maps scan looked at it:
    # notOurs once it left its cgroup, failed with the kernel's ENOENT for a mapping).
    assert not [e for e in ev if e["event"] == "broker_error"]
    refused = {(e["request"], e["code"]) for e in ev if e["event"] == "broker_refused"}
    assert {c for _, c in refused} <= {"notOurs", "failed"}, refused
    # (readFilters: c-ptrace/c-mprotect die of their attack right after READY, while
    # the broker reads their filters back.)
    assert {r for r, _ in refused} <= {"openProc", "openFd", "openMapFile", "openPidNs",
                                       "signalThread", "signal", "pids", "readFilters"}, refused


def test_run_broker_refuses_root_and_privsep_refuses_no_sandbox(tmp_path):
    """--broker is the unprivileged unit's: as root it is one line and exit 1, before
    anything connects; --privsep with --no-sandbox is a contradiction (exit 2)."""
    cfg = tmp_path / "one.toml"
    cfg.write_text(textwrap.dedent(ONE))
    for extra, code, needle in ((["--broker", str(tmp_path / "none.sock")], 1, "must not be root"),
                                (["--privsep", "--no-sandbox"], 2, "not with --no-sandbox")):
        p = subprocess.run([sys.executable, "-m", "supervisor.cli", "run", *extra,
                            "--config", str(cfg)], capture_output=True, text=True, timeout=60)
        assert p.returncode == code and needle in p.stderr, (p.returncode, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr


# A research pipeline whose reader keeps warm standbys: their hand-overs are `adopt`s.
STANDBYS = """
[domains.research]
[channels.a_out]
slot_size = "4KiB"
dtype = "float32"
[workers.a]
domain = "research"
module = "workers.probe"
publishes = ["a_out"]
args = ["--publish", "a_out"]
[workers.r]
domain = "research"
module = "workers.probe"
subscribes = ["a_out"]
args = ["--read", "a_out"]
warm_standby = true
restart = "always"
max_restarts = 10
backoff_initial_ms = 10
"""


def test_a_standbys_hand_over_goes_through_the_brokers_adopt(tmp_path):
    """Red team 10 row 9 in the lifecycle: under privsep a warm standby's channels reach
    it only through the broker (`adopt`, checked as a start's; the proper holds no
    control socket). A proper whose first hand-over is subverted (its own broker
    connection as the wake-up) is refused in one `broker_refused` line naming the
    worker; that standby is discarded and the worker starts cold (a checked start), READY;
    the next takeover, honest, adopts the other standby through the broker."""
    from supervisor.ipc.channel import ReaderHandle

    cfg_path = tmp_path / "standbys.toml"
    cfg_path.write_text(textwrap.dedent(STANDBYS))
    cfg = load(cfg_path)
    err = tmp_path / "broker.err"
    state = Path(os.environ["TRIO_STATE_DIR"])
    with open(err, "w") as f:
        client = BrokerClient.spawn(state_dir=state, config=cfg_path, stderr=f)
    honest, calls = client.adopt, []

    def adopt(worker, incarnation, handles):
        calls.append(worker)
        if len(calls) == 1:
            h = handles["a_out"]
            handles = {"a_out": ReaderHandle(h.spec, h.index, h.data_fd, h.lease_fd,
                                             client.sock.fileno())}
        return honest(worker, incarnation, handles)

    client.adopt = adopt
    log = EventLog(stream=io.StringIO())
    sup = Supervisor(cfg, log=log, launcher=BrokerLauncher(client),
                     latch=BrokerLatch(client, state / "failsafe.latch"))

    async def takeover(outcome: str) -> None:
        run = sup.runs["r"]
        while sum(sb.warm for sb in run.standbys) < 2 or not run.ready.is_set():
            await trio.sleep(0.05)
        seen = len(log.of(outcome, "r"))
        run.current.kill()
        while len(log.of(outcome, "r")) == seen:
            await trio.sleep(0.02)

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            with trio.fail_after(120):
                await takeover("standby_failed")
                starts = len(log.of("start", "r"))
                while len(log.of("ready", "r")) < 2:      # the cold start's
                    await trio.sleep(0.05)
                assert len(log.of("start", "r")) >= starts
                await takeover("standby_adopted")
            n.cancel_scope.cancel()

    try:
        trio.run(main)
    except BaseException:
        print("\n".join(ln for ln in log.stream.getvalue().splitlines()
                        if '"event":"output"' not in ln)[-6000:])
        print(err.read_text()[-3000:])
        raise
    finally:
        assert client.close() == 0
    failed = log.of("standby_failed", "r")
    assert len(failed) == 1 and "badFds" in failed[0]["error"], failed
    events = [json.loads(ln) for ln in err.read_text().splitlines() if ln.startswith("{")]
    refused = [(e["request"], e["code"], e.get("worker")) for e in events
               if e["event"] == "broker_refused"]
    assert refused == [("adopt", "badFds", "r")], refused
    adopted = [e for e in events if e["event"] == "broker_adopted"]
    assert [e["worker"] for e in adopted] == ["r"] and calls == ["r", "r"], (adopted, calls)
    assert log.of("standby_adopted", "r")[0]["pid"] == adopted[0]["pid"]
