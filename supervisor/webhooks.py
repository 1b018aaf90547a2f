"""Webhooks: the event log's notices (a run FAILED, a node drained) POSTed to people's
endpoints, a Slack-compatible form or plain JSON, from the daemon's ``[[notify]]`` tables.

    [[notify]]
    name = "oncall"                                        # in logs and in the cursor table
    url_file = "/etc/training-supervisor/oncall-webhook"   # the URL, a secret (or url = "...")
    format = "slack"                                       # {"text": ...}; "json": the event
    kinds = ["run.failed", "node.drained"]                 # absent: DEFAULT_KINDS; "node.*" globs
    runs = ["run-42"]                                      # absent: every run, and the daemon's own

A notice's kind is its event's kind, except a run's change of state, which is
``run.<new state>`` (``run.failed``, ``run.succeeded``, ``run.paused``).

Delivery, one asyncio task a webhook on the daemon's event loop, never on the
reconciler's thread: the tick records events and goes on, whatever a receiver does. The
queue is the event log itself (SQLite), read ``BATCH`` events at a time after the
webhook's cursor (``notify_cursors``), which moves past each event once it was delivered
(any 2xx) or passed over (not a notice it wants). So nothing is lost to a receiver that
is down, or to a daemon restart: a receiver that does not answer, answers 5xx, 408 or
429 is retried with backoff (tenacity, up to ``MAX_WAIT_S`` apart), in order, for as long
as it takes. Nothing is sent twice, but for a daemon killed between a receiver's answer
and the cursor's write; every notice carries its event's id (``Idempotency-Key``) for such
a receiver to drop the repeat. A receiver that refuses a notice (another 4xx) will refuse
it again: it is passed over and the log says so. A new webhook starts at the newest event
(the log's history is not replayed). The URL is never logged (it is the secret that lets
anyone post into the channel): the webhook's name stands for it.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from supervisor.domain import EventRecord, RunState, run_id_of
from supervisor.domain.events import EventKind
from supervisor.errors import StoreError, SupervisorError
from supervisor.store import SqlStore

log = logging.getLogger(__name__)

BATCH = 50  # events read after a cursor at a time
EVERY_S = 0.5  # between two reads of the log while nothing is pending
TIMEOUT_S = 5.0  # a receiver's answer
MAX_WAIT_S = 30.0  # the longest pause between two tries of one notice
DEFAULT_KINDS = ("run.failed", "node.drained", "drain.held", "attempt.abandoned")
NOTICES = frozenset({*(k.value for k in EventKind if k is not EventKind.RUN_STATE),
                     *(f"run.{s.value.lower()}" for s in RunState)})


class Webhook(BaseModel):
    """One ``[[notify]]`` table of the daemon's config."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")]
    url: str | None = Field(default=None, repr=False)
    url_file: Path | None = None
    format: Literal["json", "slack"] = "json"
    kinds: tuple[Annotated[str, Field(min_length=1, max_length=64)], ...] = DEFAULT_KINDS
    runs: tuple[Annotated[str, Field(pattern=r"^run-[0-9]{1,12}$")], ...] = ()

    @model_validator(mode="after")
    def _check(self) -> Webhook:
        if (self.url is None) == (self.url_file is None):
            raise ValueError(f"notify {self.name}: give url or url_file (a file only the daemon reads), "
                             "one of them")
        if self.url is not None:
            check_url(self.url)
        unknown = [k for k in self.kinds if not any(fnmatch.fnmatchcase(n, k) for n in NOTICES)]
        if unknown:
            raise ValueError(f"notify {self.name}: kinds {', '.join(map(repr, unknown))} match no notice "
                             "(a run's new state as run.failed, run.succeeded ...; or an event kind, as "
                             "node.drained)")
        return self

    def target(self) -> str:
        """The URL (read from ``url_file`` now); SupervisorError naming the file, never the URL."""
        if self.url is not None:
            return self.url
        assert self.url_file is not None
        try:
            text = self.url_file.read_text().strip()
        except OSError as e:
            raise SupervisorError(f"notify {self.name}: cannot read url_file {self.url_file}: "
                                  f"{e.strerror}") from e
        try:
            return check_url(text)
        except ValueError as e:
            raise SupervisorError(f"notify {self.name}: {self.url_file}: {e}") from None

    def wants(self, e: EventRecord) -> bool:
        if self.runs and (e.run_number is None or run_id_of(e.run_number) not in self.runs):
            return False
        notice = notice_of(e)
        return any(fnmatch.fnmatchcase(notice, k) for k in self.kinds)


def check_url(url: str) -> str:
    """An http(s) URL; ValueError that does not repeat it (it is a secret)."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        raise ValueError("the webhook URL is not a URL") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError("the webhook URL must be http:// or https:// with a host")
    return url


def notice_of(e: EventRecord) -> str:
    """The notice an event is: its kind, or ``run.<new state>`` for a run's change of state."""
    if e.kind == EventKind.RUN_STATE and isinstance(e.data.get("to"), str):
        return f"run.{str(e.data['to']).lower()}"
    return e.kind


