"""The embedded database of one workspace: sessions, messages and run records in SQLite.

One :class:`Store` owns one ``sqlite3`` connection to ``<data_dir>/crush.db`` (WAL mode, foreign
keys on, a busy timeout), plus a second one that only writes run records (so that the commit a
prompt's 202 waits for never queues behind other calls). The event loop never blocks on the
database: every public method is one call into a worker thread through
:func:`trio.to_thread.run_sync`, serialized per connection by a ``CapacityLimiter(1)`` so each
connection (opened with ``check_same_thread=False``) is only ever used by one thread at a time.

Rows are encoded on the calling (event loop) side before the thread starts, so an object the caller
keeps mutating (a streaming message) is captured at the moment of the call; rows are decoded into
fresh objects inside the thread.

The schema is versioned with ``PRAGMA user_version``: :data:`MIGRATIONS` is an ordered tuple of SQL
scripts, and opening a store applies each one the database has not seen yet, each in its own
transaction together with the version bump. A new migration is one more string appended to the
tuple.

Errors from sqlite become :class:`~crush_trio.errors.StoreError` (with the sqlite error as the
cause), and every call on a closed store raises ``StoreError("store is closed ...")``.
"""

from __future__ import annotations

import hashlib
import sqlite3
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import trio

from ..defaults import SQLITE_BUSY_TIMEOUT_MS
from ..errors import StoreError
from ..metrics import METRICS
from ..wire import (
    Message,
    Role,
    Run,
    RunStatus,
    Session,
    Todo,
    now,
    todos_to_json,
)
from .datadir import create_private_file, ensure_data_dir
from .paging import Dialect, PageQuery, run_page
from .rows import (
    MESSAGE_COLUMNS,
    RUN_COLUMNS,
    SESSION_COLUMNS,
    message_from_row,
    message_row,
    run_from_row,
    run_row,
    session_from_row,
    session_row,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

T = TypeVar("T")

#: File name of the database inside a workspace's data directory.
DB_FILENAME: Final = "crush.db"

_MIGRATION_1: Final = """
CREATE TABLE sessions (
    id                TEXT PRIMARY KEY,
    parent_session_id TEXT,
    title             TEXT    NOT NULL DEFAULT '',
    message_count     INTEGER NOT NULL DEFAULT 0 CHECK (message_count >= 0),
    prompt_tokens     INTEGER NOT NULL DEFAULT 0 CHECK (prompt_tokens >= 0),
    completion_tokens INTEGER NOT NULL DEFAULT 0 CHECK (completion_tokens >= 0),
    cost              REAL    NOT NULL DEFAULT 0.0 CHECK (cost >= 0.0),
    created_at        INTEGER NOT NULL,
    updated_at        INTEGER NOT NULL
);

CREATE TABLE messages (
    id          TEXT PRIMARY KEY,
    session_id  TEXT    NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    role        TEXT    NOT NULL,
    parts       TEXT    NOT NULL DEFAULT '[]',
    model       TEXT    NOT NULL DEFAULT '',
    provider    TEXT    NOT NULL DEFAULT '',
    created_at  INTEGER NOT NULL,
    updated_at  INTEGER NOT NULL,
    finished_at INTEGER
);

CREATE INDEX idx_messages_session_created ON messages (session_id, created_at);

CREATE TRIGGER messages_count_insert AFTER INSERT ON messages
BEGIN
    UPDATE sessions SET message_count = message_count + 1 WHERE id = NEW.session_id;
END;

CREATE TRIGGER messages_count_delete AFTER DELETE ON messages
BEGIN
    UPDATE sessions SET message_count = message_count - 1 WHERE id = OLD.session_id;
END;

-- No foreign key on session_id: a run record outlives a deleted session, so a client can still
-- ask how its run ended.
CREATE TABLE runs (
    run_id      TEXT PRIMARY KEY,
    session_id  TEXT    NOT NULL,
    status      TEXT    NOT NULL,
    message_id  TEXT,
    text        TEXT    NOT NULL DEFAULT '',
    error       TEXT,
    created_at  INTEGER NOT NULL,
    finished_at INTEGER
);

CREATE INDEX idx_runs_status ON runs (status);
"""

# Version 2: a run record keeps its prompt, written in the same transaction that makes the run
# exist (a 202 is sent only after that commit), and streaming messages can be found by index
# when a killed process left them unfinished.
_MIGRATION_2: Final = """
ALTER TABLE runs ADD COLUMN prompt TEXT NOT NULL DEFAULT '';
CREATE INDEX idx_messages_unfinished ON messages (role) WHERE finished_at IS NULL;
"""

#: The schema, as ordered migrations: entry ``i`` moves the database from version ``i`` to
#: ``i + 1``. Append new scripts; never edit one that has shipped.
# Version 3: summaries (a session names the summary later model requests start from).
_MIGRATION_3: Final = """
ALTER TABLE sessions ADD COLUMN summary_message_id TEXT;
ALTER TABLE messages ADD COLUMN is_summary_message INTEGER NOT NULL DEFAULT 0;
"""

# Version 4: a session's todo list (the ``todos`` tool), as JSON text.
_MIGRATION_4: Final = """
ALTER TABLE sessions ADD COLUMN todos TEXT NOT NULL DEFAULT '[]';
"""

MIGRATIONS: Final[tuple[str, ...]] = (_MIGRATION_1, _MIGRATION_2, _MIGRATION_3, _MIGRATION_4)

#: The schema version this code writes (``PRAGMA user_version`` after opening).
SCHEMA_VERSION: Final = len(MIGRATIONS)

# Insert a message, or update the streaming fields of an existing one. Rows whose session no longer
# exists are skipped rather than failing the batch: a late write after a session was deleted must
# neither resurrect the row nor break the other messages in the batch.
_UPSERT_MESSAGE: Final = f"""
INSERT INTO messages ({MESSAGE_COLUMNS})
SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ?
WHERE EXISTS (SELECT 1 FROM sessions WHERE id = ?)
ON CONFLICT (id) DO UPDATE SET
    parts = excluded.parts,
    updated_at = excluded.updated_at,
    finished_at = excluded.finished_at
"""

_SQLITE: Final = Dialect(mark="?", seq="rowid")


def _fetch(conn: sqlite3.Connection) -> Callable[[str, Any], list[Any]]:
    return lambda sql, params: conn.execute(sql, params).fetchall()


# ---------------------------------------------------------------------------------------------
# Connection setup (worker thread)


def _transaction(conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
    """Run ``fn`` in one write transaction; roll back if it raises (a commit is timed)."""
    started = time.perf_counter()
    conn.execute("BEGIN IMMEDIATE")
    try:
        result = fn(conn)
    except BaseException:
        if conn.in_transaction:  # sqlite may already have rolled back (e.g. disk full)
            conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    METRICS.store_write_latency.observe(time.perf_counter() - started)
    return result


def _migrate(conn: sqlite3.Connection, path: Path) -> None:
    version: int = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"database {path} has schema version {version}, newer than this server supports "
            f"({SCHEMA_VERSION}); upgrade crush-trio or use another data directory"
        )
    for target in range(version + 1, SCHEMA_VERSION + 1):
        script = MIGRATIONS[target - 1]
        try:
            # One transaction per migration, version bump included, so a crash leaves the
            # database at a whole version.
            conn.executescript(
                f"BEGIN IMMEDIATE;\n{script}\nPRAGMA user_version = {target:d};\nCOMMIT;"
            )
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


def _connect(path: Path) -> sqlite3.Connection:
    ensure_data_dir(path.parent)  # 0700, with a .gitignore of "*"
    create_private_file(path)  # 0600: it holds every prompt, reply and tool output
    conn = sqlite3.connect(
        path,
        timeout=SQLITE_BUSY_TIMEOUT_MS / 1000,
        isolation_level=None,  # we issue BEGIN/COMMIT ourselves
        check_same_thread=False,  # used from worker threads, one at a time (see Store)
    )
    try:
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreError(
                f"database {path} cannot use WAL journaling (got {mode!r}); put the data "
                "directory on a local file system"
            )
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS:d}")
        conn.execute("PRAGMA synchronous = NORMAL")  # safe with WAL; commits stay durable on crash
        _migrate(conn, path)
    except BaseException:
        conn.close()
        raise
    return conn


