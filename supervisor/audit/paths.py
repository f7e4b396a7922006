"""Interference paths: every way one domain's process can put bytes (or load) where
another domain's process (or the supervisor) reads or feels them.

Derived from the config and from the mechanisms in the code, never a hand list: the
channel table gives who writes and who reads which segment (`Config.writer_of`,
`readers_of`, the reader index the supervisor hands out in that order, the monitor at
the spare index after them), the spec gives the bounds (`ChannelSpec.lease_ms`,
`max_leases`, `slot_count`, `max_readers`, `crc`, `max_age_ms`), the supervisor's
classes give the pipe limits (`Supervisor.STATUS_LINES_PER_S`, `output.LineLimiter`),
and the domains' binds give the files they share. What each mechanism is (who maps what
with which protection) is the code in supervisor/ipc/channel.py (`Channel.create`,
`writer_handle`, `reader_handle`), shm.py (O_RDONLY re-open, mode 0400),
writer.py (`Writer._protected`: a lease counts only for the slot's current generation
and within lease_ms) and reader.py (`Reader._drain`: the reader reads its wake-up
socket, the writer never reads its end). Workers' writers do not seal their segment (a
restarted writer maps it again: supervisor/worker.py), so a reader's read-only access
rests on its O_RDONLY description and the inode's mode 0400, not on a seal.

Each path: {id, kind, direction, from, to, writer, reader, carries, worst, bound,
crosses (different domains), live (what ``audit --live`` checks)}; ``from``/``to`` are
domain names or "supervisor".
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from supervisor.config import Config

SUPERVISOR = "supervisor"


@dataclass(frozen=True)
class Path:
    id: str
    kind: str
    source: str          # the writing domain (or "supervisor")
    target: str          # the reading domain (or "supervisor")
    writer: str          # process (worker name, or "supervisor")
    reader: str
    carries: str         # what bytes go from writer to reader
    worst: str           # the worst a hostile writer can do to the reader through it
    bound: str           # the mechanism that bounds it
    live: str = ""       # what `audit --live` checks on the running processes
    channel: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["from"], d["to"] = d.pop("source"), d.pop("target")
        d["direction"] = f"{self.source} -> {self.target}"
        d["crosses"] = self.source != self.target
        return d


def _domain(cfg: Config, worker: str) -> str:
    return cfg.workers[worker].domain if worker in cfg.workers else SUPERVISOR


def _channel_paths(cfg: Config, name: str) -> list[Path]:
    ch = cfg.channels[name]
    s = ch.spec
    writer = cfg.writer_of(name)
    wd = _domain(cfg, writer)
    readers = cfg.readers_of(name)
    # The monitor takes the spare index after the workers' (Supervisor._run_monitor).
    endpoints = [*readers, SUPERVISOR] if len(readers) < s.max_readers else readers
    checks = ["seqlock generation", "header and layout against the spec"]
    if s.crc:
        checks.append("CRC-32 of the payload")
    if s.max_age_ms:
        checks.append(f"age <= max_age_ms {s.max_age_ms} ms")
    out: list[Path] = []
    for index, reader in enumerate(endpoints):
        rd = _domain(cfg, reader)
        log_only = reader in cfg.workers and name in cfg.workers[reader].shadow_subscribes
        use = ("log only (shadow_subscribes): never an input of its outputs" if log_only else
               "counts and shows it on the status line, never acts on it"
               if reader == SUPERVISOR else "an input of what it publishes")
        out.append(Path(
            id=f"{name}.data.{reader}", kind="channel data", channel=name,
            source=wd, target=rd, writer=writer, reader=reader,
            carries=f"{s.slot_count} slots of {s.slot_size} bytes ({s.kind}, {s.dtype}); "
                    f"reader {index}: {use}",
            worst=("any bytes it likes in the slots it publishes (a forged message within "
                   f"slot_size {s.slot_size}), or none (a stale stream); it cannot write "
                   "the reader's memory"),
            bound=(f"the reader maps the segment read-only: its own O_RDONLY description "
                   f"of a mode-0400 memfd it cannot re-open writable (no capabilities, "
                   f"another owner's inode); it rejects what fails: {', '.join(checks)}"
                   + ("" if not ch.actuation else "; when its writer dies, and on "
                      "fail-safe, the supervisor publishes the payload's safe value as "
                      "writer of last resort")),
            live=f"{writer}: data rw-s, fd O_RDWR; {reader}: data r--s, fd O_RDONLY"))
        out.append(Path(
            id=f"{name}.lease.{reader}", kind="lease table", channel=name,
            source=rd, target=wd, writer=reader, reader=writer,
            carries=(f"lease table {index} (one page): up to max_leases {s.max_leases} "
                     "entries (slot, generation, deadline) saying which slots the writer "
                     "must skip, and two wake-up hints (awake, busy-polling)"),
            worst=(f"make the writer skip up to {s.max_leases} slot(s) of {s.slot_count} "
                   f"for up to lease_ms {s.lease_ms} ms each; claim to be awake (the writer "
                   "then skips only this reader's wake-up) or busy-polling (one extra "
                   "wake-up byte per announcement to this reader)"),
            bound=(f"lease <= lease_ms ({s.lease_ms} ms) then the writer reclaims; a lease "
                   "counts only for the slot's current generation; slot_count "
                   f"{s.slot_count} > max_readers x max_leases {s.max_readers * s.max_leases}: "
                   "the writer always finds a free slot, never blocks; the writer maps the "
                   "table read-only"),
            live=f"{reader}: lease{index} rw-s, fd O_RDWR; {writer}: lease{index} r--s, "
                 "fd O_RDONLY"))
        out.append(Path(
            id=f"{name}.wakeup.{reader}", kind="wake-up socket", channel=name,
            source=wd, target=rd, writer=writer, reader=reader,
            carries="one byte per publish (and per announcement to a busy-polling reader) "
                    "on a stream socketpair; the reader drains it",
            worst="wake the reader without a message (it looks at shared memory, finds "
                  "nothing new, sleeps again): CPU of the reader, no data",
            bound="the reader trusts only the segment (every wake-up is followed by the "
                  "same checks); its end is non-blocking",
            live=f"{reader}: a socket fd per channel it reads"))
        out.append(Path(
            id=f"{name}.wakeup-back.{reader}", kind="wake-up socket (reverse)", channel=name,
            source=rd, target=wd, writer=reader, reader=writer,
            carries="nothing by design: the socketpair is bidirectional, but the writer "
                    "never reads its end",
            worst="fill the writer's receive buffer with bytes nobody reads; leave its own "
                  "end full so the writer's wake-up write fails",
            bound="the writer's writes are non-blocking on its own description and a "
                  "failure is ignored (the reader then sees the message on its next look); "
                  "kernel socket buffer size",
            live=f"{writer}: one socket fd per reader"))
    return out


OBSERVATION = "observation (slot choice)"


def _observation_paths(cfg: Config, name: str) -> list[Path]:
    """What a non-actuating domain can observe of an actuating one through a channel
    they both read (gate 9 finding 8; red team 14 row 9, known, not closed): the writer
    skips the slots a reader's leases hold, and every reader reads the header's
    last_slot to find the newest message, so one reader sees the other's pace. No
    bytes of the observed reader's and no effect on it: an inference, listed so that
    the signed report, not only docs/review.md, says it. (The reverse, control seeing
    research's pace, carries nothing control acts on; research's leases are bounded as
    the lease table's path says.)"""
    writer = cfg.writer_of(name)
    readers = [r for r in cfg.readers_of(name) if r in cfg.workers]
    out: list[Path] = []
    for seen in readers:
        sd = cfg.domains.get(_domain(cfg, seen))
        if sd is None or not sd.actuates:
            continue
        for by in readers:
            bd = cfg.domains.get(_domain(cfg, by))
            if bd is None or bd.actuates:
                continue
            out.append(Path(
                id=f"{name}.slotchoice.{by}", kind=OBSERVATION, channel=name,
                source=_domain(cfg, seen), target=_domain(cfg, by),
                writer=f"{seen} (through {writer}'s slot choice)", reader=by,
                carries=(f"which slot {writer} chose (the header's last_slot, which {by} "
                         f"reads to find the newest message): {writer} skips the slots "
                         f"{seen}'s leases hold, so the choice follows {seen}'s read pace"),
                worst=(f"{by} infers when {seen} reads and how long it holds a slot (red "
                       f"team 14 row 9: modeld's pace guessed 20 of 20); no bytes of "
                       f"{seen}'s, no effect on it"),
                bound="none (known, not closed): every reader of a channel sees the "
                      "writer's slot choice"))
    return out


def _pipe_paths(cfg: Config) -> list[Path]:
    from supervisor.lifecycle import Supervisor
    from supervisor.output import LineLimiter

    lim = LineLimiter()
    out = []
    for w in cfg.workers.values():
        out.append(Path(
            id=f"status.{w.name}", kind="status pipe", source=w.domain, target=SUPERVISOR,
            writer=w.name, reader=SUPERVISOR,
            carries="protocol lines READY, WATCHDOG, STATUS, REFUSED, STANDBY",
            worst="claim READY or keep pinging while doing nothing useful; flood lines "
                  "to slow the supervisor's event loop",
            bound=(f"one 4 KiB read per wake-up; lines over 4096 bytes dropped; more than "
                   f"{Supervisor.STATUS_LINES_PER_S:g} lines/s sustained is a refusal "
                   f"(the worker is killed and not restarted: its own loss, a fail-safe "
                   f"for a required control worker); {Supervisor.STATUS_EVENT_BURST:g} status events "
                   f"then {Supervisor.STATUS_EVENTS_PER_S:g}/s reach the log; READY of a "
                   "control worker is verified (maps snapshot) before it counts"),
            live=f"{w.name}: status pipe write end O_WRONLY, read end held by the supervisor"))
        out.append(Path(
            id=f"output.{w.name}", kind="output pipe", source=w.domain, target=SUPERVISOR,
            writer=w.name, reader=SUPERVISOR, carries="stdout and stderr lines, re-emitted "
            "as log events whose source is the worker",
            worst="fill the log with lies or noise under its own name",
            bound=(f"{lim.max_line} bytes a line kept, {lim.rate:g} lines/s after a burst "
                   f"of {lim.burst}; dropped lines are counted"),
            live=f"{w.name}: stdout/stderr are a pipe read by the supervisor, never a tty"))
        d = cfg.domains[w.domain]
        if not d.exec_memory_after_ready:
            out.append(Path(
                id=f"execwatch.{w.name}", kind="exec-watch notifications", source=w.domain,
                target=SUPERVISOR, writer=w.name, reader=SUPERVISOR,
                carries="a seccomp user notification per mmap/mprotect with PROT_EXEC and "
                        "per memfd_create: the call's arguments",
                worst="ask again and again (each request blocks only its own thread until "
                      "answered); race a mapping change under the supervisor's look",
                bound="the supervisor holds the only listener; before READY it allows file-"
                      "backed code from read-only mounts (and the declared jit kernels), "
                      "after READY nothing: the worker is killed" + (
                          "; from READY the kernel kills such calls itself (W^X filter, "
                          "checked by the supervisor before READY counts)" if _wx() else ""),
                live="strict workers: the supervisor's fds include the listener "
                     "(anon_inode:seccomp notify)"))
        if w.warm_standby:
            out.append(Path(
                id=f"standby.{w.name}", kind="standby control socket", source=SUPERVISOR,
                target=w.domain, writer=SUPERVISOR, reader=f"{w.name} (standby)",
                carries="the channel handles (fds) at take-over",
                worst="(supervisor is trusted)", bound="seqpacket socket to that standby only",
                live=f"{w.name} standby: one socket fd"))
    return out


def _wx() -> bool:
    from .syscalls import _wx as wx_module

    return wx_module() is not None


def _file_paths(cfg: Config) -> list[Path]:
    out = []
    state = os.environ.get("TRIO_STATE_DIR") or cfg.supervisor.state_dir
    seen_by = [n for n, d in cfg.domains.items()
               if any(_overlap(p, state) for p in (*d.extra_ro_binds, *d.extra_rw_binds))]
    out.append(Path(
        id="state-dir", kind="state directory", source=SUPERVISOR, target=SUPERVISOR,
        writer=SUPERVISOR, reader=SUPERVISOR,
        carries=f"the fail-safe latch in {state} (read at every start: latched = start "
                "nothing, exit 4)",
        worst="(only the supervisor writes it)",
        bound="not bound into any sandbox" if not seen_by else
              f"BOUND into domain(s) {', '.join(seen_by)}",
        live="no worker's mount table shows it"))
    any_rw = False
    for name, d in cfg.domains.items():
        for rw in d.extra_rw_binds:
            any_rw = True
            readers = [o for o, od in cfg.domains.items() if o != name and any(
                _overlap(p, rw) for p in (*od.extra_ro_binds, *od.extra_rw_binds))]
            writers = cfg.workers_in(name)
            for target in readers or [None]:
                out.append(Path(
                    id=f"files.{name}.{rw}", kind="drive log / written files",
                    source=name, target=target or "offline (supervisor replay)",
                    writer=", ".join(writers) or "-", reader=", ".join(
                        cfg.workers_in(target)) if target else "supervisor replay",
                    carries=f"files written below {rw}",
                    worst="any file content; a replay feeds recorded frames and time to "
                          "control (simulation mode only)",
                    bound="Landlock and the bind confine writes to this directory; a vehicle "
                          "config refuses replay arguments (supervisor.mode)",
                    live=f"{name}: {rw} mounted rw, no other domain mounts it"))
    if not any_rw:
        out.append(Path(
            id="files.none", kind="drive log / written files", source="-", target="-",
            writer="-", reader="-", carries="none: no domain has extra_rw_binds, so no "
            "sandbox can write a file another process reads (/tmp and /dev/shm are private "
            "tmpfs per sandbox)", worst="-", bound="read-only binds; root remounted ro",
            live="every worker's mounts outside /tmp, /dev/shm are read-only"))
    return out


def _overlap(a: str, b: str) -> bool:
    a, b = os.path.abspath(a).rstrip("/") + "/", os.path.abspath(b).rstrip("/") + "/"
    return a.startswith(b) or b.startswith(a)


def _resource_paths(cfg: Config) -> list[Path]:
    """CPU and memory: every domain's workers share the machine with every other's."""
    out = []
    names = list(cfg.domains)
    for src in names:
        ws = [cfg.workers[w] for w in cfg.workers_in(src)]
        if not ws:
            continue
        weight = sum(cfg.cpu_weight_of(w.name) for w in ws)
        quota = [w.cpu_quota for w in ws]
        cpu = ("unlimited" if any(q is None for q in quota)
               else f"{sum(q for q in quota):g} % of one CPU")
        mems = [w.memory_max for w in ws]
        mem = ("unlimited" if any(m is None for m in mems)
               else f"{sum(mems) / 2**30:.2f} GiB")
        pids = [w.pids_max for w in ws]
        for dst in names:
            if dst == src or not cfg.workers_in(dst):
                continue
            other = sum(cfg.cpu_weight_of(w) for w in cfg.workers_in(dst))
            rt = [w.name for w in (cfg.workers[x] for x in cfg.workers_in(dst))
                  if w.realtime_priority is not None]
            share = weight / (weight + other) if weight + other else 0
            out.append(Path(
                id=f"resources.{src}.{dst}", kind="shared CPU and memory (cgroups)",
                source=src, target=dst, writer=", ".join(w.name for w in ws),
                reader=", ".join(cfg.workers_in(dst)),
                carries="no bytes: contention for CPU time, memory and page cache",
                worst=(f"take CPU time from {dst}: under full contention {src}'s workers "
                       f"(cpu.weight {weight} in all) get {share:.0%} of the contended CPUs "
                       f"against {dst}'s {other}; quota {cpu}; memory {mem} (host memory "
                       "pressure, page cache eviction)"),
                bound=(f"one cgroup per worker run: memory.max, pids.max "
                       f"({', '.join('unlimited' if p is None else str(p) for p in pids)}), "
                       f"cpu.max, cpu.weight; without cgroups only RLIMIT_DATA stands in for "
                       f"memory_max" + (f"; {dst}'s {', '.join(rt)} run SCHED_FIFO from "
                                         "READY" if rt else "")),
                live=f"{src}'s workers are members of their own cgroups with these limits"))
    return out


def _network_paths(cfg: Config) -> list[Path]:
    """A domain with a network reads bytes from outside the machine."""
    out = []
    for name, d in cfg.domains.items():
        if d.network and cfg.workers_in(name):
            out.append(Path(
                id=f"network.{name}", kind="network", source="outside", target=name,
                writer="any host the network reaches", reader=", ".join(cfg.workers_in(name)),
                carries="anything: the host's network namespace, name resolution and TLS "
                        "files bound",
                worst=f"feed {name} any data or code (it may run what it receives)",
                bound="nothing on this path; what it writes stays research data (the trust "
                      "rules keep it from actuation); an actuating domain never has a "
                      "network (the loader refuses it)",
                live=f"{name}: net namespace is the host's"))
    return out


def _process_paths(cfg: Config) -> list[Path]:
    if len(cfg.domains) < 2:
        return []
    return [Path(
        id="processes", kind="signals, ptrace, /proc", source="any", target="any",
        writer="-", reader="-",
        carries="none: each sandbox has its own pid, ipc, uts, net, mount and user "
                "namespace and runs as its domain's host user",
        worst="-", bound="namespaces (bwrap --unshare-*), distinct host uids, capabilities "
                         "dropped, ptrace and process_vm_* killed or EPERM by seccomp",
        live="no two sandboxes share a namespace; host uids differ per domain")]


def interference_paths(cfg: Config) -> list[dict[str, Any]]:
    """Every path, channels first (sorted by channel), then pipes, files, resources."""
    paths: list[Path] = []
    for name in cfg.channels:
        paths += _channel_paths(cfg, name)
    for name in cfg.channels:
        paths += _observation_paths(cfg, name)
    paths += (_pipe_paths(cfg) + _file_paths(cfg) + _resource_paths(cfg)
              + _network_paths(cfg) + _process_paths(cfg))
    return [p.as_dict() for p in paths]


def summary(paths: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts for the verdict: paths between different domains, and those into an
    actuating (control) domain from a non-actuating one."""
    cross = [p for p in paths if p["crosses"] and p["from"] not in ("-", "any")]
    return {"total": len(paths), "cross_domain": len(cross),
            "kinds": sorted({p["kind"] for p in paths})}
