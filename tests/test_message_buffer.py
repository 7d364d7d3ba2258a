"""The message service: throttled events, batched writes, terminal flushes, flush_all, deletes.

Timing tests use ``autojump_clock`` with an in-memory store (no threads, so virtual time only
moves when every task waits on the clock). Persistence tests use the real :class:`Store` with a
debounce window long enough that the flusher never fires on its own.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing

from crush_trio.errors import StoreError
from crush_trio.store import DEBOUNCE_SECONDS, MessageService, Store
from crush_trio.store.messages import WRITE_WINDOW_SECONDS, Shape, is_terminal_change, shape_of
from crush_trio.wire import (
    EventKind,
    FinishPart,
    FinishReason,
    Message,
    Part,
    ReasoningPart,
    Role,
    Session,
    TextPart,
    ToolCallPart,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable, Iterator
    from pathlib import Path

#: Trio-clock cap for each test's waits.
TEST_TIMEOUT = 10

#: A window the flusher never reaches within a test, for tests that drive writes by hand.
NEVER = 3600.0


class FakeStore:
    """An in-memory MessageStore that records every batch and can hold a write at its start."""

    def __init__(self) -> None:
        self.sessions: set[str] = {"s"}
        self.rows: dict[str, str] = {}  # id -> text at the time it was written
        self.batches: list[list[tuple[str, str]]] = []  # (id, text) per write
        self.write_times: list[float] = []
        self.gate: trio.Event | None = None
        self.write_started = trio.Event()
        self.fail: StoreError | None = None

    async def write_messages(self, messages: Iterable[Message]) -> set[str]:
        batch = list(messages)
        self.write_started.set()
        if self.gate is not None:
            await self.gate.wait()
        else:
            await trio.lowlevel.checkpoint()
        if self.fail is not None:
            raise self.fail
        self.batches.append([(m.id, m.text()) for m in batch])
        self.write_times.append(trio.current_time())
        written = {m.id for m in batch if m.session_id in self.sessions}
        for m in batch:
            if m.id in written:
                self.rows[m.id] = m.text()
        return written


class Recorder:
    """The publish callback: records (kind, id, text) in call order."""

    def __init__(self) -> None:
        self.events: list[tuple[EventKind, str, str]] = []

    def __call__(self, message: Message, kind: EventKind) -> None:
        self.events.append((kind, message.id, message.text()))


def msg(mid: str = "m", *parts: Part, session_id: str = "s") -> Message:
    return Message(id=mid, session_id=session_id, role=Role.ASSISTANT, parts=list(parts))


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    s = await Store.open(tmp_path / "data")
    try:
        yield s
    finally:
        await s.aclose()


# ---------------------------------------------------------------------------------------------
# Terminal-change rules (no I/O)


def test_default_windows() -> None:
    assert DEBOUNCE_SECONDS == 0.033  # Crush's publish window: one frame
    assert WRITE_WINDOW_SECONDS > DEBOUNCE_SECONDS


@pytest.mark.parametrize(
    ("before", "after", "terminal"),
    [
        (msg("m", TextPart("a")), msg("m", TextPart("ab")), False),
        (msg("m"), msg("m", ReasoningPart(thinking="x")), False),
        (msg("m", ReasoningPart()), msg("m", ReasoningPart(finished_at=5)), True),
        (msg("m"), msg("m", ToolCallPart(id="t", name="bash")), True),
        (
            msg("m", ToolCallPart(id="t", name="bash")),
            msg("m", ToolCallPart(id="t", name="bash", input='{"a"')),
            False,
        ),
        (
            msg("m", ToolCallPart(id="t", name="bash")),
            msg("m", ToolCallPart(id="t", name="bash", finished=True)),
            True,
        ),
        (msg("m", TextPart("a")), msg("m", TextPart("a"), FinishPart(FinishReason.END_TURN)), True),
    ],
)
def test_is_terminal_change(before: Message, after: Message, terminal: bool) -> None:
    assert is_terminal_change(shape_of(before), shape_of(after)) is terminal


def test_first_update_is_compared_with_an_empty_message() -> None:
    assert not is_terminal_change(None, shape_of(msg("m", TextPart("hi"))))
    assert is_terminal_change(None, shape_of(msg("m", FinishPart(FinishReason.CANCELED))))
    assert shape_of(msg("m")) == Shape(finished=False, tool_calls=(), reasoning_finished=0)


def test_negative_windows_are_refused() -> None:
    with pytest.raises(ValueError, match="debounce"):
        MessageService(FakeStore(), Recorder(), debounce=-1)
    with pytest.raises(ValueError, match="write_window"):
        MessageService(FakeStore(), Recorder(), write_window=float("nan"))


# ---------------------------------------------------------------------------------------------
# Debouncing (virtual time)


async def test_many_updates_in_one_window_make_one_event_and_one_write(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A message's first update goes out at once (its ``created`` starts no window); the 29
    after it, inside the window that first event starts, go out together when it ends."""
    fake, published = FakeStore(), Recorder()
    service = MessageService(fake, published)
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            message = msg("m", TextPart(""))
            await service.create(message)
            start = trio.current_time()
            for i in range(30):  # 30 updates over 29 ms: all inside one 33 ms window
                message.parts = [TextPart("x" * (i + 1))]
                await service.update(message)
                await trio.sleep(0.001)  # virtual time (autojump_clock)
            assert published.events == [(EventKind.CREATED, "m", ""), (EventKind.UPDATED, "m", "x")]
            await trio.sleep(DEBOUNCE_SECONDS)
            # Published from memory when the window since the first words ended...
            assert published.events[2:] == [(EventKind.UPDATED, "m", "x" * 30)]
            assert fake.batches == []  # ...and not written yet
            assert service.pending_count == 1
            await trio.sleep(WRITE_WINDOW_SECONDS)
            nursery.cancel_scope.cancel()

    assert fake.batches == [[("m", "x" * 30)]]
    assert fake.write_times[0] == pytest.approx(start + WRITE_WINDOW_SECONDS)
    assert service.flush_count == 1
    assert len(published.events) == 3  # the write publishes nothing new
    assert service.publish_count == 2
    assert service.peak_pending == 1
    assert service.pending_count == 0


