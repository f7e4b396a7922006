"""Hostile probe attacks on the network rule (`network = false`: nothing outside the
sandbox), kept apart from attacks.py so they can grow on their own; merged into
attacks.ATTACKS.

``--attack-arg`` is a host directory bound into the worker's sandbox
(``extra_ro_binds``) holding the host's sockets: ``stream.sock`` (listening) and
``dgram.sock`` (bound). A call that seccomp kills prints nothing: the supervisor's
exit event (SIGSYS, seccomp) is the evidence. An attack prints ``ATTACK-STEP name``
just before the call it expects to be the fatal one, so a test can tell which call
killed it.
"""
from __future__ import annotations

import errno
import os
import socket
import struct
from typing import Callable

from supervisor.worker import WorkerContext

_AF_VSOCK = getattr(socket, "AF_VSOCK", 40)
_VMADDR_CID_HOST = 2
_NETLINK_ROUTE = 0
_RTM_GETLINK, _NLM_F_REQUEST, _NLM_F_DUMP = 18, 0x1, 0x300


def _arg() -> str:
    from . import attacks

    return attacks.ARG


def _err(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno:
        return errno.errorcode.get(e.errno, str(e.errno))
    return f"{type(e).__name__}: {e}"


def _step(name: str) -> None:
    print(f"ATTACK-STEP {name}", flush=True)


def unix_stream_host(ctx: WorkerContext) -> dict:
    """Connect a stream socket to a host service socket in an extra_ro_binds dir."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _step("connect")
        s.connect(os.path.join(_arg(), "stream.sock"))
        s.sendall(b"hello from the sandbox")
    except OSError as e:
        return {"denied": True, "error": _err(e)}
    finally:
        s.close()
    return {"denied": False}


def unix_dgram_host(ctx: WorkerContext) -> dict:
    """A datagram to a host socket: connect then send, as a logging client does."""
    _step("socket")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        _step("connect")
        s.connect(os.path.join(_arg(), "dgram.sock"))
        s.send(b"hello from the sandbox")
    except OSError as e:
        return {"denied": True, "error": _err(e)}
    finally:
        s.close()
    return {"denied": False}


def vsock(ctx: WorkerContext) -> dict:
    """AF_VSOCK is not network-namespaced: it reaches the hypervisor or host."""
    _step("socket")
    try:
        s = socket.socket(_AF_VSOCK, socket.SOCK_STREAM)
    except OSError as e:
        return {"denied": True, "error": _err(e)}
    try:
        s.settimeout(1.0)
        s.connect((_VMADDR_CID_HOST, 9))
        return {"denied": False, "connect": "ok"}
    except OSError as e:
        return {"denied": False, "socket": "created", "connect": _err(e)}
    finally:
        s.close()


def netlink(ctx: WorkerContext) -> dict:
    """Ask the kernel for the interface list over rtnetlink."""
    _step("socket")
    try:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_ROUTE)
    except OSError as e:
        return {"denied": True, "error": _err(e)}
    try:
        s.settimeout(1.0)
        body = struct.pack("Bxxxii", socket.AF_UNSPEC, 0, 0)       # struct ifinfomsg
        hdr = struct.pack("=IHHII", 16 + len(body), _RTM_GETLINK,
                          _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
        s.send(hdr + body)
        return {"denied": False, "answered": len(s.recv(65536))}
    except OSError as e:
        return {"denied": False, "socket": "created", "error": _err(e)}
    finally:
        s.close()


def inet(ctx: WorkerContext) -> dict:
    """An IP socket at all (the private network namespace would only have `lo`)."""
    _step("socket")
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
    except OSError as e:
        return {"denied": True, "error": _err(e)}
    return {"denied": False}


def sendto_address(ctx: WorkerContext) -> dict:
    """sendto with an address, from a socket seccomp lets exist (a stream pair)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _step("sendto")
        a.sendto(b"x", os.path.join(_arg(), "dgram.sock"))
    except OSError as e:
        return {"denied": True, "error": _err(e)}
    finally:
        a.close(), b.close()
    return {"denied": False}


def sendmsg_address(ctx: WorkerContext) -> dict:
    """sendmsg with an address: seccomp cannot read the msghdr, so every kind of socket
    the sandbox may hold is tried. Stream and seqpacket sockets must refuse or ignore
    the address (the kernel's rule, checked here: the host socket receives nothing); a
    socket kind that would honour it (datagram, raw) must not exist: killed at
    socket()/socketpair()."""
    target = os.path.join(_arg(), "dgram.sock")
    res: dict = {}
    _step("sendmsg")              # a started control worker dies here: no sendmsg at all
    for name, kind in (("stream", socket.SOCK_STREAM), ("seqpacket", socket.SOCK_SEQPACKET)):
        s = socket.socket(socket.AF_UNIX, kind)          # unconnected
        a, b = socket.socketpair(socket.AF_UNIX, kind)   # connected to each other
        for how, sock in (("unconnected", s), ("pair", a)):
            try:
                res[f"{name}_{how}"] = f"sent:{sock.sendmsg([b'x'], [], 0, target)}"
            except OSError as e:
                res[f"{name}_{how}"] = _err(e)
        s.close(), a.close(), b.close()
    print("ATTACK-STEP connected-kinds " + " ".join(f"{k}={v}" for k, v in res.items()),
          flush=True)
    _step("socketpair-dgram")
    try:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        a.sendmsg([b"x"], [], 0, target)
    except OSError as e:
        return {"denied": True, **res, "dgram": _err(e)}
    return {"denied": False, **res}


def socketpair_ok(ctx: WorkerContext) -> dict:
    """Not an attack: what channels use must keep working (stream and seqpacket pairs,
    fds passed over them)."""
    res: dict = {}
    for name, kind in (("stream", socket.SOCK_STREAM), ("seqpacket", socket.SOCK_SEQPACKET)):
        a, b = socket.socketpair(socket.AF_UNIX, kind)
        r, w = os.pipe()
        socket.send_fds(a, [b"ping"], [w])
        msg, fds, _, _ = socket.recv_fds(b, 16, 1)
        res[name] = msg.decode() + f"+{len(fds)}fd"
        for fd in (r, w, *fds):
            os.close(fd)
        a.close(), b.close()
    return {"denied": None, **res}


def abstract_unix(ctx: WorkerContext) -> dict:
    """Connect to an abstract name the host listens on (ARG's basename, made
    abstract): separate network namespace, Landlock scope, and connect kills."""
    name = "\0trio-net-" + os.path.basename(_arg().rstrip("/"))
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _step("connect")
        s.connect(name)
    except OSError as e:
        return {"denied": True, "error": _err(e)}
    finally:
        s.close()
    return {"denied": False}


ATTACKS: dict[str, Callable[[WorkerContext], dict]] = {
    f.__name__: f for f in (unix_stream_host, unix_dgram_host, vsock, netlink, inet,
                            sendto_address, sendmsg_address, socketpair_ok, abstract_unix)
}
