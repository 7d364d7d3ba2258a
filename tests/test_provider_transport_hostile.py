"""The providers' HTTP/1.1 transport (crush_trio/providers/transport.py) against hostile servers.

Each test drives :class:`Http11Transport` directly against a raw loopback server that writes
scripted bytes (malformed heads, endless heads, conflicting lengths, early closes, stray bytes)
and checks three things: the error is a clear ``httpx`` exception, no connection leaks (the
transport's counts, and the server seeing the client close its side), and the next good request
on the same transport works.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import struct
from typing import TYPE_CHECKING, Final

import httpx
import pytest
import trio
import trio.testing

from crush_trio.providers.pool import shared_ssl_context
from crush_trio.providers.transport import MAX_HEAD_BYTES, MAX_INFORMATIONAL, Http11Transport
from tests.test_provider_body import request_length

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

#: Bound on every wait of a test (seconds).
WAIT: Final = 10
BODY: Final = b"hello"
OK: Final = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
#: A head whose body never comes (the server then waits for the client to close).
OPEN_HEAD: Final = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"

#: A scripted reply: the pieces to send (the client reads each before the next is sent), then
#: what the server does with the connection: ``keep`` (wait for its next request), ``close``,
#: ``hang`` (read until the client closes), ``flood`` (send header lines until the client
#: closes). A ``shut`` reply is taken when a connection is accepted: the server ends its side at
#: once, before reading anything.
Reply = tuple[list[bytes], str]


def reply(*lines: bytes, body: bytes = b"") -> bytes:
    """A response: the lines (status line, header fields) each ended by CRLF, the empty line,
    ``body``."""
    return b"".join(line + b"\r\n" for line in lines) + b"\r\n" + body


class Wire:
    """A loopback server answering each request with the next :data:`Reply`."""

    def __init__(self, *replies: Reply) -> None:
        self.replies = list(replies)
        self.connections = 0
        self.requests = 0
        #: Every byte the clients sent.
        self.received = b""
        #: Replies sent whole.
        self.replied = 0
        #: Connections ended by the client (its end of stream, or a reset).
        self.client_closed = 0
        #: Connections the server closed first.
        self.server_closed = 0
        self._event = trio.Event()

    def _changed(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._event.wait()

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        self._changed()
        async with stream:
            try:
                by_client = await self._converse(stream)
            except trio.BrokenResourceError:
                by_client = True
        if by_client:
            self.client_closed += 1
        else:
            self.server_closed += 1
        self._changed()

    async def _converse(self, stream: trio.SocketStream) -> bool:
        """Whether the client ended the connection (else the server did)."""
        if self.replies and self.replies[0][1] == "shut":
            self.replies.pop(0)
            await stream.send_eof()
            await self._drain(stream)
            return True
        buffer = b""
        while True:
            request, buffer = await self._request(stream, buffer)
            if request is None:
                return True
            self.requests += 1
            self._changed()
            pieces, then = self.replies.pop(0)
            for index, piece in enumerate(pieces):
                if index:
                    await trio.testing.wait_all_tasks_blocked()
                await stream.send_all(piece)
            self.replied += 1
            self._changed()
            if then == "close":
                return False
            if then == "hang":
                await self._drain(stream)
                return True
            if then == "flood":
                lines = b"x-pad: " + b"p" * 1000 + b"\r\n"
                while True:  # until the client closes (a BrokenResourceError)
                    await stream.send_all(lines * 16)

    async def _request(
        self, stream: trio.SocketStream, buffer: bytes
    ) -> tuple[bytes | None, bytes]:
        """The next request (head and body), or None at the end of the stream."""
        while b"\r\n\r\n" not in buffer:
            more = await self._receive(stream)
            if not more:
                return None, buffer
            buffer += more
        head, _, buffer = buffer.partition(b"\r\n\r\n")
        length = request_length(head)
        while len(buffer) < length:
            more = await self._receive(stream)
            if not more:
                return None, buffer
            buffer += more
        return head + b"\r\n\r\n" + buffer[:length], buffer[length:]

    async def _receive(self, stream: trio.SocketStream) -> bytes:
        data = await stream.receive_some(65536)
        self.received += data
        return data

    async def _drain(self, stream: trio.SocketStream) -> None:
        while await self._receive(stream):
            pass


@contextlib.asynccontextmanager
async def wired(
    *replies: Reply, max_connections: int = 4, keepalive_expiry: float = 30.0
) -> AsyncIterator[tuple[Http11Transport, Wire, str]]:
    """A transport, and a :class:`Wire` serving ``replies`` at the URL given."""
    wire = Wire(*replies)
    transport = Http11Transport(
        ssl_context=shared_ssl_context(),
        max_connections=max_connections,
        keepalive_expiry=keepalive_expiry,
    )
    async with trio.open_nursery() as nursery:
        serve = functools.partial(trio.serve_tcp, host="127.0.0.1")
        listeners = await nursery.start(serve, wire.handle, 0)
        port = listeners[0].socket.getsockname()[1]
        try:
            yield transport, wire, f"http://127.0.0.1:{port}/v1/chat"
        finally:
            await transport.aclose()
            nursery.cancel_scope.cancel()


def request(url: str, headers: dict[str, str] | None = None) -> httpx.Request:
    timeouts = {"connect": 5.0, "read": 5.0, "write": None, "pool": None}
    return httpx.Request(
        "POST", url, content=b"{}", headers=headers, extensions={"timeout": timeouts}
    )


async def read_body(response: httpx.Response) -> bytes:
    """The whole body, read from the transport's stream; the response is closed after."""
    stream = response.stream
    assert isinstance(stream, httpx.AsyncByteStream)
    try:
        return b"".join([part async for part in stream])
    finally:
        await response.aclose()


