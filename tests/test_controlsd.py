"""controlsd: the control law on its own (pure, clock injected), then the worker as a
real process between two real channels, going safe when the model goes away."""
from __future__ import annotations

import math
import signal
import time

import numpy as np
import pytest

from supervisor.ipc import Channel, ChannelSpec, NextLoan, Reader, Receipt, Writer
from workers.controlsd import model_output_of
from workers.controlsd.law import (Command, ControlLaw, DriverState, LawConfig,
                                   ModelOutput, SafeReason)



MS = 1_000_000
CFG = LawConfig(k_p=0.1, k_h=1.0, max_steer=0.2, max_rate=0.5, timeout_ms=100,
                max_age_ms=120, min_confidence=0.5, engage_count=3)


def out(offset=0.0, heading=0.0, conf=0.9, ts=0, **kw) -> ModelOutput:
    return ModelOutput(offset, heading, conf, ts, **kw)


def run(law: ControlLaw, t0: int, n: int, dt_ms: int = 20, make=None) -> list[Command]:
    """n steps every dt_ms from t0; make(t) -> ModelOutput | None each step."""
    cmds = []
    for i in range(n):
        t = t0 + i * dt_ms * MS
        cmds.append(law.step(make(t) if make else None, t))
    return cmds


# ---------------------------------------------------------------- the law


def test_starts_safe_and_engages_after_engage_count_outputs():
    law = ControlLaw(CFG)
    c = law.step(None, 0)
    assert (c.engaged, c.reason, c.steer_rad, c.model_age_ms) == (False, SafeReason.NO_INPUT,
                                                                  0.0, -1.0)
    cmds = run(law, 20 * MS, 4, make=lambda t: out(0.5, ts=t - 10 * MS))
    assert [c.reason for c in cmds] == [SafeReason.RECOVERING, SafeReason.RECOVERING,
                                        SafeReason.OK, SafeReason.OK]
    assert [c.engaged for c in cmds] == [False, False, True, True]
    assert cmds[0].steer_rad == 0.0 and cmds[3].model_age_ms == pytest.approx(10.0)


@pytest.mark.parametrize("offset,heading,sign", [(0.5, 0.0, -1), (-0.5, 0.0, 1),
                                                 (0.0, 0.03, -1), (0.0, -0.03, 1)])
def test_steers_against_offset_and_heading(offset, heading, sign):
    law = ControlLaw(CFG)
    cmds = run(law, 0, 60, make=lambda t: out(offset, heading, ts=t))
    want = -(CFG.k_p * offset + CFG.k_h * heading)
    assert np.sign(cmds[-1].steer_rad) == sign
    assert cmds[-1].steer_rad == pytest.approx(want)        # settled on the target
    assert cmds[-1].engaged and cmds[-1].reason == SafeReason.OK


def test_clamps_and_rate_limits():
    law = ControlLaw(CFG)
    cmds = run(law, 0, 80, make=lambda t: out(-10.0, ts=t))   # wants +1.0 rad
    steer = [c.steer_rad for c in cmds]
    assert max(steer) == pytest.approx(CFG.max_steer) and max(steer) <= CFG.max_steer
    assert all(c.target_rad <= CFG.max_steer for c in cmds)
    steps = np.diff(steer)
    assert steps.max() <= CFG.max_rate * 0.020 + 1e-12       # 0.5 rad/s at 20 ms steps
    assert steps.max() == pytest.approx(CFG.max_rate * 0.020)
    # a stalled caller cannot make it jump: dt is capped at max_dt_s
    law2 = ControlLaw(CFG)
    before = run(law2, 0, 3, make=lambda t: out(-10.0, ts=t))[-1].steer_rad
    c = law2.step(out(-10.0, ts=5000 * MS), 5000 * MS)
    assert c.steer_rad - before == pytest.approx(CFG.max_rate * CFG.max_dt_s)


def test_timeout_goes_safe_ramps_to_zero_and_recovers():
    law = ControlLaw(CFG)
    cmds = run(law, 0, 40, make=lambda t: out(-1.0, ts=t))   # engaged, steer 0.1
    assert cmds[-1].engaged and cmds[-1].steer_rad == pytest.approx(0.1)
    t = 40 * 20 * MS
    silent = run(law, t, 30)                                 # no new output
    # still OK within timeout_ms of the last output, then TIMEOUT
    reasons = [c.reason for c in silent]
    first_safe = reasons.index(SafeReason.TIMEOUT)
    assert all(r == SafeReason.OK for r in reasons[:first_safe])
    assert (first_safe + 1) * 20 > CFG.timeout_ms >= first_safe * 20 - 20
    safe = silent[first_safe:]
    assert all(not c.engaged and c.reason == SafeReason.TIMEOUT for c in safe)
    steer = [c.steer_rad for c in safe]
    assert steer[-1] == 0.0 and all(np.diff(steer) <= 0)     # ramps down to 0, no jump
    assert min(np.diff(steer)) >= -CFG.max_rate * 0.020 - 1e-12
    # recovery: engage_count fresh outputs
    t2 = t + 30 * 20 * MS
    back = run(law, t2, 4, make=lambda t: out(-1.0, ts=t))
    assert [c.engaged for c in back] == [False, False, True, True]
    assert back[0].reason == SafeReason.RECOVERING


