"""`supervisor audit --live --start`: start the configured system, read what each sandbox
really is from /proc and from the supervisor's own state, and compare it with the promise.
(Plain ``--live`` inspects the system that is running instead: running.py; the row
building and comparison below serve both.)

With ``--start`` the audit starts the configured system itself, in this process, exactly as ``supervisor run`` does (`Supervisor.run` under
trio, a quiet event log, no systemd notification, a private temporary state directory
so that a fail-safe during the audit never latches the real one). Once every worker is
READY (the ``all_ready`` event) and a short settle time has passed, evidence is read off
the event loop (watchdogs and exec-watch answers keep running), then the system is
stopped in order (cancel = the same shutdown as SIGTERM).
"""
from __future__ import annotations

import io
import os
import pwd
import tempfile
import traceback
from typing import Any, Callable

from supervisor.config import Config

from . import evidence as ev
from .promise import HOST, NAMESPACES, PRIVATE, strict

# Namespaces each sandbox must have for itself: never the host's, never another's
# (every one bwrap makes: the same tuple as the promise's).
_PER_SANDBOX = NAMESPACES


def _default_factory(cfg: Config, log) -> Any:
    from supervisor.lifecycle import Supervisor
    from supervisor.notify import Notifier

    return Supervisor(cfg, log=log, notifier=Notifier({}))


async def _start_and_collect(cfg: Config, factory, settle_s: float, timeout_s: float,
                             promises: dict[str, dict[str, Any]],
                             progress: Callable[[str], None] = lambda m: None,
                             ) -> tuple[Any, Any, str, dict]:
    import trio

    from supervisor.events import EventLog

    log = EventLog(stream=io.StringIO(), keep=True)
    sup = factory(cfg, log)
    collected: dict[str, Any] = {}
    ended = trio.Event()
    failure: list[BaseException] = []

    async def supervise() -> None:
        try:
            await sup.run()
        except Exception as e:     # reported as the outcome, the audit still answers
            failure.append(e)
        finally:
            ended.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(supervise)
        with trio.move_on_after(timeout_s):
            said = 0.0
            while not ended.is_set() and not log.of("all_ready"):
                await trio.sleep(0.05)
                if trio.current_time() - said >= 2.0:    # a terminal sees it is alive
                    said = trio.current_time()
                    ready = sorted({e["worker"] for e in log.of("ready")})
                    progress(f"waiting for READY: {len(ready)} of {len(cfg.workers)} "
                             f"({', '.join(ready) or 'none yet'})")
        if failure:
            outcome = f"supervisor failed: {_describe(failure[0])}"
        elif log.of("all_ready") and not ended.is_set():
            outcome = "started"
            await trio.sleep(settle_s)
            if ended.is_set():
                outcome = "supervisor stopped during the audit"
            else:
                collected = await trio.to_thread.run_sync(collect, sup, promises)
        elif ended.is_set():
            outcome = "supervisor stopped before all workers were READY"
        else:
            outcome = f"not all workers READY within {timeout_s:g} s"
        nursery.cancel_scope.cancel()
    if failure and outcome == "started":     # the orderly stop itself failed
        collected["stop_error"] = _describe(failure[0])
    return sup, log, outcome, collected


def _describe(e: BaseException) -> str:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    where = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    return f"{type(e).__name__}: {e}" + (f" ({where.filename}:{where.lineno})" if where else "")


