"""Rendering of the reviewer's sections (see sections.py): provenance and verdict first,
then interference paths, failure behaviour, filesystem views and, as appendices, the
whole syscall policy of each seccomp class. Markdown tables have at most 6 columns."""
from __future__ import annotations

from typing import Any

from supervisor.config import format_size


def _esc(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    assert len(head) <= 6, head     # narrow enough to read
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(_esc(c) for c in r) + " |" for r in rows]
    return out + [""]


# --------------------------------------------------------------------------- head


def _provenance_items(p: dict[str, Any]) -> list[tuple[str, str]]:
    git = p.get("git") or {}
    commit = git.get("commit") or "?"
    if git.get("dirty"):
        commit += " (with uncommitted changes in supervisor/, workers/ or schemas/)"
    items = [("time (UTC)", p.get("time_utc")), ("host", p.get("host")),
             ("kernel", p.get("kernel")), ("distribution", p.get("distribution") or "?"),
             ("package", f"{p['package']['name']} {p['package']['version'] or '(not installed)'}"),
             ("git commit", commit),
             ("config", f"{p['config']['source']}, sha256 {p['config']['sha256']}")]
    for a in p.get("artifacts") or []:
        files = "; ".join(f"{n} {h}" for n, h in (a.get("files") or {}).items())
        match = {True: "all match the manifest", False: "DO NOT MATCH the manifest",
                 None: "not checked"}[a.get("files_match_manifest")]
        items.append((f"artifact ({a['worker']})",
                      f"{a.get('artifact')}: manifest sha256 {a.get('manifest_sha256')}, "
                      f"key id {a.get('key_id')}, signature {a.get('signature')}; files "
                      f"(sha256): {files or 'none listed'}; {match}"))
    for t in p.get("code_trees") or []:
        installed = t.get("domain") == "(installed)"
        items.append(("code (installed package)" if installed
                      else f"control code ({t.get('domain')})",
                      f"{'' if installed else 'python_path '}{t.get('path')}: tree sha256 "
                      f"{t.get('sha256')}"))
    items.append(("python", p.get("python")))
    run = p.get("_running")
    if run:
        items.append(("running supervisor", f"pid {run['pid']}, started with "
                      f"{run['config']}, audited against {run['config_audited']}, "
                      f"{run['sandboxes']} sandboxes (standbys included)"))
    libs = ", ".join(f"{k} {v or 'absent'}" for k, v in (p.get("libraries") or {}).items())
    items.append(("libraries", libs))
    tools = ", ".join(f"{v or k + ' absent'}" for k, v in (p.get("tools") or {}).items())
    items.append(("tools", tools))
    return [(k, str(v)) for k, v in items]


def verdict_paragraph(report: dict[str, Any]) -> str:
    v = report.get("verdict")
    if not v:
        return ""
    c = v["counts"]
    live = report["mode"] == "live"
    if v["holds"]:
        head = ("VERDICT: the running system matches its config and the isolation holds."
                if live else "VERDICT: the config's isolation promise holds "
                "(what it promises; `audit --live` checks a running system against it).")
    else:
        head = "VERDICT: NOT HOLDING: " + "; ".join(v["reasons"]) + "."
    into = v.get("into_actuating") or []
    intro = ", ".join(f"{p['kind']} ({p['writer']} -> {p['reader']})" for p in into)
    killed = ", ".join(f"{n} killed in {k}" for k, n in c["killed"].items())
    return (f"{head} {c['workers']} workers in {c['domains']} domains, {c['channels']} "
            f"channels. {c['paths']} interference paths: {c['cross_domain_paths']} between "
            f"domains, {c['supervisor_paths']} to or from the supervisor; "
            f"{c['into_actuating']} lead from a non-actuating domain into an actuating one"
            + (f": {intro}, each bounded as listed." if into else ".")
            + f" {c['seccomp_classes']} seccomp class(es): {killed or 'none'} (syscalls)."
            + (f" {c['differences']} difference(s) found live." if live else ""))


def _prov(report: dict[str, Any]) -> dict[str, Any] | None:
    p = report.get("provenance")
    return dict(p, _running=report.get("running")) if p else None


def md_head(report: dict[str, Any]) -> list[str]:
    out = []
    para = verdict_paragraph(report)
    if para:
        out += [para, ""]
    p = _prov(report)
    if p:
        out += ["## Provenance", ""]
        out += _table(["item", "value"], [[k, v] for k, v in _provenance_items(p)])
    return out


