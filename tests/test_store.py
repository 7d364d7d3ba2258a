"""The embedded store below its contract: schema, triggers, errors and staying off the event loop.

The behaviour every store shares (sessions, messages, runs) is tested against both stores in
tests/test_store_contract.py."""

from __future__ import annotations

import sqlite3
import threading
import uuid
from typing import TYPE_CHECKING, Any

import pytest
import trio

from crush_trio.errors import StoreError
from crush_trio.store import db as db_module
from crush_trio.store import rows as rows_module
from crush_trio.store.db import DB_FILENAME, SCHEMA_VERSION, RunIdFilter, Store
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
    ToolCallPart,
    ToolResultPart,
    parts_from_json,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable
    from pathlib import Path

#: Trio-clock cap for each test's waits.
TEST_TIMEOUT = 10


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    s = await Store.open(tmp_path / "data")
    try:
        yield s
    finally:
        await s.aclose()


def raw(tmp_path: Path) -> sqlite3.Connection:
    """A plain connection to the test database, for checks below the Store API."""
    conn = sqlite3.connect(tmp_path / "data" / DB_FILENAME, isolation_level=None)
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


def all_parts() -> list[Any]:
    return [
        ReasoningPart(thinking="hmm", signature="sig", started_at=10, finished_at=11),
        TextPart(text="hello ✓"),
        ToolCallPart(id="call-1", name="bash", input='{"cmd": "ls"}', finished=True),
        ToolResultPart(tool_call_id="call-1", name="bash", content="a\nb", is_error=True),
        FinishPart(reason=FinishReason.TOOL_USE, time=12, message="m", details="d"),
    ]


async def test_open_creates_directory_wal_and_schema_version(tmp_path: Path) -> None:
    s = await Store.open(tmp_path / "nested" / "data")
    await s.aclose()
    conn = sqlite3.connect(tmp_path / "nested" / "data" / DB_FILENAME)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


async def test_reopen_keeps_data_and_does_not_rerun_migrations(tmp_path: Path) -> None:
    s = await Store.open(tmp_path / "data")
    await s.create_session(Session(id="s1", title="kept"))
    await s.write_messages(
        [Message(id="m1", session_id="s1", role=Role.USER, parts=[TextPart("x")])]
    )
    await s.aclose()

    s = await Store.open(tmp_path / "data")
    try:
        session = await s.get_session("s1")
        assert session is not None
        assert session.title == "kept"
        assert session.message_count == 1
        assert [m.text() for m in await s.list_messages("s1")] == ["x"]
    finally:
        await s.aclose()


async def test_newer_schema_version_is_refused(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    conn = sqlite3.connect(tmp_path / "data" / DB_FILENAME)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreError, match="newer than this server supports"):
        await Store.open(tmp_path / "data")


async def test_message_round_trip_with_every_part_type(store: Store, tmp_path: Path) -> None:
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
    )
    assert await store.write_messages([message]) == {"m"}
    assert await store.get_message("m") == message
    assert await store.get_message("nope") is None

    conn = raw(tmp_path)
    try:
        stored = conn.execute("SELECT parts, finished_at FROM messages").fetchone()
    finally:
        conn.close()
    assert stored[0].startswith('[{"type":"reasoning","data":{')
    assert stored[1] == 12  # the finish part's time

    message.parts = [TextPart("edited")]
    message.updated_at = 7
    assert await store.write_messages([message]) == {"m"}
    got = await store.get_message("m")
    assert got is not None
    assert (got.parts, got.updated_at, got.model) == ([TextPart("edited")], 7, "model-x")


async def test_message_count_trigger_on_insert_upsert_and_delete(
    store: Store, tmp_path: Path
) -> None:
    await store.create_session(Session(id="s"))
    await store.write_messages([Message(id="m1", session_id="s", role=Role.USER)])
    await store.write_messages(
        [
            Message(id="m1", session_id="s", role=Role.USER, parts=[TextPart("upserted")]),
            Message(id="m2", session_id="s", role=Role.ASSISTANT),
        ]
    )
    session = await store.get_session("s")
    assert session is not None
    assert session.message_count == 2  # the upsert of m1 did not count twice
    message = await store.get_message("m1")
    assert message is not None
    assert message.text() == "upserted"

    conn = raw(tmp_path)
    try:
        conn.execute("DELETE FROM messages WHERE id = 'm1'")
    finally:
        conn.close()
    session = await store.get_session("s")
    assert session is not None
    assert session.message_count == 1


