"""The ``fetch`` tool: GET a URL and return its text, HTML converted to Markdown.

Security (docs/tools.md, "fetch"):

* it always asks (action ``fetch``, scope the URL) unless ``permissions.allowed_tools`` names it;
  a redirect to another origin asks again, so a request goes out only where the user allowed;
* only ``http`` and ``https`` URLs, and only public addresses: loopback, link-local (the cloud
  metadata service at 169.254.169.254), private, shared, multicast, reserved and unspecified
  addresses, and this machine's own addresses, are refused unless ``options.fetch.allow_private``
  lists a network that holds them;
* the check runs on every redirect hop and on the address actually connected: the host name is
  resolved once per connection by :class:`GuardedBackend` (an ``httpcore`` network backend, its
  public seam), every address it resolves to is checked, and the connection goes to one of those
  very addresses. TLS still verifies the certificate against, and sends SNI for, the URL's host
  name, and the ``Host`` header is the URL's. No later lookup can move the request elsewhere (no
  DNS rebinding), and no proxy from the environment is used;
* bounds: the body read (``options.fetch.max_bytes``, after gzip/deflate decoding, which is
  itself bounded per step), the whole fetch's time (``options.fetch.timeout``), redirects
  followed (``options.fetch.max_redirects``), and the text returned
  (:data:`FETCH_MAX_RESULT_CHARS`).
  The body is streamed: at most ``max_bytes`` plus one chunk is held, whatever the server sends.

HTML is converted by ``html-to-markdown`` (a Rust converter) in a worker thread.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
import zlib
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, Final

import attrs
import html_to_markdown
import httpcore
import httpx
import trio

from .. import __version__
from ..defaults import BINARY_SNIFF_BYTES
from .base import (
    ToolBase,
    ToolContext,
    ToolError,
    ToolResult,
    ToolSpec,
    ask_permission,
    run_blocking,
)

if TYPE_CHECKING:
    from ..config import FetchOptions

__all__ = [
    "FETCH_FORMATS",
    "FETCH_MAX_RESULT_CHARS",
    "AddressPolicy",
    "FetchRefused",
    "FetchTool",
    "GuardedBackend",
    "Resolver",
    "system_resolver",
]

#: ``fetch``: most characters of text returned to the model (the rest is cut, with a note).
FETCH_MAX_RESULT_CHARS: Final = 100_000
#: ``fetch``: deepest HTML nesting converted (deeper elements are flattened by the converter).
FETCH_MAX_HTML_DEPTH: Final = 512
#: ``fetch``: most bytes one step of gzip/deflate decoding may produce (bounds a compression bomb).
DECODE_STEP_BYTES: Final = 256 * 1024

FETCH_FORMATS: Final = ("markdown", "text", "html")
_REDIRECTS: Final = frozenset({301, 302, 303, 307, 308})
_HTML_TYPES: Final = frozenset({"text/html", "application/xhtml+xml"})
_TEXT_TYPES: Final = frozenset(
    {
        "application/json",
        "application/xml",
        "application/javascript",
        "application/x-javascript",
        "application/ecmascript",
        "application/x-yaml",
        "application/yaml",
        "application/toml",
        "application/x-sh",
        "application/sql",
        "application/graphql",
    }
)

#: Resolves a host name to its addresses, in order (the default: :func:`system_resolver`).
Resolver = Callable[[str, int], Awaitable[list[str]]]


class FetchRefused(Exception):
    """A request fetch does not make (an address or scheme it refuses); the message says why."""


async def system_resolver(host: str, port: int) -> list[str]:
    """The addresses of ``host`` from the system resolver, in its order, without duplicates."""
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise FetchRefused(f"cannot resolve host {host!r}: {exc.strerror or exc}") from None
    seen: list[str] = []
    for info in infos:
        address = str(info[4][0])
        if address not in seen:
            seen.append(address)
    return seen


def _is_own_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``ip`` belongs to this machine: binding a socket to it succeeds only then."""
    family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(ip), 0))
    except OSError:
        return False
    return True


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, NAT64), which is where it leads."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


_NAT64: Final = ipaddress.IPv6Network("64:ff9b::/96")


