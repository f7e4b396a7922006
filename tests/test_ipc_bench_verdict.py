"""bench/ipcbench/report.py target_verdict: issue 26's block at the end of
``ipc_latency.py``. Pure arithmetic on synthetic rows (no processes): a clear lead is
called met and clear, two draws of one distribution are called within noise, and a
burst inside one pass widens the p99 interval (blocks, not single samples, are drawn)."""
from __future__ import annotations

import os
import sys

import numpy as np

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
from ipcbench.children import stats_us  # noqa: E402
from ipcbench.report import TARGET_SIZES, block_bootstrap, target_verdict  # noqa: E402

SIZES = [("64 B", TARGET_SIZES[0]), ("64 KiB", TARGET_SIZES[1]),
         ("NV12 1928x1208", TARGET_SIZES[2])]


def _rows(scale: dict[str, float], rates: dict[str, list[float]], seed: int,
          period_s: float = 5e-4) -> list[dict]:
    """Latency and throughput rows as aggregate() leaves them: 4 passes of 1000 samples
    (ns, lognormal around 40 us times ``scale``), per-pass rates."""
    rng = np.random.default_rng(seed)
    rows = []
    for key, s in scale.items():
        for label, n in SIZES:
            raws = [(rng.lognormal(np.log(40_000), 0.35, 1000) * s).astype(np.int64)
                    for _ in range(4)]
            rows.append({"transport": key, "nbytes": n, "size": label, "mode": "latency",
                         "latency": stats_us(np.concatenate(raws)), "_raws": raws,
                         "params": {"period_s": period_s}})
            per = rates[key]
            rows.append({"transport": key, "nbytes": n, "size": label,
                         "mode": "throughput", "msgs_per_s": float(np.median(per)),
                         "msgs_per_s_per_repeat": per})
    return rows


def test_a_clear_lead_is_met_and_clear(capsys):
    rows = _rows({"bridge": 0.8, "iox2": 1.0},
                 {"bridge": [110.0, 112, 108, 111], "iox2": [100.0, 99, 101, 100]}, 1)
    v = target_verdict(rows, SIZES, resamples=300)
    assert v["met"] and v["clear"]
    for label, _ in SIZES:
        lo, hi = v[label]["p99"]["ci"]
        assert lo <= v[label]["p99"]["ratio"] <= hi < 1.0
    assert "target in this run: MET" in capsys.readouterr().out


def test_one_distribution_twice_is_within_noise(capsys):
    rows = _rows({"bridge": 1.0, "iox2": 1.0},
                 {"bridge": [100.0, 103, 97, 101], "iox2": [101.0, 98, 102, 100]}, 2)
    v = target_verdict(rows, SIZES, resamples=300)
    assert not v["clear"]
    assert all(v[label]["p99"]["ci"][0] < 1.0 < v[label]["p99"]["ci"][1]
               for label, _ in SIZES)
    assert "does not decide it" in capsys.readouterr().out


def test_a_behind_throughput_is_not_met():
    rows = _rows({"bridge": 0.8, "iox2": 1.0},
                 {"bridge": [90.0, 91, 89, 90], "iox2": [100.0, 99, 101, 100]}, 3)
    v = target_verdict(rows, SIZES, resamples=300)
    assert not v["met"] and v["clear"]       # clearly behind is decided too


def test_a_burst_widens_the_interval_more_in_blocks_than_alone():
    rng = np.random.default_rng(4)
    raws = [rng.normal(40_000, 2000, 2000) for _ in range(2)]
    raws[0][700:760] += 400_000          # one burst of foreign load: 60 slow messages
    wide = block_bootstrap(raws, 99, np.random.default_rng(5))
    alone = block_bootstrap(raws, 99, np.random.default_rng(5), block=1)
    spread = lambda x: np.subtract(*np.percentile(x, [95, 5]))  # noqa: E731
    assert spread(wide) > 1.5 * spread(alone)


def test_paired_blocks_keep_a_shared_burst_together():
    """A burst both transports met (same positions) moves both p99s together: the
    paired interval of the ratio stays narrow; drawn apart (matrix style) it widens."""
    from ipcbench.report import paired_bootstrap
    rng = np.random.default_rng(6)
    a = rng.normal(40_000, 1500, 4000)
    b = rng.normal(44_000, 1500, 4000)
    for lo in (500, 2100, 3300):         # three bursts, 40 messages each, on both
        a[lo:lo + 40] += 300_000
        b[lo:lo + 40] += 300_000
    together = paired_bootstrap(a, b, 99, np.random.default_rng(7))
    apart = (block_bootstrap([a], 99, np.random.default_rng(7))
             / block_bootstrap([b], 99, np.random.default_rng(8)))
    spread = lambda x: np.subtract(*np.percentile(x, [95, 5]))  # noqa: E731
    assert spread(together) < spread(apart)


def test_p99s_at_the_pacing_period_decide_nothing(capsys):
    """Loaded, both p99s sit at the pacing period (the reader ran at the sender's next
    wake-up): the verdict says so and does not call the run clear."""
    rows = _rows({"bridge": 0.8, "iox2": 1.0},
                 {"bridge": [110.0, 112, 108, 111], "iox2": [100.0, 99, 101, 100]}, 1,
                 period_s=60e-6)
    v = target_verdict(rows, SIZES, resamples=300)
    assert v["64 B"]["p99_at_period"] and not v["clear"]
    assert "pacing period" in capsys.readouterr().out


def test_paired_bursts_decide_throughput():
    """With paired bursts the throughput ratio is their median rates' and its interval
    comes from resampled rounds: a steady 20 % lead is met and clear, an alternating
    lead and lag is within noise."""
    from ipcbench.report import burst_rate
    rows = _rows({"bridge": 0.8, "iox2": 1.0},
                 {"bridge": [90.0, 91, 89, 90], "iox2": [100.0, 99, 101, 100]}, 9)
    rng = np.random.default_rng(10)
    fast = {lab: {"bridge": [(1999, int(1e7 / 1.2 * (1 + 0.02 * rng.random())))
                             for _ in range(16)],
                  "iox2": [(1999, int(1e7 * (1 + 0.02 * rng.random()))) for _ in range(16)]}
            for lab, _ in SIZES}
    v = target_verdict(rows, SIZES, paired={"throughput": fast}, resamples=300)
    t = v["64 B"]["throughput"]
    assert t["source"] == "paired" and 1.15 < t["ratio"] < 1.25 and t["ci"][0] > 1.0
    assert v["met"] and v["clear"]          # the matrix's 0.9x rates are not used
    assert burst_rate(fast["64 B"]["bridge"]) > burst_rate(fast["64 B"]["iox2"])
    mixed = {lab: {"bridge": [(1999, int(1e7 * (0.7 if i % 2 else 1.3))) for i in range(16)],
                   "iox2": [(1999, int(1e7)) for _ in range(16)]} for lab, _ in SIZES}
    v = target_verdict(rows, SIZES, paired={"throughput": mixed}, resamples=300)
    assert not v["clear"]
