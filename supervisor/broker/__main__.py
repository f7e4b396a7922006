"""``python -m supervisor.broker --config X --state-dir Y (--socket-fd N | --listen-fd N
--peer-user U)``: the privileged broker (supervisor/broker/_server.py).

--socket-fd: one end of a socketpair its parent made (a developer's `supervisor run`,
the tests). --listen-fd: a listening SOCK_SEQPACKET socket systemd passes
(trio-broker.socket); the broker accepts one connection, and only from --peer-user's
uid (SO_PEERCRED), refusing any other peer in one line.

Exit codes: 0 the client closed (every sandbox stopped), 2 config or state dir refused,
9 another supervisor or broker holds the state dir (standalone only).
"""
from __future__ import annotations

import argparse
import os
import pwd
import socket
import struct
import sys

from supervisor.events import EventLog


def _accept(listen_fd: int, peer_user: str, log: EventLog) -> socket.socket:
    """The one client: the first connection from `peer_user`'s uid."""
    uid = pwd.getpwnam(peer_user).pw_uid
    lsock = socket.socket(fileno=listen_fd)
    while True:
        conn, _ = lsock.accept()
        pid, puid, _gid = struct.unpack("3i", conn.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if puid == uid:
            lsock.close()
            return conn
        log.emit("broker_refused", source="broker", request="connect", code="refused",
                 reason=f"peer pid {pid} uid {puid} is not {peer_user} ({uid})")
        conn.close()


def _no_inheritance(keep: set[int]) -> None:
    """Every fd we were handed besides stdio and our socket (the run's state-dir lock:
    statelock.held_fds) is ours alone: nothing we start may keep it."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.set_inheritable(fd, False)
            except OSError:
                pass                       # the listing's own fd, closed meanwhile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m supervisor.broker")
    p.add_argument("--config", default=None)
    p.add_argument("--state-dir", required=True)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--socket-fd", type=int)
    g.add_argument("--listen-fd", type=int)
    p.add_argument("--peer-user", default="trio-supervisor")
    args = p.parse_args(argv)
    _no_inheritance({fd for fd in (args.socket_fd, args.listen_fd) if fd is not None})
    # Written, never kept: root's memory must not grow with what a compromised proper
    # makes it refuse (red team 11 row 11: 563 B an event, for good). Nothing reads them.
    log = EventLog(keep=False)
    from supervisor.config import ConfigError, load

    from ._checks import StateDir
    from ._errors import BrokerError
    from ._server import Broker

    try:
        cfg = load(args.config)
    except ConfigError as e:
        print(f"broker: config: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    try:
        state = StateDir.open(args.state_dir)
    except BrokerError as e:
        print(f"broker: {e}", file=sys.stderr)
        return 2
    from supervisor.startcheck import machine_problems

    # The sandbox host: a machine that refuses every sandbox (a container) is said
    # here, once, before any start (review 6 finding 11: through the broker the
    # proper's preflight skipped it, and the car latched its fail-safe).
    problems = machine_problems(cfg)
    if problems:
        for line in problems:
            print(f"broker: machine: {line}", file=sys.stderr)
        from supervisor.exits import Exit

        return int(Exit.START_FAILED)
    if args.listen_fd is not None:
        # Standalone (systemd's socket): the one process of this state dir, so the one
        # to hold its lock (statelock.py). Spawned by `run --privsep`, that run holds it.
        from supervisor import statelock
        from supervisor.exits import Exit

        try:
            statelock.hold(args.state_dir)
        except statelock.Held as e:
            print(f"broker: {e}", file=sys.stderr)
            return int(Exit.LOCKED)
        except OSError as e:
            print(f"broker: state dir lock: {e.strerror or e}", file=sys.stderr)
            return 2
    try:
        if args.socket_fd is not None:
            sock = socket.socket(fileno=args.socket_fd)
        else:
            sock = _accept(args.listen_fd, args.peer_user, log)
    except KeyError:
        print(f"broker: no user {args.peer_user!r} for the peer", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"broker: socket fd {args.socket_fd if args.listen_fd is None else args.listen_fd}:"
              f" {e.strerror or e}", file=sys.stderr)
        return 2
    if sock.type != socket.SOCK_SEQPACKET or sock.family != socket.AF_UNIX:
        print("broker: the socket must be AF_UNIX SOCK_SEQPACKET", file=sys.stderr)
        return 2
    os.set_blocking(sock.fileno(), True)
    broker = Broker(cfg, state, sock, log)
    broker.open_cgroups()
    return broker.serve()


if __name__ == "__main__":
    sys.exit(main())