async def test_update_after_a_quiet_window_is_published_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The first words of a reply are not held back by the window (leading edge)."""
    fake, published = FakeStore(), Recorder()
    service = MessageService(fake, published)
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            message = msg("m")
            await service.create(message)
            await trio.sleep(DEBOUNCE_SECONDS * 2)  # the model is slow to start
            message.parts = [TextPart("Hello")]
            await service.update(message)
            assert published.events[-1] == (EventKind.UPDATED, "m", "Hello")  # no wait at all
            message.parts = [TextPart("Hello, world")]
            await service.update(message)  # inside the window of the event just sent
            assert published.events[-1] == (EventKind.UPDATED, "m", "Hello")
            sent = trio.current_time()
            await trio.sleep(DEBOUNCE_SECONDS / 2)
            assert published.events[-1] == (EventKind.UPDATED, "m", "Hello")
            await trio.sleep(DEBOUNCE_SECONDS)  # past the end of the window
            assert published.events[-1] == (EventKind.UPDATED, "m", "Hello, world")
            nursery.cancel_scope.cancel()
    assert service.publish_count == 2
    assert sent + DEBOUNCE_SECONDS <= trio.current_time()


async def test_steady_stream_is_published_once_per_window_and_written_once_per_write_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Windows start at the first change; later changes do not push them back."""
    fake, published = FakeStore(), Recorder()
    service = MessageService(fake, published)
    times: list[float] = []
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            message = msg("m")
            start = trio.current_time()
            for i in range(300):  # one update every 2 ms for 600 ms
                message.parts = [TextPart(str(i))]
                before = len(published.events)
                await service.update(message)
                await trio.sleep(0.002)  # virtual time (autojump_clock)
                times += [trio.current_time()] * (len(published.events) - before)
            await trio.sleep(WRITE_WINDOW_SECONDS)
            nursery.cancel_scope.cancel()

    elapsed = 0.6
    assert elapsed / DEBOUNCE_SECONDS - 1 <= len(published.events) <= elapsed / DEBOUNCE_SECONDS + 2
    assert published.events[-1] == (EventKind.UPDATED, "m", "299")
    gaps = [b - a for a, b in zip(fake.write_times, fake.write_times[1:], strict=False)]
    assert 2 <= len(fake.batches) <= 4  # 600 ms / 250 ms, plus the tail
    assert all(gap >= WRITE_WINDOW_SECONDS - 1e-9 for gap in gaps)
    assert fake.write_times[0] == pytest.approx(start + WRITE_WINDOW_SECONDS)
    assert fake.rows["m"] == "299"


