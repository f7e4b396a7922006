"""Bytecode a control sandbox would run instead of the source admission read is refused
in a control python_path (`supervisor check` / `run` say it before anything starts); an
honest cache, written by any import of the same source, is not (red team 11 rows 1, 2, 9:
the attacks themselves run in real sandboxes in tests/test_redteam_round11.py)."""
from __future__ import annotations

import importlib.util
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.admission.bytecode import loaded_instead, unfaithful
from supervisor.config._runtime import code_dir_problem


@pytest.fixture
def code_dir(tmp_path: Path) -> Path:
    d = tmp_path / "control-code"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    tmp_path.chmod(0o755)
    return d


def _module(d: Path, name: str, text: str) -> Path:
    p = d / f"{name}.py"
    p.write_text(text)
    p.chmod(0o644)
    return p


def _plant(source: Path, text: str, mode: py_compile.PycInvalidationMode) -> Path:
    """Compile `text` as if it were `source`, into the cache the interpreter reads."""
    real = source.read_text()
    st = source.stat()
    source.write_text(text)
    try:
        cfile = py_compile.compile(str(source), doraise=True, invalidation_mode=mode)
    finally:
        source.write_text(real)
        os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    return Path(cfile)


def test_an_honest_cache_passes_and_the_interpreter_agrees(code_dir):
    src = _module(code_dir, "law", "LIMIT = 0.5\ndef f(x):\n    return min(x, LIMIT)\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    subprocess.run([sys.executable, "-c", "import law"], cwd="/", check=True,
                   env={**env, "PYTHONPATH": str(code_dir)})
    assert loaded_instead(str(src)) == importlib.util.cache_from_source(str(src))
    assert unfaithful(str(src)) is None
    assert code_dir_problem(str(code_dir)) is None


@pytest.mark.parametrize("mode", [py_compile.PycInvalidationMode.TIMESTAMP,
                                  py_compile.PycInvalidationMode.UNCHECKED_HASH])
def test_a_planted_cache_is_named_and_is_what_the_interpreter_runs(code_dir, mode):
    src = _module(code_dir, "law", "LIMIT = 0.5\n")
    if mode is py_compile.PycInvalidationMode.TIMESTAMP:
        # same size, so the header's mtime and size both match the source
        cfile = _plant(src, "LIMIT = 5.0\n", mode)
    else:
        cfile = _plant(src, "LIMIT = 50.0  # an unchecked hash pyc loads whatever the source\n", mode)
    ran = subprocess.run([sys.executable, "-c", "import law; print(law.LIMIT)"], cwd="/",
                         env={**os.environ, "PYTHONPATH": str(code_dir),
                              "PYTHONDONTWRITEBYTECODE": "1"},
                         capture_output=True, text=True, check=True)
    assert ran.stdout.strip() != "0.5"               # the interpreter runs the plant
    assert unfaithful(str(src)) == str(cfile)
    why = code_dir_problem(str(code_dir))
    assert why is not None and why.startswith(f"{cfile}: bytecode the interpreter would run "
                                              "instead of law.py, and not what law.py "
                                              "compiles to"), why


def test_a_stale_cache_the_interpreter_ignores_is_no_problem(code_dir):
    """A developer edited the source after an import: the old .pyc no longer matches its
    header, the interpreter compiles the source, and nothing is refused."""
    src = _module(code_dir, "law", "LIMIT = 0.5\n")
    py_compile.compile(str(src), doraise=True)
    src.write_text("LIMIT = 0.25  # a longer line: another size\n")
    assert loaded_instead(str(src)) is None
    assert code_dir_problem(str(code_dir)) is None


def test_a_sourceless_module_in_a_control_python_path_is_refused(code_dir):
    src = _module(code_dir, "vendor_law", "LIMIT = 0.5\n")
    pyc = code_dir / "vendor_law.pyc"
    py_compile.compile(str(src), cfile=str(pyc), doraise=True)
    pyc.chmod(0o644)
    src.unlink()
    why = code_dir_problem(str(code_dir))
    assert why == (f"{pyc}: sourceless bytecode, a module admission cannot read: ship its "
                   f"source, never the .pyc alone"), why
    # a research python_path is not vouched for: its code is the domain's own business
    assert code_dir_problem(str(code_dir), owners=False) is None
