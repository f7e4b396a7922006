"""What runs as root, and why (issue 27): one row per supervisor process.

Today's install is one root supervisor (`units.UNIT_NAME`) that also reads everything
the sandboxes write. With the split units (supervisor/broker, docs/broker.md) the root
part is the broker alone, with a fixed vocabulary, and the supervisor proper runs as
`units.SUPERVISOR_USER` with no capabilities. The audit says which of the two is in use
and how it knows (`split_in_use`): the process a live audit finds holding the
sandboxes, or else the broker's unit installed under /etc/systemd/system. Capabilities and exposure come from
supervisor/units.py, the code that writes the units, not from a copy here."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from supervisor.config import Config

UNIT_DIR = Path("/etc/systemd/system")

# What needs root, in the broker's words (docs/broker.md's request table). The single
# supervisor of today needs the same, and reads hostile input besides.
ROOT_WORK = (
    "cgroups: creates the tree and one leaf per sandbox, kills and removes them",
    "sandbox start as each domain's host user (setuid/setgid, the staging mount namespace)",
    "/proc of the sandboxes: maps, mem, pagemap, mountinfo, fd/N and map_files opened for "
    "the exec watch and the maps scan; SIGSTOP/SIGCONT of a worker's threads while judged",
    "signals to, and reaping of, the sandboxes it started",
    "the fail-safe latch in the 0700 root state dir",
)
PROPER_WORK = ("config, lifecycle, worker pipes and status lines, events, the exec-watch "
               "judgement, admission and maps scans, replay, the monitor")


def _score(points: dict[str, str], weight: int) -> float:
    """systemd-analyze security's score of the items a units.py dict names
    (ceil(100 * sum / weight) / 10, as units.py documents it)."""
    total = sum(int(v.split(":", 1)[0]) for v in points.values())
    return math.ceil(100 * total / weight) / 10


def split_in_use(running: dict[str, Any] | None = None,
                 unit_dir: Path = UNIT_DIR) -> tuple[bool, str]:
    """(split, how it was found). A live audit knows the process that holds the
    sandboxes (running.py: their parent); otherwise an installed broker unit says so. A
    broker some test or developer started by hand is not the install's, and is not
    looked for."""
    from supervisor import units

    argv = (running or {}).get("argv") or []
    if running is not None:
        if "supervisor.broker" in argv:
            return True, f"the sandboxes' parent is a broker (pid {running.get('pid')})"
        return False, f"the sandboxes' parent is a root supervisor (pid {running.get('pid')})"
    if (unit_dir / units.BROKER_UNIT).exists():
        return True, f"{unit_dir / units.BROKER_UNIT} is installed"
    return False, f"no {units.BROKER_UNIT} in {unit_dir}"


def privilege(cfg: Config, *, split: bool | None = None, running: dict[str, Any] | None = None,
              unit_dir: Path = UNIT_DIR) -> dict[str, Any]:
    """{split, found, processes: [{process, unit, user, root, capabilities, exposure,
    reads_hostile_input, why}]}."""
    from supervisor import units

    found = "given"
    if split is None:
        split, found = split_in_use(running, unit_dir)
    realtime = any(w.realtime_priority is not None for w in cfg.workers.values())
    caps = [*units.CAPABILITIES, *([units.REALTIME_CAPABILITY] if realtime else [])]
    why = list(ROOT_WORK) + (["SCHED_FIFO for real-time workers (CAP_SYS_NICE)"]
                             if realtime else [])
    root_exposure = _score(units.EXPOSURE, 56135)
    if not split:
        rows = [{"process": "supervisor", "unit": units.UNIT_NAME, "user": "root",
                 "root": True, "capabilities": caps, "exposure": root_exposure,
                 "reads_hostile_input": True,
                 "why": why + [f"and in the same process: {PROPER_WORK}"]}]
    else:
        rows = [{"process": "broker", "unit": units.BROKER_UNIT, "user": "root",
                 "root": True, "capabilities": caps, "exposure": root_exposure,
                 "reads_hostile_input": False,
                 "why": why + ["nothing else: a fixed Cap'n Proto vocabulary, each request "
                               "checked against the config it loaded itself"]},
                {"process": "supervisor proper", "unit": units.PROPER_UNIT,
                 "user": units.SUPERVISOR_USER, "root": False, "capabilities": [],
                 "exposure": _score(units.PROPER_EXPOSURE, 56435),
                 "reads_hostile_input": True, "why": [PROPER_WORK]}]
    return {"split": split, "found": found, "processes": rows}


def md_lines(report: dict[str, Any]) -> list[str]:
    p = report.get("privilege")
    if not p:
        return []
    lines = ["## What runs as root", "",
             ("Split units: the broker alone is root; the supervisor proper has no "
              "capabilities." if p["split"] else
              "One root supervisor (the broker split, issue 27, is not in use).")
             + f" Found: {p['found']}.", ""]
    # Six columns at most (the report's tables stay readable); the reasons follow.
    head = ["process", "unit", "user", "capabilities", "exposure", "reads hostile input"]
    rows = [[r["process"], r["unit"], r["user"], ", ".join(r["capabilities"]) or "none",
             f"{r['exposure']:.1f}", "yes" if r["reads_hostile_input"] else "no"]
            for r in p["processes"]]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    for r in p["processes"]:
        lines += ["", f"Why the {r['process']} {'is root' if r['root'] else 'runs'}:", ""]
        lines += [f"- {w}" for w in r["why"]]
    return lines + [""]


def text_lines(report: dict[str, Any]) -> list[str]:
    p = report.get("privilege")
    if not p:
        return []
    lines = ["", f"What runs as root ({'split units' if p['split'] else 'one root supervisor'}; "
                 f"{p['found']}):"]
    for r in p["processes"]:
        lines.append(f"  {r['process']} ({r['unit']}): user {r['user']}, capabilities "
                     f"{', '.join(r['capabilities']) or 'none'}, exposure "
                     f"{r['exposure']:.1f}, reads hostile input: "
                     f"{'yes' if r['reads_hostile_input'] else 'no'}")
        lines += [f"    - {w}" for w in r["why"]]
    return lines