async def fetch(
    transport: Http11Transport, url: str, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    response = await transport.handle_async_request(request(url, headers))
    return response.status_code, await read_body(response)


def counts(transport: Http11Transport) -> tuple[int, int]:
    """The transport's open and idle connections."""
    return transport.open_connections, transport.idle_connections


async def cancel_once_blocked(transport: Http11Transport, req: httpx.Request) -> None:
    """Send ``req`` until the sending task blocks; it has not ended then, and a cancel ends it
    (cancelled, not failed)."""
    scope = trio.CancelScope()
    outcome: list[bool] = []

    async def send() -> None:
        with scope:
            await transport.handle_async_request(req)
        outcome.append(scope.cancelled_caught)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        await trio.testing.wait_all_tasks_blocked()
        assert outcome == []
        scope.cancel()
    assert outcome == [True]


async def hostile(reply: Reply, error: type[httpx.HTTPError], fragment: str) -> Wire:
    """Sends a request answered by ``reply``: it fails with ``error`` whose message has
    ``fragment``, the connection is closed and not counted, and the next request (on a new
    connection) works."""
    with trio.fail_after(WAIT):
        async with wired(reply, ([OK], "keep")) as (transport, wire, url):
            with pytest.raises(error) as info:
                await transport.handle_async_request(request(url))
            assert fragment in str(info.value), str(info.value)
            assert counts(transport) == (0, 0)
            await wire.until(lambda: wire.client_closed + wire.server_closed == 1)
            if reply[1] != "close":
                assert wire.client_closed == 1  # the client closed it, not left it open
            assert await fetch(transport, url) == (200, BODY)
            assert counts(transport) == (1, 1)
    assert wire.connections == 2
    return wire


# -- malformed heads ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "status_line",
    [
        b"HTTP/2 200 OK",
        b"garbage",
        b"",
        b"HTTP/1.1 20 OK",
        b"HTTP/1.1 2000 OK",
        b"HTTP/1.2 200 OK",
        b"http/1.1 200 OK",
        b" HTTP/1.1 200 OK",
        b"HTTP/1.1  200 OK",
        b"HTTP/1.1 2OO OK",
        b"HTTP/1.1 000 Zero",
        b"HTTP/1.1 099 Low",
    ],
)
async def test_a_malformed_status_line_is_refused(status_line: bytes) -> None:
    # No body: a status below 200 taken as informational would be followed by the 200.
    hostile_bytes = reply(status_line) + OK
    await hostile(([hostile_bytes], "hang"), httpx.RemoteProtocolError, "malformed status line")


