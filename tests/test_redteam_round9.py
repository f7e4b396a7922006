"""Red team, round 9 (docs/redteam9.md): what the humans see (console, journald, the
reviewer's signed audit, a developer's replay of a handed log) against an attacker who
knows the code.

Rows 1 and 6: a signed audit report and `audit verify` (files a reviewer is handed).
Rows 2 and 3: one real `supervisor run` (bubblewrap sandboxes, cgroups), its console a
real pty, its stderr journald's stream as far as it can tell, and a hostile research
worker's text. Row 4: the real `supervisor replay` of a copied drive log. Rows 5, 7 and
8: the real EventLog, Monitor and writer threads on a real pty or socketpair.

Each test asserts the claim the way it should hold. A claim that fails today is an
``xfail(strict=True)`` whose reason starts with "redteam9 row N"; the lead's fix turns it
into a plain pass. ``--runxfail`` shows the evidence of each break.
"""
from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import textwrap
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the signed audit (row 1)


@pytest.fixture
def signed_minimal(tmp_path: Path):
    """minimal.toml with its model artifact and public key copied beside it (absolute
    paths, as a vehicle's config names them), a JSON report of it made by the audit's
    own provenance and trust readers, and a reviewer's signature over the report."""
    from supervisor.audit.promise import trusted_models
    from supervisor.audit.provenance import provenance
    from supervisor.audit.sign import sign_file
    from supervisor.config import load
    from supervisor.model.keys import generate_private_key, load_private_key, public_key_text

    shutil.copytree(REPO / "models/demo/lane-offset", tmp_path / "art")
    shutil.copy(REPO / "models/demo/demo_ed25519.pub", tmp_path / "key.pub")
    text = (REPO / "supervisor/configs/minimal.toml").read_text()
    text = text.replace('"models/demo/lane-offset"', f'"{tmp_path}/art"')
    text = text.replace('"models/demo/demo_ed25519.pub"', f'"{tmp_path}/key.pub"')
    assert f"{tmp_path}/key.pub" in text and f"{tmp_path}/art" in text
    # A control worker of the vehicle's own package, outside the project (row 6): its
    # python_path root's and writable by no one else, as `check` requires.
    tmp_path.chmod(0o755)
    lib = tmp_path / "lib" / "rt9ctl"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text(_CTL_V1)
    for p in (tmp_path / "lib", lib):
        p.chmod(0o755)
    (lib / "__init__.py").chmod(0o644)
    assert text.count("[domains.control]\n") == 1
    text = text.replace("[domains.control]\n",
                        f'[domains.control]\npython_path = ["{tmp_path}/lib"]\n')
    text += ('\n[workers.c-own]\ndomain = "control"\nmodule = "rt9ctl"\n'
             'optional = true\n')
    cfg_path = tmp_path / "vehicle.toml"
    cfg_path.write_text(text)
    cfg = load(str(cfg_path))
    # What `audit --format json` puts in its provenance (the full audit takes ~20 s here;
    # verify reads only the provenance and the verdict).
    rows = [{"worker": w.name, "models": trusted_models(w, cfg)} for w in cfg.workers.values()]
    report = tmp_path / "audit.json"
    report.write_text(json.dumps({"provenance": provenance(cfg, rows), "result": "promise"},
                                 indent=1))
    key = tmp_path / "review.key"
    generate_private_key(key)
    key.chmod(0o600)
    (tmp_path / "review.pub").write_text(public_key_text(load_private_key(key).public_key()))
    sign_file(str(report), str(key))
    return tmp_path, cfg_path, report


_CTL_V1 = """
import time
def main(ctx):
    ctx.ready(status="c-own v1")
    while True:
        ctx.watchdog()
        time.sleep(0.05)
"""
# The same worker, changed after the review: it now pulls in a library the review never
# saw (here the standard library's ctypes, and what it loads; any code would do).
_CTL_V2 = _CTL_V1.replace("import time", "import ctypes, time  # changed after review")


