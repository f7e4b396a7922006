"""Reliability of the real pipeline, short version of `bench/stress.py`: kill -9 of each
worker in turn under the restart policy, then a stalled reader paced against no stall.

One sandboxed pipeline (camerad -> modeld -> controlsd, failure_policy = "restart",
restart = "always"), this process reading every channel and checking every message.
The long run (10,000+ frames, soak) is `python bench/stress.py`; its docstring says
what each figure means."""
from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sandbox
if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)

_spec = importlib.util.spec_from_file_location(
    "bench_stress", Path(__file__).resolve().parents[1] / "bench" / "stress.py")
stress = importlib.util.module_from_spec(_spec)
sys.modules["bench_stress"] = stress          # dataclasses look their module up
_spec.loader.exec_module(stress)

WORKERS = stress.WORKERS


@pytest.fixture(scope="module")
def result():
    opts = stress.Options(
        frames=10**9, max_kills=3, victims=("camerad", "modeld", "controlsd"),
        kill_every=(0.3, 0.8), fps=20.0, seed=1,
        stall_s=8.0, stall_phase_s=1.0,         # 4 unstalled + 4 stalled, alternating
        verify=120, recover_timeout_s=30.0, progress=False)
    return stress.run(opts)


def _why(res: dict, *keys: str) -> str:
    return "; ".join(f"{k}={res.get(k)!r}"[:1500] for k in keys)


def test_every_kill_is_one_sigkill_exit_and_a_restart(result):
    res = result
    assert res["recover_failures"] == 0, _why(res, "kills", "accounting_problems")
    assert res["kills_total"] == 3 and all(res["kills"].get(w) for w in WORKERS), res["kills"]
    assert res["accounting_problems"] == [], res["accounting_problems"]
    for w, a in res["restart_accounting"].items():
        assert a["kills"] == a["exits"] == a["exits_sigkill"] == a["restarts"], (w, a)
        assert a["duplicate_exits"] == 0, (w, a)
    # each killed worker produced output again (what the pipeline waited for)
    for w in WORKERS:
        assert res["kill_to_first_output"][w]["n"] == res["kills"][w], res["kill_to_first_output"]


def test_no_torn_read_accepted(result):
    res = result
    assert res["torn_reads_accepted"] == 0, _why(res, "torn_by_check", "torn_examples")
    ref = res["reference"]
    assert ref["verified"] >= 100 and ref["mismatches"] == 0, ref
    assert res["model_outputs_seen"] > 100 and res["commands_seen"] > 300, res


def test_never_engaged_while_the_model_was_down(result):
    res = result
    # the windows held commands, every one of them disengaged
    assert res["commands_checked_while_model_down"] > 0, res
    assert res["engaged_while_model_down"] == 0, res["engaged_while_model_down_examples"]
    assert res["engaged_without_fresh_model_seen"] == 0, res


def test_no_slot_or_lease_leaked_and_the_writer_never_waited(result):
    res = result
    assert res["slots_leaked"] == 0 and res["leases_leaked"] == 0, res["lease_tables"]
    assert res["fresh_reader_received"] == {"road_frames": 5, "model_out": 5,
                                            "control_cmd": 5}, res["fresh_reader_received"]
    # The held messages were reclaimed by the writer (their lease ran out), not waited for.
    held = res["stall"]["held_messages"]
    assert held.get("road_frames:lease_lost", 0) >= 3, held
    assert not any(k.endswith("still_valid") for k in held), held
    # No camera stall outside its own restarts that a blocked writer would show: the
    # loose bound is for a shared machine (a blocked writer stops for good).
    w = res["writer"]
    assert w["max_gap_ms"] is None or w["max_gap_ms"] < 1000, w


def test_stalled_reader_leaves_control_latency_within_3x(result):
    """A reader holding its leases cannot slow the writer (a blocked writer would be
    unbounded); p99 over ~40 samples on a shared 2-core CI machine is noisy (0.8-1.2x
    seen here quiet, 3.3x beside another suite's fleets: 9.2 -> 30.7 ms, command gaps
    1.06x), so the bound is loose: 3x, or within the car's 50 ms command max_age. It
    catches a writer that waits (seconds), not jitter."""
    st = result["stall"]
    assert st["unstalled"]["n"] >= 40 and st["stalled"]["n"] >= 40, st
    assert (st["p99_ratio_stalled_unstalled"] <= 3.0
            or st["stalled"]["e2e_p99_ms"] <= 50.0), st
