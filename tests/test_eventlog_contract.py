"""The event-log contract, run against every implementation: the in-memory ring and Redis Streams.

Each test gets ``open_log``: every call opens another handle on the same workspace's log, as two
nodes would (each handle has its own epoch, 0 until it fences).
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final

import pytest
import trio

from crush_trio.eventlog import EventLog, EventLogError, Fenced, MemoryEventLog

#: The replay bound the tests configure (events).
BOUND: Final = 20
#: Bound on each test's waits (seconds).
WAIT: Final = 10.0

OpenLog = Callable[[], Awaitable[EventLog]]


@pytest.fixture(params=["memory", "redis"])
async def open_log(request: pytest.FixtureRequest) -> AsyncIterator[OpenLog]:
    if request.param == "memory":
        ring = MemoryEventLog(max_events=BOUND)

        async def open_memory() -> EventLog:
            return ring.handle()

        yield open_memory
        return
    from crush_trio.cluster.redislog import open_redis_logs

    url = request.getfixturevalue("redis_url")
    async with open_redis_logs(url, max_events=BOUND) as logs:

        async def open_redis() -> EventLog:
            return logs.log("ws-contract")

        yield open_redis


def events(first: int, last: int) -> list[tuple[int, bytes]]:
    return [(seq, b'{"seq":%d,"type":"message"}' % seq) for seq in range(first, last + 1)]


async def test_append_then_read_in_order(open_log: OpenLog) -> None:
    log = await open_log()
    assert await log.last_seq() == 0
    assert await log.first_seq() == 1
    assert await log.read(0, 10) == []
    await log.append(events(1, 3))
    await log.append(events(4, 4))
    await log.append([])
    assert await log.read(0, 100) == events(1, 4)
    assert await log.read(1, 2) == events(2, 3)
    assert await log.read(4, 10) == []
    assert await log.last_seq() == 4
    assert await log.first_seq() == 1
    # Opaque bytes come back as they went in.
    await log.append([(5, b"\x00\xff\n{}")])
    assert await log.read(4, 1) == [(5, b"\x00\xff\n{}")]


async def test_append_out_of_order_lands_nothing(open_log: OpenLog) -> None:
    log = await open_log()
    await log.append(events(1, 3))
    with pytest.raises(EventLogError, match="not above"):
        await log.append(events(3, 5))
    with pytest.raises(EventLogError, match="not above"):
        await log.append([(7, b"x"), (6, b"y")])
    assert await log.read(0, 100) == events(1, 3)
    assert await log.last_seq() == 3


async def test_bound_trims_the_oldest(open_log: OpenLog) -> None:
    log = await open_log()
    for first in range(1, 500, 10):
        await log.append(events(first, first + 9))
    assert await log.last_seq() == 500
    first = await log.first_seq()
    assert first > 1, "nothing was trimmed"
    kept = await log.read(0, 10_000)
    # At least the bound is kept (Redis trims in whole stream nodes, so it may keep more), and
    # what is kept is the newest events with no hole.
    assert len(kept) >= BOUND
    assert kept == events(first, 500)
    assert await log.read(first - 1, 1) == events(first, first)


async def test_fence_is_monotonic(open_log: OpenLog) -> None:
    old, new, late = await open_log(), await open_log(), await open_log()
    await old.fence(1)
    await old.append(events(1, 2))
    await new.fence(2)
    await new.fence(2)  # claiming again with the current epoch is allowed
    with pytest.raises(Fenced):
        await old.append(events(3, 3))
    with pytest.raises(Fenced):
        await old.fence(1)  # an older epoch cannot take the log back
    with pytest.raises(Fenced):
        await late.fence(1)
    with pytest.raises(Fenced):
        await late.append(events(3, 3))  # never fenced: epoch 0
    await new.append(events(3, 3))
    assert await new.read(0, 10) == events(1, 3)


async def test_fenced_append_lands_nothing(open_log: OpenLog) -> None:
    old, new = await open_log(), await open_log()
    await old.fence(7)
    await old.append(events(1, 5))
    await new.fence(8)
    with pytest.raises(Fenced, match="epoch 8"):
        await old.append(events(6, 9))
    assert await new.last_seq() == 5
    assert await new.read(0, 100) == events(1, 5)


async def test_fence_is_atomic_with_appends(open_log: OpenLog) -> None:
    """Appends racing a fence: every append that returned landed whole, every one that raised
    landed nothing, and none lands once the fence returned."""
    old, new = await open_log(), await open_log()
    await old.fence(1)
    landed: list[int] = []
    refused: list[int] = []
    fenced_at: list[int] = []
    some_landed = trio.Event()

    async def writer() -> None:
        seq = 1
        while True:
            batch = events(seq, seq + 2)
            try:
                await old.append(batch)
            except Fenced:
                refused.append(seq)
                return
            landed.append(seq)
            if len(landed) == 5:
                some_landed.set()
            seq += 3

    async def fencer() -> None:
        await some_landed.wait()
        await new.fence(2)
        fenced_at.append(await new.last_seq())

    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            nursery.start_soon(fencer)
    assert refused, "the writer was never fenced"
    last = landed[-1] + 2
    assert await new.last_seq() == last == fenced_at[0]
    assert [seq for seq, _ in await new.read(0, 10_000)][-last:] == list(range(1, last + 1))[
        -BOUND:
    ]


async def test_new_owner_continues_from_last_seq(open_log: OpenLog) -> None:
    """Resume across owners: the new owner fences, continues numbering from last_seq(), and a
    reader that was at S reads S+1... in order with no hole across the hand-over."""
    old = await open_log()
    await old.fence(1)
    await old.append(events(1, 6))
    new = await open_log()
    await new.fence(2)
    last = await new.last_seq()
    assert last == 6
    await new.append(events(last + 1, last + 4))
    with pytest.raises(Fenced):
        await old.append(events(11, 11))
    reader = await open_log()
    assert await reader.read(3, 100) == events(4, 10)


async def test_memory_log_byte_bound() -> None:
    log = MemoryEventLog(max_events=100, max_bytes=10)
    await log.append([(1, b"aaaa"), (2, b"bbbb")])
    await log.append([(3, b"cccc")])
    assert await log.read(0, 10) == [(2, b"bbbb"), (3, b"cccc")]
    await log.append([(4, b"x" * 50)])  # larger than the bound: kept alone
    assert await log.read(0, 10) == [(4, b"x" * 50)]
    assert await log.first_seq() == 4


async def test_redis_stream_id_is_the_seq(redis_url: str) -> None:
    from crush_trio.cluster.redislog import open_redis_logs, stream_key

    async with open_redis_logs(redis_url, max_events=BOUND) as logs:
        log = logs.log("ws-ids")
        await log.fence(3)
        await log.append(events(41, 43))
        entries = await logs.client.xrange(stream_key("ws-ids"))
        assert [e.identifier for e in entries] == [b"41-0", b"42-0", b"43-0"]
        assert entries[0].field_values == {b"e": events(41, 41)[0][1]}
        assert await logs.client.get("crush_trio:ws:{ws-ids}:epoch") == b"3"


# coredis leaves the memory streams of a connection that never connected to the collector.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_redis_unreachable_names_the_url() -> None:
    from crush_trio.cluster.redislog import open_redis_logs
    from tests.services import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    with trio.fail_after(WAIT), pytest.raises(EventLogError, match="cannot reach Redis at"):
        async with open_redis_logs(url):
            pass
    gc.collect()  # here, where the warning is ignored
