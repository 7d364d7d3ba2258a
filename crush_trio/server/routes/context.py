"""What every route module shares: the context its handlers read, and how they answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
from quart import Response, request

from ... import wire
from ..api import Api
from ..history import History
from ..security import response_headers
from ..settings import Settings

if TYPE_CHECKING:
    from ...errors import CrushError

T = TypeVar("T")


@attrs.frozen
class RouteContext:
    """The objects the route handlers work with, built once by ``create_app``."""

    #: The operations shared with the websocket commands.
    api: Api
    #: How the server is served: token, origins, hosts, body bound, ping intervals.
    settings: Settings
    #: Diffs, reverts, forks, pages and exports over ``api``.
    history: History
    #: Called (synchronously) by ``POST /v1/control`` to stop the server; None: nothing to stop.
    on_shutdown: Callable[[], object] | None = None


def json_response(data: Any, status: int = 200) -> Response:
    """``data`` encoded by the wire converter, as ``application/json``."""
    body = wire.dumps(data)
    return Response(body, status=status, content_type="application/json")


def error_response(exc: CrushError) -> Response:
    """The answer to ``exc``: ``{"message": ...}`` with its status and headers (a 413 closes the
    connection, its body being left unread; a cluster redirect names the owner)."""
    response = json_response({"message": exc.message}, exc.status)
    if exc.status == 413:
        response.headers["Connection"] = "close"
    response.headers.update(response_headers(exc))
    return response


async def read_body(cls: type[T]) -> T:
    """The request body parsed as ``cls`` (400 naming the JSON path of what is wrong)."""
    raw = await request.get_data(cache=False)
    return wire.loads_body(raw, cls)
