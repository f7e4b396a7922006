"""Whole-config rules: what no single table can show, checked once all are read.

Each rule reports through ``add(key, reason)`` (the loader's problem list) and never
stops at the first problem: who writes each channel (exactly one writer), the trust
rule (no research or shadow data reaches a control or actuating worker except through
``shadow_subscribes``), required workers on optional ones, dependency cycles, host
users per domain, and the shared-memory budget. Machine-dependent checks are in
`_runtime`.
"""
from __future__ import annotations

import math
import os
from typing import Callable

from supervisor.ipc.spec import ChannelSpec

from ._graph import cycle_through, topo_sort
from ._model import (CONTROL, MIN_START_CPU_S, REALTIME_TOTAL_PCT, RESEARCH, VEHICLE,
                     ChannelConfig, DomainConfig, WorkerConfig)
from ._values import _key, format_size

Add = Callable[[str, str], None]
"""Reports one problem: ``add(key path, reason)``."""


# The users `run --privsep` drops the supervisor proper to (lifecycle/_privsep.py
# PROPER_USER, NOBODY; tests/test_privsep_users.py holds them equal), by name -> uid.
SUPERVISOR_USERS: dict[str, int | None] = {"trio-supervisor": None, "nobody": 65534}


def _uid_of(user: str) -> int | None:
    import pwd

    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


def check_users(add: Add, domains: dict[str, DomainConfig]) -> None:
    from supervisor.sandbox.policy import default_user

    seen: dict[str, str] = {}
    for name, d in domains.items():
        user = d.user or default_user(d.profile)
        if user == "root":
            add(f"{_key('domains', name)}.user", "sandboxes never run as root")
        elif user in SUPERVISOR_USERS or _uid_of(user) == SUPERVISOR_USERS["nobody"]:
            # red team round 4: under `run --privsep` the supervisor proper drops to
            # one of these; a sandbox sharing its host uid could signal or trace it.
            add(f"{_key('domains', name)}.user",
                f"user {user!r} is the unprivileged supervisor's own (run --privsep runs "
                f"it as trio-supervisor, else nobody); sandboxes need users of their own")
        rules = "research" if d.profile == RESEARCH else "strict"
        other = seen.setdefault(user, f"{name}:{rules}")
        # Strict domains may share the control user; research never shares with them.
        if other.split(":")[1] != rules:
            add(f"{_key('domains', name)}.user",
                f"user {user!r} is also used by domain {other.split(':')[0]!r}; "
                f"research and control-grade domains need distinct host users")


# Host trees no domain may write into: the OS, the kernel's views, runtime state.
_NEVER_WRITABLE = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/boot", "/proc", "/sys",
                   "/dev", "/run", "/var/lib/trio-supervisor")
# The sandbox's own /proc, /dev (bwrap's) and what it never sees of the host: a bind
# there comes after bwrap's and replaces it (red team round 7 row 0: python_path =
# ["/proc"] showed research the host's processes, extra_ro_binds = ["/dev"] its devices).
_NEVER_BOUND = ("/proc", "/dev", "/sys", "/run")


def _nested(a: str, b: str) -> bool:
    a, b = a.rstrip("/") or "/", b.rstrip("/") or "/"
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def check_binds(add: Add, domains: dict[str, DomainConfig], models: dict,
                state_dir: str, project_root: str,
                resolve: Callable[[str], str] | None = None) -> None:
    """A writable bind is a channel outside the bridge: what one domain writes there must
    never be what another domain (or the model trust) reads. So it may not overlap any
    other domain's binds, a model's files, the project, the state dir or the OS.

    ``resolve`` (`check_runtime` passes os.path.realpath): compare the paths as bubblewrap
    will bind them on this machine, symlinks followed, so an alias of another domain's
    writable directory is that directory."""
    def _overlap(a: str, b: str) -> bool:
        return _nested(a, b) if resolve is None else _nested(resolve(a), resolve(b))

    ro = [(f"domains.{n}", p) for n, d in domains.items()
          for p in (*d.extra_ro_binds, *d.python_path)]
    ro += [(f"models.{n}", p) for n, m in models.items()
           for p in (getattr(m, "artifact", ""), getattr(m, "public_key", "")) if p.startswith("/")]
    for name, d in domains.items():
        for list_name in ("extra_ro_binds", "python_path"):
            for i, p in enumerate(getattr(d, list_name)):
                real = os.path.normpath(p) if resolve is None else resolve(p)
                top = next((t for t in _NEVER_BOUND
                            if real == t or real.startswith(t + "/")), None)
                if top is not None:
                    add(f"{_key('domains', name)}.{list_name}[{i}]",
                        f"{p} {'is' if real == top else 'is under'} {top}: the sandbox has "
                        f"its own {top}, never the host's")
        for i, rw in enumerate(d.extra_rw_binds):
            key = f"{_key('domains', name)}.extra_rw_binds[{i}]"
            bad = [p for p in (*_NEVER_WRITABLE, state_dir, project_root) if _overlap(rw, p)]
            if bad:
                add(key, f"{rw} overlaps {bad[0]}: never writable from a sandbox")
                continue
            for other, d2 in domains.items():
                for j, rw2 in enumerate(d2.extra_rw_binds):
                    if other != name and _overlap(rw, rw2):
                        add(key, f"{rw} overlaps domains.{other}.extra_rw_binds ({rw2}): "
                            "one writable place per domain")
            for where, p in ro:
                if where != f"domains.{name}" and _overlap(rw, p):
                    add(key, f"{rw} overlaps {where} ({p}): what this domain writes there "
                        "would be read outside the bridge")


