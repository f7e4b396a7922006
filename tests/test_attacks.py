"""Hostile workers under a real `supervisor run`: every attack runs from inside a real
sandbox started the way the supervisor starts it; each test asserts that the attack
failed AND that the supervisor's own log names the worker (an `output`, `exit` or
`refused` event). One supervisor runs the whole hostile fleet at once (each attacker
is optional and never restarted), so the suite pays for one start-up.

Kernel knobs are opened for writing and never written (workers/probe/attacks.py).
"""
from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import socket
import subprocess  # noqa: F401  (test_privsep wraps A.subprocess.Popen)
import textwrap
from pathlib import Path

import pytest

from tests._fleet import LoggedRun, assert_denied, attack_result, killed_by
from tests._fleet import of as _of

pytestmark = pytest.mark.sandbox
if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the supervisor's isolation (host uids, cgroups) needs root", allow_module_level=True)

# name -> (domain, attack, before READY?)
ATTACKERS = {
    "c-core": ("control", "core_pattern", False),
    "r-core": ("research", "core_pattern", False),
    "c-sysrq": ("control", "sysrq", False),
    "c-procmem": ("control", "proc_self_mem", False),
    "r-reopen": ("research", "reopen_rw", False),
    "r-acl": ("research", "acl_then_reopen", False),
    "c-acl": ("control", "acl_then_reopen", False),
    "r-chmod": ("research", "fchmod_channel", False),
    "c-forge": ("control", "forge_log", False),
    "c-tty": ("control", "tty", False),
    "c-ptrace": ("control", "ptrace", False),
    "c-scout": ("control", "seccomp_scout", False),
    "c-persona": ("control", "personality", False),
    "c-unix": ("control", "unix_connect", False),
    "c-devshm": ("control", "dev_shm", False),
    "c-mprotect": ("control", "mprotect_exec", False),
    "c-mprotect0": ("control", "mprotect_exec", True),
    "c-jit": ("control", "mprotect_exec", True),       # declared jit_kernels: allowed
    "c-memfd": ("control", "memfd_exec", False),
    "c-dlopen": ("control", "dlopen_tmp", True),
    "c-torch": ("control", "torch_files", False),
    "c-guard": ("control", "swallow_guard", False),
    "c-fakeready": ("control", "fake_ready", True),
    "c-hog": ("control", "memory_hog", False),
    "r-storm": ("research", "fork_storm", False),
    "r-hog": ("research", "memory_hog", False),
    "r-flood": ("research", "status_flood", False),
    "c-longline": ("control", "long_line", False),
    "c-nested": ("control", "nested_log", False),
    "c-ldt": ("control", "modify_ldt", False),
    "r-ldt": ("research", "modify_ldt", False),
    "c-mremap": ("control", "mremap_exec", False),
    "c-headless": ("control", "headless_mremap", False),
    "c-listener": ("control", "own_listener", False),
    "r-wake": ("research", "wake_abuse", False),
    "r-announce": ("research", "announce_sink", False),
    "r-hoard": ("research", "lease_hoard", False),
    "r-churn": ("research", "status_churn", False),
    "r-escape": ("research", "status_escape", False),
    "r-descr": ("research", "shared_description", False),
    "c-patch": ("control", "patch_library", True),
    "r-weight": ("research", "raise_cpu_weight", False),
    "c-rt": ("control", "raise_priority", False),      # granted SCHED_FIFO 50 at READY
    "r-rt": ("research", "raise_priority", False),
    "c-rtspin": ("control", "realtime_runaway", False),   # SCHED_FIFO, 10 % budget
    # red team (real-time): each SCHED_FIFO 50 at READY, 10 % budget like c-rtspin
    "c-rtpi": ("control", "realtime_pi_boost", False),
    "c-rthop": ("control", "realtime_hop", False),
    "c-rtmisc": ("control", "realtime_sched_misc", False),
    "r-rtmisc": ("research", "realtime_sched_misc", False),   # no grant: every door, cold
    # issue 21: races against the exec watch before READY, and the W^X lock at READY
    # (a thread born during the stop: tests/test_wx_freeze.py, many tries, cheaper there)
    "c-cowrace": ("control", "cow_mremap_race", True),
    "c-fdswap": ("control", "fd_swap_race", True),
    "c-fakewx": ("control", "fake_wx_lock", True),       # READY by hand, a decoy filter
    "c-wx1thread": ("control", "wx_one_thread", True),   # the W^X filter on one thread only
    "c-vmchild": ("control", "shared_vm_child", True),
    # Late: it looks 3 s after its READY at what r-descr set at its own.
    "c-descr": ("control", "shared_description", False),
    "c-sigcont": ("control", "sigcont_race", True),      # last: it may strand itself (5 s)
}
REALTIME = ("c-rt", "c-rtspin", "c-rtpi", "c-rthop", "c-rtmisc")
RT_PRIORITY = 50
# The control pair every attack is measured against: its watchdog judges starvation.
# 1 s, not 300 ms: on a 2-core CI runner under two CPU hogs a nice-0 probe went 300 ms
# unscheduled with no attack at all (3 misses in one run); an attack that starves control
# (a fork storm, a status flood, a runaway real-time thread) holds it for longer than 1 s.
CONTROL_WATCHDOG_MS = 1000
# An attacker's READY deadline: under load a sandbox start took over 5 s (c-tty: a ready
# timeout, no attack run, nothing proved). c-sigcont keeps the default 5 s: it may strand
# itself stopped, and the deadline is what ends it (its test accepts that).
ATTACKER_READY_TIMEOUT_MS = 30_000


