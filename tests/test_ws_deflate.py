"""permessage-deflate on the event websocket (PROTOCOL §5, ``crush_trio.wsdeflate``).

* A client that offers it gets compressed frames (RSV1 set on the wire) and decodes exactly the
  stream an uncompressed client gets: same seqs, same payloads, live and replayed by ``since``,
  whatever parameters it offers (context takeover or not, a smaller server window).
* A client that does not offer it gets today's frames, unchanged.
* A compressed command that inflates past ``server.max_body_bytes`` (a deflate bomb) closes the
  connection with 1009 without being inflated whole; an offer that does not parse is declined.

Every wait is bounded by ``trio.fail_after``; order comes from frames, never from sleeping.
"""

from __future__ import annotations

import contextlib
import tracemalloc
import uuid
import zlib
from typing import TYPE_CHECKING, Any

import orjson
import pytest
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import Connection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Event,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.extensions import Extension, PerMessageDeflate

from crush_trio.broker import Event as BrokerEvent
from crush_trio.client import WorkspaceClient, open_event_socket
from crush_trio.config import DEFAULT_MAX_BODY_BYTES
from crush_trio.providers.scripted import ScriptedModel, Step
from crush_trio.server.commands import reply_frame
from crush_trio.wsdeflate import LANE_LOG, LANE_LOG_BYTES, BoundedDeflate, Cohort
from tests.conftest import running_server

if TYPE_CHECKING:
    from pathlib import Path

    from crush_trio.testing import CrushServer

#: Cap on every test's waits (seconds).
CAP = 20
#: The reply of the runs watched here: several words, a pause between them, so several deltas.
REPLY = " ".join(f"word{i} and some more text" for i in range(12))


def reply_step() -> Step:
    return Step(REPLY, token_delay=0.01)


def mask(payload: bytes, key: bytes = b"\x01\x02\x03\x04") -> bytes:
    n = len(payload)
    keys = (key * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(keys, "big")).to_bytes(n, "big")


def client_frame(payload: bytes, first_byte: int) -> bytes:
    """One masked client frame (``first_byte``: FIN, RSV bits and opcode)."""
    n = len(payload)
    if n < 126:
        header = bytes((first_byte, 0x80 | n))
    elif n < 1 << 16:
        header = bytes((first_byte, 0x80 | 126)) + n.to_bytes(2, "big")
    else:
        header = bytes((first_byte, 0x80 | 127)) + n.to_bytes(8, "big")
    key = b"\x01\x02\x03\x04"
    return header + key + mask(payload, key)


