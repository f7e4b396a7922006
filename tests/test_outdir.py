"""supervisor/outdir.py: root writes only where no other user can point it (red team
round 5 rows 2-4 and 12, and the same class in `log cut`, `log frames --out` and the
fleet's `--out`). Real directories of another real user (nobody), real symlinks; every
test takes well under a second."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from supervisor.outdir import OutDir, OutDirError

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chowns to another user (root)")


@pytest.fixture()
def base():
    """A directory anyone may traverse, like the red team's (pytest's tmp dirs are 0700)."""
    d = Path(tempfile.mkdtemp(prefix="outdir-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _nobodys(p: Path) -> Path:
    p.mkdir()
    os.chown(p, NOBODY, NOBODY)
    return p


def test_a_new_dir_is_made_exactly_and_written_through_its_fd(base: Path) -> None:
    victim = base / "victim"
    victim.write_text("precious\n")
    with OutDir.open(str(base / "run"), mode=0o750) as d:
        assert d.created
        st = os.fstat(d.fd)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), 0o750)
        os.symlink(victim, base / "run" / "summary.json")      # planted under the name
        d.write_text("summary.json", "{}", 0o644)
        assert victim.read_text() == "precious\n"              # the link was replaced
        assert not (base / "run" / "summary.json").is_symlink()
        assert (base / "run" / "summary.json").read_text() == "{}"
        assert d.names() == ["summary.json"]                   # no temp file left


def test_missing_parents_are_made_by_the_same_rule(base: Path) -> None:
    with OutDir.open(str(base / "x" / "y" / "z"), parents=True) as d:
        assert d.created and (base / "x" / "y").stat().st_mode & 0o777 == 0o755
    with pytest.raises(OutDirError, match="owned by uid 65534"):
        OutDir.open(str(_nobodys(base / "att") / "p" / "q"), parents=True)
    assert not (base / "att" / "p").exists()


def test_a_sticky_world_writable_parent_is_fine_for_a_new_private_dir(base: Path) -> None:
    tmp = base / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    with OutDir.open(str(tmp / "new"), mode=0o700) as d:
        assert stat.S_IMODE(os.fstat(d.fd).st_mode) == 0o700
    squat = _nobodys(tmp / "squat")                            # another user was first
    with pytest.raises(OutDirError, match="owned by uid 65534"):
        OutDir.open(str(squat))


@pytest.mark.parametrize("case", ["out_nobodys", "parent_nobodys", "out_nobodys_link",
                                  "ancestor_group_writable", "out_group_writable"])
def test_what_another_user_could_swap_is_refused_in_one_line(base: Path, case: str) -> None:
    private = base / "private"
    private.mkdir(mode=0o700)
    if case == "out_nobodys":
        out = _nobodys(base / "out")
    elif case == "parent_nobodys":
        out = _nobodys(base / "att") / "out"
    elif case == "out_nobodys_link":
        out = base / "out"
        os.symlink(private, out)
        os.lchown(out, NOBODY, NOBODY)
    elif case == "ancestor_group_writable":
        (base / "a").mkdir()
        (base / "a").chmod(0o775)
        os.chown(base / "a", 0, 65534)          # a group that is not root's own
        (base / "a" / "b").mkdir()
        out = base / "a" / "b" / "out"
    else:
        out = base / "out"
        out.mkdir()
        out.chmod(0o777)
        os.chown(out, 0, 65534)
    with pytest.raises(OutDirError) as e:
        OutDir.open(str(out))
    assert str(out) in str(e.value) and "\n" not in str(e.value), e.value
    assert not list(private.iterdir()) and stat.S_IMODE(private.stat().st_mode) == 0o700
    assert not (base / "a" / "b" / "out").exists()


def test_the_sudo_user_is_trusted_for_output_but_not_for_the_cache(base: Path,
                                                                   monkeypatch) -> None:
    att = _nobodys(base / "att")
    monkeypatch.setenv("SUDO_UID", str(NOBODY))
    OutDir.open(str(att / "out")).close()                     # their own directory
    with pytest.raises(OutDirError):
        OutDir.open(str(att / "cache"), invoker=False)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "supervisor.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("cmd", ["cut", "frames"])
def test_log_cut_and_frames_refuse_an_out_another_user_owns(base: Path, cmd: str) -> None:
    from tests.test_replay_format import write_log

    write_log(base / "drive", n=2)
    att = _nobodys(base / "att")
    out = att / "out"
    args = (["log", "cut", str(base / "drive"), str(out)] if cmd == "cut"
            else ["log", "frames", str(base / "drive"), "--out", str(out)])
    r = _cli(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-300:]
    assert "owned by uid 65534" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_the_fleets_out_is_refused_the_same_way(base: Path) -> None:
    from supervisor.replay.fleet import FleetError, replay_fleet
    from tests.test_replay_format import write_log

    write_log(base / "drive", n=2)
    out = _nobodys(base / "att") / "fleet"
    with pytest.raises(FleetError, match="owned by uid 65534"):
        replay_fleet([str(base / "drive")], str(out))
    assert not out.exists()


def test_a_users_own_group_writable_dirs_and_trusted_links_are_accepted(base: Path) -> None:
    """A umask 002 login (private user groups: the user's directories are 775 and their
    group is theirs alone) and a symlink the user owns (a link's mode is always 777):
    accepted (review: both were refused, and a link loop recursed)."""
    own = base / "own"
    own.mkdir()
    own.chmod(0o775)                            # root's group: root's alone
    os.symlink(own, base / "link")
    OutDir.open(str(base / "link" / "out")).close()
    assert (own / "out").is_dir()
    os.symlink("loop", base / "loop")
    with pytest.raises(OutDirError):
        OutDir.open(str(base / "loop"))
