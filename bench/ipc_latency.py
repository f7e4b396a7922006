#!/usr/bin/env python3
"""One-way latency and throughput of process-to-process tensor transports.

Compares, in one run and on the same machine, the trio-bridge (``supervisor.ipc``)
with three peers:

* ``pipe``      multiprocessing.Pipe, numpy array pickled by ``Connection.send``
* ``zmq``       pyzmq PUSH/PULL over ipc:// in /tmp, ``send(arr, copy=True)``,
                receiver ``np.frombuffer``
* ``iox2``      iceoryx2 publish-subscribe, loaned ``Slice[c_uint8]`` samples
                (zero-copy), receiver blocks on an iceoryx2 event Listener
* ``iox2-poll`` the same, receiver busy-polls ``Subscriber.receive()`` (burns a core)
* ``bridge``    supervisor.ipc Writer.loan()/publish + Reader.receive() (eventfd)

Opt-in extras: ``iox2-waitset`` (receiver blocks in an iceoryx2 WaitSet instead of
on the Listener directly) and ``bridge-poll`` (``Reader.receive(timeout=0)`` spin).

Latency: the sender writes ``time.monotonic_ns()`` (CLOCK_MONOTONIC, system-wide)
into the payload's first 8 bytes immediately before send/publish; the receiver
reads ``time.monotonic_ns()`` as soon as it holds a numpy array of the payload.
For loan-based transports (iceoryx2, bridge) loaning and filling the buffer happen
*before* the stamp and are not part of the latency.  Messages are paced (one per
period, and never before the receiver has taken the previous one, via a
shared-memory side channel) so the figure is latency, not queueing.

Throughput: unpaced streaming for a fixed time with at most ``--window``
messages in flight (same side-channel credit for every transport, so the receiver
keeps up and lossy rings never overwrite unread slots).

Each (transport, size, mode) runs in two fresh fork()ed children; the parent
only supervises (timeouts, kill, cleanup) so one broken transport yields an error
row, not an aborted table.

    python bench/ipc_latency.py [--quick] [--json out.json] [--transports pipe,zmq,...]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import mmap
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import platform
import resource
import signal
import sys
import tempfile
import time
import traceback
import uuid

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

NV12_FRAME = 1928 * 1208 * 3 // 2  # 3,493,536 bytes
SIZES: list[tuple[str, int]] = [
    ("64 B", 64),
    ("64 KiB", 64 * 1024),
    ("1 MiB", 1024 * 1024),
    ("NV12 1928x1208", NV12_FRAME),
]
HDR_BYTES = 16  # int64 send timestamp, int64 sequence number

# Indices into the int64 control block shared by parent, sender and receiver.
C_LAST_SEQ = 0   # highest sequence number the receiver has taken (-1: none)
C_RX_READY = 1   # receiver endpoint open
C_TX_DONE = 2    # sender finished sending
C_TX_LAST = 3    # last sequence number sent (valid once C_TX_DONE)
C_RX_DONE = 4    # receiver finished (sender may close its endpoint)
C_ABORT = 5      # parent asks both children to stop
C_TX_READY = 6   # sender endpoint open
C_WORDS = 8


class Skip(Exception):
    """The transport is not available in this environment."""


def now_ns() -> int:
    return time.monotonic_ns()


def _u8_view(address: int, nbytes: int, _types: dict[int, type] = {}) -> np.ndarray:
    """Writable numpy uint8 view of raw memory (no copy)."""
    t = _types.get(nbytes)
    if t is None:
        t = _types[nbytes] = ctypes.c_uint8 * nbytes
    return np.frombuffer(t.from_address(address), dtype=np.uint8)


def _stamp(buf: np.ndarray, seq: int) -> int:
    """Write seq and the send timestamp into the payload header; the stamp goes last."""
    hdr = buf[:HDR_BYTES].view(np.int64)
    hdr[1] = seq
    t = now_ns()
    hdr[0] = t
    return t


def _read_stamp(arr: np.ndarray) -> tuple[int, int]:
    hdr = arr.reshape(-1).view(np.uint8)[:HDR_BYTES].view(np.int64)
    return int(hdr[0]), int(hdr[1])


# --------------------------------------------------------------------------------------
# Transport interface
# --------------------------------------------------------------------------------------

class SenderEnd:
    def send(self, seq: int, src: np.ndarray, fill: bool) -> None:
        """Put ``src`` (with seq and timestamp in its first 16 bytes) on the wire.

        Copy-based transports stamp ``src`` in place and send it.  Loan-based ones
        loan a buffer, copy ``src`` into it when ``fill`` (outside the measured
        interval), then stamp and publish.
        """
        raise NotImplementedError

    def close(self) -> None:
        pass


class ReceiverEnd:
    def recv(self, timeout_s: float) -> tuple[int, int, int, int] | None:
        """Wait up to ``timeout_s`` for one message.

        Returns ``(t_send_ns, seq, t_recv_ns, nbytes)`` where ``t_recv_ns`` is taken as
        soon as a numpy array of the payload is held, or None on timeout.  The message
        is released before returning.
        """
        raise NotImplementedError

    def close(self) -> None:
        pass


class Transport:
    key = "?"
    label = "?"
    blocking = True   # False: the receiver busy-polls a core
    # Which endpoint must exist first: "receiver" (it creates the service, e.g. iceoryx2),
    # "sender" (the reader attaches to a live writer, e.g. the bridge) or "any".
    open_first = "any"
    note = ""

    def check(self) -> None:
        """Raise Skip if unusable here.  Runs in the parent."""

    def setup(self, nbytes: int, run_id: str) -> None:
        """Parent, before fork: create whatever both children inherit."""
        self.nbytes = nbytes
        self.run_id = run_id

    def teardown(self) -> None:
        """Parent, after both children are gone."""

    def open_sender(self) -> SenderEnd:
        raise NotImplementedError

    def open_receiver(self) -> ReceiverEnd:
        raise NotImplementedError


# --------------------------------------------------------------------------------------
# 1. multiprocessing.Pipe + pickle
# --------------------------------------------------------------------------------------

class PipeTransport(Transport):
    key = "pipe"
    label = "mp.Pipe+pickle"

    def setup(self, nbytes, run_id):
        super().setup(nbytes, run_id)
        self.r, self.w = mp.get_context("fork").Pipe(duplex=False)

    def teardown(self):
        for c in (self.r, self.w):
            try:
                c.close()
            except OSError:
                pass

    def open_sender(self):
        self.r.close()
        w = self.w

        class S(SenderEnd):
            def send(self, seq, src, fill):
                _stamp(src, seq)
                w.send(src)

            def close(self):
                w.close()
        return S()

    def open_receiver(self):
        self.w.close()
        r = self.r

        class R(ReceiverEnd):
            def recv(self, timeout_s):
                if not r.poll(timeout_s):
                    return None
                arr = r.recv()
                t = now_ns()
                ts, seq = _read_stamp(arr)
                return ts, seq, t, arr.nbytes

            def close(self):
                r.close()
        return R()


# --------------------------------------------------------------------------------------
# 2. pyzmq PUSH/PULL over ipc://
# --------------------------------------------------------------------------------------

class ZmqTransport(Transport):
    key = "zmq"
    label = "zmq PUSH/PULL ipc"
    HWM = 16

    def check(self):
        try:
            import zmq  # noqa: F401
        except ImportError as e:
            raise Skip(f"pyzmq not installed: {e}")

    def setup(self, nbytes, run_id):
        super().setup(nbytes, run_id)
        self.path = os.path.join(tempfile.gettempdir(), f"ipcbench-{run_id}.sock")
        self.addr = "ipc://" + self.path

    def teardown(self):
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def open_sender(self):
        import zmq
        ctx = zmq.Context()
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, self.HWM)
        s.setsockopt(zmq.LINGER, 1000)
        s.connect(self.addr)

        class S(SenderEnd):
            def send(self, seq, src, fill):
                _stamp(src, seq)
                s.send(src, copy=True)

            def close(self):
                s.close()
                ctx.term()
        return S()

    def open_receiver(self):
        import zmq
        ctx = zmq.Context()
        s = ctx.socket(zmq.PULL)
        s.setsockopt(zmq.RCVHWM, self.HWM)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(self.addr)
        # Small messages: a bytes copy is cheaper than a zmq.Frame; large: frombuffer
        # on the Frame, no extra copy (pyzmq's own threshold).
        copy = self.nbytes < zmq.COPY_THRESHOLD
        again = zmq.Again
        state = {"rcvtimeo": None}

        class R(ReceiverEnd):
            def recv(self, timeout_s):
                ms = max(1, int(timeout_s * 1000))
                if state["rcvtimeo"] != ms:
                    s.setsockopt(zmq.RCVTIMEO, ms)
                    state["rcvtimeo"] = ms
                try:
                    m = s.recv(copy=copy)
                except again:
                    return None
                arr = np.frombuffer(m if copy else m.buffer, dtype=np.uint8)
                t = now_ns()
                ts, seq = _read_stamp(arr)
                return ts, seq, t, arr.nbytes

            def close(self):
                s.close()
                ctx.term()
        return R()


# --------------------------------------------------------------------------------------
# 3. iceoryx2 publish-subscribe, Slice[c_uint8], loaned samples
# --------------------------------------------------------------------------------------

class Iox2Transport(Transport):
    key = "iox2"
    label = "iceoryx2 (event)"
    open_first = "receiver"
    wake = "listener"       # listener | waitset | poll
    SUB_BUFFER = 8

    def check(self):
        try:
            import iceoryx2  # noqa: F401
        except ImportError as e:
            raise Skip(f"iceoryx2 not installed: {e}")

    def setup(self, nbytes, run_id):
        super().setup(nbytes, run_id)
        self.service = f"ipcbench/{run_id}"

    @staticmethod
    def _node():
        import iceoryx2 as iox2
        iox2.set_log_level(iox2.LogLevel.Error)
        # Disabled: iceoryx2 must not swallow the SIGTERM the supervisor may send.
        return (iox2.NodeBuilder.new()
                .signal_handling_mode(iox2.SignalHandlingMode.Disabled)
                .create(iox2.ServiceType.Ipc))

    def _pubsub_builder(self, node):
        import iceoryx2 as iox2
        return (node.service_builder(iox2.ServiceName.new(self.service))
                .publish_subscribe(iox2.Slice[ctypes.c_uint8])
                .subscriber_max_buffer_size(self.SUB_BUFFER)
                .history_size(0)
                .max_publishers(1)
                .max_subscribers(1))

    def open_receiver(self):
        import iceoryx2 as iox2
        node = self._node()
        # The receiver starts first and creates the services; the sender opens them.
        svc = self._pubsub_builder(node).create()
        sub = svc.subscriber_builder().create()
        listener = waitset = guard = None
        if self.wake != "poll":
            ev = node.service_builder(iox2.ServiceName.new(self.service)).event().create()
            listener = ev.listener_builder().create()
            if self.wake == "waitset":
                waitset = iox2.WaitSetBuilder.new().signal_handling_mode(
                    iox2.SignalHandlingMode.Disabled).create(iox2.ServiceType.Ipc)
                guard = waitset.attach_notification(listener)
        wake = self.wake
        Duration = iox2.Duration
        keep = [node, svc]  # keep the node and port factory alive

        def take():
            sample = sub.receive()
            if sample is None:
                return None
            p = sample.payload()                   # Slice[c_uint8] over shared memory
            arr = _u8_view(p.data_ptr, p.number_of_elements)
            t = now_ns()
            ts, seq = _read_stamp(arr)
            n = arr.nbytes
            del arr, p
            sample.delete()                        # hand the chunk back
            return ts, seq, t, n

        class R(ReceiverEnd):
            def recv(self, timeout_s):
                got = take()
                if got is not None:
                    return got
                deadline = now_ns() + int(timeout_s * 1e9)
                if wake == "poll":
                    while True:
                        got = take()
                        if got is not None:
                            return got
                        if now_ns() > deadline:
                            return None
                while True:
                    left = deadline - now_ns()
                    if left <= 0:
                        return None
                    if wake == "listener":
                        listener.timed_wait(Duration.from_nanos(left))
                    else:
                        waitset.wait_and_process_with_timeout(Duration.from_nanos(left))
                        listener.try_wait()        # consume, or the WaitSet fires again
                    got = take()
                    if got is not None:
                        return got

            def close(self):
                # Release the Rust-side ports explicitly: the closures above keep the
                # Python objects alive in a reference cycle, and a node that is never
                # dropped leaves stale files in /dev/shm and /tmp/iceoryx2.
                nonlocal guard
                guard = None
                _iox2_delete(waitset, listener, sub)
                keep.clear()
        return R()

    def open_sender(self):
        import iceoryx2 as iox2
        node = self._node()
        svc = self._pubsub_builder(node).open()
        pub = (svc.publisher_builder()
               .initial_max_slice_len(self.nbytes)
               .max_loaned_samples(2)
               .create())
        notifier = None
        if self.wake != "poll":
            ev = node.service_builder(iox2.ServiceName.new(self.service)).event().open()
            notifier = ev.notifier_builder().create()
        pub.update_connections()
        nbytes = self.nbytes
        keep = [node, svc]

        class S(SenderEnd):
            def send(self, seq, src, fill):
                sample = pub.loan_slice_uninit(nbytes)
                buf = _u8_view(sample.payload_ptr, nbytes)
                if fill:
                    np.copyto(buf, src)
                sample = sample.assume_init()
                _stamp(buf, seq)
                del buf
                sample.send()
                if notifier is not None:
                    notifier.notify()

            def close(self):
                _iox2_delete(notifier, pub)
                keep.clear()
        return S()


def _iox2_delete(*ports) -> None:
    for port in ports:
        if port is not None:
            try:
                port.delete()
            except Exception:  # noqa: BLE001 - best-effort cleanup
                pass


class Iox2PollTransport(Iox2Transport):
    key = "iox2-poll"
    label = "iceoryx2 (busy-poll)"
    wake = "poll"
    blocking = False
    note = "receiver spins on Subscriber.receive(), one core at 100%"


class Iox2WaitSetTransport(Iox2Transport):
    key = "iox2-waitset"
    label = "iceoryx2 (waitset)"
    wake = "waitset"


# --------------------------------------------------------------------------------------
# 4. trio-bridge: supervisor.ipc
# --------------------------------------------------------------------------------------

class BridgeTransport(Transport):
    key = "bridge"
    label = "trio-bridge"
    open_first = "sender"   # a Reader waits for its Writer to have attached
    module = "supervisor.ipc"
    poll = False
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
        w = Writer(self.wh)                        # fds inherited through fork()
        nbytes = self.nbytes
        shape = (nbytes,)
        explicit_ts = [True]

        class S(SenderEnd):
            def send(self, seq, src, fill):
                with w.loan() as slot:
                    a = slot.array(shape, "uint8")
                    if fill:
                        np.copyto(a, src)
                    t = _stamp(a, seq)
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
        r = Reader(self.rh)
        poll = self.poll

        try_receive = getattr(r, "try_receive", None)

        def _rejection(e: Exception) -> bool:
            # Typed bridge rejections (Rejected subclasses carry .reason) and LeaseLost
            # are counted and skipped; anything else is a real failure.
            return hasattr(e, "reason") or type(e).__name__ == "LeaseLost"

        class R(ReceiverEnd):
            rejected = 0

            def recv(self, timeout_s):
                deadline = now_ns() + int(timeout_s * 1e9)
                while True:
                    try:
                        if poll:
                            msg = (try_receive() if try_receive is not None
                                   else r.receive(timeout=0))
                        else:
                            msg = r.receive(timeout=max(timeout_s, 1e-3))
                    except TimeoutError:           # ChannelTimeout
                        msg = None
                    except Exception as e:  # noqa: BLE001
                        if not _rejection(e):
                            raise
                        self.rejected += 1
                        msg = None
                    if msg is not None:
                        arr = msg.array
                        t = now_ns()
                        ts, seq = _read_stamp(arr)
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
                    if not poll or now_ns() > deadline:
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


TRANSPORTS: dict[str, type[Transport]] = {
    t.key: t for t in (PipeTransport, ZmqTransport, Iox2Transport, Iox2PollTransport,
                       Iox2WaitSetTransport, BridgeTransport, BridgePollTransport)
}
DEFAULT_TRANSPORTS = ["pipe", "zmq", "iox2", "iox2-poll", "bridge"]
MAX_FOREIGN = [10.0]   # set from --max-foreign


# --------------------------------------------------------------------------------------
# Child processes
# --------------------------------------------------------------------------------------

def _cpu_self() -> float:
    """CPU seconds of this process, all threads (zmq I/O threads included)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_cpu_s() -> float | None:
    """Machine-wide non-idle CPU seconds so far (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal ...
    return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / _HZ


def _pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        ncpu = os.cpu_count() or 1
        os.sched_setaffinity(0, {cpu % ncpu})


def _wait_credit(ctrl: np.ndarray, seq: int, window: int, timeout_s: float) -> bool:
    """Block until fewer than ``window`` messages are in flight before ``seq``."""
    if seq - ctrl[C_LAST_SEQ] <= window:
        return True
    t_end = time.monotonic() + timeout_s
    spins = 0
    while seq - ctrl[C_LAST_SEQ] > window:
        if ctrl[C_ABORT]:
            raise RuntimeError("aborted by parent")
        spins += 1
        if spins > 200:                # ~20-40 us of spinning, then let others run
            time.sleep(20e-6)
            if time.monotonic() > t_end:
                return False           # message lost (lossy transport): move on
    return True


def _sender_main(transport: Transport, mode: str, p: dict, ctrl: np.ndarray, conn) -> None:
    out: dict = {"role": "sender"}
    tx = None
    try:
        _pin(p["pin_tx"])
        tx = transport.open_sender()
        ctrl[C_TX_READY] = 1
        src = np.random.default_rng(1).integers(0, 256, transport.nbytes, dtype=np.uint8)
        t_end = time.monotonic() + 15
        while not ctrl[C_RX_READY]:
            if ctrl[C_ABORT] or time.monotonic() > t_end:
                raise RuntimeError("receiver never became ready")
            time.sleep(1e-3)
        fill = p["fill"]
        warmup = p["warmup"]
        stalls = 0
        seq = 0
        gc.collect()
        gc.disable()
        # Warm-up: paced, one in flight (first messages may be lost while connecting).
        for seq in range(warmup):
            if not _wait_credit(ctrl, seq, 1, 0.2):
                stalls += 1
            tx.send(seq, src, fill)
            time.sleep(p["period_s"])
        seq = warmup
        if mode == "latency":
            period_ns = int(p["period_s"] * 1e9)
            nxt = now_ns() + period_ns
            give_up = now_ns() + int(p["max_latency_s"] * 1e9)
            seq = warmup
            for seq in range(warmup, warmup + p["count"]):
                if now_ns() > give_up:
                    out["truncated"] = True   # slow transport: fewer samples, not a hang
                    break
                dt = nxt - now_ns()
                if dt > 0:
                    time.sleep(dt / 1e9)
                # Never send before the receiver has taken the previous message.
                if not _wait_credit(ctrl, seq, 1, 0.5):
                    stalls += 1
                tx.send(seq, src, fill)
                nxt = max(nxt + period_ns, now_ns())
                if ctrl[C_ABORT]:
                    raise RuntimeError("aborted by parent")
            else:
                seq = warmup + p["count"]
        else:
            window = p["window"]
            stop = now_ns() + int(p["duration_s"] * 1e9)
            while True:
                if not _wait_credit(ctrl, seq, window, 0.5):
                    stalls += 1
                tx.send(seq, src, fill)
                seq += 1
                if not seq & 15 and (now_ns() > stop or ctrl[C_ABORT]):
                    break
        gc.enable()
        ctrl[C_TX_LAST] = seq - 1
        ctrl[C_TX_DONE] = 1
        out.update(sent=seq, stalls=stalls)
        # Keep the endpoint open until the receiver has drained (zmq linger,
        # iceoryx2 publisher lifetime, bridge writer).
        t_end = time.monotonic() + 10
        while not ctrl[C_RX_DONE] and not ctrl[C_ABORT] and time.monotonic() < t_end:
            time.sleep(1e-3)
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
        ctrl[C_TX_DONE] = 1
    finally:
        try:
            if tx is not None:
                tx.close()
        except Exception as e:  # noqa: BLE001
            out.setdefault("close_error", repr(e))
        out["cpu_s"] = _cpu_self()
        conn.send(out)
        conn.close()


def _stats_us(lat_ns: np.ndarray) -> dict:
    if lat_ns.size == 0:
        return {"n": 0}
    us = lat_ns.astype(np.float64) / 1e3
    p50, p99, p999 = np.percentile(us, [50, 99, 99.9])
    return {"n": int(us.size), "min": float(us.min()), "mean": float(us.mean()),
            "p50": float(p50), "p99": float(p99), "p99.9": float(p999),
            "max": float(us.max())}


def _windowed_rate(t_ns: np.ndarray, overall: float) -> float:
    """Median rate over fixed windows (>= 50 ms and >= ~20 messages each).

    More robust than the overall rate against a short burst of unrelated load on a
    small machine; falls back to the overall rate when the run is too short.
    """
    if t_ns.size < 60 or not overall == overall:
        return overall
    win = max(0.05, 20.0 / overall)
    span = (t_ns[-1] - t_ns[0]) / 1e9
    nwin = int(span / win)
    if nwin < 3:
        return overall
    edges = t_ns[0] + (np.arange(nwin + 1) * win * 1e9).astype(np.int64)
    counts, _ = np.histogram(t_ns, bins=edges)
    return float(np.median(counts)) / win


def _receiver_main(transport: Transport, mode: str, p: dict, ctrl: np.ndarray, conn) -> None:
    out: dict = {"role": "receiver"}
    rx = None
    try:
        _pin(p["pin_rx"])
        rx = transport.open_receiver()
        nbytes = transport.nbytes
        warmup = p["warmup"]
        cap = p["count"] if mode == "latency" else p["max_msgs"]
        lat = np.empty(cap, dtype=np.int64)
        trecv = np.empty(cap if mode == "throughput" else 0, dtype=np.int64)
        n = 0
        last = -1
        drops = reorder = bad_len = 0
        t_first = t_last = 0
        grace = None
        hard_end = time.monotonic() + p["deadline_s"]
        gc.collect()
        gc.disable()
        ctrl[C_RX_READY] = 1
        while True:
            got = rx.recv(0.05)
            if got is None:
                if ctrl[C_ABORT]:
                    raise RuntimeError("aborted by parent")
                if ctrl[C_TX_DONE] and last >= ctrl[C_TX_LAST]:
                    break
                if ctrl[C_TX_DONE]:
                    # Sender is done but messages are missing: give them a moment.
                    if grace is None:
                        grace = time.monotonic() + 0.5
                    elif time.monotonic() > grace:
                        break
                if time.monotonic() > hard_end:
                    raise TimeoutError(f"receiver deadline passed after {n} messages")
                continue
            ts, seq, t, got_n = got
            if got_n != nbytes:
                bad_len += 1
            if seq > last + 1:
                drops += seq - last - 1
            elif seq <= last:
                reorder += 1
                continue
            last = seq
            ctrl[C_LAST_SEQ] = seq
            if seq >= warmup:
                if n == 0:
                    t_first = t
                t_last = t
                if n < cap:
                    lat[n] = t - ts
                    if mode == "throughput":
                        trecv[n] = t
                n += 1
            if ctrl[C_TX_DONE] and seq >= ctrl[C_TX_LAST]:
                break
        gc.enable()
        rec = lat[:min(n, cap)]
        out.update(received=n, drops=int(drops), reorder=reorder, bad_len=bad_len,
                   latency=_stats_us(rec))
        if mode == "latency":
            out["raw_ns"] = rec.copy()
        rejected = getattr(rx, "rejected", 0)
        if rejected:
            out["rejected"] = rejected
        if mode == "throughput":
            el = (t_last - t_first) / 1e9
            overall = (n - 1) / el if n > 1 and el > 0 else float("nan")
            rate = _windowed_rate(trecv[:min(n, cap)], overall)
            out.update(elapsed_s=el, msgs_per_s=rate, msgs_per_s_overall=overall,
                       gb_per_s=rate * nbytes / 1e9)
    except BaseException as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    finally:
        ctrl[C_RX_DONE] = 1
        try:
            if rx is not None:
                rx.close()
        except Exception as e:  # noqa: BLE001
            out.setdefault("close_error", repr(e))
        out["cpu_s"] = _cpu_self()
        conn.send(out)
        conn.close()


# --------------------------------------------------------------------------------------
# Parent: run one case under supervision
# --------------------------------------------------------------------------------------

def _child(target, *args) -> None:
    # Forked children: default SIGINT/SIGTERM so the parent can always stop them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        target(*args)
    finally:
        gc.collect()   # drop what the transports left in cycles (iceoryx2 nodes) first
        os._exit(0)


def _stop(proc) -> bool:
    """Make sure a child is gone; True if it had to be killed."""
    proc.join(0.5)
    if proc.exitcode is not None:
        return False
    proc.terminate()
    proc.join(1.0)
    if proc.exitcode is None:
        proc.kill()
        proc.join(1.0)
    return True


def run_case(tcls: type[Transport], mode: str, size_label: str, nbytes: int,
             p: dict) -> dict:
    row = {"transport": tcls.key, "label": tcls.label, "size": size_label,
           "nbytes": nbytes, "mode": mode}
    t = tcls()
    run_id = f"{os.getpid()}-{uuid.uuid4().hex[:10]}"
    ctx = mp.get_context("fork")
    shm = mmap.mmap(-1, C_WORDS * 8)
    ctrl = np.frombuffer(shm, dtype=np.int64)
    ctrl[:] = 0
    ctrl[C_LAST_SEQ] = -1
    procs = []
    conns = {}
    killed = False
    results: dict[str, dict] = {}
    t0 = time.monotonic()
    busy0, own0 = _busy_cpu_s(), _cpu_self()
    try:
        t.setup(nbytes, run_id)
        roles = [("receiver", _receiver_main, C_RX_READY), ("sender", _sender_main, C_TX_READY)]
        if t.open_first == "sender":
            roles.reverse()
        for role, target, ready in roles:
            parent_end, child_end = ctx.Pipe(duplex=False)
            pr = ctx.Process(target=_child, args=(target, t, mode, p, ctrl, child_end),
                             name=f"bench-{tcls.key}-{role}", daemon=True)
            pr.start()
            child_end.close()
            procs.append(pr)
            conns[parent_end] = role
            if len(procs) == 1 and t.open_first != "any":
                # Let the first endpoint open before starting the other one.
                t_ready = time.monotonic() + 15
                while not ctrl[ready] and pr.is_alive() and time.monotonic() < t_ready:
                    time.sleep(1e-3)
        deadline = time.monotonic() + p["deadline_s"] + 15
        pending = dict(conns)
        progress, last_seen = time.monotonic(), None
        while pending and time.monotonic() < deadline:
            seen = (int(ctrl[C_LAST_SEQ]), int(ctrl[C_RX_READY]), int(ctrl[C_TX_READY]),
                    int(ctrl[C_TX_DONE]), int(ctrl[C_RX_DONE]))
            if seen != last_seen:
                progress, last_seen = time.monotonic(), seen
            elif time.monotonic() - progress > p["stall_s"]:
                row["stalled"] = f"no progress for {p['stall_s']:.0f} s"
                break
            for c in mpc.wait(list(pending), timeout=0.2):
                role = pending.pop(c)
                try:
                    results[role] = c.recv()
                except EOFError:
                    pr = next(x for x in procs if x.name.endswith(role))
                    pr.join(0.5)
                    results[role] = {"error": f"{role} died without a report "
                                              f"(exit code {pr.exitcode})"}
            if pending and any(pr.exitcode not in (None, 0) for pr in procs):
                # A child crashed (e.g. a segfault): give the other a moment, then stop.
                for c in mpc.wait(list(pending), timeout=1.0):
                    role = pending.pop(c)
                    try:
                        results[role] = c.recv()
                    except EOFError:
                        pass
                break
        if pending:
            ctrl[C_ABORT] = 1
            for c in mpc.wait(list(pending), timeout=1.0):
                role = pending.pop(c)
                try:
                    results[role] = c.recv()
                except EOFError:
                    pass
        for pr in procs:
            killed |= _stop(pr)
        rx = results.get("receiver", {})
        tx = results.get("sender", {})
        errs = []
        for role, r in (("receiver", rx), ("sender", tx)):
            if not r:
                code = next((pr.exitcode for pr in procs if role in pr.name), None)
                errs.append(f"{role}: no report (exit code {code})")
            elif "error" in r:
                errs.append(f"{role}: {r['error']}")
        if "stalled" in row:
            errs.insert(0, f"stalled ({row['stalled']}, last seq {last_seen[0]}); killed")
        if errs:
            row["error"] = "; ".join(errs)
            row["tracebacks"] = [r["traceback"] for r in (rx, tx) if "traceback" in r]
        for k in ("received", "drops", "reorder", "bad_len", "rejected", "msgs_per_s",
                  "msgs_per_s_overall", "gb_per_s", "elapsed_s", "latency"):
            if k in rx:
                row[k] = rx[k]
        for k in ("sent", "stalls", "truncated"):
            if k in tx:
                row[k] = tx[k]
        if "raw_ns" in rx:
            row["_raw_ns"] = rx["raw_ns"]     # kept in memory for aggregation only
        if not errs and rx.get("received", 0) == 0:
            row["error"] = "no messages received"
    except Skip:
        raise
    except Exception as e:  # noqa: BLE001 - setup failures become error rows
        row["error"] = f"{type(e).__name__}: {e}"
        row["tracebacks"] = [traceback.format_exc()]
    finally:
        for pr in procs:
            killed |= _stop(pr)
        for c in conns:
            c.close()
        try:
            t.teardown()
        except Exception as e:  # noqa: BLE001
            row.setdefault("teardown_error", repr(e))
        del ctrl
        shm.close()
    row["killed"] = killed
    wall = time.monotonic() - t0
    row["wall_s"] = round(wall, 3)
    busy1 = _busy_cpu_s()
    if busy0 is not None and busy1 is not None and wall > 0.2:
        ours = (_cpu_self() - own0) + sum(r.get("cpu_s", 0.0) for r in results.values())
        # CPU burnt by anything but this case's three processes, as a share of the
        # machine: other work running concurrently distorts the numbers.
        row["foreign_cpu_pct"] = round(
            max(0.0, busy1 - busy0 - ours) / (wall * (os.cpu_count() or 1)) * 100, 1)
    return row


def _iox2_cleanup() -> None:
    """Remove resources of iceoryx2 nodes that died (killed children), in a child."""
    def work():
        import iceoryx2 as iox2
        iox2.set_log_level(iox2.LogLevel.Fatal)
        node = (iox2.NodeBuilder.new()
                .signal_handling_mode(iox2.SignalHandlingMode.Disabled)
                .create(iox2.ServiceType.Ipc))
        node.try_cleanup_dead_nodes()
    pr = mp.get_context("fork").Process(target=_child, args=(work,), daemon=True)
    pr.start()
    pr.join(10)
    _stop(pr)


# --------------------------------------------------------------------------------------
# Parameters, table, main
# --------------------------------------------------------------------------------------

def params_for(nbytes: int, quick: bool, repeats: int, args) -> dict:
    """Per-run parameters; counts are per repeat (the totals are split over repeats)."""
    big = nbytes >= 1 << 20
    frame = nbytes >= NV12_FRAME
    if quick:
        total = 200 if frame else 300 if big else 500
        warmup = 10 if big else 20
        duration = 0.4
    else:
        total = 1000 if frame else 2000
        warmup = 20 if big else 50
        duration = 1.5
    if args.count:
        total = args.count
    if args.duration:
        duration = args.duration
    count = max(1, -(-total // repeats))
    duration = duration / repeats
    period = 2e-3 if frame else 1e-3 if big else 5e-4
    if args.period_us:
        period = args.period_us / 1e6
    est = warmup * period + count * (period + 0.02)
    return {
        "count": count, "warmup": warmup, "period_s": period,
        "duration_s": duration, "window": args.window, "fill": args.fill == "copy",
        "max_msgs": 2_000_000,
        # receiver hard deadline: generous, only there to catch a hung transport
        "deadline_s": max(10.0, est + duration + 10),
        # parent: no message taken and no state change for this long -> abort the case
        "stall_s": 8.0,
        # latency runs of very slow transports (pickled frames) stop early
        "max_latency_s": (3.0 if quick else 8.0) / repeats,
        "pin_tx": 0 if args.pin else None, "pin_rx": 1 if args.pin else None,
    }


def aggregate(runs: list[dict], raw_dir: str | None) -> list[dict]:
    """Merge the repeats of each (transport, size, mode) into one row.

    Latency percentiles come from all repeats' samples pooled; throughput is the
    median over repeats (each already a median over short windows).
    """
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["transport"], r["size"], r["mode"]), []).append(r)
    out = []
    for (key, size, mode), rs in groups.items():
        first = rs[0]
        row = {k: first[k] for k in ("transport", "label", "size", "nbytes", "mode")}
        if "skipped" in first:
            row["skipped"] = first["skipped"]
            out.append(row)
            continue
        good = [r for r in rs if "error" not in r]
        bad = [r for r in rs if "error" in r]
        row["repeats"] = len(rs)
        if bad:
            msg = bad[0]["error"]
            row["error" if not good else "warning"] = (
                msg if len(rs) == 1 else f"{len(bad)}/{len(rs)} repeats failed: {msg}")
            tbs = [tb for r in bad for tb in r.get("tracebacks", [])]
            if tbs:
                row["tracebacks"] = tbs
        for k in ("received", "drops", "reorder", "bad_len", "rejected", "sent", "stalls"):
            vals = [r[k] for r in good if k in r]
            if vals:
                row[k] = int(sum(vals))
        row["killed"] = any(r.get("killed") for r in rs)
        if any(r.get("truncated") for r in rs):
            row["truncated"] = True
        fc = [r["foreign_cpu_pct"] for r in rs if "foreign_cpu_pct" in r]
        if fc:
            row["foreign_cpu_pct_max"] = max(fc)
        row["wall_s"] = round(sum(r.get("wall_s", 0) for r in rs), 3)
        row["params"] = first.get("params")
        if mode == "latency":
            raws = [r["_raw_ns"] for r in good if r.get("_raw_ns") is not None]
            if raws:
                pooled = np.concatenate(raws)
                row["latency"] = _stats_us(pooled)
                row["latency_per_repeat"] = [r.get("latency") for r in good]
                if raw_dir:
                    os.makedirs(raw_dir, exist_ok=True)
                    fn = f"{key}_{row['nbytes']}_latency.npy"
                    np.save(os.path.join(raw_dir, fn), pooled)
                    row["raw_file"] = os.path.join(raw_dir, fn)
        else:
            rates = [r["msgs_per_s"] for r in good if r.get("msgs_per_s") == r.get("msgs_per_s")
                     and r.get("msgs_per_s")]
            if rates:
                rate = float(np.median(rates))
                row["msgs_per_s"] = rate
                row["gb_per_s"] = rate * row["nbytes"] / 1e9
                row["msgs_per_s_per_repeat"] = rates
                row["msgs_per_s_overall_per_repeat"] = [r.get("msgs_per_s_overall")
                                                        for r in good]
                row["loaded_latency_per_repeat"] = [r.get("latency") for r in good]
        if not good and "error" not in row:
            row["error"] = "no successful repeat"
        out.append(row)
    return out


def _fmt(v: float | None, digits: int = 1) -> str:
    if v is None or v != v:  # None or NaN
        return "-"
    if v >= 10000:
        return f"{v:,.0f}"
    if v >= 100:
        return f"{v:.0f}"
    return f"{v:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    if not a or not b or a != a or b != b:
        return "n/a"
    return f"{a / b:.2f}x"


def build_summary(rows: list[dict], keys: list[str]) -> dict:
    """{size: {transport: {"lat": stats, "tput": row, "error": str}}}"""
    out: dict = {}
    for r in rows:
        cell = out.setdefault(r["size"], {}).setdefault(r["transport"], {})
        if r.get("skipped"):
            cell["skipped"] = r["skipped"]
            continue
        if r.get("error"):
            cell.setdefault("error", []).append(f"{r['mode']}: {r['error']}")
        if r.get("warning"):
            cell.setdefault("warning", []).append(f"{r['mode']}: {r['warning']}")
        if r["mode"] == "latency" and r.get("latency", {}).get("n"):
            cell["lat"] = r["latency"]
        cell["foreign"] = max(cell.get("foreign", 0.0), r.get("foreign_cpu_pct_max", 0.0))
        if r["mode"] == "throughput" and r.get("msgs_per_s"):
            cell["tput"] = r
    return out


def print_tables(rows: list[dict], keys: list[str], labels: dict[str, str]) -> dict:
    summ = build_summary(rows, keys)
    w = 78
    print()
    print("=" * w)
    print("Per-case results  (latency: paced, one-way, us;  throughput: unpaced stream)")
    print("other% = CPU share other processes used during the case (max over runs); "
          "* = above --max-foreign, treat with care")
    print("=" * w)
    hdr = (f"{'size':<15} {'transport':<23} {'p50':>8} {'p99':>8} {'p99.9':>8} "
           f"{'max':>8} {'n':>6} {'msgs/s':>10} {'GB/s':>6} {'other%':>6}")
    print(hdr)
    print("-" * len(hdr))
    for size, _ in SIZES:
        for k in keys:
            cell = summ.get(size, {}).get(k, {})
            name = labels[k]
            if "skipped" in cell:
                print(f"{size:<15} {name:<23} SKIPPED: {cell['skipped']}")
                continue
            lat = cell.get("lat", {})
            tp = cell.get("tput", {})
            line = (f"{size:<15} {name:<23} {_fmt(lat.get('p50')):>8} "
                    f"{_fmt(lat.get('p99')):>8} {_fmt(lat.get('p99.9')):>8} "
                    f"{_fmt(lat.get('max')):>8} {lat.get('n', 0):>6} "
                    f"{_fmt(tp.get('msgs_per_s'), 0):>10} "
                    f"{_fmt(tp.get('gb_per_s'), 2) if tp else '-':>6} "
                    f"{cell.get('foreign', 0):>5.0f}{'*' if cell.get('foreign', 0) > MAX_FOREIGN[0] else ' '}")
            print(line)
            for e in cell.get("error", []):
                print(f"{'':<15} {'':<23} ERROR {e[:200]}")
            for e in cell.get("warning", []):
                print(f"{'':<15} {'':<23} WARNING {e[:200]}")
        print()

    # Compact matrix: rows = size, columns = transport.
    print("Latency p50 / p99 / p99.9 [us]  and  throughput [msgs/s]")
    colw = 24
    head = f"{'size':<15}" + "".join(f"{labels[k][:colw - 1]:>{colw}}" for k in keys)
    print(head)
    print("-" * len(head))
    for size, _ in SIZES:
        l1 = f"{size:<15}"
        l2 = f"{'':<15}"
        for k in keys:
            cell = summ.get(size, {}).get(k, {})
            lat = cell.get("lat")
            if "skipped" in cell:
                a, b = "skipped", ""
            elif lat:
                a = f"{_fmt(lat['p50'])}/{_fmt(lat['p99'])}/{_fmt(lat['p99.9'])}"
                tp = cell.get("tput")
                b = f"{_fmt(tp['msgs_per_s'], 0)}/s" if tp else "ERR"
            else:
                a, b = "ERR", ""
            l1 += f"{a:>{colw}}"
            l2 += f"{b:>{colw}}"
        print(l1)
        print(l2)
    print()

    # Ratios against the bridge at p50 and p99 (>1x: the first one is slower).
    ratio_cols = [("Pipe/bridge", "pipe", "bridge"), ("zmq/bridge", "zmq", "bridge"),
                  ("bridge/iceoryx2", "bridge", "iox2")]
    ratios: dict = {}
    head = f"{'size':<15}" + "".join(f"{n + ' p50':>20}{n + ' p99':>20}" for n, _, _ in ratio_cols)
    print("Latency ratios (>1x: numerator slower; iceoryx2 = blocking/event variant)")
    print(head)
    print("-" * len(head))
    for size, _ in SIZES:
        line = f"{size:<15}"
        cells = summ.get(size, {})
        for name, a, b in ratio_cols:
            la = cells.get(a, {}).get("lat") or {}
            lb = cells.get(b, {}).get("lat") or {}
            for q in ("p50", "p99"):
                r = _ratio(la.get(q), lb.get(q))
                ratios.setdefault(size, {})[f"{name} {q}"] = (
                    la[q] / lb[q] if la.get(q) and lb.get(q) else None)
                line += f"{r:>20}"
        print(line)
    print()
    return ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer messages, shorter streams (<60 s)")
    ap.add_argument("--json", metavar="PATH", help="write all results as JSON")
    ap.add_argument("--transports", default=",".join(DEFAULT_TRANSPORTS),
                    help=f"comma list from {','.join(TRANSPORTS)} (default: %(default)s)")
    ap.add_argument("--sizes", default="all",
                    help="comma list of byte counts, or 'all' (64,65536,1048576,frame)")
    ap.add_argument("--modes", default="latency,throughput")
    ap.add_argument("--repeat", type=int,
                    help="passes over the whole matrix, interleaved in time; latency "
                         "samples are pooled, throughput is the median (default: 2, "
                         "--quick: 1). Counts and durations are split over the passes.")
    ap.add_argument("--count", type=int, help="latency messages per case, all repeats (override)")
    ap.add_argument("--period-us", type=float, help="latency pacing period (override)")
    ap.add_argument("--duration", type=float,
                    help="throughput seconds per case, all repeats (override)")
    ap.add_argument("--window", type=int, default=4,
                    help="max messages in flight while streaming (default: %(default)s)")
    ap.add_argument("--fill", choices=("copy", "stamp"), default="copy",
                    help="loan-based senders: copy the ready payload into the loan each "
                         "message (copy, default) or only write the 16-byte header "
                         "(stamp: producer writes in place). Never inside the latency.")
    ap.add_argument("--max-foreign", type=float, default=10.0, metavar="PCT",
                    help="a case during which other processes used more than PCT%% of "
                         "the CPUs is re-run (default: %(default)s)")
    ap.add_argument("--retries", type=int, default=1,
                    help="re-runs allowed per disturbed case (default: %(default)s)")
    ap.add_argument("--budget", type=float, metavar="S",
                    help="no more re-runs once they would push the whole run past S "
                         "seconds (default: 170, --quick: 55)")
    ap.add_argument("--pin", action="store_true", help="pin sender to CPU0, receiver to CPU1")
    ap.add_argument("--bridge-module", default="supervisor.ipc",
                    help="module providing ChannelSpec/Channel/Writer/Reader")
    ap.add_argument("--raw", metavar="DIR",
                    help="save every case's raw latencies (ns, arrival order) as .npy")
    ap.add_argument("-v", "--verbose", action="store_true", help="print child tracebacks")
    args = ap.parse_args(argv)

    keys = [k.strip() for k in args.transports.split(",") if k.strip()]
    unknown = [k for k in keys if k not in TRANSPORTS]
    if unknown:
        ap.error(f"unknown transport(s) {unknown}; choose from {list(TRANSPORTS)}")
    if args.sizes == "all":
        sizes = SIZES
    else:
        sizes = []
        for s in args.sizes.split(","):
            s = s.strip()
            n = NV12_FRAME if s in ("frame", "nv12") else int(s)
            sizes.append(next(((lab, b) for lab, b in SIZES if b == n), (f"{n} B", n)))
        SIZES[:] = sizes
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    MAX_FOREIGN[0] = args.max_foreign
    BridgeTransport.module = args.bridge_module
    BridgePollTransport.module = args.bridge_module
    labels = {k: TRANSPORTS[k].label for k in keys}

    print(f"ipc_latency: {platform.node()} {platform.machine()} cpus={os.cpu_count()} "
          f"python {platform.python_version()} numpy {np.__version__}"
          f"{' QUICK' if args.quick else ''} fill={args.fill} window={args.window}"
          f"{' pinned' if args.pin else ''}")
    load0 = os.getloadavg()
    if load0[0] > 0.5:
        print(f"  warning: load average {load0[0]:.2f} before start; other work on this "
              f"machine will distort the tails (2 cores: sender + receiver need both)")
    skipped: dict[str, str] = {}
    for k in keys:
        try:
            TRANSPORTS[k]().check()
        except Skip as e:
            skipped[k] = str(e)
            print(f"  note: skipping {labels[k]}: {e}")

    repeats = args.repeat or (1 if args.quick else 2)
    runs: list[dict] = []
    budget = args.budget or (55.0 if args.quick else 170.0)
    n_cases = repeats * len(sizes) * len(modes) * len([k for k in keys if k not in skipped])
    done = 0
    t_start = time.monotonic()
    iox2_killed = False
    for rep in range(repeats):
        if repeats > 1:
            print(f"-- repeat {rep + 1}/{repeats}")
        for size, nbytes in sizes:
            p = params_for(nbytes, args.quick, repeats, args)
            # Rotate the order each repeat so no transport always follows the same one.
            order = keys[rep % len(keys):] + keys[:rep % len(keys)]
            for k in order:
                if k in skipped:
                    if rep == 0:
                        runs.append({"transport": k, "label": labels[k], "size": size,
                                     "nbytes": nbytes, "mode": "latency",
                                     "skipped": skipped[k]})
                    continue
                for mode in modes:
                    row = run_case(TRANSPORTS[k], mode, size, nbytes, p)
                    done += 1
                    for _ in range(args.retries):
                        busy = row.get("foreign_cpu_pct", 0.0)
                        if busy <= args.max_foreign or "error" in row:
                            break
                        spent = time.monotonic() - t_start
                        if spent + row["wall_s"] + spent / done * (n_cases - done) > budget:
                            row["retry_skipped"] = "time budget"
                            break
                        print(f"  {size:<15} {labels[k]:<23} {mode:<10} other processes "
                              f"used {busy:.0f}% of the CPUs meanwhile: running it again")
                        again = run_case(TRANSPORTS[k], mode, size, nbytes, p)
                        if ("error" not in again
                                and again.get("foreign_cpu_pct", 0.0) < busy):
                            row = again
                        row["retried"] = row.get("retried", 0) + 1
                    row["repeat"] = rep
                    row["params"] = {kk: p[kk] for kk in ("count", "warmup", "period_s",
                                                           "duration_s", "window", "fill")}
                    runs.append(row)
                    iox2_killed |= row.get("killed", False) and k.startswith("iox2")
                    lat = row.get("latency", {})
                    msg = (f"  {size:<15} {labels[k]:<23} {mode:<10} "
                           + (f"ERROR {row['error'][:160]}" if "error" in row else
                              f"{'loaded ' if mode == 'throughput' else ''}"
                              f"p50 {_fmt(lat.get('p50'))} us  p99 {_fmt(lat.get('p99'))} us"
                              + (f"  {_fmt(row.get('msgs_per_s'), 0)} msg/s "
                                 f"{_fmt(row.get('gb_per_s'), 2)} GB/s"
                                 if mode == "throughput" else "")
                              + (f"  drops={row['drops']}" if row.get("drops") else ""))
                           + f"  [{row['wall_s']:.1f}s"
                           + (f", other procs {row['foreign_cpu_pct']:.0f}% CPU"
                              if row.get("foreign_cpu_pct", 0) >= 2 else "")
                           + "]")
                    print(msg, flush=True)
                    if args.verbose and row.get("tracebacks"):
                        for tb in row["tracebacks"]:
                            print(tb)
    if iox2_killed or any(k.startswith("iox2") and k not in skipped for k in keys):
        _iox2_cleanup()
    rows = aggregate(runs, args.raw)
    elapsed = time.monotonic() - t_start
    ratios = print_tables(rows, keys, labels)
    load1 = os.getloadavg()
    print(f"total {elapsed:.1f} s   load average before {load0[0]:.2f}, after {load1[0]:.2f} "
          f"(the benchmark itself adds ~1-2)")

    if args.json:
        doc = {
            "meta": {
                "host": platform.node(), "machine": platform.machine(),
                "cpus": os.cpu_count(), "python": platform.python_version(),
                "numpy": np.__version__, "quick": args.quick, "fill": args.fill,
                "window": args.window, "pinned": args.pin, "clock": "CLOCK_MONOTONIC",
                "elapsed_s": elapsed, "loadavg_before": load0, "loadavg_after": load1,
                "transports": {k: labels[k] for k in keys},
                "versions": _versions(),
            },
            "results": rows,
            "ratios": ratios,
            "runs": [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


def _versions() -> dict:
    v = {}
    for mod in ("zmq", "iceoryx2"):
        try:
            m = importlib.import_module(mod)
            v[mod] = getattr(m, "__version__", None) or _dist_version(mod)
        except ImportError:
            pass
    return v


def _dist_version(mod: str) -> str | None:
    try:
        from importlib.metadata import version
        return version({"zmq": "pyzmq"}.get(mod, mod))
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())
