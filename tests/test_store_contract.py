"""The workspace store contract (crush_trio.store.protocol), run against both implementations:
the embedded SQLite store and the cluster's PostgreSQL store. Then what only the PostgreSQL
store has: fencing by the lease epoch and the once-only terminal record."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import attrs
import psycopg
import pytest
import trio
import trio.testing

from crush_trio import eventlog
from crush_trio.cluster.pg import Fenced, Lease, PgCluster
from crush_trio.cluster.pgstore import PgStore
from crush_trio.errors import StoreError
from crush_trio.store.db import Store
from crush_trio.store.paging import CursorNotFound, PageQuery
from crush_trio.store.protocol import WorkspaceStore
from crush_trio.wire import (
    FinishPart,
    FinishReason,
    Message,
    ReasoningPart,
    Role,
    Run,
    RunStatus,
    Session,
    TextPart,
    Todo,
    TodoStatus,
    ToolCallPart,
    ToolResultPart,
)

if TYPE_CHECKING:
    from pathlib import Path

#: Trio-clock cap of each test's waits (seconds).
TEST_TIMEOUT = 30
#: The terminal statuses the concurrent callers race with.
STATUSES = [RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED]
#: Lease length in these tests (seconds): long enough never to expire by itself.
TTL = 60.0


@attrs.define
class Backend:
    """A store under test, and how to open the same workspace's data again."""

    store: WorkspaceStore
    reopen: Callable[[], Awaitable[WorkspaceStore]]


@pytest.fixture(params=["sqlite", "postgres"])
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    opened: list[WorkspaceStore] = []
    if request.param == "sqlite":

        async def reopen() -> WorkspaceStore:
            opened.append(await Store.open(tmp_path / "data"))
            return opened[-1]

        try:
            yield Backend(await reopen(), reopen)
        finally:
            for s in opened:
                await s.aclose()
        return

    dsn: str = request.getfixturevalue("pg_dsn")
    cluster = await PgCluster.open(dsn)
    try:
        lease = await cluster.claim_workspace(str(tmp_path), "node-a", TTL)
        assert isinstance(lease, Lease)

        async def reopen_pg() -> WorkspaceStore:
            store = await PgStore.open(cluster, lease.workspace_id, lease.epoch)
            opened.append(store)
            return store

        # Another workspace in the same database: nothing of it may show in the store's answers.
        other = await cluster.claim_workspace(str(tmp_path / "other"), "node-a", TTL)
        assert isinstance(other, Lease)
        neighbour = await PgStore.open(cluster, other.workspace_id, other.epoch)
        await neighbour.create_session(Session(id="s", title="neighbour's"))
        await neighbour.write_messages([Message(id="m", session_id="s", role=Role.ASSISTANT)])
        await neighbour.save_runs([Run(run_id="r2", session_id="s", status=RunStatus.RUNNING)])

        yield Backend(await reopen_pg(), reopen_pg)
    finally:
        for s in opened:
            await s.aclose()
        await cluster.aclose()


def all_parts() -> list[Any]:
    return [
        ReasoningPart(thinking="hmm", signature="sig", started_at=10, finished_at=11),
        TextPart(text="hello ✓ \x00-free ' quotes \" and %s"),
        ToolCallPart(id="call-1", name="bash", input='{"cmd": "ls"}', finished=True),
        ToolResultPart(tool_call_id="call-1", name="bash", content="a\nb", is_error=True),
        FinishPart(reason=FinishReason.TOOL_USE, time=12, message="m", details="d"),
    ]


# -- sessions -------------------------------------------------------------------------------------


