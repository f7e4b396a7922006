"""The audit report as text (a terminal), Markdown (a review record) or JSON (tools)."""
from __future__ import annotations

import json
from typing import Any, Callable

from supervisor.config import format_size

Cell = Callable[[dict[str, Any], str], str]


def _yn(v: Any) -> str:
    return "?" if v is None else "yes" if v else "no"


def _host(r: dict, mode: str) -> str:
    h = r.get("host") or {}
    if not h:
        return "-"
    return f"{h.get('user') or '?'} ({h.get('uid')}:{h.get('gid')})"


def _namespaces(r: dict, mode: str) -> str:
    ns = r.get("namespaces") or {}
    if not ns:
        return "-"
    own = [k for k, v in ns.items() if v == "private"]
    host = [k for k, v in ns.items() if v == "host"]
    unknown = [k for k, v in ns.items() if v is None]
    parts = [f"own {' '.join(own)}" if own else "", f"HOST {' '.join(host)}" if host else "",
             f"unknown {' '.join(unknown)}" if unknown else ""]
    return "; ".join(p for p in parts if p)


def _seccomp(r: dict, mode: str) -> str:
    s = r.get("seccomp") or {}
    if not s:
        return "-"
    head = f"{s.get('mode')} x{s.get('filters')}"
    if mode != "config":
        return head + (f" (+{s['inherited']} inherited)" if s.get("inherited") else "")
    launch = s.get("launch") or {}
    parts = [head]
    if launch:
        parts.append(f"launch: {len(launch['kill'])} kill rules, {len(launch['eperm'])} "
                     f"EPERM rules")
    if s.get("after_start_kill"):
        parts.append("after start kills " + "/".join(s["after_start_kill"]))
    if s.get("exec_watch"):
        parts.append("exec watch")
    if s.get("class"):
        parts.append(f"every rule: appendix {s['class']}")
    return "; ".join(parts)


def _caps(r: dict, mode: str) -> str:
    c = r.get("capabilities")
    if c is None:
        return "-"
    held = {k: v for k, v in c.items() if v}
    return "none" if not held else "; ".join(f"{k}: {','.join(v)}" for k, v in held.items())


def _limit(key: str, fmt: Callable[[Any], str]) -> Cell:
    def cell(r: dict, mode: str) -> str:
        lim = r.get("limits")
        if lim is None:
            return "-"
        v = lim.get(key)
        if v is None:
            return "inherited" if key == "nofile" else "unlimited"
        return fmt(v)
    return cell


def _scheduling(r: dict, mode: str) -> str:
    s = r.get("scheduling")
    if s is None:
        return "-"
    poll = f"; busy-polls its readers' streams (<= {2 * s['busy_poll_us']} us a message)" \
        if s.get("busy_poll_us") else ""
    if s["policy"] == "other":
        return "normal" + poll
    budget = s.get("rt_budget_pct")
    bound = f"{budget}% of a CPU per 100 ms" if budget else "global RT limit only"
    return (f"{s['policy'].upper()} {s['priority']} from READY"
            f"{', not inherited' if s['reset_on_fork'] else ', INHERITED by children'}; "
            f"{bound}{poll}")


def _writes(r: dict, mode: str) -> str:
    ch = r.get("channels")
    if ch is None:
        return "-"
    items = [f"{c['channel']} ({'rw' if c['access'] == 'read-write' else 'ro'})"
             for c in ch["writes"]]
    return ", ".join(items) or "none"


def _reads(r: dict, mode: str) -> str:
    ch = r.get("channels")
    if ch is None:
        return "-"
    items = []
    for c in ch["reads"]:
        tags = ["ro" if c["access"] == "read-only" else "rw"]
        if c.get("log_only"):
            tags.append("log-only")
        elif c.get("shadow"):
            tags.append("shadow")
        items.append(f"{c['channel']} ({', '.join(tags)})")
    return ", ".join(items) or "none"