def body_of(hook: Webhook, e: EventRecord, cluster: str) -> dict[str, Any]:
    notice, run = notice_of(e), run_id_of(e.run_number) if e.run_number else None
    if hook.format == "slack":
        return {"text": f"[{cluster}] {run or 'daemon'}: {notice}: {e.message}"}
    return {"cluster": cluster, "id": e.id, "ts": e.ts, "notice": notice, "kind": e.kind, "run_id": run,
            "message": e.message, "data": e.data}


class _TryAgain(Exception):
    """A receiver that may take the notice later (no answer, 5xx, 408, 429)."""


class Webhooks:
    """Every ``[[notify]]`` webhook, each delivered by its own task (``deliver_forever``)."""

    def __init__(self, store: SqlStore, hooks: list[Webhook], cluster: str,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.store = store
        self.cluster = cluster
        self.hooks = hooks
        self.targets: dict[str, tuple[Webhook, str]] = {}  # read by start
        self._transport = transport
        self.delivered: dict[str, int] = {h.name: 0 for h in hooks}

    def start(self) -> None:
        """Read the URLs (a bad url_file fails the daemon's start, naming it). A webhook seen
        for the first time starts at the newest event (no history replayed)."""
        self.targets = {h.name: (h, h.target()) for h in self.hooks}
        if self.targets:  # httpx logs each request's URL at INFO: a webhook's is a secret
            logging.getLogger("httpx").setLevel(logging.WARNING)
        with self.store.tx() as tx:
            newest = tx.newest_event_id()
            for name in self.targets:
                if tx.notify_cursor(name) is None:
                    tx.set_notify_cursor(name, newest)

    async def deliver_forever(self) -> None:
        if not self.targets:
            await asyncio.Event().wait()  # nothing to do, ever
        client = httpx.AsyncClient(timeout=TIMEOUT_S, follow_redirects=False, transport=self._transport)
        async with client as http:
            await asyncio.gather(*(self._one(http, name) for name in self.targets))

    async def _one(self, http: httpx.AsyncClient, name: str) -> None:
        hook, url = self.targets[name]
        while True:
            try:
                moved = await self.deliver_batch(http, hook, url)
            except StoreError as e:
                log.warning("notify %s: %s", name, e)
                moved = False
            if not moved:
                await asyncio.sleep(EVERY_S)

    async def deliver_batch(self, http: httpx.AsyncClient, hook: Webhook, url: str) -> bool:
        """Deliver (or pass over) the events after the cursor, a batch: whether any were."""
        def read() -> list[EventRecord]:
            with self.store.tx() as tx:
                return tx.list_events(after_id=tx.notify_cursor(hook.name) or 0, limit=BATCH)

        events = await asyncio.to_thread(read)
        for e in events:
            if hook.wants(e):
                await self._send(http, hook, url, e)
            await asyncio.to_thread(self._advance, hook.name, e.id)
        return bool(events)

    def _advance(self, name: str, event_id: int) -> None:
        with self.store.tx() as tx:
            tx.set_notify_cursor(name, event_id)

    async def _send(self, http: httpx.AsyncClient, hook: Webhook, url: str, e: EventRecord) -> None:
        failing = False

        def said_once(state: Any) -> None:
            nonlocal failing
            if not failing:
                log.warning("notify %s: event %d not delivered (%s); trying again until it is", hook.name,
                            e.id, state.outcome.exception())
                failing = True

        headers = {"Idempotency-Key": f"{self.cluster}-{e.id}"}
        async for attempt in AsyncRetrying(retry=retry_if_exception_type(_TryAgain), reraise=True,
                                           wait=wait_exponential(multiplier=0.5, max=MAX_WAIT_S),
                                           before_sleep=said_once):
            with attempt:
                status = await self._post(http, url, body_of(hook, e, self.cluster), headers)
        if 200 <= status < 300:
            self.delivered[hook.name] += 1
            if failing:
                log.info("notify %s: delivered again from event %d", hook.name, e.id)
        else:
            log.warning("notify %s: event %d refused (HTTP %d): passed over", hook.name, e.id, status)

    @staticmethod
    async def _post(http: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]) -> int:
        try:
            answer = await http.post(url, json=body, headers=headers)
        except httpx.HTTPError as e:
            raise _TryAgain(type(e).__name__ + _without(str(e), url)) from None
        if answer.status_code >= 500 or answer.status_code in (408, 429):
            raise _TryAgain(f"HTTP {answer.status_code}")
        return answer.status_code


def _without(text: str, url: str) -> str:
    """An error's text with the URL (a secret) taken out."""
    text = text.replace(url, "<url>")
    return f": {text}" if text else ""

