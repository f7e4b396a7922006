"""Typed refusals of a model artifact. Every message names the file or field at fault."""
from __future__ import annotations


class ArtifactError(Exception):
    """Base class: the artifact may not be loaded (nothing from it has run)."""


class UnsignedArtifact(ArtifactError):
    """No (or an empty) manifest.sig, or no manifest.json at all."""


class BadSignature(ArtifactError):
    """manifest.sig is not a valid ed25519 signature of manifest.json by the trusted key."""


class BadPublicKey(ArtifactError):
    """The trusted public key file cannot be read as an ed25519 public key."""


class ManifestError(ArtifactError):
    """The signed manifest is not canonical JSON or lacks/garbles a required field."""


class MissingFile(ArtifactError):
    """A file the manifest lists is absent (or not a regular file)."""


class UnlistedFile(ArtifactError):
    """The bundle holds a file the manifest does not list (it would be unverified)."""


class HashMismatch(ArtifactError):
    """A file's sha256 (or size, or a kernel object's hash) differs from the manifest."""


class WrongVersion(ArtifactError):
    """Model name/version (or the artifact format) is not the one expected."""


class RuntimeMismatch(ArtifactError):
    """The artifact was built for another tinygrad version, device or renderer."""


class HostIncompatible(ArtifactError):
    """The compiled objects target another architecture or CPU features than this host has."""


class AbiMismatch(ArtifactError):
    """Input or output tensor ABI differs from what the caller (or the captured JIT) expects."""


class UnsafePickle(ArtifactError):
    """jit.pkl references something outside the allow-list (defence in depth after the signature)."""


class KernelNotInArtifact(ArtifactError):
    """tinygrad asked to compile a kernel that the signed kernels.db does not hold.

    Raised instead of ever running a compiler."""

    def __init__(self, kernel: str, detail: str = "") -> None:
        self.kernel = kernel
        msg = f"kernel {kernel!r} is not in the signed artifact (kernels.db); refusing to compile it"
        super().__init__(msg + (f": {detail}" if detail else ""))


class GoldenMismatch(ArtifactError):
    """The power-on self-test output differs from the signed golden output on this host."""


class DeviceUnavailable(ArtifactError):
    """The artifact's device cannot be reached here (no libcuda, no GPU, a driver error)."""


class CompilerVisible(ArtifactError):
    """A device-code compiler (NVRTC, nvJitLink, ptxas, the driver's PTX JIT) is visible to
    a control process that is about to run device code: it would be able to compile."""
