"""Red team, round 3: attacks no issue named, each run from inside a real sandbox
(workers/probe/attacks_redteam3.py) under one real `Supervisor`, embedded here as
tests/test_faults.py embeds it, so that the test holds a reader of each attacker's
channel (reader index 1, the spare after the monitor's 0) and can watch the supervisor's
own event loop. Every test asserts the secure behaviour; an attack that succeeds today
is an `xfail(strict=True)` whose reason starts with BREAK and says where to fix it
(docs/redteam3.md has the table).

The fleet runs in phases the test drives (an attacker waits for the test's reader on its
channel): the last-word attackers together, then the output flood, then the wake-up
spam, each of those two alone so that its cost to the supervisor is measured against a
quiet window of the same run.
"""
from __future__ import annotations

import io
import math
import os
import shutil
import textwrap
import time

import numpy as np
import pytest

from tests._fleet import attack_result
from tests._fleet import of as _of

pytestmark = pytest.mark.sandbox
if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the supervisor's isolation (host uids, cgroups) needs root",
                allow_module_level=True)

MODULE = "workers.probe.attacks_redteam3"
TEST_READER = 1
LASTWORD = {"c-rollback": "lastword_rollback", "c-unmagic": "lastword_unmagic",
            "c-brick": "lastword_brick", "c-skipseq": "lastword_skipped_seq",
            "c-seal": "lastword_seal",
            "c-headless": "headless_writer"}
# The brick on a channel that is not actuation (no payload: model_out's kind): the
# supervisor never writes it, so nothing repairs it.
PLAIN = {"c-brick-plain": "plain_brick"}
# Actuation writers that die 1 s after the test's reader attached: once in a quiet
# moment, once while r-flood floods the supervisor.
VICTIMS = {"c-vquiet": "die_after_attach", "c-vflood": "die_after_attach"}
# How much longer the last-word thread may take, from seeing a death to SAFE published,
# while research floods the supervisor than when it does not
SAFE_MARGIN_MS = 20.0
CPU_ATTACKS = {"r-flood": "newline_flood", "r-spam": "wake_spam",
               "r-escape": "status_escape_flood"}
# How much of a CPU, and how much event-loop lag, one research worker may cost the
# supervisor beyond what the same run cost it in the quiet window before.
CPU_MARGIN = 0.25
LAG_MARGIN_MS = 50.0


def _ch(worker: str) -> str:
    """The channel an attacker publishes on (channel names are [a-z0-9_])."""
    return "ch_" + worker.replace("-", "_")


def _toml() -> str:
    out = [textwrap.dedent("""
    [supervisor]
    status_interval_s = 0.5
    maps_scan_interval_s = 0.5
    start_parallel = 3
    [domains.control]
    failure_policy = "restart"
    [domains.research]
    """)]
    for name in (*LASTWORD, *VICTIMS):
        out.append(textwrap.dedent(f"""
        [channels.{_ch(name)}]
        slot_size = "4KiB"
        dtype = "float32"
        payload = "control_cmd"
        slot_count = 8
        max_readers = 2
        max_age_ms = 1000     # the vehicle limit for an actuation channel
        """))
    for name in (*CPU_ATTACKS, *PLAIN):
        out.append(textwrap.dedent(f"""
        [channels.{_ch(name)}]
        slot_size = "4KiB"
        dtype = "float32"
        slot_count = 4
        max_readers = 2
        """))

    def worker(name: str, domain: str, attack: str, channel: str | None, extra: str = "") -> str:
        pub = f'publishes = ["{channel}"]' if channel else ""
        args = ["--attack", attack] + (["--pub", channel] if channel else [])
        argv = "[" + ", ".join(f'"{a}"' for a in args) + "]"
        return textwrap.dedent(f"""
        [workers.{name}]
        domain = "{domain}"
        module = "{MODULE}"
        {pub}
        args = {argv}
        optional = true
        ready_timeout_ms = 60000
        memory_max = "256MiB"
        pids_max = 32
        """) + textwrap.dedent(extra or 'restart = "never"\n')

    for name, attack in LASTWORD.items():
        extra = ('restart = "on-failure"\nmax_restarts = 2\nbackoff_initial_ms = 50\n'
                 if name in ("c-brick", "c-seal") else "")
        out.append(worker(name, "control", attack, _ch(name), extra))
    for name, attack in VICTIMS.items():
        out.append(worker(name, "control", attack, _ch(name)))
    for name, attack in PLAIN.items():
        out.append(worker(name, "control", attack, _ch(name),
                          'restart = "on-failure"\nmax_restarts = 2\nbackoff_initial_ms = 50\n'))
    for name, attack in CPU_ATTACKS.items():
        out.append(worker(name, "research", attack, _ch(name),
                          'restart = "never"\ncpu_quota = 50\n'))
    out.append(worker("c-fakesys", "control", "fake_signal_exit", None))
    return "".join(out)


