"""The event stream as Server-Sent Events (``GET /v1/workspaces/{wid}/events``, PROTOCOL §5).

The same subscription as the websockets (:func:`~.connection.subscribed`), but no commands and no
close code: the body is an async iterator that hypercorn drains, so the writer is the response
itself, and an idle stream gets a comment line every ``server.sse_ping_interval`` seconds.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Final

import trio
from quart import Response

from ..broker import Event
from .connection import Subscription, subscribed

if TYPE_CHECKING:
    from ..backend.workspace import Workspace
    from .settings import Settings

#: The keep-alive comment of an idle stream.
SSE_PING: Final = b": ping\n\n"


async def serve_sse(ws: Workspace, sub: Subscription, settings: Settings) -> Response:
    """An SSE response streaming the workspace's events (PROTOCOL §5)."""
    ws.check_open()
    interval = settings.sse_ping_interval

    async def body() -> AsyncIterator[bytes]:
        # Subscribe (and hold the workspace) only once the body is being sent: a client that
        # leaves before that point must not leave a hold behind, and the subscription is undone
        # only for a body that started.
        if ws.closing:
            return
        async with subscribed(ws, sub, "sse") as (stream, hello, first):
            yield hello.sse
            for frame in first:
                yield frame.sse
            while not stream.killed.is_set():
                # Never yield inside a cancel scope: the scope would span the consumer's code.
                event: Event | None = None
                with trio.move_on_after(interval if interval > 0 else math.inf):
                    try:
                        event = await stream.receive.receive()
                    except trio.EndOfChannel:
                        return
                if event is None:
                    yield SSE_PING
                    continue
                yield event.sse
                stream.after_receive()

    response = Response(
        body(),
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    response.timeout = None
    return response
