"""systemd unit for the supervisor, generated from the config, for the install target.

One unit runs the supervisor; the supervisor runs the workers in their own sandboxes
(systemd cannot express the per-worker bubblewrap + seccomp + fd hand-off). The unit
adds what systemd does best around it: notify/watchdog, a restart policy that does not
loop on a bad config, an admission refusal or a latched fail-safe, resource caps, a
delegated cgroup subtree, and every hardening option that still lets the supervisor do
its root work and bubblewrap build its sandboxes.

The interpreter is the install target's, never the developer's: ``--prefix`` (a venv,
default `DEFAULT_PREFIX`, ExecStart uses PREFIX/bin/python3) or ``--python``.

What the supervisor needs, and so what the unit cannot take away (each measured by
running ``supervisor audit --live`` under these restrictions, see tests/test_units.py):

* root (User=root), with exactly these capabilities: CAP_SETUID/CAP_SETGID (a sandbox
  drops to its domain's host user between fork and exec), CAP_SYS_ADMIN (the staging
  mount namespace, /proc/PID/map_files), CAP_SYS_CHROOT (setns into the staging mount
  namespace), CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH (reading the workers' /proc: maps,
  fds, the exec watch's judgement), CAP_KILL (stopping sandboxes that run as other uids;
  without it an orderly stop leaves them running);
* the cgroup file system writable (ProtectControlGroups=no) below its own delegated
  subtree (Delegate=yes);
* user, pid, net, mnt, ipc, uts and cgroup namespaces for bwrap, and the mount family of
  system calls (bwrap, the staging helper);
* a /proc that a user namespace may mount again: ProtectKernelTunables=,
  ProtectKernelLogs= and ProcSubset=pid cover parts of /proc with mounts, after which
  the kernel refuses bwrap's ``--proc`` (EPERM; measured); ProtectProc=invisible is fine;
* sethostname inside the sandbox's UTS namespace: ProtectHostname= forbids it by seccomp;
* AF_NETLINK besides AF_UNIX: bwrap brings up the loopback interface of each new network
  namespace over rtnetlink, and fails without it (measured);
* UMask=0022: the staging helper's directories (the filtered site-packages views) are
  created under the supervisor's umask, and with 0077 the domain users cannot traverse
  them (every control worker then fails to start; measured).
"""
from __future__ import annotations

from pathlib import Path

from supervisor.config import Config
from supervisor.exits import Exit

DEFAULT_PREFIX = "/opt/trio-supervisor"   # python3 -m venv; pip install '<pkg>[research]'
UNIT_NAME = "trio-supervisor.service"

CAPABILITIES = ("CAP_SETUID", "CAP_SETGID", "CAP_SYS_ADMIN", "CAP_SYS_CHROOT",
                "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_KILL")
NAMESPACES = ("user", "pid", "net", "mnt", "ipc", "uts", "cgroup")
# Denied with EPERM for the supervisor and everything below it (the workers' own filters
# stack on top). Not denied, because bwrap or the supervisor needs them: @mount,
# @privileged (setresuid, setgroups, capset, pivot_root, sethostname), @process (clone
# with namespace flags, unshare, setns), seccomp, landlock_*.
SYSCALL_DENY = ("@clock", "@cpu-emulation", "@debug", "@keyring", "@module", "@obsolete",
                "@raw-io", "@reboot", "@resources", "@swap", "bpf", "userfaultfd",
                "io_uring_setup", "io_uring_enter", "io_uring_register")
_HOMES = ("/root", "/home", "/run/user")
_DEFAULT_NOFILE_HARD = 524288     # systemd's default hard RLIMIT_NOFILE for services


