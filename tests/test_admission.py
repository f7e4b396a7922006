"""Admission: control-domain workers must never get torch into their address space.

Real files, real gcc-built shared objects, real subprocesses; no mocks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from supervisor.admission import (
    AdmissionReport,
    ProcessGone,
    check_elf_files,
    check_running,
    check_worker,
    read_elf,
    scan_maps_text,
    scan_pid,
    walk_module,
)
from supervisor.admission import check as admission_check
from supervisor.admission._witness import RACY_NS
from supervisor.admission.elf import ElfUnreadable

REPO = Path(__file__).resolve().parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_GCC = shutil.which("gcc") is not None
HAS_TINYGRAD = importlib.util.find_spec("tinygrad") is not None
needs_gcc = pytest.mark.skipif(not HAS_GCC, reason="needs gcc to build test shared objects")
needs_tinygrad = pytest.mark.skipif(not HAS_TINYGRAD, reason="tinygrad not installed")


def make_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def control(tmp_path: Path, module: str, *, name: str = "camerad") -> AdmissionReport:
    # the worker's sys.path: its own code first, then this interpreter's
    return check_worker(name, "control", module, None, [str(tmp_path), *sys.path[1:]])


def only_import_chains(report: AdmissionReport) -> list[str]:
    return [" -> ".join(f.chain) for f in report.findings if f.kind == "import"]


# ---------------------------------------------------------------------------
# static import walk


def test_direct_import_is_refused_with_chain(tmp_path: Path) -> None:
    make_tree(tmp_path, {"w_direct/__init__.py": "import os\nimport torch\n"})
    report = control(tmp_path, "w_direct")
    assert not report.ok
    [finding] = report.findings
    assert finding.kind == "import"
    assert finding.worker == "camerad" and finding.domain == "control"
    assert finding.chain == ["w_direct (w_direct/__init__.py:2)", "torch"]
    text = report.format()
    assert "camerad" in text and "control" in text
    assert "w_direct (w_direct/__init__.py:2) imports torch" in text


def test_chain_of_three_modules(tmp_path: Path) -> None:
    make_tree(
        tmp_path,
        {
            "chain3/__init__.py": "",
            "chain3/a.py": "import chain3.b\n",
            "chain3/b.py": "import json\nfrom chain3 import c\n",
            "chain3/c.py": "import os\n\nimport torch.nn.functional as F\n",
        },
    )
    report = control(tmp_path, "chain3.a")
    assert not report.ok
    assert report.findings[0].message.endswith(
        "chain3.a (chain3/a.py:1) imports chain3.b (chain3/b.py:2) imports chain3.c (chain3/c.py:3) "
        "imports torch.nn.functional"
    )


def test_package_entry_then_bad_submodule(tmp_path: Path) -> None:
    # the shape from the design note: workers.foo/__init__ -> workers.foo.bad -> torch
    make_tree(
        tmp_path,
        {
            "wk/__init__.py": "",
            "wk/foo/__init__.py": '"""doc"""\n\nfrom . import bad\n',
            "wk/foo/bad.py": "import torch\n",
        },
    )
    report = control(tmp_path, "wk.foo")
    assert only_import_chains(report) == [
        "wk.foo (wk/foo/__init__.py:3) -> wk.foo.bad (wk/foo/bad.py:1) -> torch"
    ]
    assert report.findings[0].message.endswith(
        "wk.foo (wk/foo/__init__.py:3) imports wk.foo.bad (wk/foo/bad.py:1) imports torch"
    )


def test_parent_package_of_entry_runs_first(tmp_path: Path) -> None:
    # python -m pk.worker executes pk/__init__.py before pk/worker.py
    make_tree(tmp_path, {"pk/__init__.py": "import torch\n", "pk/worker.py": "print('hi')\n"})
    report = control(tmp_path, "pk.worker")
    assert report.findings[0].message.endswith(
        "pk.worker (pk/worker.py) is inside package pk (pk/__init__.py:1) imports torch"
    )


def test_relative_imports(tmp_path: Path) -> None:
    make_tree(
        tmp_path,
        {
            "relpkg/__init__.py": "from .sub.deep import thing\n",
            "relpkg/sub/__init__.py": "",
            "relpkg/sub/deep.py": "from ..helpers import util as thing\n",
            "relpkg/helpers/__init__.py": "",
            "relpkg/helpers/util.py": "from torch import nn\n",
        },
    )
    report = control(tmp_path, "relpkg")
    assert not report.ok
    [finding] = report.findings
    assert finding.chain == [
        "relpkg (relpkg/__init__.py:1)",
        "relpkg.sub.deep (relpkg/sub/deep.py:1)",
        "relpkg.helpers.util (relpkg/helpers/util.py:1)",
        "torch",
    ]
    assert finding.message.endswith(
        "relpkg (relpkg/__init__.py:1) imports relpkg.sub.deep (relpkg/sub/deep.py:1) "
        "imports relpkg.helpers.util (relpkg/helpers/util.py:1) imports torch"
    )


@pytest.mark.parametrize(
    "source",
    [
        'import importlib\nmod = importlib.import_module("torch")\n',
        'from importlib import import_module as im\nmod = im("torch.nn")\n',
        'mod = __import__("torch")\n',
        'import builtins\nmod = builtins.__import__("tor" + "ch")\n',
    ],
    ids=["import_module", "aliased", "dunder_import", "folded_literal"],
)
def test_dynamic_imports_with_literals(tmp_path: Path, source: str) -> None:
    make_tree(tmp_path, {"dyn/__init__.py": source})
    report = control(tmp_path, "dyn")
    assert not report.ok
    assert report.findings[0].chain[-1].startswith("torch")


def test_computed_import_name_is_matched_against_real_modules(tmp_path: Path) -> None:
    # tinygrad picks its backend with import_module(f"{base}.runtime.ops_{x}"); same shape here
    make_tree(
        tmp_path,
        {
            "plug/__init__.py": "import importlib\n\n"
            "def load(name):\n    return importlib.import_module(f'{__name__}.backends.{name}')\n",
            "plug/backends/__init__.py": "",
            "plug/backends/cpu.py": "import os\n",
            "plug/backends/gpu.py": "import torch\n",
        },
    )
    report = control(tmp_path, "plug")
    assert only_import_chains(report) == [
        "plug (plug/__init__.py:4) -> plug.backends.gpu (plug/backends/gpu.py:1) -> torch"
    ]


def test_import_in_function_body_counts(tmp_path: Path) -> None:
    make_tree(
        tmp_path,
        {"lazyw/__init__.py": "def to_torch(x):\n    import torch\n    return torch.tensor(x)\n"},
    )
    report = control(tmp_path, "lazyw")
    assert not report.ok
    assert report.findings[0].chain == ["lazyw (lazyw/__init__.py:2, in to_torch())", "torch"]


def test_import_in_try_block_counts(tmp_path: Path) -> None:
    make_tree(
        tmp_path,
        {"tryw/__init__.py": "try:\n    import torch\nexcept ImportError:\n    torch = None\n"},
    )
    assert not control(tmp_path, "tryw").ok


def test_type_checking_block_is_not_a_path(tmp_path: Path) -> None:
    make_tree(
        tmp_path,
        {
            "tcw/__init__.py": """\
                from __future__ import annotations
                import typing
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    import torch
                if typing.TYPE_CHECKING:
                    from torch import Tensor
                else:
                    Tensor = object
                def f(x: torch.Tensor) -> None: ...
            """
        },
    )
    report = control(tmp_path, "tcw")
    assert report.ok, report.format()


def test_forbidden_module_reported_even_if_not_installed(tmp_path: Path) -> None:
    make_tree(tmp_path, {"extw/__init__.py": "import extra.torch_backend.backend\n"})
    report = control(tmp_path, "extw")
    assert not report.ok
    assert report.findings[0].chain[-1] == "extra.torch_backend.backend"
    assert "forbidden: extra.torch_backend" in report.findings[0].message


def test_clean_package_passes(tmp_path: Path) -> None:
    make_tree(
        tmp_path,
        {
            "cleanw/__init__.py": "import os, json\nfrom . import loop\n",
            "cleanw/loop.py": "import numpy as np\nfrom .law import gain\n",
            "cleanw/law.py": "def gain(x):\n    import math\n    return math.tanh(x)\n",
        },
    )
    report = control(tmp_path, "cleanw")
    assert report.ok, report.format()
    assert report.findings == []
    assert report.format().startswith("admitted: control-domain worker camerad")


def test_research_domain_is_always_admitted(tmp_path: Path) -> None:
    make_tree(tmp_path, {"trainer/__init__.py": "import torch\n"})
    report = check_worker("trainer", "research", "trainer", None, [str(tmp_path)])
    assert report.ok and report.findings == []


def test_unknown_domain_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        check_worker("x", "sandbox", "os", None, [str(tmp_path)])


def test_argv_python_module_script_and_code(tmp_path: Path) -> None:
    make_tree(
        tmp_path,
        {
            "argvw/__init__.py": "",
            "argvw/__main__.py": "from argvw import model\n",
            "argvw/model.py": "import torch\n",
            "scripts/run.py": "import helper\n",
            "scripts/helper.py": "import torch\n",
        },
    )
    sp = [str(tmp_path), *sys.path[1:]]
    by_module = check_worker("m", "control", None, [sys.executable, "-u", "-m", "argvw.model"], sp)
    assert only_import_chains(by_module) == ["argvw.model (argvw/model.py:1) -> torch"]
    by_script = check_worker("s", "control", None, ["python3", str(tmp_path / "scripts/run.py")], sp)
    assert only_import_chains(by_script) == [
        # the script's directory is sys.path[0], so paths display relative to it
        "__main__ (run.py:1) -> helper (helper.py:1) -> torch"
    ]
    by_code = check_worker("c", "control", None, [sys.executable, "-c", "import os; import torch"], sp)
    assert not by_code.ok
    assert check_worker("ok", "control", None, [sys.executable, "-c", "import os"], sp).ok


def test_missing_executable_fails_closed(tmp_path: Path) -> None:
    report = check_worker("ghost", "control", None, ["definitely-not-a-real-binary-xyz"], [str(tmp_path)])
    assert not report.ok


@needs_tinygrad
def test_tinygrad_control_imports_are_admitted_and_torch_frontend_is_not(tmp_path: Path) -> None:
    make_tree(
        tmp_path,
        {
            "modeld/__init__.py": "from tinygrad import Tensor, TinyJit\nfrom tinygrad import nn\n",
            "tgtorch/__init__.py": "from tinygrad.nn import torch\n",
            "tgdata/__init__.py": "from tinygrad.nn.datasets import mnist\n",
        },
    )
    ok = control(tmp_path, "modeld", name="modeld")
    assert ok.ok, ok.format()
    # tinygrad.dtype._to_torch_dtype imports torch lazily: audited, noted, not refused
    assert any("tinygrad.dtype" in n and "_to_torch_dtype" in n for n in ok.notes)

    bad = control(tmp_path, "tgtorch")
    assert only_import_chains(bad) == ["tgtorch (tgtorch/__init__.py:1) -> tinygrad.nn.torch"]
    # worker code may not use the dataset loaders, though tinygrad.nn itself imports them
    data = control(tmp_path, "tgdata")
    assert only_import_chains(data) == ["tgdata (tgdata/__init__.py:1) -> tinygrad.nn.datasets"]


@needs_tinygrad
def test_tinygrad_walk_reaches_backends_and_no_torch_frontend() -> None:
    walk = walk_module("tinygrad", sys.path)
    # device.py picks backends with import_module(f"{base}.runtime.ops_{x}")
    assert "tinygrad.runtime.ops_cpu" in walk.modules
    assert "tinygrad.nn.torch" not in walk.modules
    unwaived = [h for h in walk.hits if h.waiver is None]
    assert unwaived == []


# ---------------------------------------------------------------------------
# ELF


def gcc_shared(out: Path, source: str, *extra: str) -> Path:
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src), *extra], check=True)
    src.unlink()
    return out


@pytest.fixture(scope="module")
def fake_torch_libs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not HAS_GCC:
        pytest.skip("needs gcc")
    d = tmp_path_factory.mktemp("elf")
    pkg = d / "native_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import _fast\n")
    ext_name = "_fast" + importlib.machinery.EXTENSION_SUFFIXES[0]
    # libtorch_cpu.so next to the extension, found through RUNPATH=$ORIGIN
    libtorch = gcc_shared(pkg / "libtorch_cpu.so", "int torch_thing(void){return 42;}\n")
    ext = gcc_shared(
        pkg / ext_name,
        "int torch_thing(void);\nint fast(void){return torch_thing();}\n",
        f"-L{pkg}", "-ltorch_cpu", "-Wl,-rpath,$ORIGIN",
    )
    # a two-hop chain: ext2 -> libmid.so -> libtorch_cpu.so, in another dir
    vendor = d / "vendor"
    vendor.mkdir()
    shutil.copy(libtorch, vendor / "libtorch_cpu.so")
    mid = gcc_shared(
        vendor / "libmid.so", "int torch_thing(void);\nint mid(void){return torch_thing();}\n",
        f"-L{vendor}", "-ltorch_cpu", "-Wl,-rpath,$ORIGIN",
    )
    pkg2 = d / "mid_pkg"
    pkg2.mkdir()
    (pkg2 / "__init__.py").write_text("from mid_pkg import _ext\n")
    ext2 = gcc_shared(
        pkg2 / ext_name, "int mid(void);\nint go(void){return mid();}\n",
        f"-L{vendor}", "-lmid", "-Wl,-rpath,$ORIGIN/../vendor",
    )
    clean = d / "clean_pkg"
    clean.mkdir()
    (clean / "__init__.py").write_text("from . import _ok\n")
    ok_ext = gcc_shared(clean / ("_ok" + importlib.machinery.EXTENSION_SUFFIXES[0]),
                        "#include <math.h>\ndouble f(double x){return cos(x);}\n", "-lm")
    return {"root": d, "libtorch": libtorch, "ext": ext, "mid": mid, "ext2": ext2, "ok_ext": ok_ext}


@needs_gcc
def test_elf_extension_linked_to_libtorch_is_refused(fake_torch_libs: dict[str, Path]) -> None:
    libs = fake_torch_libs
    assert read_elf(str(libs["ext"])).needed[0] == "libtorch_cpu.so"
    result = check_elf_files([str(libs["ext"])])
    [hit] = result.hits
    assert hit.chain == [str(libs["ext"]), f"libtorch_cpu.so ({libs['libtorch']})"]
    assert hit.describe() == f"file {libs['ext']} needs libtorch_cpu.so ({libs['libtorch']})"

    report = check_worker("planner", "control", "native_pkg", None, [str(libs["root"]), *sys.path[1:]])
    assert not report.ok
    elf = [f for f in report.findings if f.kind == "elf"]
    assert any(f.chain[0] == str(libs["ext"]) and f.chain[-1].startswith("libtorch_cpu.so") for f in elf)
    assert any("in package native_pkg" in f.message for f in elf)


@needs_gcc
def test_elf_transitive_chain(fake_torch_libs: dict[str, Path]) -> None:
    libs = fake_torch_libs
    result = check_elf_files([str(libs["ext2"])])
    [hit] = result.hits
    vendor = libs["mid"].parent
    assert hit.describe() == (
        f"file {libs['ext2']} needs libmid.so ({vendor / 'libmid.so'}) "
        f"needs libtorch_cpu.so ({vendor / 'libtorch_cpu.so'})"
    )
    report = check_worker("mid", "control", "mid_pkg", None, [str(libs["root"]), *sys.path[1:]])
    assert [f.kind for f in report.findings] == ["elf"]


@needs_gcc
def test_elf_unrelated_library_passes(fake_torch_libs: dict[str, Path]) -> None:
    result = check_elf_files([str(fake_torch_libs["ok_ext"])])
    assert result.hits == []
    assert any("libm" in os.path.basename(p) for p in result.checked)
    report = check_worker("ok", "control", "clean_pkg", None, [str(fake_torch_libs["root"]), *sys.path[1:]])
    assert report.ok, report.format()


def test_elf_corrupt_and_non_elf_files_are_skipped_with_a_note(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.so"
    corrupt.write_bytes(b"\x7fELF" + b"\x02\x01\x01" + os.urandom(40) + b"\xff" * 200)
    text = tmp_path / "notelf.so"
    text.write_text("INPUT(-lc)\n")  # a linker script, as some distros ship
    truncated = tmp_path / "trunc.so"
    truncated.write_bytes(b"\x7fELF")
    result = check_elf_files([str(corrupt), str(text), str(truncated), str(tmp_path / "missing.so")])
    assert result.hits == []
    assert len(result.notes) == 4
    assert any("notelf.so" in n and "not an ELF" in n for n in result.notes)
    assert any("corrupt.so" in n for n in result.notes)
    with pytest.raises(ElfUnreadable):
        read_elf(str(corrupt))

    make_tree(tmp_path, {"brokenpkg/__init__.py": ""})
    shutil.copy(corrupt, tmp_path / "brokenpkg" / "_x.so")
    report = control(tmp_path, "brokenpkg")
    assert report.ok
    assert any("_x.so" in n and "skipped" in n for n in report.notes)


def test_elf_argv_executable_is_checked() -> None:
    report = check_worker("ls", "control", None, ["ls", "-l"], sys.path)
    assert report.ok, report.format()


# ---------------------------------------------------------------------------
# /proc/PID/maps


def spawn_waiting(code: str, *args: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=_env()
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", line
    return proc


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


SLEEPER = "import ctypes, sys, time\nfor p in sys.argv[1:]: ctypes.CDLL(p)\nprint('ready', flush=True)\ntime.sleep(60)\n"


@needs_gcc
def test_maps_finds_ctypes_loaded_fake_libtorch(fake_torch_libs: dict[str, Path]) -> None:
    proc = spawn_waiting(SLEEPER, str(fake_torch_libs["libtorch"]))
    try:
        hits = scan_pid(proc.pid)
        assert [h.path for h in hits] == [str(fake_torch_libs["libtorch"])]
        assert hits[0].pattern == "libtorch*"
        report = check_running("camerad", "control", proc.pid)
        assert not report.ok and report.findings[0].kind == "maps"
        assert "camerad" in report.format()
    finally:
        proc.kill()
        proc.wait()


def test_maps_clean_process_and_gone_process() -> None:
    proc = spawn_waiting(SLEEPER)
    try:
        assert scan_pid(proc.pid) == []
        assert check_running("camerad", "control", proc.pid).ok
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(ProcessGone):
        scan_pid(proc.pid)


def test_maps_text_parsing() -> None:
    text = (
        "7f00-7f10 r-xp 00000000 08:01 12 /opt/x/torch/lib/libc10.so\n"
        "7f10-7f20 r--p 00001000 08:01 12 /opt/x/torch/lib/libc10.so\n"
        "7f20-7f30 r-xp 00000000 08:01 13 /opt/x/torch/_C.cpython-311-x86_64-linux-gnu.so\n"
        "7f30-7f40 r-xp 00000000 08:01 14 /tmp/dir with space/libtorch_python.so (deleted)\n"
        "7f40-7f50 rw-p 00000000 00:00 0 [heap]\n"
        "7f50-7f60 r-xp 00000000 08:01 15 /usr/lib/libcamera.so\n"
    )
    hits = scan_maps_text(1, text)
    assert [(h.path, h.deleted) for h in hits] == [
        ("/opt/x/torch/lib/libc10.so", False),
        ("/opt/x/torch/_C.cpython-311-x86_64-linux-gnu.so", False),
        ("/tmp/dir with space/libtorch_python.so", True),
    ]


# ---------------------------------------------------------------------------
# in-process guard

GUARD_SCRIPT = """
import json, sys
from supervisor.admission import guard
guard.install("camerad")
out = {}
def attempt(label, fn):
    try:
        fn()
        out[label] = "imported"
    except ImportError as e:
        out[label] = f"{type(e).__name__}: {e}"
    except OSError as e:
        out[label] = f"{type(e).__name__}: {e}"
