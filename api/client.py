"""A small synchronous client of the REST API (httpx), used by `supervisorctl`."""

from __future__ import annotations

from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8470"


class ApiError(Exception):
    """The daemon answered with an error, or could not be reached (status 0)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class Client:
    def __init__(self, url: str = DEFAULT_URL, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            resp = self._http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise ApiError(0, f"cannot reach training-supervisor at {self.url}: {e} "
                              "(is the daemon running? set --url or TSUP_URL)") from e
        if resp.status_code >= 400:
            try:
                body = resp.json()
                detail = body.get("detail", resp.text) if isinstance(body, dict) else resp.text
            except ValueError:
                detail = resp.text
            if not isinstance(detail, str):  # FastAPI's request validation errors are lists
                detail = "; ".join(
                    f"{'.'.join(str(x) for x in d.get('loc', []))}: {d.get('msg')}" for d in detail
                ) if isinstance(detail, list) else str(detail)
            raise ApiError(resp.status_code, detail)
        try:
            return resp.json()
        except ValueError as e:
            raise ApiError(0, f"{self.url} answered with something other than JSON: is it "
                              "training-supervisor's API?") from e

    def runs(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/v1/runs")
        return result

    def run(self, run_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/v1/runs/{run_id}")
        return result

    def events(self, run_id: str, after: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call(
            "GET", f"/v1/runs/{run_id}/events", params={"after": after, "limit": limit}
        )
        return result

    def command(self, run_id: str, kind: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/v1/runs/{run_id}/{kind}")
        return result

    def command_result(self, command_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/v1/commands/{command_id}")
        return result

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", "/v1/runs", json={"spec": spec})
        return result

    def nodes(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/v1/nodes")
        return result

    def probe(self, node: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/v1/nodes/{node}/probe")
        return result
