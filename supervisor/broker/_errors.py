"""The broker's refusals, one class per `ErrorCode` of schemas/broker.capnp.

The broker raises them while judging a request, logs one `broker_refused` line and
answers the client with the code and the one-line reason; the client raises the same
class again from the reply, so a caller catches by type (like ipc/errors.py). `code` is
also the key the broker counts refusals under."""
from __future__ import annotations


class BrokerError(Exception):
    """A request the broker did not carry out. str() is one line."""

    code = "failed"
    rid = 0          # the request it answers, where its id could be read (0: not)

    def __init__(self, reason: str, errno: int = 0) -> None:
        # One line whatever the cause said: a reason may quote hostile bytes.
        self.reason = " ".join(str(reason).split())[:500]
        self.errno = errno if 0 <= errno < 4096 else 0   # the kernel's, for `failed`
        super().__init__(self.reason)


class Malformed(BrokerError):
    """Not a message of the schema, or a field outside its bounds."""

    code = "malformed"


class TooLarge(BrokerError):
    """Over MAX_MESSAGE bytes (the datagram was cut: nothing of it is used)."""

    code = "tooLarge"


class BadFds(BrokerError):
    """fds where the request takes none, too many, or of the wrong kind."""

    code = "badFds"


class UnknownWorker(BrokerError):
    """A worker the broker's own config does not name."""

    code = "unknownWorker"


class NotOurs(BrokerError):
    """A pid or incarnation the broker did not start (or has reaped)."""

    code = "notOurs"


class Refused(BrokerError):
    """Against the broker's config: uid 0, a bind it does not name, a reused incarnation."""

    code = "refused"


class Failed(BrokerError):
    """Allowed, but the kernel or bwrap said no (the reason says which)."""

    code = "failed"


ERRORS: dict[str, type[BrokerError]] = {
    c.code: c for c in (Malformed, TooLarge, BadFds, UnknownWorker, NotOurs, Refused, Failed)}
