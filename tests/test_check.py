"""`supervisor check`: everything knowable before start, one line per problem, no traceback.

The CLI tests run the real command (``python -m supervisor.cli check --config F``) from
an unrelated working directory; the others call `supervisor.config.check_runtime`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from supervisor.config import (MIN_WORKER_MEMORY, channel_shm_bytes,
                               check_runtime, load, loads)

ROOT = Path(__file__).resolve().parents[1]

# One control worker publishing one small channel; {worker} and {domain} add keys.
CONFIG = """
[domains.control]
actuates = true
{domain}
[channels.x]
slot_size = "4KiB"
{channels}
[workers.w]
domain = "control"
publishes = ["x"]
{worker}
"""


def config(tmp_path: Path, worker: str = 'module = "workers.probe"', domain: str = "",
           channels: str = "", extra: str = "") -> Path:
    path = tmp_path / "cars.toml"
    path.write_text(CONFIG.format(worker=worker, domain=domain, channels=channels) + extra)
    return path


def check(tmp_path: Path, path: Path | None = None, env: dict | None = None):
    argv = [sys.executable, "-m", "supervisor.cli", "check"]
    if path is not None:
        argv += ["--config", str(path)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=dict(os.environ, **(env or {})))
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr
    return p


def problem_lines(p, path: Path) -> list[str]:
    return [line for line in p.stderr.splitlines() if line.startswith(f"{path}: ")]


def one_problem(tmp_path: Path, path: Path, key: str, env: dict | None = None) -> str:
    """Run check on a config with exactly one problem, at ``key``; its reason."""
    p = check(tmp_path, path, env)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = problem_lines(p, path)
    assert len(lines) == 1, p.stderr
    head = f"{path}: {key}: "
    assert lines[0].startswith(head), lines
    assert "all admitted" not in p.stdout
    return lines[0][len(head):]


# ------------------------------------------------------------------ the CLI, one case each

# `supervisor check` on the embedded default (the car: seven sandboxes built) passes:
# tests/test_vehicle_config.py, test_the_default_is_the_car_checked_and_trusting_both_models.


def test_small_config_passes(tmp_path):
    p = check(tmp_path, config(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "1 workers, 1 channels: all admitted" in p.stdout


def test_missing_module(tmp_path):
    reason = one_problem(tmp_path, config(tmp_path, 'module = "workers.nope"'),
                         "workers.w.module")
    assert reason.startswith("no module named 'workers.nope'")
    assert "did you mean 'workers." in reason


def test_missing_top_level_package(tmp_path):
    reason = one_problem(tmp_path, config(tmp_path, 'module = "nosuchpkg.worker"'),
                         "workers.w.module")
    assert reason.startswith("no module named 'nosuchpkg'")


def test_module_that_is_not_a_worker(tmp_path):
    reason = one_problem(tmp_path, config(tmp_path, 'module = "workers.camerad.synthetic"'),
                         "workers.w.module")
    assert reason.startswith("workers.camerad.synthetic is not a worker (no top-level main(ctx))")
    assert reason.endswith("did you mean 'workers.camerad'?")


def test_missing_extra_ro_bind(tmp_path):
    domain = f'extra_ro_binds = ["{tmp_path}", "/no/such/dir"]'
    reason = one_problem(tmp_path, config(tmp_path, domain=domain),
                         "domains.control.extra_ro_binds[1]")
    assert reason == "/no/such/dir: no such file or directory"


def test_memory_max_below_interpreter_floor(tmp_path):
    path = config(tmp_path, 'module = "workers.probe"\nmemory_max = "16MiB"')
    reason = one_problem(tmp_path, path, "workers.w.memory_max")
    assert reason == "16MiB cannot host the interpreter (minimum 64MiB)"


def test_channels_over_shm_budget(tmp_path):
    big = '[channels.big]\nslot_size = "1GiB"\nslot_count = 1024\n'
    path = config(tmp_path, 'module = "workers.probe"', channels=big)
    path.write_text(path.read_text().replace('publishes = ["x"]', 'publishes = ["x", "big"]'))
    reason = one_problem(tmp_path, path, "channels")
    assert "total 1.0TiB of shared memory for 2 channels" in reason
    assert "big 1024 slots of 1GiB = 1.0TiB" in reason       # the biggest, named first
    assert "exceeds shm_budget 2GiB" in reason


def test_channels_over_configured_shm_budget(tmp_path):
    frames = '[channels.frames]\nslot_size = "3.5MiB"\nslot_count = 6\n'
    path = config(tmp_path, 'module = "workers.probe"', channels=frames,
                  extra='[supervisor]\nshm_budget = "16MiB"\n')
    path.write_text(path.read_text().replace('publishes = ["x"]',
                                             'publishes = ["x", "frames"]'))
    reason = one_problem(tmp_path, path, "channels")
    assert "biggest: frames 6 slots of 3.5MiB" in reason
    assert "exceeds shm_budget 16MiB" in reason


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable")


def test_channels_over_machine_memory(tmp_path):
    if _mem_available() > 2**39:
        pytest.skip("this machine has more than 512 GiB available")
    big = '[channels.big]\nslot_size = "1GiB"\nslot_count = 512\n'
    path = config(tmp_path, 'module = "workers.probe"', channels=big,
                  extra='[supervisor]\nshm_budget = "1TiB"\n')     # the most it may be
    path.write_text(path.read_text().replace('publishes = ["x"]', 'publishes = ["x", "big"]'))
    reason = one_problem(tmp_path, path, "channels")
    assert "big 512 slots of 1GiB" in reason
    assert "exceeds this machine's available memory" in reason and "MemAvailable" in reason


@pytest.mark.skipif(os.geteuid() != 0, reason="domain users are only looked up as root")
def test_missing_domain_user(tmp_path):
    path = config(tmp_path, domain='user = "trio-nosuchuser"')
    reason = one_problem(tmp_path, path, "domains.control.user")
    assert "no system user 'trio-nosuchuser'" in reason


def test_missing_command_executable(tmp_path):
    # research: admission does not vet a research command (control refuses it, exit 3)
    path = config(tmp_path, 'command = ["/no/such/prog", "--flag"]',
                  extra="[domains.research]\n")
    path.write_text(path.read_text().replace('domain = "control"', 'domain = "research"'))
    reason = one_problem(tmp_path, path, "workers.w.command[0]")
    assert reason == "/no/such/prog: no such file or directory"


def test_file_problems_one_line_each(tmp_path):
    """Loader problems take the same shape: FILE: KEY: REASON, unindented, exit 2."""
    path = config(tmp_path, 'module = "workers.probe"\nmemroy_max = "1GiB"')
    reason = one_problem(tmp_path, path, "workers.w.memroy_max")
    assert reason == "unknown key; did you mean 'memory_max'?"


def test_every_problem_reported_at_once(tmp_path):
    path = tmp_path / "many.toml"
    path.write_text(textwrap.dedent("""
        [domains.control]
        actuates = true
        extra_ro_binds = ["/no/such/dir"]
        [channels.a]
        slot_size = "4KiB"
        [channels.b]
        slot_size = "4KiB"
        [workers.one]
        domain = "control"
        module = "workers.nope"
        publishes = ["a"]
        [workers.two]
        domain = "control"
        module = "workers.camerad.synthetic"
        publishes = ["b"]
        """))
    p = check(tmp_path, path)
    assert p.returncode == 2, p.stderr
    keys = sorted(line.split(": ")[1] for line in problem_lines(p, path))
    assert keys == ["domains.control.extra_ro_binds[0]", "workers.one.module",
                    "workers.two.module"]
    assert "supervisor check: 3 config problems" in p.stderr


def test_admission_refusal_wins_over_config_problem(tmp_path):
    """A control worker importing torch is refused (exit 3) even when the config also
    has problems; the config problems are still printed."""
    path = config(tmp_path, 'module = "workers.research"',
                  domain='extra_ro_binds = ["/nonexistent-bind"]')
    p = check(tmp_path, path)
    assert p.returncode == 3, p.stderr
    assert f"{path}: domains.control.extra_ro_binds[0]: /nonexistent-bind" in p.stderr
    assert "control-domain worker w imports torch" in p.stderr, p.stderr


def test_a_package_only_the_operators_pythonpath_finds_is_no_module(tmp_path):
    """The sandbox clears PYTHONPATH: a package found only through the operator's is one
    the worker cannot import, so check says so (it said "is not a worker" and walked the
    operator's file)."""
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def main(ctx):\n    pass\n")
    path = config(tmp_path, 'module = "mypkg"')
    p = check(tmp_path, path, env={"PYTHONPATH": str(tmp_path)})
    assert p.returncode == 2, p.stderr
    assert f"{path}: workers.w.module: no module named 'mypkg'" in p.stderr, p.stderr


# ------------------------------------------------------------------ check_runtime directly

def runtime(text: str) -> dict[str, str]:
    return {p.key: p.reason for p in check_runtime(loads(text, "t.toml"))}


def package(tmp_path: Path, monkeypatch, name: str, init: str | None, **files: str) -> str:
    pkg = tmp_path / name
    pkg.mkdir()
    if init is not None:
        (pkg / "__init__.py").write_text(textwrap.dedent(init))
    for f, body in files.items():
        (pkg / f"{f}.py").write_text(textwrap.dedent(body))
    # On the workers' own path (what a sandboxed worker's interpreter searches), as an
    # installed package would be: these tests are about the shape of a module, not where.
    from supervisor.sandbox import policy

    search = policy.worker_sys_path

    def workers_path(sandboxed: bool = True, python_path=()) -> list[str]:
        return [str(tmp_path), *search(sandboxed, python_path)]

    monkeypatch.setattr(policy, "worker_sys_path", workers_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def worker_problem(module: str) -> str | None:
    text = CONFIG.format(worker=f'module = "{module}"', domain="", channels="")
    return runtime(text).get("workers.w.module")


def test_default_config_has_no_runtime_problems():
    assert check_runtime(load()) == []


@pytest.mark.parametrize("source", [
    "def main(ctx):\n    return 0\n",
    "def main(ctx=None, *, verbose=False):\n    return 0\n",
    "def main(*args):\n    return 0\n",
    "from .impl import main\n",
    "try:\n    from .impl import main\nexcept ImportError:\n    def main(ctx): return 1\n",
    "main = lambda ctx: 0\n",
])
def test_worker_shapes_accepted(tmp_path, monkeypatch, source):
    name = package(tmp_path, monkeypatch, "okpkg", source, impl="def main(ctx): return 0\n")
    assert worker_problem(name) is None


@pytest.mark.parametrize("source, why", [
    ("import os\n", "no top-level main(ctx)"),
    ("class Worker:\n    def main(self, ctx): pass\n", "no top-level main(ctx)"),
    ("def run():\n    def main(ctx): pass\n", "no top-level main(ctx)"),
    ("async def main(ctx):\n    pass\n", "main is 'async def'"),
    ("def main():\n    pass\n", "main() takes no argument"),
    ("def main(ctx, other):\n    pass\n", "main() requires 2 arguments"),
    ("def main(ctx, *, mode):\n    pass\n", "keyword argument 'mode'"),
])
def test_worker_shapes_refused(tmp_path, monkeypatch, source, why):
    name = package(tmp_path, monkeypatch, "nopkg", source)
    reason = worker_problem(name)
    assert reason is not None and reason.startswith(f"{name} is not a worker (")
    assert why in reason


def test_submodule_worker_and_syntax_error(tmp_path, monkeypatch):
    package(tmp_path, monkeypatch, "pkg2", "", good="def main(ctx): return 0\n",
            broken="def main(ctx):\n  return (\n")
    assert worker_problem("pkg2.good") is None
    reason = worker_problem("pkg2.broken")
    assert reason.startswith("cannot parse ") and "broken.py" in reason


def test_namespace_package_is_not_a_worker(tmp_path, monkeypatch):
    package(tmp_path, monkeypatch, "nspkg", None)
    assert "namespace package" in worker_problem("nspkg")


def test_modules_are_located_without_importing(tmp_path, monkeypatch):
    """Neither the module nor its parent packages run: they may import anything."""
    marker = tmp_path / "ran"
    package(tmp_path, monkeypatch, "loud", f"open({str(marker)!r}, 'w').close()\n",
            child="def main(ctx): return 0\n")
    assert worker_problem("loud.child") is None
    assert worker_problem("loud.missing").startswith("no module named 'loud.missing'")
    assert not marker.exists()
    assert "loud" not in sys.modules


def test_module_inside_a_plain_module():
    reason = worker_problem("workers.camerad.synthetic.inner")
    assert reason.startswith("no module named 'workers.camerad.synthetic.inner'; "
                             "'workers.camerad.synthetic' is not a package")


def test_runtime_checks_skip_sandbox_only_items_without_sandbox(tmp_path):
    text = CONFIG.format(worker='module = "workers.probe"', channels="",
                         domain='extra_ro_binds = ["/no/such/dir"]\nuser = "trio-nosuchuser"')
    cfg = loads(text, "t.toml")
    assert check_runtime(cfg, sandboxed=False) == []
    keys = {p.key for p in check_runtime(cfg)}
    assert "domains.control.extra_ro_binds[0]" in keys
    if os.geteuid() == 0:
        assert "domains.control.user" in keys


def test_shm_bytes_counts_segment_and_lease_tables():
    spec = load().channels["road_frames"].spec
    assert channel_shm_bytes(spec) == spec.segment_size + spec.max_readers * spec.lease_size
    assert MIN_WORKER_MEMORY == 64 * 2**20


def test_a_domains_python_path_is_where_its_workers_and_admission_look(tmp_path):
    """`python_path` in a domain: the one way to run a worker package that lives outside
    the project and site-packages. The sandbox imports it from there (bound read-only,
    on PYTHONPATH), check finds it there, and admission walks it there: its torch
    import is refused naming the chain."""
    from supervisor.sandbox import launch
    from supervisor.sandbox.policy import for_worker

    lib = tmp_path / "lib"
    (lib / "mypkg").mkdir(parents=True)
    (lib / "mypkg" / "__init__.py").write_text("def main(ctx):\n    from . import model\n")
    (lib / "mypkg" / "model.py").write_text("import torch\n")
    path = config(tmp_path, 'module = "mypkg"', domain=f'python_path = ["{lib}"]')
    cfg = load(path)
    assert not [p for p in check_runtime(cfg) if p.key.startswith("workers.w.")]
    inside = launch.spawn(for_worker(cfg, cfg.workers["w"]),
                          [sys.executable, "-c", "import mypkg; print(mypkg.__file__)"],
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
    out, err = inside.communicate(timeout=60)
    assert inside.returncode == 0, err
    assert out.decode().strip() == str(lib / "mypkg" / "__init__.py")
    p = check(tmp_path, path)
    assert p.returncode == 3, p.stderr
    assert "mypkg.model" in p.stderr and "imports torch" in p.stderr, p.stderr


_HOOK = """
import os
try:                                     # visible only outside a sandbox
    open({marker!r}, "w").close()
except OSError:
    pass
if os.fork() == 0:                       # runs before the runner's lock-down
    import time
    time.sleep(30)
    os._exit(0)
"""


def test_a_start_up_hook_in_a_python_path_is_refused_at_check_and_at_ready(tmp_path,
                                                                           monkeypatch):
    """A sitecustomize.py in a domain's python_path runs in every worker at interpreter
    start-up, before the guard, the exec watch and the seccomp lock-down, walked by
    nothing: here it forks a child that keeps the worker's channel fds under the
    start-up filter only. check refuses the directory; and were that bypassed, the
    supervisor refuses the control worker at READY for the process beside it."""
    import io

    import trio

    from supervisor.config import _runtime
    from supervisor.events import EventLog
    from supervisor.lifecycle import Supervisor

    lib = tmp_path / "lib"
    lib.mkdir()
    marker = tmp_path / "ran-outside-a-sandbox"
    (lib / "sitecustomize.py").write_text(_HOOK.format(marker=str(marker)))
    path = config(tmp_path, 'module = "workers.probe"\nargs = ["--publish", "x"]',
                  domain=f'python_path = ["{lib}"]')
    got = [p for p in check_runtime(load(path)) if "python_path" in p.key]
    assert got and "sitecustomize.py would run in every sandbox" in got[0].reason, got
    # Learning the workers' sys.path ran none of it (a probe interpreter, as root).
    assert not marker.exists()
    # Bypassed (a check that missed it): the READY check still sees the child.
    monkeypatch.setattr(_runtime, "code_dir_problem", lambda *a, **k: None)
    log = EventLog(stream=io.StringIO(), keep=True)
    sup = Supervisor(load(path), log=log, status_out=io.StringIO())

    async def main() -> None:
        with trio.move_on_after(120):
            await sup.run()

    trio.run(main)
    refused = log.of("refused", "w")
    assert refused and refused[0]["kind"] == "extra_process", log.events[-5:]
    assert "READY with a process besides the worker" in refused[0]["reason"]
    assert not log.of("ready", "w")


def test_a_pth_file_in_a_python_path_runs_nothing_in_the_sandbox(tmp_path):
    """An attacker who can only add files beside a domain's worker package tries the
    other start-up door: a .pth file, whose `import` lines site.py executes in a site
    directory. A python_path is put on PYTHONPATH, not made a site directory: inside a
    real control sandbox the line never runs, and the package still imports."""
    from supervisor.sandbox import launch
    from supervisor.sandbox.policy import for_worker

    lib = tmp_path / "lib"
    (lib / "mypkg").mkdir(parents=True)
    (lib / "mypkg" / "__init__.py").write_text("def main(ctx):\n    pass\n")
    (lib / "evil.pth").write_text("import sys; print('PTH RAN', flush=True)\n")
    path = config(tmp_path, 'module = "mypkg"', domain=f'python_path = ["{lib}"]')
    cfg = load(path)
    inside = launch.spawn(for_worker(cfg, cfg.workers["w"]),
                          [sys.executable, "-c", "import mypkg; print('imported')"],
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
    out, err = inside.communicate(timeout=60)
    assert inside.returncode == 0, err
    assert out.decode().split() == ["imported"], out


def test_a_link_in_a_control_python_path_is_judged_by_where_it_leads(tmp_path):
    """A root-owned python_path whose package is a symbolic link to a directory another
    user owns: what the sandbox imports is that user's. The ownership rule follows the
    link (os.stat), so check refuses it."""
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    lib = tmp_path / "lib"
    lib.mkdir()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "__init__.py").write_text("def main(ctx):\n    pass\n")
    os.chown(theirs, 65534, 65534)
    (lib / "mypkg").symlink_to(theirs)
    path = config(tmp_path, 'module = "mypkg"', domain=f'python_path = ["{lib}"]')
    got = [p for p in check_runtime(load(path)) if p.key == "domains.control.python_path[0]"]
    assert got and "is owned by uid 65534" in got[0].reason, got


def test_an_actuation_writer_slower_than_its_watchdog_or_max_age_is_refused():
    """controlsd declares its rate argument (RATE_ARG = --hz). On the car its channel must
    move within its watchdog, else the supervisor finds it silent: --hz 2 beside
    watchdog_ms = 300 failed safe at boot with no fault (red team 16 row 27). Slower than
    the channel's max_age, every reader is without a current command between publishes.
    Both are config problems naming the argument; the car's own rate is none."""
    from supervisor.config import dumps, loads, minimal_doc

    def problems(hz: str | None, watchdog: int) -> dict[str, str]:
        doc = minimal_doc()
        w = doc["workers"]["controlsd"]
        w["args"] = [a for a in w.get("args", []) if a != "--hz"][:0] + (
            ["--hz", hz] if hz is not None else [])
        w["watchdog_ms"] = watchdog
        return {p.key: p.reason for p in check_runtime(loads(dumps(doc), "t.toml"))
                if p.key.startswith("workers.controlsd")}

    slow = problems("2", 300)
    assert list(slow) == ["workers.controlsd.args[1]"], slow
    assert "--hz 2 publishes every 500 ms" in slow["workers.controlsd.args[1]"]
    assert "watchdog_ms (300 ms)" in slow["workers.controlsd.args[1]"]
    stale = problems("10", 1000)           # 100 ms apart, control_cmd's max_age is 50
    assert "max_age_ms" in stale["workers.controlsd.args[1]"], stale
    assert problems("100", 200) == {} and problems(None, 200) == {}   # default --hz 50
