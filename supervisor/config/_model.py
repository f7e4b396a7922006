"""The config's data model: what `load()` returns, and the errors it raises.

Plain frozen dataclasses, checked by `_loader` and `_rules` before anyone gets one.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from supervisor.ipc.errors import ConfigError
from supervisor.ipc.spec import ChannelSpec
from supervisor.protocol import SIMULATION, VEHICLE, Isolation, printable

from ._graph import edges, topo_sort

CONTROL = "control"
RESEARCH = "research"
# Default cgroup cpu.weight by profile: under contention control gets ten times
# research's share of the CPUs, so a busy research model cannot delay the control loop
# (the quota only caps research; the weight decides who waits when both want a core).
CPU_WEIGHT = {CONTROL: 1000, RESEARCH: 100}
# A real-time worker's default RT budget (% of a CPU per 100 ms), and what all of them
# together may reserve (the kernel keeps 5 % of every CPU out of RT reach itself).
REALTIME_BUDGET_PCT = 20
REALTIME_TOTAL_PCT = 80
# Supervisor modes ([supervisor] mode): SIMULATION, VEHICLE from supervisor.protocol (the
# worker is told its mode too, protocol.ENV_MODE).
DEFAULT_SOURCE = "<embedded supervisor/default.toml>"
# Overrides [supervisor] state_dir (tests, development): see _runtime.state_dir_in_use.
ENV_STATE_DIR = "TRIO_STATE_DIR"
# The checkout holding supervisor/ and workers/: on the workers' PYTHONPATH (see
# supervisor.sandbox.policy.PROJECT_ROOT), so module names are looked up here too.
PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
# The project's own packages there: what every worker runs (the runner, the worker API,
# the workers) and what the audit digests; never shadowed by a python_path.
PROJECT_PACKAGES = ("supervisor", "workers", "schemas")

# The smallest memory_max a module worker (python -m supervisor.runner MODULE) may have.
# Its cgroup is charged for the interpreter, the libraries it maps, its heap and the
# shared memory it writes, from the first instruction. Measured (VmRSS in
# /proc/self/status, CPython 3.11, x86-64): bare interpreter 13 MiB; + numpy 27 MiB;
# + capnp 37 MiB; + supervisor.runner/worker with the import guard, seccomp and
# Landlock modules 42 MiB, before the worker's own imports, heap, thread stacks (numpy's
# BLAS pool) and channel slots. Below 64 MiB such a worker is OOM-killed while starting,
# before it can become READY; 64 MiB leaves ~20 MiB for the worker itself.
MIN_WORKER_MEMORY = 64 * 2**20
# The least CPU time a module worker needs to become READY: the interpreter, numpy,
# capnp, the runner and the worker's own imports. Measured (user + sys, CPython 3.11,
# this 2-core VM): workers.probe 0.37 s, camerad 0.36 s, controlsd 0.39 s, modeld 0.48 s
# before loading its model. A cpu_quota that gives less than this within
# ready_timeout_ms can never see READY (issue 22: camerad at cpu_quota = 1).
MIN_START_CPU_S = 0.3
DEFAULT_SHM_BUDGET = 2 * 2**30

# --------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config file."""

    file: str
    key: str      # key path such as "workers.modeld.subscribes[1]"; "" for the whole file
    reason: str

    def __str__(self) -> str:
        # One printable line whatever the config held: a reason may quote a value (a path,
        # a user, an argument) with a newline or an escape sequence in it.
        text = f"{self.file}: {self.key}: {self.reason}" if self.key else f"{self.file}: {self.reason}"
        return printable(text)


