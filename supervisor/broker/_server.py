"""The privileged broker: the only process that keeps root once the supervisor is split
(issue 27). It does what needs privilege and nothing else: builds and starts a worker's
sandbox from the config it loaded itself (cgroup leaf, bwrap as the domain's user),
signals, kills and reaps what it started, opens /proc files of those processes, and
writes the fail-safe latch in its state dir. It never reads a worker's output, status
or exec-watch notification: it makes the pipes and sockets and hands the read ends to
the supervisor proper.

One request at a time on the main thread (bwrap's --die-with-parent is bound to the
thread that forks it, see sandbox/launch.py), one reply per request. Every refusal is
one `broker_refused` event and a typed error to the client; an unexpected exception is
one `broker_error` event and a `failed` reply, never the broker's end. End of stream
(the supervisor proper is gone) kills every sandbox the broker started, and it exits.
"""
from __future__ import annotations

import collections
import ctypes
import errno
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from supervisor.config import CONTROL, Config, WorkerConfig
from supervisor.sandbox.policy import CUDA_DEVICE_NODES
from supervisor.events import EventLog
from supervisor.protocol import ENV_EXECWATCH_FD, ENV_STANDBY_FD, endpoint_for, worker_env

from . import _protocol as P
from ._checks import ChannelPins, StateDir, check_channel_fds, check_plan
from ._errors import BadFds, BrokerError, Failed, NotOurs, Refused, UnknownWorker


# Live (started, not reaped) sandboxes of one worker: its run and the previous run not
# yet reaped, plus two warm standbys for a worker with warm_standby
# (lifecycle/_standby.py STANDBY_DEPTH). More is a client starting sandboxes in a loop.
MAX_LIVE = 2
MAX_LIVE_STANDBY = 2 + 2
# readFilters answered at once, each on a thread of its own for up to wx.VERIFY_WALL_S:
# one per READY of a sandbox is what an honest client asks (the car: 7 at most at once).
MAX_VERIFYING = 32


@dataclass
class _Incarnation:
    """One sandbox the broker started and has not reaped."""

    worker: str
    number: int
    proc: subprocess.Popen
    cgroup: object | None = None        # sandbox.cgroups.WorkerCgroup
    oom_before: int = 0
    # A standby's hand-over socket (our end), held here until `adopt` sends its channels
    # through it, never handed to the supervisor proper (red team 10 row 9): None for a
    # run, and once handed over.
    ctl: socket.socket | None = None

    def close_ctl(self) -> None:
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None

    @property
    def leaves(self) -> tuple[str, ...]:
        """"/TREE/LEAF" of each of its cgroup directories, as /proc/PID/cgroup shows
        them (relative to each hierarchy's root)."""
        if self.cgroup is None:
            return ()
        return tuple(dict.fromkeys("/" + "/".join(p.rstrip("/").split("/")[-2:])
                                   for p in self.cgroup.paths))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def pids(self) -> set[int]:
        """Host pids of the sandbox now: its cgroup's members (bwrap gone or not), else
        bwrap and its descendants while bwrap lives."""
        if self.cgroup is not None:
            try:
                return set(self.cgroup.pids())
            except OSError:
                pass
        if not self.alive:
            return set()
        from supervisor.sandbox import descendant_pids

        return {self.proc.pid, *descendant_pids(self.proc.pid)}


def _cgroup_paths(pid: int) -> set[str]:
    """The cgroup paths of `pid` in each hierarchy (/proc/PID/cgroup), empty if gone."""
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return set()
    return {line.split(":", 2)[2] for line in text.splitlines() if line.count(":") >= 2}


_NR_TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine(), -1)
_libc = ctypes.CDLL(None, use_errno=True)


def tgkill(pid: int, tid: int, sig: int) -> bool:
    """tgkill(2); False if the thread is gone (ESRCH), OSError for anything else."""
    if _libc.syscall(ctypes.c_long(_NR_TGKILL), ctypes.c_long(pid), ctypes.c_long(tid),
                     ctypes.c_long(sig)) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.ESRCH:
        return False
    raise OSError(err, f"tgkill({pid}, {tid}, {sig})")


