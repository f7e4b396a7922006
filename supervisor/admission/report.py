"""What admission says about a worker, in a form both code and humans read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FindingKind = Literal["import", "elf", "maps"]


@dataclass(frozen=True)
class Finding:
    kind: FindingKind
    worker: str
    domain: str
    chain: list[str]  # entry ... forbidden thing, one element per hop
    message: str  # one human sentence naming worker, domain and the chain


@dataclass
class AdmissionReport:
    worker: str
    domain: str
    ok: bool
    findings: list[Finding] = field(default_factory=list)
    # not refusals: skipped/corrupt files, unresolvable dynamic imports,
    # waived lazy imports. Kept so an operator can see what was not proven.
    notes: list[str] = field(default_factory=list)

    def format(self, *, with_notes: bool = False) -> str:
        if self.ok:
            head = f"admitted: {self.domain}-domain worker {self.worker}"
            if self.domain == "control":
                head += " (no forbidden module or library reachable)"
            lines = [head]
        else:
            n = len(self.findings)
            plural = "s" if n != 1 else ""
            lines = [f"refused: {self.domain}-domain worker {self.worker} reaches forbidden code ({n} finding{plural})"]
            lines += [f"  [{f.kind}] {f.message}" for f in self.findings]
        if with_notes and self.notes:
            lines.append("  notes:")
            lines += [f"    {note}" for note in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()
