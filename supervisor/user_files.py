"""Files in directories a run's user can write, touched by a daemon that may be root.

A run's directories (its run directory, attempts, logs, checkpoint directory) are the
run's user's, who can put anything there while the daemon works: a symbolic link to the
daemon's state directory or to /etc, a FIFO that blocks its reader for ever, a link to
/dev/zero that never ends. So the daemon

- reaches such a path from a directory it trusts one component at a time, never
  following a link (``O_NOFOLLOW`` at every step), and then works on what it opened:
  ``fchown`` on the descriptor, creations and renames relative to the held directory;
- opens files without blocking (``O_NONBLOCK``), uses regular files only, and reads at
  most a stated number of bytes;
- below a trusted ``base`` (the daemon's own runs directory, where it reads and appends
  to a run's logs as itself), uses a file of one name only: a hard link is another
  file's second name (``fs.protected_hardlinks`` stops a user making one of a file not
  hers, where it is set; this does not depend on it).

What the daemon does in a run's checkpoint directory, its results and its scripts goes
through supervisor/runfiles/user_tree.py instead: a worker of the run's user uses these same
functions with that user's rights.

A refusal raises ``UnsafePath``, an ``OSError``: callers that treat an unreadable file as
absent (or a failed launch as a launch error) keep doing so, and the message says what
was found instead of a file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Owner(Protocol):
    """Who a handed-over path is made to belong to (users.RunAs)."""

    @property
    def uid(self) -> int: ...
    @property
    def gid(self) -> int: ...


class UnsafePath(OSError):
    """A path the daemon will not use: a link, a special file, too big, outside its base."""


class TreeStalled(OSError):
    """The run's user's worker (supervisor/runfiles/user_tree.py) did not answer in time: no
    answer, so not one a caller may take for "unreadable" or "absent"."""


def _parts(base: Path, path: Path) -> list[str]:
    try:
        rel = path.relative_to(base)
    except ValueError:
        raise UnsafePath(errno.EXDEV, f"{path} is not under {base}") from None
    if any(p in ("..", "") for p in rel.parts):
        raise UnsafePath(errno.EINVAL, f"{path}: '..' in a path under {base}")
    return [p for p in rel.parts if p != "."]


def _opened_dir(fd: int, name: str, shown: Path, *, create: bool, mode: int,
                owner: Owner | None = None) -> int:
    try:
        return os.open(name, _DIR, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePath(e.errno, f"{shown}: not a directory (a link or a file is there)") from None
        raise
    made = False
    with contextlib.suppress(FileExistsError):  # made meanwhile: opened below all the same
        os.mkdir(name, mode, dir_fd=fd)
        made = True
    opened = _opened_dir(fd, name, shown, create=False, mode=mode)
    if made and owner is not None:  # what the daemon makes in a user's tree is the user's
        os.fchown(opened, owner.uid, owner.gid)
    return opened


@contextlib.contextmanager
def directory(base: Path, path: Path, *, create: bool = False, mode: int = 0o755,
              owner: Owner | None = None) -> Iterator[int]:
    """A descriptor of the directory ``path`` under the trusted ``base``, reached without
    following a link below ``base`` (made where missing when ``create``, ``owner``'s)."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    shown = base
    try:
        for name in _parts(base, path):
            shown = shown / name
            inner = _opened_dir(fd, name, shown, create=create, mode=mode, owner=owner)
            os.close(fd)
            fd = inner
        yield fd
    finally:
        os.close(fd)


def _regular(fd: int, path: Path) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafePath(errno.EINVAL, f"{path}: not a regular file (mode {stat.filemode(st.st_mode)})")
    return st


def _open_file(path: Path, flags: int, base: Path | None, mode: int = 0o644) -> int:
    try:
        if base is None:
            fd = os.open(path, flags | _OPEN, mode)
        else:
            with directory(base, path.parent) as parent:
                fd = os.open(path.name, flags | _OPEN, mode, dir_fd=parent)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(e.errno, f"{path}: a symbolic link, not followed") from None
        raise
    st = _regular(fd, path)
    if base is not None and st.st_nlink > 1:
        os.close(fd)
        raise UnsafePath(errno.EMLINK, f"{path}: a file of {st.st_nlink} names (a hard link), not used")
    return fd


def read_bytes(path: Path, limit: int, *, base: Path | None = None, offset: int = 0) -> bytes:
    """At most ``limit`` bytes of the regular file ``path`` from ``offset`` (its last
    component never a link; none below ``base`` when given)."""
    fd = _open_file(path, os.O_RDONLY, base)
    with os.fdopen(fd, "rb") as f:
        if offset:
            f.seek(offset)
        return f.read(limit)


def read_text(path: Path, limit: int = 1 << 20, *, base: Path | None = None) -> str:
    """The whole of a small regular file; UnsafePath when it holds more than ``limit`` bytes."""
    fd = _open_file(path, os.O_RDONLY, base)
    size = os.fstat(fd).st_size
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if size > limit or len(data) > limit:
        raise UnsafePath(errno.EFBIG, f"{path}: {max(size, len(data))} bytes, more than the {limit} read")
    return data.decode()  # UnicodeDecodeError (a ValueError) for what is not text


def size_of(path: Path, *, base: Path | None = None) -> int:
    """The size of the regular file ``path`` (opened as the readers above open it)."""
    fd = _open_file(path, os.O_RDONLY, base)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def open_append(base: Path, path: Path) -> int:
    """A descriptor appending to the regular file ``path`` under ``base``, created when
    missing (a rank's log, opened here and handed to the rank)."""
    fd = _open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, base)
    os.set_blocking(fd, True)
    return fd


