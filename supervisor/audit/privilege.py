"""What runs as root, and why (issue 27): one row per supervisor process.

Today's install is one root supervisor (`units.UNIT_NAME`) that also reads everything
the sandboxes write. With the split units (supervisor/broker, docs/broker.md) the root
part is the broker alone, with a fixed vocabulary, and the supervisor proper runs as
`units.SUPERVISOR_USER` with no capabilities. The audit says which of the two is in use
and how it knows (`split_in_use`): the process a live audit finds holding the
sandboxes, or else the broker's unit installed under /etc/systemd/system. Capabilities and exposure come from
supervisor/units.py, the code that writes the units, not from a copy here."""
from __future__ import annotations

import functools
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
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


@dataclass(frozen=True)
class UnitScore:
    """A unit's exposure as the reviewer signs it, and which unit text it is of."""
    exposure: float
    source: str                  # how the number was found
    unit_sha256: str | None      # of the unit text `supervisor units` renders


_RENDER = {"trio-supervisor.service": "render", "trio-broker.service": "render_broker",
           "trio-supervisor-proper.service": "render_proper"}


def unit_score(cfg: Config, unit: str, table: dict[str, str], weight: int) -> UnitScore:
    """The exposure of the unit `supervisor units` renders for ``cfg``, measured by
    `systemd-analyze security --offline` where it is installed (gate 9 finding 5: the
    report signed units.py's hand-kept table, 3.3, while the unit scored 3.6), else
    the table's sum, said so; with the rendered text's sha256 (what `--live` compares
    the installed unit with)."""
    from supervisor import units

    fallback = _score(table, weight)
    try:
        src = cfg.source if cfg.source and not cfg.source.startswith("<") else None
        text = getattr(units, _RENDER[unit])(cfg, config_path=src)
    except Exception as e:              # a config no unit is rendered for: the table
        return UnitScore(fallback, f"units.py's EXPOSURE table (no unit rendered: "
                                   f"{type(e).__name__}: {e})", None)
    digest = hashlib.sha256(text.encode()).hexdigest()
    measured = _measure(text, unit)
    if measured is None:
        return UnitScore(fallback, "units.py's EXPOSURE table (systemd-analyze security "
                                   "--offline is not available here)", digest)
    return UnitScore(measured, "systemd-analyze security --offline of the unit "
                               "`supervisor units` renders", digest)


