"""What the config trusts to run ([models.NAME]), checked before anything starts.

`supervisor check` verifies every model a worker names, exactly as the worker will at
start (signature over the manifest, every file's hash, name, minimum version), and
prints one line per model saying what is trusted. A refusal is a config problem
naming the model and what was wrong; nothing is unpickled or executed here.
"""
from __future__ import annotations

import errno
import tempfile
from dataclasses import dataclass

from .artifact import load_verified
from .errors import ArtifactError


@dataclass(frozen=True)
class Trusted:
    model: str             # the [models.NAME] table
    name: str              # the manifest's model.name
    version: str
    min_version: str | None
    key_id: str
    manifest_sha256: str
    workers: tuple[str, ...]

    def line(self) -> str:
        floor = f" (>= {self.min_version})" if self.min_version else ""
        return (f"trusts model {self.model!r}: {self.name} {self.version}{floor}, key "
                f"{self.key_id[:16]}, manifest sha256 {self.manifest_sha256[:16]}, "
                f"for {', '.join(self.workers)}")


def verify_models(cfg) -> tuple[list[Trusted], list[tuple[str, str]]]:
    """(what is trusted, [(key path, reason)]) for every model a worker uses."""
    trusted: list[Trusted] = []
    problems: list[tuple[str, str]] = []
    for name, m in cfg.models.items():
        users = tuple(w.name for w in cfg.workers.values() if w.model == name)
        if not users:
            continue
        try:
            with load_verified(m.artifact, m.public_key, expect_name=m.expect_name or None,
                               min_version=m.min_version) as v:
                trusted.append(Trusted(name, v.name, v.version, m.min_version, v.key_id,
                                       v.manifest_sha256.hex(), users))
                problems += _unbound_inputs(cfg, name, v, users)
                problems += _device_mismatch(cfg, name, v, users)
        except ArtifactError as e:
            problems.append((f"models.{name}", f"refused: {type(e).__name__}: {e}"))
        except OSError as e:
            # Verifying writes a private copy under the temporary directory: a full or
            # read-only one is not the artifact's fault (a 1 MiB /tmp said "cannot read").
            where = (f" (the verified copy is written under {tempfile.gettempdir()!r}: "
                     "TMPDIR)" if e.errno in (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
                     else "")
            problems.append((f"models.{name}", f"cannot verify: {e.strerror or e}{where}"))
    return trusted, problems


def _device_mismatch(cfg, name: str, v, users: tuple[str, ...]) -> list[tuple[str, str]]:
    """A CUDA artifact runs only in a worker that declares device = "cuda" (else its
    sandbox has no GPU node and modeld refuses at every start); a CPU artifact in one that
    does would hold GPU nodes it never uses."""
    out: list[tuple[str, str]] = []
    for w in users:
        have = getattr(cfg.workers[w], "device", "cpu")
        if v.device == "CUDA" and have != "cuda":
            out.append((f"workers.{w}.device", f"model {name!r} is a CUDA artifact "
                        f"({v.target}): the worker needs device = \"cuda\" (it has {have!r})"))
        elif v.device != "CUDA" and have == "cuda":
            out.append((f"workers.{w}.device", f"model {name!r} runs on the CPU: device = "
                        f"\"cuda\" would give the worker GPU nodes it never uses"))
    return out


def _unbound_inputs(cfg, name: str, v, users: tuple[str, ...]) -> list[tuple[str, str]]:
    """A model of several cameras (input ABI 3) names the worker role of each input:
    a worker running it without that role bound would refuse to start (in control:
    restarts, then fail-safe), so `check` says so first."""
    out: list[tuple[str, str]] = []
    if len(v.input_abis) < 2:      # one camera: the worker's own ROLES rule covers it
        return out
    for w in users:
        roles = dict(cfg.workers[w].roles)
        for i in v.input_abis:
            role = i.get("role")
            if role is not None and role not in roles:
                out.append((f"workers.{w}.subscribes",
                            f"model {name!r} takes input {i.get('name')!r} "
                            f"({i.get('sensor') or 'a'} camera) on role {role!r}: bind it, "
                            f"e.g. subscribes = {{ {role} = \"CHANNEL\" }}"))
    return out