def text_head(report: dict[str, Any]) -> list[str]:
    out = [verdict_paragraph(report)] if report.get("verdict") else []
    p = _prov(report)
    if p:
        out += [f"  {k}: {v}" for k, v in _provenance_items(p)]
    return out


# --------------------------------------------------------------------------- paths


_PATH_GROUPS = (("Shared memory: channels, lease tables, wake-up sockets",
                 ("channel data", "lease table", "wake-up socket", "wake-up socket (reverse)")),
                ("Pipes and sockets to the supervisor",
                 ("status pipe", "output pipe", "exec-watch notifications",
                  "standby control socket")),
                ("Files", ("state directory", "drive log / written files")),
                ("Shared CPU and memory, processes, network",
                 ("shared CPU and memory (cgroups)", "signals, ptrace, /proc", "network")),
                # (gate 9 finding 8: said in the signed report, not only docs/review.md)
                ("What one domain can observe of another (known, not closed)",
                 ("observation (slot choice)",)))


def md_paths(report: dict[str, Any]) -> list[str]:
    paths = report.get("interference_paths")
    if paths is None:
        return []
    out = ["## Interference paths", "",
           "Every path by which a process of one domain can put bytes (or load) where "
           "another domain's process, or the supervisor, reads or feels them. Direction is "
           "writer's domain -> reader's domain; **bold** rows lead from a non-actuating "
           "domain into an actuating one.", ""]
    into = {p["id"] for p in (report.get("verdict") or {}).get("into_actuating", [])}
    for title, kinds in _PATH_GROUPS:
        if not any(p["kind"] in kinds for p in paths):
            continue
        out += [f"### {title}", ""]
        for kind in kinds:
            out += _kind_table(kind, [p for p in paths if p["kind"] == kind], into)
    live = report.get("live_paths")
    if live:
        out += ["### Checked on the running processes", ""]
        out += _table(["path", "check", "observed", "ok"],
                      [[c["path"], c["check"], c["observed"], "yes" if c["ok"] else "**NO**"]
                       for c in live])
    return out


def _kind_table(kind: str, rows: list[dict[str, Any]], into: set[str]) -> list[str]:
    """One kind of path: what every instance shares said once, above a table of what
    differs (a lease table's bound names its own channel's lease_ms, so it stays a
    column there)."""
    if not rows:
        return []

    def ident(p: dict[str, Any]) -> str:
        return f"**{p['id']}**" if p["id"] in into else p["id"]

    shared = [k for k in ("carries", "worst", "bound") if len({p[k] for p in rows}) == 1]
    out = [f"**{kind}**" + "".join(
        f"; {'worst a hostile writer can do' if k == 'worst' else 'bound by' if k == 'bound' else k}"
        f": {rows[0][k]}" for k in shared) + ".", ""]
    cols = [k for k in ("carries", "worst", "bound") if k not in shared]
    head = ["path", "direction", "writer -> reader"] + [
        {"carries": "carries", "worst": "worst a hostile writer can do",
         "bound": "bound by"}[k] for k in cols]
    return out + _table(head, [[ident(p), p["direction"], f"{p['writer']} -> {p['reader']}"]
                               + [p[k] for k in cols] for p in rows])


# --------------------------------------------------------------------------- failure


def _restart_cell(f: dict[str, Any]) -> str:
    b = f["budget"]
    return (f"{f['restart_text']}; at most {b['max_restarts']} in {b['window_s']:g} s; "
            f"backoff {f['backoff_text']}")


def md_failure(report: dict[str, Any]) -> list[str]:
    rows = report.get("failure")
    if rows is None:
        return []
    out = ["## Failure behaviour per worker", ""]
    out += _table(["worker", "restart, budget, backoff", "watchdog, ready timeout",
                   "warm standby", "out of restarts", "actuation channel meanwhile"],
                  [[f"{f['worker']} ({f['domain']}, {f['failure_policy']})",
                    _restart_cell(f),
                    (f"{f['watchdog_ms']} ms" if f["watchdog_ms"] else "no watchdog")
                    + f"; READY within {f['ready_timeout_ms']} ms",
                    "yes: takes over at once" if f["warm_standby"] else "no",
                    f["on_give_up"], f["actuation_meanwhile"]] for f in rows])
    return out


# --------------------------------------------------------------------------- filesystem


