"""The event websocket's writer runs only while frames wait (:class:`OnDemandWriter`), and one
keepalive timer pings idle connections (:class:`Keepalive`).

:func:`serve_connection` runs here against a real broker and a scripted socket that records what
it is asked to write: directly (the broker's ``send_now``), or by the writer. The socket can
refuse direct writes (a socket that would block), take a frame only in part, or hold the
writer's writes until told to go on; the connection's tasks run in a nursery of the test's, so
the test sees when a writer (or a ping) runs. Every wait is bounded (``trio.fail_after``) and
time is the autojump clock's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, cast

import orjson
import pytest
import trio
import trio.testing

from crush_trio.broker import FLUSH, NOT_SENT, SENT, SENT_IN_PART, TOO_SLOW_REASON, Broker, Event
from crush_trio.errors import WS_CLOSE_GOING_AWAY, WS_CLOSE_NORMAL, WS_CLOSE_TRY_AGAIN_LATER
from crush_trio.server import listener
from crush_trio.server.connection import (
    SLOW_CLOSE_TIMEOUT,
    WORKSPACE_CLOSED,
    OnDemandWriter,
    PeerGone,
    Subscription,
    serve_connection,
)
from crush_trio.server.keepalive import TICKS_PER_INTERVAL, Keepalive
from crush_trio.server.ws_trio import PONG_TIMEOUT
from crush_trio.wire import AgentEvent

from .test_direct_write import HalfWrites, watch_one_run
from .test_ws_deflate import open_raw

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from crush_trio.client import WorkspaceClient
    from crush_trio.providers.scripted import ScriptedModel
    from crush_trio.server.api import Api
    from crush_trio.testing import CrushServer

#: Cap on every wait of a test (trio clock; autojump makes it cheap).
CAP: Final = 60.0
#: The ping interval of the keepalive tests (seconds).
INTERVAL: Final = 20.0


def lossy(n: int) -> AgentEvent:
    return AgentEvent("info", text=f"event {n}")


def seq_of(event: Event) -> int:
    return int(orjson.loads(event.text)["seq"])


class ScriptedSocket:
    """An :class:`~crush_trio.server.connection.EventSocket` that records its writes.

    ``blocked``: direct writes are refused (``NOT_SENT``), as by a socket that would block, and
    the writer's writes wait for :meth:`unblock`. ``partial``: a direct write takes the frame only
    in part (``SENT_IN_PART``); the rest stays pending until the writer's next write.
    """

    max_batch = 4
    left: tuple[type[Exception], ...] = (trio.ClosedResourceError, trio.EndOfChannel)

    def __init__(self) -> None:
        #: Frames written, whole, in the order they went out.
        self.wire: list[Event] = []
        #: How each one went: "direct" or "writer".
        self.how: list[str] = []
        #: Writes by the writer (each one batch).
        self.batches: list[int] = []
        #: Direct writes (the broker's), by the number of frames each wrote.
        self.direct_writes: list[int] = []
        self.sent = False
        self.blocked = False
        self.partial = False
        self.pending: Event | None = None
        self._room = trio.Event()
        self.write_deadline: float | None = None
        self.closed: tuple[int, str] | None = None
        self.gone = False
        self.pings = 0
        self.answer_pings = True
        self.commands_send, self._commands = trio.open_memory_channel[str | bytes](4)

    @property
    def send_now(self) -> Callable[[Sequence[Event]], int] | None:
        return self._send_now

    def _send_now(self, events: Sequence[Event]) -> int:
        assert self.pending is None, "a direct write while the rest of a frame was pending"
        if self.blocked:
            return NOT_SENT
        self.sent = True
        self.direct_writes.append(len(events))
        *whole, last = events
        for event in whole:
            self._put(event, "direct")
        if self.partial:
            self.pending = last
            return SENT_IN_PART
        self._put(last, "direct")
        return SENT

    def _put(self, event: Event, how: str) -> None:
        self.wire.append(event)
        self.how.append(how)

    def unblock(self) -> None:
        self.blocked = False
        self._room.set()

    async def send_frames(self, frames: Sequence[Event]) -> None:
        if self.gone or self.closed is not None:
            raise PeerGone
        self.sent = True
        self.batches.append(len(frames))
        if self.pending is not None:  # the rest of a frame begun directly goes first
            self._put(self.pending, "direct")
            self.pending = None
        if self.blocked:
            await self._room.wait()
            self._room = trio.Event()
        else:
            await trio.lowlevel.checkpoint()
        for frame in frames:
            if frame is not FLUSH:
                self._put(frame, "writer")

    async def ping(self) -> bool:
        self.pings += 1
        if self.answer_pings:
            await trio.lowlevel.checkpoint()
            return True
        await trio.sleep(PONG_TIMEOUT)
        return False

    def stop_reading(self) -> None:
        self._commands.close()

    def receive(self) -> Any:
        return self._commands.receive()

    async def close(self, code: int, reason: str) -> None:
        if self.pending is not None:  # the close frame follows the frame begun
            self._put(self.pending, "direct")
            self.pending = None
        self.closed = (code, reason)
        await trio.lowlevel.checkpoint()

    def limit_writes(self, deadline: float) -> None:
        self.write_deadline = deadline

    def ending(self) -> str:
        return "closed"


class FakeWorkspace:
    """What :func:`serve_connection` needs of a workspace: a real broker, its id and state."""

    def __init__(self, broker: Broker) -> None:
        self.id = "w-on-demand"
        self.broker = broker
        self.closing = False
        self.attached: list[str] = []

    def attach(self, client_id: str) -> None:
        self.attached.append(client_id)

    def detach(self, client_id: str) -> None:
        self.attached.remove(client_id)


class Served:
    """One connection served in the test's nursery; its tasks run in :attr:`tasks`."""

    def __init__(self, sock: ScriptedSocket, ws: FakeWorkspace, tasks: trio.Nursery) -> None:
        self.sock = sock
        self.ws = ws
        self.tasks = tasks
        self.done = trio.Event()

    @property
    def broker(self) -> Broker:
        return self.ws.broker

    def task_names(self) -> list[str]:
        return [t.name.rsplit(".", 1)[-1] for t in self.tasks.child_tasks]

    async def run(self, keepalive: Keepalive | None) -> None:
        try:
            await serve_connection(
                cast("Any", self.sock),
                cast("Any", self.ws),
                Subscription("client-1"),
                cast("Api", None),
                keepalive,
                self.tasks,
            )
        finally:
            self.done.set()