def _models(r: dict, mode: str) -> str:
    ms = r.get("models")
    if ms is None:
        return "-"
    if not ms:
        return "none"
    out = []
    for m in ms:
        if mode == "config":
            key = (m.get("key_id") or "?")[:16]
            floor = f" (min {m['min_version']})" if m.get("min_version") else ""
            out.append(f"{m.get('name') or m.get('artifact')} {m.get('version') or ''} "
                       f"key {key}: {m.get('signature')}{floor}".replace("  ", " "))
        else:
            out.append(f"{m.get('artifact')}: "
                       + ("same as audited" if m.get("same_as_audited") else "DIFFERENT"))
    return "; ".join(out)


def _admission(r: dict, mode: str) -> str:
    a = r.get("admission") or {}
    if not a.get("checked"):
        return "not checked"
    if a.get("admitted"):
        return "admitted"
    return "refused: " + " | ".join(a.get("chains") or ["?"])


def _jit(r: dict, mode: str) -> str:
    v = r.get("jit_kernels")
    if mode == "config":
        return "allowed" if v else "no"
    return "?" if v is None else "present" if v else "none"


def _field(key: str) -> Cell:
    return lambda r, mode: _yn(r.get(key))


# (label, prefix of the difference keys it shows, cell)
ISOLATION: list[tuple[str, str, Cell]] = [
    ("host user (uid:gid)", "host", _host),
    ("namespaces", "namespaces", _namespaces),
    ("network", "network", _field("network")),
    ("compilers visible", "compilers_visible", _field("compilers_visible")),
    ("exec after start", "exec_after_start", _field("exec_after_start")),
    ("new exec memory after READY", "new_exec_memory_after_ready",
     _field("new_exec_memory_after_ready")),
    ("jit kernels (anon code before READY)", "jit_kernels", _jit),
    ("seccomp", "seccomp", _seccomp),
    ("no_new_privs", "no_new_privs", _field("no_new_privs")),
    ("capabilities", "capabilities", _caps),
]
RESOURCES: list[tuple[str, str, Cell]] = [
    ("memory max", "limits.memory_max", _limit("memory_max", format_size)),
    ("pids max", "limits.pids_max", _limit("pids_max", str)),
    ("cpu quota", "limits.cpu_quota_pct", _limit("cpu_quota_pct", lambda v: f"{v:g}%")),
    ("cpu weight", "limits.cpu_weight", _limit("cpu_weight", str)),
    ("scheduling", "scheduling", _scheduling),
    ("open files", "limits.nofile", _limit("nofile", str)),
    ("writes", "channels", _writes),
    ("reads", "channels", _reads),
    ("trusted models", "models", _models),
    ("torch", "torch", lambda r, m: r.get("torch") or "-"),
    ("admission", "admission", _admission),
]


def _differing(report: dict, worker: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in report.get("differences", []):
        if d.get("worker") == worker:
            out.setdefault(d["key"], []).append(d)
    return out


def _cell(report: dict, row: dict, prefix: str, cell: Cell) -> str:
    text = cell(row, report["mode"])
    if report["mode"] != "live":
        return text
    diffs = _differing(report, row["worker"])
    hit = [d for k, ds in diffs.items() for d in ds
           if k == prefix or k.startswith(prefix + ".")]
    if prefix == "channels" and hit:
        # writes and reads share the prefix: mark the cell that names the channel
        hit = [d for d in hit if d["key"].split(".")[1] in text]
    if prefix == "host" and not hit:
        return text
    return f"!! {text}" if hit else text


def _domain(r: dict) -> str:
    p = r.get("profile")
    return r["domain"] if p in (None, r["domain"]) else f"{r['domain']} ({p})"


def _title(report: dict) -> str:
    if report["mode"] == "live":
        return f"Isolation audit (live evidence) of {report['config']}"
    return f"Isolation audit (config promises) of {report['config']}"


def _summary(report: dict) -> str:
    res = report["result"]
    if res == "promise":
        return "What the config promises; `supervisor audit --live` checks it on a running system."
    if res == "matches":
        return f"The running system matches the config ({len(report['workers'])} workers)."
    if res == "not-started":
        sup = report.get("supervisor") or {}
        return (f"The system could not be started: {sup.get('outcome')} "
                f"(supervisor exit {sup.get('exit_code')}).")
    n = len(report["differences"])
    return f"{n} difference{'' if n == 1 else 's'} between the running system and the config."


# --------------------------------------------------------------------------- markdown


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_md_escape(c) for c in r) + " |" for r in rows]
    return out


