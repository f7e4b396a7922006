"""What a control-domain worker can see of the file system, against the host.

    python bench/control_view.py [--json FILE] [--timeout 60]

Starts one real control sandbox (`policy_for_domain("control")`, `sandbox.launch.run`,
the same bwrap/seccomp/host uid a control worker gets) running a small walker under
the interpreter the workers use. The walker `os.walk`s "/" without following symlinks
and without staying on one file system (every bind is its own mount), skipping /proc,
/sys and /dev, and counts per bound tree: regular files, their bytes (apparent size,
st_size, every path counted), directories, symlinks, other nodes, unreadable dirs.
It also lists every path whose name is torch-like and the top-level entries of each
visible site-packages with their file counts and bytes.

This process then walks the same trees on the host (as root), so each row shows
visible / host, and lists the site-packages entries the sandbox does not show.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import stat
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from supervisor.sandbox import policy_for_domain  # noqa: E402
from supervisor.sandbox.launch import run  # noqa: E402

# Must never be visible in control: a torch package / module / dist-info / .pth directly
# in an import directory (site-packages), or a libtorch* / libc10* library anywhere.
TORCH_TOP_RE = r"^(torch|functorch|torchgen)(\.py|\.pth|-[^/]*\.(dist|egg)-info|\.egg-info)?$"
TORCH_LIB_RE = r"^lib(torch|c10)[^/]*\.so(\.[^/]*)?$"

# The walker: stdlib only, runs inside the sandbox; argv[1] = JSON {"roots":[...], "sites":[...]}.
WALKER = r'''
import json, os, re, stat, sys, time
arg = json.loads(sys.argv[1])
roots = sorted(arg["roots"], key=len, reverse=True)
sites = arg["sites"]
top_re, lib_re = re.compile(arg["top_re"]), re.compile(arg["lib_re"])
import importlib.util
specs = {m: str(importlib.util.find_spec(m)) for m in ("torch", "functorch", "torchgen")}
SKIP = {"/proc", "/sys", "/dev"}
t0 = time.monotonic()

def tree_of(p):
    for r in roots:
        if p == r or p.startswith(r.rstrip("/") + "/"):
            return r
    return "(other)"

def new():
    return {"files": 0, "bytes": 0, "dirs": 0, "symlinks": 0, "other": 0, "errors": 0}

trees = {}
site_entries = {s: {} for s in sites}
torch_hits, torch_like, err_samples = [], [], []
top = sorted(os.listdir("/"))

def onerror(e):
    t = trees.setdefault(tree_of(e.filename or "/"), new())
    t["errors"] += 1
    if len(err_samples) < 10:
        err_samples.append(f"{e.filename}: {e.strerror}")

for dirpath, dirnames, filenames in os.walk("/", onerror=onerror, followlinks=False):
    if dirpath == "/":
        dirnames[:] = [d for d in dirnames if "/" + d not in SKIP]
    for name in dirnames + filenames:
        p = os.path.join(dirpath, name)
        if (dirpath in sites and top_re.match(name)) or lib_re.match(name):
            torch_hits.append(p)
        elif "torch" in name.lower():
            torch_like.append(p)
        try:
            st = os.lstat(p)
        except OSError as e:
            onerror(e)
            continue
        t = trees.setdefault(tree_of(p), new())
        site = next((s for s in sites if p.startswith(s + "/")), None)
        ent = None
        if site is not None:
            top_name = p[len(site) + 1:].split("/", 1)[0]
            ent = site_entries[site].setdefault(top_name, [0, 0])
        if stat.S_ISDIR(st.st_mode):
            t["dirs"] += 1
        elif stat.S_ISLNK(st.st_mode):
            t["symlinks"] += 1
            if ent is not None and "/" not in p[len(site) + 1:]:
                ent[0] += 1
        elif stat.S_ISREG(st.st_mode):
            t["files"] += 1
            t["bytes"] += st.st_size
            if ent is not None:
                ent[0] += 1
                ent[1] += st.st_size
        else:
            t["other"] += 1

print(json.dumps({"trees": trees, "site_entries": site_entries, "torch_hits": torch_hits,
                  "torch_like": torch_like, "find_spec": specs,
                  "errors": err_samples, "root_listing": top, "uid": os.getuid(),
                  "walk_s": time.monotonic() - t0}))
'''


def host_walk(roots: list[str], sites: list[str]) -> dict:
    """The same walk on the host, restricted to the given trees."""
    trees: dict[str, dict] = {}
    site_entries: dict[str, dict[str, list[int]]] = {s: {} for s in sites}
    top_re, lib_re = re.compile(TORCH_TOP_RE), re.compile(TORCH_LIB_RE)
    torch_hits: list[str] = []
    for root in roots:
        t = trees[root] = {"files": 0, "bytes": 0, "dirs": 0, "symlinks": 0, "other": 0,
                           "errors": 0}
        st0 = os.lstat(root)
        if not stat.S_ISDIR(st0.st_mode):          # a single bound file (/etc/passwd)
            if stat.S_ISREG(st0.st_mode):
                t["files"], t["bytes"] = 1, st0.st_size
            elif stat.S_ISLNK(st0.st_mode):
                t["symlinks"] = 1
            continue
        others = [r for r in roots if r != root and r.startswith(root.rstrip("/") + "/")]
        def onerror(e: OSError, t: dict = t) -> None:
            t["errors"] += 1

        for dirpath, dirnames, filenames in os.walk(root, followlinks=False, onerror=onerror):
            # a nested bound tree is counted on its own row
            dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in others]
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                if (dirpath in sites and top_re.match(name)) or lib_re.match(name):
                    torch_hits.append(p)
                try:
                    st = os.lstat(p)
                except OSError:
                    t["errors"] += 1
                    continue
                site = next((s for s in sites if p.startswith(s + "/")), None)
                ent = None
                if site is not None:
                    ent = site_entries[site].setdefault(p[len(site) + 1:].split("/", 1)[0], [0, 0])
                if stat.S_ISDIR(st.st_mode):
                    t["dirs"] += 1
                elif stat.S_ISLNK(st.st_mode):
                    t["symlinks"] += 1
                    if ent is not None and "/" not in p[len(site) + 1:]:
                        ent[0] += 1
                elif stat.S_ISREG(st.st_mode):
                    t["files"] += 1
                    t["bytes"] += st.st_size
                    if ent is not None:
                        ent[0] += 1
                        ent[1] += st.st_size
                else:
                    t["other"] += 1
    return {"trees": trees, "site_entries": site_entries, "torch_hits": torch_hits}


def group_of(root: str, prefix_dirs: list[str], project: list[str]) -> str:
    if root == "/usr":
        return "/usr"
    if root.startswith("/etc/") or root == "/etc":
        return "/etc (bound files)"
    if root in project:
        return "project packages"
    if root in prefix_dirs:
        return "interpreter prefix"
    if root == "/tmp":
        return "/tmp (private tmpfs)"
    if root == "(other)":
        return "(other: sandbox root)"
    return root


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="FILE", help="also write everything as JSON ('-' = stdout)")
    ap.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args()

    from supervisor.sandbox.policy import project_packages, python_dirs

    pol = policy_for_domain("control")
    prefix_dirs = [p for p in pol.ro_binds if p in python_dirs() or
                   any(p == os.path.abspath(q) for q in python_dirs())]
    project = [p for p in pol.ro_binds if p in project_packages()]
    # Bound trees that are real directories or files (not the merged-/usr symlinks).
    roots = [p for p in pol.ro_binds if not os.path.islink(p)] + ["/tmp"]
    sites = sorted({os.path.realpath(s) for r in pol.ro_binds
                    for s in glob.glob(os.path.join(r, "lib", "python3*", "*-packages"))})
    sites += [p for p in pol.ro_binds if os.path.basename(p) in ("site-packages", "dist-packages")]
    sites = sorted(set(sites))
    # Site-packages inside the prefix get their own row (sub-tree of the prefix row).
    walk_roots = roots + [s for s in sites if s not in roots]
    arg = json.dumps({"roots": walk_roots, "sites": sites, "top_re": TORCH_TOP_RE,
                      "lib_re": TORCH_LIB_RE})

    t0 = time.monotonic()
    res = run(pol, [sys.executable, "-c", WALKER, arg], timeout=a.timeout)
    t_sandbox = time.monotonic() - t0
    if res.returncode != 0:
        print(f"walker failed in the sandbox: exit {res.returncode}\n{res.stderr[-3000:]}",
              file=sys.stderr)
        return 1
    inside = json.loads(res.stdout)
    t1 = time.monotonic()
    host = host_walk([r for r in walk_roots if r != "/tmp"], sites)
    t_host = time.monotonic() - t1

    # Rows: each bound tree; the site-packages row is a sub-tree of the prefix row, so the
    # prefix row is shown with and without it.
    L: list[str] = []
    L.append(f"Control sandbox (uid inside {inside['uid']}, host uid {pol.host_uid}): "
             f"walk of / (minus /proc /sys /dev) {inside['walk_s']:.1f} s inside, "
             f"{t_sandbox:.1f} s with sandbox start; host walk of the same trees {t_host:.1f} s.")
    L.append(f"Top level of / inside: {' '.join(inside['root_listing'])}")
    L.append("")
    L.append("| bound tree | files visible | bytes visible | files on host | bytes on host "
             "| visible/host bytes | symlinks | dirs | masked (char dev) | unreadable |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    groups: dict[str, dict] = {}
    hgroups: dict[str, dict] = {}
    order: list[str] = []
    for r in walk_roots + ["(other)"]:
        g = group_of(r, prefix_dirs, project)
        if r in sites:
            g = f"  of which site-packages ({r})"
        if g not in order:
            order.append(g)
        for src, dst in ((inside["trees"].get(r), groups), (host["trees"].get(r), hgroups)):
            if src is None:
                continue
            acc = dst.setdefault(g, {"files": 0, "bytes": 0, "dirs": 0, "symlinks": 0,
                                     "other": 0, "errors": 0})
            for k in acc:
                acc[k] += src.get(k, 0)
    # The inside walk assigns site-packages paths to the site row (longest root first) and
    # the host walk prunes nested roots, so on both sides the prefix row excludes them and
    # every file is counted once in the total.
    tot_in = {"files": 0, "bytes": 0}
    tot_host = {"files": 0, "bytes": 0}
    for g in order:
        i = groups.get(g) or dict.fromkeys(("files", "bytes", "dirs", "symlinks", "other",
                                            "errors"), 0)
        h = hgroups.get(g)
        for k in tot_in:
            tot_in[k] += i[k]
            tot_host[k] += h[k] if h else 0
        hf = f"{h['files']:,}" if h else "-"
        hb = human(h["bytes"]) if h else "-"
        ratio = f"{100 * i['bytes'] / h['bytes']:.1f} %" if h and h["bytes"] else "-"
        name = g if not g.startswith("  ") else g.strip()
        if g == "interpreter prefix":
            name = "interpreter prefix (" + ", ".join(prefix_dirs) + "), without site-packages"
        if g == "project packages":
            name = "project packages (" + ", ".join(os.path.basename(p) for p in project) + ")"
        if g == "/etc (bound files)":
            name = "/etc (" + ", ".join(os.path.basename(p) for p in pol.ro_binds
                                        if p.startswith("/etc/") and not os.path.islink(p)) + ")"
        L.append(f"| {name} | {i['files']:,} | {human(i['bytes'])} | {hf} | {hb} | {ratio} | "
                 f"{i['symlinks']:,} | {i['dirs']:,} | {i['other']} | {i['errors']} |")
    L.append(f"| **total** | **{tot_in['files']:,}** | **{human(tot_in['bytes'])}** | "
             f"{tot_host['files']:,} | {human(tot_host['bytes'])} | "
             f"{100 * tot_in['bytes'] / max(tot_host['bytes'], 1):.1f} % | | | | |")
    L.append("")
    L.append("Host columns: the same paths walked on the host as root (for /etc only the bound "
             "files; the rest of the host /etc is not bound). Merged-/usr links (/bin /sbin /lib "
             "/lib64) are symlinks inside too and are not walked twice. `masked`: compilers "
             "replaced by /dev/null; toolchain directories (/usr/lib/gcc, ...) are empty tmpfs "
             "inside, hence fewer files in /usr.")
    L.append("")
    hits = inside["torch_hits"]
    L.append(f"**Torch visible inside: {len(hits)}**"
             + (": " + ", ".join(hits[:20]) if hits else " (none)")
             + f" -- a torch/functorch/torchgen package, module, .pth or dist-info directly in a "
             f"site-packages, or a libtorch*/libc10* library anywhere; on the host, in the same "
             f"trees: {len(host['torch_hits'])}.")
    L.append("`importlib.util.find_spec` inside: "
             + ", ".join(f"{m} -> {v}" for m, v in inside["find_spec"].items()))
    like = inside["torch_like"]
    L.append(f"Other visible paths with 'torch' in the name ({len(like)}; parts of other "
             f"packages or console scripts, not torch itself):"
             + ("" if like else " none"))
    for q in like[:20]:
        L.append(f"- `{q}`")
    L.append("")
    L.append("| site-packages | entries inside / host | files inside / host | bytes inside / host "
             "| visible bytes |")
    L.append("|---|---:|---:|---:|---:|")
    site_cmp = {}
    notes: list[str] = []
    for s in sites:
        vi = inside["site_entries"].get(s, {})
        vh = host["site_entries"].get(s, {})
        hidden = sorted(set(vh) - set(vi))
        extra = sorted(set(vi) - set(vh))
        differ = sorted(n for n in set(vi) & set(vh) if vi[n] != vh[n])
        fi, bi = sum(x[0] for x in vi.values()), sum(x[1] for x in vi.values())
        fh, bh = sum(x[0] for x in vh.values()), sum(x[1] for x in vh.values())
        L.append(f"| {s} | {len(vi)} / {len(vh)} | {fi:,} / {fh:,} | {human(bi)} / {human(bh)} "
                 f"| {100 * bi / max(bh, 1):.1f} % |")
        notes.append(f"Hidden top-level entries of {s}: {len(hidden)}"
                     + (f" ({sum(vh[n][0] for n in hidden):,} files, "
                        f"{human(sum(vh[n][1] for n in hidden))} on the host)" if hidden else ""))
        notes += [f"- `{n}`: {vh[n][0]:,} files, {human(vh[n][1])}" for n in hidden]
        big = sorted(vi, key=lambda n: -vi[n][1])[:8]
        if big:
            notes.append(f"Largest visible entries of {s}: "
                         + ", ".join(f"{n} {human(vi[n][1])}" for n in big))
        if extra:
            notes.append(f"Visible inside but not on the host: {', '.join(extra)}")
        if differ:
            notes.append("Entries whose counts differ inside vs host (permissions?): "
                         + ", ".join(f"{n} {vi[n]} vs {vh[n]}" for n in differ[:20]))
        site_cmp[s] = {"inside": {"entries": len(vi), "files": fi, "bytes": bi},
                       "host": {"entries": len(vh), "files": fh, "bytes": bh},
                       "hidden": {n: vh[n] for n in hidden}, "extra": extra, "differ": differ}
    L.append("")
    L += notes
    if inside["errors"]:
        L.append("")
        L.append("Unreadable inside (first ones): " + "; ".join(inside["errors"]))
    print("\n".join(L))
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}; Python {platform.python_version()}; "
          f"kernel {platform.release()}")
    if a.json:
        doc = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "policy_ro_binds": pol.ro_binds,
               "policy_hidden": pol.hidden, "inside": inside, "host": host,
               "groups_inside": groups, "groups_host": hgroups, "site_packages": site_cmp,
               "torch_visible": len(hits)}
        text = json.dumps(doc, indent=1)
        if a.json == "-":
            print(text)
        else:
            Path(a.json).write_text(text)
    return 0 if not hits else 2


if __name__ == "__main__":
    sys.exit(main())
