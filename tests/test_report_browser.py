"""report.html in a real browser: headless Chromium loads the page from file://, a
mouse drags the scrubber, and the pixels say that the road frame and the cursor on the
signal charts moved with it (Chrome DevTools Protocol over a pipe: no port, no
network). The page comes from `report.collect` over real drive logs (the synthetic
camera's frames), the same code a replay runs; no pipeline is needed for it."""
from __future__ import annotations

import base64
import io
import json
import os
import select
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

from supervisor.replay.derive import ReplayPlan
from supervisor.replay.drivelog import DriveLog
from supervisor.replay.report import collect, write
from tests.test_replay_format import write_log

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("chromium is not installed (apt-get install -y chromium; .ci/run installs it)",
                allow_module_level=True)

PLAN = ReplayPlan(camera="camerad", frames="road_frames", controls="controlsd",
                  command="control_cmd", model="modeld", model_out="model_out")


class Browser:
    """Headless Chromium driven over --remote-debugging-pipe: it reads commands from
    its fd 3 and writes replies to its fd 4, each a JSON object ended by a NUL."""

    def __init__(self) -> None:
        to_r, self._to = os.pipe()
        self._from, from_w = os.pipe()
        self._profile = tempfile.mkdtemp(prefix="chromium-")
        # As root Chromium's own sandbox cannot start (--no-sandbox): it only ever loads
        # the test's own local page, and the page's CSP forbids any fetch anyway.
        args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions", "--mute-audio",
                f"--user-data-dir={self._profile}", "--remote-debugging-pipe",
                "--window-size=1200,900", "about:blank"]
        self.p = subprocess.Popen(["bash", "-c", f'exec "$@" 3<&{to_r} 4>&{from_w}', "bash", *args],
                                  pass_fds=(to_r, from_w), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(to_r)
        os.close(from_w)
        self._buf = b""
        self._id = 0
        self.session: str | None = None
        pages = [t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page"]
        self.session = self.call("Target.attachToTarget", targetId=pages[0]["targetId"],
                                 flatten=True, session=False)["sessionId"]

    def call(self, method: str, session: bool = True, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._to, json.dumps(msg).encode() + b"\0")
        while True:
            while b"\0" not in self._buf:
                # A browser that hangs fails the test in one line, never hangs the suite.
                if not select.select([self._from], [], [], 60)[0]:
                    raise RuntimeError(f"{method}: no reply from chromium in 60 s")
                chunk = os.read(self._from, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed the pipe: "
                                       + self.p.stderr.read().decode(errors="replace")[-2000:])
                self._buf += chunk
            raw, _, self._buf = self._buf.partition(b"\0")
            reply = json.loads(raw)
            if reply.get("id") == self._id:      # (events and other replies: not ours)
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def js(self, expr: str):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True,
                      awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def shot(self, rect: dict) -> np.ndarray:
        """RGB pixels of a page rectangle (page coordinates)."""
        from PIL import Image

        r = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                      clip={**rect, "scale": 1})
        return np.asarray(Image.open(io.BytesIO(base64.b64decode(r["data"]))).convert("RGB"))

    def close(self) -> None:
        os.close(self._to)
        os.close(self._from)
        self.p.kill()
        self.p.wait()
        shutil.rmtree(self._profile, ignore_errors=True)


RECT = """(() => { const r = document.querySelector(%r).getBoundingClientRect();
  return {x: r.left + scrollX, y: r.top + scrollY, width: r.width, height: r.height}; })()"""


def _cursor_x(img: np.ndarray) -> float:
    """The mean column of the cursor's pixels in a chart's picture: the only red there
    (the lines are blue and grey); a 1-px line between two pixel columns is drawn
    half-strength in both, so reddish, not exactly its colour."""
    px = img.astype(int)
    red = (px[..., 0] - px[..., 1] > 50) & (px[..., 0] - px[..., 2] > 50)
    cols = np.nonzero(red.sum(axis=0) >= img.shape[0] // 2)[0]   # a vertical line
    assert cols.size, "no cursor drawn"
    return float(cols.mean())


def test_the_scrubber_moves_the_frame_and_the_plot_cursor_in_chromium(tmp_path):
    n = 20
    write_log(tmp_path / "drive", n=n)
    write_log(tmp_path / "run-log", n=n, offset=lambda k: 0.02 * k)
    src, run = DriveLog.open(tmp_path / "drive"), DriveLog.open(tmp_path / "run-log")
    page = collect(tmp_path, src, run, src, PLAN, {"exit_code": 0, "mode": "lockstep"}, None,
                   {"model_out": "model_out", "control_cmd": "control_cmd"})
    assert page.frame_ids == list(range(n)) and not page.notes
    html = tmp_path / "report.html"
    write(html, page)

    b = Browser()
    try:
        b.call("Page.enable")
        b.call("Emulation.setDeviceMetricsOverride", width=1200, height=900,
               deviceScaleFactor=1, mobile=False)
        b.call("Page.navigate", url=html.as_uri())
        b.js("new Promise(r => { const f = () => document.readyState === 'complete' "
             "&& document.getElementById('scrub') ? r(1) : setTimeout(f, 20); f(); })")
        assert b.js("document.getElementById('frame-id').textContent") == "0"
        frame, chart = b.js(RECT % "#frame"), b.js(RECT % ".charts svg")
        img0, chart0 = b.shot(frame), b.shot(chart)

        # A mouse drag on the slider, as a developer would: press at its left end, move
        # to 70 % of its width, release (viewport coordinates: scroll it into view).
        b.js("document.getElementById('scrub').scrollIntoView({block: 'center'})")
        s = b.js("""(() => { const r = document.getElementById('scrub')
                     .getBoundingClientRect(); return [r.left, r.top, r.width, r.height]; })()""")
        y = s[1] + s[3] / 2
        for kind, x in (("mousePressed", s[0] + 3), ("mouseMoved", s[0] + 0.7 * s[2]),
                        ("mouseReleased", s[0] + 0.7 * s[2])):
            b.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left",
                   clickCount=1, buttons=0 if kind == "mouseReleased" else 1)
        pos = int(b.js("document.getElementById('scrub').value"))
        assert 10 <= pos <= 16, pos                         # ~70 % of 0..19
        assert b.js("document.getElementById('frame-id').textContent") == str(pos)
        img1, chart1 = b.shot(frame), b.shot(chart)
        # Nothing was fetched: every picture and datum is inline.
        assert b.js("performance.getEntriesByType('resource').length") == 0
    finally:
        b.close()

    # The picture is another frame of the drive (the synthetic road moves) ...
    assert img0.shape == img1.shape and img0.shape[1] >= 300
    assert np.abs(img0.astype(int) - img1.astype(int)).mean() > 2.0
    # ... and the cursor moved right on the chart, from the first frame to the chosen one.
    x0, x1 = _cursor_x(chart0), _cursor_x(chart1)
    svg_x0, svg_w = 150, 640 - 150 - 4                       # the plot area (report._chart)
    assert abs(x0 - svg_x0) <= 2, x0
    assert x1 == pytest.approx(svg_x0 + svg_w * pos / (n - 1), abs=3), (x1, pos)
