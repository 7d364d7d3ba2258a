"""HTTP machinery shared by the HTTP providers: SSE decoding, timeouts, retries, error mapping.

Layers, from the wire up:

* :class:`SSEDecoder` is pure logic: bytes in, :class:`SSEEvent` values out. It knows nothing of
  sockets or clocks, so it is tested by feeding it bytes split at every possible point.
* :class:`HttpStreamer` is the thin Trio shell. It owns one connection pool per provider (the
  providers' own HTTP/1.1 transport, :mod:`crush_trio.providers.transport`, under ``httpx``'s
  request and response types), posts a JSON body, retries transient failures, enforces the
  named timeouts on Trio's clock, and yields decoded events. The body of a stream is read from
  its connection by :mod:`crush_trio.providers.body` (through ``httpx`` when compressed). Every
  ``httpx`` exception, and every error of that reader, becomes a
  :class:`~crush_trio.errors.ProviderError` here, so the provider modules above it never see HTTP
  errors.

Timeouts (all config keys of a provider, in seconds):

* ``connect_timeout``: opening the TCP (and TLS) connection.
* ``first_byte_timeout``: from sending the request until the response headers *and* the first
  chunk of the body arrived. Enforced with :func:`trio.move_on_after`, so Trio's clock (and a
  test's ``MockClock``) drives it.
* ``chunk_timeout``: the longest silence between two chunks of a streaming body.

Retries: a connection failure, HTTP 429 and HTTP 5xx are retried up to ``max_retries`` times, only
before any content was streamed. The delay for the ``n``-th retry (counting from 0) takes "equal
jitter": with ``cap = min(retry_max_delay, retry_base_delay * 2**n)`` it is uniform in
``[cap/2, cap]``. When the server sent ``Retry-After`` the delay is that value plus up to
:data:`RETRY_AFTER_JITTER` of it (never earlier than asked), capped by ``retry_max_delay``. The
jitter keeps runs that hit a 429 together from retrying together; its random source is
:attr:`HttpStreamer.rand` (tests set it to a constant). A
:class:`~crush_trio.providers.base.Retrying` event is yielded before each retry sleep so clients
can show it. Timeouts are not retried: a provider that is silent for ``first_byte_timeout`` is
reported at once instead of multiplying the wait.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any, Final, Protocol

import attrs
import httpx
import orjson
import trio

from ..defaults import (
    CLEANUP_TIMEOUT,
    DEFAULT_CHUNK_TIMEOUT,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_FIRST_BYTE_TIMEOUT,
    DEFAULT_MAX_RETRIES,
    DEFAULT_RETRY_BASE_DELAY,
    DEFAULT_RETRY_MAX_DELAY,
)
from ..errors import ProviderError
from ..metrics import METRICS, status_kind
from .base import Retrying
from .body import READ_PACER, BodyError, BodyTimeout, IncompleteBody
from .pool import shared_ssl_context
from .transport import Http11Transport, take_over

#: Largest extra wait added to a server's ``Retry-After``, as a fraction of it (so that clients
#: told the same delay spread out instead of retrying at the same instant).
RETRY_AFTER_JITTER: Final = 0.2

#: After the final event of a reply, how long to wait for the end of the body so the connection
#: can be reused; past it the connection is closed instead (no error: the reply is complete).
DRAIN_TIMEOUT: Final = 1.0
#: Most bytes of an error response body read to find its message; the rest is discarded.
MAX_ERROR_BODY_BYTES: Final = 64 * 1024
#: Largest SSE event (or line) accepted; a larger one is a protocol error, never unbounded memory.
MAX_SSE_EVENT_BYTES: Final = 16 * 1024 * 1024
#: Longest excerpt of a bad chunk or error body quoted in an error message.
MAX_QUOTE_CHARS: Final = 200

#: Connections one provider's client opens at once (more streams wait for one to free up), all
#: kept alive between requests so that a burst of runs does not reconnect on every round.
MAX_PROVIDER_CONNECTIONS: Final = 100
#: How long an idle provider connection is kept for the next request (seconds).
PROVIDER_KEEPALIVE_EXPIRY: Final = 30.0

#: Statuses retried before any content was streamed (besides every 5xx).
RETRYABLE_STATUSES: Final = frozenset({429})
#: Statuses that mean the credentials are wrong: fail at once with an api_key hint.
AUTH_STATUSES: Final = frozenset({401, 403})


class ProviderSettings(Protocol):
    """The provider config keys this package reads (``ProviderConfig`` in the config module).

    Any object with these attributes works; :class:`Settings` is a plain implementation.
    """

    @property
    def type(self) -> str: ...
    @property
    def base_url(self) -> str: ...
    @property
    def api_key(self) -> str: ...
    @property
    def extra_headers(self) -> Mapping[str, str]: ...
    @property
    def delay_ms(self) -> float: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def first_byte_timeout(self) -> float: ...
    @property
    def chunk_timeout(self) -> float: ...
    @property
    def max_retries(self) -> int: ...
    @property
    def retry_base_delay(self) -> float: ...
    @property
    def retry_max_delay(self) -> float: ...


@attrs.frozen
class Settings:
    """Provider settings with the documented defaults, for code that builds a provider by hand."""

    type: str = "openai-compat"
    base_url: str = ""
    api_key: str = ""
    extra_headers: Mapping[str, str] = attrs.field(factory=dict)
    delay_ms: float = 0.0
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    first_byte_timeout: float = DEFAULT_FIRST_BYTE_TIMEOUT
    chunk_timeout: float = DEFAULT_CHUNK_TIMEOUT
    max_retries: int = DEFAULT_MAX_RETRIES
    retry_base_delay: float = DEFAULT_RETRY_BASE_DELAY
    retry_max_delay: float = DEFAULT_RETRY_MAX_DELAY


# ---------------------------------------------------------------------------------------------
# Server-sent events, without I/O


@attrs.frozen
class SSEEvent:
    """One dispatched server-sent event: its ``event:`` name and its joined ``data:`` lines."""

    event: str = "message"
    data: str = ""


class SSEDecoder:
    """Incremental decoder of a ``text/event-stream`` body (the WHATWG event-stream rules).

    Lines end in ``\\n``, ``\\r\\n`` or ``\\r``, possibly split across chunks; ``data:`` lines
    are joined with ``\\n``; a blank line dispatches the event; ``:`` comments, ``id:`` and
    ``retry:`` are ignored. An event still pending when the body ends is dispatched by
    :meth:`close`, since some servers omit the final blank line.

    Args:
        limit: the largest event or line in bytes; a bigger one raises :class:`ValueError`.
    """

    def __init__(self, limit: int = MAX_SSE_EVENT_BYTES) -> None:
        self._limit = limit
        self._buffer = b""
        self._event = ""
        self._data: list[str] = []
        self._size = 0

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Decode ``chunk`` and return the events it completed.

        Raises:
            ValueError: an event or line exceeds the limit.
        """
        # What a model streams: events of one data line each, whole in their chunk.
        whole = self.take_whole(chunk)
        if whole is not None:
            return whole
        buffer = self._buffer + chunk if self._buffer else chunk
        events: list[SSEEvent] = []
        start = 0
        size = len(buffer)
        while start < size:
            nl = buffer.find(b"\n", start)
            cr = buffer.find(b"\r", start, nl if nl >= 0 else size)
            if cr >= 0:
                if cr + 1 == size:
                    break  # a "\r" at the end may be the first half of "\r\n": wait for more
                end = cr
                start_next = cr + 2 if buffer[cr + 1] == 0x0A else cr + 1
            elif nl >= 0:
                end = nl
                start_next = nl + 1
            else:
                break
            self._line(buffer[start:end], events)
            start = start_next
        self._buffer = buffer[start:]
        if len(self._buffer) > self._limit:
            raise ValueError(f"an event-stream line is longer than {self._limit} bytes")
        return events

    def take_whole(self, chunk: bytes) -> list[SSEEvent] | None:
        """The events of ``chunk`` when it is whole events of one ``data: `` line each and
        nothing is pending: what :meth:`feed` would return, the decoder left as it is. None
        when it is anything else; nothing changed then, and :meth:`feed` takes the same bytes
        (and raises where it must)."""
        if self._buffer or self._data or self._event or not chunk.endswith(b"\n\n"):
            return None
        events: list[SSEEvent] = []
        for line in chunk[:-2].split(b"\n\n"):
            if not line.startswith(b"data: ") or len(line) > self._limit:
                return None
            data = line[6:]
            if b"\n" in data or b"\r" in data:
                return None
            events.append(SSEEvent("message", data.decode("utf-8", errors="replace")))
        return events

    def close(self) -> list[SSEEvent]:
        """End of the body: return the last event if one was pending."""
        events: list[SSEEvent] = []
        if self._buffer:
            line, self._buffer = self._buffer.rstrip(b"\r"), b""
            self._line(line, events)
        self._dispatch(events)
        return events

    def _line(self, raw: bytes, events: list[SSEEvent]) -> None:
        if not raw:
            self._dispatch(events)
            return
        line = raw.decode("utf-8", errors="replace")
        if line.startswith(":"):
            return
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._size += len(raw)
            if self._size > self._limit:
                raise ValueError(f"an event-stream event is larger than {self._limit} bytes")
            self._data.append(value)
        elif name == "event":
            self._event = value

    def _dispatch(self, events: list[SSEEvent]) -> None:
        if self._data:
            events.append(SSEEvent(self._event or "message", "\n".join(self._data)))
        self._event = ""
        self._data = []
        self._size = 0