@attrs.define
class AddressPolicy:
    """Which addresses ``fetch`` may connect to (pure, but for the own-address probe).

    Attributes:
        allowed: networks reachable although not public (``options.fetch.allow_private``).
        is_own: whether an address is this machine's (a bind probe by default).
    """

    allowed: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    is_own: Callable[[ipaddress.IPv4Address | ipaddress.IPv6Address], bool] = _is_own_address

    @classmethod
    def from_options(cls, options: FetchOptions) -> AddressPolicy:
        networks = []
        for entry in options.allow_private:
            try:
                networks.append(ipaddress.ip_network(entry.strip(), strict=False))
            except ValueError:
                continue  # reported at config load (config.py checks the entries)
        return cls(tuple(networks))

    def refusal(self, address: str) -> str | None:
        """Why ``address`` may not be reached (what kind of address it is), or None."""
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return "not an IP address"
        if isinstance(ip, ipaddress.IPv6Address) and (v4 := _embedded_v4(ip)) is not None:
            if any(ip in net for net in self.allowed):
                return None
            ip = v4
        if any(ip in net for net in self.allowed):
            return None
        if ip.is_unspecified:
            return "the unspecified address (it reaches this machine)"
        if ip.is_loopback:
            return "a loopback address (this machine)"
        if ip.is_link_local:
            return "a link-local address (such as the cloud metadata service)"
        if ip.is_multicast:
            return "a multicast address"
        if ip.is_reserved:
            return "a reserved address"
        if not ip.is_global:
            return "a private address"
        if self.is_own(ip):
            return "an address of this machine"
        return None


