#!/usr/bin/env python3
"""One-way latency and throughput of process-to-process tensor transports.

Compares, in one run and on the same machine, the trio-bridge (``supervisor.ipc``)
with three peers:

* ``pipe``      multiprocessing.Pipe, numpy array pickled by ``Connection.send``
* ``zmq``       pyzmq PUSH/PULL over ipc:// in /tmp, ``send(arr, copy=True)``,
                receiver ``np.frombuffer``
* ``iox2``      iceoryx2 publish-subscribe, loaned ``Slice[c_uint8]`` samples
                (zero-copy), receiver blocks on an iceoryx2 event Listener
* ``iox2-poll`` the same, receiver busy-polls ``Subscriber.receive()`` (burns a core)
* ``bridge-py`` the same on the bridge's pure-Python path (``native=False``): the hot
                path before the native module (x86-64 only), so before/after is one run
* ``bridge``    supervisor.ipc Writer.loan()/publish + Reader.receive() (wake-up socket),
                on the native module (supervisor/ipc/_native.c)

Opt-in extras: ``iox2-waitset`` (receiver blocks in an iceoryx2 WaitSet instead of
on the Listener directly), ``bridge-poll`` (``Reader.receive(timeout=0)`` spin) and
``bridge-cadence`` (the reader's ``busy_poll_us``: a window around the predicted next
message, defined in this file).

Latency: the sender writes ``time.monotonic_ns()`` (CLOCK_MONOTONIC, system-wide)
into the payload's first 8 bytes immediately before send/publish; the receiver
reads ``time.monotonic_ns()`` as soon as it holds a numpy array of the payload.
For loan-based transports (iceoryx2, bridge) loaning and filling the buffer happen
*before* the stamp and are not part of the latency.  Messages are paced (one per
period, and never before the receiver has taken the previous one, via a
shared-memory side channel) so the figure is latency, not queueing.

Throughput: unpaced streaming for a fixed time with at most ``--window``
messages in flight (same side-channel credit for every transport, so the receiver
keeps up and lossy rings never overwrite unread slots: iceoryx2's subscriber buffer
and the bridge's ring are both 8 deep and both overwrite the oldest when full, so
neither drops at window 4). A sender out of credit looks for 300 us, then sleeps on a
futex its receiver wakes (ipcbench/credit.py), never on a timer. Both loan-based
senders copy the whole payload into shared memory (``--fill copy``) and both
receivers read the 16-byte stamp of a view of it, then give the buffer back. Before a
stream is measured, 64 messages are streamed the same way (children.warmup_of), so a
fresh segment's first touch of its buffers (~850 page faults a 3.5 MB slot) falls
mostly outside it.

Each (transport, size, mode) runs in two fresh fork()ed children; the parent
only supervises (timeouts, kill, cleanup) so one broken transport yields an error
row, not an aborted table.

Samples and the verdict: by default 6000 paced messages per transport at 64 B and 64 KiB
and 4000 at 1 MiB and NV12 (the same count and pacing for every transport), in 4 passes
over the matrix; each pass runs every size's transports back to back, their order
rotated, so both sides of a ratio meet the same neighbours. A p99 of 1000 samples is the
10th-worst message and moved 0.46x-1.41x between quiet runs; at 4000-6000 it rests on
40-60. Latency percentiles pool the passes; throughput is the median pass.

Paired (``--paired``, on when both are selected): after the matrix, the bridge and
iceoryx2 (event) once more in the same two children, each through its own send/recv
(ipcbench/paired.py): latency message by message (A B B A ..., each with the matrix's
count and pacing), throughput in bursts (64 rounds of a burst each, A B then B A, of
2000 messages, 300 at 1 MiB and above, at window 4, each burst begun once the one
before is drained; a transport's rate is its median burst's). A neighbour's burst of
load then lands on both, within a period (a burst) of each other, where the matrix
gives it to whichever case ran then; and one receiver process serves both, so where
the scheduler wakes it (on the sender's CPU or the other: 12-25 us of p50 at NV12,
loaded) is the same for both (printed per size). Each paired throughput size also
prints, per transport, a message's wall time next to the sender's and the receiver's CPU
per message, the share taken on the sender's CPU and the sender's page faults: at NV12
(loaded) wall = sender + receiver CPU, taken on the sender's CPU 1.00, for both: the
two run in turn on one CPU. Last, the issue 26 block: bridge /
iceoryx2 throughput and latency p50/p99 at 64 B, 64 KiB and NV12 from the paired run
(from the matrix with ``--paired off``), each ratio with a 90 % interval (latency:
bootstrap over blocks of 50 consecutive pairs, the same blocks for both, so a burst of
load counts as one draw; throughput: rounds resampled); "within noise" where the
interval straddles 1x, and a note where both p99s sit at the pacing period (loaded: a
reader woken while a neighbour held its CPU ran only at the sender's next pacing
wake-up; such a p99 measures the neighbours).

    python bench/ipc_latency.py [--quick] [--json out.json] [--transports pipe,zmq,...]

Before the matrix, the bridge's per-message CPU cost on both paths, in-process
(``--cost N`` messages per path and size, 0: skip; see ipcbench/cost.py).

Per case the minor page faults per message at each end are printed (getrusage, measured
phase): a transport that maps or first-touches pages per message shows it there.

After the matrix, system calls per message (``--syscalls``; default: the bridge and
iceoryx2 (event) when strace is installed): each case once more with ``strace -f -c``
attached to each child for the measured phase only, and the voluntary context switches
(sleeps) per message at each end (see ipcbench/syscalls.py). Traced runs are slower;
their rates and latencies are not reported, only the counts.

This file is the driver (options, the matrix of cases, re-runs, JSON); each transport
is one module of bench/ipcbench/ (pipe, zmq_ipc, iox2, bridge), next to the children,
the per-case harness and the tables.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time

import numpy as np

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)
# The transports and the harness live in bench/ipcbench/.
for _path in (REPO_ROOT, BENCH_DIR):
    if _path not in sys.path:
        sys.path.insert(0, _path)
from ipcbench import (DEFAULT_TRANSPORTS, TRANSPORTS, BridgePollTransport,  # noqa: E402
                      BridgeTransport, Skip)
from ipcbench.cost import per_message_cost, print_cost  # noqa: E402
from ipcbench.harness import iox2_cleanup, run_case  # noqa: E402
from ipcbench.paired import run_paired  # noqa: E402
from ipcbench.report import (aggregate, burst_rate, fmt, print_syscalls,  # noqa: E402
                             print_tables, target_verdict)
from ipcbench.syscalls import available as strace_available  # noqa: E402



class BridgeCadenceTransport(BridgeTransport):
    """Opt-in: the bridge's reader with ``busy_poll_us`` (supervisor/ipc/_cadence.py):
    it learns a regular stream's period, sleeps until just before the next message is
    due and watches shared memory from there (at most 2 x busy_poll_us of CPU a
    message; controlsd reads so). Its counterpart is iceoryx2 (busy-poll), not (event)."""
    key = "bridge-cadence"
    label = "trio-bridge (cadence 100us)"
    note = "reader busy-polls a 2 x 100 us window around the predicted next message"
    busy_poll_us = 100

    def _reader_kw(self) -> dict:
        return {**super()._reader_kw(), "busy_poll_us": self.busy_poll_us}


TRANSPORTS.setdefault(BridgeCadenceTransport.key, BridgeCadenceTransport)

NV12_FRAME = 1928 * 1208 * 3 // 2  # 3,493,536 bytes
SIZES: list[tuple[str, int]] = [
    ("64 B", 64),
    ("64 KiB", 64 * 1024),
    ("1 MiB", 1024 * 1024),
    ("NV12 1928x1208", NV12_FRAME),
]

# --------------------------------------------------------------------------------------
# Parameters, main
# --------------------------------------------------------------------------------------

def params_for(nbytes: int, quick: bool, repeats: int, args) -> dict:
    """Per-run parameters; counts are per repeat (the totals are split over repeats)."""
    big = nbytes >= 1 << 20
    frame = nbytes >= NV12_FRAME
    if quick:
        total = 200 if frame else 300 if big else 500
        warmup = 10 if big else 20
        duration = 0.4
    else:
        # A p99 of n samples is the n/100-th worst: at 1000 it moved 0.46x-1.41x between
        # quiet runs (NV12). 4000-6000 put 40-60 samples above it.
        total = 4000 if big else 6000
        warmup = 20 if big else 50
        duration = 2.0
    if args.count:
        total = args.count
    if args.duration:
        duration = args.duration
    count = max(1, -(-total // repeats))
    duration = duration / repeats
    period = 2e-3 if frame else 1e-3 if big else 5e-4
    if args.period_us:
        period = args.period_us / 1e6
    est = warmup * period + count * (period + 0.02)
    return {
        "count": count, "warmup": warmup, "period_s": period,
        # Streamed before a stream is measured (children.warmup_of): 8 slots (bridge)
        # or ~11 chunks (iceoryx2) touched at window 4.
        "warmup_stream": 64,
        "duration_s": duration, "window": args.window, "fill": args.fill == "copy",
        "max_msgs": 2_000_000,
        # receiver hard deadline: generous, only there to catch a hung transport
        "deadline_s": max(10.0, est + duration + 10),
        # parent: no message taken and no state change for this long -> abort the case
        "stall_s": 8.0,
        # latency runs of very slow transports (pickled frames) stop early
        "max_latency_s": (3.0 if quick else 8.0) / repeats,
        "pin_tx": 0 if args.pin else None, "pin_rx": 1 if args.pin else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer messages, shorter streams (<60 s)")
    ap.add_argument("--json", metavar="PATH", help="write all results as JSON")
    ap.add_argument("--transports", default=",".join(DEFAULT_TRANSPORTS),
                    help=f"comma list from {','.join(TRANSPORTS)} (default: %(default)s)")
    ap.add_argument("--sizes", default="all",
                    help="comma list of byte counts, or 'all' (64,65536,1048576,frame)")
    ap.add_argument("--modes", default="latency,throughput")
    ap.add_argument("--repeat", type=int,
                    help="passes over the whole matrix, interleaved in time; latency "
                         "samples are pooled, throughput is the median (default: 4, "
                         "--quick: 1). Counts and durations are split over the passes.")
    ap.add_argument("--count", type=int, help="latency messages per case, all repeats (override)")
    ap.add_argument("--period-us", type=float, help="latency pacing period (override)")
    ap.add_argument("--duration", type=float,
                    help="throughput seconds per case, all repeats (override)")
    ap.add_argument("--window", type=int, default=4,
                    help="max messages in flight while streaming (default: %(default)s)")
    ap.add_argument("--fill", choices=("copy", "stamp"), default="copy",
                    help="loan-based senders: copy the ready payload into the loan each "
                         "message (copy, default) or only write the 16-byte header "
                         "(stamp: producer writes in place). Never inside the latency.")
    ap.add_argument("--max-foreign", type=float, default=10.0, metavar="PCT",
                    help="a case during which other processes used more than PCT%% of "
                         "the CPUs is re-run (default: %(default)s)")
    ap.add_argument("--retries", type=int, default=1,
                    help="re-runs allowed per disturbed case (default: %(default)s)")
    ap.add_argument("--budget", type=float, metavar="S",
                    help="no more re-runs once they would push the whole run past S "
                         "seconds (default: 300, --quick: 55)")
    ap.add_argument("--pin", action="store_true", help="pin sender to CPU0, receiver to CPU1")
    ap.add_argument("--bridge-module", default="supervisor.ipc",
                    help="module providing ChannelSpec/Channel/Writer/Reader")
    ap.add_argument("--raw", metavar="DIR",
                    help="save every case's raw latencies (ns, arrival order) as .npy")
    ap.add_argument("--cost", type=int, metavar="N",
                    help="per-message cost of the bridge's two paths, N messages each per "
                         "size, in-process (default: 20000, --quick: 5000; 0: skip)")
    ap.add_argument("--syscalls", default="auto", metavar="LIST",
                    help="count system calls per message (strace) for these transports "
                         "after the matrix: a comma list, 'all' (every selected one), "
                         "'none', or 'auto' (bridge and iox2 if selected; default)")
    ap.add_argument("--syscalls-only", action="store_true",
                    help="only the system-call pass (no cost, no matrix)")
    ap.add_argument("--breakdown", type=int, metavar="N", nargs="?", const=2000,
                    help="only split each woken message's latency (bridge and iceoryx2 "
                         "event, N paced messages per size, default 2000) at the writer's "
                         "return from send and the reader's return from its wait")
    ap.add_argument("--cold", type=int, metavar="N", nargs="?", const=200,
                    help="only the in-process cold costs (bridge and iceoryx2 event, "
                         "batches of N messages alternating, 16 MB touched before each "
                         "timed part): the writer's stamp -> send returns (a wake-up "
                         "sent every message) and the reader's take -> view held")
    ap.add_argument("--paired", choices=("auto", "off"), default="auto",
                    help="after the matrix, the bridge and iceoryx2 (event) once more in "
                         "the same two children (ipcbench/paired.py): latency message by "
                         "message with the matrix's count and pacing, throughput in "
                         "alternating bursts; the issue 26 verdict judges on them. auto "
                         "(default): when both are selected")
    ap.add_argument("-v", "--verbose", action="store_true", help="print child tracebacks")
    args = ap.parse_args(argv)
    if args.breakdown:
        return breakdown(args.breakdown, args.sizes)
    if args.cold:
        return cold(args.cold, args.sizes)

    keys = [k.strip() for k in args.transports.split(",") if k.strip()]
    unknown = [k for k in keys if k not in TRANSPORTS]
    if unknown:
        ap.error(f"unknown transport(s) {unknown}; choose from {list(TRANSPORTS)}")
    if args.sizes == "all":
        sizes = SIZES
    else:
        sizes = []
        for s in args.sizes.split(","):
            s = s.strip()
            n = NV12_FRAME if s in ("frame", "nv12") else int(s)
            sizes.append(next(((lab, b) for lab, b in SIZES if b == n), (f"{n} B", n)))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    BridgeTransport.module = args.bridge_module
    BridgePollTransport.module = args.bridge_module
    labels = {k: TRANSPORTS[k].label for k in keys}

    print(f"ipc_latency: {platform.node()} {platform.machine()} cpus={os.cpu_count()} "
          f"python {platform.python_version()} numpy {np.__version__}"
          f"{' QUICK' if args.quick else ''} fill={args.fill} window={args.window}"
          f"{' pinned' if args.pin else ''}")
    load0 = os.getloadavg()
    if load0[0] > 0.5:
        print(f"  warning: load average {load0[0]:.2f} before start; other work on this "
              f"machine will distort the tails (2 cores: sender + receiver need both)")
    skipped: dict[str, str] = {}
    for k in keys:
        try:
            TRANSPORTS[k]().check()
        except Skip as e:
            skipped[k] = str(e)
            print(f"  note: skipping {labels[k]}: {e}")

    if "bridge" in keys and "bridge" not in skipped:
        # The plain "bridge" runs whichever path the module picks; on x86-64 that is the
        # pure-Python one, silently, when the native module is not built (or is stale).
        try:
            nat = importlib.import_module(args.bridge_module + "._atomics").select(None)
        except Exception as e:  # noqa: BLE001 - reported, the case itself will fail
            print(f"  note: cannot tell which path {labels['bridge']} runs: {e}")
        else:
            if nat is None:
                print(f"  WARNING: {labels['bridge']} runs the pure-Python path here (the "
                      f"native module is not built, or TRIO_BRIDGE_NATIVE=0): rebuild "
                      f"(python setup.py build_ext --inplace) before comparing")
    if args.syscalls == "none":
        traced_keys: list[str] = []
    elif args.syscalls == "auto":
        traced_keys = [k for k in keys if k in ("iox2", "bridge")]
    elif args.syscalls == "all":
        traced_keys = list(keys)
    else:
        traced_keys = [k.strip() for k in args.syscalls.split(",") if k.strip()]
        bad = [k for k in traced_keys if k not in keys]
        if bad:
            ap.error(f"--syscalls {bad}: not among --transports {keys}")
    traced_keys = [k for k in traced_keys if k not in skipped]
    if traced_keys and (why := strace_available()):
        if args.syscalls_only or args.syscalls not in ("auto",):
            ap.error(f"--syscalls: {why}")
        print(f"  note: no system-call counts: {why}")
        traced_keys = []
    if args.syscalls_only:
        if not traced_keys:
            ap.error("--syscalls-only: no transport to trace")
        t_start = time.monotonic()
        sc = _syscall_pass(traced_keys, labels, sizes, modes, args, None)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"syscalls": sc}, f, indent=1, default=str)
            print(f"wrote {args.json}")
        print(f"total {time.monotonic() - t_start:.1f} s")
        return 0

    cost: dict[str, dict] = {}
    n_cost = args.cost if args.cost is not None else (5000 if args.quick else 20000)
    if n_cost > 0 and any(k.startswith("bridge") for k in keys):
        for size, nbytes in sizes:
            cost[size] = per_message_cost(nbytes, n_cost, fill=args.fill == "copy",
                                          module=args.bridge_module)
        print_cost(cost, args.fill)

    repeats = args.repeat or (1 if args.quick else 4)
    runs: list[dict] = []
    budget = args.budget or (55.0 if args.quick else 300.0)
    n_cases = repeats * len(sizes) * len(modes) * len([k for k in keys if k not in skipped])
    done = 0
    t_start = time.monotonic()
    iox2_killed = False
    for rep in range(repeats):
        if repeats > 1:
            print(f"-- repeat {rep + 1}/{repeats}")
        for size, nbytes in sizes:
            p = params_for(nbytes, args.quick, repeats, args)
            # Rotate the order each repeat so no transport always follows the same one.
            order = keys[rep % len(keys):] + keys[:rep % len(keys)]
            for k in order:
                if k in skipped:
                    if rep == 0:
                        runs.append({"transport": k, "label": labels[k], "size": size,
                                     "nbytes": nbytes, "mode": "latency",
                                     "skipped": skipped[k]})
                    continue
                for mode in modes:
                    row = run_case(TRANSPORTS[k], mode, size, nbytes, p)
                    done += 1
                    for _ in range(args.retries):
                        busy = row.get("foreign_cpu_pct", 0.0)
                        if busy <= args.max_foreign or "error" in row:
                            break
                        spent = time.monotonic() - t_start
                        if spent + row["wall_s"] + spent / done * (n_cases - done) > budget:
                            row["retry_skipped"] = "time budget"
                            break
                        print(f"  {size:<15} {labels[k]:<23} {mode:<10} other processes "
                              f"used {busy:.0f}% of the CPUs meanwhile: running it again")
                        again = run_case(TRANSPORTS[k], mode, size, nbytes, p)
                        if ("error" not in again
                                and again.get("foreign_cpu_pct", 0.0) < busy):
                            row = again
                        row["retried"] = row.get("retried", 0) + 1
                    row["repeat"] = rep
                    row["params"] = {kk: p[kk] for kk in ("count", "warmup", "warmup_stream",
                                                           "period_s", "duration_s", "window",
                                                           "fill")}
                    runs.append(row)
                    iox2_killed |= row.get("killed", False) and k.startswith("iox2")
                    lat = row.get("latency", {})
                    msg = (f"  {size:<15} {labels[k]:<23} {mode:<10} "
                           + (f"ERROR {row['error'][:160]}" if "error" in row else
                              f"{'loaded ' if mode == 'throughput' else ''}"
                              f"p50 {fmt(lat.get('p50'))} us  p99 {fmt(lat.get('p99'))} us"
                              + (f"  {fmt(row.get('msgs_per_s'), 0)} msg/s "
                                 f"{fmt(row.get('gb_per_s'), 2)} GB/s"
                                 if mode == "throughput" else "")
                              + (f"  sleeps/msg rx {row['sleeps_per_msg_rx']:.2f}"
                                 if row.get("sleeps_per_msg_rx") is not None else "")
                              + (f"  faults/msg tx {row['faults_per_msg_tx']:.2f} rx "
                                 f"{row['faults_per_msg_rx']:.2f}"
                                 if row.get("faults_per_msg_rx") is not None else "")
                              + (f"  drops={row['drops']}" if row.get("drops") else ""))
                           + f"  [{row['wall_s']:.1f}s"
                           + (f", other procs {row['foreign_cpu_pct']:.0f}% CPU"
                              if row.get("foreign_cpu_pct", 0) >= 2 else "")
                           + "]")
                    print(msg, flush=True)
                    if args.verbose and row.get("tracebacks"):
                        for tb in row["tracebacks"]:
                            print(tb)
    if iox2_killed or any(k.startswith("iox2") and k not in skipped for k in keys):
        iox2_cleanup()
    paired = _paired_pass(keys, skipped, sizes, modes, args)
    rows = aggregate(runs, args.raw)
    elapsed = time.monotonic() - t_start
    ratios = print_tables(rows, keys, labels, sizes, args.max_foreign)
    verdict = target_verdict(rows, sizes, paired=paired)
    for r in rows:
        r.pop("_raws", None)           # the samples stay in memory (and --raw), not JSON
    if cost:
        print_cost(cost, args.fill)           # again, next to the tables
    sc = _syscall_pass(traced_keys, labels, sizes, modes, args, rows) if traced_keys else None
    load1 = os.getloadavg()
    print(f"total {elapsed:.1f} s   load average before {load0[0]:.2f}, after {load1[0]:.2f} "
          f"(the benchmark itself adds ~1-2)")

    if args.json:
        doc = {
            "meta": {
                "host": platform.node(), "machine": platform.machine(),
                "cpus": os.cpu_count(), "python": platform.python_version(),
                "numpy": np.__version__, "quick": args.quick, "fill": args.fill,
                "window": args.window, "pinned": args.pin, "clock": "CLOCK_MONOTONIC",
                "elapsed_s": elapsed, "loadavg_before": load0, "loadavg_after": load1,
                "transports": {k: labels[k] for k in keys},
                "versions": _versions(),
            },
            "results": rows,
            "ratios": ratios,
            "target": verdict,
            "per_message_cost_us": cost,
            "syscalls": sc,
            "paired_throughput_cost": (paired or {}).get("throughput_cost"),
            "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


# Paired throughput: messages a burst (about 20-100 ms of streaming here) and rounds.
# 64 rounds, not 16: the interval is of a median of bursts, and its width goes as
# 1/sqrt(rounds) (simulated, ratio of medians with rounds resampled, bursts at 8 %
# noise, a tenth stalled 3x: 90 % interval 0.215 wide at 16 rounds, 0.108 at 64, the
# true ratio inside it 96 % of the time at both). A quiet run's NV12 ratio,
# 1.03x [0.99-1.07] at 16, could not be called either way; a burst is 20-100 ms, so
# 48 rounds more cost ~10-20 s of a 2-minute run (loaded: ~60 s).
PAIRED_BURST_SMALL, PAIRED_BURST_BIG, PAIRED_ROUNDS = 2000, 300, 64


def _paired_pass(keys: list[str], skipped: dict, sizes, modes, args) -> dict:
    """The bridge and iceoryx2 (event) in the same two children (ipcbench/paired.py), at
    every size: latency message by message, throughput in alternating bursts.
    {"latency": {size label: {key: latencies in ns}}, "throughput": {size label: {key:
    [(messages - 1, ns), ...] per burst, in round order}}, "throughput_cost": {size
    label: {key: per message wall/sender CPU/receiver CPU us, faults, same_cpu}}}."""
    pair = ("iox2", "bridge")
    if args.paired == "off" or any(k not in keys or k in skipped for k in pair):
        return {}
    out: dict = {"latency": {}, "throughput": {}, "throughput_cost": {}}
    print(f"-- paired: {' and '.join(pair)} in the same two children; latency message by "
          f"message (A B B A ...), p50 / p99 us; throughput in bursts (A B B A ...), the "
          f"median burst's msg/s")
    for size, nbytes in sizes:
        p = params_for(nbytes, args.quick, 1, args)
        if "latency" in modes:
            got = run_paired([TRANSPORTS[k] for k in pair], nbytes, p)
            if "error" in got:
                print(f"  {size:<15} latency    ERROR {got['error']}  [{got['wall_s']:.1f}s]")
            else:
                out["latency"][size] = got["lat"]
                cells = "   ".join(f"{k} {np.percentile(v, 50) / 1e3:.1f} / "
                                   f"{np.percentile(v, 99) / 1e3:.1f}"
                                   for k, v in got["lat"].items())
                same = " / ".join(f"{v:.2f}" for v in got.get("same_cpu", {}).values())
                print(f"  {size:<15} latency    {cells}   n {p['count']} each, woken on "
                      f"the sender's CPU {same}  [{got['wall_s']:.1f}s, all processes "
                      f"{got.get('busy_cpu_pct', 0):.0f}% CPU]", flush=True)
        if "throughput" in modes:
            big = nbytes >= 1 << 20
            p = {**p, "burst": PAIRED_BURST_BIG if big else PAIRED_BURST_SMALL,
                 "rounds": 4 if args.quick else PAIRED_ROUNDS}
            got = run_paired([TRANSPORTS[k] for k in pair], nbytes, p, mode="throughput")
            if "error" in got:
                print(f"  {size:<15} throughput ERROR {got['error']}  [{got['wall_s']:.1f}s]")
            else:
                out["throughput"][size] = got["bursts"]
                out["throughput_cost"][size] = got["cost"]
                cells = "   ".join(f"{k} {fmt(burst_rate(v), 0)}/s"
                                   for k, v in got["bursts"].items())
                print(f"  {size:<15} throughput {cells}   {p['rounds']} bursts of "
                      f"{p['burst']} each  [{got['wall_s']:.1f}s, all processes "
                      f"{got.get('busy_cpu_pct', 0):.0f}% CPU]", flush=True)
                for k, c in got["cost"].items():
                    # wall ~ sender + receiver CPU with same_cpu ~ 1: the two ran in
                    # turn on one CPU (the rest of wall: other processes, switches).
                    print(f"  {'':<15}   {k:<7} per message: wall {c['wall_us']:.1f} us, "
                          f"sender CPU {c['tx_cpu_us']:.1f} + receiver CPU "
                          f"{c['rx_cpu_us']:.1f} = {c['tx_cpu_us'] + c['rx_cpu_us']:.1f} "
                          f"us; taken on the sender's CPU {c['same_cpu']:.2f}; sender "
                          f"faults {c['tx_faults']:.3f}; window full {c['tx_full']:.2f}")
    iox2_cleanup()
    return out


def _syscall_pass(keys: list[str], labels: dict[str, str], sizes, modes, args,
                  untraced: list[dict] | None) -> dict:
    """Each (transport, size, mode) once more under strace: system calls per message."""
    runs = []
    for size, nbytes in sizes:
        p = params_for(nbytes, args.quick, 1, args)
        p["trace"] = True
        # Under ptrace the transports slow down: a shorter latency run and stream.
        p["count"] = min(p["count"], 500 if args.quick else 1000)
        p["max_latency_s"] = 10.0
        for k in keys:
            for mode in modes:
                row = run_case(TRANSPORTS[k], mode, size, nbytes, p)
                runs.append(row)
                sc = row.get("syscalls")
                print(f"  traced {size:<15} {labels[k]:<23} {mode:<10} "
                      + (f"ERROR {row.get('error', 'no count')[:160]}" if not sc else
                         f"{sc['sender'].get('per_msg', 0):.2f} + "
                         f"{sc['receiver'].get('per_msg', 0):.2f} calls/msg "
                         f"({sc['receiver']['messages']} msgs)")
                      + f"  [{row['wall_s']:.1f}s]", flush=True)
    for r in runs:
        r.pop("_raw_ns", None)
    print()
    summary = print_syscalls(runs, keys, labels, sizes, untraced)
    return {"summary": summary,
            "runs": [{k: r.get(k) for k in ("transport", "size", "mode", "syscalls",
                                              "error")} for r in runs]}


# --------------------------------------------------------------------------------------
# --breakdown: where a woken message's latency goes
# --------------------------------------------------------------------------------------

_BD_WARMUP = 50


def breakdown(count: int, sizes_arg: str) -> int:
    """Bridge and iceoryx2 (event), paced (one message in flight, the reader asleep for
    each), every message split into: stamp -> the writer's send returns; stamp -> the
    reader's blocking wait returns (the wake-up: the writer's part, the kernel's and the
    scheduler's); wait returns -> the reader holds a view (the reader's part). Sizes
    alternate the transports' order. Children write their clock readings into shared
    memory; nothing is printed until both are gone."""
    sizes = [b for _, b in SIZES] if sizes_arg == "all" else [
        NV12_FRAME if x.strip() in ("frame", "nv12") else int(x) for x in sizes_arg.split(",")]
    print(f"ipc_latency --breakdown: {count} paced messages per case, p50 / p99 us; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("  tail: the messages at or above the case's p99 total, median of each part; "
          "same CPU: share of messages whose reader ran on the CPU the writer sent from "
          "(all / in the tail)")
    print(f"{'size':>9} {'transport':9} {'total':>15} {'writer part':>15} "
          f"{'stamp->woken':>15} {'reader part':>15}   {'tail: writer/woken/reader':>26} "
          f"{'same CPU':>11}  total p50 by the reader's CPU (20 messages or more)")
    for n, nbytes in enumerate(sizes):
        period = 2e-3 if nbytes >= NV12_FRAME else 1e-3 if nbytes >= 1 << 20 else 5e-4
        for kind in (("bridge", "iox2") if n % 2 == 0 else ("iox2", "bridge")):
            st, sent, woke, got, cpu_tx, cpu_rx = _bd_case(kind, nbytes, count, period)
            ok = woke > 0
            cells = []
            for a, b in ((st, got), (st, sent), (st[ok], woke[ok]), (woke[ok], got[ok])):
                d = (b - a) / 1e3
                cells.append(f"{np.percentile(d, 50):7.1f}/{np.percentile(d, 99):<7.1f}")
            total = got - st
            tail = ok & (total >= np.percentile(total, 99))
            parts = [np.median((b[tail] - a[tail]) / 1e3) if tail.any() else float("nan")
                     for a, b in ((st, sent), (st, woke), (woke, got))]
            same = cpu_tx == cpu_rx
            print(f"{nbytes:>9} {kind:9} " + " ".join(cells)
                  + f"   {parts[0]:8.1f}/{parts[1]:7.1f}/{parts[2]:7.1f}"
                  + f"   {same.mean():.2f}/{same[tail].mean() if tail.any() else 0:.2f}"
                  + "".join(f"  {lab} CPU p50 {np.median(total[m]) / 1e3:.1f}"
                            for lab, m in (("same", same), ("other", ~same)) if m.sum() >= 20)
                  + (f"  (woken {ok.mean():.2f})" if ok.mean() < 0.99 else ""), flush=True)
    iox2_cleanup()
    return 0


def _getcpu():
    """sched_getcpu() through libc (the vDSO/rseq: no system call), or a constant -1."""
    import ctypes
    try:
        f = ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):
        return lambda: -1
    f.restype = ctypes.c_int
    return f


def _bd_case(kind: str, nbytes: int, count: int, period_s: float) -> np.ndarray:
    """One case in two fork()ed children; rows: stamp, sent, woken (0: not asleep), got,
    the writer's CPU at send and the reader's once it holds the view."""
    import mmap
    from ipcbench.iox2 import Iox2Transport
    from ipcbench.transport import read_stamp, stamp, u8_view
    now = time.monotonic_ns
    shm = mmap.mmap(-1, 8 * (6 * count + 3))
    ctrl = np.frombuffer(shm, dtype=np.int64)
    ctrl[:] = 0
    ctrl[0] = -1                           # sequence taken last (the writer's credit)
    rows = ctrl[3:].reshape(6, count)      # ctrl[1]: receiver ready, ctrl[2]: done
    getcpu = _getcpu()
    t = BridgeTransport() if kind == "bridge" else Iox2Transport()
    t.setup(nbytes, f"bd-{os.getpid()}-{nbytes}")
    src = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    total = count + _BD_WARMUP

    def writer() -> None:
        if kind == "bridge":
            from supervisor.ipc import Writer
            w = Writer(t.wh)

            def send(i: int) -> int:
                with w.loan() as slot:
                    a = slot.array((nbytes,), "uint8")
                    np.copyto(a, src)
                    ts = stamp(a, i)
                    del a
                    slot.publish(publish_ts_ns=ts)
                return ts
        else:
            end = now() + 15_000_000_000
            while not ctrl[1] and now() < end:
                time.sleep(1e-3)     # the reader creates the services
            import iceoryx2 as iox2
            node = t._node()
            pub = (t._pubsub_builder(node).open().publisher_builder()
                   .initial_max_slice_len(nbytes).max_loaned_samples(2).create())
            notifier = (node.service_builder(iox2.ServiceName.new(t.service)).event()
                        .open().notifier_builder().create())
            pub.update_connections()

            def send(i: int) -> int:
                sample = pub.loan_slice_uninit(nbytes)
                buf = u8_view(sample.payload_ptr, nbytes)
                np.copyto(buf, src)
                sample = sample.assume_init()
                ts = stamp(buf, i)
                del buf
                sample.send()
                notifier.notify()
                return ts
        end = now() + 15_000_000_000
        while not ctrl[1]:
            if now() > end:
                raise TimeoutError("the reader never became ready")
            time.sleep(1e-3)
        for i in range(total):
            time.sleep(period_s)
            end = now() + 2_000_000_000
            while ctrl[0] < i - 1 and now() < end:
                pass                       # never before the previous one was taken
            ts = send(i)
            t_sent = now()
            if i >= _BD_WARMUP:
                rows[0, i - _BD_WARMUP], rows[1, i - _BD_WARMUP] = ts, t_sent
                rows[4, i - _BD_WARMUP] = getcpu()
        end = now() + 5_000_000_000
        while not ctrl[2] and now() < end:
            time.sleep(1e-3)

    def reader() -> None:
        if kind == "bridge":
            from supervisor.ipc import Reader
            r = Reader(t.rh)
            wait, woke = r._wait, [0]

            def timed_wait(*a):            # the reader's blocking wait, clocked
                x = wait(*a)
                woke[0] = now()
                return x
            r._wait = timed_wait
            ctrl[1] = 1

            def recv() -> tuple[int, int, int]:
                woke[0] = 0
                m = r.try_receive()
                if m is None:
                    m = r.receive(timeout=5.0)
                arr = m.array
                t_got = now()
                seq = read_stamp(arr)[1]
                del arr
                m.release()
                return seq, woke[0], t_got
        else:
            import iceoryx2 as iox2
            node = t._node()
            sub = t._pubsub_builder(node).create().subscriber_builder().create()
            listener = (node.service_builder(iox2.ServiceName.new(t.service)).event()
                        .create().listener_builder().create())
            wait_for = iox2.Duration.from_nanos(50_000_000)
            ctrl[1] = 1

            def recv() -> tuple[int, int, int]:
                t_woke, end = 0, now() + 5_000_000_000
                while (sample := sub.receive()) is None:
                    if now() > end:
                        raise TimeoutError("no message within 5 s")
                    listener.timed_wait(wait_for)
                    t_woke = now()
                p = sample.payload()
                arr = u8_view(p.data_ptr, p.number_of_elements)
                t_got = now()
                seq = read_stamp(arr)[1]
                del arr, p
                sample.delete()
                return seq, t_woke, t_got
        for _ in range(total):
            seq, t_woke, t_got = recv()
            if seq >= _BD_WARMUP:
                rows[2, seq - _BD_WARMUP], rows[3, seq - _BD_WARMUP] = t_woke, t_got
                rows[5, seq - _BD_WARMUP] = getcpu()
            ctrl[0] = seq
        ctrl[2] = 1

    pids = []
    for role in ((writer, reader) if kind == "bridge" else (reader, writer)):
        pid = os.fork()
        if pid == 0:
            import gc
            gc.disable()
            code = 0
            try:
                role()
            except BaseException:  # noqa: BLE001 - a child reports and exits
                import traceback
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        pids.append(pid)
    end = time.monotonic() + 30 + total * (period_s + 0.01)
    for pid in pids:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > end:          # a child hung: stop both
                for other in pids:
                    try:
                        os.kill(other, 9)
                    except ProcessLookupError:
                        pass
            time.sleep(0.01)
    t.teardown()
    if not rows[3].all():
        raise SystemExit(f"--breakdown: {kind} at {nbytes} B lost messages or failed")
    return rows.copy()


# --------------------------------------------------------------------------------------
# --cold: the constant parts of a woken message, in one process, caches cold
# --------------------------------------------------------------------------------------

_COLD_BATCHES = 8
_COLD_TOUCH = 16 << 20     # bytes touched before each timed part: a paced stream's writer
                           # and reader run cold (a frame copied, other work in between)


def cold(count: int, sizes_arg: str) -> int:
    """Bridge and iceoryx2 (event) in one process, alternating in batches of ``count``:
    the writer's stamp -> its send returns, with the wake-up sent every message (the
    bridge's reader flag held down, as a sleeping reader's; iceoryx2 notifies every
    message), and the reader's take -> a numpy view of the payload held. 16 MB are
    touched before each timed part, so every object either touches is a cache miss, as
    in a paced stream between processes (--breakdown). No scheduling in it: the part of
    the latency the transport's own code decides."""
    import select

    from ipcbench.transport import read_stamp, stamp, u8_view

    import supervisor.ipc as bridge
    from supervisor.ipc import layout as L
    sizes = [b for _, b in SIZES] if sizes_arg == "all" else [
        NV12_FRAME if x.strip() in ("frame", "nv12") else int(x) for x in sizes_arg.split(",")]
    touch = np.zeros(_COLD_TOUCH, np.uint8)
    pc = time.perf_counter_ns

    def bridge_case(nbytes: int):
        spec = bridge.ChannelSpec(name=f"cold_{os.getpid()}_{nbytes}", slot_size=nbytes,
                                  slot_count=8, dtype="uint8", max_readers=1, max_leases=1)
        ch = bridge.Channel.create(spec)
        w, r = bridge.Writer(ch.writer_handle()), bridge.Reader(ch.reader_handle(0))
        src = np.random.default_rng(0).integers(0, 256, nbytes, np.uint8)
        sleeps = [1 << 40]

        def one(i: int) -> tuple[int, int]:
            # Asleep, a new sleep: the writer sends this message's wake-up byte (K5, K6).
            r._lease_r.store(L.OFF_SLEEPS, sleeps[0])
            r._lease_r.store(L.OFF_AWAKE, 0)
            sleeps[0] += 1
            np.add(touch, 1, out=touch)
            with w.loan() as loan:
                a = loan.array((nbytes,), "uint8")
                np.copyto(a, src)
                t = stamp(a, i)
                del a
                t0 = pc()
                loan.publish(publish_ts_ns=t)
                t1 = pc()
            if not select.select((r._efd,), (), (), 2.0)[0]:
                raise RuntimeError("--cold: the bridge sent no wake-up for a sleeping reader")
            os.read(r._efd, 256)
            r._lease_r.store(L.OFF_AWAKE, L.READER_AWAKE)
            np.add(touch, 1, out=touch)
            t2 = pc()
            m = r.try_receive()
            arr = m.array
            t3 = pc()
            read_stamp(arr)
            del arr
            m.release()
            return t1 - t0, t3 - t2

        def close() -> None:
            r.close()
            w.close()
            ch.close()
        return one, close

    def iox2_case(nbytes: int):
        import iceoryx2 as iox2
        from ipcbench.iox2 import Iox2Transport
        t = Iox2Transport()
        t.setup(nbytes, f"cold-{os.getpid()}-{nbytes}")
        node = t._node()
        svc = t._pubsub_builder(node).create()
        sub = svc.subscriber_builder().create()
        ev = node.service_builder(iox2.ServiceName.new(t.service)).event().create()
        listener = ev.listener_builder().create()
        notifier = ev.notifier_builder().create()
        pub = (svc.publisher_builder().initial_max_slice_len(nbytes)
               .max_loaned_samples(2).create())
        pub.update_connections()
        src = np.random.default_rng(0).integers(0, 256, nbytes, np.uint8)
        keep = [node, svc, ev]

        def one(i: int) -> tuple[int, int]:
            np.add(touch, 1, out=touch)
            sample = pub.loan_slice_uninit(nbytes)
            buf = u8_view(sample.payload_ptr, nbytes)
            np.copyto(buf, src)
            sample = sample.assume_init()
            stamp(buf, i)
            del buf
            t0 = pc()
            sample.send()
            notifier.notify()
            t1 = pc()
            listener.try_wait()
            np.add(touch, 1, out=touch)
            t2 = pc()
            got = sub.receive()
            p = got.payload()
            arr = u8_view(p.data_ptr, p.number_of_elements)
            t3 = pc()
            read_stamp(arr)
            del arr, p
            got.delete()
            return t1 - t0, t3 - t2

        def close() -> None:
            for port in (notifier, listener, pub, sub):
                port.delete()
            keep.clear()
        return one, close

    import gc
    print(f"ipc_latency --cold: {_COLD_BATCHES} batches x {count} messages per transport "
          f"and size, alternating; 16 MB touched before each part; p50 / p90 us; load "
          f"average {os.getloadavg()[0]:.2f}")
    print(f"{'size':>9} {'transport':9} {'stamp -> send returns':>22} {'take -> view held':>18}")
    for nbytes in sizes:
        cases = {"bridge": bridge_case(nbytes), "iox2": iox2_case(nbytes)}
        got: dict[str, list] = {k: [] for k in cases}
        gc.collect()
        gc.disable()
        try:
            for k, (one, _) in cases.items():
                for i in range(20):
                    one(i)
            for b in range(_COLD_BATCHES):
                for k, (one, _) in cases.items():
                    got[k] += [one(20 + b * count + i) for i in range(count)]
        finally:
            gc.enable()
            for _, close in cases.values():
                close()
        for k, rows in got.items():
            d = np.array(rows) / 1e3
            cells = [f"{np.percentile(d[:, j], 50):7.2f} / {np.percentile(d[:, j], 90):<7.2f}"
                     for j in (0, 1)]
            print(f"{nbytes:>9} {k:9} {cells[0]:>22} {cells[1]:>18}", flush=True)
    iox2_cleanup()
    return 0


def _versions() -> dict:
    v = {}
    for mod in ("zmq", "iceoryx2"):
        try:
            m = importlib.import_module(mod)
            v[mod] = getattr(m, "__version__", None) or _dist_version(mod)
        except ImportError:
            pass
    return v


def _dist_version(mod: str) -> str | None:
    try:
        from importlib.metadata import version
        return version({"zmq": "pyzmq"}.get(mod, mod))
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())