async def test_messages_due_in_the_same_window_share_one_write(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = FakeStore()
    service = MessageService(fake, Recorder())
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            for mid in ("a", "b", "c"):
                await service.update(msg(mid, TextPart(mid)))
            assert service.peak_pending == 3
            await trio.sleep(WRITE_WINDOW_SECONDS * 2)
            nursery.cancel_scope.cancel()
    assert fake.batches == [[("a", "a"), ("b", "b"), ("c", "c")]]


# ---------------------------------------------------------------------------------------------
# Terminal changes


@pytest.mark.parametrize(
    ("baseline", "terminal"),
    [
        (msg("m", TextPart("a")), msg("m", TextPart("ab"), FinishPart(FinishReason.END_TURN))),
        (msg("m", TextPart("a")), msg("m", TextPart("a"), ToolCallPart(id="t", name="ls"))),
        (
            msg("m", ToolCallPart(id="t", name="ls")),
            msg("m", ToolCallPart(id="t", name="ls", input="{}", finished=True)),
        ),
        (
            msg("m", ReasoningPart(thinking="th")),
            msg("m", ReasoningPart(thinking="think", finished_at=3)),
        ),
    ],
    ids=["finish", "tool-call-added", "tool-call-finished", "reasoning-finished"],
)
async def test_terminal_change_is_written_and_published_at_once(
    baseline: Message, terminal: Message
) -> None:
    fake, published = FakeStore(), Recorder()
    service = MessageService(fake, published, debounce=NEVER)  # no flusher: only terminal writes
    await service.update(baseline)
    await service.flush("m")
    fake.batches.clear()
    published.events.clear()

    await service.update(msg("m", *baseline.parts, TextPart("delta")))
    assert fake.batches == []  # an ordinary delta waits for the window
    await service.update(terminal)

    assert fake.batches == [[("m", terminal.text())]]
    assert published.events == [(EventKind.UPDATED, "m", terminal.text())]
    assert service.pending_count == 0


async def test_update_after_finish_is_still_written_at_once() -> None:
    """A finished message keeps no baseline, so a later change to it is not left pending."""
    fake = FakeStore()
    service = MessageService(fake, Recorder(), debounce=NEVER)
    done = msg("m", TextPart("a"), FinishPart(FinishReason.END_TURN))
    await service.update(done)
    done.parts[0] = TextPart("a, corrected")
    await service.update(done)
    assert [b[0][1] for b in fake.batches] == ["a", "a, corrected"]


# ---------------------------------------------------------------------------------------------
# flush / flush_all with the real store


async def test_flush_writes_pending_rows_in_creation_order(store: Store) -> None:
    await store.create_session(Session(id="s"))
    service = MessageService(store, Recorder(), debounce=NEVER)
    await service.create(msg("b"))
    await service.create(msg("a"))
    assert await store.get_message("a") is None  # creation is batched, not a round trip
    await service.update(msg("a", TextPart("A")))
    await service.flush("a")
    assert [m.id for m in await store.list_messages("s")] == ["b", "a"]
    a = await store.get_message("a")
    assert a is not None
    assert a.text() == "A"
    assert service.pending_count == 0


async def test_flush_all_persists_latest_state_after_flusher_cancelled_inside_shield(
    store: Store,
) -> None:
    await store.create_session(Session(id="s"))
    published = Recorder()
    service = MessageService(store, published, debounce=NEVER)
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            for mid in ("a", "b"):
                await service.create(msg(mid))
                for text in ("1", "12", "123"):
                    await service.update(msg(mid, TextPart(mid + text)))
            await service.update(msg("new", TextPart("never created")))
            # Shutdown: the owner's scope is cancelled, then the final save runs shielded.
            nursery.cancel_scope.cancel()
            with trio.move_on_after(TEST_TIMEOUT, shield=True) as save:
                await service.flush_all()
            assert not save.cancelled_caught

    assert [(m.id, m.text()) for m in await store.list_messages("s")] == [
        ("a", "a123"),
        ("b", "b123"),
        ("new", "never created"),
    ]
    assert service.flush_count == 1  # one transaction for the whole drain
    assert service.pending_count == 0
    latest = {mid: text for kind, mid, text in published.events if kind is EventKind.UPDATED}
    assert latest == {"a": "a123", "b": "b123", "new": "never created"}


async def test_publish_order_created_then_updated(store: Store) -> None:
    await store.create_session(Session(id="s"))
    published = Recorder()
    service = MessageService(store, published, debounce=NEVER)
    await service.create(msg("m", TextPart("")))
    await service.update(msg("m", TextPart("hi")))
    await service.flush_all()
    await service.update(msg("m", TextPart("hi there"), FinishPart(FinishReason.END_TURN)))
    await service.flush_all()  # nothing left: publishes nothing
    assert published.events == [
        (EventKind.CREATED, "m", ""),
        (EventKind.UPDATED, "m", "hi"),
        (EventKind.UPDATED, "m", "hi there"),
    ]


async def test_flush_all_waits_for_the_write_in_flight() -> None:
    fake = FakeStore()
    service = MessageService(fake, Recorder(), debounce=NEVER)
    fake.gate = trio.Event()
    await service.update(msg("a", TextPart("a1")))
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.flush, "a")
            await fake.write_started.wait()
            await service.update(msg("a", TextPart("a2")))  # arrives during the write
            flushed = trio.Event()

            async def flush_all() -> None:
                await service.flush_all()
                flushed.set()

            nursery.start_soon(flush_all)
            await trio.testing.wait_all_tasks_blocked()
            assert not flushed.is_set()
            fake.gate.set()
    assert fake.batches == [[("a", "a1")], [("a", "a2")]]