def _run_fleet(tmp) -> dict:
    """One embedded Supervisor with every attacker; returns what the test needs."""
    import trio

    from schemas.payloads import CONTROL_CMD
    from supervisor.config import loads
    from supervisor.events import EventLog
    from supervisor.ipc import LeaseLost, Reader, Rejected
    from supervisor.lifecycle import Supervisor

    cfg = loads(_toml(), str(tmp / "redteam3.toml"))
    logf = open(tmp / "supervisor.log", "w")
    log = EventLog(stream=logf, keep=True)
    me = os.getpid()
    seen: dict[str, list[tuple[int, int, int, dict]]] = {
        n: [] for n in (*LASTWORD, *VICTIMS, *PLAIN)}
    lag: list[tuple[int, float]] = []            # (monotonic ns, ms late) of a 5 ms sleep
    cpu: list[tuple[int, float]] = []            # (monotonic ns, process CPU s)

    def result(worker: str) -> dict | None:
        return attack_result(log.events, worker)

    async def until(pred, timeout: float) -> bool:
        with trio.move_on_after(timeout):
            while not pred():
                await trio.sleep(0.05)
            return True
        return False

    async def receive(name: str, reader: Reader) -> None:
        while True:
            try:
                m = await reader.receive_async()
            except Rejected:
                continue
            try:
                with m:
                    seen[name].append((m.publish_ts_ns, m.sequence, m.stamp.writer_pid,
                                       CONTROL_CMD.decode(np.array(m.array))))
            except LeaseLost:          # this reader too slow (the flood): the next one
                continue

    async def probe_lag() -> None:
        while True:
            t = time.monotonic_ns()
            await trio.sleep(0.005)
            now = time.monotonic_ns()
            lag.append((now, (now - t) / 1e6 - 5.0))
            if not cpu or now - cpu[-1][0] > 100_000_000:
                cpu.append((now, time.process_time()))

    async def reader_of(channel: str) -> Reader:
        h = sup.channels[channel].reader_handle(TEST_READER)
        return await trio.to_thread.run_sync(lambda: Reader(h))

    sup = Supervisor(cfg, log=log, status_out=io.StringIO())
    windows: dict[str, tuple[int, int]] = {}

    async def main() -> None:
        async with trio.open_nursery() as n:
            await n.start(sup.run)
            n.start_soon(probe_lag)
            # Phase 1: the actuation writers, together (each dies once its reader took)
            for name in (*LASTWORD, *PLAIN):
                n.start_soon(receive, name, await reader_of(_ch(name)))
            await until(lambda: all(_of(log.events, w, "exit") for w in LASTWORD)
                        and all(any('"restarted"' in e["line"]
                                    for e in _of(log.events, w, "output"))
                                for w in ("c-brick", *PLAIN)), 120)
            await trio.sleep(1.0)          # the last words
            # Phase 2: an actuation writer's death in a quiet moment
            n.start_soon(receive, "c-vquiet", await reader_of(_ch("c-vquiet")))
            await until(lambda: _of(log.events, "c-vquiet", "last_word"), 30)
            # Phases 3 and 4: each CPU attack alone, after a quiet window; during the
            # flood, the second actuation writer's death
            for name in CPU_ATTACKS:
                await trio.sleep(1.5)
                await reader_of(_ch(name))
                if name == "r-flood":
                    await trio.sleep(0.5)
                    n.start_soon(receive, "c-vflood", await reader_of(_ch("c-vflood")))
                await until(lambda: result(name) is not None
                            or _of(log.events, name, "exit"), 90)
                res = result(name)
                if res is not None and "window_ns" in res:
                    windows[name] = tuple(res["window_ns"])
            n.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        logf.close()
    return {"events": log.events, "seen": seen, "lag": lag, "cpu": cpu,
            "windows": windows, "me": me}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    return _run_fleet(tmp_path_factory.mktemp("redteam3"))


