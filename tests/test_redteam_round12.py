"""Red team, round 12 (docs/redteam12.md): an attacker who knows the code, against what
changed in the two hours before it (the bytecode rules, the broker's adopt, the ordered
start slots, start-up dependencies and the open-file rule).

Themes, each with one shared fixture:

* bytecode admission did not read (rows 1-): `.pyc` headers, caches and trees that
  `admission/bytecode.py` and its users (`code_dir_problem`, admission's walk, the
  audit's tree digest) judge differently from the interpreter, each shown running in a
  real control sandbox.

Each test asserts the claim the way it should hold. A claim that fails today is an
``xfail(strict=True)`` whose reason starts with "redteam12 row N"; the fix turns it into
a plain pass. ``--runxfail -s`` shows the evidence of each break.
"""
from __future__ import annotations

import importlib.util
import marshal
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.sandbox
if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap is not installed", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the supervisor's isolation (host uids, cgroups) needs root", allow_module_level=True)

PY = sys.executable
TAG = sys.implementation.cache_tag


def _sandboxed(pp: Path, code: str):
    """`python -c code` in a real control sandbox whose domain's python_path is `pp`."""
    from supervisor.sandbox.launch import run
    from supervisor.sandbox.policy import policy_for_domain

    return run(policy_for_domain("control", python_path=[str(pp)]), [PY, "-c", code],
               timeout=60)


