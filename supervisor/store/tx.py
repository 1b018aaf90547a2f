"""One transaction: every query and write of the store, grouped by what they are about."""

from __future__ import annotations

from sqlalchemy import Connection

from supervisor.store.history import HistoryQueries
from supervisor.store.nodes import NodeQueries
from supervisor.store.people import PeopleQueries
from supervisor.store.runs import RunQueries
from supervisor.store.telemetry import TelemetryQueries


class Tx(RunQueries, NodeQueries, HistoryQueries, TelemetryQueries, PeopleQueries):
    """Every query and write, inside one transaction (``SqlStore.tx()``)."""

    def __init__(self, conn: Connection) -> None:
        self.c = conn
