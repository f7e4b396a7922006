"""The supervisor's one declarative config: domains, workers and the channels between them.

``load()`` reads a TOML file (or the embedded ``supervisor/default.toml``) and checks all
of it before anything is launched. It returns a `Config`, or raises one `ConfigFileError`
that lists every problem found as ``FILE: KEY: REASON``, e.g.::

    cars.toml: workers.modeld.subscribes[0]: unknown channel 'road_frame'; did you mean 'road_frames'?

Safety rules checked here, besides types and references:

* a channel has exactly one writer, and a worker never reads what it writes itself;
* a control (or actuating) worker never reads, other than through ``shadow_subscribes``
  (log-only), a channel written in the research domain, marked ``shadow = true``, or
  derived from either through workers of other domains;
* only the control domain may actuate, and it never gets the network;
* publisher -> subscriber dependencies form no cycle, so ``Config.start_order()`` exists;
* a required worker does not depend on an optional one (admission may refuse that one);
* a module worker's ``memory_max`` can host the interpreter (`MIN_WORKER_MEMORY`);
* every worker has a ``memory_max`` and a ``pids_max``: its own, its domain's, or its
  profile's (`PROFILE_LIMITS`), never unset after loading;
* all channels' shared memory fits ``[supervisor] shm_budget``;
* every number is within its range, with its unit (`_loader`: ms, s, %, bytes, counts),
  a module worker's cpu_quota leaves it the CPU to start before its ready timeout
  (`MIN_START_CPU_S`), and no string holds a NUL or anything that is not UTF-8; names
  and host users match their patterns (they become paths, unit names, getpwnam input).

What depends on the machine rather than the file is checked by `check_runtime(cfg)`
(``supervisor check`` runs it): worker modules exist and define ``main(ctx)``, command
executables and ``extra_ro_binds`` exist, domain users exist, channels fit MemAvailable,
a worker whose module declares ``NEEDS_MODEL`` has ``model =``, a vehicle's state dir is
writable (probed, nothing left behind), and a vehicle config (``[supervisor] mode``) gives
no worker a simulation-only argument (the module's ``SIMULATION_ONLY``: recorded frames or
time into control, a camera paced by another domain, a model no ``[models]`` table
trusts), also not through a ``command`` that runs a worker module.

The package in parts: `_model` (the dataclasses and errors), `_loader` (TOML to checked
dataclasses), `_values` (value checks, sizes), `_rules` (the whole-file rules: writers,
trust, optional workers, cycles, users, shared memory), `_graph` (start order, cycles)
and `_runtime` (`check_runtime`).
"""
from supervisor.ipc.errors import ConfigError
from supervisor.ipc.spec import DTYPES, KINDS, PIXEL_FORMATS, ChannelSpec

from ._derive import default_doc, derive, dumps, minimal_doc
from ._loader import load, loads
from ._model import (CONTROL, DEFAULT_SHM_BUDGET, DEFAULT_SOURCE, MIN_WORKER_MEMORY,
                     PROFILE_LIMITS, PROFILES, PROJECT_PACKAGES, PROJECT_ROOT, RESEARCH, SIMULATION, VEHICLE, ChannelConfig, Config, ConfigFileError,
                     DomainConfig, ModelConfig, Problem, SupervisorConfig, WorkerConfig)
from ._rules import channel_shm_bytes
from ._runtime import check_runtime
from ._values import format_size, parse_size

__all__ = [
    "CONTROL", "DEFAULT_SHM_BUDGET", "DEFAULT_SOURCE", "DTYPES", "KINDS", "MIN_WORKER_MEMORY",
    "PIXEL_FORMATS", "PROFILE_LIMITS", "PROFILES", "PROJECT_PACKAGES", "PROJECT_ROOT", "RESEARCH", "SIMULATION", "VEHICLE", "ChannelConfig", "ChannelSpec",
    "Config", "ConfigError", "ConfigFileError", "DomainConfig", "ModelConfig", "Problem", "SupervisorConfig",
    "WorkerConfig", "channel_shm_bytes", "check_runtime", "default_doc", "derive", "dumps", "format_size", "load", "loads",
    "minimal_doc", "parse_size",
]
