"""The event stream over SSE served by the connection dispatcher (see :mod:`.dispatch`).

``GET /v1/workspaces/{wid}/events`` (HTTP/1.1, no body), as a connection's first request or as a
later one of a kept-alive connection that hypercorn handed back, is served here, on the socket
(TCP or Unix), when the event websocket is too (``server.ws_transport: "trio-websocket"``); the
quart route (:mod:`.sse`) serves it otherwise, and when it is pipelined behind another answer.
Same contract (PROTOCOL §5): the same checks in the same order
(``Host`` 421, token 401, ``Origin`` 403, the cluster's redirect, workspace 404, ``client_id``/
``since``/``Last-Event-ID``/``deltas`` 400, a closing workspace), answered with the same status,
JSON body and headers; then ``200`` with the quart route's headers, a chunked body of SSE blocks
(``hello``, the resumed events, then each event or ``: ping``), gzip-compressed when the
request's ``Accept-Encoding`` takes it. The answer says ``connection: close``: the connection
ends with the stream.

Why: through quart's response generator, its ASGI send, hypercorn's HTTP stream and h11's chunked
framing, one block cost about 530 µs per client (1,000 gzip clients saturated a core). Here an
event's SSE block (encoded once and shared) goes out with the broker's direct write
(:attr:`~crush_trio.broker.ClientStream.send_now`) while the client keeps up: one ``write`` of
bytes that are, for a gzip stream, compressed once per cohort of streams in step
(:mod:`.sse_gzip`), for a plain one framed as a chunk. The writer task sends only what the
socket did not take, and the pings.

Tasks per stream: the handler, which reads the socket until the client leaves (what it sends is
discarded), and the writer. Every write goes through the connection's
:class:`~.listener.PrefixedStream`, one chunk per frame: a chunk (and the gzip block in it) is
written whole, or the connection is aborted. The slow-client policy is the websocket's: lossy
events dropped into a ``gap``, a client that cannot take a must-deliver event in time is killed
(its writes bounded by :data:`~.connection.SLOW_CLOSE_TIMEOUT`). The stream ends with the gzip
trailer and the last chunk when the workspace closes, the client is killed, or the server shuts
down; after a write cut short (frames not sent) a gzip stream ends without its trailer (it could
not be inflated), a plain one with the last chunk.

Pings: an idle stream's writer looks at the trio clock's ticks (multiples of
``sse_ping_interval / PING_TICKS``) and writes ``: ping`` at a tick when nothing was written
since the tick before, so nothing is ever silent longer than ``sse_ping_interval``; streams in
step ping at the same ticks and so stay in step (one gzip compression for all).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from email.utils import formatdate
from typing import TYPE_CHECKING, Final
from urllib.parse import parse_qsl, unquote

import orjson
import trio
from werkzeug.datastructures import Headers, MultiDict
from werkzeug.http import parse_cookie

from ..broker import FLUSH, NOT_SENT, SENT, SENT_IN_PART, TOO_SLOW_REASON, Event
from ..errors import CrushError
from ..logs import set_log_context
from ..metrics import METRICS
from .connection import SLOW_CLOSE_TIMEOUT, PeerGone, close_bound, parse_subscription, subscribed
from .listener import answer_and_linger, discard_until_eof
from .security import (
    check_request_host,
    check_request_origin,
    check_request_token,
    redact_target,
    response_headers,
)
from .sse import SSE_PING, accepts_gzip
from .sse_gzip import LAST_CHUNK, GzipStream, http_chunk

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..backend.workspace import Workspace
    from ..broker import ClientStream
    from .api import Api
    from .connection import Subscription
    from .listener import PrefixedStream
    from .settings import Settings

log = logging.getLogger(__name__)
access_log = logging.getLogger("crush_trio.access")

#: Most queued blocks written in one write.
MAX_BLOCKS_PER_WRITE: Final = 64
#: Clock ticks per ``sse_ping_interval`` at which an idle stream may ping (see the module).
PING_TICKS: Final = 2
#: Bound on writing a refusal (seconds).
REFUSAL_TIMEOUT: Final = 2.0
#: Bytes read at once from the client (all discarded).
READ_BYTES: Final = 4096

#: The quart route's headers of the answer, in its order (``content-encoding`` after ``vary``).
_HEAD: Final = (
    b"HTTP/1.1 200 \r\ncache-control: no-cache\r\nx-accel-buffering: no\r\n"
    b"vary: Accept-Encoding\r\n"
)
_GZIP_HEADER: Final = b"content-encoding: gzip\r\n"


class EventStreamRequest:
    """The parts of an event-stream request that the checks need, shaped like quart's."""

    __slots__ = ("args", "cookies", "headers", "path", "query")

    def __init__(self, head: bytes) -> None:
        lines = head[: head.find(b"\r\n\r\n")].decode("latin-1").split("\r\n")
        target = lines[0].split(" ", 2)[1]
        path, _, self.query = target.partition("?")
        self.path = unquote(path)
        self.headers = Headers()
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                self.headers.add(name.strip(), value.strip())
        self.args = MultiDict(parse_qsl(self.query, keep_blank_values=True))
        self.cookies = parse_cookie(self.headers.get("Cookie", ""))

    @property
    def wid(self) -> str:
        return self.path.split("/")[3]


