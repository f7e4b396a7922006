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
    ``.dist-info``. Entries outside site_dir (console scripts) are not listed.

    Every distribution's own Name (its METADATA's header, whatever its directory is
    called) decides; its files are its RECORD's first column. importlib.metadata's
    parse of all 127 distributions here and of torch's whole RECORD as paths cost 0.15 s
    of every supervisor process; this reads the same, 0.01 s."""
    out: dict[str, str] = {}
    try:
        entries = os.listdir(site_dir)
    except OSError:
        return ()
    for entry in entries:
        if not entry.endswith((".dist-info", ".egg-info")):
            continue
        meta = os.path.join(site_dir, entry)
        name = _declared_name(meta)
        if name is None or not is_refused(name):
            continue
        for top in _record_tops(meta, site_dir):
            if top in ("..", "__pycache__", "") or not os.path.lexists(os.path.join(site_dir, top)):
                continue
            out.setdefault(top, name)
    return tuple(sorted(out.items()))


def _declared_name(meta: str) -> str | None:
    """The ``Name:`` header of a .dist-info's METADATA or an .egg-info's PKG-INFO (a
    file .egg-info is PKG-INFO itself), read up to the headers' end."""
    for path in (os.path.join(meta, "METADATA"), os.path.join(meta, "PKG-INFO"), meta):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if not line.strip():
                        break
                    if line[:5].lower() == "name:":
                        return line[5:].strip()
        except (IsADirectoryError, FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            return None
    return None


def _record_tops(meta: str, site_dir: str) -> list[str]:
    """The top-level names of a distribution's files: its RECORD's first column, else
    (an egg-info without one) what importlib.metadata finds."""
    import csv

    try:
        with open(os.path.join(meta, "RECORD"), newline="", encoding="utf-8",
                  errors="replace") as f:
            return list({row[0].split("/", 1)[0] for row in csv.reader(f) if row}
                        | {os.path.basename(meta)})
    except OSError:
        pass
    dist = md.PathDistribution(md.Path(meta)) if os.path.isdir(meta) else None
    files = (dist.files if dist is not None else None) or ()
    return list({str(f).split("/", 1)[0] for f in files} | {os.path.basename(meta)})
