"""A websocket client disconnected as too slow (1013) gets whole frames, then the close frame.

The client is a raw socket with a small receive buffer that stops reading while a run streams
(snapshot mode: every ``message`` frame carries the whole reply so far; delta mode: many small
``message_delta`` frames). Its queue fills, the broker disconnects it as too slow, and it resumes
reading shortly after. Whatever the server had started writing then must arrive whole, followed
by the close frame (1013), or by a clean EOF at a frame boundary: never a frame cut short, never a
close frame written into the middle of another frame (what a client's websocket library reports
as 1007 or 1006). Both websocket transports, with and without permessage-deflate, several rounds
each; the frames are parsed by hand (and inflated when compressed), so any byte out of place
fails the round.

The pause before the client reads again is part of the scenario (a client busy elsewhere), not a
wait for something: every wait on the server is bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import os
import random
import socket
import struct
import uuid
import zlib
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Final

import orjson
import pytest
import trio
import trio.testing

from crush_trio.metrics import METRICS
from crush_trio.providers.scripted import ScriptedModel, Step
from crush_trio.server import connection, listener
from crush_trio.server.listener import PrefixedStream

from .conftest import WAIT, Server, running_server

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from crush_trio.broker import ClientStream

#: Rounds per transport, mode and compression (each one a fresh slow client and run).
ROUNDS: Final = 4
#: Tokens of each run and the pause between them (seconds).
TOKENS: Final = 6000
TOKEN_DELAY: Final = 0.001
#: How long the client keeps not reading after the server disconnected it (seconds).
RESUME_DELAY: Final = 0.05
#: The slow client's receive buffer (bytes): the kernel's buffers fill quickly.
CLIENT_RCVBUF: Final = 4096
#: The slow client's segment size (bytes), as on Ethernet. Loopback's own (about 64 KiB) is larger
#: than the receive buffer: once the buffer has room again the kernel sends no window update, only
#: zero-window probes that back off to seconds apart, and a client that resumed reading could take
#: longer than ``SLOW_CLOSE_TIMEOUT`` to drain what it is owed (the test then saw a reset).
CLIENT_MSS: Final = 1460
#: The text of each run: tokens of 200 random base64 characters (they compress to about 3/4),
#: so that delta mode and compressed frames, too, outgrow the sockets' buffers at once.
REPLY: Final = "".join(
    base64.b64encode(random.Random(i).randbytes(150)).decode() + " " for i in range(TOKENS)
)

WS_CLOSE: Final = 0x8


class Frames:
    """Server frames parsed from raw bytes, inflated when RSV1 is set (context takeover)."""

    def __init__(self) -> None:
        self.buffer = b""
        self.texts = 0
        self.close_code: int | None = None
        self.inflater = zlib.decompressobj(-15)

    def feed(self, data: bytes) -> None:
        self.buffer += data
        while (frame := self._next()) is not None:
            first, payload = frame
            opcode = first & 0x0F
            assert first & 0x80, "a fragmented frame"
            assert self.close_code is None, f"a frame (opcode {opcode}) after the close frame"
            if opcode == WS_CLOSE:
                assert len(payload) >= 2, payload
                self.close_code = int.from_bytes(payload[:2], "big")
                payload[2:].decode()  # the reason is UTF-8
            elif opcode == 0x1:
                if first & 0x40:  # RSV1: permessage-deflate
                    payload = self.inflater.decompress(payload + b"\x00\x00\xff\xff")
                # One whole, valid JSON envelope, or (batch=1) several, one per line.
                for line in payload.split(b"\n"):
                    if line:
                        frame_obj = orjson.loads(line)
                        assert "seq" in frame_obj, frame_obj
                        assert "type" in frame_obj, frame_obj
                self.texts += 1
            else:
                assert opcode in (0x9, 0xA), f"unexpected opcode {opcode:#x}"

    def _next(self) -> tuple[int, bytes] | None:
        buf = self.buffer
        if len(buf) < 2:
            return None
        first, second = buf[0], buf[1]
        assert not second & 0x80, "a masked server frame"
        size = second & 0x7F
        offset = 2
        if size == 126:
            if len(buf) < 4:
                return None
            size = int.from_bytes(buf[2:4], "big")
            offset = 4
        elif size == 127:
            if len(buf) < 10:
                return None
            size = int.from_bytes(buf[2:10], "big")
            offset = 10
        if len(buf) < offset + size:
            return None
        self.buffer = buf[offset + size :]
        return first, buf[offset : offset + size]

    def partial(self) -> str:
        """What is left unparsed at EOF (empty at a frame boundary)."""
        buf = self.buffer
        if not buf:
            return ""
        return f"{len(buf)} bytes of a frame cut short (header {buf[:10].hex()})"


def small_buffered_socket() -> trio.socket.SocketType:
    """A TCP socket with the slow client's small receive buffer and Ethernet-sized segments."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, CLIENT_MSS)
    return sock


