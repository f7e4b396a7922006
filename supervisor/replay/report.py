"""``report.html``: one self-contained page per replay, to attach to a CI job.

No network: the road video's frames are inline PNGs (data: URIs), the signals inline
SVG, plot.png inline, one small script and no external reference at all (a CI
artifact viewer may be offline, and a page that fetches nothing leaks nothing). What
it shows: the verdict (and why), the replay's summary, with ``--ref`` the per-channel
and per-field comparison with the first divergent values, the model time gate, and a
scrubber: a slider over the log's frames that shows the frame and moves a cursor over
every signal (the run's, REF's dashed), with the values at that frame.

`collect` reads what a run left (summary, logs, diff) into a `Page`; `render` is pure
(text in, text out), so the page is tested without a pipeline.
"""
from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from schemas.payloads import PAYLOADS

from .diff import Report, log_loss_notes

MAX_FRAMES = 100        # frames in the scrubber (evenly spread over the log): ~1-2 MB
THUMB_W = 192           # their width in pixels (grey: the Y plane, area-averaged)


@dataclass
class Signal:
    """One field over frames: the run's values and REF's (None where absent)."""

    name: str                                   # CHANNEL.FIELD
    run: dict[int, float] = field(default_factory=dict)   # frame id -> value
    ref: dict[int, float] = field(default_factory=dict)


