"""``zmq``: pyzmq PUSH/PULL over ipc:// in /tmp, ``send(arr, copy=True)``, receiver
``np.frombuffer``."""
from __future__ import annotations

import os
import tempfile

import numpy as np

from .transport import (ReceiverEnd, SenderEnd, Skip, Transport, now_ns, read_stamp,
                        stamp)


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
                stamp(src, seq)
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
                ts, seq = read_stamp(arr)
                return ts, seq, t, arr.nbytes

            def close(self):
                s.close()
                ctx.term()
        return R()
