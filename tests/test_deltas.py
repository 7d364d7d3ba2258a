"""Message deltas (PROTOCOL §6): appends published as ``message_delta`` to clients that ask for
them (``?deltas=1``), the same change as a ``message`` snapshot under the same seq to the others.

The first half drives the real pieces without a server (the step assembler, the message service,
the broker, a client model that applies frames as a client does) on ``autojump_clock`` or a
virtual clock, so coalescing windows are exact. The second half checks the wire through a real
server: both websocket transports and SSE, snapshot mode unchanged, resume by ``since``.
"""

from __future__ import annotations

import copy
import itertools
import uuid
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crush_trio import wire
from crush_trio.broker import Broker, ClientStream, Event
from crush_trio.core.assembler import StepAssembler
from crush_trio.errors import BadRequest
from crush_trio.providers import base as pb
from crush_trio.providers.scripted import Gate, ScriptedModel, Step
from crush_trio.server.connection import parse_deltas, parse_subscription
from crush_trio.store import MessageService
from crush_trio.wire import (
    DeltaPartType,
    EventKind,
    Message,
    MessageDelta,
    ReasoningPart,
    Role,
    TextPart,
    ToolCallPart,
)

from .conftest import TOKEN, WAIT, event_socket, running_server, ws_url

if TYPE_CHECKING:
    from collections.abc import Iterable
    from pathlib import Path

DEBOUNCE = 0.033


# -- a client as the protocol describes it -----------------------------------------------------


def fields(message: Message) -> list[tuple[str, str]]:
    """What deltas carry of a message: each part's type and its growing field."""
    out = []
    for part in message.parts:
        if isinstance(part, TextPart):
            out.append(("text", part.text))
        elif isinstance(part, ReasoningPart):
            out.append(("reasoning", part.thinking))
        elif isinstance(part, ToolCallPart):
            out.append(("tool_call", part.input))
        else:
            out.append((type(part).__name__, ""))
    return out


class Assembled:
    """Messages as a client assembles them from ``message`` and ``message_delta`` frames."""

    def __init__(self) -> None:
        self.messages: dict[str, Message] = {}
        self.gaps = 0
        self.deltas = 0
        self.snapshots = 0

    def apply(self, frame: dict[str, Any]) -> bool:
        """Apply one frame; False when a delta finds bytes missing (the client re-reads)."""
        kind = frame["type"]
        payload = frame["payload"].get("payload")
        if kind == "gap":
            self.gaps += 1
        elif kind == "message":
            self.snapshots += 1
            self.messages[payload["id"]] = wire.converter.structure(payload, Message)
        elif kind == "message_delta":
            self.deltas += 1
            delta = wire.converter.structure(payload, MessageDelta)
            message = self.messages.get(delta.message_id)
            return message is not None and wire.apply_delta(message, delta)
        return True


def drain(stream: ClientStream) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = []
    while True:
        try:
            event = stream.receive.receive_nowait()
        except trio.WouldBlock:
            return frames
        stream.after_receive()
        frames.append(orjson.loads(event.text))


def decode(events: Iterable[Event]) -> list[dict[str, Any]]:
    return [orjson.loads(e.text) for e in events]


class Harness:
    """The server's path of one assistant message: assembler → message service → broker."""

    def __init__(self, broker: Broker | None = None, debounce: float = DEBOUNCE) -> None:
        self.broker = broker or Broker()
        self.rows: dict[str, Message] = {}
        self.service = MessageService(
            self,
            self.broker.publish,
            debounce=debounce,
            write_window=3600,
            publish_delta=self.broker.publish_delta,
        )
        self.msg = Message("m1", "s1", Role.ASSISTANT)
        self.assembler = StepAssembler(self.msg)

    async def write_messages(self, messages: Iterable[Message]) -> set[str]:
        await trio.lowlevel.checkpoint()
        batch = list(messages)
        for m in batch:
            self.rows[m.id] = copy.deepcopy(m)
        return {m.id for m in batch}

    async def feed(self, event: pb.StreamEvent) -> None:
        if self.assembler.feed(event):
            await self.service.update(self.msg, self.assembler.append)

    async def finish(self) -> None:
        self.assembler.finish()
        await self.service.update(self.msg)


def chunk(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points) if b > a]


# -- the payload and its parsing ---------------------------------------------------------------


