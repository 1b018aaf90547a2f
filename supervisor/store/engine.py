"""The SQLite database: opening it, its pragmas, its transactions, its migrations.

SQLite runs in WAL mode so that API readers never block the reconciler, with
``synchronous=FULL`` so that a committed event survives a power cut, and a busy
timeout so that the API's small writes (queued commands) wait instead of failing.

Migrations run on a connection of their own that begins with an explicit BEGIN
(SQLAlchemy's documented recipe for pysqlite, which otherwise commits DDL before the
first DML): a migration that fails midway rolls back whole, and the next start finds
the database as it was. Every other transaction keeps pysqlite's way (BEGIN before the
first write): with a reader's snapshot held from its start, a transaction that read and
then wrote while another thread committed would fail at once ("database is locked",
SQLITE_BUSY_SNAPSHOT) instead of waiting its turn.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection, Engine, create_engine, event, insert, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import ConnectionPoolEntry, NullPool

from supervisor.errors import StoreError
from supervisor.store import migrations
from supervisor.store import schema as t
from supervisor.store.tx import Tx


class SqlStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._engine: Engine | None = None

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        url = f"sqlite:///{self.path}"
        migrating = create_engine(url, poolclass=NullPool)
        event.listen(migrating, "connect", _on_connect_explicit)
        event.listen(migrating, "begin", _on_begin)
        try:
            with migrating.begin() as conn:
                migrate(conn)
        except SQLAlchemyError as e:
            raise StoreError(f"{self.path}: cannot open the database: {e}") from e
        finally:
            migrating.dispose()
        engine = create_engine(url, connect_args={"check_same_thread": False})
        event.listen(engine, "connect", _on_connect)
        self._engine = engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None

    @contextmanager
    def tx(self) -> Iterator[Tx]:
        """One transaction: committed when the block ends, rolled back when it raises. A
        database error (locked, full, gone) is raised as the store's own ``StoreError``,
        so that no caller outside store/ needs to know SQLAlchemy."""
        if self._engine is None:
            raise StoreError("store is not open")
        try:
            with self._engine.begin() as conn:
                yield Tx(conn)
        except SQLAlchemyError as e:
            raise StoreError(f"{self.path}: {e}") from e


def _on_connect_explicit(dbapi_conn: sqlite3.Connection, record: ConnectionPoolEntry) -> None:
    # pysqlite must not issue BEGIN itself (it would commit DDL on its own): _on_begin does.
    dbapi_conn.isolation_level = None
    _on_connect(dbapi_conn, record)


def _on_connect(dbapi_conn: sqlite3.Connection, _record: ConnectionPoolEntry) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


def _on_begin(conn: Connection) -> None:
    conn.exec_driver_sql("BEGIN")


def migrate(conn: Connection) -> None:
    """Bring the schema to ``SCHEMA_VERSION``, inside the caller's transaction."""
    t.schema_version.create(conn, checkfirst=True)
    current = conn.execute(select(t.schema_version.c.version)).scalar()
    if current is None:
        current = 0
        conn.execute(insert(t.schema_version).values(version=0))
    if current > migrations.SCHEMA_VERSION:
        raise StoreError(
            f"database schema v{current} is newer than this supervisor understands "
            f"(v{migrations.SCHEMA_VERSION}); upgrade training-supervisor"
        )
    for version in range(current, migrations.SCHEMA_VERSION):
        migrations.MIGRATIONS[version](conn)
        conn.execute(update(t.schema_version).values(version=version + 1))
