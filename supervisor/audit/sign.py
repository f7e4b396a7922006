"""Detached ed25519 signatures over a JSON audit report, with the keys and format the
project already uses for model artifacts (supervisor/model/keys.py; a signature is the
raw 64 bytes, like an artifact's manifest.sig).

What is signed is the report file's exact bytes: ``audit --format json --sign KEY``
writes the report to stdout (or ``--output``) and ``REPORT.sig`` next to it, so a
reviewer signs what they read and ``audit verify REPORT SIG PUBKEY`` checks that
nothing of it changed, not even whitespace.
"""
from __future__ import annotations

from pathlib import Path

from supervisor.model.errors import BadPublicKey, BadSignature


class SignError(Exception):
    """A key, report or signature that cannot be used: one line for the user."""


def sign_bytes(data: bytes, private_key: str) -> tuple[bytes, str]:
    """(signature, key id of the signer) of ``data`` with the PEM or raw key file."""
    from supervisor.model.keys import key_id, load_private_key

    try:
        key = load_private_key(private_key)
    except (OSError, ValueError, TypeError) as e:
        raise SignError(f"private key {private_key}: {getattr(e, 'strerror', None) or e}") \
            from None
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


def verify_file(report: str, signature: str, public_key: str) -> str:
    """The signer's key id if ``signature`` is ``public_key``'s over the report's
    bytes; SignError (one line) otherwise."""
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
    try:
        verify(key, sig, data, what=f"{signature} over {report}")
    except BadSignature:
        raise SignError(f"{signature} is not a signature of {report} by key "
                        f"{key_id(key)[:16]}...: the report was altered, or another key "
                        f"signed it") from None
    return key_id(key)