async def test_sqlite_errors_become_store_errors(store: Store) -> None:
    await store.create_session(Session(id="s"))
    with pytest.raises(StoreError, match="creating session 's'") as info:
        await store.create_session(Session(id="s"))
    assert isinstance(info.value.__cause__, sqlite3.IntegrityError)


CLOSED_CALLS: list[Callable[[Store], Awaitable[object]]] = [
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
    lambda s: s.save_runs([Run(run_id="r", session_id="x")]),
    lambda s: s.get_run_prompt("r"),
    lambda s: s.get_run("r"),
    lambda s: s.list_runs({RunStatus.QUEUED}),
    lambda s: s.list_runs(set()),
]


@pytest.mark.parametrize("call", CLOSED_CALLS)
async def test_closed_store_raises_store_error(
    tmp_path: Path, call: Callable[[Store], Awaitable[object]]
) -> None:
    s = await Store.open(tmp_path / "data")
    await s.aclose()
    await s.aclose()  # idempotent
    assert s.closed
    with pytest.raises(StoreError, match="store is closed"):
        await call(s)


async def test_call_waiting_for_its_turn_when_the_store_closes_raises_store_error(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    entered = trio.Event()
    token = trio.lowlevel.current_trio_token()
    real = parts_from_json

    def blocking(raw_parts: str) -> Any:
        trio.from_thread.run_sync(entered.set, trio_token=token)
        assert release.wait(TEST_TIMEOUT)
        return real(raw_parts)

    await store.create_session(Session(id="s"))
    await store.write_messages([Message(id="m", session_id="s", role=Role.USER)])
    monkeypatch.setattr(rows_module, "parts_from_json", blocking)
    errors: list[BaseException] = []

    async def queued_call() -> None:
        try:
            await store.get_session("s")
        except StoreError as exc:
            errors.append(exc)

    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.get_message, "m")  # holds the connection
            await entered.wait()
            nursery.start_soon(queued_call)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(store.aclose)
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    assert len(errors) == 1
    assert "store is closed" in str(errors[0])