def test_apply_delta_skips_what_the_client_has_and_refuses_holes() -> None:
    msg = Message("m", "s", Role.ASSISTANT)
    d = MessageDelta("m", "s", 0, DeltaPartType.TEXT, 0, "héllo")
    assert wire.apply_delta(msg, d)
    assert fields(msg) == [("text", "héllo")]
    # Overlapping (the client re-read past the delta's start): only the new tail is applied.
    assert wire.apply_delta(msg, MessageDelta("m", "s", 0, DeltaPartType.TEXT, 3, "lo🙂"))
    assert fields(msg) == [("text", "héllo🙂")]
    # Already covered: nothing changes.
    assert wire.apply_delta(msg, MessageDelta("m", "s", 0, DeltaPartType.TEXT, 1, "é"))
    assert fields(msg) == [("text", "héllo🙂")]
    # Bytes missing (offset beyond what the client has), a part beyond the next, a wrong type.
    assert not wire.apply_delta(msg, MessageDelta("m", "s", 0, DeltaPartType.TEXT, 9, "x"))
    assert not wire.apply_delta(msg, MessageDelta("m", "s", 2, DeltaPartType.TEXT, 0, "x"))
    assert not wire.apply_delta(msg, MessageDelta("m", "s", 0, DeltaPartType.REASONING, 0, "x"))
    assert not wire.apply_delta(msg, MessageDelta("m", "s", 0, DeltaPartType.TEXT, -1, "x"))
    assert fields(msg) == [("text", "héllo🙂")]
    # A delta at the next index creates the part; a tool call part takes its id and name.
    call = MessageDelta("m", "s", 1, DeltaPartType.TOOL_CALL, 0, '{"a"', "c1", "bash")
    assert wire.apply_delta(msg, call)
    assert msg.parts[1] == ToolCallPart("c1", "bash", '{"a"')


def test_the_deltas_query_is_parsed_in_one_place() -> None:
    assert parse_deltas(None) is False
    assert parse_deltas("0") is False
    assert parse_deltas("1")
    with pytest.raises(BadRequest) as info:
        parse_deltas("yes")
    assert "deltas must be 1" in str(info.value)
    cid = str(uuid.uuid4())
    sub = parse_subscription({"client_id": cid, "since": "4", "deltas": "1"})
    assert (sub.client_id, sub.since, sub.deltas) == (cid, 4, True)
    assert parse_subscription({"client_id": cid}).deltas is False
    # SSE's Last-Event-ID wins over since.
    assert parse_subscription({"client_id": cid, "since": "4"}, "9").since == 9


# -- one seq, two forms ------------------------------------------------------------------------


async def test_one_change_one_seq_two_forms_encoded_once() -> None:
    broker = Broker()
    delta_a, _ = broker.subscribe(deltas=True)
    delta_b, _ = broker.subscribe(deltas=True)
    snap, _ = broker.subscribe()
    msg = Message("m", "s", Role.ASSISTANT, [TextPart("hi")])
    event = broker.publish_delta(MessageDelta("m", "s", 0, DeltaPartType.TEXT, 0, "hi"), msg)
    (a,), (b,), (c,) = (list(drain_events(s)) for s in (delta_a, delta_b, snap))
    assert a is b is event
    assert c is event.snapshot  # each form encoded once, shared
    assert a.seq == c.seq == broker.seq
    da, dc = orjson.loads(a.text), orjson.loads(c.text)
    assert da == {
        "seq": broker.seq,
        "type": "message_delta",
        "payload": {
            "type": "updated",
            "payload": {
                "message_id": "m",
                "session_id": "s",
                "part": 0,
                "part_type": "text",
                "offset": 0,
                "text": "hi",
            },
        },
    }
    assert dc["type"] == "message"
    assert dc["payload"]["type"] == "updated"
    assert dc["payload"]["payload"]["id"] == "m"
    assert dc["payload"]["payload"]["parts"] == [{"type": "text", "data": {"text": "hi"}}]
    # The replay buffer's byte bound counts both forms.
    assert broker.stats()["replay_bytes"] == a.size + c.size
    with pytest.raises(ValueError, match="publish_delta"):
        broker.publish(MessageDelta("m", "s", 0, DeltaPartType.TEXT, 2, "x"))


