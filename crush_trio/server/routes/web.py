"""The browser client: ``GET /`` (which trades a ``?token=`` for a cookie) and its files under
``/static/``, each with a strict Content-Security-Policy."""

from __future__ import annotations

import re
from importlib import resources
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import parse_qsl, urlencode

from quart import Response, redirect, request

from ...errors import NotFound
from ..security import token_cookie_name

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from .context import RouteContext

_CONTENT_TYPES: Final = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}

_CSP_HOST: Final = re.compile(r"[A-Za-z0-9.\-\[\]:]+")


def register(app: QuartTrio, ctx: RouteContext) -> None:
    """Add the routes of this module to ``app``."""
    settings = ctx.settings

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
        return static_response("index.html")

    @app.get("/static/<path:name>")
    async def static_file(name: str) -> Response:
        return static_response(name)


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


def static_response(name: str) -> Response:
    """The web client's file ``name`` (404 for a name outside it)."""
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
