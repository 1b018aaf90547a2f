"""Who may do what through the API: a bearer token for every write, and for reads from
anywhere but this host.

The daemon keeps one token in a file (supervisor/token_file.py), created with mode 0600
on its first start; whoever can read that file may operate the supervisor.
``supervisorctl`` finds it through its config or the environment (api/ctl.py). Tokens
are compared in constant time.

    no token where one is needed   401 {"error": "Unauthorized", ...}, WWW-Authenticate: Bearer
    a token that is not the one    403 {"error": "Forbidden", ...}
"""

from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer


def is_loopback(host: str | None) -> bool:
    if host is None:
        return False
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


class TokenAuth:
    """The API's two FastAPI dependencies: ``write`` for every request that changes
    something, ``read`` for the rest (open to clients on this host). Both name the
    bearer scheme, so that the OpenAPI schema says which operations need the token."""

    def __init__(self, token: str, token_file: Path | None = None) -> None:
        expected = token.encode()
        where = f" (it is in {token_file} on the daemon's host)" if token_file else ""
        # auto_error=False: a missing header is our 401 with our body, not FastAPI's 403.
        bearer = HTTPBearer(auto_error=False, description="the daemon's API token")

        def check(credentials: HTTPAuthorizationCredentials | None) -> None:
            if credentials is None:
                raise HTTPException(
                    401, f"this request needs the API token: send 'Authorization: Bearer <token>'{where}",
                    headers={"WWW-Authenticate": "Bearer"})
            if not hmac.compare_digest(credentials.credentials.encode(), expected):
                raise HTTPException(403, "the API token is not this daemon's")

        def write(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:  # noqa: B008
            check(credentials)

        def read(request: Request,
                 credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:  # noqa: B008
            if not is_loopback(request.client.host if request.client else None):
                check(credentials)

        self.write = write
        self.read = read
