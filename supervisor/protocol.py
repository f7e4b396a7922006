"""The worker <-> supervisor contract: environment names and status lines.

Stdlib only: the runner reads it before anything that could start a thread (numpy
starts its BLAS pool at import), because Landlock restricts only the calling thread.

Status lines (worker -> supervisor, one per line on the status fd, like sd_notify):
    READY=1 [STATUS=text]   start-up is over
    WATCHDOG=1              still alive
    STATUS=text             free-form status for the event log and the live line
    REFUSED=<kind> <detail> the import guard refused something (reported even when the
                            worker swallows the exception)
    STANDBY=1               a warm standby finished its start-up and waits for channels
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Sequence

ENV_NAME = "TRIO_WORKER"
ENV_DOMAIN = "TRIO_DOMAIN"
ENV_PROFILE = "TRIO_PROFILE"      # the domain's profile: which rules the runner applies
ENV_STATUS_FD = "TRIO_STATUS_FD"
ENV_CHANNELS = "TRIO_CHANNELS"
ENV_NETWORK = "TRIO_NETWORK"
# A unix socket (control-grade sandboxes): the runner sends its exec-watch listener fd.
ENV_EXECWATCH_FD = "TRIO_EXECWATCH_FD"
# A warm standby: a unix socket on which the supervisor hands over the channels when it
# activates this instance (JSON {"channels": {name: handle}, "fds": [numbers]} + fds).
ENV_STANDBY_FD = "TRIO_STANDBY_FD"
# "1" when the supervisor started the worker in a sandbox (Landlock applies then).
ENV_SANDBOXED = "TRIO_SANDBOXED"
# The worker's roles bound to channels by the config: "frames=road_frames,model=model_out".
# A worker asks for a role (ctx.reader("frames")), never for a channel's name.
ENV_ROLES = "TRIO_ROLES"
# The roles bound through shadow_subscribes (log only): `WorkerContext.reader` refuses
# them, `shadow_reader` hands them out, so a config that binds an actuation input there
# (red team round 6 row 0) stops the worker instead of feeding it research's numbers.
ENV_SHADOW_ROLES = "TRIO_SHADOW_ROLES"


def encode_roles(roles: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> str:
    return ",".join(f"{r}={c}" for r, c in roles)


def decode_roles(text: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        role, eq, ch = item.partition("=")
        if eq and role and ch:
            out[role] = ch
    return out


# The model a worker is trusted to load ([models.NAME]): JSON {"name", "artifact",
# "public_key", "expect_name", "min_version"}; both paths are bound read-only.
ENV_MODEL = "TRIO_MODEL"


# The domain's isolation knobs the runner applies before the worker's code runs
# (see supervisor.config.DomainConfig): "refuse_torch=1,exec_after_start=0,...".
ENV_ISOLATION = "TRIO_ISOLATION"
# Directories the worker may write besides /tmp and /dev (Landlock), ":"-separated.
ENV_WRITABLE = "TRIO_WRITABLE"
# "vehicle" or "simulation" ([supervisor] mode): a worker refuses its SIMULATION_ONLY
# arguments unless told "simulation" (absent or garbled: vehicle).
ENV_MODE = "TRIO_MODE"
ENV_BUSY_POLL = "TRIO_BUSY_POLL_US"     # the worker's readers' busy_poll_us
VEHICLE, SIMULATION = "vehicle", "simulation"


@dataclass(frozen=True)
class Isolation:
    """What the runner and the worker context enforce inside the sandbox. The
    defaults are control's: a missing or garbled variable fails closed."""

    refuse_torch: bool = True
    exec_after_start: bool = False
    exec_memory_after_ready: bool = False
    seccomp: str = "control"

    def encode(self) -> str:
        return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}"
                        for k, v in dataclasses.asdict(self).items())

    @classmethod
    def for_profile(cls, profile: str) -> Isolation:
        """A profile's defaults (supervisor.config.PROFILE_DEFAULTS): anything but
        research is control."""
        if profile == "research":
            return cls(refuse_torch=False, exec_after_start=True, exec_memory_after_ready=True,
                       seccomp="research")
        return cls()

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ) -> Isolation:
        text = env.get(ENV_ISOLATION)
        if text is None:   # started by hand (a test, a developer): the profile decides
            return cls.for_profile(env.get(ENV_PROFILE) or env.get(ENV_DOMAIN, "control"))
        return cls.decode(text)

    @classmethod
    def decode(cls, text: str | None) -> Isolation:
        out = cls()
        if not text:
            return out
        vals: dict[str, object] = {}
        for item in text.split(","):
            k, _, v = item.partition("=")
            if k in ("refuse_torch", "exec_after_start", "exec_memory_after_ready"):
                vals[k] = v == "1"
            elif k == "seccomp" and v in ("control", "research"):
                vals[k] = v
        return dataclasses.replace(out, **vals)