def test_delta_encoding_leaves_out_empty_tool_fields() -> None:
    """``tool_call_id`` and ``tool_name`` are on the wire only when set; the broker's own encoder
    and the converter agree, and a missing key decodes as ""."""
    broker = Broker()
    client, _ = broker.subscribe(deltas=True)
    text = MessageDelta("m", "s", 0, DeltaPartType.TEXT, 0, "hi")
    call = MessageDelta("m", "s", 1, DeltaPartType.TOOL_CALL, 0, "{", "c1", "bash")
    msg = Message("m", "s", Role.ASSISTANT, [TextPart("hi"), ToolCallPart("c1", "bash", "{")])
    for delta in (text, call):
        broker.publish_delta(delta, msg)
        (event,) = drain_events(client)
        payload = orjson.loads(event.text)["payload"]["payload"]
        assert payload == orjson.loads(wire.dumps(delta))
        assert wire.converter.structure(payload, MessageDelta) == delta
    assert "tool_call_id" not in orjson.loads(wire.dumps(text))
    assert orjson.loads(wire.dumps(call))["tool_name"] == "bash"


def drain_events(stream: ClientStream) -> Iterable[Event]:
    while True:
        try:
            yield stream.receive.receive_nowait()
        except trio.WouldBlock:
            return


async def test_snapshot_form_is_encoded_only_while_a_snapshot_client_is_connected() -> None:
    broker = Broker()
    deltas, _ = broker.subscribe(deltas=True)
    msg = Message("m", "s", Role.ASSISTANT, [TextPart("ab")])
    first = broker.publish_delta(MessageDelta("m", "s", 0, DeltaPartType.TEXT, 0, "a"), msg)
    assert first.snapshot is None
    assert broker.stats()["snapshots_skipped"] == 1
    snap, replay = broker.subscribe(since=0)
    # Its form was never encoded: a snapshot-mode client resuming across it gets a gap instead.
    assert [f["type"] for f in decode(replay)] == ["gap"]
    assert orjson.loads(replay[0].text)["payload"] == {"dropped": 1, "from_seq": 1, "to_seq": 1}
    second = broker.publish_delta(MessageDelta("m", "s", 0, DeltaPartType.TEXT, 1, "b"), msg)
    assert second.snapshot is not None
    assert [e.seq for e in drain_events(snap)] == [second.seq]
    snap.close()
    assert broker.snapshot_clients == 0
    assert (
        broker.publish_delta(MessageDelta("m", "s", 0, DeltaPartType.TEXT, 2, "c"), msg).snapshot
        is None
    )
    # A delta-mode client replays every delta; a snapshot-mode one gets gaps around the one
    # snapshot that was encoded.
    _, replay = broker.subscribe(since=0, deltas=True)
    assert [(f["type"], f["seq"]) for f in decode(replay)] == [
        ("message_delta", s) for s in (1, 2, 3)
    ]
    _, replay = broker.subscribe(since=0)
    got = decode(replay)
    assert [f["type"] for f in got] == ["gap", "message", "gap"]
    assert got[1]["seq"] == 2
    assert got[2]["payload"]["from_seq"] == 3


async def test_deltas_are_lossy_and_bounded_by_bytes_in_the_replay_buffer() -> None:
    broker = Broker(replay_bytes=2000, client_queue_size=4)
    stream, _ = broker.subscribe(deltas=True)
    msg = Message("m", "s", Role.ASSISTANT, [TextPart("")])
    for i in range(50):
        broker.publish_delta(MessageDelta("m", "s", 0, DeltaPartType.TEXT, i * 20, "é" * 20), msg)
    assert stream.dropped == 46
    assert len(stream.receive) == 4
    used = sum(len(e.text.encode()) for e in broker.replay)
    assert used <= 2000
    assert broker.stats()["replay_bytes"] == used
    assert all(e.size == len(e.text.encode()) for e in broker.replay)  # bytes, not characters


# -- assembling, coalescing, offsets -----------------------------------------------------------


