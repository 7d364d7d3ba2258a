"""Event stream transports: websocket (with commands) and SSE.

Each connection is one :class:`~crush_trio.broker.ClientStream` plus tasks that move its bytes:

* **writer** (exactly one per socket): drains the client's bounded channel into the socket;
  nothing else writes to the socket (command replies go through the same channel).
* **reader** (websocket): always drains ``websocket.receive()`` so the server notices a
  disconnect, and runs commands; replies wait for room in the channel (backpressure on commands).
* **watchdog**: when the broker kills the client (a must-deliver event did not fit in time) or the
  workspace closes, it ends the connection with 1013 ``too slow`` or 1001.

A send to a peer that stopped reading can block inside the HTTP server with no way to cancel it;
the listening socket's ``TCP_USER_TIMEOUT`` (``server.tcp_user_timeout_ms``) makes the kernel
break such a connection, which bounds how long a stalled client can hold shutdown.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Final

import orjson
import trio
from quart import Response, websocket

from .. import __version__, wire
from ..broker import Event
from ..errors import (
    WS_CLOSE_GOING_AWAY,
    BadRequest,
    CrushError,
    NotFound,
)
from ..wire import AgentMessage, CreateSessionRequest, GrantRequest, RunRef, SessionRef

if TYPE_CHECKING:
    from ..backend.workspace import Workspace
    from .api import Api
    from .app import Settings

log = logging.getLogger(__name__)

#: Bound on sending a close frame to a client (seconds).
CLOSE_TIMEOUT: Final = 2.0

SSE_PING: Final = b": ping\n\n"


def _reply_frame(payload: dict[str, Any]) -> Event:
    return Event(-1, "reply", orjson.dumps(payload).decode(), must_deliver=False)


# ---------------------------------------------------------------------------------------------
# Websocket


async def serve_websocket(
    ws: Workspace, client_id: str, since: int | None, api: Api, settings: Settings
) -> None:
    """Serve one websocket connection until the client leaves or the workspace closes."""
    await websocket.accept()
    stream, first = ws.broker.subscribe(since=since, client_id=client_id)
    hello = ws.broker.hello(ws.id, __version__)  # same tick as subscribe: seq cannot move
    ws.attach(client_id)
    close_code, close_reason = 1000, ""
    try:
        # Two tasks per connection: the writer (below) and this one, which reads commands.
        async with trio.open_nursery() as nursery:

            async def writer() -> None:
                await websocket.send(hello.text)
                for frame in first:
                    await websocket.send(frame.text)
                first.clear()
                async for event in stream.receive:
                    if stream.killed.is_set():
                        break  # disconnected by the broker: close now, skip what is queued
                    await websocket.send(event.text)
                    stream.after_receive()
                # The channel closed: the client was killed, or the workspace closed (in which
                # case everything queued, the final run_complete events included, was sent).
                nursery.cancel_scope.cancel()

            nursery.start_soon(writer)
            while True:
                raw = await websocket.receive()
                reply = await _run_command(raw, ws, api)
                if reply is not None:
                    await stream.send_reply(_reply_frame(reply))
    finally:
        stream.close()
        ws.detach(client_id)
    if stream.killed.is_set():
        close_code, close_reason = stream.kill_code, stream.kill_reason
    elif ws.closing:
        close_code, close_reason = WS_CLOSE_GOING_AWAY, "workspace closed"
    with trio.move_on_after(CLOSE_TIMEOUT, shield=True):
        try:
            await websocket.close(close_code, close_reason)
        except Exception:  # already closed by the peer or the server
            pass


_METHODS: Final = {
    "agent.prompt",
    "agent.cancel",
    "agent.clear_queue",
    "sessions.create",
    "sessions.list",
    "messages.list",
    "runs.get",
    "runs.cancel",
    "permissions.grant",
}


async def _run_command(raw: str | bytes, ws: Workspace, api: Api) -> dict[str, Any] | None:
    """Run one websocket command; returns the reply (PROTOCOL §5 "Websocket commands")."""
    if isinstance(raw, bytes):
        return {"type": "error", "message": "binary frames are not accepted; send JSON text"}
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return {"type": "error", "message": f"frame is not valid JSON ({exc}); send a command"}
    has_id = isinstance(data, dict) and "id" in data
    request_id = data.get("id") if isinstance(data, dict) else None
    try:
        if not isinstance(data, dict):
            raise BadRequest('a command must be a JSON object {"id", "method", "params"}')
        command = wire.structure(data, wire.WsCommand, what="command")
        result = await _dispatch(command.method, command.params, ws, api)
    except CrushError as exc:
        if not has_id:
            return {"type": "error", "message": exc.message}
        return {
            "type": "reply",
            "id": request_id,
            "ok": False,
            "status": exc.status,
            "message": exc.message,
        }
    except Exception as exc:
        log.exception("websocket command failed with a bug")
        message = f"internal error ({type(exc).__name__}); this is a bug, please report it"
        if not has_id:
            return {"type": "error", "message": message}
        return {"type": "reply", "id": request_id, "ok": False, "status": 500, "message": message}
    return {
        "type": "reply",
        "id": request_id,
        "ok": True,
        "result": wire.converter.unstructure(result),
    }


async def _dispatch(method: str, params: dict[str, Any], ws: Workspace, api: Api) -> Any:
    if method not in _METHODS:
        raise NotFound(f"unknown method {method!r}; methods are {', '.join(sorted(_METHODS))}")
    what = f"params of {method}"
    if method == "agent.prompt":
        return await api.prompt(ws, wire.structure(params, AgentMessage, what=what))
    if method == "agent.cancel":
        ref = wire.structure(params, SessionRef, what=what)
        await api.get_session(ws, ref.session_id, in_body=True)
        return await api.cancel(ws, ref.session_id)
    if method == "agent.clear_queue":
        ref = wire.structure(params, SessionRef, what=what)
        await api.get_session(ws, ref.session_id, in_body=True)
        return await api.clear_queue(ws, ref.session_id)
    if method == "sessions.create":
        return await api.create_session(ws, wire.structure(params, CreateSessionRequest, what=what))
    if method == "sessions.list":
        return await api.list_sessions(ws)
    if method == "messages.list":
        ref = wire.structure(params, SessionRef, what=what)
        return await api.list_messages(ws, ref.session_id, in_body=True)
    if method == "runs.cancel":
        ref_cancel = wire.structure(params, RunRef, what=what)
        return await api.cancel_run(ws, ref_cancel.run_id, in_body=True)
    if method == "runs.get":
        ref_run = wire.structure(params, RunRef, what=what)
        return await api.get_run(ws, ref_run.run_id, in_body=True)
    return await api.grant(ws, wire.structure(params, GrantRequest, what=what))


# ---------------------------------------------------------------------------------------------
# SSE


async def serve_sse(
    ws: Workspace, client_id: str, since: int | None, settings: Settings
) -> Response:
    """An SSE response streaming the workspace's events (PROTOCOL §5)."""
    ws.check_open()
    interval = settings.sse_ping_interval

    async def body() -> AsyncIterator[bytes]:
        # Subscribe (and hold the workspace) only once the body is being sent: a client that
        # leaves before that point must not leave a hold behind, and the finally below runs only
        # for a body that started.
        if ws.closing:
            return
        stream, first = ws.broker.subscribe(since=since, client_id=client_id)
        hello = ws.broker.hello(ws.id, __version__)  # same tick as subscribe: seq cannot move
        ws.attach(client_id)
        try:
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
        finally:
            stream.close()
            ws.detach(client_id)

    response = Response(
        body(),
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    response.timeout = None
    return response
