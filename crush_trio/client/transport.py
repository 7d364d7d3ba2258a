"""Opening one websocket to a workspace's event stream: address, headers, socket, ``hello``.

Both users of the event stream go through here: the workspace's reconnecting stream
(:class:`~crush_trio.client.stream.EventStream`) and the raw connection of
:func:`~crush_trio.client.open_event_socket`. Nothing here reads past the ``hello`` frame,
decodes events or reconnects.
"""

from __future__ import annotations

import ssl
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote, urlencode, urlsplit

import orjson
import trio

from .._compat import trio_websocket as compat_ws
from ..defaults import CLEANUP_TIMEOUT
from ..wsdeflate import client_deflate
from .errors import AuthError, Conflict, CrushError, NotFound, Unreachable, single_errors

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from trio_websocket import ConnectionRejected, WebSocketConnection

#: Bound on opening the websocket and receiving its ``hello`` frame (seconds).
HELLO_TIMEOUT: Final = 10.0
#: Largest event frame accepted (a message event carries a whole message).
MAX_EVENT_BYTES: Final = 64 * 1024 * 1024
#: Frames buffered inside the websocket library between the socket and the reader task.
WS_QUEUE_SIZE: Final = 64
#: Most redirects (307 to the cluster node that owns a workspace) followed for one request or
#: one stream connection.
MAX_REDIRECTS: Final = 5


def websocket_base(base_url: str) -> str:
    """The ``ws://`` (or ``wss://``) base of an ``http://`` (or ``https://``) server address."""
    return base_url.replace("https://", "wss://", 1).replace("http://", "ws://", 1)


def bearer_headers(token: str | None) -> list[tuple[bytes, bytes]]:
    """The websocket handshake's ``Authorization`` header (none without a token)."""
    if not token:
        return []
    return [(b"Authorization", f"Bearer {token}".encode())]


def stream_resource(
    workspace_id: str,
    client_id: str,
    since: int | None,
    *,
    deltas: bool = False,
    batch: bool = False,
) -> str:
    """The path and query of a workspace's event stream (PROTOCOL §5); with ``deltas`` it asks
    for ``message_delta`` events (``deltas=1``), with ``batch`` for frames that may carry several
    envelopes (``batch=1``: one per line, in order)."""
    query: dict[str, Any] = {"client_id": client_id}
    if since is not None:
        query["since"] = since
    if deltas:
        query["deltas"] = 1
    if batch:
        query["batch"] = 1
    return f"/v1/workspaces/{quote(workspace_id, safe='')}/ws?{urlencode(query)}"


def rejection_error(where: str, exc: ConnectionRejected) -> CrushError:
    """The library's error for a refused event-stream upgrade, with the server's message."""
    body = exc.body or b""
    try:
        message = str(orjson.loads(body).get("message", ""))
    except (orjson.JSONDecodeError, AttributeError):
        message = body.decode(errors="replace")
    message = message or f"status {exc.status_code}"
    if exc.status_code in (401, 403):
        return AuthError(f"{where} refused the connection: {message}")
    if exc.status_code == 404:
        return NotFound(f"{where} is gone: {message}")
    if exc.status_code == 409:
        return Conflict(f"{where} refused the connection: {message}")
    return Unreachable(f"{where} refused the connection: {message}")


class WireCounter:
    """Bytes read from a connection's socket: frames as they travel, compressed or not."""

    def __init__(self) -> None:
        self.received = 0


class _CountingStream(trio.abc.Stream):
    """A stream that adds what it receives to a :class:`WireCounter`."""

    def __init__(self, stream: trio.abc.Stream, counter: WireCounter) -> None:
        self.stream = stream
        self.counter = counter

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self.stream.receive_some(max_bytes)
        self.counter.received += len(data)
        return data

    async def aclose(self) -> None:
        await self.stream.aclose()


async def _connect(ws_url: str, unix_path: str | None) -> tuple[trio.abc.Stream, str]:
    """The socket stream to the server and the ``Host`` of the upgrade request."""
    if unix_path is not None:
        return await trio.open_unix_socket(unix_path), "localhost"
    split = urlsplit(ws_url)
    secure = split.scheme == "wss"
    host = split.hostname or "localhost"
    port = split.port or (443 if secure else 80)
    name = f"[{host}]" if ":" in host else host  # an IPv6 literal
    host_header = name if port in (80, 443) else f"{name}:{port}"
    if secure:
        stream: trio.abc.Stream = await trio.open_ssl_over_tcp_stream(
            host, port, ssl_context=ssl.create_default_context(), https_compatible=True
        )
    else:
        stream = await trio.open_tcp_stream(host, port)
    return stream, host_header


@asynccontextmanager
async def open_stream_socket(
    ws_base: str,
    unix_path: str | None,
    resource: str,
    headers: list[tuple[bytes, bytes]],
    *,
    timeout: float,  # noqa: ASYNC109
    message_queue_size: int = WS_QUEUE_SIZE,
    max_message_size: int = MAX_EVENT_BYTES,
    compression: bool = True,
    counter: WireCounter | None = None,
) -> AsyncIterator[WebSocketConnection]:
    """One websocket connection to ``resource`` (``/v1/...``): at ``ws_base`` over TCP (TLS for
    ``wss://``), or over the Unix socket ``unix_path`` when it is set. Leaving the block closes it
    (bounded by :data:`~crush_trio.defaults.CLEANUP_TIMEOUT`).

    With ``compression`` the upgrade offers permessage-deflate (protocol.md 6.7); a compressed frame
    that inflates past ``max_message_size`` closes the connection with 1009. ``counter``, when
    given, counts the bytes read from the socket.

    Raises (one exception, never a group): ``ConnectionRejected`` (the server refused the
    upgrade), ``trio.TooSlowError`` (no answer within ``timeout``), ``OSError``, ``HandshakeError``.
    """
    deadline = trio.current_time() + timeout
    with single_errors():
        async with trio.open_nursery() as nursery:
            with trio.fail_at(deadline):
                stream, host = await _connect(ws_base + resource, unix_path)
            if counter is not None:
                stream = _CountingStream(stream, counter)
            try:
                with trio.fail_at(deadline):
                    conn = await compat_ws.wrap_client_stream(
                        nursery,
                        stream,
                        host,
                        resource,
                        extra_headers=headers,
                        message_queue_size=message_queue_size,
                        max_message_size=max_message_size,
                        deflate=client_deflate(max_message_size) if compression else None,
                    )
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
            try:
                yield conn
            finally:
                with trio.move_on_after(CLEANUP_TIMEOUT):
                    await conn.aclose()
                nursery.cancel_scope.cancel()


async def receive_hello(
    conn: WebSocketConnection,
    where: str,
    timeout: float,  # noqa: ASYNC109
) -> dict[str, Any]:
    """The connection's first frame, which must be the server's ``hello`` (PROTOCOL §5).

    Raises:
        trio.TooSlowError: no frame within ``timeout`` seconds.
        orjson.JSONDecodeError: the first frame is not JSON.
        ConnectionClosed: the connection closed first.
        Unreachable: the first frame is not a ``hello`` (``where`` names the stream).
    """
    with trio.fail_after(timeout):
        hello = orjson.loads(await conn.get_message())
    if not isinstance(hello, dict) or hello.get("type") != "hello":
        raise Unreachable(f"{where} did not start with a hello frame; is this a crush_trio server?")
    return hello
