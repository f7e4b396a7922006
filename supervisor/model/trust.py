"""What the config trusts to run ([models.NAME]), checked before anything starts.

`supervisor check` verifies every model a worker names, exactly as the worker will at
start (signature over the manifest, every file's hash, name, minimum version), and
prints one line per model saying what is trusted. A refusal is a config problem
naming the model and what was wrong; nothing is unpickled or executed here.
"""
from __future__ import annotations

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
        except ArtifactError as e:
            problems.append((f"models.{name}", f"refused: {type(e).__name__}: {e}"))
        except OSError as e:
            problems.append((f"models.{name}", f"cannot read: {e.strerror or e}"))
    return trusted, problems