def _toml(sock_dir: Path) -> str:
    parts = [f"""
    [supervisor]
    maps_scan_interval_s = 0.5
    start_parallel = 3                # (in start order: r-descr reports before c-descr)
    status_interval_s = 0.5
    [domains.control]
    failure_policy = "restart"
    actuates = true
    extra_ro_binds = ["{sock_dir}"]
    [domains.research]
    [channels.frames]
    slot_size = "4KiB"
    dtype = "uint8"
    max_readers = {len(ATTACKERS) + 3}
    slot_count = {2 * (len(ATTACKERS) + 3) + 1}
    [workers.src]
    domain = "control"
    module = "workers.probe"
    publishes = ["frames"]
    args = ["--publish", "frames", "--period-ms", "20", "--ping-ms", "20", "--announce",
            "--loan-ahead"]
    watchdog_ms = {CONTROL_WATCHDOG_MS}
    restart = "always"
    [workers.sink]
    domain = "control"
    module = "workers.probe"
    subscribes = ["frames"]
    args = ["--read", "frames", "--period-ms", "20", "--ping-ms", "20"]
    watchdog_ms = {CONTROL_WATCHDOG_MS}
    restart = "always"
    """]
    for name, (domain, attack, before) in ATTACKERS.items():
        args = ["--read", "frames", "--attack", attack,
                "--attack-arg", str(sock_dir / "host.sock")] + (["--attack-before-ready"] if before else [])
        extra = ["jit_kernels = true"] if name == "c-jit" else []
        if name in REALTIME:
            extra += [f"realtime_priority = {RT_PRIORITY}", "realtime_budget_pct = 10"]
        if name != "c-sigcont":
            extra.append(f"ready_timeout_ms = {ATTACKER_READY_TIMEOUT_MS}")
        extra_lines = "\n    ".join(extra)
        parts.append(f"""
    [workers.{name}]
    {extra_lines}
    domain = "{domain}"
    module = "workers.probe"
    subscribes = ["frames"]
    args = {json.dumps(args)}
    restart = "never"
    optional = true
    memory_max = "256MiB"
    pids_max = 32
    cpu_quota = 50
    """)
    return textwrap.dedent("".join(parts))