async def slow_client(
    server: Server, wid: str, client_id: str, *, deltas: bool, compress: bool, batch: bool = False
) -> tuple[trio.socket.SocketType, Frames]:
    """An upgraded websocket as a raw socket with a small receive buffer, once ``hello`` came
    (the server has subscribed it); returns it and its frames so far."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = small_buffered_socket()
    await sock.connect((host, int(port)))
    query = f"client_id={client_id}&token={server.token}" + ("&deltas=1" if deltas else "")
    query += "&batch=1" if batch else ""
    head = (
        f"GET /v1/workspaces/{wid}/ws?{query} HTTP/1.1\r\n"
        f"Host: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
        "Sec-WebSocket-Version: 13\r\n"
    )
    if compress:
        head += "Sec-WebSocket-Extensions: permessage-deflate\r\n"
    await sock.send((head + "\r\n").encode())
    data = b""
    with trio.fail_after(WAIT):
        while b"\r\n\r\n" not in data:
            chunk = await sock.recv(65536)
            assert chunk, "closed during the upgrade"
            data += chunk
    answer, _, rest = data.partition(b"\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 101"), answer
    assert (b"permessage-deflate" in answer.lower()) == compress, answer
    frames = Frames()
    frames.feed(rest)
    with trio.fail_after(WAIT):
        while not frames.texts:
            chunk = await sock.recv(65536)
            assert chunk, "closed before hello"
            frames.feed(chunk)
    return sock, frames


def _config(tmp_path: Path, transport: str, **more: object) -> Path:
    path = tmp_path / "crush.json"
    server = {
        **more,
        "ws_transport": transport,
        "client_queue_size": 16,
        "client_queue_bytes": 256 * 1024,
        "must_deliver_timeout": 0.5,
        "detach_grace": 0,
    }
    path.write_text(orjson.dumps({"server": server}).decode())
    return path


def _slow_closes(outcome: str) -> float:
    value = METRICS.registry.get_sample_value(
        "crush_trio_slow_client_closes_total", {"outcome": outcome}
    )
    return value or 0.0


async def _one_round(
    server: Server, wid: str, *, deltas: bool, compress: bool, batch: bool = False
) -> Frames:
    ws = server.backend.get(wid)
    sid = (await server.create_session(wid))["id"]
    client_id = str(uuid.uuid4())
    sock, frames = await slow_client(
        server, wid, client_id, deltas=deltas, compress=compress, batch=batch
    )
    with sock:
        streams: list[ClientStream] = [c for c in ws.broker.clients if c.client_id == client_id]
        assert len(streams) == 1
        (stream,) = streams
        run = await server.prompt(wid, sid, "stream a long reply")
        with trio.fail_after(WAIT * 2):
            await stream.killed.wait()  # the client has not read a byte since the upgrade
        assert stream.kill_code == 1013
        assert stream.kill_reason == "too slow"
        await trio.sleep(RESUME_DELAY)  # the scenario: the client reads again a little later
        with trio.fail_after(WAIT * 2):
            while True:
                try:
                    chunk = await sock.recv(65536)
                except ConnectionResetError:
                    raise AssertionError(
                        f"reset after {frames.texts} frames; {frames.partial() or 'at a boundary'}"
                    ) from None
                if not chunk:
                    break
                frames.feed(chunk)
                if frames.close_code is not None and not frames.buffer:
                    # Answer the close (masked, empty payload) as a client does.
                    await sock.send(bytes((0x88, 0x80)) + os.urandom(4))
                    while chunk := await sock.recv(65536):
                        frames.feed(chunk)
                    break
    assert not frames.partial(), frames.partial()
    assert frames.close_code in (1013, None)
    await server.http.post(f"/v1/workspaces/{wid}/runs/{run['run_id']}/cancel")
    return frames


@pytest.mark.parametrize("deltas", [False, True], ids=["snapshots", "deltas"])
@pytest.mark.parametrize("compress", [False, True], ids=["plain", "deflate"])
@pytest.mark.parametrize("transport", ["trio-websocket", "asgi"])
async def test_a_client_disconnected_as_too_slow_gets_whole_frames_then_1013(
    tmp_path: Path, transport: str, compress: bool, deltas: bool
) -> None:
    closed_before = _slow_closes("closed")
    model = ScriptedModel([Step(REPLY, token_delay=TOKEN_DELAY) for _ in range(ROUNDS)])
    async with running_server(
        tmp_path, config_file=_config(tmp_path, transport), provider_factory=model
    ) as server:
        wid = (await server.open_workspace())["id"]
        for _ in range(ROUNDS):
            frames = await _one_round(server, wid, deltas=deltas, compress=compress)
            # The client read again well within the bound: it got the close frame.
            assert frames.close_code == 1013, f"no close frame after {frames.texts} frames"
    assert _slow_closes("closed") - closed_before == ROUNDS


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "deflate"])
async def test_a_slow_client_that_takes_batches_gets_whole_frames_then_1013(
    tmp_path: Path, compress: bool
) -> None:
    """The same with ``batch=1`` (a compressed event goes out as its line, in the lane of such
    connections): whole frames, then 1013."""
    model = ScriptedModel([Step(REPLY, token_delay=TOKEN_DELAY) for _ in range(ROUNDS)])
    config = _config(tmp_path, "trio-websocket")
    async with running_server(tmp_path, config_file=config, provider_factory=model) as server:
        wid = (await server.open_workspace())["id"]
        for _ in range(ROUNDS):
            frames = await _one_round(server, wid, deltas=True, compress=compress, batch=True)
            assert frames.close_code == 1013, f"no close frame after {frames.texts} frames"


@pytest.mark.parametrize("transport", ["trio-websocket", "asgi"])
async def test_a_slow_client_that_does_not_read_again_in_time_is_reset_with_nothing_more(
    tmp_path: Path, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``SLOW_CLOSE_TIMEOUT`` the connection is aborted: a reset, no close frame."""
    monkeypatch.setattr(connection, "SLOW_CLOSE_TIMEOUT", 0.3)
    aborted = trio.Event()
    abort = PrefixedStream.abort

    def abort_and_tell(self: PrefixedStream) -> None:
        abort(self)
        aborted.set()

    monkeypatch.setattr(PrefixedStream, "abort", abort_and_tell)
    aborted_before = _slow_closes("aborted")
    model = ScriptedModel([Step(REPLY, token_delay=TOKEN_DELAY)])
    # Without the kernel's own timeout on stalled sockets (asgi), which would break it first.
    config = _config(tmp_path, transport, tcp_user_timeout_ms=0)
    async with running_server(tmp_path, config_file=config, provider_factory=model) as server:
        wid = (await server.open_workspace())["id"]
        ws = server.backend.get(wid)
        sid = (await server.create_session(wid))["id"]
        client_id = str(uuid.uuid4())
        sock, frames = await slow_client(server, wid, client_id, deltas=False, compress=False)
        with sock:
            (stream,) = [c for c in ws.broker.clients if c.client_id == client_id]
            run = await server.prompt(wid, sid, "stream a long reply")
            with trio.fail_after(WAIT * 2):
                await stream.killed.wait()
                await aborted.wait()  # the server gave up on it
            with trio.fail_after(WAIT), contextlib.suppress(ConnectionResetError):
                while chunk := await sock.recv(65536):
                    frames.feed(chunk)
                raise AssertionError("a FIN after the bound: expected a reset")
        assert frames.close_code is None  # nothing was written after the frame cut short
        await server.http.post(f"/v1/workspaces/{wid}/runs/{run['run_id']}/cancel")
    assert _slow_closes("aborted") - aborted_before == 1