async def test_database_work_runs_in_a_worker_thread(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.create_session(Session(id="s"))
    await store.write_messages([Message(id="m", session_id="s", role=Role.USER)])
    seen: list[int] = []
    real = parts_from_json

    def spy(raw_parts: str) -> Any:
        seen.append(threading.get_ident())
        return real(raw_parts)

    monkeypatch.setattr(rows_module, "parts_from_json", spy)
    assert await store.list_messages("s") != []
    assert seen
    assert threading.get_ident() not in seen


async def test_event_loop_keeps_running_while_a_database_call_is_busy(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker thread cannot finish until a trio task runs, so a blocked loop would fail."""
    await store.create_session(Session(id="s"))
    await store.write_messages([Message(id="m", session_id="s", role=Role.USER)])
    loop_ran = threading.Event()
    real = parts_from_json

    def needs_the_loop(raw_parts: str) -> Any:
        assert loop_ran.wait(TEST_TIMEOUT), "the event loop was blocked during a database call"
        return real(raw_parts)

    async def other_task() -> None:
        await trio.testing.wait_all_tasks_blocked()
        loop_ran.set()

    monkeypatch.setattr(rows_module, "parts_from_json", needs_the_loop)
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other_task)
            message = await store.get_message("m")
    assert message is not None
    assert loop_ran.is_set()


async def test_cancelled_write_that_started_is_not_torn(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel arriving while the thread runs does not abandon it: the commit completes and the
    call returns; the cancellation lands at the caller's next checkpoint."""
    await store.create_session(Session(id="s"))
    started = trio.Event()
    release = threading.Event()
    token = trio.lowlevel.current_trio_token()
    real = db_module._transaction

    def slow_transaction(conn: sqlite3.Connection, fn: Any) -> Any:
        trio.from_thread.run_sync(started.set, trio_token=token)
        assert release.wait(TEST_TIMEOUT)
        return real(conn, fn)

    monkeypatch.setattr(db_module, "_transaction", slow_transaction)
    batch = [Message(id=f"m{i}", session_id="s", role=Role.USER) for i in range(50)]
    with trio.fail_after(TEST_TIMEOUT):
        scope = trio.CancelScope()
        returned: list[set[str]] = []

        async def writer() -> None:
            with scope:
                returned.append(await store.write_messages(batch))
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            await started.wait()
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            release.set()
    assert len(returned) == 1
    assert len(returned[0]) == 50
    assert scope.cancelled_caught
    monkeypatch.undo()
    assert len(await store.list_messages("s")) == 50


def count_database_calls(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on, what each database call of ``store`` is doing, in order."""
    calls: list[str] = []
    real_call = store._call

    async def counting(what: str, fn: Any) -> Any:
        calls.append(what)
        return await real_call(what, fn)

    monkeypatch.setattr(store, "_call", counting)
    return calls


async def test_new_session_lists_no_messages_without_a_database_call(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session this store created and no write touched is known empty; any write ends that."""
    await store.create_session(Session(id="fresh"))
    await store.create_session(Session(id="written"))
    calls = count_database_calls(store, monkeypatch)
    assert await store.list_messages("fresh") == []
    assert calls == []

    await store.write_messages([Message(id="w", session_id="written", role=Role.USER)])
    await store.write_messages([Message(id="c", session_id="fresh", role=Role.USER)])
    calls.clear()
    assert [m.id for m in await store.list_messages("written")] == ["w"]
    assert [m.id for m in await store.list_messages("fresh")] == ["c"]
    assert len(calls) == 2

    # A reopened store does not know which sessions are empty: it asks the database.
    await store.aclose()
    reopened = await Store.open(tmp_path / "data")
    try:
        assert [m.id for m in await reopened.list_messages("fresh")] == ["c"]
    finally:
        await reopened.aclose()


async def test_new_session_is_read_without_a_database_call_until_a_write_changes_it(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session this store created is read from memory (a new session's first run reads it
    for its busy state and its title check); each kind of write to it ends that, and the next
    read shows what the write did."""
    writes: dict[str, Callable[[str], Awaitable[object]]] = {
        "title": lambda sid: store.set_title(sid, "renamed"),
        "usage": lambda sid: store.record_step_usage(sid, 5, 6, 0.5),
        "todos": lambda sid: store.set_todos(sid, [Todo("write the test")]),
        "summary": lambda sid: store.set_summary(sid, "sum", 3, 0.25),
        "message": lambda sid: store.write_messages(
            [Message(id=f"m-{sid}", session_id=sid, role=Role.USER)]
        ),
        "update": lambda sid: store.update_session(Session(id=sid, title="updated", cost=2.0)),
        "delete": lambda sid: store.delete_session(sid),
    }
    for sid in writes:
        await store.create_session(Session(id=sid, title="new", created_at=7, updated_at=8))
    calls = count_database_calls(store, monkeypatch)
    for sid in writes:
        session = await store.get_session(sid)
        assert session == Session(id=sid, title="new", created_at=7, updated_at=8)
        session.title = "changed by a caller"  # each read is a copy of its own
        session.is_busy = True
    assert calls == []
    assert await store.get_session("title") == Session(
        id="title", title="new", created_at=7, updated_at=8
    )

    for sid, write in writes.items():
        await write(sid)
    calls.clear()
    read = {sid: await store.get_session(sid) for sid in writes}
    assert len(calls) == len(writes)
    assert read.pop("delete") is None
    sessions = {sid: session for sid, session in read.items() if session is not None}
    assert sessions.keys() == read.keys()
    assert sessions["title"].title == "renamed"
    assert (sessions["usage"].prompt_tokens, sessions["usage"].cost) == (5, 0.5)
    assert [t.content for t in sessions["todos"].todos] == ["write the test"]
    assert sessions["summary"].summary_message_id == "sum"
    assert sessions["message"].message_count == 1
    assert (sessions["update"].title, sessions["update"].cost) == ("updated", 2.0)


async def test_a_deleted_message_sends_every_session_read_to_the_database(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message delete names no session, and it changes its session's message count."""
    await store.create_session(Session(id="fresh"))
    await store.create_session(Session(id="other"))
    await store.write_messages([Message(id="m", session_id="other", role=Role.USER)])
    assert await store.delete_message("m")
    calls = count_database_calls(store, monkeypatch)
    assert await store.get_session("fresh") == Session(id="fresh")
    assert len(calls) == 1


async def test_new_sessions_kept_in_memory_are_bounded(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sessions created and never used pin no more than ``FRESH_SESSIONS_KEPT`` rows: past it
    the oldest is read from the database again, with the same result."""
    monkeypatch.setattr(db_module, "FRESH_SESSIONS_KEPT", 2)
    for sid in ("a", "b", "c"):
        await store.create_session(Session(id=sid, title=sid))
    calls = count_database_calls(store, monkeypatch)
    for sid in ("b", "c"):
        assert await store.get_session(sid) == Session(id=sid, title=sid)
    assert calls == []
    assert await store.get_session("a") == Session(id="a", title="a")
    assert len(calls) == 1


def test_run_id_filter_never_forgets_and_rarely_guesses() -> None:
    ids = [str(uuid.uuid4()) for _ in range(5_000)]
    small = RunIdFilter(bits=1 << 16)
    for run_id in ids:
        small.add(run_id)
    assert all(run_id in small for run_id in ids)  # no false negatives, ever
    others = [str(uuid.uuid4()) for _ in range(5_000)]
    false_positives = sum(run_id in small for run_id in others)
    assert false_positives < len(others) * 0.05  # 5,000 ids in 64 Kibit: about 1%
    assert 42 not in small
    with pytest.raises(ValueError, match="power of two"):
        RunIdFilter(bits=1000)


async def test_used_run_ids_are_known_without_a_database_call_and_after_reopening(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.create_session(Session(id="s"))
    await store.save_runs([Run(run_id="saved", session_id="s", status=RunStatus.RUNNING)])
    await store.save_runs([Run(run_id="batched", session_id="s", status=RunStatus.QUEUED)])
    assert store.may_have_run("saved")
    assert store.may_have_run("batched")
    assert not store.may_have_run(str(uuid.uuid4()))

    await store.aclose()
    reopened = await Store.open(tmp_path / "data")
    try:
        assert reopened.may_have_run("saved")
        assert reopened.may_have_run("batched")
        assert not reopened.may_have_run(str(uuid.uuid4()))
    finally:
        await reopened.aclose()


async def test_database_files_are_created_private_whatever_the_umask(tmp_path: Path) -> None:
    """A workspace's database holds every prompt, reply and tool output, the outbox the run
    texts: they and their -wal/-shm files are 0600 even under a umask of 022."""
    import os
    import stat

    from crush_trio.webhooks.outbox import OUTBOX_FILENAME, OutboxFile

    old = os.umask(0o022)
    try:
        store = await Store.open(tmp_path / "data")
        outbox = await OutboxFile.open(tmp_path / "server" / OUTBOX_FILENAME)
        try:
            await store.create_session(Session(id="private"))  # writes the -wal file
            files = [
                path
                for folder in (tmp_path / "data", tmp_path / "server")
                for path in folder.iterdir()
                if path.name != ".gitignore"
            ]
            names = {p.name for p in files}
            assert {DB_FILENAME, f"{DB_FILENAME}-wal", f"{DB_FILENAME}-shm"} <= names
            assert {OUTBOX_FILENAME, f"{OUTBOX_FILENAME}-wal"} <= names
            for path in files:
                assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        finally:
            await outbox.aclose()
            await store.aclose()
    finally:
        os.umask(old)