# ---------------------------------------------------------------------------------------------
# Retry and error helpers, without I/O


def backoff_delay(
    settings: ProviderSettings,
    retry: int,
    retry_after: float | None,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait before the ``retry``-th retry (0-based), with jitter from ``rand()``
    (a float in ``[0, 1]``).

    Without ``Retry-After``: equal jitter, uniform in ``[cap/2, cap]`` for
    ``cap = min(retry_max_delay, retry_base_delay * 2**retry)``. With it: ``Retry-After`` plus up
    to :data:`RETRY_AFTER_JITTER` of it. Either way the delay is capped by ``retry_max_delay``.
    """
    jitter = min(1.0, max(0.0, rand()))
    if retry_after is not None:
        wait = max(0.0, retry_after) * (1.0 + RETRY_AFTER_JITTER * jitter)
        return min(settings.retry_max_delay, wait)
    cap = max(0.0, min(settings.retry_max_delay, settings.retry_base_delay * float(2**retry)))
    return cap / 2 + cap / 2 * jitter


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """The server's requested delay in seconds (``retry-after-ms`` or ``Retry-After`` seconds).

    An HTTP-date ``Retry-After`` or a malformed value is ignored (the backoff applies).
    """
    for key, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        raw = headers.get(key)
        if raw is None:
            continue
        try:
            value = float(raw.strip()) * scale
        except ValueError:
            continue
        if math.isfinite(value) and value >= 0:
            return value
    return None


def quote(text: str | bytes, limit: int = MAX_QUOTE_CHARS) -> str:
    """A short excerpt of ``text`` for an error message."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."


def error_message(body: bytes) -> str:
    """The human message of an error body (``{"error": {"message": ...}}`` and variants)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return quote(body) or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            for key in ("message", "detail", "error"):
                value = err.get(key)
                if isinstance(value, str) and value:
                    return quote(value, 4 * MAX_QUOTE_CHARS)
        elif isinstance(err, str) and err:
            return quote(err, 4 * MAX_QUOTE_CHARS)
    return quote(body)


def parse_json_event(provider: str, data: str) -> Any:
    """Decode the JSON data of one stream event.

    Raises:
        ProviderError: the data is not JSON (a malformed chunk never hangs or crashes the run).
    """
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise ProviderError(
            f"provider {provider!r} sent a malformed stream chunk: {quote(data)} ({exc})"
        ) from exc


def is_retryable_status(status: int) -> bool:
    return status in RETRYABLE_STATUSES or 500 <= status <= 599


# ---------------------------------------------------------------------------------------------
# The Trio shell


@attrs.frozen
class _Retry:
    """A transient failure before any content: retry it, or report ``message`` when out of tries."""

    #: The ``kind`` of the failure in ``provider_errors``.
    kind: str
    reason: str
    message: str
    retry_after: float | None = None


@attrs.frozen
class _Opened:
    response: httpx.Response
    chunks: AsyncIterator[bytes]
    first: bytes | None


class HttpStreamer:
    """One provider's HTTP client: posts JSON, yields server-sent events, retries, times out.

    Args:
        provider: the provider's name in ``crush.json``, used in every error message.
        settings: timeouts, retries, ``base_url`` and ``extra_headers``.
        headers: headers of every request (auth, API version); ``extra_headers`` override them.

    Cancellation: cancelling (or closing) a :meth:`stream_sse` generator closes its HTTP response,
    and with it the upstream connection, inside a shielded scope bounded by
    :data:`~crush_trio.defaults.CLEANUP_TIMEOUT`.
    """

    def __init__(
        self, provider: str, settings: ProviderSettings, *, headers: Mapping[str, str]
    ) -> None:
        self.provider = provider
        self.settings = settings
        self._metrics = METRICS.provider(provider)
        #: Random source of the retry jitter (a float in [0, 1]); tests replace it.
        self.rand: Callable[[], float] = random.random
        # An event stream is not worth compressing, and an uncompressed body can be read as it
        # arrives on the socket, without httpx's decoder and re-chunker layers (see _open).
        merged = {
            "accept": "text/event-stream",
            "accept-encoding": "identity",
            **headers,
            **dict(settings.extra_headers),
        }
        # The first byte is timed on Trio's clock in _open, which also covers writing the
        # request and waiting for the pool. A chunk gap is timed by the body reader's own read
        # timeout (the read watch; no cancel scope per chunk) when that cannot cut the
        # first-byte wait short, i.e. when chunk_timeout >= first_byte_timeout (the defaults);
        # otherwise on Trio's clock per chunk.
        self._read_timeout = settings.chunk_timeout >= settings.first_byte_timeout
        timeout = httpx.Timeout(
            connect=settings.connect_timeout,
            read=settings.chunk_timeout if self._read_timeout else None,
            write=None,
            pool=None,
        )
        # Requests go to the transport itself: a provider's POST needs none of the client's
        # layers (URL merging, auth flows, redirects, a cookie jar, event hooks), which cost
        # about 0.06 ms of each request's start (docs/performance.md). The headers are those
        # the client would have sent (its defaults under ours), merged once; no cookie jar,
        # as Go's default client has none.
        self._headers = httpx.Headers(
            {"Connection": "keep-alive", "User-Agent": f"python-httpx/{httpx.__version__}"}
        )
        self._headers.update(merged)  # by name in any case, as the client's merge
        self._headers["content-type"] = "application/json"
        self._timeout = timeout.as_dict()
        self._transport = Http11Transport(
            ssl_context=shared_ssl_context(),
            max_connections=MAX_PROVIDER_CONNECTIONS,
            keepalive_expiry=PROVIDER_KEEPALIVE_EXPIRY,
        )

    async def aclose(self) -> None:
        """Close the pooled connections."""
        await self._transport.aclose()

    def request(self, url: str, payload: bytes) -> httpx.Request:
        """The POST of ``payload`` (JSON) to ``url``, with this provider's headers and timeouts.

        Raises:
            httpx.InvalidURL: ``url`` is not a URL.
        """
        return httpx.Request(
            "POST",
            url,
            headers=self._headers,
            content=payload,
            extensions={"timeout": self._timeout},
        )

    async def send(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` through the provider's connection pool; the body is left to read.

        Raises:
            httpx.TransportError: connecting, writing or reading the head failed (or timed out).
            httpx.UnsupportedProtocol: the URL's scheme is not http or https.
        """
        response = await self._transport.handle_async_request(request)
        response.request = request
        return response

    async def stream_sse(
        self,
        url: str,
        body: Mapping[str, Any],
        *,
        is_final: Callable[[SSEEvent], bool] = lambda _: False,
    ) -> AsyncGenerator[SSEEvent | Retrying, None]:
        """POST ``body`` as JSON to ``url`` and yield the events of the streamed reply.

        ``Retrying`` values are yielded before each retry sleep. After an event for which
        ``is_final`` is true, the rest of the body is drained for up to :data:`DRAIN_TIMEOUT` so
        the connection can be reused, and the generator ends.

        Raises:
            ProviderError: the request failed, the reply was not a stream, a timeout expired,
                the connection broke or the stream was malformed.

        Cancellation: the response is closed when the generator is closed or cancelled.
        """
        payload = orjson.dumps(body)
        retry = 0
        while True:
            outcome = await self._open(url, payload)
            if isinstance(outcome, _Opened):
                break
            self._metrics.error(outcome.kind)
            if retry >= self.settings.max_retries:
                raise ProviderError(outcome.message, retryable=True)
            delay = backoff_delay(self.settings, retry, outcome.retry_after, self.rand)
            retry += 1
            self._metrics.retries.inc()
            yield Retrying(attempt=retry, delay=delay, reason=outcome.reason)
            await trio.sleep(delay)

        response, chunks = outcome.response, outcome.chunks
        decoder = SSEDecoder()
        pacer = READ_PACER.get()
        fold = pacer.fold if pacer is not None else None
        if fold is not None:
            fold.events = functools.partial(_whole_events, decoder, is_final)
        try:
            chunk = outcome.first
            while chunk is not None:
                for event in self._decode(decoder, chunk):
                    yield event
                    if is_final(event):
                        await self._drain(chunks)
                        return
                chunk = await self._next_chunk(chunks)
            for event in self._decode(decoder, None):
                yield event
        finally:
            if fold is not None:
                fold.events = None
            with trio.move_on_after(CLEANUP_TIMEOUT, shield=True):
                await _aclose_iter(chunks)
                await response.aclose()

    async def _open(self, url: str, payload: bytes) -> _Opened | _Retry:
        """Send the request and wait for the headers and the first chunk (first-byte timeout)."""
        name = self.provider
        response: httpx.Response | None = None
        try:
            request = self.request(url, payload)
        except httpx.InvalidURL as exc:
            self._metrics.error("config")
            raise ProviderError(
                f"provider {name!r} has an invalid base_url ({url}): {exc}; "
                "set base_url to an http:// or https:// URL"
            ) from exc
        ok = False
        self._metrics.requests.inc()
        started = trio.current_time()
        try:
            with trio.move_on_after(self.settings.first_byte_timeout):
                response = await self.send(request)
                self._metrics.latency.observe(trio.current_time() - started)
                status = response.status_code
                if not 200 <= status <= 299:
                    return await self._failed(response, url)
                content_type = response.headers.get("content-type", "")
                if content_type.startswith("application/json"):
                    self._metrics.error("protocol")
                    detail = error_message(await _read_limited(response))
                    raise ProviderError(
                        f"provider {name!r} answered with JSON instead of an event stream "
                        f"({detail}); check that base_url {self.settings.base_url!r} points at "
                        "an API that supports streaming"
                    )
                chunks = self._body_chunks(response)
                first, timed_out = await self._first_chunk(chunks)
                if not timed_out:  # a timeout is reported as the first-byte timeout, below
                    ok = True
                    return _Opened(response, chunks, first)
            self._metrics.error("timeout")
            raise ProviderError(
                f"provider {name!r} sent no response within first_byte_timeout="
                f"{self.settings.first_byte_timeout:g}s; check that {url} is up, or raise "
                f"first_byte_timeout for provider {name!r} if the model is slow to start",
                retryable=True,
            )
        except httpx.UnsupportedProtocol as exc:
            self._metrics.error("config")
            raise ProviderError(
                f"provider {name!r} has an unsupported base_url ({url}): {exc}; "
                "set base_url to an http:// or https:// URL"
            ) from exc
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            return _Retry(
                kind="connect",
                reason=f"connection failed: {_describe(exc)}",
                message=(
                    f"could not connect to provider {name!r} at {url}: {_describe(exc)}; "
                    f"check base_url for provider {name!r} and that the server is running"
                ),
            )
        except httpx.TransportError as exc:
            if response is not None:
                self._metrics.error("broken")
                raise ProviderError(
                    f"provider {name!r} broke the connection before the reply started: "
                    f"{_describe(exc)}",
                    retryable=True,
                ) from exc
            # The connection failed before any response: nothing was streamed, so retry.
            return _Retry(
                kind="connect",
                reason=f"connection failed: {_describe(exc)}",
                message=(
                    f"provider {name!r} at {url} closed the connection before answering: "
                    f"{_describe(exc)}"
                ),
            )
        except httpx.HTTPError as exc:
            self._metrics.error("http")
            raise ProviderError(f"request to provider {name!r} failed: {_describe(exc)}") from exc
        finally:
            if response is not None and not ok:
                with trio.move_on_after(CLEANUP_TIMEOUT, shield=True):
                    await response.aclose()

    def _body_chunks(self, response: httpx.Response) -> AsyncIterator[bytes]:
        """The chunks of a response's body, read the cheapest way its encoding allows."""
        encoded = response.headers.get("content-encoding", "identity").lower()
        stream = response.stream
        body = take_over(
            response,
            timeout=self.settings.chunk_timeout if self._read_timeout else None,
        )
        if body is not None:
            # HTTP/1.1, uncompressed: the body is read from the connection itself
            # (providers/body.py), one socket read per payload.
            return body
        if encoded in ("", "identity") and isinstance(stream, httpx.AsyncByteStream):
            # The transport's byte stream itself: ``aiter_raw`` would add a generator and a
            # re-chunker per chunk and changes nothing without a chunk size.
            return aiter(stream)
        return response.aiter_bytes()  # the server compressed it anyway, or HTTP/2

    async def _first_chunk(self, chunks: AsyncIterator[bytes]) -> tuple[bytes | None, bool]:
        """The body's first chunk (None: the body is empty), and whether the body reader's own
        timeout ran out first.

        Raises:
            ProviderError: the body is malformed, or the connection broke before it started.
        """
        try:
            return await anext(chunks), False
        except StopAsyncIteration:
            return None, False
        except BodyError as exc:
            raise self._malformed_body(exc) from exc
        except IncompleteBody as exc:
            self._metrics.error("broken")
            raise ProviderError(
                f"provider {self.provider!r} broke the connection before the reply started: "
                f"{_describe(exc)}",
                retryable=True,
            ) from exc
        except BodyTimeout:
            return None, True

    async def _failed(self, response: httpx.Response, url: str) -> _Retry:
        """Turn a non-2xx response into a retry, or raise the matching ProviderError."""
        name = self.provider
        status = response.status_code
        try:
            detail = error_message(await _read_limited(response))
        except httpx.HTTPError as exc:
            detail = f"(error body unreadable: {_describe(exc)})"
        if status in AUTH_STATUSES:
            self._metrics.error("auth")
            raise ProviderError(
                f"provider {name!r} rejected the request ({status}): "
                f"check the api_key for provider {name!r}",
                details=detail,
            )
        if is_retryable_status(status):
            return _Retry(
                kind=status_kind(status),
                reason=f"HTTP {status}: {detail}",
                message=(
                    f"provider {name!r} kept failing ({status}: {detail}) after "
                    f"{self.settings.max_retries} retries; try again later or raise max_retries"
                ),
                retry_after=parse_retry_after(response.headers),
            )
        self._metrics.error(status_kind(status))
        hint = ""
        if status == 404:
            hint = f"; check base_url for provider {name!r} ({url}) and the model id"
        raise ProviderError(
            f"provider {name!r} refused the request ({status}): {detail}{hint}", details=detail
        )

    async def _next_chunk(self, chunks: AsyncIterator[bytes]) -> bytes | None:
        """The next body chunk, or None at the end (chunk timeout, errors translated)."""
        if self._read_timeout:  # the reader times each read: no scope of our own per chunk
            try:
                return await anext(chunks)
            except StopAsyncIteration:
                return None
            except (httpx.ReadTimeout, BodyTimeout):
                raise self._stalled() from None
            except (httpx.HTTPError, IncompleteBody) as exc:
                raise self._broken(exc) from exc
            except BodyError as exc:
                raise self._malformed_body(exc) from exc
        chunk: bytes | None = None
        with trio.move_on_after(self.settings.chunk_timeout) as scope:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                return None
            except (httpx.HTTPError, IncompleteBody) as exc:
                raise self._broken(exc) from exc
            except BodyError as exc:
                raise self._malformed_body(exc) from exc
        if scope.cancelled_caught:
            raise self._stalled()
        return chunk

    def _broken(self, exc: Exception) -> ProviderError:
        self._metrics.error("broken")
        return ProviderError(
            f"provider {self.provider!r} closed the connection mid-stream: {_describe(exc)}",
            retryable=True,
        )

    def _malformed_body(self, exc: BodyError) -> ProviderError:
        self._metrics.error("protocol")
        return ProviderError(
            f"provider {self.provider!r} sent a malformed HTTP body: {exc}; "
            "the connection was closed",
            retryable=True,
        )

    def _stalled(self) -> ProviderError:
        self._metrics.error("timeout")
        name = self.provider
        return ProviderError(
            f"provider {name!r} stalled mid-stream: nothing for chunk_timeout="
            f"{self.settings.chunk_timeout:g}s; raise chunk_timeout for provider {name!r} "
            "if the model pauses that long",
            retryable=True,
        )

    def _decode(self, decoder: SSEDecoder, chunk: bytes | None) -> list[SSEEvent]:
        try:
            return decoder.feed(chunk) if chunk is not None else decoder.close()
        except ValueError as exc:
            self._metrics.error("protocol")
            raise ProviderError(f"provider {self.provider!r} sent a malformed stream: {exc}")

    async def _drain(self, chunks: AsyncIterator[bytes]) -> None:
        with trio.move_on_after(DRAIN_TIMEOUT):
            with contextlib.suppress(httpx.HTTPError, BodyError, BodyTimeout, IncompleteBody):
                async for _ in chunks:
                    pass


def _whole_events(
    decoder: SSEDecoder, is_final: Callable[[SSEEvent], bool], payload: bytes
) -> list[SSEEvent] | None:
    """The event-stream stage of a stream's :class:`~crush_trio.providers.body.ReadFold`:
    ``payload``'s events when they are whole and none ends the stream."""
    events = decoder.take_whole(payload)
    if events is None or any(is_final(event) for event in events):
        return None
    return events


async def _read_limited(response: httpx.Response) -> bytes:
    """Up to :data:`MAX_ERROR_BODY_BYTES` of the body."""
    parts: list[bytes] = []
    size = 0
    iterator = response.aiter_bytes()
    try:
        async for chunk in iterator:
            parts.append(chunk)
            size += len(chunk)
            if size >= MAX_ERROR_BODY_BYTES:
                break
    finally:
        await _aclose_iter(iterator)
    return b"".join(parts)[:MAX_ERROR_BODY_BYTES]


async def _aclose_iter(iterator: AsyncIterator[bytes]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