async def test_an_endless_head_is_cut_at_max_head_bytes() -> None:
    """The server sends header lines forever: the client stops reading past the bound and
    closes the connection (the server's writes then fail)."""
    await hostile(
        ([b"HTTP/1.1 200 OK\r\n"], "flood"),
        httpx.RemoteProtocolError,
        f"longer than MAX_HEAD_BYTES={MAX_HEAD_BYTES}",
    )


def padded_head(size: int) -> bytes:
    """A status line and header fields of exactly ``size`` bytes (without the final CRLF)."""
    start = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-pad: "
    return start + b"p" * (size - len(start))


async def test_a_complete_head_longer_than_max_head_bytes_is_refused() -> None:
    """The head ends, but past the bound (it arrives in one piece with its body)."""
    wire_bytes = padded_head(MAX_HEAD_BYTES + 1) + b"\r\n\r\n" + BODY
    await hostile(([wire_bytes], "hang"), httpx.RemoteProtocolError, "MAX_HEAD_BYTES")


@pytest.mark.parametrize(
    "split",
    [
        False,
        True,
    ],
    ids=["one-piece", "terminator-split"],
)
async def test_a_head_of_exactly_max_head_bytes_is_accepted(split: bool) -> None:
    whole = padded_head(MAX_HEAD_BYTES) + b"\r\n\r\n" + BODY
    cut = MAX_HEAD_BYTES + 2
    pieces = [whole[:cut], whole[cut:]] if split else [whole]
    with trio.fail_after(WAIT):
        async with wired((pieces, "keep")) as (transport, wire, url):
            assert await fetch(transport, url) == (200, BODY)
            assert counts(transport) == (1, 1)
    assert wire.connections == 1


@pytest.mark.parametrize(
    "fields",
    [
        [b"content-length: 5", b"content-length: 6"],
        [b"content-length: 5, 6"],
        [b"content-length: abc"],
        [b"content-length: -5"],
        [b"content-length: +5"],
        [b"content-length: "],
        [b"content-length: 0x5"],
    ],
    ids=["two-fields", "list", "letters", "negative", "plus", "empty", "hex"],
)
async def test_a_bad_content_length_is_refused(fields: list[bytes]) -> None:
    wire_bytes = reply(b"HTTP/1.1 200 OK", *fields, body=BODY)
    await hostile(([wire_bytes], "hang"), httpx.RemoteProtocolError, "malformed content-length")


async def test_repeated_equal_content_lengths_are_one_length() -> None:
    wire_bytes = reply(b"HTTP/1.1 200 OK", b"content-length: 5", b"Content-Length: 5, 5", body=BODY)
    with trio.fail_after(WAIT):
        async with wired(([wire_bytes], "keep"), ([OK], "keep")) as (transport, wire, url):
            assert await fetch(transport, url) == (200, BODY)
            assert await fetch(transport, url) == (200, BODY)
    assert wire.connections == 1


@pytest.mark.parametrize(
    "fields",
    [
        [b"no colon here"],
        [b"x-a: 1", b" folded continuation"],
        [b"x-a: 1", b"\tfolded: with a colon"],
        [b"x-a : 1"],
        [b": no name"],
        [b"x-a: 1\nx-b: 2"],
        [b"x-a: 1\x00"],
        [b"x\x01a: 1"],
    ],
    ids=["no-colon", "obs-fold", "obs-fold-tab", "space-before-colon", "no-name", "bare-lf", "nul",
         "control-in-name"],
)  # fmt: skip
async def test_a_malformed_header_line_is_refused(fields: list[bytes]) -> None:
    wire_bytes = reply(b"HTTP/1.1 200 OK", b"content-length: 5", *fields, body=BODY)
    await hostile(([wire_bytes], "hang"), httpx.RemoteProtocolError, "malformed header line")


# -- informational heads --------------------------------------------------------------------

CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
EARLY_HINTS: Final = b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n\r\n"