class ConfigFileError(ConfigError):
    """A config file is unusable; ``problems`` lists everything found, not just the first."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = list(problems)
        n = len(self.problems)
        where = self.problems[0].file if self.problems else "<config>"
        head = f"{where}: {n} config problem{'' if n == 1 else 's'}"
        super().__init__(head + "".join(f"\n  {p}" for p in self.problems))


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class SupervisorConfig:
    status_interval_s: float = 5.0
    maps_scan_interval_s: float = 1.0   # admission re-scan of /proc/PID/maps
    log_format: str = "json"            # "json" | "text"
    # Where the fail-safe latch lives (it must survive a restart of the supervisor);
    # the environment variable TRIO_STATE_DIR overrides it (tests, development).
    state_dir: str = "/var/lib/trio-supervisor"
    # Upper bound on the shared memory of all channels together (segments + lease
    # tables); check_runtime() also compares the total with the machine's MemAvailable.
    shm_budget: int = DEFAULT_SHM_BUDGET
    # "vehicle" or "simulation". Worker arguments that feed control recorded data or
    # recorded time, or pace it from another domain (a module's ``SIMULATION_ONLY``,
    # e.g. controlsd's --log-clock), are refused in a vehicle config; `supervisor
    # replay` derives simulation configs, and `supervisor units` renders only vehicle ones.
    mode: str = VEHICLE
    # How many workers may be starting (spawned, not yet READY) at once. Each starts
    # only once every worker it subscribes to is READY, whatever this says; 1 starts
    # them one after another in start order. More overlaps the start-ups of
    # independent workers (imports, model loads): a fleet boots in less wall time, at
    # the cost of start-ups competing for the CPUs.
    start_parallel: int = 1


# Built-in domain profiles: supervisor/sandbox/policy.py derives every isolation knob of
# a domain's sandboxes from its profile (and the domain's own network/user/binds).
PROFILES = (CONTROL, RESEARCH)


@dataclass(frozen=True)
class DomainConfig:
    """A domain: a set of workers that share one isolation, every knob a typed field.

    The profile sets each isolation field's default (`PROFILE_DEFAULTS`); a domain may
    override any of them, but a control-profile domain may only tighten (the loader
    refuses a loosened one, naming the key). Every consumer (sandbox policy, runner,
    admission, audit) reads these fields, never the profile's name.
    """

    name: str
    # "control" or "research". A domain named control or research has that profile;
    # any other name must say.
    profile: str = ""
    # Network namespace with interfaces (name resolution and TLS files bound). Never
    # for control.
    network: bool = False
    # What to do when a worker exhausts its restart budget: "restart" keeps the domain
    # going without it, "fail_safe" stops the whole domain safe. Defaults to
    # "fail_safe" for the control profile when the key is absent.
    failure_policy: str = "restart"
    # Its outputs may reach actuators (control profile only).
    actuates: bool = False
    extra_ro_binds: tuple[str, ...] = ()
    # Directories of the domain's own worker packages (outside the project and the
    # interpreter's site-packages): each bound read-only and put on the sandbox's
    # PYTHONPATH after the project root. Admission walks the same path. The operator's
    # PYTHONPATH never reaches a sandbox.
    python_path: tuple[str, ...] = ()
    # Directories bound read-write (e.g. a recorder's output); Landlock allows writes
    # below them. Never for the control profile: control writes only shared memory.
    extra_rw_binds: tuple[str, ...] = ()
    # Host user the domain's sandboxes run as (never root); default trio-research for
    # research, trio-control for every other domain (scripts/install.sh creates both).
    # Distinct domains must use distinct users: the kernel then treats one domain's
    # processes and files as a stranger's to the other.
    user: str | None = None
    # -- isolation knobs; None = the profile's default (resolved by the loader)
    # cc, gcc, clang, ld, ... masked inside the sandbox (and Debian's alternatives).
    hide_compilers: bool | None = None
    # May start processes after its start-up (control: from the runner on, execve
    # kills the worker and fork, vfork and clone without CLONE_THREAD fail with EPERM;
    # the worker's own code never runs with either allowed).
    exec_after_start: bool | None = None
    # Torch (and the rest of the refusal list) refused at admission, by the import
    # guard and the maps scan, and absent from the sandbox's filesystem.
    refuse_torch: bool | None = None
    # May map new executable memory after READY. False: every executable mapping is
    # judged by the exec watch while starting and refused (the worker killed) after.
    exec_memory_after_ready: bool | None = None
    # Syscall filter class: "control" (denials kill) or "research" (EPERM for most).
    seccomp: str = ""
    # -- the default cgroup limits of its workers (a worker's own key wins); None = the
    # profile's (`PROFILE_LIMITS`, resolved by the loader: never None after load()).
    memory_max: int | None = None      # bytes
    pids_max: int | None = None        # processes + threads

    @property
    def code_vouched(self) -> bool:
        """Whether admission vouches for this domain's code (every profile but research):
        its python_path must be root's alone (config checks), and an audit digests it
        (a signed report covers that code, not whatever is there later)."""
        return self.profile != RESEARCH

    def isolation(self) -> Isolation:
        """The knobs the runner enforces inside each sandbox of this domain."""
        return Isolation(refuse_torch=bool(self.refuse_torch),
                         exec_after_start=bool(self.exec_after_start),
                         exec_memory_after_ready=bool(self.exec_memory_after_ready),
                         seccomp=self.seccomp or CONTROL)


# Each profile's isolation; for control these are also the loosest values allowed.
# The knobs the runner enforces come from `protocol.Isolation.for_profile` (one home);
# the sandbox's view adds network and compilers.
PROFILE_DEFAULTS: dict[str, dict[str, object]] = {
    profile: {**extra, **dataclasses.asdict(Isolation.for_profile(profile))}
    for profile, extra in ((CONTROL, {"network": False, "hide_compilers": True}),
                           (RESEARCH, {"hide_compilers": False}))
}


# Each profile's default cgroup limits for a worker that sets none (the domain's
# ``memory_max`` / ``pids_max`` keys override them for all its workers; a worker's own
# keys override both). A default is a backstop against a runaway worker, not a sizing:
# control workers differ too much (camerad ~50 MiB, modeld with a real model GiBs), so
# each control worker should say what it needs; without a limit at all, one worker could
# take the vehicle's memory or pids from every other (issue 21: a research worker with
# no memory_max wrote 3 GiB).
#
# memory_max (bytes, the cgroup's: heap, page cache, shared memory it writes, tmpfs):
# * control 1 GiB. Measured here (VmHWM, CPython 3.11): a module worker with numpy and
#   capnp 35 MiB; modeld with the signed demo model after 5 frames 156 MiB. Without
#   cgroups the limit falls back to RLIMIT_DATA, which counts every thread's stack and
#   malloc arena: there `import numpy` with OpenBLAS's thread per core hung at 512 MiB on
#   a 16-core machine and took 0.23 s at 1 GiB (../shared/NOTES.md). So 1 GiB, not less.
# * research 2 GiB. `import torch` (CPU) alone is 217 MiB RSS here; a shadow model's
#   weights and activations get the remaining ~1.8 GiB. A bigger research model says so
#   (the default config's research worker: 8 GiB); the 3 GiB write stops at 2 GiB.
# pids_max (processes + threads; a fork or thread storm stops here):
# * control 64: the interpreter, numpy's BLAS pool (one thread per core) and the
#   worker's own few threads; control may not fork after start anyway.
# * research 256: torch's intra-op and inter-op pools (one thread per core each) plus
#   OpenMP's, on machines of up to ~64 cores.
PROFILE_LIMITS: dict[str, dict[str, int]] = {
    CONTROL: {"memory_max": 1 * 2**30, "pids_max": 64},
    RESEARCH: {"memory_max": 2 * 2**30, "pids_max": 256},
}


@dataclass(frozen=True)
class WorkerConfig:
    name: str
    domain: str
    module: str | None = None               # run as ``python -m module``
    command: tuple[str, ...] | None = None  # or this argv
    args: tuple[str, ...] = ()
    # Channel names; in the TOML each is bound to a role the worker's code asks for
    # (``subscribes = {frames = "road_frames"}``; an array means role = channel name).
    publishes: tuple[str, ...] = ()
    subscribes: tuple[str, ...] = ()
    shadow_subscribes: tuple[str, ...] = ()  # read for logging only, never for actuation
    roles: tuple[tuple[str, str], ...] = ()  # (role, channel) of all three, filled by the loader
    restart: str = "on-failure"             # "always" | "on-failure" | "never"
    backoff_initial_ms: int = 100
    backoff_max_ms: int = 5000
    max_restarts: int = 5                   # at most this many restarts ...
    restart_window_s: float = 60.0          # ... within this window, else the budget is spent
    # A worker that gave up (out of restarts) outside a failed-safe domain is tried
    # again after this cool-down, under its restart policy; 0 = never again.
    cooldown_s: float = 30.0
    # Keep a second instance started, imports done, model loaded, waiting in its own
    # sandbox (pre-READY, under every rule a fresh worker has) to be handed the
    # channels when this one dies: recovery without the cold start.
    warm_standby: bool = False
    watchdog_ms: int = 0                    # 0: no watchdog
    ready_timeout_ms: int = 5000
    optional: bool = False                  # if admission refuses it, the rest still starts
    # cgroup limits of the worker's sandbox (v2, or v1 memory/pids/cpu controllers):
    # None in the file: the domain's default (DomainConfig.memory_max / pids_max, from the
    # profile's PROFILE_LIMITS); never None after load(), so what is enforced is visible.
    memory_max: int | None = None           # bytes: heap, page cache, shared memory and tmpfs
    cpu_quota: float | None = None          # percent of one CPU (200 = two CPUs)
    # Share of the CPUs under contention (cgroup cpu.weight 1..10000); None: the
    # profile's (CPU_WEIGHT). A research worker may never outweigh a control worker.
    cpu_weight: int | None = None
    # SCHED_FIFO priority (1..98) of the worker's main thread from READY on; None:
    # normal class. Control workers only; set by the supervisor, never inherited by
    # threads or children the worker starts (supervisor/sandbox/sched.py).
    realtime_priority: int | None = None
    # ... and the most of one CPU it may hold per 100 ms where the kernel can bound it
    # per cgroup (v1 RT groups); None: REALTIME_BUDGET_PCT.
    realtime_budget_pct: int | None = None
    # Its readers busy-poll a regular stream (a camera's) for up to this many us either
    # side of the next message's predicted arrival instead of sleeping through the
    # wake-up (supervisor/ipc/_cadence.py): at most 2x this of CPU per message. 0: off.
    # Each window begins with a rehearsal of the last message's path (Reader.rehearse).
    busy_poll_us: int = 0
    pids_max: int | None = None             # processes + threads (a fork storm stops here)
    # Control-grade domains: may the worker create anonymous executable memory before
    # READY (modeld: tinygrad maps the signed artifact's kernels)? Never after READY.
    jit_kernels: bool = False
    nofile: int | None = None
    # A [models.NAME] the worker loads: its artifact and public key are bound read-only
    # into the sandbox and the trust record is passed to it (protocol.ENV_MODEL).
    model: str | None = None
    # The accelerator the worker may open: "cpu" (none) or "cuda" (the GPU's device nodes,
    # /dev/nvidia0, nvidiactl, nvidia-uvm, bound into its sandbox; nothing else of /dev).
    # A control worker needs a model to get one; research never gets more than control.
    device: str = "cpu"

    def cpu_weight_in(self, profile: str) -> int:
        """Its cgroup cpu.weight in a domain of ``profile``: its own, or the profile's."""
        return self.cpu_weight if self.cpu_weight is not None else CPU_WEIGHT[profile]

    def realtime(self):
        """Its sandbox.sched.Realtime, or None for the normal class."""
        from supervisor.sandbox.sched import Realtime

        if self.realtime_priority is None:
            return None
        return Realtime(self.realtime_priority, self.realtime_budget_pct or REALTIME_BUDGET_PCT)

    @property
    def reads(self) -> tuple[str, ...]:
        """Every channel the worker attaches to as a reader, shadow or not."""
        return self.subscribes + self.shadow_subscribes

    def argv(self, python: str = sys.executable) -> list[str]:
        base = [python, "-m", self.module] if self.module else list(self.command or ())
        return base + list(self.args)


