"""Who may do what through the API: a bearer token on every request but ``/healthz``
and the status page's own HTML, and who it is (``Caller``, supervisor/people.py).

The daemon keeps its two tokens in files (supervisor/token_file.py), created with mode
0600 on its first start: whoever can read the API token may operate the supervisor;
whoever has the read-only token may watch it (the status page, /metrics, every GET).
People hold tokens of their own, each bound to a Unix account (``training-supervisor
token issue``): a person reads and acts on their own runs, an operator's on all. No
client is trusted for where it connects from: an SSH tunnel or a proxy makes every
client look local. ``supervisorctl`` finds a token through its config, the environment
or the person's own file (cli/ctl_settings.py); the status page asks for the read-only
token once and keeps it for the browser tab (api/status.html). The daemon's tokens are
compared in constant time; a person's is found by its SHA-256.

    no token where one is needed      401 {"error": "Unauthorized", ...}, WWW-Authenticate: Bearer
    a token that is nobody's          403 {"error": "Forbidden", ...}
    a token that may not do this      403 (the read-only token's write; another's run)
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from pathlib import Path

from fastapi import Depends, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from supervisor.domain import Person
from supervisor.people import ADMIN, READER, Caller


class TokenAuth:
    """The API's two FastAPI dependencies, each the request's ``Caller``: ``write`` for
    every request that changes something (the API token or a person's), ``read`` for the
    rest (any token). Both name the bearer scheme, so that the OpenAPI schema says which
    operations need a token. ``people``: whose a token is (None: nobody's)."""

    def __init__(self, token: str, token_file: Path | None = None, *, read_token: str | None = None,
                 read_token_file: Path | None = None,
                 people: Callable[[str], Person | None] = lambda _token: None) -> None:
        admin, reader = token.encode(), read_token.encode() if read_token else None
        where = f" (it is in {token_file} on the daemon's host)" if token_file else ""
        read_where = f" (in {read_token_file} on the daemon's host)" if read_token_file else ""
        # auto_error=False: a missing header is our 401 with our body, not FastAPI's 403.
        bearer = HTTPBearer(auto_error=False,
                            description="the API token, a person's, or (reads) the read-only one")

        def caller(credentials: HTTPAuthorizationCredentials | None, what: str) -> Caller:
            if credentials is None:
                raise HTTPException(
                    401, f"this request needs {what}: send 'Authorization: Bearer <token>'",
                    headers={"WWW-Authenticate": "Bearer"})
            given = credentials.credentials.encode()
            is_admin = hmac.compare_digest(given, admin)  # both compared, whichever it is
            is_reader = reader is not None and hmac.compare_digest(given, reader)
            if is_admin:
                return ADMIN
            if is_reader:
                return READER
            person = people(credentials.credentials)
            if person is None:
                raise HTTPException(403, "the API token is not this daemon's, nor a person's it issued")
            return Caller(user=person.user, operator=person.operator, writes=True)

        def write(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Caller:  # noqa: B008
            who = caller(credentials, f"the API token{where} or your own")
            if not who.writes:
                raise HTTPException(403, "the read-only token cannot change anything")
            return who

        def read(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> Caller:  # noqa: B008
            return caller(credentials, f"a token: the API token, your own, or the read-only one{read_where}")

        self.write = write
        self.read = read
