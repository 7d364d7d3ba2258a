"""Websocket commands (PROTOCOL §5 "Websocket commands"): one frame in, one reply frame out.

:func:`run_command` is what every websocket transport calls for each text frame it receives; the
operations themselves are :class:`~crush_trio.server.api.Api`'s, shared with the HTTP routes, so a
command and its route answer the same result and the same status.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import orjson

from .. import wire
from ..broker import Event
from ..errors import BadRequest, CrushError, NotFound, bug_message
from ..wire import (
    AcceptedPrompt,
    AgentMessage,
    CreateSessionRequest,
    GrantRequest,
    RunRef,
    SessionRef,
)
from .history import History

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    import trio

    from ..backend.workspace import Workspace
    from ..broker import ClientStream
    from .api import Api

log = logging.getLogger(__name__)

#: The command methods, as listed in an unknown method's error.
METHODS: Final = frozenset(
    {
        "agent.prompt",
        "agent.cancel",
        "agent.clear_queue",
        "sessions.create",
        "sessions.list",
        "sessions.summarize",
        "messages.list",
        "runs.get",
        "runs.cancel",
        "permissions.grant",
    }
)


def reply_frame(payload: dict[str, Any]) -> Event:
    """A reply as a frame for the client's queue (lossless, not sequenced)."""
    return Event(-1, "reply", orjson.dumps(payload).decode(), must_deliver=False)


class DurableReply(dict[str, Any]):
    """The reply to an accepted ``agent.prompt``, to be sent once its run record is committed."""

    def __init__(self, reply: dict[str, Any], run_id: str) -> None:
        super().__init__(reply)
        self.run_id = run_id

    async def send_when_durable(self, ws: Workspace, stream: ClientStream) -> None:
        reply: dict[str, Any] = self
        try:
            await ws.agent.durable(self.run_id)
        except CrushError as exc:
            reply = {**self, "ok": False, "status": exc.status, "message": exc.message}
            del reply["result"]
        await stream.send_reply(reply_frame(reply))


class LaterReply:
    """A command whose work takes long (``sessions.summarize``): it runs in a task of its own,
    so the commands after it are read meanwhile, and its reply is queued when it ends."""

    def __init__(self, request_id: Any, work: Callable[[], Awaitable[Any]]) -> None:
        self.request_id = request_id
        self.work = work

    async def send_when_done(self, stream: ClientStream) -> None:
        reply: dict[str, Any]
        try:
            result = await self.work()
        except CrushError as exc:
            reply = {"ok": False, "status": exc.status, "message": exc.message}
        except Exception as exc:
            log.exception("websocket command failed with a bug")
            reply = {"ok": False, "status": 500, "message": bug_message(exc)}
        else:
            reply = {"ok": True, "result": wire.unstructure(result)}
        await stream.send_reply(reply_frame({"type": "reply", "id": self.request_id, **reply}))


async def answer_command(
    raw: str | bytes, ws: Workspace, api: Api, stream: ClientStream, nursery: trio.Nursery
) -> None:
    """Run one websocket command and queue its reply. The reply to ``agent.prompt`` waits for
    the commit of its run record (docs/protocol.md "Durability of an accepted prompt") in a task
    of its own in ``nursery``, so the commands after it are read meanwhile and a burst of prompts
    on one connection shares its commits."""
    reply = await run_command(raw, ws, api)
    if isinstance(reply, DurableReply):
        nursery.start_soon(reply.send_when_durable, ws, stream)
    elif isinstance(reply, LaterReply):
        nursery.start_soon(reply.send_when_done, stream)
    elif reply is not None:
        await stream.send_reply(reply_frame(reply))


async def run_command(
    raw: str | bytes, ws: Workspace, api: Api
) -> dict[str, Any] | LaterReply | None:
    """Run one websocket command; returns the reply (PROTOCOL §5 "Websocket commands"). An
    accepted ``agent.prompt`` returns a :class:`DurableReply` (see :func:`answer_command`)."""
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
        result = await dispatch(command.method, command.params, ws, api)
        if isinstance(result, LaterReply):
            result.request_id = request_id
            return result
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
        message = bug_message(exc)
        if not has_id:
            return {"type": "error", "message": message}
        return {"type": "reply", "id": request_id, "ok": False, "status": 500, "message": message}
    reply = {
        "type": "reply",
        "id": request_id,
        "ok": True,
        "result": wire.unstructure(result),
    }
    if isinstance(result, AcceptedPrompt):
        return DurableReply(reply, result.run_id)
    return reply


async def dispatch(method: str, params: dict[str, Any], ws: Workspace, api: Api) -> Any:
    """Parse ``params`` for ``method`` and run it; an id inside ``params`` that names nothing is
    a 400 (the HTTP routes answer 404 for an id in the path)."""
    if method not in METHODS:
        raise NotFound(f"unknown method {method!r}; methods are {', '.join(sorted(METHODS))}")
    what = f"params of {method}"
    if method == "agent.prompt":
        return await api.accept_prompt(ws, wire.structure(params, AgentMessage, what=what))
    if method == "agent.cancel":
        # As the HTTP route: idempotent, no session check (PROTOCOL §3).
        ref = wire.structure(params, SessionRef, what=what)
        return await api.cancel(ws, ref.session_id)
    if method == "agent.clear_queue":
        ref = wire.structure(params, SessionRef, what=what)
        await api.get_session(ws, ref.session_id, in_body=True)
        return await api.clear_queue(ws, ref.session_id)
    if method == "sessions.create":
        return await api.create_session(ws, wire.structure(params, CreateSessionRequest, what=what))
    if method == "sessions.summarize":
        ref_summary = wire.structure(params, SessionRef, what=what)
        await api.get_session(ws, ref_summary.session_id, in_body=True)
        return LaterReply(None, partial(api.summarize, ws, ref_summary.session_id, in_body=True))
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
        run = await api.get_run(ws, ref_run.run_id, in_body=True)
        return await History.decorate(ws, run)  # with the files it changed, as over HTTP
    return await api.grant(ws, wire.structure(params, GrantRequest, what=what))
