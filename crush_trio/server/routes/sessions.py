"""Session routes: create, list (paged on request), read, rename and delete a session, and read
its messages, its user messages, the files it wrote and the files it read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quart import Response, request

from ...wire import CreateSessionRequest, UpdateSessionRequest
from ..history import parse_page, wants_page
from .context import json_response, read_body

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from .context import RouteContext


def register(app: QuartTrio, ctx: RouteContext) -> None:
    """Add the routes of this module to ``app``."""
    api, history = ctx.api, ctx.history
    s = "/v1/workspaces/<wid>/sessions/<sid>"

    @app.post("/v1/workspaces/<wid>/sessions")
    async def create_session(wid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(await api.create_session(ws, await read_body(CreateSessionRequest)))

    @app.get("/v1/workspaces/<wid>/sessions")
    async def list_sessions(wid: str) -> Response:
        if wants_page(request.args):
            page = parse_page(request.args, what="sessions")
            return json_response(await history.sessions_page(api.workspace(wid), page))
        return json_response(await api.list_sessions(api.workspace(wid)))

    @app.get(s)
    async def get_session(wid: str, sid: str) -> Response:
        return json_response(await api.get_session(api.workspace(wid), sid))

    @app.patch(s)
    async def rename_session(wid: str, sid: str) -> Response:
        req = await read_body(UpdateSessionRequest)
        return json_response(await api.rename_session(api.workspace(wid), sid, req.title))

    @app.put(s)
    async def save_session(wid: str, sid: str) -> Response:
        # Crush's SaveSession sends the whole session; only its title can change here.
        req = await read_body(UpdateSessionRequest)
        return json_response(await api.rename_session(api.workspace(wid), sid, req.title))

    @app.delete(s)
    async def delete_session(wid: str, sid: str) -> Response:
        return json_response(await api.delete_session(api.workspace(wid), sid))

    @app.get(s + "/messages")
    async def list_messages(wid: str, sid: str) -> Response:
        if wants_page(request.args):
            page = parse_page(request.args, what="messages")
            return json_response(await history.messages_page(api.workspace(wid), sid, page))
        return json_response(await api.list_messages(api.workspace(wid), sid))

    @app.get(s + "/messages/user")
    async def session_user_messages(wid: str, sid: str) -> Response:
        ws = api.workspace(wid)
        await api.get_session(ws, sid)
        return json_response(await api.user_messages(ws, sid))

    @app.get("/v1/workspaces/<wid>/messages/user")
    async def user_messages(wid: str) -> Response:
        return json_response(await api.user_messages(api.workspace(wid)))

    @app.get(s + "/history")
    async def session_history(wid: str, sid: str) -> Response:
        return json_response(await api.session_history(api.workspace(wid), sid))

    @app.get(s + "/filetracker/files")
    async def read_files(wid: str, sid: str) -> Response:
        return json_response(await api.read_files(api.workspace(wid), sid))