def test_stale_low_confidence_invalid_and_unverified_outputs_go_safe():
    for bad, reason in [(lambda t: out(0.3, ts=t - 200 * MS), SafeReason.STALE),
                        (lambda t: out(0.3, conf=0.2, ts=t), SafeReason.LOW_CONFIDENCE),
                        (lambda t: out(math.nan, ts=t), SafeReason.INVALID),
                        (lambda t: ModelOutput.from_array(np.zeros(2, np.float32), t),
                         SafeReason.INVALID),
                        (lambda t: out(0.3, ts=t, host_visible=False),
                         SafeReason.NOT_HOST_VISIBLE)]:
        law = ControlLaw(CFG)
        good = run(law, 0, 30, make=lambda t: out(0.3, ts=t))
        assert good[-1].engaged
        cmds = run(law, 30 * 20 * MS, 20, make=bad)
        assert all(not c.engaged and c.reason == reason for c in cmds), reason
        assert cmds[-1].steer_rad == 0.0 and cmds[0].steer_rad < 0   # ramped, no jump
        # one good output among bad ones is not enough; engage_count in a row is
        law.step(out(0.3, ts=50 * 20 * MS), 50 * 20 * MS)
        c = law.step(bad(51 * 20 * MS), 51 * 20 * MS)
        assert not c.engaged
        back = run(law, 52 * 20 * MS, 3, make=lambda t: out(0.3, ts=t))
        assert back[-1].engaged and back[-1].reason == SafeReason.OK


def test_future_stamped_output_goes_safe_with_reason_future_and_recovers():
    hour = 3600 * 1000 * MS
    law = ControlLaw(CFG)
    good = run(law, 0, 30, make=lambda t: out(0.3, ts=t))
    assert good[-1].engaged and good[-1].steer_rad < 0
    t = 30 * 20 * MS
    # A negative age is not freshness: safe at once, ramping, with its own reason.
    cmds = run(law, t, 10, make=lambda t: out(0.3, ts=t + hour))
    assert all(not c.engaged and c.reason == SafeReason.FUTURE for c in cmds)
    assert cmds[0].steer_rad > good[-1].steer_rad and cmds[-1].steer_rad == 0.0
    assert cmds[-1].model_age_ms == pytest.approx(-hour / MS)
    # One output the bridge refused as a future timestamp does the same.
    law2 = ControlLaw(CFG)
    run(law2, 0, 30, make=lambda t: out(0.3, ts=t))
    c = law2.step(ModelOutput.refused_by(SafeReason.FUTURE, t + hour), t)
    assert (c.engaged, c.reason, c.model_age_ms) == (False, SafeReason.FUTURE, -hour / MS)
    assert law2.step(None, t + 20 * MS).reason == SafeReason.FUTURE   # until a new output
    assert law2.step(None, t + 200 * MS).reason == SafeReason.TIMEOUT
    for lw in (law, law2):
        # Back only through the re-engage hysteresis: engage_count good ones in a row.
        t2 = t + 1000 * MS
        back = run(lw, t2, 4, make=lambda t: out(0.3, ts=t))
        assert [c.reason for c in back] == [SafeReason.RECOVERING, SafeReason.RECOVERING,
                                            SafeReason.OK, SafeReason.OK]
        assert [c.engaged for c in back] == [False, False, True, True]
    # Within the tolerance (same clock, a few ms): not a lie, engaged.
    assert CFG.future_tolerance_ms == 5.0
    law3 = ControlLaw(CFG)
    near = run(law3, 0, 4, make=lambda t: out(0.3, ts=t + 4 * MS))
    assert near[-1].engaged and near[-1].reason == SafeReason.OK
    with pytest.raises(ValueError):
        ModelOutput.refused_by(SafeReason.OK, 0)


def test_low_pass_slows_the_target_and_hold_forces_safe():
    fast = run(ControlLaw(CFG), 0, 10, make=lambda t: out(-1.0, ts=t))
    slow_law = ControlLaw(LawConfig(**{**CFG.__dict__, "tau_s": 0.2}))
    slow = run(slow_law, 0, 10, make=lambda t: out(-1.0, ts=t))
    assert 0 < slow[-1].steer_rad < fast[-1].steer_rad
    c = slow_law.step(out(-1.0, ts=200 * MS), 200 * MS, hold=SafeReason.SHUTDOWN)
    assert (c.engaged, c.reason) == (False, SafeReason.SHUTDOWN)