# Markdown tables narrow enough to read: at most 6 columns, split by topic (the worker
# column, with its domain, first).
GROUPS: list[tuple[str, list[tuple[str, str, Cell]]]] = [
    ("Identity and namespaces", [ISOLATION[0], ISOLATION[1], ISOLATION[2], ISOLATION[9],
                                 ISOLATION[8]]),
    ("Code execution", [ISOLATION[3], ISOLATION[4], ISOLATION[5], ISOLATION[6]]),
    ("Seccomp (summary; the whole policy is in the appendices)", [ISOLATION[7]]),
    ("Resources", RESOURCES[:4] + [RESOURCES[5]]),
    ("Scheduling and channels", [RESOURCES[4], RESOURCES[6], RESOURCES[7]]),
    ("Trust", RESOURCES[8:]),
]


def markdown(report: dict) -> str:
    from . import privilege, review

    live = report["mode"] == "live"
    lines = [f"# {_title(report)}", ""]
    lines += review.md_head(report)
    lines += [_summary(report), ""]
    rows = report["workers"]

    def first(r: dict) -> list[str]:
        who = f"{r['worker']} ({_domain(r)})"
        if live:
            who += f", pid {r.get('pid')}" if r.get("running") else ", NOT RUNNING"
        return [who]

    if live:
        lines += ["## Differences", ""]
        lines += [f"- **{d['worker'] or '-'}** `{d['key']}`: {d['detail']}"
                  for d in report["differences"]] or ["None."]
        lines.append("")
    lines += review.md_paths(report)
    lines += review.md_failure(report)
    lines += privilege.md_lines(report)
    lines += ["## Isolation per worker", ""]
    for title, cols in GROUPS:
        lines += [f"### {title}", ""]
        lines += _md_table(["worker"] + [c[0] for c in cols],
                           [first(r) + [_cell(report, r, p, c) for _, p, c in cols]
                            for r in rows])
        lines.append("")
    lines += review.md_filesystem(report)
    lines += ["## Channels", ""]
    lines += _md_table(["channel", "writer", "readers", "data", "checks", "feeds actuation"],
                       [_channel_narrow(c) for c in report["channels"]])
    lines += ["", "## Trust rules", ""] + _trust_lines(report["trust"], "- ")
    lines += review.md_syscalls(report)
    return "\n".join(lines).rstrip("\n") + "\n"


def _channel_narrow(c: dict) -> list[str]:
    cells = _channel_cells(c)
    data = f"{c['kind']} {c['dtype']}, {c['slot_count']} x {c['slot_size']} B" + (
        f"; payload {c['payload']}" if c["payload"] else "") + (
        "; ACTUATION" if c["actuation"] else "") + (
        f"; {cells[3]}" if cells[3] != "no" else "")
    checks = f"{cells[6]}, max age {cells[7]}, lease {c['lease_ms']} ms"
    return [c["channel"], cells[1], cells[2], data, checks, cells[8]]


