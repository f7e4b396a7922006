"""The parent's side of one case: fork the two children, supervise them (progress,
timeouts, kill, cleanup) and turn whatever happened into one result row, so one broken
transport yields an error row, not an aborted table."""
from __future__ import annotations

import gc
import mmap
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import time
import traceback
import uuid

import numpy as np

from . import syscalls
from .children import (C_ABORT, C_LAST_SEQ, C_RX_DONE, C_RX_END, C_RX_READY, C_TRACE,
                       C_TX_ARMED, C_TX_DONE, C_TX_READY, C_WORDS, TRACE_GO, TRACE_STOPPED,
                       busy_cpu_s, cpu_self, receiver_main, sender_main, warmup_of)
from .transport import Skip, Transport


def _child(target, *args) -> None:
    # Forked children: default SIGINT/SIGTERM so the parent can always stop them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        target(*args)
    finally:
        gc.collect()   # drop what the transports left in cycles (iceoryx2 nodes) first
        os._exit(0)


def _stop(proc) -> bool:
    """Make sure a child is gone; True if it had to be killed."""
    proc.join(0.5)
    if proc.exitcode is not None:
        return False
    proc.terminate()
    proc.join(1.0)
    if proc.exitcode is None:
        proc.kill()
        proc.join(1.0)
    return True


def run_case(tcls: type[Transport], mode: str, size_label: str, nbytes: int,
             p: dict) -> dict:
    row = {"transport": tcls.key, "label": tcls.label, "size": size_label,
           "nbytes": nbytes, "mode": mode}
    t = tcls()
    run_id = f"{os.getpid()}-{uuid.uuid4().hex[:10]}"
    ctx = mp.get_context("fork")
    shm = mmap.mmap(-1, C_WORDS * 8)
    ctrl = np.frombuffer(shm, dtype=np.int64)
    ctrl[:] = 0
    ctrl[C_LAST_SEQ] = -1
    procs = []
    conns = {}
    killed = False
    results: dict[str, dict] = {}
    t0 = time.monotonic()
    busy0, own0 = busy_cpu_s(), cpu_self()
    tracers: dict[str, syscalls.Tracer] = {}
    traced: dict[str, syscalls.Counts] = {}
    trace = bool(p.get("trace"))
    try:
        t.setup(nbytes, run_id)
        roles = [("receiver", receiver_main, C_RX_READY), ("sender", sender_main, C_TX_READY)]
        if t.open_first == "sender":
            roles.reverse()
        for role, target, ready in roles:
            parent_end, child_end = ctx.Pipe(duplex=False)
            pr = ctx.Process(target=_child, args=(target, t, mode, p, ctrl, child_end),
                             name=f"bench-{tcls.key}-{role}", daemon=True)
            pr.start()
            child_end.close()
            procs.append(pr)
            conns[parent_end] = role
            if len(procs) == 1 and t.open_first != "any":
                # Let the first endpoint open before starting the other one.
                t_ready = time.monotonic() + 15
                while not ctrl[ready] and pr.is_alive() and time.monotonic() < t_ready:
                    time.sleep(1e-3)
        deadline = time.monotonic() + p["deadline_s"] + 15
        pending = dict(conns)
        progress, last_seen = time.monotonic(), None
        while pending and time.monotonic() < deadline:
            seen = (int(ctrl[C_LAST_SEQ]), int(ctrl[C_RX_READY]), int(ctrl[C_TX_READY]),
                    int(ctrl[C_TX_DONE]), int(ctrl[C_RX_DONE]))
            if seen != last_seen:
                progress, last_seen = time.monotonic(), seen
            elif time.monotonic() - progress > p["stall_s"]:
                row["stalled"] = f"no progress for {p['stall_s']:.0f} s"
                break
            if trace:
                _trace_step(ctrl, procs, tracers, traced)
            for c in mpc.wait(list(pending), timeout=0.01 if trace else 0.2):
                role = pending.pop(c)
                try:
                    results[role] = c.recv()
                except EOFError:
                    pr = next(x for x in procs if x.name.endswith(role))
                    pr.join(0.5)
                    results[role] = {"error": f"{role} died without a report "
                                              f"(exit code {pr.exitcode})"}
            if pending and any(pr.exitcode not in (None, 0) for pr in procs):
                # A child crashed (e.g. a segfault): give the other a moment, then stop.
                for c in mpc.wait(list(pending), timeout=1.0):
                    role = pending.pop(c)
                    try:
                        results[role] = c.recv()
                    except EOFError:
                        pass
                break
        if pending:
            ctrl[C_ABORT] = 1
            for c in mpc.wait(list(pending), timeout=1.0):
                role = pending.pop(c)
                try:
                    results[role] = c.recv()
                except EOFError:
                    pass
        if tracers:
            _detach_all(ctrl, tracers, traced)
        for pr in procs:
            killed |= _stop(pr)
        rx = results.get("receiver", {})
        tx = results.get("sender", {})
        errs = []
        for role, r in (("receiver", rx), ("sender", tx)):
            if not r:
                code = next((pr.exitcode for pr in procs if role in pr.name), None)
                errs.append(f"{role}: no report (exit code {code})")
            elif "error" in r:
                errs.append(f"{role}: {r['error']}")
        if "stalled" in row:
            errs.insert(0, f"stalled ({row['stalled']}, last seq {last_seen[0]}); killed")
        if errs:
            row["error"] = "; ".join(errs)
            row["tracebacks"] = [r["traceback"] for r in (rx, tx) if "traceback" in r]
        for k in ("received", "drops", "reorder", "bad_len", "rejected", "msgs_per_s",
                  "msgs_per_s_overall", "gb_per_s", "elapsed_s", "latency"):
            if k in rx:
                row[k] = rx[k]
        for k in ("sent", "stalls", "truncated"):
            if k in tx:
                row[k] = tx[k]
        # Sleeps (voluntary context switches) per message at each end, measured phase.
        n_tx, n_rx = max(0, tx.get("sent", 0) - warmup_of(p, mode)), rx.get("received", 0)
        for role, r, n in (("tx", tx, n_tx), ("rx", rx, n_rx)):
            if "switches" in r and n:
                row[f"sleeps_per_msg_{role}"] = round(r["switches"][0] / n, 3)
                if len(r["switches"]) > 2:     # minor page faults of that end
                    row[f"faults_per_msg_{role}"] = round(r["switches"][2] / n, 3)
            if "cpu_measured_s" in r and n:
                # CPU of that end per message, measured phase (user + system).
                row[f"cpu_us_per_msg_{role}"] = round(r["cpu_measured_s"] / n * 1e6, 2)
        if "credit_sleeps" in tx and n_tx:
            # The harness's own waits for credit (window full), per message sent.
            row["credit_sleeps_per_msg"] = round(tx["credit_sleeps"] / n_tx, 3)
        if trace and not errs:
            if set(traced) != {"sender", "receiver"}:
                errs.append("syscall count: the tracer never attached to both children")
            else:
                n_tx = max(0, tx.get("sent", 0) - warmup_of(p, mode))
                row["syscalls"] = {
                    "sender": syscalls.per_message(traced["sender"], n_tx),
                    "receiver": syscalls.per_message(traced["receiver"],
                                                     rx.get("received", 0))}
            if errs:
                row["error"] = "; ".join(errs)
        if "raw_ns" in rx:
            row["_raw_ns"] = rx["raw_ns"]     # kept in memory for aggregation only
        if not errs and rx.get("received", 0) == 0:
            row["error"] = "no messages received"
    except Skip:
        raise
    except Exception as e:  # noqa: BLE001 - setup failures become error rows
        row["error"] = f"{type(e).__name__}: {e}"
        row["tracebacks"] = [traceback.format_exc()]
    finally:
        if tracers:
            try:
                _detach_all(ctrl, tracers, traced)
            except Exception as e:  # noqa: BLE001
                row.setdefault("error", f"syscall count: {e}")
        for pr in procs:
            killed |= _stop(pr)
        for c in conns:
            c.close()
        try:
            t.teardown()
        except Exception as e:  # noqa: BLE001
            row.setdefault("teardown_error", repr(e))
        del ctrl
        shm.close()
    row["killed"] = killed
    wall = time.monotonic() - t0
    row["wall_s"] = round(wall, 3)
    busy1 = busy_cpu_s()
    if busy0 is not None and busy1 is not None and wall > 0.2:
        ours = (cpu_self() - own0) + sum(r.get("cpu_s", 0.0) for r in results.values())
        # CPU burnt by anything but this case's three processes, as a share of the
        # machine: other work running concurrently distorts the numbers.
        row["foreign_cpu_pct"] = round(
            max(0.0, busy1 - busy0 - ours) / (wall * (os.cpu_count() or 1)) * 100, 1)
    return row