def test_command_array_round_trip():
    c = Command(-0.125, True, SafeReason.OK, 12.5)
    a = c.to_array()
    assert a.dtype == np.float32 and a.shape == (4,)
    assert a.tolist() == [-0.125, 1.0, 0.0, 12.5]
    back = Command.from_array(a)
    assert (back.steer_rad, back.engaged, back.reason, back.model_age_ms) == \
        (-0.125, True, SafeReason.OK, 12.5)
    assert Command.from_array(Command(0.0, False, SafeReason.TIMEOUT, 300.0).to_array()
                              ).reason == SafeReason.TIMEOUT


def test_a_replay_on_the_drives_clock_gives_the_cars_commands():
    """The car's law steps at 20 ms ticks and on each output (arriving 3-9 ms after its
    frame's capture), skips one output (a newer one came first), and the log begins
    mid-drive, engaged and ramping. `DriveClock` with a fresh law, fed the outputs in
    order, gives the car's first command for each frame bit for bit; the skipped one
    gets a command of its own without moving the car's steps."""
    from workers.controlsd.logclock import DriveClock

    cfg = LawConfig(k_p=0.3, k_h=1.0, max_steer=0.3, max_rate=0.2, engage_count=3)
    car = ControlLaw(cfg)
    outs = {f: out(0.4 * math.sin(f / 3), 0.02 * (f % 5), ts=f * 50 * MS, frame_id=f)
            for f in range(40)}
    arrive = {f: f * 50 * MS + (3 + f % 7) * MS for f in outs if f != 17}
    events = sorted([(t, f) for f, t in arrive.items()]
                    + [(k * 20 * MS + 1, None) for k in range(100)])
    log = []                            # (t, frame id, command payload) as recorded
    for t, f in events:             # (17 came with 18: the car took 18 only)
        c = car.step(outs[f] if f is not None else None, t)
        if c.frame_id is not None:
            log.append((t, c.frame_id, tuple(c.to_array().astype(float).tolist())))
    # The recorder attached just after the car acted on output 12 (mid-drive, ramping).
    start = next(k for k, (_, f, _) in enumerate(log) if f == 12) + 1
    first_seen = {}
    for t, f, v in log[start:]:
        first_seen.setdefault(f, v)
    clock, law = DriveClock(log[start:]), ControlLaw(cfg)
    got = {}
    for f in range(12, 40):
        cmd, _, on_drive = clock.step(law, outs[f]._replace(ts_ns=0), f * 50 * MS)
        assert on_drive == (f != 17), f
        got[f] = tuple(cmd.to_array().astype(float).tolist())
    assert first_seen[20][1] == 1.0 and 0 < abs(first_seen[13][0]) < cfg.max_steer
    for f in range(12, 40):
        if f != 17:
            # Engagement, reason and age exactly; the steer from the float32 the car
            # published (its law keeps float64): equal up to float32's last bit while
            # the ramp the log began in lasts, exactly once the target is reached.
            assert got[f][1:] == first_seen[f][1:], f
            assert got[f][0] == pytest.approx(first_seen[f][0], abs=1e-7), f
    assert got[39] == first_seen[39]
    # Another gain: the same clock gives other commands (what --ref self then shows).
    clock, law = DriveClock(log[start:]), ControlLaw(LawConfig(k_p=0.6, k_h=1.0, max_steer=0.3,
                                                               max_rate=0.2, engage_count=3))
    other = [clock.step(law, outs[f], f * 50 * MS)[0].steer_rad for f in range(12, 40)]
    assert sum(o != got[f][0] for o, f in zip(other, range(12, 40))) > 10


def test_resume_takes_the_state_and_needs_a_new_output():
    law = ControlLaw(CFG)
    law.resume(0.05, True, 3, 1000 * MS)
    assert law.last_ns == 1000 * MS
    c = law.step(out(0.0, 0.0, ts=1010 * MS), 1010 * MS)   # target 0: ramps down from 0.05
    assert c.engaged and c.reason == SafeReason.OK
    assert c.steer_rad == pytest.approx(0.05 - CFG.max_rate * 0.010)
    law = ControlLaw(CFG)
    law.resume(0.0, False, 2, 1000 * MS)                     # two good outputs so far
    assert law.step(out(ts=1010 * MS), 1010 * MS).engaged    # the third engages
    law = ControlLaw(CFG)
    law.resume(0.1, True, 3, 1000 * MS)
    assert law.step(None, 1010 * MS).reason == SafeReason.NO_INPUT   # nothing carried over


# ---------------------------------------------------------------- the driver monitor


