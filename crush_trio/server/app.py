"""The HTTP application: the ``/v1`` routes, the error table and the browser client's files.

Routes are thin: parse and validate input with the wire converter, call :class:`Api`, encode the
result. Every :class:`~crush_trio.errors.CrushError` becomes ``{"message": ...}`` with its status;
anything else is a 500 whose message says it is a bug. The token, origin and ``Host`` checks, the
cross-site and content-type checks of state-changing requests and the per-port cookie name live in
:mod:`crush_trio.server.security` (tokens are compared in constant time and never logged: the
access log redacts ``token`` after URL-decoding); the event streams in :mod:`.sse` and
:mod:`.ws_asgi`.
"""

from __future__ import annotations

import logging
import os
import re
import time
from importlib import resources
from typing import Any, Final
from urllib.parse import parse_qsl, urlencode

from quart import Response, redirect, request, websocket
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from .. import __version__, wire
from ..errors import WS_CLOSE_SERVICE_RESTART, CrushError, NotFound, TooLarge, bug_message
from ..logs import set_log_context
from ..metrics import CONTENT_TYPE, render
from ..wire import (
    AgentInitRequest,
    AgentMessage,
    ControlRequest,
    CreateSessionRequest,
    CreateWorkspaceRequest,
    CurrentSessionRequest,
    GrantRequest,
    NeedsInit,
    SelectModelRequest,
    SkipRequest,
    TrustRequest,
    UpdateSessionRequest,
)
from . import openapi
from .api import Api
from .connection import check_upgrade, parse_subscription
from .history import parse_page, wants_page
from .history import register as register_history
from .security import (
    check_request_host,
    check_request_origin,
    check_request_token,
    check_state_change,
    redact_target,
    response_headers,
    token_cookie_name,
)
from .settings import Settings
from .sse import serve_sse
from .ws_asgi import serve_asgi_websocket

log = logging.getLogger(__name__)
access_log = logging.getLogger("crush_trio.access")

#: Environment variable that enables test-only routes (``/debug/...``); never set in production.
DEBUG_ROUTES_ENV: Final = "CRUSH_TRIO_DEBUG_ROUTES"


def json_response(data: Any, status: int = 200) -> Response:
    body = wire.dumps(data)
    return Response(body, status=status, content_type="application/json")


def error_response(exc: CrushError) -> Response:
    response = json_response({"message": exc.message}, exc.status)
    if exc.status == 413:
        response.headers["Connection"] = "close"
    response.headers.update(response_headers(exc))
    return response