class Fleet(LoggedRun):
    def __init__(self, tmp: Path) -> None:
        self.sock_dir = tmp / "socks"
        self.sock_dir.mkdir()
        os.chmod(tmp, 0o755)
        os.chmod(self.sock_dir, 0o755)
        # A host service socket that happens to lie in a directory bound into control.
        self.host_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.host_sock.bind(str(self.sock_dir / "host.sock"))
        os.chmod(self.sock_dir / "host.sock", 0o777)
        self.host_sock.listen(8)
        self.host_sock.setblocking(False)
        # stdout: the live status line (not a terminal, so one line per interval)
        self.out_path = tmp / "status.out"
        self.out = open(self.out_path, "wb")
        # The fleet's evidence includes the workers' own lines (`output`, debug level).
        super().__init__(tmp, "hostile", _toml(self.sock_dir), args=["--log-level", "debug"],
                         stdout=self.out, log_head='{"event":"earlier","note":"must survive"}\n')

    def settle(self, stall_s: float = 180, admission_s: float = 600,
               cap_s: float = 1500) -> list[dict]:
        """Until every attacker has started and ended its attack (or been killed). The
        attackers start one after another (~1-2.5 s each, ~80 s for the fleet on a quiet
        2-core machine); under load it is longer (load 20: admission alone took 55 s;
        two CPU hogs on a machine shared with other runs: none had started after 240 s).
        So not a fixed deadline (`LoggedRun.settle`); 1.5 s after the last for late
        kills (maps scan, OOM) and the storm's aftermath. ATTACKERS is read here, when
        called: test_privsep runs a subset of it."""
        return super().settle(ATTACKERS, stall_s=stall_s, admission_s=admission_s,
                              cap_s=cap_s, tail_s=1.5,
                              finished=lambda ev: any(e["event"] == "all_ready" for e in ev))

    def stop(self) -> list[dict]:
        self.terminate(60)
        self.host_sock.close()
        self.out.close()
        return self.events()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("hostile"))
    try:
        ev = f.settle()
        before_stop = list(ev)
        try:
            f.host_sock.accept()[0].close()
            host_connected = True
        except BlockingIOError:
            host_connected = False
        after = f.stop()
        yield {"events": after, "running": before_stop, "fleet": f,
               "host_connected": host_connected}
    finally:
        f.kill()


# ---------------------------------------------------------------- host root


@pytest.mark.parametrize("worker", ["c-core", "r-core", "c-sysrq"])
def test_kernel_knobs_read_only(fleet, worker):
    res = assert_denied(fleet["events"], worker)
    assert res["error"] in ("EROFS", "EACCES", "ENOENT"), res


def test_research_cannot_raise_its_cpu_weight(fleet):
    """The weight that makes research wait for control is set from outside: inside the
    sandbox no cgroup file is writable (none is even mounted) and mounting one fails."""
    res = assert_denied(fleet["events"], "r-weight")
    assert res["opened"] == [] and res["mount_cgroup2"] != "ok" and res["mount_cgroup"] != "ok"


def test_realtime_is_granted_by_the_supervisor_and_cannot_be_raised_or_passed_on(fleet):
    """A control worker the supervisor made SCHED_FIFO at READY cannot raise its
    priority, clear SCHED_RESET_ON_FORK or lower its nice value, and the threads and
    children it starts run in the normal class."""
    res = assert_denied(fleet["events"], "c-rt")
    assert res["granted"] == [os.SCHED_FIFO, RT_PRIORITY, True], res
    assert res["fifo_98"] == res["fifo_1_no_reset"] == "EPERM", res
    assert res["nice_-20"] == "EACCES", res        # setpriority's word for it
    grant = _of(fleet["events"], "c-rt", "realtime")
    assert grant and grant[0]["priority"] == RT_PRIORITY and grant[0]["reset_on_fork"]


def test_a_runaway_realtime_worker_is_held_to_its_budget(fleet):
    """A SCHED_FIFO control worker in a busy loop gets its cgroup's RT budget (10 % of a
    CPU per 100 ms here), not the CPU: the rest of the machine, the supervisor's
    watchdog included, keeps running. Needs RT group scheduling (cgroup v1 with
    cpu.rt_runtime_us); without it only the kernel's global 95 % applies."""
    grant = _of(fleet["events"], "c-rtspin", "realtime")
    assert grant, _of(fleet["events"], "c-rtspin")
    if not grant[0]["bound"].endswith("(cgroup)"):
        pytest.skip(f"no per-cgroup RT budget here: {grant[0]['bound']}")
    res = assert_denied(fleet["events"], "c-rtspin")
    assert res["fifo"] and res["share"] < 0.25, res
    print(f"\nrunaway SCHED_FIFO worker, 10 % budget: {res['cpu_s']} s CPU in {res['wall_s']} s")


def test_a_realtime_worker_cannot_escape_its_budget_by_priority_inheritance(fleet):
    """Red team (was a hole): the main thread (FIFO 50, 10 % budget) blocks in
    FUTEX_LOCK_PI on a futex its own normal thread holds; the kernel boosts the owner to
    FIFO 50 and a boosted task is never throttled: 0.95 of a CPU, a normal competitor on
    that CPU got 0.045 s of 1 s. Now the PI futex ops kill a control worker (seccomp),
    and the supervisor names it."""
    ev = fleet["events"]
    assert attack_result(ev, "c-rtpi") is None, attack_result(ev, "c-rtpi")
    # killed at FUTEX_LOCK_PI itself, not at the sched_setaffinity that follows it
    assert not [e for e in _of(ev, "c-rtpi", "output")
                if e["line"].startswith("ATTACK-STEP lock_pi")], _of(ev, "c-rtpi")
    ex = killed_by(ev, "c-rtpi")
    assert ex["signal"] == "SIGSYS" and "seccomp" in ex["cause"], ex