async def test_appends_in_one_window_are_coalesced_with_continuous_offsets(
    autojump_clock: trio.testing.MockClock,
) -> None:
    h = Harness()
    stream, _ = h.broker.subscribe(deltas=True)
    await h.service.create(h.msg)
    words = ["Hello", " wörld", " 🙂", " again", " and", " more"]
    async with trio.open_nursery() as nursery:
        await nursery.start(h.service.run)
        await trio.sleep(1)  # a quiet window: the first append goes out at once
        for word in words[:3]:
            await h.feed(pb.TextDelta(word))
        frames = drain(stream)
        assert [f["type"] for f in frames] == ["message", "message_delta"]
        await trio.sleep(DEBOUNCE * 2)  # the window ends: the other two, coalesced
        for word in words[3:]:
            await h.feed(pb.TextDelta(word))
        await trio.sleep(DEBOUNCE * 2)
        frames += drain(stream)
        nursery.cancel_scope.cancel()
    deltas = [f["payload"]["payload"] for f in frames if f["type"] == "message_delta"]
    assert [(d["offset"], d["text"]) for d in deltas] == [
        (0, "Hello"),
        (5, " wörld 🙂"),  # code points: "ö" and "🙂" count one each
        (13, " again"),
        (19, " and more"),
    ]
    for before, after in itertools.pairwise(deltas):
        assert after["offset"] == before["offset"] + len(before["text"])
    seqs = [f["seq"] for f in frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one seq per change


async def test_non_appends_are_announced_whole(autojump_clock: trio.testing.MockClock) -> None:
    """Reasoning finished, a tool call started and finished, a retry's reset, the finish part:
    each is a ``message`` snapshot in delta mode too."""
    h = Harness()
    stream, _ = h.broker.subscribe(deltas=True)
    await h.service.create(h.msg)
    async with trio.open_nursery() as nursery:
        await nursery.start(h.service.run)
        script: list[pb.StreamEvent] = [
            pb.ReasoningDelta("think"),
            pb.ReasoningDone("sig"),
            pb.TextDelta("first try"),
            pb.Retrying(1, 0.0, "overloaded"),
            pb.TextDelta("second"),
            pb.ToolCallStart("c1", "bash"),
            pb.ToolCallDelta("c1", '{"command": '),
            pb.ToolCallDelta("c1", '"ls"}'),
            pb.ToolCallDone("c1", "bash", '{"command": "ls"}'),
        ]
        client = Assembled()
        kinds = []
        for event in script:
            await trio.sleep(1)  # every change in its own window
            await h.feed(event)
            await trio.sleep(1)
            got = drain(stream)
            kinds.append([f["type"] for f in got])
            assert all(client.apply(f) for f in got)
            if got:  # (a retry publishes nothing until the next change)
                assert fields(client.messages["m1"]) == fields(h.msg)
        await h.finish()
        got = drain(stream)
        assert all(client.apply(f) for f in got)
        kinds.append([f["type"] for f in got])
        nursery.cancel_scope.cancel()
    assert kinds[0] == ["message", "message_delta"]  # created, then the reasoning's first delta
    assert kinds[1] == ["message"]  # reasoning finished
    assert kinds[2] == ["message_delta"]
    assert kinds[3] == []  # the retry publishes nothing by itself...
    assert kinds[4] == ["message"]  # ...and the next change is whole (the text was dropped)
    assert kinds[5] == ["message"]  # a new tool call part is written at once
    assert kinds[6] == kinds[7] == ["message_delta"]  # its input grows by deltas
    assert kinds[8] == ["message"]  # finished
    assert kinds[9] == ["message"]  # the finish part
    assert client.messages["m1"] == h.rows["m1"] == h.msg


reply_text = st.text(alphabet=st.sampled_from(list("abc xyz\n.é€🙂")), min_size=1, max_size=120)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    reasoning=st.text(alphabet=st.sampled_from(list("hmm ok🤔")), max_size=40),
    text=reply_text,
    args=st.text(alphabet=st.sampled_from(list('{}":ab1 ')), max_size=40),
    cuts=st.lists(st.integers(0, 1000), max_size=40),
    delays=st.lists(st.sampled_from([0, 0, 0.005, 0.02, 0.04]), min_size=1, max_size=40),
)
def test_applying_every_delta_yields_the_stored_message(
    reasoning: str, text: str, args: str, cuts: list[int], delays: list[float]
) -> None:
    """Random chunkings and timings of a scripted reply: a delta-mode client that applies every
    frame holds, at each seq, exactly what the snapshot form of that seq says, and at the end
    the stored message."""

    async def main() -> None:
        h = Harness()
        deltas, _ = h.broker.subscribe(deltas=True)
        snaps, _ = h.broker.subscribe()  # so every seq has its snapshot form to compare with
        script: list[pb.StreamEvent] = [pb.ReasoningDelta(c) for c in chunk(reasoning, cuts)]
        if reasoning:
            script.append(pb.ReasoningDone("sig"))
        script += [pb.TextDelta(c) for c in chunk(text, cuts)]
        if args:
            script.append(pb.ToolCallStart("c1", "edit"))
            script += [pb.ToolCallDelta("c1", c) for c in chunk(args, cuts)]
        client = Assembled()
        by_seq: dict[int, list[tuple[str, str]]] = {}

        def check() -> None:
            for f in drain(snaps):
                if f["type"] == "message":
                    by_seq[f["seq"]] = fields(
                        wire.converter.structure(f["payload"]["payload"], Message)
                    )
            for f in drain(deltas):
                assert client.apply(f), f
                if f["seq"] in by_seq:
                    assert fields(client.messages["m1"]) == by_seq[f["seq"]]

        async with trio.open_nursery() as nursery:
            await nursery.start(h.service.run)
            await h.service.create(h.msg)
            for i, event in enumerate(script):
                await h.feed(event)
                await trio.sleep(delays[i % len(delays)])
                check()
            await trio.sleep(1)
            check()
            # Before the finish: everything streamed is there, from deltas (and snapshots).
            assert fields(client.messages["m1"]) == fields(h.msg)
            await h.finish()
            await h.service.flush_all()
            check()
            nursery.cancel_scope.cancel()
        assert client.messages["m1"] == h.rows["m1"]
        assert client.messages["m1"].text() == text
        assert client.gaps == 0
        assert deltas.dropped == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_a_dropped_delta_means_a_gap_then_a_reread_and_the_stream_continues(
    autojump_clock: trio.testing.MockClock,
) -> None:
    h = Harness(Broker(client_queue_size=3))
    stream, _ = h.broker.subscribe(deltas=True)
    await h.service.create(h.msg)
    words = [f"w{i}é " for i in range(40)]
    client = Assembled()
    async with trio.open_nursery() as nursery:
        await nursery.start(h.service.run)
        for word in words[:20]:  # the client does not read: its queue of 3 overflows
            await h.feed(pb.TextDelta(word))
            await trio.sleep(DEBOUNCE)
        assert stream.dropped > 0
        frames = drain(stream)
        assert "gap" in [f["type"] for f in frames]
        for frame in frames:
            if frame["type"] == "gap":
                break
            client.apply(frame)
        # The re-read (the stored message: flushed, as a listing does) while more text streams.
        await h.feed(pb.TextDelta(words[20]))
        await h.service.flush_session("s1")
        client.messages["m1"] = copy.deepcopy(h.rows["m1"])
        for word in words[21:]:
            await h.feed(pb.TextDelta(word))
            await trio.sleep(DEBOUNCE / 3)
            for frame in drain(stream):
                assert client.apply(frame), frame  # offsets <= what it has: no new hole
        await trio.sleep(1)
        for frame in drain(stream):
            assert client.apply(frame)
        nursery.cancel_scope.cancel()
    assert client.messages["m1"].text() == "".join(words) == h.msg.text()


