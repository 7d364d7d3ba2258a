"""The providers' HTTP/1.1 transport: an ``httpx`` transport of our own, with its own pool.

A model request is one ``POST`` of a JSON body answered by a streamed body, on a kept-alive
connection. ``httpx``'s default transport sends it through ``httpcore``'s connection pool and
``h11``: about 0.45 ms of CPU per request on this project's machines (a request written and its
head read in 0.06 ms by hand, ``python -m bench.provider_request``), paid by every run's start
while a burst of runs waits for the event loop. :class:`Http11Transport` implements ``httpx``'s
public transport interface (:class:`httpx.AsyncBaseTransport`) itself, for ``http://`` and
``https://`` URLs and HTTP/1.1 only (what providers speak to a client that does not offer
HTTP/2):

* **the pool**: idle connections per origin, newest first, kept for ``keepalive_expiry``
  seconds; at most ``max_connections`` open at once, a request beyond waits for one to be
  handed back or closed (an idle connection of another origin is closed to make room). An idle
  connection the server closed (its socket is readable while idle) is dropped, not reused.
* **a request**: the request line and headers written with the body in one ``send_all``
  (header names and values checked: a CR, LF or NUL in one is an error, never a second
  header); the response head read up to :data:`MAX_HEAD_BYTES` and parsed (informational
  ``1xx`` heads skipped, at most :data:`MAX_INFORMATIONAL`).
* **the body**: framed by ``transfer-encoding: chunked``, ``content-length`` or the connection's
  end (:mod:`crush_trio.providers.body`'s decoders). :class:`Http11Body` is the response's
  ``httpx`` stream (error bodies and compressed bodies are read through it);
  :func:`crush_trio.providers.body.take_over` reads a streamed body from its connection
  directly. A connection goes back to the pool only when its body was read whole, nothing
  followed it and neither side asked to close; anything else closes it.

Errors are ``httpx``'s public exceptions, as its own transport raises them
(:class:`httpx.ConnectError`, :class:`httpx.ConnectTimeout`, :class:`httpx.ReadError`,
:class:`httpx.WriteError`, :class:`httpx.ReadTimeout`, :class:`httpx.RemoteProtocolError`,
:class:`httpx.LocalProtocolError`, :class:`httpx.UnsupportedProtocol`), so the provider's error
mapping (:class:`crush_trio.providers.http.HttpStreamer`) is the same for any transport.
Timeouts come from the request's ``timeout`` extension: ``connect`` bounds the TCP connect and
the TLS handshake, ``read`` each read of the head (and of a body read through
:class:`Http11Body`); writes and the wait for a free connection are bounded by the caller's
scope (the provider's first-byte timeout).

Cancellation: a request cancelled before its head was read closes its connection (it may be
half-written); closing a response whose body was not read whole closes its connection.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import select
from typing import TYPE_CHECKING, Final

import httpx
import trio

from .body import (
    READ_PACER,
    READ_SIZE,
    BodyError,
    BodyTimeout,
    ChunkedDecoder,
    Decoder,
    IncompleteBody,
    LengthDecoder,
    SocketBody,
)

if TYPE_CHECKING:
    import ssl
    from collections.abc import AsyncIterator, Iterable

#: Largest response head (status line and header fields) accepted, in bytes; a longer one is a
#: protocol error and closes the connection.
MAX_HEAD_BYTES: Final = 64 * 1024
#: Most informational (``1xx``) heads skipped before the final one.
MAX_INFORMATIONAL: Final = 8
#: A request body up to this size (bytes) goes out in one send with its head; a larger one is
#: sent after it, not copied into one buffer.
ONE_SEND_BYTES: Final = 64 * 1024

_TOKEN: Final = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_STATUS: Final = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: ([^\r\n]*))?")
_BAD_VALUE: Final = re.compile(rb"[\r\n\x00]")
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}


def _timeout(request: httpx.Request, name: str) -> float | None:
    value = request.extensions.get("timeout", {}).get(name)
    return None if value is None else float(value)


def request_head(request: httpx.Request) -> bytes:
    """The request line and header fields of ``request``, ending with the empty line.

    Raises:
        httpx.LocalProtocolError: a method, header name or value that would break the framing.
    """
    method = request.method.encode("ascii")
    if _TOKEN.fullmatch(method) is None:
        raise httpx.LocalProtocolError(f"invalid HTTP method {request.method!r}")
    target = request.url.raw_path or b"/"
    if _BAD_VALUE.search(target) or b" " in target:
        raise httpx.LocalProtocolError(f"invalid request target {target[:100]!r}")
    lines = [method + b" " + target + b" HTTP/1.1"]
    for name, value in request.headers.raw:
        if _TOKEN.fullmatch(name) is None:
            raise httpx.LocalProtocolError(f"invalid header name {name[:100]!r}")
        if _BAD_VALUE.search(value):
            raise httpx.LocalProtocolError(
                f"header {name.decode('ascii')!r} has a CR, LF or NUL in its value"
            )
        lines.append(name + b": " + value)
    lines.append(b"\r\n")
    return b"\r\n".join(lines)


class ResponseHead:
    """A parsed response head: status, reason, version, header fields (names lower-cased)."""

    __slots__ = ("headers", "minor", "reason", "status")

    def __init__(
        self, minor: int, status: int, reason: bytes, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self.minor = minor
        self.status = status
        self.reason = reason
        self.headers = headers

    def values(self, name: bytes) -> list[bytes]:
        return [value for key, value in self.headers if key == name]


def parse_head(data: bytes) -> ResponseHead:
    """Parse a response head (without its final empty line).

    Raises:
        httpx.RemoteProtocolError: a malformed status line or header field.
    """
    lines = data.split(b"\r\n")
    match = _STATUS.fullmatch(lines[0])
    if match is None:
        raise httpx.RemoteProtocolError(f"malformed status line {lines[0][:100]!r}")
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or _TOKEN.fullmatch(name) is None:
            raise httpx.RemoteProtocolError(f"malformed header line {line[:100]!r}")
        value = value.strip(b" \t")
        if _BAD_VALUE.search(value):
            raise httpx.RemoteProtocolError(f"malformed header line {line[:100]!r}")
        headers.append((name.lower(), value))
    return ResponseHead(int(match[1]), int(match[2]), match[3] or b"", headers)


def body_framing(head: ResponseHead) -> tuple[Decoder, bool]:
    """The decoder of a response body after ``head`` (the answer to a ``POST``), and whether
    the connection may carry another request after it.

    Raises:
        httpx.RemoteProtocolError: a ``content-length`` that is not one number.
    """
    tokens = b",".join(head.values(b"connection")).lower()
    keep = head.minor == 1 and b"close" not in tokens
    if head.status in (204, 304):
        return LengthDecoder(0), keep
    codings = [
        c.strip(b" \t").lower() for c in b",".join(head.values(b"transfer-encoding")).split(b",")
    ]
    codings = [c for c in codings if c]
    if codings:
        # chunked last frames the body; anything else runs to the connection's end. A length
        # beside a transfer coding is ignored, and the connection is not reused (RFC 9112 6.3).
        if codings[-1] == b"chunked":
            return ChunkedDecoder(), keep and not head.values(b"content-length")
        return LengthDecoder(None), False
    lengths = {
        v.strip(b" \t") for value in head.values(b"content-length") for v in value.split(b",")
    }
    if not lengths:
        return LengthDecoder(None), False
    if len(lengths) != 1 or not next(iter(lengths)).isdigit():
        raise httpx.RemoteProtocolError(
            f"malformed content-length {b', '.join(sorted(lengths))[:100]!r}"
        )
    return LengthDecoder(int(next(iter(lengths)))), keep


class Connection:
    """One HTTP/1.1 connection of the pool: a Trio stream, and its socket for the fast reads."""

    __slots__ = ("fd", "idle_since", "origin", "stream")

    def __init__(self, origin: tuple[str, str, int], stream: trio.abc.Stream, fd: int) -> None:
        self.origin = origin
        self.stream = stream
        #: The TCP socket's descriptor: read directly when the connection is plain (-1: TLS).
        self.fd = fd
        self.idle_since = 0.0

    async def write(self, data: bytes) -> None:
        """Send ``data``: straight to the socket when the connection is plain (no task switch
        when its send buffer takes it all, as a request usually fits), the rest as the stream
        takes it."""
        if self.fd < 0:
            await self.stream.send_all(data)
            return
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            sent = os.write(self.fd, data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            await self.stream.send_all(memoryview(data)[sent:])

    async def read(self, *, paced: bool = True) -> bytes:
        """Up to :data:`~crush_trio.providers.body.READ_SIZE` bytes (``b""``: the peer closed).
        ``paced``: the read waits for the consumer's pacer first, if one is set
        (:data:`~crush_trio.providers.body.READ_PACER`); a response head is read at once.

        Raises:
            IncompleteBody: the connection broke.
        """
        pacer = READ_PACER.get() if paced else None
        try:
            if self.fd < 0:
                if pacer is not None and await pacer.before_read() and not self._tls_ready():
                    pacer.read_empty()
                return bytes(await self.stream.receive_some(READ_SIZE))
            if pacer is not None and await pacer.before_read(self.read_now):
                taken = pacer.taken()  # what a pass read and did not take in itself
                if isinstance(taken, bytes):
                    return taken
                if taken is not None:
                    raise taken
                try:
                    return os.read(self.fd, READ_SIZE)
                except BlockingIOError:
                    pacer.read_empty()
            while True:
                # Wait, then read: a paced token is never there yet when the reader comes back.
                await trio.lowlevel.wait_readable(self.fd)
                try:
                    return os.read(self.fd, READ_SIZE)
                except BlockingIOError:
                    continue
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise IncompleteBody(f"the connection broke: {_describe(exc)}") from exc

    def read_now(self) -> bytes:
        """Read the plain socket without waiting (:class:`BlockingIOError`: nothing there)."""
        return os.read(self.fd, READ_SIZE)

    def _tls_ready(self) -> bool:
        """Whether a TLS read would find data at once (decrypted bytes held, or the socket
        readable)."""
        pending = getattr(self.stream, "pending", None)
        return bool(pending is not None and pending()) or self._readable()

    def stale(self) -> bool:
        """Whether the idle connection was closed or written to by the server (readable)."""
        return self._readable()

    def _readable(self) -> bool:
        try:
            poller = select.poll()
            poller.register(self._socket_fd(), select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True

    def _socket_fd(self) -> int:
        if self.fd >= 0:
            return self.fd
        transport = getattr(self.stream, "transport_stream", None)
        if isinstance(transport, trio.SocketStream):
            return transport.socket.fileno()
        return -1

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)


class Http11Body(httpx.AsyncByteStream):
    """The body of one response on its connection (``response.stream``).

    Iterating it gives the decoded body (each read bounded by the request's read timeout);
    :func:`crush_trio.providers.body.take_over` may read it instead, from :attr:`connection`,
    and calls :meth:`mark_finished` when it read it whole. Closing it hands the connection back
    to the pool when the body was read whole, else closes the connection.
    """

    def __init__(
        self,
        pool: Http11Transport,
        connection: Connection,
        decoder: Decoder,
        first: bytes,
        *,
        reusable: bool,
        read_timeout: float | None,
    ) -> None:
        self._pool = pool
        self.connection: Connection | None = connection
        self.decoder = decoder
        self.first = first
        self.reusable = reusable
        self._read_timeout = read_timeout
        #: Whether anything read the body (this iterator, or the reader that took it over).
        self.started = False
        self._finished = False

    def mark_finished(self) -> None:
        """The body was read whole and nothing followed it: :meth:`aclose` keeps the
        connection."""
        self._finished = True

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.started:
            raise httpx.StreamConsumed()
        connection = self.connection
        if connection is None:
            raise httpx.StreamClosed()
        self.started = True
        # The body reader of take_over, with a cancel scope per read and httpx's errors.
        body = SocketBody(
            connection.read,
            self.decoder,
            self.first,
            timeout=self._read_timeout,
            connection=self,
            reusable=self.reusable,
        )
        self.first = b""
        try:
            async for payload in body:
                yield payload
            await body.aclose()  # marks this stream finished when the body was read whole
        except BodyTimeout as exc:
            raise httpx.ReadTimeout(str(exc)) from exc
        except (IncompleteBody, BodyError) as exc:
            raise httpx.RemoteProtocolError(str(exc)) from exc

    async def aclose(self) -> None:
        connection, self.connection = self.connection, None
        if connection is None:
            return
        if self._finished and self.reusable:
            self._pool.release(connection)
        else:
            await self._pool.discard(connection)


class Http11Transport(httpx.AsyncBaseTransport):
    """See the module docstring.

    Args:
        ssl_context: the TLS context of ``https://`` connections.
        max_connections: most connections open at once (all origins).
        keepalive_expiry: how long an idle connection is kept (seconds).
    """

    def __init__(
        self, *, ssl_context: ssl.SSLContext, max_connections: int, keepalive_expiry: float
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")
        # HTTP/1.1 is all this transport speaks; say so in the handshake (as httpx does).
        ssl_context.set_alpn_protocols(["http/1.1"])
        self._ssl = ssl_context
        self.max_connections = max_connections
        self.keepalive_expiry = keepalive_expiry
        self._idle: dict[tuple[str, str, int], collections.deque[Connection]] = {}
        #: Connections open (idle, in use or being opened).
        self.open_connections = 0
        self._freed = trio.lowlevel.ParkingLot()
        self._closed = False

    @property
    def idle_connections(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        scheme = url.scheme
        if scheme not in _DEFAULT_PORTS:
            raise httpx.UnsupportedProtocol(
                f"the URL's scheme must be http or https, not {scheme!r}"
            )
        if not url.host:
            raise httpx.UnsupportedProtocol(f"the URL {str(url)[:200]!r} has no host")
        if self._closed:
            raise httpx.ConnectError("the provider's transport is closed")
        head = request_head(request)
        body = request.content  # a provider's request is always built from bytes
        origin = (scheme, url.host, url.port or _DEFAULT_PORTS[scheme])
        connection = await self._checkout(origin, request)
        try:
            try:
                if len(body) <= ONE_SEND_BYTES:
                    await connection.write(head + body)
                else:
                    await connection.write(head)
                    await connection.write(body)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise httpx.WriteError(f"writing the request failed: {_describe(exc)}") from exc
            parsed, first = await self._read_head(connection, _timeout(request, "read"))
            decoder, reusable = body_framing(parsed)
        except BaseException:
            await self.discard(connection)
            raise
        if b"close" in request.headers.get("connection", "").lower().encode():
            reusable = False
        stream = Http11Body(
            self,
            connection,
            decoder,
            first,
            reusable=reusable,
            read_timeout=_timeout(request, "read"),
        )
        return httpx.Response(
            parsed.status,
            headers=parsed.headers,
            stream=stream,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": parsed.reason},
        )

    async def _read_head(
        self, connection: Connection, read_timeout: float | None
    ) -> tuple[ResponseHead, bytes]:
        """The final response head and the bytes that followed it."""
        buffer = b""
        informational = 0
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                # Up to three bytes of the empty line may be there already.
                if len(buffer) > MAX_HEAD_BYTES + 3:
                    raise httpx.RemoteProtocolError(
                        f"the response head is longer than MAX_HEAD_BYTES={MAX_HEAD_BYTES}"
                    )
                with trio.move_on_after(
                    read_timeout if read_timeout is not None else float("inf")
                ) as scope:
                    try:
                        data = await connection.read(paced=False)
                    except IncompleteBody as exc:
                        raise httpx.ReadError(str(exc)) from exc
                if scope.cancelled_caught:
                    raise httpx.ReadTimeout("no response head within the read timeout")
                if not data:
                    raise httpx.RemoteProtocolError(
                        "the server closed the connection without sending a complete response"
                        if buffer
                        else "Server disconnected without sending a response."
                    )
                buffer += data
                continue
            if end > MAX_HEAD_BYTES:
                raise httpx.RemoteProtocolError(
                    f"the response head is longer than MAX_HEAD_BYTES={MAX_HEAD_BYTES}"
                )
            head = parse_head(buffer[:end])
            buffer = buffer[end + 4 :]
            if head.status >= 200:
                return head, buffer
            if head.status < 100:
                raise httpx.RemoteProtocolError(
                    f"malformed status line: status {head.status} is below 100"
                )
            if head.status == 101:
                raise httpx.RemoteProtocolError("the server switched protocols (101)")
            informational += 1
            if informational > MAX_INFORMATIONAL:
                raise httpx.RemoteProtocolError(
                    f"more than MAX_INFORMATIONAL={MAX_INFORMATIONAL} informational responses"
                )

    async def _checkout(self, origin: tuple[str, str, int], request: httpx.Request) -> Connection:
        """An idle connection to ``origin`` that is still good, or a new one."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            idle = self._idle.get(origin)
            now = trio.current_time()
            while idle:
                connection = idle.pop()
                if now - connection.idle_since < self.keepalive_expiry and not connection.stale():
                    return connection  # no checkpoint since the pop: a cancel cannot lose it
                await self.discard(connection)
            if self._closed:
                raise httpx.ConnectError("the provider's transport is closed")
            if self.open_connections < self.max_connections:
                break
            if not await self._close_oldest_idle():
                await self._freed.park()
        self.open_connections += 1
        try:
            return await self._connect(origin, request)
        except BaseException:
            self.open_connections -= 1
            self._freed.unpark()
            raise

    async def _close_oldest_idle(self) -> bool:
        oldest: Connection | None = None
        for idle in self._idle.values():
            if idle and (oldest is None or idle[0].idle_since < oldest.idle_since):
                oldest = idle[0]
        if oldest is None:
            return False
        self._idle[oldest.origin].popleft()
        await self.discard(oldest)
        return True

    async def _connect(self, origin: tuple[str, str, int], request: httpx.Request) -> Connection:
        scheme, host, port = origin
        limit = _timeout(request, "connect")
        with trio.move_on_after(limit if limit is not None else float("inf")) as scope:
            try:
                tcp = await trio.open_tcp_stream(host, port)
            except OSError as exc:
                raise httpx.ConnectError(_describe(exc)) from exc
            if scheme == "http":
                return Connection(origin, tcp, tcp.socket.fileno())
            tls = trio.SSLStream(tcp, self._ssl, server_hostname=host, https_compatible=True)
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError as exc:
                await trio.aclose_forcefully(tcp)
                cause = exc.__cause__ if exc.__cause__ is not None else exc
                raise httpx.ConnectError(_describe(cause)) from exc
            except BaseException:
                await trio.aclose_forcefully(tcp)
                raise
            return Connection(origin, tls, -1)
        assert scope.cancelled_caught
        raise httpx.ConnectTimeout(f"connecting to {host}:{port} took longer than {limit:g}s")

    def release(self, connection: Connection) -> None:
        """Keep ``connection`` (its exchange complete) for the next request to its origin."""
        if self._closed:
            self.open_connections -= 1
            self._freed.unpark()
            with contextlib.suppress(OSError):
                _close_now(connection)
            return
        connection.idle_since = trio.current_time()
        self._idle.setdefault(connection.origin, collections.deque()).append(connection)
        self._freed.unpark()

    async def discard(self, connection: Connection) -> None:
        """Close ``connection`` (not reusable) and free its place."""
        self.open_connections -= 1
        self._freed.unpark()
        await connection.aclose()

    async def aclose(self) -> None:
        """Close the idle connections; connections in use close when their responses do."""
        self._closed = True
        idle: Iterable[Connection] = [c for q in self._idle.values() for c in q]
        self._idle.clear()
        for connection in idle:
            await self.discard(connection)
        self._freed.unpark_all()


def take_over(response: httpx.Response, *, timeout: float | None) -> SocketBody | None:
    """Read ``response``'s body with :class:`SocketBody`, or None where the fast path does not
    apply (then read it through ``httpx``): a response of
    :class:`Http11Transport` whose body nothing read yet and
    which is not compressed. Call it right after the headers arrived."""
    stream = response.stream
    if not isinstance(stream, Http11Body) or stream.started or stream.connection is None:
        return None
    if response.headers.get("content-encoding", "identity").lower() not in ("", "identity"):
        return None
    stream.started = True
    connection = stream.connection
    return SocketBody(
        connection.read,
        stream.decoder,
        stream.first,
        fd=connection.fd if connection.fd >= 0 else None,
        timeout=timeout,
        connection=stream,
        reusable=stream.reusable,
    )


def _close_now(connection: Connection) -> None:
    transport = getattr(connection.stream, "transport_stream", connection.stream)
    if isinstance(transport, trio.SocketStream):
        transport.socket.close()


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
