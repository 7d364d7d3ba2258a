"""The shared PostgreSQL database of a cluster: the connection pool, the schema, node records and
workspace leases with a fencing epoch.

Threads and the event loop:
    psycopg is used synchronously in worker threads. :class:`PgCluster` owns one
    ``psycopg_pool.ConnectionPool`` and one ``trio.CapacityLimiter`` of the pool's size, so a call
    that holds the limiter always finds a connection; callers beyond that queue on the limiter
    (first come, first served). Every call is one transaction on one pooled connection: committed
    when the call returns, rolled back when it raises. Once its thread has started, a call is not
    cancellable (it commits or rolls back as a whole; the cancellation arrives at the caller's
    next checkpoint), as in :mod:`crush_trio.store.db`. A pooled connection the server dropped
    (a database restart) is noticed before use and replaced, so it fails no call. psycopg is
    imported only when a cluster is opened, so single-node mode never needs it.

Clock:
    Every lease time is the database's (``clock_timestamp()``), never a node's, so nodes with
    skewed clocks agree on who holds a lease. Callers get durations (``expires_in``) rather than
    instants they would have to compare with their own clock.

Schema (version :data:`SCHEMA_VERSION`, in table ``crush_schema``):
    ``cluster_nodes (node_id, url, heartbeat_at)``
        One row per node: where it serves, and when it last said it was alive.
    ``cluster_workspaces (workspace_id, path unique, owner_node, epoch, lease_expires_at)``
        One row per project directory (the same path on every node: the directory lives on a
        shared file system). The lease: who owns the workspace until when. ``epoch`` grows by one
        each time the lease is taken afresh; it is the fencing token of every write.
    ``sessions``, ``messages``, ``runs``, ``run_terminals``
        The workspaces' data (:mod:`crush_trio.cluster.pgstore`): the tables of the embedded
        SQLite store with a ``workspace_id`` column in front of every key, a ``seq`` identity
        column for insertion order (SQLite's ``rowid``), and ``run_terminals``, the once-only
        record of each run's terminal event.

    :data:`MIGRATIONS` are applied in order at :meth:`PgCluster.open`, each in one transaction
    with the version bump, under an advisory lock so that nodes starting together do not race;
    a database with a newer version than this code is refused.

Leases and fencing:
    :meth:`PgCluster.claim_workspace` creates a workspace's row (a new ``workspace_id``, epoch 1)
    or takes the lease when it has expired, bumping the epoch. Claims lock the row (``FOR NO KEY
    UPDATE``) and the path is unique, so of two nodes claiming at once exactly one wins and the
    other gets :class:`Held`. A claim of a live lease the node already holds extends it and keeps
    the epoch. The owner keeps the lease with :meth:`~PgCluster.renew` (which fails once the epoch
    moved) and gives it up with :meth:`~PgCluster.release`.

    The fence is a transaction-scoped advisory lock per workspace (key: ``hashtextextended`` of
    its id). A write of a workspace's data starts with :func:`check_epoch`, which takes the lock
    shared and then reads the epoch (the database function ``crush_check_epoch``: the read comes
    after the lock, with a fresh snapshot). A claim that takes a lease over takes the lock
    exclusively before it bumps the epoch. So either the claim committed first (the write sees
    the new epoch, raises :class:`~crush_trio.errors.Fenced`, the class the event log raises
    too, and rolls back: nothing lands) or the claim waits until the writes in progress have
    committed. PostgreSQL queues lock requests fairly (a shared request waits behind a waiting
    exclusive one), so a stream of writes cannot starve a claim; and since writes take no lock on
    the lease row, they never delay a renewal. A node that lost its lease can therefore never
    write after the new owner took over. A node paused inside a write holds the fence until the
    server ends its idle transaction (:data:`IDLE_IN_TRANSACTION_TIMEOUT`); its write then fails
    without landing.
"""

from __future__ import annotations

import select
import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs
import trio

from ..defaults import CLEANUP_TIMEOUT, DEFAULT_DATABASE_POOL
from ..errors import Fenced as Fenced  # one class for the store and the event log
from ..errors import StoreError

if TYPE_CHECKING:
    from collections.abc import Callable

    import psycopg
    from psycopg_pool import ConnectionPool

T = TypeVar("T")