def test_a_realtime_worker_cannot_multiply_its_budget_by_hopping_cpus(fleet):
    """Red team (was a hole): cpu.rt_runtime_us is per CPU, so a FIFO thread moving
    itself to the next CPU after 8 ms of CPU time got 0.185 of a CPU at a 10 % budget on
    2 CPUs (c-rtspin: 0.10). Now sched_setaffinity kills a control worker."""
    ev = fleet["events"]
    assert attack_result(ev, "c-rthop") is None, attack_result(ev, "c-rthop")
    ex = killed_by(ev, "c-rthop")
    assert ex["signal"] == "SIGSYS" and "seccomp" in ex["cause"], ex


def test_a_realtime_worker_has_no_other_door_to_priority(fleet):
    """Red team: SCHED_DEADLINE, RR for FIFO, sched_setattr without the reset flag,
    IOPRIO_CLASS_RT, FIFO for a thread or for bwrap's init, RLIMIT_RTPRIO raised: all
    refused, and the grant is unchanged afterwards."""
    ev = fleet["events"]
    res = assert_denied(ev, "c-rtmisc")
    for k in ("deadline", "setattr_no_reset", "rr", "ioprio_rt", "init_fifo", "thread_fifo"):
        assert res[k] == "EPERM", (k, res)
    assert res["after"] == [os.SCHED_FIFO, RT_PRIORITY, True], res
    print(f"\nuclamp_min=1024 for the FIFO thread: {res['uclamp_min_1024']}")


def test_research_has_no_door_to_priority_either(fleet):
    """The same doors from research, which holds no grant at all (and keeps
    sched_setaffinity, which only kills in control): deadline, RR, FIFO through
    sched_setattr, RT I/O priority, FIFO for a thread or for bwrap's init, a higher
    RLIMIT_RTPRIO. All refused; it ends in the normal class."""
    ev = fleet["events"]
    res = attack_result(ev, "r-rtmisc")
    assert res is not None, _of(ev, "r-rtmisc")
    for k in ("deadline", "setattr_no_reset", "rr", "ioprio_rt", "init_fifo", "thread_fifo",
              "rlimit_rtprio"):
        assert res[k] != "ok", (k, res)
    assert res["fifo"] is False and res["after"][0] == os.SCHED_OTHER, res


def test_research_cannot_enter_the_realtime_class(fleet):
    res = assert_denied(fleet["events"], "r-rt")
    assert res["granted"][0] == os.SCHED_OTHER and res["fifo_98"] == "EPERM", res
    assert not _of(fleet["events"], "r-rt", "realtime")


def test_each_domain_runs_as_its_own_unprivileged_host_user(fleet):
    users = {e["domain"]: e for e in fleet["events"] if e["event"] == "domain_user"}
    control, research = pwd.getpwnam("trio-control"), pwd.getpwnam("trio-research")
    assert users["control"]["host_uid"] == control.pw_uid != 0
    assert users["research"]["host_uid"] == research.pw_uid != 0
    assert control.pw_uid != research.pw_uid


def test_proc_self_mem_not_writable(fleet):
    assert_denied(fleet["events"], "c-procmem")


# ---------------------------------------------------------------- reader -> writer


def test_reader_cannot_reopen_its_channel_writable(fleet):
    res = assert_denied(fleet["events"], "r-reopen")
    assert res["error"] == "EACCES"


def test_a_control_worker_cannot_scout_its_filter_from_a_child(fleet):
    """Red team (was a hole): a forked child made each forbidden call and died of it
    alone; the supervisor saw nothing, so a hostile worker could map its seccomp filter
    call by call without a trace. Now no child can be made (EPERM): a forbidden call
    can only be the worker's own, which kills it with a seccomp exit event (c-ptrace)."""
    res = assert_denied(fleet["events"], "c-scout")
    assert set(res["mapped"].values()) == {"no child: EPERM"}, res