async def test_resume_by_since_inside_and_outside_the_ring() -> None:
    broker = Broker(replay_size=5)
    msg = Message("m", "s", Role.ASSISTANT, [TextPart("")])
    broker.publish(msg, EventKind.CREATED)
    for i in range(10):
        broker.publish_delta(MessageDelta("m", "s", 0, DeltaPartType.TEXT, i, "x"), msg)
    # Inside: every delta after the cursor, in the delta form.
    _, frames = broker.subscribe(since=8, deltas=True)
    assert [(f["type"], f["seq"]) for f in decode(frames)] == [
        ("message_delta", 9),
        ("message_delta", 10),
        ("message_delta", 11),
    ]
    assert [f["payload"]["payload"]["offset"] for f in decode(frames)] == [7, 8, 9]
    # Outside: a gap for what fell off the ring, then the ring.
    _, frames = broker.subscribe(since=2, deltas=True)
    got = decode(frames)
    assert got[0]["type"] == "gap"
    assert got[0]["payload"] == {
        "dropped": 4,
        "from_seq": 3,
        "to_seq": 6,
    }
    assert [f["seq"] for f in got[1:]] == [7, 8, 9, 10, 11]


# -- through a real server -----------------------------------------------------------------------


def _config(tmp_path: Path, **server: Any) -> Path:
    path = tmp_path / "crush.json"
    path.write_text(orjson.dumps({"server": server}).decode())
    return path