def check_cpu_weights(add: Add, workers: dict[str, WorkerConfig],
                      domains: dict[str, DomainConfig]) -> None:
    """No research worker outweighs a control worker for CPU (cgroup cpu.weight): under
    contention research waits for control, never the other way round."""
    by_profile: dict[str, list[tuple[int, str]]] = {CONTROL: [], RESEARCH: []}
    for w in workers.values():
        d = domains.get(w.domain)             # an unknown domain is reported elsewhere
        if d is not None and d.profile in by_profile:
            by_profile[d.profile].append((w.cpu_weight_in(d.profile), w.name))
    if not by_profile[CONTROL]:
        return
    low, low_name = min(by_profile[CONTROL])
    for weight, name in by_profile[RESEARCH]:
        if weight > low:
            add(f"{_key('workers', name)}.cpu_weight",
                f"{weight} outweighs control worker {low_name!r} ({low}): a research "
                "worker may never take CPU from control under contention")


def check_devices(add: Add, workers: dict[str, WorkerConfig],
                  domains: dict[str, DomainConfig]) -> None:
    """device = "cuda": the GPU's nodes in the worker's sandbox. A control worker gets
    them only to run a signed model (modeld): the nodes are an ioctl surface into the
    kernel driver, worth opening for the model and for nothing else. Research may have
    them, and gets the same nodes as control, never more (policy.CUDA_DEVICE_NODES)."""
    for w in workers.values():
        if w.device == "cpu":
            continue
        d = domains.get(w.domain)
        if d is not None and d.profile == CONTROL and not w.model:
            add(f"{_key('workers', w.name)}.device",
                f"a control worker gets the GPU ({w.device}) only to run a signed model: "
                f"give it model = NAME, or device = \"cpu\"")


def check_realtime(add: Add, workers: dict[str, WorkerConfig],
                   domains: dict[str, DomainConfig]) -> None:
    """Only control workers run real-time (a research task in the RT class would
    preempt every control task in the normal one), and their RT budgets fit together."""
    total = 0
    for w in workers.values():
        key = _key("workers", w.name)
        if w.realtime_priority is None:
            if w.realtime_budget_pct is not None:
                add(f"{key}.realtime_budget_pct", "has no effect without realtime_priority")
            continue
        d = domains.get(w.domain)
        if d is not None and d.profile != CONTROL:
            add(f"{key}.realtime_priority", f"a {d.profile} worker may not run real-time: "
                "it would preempt control workers; only control workers may")
            continue
        total += w.realtime().budget_pct
    if total > REALTIME_TOTAL_PCT:
        add("workers", f"real-time budgets add up to {total} % of a CPU, more than "
            f"{REALTIME_TOTAL_PCT} %: lower realtime_budget_pct")


def check_busy_poll(add: Add, workers: dict[str, WorkerConfig], writers: dict[str, str]) -> None:
    """A real-time reader that busy-polls runs ahead of every normal task for up to 2 x
    busy_poll_us a message: above its writer's priority its spin takes the CPU the
    writer needs to publish (measured: controlsd at FIFO 53 spinning for modeld at 51
    on 2 CPUs, 14 of 108 windows hit). So a busy-polling real-time reader must rank
    below the writers it waits for."""
    for w in workers.values():
        if not w.busy_poll_us or w.realtime_priority is None:
            continue
        for ch in w.subscribes:     # shadow reads feed no actuation: not worth a rule
            src = workers.get(writers.get(ch, ""))
            if (src is None or src is w
                    or (src.realtime_priority or 0) > w.realtime_priority):
                continue
            wp = ("the normal class" if src.realtime_priority is None
                  else f"priority {src.realtime_priority}")
            add(f"{_key('workers', w.name)}.busy_poll_us",
                f"busy-polls channel {ch!r} at realtime_priority {w.realtime_priority} while "
                f"its writer {src.name!r} runs at {wp}: the spin would take the CPU the "
                "writer needs to publish; rank the reader below its writers, or drop "
                "busy_poll_us")
            break                   # one line per worker


