"""A worker whose interpreter lacks a package it imports at every start (a `pip install .`
without the ``[research]`` extra): `check` names the package and how to install it before
anything starts, and `run` starts the rest without an optional worker, said once, instead
of restarting it five times, cooling down, and again, for ever."""
from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from supervisor.config._deps import install_hint, startup_imports

ROOT = Path(__file__).resolve().parents[1]
ABSENT = "trio_test_absent_dependency"

CONFIG = """
[domains.control]
actuates = true
[domains.research]
python_path = ["{pp}"]
[channels.x]
slot_size = "4KiB"
[workers.w]
domain = "control"
module = "workers.probe"
publishes = ["x"]
args = ["--publish", "x", "--period-ms", "50"]
[workers.shadow]
domain = "research"
module = "shadowpkg"
subscribes = ["x"]
optional = true
"""

SHADOW = f'''"""A research worker needing a package this machine lacks."""
import os


def main(ctx):
    import json
    import {ABSENT}.models as m      # always runs: the worker cannot start without it
    return 0
'''


def _config(tmp_path: Path) -> Path:
    pp = tmp_path / "research-code"
    (pp / "shadowpkg").mkdir(parents=True)
    (pp / "shadowpkg" / "__init__.py").write_text(SHADOW)
    path = tmp_path / "car.toml"
    path.write_text(CONFIG.format(pp=pp))
    return path


def test_the_research_worker_needs_torch_and_the_hint_names_the_extra():
    """The shipped research worker imports torch in main: that is what a `pip install .`
    without `[research]` lacks, and the hint names the extra pyproject declares."""
    src = (ROOT / "workers" / "research" / "__init__.py").read_text()
    found = {i.top: i for i in startup_imports(ast.parse(src))}
    assert found["torch"].where == "main", found
    assert install_hint("torch") == "pip install 'supervisor[research]'"
    assert install_hint(ABSENT) == f"install {ABSENT!r} into the workers' interpreter"


def test_guarded_and_nested_imports_are_not_startup_imports():
    tree = ast.parse("import numpy\ntry:\n    import fancy\nexcept ImportError:\n    fancy = None\n"
                     "if False:\n    import never\n"
                     "def helper():\n    import lazy\n"
                     "def main(ctx):\n    import os, inmain\n    from pkg.sub import x\n"
                     "    if ctx:\n        import maybe\n")
    assert [(i.top, i.where) for i in startup_imports(tree)] == [
        ("numpy", "module level"), ("inmain", "main"), ("pkg", "main")]


def test_check_names_the_missing_package_and_how_to_install_it(tmp_path):
    """`supervisor check`'s config rules (as the CLI prints them: one line each)."""
    from supervisor.config import check_runtime, load

    path = _config(tmp_path)
    problems = [str(p) for p in check_runtime(load(str(path)))]
    assert len(problems) == 1, problems
    line = problems[0]
    assert line.startswith(f"{path}: workers.shadow.module: shadowpkg imports '{ABSENT}' ("), line
    assert "__init__.py:7, main)" in line and "not installed for the workers' interpreter: " \
        f"install '{ABSENT}'" in line, line


def test_run_starts_the_rest_without_the_optional_worker(tmp_path):
    """Sandboxed, as the car runs: the control worker is READY and publishing; the
    research worker is skipped once with the reason, never started, never restarted."""
    path = _config(tmp_path)
    env = {**os.environ, "TRIO_STATE_DIR": str(tmp_path / "state")}
    p = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "run", "--config", str(path),
                          "--log-format", "json"], cwd=tmp_path, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    events: list[dict] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
            if events[-1].get("event") == "all_ready":
                break
        p.send_signal(signal.SIGINT)
        rest, _ = p.communicate(timeout=30)
    finally:
        p.kill()
    for line in rest.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    kinds = [e.get("event") for e in events]
    assert "all_ready" in kinds, kinds
    assert p.returncode == 0, kinds
    skipped = [e for e in events if e.get("event") == "skipped"]
    assert [e["worker"] for e in skipped] == ["shadow"], skipped
    assert skipped[0]["reason"].startswith(f"cannot start here (optional): shadowpkg imports '{ABSENT}'")
    assert not [e for e in events if e.get("worker") == "shadow"
                and e.get("event") in ("spawned", "started", "exit", "restart", "ready")], events
    assert any(e.get("event") == "ready" and e.get("worker") == "w" for e in events), kinds


def test_an_editable_dependency_the_sandbox_cannot_see_is_named_with_the_fix(tmp_path):
    """A developer's `pip install -e` of a dependency: its tree is found through
    setuptools' import hook here, but the worker's sandbox binds only the interpreter's
    directories, the project and the config's paths, so the import failed at start-up
    (ModuleNotFoundError) after `check` had said all was fine. `check` now names where
    the tree is and both fixes; with the tree bound, the worker's problem is gone."""
    import types

    from setuptools.command.editable_wheel import _finder_template

    from supervisor.config import check_runtime, loads

    name = "trio_test_editable_dep"
    tree = tmp_path / "devtree" / "src_odd" / name
    tree.mkdir(parents=True)
    (tree / "__init__.py").write_text("X = 1\n")
    code = tmp_path / "code"
    (code / "edworker").mkdir(parents=True)
    (code / "edworker" / "__init__.py").write_text(
        f"import {name}\n\n\ndef main(ctx):\n    return 0\n")
    finder = types.ModuleType("__editable___trio_test_finder")
    exec(_finder_template(finder.__name__, {name: str(tree)}, {}), finder.__dict__)
    toml = ('[domains.research]\nprofile = "research"\npython_path = ["{code}"]\n{binds}'
            '[workers.ed]\ndomain = "research"\nmodule = "edworker"\n')
    before = list(sys.meta_path)
    finder.install()                          # what the .pth of an editable install runs
    try:
        cfg = loads(toml.format(code=code, binds=""), str(tmp_path / "ed.toml"))
        [problem] = [p for p in check_runtime(cfg, sandboxed=True) if p.key == "workers.ed.module"]
        assert f"imports {name!r}" in problem.reason
        assert f"installed editable at {tree}" in problem.reason
        assert "install it without -e" in problem.reason
        assert f"add {str(tree.parent)!r} to the domain's extra_ro_binds" in problem.reason
        bound = loads(toml.format(code=code, binds=f'extra_ro_binds = ["{tree.parent}"]\n'),
                      str(tmp_path / "ed.toml"))
        assert not [p for p in check_runtime(bound, sandboxed=True)
                    if p.key == "workers.ed.module"]
    finally:
        sys.meta_path[:] = before
        sys.path_hooks[:] = [h for h in sys.path_hooks
                             if getattr(h, "__module__", "") != finder.__name__]