@pytest.mark.parametrize("worker", ["r-acl", "c-acl", "r-chmod"])
def test_acl_or_chmod_on_a_channel_kills_the_reader(fleet, worker):
    ev = fleet["events"]
    assert attack_result(ev, worker) is None, "the attack returned instead of being killed"
    ex = killed_by(ev, worker)
    assert ex["signal"] == "SIGSYS" and "seccomp" in ex["cause"], ex


def test_wake_up_socket_abuse_leaves_the_writer_publishing(fleet):
    """fds sent to the writer's end, its direction stuffed, both directions shut down."""
    ev = fleet["events"]
    res = assert_denied(ev, "r-wake")
    assert res["scm_rights"] == "sent" and res["flood"] == "EAGAIN", res
    assert not _of(fleet["running"], "src", "exit") and not _of(fleet["running"], "r-wake", "exit")


def test_a_reader_claiming_to_busy_poll_cannot_hurt_an_announcing_writer(fleet):
    """Research claims (its own lease table) to busy-poll and to sleep, so the control
    writer's announcements go to its socket; it takes them, then shuts the socket. The
    writer announces and publishes on, and the control sink keeps reading."""
    ev = fleet["events"]
    res = assert_denied(ev, "r-announce")
    assert res["woken_bytes"] > 0, res          # the claim worked: it was woken
    assert not _of(fleet["running"], "src", "exit")
    assert not _of(fleet["running"], "sink", "exit")


def test_a_reader_hoarding_leases_cannot_pin_a_writer_that_loans_ahead(fleet):
    """Research forges a live lease on every slot in all 126 entries of its lease page;
    the control writer (src, NextLoan) honours max_leases of them, publishes on through
    more than one slot, and the control sink keeps reading."""
    ev = fleet["events"]
    res = assert_denied(ev, "r-hoard")
    print(f"\nr-hoard: {res}")
    assert res["entries_forged"] > 100 and res["published"] >= 30, res
    assert not _of(fleet["running"], "src", "exit")
    assert not _of(fleet["running"], "sink", "exit")


def test_a_research_reader_cannot_change_what_a_control_reader_holds(fleet):
    """A covert channel at least: flags and offset set by research, read by control."""
    ev = fleet["events"]
    assert attack_result(ev, "r-descr") == {"attack": "shared_description", "denied": None,
                                            "set": True}
    assert_denied(ev, "c-descr")

    def reported(worker: str) -> int:
        return next(e["mono_ns"] for e in _of(ev, worker, "output")
                    if e["line"].startswith("ATTACK "))
    # Control looked after research had set them, or the test proved nothing.
    assert reported("r-descr") < reported("c-descr")


def test_frames_untouched_by_the_reader_attacks(fleet):
    ev = fleet["events"]
    # src and sink kept running through every attack: no restarts, no watchdog misses.
    for w in ("src", "sink"):
        assert not _of(ev, w, "watchdog_missed"), _of(ev, w, "watchdog_missed")
        assert len(_of(fleet["running"], w, "start")) == 1, f"{w} was restarted"


# ---------------------------------------------------------------- the supervisor's log


def test_worker_output_cannot_forge_or_erase_the_log(fleet):
    ev = fleet["events"]
    res = assert_denied(ev, "c-forge")
    assert res["ftruncate1"] == "EINVAL" and res["ftruncate2"] == "EINVAL", res
    with open(fleet["fleet"].log_path) as f:
        assert "must survive" in f.readline()
    # The forged lines are there only as the worker's output, quoted.
    forged = [e for e in _of(ev, "c-forge", "output") if '"event":"ready"' in e["line"]]
    assert forged and all(e["event"] == "output" for e in forged)
    assert not [e for e in ev if e["event"] == "fail_safe"]
    assert not [e for e in ev if e["event"] == "ready" and e.get("pid") == 1]


def test_no_terminal_for_workers(fleet):
    res = assert_denied(fleet["events"], "c-tty")
    assert res["dev_tty"] in ("ENXIO", "ENOENT", "EACCES"), res


# ---------------------------------------------------------------- denials are visible


@pytest.mark.parametrize("worker", ["c-ptrace", "c-persona", "c-unix", "c-ldt"])
def test_dangerous_syscalls_kill_and_are_logged(fleet, worker):
    ev = fleet["events"]
    assert attack_result(ev, worker) is None
    ex = killed_by(ev, worker)
    assert ex["signal"] == "SIGSYS" and ex["code"] == 128 + signal.SIGSYS, ex
    assert "seccomp" in ex["cause"]


