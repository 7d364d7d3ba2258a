"""The event streams of a workspace: ``GET .../events`` (SSE, :mod:`..sse`) and the websocket
route ``.../ws`` (:mod:`..ws_asgi`), and the test-only route that drops them."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Final

from quart import Response, request, websocket

from ...errors import WS_CLOSE_SERVICE_RESTART, CrushError
from ..connection import check_upgrade, parse_subscription
from ..security import check_request_host, check_request_token
from ..sse import serve_sse
from ..ws_asgi import serve_asgi_websocket
from .context import error_response, json_response

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from .context import RouteContext

#: Environment variable that enables test-only routes (``/debug/...``); never set in production.
DEBUG_ROUTES_ENV: Final = "CRUSH_TRIO_DEBUG_ROUTES"


def register_debug(app: QuartTrio, ctx: RouteContext) -> None:
    """Add the test-only routes to ``app`` when :data:`DEBUG_ROUTES_ENV` is ``1``."""
    if os.environ.get(DEBUG_ROUTES_ENV) != "1":
        return
    api = ctx.api

    @app.post("/v1/workspaces/<wid>/debug/drop-streams")
    async def drop_streams(wid: str) -> Response:
        ws = api.workspace(wid)
        dropped = ws.broker.drop_all("dropped by debug route", WS_CLOSE_SERVICE_RESTART)
        return json_response({"dropped": dropped})


def register(app: QuartTrio, ctx: RouteContext) -> None:
    """Add the event-stream routes to ``app``."""
    api, settings = ctx.api, ctx.settings

    @app.get("/v1/workspaces/<wid>/events")
    async def events(wid: str) -> Response:
        ws = api.workspace(wid)
        sub = parse_subscription(request.args, request.headers.get("Last-Event-ID"))
        return await serve_sse(ws, sub, settings)

    @app.websocket("/v1/workspaces/<wid>/ws")
    async def ws_endpoint(wid: str) -> Response | None:
        try:
            check_request_host(settings, websocket.headers)
            check_request_token(settings, websocket.headers, websocket.args, websocket.cookies)
            await api.place(websocket.path, websocket.query_string, websocket.args)
            ws, sub = check_upgrade(
                settings,
                api,
                wid,
                websocket.headers,
                websocket.args,
                websocket.cookies,
                websocket.scheme,
            )
        except CrushError as exc:
            return error_response(exc)
        await serve_asgi_websocket(ws, sub, api)
        return None
