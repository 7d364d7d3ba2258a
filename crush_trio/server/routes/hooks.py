"""What runs around every request: the checks before it, the access log after it, and the error
table that turns every exception into ``{"message": ...}`` with its status.

The token, origin and ``Host`` checks and the cross-site and content-type checks of
state-changing requests are :mod:`crush_trio.server.security`'s; tokens are compared in constant
time and never logged (the access log redacts ``token`` after URL-decoding).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from quart import Response, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from ...errors import CrushError, TooLarge, bug_message
from ...logs import set_log_context
from ..security import (
    check_request_host,
    check_request_origin,
    check_request_token,
    check_state_change,
    redact_target,
)
from .context import error_response, json_response

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from .context import RouteContext

#: Unhandled errors are logged under the application module's name, where they always were.
log = logging.getLogger("crush_trio.server.app")
access_log = logging.getLogger("crush_trio.access")

#: Methods whose request body is left unread when a check refuses the request.
_BODY_METHODS = ("POST", "PUT", "PATCH", "DELETE")


def register(app: QuartTrio, ctx: RouteContext) -> None:
    """Add the request checks, the access log and the error handlers to ``app``."""
    settings = ctx.settings

    @app.before_request
    async def _auth() -> Response | None:
        request.environ_started = time.perf_counter()  # type: ignore[attr-defined]
        ids = request.view_args or {}
        set_log_context(
            workspace_id=ids.get("wid"), session_id=ids.get("sid"), run_id=ids.get("run_id")
        )
        try:
            check_request_host(settings, request.headers)
            if request.path == "/v1/health":
                return None
            check_request_token(settings, request.headers, request.args, request.cookies)
            if request.path.endswith("/events"):
                check_request_origin(settings, request.headers, request.scheme)
            check_state_change(settings, request.method, request.headers, request.scheme)
            await ctx.api.place(request.path, request.query_string, request.args, request.method)
        except CrushError as exc:
            response = error_response(exc)
            if request.method in _BODY_METHODS:
                response.headers["Connection"] = "close"  # the body is left unread
            return response
        return None

    @app.after_request
    async def _access_log(response: Response) -> Response:
        if access_log.isEnabledFor(logging.INFO):
            started = getattr(request, "environ_started", None)
            elapsed = (time.perf_counter() - started) * 1000 if started else 0.0
            target = redact_target(request.path, request.query_string, settings.token)
            access_log.info(
                "%s %s %d %.1fms",
                request.method,
                target,
                response.status_code,
                elapsed,
                extra={
                    "method": request.method,
                    "target": target,
                    "status": response.status_code,
                    "duration_ms": round(elapsed, 1),
                },
            )
        return response

    @app.errorhandler(CrushError)
    async def _crush_error(exc: CrushError) -> Response:
        return error_response(exc)

    @app.errorhandler(RequestEntityTooLarge)
    async def _too_large(exc: RequestEntityTooLarge) -> Response:
        return error_response(
            TooLarge(
                f"request body too large: the limit is {settings.max_body_bytes} "
                "bytes (server.max_body_bytes); send a smaller body"
            )
        )

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        return http_error_response(exc)

    @app.errorhandler(Exception)
    async def _bug(exc: Exception) -> Response:
        log.exception(
            "unhandled error in %s %s",
            request.method,
            redact_target(request.path, "", settings.token),
        )
        return json_response({"message": bug_message(exc)}, 500)


def http_error_response(exc: HTTPException) -> Response:
    """A routing or protocol error of the framework (no route, method not allowed, ...) in our
    shape, with ``Allow`` on a 405 (RFC 9110 asks for it)."""
    status = exc.code or 500
    if status == 404:
        message = f"no route {request.method} {request.path}; see docs/protocol.md for the routes"
    elif status == 405:
        message = f"method {request.method} is not allowed on {request.path}"
    else:
        message = exc.description or exc.name
    response = json_response({"message": message}, status)
    allowed = getattr(exc, "valid_methods", None)
    if status == 405 and allowed:
        response.headers["Allow"] = ", ".join(sorted(allowed))
    return response
