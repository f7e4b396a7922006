"""``pipe``: multiprocessing.Pipe, the numpy array pickled by ``Connection.send``."""
from __future__ import annotations

import multiprocessing as mp

from .transport import ReceiverEnd, SenderEnd, Transport, now_ns, read_stamp, stamp


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
                stamp(src, seq)
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
                ts, seq = read_stamp(arr)
                return ts, seq, t, arr.nbytes

            def close(self):
                r.close()
        return R()