async def test_cancel_before_the_write_starts_keeps_state_pending() -> None:
    fake = FakeStore()
    published = Recorder()
    service = MessageService(fake, published, debounce=NEVER)
    fake.gate = trio.Event()
    await service.create(msg("a"))
    await service.update(msg("a", TextPart("a0")))  # the first words: published at once
    await service.update(msg("a", TextPart("a1")))  # inside the window of that event
    with trio.fail_after(TEST_TIMEOUT):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(service.flush_all)
                await fake.write_started.wait()
                scope.cancel()
    assert fake.batches == []
    assert published.events == [(EventKind.CREATED, "a", ""), (EventKind.UPDATED, "a", "a0")]
    assert service.pending_count == 1

    fake.gate = None
    await service.flush_all()
    assert fake.batches == [[("a", "a1")]]


async def test_newer_state_wins_over_a_restored_batch() -> None:
    fake = FakeStore()
    service = MessageService(fake, Recorder(), debounce=NEVER)
    fake.gate = trio.Event()
    await service.update(msg("a", TextPart("old")))
    with trio.fail_after(TEST_TIMEOUT):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(service.flush_all)
                await fake.write_started.wait()
                await service.update(msg("a", TextPart("new")))
                scope.cancel()
    fake.gate = None
    await service.flush_all()
    assert fake.batches == [[("a", "new")]]


async def test_failed_flush_raises_and_keeps_state_pending() -> None:
    fake = FakeStore()
    service = MessageService(fake, Recorder(), debounce=NEVER)
    fake.fail = StoreError("disk broke")
    await service.update(msg("a", TextPart("a")))
    with pytest.raises(StoreError, match="disk broke"):
        await service.flush_all()
    assert service.pending_count == 1
    fake.fail = None
    await service.flush_all()
    assert fake.rows == {"a": "a"}


