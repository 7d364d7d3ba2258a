"""The event websocket served by trio-websocket (see :mod:`crush_trio.server.listener`).

Same contract as the quart route in ``streams.py`` (PROTOCOL §5): refusals answer 401/403/400/404
with a JSON body before the upgrade; the first frame is ``hello``; commands go over the same
socket; close codes 1000/1001/1009/1012/1013.

Tasks per connection: trio-websocket's reader, the writer (the only task that sends events), and
the handler itself, which runs the commands. The broker kills a client by cancelling its writer
(sends here can be cancelled), so a stalled client is cut off at once. A writer that has sent
nothing for ``ws_ping_interval`` seconds pings the client and closes the connection if no pong
comes back within :data:`PONG_TIMEOUT`.
"""

from __future__ import annotations

import logging
import re
from http.cookies import CookieError, SimpleCookie
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import parse_qsl, urlsplit

import orjson
import trio
from trio_websocket import CloseReason, ConnectionClosed, WebSocketConnection, wrap_server_stream
from werkzeug.datastructures import Headers
from wsproto.connection import ConnectionState

from .. import __version__, wire
from ..broker import Event
from ..errors import WS_CLOSE_GOING_AWAY, CrushError
from .app import Settings, _parse_seq, check_request_origin, check_request_token
from .listener import PrefixedStream
from .streams import CLOSE_TIMEOUT, _reply_frame, _run_command

if TYPE_CHECKING:
    from .api import Api

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


async def serve_event_websocket(
    stream: PrefixedStream, api: Api, settings: Settings, ping_interval: float
) -> None:
    """Handle one connection whose head is an upgrade to ``/v1/workspaces/{wid}/ws``."""
    async with trio.open_nursery() as nursery:
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT):
                request = await wrap_server_stream(
                    nursery,
                    stream,
                    message_queue_size=INBOUND_QUEUE,
                    max_message_size=settings.max_body_bytes,
                )
        except (trio.TooSlowError, ConnectionClosed, trio.BrokenResourceError, OSError):
            await stream.aclose()
            nursery.cancel_scope.cancel()
            return
        req = _Request(request.path, request.headers)
        if "Host" not in req.headers:  # wsproto keeps Host out of the header list
            match = _HOST.search(stream.head)
            if match:
                req.headers["Host"] = match.group(1).decode("latin-1").strip()
        try:
            check_request_token(settings, req.headers, req.args, req.cookies)
            check_request_origin(settings, req.headers, "http")
            wid = req.path.split("/")[3]
            ws = api.workspace(wid)
            client_id = wire.validate_client_id(req.args.get("client_id"))
            since = _parse_seq(req.args.get("since"), "since")
            ws.check_open()
        except CrushError as exc:
            body = orjson.dumps({"message": exc.message})
            with trio.move_on_after(CLOSE_TIMEOUT):
                try:
                    await request.reject(
                        exc.status,
                        extra_headers=[(b"content-type", b"application/json")],
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
        await _serve(conn, ws, client_id, since, api, ping_interval)
        nursery.cancel_scope.cancel()


async def _serve(
    conn: WebSocketConnection,
    ws: Any,
    client_id: str,
    since: int | None,
    api: Api,
    ping_interval: float,
) -> None:
    if ws.closing:  # the workspace began closing while the upgrade was answered
        with trio.move_on_after(CLOSE_TIMEOUT, shield=True):
            await conn.aclose(WS_CLOSE_GOING_AWAY, "workspace closed")
        return
    stream, first = ws.broker.subscribe(since=since, client_id=client_id)
    hello = ws.broker.hello(ws.id, __version__)  # same tick as subscribe: seq cannot move
    ws.attach(client_id)
    try:
        async with trio.open_nursery() as nursery:
            writer_scope = trio.CancelScope()
            stream.on_kill = writer_scope.cancel

            async def writer() -> None:
                with writer_scope:
                    try:
                        await _write(conn, stream, hello, first, ping_interval)
                    except ConnectionClosed:
                        pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(writer)
            while True:
                try:
                    raw = await conn.get_message()
                except ConnectionClosed:
                    break  # the client left (or sent an oversized frame: closed with 1009)
                reply = await _run_command(raw, ws, api)
                if reply is not None:
                    await stream.send_reply(_reply_frame(reply))
            nursery.cancel_scope.cancel()
    finally:
        stream.close()
        ws.detach(client_id)
    if stream.killed.is_set():
        code, reason = stream.kill_code, stream.kill_reason
    elif ws.closing:
        code, reason = WS_CLOSE_GOING_AWAY, "workspace closed"
    else:
        code, reason = 1000, ""
    with trio.move_on_after(CLOSE_TIMEOUT, shield=True):
        await conn.aclose(code, reason)


async def _write(
    conn: WebSocketConnection,
    stream: Any,
    hello: Event,
    first: list[Event],
    ping_interval: float,
) -> None:
    await _send_frames(conn, b"".join([hello.ws_frame, *(f.ws_frame for f in first)]))
    first.clear()
    idle_limit = ping_interval if ping_interval > 0 else float("inf")
    while True:
        event: Event | None = None
        with trio.move_on_after(idle_limit):
            try:
                event = await stream.receive.receive()
            except trio.EndOfChannel:
                return  # killed, or the workspace closed after everything queued was sent
        if event is None:
            with trio.move_on_after(PONG_TIMEOUT) as waiting:
                await conn.ping()
            if waiting.cancelled_caught:
                log.info("closing websocket of client %s: no pong", stream.client_id)
                return
            continue
        if stream.killed.is_set():
            return
        # Whatever else is already queued goes out in the same socket write.
        frames = [event.ws_frame]
        while len(frames) < MAX_FRAMES_PER_WRITE:
            try:
                frames.append(stream.receive.receive_nowait().ws_frame)
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        await _send_frames(conn, frames[0] if len(frames) == 1 else b"".join(frames))
        stream.after_receive()


async def _send_frames(conn: WebSocketConnection, data: bytes) -> None:
    """Write pre-encoded text frames (each event's frame is built once and shared by every
    client), serialized with the connection's own sends (pings, pongs, close).

    trio-websocket would encode the same frame again for every client; its frames carry no
    extension (none is negotiated), so the shared bytes are exactly what it would send.
    """
    if conn._wsproto.state is not ConnectionState.OPEN:
        raise ConnectionClosed(conn._close_reason or CloseReason(1006, "connection closed"))
    async with conn._stream_lock:
        try:
            await conn._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise ConnectionClosed(CloseReason(1006, "connection lost")) from None
