"""Isolation under abuse: does one worker's fork storm or memory hog stall the others?

    python bench/isolation.py [--seconds 12] [--scenarios baseline,research,control] [--json F]

Runs the real supervisor in this process (as tests/test_e2e.py does), every worker in
its bubblewrap sandbox with its cgroup, on a control pipeline of probe workers:

    cam (20 Hz) --frames--> relay (20 Hz) --cmd--> sink        all control, watchdog 200 ms

This process attaches as one more reader of `frames` and `cmd` (the spare reader index,
max_readers = readers + 1) and records every message's publish timestamp, so a stall
of a publisher shows as a gap between consecutive publish times, whatever this process
is doing. Per scenario, one after the other in the same run:

  baseline  no abuser
  research  two research-domain abusers: fork_storm (pids_max 32), then memory_hog
            (memory_max 256MiB) while the storm's children still hold their pids
  control   memory_hog in the control domain (optional, memory_max 256MiB)

Abusers: workers.probe --attack NAME, restart = "never", optional = true, cpu_quota 50.
A harmless research `gate` probe (in every scenario) becomes READY after
--abuse-after-ms and the abusers start after it, so the pipeline runs steadily first;
each abuser attacks right after its READY. `--repeat`: restart = "on-failure" with a
200 ms backoff, so the hog is OOM-killed and restarted until the end of the run.
The "abuse window" runs from the first abuser's READY to 1 s after the last one
finished (its last `exit` event, or its `ATTACK` output line while it lives on).

Reported: delivered messages/s, publish-to-publish gap p50/p99/max (whole run and
inside the abuse window), sequence numbers this reader missed, watchdog misses / exits /
restarts of control workers, how each abuser ended (the `exit` event's signal and
cause, the fork storm's ATTACK line), the CPU other processes used meanwhile, and
ratios against the baseline of the same run.

Note on the probe's rate: it publishes once per loop and sleeps min(ping, period) per
loop, so `--period-ms 50 --ping-ms 20` publishes at 50 Hz. A 20 Hz source is
`--period-ms 50 --ping-ms 50` (pinging every 50 ms against a 200 ms watchdog).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from supervisor.config import loads  # noqa: E402
from supervisor.events import EventLog  # noqa: E402
from supervisor.ipc import Reader  # noqa: E402
from supervisor.lifecycle import Supervisor  # noqa: E402

CONTROL_WORKERS = ("cam", "relay", "sink")
STREAMS = ("frames", "cmd")

PIPELINE = """
[domains.control]
failure_policy = "fail_safe"
actuates = true
[domains.research]

[channels.frames]
slot_size = "4KiB"
slot_count = 16
max_readers = 2
[channels.cmd]
slot_size = "4KiB"
slot_count = 16
max_readers = 2