@attrs.define
class GuardedBackend(httpcore.AsyncNetworkBackend):
    """An ``httpcore`` network backend that resolves each host once, checks every address it
    resolves to, and connects to one of those checked addresses (never looking the name up again).

    ``connected`` records the address of the last connection made (for tests and messages).
    """

    policy: AddressPolicy
    resolve: Resolver = system_resolver
    inner: httpcore.AsyncNetworkBackend = attrs.field(factory=httpcore.TrioBackend)
    connected: str | None = None

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        addresses = await self.resolve(host, port)
        if not addresses:
            raise FetchRefused(f"host {host!r} resolves to no address")
        for address in addresses:
            why = self.policy.refusal(address)
            if why is not None:
                where = address if host == address else f"{host} resolves to {address}, which"
                raise FetchRefused(f"{where} is {why}")
        error: Exception | None = None
        for address in addresses:
            try:
                stream = await self.inner.connect_tcp(
                    address, port, timeout=timeout, socket_options=socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
                continue
            self.connected = address
            return stream
        assert error is not None
        raise error

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise FetchRefused("fetch does not connect to Unix sockets")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


# ---------------------------------------------------------------------------------------------
# The body: bounded reading and decoding


class _Decoder:
    """gzip/deflate decoding in bounded steps (a small body may inflate to gigabytes)."""

    def __init__(self, encoding: str) -> None:
        self.identity = encoding in ("", "identity")
        if encoding == "gzip" or encoding == "x-gzip":
            self._z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            self._z = zlib.decompressobj()
        elif not self.identity:
            raise ToolError(
                f"the server sent the body with content-encoding {encoding!r}, which fetch "
                "cannot decode (it asks for gzip or deflate)"
            )

    def feed(self, data: bytes) -> Iterable[bytes]:
        if self.identity:
            yield data
            return
        try:
            while data:
                out = self._z.decompress(data, DECODE_STEP_BYTES)
                data = self._z.unconsumed_tail
                if out:
                    yield out
                if self._z.eof:
                    return
        except zlib.error as exc:
            raise ToolError(f"the server sent a damaged compressed body: {exc}") from None


@attrs.frozen
class _Fetched:
    url: str
    status: int
    content_type: str
    charset: str | None
    body: bytes
    truncated: bool


def _media_type(value: str) -> tuple[str, str | None]:
    """``text/html; charset=UTF-8`` → ``("text/html", "UTF-8")``."""
    kind, _, rest = value.partition(";")
    charset = None
    for param in rest.split(";"):
        name, _, val = param.partition("=")
        if name.strip().lower() == "charset" and val.strip():
            charset = val.strip().strip('"').strip("'")
    return kind.strip().lower(), charset


def _is_text(media: str, body: bytes) -> bool:
    if media.startswith("text/") or media in _TEXT_TYPES:
        return True
    if media.endswith(("+json", "+xml")):
        return True
    return media in ("", "application/octet-stream") and b"\0" not in body[:BINARY_SNIFF_BYTES]


def _decode(body: bytes, charset: str | None) -> str:
    try:
        return body.decode(charset or "utf-8", errors="replace")
    except LookupError:  # an unknown charset name
        return body.decode("utf-8", errors="replace")


def _convert(html: str, fmt: str) -> str:
    """HTML → Markdown or plain text (blocking, CPU-bound: called in a worker thread)."""
    options = html_to_markdown.ConversionOptions(
        output_format="plain" if fmt == "text" else "markdown",
        extract_metadata=False,
        max_depth=FETCH_MAX_HTML_DEPTH,
    )
    result = html_to_markdown.convert(html, options)
    return result.content or ""


def _origin(url: httpx.URL) -> tuple[str, str, int | None]:
    return (url.scheme, url.host, url.port)


def _check_url(raw: str | httpx.URL, policy: AddressPolicy) -> httpx.URL:
    """Parse a URL and refuse what no request may go to (before any network use)."""
    try:
        url = raw if isinstance(raw, httpx.URL) else httpx.URL(raw)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ToolError(f"invalid URL {raw!r}: {exc}; give an absolute http(s) URL") from None
    if url.scheme not in ("http", "https"):
        scheme = url.scheme or "(none)"
        raise ToolError(
            f"fetch refused: {str(raw)!r} has scheme {scheme}; fetch reads http and https URLs only"
        )
    if not url.host:
        raise ToolError(f"invalid URL {str(raw)!r}: it has no host; give an absolute http(s) URL")
    if url.userinfo:
        raise ToolError(
            f"fetch refused: {str(raw)!r} carries a user name or password; fetch sends no "
            "credentials"
        )
    host = url.host
    literal = True
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        literal = False
    if host == "localhost" or host.endswith(".localhost"):
        host, literal = "127.0.0.1", True
    if literal:
        why = policy.refusal(host)
        if why is not None:
            raise ToolError(_refused_message(str(url), f"{url.host} is {why}"))
    return url


def _refused_message(url: str, why: str) -> str:
    return (
        f"fetch refused: {url}: {why}. fetch reaches public addresses only; to reach a private "
        "network, the user can list it in options.fetch.allow_private in their config"
    )


# ---------------------------------------------------------------------------------------------
# The tool


@attrs.define
class FetchTool(ToolBase):
    """``fetch``: GET a URL, return its text (HTML as Markdown, plain text or HTML).

    Attributes:
        resolver: how host names are resolved (tests map names to test servers).
        ssl_context: TLS settings (default: the system's trust store, verifying).
    """

    resolver: Resolver = system_resolver
    ssl_context: ssl.SSLContext | None = None

    #: Offered to sub-agents (``agent``): it only reads, and asks under its usual rule.
    read_only = True
    spec = ToolSpec(
        name="fetch",
        description=(
            "Fetch a URL with an HTTP GET and return its content as text. HTML is converted to "
            "Markdown by default ('format': 'markdown'), or to plain text ('text'), or returned "
            "as HTML ('html'); other text (JSON, plain text, source) comes back as it is; binary "
            "content is refused. Only http and https URLs on public addresses; redirects are "
            "followed up to a limit. Large pages are cut (the result says so). Asks the user "
            "for permission to fetch the URL."
        ),
        parameters={
            "type": "object",
            "properties": {
                "url": {"type": "string", "description": "The http or https URL to fetch."},
                "format": {
                    "type": "string",
                    "enum": list(FETCH_FORMATS),
                    "description": "markdown (default), text or html: how HTML is returned.",
                },
            },
            "required": ["url"],
        },
    )

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        fmt = params.get("format") or "markdown"
        if fmt not in FETCH_FORMATS:
            raise ToolError(
                f"parameter 'format' of tool fetch must be one of {', '.join(FETCH_FORMATS)}, "
                f"got {fmt!r}"
            )
        policy = AddressPolicy.from_options(ctx.fetch)
        url = _check_url(str(params["url"]).strip(), policy)
        await self._ask(ctx, url, fmt, None)
        fetched = await self._fetch(ctx, url, fmt, policy)
        return await self._result(ctx, fetched, fmt)

    async def _ask(self, ctx: ToolContext, url: httpx.URL, fmt: str, came_from: str | None) -> None:
        note = f" (redirected from {came_from})" if came_from else ""
        await ask_permission(
            ctx,
            tool_name="fetch",
            action="fetch",
            description=f"Fetch {url}{note}",
            params={"url": str(url), "format": fmt},
            path=str(url),
        )

    async def _fetch(
        self, ctx: ToolContext, url: httpx.URL, fmt: str, policy: AddressPolicy
    ) -> _Fetched:
        """Follow the redirects of ``url`` and read the final body.

        The time limit covers the network work of every hop together; waiting for the answer to
        a redirect's permission request does not count (as for every tool).
        """
        options = ctx.fetch
        limit = min(options.timeout, ctx.timeout)
        remaining = limit
        backend = GuardedBackend(policy, self.resolver)
        async with httpcore.AsyncConnectionPool(
            ssl_context=self.ssl_context or httpcore.default_ssl_context(),
            network_backend=backend,
            max_connections=1,
            retries=0,
        ) as pool:
            for hop in range(options.max_redirects + 1):
                started = trio.current_time()
                outcome: _Fetched | httpx.URL | None = None
                with trio.move_on_after(remaining):
                    outcome = await self._hop(pool, url, policy, options.max_bytes, remaining)
                remaining -= trio.current_time() - started
                if outcome is None:
                    raise ToolError(
                        f"fetch of {url} timed out after {limit:g} s (options.fetch.timeout) "
                        "and was stopped"
                    )
                if isinstance(outcome, _Fetched):
                    return outcome
                if hop == options.max_redirects:
                    break
                if _origin(outcome) != _origin(url):
                    await self._ask(ctx, outcome, fmt, str(url))
                url = outcome
        raise ToolError(
            f"fetch of {url} stopped: more than {options.max_redirects} redirects "
            "(options.fetch.max_redirects)"
        )

    async def _hop(
        self,
        pool: httpcore.AsyncConnectionPool,
        url: httpx.URL,
        policy: AddressPolicy,
        max_bytes: int,
        remaining: float,
    ) -> _Fetched | httpx.URL:
        """One request: the body read (bounded), or where a redirect leads (checked)."""
        headers = [
            (b"Host", url.netloc),
            (b"User-Agent", f"crush-trio/{__version__} (fetch tool)".encode()),
            (b"Accept", b"text/html,text/markdown;q=0.9,text/plain;q=0.8,*/*;q=0.1"),
            (b"Accept-Encoding", b"gzip, deflate"),
        ]
        phases = {"connect": remaining, "read": remaining, "write": remaining, "pool": remaining}
        try:
            async with pool.stream(
                "GET", str(url), headers=headers, extensions={"timeout": phases}
            ) as response:
                if response.status not in _REDIRECTS:
                    return await _read_body(url, response, max_bytes)
                location = _header(response.headers, b"location")
                if location is None:
                    raise ToolError(
                        f"{url} answered {response.status} without a Location header; nothing "
                        "to follow"
                    )
                return _check_url(url.join(location), policy)
        except FetchRefused as exc:
            raise ToolError(_refused_message(str(url), str(exc))) from None
        except httpcore.TimeoutException:
            raise ToolError(
                f"fetch of {url} timed out (options.fetch.timeout) and was stopped"
            ) from None
        except (httpcore.NetworkError, httpcore.ProtocolError) as exc:
            raise ToolError(
                f"fetch of {url} failed: {type(exc).__name__}: {exc or 'no detail'}"
            ) from None

    async def _result(self, ctx: ToolContext, fetched: _Fetched, fmt: str) -> ToolResult:
        if fetched.status >= 400:
            raise ToolError(
                f"fetch of {fetched.url} failed: the server answered HTTP {fetched.status}"
            )
        media, body = fetched.content_type, fetched.body
        if not _is_text(media, body):
            raise ToolError(
                f"{fetched.url} is {media or 'binary content'}, not text; fetch returns text "
                "and HTML only"
            )
        text = _decode(body, fetched.charset)
        if media in _HTML_TYPES and fmt != "html":
            text = await run_blocking(ctx, "fetch", _convert, text, fmt)
        notes = []
        if fetched.truncated:
            notes.append(
                f"(the body was cut at {ctx.fetch.max_bytes} bytes, options.fetch.max_bytes; "
                "the rest was not read)"
            )
        if len(text) > FETCH_MAX_RESULT_CHARS:
            notes.append(f"(showing the first {FETCH_MAX_RESULT_CHARS} of {len(text)} characters)")
            text = text[:FETCH_MAX_RESULT_CHARS]
        head = f"Fetched {fetched.url} ({media or 'unknown type'}, HTTP {fetched.status})"
        return ToolResult(content="\n\n".join([head, text, *notes]))


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _read_body(url: httpx.URL, response: httpcore.Response, max_bytes: int) -> _Fetched:
    """Read at most ``max_bytes`` of the decoded body; stop reading past it."""
    content_type = _header(response.headers, b"content-type") or ""
    media, charset = _media_type(content_type)
    decoder = _Decoder((_header(response.headers, b"content-encoding") or "").strip().lower())
    body = bytearray()
    truncated = False
    async for chunk in response.aiter_stream():
        for data in decoder.feed(chunk):
            room = max_bytes - len(body)
            body += data[:room]
            if len(data) > room:
                truncated = True
                break
        if truncated:
            break
    return _Fetched(str(url), response.status, media, charset, bytes(body), truncated)
