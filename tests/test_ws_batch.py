"""Frames of several envelopes (``batch=1`` on the event websocket, docs/protocol.md §6.1).

The first half drives :func:`~crush_trio.broker.batch_frames` and the compression of batches
without a server: which events go together, in what order, under which bound; that connections
sent the same events together share one frame and one compression; that a frame's events are
compressed as one group; and when connections whose frames group the same events differently (a
command's reply splits one of them, tests/test_broker_ticks.py) share one compressor. The second
half checks the wire through a real server: a connection that asked for batches reads the same
envelopes, in the same order, as one that did not, in fewer frames, compressed or not.
"""

from __future__ import annotations

import uuid
import zlib
from typing import TYPE_CHECKING, Any

import orjson
import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from crush_trio.broker import (
    MAX_BATCH_BYTES,
    BatchCache,
    Event,
    batch_frames,
    batch_groups,
    connection_frame,
)
from crush_trio.client import open_event_socket
from crush_trio.errors import BadRequest
from crush_trio.providers.scripted import ScriptedModel, Step
from crush_trio.server.connection import parse_subscription
from crush_trio.wsdeflate import BoundedDeflate

from .conftest import TOKEN, WAIT, running_server

if TYPE_CHECKING:
    from pathlib import Path


def event(seq: int, type: str = "message_delta", size: int = 40) -> Event:
    text = orjson.dumps({"seq": seq, "type": type, "payload": {"pad": "x" * size}}).decode()
    return Event(seq, type, text, must_deliver=type == "run_complete")


def lines(text: str | bytes) -> list[Any]:
    """The envelopes of one frame's text, as a client reads them: one per line."""
    parts = text.split("\n") if isinstance(text, str) else text.split(b"\n")
    return [orjson.loads(line) for line in parts if line]


def envelopes(frames: list[Event]) -> list[Any]:
    """The envelopes a client reads from ``frames``."""
    return [envelope for frame in frames for envelope in lines(frame.text)]


def test_consecutive_events_go_in_one_frame_and_a_connections_own_frames_alone() -> None:
    cache = BatchCache()
    hello = connection_frame(0, "hello", {"workspace_id": "w"})
    reply = Event(0, "reply", '{"type":"reply","id":1}', False)
    gap = connection_frame(9, "gap", {"dropped": 1, "from_seq": 3, "to_seq": 3})
    e = [event(i) for i in range(1, 8)]
    sent = [hello, e[0], e[1], e[2], reply, e[3], gap, e[4], e[5], e[6]]
    frames = batch_frames(sent, cache)
    assert [f.type for f in frames] == ["hello", "batch", "reply", "message_delta", "gap", "batch"]
    assert [frames[i] for i in (0, 2, 3, 4)] == [hello, reply, e[3], gap]
    # Read in order, the frames carry exactly what was sent.
    assert envelopes(frames) == [orjson.loads(x.text) for x in sent]
    assert (frames[1].seq, frames[5].seq) == (3, 7)
    assert frames[1].size == len(frames[1].text.encode())
    # A lone event is its own frame: no array of one.
    assert batch_frames([e[0]], cache) == [e[0]]


def test_a_batch_is_bounded_and_a_large_event_goes_alone() -> None:
    cache = BatchCache()
    small = [event(i, size=1000) for i in range(1, 80)]
    big = event(80, "message", size=MAX_BATCH_BYTES)
    frames = batch_frames([*small, big, event(81)], cache)
    assert all(f.size <= MAX_BATCH_BYTES for f in frames if f.type == "batch")
    assert sum(f.type == "batch" for f in frames) >= 2
    assert big in frames
    assert (frames[-1].seq, frames[-1].type) == (81, "message_delta")
    assert [x["seq"] for x in envelopes(frames)] == list(range(1, 82))
    # A must-deliver event makes its batch must-deliver.
    complete = batch_frames([event(90), event(91, "run_complete")], cache)
    assert complete[0].must_deliver


def test_connections_sent_the_same_events_share_one_frame() -> None:
    cache = BatchCache(size=4)
    e = [event(i) for i in range(1, 10)]
    first = batch_frames(e[:5], cache)
    again = batch_frames(list(e[:5]), cache)
    assert first[0] is again[0]  # one text, one websocket frame, one compression
    assert first[0].ws_frame is again[0].ws_frame
    # Other events together (a connection that missed one): another frame.
    other = batch_frames([e[0], *e[2:5]], cache)
    assert other[0] is not first[0]
    # The cache is bounded: the oldest batches go.
    for start in range(5):
        batch_frames(e[start : start + 3], cache)
    assert len(cache) == 4
    assert batch_frames(e[:5], cache)[0] is not first[0]


