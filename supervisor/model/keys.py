"""ed25519 keys for model artifacts (library: cryptography).

Public keys are stored as one line of 64 hex digits (the raw 32 bytes) or as PEM
(SubjectPublicKeyInfo). Private keys (build side only, never in the repository) as PEM
PKCS#8, unencrypted, mode 0600.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import BadPublicKey, BadSignature

_HEX64 = re.compile(rb"^\s*([0-9a-fA-F]{64})\s*$")


def public_key_from_bytes(data: bytes, *, source: str = "public key") -> Ed25519PublicKey:
    """Raw 32 bytes, 64 hex digits (whitespace allowed around) or PEM."""
    if len(data) == 32:
        return Ed25519PublicKey.from_public_bytes(data)
    m = _HEX64.match(data)
    if m:
        return Ed25519PublicKey.from_public_bytes(bytes.fromhex(m.group(1).decode()))
    if b"-----BEGIN" in data:
        try:
            key = serialization.load_pem_public_key(data)
        except ValueError as exc:
            raise BadPublicKey(f"{source}: not a PEM public key: {exc}") from None
        if not isinstance(key, Ed25519PublicKey):
            raise BadPublicKey(f"{source}: PEM key is {type(key).__name__}, not ed25519")
        return key
    raise BadPublicKey(f"{source}: expected 64 hex digits or a PEM ed25519 public key "
                       f"({len(data)} bytes found)")


def load_public_key(key: str | os.PathLike | bytes | Ed25519PublicKey) -> Ed25519PublicKey:
    """A public key object from a key object, raw/hex/PEM bytes or a file path."""
    if isinstance(key, Ed25519PublicKey):
        return key
    if isinstance(key, bytes):
        return public_key_from_bytes(key)
    path = Path(key)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BadPublicKey(f"public key {path}: {exc.strerror or exc}") from None
    return public_key_from_bytes(data, source=f"public key {path}")


def raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(key: Ed25519PublicKey) -> str:
    """sha256 of the raw public key, hex: names the signer in manifests and messages."""
    return hashlib.sha256(raw_public(key)).hexdigest()


def public_key_text(key: Ed25519PublicKey) -> str:
    return raw_public(key).hex() + "\n"


def verify(key: Ed25519PublicKey, signature: bytes, data: bytes, *, what: str) -> None:
    if len(signature) != 64:
        raise BadSignature(f"{what}: signature is {len(signature)} bytes, ed25519 needs 64")
    try:
        key.verify(signature, data)
    except InvalidSignature:
        raise BadSignature(f"{what}: ed25519 signature does not verify with the trusted key "
                           f"{key_id(key)[:16]}... (manifest altered, or signed by another key)"
                           ) from None


# ------------------------------------------------------------------ build side

def generate_private_key(path: str | os.PathLike) -> Ed25519PrivateKey:
    """A new key written to ``path`` (created 0600, never overwritten)."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return key


def load_private_key(path: str | os.PathLike) -> Ed25519PrivateKey:
    data = Path(path).read_bytes()
    if len(data) == 32:
        return Ed25519PrivateKey.from_private_bytes(data)
    key = serialization.load_pem_private_key(data, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path}: {type(key).__name__} is not an ed25519 private key")
    return key
