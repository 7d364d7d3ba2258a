"""The connection dispatcher: one address for HTTP, the event websocket and the event stream.

Each accepted connection's request head is read first and checked (:func:`~.head.check_head`):
a head that is too long, too slow, malformed, or carries non-ASCII bytes in a header that a
library decodes later gets its error status here and the connection is closed. Then the
request is routed (:func:`route`):

* an upgrade to the event websocket (``GET /v1/workspaces/{wid}/ws`` with ``Upgrade:
  websocket``) is served by trio-websocket directly (:mod:`.ws_trio`);
* a plain ``GET /v1/workspaces/{wid}/events`` by the SSE handler (:mod:`.sse_listener`);
* everything else by hypercorn (:class:`~.listener.HttpConnection`), with the bytes already
  read put back in front of the stream.

A kept-alive connection is routed again at each request that starts while hypercorn is at rest
between two: hypercorn hands the connection back (:attr:`~.listener.HttpConnection.
handed_back`) when that request is one of the first two. So an event stream asked for on a
connection that served other requests first (Go's HTTP client reuses idle connections, as
Crush's client does) gets the same direct writes and compression as on a new connection. A
request pipelined behind an answer in progress stays with hypercorn, which serves it through
the app's routes (same contract, more CPU per event).

Every connection runs inside :func:`~.listener.contained`: whatever a peer sends, an exception
ends that connection only, with one log line.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import trio

from .._compat.hypercorn import ConnectionState, Lifespan, WorkerContext
from .head import HEAD_LIMIT, HeadError, check_head, read_head
from .listener import (
    CONNECTION_STREAM,
    HttpConnection,
    PrefixedStream,
    answer_error,
    clear_user_timeout,
    contained,
)
from .peers import sandboxed_peer
from .security import strip_web_prefix

if TYPE_CHECKING:
    from hypercorn.config import Config as HypercornConfig

log = logging.getLogger(__name__)

_WS_REQUEST: Final = re.compile(rb"^GET /v1/workspaces/[^/?\s]+/ws(?:\?[^\s]*)? HTTP/1\.1\r\n")
_UPGRADE: Final = re.compile(rb"(?im)^upgrade:[ \t]*websocket[ \t]*\r?$")
_SSE_REQUEST: Final = re.compile(
    rb"^GET /v1/workspaces/[^/?%\s]+/events(?:\?[^\s]*)? HTTP/1\.1\r\n"
)
#: Headers that make a request more than a plain GET (a body, an upgrade, an expectation).
_NOT_PLAIN_GET: Final = re.compile(
    rb"(?im)^(?:transfer-encoding|upgrade|expect)[ \t]*:|^content-length[ \t]*:[ \t]*0*[1-9]"
)


def strip_head_prefix(head: bytes, web_prefix: str) -> bytes:
    """``head`` (a checked request head and what followed it) with the web page's path prefix
    taken off the request target (see :func:`~.security.strip_web_prefix`)."""
    if not web_prefix:
        return head
    line_end = head.find(b"\r\n")
    method, target, version = head[:line_end].split(b" ", 2)
    path, sep, query = target.partition(b"?")
    stripped = strip_web_prefix(path.decode("ascii"), web_prefix)
    if stripped is None:
        return head
    target = stripped.encode("ascii") + sep + query
    return b" ".join((method, target, version)) + head[line_end:]


def is_event_websocket(head: bytes) -> bool:
    end = head.find(b"\r\n\r\n")
    return end >= 0 and bool(_WS_REQUEST.match(head)) and bool(_UPGRADE.search(head[:end]))


def is_event_stream(head: bytes) -> bool:
    """A plain HTTP/1.1 ``GET /v1/workspaces/{wid}/events`` (no body, no upgrade)."""
    end = head.find(b"\r\n\r\n")
    return end >= 0 and bool(_SSE_REQUEST.match(head)) and not _NOT_PLAIN_GET.search(head[:end])


WsHandler = Callable[[PrefixedStream], Awaitable[None]]


class Routes:
    """Which handler serves a checked request head (see the module): the event websocket's, the
    event stream's, or none (hypercorn)."""

    __slots__ = ("sse_handler", "web_prefix", "ws_handler")

    def __init__(
        self, ws_handler: WsHandler | None, sse_handler: WsHandler | None, web_prefix: str
    ) -> None:
        self.ws_handler = ws_handler
        self.sse_handler = sse_handler
        self.web_prefix = web_prefix

    def route(self, head: bytes) -> tuple[WsHandler, str] | None:
        """The handler of ``head`` (prefix already stripped) and what it serves, for the logs;
        None: hypercorn's."""
        if self.ws_handler is not None and is_event_websocket(head):
            return self.ws_handler, "event websocket"
        if self.sse_handler is not None and is_event_stream(head):
            return self.sse_handler, "event stream"
        return None

    def claim(self, data: bytes) -> bytes | None:
        """For hypercorn between two requests (:class:`~.listener.HttpConnection`'s
        ``take_over``): ``data`` (the next head, whole, and what followed it) as the dispatcher
        serves it when one of its handlers does, else None. A head the dispatcher would refuse
        stays with hypercorn, whose rules (:class:`~.listener.ConnectionRules`) refuse it."""
        end = data.find(b"\r\n\r\n")
        if end < 0 or end + 4 > HEAD_LIMIT:
            return None
        try:
            check_head(data)
        except HeadError:
            return None
        data = strip_head_prefix(data, self.web_prefix)
        return data if self.route(data) is not None else None