def inflate_frames(data: bytes, inflater: Any) -> list[str]:
    """The texts of the compressed websocket frames in ``data`` (as a client inflates them)."""
    texts = []
    while data:
        assert data[0] == 0xC1  # FIN, RSV1, text
        size, start = data[1] & 0x7F, 2
        if size == 126:
            size, start = int.from_bytes(data[2:4], "big"), 4
        payload, data = data[start : start + size], data[start + size :]
        texts.append(inflater.decompress(payload + b"\x00\x00\xff\xff").decode())
    return texts


def test_connections_grouped_differently_share_one_compressor() -> None:
    """One connection gets its events in two frames (a reply came between them: what it held
    before the reply is written at once, ahead of the others), the other in one, compressed
    after them: its frame is the two logged pieces joined, so both stay on one compressor, and
    each reads its envelopes back in order."""
    a, b = BoundedDeflate(1 << 20), BoundedDeflate(1 << 20)
    cache = BatchCache()
    e = [event(i) for i in range(1, 9)]
    a_frames = b"".join(a.frame_group(g, cache.get) for g in batch_groups(e[:3]))
    a_frames += b"".join(a.frame_group(g, cache.get) for g in batch_groups(e[3:]))
    b_frames = b"".join(b.frame_group(g, cache.get) for g in batch_groups(e))
    assert a._line_lane is b._line_lane  # one compressor for both: each event compressed once
    inflate_a, inflate_b = zlib.decompressobj(-15), zlib.decompressobj(-15)
    read_a = inflate_frames(a_frames, inflate_a)
    read_b = inflate_frames(b_frames, inflate_b)
    assert (len(read_a), len(read_b)) == (2, 1)
    expected = [orjson.loads(x.text) for x in e]
    assert [x for t in read_a for x in lines(t)] == expected
    assert [x for t in read_b for x in lines(t)] == expected
    # A lone event is its line too, in the same window (the inflaters carry on).
    more = event(9)
    for deflate, inflater in ((a, inflate_a), (b, inflate_b)):
        (text,) = inflate_frames(deflate.frame_group([more], cache.get), inflater)
        assert lines(text) == [orjson.loads(more.text)]
    assert a._line_lane is b._line_lane


def test_a_frames_events_are_one_compressed_group_that_followers_send_as_logged() -> None:
    """The events of one frame are compressed together, with one flush: fewer bytes than a
    frame each; a connection sent the same frame sends the logged bytes (one compression)."""
    a, b, c = BoundedDeflate(1 << 20), BoundedDeflate(1 << 20), BoundedDeflate(1 << 20)
    cache = BatchCache()
    e = [event(i) for i in range(1, 9)]
    together = a.frame_group(e, cache.get)
    assert b.frame_group(e, cache.get) == together
    assert a._line_lane is b._line_lane
    lane = a._line_lane
    assert lane is not None
    assert (lane.head, len(lane.groups)) == (8, 1)
    one_by_one = b"".join(c.frame_group([x], cache.get) for x in e)
    assert c._line_lane is not lane  # its first frame ends inside the lane's first group
    assert len(together) < len(one_by_one)
    expected = [orjson.loads(x.text) for x in e]
    (text,) = inflate_frames(together, zlib.decompressobj(-15))
    assert lines(text) == expected
    texts = inflate_frames(one_by_one, zlib.decompressobj(-15))
    assert [x for t in texts for x in lines(t)] == expected


def test_a_connection_whose_frame_ends_inside_a_logged_group_leaves_the_lane() -> None:
    """The connection compressed first sent eight events in one frame; another gets them in two
    (its writer took them in two parts): it cannot send part of the logged piece, so it
    compresses its own, and both read their envelopes in order."""
    a, b = BoundedDeflate(1 << 20), BoundedDeflate(1 << 20)
    cache = BatchCache()
    e = [event(i) for i in range(1, 10)]
    a_frames = a.frame_group(e[:8], cache.get)
    b_frames = b.frame_group(e[:3], cache.get) + b.frame_group(e[3:8], cache.get)
    assert a._line_lane is not b._line_lane
    inflate_a, inflate_b = zlib.decompressobj(-15), zlib.decompressobj(-15)
    expected = [orjson.loads(x.text) for x in e]
    (text,) = inflate_frames(a_frames, inflate_a)
    assert lines(text) == expected[:8]
    assert [x for t in inflate_frames(b_frames, inflate_b) for x in lines(t)] == expected[:8]
    # Each carries on in its own lane.
    for deflate, inflater in ((a, inflate_a), (b, inflate_b)):
        (text,) = inflate_frames(deflate.frame_group([e[8]], cache.get), inflater)
        assert lines(text) == expected[8:]


def test_the_batch_query_is_parsed_with_the_stream() -> None:
    cid = str(uuid.uuid4())
    assert parse_subscription({"client_id": cid}).batch is False
    assert parse_subscription({"client_id": cid, "batch": "0"}).batch is False
    assert parse_subscription({"client_id": cid, "batch": "1"}).batch is True
    with pytest.raises(BadRequest) as info:
        parse_subscription({"client_id": cid, "batch": "yes"})
    assert "batch must be 1" in str(info.value)


