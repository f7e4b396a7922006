"""One home for the rule "root writes only where no one else can point it".

The CLI runs as root (record, replay, log cut, log frames, the admission cache, units),
and its output directories are named by the user: a directory another local user owns,
or can rename and replace, lets that user choose what root writes, chmods, chowns or
deletes (red team round 5 rows 2, 3, 4, 12). The rule, in one place:

* every directory on the way to OUT (its parent and each ancestor, through any symlink
  on the way) is owned by a trusted uid (root, this process's euid and, for output the
  user asked for, the user who ran sudo) and writable by no one else, or sticky (/tmp:
  others may add names there but cannot rename or delete ours); a symlink on the way
  is a trusted uid's. Then no other user can change what OUT's path names;
* OUT itself is opened ``O_DIRECTORY|O_NOFOLLOW`` (made ``mode`` when missing) and
  checked by ``fstat`` on that fd: a trusted uid's, writable by no one else, empty when
  asked;
* every write, chmod, chown and unlink after that goes through the fd (``dir_fd=``,
  ``O_CREAT|O_EXCL|O_NOFOLLOW`` temp names renamed into place, ``fchmod``/``fchown``).

A refusal is an `OutDirError`: one line naming the path, why, and what to do.
broker/_checks.StateDir.open is the same rule for the broker's state dir (no sudo user
there, 0700).
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class OutDirError(Exception):
    """One line: which path, why it is refused, what to do."""


def trusted_uids(invoker: bool = True) -> frozenset[int]:
    """root, this process's euid and (``invoker``, as root under sudo) the user who ran
    sudo: their own directory is where they asked for the output."""
    uids = {0, os.geteuid()}
    if invoker and os.geteuid() == 0:
        sudo = os.environ.get("SUDO_UID", "")
        if sudo.isdecimal() and sudo.isascii():
            uids.add(int(sudo))
    return frozenset(uids)


def _private_group(gid: int, uids: frozenset[int]) -> bool:
    """``gid`` is a trusted user's own group and no one else's (a umask 002 login:
    private user groups make a user's directories 775)."""
    import grp
    import pwd

    try:
        g = grp.getgrgid(gid)
    except KeyError:
        return False
    owners = []
    for uid in uids:
        try:
            owners.append(pwd.getpwuid(uid))
        except KeyError:
            continue
    names = {pw.pw_name for pw in owners}
    return any(pw.pw_gid == gid for pw in owners) and set(g.gr_mem) <= names


def _why_untrusted(st: os.stat_result, uids: frozenset[int], *, sticky_ok: bool) -> str | None:
    if st.st_uid not in uids:
        return f"owned by uid {st.st_uid}"
    if stat.S_ISLNK(st.st_mode):
        return None          # a link's mode is always 777: who owns it decides
    if st.st_mode & 0o002 and not (sticky_ok and st.st_mode & stat.S_ISVTX):
        return f"writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    if st.st_mode & 0o020 and not (sticky_ok and st.st_mode & stat.S_ISVTX) \
            and not _private_group(st.st_gid, uids):
        return f"writable by group {st.st_gid} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def check_chain(path: str, *, what: str, uids: frozenset[int], shown: str | None = None) -> None:
    """Refuse ``path`` (a directory that exists) when another user could change what
    it names: an ancestor or a symlink on the way that is not trusted (module doc).
    ``shown``: the path the refusal names (the OUT inside ``path``)."""
    path = os.path.abspath(path)
    name = shown or path
    dirs: set[str] = set()
    parts = [p for p in path.split("/") if p]
    for i in range(len(parts) + 1):
        prefix = "/" + "/".join(parts[:i])
        try:
            st = os.lstat(prefix)
        except OSError as e:
            raise OutDirError(f"{what} {name}: {prefix}: {e.strerror}") from None
        if stat.S_ISLNK(st.st_mode):
            why = _why_untrusted(st, uids, sticky_ok=True)
            if why is not None:
                raise OutDirError(f"{what} {name}: {prefix} is a symlink {why}: another "
                                  "user chooses where it points; give a directory of your own")
        # Whatever this prefix resolves through, and where it ends, must be trusted.
        try:
            real = os.path.realpath(prefix, strict=True)
        except OSError as e:         # a loop, or a link to nothing
            raise OutDirError(f"{what} {name}: {prefix}: {e.strerror or e}") from None
        while True:
            dirs.add(real)
            if real == "/":
                break
            real = os.path.dirname(real)
    for d in sorted(dirs):
        try:
            st = os.stat(d)
        except OSError as e:
            raise OutDirError(f"{what} {name}: {d}: {e.strerror}") from None
        why = _why_untrusted(st, uids, sticky_ok=True)
        if why is not None:
            raise OutDirError(f"{what} {name}: {d} is {why}: that user could swap what is "
                              "written there; use a directory only you (or root) can write")


@dataclass
class OutDir:
    """An output directory held open by fd: every operation is relative to it and
    follows no symlink. A context manager (closes the fd)."""

    path: str
    fd: int
    created: bool = False

    @classmethod
    def open(cls, path: str, *, what: str = "--out", create: bool = True,
             empty: bool = True, mode: int = 0o755, invoker: bool = True,
             parents: bool = False) -> OutDir:
        """OUT checked by the module's rule; made ``mode`` (exactly) when missing and
        ``create``; ``empty``: an existing one must hold nothing; ``parents``: missing
        ancestors are made 0755, each by the same rule."""
        uids = trusted_uids(invoker)
        path = os.path.abspath(path)
        name = os.path.basename(path)
        parent = os.path.dirname(path)
        if not name or name in (".", ".."):
            raise OutDirError(f"{what} {path}: not a directory name")
        if parents and create and not os.path.lexists(parent):
            cls.open(parent, what=what, empty=False, invoker=invoker, parents=True).close()
        if not os.path.isdir(parent):
            raise OutDirError(f"{what} {path}: its parent directory {parent} does not exist")
        check_chain(parent, what=what, uids=uids, shown=path)
        try:
            pfd = os.open(parent, _DIR_FLAGS & ~os.O_NOFOLLOW)   # the chain is trusted
        except OSError as e:
            raise OutDirError(f"{what} {path}: {parent}: {e.strerror}") from None
        try:
            created = False
            try:
                st = os.lstat(name, dir_fd=pfd)
            except FileNotFoundError:
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode):
                if _why_untrusted(st, uids, sticky_ok=True) is not None:
                    raise OutDirError(f"{what} {path}: a symlink owned by uid {st.st_uid}: "
                                      "another user chooses where it points; give the "
                                      "real directory")
                os.close(pfd)
                pfd = -1
                try:
                    real = os.path.realpath(path, strict=True)
                except OSError as e:     # a loop, or a link to nothing
                    raise OutDirError(f"{what} {path}: {e.strerror or e}") from None
                if real == path:
                    raise OutDirError(f"{what} {path}: a symlink that resolves to itself")
                return cls.open(real, what=what, create=create,
                                empty=empty, mode=mode, invoker=invoker, parents=parents)
            if st is None:
                if not create:
                    raise OutDirError(f"{what} {path}: no such directory")
                try:
                    os.mkdir(name, 0o700, dir_fd=pfd)
                    created = True
                except FileExistsError:
                    pass                  # made meanwhile: judged below like any other
                except OSError as e:
                    raise OutDirError(f"{what} {path}: {e.strerror}") from None
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
            except OSError as e:
                why = "not a directory" if e.errno in (20, 40) else e.strerror   # ENOTDIR, ELOOP
                raise OutDirError(f"{what} {path}: {why}") from None
        finally:
            if pfd >= 0:
                os.close(pfd)
        out = cls(path, fd, created)
        try:
            st = os.fstat(fd)
            if created:
                os.fchmod(fd, mode)       # exactly: the umask does not decide who reads
            else:
                why = _why_untrusted(st, uids, sticky_ok=False)
                if why is not None:
                    raise OutDirError(f"{what} {path}: {why}; it must be yours and writable "
                                      "by no one else (or name a new directory)")
                if empty and any(True for _ in os.scandir(fd)):
                    raise OutDirError(f"{what} {path}: exists and is not an empty directory")
        except BaseException:
            out.close()
            raise
        return out

    def __enter__(self) -> OutDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def chmod(self, mode: int) -> None:
        os.fchmod(self.fd, mode)

    def chown(self, uid: int, gid: int) -> None:
        os.fchown(self.fd, uid, gid)

    def subdir(self, name: str, mode: int = 0o755) -> OutDir:
        """``name`` inside, made ``mode`` if missing (never through a link)."""
        created = False
        try:
            os.mkdir(name, 0o700, dir_fd=self.fd)
            created = True
        except FileExistsError:
            pass
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        except OSError as e:         # a link or a file planted under its name
            raise OutDirError(f"{self.join(name)}: {e.strerror} (a symlink or a file "
                              "where a directory was to be)") from None
        sub = OutDir(self.join(name), fd, created)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() and not created:
                raise OutDirError(f"{sub.path}: owned by uid {st.st_uid}, not this process's")
            os.fchmod(fd, mode)
        except BaseException:
            sub.close()
            raise
        return sub

    def write_bytes(self, name: str, data: bytes, mode: int = 0o644) -> None:
        """``name`` replaced atomically: a fresh temp file (``O_EXCL|O_NOFOLLOW``: a name
        planted there is removed, never followed), renamed over ``name`` (rename replaces
        a symlink, it does not write through it). OSError is the caller's."""
        tmp = f".{name}.{os.getpid()}-{os.urandom(4).hex()}.tmp"   # threads: each its own
        self.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=self.fd)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            self.unlink(tmp)
            raise

    def write_text(self, name: str, text: str, mode: int = 0o644) -> None:
        self.write_bytes(name, text.encode("utf-8"), mode)

    def unlink(self, name: str) -> None:
        """Remove ``name`` (a link is removed, never followed); missing is fine."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def names(self) -> list[str]:
        return [e.name for e in os.scandir(self.fd)]