def run_live(cfg: Config, promises: dict[str, dict[str, Any]], *,
             factory: Callable[[Config, Any], Any] | None = None,
             settle_s: float = 1.0, timeout_s: float = 180.0,
             progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Start ``cfg``, collect evidence, stop. Returns {"outcome", "exit_code" (of the
    supervisor), "events" (its refusals and exits), "host", "workers": {name: evidence}}."""
    import trio

    saved = os.environ.get("TRIO_STATE_DIR")
    with tempfile.TemporaryDirectory(prefix="trio-audit-") as state:
        os.environ["TRIO_STATE_DIR"] = state
        try:
            sup, log, outcome, collected = trio.run(
                _start_and_collect, cfg, factory or _default_factory, settle_s, timeout_s,
                promises, progress)
        finally:
            if saved is None:
                os.environ.pop("TRIO_STATE_DIR", None)
            else:
                os.environ["TRIO_STATE_DIR"] = saved
    keep = ("refused", "exit", "gave_up", "skipped", "supervisor_exit", "limits_not_enforced",
            "start_failed", "fail_safe", "config_problem")
    events = [{k: v for k, v in e.items() if k not in ("ts", "mono_ns")}
              for e in log.events if e["event"] in keep]
    if outcome != "started":   # what the workers said last: why they did not start
        last: dict[str, list[str]] = {}
        for e in log.of("output"):
            last.setdefault(e.get("worker", "?"), []).append(e.get("line", ""))
        events += [{"event": "output", "worker": w, "lines": lines[-5:]}
                   for w, lines in last.items()]
    cgroups = next((e.get("version") for e in log.of("cgroups")), None)
    return {"outcome": outcome, "exit_code": int(sup.exit_code), "events": events,
            "cgroups": cgroups, "survivors": survivors(collected.get("workers", {})),
            **collected}


def survivors(evidence: dict[str, Any], grace_s: float = 2.0) -> dict[str, list[int]]:
    """Processes of a sandbox still alive after the orderly stop (they must all be
    gone: a supervisor that cannot signal its sandboxes leaves them running)."""
    import time

    from supervisor.admission import maps

    deadline = time.monotonic() + grace_s
    left: dict[str, list[int]] = {}
    while True:
        left = {}
        for name, e in evidence.items():
            for pid, begun in (e.get("start_times") or {}).items():
                try:
                    alive = maps.start_time(int(pid)) == begun
                except (maps.ProcessGone, OSError, ValueError):
                    alive = False
                if alive:
                    left.setdefault(name, []).append(int(pid))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


# --------------------------------------------------------------------------- collection


def host_namespaces() -> dict[str, dict[str, int | None]]:
    """The supervisor's own namespaces and, when readable, the host's (pid 1's): a
    sandbox must share none of them (under systemd the supervisor itself may already
    have private ones)."""
    out = {"supervisor": ev.namespaces("self")}
    try:
        init = ev.namespaces(1)
    except ev.Gone:
        init = {}
    if any(v is not None for v in init.values()):
        out["init"] = init
    return out


def _evidence_of(sup, run, promise: dict[str, Any], candidates: list[str]) -> dict[str, Any]:
    """`_worker_evidence`, read as the sandbox's host user when this process cannot
    read other users' /proc itself (no CAP_SYS_PTRACE: a unit with a smaller bounding
    set, see supervisor/audit/asuser.py)."""
    from . import asuser

    if run.proc is None or run.pid is None or asuser.can_read_any_proc():
        return _worker_evidence(sup, run, promise, candidates)
    try:
        uid, gid = asuser.host_ids(run.pid)
    except OSError:
        uid = 0
    if uid == 0:
        return _worker_evidence(sup, run, promise, candidates)
    return asuser.as_host_user(uid, gid, _worker_evidence, sup, run, promise, candidates)


def collect(sup, promises: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Evidence for every worker of a running supervisor (call off the event loop)."""
    candidates = ev.compiler_candidates()
    workers: dict[str, Any] = {}
    for name, run in list(sup.runs.items()):
        for _attempt in range(3):
            try:
                workers[name] = _evidence_of(sup, run, promises.get(name, {}), candidates)
                break
            except ev.Gone:
                workers[name] = {"running": False, "why": "exited while being read"}
        # warm standbys: more sandboxes of the same worker (oldest first)
        standbys = list(getattr(run, "standbys", None) or
                        ([run.standby] if getattr(run, "standby", None) else []))
        for standby in standbys if workers[name].get("running") else []:
            try:
                sb = _evidence_of(sup, standby, promises.get(name, {}), candidates)
            except ev.Gone:
                sb = {"running": False, "why": "exited while being read"}
            if sb.get("running"):
                workers[name].setdefault("standbys", []).append(sb)
                workers[name].setdefault("standby", sb)
    own = ev.status("self")
    return {"host": host_namespaces(), "workers": workers,
            "compiler_candidates": candidates,
            # filters every sandbox inherits from the supervisor (systemd's, under the unit)
            "inherited_seccomp_filters": int(own.get("Seccomp_filters") or 0)}


def _worker_evidence(sup, run, promise: dict[str, Any], candidates: list[str]) -> dict[str, Any]:
    from supervisor.admission import maps

    if run.proc is None or run.proc.poll() is not None or run.refused:
        return {"running": False, "why": run.refused or run.exit_reason or "not running"}
    pids = sup.worker_pids(run)
    pid = sup._worker_pid(run)
    if pid == run.pid and sup.sandboxed:
        return {"running": False, "why": "sandbox has no worker process (yet)"}
    try:
        begun = maps.start_time(pid)
    except maps.ProcessGone as e:
        raise ev.Gone(pid) from e
    st = ev.status(pid)
    entries = ev.maps(pid)
    known = ev.segments_of("self")      # this process is the supervisor: its segments
    out: dict[str, Any] = {
        "running": True,
        "pid": pid,
        "sandbox_pids": [run.pid, *pids],
        "status": {k: st.get(k) for k in ("Uid", "Gid", "NoNewPrivs", "Seccomp",
                                          "Seccomp_filters", *ev._CAP_FIELDS)},
        "uid_map": ev.id_map(pid, "uid"),
        "gid_map": ev.id_map(pid, "gid"),
        "namespaces": ev.namespaces(pid),
        "interfaces": ev.interfaces(pid),
        "nofile": list(ev.nofile(pid)),
        "scheduling": ev.scheduling(pid),
        "exec_mappings": ev.exec_mappings(entries),
        "channel_mappings": ev.channel_mappings(entries, known),
        "channel_fds": ev.channel_fds(pid, known),
        "compilers": ev.compiler_probe(pid, candidates),
        "exec_watch": {"listener_held": run.watch is not None,
                       "closed_at_ready": bool(run.watch is not None and run.watch.ready),
                       "ready_snapshot": len(run.exec_snapshot) if run.exec_snapshot else None},
    }
    try:
        hits = maps.scan_pid(pid)
        snap = run.exec_snapshot
        later = maps.scan_pid(pid, snapshot=snap) if snap is not None and snap.pid == pid else []
    except maps.ProcessGone as e:
        raise ev.Gone(pid) from e
    out["forbidden_libraries"] = [h.describe() for h in hits]
    out["after_ready_hits"] = [h.describe() for h in later if h.kind != maps.KIND_FORBIDDEN]
    cg = run.cgroup
    if cg is not None:
        try:
            force = cg.in_force()
            force["member"] = pid in cg.pids()
        except OSError as e:
            force = {"error": str(e)}
        out["cgroup"] = force
    else:
        out["cgroup"] = None
    out["models"] = [{"artifact": m.get("artifact"),
                      "manifest_sha256": ev.file_sha256_in_root(
                          pid, os.path.join(m["artifact"], "manifest.json"))
                      if m.get("artifact") else None,
                      "pubkey_sha256": ev.file_sha256_in_root(pid, m["pubkey"])
                      if m.get("pubkey") else None}
                     for m in promise.get("models", [])]
    if maps.start_time(pid) != begun:
        raise ev.Gone(pid)         # restarted meanwhile: read the new one
    starts = {}
    for p in out["sandbox_pids"]:
        try:
            starts[str(p)] = maps.start_time(p)
        except (maps.ProcessGone, OSError):
            pass
    out["start_times"] = starts
    return out


# --------------------------------------------------------------------------- observed rows


def _host_sha(path: str | None) -> str | None:
    import hashlib

    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def observed_row(promise: dict[str, Any], e: dict[str, Any] | None,
                 host: dict[str, dict[str, int | None]], events: list[dict],
                 inherited_filters: int = 0) -> dict[str, Any]:
    """The same keys as the promise, filled from evidence (None where nothing was seen)."""
    name = promise["worker"]
    refusals = [x for x in events if x["event"] == "refused" and x.get("worker") == name]
    row: dict[str, Any] = {k: promise[k] for k in ("worker", "domain", "profile", "optional")}
    row["running"] = bool(e and e.get("running"))
    row["pid"] = e.get("pid") if e else None
    if not row["running"]:
        row["why_not_running"] = (e or {}).get("why") or (
            refusals[-1].get("reason") if refusals else "not started")
        row["admission"] = {"checked": True, "admitted": not refusals,
                            "chains": [c for x in refusals
                                       for c in (x.get("chains") or [x.get("reason", "")])]}
        return row
    st = e["status"]
    uid = int(st["Uid"].split()[1])
    gid = int(st["Gid"].split()[1])
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = None
    row["host"] = {"user": user, "uid": uid, "gid": gid}
    host_inos = {ns: {v.get(ns) for v in host.values()} - {None} for ns in NAMESPACES}
    row["namespaces"] = {ns: (None if ino is None else HOST if ino in host_inos[ns] else PRIVATE)
                         for ns, ino in e["namespaces"].items()}
    row["network"] = row["namespaces"].get("net") == HOST or any(
        i != "lo" for i in e["interfaces"])
    row["compilers_visible"] = any(v == "executable" for v in e["compilers"].values())
    mode = {"0": "disabled", "1": "strict", "2": "filter"}.get(st.get("Seccomp") or "", "?")
    # the sandbox's own filters: those above what it inherited from the supervisor
    filters = max(0, int(st.get("Seccomp_filters") or 0) - inherited_filters)
    promised_launch = 1 if (promise["seccomp"].get("launch") is not None) else 0
    exec_ban = mode == "filter" and filters >= promised_launch + 2
    row["exec_after_start"] = not exec_ban
    watch = e["exec_watch"]
    row["new_exec_memory_after_ready"] = not (watch["listener_held"] and watch["closed_at_ready"]) \
        or bool(e["after_ready_hits"])
    row["jit_kernels"] = any(m["backing"] == "anonymous" for m in e["exec_mappings"])
    if filters == 0 and mode == "filter":
        mode = "inherited only"
    row["seccomp"] = {"mode": mode, "filters": filters, "inherited": inherited_filters}
    row["no_new_privs"] = st.get("NoNewPrivs") == "1"
    row["capabilities"] = {label: ev.capability_names(st[field] or "0")
                           for field, label in ev._CAP_FIELDS.items()}
    cg = e.get("cgroup") or {}
    quota, period = cg.get("cpu_quota_us"), cg.get("cpu_period_us")
    row["limits"] = {
        "memory_max": cg.get("memory_max"),
        "pids_max": cg.get("pids_max"),
        "cpu_quota_pct": round(quota * 100 / period, 3) if quota and period else None,
        "cpu_weight": cg.get("cpu_weight"),
        "nofile": e["nofile"][0],
        "enforced_by": (f"cgroup v{cg['version']}" if cg.get("version") and cg.get("member")
                        else "nothing (no cgroup)"),
    }
    row["scheduling"] = dict(e["scheduling"], rt_budget_pct=cg.get("rt_budget_pct"))
    writes, reads = [], []
    fds = e["channel_fds"]
    for ch, m in sorted(e["channel_mappings"].items()):
        modes = m["data"]
        writable = any("w" in p for p in modes) or "O_RDWR" in fds.get(ch, {}).get("data", [])
        item = {"channel": ch, "access": "read-write" if writable else "read-only",
                "mapped": modes, "fds": fds.get(ch, {}).get("data", []),
                "leases": m["leases"]}
        (writes if writable else reads).append(item)
    for ch, f in sorted(fds.items()):   # open but not mapped
        if ch not in e["channel_mappings"]:
            writable = "O_RDWR" in f["data"] or "O_WRONLY" in f["data"]
            item = {"channel": ch, "access": "read-write" if writable else "read-only",
                    "mapped": [], "fds": f["data"], "leases": {}}
            (writes if writable else reads).append(item)
    row["channels"] = {"writes": writes, "reads": reads}
    models = []
    for want, seen in zip(promise.get("models", []), e.get("models", [])):
        models.append({"artifact": want.get("artifact"),
                       "manifest_sha256": seen["manifest_sha256"],
                       "same_as_audited": (seen["manifest_sha256"] is not None
                                           and seen["manifest_sha256"] == want.get("manifest_sha256")
                                           and seen["pubkey_sha256"] == _host_sha(want.get("pubkey")))})
    row["models"] = models
    row["torch"] = "mapped" if e["forbidden_libraries"] else "absent"
    row["admission"] = {"checked": True, "admitted": not refusals and not (
        strict(promise["profile"]) and e["forbidden_libraries"]),
        "chains": [c for x in refusals for c in (x.get("chains") or [x.get("reason", "")])]
        + (e["forbidden_libraries"] if strict(promise["profile"]) else [])}
    return row


# --------------------------------------------------------------------------- comparison


def differences(promise: dict[str, Any], seen: dict[str, Any],
                e: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every way the observed row differs from the promised one."""
    name = promise["worker"]
    out: list[dict[str, Any]] = []

    def diff(key: str, expected: Any, observed: Any, detail: str) -> None:
        out.append({"worker": name, "key": key, "expected": expected, "observed": observed,
                    "detail": detail})

    if not seen["running"]:
        if promise["admission"].get("admitted") is False and promise["optional"]:
            return out     # refused by admission and optional: not running is the promise
        diff("running", True, False, f"{name} is not running: {seen.get('why_not_running')}")
        return out
    ph, sh = promise["host"], seen["host"]
    if sh["uid"] == 0 or sh["gid"] == 0:
        diff("host.uid", ph["uid"], sh["uid"], f"{name} runs as host root (uid {sh['uid']}, "
             f"gid {sh['gid']}), not as {ph['user']}")
    elif (ph["uid"], ph["gid"]) != (sh["uid"], sh["gid"]):
        diff("host.uid", ph["uid"], sh["uid"], f"{name} runs as host uid/gid "
             f"{sh['uid']}/{sh['gid']} ({sh['user']}), the config says {ph['user']} "
             f"({ph['uid']}/{ph['gid']})")
    for ns in NAMESPACES:
        want, got = promise["namespaces"][ns], seen["namespaces"].get(ns)
        if got is not None and want != got:
            diff(f"namespaces.{ns}", want, got, f"{name}'s {ns} namespace is "
                 f"{'the host' if got == HOST else 'its own'}'s; the config promises "
                 f"{'the host' if want == HOST else 'its own'}'s".replace("its own's", "its own"))
    if promise["network"] != seen["network"]:
        ifaces = ", ".join(e["interfaces"]) if e else "?"
        diff("network", promise["network"], seen["network"],
             f"{name} {'has' if seen['network'] else 'has no'} network (interfaces: {ifaces}); "
             f"the config says {'yes' if promise['network'] else 'no'}")
    if promise["compilers_visible"] != seen["compilers_visible"]:
        runnable = [p for p, v in (e or {}).get("compilers", {}).items() if v == "executable"]
        diff("compilers_visible", promise["compilers_visible"], seen["compilers_visible"],
             f"compilers resolve to executables inside {name}: {', '.join(runnable)}"
             if runnable else f"no compiler resolves inside {name}, the config allows them")
    for key, what in (("exec_after_start", "exec after start"),
                      ("new_exec_memory_after_ready", "new executable memory after READY")):
        if promise[key] != seen[key]:
            diff(key, promise[key], seen[key], f"{name}: {what} is "
                 f"{'possible' if seen[key] else 'denied'}; the config says "
                 f"{'allowed' if promise[key] else 'denied'}"
                 + (f" (seccomp {seen['seccomp']['mode']}, {seen['seccomp']['filters']} filters)"
                    if key == "exec_after_start" else
                    f" ({'; '.join(e['after_ready_hits'])})" if e and e['after_ready_hits'] else ""))
    if seen["jit_kernels"] and not promise["jit_kernels"]:
        diff("jit_kernels", False, True, f"{name} has anonymous executable memory but is not "
             "declared jit_kernels")
    ps, ss = promise["seccomp"], seen["seccomp"]
    if ps["mode"] != ss["mode"] or ps["filters"] != ss["filters"]:
        diff("seccomp", {"mode": ps["mode"], "filters": ps["filters"]},
             {"mode": ss["mode"], "filters": ss["filters"]},
             f"{name}: seccomp {ss['mode']} with {ss['filters']} filter(s); the config "
             f"promises {ps['mode']} with {ps['filters']}")
    if promise["no_new_privs"] != seen["no_new_privs"]:
        diff("no_new_privs", True, seen["no_new_privs"], f"{name}: NoNewPrivs is not set")
    for label, caps in seen["capabilities"].items():
        if caps != promise["capabilities"].get(label, []):
            diff(f"capabilities.{label}", promise["capabilities"].get(label, []), caps,
                 f"{name} holds {label} capabilities: {', '.join(caps)}")
    pl, sl = promise["limits"], seen["limits"]
    for key in ("memory_max", "pids_max", "cpu_quota_pct", "cpu_weight"):
        want, got = pl[key], sl[key]
        if key == "memory_max" and want is not None and got is not None:
            same = abs(want - got) < 4096       # the kernel rounds to pages
        elif key == "cpu_quota_pct" and want is not None and got is not None:
            same = abs(want - got) < 0.01
        else:
            same = want == got
        if not same:
            unset = "not set" if key == "cpu_weight" else "unlimited"
            diff(f"limits.{key}", want, got, f"{name}: {key} in force is "
                 f"{unset if got is None else got}, the config says "
                 f"{unset if want is None else want} ({sl['enforced_by']})")
    psch, ssch = promise["scheduling"], seen["scheduling"]
    if (psch["policy"], psch["priority"], psch["reset_on_fork"]) != (
            ssch["policy"], ssch["priority"], ssch["reset_on_fork"]):
        diff("scheduling", psch, ssch, f"{name}: main thread runs {ssch['policy']} "
             f"{ssch['priority']} (reset_on_fork {ssch['reset_on_fork']}), the config says "
             f"{psch['policy']} {psch['priority']}")
    if psch["rt_budget_pct"] is not None and ssch["rt_budget_pct"] not in (
            None, psch["rt_budget_pct"]):      # None: no RT groups, the global bound only
        diff("scheduling.rt_budget_pct", psch["rt_budget_pct"], ssch["rt_budget_pct"],
             f"{name}: RT budget in force is {ssch['rt_budget_pct']} %, the config says "
             f"{psch['rt_budget_pct']} %")
    if pl["nofile"] is not None and sl["nofile"] != pl["nofile"]:
        diff("limits.nofile", pl["nofile"], sl["nofile"], f"{name}: open-file limit "
             f"{sl['nofile']}, the config says {pl['nofile']}")
    # channels: nothing mapped writable that the config only lets it read; nothing it
    # does not use at all; its writes mapped writable.
    pw = {c["channel"] for c in promise["channels"]["writes"]}
    pr = {c["channel"] for c in promise["channels"]["reads"]}
    for item in seen["channels"]["writes"]:
        ch = item["channel"]
        if ch not in pw:
            diff(f"channels.{ch}", "read-only" if ch in pr else "not used", "read-write",
                 f"{name} maps channel {ch} writable ({', '.join(item['mapped'] or item['fds'])})"
                 + (" but only reads it" if ch in pr else " but does not use it"))
    for item in seen["channels"]["reads"]:
        ch = item["channel"]
        if ch not in pr and ch not in pw:
            diff(f"channels.{ch}", "not used", "read-only",
                 f"{name} maps channel {ch} but does not use it")
        elif ch in pw and item["mapped"]:
            diff(f"channels.{ch}", "read-write", "read-only",
                 f"{name} writes channel {ch} but maps it read-only")
    for item in seen["channels"]["writes"] + seen["channels"]["reads"]:
        ch = item["channel"]
        if ch in pw:
            bad = [i for i, perms in item["leases"].items() if any("w" in p for p in perms)]
            if bad:
                diff(f"channels.{ch}.leases", "read-only", "read-write",
                     f"{name}, the writer of {ch}, maps reader lease table(s) "
                     f"{', '.join(bad)} writable")
    for want, got in zip(promise.get("models", []), seen.get("models", [])):
        if not got["same_as_audited"]:
            diff("models", want.get("manifest_sha256"), got["manifest_sha256"],
                 f"{name} does not see the audited artifact {want.get('artifact')} "
                 "(or its public key) at the same path")
    if strict(promise["profile"]) and seen["torch"] == "mapped":
        diff("torch", "refused", "mapped", f"{name} maps torch: "
             + "; ".join(e["forbidden_libraries"][:3] if e else []))
    return out


def shared_namespaces(evidence: dict[str, Any]) -> list[dict[str, Any]]:
    """Namespaces two sandboxes have in common (each must have its own)."""
    out = []
    owners: dict[tuple[str, int], str] = {}
    for name, e in evidence.items():
        if not e.get("running"):
            continue
        for ns in _PER_SANDBOX:
            ino = e["namespaces"].get(ns)
            if ino is None:
                continue
            other = owners.setdefault((ns, ino), name)
            if other != name:
                out.append({"worker": name, "key": f"namespaces.{ns}", "expected": "its own",
                            "observed": f"shared with {other}",
                            "detail": f"{name} shares its {ns} namespace (inode {ino}) "
                                      f"with {other}"})
    return out