[workers.cam]
domain = "control"
module = "workers.probe"
publishes = ["frames"]
args = ["--publish", "frames", "--period-ms", "{period}", "--ping-ms", "{period}"]
watchdog_ms = {watchdog}
[workers.relay]
domain = "control"
module = "workers.probe"
subscribes = ["frames"]
publishes = ["cmd"]
args = ["--read", "frames", "--publish", "cmd", "--period-ms", "{period}", "--ping-ms", "{period}"]
watchdog_ms = {watchdog}
[workers.sink]
domain = "control"
module = "workers.probe"
subscribes = ["cmd"]
args = ["--read", "cmd", "--ping-ms", "20"]
watchdog_ms = {watchdog}
"""

# Every scenario (baseline too): a harmless research probe that becomes READY after
# --abuse-after-ms. Workers start in declaration order, each after the previous READY, so
# the abusers start only then and the pipeline runs steadily first.
GATE = """
[workers.gate]
domain = "research"
module = "workers.probe"
args = ["--ready-delay-ms", "{delay}"]
restart = "never"
optional = true
ready_timeout_ms = {timeout}
"""

ABUSER = """
[workers.{name}]
domain = "{domain}"
module = "workers.probe"
args = [{args}]
restart = "{restart}"
backoff_initial_ms = 200
backoff_max_ms = 200
max_restarts = 1000
optional = true
memory_max = "{memory_max}"
pids_max = {pids_max}
cpu_quota = {cpu_quota}
ready_timeout_ms = 15000
"""

# scenario -> [(worker name, domain, attack)], started in this order
SCENARIOS: dict[str, list[tuple[str, str, str]]] = {
    "baseline": [],
    "research": [("r_storm", "research", "fork_storm"), ("r_hog", "research", "memory_hog")],
    "control": [("c_hog", "control", "memory_hog")],
}
TITLES = {
    "baseline": "(a) baseline, no abuser",
    "research": "(b) research: fork_storm + memory_hog",
    "control": "(c) control: memory_hog",
}


def config_text(scenario: str, a: argparse.Namespace) -> str:
    text = PIPELINE.format(period=a.period_ms, watchdog=a.watchdog_ms)
    text += GATE.format(delay=a.abuse_after_ms, timeout=a.abuse_after_ms + 10000)
    for name, domain, attack in SCENARIOS[scenario]:
        args = ["--attack", attack]
        text += ABUSER.format(name=name, domain=domain, args=", ".join(json.dumps(x) for x in args),
                              restart="on-failure" if a.repeat else "never",
                              memory_max=a.memory_max, pids_max=a.pids_max, cpu_quota=a.cpu_quota)
    return text


def _cpu_busy_s() -> float:
    """Machine-wide non-idle CPU seconds (user nice system irq softirq steal)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def pct(xs, q: float) -> float:
    return float(np.percentile(np.asarray(xs, float), q)) if len(xs) else float("nan")


def stream_stats(samples: list[tuple[int, int, int]], t0: int, t1: int,
                 window: tuple[int, int] | None) -> dict:
    """samples: (sequence, publish_ns, receive_ns) in arrival order."""
    pub = np.array([p for _, p, _ in samples], np.int64)
    seq = np.array([s for s, _, _ in samples], np.int64)
    lag = np.array([(r - p) / 1e6 for _, p, r in samples])
    gaps = np.diff(pub) / 1e6 if len(pub) > 1 else np.array([])
    out = {
        "messages": len(samples),
        "rate_hz": len(samples) / ((t1 - t0) / 1e9),
        "rate_span_hz": (len(pub) - 1) / ((pub[-1] - pub[0]) / 1e9) if len(pub) > 1 else 0.0,
        "gap_p50_ms": pct(gaps, 50), "gap_p99_ms": pct(gaps, 99),
        "gap_max_ms": float(gaps.max()) if len(gaps) else float("nan"),
        "seq_missing": int((np.diff(seq) - 1).clip(0).sum()) if len(seq) > 1 else 0,
        "publish_to_bench_p50_ms": pct(lag, 50), "publish_to_bench_p99_ms": pct(lag, 99),
    }
    if window is not None and len(pub) > 1:
        # gaps that end inside the window (a stall that starts in it ends in it or after)
        w0, w1 = window
        ends = pub[1:]
        sel = gaps[(ends >= w0) & (pub[:-1] <= w1)]
        out["window_gaps"] = int(len(sel))
        out["window_gap_max_ms"] = float(sel.max()) if len(sel) else float("nan")
        out["window_gap_p99_ms"] = pct(sel, 99)
    return out