def test_every_attack_ran(fleet):
    """Not an xfail: the strict xfails below would pass on a fleet that never ran its
    attacks (a setup error is an xfail too). Each attacker left its evidence."""
    ev = fleet["events"]
    for worker in (*LASTWORD, *VICTIMS, *PLAIN, "c-fakesys"):
        res = attack_result(ev, worker)
        assert res is not None and "crashed" not in res, (worker, _of(ev, worker)[-5:])
    for worker in ("c-rollback", "c-unmagic", "c-brick", "c-skipseq", "c-seal"):
        assert fleet["seen"][worker], worker          # the test's reader took its commands
    for worker in CPU_ATTACKS:                        # measured, or refused for it
        assert worker in fleet["windows"] or _refused(fleet, worker), _of(ev, worker)[-5:]
        assert "crashed" not in (attack_result(ev, worker) or {}), attack_result(ev, worker)


def _refused(fleet, worker: str) -> list[dict]:
    return _of(fleet["events"], worker, "refused")


def _is_safe(cmd: dict) -> bool:
    # The supervisor's word: WRITER_LOST for a death (14), FAIL_SAFE if the domain failed
    # (10), SHUTDOWN after a stop (8).
    return cmd["engaged"] == 0.0 and cmd["reason"] in (8.0, 10.0, 14.0)


# ---------------------------------------------------------------- the last word


def _last_word_seen(fleet, worker: str) -> None:
    ev, seen, me = fleet["events"], fleet["seen"][worker], fleet["me"]
    poisoned = next((e for e in _of(ev, worker, "output") if '"poisoned"' in e["line"]), None)
    assert poisoned is not None, _of(ev, worker)          # the attack ran
    words = _of(ev, worker, "last_word")
    print(f"\n{worker}: {poisoned['line']}\n  last_word: {words}\n  the test's reader "
          f"took {len(seen)} messages, the last: {seen[-1:] if seen else None}")
    assert words, _of(ev, worker)                         # the supervisor says it said it
    # The reader took the supervisor's SAFE after the poisoner's last command (a
    # restarted run's commands, steer 0.125, may follow it: they must be heard too).
    ours = [i for i, s in enumerate(seen) if s[2] == me]
    assert ours and _is_safe(seen[ours[0]][3]), (
        f"the reader never took the supervisor's SAFE: {seen[-3:]}")
    assert not [s for s in seen[ours[0]:] if s[2] != me and s[3]["steer_rad"] != 0.125], (
        f"the poisoner's commands came after the SAFE: {seen[ours[0]:][:3]}")


# Was a strict xfail (BREAK), fixed: see docs/redteam3.md.
def test_last_word_is_seen_after_a_last_seq_rollback(fleet):
    _last_word_seen(fleet, "c-rollback")


# Was a strict xfail (BREAK), fixed: see docs/redteam3.md.
def test_last_word_is_seen_after_the_magic_is_zeroed(fleet):
    _last_word_seen(fleet, "c-unmagic")


def test_last_word_after_a_last_seq_near_the_bound(fleet):
    """last_seq = 2**62 - 1 is still plausible: the supervisor's SAFE lands (2**62)."""
    _last_word_seen(fleet, "c-brick")


