#!/usr/bin/env bash
# Install what the supervisor needs on a fresh Debian 12 + Python 3.11 machine (Python 3.12
# and 3.13, Debian 13's, work too: docs/deploy-layouts.md).
#   bash scripts/install.sh          # runtime: bubblewrap, libseccomp, the package with
#                                    # its research extra (the default config's torch
#                                    # shadow worker; torch==2.13.0 CPU wheel on disk)
#   bash scripts/install.sh --dev    # + clang (model builds) and the test extra
#   bash scripts/install.sh --system # the vehicle install: a venv under PREFIX
#                                    # (/opt/trio-supervisor) from a system interpreter
#                                    # outside any home, the domain users, the state dir,
#                                    # and the systemd unit written and verified
#                                    # (docs/vehicle.md: enable, remove)
# Not --system: into PYTHON if set, else the active venv, else `python`, else `python3`.
# Started as `sh scripts/install.sh` (dash on Debian) it stopped at once with 'set:
# Illegal option -o pipefail'. Plain POSIX sh up to the re-run under bash.
if [ -z "${BASH_VERSION:-}" ]; then
    if command -v bash >/dev/null 2>&1 && [ -f "$0" ]; then exec bash "$0" "$@"; fi
    echo "scripts/install.sh: needs bash: bash $0" >&2
    exit 2
fi
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1
# Every sandbox runs as a domain user, a stranger to root's files: what this install
# writes (the venv, the native module, pip's files) must be readable by others, whatever
# the caller's umask (with 077 no worker could start).
umask 022
dev=0
system=0
case "${1:-}" in
    --dev) dev=1 ;;
    --system) system=1 ;;
    "") ;;
    *) echo "install.sh: unknown option ${1} (use --dev or --system)" >&2; exit 2 ;;
esac
PREFIX="${TRIO_PREFIX:-/opt/trio-supervisor}"