async def serve(
    nursery: trio.Nursery,
    *,
    keepalive: Keepalive | None = None,
    sock: ScriptedSocket | None = None,
    broker: Broker | None = None,
) -> Served:
    """Start serving a connection; returns once it is idle (``hello`` written)."""
    tasks = await nursery.start(_task_nursery)
    served = Served(sock or ScriptedSocket(), FakeWorkspace(broker or Broker()), tasks)
    nursery.start_soon(served.run, keepalive)
    await trio.testing.wait_all_tasks_blocked()
    return served


async def _task_nursery(*, task_status: trio.TaskStatus[trio.Nursery]) -> None:
    """A nursery for the connection's tasks (as the transport's), open until cancelled."""
    async with trio.open_nursery() as tasks:
        task_status.started(tasks)
        await trio.sleep_forever()


async def test_an_idle_client_has_no_writer_task_and_its_frames_go_out_directly(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            c = await serve(nursery)
            assert [f.type for f in c.sock.wire] == ["hello"]
            assert c.task_names() == []  # the writer that sent hello has ended
            for n in range(5):
                c.broker.publish(lossy(n))
                # Written in the publisher's call, before any task ran.
                assert c.sock.how[-1] == "direct"
                assert len(c.sock.wire) == n + 2
            assert c.task_names() == []
            await trio.testing.wait_all_tasks_blocked()
            assert c.task_names() == []
            assert [seq_of(f) for f in c.sock.wire[1:]] == [1, 2, 3, 4, 5]
            c.sock.commands_send.close()  # the client leaves
            await c.done.wait()
            assert c.sock.closed == (WS_CLOSE_NORMAL, "")
            assert c.broker.clients == set()
            assert c.ws.attached == []
            nursery.cancel_scope.cancel()


async def test_a_writer_starts_when_the_socket_would_block_and_ends_once_drained(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            c = await serve(nursery)
            c.sock.blocked = True
            for n in range(10):
                c.broker.publish(lossy(n))
            await trio.testing.wait_all_tasks_blocked()
            assert c.task_names() == ["_write"]  # one writer, waiting for room
            c.broker.publish(lossy(10))  # the writer holds frames: nothing goes out directly
            assert c.sock.how.count("direct") == 0
            for _ in range(10):
                c.sock.unblock()
                c.sock.blocked = True
                await trio.testing.wait_all_tasks_blocked()
            c.sock.unblock()
            await trio.testing.wait_all_tasks_blocked()
            assert c.task_names() == []  # drained: the writer ended
            assert all(b <= c.sock.max_batch for b in c.sock.batches)
            assert max(c.sock.batches) > 1  # queued frames go out several per write
            assert [seq_of(f) for f in c.sock.wire[1:]] == list(range(1, 12))
            c.broker.publish(lossy(11))  # idle again: direct
            assert c.sock.how[-1] == "direct"
            assert c.task_names() == []
            nursery.cancel_scope.cancel()


async def test_the_rest_of_a_frame_taken_in_part_goes_out_before_the_next_frames(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            c = await serve(nursery)
            c.sock.partial = True
            c.broker.publish(lossy(0))  # taken in part: a FLUSH starts the writer
            assert c.sock.pending is not None
            assert c.task_names() == ["_write"]
            c.broker.publish(lossy(1))  # queued behind the FLUSH
            c.broker.publish(lossy(2))
            await trio.testing.wait_all_tasks_blocked()
            assert c.sock.pending is None
            assert c.task_names() == []
            assert [seq_of(f) for f in c.sock.wire[1:]] == [1, 2, 3]
            c.broker.publish(lossy(3))  # direct again, in part again
            await trio.testing.wait_all_tasks_blocked()
            assert [seq_of(f) for f in c.sock.wire[1:]] == [1, 2, 3, 4]
            nursery.cancel_scope.cancel()


async def test_a_batch_of_publishes_goes_out_in_two_writes_its_first_frame_then_the_rest(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            c = await serve(nursery)
            c.sock.direct_writes.clear()
            with c.broker.batched():
                c.broker.publish(lossy(0))
                assert c.sock.direct_writes == [1]  # the first at once: the socket takes it
                for n in range(1, 5):
                    c.broker.publish(lossy(n))
                assert c.sock.direct_writes == [1]  # the rest are held for the end
                assert len(c.sock.wire) == 2
            assert c.sock.direct_writes == [1, 4]
            c.broker.publish(lossy(5))  # no batch: each frame at once again
            assert c.sock.direct_writes == [1, 4, 1]
            assert c.task_names() == []
            assert [seq_of(f) for f in c.sock.wire[1:]] == [1, 2, 3, 4, 5, 6]
            assert set(c.sock.how[1:]) == {"direct"}  # (hello went by the first writer)
            nursery.cancel_scope.cancel()


async def test_frames_held_by_a_batch_that_the_socket_refuses_are_queued_in_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            c = await serve(nursery)
            with c.broker.batched():
                for n in range(4):
                    c.broker.publish(lossy(n))
                c.sock.blocked = True  # (a transport's state cannot change within a batch)
            assert c.task_names() == ["_write"]  # the held three were queued for the writer
            c.broker.publish(lossy(4))  # behind them
            assert len(c.broker.clients) == 1
            (client,) = c.broker.clients
            assert len(client.receive) == 4
            c.sock.unblock()
            await trio.testing.wait_all_tasks_blocked()
            assert [seq_of(f) for f in c.sock.wire[1:]] == [1, 2, 3, 4, 5]
            assert len(client.receive) == 0
            assert client.receive.bytes == 0
            assert c.task_names() == []
            nursery.cancel_scope.cancel()


async def test_the_rest_of_a_batch_written_in_part_goes_out_before_later_frames(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            c = await serve(nursery)
            with c.broker.batched():
                for n in range(3):
                    c.broker.publish(lossy(n))
                c.sock.partial = True  # the held frames' write will be taken in part
            assert c.task_names() == ["_write"]
            c.sock.partial = False
            c.broker.publish(lossy(3))
            await trio.testing.wait_all_tasks_blocked()
            assert [seq_of(f) for f in c.sock.wire[1:]] == [1, 2, 3, 4]
            assert c.task_names() == []
            nursery.cancel_scope.cancel()


async def test_a_batch_after_a_frame_taken_in_part_queues_behind_its_rest(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            c = await serve(nursery)
            second = await serve(nursery, broker=c.broker)
            c.sock.partial = True
            c.sock.direct_writes.clear()
            second.sock.direct_writes.clear()
            with c.broker.batched():
                for n in range(3):
                    c.broker.publish(lossy(n))
            assert c.sock.direct_writes == [1]  # in part: the rest of it, then the queue
            assert second.sock.direct_writes == [1, 2]  # the other client: first, then rest
            await trio.testing.wait_all_tasks_blocked()
            for served in (c, second):
                assert [seq_of(f) for f in served.sock.wire[1:]] == [1, 2, 3]
            assert c.sock.how[1:] == ["direct", "writer", "writer"]
            nursery.cancel_scope.cancel()


async def test_hello_and_resumed_frames_go_first_then_direct_writes(
    autojump_clock: trio.abc.Clock,
) -> None:
    broker = Broker()
    for n in range(3):
        broker.publish(lossy(n))
    sock = ScriptedSocket()
    sock.blocked = True  # the first frames wait for room
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            tasks = await nursery.start(_task_nursery)
            c = Served(sock, FakeWorkspace(broker), tasks)

            async def resume() -> None:
                await serve_connection(
                    cast("Any", sock),
                    cast("Any", c.ws),
                    Subscription("client-1", since=1),
                    cast("Api", None),
                    None,
                    tasks,
                )

            nursery.start_soon(resume)
            await trio.testing.wait_all_tasks_blocked()
            broker.publish(lossy(3))  # while hello is being written: queued, not direct
            assert sock.wire == []
            sock.unblock()
            await trio.testing.wait_all_tasks_blocked()
            assert [f.type for f in sock.wire][:1] == ["hello"]
            assert [seq_of(f) for f in sock.wire[1:]] == [2, 3, 4]
            assert sock.how == ["writer"] * 4
            broker.publish(lossy(4))
            assert sock.how[-1] == "direct"
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("writing", [True, False], ids=["writer-running", "idle"])
async def test_a_killed_client_is_closed_1013_with_its_writes_bounded(
    autojump_clock: trio.abc.Clock, writing: bool
) -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            c = await serve(nursery)
            if writing:
                c.sock.blocked = True
                for n in range(3):
                    c.broker.publish(lossy(n))
                await trio.testing.wait_all_tasks_blocked()
                assert c.task_names() == ["_write"]
            (stream,) = c.broker.clients
            killed_at = trio.current_time()
            stream.kill(TOO_SLOW_REASON)
            assert c.sock.write_deadline == killed_at + SLOW_CLOSE_TIMEOUT
            await c.done.wait()
            assert c.sock.closed == (WS_CLOSE_TRY_AGAIN_LATER, TOO_SLOW_REASON)
            assert trio.current_time() == killed_at  # no wait for the writer's room
            await trio.testing.wait_all_tasks_blocked()
            assert c.task_names() == []
            assert c.broker.clients == set()
            nursery.cancel_scope.cancel()


async def test_the_keepalive_pings_an_idle_connection_and_closes_it_without_a_pong(
    autojump_clock: trio.abc.Clock,
) -> None:
    keepalive = Keepalive(INTERVAL)
    with trio.fail_after(10 * INTERVAL):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keepalive.run)
            c = await serve(nursery, keepalive=keepalive)
            assert len(keepalive) == 1
            started = trio.current_time()
            # A client sent something every half interval is never pinged.
            for n in range(6):
                await trio.sleep(INTERVAL / 2)
                c.broker.publish(lossy(n))
            assert c.sock.pings == 0
            # Silent: pinged after one interval (within a tick), then each interval.
            quiet = trio.current_time()
            while c.sock.pings == 0:
                await trio.sleep(INTERVAL / TICKS_PER_INTERVAL)
            assert (
                INTERVAL <= trio.current_time() - quiet <= INTERVAL * (1 + 2 / TICKS_PER_INTERVAL)
            )
            await trio.sleep(2 * INTERVAL)
            assert c.sock.pings in (2, 3)
            assert c.sock.closed is None
            assert c.task_names() == []  # the pongs came: no ping task left
            # No pong: closed (1000, as a client that left) after PONG_TIMEOUT.
            c.sock.answer_pings = False
            pings = c.sock.pings
            await c.done.wait()
            assert c.sock.pings == pings + 1
            assert c.sock.closed == (WS_CLOSE_NORMAL, "")
            assert trio.current_time() - started > PONG_TIMEOUT
            assert len(keepalive) == 0
            assert c.broker.clients == set()
            nursery.cancel_scope.cancel()


async def test_a_command_reply_goes_out_through_the_same_path(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            c = await serve(nursery)
            await c.sock.commands_send.send(b"binary")  # refused with an error reply
            await trio.testing.wait_all_tasks_blocked()
            reply = orjson.loads(c.sock.wire[-1].text)
            assert reply["type"] == "error"
            assert "binary" in reply["message"]
            nursery.cancel_scope.cancel()


async def test_a_closing_workspace_gets_everything_queued_then_1001(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            c = await serve(nursery)
            c.broker.publish(lossy(0))  # direct
            c.sock.blocked = True
            for n in range(1, 6):
                c.broker.publish(lossy(n))  # queued: the writer waits for room
            await trio.testing.wait_all_tasks_blocked()
            c.ws.closing = True
            c.broker.close()
            c.sock.unblock()
            await c.done.wait()
            assert [seq_of(f) for f in c.sock.wire[1:]] == [1, 2, 3, 4, 5, 6]
            assert c.sock.closed == (WS_CLOSE_GOING_AWAY, WORKSPACE_CLOSED)
            nursery.cancel_scope.cancel()


async def test_a_closing_workspace_closes_an_idle_connection_1001(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            c = await serve(nursery)
            assert c.task_names() == []
            c.ws.closing = True
            c.broker.close()  # no writer runs: the close starts one, which sees the end
            await c.done.wait()
            assert c.sock.closed == (WS_CLOSE_GOING_AWAY, WORKSPACE_CLOSED)
            nursery.cancel_scope.cancel()


async def test_a_client_gone_while_the_writer_writes_ends_the_connection(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            c = await serve(nursery)
            c.sock.blocked = True
            c.broker.publish(lossy(0))
            await trio.testing.wait_all_tasks_blocked()
            c.sock.gone = True
            c.sock.unblock()  # the batch in flight is written; the next write finds it gone
            c.sock.blocked = False
            c.broker.publish(lossy(1))
            await c.done.wait()
            assert c.sock.closed == (WS_CLOSE_NORMAL, "")
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("phase", ["before-hello", "while-streaming", "idle"])
async def test_cancellation_at_each_phase_leaves_nothing_behind(
    autojump_clock: trio.abc.Clock, phase: str
) -> None:
    broker = Broker()
    sock = ScriptedSocket()
    if phase == "before-hello":
        sock.blocked = True
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            tasks = await nursery.start(_task_nursery)
            c = Served(sock, FakeWorkspace(broker), tasks)
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as handler:
                    handler.start_soon(c.run, None)
                    await trio.testing.wait_all_tasks_blocked()
                    if phase == "while-streaming":
                        sock.blocked = True
                        for n in range(3):
                            broker.publish(lossy(n))
                        await trio.testing.wait_all_tasks_blocked()
                        assert c.task_names() == ["_write"]
                    scope.cancel()
            assert c.done.is_set()
            assert broker.clients == set()
            assert c.ws.attached == []
            broker.publish(lossy(9))  # nothing is written to a connection that ended
            assert all(seq_of(f) != broker.latest_seq for f in sock.wire if f.type != "hello")
            nursery.cancel_scope.cancel()


async def test_the_keepalive_looks_at_connections_once_per_tick() -> None:
    class Conn:
        def __init__(self, sent: bool) -> None:
            self.sent = sent
            self.pinged = 0

        def sent_since(self) -> bool:
            sent, self.sent = self.sent, False
            return sent

        def ping_soon(self) -> None:
            self.pinged += 1

    keepalive = Keepalive(INTERVAL)
    quiet, busy = Conn(False), Conn(True)
    keepalive.add(quiet)
    keepalive.add(busy)
    now = trio.current_time()
    assert keepalive.tick(now + INTERVAL / 2) == 0
    assert keepalive.tick(now + INTERVAL) == 1  # quiet for the interval
    assert (quiet.pinged, busy.pinged) == (1, 0)
    assert keepalive.tick(now + INTERVAL * 1.25) == 0  # the next ping an interval later
    assert keepalive.tick(now + INTERVAL * 2) == 2  # busy has been silent since its last write
    keepalive.discard(quiet)
    keepalive.discard(quiet)
    assert len(keepalive) == 1
    off = Keepalive(0)
    off.add(quiet)
    assert len(off) == 0


def writers_running() -> int:
    """Writer tasks in this trio run (the server's included)."""
    code = OnDemandWriter._write.__code__
    running = 0
    stack = [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        running += getattr(task.coro, "cr_code", None) is code
        for child in task.child_nurseries:
            stack.extend(child.child_tasks)
    return running


async def test_on_a_real_server_idle_clients_hold_no_writer_and_partial_writes_start_one(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with trio.fail_after(CAP):
        idle = await open_raw(crush_server, crush_workspace.id, [])
        await idle.messages_until(None)  # the hello
        await trio.testing.wait_all_tasks_blocked()
        assert writers_running() == 0
        started = 0
        write = OnDemandWriter._write

        def counted(writer: OnDemandWriter) -> Any:
            nonlocal started
            started += 1
            return write(writer)

        monkeypatch.setattr(OnDemandWriter, "_write", counted)
        monkeypatch.setattr(listener, "os", HalfWrites())
        got = await watch_one_run(crush_server, crush_workspace, scripted_model)
        assert got["packed"] == got["plain"]
        # Every frame was taken in part: a writer started to send each rest, then ended.
        assert started >= 2 * sum(kind == "message_delta" for _, kind, _ in got["plain"])
        monkeypatch.setattr(OnDemandWriter, "_write", write)
        await trio.testing.wait_all_tasks_blocked()
        assert writers_running() == 0
        await idle.stream.aclose()