async def test_flusher_survives_a_store_error_and_retries(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeStore()
    service = MessageService(fake, Recorder())
    fake.fail = StoreError("store is closed")
    with trio.fail_after(TEST_TIMEOUT), caplog.at_level(logging.ERROR):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            await service.update(msg("a", TextPart("a")))
            await trio.sleep(WRITE_WINDOW_SECONDS * 2)
            assert service.write_errors == 1
            assert service.pending_count == 1
            fake.fail = None
            await trio.sleep(2)  # past the retry delay and one more window
            nursery.cancel_scope.cancel()
    assert fake.rows == {"a": "a"}
    assert "store is closed" in caplog.text


async def test_run_cannot_be_started_twice() -> None:
    service = MessageService(FakeStore(), Recorder())
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            with pytest.raises(RuntimeError, match="already running"):
                await service.run()
            nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------------------------
# Deletes must not be undone by a late flush


async def test_deleted_session_is_not_resurrected_by_a_late_flush(store: Store) -> None:
    await store.create_session(Session(id="s"))
    await store.create_session(Session(id="other"))
    published = Recorder()
    service = MessageService(store, published, debounce=NEVER)
    await service.create(msg("m"))
    await service.create(msg("o", session_id="other"))
    await service.update(msg("m", TextPart("first")))  # published at once
    await service.update(msg("o", TextPart("first"), session_id="other"))
    await service.update(msg("m", TextPart("pending")))  # held for the window
    await service.update(msg("o", TextPart("kept"), session_id="other"))

    await service.delete_session_messages("s")
    assert await store.delete_session("s")
    await service.flush_all()

    assert await store.get_session("s") is None
    assert await store.get_message("m") is None
    kept = await store.get_message("o")
    assert kept is not None
    assert kept.text() == "kept"
    assert (EventKind.UPDATED, "m", "pending") not in published.events


async def test_store_skips_late_write_even_without_delete_session_messages(store: Store) -> None:
    await store.create_session(Session(id="s"))
    published = Recorder()
    service = MessageService(store, published, debounce=NEVER)
    await service.create(msg("m"))
    await service.update(msg("m", TextPart("first")))  # published at once
    await service.update(msg("m", TextPart("pending")))  # held for the window
    assert await store.delete_session("s")
    await service.flush_all()
    assert await store.get_message("m") is None
    assert published.events == [(EventKind.CREATED, "m", ""), (EventKind.UPDATED, "m", "first")]


async def test_forget_drops_pending_state(store: Store) -> None:
    await store.create_session(Session(id="s"))
    service = MessageService(store, Recorder(), debounce=NEVER)
    await service.create(msg("m", TextPart("created")))
    await service.flush_all()
    await service.update(msg("m", TextPart("pending")))
    await service.forget("m")
    await service.flush_all()
    stored = await store.get_message("m")
    assert stored is not None
    assert stored.text() == "created"
    assert service.flush_count == 1


async def test_forget_waits_for_the_write_in_flight_and_suppresses_its_event() -> None:
    fake = FakeStore()
    published = Recorder()
    service = MessageService(fake, published, debounce=NEVER)
    fake.gate = trio.Event()
    for mid in ("a", "b"):
        await service.create(msg(mid))
        await service.update(msg(mid, TextPart("first")))  # published at once
        await service.update(msg(mid, TextPart(mid)))  # held: published once written
    published.events.clear()
    forgotten = trio.Event()
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.flush_all)
            await fake.write_started.wait()

            async def forget() -> None:
                await service.forget("a")
                forgotten.set()

            nursery.start_soon(forget)
            await trio.testing.wait_all_tasks_blocked()
            assert not forgotten.is_set()  # the caller may delete the row only after this
            fake.gate.set()
    assert forgotten.is_set()
    assert published.events == [(EventKind.UPDATED, "b", "b")]


async def test_caller_may_keep_mutating_the_same_message_object(store: Store) -> None:
    """The row is encoded when written, so in-place edits between updates are captured."""
    await store.create_session(Session(id="s"))
    service = MessageService(store, Recorder(), debounce=NEVER)
    message = msg("m", TextPart(""))
    await service.create(message)
    for chunk in ("a", "b", "c"):
        message.parts[0] = TextPart(message.text() + chunk)
        await service.update(message)
    await service.flush_all()
    stored = await store.get_message("m")
    assert stored is not None
    assert stored.text() == "abc"


async def test_flush_session_writes_only_when_that_session_has_unwritten_state() -> None:
    fake = FakeStore()
    fake.sessions.add("other")
    service = MessageService(fake, Recorder(), debounce=NEVER)
    await service.update(msg("o", TextPart("streaming"), session_id="other"))

    await service.flush_session("s")  # nothing of "s" is pending: no write at all
    assert fake.batches == []
    assert service.pending_count == 1

    await service.update(msg("m", TextPart("mine")))
    await service.flush_session("s")  # everything pending goes, in creation order
    assert fake.batches == [[("o", "streaming"), ("m", "mine")]]


