"""Routes over what a workspace's runs did: ``GET .../runs`` (paged), ``GET .../runs/{id}/diff``,
``POST .../runs/{id}/revert``, ``GET .../reverts/{revert_id}``, ``GET .../sessions/{sid}/diff``,
``POST .../sessions/{sid}/fork`` and ``GET .../sessions/{sid}/export`` (docs/protocol.md
"Changes" and "Paging"); the operations are :class:`~crush_trio.server.history.History`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quart import Response, request

from ... import wire
from ...changes import RevertConflict
from ...wire import ForkRequest, RevertRequest
from ..history import parse_page
from .context import json_response, read_body

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from .context import RouteContext


def register(app: QuartTrio, ctx: RouteContext) -> None:
    """Add the routes of this module to ``app``."""
    api, history = ctx.api, ctx.history
    w = "/v1/workspaces/<wid>"

    @app.get(w + "/runs")
    async def list_runs(wid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(await history.list_runs(ws, parse_page(request.args, what="runs")))

    @app.get(w + "/runs/<run_id>/diff")
    async def run_diff(wid: str, run_id: str) -> Response:
        return json_response(await history.run_diff(api.workspace(wid), run_id))

    @app.post(w + "/runs/<run_id>/revert")
    async def revert(wid: str, run_id: str) -> Response:
        ws = api.workspace(wid)
        raw = await request.get_data(cache=False)
        req = wire.loads_body(raw, RevertRequest) if raw.strip() else RevertRequest()
        try:
            return json_response(await history.revert(ws, run_id, req))
        except RevertConflict as exc:
            return json_response({"message": exc.message, "files": exc.files}, 409)

    @app.get(w + "/reverts/<revert_id>")
    async def revert_record(wid: str, revert_id: str) -> Response:
        return json_response(await history.revert_record(api.workspace(wid), revert_id))

    @app.get(w + "/sessions/<sid>/diff")
    async def session_diff(wid: str, sid: str) -> Response:
        return json_response(await history.session_diff(api.workspace(wid), sid))

    @app.post(w + "/sessions/<sid>/fork")
    async def fork(wid: str, sid: str) -> Response:
        ws = api.workspace(wid)
        req = await read_body(ForkRequest)
        try:
            return json_response(await history.fork(ws, sid, req), 201)
        except RevertConflict as exc:
            return json_response({"message": exc.message, "files": exc.files}, 409)

    @app.get(w + "/sessions/<sid>/export")
    async def export(wid: str, sid: str) -> Response:
        fmt = request.args.get("format", "json")
        return await history.export(api.workspace(wid), sid, fmt)