def create_app(api: Api, settings: Settings, *, on_shutdown: Any = None) -> QuartTrio:
    """Build the ASGI app serving ``api``'s backend.

    Args:
        on_shutdown: called (synchronously) by ``POST /v1/control`` to stop the server.
    """
    app = QuartTrio("crush_trio", static_folder=None)  # our own /static route serves web/
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60
    backend = api.backend

    # -- auth, origin, logging ------------------------------------------------------------------

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
            await api.place(request.path, request.query_string, request.args, request.method)
        except CrushError as exc:
            response = error_response(exc)
            if request.method in ("POST", "PUT", "PATCH", "DELETE"):
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

    # -- errors ---------------------------------------------------------------------------------

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
        status = exc.code or 500
        if status == 404:
            message = (
                f"no route {request.method} {request.path}; see docs/protocol.md for the routes"
            )
        elif status == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        else:
            message = exc.description or exc.name
        response = json_response({"message": message}, status)
        allowed = getattr(exc, "valid_methods", None)
        if status == 405 and allowed:
            response.headers["Allow"] = ", ".join(sorted(allowed))  # RFC 9110 asks for it
        return response

    @app.errorhandler(Exception)
    async def _bug(exc: Exception) -> Response:
        log.exception(
            "unhandled error in %s %s",
            request.method,
            redact_target(request.path, "", settings.token),
        )
        return json_response({"message": bug_message(exc)}, 500)

    async def body(cls: type[Any]) -> Any:
        raw = await request.get_data(cache=False)
        return wire.loads_body(raw, cls)

    # Diffs, reverts, forks, run lists, exports, and the paged forms of the lists below.
    history = register_history(app, api, body, json_response)

    # -- system ---------------------------------------------------------------------------------

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
        response.headers["Content-Security-Policy"] = "default-src 'none'; frame-ancestors 'none'"
        return response

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(), content_type=CONTENT_TYPE)

    @app.post("/v1/control")
    async def control() -> Response:
        req = await body(ControlRequest)
        if req.command == "shutdown_if_idle":
            api.check_idle()
        if on_shutdown is not None:
            on_shutdown()
        return json_response({})

    @app.delete("/v1/clients/<client_id>")
    async def retire_client(client_id: str) -> Response:
        backend.retire(client_id)
        return json_response({})

    # -- workspaces -----------------------------------------------------------------------------

    @app.post("/v1/workspaces")
    async def create_workspace() -> Response:
        req = await body(CreateWorkspaceRequest)
        ws = await api.open_workspace(req.path, req.client_id)
        return json_response(ws.info)

    @app.get("/v1/workspaces")
    async def list_workspaces() -> Response:
        return json_response([ws.info for ws in backend.list()])

    @app.get("/v1/workspaces/<wid>")
    async def get_workspace(wid: str) -> Response:
        return json_response(backend.get(wid).info)

    @app.delete("/v1/workspaces/<wid>")
    async def delete_workspace(wid: str) -> Response:
        client_id = request.args.get("client_id")
        backend.release(wid, wire.validate_client_id(client_id))
        return json_response({})

    @app.post("/v1/workspaces/<wid>/current-session")
    async def current_session(wid: str) -> Response:
        ws = api.workspace(wid)
        client_id = wire.validate_client_id(request.args.get("client_id"))
        req = await body(CurrentSessionRequest)
        return json_response(await api.set_current_session(ws, client_id, req))

    @app.get("/v1/workspaces/<wid>/config")
    async def workspace_config(wid: str) -> Response:
        return json_response(api.config(api.workspace(wid)))

    @app.get("/v1/workspaces/<wid>/providers")
    async def workspace_providers(wid: str) -> Response:
        return json_response(api.providers(api.workspace(wid)))

    @app.post("/v1/workspaces/<wid>/config/model")
    async def select_model(wid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(api.select_model(ws, await body(SelectModelRequest)))

    @app.get("/v1/workspaces/<wid>/project/needs-init")
    async def needs_init(wid: str) -> Response:
        api.workspace(wid)
        return json_response(NeedsInit(needs_init=False))

    # -- sessions -------------------------------------------------------------------------------

    @app.post("/v1/workspaces/<wid>/sessions")
    async def create_session(wid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(await api.create_session(ws, await body(CreateSessionRequest)))

    @app.get("/v1/workspaces/<wid>/sessions")
    async def list_sessions(wid: str) -> Response:
        if wants_page(request.args):
            page = parse_page(request.args, what="sessions")
            return json_response(await history.sessions_page(api.workspace(wid), page))
        return json_response(await api.list_sessions(api.workspace(wid)))

    @app.get("/v1/workspaces/<wid>/sessions/<sid>")
    async def get_session(wid: str, sid: str) -> Response:
        return json_response(await api.get_session(api.workspace(wid), sid))

    @app.patch("/v1/workspaces/<wid>/sessions/<sid>")
    async def rename_session(wid: str, sid: str) -> Response:
        req = await body(UpdateSessionRequest)
        return json_response(await api.rename_session(api.workspace(wid), sid, req.title))

    @app.put("/v1/workspaces/<wid>/sessions/<sid>")
    async def save_session(wid: str, sid: str) -> Response:
        # Crush's SaveSession sends the whole session; only its title can change here.
        req = await body(UpdateSessionRequest)
        return json_response(await api.rename_session(api.workspace(wid), sid, req.title))

    @app.delete("/v1/workspaces/<wid>/sessions/<sid>")
    async def delete_session(wid: str, sid: str) -> Response:
        return json_response(await api.delete_session(api.workspace(wid), sid))

    @app.get("/v1/workspaces/<wid>/sessions/<sid>/messages")
    async def list_messages(wid: str, sid: str) -> Response:
        if wants_page(request.args):
            page = parse_page(request.args, what="messages")
            return json_response(await history.messages_page(api.workspace(wid), sid, page))
        return json_response(await api.list_messages(api.workspace(wid), sid))

    @app.get("/v1/workspaces/<wid>/sessions/<sid>/messages/user")
    async def session_user_messages(wid: str, sid: str) -> Response:
        ws = api.workspace(wid)
        await api.get_session(ws, sid)
        return json_response(await api.user_messages(ws, sid))

    @app.get("/v1/workspaces/<wid>/messages/user")
    async def user_messages(wid: str) -> Response:
        return json_response(await api.user_messages(api.workspace(wid)))

    @app.get("/v1/workspaces/<wid>/sessions/<sid>/history")
    async def session_history(wid: str, sid: str) -> Response:
        return json_response(await api.session_history(api.workspace(wid), sid))

    @app.get("/v1/workspaces/<wid>/sessions/<sid>/filetracker/files")
    async def read_files(wid: str, sid: str) -> Response:
        return json_response(await api.read_files(api.workspace(wid), sid))

    # -- agent ----------------------------------------------------------------------------------

    @app.get("/v1/workspaces/<wid>/agent")
    async def agent_info(wid: str) -> Response:
        return json_response(api.agent_info(api.workspace(wid)))

    @app.post("/v1/workspaces/<wid>/agent")
    async def prompt(wid: str) -> Response:
        ws = api.workspace(wid)
        accepted = await api.prompt(ws, await body(AgentMessage))
        return json_response(accepted, 202)

    @app.post("/v1/workspaces/<wid>/agent/init")
    async def agent_init(wid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(api.agent_init(ws, await body(AgentInitRequest)))

    @app.post("/v1/workspaces/<wid>/agent/update")
    async def agent_update(wid: str) -> Response:
        return json_response(api.agent_update(api.workspace(wid)))

    @app.get("/v1/workspaces/<wid>/agent/default-small-model")
    async def default_small_model(wid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(api.default_small_model(ws, request.args.get("provider_id")))

    @app.get("/v1/workspaces/<wid>/agent/sessions/<sid>")
    async def agent_session(wid: str, sid: str) -> Response:
        return json_response(await api.get_session(api.workspace(wid), sid))

    async def _session(wid: str, sid: str) -> Any:
        ws = api.workspace(wid)
        await api.get_session(ws, sid)
        return ws

    @app.post("/v1/workspaces/<wid>/agent/sessions/<sid>/cancel")
    async def cancel(wid: str, sid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(await api.cancel(ws, sid))

    @app.post("/v1/workspaces/<wid>/agent/sessions/<sid>/summarize")
    async def summarize(wid: str, sid: str) -> Response:
        return json_response(await api.summarize(api.workspace(wid), sid))

    @app.get("/v1/workspaces/<wid>/agent/sessions/<sid>/prompts/queued")
    async def queued(wid: str, sid: str) -> Response:
        return json_response(api.queued_count(await _session(wid, sid), sid))

    @app.get("/v1/workspaces/<wid>/agent/sessions/<sid>/prompts/list")
    async def queued_list(wid: str, sid: str) -> Response:
        return json_response(api.queued_list(await _session(wid, sid), sid))

    @app.post("/v1/workspaces/<wid>/agent/sessions/<sid>/prompts/clear")
    async def clear(wid: str, sid: str) -> Response:
        return json_response(await api.clear_queue(await _session(wid, sid), sid))

    @app.get("/v1/workspaces/<wid>/runs/<run_id>")
    async def get_run(wid: str, run_id: str) -> Response:
        return json_response(await history.run(api.workspace(wid), run_id))

    @app.post("/v1/workspaces/<wid>/runs/<run_id>/cancel")
    async def cancel_run(wid: str, run_id: str) -> Response:
        return json_response(await api.cancel_run(api.workspace(wid), run_id))

    # -- permissions ----------------------------------------------------------------------------

    @app.post("/v1/workspaces/<wid>/permissions/grant")
    async def grant(wid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(await api.grant(ws, await body(GrantRequest)))

    @app.get("/v1/workspaces/<wid>/permissions")
    async def pending_permissions(wid: str) -> Response:
        return json_response(api.pending_permissions(api.workspace(wid)))

    @app.get("/v1/workspaces/<wid>/permissions/skip")
    async def skip_state(wid: str) -> Response:
        return json_response(api.skip_state(api.workspace(wid)))

    @app.post("/v1/workspaces/<wid>/permissions/skip")
    async def skip(wid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(await api.skip(ws, await body(SkipRequest)))

    # -- trust ----------------------------------------------------------------------------------

    @app.post("/v1/workspaces/<wid>/trust")
    async def trust(wid: str) -> Response:
        ws = api.workspace(wid)
        return json_response(await api.trust(ws, await body(TrustRequest)))

    # -- test hooks (off unless CRUSH_TRIO_DEBUG_ROUTES=1) -----------------------------------

    if os.environ.get(DEBUG_ROUTES_ENV) == "1":

        @app.post("/v1/workspaces/<wid>/debug/drop-streams")
        async def drop_streams(wid: str) -> Response:
            ws = api.workspace(wid)
            dropped = ws.broker.drop_all("dropped by debug route", WS_CLOSE_SERVICE_RESTART)
            return json_response({"dropped": dropped})

    # -- event streams --------------------------------------------------------------------------

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

    # -- the browser client ---------------------------------------------------------------------

    @app.get("/")
    async def index() -> Any:
        if "token" in request.args:
            # The token is valid (checked above): trade it for a cookie and drop it from the URL.
            # The cookie is scoped to this start's unguessable path prefix, where the page then
            # lives: cookies ignore ports, and with Path=/ the browser would send the token to
            # every other server on this host (a dev server the agent started, say).
            rest = [(k, v) for k, v in parse_qsl(request.query_string.decode()) if k != "token"]
            target = settings.web_prefix + "/" + ("?" + urlencode(rest) if rest else "")
            response: Any = redirect(target, 303)
            response.set_cookie(
                token_cookie_name(request.headers),
                settings.token,
                httponly=True,
                samesite="Strict",
                path=settings.web_prefix,
            )
            return response
        return _static("index.html")

    @app.get("/static/<path:name>")
    async def static_file(name: str) -> Response:
        return _static(name)

    return app


_CONTENT_TYPES: Final = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}


_CSP_HOST: Final = re.compile(r"[A-Za-z0-9.\-\[\]:]+")


def page_csp(host: str | None) -> str:
    """The web client's Content-Security-Policy: it may connect to this server only (its own
    ``ws://``/``wss://`` origin is named too, for browsers before CSP Level 3), may not be
    framed, and loads nothing from elsewhere. ``host`` has passed the ``Host`` allow-list."""
    sockets = f" ws://{host} wss://{host}" if host and _CSP_HOST.fullmatch(host) else ""
    return (
        f"default-src 'self'; connect-src 'self'{sockets}; img-src 'self' data:; "
        "style-src 'self'; script-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
        "form-action 'self'"
    )


def _static(name: str) -> Response:
    if ".." in name.split("/"):
        raise NotFound(f"no file {name!r}")
    root = resources.files("crush_trio") / "web"
    target = root.joinpath(*name.split("/"))
    if not target.is_file():
        raise NotFound(f"no file {name!r} in the web client")
    suffix = "." + name.rsplit(".", 1)[-1] if "." in name else ""
    response = Response(
        target.read_bytes(), content_type=_CONTENT_TYPES.get(suffix, "application/octet-stream")
    )
    response.headers["Cache-Control"] = "no-cache"
    response.headers["Content-Security-Policy"] = page_csp(request.headers.get("Host"))
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    return response
