"""Request rules: the token, the ``Origin`` of event streams, the ``Host`` allow-list, cross-site
checks of state-changing requests, the JSON content type, the per-port token cookie, token
redaction in logs, the ``since``/``Last-Event-ID`` seq, and the headers of a cluster's answers
that send a client elsewhere (``Location`` of a 307, ``Retry-After`` of a 503).

Every function here is pure (headers in, verdict out) so that both HTTP paths (the quart app and
the trio-websocket endpoint) apply the same rules. Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import secrets
from typing import TYPE_CHECKING, Any, Final, Protocol
from urllib.parse import parse_qsl, quote, urlencode

from ..errors import (
    BadRequest,
    CrushError,
    Forbidden,
    MisdirectedRequest,
    Moved,
    OwnerUnavailable,
    Unauthorized,
    UnsupportedMediaType,
)

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable

#: Host names every server answers to (any port).
LOOPBACK_HOSTS: Final = frozenset({"localhost", "127.0.0.1", "::1"})
#: Most distinct ``Host`` values whose verdict is remembered (the cache is cleared when full).
HOST_CACHE_SIZE: Final = 256
#: Methods that change state: they get the ``Origin``/``Sec-Fetch-Site`` and content-type checks.
STATE_CHANGING_METHODS: Final = frozenset({"POST", "PUT", "PATCH", "DELETE"})
#: ``Sec-Fetch-Site`` values that mean the request was made by another site's page.
FOREIGN_FETCH_SITES: Final = frozenset({"cross-site", "same-site"})
#: Prefix of the token cookie; the port the browser used follows it (``crush_trio_token_7433``).
TOKEN_COOKIE_PREFIX: Final = "crush_trio_token_"
#: Random bytes (hex-encoded) of the web page's path prefix, new at every start
#: (:func:`new_web_prefix`).
WEB_PREFIX_BYTES: Final = 16
#: Addresses that mean "every interface" when given to ``--host``.
_WILDCARD_BINDS: Final = frozenset({"0.0.0.0", "::", ""})
#: What stays as it is in a redirect's path (RFC 3986 ``pchar`` and ``/``); the query also
#: keeps ``?`` and existing ``%`` escapes.
_PATH_SAFE: Final = "/:@!$&'()*+,;=-._~"
_QUERY_SAFE: Final = _PATH_SAFE + "?%"


def split_host(value: str) -> tuple[str, str]:
    """``(name, port)`` of a ``Host`` header value; the name lower-cased, without brackets or
    trailing dot; ``port`` is ``""`` when absent."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return value.lower(), ""
        name, rest = value[1:end], value[end + 1 :]
        port = rest[1:] if rest.startswith(":") else rest  # junk after "]" fails the port check
    elif value.count(":") == 1:
        name, port = value.split(":", 1)
    else:
        name, port = value, ""
    return name.lower().rstrip("."), port


def _ip_allowed(name: str, *, any_ip: bool) -> bool:
    """An IP literal passes when it is a loopback address, or any when ``any_ip``."""
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    return any_ip or address.is_loopback


class HostPolicy:
    """Which ``Host`` names this server answers to.

    Loopback names and addresses always; the names in ``allowed`` (``server.allowed_hosts``,
    ``--allow-host``); the bind address itself when it is a specific address; and any IP
    literal when the server
    binds every interface (``0.0.0.0``/``::``). An IP literal cannot be re-bound by DNS, so it
    cannot carry another site's page to this server; host *names* must be listed.
    """

    def __init__(self, allowed: Iterable[str] = (), *, bind: str = "127.0.0.1") -> None:
        names = set(LOOPBACK_HOSTS)
        for entry in allowed:
            name, _ = split_host(str(entry))
            if name:
                names.add(name)
        bind_name = bind.strip("[]").lower()
        self.any_ip_literal = bind_name in _WILDCARD_BINDS
        if not self.any_ip_literal:
            names.add(bind_name)
        self.names: frozenset[str] = frozenset(names)
        self._cache: dict[str, bool] = {}

    def allows(self, host: str) -> bool:
        """Whether a request with this ``Host`` header value is served (cached per value)."""
        verdict = self._cache.get(host)
        if verdict is None:
            if len(self._cache) >= HOST_CACHE_SIZE:
                self._cache.clear()
            name, port = split_host(host)
            verdict = (port == "" or port.isdigit()) and (
                name in self.names or _ip_allowed(name, any_ip=self.any_ip_literal)
            )
            self._cache[host] = verdict
        return verdict


