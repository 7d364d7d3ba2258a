"""Run routes: one run with the files it changed, and cancelling one run. The run list, diffs
and reverts are in :mod:`.changes`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .context import json_response

if TYPE_CHECKING:
    from quart import Response
    from quart_trio import QuartTrio

    from .context import RouteContext


def register(app: QuartTrio, ctx: RouteContext) -> None:
    """Add the routes of this module to ``app``."""
    api, history = ctx.api, ctx.history

    @app.get("/v1/workspaces/<wid>/runs/<run_id>")
    async def get_run(wid: str, run_id: str) -> Response:
        return json_response(await history.run(api.workspace(wid), run_id))

    @app.post("/v1/workspaces/<wid>/runs/<run_id>/cancel")
    async def cancel_run(wid: str, run_id: str) -> Response:
        return json_response(await api.cancel_run(api.workspace(wid), run_id))
