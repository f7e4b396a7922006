"""``iox2``: iceoryx2 publish-subscribe, loaned ``Slice[c_uint8]`` samples (zero-copy);
the receiver blocks on an iceoryx2 event Listener (``iox2``), in a WaitSet
(``iox2-waitset``) or busy-polls ``Subscriber.receive()`` (``iox2-poll``)."""
from __future__ import annotations

import ctypes

import numpy as np

from .transport import (ReceiverEnd, SenderEnd, Skip, Transport, now_ns, read_stamp,
                        stamp, u8_view)


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
            arr = u8_view(p.data_ptr, p.number_of_elements)
            t = now_ns()
            ts, seq = read_stamp(arr)
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
                        try:
                            listener.timed_wait(Duration.from_nanos(left))
                        except iox2.ListenerWaitError as e:
                            # A signal cut the wait short (strace attaching, --syscalls):
                            # its SO_RCVTIMEO wait is not restarted. Look again.
                            if "Interrupt" not in str(e):
                                raise
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
                buf = u8_view(sample.payload_ptr, nbytes)
                if fill:
                    np.copyto(buf, src)
                sample = sample.assume_init()
                stamp(buf, seq)
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