def _mount_rows(v: dict[str, Any]) -> list[list[str]]:
    rows = []
    for m in v["mounts"]:
        extra = (format_size(m["size"]) if m.get("size") else
                 f"-> {m['source']}" if m["what"] == "symlink" else
                 m["source"] if m.get("source") and m["source"] != m["path"] else "")
        rows.append([m["path"], m["what"], m["access"], extra])
    return rows


def _grouped_views(report: dict[str, Any]) -> list[tuple[list[str], dict[str, Any]]]:
    """Workers with identical views share one table."""
    groups: list[tuple[list[str], dict[str, Any]]] = []
    for name, v in (report.get("filesystem") or {}).items():
        for names, seen in groups:
            if seen == v:
                names.append(name)
                break
        else:
            groups.append(([name], v))
    return groups


def md_filesystem(report: dict[str, Any]) -> list[str]:
    if report.get("filesystem") is None:
        return []
    out = ["## Filesystem view per worker", "",
           "From the bubblewrap command line the supervisor builds (policy.py, bwrap.py). "
           "Nothing else of the host exists inside. Writable: the listed rw mounts only.", ""]
    for names, v in _grouped_views(report):
        out += [f"### {', '.join(names)}", ""]
        if v.get("error"):
            out += [f"No view: {v['error']}", ""]
            continue
        out += _table(["path", "what", "access", "size / source"], _mount_rows(v))
        if v["masked"]:
            out += [f"Compilers masked (bound over by /dev/null, cannot run): "
                    f"{', '.join(v['masked'])}.", ""]
        if v.get("hidden"):
            out += [f"The machine's counters, empty inside (bound over by /dev/null): "
                    f"{', '.join(v['hidden'])}.", ""]
        for d, names_ in v["whiteouts"].items():
            out += [f"Whiteouts in {d} (absent inside): {', '.join(names_)}.", ""]
        out += [_device_line(v), ""]
    return out


def _device_line(v: dict[str, Any]) -> str:
    """The accelerator a worker's sandbox opens: its declared device and GPU nodes."""
    dev, nodes = v.get("device", "cpu"), v.get("device_nodes") or []
    if dev == "cpu":
        return ("Device: cpu (no GPU node: " + (f"device binds {', '.join(nodes)}"
                                                if nodes else "nothing of /dev beyond "
                                                "bwrap's standard nodes") + ").")
    return (f"Device: {dev}: GPU nodes " + (", ".join(nodes) if nodes else
                                            "none (none exist on this machine)") + ".")


# --------------------------------------------------------------------------- syscalls


def _socket_types(whens: list[str]) -> list[str]:
    """One rule per socket type (seccomp compares the masked type field, 4 bits) read
    back as "every type but ...": the complement is what a reviewer checks."""
    import re
    import socket

    by: dict[str, list[str]] = {}
    rest = []
    for w in whens:
        m = re.match(r"^(.*?)type (\w+)$", w)
        (by.setdefault(m.group(1), []).append(m.group(2)) if m else rest.append(w))
    out = list(rest)
    names = {str(k.value): k.name for k in socket.SocketKind if k.value < 16}
    for prefix, types in by.items():
        listed = {names.get(t, t) for t in types}
        every = [names.get(str(i), str(i)) for i in range(16)]
        kept = [t for t in every if t not in listed]
        out.append(f"{prefix}type any but {', '.join(kept)}" if len(kept) < len(listed)
                   else f"{prefix}type {', '.join(sorted(listed))}")
    return out


def _grouped_conditions(rules: list[dict[str, Any]]) -> list[list[str]]:
    by: dict[tuple[str, str, str], list[str]] = {}
    for r in rules:
        act = r["action"] if r["action"] != "errno" else r["errno"]
        by.setdefault((r["syscall"], act, r["stage"]), []).append(r["when"] or "always")
    return [[s, a, "; ".join(_socket_types(w) if s in ("socket", "socketpair") else w), st]
            for (s, a, st), w in sorted(by.items())]