@functools.lru_cache(maxsize=8)
def _measure(text: str, unit: str) -> float | None:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory(prefix="audit-unit-") as d:
        path = os.path.join(d, unit)
        Path(path).write_text(text)
        try:
            r = subprocess.run([exe, "security", "--offline=true", path],
                               capture_output=True, text=True, timeout=60,
                               stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return None
    for line in r.stdout.splitlines():
        if "Overall exposure level" in line:
            try:
                return float(line.split(":", 1)[1].split()[0])
            except (IndexError, ValueError):
                return None
    return None


def installed_unit(unit: str, rendered_sha256: str | None,
                   unit_dir: Path = UNIT_DIR) -> str:
    """Whether the unit installed here is the text the exposure is of (a live audit:
    an operator's edit of the installed unit changes what runs, not the report)."""
    path = unit_dir / unit
    try:
        here = hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return f"{path}: not installed"
    except OSError as e:
        return f"{path}: unreadable ({e.strerror or e})"
    if rendered_sha256 is None:
        return f"{path}: sha256 {here} (no rendered unit to compare with)"
    if here == rendered_sha256:
        return f"{path}: the rendered unit (sha256 {here})"
    return (f"{path}: sha256 {here}, not the rendered unit's {rendered_sha256} (edited, "
            f"or rendered with another --prefix/--python/--config): its exposure is not "
            f"the one above")


# Capability numbers as the kernel counts them (linux/capability.h), for CapEff & co.
CAP_NAMES = tuple(f"CAP_{n}" for n in (
    "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP "
    "LINUX_IMMUTABLE NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER "
    "SYS_MODULE SYS_RAWIO SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE "
    "SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP "
    "MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF "
    "CHECKPOINT_RESTORE").split())


def caps_of(mask: int) -> list[str]:
    return [CAP_NAMES[i] if i < len(CAP_NAMES) else f"CAP_{i}"
            for i in range(mask.bit_length()) if mask >> i & 1]


def held(pid: int) -> dict[str, Any] | None:
    """What process ``pid`` holds, from /proc/PID/status and its cgroup: uids,
    effective and bounding capabilities, no_new_privs (None if it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cgroup = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None
    f = {k: v.strip() for k, _, v in (x.partition(":") for x in status.splitlines())}
    eff, bnd = int(f.get("CapEff", "0"), 16), int(f.get("CapBnd", "0"), 16)
    return {"pid": pid, "uid": [int(x) for x in f.get("Uid", "").split()],
            "CapEff": f"{eff:016x}", "CapBnd": f"{bnd:016x}",
            "no_new_privs": f.get("NoNewPrivs") == "1",
            "effective": caps_of(eff), "bounding": caps_of(bnd),
            "cgroup": cgroup.strip().splitlines()[-1].partition("::")[2] if cgroup else ""}


def _read_process(row: dict[str, Any], unit_caps: list[str], pid: int, how: str) -> None:
    """A live row lists what the process holds (gate 9 finding 12: it listed the unit's
    table, 7, of a supervisor holding 40); the unit's table stays beside it, and what
    goes beyond it is judged where the unit is what started the process."""
    got = held(pid)
    if got is None:
        row["process_read"] = f"pid {pid}: gone before /proc/{pid}/status was read"
        return
    under = f"/{row['unit']}" in got["cgroup"]
    row.update(capabilities=got["effective"], capabilities_unit=unit_caps,
               beyond_unit=[c for c in got["effective"] if c not in unit_caps],
               under_unit=under, process_read=dict(got, how=how))


def differences(p: dict[str, Any]) -> list[dict[str, Any]]:
    """A live audit's differences of 'What runs as root': a process its unit started
    that holds a capability beyond the unit's table (an edited or removed
    CapabilityBoundingSet=). One started from a shell is bound by no unit: its
    capabilities are listed, not judged."""
    out = []
    for r in p.get("processes", []):
        if r.get("beyond_unit") and r.get("under_unit"):
            pid = (r.get("process_read") or {}).get("pid")
            out.append({"worker": None, "key": "privilege.capabilities",
                        "expected": r.get("capabilities_unit"), "observed": r["capabilities"],
                        "detail": f"the {r['process']} (pid {pid}, {r['unit']}) holds "
                                  f"{len(r['beyond_unit'])} capabilities beyond its unit's "
                                  f"table: {', '.join(r['beyond_unit'])}"})
    return out


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
              unit_dir: Path = UNIT_DIR, pid: int | None = None) -> dict[str, Any]:
    """{split, found, processes: [{process, unit, user, root, capabilities, exposure,
    reads_hostile_input, why}]}. With ``pid`` (a live audit: the running supervisor or
    broker, or this process when it started the system), the root row's capabilities
    are that process's (CapEff), beside the unit's table (capabilities_unit)."""
    from supervisor import units

    found = "given"
    if split is None:
        split, found = split_in_use(running, unit_dir)
    realtime = any(w.realtime_priority is not None for w in cfg.workers.values())
    caps = [*units.CAPABILITIES, *([units.REALTIME_CAPABILITY] if realtime else [])]
    why = list(ROOT_WORK) + (["SCHED_FIFO for real-time workers (CAP_SYS_NICE)"]
                             if realtime else [])
    def scored(unit: str, table: dict[str, str], weight: int) -> dict[str, Any]:
        sc = unit_score(cfg, unit, table, weight)
        row = {"exposure": sc.exposure, "exposure_source": sc.source,
               "unit_sha256": sc.unit_sha256}
        if running is not None:
            row["installed_unit"] = installed_unit(unit, sc.unit_sha256, unit_dir)
        return row

    if not split:
        rows = [{"process": "supervisor", "unit": units.UNIT_NAME, "user": "root",
                 "root": True, "capabilities": caps,
                 **scored(units.UNIT_NAME, units.EXPOSURE, 56135),
                 "reads_hostile_input": True,
                 "why": why + [f"and in the same process: {PROPER_WORK}"]}]
    else:
        rows = [{"process": "broker", "unit": units.BROKER_UNIT, "user": "root",
                 "root": True, "capabilities": caps,
                 **scored(units.BROKER_UNIT, units.EXPOSURE, 56135),
                 "reads_hostile_input": False,
                 "why": why + ["nothing else: a fixed Cap'n Proto vocabulary, each request "
                               "checked against the config it loaded itself"]},
                {"process": "supervisor proper", "unit": units.PROPER_UNIT,
                 "user": units.SUPERVISOR_USER, "root": False, "capabilities": [],
                 **scored(units.PROPER_UNIT, units.PROPER_EXPOSURE, 56435),
                 "reads_hostile_input": True, "why": [PROPER_WORK]}]
    if pid is not None and rows[0]["root"]:
        _read_process(rows[0], caps, pid, "the running supervisor" if running is not None
                      else "this process: the audit started the system itself")
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
    def named(r: dict[str, Any]) -> str:
        beyond = set(r.get("beyond_unit") or [])
        return ", ".join(f"!!{c}" if c in beyond else c for c in r["capabilities"]) or "none"
    rows = [[r["process"], r["unit"], r["user"], named(r),
             f"{r['exposure']:.1f}", "yes" if r["reads_hostile_input"] else "no"]
            for r in p["processes"]]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    for r in p["processes"]:
        if r.get("exposure_source"):
            lines += ["", f"Exposure of {r['unit']}: {r['exposure_source']}"
                      + (f" (unit text sha256 {r['unit_sha256']})" if r.get("unit_sha256")
                         else "") + "."]
        if r.get("installed_unit"):
            lines += ["", f"Installed: {r['installed_unit']}."]
        lines += _held_lines(r, "")
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
        if r.get("exposure_source"):
            lines.append(f"    exposure: {r['exposure_source']}"
                         + (f", unit sha256 {r['unit_sha256']}" if r.get("unit_sha256")
                            else ""))
        if r.get("installed_unit"):
            lines.append(f"    installed: {r['installed_unit']}")
        lines += [f"    {x}" for x in _held_lines(r, "") if x]
        lines += [f"    - {w}" for w in r["why"]]
    return lines


def _held_lines(r: dict[str, Any], pad: str) -> list[str]:
    got = r.get("process_read")
    if not got:
        return []
    if isinstance(got, str):
        return ["", f"{pad}Read: {got}."]
    beyond = r.get("beyond_unit") or []
    judged = ("a difference: its unit started it" if r.get("under_unit") else
              f"not judged: not started by {r['unit']} (cgroup {got.get('cgroup')}), so "
              f"no unit bounds it")
    return ["", f"{pad}Read from /proc/{got['pid']}/status ({got['how']}): uid "
                f"{'/'.join(map(str, got['uid']))}, CapEff {got['CapEff']} "
                f"({len(r['capabilities'])} capabilities), CapBnd {got['CapBnd']}, "
                f"NoNewPrivs {'1' if got['no_new_privs'] else '0'}; the unit's table: "
                f"{', '.join(r.get('capabilities_unit') or []) or 'none'}"
                + (f"; beyond it (!!): {len(beyond)}, {judged}" if beyond else "") + "."]
