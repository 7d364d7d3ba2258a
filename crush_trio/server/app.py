"""The HTTP application: the ``/v1`` routes, the error table and the browser client's files.

Routes are thin: parse and validate input with the wire converter, call :class:`Api`, encode the
result. Every :class:`~crush_trio.errors.CrushError` becomes ``{"message": ...}`` with its status;
anything else is a 500 whose message says it is a bug. The routes live in :mod:`.routes`, one
module per resource, each adding its handlers with ``register(app, ctx)``; the request checks
(token, origin, ``Host``, cross-site and content-type rules, in :mod:`crush_trio.server.security`)
and the error table in :mod:`.routes.hooks`; the event streams in :mod:`.sse` and :mod:`.ws_asgi`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from quart_trio import QuartTrio

from .history import History
from .routes import (
    agent,
    changes,
    events,
    hooks,
    models,
    permissions,
    runs,
    sessions,
    system,
    web,
    workspaces,
)
from .routes.context import RouteContext

if TYPE_CHECKING:
    from .api import Api
    from .settings import Settings

#: Seconds a request body may take to arrive (quart's ``BODY_TIMEOUT``).
BODY_TIMEOUT: Final = 60


def create_app(api: Api, settings: Settings, *, on_shutdown: Any = None) -> QuartTrio:
    """Build the ASGI app serving ``api``'s backend.

    Args:
        on_shutdown: called (synchronously) by ``POST /v1/control`` to stop the server.
    """
    app = QuartTrio("crush_trio", static_folder=None)  # our own /static route serves web/
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = BODY_TIMEOUT
    ctx = RouteContext(api=api, settings=settings, history=History(api), on_shutdown=on_shutdown)
    hooks.register(app, ctx)  # checks before, access log after, and the error table
    changes.register(app, ctx)
    system.register(app, ctx)
    workspaces.register(app, ctx)
    models.register(app, ctx)
    sessions.register(app, ctx)
    agent.register(app, ctx)
    runs.register(app, ctx)
    permissions.register(app, ctx)
    events.register_debug(app, ctx)
    events.register(app, ctx)
    web.register(app, ctx)
    return app
