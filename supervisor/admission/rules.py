"""The forbidden set: what a control-domain worker may never pull in.

Kept as plain data so the static walker, the ELF check, the /proc maps scan
and the in-process import guard all judge by the same list.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ModuleRule:
    """A forbidden Python module, and every submodule of it.

    ``allowed_importer`` names a top-level package whose own modules may import
    this one without it counting (None = forbidden whoever imports it). It
    exists for ``tinygrad.nn.datasets``: tinygrad 0.14's ``tinygrad/nn/__init__``
    imports it unconditionally, and ``tinygrad.engine.jit`` imports
    ``tinygrad.nn.state``, so ``from tinygrad import Tensor`` loads it. A strict
    rule would refuse every control worker that uses tinygrad at all. The
    module itself imports no torch (the walker still walks into it to prove
    that), so the rule refuses worker code that imports it, not tinygrad's own.
    """

    name: str
    reason: str
    allowed_importer: str | None = None

    def matches(self, module: str) -> bool:
        return module == self.name or module.startswith(self.name + ".")

    def allows_importer(self, importer: str | None) -> bool:
        if self.allowed_importer is None or importer is None:
            return False
        top = importer.split(".", 1)[0]
        return top == self.allowed_importer


MODULE_RULES: tuple[ModuleRule, ...] = (
    ModuleRule("torch", "torch"),
    # listed although covered by "torch": it compiles and dlopens C++ at runtime
    ModuleRule("torch.utils.cpp_extension", "torch C++ extension builder"),
    ModuleRule("tinygrad.nn.torch", "tinygrad's torch frontend (imports extra.torch_backend)"),
    ModuleRule(
        "tinygrad.nn.datasets",
        "tinygrad dataset loaders",
        allowed_importer="tinygrad",
    ),
    ModuleRule("extra.torch_backend", "tinygrad's torch backend (imports torch)"),
    # CUDA's compilers as pip wheels: control loads cubin through the driver alone and
    # never compiles (issue 28; the sandbox also whites out their libraries).
    ModuleRule("nvidia.cuda_nvrtc", "NVRTC, CUDA's runtime compiler"),
    ModuleRule("nvidia.nvjitlink", "nvJitLink, CUDA's JIT linker (compiles PTX)"),
    ModuleRule("nvidia.cuda_nvcc", "nvcc/ptxas, CUDA's compilers"),
)

@dataclass(frozen=True)
class LazyImportWaiver:
    """An audited import of a forbidden module inside a third-party function body.

    The static walk counts function-body imports (they are a path), so these
    would refuse every worker that uses the package. A waiver turns exactly one
    (importer module, enclosing function, forbidden target) into a note. It is
    safe only together with the in-process guard (guard.install), which makes
    the import raise ImportError if the function is ever called. A new lazy
    import anywhere else, or any module-level one, is still refused.
    """

    importer: str
    scope: str  # enclosing function qualname, e.g. "_to_torch_dtype"
    target: str  # forbidden module imported there
    reason: str

    def covers(self, importer: str, scope: str, target: str) -> bool:
        return (
            importer == self.importer
            and scope == self.scope
            and (target == self.target or target.startswith(self.target + "."))
        )


LAZY_IMPORT_WAIVERS: tuple[LazyImportWaiver, ...] = (
    LazyImportWaiver(
        "tinygrad.dtype",
        "_to_torch_dtype",
        "torch",
        "tinygrad 0.14 dtype.py imports torch inside _to_torch_dtype; its only caller is "
        "_from_torch_dtype, used by tinygrad's torch backend (extra.torch_backend, not in the wheel)",
    ),
)


def find_waiver(importer: str, scope: str, target: str) -> LazyImportWaiver | None:
    for waiver in LAZY_IMPORT_WAIVERS:
        if waiver.covers(importer, scope, target):
            return waiver
    return None


# Shell-style patterns on the file name (soname) of a shared object.
# libtorch_python* is already covered by libtorch*; it is listed so the policy
# reads the same as the design document.
SONAME_PATTERNS: tuple[str, ...] = ("libtorch*", "libc10*", "libtorch_python*",
                                    # CUDA's compilers (see MODULE_RULES)
                                    "libnvrtc*", "libnvJitLink*", "libnvptxcompiler*")


@dataclass(frozen=True)
class RefusedDistribution:
    """An installed distribution whose shared objects are refused by identity.

    The /proc maps scan reads the build-id (NT_GNU_BUILD_ID) of every shared
    object matching ``globs`` (relative to each directory the distribution's
    top-level ``packages`` are installed in, and to that directory's parent,
    i.e. site-packages) and refuses any executable mapping with one of those
    build-ids, whatever the mapped file is called (a renamed copy, a memfd).
    The distribution is located without importing it.
    """

    name: str
    packages: tuple[str, ...]
    globs: tuple[str, ...]


REFUSED_DISTRIBUTIONS: tuple[RefusedDistribution, ...] = (
    RefusedDistribution(
        "torch",
        ("torch",),
        # relative to site-packages: the package's libraries, its extension
        # module, and what auditwheel vendors next to it in manylinux wheels
        ("torch/lib/*.so*", "torch/_C*.so", "torch.libs/*.so*"),
    ),
)


def forbidden_module_rule(module: str, importer: str | None = None) -> ModuleRule | None:
    """The rule that forbids importing ``module`` from ``importer``, if any.

    The most specific matching rule wins, so messages name e.g.
    ``torch.utils.cpp_extension`` rather than just ``torch``.
    """
    hits = [r for r in MODULE_RULES if r.matches(module)]
    hits.sort(key=lambda r: len(r.name), reverse=True)
    for rule in hits:
        if not rule.allows_importer(importer):
            return rule
    return None


def is_forbidden_module(module: str, importer: str | None = None) -> bool:
    return forbidden_module_rule(module, importer) is not None


def forbidden_soname(name_or_path: str) -> str | None:
    """The pattern a library name/path matches, or None.

    Only the basename is matched, so ``/x/torch/lib/libtorch_cpu.so`` and a
    bare DT_NEEDED ``libtorch_cpu.so`` are judged the same way.
    """
    base = os.path.basename(name_or_path)
    for pattern in SONAME_PATTERNS:
        if fnmatch.fnmatchcase(base, pattern):
            return pattern
    return None


def is_torch_c_extension(path: str) -> bool:
    """``torch/_C*.so``: torch's own extension module, whatever its soname."""
    parent, base = os.path.split(path)
    return os.path.basename(parent) == "torch" and base.startswith("_C") and ".so" in base
