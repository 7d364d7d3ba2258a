"""Agent routes: the agent's state, getting it ready, prompts (202 once the run record is
stored), a session as the agent sees it, cancel, summaries and the queue of waiting prompts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...wire import AgentInitRequest, AgentMessage
from .context import json_response, read_body

if TYPE_CHECKING:
    from quart import Response
    from quart_trio import QuartTrio

    from ...backend.workspace import Workspace
    from ..api import Api
    from .context import RouteContext


async def session_workspace(api: Api, wid: str, sid: str) -> Workspace:
    """The workspace ``wid``, once its session ``sid`` is known to exist (404 otherwise)."""
    ws = api.workspace(wid)
    await api.get_session(ws, sid)
    return ws


def register(app: QuartTrio, ctx: RouteContext) -> None:
    """Add the routes of this module to ``app``."""
    api = ctx.api
    w = "/v1/workspaces/<wid>/agent"
    a = w + "/sessions/<sid>"

    @app.get(w)
    async def agent_info(wid: str) -> Response:
        return json_response(api.agent_info(api.workspace(wid)))

    @app.post(w)
    async def prompt(wid: str) -> Response:
        ws = api.workspace(wid)
        accepted = await api.prompt(ws, await read_body(AgentMessage))
        return json_response(accepted, 202)

    @app.post(w + "/init")
    async def agent_init(wid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(api.agent_init(ws, await read_body(AgentInitRequest)))

    @app.post(w + "/update")
    async def agent_update(wid: str) -> Response:
        return json_response(api.agent_update(api.workspace(wid)))

    @app.get(a)
    async def agent_session(wid: str, sid: str) -> Response:
        return json_response(await api.get_session(api.workspace(wid), sid))

    @app.post(a + "/cancel")
    async def cancel(wid: str, sid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(await api.cancel(ws, sid))

    @app.post(a + "/summarize")
    async def summarize(wid: str, sid: str) -> Response:
        return json_response(await api.summarize(api.workspace(wid), sid))

    @app.get(a + "/prompts/queued")
    async def queued(wid: str, sid: str) -> Response:
        return json_response(api.queued_count(await session_workspace(api, wid, sid), sid))

    @app.get(a + "/prompts/list")
    async def queued_list(wid: str, sid: str) -> Response:
        return json_response(api.queued_list(await session_workspace(api, wid, sid), sid))

    @app.post(a + "/prompts/clear")
    async def clear(wid: str, sid: str) -> Response:
        return json_response(await api.clear_queue(await session_workspace(api, wid, sid), sid))