DCFG = LawConfig(k_p=0.1, k_h=1.0, max_steer=0.2, max_rate=0.5, timeout_ms=100,
                 max_age_ms=120, engage_count=3, watch_driver=True, driver_max_age_ms=300,
                 min_face_prob=0.5, min_driver_confidence=0.5, min_eyes_on_road=0.5,
                 driver_grace_ms=1000)


def drive(law: ControlLaw, t0_ms: int, ms: int, face=0.9, eyes=0.9, conf=0.9,
          driver=True) -> list[Command]:
    """Model outputs every 50 ms and (if ``driver``) driver states every 50 ms, steps
    every 10 ms, for ``ms`` from ``t0_ms``."""
    cmds = []
    for t_ms in range(t0_ms, t0_ms + ms, 10):
        t = t_ms * MS
        mo = out(0.5, 0.0, ts=t - 5 * MS) if t_ms % 50 == 0 else None
        ds = (DriverState(face, eyes, conf, t - 5 * MS)
              if driver and t_ms % 50 == 20 else None)
        cmds.append(law.step(mo, t, driver=ds))
    return cmds


def test_without_a_driver_monitor_the_law_is_unchanged():
    plain, given = ControlLaw(CFG), ControlLaw(CFG)
    bad = DriverState(0.0, 0.0, 0.0, 0)             # no driver at all, and old
    for i in range(60):
        t = i * 20 * MS
        mo = out(0.3, 0.01, ts=t) if i % 3 == 0 else None
        assert plain.step(mo, t) == given.step(mo, t, driver=bad)
    assert plain.engaged


def test_driver_monitor_stale_absent_distracted_and_back():
    law = ControlLaw(DCFG)
    cmds = drive(law, 0, 500, driver=False)           # no driver state: never engages
    assert all(c.reason == SafeReason.DRIVER_STALE and not c.engaged for c in cmds[5:])
    cmds = drive(law, 500, 500)                        # a driver, watching the road
    assert cmds[-1].engaged and cmds[-1].reason == SafeReason.OK
    cmds = drive(law, 1000, 900, face=0.1)             # no face, within the grace
    assert all(c.engaged for c in cmds)
    cmds = drive(law, 1900, 400, face=0.1)             # ... past it
    assert cmds[-1].reason == SafeReason.DRIVER_ABSENT and not cmds[-1].engaged
    first = next(i for i, c in enumerate(cmds) if not c.engaged)
    assert 1900 + 10 * first - 1020 >= 1000            # not before the grace ran out
    steer = [c.steer_rad for c in cmds[first:]]
    assert all(np.diff(np.abs(steer)) <= 0) and steer[-1] == 0.0   # ramps to 0
    cmds = drive(law, 2300, 400)                       # back: RECOVERING, then engaged
    assert cmds[0].reason in (SafeReason.DRIVER_ABSENT, SafeReason.RECOVERING)
    assert any(c.reason == SafeReason.RECOVERING for c in cmds)
    assert cmds[-1].engaged
    cmds = drive(law, 2700, 500, eyes=0.1)             # a glance away: tolerated
    assert all(c.engaged for c in cmds)
    cmds = drive(law, 3200, 900, eyes=0.1)             # a long look away: not
    assert cmds[-1].reason == SafeReason.DRIVER_DISTRACTED and not cmds[-1].engaged
    cmds = drive(law, 4100, 300)
    assert cmds[-1].engaged
    cmds = drive(law, 4400, 400, driver=False)         # the monitor stops
    assert cmds[-1].reason == SafeReason.DRIVER_STALE and not cmds[-1].engaged
    stale_at = 4400 + 10 * next(i for i, c in enumerate(cmds) if not c.engaged)
    assert stale_at - (4370 - 5) > DCFG.driver_max_age_ms   # newest state captured 4365


@pytest.mark.parametrize("face,eyes,conf,why", [
    (0.9, 0.9, 0.1, SafeReason.DRIVER_ABSENT),          # the monitor cannot tell
    (math.nan, 0.9, 0.9, SafeReason.DRIVER_ABSENT),     # NaN is never a driver
    (0.9, math.nan, 0.9, SafeReason.DRIVER_DISTRACTED),
])
def test_an_unsure_or_broken_driver_state_is_never_an_attentive_driver(face, eyes, conf, why):
    law = ControlLaw(DCFG)
    drive(law, 0, 500)
    cmds = drive(law, 500, 1500, face=face, eyes=eyes, conf=conf)
    assert cmds[-1].reason == why and not cmds[-1].engaged


def test_model_checks_come_before_the_driver():
    law = ControlLaw(DCFG)
    drive(law, 0, 500)
    cmds = [law.step(None, (500 + k * 10) * MS) for k in range(40)]  # model and driver gone
    assert cmds[-1].reason == SafeReason.TIMEOUT


