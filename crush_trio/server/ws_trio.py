"""The event websocket served by trio-websocket (see :mod:`crush_trio.server.listener`).

Same contract and lifecycle as the quart route (:func:`~.connection.serve_connection`, PROTOCOL §5):
refusals answer 401/403/400/404 with a JSON body before the upgrade; the first frame is ``hello``;
commands go over the same socket; close codes 1000/1001/1009/1012/1013. A client that offers
permessage-deflate gets it (:mod:`crush_trio.wsdeflate`): its frames are compressed per
connection, and its compressed commands are inflated within ``server.max_body_bytes``.

Tasks per connection: trio-websocket's reader and the handler itself, which runs the commands.
An idle client's frames are written at once by the broker (:meth:`TrioEventSocket.send_now`); the
writer (:class:`~.connection.OnDemandWriter`, the only task that sends queued events) runs only
while frames wait for a socket that would block. Every write goes through the connection's
:class:`~.listener.PrefixedStream`, which writes each frame whole or aborts the connection: a
client disconnected as too slow gets the frame in flight and then the close frame (1013) if it
reads again within :data:`~.connection.SLOW_CLOSE_TIMEOUT`, else a reset and nothing more. A
client that was sent nothing for ``server.ws_ping_interval`` seconds is pinged by the server's
one timer (:mod:`.keepalive`), in a task that lasts until the pong; the connection is closed if
no pong comes back within :data:`PONG_TIMEOUT`.
"""

from __future__ import annotations

import itertools
import logging
import re
from http.cookies import CookieError, SimpleCookie
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import parse_qsl, urlsplit

import orjson
import trio
from trio_websocket import ConnectionClosed, WebSocketRequest
from werkzeug.datastructures import Headers

from .._compat import trio_websocket as compat_ws
from ..broker import (
    FLUSH,
    NOT_SENT,
    SENT,
    SENT_IN_PART,
    BatchCache,
    Event,
    batch_frames,
    batch_groups,
)
from ..defaults import CLOSE_TIMEOUT
from ..errors import CrushError
from ..wsdeflate import BoundedDeflate
from .connection import PeerGone, check_upgrade, close_bound, serve_connection
from .security import check_request_host, check_request_token, response_headers

if TYPE_CHECKING:
    from collections.abc import Awaitable, Coroutine, Sequence

    from .api import Api
    from .keepalive import Keepalive
    from .listener import PrefixedStream
    from .settings import Settings

log = logging.getLogger(__name__)

#: Commands read ahead of the handler (trio-websocket's inbound queue; backpressure beyond it).
INBOUND_QUEUE: Final = 4
#: How long a ping waits for its pong before the connection counts as dead (seconds).
PONG_TIMEOUT: Final = 10.0
#: Most queued events written to the socket in one write.
MAX_FRAMES_PER_WRITE: Final = 64
#: Bound on the upgrade handshake once the head has arrived (seconds).
HANDSHAKE_TIMEOUT: Final = 10.0

#: What a write to a client that has left raises.
_GONE: Final = (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError, OSError)


_HOST: Final = re.compile(rb"(?im)^host:[ \t]*([^\r\n]*)\r?$")

#: The batch frames of the connections that take them (``batch=1``), shared by all of them.
_BATCHES: Final = BatchCache()


