"""Review 7's audit findings, below the CLI: what `audit diff` and `audit verify` now
name (findings 2, 4, 9) on reports built by hand, in milliseconds. The CLI journeys
(two installs in private mount namespaces, a vehicle supervisor) are in
tests/test_review_round7.py."""
from __future__ import annotations

from typing import Any

from supervisor.audit import diff


def _report(root: str, *, models: str = "ro", old_style: bool = False) -> dict[str, Any]:
    """The parts of a report `audit diff` reads for one sandbox at install ROOT."""
    mounts = [{"path": "/", "what": "root", "access": "ro", "size": None, "source": ""},
              {"path": root, "what": "tmpfs", "access": "ro", "size": None, "source": ""},
              {"path": f"{root}/models", "what": "bind", "access": models, "size": None,
               "source": f"{root}/models"},
              {"path": f"{root}/supervisor", "what": "bind", "access": "ro", "size": None,
               "source": f"{root}/supervisor"},
              {"path": "/tmp", "what": "tmpfs", "access": "rw", "size": 1 << 20,
               "source": ""}]
    prov: dict[str, Any] = {"code_trees": [{"domain": "(installed)",
                                            "path": f"{root}/supervisor", "sha256": "0" * 64}]}
    if not old_style:
        prov["project_root"] = root
    return {"schema_version": 1, "workers": [{"worker": "one"}], "provenance": prov,
            "filesystem": {"one": {"mounts": mounts, "masked": [f"{root}/bin/cc"],
                                   "whiteouts": {f"{root}/site": ["torch"]}}}}


def test_one_code_at_two_install_paths_is_no_change_in_isolation():
    for old_style in (False, True):          # a report from before project_root
        d = diff.compare(_report("/opt/A", old_style=old_style), _report("/opt/B"))
        assert (d["weakened"], d["tightened"], d["changed"], d["exit_code"]) == (0, 0, 0, 0), \
            d["changes"]
        assert d["provenance"]["project_root"] == {"old": "/opt/A", "new": "/opt/B"}
    same = diff.compare(_report("/opt/A"), _report("/opt/A"))
    assert "project_root" not in same["provenance"] and not same["changes"]


def test_a_real_weakening_still_shows_across_install_paths():
    d = diff.compare(_report("/opt/A"), _report("/opt/B", models="rw"))
    assert d["weakened"] == 1 and d["exit_code"] == 6, d["changes"]
    (c,) = d["changes"]
    assert (c["subject"], c["key"], c["old"], c["new"]) == ("one", "/opt/B/models", "ro", "rw")
    # A bind outside the project (same at both installs) that appears is new.
    b = _report("/opt/B")
    b["filesystem"]["one"]["mounts"].append(
        {"path": "/etc/secret", "what": "bind", "access": "ro", "size": None, "source": "/x"})
    b["filesystem"]["one"]["masked"] = []
    d = diff.compare(_report("/opt/A"), b)
    weak = {(c["key"], c["old"]) for c in d["changes"] if c["effect"] == "weakened"}
    assert weak == {("/etc/secret", None), ("masked compiler", "/opt/A/bin/cc")}, d["changes"]



def _tree(entries: list[list] | None) -> dict[str, Any]:
    return {"domain": "(installed)", "path": "/opt/A/supervisor", "sha256": "1" * 64,
            "entries": entries}


def test_verify_names_the_files_of_a_code_tree_that_moved(tmp_path):
    from supervisor.audit.provenance import tree_digest, tree_sha256
    from supervisor.audit.sign import _files_moved

    (tmp_path / "ipc").mkdir()
    for name, text in (("ipc/_native.c", "int f;"), ("ipc/_native.so", "ELF-1"),
                       ("law.py", "K = 1\n"), ("old.py", "")):
        (tmp_path / name).write_text(text)
    digest, then = tree_digest(str(tmp_path))
    assert digest == tree_sha256(str(tmp_path)) and ["ipc", "dir"] in then
    (tmp_path / "law.py").write_text("K = 2\n")
    (tmp_path / "new.py").write_text("")
    (tmp_path / "old.py").unlink()
    (tmp_path / "ipc" / "_native.so").write_text("ELF-2")       # another compiler
    said = _files_moved(_tree(then), _tree(tree_digest(str(tmp_path))[1]))
    assert said.startswith("changed: ipc/_native.so (sha256 "), said
    assert "law.py (sha256 " in said and "added: new.py; removed: old.py" in said, said
    assert "ipc/_native.c is the report's (rebuilt here from the report's source" in said
    (tmp_path / "ipc" / "_native.c").write_text("int g;")
    said = _files_moved(_tree(then), _tree(tree_digest(str(tmp_path))[1]))
    assert "its source ipc/_native.c differs too" in said, said
    # A report made before the entries were kept: verify still runs, and says so.
    assert "re-audit" in _files_moved({"sha256": "1" * 64}, _tree(then))


def test_a_trees_entries_are_kept_up_to_a_bound(tmp_path, monkeypatch):
    from supervisor.audit import provenance

    for i in range(4):
        (tmp_path / f"m{i}.py").write_text("")
    assert len(provenance._tree("x", str(tmp_path))["entries"]) == 4
    monkeypatch.setattr(provenance, "ENTRIES_MAX", 3)
    t = provenance._tree("x", str(tmp_path))
    assert t["entries"] is None and len(t["sha256"]) == 64      # the digest stays


def test_verify_says_what_moved_in_the_config():
    from supervisor.audit.sign import _what_moved
    from supervisor.config import dumps

    text = '[domains.control]\nnetwork = false  # never\nactuates = true\n'
    covers = {"config": {"canonical": dumps({"domains": {"control": {
        "network": False, "actuates": True}}})}}
    comment = _what_moved(covers, (text + "# reviewed\n").encode(), "F")
    assert comment.startswith("only comments or layout differ"), comment
    net = _what_moved(covers, text.replace("network = false", "network = true").encode(), "F")
    assert "the config's meaning moved: domains.control.network false -> true" in net, net
    assert "supervisor audit --config F" in net
    assert "no longer parses" in _what_moved(covers, b"[domains", "F")
    assert "older audit" in _what_moved({"config": {"sha256": "0" * 64}}, text.encode(), "F")


def test_check_start_names_no_broker_as_a_second_pipeline():
    """The note of a check beside a test/bench run names `supervisor run`s, not a broker
    (`python -m supervisor.broker` runs no pipeline; the run it serves is named)."""
    import subprocess
    import sys
    import time

    from supervisor.startcheck import other_supervisors

    sleep = [sys.executable, "-c", "import time; time.sleep(30)", "-m"]
    broker = subprocess.Popen([*sleep, "supervisor.broker", "--socket", "/x"])
    run = subprocess.Popen([*sleep, "supervisor.cli", "run", "--quiet"])
    try:              # until the run's command line is read (a loaded runner: not at once)
        for _ in range(100):
            found = dict(other_supervisors())
            if run.pid in found:
                break
            time.sleep(0.02)
    finally:
        for p in (broker, run):
            p.kill()
            p.wait()
    assert run.pid in found and broker.pid not in found, found