# ---------------------------------------------------------------- status lines


@dataclass(frozen=True)
class StatusLine:
    """One assignment of a status line: kind READY | WATCHDOG | STATUS | REFUSED |
    STANDBY | UNKNOWN, with its text (STATUS: free text; REFUSED: "kind detail")."""

    kind: str
    text: str = ""


_KINDS = ("READY", "WATCHDOG", "STATUS", "REFUSED", "STANDBY")
STATUS_MAX = 512
_LINE_MAX = STATUS_MAX + 64        # what parse_line reads of one line


def format_line(kind: str, text: str = "") -> str:
    """Worker side: one line for the status fd (no newline inside, ever)."""
    if kind not in _KINDS:
        raise ValueError(f"unknown status kind {kind!r}")
    text = text.replace("\n", " ")
    if kind == "STATUS":
        return f"STATUS={text}"
    if kind == "REFUSED":
        return f"REFUSED={text}"
    return f"{kind}=1" + (f" STATUS={text}" if text else "")


def printable(text: str) -> str:
    """``text`` with every character that is not printable (controls, escape sequences,
    bidi overrides) shown as a Python escape: a worker's words reach the operator's
    terminal (the live status line) and must not move its cursor or rewrite it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def parse_line(line: str) -> list[StatusLine]:
    """Supervisor side. sd_notify style: several assignments may share a line
    ("READY=1 STATUS=fps=20"); STATUS and REFUSED take the rest of the line, made
    `printable`."""
    out: list[StatusLine] = []
    # Cut before escaping: printable() costs a Python step per character, and a worker
    # may send lines of control characters (red team round 3: 4 KiB lines cost ~0.8 ms
    # each). No honest line is longer than a STATUS= of STATUS_MAX after a few flags,
    # nor carries more assignments than there are kinds.
    rest = printable(line[:_LINE_MAX])
    while rest and len(out) < len(_KINDS):
        key, eq, value = rest.partition("=")
        if not eq or key not in _KINDS:
            out.append(StatusLine("UNKNOWN", rest[:STATUS_MAX]))
            break
        if key in ("STATUS", "REFUSED"):
            out.append(StatusLine(key, value[:STATUS_MAX]))
            break
        flag, _, rest = value.partition(" ")
        if flag != "1":
            out.append(StatusLine("UNKNOWN", f"{key}={flag}"[:STATUS_MAX]))
        else:
            out.append(StatusLine(key))
    return out


# ---------------------------------------------------------------- simulation-only arguments


def simulation_only(declared: Any, args: Sequence[str]) -> list[tuple[int, str, str]]:
    """``(index, argument, why)`` for each of ``args`` that a worker module declares
    simulation-only: ``SIMULATION_ONLY = {"--flag": why}`` or ``{"--flag": (why,
    ("value", ...))}`` for some values only; ``--flag value`` and ``--flag=value`` alike.
    Exact names: the module's parser must refuse abbreviations (allow_abbrev=False).
    Checked by `supervisor check` on a vehicle config and by the worker itself."""
    if not isinstance(declared, dict):
        return []
    out = []
    args = list(args)
    for i, tok in enumerate(args):
        flag, eq, val = str(tok).partition("=")
        if flag not in declared:
            continue
        spec = declared[flag]
        why, values = spec if isinstance(spec, tuple) and len(spec) == 2 else (spec, None)
        value = val if eq else (str(args[i + 1]) if i + 1 < len(args) else "")
        if values is not None and value not in values:
            continue
        out.append((i, f"{flag} {value}" if values is not None else flag, str(why)))
    return out


# ---------------------------------------------------------------- the endpoint


@dataclass(frozen=True)
class Endpoint:
    """Everything a worker is told at start, besides its fds: who it is, its domain's
    rules, and which channel each of its roles is bound to. The supervisor and the
    tests start workers through `worker_env`, so both speak the same contract."""

    name: str
    domain: str
    profile: str = ""
    isolation: Isolation | None = None     # None: the profile's defaults
    network: bool = False
    sandboxed: bool = False
    roles: tuple[tuple[str, str], ...] = ()
    shadow_roles: tuple[str, ...] = ()           # roles bound through shadow_subscribes
    writable: tuple[str, ...] = ()
    model: dict[str, str | None] | None = None   # the trust record of [models.NAME]
    mode: str = VEHICLE                          # [supervisor] mode
    busy_poll_us: int = 0                        # its readers' (ipc/_cadence.py)


def endpoint_for(cfg: Any, w: Any, sandboxed: bool = True) -> Endpoint:
    """What worker `w` of config `cfg` (a supervisor.config Config and WorkerConfig) is
    told at start: one derivation for the supervisor's own launches and the broker's,
    so the two can never tell a worker different things (STYLE 2.3)."""
    d = cfg.domain_of(w.name)
    m = cfg.models.get(w.model or "")
    return Endpoint(name=w.name, domain=w.domain, profile=d.profile, isolation=d.isolation(),
                    network=d.network, sandboxed=sandboxed, roles=w.roles,
                    shadow_roles=tuple(r for r, ch in w.roles if ch in w.shadow_subscribes),
                    writable=d.extra_rw_binds,
                    model=dataclasses.asdict(m) if m else None, mode=cfg.supervisor.mode,
                    busy_poll_us=w.busy_poll_us)


def worker_env(ep: Endpoint, status_fd: int | None,
               handles: dict[str, object]) -> tuple[dict[str, str], list[int]]:
    """The environment and the fds to pass for `ep`; `handles` maps each channel name
    to its WriterHandle or ReaderHandle (empty for a standby, which gets them later)."""
    from supervisor.ipc import env_name   # not at import: the runner needs stdlib only

    iso = ep.isolation or Isolation.for_profile(ep.profile or ep.domain)
    env = {ENV_NAME: ep.name, ENV_DOMAIN: ep.domain, ENV_PROFILE: ep.profile or ep.domain,
           ENV_NETWORK: "1" if ep.network else "0", ENV_SANDBOXED: "1" if ep.sandboxed else "0",
           ENV_ISOLATION: iso.encode(), ENV_WRITABLE: ":".join(ep.writable),
           ENV_ROLES: encode_roles(ep.roles), ENV_SHADOW_ROLES: ",".join(ep.shadow_roles),
           ENV_CHANNELS: ",".join(handles),
           ENV_MODE: ep.mode, ENV_BUSY_POLL: str(ep.busy_poll_us)}
    if status_fd is not None:
        env[ENV_STATUS_FD] = str(status_fd)
    if ep.model is not None:
        import json

        env[ENV_MODEL] = json.dumps(ep.model, sort_keys=True)
    fds: list[int] = []
    for ch, h in handles.items():
        env[env_name(ch)] = h.to_json()   # type: ignore[attr-defined]
        fds += h.fds()                    # type: ignore[attr-defined]
    return env, fds
