"""The event stream as Server-Sent Events (``GET /v1/workspaces/{wid}/events``, PROTOCOL §5).

This is the quart route: it serves the stream when the event websocket is the app's too
(``server.ws_transport: "asgi"``), and when its request is pipelined behind another answer on a
kept-alive connection. It is otherwise served on the socket by :mod:`.sse_listener` (see
:mod:`.dispatch`), with the same answers and the same bytes once inflated (the gzip constants
here apply to both).

The same subscription as the websockets (:func:`~.connection.subscribed`), but no commands and no
close code: the body is an async iterator that hypercorn drains, so the writer is the response
itself, and an idle stream gets a comment line every ``server.sse_ping_interval`` seconds.

A request whose ``Accept-Encoding`` takes gzip (Go's HTTP client, as Crush's client uses it, sends
``gzip`` and inflates on its own; browsers too) gets the stream gzip-compressed
(``Content-Encoding: gzip``): one compressor per stream, so an event compresses against the ones
before it (a ``message`` snapshot against the previous snapshot of the same message), flushed
after every event and ping (``Z_SYNC_FLUSH``) so that each one reaches the client at once, and
finished (the gzip trailer) when the stream ends on its own. A request without it gets the plain
stream, byte for byte as before.
"""

from __future__ import annotations

import math
import zlib
from contextlib import aclosing
from typing import TYPE_CHECKING, Final

import trio
from quart import Response, request

from .connection import Subscription, subscribed

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator

    from ..backend.workspace import Workspace
    from ..broker import Event
    from .settings import Settings

#: The keep-alive comment of an idle stream.
SSE_PING: Final = b": ping\n\n"
#: zlib compression level of a gzip stream.
GZIP_LEVEL: Final = 6
#: LZ77 window of a gzip stream's compressor (bits; ``2**bits`` bytes): the largest zlib has, so
#: that a snapshot of a message up to 32 KiB long compresses against the previous snapshot.
#: The window's memory is touched as the stream's bytes flow, up to 128 KiB per stream.
GZIP_WINDOW_BITS: Final = 15
#: zlib memory level of a gzip stream's compressor (its hash and output buffer: 4 is 8 KiB).
GZIP_MEM_LEVEL: Final = 4
#: ``wbits`` that makes zlib write a gzip header and trailer around the deflate stream.
_GZIP_WBITS: Final = 16 + GZIP_WINDOW_BITS


def accepts_gzip(accept_encoding: str | None) -> bool:
    """Whether an ``Accept-Encoding`` header takes ``gzip`` (RFC 9110 §12.5.3): listed (or
    ``x-gzip``) with a weight above 0, or not listed while ``*`` is, with a weight above 0."""
    if not accept_encoding:
        return False
    star: bool | None = None
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        coding = coding.strip().lower()
        weight = 1.0
        for param in params.split(";"):
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    weight = float(value.strip())
                except ValueError:
                    weight = 0.0
        if coding in ("gzip", "x-gzip"):
            return weight > 0
        if coding == "*":
            star = weight > 0
    return bool(star)


async def gzipped(blocks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """``blocks`` as one gzip stream: each block compressed and flushed at once (every chunk
    out is decodable up to the block's end); the trailer once ``blocks`` ends on its own."""
    compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, _GZIP_WBITS, GZIP_MEM_LEVEL)
    async with aclosing(blocks):
        async for block in blocks:
            yield compressor.compress(block) + compressor.flush(zlib.Z_SYNC_FLUSH)
    yield compressor.flush(zlib.Z_FINISH)


async def sse_blocks(
    ws: Workspace, sub: Subscription, interval: float
) -> AsyncGenerator[bytes, None]:
    """The SSE blocks of one stream: ``hello``, the resumed events, then each event or ping."""
    # Subscribe (and hold the workspace) only once the body is being sent: a client that
    # leaves before that point must not leave a hold behind, and the subscription is undone
    # only for a body that started.
    if ws.closing:
        return
    async with subscribed(ws, sub, "sse") as (stream, hello, first):
        yield hello.sse
        for frame in first:
            yield frame.sse
        while not stream.is_killed:
            # Never yield inside a cancel scope: the scope would span the consumer's code.
            event: Event | None = None
            with trio.move_on_after(interval if interval > 0 else math.inf):
                try:
                    event = await stream.receive.receive()
                except trio.EndOfChannel:
                    return
            if event is None:
                yield SSE_PING
                continue
            yield event.sse
            stream.after_receive()


async def serve_sse(ws: Workspace, sub: Subscription, settings: Settings) -> Response:
    """An SSE response streaming the workspace's events (PROTOCOL §5), gzip-compressed when the
    request's ``Accept-Encoding`` takes it."""
    ws.check_open()
    blocks = sse_blocks(ws, sub, settings.sse_ping_interval)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Vary": "Accept-Encoding"}
    if accepts_gzip(request.headers.get("Accept-Encoding")):
        blocks = gzipped(blocks)
        headers["Content-Encoding"] = "gzip"
    response = Response(blocks, content_type="text/event-stream", headers=headers)
    response.timeout = None
    return response