def _trace_step(ctrl, procs, tracers: dict, traced: dict) -> None:
    """The parent's side of the tracer handshake (children.py): attach once the sender
    is armed, detach once the receiver is done."""
    if not tracers and not traced and ctrl[C_TX_ARMED] and ctrl[C_RX_READY]:
        for pr in procs:
            role = "sender" if pr.name.endswith("sender") else "receiver"
            tracers[role] = syscalls.Tracer(pr.pid)
        try:
            for t in tracers.values():
                t.attach()
        except syscalls.TracerError:
            _detach_all(ctrl, tracers, {})
            ctrl[C_ABORT] = 1
            raise
        ctrl[C_TRACE] = TRACE_GO
    elif tracers and ctrl[C_RX_END] and ctrl[C_TX_DONE]:
        _detach_all(ctrl, tracers, traced)


def _detach_all(ctrl, tracers: dict, traced: dict) -> None:
    try:
        for role, t in list(tracers.items()):
            traced[role] = t.detach()
    finally:
        tracers.clear()
        ctrl[C_TRACE] = TRACE_STOPPED


def iox2_cleanup() -> None:
    """Remove resources of iceoryx2 nodes that died (killed children), in a child."""
    def work():
        import iceoryx2 as iox2
        iox2.set_log_level(iox2.LogLevel.Fatal)
        node = (iox2.NodeBuilder.new()
                .signal_handling_mode(iox2.SignalHandlingMode.Disabled)
                .create(iox2.ServiceType.Ipc))
        node.try_cleanup_dead_nodes()
    pr = mp.get_context("fork").Process(target=_child, args=(work,), daemon=True)
    pr.start()
    pr.join(10)
    _stop(pr)
