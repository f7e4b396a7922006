"""Make bind sources reachable for sandboxes that run as unprivileged host uids.

bubblewrap runs as the domain's host uid (never root), so it resolves every bind
source with that uid's permissions. An interpreter under a 0700 directory
(/root/.pyenv here) is then unreachable. Loosening /root is not an option, so a
root helper makes a *private* mount namespace in which each unreachable source is
bind-mounted read-only (a domain's ``extra_rw_binds``: read-write) under a
world-traversable tmpfs, and bwrap is started inside
that namespace (``setns`` between fork and exec). The host never sees these mounts,
and they vanish with the last reference to the namespace: nothing to clean up after
a crash.
"""
from __future__ import annotations

import atexit
import os
import shlex
import stat
import subprocess
import threading
from dataclasses import dataclass, field
from typing import Iterable

CLONE_NEWNS = 0x00020000
# Mount point on the host: an empty directory; the tmpfs over it exists only in the
# private namespace.
BASE = "/run/trio-staging"


def reachable_by_stranger(path: str) -> bool:
    """True if a uid with no relation to any owner can open `path` (and below).

    Every ancestor needs o+x; the path itself o+r (and o+x for a directory).
    """
    path = os.path.abspath(path)
    parts = path.split("/")
    for i in range(1, len(parts)):
        d = "/".join(parts[:i]) or "/"
        try:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    try:
        st = os.stat(path)
    except OSError:
        return True   # missing: bwrap reports it, not us
    need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(st.st_mode) else 0)
    return st.st_mode & need == need


@dataclass
class Staging:
    """A private mount namespace exposing `sources` under BASE/<n>, read-only, and
    for each directory in `hide` a view of it without the named entries."""

    sources: tuple[str, ...]
    hide: tuple[tuple[str, tuple[str, ...]], ...] = ()
    mntns_fd: int = -1
    _index: dict[str, str] = field(default_factory=dict)
    views: dict[str, str] = field(default_factory=dict)   # directory -> its filtered view

    @classmethod
    def create(cls, sources: Iterable[str],
               hide: Iterable[tuple[str, tuple[str, ...]]] = (),
               writable: Iterable[str] = ()) -> "Staging":
        srcs = tuple(sorted(set(os.path.abspath(s) for s in sources)))
        rw = {os.path.abspath(s) for s in writable}
        st = cls(srcs, tuple(sorted(hide)))
        if not srcs and not st.hide:
            return st
        os.makedirs(BASE, mode=0o755, exist_ok=True)
        # umask 022: the views' directories are traversed by the domains' users (a
        # root shell's umask 077 made every control worker fail to import).
        script = ["set -e", "umask 022",
                  f"mount -t tmpfs -o mode=0755,size=64k,nosuid,nodev trio-staging {BASE}"]
        for i, s in enumerate(srcs):
            d = f"{BASE}/{i}"
            st._index[s] = d
            point = f"mkdir {d}" if os.path.isdir(s) else f": > {d}"   # a file binds onto a file
            # Read-only unless it is a domain's writable bind (extra_rw_binds).
            script += [point, f"mount --rbind {shlex.quote(s)} {d}",
                       f"mount -o remount,bind,{'' if s in rw else 'ro,'}nosuid,nodev {d}"]
        # Hidden entries: a read-only overlay whose top layer holds a whiteout (char
        # device 0:0) per name. One mount, built once; each sandbox binds the view over
        # the directory at the cost of one bind (rebuilding it from its other entries
        # cost ~250 mounts, a quarter of a second, per sandbox).
        for i, (d, names) in enumerate(st.hide):
            wh, view = f"{BASE}/w{i}", f"{BASE}/v{i}"
            st.views[d] = view
            script += [f"mkdir {wh} {view}"]
            script += [f"mknod {shlex.quote(wh + '/' + n)} c 0 0" for n in names]
            script += [f"mount -t overlay trio-hide -o ro,nosuid,nodev,"
                       f"lowerdir={wh}:{shlex.quote(d)} {view}"]
        script += ["echo ready", "exec cat >/dev/null"]
        # util-linux unshare: --propagation slave so our mounts never reach the host.
        p = subprocess.Popen(["unshare", "--mount", "--propagation", "slave", "sh", "-c",
                              "\n".join(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})
        try:
            line = p.stdout.readline()
            if line != b"ready\n":
                err = " ".join(p.stderr.read().decode(errors="replace").split())
                raise OSError(f"staging mount namespace failed: {err or 'no output'}")
            st.mntns_fd = os.open(f"/proc/{p.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            p.stdin.close()   # the helper exits; the namespace lives on through our fd
            p.wait()
            p.stdout.close()
            p.stderr.close()
        return st

    def source_for(self, path: str) -> str:
        """Where bwrap (inside the staging namespace) finds host `path`."""
        path = os.path.abspath(path)
        for s, d in self._index.items():
            if path == s:
                return d
            if path.startswith(s.rstrip("/") + "/"):
                return d + path[len(s.rstrip("/")):]
        return path

    def close(self) -> None:
        if self.mntns_fd >= 0:
            os.close(self.mntns_fd)
            self.mntns_fd = -1


_lock = threading.Lock()
_cache: dict[tuple, Staging] = {}


def staging_for(paths: Iterable[str], hidden: Iterable[str] = (),
                writable: Iterable[str] = ()) -> Staging:
    """The shared staging namespace for the unreachable ones among `paths`, with
    filtered views of the directories holding `hidden` entries.

    One per distinct set, kept for the life of the process (a few kB of tmpfs).
    """
    need = tuple(sorted({os.path.abspath(p) for p in paths if not reachable_by_stranger(p)}))
    by_dir: dict[str, set[str]] = {}
    for h in hidden:
        by_dir.setdefault(os.path.dirname(h), set()).add(os.path.basename(h))
    hide = tuple(sorted((d, tuple(sorted(n))) for d, n in by_dir.items()
                        if ":" not in d and "," not in d))   # overlay option syntax
    rw = tuple(sorted(os.path.abspath(p) for p in writable if os.path.abspath(p) in need))
    with _lock:
        st = _cache.get((need, hide, rw))
        if st is None:
            st = _cache[(need, hide, rw)] = Staging.create(need, hide, rw)
        return st


@atexit.register
def _close_all() -> None:
    for st in _cache.values():
        st.close()
    _cache.clear()