import importlib
attempt("import", lambda: exec("import torch"))
attempt("import_module", lambda: importlib.import_module("torch"))
attempt("dunder", lambda: __import__("torch.nn"))
attempt("tinygrad_frontend", lambda: exec("from tinygrad.nn import torch"))
import numpy
out["numpy"] = numpy.__name__
try:
    from tinygrad import Tensor
    out["tinygrad"] = Tensor.__name__
except ModuleNotFoundError:
    out["tinygrad"] = "not installed"
if len(sys.argv) > 1:
    import ctypes
    attempt("dlopen", lambda: ctypes.CDLL(sys.argv[1]))
out["torch_loaded"] = "torch" in sys.modules
print(json.dumps(out))
"""


def run_py(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], check=False, capture_output=True, text=True, env=_env(), timeout=60
    )


def test_guard_blocks_torch_and_keeps_normal_imports(tmp_path: Path) -> None:
    args = []
    if HAS_GCC:
        args.append(str(gcc_shared(tmp_path / "libtorch_cpu.so", "int t(void){return 1;}\n")))
    proc = run_py(GUARD_SCRIPT, *args)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    msg = "control-domain worker camerad may not import torch (forbidden by admission policy: {})"
    assert out["import"] == "ForbiddenImportError: " + msg.format("torch")
    assert out["import_module"] == "ForbiddenImportError: " + msg.format("torch")
    assert out["dunder"].startswith("ForbiddenImportError: control-domain worker camerad may not import torch")
    assert out["tinygrad_frontend"] == "ForbiddenImportError: " + msg.format("tinygrad.nn.torch")
    assert out["numpy"] == "numpy"
    assert out["tinygrad"] in ("Tensor", "not installed")
    assert out["torch_loaded"] is False
    if HAS_GCC:
        assert out["dlopen"].startswith("ForbiddenLibraryError: control-domain worker camerad may not load")


def test_guard_refuses_when_torch_already_loaded(tmp_path: Path) -> None:
    code = (
        "import sys, types\n"
        "sys.modules['torch'] = types.ModuleType('torch')\n"
        "from supervisor.admission import guard\n"
        "try:\n    guard.install('camerad')\nexcept guard.ForbiddenModuleLoaded as e:\n    print('refused:', e)\n"
    )
    proc = run_py(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("refused: control-domain worker camerad already has forbidden code loaded")
    assert "module torch" in proc.stdout


# ---------------------------------------------------------------------------
# the cached walk: reused for a fleet of one module, never past a change


def _rewrite_keeping_size_and_mtime(path: Path, content: str | bytes) -> None:
    """Rewrite in place (same inode, same size, mtime put back): only ctime tells."""
    data = content.encode() if isinstance(content, str) else content
    before = path.stat()
    assert len(data) == before.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


def _past_racy() -> None:
    """Files written this instant may share a timestamp with a later change: a walk that
    read them is not kept until they are older than RACY_NS (see _witness)."""
    time.sleep(RACY_NS / 1e9 + 0.05)


def test_cache_one_walk_for_a_fleet_and_each_report_names_its_worker(tmp_path: Path) -> None:
    make_tree(tmp_path, {"fleetw/__init__.py": "import json\nfrom fleetw import a\n",
                         "fleetw/a.py": "import torch\n"})
    _past_racy()
    before = dataclasses.replace(admission_check.CACHE_STATS)
    reports = [control(tmp_path, "fleetw", name=f"w{i}") for i in range(5)]
    assert admission_check.CACHE_STATS.walks == before.walks + 1
    assert admission_check.CACHE_STATS.hits == before.hits + 4
    for i, r in enumerate(reports):
        [finding] = r.findings
        assert finding.worker == f"w{i}" and f"worker w{i} imports torch" in finding.message
        assert finding.chain == ["fleetw (fleetw/__init__.py:2)", "fleetw.a (fleetw/a.py:1)", "torch"]


def test_one_admission_pass_identifies_each_file_once_and_the_next_pass_reads_afresh(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A config's workers share their code: the witnesses checked in one pass (one
    `run`/`check`) read and hash each file once (the car's warm admission: 5,172 digests
    of 1,056 files, 2.5 s, before); a change between passes is still seen."""
    from supervisor.admission import _witness, one_pass

    make_tree(tmp_path, {"passw/__init__.py": "from passw import b\n", "passw/b.py": "import array\n",
                         "passv/__init__.py": "from passw import b\n"})
    _past_racy()
    assert control(tmp_path, "passw").ok and control(tmp_path, "passv").ok   # walked
    reads: list[str] = []
    real = _witness.file_id
    monkeypatch.setattr(_witness, "file_id", lambda p: reads.append(p) or real(p))
    before = dataclasses.replace(admission_check.CACHE_STATS)
    with one_pass():
        assert control(tmp_path, "passw").ok and control(tmp_path, "passv").ok
    assert admission_check.CACHE_STATS.hits == before.hits + 2
    assert reads and len(reads) == len(set(reads))
    assert str(tmp_path / "passw" / "b.py") in reads
    _rewrite_keeping_size_and_mtime(tmp_path / "passw/b.py", "import torch\n")
    with one_pass():
        assert not control(tmp_path, "passv").ok