def _resign_artifact(art: Path, pub: Path, attacker_key: Path) -> str:
    """The artifact's manifest re-signed by the attacker's key, whose public key replaces
    the file the config names: the config's bytes do not change. Returns the key id."""
    from supervisor.model.keys import (generate_private_key, key_id, load_private_key,
                                       public_key_text)

    generate_private_key(attacker_key)
    priv = load_private_key(attacker_key)
    m = json.loads((art / "manifest.json").read_bytes())
    m["signing"]["key_id"] = key_id(priv.public_key())
    mbytes = json.dumps(m, sort_keys=True, separators=(",", ":")).encode()   # canonical
    (art / "manifest.json").write_bytes(mbytes)
    (art / "manifest.sig").write_bytes(priv.sign(mbytes))
    pub.write_text(public_key_text(priv.public_key()))
    return key_id(priv.public_key())


def test_a_signed_audit_never_verifies_for_a_config_that_trusts_another_key(signed_minimal):
    """A reviewer signed the audit of a vehicle config that trusts the demo key for its
    model. Then the public key file the config names is replaced (and the artifact
    re-signed with the new key): `supervisor check` now trusts another signer, with the
    config's bytes unchanged. `audit verify --config` must not say the report covers it."""
    from supervisor.config import load
    from supervisor.model.trust import verify_models

    tmp, cfg_path, report = signed_minimal
    before = json.loads(report.read_text())["provenance"]["artifacts"][0]["key_id"]
    kid = _resign_artifact(tmp / "art", tmp / "key.pub", tmp / "attacker.key")
    trusted, problems = verify_models(load(str(cfg_path)))
    # The swap is real: the system that will run trusts the attacker's key.
    assert not problems and [t.key_id for t in trusted] == [kid] and kid != before
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "audit", "verify",
                        str(report), f"{report}.sig", str(tmp / "review.pub"),
                        "--config", str(cfg_path)],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    print(r.returncode, r.stdout, r.stderr)
    assert r.returncode != 0, "verify said OK for a config that trusts another model key"
    assert "FAILED" in r.stderr