@pytest.mark.parametrize(
    "pieces",
    [
        [CONTINUE + EARLY_HINTS + OK],
        [CONTINUE, EARLY_HINTS, OK],
        [CONTINUE + EARLY_HINTS[:10], EARLY_HINTS[10:] + OK[:5], OK[5:]],
        [CONTINUE * (MAX_INFORMATIONAL - 1) + EARLY_HINTS + OK],
    ],
    ids=["one-piece", "head-per-piece", "cut-anywhere", "max-informational"],
)
async def test_informational_heads_are_skipped(pieces: list[bytes]) -> None:
    with trio.fail_after(WAIT):
        async with wired((pieces, "keep"), ([OK], "keep")) as (transport, wire, url):
            response = await transport.handle_async_request(request(url))
            assert response.status_code == 200
            assert "link" not in response.headers  # the final head's fields only
            assert await read_body(response) == BODY
            assert counts(transport) == (1, 1)
            assert await fetch(transport, url) == (200, BODY)
    assert wire.connections == 1


async def test_too_many_informational_heads_are_refused() -> None:
    wire_bytes = CONTINUE * (MAX_INFORMATIONAL + 1) + OK
    await hostile(
        ([wire_bytes], "hang"),
        httpx.RemoteProtocolError,
        f"more than MAX_INFORMATIONAL={MAX_INFORMATIONAL} informational responses",
    )


async def test_switching_protocols_is_refused() -> None:
    wire_bytes = b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n" + OK
    await hostile(([wire_bytes], "hang"), httpx.RemoteProtocolError, "switched protocols (101)")


# -- early closes and silence ----------------------------------------------------------------


async def test_a_server_that_closes_at_once_sent_no_response() -> None:
    await hostile(
        ([], "shut"), httpx.RemoteProtocolError, "Server disconnected without sending a response."
    )


async def test_a_server_that_closes_after_reading_the_request_sent_no_response() -> None:
    await hostile(
        ([], "close"), httpx.RemoteProtocolError, "Server disconnected without sending a response."
    )


@pytest.mark.parametrize(
    "partial",
    [b"HTTP/1.1 200 OK\r\ncontent-le", b"HTTP/1.1 200 OK\r\n", CONTINUE + b"HTTP/1.1"],
    ids=["mid-field", "after-status-line", "after-informational"],
)
async def test_a_server_that_closes_mid_head_is_an_incomplete_response(partial: bytes) -> None:
    await hostile(
        ([partial], "close"),
        httpx.RemoteProtocolError,
        "closed the connection without sending a complete response",
    )


async def test_a_silent_server_is_a_read_timeout(autojump_clock: trio.testing.MockClock) -> None:
    await hostile(([], "hang"), httpx.ReadTimeout, "no response head within the read timeout")


#: A request body larger than a loopback socket's buffers on both sides take at once.
HUGE: Final = 32 * 1024 * 1024


@contextlib.asynccontextmanager
async def unread(*, reset: bool) -> AsyncIterator[tuple[Http11Transport, str, trio.Event]]:
    """A transport, and a server that reads the start of a request and then stops reading it
    (``reset``: resets the connection instead); the event is set when a connection ends."""
    ended = trio.Event()

    async def handle(stream: trio.SocketStream) -> None:
        try:
            await stream.receive_some(65536)
            if reset:
                linger = struct.pack("ii", 1, 0)  # close with a reset, not an orderly end
                stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
                await trio.aclose_forcefully(stream)
                return
            await trio.sleep_forever()
        finally:
            ended.set()

    transport = Http11Transport(
        ssl_context=shared_ssl_context(), max_connections=1, keepalive_expiry=30.0
    )
    async with trio.open_nursery() as nursery:
        serve = functools.partial(trio.serve_tcp, host="127.0.0.1")
        listeners = await nursery.start(serve, handle, 0)
        port = listeners[0].socket.getsockname()[1]
        try:
            yield transport, f"http://127.0.0.1:{port}/v1/chat", ended
        finally:
            await transport.aclose()
            nursery.cancel_scope.cancel()


def huge_request(url: str) -> httpx.Request:
    timeouts = {"connect": 5.0, "read": 5.0, "write": None, "pool": None}
    return httpx.Request("POST", url, content=b"x" * HUGE, extensions={"timeout": timeouts})


async def test_a_request_the_server_stops_reading_waits_and_a_cancel_ends_it() -> None:
    """The socket takes part of the request at once and the rest waits for room (the
    provider's first_byte_timeout bounds it); a cancel meanwhile leaks no connection."""
    with trio.fail_after(WAIT):
        async with unread(reset=False) as (transport, url, _ended):
            # It waits for the server to read until cancelled.
            await cancel_once_blocked(transport, huge_request(url))
            assert counts(transport) == (0, 0)


