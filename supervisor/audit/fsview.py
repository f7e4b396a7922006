"""Each worker's filesystem view, read off the bubblewrap command line the supervisor
would run: `promise.policy` (`sandbox.policy.for_worker`, as the supervisor)
then `sandbox.bwrap.build_bwrap_argv`, parsed back into mounts. Nothing is restated here:
a bind the policy adds or drops shows up (or disappears) in the report by itself.

Staging (root runs bwrap as the domain's host user from a private mount namespace)
changes where bwrap finds a source, never where it mounts it; the view here is given
with host paths as sources, and a directory with refused entries as one "filtered view"
bind, as staging makes it (`Staging.views`).

Mount entry: {path, what, access ("ro" | "rw"), source, size (bytes, tmpfs only)};
what is one of "bind", "device bind", "tmpfs", "proc", "dev", "symlink",
"masked" (bound over by /dev/null: a compiler, which cannot be executed, listed under
"masked"; a /proc counter, the machine's, read empty inside, listed under "hidden"), "emptied" (a
toolchain directory covered by an empty read-only tmpfs), "whiteout view" (a
site-packages without the refused distributions).
"""
from __future__ import annotations

import os
from typing import Any

from supervisor.config import Config, WorkerConfig

FILTERED = "(filtered view)"
# What bwrap's --dev puts in /dev (bwrap(1)): these nodes are bind mounts of the host's
# device nodes, writable as devices are (writing /dev/null is no channel to anyone);
# the /dev directory itself is remounted read-only by the policy.
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty", "pts", "ptmx", "console")
DEV_NODES_TEXT = "bwrap --dev: " + ", ".join(DEV_NODES[:7])


def _parse(argv: list[str]) -> list[dict[str, Any]]:
    """bwrap's mount options, in order, into mounts with their final access."""
    mounts: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    size: int | None = None

    def put(path: str, **m: Any) -> None:
        if path not in mounts:
            order.append(path)
        mounts[path] = {"path": path, "size": None, **m}

    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            break
        if a == "--size":
            size = int(argv[i + 1])
            i += 2
            continue
        if a in ("--ro-bind", "--bind", "--dev-bind"):
            src, dst = argv[i + 1], argv[i + 2]
            what = ("masked" if src == "/dev/null" and a == "--ro-bind" else
                    "whiteout view" if src == FILTERED else
                    "device bind" if a == "--dev-bind" else "bind")
            put(dst, what=what, access="ro" if a == "--ro-bind" else "rw", source=src)
            i += 3
            continue
        if a == "--symlink":
            put(argv[i + 2], what="symlink", access="ro", source=argv[i + 1])
            i += 3
            continue
        if a == "--tmpfs":
            put(argv[i + 1], what="tmpfs", access="rw", source="", size=size)
            size = None
            i += 2
            continue
        if a in ("--proc", "--dev"):
            put(argv[i + 1], what=a[2:], access="rw",
                source=DEV_NODES_TEXT if a == "--dev" else "")
            i += 2
            continue
        if a == "--remount-ro":
            p = argv[i + 1]
            if p in mounts:
                m = mounts[p]
                m["access"] = "ro"
                if m["what"] == "tmpfs" and p != "/":
                    m["what"] = "emptied" if not any(
                        o != p and o.startswith(p.rstrip("/") + "/") for o in order) else "tmpfs"
            else:
                put(p, what="root", access="ro", source="")
            i += 2
            continue
        i += 1
    return [mounts[p] for p in order]


