"""Frames that many tasks publish in one round of the event loop go out in two writes per client:
the first at once, the rest when the broker's tick ends (:meth:`Broker.coalesce_ticks`).

The connection is :func:`serve_connection` against a real broker and the scripted socket of
:mod:`tests.test_on_demand_writer`, which records each direct write and the frames it carried.
Every wait is bounded and time is the autojump clock's.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio
import trio.testing

from crush_trio.broker import Event

from .conftest import WAIT, running_server
from .test_on_demand_writer import CAP, Served, lossy, seq_of, serve

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable
    from pathlib import Path

    from crush_trio.broker import Broker


async def ticking(nursery: trio.Nursery, *served: Served) -> trio.CancelScope:
    """Start the ticks of the connections' broker in a scope of their own, and forget the
    connections' writes so far; returns the scope."""

    async def run(*, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            await served[0].broker.coalesce_ticks()

    scope: trio.CancelScope = await nursery.start(run)
    await trio.testing.wait_all_tasks_blocked()
    for one in served:
        one.sock.direct_writes.clear()
    return scope


@asynccontextmanager
async def one_ticking() -> AsyncIterator[Served]:
    """One connection served, its broker's ticks running, within the test's bound."""
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            c = await serve(nursery)
            await ticking(nursery, c)
            yield c
            nursery.cancel_scope.cancel()


def seqs(served: Served) -> list[int]:
    return [seq_of(frame) for frame in served.sock.wire[1:]]  # (after hello)


def publish(broker: Broker, numbers: Iterable[int]) -> None:
    for n in numbers:
        broker.publish(lossy(n))


def reply_to(served: Served) -> None:
    """Give the connection's client a command's reply, as its command handler does."""
    (client,) = served.broker.clients
    assert client.try_deliver_nowait(Event(0, "reply", '{"type":"reply","id":1}', False))


def wire_types(served: Served) -> list[str]:
    return [frame.type for frame in served.sock.wire[1:]]  # (after hello)


async def publish_from(broker: Broker, n: int) -> None:
    broker.publish(lossy(n))
    await trio.lowlevel.checkpoint()


async def test_events_published_by_many_tasks_in_one_round_go_out_in_two_writes(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            c = await serve(nursery)
            second = await serve(nursery, broker=c.broker)
            await ticking(nursery, c, second)
            async with trio.open_nursery() as publishers:  # five tasks, one round
                for n in range(5):
                    publishers.start_soon(publish_from, c.broker, n)
            await trio.testing.wait_all_tasks_blocked()
            for served in (c, second):
                assert served.sock.direct_writes == [1, 4]
                assert seqs(served) == [1, 2, 3, 4, 5]
                assert set(served.sock.how[1:]) == {"direct"}
            assert c.task_names() == []  # no writer was needed
            nursery.cancel_scope.cancel()


async def test_a_lone_event_goes_out_at_once_and_each_round_opens_its_own_tick(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with one_ticking() as c:
        c.broker.publish(lossy(0))
        assert c.sock.direct_writes == [1]  # written before anything else runs
        await trio.testing.wait_all_tasks_blocked()
        c.broker.publish(lossy(1))
        c.broker.publish(lossy(2))
        assert c.sock.direct_writes == [1, 1]  # the second is held for the tick's end
        await trio.testing.wait_all_tasks_blocked()
        assert c.sock.direct_writes == [1, 1, 1]
        assert seqs(c) == [1, 2, 3]


async def test_a_batch_within_a_tick_is_written_at_the_tick_end_in_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with one_ticking() as c:
        c.broker.publish(lossy(0))
        with c.broker.batched():
            for n in range(1, 4):
                c.broker.publish(lossy(n))
        c.broker.publish(lossy(4))
        assert c.sock.direct_writes == [1]
        await trio.testing.wait_all_tasks_blocked()
        assert c.sock.direct_writes == [1, 4]
        assert seqs(c) == [1, 2, 3, 4, 5]


async def test_a_reply_writes_what_was_held_before_it_then_itself(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A command's reply to a connection that holds frames of a batch: the held frames go out
    first, in one write, then the reply, and the batch's later frames at its end. The wire has
    the publishes' order; and a connection that takes batches has its frames split at the reply
    written before the other connections' (whose frames then join its compressed pieces,
    tests/test_ws_batch.py)."""
    async with one_ticking() as c:
        with c.broker.batched():
            publish(c.broker, range(3))
            assert c.sock.direct_writes == [1]  # the rest held for the batch's end
            reply_to(c)
            assert c.sock.direct_writes == [1, 2, 1]
            publish(c.broker, range(3, 5))
            assert c.sock.direct_writes == [1, 2, 1]
        assert c.sock.direct_writes == [1, 2, 1, 2]
        assert wire_types(c) == ["agent_event"] * 3 + ["reply"] + ["agent_event"] * 2
        assert [seq_of(f) for f in c.sock.wire[1:] if f.type != "reply"] == [1, 2, 3, 4, 5]


async def test_a_reply_behind_held_frames_the_socket_refuses_waits_behind_them(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with one_ticking() as c:
        with c.broker.batched():
            publish(c.broker, range(3))
            c.sock.blocked = True
            reply_to(c)  # queued, behind the two held
            publish(c.broker, range(3, 4))
        c.sock.unblock()
        await trio.testing.wait_all_tasks_blocked()
        assert wire_types(c) == ["agent_event"] * 3 + ["reply", "agent_event"]
        assert c.sock.how[1:] == ["direct"] + ["writer"] * 4


async def test_frames_held_by_a_tick_that_the_socket_refuses_go_to_the_writer_in_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with one_ticking() as c:
        for n in range(3):
            c.broker.publish(lossy(n))
        c.sock.blocked = True  # the socket fills before the tick ends
        await trio.testing.wait_all_tasks_blocked()
        assert c.task_names() == ["_write"]
        c.broker.publish(lossy(3))  # behind the held two, in the queue
        c.sock.unblock()
        await trio.testing.wait_all_tasks_blocked()
        assert seqs(c) == [1, 2, 3, 4]
        assert c.sock.how[1:] == ["direct", "writer", "writer", "writer"]


async def test_stopped_ticks_write_what_they_held_and_later_frames_go_out_at_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            c = await serve(nursery)
            ticks = await ticking(nursery, c)
            ticks.cancel()  # stopping; the tick below opens before the ticks task runs again
            for n in range(3):
                c.broker.publish(lossy(n))
            assert c.sock.direct_writes == [1]
            await trio.testing.wait_all_tasks_blocked()
            assert c.sock.direct_writes == [1, 2]  # written as the ticks ended
            c.broker.publish(lossy(3))
            c.broker.publish(lossy(4))
            assert c.sock.direct_writes == [1, 2, 1, 1]  # no ticks: each at once
            assert seqs(c) == [1, 2, 3, 4, 5]
            nursery.cancel_scope.cancel()


async def test_a_client_closed_with_frames_held_gets_none_of_them(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            c = await serve(nursery)
            other = await serve(nursery, broker=c.broker)
            await ticking(nursery, c, other)
            for n in range(3):
                c.broker.publish(lossy(n))
            next(iter(c.broker.clients)).kill("going away")  # one of the two, frames held
            await trio.testing.wait_all_tasks_blocked()
            assert sum(c.sock.direct_writes) + sum(other.sock.direct_writes) == 4
            assert sorted([seqs(c), seqs(other)], key=len) == [[1], [1, 2, 3]]
            nursery.cancel_scope.cancel()


async def test_a_workspace_ticks_while_it_is_open(tmp_path: Path) -> None:
    async with running_server(tmp_path) as server:
        wid = (await server.open_workspace())["id"]
        ws = server.backend.get(wid)
        assert ws.broker.ticking
        ws.request_shutdown()
        with trio.fail_after(WAIT):
            await ws.closed.wait()
        assert not ws.broker.ticking
