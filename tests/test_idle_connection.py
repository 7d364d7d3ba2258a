"""What an idle event stream keeps is made on demand: a client's queue that drained takes events
again in order, a cleared one too, and the connection's containment still logs, closes and lets
cancellation through (docs/performance.md, W4)."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from crush_trio.broker import Broker, ClientStream, Event
from crush_trio.server.listener import contained
from crush_trio.wire import AgentEvent


def lossy(n: int) -> AgentEvent:
    return AgentEvent("info", text=f"event {n}")


def drain(stream: ClientStream) -> list[Event]:
    out = []
    while True:
        try:
            out.append(stream.receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return out
        stream.after_receive()


async def test_a_queue_that_drained_takes_events_again_in_order() -> None:
    broker = Broker(client_queue_size=3)
    stream, _ = broker.subscribe()
    assert len(stream.receive) == 0
    assert stream.receive.bytes == 0
    for round_ in range(3):
        for n in range(3):
            broker.publish(lossy(10 * round_ + n))
        assert len(stream.receive) == 3
        assert stream.receive.full
        got = drain(stream)
        assert [e.seq for e in got] == [3 * round_ + n + 1 for n in range(3)]
        assert len(stream.receive) == 0
        assert stream.receive.bytes == 0
    assert stream.dropped == 0


async def test_a_cleared_queue_takes_events_again() -> None:
    broker = Broker()
    stream, _ = broker.subscribe()
    broker.publish(lossy(1))
    broker.publish(lossy(2))
    stream.clear()
    assert len(stream.receive) == 0
    assert stream.receive.bytes == 0
    with pytest.raises(trio.WouldBlock):
        stream.receive.receive_nowait()
    broker.publish(lossy(3))
    assert [e.seq for e in drain(stream)] == [3]


async def test_a_waiting_reader_wakes_for_the_first_event() -> None:
    broker = Broker()
    stream, _ = broker.subscribe()
    got: list[Event] = []
    async with trio.open_nursery() as nursery:

        async def read() -> None:
            got.append(await stream.receive.receive())

        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        broker.publish(lossy(1))
    assert [e.seq for e in got] == [1]


async def test_a_closed_empty_queue_ends() -> None:
    broker = Broker()
    stream, _ = broker.subscribe()
    stream.close()
    with pytest.raises(trio.EndOfChannel):
        await stream.receive.receive()


async def test_containment_logs_an_error_closes_the_stream_and_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    _, right = trio.testing.memory_stream_pair()
    async with contained(right, "event websocket"):
        raise ExceptionGroup("handler", [ValueError("bad frame")])
    with pytest.raises(trio.ClosedResourceError):
        await right.send_all(b"x")
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 1
    assert "event websocket from" in messages[0]
    assert "ValueError: bad frame" in messages[0]


async def test_containment_lets_a_cancellation_inside_a_group_through() -> None:
    _, right = trio.testing.memory_stream_pair()
    with trio.CancelScope() as scope:
        async with contained(right), trio.open_nursery() as nursery:
            nursery.start_soon(trio.sleep_forever)
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    with pytest.raises(trio.ClosedResourceError):
        await right.send_all(b"x")
