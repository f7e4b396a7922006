"""``supervisor`` command line: run, check, units."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from supervisor.config import ConfigError, load
from supervisor.events import EventLog
from supervisor.lifecycle import Exit


def _config(path: str | None):
    try:
        return load(path)
    except ConfigError as e:
        print(f"supervisor: config error:\n{e}", file=sys.stderr)
        raise SystemExit(int(Exit.CONFIG))


def cmd_check(args: argparse.Namespace) -> int:
    from supervisor.lifecycle import Supervisor

    cfg = _config(args.config)
    log = EventLog(stream=open("/dev/null", "w"), keep=True)
    refused = Supervisor(cfg, log=log).admit()
    for e in log.of("refused"):
        print(e["reason"], file=sys.stderr)
    if refused:
        print(f"supervisor check: refused {len(refused)} worker(s): {', '.join(refused)}",
              file=sys.stderr)
        return int(Exit.REFUSED)
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
    return int(trio.run(sup.run))


def cmd_units(args: argparse.Namespace) -> int:
    from supervisor.units import write_units

    cfg = _config(args.config)
    for path in write_units(cfg, Path(args.out), config_path=args.config):
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="supervisor", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("run", "check", "units"):
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
    args = p.parse_args(argv)
    return {"run": cmd_run, "check": cmd_check, "units": cmd_units}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