def _pyc(code, flags: int, src: Path) -> bytes:
    """A .pyc as the interpreter reads it: magic, flags, then (flags bit 0 clear) the
    source's mtime and size, or (bit 0 set) its hash; then the marshalled code."""
    st = src.stat()
    if flags & 1:
        tail = importlib.util.source_hash(src.read_bytes())
    else:
        tail = ((int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
                + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little"))
    return importlib.util.MAGIC_NUMBER + flags.to_bytes(4, "little") + tail + marshal.dumps(code)


def _package(pp: Path, name: str, source: str) -> Path:
    """A root-owned 0755 package `name` in `pp` whose __init__.py is `source`."""
    pkg = pp / name
    pkg.mkdir(mode=0o755)
    pkg.chmod(0o755)
    mod = pkg / "__init__.py"
    mod.write_text(source)
    mod.chmod(0o644)
    return mod


def _plant(mod: Path, data: bytes, name: str | None = None) -> Path:
    cache = mod.parent / "__pycache__"
    cache.mkdir(mode=0o755, exist_ok=True)
    cache.chmod(0o755)
    pyc = cache / (name or f"{mod.stem}.{TAG}.pyc")
    pyc.write_bytes(data)
    pyc.chmod(0o644)
    return pyc


# ================================================================ bytecode not read

@pytest.fixture(scope="module")
def code_dir():
    tmp = Path(tempfile.mkdtemp(prefix="rt12c-", dir="/tmp"))
    tmp.chmod(0o755)
    pp = tmp / "lib"
    pp.mkdir(mode=0o755)
    pp.chmod(0o755)
    try:
        yield pp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


CLEAN = "LIMIT = 0.5\ndef main(ctx):\n    pass\n"
EVIL = "LIMIT = 5.0\ndef main(ctx):\n    import torch\n"


def test_a_cache_with_flags_two_is_judged_as_the_interpreter_loads_it(code_dir):
    """The interpreter (importlib's SourceLoader.get_code) reads a cache's flags word:
    bit 0 hash-based, bit 1 check_source, any other bit refused. Flags 2 (bit 1 alone)
    is not hash-based, so it is validated by the source's mtime and size, as flags 0,
    and runs. `bytecode.loaded_instead` treats every value but 0 and 'bit 0 set' as a
    cache the interpreter would not load."""
    from supervisor.admission.check import check_worker
    from supervisor.audit.provenance import tree_sha256
    from supervisor.config._runtime import code_dir_problem
    from supervisor.sandbox.policy import worker_sys_path

    mod = _package(code_dir, "rt12flag", CLEAN)
    try:
        before = tree_sha256(str(code_dir))
        _plant(mod, _pyc(compile(EVIL, str(mod), "exec"), 2, mod))
        ran = _sandboxed(code_dir, "import rt12flag; print('LIMIT', rt12flag.LIMIT)")
        why = code_dir_problem(str(code_dir))
        report = check_worker("w", "control", "rt12flag", None,
                              worker_sys_path(True, (str(code_dir),)))
        after = tree_sha256(str(code_dir))
        print(f"rt12 row 1: sandbox {ran.stdout.strip()!r}; code_dir_problem {why!r}; "
              f"admission {report.format().splitlines()[0]!r}; digest moved {after != before}")
        assert ran.returncode == 0 and "LIMIT 5.0" in ran.stdout, ran.stderr
        assert why is not None and "rt12flag" in why, why
        assert not report.ok, report.format()
        assert after != before
    finally:
        shutil.rmtree(mod.parent, ignore_errors=True)


def test_source_inside_pycache_is_code_the_digest_covers(code_dir):
    """`audit/provenance._walk_into` skips every `__pycache__` ("derived, rewritten by
    any import"), and `code_dir_problem` refuses only sourceless `.pyc` there (red team
    11 rows 12, 15). But `__pycache__` is an identifier: a package's `__pycache__` is a
    namespace subpackage, and a `.py` in it a module that a literal import reaches."""
    from supervisor.admission.check import check_worker
    from supervisor.audit.provenance import tree_sha256
    from supervisor.config._runtime import code_dir_problem
    from supervisor.sandbox.policy import worker_sys_path

    mod = _package(code_dir, "rt12pc", "from .__pycache__ import law\nLIMIT = law.LIMIT\n"
                                       "def main(ctx):\n    pass\n")
    cache = mod.parent / "__pycache__"
    cache.mkdir(mode=0o755)
    cache.chmod(0o755)
    law = cache / "law.py"
    law.write_text("LIMIT = 0.5  # the reviewed steering limit\n")
    law.chmod(0o644)
    try:
        signed = tree_sha256(str(code_dir))
        law.write_text("LIMIT = 5.0  # after the review\n")
        ran = _sandboxed(code_dir, "import rt12pc; print('LIMIT', rt12pc.LIMIT)")
        why = code_dir_problem(str(code_dir))
        report = check_worker("w", "control", "rt12pc", None,
                              worker_sys_path(True, (str(code_dir),)))
        now = tree_sha256(str(code_dir))
        print(f"rt12 row 3: sandbox {ran.stdout.strip()!r}; code_dir_problem {why!r}; "
              f"admission {report.format().splitlines()[0]!r}; digest moved {now != signed}")
        assert ran.returncode == 0 and "LIMIT 5.0" in ran.stdout, ran.stderr
        # Either the tree refuses code in __pycache__, or the digest covers it.
        assert why is not None or now != signed
    finally:
        shutil.rmtree(mod.parent, ignore_errors=True)


_DEEP_CONFIG = """
[domains.control]
actuates = true
python_path = ["{lib}"]
[channels.x]
slot_size = "4KiB"
[workers.w]
domain = "control"
publishes = ["x"]
module = "rt12deep"
"""


def test_a_source_that_does_not_compile_is_named_not_an_internal_error(code_dir):
    """`bytecode.unfaithful` compiles the source to compare it with its cache and
    catches SyntaxError/ValueError; admission parses it with `ast.parse`. A source
    nested beyond the parser (`x = ----...1`, 100 000 minus signs: MemoryError, or
    RecursionError at other depths) is never compiled in the sandbox, whose
    interpreter runs the valid cache beside it. Refused (good), but as a bug."""
    import subprocess

    mod = _package(code_dir, "rt12deep", "x = " + "-" * 100_000 + "1\n"
                                         "def main(ctx):\n    pass\n")
    _plant(mod, _pyc(compile(EVIL, str(mod), "exec"), 0, mod))
    cfg = code_dir.parent / "deep.toml"
    cfg.write_text(_DEEP_CONFIG.format(lib=code_dir))
    try:
        ran = _sandboxed(code_dir, "import rt12deep; print('LIMIT', rt12deep.LIMIT)")
        chk = subprocess.run([shutil.which("supervisor") or "supervisor", "check",
                              "--config", str(cfg)], capture_output=True, text=True,
                             timeout=120)
        out = (chk.stdout + chk.stderr).strip()
        print(f"rt12 row 2: sandbox {ran.stdout.strip()!r}; check exit {chk.returncode}: "
              f"{out[-300:]!r}")
        assert ran.returncode == 0 and "LIMIT 5.0" in ran.stdout, ran.stderr
        assert chk.returncode != 0                       # refused: it must be
        assert chk.returncode != 1 and "rt12deep" in out, out   # as bad input, named
    finally:
        shutil.rmtree(mod.parent, ignore_errors=True)
        cfg.unlink()


def _bad_hash(mod: Path) -> tuple[str, bytes]:
    """A checked hash .pyc whose hash is not its source's: the plain interpreter
    compiles the source instead; `--check-hash-based-pycs never` runs it."""
    data = bytearray(_pyc(compile(EVIL, str(mod), "exec"), 3, mod))
    data[8:16] = bytes(8)
    return f"__init__.{TAG}.pyc", bytes(data)


_OPTIONS = {
    "-O": (lambda mod: (f"__init__.{TAG}.opt-1.pyc",
                        _pyc(compile(EVIL, str(mod), "exec"), 0, mod)), ["-O"]),
    "check-hash-never": (_bad_hash, ["--check-hash-based-pycs", "never"]),
}


@pytest.mark.parametrize("option", ["-O", "check-hash-never"])
def test_interpreter_options_run_only_caches_the_checks_judged(code_dir, option):
    """A control worker may be a `command` (`[python, "-O", "-m", "supervisor.runner",
    "mod"]`: `supervisor check` exit 0, 'all admitted'). Under -O (or -OO) the
    interpreter reads `__pycache__/NAME.cpython-311.opt-1.pyc` (opt-2), validated by the
    source's mtime and size as the plain cache is; `bytecode.cache_path` names only
    `NAME.cpython-311.pyc`, and `sourceless` takes the opt-1 name (dots in the stem) for
    a cache. Under `--check-hash-based-pycs never` a checked hash .pyc is run whatever
    its hash, which `loaded_instead` takes for one the interpreter would not load."""
    from supervisor.admission.check import check_worker
    from supervisor.audit.provenance import tree_sha256
    from supervisor.config._runtime import code_dir_problem
    from supervisor.sandbox.launch import run
    from supervisor.sandbox.policy import policy_for_domain, worker_sys_path

    make, flags = _OPTIONS[option]
    mod = _package(code_dir, "rt12opt", CLEAN)
    try:
        signed = tree_sha256(str(code_dir))
        name, data = make(mod)
        _plant(mod, data, name)
        ran = run(policy_for_domain("control", python_path=[str(code_dir)]),
                  [PY, *flags, "-c", "import rt12opt; print('LIMIT', rt12opt.LIMIT)"],
                  timeout=60)
        why = code_dir_problem(str(code_dir))
        # (-m rt12opt, not -m supervisor.runner rt12opt: row 8, admission of the
        # runner's argument, is another gap)
        report = check_worker("w", "control", None, [PY, *flags, "-m", "rt12opt"],
                              worker_sys_path(True, (str(code_dir),)))
        now = tree_sha256(str(code_dir))
        print(f"rt12 row 4 ({option}): sandbox {ran.stdout.strip()!r}; code_dir_problem "
              f"{why!r}; admission {report.format().splitlines()[0]!r}; digest moved "
              f"{now != signed}")
        assert ran.returncode == 0 and "LIMIT 5.0" in ran.stdout, ran.stderr
        assert why is not None, why
        assert not report.ok, report.format()
        assert now != signed
    finally:
        shutil.rmtree(mod.parent, ignore_errors=True)


_LAUNCHERS = {                 # a module that runs another, named by its argument
    "runner": ["-m", "supervisor.runner", "rt12torch"],
    "runpy": ["-m", "runpy", "rt12torch"],
    "cProfile": ["-m", "cProfile", "-m", "rt12torch"],
}


@pytest.mark.parametrize("launcher", sorted(_LAUNCHERS))
def test_a_command_through_a_launcher_is_admitted_as_its_module(code_dir, launcher):
    """`admission/check._python_target` takes `python -m supervisor.runner MOD` for the
    module `supervisor.runner` and walks it; MOD, which the runner imports by name
    (importlib), is a computed import: a note. The same worker as `module = "MOD"` is
    refused before the car starts (`supervisor check` exit 3); as this command, exit 0
    'all admitted' (checked by hand with the CLI), and only the runtime guard (or the
    whiteout) stops torch, in the car. The standard library's launchers (`runpy`,
    `cProfile -m`) run MOD just the same (shown in the sandbox: MOD's first line ran)."""
    from supervisor.admission.check import check_worker
    from supervisor.sandbox.launch import run
    from supervisor.sandbox.policy import policy_for_domain, worker_sys_path

    mod = _package(code_dir, "rt12torch", "print('RT12 rt12torch ran', flush=True)\n"
                                          "import torch\ndef main(ctx):\n    pass\n")
    try:
        sys_path = worker_sys_path(True, (str(code_dir),))
        as_module = check_worker("w", "control", "rt12torch", None, sys_path)
        argv = [PY, *_LAUNCHERS[launcher]]
        as_command = check_worker("w", "control", None, argv, sys_path)
        ran = None
        if launcher != "runner":           # (the runner needs a worker's environment)
            ran = run(policy_for_domain("control", python_path=[str(code_dir)]), argv,
                      timeout=60)
        print(f"rt12 row 8 ({launcher}): module = rt12torch: "
              f"{as_module.format().splitlines()[0]!r}; {argv[1:]}: "
              f"{as_command.format().splitlines()[0]!r}; sandbox "
              f"{ran.stdout.strip()[:40] if ran else None!r}")
        assert ran is None or "RT12 rt12torch ran" in ran.stdout, ran.stderr
        assert not as_module.ok
        assert not as_command.ok, as_command.format()
    finally:
        shutil.rmtree(mod.parent, ignore_errors=True)


def test_combined_short_options_name_the_module_admission_walks(code_dir):
    """`_python_target` knows `-m MOD`, `-mMOD`, and options with an argument; any other
    word starting with '-' is skipped whole. CPython reads `-Bm MOD` as `-B -m MOD`
    (likewise `-Em`, `-Im`, `-sm`, ...), so a control command `[python, "-Bm", MOD]`
    runs MOD, which nothing walked."""
    from supervisor.admission.check import check_worker
    from supervisor.sandbox.launch import run
    from supervisor.sandbox.policy import policy_for_domain, worker_sys_path

    mod = _package(code_dir, "rt12bm", "print('RT12 rt12bm ran', flush=True)\nimport torch\n"
                                       "def main(ctx):\n    pass\n")
    try:
        sys_path = worker_sys_path(True, (str(code_dir),))
        apart = check_worker("w", "control", None, [PY, "-B", "-m", "rt12bm"], sys_path)
        joined = check_worker("w", "control", None, [PY, "-Bm", "rt12bm"], sys_path)
        ran = run(policy_for_domain("control", python_path=[str(code_dir)]),
                  [PY, "-Bm", "rt12bm"], timeout=60)
        print(f"rt12 row 14: -B -m: {apart.format().splitlines()[0]!r}; -Bm: "
              f"{joined.format().splitlines()[0]!r}; sandbox stdout {ran.stdout.strip()!r}")
        assert "RT12 rt12bm ran" in ran.stdout, ran.stderr    # the sandbox runs it
        assert not apart.ok
        assert not joined.ok, joined.format()
    finally:
        shutil.rmtree(mod.parent, ignore_errors=True)


def test_a_python_path_that_links_to_an_archive_is_refused(code_dir):
    """(held, row 9) red team 11 row 13's rule follows a symlink: `os.path.isdir` of a link to
    a zip is False."""
    from supervisor.config._runtime import code_dir_problem

    archive = code_dir.parent / "lib.zip"
    archive.write_bytes(b"PK\x05\x06" + bytes(18))        # an empty zip
    link = code_dir.parent / "zlink"
    link.symlink_to(archive)
    try:
        why = code_dir_problem(str(link))
        print(f"rt12 row 9: code_dir_problem {why!r}")
        assert why is not None and "not a directory" in why, why
    finally:
        link.unlink()
        archive.unlink()


NOBODY = 65534


def test_a_symlinked_directory_in_a_python_path_is_checked_as_its_own(code_dir):
    """`code_dir_problem` requires everything in a control python_path to be root's and
    writable by no one else (red team 7 row 1). Its walk is `os.walk(real)`, which lists
    a symlink to a directory in `dirs` (its target's owner is checked) but never walks
    into it; the sandbox follows it (the target is under /usr, visible read-only)."""
    import subprocess

    from supervisor.config._runtime import code_dir_problem

    target = Path(tempfile.mkdtemp(prefix="rt12-", dir="/usr/local/share"))
    link = code_dir / "rt12sym"
    try:
        target.chmod(0o755)
        init = target / "__init__.py"
        init.write_text("OWNER = 'root'\n")
        init.chmod(0o644)
        os.chown(init, NOBODY, -1)          # a vendor tree with one file left to its user
        link.symlink_to(target)
        why = code_dir_problem(str(code_dir))
        wrote = subprocess.run(["su", "nobody", "-s", "/bin/sh", "-c",
                                f"echo \"OWNER = 'nobody'\" > {init}"],
                               capture_output=True, text=True, timeout=30)
        ran = _sandboxed(code_dir, "import rt12sym; print('OWNER', rt12sym.OWNER)")
        print(f"rt12 row 5: code_dir_problem {why!r}; nobody wrote rc {wrote.returncode}; "
              f"sandbox {ran.stdout.strip()!r}")
        assert wrote.returncode == 0 and "OWNER nobody" in ran.stdout, (wrote.stderr, ran.stderr)
        # refused: nobody's file named, or the link out of the tree
        assert why is not None and ("uid 65534" in why or "rt12sym" in why), why
    finally:
        link.unlink(missing_ok=True)
        shutil.rmtree(target, ignore_errors=True)


def test_sourceless_bytecode_in_a_nested_namespace_dir_is_refused(code_dir, tmp_path):
    """(held, row 12) `ns/deeper/1evil.pyc` (namespace directories, no __init__, a stem
    that is no identifier): the whole-tree walk judges every file's name."""
    import py_compile

    from supervisor.config._runtime import code_dir_problem

    deep = code_dir / "rt12ns" / "deeper"
    deep.mkdir(parents=True, mode=0o755)
    for d in (deep, deep.parent):
        d.chmod(0o755)
    src = tmp_path / "_e.py"
    src.write_text("LIMIT = 5.0\n")
    target = deep / "1evil.pyc"
    py_compile.compile(str(src), cfile=str(target), doraise=True)
    target.chmod(0o644)
    try:
        ran = _sandboxed(code_dir, "import importlib; print('LIMIT', "
                                   "importlib.import_module('rt12ns.deeper.1evil').LIMIT)")
        why = code_dir_problem(str(code_dir))
        print(f"rt12 row 12: sandbox {ran.stdout.strip()!r}; code_dir_problem {why!r}")
        assert "LIMIT 5.0" in ran.stdout, ran.stderr
        assert why is not None and "1evil.pyc" in why, why
    finally:
        shutil.rmtree(code_dir / "rt12ns", ignore_errors=True)


def test_a_pth_file_in_a_python_path_runs_nothing(code_dir):
    """(held, row 13) site.py runs a .pth file's `import` lines only in site
    directories; a python_path is on PYTHONPATH, not one of them."""
    pth = code_dir / "rt12.pth"
    pth.write_text("import sys; print('RT12 pth ran', flush=True)\n")
    pth.chmod(0o644)
    try:
        ran = _sandboxed(code_dir, "print('worker code')")
        print(f"rt12 row 13: sandbox {ran.stdout.strip()!r}")
        assert ran.returncode == 0, ran.stderr
        assert "RT12 pth ran" not in ran.stdout
    finally:
        pth.unlink()


# ================================================================ the open-file rule

_WIDE = "".join(f'[channels.c{i}]\nslot_size = "64B"\nslot_count = 200\nmax_readers = 64\n'
                f'max_leases = 2\n' for i in range(4)) + """
[workers.w]
domain = "research"
module = "workers.probe"
publishes = ["c0", "c1", "c2", "c3"]
args = ["--publish", "c0", "--publish", "c1", "--publish", "c2", "--publish", "c3"]
[workers.r]
domain = "research"
module = "workers.probe"
subscribes = ["c0", "c1", "c2", "c3"]
args = ["--read", "c0", "--read", "c1", "--read", "c2", "--read", "c3"]
"""


def _rmdir_cgroups_of(pid: int) -> None:
    """The supervisor tree a run of ours left (an internal error skips its clean-up)."""
    import glob

    for d in glob.glob(f"/sys/fs/cgroup/*/trio-supervisor-*-{pid}"):
        for sub, _, _ in sorted(os.walk(d), key=lambda t: -len(t[0])):
            try:
                os.rmdir(sub)
            except OSError:
                pass


def test_the_open_file_rule_counts_what_a_channel_holds(tmp_path):
    """`fdlimit.needed` = 60 + 12 a worker + 3 a channel (fitted to the car's 162 fds).
    A channel's handles are a segment, a lease table per reader and a wake-up pair per
    reader: with `max_readers = 64` (allowed: 1-64) four channels are ~770 fds. Under a
    hard limit of 128 `check` must refuse the config, as it does one with too many
    workers, rather than `run` failing in Channel.create with no word of the limit."""
    import subprocess

    cfg = tmp_path / "wide.toml"
    cfg.write_text('[domains.research]\nactuates = false\n' + _WIDE)
    exe = shutil.which("supervisor") or "supervisor"
    lim = ["prlimit", "--nofile=128:128"]
    chk = subprocess.run([*lim, exe, "check", "--config", str(cfg)], capture_output=True,
                         text=True, timeout=120)
    state = tmp_path / "state"
    state.mkdir()
    p = subprocess.Popen([*lim, exe, "run", "--config", str(cfg)], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "TRIO_STATE_DIR": str(state)})
    try:
        out, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        _rmdir_cgroups_of(p.pid)
    said = (chk.stdout + chk.stderr).strip().splitlines()
    last = out.strip().splitlines()[-1] if out.strip() else ""
    print(f"rt12 row 6: check (ulimit -n 128) exit {chk.returncode}: "
          f"{said[-1] if said else ''!r}; run exit {p.returncode}: {last!r}")
    assert p.returncode != 0                   # it does not fit (the evidence)
    assert chk.returncode != 0 and "open files" in chk.stdout + chk.stderr, said


# ================================================================ the start, held

_HELD = """
[domains.control]
[domains.research]
[channels.x]
slot_size = "4KiB"
[workers.c]
domain = "control"
module = "workers.probe"
publishes = ["x"]
args = ["--publish", "x"]
[workers.r]
domain = "research"
module = "workers.probe"
optional = true
args = ["--ready-delay-ms", "100000"]
ready_timeout_ms = 1000
backoff_initial_ms = 10
max_restarts = 1
restart_window_s = 0.5
"""


def test_an_optional_worker_never_ready_does_not_hold_the_cars_start(tmp_path, monkeypatch):
    """`_start_all` returns (then READY=1 to systemd, `all_ready`, the monitor) once every
    worker's `_supervise` said started: at its first READY, or an optional one at
    `gave_up`. The budget (`_budget_left`) counts restarts within `restart_window_s`; a
    worker whose every attempt lasts its ready timeout (longer than the window) never
    spends it. The unit is Type=notify with no TimeoutStartSec: systemd's default 90 s
    start timeout then stops the whole car (and Restart=on-failure starts it again, for
    ever). The car's own research worker has ready_timeout_ms = 300000 and the default
    window of 60 s, the same shape: a research model that never says READY is enough."""
    import socket
    import time

    from tests._fleet import LoggedRun

    sock_path = tmp_path / "notify"
    listen = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listen.bind(str(sock_path))
    listen.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(sock_path))
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    run = LoggedRun(tmp_path, "held", _HELD)
    said: list[str] = []
    try:
        # Until systemd would have been told READY=1, or r has been killed 4 times
        # without it (the evidence of the break), or 20 s.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and run.proc.poll() is None:
            while True:
                try:
                    said.append(listen.recv(4096).decode())
                except BlockingIOError:
                    break
            ev = run.events(strict=False)
            if any("READY=1" in m.split("\n") for m in said) and any(
                    e["event"] == "gave_up" and e.get("worker") == "r" for e in ev):
                break
            r_exits = [e for e in ev if e["event"] == "exit" and e.get("worker") == "r"]
            if any(e["event"] == "ready" and e.get("worker") == "c" for e in ev) and len(r_exits) >= 4:
                break
            time.sleep(0.2)
        time.sleep(0.3)                  # all_ready follows READY=1
    finally:
        run.terminate()
        listen.close()
    ev = run.events(strict=False)
    kinds = [(e["event"], e.get("worker")) for e in ev]
    r_exits = [e for e in ev if e["event"] == "exit" and e.get("worker") == "r"]
    ready1 = [m for m in said if "READY=1" in m.split("\n")]
    print(f"rt12 row 7: c ready {('ready', 'c') in kinds}; r exits {len(r_exits)} "
          f"(causes {sorted({str(e.get('cause') or e.get('reason')) for e in r_exits})}); "
          f"gave_up {('gave_up', 'r') in kinds}; all_ready {('all_ready', None) in kinds}; "
          f"READY=1 sent {len(ready1)}; notify datagrams {len(said)}")
    assert ("ready", "c") in kinds, kinds
    assert ready1                                   # systemd hears the car has started
    assert ("gave_up", "r") in kinds                # and r's start ends


