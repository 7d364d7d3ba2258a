"""The broker over an event log (cluster mode): events reach clients only after the log accepted
them, batched per publish window; resume past the replay buffer reads the log; a fenced log
closes the clients (1012) and tells the owner; a new owner continues the numbering."""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import orjson
import pytest
import trio
import trio.testing

from crush_trio.broker import (
    LOG_FENCED_REASON,
    LOG_UNAVAILABLE_REASON,
    Broker,
    ClientStream,
    Event,
)
from crush_trio.errors import WS_CLOSE_SERVICE_RESTART, CrushError
from crush_trio.eventlog import EventLog, EventLogError, EventRecord, Fenced, MemoryEventLog
from crush_trio.wire import AgentEvent, EventKind, RunComplete

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

#: Bound on each test's waits (seconds).
WAIT: Final = 10.0


def lossy(n: int, tag: str = "") -> AgentEvent:
    return AgentEvent("info", text=f"{tag}event {n}")


async def take(stream: ClientStream, count: int) -> list[Event]:
    """The next ``count`` events of ``stream``, waiting for each."""
    out = []
    for _ in range(count):
        out.append(await stream.receive.receive())
        stream.after_receive()
    return out


def drain(stream: ClientStream) -> list[Event]:
    out = []
    while True:
        try:
            out.append(stream.receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return out
        stream.after_receive()


def seqs(frames: Sequence[Event]) -> list[int]:
    return [f.seq for f in frames if f.type not in ("gap", "hello")]


def messages(frames: Sequence[Event]) -> list[str]:
    return [orjson.loads(f.text)["payload"]["payload"]["text"] for f in frames]


class GatedLog:
    """A log whose appends wait for :attr:`gate` (one append at a time), recording each batch's
    size; ``fail`` makes appends raise, ``lose_reply`` makes the next one land and raise."""

    def __init__(self, inner: EventLog) -> None:
        self.inner = inner
        self.gate = trio.Event()
        self.gate.set()
        self.batches: list[int] = []
        self.entered = trio.Event()
        self.fail: CrushError | None = None
        self.lose_reply = False

    async def append(self, batch: Sequence[EventRecord]) -> None:
        self.entered.set()
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        await self.inner.append(batch)
        self.batches.append(len(batch))
        if self.lose_reply:
            self.lose_reply = False
            raise EventLogError("connection lost before the reply")

    async def read(self, after_seq: int, limit: int) -> list[EventRecord]:
        return await self.inner.read(after_seq, limit)

    async def last_seq(self) -> int:
        return await self.inner.last_seq()

    async def first_seq(self) -> int:
        return await self.inner.first_seq()

    async def fence(self, epoch: int) -> None:
        await self.inner.fence(epoch)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.fixture
async def nursery() -> AsyncIterator[trio.Nursery]:
    async with trio.open_nursery() as nursery:
        yield nursery
        nursery.cancel_scope.cancel()


async def test_an_event_reaches_clients_only_after_the_log_accepted_it(
    nursery: trio.Nursery,
) -> None:
    log = GatedLog(MemoryEventLog())
    broker = Broker(log=log)
    await nursery.start(broker.write_log)
    client, _ = broker.subscribe()
    log.gate = trio.Event()
    broker.publish(lossy(1))
    await trio.testing.wait_all_tasks_blocked()
    assert drain(client) == []
    assert broker.durable_seq == 0
    assert broker.stats()["log_pending"] == 1
    assert broker.hello("w", "v").seq == 0  # clients are told only what they may have seen
    log.gate.set()
    await trio.testing.wait_all_tasks_blocked()
    assert seqs(drain(client)) == [1]
    assert await log.read(0, 10) == [(1, broker.replay[0].text.encode())]


async def test_events_published_during_an_append_go_in_the_next_batch(
    nursery: trio.Nursery,
) -> None:
    log = GatedLog(MemoryEventLog())
    broker = Broker(log=log)
    await nursery.start(broker.write_log)
    client, _ = broker.subscribe()
    log.gate = trio.Event()
    broker.publish(lossy(1))
    await log.entered.wait()  # the first append is in flight
    for n in range(2, 7):
        broker.publish(lossy(n))
    log.gate.set()
    await trio.testing.wait_all_tasks_blocked()
    assert log.batches == [1, 5]
    assert seqs(drain(client)) == [1, 2, 3, 4, 5, 6]
    assert broker.stats()["log_appends"] == 2


async def test_must_deliver_returns_after_the_append_and_keeps_order(
    nursery: trio.Nursery,
) -> None:
    log = GatedLog(MemoryEventLog())
    broker = Broker(log=log)
    await nursery.start(broker.write_log)
    client, _ = broker.subscribe()
    log.gate = trio.Event()
    returned = trio.Event()

    async def publish_terminal() -> None:
        await broker.publish_must_deliver(RunComplete("s", "r"), EventKind.CREATED)
        returned.set()

    broker.publish(lossy(1))
    nursery.start_soon(publish_terminal)
    await trio.testing.wait_all_tasks_blocked()
    broker.publish(lossy(3))
    assert not returned.is_set()
    log.gate.set()
    with trio.fail_after(WAIT):
        await returned.wait()
    await trio.testing.wait_all_tasks_blocked()
    frames = drain(client)
    assert [(f.seq, f.type) for f in frames] == [
        (1, "agent_event"),
        (2, "run_complete"),
        (3, "agent_event"),
    ]


async def test_must_deliver_to_a_full_client_holds_later_events_back(
    nursery: trio.Nursery,
) -> None:
    broker = Broker(log=MemoryEventLog(), client_queue_size=1)
    await nursery.start(broker.write_log)
    client, _ = broker.subscribe()
    broker.publish(lossy(1))
    await trio.testing.wait_all_tasks_blocked()  # the queue is full now
    nursery.start_soon(broker.publish_must_deliver, RunComplete("s", "r"), EventKind.CREATED)
    await trio.testing.wait_all_tasks_blocked()
    broker.publish(lossy(3))  # would overtake the terminal: dropped into the gap
    await trio.testing.wait_all_tasks_blocked()
    frames: list[Event] = []
    with trio.fail_after(WAIT):
        while len(frames) < 3:
            frames.append(await client.receive.receive())
            client.after_receive()
    assert [f.type for f in frames] == ["agent_event", "run_complete", "gap"]
    assert orjson.loads(frames[2].text)["payload"] == {"dropped": 1, "from_seq": 3, "to_seq": 3}


async def test_resume_past_the_replay_buffer_reads_the_log(nursery: trio.Nursery) -> None:
    broker = Broker(log=MemoryEventLog(max_events=8), replay_size=3)
    await nursery.start(broker.write_log)
    for n in range(1, 11):
        broker.publish(lossy(n))
    await trio.testing.wait_all_tasks_blocked()
    assert [e.seq for e in broker.replay] == [8, 9, 10]
    _, first = await broker.subscribe_resuming(since=4)
    assert seqs(first) == [5, 6, 7, 8, 9, 10]
    assert messages(first) == [f"event {n}" for n in range(5, 11)]
    assert "gap" not in [f.type for f in first]
    # Older than the log keeps: a gap, then everything kept.
    _, first = await broker.subscribe_resuming(since=0)
    assert first[0].type == "gap"
    assert orjson.loads(first[0].text)["payload"] == {"dropped": 2, "from_seq": 1, "to_seq": 2}
    assert seqs(first) == list(range(3, 11))
    _, first = await broker.subscribe_resuming(since=10)
    assert first == []


async def test_delta_changes_resume_from_the_log_in_both_forms(nursery: trio.Nursery) -> None:
    from crush_trio.wire import DeltaPartType, Message, MessageDelta, Role, TextPart

    broker = Broker(log=MemoryEventLog(), replay_size=1)
    await nursery.start(broker.write_log)
    snapshot_client, _ = broker.subscribe()  # snapshot forms get encoded
    message = Message("m", "s", Role.ASSISTANT, [TextPart("hi")])
    broker.publish_delta(MessageDelta("m", "s", 0, DeltaPartType.TEXT, 0, "hi"), message)
    broker.publish(lossy(2))
    await trio.testing.wait_all_tasks_blocked()
    _, deltas = await broker.subscribe_resuming(since=0, deltas=True)
    _, snapshots = await broker.subscribe_resuming(since=0, deltas=False)
    assert [f.type for f in deltas] == ["message_delta", "agent_event"]
    assert [f.type for f in snapshots] == ["message", "agent_event"]
    assert orjson.loads(snapshots[0].text)["payload"]["payload"]["id"] == "m"
    snapshot_client.close()


async def test_a_fenced_log_closes_the_clients_and_tells_the_owner(nursery: trio.Nursery) -> None:
    ring = MemoryEventLog()
    mine = ring.handle()
    await mine.fence(1)
    lost: list[CrushError] = []
    broker = Broker(log=mine, on_log_lost=lost.append)
    await nursery.start(broker.write_log)
    client, _ = broker.subscribe()
    broker.publish(lossy(1))
    await trio.testing.wait_all_tasks_blocked()
    assert seqs(drain(client)) == [1]
    await ring.handle().fence(2)  # a newer owner
    broker.publish(lossy(2, "after the fence: "))
    with trio.fail_after(WAIT):
        await client.killed.wait()
        # A must-deliver publish after the loss returns at once, delivered to nobody.
        await broker.publish_must_deliver(RunComplete("s", "r"), EventKind.CREATED)
    assert client.kill_code == WS_CLOSE_SERVICE_RESTART
    assert client.kill_reason == LOG_FENCED_REASON
    assert len(lost) == 1
    assert isinstance(lost[0], Fenced)
    assert drain(client) == []
    assert await ring.last_seq() == 1  # nothing after the fence landed
    with pytest.raises(trio.ClosedResourceError):
        broker.subscribe()


async def test_an_unavailable_log_is_given_up_after_the_append_timeout(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    log = GatedLog(MemoryEventLog())
    lost: list[CrushError] = []
    broker = Broker(log=log, log_append_timeout=3.0, on_log_lost=lost.append)
    await nursery.start(broker.write_log)
    client, _ = broker.subscribe()
    log.fail = EventLogError("connection refused")
    start = trio.current_time()
    broker.publish(lossy(1))
    with trio.fail_after(WAIT):
        await client.killed.wait()
    assert 3.0 <= trio.current_time() - start < 3.5
    assert isinstance(lost[0], EventLogError)
    assert "log_append_timeout" in str(lost[0])
    assert client.kill_reason == LOG_UNAVAILABLE_REASON
    assert drain(client) == []


async def test_an_append_whose_reply_was_lost_is_not_appended_twice(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    log = GatedLog(MemoryEventLog())
    broker = Broker(log=log)
    await nursery.start(broker.write_log)
    client, _ = broker.subscribe()
    log.lose_reply = True
    broker.publish(lossy(1))
    broker.publish(lossy(2))
    with trio.fail_after(WAIT):
        delivered = await take(client, 2)  # delivered once the log holds them
    assert log.batches == [2]
    assert seqs(delivered) == [1, 2]
    assert drain(client) == []
    assert broker.log_lost is None


async def test_close_appends_and_delivers_what_is_queued() -> None:
    log = GatedLog(MemoryEventLog())
    broker = Broker(log=log)
    async with trio.open_nursery() as nursery:
        await nursery.start(broker.write_log)
        client, _ = broker.subscribe()
        log.gate = trio.Event()
        broker.publish(lossy(1))
        await log.entered.wait()
        broker.publish(lossy(2))
        nursery.cancel_scope.cancel()  # the writer is cancelled mid-append
    log.gate.set()
    with trio.fail_after(WAIT):
        await broker.aclose()
    assert seqs(drain(client)) == [1, 2]
    assert [seq for seq, _ in await log.read(0, 10)] == [1, 2]


async def test_publishing_before_the_log_is_open_is_refused() -> None:
    with pytest.raises(RuntimeError, match="write_log"):
        Broker(log=MemoryEventLog()).publish(lossy(1))


async def test_old_and_new_owner_on_redis(redis_url: str) -> None:
    """Two owners of one workspace's Redis stream: the new owner continues the numbering, a
    client of it resuming with since=S gets S+1... in order with no gap, and what the old owner
    publishes after the fence reaches nobody."""
    from crush_trio.cluster.redislog import open_redis_logs

    async with open_redis_logs(redis_url) as logs, trio.open_nursery() as nursery:
        old_log = logs.log("ws-1")
        await old_log.fence(1)
        old_lost: list[CrushError] = []
        old = Broker(log=old_log, replay_size=4, on_log_lost=old_lost.append)
        await nursery.start(old.write_log)
        old_client, _ = old.subscribe()
        for n in range(1, 13):
            old.publish(lossy(n, "old "))
        await old.publish_must_deliver(RunComplete("s", "r1"), EventKind.CREATED)
        seen = drain(old_client)
        assert seqs(seen) == list(range(1, 14))
        since = seen[5].seq  # the client was at S = 6

        new_log = logs.log("ws-1")
        await new_log.fence(2)
        new = Broker(log=new_log, replay_size=4)
        await nursery.start(new.write_log)
        assert new.seq == new.durable_seq == 13

        old.publish(lossy(99, "old after the fence "))
        with trio.fail_after(WAIT):
            await old_client.killed.wait()
        assert old_client.kill_code == WS_CLOSE_SERVICE_RESTART
        assert isinstance(old_lost[0], Fenced)

        for n in range(14, 18):
            new.publish(lossy(n, "new "))
        await new.publish_must_deliver(RunComplete("s", "r2"), EventKind.CREATED)
        client, first = await new.subscribe_resuming(since=since)
        assert [f.type for f in first if f.type == "gap"] == []
        assert seqs(first) == list(range(since + 1, 19))
        texts = [f.text for f in first]
        assert not any("after the fence" in t for t in texts)
        assert sum('"run_complete"' in t for t in texts) == 2
        stored = await new_log.read(0, 100)
        assert [seq for seq, _ in stored] == list(range(1, 19))
        assert not any(b"after the fence" in data for _, data in stored)
        new.publish(lossy(19, "new "))
        with trio.fail_after(WAIT):
            frame = await client.receive.receive()
        assert frame.seq == 19
        nursery.cancel_scope.cancel()


async def test_a_resume_the_log_cannot_serve_gets_a_gap(nursery: trio.Nursery) -> None:
    class Unreadable(GatedLog):
        async def read(self, after_seq: int, limit: int) -> list[EventRecord]:
            raise EventLogError("connection refused")

    broker = Broker(log=Unreadable(MemoryEventLog()), replay_size=2)
    await nursery.start(broker.write_log)
    for n in range(1, 6):
        broker.publish(lossy(n))
    await trio.testing.wait_all_tasks_blocked()
    _, first = await broker.subscribe_resuming(since=1)
    assert first[0].type == "gap"
    assert orjson.loads(first[0].text)["payload"] == {"dropped": 2, "from_seq": 2, "to_seq": 3}
    assert seqs(first) == [4, 5]


async def test_a_resume_across_a_trimmed_log_skips_what_is_not_delivered_yet(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Past a hole the log read reaches appended events the writer has not delivered yet: they
    come live, once, not also among the resumed frames."""
    log = GatedLog(MemoryEventLog(max_events=6))
    broker = Broker(log=log, replay_size=2)
    await nursery.start(broker.write_log)
    for n in range(1, 11):
        broker.publish(lossy(n))
    await trio.testing.wait_all_tasks_blocked()  # the buffer keeps 9..10
    log.gate = trio.Event()
    for n in range(11, 13):
        broker.publish(lossy(n))
    await log.entered.wait()
    await log.inner.append(events_of(broker, 11, 12))  # landed; the writer has not seen it yet
    client, first = await broker.subscribe_resuming(since=2)
    assert first[0].type == "gap"
    assert seqs(first) == [7, 8, 9, 10]  # the log keeps 7..12
    log.gate.set()  # the writer's append: already there, reconciled by last_seq()
    with trio.fail_after(WAIT):
        delivered = await take(client, 2)
    assert seqs(delivered) == [11, 12]
    assert drain(client) == []


def events_of(broker: Broker, first: int, last: int) -> list[EventRecord]:
    from crush_trio.broker import log_record

    queued = broker._inflight + broker._pending
    return [(e.seq, log_record(e)) for e in queued if first <= e.seq <= last]


async def test_a_log_that_cannot_be_opened_names_the_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class Silent(GatedLog):
        async def last_seq(self) -> int:
            await trio.sleep_forever()
            raise AssertionError("unreachable")

    broker = Broker(log=Silent(MemoryEventLog()), log_append_timeout=2.0)
    with pytest.raises(EventLogError, match="log_append_timeout"):
        await broker.write_log()