def md_syscalls(report: dict[str, Any]) -> list[str]:
    sc = report.get("syscalls")
    if sc is None:
        return []
    out = ["", "## Appendices: the whole syscall policy per seccomp class", ""]
    if sc.get("error"):
        return out + [f"Unavailable here: {sc['error']}", ""]
    for i, (key, c) in enumerate(sc["classes"].items()):
        letter = chr(ord("A") + i)
        out += [f"### Appendix {letter}: {key} (domains: {', '.join(c['domains'])})", "",
                f"Default action: {c['default']} (the filters are deny-lists). Stacked "
                "filters: the strictest action wins (kill > errno > notify > allow).", "",
                f"**Killed** (SIGSYS, the whole process; {len(c['killed'])}): "
                f"{', '.join(c['killed']) or 'none'}.", ""]
        errs = c["errno"]
        if errs:
            by: dict[str, list[str]] = {}
            for n, e in errs.items():
                by.setdefault(e, []).append(n)
            for e, names in by.items():
                out += [f"**{e}** ({len(names)}): {', '.join(names)}.", ""]
        out += [f"**Notified** to the supervisor (exec watch): "
                f"{', '.join(c['notified']) or 'none'}.", ""]
        if c["conditional"]:
            out += ["**Depending on the arguments** (otherwise allowed):", ""]
            out += _table(["syscall", "action", "when", "filter"],
                          _grouped_conditions(c["conditional"]))
        if c.get("after_ready"):
            out += ["**From READY on** (W^X, supervisor/sandbox/wx.py):", ""]
            out += _table(["syscall", "action", "when", "filter"],
                          _grouped_conditions(c["after_ready"]))
        out += [f"**Allowed** ({len(c['allowed'])} of {c['table_size']} in this "
                f"architecture's table): {', '.join(c['allowed'])}.", ""]
    return out


# --------------------------------------------------------------------------- text


def text_sections(report: dict[str, Any]) -> list[str]:
    out: list[str] = []
    paths = report.get("interference_paths") or []
    if paths:
        out += ["", "Interference paths (writer -> reader: worst; bound):"]
        for p in paths:
            out.append(f"  {p['id']} [{p['direction']}] {p['writer']} -> {p['reader']}: "
                       f"{p['worst']}; bound: {p['bound']}")
    for c in report.get("live_paths") or []:
        out.append(f"  live {c['path']}: {c['check']}: {c['observed']}"
                   + ("" if c["ok"] else "  !! NOT AS PROMISED"))
    if report.get("failure"):
        out += ["", "Failure behaviour:"]
        for f in report["failure"]:
            out.append(f"  {f['worker']}: {_restart_cell(f)}; watchdog "
                       f"{f['watchdog_ms'] or 'none'} ms; standby "
                       f"{'yes' if f['warm_standby'] else 'no'}; out of restarts: "
                       f"{f['on_give_up']}; meanwhile: {f['actuation_meanwhile']}")
    if report.get("filesystem"):
        out += ["", "Filesystem views:"]
        for names, v in _grouped_views(report):
            out.append(f"  {', '.join(names)}:" + (f" no view: {v['error']}"
                                                   if v.get("error") else ""))
            for row in _mount_rows(v) if not v.get("error") else []:
                out.append(f"    {row[0]}  {row[1]} {row[2]} {row[3]}".rstrip())
            if v.get("masked"):
                out.append(f"    masked compilers: {', '.join(v['masked'])}")
            if v.get("hidden"):
                out.append(f"    the machine's counters, empty inside: "
                           f"{', '.join(v['hidden'])}")
            for d, names_ in (v.get("whiteouts") or {}).items():
                out.append(f"    whiteouts in {d}: {', '.join(names_)}")
            if not v.get("error"):
                out.append(f"    {_device_line(v)}")
    sc = report.get("syscalls")
    if sc:
        out += ["", "Syscall policy per seccomp class:"]
        if sc.get("error"):
            out.append(f"  unavailable: {sc['error']}")
        for key, c in (sc.get("classes") or {}).items():
            out.append(f"  {key} (domains {', '.join(c['domains'])}), default {c['default']}")
            out.append(f"    killed ({len(c['killed'])}): {', '.join(c['killed'])}")
            by: dict[str, list[str]] = {}
            for n, e in c["errno"].items():
                by.setdefault(e, []).append(n)
            out += [f"    {e} ({len(ns)}): {', '.join(ns)}" for e, ns in by.items()]
            out.append(f"    notified: {', '.join(c['notified']) or 'none'}")
            for row in _grouped_conditions(c["conditional"]):
                out.append(f"    {row[0]}: {row[1]} when {row[2]} ({row[3]})")
            for row in _grouped_conditions(c.get("after_ready") or []):
                out.append(f"    {row[0]}: {row[1]} when {row[2]} ({row[3]})")
            out.append(f"    allowed ({len(c['allowed'])}): {', '.join(c['allowed'])}")
    return out