async def serve_dispatching(
    app: Any,
    config: HypercornConfig,
    sock: Any,
    ws_handler: WsHandler | None,
    *,
    shutdown_trigger: Callable[[], Awaitable[Any]],
    web_prefix: str = "",
    sse_handler: WsHandler | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` with hypercorn, the event websocket with ``ws_handler`` and the event
    stream with ``sse_handler`` on ``sock`` (see the module; ``None``: hypercorn serves it
    through the app's route). A request under ``web_prefix`` (the web page's path prefix) is
    served as the path below it (:class:`~.listener.ConnectionRules` does the same for the
    requests hypercorn serves).

    Mirrors hypercorn's own trio worker (lifespan, then connections, then a graceful deadline
    after ``shutdown_trigger`` returns) with the dispatcher in front of each connection.
    """
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(app, config, lifespan_state)
    context = WorkerContext(None)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    # A Unix socket needs no token, so no sandboxed command may connect to it (peers.py).
    unix = sock.family == socket.AF_UNIX
    routes = Routes(ws_handler, sse_handler, web_prefix)
    # With no handler of its own there is nothing to take back: hypercorn reads every request.
    take_over = routes.claim if ws_handler is not None or sse_handler is not None else None

    async def serve_request(stream: trio.SocketStream, head: bytes) -> bytes | None:
        """Serve the request ``head`` begins (checked, prefix stripped); the next one's bytes
        when hypercorn handed the connection back before it."""
        wrapped = PrefixedStream(stream, head)
        routed = routes.route(head)
        del head  # the stream holds it as long as it is needed
        if routed is not None:
            handler, what = routed
            # The handler has its own policy for slow clients (see clear_user_timeout).
            clear_user_timeout(stream.socket)
            async with contained(wrapped, what):
                await handler(wrapped)
            return None
        CONNECTION_STREAM.set(wrapped)  # this task's, and hypercorn's under it
        # TCPServer is typed for SSL streams but takes any stream with a .socket.
        connection = HttpConnection(
            app,
            config,
            context,
            ConnectionState(lifespan_state.copy()),
            wrapped,
            take_over=take_over,
        )
        await connection
        return connection.handed_back

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as connections:

            async def handle(stream: trio.SocketStream) -> None:
                async with contained(stream):
                    refused = sandboxed_peer(stream.socket) if unix else None
                    if refused is not None:
                        log.warning("refused a Unix-socket connection: %s", refused)
                        await answer_error(stream, HeadError(403, refused))
                        return
                    try:
                        head = await read_head(stream)
                        if not head:
                            return
                        check_head(head)
                        head = strip_head_prefix(head, web_prefix)
                    except HeadError as exc:
                        await answer_error(stream, exc)
                        return
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        return
                    next_head: bytes | None = head
                    del head
                    while next_head is not None:
                        next_head = await serve_request(stream, next_head)

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
