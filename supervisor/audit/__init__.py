"""``supervisor audit``: what each worker can and cannot do, for a safety reviewer who
signs it (docs/review.md). The command line is command.py's:

    supervisor audit [--config F] [--format text|markdown|json] [--output F] [--sign KEY]
    supervisor audit --live [--pid PID] [--config F] [--format ...]
    supervisor audit --live --start [--config F] [--settle S] [--timeout S]
    supervisor audit diff OLD.json NEW.json [--format ...]      (diff.py; exit 6 weakened)
    supervisor audit verify REPORT SIG PUBKEY                    (sign.py)

Without ``--live`` the report says what the config *promises*, derived from the code
that enforces it: the sandbox policy (`Supervisor._policy` ->
`supervisor.sandbox.policy`) and the bwrap command line built from it (fsview.py), the
seccomp filters as `supervisor.sandbox.seccomp` builds them (syscalls.py), the cgroup
limits, the channels and the IPC mechanisms between them (paths.py), the restart and
fail-safe policy (failure.py), the signed model artifacts a worker loads (their
manifests read and signatures checked with the key the worker trusts) and the static
torch admission (`supervisor.admission.check_worker`, as ``Supervisor.admit`` runs it).
Provenance and the verdict come first (sections.py, review.py).

With ``--live`` it reads the system that is RUNNING (running.py): the supervisor is
found through /proc as the parent of its bwrap sandboxes, each sandbox is read from the
outside (/proc of its worker, its cgroup, its fds against the handles bwrap was given),
nothing is started, signalled or written, and every difference from the promise is
flagged, each interference path's fds and mappings included (pathcheck.py), each
filesystem view against the mount table. Root is needed, as for ``run``.

With ``--live --start`` it STARTS the configured system itself, in this process,
exactly as ``supervisor run`` would (every worker of the config, including any that
talks to the vehicle: refused while a vehicle supervisor runs), waits until every
worker is READY, reads each worker's sandbox from the outside (/proc of its host pid,
its cgroup, the supervisor's exec-watch state), stops the system in order and flags
every difference from the promise. A fail-safe during the audit is latched in a private
temporary state directory, never in the real one.

Exit codes of ``supervisor audit``:

    0  config mode: the report was produced; --live: the running system matches the config
    6  --live: differences were found (listed in the report); diff: isolation weakened
    1  a user's mistake (one line), internal error, a signature that does not verify,
       or --live --start could not start the system for another reason
    2  config error (as ``supervisor run``)
    3, 4, 5  --live --start: the supervisor stopped before all workers were READY with that exit
       status (3 admission refused a required worker, 4 fail-safe, 5 a required worker
       never became ready)

JSON (``--format json``), schema_version 1. Keys are only ever added within a
schema_version; a renamed or removed key or a changed meaning bumps it.

    schema_version   1
    mode             "config" | "live"
    config           the config's source (path or "<embedded ...>")
    result           "promise" (config mode) | "matches" | "differences" | "not-started"
    exit_code        the exit status the command returns (above)
    workers          one row per worker, declaration order (keys below); in live mode the
                     row holds what was observed, with the raw readings under "evidence"
    promised         (live only) the config-mode rows, for comparison
    differences      list of {worker, key, expected, observed, detail}; key names the row
                     field ("namespaces.net", "host.uid", "channels.frames", "limits.pids_max",
                     "seccomp", "capabilities.effective", "torch", "running", ...);
                     always [] in config mode
    channels         the channel matrix: {channel, writer, writer_domain, readers: [{worker,
                     log_only}], shadow, research_data (why it counts as research data, or
                     null), payload, actuation, feeds_actuation: [actuation channels it is
                     upstream of], kind, dtype, slot_size, slot_count, crc, max_age_ms,
                     lease_ms, max_readers}
    trust            {rules: [the safety rules as supervisor/config.py documents them],
                     check_trust: its summary, actuation_paths: [{actuation, channels,
                     workers, domains, research_data_upstream}], research_data: {channel:
                     why}, log_only_reads: [{worker, channel, research_data}],
                     actuating_domains, holds, supervisor_mode: "vehicle" or
                     "simulation" (recorded frames/time may reach control)}
    supervisor       (live only) {outcome, exit_code, events: the supervisor's refused/
                     exit/gave_up/skipped/... events (and, when it did not start, each
                     worker's last output lines), cgroups: cgroup version or null,
                     survivors: {worker: [host pids]} still alive after the stop,
                     stop_error: why the orderly stop failed, or null}
    host_namespaces  (live only) {"supervisor": {ns: inode}, "init": {ns: inode}}
    provenance       {time_utc, host, kernel, distribution, package: {name, version},
                     git: {commit ("not a checkout"), dirty}, config: {source, sha256},
                     artifacts: [{worker, artifact, manifest_sha256, key_id, signature,
                     name, version}], python, libraries: {name: version}, tools}
    verdict          {holds, reasons: [why not], counts: {workers, domains, channels,
                     paths, cross_domain_paths, supervisor_paths, into_actuating,
                     seccomp_classes, killed: {class: n}, differences}, into_actuating:
                     [{id, kind, writer, reader, bound}]}
    interference_paths  [{id, kind, channel, from, to, direction, crosses, writer,
                     reader, carries, worst, bound, live}] (paths.py)
    failure          [{worker, domain, restart, restart_text, budget: {max_restarts,
                     window_s}, backoff_ms: {initial, max}, backoff_text, cooldown_s,
                     watchdog_ms, ready_timeout_ms, warm_standby, optional,
                     failure_policy, on_give_up, actuation_meanwhile}] (failure.py)
    filesystem       {worker: {mounts: [{path, what, access, source, size}], masked
                     (compilers), hidden (/proc counters, empty inside),
                     whiteouts: {dir: [names]}, writable, error}} (fsview.py)
    syscalls         {classes: {key: {domains, launch, runtime, exec_watch, network,
                     default, killed, errno: {name: errno}, notified, conditional:
                     [{syscall, action, errno, when, stage}], after_ready: [...],
                     allowed, table_size}}, by_domain: {domain: key}, error}
    live_paths       (--live on a running system) [{path, check, observed, ok}]
    privilege        what runs as root and why (privilege.py): {split, found (how the
                     audit knows), processes: [{process, unit, user, root, capabilities,
                     exposure, reads_hostile_input, why: [...]}]}
    running          (--live on a running system) {pid, argv, config, sandboxes}

Worker row (config mode = promise; live mode = observation, same keys):

    worker, domain, profile, optional
    running, pid                 live only: the worker's host pid (inside its sandbox)
    policy_error                 config only: why no sandbox policy could be built, or null
    host                         {user, uid, gid}: the unprivileged host user it runs as
    namespaces                   {user, pid, ipc, uts, cgroup, mnt, net: "private" | "host"}
    network                      bool: reaches a network (net namespace is the host's, or
                                 an interface other than lo exists)
    compilers_visible            bool: a compiler/assembler/linker resolves to an
                                 executable file inside the sandbox (masked = char device)
    exec_after_start             bool: execve (or a new process) possible once the runner
                                 locked down (strict profiles: no, seccomp kills execve
                                 and refuses fork). Live: inferred from the
                                 number of stacked seccomp filters
    new_exec_memory_after_ready  bool: new executable memory after READY (strict: no, the
                                 exec watch refuses it). Live: the supervisor holds the
                                 watch listener and closed it at READY, and nothing
                                 executable appeared since the READY snapshot
    jit_kernels                  config: anonymous code allowed before READY; live: anonymous
                                 executable memory present
    seccomp                      config: {mode, filters, launch: {kill, eperm, enosys},
                                 after_start_kill, exec_watch}; live: {mode, filters,
                                 inherited} from /proc/PID/status Seccomp and
                                 Seccomp_filters: filters counts the sandbox's own, above
                                 the `inherited` ones the supervisor itself runs under
                                 (systemd's, under the unit)
    no_new_privs                 bool
    capabilities                 {effective, permitted, inheritable, ambient, bounding}:
                                 lists of capability names (all empty: bwrap --cap-drop ALL)
    limits                       {memory_max (bytes), pids_max, cpu_quota_pct, cpu_weight
                                 (cgroup cpu.weight; v1 cpu.shares x 100 / 1024), nofile}; null
                                 = unlimited / inherited; live adds enforced_by
    scheduling                   {policy ("fifo" | "other" ...), priority, reset_on_fork,
                                 rt_budget_pct, busy_poll_us (config only)}: the main
                                 thread from READY on; live reads
                                 sched_getscheduler and the cgroup's cpu.rt_runtime_us
                                 (null: no per-cgroup RT budget, the global limit only)
    channels                     {writes: [{channel, access}], reads: [{channel, shadow,
                                 log_only, access}]}; access "read-write" | "read-only";
                                 live items add mapped (perms of the segment's mappings),
                                 fds (access modes of its fds) and leases
    models                       config: [{model (its [models.NAME], when it names one),
                                 artifact, pubkey, name, version, key_id, signature,
                                 manifest_sha256, expect_name, expect_version,
                                 min_version (the no-rollback floor; null if none)}];
                                 live: [{artifact, manifest_sha256 as seen inside,
                                 same_as_audited}]
    torch                        config: "refused" | "allowed"; live: "mapped" | "absent"
    admission                    {checked, admitted, chains: [refusal chains]}
    standby                      live only, for a worker with a warm standby: the
                                 standby sandbox's observed row (same keys, no channels
                                 expected); its differences have keys "standby.<key>"
    evidence                     live only: the raw readings (status lines, uid/gid maps,
                                 namespace inodes, interfaces, cgroup limits in force,
                                 executable mappings and their backing, channel mappings
                                 and fds, compiler probes, exec-watch state, maps scan)
"""
from __future__ import annotations