async def test_a_server_that_resets_while_the_request_is_written_is_a_write_error() -> None:
    with trio.fail_after(WAIT):
        async with unread(reset=True) as (transport, url, ended):
            with pytest.raises(httpx.WriteError, match="writing the request failed"):
                await transport.handle_async_request(huge_request(url))
            assert counts(transport) == (0, 0)
            await ended.wait()


# -- request header injection ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "fragment"),
    [
        ({"x-api-key": "a\r\nevil: 1"}, "has a CR, LF or NUL in its value"),
        ({"x-api-key": "a\nevil: 1"}, "has a CR, LF or NUL in its value"),
        ({"x-api-key": "a\revil: 1"}, "has a CR, LF or NUL in its value"),
        ({"x-api-key": "a\x00evil"}, "has a CR, LF or NUL in its value"),
        ({"evil: 1\r\nx-a": "1"}, "invalid header name"),
        ({"x evil": "1"}, "invalid header name"),
        ({"": "evil"}, "invalid header name"),
    ],
)
async def test_a_header_that_would_break_the_framing_is_never_sent(
    headers: dict[str, str], fragment: str
) -> None:
    with trio.fail_after(WAIT):
        async with wired(([OK], "keep")) as (transport, wire, url):
            with pytest.raises(httpx.LocalProtocolError) as info:
                await transport.handle_async_request(request(url, headers))
            assert fragment in str(info.value)
            assert counts(transport) == (0, 0)
            assert wire.connections == 0  # refused before a connection was even taken
            assert await fetch(transport, url) == (200, BODY)
            assert counts(transport) == (1, 1)
    assert wire.requests == 1
    assert b"evil" not in wire.received.lower()


async def test_a_method_that_would_break_the_request_line_is_never_sent() -> None:
    with trio.fail_after(WAIT):
        async with wired(([OK], "keep")) as (transport, wire, url):
            bad = httpx.Request("GET / HTTP/1.1\r\nEvil: 1\r\nX", url, content=b"{}")
            with pytest.raises(httpx.LocalProtocolError, match="invalid HTTP method"):
                await transport.handle_async_request(bad)
            assert counts(transport) == (0, 0)
            assert await fetch(transport, url) == (200, BODY)
    assert wire.connections == 1
    assert b"evil" not in wire.received.lower()


# -- the pool: stale, expired and limited connections ----------------------------------------