async def test_flush_session_waits_for_a_write_in_flight_of_that_session() -> None:
    fake = FakeStore()
    service = MessageService(fake, Recorder(), debounce=NEVER)
    fake.gate = trio.Event()
    await service.update(msg("m", TextPart("mine")))
    flushed = trio.Event()

    async def flush_session() -> None:
        await service.flush_session("s")
        flushed.set()

    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.flush_all)
            await fake.write_started.wait()
            nursery.start_soon(flush_session)
            await trio.testing.wait_all_tasks_blocked()
            assert not flushed.is_set()  # a listing now could miss the row being written
            fake.gate.set()
    assert flushed.is_set()
    assert fake.rows == {"m": "mine"}


class Batches:
    """The ``batch`` callback: records which publishes happened inside which batch, and when."""

    def __init__(self, published: Recorder) -> None:
        self.published = published
        #: (trio time, ids published) per batch that published something.
        self.batches: list[tuple[float, list[str]]] = []

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        before = len(self.published.events)
        yield
        ids = [mid for _, mid, _ in self.published.events[before:]]
        if ids:
            self.batches.append((trio.current_time(), ids))


async def test_windows_that_end_close_together_are_published_together_in_one_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A window ending within half a window of an earlier one ends with it: the streams fall
    into step, and one wake of the flusher publishes them all (one write per client)."""
    fake, published = FakeStore(), Recorder()
    batches = Batches(published)
    service = MessageService(fake, published, write_window=NEVER, batch=batches)
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            start = trio.current_time()
            messages = {}
            for mid, at in (("a", 0.0), ("b", 0.010), ("c", 0.020)):
                await trio.sleep_until(start + at)
                messages[mid] = message = msg(mid)
                await service.create(message)
                message.parts = [TextPart("w")]
                await service.update(message)  # published at once: its window starts now
                message.parts = [TextPart("x")]
                await service.update(message)  # held for the end of the window
            # a's window ends at 33 ms, b's at 43 (within half a window: ends with a's), c's
            # at 53 (not within it).
            await trio.sleep_until(start + DEBOUNCE_SECONDS + 0.001)
            assert batches.batches == [(pytest.approx(start + DEBOUNCE_SECONDS), ["a", "b"])]
            await trio.sleep_until(start + 0.020 + DEBOUNCE_SECONDS + 0.001)
            assert batches.batches[1] == (pytest.approx(start + 0.020 + DEBOUNCE_SECONDS), ["c"])
            # In step from now on: a and b's next windows end together.
            for mid in ("a", "b"):
                messages[mid].parts = [TextPart("xy")]
                await service.update(messages[mid])
            await trio.sleep_until(start + 2 * DEBOUNCE_SECONDS + 0.001)
            assert batches.batches[2] == (pytest.approx(start + 2 * DEBOUNCE_SECONDS), ["a", "b"])
            nursery.cancel_scope.cancel()
    assert len(batches.batches) == 3


class TaskSteps(trio.abc.Instrument):
    """Counts the steps of the tasks whose name ends with ``suffix``."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith(self.suffix):
            self.steps += 1


async def test_a_later_deadline_does_not_wake_the_flusher(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An update held for its window wakes the flusher only when that window ends before the
    flusher's next deadline. Five streams in step, each updated at its own moment: the flusher
    steps about twice a window (its deadline, and the first update held after it), not once per
    stream's update."""
    fake, published = FakeStore(), Recorder()
    service = MessageService(fake, published, write_window=NEVER)
    steps = TaskSteps("MessageService.run")
    windows = 20
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            messages = [msg(f"m{i}") for i in range(5)]
            for message in messages:
                await service.create(message)  # their windows start together
            trio.lowlevel.add_instrument(steps)
            try:
                end = trio.current_time() + windows * DEBOUNCE_SECONDS
                while trio.current_time() < end:
                    for message in messages:
                        await trio.sleep(0.001)  # virtual time (autojump_clock)
                        message.parts = [TextPart(message.text() + "x")]
                        await service.update(message)
                await trio.sleep(DEBOUNCE_SECONDS)
            finally:
                trio.lowlevel.remove_instrument(steps)
            nursery.cancel_scope.cancel()
    for message in messages:
        assert (EventKind.UPDATED, message.id, message.text()) in published.events
    assert service.publish_count == pytest.approx(5 * windows, abs=10)
    assert steps.steps <= 2 * windows + 3