# Was a strict xfail (BREAK), fixed: see docs/redteam3.md.
def test_a_restarted_writer_is_heard_after_a_near_bound_poison(fleet):
    """The poisoner dies; restarted (clean) runs of the writer must attach and their
    commands must reach the reader that took the poisoner's."""
    ev, seen, me = fleet["events"], fleet["seen"]["c-brick"], fleet["me"]
    runs = [attack_result([e], "c-brick") for e in _of(ev, "c-brick", "output")
            if e["line"].startswith("ATTACK ") and '"restarted"' in e["line"]]
    after = [s for s in seen if s[2] != me and s[3]["steer_rad"] == 0.125]
    print(f"\nc-brick restarted runs: {runs}\n  the reader took {len(after)} of their "
          f"commands; its last: {seen[-1:]}")
    assert runs, _of(ev, "c-brick")                  # it was restarted at all
    assert runs[0]["attach"] == "ok", runs           # the first restart could write
    assert after, "no command of a restarted writer reached the reader"


# Was a strict xfail (BREAK), fixed: see docs/redteam3.md.
def test_last_word_is_said_after_the_writer_sealed_its_segment(fleet):
    ev = fleet["events"]
    again = [e["line"] for e in _of(ev, "c-seal", "output") if "restarted" in e["line"]]
    print(f"\nc-seal: last_word_error {_of(ev, 'c-seal', 'last_word_error')[:1]}; "
          f"restarted: {again}")
    _last_word_seen(fleet, "c-seal")


# Was a strict xfail (BREAK), fixed: see docs/redteam3.md.
def test_a_last_word_not_said_is_an_error_in_the_log(fleet):
    from supervisor.events import Level, level_of

    errors = _of(fleet["events"], "c-seal", "last_word_error")   # (none once the seal is fixed)
    assert all(e["level"] == "error" for e in errors), errors
    assert level_of("last_word_error", {"worker": "c-seal"}) == Level.ERROR


# Was a strict xfail (BREAK), fixed: see docs/redteam3.md.
def test_a_restarted_writer_of_a_plain_channel_can_attach_after_a_near_bound_poison(fleet):
    ev = fleet["events"]
    runs = [attack_result([e], "c-brick-plain") for e in _of(ev, "c-brick-plain", "output")
            if e["line"].startswith("ATTACK ") and '"restarted"' in e["line"]]
    print(f"\nc-brick-plain restarted runs: {runs}")
    assert runs, _of(ev, "c-brick-plain")
    assert runs[0]["attach"] == "ok", runs


def test_no_last_word_while_a_thread_of_the_writer_still_publishes(fleet):
    """The writer's main thread exits (SYS_exit), another thread publishes engaged
    commands 1.5 s more, then the process ends. The pidfd of a thread group is readable
    only once every thread is gone: the supervisor says nothing before, SAFE after."""
    ev, seen, me = fleet["events"], fleet["seen"]["c-headless"], fleet["me"]
    res = attack_result(ev, "c-headless")
    assert res is not None and res.get("published_headless", 0) > 10, _of(ev, "c-headless")
    theirs = [s for s in seen if s[2] != me]
    ours = [s for s in seen if s[2] == me]
    print(f"\nc-headless: {res}; the reader took {len(theirs)} of the worker's, "
          f"{len(ours)} of the supervisor's; last_word {_of(ev, 'c-headless', 'last_word')}")
    assert ours and _is_safe(seen[-1][3]) and seen[-1][2] == me, seen[-3:]
    first_safe = ours[0][0]
    assert all(s[0] < first_safe for s in theirs), "the supervisor spoke while the writer could"
    seqs = [s[1] for s in seen]
    assert seqs == sorted(seqs), seqs


# Was a strict xfail (BREAK), fixed: see docs/redteam3.md.
def test_last_word_is_seen_after_a_rejected_sequence_jump(fleet):
    _last_word_seen(fleet, "c-skipseq")


# ---------------------------------------------------------------- the supervisor's CPU


