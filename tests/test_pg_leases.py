"""The cluster database: schema, node records, workspace leases and the fencing epoch, on a real
PostgreSQL server (``pg_dsn``: a fresh database per test)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
import trio

from crush_trio import eventlog
from crush_trio.cluster.pg import (
    SCHEMA_VERSION,
    Fenced,
    Held,
    Lease,
    PgCluster,
    check_epoch,
)
from crush_trio.errors import StoreError
from tests.services import free_port

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

#: Trio-clock cap of each test's waits (seconds).
TEST_TIMEOUT = 30
TTL = 10.0


@pytest.fixture
async def cluster(pg_dsn: str) -> AsyncIterator[PgCluster]:
    c = await PgCluster.open(pg_dsn)
    try:
        yield c
    finally:
        await c.aclose()


def sql(dsn: str, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Run one statement on a connection of its own (checks and changes below the API)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(query, params or None)
        return cur.fetchall() if cur.description else []


def expire(dsn: str, path: str) -> None:
    """Make a lease expire as if its TTL had passed (the database's clock decides expiry)."""
    sql(
        dsn,
        "UPDATE cluster_workspaces SET lease_expires_at = clock_timestamp() - interval '1 second' "
        "WHERE path = %s",
        (path,),
    )


async def test_open_creates_the_schema_once_even_when_nodes_start_together(pg_dsn: str) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        clusters: list[PgCluster] = []

        async def start() -> None:
            clusters.append(await PgCluster.open(pg_dsn, pool_size=2))

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(start)
        for c in clusters:
            await c.aclose()
        assert sql(pg_dsn, "SELECT version FROM crush_schema") == [(SCHEMA_VERSION,)]
        tables = {
            r[0] for r in sql(pg_dsn, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        }
        assert {"cluster_nodes", "cluster_workspaces", "sessions", "messages", "runs"} <= tables
        # Reopening applies nothing again and keeps the data.
        c = await PgCluster.open(pg_dsn)
        await c.register_node("n1", "http://a")
        await c.aclose()
        c = await PgCluster.open(pg_dsn)
        assert await c.node_url("n1") == "http://a"
        await c.aclose()


async def test_newer_schema_is_refused(pg_dsn: str) -> None:
    await (await PgCluster.open(pg_dsn)).aclose()  # creates the schema
    sql(pg_dsn, "UPDATE crush_schema SET version = %s", (SCHEMA_VERSION + 1,))
    with trio.fail_after(TEST_TIMEOUT), pytest.raises(StoreError, match="newer than this"):
        await PgCluster.open(pg_dsn)


async def test_unreachable_database_is_a_store_error_naming_it() -> None:
    dsn = f"postgresql://postgres:secret@127.0.0.1:{free_port()}/nowhere"
    with trio.fail_after(TEST_TIMEOUT), pytest.raises(StoreError) as info:
        await PgCluster.open(dsn, connect_timeout=2)
    assert "127.0.0.1" in str(info.value)
    assert "cluster.database_url" in str(info.value)
    assert "secret" not in str(info.value)


async def test_closed_cluster_refuses_calls(cluster: PgCluster) -> None:
    await cluster.aclose()
    await cluster.aclose()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        await cluster.node_url("n")


async def test_nodes_register_heartbeat_and_are_found(cluster: PgCluster, pg_dsn: str) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        assert await cluster.node_url("n1") is None
        assert await cluster.heartbeat("n1") is False
        await cluster.register_node("n1", "http://127.0.0.1:1")
        await cluster.register_node("n1", "http://127.0.0.1:2")  # a restart moves it
        await cluster.register_node("n2", "http://127.0.0.1:3")
        assert await cluster.heartbeat("n1") is True
        assert await cluster.node_url("n1") == "http://127.0.0.1:2"
        assert await cluster.live_nodes(60) == {
            "n1": "http://127.0.0.1:2",
            "n2": "http://127.0.0.1:3",
        }
        sql(
            pg_dsn,
            "UPDATE cluster_nodes SET heartbeat_at = clock_timestamp() - interval '1 minute' "
            "WHERE node_id = 'n2'",
        )
        assert await cluster.live_nodes(30) == {"n1": "http://127.0.0.1:2"}


async def test_first_claim_creates_the_workspace_and_others_are_told_the_owner(
    cluster: PgCluster,
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        await cluster.register_node("a", "http://a:1")
        lease = await cluster.claim_workspace("/p", "a", TTL)
        assert isinstance(lease, Lease)
        assert (lease.path, lease.epoch, lease.ttl) == ("/p", 1, TTL)

        held = await cluster.claim_workspace("/p", "b", TTL)
        assert isinstance(held, Held)
        assert (held.workspace_id, held.owner_node, held.owner_url) == (
            lease.workspace_id,
            "a",
            "http://a:1",
        )
        assert 0 < held.expires_in <= TTL

        # The owner claiming again (a second open) keeps its epoch.
        again = await cluster.claim_workspace("/p", "a", TTL)
        assert isinstance(again, Lease)
        assert (again.workspace_id, again.epoch) == (lease.workspace_id, 1)

        other = await cluster.claim_workspace("/q", "b", TTL)
        assert isinstance(other, Lease)
        assert other.workspace_id != lease.workspace_id


async def test_expired_lease_is_taken_with_a_new_epoch_and_the_old_owner_loses_it(
    cluster: PgCluster,
    pg_dsn: str,
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        old = await cluster.claim_workspace("/p", "a", TTL)
        assert isinstance(old, Lease)
        assert await cluster.renew(old) is True
        expire(pg_dsn, "/p")
        # Expired but not taken: the owner may still renew (nobody else wrote).
        assert await cluster.renew(old) is True
        expire(pg_dsn, "/p")

        new = await cluster.claim_workspace("/p", "b", TTL)
        assert isinstance(new, Lease)
        assert (new.workspace_id, new.epoch) == (old.workspace_id, 2)
        assert await cluster.current_epoch(old.workspace_id) == 2
        assert await cluster.renew(old) is False
        assert await cluster.release(old) is False  # a lost lease cannot expire the new one
        assert await cluster.renew(new) is True
        held = await cluster.claim_workspace("/p", "a", TTL)
        assert isinstance(held, Held)
        assert held.owner_node == "b"

        # Its own expired lease, claimed again, is a new epoch too: the old Lease is fenced.
        expire(pg_dsn, "/p")
        third = await cluster.claim_workspace("/p", "b", TTL)
        assert isinstance(third, Lease)
        assert third.epoch == 3
        assert await cluster.renew(new) is False


async def test_release_hands_the_workspace_over_at_once(cluster: PgCluster) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        lease = await cluster.claim_workspace("/p", "a", TTL)
        assert isinstance(lease, Lease)
        assert await cluster.release(lease) is True
        taken = await cluster.claim_workspace("/p", "b", TTL)
        assert isinstance(taken, Lease)
        assert taken.epoch == lease.epoch + 1


async def test_nodes_claiming_the_same_path_at_once_get_one_owner(pg_dsn: str) -> None:
    nodes = [f"n{i}" for i in range(6)]
    clusters = {n: await PgCluster.open(pg_dsn, pool_size=2) for n in nodes}
    try:
        with trio.fail_after(TEST_TIMEOUT):
            for round_ in range(3):
                if round_:
                    expire(pg_dsn, "/shared")
                results: dict[str, Lease | Held] = {}

                async def claim(node: str, results: dict[str, Lease | Held]) -> None:
                    results[node] = await clusters[node].claim_workspace("/shared", node, TTL)

                async with trio.open_nursery() as nursery:
                    for n in nodes:
                        nursery.start_soon(claim, n, results)
                winners = [n for n, r in results.items() if isinstance(r, Lease)]
                assert len(winners) == 1, results
                lease = results[winners[0]]
                assert isinstance(lease, Lease)
                assert lease.epoch == round_ + 1
                assert all(
                    r.owner_node == winners[0] and r.workspace_id == lease.workspace_id
                    for r in results.values()
                    if isinstance(r, Held)
                )
        assert sql(pg_dsn, "SELECT count(*) FROM cluster_workspaces") == [(1,)]
    finally:
        for c in clusters.values():
            await c.aclose()


async def test_expired_with_work_lists_only_expired_workspaces_with_active_runs(
    cluster: PgCluster,
    pg_dsn: str,
) -> None:
    dsn = pg_dsn
    with trio.fail_after(TEST_TIMEOUT):
        ids = {}
        for path in ("/idle", "/busy", "/live", "/done", "/unlogged"):
            lease = await cluster.claim_workspace(path, "a", TTL)
            assert isinstance(lease, Lease)
            ids[path] = lease.workspace_id
        for path, status in [("/busy", "queued"), ("/live", "running"), ("/done", "completed")]:
            sql(
                dsn,
                "INSERT INTO runs (workspace_id, run_id, session_id, status, created_at) "
                "VALUES (%s, 'r', 's', %s, 1)",
                (ids[path], status),
            )
        sql(
            dsn,
            "INSERT INTO runs (workspace_id, run_id, session_id, status, created_at) "
            "VALUES (%s, 'r', 's', 'failed', 1)",
            (ids["/unlogged"],),
        )
        sql(
            dsn,
            "INSERT INTO run_terminals (workspace_id, run_id, event, epoch) "
            "VALUES (%s, 'r', 'x', 1)",
            (ids["/unlogged"],),
        )
        assert await cluster.expired_with_work() == []
        for path in ("/idle", "/busy", "/done", "/unlogged"):
            expire(dsn, path)
        found = await cluster.expired_with_work()
        assert sorted(found) == sorted([(ids["/busy"], "/busy"), (ids["/unlogged"], "/unlogged")])


async def test_a_write_in_progress_delays_a_takeover_but_not_a_renewal_and_a_later_write_is_fenced(
    cluster: PgCluster, pg_dsn: str
) -> None:
    """The fence: a claim cannot take the lease over while a write that checked the epoch is
    open, the owner's renewal is not held up by it, and a write that starts after the claim
    sees the new epoch."""
    # Another node whose statements give up after waiting 200 ms for a lock.
    impatient = await PgCluster.open(pg_dsn + "?options=-c%20lock_timeout%3D200ms", pool_size=2)
    try:
        with trio.fail_after(TEST_TIMEOUT):
            lease = await cluster.claim_workspace("/p", "a", TTL)
            assert isinstance(lease, Lease)
            checked = trio.Event()
            finish = threading.Event()
            token = trio.lowlevel.current_trio_token()

            def write(conn: psycopg.Connection[Any]) -> None:
                check_epoch(conn, lease.workspace_id, lease.epoch)
                trio.from_thread.run_sync(checked.set, trio_token=token)
                finish.wait(TEST_TIMEOUT)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cluster.call, "a held write", write)
                await checked.wait()
                assert await impatient.renew(lease) is True
                expire(pg_dsn, "/p")
                with pytest.raises(StoreError) as info:
                    await impatient.claim_workspace("/p", "b", TTL)
                assert isinstance(info.value.__cause__, psycopg.errors.LockNotAvailable)
                # A live lease is answered without waiting for the write.
                assert await impatient.renew(lease) is True
                held = await impatient.claim_workspace("/p", "b", TTL)
                assert isinstance(held, Held)
                finish.set()

            expire(pg_dsn, "/p")
            taken = await impatient.claim_workspace("/p", "b", TTL)
            assert isinstance(taken, Lease)

            def late_write(conn: psycopg.Connection[Any]) -> None:
                check_epoch(conn, lease.workspace_id, lease.epoch)

            with pytest.raises(Fenced, match=r"epoch 1\).*epoch 2") as fenced:
                await cluster.call("a late write", late_write)
            assert type(fenced.value) is eventlog.Fenced  # the class the event log raises
    finally:
        await impatient.aclose()


async def test_a_node_stopped_inside_a_write_cannot_hold_up_a_takeover(pg_dsn: str) -> None:
    """A node paused between the epoch check and its commit holds the fence; the server ends
    its idle transaction after the idle timeout, the takeover goes on, and the paused write,
    resumed, fails without landing anything."""
    paused = await PgCluster.open(pg_dsn, idle_in_transaction_timeout=0.5)
    other = await PgCluster.open(pg_dsn, pool_size=2)
    try:
        with trio.fail_after(TEST_TIMEOUT):
            lease = await paused.claim_workspace("/p", "a", TTL)
            assert isinstance(lease, Lease)
            checked = trio.Event()
            resume = threading.Event()
            token = trio.lowlevel.current_trio_token()
            outcome: list[BaseException] = []

            def write(conn: psycopg.Connection[Any]) -> None:
                check_epoch(conn, lease.workspace_id, lease.epoch)
                trio.from_thread.run_sync(checked.set, trio_token=token)
                resume.wait(TEST_TIMEOUT)  # the node is stopped here
                conn.execute(
                    "INSERT INTO sessions (workspace_id, id, created_at, updated_at) "
                    "VALUES (%s, 'late', 1, 1)",
                    (lease.workspace_id,),
                )

            async def writer() -> None:
                try:
                    await paused.call("a paused write", write)
                except StoreError as exc:
                    outcome.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                await checked.wait()
                expire(pg_dsn, "/p")
                taken = await other.claim_workspace("/p", "b", TTL)
                assert isinstance(taken, Lease)
                assert taken.epoch == 2
                resume.set()
            assert len(outcome) == 1
            assert sql(pg_dsn, "SELECT count(*) FROM sessions") == [(0,)]
            # The paused node's pool replaced the connection the server closed.
            assert await paused.current_epoch(lease.workspace_id) == 2
    finally:
        await paused.aclose()
        await other.aclose()


async def test_connections_carry_the_statement_and_idle_timeouts(cluster: PgCluster) -> None:
    def settings(conn: psycopg.Connection[Any]) -> tuple[Any, ...]:
        row = conn.execute(
            "SELECT current_setting('statement_timeout'), "
            "current_setting('idle_in_transaction_session_timeout')"
        ).fetchone()
        assert row is not None
        return tuple(row)

    assert await cluster.call("reading settings", settings) == ("30s", "5s")


async def test_calls_go_on_after_the_database_dropped_every_connection(
    cluster: PgCluster, pg_dsn: str
) -> None:
    """A database restart (here: every session of the pool terminated) costs no failed call:
    a pooled connection is checked before use and replaced when broken."""
    with trio.fail_after(TEST_TIMEOUT):
        await cluster.register_node("n1", "http://a")
        dropped = sql(
            pg_dsn,
            "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        assert len(dropped) >= 1
        for _ in range(20):
            assert await cluster.node_url("n1") == "http://a"