from typing import Any, Callable

from supervisor.config import Config
from supervisor.exits import Exit

from .render import render

__all__ = ["EXIT_DIFFERENCES", "EXIT_MATCH", "SCHEMA_VERSION", "audit", "render"]

SCHEMA_VERSION = 1
EXIT_MATCH = 0
EXIT_DIFFERENCES = int(Exit.DIFFERS)


def audit(cfg: Config, *, live: bool = False, factory: Callable[[Config, Any], Any] | None = None,
          settle_s: float = 1.0, timeout_s: float = 180.0, running: Any = None,
          progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The audit report (a JSON-ready dict, schema above). With ``running`` (a
    `running.RunningSupervisor`) --live reads that system, read-only; without it --live
    starts its own (``--start``). ``factory(cfg, log)`` makes the Supervisor for the
    latter (tests pass a subclass that breaks isolation on purpose)."""
    from . import promise as pr

    say = progress or (lambda msg: None)
    report: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "mode": "live" if live else "config",
                              "config": cfg.source}
    if live:
        say("deriving the promise from the config")
        promised = [pr.worker_row(cfg, w) for w in cfg.workers.values()]
        got = _collect(cfg, promised, running, factory, settle_s, timeout_s, say)
        _admission_at_start(promised, got)
        rows, diffs = _observed(promised, got)
        diffs += _stop_differences(got)
        if running is not None and got["outcome"] == "started":
            diffs += _running_checks(cfg, report, got, running, say)
        if got["outcome"] != "started":
            result, code = "not-started", got["exit_code"] or 1
        elif diffs:
            result, code = "differences", EXIT_DIFFERENCES
        else:
            result, code = "matches", EXIT_MATCH
        report.update(result=result, exit_code=code, workers=rows, promised=promised,
                      differences=diffs,
                      supervisor={k: got.get(k) for k in ("outcome", "exit_code", "events",
                                                          "cgroups", "survivors", "stop_error")},
                      host_namespaces=got.get("host"))
    else:
        admitted = pr.admission(cfg)
        rows = [pr.worker_row(cfg, w, admitted=admitted[w.name])
                for w in cfg.workers.values()]
        report.update(result="promise", exit_code=EXIT_MATCH, workers=rows, differences=[])
    report["channels"] = pr.channel_rows(cfg)
    report["trust"] = pr.trust_rules(cfg)
    from .sections import add_sections

    say("adding the reviewer's sections")
    report = add_sections(report, cfg)
    if running is not None:
        # What the supervisor was started with, and what it was audited against (they
        # differ when --config names another file: then the differences say how).
        report["running"] = {"pid": running.pid, "argv": running.argv,
                             "config": running.config or "<embedded default>",
                             "config_audited": cfg.source,
                             "sandboxes": len(running.sandboxes)}
    from .privilege import privilege

    # What runs as root: --live --start runs the system in this (root) process.
    import os

    from .privilege import differences as privilege_differences
    report["privilege"] = privilege(cfg, running=report.get("running"),
                                    split=False if live and running is None else None,
                                    pid=(running.pid if running is not None else os.getpid())
                                    if live else None)
    if live and running is None:
        report["privilege"]["found"] = "the audit started the system itself, as root"
    if live:
        more = privilege_differences(report["privilege"])
        if more:
            report["differences"] = report.get("differences", []) + more
            if report.get("result") == "matches":
                report.update(result="differences", exit_code=EXIT_DIFFERENCES)
    return report


def _collect(cfg: Config, promised: list[dict[str, Any]], running: Any, factory,
             settle_s: float, timeout_s: float, say: Callable[[str], None]) -> dict[str, Any]:
    """Evidence: read off the running supervisor, or from a system started for it."""
    from . import live as lv

    promises = {r["worker"]: r for r in promised}
    if running is not None:
        from . import running as rn

        return rn.collect(running, promises, say)
    say("starting the configured system (--start)")
    return lv.run_live(cfg, promises, factory=factory, settle_s=settle_s,
                       timeout_s=timeout_s, progress=say)


def _admission_at_start(promised: list[dict[str, Any]], got: dict[str, Any]) -> None:
    """Admission as the supervisor ran it at start (its refusal events)."""
    static = {e["worker"]: e for e in got["events"]
              if e["event"] == "refused" and "kind" not in e and e.get("worker")}
    for r in promised:
        e = static.get(r["worker"])
        r["admission"] = {"checked": got["outcome"] == "started" or bool(static),
                          "admitted": e is None,
                          "chains": list(e.get("chains") or [e.get("reason", "")]) if e else []}


def _observed(promised: list[dict[str, Any]],
              got: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The observed rows (standbys included) and every difference from the promise."""
    from . import live as lv
    from . import promise as pr

    evidence = got.get("workers", {})
    started = got["outcome"] == "started"
    rows, diffs = [], []
    for p in promised:
        e = evidence.get(p["worker"])
        seen = lv.observed_row(p, e, got.get("host", {}), got["events"],
                               got.get("inherited_seccomp_filters", 0))
        seen["evidence"] = e
        rows.append(seen)
        if started:
            diffs += lv.differences(p, seen, e)
        standbys = (e or {}).get("standbys") or ([e["standby"]] if e and e.get("standby")
                                                  else [])
        if started and standbys:
            checked = [_standby_row(p, e_sb, got) for e_sb in standbys]
            seen["standby"] = checked[0][0]
            seen["standbys"] = [row for row, _ in checked]
            diffs += [d for _, ds in checked for d in ds]
    if started:   # each sandbox its own namespaces (unless promised the host's)
        by_name = {p["worker"]: p for p in promised}
        diffs += [d for d in lv.shared_namespaces(evidence)
                  if d["worker"] in by_name and by_name[d["worker"]]["namespaces"]
                  [d["key"].split(".", 1)[1]] != pr.HOST]
    return rows, diffs


def _stop_differences(got: dict[str, Any]) -> list[dict[str, Any]]:
    """--start: the orderly stop failed, or sandbox processes outlived it."""
    out = []
    if got.get("stop_error"):
        out.append({"worker": None, "key": "stop", "expected": "orderly stop",
                    "observed": got["stop_error"],
                    "detail": f"the supervisor's orderly stop failed: {got['stop_error']}"})
    for name, pids in got.get("survivors", {}).items():
        out.append({"worker": name, "key": "stop", "expected": "stopped",
                    "observed": pids, "detail": f"{name}: sandbox process(es) "
                    f"{', '.join(map(str, pids))} still running after the orderly stop"})
    return out


def _standby_row(p: dict[str, Any], e_sb: dict[str, Any],
                 got: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A warm standby: the same sandbox as its worker, but no channel until it takes
    over, and the normal class (a real-time grant comes at its READY too), and W^X
    is locked at READY, which a standby has not reached."""
    from . import live as lv
    from . import promise as pr

    sec = dict(p["seccomp"], filters=p["seccomp"]["filters"]
               - (1 if p["seccomp"].get("wx_from_ready") else 0))
    p_sb = dict(p, channels={"writes": [], "reads": []}, seccomp=sec,
                scheduling=dict(p["scheduling"], policy="other", priority=0,
                                reset_on_fork=False, rt_budget_pct=None))
    seen_sb = lv.observed_row(p_sb, e_sb, got.get("host", {}), [],
                              got.get("inherited_seccomp_filters", 0))
    row = {k: seen_sb[k] for k in seen_sb if k not in ("worker", "domain", "profile",
                                                        "optional")}
    # Still in start-up (READY comes at take-over): its exec window is open by design;
    # the exec watch must be installed all the same.
    diffs = [d for d in lv.differences(p_sb, seen_sb, e_sb)
             if d["key"] != "new_exec_memory_after_ready"]
    if pr.strict(p["profile"]) and not e_sb["exec_watch"]["listener_held"]:
        diffs.append({"worker": p["worker"], "key": "new_exec_memory_after_ready",
                      "expected": False, "observed": True,
                      "detail": f"{p['worker']}: no exec watch installed"})
    return row, [dict(d, key=f"standby.{d['key']}", detail=f"(standby pid {e_sb.get('pid')}) "
                      f"{d['detail']}") for d in diffs]


def _running_checks(cfg: Config, report: dict[str, Any], got: dict[str, Any], running: Any,
                    say: Callable[[str], None]) -> list[dict[str, Any]]:
    """What only a running system shows: each interference path's fds and mappings,
    each filesystem view against its mount table, the inherited open-file limit."""
    from . import fsview, pathcheck, paths

    say("checking interference paths and filesystem views")
    state = pathcheck.state_dir_of(cfg, running.state_dir)
    rows, diffs = pathcheck.check_paths(cfg, paths.interference_paths(cfg), got, state)
    report["live_paths"] = rows
    for name, e in (got.get("workers") or {}).items():
        if not e.get("running"):
            continue
        view = fsview.view_of(cfg, cfg.workers[name])
        diffs += fsview.compare(name, view, e.get("mounts") or {})
        want = cfg.workers[name].nofile
        own = (got.get("supervisor_nofile") or [None])[0]
        if want is None and own is not None and e["nofile"][0] != own:
            diffs.append({"worker": name, "key": "limits.nofile",
                          "expected": f"inherited ({own})", "observed": e["nofile"][0],
                          "detail": f"{name}: open-file limit {e['nofile'][0]}; the config "
                                    f"says inherited, the supervisor's own is {own}"})
    return diffs
