"""systemd unit for the supervisor, generated from the config.

One unit runs the supervisor; the supervisor runs the workers in their own sandboxes
(systemd cannot express the per-worker bubblewrap + seccomp + fd hand-off). The unit
adds what systemd does best around it: notify/watchdog, restart policy that does not
loop on a bad config or an admission refusal, resource caps and hardening that still
lets bubblewrap create user namespaces.
"""
from __future__ import annotations

import sys
from pathlib import Path

from supervisor.config import Config
from supervisor.lifecycle import Exit


def render(cfg: Config, *, config_path: str | None, python: str = sys.executable) -> str:
    conf = f" --config {Path(config_path).resolve()}" if config_path else ""
    memory = sum(w.memory_max or 0 for w in cfg.workers.values())
    needs_net = any(d.network for d in cfg.domains.values())
    lines = [
        "[Unit]",
        f"Description=trio supervisor: {len(cfg.workers)} sandboxed workers from {cfg.source}",
        "After=local-fs.target",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        f"ExecStart={python} -m supervisor.cli run{conf}",
        "WatchdogSec=2s",
        "Restart=on-failure",
        "RestartSec=1s",
        # A bad config or a refused worker will not get better by restarting.
        # A failed-safe control domain stays down until an operator clears the latch.
        f"RestartPreventExitStatus={int(Exit.CONFIG)} {int(Exit.REFUSED)} {int(Exit.FAIL_SAFE)}",
        "KillMode=mixed",
        "TimeoutStopSec=15s",
        *( [f"MemoryMax={memory}"] if memory else []),
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=read-only",
        "PrivateTmp=yes",
        "PrivateDevices=yes",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "MemoryDenyWriteExecute=no",   # tinygrad maps compiled kernels executable
        "SystemCallArchitectures=native",
        "RestrictAddressFamilies=AF_UNIX" + (" AF_INET AF_INET6 AF_NETLINK" if needs_net else ""),
        *([] if needs_net else ["PrivateNetwork=yes", "IPAddressDeny=any"]),
        # bubblewrap needs to create user/pid/net/mount/ipc/uts namespaces.
        "RestrictNamespaces=user pid net mnt ipc uts cgroup",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "UMask=0077",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


def write_units(cfg: Config, out: Path, *, config_path: str | None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "trio-supervisor.service"
    path.write_text(render(cfg, config_path=config_path))
    return [path]
