"""Workspace routes: open (or join), list, read and release a workspace, the session a client
shows, Crush's project check and the trust of the workspace's own config files."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quart import Response, request

from ... import wire
from ...wire import CreateWorkspaceRequest, CurrentSessionRequest, NeedsInit, TrustRequest
from .context import json_response, read_body

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from .context import RouteContext


def register(app: QuartTrio, ctx: RouteContext) -> None:
    """Add the routes of this module to ``app``."""
    api = ctx.api

    @app.post("/v1/workspaces")
    async def create_workspace() -> Response:
        req = await read_body(CreateWorkspaceRequest)
        ws = await api.open_workspace(req.path, req.client_id)
        return json_response(ws.info)

    @app.get("/v1/workspaces")
    async def list_workspaces() -> Response:
        return json_response([ws.info for ws in api.backend.list()])

    @app.get("/v1/workspaces/<wid>")
    async def get_workspace(wid: str) -> Response:
        return json_response(api.backend.get(wid).info)

    @app.delete("/v1/workspaces/<wid>")
    async def delete_workspace(wid: str) -> Response:
        client_id = request.args.get("client_id")
        api.backend.release(wid, wire.validate_client_id(client_id))
        return json_response({})

    @app.post("/v1/workspaces/<wid>/current-session")
    async def current_session(wid: str) -> Response:
        ws = api.workspace(wid)
        client_id = wire.validate_client_id(request.args.get("client_id"))
        req = await read_body(CurrentSessionRequest)
        return json_response(await api.set_current_session(ws, client_id, req))

    @app.get("/v1/workspaces/<wid>/project/needs-init")
    async def needs_init(wid: str) -> Response:
        api.workspace(wid)
        return json_response(NeedsInit(needs_init=False))

    @app.post("/v1/workspaces/<wid>/trust")
    async def trust(wid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(await api.trust(ws, await read_body(TrustRequest)))