#: Bound on opening a connection to the database (seconds), and on opening the pool.
CONNECT_TIMEOUT: Final = 10.0
#: Bound on waiting for a pooled connection inside a call (seconds). The limiter keeps calls to
#: the pool's size, so this is reached only while the pool reconnects after losing the database.
POOL_WAIT_TIMEOUT: Final = 30.0
#: Bound on one statement of a call, lock waits included (seconds; the server cancels it).
STATEMENT_TIMEOUT: Final = 30.0
#: A transaction idle this long (seconds) is ended by the server, which releases its locks: a
#: node stopped in the middle of a write (SIGSTOP, a long pause) cannot hold up the node taking
#: its workspace over for longer. The calls' own transactions never pause between statements.
IDLE_IN_TRANSACTION_TIMEOUT: Final = 5.0
#: Bound on unacknowledged data on a connection (seconds): the kernel breaks a connection whose
#: database stopped answering (network partition) instead of retrying for many minutes.
TCP_USER_TIMEOUT: Final = 10.0
#: TCP keepalive of idle pooled connections: first probe after this many idle seconds, then
#: every KEEPALIVE_INTERVAL seconds, dropped after KEEPALIVE_COUNT unanswered probes.
KEEPALIVE_IDLE: Final = 10
KEEPALIVE_INTERVAL: Final = 5
KEEPALIVE_COUNT: Final = 3
#: SQLSTATE raised by the database's epoch check (``crush_check_epoch``) for a fenced write.
FENCED_SQLSTATE: Final = "CR001"
#: Key of the advisory lock that serializes schema migrations of nodes starting together.
SCHEMA_LOCK_KEY: Final = 0x637275736874  # "crusht"