def test_research_cannot_install_its_own_code_segments(fleet):
    res = assert_denied(fleet["events"], "r-ldt")
    assert res["errno"] == "EPERM", res


def test_host_socket_in_bound_dir_never_connected(fleet):
    assert fleet["host_connected"] is False


def test_dev_shm_private_and_capped(fleet):
    res = assert_denied(fleet["events"], "c-devshm")
    assert res["error"] == "ENOSPC" and res["mib"] <= 17, res   # the write that failed is counted


# ---------------------------------------------------------------- resources


def test_fork_storm_capped_and_control_unaffected(fleet):
    ev = fleet["events"]
    res = assert_denied(ev, "r-storm")
    assert res["forks"] < 32, res
    for w in ("src", "sink"):
        assert not _of(ev, w, "watchdog_missed")


@pytest.mark.parametrize("worker", ["c-hog", "r-hog"])
def test_memory_hog_in_shared_memory_is_killed_alone(fleet, worker):
    ev = fleet["events"]
    ex = killed_by(ev, worker)
    assert ex["signal"] == "SIGKILL" and "out of memory" in ex["cause"], ex
    for w in ("src", "sink"):
        assert len(_of(fleet["running"], w, "start")) == 1


# ---------------------------------------------------------------- no new code after READY


@pytest.mark.parametrize("worker", ["c-mprotect", "c-memfd"])
def test_new_executable_memory_after_ready_kills(fleet, worker):
    """From READY on the kernel refuses it: the W^X filter the worker locked itself with
    (sandbox/wx.py) kills the process at the syscall, before the exec watch is asked."""
    ev = fleet["events"]
    assert attack_result(ev, worker) is None, attack_result(ev, worker)
    ex = killed_by(ev, worker)
    assert ex["signal"] == "SIGSYS" and "seccomp" in ex["cause"], ex
    assert not _of(ev, worker, "refused"), _of(ev, worker, "refused")   # no judgement needed


def test_ready_says_what_was_locked(fleet):
    """Each control worker's `ready` event: how its W^X lock was checked (its filter read
    back from every thread), what its READY line said of MDWE, and whether this kernel
    has MDWE at all (false: only the filter holds; the audit reads this field)."""
    for w in ("src", "sink"):
        [ready] = _of(fleet["running"], w, "ready")
        assert ready["wx_lock"] == "ptrace", ready
        assert isinstance(ready["mdwe_kernel"], bool), ready
        assert ready["mdwe"] is ready["mdwe_kernel"], ready


@pytest.mark.parametrize("worker,needle", [
    ("c-fakeready", "none of them the W^X filter"),
    ("c-fakewx", "none of them the W^X filter"),       # a decoy filter grew the count
    ("c-wx1thread", "thread ")])                      # the filter on the main thread only
def test_ready_without_the_wx_lock_is_refused(fleet, worker, needle):
    """READY is the supervisor's decision: it reads the filters back from every thread of
    the worker (ptrace) and refuses a READY without the W^X program on each, whatever
    the READY line claims and however many filters the worker holds."""
    ev = fleet["events"]
    ref = _of(ev, worker, "refused")
    assert ref and ref[0]["kind"] == "wx_lock", _of(ev, worker)
    assert worker in ref[0]["reason"] and needle in ref[0]["reason"], ref[0]
    assert not _of(ev, worker, "ready")
    assert _of(ev, worker, "exit"), "refused but not stopped"


def test_no_process_can_share_memory_outside_the_stopped_thread_group(fleet):
    """The exec watch stops the worker's thread group while it judges; a vfork child or a
    clone(CLONE_VM) process would share its memory and run on. None can be made."""
    res = assert_denied(fleet["events"], "c-vmchild")
    assert res["vfork"] == res["clone_vm"] == res["fork"] == "EPERM", res


