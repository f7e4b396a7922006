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