def write_atomic(base: Path, path: Path, data: bytes, owner: Owner | None = None) -> None:
    """Replace ``path`` under ``base`` with ``data``: a fresh temporary file beside it
    (``O_EXCL``: never one somebody planted), owned by ``owner`` when given, renamed over."""
    with directory(base, path.parent, create=True) as parent:
        tmp = f".{path.name}.{os.getpid()}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=parent)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN, 0o644, dir_fd=parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if owner is not None:
                    os.fchown(f.fileno(), owner.uid, owner.gid)
            os.replace(tmp, path.name, src_dir_fd=parent, dst_dir_fd=parent)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=parent)
            raise


def hand_over(base: Path, owner: Owner, *paths: Path) -> None:
    """Make each directory (created if missing) or existing file under ``base`` the
    owner's, reached without following a link: a link planted in a path's place fails
    the hand-over instead of giving away what it points to."""
    for path in paths:
        if path == base or path.is_dir() or not path.exists():
            with directory(base, path, create=True) as fd:
                os.fchown(fd, owner.uid, owner.gid)
            continue
        fd = _open_file(path, os.O_RDONLY, base)
        try:
            os.fchown(fd, owner.uid, owner.gid)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _listed(base: Path | None, path: Path) -> Iterator[int]:
    """``directory(base, path)``, or with no base the directory ``path`` itself (its last
    component not a link)."""
    if base is not None:
        with directory(base, path) as fd:
            yield fd
        return
    fd = os.open(path, _DIR)
    try:
        yield fd
    finally:
        os.close(fd)


def listdir(base: Path | None, path: Path) -> list[str]:
    """The names in the directory ``path`` (reached from ``base`` without following a
    link below it, when given), sorted."""
    with _listed(base, path) as fd:
        return sorted(os.listdir(fd))


def newest_mtime(base: Path | None, path: Path, suffix: str) -> float | None:
    """When a regular file of ``path`` whose name ends in ``suffix`` last changed (the
    newest; links and special files passed over), or None."""
    newest = None
    with _listed(base, path) as fd:
        for name in os.listdir(fd):
            if not name.endswith(suffix):
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
    return newest


class Reader(Protocol):
    """Who reads a run's logs: ``HERE`` (this process) or the run's user's worker
    (supervisor/runfiles/user_tree.py's ``Tree``), with the functions above."""

    def listdir(self, base: Path | None, path: Path) -> list[str]: ...
    def size_of(self, path: Path, *, base: Path | None = None) -> int: ...
    def read_bytes(self, path: Path, limit: int, *, base: Path | None = None, offset: int = 0) -> bytes: ...


class _Here:
    """The functions of this module, as a ``Reader``."""

    listdir = staticmethod(listdir)
    size_of = staticmethod(size_of)
    read_bytes = staticmethod(read_bytes)


HERE: Reader = _Here()


def move_into(base: Path, path: Path, into: Path, owner: Owner | None = None) -> Path:
    """Move ``path`` (any entry, a link included: it is moved, not followed) from its
    directory under ``base`` into the directory ``into`` under ``base`` (made when
    missing, ``owner``'s: the user's tree stays the user's); the entry's new path."""
    with directory(base, path.parent) as src, directory(base, into, create=True, owner=owner) as dst:
        os.rename(path.name, path.name, src_dir_fd=src, dst_dir_fd=dst)
    return into / path.name
