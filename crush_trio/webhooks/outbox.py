"""The webhook outbox file: pending and failed deliveries in their own SQLite database.

``<server data directory>/webhooks.db`` (docs/webhooks.md says where that is) holds one row per
delivery that is not done: ``pending`` ones (a restart resumes them) and ``failed`` ones (kept
for inspection, at most ``server.webhook_failed_kept``, the oldest removed first). A delivered
or dropped delivery's row is deleted. Secrets are never written: an attempt after a restart
finds its endpoint's secret in the configuration again.

Every call runs in a worker thread (:func:`trio.to_thread.run_sync`), one at a time through a
``CapacityLimiter(1)``, so the event loop never waits on the disk; the connection is opened with
``check_same_thread=False`` and used by one thread at a time.
"""

from __future__ import annotations

import enum
import sqlite3
from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs
import trio

from ..defaults import SQLITE_BUSY_TIMEOUT_MS
from ..errors import StoreError
from ..store.datadir import create_private_file, ensure_data_dir

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from pathlib import Path

T = TypeVar("T")

#: File name of the outbox inside the server's data directory.
OUTBOX_FILENAME: Final = "webhooks.db"

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS deliveries (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    id          TEXT    NOT NULL UNIQUE,
    url         TEXT    NOT NULL,
    scope       TEXT    NOT NULL,
    body        BLOB    NOT NULL,
    status      TEXT    NOT NULL,
    attempts    INTEGER NOT NULL DEFAULT 0,
    next_at     REAL    NOT NULL,
    created_at  REAL    NOT NULL,
    last_error  TEXT    NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS idx_deliveries_status ON deliveries (status, seq);
"""

_COLUMNS: Final = "id, url, scope, body, status, attempts, next_at, created_at, last_error"

_UPSERT: Final = f"""
INSERT INTO deliveries ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (id) DO UPDATE SET
    status = excluded.status,
    attempts = excluded.attempts,
    next_at = excluded.next_at,
    last_error = excluded.last_error
"""

_PRUNE_FAILED: Final = """
DELETE FROM deliveries WHERE status = 'failed' AND seq NOT IN (
    SELECT seq FROM deliveries WHERE status = 'failed' ORDER BY seq DESC LIMIT ?
)
"""


class Status(enum.StrEnum):
    """Where a delivery is. ``pending`` → ``failed`` is stored; ``delivered`` and ``dropped``
    deliveries leave the file."""

    PENDING = "pending"
    FAILED = "failed"


@attrs.define(eq=False)
class Delivery:
    """One POST of one event to one endpoint, until it is delivered, fails or is dropped.

    Attributes:
        id: the delivery id (body, header; the same on every attempt).
        url: the endpoint.
        scope: whose endpoint it is: ``""`` for the server's own, else the path of the workspace
            whose configuration lists it (the secret is looked up there).
        body: the JSON body, fixed when the delivery is made.
        attempts: POSTs made so far.
        next_at: Unix time of the next attempt.
        created_at: Unix time the delivery was made.
        last_error: why the last attempt did not deliver.
        secret: the endpoint's secret, in memory only (after a restart it is looked up again).
    """

    id: str
    url: str
    scope: str
    body: bytes
    created_at: float
    status: Status = Status.PENDING
    attempts: int = 0
    next_at: float = 0.0
    last_error: str = ""
    secret: bytes | None = attrs.field(default=None, repr=False)

    def row(self) -> tuple[object, ...]:
        return (
            self.id,
            self.url,
            self.scope,
            self.body,
            self.status.value,
            self.attempts,
            self.next_at,
            self.created_at,
            self.last_error,
        )


def _from_row(row: tuple[Any, ...]) -> Delivery:
    (id_, url, scope, body, status, attempts, next_at, created_at, last_error) = row
    return Delivery(
        id=str(id_),
        url=str(url),
        scope=str(scope),
        body=bytes(body),
        status=Status(str(status)),
        attempts=int(attempts),
        next_at=float(next_at),
        created_at=float(created_at),
        last_error=str(last_error),
    )


def _connect(path: Path) -> sqlite3.Connection:
    try:
        ensure_data_dir(path.parent)  # 0700, with a .gitignore of "*"
        create_private_file(path)  # 0600: it holds run texts and endpoint URLs
        conn = sqlite3.connect(
            path,
            timeout=SQLITE_BUSY_TIMEOUT_MS / 1000,
            isolation_level=None,  # BEGIN/COMMIT are ours
            check_same_thread=False,  # used from worker threads, one at a time
        )
    except (sqlite3.Error, OSError) as exc:
        raise StoreError(
            f"cannot open the webhook outbox {path}: {exc}; check the data directory"
        ) from exc
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.executescript(_SCHEMA)
    except sqlite3.Error as exc:
        conn.close()
        raise StoreError(
            f"cannot use the webhook outbox {path}: {exc}; move the file away to start afresh"
        ) from exc
    return conn


class OutboxFile:
    """The outbox database. Create it with :meth:`open`; close it with :meth:`aclose`.

    Cancellation: a call cancelled while waiting for its turn does nothing; once its thread has
    started it runs to the end (a write commits or rolls back whole) and the cancellation is
    delivered afterwards.
    """

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self._conn: sqlite3.Connection | None = conn
        self.path = path
        self._limiter = trio.CapacityLimiter(1)

    @classmethod
    async def open(cls, path: Path) -> OutboxFile:
        """Open (creating it and its directory when missing) the outbox at ``path``.

        Raises:
            StoreError: it cannot be created or read.
        """
        conn = await trio.to_thread.run_sync(_connect, path)
        return cls(conn, path)

    async def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        conn = self._conn
        if conn is None:
            raise StoreError(f"the webhook outbox {self.path} is closed")

        def work() -> T:
            try:
                return fn(conn)
            except sqlite3.Error as exc:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise StoreError(f"webhook outbox {self.path}: {exc}") from exc

        return await trio.to_thread.run_sync(work, limiter=self._limiter)

    async def pending(self) -> list[Delivery]:
        """The pending deliveries, oldest first."""

        def read(conn: sqlite3.Connection) -> list[Delivery]:
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM deliveries WHERE status = 'pending' ORDER BY seq"
            ).fetchall()
            return [_from_row(r) for r in rows]

        return await self._call(read)

    async def failed(self) -> list[Delivery]:
        """The failed deliveries kept for inspection, oldest first."""

        def read(conn: sqlite3.Connection) -> list[Delivery]:
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM deliveries WHERE status = 'failed' ORDER BY seq"
            ).fetchall()
            return [_from_row(r) for r in rows]

        return await self._call(read)

    async def write(
        self,
        saves: Iterable[tuple[object, ...]],
        deletes: Iterable[str],
        *,
        failed_kept: int,
    ) -> None:
        """In one transaction: insert or update the rows ``saves`` (from :meth:`Delivery.row`,
        encoded by the caller), delete the deliveries ``deletes``, and keep at most
        ``failed_kept`` failed ones."""
        save_rows = list(saves)
        delete_ids = [(d,) for d in deletes]

        def apply(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(_UPSERT, save_rows)
            conn.executemany("DELETE FROM deliveries WHERE id = ?", delete_ids)
            conn.execute(_PRUNE_FAILED, (failed_kept,))
            conn.execute("COMMIT")

        await self._call(apply)

    async def aclose(self) -> None:
        """Close the database (waits for a call in progress)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await trio.to_thread.run_sync(conn.close, limiter=self._limiter)