def check_start_cpu(add: Add, workers: dict[str, WorkerConfig]) -> None:
    """A module worker's cpu_quota must leave it the CPU to start before its ready
    timeout (`MIN_START_CPU_S`): below that it is killed as not ready, restarted, killed
    again, and in control the domain fails safe. A command worker's needs are unknown."""
    for w in workers.values():
        if not w.module or w.cpu_quota is None:
            continue
        budget_s = w.cpu_quota / 100 * w.ready_timeout_ms / 1000
        if budget_s < MIN_START_CPU_S:
            need = math.ceil(MIN_START_CPU_S * 100_000 / w.ready_timeout_ms)
            add(f"{_key('workers', w.name)}.cpu_quota",
                f"{w.cpu_quota:g} % of a CPU gives {w.name!r} {budget_s:.3g} CPU-seconds "
                f"before its ready timeout ({w.ready_timeout_ms} ms); a Python worker needs "
                f"about {MIN_START_CPU_S:g} to start, so it would never be READY: use "
                f"cpu_quota >= {need} or a longer ready_timeout_ms")


def check_writers(add: Add, workers: dict[str, WorkerConfig], channels: dict) -> dict[str, str]:
    writers: dict[str, str] = {}
    for w in workers.values():
        for i, ch in enumerate(w.publishes):
            if ch not in channels:
                continue
            if ch in writers:
                add(f"{_key('workers', w.name)}.publishes[{i}]",
                    f"channel {ch!r} is already published by worker {writers[ch]!r}; "
                    "a channel has exactly one writer")
            else:
                writers[ch] = w.name
    for ch in channels:
        if ch not in writers:
            add(_key("channels", ch), f"no worker publishes channel {ch!r}; "
                "every channel needs exactly one writer")
    return writers


def check_trust(add: Add, workers: dict[str, WorkerConfig], domains: dict[str, DomainConfig],
                writers: dict[str, str], channels: dict[str, dict]) -> None:
    """No research or shadow data reaches a control/actuating worker except through
    shadow_subscribes, not even laundered through workers of a third domain."""
    def profile(w: WorkerConfig) -> str:
        d = domains.get(w.domain)
        return d.profile if d else CONTROL

    def protected(w: WorkerConfig) -> bool:
        d = domains.get(w.domain)
        return profile(w) == CONTROL or bool(d and d.actuates)

    # channel -> (root channel, chain of workers it passed through) for tainted data
    taint: dict[str, tuple[str, list[str]]] = {}
    for ch, writer in writers.items():
        if profile(workers[writer]) == RESEARCH or channels.get(ch, {}).get("shadow"):
            taint[ch] = (ch, [])
    changed = True
    while changed:
        changed = False
        for w in workers.values():
            if protected(w):
                continue
            src = next((c for c in w.subscribes if c in taint), None)
            for out in w.publishes:
                if src is not None and out not in taint and out in writers:
                    root, via = taint[src]
                    taint[out] = (root, via + [w.name])
                    changed = True

    for w in workers.values():
        if not protected(w):
            continue
        who = (f"control worker {w.name!r}" if profile(w) == CONTROL
               else f"worker {w.name!r} of actuating domain {w.domain!r}")
        fix = "mark it shadow_subscribes (log-only) or move it"
        for i, ch in enumerate(w.subscribes):
            if ch not in taint:
                continue
            root, via = taint[ch]
            at = f"{_key('workers', w.name)}.subscribes[{i}]"
            root_is_research = profile(workers[writers[root]]) == RESEARCH
            if via:
                kind = "research" if root_is_research else "shadow"
                add(at, f"{who} subscribes to channel {ch!r}, which is derived from "
                    f"{kind} channel {root!r} via {' -> '.join(via)}; {fix}")
            elif root_is_research:
                add(at, f"{who} subscribes to research channel {ch!r}; {fix}")
            else:
                add(at, f"{who} subscribes to shadow channel {ch!r}, which must never "
                    f"drive actuation; {fix}")