@dataclass
class Page:
    title: str
    summary: dict[str, Any]
    report: Report | None = None
    plot_png: bytes | None = None
    frame_ids: list[int] = field(default_factory=list)    # the scrubber's positions
    thumbs: dict[int, bytes] = field(default_factory=dict)  # frame id -> PNG
    signals: list[Signal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- PNG, without a library


def png_grey(img: np.ndarray) -> bytes:
    """An 8-bit greyscale PNG of ``img`` (H x W uint8): zlib and struct only, so the
    report needs nothing the replay does not (and no network)."""
    img = np.ascontiguousarray(img, np.uint8)
    h, w = img.shape
    raw = b"".join(b"\x00" + img[r].tobytes() for r in range(h))   # filter 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def thumb(nv12: bytes, width: int, height: int, out_w: int = THUMB_W) -> np.ndarray:
    """The Y plane of a tightly packed NV12 frame, area-averaged down to ``out_w``."""
    y = np.frombuffer(nv12, np.uint8, width * height).reshape(height, width)
    k = max(1, math.ceil(width / out_w))
    h2, w2 = height // k, width // k
    return y[:h2 * k, :w2 * k].reshape(h2, k, w2, k).mean(axis=(1, 3)).astype(np.uint8)


# ---------------------------------------------------------------- collecting


def _first_per_frame(msgs) -> dict[int, Any]:
    out: dict[int, Any] = {}
    for m in msgs:
        if m.frame_id is not None and m.frame_id not in out:
            out[m.frame_id] = m
    return out


def _fields(payload: str | None, width: int) -> list[str]:
    p = PAYLOADS.get(payload or "")
    if p is not None and len(p.fields) == width:
        return list(p.fields)
    return [f"[{i}]" for i in range(width)]


def signals_of(run, ref, channels: list[str], payloads: dict[str, str]) -> list[Signal]:
    """Every field of ``channels`` per frame id (the first message per frame, as the
    diff pairs them), for the run and REF."""
    out: list[Signal] = []
    for ch in channels:
        a = _first_per_frame(run.messages.get(ch, []))
        b = _first_per_frame(ref.messages.get(ch, [])) if ref is not None else {}
        width = next((m.array.size for m in (*a.values(), *b.values())), 0)
        for i, name in enumerate(_fields(payloads.get(ch), width)):
            s = Signal(f"{ch}.{name}")
            for side, msgs in ((s.run, a), (s.ref, b)):
                for fid, m in msgs.items():
                    v = m.array.ravel()
                    if i < v.size:
                        side[fid] = float(v[i])
            out.append(s)
    return out


def chosen_signals(run, ref, sigs: list) -> list[Signal]:
    """--plot's signals (`signals.Sig`) per frame id, for the run and REF."""
    from .signals import value

    out: list[Signal] = []
    for sig in sigs:
        s = Signal(sig.name)
        for side, log in ((s.run, run), (s.ref, ref)):
            if log is None:
                continue
            for fid, m in _first_per_frame(log.messages.get(sig.channel, [])).items():
                v = value(m, sig)
                if v is not None:
                    side[fid] = v
        out.append(s)
    return out


def collect(run_dir: str | Path, src, run, ref, plan, summary: dict[str, Any],
            report: Report | None, payloads: dict[str, str], signals: list | None = None
            ) -> Page:
    """What the run left, as a page. A part that cannot be read (a video without its
    decoder, a missing plot) is left out and named in the page's notes. ``signals``
    (--plot's) replace the default ones: every field of the command and the model's
    output."""
    from .cut import title

    run_dir = Path(run_dir)
    page = Page(f"replay of {title(src)}", summary, report)
    png = run_dir / "plot.png"
    if png.is_file():
        page.plot_png = png.read_bytes()
    try:
        video = src.video(plan.frames)
        ids = [e.frame_id for e in video.index]
        step = max(1, math.ceil(len(ids) / MAX_FRAMES))
        want = set(ids[::step])
        w, h = video.info.width, video.info.height
        for e, data in video.frames():
            if e.frame_id in want:
                page.thumbs[e.frame_id] = png_grey(thumb(data, w, h))
        page.frame_ids = [f for f in ids if f in page.thumbs]
    except Exception as e:                       # the page still has everything else
        page.notes.append(f"frames not shown: {type(e).__name__}: {e}")
    if signals:
        page.signals = chosen_signals(run, ref, signals)
    else:
        chans = [c for c in (plan.command, plan.model_out) if c]
        page.signals = signals_of(run, ref, chans, payloads)
    return page


# ---------------------------------------------------------------- rendering

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;max-width:1100px}
h1{font-size:1.3em} h2{font-size:1.1em;margin-top:1.6em}
.verdict{padding:.6em 1em;border-radius:6px;font-weight:600;display:inline-block}
.ok{background:#dff5e1;color:#155d27}.bad{background:#fde2e1;color:#8a1c14}
.none{background:#eee}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.25em .6em;
text-align:right}th{background:#f4f4f4}td:first-child,th:first-child{text-align:left}
.scrub{display:flex;gap:1em;align-items:flex-start}.scrub img{image-rendering:pixelated;
width:384px;border:1px solid #999}.charts svg{display:block;margin-bottom:4px}
code{background:#f4f4f4;padding:0 .2em}
"""

# The scrubber: the slider picks a frame; its picture, the cursor on every chart and the
# values table follow. Data is inline (JSON); nothing is fetched.
_JS = """
const D = JSON.parse(document.getElementById('scrub-data').textContent);
const slider = document.getElementById('scrub');
function show(i){
  const fid = D.frames[i];
  document.getElementById('frame').src = D.thumbs[i];
  document.getElementById('frame-id').textContent = fid;
  document.querySelectorAll('line.cursor').forEach(l => {
    const x = l.dataset.x0 * 1 + (l.dataset.w * 1) * (D.n > 1 ? i / (D.n - 1) : 0);
    l.setAttribute('x1', x); l.setAttribute('x2', x);
  });
  // Built node by node, text by textContent: a signal's name is data, never markup.
  const tbody = document.getElementById('values');
  const head = document.createElement('tr');
  ['signal', 'run', 'REF'].forEach(t => {
    const th = document.createElement('th'); th.textContent = t; head.appendChild(th);
  });
  const rows = [head];
  D.signals.forEach(s => {
    const tr = document.createElement('tr');
    const td = document.createElement('td');
    const code = document.createElement('code');
    code.textContent = s.name;
    td.appendChild(code); tr.appendChild(td);
    [s.run[fid], s.ref[fid]].forEach(v => {
      const c = document.createElement('td'); c.textContent = fmt(v); tr.appendChild(c);
    });
    rows.push(tr);
  });
  tbody.replaceChildren(...rows);
}
function fmt(v){ return v === undefined || v === null ? '-' : Number(v).toPrecision(6); }
slider.addEventListener('input', e => show(e.target.value * 1));
show(0);
"""

# The only script the page may run is this one, by hash (CSP): no inline handler, no
# injected <script>, runs even if a value ever escaped its escaping (red team round 5).
_JS_HASH = "sha256-" + base64.b64encode(hashlib.sha256(_JS.encode()).digest()).decode()

_CHART_W, _CHART_H, _PAD = 640, 70, 4


def _esc(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _chart(sig: Signal, ids: list[int]) -> str:
    """An inline SVG of one signal over the scrubber's frames (run solid, REF dashed),
    with a cursor line the script moves."""
    vals = [v for side in (sig.run, sig.ref) for v in side.values() if math.isfinite(v)]
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    if hi - lo < 1e-12:
        lo, hi = lo - 1, hi + 1
    all_ids = sorted(set(sig.run) | set(sig.ref)) or ids
    f0, f1 = (all_ids[0], all_ids[-1]) if all_ids else (0, 1)
    span = max(f1 - f0, 1)
    x0, w = 150, _CHART_W - 150 - _PAD
    x_of = (lambda f: x0 + w * (f - f0) / span)
    y_of = (lambda v: _PAD + (_CHART_H - 2 * _PAD) * (1 - (v - lo) / (hi - lo)))

    def line(side: dict[int, float], style: str) -> str:
        pts = " ".join(f"{x_of(f):.1f},{y_of(v):.1f}" for f, v in sorted(side.items())
                       if math.isfinite(v))
        return f'<polyline fill="none" {style} points="{pts}"/>' if pts else ""

    # The cursor spans the scrubber's first to last frame (its own x range).
    cx0 = x_of(ids[0]) if ids else x0
    cw = (x_of(ids[-1]) - cx0) if ids else w
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{_CHART_W}" height="{_CHART_H}" '
            f'role="img" aria-label="{_esc(sig.name)}">'
            f'<rect x="{x0}" y="0" width="{w}" height="{_CHART_H}" fill="#fafafa" stroke="#ddd"/>'
            f'<text x="2" y="14" font-size="11">{_esc(sig.name)}</text>'
            f'<text x="2" y="30" font-size="10" fill="#666">{hi:.4g}</text>'
            f'<text x="2" y="{_CHART_H - 4}" font-size="10" fill="#666">{lo:.4g}</text>'
            + line(sig.ref, 'stroke="#999" stroke-dasharray="4 3" stroke-width="1.2"')
            + line(sig.run, 'stroke="#1f5fbf" stroke-width="1.2"')
            + f'<line class="cursor" data-x0="{cx0:.1f}" data-w="{cw:.1f}" x1="{cx0:.1f}" '
              f'x2="{cx0:.1f}" y1="0" y2="{_CHART_H}" stroke="#d33" stroke-width="1"/></svg>')


def _verdict(page: Page) -> tuple[str, str]:
    s, r = page.summary, page.report
    code = s.get("exit_code")
    if s.get("error"):
        return "bad", f"FAILED (exit {code}): {s['error']}"
    if r is None:
        return "none", f"no comparison (no --ref): exit {code}"
    if r.ok:
        return "ok", "within tolerance (exit 0)"
    first = ("" if r.first_divergent_frame is None
             else f", first divergent frame {r.first_divergent_frame}")
    from .diff import time_only

    why = f": {time_only(r)}" if time_only(r) else ""
    return "bad", f"DIFFERS (exit {code}){first}{why}"


def _summary_rows(s: dict[str, Any]) -> list[tuple[str, Any]]:
    f, lat = s.get("frames", {}), s.get("model_latency_ms", {})
    drops = sum(sum(v.values()) for v in s.get("drops", {}).values())
    fmt = (lambda v: "-" if v is None else f"{v:.2f}")
    return [("log", s.get("log", "")), ("mode", s.get("mode", "")),
            ("frames replayed / in log", f"{f.get('replayed', 0)} / {f.get('in_log', 0)}"),
            ("model outputs", f.get("model_outputs", 0)), ("commands", f.get("commands", 0)),
            ("step timeouts", f.get("step_timeouts", 0)), ("drops", drops),
            ("model latency p50 / p99 / max (ms)",
             f"{fmt(lat.get('p50'))} / {fmt(lat.get('p99'))} / {fmt(lat.get('max'))}"),
            ("deadline misses", s.get("deadline_misses", 0)),
            ("speed vs real time", s.get("speed_vs_realtime")),
            ("pipeline start-up (s)", s.get("pipeline_start_s")),
            ("input log", (s.get("input_log_loss") or {}).get("text", ""))]


def _table(head: list[str], rows: list[list[Any]]) -> str:
    return ("<table><tr>" + "".join(f"<th>{_esc(h)}</th>" for h in head) + "</tr>"
            + "".join("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in r) + "</tr>" for r in rows)
            + "</table>")


def _diff_html(r: Report) -> str:
    out = [f"<h2>Comparison</h2><p>run <code>{_esc(r.run)}</code> against REF "
           f"<code>{_esc(r.ref)}</code></p>"]
    rows = []
    for c in r.channels:
        rows.append([c.channel, "yes" if c.gated else "no (reported only)",
                     c.note or c.compared, "" if c.note else len(c.added),
                     "" if c.note else len(c.removed), "" if c.note else len(c.changed),
                     "ok" if c.ok else "DIFFERS"])
    out.append('<table id="channels">' + _table(
        ["channel", "gated", "compared", "added", "removed", "changed", "result"],
        rows)[len("<table>"):])
    dups = [f"{c.channel} ({'REF' if side == 'ref' else 'run'}): "
            f"{', '.join(str(i) for i in d[:8])}{' ...' if len(d) > 8 else ''}"
            for c in r.channels for side, d in c.duplicated.items()]
    bad = [f"{c.channel} ({'REF' if side == 'ref' else 'run'}): "
           f"{', '.join(str(i) for i in d[:8])}{' ...' if len(d) > 8 else ''}"
           for c in r.channels for side, d in c.nonfinite.items()]
    if bad:
        out.append(f"<p>NaN or infinity in: {_esc('; '.join(bad))}</p>")
    if dups:
        out.append(f"<p>duplicated frames (more than one message; the first compared): "
                   f"{_esc('; '.join(dups))}</p>")
    edges = [f"{c.channel} ({', '.join(f'{k} {n}' for k, n in c.edges.items())})"
             for c in r.channels if c.edges]
    if edges:
        out.append(f"<p>at the log's edges, not compared (the recording had not begun or "
                   f"had ended): {_esc('; '.join(edges))}</p>")
    lost = [f"{c.channel}: {'; '.join(log_loss_notes(c))}" for c in r.channels
            if log_loss_notes(c)]
    if lost:
        out.append(f"<p>the log's own loss, set aside: {_esc(' | '.join(lost))}</p>")
    if r.ignored:
        out.append(f"<p>ignored channels: {_esc(', '.join(r.ignored))}</p>")
    fields = [(c.channel, f) for c in r.channels for f in c.fields if f.changed or f.max_abs]
    if fields:
        out.append("<h2>Fields</h2>" + _table(
            ["field", "over tolerance", "max |diff|", "at frame", "tolerance"],
            [[f"{ch}.{f.name}", f.changed, f"{f.max_abs:.6g}",
              "" if f.at_frame is None else f.at_frame, f"{f.tolerance:g}"]
             for ch, f in fields]))
        ex = [[f"{ch}.{f.name}", x["frame"], x["ref"], x["run"], x["diff"]]
              for ch, f in fields for x in f.examples]
        if ex:
            out.append("<h2>First divergent values</h2>"
                       + _table(["field", "frame", "REF", "run", "|diff|"], ex))
    g = r.gate
    if g.p99_ms is None:
        out.append(f"<p>model time: {_esc(g.why)}</p>")
    else:
        rows = []
        for k, v, rv in (("p99", g.p99_ms, g.ref_p99_ms), ("max", g.max_ms, g.ref_max_ms)):
            lim = g.limit(k)
            rows.append([k, f"{v:.2f}", f"{rv:.2f}",
                         "not gated" if lim is None else f"{lim:.2f}"])
        out.append("<h2>Model time</h2>" + f"<p>{_esc(g.label())}</p>"
                   + _table(["", "run (ms)", "REF (ms)", "limit (ms)"], rows)
                   + ("" if g.ok else f"<p><b>failed:</b> {_esc(g.why)}</p>"))
    return "\n".join(out)


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def render(page: Page) -> str:
    """The page as one HTML document (every value escaped; the scrubber's data is
    inline JSON, ``</`` escaped so no value can end the script)."""
    cls, text = _verdict(page)
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             # Nothing may be fetched: no network from a CI artifact, ever.
             '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
             'img-src data:; style-src \'unsafe-inline\'; '
             f'script-src \'{_JS_HASH}\'">',
             f"<title>{_esc(page.title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{_esc(page.title)}</h1>",
             f'<p id="verdict" class="verdict {cls}">{_esc(text)}</p>',
             "<h2>Summary</h2>" + _table(["", ""], [list(r) for r in _summary_rows(page.summary)])]
    if page.report is not None:
        parts.append(_diff_html(page.report))
    if page.frame_ids and page.signals:
        ids = page.frame_ids
        data = {"frames": ids, "n": len(ids),
                "thumbs": [_data_uri(page.thumbs[f]) for f in ids],
                "signals": [{"name": s.name,
                             "run": {str(f): s.run[f] for f in ids if f in s.run
                                     and math.isfinite(s.run[f])},
                             "ref": {str(f): s.ref[f] for f in ids if f in s.ref
                                     and math.isfinite(s.ref[f])}}
                            for s in page.signals]}
        blob = json.dumps(data).replace("</", "<\\/")
        parts += ["<h2>Frames and signals</h2>",
                  f'<p>frame <b id="frame-id">{ids[0]}</b> <input type="range" id="scrub" '
                  f'min="0" max="{len(ids) - 1}" value="0" style="width:60%"> '
                  f"({len(ids)} of the log's frames; run solid, REF dashed)</p>",
                  '<div class="scrub"><img id="frame" alt="road frame" src="'
                  f'{_data_uri(page.thumbs[ids[0]])}"><table id="values"></table></div>',
                  '<div class="charts">' + "".join(_chart(s, ids) for s in page.signals)
                  + "</div>",
                  f'<script type="application/json" id="scrub-data">{blob}</script>',
                  f"<script>{_JS}</script>"]
    if page.plot_png:
        parts.append(f'<h2>plot.png</h2><img alt="plot" src="{_data_uri(page.plot_png)}">')
    for n in page.notes:
        parts.append(f'<p class="note">{_esc(n)}</p>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write(path: str | Path, page: Page) -> None:
    """The page at ``path``, through its directory's fd (`supervisor.outdir`: a
    directory another user could swap is refused, a link planted under the name is
    replaced, never written through). OSError or OutDirError is the caller's."""
    from supervisor.outdir import OutDir

    path = os.path.abspath(path)
    with OutDir.open(os.path.dirname(path), what="report", create=False, empty=False) as d:
        d.write_text(os.path.basename(path), render(page))
