"""The SQLite store (SQLAlchemy 2.0 Core): the only package that writes SQL.

    store = SqlStore(path)        # no I/O yet
    store.open()                  # engine, WAL, migrations
    with store.tx() as tx:        # one transaction
        run = tx.get_run(42)

    engine.py     opening, pragmas, explicit transactions, migrations
    schema.py     the tables and their migrations
    tx.py         Tx: one transaction, every query below
    runs.py       runs, attempts, operators' commands
    nodes.py      nodes, probes, node intents
    history.py    checkpoints (persistent and in memory), faults, stragglers, data skips
    telemetry.py  step metrics, attempt stats, the loss curve, events and the outbox
    rows.py       row <-> record mapping
"""

from supervisor.store.engine import SqlStore
from supervisor.store.tx import Tx

__all__ = ["SqlStore", "Tx"]
