"""The ``supervisor audit`` command line, all of it (``supervisor/cli.py`` dispatches
here; ``python -m supervisor.audit`` is the same):

    supervisor audit [--config F] [--format text|markdown|json] [--output FILE]
                     [--sign KEY]
    supervisor audit --live [--config F] [--pid PID] [--format ...]
    supervisor audit --live --start [--config F] [--settle S] [--timeout S]
    supervisor audit diff OLD.json NEW.json [--format text|markdown|json]
    supervisor audit verify REPORT SIG PUBKEY [--config F]

``--live`` inspects the running supervisor (found through /proc: its bwrap children;
``--pid`` picks one when several run), read-only; its config is the one the running
supervisor was started with unless ``--config`` says otherwise. ``--start`` starts a
system of its own for the audit instead, and refuses while a vehicle supervisor runs.
``--settle``/``--timeout`` only apply to a system the audit starts: given with ``--live``
alone they are taken as ``--start`` (what ``--live`` meant before), with a note on stderr.
``--sign KEY`` writes the JSON report to ``--output`` and a detached ed25519 signature
next to it (``FILE.sig``); the key file must be its owner's alone (mode 0600). ``verify``
says what it checked (key, the config and code the report covers) and fails when the
config in hand (``--config``, else the report's source) is not the one it covers. Progress goes to stderr when it is a terminal.

Exit codes (a CI step gates on them: "the tool broke" must not read as "the report was
tampered with", review 7 finding 7):

- 0 report made / system matches / diff without weakening / verify OK;
- 2 bad input, one line: a config that does not load, a typo'd or unreadable file, a
  file that is not a report, a key or signature file of the wrong kind, a usage error;
- 6 DIFFERS: differences found live, the diff weakened isolation, or ``verify`` FAILED
  (a signature that does not verify the report's bytes, or a good signature over a
  report that does not cover the config, models or code in hand);
- 1 the audit did not finish: an internal error (a bug: one line that says where,
  never a traceback) or an interruption (Ctrl-C), as for every command;
- 3, 4, 5 ``--start``: the supervisor's own exit before READY.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from supervisor.exits import Exit

PROG = "supervisor audit"


class UsageError(Exception):
    """A user's mistake (bad input): one line on stderr, exit 2 as every command's."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Isolation audit for a safety "
                                "reviewer (see docs/review.md). Also: `audit diff OLD NEW`, "
                                "`audit verify REPORT SIG PUBKEY`.")
    p.add_argument("--config", "-c", default=None, help="TOML config (default: the embedded "
                   "one; --live: the running supervisor's)")
    p.add_argument("--format", choices=("text", "markdown", "json"), default=None)
    p.add_argument("--output", "-o", default=None, help="write the report here, not stdout")
    p.add_argument("--sign", metavar="KEY", default=None,
                   help="ed25519 private key: sign the JSON report (needs --output)")
    p.add_argument("--live", action="store_true",
                   help="inspect the running system (read-only)")
    p.add_argument("--start", action="store_true",
                   help="--live: start a system of its own for the audit instead")
    p.add_argument("--pid", type=int, default=None,
                   help="--live: the supervisor to inspect when several run")
    p.add_argument("--settle", type=float, default=None,
                   help="--start: seconds to wait after all workers are READY (1)")
    p.add_argument("--timeout", type=float, default=None,
                   help="--start: seconds to wait for all workers to be READY (180)")
    return p


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):    # one line, exit 2 (argparse's own: usage + 2)
        raise UsageError(f"{self.prog}: {message}")


def _load(path: str | None):
    from supervisor.config import ConfigError, load

    try:
        return load(path)
    except ConfigError as e:
        first = str(e).splitlines()
        print(f"{PROG}: config error: {' '.join(x.strip() for x in first)}", file=sys.stderr)
        raise SystemExit(int(Exit.CONFIG))


def cmd_diff(argv: list[str]) -> int:
    from . import diff

    p = _Parser(prog=f"{PROG} diff", add_help=True)
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text")
    a = p.parse_args(argv)
    try:
        d = diff.compare(diff.load(a.old), diff.load(a.new))
    except diff.ReportError as e:
        raise UsageError(f"{PROG} diff: {e}") from None
    sys.stdout.write(diff.render(d, a.format))
    return int(d["exit_code"])


def cmd_verify(argv: list[str]) -> int:
    from .sign import NotVerified, SignError, verify_file

    p = _Parser(prog=f"{PROG} verify")
    p.add_argument("report")
    p.add_argument("signature")
    p.add_argument("pubkey")
    p.add_argument("--config", "-c", default=None, help="the config that will run "
                   "(default: the report's own source, where it exists here)")
    a = p.parse_args(argv)
    try:
        v = verify_file(a.report, a.signature, a.pubkey, a.config)
    except NotVerified as e:       # the bytes are not what the key signed: stop
        print(f"{PROG} verify: FAILED: {e}", file=sys.stderr)
        return int(Exit.DIFFERS)
    except SignError as e:         # a file missing or of the wrong kind: bad input
        raise UsageError(f"{PROG} verify: {e}") from None
    if not v.config_ok:
        # The signature is good, but what it vouches for is not what is in hand.
        print(f"{PROG} verify: FAILED: {a.report} is signed by key {v.key_id}, but "
              f"{v.config_now}", file=sys.stderr)
        print("\n".join(v.lines()))
        return int(Exit.DIFFERS)
    print(f"{PROG} verify: OK: {a.report} signed by key {v.key_id}")
    print("\n".join(v.lines()))
    return 0