_FIRST = """
[domains.control]
[domains.research]
[channels.x]
slot_size = "4KiB"
[workers.r]
domain = "research"
module = "workers.probe"
optional = true
args = ["--ready-delay-ms", "100000"]
ready_timeout_ms = 1000
backoff_initial_ms = 10
max_restarts = 2
[workers.c]
domain = "control"
module = "workers.probe"
publishes = ["x"]
args = ["--publish", "x"]
"""


def test_a_required_worker_never_waits_on_an_optional_one_it_does_not_read(tmp_path, monkeypatch):
    """(against 024e717) READY=1 now follows the required workers' READY, but `_start_all`
    still starts in `start_order()`: publishers first, ties in declaration order. An
    optional research worker declared before control, that never says READY, holds the
    one start slot (start_parallel = 1, the default) for its whole budget; control, which
    reads nothing of it, waits. With the car's research settings (ready_timeout_ms =
    300000, max_restarts 5) that is 30 minutes of a car that does not drive."""
    import socket
    import time

    from tests._fleet import LoggedRun

    sock_path = tmp_path / "notify"
    listen = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listen.bind(str(sock_path))
    listen.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(sock_path))
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    run = LoggedRun(tmp_path, "first", _FIRST)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and run.proc.poll() is None:
            ev = run.events(strict=False)
            if any(e["event"] == "ready" and e.get("worker") == "c" for e in ev):
                break
            time.sleep(0.2)
    finally:
        run.terminate()
        listen.close()
    ev = run.events(strict=False)
    at = {}
    for e in ev:
        at.setdefault((e["event"], e.get("worker")), e["mono_ns"])
    t0 = at.get(("channels_created", None), 0)

    def ms(key):
        return None if key not in at else round((at[key] - t0) / 1e6)

    print(f"rt12 row 10: after channels_created: r start {ms(('start', 'r'))} ms, r gave_up "
          f"{ms(('gave_up', 'r'))} ms, c start {ms(('start', 'c'))} ms, c ready "
          f"{ms(('ready', 'c'))} ms")
    assert ("ready", "c") in at, sorted(at)
    # control is not held behind r's ready timeouts
    assert ("gave_up", "r") not in at or at[("start", "c")] < at[("gave_up", "r")]