def _cost(fleet, worker: str) -> tuple[float, float, float, float]:
    """(CPU/s during, CPU/s in the 1.5 s before, p99 event-loop lag during, before, ms)."""
    t0, t1 = fleet["windows"][worker]

    def cpu_share(a: int, b: int) -> float:
        pts = [(t, c) for t, c in fleet["cpu"] if a <= t <= b]
        if len(pts) < 2:
            return math.nan
        return (pts[-1][1] - pts[0][1]) / ((pts[-1][0] - pts[0][0]) / 1e9)

    def p99(a: int, b: int) -> float:
        xs = [x for t, x in fleet["lag"] if a <= t <= b]
        return float(np.percentile(xs, 99)) if xs else math.nan

    before = (t0 - 1_500_000_000, t0)
    return cpu_share(t0, t1), cpu_share(*before), p99(t0, t1), p99(*before)


def _assert_bounded(fleet, worker: str) -> None:
    ev = fleet["events"]
    refused = _refused(fleet, worker)
    if refused:                    # the supervisor ended it: the claim holds that way
        print(f"\n{worker}: refused: {refused[0].get('reason')}")
        return
    res = attack_result(ev, worker)
    assert res is not None and worker in fleet["windows"], _of(ev, worker)[-5:]
    during, before, lag, lag0 = _cost(fleet, worker)
    print(f"\n{worker}: {res}\n  supervisor CPU {during:.2f}/s during, {before:.2f}/s "
          f"before; event-loop lag p99 {lag:.1f} ms during, {lag0:.1f} ms before")
    assert during <= before + CPU_MARGIN, (during, before)
    assert lag <= lag0 + LAG_MARGIN_MS, (lag, lag0)


# Was a strict xfail (BREAK), fixed: see docs/redteam3.md.
def test_an_output_newline_flood_costs_the_supervisor_little(fleet):
    _assert_bounded(fleet, "r-flood")


def test_wake_up_spam_on_the_monitors_socket_costs_the_supervisor_little(fleet):
    _assert_bounded(fleet, "r-spam")


def _death_to_safe_ms(fleet, worker: str) -> float:
    res = attack_result(fleet["events"], worker)
    assert res is not None and "died_ns" in res, _of(fleet["events"], worker)
    safe = [s for s in fleet["seen"][worker] if s[2] == fleet["me"] and _is_safe(s[3])]
    assert safe, fleet["seen"][worker][-3:]
    return (safe[0][0] - res["died_ns"]) / 1e6


def test_death_to_safe_is_not_delayed_by_a_research_flood(fleet):
    """An actuation writer dies while a research worker floods the supervisor's output
    pipe: the last-word thread is the supervisor's, and it needs the GIL that the event
    loop holds while it splits lines (each of the thread's system calls gives the GIL
    up and waits up to the 5 ms switch interval to get it back). Judged on the thread's
    own share (`last_word` waited_ms: from seeing the death to SAFE published): death ->
    SAFE end to end is printed, not judged, since on this loaded machine the dying
    worker's own teardown swung it from 11 to 115 ms in either phase."""
    ev = fleet["events"]
    quiet, flood = _death_to_safe_ms(fleet, "c-vquiet"), _death_to_safe_ms(fleet, "c-vflood")
    t0, t1 = fleet["windows"].get("r-flood", (0, 0))
    died = attack_result(ev, "c-vflood")["died_ns"]
    wq = [e["waited_ms"] for e in _of(ev, "c-vquiet", "last_word")]
    wf = [e["waited_ms"] for e in _of(ev, "c-vflood", "last_word")]
    print(f"\ndeath -> SAFE: {quiet:.1f} ms quiet, {flood:.1f} ms during the flood "
          f"(died {(died - t0) / 1e6:.0f} ms into a {(t1 - t0) / 1e6:.0f} ms flood); "
          f"the last-word thread's share (waited_ms): {wq} quiet, {wf} during the flood")
    if _refused(fleet, "r-flood"):
        return                     # no flood to be delayed by
    assert t0 < died < t1, "the writer did not die during the flood"
    assert wq and wf, (wq, wf)
    assert wf[0] <= wq[0] + SAFE_MARGIN_MS, (wf, wq)


