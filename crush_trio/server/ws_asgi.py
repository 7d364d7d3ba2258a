"""The event websocket as a quart route (``server.ws_transport: "asgi"``), served by hypercorn.

The lifecycle is :func:`~.connection.serve_connection`'s; this module only adapts quart's
``websocket`` object to it. Hypercorn pings the client itself, writes one frame per send, and
cannot interrupt a send to a client that stopped reading (it writes inside a shielded scope):
the listening socket's ``TCP_USER_TIMEOUT`` (``server.tcp_user_timeout_ms``) makes the kernel
break such a connection, which bounds how long a stalled client can hold shutdown. Its writes go
through the connection's :class:`~.listener.PrefixedStream` (the dispatcher names it in
:data:`~.listener.CONNECTION_STREAM`), which writes every frame whole or aborts the connection,
and which a client killed as too slow bounds (:meth:`AsgiEventSocket.limit_writes`). A disconnect
cancels the handler (quart-trio), which is why the reader never sees the client leave.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import trio
from quart import websocket

from .connection import Subscription, close_bound, serve_connection
from .listener import CONNECTION_STREAM

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..backend.workspace import Workspace
    from ..broker import Event
    from .api import Api


class AsgiEventSocket:
    """quart's current ``websocket`` as an :class:`~.connection.EventSocket`."""

    max_batch = 1
    send_now = None  # hypercorn encodes and writes every frame itself
    left: tuple[type[Exception], ...] = ()  # a disconnect cancels the handler (quart-trio)
    sent = False  # hypercorn pings the client itself (websocket_ping_interval): no keepalive

    def __init__(self) -> None:
        #: The connection's stream under hypercorn (None: served without the dispatcher).
        self.stream = CONNECTION_STREAM.get()
        self._close_failed = False
        #: The wait in :meth:`receive`, and whether :meth:`stop_reading` was called.
        self._reading: trio.CancelScope | None = None
        self._stopped = False

    def limit_writes(self, deadline: float) -> None:
        if self.stream is not None:
            self.stream.limit_writes(deadline)

    def ending(self) -> str:
        stream = self.stream
        if stream is not None and stream.aborted:
            return "aborted"
        if self._close_failed or (stream is not None and stream.broken):
            return "gone"
        return "closed"

    async def send_frames(self, frames: Sequence[Event]) -> None:
        for frame in frames:
            await websocket.send(frame.text)

    async def ping(self) -> bool:  # never called: hypercorn pings
        return True

    def stop_reading(self) -> None:
        self._stopped = True
        if self._reading is not None:
            self._reading.cancel()

    async def receive(self) -> str | bytes | None:
        if not self._stopped:
            with trio.CancelScope() as self._reading:
                return await websocket.receive()
        return None

    async def close(self, code: int, reason: str) -> None:
        deadline = self.stream.write_deadline if self.stream is not None else math.inf
        with trio.move_on_after(close_bound(deadline), shield=True):
            try:
                await websocket.close(code, reason)
            except Exception:  # already closed by the peer or the server
                self._close_failed = True


async def serve_asgi_websocket(ws: Workspace, sub: Subscription, api: Api) -> None:
    """Accept the upgrade (already checked) and serve the connection until it ends."""
    await websocket.accept()
    await serve_connection(AsgiEventSocket(), ws, sub, api)