_STANDBY = """
[domains.control]
[channels.x]
slot_size = "4KiB"
[workers.c]
domain = "control"
module = "workers.probe"
publishes = ["x"]
args = ["--publish", "x"]
warm_standby = true
[workers.d]
domain = "control"
module = "workers.probe"
subscribes = ["x"]
args = ["--read", "x"]
"""


def test_a_limit_the_open_file_rule_admits_holds_the_running_config(tmp_path):
    """(against 221a352) `fdlimit.needed` is fitted "exactly" to the running car's fds,
    with no margin for what a start holds for a moment (the old rule said so). With
    RLIMIT_NOFILE at exactly `needed(cfg)`, `check` passes; the run must then hold its
    workers and both standbys."""
    import resource
    import time

    from supervisor.config import load
    from supervisor.fdlimit import needed, shortfall
    from tests._fleet import LoggedRun

    path = tmp_path / "cfg.toml"
    path.write_text(_STANDBY)
    n = needed(load(path))

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    run = LoggedRun(tmp_path, "fit", _STANDBY, preexec_fn=limit)
    try:
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline and run.proc.poll() is None:
            ev = run.events(strict=False)
            warm = [e for e in ev if e["event"] == "standby_warm"]
            failed = [e for e in ev if e["event"] in ("standby_failed", "start_failed")]
            if len(warm) >= 2 or failed:
                break
            time.sleep(0.2)
    finally:
        run.terminate()
    ev = run.events(strict=False)
    failed = [e.get("error", "") for e in ev if e["event"] in ("standby_failed", "start_failed")]
    warm = sum(e["event"] == "standby_warm" for e in ev)
    print(f"rt12 row 11: needed(cfg) {n}; standbys warm {warm}; failed {failed}")
    assert any(e["event"] == "all_ready" for e in ev)     # the run got that far
    assert not any("Too many open files" in f for f in failed), failed
    assert warm >= 2
