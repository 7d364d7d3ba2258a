"""An ``httpx`` transport made of several small connection pools.

``httpcore``'s connection pool does its bookkeeping by scanning every connection for every
queued request whenever a request starts or a response closes, and while scanning it counts the
connections once more for each idle one. With ``C`` kept-alive connections a request start costs
``O(C²)`` checks: at 50 concurrent model streams to one provider this was a third of the server's
CPU during a burst of run starts, and at 200 streams most of it.

:class:`ShardedTransport` keeps the same total limits but splits them over shards of at most
:data:`SHARD_CONNECTIONS` connections, each a plain ``httpx.AsyncHTTPTransport``, and sends each
request to the shard with the fewest requests in flight. The quadratic work is then bounded by
the shard size, and nothing private of ``httpx`` or ``httpcore`` is touched.

Every shard, and every provider, uses the one TLS context of :func:`shared_ssl_context`:
building one loads the trust store, about 50 ms of CPU, which a transport per shard would pay
once per shard on a workspace's first model request, blocking the event loop.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING, Final

import attrs
import httpx

if TYPE_CHECKING:
    import ssl
    from collections.abc import AsyncIterator

log = logging.getLogger(__name__)

#: Most connections of one shard: the bound on the pool's per-request bookkeeping.
SHARD_CONNECTIONS: Final = 8


@functools.cache
def shared_ssl_context() -> ssl.SSLContext:
    """The process's TLS context for model providers: certificate verification on, the trust
    store from the environment as ``httpx`` reads it (``SSL_CERT_FILE``, ``SSL_CERT_DIR``) or
    ``certifi``. Built on first use and kept; call it from a thread to keep the load off the
    event loop (the server does so at start-up)."""
    return httpx.create_ssl_context()


def warm_ssl_context() -> None:
    """Build :func:`shared_ssl_context` ahead of the first model request (run it in a thread).
    A failure is only logged here: the first provider set up reports it with its own error."""
    try:
        shared_ssl_context()
    except Exception as exc:
        log.warning("building the providers' TLS context failed: %s", exc)


class ShardedTransport(httpx.AsyncBaseTransport):
    """Requests spread over ``ceil(max_connections / shard_size)`` pools, least busy first.

    Args:
        limits: the limits of the whole transport; each shard gets its share of
            ``max_connections`` and ``max_keepalive_connections`` (rounded up) and the same
            ``keepalive_expiry``.
        shard_size: most connections of one shard.
        verify: the TLS context (or ``httpx``'s ``verify`` value) of every shard; by default
            :func:`shared_ssl_context`.

    A request counts as in flight from its start until its response is closed, so a shard with
    long-running streams is passed over while another has room. Cancellation and errors while
    sending release the request's count at once.
    """

    def __init__(
        self,
        *,
        limits: httpx.Limits,
        shard_size: int = SHARD_CONNECTIONS,
        verify: ssl.SSLContext | bool | None = None,
    ) -> None:
        if shard_size < 1:
            raise ValueError(f"shard_size must be at least 1, not {shard_size}")
        total = limits.max_connections
        count = 1 if total is None else max(1, math.ceil(total / shard_size))

        def share(value: int | None) -> int | None:
            return None if value is None else max(1, math.ceil(value / count))

        shard_limits = httpx.Limits(
            max_connections=share(total),
            max_keepalive_connections=share(limits.max_keepalive_connections),
            keepalive_expiry=limits.keepalive_expiry,
        )
        tls = shared_ssl_context() if verify is None else verify
        self._shards = [
            httpx.AsyncHTTPTransport(limits=shard_limits, verify=tls) for _ in range(count)
        ]
        self._in_flight = [0] * count

    @property
    def in_flight(self) -> list[int]:
        """Requests in flight per shard (a copy; for tests and diagnostics)."""
        return list(self._in_flight)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        index = min(range(len(self._shards)), key=self._in_flight.__getitem__)
        self._in_flight[index] += 1
        release = _Release(self._in_flight, index)
        try:
            response = await self._shards[index].handle_async_request(request)
        except BaseException:
            release()
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(
            status_code=response.status_code,
            headers=response.headers,
            stream=ReleasingStream(response.stream, release),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        for shard in self._shards:
            await shard.aclose()


@attrs.define
class _Release:
    """Decrements a shard's in-flight count, once."""

    counts: list[int]
    index: int
    done: bool = False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            self.counts[self.index] -= 1


class ReleasingStream(httpx.AsyncByteStream):
    """A response body that releases its request's shard slot when closed."""

    def __init__(self, stream: httpx.AsyncByteStream, release: _Release) -> None:
        self._stream = stream
        self._release = release

    @property
    def inner(self) -> httpx.AsyncByteStream:
        """The shard's own response stream (the body reader below httpx looks through it)."""
        return self._stream

    def __aiter__(self) -> AsyncIterator[bytes]:
        # The body's own iterator, not a generator around it: no extra layer per chunk.
        return self._stream.__aiter__()

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            self._release()