_MIGRATION_1: Final = """
CREATE TABLE cluster_nodes (
    node_id      text PRIMARY KEY,
    url          text        NOT NULL,
    heartbeat_at timestamptz NOT NULL
);

CREATE TABLE cluster_workspaces (
    workspace_id     text PRIMARY KEY,
    path             text        NOT NULL UNIQUE,
    owner_node       text,
    epoch            bigint      NOT NULL CHECK (epoch > 0),
    lease_expires_at timestamptz NOT NULL
);

CREATE TABLE sessions (
    workspace_id       text             NOT NULL
                       REFERENCES cluster_workspaces (workspace_id) ON DELETE CASCADE,
    id                 text             NOT NULL,
    seq                bigint           GENERATED ALWAYS AS IDENTITY,
    parent_session_id  text,
    title              text             NOT NULL DEFAULT '',
    message_count      integer          NOT NULL DEFAULT 0 CHECK (message_count >= 0),
    prompt_tokens      bigint           NOT NULL DEFAULT 0 CHECK (prompt_tokens >= 0),
    completion_tokens  bigint           NOT NULL DEFAULT 0 CHECK (completion_tokens >= 0),
    cost               double precision NOT NULL DEFAULT 0 CHECK (cost >= 0),
    created_at         bigint           NOT NULL,
    updated_at         bigint           NOT NULL,
    summary_message_id text,
    PRIMARY KEY (workspace_id, id)
);

CREATE INDEX sessions_updated ON sessions (workspace_id, updated_at DESC, seq DESC);

CREATE TABLE messages (
    workspace_id       text    NOT NULL,
    id                 text    NOT NULL,
    seq                bigint  GENERATED ALWAYS AS IDENTITY,
    session_id         text    NOT NULL,
    role               text    NOT NULL,
    parts              text    NOT NULL DEFAULT '[]',
    model              text    NOT NULL DEFAULT '',
    provider           text    NOT NULL DEFAULT '',
    created_at         bigint  NOT NULL,
    updated_at         bigint  NOT NULL,
    finished_at        bigint,
    is_summary_message boolean NOT NULL DEFAULT false,
    PRIMARY KEY (workspace_id, id),
    FOREIGN KEY (workspace_id, session_id) REFERENCES sessions (workspace_id, id) ON DELETE CASCADE
);

CREATE INDEX messages_session_created ON messages (workspace_id, session_id, created_at, seq);
CREATE INDEX messages_unfinished ON messages (workspace_id, role) WHERE finished_at IS NULL;

CREATE FUNCTION messages_count() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        UPDATE sessions SET message_count = message_count + 1
            WHERE workspace_id = NEW.workspace_id AND id = NEW.session_id;
    ELSE
        UPDATE sessions SET message_count = message_count - 1
            WHERE workspace_id = OLD.workspace_id AND id = OLD.session_id;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER messages_count AFTER INSERT OR DELETE ON messages
    FOR EACH ROW EXECUTE FUNCTION messages_count();

-- No foreign key to sessions: a run record outlives a deleted session.
CREATE TABLE runs (
    workspace_id text   NOT NULL REFERENCES cluster_workspaces (workspace_id) ON DELETE CASCADE,
    run_id       text   NOT NULL,
    seq          bigint GENERATED ALWAYS AS IDENTITY,
    session_id   text   NOT NULL,
    status       text   NOT NULL,
    message_id   text,
    text         text   NOT NULL DEFAULT '',
    error        text,
    created_at   bigint NOT NULL,
    finished_at  bigint,
    prompt       text   NOT NULL DEFAULT '',
    PRIMARY KEY (workspace_id, run_id)
);

CREATE INDEX runs_status ON runs (workspace_id, status, created_at, seq);
CREATE INDEX runs_active ON runs (workspace_id) WHERE status IN ('queued', 'running');

-- The once-only record of a run's terminal event (its run_complete), written in the transaction
-- that gives the run its terminal status. "logged" is set once the event log holds the event.
CREATE TABLE run_terminals (
    workspace_id text        NOT NULL,
    run_id       text        NOT NULL,
    event        bytea       NOT NULL,
    epoch        bigint      NOT NULL,
    recorded_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    logged       boolean     NOT NULL DEFAULT false,
    PRIMARY KEY (workspace_id, run_id),
    FOREIGN KEY (workspace_id, run_id) REFERENCES runs (workspace_id, run_id) ON DELETE CASCADE
);

CREATE INDEX run_terminals_unlogged ON run_terminals (workspace_id) WHERE NOT logged;

-- The fence of every write (crush_trio.cluster.pg.check_epoch): the workspace's advisory lock,
-- shared, then its epoch, read after the lock (a volatile function's statements each take a new
-- snapshot). A mismatch raises SQLSTATE CR001 with "workspace_id epoch current" as the detail.
CREATE FUNCTION crush_check_epoch(ws text, expected bigint) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    current_epoch bigint;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(hashtextextended(ws, 0));
    SELECT epoch INTO current_epoch FROM cluster_workspaces WHERE workspace_id = ws;
    IF current_epoch IS DISTINCT FROM expected THEN
        RAISE EXCEPTION USING
            ERRCODE = 'CR001',
            MESSAGE = format('workspace %s is at epoch %s, not %s', ws, current_epoch, expected),
            DETAIL = coalesce(current_epoch::text, '');
    END IF;
END
$$;
"""

# Version 2: a session's todo list (the ``todos`` tool), as JSON text.
_MIGRATION_2: Final = """
ALTER TABLE sessions ADD COLUMN todos text NOT NULL DEFAULT '[]';
"""

#: The schema, as ordered migrations: entry ``i`` moves the database from version ``i`` to
#: ``i + 1``. Append new scripts; never edit one that has shipped.
MIGRATIONS: Final[tuple[str, ...]] = (_MIGRATION_1, _MIGRATION_2)

#: The schema version this code writes.
SCHEMA_VERSION: Final = len(MIGRATIONS)


def superseded(workspace_id: str, epoch: int, current: int | None) -> Fenced:
    """The :class:`~crush_trio.errors.Fenced` of a write made at ``epoch`` after the
    workspace moved to ``current`` (None: the workspace is gone)."""
    now = "is gone" if current is None else f"is at epoch {current}"
    return Fenced(
        f"workspace {workspace_id!r} is no longer owned by this node: its lease (epoch {epoch}) "
        f"was taken over and the workspace {now}; nothing was written, reconnect to the "
        "workspace's current owner"
    )


@attrs.frozen
class Lease:
    """This node owns the workspace until the lease expires; ``epoch`` fences its writes."""

    workspace_id: str
    path: str
    epoch: int
    #: When the lease expires (the database's clock; for display: compare durations, not this).
    expires_at: datetime
    #: The lease's length (seconds), which :meth:`PgCluster.renew` extends it by again.
    ttl: float