@pytest.mark.parametrize("worker", ["c-cowrace", "c-fdswap", "c-sigcont"])
def test_a_race_against_the_exec_watch_never_wins(fleet, worker):
    """Issue 21 (was a hole: wins in bench/wx_race.py before the fix): thread 2 mremaps a
    patched copy-on-write page onto the page thread 1 asked to make executable, or
    dup2()s a /tmp file onto the fd thread 1 asked to map, while the supervisor judges;
    c-sigcont also wakes the stopped worker with SIGCONT and stops itself again. The
    worker is stopped while judged and the kernel's result checked: no try wins, and
    the refusal names the worker and what was refused."""
    ev = fleet["events"]
    res = attack_result(ev, worker)
    assert res is None or (res["denied"] is True and res["wins"] == 0), res
    ref = _of(ev, worker, "refused")
    if worker == "c-sigcont" and not ref:
        # Its own SIGSTOP can land after its request was answered: then it has stopped
        # itself for good, and the ready deadline names it.
        assert _of(ev, worker, "ready_timeout") and res is None, _of(ev, worker)
        return
    assert ref and ref[0]["kind"] == "exec_memory", _of(ev, worker)
    reason = ref[0]["reason"] + " " + str(ref[0].get("target"))
    assert worker in reason
    if worker == "c-fdswap":
        assert "/tmp/libswap.so" in reason or "not the file judged" in reason, ref[0]
    else:
        assert "libz" in reason and ("page 0x" in reason or "too slow" in reason), ref[0]
    assert _of(ev, worker, "exit"), "refused but not stopped"


def test_new_executable_mapping_by_mremap_is_refused_by_the_maps_scan(fleet):
    """mremap makes a new executable mapping (libc's text grown and moved) without a
    watched syscall: the maps scan names it against the READY snapshot and stops it."""
    ev = fleet["events"]
    assert attack_result(ev, "c-mremap") is None, "the mremap went unnoticed for 8 s"
    ref = _of(ev, "c-mremap", "refused")
    assert ref and ref[0]["kind"] == "new-exec-after-ready", _of(ev, "c-mremap")
    assert "libc.so" in ref[0]["reason"]
    assert _of(ev, "c-mremap", "exit"), "refused but not stopped"


def test_a_worker_without_its_main_thread_is_still_scanned(fleet):
    """Red team (was a hole): the main thread exits alone, so /proc/PID/maps of the
    worker reads empty and its mountinfo fails; the scan took that for a process gone
    and skipped it, and the mremap that only the scan can see went unnoticed. The scan
    reads a live thread's view now (maps.live_task)."""
    ev = fleet["events"]
    assert attack_result(ev, "c-headless") is None, "the mremap went unnoticed for 8 s"
    ref = _of(ev, "c-headless", "refused")
    assert ref and ref[0]["kind"] == "new-exec-after-ready", \
        "\n".join(str(e.get("line") or e["event"]) for e in _of(ev, "c-headless"))
    assert _of(ev, "c-headless", "exit"), "refused but not stopped"


def test_a_worker_cannot_take_the_exec_watch_for_itself(fleet):
    """A second seccomp listener is refused by the kernel (one per filter chain); a
    notify filter without one answers nothing: after READY the W^X filter kills the
    mprotect before any notification."""
    ev = fleet["events"]
    step = [e["line"] for e in _of(ev, "c-listener", "output")
            if e["line"].startswith("ATTACK-STEP own_listener ")]
    assert step, _of(ev, "c-listener")
    res = json.loads(step[0].split(" ", 2)[2])
    assert res["new_listener"] == "EBUSY", res
    assert attack_result(ev, "c-listener") is None
    ex = killed_by(ev, "c-listener")
    assert ex["signal"] == "SIGSYS" and "seccomp" in ex["cause"], ex


def test_anonymous_exec_before_ready_refused_without_jit_kernels(fleet):
    ev = fleet["events"]
    ref = _of(ev, "c-mprotect0", "refused")
    assert ref and ref[0]["kind"] == "exec_memory", _of(ev, "c-mprotect0")


def test_a_patched_library_page_cannot_become_code_again(fleet):
    """Before READY, libz mapped r-x from a read-only mount, made writable (unwatched),
    patched and made executable: the copied-on-write page is refused."""
    ev = fleet["events"]
    ref = _of(ev, "c-patch", "refused")
    assert ref and ref[0]["kind"] == "exec_memory" and ref[0]["syscall"] == "mprotect", \
        _of(ev, "c-patch")
    assert "modified" in ref[0]["reason"] and "libz" in ref[0]["reason"], ref[0]
    res = attack_result(ev, "c-patch")
    assert res is None or (res["denied"] and res["rw"] == 0), res