# Was a strict xfail (BREAK), fixed: see docs/redteam3.md.
def test_a_status_line_of_control_characters_costs_the_supervisor_little(fleet):
    """Per line, in CPU time (not wall time: the machine's load changes how much of a
    CPU the supervisor gets, not what a line costs it): an honest status line costs it
    tens of microseconds; a bound of 100 us per line leaves room for a loaded cache."""
    ev = fleet["events"]
    if _refused(fleet, "r-escape"):
        return
    res = attack_result(ev, "r-escape")
    assert res is not None and "r-escape" in fleet["windows"], _of(ev, "r-escape")[-5:]
    during, before, lag, lag0 = _cost(fleet, "r-escape")
    t0, t1 = fleet["windows"]["r-escape"]
    extra_s = max(during - before, 0.0) * (t1 - t0) / 1e9
    per_line_us = extra_s / max(res["lines"], 1) * 1e6
    print(f"\nr-escape: {res}\n  supervisor CPU {during:.2f}/s during, {before:.2f}/s "
          f"before: {per_line_us:.0f} us of supervisor CPU per line ({extra_s:.2f} s for "
          f"the worker's {res['own_cpu_s']:.3f} s); lag p99 {lag:.1f} ms ({lag0:.1f} before)")
    assert per_line_us <= 100.0, per_line_us


# ---------------------------------------------------------------- the log's word


# Was a strict xfail (BREAK), fixed: see docs/redteam3.md.
def test_a_worker_cannot_forge_a_kill_in_the_log(fleet):
    """Nobody killed c-fakesys: no cgroup limit, no watchdog, no refusal."""
    ev = fleet["events"]
    res = attack_result(ev, "c-fakesys")
    ex = _of(ev, "c-fakesys", "exit")
    print(f"\nc-fakesys: {res}; exit: {ex}")
    assert res is not None and ex, _of(ev, "c-fakesys")
    assert ex[0]["signal"] != "SIGKILL" and "SIGKILL" not in (ex[0].get("cause") or ""), ex[0]


# ---------------------------------------------------------------- hostile drive logs


# A log's video description and index are text and records the log chose (a developer's
# laptop, a fleet, a compromised car's recorder): name -> (the .video JSON, frame bytes)
HOSTILE_VIDEOS = {
    "frame-shorter-than-described": ({"codec": "raw", "width": 64, "height": 64}, 100),
    "width-a-string": ({"codec": "raw", "width": "64", "height": 64}, 6144),
    "negative-width": ({"codec": "raw", "width": -64, "height": 64}, 100),
}


def _hostile_video_log(d, info: dict, size: int):
    """A closed log (start, stop) of no messages whose one video channel has one frame
    of ``size`` bytes, well indexed (magic, CRC), described by ``info``."""
    import json as _json

    from supervisor.replay.logfmt import MESSAGES, Entry, _vix, frame_record

    start = Entry.new_message(monoNs=1)
    s = start.init("start")
    s.version, s.writer, s.channels, s.info = 1, "recorder", ["road"], "{}"
    stop = Entry.new_message(monoNs=3)
    stop.stop = "{}"
    d.mkdir()
    (d / MESSAGES).write_bytes(b"".join(frame_record(e.to_bytes()) for e in (start, stop)))
    (d / "road.video").write_text(_json.dumps(info))
    (d / "road.nv12").write_bytes(b"\x80" * size)
    (d / "road.vidx").write_bytes(_vix(1, 10, 0, size, 1))
    return d


# Was a strict xfail (BREAK), fixed in replay/logfmt.py: see docs/redteam3.md.
@pytest.mark.parametrize("case", sorted(HOSTILE_VIDEOS))
def test_supervisor_log_frames_answers_a_hostile_video_in_one_line(tmp_path, case, capsys):
    from supervisor.cli import main

    info, size = HOSTILE_VIDEOS[case]
    log = _hostile_video_log(tmp_path / "log", info, size)
    try:
        rc = main(["log", "frames", str(log), "--out", str(tmp_path / "png")])
    except Exception as e:          # what `supervisor log frames` prints as a traceback
        pytest.fail(f"traceback: {type(e).__name__}: {e}")
    err = capsys.readouterr().err
    assert rc in (0, 2) and len(err.strip().splitlines()) <= 1, (rc, err)