def test_a_signed_audit_never_verifies_after_the_control_code_it_covers_changed(
        signed_minimal):
    """The reviewed config runs a control worker (`c-own`) from the vehicle's own package
    (`[domains.control] python_path`, root's, as check requires). After the report was
    signed, that module is changed (same TOML, same models). The audit's admission of
    that worker described code that no longer runs: verify must not say OK."""
    tmp, cfg_path, report = signed_minimal
    src = tmp / "lib" / "rt9ctl" / "__init__.py"
    src.write_text(_CTL_V2)
    r = subprocess.run([sys.executable, "-m", "supervisor.cli", "audit", "verify",
                        str(report), f"{report}.sig", str(tmp / "review.pub"),
                        "--config", str(cfg_path)],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    print(r.returncode, r.stdout, r.stderr)
    assert r.returncode != 0, "verify said OK after the control code it covers changed"
    assert "FAILED" in r.stderr


# ---------------------------------------------------------------- the fleet (rows 2-4)
#
# One real `supervisor run`: its console (stdout, the live status row) a real
# pseudo-terminal the test reads, its events (stderr) a file that the supervisor takes
# for journald's stream ($JOURNAL_STREAM names it: every line gets journald's <N>
# priority prefix, as under systemd). The hostile worker is research (`rt9w`, written at
# run time into a root-owned python_path): it writes what a compromised research worker
# would want an operator or a reviewer to read.

_RT9W = r'''
"""Red team round 9 workers (tests/test_redteam_round9.py writes this file)."""
import os
import sys
import time

MARK = "PWNED"

# What a hostile worker prints, raw bytes on its stdout/stderr: terminal escapes (a
# title, the clipboard through OSC 52, a cleared screen), a carriage return that would
# overwrite the row, NUL, invalid UTF-8, Unicode line breaks, lines that look like the
# supervisor's own events (JSON, and with journald's priority prefix), and a log record
# with keys of an event.
OUTPUT = [
    b"\x1b]0;PWNED title\x07\x1b[2J\x1b[H control ok\n",
    b"\x1b]52;c;UFdORUQ=\x07 PWNED clipboard\n",
    b"PWNED ordinary\rFAIL-SAFE cleared: ENGAGED +0.000 rad\n",
    b"PWNED nul\x00byte bad utf8 \xff\xfe\xc3\x28 end\n",
    "PWNED line\u2028break\u0085next\u202eesrever".encode(),
    b"\n",
    b'{"ts":1,"mono_ns":1,"source":"supervisor","event":"fail_safe","level":"error",'
    b'"reason":"PWNED forged"}\n',
    b'<0>{"ts":1,"source":"supervisor","event":"all_ready","level":"info","x":"PWNED"}\n',
    b'<3>PWNED journald priority\n',
    b'{"log":"PWNED rec","data":{"k\\u001b[2J":"\\u001b]0;t\\u0007"},"event":"fail_safe",'
    b'"source":"supervisor","level":"error","worker":"c","ts":1}\n',
]
STATUS = [
    b"STATUS=PWNED \x1b]0;title\x07\x1b[2J\x1b[1;1H engaged=1 reason=none\r\n",
    b"STATUS=PWNED\x1b[1A\x1b[2K FAIL-SAFE cleared \xff\n",
]


def ansi(ctx):
    ctx.ready(status="rt9 ansi")
    for chunk in OUTPUT:
        os.write(1, chunk)
        os.write(2, chunk)
    ctx.log("PWNED \x1b[31mred\x1b[0m \r", **{"k\x1b]0;x\x07": "v\x1b[2J"})
    for line in STATUS:
        os.write(ctx.status_fd, line)
        time.sleep(0.6)                 # each one a status event and a live row
    print("rt9 ansi: done", flush=True)
    while True:
        ctx.watchdog()
        time.sleep(0.05)


def main(ctx):
    attack = sys.argv[1]
    if attack == "ansi":
        return ansi(ctx)
    raise SystemExit("unknown attack " + attack)
'''


def _fleet_toml(pp: Path) -> str:
    return textwrap.dedent(f"""
    [supervisor]
    status_interval_s = 0.5
    [domains.control]
    actuates = true
    [domains.research]
    python_path = ["{pp}"]
    [channels.cmd]
    slot_size = "4KiB"
    dtype = "float32"
    payload = "control_cmd"
    max_age_ms = 50
    [workers.c]
    domain = "control"
    module = "workers.probe"
    publishes = ["cmd"]
    args = ["--publish", "cmd", "--period-ms", "10", "--ping-ms", "20"]
    watchdog_ms = 1000
    ready_timeout_ms = 30000
    [workers.r-ansi]
    domain = "research"
    module = "rt9w"
    args = ["ansi"]
    restart = "never"
    optional = true
    ready_timeout_ms = 30000
    """)


class Fleet:
    """`supervisor run` with stdout on a real pty (read and kept by the test, 160
    columns) and stderr a file that is journald's stream as far as it can tell."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="rt9-", dir="/tmp"))
        self.tmp.chmod(0o755)
        self.pp = self.tmp / "lib"
        (self.pp / "rt9w").mkdir(parents=True)
        for d in (self.pp, self.pp / "rt9w"):
            d.chmod(0o755)
        (self.pp / "rt9w" / "__init__.py").write_text(_RT9W)
        (self.pp / "rt9w" / "__init__.py").chmod(0o644)
        state = self.tmp / "state"
        state.mkdir(mode=0o700)
        cfg = self.tmp / "rt9.toml"
        cfg.write_text(_fleet_toml(self.pp))
        self.log_path = self.tmp / "journal.log"
        self.log = open(self.log_path, "wb")
        st = os.fstat(self.log.fileno())
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
        self.console = bytearray()
        self._stop = False
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()
        env = dict(os.environ, TRIO_STATE_DIR=str(state),
                   JOURNAL_STREAM=f"{st.st_dev}:{st.st_ino}")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor.cli", "run", "--config", str(cfg)],
            stdin=subprocess.DEVNULL, stdout=self.slave, stderr=self.log, cwd=REPO,
            process_group=0, env=env)

    def _drain(self) -> None:
        while not self._stop:
            r, _, _ = select.select([self.master], [], [], 0.2)
            if not r:
                continue
            try:
                got = os.read(self.master, 65536)
            except OSError:
                return
            if not got:
                return
            self.console += got

    def lines(self) -> list[bytes]:
        return self.log_path.read_bytes().splitlines()

    def events(self) -> list[dict]:
        out = []
        for line in self.lines():
            try:
                out.append(json.loads(line[3:]))
            except ValueError:
                pass             # a line being written now; checked whole at the end
        return out

    def wait_for(self, pred, timeout_s: float) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = [e for e in self.events() if pred(e)]
            if got or self.proc.poll() is not None:
                return got
            time.sleep(0.05)
        return []

    def tail(self, n: int = 30) -> str:
        return "\n".join(x.decode(errors="replace")[:300] for x in self.lines()[-n:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stop = True
        self._drainer.join(timeout=2)
        for fd in (self.slave, self.master):
            try:
                os.close(fd)
            except OSError:
                pass
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet():
    if shutil.which("bwrap") is None or os.geteuid() != 0:
        pytest.skip("the supervisor's sandboxes need bubblewrap and root")
    f = Fleet()
    try:
        got = f.wait_for(lambda e: e.get("event") in ("all_ready", "supervisor_exit")
                         and e.get("source") == "supervisor", 120)
        if not got or got[0]["event"] != "all_ready":
            pytest.fail("the fleet never became ready:\n" + f.tail())
        done = f.wait_for(lambda e: e.get("event") == "output" and e.get("worker") == "r-ansi"
                          and e.get("line") == "rt9 ansi: done", 30)
        if not done:
            pytest.fail("r-ansi never finished its attack:\n" + f.tail())
        time.sleep(1.5)                  # one more live row with its last status
        yield f
    finally:
        f.close()


def _strict_json(text: str) -> dict:
    def refuse(c: str):
        raise ValueError(f"not JSON: {c}")
    return json.loads(text, parse_constant=refuse)


# ------------------------------------------------------------------ row 2 (held)
@pytest.mark.sandbox
def test_a_research_workers_text_never_forges_an_event_or_a_journald_priority(fleet):
    """Every line the supervisor wrote to journald's stream is one event: its own <N>
    prefix, then strict ASCII JSON. Whatever r-ansi printed (JSON of a `fail_safe`, a
    `<0>` prefix, a log record with event keys) is an info event naming r-ansi; nothing
    is a supervisor event it forged, and no byte would act on a terminal."""
    raw = fleet.log_path.read_bytes()
    for bad in (b"\x1b", b"\x07", b"\x00", b"\r"):
        assert bad not in raw, f"{bad!r} reached the journal stream"
    assert all(b < 0x80 for b in raw), "a non-ASCII byte reached the journal stream"
    lines = raw.splitlines()
    evs = []
    for line in lines:
        assert re.match(rb"^<[0-7]>\{", line), line[:200]
        evs.append((int(line[1:2]), _strict_json(line[3:].decode())))
    mine = [(p, e) for p, e in evs if "PWNED" in json.dumps(e)]
    assert len(mine) >= 12, f"the attack's lines are missing:\n{fleet.tail()}"
    for prio, e in mine:
        assert e.get("worker") == "r-ansi", e
        assert e["event"] in ("output", "log", "status"), e
        assert prio == 6 and e["level"] == "info", (prio, e)
        assert e["source"] in ("r-ansi", "supervisor"), e
        if e["source"] == "supervisor":
            assert e["event"] == "status", e      # the supervisor's report, naming r-ansi
    forged = [e for _, e in evs if e.get("event") == "fail_safe"
              or (e.get("event") == "all_ready" and e.get("source") != "supervisor")]
    assert not forged, forged
    assert sum(e.get("event") == "all_ready" for _, e in evs) == 1
    rec = [e for _, e in mine if e["event"] == "log" and e.get("msg") == "PWNED rec"]
    assert rec and set(rec[0]) >= {"msg", "data"} and rec[0]["source"] == "r-ansi", rec
    assert rec[0]["ts"] != 1, rec[0]
    # The same events as `--log-format text` renders them: nothing a terminal acts on.
    from supervisor.events import render
    for _, e in mine:
        text = render(e, "text")
        assert text.isprintable(), repr(text)
    print(f"{len(lines)} journal lines, {len(mine)} carrying r-ansi's text, all <6> info")


# ------------------------------------------------------------------ row 3 (held)
@pytest.mark.sandbox
def test_a_research_workers_status_never_acts_on_the_operators_console(fleet):
    """The live row carries r-ansi's STATUS= text (escapes, a carriage return, a cursor
    move up): on the console pty the only control sequences are the supervisor's own
    (carriage return + erase line, and newlines), and the row still leads with the
    actuation state."""
    out = bytes(fleet.console)
    assert b"PWNED" in out, out[-2000:]
    stripped = out.replace(b"\r\x1b[2K", b"")
    for bad in (b"\x1b", b"\x07", b"\x00"):
        assert bad not in stripped, (bad, out[max(0, out.find(bad) - 200):][:400])
    rows = [r for r in re.split(rb"\r\x1b\[2K|\r?\n", out) if b"PWNED" in r]
    assert rows
    for r in rows:
        assert b"\r" not in r, r
        assert r.startswith((b"ENGAGED", b"SAFE")), r[:200]
        assert r.decode("utf-8").isprintable(), r
    print(f"console: {len(out)} bytes, {len(rows)} rows with r-ansi's status, e.g. "
          f"{rows[-1][:160]!r}")


# ---------------------------------------------------------------- a handed drive log (row 4)

_EVIL_R = '''
import os, socket, time
def main(ctx):
    names = [n for _, n in socket.if_nameindex()]
    with open(os.path.join(PROOF, "ran"), "w") as f:
        f.write("uid=%d interfaces=%s\\n" % (os.getuid(), ",".join(names)))
    print("rt9evil: research code from the drive log, interfaces", names, flush=True)
    ctx.ready(status="rt9 evil research")
    while True:
        ctx.watchdog()
        time.sleep(0.05)
'''
_EVIL_C = '''
import os, time
def main(ctx):
    print("rt9evil-c: control code from the drive log", flush=True)
    ctx.ready(status="rt9 evil control")
    while True:
        ctx.watchdog()
        time.sleep(0.05)
'''


@pytest.mark.sandbox
def test_a_handed_drive_log_never_runs_code_it_carries(tmp_path):
    """A colleague's drive log, copied here (`cp -r`, scp, an unpacked archive: the
    copier owns every file, so `trusted_source` accepts its source.toml). Its config
    adds a research worker with network and a writable bind outside the log, and a
    control worker, both of modules inside the log directory. Replaying a log must
    play its frames through this machine's pipeline, never run code the log brought."""
    if shutil.which("bwrap") is None or os.geteuid() != 0:
        pytest.skip("the replay's sandboxes need bubblewrap and root")
    from supervisor.config import dumps, minimal_doc
    from tests.test_replay_format import write_log

    tmp_path.chmod(0o755)
    log = tmp_path / "drive1"
    write_log(log, n=40)
    proof = tmp_path / "proof"
    proof.mkdir()
    proof.chmod(0o777)
    for name, src in (("rt9evil", f"PROOF = {str(proof)!r}\n" + _EVIL_R),
                      ("rt9evilc", _EVIL_C)):
        (log / "lib" / name).mkdir(parents=True, exist_ok=True)
        (log / "lib" / name / "__init__.py").write_text(src)
        (log / "lib" / name / "__init__.py").chmod(0o644)
        (log / "lib" / name).chmod(0o755)
    (log / "lib").chmod(0o755)
    doc = minimal_doc()
    doc["domains"]["research"].update(python_path=[str(log / "lib")], network=True,
                                      extra_rw_binds=[str(proof)])
    doc["domains"]["control"]["python_path"] = [str(log / "lib")]
    doc["workers"] = {
        "evil-c": {"domain": "control", "module": "rt9evilc", "restart": "never",
                   "optional": True},          # first: READY before the research one
        "evil": {"domain": "research", "module": "rt9evil", "restart": "never",
                 "optional": True},
        **doc["workers"]}
    (log / "source.toml").write_text(dumps(doc))
    (log / "source.toml").chmod(0o644)
    run = tmp_path / "run"
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "supervisor.cli", "replay", str(log),
                          "--out", str(run)], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, process_group=0)
    try:
        while (time.monotonic() - t0 < 60 and p.poll() is None
               and not (proof / "ran").exists()):
            time.sleep(0.1)
        ran_after = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)         # an ordered stop, as Ctrl-C
        try:
            out, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
    said = (proof / "ran").read_text() if (proof / "ran").exists() else ""
    # The control worker's output, in the run's lifecycle log (the events the replay
    # recorded; the run was stopped early, so read as bytes).
    life = run / "log" / "lifecycle.tlog"
    control = [b"rt9evil-c: control code"] if life.exists() and \
        b"rt9evil-c: control code" in life.read_bytes() else []
    print(f"after {ran_after:.1f} s: research proof {said.strip()!r}; control output "
          f"{control}; replay rc {p.returncode}\n"
          f"{out.decode(errors='replace')[-800:]}")
    assert not said, f"the log's research code ran, with network: {said}"
    assert not control, f"the log's control code ran: {control}"