@dataclass(frozen=True)
class ChannelConfig:
    name: str
    spec: ChannelSpec
    shadow: bool = False   # research/shadow output: must never drive actuation
    # A declared payload (schemas/payloads.py) for float32 tensor channels; an
    # actuation payload (control_cmd) makes this an actuation channel: on fail-safe its
    # last message is the payload's safe value.
    payload: str | None = None

    @property
    def actuation(self) -> bool:
        from schemas.payloads import PAYLOADS

        return self.payload is not None and PAYLOADS[self.payload].safe is not None


@dataclass(frozen=True)
class ModelConfig:
    """What a vehicle trusts to run: a signed artifact, the key it must verify with,
    the model it must be, and the oldest version it may be (no rollback). Relative
    paths are relative to the project root (the checkout or install)."""

    name: str
    artifact: str                     # bundle directory (manifest.json + manifest.sig + files)
    public_key: str                   # ed25519 public key file
    expect_name: str                  # the manifest's model.name must be this
    min_version: str | None = None    # the manifest's model.version must be >= this

    def resolved(self, root: str = PROJECT_ROOT) -> ModelConfig:
        from os.path import join
        return ModelConfig(self.name, join(root, self.artifact), join(root, self.public_key),
                           self.expect_name, self.min_version)


@dataclass(frozen=True)
class Config:
    source: str
    supervisor: SupervisorConfig
    domains: dict[str, DomainConfig]
    workers: dict[str, WorkerConfig]      # in declaration order
    channels: dict[str, ChannelConfig]    # sorted by name; channel_id is 1-based in that order
    models: dict[str, ModelConfig] = dataclasses.field(default_factory=dict)  # paths resolved

    def channel_specs(self) -> dict[str, ChannelSpec]:
        return {name: ch.spec for name, ch in self.channels.items()}

    def writer_of(self, channel: str) -> str:
        if channel not in self.channels:
            raise KeyError(channel)
        return next(w.name for w in self.workers.values() if channel in w.publishes)

    def readers_of(self, channel: str) -> list[str]:
        """Workers that read ``channel`` (``subscribes`` or ``shadow_subscribes``)."""
        if channel not in self.channels:
            raise KeyError(channel)
        return [w.name for w in self.workers.values() if channel in w.reads]

    def reader_index(self, channel: str, worker: str) -> int:
        """The reader slot ``worker`` holds on ``channel``: its place in readers_of()."""
        return self.readers_of(channel).index(worker)

    def monitor_index(self, channel: str) -> int:
        """The supervisor's own reader slot on ``channel``: the spare after the workers'."""
        return len(self.readers_of(channel))

    def profile_of(self, worker: str) -> str:
        """The profile (control or research) of a worker's domain: what its sandbox is."""
        return self.domains[self.workers[worker].domain].profile

    def cpu_weight_of(self, worker: str) -> int:
        """The worker's cgroup cpu.weight: its own, or its profile's default."""
        return self.workers[worker].cpu_weight_in(self.profile_of(worker))

    def domain_of(self, worker: str) -> DomainConfig:
        return self.domains[self.workers[worker].domain]

    def workers_in(self, domain: str) -> list[str]:
        return [w.name for w in self.workers.values() if w.domain == domain]

    def start_order(self) -> list[str]:
        """Publishers before their subscribers; ties keep declaration order. Shadow
        subscriptions impose no order (a log-only reader attaches when it can). Required
        workers before optional ones where no required worker reads an optional one's
        output: a serial start never holds the car behind an optional worker that is
        slow to become READY, or never does (red team 12 row 10)."""
        order, _ = topo_sort(self.workers)
        after = self.start_after()
        required = [n for n in order if not self.workers[n].optional]
        if any(self.workers[d].optional for n in required for d in after[n]):
            return order
        return required + [n for n in order if self.workers[n].optional]

    def start_after(self) -> dict[str, set[str]]:
        """Each worker -> the workers whose READY it waits for before it starts (the
        publishers of what it subscribes to; shadow subscriptions wait for nothing)."""
        after: dict[str, set[str]] = {name: set() for name in self.workers}
        for pub, subs in edges(self.workers).items():
            for sub in subs:
                after[sub].add(pub)
        return after

