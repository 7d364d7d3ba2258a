"""The broker as a unit: sequencing, encode once, lossy drops with gaps, must-deliver bounds,
replay bounds and resume frames."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
import pytest
import trio
import trio.testing

from crush_trio.broker import NOT_SENT, SENT, Broker, ClientStream, Event
from crush_trio.wire import AgentEvent, EventKind, RunComplete

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


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


async def test_events_are_sequenced_and_encoded_once_for_every_client() -> None:
    broker = Broker()
    a, _ = broker.subscribe()
    b, _ = broker.subscribe()
    broker.publish(lossy(1), EventKind.CREATED)
    ea, eb = drain(a), drain(b)
    assert ea[0] is eb[0] is broker.replay[-1]  # one object, shared
    envelope = orjson.loads(ea[0].text)
    assert envelope == {
        "seq": 1,
        "type": "agent_event",
        "payload": {
            "type": "created",
            "payload": {
                "type": "info",
                "session_id": None,
                "run_id": None,
                "text": "event 1",
                "error": "",
                "message": None,
            },
        },
    }
    assert ea[0].sse == f"id: 1\ndata: {ea[0].text}\n\n".encode()


async def test_must_deliver_payloads_are_refused_on_the_lossy_path() -> None:
    with pytest.raises(ValueError, match="must-deliver"):
        Broker().publish(RunComplete("s", "r"))


async def test_full_client_drops_lossy_events_and_gets_a_gap_in_order() -> None:
    broker = Broker(client_queue_size=2)
    slow, _ = broker.subscribe()
    fast, _ = broker.subscribe(client_id="fast")
    for n in range(5):
        broker.publish(lossy(n))
        drain(fast)
    assert slow.dropped == 3
    assert broker.dropped == 3
    first = slow.receive.receive_nowait()
    slow.after_receive()  # room again: the gap is queued behind what was already there
    frames = [first, *drain(slow)]
    assert [f.type for f in frames] == ["agent_event", "agent_event", "gap"]
    gap = orjson.loads(frames[-1].text)
    assert gap["payload"] == {"dropped": 3, "from_seq": 3, "to_seq": 5}
    assert gap["seq"] == broker.seq  # a connection frame repeats the latest seq
    assert fast.dropped == 0


async def test_must_deliver_waits_for_room_then_kills_the_slow_client(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = Broker(client_queue_size=1, must_deliver_timeout=2.0)
    slow, _ = broker.subscribe()
    ok, _ = broker.subscribe()
    broker.publish(lossy(0))
    drain(ok)
    started = trio.current_time()
    await broker.publish_must_deliver(RunComplete("s", "r1"), EventKind.CREATED)
    assert trio.current_time() - started == pytest.approx(2.0)
    assert slow.killed.is_set()
    assert slow.kill_reason == "too slow"
    assert slow.kill_code == 1013
    assert slow not in broker.clients
    assert broker.killed == 1
    assert [e.type for e in drain(ok)] == ["run_complete"]


async def test_must_deliver_is_delivered_when_the_client_makes_room(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = Broker(client_queue_size=1, must_deliver_timeout=5.0)
    slow, _ = broker.subscribe()
    broker.publish(lossy(0))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(broker.publish_must_deliver, RunComplete("s", "r1"), EventKind.CREATED)
        await trio.testing.wait_all_tasks_blocked()
        broker.publish(lossy(1))  # behind a waiting must-deliver event: dropped into a gap
        await trio.sleep(1)
        first = drain(slow)
        await trio.testing.wait_all_tasks_blocked()  # the publisher finishes its delivery
        assert [e.type for e in first + drain(slow)] == ["agent_event", "run_complete", "gap"]
    assert not slow.killed.is_set()


async def test_replay_is_bounded_by_count_and_by_bytes() -> None:
    by_count = Broker(replay_size=3)
    for n in range(10):
        by_count.publish(lossy(n))
    assert [e.seq for e in by_count.replay] == [8, 9, 10]
    by_bytes = Broker(replay_bytes=500)
    for n in range(50):
        by_bytes.publish(AgentEvent("info", text="x" * 100 + str(n)))
    assert sum(len(e.text) for e in by_bytes.replay) <= 500
    assert by_bytes.replay[-1].seq == 50
    assert len(by_bytes.replay) < 50


async def test_resume_frames() -> None:
    broker = Broker(replay_size=3)
    for n in range(6):
        broker.publish(lossy(n))
    _, frames = broker.subscribe(since=5)
    assert [f.seq for f in frames] == [6]
    _, frames = broker.subscribe(since=6)
    assert frames == []
    _, frames = broker.subscribe(since=1)  # 2 and 3 are gone
    gap = orjson.loads(frames[0].text)
    assert gap["type"] == "gap"
    assert gap["payload"] == {"dropped": 2, "from_seq": 2, "to_seq": 3}
    assert [f.seq for f in frames[1:]] == [4, 5, 6]
    _, frames = broker.subscribe(since=99)  # a cursor from an earlier server process
    assert [f.type for f in frames] == ["gap"]


async def test_closing_the_broker_ends_every_stream() -> None:
    broker = Broker()
    stream, _ = broker.subscribe()
    broker.publish(lossy(1))
    broker.close()
    assert [e.seq for e in drain(stream)] == [1]
    with pytest.raises(trio.EndOfChannel):
        stream.receive.receive_nowait()
    with pytest.raises(trio.ClosedResourceError):
        broker.subscribe()


class AfterFirstStep(trio.abc.Instrument):
    """Calls ``action`` once, right after the first step of the task named ``name``."""

    def __init__(self, name: str, action: Callable[[], object]) -> None:
        self.name = name
        self.action: Callable[[], object] | None = action

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if self.action is not None and task.name.endswith(self.name):
            action, self.action = self.action, None
            action()


async def test_a_writer_never_holds_a_taken_frame_across_a_yield() -> None:
    """A transport that leaves the direct write set while its writer waits on the queue (SSE):
    a frame published while the writer yields inside ``receive`` must not go out ahead of the
    one it is receiving. The writer takes its frame only after its last checkpoint."""
    broker = Broker()
    stream, _ = broker.subscribe()
    wire: list[int] = []
    refuse = True

    def send_now(events: Sequence[Event]) -> int:
        if refuse:
            return NOT_SENT
        wire.extend(orjson.loads(e.text)["seq"] for e in events)
        return SENT

    stream.send_now = send_now
    broker.publish(lossy(1))  # refused: queued for the writer
    refuse = False

    async def writer() -> None:
        event = await stream.receive.receive()
        wire.append(orjson.loads(event.text)["seq"])  # written at once, as a writer would

    # Published at the writer's first yield, i.e. while it is inside ``receive``.
    instrument = AfterFirstStep("writer", lambda: broker.publish(lossy(2)))
    trio.lowlevel.add_instrument(instrument)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
    finally:
        trio.lowlevel.remove_instrument(instrument)
    assert instrument.action is None
    assert wire + [orjson.loads(e.text)["seq"] for e in drain(stream)] == [1, 2]