@dataclass
class Broker:
    config: Config
    state: StateDir
    sock: socket.socket
    log: EventLog
    python: str = sys.executable
    cgroups: object | None = None                 # sandbox.cgroups.CgroupTree
    live: dict[tuple[str, int], _Incarnation] = field(default_factory=dict)
    last_incarnation: dict[str, int] = field(default_factory=dict)
    # Incarnations reaped lately (bounded): `pids` of one is empty, not a refusal.
    reaped: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))
    refusals: collections.Counter = field(default_factory=collections.Counter)
    by_request: collections.Counter = field(default_factory=collections.Counter)
    served: int = 0
    _leaf_seq: int = 0
    # Cgroups of reaped sandboxes being killed empty and removed off the main thread
    # (`_reap`): joined before the tree is closed.
    _releasing: list = field(default_factory=list)
    # readFilters requests being answered on threads of their own (`_one`): joined
    # before the sandboxes are stopped. Replies leave under `_send_lock`.
    _verifying: list = field(default_factory=list)
    _send_lock: threading.Lock = field(default_factory=threading.Lock)
    # Which memfd is which channel's, from each channel's first start (_checks).
    pins: ChannelPins = field(default_factory=ChannelPins)
    rt_reserved: int | None = None     # % of a CPU reserved for the tree's RT leaves (v1)
    rt_error: str = ""                 # why none could be reserved

    # ------------------------------------------------------------ start and end

    def open_cgroups(self) -> None:
        """One cgroup tree for the broker's sandboxes (root only), partial where the
        machine delegates only some controllers; what is off is said once."""
        if os.geteuid() != 0:
            return
        from supervisor.sandbox.cgroups import CgroupTree, CgroupUnavailable, limits_off

        try:
            self.cgroups = CgroupTree.create(partial=True)
        except (CgroupUnavailable, OSError) as e:
            self.log.emit("limits_not_enforced", source="broker",
                          **limits_off(None, str(e)).event())
            return
        off = limits_off(self.cgroups)
        if off is not None:
            self.log.emit("limits_not_enforced", source="broker", **off.event())
        self._reserve_rt()

    def _reserve_rt(self) -> None:
        """The tree's RT bandwidth, as the in-process supervisor reserves it
        (lifecycle/_realtime.py): every RT worker's budget plus the largest once more (an
        adopted standby may be READY before the dead run's leaf is gone), else exactly
        the budgets. On cgroup v1 with RT group scheduling a leaf's cpu.rt_runtime_us
        must fit in its parent's, which is 0 for a new tree: without this every
        `realtime` request failed (EINVAL) and controlsd ran in the normal class."""
        from supervisor.sandbox.sched import RT_PERIOD_US

        budgets = [w.realtime().budget_pct for w in self.config.workers.values()
                   if w.realtime_priority is not None]
        self.rt_reserved = None
        if not budgets or self.cgroups is None:
            return
        err: OSError | None = None
        for pct in dict.fromkeys((min(sum(budgets) + max(budgets), 90), sum(budgets))):
            try:
                grouped = self.cgroups.reserve_rt(pct * RT_PERIOD_US // 100, RT_PERIOD_US)
            except OSError as e:
                err = e
                continue
            self.rt_reserved = pct if grouped else None
            return
        self.rt_error = (f"reserving {sum(budgets)} % of a CPU for RT workers: {err} (the "
                         "broker's own cgroup has less RT runtime: give it cpu.rt_runtime_us)")
        self.log.emit("realtime_unavailable", source="broker", worker=None,
                      reason=self.rt_error)

    def serve(self) -> int:
        self.log.emit("broker_start", source="broker", pid=os.getpid(), uid=os.geteuid(),
                      config=self.config.source, state_dir=self.state.path,
                      workers=sorted(self.config.workers))
        try:
            while True:
                try:
                    got = P.recv(self.sock)
                except BrokerError as e:          # cut by the kernel: no id to answer
                    self._refused("?", e)
                    self._send(0, P.Error(e.code, e.reason))
                    continue
                except InterruptedError:
                    continue
                except OSError as e:
                    self.log.emit("broker_error", source="broker", error=f"recv: {e}")
                    break
                if got is None:
                    break
                self._one(*got)
        finally:
            self.stop_all()
            self.state.close()
        self.log.emit("broker_exit", source="broker", served=self.served,
                      by_request=dict(self.by_request.most_common()),
                      refusals=dict(self.refusals))
        return 0

    def stop_all(self) -> None:
        """Kill every sandbox still held, then the cgroup tree (nothing outlives us)."""
        for t in self._releasing:
            t.join()
        self._releasing.clear()
        for inc in list(self.live.values()):
            try:
                self._kill_incarnation(inc)
            except Failed as e:                  # the next one all the same
                self.log.emit("cgroup_error", source="broker", worker=inc.worker, error=str(e))
        # Killed first: a read-back of one of them (up to wx.VERIFY_WALL_S on a thread
        # that will not stop) ends with its process, instead of holding the kills.
        for t in self._verifying:
            t.join()
        self._verifying.clear()
        for inc in list(self.live.values()):
            try:
                inc.proc.wait(5)
            except subprocess.TimeoutExpired as e:
                self.log.emit("cgroup_error", source="broker", worker=inc.worker, error=str(e))
            self._release(inc)
            inc.close_ctl()
        self.live.clear()
        if self.cgroups is not None:
            try:
                self.cgroups.close()
            except OSError as e:
                self.log.emit("cgroup_error", source="broker", error=str(e))
            self.cgroups = None

    def _send(self, rid: int, rep: P.Reply, fds: list[int] = ()) -> None:
        try:
            with self._send_lock:
                P.send(self.sock, P.encode_reply(rid, rep), fds)
        except OSError as e:
            self.log.emit("broker_error", source="broker", error=f"send: {e}")

    def _refused(self, kind: str, e: BrokerError, **fields) -> None:
        self.refusals[e.code] += 1
        self.log.emit("broker_refused", source="broker", request=kind, code=e.code,
                      reason=e.reason, **fields)

    def _one(self, data: bytes, fds: list[int]) -> None:
        """Decode, judge and answer one request. Every received fd is closed here once
        the request is done (a started sandbox holds its own copies); the fds of the
        reply are ours and closed once sent."""
        self.served += 1
        rid, kind, req = 0, "?", None
        try:
            rid, req = P.decode_request(data)
            kind = P.kind_of(req)
            self.by_request[kind] += 1
        except Exception as e:           # answered as any other refusal or bug, below
            self._answer(getattr(e, "rid", 0), kind, None, fds, undecodable=e)
            return
        if isinstance(req, P.ReadFilters):
            # The W^X read-back seizes every thread of a process and may take up to
            # wx.VERIFY_WALL_S (a thread that will not stop): on this thread it held
            # every other request, a dying control writer's `pids` (the supervisor's
            # SAFE path) among them. Its own thread (ptrace requests come from the
            # seizing thread, and it seizes and lets go within the one call); the
            # proper's client matches replies by id.
            self._verifying = [t for t in self._verifying if t.is_alive()]
            if len(self._verifying) >= MAX_VERIFYING:
                # One per READY of a sandbox is what an honest proper asks; a
                # compromised one asking in a loop had a root thread started for each
                # (red team 13's note): refused while the others are in flight.
                self._answer(rid, kind, None, fds, undecodable=Refused(
                    f"{len(self._verifying)} readFilters requests already in flight"))
                return
            t = threading.Thread(target=self._answer, args=(rid, kind, req, fds),
                                 daemon=True, name="broker-readFilters")
            self._verifying.append(t)
            t.start()
            return
        self._answer(rid, kind, req, fds)

    def _answer(self, rid: int, kind: str, req: P.Request | None, fds: list[int],
                undecodable: Exception | None = None) -> None:
        out: list[int] = []
        try:
            if undecodable is not None:
                raise undecodable
            if fds and not isinstance(req, P.WITH_CHANNELS):
                raise BadFds(f"{len(fds)} fds with a {kind} request, which takes none")
            rep, out = self._handle(req, fds)
        except BrokerError as e:
            # A start's or adopt's refusal names the worker it was for (the reason may
            # name only a channel).
            self._refused(kind, e, **({"worker": req.worker}
                                      if isinstance(req, P.WITH_CHANNELS) else {}))
            rep = P.Error(e.code, e.reason, e.errno)
        except Exception as e:      # a bug of ours: one line, a reply, and on we go
            self.refusals["failed"] += 1
            line = f"{type(e).__name__}: {' '.join(str(e).split())}"[:500]
            self.log.emit("broker_error", source="broker", request=kind, error=line)
            rep = P.Error("failed", line)
        finally:
            P.close_fds(fds)
        try:
            self._send(rid, rep, out)
        finally:
            P.close_fds(out)

    def _handle(self, req: P.Request, fds: list[int]) -> tuple[P.Reply, list[int]]:
        if isinstance(req, P.Ping):
            return P.Ok(), []
        if isinstance(req, P.Start):
            return self._start(req, fds)
        if isinstance(req, P.Adopt):
            return self._adopt(req, fds)
        if isinstance(req, P.SignalPid):
            self._signal(req.pid, P.SIGNALS[req.signal])
            return P.Ok(), []
        if isinstance(req, P.KillSandbox):
            self._kill_incarnation(self._incarnation(req.worker, req.incarnation))
            return P.Ok(), []
        if isinstance(req, P.Reap):
            return self._reap(self._incarnation(req.worker, req.incarnation)), []
        if isinstance(req, P.Pids):
            if (req.worker, req.incarnation) in self.reaped:
                # Reaped: what was left was killed and its cgroup removed. The
                # supervisor's last-word thread may ask once more after the loop's reap.
                return P.PidList(()), []
            inc = self._incarnation(req.worker, req.incarnation)
            return P.PidList(tuple(sorted(inc.pids()))), []
        if isinstance(req, P.OpenProc):
            return self._open_proc(req)
        if isinstance(req, P.OpenFd):
            return P.Link(), [self._open_link(req.pid, f"fd/{req.fd}")]
        if isinstance(req, P.OpenMapFile):
            return P.Link(), [self._open_link(req.pid, f"map_files/{req.start:x}-{req.end:x}")]
        if isinstance(req, P.OpenMapFiles):
            return self._open_map_files(req)
        if isinstance(req, P.OpenPidNs):
            return P.Link(), [self._open_link(req.pid, "ns/pid")]
        if isinstance(req, P.SignalThread):
            self._signal_thread(req)
            return P.Ok(), []
        if isinstance(req, P.ReadFilters):
            return self._read_filters(req.pid), []
        if isinstance(req, P.SetLatch):
            self.state.set_latch(req.reason)
            self.log.emit("broker_latch", source="broker", action="set", reason=req.reason)
            return P.Ok(), []
        if isinstance(req, P.ClearLatch):
            # The operator's acknowledgement (`supervisor clear-fail-safe`, root, on the
            # file), never the unprivileged supervisor's: a compromised one would clear
            # it and start control again (red team round 4).
            raise Refused("the fail-safe latch is cleared by the operator "
                          "(supervisor clear-fail-safe), not through the broker")
        if isinstance(req, P.ReadLatch):
            return P.Latch(self.state.read_latch()), []
        if isinstance(req, P.ReserveLatch):
            # Each run's start, as on the direct path: a latch that took the reserve on
            # a full disk, then cleared, left a long-lived broker without one (review).
            self.state.reserve_latch()
            return P.Ok(), []
        if isinstance(req, P.Realtime):
            self._realtime(self._incarnation(req.worker, req.incarnation))
            return P.Ok(), []
        raise Refused(f"no handler for {type(req).__name__}")

    # ------------------------------------------------------------ ownership

    def _incarnation(self, worker: str, number: int) -> _Incarnation:
        if worker not in self.config.workers:
            raise UnknownWorker(f"no worker {worker!r} in the broker's config")
        inc = self.live.get((worker, number))
        if inc is None:
            raise NotOurs(f"{worker} incarnation {number}: not started by the broker, or reaped")
        return inc

    def _owner(self, pid: int) -> _Incarnation | None:
        """The incarnation whose sandbox `pid` is in now (its bwrap while not reaped).

        With cgroups: one read of /proc/PID/cgroup, matched against each leaf's last two
        path components (the broker's own tree, then the leaf). Listing every leaf's
        members in every hierarchy per request cost the broker ~2 ms of CPU a request
        (27 % of a core at steady state on the default config, loaded: the maps scan
        asks for each executable mapping each second)."""
        live = list(self.live.values())     # readFilters asks from its own thread
        for inc in live:
            if pid == inc.proc.pid and inc.alive:
                return inc
        where = _cgroup_paths(pid) if any(i.cgroup is not None for i in live) \
            else set()
        for inc in live:
            if inc.cgroup is not None:
                if any(f"{p}/".find(f"{leaf}/") >= 0 for p in where for leaf in inc.leaves):
                    return inc
            elif pid in inc.pids():
                return inc
        return None

    def _pinned(self, pid: int) -> tuple[int, _Incarnation]:
        """A pidfd of `pid` checked to be one of ours after it was opened (a pid number
        recycled between the check and the open is never signalled or opened)."""
        if self._owner(pid) is None:
            raise NotOurs(f"pid {pid} is not in a sandbox the broker started")
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise NotOurs(f"pid {pid} is gone") from None
        inc = self._owner(pid)
        if inc is None:
            os.close(fd)
            raise NotOurs(f"pid {pid} left the broker's sandboxes")
        return fd, inc

    # ------------------------------------------------------------ requests

    def _start(self, req: P.Start, fds: list[int]) -> tuple[P.Reply, list[int]]:
        w = self.config.workers.get(req.worker)
        if w is None:
            raise UnknownWorker(f"no worker {req.worker!r} in the broker's config")
        self._not_latched(w)
        if req.incarnation <= self.last_incarnation.get(w.name, 0):
            raise Refused(f"{w.name} incarnation {req.incarnation} already used "
                          f"(next must be > {self.last_incarnation.get(w.name, 0)})")
        if req.standby and not w.warm_standby:
            raise Refused(f"{w.name} has no warm_standby in the config")
        cap = MAX_LIVE_STANDBY if w.warm_standby else MAX_LIVE
        live = sum(1 for inc in self.live.values() if inc.worker == w.name)
        if live >= cap:
            raise Refused(f"{w.name} has {live} sandboxes not reaped (at most {cap})")
        if req.standby and (req.channels or fds):
            raise BadFds("a standby is handed its channels later (adopt), not at start")
        handles = {} if req.standby else self._handles(w, req.channels, fds)
        from supervisor.sandbox.policy import for_worker

        try:
            pol = for_worker(self.config, w)
        except (LookupError, ValueError) as e:
            raise Refused(f"{w.name}: {e}") from None
        d = self.config.domains[w.domain]
        # Device nodes: the domain's own, and the GPU's for a worker whose config says
        # device = "cuda" (issue 28), never more.
        gpu = CUDA_DEVICE_NODES if getattr(w, "device", "cpu") == "cuda" else ()
        check_plan(pol, domain_rw=tuple(d.extra_rw_binds),
                   domain_dev=(*(getattr(d, "extra_dev_binds", ()) or ()), *gpu),
                   state_dir=self.state.path, root=os.geteuid() == 0)
        self.last_incarnation[w.name] = req.incarnation
        return self._launch(w, req, pol, handles)

    def _not_latched(self, w: WorkerConfig) -> None:
        """The latch holds whatever the supervisor proper believes (red team round 4: a
        compromised one started workers while the fail-safe was latched): no control
        worker starts, nor takes over from a standby, while it is set."""
        if self.config.profile_of(w.name) == CONTROL and self.state.read_latch():
            raise Refused(f"{w.name}: the fail-safe is latched: no control worker starts "
                          f"until the operator clears it (supervisor clear-fail-safe)")

    def _handles(self, w: WorkerConfig, channels: tuple[P.Grant, ...],
                 fds: list[int]) -> dict[str, object]:
        """The worker's channel handles over the received fds, each judged against the
        broker's own spec of the channel (names, roles, reader index, fd kinds, sizes):
        a start's, and a standby's hand-over (`adopt`), alike."""
        from supervisor.failsafe import trusted_readers
        from supervisor.ipc.channel import ReaderHandle, WriterHandle

        want = {**{c: "writer" for c in w.publishes}, **{c: "reader" for c in w.reads}}
        got = {g.channel: g for g in channels}
        if len(got) != len(channels) or set(got) != set(want):
            raise Refused(f"{w.name}: channels {sorted(got)}; the config gives it "
                          f"{sorted(want)}")
        if sum(g.fd_count for g in channels) != len(fds):
            raise BadFds(f"{len(fds)} fds for grants of {sum(g.fd_count for g in channels)}")
        specs = self.config.channel_specs()
        out: dict[str, object] = {}
        at = 0
        for g in channels:
            if g.role != want[g.channel]:
                raise Refused(f"{w.name} is a {want[g.channel]} of {g.channel}, not a {g.role}")
            spec = specs[g.channel]
            mine = fds[at:at + g.fd_count]
            at += g.fd_count
            index = 0 if g.role == "writer" else self.config.reader_index(g.channel, w.name)
            check_channel_fds(g.channel, spec, g.role, mine, pins=self.pins, index=index)
            if g.role == "writer":
                n = spec.max_readers
                # Whose positions a restarted writer numbers above: the broker's own
                # config says, as Channel.trust does in the supervisor (layout.resume_point).
                out[g.channel] = WriterHandle(spec, mine[0], tuple(mine[1:1 + n]),
                                              tuple(mine[1 + n:]),
                                              trusted_readers(self.config, g.channel),
                                              self.config.monitor_index(g.channel))
            else:
                out[g.channel] = ReaderHandle(spec, index, *mine)
        return out

    def _adopt(self, req: P.Adopt, fds: list[int]) -> tuple[P.Reply, list[int]]:
        """A warm standby's hand-over, judged as a start's channels are (`_handles`: the
        config's channels for the worker, each role, reader index, fd kind, size, name,
        mode and pin; the latch for a control worker), then sent to the standby over the
        control socket only the broker holds (red team 10 row 9: the proper sent them
        itself, unchecked). Once: the socket is closed after the send, sent or not."""
        import json

        inc = self._incarnation(req.worker, req.incarnation)
        w = self.config.workers[inc.worker]
        if inc.ctl is None:
            raise Refused(f"{w.name} incarnation {inc.number} is not a standby waiting "
                          f"for its channels")
        self._not_latched(w)
        handles = self._handles(w, req.channels, fds)
        hand = [fd for h in handles.values() for fd in h.fds()]
        # The message worker._activate reads: each handle's JSON, and the fd numbers (ours)
        # in the order their fds travel.
        text = json.dumps({"channels": {ch: h.to_json() for ch, h in handles.items()},
                           "fds": hand})
        ctl, inc.ctl = inc.ctl, None
        try:
            # Never blocks the broker: its queue holds nothing else (the standby's
            # writes go the other way, never read here).
            socket.send_fds(ctl, [text.encode()], hand, socket.MSG_DONTWAIT)
        except OSError as e:
            raise Failed(f"{w.name}: hand-over to incarnation {inc.number}: {e.strerror}",
                         e.errno or 0) from None
        finally:
            ctl.close()
        self.log.emit("broker_adopted", source="broker", worker=w.name,
                      incarnation=inc.number, pid=inc.proc.pid, channels=sorted(handles))
        return P.Ok(), []

    def _launch(self, w: WorkerConfig, req: P.Start, pol, handles: dict) -> tuple[P.Reply, list[int]]:
        from supervisor.sandbox import launch

        domain = self.config.domains[w.domain]
        mine: list[int] = []      # our ends, handed to the client
        theirs: list[int] = []    # the child's ends, closed once it has them
        cg = None
        watch = ctl = None
        try:
            # stdout+stderr and the status pipe: read by the supervisor proper, never here.
            status_r, status_w = os.pipe2(os.O_CLOEXEC)
            mine.append(status_r)
            theirs.append(status_w)
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            mine.append(out_r)
            theirs.append(out_w)
            env, child_fds = worker_env(endpoint_for(self.config, w, sandboxed=True), status_w,
                                         handles)
            child_fds.append(status_w)
            if not domain.exec_memory_after_ready:
                watch, their_watch = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                env[ENV_EXECWATCH_FD] = str(their_watch.fileno())
                theirs.append(their_watch.detach())
                child_fds.append(theirs[-1])
                mine.append(watch.detach())
            if req.standby:
                # Ours stays here: the hand-over is `adopt`'s (red team 10 row 9).
                ctl, their_ctl = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                env[ENV_STANDBY_FD] = str(their_ctl.fileno())
                theirs.append(their_ctl.detach())
                child_fds.append(theirs[-1])
            join_fds: list[int] = []
            if self.cgroups is not None:
                from supervisor.sandbox.cgroups import Limits

                self._leaf_seq += 1
                cg = self.cgroups.leaf(f"{w.name}-{'s' if req.standby else 'r'}{self._leaf_seq}",
                                       Limits(memory_max=w.memory_max, pids_max=w.pids_max,
                                              cpu_quota_pct=w.cpu_quota,
                                              cpu_weight=self.config.cpu_weight_of(w.name)))
                join_fds = cg.open_join_fds()
                theirs += join_fds
            proc = launch.spawn(pol, launch.worker_argv(w, self.python), child_fds,
                                env_extra=env, stdin=subprocess.DEVNULL, stdout=out_w,
                                stderr=out_w, start_new_session=True,
                                rlimits=launch.worker_rlimits(w), cgroup_fds=join_fds)
            pidfd = os.pidfd_open(proc.pid)
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
            P.close_fds(mine)
            if ctl is not None:
                ctl.close()
            if cg is not None:
                try:
                    cg.kill_all()
                    cg.remove()
                except OSError:
                    pass
            raise Failed(f"{w.name}: {type(e).__name__}: {e}") from None
        finally:
            P.close_fds(theirs)
        inc = _Incarnation(w.name, req.incarnation, proc, cg, ctl=ctl)
        if cg is not None:
            try:
                inc.oom_before = cg.oom_kills()
            except OSError:
                pass
        self.live[(w.name, req.incarnation)] = inc
        self.log.emit("broker_started", source="broker", worker=w.name,
                      incarnation=req.incarnation, pid=proc.pid, standby=req.standby,
                      host_uid=pol.host_uid, cgroup=cg is not None)
        return (P.Started(pid=proc.pid, host_uid=-1 if pol.host_uid is None else pol.host_uid,
                          cgroup=cg is not None, exec_watch=watch is not None,
                          control=ctl is not None),
                [pidfd, *mine])

    def _signal(self, pid: int, sig: int) -> None:
        """SIGKILL of bwrap kills the sandbox; other signals go where the client says
        (the worker itself: bwrap does not forward them), if it is one of ours."""
        fd, inc = self._pinned(pid)
        try:
            signal.pidfd_send_signal(fd, sig)
        except ProcessLookupError:
            pass
        except OSError as e:
            raise Failed(f"signal {P.SIGNAL_NAMES.get(sig, sig)} to {pid}: {e.strerror}") \
                from None
        finally:
            os.close(fd)

    def _kill_incarnation(self, inc: _Incarnation) -> None:
        if inc.alive:
            try:
                inc.proc.kill()
            except ProcessLookupError:
                pass
        if inc.cgroup is not None:
            try:
                inc.cgroup.kill_all()
            except (OSError, TimeoutError) as e:
                raise Failed(f"{inc.worker}: cgroup not empty: {e}") from None

    def _release(self, inc: _Incarnation) -> None:
        cg, inc.cgroup = inc.cgroup, None
        if cg is not None:
            try:
                cg.kill_all()
                cg.remove()
            except (OSError, TimeoutError) as e:
                self.log.emit("cgroup_error", source="broker", worker=inc.worker, error=str(e))

    def _reap(self, inc: _Incarnation) -> P.Reaped:
        """Whether bwrap has exited (never blocks); once it has, the incarnation is
        forgotten (its pids are no longer ours: nothing in it can be signalled or opened
        through us) and what is left of the sandbox is killed and its cgroup removed on
        a thread of its own. That takes 20-130 ms (v1: waiting for the dying tasks to
        leave, then an rmdir per hierarchy); done before the reply it held the
        supervisor proper's loop, and the warm standby's adoption behind it, as long
        (bench/recovery.py --trace)."""
        code = inc.proc.poll()
        if code is None:
            return P.Reaped(exited=False)
        oom = 0
        if inc.cgroup is not None:
            try:
                oom = max(0, inc.cgroup.oom_kills() - inc.oom_before)
                # Before the reply: nothing left of it runs again (a process that
                # outlived bwrap could still write its channels while a standby takes
                # over: one writer per byte); the wait and the rmdirs go on a thread.
                inc.cgroup.kill_now()
            except OSError as e:
                self.log.emit("cgroup_error", source="broker", worker=inc.worker,
                              error=str(e))
            self._releasing = [t for t in self._releasing if t.is_alive()]
            t = threading.Thread(target=self._release, args=(inc,), daemon=True,
                                 name=f"release-{inc.worker}-{inc.number}")
            t.start()
            self._releasing.append(t)
        del self.live[(inc.worker, inc.number)]
        inc.close_ctl()
        self.reaped.append((inc.worker, inc.number))
        self.log.emit("broker_reaped", source="broker", worker=inc.worker,
                      incarnation=inc.number, pid=inc.proc.pid, code=code, oom_kills=oom)
        return P.Reaped(exited=True, code=code, oom_kills=oom)

    def _open_proc(self, req: P.OpenProc) -> tuple[P.Reply, list[int]]:
        """/proc/PID and the named files, opened as the broker (the kernel's access
        check of maps and mem is made at open), for a pid of ours only. A /proc/PID
        directory fd stays bound to that process: re-checked as ours after the open."""
        if self._owner(req.pid) is None:
            raise NotOurs(f"pid {req.pid} is not in a sandbox the broker started")
        fds: list[int] = []
        try:
            dfd = os.open(f"/proc/{req.pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            fds.append(dfd)
            if self._owner(req.pid) is None:
                raise NotOurs(f"pid {req.pid} left the broker's sandboxes")
            for name in req.files:
                if name == "pagemap":       # physical frame numbers only for CAP_SYS_ADMIN
                    fds.append(_open_without_sys_admin(name, dfd))
                else:
                    fds.append(os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dfd))
        except BrokerError:
            P.close_fds(fds)
            raise
        except OSError as e:
            P.close_fds(fds)
            raise Failed(f"/proc/{req.pid}: {e.strerror}", e.errno or 0) from None
        return P.Opened(req.files), fds

    def _open_link(self, pid: int, name: str) -> int:
        """An O_PATH fd of what /proc/PID/<name> (fd/N, map_files/A-B or ns/pid, formatted
        here from numbers) leads to, for a pid of ours. The kernel checks those magic links at
        each lookup (ptrace access; CAP_SYS_ADMIN for map_files), so the supervisor
        proper cannot follow them through a directory fd: it gets the target itself.
        O_PATH opens nothing (a device mapping is not opened, a FIFO does not block); the
        holder fstat()s it, readlink()s /proc/self/fd/M for its name, and reopens it only
        with its own permissions."""
        dfd, _ = self._proc_dir(pid)
        try:
            return os.open(name, os.O_PATH | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as e:
            raise Failed(f"/proc/{pid}/{name.split('/')[0]}: {e.strerror}", e.errno or 0) from None
        finally:
            os.close(dfd)

    def _open_map_files(self, req: P.OpenMapFiles) -> tuple[P.Reply, list[int]]:
        """`_open_link` of map_files/A-B for many ranges of one process of ours, the
        directory opened and checked once: a range not mapped (any more) is False, as
        ENOENT is for one."""
        dfd, _ = self._proc_dir(req.pid)
        found: list[bool] = []
        fds: list[int] = []
        try:
            for start, end in req.ranges:
                try:
                    fds.append(os.open(f"map_files/{start:x}-{end:x}",
                                       os.O_PATH | os.O_CLOEXEC, dir_fd=dfd))
                    found.append(True)
                except FileNotFoundError:
                    found.append(False)
        except OSError as e:
            P.close_fds(fds)
            raise Failed(f"/proc/{req.pid}/map_files: {e.strerror}", e.errno or 0) from None
        finally:
            os.close(dfd)
        return P.Links(tuple(found)), fds

    def _proc_dir(self, pid: int) -> tuple[int, _Incarnation]:
        """/proc/PID opened for a pid of ours, re-checked after the open (the directory
        fd stays bound to that process even if the number is reused)."""
        if self._owner(pid) is None:
            raise NotOurs(f"pid {pid} is not in a sandbox the broker started")
        try:
            dfd = os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise NotOurs(f"pid {pid}: {e.strerror}") from None
        inc = self._owner(pid)
        if inc is None:
            os.close(dfd)
            raise NotOurs(f"pid {pid} left the broker's sandboxes")
        return dfd, inc

    def _signal_thread(self, req: P.SignalThread) -> None:
        """SIGSTOP/SIGCONT to one thread of a process of ours: the thread must be listed
        under that process's own /proc/PID/task once it is pinned (a tid of another
        process, ours or not, is refused)."""
        pidfd, _ = self._pinned(req.pid)
        try:
            dfd, _ = self._proc_dir(req.pid)
            try:
                tids = os.listdir(f"/proc/self/fd/{dfd}/task")
            finally:
                os.close(dfd)
            if str(req.tid) not in tids:
                raise NotOurs(f"thread {req.tid} is not a thread of pid {req.pid}")
            sig = signal.SIGSTOP if req.stop else signal.SIGCONT
            if not tgkill(req.pid, req.tid, sig):
                raise NotOurs(f"thread {req.tid} of pid {req.pid} is gone")
        finally:
            os.close(pidfd)

    def _read_filters(self, pid: int) -> P.Filters:
        """The W^X check's privileged part for a process of ours (sandbox/wx.py `verify`,
        as root: every thread seized, its seccomp programs read back with
        PTRACE_SECCOMP_GET_FILTER, let go). The only judgement here is the exact match
        against the W^X program this code builds; the verdict's use (READY or refused)
        stays the supervisor proper's. Runs on this thread: ptrace requests must come
        from the thread that seized. A process killed during the check is `failed` with
        ESRCH (its exit, with its own cause, is what the proper reports)."""
        from supervisor.sandbox import wx

        pidfd, _ = self._pinned(pid)
        try:
            got = wx.verify(pid, baseline=None)
        except ProcessLookupError as e:
            raise Failed(f"pid {pid}: {e.strerror or e}", errno.ESRCH) from None
        except OSError as e:
            raise Failed(f"pid {pid}: filter read-back: {e.strerror or e}", e.errno or 0) \
                from None
        finally:
            os.close(pidfd)
        return P.Filters(ptrace=got.how == "ptrace", ok=got.ok and got.how == "ptrace",
                         reason=got.reason, threads=got.threads, micros=int(got.ms * 1e3))

    def _realtime(self, inc: _Incarnation) -> None:
        """SCHED_FIFO at the config's priority for the sandbox's worker (pid 2 of its
        pid namespace). The policy around it (READY first, one CPU left outside the
        real-time class) stays the supervisor proper's."""
        from supervisor.sandbox import sandbox_main_pid
        from supervisor.sandbox.sched import RT_PERIOD_US, RealtimeUnavailable, make_fifo

        rt = self.config.workers[inc.worker].realtime()
        if rt is None:
            raise Refused(f"{inc.worker} has no realtime_priority in the config")
        pid = sandbox_main_pid(sorted(inc.pids() - {inc.proc.pid}))
        if pid is None:
            raise Failed(f"{inc.worker}: no worker process in the sandbox")
        try:
            if inc.cgroup is not None:
                try:
                    inc.cgroup.grant_rt(rt.runtime_us, RT_PERIOD_US)
                except OSError as e:
                    why = self.rt_error or f"{rt.budget_pct} % of a CPU for its cgroup: " \
                                           f"{e.strerror or e}"
                    raise Failed(f"{inc.worker}: no RT budget: {why}", e.errno or 0) from None
            make_fifo(pid, rt.priority, lambda: pid in inc.pids())
        except (RealtimeUnavailable, OSError) as e:
            raise Failed(f"{inc.worker}: {e}", getattr(e, "errno", 0) or 0) from None


_CAP_SYS_ADMIN = 21


def _open_without_sys_admin(name: str, dfd: int) -> int:
    """Open /proc/PID/<name> with CAP_SYS_ADMIN out of this thread's effective set:
    pagemap decides at open, from the opener's CAP_SYS_ADMIN, whether reads show
    physical frame numbers (red team round 5: the unprivileged proper read 3,528 of
    them). CAP_SYS_PTRACE still passes the access check. The set is restored after."""
    from supervisor.audit.asuser import CapsNotRestored, without_effective

    try:
        return without_effective((_CAP_SYS_ADMIN,), lambda: os.open(
            name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dfd))
    except CapsNotRestored:
        os._exit(70)                    # never left without it
