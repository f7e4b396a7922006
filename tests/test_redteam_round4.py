"""Red team, round 4: attacks on what landed on the last day (the admission cache, the
privileged split, the last word's reader positions, take_newest, CUDA launch plans).

Each test asserts the claim the way it should hold. An attack that succeeds today is an
``xfail(strict=True)`` whose reason starts with BREAK and says where to fix it (the
table is docs/redteam4.md). The attacker runs with the privileges it would have: a
file writer for admission, a reader process holding its own lease table (real shared
memory, the real Reader/Writer/publish_safe), a holder of a signing key whose plan the
loader must still refuse when it is inconsistent, a config author.
"""
from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from supervisor.admission import check as admission_check
from supervisor.admission._witness import RACY_NS

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ admission cache

_FRESH_WALK = """
import json, sys
from supervisor.admission import check
r = check.check_worker("w", "control", sys.argv[1], None, [sys.argv[2], *sys.path[1:]])
print(json.dumps({"ok": r.ok, "chains": [" -> ".join(f.chain) for f in r.findings]}))
"""


def _fresh_walk(code: Path, module: str) -> dict:
    """The verdict of a walk with nothing cached: a new process, TRIO_ADMISSION_CACHE=off."""
    env = dict(os.environ, TRIO_ADMISSION_CACHE="off",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-c", _FRESH_WALK, module, str(code)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_a_cached_admission_never_admits_a_module_changed_through_a_mapping(tmp_path: Path) -> None:
    """A module rewritten through a MAP_SHARED writable mapping keeps (dev, inode, size,
    mtime, ctime): the kernel stamps only the first write fault of a clean page, and the
    page stays dirty until writeback (30 s on ext4, never on tmpfs). A cached verdict must
    still be the verdict a walk gives now. Broken until dd964f8 (identity only)."""
    code = tmp_path / "code"
    pkg = code / "rt4mmap"
    pkg.mkdir(parents=True)
    init = pkg / "__init__.py"
    init.write_bytes(b"import json\n" + b"#" * 4084 + b"\n")      # one page, clean
    fd = os.open(init, os.O_RDWR)
    try:
        m = mmap.mmap(fd, 4096)
        m[0:1] = b"i"                       # the one write fault: mtime/ctime now, page dirty
        time.sleep(RACY_NS / 1e9 + 0.1)     # older than RACY_NS: the walk is kept
        first = admission_check.check_worker("w", "control", "rt4mmap", None,
                                             [str(code), *sys.path[1:]])
        assert first.ok, first.format()
        before = os.stat(init)
        m[0:12] = b"import torch"           # the same dirty page: no fault, no new stamp

        after = os.stat(init)
        same_id = (before.st_ino, before.st_size, before.st_mtime_ns, before.st_ctime_ns) == \
            (after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns)
        second = admission_check.check_worker("w", "control", "rt4mmap", None,
                                              [str(code), *sys.path[1:]])
        m.close()
    finally:
        os.close(fd)
    assert init.read_bytes().startswith(b"import torch")
    fresh = _fresh_walk(code, "rt4mmap")
    assert not fresh["ok"], fresh
    assert fresh["chains"] == ["rt4mmap (rt4mmap/__init__.py:1) -> torch"], fresh
    # the claim: a cached verdict is the verdict a walk would give now
    assert not second.ok, (f"cached verdict admitted it (identity unchanged: {same_id}); "
                           f"a fresh walk refuses: {fresh['chains']}")


_ADMIT_WITH_CACHE = """
import json, sys
from supervisor.admission import check
r = check.check_worker("w", "control", sys.argv[1], None, [sys.argv[2], *sys.path[1:]])
print(json.dumps({"ok": r.ok, "walks": check.CACHE_STATS.walks, "hits": check.CACHE_STATS.hits}))
"""


def _admit_with_disk_cache(code: Path, module: str, cache: Path) -> dict:
    env = dict(os.environ, TRIO_ADMISSION_CACHE=str(cache),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, "-c", _ADMIT_WITH_CACHE, module, str(code)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_the_disk_cache_never_admits_a_module_changed_through_a_mapping(tmp_path: Path) -> None:
    """The same, across supervisor processes (TRIO_ADMISSION_CACHE). Broken until
    dd964f8."""
    code, cache = tmp_path / "code", tmp_path / "cache"
    (code / "rt4disk").mkdir(parents=True)
    init = code / "rt4disk" / "__init__.py"
    init.write_bytes(b"import json\n" + b"#" * 4084 + b"\n")
    fd = os.open(init, os.O_RDWR)
    try:
        m = mmap.mmap(fd, 4096)
        m[0:1] = b"i"                       # the write fault: stamped now, the page dirty
        time.sleep(RACY_NS / 1e9 + 0.1)
        first = _admit_with_disk_cache(code, "rt4disk", cache)
        assert (first["ok"], first["walks"]) == (True, 1), first
        m[0:12] = b"import torch"           # the dirty page: no new stamp
        second = _admit_with_disk_cache(code, "rt4disk", cache)
        m.close()
    finally:
        os.close(fd)
    fresh = _fresh_walk(code, "rt4disk")
    assert not fresh["ok"], fresh
    assert not second["ok"], (second, fresh)


_FLIPPER = r"""
import mmap, os, sys, time
n, d = int(sys.argv[1]), sys.argv[2]
parent, deadline = os.getppid(), time.monotonic() + 60   # never outlives the test
T, C = b"import torch", b"import json "
maps = []
for i in range(n):
    fd = os.open(os.path.join(d, f"rt4f{i}", "__init__.py"), os.O_RDWR)
    maps.append(mmap.mmap(fd, 4096))
    os.close(fd)
cfd = os.open(os.path.join(d, "ctl"), os.O_RDWR)
ctl = mmap.mmap(cfd, 4096)
for m in maps:
    m[0:12] = T                  # the one write fault of each page: stamped now, dirty after
print("ready", flush=True)
active, k = list(range(n)), 0
while active and ctl[4095] == 0:
    k += 1
    if k % 64 == 0 and (os.getppid() != parent or time.monotonic() > deadline):
        break
    for i in list(active):
        if ctl[i]:               # the test is done walking i: leave it importing torch
            maps[i][0:12] = T
            ctl[i] = 2
            active.remove(i)
        else:
            maps[i][0:12] = T if k & 1 else C
"""


# Was a strict xfail (BREAK), fixed: see docs/redteam4.md.
def test_a_module_changing_during_its_walk_is_never_a_stale_hit(tmp_path: Path) -> None:
    code = tmp_path / "code"
    n = 600                  # found within 1-241 walks in four runs (loaded)
    for i in range(n):
        (code / f"rt4f{i}").mkdir(parents=True)
        (code / f"rt4f{i}" / "__init__.py").write_bytes(b"import json \n" + b"#" * 4082 + b"\n")
    (code / "ctl").write_bytes(b"\0" * 4096)
    cfd = os.open(code / "ctl", os.O_RDWR)
    ctl = mmap.mmap(cfd, 4096)
    p = subprocess.Popen([sys.executable, "-c", _FLIPPER, str(n), str(code)],
                         stdout=subprocess.PIPE, text=True)
    stale: list[int] = []
    try:
        assert p.stdout is not None and p.stdout.readline().startswith("ready")
        time.sleep(RACY_NS / 1e9 + 0.15)            # the stamps older than RACY_NS
        path = [str(code), *sys.path[1:]]
        for i in range(n):
            admission_check.check_worker("w", "control", f"rt4f{i}", None, path)  # racing
            ctl[i] = 1
            end = time.monotonic() + 10
            while ctl[i] != 2 and time.monotonic() < end:
                time.sleep(0)
            assert ctl[i] == 2, "the flipper stopped answering"
            again = admission_check.check_worker("w", "control", f"rt4f{i}", None, path)
            now = (code / f"rt4f{i}" / "__init__.py").read_bytes()[:12]
            if again.ok and now == b"import torch":
                stale.append(i)
                break
    finally:
        ctl[4095] = 1
        p.wait(timeout=30)
        ctl.close()
        os.close(cfd)
    assert not stale, f"walk {stale[0]}: a cached 'admit' for a module that imports torch"


# ------------------------------------------------------------------ the last word

_LASTWORD_TOML = '''
[domains.control]
profile = "control"
[domains.research]
profile = "research"
[channels.control_cmd]
kind = "tensor"
dtype = "float32"
slot_size = "4KiB"
payload = "control_cmd"
max_age_ms = 1000     # a vehicle actuation channel's age limit (config/_rules.py)
[workers.controlsd]
domain = "control"
module = "workers.controlsd"
publishes = ["control_cmd"]
[workers.actuator]
domain = "control"
module = "workers.recorder"
subscribes = ["control_cmd"]
[workers.logger]
domain = "control"
module = "workers.recorder"
subscribes = ["control_cmd"]
'''


def _drain(r) -> list[tuple[int, object]]:
    from schemas.payloads import CONTROL_CMD
    from supervisor.ipc.errors import Rejected

    out: list[tuple[int, object]] = []
    while True:
        try:
            m = r.try_receive()
        except Rejected as e:
            out.append((e.sequence or -1, e.reason))
            continue
        if m is None:
            return out
        with m:
            out.append((m.stamp[0], CONTROL_CMD.decode(np.array(m.array))))


def _safe_last(seen) -> bool:
    return bool(seen) and isinstance(seen[-1][1], dict) and seen[-1][1]["engaged"] == 0.0


def _safe_delivered_last(seen) -> bool:
    """The last message delivered (refusals aside) is a SAFE."""
    got = [c for _, c in seen if isinstance(c, dict)]
    return bool(got) and got[-1]["engaged"] == 0.0


@pytest.mark.parametrize("claimed", ["honest_limit", "plausible"])
def test_a_control_reader_cannot_hide_the_last_word_from_another(make_channel, claimed) -> None:
    """A control reader claims a position no honest reader reaches, in its own lease
    table; its writer dies: the honest control reader still takes SAFE, and nothing
    engaged after it (the liar's own SAFE, above its claim, is refused: counted once).
    Broken until 635e2c9 (one SAFE, numbered above the claim: refused as sequence_jump)."""
    from schemas.payloads import CONTROL_CMD
    from supervisor.config import loads
    from supervisor.failsafe import publish_safe, trusted_readers
    from supervisor.ipc import Reader, Writer
    from supervisor.ipc import layout as L

    cfg = loads(_LASTWORD_TOML, "rt4-lastword.toml")
    trusted = trusted_readers(cfg, "control_cmd")
    honest_i = cfg.readers_of("control_cmd").index("actuator")
    hostile_i = cfg.readers_of("control_cmd").index("logger")
    assert {honest_i, hostile_i} <= set(trusted)
    ch = make_channel(name="control_cmd", slot_size=4096, dtype="float32",
                      max_readers=len(cfg.readers_of("control_cmd")) + 1, slot_count=8)
    w = Writer(ch.writer_handle(), domain="control", seal=False)
    honest = Reader(ch.reader_handle(honest_i))
    hostile = Reader(ch.reader_handle(hostile_i))
    for _ in range(4):
        w.publish_array(CONTROL_CMD.encode(steer_rad=0.1, engaged=1.0))
    assert len(_drain(honest)) == 4
    _drain(hostile)
    w.close()                                           # the writer dies
    # The hostile control reader's own table: a position no honest reader reaches.
    pos = L.SEQ_HONEST if claimed == "honest_limit" else L.PLAUSIBLE - 2
    struct.pack_into("<Q", hostile._lease_mm, L.OFF_TAKEN, pos)
    publish_safe(ch, "control_cmd", trusted)
    seen = _drain(honest)
    assert _safe_delivered_last(seen), f"honest control reader after SAFE: {seen}, " \
        f"rejected {honest.stats.rejected}"


# ------------------------------------------------------------------ CUDA launch plans

CUDA_DEMO = REPO / "models" / "demo" / "lane-offset-cuda"


@pytest.fixture(scope="module")
def signing_key(tmp_path_factory):
    from supervisor.model import keys as K

    d = tmp_path_factory.mktemp("rt4keys")
    k = K.generate_private_key(d / "k.key")
    (d / "k.pub").write_text(K.public_key_text(k.public_key()))
    return k, d / "k.pub"


@pytest.mark.parametrize("dim", ["grid", "block"])
def test_a_plan_launching_more_threads_than_its_kernel_was_built_for_is_refused(
        tmp_path, signing_key, dim) -> None:
    from supervisor.model import artifact as A
    from supervisor.model import cuda as C
    from supervisor.model import load_verified
    from supervisor.model.errors import ArtifactError
    from workers.modeld.engine import ENGINE_ABIS

    k, pub = signing_key
    b = Path(shutil.copytree(CUDA_DEMO, tmp_path / "b"))
    plan = json.loads((b / C.LAUNCH_FILE).read_bytes())
    c0 = plan["calls"][0]
    assert (c0["kernel"], c0["grid"], c0["block"]) == ("E_725_2_16_4", [2, 725, 1], [16, 1, 1])
    if dim == "grid":
        c0["grid"] = [2, 1450, 1]
    else:
        c0["block"] = [32, 1, 1]
    (b / C.LAUNCH_FILE).write_bytes(json.dumps(plan).encode())
    m = A.read_manifest_unverified(b)
    m.pop("signing", None)
    A.write_signed(b, A.refresh_file_entries(b, m), k)
    with pytest.raises(ArtifactError):
        load_verified(b, pub, expect_abi=ENGINE_ABIS).close()


# ------------------------------------------------------------------ the privileged split

_BROKER_TOML = """
[domains.control]
failure_policy = "fail_safe"
actuates = true
[channels.a_out]
slot_size = "4KiB"
dtype = "float32"
[workers.a]
domain = "control"
module = "workers.probe"
publishes = ["a_out"]
args = ["--publish", "a_out"]
"""

# The compromised supervisor proper: started as root only because /root (the
# interpreter) is 0700 here; it imports what it needs, then drops to nobody as
# `run --privsep` does, and only then speaks to the broker on the socket it holds.
_PROPER = r"""
import json, os, signal, socket, sys
from supervisor.broker import BrokerClient
from supervisor.config import load
from supervisor.ipc.channel import Channel
fd, cfg_path, broker_pid, state_dir = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
cfg = load(cfg_path)
os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
assert os.getresuid() == (65534, 65534, 65534)
c = BrokerClient(socket.socket(fileno=fd))
out = {}
def attempt(name, fn):
    try:
        r = fn()
        out[name] = "allowed" if r is None else r
    except Exception as e:
        out[name] = getattr(e, "code", type(e).__name__)
out["latched_before"] = bool(c.read_latch())
ch = Channel.create(cfg.channel_specs()["a_out"])
def start():
    s = c.start("a", 1, handles={"a_out": ch.writer_handle()})
    c.kill_sandbox("a", 1)
    return "started"
attempt("start_while_latched", start)
attempt("clear_latch", c.clear_latch)
out["latched_after"] = bool(c.read_latch())
# Reaching the broker itself: signals, its /proc, its state dir.
attempt("signal_broker", lambda: os.kill(broker_pid, signal.SIGSTOP))
attempt("broker_environ", lambda: len(open(f"/proc/{broker_pid}/environ", "rb").read()) and "read")
attempt("broker_fds", lambda: os.listdir(f"/proc/{broker_pid}/fd") and "listed")
attempt("state_dir", lambda: os.listdir(state_dir) is not None and "listed")
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def proper_attacks(tmp_path_factory) -> dict:
    """One broker (root, as `run --privsep` starts it) with the fail-safe latched by an
    honest run; a supervisor proper dropped to nobody then asks it for what it may not."""
    if shutil.which("bwrap") is None or os.geteuid() != 0:
        pytest.skip("the broker starts sandboxes as root with bubblewrap")
    from supervisor.broker import BrokerClient

    d = tmp_path_factory.mktemp("rt4broker")
    cfg = d / "broker.toml"
    cfg.write_text(_BROKER_TOML)
    # The state dir root's 0700, under a directory anyone may traverse (pytest's own
    # tmp dirs are 0700 root: a refusal must come from the state dir, not its parents).
    base = Path(tempfile.mkdtemp(prefix="rt4-broker-"))
    base.chmod(0o755)
    state = base / "state"
    state.mkdir(mode=0o700)
    err = open(d / "broker.err", "w")
    client = BrokerClient.spawn(state_dir=state, config=cfg, stderr=err)
    try:
        client.set_latch("an honest run failed safe: driver fault")   # as the broker does
        assert client.read_latch()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        p = subprocess.run([sys.executable, "-c", _PROPER, str(client.sock.fileno()), str(cfg),
                            str(client.proc.pid), str(state)],
                           pass_fds=[client.sock.fileno()], env=env, cwd="/",
                           capture_output=True, text=True, timeout=60, check=False)
        assert p.returncode == 0, p.stderr[-2000:]
        got = json.loads(p.stdout.strip().splitlines()[-1])
        got["broker_alive"] = client.proc.poll() is None
    finally:
        code = client.close()
        err.close()
        shutil.rmtree(base, ignore_errors=True)
    got["broker_exit"] = code
    return got


def test_the_unprivileged_supervisor_proper_cannot_reach_the_broker_itself(proper_attacks):
    assert proper_attacks["latched_before"]
    for k in ("signal_broker", "broker_environ", "broker_fds", "state_dir"):
        assert proper_attacks[k] == "PermissionError", (k, proper_attacks)
    assert proper_attacks["broker_alive"] and proper_attacks["broker_exit"] == 0


def test_the_broker_starts_nothing_while_the_fail_safe_is_latched(proper_attacks):
    """While root's latch is set, the broker starts no control worker for the
    unprivileged supervisor proper. Broken until 69b0570 (started)."""
    assert proper_attacks["start_while_latched"] != "started", proper_attacks


def test_the_unprivileged_supervisor_proper_cannot_clear_the_latch(proper_attacks):
    """Only root clears the latch (supervisor clear-fail-safe): clearLatch from the
    supervisor proper is refused. Broken until 69b0570 (served)."""
    assert proper_attacks["clear_latch"] != "allowed" and proper_attacks["latched_after"], \
        proper_attacks


# ------------------------------------------------------------------ log cut

def test_a_hostile_video_index_is_one_line_and_never_amplifies_a_cut(tmp_path) -> None:
    """A recorder's log whose index repeats one frame's record (its own valid CRC) 200
    times: the cut is one line or a log with each frame once, never a traceback or 200
    copies. Broken until df404dd (the cut copied the frame 200 times into memory, then
    died on an assert; python -O would have written them all)."""
    from tests.test_replay_format import write_log

    src = tmp_path / "drive"
    write_log(src, n=4)
    vidx = src / "road_frames.vidx"
    raw = vidx.read_bytes()
    vidx.write_bytes(raw + raw[:40] * 200)        # frame 0's record, CRC and all, again
    before = (src / "road_frames.nv12").stat().st_size
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "supervisor.cli", "log", "cut", str(src), str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert "Traceback" not in p.stderr, p.stderr[-600:]
    after = sum(f.stat().st_size for f in out.glob("road_frames.nv12"))
    assert after <= before, (before, after, p.returncode, p.stderr[-300:])


# ------------------------------------------------------------------ from inside sandboxes

RT4_MODULE = "workers.probe.attacks_redteam4"
RT4_FLEET = {"c-rt4-victim": ("lastword_victim", "--pub"),
             "c-rt4-honest": ("honest_reader", "--sub"),
             "c-rt4-hostile": ("claim_position", "--sub")}


def _rt4_toml() -> str:
    out = ['''
[supervisor]
status_interval_s = 0.5
[domains.control]
failure_policy = "restart"
[channels.ch_rt4]
slot_size = "4KiB"
dtype = "float32"
payload = "control_cmd"
slot_count = 8
max_readers = 3
max_age_ms = 1000     # the vehicle limit for an actuation channel (config/_rules.py)
''']
    for name, (attack, flag) in RT4_FLEET.items():
        bind = "publishes" if flag == "--pub" else "subscribes"
        out.append(f'''
[workers.{name}]
domain = "control"
module = "{RT4_MODULE}"
{bind} = ["ch_rt4"]
args = ["--attack", "{attack}", "{flag}", "ch_rt4"]
optional = true
restart = "never"
ready_timeout_ms = 60000
memory_max = "256MiB"
pids_max = 32
''')
    return "".join(out)


@pytest.fixture(scope="module")
def rt4_fleet(tmp_path_factory) -> list[dict]:
    """One embedded Supervisor with the three last-word workers, until the honest reader
    has said what it got (or 90 s)."""
    if shutil.which("bwrap") is None or os.geteuid() != 0:
        pytest.skip("sandboxes with host uids need root and bubblewrap")
    import io

    import trio

    from supervisor.config import loads
    from supervisor.events import EventLog
    from supervisor.lifecycle import Supervisor
    from tests._fleet import attack_result

    tmp = tmp_path_factory.mktemp("rt4fleet")
    cfg = loads(_rt4_toml(), str(tmp / "rt4.toml"))
    logf = open(tmp / "supervisor.log", "w")
    log = EventLog(stream=logf, keep=True)
    sup = Supervisor(cfg, log=log, status_out=io.StringIO())

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            with trio.move_on_after(90):
                while attack_result(log.events, "c-rt4-honest") is None and not any(
                        "crashed" in (attack_result(log.events, w) or {}) for w in RT4_FLEET):
                    await trio.sleep(0.1)
            n.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        logf.close()
    return log.events


def test_the_sandboxed_last_word_attack_ran(rt4_fleet) -> None:
    """Not an xfail: the strict xfail below would pass on a fleet that never attacked."""
    from tests._fleet import attack_result, of as _of

    for worker in RT4_FLEET:
        res = attack_result(rt4_fleet, worker)
        assert res is not None and "crashed" not in res, (worker, _of(rt4_fleet, worker)[-6:])
    assert attack_result(rt4_fleet, "c-rt4-victim")["claimed_seen"]
    assert _of(rt4_fleet, "c-rt4-victim", "last_word"), _of(rt4_fleet, "c-rt4-victim")[-6:]


def test_a_sandboxed_control_reader_cannot_hide_the_last_word(rt4_fleet) -> None:
    """End to end: the honest control reader (its own sandbox) takes SAFE after its writer
    died, whatever the hostile control reader claimed. Broken until 635e2c9."""
    from tests._fleet import attack_result, of as _of

    res = attack_result(rt4_fleet, "c-rt4-honest")
    assert res is not None and res.get("saw_safe"), (
        res, [e["line"] for e in _of(rt4_fleet, "c-rt4-honest", "output")][-4:],
        _of(rt4_fleet, "c-rt4-victim", "last_word"))


# ------------------------------------------------------------------ users

@pytest.mark.parametrize("domain", ["control", "research"])
def test_no_domain_runs_as_the_supervisor_propers_user(domain) -> None:
    """No sandbox shares a uid with the unprivileged supervisor proper (nobody, where
    trio-supervisor does not exist, as here). Broken until 80cbb77."""
    from supervisor.config import ConfigError, loads

    toml = f'''
[domains.{domain}]
user = "nobody"
[channels.x]
slot_size = "4KiB"
dtype = "float32"
[workers.w]
domain = "{domain}"
module = "workers.probe"
publishes = ["x"]
'''
    with pytest.raises(ConfigError, match="user"):
        loads(toml, "rt4-users.toml")


# ------------------------------------------------------------------ take_newest

@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_lying_header_cannot_starve_take_newest(make_channel, native) -> None:
    """A writer's header claims a sequence (below SEQ_HONEST) no slot holds, while its
    slots hold the real frames: take_newest still delivers them, as an in-order reader
    gets them. Broken until 41c6f58 (None at every look, forever, nothing counted)."""
    from supervisor.ipc import Reader, Writer
    from supervisor.ipc import layout as L

    ch = make_channel(name="road_frames", slot_size=4096, dtype="float32", max_readers=2,
                      slot_count=8)
    w = Writer(ch.writer_handle(), domain="control", seal=False)
    newest = Reader(ch.reader_handle(0), native=native)
    in_order = Reader(ch.reader_handle(1), native=native)
    took_newest, took_in_order = [], []
    for k in range(1, 7):
        w.publish_array(np.full(4, k, np.float32))
        L.U64.pack_into(w._buf, L.OFF_LAST_SEQ, 1000)     # the header claims a newer one
        for r, out in ((newest, took_newest), (in_order, took_in_order)):
            m = r.take_newest() if r is newest else r.try_receive()
            if m is not None:
                with m:
                    out.append(m.sequence)
    assert took_in_order == [1, 2, 3, 4, 5, 6]
    assert took_newest, (took_newest, newest.stats)


# ------------------------------------------------------------------ a restarted writer

# Was a strict xfail (BREAK), fixed: see docs/redteam4.md (layout.resume_point).
def test_a_restarted_writer_is_heard_after_its_predecessor_walked_the_readers_up(
        make_channel) -> None:
    from schemas.payloads import CONTROL_CMD
    from supervisor.failsafe import publish_safe
    from supervisor.ipc import Reader, Writer
    from supervisor.ipc import layout as L

    ch = make_channel(name="control_cmd", slot_size=4096, dtype="float32", max_readers=2,
                      slot_count=8)
    w = Writer(ch.writer_handle(), domain="control", seal=False)
    r = Reader(ch.reader_handle(0))

    def pub(writer, steer: float) -> None:
        writer.publish_array(CONTROL_CMD.encode(steer_rad=steer, engaged=1.0))

    pub(w, 0.1)
    assert [s for s, _ in _drain(r)] == [1]
    w._last_seq = L.SEQ_HONEST - 3          # the hostile predecessor's own counter
    for _ in range(6):
        pub(w, 0.1)
        _drain(r)
    assert r._last_seq > L.SEQ_HONEST       # walked up, message by message
    w.close()
    publish_safe(ch, "control_cmd")
    assert _safe_last(_drain(r))            # the last word still reaches it
    w2 = Writer(ch.writer_handle(), domain="control", seal=False)    # restarted, honest
    for _ in range(5):
        pub(w2, 0.2)
    got = _drain(r)
    w2.close()
    assert [c["steer_rad"] for _, c in got if isinstance(c, dict)] == [
        pytest.approx(0.2)] * 5, (got, r.stats.rejected, w2.last_sequence)


# Was a strict xfail (BREAK), fixed: see docs/redteam4.md (layout.resume_point).
def test_a_control_reader_cannot_make_a_later_restarted_writer_unheard(make_channel) -> None:
    from schemas.payloads import CONTROL_CMD
    from supervisor.config import loads
    from supervisor.failsafe import publish_safe, trusted_readers
    from supervisor.ipc import Reader, Writer
    from supervisor.ipc import layout as L

    cfg = loads(_LASTWORD_TOML, "rt4-lastword.toml")
    trusted = trusted_readers(cfg, "control_cmd")
    honest_i = cfg.readers_of("control_cmd").index("actuator")
    hostile_i = cfg.readers_of("control_cmd").index("logger")
    ch = make_channel(name="control_cmd", slot_size=4096, dtype="float32",
                      max_readers=len(cfg.readers_of("control_cmd")) + 1, slot_count=8)
    first = Writer(ch.writer_handle(), domain="control", seal=False)
    honest = Reader(ch.reader_handle(honest_i))
    hostile = Reader(ch.reader_handle(hostile_i))

    def run(w, steer: float, n: int) -> None:
        for _ in range(n):
            w.publish_array(CONTROL_CMD.encode(steer_rad=steer, engaged=1.0))
            _drain(honest)
        w.close()

    run(first, 0.1, 3)
    _drain(hostile)
    struct.pack_into("<Q", hostile._lease_mm, L.OFF_TAKEN, L.SEQ_HONEST - 10)
    publish_safe(ch, "control_cmd", trusted)      # the first writer died
    assert _safe_last(_drain(honest))
    run(Writer(ch.writer_handle(), domain="control", seal=False), 0.2, 12)   # restarted: heard
    assert honest._last_seq > L.SEQ_HONEST
    w = Writer(ch.writer_handle(), domain="control", seal=False)      # restarted again
    for _ in range(3):
        w.publish_array(CONTROL_CMD.encode(steer_rad=0.3, engaged=1.0))
    got = _drain(honest)
    w.close()
    assert [c["steer_rad"] for _, c in got if isinstance(c, dict)] == [
        pytest.approx(0.3)] * 3, (got, honest.stats.rejected, w.last_sequence)


@pytest.mark.parametrize("case", ["dangling_symlink", "under_a_file"])
# Was a strict xfail (BREAK), fixed: see docs/redteam4.md.
def test_log_cut_refuses_a_bad_out_in_one_line(tmp_path, case) -> None:
    from tests.test_replay_format import write_log

    src = tmp_path / "drive"
    write_log(src, n=4)
    target = tmp_path / "elsewhere" / "x"
    if case == "dangling_symlink":
        out = tmp_path / "out"
        out.symlink_to(target)
    else:
        (tmp_path / "afile").write_text("")
        out = tmp_path / "afile" / "sub"
    p = subprocess.run([sys.executable, "-m", "supervisor.cli", "log", "cut", str(src), str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert not target.exists() and not target.parent.exists()      # nothing written through
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr[-400:]
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


# Was a strict xfail (BREAK), fixed: see docs/redteam4.md.
def test_the_broker_refuses_a_state_dir_others_can_write(tmp_path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the broker's state dir is root's")
    from supervisor.broker import BrokerClient

    cfg = tmp_path / "broker.toml"
    cfg.write_text(_BROKER_TOML)
    # Under a directory nobody can traverse (pytest's tmp_path is under a 0700 root dir)
    base = Path(tempfile.mkdtemp(prefix="rt4-state-"))
    base.chmod(0o755)
    state = base / "state"
    state.mkdir()
    os.chown(state, 65534, 65534)
    state.chmod(0o777)
    client = BrokerClient.spawn(state_dir=state, config=cfg, stderr=subprocess.DEVNULL)
    removed = "broker refused the state dir"
    try:
        client.set_latch("root latched this")
        p = subprocess.run([sys.executable, "-c",
                            "import os, sys; os.setgroups([]); os.setresgid(65534, 65534, 65534);"
                            " os.setresuid(65534, 65534, 65534); os.unlink(sys.argv[1])",
                            str(state / "failsafe.latch")],
                           capture_output=True, text=True, timeout=60, check=False)
        removed = "removed by nobody" if p.returncode == 0 else p.stderr.strip()[-120:]
    except Exception as e:            # the broker refused to start, or refused the latch
        removed = f"refused: {type(e).__name__}: {e}"
    finally:
        client.close()
        shutil.rmtree(base, ignore_errors=True)
    assert removed != "removed by nobody", removed


# Was a strict xfail (BREAK), fixed: see docs/redteam4.md.
def test_a_deeply_nested_json_entry_is_a_corrupt_record_not_a_traceback(tmp_path) -> None:
    from supervisor.replay.logfmt import MESSAGES, Entry, StreamWriter
    from tests.test_replay_format import write_log

    src = tmp_path / "drive"
    write_log(src, n=4)
    e = Entry.new_message(monoNs=1)
    e.event = "[" * 100_000 + "]" * 100_000
    w = StreamWriter(src / MESSAGES)
    w.write_entry(e)
    w.close()
    p = subprocess.run([sys.executable, "-m", "supervisor.cli", "log", "info", str(src)],
                       cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert "Traceback" not in p.stderr, p.stderr[-300:]


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:"):
                out.add(link)
    except OSError:
        pass
    return out


def test_no_sandbox_holds_the_brokers_socket(tmp_path) -> None:
    """Every process of a sandbox the broker started (bwrap, its init, the worker) holds
    no descriptor of the broker's own socket: a worker cannot talk to the broker."""
    if shutil.which("bwrap") is None or os.geteuid() != 0:
        pytest.skip("the broker starts sandboxes as root with bubblewrap")
    from supervisor.broker import BrokerClient
    from supervisor.config import load
    from supervisor.ipc.channel import Channel

    cfg_path = tmp_path / "broker.toml"
    cfg_path.write_text(_BROKER_TOML)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    client = BrokerClient.spawn(state_dir=state, config=cfg_path, stderr=subprocess.DEVNULL)
    ch = Channel.create(load(cfg_path).channel_specs()["a_out"])
    try:
        client.ping()
        argv = Path(f"/proc/{client.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"--socket-fd" in argv, argv
        theirs = int(argv[argv.index(b"--socket-fd") + 1])
        broker_sock = os.readlink(f"/proc/{client.proc.pid}/fd/{theirs}")
        assert broker_sock.startswith("socket:")
        s = client.start("a", 1, handles={"a_out": ch.writer_handle()})
        pids: list[int] = []
        end = time.monotonic() + 60
        while time.monotonic() < end and len(pids) < 3:    # bwrap, its init, the worker
            pids = client.pids("a", 1)
            time.sleep(0.1)
        held = {p: _socket_inodes(p) for p in pids}
        client.kill_sandbox("a", 1)
        for fd in (s.pidfd, s.status_r, s.out_r):
            os.close(fd)
    finally:
        client.close()
        ch.close()
    assert len(pids) >= 3, pids
    assert not [p for p, socks in held.items() if broker_sock in socks], (broker_sock, held)