# ---------------------------------------------------------------- the output queue (row 5)

# A console that reads 1 MiB/s (an ssh session over a modest link; this machine's own
# pty, read by a tight loop, takes ~41 MB/s; a serial console ~11 KB/s) shows the
# fail-safe within a second of the stall's end only if at most this much is ahead of it.
FAIL_SAFE_AHEAD_MAX = 1 << 20


def test_a_research_workers_output_never_puts_minutes_of_text_ahead_of_the_fail_safe():
    """The real EventLog on a real pty (the operator's console) whose output is stopped,
    as a slow or stalled console is. A research worker prints lines of 2048 bytes of
    0xff, at most what `LineLimiter` keeps (each an `output` event of 12 KiB: every
    invalid byte is U+FFFD, `\\ufffd` in JSON), until the queue is full (10,000 lines:
    200 s of one worker's allowed 50 lines/s, 40 s of five). Then control fails safe.
    The fail_safe line must not wait behind more than a second's worth of a slow console."""
    from supervisor import outstream
    from supervisor.events import EventLog
    from supervisor.output import LineLimiter

    master, slave = pty.openpty()
    tty = os.fdopen(slave, "w", encoding="utf-8", closefd=False)
    termios.tcflow(slave, termios.TCOOFF)
    try:
        log = EventLog(stream=tty, keep=False)
        lim = LineLimiter()
        line = lim.feed(b"\xff" * 5000 + b"\n", now=0.0)[0]   # what the limiter keeps
        assert len(line.encode("utf-8")) <= 3 * lim.max_line + 64
        for _ in range(outstream.MAX_PENDING):
            log.emit("output", source="r-noise", worker="r-noise", domain="research",
                     line=line)
        log.emit("fail_safe", domain="control", reason="controlsd gave up")
        w = log._writer
        assert w is not None
        with w._cond:
            queued = list(w._lines)
        vital = next(i for i, (rank, _) in enumerate(queued) if rank == outstream.VITAL)
        ahead = sum(len(text) for _, text in queued[:vital])
        print(f"{vital} lines, {ahead / 1e6:.1f} MB queued ahead of the fail_safe line "
              f"(each {len(queued[0][1])} bytes): {ahead / (1 << 20):.0f} s at 1 MiB/s")
        assert ahead <= FAIL_SAFE_AHEAD_MAX
    finally:
        os.close(master)                 # the writer's blocked write ends (EIO): no leak
        try:
            termios.tcflow(slave, termios.TCOON)
        except (OSError, termios.error):  # EIO: the master is gone already
            pass
        os.close(slave)


