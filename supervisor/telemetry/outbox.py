"""The outbox: the events the reconciler recorded, published on MQTT in the order they
were recorded, at least once (an event is marked published only after the broker took
it; one not published stays for the next try, and the next start).

Events go to ``tsup/v1/<cluster>/events/run-<n>`` (``.../daemon`` for the daemon's own).
An ``attempt.ended`` event also publishes the attempt's fence (wire/sealing.py),
retained and sealed with the attempt's key: its node agents (node/agent.py) end
whatever of the attempt is left on their nodes, one back from a partition included.
"""

from __future__ import annotations

import asyncio
import json
import logging

from supervisor.domain import EventRecord, run_id_of
from supervisor.domain.events import EventKind
from supervisor.errors import StoreError
from supervisor.store import SqlStore
from supervisor.telemetry.link import MqttLink
from wire import attempt_key, encode_fence

log = logging.getLogger(__name__)

BATCH = 100  # events per read of the outbox
EVERY_S = 0.5  # between two reads while the daemon runs


class Outbox:
    def __init__(self, store: SqlStore, link: MqttLink, cluster_id: str, secret: bytes | None) -> None:
        self.store = store
        self.link = link
        self.cluster_id = cluster_id
        self.secret = secret  # the supervisor's: a fence is sealed with its attempt's key

    async def publish_forever(self) -> None:
        while True:
            await asyncio.sleep(EVERY_S)
            try:
                await self.publish_batch()
            except StoreError as e:
                log.warning("outbox: %s", e)

    async def publish_batch(self) -> tuple[int, bool]:
        """Publish up to a batch of recorded events: (how many, whether the outbox is empty)."""
        if not self.link.connected:
            return 0, False
        events = await asyncio.to_thread(self._unpublished)
        published: list[int] = []
        for e in events:
            topic = f"tsup/v1/{self.cluster_id}/events/{f'run-{e.run_number}' if e.run_number else 'daemon'}"
            body = {"id": e.id, "ts": e.ts, "kind": e.kind, "message": e.message, "data": e.data}
            if not await self.link.publish(topic, json.dumps(body).encode()):
                break
            fence = self.fence_of(e)
            if fence is not None and not await self.link.publish(*fence, retain=True):
                break
            published.append(e.id)
        if published:
            await asyncio.to_thread(self._mark_published, published)
        return len(published), len(published) == len(events) and len(events) < BATCH

    # The database off the event loop: a commit waits for the disk (synchronous=FULL) and
    # for the reconciler's transaction, and the loop meanwhile receives the telemetry.
    def _unpublished(self) -> list[EventRecord]:
        with self.store.tx() as tx:
            return tx.unpublished_events(limit=BATCH)

    def _mark_published(self, ids: list[int]) -> None:
        with self.store.tx() as tx:
            tx.mark_published(ids)

    def fence_of(self, e: EventRecord) -> tuple[str, bytes] | None:
        """For an attempt that ended: its fence (topic, payload), for its node agents to end
        whatever of it is left on their nodes; None for any other event."""
        attempt = e.data.get("attempt")
        if e.kind != EventKind.ATTEMPT_ENDED or self.secret is None or not e.run_number:
            return None
        if not isinstance(attempt, int):
            return None
        run_id = run_id_of(e.run_number)
        key = attempt_key(self.secret, self.cluster_id, run_id, attempt)
        return encode_fence(run_id, attempt, e.message, key=key, cluster=self.cluster_id)

    async def flush(self) -> int:
        """Publish until the outbox is empty (the caller bounds the time)."""
        total = 0
        while True:
            count, empty = await self.publish_batch()
            total += count
            if empty or count == 0:
                return total