def test_cache_keeps_no_walk_of_files_changed_just_before_it(tmp_path: Path) -> None:
    make_tree(tmp_path, {"racyw/__init__.py": "import json\n"})
    before = dataclasses.replace(admission_check.CACHE_STATS)
    assert control(tmp_path, "racyw").ok and control(tmp_path, "racyw").ok
    assert admission_check.CACHE_STATS.walks == before.walks + 2  # the first was not kept
    _past_racy()
    assert control(tmp_path, "racyw").ok and control(tmp_path, "racyw").ok
    assert admission_check.CACHE_STATS.walks == before.walks + 3
    assert admission_check.CACHE_STATS.hits == before.hits + 1


def test_cache_sees_a_module_rewritten_with_its_size_and_mtime(tmp_path: Path) -> None:
    make_tree(tmp_path, {"editw/__init__.py": "from editw import b\n", "editw/b.py": "import array\n"})
    _past_racy()
    assert control(tmp_path, "editw").ok
    _rewrite_keeping_size_and_mtime(tmp_path / "editw/b.py", "import torch\n")
    assert only_import_chains(control(tmp_path, "editw")) == [
        "editw (editw/__init__.py:1) -> editw.b (editw/b.py:1) -> torch"]


def test_cache_sees_a_module_that_appears_and_a_namespace_that_becomes_a_package(tmp_path: Path) -> None:
    make_tree(tmp_path, {"appearw/__init__.py": "import later_mod\nimport nsp.clean\n",
                         "nsp/clean.py": "import json\n"})
    _past_racy()
    assert control(tmp_path, "appearw").ok  # later_mod missing: noted, not refused
    make_tree(tmp_path, {"later_mod.py": "import torch\n"})
    assert only_import_chains(control(tmp_path, "appearw")) == [
        "appearw (appearw/__init__.py:1) -> later_mod (later_mod.py:1) -> torch"]
    _past_racy()
    (tmp_path / "later_mod.py").unlink()
    assert control(tmp_path, "appearw").ok
    _past_racy()
    # nsp/ was a namespace portion; an __init__ appearing in it runs first
    make_tree(tmp_path, {"nsp/__init__.py": "import torch\n"})
    assert only_import_chains(control(tmp_path, "appearw")) == [
        "appearw (appearw/__init__.py:2) -> nsp (nsp/__init__.py:1) -> torch"]