async def check_request(
    settings: Settings, api: Api, req: EventStreamRequest
) -> tuple[Workspace, Subscription]:
    """The app's checks of ``GET .../events``, in its order (its ``before_request``, then the
    route): raises the :class:`~crush_trio.errors.CrushError` the request is refused with."""
    check_request_host(settings, req.headers)
    check_request_token(settings, req.headers, req.args, req.cookies)
    check_request_origin(settings, req.headers, "http")
    await api.place(req.path, req.query.encode("latin-1"), req.args, "GET")
    ws = api.workspace(req.wid)
    sub = parse_subscription(req.args, req.headers.get("Last-Event-ID"))
    ws.check_open()
    return ws, sub


class SseSocket:
    """One accepted SSE stream's writes: the response head, then each block as a chunk
    (gzip-compressed when :attr:`gzip` is set).

    Only one writer at a time: the stream's writer task (:meth:`send_blocks`, :meth:`close`),
    or the broker's direct write while that task is parked (:meth:`send_now`).
    """

    __slots__ = ("_head", "gzip", "stream", "unsent", "writes")

    def __init__(self, stream: PrefixedStream, gzip: GzipStream | None) -> None:
        self.stream = stream
        self.gzip = gzip
        #: The response head, until the first write sends it.
        self._head: bytes | None = (
            _HEAD
            + (_GZIP_HEADER if gzip is not None else b"")
            + b"content-type: text/event-stream\r\ndate: "
            + formatdate(usegmt=True).encode()
            + b"\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        )
        #: Writes made (the idle check of the pings compares it between ticks).
        self.writes = 0
        #: A write did not end (cut short, or failed): blocks may be missing from the body.
        self.unsent = False

    def chunk(self, block: bytes) -> bytes:
        gzip = self.gzip
        return http_chunk(block) if gzip is None else gzip.chunk(block)

    def send_now(self, events: Sequence[Event]) -> int:
        """Write ``events``' blocks at once, in one write, without waiting (the broker's direct
        write, while the writer is parked; see :meth:`.ws_trio.TrioEventSocket.send_now`)."""
        stream = self.stream
        if not stream.writable_now:
            return NOT_SENT
        self.writes += 1
        if len(events) == 1:
            data = self.chunk(events[0].sse)
        else:
            chunk = self.chunk
            data = b"".join([chunk(event.sse) for event in events])
        return SENT if stream.write_nowait(data) else SENT_IN_PART

    async def send_blocks(self, blocks: Sequence[bytes]) -> None:
        """Write ``blocks`` (SSE blocks) in one write, each a chunk (none: only the rest of a
        chunk that :meth:`send_now` wrote in part).

        Cancellation: the chunk in flight is finished, those after it are not written (and
        :attr:`unsent` stays set).

        Raises:
            PeerGone: the client has left.
        """
        parts = [self.chunk(b) for b in blocks]
        head, self._head = self._head, None
        if head is not None:
            parts.insert(0, head)
        self.writes += 1
        self.unsent = True
        try:
            if len(parts) == 1:
                await self.stream.send_frames(parts[0], None)
            else:
                await self.stream.send_frames(
                    b"".join(parts), list(itertools.accumulate(map(len, parts)))
                )
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise PeerGone from None
        self.unsent = False

    async def close(self) -> None:
        """End the body (the gzip trailer, the last chunk), then send EOF and read what the
        client still sends until it closes (a lingering close); bounded, never raises. After a
        write cut short, a gzip stream gets neither (it could not be inflated to its end), a
        plain one only the last chunk.

        Cancellation: the end of the body and the EOF are written shielded, within
        :func:`~.connection.close_bound`; the lingering read stops at once."""
        gzip, tail = self.gzip, LAST_CHUNK
        if gzip is not None:
            tail = b"" if self.unsent else gzip.finish() + LAST_CHUNK
            gzip.release()
        head, self._head = self._head, None
        stream = self.stream
        with trio.move_on_after(close_bound(stream.write_deadline), shield=True):
            try:
                await stream.send_frames((head or b"") + tail, None)
                await stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return
        # Not shielded: a shutdown does not wait for clients that keep the connection open.
        await discard_until_eof(stream)

    def ending(self) -> str:
        """How a killed client's close went (``crush_trio_slow_client_closes_total``)."""
        if self.stream.aborted:
            return "aborted"
        if self.stream.broken:
            return "gone"
        return "closed"


async def serve_event_stream(stream: PrefixedStream, api: Api, settings: Settings) -> None:
    """Handle one connection whose head is ``GET /v1/workspaces/{wid}/events`` (see the module):
    refuse it, or stream the workspace's events until the client leaves, is killed, or the
    workspace closes.

    Cancellation (the server's grace deadline): the subscription is undone, and the end of the
    body is still written, shielded and bounded (:meth:`SseSocket.close`)."""
    started = time.perf_counter()
    req = EventStreamRequest(stream.head)
    stream.head = b""  # the stream keeps nothing of its request (an idle client's memory)
    set_log_context(workspace_id=req.wid)
    try:
        ws, sub = await check_request(settings, api, req)
    except CrushError as exc:
        _log_access(req, exc.status, started, settings)
        await refuse(stream, exc)
        return
    sock = SseSocket(
        stream, GzipStream() if accepts_gzip(req.headers.get("Accept-Encoding")) else None
    )
    _log_access(req, 200, started, settings)
    del req
    try:
        if not ws.closing:  # the workspace may have begun closing while the request was checked
            await stream_events(sock, ws, sub, settings.sse_ping_interval)
    finally:
        await sock.close()


async def stream_events(sock: SseSocket, ws: Workspace, sub: Subscription, interval: float) -> None:
    """Subscribe, then run the writer while reading the socket until the client leaves."""
    client: ClientStream | None = None
    try:
        async with (
            subscribed(ws, sub, "sse") as (stream, hello, first),
            trio.open_nursery() as nursery,
        ):
            client = stream
            opening = [hello, *first]  # the writer's first write; it clears the list
            writer_scope = trio.CancelScope()

            def on_kill() -> None:
                # Never cut the chunk in flight: it, then the end of the body, get the bound.
                sock.stream.limit_writes(trio.current_time() + SLOW_CLOSE_TIMEOUT)
                writer_scope.cancel()

            stream.on_kill = on_kill
            stream.send_now = sock.send_now

            async def writer() -> None:
                with writer_scope:
                    try:
                        await write_events(sock, stream, opening, interval)
                    except PeerGone:
                        pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(writer)
            await read_until_gone(sock.stream)
            nursery.cancel_scope.cancel()  # the client left
    finally:
        if client is not None and client.kill_reason == TOO_SLOW_REASON:
            METRICS.slow_client_closes.labels(outcome=sock.ending()).inc()


async def write_events(
    sock: SseSocket, stream: ClientStream, first: list[Event], interval: float
) -> None:
    """The writer: ``first`` (``hello`` and the resumed events), then the client's queue until
    it ends, and a ping at a tick when the stream was idle since the tick before."""
    await sock.send_blocks([event.sse for event in first])
    first.clear()
    tick = interval / PING_TICKS if interval > 0 else math.inf
    receive = stream.receive
    seen = -1  # writes as of the last tick
    while True:
        event: Event | None = None
        with trio.move_on_at((math.floor(trio.current_time() / tick) + 1) * tick):
            try:
                event = await receive.receive()
            except trio.EndOfChannel:
                return
        if event is None:
            if sock.writes == seen:
                await sock.send_blocks([SSE_PING])
            seen = sock.writes
            continue
        if stream.killed.is_set():
            return  # disconnected by the broker: end now, skip what is queued
        blocks = [] if event is FLUSH else [event.sse]
        while len(blocks) < MAX_BLOCKS_PER_WRITE:
            try:
                event = receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if event is not FLUSH:
                blocks.append(event.sse)
        await sock.send_blocks(blocks)
        stream.after_receive()


async def read_until_gone(stream: PrefixedStream) -> None:
    """Read (and discard) what the client sends until it closes or resets the connection."""
    while True:
        try:
            if not await stream.receive_some(READ_BYTES):
                return
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return


async def refuse(stream: PrefixedStream, exc: CrushError) -> None:
    """Answer ``exc`` as the app does (``{"message": ...}``, its status and headers), then close
    the connection (``connection: close``, a lingering close)."""
    body = orjson.dumps({"message": exc.message})
    extra = "".join(f"{k.lower()}: {v}\r\n" for k, v in response_headers(exc).items())
    head = (
        f"HTTP/1.1 {exc.status} \r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{extra}date: {formatdate(usegmt=True)}\r\n"
        "connection: close\r\n\r\n"
    ).encode("latin-1")
    await answer_and_linger(stream, head + body, REFUSAL_TIMEOUT)


def _log_access(req: EventStreamRequest, status: int, started: float, settings: Settings) -> None:
    """The access line the app writes for a request (:mod:`.routes.hooks`)."""
    if not access_log.isEnabledFor(logging.INFO):
        return
    elapsed = (time.perf_counter() - started) * 1000
    target = redact_target(req.path, req.query, settings.token)
    access_log.info(
        "%s %s %d %.1fms",
        "GET",
        target,
        status,
        elapsed,
        extra={
            "method": "GET",
            "target": target,
            "status": status,
            "duration_ms": round(elapsed, 1),
        },
    )