async def test_session_round_trip_update_usage_summary_and_list_order(backend: Backend) -> None:
    store = backend.store
    with trio.fail_after(TEST_TIMEOUT):
        a = Session(id="a", title="first", created_at=100, updated_at=100)
        b = Session(id="b", title="second", parent_session_id="a", created_at=200, updated_at=200)
        c = Session(id="c", title="same time as b", created_at=200, updated_at=200)
        for s in (a, b, c):
            await store.create_session(s)
        assert store.session_exists("a")
        assert not store.session_exists("nope")

        assert await store.get_session("b") == Session(
            id="b", title="second", parent_session_id="a", created_at=200, updated_at=200
        )
        assert await store.get_session("s") is None  # the neighbour's session id
        assert await store.get_session("missing") is None
        # Most recently updated first; equal times: the later insert first.
        assert [s.id for s in await store.list_sessions()] == ["c", "b", "a"]

        a.title, a.updated_at, a.cost, a.message_count = "renamed", 300, 1.5, 99
        assert await store.update_session(a) is True
        assert await store.update_session(Session(id="missing")) is False
        assert [s.id for s in await store.list_sessions()] == ["a", "c", "b"]
        got = await store.get_session("a")
        assert got is not None
        assert (got.title, got.cost, got.message_count) == ("renamed", 1.5, 0)  # count is kept

        after = await store.record_step_usage("a", 10, 5, 0.25)
        assert after is not None
        assert (after.title, after.prompt_tokens, after.completion_tokens, after.cost) == (
            "renamed",
            10,
            5,
            1.75,
        )
        after = await store.record_step_usage("a", 1, 2, 0.25)
        assert after is not None
        assert (after.prompt_tokens, after.completion_tokens, after.cost) == (1, 2, 2.0)
        assert await store.get_session("a") == after
        assert await store.record_step_usage("missing", 1, 1, 1.0) is None

        # A title is set alone: the usage recorded before it stays (no lost update).
        kept = await store.set_title("a", "model title", keep_existing=True)
        assert kept is not None
        assert await store.get_session("a") == kept
        # The client's title and the usage stay.
        assert attrs.evolve(kept, updated_at=after.updated_at) == after
        untitled = Session(id="u", created_at=400, updated_at=400)
        await store.create_session(untitled)
        await store.record_step_usage("u", 3, 4, 0.5)
        titled = await store.set_title("u", "model title", keep_existing=True)
        assert titled is not None
        assert (titled.title, titled.prompt_tokens, titled.completion_tokens, titled.cost) == (
            "model title",
            3,
            4,
            0.5,
        )
        renamed = await store.set_title("u", "the client's")
        assert renamed is not None
        assert renamed.title == "the client's"
        assert renamed.cost == 0.5
        assert await store.set_title("missing", "x") is None
        await store.delete_session("u")

        summary = await store.set_summary("a", "sum-1", 7, 0.5)
        assert summary is not None
        assert (summary.summary_message_id, summary.prompt_tokens) == ("sum-1", 0)
        assert (summary.completion_tokens, summary.cost) == (7, 2.5)
        assert await store.get_session("a") == summary
        assert await store.set_summary("missing", "x", 1, 1.0) is None


async def test_todos_round_trip_replace_and_survive_a_reopen(backend: Backend) -> None:
    store = backend.store
    todos = [
        Todo("Add tests", TodoStatus.IN_PROGRESS, "Adding tests"),
        Todo("Fix the bug ✓ 'quoted' %s", TodoStatus.PENDING),
    ]
    with trio.fail_after(TEST_TIMEOUT):
        await store.create_session(Session(id="a", title="t", created_at=100, updated_at=100))
        assert (await store.get_session("a")) == Session(
            id="a", title="t", created_at=100, updated_at=100
        )  # an empty list by default
        saved = await store.set_todos("a", todos)
        assert saved is not None
        assert saved.todos == todos
        assert saved.title == "t"
        assert saved.updated_at >= 100
        # update_session (title, usage) leaves the list alone.
        saved.title = "renamed"
        assert await store.update_session(saved) is True
        again = await backend.reopen()
        got = await again.get_session("a")
        assert got is not None
        assert got.todos == todos
        assert got.title == "renamed"
        done = [Todo("Add tests", TodoStatus.COMPLETED, "Adding tests")]
        replaced = await again.set_todos("a", done)
        assert replaced is not None
        assert replaced.todos == done
        assert [s.todos for s in await again.list_sessions()] == [done]
        assert await again.set_todos("missing", done) is None


async def test_duplicate_session_is_a_store_error(backend: Backend) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        await backend.store.create_session(Session(id="s1"))
        with pytest.raises(StoreError, match="creating session 's1'"):
            await backend.store.create_session(Session(id="s1"))
        # The store is still usable after the failed transaction.
        await backend.store.create_session(Session(id="s2"))
        assert {s.id for s in await backend.store.list_sessions()} == {"s1", "s2"}