# -- the connection's stream: every frame whole, or an abort ---------------------------------

#: A frame larger than what loopback sockets buffer, so its write blocks part-way through.
BIG: Final = 8 * 1024 * 1024


@asynccontextmanager
async def stream_pair() -> AsyncIterator[tuple[PrefixedStream, trio.socket.SocketType]]:
    """A server-side :class:`PrefixedStream` over loopback TCP and the raw client socket (with a
    small receive buffer, not read until the test says so)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with listeners[0]:
        client = small_buffered_socket()
        await client.connect(listeners[0].socket.getsockname())
        server = await listeners[0].accept()
        with client:
            stream = PrefixedStream(server, b"")
            try:
                yield stream, client
            finally:
                await stream.aclose()


async def read_all(sock: trio.socket.SocketType) -> tuple[bytes, bool]:
    """Everything the peer sent until EOF (False) or a reset (True)."""
    data = bytearray()
    with trio.fail_after(WAIT):
        while True:
            try:
                chunk = await sock.recv(1 << 20)
            except ConnectionResetError:
                return bytes(data), True
            if not chunk:
                return bytes(data), False
            data += chunk


async def test_a_write_cancelled_part_way_finishes_its_frame_and_nothing_after_it() -> None:
    frames = [b"a" * BIG, b"b" * 100, b"c" * 100]
    ends = list(itertools.accumulate(map(len, frames)))
    async with stream_pair() as (stream, client):
        writing = trio.CancelScope()
        async with trio.open_nursery() as nursery:

            async def write() -> None:
                with writing:
                    await stream.send_frames(b"".join(frames), ends)

            nursery.start_soon(write)
            with trio.fail_after(WAIT):
                await trio.testing.wait_all_tasks_blocked()  # blocked inside the first frame
            writing.cancel()
            nursery.start_soon(stream.send_all, b"CLOSE")  # waits for the frame in flight
            data, reset = await read_all_until(client, BIG + 5)
        assert writing.cancelled_caught
        assert not reset
        assert data == frames[0] + b"CLOSE"  # the rest of frame 1, then the next
        assert not stream.aborted


async def read_all_until(sock: trio.socket.SocketType, size: int) -> tuple[bytes, bool]:
    data = bytearray()
    with trio.fail_after(WAIT):
        while len(data) < size:
            try:
                chunk = await sock.recv(1 << 20)
            except ConnectionResetError:
                return bytes(data), True
            if not chunk:
                break
            data += chunk
    return bytes(data), False


async def test_a_write_past_its_deadline_aborts_the_connection_and_writes_nothing_more() -> None:
    async with stream_pair() as (stream, client):
        with trio.fail_after(WAIT):
            async with trio.open_nursery() as nursery:
                errors: list[BaseException] = []

                async def write() -> None:
                    try:
                        await stream.send_all(b"a" * BIG)
                    except trio.BrokenResourceError as exc:
                        errors.append(exc)

                nursery.start_soon(write)
                await trio.testing.wait_all_tasks_blocked()
                stream.limit_writes(trio.current_time() + 0.2)
        assert errors
        assert stream.aborted
        with pytest.raises(trio.ClosedResourceError):
            await stream.send_all(b"CLOSE")
        data, reset = await read_all(client)
    assert reset  # a reset, never a FIN after a frame cut short
    assert len(data) < BIG
    assert b"CLOSE" not in data


async def test_a_cancelled_write_whose_frame_is_not_taken_in_time_aborts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(listener, "FRAME_FINISH_TIMEOUT", 0.2)
    async with stream_pair() as (stream, client):
        with trio.fail_after(WAIT), trio.CancelScope() as writing:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream.send_all, b"a" * BIG)
                await trio.testing.wait_all_tasks_blocked()
                writing.cancel()
        assert stream.aborted
        data, reset = await read_all(client)
    assert reset
    assert len(data) < BIG


async def test_a_close_during_a_write_that_does_not_end_aborts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(listener, "SEND_TIMEOUT", 0.2)
    async with stream_pair() as (stream, client):
        with trio.fail_after(WAIT):
            async with trio.open_nursery() as nursery:

                async def write() -> None:
                    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                        await stream.send_all(b"a" * BIG)

                nursery.start_soon(write)
                await trio.testing.wait_all_tasks_blocked()
                await stream.aclose()
        assert stream.aborted
        data, reset = await read_all(client)
    assert reset
    assert len(data) < BIG


async def test_a_frame_written_at_once_in_part_is_finished_before_the_next_frame() -> None:
    async with stream_pair() as (stream, client):
        assert stream.writable_now
        assert stream.write_nowait(b"x" * 10)  # room: written whole at once
        assert not stream.write_nowait(b"a" * BIG)  # more than the socket takes: the rest waits
        assert not stream.writable_now  # nothing more is written at once before the rest
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.send_frames, b"b" * 100 + b"c" * 100, [100, 200])
            data, reset = await read_all_until(client, 10 + BIG + 200)
        assert not reset
        assert data == b"x" * 10 + b"a" * BIG + b"b" * 100 + b"c" * 100
        assert stream.writable_now


async def test_a_close_with_part_of_a_frame_pending_resets_the_connection() -> None:
    async with stream_pair() as (stream, client):
        assert not stream.write_nowait(b"a" * BIG)
        with trio.fail_after(WAIT):
            await stream.aclose()
        assert stream.aborted  # never a FIN after a frame cut short
        data, reset = await read_all(client)
    assert reset
    assert len(data) < BIG


async def test_an_eof_sends_the_rest_of_a_frame_begun_at_once_first() -> None:
    async with stream_pair() as (stream, client):
        assert not stream.write_nowait(b"a" * BIG)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.send_eof)
            data, reset = await read_all(client)
        assert not reset
        assert data == b"a" * BIG


async def test_a_frame_written_at_once_to_a_reset_peer_fails_the_next_write() -> None:
    async with stream_pair() as (stream, client):
        # The peer resets the connection (SO_LINGER 0), then a frame goes out at once.
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # on loopback the reset reaches the server's socket within the call
        assert not stream.write_nowait(b"x" * 100)  # refused: kept as pending, no exception
        assert not stream.writable_now  # the rest is pending, nothing more at once
        with pytest.raises((trio.BrokenResourceError, trio.ClosedResourceError)):
            await stream.send_all(b"next")
        assert stream.broken


async def test_a_write_at_once_after_the_socket_closed_underneath_reaches_no_other_file() -> None:
    async with stream_pair() as (stream, _client):
        number = stream.socket.fileno()
        # The socket is closed underneath the stream (not through it), and its number is taken
        # by another connection at once, as the kernel does under a busy server.
        stream.socket.close()
        one, two = socket.socketpair()
        with one, two:
            peer = one if two.fileno() == number else two  # the end that reads what is written
            duplicated = number not in (one.fileno(), two.fileno())
            if duplicated:
                os.dup2(one.fileno(), number)
            try:
                assert not stream.write_nowait(b"a frame for the closed connection")
                peer.setblocking(False)
                with pytest.raises(BlockingIOError):
                    peer.recv(100)  # nothing reached the connection that now has the number
            finally:
                if duplicated:
                    os.close(number)