def target_python(python: str | None = None, prefix: str | None = None) -> str:
    """The install target's interpreter: ``python`` as given, else PREFIX/bin/python3."""
    if python:
        return python
    return str(Path(prefix or DEFAULT_PREFIX) / "bin" / "python3")


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def render(cfg: Config, *, config_path: str | None, python: str | None = None,
           prefix: str | None = None) -> str:
    from supervisor.sandbox.staging import BASE as STAGING

    py = target_python(python, prefix)
    conf_file = str(Path(config_path).resolve()) if config_path else None
    conf = f" --config {conf_file}" if conf_file else ""
    memory = sum(w.memory_max or 0 for w in cfg.workers.values())
    needs_net = any(d.network for d in cfg.domains.values())
    nofile = max((w.nofile or 0 for w in cfg.workers.values()), default=0)
    home = any(_under(p, _HOMES) for p in (py, conf_file or ""))
    state = cfg.supervisor.state_dir.rstrip("/")
    if state.startswith("/var/lib/") and "/" not in state[len("/var/lib/"):]:
        state_lines = [f"StateDirectory={state[len('/var/lib/'):]}", "StateDirectoryMode=0700"]
    else:
        state_lines = [f"ReadWritePaths=-{state}"]
    staging = ([f"RuntimeDirectory={STAGING[len('/run/'):]}", "RuntimeDirectoryMode=0755"]
               if STAGING.startswith("/run/") else [f"ReadWritePaths=-{STAGING}"])
    lines = [
        "# Generated by `supervisor units` from the config; regenerate, do not edit.",
        "[Unit]",
        f"Description=trio supervisor: {len(cfg.workers)} sandboxed workers from {cfg.source}",
        "After=local-fs.target",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        f"ExecStart={py} -m supervisor.cli run{conf}",
        "Environment=PYTHONDONTWRITEBYTECODE=1",
        "WatchdogSec=2s",
        "Restart=on-failure",
        "RestartSec=1s",
        "# 2 config error, 3 admission refused a required worker, 4 fail-safe latched:",
        "# none gets better by restarting (4 waits for `supervisor clear-fail-safe`).",
        f"RestartPreventExitStatus={int(Exit.CONFIG)} {int(Exit.REFUSED)} {int(Exit.FAIL_SAFE)}",
        "KillMode=mixed",
        "TimeoutStopSec=15s",
        "# The supervisor makes one cgroup per worker run below its own.",
        "Delegate=yes",
        *([f"MemoryMax={memory}"] if memory else []),
        *([f"LimitNOFILE=1024:{nofile}"] if nofile > _DEFAULT_NOFILE_HARD else []),
        "LimitCORE=0",
        *state_lines,
        "# The staging mount namespace's mount point (supervisor/sandbox/staging.py).",
        *staging,
        "User=root",
        "# setuid/setgid: drop to the domain user; sys_admin + sys_chroot: the staging",
        "# mount namespace; sys_ptrace + dac_read_search: the workers' /proc (maps scan,",
        "# exec watch); kill: stop sandboxes of other uids.",
        "CapabilityBoundingSet=" + " ".join(CAPABILITIES),
        "AmbientCapabilities=",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        f"ProtectHome={'read-only' if home else 'yes'}",
        "PrivateTmp=yes",
        "PrivateDevices=yes",
        "PrivateMounts=yes",
        "PrivateIPC=yes",
        "ProtectKernelModules=yes",
        "ProtectClock=yes",
        "ProtectProc=invisible",
        "# Off on purpose: each of these breaks bubblewrap inside the unit (its --proc",
        "# mount is refused under covered /proc files; --hostname needs sethostname) or the",
        "# per-worker cgroups.",
        "ProtectKernelTunables=no",
        "ProtectKernelLogs=no",
        "ProtectHostname=no",
        "ProtectControlGroups=no",
        "KeyringMode=private",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "# tinygrad maps the signed artifact's kernels executable (modeld, jit_kernels).",
        "MemoryDenyWriteExecute=no",
        "SystemCallArchitectures=native",
        "SystemCallFilter=~" + " ".join(SYSCALL_DENY),
        "SystemCallErrorNumber=EPERM",
        "# AF_NETLINK: bwrap brings up lo in each sandbox's network namespace (rtnetlink).",
        "RestrictAddressFamilies=AF_UNIX AF_NETLINK" + (" AF_INET AF_INET6" if needs_net else ""),
        *([] if needs_net else ["PrivateNetwork=yes", "IPAddressDeny=any"]),
        "# bubblewrap creates every one of these for each sandbox.",
        "RestrictNamespaces=" + " ".join(NAMESPACES),
        "UMask=0022",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


def write_units(cfg: Config, out: Path, *, config_path: str | None, python: str | None = None,
                prefix: str | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / UNIT_NAME
    path.write_text(render(cfg, config_path=config_path, python=python, prefix=prefix))
    return [path]
