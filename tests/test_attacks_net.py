"""`network = false` means nothing outside the sandbox, in every profile (issue 21, item 4).

Hostile workers under a real `supervisor run`, in the style of tests/test_attacks.py:
one supervisor runs a small fleet; each test asserts that the attack was denied AND
that the supervisor's own log names the worker. The host offers what an attacker would
look for: a listening stream socket and a bound datagram socket in a directory that is
in both domains' `extra_ro_binds`, and an abstract socket in the host's network
namespace. A kill by seccomp is the denial (an exit event naming seccomp and SIGSYS);
the host sockets must have received nothing.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import textwrap
from pathlib import Path

import pytest

from tests._fleet import LoggedRun
from tests._fleet import of as _of

pytestmark = pytest.mark.sandbox
if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the supervisor's isolation (host uids, cgroups) needs root", allow_module_level=True)

# name -> (domain, attack, the call that must kill it; None: must run and answer)
ATTACKERS = {
    "r-ustream": ("research", "unix_stream_host", "connect"),
    "c-ustream": ("control", "unix_stream_host", "connect"),
    "r-udgram": ("research", "unix_dgram_host", "socket"),
    "c-udgram": ("control", "unix_dgram_host", "socket"),
    "r-vsock": ("research", "vsock", "socket"),
    "c-vsock": ("control", "vsock", "socket"),
    "r-netlink": ("research", "netlink", "socket"),
    "c-netlink": ("control", "netlink", "socket"),
    "r-inet": ("research", "inet", "socket"),
    "r-sendto": ("research", "sendto_address", "sendto"),
    "r-sendmsg": ("research", "sendmsg_address", "socketpair-dgram"),
    # A started control worker may not call sendmsg at all (round 6 row 0b: the only
    # call that carries a descriptor out): killed at the first one.
    "c-sendmsg": ("control", "sendmsg_address", "sendmsg"),
    "r-abstract": ("research", "abstract_unix", "connect"),
}
# Not attacks: what must keep working under the rule. Run by workers that exist anyway
# (each worker costs a serial start): socketpairs passing an fd, in research by the
# torch importer (a started control worker passes no fd: c-sendmsg).
TORCH = "r-torch"     # a research worker importing torch under the same rule
PAIRS = {"r-pair": TORCH}


def _toml(sock_dir: Path) -> str:
    parts = [f"""
    [supervisor]
    maps_scan_interval_s = 0.5
    status_interval_s = 1.0
    [domains.control]
    failure_policy = "restart"
    actuates = true
    extra_ro_binds = ["{sock_dir}"]
    [domains.research]
    extra_ro_binds = ["{sock_dir}"]
    [channels.frames]
    slot_size = "4KiB"
    dtype = "uint8"
    max_readers = 2
    slot_count = 5
    [workers.src]
    domain = "control"
    module = "workers.probe"
    publishes = ["frames"]
    args = ["--publish", "frames", "--period-ms", "50", "--ping-ms", "50"]
    watchdog_ms = 1000
    [workers.{TORCH}]
    domain = "research"
    module = "workers.probe"
    args = ["--attack", "socketpair_ok", "--import", "torch"]
    restart = "never"
    optional = true
    ready_timeout_ms = 30000
    memory_max = "2GiB"
    """]
    for name, (domain, attack, _) in ATTACKERS.items():
        first = ["--attack", "socketpair_ok"] if name in PAIRS.values() else []
        args = [*first, "--attack", attack, "--attack-arg", str(sock_dir)]
        parts.append(f"""
    [workers.{name}]
    domain = "{domain}"
    module = "workers.probe"
    args = {json.dumps(args)}
    restart = "never"
    optional = true
    memory_max = "256MiB"
    pids_max = 32
    ready_timeout_ms = 30000
    """)
    return textwrap.dedent("".join(parts))


class Host(LoggedRun):
    """What the host offers: the sockets the fleet attacks, and the supervisor."""

    def __init__(self, tmp: Path) -> None:
        os.chmod(tmp, 0o755)
        self.sock_dir = tmp / f"net{os.getpid()}"
        self.sock_dir.mkdir(mode=0o755)
        os.chmod(self.sock_dir, 0o755)
        self.stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.stream.bind(str(self.sock_dir / "stream.sock"))
        self.stream.listen(8)
        self.stream.setblocking(False)
        self.dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.dgram.bind(str(self.sock_dir / "dgram.sock"))
        self.dgram.setblocking(False)
        for s in ("stream.sock", "dgram.sock"):   # anyone may connect: only the sandbox stops it
            os.chmod(self.sock_dir / s, 0o777)
        self.abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.abstract.bind("\0trio-net-" + self.sock_dir.name)
        self.abstract.listen(8)
        self.abstract.setblocking(False)
        super().__init__(tmp, "net", _toml(self.sock_dir))

    def settle(self, stall_s: float = 180, admission_s: float = 600,
               cap_s: float = 1200) -> list[dict]:
        """Until every attacker has been killed or answered, and torch has imported, then
        0.5 s more (`LoggedRun.settle`: not a fixed deadline, the fleet starts one worker
        after another; on a loaded 2-core machine 60 s was not enough for them all). Each
        attacker's READY deadline is 30 s for the same reason (a sandbox start took over
        5 s under load: killed before its attack, nothing proved)."""
        def done(ev: list[dict]) -> set[str]:
            return {e.get("worker") for e in ev if e["event"] in ("exit", "refused", "gave_up")
                    or (e["event"] == "output" and e["worker"] == TORCH
                        and "import" in e["line"])}
        return super().settle({*ATTACKERS, TORCH}, stall_s=stall_s, admission_s=admission_s,
                              cap_s=cap_s, tail_s=0.5, done=done)

    def received(self) -> dict:
        got: dict = {}
        for name, s in (("stream", self.stream), ("abstract", self.abstract)):
            try:
                s.accept()[0].close()
                got[name] = "connection"
            except BlockingIOError:
                pass
        try:
            got["dgram"] = self.dgram.recv(64).decode(errors="replace")
        except BlockingIOError:
            pass
        return got

    def stop(self) -> list[dict]:
        self.terminate(30)
        for s in (self.stream, self.dgram, self.abstract):
            s.close()
        return self.events()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    h = Host(tmp_path_factory.mktemp("net"))
    try:
        running = h.settle()
        received = h.received()
        yield {"events": h.stop(), "running": running, "received": received}
    finally:
        h.kill()


def _lines(ev: list[dict], worker: str, prefix: str) -> list[str]:
    return [e["line"][len(prefix):] for e in _of(ev, worker, "output")
            if e["line"].startswith(prefix)]


def test_the_host_sockets_received_nothing(fleet):
    assert fleet["received"] == {}, fleet["received"]


@pytest.mark.parametrize("worker", [w for w, (_, _, call) in ATTACKERS.items() if call])
def test_reaching_outside_kills_the_worker_at_the_call_and_is_logged(fleet, worker):
    """Research as control: a host socket in a bound directory (stream and datagram),
    AF_VSOCK, AF_NETLINK, AF_INET, sendto with an address, a socket kind that would
    honour sendmsg's address, an abstract name: each is killed by seccomp at the call
    itself, and the supervisor's exit event names the worker, seccomp and SIGSYS."""
    ev = fleet["events"]
    call = ATTACKERS[worker][2]
    returned = [x for x in _lines(ev, worker, "ATTACK ") if '"socketpair_ok"' not in x]
    assert returned == [], f"{worker} returned: {_of(ev, worker)}"
    steps = _lines(ev, worker, "ATTACK-STEP ")
    assert steps and steps[-1] == call, (worker, steps)
    ex = _of(ev, worker, "exit")
    assert ex, f"no exit event for {worker}: {_of(ev, worker)}"
    assert ex[0]["signal"] == "SIGSYS" and "seccomp" in ex[0]["cause"], ex[0]


