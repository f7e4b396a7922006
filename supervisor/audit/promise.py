"""What the config promises, worker by worker: the `supervisor audit` rows without --live.

Everything here is derived from the same code the supervisor runs: the sandbox policy
comes from ``Supervisor._policy`` (so `supervisor.sandbox.policy` decides, not a copy of
its rules), the seccomp summary from the constants of `supervisor.sandbox.seccomp`, the
admission verdict from `supervisor.admission.check_worker` exactly as
``Supervisor.admit`` calls it. Nothing is started and no worker module is imported.
"""
from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import io
import json
import pwd
import re
import sys
from pathlib import Path
from typing import Any

from supervisor.config import Config, WorkerConfig

# Namespaces every sandbox gets from bwrap (--unshare-user/-pid/-ipc/-uts/-cgroup-try,
# a mount namespace always, and --unshare-net unless the domain has a network).
NAMESPACES = ("user", "pid", "ipc", "uts", "cgroup", "mnt", "net")
PRIVATE, HOST = "private", "host"


# --------------------------------------------------------------------------- helpers


def quiet_supervisor(cfg: Config):
    """A Supervisor object for its derivations only (policy, admission): no log output,
    no systemd notification."""
    from supervisor.events import EventLog
    from supervisor.lifecycle import Supervisor
    from supervisor.notify import Notifier

    return Supervisor(cfg, log=EventLog(stream=io.StringIO()), notifier=Notifier({}))


def profile_of(cfg: Config, w: WorkerConfig) -> str:
    """The rules a worker's sandbox runs under: its domain's profile (control or
    research); a config without profiles: the domain name (anything but research is
    control-grade, as the sandbox code decides)."""
    d = cfg.domains[w.domain]
    return getattr(d, "profile", "") or w.domain


def strict(profile: str) -> bool:
    from supervisor.sandbox.policy import RESEARCH

    return profile != RESEARCH


def domain_user(cfg: Config, w: WorkerConfig) -> str:
    from supervisor.sandbox.policy import default_user

    return cfg.domains[w.domain].user or default_user(profile_of(cfg, w))


def user_ids(name: str) -> tuple[int | None, int | None]:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        return None, None
    return pw.pw_uid, pw.pw_gid


def policy(cfg: Config, w: WorkerConfig):
    """(SandboxPolicy, None) as the supervisor builds it (the same pure function), or
    (None, why not)."""
    from supervisor.sandbox.policy import for_worker

    try:
        return for_worker(cfg, w), None
    except (LookupError, ValueError, OSError) as e:
        return None, str(e.args[0] if e.args else e)


# --------------------------------------------------------------------------- seccomp


def _has_wx() -> bool:
    """W^X from READY exists in this tree (supervisor/sandbox/wx.py, worker.lock_wx)."""
    from .syscalls import _wx

    return _wx() is not None


def seccomp_promise(profile: str, network: bool, *, at_launch: bool = True,
                    after_start: bool | None = None, wx: bool = False) -> dict[str, Any]:
    """The filters a sandbox of this profile carries, summarised from the constants of
    `supervisor.sandbox.seccomp` (the same ones `build_filter` compiles)."""
    from supervisor.sandbox import seccomp as sc

    is_strict = strict(profile)
    after_start = is_strict if after_start is None else after_start
    clone_ns = "clone(CLONE_NEW*)"
    if is_strict:
        kill = [*sc.BASE_DENY, clone_ns, *sc.FILE_META_DENY, *sc.STRICT_DENY,
                "personality(other than query)", "shmat(SHM_EXEC)",
                "socket(AF_UNIX, SOCK_DGRAM)", "socketpair(SOCK_DGRAM)",
                "futex(PI ops)", "sched_setaffinity"]
        if not network:
            kill += ["socket(other than AF_UNIX)", "connect", "sendto(with address)"]
        eperm: list[str] = []
    else:
        kill = list(sc.FILE_META_FD)
        eperm = [*sc.BASE_DENY, clone_ns,
                 *(n for n in sc.FILE_META_DENY if n not in sc.FILE_META_FD)]
    launch = {"kill": kill, "eperm": eperm, "enosys": ["clone3"]}
    try:   # the rules build_filter really adds (the lists above are the fallback)
        from .syscalls import stage_lists

        launch = stage_lists(profile, stage="launch", network=network)
    except sc.SeccompUnavailableError:
        pass
    filters = (1 if at_launch else 0) + (2 if after_start else 0) + (1 if wx else 0)
    return {
        "mode": "filter" if filters else "disabled",
        "filters": filters,
        "launch": launch if at_launch else None,
        "after_start_kill": list(sc.EXEC_DENY) if after_start else [],
        "exec_watch": ([f"{n}(PROT_EXEC)" for n in sc.EXEC_WATCH_PROT]
                       + list(sc.EXEC_WATCH_ANY)) if after_start else [],
        # W^X (sandbox/wx.py): loaded by the worker at READY, one more filter from then on
        "wx_from_ready": wx,
    }