# ---------------------------------------------------------------- one journald stream (row 7)


def test_the_journal_stream_never_splits_an_event_line():
    """Under systemd stdout and stderr are one journald stream socket (the unit sets
    neither StandardOutput nor StandardError: stderr inherits stdout's). The real
    EventLog (stderr) and the real Monitor (stdout, not a terminal: one row per
    interval) each write it from a writer thread of their own. journald stalls for a
    second (busy, rotating) while a research worker prints lines of "<0>" (600 lines:
    12 s of one worker's allowed rate, or a burst of three), then reads on at ~2 MB/s.
    Every line journald reads must be one whole event (`<N>{...}`) or one whole row;
    none may start with a worker's text (journald reads a leading <0> as EMERG, which it
    forwards to every logged-in terminal)."""
    import socket

    from supervisor.events import EventLog
    from supervisor.monitor import Monitor

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    err = os.fdopen(os.dup(a.fileno()), "w")
    out = os.fdopen(os.dup(a.fileno()), "w")
    st = os.fstat(err.fileno())
    got = bytearray()
    resume, stop = threading.Event(), threading.Event()

    def journald() -> None:
        resume.wait()
        while not stop.is_set():
            try:
                data = b.recv(4096)
            except OSError:
                return
            if not data:
                return
            got.extend(data)
            time.sleep(0.002)

    reader = threading.Thread(target=journald, daemon=True)
    reader.start()
    try:
        log = EventLog(stream=err, keep=False, journal=True)
        assert f"{st.st_dev}:{st.st_ino}"         # (the unit's JOURNAL_STREAM names it)
        mon = Monitor({}, {}, out=out)
        mon.statuses["c"] = "engaged=1 reason=none"
        line = "<0>" * 682                        # 2046 bytes: what LineLimiter keeps
        for i in range(600):
            log.emit("output", source="r-noise", worker="r-noise", domain="research",
                     line=line)
            if i % 30 == 0:
                mon.print_line()                  # the row, every interval
            time.sleep(0.0015)
        resume.set()
        for _ in range(60):                       # rows 50x as often as the real 1 s,
            mon.print_line()                      # to meet every write of the backlog
            time.sleep(0.02)
        log.emit("fail_safe", domain="control", reason="controlsd gave up")
        assert log.drain(20)
        time.sleep(0.3)
    finally:
        stop.set()
        a.close()
        b.close()
        reader.join(timeout=2)
        for f in (err, out):
            try:
                f.close()
            except OSError:
                pass
    lines = [ln for ln in bytes(got).split(b"\n") if ln]
    row = mon.line(None).encode()
    whole = [ln for ln in lines if ln == row
             or (re.match(rb"^<[346]>\{", ln) and ln.endswith(b"}"))]
    broken = [ln for ln in lines if ln not in whole]
    emerg = [ln for ln in lines if ln.startswith(b"<0>")]
    print(f"{len(lines)} lines read, {len(broken)} not whole, {len(emerg)} starting <0> "
          f"(EMERG), e.g. {broken[:1]!r:.200}")
    assert not emerg, f"{len(emerg)} entries journald reads as EMERG"
    assert not broken, f"{len(broken)} of {len(lines)} lines split or joined"