async def _sse(
    url: str,
    wid: str,
    params: dict[str, str],
    stop: Any,
    out: list[Any],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Collect SSE frames into ``out`` until ``stop(frame)``; started once ``hello`` came."""
    async with httpx.AsyncClient(base_url=url, timeout=WAIT) as http:
        async with http.stream(
            "GET",
            f"/v1/workspaces/{wid}/events",
            params={"client_id": str(uuid.uuid4()), **params},
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    frame = orjson.loads(line[6:])
                    if frame["type"] == "hello":
                        task_status.started()
                        continue
                    out.append(frame)
                    if stop(frame):
                        return


def _is_complete(run_id: str) -> Any:
    return lambda f: f["type"] == "run_complete" and f["payload"]["payload"]["run_id"] == run_id


@pytest.mark.parametrize("transport", ["trio-websocket", "asgi", "sse"])
async def test_a_run_in_both_modes_over_every_transport(tmp_path: Path, transport: str) -> None:
    """A delta-mode and a snapshot-mode client watch the same run: the same seqs, deltas only
    for the one that asked, and both end with the stored messages."""
    ws_transport = "asgi" if transport == "asgi" else "trio-websocket"
    text = "".join(f"wörd{i} 🙂 " for i in range(300))
    gate = Gate()  # the reply pauses halfway: its first half goes out as deltas
    model = ScriptedModel([Step(text=text, gate_mid=gate)])
    async with running_server(
        tmp_path,
        config_file=_config(tmp_path, ws_transport=ws_transport),
        provider_factory=model,
    ) as server:
        wid = (await server.open_workspace())["id"]
        sid = (await server.create_session(wid))["id"]
        run_id = "r-" + uuid.uuid4().hex[:8]
        delta_frames: list[dict[str, Any]] = []
        snap_frames: list[dict[str, Any]] = []
        saw_delta = trio.Event()

        def stop_delta(frame: dict[str, Any]) -> bool:
            if frame["type"] == "message_delta":
                saw_delta.set()
            return bool(_is_complete(run_id)(frame))

        with trio.fail_after(WAIT * 3):
            if transport == "sse":
                async with trio.open_nursery() as nursery:
                    await nursery.start(
                        _sse, server.url, wid, {"deltas": "1"}, stop_delta, delta_frames
                    )
                    await nursery.start(
                        _sse, server.url, wid, {}, _is_complete(run_id), snap_frames
                    )
                    await server.prompt(wid, sid, text, run_id=run_id)
                    await saw_delta.wait()
                    gate.release()
            else:
                durl = ws_url(server.url, wid, str(uuid.uuid4())) + "&deltas=1"
                surl = ws_url(server.url, wid, str(uuid.uuid4()))
                async with event_socket(durl) as dsock, event_socket(surl) as ssock:
                    assert (await dsock.recv())["type"] == "hello"
                    assert (await ssock.recv())["type"] == "hello"
                    await server.prompt(wid, sid, text, run_id=run_id)
                    delta_frames = await dsock.until(lambda f: f["type"] == "message_delta")
                    gate.release()
                    delta_frames += await dsock.until(_is_complete(run_id))
                    snap_frames = await ssock.until(_is_complete(run_id))
        stored = {m["id"]: m for m in await server.messages(wid, sid)}
    delta_frames = [f for f in delta_frames if f["type"] != "hello"]
    snap_frames = [f for f in snap_frames if f["type"] != "hello"]
    assert [f["seq"] for f in delta_frames] == [f["seq"] for f in snap_frames]
    assert "gap" not in {f["type"] for f in delta_frames + snap_frames}
    assert "message_delta" not in {f["type"] for f in snap_frames}
    assert sum(f["type"] == "message_delta" for f in delta_frames) >= 1
    for d, s in zip(delta_frames, snap_frames, strict=True):
        if d["type"] == "message_delta":
            assert s["type"] == "message"
        else:
            assert d == s  # everything else is the same frame
    for frames in (delta_frames, snap_frames):
        client = Assembled()
        for f in frames:
            assert client.apply(f)
        assert {mid: wire.converter.unstructure(m) for mid, m in client.messages.items()} == {
            mid: m for mid, m in stored.items() if mid in client.messages
        }
    replies = [m for m in stored.values() if m["role"] == "assistant"]
    assert wire.converter.structure(replies[-1], Message).text() == text


async def test_resume_by_since_over_the_websocket_in_delta_mode(tmp_path: Path) -> None:
    text = "".join(f"token{i} " for i in range(200))
    gate = Gate()
    model = ScriptedModel([Step(text=text, gate_mid=gate)])
    async with running_server(tmp_path, provider_factory=model) as server:
        wid = (await server.open_workspace())["id"]
        sid = (await server.create_session(wid))["id"]
        with trio.fail_after(WAIT * 2):
            url = ws_url(server.url, wid, str(uuid.uuid4())) + "&deltas=1"
            async with event_socket(url) as sock:
                hello = await sock.recv()
                await server.prompt(wid, sid, text, run_id="r1")
                frames = await sock.until(lambda f: f["type"] == "message_delta")
                gate.release()
                frames += await sock.until(_is_complete("r1"))
            cut = next(f["seq"] for f in frames if f["type"] == "message_delta")
            async with event_socket(
                ws_url(server.url, wid, str(uuid.uuid4()), since=cut) + "&deltas=1"
            ) as again:
                assert (await again.recv())["type"] == "hello"
                replayed = await again.until(_is_complete("r1"))
        stored = await server.messages(wid, sid)
    assert replayed == [f for f in frames if f["seq"] > cut]
    assert hello["seq"] < cut
    # The frames after the cursor complete what the client had at the cursor.
    client = Assembled()
    for f in frames:
        if f["seq"] <= cut:
            assert client.apply(f)
    for f in replayed:
        assert client.apply(f)
    assert client.messages[stored[-1]["id"]].text() == text


async def test_resume_from_outside_the_ring_in_delta_mode_starts_with_a_gap(
    tmp_path: Path,
) -> None:
    text = "".join(f"token{i} " for i in range(100))
    gate = Gate()
    model = ScriptedModel([Step(text=text, gate_mid=gate)])
    config = _config(tmp_path, replay_buffer=4)
    async with running_server(tmp_path, config_file=config, provider_factory=model) as server:
        wid = (await server.open_workspace())["id"]
        sid = (await server.create_session(wid))["id"]
        with trio.fail_after(WAIT * 2):
            url = ws_url(server.url, wid, str(uuid.uuid4())) + "&deltas=1"
            async with event_socket(url) as sock:
                hello = await sock.recv()
                await server.prompt(wid, sid, text, run_id="r1")
                frames = await sock.until(lambda f: f["type"] == "message_delta")
                gate.release()
                frames += await sock.until(_is_complete("r1"))
            last = frames[-1]["seq"]
            assert last - hello["seq"] > 4
            async with event_socket(
                ws_url(server.url, wid, str(uuid.uuid4()), since=hello["seq"]) + "&deltas=1"
            ) as again:
                assert (await again.recv())["type"] == "hello"
                gap = await again.recv()
                replayed = await again.until(_is_complete("r1"))
        stored = await server.messages(wid, sid)
    oldest = replayed[0]["seq"]
    assert gap["type"] == "gap"
    assert gap["payload"] == {
        "dropped": oldest - 1 - hello["seq"],
        "from_seq": hello["seq"] + 1,
        "to_seq": oldest - 1,
    }
    assert replayed == frames[-len(replayed) :]
    # After the gap the client re-reads; what it re-reads is the stored reply.
    assert wire.converter.structure(stored[-1], Message).text() == text


@pytest.mark.parametrize(
    ("field", "value"),
    [("part_type", "image"), ("part", -1), ("offset", -3)],
)
def test_a_delta_with_a_bad_field_is_refused_by_the_converter(field: str, value: object) -> None:
    """The wire type is strict: an unknown part type or a negative index never structures."""
    good = {
        "message_id": "m",
        "session_id": "s",
        "part": 0,
        "part_type": "text",
        "offset": 0,
        "text": "hi",
    }
    assert (
        wire.structure(good, wire.MessageDelta, what="delta").part_type is wire.DeltaPartType.TEXT
    )
    with pytest.raises(BadRequest, match=field):
        wire.structure({**good, field: value}, wire.MessageDelta, what="delta")