class RequestPolicy(Protocol):
    """What the request rules read of how the server is served (the app's
    :class:`~crush_trio.server.settings.Settings` is one)."""

    @property
    def token(self) -> str:
        """The token every request must carry (``""``: none)."""
        ...

    @property
    def unix(self) -> bool:
        """Served on a Unix socket, which no web page can reach: no token or ``Host`` check."""
        ...

    @property
    def allow_origins(self) -> Collection[str]:
        """Origins besides the server's own whose pages may use it."""
        ...

    @property
    def hosts(self) -> HostPolicy:
        """The host names served."""
        ...


def check_request_host(settings: RequestPolicy, headers: Any) -> None:
    """Raise :class:`MisdirectedRequest` (421) unless the ``Host`` header names this server.

    Requests without ``Host`` pass (HTTP/1.0 tools; every browser sends it), and so does every
    request on a Unix socket, which no web page can reach.
    """
    if settings.unix:
        return
    host = headers.get("Host")
    if host is None or settings.hosts.allows(host):
        return
    raise MisdirectedRequest(
        f"host {host!r} is not a name this server answers to; connect through localhost or "
        f"127.0.0.1, or add the name to the config key server.allowed_hosts (or --allow-host "
        f"{split_host(host)[0] or 'NAME'})"
    )


def own_origin(headers: Any, scheme: str) -> str:
    """This server's origin as the client sees it: scheme + the ``Host`` header."""
    return f"{'https' if scheme in ('https', 'wss') else 'http'}://{headers.get('Host', '')}"


def presented_token(headers: Any, args: Any, cookies: Any) -> str | None:
    """The token a request carries: bearer header, then ``?token=``, then the cookie of the port
    the browser used (:func:`token_cookie_name`)."""
    auth = headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return str(auth[7:].strip())
    if "token" in args:
        return str(args["token"])
    cookie = cookies.get(token_cookie_name(headers))
    return str(cookie) if cookie is not None else None


def check_request_token(settings: RequestPolicy, headers: Any, args: Any, cookies: Any) -> None:
    """Raise :class:`Unauthorized` unless the request carries the server's token."""
    if settings.unix or not settings.token:
        return
    given = presented_token(headers, args, cookies)
    if given is None:
        raise Unauthorized(
            "missing token: send 'Authorization: Bearer TOKEN' or add ?token=TOKEN "
            "(the token is printed by 'crush-trio serve')"
        )
    if not hmac.compare_digest(given.encode(), settings.token.encode()):
        raise Unauthorized("wrong token: use the token printed by 'crush-trio serve'")


def check_request_origin(settings: RequestPolicy, headers: Any, scheme: str) -> None:
    """Raise :class:`Forbidden` for an ``Origin`` that is neither ours nor allowed (event
    streams: any method)."""
    origin = headers.get("Origin")
    if origin is None:
        return
    own = own_origin(headers, scheme)
    if origin == own or origin in settings.allow_origins:
        return
    raise Forbidden(
        f"origin {origin!r} is not allowed; connect from {own} or start the server with "
        f"--allow-origin {origin}"
    )


def parse_seq(value: str | None, name: str) -> int | None:
    """The event seq a client resumes after (``since``, ``Last-Event-ID``); ``None`` when absent.

    Raises:
        BadRequest: not a non-negative integer; the message names ``name``.
    """
    if value is None or value == "":
        return None
    try:
        seq = int(value)
    except ValueError:
        raise BadRequest(f"{name} must be an integer event seq, got {value!r}") from None
    if seq < 0:
        raise BadRequest(f"{name} must not be negative")
    return seq


