"""The reviewer's sections of a report, added to the worker rows: provenance,
interference paths, failure behaviour, filesystem views, the syscall policy, and the
verdict that the summary paragraph states first."""
from __future__ import annotations

from typing import Any

from supervisor.config import Config


def add_sections(report: dict[str, Any], cfg: Config) -> dict[str, Any]:
    from . import failure, fsview, paths, provenance, syscalls

    rows = report.get("promised") or report["workers"]
    report["provenance"] = provenance.provenance(cfg, rows)
    report["interference_paths"] = paths.interference_paths(cfg)
    report["failure"] = failure.failure_rows(cfg)
    report["filesystem"] = fsview.views(cfg)
    report["syscalls"] = syscalls.policies(cfg)
    for r in report["workers"] + (report.get("promised") or []):
        if isinstance(r.get("seccomp"), dict) and r.get("domain") in report["syscalls"]["by_domain"]:
            r["seccomp"]["class"] = report["syscalls"]["by_domain"][r["domain"]]
    report["verdict"] = verdict(report, cfg)
    return report


def _weak_views(report: dict[str, Any], cfg: Config) -> list[str]:
    """Strict workers with a writable mount beyond their private /tmp and /dev/shm."""
    out = []
    for name, v in report["filesystem"].items():
        if cfg.domains[cfg.workers[name].domain].profile == "research":
            continue
        extra = [p for p in v["writable"] if p not in ("/tmp", "/dev/shm")]
        if extra:
            out.append(f"{name} can write {', '.join(extra)}")
    return out


def verdict(report: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """{holds, reasons: [why not], counts, into_actuating: [paths from a non-actuating
    domain into an actuating one]}."""
    rows = report.get("promised") or report["workers"]
    reasons: list[str] = []
    if not report["trust"]["holds"]:
        reasons.append("the trust rules do not hold (research or shadow data reaches "
                       "actuation, or an actuating domain has a network)")
    for r in rows:
        if r.get("policy_error"):
            reasons.append(f"{r['worker']}: no sandbox policy: {r['policy_error']}")
        a = r.get("admission") or {}
        if a.get("admitted") is False and not r.get("optional"):
            reasons.append(f"{r['worker']}: refused by admission (required)")
    reasons += _weak_views(report, cfg)
    if report["syscalls"].get("error"):
        reasons.append(f"syscall policy unreadable: {report['syscalls']['error']}")
    if report["mode"] == "live" and report["result"] != "matches":
        n = len(report.get("differences", []))
        reasons.append(f"{n} difference(s) between the running system and the config"
                       if report["result"] == "differences" else
                       f"the system could not be inspected ({report['result']})")
    actuating = {n for n, d in cfg.domains.items() if d.actuates}
    into = [p for p in report["interference_paths"]
            if p["to"] in actuating and p["from"] in cfg.domains and p["from"] not in actuating]
    classes = report["syscalls"].get("classes", {})
    counts = {
        "workers": len(rows), "domains": len(cfg.domains), "channels": len(cfg.channels),
        "paths": len(report["interference_paths"]),
        "cross_domain_paths": sum(1 for p in report["interference_paths"]
                                  if p["from"] in cfg.domains and p["to"] in cfg.domains
                                  and p["from"] != p["to"]),
        "supervisor_paths": sum(1 for p in report["interference_paths"]
                                if "supervisor" in (p["from"], p["to"])),
        "into_actuating": len(into),
        "seccomp_classes": len(classes),
        "killed": {k: len(c["killed"]) for k, c in classes.items()},
        "differences": len(report.get("differences", [])),
    }
    return {"holds": not reasons, "reasons": reasons, "counts": counts,
            "into_actuating": [{"id": p["id"], "kind": p["kind"], "writer": p["writer"],
                                "reader": p["reader"], "bound": p["bound"]} for p in into]}
