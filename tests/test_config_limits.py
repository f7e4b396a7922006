"""Every worker has limits (issue 21 item 5): memory_max and pids_max default per profile
(config/_model.py PROFILE_LIMITS), a domain may set its workers' default, a worker its own;
after load() neither is ever None, so the audit shows what is enforced."""
from __future__ import annotations

from supervisor.config import load
from supervisor.config._model import MIN_WORKER_MEMORY, PROFILE_LIMITS
from tests.test_config import base, load_doc, one_problem

GiB, MiB = 2**30, 2**20


def test_profiles_have_default_limits_research_included():
    assert PROFILE_LIMITS["control"] == {"memory_max": 1 * GiB, "pids_max": 64}
    assert PROFILE_LIMITS["research"] == {"memory_max": 2 * GiB, "pids_max": 256}
    for limits in PROFILE_LIMITS.values():
        assert limits["memory_max"] >= MIN_WORKER_MEMORY


def test_a_worker_without_limits_gets_its_profiles():
    cfg = load_doc(base())        # no worker of BASE sets memory_max or pids_max
    got = {n: (w.memory_max, w.pids_max) for n, w in cfg.workers.items()}
    assert got == {"cam": (1 * GiB, 64), "model": (1 * GiB, 64), "ctl": (1 * GiB, 64),
                   "lab": (2 * GiB, 256)}
    assert (cfg.domains["research"].memory_max, cfg.domains["research"].pids_max) == (2 * GiB, 256)


def test_domain_default_and_worker_own_win_in_that_order():
    doc = base()
    doc["domains"]["research"].update(memory_max="6GiB", pids_max=512)
    doc["domains"]["control"]["memory_max"] = "768MiB"
    doc["workers"]["lab"]["memory_max"] = "3GiB"
    doc["workers"]["cam"]["pids_max"] = 32
    cfg = load_doc(doc)
    assert (cfg.workers["lab"].memory_max, cfg.workers["lab"].pids_max) == (3 * GiB, 512)
    assert (cfg.workers["cam"].memory_max, cfg.workers["cam"].pids_max) == (768 * MiB, 32)
    assert cfg.workers["model"].memory_max == 768 * MiB


def test_an_inherited_limit_too_small_for_python_names_the_domain():
    doc = base()
    doc["domains"]["control"]["memory_max"] = "16MiB"
    reason = one_problem(doc, "workers.cam.memory_max")
    assert reason == ("16MiB (domain 'control''s memory_max, which it inherits) cannot host "
                      "the interpreter (minimum 64MiB)")


def test_domain_limit_keys_are_checked():
    doc = base()
    doc["domains"]["research"]["pids_max"] = 2
    assert one_problem(doc, "domains.research.pids_max") == "2 is out of range; must be in 8..4194304"


def test_the_default_config_has_every_limit():
    for w in load().workers.values():
        assert w.memory_max and w.pids_max, w


# ------------------------------------------------------------------ ranges and rules (issue 22)


def test_a_cpu_quota_too_small_to_start_in_is_refused_with_the_reason():
    doc = base()
    doc["workers"]["cam"]["cpu_quota"] = 5            # 0.25 CPU-s in 5 s: never READY
    reason = one_problem(doc, "workers.cam.cpu_quota")
    assert reason == ("5 % of a CPU gives 'cam' 0.25 CPU-seconds before its ready timeout "
                      "(5000 ms); a Python worker needs about 0.3 to start, so it would never "
                      "be READY: use cpu_quota >= 6 or a longer ready_timeout_ms")
    doc["workers"]["cam"]["cpu_quota"] = 6
    assert load_doc(doc).workers["cam"].cpu_quota == 6
    doc["workers"]["cam"].update(cpu_quota=1, ready_timeout_ms=30000)   # 0.3 CPU-s: enough
    assert load_doc(doc).workers["cam"].cpu_quota == 1
    doc["workers"]["ctl"]["cpu_quota"] = 1           # a command: its needs are unknown
    assert load_doc(doc).workers["ctl"].cpu_quota == 1


def test_zero_means_off_where_the_key_says_so():
    doc = base()
    doc["workers"]["cam"].update(cooldown_s=0, watchdog_ms=0)
    w = load_doc(doc).workers["cam"]
    assert (w.cooldown_s, w.watchdog_ms) == (0.0, 0)
    doc["workers"]["cam"]["watchdog_ms"] = 19
    assert one_problem(doc, "workers.cam.watchdog_ms") == \
        "19 is out of range; must be in 20..3600000 ms (or 0: off)"


def test_a_problem_is_one_printable_line_whatever_the_value():
    from supervisor.config import Problem

    p = Problem("c.toml", 'workers."a\\nb"', "bad\nvalue \x1b[2J")
    assert str(p) == 'c.toml: workers."a\\nb": bad\\nvalue \\x1b[2J' and str(p).isprintable()


def test_the_state_dir_run_latches_in_must_be_writable(tmp_path, monkeypatch):
    from supervisor.config import check_runtime, loads
    from tests.test_config import to_toml

    monkeypatch.delenv("TRIO_STATE_DIR", raising=False)
    doc = base()
    doc["supervisor"] = {"state_dir": "/proc/trio-nowhere"}
    found = [p for p in check_runtime(loads(to_toml(doc), "c.toml"), sandboxed=False)
             if p.key == "supervisor.state_dir"]
    assert len(found) == 1 and "not writable (creating it in /proc)" in found[0].reason
    doc["supervisor"]["mode"] = "simulation"       # a simulation latches per run, below it
    assert [p.key for p in check_runtime(loads(to_toml(doc), "c.toml"), sandboxed=False)
            if p.key == "supervisor.state_dir"] == ["supervisor.state_dir"]
    doc["supervisor"]["state_dir"] = "/var/lib/trio-supervisor"   # the vehicle's: never
    assert not [p for p in check_runtime(loads(to_toml(doc), "c.toml"), sandboxed=False)
                if p.key == "supervisor.state_dir"]        # ... then below the temp dir
    monkeypatch.setenv("TRIO_STATE_DIR", "/proc/elsewhere")   # what run would use
    doc["supervisor"]["mode"] = "vehicle"
    doc["supervisor"]["state_dir"] = str(tmp_path)
    found = [p for p in check_runtime(loads(to_toml(doc), "c.toml"), sandboxed=False)
             if p.key == "supervisor.state_dir"]
    assert len(found) == 1 and "TRIO_STATE_DIR overrides" in found[0].reason


def test_needs_model_is_read_from_the_module_and_fails_closed(tmp_path, monkeypatch):
    from supervisor.config import check_runtime, loads
    from tests.test_config import to_toml

    pkg = tmp_path / "fakeworkers"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "needy.py").write_text("NEEDS_MODEL = True\ndef main(ctx):\n    return 0\n")
    (pkg / "odd.py").write_text("NEEDS_MODEL = bool(1)\ndef main(ctx):\n    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    doc = base()
    doc["workers"]["cam"]["module"] = "fakeworkers.needy"
    doc["workers"]["lab"]["module"] = "fakeworkers.odd"
    found = {p.key: p.reason for p in check_runtime(loads(to_toml(doc), "c.toml"),
                                                     sandboxed=False)}
    assert found["workers.cam.model"].startswith("fakeworkers.needy needs a model: give 'cam' "
                                                 "model = NAME")
    assert "NEEDS_MODEL must be True or False" in found["workers.lab.module"]
    assert "workers.model.model" in found      # BASE's modeld has no model either