@attrs.frozen
class Held:
    """Another node holds a live lease on the workspace."""

    workspace_id: str
    owner_node: str | None
    #: The owner's advertised URL (None: the owner never registered).
    owner_url: str | None
    #: Seconds until the lease expires unless its owner renews it.
    expires_in: float


@attrs.frozen
class Owner:
    """Who holds a workspace's lease, as another node sees it."""

    path: str
    owner_node: str | None
    owner_url: str | None
    #: Seconds until the lease expires (negative: expired).
    expires_in: float


def check_epoch(conn: psycopg.Connection[Any], workspace_id: str, epoch: int) -> None:
    """First statement of a write transaction: hold the workspace's fence (shared, until the
    transaction ends) and raise :class:`Fenced` unless the workspace is still at ``epoch``."""
    import psycopg

    try:
        conn.execute("SELECT crush_check_epoch(%s, %s)", (workspace_id, epoch))
    except psycopg.Error as exc:
        if exc.sqlstate != FENCED_SQLSTATE:
            raise
        detail = exc.diag.message_detail or ""
        current = int(detail) if detail.isdigit() else None
        raise superseded(workspace_id, epoch, current) from None


def _dropped(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle connection is closed or has input waiting (an idle connection gets
    none unless the server is closing it)."""
    if conn.closed or conn.broken:
        return True
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


def _describe(dsn: str) -> str:
    """The DSN without credentials, for messages."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        info = conninfo_to_dict(dsn)
    except Exception:
        return "(unreadable DSN)"
    host = info.get("host") or "localhost"
    return f"{host}:{info.get('port') or 5432}/{info.get('dbname') or ''}"


def _migrate(conn: psycopg.Connection[Any], where: str) -> None:
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
        conn.execute("CREATE TABLE IF NOT EXISTS crush_schema (version integer NOT NULL)")
        row = conn.execute("SELECT version FROM crush_schema").fetchone()
        if row is None:
            conn.execute("INSERT INTO crush_schema (version) VALUES (0)")
            version = 0
        else:
            version = int(row[0])
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"database {where} has schema version {version}, newer than this server supports "
            f"({SCHEMA_VERSION}); upgrade crush-trio on every node"
        )
    for target in range(version + 1, SCHEMA_VERSION + 1):
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
            (seen,) = conn.execute("SELECT version FROM crush_schema").fetchone() or (0,)
            if seen >= target:  # another node migrated meanwhile
                continue
            conn.execute(MIGRATIONS[target - 1].encode())
            conn.execute("UPDATE crush_schema SET version = %s", (target,))


