"""Opening one websocket to a workspace's event stream: address, headers, socket, ``hello``.

Both users of the event stream go through here: the workspace's reconnecting stream
(:class:`~crush_trio.client.stream.EventStream`) and the raw connection of
:func:`~crush_trio.client.open_event_socket`. Nothing here reads past the ``hello`` frame,
decodes events or reconnects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final
from urllib.parse import quote, urlencode

import orjson
import trio
from trio_websocket import (
    ConnectionRejected,
    WebSocketConnection,
    open_websocket_url,
    wrap_client_stream,
)

from .errors import AuthError, Conflict, CrushError, NotFound, Unreachable

#: Bound on opening the websocket and receiving its ``hello`` frame (seconds).
HELLO_TIMEOUT: Final = 10.0
#: Bound on each cleanup step when a connection or a workspace block ends (seconds).
CLOSE_TIMEOUT: Final = 5.0
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
    workspace_id: str, client_id: str, since: int | None, *, deltas: bool = False
) -> str:
    """The path and query of a workspace's event stream (PROTOCOL §5); with ``deltas`` it asks
    for ``message_delta`` events (``deltas=1``)."""
    query: dict[str, Any] = {"client_id": client_id}
    if since is not None:
        query["since"] = since
    if deltas:
        query["deltas"] = 1
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
) -> AsyncIterator[WebSocketConnection]:
    """One websocket connection to ``resource`` (``/v1/...``): at ``ws_base`` over TCP, or over
    the Unix socket ``unix_path`` when it is set. Leaving the block closes it (bounded by
    :data:`CLOSE_TIMEOUT`)."""
    if unix_path is None:
        async with open_websocket_url(
            ws_base + resource,
            extra_headers=headers,
            message_queue_size=message_queue_size,
            max_message_size=max_message_size,
            connect_timeout=timeout,
            disconnect_timeout=CLOSE_TIMEOUT,
        ) as conn:
            yield conn
        return
    async with trio.open_nursery() as nursery:
        with trio.fail_after(timeout):
            stream = await trio.open_unix_socket(unix_path)
            conn = await wrap_client_stream(
                nursery,
                stream,
                "localhost",
                resource,
                extra_headers=headers,
                message_queue_size=message_queue_size,
                max_message_size=max_message_size,
            )
        try:
            yield conn
        finally:
            with trio.move_on_after(CLOSE_TIMEOUT):
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