async def test_delete_session_removes_its_messages_but_keeps_its_runs(backend: Backend) -> None:
    store = backend.store
    with trio.fail_after(TEST_TIMEOUT):
        await store.create_session(Session(id="s"))
        await store.create_session(Session(id="keep"))
        await store.write_messages(
            [
                Message(id="m", session_id="s", role=Role.USER),
                Message(id="k", session_id="keep", role=Role.USER),
            ]
        )
        await store.save_runs([Run(run_id="r", session_id="s")])

        assert await store.delete_session("s") is True
        assert not store.session_exists("s")
        assert await store.delete_session("s") is False
        assert await store.get_session("s") is None
        assert await store.get_message("m") is None
        assert await store.list_messages("s") == []
        assert await store.get_message("k") is not None
        assert await store.get_run("r") is not None


# -- messages -------------------------------------------------------------------------------------


async def test_message_round_trip_with_every_part_type(backend: Backend) -> None:
    store = backend.store
    with trio.fail_after(TEST_TIMEOUT):
        await store.create_session(Session(id="s"))
        message = Message(
            id="m",
            session_id="s",
            role=Role.ASSISTANT,
            parts=all_parts(),
            model="model-x",
            provider="prov",
            created_at=5,
            updated_at=6,
            is_summary_message=True,
        )
        assert await store.write_messages([message]) == {"m"}
        assert await store.get_message("m") == message
        assert await store.get_message("nope") is None

        # An update rewrites the parts and times, not the identity fields.
        message.parts = [TextPart("edited")]
        message.updated_at = 7
        message.model = "ignored"
        assert await store.write_messages([message]) == {"m"}
        got = await store.get_message("m")
        assert got is not None
        assert (got.parts, got.updated_at, got.model, got.is_summary_message) == (
            [TextPart("edited")],
            7,
            "model-x",
            True,
        )


async def test_list_messages_orders_by_created_at_then_insertion(backend: Backend) -> None:
    store = backend.store
    with trio.fail_after(TEST_TIMEOUT):
        await store.create_session(Session(id="s"))
        await store.create_session(Session(id="other"))
        assert await store.list_messages("s") == []
        for mid, created in [("c", 50), ("a", 50), ("b", 50), ("early", 10)]:
            await store.write_messages(
                [Message(id=mid, session_id="s", role=Role.USER, created_at=created)]
            )
        await store.write_messages([Message(id="x", session_id="other", role=Role.USER)])
        assert [m.id for m in await store.list_messages("s")] == ["early", "c", "a", "b"]
        assert await store.list_messages("none") == []


async def test_a_batch_of_fifty_is_one_write_counted_once_per_message(backend: Backend) -> None:
    store = backend.store
    with trio.fail_after(TEST_TIMEOUT):
        await store.create_session(Session(id="s"))
        await store.create_session(Session(id="t"))
        batch = [
            Message(
                id=f"m{i:02d}",
                session_id="s" if i % 2 else "t",
                role=Role.ASSISTANT,
                parts=[TextPart("x" * i)],
                created_at=i,
            )
            for i in range(50)
        ]
        assert await store.write_messages(batch) == {m.id for m in batch}
        # Rewriting a batch (the next write window) updates; the counts do not grow.
        for m in batch:
            m.parts = [TextPart("y")]
        assert await store.write_messages(batch) == {m.id for m in batch}
        sessions = {s.id: s.message_count for s in await store.list_sessions()}
        assert sessions == {"s": 25, "t": 25}
        listed = await store.list_messages("s")
        assert [m.id for m in listed] == [m.id for m in batch if m.session_id == "s"]
        assert {m.text() for m in listed} == {"y"}

        assert await store.delete_message("m01") is True
        assert await store.delete_message("m01") is False
        session = await store.get_session("s")
        assert session is not None
        assert session.message_count == 24


async def test_write_messages_skips_the_rows_of_a_deleted_session(backend: Backend) -> None:
    store = backend.store
    with trio.fail_after(TEST_TIMEOUT):
        await store.create_session(Session(id="s"))
        await store.create_session(Session(id="gone"))
        await store.delete_session("gone")
        written = await store.write_messages(
            [
                Message(id="late", session_id="gone", role=Role.ASSISTANT),
                Message(id="ok", session_id="s", role=Role.ASSISTANT),
            ]
        )
        assert written == {"ok"}
        assert await store.get_message("late") is None
        assert await store.get_message("ok") is not None
        assert await store.write_messages([]) == set()