def check_state_change(settings: RequestPolicy, method: str, headers: Any, scheme: str) -> None:
    """For POST/PUT/PATCH/DELETE: refuse another site's page (403) and a non-JSON body (415).

    403 when ``Origin`` is present and neither ours nor allowed (``--allow-origin``), or when
    ``Sec-Fetch-Site`` says ``cross-site``/``same-site`` and no allowed ``Origin`` vouches for it.
    415 unless ``Content-Type`` is ``application/json``; a request without a body may omit it.
    """
    if method not in STATE_CHANGING_METHODS:
        return
    origin = headers.get("Origin")
    allowed_origin = origin is not None and origin in settings.allow_origins
    if origin is not None and not allowed_origin:
        own = own_origin(headers, scheme)
        if origin != own:
            raise Forbidden(
                f"origin {origin!r} may not send {method} requests to this server; send them "
                f"from {own} or start the server with --allow-origin {origin}"
            )
    site = headers.get("Sec-Fetch-Site", "").strip().lower()
    if site in FOREIGN_FETCH_SITES and not allowed_origin:
        raise Forbidden(
            f"a {site} page may not send {method} requests to this server (Sec-Fetch-Site: "
            f"{site}); use the server's own page, or allow its origin with --allow-origin"
        )
    content_type = headers.get("Content-Type")
    if content_type is None:
        if _has_body(headers):
            raise UnsupportedMediaType(
                f"{method} with a body needs 'Content-Type: application/json'; send the body "
                "as JSON with that header"
            )
        return
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise UnsupportedMediaType(
            f"Content-Type {content_type!r} is not accepted: request bodies are JSON; send "
            "'Content-Type: application/json'"
        )


def _has_body(headers: Any) -> bool:
    if headers.get("Transfer-Encoding") is not None:
        return True
    length = headers.get("Content-Length")
    return length is not None and length.strip() not in ("", "0")


def new_web_prefix() -> str:
    """A fresh, unguessable path prefix for the web page (``/w-<32 hex digits>``).

    The token cookie is scoped to it (``Path=``): cookies ignore ports, so with ``Path=/`` every
    server on the same host (a dev server the agent started, say) would receive the token with
    each request the browser sends it. Under this prefix only this server's page asks for it.
    """
    return "/w-" + secrets.token_hex(WEB_PREFIX_BYTES)


def strip_web_prefix(path: str, prefix: str) -> str | None:
    """``path`` without the web page's ``prefix`` (``/`` for the prefix itself), or None when
    it does not start with it."""
    if not prefix or not path.startswith(prefix):
        return None
    rest = path[len(prefix) :]
    if not rest:
        return "/"
    return rest if rest.startswith("/") else None


def token_cookie_name(headers: Any) -> str:
    """The token cookie's name for the port the browser used, so that servers on other ports of
    the same host neither receive nor overwrite it (cookies ignore ports)."""
    _, port = split_host(headers.get("Host", ""))
    return TOKEN_COOKIE_PREFIX + (port if port.isdigit() else "80")


def redact_target(path: str, query: bytes | str, token: str = "") -> str:
    """The request target for a log line, with every ``token`` parameter's value (matched after
    URL-decoding, so ``%74oken`` counts) and any occurrence of the server's token replaced."""
    if isinstance(query, bytes):
        query = query.decode("latin-1")
    if not query:
        return path
    pairs = parse_qsl(query, keep_blank_values=True)
    clean = [
        (key, "[redacted]" if key.lower() == "token" or (token and token in value) else value)
        for key, value in pairs
    ]
    text = path + "?" + urlencode(clean, safe="[]")
    if token:
        text = text.replace(token, "[redacted]").replace(quote(token, safe=""), "[redacted]")
    return text


def response_headers(exc: CrushError) -> dict[str, str]:
    """The extra headers of an error answer: ``Location`` for a workspace another node owns
    (:class:`~crush_trio.errors.Moved`), ``Retry-After`` for an owner that stopped renewing
    (:class:`~crush_trio.errors.OwnerUnavailable`)."""
    if isinstance(exc, Moved):
        return {"Location": exc.location}
    if isinstance(exc, OwnerUnavailable):
        return {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
    return {}


def request_target(path: str, query: bytes) -> str:
    """A request's target as ASCII for a ``Location`` header: the (decoded) path percent-encoded
    again, and the raw query's bytes outside the URL alphabet percent-encoded, so neither a
    non-ASCII character nor a CR or LF the client escaped can reach the header."""
    target = quote(path, safe=_PATH_SAFE)
    if query:
        target += "?" + quote(query, safe=_QUERY_SAFE)
    return target
