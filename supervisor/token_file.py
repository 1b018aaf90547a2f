"""Secrets kept in files: the API's bearer token (``<state dir>/api-token`` unless the
daemon's config names another, ``api_token_file``), its read-only token
(``<state dir>/api-read-token``: the status page, /metrics, every GET) and the telemetry
secret each attempt's key derives from (``<state dir>/telemetry-secret``).

The daemon makes each on its first start, with mode 0600, and reads it on every later
one; ``supervisorctl`` reads a token where it can (cli/ctl.py). A file that others may
read is refused rather than used: the API token is the key to every write. The read-only
token alone may be shared with a group (mode 0640: ``chgrp operators`` it).
"""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

TOKEN_FILE_NAME = "api-token"  # noqa: S105 - a file name, not a secret
READ_TOKEN_FILE_NAME = "api-read-token"  # noqa: S105 - a file name, not a secret
TELEMETRY_SECRET_NAME = "telemetry-secret"  # noqa: S105 - a file name, not a secret
_TOKEN_BYTES = 32  # 256 bits, as URL-safe base64: 43 characters


@dataclass(frozen=True, slots=True)
class ApiTokens:
    """The API's two tokens and where they are kept (for the messages that name them)."""

    token: str  # every request
    token_file: Path
    read_token: str  # reads only
    read_token_file: Path


def ensure_token(path: Path, what: str = "API token", *, group_may_read: bool = False) -> str:
    """The token in ``path``, made (mode 0600) when the file does not exist. A file others
    can read (or its group, unless ``group_may_read``) is refused, not silently used."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token(path, check_mode=True, what=what, group_may_read=group_may_read)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(_TOKEN_BYTES) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return read_token(path, check_mode=True, what=what)


def read_token(path: Path, *, check_mode: bool = False, what: str = "API token",
               group_may_read: bool = False) -> str:
    """The token a file holds; OSError when unreadable, ValueError when unusable."""
    if check_mode:
        mode = path.stat().st_mode
        closed = stat.S_IRWXO | (stat.S_IWGRP | stat.S_IXGRP if group_may_read else stat.S_IRWXG)
        if mode & closed:
            raise ValueError(f"{path}: the {what} file is open to others (mode "
                             f"{stat.S_IMODE(mode):04o}); chmod {'640' if group_may_read else '600'} it")
    token = path.read_text().strip()
    if len(token) < 16 or any(c.isspace() for c in token):
        raise ValueError(f"{path}: not a usable {what} (expected one line of at least 16 characters)")
    return token