class _Request:
    """The parts of an upgrade request that the checks need, shaped like quart's."""

    def __init__(self, path: str, raw_headers: list[tuple[bytes, bytes]]) -> None:
        split = urlsplit(path)
        self.path = split.path
        self.args = dict(parse_qsl(split.query, keep_blank_values=True))
        self.headers = Headers([(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw_headers])
        self.cookies: dict[str, str] = {}
        try:
            jar = SimpleCookie(self.headers.get("Cookie", ""))
            self.cookies = {name: morsel.value for name, morsel in jar.items()}
        except CookieError:
            pass


class SerializedStream(trio.abc.HalfCloseableStream):
    """The connection's stream as trio-websocket writes it, and a way to stop waiting for its
    handshake when it closes (:attr:`on_close`).

    trio-websocket has no public way to send bytes already encoded as frames, and encoding each
    event again for every client is what the broker's shared frames avoid; so the writer writes
    the :class:`PrefixedStream` under the connection directly, holding the connection's own
    send lock (:attr:`~crush_trio._compat.trio_websocket.DeflateConnection.send_lock`), which
    trio-websocket holds around each of its writes here (pings, pongs, close): one lock per
    connection keeps its writes and the library's from interleaving.
    """

    __slots__ = ("on_close", "stream", "transport")

    def __init__(self, stream: PrefixedStream) -> None:
        self.stream = stream
        #: The socket stream underneath (as :class:`PrefixedStream` names it).
        self.transport = stream.transport
        #: Cancelled when the stream is closed (see :func:`serve_event_websocket`).
        self.on_close: trio.CancelScope | None = None

    def send_all(self, data: bytes | bytearray | memoryview) -> Coroutine[Any, Any, None]:
        # Called by trio-websocket only, under the connection's send lock.
        return self.stream.send_all(data)

    def receive_some(self, max_bytes: int | None = None) -> Coroutine[Any, Any, bytes]:
        # The stream's own coroutine: an idle connection's reader waits one frame less deep.
        return self.stream.receive_some(max_bytes)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.stream.send_eof()  # never called by trio-websocket

    async def aclose(self) -> None:
        if self.on_close is not None:
            self.on_close.cancel()
        await self.stream.aclose()


class TrioEventSocket:
    """An accepted trio-websocket connection as an :class:`~.connection.EventSocket`."""

    __slots__ = (
        "_peer_closed",
        "batch",
        "client_id",
        "conn",
        "deflate",
        "prefixed",
        "send_lock",
        "sent",
    )

    max_batch = MAX_FRAMES_PER_WRITE
    #: What :meth:`receive` raises once the client has left (or its frame was too big: 1009).
    left: tuple[type[Exception], ...] = (ConnectionClosed,)

    def __init__(
        self,
        conn: compat_ws.DeflateConnection,
        stream: SerializedStream,
        *,
        client_id: str,
        deflate: BoundedDeflate | None = None,
        batch: bool = False,
    ) -> None:
        self.conn = conn
        #: The stream every write goes through, and the connection's send lock (held by every
        #: write: trio-websocket's and :meth:`send_frames`).
        self.prefixed = stream.stream
        self.send_lock = conn.send_lock
        self.client_id = client_id
        #: Something was written since the keepalive last looked.
        self.sent = False
        #: The negotiated permessage-deflate, or None: frames go out as shared.
        self.deflate = deflate
        #: The client takes frames of several envelopes (``batch=1``): the events written
        #: together go in one frame of lines (:meth:`_batch_parts`).
        self.batch = batch
        self._peer_closed = False

    def send_now(self, events: Sequence[Event]) -> int:
        """Write ``events``' frames at once, in one write, without waiting (the broker's direct
        write: called only while this connection's writer is idle, see
        :attr:`~crush_trio.broker.ClientStream.send_now`).

        Returns :data:`~crush_trio.broker.NOT_SENT` when a write is in progress or pending, the
        connection is closing, or its writes have a deadline (the writer sends the frames then);
        :data:`~crush_trio.broker.SENT` when the socket took them all; else
        :data:`~crush_trio.broker.SENT_IN_PART`: the rest waits in the stream for the writer.
        """
        prefixed = self.prefixed
        if not prefixed.writable_now or self.send_lock.locked() or self.conn.closed is not None:
            return NOT_SENT
        deflate = self.deflate
        if self.batch:
            data = b"".join(self._batch_parts(events))
        elif len(events) == 1:
            event = events[0]
            data = event.ws_frame if deflate is None else deflate.frame(event)
        elif deflate is None:
            data = b"".join([event.ws_frame for event in events])
        else:
            frame = deflate.frame
            data = b"".join([frame(event) for event in events])
        self.sent = True
        return SENT if prefixed.write_nowait(data) else SENT_IN_PART

    async def send_frames(self, frames: Sequence[Event]) -> None:
        """Write pre-encoded text frames (each event's frame is built once and shared by every
        client) in one write. Without permessage-deflate the shared bytes are exactly what
        trio-websocket would send; with it, each frame is compressed into this connection's
        window first (:meth:`BoundedDeflate.frame`).

        Cancellation: the frame in flight is finished (bounded), the frames after it are not
        written (:meth:`PrefixedStream.send_frames`)."""
        if self.conn.closed is not None:  # closing or closed: no data frame after a close frame
            raise PeerGone
        deflate = self.deflate
        if self.batch:
            parts = self._batch_parts([f for f in frames if f is not FLUSH])
        elif deflate is not None:
            frame = deflate.frame
            parts = [frame(f) for f in frames if f is not FLUSH]
        else:
            parts = [f.ws_frame for f in frames if f is not FLUSH]
        self.sent = True
        try:
            async with self.send_lock:
                if not parts:  # only the rest of a frame written in part by send_now
                    await self.prefixed.send_frames(b"", ())
                elif len(parts) == 1:
                    await self.prefixed.send_frames(parts[0], (len(parts[0]),))
                else:
                    await self.prefixed.send_frames(
                        b"".join(parts), list(itertools.accumulate(map(len, parts)))
                    )
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise PeerGone from None

    def _batch_parts(self, events: Sequence[Event]) -> list[bytes]:
        """The frames of ``events`` for a connection that takes batches: the events written
        together grouped (:func:`~crush_trio.broker.batch_groups`), each group one frame of
        lines: shared when uncompressed (:data:`_BATCHES`), compressed event by event in the
        connection's lane otherwise (:meth:`BoundedDeflate.frame_group`)."""
        deflate = self.deflate
        if deflate is None:
            return [frame.ws_frame for frame in batch_frames(events, _BATCHES)]
        return [deflate.frame_group(group, _BATCHES.get) for group in batch_groups(events)]

    def limit_writes(self, deadline: float) -> None:
        self.prefixed.limit_writes(deadline)

    def ending(self) -> str:
        prefixed = self.prefixed
        if prefixed.aborted:
            return "aborted"
        if prefixed.broken or self._peer_closed:
            return "gone"
        return "closed"

    async def ping(self) -> bool:
        with trio.move_on_after(PONG_TIMEOUT) as waiting:
            try:
                await self.conn.ping()
            except ConnectionClosed:
                raise PeerGone from None
        if waiting.cancelled_caught:
            log.info("closing websocket of client %s: no pong", self.client_id)
            return False
        return True

    def stop_reading(self) -> None:
        self.conn.stop_reading()

    def receive(self) -> Awaitable[str | bytes]:
        # trio-websocket's own coroutine: an idle connection's handler waits one frame less deep.
        return self.conn.get_message()

    async def close(self, code: int, reason: str) -> None:
        # The client's close frame (or its leaving) came first: no close frame of ours then.
        self._peer_closed = self.conn.closed is not None
        with trio.move_on_after(close_bound(self.prefixed.write_deadline), shield=True):
            await self.conn.aclose(code, reason)
        if self.deflate is not None:
            self.deflate.release()


async def serve_event_websocket(
    stream: PrefixedStream, api: Api, settings: Settings, keepalive: Keepalive | None = None
) -> None:
    """Handle one connection whose head is an upgrade to ``/v1/workspaces/{wid}/ws``; the
    server's ``keepalive`` pings it when idle (None: never pinged)."""
    serialized = SerializedStream(stream)
    async with trio.open_nursery() as nursery:
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT), trio.CancelScope() as handshake:
                # A request that wsproto refuses (e.g. Sec-WebSocket-Version other than 13) is
                # answered by trio-websocket's reader (426 or 400), which then closes the stream
                # and ends, without ever completing the wait for the request: stop waiting then.
                serialized.on_close = handshake
                request = await wrap_server_stream(nursery, serialized, settings.max_body_bytes)
            serialized.on_close = None
        except (trio.TooSlowError, ConnectionClosed, trio.BrokenResourceError, OSError):
            await stream.aclose()
            nursery.cancel_scope.cancel()
            return
        if handshake.cancelled_caught:
            nursery.cancel_scope.cancel()
            return
        req = _Request(request.path, request.headers)
        if "Host" not in req.headers:  # wsproto keeps Host out of the header list
            match = _HOST.search(stream.head)
            if match:
                req.headers["Host"] = match.group(1).decode("latin-1").strip()
        try:
            check_request_host(settings, req.headers)
            check_request_token(settings, req.headers, req.args, req.cookies)
            query = request.path.partition("?")[2].encode("latin-1")
            await api.place(req.path, query, req.args)
            ws, sub = check_upgrade(
                settings, api, req.path.split("/")[3], req.headers, req.args, req.cookies, "http"
            )
        except CrushError as exc:
            body = orjson.dumps({"message": exc.message})
            extra = [(k.encode(), v.encode()) for k, v in response_headers(exc).items()]
            with trio.move_on_after(CLOSE_TIMEOUT):
                try:
                    await request.reject(
                        exc.status,
                        extra_headers=[(b"content-type", b"application/json"), *extra],
                        body=body,
                    )
                except _GONE:
                    pass  # the client left while the refusal was written
            nursery.cancel_scope.cancel()
            return
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                conn = await request.accept()
        except (*_GONE, trio.TooSlowError):
            nursery.cancel_scope.cancel()
            return  # the client left (or stalled) while the upgrade answer was written
        assert isinstance(conn, compat_ws.DeflateConnection)
        deflate = conn.deflate if conn.compressing else None
        assert deflate is None or isinstance(deflate, BoundedDeflate)
        sock = TrioEventSocket(
            conn,
            serialized,
            client_id=sub.client_id,
            deflate=deflate,
            batch=sub.batch,
        )
        # The connection keeps nothing of its upgrade request (an idle client's memory).
        del request, req, handshake
        match = None
        stream.head = b""
        await serve_connection(sock, ws, sub, api, keepalive, nursery)
        nursery.cancel_scope.cancel()


async def wrap_server_stream(
    nursery: trio.Nursery, stream: SerializedStream, max_message_size: int
) -> WebSocketRequest:
    """trio-websocket's ``wrap_server_stream`` with a connection that accepts permessage-deflate
    when the client offers it (inflating its messages within ``max_message_size``), through
    :mod:`crush_trio._compat.trio_websocket`."""
    return await compat_ws.wrap_server_stream(
        nursery,
        stream,
        message_queue_size=INBOUND_QUEUE,
        max_message_size=max_message_size,
        deflate=BoundedDeflate(max_message_size),
    )