def test_after_a_suspend_nothing_captured_before_it_steers():
    """CLOCK_MONOTONIC stops in a suspend: an output from just before one looks as young
    after the resume. The law, told the clock stopped, judges every output and driver
    state captured before the resume STALE, and engages again only on engage_count
    captured after it."""
    for cfg, make in [(CFG, lambda t: out(0.3, ts=t - 5 * MS)), (DCFG, None)]:
        law = ControlLaw(cfg)
        cmds = run(law, 0, 30, make=make) if make else drive(law, 0, 500)
        assert cmds[-1].engaged
        t = 600 * MS                     # the resume, 0 ms of monotonic time later
        law.clock_stopped(t)
        before = out(0.3, ts=t - 5 * MS)     # young by the stopped clock, seconds old
        c = law.step(before, t, driver=DriverState(0.9, 0.9, 0.9, t - 5 * MS))
        assert not c.engaged and c.reason == SafeReason.STALE, c
        assert law.judge(before, t, t + 1 * MS) == SafeReason.STALE
        after = run(law, t + 20 * MS, 4, make=lambda u: out(0.3, ts=u - 1 * MS)) if make \
            else drive(law, 620, 300)
        assert after[-1].engaged and after[-1].reason == SafeReason.OK
        if not make:
            # a driver state from before the resume is no driver state
            law.clock_stopped(1000 * MS)
            law.see_driver(DriverState(0.9, 0.9, 0.9, 995 * MS))
            assert law.judge_driver(1000 * MS) == SafeReason.DRIVER_STALE