@needs_gcc
def test_cache_sees_a_native_file_rewritten_with_its_size_and_mtime(fake_torch_libs: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    pkg = tmp_path / "swap_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import _ok\n")
    ext = pkg / fake_torch_libs["ok_ext"].name
    clean, linked = fake_torch_libs["ok_ext"].read_bytes(), fake_torch_libs["ext"].read_bytes()
    size = max(len(clean), len(linked))   # padded alike: the loader ignores bytes past the end
    ext.write_bytes(clean.ljust(size, b"\0"))
    _past_racy()
    assert control(tmp_path, "swap_pkg").ok
    # same path, inode, size and mtime; now it needs libtorch_cpu.so
    _rewrite_keeping_size_and_mtime(ext, linked.ljust(size, b"\0"))
    [finding] = control(tmp_path, "swap_pkg").findings
    assert finding.kind == "elf" and finding.chain[0] == str(ext)
    assert finding.chain[-1].startswith("libtorch_cpu.so")


_ADMIT_ONCE = """
import json, sys
from supervisor.admission import check
r = check.check_worker("w", "control", sys.argv[1], None, [sys.argv[2], *sys.path[1:]])
print(json.dumps({"ok": r.ok, "walks": check.CACHE_STATS.walks, "hits": check.CACHE_STATS.hits,
                  "chains": [" -> ".join(f.chain) for f in r.findings]}))
"""


