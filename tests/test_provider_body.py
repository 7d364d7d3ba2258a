"""The response body reader below httpx (crush_trio/providers/body.py).

The decoders are fed every chunking hypothesis finds; the reader is driven through the provider's
HTTP client against a raw loopback server that writes scripted bytes, so framing the fake model
never produces (extensions, trailers, malformed sizes, a body cut mid-chunk) is covered, and so is
what happens to the connection afterwards (handed back to the pool, or closed).
"""

from __future__ import annotations

import contextlib
import gzip
import random
from typing import TYPE_CHECKING, Any

import httpx
import hypothesis
import hypothesis.strategies as st
import pytest
import trio
import trio.testing

from crush_trio.errors import ProviderError
from crush_trio.providers.body import (
    MAX_CHUNK_BYTES,
    MAX_CHUNK_LINE_BYTES,
    MAX_TRAILER_BYTES,
    READ_WATCH_INTERVAL,
    BodyError,
    ChunkedDecoder,
    IncompleteBody,
    LengthDecoder,
    SocketBody,
    read_watch,
)
from crush_trio.providers.http import HttpStreamer, Settings, SSEEvent
from crush_trio.providers.transport import take_over

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

TEST_TIMEOUT = 10


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for point in points:
        pieces.append(data[last:point])
        last = point
    pieces.append(data[last:])
    return pieces


def chunked(
    payloads: list[bytes], *, extensions: bool = False, trailers: Sequence[bytes] = ()
) -> bytes:
    out = b""
    for i, payload in enumerate(payloads):
        ext = f';name{i}="v;al"'.encode() if extensions else b""
        out += b"%x%s\r\n%s\r\n" % (len(payload), ext, payload)
    out += b"0" + (b";last" if extensions else b"") + b"\r\n"
    for trailer in trailers:
        out += trailer + b"\r\n"
    return out + b"\r\n"


def decode_all(decoder: ChunkedDecoder | LengthDecoder, pieces: list[bytes]) -> bytes:
    out = b""
    for piece in pieces:
        out += decoder.feed(piece)
    return out


# ---------------------------------------------------------------------------------------------
# Decoders without I/O


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
    payloads=st.lists(st.binary(min_size=1, max_size=40), max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
    extensions=st.booleans(),
    trailers=st.lists(st.sampled_from([b"x-usage: 12", b"checksum: abc"]), max_size=2),
    after=st.sampled_from([b"", b"HTTP/1.1 200 OK\r\n"]),
)
def test_chunked_decoder_gives_the_payload_for_any_chunking(
    payloads: list[bytes], cuts: list[int], extensions: bool, trailers: list[bytes], after: bytes
) -> None:
    wire = chunked(payloads, extensions=extensions, trailers=trailers)
    decoder = ChunkedDecoder()
    assert decode_all(decoder, split_at(wire + after, cuts)) == b"".join(payloads)
    assert decoder.done
    assert decoder.extra == after
    decoder.eof()  # a connection that ends after the last chunk is fine


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(
    payload=st.binary(min_size=1, max_size=200),
    cut=st.integers(min_value=1, max_value=10_000),
)
def test_chunked_decoder_at_eof_before_the_end_is_incomplete(payload: bytes, cut: int) -> None:
    wire = chunked([payload])
    cut %= len(wire) - 1  # anything short of the final CRLF
    decoder = ChunkedDecoder()
    decoder.feed(wire[:cut])
    assert not decoder.done
    with pytest.raises(IncompleteBody, match="connection closed"):
        decoder.eof()


def test_chunked_decoder_passes_chunk_data_on_as_it_arrives() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"a\r\nhello") == b"hello"
    with pytest.raises(IncompleteBody, match="5 bytes of a chunk unread"):
        decoder.eof()