def check_optional(add: Add, workers: dict[str, WorkerConfig], writers: dict[str, str]) -> None:
    for w in workers.values():
        if w.optional:
            continue
        for i, ch in enumerate(w.subscribes):
            pub = writers.get(ch)
            if pub is not None and pub != w.name and workers[pub].optional:
                add(f"{_key('workers', w.name)}.subscribes[{i}]",
                    f"channel {ch!r} is published by optional worker {pub!r}; if "
                    f"admission refuses {pub!r}, {w.name!r} cannot run: make "
                    f"{w.name!r} optional too or {pub!r} required")


def check_cycles(add: Add, workers: dict[str, WorkerConfig]) -> None:
    _, stuck = topo_sort(workers)
    reported: set[str] = set()
    for start in stuck:
        if start in reported:
            continue
        cycle = cycle_through(start, workers, stuck)
        if cycle is None:       # downstream of a cycle, not on one
            continue
        reported.update(name for name, _ in cycle)
        hops = "".join(f" -[{ch}]-> {name}" for name, ch in cycle[1:])
        closing = cycle[-1][1]
        index = workers[start].subscribes.index(closing)
        add(f"{_key('workers', start)}.subscribes[{index}]",
            f"dependency cycle {start}{hops}: publishers must start before their "
            "subscribers; break the cycle (a log-only read can use shadow_subscribes)")


def check_shm_budget(add: Add, budget: int, channels: dict[str, ChannelConfig]) -> None:
    total = sum(channel_shm_bytes(c.spec) for c in channels.values())
    if total > budget:
        add("channels", f"{_shm_overview(channels)} exceeds shm_budget "
            f"{format_size(budget)}; shrink slot_size or slot_count, or raise "
            "[supervisor] shm_budget")


# The longest an actuation command may be acted on, on the vehicle: a bound on absurd
# values (an hour loaded: review 6 finding 10), not a tuning: the car's is 50 ms. Two
# seconds leaves room to tests that read a ring after the supervisor has gone, on a
# loaded 2-core machine (test_failsafe, test_faults).
MAX_ACTUATION_AGE_MS = 2000


def check_actuation_age(add: Add, mode: str, channels: dict[str, ChannelConfig]) -> None:
    """On the vehicle an actuation channel's commands go stale: max_age_ms is what every
    reader holds a command for at most, the actuator's own fail-safe when the supervisor
    cannot say SAFE (a wedged controlsd, the last word failed). 0 ("no age check") made a
    wedged writer's last ENGAGED command current for ever, and the live row said so (red
    team 9, read); so would an hour. Simulation (a lockstep replay) turns ages off on
    purpose."""
    if mode != VEHICLE:
        return
    for name, ch in channels.items():
        if not ch.actuation:
            continue
        age = ch.spec.max_age_ms
        if not age or age > MAX_ACTUATION_AGE_MS:
            add(f"{_key('channels', name)}.max_age_ms",
                f"{'0 turns off' if not age else f'{age} ms stretches'} the age check of an "
                f"actuation channel: a wedged writer's last command would stay current "
                f"{'for ever' if not age else 'that long'}; give the longest a command may "
                f"be acted on, at most {MAX_ACTUATION_AGE_MS} ms (the car's default: 50)")

# --------------------------------------------------------------------------- shared memory


def channel_shm_bytes(spec: ChannelSpec) -> int:
    """Shared memory one channel holds, as `supervisor.ipc.Channel.create` makes it: the
    data segment plus one lease table per possible reader."""
    return spec.segment_size + spec.max_readers * spec.lease_size


def _approx_size(n: int) -> str:
    """``n`` bytes to one decimal in the largest binary unit (for totals, not input)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def _shm_overview(channels: dict[str, ChannelConfig], biggest: int = 3) -> str:
    """``total 1.0TiB of shared memory for 2 channels (biggest: ...)``."""
    sizes = sorted(((channel_shm_bytes(c.spec), name) for name, c in channels.items()),
                   key=lambda t: (-t[0], t[1]))
    total = sum(n for n, _ in sizes)
    top = ", ".join(f"{name} {channels[name].spec.slot_count} slots of "
                    f"{format_size(channels[name].spec.slot_size)} = {_approx_size(n)}"
                    for n, name in sizes[:biggest])
    n = len(sizes)
    return (f"total {_approx_size(total)} of shared memory for {n} channel"
            f"{'' if n == 1 else 's'} (biggest: {top})")