def view_of(cfg: Config, w: WorkerConfig) -> dict[str, Any]:
    """{mounts, masked: [paths], whiteouts: {dir: [names]}, writable: [paths], device,
    device_nodes: [paths], error}."""
    from supervisor.sandbox.bwrap import build_bwrap_argv

    from .promise import policy

    pol, why = policy(cfg, w)
    if pol is None:
        return {"mounts": [], "masked": [], "hidden": [], "whiteouts": {}, "writable": [],
                "error": why}
    hidden: dict[str, list[str]] = {}
    for h in pol.hidden:
        hidden.setdefault(os.path.dirname(h), []).append(os.path.basename(h))
    try:
        argv = build_bwrap_argv(pol, ["worker"], views={d: FILTERED for d in hidden})
    except (OSError, ValueError) as e:   # no bwrap here: say so, the rest still reports
        return {"mounts": [], "masked": [], "hidden": [], "whiteouts": {}, "writable": [],
                "error": f"{type(e).__name__}: {e}"}
    mounts = _parse(argv)
    return {
        "mounts": [m for m in mounts if m["what"] not in ("masked",)],
        # A /dev/null bind is a compiler that cannot run, or, under /proc, one of the
        # machine's counters read empty inside (gate 9 finding 11: all were "compilers").
        "masked": [m["path"] for m in mounts if m["what"] == "masked"
                   and not m["path"].startswith("/proc/")],
        "hidden": [m["path"] for m in mounts if m["what"] == "masked"
                   and m["path"].startswith("/proc/")],
        "whiteouts": {d: sorted(names) for d, names in sorted(hidden.items())},
        "writable": [m["path"] for m in mounts if m["access"] == "rw"
                     and m["what"] not in ("symlink",)],
        # The accelerator view: what the worker declared and which GPU nodes it gets
        # (policy.CUDA_DEVICE_NODES that exist on this machine).
        "device": pol.device,
        "device_nodes": list(pol.dev_binds),
        "error": None,
    }


def views(cfg: Config) -> dict[str, dict[str, Any]]:
    return {w.name: view_of(cfg, w) for w in cfg.workers.values()}


# --------------------------------------------------------------------------- live


def _unescape(s: str) -> str:
    return s.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n") \
        .replace("\\134", "\\")


def mountinfo(pid: int) -> dict[str, dict[str, Any]]:
    """mount point (as the process sees it) -> {access, fstype, size} of the last mount
    on it (the one in effect)."""
    from .evidence import _read

    out: dict[str, dict[str, Any]] = {}
    for line in _read(f"/proc/{pid}/mountinfo").splitlines():
        pre, _, post = line.partition(" - ")
        f, p = pre.split(), post.split()
        if len(f) < 6 or len(p) < 3:
            continue
        opts = f[5].split(",")
        size = None
        for o in p[2].split(","):
            if o.startswith("size="):
                v = o[5:]
                mult = {"k": 1024, "m": 2**20, "g": 2**30}.get(v[-1:].lower(), 1)
                size = int(v.rstrip("kKmMgG")) * mult
        out[_unescape(f[4])] = {"access": "ro" if "ro" in opts else "rw", "fstype": p[0],
                                "size": size}
    return out


def compare(name: str, promised: dict[str, Any], seen: dict[str, dict[str, Any]]) -> list[dict]:
    """Differences between the promised view and the live mount table: a promised mount
    missing or with other access, a tmpfs of another size, and any writable mount the
    promise does not have (the worst kind: a place to write that nobody reviewed)."""
    out = []

    def diff(key: str, expected: Any, observed: Any, detail: str) -> None:
        out.append({"worker": name, "key": f"filesystem.{key}", "expected": expected,
                    "observed": observed, "detail": detail})

    want = {m["path"]: m for m in promised.get("mounts", []) if m["what"] != "symlink"}
    for path in promised.get("masked", []) + promised.get("hidden", []):
        want[path] = {"path": path, "what": "masked", "access": "ro", "size": None}
    for path, m in want.items():
        got = seen.get(path)
        if got is None:
            if m["what"] in ("root",):
                continue
            diff(path, m["access"], None, f"{name}: {m['what']} {path} is not mounted")
            continue
        if got["access"] != m["access"]:
            diff(path, m["access"], got["access"],
                 f"{name}: {path} is mounted {got['access']}, the policy says {m['access']}")
        if m.get("size") and got.get("size") and abs(got["size"] - m["size"]) > 4096:
            diff(path, m["size"], got["size"],
                 f"{name}: tmpfs {path} is {got['size']} bytes, the policy says {m['size']}")
    has_dev = any(m["what"] == "dev" for m in want.values())
    for path, got in seen.items():
        if path in want or got["access"] != "rw" or got["fstype"] in ("proc",):
            continue
        if has_dev and path.startswith("/dev/") and path[5:].split("/")[0] in DEV_NODES \
                and got["fstype"] in ("devtmpfs", "devpts", "tmpfs"):
            continue      # bwrap --dev's own nodes
        diff(path, None, "rw", f"{name}: {path} ({got['fstype']}) is mounted writable and "
                               "is not in the policy")
    return out
