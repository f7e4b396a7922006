"""Where and from what an audit was made, so that a reviewer can reproduce it and tell
two reports apart: time, host, kernel, distribution, package version and git commit,
the config's sha256, every model artifact's sha256 and signing key, the interpreter and
the libraries that enforce or check isolation."""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from supervisor.admission.bytecode import cache_name, unfaithful
from supervisor.config import PROJECT_PACKAGES, Config

# Libraries whose versions change what is enforced or checked.
LIBRARIES = ("trio", "numpy", "cryptography", "pyseccomp", "pycapnp", "tinygrad", "torch")


def _distribution() -> str | None:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit(root: str) -> dict[str, Any]:
    """{commit, dirty} of the checkout at ``root``, or {commit: "not a checkout"}."""
    if not os.path.isdir(os.path.join(root, ".git")):
        return {"commit": "not a checkout", "dirty": None}
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        # Only the shipped packages count: a dirty test file changes nothing enforced.
        status = subprocess.run(["git", "-C", root, "status", "--porcelain", "--",
                                 *PROJECT_PACKAGES], capture_output=True,
                                text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": "not a checkout", "dirty": None}
    return {"commit": head, "dirty": bool(status.strip())}


def _tool(argv: list[str]) -> str | None:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    out = (p.stdout or p.stderr).strip().splitlines()
    return out[0] if out else None


def _config_path(cfg: Config) -> Path:
    from supervisor.config import PROJECT_ROOT

    if cfg.source.startswith("<embedded"):
        return Path(PROJECT_ROOT) / "supervisor" / "default.toml"
    return Path(cfg.source)


def config_sha256(cfg: Config) -> str | None:
    """sha256 of the config file's bytes (the embedded default's when no file)."""
    try:
        return hashlib.sha256(_config_path(cfg).read_bytes()).hexdigest()
    except OSError:
        return None


def config_canonical(cfg: Config) -> str | None:
    """The config as loaded, without its comments and layout (`supervisor.config.dumps`
    of its TOML document): `audit verify` of a config whose bytes differ names the keys
    whose meaning moved, or says only comments or layout did (review 7 finding 4)."""
    import tomllib

    from supervisor.config import dumps

    try:
        return dumps(tomllib.loads(_config_path(cfg).read_text("utf-8")))
    except (OSError, ValueError):
        return None


def _files(artifact: str | None) -> tuple[dict[str, str], bool | None]:
    """({file: sha256} as the signed manifest lists them, whether every file on disk
    has that sha256 now)."""
    import json

    if not artifact:
        return {}, None
    root = Path(artifact)
    try:
        listed = json.loads((root / "manifest.json").read_bytes()).get("files") or {}
    except (OSError, ValueError, AttributeError):
        return {}, None
    files = {n: str(v.get("sha256")) for n, v in listed.items() if isinstance(v, dict)}
    ok = True
    for name, want in files.items():
        try:
            with open(root / name, "rb") as f:
                ok &= hashlib.file_digest(f, "sha256").hexdigest() == want
        except OSError:
            ok = False
    return files, ok


TREE_MAX = 20_000       # entries of one python_path hashed, at most (as config checks)


def tree_sha256(path: str) -> str:
    """One digest of a code tree: every entry's relative path, kind and content, one
    JSON array per entry in sorted order (names may hold newlines: joined plainly, two
    trees re-split into one digest, review 6 finding 6). A link is hashed by what it
    resolves to as well (a module linked to a file outside the tree is imported through
    the link: its content, not its target's name, is the code; finding 4). Or why there
    is no digest."""
    return tree_digest(path)[0]


ENTRIES_MAX = 5_000     # a tree's entries kept in the report, at most (its size bounded)


def tree_digest(path: str) -> tuple[str, list[list] | None]:
    """(tree_sha256's digest, the entries it hashed in order: [path, kind, ...] as
    `_walk_into` writes them, or None when there is no digest). The entries let `audit
    verify` name the files that moved, not only a digest (review 7 finding 9)."""
    h = hashlib.sha256(b"tree v2\n")
    entries: list[list] = []

    def emit(entry: list) -> None:
        h.update(_line(entry))
        entries.append(entry)
    try:
        _walk_into(emit, os.path.realpath(path), "", [0], set())
    except _TooBig:
        return f"more than {TREE_MAX} entries", None
    except OSError as e:
        return f"unreadable: {e.filename}: {e.strerror}", None
    return h.hexdigest(), entries


class _TooBig(Exception):
    pass


def _walk_into(emit: Callable[[list], None], root: str, prefix: str, seen: list[int],
               dirs_in: set[str], caches: bool = False) -> None:
    """Emit (to be hashed) each entry of the tree at `root` (a real directory) under the
    name `prefix`; `dirs_in`: the real directories being walked (a link back into one is
    named, not followed)."""
    dirs_in = dirs_in | {root}
    for name in sorted(os.listdir(root)):
        if name == "__pycache__":
            # Derived, rewritten by any import: its caches count only where one is not
            # its source's (below). Anything else in it is a module (it imports as a
            # package: red team 12 row 3), hashed as any entry; honest trees add nothing.
            full = os.path.join(root, name)
            if os.path.isdir(full) and not os.path.islink(full):
                _walk_into(emit, full, prefix + name + "/", seen, dirs_in, caches=True)
            else:
                emit([prefix + name, "not a directory"])
            continue
        if caches and cache_name(name) and stat.S_ISREG(os.lstat(os.path.join(root, name)).st_mode):
            continue
        seen[0] += 1
        if seen[0] > TREE_MAX:
            raise _TooBig
        full, rel = os.path.join(root, name), prefix + name
        st = os.lstat(full)
        entry: list = [rel]
        if stat.S_ISLNK(st.st_mode):
            entry += ["link", os.readlink(full)]
            real = os.path.realpath(full)
            if os.path.isdir(real):
                if real in dirs_in:
                    entry.append("loop")
                else:
                    emit(entry + ["dir"])
                    _walk_into(emit, real, rel + "/", seen, dirs_in)
                    continue
            elif os.path.exists(real):
                entry += ["file", _file_sha256(real)]
            else:
                entry.append("dangling")
        elif stat.S_ISDIR(st.st_mode):
            emit(entry + ["dir"])
            _walk_into(emit, full, rel + "/", seen, dirs_in)
            continue
        elif stat.S_ISREG(st.st_mode):
            entry += ["file", _file_sha256(full)]
            cached = unfaithful(full) if name.endswith(".py") else None
            if cached:
                # What runs is that bytecode, not this source (red team 11 row 2): an
                # honest cache adds nothing, so a tree's digest is the same warm or cold.
                entry += ["runs bytecode", _file_sha256(cached)]
        else:                       # a FIFO or device: named, never opened (it would hang)
            entry += ["special", stat.S_IFMT(st.st_mode)]
        emit(entry)


def _line(entry: list) -> bytes:
    return json.dumps(entry, ensure_ascii=True).encode() + b"\n"


def _file_sha256(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return "special"
        return hashlib.file_digest(f, "sha256").hexdigest()


INSTALLED = "(installed)"      # code_trees' domain for the project's own packages
PACKAGES = PROJECT_PACKAGES


def code_trees(cfg: Config) -> list[dict[str, Any]]:
    """The code the report's admission rows describe, as digests: the project's own
    packages (the control workers' modules, the runner, the guard: review 6 finding 5,
    an installed copy outside git changed after signing verified OK) and each
    python_path of a domain whose code admission vouches for
    (`DomainConfig.code_vouched`; red team 9 row 6)."""
    from supervisor.config import PROJECT_ROOT

    own = [_tree(INSTALLED, os.path.join(str(PROJECT_ROOT), pkg)) for pkg in PACKAGES]
    return own + [_tree(name, p) for name, d in sorted(cfg.domains.items())
                  if d.code_vouched for p in d.python_path]


def _tree(domain: str, path: str) -> dict[str, Any]:
    """One code tree: its digest and, up to ENTRIES_MAX, the entries digested (None:
    more, or no digest: verify then cannot name the files)."""
    digest, entries = tree_digest(path)
    if entries is not None and len(entries) > ENTRIES_MAX:
        entries = None
    return {"domain": domain, "path": path, "sha256": digest, "entries": entries}


def artifacts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each model artifact the workers load: manifest sha256 and signing key id (the
    manifest lists every file's sha256 and is what the signature covers), the files'
    sha256 and whether the files on disk match them."""
    out = []
    for r in rows:
        for m in r.get("models") or []:
            files, match = _files(m.get("artifact"))
            out.append({"worker": r["worker"], "artifact": m.get("artifact"),
                        "manifest_sha256": m.get("manifest_sha256"),
                        "key_id": m.get("key_id"), "signature": m.get("signature"),
                        "name": m.get("name"), "version": m.get("version"),
                        "files": files, "files_match_manifest": match})
    return out


def provenance(cfg: Config, rows: list[dict[str, Any]]) -> dict[str, Any]:
    from supervisor.config import PROJECT_ROOT

    u = platform.uname()
    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "kernel": f"{u.system} {u.release} {u.machine}",
        "distribution": _distribution(),
        "package": {"name": "supervisor", "version": _version("supervisor")},
        "git": git_commit(str(PROJECT_ROOT)),
        # The install: `audit diff` compares the paths under it relative to it.
        "project_root": str(PROJECT_ROOT),
        "config": {"source": cfg.source, "sha256": config_sha256(cfg),
                   "canonical": config_canonical(cfg)},
        "artifacts": artifacts(rows),
        "code_trees": code_trees(cfg),
        "python": f"{platform.python_implementation()} {platform.python_version()} "
                  f"({sys.executable})",
        "libraries": {name: _version(name) for name in LIBRARIES},
        "tools": {"bwrap": _tool(["bwrap", "--version"])},
    }
