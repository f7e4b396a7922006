"""The schemas load from a checkout whose path is not ASCII (a user's home, a
localized folder): pycapnp 2.2 cut an import directory by its extra UTF-8 bytes, and
capnp's C++ aborted the process (rc 134, no Python line) in `supervisor check` when
the drive log's schema imported "/receipt.capnp"."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_schema_importing_from_the_schema_dir_loads_from_a_non_ascii_checkout(tmp_path):
    root = tmp_path / "capé x"
    shutil.copytree(REPO / "schemas", root / "schemas",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "supervisor" / "replay" / "drivelog.capnp", root)
    code = ("import sys, capnp; sys.path.insert(0, sys.argv[1]); import schemas; "
            "assert schemas.__file__.startswith(sys.argv[1]); "
            "m = capnp.load(sys.argv[1] + '/drivelog.capnp', "
            "imports=[schemas.import_dir(schemas.SCHEMA_DIR)]); print('loaded', m)")
    p = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True,
                       text=True, timeout=60, check=False)
    assert p.returncode == 0 and "loaded" in p.stdout, (p.returncode, p.stderr[-600:])
