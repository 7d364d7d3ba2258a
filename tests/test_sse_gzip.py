"""The SSE stream gzip-compressed for a client whose Accept-Encoding takes gzip (Go's HTTP client,
as Crush's client uses it): the same events once inflated, each one readable before the next is
sent, the gzip trailer when the stream ends, and the plain stream for a client that does not ask;
through the dispatcher's stream and through the app's route."""

from __future__ import annotations

import uuid
import zlib
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import httpx
import orjson
import pytest
import trio

from crush_trio.server.sse import accepts_gzip
from tests.conftest import TOKEN, WAIT, Server, running_server

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path


@pytest.fixture(params=["trio-websocket", "asgi"], ids=["dispatcher", "app-route"])
async def server(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Server]:
    """A server whose SSE stream is the dispatcher's (``trio-websocket``, the default) or the
    app's quart route (``asgi``): both must answer the same."""
    config = tmp_path / "crush.json"
    config.write_text(f'{{"server": {{"ws_transport": "{request.param}"}}}}')
    async with running_server(tmp_path, config_file=config) as srv:
        yield srv


class Inflated:
    """A gzip body read raw off the wire and inflated here, chunk by chunk."""

    def __init__(self, response: httpx.Response) -> None:
        self.chunks = response.aiter_raw()
        self.inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self.text = b""
        self.wire_bytes = 0

    async def until(self, marker: bytes) -> bytes:
        """Read chunks until the inflated text holds ``marker``; the inflated text so far."""
        with trio.fail_after(WAIT):
            while marker not in self.text:
                chunk = await self.chunks.__anext__()
                self.wire_bytes += len(chunk)
                self.text += self.inflater.decompress(chunk)
        return self.text

    async def to_end(self) -> bytes:
        with trio.fail_after(WAIT):
            async for chunk in self.chunks:
                self.wire_bytes += len(chunk)
                self.text += self.inflater.decompress(chunk)
        return self.text


@asynccontextmanager
async def sse(server: Server, wid: str, encoding: str) -> AsyncIterator[httpx.Response]:
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=WAIT) as client,
        client.stream(
            "GET",
            f"/v1/workspaces/{wid}/events",
            params={"client_id": str(uuid.uuid4())},
            headers={"Authorization": f"Bearer {TOKEN}", "Accept-Encoding": encoding},
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        yield response


def blocks(text: bytes) -> list[bytes]:
    return [b for b in text.split(b"\n\n") if b]


async def test_a_gzip_stream_inflates_to_the_events_of_the_plain_stream(server: Server) -> None:
    ws = await server.open_workspace()
    async with sse(server, ws["id"], "gzip") as zipped, sse(server, ws["id"], "identity") as plain:
        assert zipped.headers["content-encoding"] == "gzip"
        assert "content-encoding" not in plain.headers
        assert "accept-encoding" in zipped.headers["vary"].lower()
        inflated = Inflated(zipped)
        await inflated.until(b'"type":"hello"')
        raw = plain.aiter_raw()
        text = b""
        with trio.fail_after(WAIT):
            while b'"type":"hello"' not in text:
                text += await raw.__anext__()
        titles = [f"session {n} " + "words " * 40 for n in range(5)]
        for title in titles:
            await server.create_session(ws["id"], title)
        last = titles[-1].encode()
        await inflated.until(last)
        with trio.fail_after(WAIT):
            while last not in text:
                text += await raw.__anext__()
    assert blocks(inflated.text) == blocks(text)
    sessions = [orjson.loads(b.split(b"data: ", 1)[1]) for b in blocks(text)[1:]]
    assert [s["payload"]["payload"]["title"] for s in sessions] == titles
    # Five sessions that differ in a few characters: each compresses against the one before.
    assert inflated.wire_bytes < len(text) / 4, (inflated.wire_bytes, len(text))


async def test_each_event_is_readable_before_the_next_one_is_sent(server: Server) -> None:
    ws = await server.open_workspace()
    async with sse(server, ws["id"], "gzip") as zipped:
        inflated = Inflated(zipped)
        await inflated.until(b"\n\n")  # hello
        for n in range(3):
            # No event follows this one until it has been read and inflated whole.
            await server.create_session(ws["id"], f"one at a time {n}")
            text = await inflated.until(f"one at a time {n}".encode())
            assert text.endswith(b"\n\n")  # the whole block, not a part held in the compressor
            assert len(blocks(text)) == n + 2  # hello and the sessions so far


async def test_the_gzip_stream_ends_with_its_trailer(server: Server) -> None:
    ws = await server.open_workspace()
    async with sse(server, ws["id"], "gzip") as zipped:
        inflated = Inflated(zipped)
        await inflated.until(b"\n\n")
        await server.create_session(ws["id"], "before the end")
        await inflated.until(b"before the end")
        server.backend.get(ws["id"]).broker.drop_all("test: stream ends", 1012)
        await inflated.to_end()
    assert inflated.inflater.eof  # a complete gzip member: header, blocks, trailer
    assert inflated.inflater.unused_data == b""


async def test_a_client_without_accept_encoding_gets_plain_text(server: Server) -> None:
    ws = await server.open_workspace()
    host = server.url.removeprefix("http://")
    request = (
        f"GET /v1/workspaces/{ws['id']}/events?client_id={uuid.uuid4()} HTTP/1.1\r\n"
        f"Host: {host}\r\nAuthorization: Bearer {TOKEN}\r\nAccept: text/event-stream\r\n\r\n"
    ).encode()
    address, port = host.rsplit(":", 1)
    stream = await trio.open_tcp_stream(address, int(port))
    async with stream:
        await stream.send_all(request)
        received = b""
        with trio.fail_after(WAIT):
            while b'"type":"hello"' not in received:
                received += await stream.receive_some(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"content-encoding" not in head.lower()
    assert b"\r\nid: " in body
    assert b'\ndata: {"seq":' in body  # chunked, plain text


@pytest.mark.parametrize(
    ("header", "gzip"),
    [
        (None, False),
        ("", False),
        ("identity", False),
        ("gzip", True),
        ("GZIP", True),
        ("x-gzip", True),
        ("deflate, gzip;q=0.5", True),
        ("gzip;q=0", False),
        ("gzip; q=0.0, *", False),
        ("*", True),
        ("*;q=0", False),
        ("br, *;q=0.1", True),
        ("gzip;q=bad", False),
        ("br", False),
    ],
)
def test_accept_encoding(header: str | None, gzip: bool) -> None:
    assert accepts_gzip(header) is gzip
