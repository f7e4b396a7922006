"""``audit diff OLD.json NEW.json``: what changed in isolation between two reports (two
configs, two releases, the promise and a live run), each change judged weakened,
tightened or changed. Exit 6 when anything weakened.

Compared: each worker's row (namespaces, network, compilers, exec, seccomp, privileges,
limits, channels, torch, host user), its failure behaviour, its filesystem view (mounts
and their access, masked compilers, whiteouts), the syscall policy of its domain's class
(a syscall that stops being killed, or becomes allowed, weakens), the interference paths
(a new path weakens, a gone one tightens) and the trust verdict. Provenance (time, host,
commit, the install's project root) is shown when it differs, never judged; paths under
each report's project root are compared relative to it, so one code installed at two
paths is no change in isolation.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable

WEAKENED, TIGHTENED, CHANGED = "weakened", "tightened", "changed"

# Row booleans where True is the looser value.
_LOOSE_WHEN_TRUE = ("network", "compilers_visible", "exec_after_start",
                    "new_exec_memory_after_ready", "jit_kernels")
# Limits where None is unlimited and more is looser (cpu_weight: see _weight).
_LIMITS = ("memory_max", "pids_max", "cpu_quota_pct", "nofile")


@dataclass(frozen=True)
class Change:
    section: str
    subject: str       # worker, channel, path id, class, "trust", ...
    key: str
    old: Any
    new: Any
    effect: str

    def line(self) -> str:
        a, b = _pair(self.old, self.new)
        return f"{self.effect.upper():9} {self.section}: {self.subject}: {self.key}: {a} -> {b}"


def _pair(old: Any, new: Any) -> tuple[str, str]:
    """Both sides short; two long texts cut around where they differ (cut at their
    start, two long texts that differ late both read the same '...')."""
    if not (isinstance(old, str) and isinstance(new, str)) or max(len(old), len(new)) <= 120:
        return _short(old), _short(new)
    i = 0
    while i < min(len(old), len(new)) and old[i] == new[i]:
        i += 1
    j = 0
    while j < min(len(old), len(new)) - i and old[-1 - j] == new[-1 - j]:
        j += 1
    start = max(0, i - 30)

    def cut(s: str) -> str:
        mid = s[start:len(s) - j]
        mid = mid if len(mid) <= 100 else mid[:97] + "..."
        return ("..." if start else "") + mid + ("..." if j else "")
    return cut(old), cut(new)


def _short(v: Any) -> str:
    if v is None:
        return "absent"
    s = json.dumps(v, default=str) if not isinstance(v, str) else v
    return s if len(s) <= 120 else s[:117] + "..."


class ReportError(Exception):
    """A file that is not an audit report: one line for the user."""


def load(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            r = json.load(f)
    except OSError as e:
        raise ReportError(f"{path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ReportError(f"{path}: not JSON ({e}); make it with `audit --format json`") from None
    if not isinstance(r, dict) or "workers" not in r or "schema_version" not in r:
        raise ReportError(f"{path}: not an audit report (no schema_version/workers)")
    from . import SCHEMA_VERSION

    # Another schema's keys may mean other things: compared as this one, a newer report
    # read as every worker removed, "80 tightened", and judged isolation on that.
    if r["schema_version"] != SCHEMA_VERSION:
        raise ReportError(f"{path}: audit report schema_version {r['schema_version']!r}; "
                          f"this supervisor compares version {SCHEMA_VERSION} (regenerate "
                          f"it with this version's `audit --format json`)")
    if not isinstance(r["workers"], list) or not r["workers"]:
        raise ReportError(f"{path}: an audit report of no workers: nothing to compare")
    return r


def _more(old: Any, new: Any) -> str:
    """For a limit where None is unlimited: is new looser than old?"""
    if old == new:
        return ""
    if new is None:
        return WEAKENED
    if old is None:
        return TIGHTENED
    return WEAKENED if new > old else TIGHTENED


def _rows(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    # A live report's rows are observations; compare promises with promises.
    return {w["worker"]: w for w in (r.get("promised") or r["workers"])}


def _worker_changes(name: str, o: dict[str, Any], n: dict[str, Any]) -> list[Change]:
    out: list[Change] = []

    def add(key: str, old: Any, new: Any, effect: str) -> None:
        out.append(Change("worker", name, key, old, new, effect))

    for ns, v in (n.get("namespaces") or {}).items():
        ov = (o.get("namespaces") or {}).get(ns)
        if ov != v:
            add(f"namespaces.{ns}", ov, v, WEAKENED if v == "host" else TIGHTENED)
    for k in _LOOSE_WHEN_TRUE:
        if o.get(k) != n.get(k):
            add(k, o.get(k), n.get(k), WEAKENED if n.get(k) else TIGHTENED)
    if o.get("no_new_privs") != n.get("no_new_privs"):
        add("no_new_privs", o.get("no_new_privs"), n.get("no_new_privs"),
            WEAKENED if not n.get("no_new_privs") else TIGHTENED)
    for label, caps in (n.get("capabilities") or {}).items():
        old = set((o.get("capabilities") or {}).get(label, []))
        if set(caps) != old:
            add(f"capabilities.{label}", sorted(old), sorted(caps),
                WEAKENED if set(caps) - old else TIGHTENED)
    os_, ns_ = o.get("seccomp") or {}, n.get("seccomp") or {}
    if os_.get("filters") != ns_.get("filters"):
        add("seccomp.filters", os_.get("filters"), ns_.get("filters"),
            WEAKENED if (ns_.get("filters") or 0) < (os_.get("filters") or 0) else TIGHTENED)
    ol, nl = o.get("limits") or {}, n.get("limits") or {}
    for k in _LIMITS:
        eff = _more(ol.get(k), nl.get(k))
        if eff:
            add(f"limits.{k}", ol.get(k), nl.get(k), eff)
    if ol.get("cpu_weight") != nl.get("cpu_weight"):
        # A research worker weighing more takes more from control; a control worker
        # weighing less gets less.
        up = (nl.get("cpu_weight") or 0) > (ol.get("cpu_weight") or 0)
        strict = n.get("profile") != "research"
        add("limits.cpu_weight", ol.get("cpu_weight"), nl.get("cpu_weight"),
            (TIGHTENED if up else WEAKENED) if strict else (WEAKENED if up else TIGHTENED))
    for side in ("writes", "reads"):
        old = {c["channel"] for c in (o.get("channels") or {}).get(side, [])}
        new = {c["channel"] for c in (n.get("channels") or {}).get(side, [])}
        for c in sorted(new - old):
            add(f"channels.{side}", None, c, WEAKENED)
        for c in sorted(old - new):
            add(f"channels.{side}", c, None, TIGHTENED)
    if o.get("torch") != n.get("torch"):
        add("torch", o.get("torch"), n.get("torch"),
            WEAKENED if n.get("torch") in ("allowed", "mapped") else TIGHTENED)
    osch, nsch = o.get("scheduling") or {}, n.get("scheduling") or {}
    if (osch.get("policy"), osch.get("priority")) != (nsch.get("policy"), nsch.get("priority")):
        # A control worker that loses real-time priority (or gets less) can be starved
        # by research again; a research worker that gains it can starve control.
        rt_old = osch.get("priority") or 0 if osch.get("policy") in ("fifo", "rr") else 0
        rt_new = nsch.get("priority") or 0 if nsch.get("policy") in ("fifo", "rr") else 0
        if rt_old == rt_new:
            eff = CHANGED
        elif n.get("profile") == "research":
            eff = WEAKENED if rt_new > rt_old else TIGHTENED
        else:
            eff = WEAKENED if rt_new < rt_old else TIGHTENED
        add("scheduling", f"{osch.get('policy')} {osch.get('priority')}",
            f"{nsch.get('policy')} {nsch.get('priority')}", eff)
    oh, nh = o.get("host") or {}, n.get("host") or {}
    if (oh.get("user"), oh.get("uid")) != (nh.get("user"), nh.get("uid")):
        add("host", oh, nh, WEAKENED if nh.get("uid") == 0 else CHANGED)
    return out


def _failure_changes(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    out = []
    o = {f["worker"]: f for f in old.get("failure") or []}
    for f in new.get("failure") or []:
        p = o.get(f["worker"])
        if p is None:
            continue
        if p["failure_policy"] != f["failure_policy"]:
            out.append(Change("failure", f["worker"], "failure_policy", p["failure_policy"],
                              f["failure_policy"], WEAKENED if p["failure_policy"] ==
                              "fail_safe" else TIGHTENED))
        eff = _more(p["watchdog_ms"], f["watchdog_ms"])
        if eff:
            out.append(Change("failure", f["worker"], "watchdog_ms", p["watchdog_ms"],
                              f["watchdog_ms"], eff))
        if p.get("warm_standby") and not f.get("warm_standby") and f["domain"] == "control":
            # The standby's socket goes (a path fewer), but a control worker's failure
            # then waits for a cold start: what actuation gets meanwhile is weaker.
            out.append(Change("failure", f["worker"], "warm_standby", True, False, WEAKENED))
        if p["actuation_meanwhile"] != f["actuation_meanwhile"]:
            out.append(Change("failure", f["worker"], "actuation_meanwhile",
                              p["actuation_meanwhile"], f["actuation_meanwhile"], CHANGED))
    return out


PROJECT = "<project>"     # the project root, whichever install a report was made at


def project_root(r: dict[str, Any]) -> str | None:
    """The install a report was made at: its provenance's ``project_root``, or (a report
    made before it was recorded) the parent of its installed packages' code trees."""
    from .provenance import INSTALLED

    prov = r.get("provenance") or {}
    if prov.get("project_root"):
        return str(prov["project_root"])
    for t in prov.get("code_trees") or []:
        if t.get("domain") == INSTALLED and t.get("path"):
            return os.path.dirname(str(t["path"]))
    return None


