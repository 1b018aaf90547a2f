"""A small synchronous client of the REST API (httpx), used by `supervisorctl`."""

from __future__ import annotations

import json
import ssl
import time
from collections.abc import Iterator
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8470"
_RECONNECT_S = 1.0


class ApiError(Exception):
    """The daemon answered with an error, or could not be reached (status 0)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class Client:
    """``token``: sent as a bearer token when given (writes need it; reads from this
    host do not). ``verify``: a CA bundle's path for an HTTPS daemon whose certificate
    the system does not trust. ``token_hint`` says where a token was looked for, for the
    message when the daemon asks for one."""

    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None, verify: str | bool = True,
                 token_hint: str = "", timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.token_hint = token_hint
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        trust = ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers, verify=trust)
        self._has_token = token is not None

    def close(self) -> None:
        self._http.close()

    def get(self, path: str, **kwargs: Any) -> Any:
        return self._call("GET", path, **kwargs)

    def post(self, path: str, **kwargs: Any) -> Any:
        return self._call("POST", path, **kwargs)

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise self._unreachable(e) from e
        self._raise_for(resp)
        try:
            return resp.json()
        except ValueError as e:
            raise ApiError(0, f"{self.url} answered with something other than JSON: is it "
                              "training-supervisor's API?") from e

    def stream_events(self, run_id: str, after: int = 0) -> Iterator[dict[str, Any]]:
        """A run's events as the daemon records them (server-sent events), until the run
        has ended; a dropped connection is picked up again where it broke off."""
        while True:
            headers = {"Last-Event-ID": str(after)}
            try:
                with self._http.stream("GET", f"/v1/runs/{run_id}/events/stream", headers=headers,
                                       timeout=httpx.Timeout(30.0, read=None)) as resp:
                    if resp.status_code >= 400:
                        resp.read()
                        self._raise_for(resp)
                    for kind, data in _sse(resp.iter_lines()):
                        if kind == "end":
                            return
                        event: dict[str, Any] = json.loads(data)
                        after = event["id"]
                        yield event
            except (httpx.TransportError, httpx.StreamError) as e:
                if after == 0:
                    raise self._unreachable(e) from e
                time.sleep(_RECONNECT_S)  # the daemon restarting: carry on from the last event

    def _unreachable(self, e: Exception) -> ApiError:
        return ApiError(0, f"cannot reach training-supervisor at {self.url}: {e} "
                           "(is the daemon running? set --url or TSUP_URL)")

    def _raise_for(self, resp: httpx.Response) -> None:
        if resp.status_code < 400:
            return
        try:
            body = resp.json()
            detail = body.get("detail", resp.text) if isinstance(body, dict) else resp.text
        except ValueError:
            detail = resp.text
        if not isinstance(detail, str):  # FastAPI's request validation errors are lists
            detail = "; ".join(
                f"{'.'.join(str(x) for x in d.get('loc', []))}: {d.get('msg')}" for d in detail
            ) if isinstance(detail, list) else str(detail)
        if resp.status_code == 401 and not self._has_token:
            detail += f"; no token found (looked in {self.token_hint or 'nowhere'}): give --token-file " \
                      "or set TSUP_API_TOKEN_FILE"
        raise ApiError(resp.status_code, detail)


def _sse(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(event type, data) of each server-sent event; comments and ids skipped."""
    kind, data = "message", list[str]()
    for line in lines:
        if not line:
            if data:
                yield kind, "\n".join(data)
            kind, data = "message", []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            kind = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