# --------------------------------------------------------------------------- models


def _static_argparse(path: Path) -> tuple[dict[str, Any], dict[str, str]] | None:
    """For a worker module's source: ({dest: default}, {option: dest}) of its
    ``add_argument`` calls whose defaults are literals or module constants built from
    ``Path(__file__)`` and string joins. Read, never imported or executed."""
    try:
        tree = ast.parse(path.read_text("utf-8"), str(path))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    env: dict[str, Any] = {}

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id == "__file__":
                return path
            return env[node.id]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return Path(ev(node.left)) / ev(node.right)
        if isinstance(node, ast.Attribute):
            base = ev(node.value)
            if node.attr == "parent":
                return Path(base).parent
            raise KeyError(node.attr)
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "parents":
            return Path(ev(node.value.value)).parents[ev(node.slice)]
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in ("Path", "str") and len(node.args) == 1:
                v = ev(node.args[0])
                return Path(v) if f.id == "Path" else str(v)
            if isinstance(f, ast.Attribute) and f.attr == "resolve" and not node.args:
                return Path(ev(f.value)).resolve()
        raise KeyError(type(node).__name__)

    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            try:
                env[node.targets[0].id] = ev(node.value)
            except (KeyError, TypeError, ValueError, IndexError):
                pass
    defaults: dict[str, Any] = {}
    options: dict[str, str] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant)
                 and isinstance(a.value, str) and a.value.startswith("--")]
        if not names:
            continue
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        dest = kw["dest"].value if isinstance(kw.get("dest"), ast.Constant) else \
            names[0][2:].replace("-", "_")
        for n in names:
            options[n] = dest
        if "default" in kw:
            try:
                defaults[dest] = ev(kw["default"])
            except (KeyError, TypeError, ValueError, IndexError):
                pass
    return defaults, options


def _module_file(module: str) -> Path | None:
    from supervisor.config import PROJECT_ROOT

    parts = module.split(".")
    for root in (PROJECT_ROOT, *sys.path):
        base = Path(root or ".").joinpath(*parts)
        for cand in (base / "__init__.py", base.with_suffix(".py")):
            if cand.is_file():
                return cand
    return None


