"""A workspace's sessions, messages and run records in the cluster's PostgreSQL database,
every write fenced by the lease epoch.

:class:`PgStore` keeps the contract of :class:`~crush_trio.core.ports.WorkspaceStore` (the
same tests run against it and the SQLite store) for one workspace of a
:class:`~crush_trio.cluster.pg.PgCluster`, at the epoch of the lease its node holds. The tables
(see :mod:`crush_trio.cluster.pg`) are the SQLite store's with ``workspace_id`` in front of every
key; rows are encoded on the event loop side before the worker thread starts, as in
:mod:`crush_trio.store.db`.

Fencing:
    Every write is one transaction that begins with :func:`~crush_trio.cluster.pg.check_epoch`
    (the workspace's fence, taken shared, then its epoch). If another node has claimed
    the workspace since this store was opened, the write raises
    :class:`~crush_trio.cluster.pg.Fenced` and rolls back: nothing of it lands. The store then
    refuses every later write with ``Fenced`` at once, without a database call; reads still work.
    While a write holds the fence, a claim waits for its commit, so no write of an old owner can
    land after a new owner's claim.

Throughput:
    A batch (``write_messages``, ``save_runs``) is one transaction whose statements go to the
    server in one pipeline, so a write window of 50 messages costs about one round trip. Calls
    share the cluster's pool through its ``CapacityLimiter`` (sized to the pool); there is no
    per-workspace connection.

The terminal record:
    :meth:`PgStore.record_terminal` writes a run's terminal status and its ``run_complete`` event
    in one fenced transaction, once: the first call for a run inserts the record and returns
    True, every later call (on any node, at any epoch) returns False and changes nothing. A run
    with a terminal status keeps it: :meth:`~PgStore.save_runs` never moves it to another status.
    The record stays "unlogged" until :meth:`~PgStore.mark_logged` notes that the event log holds
    the event; a node recovering the workspace appends what :meth:`~PgStore.unlogged_terminals`
    returns, so an event committed just before its owner died still reaches the log exactly
    once (the log's ``seq`` decides duplicates, not this table).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, TypeVar

import trio

from ..errors import StoreError
from ..store.db import RunIdFilter
from ..store.paging import Dialect, PageQuery, run_page
from ..store.rows import (
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
from ..wire import Message, Role, Run, RunStatus, Session, Todo, now, todos_to_json
from .pg import Fenced, PgCluster, check_epoch

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    import psycopg

    from ..core.ports import WorkspaceStore

T = TypeVar("T")


def _fetch(conn: psycopg.Connection[Any]) -> Callable[[str, Any], list[Any]]:
    return lambda sql, params: conn.execute(sql, params).fetchall()


#: Terminal run statuses, as stored: a run with one of them keeps it.
_TERMINAL: Final = tuple(s.value for s in RunStatus if s.terminal)

_UPSERT_MESSAGE: Final = f"""
INSERT INTO messages (workspace_id, {MESSAGE_COLUMNS})
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
ON CONFLICT (workspace_id, id) DO UPDATE SET
    parts = excluded.parts,
    updated_at = excluded.updated_at,
    finished_at = excluded.finished_at
"""

# A terminal status is final: an update never moves a run out of one (the WHERE is evaluated on
# the newest row version, so this holds against a concurrent record_terminal too).
_UPSERT_RUN: Final = f"""
INSERT INTO runs (workspace_id, {RUN_COLUMNS}, prompt)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)
ON CONFLICT (workspace_id, run_id) DO UPDATE SET
    status = excluded.status,
    message_id = excluded.message_id,
    text = excluded.text,
    error = excluded.error,
    finished_at = excluded.finished_at