def run_scenario(scenario: str, a: argparse.Namespace) -> dict:
    cfg = loads(config_text(scenario, a), f"bench/isolation.py:{scenario}")
    log = EventLog(stream=io.StringIO())
    samples: dict[str, list[tuple[int, int, int]]] = {s: [] for s in STREAMS}
    marks: dict[str, int] = {}
    busy0, own0, wall0 = _cpu_busy_s(), _own_cpu_s(), time.monotonic()
    load0 = os.getloadavg()[0]

    def ready(name: str) -> bool:
        return any(e["event"] == "ready" and e.get("worker") == name for e in log.events)

    async def main():
        sup = Supervisor(cfg, log=log, status_out=None)
        async with trio.open_nursery() as nursery:
            # Not nursery.start: that returns only once every worker (abusers too) is
            # ready; attach as soon as the control pipeline is.
            nursery.start_soon(sup.run)
            with trio.fail_after(60):
                while not all(ready(w) for w in CONTROL_WORKERS):
                    if any(e["event"] in ("supervisor_exit", "fail_safe") for e in log.events):
                        raise RuntimeError("supervisor stopped before the pipeline was ready: "
                                           + json.dumps(log.events[-3:], default=str))
                    await trio.sleep(0.01)
            readers = {s: Reader(sup.channels[s].reader_handle(len(cfg.readers_of(s))))
                       for s in STREAMS}

            async def follow(r: Reader, sink: list) -> None:
                while True:
                    with await r.receive_async() as m:
                        sink.append((m.sequence, m.publish_ts_ns, time.monotonic_ns()))

            marks["t0"] = time.monotonic_ns()
            for s in STREAMS:
                nursery.start_soon(follow, readers[s], samples[s])
            await trio.sleep(a.seconds)
            marks["t1"] = time.monotonic_ns()
            marks["dropped"] = {s: readers[s].stats.dropped for s in STREAMS}
            marks["rejected"] = {s: sum(readers[s].stats.rejected.values()) for s in STREAMS}
            nursery.cancel_scope.cancel()
        for r in readers.values():
            r.close()
        return int(sup.exit_code)

    exit_code = trio.run(main)
    wall = time.monotonic() - wall0
    other = (_cpu_busy_s() - busy0) - (_own_cpu_s() - own0)
    t0, t1 = marks["t0"], marks["t1"]
    ev = log.events

    # Abusers: start, end (exit event or ATTACK line), outcome.
    abusers = {}
    for name, domain, attack in SCENARIOS[scenario]:
        st = [e for e in ev if e.get("worker") == name and e["event"] == "start"]
        rd = [e for e in ev if e.get("worker") == name and e["event"] == "ready"]
        ex = [e for e in ev if e.get("worker") == name and e["event"] == "exit"]
        att = []
        for e in ev:
            if e.get("worker") == name and e["event"] == "output" and \
                    str(e.get("line", "")).startswith("ATTACK "):
                try:
                    att.append((e["mono_ns"], json.loads(e["line"][7:])))
                except ValueError:
                    att.append((e["mono_ns"], {"raw": e["line"]}))
        refused = [e for e in ev if e.get("worker") == name and e["event"] == "refused"]
        end = ex[-1]["mono_ns"] if ex else (att[0][0] if att else None)
        if ex:
            x = ex[0]
            ended = (f"exit code {x['code']}" + (f", {x['signal']}" if x.get("signal") else "")
                     + (f": {x['cause']}" if x.get("cause") else "")
                     + (f", {(x['mono_ns'] - rd[0]['mono_ns']) / 1e9:.2f} s after READY"
                        if rd else f", {x['uptime_ms'] / 1000:.2f} s after start"))
            if len(ex) > 1:
                oom = sum(1 for e in ex if str(e.get("cause") or "").startswith("out of memory"))
                ended = f"{len(ex)} runs ended, {oom} of them out of memory; first: " + ended
        else:
            ended = "still running at the end (stopped at shutdown)"
        if att:
            ended += "; ATTACK " + json.dumps(att[0][1], separators=(",", ":"))
        if refused:
            ended += "; refused: " + str(refused[0].get("reason"))[:120]
        abusers[name] = {
            "domain": domain, "attack": attack,
            "start_s": (st[0]["mono_ns"] - t0) / 1e9 if st else None,
            "ready_s": (rd[0]["mono_ns"] - t0) / 1e9 if rd else None,
            "end_s": (end - t0) / 1e9 if end else None,
            "exits": [{k: e.get(k) for k in ("code", "signal", "cause", "reason", "uptime_ms")}
                      for e in ex],
            "runs": len(st),
            "attack_result": att[0][1] if att else None,
            "ended": ended,
        }
    window = None
    if abusers:
        # The attack starts right after READY (the sandbox start before it is not abuse).
        starts = [t0 + v["ready_s"] * 1e9 for v in abusers.values() if v["ready_s"] is not None]
        ends = [t0 + v["end_s"] * 1e9 for v in abusers.values() if v["end_s"] is not None]
        if starts:
            window = (int(min(starts)), min(int(max(ends or [t1])) + 1_000_000_000, t1))

    ctl = {}
    for w in CONTROL_WORKERS:
        ctl[w] = {k: sum(1 for e in ev if e.get("worker") == w and e["event"] == k)
                  for k in ("watchdog_missed", "exit", "restart", "refused")}
    return {
        "scenario": scenario,
        "title": TITLES[scenario],
        "seconds": (t1 - t0) / 1e9,
        "streams": {s: {**stream_stats(samples[s], t0, t1, window),
                        "reader_dropped": marks["dropped"][s],
                        "reader_rejected": marks["rejected"][s]} for s in STREAMS},
        "abuse_window_s": ([(window[0] - t0) / 1e9, (window[1] - t0) / 1e9] if window else None),
        "control_workers": ctl,
        "control_watchdog_missed": sum(c["watchdog_missed"] for c in ctl.values()),
        "control_restarts": sum(c["restart"] for c in ctl.values()),
        "control_exits": sum(c["exit"] for c in ctl.values()),
        "fail_safe": any(e["event"] == "fail_safe" for e in ev),
        "abusers": abusers,
        "supervisor_exit_code": exit_code,
        "wall_s": wall,
        "other_cpu_pct": 100 * other / (wall * (os.cpu_count() or 1)),
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg()[0],
        "limits_not_enforced": [e.get("reason") for e in ev if e["event"] == "limits_not_enforced"],
        "events": ev if a.keep_events else None,
    }


