"""Who may do what through the API: a bearer token for every write, and one for every
read: the same, or the read-only token.

The daemon keeps both in files (supervisor/token_file.py), created with mode 0600 on its
first start: whoever can read the API token may operate the supervisor; whoever has the
read-only token may watch it (the status page, /metrics, every GET). No client is
trusted for where it connects from: an SSH tunnel or a proxy makes every client look
local. ``supervisorctl`` finds a token through its config or the environment
(cli/ctl.py); the status page asks for the read-only token once and keeps it for the
browser tab (api/status.html). Tokens are compared in constant time. ``/healthz`` and the
status page's own HTML are open: neither holds anything of the runs.

    no token where one is needed   401 {"error": "Unauthorized", ...}, WWW-Authenticate: Bearer
    a token that is not the one    403 {"error": "Forbidden", ...}
"""

from __future__ import annotations

import hmac
from pathlib import Path

from fastapi import Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer


class TokenAuth:
    """The API's two FastAPI dependencies: ``write`` for every request that changes
    something (the API token), ``read`` for the rest (either token). Both name the
    bearer scheme, so that the OpenAPI schema says which operations need a token."""

    def __init__(self, token: str, token_file: Path | None = None, *, read_token: str | None = None,
                 read_token_file: Path | None = None) -> None:
        writers = [token.encode()]
        readers = [*writers, *([read_token.encode()] if read_token else [])]
        where = f" (it is in {token_file} on the daemon's host)" if token_file else ""
        read_where = f" (in {read_token_file} on the daemon's host)" if read_token_file else ""
        # auto_error=False: a missing header is our 401 with our body, not FastAPI's 403.
        bearer = HTTPBearer(auto_error=False, description="the API token (reads: or the read-only one)")

        def check(credentials: HTTPAuthorizationCredentials | None, allowed: list[bytes], what: str) -> None:
            if credentials is None:
                raise HTTPException(
                    401, f"this request needs {what}: send 'Authorization: Bearer <token>'",
                    headers={"WWW-Authenticate": "Bearer"})
            given = credentials.credentials.encode()
            if any([hmac.compare_digest(given, t) for t in allowed]):  # a list: every one compared
                return
            if any([hmac.compare_digest(given, t) for t in readers]):
                raise HTTPException(403, "the read-only token cannot change anything")
            raise HTTPException(403, "the API token is not this daemon's")

        def write(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:  # noqa: B008
            check(credentials, writers, f"the API token{where}")

        def read(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:  # noqa: B008
            check(credentials, readers, f"the API token or the read-only one{read_where}")

        self.write = write
        self.read = read