@pytest.mark.parametrize(
    ("wire", "message"),
    [
        (b"zz\r\nhello\r\n", "malformed chunk size line b'zz'"),
        (b"0x5\r\nhello\r\n", "malformed chunk size line"),
        (b"1_0\r\n", "malformed chunk size line"),
        (b"-5\r\n", "malformed chunk size line"),
        (b"\r\n", "malformed chunk size line"),
        (b"5\r\nhelloXY", "chunk data is not followed by CRLF"),
        (b"%x\r\n" % (MAX_CHUNK_BYTES + 1), f"exceeds MAX_CHUNK_BYTES={MAX_CHUNK_BYTES}"),
        (b"ffffffffffffffff\r\n", "exceeds MAX_CHUNK_BYTES"),
        (b"1" * (MAX_CHUNK_LINE_BYTES + 1), "longer than MAX_CHUNK_LINE_BYTES"),
        (b"0\r\n" + b"x: y\r\n" * (MAX_TRAILER_BYTES // 6 + 1), "MAX_TRAILER_BYTES"),
    ],
)
def test_chunked_decoder_rejects_bad_framing(wire: bytes, message: str) -> None:
    with pytest.raises(BodyError, match=message.replace("(", r"\(")):
        ChunkedDecoder().feed(wire)


def test_a_chunk_of_exactly_the_bound_is_accepted_and_streamed() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"%x\r\n" % MAX_CHUNK_BYTES + b"ab") == b"ab"


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(
    payload=st.binary(max_size=100),
    extra=st.binary(max_size=10),
    cuts=st.lists(st.integers(min_value=0, max_value=1000), max_size=6),
)
def test_length_decoder_stops_at_the_length(payload: bytes, extra: bytes, cuts: list[int]) -> None:
    decoder = LengthDecoder(len(payload))
    assert decode_all(decoder, split_at(payload + extra, cuts)) == payload
    assert decoder.done
    assert decoder.extra == extra


def test_length_decoder_at_eof_before_the_length_is_incomplete() -> None:
    decoder = LengthDecoder(10)
    decoder.feed(b"abc")
    with pytest.raises(IncompleteBody, match="7 bytes of the body unread"):
        decoder.eof()


def test_close_delimited_body_ends_with_the_connection() -> None:
    decoder = LengthDecoder(None)
    assert decode_all(decoder, [b"abc", b"", b"def"]) == b"abcdef"
    assert not decoder.done
    decoder.eof()
    assert decoder.done


# ---------------------------------------------------------------------------------------------
# Through the provider's HTTP client, against a raw server


def sse(*datas: str) -> bytes:
    return b"".join(b"data: %s\n\n" % d.encode() for d in datas)


EVENTS = sse('{"n": 1}', '{"n": 2}', "[DONE]")


class RawServer:
    """Answers each request on a connection with the next scripted response bytes (written in
    the given pieces), then, if the script says so, closes the connection."""

    def __init__(self, *responses: tuple[list[bytes], bool]) -> None:
        self.responses = list(responses)
        self.connections = 0
        self.requests = 0
        #: Each request's head (request line and header lines) as received.
        self.heads: list[bytes] = []
        self.closed_by_client = 0
        self.client_gone = trio.Event()

    async def serve(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, self._connection, listeners)
            task_status.started(f"http://127.0.0.1:{port}")

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buffer = b""
        async with stream:
            while True:
                while b"\r\n\r\n" not in buffer:
                    more = await stream.receive_some(65536)
                    if not more:
                        self.closed_by_client += 1
                        self.client_gone.set()
                        return
                    buffer += more
                head, buffer = buffer.split(b"\r\n\r\n", 1)
                self.heads.append(head)
                length = request_length(head)
                while len(buffer) < length:
                    buffer += await stream.receive_some(65536)
                buffer = buffer[length:]
                self.requests += 1
                pieces, close = self.responses.pop(0)
                for piece in pieces:
                    await stream.send_all(piece)
                if close:
                    return


def request_length(head: bytes) -> int:
    """The ``content-length`` of a request head (0 without one)."""
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return length


def head(framing: str, extra: str = "") -> bytes:
    return (f"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n{framing}{extra}\r\n").encode()


CHUNKED = "transfer-encoding: chunked\r\n"


@contextlib.asynccontextmanager
async def streamer(
    server: RawServer, *, watch: bool = True, **settings: Any
) -> AsyncIterator[tuple[HttpStreamer, str]]:
    """The provider's HTTP client against ``server``; with ``watch``, the read watch runs (as it
    does in the server), else every read times itself."""
    async with contextlib.AsyncExitStack() as stack:
        if watch:
            await stack.enter_async_context(read_watch())
        nursery = await stack.enter_async_context(trio.open_nursery())
        url = await nursery.start(server.serve)
        http = HttpStreamer("raw", Settings(base_url=url, max_retries=0, **settings), headers={})
        try:
            yield http, url + "/v1/chat"
        finally:
            await http.aclose()
            nursery.cancel_scope.cancel()


async def datas(http: HttpStreamer, url: str) -> list[str]:
    out: list[str] = []
    async with contextlib.aclosing(http.stream_sse(url, {"x": 1})) as events:
        async for event in events:
            assert isinstance(event, SSEEvent)
            out.append(event.data)
    return out


async def final_datas(http: HttpStreamer, url: str) -> list[str]:
    """Like :func:`datas`, ending at ``[DONE]`` as the providers do (the rest is drained)."""
    out: list[str] = []
    stream = http.stream_sse(url, {"x": 1}, is_final=lambda e: e.data == "[DONE]")
    async with contextlib.aclosing(stream) as events:
        async for event in events:
            assert isinstance(event, SSEEvent)
            out.append(event.data)
    return out


WANT = ['{"n": 1}', '{"n": 2}', "[DONE]"]


async def test_the_fast_path_is_taken_for_an_http11_chunked_stream() -> None:
    """A response of the providers' own transport is read from its connection."""
    server = RawServer(([head(CHUNKED), chunked([EVENTS])], False))
    with trio.fail_after(TEST_TIMEOUT):
        async with streamer(server) as (http, url):
            response = await http.send(http.request(url, b"{}"))
            try:
                body = take_over(response, timeout=None)
                assert isinstance(body, SocketBody)
                assert b"".join([part async for part in body]) == EVENTS
                assert body.complete
                await body.aclose()
            finally:
                await response.aclose()


@pytest.mark.parametrize("seed", range(8))
async def test_random_chunkings_on_the_wire_give_the_same_events_and_reuse_the_connection(
    seed: int,
) -> None:
    rng = random.Random(seed)
    payloads, rest = [], EVENTS
    while rest:
        size = rng.randint(1, 25)
        payloads.append(rest[:size])
        rest = rest[size:]
    wire = head(CHUNKED) + chunked(
        payloads, extensions=seed % 2 == 1, trailers=[b"x-usage: 3"] if seed % 3 == 0 else []
    )
    pieces = split_at(wire, [rng.randint(0, len(wire)) for _ in range(rng.randint(0, 10))])
    server = RawServer((pieces, False), ([head(CHUNKED), chunked([EVENTS])], False))
    with trio.fail_after(TEST_TIMEOUT):
        async with streamer(server) as (http, url):
            assert await datas(http, url) == WANT
            assert await datas(http, url) == WANT
    assert server.requests == 2
    assert server.connections == 1  # handed back to the pool after the whole body was read


async def test_draining_after_the_final_event_hands_the_connection_back() -> None:
    tail = chunked([EVENTS[:20], EVENTS[20:]], trailers=[b"x-end: 1"])
    server = RawServer(([head(CHUNKED), tail], False), ([head(CHUNKED), chunked([EVENTS])], False))
    with trio.fail_after(TEST_TIMEOUT):
        async with streamer(server) as (http, url):
            assert await final_datas(http, url) == WANT
            assert await final_datas(http, url) == WANT
    assert server.connections == 1


async def test_a_content_length_body_is_read_and_the_connection_reused() -> None:
    fixed = head(f"content-length: {len(EVENTS)}\r\n") + EVENTS
    server = RawServer(([fixed[:30], fixed[30:]], False), ([fixed], False))
    with trio.fail_after(TEST_TIMEOUT):
        async with streamer(server) as (http, url):
            assert await datas(http, url) == WANT
            assert await datas(http, url) == WANT
    assert server.connections == 1


async def test_a_close_delimited_body_ends_with_the_connection() -> None:
    server = RawServer(([head(""), EVENTS[:10], EVENTS[10:]], True), ([head(""), EVENTS], True))
    with trio.fail_after(TEST_TIMEOUT):
        async with streamer(server) as (http, url):
            assert await datas(http, url) == WANT
            assert await datas(http, url) == WANT
    assert server.connections == 2


async def test_a_server_that_asks_to_close_gets_a_new_connection_next_time() -> None:
    response = [head(CHUNKED, "connection: close\r\n"), chunked([EVENTS])]
    server = RawServer((response, True), (response, True))
    with trio.fail_after(TEST_TIMEOUT):
        async with streamer(server) as (http, url):
            assert await datas(http, url) == WANT
            assert await datas(http, url) == WANT
    assert server.connections == 2


async def test_bytes_after_the_body_close_the_connection() -> None:
    server = RawServer(
        ([head(CHUNKED), chunked([EVENTS]) + b"junk"], False),
        ([head(CHUNKED), chunked([EVENTS])], False),
    )
    with trio.fail_after(TEST_TIMEOUT):
        async with streamer(server) as (http, url):
            assert await datas(http, url) == WANT
            await server.client_gone.wait()
            assert await datas(http, url) == WANT
    assert server.connections == 2


async def test_a_malformed_chunk_size_is_a_clear_error_and_closes_the_connection() -> None:
    bad = chunked([sse('{"n": 1}')])[:-5] + b"zz\r\nmore\r\n"
    server = RawServer(([head(CHUNKED), bad], False))
    with trio.fail_after(TEST_TIMEOUT):
        async with streamer(server) as (http, url):
            with pytest.raises(ProviderError) as info:
                await datas(http, url)
            await server.client_gone.wait()
    assert str(info.value) == (
        "provider 'raw' sent a malformed HTTP body: malformed chunk size line b'zz'; "
        "the connection was closed"
    )


async def test_an_oversize_chunk_is_refused() -> None:
    bad = b"%x\r\n" % (MAX_CHUNK_BYTES + 1) + b"data: x\n\n"
    server = RawServer(([head(CHUNKED), bad], False))
    with trio.fail_after(TEST_TIMEOUT):
        async with streamer(server) as (http, url):
            with pytest.raises(ProviderError, match="exceeds MAX_CHUNK_BYTES") as info:
                await datas(http, url)
            await server.client_gone.wait()
    assert "malformed HTTP body" in str(info.value)


async def test_eof_mid_chunk_is_a_broken_connection() -> None:
    cut = chunked([EVENTS])[:-20]
    server = RawServer(([head(CHUNKED), cut], True))
    with trio.fail_after(TEST_TIMEOUT):
        async with streamer(server) as (http, url):
            seen: list[str] = []
            # Draining the stream is one step; it needs the loop.
            with pytest.raises(ProviderError) as info:  # noqa: PT012
                async with contextlib.aclosing(http.stream_sse(url, {})) as events:
                    async for event in events:
                        assert isinstance(event, SSEEvent)
                        seen.append(event.data)
    assert seen == WANT[:2]
    assert str(info.value).startswith(
        "provider 'raw' closed the connection mid-stream: IncompleteBody: the connection closed"
    )


async def test_eof_before_the_first_byte_of_the_body() -> None:
    server = RawServer(([head(CHUNKED)], True))
    with trio.fail_after(TEST_TIMEOUT):
        async with streamer(server) as (http, url):
            with pytest.raises(ProviderError, match="broke the connection before the reply"):
                await datas(http, url)


async def test_a_compressed_body_is_read_through_httpx() -> None:
    packed = gzip.compress(EVENTS)
    response = head(f"content-length: {len(packed)}\r\n", "content-encoding: gzip\r\n") + packed
    server = RawServer(([response], False))
    with trio.fail_after(TEST_TIMEOUT):
        async with streamer(server) as (http, url):
            sent = await http.send(http.request(url, b"{}"))
            try:
                assert take_over(sent, timeout=None) is None
            finally:
                await sent.aclose()
    server = RawServer(([response], False))
    with trio.fail_after(TEST_TIMEOUT):
        async with streamer(server) as (http, url):
            assert await datas(http, url) == WANT


async def test_a_request_carries_the_provider_headers_once_each() -> None:
    """The request goes to the connection pool without httpx's client: it still carries the
    client's default headers under the provider's, and ``extra_headers`` replace a header of
    any case instead of adding a second one."""
    server = RawServer(([head(CHUNKED), chunked([EVENTS])], False))
    with trio.fail_after(TEST_TIMEOUT):
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(read_watch())
            nursery = await stack.enter_async_context(trio.open_nursery())
            url = await nursery.start(server.serve)
            extra = {"user-agent": "agent/2", "X-Org": "o"}
            settings = Settings(base_url=url, max_retries=0, extra_headers=extra)
            http = HttpStreamer("raw", settings, headers={"Authorization": "Bearer k"})
            try:
                assert await datas(http, url + "/v1/chat") == WANT
            finally:
                await http.aclose()
                nursery.cancel_scope.cancel()
    (request,) = server.heads
    lines = request.decode().split("\r\n")
    assert lines[0] == "POST /v1/chat HTTP/1.1"
    fields = [tuple(part.strip() for part in line.split(":", 1)) for line in lines[1:]]
    names = [name.lower() for name, _ in fields]
    assert len(names) == len(set(names)), names
    got = {name.lower(): value for name, value in fields}
    assert got == {
        "host": url.removeprefix("http://"),
        "connection": "keep-alive",
        "user-agent": "agent/2",
        "accept": "text/event-stream",
        "accept-encoding": "identity",
        "authorization": "Bearer k",
        "x-org": "o",
        "content-type": "application/json",
        "content-length": str(len(b'{"x":1}')),
    }


async def test_cookies_a_provider_sets_are_neither_kept_nor_sent_back() -> None:
    """A provider (or a gateway before it) that sets a new cookie on every response: nothing
    is kept between requests, so the cookies cannot pile up in memory, and no request carries
    a ``Cookie`` header."""
    cookies = "".join(f"set-cookie: c{n}={'x' * 1000}; Path=/\r\n" for n in range(50))
    reply = [head(CHUNKED, cookies), chunked([EVENTS])]
    server = RawServer((reply, False), (reply, False), (reply, False))
    with trio.fail_after(TEST_TIMEOUT):
        async with streamer(server) as (http, url):
            for _ in range(3):
                assert await datas(http, url) == WANT
    assert len(server.heads) == 3
    assert all(b"cookie" not in request.lower() for request in server.heads)


async def test_a_response_from_another_transport_is_read_through_httpx() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=EVENTS, headers={"content-type": "text/event-stream"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        response = await client.send(client.build_request("GET", "http://x/"), stream=True)
        assert take_over(response, timeout=None) is None
        await response.aclose()


class HangingServer(RawServer):
    """Sends its first response's pieces, then keeps the connection open without a word."""

    async def _connection(self, stream: trio.SocketStream) -> None:
        if self.requests:
            await super()._connection(stream)
            return
        self.connections += 1
        async with stream:
            await stream.receive_some(65536)
            self.requests += 1
            pieces, _ = self.responses.pop(0)
            for piece in pieces:
                await stream.send_all(piece)
            while await stream.receive_some(65536):
                pass
            self.closed_by_client += 1
            self.client_gone.set()


@pytest.mark.parametrize(
    ("first_byte_timeout", "watch"),
    [(60.0, True), (20.0, True), (20.0, False)],
    ids=["own-scope", "read-watch", "scope-per-read"],
)
async def test_a_stalled_body_times_out_closes_the_connection_and_the_next_request_works(
    first_byte_timeout: float, watch: bool, autojump_clock: trio.testing.MockClock
) -> None:
    """chunk_timeout >= first_byte_timeout: the read watch times the reads (no cancel scope per
    read), or each read its own scope where no watch runs; otherwise a scope per chunk does.
    Same error, bounded by the watch's interval, and the stalled connection is closed, not
    handed back."""
    server = HangingServer(
        ([head(CHUNKED), chunked([sse('{"n": 1}')])[:-5]], False),
        ([head(CHUNKED), chunked([EVENTS])], False),
    )
    with trio.fail_after(1000):
        async with streamer(
            server, watch=watch, chunk_timeout=20, first_byte_timeout=first_byte_timeout
        ) as (http, url):
            seen: list[str] = []
            # Draining the stream is one step; it needs the loop.
            with pytest.raises(ProviderError) as info:  # noqa: PT012
                async with contextlib.aclosing(http.stream_sse(url, {})) as events:
                    async for event in events:
                        assert isinstance(event, SSEEvent)
                        seen.append(event.data)
                        started = trio.current_time()
            waited = trio.current_time() - started
            await server.client_gone.wait()
            assert await datas(http, url) == WANT
    assert seen == ['{"n": 1}']
    assert str(info.value).startswith(
        "provider 'raw' stalled mid-stream: nothing for chunk_timeout=20s"
    )
    assert 20 <= waited <= 20 + READ_WATCH_INTERVAL + 0.01
    assert server.connections == 2


async def test_a_read_waiting_when_the_read_watch_stops_ends_with_a_clear_error() -> None:
    """The watch's owner (the server's backend) stops while a stream waits on a silent
    provider: the read ends at once with an error saying so, instead of waiting with no
    timeout. A watch entered and left before the read leaves the outer one in charge (else the
    read would time itself and outlast the outer block)."""
    server = HangingServer(([head(CHUNKED), chunked([sse('{"n": 1}')])[:-5]], False))
    seen: list[str] = []
    errors: list[ProviderError] = []
    waiting = trio.Event()
    done = trio.Event()

    async def consume(http: HttpStreamer, url: str) -> None:
        try:
            async with contextlib.aclosing(http.stream_sse(url, {})) as events:
                async for event in events:
                    assert isinstance(event, SSEEvent)
                    seen.append(event.data)
                    waiting.set()
        except ProviderError as exc:
            errors.append(exc)
        finally:
            done.set()

    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(server.serve)
            settings = Settings(base_url=url, max_retries=0, chunk_timeout=60)
            http = HttpStreamer("raw", settings, headers={})
            async with read_watch():
                async with read_watch():
                    pass
                nursery.start_soon(consume, http, url + "/v1/chat")
                await waiting.wait()
                await trio.testing.wait_all_tasks_blocked()
            await done.wait()
            await http.aclose()
            nursery.cancel_scope.cancel()
    assert seen == ['{"n": 1}']
    assert len(errors) == 1
    assert "the provider read watch stopped" in str(errors[0])


async def test_a_read_of_a_stopping_watch_moves_to_another_running_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two watches run (two backends in one process); the one a stalled read joined stops: the
    read is timed by the other and reported as stalled, not ended."""
    server = HangingServer(([head(CHUNKED), chunked([sse('{"n": 1}')])[:-5]], False))
    errors: list[ProviderError] = []
    waiting = trio.Event()
    done = trio.Event()

    async def consume(http: HttpStreamer, url: str) -> None:
        try:
            async with contextlib.aclosing(http.stream_sse(url, {})) as events:
                async for _ in events:
                    waiting.set()
        except ProviderError as exc:
            errors.append(exc)
        finally:
            done.set()

    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(server.serve)
            settings = Settings(base_url=url, max_retries=0, chunk_timeout=20)
            http = HttpStreamer("raw", settings, headers={})
            async with read_watch():
                async with read_watch():
                    nursery.start_soon(consume, http, url + "/v1/chat")
                    await waiting.wait()
                    await trio.testing.wait_all_tasks_blocked()
                left = trio.current_time()
                await done.wait()
                waited = trio.current_time() - left
            await http.aclose()
            nursery.cancel_scope.cancel()
    assert len(errors) == 1
    assert "stalled mid-stream: nothing for chunk_timeout=20s" in str(errors[0])
    assert 0 < waited <= 20 + READ_WATCH_INTERVAL + 0.01