# The same range as pyproject.toml's requires-python (tests/test_install_layouts.py);
# the probe runs under Python 2.7 too (version_info[:2] exists there).
in_range() {
    "$1" -c 'import sys; sys.exit(not ((3, 11) <= sys.version_info[:2] < (3, 14)))' 2>/dev/null
}
version_of() {
    "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null
}
# The interpreter's C headers, where pip builds the bridge's native module against them.
include_of() {
    "$1" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null
}
# Debian's python3-dev (python3.X-dev) holds /usr/include/python3.X only: a pyenv,
# /usr/local or other interpreter without its headers looped on that advice (review 9
# finding 9). One line naming this interpreter's missing header; nothing when present.
headers_line() {
    local inc
    inc="$(include_of "$1")" || return 0
    [ -e "$inc/Python.h" ] && return 0
    case "$inc" in /usr/include/*) return 0 ;; esac     # apt's python3-dev below
    echo "$2: the bridge's native module cannot be built: this interpreter's headers $inc/Python.h are missing (python3-dev serves /usr/bin/python3 only): install this Python's headers (pyenv: reinstall it; /usr/local: make install from its source), or use a venv of /usr/bin/python3"
}

# The interpreter the package goes into (not --system, which makes its own venv): PYTHON
# if given, else the active venv's, else `python`, else `python3` (Debian has no `python`).
py="${PYTHON:-}"
if [ -z "$py" ] && [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    py="$VIRTUAL_ENV/bin/python"
fi
[ -z "$py" ] && py="$(command -v python || command -v python3 || true)"
if [ $system -eq 0 ]; then
    if [ -z "$py" ]; then
        echo "install.sh: no python or python3 on PATH: apt-get install python3 python3-venv, make a venv (python3 -m venv DIR; . DIR/bin/activate) and run this again" >&2
        exit 2
    fi
    # The version first, before apt and pip (review 9 finding 14): a `python` 2.7 was
    # called "externally managed", a 3.9 venv ended in pip's resolver errors.
    if ! ver="$(version_of "$py")"; then
        echo "install.sh: $py does not run: set PYTHON to a Python 3.11, 3.12 or 3.13, or activate its venv" >&2
        exit 2
    fi
    if ! in_range "$py"; then
        echo "install.sh: $py is Python $ver; the package needs 3.11, 3.12 or 3.13: set PYTHON to one, or activate its venv" >&2
        exit 2
    fi
    # Debian's own interpreter refuses pip (PEP 668, "externally-managed-environment"):
    # say so before installing anything, with what to do instead.
    rc=0
    "$py" -c 'import os, sys, sysconfig; sys.exit(sys.prefix == sys.base_prefix and os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))' \
        2>/dev/null || rc=$?
    if [ $rc -eq 1 ]; then
        echo "install.sh: $py is the system's Python (externally managed): pip may not install into it; make a venv and run this in it: apt-get install python3-venv; python3 -m venv /opt/trio-dev; . /opt/trio-dev/bin/activate; bash scripts/install.sh (or the vehicle install: bash scripts/install.sh --system)" >&2
        exit 2
    elif [ $rc -ne 0 ]; then
        echo "install.sh: $py does not run (exit $rc): set PYTHON to a Python 3.11, 3.12 or 3.13, or activate its venv" >&2
        exit 2
    fi
    # The development install links this checkout and writes into it (supervisor.egg-info,
    # the native module): from a read-only one pip failed with 15 lines, after apt.
    if [ ! -w . ]; then
        echo "install.sh: $(pwd) is read-only: the development install writes into the checkout (supervisor.egg-info, the native module); use a writable clone, or install a copy: bash scripts/install.sh --system" >&2
        exit 2
    fi
    said="$(headers_line "$py" install)"
    if [ -n "$said" ]; then echo "$said" >&2; exit 2; fi
else
    # The vehicle install's base interpreter: /usr/bin/python3, or one named with PYTHON
    # (Ubuntu 22.04 / Jetson L4T 36: 3.10 as python3, 3.11 beside it; review 9 finding
    # 13). Outside /root, /home and /tmp: the unit hides them (ProtectHome=, PrivateTmp=).
    base="${PYTHON:-/usr/bin/python3}"
    case "$base" in
        /root/*|/home/*|/tmp/*)
            echo "install.sh --system: $base is under /root, /home or /tmp, which the unit hides (ProtectHome=yes, PrivateTmp=yes): name a system interpreter, e.g. PYTHON=/usr/bin/python3.11" >&2
            exit 2 ;;
        /*) ;;
        *) echo "install.sh --system: PYTHON=$base: give the interpreter's absolute path (e.g. /usr/bin/python3.11)" >&2
           exit 2 ;;
    esac
    if [ -e "$base" ] || [ -n "${PYTHON:-}" ]; then
        # Before apt and useradd: nothing is installed for an interpreter refused here.
        if ! in_range "$base"; then
            echo "install.sh --system: $base is not Python 3.11, 3.12 or 3.13 (it is $(version_of "$base" || echo 'not runnable')): install python3.11 (apt-get install python3.11 python3.11-venv python3.11-dev) and run PYTHON=/usr/bin/python3.11 bash scripts/install.sh --system" >&2
            exit 2
        fi
        said="$(headers_line "$base" "install.sh --system")"
        if [ -n "$said" ]; then echo "$said" >&2; exit 2; fi
    fi
fi
UNIT_DIR="${TRIO_UNIT_DIR:-/etc/systemd/system}"

sudo=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo="sudo"

need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v unshare >/dev/null || need+=(util-linux)   # staging mount namespace
ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2' || need+=(libseccomp2)
# The bridge's native module (memory ordering, hot path) is compiled at install.
command -v gcc >/dev/null || need+=(gcc)
# Debian's headers (/usr/include/python3.X): the python3.X-dev of that version
dev_pkg() {
    local inc
    inc="$(include_of "$1")" || return 0
    [ -e "$inc/Python.h" ] || need+=("${inc#/usr/include/}-dev")
}
[ $system -eq 0 ] && dev_pkg "$py"
[ -e /usr/include/zlib.h ] || need+=(zlib1g-dev)      # its CRC-32 (crc32_z)
if [ $dev -eq 1 ]; then
    command -v systemd-analyze >/dev/null || need+=(systemd)
    # tinygrad's CPU backend compiles with clang when a model artifact is built (build
    # side and tests only: the control sandbox never sees a compiler).
    command -v clang >/dev/null || need+=(clang)
    # The C++ reader of the bridge (tests build it): capnp compiler, headers and libs.
    command -v capnp >/dev/null || need+=(capnproto)
    [ -e /usr/include/capnp/message.h ] || need+=(libcapnp-dev)
    command -v g++ >/dev/null || need+=(g++)
    # The console test runs `supervisor run` in a real terminal (tests/test_console.py).
    command -v tmux >/dev/null || need+=(tmux)
    # System calls per message against iceoryx2 (bench/ipc_latency.py --syscalls).
    command -v strace >/dev/null || need+=(strace)
fi
if [ $system -eq 1 ]; then
    # The unit's ExecStart is PREFIX/bin/python3 and the unit hides /root and /home
    # (ProtectHome=yes): the venv's base interpreter must live outside them.
    command -v systemd-analyze >/dev/null || need+=(systemd)
    if [ -x "$base" ]; then
        if ! "$base" -c 'import ensurepip' 2>/dev/null; then
            [ "$base" = /usr/bin/python3 ] && need+=(python3-venv) || need+=("python$(version_of "$base")-venv")
        fi
        dev_pkg "$base"
    else
        need+=(python3 python3-venv python3-dev)
    fi
fi
if [ ${#need[@]} -gt 0 ]; then
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

# One unprivileged host user per domain profile: every sandbox runs as one of them,
# never as root (kernel permission checks then treat it as a stranger).
for u in trio-control trio-research; do
    if ! getent passwd "$u" >/dev/null; then
        $sudo useradd --system --no-create-home --home-dir /nonexistent \
            --shell /usr/sbin/nologin --user-group "$u"
    fi
done

# Whether this machine lets a sandbox start at all (a container without CAP_SYS_ADMIN, a
# read-only /run): its lines ("machine: ...", with what to do), not a failure of the
# install, which may be a container's build whose run is given more.
machine_note() {
    (cd / && "$1" -m supervisor.startcheck --machine) ||
        echo "install.sh: installed, but on this machine as it is now no sandbox starts (the line above)" >&2
}

if [ $system -eq 1 ]; then
    # Again after apt (it may have brought /usr/bin/python3 just now).
    if ! in_range "$base"; then
        echo "install.sh --system: $base is not Python 3.11, 3.12 or 3.13 (it is $(version_of "$base" || echo 'not runnable')): install python3.11 (apt-get install python3.11 python3.11-venv python3.11-dev) and run PYTHON=/usr/bin/python3.11 bash scripts/install.sh --system" >&2
        exit 2
    fi
    # A venv a failed run left (ensurepip died: a full TMPDIR, a Ctrl-C) has python3 and
    # no pip: every later run said only "No module named pip" (review 9 finding 8). Made
    # again with --clear, and only then: a whole venv keeps its packages, and a PREFIX
    # that is no venv (no pyvenv.cfg) is never cleared.
    clear=""
    if [ -x "$PREFIX/bin/python3" ]; then
        if [ -e "$PREFIX/pyvenv.cfg" ] && ! "$PREFIX/bin/python3" -m pip --version >/dev/null 2>&1; then
            clear="--clear"
        fi
    else
        clear="new"
    fi
    if [ -n "$clear" ]; then
        [ "$clear" = new ] && clear=""
        if ! $sudo "$base" -m venv $clear "$PREFIX"; then
            echo "install.sh --system: $base -m venv $PREFIX failed (the line above; ensurepip unpacks pip under TMPDIR=${TMPDIR:-/tmp}: full or read-only?): fix that and run this again (the half-made venv is made again)" >&2
            exit 2
        fi
    fi
    # A real install, not a link into this checkout: the car runs what was installed.
    # Built from a private copy of the package's sources: setuptools writes build/ and
    # *.egg-info beside them, so a read-only checkout failed inside pip (15 lines ending
    # "could not create 'supervisor.egg-info': Read-only file system"), and a writable
    # one kept a build/ whose leftovers a later build could ship.
    stage="$(mktemp -d -t trio-install.XXXXXX)"
    trap 'rm -rf "$stage"' EXIT
    tar -cf - --exclude=__pycache__ --exclude='*.so' --exclude='*.pyc' \
        pyproject.toml setup.py README.md supervisor schemas workers models | tar -xf - -C "$stage"
    # Regular files only: a symbolic link left in a checkout (configs/x.toml ->
    # /etc/shadow) was followed by root's build into the installed package (red team
    # round 7 row 3), and a FIFO or a device would hang it.
    odd="$(find "$stage" ! -type f ! -type d -print -quit)"
    if [ -n "$odd" ]; then
        echo "install.sh --system: ${odd#"$stage"/} is a symbolic link or a special file:" \
             "the vehicle install copies regular files only (remove it from the checkout)" >&2
        exit 2
    fi
    $sudo "$PREFIX/bin/python3" -m pip install -q --upgrade "$stage[research]"
    (cd / && "$PREFIX/bin/python3" -m supervisor.startcheck --installed) || exit 2
    machine_note "$PREFIX/bin/python3"
    # The supervisor proper of the split units (issue 27): no home, no shell, no
    # capabilities; it reaches root only through the broker's socket.
    if ! getent passwd trio-supervisor >/dev/null; then
        $sudo useradd --system --no-create-home --home-dir /nonexistent \
            --shell /usr/sbin/nologin --user-group trio-supervisor
    fi
    $sudo install -d -m 0700 -o root -g root /var/lib/trio-supervisor
    $sudo install -d -m 0755 "$UNIT_DIR"
    $sudo "$PREFIX/bin/supervisor" units --prefix "$PREFIX" --out "$UNIT_DIR" >/dev/null
    if command -v systemd-analyze >/dev/null; then
        $sudo systemd-analyze verify "$UNIT_DIR/trio-supervisor.service" \
            "$UNIT_DIR/trio-broker.socket" "$UNIT_DIR/trio-broker.service" \
            "$UNIT_DIR/trio-supervisor-proper.service"
    fi
    # Paths in the commands below are shell-quoted: a prefix with a space in it made
    # the printed `rm -r` remove two other paths.
    qp=$(printf '%q' "$PREFIX"); qu=$(printf '%q' "$UNIT_DIR")
    echo "installed: $PREFIX (venv), $UNIT_DIR/trio-supervisor.service and the split units (verified)"
    echo "check:     $qp/bin/supervisor check --start   (the installed copy: every worker READY, stopped)"
    echo "enable:    systemctl daemon-reload && systemctl enable --now trio-supervisor"
    echo "   or, split (root only in the broker): systemctl enable --now trio-broker.socket trio-supervisor-proper"
    echo "remove:    systemctl disable --now trio-supervisor trio-broker.socket trio-supervisor-proper; (cd $qu && rm trio-supervisor.service trio-broker.socket trio-broker.service trio-supervisor-proper.service); systemctl daemon-reload; rm -r $qp /var/lib/trio-supervisor; userdel trio-supervisor; userdel trio-control; userdel trio-research"
else
    if [ $dev -eq 1 ]; then
        "$py" -m pip install -q -e '.[dev,research,replay,fleet]'
    else
        "$py" -m pip install -q -e '.[research,replay]'
    fi
    # The install as the sandboxes will see it: readable by the domain users, schemas
    # loadable from this path, `supervisor` imported from this checkout. One line each.
    here="$(pwd)"
    (cd / && "$py" -m supervisor.startcheck --installed --checkout "$here") || exit 2
    machine_note "$py"
    bin="$("$py" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/supervisor"
    echo "installed: $(pwd) (editable) into $("$py" -c 'import sys; print(sys.prefix)')"
    if ! command -v supervisor >/dev/null; then
        echo "note:      \`supervisor\` is not on this PATH: run $bin, or activate its venv" >&2
    fi
fi