async def test_writes_racing_a_session_delete_never_fail_or_bring_rows_back(
    backend: Backend,
) -> None:
    store = backend.store
    with trio.fail_after(TEST_TIMEOUT):
        for round_ in range(20):  # the race is not hit every round
            sid = f"s{round_}"
            await store.create_session(Session(id=sid))
            started = trio.Event()

            async def writer(k: int, sid: str, started: trio.Event) -> None:
                for i in range(20):
                    batch = [
                        Message(id=f"{sid}-{k}-{i}-{j}", session_id=sid, role=Role.USER)
                        for j in range(5)
                    ]
                    await store.write_messages(batch)
                    started.set()

            async with trio.open_nursery() as nursery:
                for k in range(3):
                    nursery.start_soon(writer, k, sid, started)
                await started.wait()
                assert await store.delete_session(sid) is True
            assert await store.list_messages(sid) == []
            assert await store.get_session(sid) is None


async def test_unfinished_assistant_messages(backend: Backend) -> None:
    store = backend.store
    with trio.fail_after(TEST_TIMEOUT):
        await store.create_session(Session(id="s"))
        finish = FinishPart(reason=FinishReason.END_TURN, time=9)
        await store.write_messages(
            [
                Message(id="u", session_id="s", role=Role.USER, created_at=1),
                Message(id="open2", session_id="s", role=Role.ASSISTANT, created_at=3),
                Message(id="open1", session_id="s", role=Role.ASSISTANT, created_at=2),
                Message(
                    id="done", session_id="s", role=Role.ASSISTANT, parts=[finish], created_at=2
                ),
            ]
        )
        assert [m.id for m in await store.unfinished_assistant_messages()] == ["open1", "open2"]
        closing = await store.get_message("open1")
        assert closing is not None
        closing.parts.append(finish)
        await store.write_messages([closing])
        assert [m.id for m in await store.unfinished_assistant_messages()] == ["open2"]


# -- runs -----------------------------------------------------------------------------------------


async def test_runs_round_trip_prompts_and_list_by_status(backend: Backend) -> None:
    store = backend.store
    with trio.fail_after(TEST_TIMEOUT):
        r1 = Run(run_id="r1", session_id="s", created_at=1)
        r2 = Run(run_id="r2", session_id="s", status=RunStatus.RUNNING, created_at=2)
        r3 = Run(run_id="r3", session_id="t", created_at=3)
        r0 = Run(run_id="r0", session_id="t", created_at=3)  # same time, inserted later
        assert not store.may_have_run("r1")
        await store.save_runs([r1, r2], {"r1": "first prompt", "r2": "second"})
        await store.save_runs([r3])
        await store.save_runs([r0], {"r0": "zero"})
        assert store.may_have_run("r1")
        assert store.may_have_run("r0")
        assert await store.get_run("r2") == r2
        assert await store.get_run("nope") is None
        assert await store.get_run_prompt("r1") == "first prompt"
        assert await store.get_run_prompt("r3") == ""
        assert await store.get_run_prompt("nope") is None

        r1.status, r1.message_id, r1.text, r1.finished_at = RunStatus.COMPLETED, "m", "done", 9
        r3.status, r3.error = RunStatus.FAILED, "boom"
        await store.save_runs([r1, r3], {"r1": "an update never writes the prompt"})
        assert await store.get_run("r1") == r1
        assert await store.get_run_prompt("r1") == "first prompt"

        active = await store.list_runs({RunStatus.QUEUED, RunStatus.RUNNING})
        assert [r.run_id for r in active] == ["r2", "r0"]
        assert await store.list_runs([RunStatus.COMPLETED, RunStatus.FAILED]) == [r1, r3]
        assert await store.list_runs(set()) == []


