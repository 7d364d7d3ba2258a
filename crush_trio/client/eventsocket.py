"""Raw access to a workspace's event stream: one websocket connection, its frames as text.

:class:`~crush_trio.client.WorkspaceClient` decodes every frame of its stream, routes it to run
handles and subscriptions, skips replayed duplicates and reconnects on its own. A caller that
wants the stream exactly as the server sends it opens :func:`open_event_socket` instead: one
connection with the client's address forms, token and ``hello`` handshake, and nothing more: no
decoding, no de-duplication, no reconnect, no keep-alive pings.

That is what holds many connections cheaply (the load benchmarks' fan-out and idle clients count
frames without decoding them), records a stream byte for byte, or speaks the websocket commands of
PROTOCOL §5 (``agent.prompt`` ...) over :attr:`EventSocket.connection`.
"""

from __future__ import annotations

import uuid
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import orjson
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    ConnectionTimeout,
    HandshakeError,
    WebSocketConnection,
)

from .connection import parse_server_url
from .errors import CrushError, Timeout, Unreachable, single_errors
from .transport import (
    HELLO_TIMEOUT,
    MAX_EVENT_BYTES,
    WS_QUEUE_SIZE,
    WireCounter,
    bearer_headers,
    open_stream_socket,
    receive_hello,
    rejection_error,
    stream_resource,
    websocket_base,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

__all__ = ["EventSocket", "open_event_socket"]


class EventSocket:
    """One open connection to a workspace's event stream, from :func:`open_event_socket`.

    Read it with ``async for frame in sock`` (each frame's text, as received) or
    :meth:`receive`. Reading ends when the connection closes; :attr:`close_code` and
    :attr:`close_reason` then say how.

    Backpressure: frames wait in the websocket library's queue (``message_queue_size`` of them);
    when it is full the connection stops reading its socket, and the server, which never waits on
    a client, drops lossy events for it (a ``gap`` frame follows) or closes it with 1013.

    Attributes:
        hello: the server's ``hello`` frame, decoded (``seq`` is the workspace's latest event).
        client_id: the ``client_id`` the connection was opened with.
        connection: the trio-websocket connection, for a caller that sends websocket commands.
            Only :meth:`receive` (or the iteration) should read from it.
        close_code: the close code once the connection has closed (``None`` before, and when it
            closed without one, e.g. a reset connection).
        close_reason: the close reason text, once closed.
        compressed: whether the connection negotiated permessage-deflate.
    """

    def __init__(
        self,
        connection: WebSocketConnection,
        hello: dict[str, Any],
        client_id: str,
        counter: WireCounter | None = None,
    ) -> None:
        self.connection = connection
        self.hello = hello
        self.client_id = client_id
        self.compressed = bool(getattr(connection, "compressing", False))
        self._counter = counter or WireCounter()
        self.closed = False
        self.close_code: int | None = None
        self.close_reason = ""

    async def receive(self) -> str | None:
        """The next frame's text, or ``None`` once the connection is closed.

        Cancellation: safe; a frame is only taken from the queue when it is returned.
        """
        try:
            message = await self.connection.get_message()
        except ConnectionClosed as exc:
            self.closed = True
            if exc.reason is not None:
                self.close_code, self.close_reason = exc.reason.code, exc.reason.reason or ""
            return None
        return message if isinstance(message, str) else message.decode()

    @property
    def wire_bytes(self) -> int:
        """Bytes read from the socket so far (the upgrade response and every frame as it
        travelled: compressed, when :attr:`compressed`)."""
        return self._counter.received

    def __aiter__(self) -> EventSocket:
        return self

    async def __anext__(self) -> str:
        frame = await self.receive()
        if frame is None:
            raise StopAsyncIteration
        return frame


@asynccontextmanager
async def open_event_socket(
    url: str,
    workspace_id: str,
    token: str | None = None,
    *,
    client_id: str | None = None,
    since: int | None = None,
    timeout: float = HELLO_TIMEOUT,  # noqa: ASYNC109
    message_queue_size: int = WS_QUEUE_SIZE,
    max_message_size: int = MAX_EVENT_BYTES,
    deltas: bool = True,
    compression: bool = True,
    batch: bool = False,
) -> AsyncIterator[EventSocket]:
    """Open one connection to a workspace's event stream for the block's duration.

    It returns once the server's ``hello`` frame has arrived; leaving the block closes the
    connection with a close handshake (bounded by the client's close timeout). Cancelling the
    block from outside cuts the connection without one.

    Args:
        url: the server, as for :func:`~crush_trio.client.connect` (``http://host:port``, with an
            optional ``?token=``, or ``unix:/path/to.sock``).
        workspace_id: the workspace (from :meth:`Client.workspaces
            <crush_trio.client.Client.workspaces>` or ``WorkspaceClient.id``). Opening a stream does
            not open a workspace; the connection holds it, as every stream does (PROTOCOL §6).
        token: the server's token.
        client_id: the id the server counts this connection's hold under (a new UUID by default).
        since: resume after this ``seq``: the server replays the events after it (or sends a
            ``gap`` when it no longer holds them).
        timeout: bound on connecting and receiving the ``hello`` (seconds).
        message_queue_size: frames buffered between the socket and :meth:`EventSocket.receive`.
        max_message_size: the largest frame accepted (a bigger one closes the connection, 1009).
        deltas: ask for ``message_delta`` events (``deltas=1``); ``False`` gets whole ``message``
            snapshots only, as a Crush client does.
        compression: offer permessage-deflate (the frames' text is the same either way;
            :attr:`EventSocket.wire_bytes` shows what travelled).
        batch: take frames that carry several envelopes (``batch=1``): a frame is then one
            envelope or several written together, one per line, in order.

    Raises:
        ValueError: ``url`` is not a server address.
        AuthError, NotFound, Conflict: the server refused the connection (token, unknown
            workspace, retired client).
        Timeout: no ``hello`` within ``timeout``.
        Unreachable: nothing answers at ``url``, or it is not a crush_trio event stream.
    """
    base, token, unix_path = parse_server_url(url, token)
    client_id = client_id or str(uuid.uuid4())
    resource = stream_resource(workspace_id, client_id, since, deltas=deltas, batch=batch)
    headers = bearer_headers(token)
    where = f"the event stream of workspace {workspace_id} at {url.split('?')[0]}"
    counter = WireCounter()
    with single_errors():
        async with AsyncExitStack() as stack:
            try:
                conn = await stack.enter_async_context(
                    open_stream_socket(
                        websocket_base(base),
                        unix_path,
                        resource,
                        headers,
                        timeout=timeout,
                        message_queue_size=message_queue_size,
                        max_message_size=max_message_size,
                        compression=compression,
                        counter=counter,
                    )
                )
                hello = await receive_hello(conn, where, timeout)
            except (
                ConnectionClosed,
                HandshakeError,
                OSError,
                trio.TooSlowError,
                orjson.JSONDecodeError,
            ) as exc:
                raise _open_failure(where, exc, timeout) from exc
            yield EventSocket(conn, hello, client_id, counter)


def _open_failure(where: str, exc: BaseException, timeout: float) -> CrushError:
    if isinstance(exc, ConnectionRejected):
        return rejection_error(where, exc)
    if isinstance(exc, trio.TooSlowError | ConnectionTimeout):
        return Timeout(f"{where} did not answer within {timeout:g} s")
    return Unreachable(
        f"cannot open {where} ({exc.__class__.__name__}: {exc}); check the address and that the "
        "server is running"
    )