class PgCluster:
    """A node's connection to the cluster database. Create it with :meth:`open` (or
    :func:`open_cluster`); close it with :meth:`aclose`.

    Backpressure:
        Calls queue on a ``CapacityLimiter`` of the pool's size; there is no other buffer.
    """

    def __init__(self, pool: ConnectionPool[Any], where: str, pool_size: int) -> None:
        """Wrap an open pool; use :meth:`open` instead."""
        self._pool: ConnectionPool[Any] | None = pool
        self.where = where
        #: One slot per pooled connection: a call holding a slot never waits for a connection.
        self.limiter = trio.CapacityLimiter(pool_size)
        self._pool_size = pool_size
        #: Transactions run (tests and benchmarks read it).
        self.call_count = 0

    @classmethod
    async def open(
        cls,
        dsn: str,
        *,
        pool_size: int = DEFAULT_DATABASE_POOL,
        connect_timeout: float = CONNECT_TIMEOUT,
        statement_timeout: float = STATEMENT_TIMEOUT,
        idle_in_transaction_timeout: float = IDLE_IN_TRANSACTION_TIMEOUT,
    ) -> PgCluster:
        """Connect to the database and bring its schema up to date.

        Every pooled connection gets the session settings ``statement_timeout`` and
        ``idle_in_transaction_session_timeout`` (from the arguments), and client-side
        :data:`TCP_USER_TIMEOUT` and keepalives.

        Raises:
            StoreError: the database cannot be reached within ``connect_timeout``, or its schema
                is newer than this code.
        """
        if pool_size < 1:
            raise ValueError(f"pool_size must be at least 1, got {pool_size}")
        import psycopg
        from psycopg_pool import ConnectionPool

        where = _describe(dsn)

        settings = (
            f"{round(statement_timeout * 1000)}ms",
            f"{round(idle_in_transaction_timeout * 1000)}ms",
        )

        def configure(conn: psycopg.Connection[Any]) -> None:
            conn.execute(
                "SELECT set_config('statement_timeout', %s, false), "
                "set_config('idle_in_transaction_session_timeout', %s, false)",
                settings,
            )
            conn.commit()

        def open_pool() -> ConnectionPool[Any]:
            pool: ConnectionPool[Any] = ConnectionPool(
                dsn,
                min_size=pool_size,  # warm: a takeover's first writes need no connect
                max_size=pool_size,
                open=False,
                timeout=POOL_WAIT_TIMEOUT,
                kwargs={
                    "connect_timeout": max(1, round(connect_timeout)),
                    "tcp_user_timeout": round(TCP_USER_TIMEOUT * 1000),
                    "keepalives": 1,
                    "keepalives_idle": KEEPALIVE_IDLE,
                    "keepalives_interval": KEEPALIVE_INTERVAL,
                    "keepalives_count": KEEPALIVE_COUNT,
                },
                configure=configure,
                name=f"crush-trio {where}",
            )
            try:
                pool.open(wait=True, timeout=connect_timeout)
                with pool.connection(timeout=connect_timeout) as conn:
                    _migrate(conn, where)
            except BaseException:
                pool.close(timeout=CLEANUP_TIMEOUT)
                raise
            return pool

        try:
            pool = await trio.to_thread.run_sync(open_pool)
        except psycopg.Error as exc:  # PoolTimeout is one
            raise StoreError(
                f"cannot open the cluster database {where}: {exc}; check cluster.database_url "
                "and that PostgreSQL is running"
            ) from exc
        return cls(pool, where, pool_size)

    @property
    def closed(self) -> bool:
        return self._pool is None

    async def aclose(self) -> None:
        """Close the pool after the calls in progress (bounded by
        :data:`~crush_trio.defaults.CLEANUP_TIMEOUT`); later calls raise StoreError. Idempotent."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await trio.to_thread.run_sync(lambda: pool.close(timeout=CLEANUP_TIMEOUT))

    def _closed_error(self) -> StoreError:
        return StoreError(
            f"the connection to the cluster database {self.where} is closed; the node is "
            "shutting down"
        )

    async def call(self, what: str, fn: Callable[[psycopg.Connection[Any]], T]) -> T:
        """Run ``fn(conn)`` as one transaction in a worker thread: committed when it returns,
        rolled back when it raises. psycopg errors become StoreError naming ``what``;
        :class:`Fenced` and other errors of ``fn`` pass through."""
        if self._pool is None:
            raise self._closed_error()
        import psycopg

        def in_thread() -> T:
            pool = self._pool
            if pool is None:  # closed while this call waited for its turn
                raise self._closed_error()
            try:
                conn = self._healthy_connection(pool)
                try:
                    with conn:  # commit on return, roll back on an exception
                        return fn(conn)
                finally:
                    pool.putconn(conn)
            except psycopg.Error as exc:
                raise StoreError(
                    f"cluster database {self.where}: {what} failed: {exc}".rstrip()
                ) from exc

        self.call_count += 1
        return await trio.to_thread.run_sync(in_thread, limiter=self.limiter)

    def _healthy_connection(self, pool: ConnectionPool[Any]) -> psycopg.Connection[Any]:
        """A pooled connection the server has not dropped (worker thread).

        A connection the server closed (a restart, an administrator's terminate) has its
        farewell waiting on the socket: such connections are closed and handed back, and the
        pool opens replacements. No round trip is spent on a healthy one.
        """
        for _ in range(self._pool_size):
            conn: psycopg.Connection[Any] = pool.getconn()
            if not _dropped(conn):
                return conn
            conn.close()
            pool.putconn(conn)  # discarded; the pool opens a replacement
        last: psycopg.Connection[Any] = pool.getconn()
        return last

    # -- nodes ---------------------------------------------------------------------------------

    async def register_node(self, node_id: str, url: str) -> None:
        """Record (or update) a node and where it serves; counts as a heartbeat."""

        def op(conn: psycopg.Connection[Any]) -> None:
            conn.execute(
                "INSERT INTO cluster_nodes (node_id, url, heartbeat_at) "
                "VALUES (%s, %s, clock_timestamp()) ON CONFLICT (node_id) DO UPDATE "
                "SET url = excluded.url, heartbeat_at = excluded.heartbeat_at",
                (node_id, url),
            )

        await self.call(f"registering node {node_id!r}", op)

    async def heartbeat(self, node_id: str) -> bool:
        """Note that the node is alive. False: it is not registered (call register_node)."""

        def op(conn: psycopg.Connection[Any]) -> bool:
            cur = conn.execute(
                "UPDATE cluster_nodes SET heartbeat_at = clock_timestamp() WHERE node_id = %s",
                (node_id,),
            )
            return cur.rowcount > 0

        return await self.call(f"heartbeat of node {node_id!r}", op)

    async def node_url(self, node_id: str) -> str | None:
        """Where a node serves, or None if it never registered."""

        def op(conn: psycopg.Connection[Any]) -> str | None:
            row = conn.execute(
                "SELECT url FROM cluster_nodes WHERE node_id = %s", (node_id,)
            ).fetchone()
            return None if row is None else str(row[0])

        return await self.call(f"reading node {node_id!r}", op)

    async def live_nodes(self, within: float) -> dict[str, str]:
        """Nodes whose last heartbeat is at most ``within`` seconds old: id → URL."""

        def op(conn: psycopg.Connection[Any]) -> dict[str, str]:
            rows = conn.execute(
                "SELECT node_id, url FROM cluster_nodes "
                "WHERE heartbeat_at >= clock_timestamp() - %s * interval '1 second' "
                "ORDER BY node_id",
                (within,),
            ).fetchall()
            return {str(r[0]): str(r[1]) for r in rows}

        return await self.call("listing live nodes", op)

    # -- leases --------------------------------------------------------------------------------

    async def claim_workspace(self, path: str, node_id: str, ttl: float) -> Lease | Held:
        """Own the workspace of ``path`` for ``ttl`` seconds, or learn who does.

        Creates the workspace (a new id, epoch 1) if the path has none; takes an expired lease
        (whoever held it) with the epoch bumped; extends a live lease ``node_id`` already holds,
        keeping its epoch. Otherwise returns :class:`Held`.
        """
        if not ttl > 0:
            raise ValueError(f"ttl must be positive, got {ttl}")
        new_id = uuid.uuid4().hex

        def op(conn: psycopg.Connection[Any]) -> Lease | Held:
            row = conn.execute(
                "INSERT INTO cluster_workspaces "
                "(workspace_id, path, owner_node, epoch, lease_expires_at) "
                "VALUES (%s, %s, %s, 1, clock_timestamp() + %s * interval '1 second') "
                "ON CONFLICT (path) DO NOTHING RETURNING lease_expires_at",
                (new_id, path, node_id, ttl),
            ).fetchone()
            if row is not None:
                return Lease(new_id, path, 1, row[0], ttl)
            # The row exists (perhaps committed by a concurrent claim this statement waited
            # for): lock it against other claims and renewals (not against writes, which take no
            # lock on it), then look at the lease with the clock read after the lock.
            found = conn.execute(
                "SELECT workspace_id, owner_node, epoch FROM cluster_workspaces "
                "WHERE path = %s FOR NO KEY UPDATE",
                (path,),
            ).fetchone()
            if found is None:  # deleted meanwhile; there is no API that deletes one
                raise StoreError(f"workspace row of {path!r} vanished during a claim; retry")
            workspace_id, owner, epoch = str(found[0]), found[1], int(found[2])
            (remaining,) = conn.execute(
                "SELECT extract(epoch FROM lease_expires_at - clock_timestamp())::float8 "
                "FROM cluster_workspaces WHERE workspace_id = %s",
                (workspace_id,),
            ).fetchone() or (0.0,)
            live = remaining > 0
            if live and owner != node_id:
                url = conn.execute(
                    "SELECT url FROM cluster_nodes WHERE node_id = %s", (owner,)
                ).fetchone()
                return Held(workspace_id, owner, None if url is None else url[0], remaining)
            if not live:
                # Taking over: wait for the writes in progress (they hold the fence shared);
                # writes that start later wait for this commit, then see the new epoch.
                conn.execute(
                    "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (workspace_id,)
                )
            new_epoch = epoch if live else epoch + 1
            (expires_at,) = conn.execute(
                "UPDATE cluster_workspaces SET owner_node = %s, epoch = %s, "
                "lease_expires_at = clock_timestamp() + %s * interval '1 second' "
                "WHERE workspace_id = %s RETURNING lease_expires_at",
                (node_id, new_epoch, ttl, workspace_id),
            ).fetchone() or (None,)
            assert isinstance(expires_at, datetime)  # the row is locked: the update found it
            return Lease(workspace_id, path, new_epoch, expires_at, ttl)

        return await self.call(f"claiming workspace {path!r} for node {node_id!r}", op)

    async def renew(self, lease: Lease) -> bool:
        """Extend the lease by its ``ttl`` from now. False: it is lost (another node took it:
        the epoch moved on); the node must stop serving the workspace without writing."""

        def op(conn: psycopg.Connection[Any]) -> bool:
            cur = conn.execute(
                "UPDATE cluster_workspaces "
                "SET lease_expires_at = clock_timestamp() + %s * interval '1 second' "
                "WHERE workspace_id = %s AND epoch = %s",
                (lease.ttl, lease.workspace_id, lease.epoch),
            )
            return cur.rowcount > 0

        return await self.call(f"renewing the lease of workspace {lease.workspace_id!r}", op)

    async def release(self, lease: Lease) -> bool:
        """Expire the lease now, so another node can take the workspace at once (hand-over on
        shutdown). False: the lease was already lost."""

        def op(conn: psycopg.Connection[Any]) -> bool:
            cur = conn.execute(
                "UPDATE cluster_workspaces SET lease_expires_at = "
                "least(lease_expires_at, clock_timestamp()) "
                "WHERE workspace_id = %s AND epoch = %s",
                (lease.workspace_id, lease.epoch),
            )
            return cur.rowcount > 0

        return await self.call(f"releasing the lease of workspace {lease.workspace_id!r}", op)

    async def current_epoch(self, workspace_id: str) -> int | None:
        """The workspace's epoch now (None: no such workspace)."""

        def op(conn: psycopg.Connection[Any]) -> int | None:
            row = conn.execute(
                "SELECT epoch FROM cluster_workspaces WHERE workspace_id = %s", (workspace_id,)
            ).fetchone()
            return None if row is None else int(row[0])

        return await self.call(f"reading the epoch of workspace {workspace_id!r}", op)

    async def workspace_owner(self, workspace_id: str) -> Owner | None:
        """The lease of ``workspace_id`` (None: the cluster has no such workspace)."""

        def op(conn: psycopg.Connection[Any]) -> Owner | None:
            row = conn.execute(
                "SELECT w.path, w.owner_node, n.url, "
                "extract(epoch FROM w.lease_expires_at - clock_timestamp())::float8 "
                "FROM cluster_workspaces w LEFT JOIN cluster_nodes n ON n.node_id = w.owner_node "
                "WHERE w.workspace_id = %s",
                (workspace_id,),
            ).fetchone()
            if row is None:
                return None
            return Owner(str(row[0]), row[1], row[2], float(row[3]))

        return await self.call(f"locating workspace {workspace_id!r}", op)

    async def expired_with_work(self) -> list[tuple[str, str]]:
        """Workspaces whose lease has expired and that still have work: runs queued or running,
        or terminal events recorded but not yet in the event log. ``(workspace_id, path)``,
        longest expired first."""

        def op(conn: psycopg.Connection[Any]) -> list[tuple[str, str]]:
            rows = conn.execute(
                "SELECT w.workspace_id, w.path FROM cluster_workspaces w "
                "WHERE w.lease_expires_at <= clock_timestamp() AND ("
                " EXISTS (SELECT 1 FROM runs r WHERE r.workspace_id = w.workspace_id"
                "  AND r.status IN ('queued', 'running'))"
                " OR EXISTS (SELECT 1 FROM run_terminals t WHERE t.workspace_id = w.workspace_id"
                "  AND NOT t.logged)) "
                "ORDER BY w.lease_expires_at, w.workspace_id"
            ).fetchall()
            return [(str(r[0]), str(r[1])) for r in rows]

        return await self.call("listing expired workspaces with work", op)