async def test_reopening_keeps_everything_and_the_in_memory_indexes(backend: Backend) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        await backend.store.create_session(Session(id="s", title="kept"))
        await backend.store.write_messages(
            [Message(id="m", session_id="s", role=Role.USER, parts=[TextPart("x")])]
        )
        await backend.store.save_runs([Run(run_id="r", session_id="s")], {"r": "p"})
        await backend.store.aclose()

        store = await backend.reopen()
        assert store.session_exists("s")
        assert store.may_have_run("r")
        session = await store.get_session("s")
        assert session is not None
        assert (session.title, session.message_count) == ("kept", 1)
        assert [m.text() for m in await store.list_messages("s")] == ["x"]
        assert await store.get_run_prompt("r") == "p"


CALLS: list[Callable[[WorkspaceStore], Awaitable[object]]] = [
    lambda s: s.create_session(Session(id="x")),
    lambda s: s.get_session("x"),
    lambda s: s.list_sessions(),
    lambda s: s.update_session(Session(id="x")),
    lambda s: s.record_step_usage("x", 1, 1, 1.0),
    lambda s: s.set_summary("x", "m", 1, 1.0),
    lambda s: s.delete_session("x"),
    lambda s: s.get_message("m"),
    lambda s: s.list_messages("x"),
    lambda s: s.write_messages([]),
    lambda s: s.delete_message("m"),
    lambda s: s.unfinished_assistant_messages(),
    lambda s: s.save_runs([Run(run_id="r", session_id="x")]),
    lambda s: s.get_run_prompt("r"),
    lambda s: s.get_run("r"),
    lambda s: s.list_runs({RunStatus.QUEUED}),
    lambda s: s.list_runs(set()),
]


async def test_every_call_on_a_closed_store_is_a_store_error(backend: Backend) -> None:
    store = backend.store
    await store.create_session(Session(id="fresh"))  # listed from memory while open
    await store.aclose()
    await store.aclose()  # idempotent
    assert store.closed
    for call in [*CALLS, lambda s: s.list_messages("fresh")]:
        with pytest.raises(StoreError, match="closed"):
            await call(store)


# -- PostgreSQL only: fencing ---------------------------------------------------------------------


@attrs.define
class TwoOwners:
    """A workspace taken over: ``old`` was opened at epoch 1, ``new`` after another node's
    claim."""

    dsn: str
    cluster: PgCluster
    old: PgStore
    new: PgStore


def expire_all(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE cluster_workspaces "
            "SET lease_expires_at = clock_timestamp() - interval '1 second'"
        )


@pytest.fixture
async def pg_cluster(pg_dsn: str) -> AsyncIterator[PgCluster]:
    cluster = await PgCluster.open(pg_dsn)
    try:
        yield cluster
    finally:
        await cluster.aclose()


async def claim(cluster: PgCluster, node: str, path: str = "/w") -> PgStore:
    lease = await cluster.claim_workspace(path, node, TTL)
    assert isinstance(lease, Lease), lease
    return await PgStore.open(cluster, lease.workspace_id, lease.epoch)


@pytest.fixture
async def taken_over(pg_dsn: str, pg_cluster: PgCluster) -> TwoOwners:
    old = await claim(pg_cluster, "node-a")
    await old.create_session(Session(id="s", title="before"))
    await old.write_messages([Message(id="m", session_id="s", role=Role.ASSISTANT)])
    await old.save_runs([Run(run_id="r", session_id="s", status=RunStatus.RUNNING)])
    expire_all(pg_dsn)
    new = await claim(pg_cluster, "node-b")
    assert new.epoch == old.epoch + 1
    return TwoOwners(pg_dsn, pg_cluster, old, new)


WRITES: list[Callable[[PgStore], Awaitable[object]]] = [
    lambda s: s.create_session(Session(id="late")),
    lambda s: s.update_session(Session(id="s", title="late")),
    lambda s: s.record_step_usage("s", 1, 1, 1.0),
    lambda s: s.set_summary("s", "m", 1, 1.0),
    lambda s: s.delete_session("s"),
    lambda s: s.write_messages(
        [Message(id="m", session_id="s", role=Role.ASSISTANT, parts=[TextPart("late")])]
    ),
    lambda s: s.delete_message("m"),
    lambda s: s.save_runs([Run(run_id="r", session_id="s", status=RunStatus.FAILED)]),
    lambda s: s.record_terminal(Run(run_id="r", session_id="s", status=RunStatus.FAILED), b"x"),
    lambda s: s.mark_logged(["r"]),
]


