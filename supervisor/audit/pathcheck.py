"""Each interference path checked on the running processes (``audit --live``): the fds
and mappings that carry it have the access the mechanism relies on.

Input: the paths (paths.py) and the evidence running.py read: per worker its fds by
target, its channel handles (fd numbers, from bwrap's --setenv), its channel mappings
and mount table; the supervisor's own fds and mappings. Output: one check per path
instance, {path, check, observed, ok}, and a difference for every failed one."""
from __future__ import annotations

import os
from typing import Any

from supervisor.config import Config

from .paths import SUPERVISOR


def _fd(e: dict[str, Any], fd: Any) -> dict[str, Any] | None:
    """{target, access, nonblock} of fd number ``fd`` in a worker's evidence."""
    if fd is None:
        return None
    for target, items in (e.get("fds") or {}).items():
        for i in items:
            if i["fd"] == int(fd):
                return dict(i, target=target)
    return None


def _seg(target: str | None) -> str:
    return (target or "closed").removeprefix("/memfd:").removesuffix(" (deleted)")


class _Checks:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.diffs: list[dict[str, Any]] = []

    def add(self, path: str, worker: str | None, check: str, observed: str, ok: bool) -> None:
        self.rows.append({"path": path, "check": check, "observed": observed, "ok": ok})
        if not ok:
            self.diffs.append({"worker": worker, "key": f"paths.{path}", "expected": check,
                               "observed": observed, "detail": f"{path}: expected {check}; "
                                                               f"observed {observed}"})


def _data(c: _Checks, p: dict, ew: dict, er: dict | None, got: dict) -> None:
    ch, w, r = p["channel"], p["writer"], p["reader"]
    wh = (ew.get("handles") or {}).get(ch) or {}
    f = _fd(ew, wh.get("data_fd"))
    maps = (ew.get("channel_mappings") or {}).get(ch, {}).get("data", [])
    ok = bool(f) and _seg(f["target"]) == f"trio-bridge:{ch}" and f["access"] == "O_RDWR"
    c.add(p["id"], w, f"{w}: segment fd O_RDWR, mapped rw-s",
          f"fd {wh.get('data_fd')} {_seg(f and f['target'])} {f and f['access']}, "
          f"mapped {','.join(maps) or 'not mapped'}", ok and maps == ["rw-s"])
    mode = segment_mode(got, ch)
    if mode is not None:
        c.add(p["id"], None, f"segment {ch}: inode mode 0400 (no one re-opens it writable)",
              f"mode {mode:04o}", mode & 0o222 == 0)
    if r == SUPERVISOR:
        m = (got.get("supervisor_channel_mappings") or {}).get(ch, {}).get("data", [])
        c.add(p["id"], None, "supervisor (monitor): segment mapped read-only",
              f"mapped {','.join(m) or 'not mapped'}", not any("w" in x for x in m))
        return
    if er is None or not er.get("running"):
        c.add(p["id"], r, f"{r} running", "not running", False)
        return
    rh = (er.get("handles") or {}).get(ch) or {}
    f = _fd(er, rh.get("data_fd"))
    maps = (er.get("channel_mappings") or {}).get(ch, {}).get("data", [])
    ok = bool(f) and _seg(f["target"]) == f"trio-bridge:{ch}" and f["access"] == "O_RDONLY"
    c.add(p["id"], r, f"{r}: segment fd O_RDONLY, mapped r--s only",
          f"fd {rh.get('data_fd')} {_seg(f and f['target'])} {f and f['access']}, "
          f"mapped {','.join(maps) or 'not mapped'}",
          ok and bool(maps) and not any("w" in x for x in maps))


def _lease(c: _Checks, p: dict, ew: dict, er: dict | None, got: dict, index: int) -> None:
    # A lease table is written by the channel's reader and read by the channel's writer.
    ch, cw, lw = p["channel"], p["reader"], p["writer"]
    wh = (ew.get("handles") or {}).get(ch) or {}
    lease_fds = wh.get("lease_fds") or []
    f = _fd(ew, lease_fds[index]) if index < len(lease_fds) else None
    maps = (ew.get("channel_mappings") or {}).get(ch, {}).get("leases", {}).get(str(index), [])
    c.add(p["id"], cw, f"{cw} (channel writer): lease{index} fd O_RDONLY, mapped r--s",
          f"{_seg(f and f['target'])} {f and f['access']}, mapped "
          f"{','.join(maps) or 'not mapped'}",
          bool(f) and _seg(f["target"]) == f"trio-bridge:{ch}:lease{index}"
          and f["access"] == "O_RDONLY" and not any("w" in x for x in maps))
    if lw == SUPERVISOR or er is None or not er.get("running"):
        return
    seen = lease_contents(got, ch, index)
    if seen is not None:
        # The bytes themselves, as the channel writer reads them: what the reader claims
        # now. A claim beyond lease_ms is not an error of the bound: the writer ignores it.
        c.add(p["id"], lw, f"{lw} (reader {index}): the claims it wrote, as {cw} reads them",
              seen, True)
    rh = (er.get("handles") or {}).get(ch) or {}
    f = _fd(er, rh.get("lease_fd"))
    c.add(p["id"], lw, f"{lw} (reader {index}): its own lease{index} only, fd O_RDWR",
          f"{_seg(f and f['target'])} {f and f['access']}",
          bool(f) and _seg(f["target"]) == f"trio-bridge:{ch}:lease{rh.get('index')}"
          and rh.get("index") == index and f["access"] == "O_RDWR")