def _option_values(args: tuple[str, ...], options: dict[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, value = a.partition("=")
        if name in options:
            if eq:
                out[options[name]] = value
            elif i + 1 < len(args):
                out[options[name]] = args[i + 1]
                i += 1
        i += 1
    return out


def trusted_models(w: WorkerConfig, cfg: Config | None = None) -> list[dict[str, Any]]:
    """The signed model artifacts a worker loads and the key it trusts for them: its
    ``model = NAME`` (the config's ``[models.NAME]``: artifact, public key, expected
    name, minimum version), else the ``--artifact``/``--pubkey`` options of its module
    and the worker's ``args``. Each artifact's manifest is read and its signature
    checked here with that key."""
    name = getattr(w, "model", None)
    table = getattr(cfg, "models", None) or {}
    if name and name in table:
        m = table[name]
        entry: dict[str, Any] = {"model": name, "artifact": m.artifact, "pubkey": m.public_key,
                                 "name": None, "version": None, "key_id": None,
                                 "signature": None, "manifest_sha256": None,
                                 "expect_name": m.expect_name,
                                 "expect_version": None,
                                 "min_version": getattr(m, "min_version", None)}
        entry.update(_inspect_artifact(Path(m.artifact), Path(m.public_key)))
        return [entry]
    if not w.module:
        return []
    src = _module_file(w.module)
    parsed = _static_argparse(src) if src else None
    if not parsed:
        return []
    defaults, options = parsed
    if "artifact" not in defaults and "--artifact" not in options:
        return []
    values = {**{k: str(v) for k, v in defaults.items() if v is not None},
              **_option_values(w.args, options)}
    artifact, pubkey = values.get("artifact"), values.get("pubkey")
    entry: dict[str, Any] = {"artifact": artifact, "pubkey": pubkey, "name": None,
                             "version": None, "key_id": None, "signature": None,
                             "manifest_sha256": None,
                             "expect_name": values.get("expect_name"),
                             "expect_version": values.get("expect_version")}
    if artifact:
        entry.update(_inspect_artifact(Path(artifact), Path(pubkey) if pubkey else None))
    return [entry]


def _inspect_artifact(artifact: Path, pubkey: Path | None) -> dict[str, Any]:
    from supervisor.model.artifact import MANIFEST, SIGNATURE

    out: dict[str, Any] = {}
    try:
        mbytes = (artifact / MANIFEST).read_bytes()
        m = json.loads(mbytes)
    except (OSError, ValueError) as e:
        out["signature"] = f"unreadable manifest: {e}"
        return out
    out["manifest_sha256"] = hashlib.sha256(mbytes).hexdigest()
    model = m.get("model", {}) if isinstance(m, dict) else {}
    out["name"], out["version"] = model.get("name"), model.get("version")
    out["key_id"] = (m.get("signing") or {}).get("key_id")
    if pubkey is None:
        out["signature"] = "no public key"
        return out
    try:
        from supervisor.model.keys import key_id, load_public_key, verify

        key = load_public_key(pubkey)
        verify(key, (artifact / SIGNATURE).read_bytes(), mbytes, what=str(artifact / SIGNATURE))
        kid = key_id(key)
    except Exception as e:   # BadSignature, BadPublicKey, OSError: reported, not raised
        out["signature"] = f"does not verify: {e}"
        return out
    if out["key_id"] not in (None, kid):
        out["signature"] = f"verifies, but the manifest names key {out['key_id']}"
        return out
    out["key_id"] = kid
    out["signature"] = "verified"
    return out


# --------------------------------------------------------------------------- rows


def admission(cfg: Config) -> dict[str, dict[str, Any]]:
    """Static admission of every worker, as ``Supervisor.admit`` runs it."""
    sup = quiet_supervisor(cfg)
    sup.admit()
    out = {name: {"checked": True, "admitted": True, "chains": []} for name in cfg.workers}
    for e in sup.log.of("refused"):
        out[e["worker"]] = {"checked": True, "admitted": False,
                            "chains": list(e.get("chains") or [e.get("reason", "")])}
    return out


def worker_row(cfg: Config, w: WorkerConfig, *,
               admitted: dict[str, Any] | None = None) -> dict[str, Any]:
    d = cfg.domains[w.domain]
    profile = profile_of(cfg, w)
    pol, why = policy(cfg, w)
    is_strict = pol.strict if pol is not None else strict(profile)
    network = pol.network if pol is not None else bool(d.network)
    user = domain_user(cfg, w)
    uid, gid = user_ids(user)
    if pol is not None and pol.host_uid is not None:
        uid, gid = pol.host_uid, pol.host_gid
    at_launch = pol.seccomp_at_launch if pol is not None else True
    after_start = pol.seccomp_after_start if pol is not None else is_strict
    reads = [{"channel": c, "shadow": c in w.shadow_subscribes or cfg.channels[c].shadow,
              "log_only": c in w.shadow_subscribes, "access": "read-only"} for c in w.reads]
    return {
        "worker": w.name,
        "domain": w.domain,
        "profile": profile,
        "optional": w.optional,
        "policy_error": why,
        "host": {"user": user, "uid": uid, "gid": gid},
        "namespaces": {ns: (HOST if ns == "net" and network else PRIVATE) for ns in NAMESPACES},
        "network": network,
        "compilers_visible": not pol.hide_compilers if pol is not None else not is_strict,
        "exec_after_start": not after_start,
        "new_exec_memory_after_ready": not is_strict,
        "jit_kernels": (w.jit_kernels if is_strict else True),
        "seccomp": seccomp_promise(profile, network, at_launch=at_launch,
                                   after_start=after_start,
                                   wx=_has_wx() and not d.exec_memory_after_ready),
        "no_new_privs": True,
        "capabilities": {"effective": [], "permitted": [], "inheritable": [],
                         "ambient": [], "bounding": []},
        "limits": {"memory_max": w.memory_max, "pids_max": w.pids_max,
                   "cpu_quota_pct": w.cpu_quota, "cpu_weight": cfg.cpu_weight_of(w.name),
                   "nofile": w.nofile},
        "scheduling": scheduling_promise(w),
        "channels": {"writes": [{"channel": c, "access": "read-write"} for c in w.publishes],
                     "reads": reads},
        "models": trusted_models(w, cfg),
        "torch": "refused" if is_strict else "allowed",
        "admission": admitted or {"checked": False, "admitted": None, "chains": []},
    }


def scheduling_promise(w) -> dict[str, Any]:
    """The worker's main thread from READY on (supervisor/sandbox/sched.py)."""
    rt = w.realtime()
    if rt is None:
        return {"policy": "other", "priority": 0, "reset_on_fork": False, "rt_budget_pct": None,
                "busy_poll_us": w.busy_poll_us}
    return {"policy": "fifo", "priority": rt.priority, "reset_on_fork": True,
            "rt_budget_pct": rt.budget_pct, "busy_poll_us": w.busy_poll_us}


# --------------------------------------------------------------------------- channels


def _tainted(cfg: Config) -> dict[str, str]:
    """channel -> why it is research/shadow data (written in a research-profile domain,
    marked shadow, or derived from such a channel by a worker that is not protected)."""
    why: dict[str, str] = {}
    for name, ch in cfg.channels.items():
        writer = cfg.workers[cfg.writer_of(name)]
        if not strict(profile_of(cfg, writer)):
            why[name] = f"written by research-profile worker {writer.name}"
        elif ch.shadow:
            why[name] = "marked shadow"
    changed = True
    while changed:
        changed = False
        for w in cfg.workers.values():
            protected = strict(profile_of(cfg, w)) or cfg.domains[w.domain].actuates
            if protected:
                continue
            src = next((c for c in w.subscribes if c in why), None)
            for out in w.publishes:
                if src is not None and out not in why:
                    why[out] = f"derived from {src} by {w.name}"
                    changed = True
    return why


def _feeds_actuation(cfg: Config) -> dict[str, list[str]]:
    """actuation channel -> every channel upstream of it (through ``subscribes`` only)."""
    out: dict[str, list[str]] = {}
    for name, ch in cfg.channels.items():
        if not ch.actuation:
            continue
        seen: list[str] = [name]
        todo = [name]
        while todo:
            writer = cfg.workers[cfg.writer_of(todo.pop())]
            for c in writer.subscribes:
                if c not in seen:
                    seen.append(c)
                    todo.append(c)
        out[name] = seen
    return out


def channel_rows(cfg: Config) -> list[dict[str, Any]]:
    tainted = _tainted(cfg)
    upstream = _feeds_actuation(cfg)
    rows = []
    for name, ch in cfg.channels.items():
        s = ch.spec
        readers = [{"worker": r, "log_only": name in cfg.workers[r].shadow_subscribes}
                   for r in cfg.readers_of(name)]
        rows.append({
            "channel": name,
            "writer": cfg.writer_of(name),
            "writer_domain": cfg.workers[cfg.writer_of(name)].domain,
            "readers": readers,
            "shadow": ch.shadow,
            "research_data": tainted.get(name),
            "payload": ch.payload,
            "actuation": ch.actuation,
            "feeds_actuation": sorted(a for a, ups in upstream.items()
                                      if name in ups and a != name),
            "kind": s.kind,
            "dtype": s.dtype,
            "slot_size": s.slot_size,
            "slot_count": s.slot_count,
            "crc": s.crc,
            "max_age_ms": s.max_age_ms,
            "lease_ms": s.lease_ms,
            "max_readers": s.max_readers,
            # The supervisor's monitor reads at the spare index after the workers'
            # (Supervisor._run_monitor): one more reader, never an actuating one.
            "monitor": len(readers) < s.max_readers,
        })
    return rows


# --------------------------------------------------------------------------- trust rules

_FALLBACK_RULES = [
    "a channel has exactly one writer, and a worker never reads what it writes itself",
    "a control (or actuating) worker never reads, other than through shadow_subscribes "
    "(log-only), a channel written in the research domain, marked shadow = true, or "
    "derived from either through workers of other domains",
    "only the control domain may actuate, and it never gets the network",
]


def _documented_rules() -> tuple[list[str], str]:
    """The safety rules as `supervisor.config` documents them (module docstring bullets
    up to the graph rules) and `check_trust`'s own summary."""
    import supervisor.config as config_module

    doc = inspect.getdoc(config_module) or ""
    rules: list[str] = []
    m = re.search(r"Safety rules checked here[^\n]*\n(.*?)(?:\n\s*\n|\Z)", doc, re.S)
    if m:
        for bullet in re.split(r"\n\* ", "\n" + m.group(1).strip()):
            text = " ".join(bullet.replace("``", "").split()).rstrip(";.")
            # the trust rules among them: writers, research/shadow data, actuation
            if text and any(k in text for k in ("writer", "shadow", "research", "actuat")):
                rules.append(text)
    summary = None
    for where in ("supervisor.config._rules", "supervisor.config._loader", "supervisor.config"):
        try:
            mod = importlib.import_module(where)
        except ImportError:
            continue
        fn = getattr(mod, "check_trust", None) or getattr(
            getattr(mod, "_Loader", None), "check_trust", None)
        if fn is not None:
            summary = inspect.getdoc(fn)
            break
    return rules or list(_FALLBACK_RULES), " ".join((summary or "").split())


def trust_rules(cfg: Config) -> dict[str, Any]:
    """What may reach actuation, as rules (from config.py) and as this config's facts."""
    rules, summary = _documented_rules()
    tainted = _tainted(cfg)
    upstream = _feeds_actuation(cfg)
    paths = []
    for act, chans in upstream.items():
        writers = []
        for c in chans:
            w = cfg.writer_of(c)
            if w not in writers:
                writers.append(w)
        paths.append({"actuation": act, "channels": chans, "workers": writers,
                      "domains": sorted({cfg.workers[w].domain for w in writers}),
                      "research_data_upstream": [c for c in chans if c in tainted]})
    log_only = [{"worker": w.name, "channel": c, "research_data": tainted.get(c)}
                for w in cfg.workers.values() for c in w.shadow_subscribes]
    actuating = [n for n, d in cfg.domains.items() if d.actuates]
    holds = (all(not p["research_data_upstream"] for p in paths)
             and all(not cfg.domains[n].network for n in actuating))
    return {"rules": rules, "check_trust": summary, "actuation_paths": paths,
            "research_data": tainted, "log_only_reads": log_only,
            "actuating_domains": actuating, "holds": holds, "supervisor_mode": cfg.supervisor.mode}
