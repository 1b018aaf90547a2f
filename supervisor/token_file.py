"""Secrets kept in files: the API's bearer token (``<state dir>/api-token`` unless the
daemon's config names another, ``api_token_file``) and the telemetry secret each
attempt's key derives from (``<state dir>/telemetry-secret``).

The daemon makes it on its first start, with mode 0600, and reads it on every later
one; ``supervisorctl`` reads it where it can (api/ctl.py). A file that others may read
is refused rather than used: the token is the key to every write.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

TOKEN_FILE_NAME = "api-token"  # noqa: S105 - a file name, not a secret
TELEMETRY_SECRET_NAME = "telemetry-secret"  # noqa: S105 - a file name, not a secret
_TOKEN_BYTES = 32  # 256 bits, as URL-safe base64: 43 characters


def ensure_token(path: Path, what: str = "API token") -> str:
    """The token in ``path``, made (mode 0600, never group- or world-readable) when the
    file does not exist. A file others can read is refused, not silently used."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return read_token(path, check_mode=True, what=what)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(_TOKEN_BYTES) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return read_token(path, check_mode=True, what=what)


def read_token(path: Path, *, check_mode: bool = False, what: str = "API token") -> str:
    """The token a file holds; OSError when unreadable, ValueError when unusable."""
    if check_mode:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"{path}: the {what} file is open to others (mode "
                             f"{stat.S_IMODE(mode):04o}); chmod 600 it")
    token = path.read_text().strip()
    if len(token) < 16 or any(c.isspace() for c in token):
        raise ValueError(f"{path}: not a usable {what} (expected one line of at least 16 characters)")
    return token