def snapshot(dsn: str) -> list[Any]:
    """Every row of the workspace data tables, to compare before and after."""
    with psycopg.connect(dsn) as conn:
        return [
            conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall()  # type: ignore[arg-type]
            for table in ("sessions", "messages", "runs", "run_terminals")
        ]


@pytest.mark.parametrize("write", WRITES)
async def test_a_write_after_another_nodes_claim_is_fenced_and_lands_nothing(
    taken_over: TwoOwners, write: Callable[[PgStore], Awaitable[object]]
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        before = snapshot(taken_over.dsn)
        with pytest.raises(Fenced, match="no longer owned by this node") as info:
            await write(taken_over.old)
        assert type(info.value) is eventlog.Fenced  # the class the event log raises
        assert taken_over.old.fenced
        assert snapshot(taken_over.dsn) == before

        # Later writes are refused without a database call; reads still answer.
        calls = taken_over.cluster.call_count
        with pytest.raises(Fenced):
            await taken_over.old.create_session(Session(id="later"))
        assert taken_over.cluster.call_count == calls
        assert await taken_over.old.get_session("s") is not None

        # The new owner writes.
        await taken_over.new.update_session(Session(id="s", title="after"))
        session = await taken_over.new.get_session("s")
        assert session is not None
        assert session.title == "after"


async def test_opening_at_an_old_epoch_is_fenced(taken_over: TwoOwners) -> None:
    with pytest.raises(Fenced):
        await PgStore.open(taken_over.cluster, taken_over.old.workspace_id, taken_over.old.epoch)


async def test_no_write_of_the_old_owner_lands_after_the_claim(
    pg_dsn: str, pg_cluster: PgCluster
) -> None:
    """Writes race a claim from another node: every write either landed whole before the
    claim (and returned) or raised Fenced and landed nothing."""
    other_node = await PgCluster.open(pg_dsn, pool_size=2)
    try:
        with trio.fail_after(TEST_TIMEOUT):
            old = await claim(pg_cluster, "node-a")
            await old.create_session(Session(id="s"))
            landed_ok: set[str] = set()
            fenced: set[str] = set()
            going = trio.Event()
            claimed = trio.Event()

            async def writer(k: int) -> None:
                for i in range(100_000):
                    ids = [f"w{k}-{i}-{j}" for j in range(5)]
                    batch = [Message(id=m, session_id="s", role=Role.USER) for m in ids]
                    after_claim = claimed.is_set()
                    try:
                        await old.write_messages(batch)
                    except Fenced:
                        fenced.update(ids)
                        return
                    assert not after_claim, "a write that began after the claim landed"
                    landed_ok.update(ids)
                    if len(landed_ok) >= 50:
                        going.set()

            async def take_over() -> None:
                await going.wait()  # the writers are under way
                expire_all(pg_dsn)
                await claim(other_node, "node-b")
                claimed.set()

            async with trio.open_nursery() as nursery:
                for k in range(4):
                    nursery.start_soon(writer, k)
                nursery.start_soon(take_over)

            with psycopg.connect(pg_dsn) as conn:
                stored = {r[0] for r in conn.execute("SELECT id FROM messages").fetchall()}
            assert stored == landed_ok
            assert len(fenced) == 4 * 5
            assert not stored & fenced
            session = await (await claim(other_node, "node-b")).get_session("s")
            assert session is not None
            assert session.message_count == len(landed_ok)
    finally:
        await other_node.aclose()


async def test_a_call_waiting_for_its_turn_when_the_store_closes_is_refused(
    pg_dsn: str,
) -> None:
    cluster = await PgCluster.open(pg_dsn, pool_size=1)
    try:
        with trio.fail_after(TEST_TIMEOUT):
            store = await claim(cluster, "node-a")
            release = threading.Event()
            entered = trio.Event()
            token = trio.lowlevel.current_trio_token()
            errors: list[BaseException] = []

            def hold(conn: psycopg.Connection[Any]) -> None:
                trio.from_thread.run_sync(entered.set, trio_token=token)
                release.wait(TEST_TIMEOUT)

            async def queued(call: Callable[[], Awaitable[object]]) -> None:
                try:
                    await call()
                except StoreError as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cluster.call, "holding the only connection", hold)
                await entered.wait()
                nursery.start_soon(queued, lambda: store.get_session("s"))
                nursery.start_soon(queued, lambda: store.create_session(Session(id="s")))
                await trio.testing.wait_all_tasks_blocked()
                await store.aclose()
                release.set()
            assert len(errors) == 2
            assert all("closed" in str(e) for e in errors)
            assert await cluster.current_epoch(store.workspace_id) == 1
            assert sql_count(pg_dsn, "sessions") == 0
    finally:
        await cluster.aclose()


