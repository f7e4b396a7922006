"""Failure behaviour per worker: what the supervisor does when a worker dies, hangs or
never becomes ready, and what the actuation channel carries meanwhile.

From the worker's and its domain's typed config fields (`WorkerConfig.restart`,
`max_restarts`, `restart_window_s`, `backoff_initial_ms`, `backoff_max_ms`,
`cooldown_s`, `watchdog_ms`, `ready_timeout_ms`, `warm_standby`, `optional`;
`DomainConfig.failure_policy`) read the way `Supervisor._supervise`,
`_restart_allowed`, `_budget_left` and `_give_up` read them (supervisor/lifecycle/
_supervisor.py), and from the channel graph: which actuation channels a worker writes
or feeds (`promise._feeds_actuation`).
"""
from __future__ import annotations

from typing import Any

from schemas.payloads import PAYLOADS
from supervisor.config import Config, WorkerConfig

from .promise import _feeds_actuation


def _last_word() -> bool:
    """Does this tree's supervisor publish SAFE the moment an actuation writer dies
    (lifecycle: `_last_word`, landed with issue 22), not only at fail-safe?"""
    from supervisor.lifecycle import Supervisor

    return callable(getattr(Supervisor, "_last_word", None))


def _restart_text(w: WorkerConfig) -> str:
    return {"always": "always restarted", "on-failure": "restarted after a non-zero exit",
            "never": "never restarted"}.get(w.restart, w.restart)


def _backoff(w: WorkerConfig) -> str:
    # _supervise: delay = min(initial * 2**attempt, max); attempt resets after a run that
    # was ready for more than 4 x backoff_max_ms; 0 when a warm standby is waiting.
    return (f"{w.backoff_initial_ms} ms doubling to {w.backoff_max_ms} ms"
            + ("; none while a warm standby waits" if w.warm_standby else ""))


def _meanwhile(cfg: Config, w: WorkerConfig, upstream: dict[str, list[str]]) -> str:
    """What each actuation channel this worker writes or feeds carries while it is down."""
    parts = []
    for act, chans in upstream.items():
        ch = cfg.channels[act]
        age = ch.spec.max_age_ms
        stale = (f"readers reject its last message once older than max_age_ms {age} ms"
                 if age else "its last message stays readable (no max_age_ms: UNBOUNDED)")
        if act in w.publishes:
            if _last_word():
                safe = PAYLOADS[ch.payload].safe if ch.payload in PAYLOADS else None
                word = ", ".join(f"{k}={v:g}" for k, v in (safe or {}).items())
                parts.append(f"{act}: SAFE at once by the supervisor (writer of last "
                             f"resort: {word}) the moment {w.name}'s process is dead, "
                             f"before its standby takes over or a restart; that is the "
                             f"last word until the next {w.name} publishes (if the "
                             f"supervisor cannot write it, {stale})")
            else:
                parts.append(f"{act}: no new message until the restart (or the standby) "
                             f"publishes; {stale}")
        elif any(c in w.publishes for c in chans):
            writer = cfg.writer_of(act)
            then = (f"if {writer} dies too, the supervisor publishes SAFE as writer of "
                    f"last resort" if _last_word() else f"{stale} if {writer} stops too")
            parts.append(f"{act}: its writer {writer} gets no fresh input and publishes its "
                         f"own safe state (not engaged: no input / stale / timeout); {then}")
    return "; ".join(parts) or "feeds no actuation channel"


def _on_give_up(cfg: Config, w: WorkerConfig) -> str:
    d = cfg.domains[w.domain]
    if w.optional:
        return "optional: the rest keeps running without it" + (
            f"; tried again after a {w.cooldown_s:g} s cool-down" if w.cooldown_s else "")
    if d.failure_policy == "fail_safe":
        acts = [n for n, c in cfg.channels.items() if c.actuation]
        safe = (f"; then the supervisor publishes the safe value on {', '.join(acts)} as "
                "writer of last resort" if acts else "")
        return ("FAIL-SAFE: latch set (nothing starts until `supervisor clear-fail-safe`), "
                f"every {w.domain} process killed{safe}; the supervisor exits 4")
    return ("domain keeps running without it" + (
        f"; tried again after a {w.cooldown_s:g} s cool-down" if w.cooldown_s else
        "; never tried again"))


def failure_rows(cfg: Config) -> list[dict[str, Any]]:
    upstream = _feeds_actuation(cfg)
    rows = []
    for w in cfg.workers.values():
        d = cfg.domains[w.domain]
        rows.append({
            "worker": w.name,
            "domain": w.domain,
            "restart": w.restart,
            "restart_text": _restart_text(w),
            "budget": {"max_restarts": w.max_restarts, "window_s": w.restart_window_s},
            "backoff_ms": {"initial": w.backoff_initial_ms, "max": w.backoff_max_ms},
            "cooldown_s": w.cooldown_s,
            "watchdog_ms": w.watchdog_ms or None,
            "ready_timeout_ms": w.ready_timeout_ms,
            "warm_standby": w.warm_standby,
            "optional": w.optional,
            "failure_policy": d.failure_policy,
            "on_give_up": _on_give_up(cfg, w),
            "actuation_meanwhile": _meanwhile(cfg, w, upstream),
            "backoff_text": _backoff(w),
        })
    return rows
