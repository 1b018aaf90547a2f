"""Directories of one user's own in a directory every user may write (/dev/shm, /tmp,
/var/tmp), for what a rank keeps on its node: the memory tier's saves, the node's slot
file, the Neuron compile cache.

In such a directory another user can make the name first: a directory of theirs (they
read our shards, or replace our files), a link to somewhere of ours. So every component
of the path that sits in a world-writable directory must be a real directory (never a
link) owned by this process's user, and the directory itself admits nobody else. What
is missing is made, mode 0700. A path that fails is ``UsageError``: the node must be
cleaned (or the path changed), and a retry would meet the same.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from wire.errors import UsageError


def private_dir(path: Path) -> Path:
    """``path``, made or checked as above; returned for chaining."""
    path = Path(os.path.abspath(path))
    uid = os.geteuid()
    here = Path(path.anchor)
    for name in path.parts[1:]:
        parent_st = os.lstat(here)
        here = here / name
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):  # another rank of the node made it meanwhile
                os.mkdir(here, 0o700)
            st = os.lstat(here)
        shared = bool(parent_st.st_mode & stat.S_IWOTH)  # anybody may make this name
        if shared and (not stat.S_ISDIR(st.st_mode) or st.st_uid != uid):
            what = "a link" if stat.S_ISLNK(st.st_mode) else "not a directory" if not stat.S_ISDIR(
                st.st_mode) else f"owned by uid {st.st_uid}"
            raise UsageError(f"{here}: {what}, in a directory every user may write; this process runs as "
                             f"uid {uid} and will not use it (remove it, or choose another path)")
    st = os.lstat(path)
    if st.st_uid == uid and st.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours, made by an older version with the default umask
    return path
