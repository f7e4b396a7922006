"""``supervisor`` command line: run, check, units, clear-fail-safe, audit, record, replay."""
from __future__ import annotations

# First of all: a Ctrl-C or SIGTERM from now on is recorded, never a traceback.
from supervisor import signals as _signals

_signals.install()

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from supervisor.config import ConfigError, load  # noqa: E402
from supervisor.events import EventLog  # noqa: E402
from supervisor.exits import Exit  # noqa: E402


def _internal_error(prog: str, e: BaseException) -> int:
    """A bug, not a config mistake: one line that says what and where, exit 1 (never a
    traceback on the operator's terminal, where a config mistake's line would drown)."""
    import traceback

    from supervisor.protocol import printable

    tb = traceback.extract_tb(e.__traceback__)
    where = f" ({tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    print(printable(f"{prog}: internal error: {type(e).__name__}: {e}{where}"), file=sys.stderr)
    return int(Exit.ERROR)


def _config(path: str | None):
    try:
        return load(path)
    except ConfigError as e:
        print(f"supervisor: config error:\n{e}", file=sys.stderr)
        raise SystemExit(int(Exit.CONFIG))


def cmd_check(args: argparse.Namespace) -> int:
    """Everything that can be known before start: the file (`load`), this machine
    (`check_runtime`), then static admission. One line per problem (``FILE: KEY:
    REASON``) on stderr, never a traceback. Exit 2 for config problems, 3 when
    admission refuses a worker (as ``run`` would stop there first), else 0."""
    from supervisor.config import ConfigFileError, check_runtime
    from supervisor.lifecycle import Supervisor

    try:
        try:
            cfg = load(args.config)
        except ConfigFileError as e:
            for p in e.problems:
                print(p, file=sys.stderr)
            n = len(e.problems)
            print(f"supervisor check: {n} config problem{'' if n == 1 else 's'}",
                  file=sys.stderr)
            return int(Exit.CONFIG)
        except ConfigError as e:
            print(f"supervisor check: config error: {e}", file=sys.stderr)
            return int(Exit.CONFIG)

        problems = check_runtime(cfg)
        for p in problems:
            print(p, file=sys.stderr)
        # Admission still runs: a refusal is reported (and wins, exit 3) alongside.
        with open("/dev/null", "w") as devnull:
            log = EventLog(stream=devnull, keep=True)
            refused = Supervisor(cfg, log=log).admit()
    except Exception as e:   # a bug in a check
        return _internal_error("supervisor check", e)
    for e in log.of("refused"):
        print(e["reason"], file=sys.stderr)
    if refused:
        print(f"supervisor check: refused {len(refused)} worker(s): {', '.join(refused)}",
              file=sys.stderr)
        return int(Exit.REFUSED)
    if problems:
        n = len(problems)
        print(f"supervisor check: {n} config problem{'' if n == 1 else 's'}", file=sys.stderr)
        return int(Exit.CONFIG)
    from supervisor.model.trust import verify_models

    for t in verify_models(cfg)[0]:
        print(f"supervisor check: {t.line()}")
    print(f"supervisor check: {cfg.source}: {len(cfg.workers)} workers, "
          f"{len(cfg.channels)} channels: all admitted")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    import trio

    from supervisor.lifecycle import Supervisor

    cfg = _config(args.config)
    log = EventLog(fmt=args.log_format or cfg.supervisor.log_format, keep=False)
    sup = Supervisor(cfg, log=log, sandboxed=not args.no_sandbox, grace_s=args.grace,
                     # stdout is the status line; workers' output arrives as events
                     status_out=None if args.quiet else sys.stdout)
    try:
        return int(trio.run(sup.run))
    except Exception as e:   # a bug (config mistakes are refused before start, exit 2)
        return _internal_error("supervisor run", e)


def cmd_clear_fail_safe(args: argparse.Namespace) -> int:
    """The operator's acknowledgement: the control domain may start again."""
    from supervisor.lifecycle import FailSafeLatch

    latch = FailSafeLatch.for_config(_config(args.config))
    info = latch.read()
    if info is None:
        print(f"supervisor: no fail-safe latched ({latch.path})")
        return 0
    latch.clear()
    print(f"supervisor: cleared the fail-safe latched at {info.get('time', '?')}: "
          f"{info.get('reason', '?')}")
    return 0


def cmd_units(args: argparse.Namespace) -> int:
    from supervisor.config import VEHICLE
    from supervisor.units import write_units

    cfg = _config(args.config)
    if cfg.supervisor.mode != VEHICLE:
        print(f"supervisor units: {cfg.source}: supervisor.mode: a unit runs the vehicle; "
              f"this is a {cfg.supervisor.mode!r} config (set mode = \"{VEHICLE}\")",
              file=sys.stderr)
        return int(Exit.CONFIG)
    for path in write_units(cfg, Path(args.out), config_path=args.config,
                            python=args.python, prefix=args.prefix):
        print(path)
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    """What each worker can and cannot do: from the config, or (--live) from the running
    system's evidence. Exit codes: see supervisor/audit/__init__.py (0 matches or config
    report, 6 differences found, else the supervisor's own codes)."""
    import os

    from supervisor.audit import audit, render

    cfg = _config(args.config)
    if args.live and os.geteuid() != 0:
        print("supervisor audit --live: needs root, as `supervisor run` does (host users, "
              "cgroups, the workers' /proc)", file=sys.stderr)
        return int(Exit.ERROR)
    try:
        report = audit(cfg, live=args.live, settle_s=args.settle, timeout_s=args.timeout)
        out = render(report, args.format)
    except Exception as e:   # as `check` does
        return _internal_error("supervisor audit", e)
    sys.stdout.write(out)
    return int(report["exit_code"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="supervisor", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "check", "units", "clear-fail-safe", "audit", "record", "replay"):
        s = sub.add_parser(name)
        s.add_argument("--config", "-c", default=None,
                       help="TOML config (default: the embedded one)")
        if name == "run":
            s.add_argument("--no-sandbox", action="store_true",
                           help="development only: run workers without bubblewrap")
            s.add_argument("--log-format", choices=("json", "text"), default=None)
            s.add_argument("--grace", type=float, default=3.0,
                           help="seconds between SIGTERM and SIGKILL on shutdown")
            s.add_argument("--quiet", action="store_true",
                           help="no live status line on stdout (events still go to stderr)")
        if name == "units":
            s.add_argument("--out", default="systemd")
            s.add_argument("--python", default=None,
                           help="the install target's interpreter (default: PREFIX/bin/python3)")
            s.add_argument("--prefix", default=None,
                           help="the install target's venv (default: /opt/trio-supervisor)")
        if name == "audit":
            s.add_argument("--format", choices=("text", "markdown", "json"), default="text")
            s.add_argument("--live", action="store_true",
                           help="start the configured system and audit its evidence")
            s.add_argument("--settle", type=float, default=1.0,
                           help="--live: seconds to wait after all workers are READY")
            s.add_argument("--timeout", type=float, default=180.0,
                           help="--live: seconds to wait for all workers to be READY")
        if name in ("record", "replay"):   # developer replay: supervisor/replay/
            from supervisor.replay.commands import add_record_args, add_replay_args

            (add_record_args if name == "record" else add_replay_args)(s)
    args = p.parse_args(argv)
    if args.cmd in ("record", "replay"):
        from supervisor.replay import commands

        return (commands.cmd_record if args.cmd == "record" else commands.cmd_replay)(args)
    return {"run": cmd_run, "check": cmd_check, "units": cmd_units,
            "clear-fail-safe": cmd_clear_fail_safe, "audit": cmd_audit}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
