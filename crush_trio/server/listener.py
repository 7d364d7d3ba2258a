"""One address for HTTP and the event websocket: a connection dispatcher in front of hypercorn.

Each accepted connection's request head is read first. An upgrade to the event websocket
(``GET /v1/workspaces/{wid}/ws`` with ``Upgrade: websocket``) is served by trio-websocket
directly (:mod:`crush_trio.server.wsendpoint`); everything else, including websocket upgrades
arriving on a reused keep-alive connection, goes to hypercorn with the bytes already read put back
in front of the stream.

Why: hypercorn's websocket send path costs about three times the CPU per message of a bare
trio-websocket server, keeps five tasks per idle connection, and writes inside a shielded scope
that no timeout can interrupt (docs/performance.md). trio-websocket's sends are cancellable, so a
stalled client can be cut off by the broker at once.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState

log = logging.getLogger(__name__)

#: Longest request head read before dispatching (bytes) and how long a client may take to send it.
HEAD_LIMIT: Final = 16 * 1024
HEAD_TIMEOUT: Final = 10.0

_WS_REQUEST: Final = re.compile(rb"^GET /v1/workspaces/[^/?\s]+/ws(?:\?[^\s]*)? HTTP/1\.1\r\n")
_UPGRADE: Final = re.compile(rb"(?im)^upgrade:[ \t]*websocket[ \t]*\r?$")


def clear_user_timeout(sock: Any) -> None:
    """Take ``TCP_USER_TIMEOUT`` (inherited from the listening socket) off an event websocket.

    The event websocket has its own policy for slow clients, and its sends can be cancelled: lossy
    events are dropped (then a ``gap``), and a client that cannot take a must-deliver event within
    ``server.must_deliver_timeout`` is closed with 1013. The kernel's timeout, which also aborts a
    connection whose receive window stays closed that long, would cut off clients that are only
    slow (a busy process reading hundreds of connections) before that policy could apply.
    """
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 0)
        except OSError as exc:  # not a TCP socket (a test stream), or a closed one
            log.debug("could not clear TCP_USER_TIMEOUT: %s", exc)


class PrefixedStream(trio.abc.HalfCloseableStream):
    """A socket stream with bytes already read put back in front of it."""

    def __init__(self, stream: trio.SocketStream, prefix: bytes) -> None:
        self.transport = stream
        self.socket = stream.socket
        self._prefix = prefix
        self.head = prefix  # the request head as read (the websocket endpoint reads Host from it)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._prefix:
            size = len(self._prefix) if max_bytes is None else max_bytes
            data, self._prefix = self._prefix[:size], self._prefix[size:]
            await trio.lowlevel.checkpoint()
            return data
        return await self.transport.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.transport.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.transport.send_eof()

    async def aclose(self) -> None:
        await self.transport.aclose()


async def read_head(stream: trio.SocketStream) -> bytes:
    """Read until the end of the request head (or the limit, EOF, or the timeout)."""
    data = b""
    with trio.move_on_after(HEAD_TIMEOUT):
        while b"\r\n\r\n" not in data and len(data) < HEAD_LIMIT:
            chunk = await stream.receive_some(HEAD_LIMIT)
            if not chunk:
                break
            data += chunk
    return data


def is_event_websocket(head: bytes) -> bool:
    end = head.find(b"\r\n\r\n")
    return end >= 0 and bool(_WS_REQUEST.match(head)) and bool(_UPGRADE.search(head[:end]))


WsHandler = Callable[[PrefixedStream], Awaitable[None]]


async def serve_dispatching(
    app: Any,
    config: HypercornConfig,
    sock: Any,
    ws_handler: WsHandler,
    *,
    shutdown_trigger: Callable[[], Awaitable[Any]],
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` with hypercorn and the event websocket with ``ws_handler`` on ``sock``.

    Mirrors hypercorn's own trio worker (lifespan, then connections, then a graceful deadline
    after ``shutdown_trigger`` returns) with the dispatcher in front of each connection.
    """
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(app, config, lifespan_state)
    context = WorkerContext(None)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as connections:

            async def handle(stream: trio.SocketStream) -> None:
                try:
                    head = await read_head(stream)
                except (trio.BrokenResourceError, OSError):
                    await stream.aclose()
                    return
                wrapped = PrefixedStream(stream, head)
                if is_event_websocket(head):
                    clear_user_timeout(stream.socket)
                    await ws_handler(wrapped)
                else:
                    # TCPServer is typed for SSL streams but takes any stream with a .socket.
                    await TCPServer(
                        app,
                        config,
                        context,
                        ConnectionState(lifespan_state.copy()),
                        wrapped,  # type: ignore[arg-type]
                    )

            task_status.started()
            async with trio.open_nursery() as accepting:
                accepting.start_soon(
                    partial(trio.serve_listeners, handle, [listener], handler_nursery=connections)
                )
                await shutdown_trigger()
                accepting.cancel_scope.cancel()
            await context.terminated.set()
            connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
