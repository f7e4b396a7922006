"""Installed distributions the control domain may never see, and where their files are.

The import guard and the maps scan catch torch once it is being loaded; hiding its
files from the control sandbox means there is nothing to load at all: ``import
torch``, ``open(".../libtorch_cpu.so")`` and ``dlopen`` fail with "no such file",
whatever code in the process does to the guard.
"""
from __future__ import annotations

import fnmatch
import functools
import importlib.metadata as md
import os
import re

# Distribution names (PEP 503 normalised, fnmatch patterns) refused in control.
REFUSED_DISTRIBUTIONS: tuple[str, ...] = (
    "torch", "torchvision", "torchaudio", "torchtext", "torchdata", "functorch",
    "triton", "pytorch-triton*", "nvidia-*", "intel-extension-for-pytorch",
)


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def is_refused(dist_name: str) -> bool:
    n = _normalise(dist_name)
    return any(fnmatch.fnmatchcase(n, p) for p in REFUSED_DISTRIBUTIONS)


@functools.lru_cache(maxsize=32)
def refused_entries(site_dir: str) -> tuple[tuple[str, str], ...]:
    """(entry name, distribution) for every top-level entry of `site_dir` that
    belongs to a refused distribution: its packages, modules, ``*.libs`` and
    ``.dist-info``. Entries outside site_dir (console scripts) are not listed."""
    out: dict[str, str] = {}
    for dist in md.distributions(path=[site_dir]):
        name = dist.metadata["Name"] or ""
        if not is_refused(name):
            continue
        for f in dist.files or ():
            top = str(f).split("/", 1)[0]
            if top in ("..", "__pycache__", "") or not os.path.lexists(os.path.join(site_dir, top)):
                continue
            out.setdefault(top, name)
    return tuple(sorted(out.items()))