def _admit_in_new_process(tmp_path: Path, module: str, cache: Path) -> dict:
    env = dict(os.environ, TRIO_ADMISSION_CACHE=str(cache),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _ADMIT_ONCE, module, str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_disk_cache_serves_the_next_process_and_only_while_files_and_entry_are_sound(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    code = tmp_path / "code"
    make_tree(code, {"diskw/__init__.py": "from diskw import m\n", "diskw/m.py": "import array\n"})
    _past_racy()
    first = _admit_in_new_process(code, "diskw", cache)
    assert (first["ok"], first["walks"], first["hits"]) == (True, 1, 0)
    [entry] = cache.iterdir()
    assert (cache.stat().st_mode & 0o777, entry.stat().st_mode & 0o777) == (0o700, 0o600)
    second = _admit_in_new_process(code, "diskw", cache)
    assert (second["ok"], second["walks"], second["hits"]) == (True, 0, 1)

    _rewrite_keeping_size_and_mtime(code / "diskw/m.py", "import torch\n")
    third = _admit_in_new_process(code, "diskw", cache)
    assert (third["walks"], third["chains"]) == (1, ["diskw (diskw/__init__.py:1) -> diskw.m (diskw/m.py:1) -> torch"])
    # an entry others could have written is not evidence: walked again, and replaced
    [entry] = cache.iterdir()
    entry.chmod(0o666)
    assert _admit_in_new_process(code, "diskw", cache)["walks"] == 1
    assert _admit_in_new_process(code, "diskw", cache)["hits"] == 1
    # a corrupt entry is a miss, not an error
    [entry] = cache.iterdir()
    entry.write_text('{"version": "')
    assert _admit_in_new_process(code, "diskw", cache)["walks"] == 1


def test_disk_cache_keeps_the_newest_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from supervisor.admission import _store

    make_tree(tmp_path / "code", {f"prunew{i}/__init__.py": "import json\n" for i in range(4)})
    _past_racy()
    monkeypatch.setenv("TRIO_ADMISSION_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_store, "MAX_ENTRIES", 2)
    for i in range(4):
        assert control(tmp_path / "code", f"prunew{i}").ok
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_cache_off_walks_every_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRIO_ADMISSION_CACHE=off: what the suite measures the cache against."""
    make_tree(tmp_path, {"offw/__init__.py": "import json\n"})
    _past_racy()
    monkeypatch.setenv("TRIO_ADMISSION_CACHE", "off")
    before = dataclasses.replace(admission_check.CACHE_STATS)
    assert control(tmp_path, "offw").ok and control(tmp_path, "offw").ok
    assert (admission_check.CACHE_STATS.walks, admission_check.CACHE_STATS.hits) == (before.walks + 2, before.hits)


# ---------------------------------------------------------------------------
# the real thing (optional research extra)

needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed (research extra)")


@pytest.mark.torch
@needs_torch
def test_real_torch_process_maps_show_libtorch() -> None:
    proc = spawn_waiting("import torch, time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    try:
        hits = scan_pid(proc.pid)
        names = {os.path.basename(h.path) for h in hits}
        assert "libtorch_cpu.so" in names and "libc10.so" in names
        assert any(h.pattern == "torch/_C" for h in hits)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.torch
@needs_torch
def test_real_torch_extension_elf_chain() -> None:
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    torch_dir = Path(spec.origin).parent
    c_ext = next(torch_dir.glob("_C.cpython-*.so"))
    # checked as a dependency, not by its own name: what does it link?
    needed = read_elf(str(c_ext)).needed
    assert "libtorch_python.so" in needed
    report = check_worker("t", "control", None, [sys.executable, "-c", "import torch"], sys.path)
    assert not report.ok
    kinds = {f.kind for f in report.findings}
    assert kinds == {"import"}  # refused at the import; torch's package is never walked into


def test_the_walk_reads_the_workers_from_outside_the_checkout(tmp_path):
    """`supervisor check`/`run` from another directory with the editable install (a
    meta-path hook, not a directory on sys.path): the walk found no entry module and
    admitted every control worker unwalked ("all admitted"). Now it walks the workers'
    own path (policy.worker_sys_path), and a module it cannot find is refused."""
    code = ("from supervisor.admission import check_worker\n"
            "from supervisor.sandbox.policy import worker_sys_path\n"
            "r = check_worker('p', 'control', 'workers.probe', None, worker_sys_path())\n"
            "print(r.ok, r.notes)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, check=False,
                       env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert p.returncode == 0, p.stderr[-800:]
    assert p.stdout.startswith("True") and "not found" not in p.stdout, p.stdout
    rep = check_worker("w", "control", "workers.nosuch", None, [str(tmp_path)])
    assert not rep.ok and "not found" in rep.findings[0].message, rep


def test_the_walk_follows_the_sandbox_path_not_the_operators(tmp_path):
    """An operator's PYTHONPATH (which the sandbox clears) put a shadowing `workers` first
    on the walk's path: admission walked the operator's file while the worker imported the
    project's. The walk's path is now the one a real sandbox's interpreter prints."""
    shadow = tmp_path / "workers"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("")
    (shadow / "probe.py").write_text("x = 1\n")          # admits trivially if walked
    code = ("import json\nfrom supervisor.sandbox.policy import worker_sys_path\n"
            "print(json.dumps(worker_sys_path()))\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, check=True, env=env)
    walked = json.loads(p.stdout)
    from supervisor.sandbox import launch
    from supervisor.sandbox.policy import policy_for_domain

    pol = policy_for_domain("control", profile="control")
    inside = launch.spawn(pol, [sys.executable, "-c",
                                "import json, sys; print(json.dumps(sys.path))"],
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
    out, err = inside.communicate(timeout=60)
    assert inside.returncode == 0, err[-500:]
    assert str(tmp_path) not in walked
    assert walked == json.loads(out), (walked, out)


def test_refused_entries_read_each_distributions_own_name_and_record(tmp_path: Path) -> None:
    """What control's sandbox hides (`distributions.refused_entries`) is read from each
    distribution's METADATA Name and RECORD directly (importlib.metadata's parse of every
    distribution cost 0.15 s of every supervisor process): the same answer as
    importlib.metadata's for this interpreter's site-packages, and a distribution whose
    directory is named otherwise is judged by its declared Name."""
    import importlib.metadata as md
    import sysconfig

    from supervisor.admission import distributions as D

    site = sysconfig.get_paths()["purelib"]
    want: dict[str, str] = {}
    for dist in md.distributions(path=[site]):
        name = dist.metadata["Name"] or ""
        if D.is_refused(name):
            for f in dist.files or ():
                top = str(f).split("/", 1)[0]
                if top not in ("..", "__pycache__", "") and os.path.lexists(os.path.join(site, top)):
                    want.setdefault(top, name)
    assert D.refused_entries(site) == tuple(sorted(want.items()))
    sneaky = tmp_path / "innocent-1.0.dist-info"
    sneaky.mkdir()
    (sneaky / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9\n\nbody\n")
    (sneaky / "RECORD").write_text("torch/__init__.py,,\ninnocent-1.0.dist-info/METADATA,,\n")
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    assert D.refused_entries(str(tmp_path)) == (("innocent-1.0.dist-info", "torch"),
                                                ("torch", "torch"))
