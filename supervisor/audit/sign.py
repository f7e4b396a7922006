"""Detached ed25519 signatures over a JSON audit report, with the keys and format the
project already uses for model artifacts (supervisor/model/keys.py; a signature is the
raw 64 bytes, like an artifact's manifest.sig).

What is signed is the report file's exact bytes: ``audit --format json --sign KEY``
writes the report to stdout (or ``--output``) and ``REPORT.sig`` next to it, so a
reviewer signs what they read and ``audit verify REPORT SIG PUBKEY`` checks that
nothing of it changed, not even whitespace.

A good signature only says the bytes are the signer's. What a reviewer signs off is a
config at a code version, so ``verify`` also says which config (source, sha256) and
which code (package version, git commit) the report covers, and checks that config as
it is now: a config edited after the report was signed fails verify (the report no
longer describes it), though the signature itself is good.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from supervisor.model.errors import BadPublicKey, BadSignature


class SignError(Exception):
    """A key, report or signature that cannot be used: one line for the user (bad
    input: `audit` exits 2)."""


class NotVerified(SignError):
    """A signature that does not verify the report's bytes with the key given: the
    report was altered, or another key signed it (`audit verify` exits 6, DIFFERS)."""


def load_signing_key(private_key: str):
    """The ed25519 private key in ``private_key``: refused in one line when the file is
    readable or writable by anyone but its owner (a signing key others can read signs
    for them too; ssh refuses such keys for the same reason), or when it is not an
    ed25519 private key (a public key given in its place is named as such)."""
    from supervisor.model.keys import load_private_key

    try:
        st = os.stat(private_key)
    except OSError as e:
        raise SignError(f"private key {private_key}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SignError(f"private key {private_key}: not a regular file")
    try:
        data = Path(private_key).read_bytes()
    except OSError as e:
        raise SignError(f"private key {private_key}: {e.strerror or e}") from None
    if b"PUBLIC KEY" in data or (len(data.strip()) == 64 and
                                 all(c in b"0123456789abcdefABCDEF" for c in data.strip())):
        raise SignError(f"private key {private_key}: this is a public key; --sign needs the "
                        f"private one (PEM PKCS#8, ed25519; the public key is for verify)")
    if st.st_mode & 0o077:
        raise SignError(f"private key {private_key}: mode {stat.S_IMODE(st.st_mode):04o} "
                        f"lets others read or change it: chmod 600 {private_key} (and "
                        f"consider the key exposed)")
    try:
        return load_private_key(private_key)
    except (OSError, ValueError, TypeError) as e:
        msg = str(getattr(e, "strerror", None) or e).split(". See https://")[0]
        raise SignError(f"private key {private_key}: not an ed25519 private key (PEM "
                        f"PKCS#8 expected): {msg}") from None


def sign_bytes(data: bytes, private_key: str) -> tuple[bytes, str]:
    """(signature, key id of the signer) of ``data`` with the PEM or raw key file."""
    from supervisor.model.keys import key_id

    key = load_signing_key(private_key)
    return key.sign(data), key_id(key.public_key())


def sign_file(report: str, private_key: str, out: str | None = None) -> tuple[str, str]:
    """Write ``out`` (default REPORT.sig); returns (its path, the key id)."""
    try:
        data = Path(report).read_bytes()
    except OSError as e:
        raise SignError(f"report {report}: {e.strerror or e}") from None
    sig, kid = sign_bytes(data, private_key)
    path = out or f"{report}.sig"
    Path(path).write_bytes(sig)
    return path, kid


@dataclass
class Verified:
    """What ``verify`` checked, for the reviewer to read (and sign off)."""
    report: str
    size: int
    key_id: str
    public_key: str
    covers: dict[str, Any] = field(default_factory=dict)   # the report's provenance
    result: str | None = None  # the report's own verdict (promise, matches, differs)
    config_now: str = ""       # how the config in hand compares with the report's
    config_ok: bool = True
    code_here: str = ""        # this checkout's commit against the report's (told, not judged)
    tools_here: list[str] = field(default_factory=list)   # what builds the policy here

    def lines(self) -> list[str]:
        c = self.covers
        cfg, git, pkg = c.get("config") or {}, c.get("git") or {}, c.get("package") or {}
        commit = git.get("commit") or "not a checkout"
        if git.get("dirty"):
            commit += " (with uncommitted changes)"
        return [
            f"  checked: ed25519 signature over all {self.size} bytes of {self.report}, "
            f"public key {self.public_key} (key id {self.key_id})",
            f"  the report covers: config {cfg.get('source')} sha256 {cfg.get('sha256')}; "
            f"code {pkg.get('name')} {pkg.get('version')}, git {commit}; made "
            f"{c.get('time_utc')} on {c.get('host')}; result {self.result}",
            f"  config now: {self.config_now}",
            f"  code here: {self.code_here}",
            *(f"  tools here: {t}" for t in self.tools_here),
        ]


def _config_now(covers: dict[str, Any], config: str | None) -> tuple[str, bool]:
    """Compare the config the report covers with the one in hand (``config``, else the
    report's own source path when it exists here)."""
    want = (covers.get("config") or {}).get("sha256")
    src = (covers.get("config") or {}).get("source") or ""
    if config is None:
        if src.startswith("<embedded"):
            from supervisor.config import PROJECT_ROOT

            config = str(Path(PROJECT_ROOT) / "supervisor" / "default.toml")
        elif src and os.path.isfile(src):
            config = src
        else:
            return _as_reported(covers, src)
    try:
        data = Path(config).read_bytes()
    except OSError as e:
        # The reviewer's own input: bad input (exit 2), never "does not verify" (6).
        raise SignError(f"--config {config}: {e.strerror or e}") from None
    now = hashlib.sha256(data).hexdigest()
    if now != want:
        # FAILED either way (the bytes are what was signed), but a comment is not the
        # control domain going on the network (review 7 finding 4): say which.
        return (f"{config} sha256 {now} differs from the report's {want}: the config "
                f"changed since the report was made; "
                f"{_what_moved(covers, data, config)}"), False
    moved = _meaning_moved(covers, config)
    if moved:
        return (f"{config} sha256 {now} is the report's, but {moved}: the report does "
                f"not describe what this config runs and trusts now"), False
    return (f"{config} sha256 {now}: the config the report covers, and the model keys, "
            f"manifests and control code trees it names are the report's"), True


def _as_reported(covers: dict[str, Any], src: str) -> tuple[str, bool]:
    """The report's config is not on this machine: what it names still is. Its control
    code trees and models are judged from the report's own copy of the config; saying
    "not checked" and OK verified a report against edited control code (review 8
    finding 2)."""
    from supervisor.config import ConfigError, loads

    where = f"{src or 'the config'} is not here"
    then = (covers.get("config") or {}).get("canonical")
    if not isinstance(then, str):
        return (f"{where} and the report keeps no copy of it (an older audit): not "
                f"checked (give --config F to check the config that will run)"), True
    try:
        cfg = loads(then, src or "<report>")
    except ConfigError as e:
        return (f"{where}; the report's copy of it does not load here ({e}): the code and "
                f"models it names cannot be checked"), False
    moved = _models_moved(covers, cfg) or _code_moved(covers, cfg)
    if moved:
        return (f"{where}; by the report's copy of it, {moved}: the report does not "
                f"describe the code and models here"), False
    return (f"{where} (give --config F to check the config that will run); the control "
            f"code trees and models its copy in the report names are the report's"), True


SHOWN_KEYS = 3       # config keys named when its meaning moved


def _what_moved(covers: dict[str, Any], data: bytes, config: str) -> str:
    """The config in hand against the report's canonical copy of its config: the first
    keys whose value differs, or that only comments or layout do."""
    import tomllib

    then = (covers.get("config") or {}).get("canonical")
    redo = (f"(run `supervisor audit --config {config}` and `supervisor audit diff` of "
            f"the report and the new one)")
    if not isinstance(then, str):
        return (f"the report keeps no copy of the config it covers (an older audit): what "
                f"moved cannot be named {redo}")
    try:
        now_doc = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        return f"it no longer parses as TOML ({str(e).splitlines()[0]})"
    then_flat, now_flat = _flatten(tomllib.loads(then)), _flatten(now_doc)
    moved = [k for k in sorted(then_flat.keys() | now_flat.keys())
             if then_flat.get(k, _ABSENT) != now_flat.get(k, _ABSENT)]
    if not moved:
        return ("only comments or layout differ: the loaded config is the report's (the "
                "signed bytes are not: re-sign, or verify the bytes that were signed)")
    said = ", ".join(f"{k} {_toml(then_flat.get(k, _ABSENT))} -> "
                     f"{_toml(now_flat.get(k, _ABSENT))}" for k in moved[:SHOWN_KEYS])
    more = f", and {len(moved) - SHOWN_KEYS} more" if len(moved) > SHOWN_KEYS else ""
    return f"the config's meaning moved: {said}{more} {redo}; the report does not describe it"


_ABSENT = object()


def _flatten(doc: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a TOML document's leaves (arrays are values)."""
    out: dict[str, Any] = {}
    for k, v in doc.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _toml(v: Any) -> str:
    if v is _ABSENT:
        return "absent"
    s = json.dumps(v, default=str)
    return s if len(s) <= 60 else s[:57] + "..."


def _meaning_moved(covers: dict[str, Any], config: str) -> str | None:
    """What the config's files trust or run now that the report does not say, else
    None. The config's bytes are not all of its meaning: each `[models.X]` names a
    public key file (the trust root of the model the car runs) and an artifact, and a
    control domain's `python_path` holds the code its workers import. Replaced, with
    the same TOML, `check` and `run` trusted another signer (red team 9 row 1) or ran
    other control code (row 6) while verify said the report covers the config."""
    from supervisor.config import ConfigError, load

    try:
        cfg = load(config)
    except ConfigError as e:
        return f"it no longer loads ({e})"
    return _models_moved(covers, cfg) or _code_moved(covers, cfg)


def _code_moved(covers: dict[str, Any], cfg) -> str | None:
    from .provenance import INSTALLED, code_trees

    def place(t: dict[str, Any]) -> tuple[str, str]:
        # The project's packages by name: a reviewer may verify another install of them.
        d, p = t.get("domain") or "", t.get("path") or ""
        return d, (os.path.basename(p) if d == INSTALLED else p)

    now = {place(t): t for t in code_trees(cfg)}
    if "code_trees" not in covers:
        return ("the report records no digest of the code it covers (an older audit): "
                "re-audit")
    then = {place(t): t for t in covers["code_trees"]}
    for key in sorted(now.keys() | then.keys(), key=str):
        where = (f"the installed package {key[1]}" if key[0] == INSTALLED
                 else f"domain {key[0]}'s python_path {key[1]}")
        if key not in then or key not in now:
            return f"{where} is {'new' if key not in then else 'gone'}"
        a, b = then[key].get("sha256"), now[key]["sha256"]
        if not _is_digest(b):
            # 'unreadable: ...' or 'more than N entries': equal twice is no evidence
            # that nothing changed (red team 11 row 13: a zip's digest was a constant)
            return f"{where} cannot be digested ({b}): the report cannot vouch for it"
        if a != b:
            return (f"{where}: the report covers code tree {_short(a)}, the files now "
                    f"give {_short(b)}: {_files_moved(then[key], now[key])}")
    return None


SHOWN = 3        # files named per kind of change (changed, added, removed)


def _files_moved(then: dict[str, Any], now: dict[str, Any]) -> str:
    """The first files of a code tree that differ (review 7 finding 9: a digest alone
    told an edited control worker from a native module another compiler built no
    better than not at all): `changed: probe/__init__.py (sha256 a1b2... in the report,
    c3d4... here); added: none; removed: none`."""
    if not isinstance(then.get("entries"), list):
        return "the report keeps no file list of this tree (an older audit): re-audit to name the files"
    if not isinstance(now.get("entries"), list):
        return "the files cannot be named here (too many entries)"
    old = {str(e[0]): e for e in then["entries"] if isinstance(e, list) and e}
    new = {str(e[0]): e for e in now["entries"] if e}
    changed = sorted(p for p in old.keys() & new.keys() if old[p] != new[p])
    added, removed = sorted(new.keys() - old.keys()), sorted(old.keys() - new.keys())

    def some(paths: list[str], say: Callable[[str], str]) -> str:
        if not paths:
            return "none"
        more = f", and {len(paths) - SHOWN} more" if len(paths) > SHOWN else ""
        return ", ".join(say(p) for p in paths[:SHOWN]) + more

    def was(p: str) -> str:
        return f"{p} ({_entry(old[p])} in the report, {_entry(new[p])} here)"
    out = (f"changed: {some(changed, was)}; added: {some(added, lambda p: p)}; "
           f"removed: {some(removed, lambda p: p)}")
    native = [p for p in changed + added + removed if p.endswith(".so")]
    if native:
        out += "; " + _native_note(native, old, new)
    return out


def _entry(e: list) -> str:
    """An entry as a reviewer reads it: a file's sha256 (short), else its kind."""
    if "runs bytecode" in e:
        return f"sha256 {_short(e[e.index('runs bytecode') + 1])} (its bytecode)"
    if "file" in e and e.index("file") + 1 < len(e):
        return f"sha256 {_short(e[e.index('file') + 1])}"
    return " ".join(str(x) for x in e[1:])


def _native_note(native: list[str], old: dict[str, list], new: dict[str, list]) -> str:
    """Whether a native module that differs was rebuilt from the report's source: its
    C files in the same directory unchanged (every install compiles its own .so; another
    compiler or flags give other bytes)."""
    dirs = {os.path.dirname(p) for p in native}
    sources = sorted(p for p in old.keys() | new.keys()
                     if p.endswith(".c") and os.path.dirname(p) in dirs)
    if not sources:
        return f"native module {native[0]}: no C source beside it in the tree"
    moved = [p for p in sources if old.get(p) != new.get(p)]
    if moved:
        return f"native module {native[0]}: its source {', '.join(moved)} differs too"
    return (f"native module {native[0]}: its source {', '.join(sources)} is the report's "
            f"(rebuilt here from the report's source: another compiler or flags?)")


def _models_moved(covers: dict[str, Any], cfg) -> str | None:
    from .promise import trusted_models
    def place(m: dict[str, Any]) -> str:
        # By the artifact's path below models/: a report is verified at another install
        # of the same bytes (review 7 finding 1: by absolute path, every other install's
        # models were 'gone'). Key, manifest and signature are compared below.
        art = str(m.get("artifact") or "")
        return art.rpartition("/models/")[2] if "/models/" in art else art

    now = {(w.name, place(m)): m for w in cfg.workers.values()
           for m in trusted_models(w, cfg)}
    then = {(a.get("worker"), place(a)): a for a in covers.get("artifacts") or []}
    for key in sorted(now.keys() | then.keys(), key=str):
        a, b = then.get(key), now.get(key)
        where = f"worker {key[0]}'s model {key[1]}"
        if a is None or b is None:
            return f"{where} is {'new' if a is None else 'gone'}"
        for field_, what in (("key_id", "signing key"), ("manifest_sha256", "manifest"),
                             ("signature", "signature check")):
            if a.get(field_) != b.get(field_):
                return (f"{where}: the report covers {what} {_short(a.get(field_))}, "
                        f"the files now give {_short(b.get(field_))}")
        moved = _model_files_moved(a, b.get("artifact"))
        if moved:
            return f"{where}: {moved}"
    return None


def _model_files_moved(then: dict[str, Any], artifact: str | None) -> str | None:
    """The first file of a model artifact whose bytes are not the report's (gate 9
    finding 4): the signature is over the manifest, so a file changed under an
    unchanged manifest still 'verifies'; the loader refuses it (HashMismatch) and so
    must verify. Each file is hashed here, not read from the manifest."""
    files = then.get("files")
    if not isinstance(files, dict) or not artifact:
        return None
    for name in sorted(files):
        try:
            with open(os.path.join(artifact, name), "rb") as f:
                here = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as e:
            here = f"unreadable: {e.strerror or e}"
        if here != files[name]:
            return (f"{name} (sha256 {_short(files[name])} in the report, "
                    f"{_short(here)} here)")
    if then.get("files_match_manifest") is False:
        return ("the report says its files did not match the manifest when it was made "
                "(re-audit a model the loader accepts)")
    return None


def _is_digest(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _short(v: Any) -> str:
    s = str(v)
    return s[:16] + "..." if len(s) > 24 and " " not in s else s


def verify_file(report: str, signature: str, public_key: str,
                config: str | None = None) -> Verified:
    """What was checked if ``signature`` is ``public_key``'s over the report's bytes
    (and the config in hand is the one it covers: ``config_ok``); SignError (one line)
    when the signature does not verify."""
    from supervisor.model.keys import key_id, load_public_key, verify

    try:
        data = Path(report).read_bytes()
        sig = Path(signature).read_bytes()
    except OSError as e:
        raise SignError(f"{e.filename}: {e.strerror or e}") from None
    try:
        key = load_public_key(public_key)
    except BadPublicKey as e:
        raise SignError(str(e)) from None
    if len(sig) != 64:
        raise SignError(f"{signature}: {len(sig)} bytes, an ed25519 signature has 64 "
                        f"(is it the signature file `--sign` wrote, REPORT.sig?)")
    try:
        verify(key, sig, data, what=f"{signature} over {report}")
    except BadSignature:
        raise NotVerified(f"{signature} is not a signature of {report} by key "
                        f"{key_id(key)[:16]}...: the report was altered, or another key "
                        f"signed it") from None
    try:
        doc = json.loads(data)
        covers, result = dict(doc["provenance"]), doc.get("result")
    except (ValueError, KeyError, TypeError):
        raise SignError(f"{report}: the signature is good but this is not a JSON audit "
                        f"report (no provenance): nothing to check it against") from None
    now, ok = _config_now(covers, config)
    return Verified(report, len(data), key_id(key), public_key, covers, result, now, ok,
                    _code_here(covers), _tools_moved(covers))


# What the policy is built and enforced with, as the report's provenance names it: the
# sandboxes are bubblewrap's, the seccomp filters pyseccomp's, the models tinygrad's.
WHY_TOOL = {"bwrap": "the sandboxes are built by it", "pyseccomp": "the seccomp filters "
            "are compiled by it", "python": "the supervisor and the workers run on it"}


def _tools_moved(covers: dict[str, Any]) -> list[str]:
    """The bubblewrap, interpreter and libraries here against the report's (gate 9
    finding 6: a bwrap 0.4.0 first on PATH verified OK, not a word). Told, not judged:
    a reviewer verifies on other machines; the line says what the report's isolation
    claims were not made with. One line when all are the report's."""
    import platform
    import sys

    from .provenance import LIBRARIES, _tool, _version

    now: dict[str, Any] = {"bwrap": _tool(["bwrap", "--version"]),
                           "python": f"{platform.python_implementation()} "
                                     f"{platform.python_version()} ({sys.executable})"}
    then: dict[str, Any] = {"bwrap": (covers.get("tools") or {}).get("bwrap"),
                            "python": covers.get("python")}
    libs = covers.get("libraries") or {}
    for name in LIBRARIES:
        if name in libs:
            then[name], now[name] = libs[name], _version(name)
    out = []
    for name in then:
        if then[name] != now[name]:
            why = WHY_TOOL.get(name)
            out.append(f"{name}: {now[name] or 'absent'} here, the report's "
                       f"{then[name] or 'absent'}" + (f" ({why})" if why else "")
                       + ": the report's claims were not made with this one")
    if not out:
        return [f"bwrap, python and {len(then) - 2} libraries are the report's"]
    return out


def _code_here(covers: dict[str, Any]) -> str:
    """The commit of the code verifying, beside the report's: the audit's sections are
    derived from the code, so a report of other code may not describe this one."""
    from supervisor.config import PROJECT_ROOT

    from .provenance import git_commit

    here = git_commit(str(PROJECT_ROOT))
    theirs = (covers.get("git") or {}).get("commit")
    tail = " (with uncommitted changes)" if here.get("dirty") else ""
    if here.get("commit") != theirs:
        same = f"not the report's ({theirs})"
    elif here.get("dirty") or (covers.get("git") or {}).get("dirty"):
        # The same commit is not the same code once either side has changes of its own
        # (review 8 finding 2): the code trees above say which files.
        same = "the report's commit, but not its code (uncommitted changes)"
    else:
        same = "the report's"
    return f"git {here.get('commit')}{tail}: {same}"