def test_the_same_mapping_before_ready_is_allowed_for_a_jit_worker(fleet):
    """What modeld does with its verified kernels: made executable before READY."""
    ev = fleet["events"]
    res = attack_result(ev, "c-jit")
    assert res is not None and res["denied"] is False, _of(ev, "c-jit")
    assert not _of(ev, "c-jit", "refused") and not _of(fleet["running"], "c-jit", "exit")
    assert _of(ev, "c-jit", "ready")


def test_library_dropped_in_tmp_cannot_be_mapped(fleet):
    ev = fleet["events"]
    ref = _of(ev, "c-dlopen", "refused")
    assert ref and ref[0]["syscall"] == "mmap" and "/tmp/libharmless.so" in str(ref[0]["target"]), \
        _of(ev, "c-dlopen")


def test_torch_is_not_on_the_control_filesystem(fleet):
    res = assert_denied(fleet["events"], "c-torch")
    assert res["found"] == [] and "No module named 'torch'" in res["import"], res


def test_swallowed_guard_refusal_is_reported(fleet):
    ev = fleet["events"]
    ref = _of(ev, "c-guard", "refused")
    assert ref and ref[0]["kind"].startswith("guard"), _of(ev, "c-guard")
    assert "torch" in ref[0]["reason"]


def test_status_flood_is_refused_and_starves_nobody(fleet):
    ev = fleet["events"]
    ref = _of(ev, "r-flood", "refused")
    assert ref and ref[0]["kind"] == "protocol_flood", _of(ev, "r-flood")[-3:]
    for w in ("src", "sink"):
        assert not _of(ev, w, "watchdog_missed")


def test_status_churn_cannot_flood_the_event_log(fleet):
    """900 distinct STATUS lines a second stay under the flood refusal (1000/s); each
    becoming an event was ~0.5 MB/s of log from one research worker, past journald's
    default rate limit (10,000 messages / 30 s per unit), which then drops the
    supervisor's own events too (a control worker's refusal, the fail-safe). Status
    events are rate limited per worker (a burst, then 10/s)."""
    ev = fleet["events"]
    res = attack_result(ev, "r-churn")
    assert res is not None and res["lines"] >= 300, _of(ev, "r-churn")[-3:]
    events = _of(ev, "r-churn", "status")
    assert len(events) <= 25 + res["lines"] / 50, (len(events), res["lines"])
    assert any(e.get("held") for e in events), events[-3:]    # what was held is counted


def test_a_worker_status_cannot_rewrite_the_operators_status_line(fleet):
    """The live line goes to the operator's terminal: a worker's STATUS with a carriage
    return and an erase-line would replace everything before it (the FAIL-SAFE prefix,
    the command state), and OSC 52 writes the terminal's clipboard."""
    out = fleet["fleet"].out_path.read_bytes()
    assert b"r-escape: ok" in out, out[-600:]     # the monitor did print its status
    assert b"\x1b" not in out and b"\r" not in out and b"\x07" not in out


def test_an_endless_output_line_is_cut_not_kept(fleet):
    """8 MiB without a newline: the supervisor re-emits the first 2 KiB as the worker's
    output, says how much it cut, and keeps running everyone else."""
    ev = fleet["events"]
    long = [e for e in _of(ev, "c-longline", "output") if e["line"].startswith("AAAA")]
    assert len(long) == 1, [e["line"][:80] for e in _of(ev, "c-longline", "output")]
    assert len(long[0]["line"]) < 2100 and "bytes cut]" in long[0]["line"]
    assert str(8 * (1 << 20) - 2048) in long[0]["line"]
    assert_denied(ev, "c-longline")
    assert not _of(fleet["running"], "c-longline", "exit")     # nothing killed it either


def test_a_worker_log_record_cannot_crash_or_impersonate(fleet):
    """A record nested past the recursion limit is kept as plain output; a record that
    names another source, event and worker is still this worker's `log` event."""
    ev = fleet["events"]
    deep = [e for e in _of(ev, "c-nested", "output") if e["line"].startswith('{"log":"deep"')]
    assert len(deep) == 1 and deep[0]["source"] == "c-nested", _of(ev, "c-nested")
    forged = [e for e in _of(ev, "c-nested", "log") if e["msg"] == "forged"]
    assert len(forged) == 1 and forged[0]["source"] == "c-nested", forged
    assert forged[0]["worker"] == "c-nested" and forged[0]["event"] == "log"
    assert_denied(ev, "c-nested")
    assert not _of(fleet["running"], "c-nested", "exit")       # and the supervisor ran on