def deflate_bomb(inflated: int) -> bytes:
    """A permessage-deflate payload that inflates to ``inflated`` zero bytes (about 1,000 : 1)."""
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = b"\0" * (1 << 20)
    parts = [comp.compress(chunk) for _ in range(inflated // len(chunk))]
    parts.append(comp.flush(zlib.Z_SYNC_FLUSH)[:-4])
    return b"".join(parts)


class RawSocket:
    """A websocket client on a bare TCP stream with wsproto: it sees the frames' first bytes."""

    def __init__(self, stream: trio.SocketStream, ws: WSConnection) -> None:
        self.stream = stream
        self.ws = ws
        self.response_extensions: list[str] = []
        #: The first byte of every frame the server sent (FIN, RSV1..3, opcode).
        self.first_bytes: list[int] = []
        self._raw = b""
        self._head_done = False
        self._pending: list[Event] = []

    def _scan(self, data: bytes) -> None:
        """Record the first byte of each server frame (unmasked: header + payload length)."""
        self._raw += data
        if not self._head_done:
            end = self._raw.find(b"\r\n\r\n")
            if end < 0:
                return
            self._head_done = True
            self._raw = self._raw[end + 4 :]
        while len(self._raw) >= 2:
            size = self._raw[1] & 0x7F
            at = 2
            if size == 126:
                if len(self._raw) < 4:
                    return
                size, at = int.from_bytes(self._raw[2:4], "big"), 4
            elif size == 127:
                if len(self._raw) < 10:
                    return
                size, at = int.from_bytes(self._raw[2:10], "big"), 10
            if len(self._raw) < at + size:
                return
            self.first_bytes.append(self._raw[0])
            self._raw = self._raw[at + size :]

    async def next_event(self) -> Event | None:
        while not self._pending:
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self._scan(data)
            self.ws.receive_data(data)
            self._pending.extend(self.ws.events())
        return self._pending.pop(0)

    async def messages_until(self, run_id: str | None) -> list[dict[str, Any]]:
        """Decoded frames up to the ``run_complete`` of ``run_id`` (None: the first frame)."""
        frames: list[dict[str, Any]] = []
        parts: list[str] = []
        while (event := await self.next_event()) is not None:
            if isinstance(event, TextMessage):
                parts.append(event.data)
                if not event.message_finished:
                    continue
                frame = orjson.loads("".join(parts))
                parts = []
                frames.append(frame)
                if run_id is None or (
                    frame["type"] == "run_complete"
                    and frame["payload"]["payload"]["run_id"] == run_id
                ):
                    return frames
            elif isinstance(event, CloseConnection):
                raise AssertionError(f"closed {event.code} {event.reason}")
        raise AssertionError("the connection ended")


async def open_raw(
    server: CrushServer, wid: str, extensions: list[Extension], since: int | None = None
) -> RawSocket:
    port = int(server.url.rsplit(":", 1)[1])
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    ws = WSConnection(ConnectionType.CLIENT)
    query = f"client_id={uuid.uuid4()}&deltas=1" + ("" if since is None else f"&since={since}")
    request = Request(
        host=f"127.0.0.1:{port}",
        target=f"/v1/workspaces/{wid}/ws?{query}",
        extensions=extensions,
        extra_headers=[(b"authorization", f"Bearer {server.token}".encode())],
    )
    await stream.send_all(ws.send(request))
    raw = RawSocket(stream, ws)
    event = await raw.next_event()
    if isinstance(event, RejectConnection):
        raise AssertionError(f"refused: {event.status_code}")
    assert isinstance(event, AcceptConnection)
    raw.response_extensions = [repr(e) for e in event.extensions]
    return raw


def comparable(frames: list[dict[str, Any]]) -> list[tuple[int, str, bytes]]:
    return [(f["seq"], f["type"], orjson.dumps(f["payload"])) for f in frames]


@pytest.mark.parametrize(
    "offer",
    [
        {},
        {"server_no_context_takeover": True},
        {"server_max_window_bits": 9},
        {"client_max_window_bits": 10, "client_no_context_takeover": True},
    ],
    ids=["takeover", "server_no_context_takeover", "server_window_9", "client_params"],
)
async def test_a_compressed_client_decodes_the_same_stream_as_an_uncompressed_one(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    offer: dict[str, Any],
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    scripted_model.add(reply_step(), reply_step())
    with trio.fail_after(CAP):
        plain = await open_raw(crush_server, ws.id, [])
        deflated = await open_raw(crush_server, ws.id, [PerMessageDeflate(**offer)])
        hello_plain = (await plain.messages_until(None))[0]
        hello_deflated = (await deflated.messages_until(None))[0]
        assert hello_plain["type"] == hello_deflated["type"] == "hello"
        handle = await ws.prompt(session.id, "stream a reply")
        got_plain = await plain.messages_until(handle.run_id)
        got_deflated = await deflated.messages_until(handle.run_id)
        await handle.wait(CAP)

        # Negotiated only with the client that offered it; every frame of that one but its hello
        # is compressed (RSV1, 0x40), none of the other's is.
        assert plain.response_extensions == []
        assert deflated.response_extensions
        assert "PerMessageDeflate" in deflated.response_extensions[0]
        assert plain.first_bytes
        assert all(b == 0x81 for b in plain.first_bytes)
        assert deflated.first_bytes[0] == 0x81  # the hello: a connection frame, uncompressed
        assert len(deflated.first_bytes) > 3
        assert all(b == 0xC1 for b in deflated.first_bytes[1:])
        # Several deltas, decoded identically: same seqs, same payloads.
        assert sum(f["type"] == "message_delta" for f in got_plain) >= 3
        assert comparable(got_deflated) == comparable(got_plain)

        # Replay: resuming with `since` over a compressed connection gives the same frames.
        since = got_plain[0]["seq"]
        again = await open_raw(crush_server, ws.id, [PerMessageDeflate(**offer)], since=since)
        replayed = await again.messages_until(handle.run_id)
        assert len(again.first_bytes) > 3
        assert all(b == 0xC1 for b in again.first_bytes[1:])
        assert comparable(replayed[1:]) == comparable(got_plain[1:])  # after the hello
        for raw in (plain, deflated, again):
            await raw.stream.aclose()


async def test_the_client_library_offers_compression_and_moves_fewer_bytes(
    crush_server: CrushServer, crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    scripted_model.add(reply_step())
    texts: dict[bool, list[str]] = {True: [], False: []}
    with trio.fail_after(CAP):
        async with (
            open_event_socket(crush_server.url, ws.id, crush_server.token) as packed,
            open_event_socket(
                crush_server.url, ws.id, crush_server.token, compression=False
            ) as plain,
        ):
            assert packed.compressed
            assert not plain.compressed
            handle = await ws.prompt(session.id, "stream a reply")
            for sock, compressed in ((packed, True), (plain, False)):
                async for text in sock:
                    texts[compressed].append(text)
                    if '"run_complete"' in text and handle.run_id in text:
                        break
            await handle.wait(CAP)
            assert texts[True] == texts[False]
            decoded = sum(len(t.encode()) for t in texts[True])
            # The plain socket carries at least the decoded text; the compressed one far less.
            assert plain.wire_bytes > decoded
            assert packed.wire_bytes < plain.wire_bytes / 2


async def test_a_deflate_bomb_command_is_closed_with_1009_and_the_server_stays_up(
    crush_server: CrushServer, crush_workspace: WorkspaceClient
) -> None:
    ws = crush_workspace
    limit = DEFAULT_MAX_BODY_BYTES
    bomb = deflate_bomb(16 * limit)
    assert len(bomb) < limit // 64  # small on the wire
    with trio.fail_after(CAP):
        raw = await open_raw(crush_server, ws.id, [PerMessageDeflate()])
        await raw.messages_until(None)  # the hello
        await raw.stream.send_all(client_frame(bomb, 0xC1))  # FIN, RSV1, text
        closes = []
        while (event := await raw.next_event()) is not None:
            if isinstance(event, CloseConnection):
                closes.append(event)
                break
        assert [c.code for c in closes] == [1009]
        assert "inflated" in (closes[0].reason or "")
        await raw.stream.aclose()
        # The server goes on serving websockets.
        async with open_event_socket(crush_server.url, ws.id, crush_server.token) as sock:
            assert sock.compressed
            assert sock.hello["type"] == "hello"


def test_inflating_a_bomb_stays_within_the_bound() -> None:
    """The extension inflates at most the bound (plus one byte) before refusing: wsproto's own
    permessage-deflate would inflate the whole 64 MiB first."""
    bound = 1 << 20
    ext = BoundedDeflate(bound)
    assert ext.accept("permessage-deflate") is not None
    assert ext.enabled()
    conn = Connection(ConnectionType.SERVER, extensions=[ext])
    frame = client_frame(deflate_bomb(64 * bound), 0xC1)
    tracemalloc.start()
    try:
        conn.receive_data(frame)
        events = list(conn.events())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ext.overflowed
    assert [e.code for e in events if isinstance(e, CloseConnection)] == [1009]
    assert peak < 8 * bound


def test_a_compressed_command_within_the_bound_is_inflated() -> None:
    ext = BoundedDeflate(1 << 20)
    assert ext.accept("permessage-deflate") is not None
    assert ext.enabled()
    conn = Connection(ConnectionType.SERVER, extensions=[ext])
    comp = zlib.compressobj(6, zlib.DEFLATED, -15)
    text = orjson.dumps({"id": "1", "type": "ping", "payload": "x" * 5000})
    payload = (comp.compress(text) + comp.flush(zlib.Z_SYNC_FLUSH))[:-4]
    # Two fragments: RSV1 on the first only.
    conn.receive_data(client_frame(payload[:10], 0x41) + client_frame(payload[10:], 0x80))
    messages = [e for e in conn.events() if isinstance(e, TextMessage)]
    assert "".join(m.data for m in messages).encode() == text
    assert not ext.overflowed


@pytest.mark.parametrize(
    "offer",
    [
        "permessage-deflate; server_max_window_bits=abc",
        "permessage-deflate; client_max_window_bits=99",
    ],
)
async def test_an_offer_that_does_not_parse_is_declined(
    crush_server: CrushServer, crush_workspace: WorkspaceClient, offer: str
) -> None:
    class Verbatim(PerMessageDeflate):
        def offer(self) -> str:
            return offer.split("; ", 1)[1]

    with trio.fail_after(CAP):
        raw = await open_raw(crush_server, crush_workspace.id, [Verbatim()])
        (hello,) = await raw.messages_until(None)
        assert hello["type"] == "hello"
        assert raw.response_extensions == []
        assert raw.first_bytes == [0x81]
        await raw.stream.aclose()


@pytest.mark.parametrize("no_takeover", [False, True])
def test_frames_of_one_connection_decode_in_order_compressed_or_not(no_takeover: bool) -> None:
    """The server's frames on a compressing connection: small events compressed into the
    connection's window, connection frames and events over the size bound sent as the shared
    uncompressed frame (RSV1 clear); a standard inflater reads them all, in order."""
    server = BoundedDeflate(1 << 20)
    offer = "permessage-deflate" + ("; server_no_context_takeover" if no_takeover else "")
    assert server.accept(offer) is not None
    texts = [
        orjson.dumps({"seq": 1, "type": "hello", "payload": {}}).decode(),
        *[
            orjson.dumps(
                {"seq": n, "type": "message_delta", "payload": {"text": f"t{n} "}}
            ).decode()
            for n in range(2, 6)
        ],
        orjson.dumps({"seq": 6, "type": "message", "payload": {"text": "x" * 70_000}}).decode(),
        orjson.dumps({"seq": 7, "type": "message_delta", "payload": {"text": "after"}}).decode(),
        orjson.dumps({"seq": 7, "type": "gap", "payload": {"dropped": 1}}).decode(),
        orjson.dumps({"seq": 8, "type": "message_delta", "payload": {"text": "end"}}).decode(),
    ]
    events = [BrokerEvent(orjson.loads(t)["seq"], orjson.loads(t)["type"], t, False) for t in texts]
    frames = [server.frame(e) for e in events]
    assert [f[0] for f in frames] == [0x81, 0xC1, 0xC1, 0xC1, 0xC1, 0x81, 0xC1, 0x81, 0xC1]
    assert frames[5] is events[5].ws_frame
    assert frames[0] is events[0].ws_frame  # shared bytes
    client_ext = PerMessageDeflate()
    client_ext.finalize(offer)
    client = Connection(ConnectionType.CLIENT, extensions=[client_ext])
    client.receive_data(b"".join(frames))
    got: list[str] = []
    parts: list[str] = []
    for event in client.events():
        assert isinstance(event, TextMessage)
        parts.append(event.data)
        if event.message_finished:
            got.append("".join(parts))
            parts = []
    assert got == texts


async def test_a_deflate_bomb_on_the_framework_websocket_ends_within_the_bound(
    tmp_path: Path,
) -> None:
    """The ``"asgi"`` transport's websocket (hypercorn's) inflates with the same bound: a bomb
    ends the connection as it passes the bound (hypercorn closes a connection whose frames fail
    to parse without a close frame) instead of being inflated whole first (64 MiB here)."""
    config = tmp_path / "crush.json"
    config.write_text('{"server": {"ws_transport": "asgi"}}')
    limit = DEFAULT_MAX_BODY_BYTES
    bomb = deflate_bomb(16 * limit)
    async with running_server(tmp_path, config_file=config) as server:
        ws = await server.open_workspace()
        with trio.fail_after(CAP):
            raw = await open_raw(server, ws["id"], [PerMessageDeflate()])  # type: ignore[arg-type]
            assert "PerMessageDeflate" in raw.response_extensions[0]
            await raw.messages_until(None)  # the hello
            tracemalloc.start()
            try:
                with contextlib.suppress(trio.BrokenResourceError):  # closed before it all went
                    await raw.stream.send_all(client_frame(bomb, 0xC1))
                codes = []
                while (event := await raw.next_event()) is not None:
                    if isinstance(event, CloseConnection):
                        codes.append(event.code)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert codes in ([], [1009])  # the connection ended
            assert peak < 3 * limit, f"inflating took {peak} bytes"
            await raw.stream.aclose()
            assert (await server.http.get("/v1/health")).status_code == 200


def _delta(seq: int, text: str) -> BrokerEvent:
    body = orjson.dumps({"seq": seq, "type": "message_delta", "payload": {"text": text}}).decode()
    return BrokerEvent(seq, "message_delta", body, False)


class _Sent:
    """What each of some connections was sent: its frames, and the texts of their events."""

    def __init__(self, conns: list[BoundedDeflate]) -> None:
        self.conns = conns
        self.frames: list[list[bytes]] = [[] for _ in conns]
        self.texts: list[list[str]] = [[] for _ in conns]

    def send(self, i: int, event: BrokerEvent) -> bytes:
        frame = self.conns[i].frame(event)
        self.frames[i].append(frame)
        self.texts[i].append(event.text)
        return frame


def _decoded(offer: str, frames: list[bytes]) -> list[str]:
    """What a standard client that negotiated ``offer`` reads from ``frames``."""
    client_ext = PerMessageDeflate()
    client_ext.finalize(offer)
    client = Connection(ConnectionType.CLIENT, extensions=[client_ext])
    client.receive_data(b"".join(frames))
    got = []
    for event in client.events():
        assert isinstance(event, TextMessage)
        assert event.message_finished
        got.append(event.data)
    return got


@pytest.mark.parametrize("no_takeover", [False, True])
def test_connections_that_got_the_same_frames_share_their_compression(no_takeover: bool) -> None:
    """Connections that were sent the same events in the same order share one compressor
    (a :class:`~crush_trio.wsdeflate.Lane`; without context takeover, the state every frame
    starts from): one compression per event, the same bytes for all. One that gets another
    event (its own), or falls behind, still reads exactly its own events."""
    offer = "permessage-deflate" + ("; server_no_context_takeover" if no_takeover else "")
    conns = []
    for _ in range(4):
        conn = BoundedDeflate(1 << 20)
        assert conn.accept(offer) is not None
        conns.append(conn)
    events = [_delta(n, f"token {n} of a reply that repeats itself ") for n in range(1, 41)]
    own = _delta(0, "a reply to this connection's command")
    record = _Sent(conns)
    send, sent, texts = record.send, record.frames, record.texts

    lagging: list[BrokerEvent] = []
    for n, event in enumerate(events):
        together = [send(i, event) for i in (0, 1)]
        assert together[0] is together[1]  # compressed once, the bytes shared
        if n == 10:
            send(2, own)  # connection 2 takes another turn here ...
        send(2, event)  # ... and stays in step with 0 and 1 from its own state
        if n < 5 or n >= 35:
            send(3, event)  # connection 3 keeps up, then falls behind for 30 events ...
        else:
            lagging.append(event)
        if n == 34:
            for late in lagging:  # ... and catches up after the others' states are gone
                send(3, late)
    assert all(texts[3].count(e.text) == 1 for e in events)
    for i in range(4):
        assert _decoded(offer, sent[i]) == texts[i]
    if no_takeover:  # every frame compressed from the first state: shared whatever the order
        assert sent[2][12] is sent[0][11]
    else:
        assert sent[2][12] is not sent[0][11]  # after its own turn: its own compression
        # With context takeover each frame points back at the ones before it.
        assert sum(len(f) for f in sent[0]) < sum(len(e.ws_frame) for e in events) / 2


def test_a_command_reply_keeps_its_connection_in_step_with_the_others() -> None:
    """A command's reply goes out uncompressed (RSV1 clear, outside the window), so the
    connection that sent the command still shares the others' compression afterwards, and
    reads every frame."""
    offer = "permessage-deflate"
    conns = [BoundedDeflate(1 << 20) for _ in range(2)]
    for conn in conns:
        assert conn.accept(offer) is not None
    events = [_delta(n, f"token {n} of a reply that repeats itself ") for n in range(1, 21)]
    reply = reply_frame({"type": "reply", "id": "c1", "ok": True, "result": {"run_id": "r1"}})
    sent: list[list[bytes]] = [[], []]
    texts: list[list[str]] = [[], []]
    for n, event in enumerate(events):
        if n == 5:
            frame = conns[1].frame(reply)
            assert frame is reply.ws_frame  # the shared uncompressed frame
            assert frame[0] == 0x81  # FIN, text, RSV1 clear
            sent[1].append(frame)
            texts[1].append(reply.text)
        frames = [conn.frame(event) for conn in conns]
        assert frames[0] is frames[1]  # still compressed once for both
        for i, frame in enumerate(frames):
            sent[i].append(frame)
            texts[i].append(event.text)
    for i in range(2):
        assert _decoded(offer, sent[i]) == texts[i]


def test_a_lane_compresses_each_event_once_and_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Connections in step share one compressor that advances in place: one compression per
    event whatever the number of connections, and no copy of the compressor's state (a copy
    costs several times a small event's compression)."""
    copies: list[int] = []  # calls of Cohort.send
    compressions: list[int] = []
    real_compress = Cohort._compress

    def counted(deflater: Any, shared: bytes) -> bytes:
        compressions.append(1)
        return real_compress(deflater, shared)

    monkeypatch.setattr(Cohort, "_compress", staticmethod(counted))
    # The shared states that copy a compressor where connections part are not used at all.
    monkeypatch.setattr(Cohort, "send", lambda *args: copies.append(1))
    conns = [BoundedDeflate(1 << 20) for _ in range(3)]
    for conn in conns:
        assert conn.accept("permessage-deflate") is not None
    events = [_delta(n, f"token {n} of a reply that repeats itself ") for n in range(1, 31)]
    sent: list[list[bytes]] = [[] for _ in conns]
    for event in events:
        frames = [conn.frame(event) for conn in conns]
        assert frames[0] is frames[1] is frames[2]
        for i, frame in enumerate(frames):
            sent[i].append(frame)
    assert len(compressions) == len(events)
    assert not copies
    for i in range(3):
        assert _decoded("permessage-deflate", sent[i]) == [e.text for e in events]


def test_a_connection_behind_its_lane_sends_the_logged_bytes_then_leaves_it() -> None:
    """One connection keeps up, one misses an event (dropped for it: its ``gap``), one falls
    behind by up to the lane's log and then by more. The one within the log sends the lane's
    bytes; the others go on with a new compressor; every connection reads exactly its own
    events with a standard inflater."""
    offer = "permessage-deflate"
    conns = [BoundedDeflate(1 << 20) for _ in range(4)]
    for conn in conns:
        assert conn.accept(offer) is not None
    events = [_delta(n, f"token {n} of a reply that repeats itself ") for n in range(1, 201)]
    record = _Sent(conns)
    send, sent, texts = record.send, record.frames, record.texts

    lead = [send(0, e) for e in events[:LANE_LOG]]
    skipped = 7
    for n, event in enumerate(events[:LANE_LOG]):
        if n != skipped:
            send(1, event)  # connection 1 never gets event 7
    within = [send(2, e) for e in events[:LANE_LOG]]  # LANE_LOG behind the lead: still logged
    assert all(a is b for a, b in zip(lead, within, strict=True))
    assert sent[1][skipped] is not lead[skipped + 1]  # its own compression from there on
    lead += [send(0, e) for e in events[LANE_LOG:]]
    late = [send(3, e) for e in events]  # joins at the first event, now far behind the lead
    assert late[0] is not lead[0]  # past the log: a lane of its own
    for i in range(4):
        assert _decoded(offer, sent[i]) == texts[i]
    assert len(texts[1]) == LANE_LOG - 1


def test_connections_that_start_with_the_same_event_share_a_lane() -> None:
    """Connections that join between two events start a lane with the next one, together; a
    connection that joins later starts its own."""
    conns = [BoundedDeflate(1 << 20) for _ in range(4)]
    for conn in conns:
        assert conn.accept("permessage-deflate") is not None
    first, second = _delta(1, "first event"), _delta(2, "second event")
    assert conns[0].frame(first) is conns[1].frame(first)
    in_step = conns[0].frame(second)
    assert conns[1].frame(second) is in_step
    joined = [conns[i].frame(second) for i in (2, 3)]  # both joined after the first event
    assert joined[0] is joined[1]  # a lane of their own, shared
    assert joined[0] is not in_step
    assert _decoded("permessage-deflate", [joined[0]]) == [second.text]


def test_a_lane_logs_a_bounded_number_of_bytes() -> None:
    """The log behind a lane's head keeps its events alive: large snapshots keep fewer of
    them (``LANE_LOG_BYTES``), small events at most ``LANE_LOG``; a connection behind the
    log's start still reads its events."""
    conns = [BoundedDeflate(1 << 20) for _ in range(2)]
    for conn in conns:
        assert conn.accept("permessage-deflate") is not None
    big = [_delta(n, f"snapshot {n} " + "x" * 60_000) for n in range(1, 31)]
    lead = [conns[0].frame(e) for e in big]
    lane = conns[0]._lane
    assert lane is not None
    assert lane.logged_bytes <= LANE_LOG_BYTES + len(big[-1].ws_frame) + len(lead[-1])
    assert len(lane.keys) < len(big)
    behind = [conns[1].frame(e) for e in big]
    assert behind[0] is not lead[0]  # past the log from the start: a lane of its own
    assert _decoded("permessage-deflate", behind) == [e.text for e in big]
    small = [_delta(n, f"t{n} ") for n in range(100, 300)]
    for event in small:
        conns[0].frame(event)
    assert len(lane.keys) == LANE_LOG
