"""``--plot CHANNEL.FIELD``: the signals plot.png and report.html show.

A field is named as the channel's payload names it (`schemas/payloads.py`:
``control_cmd.steer_rad``, ``model_out.offset_m``), by position for a channel without
a payload (``CHANNEL.0``), or ``latency_ms`` for a channel whose messages carry
execution receipts (the model's output). Names are checked against the config that
will run, before anything starts: an unknown channel or field is one line naming it
and what there is instead (exit 2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schemas.payloads import PAYLOADS

LATENCY = "latency_ms"          # a receipt's latency, not a payload field


class SignalError(ValueError):
    """One line: a --plot that names nothing this pipeline has."""


@dataclass(frozen=True)
class Sig:
    channel: str
    field: str
    index: int | None            # position in the payload; None: the receipt's latency

    @property
    def name(self) -> str:
        return f"{self.channel}.{self.field}"


def _channels(doc: dict[str, Any]) -> dict[str, str | None]:
    """Channel name -> its payload name (None: none declared)."""
    out: dict[str, str | None] = {}
    for n, c in (doc.get("channels") or {}).items():
        out[str(n)] = c.get("payload") if isinstance(c, dict) else None
    return out


def fields_of(payload: str | None) -> list[str]:
    p = PAYLOADS.get(payload or "")
    return list(p.fields) if p is not None else []


def parse_signals(specs: list[str], doc: dict[str, Any], plan) -> list[Sig]:
    """``specs`` resolved against the config ``doc`` (and its replay plan: the frame
    channel cannot be plotted, the model's output has ``latency_ms``)."""
    chans = _channels(doc)
    out: list[Sig] = []
    for spec in specs:
        ch, dot, f = spec.partition(".")
        if not dot or not ch or not f:
            raise SignalError(f"--plot {spec!r}: expected CHANNEL.FIELD "
                              f"(e.g. control_cmd.steer_rad)")
        if ch not in chans:
            raise SignalError(f"--plot {spec!r}: no channel {ch!r} in the config (channels: "
                              f"{', '.join(sorted(c for c in chans if c != plan.frames))})")
        if ch == plan.frames:
            raise SignalError(f"--plot {spec!r}: {ch!r} is the frame channel (its frames are "
                              f"the report's scrubber); plot a field of another channel")
        names = fields_of(chans[ch])
        with_latency = names + ([LATENCY] if ch == plan.model_out else [])
        if f == LATENCY and ch == plan.model_out:
            sig = Sig(ch, f, None)
        elif f in names:
            sig = Sig(ch, f, names.index(f))
        elif not names and f.isdecimal() and f.isascii():   # never '²' (int() refuses it)
            sig = Sig(ch, f, int(f))
        else:
            have = ", ".join(with_latency) or "none named: give a position, e.g. 0"
            raise SignalError(f"--plot {spec!r}: channel {ch!r} has no field {f!r} "
                              f"(fields: {have})")
        if sig not in out:
            out.append(sig)
    return out


def check_compare_names(gate: list[str], ignore: list[str], tol_keys: list[str],
                        doc: dict[str, Any]) -> None:
    """--gate, --ignore and --tol name channels (and fields) of the config: checked
    before anything starts, as --plot is. Unchecked, a misspelt name did nothing: a
    `--gate shadow_ou` gated nothing and a changed shadow_out passed; a
    `--tol control_cmd.steer_radd=1e-6` tolerated nothing."""
    chans = _channels(doc)
    listed = ", ".join(sorted(chans))

    def field_ok(opt: str, spec: str, ch: str, f: str, extra: tuple[str, ...] = ()) -> None:
        names = fields_of(chans[ch])
        # ("[i]": the position names the diff uses where a payload's names do not fit)
        if names and f not in names and f not in extra and not (
                f.startswith("[") and f.endswith("]") and f[1:-1].isdecimal()):
            raise SignalError(f"{opt} {spec!r}: channel {ch!r} has no field {f!r} (fields: "
                              f"{', '.join(names + list(extra))})")

    for spec, opt in [(g, "--gate") for g in gate] + [(i, "--ignore") for i in ignore] \
            + [(t, "--tol") for t in tol_keys]:
        if opt == "--gate" and spec == "all":
            continue
        ch, dot, f = spec.partition(".")
        if ch not in chans:
            raise SignalError(f"{opt} {spec!r}: no channel {ch!r} in the config (channels: "
                              f"{listed})")
        if dot and opt == "--gate":
            raise SignalError(f"{opt} {spec!r}: --gate takes a channel, not a field")
        if dot:
            field_ok(opt, spec, ch, f, ("added", "removed") if opt == "--tol" else ())


def value(msg, sig: Sig) -> float | None:
    """The signal's value in one recorded message (None: not there)."""
    if sig.index is None:
        return None if msg.receipt is None else msg.receipt.latency_ns / 1e6
    v = msg.array.ravel()
    return float(v[sig.index]) if sig.index < v.size else None
