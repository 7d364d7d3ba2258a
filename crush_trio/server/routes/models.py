"""Configuration and model routes: the configuration in use, the provider catalog, choosing the
large or small model, and a provider's default small model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quart import Response, request

from ...wire import SelectModelRequest
from .. import api as ops
from .context import json_response, read_body

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from .context import RouteContext


def register(app: QuartTrio, ctx: RouteContext) -> None:
    """Add the routes of this module to ``app``."""
    api = ctx.api

    @app.get("/v1/workspaces/<wid>/config")
    async def workspace_config(wid: str) -> Response:
        return json_response(ops.workspace_config(api.workspace(wid)))

    @app.get("/v1/workspaces/<wid>/providers")
    async def workspace_providers(wid: str) -> Response:
        return json_response(ops.providers(api.workspace(wid)))

    @app.post("/v1/workspaces/<wid>/config/model")
    async def select_model(wid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(ops.select_model(ws, await read_body(SelectModelRequest)))

    @app.get("/v1/workspaces/<wid>/agent/default-small-model")
    async def default_small_model(wid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(ops.default_small_model(ws, request.args.get("provider_id")))