def _open_in_thread(path: Path) -> sqlite3.Connection:
    try:
        return _connect(path)
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open database {path}: {exc}; check the data directory") from exc
    except OSError as exc:
        raise StoreError(
            f"cannot create data directory {path.parent}: {exc}; check its permissions"
        ) from exc


# ---------------------------------------------------------------------------------------------
# The store


#: Size of the run-id filter of each store, in bits (128 KiB): with 100,000 runs about 1% of
#: new run ids still need a database lookup to be told apart from a used one.
RUN_FILTER_BITS: Final = 1 << 20
#: Bits set per run id in the filter.
RUN_FILTER_HASHES: Final = 7
#: Most rows of new sessions kept in memory (:meth:`Store.get_session`); past it the oldest
#: are read from the database again, so sessions created and never used pin no more memory.
FRESH_SESSIONS_KEPT: Final = 4096


class RunIdFilter:
    """A Bloom filter of the run ids in a store: "certainly never used" without a database call.

    ``run_id in f`` is False only for ids never added; True means "maybe" (ask the database).
    Memory is fixed (:data:`RUN_FILTER_BITS`); more runs only make "maybe" more frequent.
    """

    def __init__(self, bits: int = RUN_FILTER_BITS, hashes: int = RUN_FILTER_HASHES) -> None:
        if bits <= 0 or bits & (bits - 1):
            raise ValueError(f"bits must be a power of two, got {bits}")
        self._bits = bytearray(bits // 8 or 1)
        self._mask = bits - 1
        self._width = self._mask.bit_length()  # bits of the hash per position
        self._hashes = hashes
        self._digest_size = -(-hashes * self._width // 8)  # ceil
        if self._digest_size > 64:
            raise ValueError(f"{hashes} hashes of {self._width} bits exceed one blake2b digest")

    def _positions(self, run_id: str) -> list[int]:
        digest = hashlib.blake2b(run_id.encode(), digest_size=self._digest_size).digest()
        value = int.from_bytes(digest)
        return [(value >> (i * self._width)) & self._mask for i in range(self._hashes)]

    def add(self, run_id: str) -> None:
        for pos in self._positions(run_id):
            self._bits[pos >> 3] |= 1 << (pos & 7)

    def __contains__(self, run_id: object) -> bool:
        if not isinstance(run_id, str):
            return False
        return all(self._bits[pos >> 3] & (1 << (pos & 7)) for pos in self._positions(run_id))


class Store:
    """One workspace's database. Create it with :meth:`open`; close it with :meth:`aclose`.

    Every method is one worker-thread call; calls are serialized (first come, first served) by a
    ``CapacityLimiter(1)``. Writes are single transactions.

    Cancellation:
        A call cancelled while it waits for its turn does nothing and raises ``Cancelled``. Once
        its thread has started the call is not cancellable: it runs to the end (a write commits or
        rolls back as a whole) and returns, and the cancellation is delivered at the caller's next
        checkpoint. So a write is never torn by a cancel.

    Backpressure:
        Callers queue on the limiter; there is no other buffer.
    """

    def __init__(
        self, conn: sqlite3.Connection, path: Path, runs_conn: sqlite3.Connection | None = None
    ) -> None:
        """Wrap an open connection; use :meth:`open` instead."""
        self._conn: sqlite3.Connection | None = conn
        self._path = path
        self._limiter = trio.CapacityLimiter(1)
        #: Run records are written through a second connection with its own worker thread, so
        #: the commit a prompt's answer waits for never queues behind the other calls (message
        #: writes, reads): it only waits for SQLite's write lock, held for one transaction.
        self._runs_conn = runs_conn
        self._runs_limiter = trio.CapacityLimiter(1)
        #: Ids of the sessions that exist, kept in memory so the hot existence checks of the
        #: agent need no thread hop (every session write goes through this object).
        self._session_ids: set[str] = set()
        #: Every run id in the database, so a new run id is checked without a thread hop.
        self._run_ids = RunIdFilter()
        #: Sessions created by this object that no message write has touched yet: listing their
        #: messages needs no thread hop (the first prompt of a new session is the common case).
        self._empty_sessions: set[str] = set()
        #: The rows of the sessions created by this object that nothing has written since (the
        #: busy state and the title check of a new session's first run read it, no thread hop).
        self._fresh_sessions: dict[str, tuple[Any, ...]] = {}

    @classmethod
    async def open(cls, data_dir: Path) -> Store:
        """Open (creating if needed) ``<data_dir>/crush.db`` and bring its schema up to date.

        Raises:
            StoreError: the directory or database cannot be created or opened, or its schema is
                newer than this code.
        """
        path = Path(data_dir) / DB_FILENAME
        conn = await trio.to_thread.run_sync(_open_in_thread, path)
        try:
            runs_conn = await trio.to_thread.run_sync(_open_in_thread, path)
        except BaseException:
            conn.close()
            raise
        store = cls(conn, path, runs_conn)
        store._session_ids = await store._call(
            "listing session ids",
            lambda c: {row[0] for row in c.execute("SELECT id FROM sessions")},
        )

        def load_run_ids(conn: sqlite3.Connection) -> None:
            for (run_id,) in conn.execute("SELECT run_id FROM runs"):
                store._run_ids.add(run_id)

        await store._call("listing run ids", load_run_ids)
        return store

    def may_have_run(self, run_id: str) -> bool:
        """False when no run with this id was ever stored (answered from memory); True means
        "maybe": ask :meth:`get_run`."""
        return run_id in self._run_ids

    def session_exists(self, session_id: str) -> bool:
        """Whether the session exists (answered from memory, no database call)."""
        return session_id in self._session_ids

    @property
    def path(self) -> Path:
        """The database file."""
        return self._path

    @property
    def closed(self) -> bool:
        return self._conn is None

    async def aclose(self) -> None:
        """Close the connection after any call in progress; later calls raise StoreError.

        Idempotent.

        Cancellation:
            New calls are refused at once; the close itself waits for its turn, so call this
            inside ``trio.move_on_after(T, shield=True)`` during shutdown. If the wait is cancelled
            the connection is left to the garbage collector.
        """
        if self._conn is None:
            return
        conn, runs_conn = self._conn, self._runs_conn
        self._conn = self._runs_conn = None

        def closer(c: sqlite3.Connection) -> Callable[[], None]:
            def close() -> None:
                try:
                    c.close()
                except sqlite3.Error as exc:
                    raise StoreError(f"closing database {self._path} failed: {exc}") from exc

            return close

        if runs_conn is not None:
            await trio.to_thread.run_sync(closer(runs_conn), limiter=self._runs_limiter)
        await trio.to_thread.run_sync(closer(conn), limiter=self._limiter)

    def _closed_error(self) -> StoreError:
        return StoreError(
            f"store is closed ({self._path}); its workspace has shut down, open the workspace "
            "again to use it"
        )

    async def _call(
        self, what: str, fn: Callable[[sqlite3.Connection], T], *, runs: bool = False
    ) -> T:
        """Run ``fn(conn)`` in the worker thread, translating sqlite errors (``runs``: on the
        run-record connection, when there is one)."""
        if self._conn is None:
            raise self._closed_error()
        use_runs = runs and self._runs_conn is not None

        def in_thread() -> T:
            conn = self._runs_conn if use_runs else self._conn
            if conn is None:  # closed while this call waited for its turn
                raise self._closed_error()
            try:
                return fn(conn)
            except sqlite3.Error as exc:
                raise StoreError(f"database {self._path}: {what} failed: {exc}") from exc

        limiter = self._runs_limiter if use_runs else self._limiter
        return await trio.to_thread.run_sync(in_thread, limiter=limiter)

    # -- sessions ------------------------------------------------------------------------------

    async def create_session(self, session: Session) -> None:
        """Insert a session. Raises StoreError if the id exists."""
        row = session_row(session)

        def op(conn: sqlite3.Connection) -> None:
            _transaction(
                conn,
                lambda c: c.execute(
                    f"INSERT INTO sessions ({SESSION_COLUMNS}) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    row,
                ),
            )

        await self._call(f"creating session {session.id!r}", op)
        self._session_ids.add(session.id)
        self._empty_sessions.add(session.id)
        self._fresh_sessions[session.id] = row
        if len(self._fresh_sessions) > FRESH_SESSIONS_KEPT:
            del self._fresh_sessions[next(iter(self._fresh_sessions))]

    async def get_session(self, session_id: str) -> Session | None:
        row = self._fresh_sessions.get(session_id)
        if row is not None:
            if self._conn is None:
                raise self._closed_error()
            await trio.lowlevel.checkpoint_if_cancelled()
            return session_from_row(row)

        def op(conn: sqlite3.Connection) -> Session | None:
            row = conn.execute(
                f"SELECT {SESSION_COLUMNS} FROM sessions WHERE id = ?", (session_id,)
            ).fetchone()
            return None if row is None else session_from_row(row)

        return await self._call(f"reading session {session_id!r}", op)

    async def list_sessions(self) -> list[Session]:
        """All sessions, most recently updated first."""

        def op(conn: sqlite3.Connection) -> list[Session]:
            rows = conn.execute(
                f"SELECT {SESSION_COLUMNS} FROM sessions ORDER BY updated_at DESC, rowid DESC"
            ).fetchall()
            return [session_from_row(r) for r in rows]

        return await self._call("listing sessions", op)

    async def update_session(self, session: Session) -> bool:
        """Store title, parent, token counts, cost and ``updated_at`` as given.

        ``message_count`` is kept by the database and is not written. Returns False if there is no
        such session.
        """
        params = (
            session.title,
            session.parent_session_id,
            session.prompt_tokens,
            session.completion_tokens,
            session.cost,
            session.updated_at,
            session.id,
        )
        self._fresh_sessions.pop(session.id, None)

        def op(conn: sqlite3.Connection) -> bool:
            cur = _transaction(
                conn,
                lambda c: c.execute(
                    "UPDATE sessions SET title = ?, parent_session_id = ?, prompt_tokens = ?, "
                    "completion_tokens = ?, cost = ?, updated_at = ? WHERE id = ?",
                    params,
                ),
            )
            return cur.rowcount > 0

        return await self._call(f"updating session {session.id!r}", op)

    async def record_step_usage(
        self, session_id: str, prompt_tokens: int, completion_tokens: int, cost: float
    ) -> Session | None:
        """After a model step: set the session's token counts to the step's (the context in use
        now, as Crush counts it) and add ``cost`` to its total, atomically.

        Returns:
            The updated session, or None if there is no such session.
        """
        return await self._update_session(
            session_id,
            "prompt_tokens = ?, completion_tokens = ?, cost = cost + ?",
            (prompt_tokens, completion_tokens, cost),
            f"recording usage of session {session_id!r}",
        )

    async def set_title(
        self, session_id: str, title: str, *, keep_existing: bool = False
    ) -> Session | None:
        """Set the session's title and nothing else, atomically, so a step's usage recorded
        meanwhile is not overwritten; ``keep_existing`` leaves a title already set (one the
        client gave) in place.

        Returns:
            The updated session, or None if there is no such session.
        """
        assignment = (
            "title = CASE WHEN title = '' THEN ? ELSE title END" if keep_existing else ("title = ?")
        )
        return await self._update_session(
            session_id, assignment, (title,), f"setting the title of session {session_id!r}"
        )

    async def set_summary(
        self, session_id: str, message_id: str, completion_tokens: int, cost: float
    ) -> Session | None:
        """Point the session at its new summary message: later model requests start from it.
        The context in use is now the summary (``prompt_tokens`` 0, ``completion_tokens`` the
        summary's), and ``cost`` (the summary's) is added to the total.

        Returns:
            The updated session, or None if there is no such session.
        """
        return await self._update_session(
            session_id,
            "summary_message_id = ?, prompt_tokens = 0, completion_tokens = ?, cost = cost + ?",
            (message_id, completion_tokens, cost),
            f"setting the summary of session {session_id!r}",
        )

    async def set_todos(self, session_id: str, todos: list[Todo]) -> Session | None:
        """Replace the session's todo list.

        Returns:
            The updated session, or None if there is no such session.
        """
        return await self._update_session(
            session_id, "todos = ?", (todos_to_json(todos),), f"saving todos of {session_id!r}"
        )

    async def _update_session(
        self, session_id: str, assignments: str, values: tuple[object, ...], what: str
    ) -> Session | None:
        """``UPDATE sessions SET <assignments>, updated_at = now`` for one session and read it
        back, in one transaction; None if there is no such session."""
        sql = f"UPDATE sessions SET {assignments}, updated_at = ? WHERE id = ?"
        params = (*values, now(), session_id)
        self._fresh_sessions.pop(session_id, None)

        def op(conn: sqlite3.Connection) -> Session | None:
            def tx(c: sqlite3.Connection) -> Session | None:
                c.execute(sql, params)
                row = c.execute(
                    f"SELECT {SESSION_COLUMNS} FROM sessions WHERE id = ?", (session_id,)
                ).fetchone()
                return None if row is None else session_from_row(row)

            return _transaction(conn, tx)

        return await self._call(what, op)

    async def delete_message(self, message_id: str) -> bool:
        """Delete one message (a summary that was cancelled or failed). False: no such row."""
        self._fresh_sessions.clear()  # its session's message count changes

        def op(conn: sqlite3.Connection) -> bool:
            cur = _transaction(
                conn, lambda c: c.execute("DELETE FROM messages WHERE id = ?", (message_id,))
            )
            return cur.rowcount > 0

        return await self._call(f"deleting message {message_id!r}", op)

    async def delete_session(self, session_id: str) -> bool:
        """Delete a session and (by cascade) its messages; its run records stay.

        Returns False if there was no such session.
        """

        def op(conn: sqlite3.Connection) -> bool:
            cur = _transaction(
                conn, lambda c: c.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
            )
            return cur.rowcount > 0

        self._session_ids.discard(session_id)
        self._empty_sessions.discard(session_id)
        self._fresh_sessions.pop(session_id, None)
        return await self._call(f"deleting session {session_id!r}", op)

    # -- messages ------------------------------------------------------------------------------

    async def get_message(self, message_id: str) -> Message | None:
        def op(conn: sqlite3.Connection) -> Message | None:
            row = conn.execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE id = ?", (message_id,)
            ).fetchone()
            return None if row is None else message_from_row(row)

        return await self._call(f"reading message {message_id!r}", op)

    async def list_messages(self, session_id: str) -> list[Message]:
        """A session's messages, oldest first; equal ``created_at`` keeps insertion order.

        A session created by this store that no message write has touched yet is answered from
        memory (an empty list) without a database call.
        """
        if session_id in self._empty_sessions:
            if self._conn is None:
                raise self._closed_error()
            await trio.lowlevel.checkpoint_if_cancelled()
            return []

        def op(conn: sqlite3.Connection) -> list[Message]:
            rows = conn.execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = ? "
                "ORDER BY created_at, rowid",
                (session_id,),
            ).fetchall()
            return [message_from_row(r) for r in rows]

        return await self._call(f"listing messages of session {session_id!r}", op)

    async def write_messages(self, messages: Iterable[Message]) -> set[str]:
        """Upsert messages in one transaction (the streaming buffer's flush).

        A new id is inserted; an existing one gets its parts, ``updated_at`` and finish time. A
        message whose session no longer exists is skipped, so a late write cannot resurrect a
        deleted session's rows.

        Returns:
            The ids that were written (the others were skipped).
        """
        rows = [(*message_row(m), m.session_id) for m in messages]
        # Discarded before the call: from now on a listing (and the session's message count)
        # must be read from the database.
        for row in rows:
            self._empty_sessions.discard(row[-1])
            self._fresh_sessions.pop(row[-1], None)

        def op(conn: sqlite3.Connection) -> set[str]:
            def tx(c: sqlite3.Connection) -> set[str]:
                written: set[str] = set()
                for row in rows:
                    if c.execute(_UPSERT_MESSAGE, row).rowcount > 0:
                        written.add(row[0])
                return written

            return _transaction(conn, tx)

        METRICS.store_batch_size.labels("messages").observe(len(rows))
        return await self._call(f"writing {len(rows)} message(s)", op)

    # -- runs ----------------------------------------------------------------------------------

    async def save_runs(self, runs: list[Run], prompts: Mapping[str, str] | None = None) -> None:
        """Insert or update several run records in one transaction.

        ``prompts`` gives the prompt text of runs being inserted (by run id); it is written only
        when the row is created, never by an update.
        """
        prompts = prompts or {}
        rows = [(*run_row(run), prompts.get(run.run_id, "")) for run in runs]
        for run in runs:
            self._run_ids.add(run.run_id)

        def op(conn: sqlite3.Connection) -> None:
            _transaction(
                conn,
                lambda c: c.executemany(
                    f"INSERT INTO runs ({RUN_COLUMNS}, prompt) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT(run_id) DO UPDATE SET status = excluded.status, "
                    "message_id = excluded.message_id, text = excluded.text, "
                    "error = excluded.error, finished_at = excluded.finished_at",
                    rows,
                ),
            )

        what = f"saving run {runs[0].run_id!r}" if len(runs) == 1 else f"saving {len(rows)} runs"
        METRICS.store_batch_size.labels("runs").observe(len(rows))
        await self._call(what, op, runs=True)

    async def get_run_prompt(self, run_id: str) -> str | None:
        """The prompt text stored with a run, or None when there is no such run."""

        def op(conn: sqlite3.Connection) -> str | None:
            row = conn.execute("SELECT prompt FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            return None if row is None else str(row[0])

        return await self._call(f"reading the prompt of run {run_id!r}", op)

    async def unfinished_assistant_messages(self) -> list[Message]:
        """Assistant messages with no finish part (streaming when a process was killed)."""

        def op(conn: sqlite3.Connection) -> list[Message]:
            rows = conn.execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages "
                "WHERE finished_at IS NULL AND role = ? ORDER BY created_at, rowid",
                (Role.ASSISTANT.value,),
            ).fetchall()
            return [message_from_row(r) for r in rows]

        return await self._call("listing unfinished assistant messages", op)

    async def get_run(self, run_id: str) -> Run | None:
        def op(conn: sqlite3.Connection) -> Run | None:
            row = conn.execute(
                f"SELECT {RUN_COLUMNS} FROM runs WHERE run_id = ?", (run_id,)
            ).fetchone()
            return None if row is None else run_from_row(row)

        return await self._call(f"reading run {run_id!r}", op)

    # -- paging (crush_trio.store.paging) ---------------------------------------------------

    async def page_sessions(self, page: PageQuery) -> list[Session]:
        """One page of sessions, newest created first (``CursorNotFound``: bad ``before``)."""
        sql, cursor, params = _SQLITE.sessions(SESSION_COLUMNS, page)

        def op(conn: sqlite3.Connection) -> list[Session]:
            rows = run_page(_fetch(conn), sql, cursor, page.before, params, page.limit)
            return [session_from_row(r) for r in rows]

        return await self._call("listing a page of sessions", op)

    async def page_messages(self, session_id: str, page: PageQuery) -> list[Message]:
        """One page of a session's messages, oldest first (``CursorNotFound``: bad cursor)."""
        sql, cursor, params, reverse = _SQLITE.messages(MESSAGE_COLUMNS, session_id, page)
        cursor_id = page.after if page.after is not None else page.before

        def op(conn: sqlite3.Connection) -> list[Message]:
            rows = run_page(_fetch(conn), sql, cursor, cursor_id, params, page.limit)
            if reverse:
                rows.reverse()
            return [message_from_row(r) for r in rows]

        return await self._call(f"listing a page of messages of session {session_id!r}", op)

    async def page_runs(self, page: PageQuery) -> list[Run]:
        """One page of runs, newest first, filtered by status and session."""
        sql, cursor, params = _SQLITE.runs(RUN_COLUMNS, page)

        def op(conn: sqlite3.Connection) -> list[Run]:
            rows = run_page(_fetch(conn), sql, cursor, page.before, params, page.limit)
            return [run_from_row(r) for r in rows]

        return await self._call("listing a page of runs", op)

    async def list_runs(self, statuses: Iterable[RunStatus]) -> list[Run]:
        """Runs whose status is one of ``statuses``, oldest first."""
        values = sorted({RunStatus(s).value for s in statuses})
        if not values:
            if self._conn is None:
                raise self._closed_error()
            return []
        marks = ", ".join("?" * len(values))

        def op(conn: sqlite3.Connection) -> list[Run]:
            rows = conn.execute(
                f"SELECT {RUN_COLUMNS} FROM runs WHERE status IN ({marks}) "
                "ORDER BY created_at, rowid",
                values,
            ).fetchall()
            return [run_from_row(r) for r in rows]

        return await self._call(f"listing runs with status {', '.join(values)}", op)