def _channel_cells(c: dict) -> list[str]:
    readers = ", ".join([r["worker"] + (" (log-only)" if r["log_only"] else "")
                         for r in c["readers"]]
                        + (["supervisor (monitor, status line only)"] if c.get("monitor")
                           else [])) or "none"
    shadow = "yes" if c["shadow"] else ("research data" if c["research_data"] else "no")
    return [c["channel"], f"{c['writer']} ({c['writer_domain']})", readers, shadow,
            c["payload"] or "-", "yes" if c["actuation"] else "no",
            "crc32" if c["crc"] else "none",
            f"{c['max_age_ms']} ms" if c["max_age_ms"] else "unbounded",
            ", ".join(c["feeds_actuation"]) or "-"]


def _trust_lines(t: dict, bullet: str) -> list[str]:
    out = [f"{bullet}{r}" for r in t["rules"]]
    if t.get("check_trust"):
        out.append(f"{bullet}{t['check_trust']}")
    out.append("")
    for p in t["actuation_paths"]:
        out.append(f"What may reach actuation channel {p['actuation']}: channels "
                   f"{', '.join(p['channels'])}; workers {', '.join(p['workers'])} "
                   f"(domains {', '.join(p['domains'])}); research/shadow data upstream: "
                   f"{', '.join(p['research_data_upstream']) or 'none'}.")
    if not t["actuation_paths"]:
        out.append("No actuation channel in this config.")
    for r in t["log_only_reads"]:
        out.append(f"{r['worker']} reads {r['channel']} log-only (shadow_subscribes).")
    out.append(f"Actuating domains: {', '.join(t['actuating_domains']) or 'none'}. "
               f"Rules hold for this config: {'yes' if t['holds'] else 'NO'}.")
    if t.get("supervisor_mode", "vehicle") != "vehicle":
        out.append(f"Mode {t['supervisor_mode']!r}: simulation-only arguments allowed "
                   f"(recorded frames or time may reach control); never a vehicle config.")
    return out


# --------------------------------------------------------------------------- text


def text(report: dict) -> str:
    from . import privilege, review

    live = report["mode"] == "live"
    lines = [_title(report)] + review.text_head(report) + [_summary(report), ""]
    width = max(len(f[0]) for f in ISOLATION + RESOURCES) + 2
    for r in report["workers"]:
        head = f"{r['worker']}  [{_domain(r)}]"
        if live:
            head += f"  pid {r.get('pid')}" if r.get("running") else "  NOT RUNNING"
        lines.append(head)
        for label, prefix, cell in ISOLATION + RESOURCES:
            lines.append(f"  {label:<{width}}{_cell(report, r, prefix, cell)}")
        if live and r.get("standby"):
            pids = ", ".join(str(sb.get("pid")) for sb in r.get("standbys") or [r["standby"]])
            bad = [d for d in report["differences"] if d["worker"] == r["worker"]
                   and d["key"].startswith("standby.")]
            lines.append(f"  {'warm standby':<{width}}pid {pids}: "
                         + (f"!! {len(bad)} difference(s)" if bad else
                            "checked like the worker, holds no channel"))
        lines.append("")
    if live:
        lines.append("Differences:" if report["differences"] else "Differences: none")
        lines += [f"  {d['detail']}" for d in report["differences"]]
        lines.append("")
    lines.append("Channels:")
    for c in report["channels"]:
        cells = _channel_cells(c)
        lines.append(f"  {cells[0]}: writer {cells[1]}; readers {cells[2]}; shadow {cells[3]}; "
                     f"payload {cells[4]}; actuation {cells[5]}; {cells[6]}; max age {cells[7]}"
                     + (f"; feeds {cells[8]}" if cells[8] != "-" else ""))
    lines += ["", "Trust rules:"] + [("  " + x if x else "") for x in _trust_lines(report["trust"], "* ")]
    lines += privilege.text_lines(report)
    lines += review.text_sections(report)
    return "\n".join(lines) + "\n"


def render(report: dict, fmt: str = "text") -> str:
    if fmt == "json":
        return json.dumps(report, indent=2, sort_keys=False, default=str) + "\n"
    if fmt == "markdown":
        return markdown(report)
    if fmt == "text":
        return text(report)
    raise ValueError(f"unknown format {fmt!r}")
