"""Permission routes: the requests waiting for an answer, answering one, and approving
everything in the workspace (``skip``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...wire import GrantRequest, SkipRequest
from .context import json_response, read_body

if TYPE_CHECKING:
    from quart import Response
    from quart_trio import QuartTrio

    from .context import RouteContext


def register(app: QuartTrio, ctx: RouteContext) -> None:
    """Add the routes of this module to ``app``."""
    api = ctx.api
    p = "/v1/workspaces/<wid>/permissions"

    @app.post(p + "/grant")
    async def grant(wid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(await api.grant(ws, await read_body(GrantRequest)))

    @app.get(p)
    async def pending_permissions(wid: str) -> Response:
        return json_response(api.pending_permissions(api.workspace(wid)))

    @app.get(p + "/skip")
    async def skip_state(wid: str) -> Response:
        return json_response(api.skip_state(api.workspace(wid)))

    @app.post(p + "/skip")
    async def skip(wid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(await api.skip(ws, await read_body(SkipRequest)))