@pytest.mark.parametrize("worker", ["r-sendmsg"])
def test_sockets_that_may_exist_ignore_or_refuse_a_sendmsg_address(fleet, worker):
    """Seccomp cannot read sendmsg's msghdr, so the address rule rests on the kinds of
    socket a sandbox may hold: stream refuses an address, seqpacket ignores it."""
    steps = _lines(fleet["events"], worker, "ATTACK-STEP connected-kinds ")
    assert steps, _of(fleet["events"], worker)
    got = dict(kv.split("=", 1) for kv in steps[0].split())
    # EOPNOTSUPP and ENOTSUP are one number on Linux; errno.errorcode names it ENOTSUP
    assert got["stream_unconnected"] in ("EOPNOTSUPP", "ENOTSUP"), got
    assert got["stream_pair"] == "EISCONN", got
    assert got["seqpacket_unconnected"] == "ENOTCONN", got
    assert got["seqpacket_pair"] == "sent:1", got   # to its peer, not to the address


@pytest.mark.parametrize("check", PAIRS)
def test_socketpairs_still_work_for_channels(fleet, check):
    """Stream and seqpacket pairs passing an fd, in research."""
    worker = PAIRS[check]
    ev = fleet["running"]
    res = [json.loads(x) for x in _lines(ev, worker, "ATTACK ")]
    res = [r for r in res if r["attack"] == "socketpair_ok"]
    assert res and res[0]["stream"] == res[0]["seqpacket"] == "ping+1fd", _of(ev, worker)


def test_research_still_imports_torch_under_the_rule(fleet):
    ev = fleet["running"]
    assert any(e["line"] == f"probe {TORCH}: imported torch" for e in _of(ev, TORCH, "output")), \
        _of(ev, TORCH)
    assert not _of(ev, TORCH, "exit"), _of(ev, TORCH, "exit")