WHERE runs.status NOT IN {_TERMINAL!r} OR runs.status = excluded.status
"""


class FencedCalls:
    """One workspace store's calls to the cluster database: reads, and writes that each run in
    one transaction behind the check of the lease epoch (see "Fencing" above).

    After :attr:`closed` is set every call raises :class:`StoreError`; after a write was fenced
    (:attr:`fenced`) every later write raises :class:`~crush_trio.cluster.pg.Fenced` at once,
    without a database call. Reads still work then.
    """

    def __init__(self, cluster: PgCluster, workspace_id: str, epoch: int) -> None:
        self.cluster = cluster
        self.workspace_id = workspace_id
        self.epoch = epoch
        #: Set when the store is closed: every later call raises StoreError.
        self.closed = False
        #: Set by the first write that was fenced: every later write is refused without a call.
        self.fenced = False

    def check_open(self) -> None:
        """Raises StoreError once the store is closed."""
        if self.closed:
            raise StoreError(
                f"store of workspace {self.workspace_id!r} is closed; its workspace has shut "
                "down, open the workspace again to use it"
            )

    def fenced_error(self) -> Fenced:
        return Fenced(
            f"workspace {self.workspace_id!r} is no longer owned by this node: its lease (epoch "
            f"{self.epoch}) was taken over; nothing was written, reconnect to the workspace's "
            "current owner"
        )

    async def read(self, what: str, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run ``fn`` on a pooled connection (``what`` names it in errors)."""
        self.check_open()

        def tx(conn: psycopg.Connection[Any]) -> T:
            self.check_open()  # closed while this call waited for its turn
            return fn(conn)

        return await self.cluster.call(what, tx)

    async def write(self, what: str, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run ``fn`` in one transaction behind the epoch check.

        Raises:
            Fenced: the workspace's epoch moved on (now or at an earlier write); nothing landed.
        """
        self.check_open()
        if self.fenced:
            raise self.fenced_error()
        workspace_id, epoch = self.workspace_id, self.epoch

        def tx(conn: psycopg.Connection[Any]) -> T:
            self.check_open()  # closed while this call waited for its turn
            check_epoch(conn, workspace_id, epoch)
            return fn(conn)

        try:
            return await self.cluster.call(what, tx)
        except Fenced:
            self.fenced = True
            raise


class PgStore:
    """One workspace's data in the cluster database, written at lease epoch ``epoch``.

    Create it with :meth:`open`; :meth:`aclose` only stops this object (the cluster's pool is
    the node's). Cancellation and errors behave as in :class:`~crush_trio.store.db.Store`.
    """

    def __init__(self, cluster: PgCluster, workspace_id: str, epoch: int) -> None:
        """Use :meth:`open`, which also loads the in-memory indexes."""
        self.cluster = cluster
        self.workspace_id = workspace_id
        self.epoch = epoch
        #: Every call to the database goes through here: reads, and the fenced writes.
        self.calls = FencedCalls(cluster, workspace_id, epoch)
        #: The paging queries' shape here (crush_trio.store.paging): rows of this workspace.
        self._paging = Dialect(
            mark="%s", seq="seq", scope="workspace_id = %s AND ", scope_params=(workspace_id,)
        )
        self._session_ids: set[str] = set()
        self._run_ids = RunIdFilter()
        self._empty_sessions: set[str] = set()

    @classmethod
    async def open(cls, cluster: PgCluster, workspace_id: str, epoch: int) -> PgStore:
        """Open the workspace's data at ``epoch``.

        Raises:
            Fenced: the workspace's epoch is no longer ``epoch``.
            StoreError: the database failed.
        """
        store = cls(cluster, workspace_id, epoch)

        def load(conn: psycopg.Connection[Any]) -> tuple[set[str], list[str]]:
            check_epoch(conn, workspace_id, epoch)
            sessions = conn.execute(
                "SELECT id FROM sessions WHERE workspace_id = %s", (workspace_id,)
            ).fetchall()
            runs = conn.execute(
                "SELECT run_id FROM runs WHERE workspace_id = %s", (workspace_id,)
            ).fetchall()
            return {r[0] for r in sessions}, [r[0] for r in runs]

        sessions, runs = await cluster.call(f"opening workspace {workspace_id!r}", load)
        store._session_ids = sessions
        for run_id in runs:
            store._run_ids.add(run_id)
        return store

    def __repr__(self) -> str:
        return f"<PgStore workspace={self.workspace_id!r} epoch={self.epoch}>"

    # -- plumbing ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.calls.closed

    @property
    def fenced(self) -> bool:
        """Set by the first write that was fenced: every later write is refused without a call."""
        return self.calls.fenced

    async def aclose(self) -> None:
        """Refuse later calls (StoreError); calls in progress finish. Idempotent."""
        self.calls.closed = True
        await trio.lowlevel.checkpoint()

    def session_exists(self, session_id: str) -> bool:
        return session_id in self._session_ids

    def may_have_run(self, run_id: str) -> bool:
        return run_id in self._run_ids

    # -- sessions ------------------------------------------------------------------------------

    async def create_session(self, session: Session) -> None:
        row = (self.workspace_id, *session_row(session))

        def op(conn: psycopg.Connection[Any]) -> None:
            conn.execute(
                f"INSERT INTO sessions (workspace_id, {SESSION_COLUMNS}) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                row,
            )

        await self.calls.write(f"creating session {session.id!r}", op)
        self._session_ids.add(session.id)
        self._empty_sessions.add(session.id)

    async def get_session(self, session_id: str) -> Session | None:
        params = (self.workspace_id, session_id)

        def op(conn: psycopg.Connection[Any]) -> Session | None:
            row = conn.execute(
                f"SELECT {SESSION_COLUMNS} FROM sessions WHERE workspace_id = %s AND id = %s",
                params,
            ).fetchone()
            return None if row is None else session_from_row(row)

        return await self.calls.read(f"reading session {session_id!r}", op)

    async def list_sessions(self) -> list[Session]:
        params = (self.workspace_id,)

        def op(conn: psycopg.Connection[Any]) -> list[Session]:
            rows = conn.execute(
                f"SELECT {SESSION_COLUMNS} FROM sessions WHERE workspace_id = %s "
                "ORDER BY updated_at DESC, seq DESC",
                params,
            ).fetchall()
            return [session_from_row(r) for r in rows]

        return await self.calls.read("listing sessions", op)

    async def update_session(self, session: Session) -> bool:
        params = (
            session.title,
            session.parent_session_id,
            session.prompt_tokens,
            session.completion_tokens,
            session.cost,
            session.updated_at,
            self.workspace_id,
            session.id,
        )

        def op(conn: psycopg.Connection[Any]) -> bool:
            cur = conn.execute(
                "UPDATE sessions SET title = %s, parent_session_id = %s, prompt_tokens = %s, "
                "completion_tokens = %s, cost = %s, updated_at = %s "
                "WHERE workspace_id = %s AND id = %s",
                params,
            )
            return cur.rowcount > 0

        return await self.calls.write(f"updating session {session.id!r}", op)

    async def record_step_usage(
        self, session_id: str, prompt_tokens: int, completion_tokens: int, cost: float
    ) -> Session | None:
        return await self._update_session(
            session_id,
            "prompt_tokens = %s, completion_tokens = %s, cost = cost + %s",
            (prompt_tokens, completion_tokens, cost),
            f"recording usage of session {session_id!r}",
        )

    async def set_title(
        self, session_id: str, title: str, *, keep_existing: bool = False
    ) -> Session | None:
        assignment = (
            "title = CASE WHEN title = '' THEN %s ELSE title END"
            if keep_existing
            else ("title = %s")
        )
        return await self._update_session(
            session_id, assignment, (title,), f"setting the title of session {session_id!r}"
        )

    async def set_summary(
        self, session_id: str, message_id: str, completion_tokens: int, cost: float
    ) -> Session | None:
        return await self._update_session(
            session_id,
            "summary_message_id = %s, prompt_tokens = 0, completion_tokens = %s, cost = cost + %s",
            (message_id, completion_tokens, cost),
            f"setting the summary of session {session_id!r}",
        )

    async def set_todos(self, session_id: str, todos: list[Todo]) -> Session | None:
        return await self._update_session(
            session_id, "todos = %s", (todos_to_json(todos),), f"saving todos of {session_id!r}"
        )

    async def _update_session(
        self, session_id: str, assignments: str, values: tuple[object, ...], what: str
    ) -> Session | None:
        query = (
            f"UPDATE sessions SET {assignments}, updated_at = %s "
            f"WHERE workspace_id = %s AND id = %s RETURNING {SESSION_COLUMNS}"
        ).encode()
        params = (*values, now(), self.workspace_id, session_id)

        def op(conn: psycopg.Connection[Any]) -> Session | None:
            row = conn.execute(query, params).fetchone()
            return None if row is None else session_from_row(row)

        return await self.calls.write(what, op)

    async def delete_session(self, session_id: str) -> bool:
        params = (self.workspace_id, session_id)

        def op(conn: psycopg.Connection[Any]) -> bool:
            cur = conn.execute("DELETE FROM sessions WHERE workspace_id = %s AND id = %s", params)
            return cur.rowcount > 0

        self._session_ids.discard(session_id)
        self._empty_sessions.discard(session_id)
        return await self.calls.write(f"deleting session {session_id!r}", op)

    # -- messages ------------------------------------------------------------------------------

    async def get_message(self, message_id: str) -> Message | None:
        params = (self.workspace_id, message_id)

        def op(conn: psycopg.Connection[Any]) -> Message | None:
            row = conn.execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE workspace_id = %s AND id = %s",
                params,
            ).fetchone()
            return None if row is None else message_from_row(row)

        return await self.calls.read(f"reading message {message_id!r}", op)

    async def list_messages(self, session_id: str) -> list[Message]:
        if session_id in self._empty_sessions:
            self.calls.check_open()
            await trio.lowlevel.checkpoint()
            return []
        params = (self.workspace_id, session_id)

        def op(conn: psycopg.Connection[Any]) -> list[Message]:
            rows = conn.execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages "
                "WHERE workspace_id = %s AND session_id = %s ORDER BY created_at, seq",
                params,
            ).fetchall()
            return [message_from_row(r) for r in rows]

        return await self.calls.read(f"listing messages of session {session_id!r}", op)

    async def write_messages(self, messages: Iterable[Message]) -> set[str]:
        """Upsert messages in one transaction, sent as one pipeline (see the module docstring).

        A message whose session no longer exists is skipped: the sessions of the batch are
        locked first (``FOR NO KEY UPDATE``, in id order), so a concurrent delete either went
        first (the rows are skipped) or waits for this commit (and then deletes them). Not ``FOR
        KEY SHARE``: the message-count trigger updates the session row, and a key-share lock
        taken while another writer's update of that row is uncommitted did not keep a delete
        from committing before this insert (a foreign-key error); the row lock the trigger
        takes anyway now comes first, so writers of one session queue on it once.
        """
        workspace_id = self.workspace_id
        # The newest state of each id (a batch normally holds each once).
        latest: dict[str, tuple[Any, ...]] = {}
        for m in messages:
            row = message_row(m)
            latest[m.id] = (workspace_id, *row[:-1], bool(row[-1]))
        rows = list(latest.values())
        session_ids = sorted({row[2] for row in rows})
        self._empty_sessions.difference_update(session_ids)

        def op(conn: psycopg.Connection[Any]) -> set[str]:
            if not rows:
                return set()
            alive = {
                r[0]
                for r in conn.execute(
                    "SELECT id FROM sessions WHERE workspace_id = %s AND id = ANY(%s) "
                    "ORDER BY id FOR NO KEY UPDATE",
                    (workspace_id, session_ids),
                ).fetchall()
            }
            kept = [row for row in rows if row[2] in alive]
            if kept:
                with conn.cursor() as cur:
                    cur.executemany(_UPSERT_MESSAGE, kept)
            return {row[1] for row in kept}

        return await self.calls.write(f"writing {len(rows)} message(s)", op)

    async def delete_message(self, message_id: str) -> bool:
        params = (self.workspace_id, message_id)

        def op(conn: psycopg.Connection[Any]) -> bool:
            cur = conn.execute("DELETE FROM messages WHERE workspace_id = %s AND id = %s", params)
            return cur.rowcount > 0

        return await self.calls.write(f"deleting message {message_id!r}", op)

    async def unfinished_assistant_messages(self) -> list[Message]:
        params = (self.workspace_id, Role.ASSISTANT.value)

        def op(conn: psycopg.Connection[Any]) -> list[Message]:
            rows = conn.execute(
                f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE workspace_id = %s "
                "AND finished_at IS NULL AND role = %s ORDER BY created_at, seq",
                params,
            ).fetchall()
            return [message_from_row(r) for r in rows]

        return await self.calls.read("listing unfinished assistant messages", op)

    # -- runs ----------------------------------------------------------------------------------

    async def save_runs(self, runs: list[Run], prompts: Mapping[str, str] | None = None) -> None:
        """Insert or update run records in one transaction (one pipeline). ``prompts`` is
        written only when a row is created; a run with a terminal status keeps it."""
        prompts = prompts or {}
        rows = [(self.workspace_id, *run_row(run), prompts.get(run.run_id, "")) for run in runs]
        for run in runs:
            self._run_ids.add(run.run_id)

        def op(conn: psycopg.Connection[Any]) -> None:
            if rows:
                with conn.cursor() as cur:
                    cur.executemany(_UPSERT_RUN, rows)

        what = f"saving run {runs[0].run_id!r}" if len(runs) == 1 else f"saving {len(rows)} runs"
        await self.calls.write(what, op)

    async def get_run(self, run_id: str) -> Run | None:
        params = (self.workspace_id, run_id)

        def op(conn: psycopg.Connection[Any]) -> Run | None:
            row = conn.execute(
                f"SELECT {RUN_COLUMNS} FROM runs WHERE workspace_id = %s AND run_id = %s",
                params,
            ).fetchone()
            return None if row is None else run_from_row(row)

        return await self.calls.read(f"reading run {run_id!r}", op)

    async def get_run_prompt(self, run_id: str) -> str | None:
        params = (self.workspace_id, run_id)

        def op(conn: psycopg.Connection[Any]) -> str | None:
            row = conn.execute(
                "SELECT prompt FROM runs WHERE workspace_id = %s AND run_id = %s", params
            ).fetchone()
            return None if row is None else str(row[0])

        return await self.calls.read(f"reading the prompt of run {run_id!r}", op)

    # -- paging (crush_trio.store.paging) ---------------------------------------------------

    async def page_sessions(self, page: PageQuery) -> list[Session]:
        dialect = self._paging
        sql, cursor, params = dialect.sessions(SESSION_COLUMNS, page)

        def op(conn: psycopg.Connection[Any]) -> list[Session]:
            rows = run_page(
                _fetch(conn), sql, cursor, page.before, params, page.limit, dialect.scope_params
            )
            return [session_from_row(r) for r in rows]

        return await self.calls.read("listing a page of sessions", op)

    async def page_messages(self, session_id: str, page: PageQuery) -> list[Message]:
        dialect = self._paging
        sql, cursor, params, reverse = dialect.messages(MESSAGE_COLUMNS, session_id, page)
        cursor_id = page.after if page.after is not None else page.before

        def op(conn: psycopg.Connection[Any]) -> list[Message]:
            rows = run_page(
                _fetch(conn), sql, cursor, cursor_id, params, page.limit, dialect.scope_params
            )
            if reverse:
                rows.reverse()
            return [message_from_row(r) for r in rows]

        return await self.calls.read(f"listing a page of messages of session {session_id!r}", op)

    async def page_runs(self, page: PageQuery) -> list[Run]:
        dialect = self._paging
        sql, cursor, params = dialect.runs(RUN_COLUMNS, page)

        def op(conn: psycopg.Connection[Any]) -> list[Run]:
            rows = run_page(
                _fetch(conn), sql, cursor, page.before, params, page.limit, dialect.scope_params
            )
            return [run_from_row(r) for r in rows]

        return await self.calls.read("listing a page of runs", op)

    async def list_runs(self, statuses: Iterable[RunStatus]) -> list[Run]:
        values = sorted({RunStatus(s).value for s in statuses})
        self.calls.check_open()
        if not values:
            await trio.lowlevel.checkpoint()
            return []
        params = (self.workspace_id, values)

        def op(conn: psycopg.Connection[Any]) -> list[Run]:
            rows = conn.execute(
                f"SELECT {RUN_COLUMNS} FROM runs WHERE workspace_id = %s "
                "AND status = ANY(%s) ORDER BY created_at, seq",
                params,
            ).fetchall()
            return [run_from_row(r) for r in rows]

        return await self.calls.read(f"listing runs with status {', '.join(values)}", op)

    # -- the terminal record -------------------------------------------------------------------

    async def record_terminal(self, run: Run, event: bytes | str) -> bool:
        """Give ``run`` its terminal status and record its terminal event, once.

        In one fenced transaction: the run's record is created if missing, the event inserted if
        the run has none yet, and only then the run's status, text, error and finish time are
        written. True: this call recorded it. False: a record existed (this call changed
        nothing); read it with :meth:`terminal_event`. Two calls at once: the second waits for
        the first's commit and gets False.

        Raises:
            ValueError: ``run`` does not have a terminal status.
            Fenced: the workspace's lease moved on; nothing was written.
        """
        if not run.status.terminal:
            raise ValueError(
                f"run {run.run_id!r} has status {run.status.value}; only a terminal status "
                "(completed, failed, cancelled) has a terminal record"
            )
        data = event.encode() if isinstance(event, str) else bytes(event)
        row = (self.workspace_id, *run_row(run), "")
        workspace_id, epoch, run_id = self.workspace_id, self.epoch, run.run_id
        self._run_ids.add(run_id)

        def op(conn: psycopg.Connection[Any]) -> bool:
            conn.execute(
                f"INSERT INTO runs (workspace_id, {RUN_COLUMNS}, prompt) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (workspace_id, run_id) DO NOTHING",
                row,
            )
            # Insert-if-absent: a concurrent insert of the same run makes this wait for its
            # commit, then do nothing.
            inserted = conn.execute(
                "INSERT INTO run_terminals (workspace_id, run_id, event, epoch) "
                "VALUES (%s, %s, %s, %s) ON CONFLICT (workspace_id, run_id) DO NOTHING "
                "RETURNING run_id",
                (workspace_id, run_id, data, epoch),
            ).fetchone()
            if inserted is None:
                return False
            conn.execute(
                "UPDATE runs SET status = %s, message_id = %s, text = %s, error = %s, "
                "finished_at = %s WHERE workspace_id = %s AND run_id = %s",
                (row[3], row[4], row[5], row[6], row[8], workspace_id, run_id),
            )
            return True

        return await self.calls.write(f"recording the end of run {run_id!r}", op)

    async def terminal_event(self, run_id: str) -> bytes | None:
        """The run's recorded terminal event, or None."""
        params = (self.workspace_id, run_id)

        def op(conn: psycopg.Connection[Any]) -> bytes | None:
            row = conn.execute(
                "SELECT event FROM run_terminals WHERE workspace_id = %s AND run_id = %s", params
            ).fetchone()
            return None if row is None else bytes(row[0])

        return await self.calls.read(f"reading the terminal event of run {run_id!r}", op)

    async def unlogged_terminals(self) -> list[tuple[str, bytes]]:
        """Terminal events not yet marked as in the event log: ``(run_id, event)``, oldest
        first."""
        params = (self.workspace_id,)

        def op(conn: psycopg.Connection[Any]) -> list[tuple[str, bytes]]:
            rows = conn.execute(
                "SELECT run_id, event FROM run_terminals WHERE workspace_id = %s AND NOT logged "
                "ORDER BY recorded_at, run_id",
                params,
            ).fetchall()
            return [(str(r[0]), bytes(r[1])) for r in rows]

        return await self.calls.read("listing terminal events not in the log", op)

    async def ended_without_record(self) -> list[str]:
        """Runs with a terminal status but no terminal record, oldest first: their node stopped
        between saving the status and recording the ``run_complete``."""
        params = (self.workspace_id,)

        def op(conn: psycopg.Connection[Any]) -> list[str]:
            rows = conn.execute(
                "SELECT r.run_id FROM runs r WHERE r.workspace_id = %s "
                "AND r.status IN ('completed', 'failed', 'cancelled') AND NOT EXISTS ("
                "SELECT 1 FROM run_terminals t WHERE t.workspace_id = r.workspace_id "
                "AND t.run_id = r.run_id) ORDER BY r.seq",
                params,
            ).fetchall()
            return [str(r[0]) for r in rows]

        return await self.calls.read("listing runs ended without a record", op)

    async def mark_logged(self, run_ids: Iterable[str]) -> None:
        """Note that the event log holds these runs' terminal events (fenced)."""
        params = (self.workspace_id, sorted(set(run_ids)))
        if not params[1]:
            self.calls.check_open()
            await trio.lowlevel.checkpoint()
            return

        def op(conn: psycopg.Connection[Any]) -> None:
            conn.execute(
                "UPDATE run_terminals SET logged = true "
                "WHERE workspace_id = %s AND run_id = ANY(%s) AND NOT logged",
                params,
            )

        await self.calls.write(f"marking {len(params[1])} terminal event(s) as logged", op)


if TYPE_CHECKING:

    def _pg_store_keeps_the_contract(store: PgStore) -> WorkspaceStore:
        return store