def _pick(pid: int | None):
    from .running import find_supervisors

    found = find_supervisors()
    if pid is not None:
        found = [r for r in found if r.pid == pid]
        if not found:
            raise UsageError(f"{PROG} --live: no running supervisor with pid {pid}")
    if not found:
        raise UsageError(f"{PROG} --live: no running supervisor found (start one with "
                         f"`supervisor run`, or audit a system of its own with --start)")
    if len(found) > 1:
        raise UsageError(f"{PROG} --live: {len(found)} supervisors run (pids "
                         f"{', '.join(str(r.pid) for r in found)}): choose one with --pid")
    return found[0]


def _refuse_start_beside_vehicle() -> None:
    """--start would be a second full system on the vehicle: refused (the rule is
    running.vehicle_supervisors', shared with `check --start`)."""
    from .running import vehicle_supervisors

    vehicle = [str(rs.pid) for rs in vehicle_supervisors()]
    if vehicle:
        raise UsageError(f"{PROG} --live --start: refused: a vehicle supervisor runs (pid "
                         f"{', '.join(vehicle)}); audit it with --live (read-only), or "
                         f"stop it")


def cmd_report(a: argparse.Namespace) -> int:
    from . import audit, render
    from .running import terminal_progress

    fmt = a.format or ("json" if a.sign else "text")
    if a.sign and (fmt != "json" or not a.output):
        raise UsageError(f"{PROG} --sign: signs the JSON report written to a file: add "
                         f"--output FILE (and --format json, the default with --sign)")
    if a.start and not a.live:
        raise UsageError(f"{PROG}: --start goes with --live")
    if a.live and not a.start and (a.settle is not None or a.timeout is not None):
        # Before issue 25 `--live` always started a system; its --settle/--timeout only
        # mean that. Scripts written then keep working, told once what they ask for.
        print(f"{PROG}: --settle/--timeout are for a system of the audit's own: taken as "
              f"--live --start (say --start)", file=sys.stderr)
        a.start = True
    a.settle = 1.0 if a.settle is None else a.settle
    a.timeout = 180.0 if a.timeout is None else a.timeout
    if a.live and os.geteuid() != 0:
        raise UsageError(f"{PROG} --live: needs root (the workers' /proc, cgroups)")
    if not a.start:
        # Nothing is started: a Ctrl-C should end the audit (one line), not be recorded
        # for a supervisor that does not exist (the CLI installs the recorder first).
        from supervisor import signals

        signals.uninstall()
    if a.output and not os.path.isdir(os.path.dirname(os.path.abspath(a.output))):
        # Before the report is made (seconds; --live --start: minutes), not after.
        raise UsageError(f"{PROG}: --output {a.output}: no such directory "
                         f"{os.path.dirname(os.path.abspath(a.output))}")
    if a.sign:
        # The key is checked before the report is made (seconds; --live --start: minutes).
        from .sign import SignError, load_signing_key

        try:
            load_signing_key(a.sign)
        except SignError as e:
            raise UsageError(f"{PROG} --sign: {e}") from None
    progress = terminal_progress()
    running = None
    if a.live and not a.start:
        running = _pick(a.pid)
        progress(f"supervisor pid {running.pid}, {len(running.sandboxes)} sandboxes")
    elif a.start:
        _refuse_start_beside_vehicle()
    cfg = _load(a.config if (a.config or running is None) else running.config)
    report = audit(cfg, live=a.live, settle_s=a.settle, timeout_s=a.timeout,
                   running=running, progress=progress)
    out = render(report, fmt)
    if a.output:
        try:
            with open(a.output, "w", encoding="utf-8") as f:
                f.write(out)
        except OSError as e:
            raise UsageError(f"{PROG}: --output {a.output}: {e.strerror or e}") from None
    else:
        sys.stdout.write(out)
    if a.sign:
        from .sign import SignError, sign_file

        try:
            path, kid = sign_file(a.output, a.sign)
        except SignError as e:
            raise UsageError(f"{PROG} --sign: {e}") from None
        print(f"{PROG}: signed {a.output} -> {path} (key {kid})", file=sys.stderr)
    progress(f"done: {report['result']}, exit {report['exit_code']}")
    return int(report["exit_code"])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "diff":
            return cmd_diff(argv[1:])
        if argv and argv[0] == "verify":
            return cmd_verify(argv[1:])
        p = _parser()
        p.__class__ = _Parser
        return cmd_report(p.parse_args(argv))
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return int(Exit.CONFIG)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return int(Exit.ERROR)
    except Exception as e:   # a bug: one line that says where, exit 1
        where = traceback.extract_tb(e.__traceback__)[-1]
        print(f"{PROG}: internal error: {type(e).__name__}: {e} "
              f"({where.filename}:{where.lineno})", file=sys.stderr)
        return int(Exit.ERROR)