@pytest.mark.parametrize(
    "first",
    [
        ([OK], "close"),
        ([OK, b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\n\r\n"], "hang"),
    ],
    ids=["closed", "stray-bytes"],
)
async def test_an_idle_connection_the_server_closed_or_wrote_to_is_not_reused(first: Reply) -> None:
    with trio.fail_after(WAIT):
        async with wired(first, ([OK], "keep")) as (transport, wire, url):
            assert await fetch(transport, url) == (200, BODY)
            assert counts(transport) == (1, 1)
            server_closes = first[1] == "close"
            # The server closed its side, or wrote its stray bytes to the idle connection.
            await wire.until(lambda: wire.replied == 1 and wire.server_closed >= server_closes)
            assert await fetch(transport, url) == (200, BODY)
            assert counts(transport) == (1, 1)
            await wire.until(lambda: wire.client_closed + wire.server_closed == 1)
    assert wire.connections == 2
    assert wire.requests == 2


async def test_an_idle_connection_past_keepalive_expiry_is_not_reused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    replies = [([OK], "keep")] * 3
    async with wired(*replies, keepalive_expiry=30.0) as (transport, wire, url):
        with trio.fail_after(WAIT):
            assert await fetch(transport, url) == (200, BODY)
        autojump_clock.jump(29)
        with trio.fail_after(WAIT):
            assert await fetch(transport, url) == (200, BODY)  # still fresh: reused
            assert wire.connections == 1
        autojump_clock.jump(31)
        with trio.fail_after(WAIT):
            assert await fetch(transport, url) == (200, BODY)
            assert counts(transport) == (1, 1)
            await wire.until(lambda: wire.client_closed == 1)  # the expired one was closed
    assert wire.connections == 2


async def test_a_request_beyond_max_connections_waits_for_a_response_to_close() -> None:
    hang: Reply = ([OPEN_HEAD], "hang")
    replies = (hang, hang, ([OK], "keep"), ([OK], "keep"))
    results: list[tuple[int, bytes]] = []
    with trio.fail_after(WAIT):
        async with wired(*replies, max_connections=2) as (transport, wire, url):
            first = await transport.handle_async_request(request(url))
            second = await transport.handle_async_request(request(url))
            assert counts(transport) == (2, 0)

            async def third() -> None:
                results.append(await fetch(transport, url))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(third)
                await trio.testing.wait_all_tasks_blocked()
                assert (wire.connections, wire.requests, results) == (2, 2, [])
                await first.aclose()
            assert results == [(200, BODY)]
            await wire.until(lambda: wire.client_closed == 1)
            assert wire.connections == 3
            assert counts(transport) == (2, 1)  # the second response, the third's connection
            await second.aclose()
            assert counts(transport) == (1, 1)
            await wire.until(lambda: wire.client_closed == 2)
            assert await fetch(transport, url) == (200, BODY)  # the idle one, reused
    assert wire.connections == 3


async def test_a_cancelled_waiting_request_leaves_the_counts_right() -> None:
    hang: Reply = ([OPEN_HEAD], "hang")
    with trio.fail_after(WAIT):
        async with wired(hang, hang, ([OK], "keep"), max_connections=2) as (transport, wire, url):
            first = await transport.handle_async_request(request(url))
            second = await transport.handle_async_request(request(url))
            await cancel_once_blocked(transport, request(url))  # waits for a connection
            assert counts(transport) == (2, 0)
            assert (wire.connections, wire.requests) == (2, 2)
            await first.aclose()
            assert counts(transport) == (1, 0)
            assert await fetch(transport, url) == (200, BODY)
            assert counts(transport) == (2, 1)
            await second.aclose()
            assert counts(transport) == (1, 1)
            await wire.until(lambda: wire.client_closed == 2)
    assert wire.connections == 3


async def test_a_request_cancelled_as_it_takes_an_idle_connection_does_not_leak_it() -> None:
    with trio.fail_after(WAIT):
        async with wired(([OK], "keep"), ([OK], "keep"), max_connections=1) as (
            transport,
            wire,
            url,
        ):
            assert await fetch(transport, url) == (200, BODY)
            assert counts(transport) == (1, 1)
            with trio.CancelScope() as scope:
                scope.cancel()
                await transport.handle_async_request(request(url))
            assert scope.cancelled_caught
            assert counts(transport) in ((1, 1), (0, 0))  # actual: (1, 0), a lost connection
            assert await fetch(transport, url) == (200, BODY)
    assert wire.requests == 2


async def test_an_idle_connection_of_another_origin_is_closed_to_make_room() -> None:
    other = Wire(([OK], "keep"))
    with trio.fail_after(WAIT):
        async with (
            wired(([OK], "keep"), max_connections=1) as (transport, wire, url),
            trio.open_nursery() as nursery,
        ):
            serve = functools.partial(trio.serve_tcp, host="127.0.0.1")
            listeners = await nursery.start(serve, other.handle, 0)
            other_url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}/v1/chat"
            assert await fetch(transport, url) == (200, BODY)
            assert await fetch(transport, other_url) == (200, BODY)
            assert counts(transport) == (1, 1)
            await wire.until(lambda: wire.client_closed == 1)
            nursery.cancel_scope.cancel()
    assert other.connections == 1


# -- bodies: read whole or not, and what the server asks ---------------------------------------


@pytest.mark.parametrize("read_first", [False, True], ids=["unread", "read-partly"])
async def test_closing_a_response_not_read_whole_closes_its_connection(read_first: bool) -> None:
    partial = reply(b"HTTP/1.1 200 OK", b"content-length: 10", body=b"abc")
    with trio.fail_after(WAIT):
        async with wired(([partial], "hang"), ([OK], "keep")) as (transport, wire, url):
            response = await transport.handle_async_request(request(url))
            if read_first:
                stream = response.stream
                assert isinstance(stream, httpx.AsyncByteStream)
                parts = aiter(stream)
                assert await anext(parts) == b"abc"
                await parts.aclose()  # type: ignore[attr-defined]
            assert counts(transport) == (1, 0)
            await response.aclose()
            assert counts(transport) == (0, 0)
            await wire.until(lambda: wire.client_closed == 1)
            assert await fetch(transport, url) == (200, BODY)
            assert counts(transport) == (1, 1)
    assert wire.connections == 2


@pytest.mark.parametrize(
    "body_reply",
    [
        reply(b"HTTP/1.1 200 OK", b"content-length: 10", body=b"abc"),
        reply(b"HTTP/1.1 200 OK", b"transfer-encoding: chunked", body=b"5\r\nhel"),
    ],
    ids=["content-length", "chunked"],
)
async def test_a_body_cut_by_the_server_is_a_protocol_error(body_reply: bytes) -> None:
    with trio.fail_after(WAIT):
        async with wired(([body_reply], "close"), ([OK], "keep")) as (transport, wire, url):
            response = await transport.handle_async_request(request(url))
            with pytest.raises(httpx.RemoteProtocolError, match="the connection closed"):
                await read_body(response)
            assert counts(transport) == (0, 0)
            assert await fetch(transport, url) == (200, BODY)
            assert counts(transport) == (1, 1)
    assert wire.connections == 2


async def test_a_body_read_whole_hands_the_connection_back() -> None:
    chunked = reply(
        b"HTTP/1.1 200 OK", b"transfer-encoding: chunked", body=b"5\r\nhello\r\n0\r\n\r\n"
    )
    empty = reply(b"HTTP/1.1 204 No Content")
    replies = (([OK], "keep"), ([chunked], "keep"), ([empty], "keep"), ([OK], "keep"))
    with trio.fail_after(WAIT):
        async with wired(*replies) as (transport, wire, url):
            assert await fetch(transport, url) == (200, BODY)
            assert counts(transport) == (1, 1)
            assert await fetch(transport, url) == (200, BODY)
            assert counts(transport) == (1, 1)
            assert await fetch(transport, url) == (204, b"")
            assert counts(transport) == (1, 1)
            assert await fetch(transport, url) == (200, BODY)
    assert (wire.connections, wire.requests) == (1, 4)


@pytest.mark.parametrize(
    ("first", "headers"),
    [
        (reply(b"HTTP/1.1 200 OK", b"connection: close", b"content-length: 5", body=BODY), None),
        (reply(b"HTTP/1.1 200 OK", b"Connection: Keep-Alive, Close", b"content-length: 5",
               body=BODY), None),
        (reply(b"HTTP/1.0 200 OK", b"content-length: 5", body=BODY), None),
        (reply(b"HTTP/1.1 200 OK", b"transfer-encoding: chunked", b"content-length: 5",
               body=b"5\r\nhello\r\n0\r\n\r\n"), None),
        (OK + b"junk", None),
        (OK, {"connection": "close"}),
    ],
    ids=["connection-close", "close-in-a-list", "http-1.0", "chunked-and-length", "extra-bytes",
         "request-asks-close"],
)  # fmt: skip
async def test_a_connection_that_must_not_carry_another_request_is_closed(
    first: bytes, headers: dict[str, str] | None
) -> None:
    """The server keeps its side open: the client must close it."""
    with trio.fail_after(WAIT):
        async with wired(([first], "hang"), ([OK], "keep")) as (transport, wire, url):
            assert await fetch(transport, url, headers) == (200, BODY)
            assert counts(transport) == (0, 0)
            await wire.until(lambda: wire.client_closed == 1)
            assert await fetch(transport, url) == (200, BODY)
            assert counts(transport) == (1, 1)
    assert wire.connections == 2


async def test_a_close_delimited_body_is_read_to_the_end_and_not_reused() -> None:
    unframed = reply(b"HTTP/1.1 200 OK", body=BODY)
    with trio.fail_after(WAIT):
        async with wired(([unframed], "close"), ([OK], "keep")) as (transport, wire, url):
            assert await fetch(transport, url) == (200, BODY)
            assert counts(transport) == (0, 0)
            assert await fetch(transport, url) == (200, BODY)
            assert counts(transport) == (1, 1)
    assert wire.connections == 2
