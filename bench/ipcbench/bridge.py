"""``bridge``: supervisor.ipc ``Writer.loan()``/``publish`` and ``Reader.receive()``
(wake-up socket) on the native module when it is built; ``bridge-py``: the same on the
pure-Python path (``native=False``, the hot path before the native module: x86-64 only),
so one run compares before and after; ``bridge-poll`` spins on ``Reader.try_receive()``."""
from __future__ import annotations

import importlib
import os

import numpy as np

from .transport import ReceiverEnd, SenderEnd, Skip, Transport, now_ns, read_stamp, stamp


class BridgeTransport(Transport):
    key = "bridge"
    label = "trio-bridge"
    open_first = "sender"   # a Reader waits for its Writer to have attached
    module = "supervisor.ipc"
    poll = False
    native: bool | None = None     # None: the module's default (native when built)
    spin_us: int | None = None     # None: the Reader's default (SPIN_US: ipc/_burst.py)
    SLOTS = 8
    _count = 0

    def _api(self):
        m = importlib.import_module(self.module)
        return m.ChannelSpec, m.Channel, m.Writer, m.Reader

    def check(self):
        try:
            self._api()
        except (ImportError, AttributeError) as e:
            raise Skip(f"{self.module} not importable yet ({type(e).__name__}: {e})")
        if self.native is not None:
            try:
                importlib.import_module(self.module + "._atomics").select(self.native)
            except Exception as e:  # noqa: BLE001 - no such path on this machine/module
                raise Skip(f"{self.label}: {e}")

    def _kw(self) -> dict:
        return {} if self.native is None else {"native": self.native}

    def _reader_kw(self) -> dict:
        kw = self._kw()
        if self.spin_us is not None:
            kw["spin_us"] = self.spin_us
        return kw

    def setup(self, nbytes, run_id):
        super().setup(nbytes, run_id)
        ChannelSpec, Channel, _, _ = self._api()
        BridgeTransport._count += 1
        spec = ChannelSpec(name=f"bench_{os.getpid()}_{BridgeTransport._count}",
                           slot_size=nbytes, slot_count=self.SLOTS, dtype="uint8",
                           max_readers=1, max_leases=1)
        self.chan = Channel.create(spec)          # the parent holds the fds
        self.wh = self.chan.writer_handle()
        self.rh = self.chan.reader_handle(0)

    def teardown(self):
        chan, self.chan = getattr(self, "chan", None), None
        self.wh = self.rh = None
        for meth in ("close", "unlink"):
            f = getattr(chan, meth, None)
            if callable(f):
                try:
                    f()
                except Exception:  # noqa: BLE001 - best-effort cleanup
                    pass

    def open_sender(self):
        _, _, Writer, _ = self._api()
        w = Writer(self.wh, **self._kw())          # fds inherited through fork()
        nbytes = self.nbytes
        shape = (nbytes,)
        explicit_ts = [True]

        class S(SenderEnd):
            def send(self, seq, src, fill):
                with w.loan() as slot:
                    a = slot.array(shape, "uint8")
                    if fill:
                        np.copyto(a, src)
                    t = stamp(a, seq)
                    del a
                    if explicit_ts[0]:
                        try:
                            # Same instant as the payload stamp the others use.
                            slot.publish(publish_ts_ns=t)
                            return
                        except TypeError:
                            explicit_ts[0] = False
                    slot.publish()

            def close(self):
                f = getattr(w, "close", None)
                if callable(f):
                    f()
        return S()

    def open_receiver(self):
        _, _, _, Reader = self._api()
        r = Reader(self.rh, **self._reader_kw())
        poll = self.poll

        try_receive = getattr(r, "try_receive", None)

        def _rejection(e: Exception) -> bool:
            # Typed bridge rejections (Rejected subclasses carry .reason) and LeaseLost
            # are counted and skipped; anything else is a real failure.
            return hasattr(e, "reason") or type(e).__name__ == "LeaseLost"

        class R(ReceiverEnd):
            rejected = 0

            def recv(self, timeout_s):
                deadline = None
                while True:
                    try:
                        if poll:
                            msg = (try_receive() if try_receive is not None
                                   else r.receive(timeout=0))
                        else:
                            # A non-blocking take first, then the blocking wait: the
                            # same order as the iceoryx2 receiver (take(), then the
                            # Listener), so neither pays for a deadline it did not need.
                            msg = try_receive() if try_receive is not None else None
                            if msg is None:
                                msg = r.receive(timeout=max(timeout_s, 1e-3))
                    except TimeoutError:           # ChannelTimeout
                        msg = None
                    except Exception as e:  # noqa: BLE001
                        if not _rejection(e):
                            raise
                        self.rejected += 1
                        msg = None
                    if msg is not None:
                        try:
                            arr = msg.array
                        except Exception as e:  # noqa: BLE001
                            # The lease ran out before the view was taken (a reader
                            # descheduled past lease_ms under load; check() gave the
                            # lease back): counted and skipped, as at release.
                            if not _rejection(e):
                                raise
                            self.rejected += 1
                            continue
                        t = now_ns()
                        ts, seq = read_stamp(arr)
                        n = arr.nbytes
                        del arr
                        try:
                            msg.release()
                        except Exception as e:  # noqa: BLE001
                            if not _rejection(e):
                                raise
                            self.rejected += 1     # overwritten while held: not valid
                            continue
                        return ts, seq, t, n
                    if not poll:
                        return None
                    if deadline is None:
                        deadline = now_ns() + int(timeout_s * 1e9)
                    elif now_ns() > deadline:
                        return None

            def close(self):
                f = getattr(r, "close", None)
                if callable(f):
                    f()
        return R()


class BridgePollTransport(BridgeTransport):
    key = "bridge-poll"
    label = "trio-bridge (busy-poll)"
    poll = True
    blocking = False
    note = "receiver spins on Reader.try_receive()"


class BridgeSpinTransport(BridgeTransport):
    """The reader's spin off (spin_us=0): the comparison with the default, which spins
    for up to SPIN_US in a burst (_burst.py, on by default since round 8)."""
    key = "bridge-nospin"
    label = "trio-bridge (no spin)"
    spin_us = 0
    note = "the reader sleeps as soon as it finds nothing (spin_us=0)"


class BridgePyTransport(BridgeTransport):
    key = "bridge-py"
    label = "trio-bridge (pure Py)"
    native = False
    note = "the pure-Python hot path (before the native module), same API"