def segment_mode(got: dict, ch: str) -> int | None:
    """The permission bits of channel ``ch``'s segment inode (through the supervisor's fd)."""
    import stat

    pid = got.get("supervisor_pid")
    fds = (got.get("supervisor_fds") or {}).get(f"/memfd:trio-bridge:{ch} (deleted)")
    if not pid or not fds:
        return None
    try:
        return stat.S_IMODE(os.stat(f"/proc/{pid}/fd/{fds[0]['fd']}").st_mode)
    except OSError:
        return None


def lease_contents(got: dict, ch: str, index: int) -> str | None:
    """Lease table ``index`` of channel ``ch`` read through the supervisor's own fd (it
    created every table): the live entries and how far ahead their deadlines are."""
    import time

    from supervisor.ipc import layout as L

    pid = got.get("supervisor_pid")
    fds = (got.get("supervisor_fds") or {}).get(f"/memfd:trio-bridge:{ch}:lease{index} (deleted)")
    if not pid or not fds:
        return None
    try:
        fd = os.open(f"/proc/{pid}/fd/{fds[0]['fd']}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        page = os.pread(fd, L.LEASE_BASE + L.LEASE_STRIDE * 16, 0)
    finally:
        os.close(fd)
    now = time.monotonic_ns()
    magic, owner, max_leases = L.LEASE_HDR.unpack_from(page, 0)
    if magic != L.LEASE_MAGIC:
        return "no lease table header (reader not attached yet)"
    live = []
    for k in range(min(max_leases, 16)):
        slot, gen, deadline = L.LEASE_ENTRY.unpack_from(page, L.lease_offset(k))
        if gen:
            live.append(f"slot {slot} gen {gen} for {(deadline - now) / 1e6:.1f} ms more")
    return (f"{len(live)} of {max_leases} lease(s) held" + (": " + "; ".join(live) if live
                                                             else "") +
            f" (written by pid {owner} inside its sandbox)")


def _wakeup(c: _Checks, p: dict, ew: dict, er: dict | None, index: int, reverse: bool) -> None:
    ch = p["channel"]
    writer = p["reader"] if reverse else p["writer"]
    wh = (ew.get("handles") or {}).get(ch) or {}
    ev_fds = wh.get("event_fds") or []
    f = _fd(ew, ev_fds[index]) if index < len(ev_fds) else None
    if reverse:
        c.add(p["id"], writer, f"{writer} (channel writer): its end a non-blocking socket",
              f"{f and f['target']}, {'non-blocking' if f and f['nonblock'] else 'BLOCKING'}",
              bool(f) and f["target"].startswith("socket:") and f["nonblock"])
        return
    reader = p["reader"]
    if reader == SUPERVISOR or er is None or not er.get("running"):
        c.add(p["id"], writer, f"{writer}: wake-up socket {index} open",
              f"{f and f['target']}", bool(f) and f["target"].startswith("socket:"))
        return
    rh = (er.get("handles") or {}).get(ch) or {}
    g = _fd(er, rh.get("event_fd"))
    same = bool(f and g) and f["target"] != g["target"]     # two ends, two inodes
    c.add(p["id"], reader, f"{reader}: its own end of a socketpair (not the writer's)",
          f"{g and g['target']} (writer's end {f and f['target']})",
          bool(g) and g["target"].startswith("socket:") and same)


def _pipes(c: _Checks, p: dict, e: dict, got: dict) -> None:
    sup = got.get("supervisor_fds") or {}
    w = p["writer"]
    if p["kind"] == "status pipe":
        f = _fd(e, e.get("status_fd"))
        held = [i for i in sup.get(f["target"], []) if i["access"] == "O_RDONLY"] if f else []
        c.add(p["id"], w, f"{w}: status fd a pipe O_WRONLY, read end held by the supervisor",
              f"{f and f['target']} {f and f['access']}; supervisor "
              f"{'holds the read end' if held else 'does NOT hold it'}",
              bool(f) and f["target"].startswith("pipe:") and f["access"] == "O_WRONLY"
              and bool(held))
    elif p["kind"] == "output pipe":
        outs = [_fd(e, 1), _fd(e, 2)]
        ok = all(f and f["target"].startswith("pipe:") and any(
            i["access"] == "O_RDONLY" for i in sup.get(f["target"], [])) for f in outs)
        c.add(p["id"], w, f"{w}: stdout and stderr a pipe read by the supervisor",
              ", ".join(str(f and f["target"]) for f in outs), ok)
    elif p["kind"] == "exec-watch notifications":
        listeners = sum(len(v) for k, v in sup.items() if "seccomp" in k)
        mine = (e.get("exec_watch") or {}).get("worker_holds_listener")
        c.add(p["id"], w, f"{w} holds no seccomp listener; the supervisor holds listeners",
              f"worker {'HOLDS one' if mine else 'holds none'}; supervisor holds {listeners}",
              not mine and listeners > 0)


def check_paths(cfg: Config, paths: list[dict[str, Any]], got: dict[str, Any],
                state_dir: str | None) -> tuple[list[dict], list[dict]]:
    c = _Checks()
    ev = got.get("workers") or {}
    index = {}
    for name in cfg.channels:
        readers = cfg.readers_of(name)
        for i, r in enumerate([*readers, SUPERVISOR]):
            index[(name, r)] = i
    for p in paths:
        kind = p["kind"]
        if p.get("channel"):
            ch = p["channel"]
            writer = cfg.writer_of(ch)
            reader = p["reader"] if kind in ("channel data", "wake-up socket") else p["writer"]
            ew = ev.get(writer)
            if ew is None or not ew.get("running"):
                c.add(p["id"], writer, f"{writer} running", "not running", False)
                continue
            er = ev.get(reader)
            i = index.get((ch, reader), 0)
            if kind == "channel data":
                _data(c, p, ew, er, got)
            elif kind == "lease table":
                _lease(c, p, ew, er, got, i)
            elif kind in ("wake-up socket", "wake-up socket (reverse)"):
                _wakeup(c, p, ew, er, i, kind.endswith("(reverse)"))
        elif kind in ("status pipe", "output pipe", "exec-watch notifications"):
            e = ev.get(p["writer"])
            if e and e.get("running"):
                _pipes(c, p, e, got)
        elif kind == "standby control socket":
            name = p["reader"].split()[0]
            sb = (ev.get(name) or {}).get("standby")
            c.add(p["id"], name, f"{name}: a warm standby sandbox waits",
                  f"standby pid {sb.get('pid')}" if sb else "no standby running", bool(sb))
        elif kind == "state directory" and state_dir:
            _state_dir(c, p, ev, state_dir)
        elif kind == "shared CPU and memory (cgroups)":
            _cgroups(c, p, ev)
        elif kind == "signals, ptrace, /proc":
            _processes(c, p, cfg, ev)
        elif kind == "drive log / written files" and p["id"] == "files.none":
            _no_shared_files(c, p, ev)
    return c.rows, c.diffs


def _cgroups(c: _Checks, p: dict, ev: dict) -> None:
    """Each worker of the writing domain sits in a cgroup of its own, limits in force."""
    for name in p["writer"].split(", "):
        e = ev.get(name) or {}
        if not e.get("running"):
            continue
        cg = e.get("cgroup") or {}
        others = [n for n, x in ev.items() if n != name and x.get("running") and
                  (x.get("cgroup") or {}).get("paths") == cg.get("paths")]
        c.add(p["id"], name, f"{name}: a member of a cgroup of its own",
              f"cgroup v{cg.get('version')} {', '.join(cg.get('paths') or ['none'])}"
              + (f", SHARED with {', '.join(others)}" if others else ""),
              bool(cg.get("member")) and not others)


def _processes(c: _Checks, p: dict, cfg: Config, ev: dict) -> None:
    uids: dict[str, set[int]] = {}
    for name, e in ev.items():
        if e.get("running"):
            uids.setdefault(cfg.workers[name].domain, set()).add(
                int(e["status"]["Uid"].split()[1]))
    shared = [(a, b) for a in uids for b in uids if a < b and uids[a] & uids[b]]
    c.add(p["id"], None, "each domain runs as its own host uids, none as root",
          "; ".join(f"{d}: {sorted(u)}" for d, u in sorted(uids.items())),
          not shared and all(0 not in u for u in uids.values()))


def _no_shared_files(c: _Checks, p: dict, ev: dict) -> None:
    from .fsview import DEV_NODES

    for name, e in ev.items():
        if not e.get("running"):
            continue
        rw = [m for m, x in (e.get("mounts") or {}).items() if x["access"] == "rw"
              and x["fstype"] not in ("proc",) and m not in ("/tmp", "/dev/shm")
              and not (m.startswith("/dev/") and m[5:].split("/")[0] in DEV_NODES)]
        c.add(p["id"], name, f"{name}: writable only /tmp, /dev/shm (private tmpfs) and "
              "bwrap's device nodes", ", ".join(rw) or "nothing else", not rw)


def _state_dir(c: _Checks, p: dict, ev: dict, state_dir: str) -> None:
    from .evidence import resolve_in_root

    seen = []
    for name, e in ev.items():
        if e.get("running"):
            _final, st = resolve_in_root(f"/proc/{e['pid']}/root", state_dir)
            if st is not None:
                seen.append(name)
    c.add(p["id"], None, f"{state_dir} exists in no sandbox",
          f"visible in {', '.join(seen)}" if seen else "in none", not seen)


def state_dir_of(cfg: Config, env_dir: str | None) -> str:
    return env_dir or os.environ.get("TRIO_STATE_DIR") or cfg.supervisor.state_dir