def test_the_suspend_watch_sees_a_suspend_and_nothing_else():
    """BOOTTIME - MONOTONIC grows only in a suspend: the watch reports one past its
    threshold, not a preemption between the reads, not the first look."""
    from workers.controlsd.suspend import READ_NS, THRESHOLD_NS, SuspendWatch

    w = SuspendWatch()
    assert not w.check(1000, 5000, 1010)                       # first look: no verdict
    assert not w.check(2000, 6000 + THRESHOLD_NS // 2, 2010)  # under the threshold
    assert w.check(3000, 7000 + 2 * THRESHOLD_NS, 3010) and w.suspends == 1
    assert not w.check(4000, 8000 + 2 * THRESHOLD_NS, 4010)   # the new offset holds
    # preempted between the reads: the stamps are too far apart to judge
    assert not w.check(5000, 9000 + 9 * THRESHOLD_NS, 5000 + READ_NS + 1)
    assert w.suspends == 1


def test_the_suspend_watch_never_fires_on_a_running_machine():
    """The real clocks, looked at as controlsd does, with the process descheduled by a
    CPU hog beside it: never a suspend (a false one would disengage the car)."""
    import multiprocessing as mp

    from workers.controlsd.suspend import SuspendWatch

    hogs = [mp.get_context("fork").Process(target=_spin, args=(1.5,)) for _ in range(2)]
    for h in hogs:
        h.start()
    try:
        w = SuspendWatch()
        end = time.monotonic() + 1.5
        looks = 0
        while time.monotonic() < end:
            w.look()
            looks += 1
            if looks % 1000 == 0:
                time.sleep(0.001)
    finally:
        for h in hogs:
            h.join()
    assert looks > 10_000 and w.suspends == 0


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_model_output_of_a_real_message(make_channel):
    ch = make_channel(name="model_out", dtype="float32", slot_size=4096, crc=True)
    with Writer(ch.writer_handle()) as w, Reader(ch.reader_handle(0)) as r:
        w.publish_array(np.array([0.25, -0.01, 0.8, 0.0], np.float32))
        with r.receive(timeout=2) as msg:
            mo = model_output_of(msg)
            receipt = getattr(msg, "receipt", None)
        assert (mo.offset_m, mo.heading_rad, mo.confidence) == pytest.approx((0.25, -0.01, 0.8))
        assert mo.host_visible
        if receipt is None:                       # no receipt: age from the publish time
            assert mo.ts_ns == msg.stamp.publish_ts_ns


# ---------------------------------------------------------------- the worker


def _tensor_channel(name: str) -> Channel:
    return Channel.create(ChannelSpec(name=name, dtype="float32", slot_size=4096,
                                      slot_count=8, max_readers=2, crc=True))


def test_controlsd_process_follows_model_and_fails_safe(workers):  # noqa: F811
    model = _tensor_channel("model_out")
    cmd = _tensor_channel("control_cmd")
    Writer(cmd.writer_handle(), seal=False).close()   # so our reader starts at seq 0
    with model, cmd, Writer(model.writer_handle()) as mw, Reader(cmd.reader_handle(1)) as cr:
        proc = workers("workers.controlsd",
                       ["--timeout-ms", "120", "--max-age-ms", "150", "--hz", "50",
                        "--k-p", "0.1", "--max-rate", "1.0", "--status-s", "0.2"],
                       reads={"model": model}, writes={"command": cmd})
        seen: list[Command] = []

        def phase(seconds: float, values=None, ts_back_ms: float = 0.0) -> list[Command]:
            start = len(seen)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                if values is not None:
                    now = time.monotonic_ns()
                    mw.publish_array(np.array(values, np.float32),
                                     publish_ts_ns=now - int(ts_back_ms * MS))
                time.sleep(0.02)
                while (m := cr.try_receive()) is not None:
                    with m:
                        seen.append(Command.from_array(m.array))
            return seen[start:]

        t0 = time.monotonic()
        while not any(ln.startswith("READY=1") for ln in proc.lines):
            assert time.monotonic() - t0 < 15 and proc.proc.poll() is None
            time.sleep(0.01)
        idle = phase(0.2)
        assert idle and all(not c.engaged and c.reason == SafeReason.NO_INPUT for c in idle)

        right = phase(0.6, [0.5, 0.0, 0.9, 0.0])           # car right of centre
        assert right[-1].engaged and right[-1].reason == SafeReason.OK
        assert right[-1].steer_rad == pytest.approx(-0.05, abs=1e-6)
        assert 0 <= right[-1].model_age_ms < 100

        gone = phase(0.5)                                   # the model stops
        assert gone[-1].reason == SafeReason.TIMEOUT and not gone[-1].engaged
        assert gone[-1].steer_rad == 0.0 and gone[-1].model_age_ms > 120

        left = phase(0.5, [-0.5, 0.0, 0.9, 0.0])           # back, car left of centre
        assert left[-1].engaged and left[-1].steer_rad == pytest.approx(0.05, abs=1e-6)

        unsure = phase(0.3, [-0.5, 0.0, 0.1, 0.0])
        assert unsure[-1].reason == SafeReason.LOW_CONFIDENCE and not unsure[-1].engaged

        old = phase(0.3, [-0.5, 0.0, 0.9, 0.0], ts_back_ms=300)
        assert old[-1].reason == SafeReason.STALE and not old[-1].engaged
        assert old[-1].model_age_ms >= 300

        # whatever happened, the steer stayed within the clamp
        assert all(abs(c.steer_rad) <= 0.3 + 1e-6 for c in seen)

        proc.proc.send_signal(signal.SIGTERM)
        rc, out, err = proc.wait()
        assert rc == 0, err
        while (m := cr.try_receive()) is not None:
            with m:
                seen.append(Command.from_array(m.array))
        assert seen[-1].reason == SafeReason.SHUTDOWN and not seen[-1].engaged
        statuses = proc.statuses()
        assert any("reason=OK" in s and "engaged=1" in s for s in statuses)
        assert any("reason=TIMEOUT" in s for s in statuses)
        assert "SHUTDOWN" in statuses[-1]


def test_controlsd_process_watches_a_bound_driver_state(workers):  # noqa: F811
    """A driver_state channel bound as role ``driver``: controlsd engages only with a
    fresh attentive driver, and goes DRIVER_STALE when the monitor stops (the model
    still publishing)."""
    from schemas.payloads import DRIVER_STATE

    model, drv = _tensor_channel("model_out"), _tensor_channel("driver_state")
    cmd = _tensor_channel("control_cmd")
    Writer(cmd.writer_handle(), seal=False).close()
    with model, drv, cmd, Writer(model.writer_handle()) as mw, \
            Writer(drv.writer_handle()) as dw, Reader(cmd.reader_handle(1)) as cr:
        proc = workers("workers.controlsd",
                       ["--hz", "50", "--timeout-ms", "300", "--max-age-ms", "300",
                        "--driver-max-age-ms", "250", "--engage-count", "2"],
                       reads={"model": model, "driver": drv}, writes={"command": cmd})
        seen: list[Command] = []

        def phase(seconds: float, driver: bool) -> list[Command]:
            start, end = len(seen), time.monotonic() + seconds
            while time.monotonic() < end:
                mw.publish_array(np.array([0.5, 0.0, 0.9, 0.0], np.float32))
                if driver:
                    dw.publish_array(DRIVER_STATE.encode(face_prob=0.95, eyes_on_road_prob=0.9,
                                                         confidence=0.9))
                time.sleep(0.03)
                while (m := cr.try_receive()) is not None:
                    with m:
                        seen.append(Command.from_array(m.array))
            return seen[start:]

        t0 = time.monotonic()
        while not any(ln.startswith("READY=1") for ln in proc.lines):
            assert time.monotonic() - t0 < 15 and proc.proc.poll() is None
            time.sleep(0.01)
        assert any("driver driver_state" in ln for ln in proc.lines if ln.startswith("READY=1"))
        early = phase(0.4, driver=False)               # a model, but no driver monitor
        assert early and not any(c.engaged for c in early)
        assert early[-1].reason == SafeReason.DRIVER_STALE
        watched = phase(0.8, driver=True)
        assert watched[-1].engaged and watched[-1].reason == SafeReason.OK
        gone = phase(1.0, driver=False)                # the monitor stops
        assert gone[-1].reason == SafeReason.DRIVER_STALE and not gone[-1].engaged


def test_controlsd_process_refuses_future_stamped_outputs(workers):  # noqa: F811
    """A modeld that lies about time (receipt capture, then publish time an hour ahead):
    the bridge rejects and counts each such output, controlsd goes safe with reason
    FUTURE at once and re-engages only after --engage-count good outputs."""
    hour = 3600 * 1000 * MS
    model = _tensor_channel("model_out")
    cmd = _tensor_channel("control_cmd")
    Writer(cmd.writer_handle(), seal=False).close()   # so our reader starts at seq 0
    with model, cmd, Writer(model.writer_handle()) as mw, Reader(cmd.reader_handle(1)) as cr:
        proc = workers("workers.controlsd",
                       ["--timeout-ms", "120", "--max-age-ms", "150", "--hz", "50",
                        "--k-p", "0.1", "--max-rate", "1.0", "--status-s", "0.2",
                        "--engage-count", "3"],
                       reads={"model": model}, writes={"command": cmd})
        seen: list[Command] = []
        fid = 0

        def phase(seconds: float, lie: str | None = None) -> list[Command]:
            nonlocal fid
            start = len(seen)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                now = time.monotonic_ns()
                fid += 1
                capture = now - 5 * MS + (hour if lie == "receipt" else 0)
                receipt = Receipt(frame_id=fid, capture_ts_ns=capture,
                                  infer_start_ns=now - 4 * MS, infer_end_ns=now - MS,
                                  device="CPU", bytes_in=64, bytes_out=16)
                with mw.loan() as loan:
                    loan.array((4,), np.float32)[:] = [0.5, 0.0, 0.9, 0.0]
                    loan.publish(receipt=receipt,
                                 publish_ts_ns=now + hour if lie == "publish" else None)
                time.sleep(0.02)
                while (m := cr.try_receive()) is not None:
                    with m:
                        seen.append(Command.from_array(m.array))
            return seen[start:]

        t0 = time.monotonic()
        while not any(ln.startswith("READY=1") for ln in proc.lines):
            assert time.monotonic() - t0 < 15 and proc.proc.poll() is None
            time.sleep(0.01)
        good = phase(0.5)
        assert good[-1].engaged and good[-1].reason == SafeReason.OK
        assert good[-1].steer_rad == pytest.approx(-0.05, abs=1e-6)

        for lie in ("receipt", "publish"):
            bad = phase(0.3, lie)
            # Safe from the first command after the first lie, and never engaged again.
            first = next(i for i, c in enumerate(bad) if c.reason == SafeReason.FUTURE)
            assert first <= 2, (lie, bad[:4])
            assert all(not c.engaged and c.reason == SafeReason.FUTURE
                       for c in bad[first:]), lie
            assert bad[-1].model_age_ms < -3_000_000          # the claimed time, shown
            back = phase(0.4)
            while back and back[0].reason == SafeReason.FUTURE:
                back.pop(0)         # commands for lies still in flight when we switched
            reasons = [c.reason for c in back]
            # Re-engaged only through the hysteresis: RECOVERING first, then OK.
            assert reasons[0] == SafeReason.RECOVERING, (lie, reasons[:4])
            first_ok = reasons.index(SafeReason.OK)
            assert all(r == SafeReason.RECOVERING for r in reasons[:first_ok])
            assert all(not c.engaged for c in back[:first_ok])
            assert back[-1].engaged and back[-1].reason == SafeReason.OK

        time.sleep(0.3)                                       # one more status line
        proc.proc.send_signal(signal.SIGTERM)
        rc, _, err = proc.wait()
        assert rc == 0, err
        statuses = proc.statuses()
        assert any("reason=FUTURE" in s for s in statuses), statuses
        last = [s for s in statuses if " future=" in s][-1]
        counted = int(last.split(" future=")[1].split()[0])
        rejected = int(last.split(" future:")[1].split()[0].rstrip(","))
        assert counted >= 20 and rejected == counted, last


def test_receipt_completion_point_is_recognised():
    from workers.controlsd import _completion_queued

    assert not _completion_queued(None)
    assert not _completion_queued("hostVisible") and not _completion_queued(1)
    assert _completion_queued("deviceQueued") and _completion_queued(2)
    assert _completion_queued("CompletionPoint.DEVICE_QUEUED")


@pytest.mark.parametrize("values", [(0.25, -0.01, 0.8, 0.0), (math.nan, 1.0, 0.9, 0.0),
                                    (math.inf, -math.inf, 1e-45, 3.4e38), (0.1, 0.2)])
def test_model_output_of_reads_what_from_array_reads(make_channel, values):
    """The float32[n] path (msg.tolist) gives the very output the numpy path gives."""
    ch = make_channel(name="model_out", dtype="float32", slot_size=4096, crc=True)
    with Writer(ch.writer_handle()) as w, Reader(ch.reader_handle(0)) as r:
        rc = Receipt(frame_id=9, capture_ts_ns=time.monotonic_ns() - 1000, infer_start_ns=1,
                     infer_end_ns=2, device="CPU", bytes_in=1, bytes_out=16,
                     completion="deviceQueued", latency_ns=77)
        with w.loan() as loan:
            loan.array((len(values),), np.float32)[:] = values
            loan.publish(receipt=rc)
        with r.receive(timeout=2) as msg:
            got = model_output_of(msg)
            want = ModelOutput.from_array(msg.array, rc.capture_ts_ns, frame_id=9,
                                          latency_ns=77, host_visible=False)
    assert repr(got) == repr(want)          # NaN != NaN: compare the reprs


def test_publish_writes_what_encode_writes(make_channel):
    from schemas.payloads import CONTROL_CMD
    from workers.controlsd import _publish

    ch = make_channel(name="control_cmd", dtype="float32", slot_size=4096, crc=True)
    with Writer(ch.writer_handle()) as w, Reader(ch.reader_handle(0)) as r:
        out = NextLoan(w, CONTROL_CMD.shape, np.float32)
        for cmd in (Command(-0.125, True, SafeReason.OK, 12.5),
                    Command(0.1, False, SafeReason.FUTURE, 1.8e13),
                    Command(0.0, False, SafeReason.NO_INPUT, -1.0, frame_id=None)):
            cmd = cmd if cmd.reason == SafeReason.NO_INPUT else cmd._replace(frame_id=77)
            now = time.monotonic_ns()
            _publish(out, cmd, now)
            with r.receive(timeout=2) as msg:
                got = msg.array.tobytes()
                stamp = msg.stamp
            want = CONTROL_CMD.encode(steer_rad=cmd.steer_rad, engaged=float(cmd.engaged),
                                      reason=float(cmd.reason), model_age_ms=cmd.model_age_ms)
            assert got == want.tobytes()
            # The header names the frame the command came from and when the law stepped
            # (what a replay pairs and steps by); nothing before the first output.
            if cmd.frame_id is None:
                assert stamp.frame_id is None
            else:
                assert (stamp.frame_id, stamp.capture_ts_ns) == (77, now)


def test_the_rehearsal_changes_neither_the_law_nor_what_is_published(make_channel):
    """controlsd's rehearsal (run at the start of each busy-poll window on the output
    taken last) steps a copy of the law and fills the loaned command slot without
    publishing it: the law's state, the commands published and their bytes are what
    they are without it."""
    from schemas.payloads import CONTROL_CMD
    from workers.controlsd import _publish, rehearsal

    mo_ch = make_channel(name="model_out", dtype="float32", slot_size=4096, crc=True)
    cmd_ch = make_channel(name="control_cmd", dtype="float32", slot_size=4096, crc=True)
    with Writer(mo_ch.writer_handle()) as mw, Reader(mo_ch.reader_handle(0)) as mr, \
            Writer(cmd_ch.writer_handle()) as cw, Reader(cmd_ch.reader_handle(0)) as cr:
        law, twin = ControlLaw(LawConfig(engage_count=1)), ControlLaw(LawConfig(engage_count=1))
        out = NextLoan(cw, CONTROL_CMD.shape, np.float32)
        rehearse = rehearsal(law, out)
        for i, offset in enumerate((0.5, -0.3, 0.2)):
            mw.publish_array(np.array([offset, 0.01, 0.9, 0.0], np.float32))
            with mr.receive(timeout=2) as msg:
                before = dict(vars(law))
                rehearse(msg)                     # as the reader calls it
                rehearse(msg)
                assert vars(law) == before        # the law itself did not move
                assert cr.try_receive() is None   # nothing was published
                got = model_output_of(msg)
            now = time.monotonic_ns() + i * 20_000_000
            cmd, want = law.step(got, now), twin.step(got, now)
            assert cmd == want and cmd.engaged
            _publish(out, cmd)
            with cr.receive(timeout=2) as m:
                assert m.array.tobytes() == CONTROL_CMD.encode(
                    steer_rad=cmd.steer_rad, engaged=1.0, reason=float(cmd.reason),
                    model_age_ms=cmd.model_age_ms).tobytes()
