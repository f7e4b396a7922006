"""`supervisor units --prefix VENV` for a venv that is not the vehicle install's: the unit
must start its own interpreter under the unit's own PrivateTmp= and ProtectHome=.

`systemd-analyze verify` passes such units (it does not build the unit's namespace), so
the test builds it: in a private mount namespace, an empty tmpfs over what PrivateTmp=yes
replaces (/tmp, /var/tmp) and what ProtectHome=yes hides (/root, /home, /run/user), then
the unit's ExecStart interpreter is run. Either `units` refuses the prefix in one line
(exit 2), or the interpreter it wrote starts. ~2 s each."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="root and unshare (a private mount namespace)")

HOMES = ("/root", "/home", "/run/user")

# $1 the venv to make (its parent is a fresh tmpfs when $3 says so), $2 the units' dir.
SCRIPT = r"""
set -e
mount --make-rprivate /
[ -n "$3" ] && mount -t tmpfs -o size=8m tmpfs "$3"
"$PY" -m venv --without-pip "$1"
set +e
"$PY" -m supervisor.cli units --prefix "$1" --out "$2" >/dev/null 2>"$2.err"
rc=$?
set -e
echo "units exit $rc"
[ $rc -eq 0 ] || exit 0
unit="$2/trio-supervisor.service"
py=$(sed -n 's/^ExecStart=\([^ ]*\) .*/\1/p' "$unit")
tmp=$(grep -cx 'PrivateTmp=yes' "$unit" || true)
home=$(grep -cx 'ProtectHome=yes' "$unit" || true)
if [ "$tmp" = 1 ]; then
    for d in /tmp /var/tmp; do mount -t tmpfs -o size=1m tmpfs "$d"; done
fi
if [ "$home" = 1 ]; then
    for d in /root /home /run/user; do [ -d "$d" ] && mount -t tmpfs -o size=1m,mode=000 tmpfs "$d"; done
fi
"$py" -c 'print("interpreter started")' 2>&1 || echo "ExecStart $py: cannot start"
"""


def _units_for(venv: str, out: Path, fresh_parent: str = "") -> tuple[str, str]:
    p = subprocess.run(["unshare", "-m", "sh", "-c", SCRIPT, "sh", venv, str(out), fresh_parent],
                       capture_output=True, text=True, timeout=120, cwd="/",
                       env={**os.environ, "PY": sys.executable,
                            "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    err = out.with_name(out.name + ".err")
    return p.stdout + p.stderr, (err.read_text() if err.exists() else "")


def _judge(said: str, err: str) -> None:
    if "units exit 0" in said:
        assert "interpreter started" in said, said
    else:
        assert "units exit 2" in said, said + err
        (line,) = err.strip().splitlines()
        assert line.startswith("supervisor units: "), line


def test_a_venv_under_tmp_is_refused_or_its_unit_starts(tmp_path):
    """A venv under /tmp (`supervisor units --prefix /tmp/lay/venv`): the unit's
    ExecStart=/tmp/lay/venv/bin/python3 and PrivateTmp=yes, so systemd starts it in an
    empty /tmp: 'No such file or directory' (status 203/EXEC); verify was clean."""
    said, err = _units_for(str(tmp_path / "venv"), tmp_path / "units")
    _judge(said, err)


@pytest.mark.skipif(not any(os.path.realpath(sys.executable).startswith(h + "/") for h in HOMES),
                    reason="this interpreter does not live under a home directory")
def test_a_venv_whose_interpreter_lives_in_a_home_is_refused_or_its_unit_starts(tmp_path):
    """A venv in /opt made from pyenv's interpreter (/root/.pyenv/...): its bin/python3
    is a link into /root, and the unit says ProtectHome=yes (the link's own path is not
    under a home), so the link dangles inside the unit."""
    said, err = _units_for("/opt/lay-venv", tmp_path / "units", fresh_parent="/opt")
    _judge(said, err)
