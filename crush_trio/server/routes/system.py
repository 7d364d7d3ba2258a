"""The server's own routes: ``/v1/health``, ``/v1/version``, the OpenAPI document and page,
``/metrics``, ``POST /v1/control`` and ``DELETE /v1/clients/{client_id}``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quart import Response

from ... import __version__
from ...metrics import CONTENT_TYPE, render
from ...wire import ControlRequest
from .. import openapi
from .context import json_response, read_body

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from .context import RouteContext

#: The OpenAPI page loads nothing and may not be framed.
DOCS_PAGE_CSP = "default-src 'none'; frame-ancestors 'none'"


def register(app: QuartTrio, ctx: RouteContext) -> None:
    """Add the routes of this module to ``app``."""
    api = ctx.api

    @app.get("/v1/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/v1/version")
    async def version() -> Response:
        return json_response({"version": __version__})

    @app.get("/v1/openapi.json")
    async def openapi_document() -> Response:
        return json_response(openapi.document())

    @app.get("/v1/docs")
    async def openapi_page() -> Response:
        response = Response(openapi.docs_page(), content_type="text/html; charset=utf-8")
        response.headers["Content-Security-Policy"] = DOCS_PAGE_CSP
        return response

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(), content_type=CONTENT_TYPE)

    @app.post("/v1/control")
    async def control() -> Response:
        req = await read_body(ControlRequest)
        if req.command == "shutdown_if_idle":
            api.check_idle()
        if ctx.on_shutdown is not None:
            ctx.on_shutdown()
        return json_response({})

    @app.delete("/v1/clients/<client_id>")
    async def retire_client(client_id: str) -> Response:
        api.backend.retire(client_id)
        return json_response({})