_EXIT_CHILD = r'''
import sys, termios
sys.path.insert(0, sys.argv[1])
from supervisor.events import EventLog
from supervisor.output import LineLimiter
termios.tcflow(2, termios.TCOOFF)      # the console is behind (a slow link; Ctrl-S)
log = EventLog(stream=sys.stderr, keep=False)
line = LineLimiter().feed(b"\xff" * 5000 + b"\n", now=0.0)[0]
for _ in range(10000):
    log.emit("output", source="r-noise", worker="r-noise", domain="research", line=line)
log.emit("fail_safe", domain="control", reason="controlsd gave up")
log.emit("supervisor_exit", code=4)
termios.tcflow(2, termios.TCOON)       # it reads again; the supervisor exits, as run does
sys.exit(4)
'''


def test_a_research_workers_backlog_never_loses_the_fail_safe_line_at_exit():
    """Row 5's backlog, then what `run` does after failing safe: it exits (code 4) and
    the interpreter's exit gives every output stream 2 s to drain. The console is a
    real pty read at up to 4 MB/s (a modest ssh link). The fail_safe line must reach it."""
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-c", _EXIT_CHILD, str(REPO)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    got, tail, at = 0, b"", None
    try:
        while True:
            r, _, _ = select.select([master], [], [], 1.0)
            if not r:
                if p.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:               # EIO: the child's side is closed
                break
            if not data:
                break
            if at is None and b'"fail_safe"' in tail + data:
                at = got
            got += len(data)
            tail = data[-16:]
            time.sleep(0.001)             # a pty gives <= 4 KiB a read: <= 4 MB/s
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        os.close(master)
    print(f"exit {p.returncode}; the console got {got / 1e6:.1f} MB, the fail_safe line "
          f"{'at byte %d' % at if at is not None else 'never'}")
    assert p.returncode == 4
    assert at is not None, "the fail_safe line never reached the console"
