"""``supervisor`` command line: run, check, units, clear-fail-safe, audit, record, replay, log."""
from __future__ import annotations

import os
import sys


def _std_fds() -> None:
    """fds 0-2 exist and have Python streams: a unit or a script may start us with one
    closed (`2>&-`), and the event log's first write ended the run (AttributeError on
    a None stderr), or a file opened later landed on fd 2 and became a child's stderr."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)            # the lowest free fd: this one
    if sys.stdout is None:
        sys.stdout = open(1, "w", buffering=1, closefd=False)
    if sys.stderr is None:
        sys.stderr = open(2, "w", buffering=1, closefd=False)


def _cwd() -> None:
    """A current directory that exists. From one that was removed (a shell left in the
    old install's directory after a reinstall, a CI workspace cleaned under it) every
    command died at `import capnp` (kj's getcwd(), SIGABRT, a C++ stack). Relative paths
    meant nothing there anyway; absolute ones still work from /."""
    try:
        os.getcwd()
    except FileNotFoundError:
        os.chdir("/")
        os.environ["PWD"] = "/"


# First of all, before anything opens a descriptor (the signal pipe took a closed fd 2,
# and stderr then wrote into it), and before anything imports capnp.
_std_fds()
_cwd()

# Then: a Ctrl-C or SIGTERM from now on is recorded, never a traceback.
from supervisor import fdlimit  # noqa: E402
from supervisor import signals as _signals  # noqa: E402

_signals.install()

import argparse  # noqa: E402
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
    admission refuses a worker (as ``run`` would stop there first), else 0. ``--start``
    beside a running vehicle supervisor is refused first, exit 2 (a second pipeline:
    its own cameras, a SCHED_FIFO controlsd, modeld's CPU; the rule is audit's)."""
    from supervisor.config import ConfigFileError, check_runtime
    from supervisor.lifecycle import Supervisor

    if args.start:
        from supervisor.audit.running import vehicle_supervisors

        vehicle = ", ".join(str(rs.pid) for rs in vehicle_supervisors())
        if vehicle:
            print(f"supervisor check --start: refused: a vehicle supervisor runs (pid "
                  f"{vehicle}): stop it first (systemctl stop trio-supervisor), or check "
                  f"without --start", file=sys.stderr)
            return int(Exit.CONFIG)
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
    if _signals.stop_pending():
        # `check --start` keeps the stop handling: a SIGTERM during admission cut it
        # short, and what it left unjudged is no refusal (review 6 finding 8: 'refused
        # 4 worker(s)', exit 3, for code nobody judged).
        print("supervisor check: stopped by a signal before the check ended",
              file=sys.stderr)
        return int(Exit.START_FAILED)
    # A module the config check already named as missing is refused by admission too
    # (fail closed: code no one has read); the config line says it, once.
    unknown = {n for n in refused
               if any(p.key == f"workers.{n}.module" and p.reason.startswith("no module named")
                      for p in problems)}
    refused = [n for n in refused if n not in unknown]
    for e in log.of("refused"):
        if e.get("worker") not in unknown:
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
    bad = _check_sandboxes(cfg)
    if bad:
        print(f"supervisor check: {bad} worker sandbox(es) cannot start", file=sys.stderr)
        return int(Exit.START_FAILED)
    print(f"supervisor check: {cfg.source}: {len(cfg.workers)} workers, "
          f"{len(cfg.channels)} channels: all admitted")
    if args.start:
        return _check_start(cfg)       # says the limits line itself, from the run
    line = _limits_line()
    if line:
        print(line)
    return 0


def _limits_line() -> str | None:
    """What this machine's cgroups cannot enforce, as `run` will find it (a tree made
    and removed here: root only; None when everything is enforced or not root). A check
    that said "all admitted" and nothing more left the operator to find out at run."""
    if os.geteuid() != 0:
        return None
    from supervisor.sandbox.cgroups import CgroupTree, CgroupUnavailable, limits_off

    try:
        with CgroupTree.create(partial=True) as tree:
            off = limits_off(tree)
    except (CgroupUnavailable, OSError) as e:
        off = limits_off(None, str(e))
    if off is None:
        return None
    from supervisor.startcheck import limits_text

    return f"supervisor check: {limits_text(off.limits, off.reason)}"


def _check_sandboxes(cfg) -> int:
    """Build each distinct sandbox as run would and start the interpreter in it (where
    sandboxes can run: root and bubblewrap). Returns how many workers' cannot start."""
    import os

    if os.geteuid() != 0:
        # (as another user, run and check --start still start sandboxes: user namespaces)
        print("supervisor check: sandboxes not rehearsed (root's check only; check --start "
              "starts them as this user)")
        return 0
    from supervisor.sandbox.launch import rehearse_config
    from supervisor.startcheck import machine_problems

    # A machine (a container) that refuses every sandbox, or one without bwrap: one
    # line with what to do, before a rehearsal that would fail once per worker with
    # the kernel's words.
    machine = machine_problems(cfg)
    for line in machine:
        print(f"supervisor check: machine: {line}", file=sys.stderr)
    if machine:
        return len(cfg.workers)
    bad = 0
    try:
        for c in rehearse_config(cfg):
            print(f"supervisor check: {c.line()}", file=sys.stdout if c.ok else sys.stderr)
            bad += not c.ok
    except Exception as e:      # a rehearsal that could not even be tried: one line
        print(f"supervisor check: the sandbox rehearsal failed: {type(e).__name__}: {e}",
              file=sys.stderr)
        return max(bad, 1)
    return bad


def _check_start(cfg) -> int:
    """`check --start`: every worker started as run starts it, READY awaited, stopped
    (supervisor/startcheck.py); one line per worker."""
    from supervisor.startcheck import start_check

    progress = sys.stderr if sys.stderr.isatty() else None
    code, lines = start_check(cfg, progress=progress)
    for line in lines:
        print(f"supervisor check --start: {line}",
              file=sys.stdout if code == Exit.SHUTDOWN else sys.stderr)
    if code == Exit.SHUTDOWN:
        print(f"supervisor check --start: {cfg.source}: all {len(cfg.workers)} workers READY")
    return int(code)


def cmd_run(args: argparse.Namespace) -> int:
    import trio

    from supervisor.lifecycle import Supervisor

    from supervisor.events import LEVEL_NAMES

    cfg = _config(args.config)
    # One supervisor per state dir, held before anything else is touched (statelock.py;
    # under --broker the state dir is the broker's to hold).
    from supervisor.statelock import hold_for_run

    refusal = None if args.broker else hold_for_run(cfg)
    if refusal is not None:
        print(refusal.line, file=sys.stderr)
        return int(refusal.code)
    from supervisor.sandbox import sched

    sched.rank_last()            # its death ends every sandbox unsaid: the OOM killer's last
    log = EventLog(fmt=args.log_format or cfg.supervisor.log_format, keep=False,
                   min_level=LEVEL_NAMES[args.log_level])
    sup = Supervisor(cfg, log=log, sandboxed=not args.no_sandbox, grace_s=args.grace,
                     # stdout is the status line; workers' output arrives as events
                     status_out=None if args.quiet else sys.stdout)
    split = None
    if args.privsep or args.broker:
        # The supervisor proper unprivileged, the broker doing what needs root
        # (docs/broker.md). Set up before anything reads a worker's output.
        from supervisor.lifecycle import BrokerLauncher, PrivsepError, connect_broker, start_privsep

        if args.no_sandbox:
            print("supervisor run: --privsep/--broker start sandboxes; not with --no-sandbox",
                  file=sys.stderr)
            return int(Exit.CONFIG)
        if args.privsep:
            from supervisor.startcheck import machine_problems

            # As the direct run's preflight does (the broker says the same at its own
            # start, for the split units): nothing started, nothing latched.
            problems = machine_problems(cfg)
            for line in problems:
                print(f"supervisor run: machine: {line}", file=sys.stderr)
            if problems:
                return int(Exit.START_FAILED)
        try:
            split = (connect_broker(cfg, args.broker) if args.broker
                     else start_privsep(cfg, args.config, before_drop=sup.judge_before_start))
        except PrivsepError as e:
            print(f"supervisor run: {e}", file=sys.stderr)
            return int(Exit.ERROR)
        sup.launcher, sup.latch = BrokerLauncher(split.client), split.latch
        st = split.status
        log.emit("privsep", broker=args.broker or "spawned", uid=int(st["Uid"].split()[0]),
                 gid=int(st["Gid"].split()[0]), cap_eff=st["CapEff"], cap_bnd=st["CapBnd"],
                 no_new_privs=st.get("NoNewPrivs") == "1")
    try:
        return int(trio.run(sup.run))
    except Exception as e:   # a bug (config mistakes are refused before start, exit 2)
        return _internal_error("supervisor run", e)
    finally:
        if split is not None:
            split.close()


def cmd_clear_fail_safe(args: argparse.Namespace) -> int:
    """The operator's acknowledgement: the control domain may start again."""
    from supervisor.lifecycle import FailSafeLatch

    latch = FailSafeLatch.for_config(_config(args.config))
    try:
        info = latch.read()
        if info is None:
            print(f"supervisor: no fail-safe latched ({latch.path})")
            return 0
        latch.clear()
    except OSError as e:
        # Not root, a read-only state dir: the latch stays, said in one line (it was a
        # 16-line traceback, exit 1: review 8 finding 7).
        print(f"supervisor clear-fail-safe: cannot clear {latch.path}: "
              f"{e.strerror or e}; the fail-safe stays latched (run it as the "
              f"supervisor's user, root on the vehicle)", file=sys.stderr)
        return int(Exit.CONFIG)
    print(f"supervisor: cleared the fail-safe latched at {info.get('time', '?')}: "
          f"{info.get('reason', '?')}")
    return 0


def cmd_units(args: argparse.Namespace) -> int:
    from supervisor.config import VEHICLE
    from supervisor.units import write_split_units, write_units

    cfg = _config(args.config)
    if cfg.supervisor.mode != VEHICLE:
        print(f"supervisor units: {cfg.source}: supervisor.mode: a unit runs the vehicle; "
              f"this is a {cfg.supervisor.mode!r} config (set mode = \"{VEHICLE}\")",
              file=sys.stderr)
        return int(Exit.CONFIG)
    # The one root unit of today and the split of issue 27 (trio-broker.socket,
    # trio-broker.service, trio-supervisor-proper.service: `run --broker`); the
    # operator enables one or the other (docs/broker.md, docs/vehicle.md).
    from supervisor.outdir import OutDirError
    from supervisor.units import hidden_from_units

    kw = dict(config_path=args.config, python=args.python, prefix=args.prefix)
    if (why := hidden_from_units(cfg, **kw)) is not None:
        print(f"supervisor units: {why}", file=sys.stderr)
        return int(Exit.CONFIG)
    try:
        paths = [*write_units(cfg, Path(args.out), **kw),
                 *write_split_units(cfg, Path(args.out), **kw)]
    except OutDirError as e:             # another user's OUT: one line, nothing written
        print(f"supervisor units: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"supervisor units: {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "audit":     # its own subcommands (diff, verify): audit/command.py
        from supervisor.audit.command import main as audit_main

        return audit_main(argv[1:])
    from supervisor.replay.commands import UsageParser

    # A usage error under --format json is one JSON document too (gate 9 finding 3).
    p = UsageParser(prog="supervisor", description=__doc__, argv=argv)
    sub = p.add_subparsers(dest="cmd", required=True)
    from supervisor.replay.commands import SUBCOMMANDS as REPLAY   # record, replay, log

    sub.add_parser("audit", help="what each worker can and cannot do (supervisor audit -h)")
    for name in ("run", "check", "units", "clear-fail-safe", *REPLAY):
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
            g = s.add_mutually_exclusive_group()
            g.add_argument("--privsep", action="store_true",
                           help="as root: start the privileged broker, then run as an "
                           "unprivileged user with no capabilities (docs/broker.md)")
            g.add_argument("--broker", metavar="SOCKET", default=None,
                           help="use the running broker listening on SOCKET "
                           "(trio-broker.socket); this process must not be root")
            s.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                           default="info", help="the least level of event written to stderr "
                           "(every event is kept in the journal's priority either way)")
        if name == "check":
            s.add_argument("--start", action="store_true",
                           help="also start every worker as run would, await READY, stop")
        if name == "units":
            s.add_argument("--out", default="systemd")
            s.add_argument("--python", default=None,
                           help="the install target's interpreter (default: PREFIX/bin/python3)")
            s.add_argument("--prefix", default=None,
                           help="the install target's venv (default: /opt/trio-supervisor)")
        if name in REPLAY:                 # developer replay: supervisor/replay/
            REPLAY[name][0](s)
    args = p.parse_args(argv)
    # Before any config is judged: check_runtime names a limit still too low for it.
    fdlimit.raise_soft_limit()
    if args.cmd in REPLAY:
        return REPLAY[args.cmd][1](args)
    cmd = {"run": cmd_run, "check": cmd_check, "units": cmd_units,
           "clear-fail-safe": cmd_clear_fail_safe}[args.cmd]
    if args.cmd == "run" or (args.cmd == "check" and args.start):
        return cmd(args)
    # Nothing is started: a stop signal ends it at once (Ctrl-C in one line), not
    # recorded for a supervisor that does not exist (check ignored Ctrl-C and SIGHUP).
    _signals.uninstall()
    try:
        return cmd(args)
    except KeyboardInterrupt:
        print(f"supervisor {args.cmd}: interrupted", file=sys.stderr)
        return int(Exit.ERROR)


if __name__ == "__main__":
    sys.exit(main())
