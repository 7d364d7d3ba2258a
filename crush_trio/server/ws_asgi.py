"""The event websocket as a quart route (``server.ws_transport: "asgi"``), served by hypercorn.

The lifecycle is :func:`~.connection.serve_connection`'s; this module only adapts quart's
``websocket`` object to it. Hypercorn pings the client itself, writes one frame per send, and
cannot interrupt a send to a client that stopped reading (it writes inside a shielded scope):
the listening socket's ``TCP_USER_TIMEOUT`` (``server.tcp_user_timeout_ms``) makes the kernel
break such a connection, which bounds how long a stalled client can hold shutdown. A disconnect
cancels the handler (quart-trio), which is why the reader never sees the client leave.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio
from quart import websocket

from ..broker import Event
from .connection import CLOSE_TIMEOUT, Subscription, serve_connection

if TYPE_CHECKING:
    from ..backend.workspace import Workspace
    from .api import Api


class AsgiEventSocket:
    """quart's current ``websocket`` as an :class:`~.connection.EventSocket`."""

    max_batch = 1
    ping_interval = 0.0  # hypercorn's websocket_ping_interval

    async def send_frames(self, frames: Sequence[Event]) -> None:
        for frame in frames:
            await websocket.send(frame.text)

    async def ping(self) -> bool:  # never called: ping_interval is 0
        return True

    async def receive(self) -> str | bytes | None:
        return await websocket.receive()

    async def close(self, code: int, reason: str) -> None:
        with trio.move_on_after(CLOSE_TIMEOUT, shield=True):
            try:
                await websocket.close(code, reason)
            except Exception:  # already closed by the peer or the server
                pass


async def serve_asgi_websocket(ws: Workspace, sub: Subscription, api: Api) -> None:
    """Accept the upgrade (already checked) and serve the connection until it ends."""
    await websocket.accept()
    await serve_connection(AsgiEventSocket(), ws, sub, api)