async def read_until_seq(sock: Any, last: int) -> tuple[list[Any], int]:
    """Envelopes up to ``seq`` ``last``, and how many frames carried them."""
    seen: list[Any] = []
    frames = 0
    async for raw in sock:
        frames += 1
        seen += lines(raw)
        if seen[-1]["seq"] >= last:
            return seen, frames
    raise AssertionError(f"the stream ended before seq {last}")


@pytest.mark.parametrize("compression", [False, True])
async def test_a_resumed_connection_gets_the_same_envelopes_in_fewer_frames(
    tmp_path: Path, compression: bool
) -> None:
    text = "".join(f"token{i} " for i in range(50))
    model = ScriptedModel([Step(text=text, token_delay=0.002)])
    async with running_server(tmp_path, provider_factory=model) as server:
        wid = (await server.open_workspace())["id"]
        with trio.fail_after(WAIT * 2):
            async with open_event_socket(server.url, wid, TOKEN) as watch:
                for _ in range(25):
                    sid = (await server.create_session(wid))["id"]
                run_id = str(uuid.uuid4())
                await server.prompt(wid, sid, "hi", run_id=run_id)
                async for raw in watch:
                    if orjson.loads(raw)["type"] == "run_complete":
                        break
            got: dict[bool, tuple[list[Any], int]] = {}
            for batch in (False, True):
                async with open_event_socket(
                    server.url, wid, TOKEN, since=0, batch=batch, compression=compression
                ) as sock:
                    assert sock.compressed is compression
                    last = sock.hello["seq"]  # the replay ends there: nothing is published
                    got[batch] = await read_until_seq(sock, last)
    (plain, plain_frames), (batched, batch_frames_read) = got[False], got[True]
    # The same envelopes, in the same order (the session's last updates may come between the
    # two connections: the second then replays a little more).
    last = plain[-1]["seq"]
    assert [x for x in batched if x["seq"] <= last] == plain
    assert [x["seq"] for x in plain] == list(range(1, last + 1))
    assert plain_frames == len(plain) > 25
    assert batch_frames_read < plain_frames / 4


async def test_live_events_written_together_come_in_one_frame(tmp_path: Path) -> None:
    """Three replies stream at once: what a publish pass writes together reaches a batch client
    in fewer frames, and it reads the same envelopes as a client without batches."""
    text = "".join(f"token{i} " for i in range(40))
    model = ScriptedModel([Step(text=text, token_delay=0.005) for _ in range(3)])
    async with running_server(tmp_path, provider_factory=model) as server:
        wid = (await server.open_workspace())["id"]
        sids = [(await server.create_session(wid))["id"] for _ in range(3)]
        with trio.fail_after(WAIT * 2):
            async with (
                open_event_socket(server.url, wid, TOKEN) as plain,
                open_event_socket(server.url, wid, TOKEN, batch=True) as batched,
            ):
                async with trio.open_nursery() as nursery:
                    for sid in sids:
                        nursery.start_soon(server.prompt, wid, sid, "hi")
                got = {}
                for name, sock in (("plain", plain), ("batched", batched)):
                    seen: list[Any] = []
                    frames = 0
                    async for raw in sock:
                        frames += 1
                        seen += lines(raw)
                        if sum(x["type"] == "run_complete" for x in seen) == 3:
                            break
                    got[name] = (seen, frames)
    (plain_seen, plain_frames), (batch_seen, batch_frames_read) = got["plain"], got["batched"]
    # A frame may carry events after the last run_complete: compare up to it.
    batch_seen = batch_seen[: len(plain_seen)]
    assert [x["seq"] for x in batch_seen] == [x["seq"] for x in plain_seen]
    assert [x["type"] for x in batch_seen] == [x["type"] for x in plain_seen]
    assert batch_frames_read < plain_frames


@pytest.mark.parametrize("value", ["2", "yes", "%C3%A9", "1" * 5000])
async def test_a_bad_batch_value_refuses_the_upgrade_and_the_server_stays_up(
    tmp_path: Path, value: str
) -> None:
    async with running_server(tmp_path) as server:
        wid = (await server.open_workspace())["id"]
        with trio.fail_after(WAIT):
            with pytest.raises(ConnectionRejected) as info:
                async with open_websocket_url(
                    server.ws_url(wid, str(uuid.uuid4())) + f"&batch={value}"
                ):
                    pass
            assert info.value.status_code == 400
            assert b"batch must be 1" in (info.value.body or b"")
            # A good value opens the stream afterwards.
            async with open_event_socket(server.url, wid, TOKEN, batch=True) as sock:
                assert sock.hello["type"] == "hello"