def f(x: float, nd: int = 1) -> str:
    return "n/a" if x is None or x != x else f"{x:.{nd}f}"


def ratio(x: float, b: float) -> str:
    return "n/a" if not b or x != x or b != b else f"{x / b:.2f}x"


def markdown(results: list[dict], a: argparse.Namespace) -> str:
    L = []
    L.append(f"Control pipeline cam -> relay -> sink at {1000 / a.period_ms:g} Hz, watchdog "
             f"{a.watchdog_ms} ms; {a.seconds:g} s per scenario; abusers: memory_max "
             f"{a.memory_max}, pids_max {a.pids_max}, cpu_quota {a.cpu_quota:g} %, restart "
             f"{'on-failure (--repeat)' if a.repeat else 'never'}.")
    L.append("msgs/s = (msgs - 1) / (last publish - first publish). "
             "Gaps are publish-to-publish of consecutive messages this process received; "
             "`window` = from the first abuser's READY (its attack starts then) to 1 s after the "
             "last one finished; `bench lag` = publish -> this process holding the message "
             "(this process also runs the supervisor).")
    L.append("")
    L.append("| scenario | stream | msgs | msgs/s | gap p50 ms | gap p99 ms | gap max ms "
             "| window max gap ms | missing seq | bench lag p99 ms |")
    L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        for s in STREAMS:
            x = r["streams"][s]
            L.append(f"| {r['title']} | {s} | {x['messages']} | {f(x['rate_span_hz'], 2)} | "
                     f"{f(x['gap_p50_ms'])} | "
                     f"{f(x['gap_p99_ms'])} | {f(x['gap_max_ms'])} | "
                     f"{f(x.get('window_gap_max_ms'))} | {x['seq_missing']} | "
                     f"{f(x['publish_to_bench_p99_ms'], 2)} |")
    L.append("")
    base = next((r for r in results if r["scenario"] == "baseline"), None)
    if base and len(results) > 1:
        L.append("Ratios against the baseline of this run (`frames`; `cmd` in brackets):")
        L.append("")
        L.append("| scenario | msgs/s | gap p50 | gap p99 | gap max "
                 "| window max gap / baseline max |")
        L.append("|---|---:|---:|---:|---:|---:|")
        for r in results:
            if r is base:
                continue
            cells = []
            for key, bkey in (("rate_span_hz", "rate_span_hz"), ("gap_p50_ms", "gap_p50_ms"),
                              ("gap_p99_ms", "gap_p99_ms"), ("gap_max_ms", "gap_max_ms"),
                              ("window_gap_max_ms", "gap_max_ms")):
                v = [ratio(r["streams"][s].get(key, float("nan")), base["streams"][s][bkey])
                     for s in STREAMS]
                cells.append(f"{v[0]} ({v[1]})")
            L.append(f"| {r['title']} | " + " | ".join(cells) + " |")
        L.append("")
    L.append("`other CPU %`: machine-wide busy CPU minus this process and its reaped children, "
             "as a share of all CPUs over the scenario (an upper bound: CPU of sandbox processes "
             "killed before their parent reaped them is counted as other).")
    L.append("")
    L.append("| scenario | control watchdog misses | control exits / restarts | fail-safe "
             "| abuse window s | other CPU % | supervisor exit |")
    L.append("|---|---:|---:|---|---|---:|---:|")
    for r in results:
        w = r["abuse_window_s"]
        L.append(f"| {r['title']} | {r['control_watchdog_missed']} | "
                 f"{r['control_exits']} / {r['control_restarts']} | "
                 f"{'YES' if r['fail_safe'] else 'no'} | "
                 f"{f'{w[0]:.1f}-{w[1]:.1f}' if w else '-'} | {f(r['other_cpu_pct'])} | "
                 f"{r['supervisor_exit_code']} |")
    L.append("")
    L.append("| scenario | abuser | domain | attack | start / READY at s | how it ended |")
    L.append("|---|---|---|---|---:|---|")
    for r in results:
        for name, x in r["abusers"].items():
            L.append(f"| {r['title']} | {name} | {x['domain']} | {x['attack']} | "
                     f"{f(x['start_s'], 2)} / {f(x['ready_s'], 2)} | {x['ended']} |")
    nl = [r["limits_not_enforced"] for r in results if r["limits_not_enforced"]]
    if nl:
        L.append("")
        L.append(f"WARNING: cgroup limits not enforced: {nl[0]}")
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=12.0, help="measured time per scenario")
    ap.add_argument("--scenarios", default="baseline,research,control",
                    help=f"comma-separated, from {','.join(SCENARIOS)}")
    ap.add_argument("--period-ms", type=int, default=50, help="cam and relay loop (50 = 20 Hz)")
    ap.add_argument("--watchdog-ms", type=int, default=200)
    ap.add_argument("--abuse-after-ms", type=int, default=2000,
                    help="READY delay of the gate worker; the abusers start after it")
    ap.add_argument("--repeat", action="store_true",
                    help='abusers restart = "on-failure" (200 ms backoff): the memory hog is '
                         'OOM-killed and restarted for the rest of the run')
    ap.add_argument("--memory-max", default="256MiB")
    ap.add_argument("--pids-max", type=int, default=32)
    ap.add_argument("--cpu-quota", type=float, default=50)
    ap.add_argument("--json", metavar="FILE", help="also write all results as JSON ('-' = stdout)")
    ap.add_argument("--keep-events", action="store_true", help="include every event in --json")
    a = ap.parse_args()
    names = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    bad = [s for s in names if s not in SCENARIOS]
    if bad:
        ap.error(f"unknown scenario(s) {bad}; known: {list(SCENARIOS)}")
    # A private state directory: a fail-safe latch written here (there should be none) never
    # blocks the machine's real supervisor, and a latch of the real one never blocks this.
    state = tempfile.mkdtemp(prefix="isolation-bench-")
    os.environ["TRIO_STATE_DIR"] = state
    results = []
    t_all = time.monotonic()
    try:
        for s in names:
            print(f"# {TITLES[s]} ...", file=sys.stderr, flush=True)
            results.append(run_scenario(s, a))
    finally:
        shutil.rmtree(state, ignore_errors=True)
    md = markdown(results, a)
    print(md)
    print(f"\ntotal {time.monotonic() - t_all:.1f} s; {os.cpu_count()} CPUs; "
          f"load average now {os.getloadavg()[0]:.2f}; Python {platform.python_version()}")
    if a.json:
        doc = {"args": vars(a), "results": results, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "kernel": platform.release()}}
        text = json.dumps(doc, indent=1, default=str)
        if a.json == "-":
            print(text)
        else:
            Path(a.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
