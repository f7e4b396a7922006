"""Signed tinygrad model artifacts: format, signing/verification, compiler-free loading.

    from supervisor.model import load_verified
    v = load_verified("models/demo/lane-offset", "models/demo/demo_ed25519.pub")

`artifact` and `keys` need only the standard library and ``cryptography``; `runtime`
imports tinygrad (lazily, after verification). A CUDA artifact (`cuda`: format and checks)
runs through `cuda_runtime`, the CUDA driver alone: no tinygrad, no compiler.
"""
from .artifact import (FORMAT, VerifiedArtifact, canonical_json, load_verified, parse_manifest,
                       write_signed)
from .errors import (AbiMismatch, ArtifactError, BadPublicKey, BadSignature, CompilerVisible,
                     DeviceUnavailable, GoldenMismatch, HashMismatch, HostIncompatible, KernelNotInArtifact, ManifestError,
                     MissingFile, RuntimeMismatch, UnlistedFile, UnsafePickle, UnsignedArtifact,
                     WrongVersion)
from .keys import key_id, load_public_key

__all__ = [
    "FORMAT", "AbiMismatch", "ArtifactError", "BadPublicKey", "BadSignature", "CompilerVisible",
    "DeviceUnavailable", "GoldenMismatch",
    "HashMismatch", "HostIncompatible", "KernelNotInArtifact", "ManifestError", "MissingFile",
    "RuntimeMismatch", "UnlistedFile", "UnsafePickle", "UnsignedArtifact", "VerifiedArtifact",
    "WrongVersion", "canonical_json", "key_id", "load_public_key", "load_verified",
    "parse_manifest", "write_signed",
]