def _placer(root: str | None) -> Callable[[str], str]:
    """A path as the same place at any install: under the project root, relative to it
    (review 7 finding 2: the same code at two install paths diffed as 35 binds gone and
    35 new, "ISOLATION WEAKENED"); anything else as it is."""
    def place(path: str) -> str:
        if root and root != "/" and (path == root or path.startswith(root + "/")):
            return PROJECT + path[len(root):]
        return path
    return place


def _fs_changes(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    out = []
    po, pn = _placer(project_root(old)), _placer(project_root(new))
    for name, v in (new.get("filesystem") or {}).items():
        p = (old.get("filesystem") or {}).get(name)
        if p is None:
            continue
        # Keyed by place, named by the new report's path (the old one's when gone).
        om = {po(m["path"]): m for m in p.get("mounts", [])}
        nm = {pn(m["path"]): m for m in v.get("mounts", [])}
        for key in nm.keys() - om.keys():
            out.append(Change("filesystem", name, nm[key]["path"], None,
                              f"{nm[key]['what']} {nm[key]['access']}", WEAKENED))
        for key in om.keys() - nm.keys():
            out.append(Change("filesystem", name, om[key]["path"],
                              f"{om[key]['what']} {om[key]['access']}", None, TIGHTENED))
        for key in nm.keys() & om.keys():
            path = nm[key]["path"]
            a, b = om[key]["access"], nm[key]["access"]
            if a != b:
                out.append(Change("filesystem", name, path, a, b,
                                  WEAKENED if b == "rw" else TIGHTENED))
            eff = _more(om[key].get("size"), nm[key].get("size")) if nm[key]["what"] == \
                "tmpfs" else ""
            if eff:
                out.append(Change("filesystem", name, f"{path} size", om[key].get("size"),
                                  nm[key].get("size"), eff))
        # (an older report kept the /proc counters under "masked": compared as one set)
        omask = {po(x): x for x in p.get("masked", []) + p.get("hidden", [])}
        nmask = {pn(x): x for x in v.get("masked", []) + v.get("hidden", [])}
        for key in sorted(omask.keys() - nmask.keys()):
            out.append(Change("filesystem", name, _masked_kind(omask[key]), omask[key], None,
                              WEAKENED))
        for key in sorted(nmask.keys() - omask.keys()):
            out.append(Change("filesystem", name, _masked_kind(nmask[key]), None, nmask[key],
                              TIGHTENED))
        ow = {(po(d), x) for d, xs in (p.get("whiteouts") or {}).items() for x in xs}
        nw = {(pn(d), x) for d, xs in (v.get("whiteouts") or {}).items() for x in xs}
        for d, x in sorted(ow - nw):
            out.append(Change("filesystem", name, f"whiteout in {d}", x, None, WEAKENED))
        for d, x in sorted(nw - ow):
            out.append(Change("filesystem", name, f"whiteout in {d}", None, x, TIGHTENED))
    return sorted(out, key=lambda c: (c.subject, c.key))


def _action_of(c: dict[str, Any], name: str) -> str:
    if name in c["killed"]:
        return "kill"
    if name in c["errno"]:
        return c["errno"][name]
    if name in c["notified"] and name not in c["allowed"]:
        return "notify"
    if any(r["syscall"] == name for r in c.get("conditional", [])):
        return "conditional"
    return "allow"


_ORDER = {"kill": 4, "conditional": 3, "notify": 1, "allow": 0}


def _syscall_changes(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    out = []
    oc = (old.get("syscalls") or {}).get("classes") or {}
    nc = (new.get("syscalls") or {}).get("classes") or {}
    ob = (old.get("syscalls") or {}).get("by_domain") or {}
    for domain, key in ((new.get("syscalls") or {}).get("by_domain") or {}).items():
        if domain not in ob or ob[domain] not in oc or key not in nc:
            continue
        a, b = oc[ob[domain]], nc[key]
        names = sorted(set(a["allowed"]) | set(b["allowed"]) | set(a["killed"])
                       | set(b["killed"]) | set(a["errno"]) | set(b["errno"])
                       | {r["syscall"] for r in a.get("conditional", []) + b.get("conditional", [])}
                       | set(a["notified"]) | set(b["notified"]))
        for n in names:
            x, y = _action_of(a, n), _action_of(b, n)
            if x == y:
                if x == "conditional":
                    wa = sorted(r["when"] + r["action"] for r in a["conditional"] if r["syscall"] == n)
                    wb = sorted(r["when"] + r["action"] for r in b["conditional"] if r["syscall"] == n)
                    if wa != wb:
                        out.append(Change("syscalls", domain, n, len(wa), len(wb),
                                          WEAKENED if len(wb) < len(wa) else CHANGED))
                continue
            rx, ry = _ORDER.get(x, 2), _ORDER.get(y, 2)
            out.append(Change("syscalls", domain, n, x, y,
                              WEAKENED if ry < rx else TIGHTENED if ry > rx else CHANGED))
        oa = {r["syscall"] + r["when"] for r in a.get("after_ready", [])}
        na = {r["syscall"] + r["when"] for r in b.get("after_ready", [])}
        for r in sorted(oa - na):
            out.append(Change("syscalls", domain, "from READY", r, None, WEAKENED))
        for r in sorted(na - oa):
            out.append(Change("syscalls", domain, "from READY", None, r, TIGHTENED))
    return out


def _path_changes(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    o = {p["id"]: p for p in old.get("interference_paths") or []}
    n = {p["id"]: p for p in new.get("interference_paths") or []}
    out = [Change("paths", i, "added", None, f"{n[i]['direction']}: {n[i]['kind']}", WEAKENED)
           for i in n.keys() - o.keys()]
    out += [Change("paths", i, "removed", f"{o[i]['direction']}: {o[i]['kind']}", None,
                   TIGHTENED) for i in o.keys() - n.keys()]
    for i in n.keys() & o.keys():
        for k in ("direction", "worst", "bound"):
            if o[i][k] != n[i][k]:
                out.append(Change("paths", i, k, o[i][k], n[i][k], CHANGED))
    return sorted(out, key=lambda c: c.subject)


def _channel_changes(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    out = []
    o = {c["channel"]: c for c in old.get("channels") or []}
    for c in new.get("channels") or []:
        p = o.get(c["channel"])
        if p is None:
            continue
        if p["crc"] != c["crc"]:
            out.append(Change("channels", c["channel"], "crc", p["crc"], c["crc"],
                              WEAKENED if not c["crc"] else TIGHTENED))
        eff = _more(p["max_age_ms"] or None, c["max_age_ms"] or None)
        if eff:
            out.append(Change("channels", c["channel"], "max_age_ms", p["max_age_ms"],
                              c["max_age_ms"], eff))
        eff = _more(p["lease_ms"], c["lease_ms"])
        if eff:
            out.append(Change("channels", c["channel"], "lease_ms", p["lease_ms"],
                              c["lease_ms"], eff))
        if p["research_data"] != c["research_data"]:
            out.append(Change("channels", c["channel"], "research_data", p["research_data"],
                              c["research_data"], CHANGED))
    return out


def compare(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """{changes: [...], weakened, tightened, changed, exit_code}."""
    changes: list[Change] = []
    ow, nw = _rows(old), _rows(new)
    for name in nw.keys() - ow.keys():
        changes.append(Change("worker", name, "added", None, nw[name].get("domain"), CHANGED))
    for name in ow.keys() - nw.keys():
        changes.append(Change("worker", name, "removed", ow[name].get("domain"), None, CHANGED))
    for name in nw:
        if name in ow:
            changes += _worker_changes(name, ow[name], nw[name])
    changes += _failure_changes(old, new) + _fs_changes(old, new)
    changes += _syscall_changes(old, new) + _path_changes(old, new)
    changes += _channel_changes(old, new)
    ot, nt = old.get("trust") or {}, new.get("trust") or {}
    if ot.get("holds") != nt.get("holds"):
        changes.append(Change("trust", "rules", "holds", ot.get("holds"), nt.get("holds"),
                              WEAKENED if not nt.get("holds") else TIGHTENED))
    # A live report: differences between the running system and its config that the
    # old report did not have are a weakening of what actually runs.
    od, nd = len(old.get("differences") or []), len(new.get("differences") or [])
    if od != nd:
        changes.append(Change("live", "differences", "count", od, nd,
                              WEAKENED if nd > od else TIGHTENED))
    counts = {e: sum(1 for c in changes if c.effect == e) for e in (WEAKENED, TIGHTENED, CHANGED)}
    prov = {}
    for k in ("time_utc", "host", "kernel", "git", "config"):
        a, b = (old.get("provenance") or {}).get(k), (new.get("provenance") or {}).get(k)
        if a != b:
            prov[k] = {"old": a, "new": b}
    if project_root(old) != project_root(new):
        # A note, never judged: its paths were compared relative to each install.
        prov["project_root"] = {"old": project_root(old), "new": project_root(new)}
    from . import EXIT_DIFFERENCES

    return {"old": old.get("config"), "new": new.get("config"), "provenance": prov,
            "changes": [asdict(c) for c in changes], **counts,
            "exit_code": EXIT_DIFFERENCES if counts[WEAKENED] else 0}


def render(d: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(d, indent=2, default=str) + "\n"
    changes = [Change(**c) for c in d["changes"]]
    verdict = (f"{d[WEAKENED]} weakened, {d[TIGHTENED]} tightened, {d[CHANGED]} changed"
               + (": ISOLATION WEAKENED" if d[WEAKENED] else ""))
    if fmt == "text":
        lines = [f"audit diff {d['old']} -> {d['new']}: {verdict}"]
        lines += [f"  {c.line()}" for c in sorted(changes, key=_rank)]
        lines += [f"  provenance {k}: {_short(v['old'])} -> {_short(v['new'])}"
                  for k, v in d["provenance"].items()]
        return "\n".join(lines) + "\n"
    if fmt == "markdown":
        lines = [f"# Audit diff: {d['old']} -> {d['new']}", "", f"**{verdict}.**", ""]
        if changes:
            lines += ["| effect | section | subject | what | old | new |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {'**weakened**' if c.effect == WEAKENED else c.effect} | {c.section} "
                      f"| {c.subject} | {c.key} | {_md_pair(c.old, c.new)} |"
                      for c in sorted(changes, key=_rank)]
        if d["provenance"]:
            lines += ["", "Provenance differs: " + "; ".join(
                f"{k}: {_short(v['old'])} -> {_short(v['new'])}" for k, v in
                d["provenance"].items())]
        return "\n".join(lines) + "\n"
    raise ValueError(f"unknown format {fmt!r}")


def _md(v: Any) -> str:
    return "-" if v is None else _short(v).replace("|", "\\|")


def _md_pair(old: Any, new: Any) -> str:
    a, b = _pair(old, new)
    return " | ".join("-" if v is None else t.replace("|", "\\|") for v, t in ((old, a), (new, b)))


def _rank(c: Change) -> tuple[int, str, str]:
    return ({WEAKENED: 0, CHANGED: 1, TIGHTENED: 2}[c.effect], c.section, c.subject)


def _masked_kind(path: str) -> str:
    return "hidden counter" if path.startswith("/proc/") else "masked compiler"