def sql_count(dsn: str, table: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()  # type: ignore[arg-type]
        assert row is not None
        return int(row[0])


# -- PostgreSQL only: the terminal record ---------------------------------------------------------


async def test_terminal_record_is_written_once_with_the_runs_status(
    pg_cluster: PgCluster,
) -> None:
    with trio.fail_after(TEST_TIMEOUT):
        store = await claim(pg_cluster, "node-a")
        run = Run(run_id="r", session_id="s", status=RunStatus.RUNNING)
        await store.save_runs([run], {"r": "prompt"})
        with pytest.raises(ValueError, match="terminal status"):
            await store.record_terminal(run, b"{}")

        done = attrs.evolve(run, status=RunStatus.COMPLETED, text="hi", finished_at=5)
        assert await store.record_terminal(done, b'{"type":"run_complete"}') is True
        assert await store.get_run("r") == done
        assert await store.get_run_prompt("r") == "prompt"
        failed = attrs.evolve(run, status=RunStatus.FAILED, error="late", finished_at=6)
        assert await store.record_terminal(failed, b"second") is False
        assert await store.get_run("r") == done
        assert await store.terminal_event("r") == b'{"type":"run_complete"}'
        assert await store.terminal_event("nope") is None

        # A terminal status is final: a stale save cannot move the run back or elsewhere.
        await store.save_runs([run, failed])
        assert await store.get_run("r") == done
        assert await store.list_runs({RunStatus.RUNNING, RunStatus.QUEUED}) == []

        # A run the store never saw gets its record too (a recovered run, say).
        lost = Run(run_id="lost", session_id="s", status=RunStatus.FAILED, error="node died")
        assert await store.record_terminal(lost, "as text") is True
        assert await store.get_run("lost") == lost
        assert store.may_have_run("lost")

        assert await store.unlogged_terminals() == [
            ("r", b'{"type":"run_complete"}'),
            ("lost", b"as text"),
        ]
        await store.mark_logged(["r"])
        await store.mark_logged([])
        assert await store.unlogged_terminals() == [("lost", b"as text")]
        assert await pg_cluster.expired_with_work() == []


async def test_terminal_record_is_once_only_under_concurrency(pg_dsn: str) -> None:
    """Many calls at once, through two connection pools: exactly one records, and the run's
    status is the winner's."""
    clusters = [await PgCluster.open(pg_dsn, pool_size=4) for _ in range(2)]
    try:
        with trio.fail_after(TEST_TIMEOUT):
            first = await claim(clusters[0], "node-a")
            stores = [first, await PgStore.open(clusters[1], first.workspace_id, first.epoch)]
            for round_ in range(5):
                run_id = f"r{round_}"
                await first.save_runs([Run(run_id=run_id, session_id="s")])
                results: dict[int, bool] = {}

                async def end(i: int, results: dict[int, bool], run_id: str) -> None:
                    run = Run(run_id=run_id, session_id="s", status=STATUSES[i % 3], text=f"by {i}")
                    results[i] = await stores[i % 2].record_terminal(run, f"event {i}")

                async with trio.open_nursery() as nursery:
                    for i in range(12):
                        nursery.start_soon(end, i, results, run_id)
                winners = [i for i, won in results.items() if won]
                assert len(winners) == 1, results
                (w,) = winners
                stored = await first.get_run(run_id)
                assert stored is not None
                assert (stored.status, stored.text) == (STATUSES[w % 3], f"by {w}")
                assert await first.terminal_event(run_id) == f"event {w}".encode()
    finally:
        for c in clusters:
            await c.aclose()


async def test_recovery_on_the_new_owner_does_not_record_a_second_terminal(
    taken_over: TwoOwners,
) -> None:
    """The old owner recorded the end of a run and died before its event reached the log: the
    new owner finds the record unlogged, and failing the run again records nothing."""
    with trio.fail_after(TEST_TIMEOUT):
        # (Recorded by the old owner while it still held the lease: replay that at epoch 2.)
        # The run keeps the creation time the old owner saved, whichever second this is.
        started = await taken_over.new.get_run("r")
        assert started is not None
        ended = attrs.evolve(started, status=RunStatus.COMPLETED, text="ok")
        assert await taken_over.new.record_terminal(ended, b"complete") is True
        expire_all(taken_over.dsn)
        assert await taken_over.cluster.expired_with_work() == [(taken_over.new.workspace_id, "/w")]
        third = await claim(taken_over.cluster, "node-c")
        assert await third.unlogged_terminals() == [("r", b"complete")]
        failed = Run(run_id="r", session_id="s", status=RunStatus.FAILED, error="node died")
        assert await third.record_terminal(failed, b"failed") is False
        assert await third.get_run("r") == ended
        with pytest.raises(Fenced):
            await taken_over.new.mark_logged(["r"])
        await third.mark_logged(["r"])
        assert await third.unlogged_terminals() == []


# -- pages (crush_trio.store.paging) --------------------------------------------------------------


async def test_pages_return_every_item_once_in_a_fixed_order_while_items_arrive(
    backend: Backend,
) -> None:
    """Sessions and runs page newest first by creation (an update does not move an item),
    messages oldest first; equal times keep insertion order; a cursor naming nothing is
    ``CursorNotFound``; the neighbour's rows never show."""
    store = backend.store
    with trio.fail_after(TEST_TIMEOUT):
        for i in range(7):
            await store.create_session(
                Session(id=f"s{i}", title=f"Title {i} 50%_", created_at=100 + i // 2)
            )
        first = await store.page_sessions(PageQuery(limit=3))
        assert [s.id for s in first] == ["s6", "s5", "s4"]
        await store.create_session(Session(id="late", created_at=999))  # arrives meanwhile
        moved = await store.get_session("s0")
        assert moved is not None
        moved.updated_at = 5000  # updated: it keeps its place in the pages
        await store.update_session(moved)
        rest = await store.page_sessions(PageQuery(limit=10, before="s4"))
        assert [s.id for s in rest] == ["s3", "s2", "s1", "s0"]
        found = await store.page_sessions(PageQuery(limit=10, query="title 3"))
        assert [s.id for s in found] == ["s3"]
        assert len(await store.page_sessions(PageQuery(limit=10, query="50%_"))) == 7
        assert await store.page_sessions(PageQuery(limit=10, query="0%x")) == []
        with pytest.raises(CursorNotFound):
            await store.page_sessions(PageQuery(before="s"))  # the neighbour's id

        msgs = [
            Message(id=f"m{i}", session_id="s1", role=Role.USER, created_at=10) for i in range(5)
        ]
        await store.write_messages(msgs)
        page = await store.page_messages("s1", PageQuery(limit=2))
        assert [m.id for m in page] == ["m0", "m1"]
        await store.write_messages(
            [Message(id="m5", session_id="s1", role=Role.USER, created_at=10)]
        )
        page = await store.page_messages("s1", PageQuery(limit=10, after="m1"))
        assert [m.id for m in page] == ["m2", "m3", "m4", "m5"]
        page = await store.page_messages("s1", PageQuery(limit=2, before="m4"))
        assert [m.id for m in page] == ["m2", "m3"]
        with pytest.raises(CursorNotFound):
            await store.page_messages("s1", PageQuery(after="m"))

        await store.save_runs(
            [
                Run(run_id=f"r{i}", session_id="s1" if i % 2 else "s2", status=st, created_at=50)
                for i, st in enumerate([RunStatus.COMPLETED, RunStatus.FAILED] * 3)
            ]
        )
        runs = await store.page_runs(PageQuery(limit=2))
        assert [r.run_id for r in runs] == ["r5", "r4"]
        runs = await store.page_runs(PageQuery(limit=10, before="r4", session_id="s1"))
        assert [r.run_id for r in runs] == ["r3", "r1"]
        runs = await store.page_runs(PageQuery(limit=10, statuses=("completed",)))
        assert [r.run_id for r in runs] == ["r4", "r2", "r0"]
