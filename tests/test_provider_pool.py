"""The providers' sharded connection pool (crush_trio/providers/pool.py) against a real fake server.

Each test runs tests/fake_llm.py in its nursery on 127.0.0.1:0 and sends requests through an
``httpx.AsyncClient`` over a :class:`ShardedTransport`, as the providers do.
"""

from __future__ import annotations

import contextlib
import ssl
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio

from crush_trio.providers.pool import ShardedTransport, shared_ssl_context
from tests.fake_llm import FakeLLM, Fault, Reply

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

#: Bound on every wait of these tests (seconds; real sockets on loopback).
WAIT = 10.0
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@contextlib.asynccontextmanager
async def pooled(
    fake: FakeLLM, *, max_connections: int, shard_size: int
) -> AsyncIterator[tuple[httpx.AsyncClient, ShardedTransport, str]]:
    async with trio.open_nursery() as nursery:
        url = await nursery.start(fake.serve)
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        transport = ShardedTransport(limits=limits, shard_size=shard_size)
        async with httpx.AsyncClient(transport=transport) as client:
            yield client, transport, url + "/v1/chat/completions"
        nursery.cancel_scope.cancel()


def test_shard_count_and_limits_follow_the_total() -> None:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=20)
    transport = ShardedTransport(limits=limits, shard_size=8)
    assert transport.in_flight == [0] * 13
    assert ShardedTransport(limits=httpx.Limits(max_connections=None)).in_flight == [0]
    with pytest.raises(ValueError, match="shard_size must be at least 1"):
        ShardedTransport(limits=limits, shard_size=0)


async def test_streams_go_to_the_least_busy_shard_and_release_it_on_close() -> None:
    fake = FakeLLM(default=Reply(text="a b c", fault=Fault.HANG, fault_after=1))
    async with pooled(fake, max_connections=6, shard_size=2) as (client, transport, url):
        async with contextlib.AsyncExitStack() as stack:
            responses = []
            for expected in ([1, 0, 0], [1, 1, 0], [1, 1, 1], [2, 1, 1]):
                request = client.build_request("POST", url, json=BODY)
                response = await client.send(request, stream=True)
                stack.push_async_callback(response.aclose)
                responses.append(response)
                assert response.status_code == 200
                assert transport.in_flight == expected
            await responses[1].aclose()
            assert transport.in_flight == [2, 0, 1]
            # The freed shard is the least busy one again.
            response = await client.send(client.build_request("POST", url, json=BODY), stream=True)
            stack.push_async_callback(response.aclose)
            assert transport.in_flight == [2, 1, 1]
        assert transport.in_flight == [0, 0, 0]
        assert fake.connections == 5


async def test_finished_replies_reuse_their_connections() -> None:
    fake = FakeLLM(default=Reply(text="one two"))
    async with pooled(fake, max_connections=4, shard_size=2) as (client, transport, url):
        statuses: list[int] = []

        async def post() -> None:
            statuses.append((await client.post(url, json=BODY)).status_code)

        for _ in range(3):
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(post)
        assert statuses == [200] * 12
        assert fake.request_count == 12
        assert fake.connections == 4
        assert transport.in_flight == [0, 0]


async def test_the_total_connection_limit_holds_across_shards() -> None:
    fake = FakeLLM(default=Reply(text="a b", fault=Fault.HANG, fault_after=1))
    async with pooled(fake, max_connections=4, shard_size=2) as (client, transport, url):
        async with contextlib.AsyncExitStack() as stack:
            first = []
            for _ in range(4):
                response = await client.send(
                    client.build_request("POST", url, json=BODY), stream=True
                )
                stack.push_async_callback(response.aclose)
                first.append(response)
            fifth: list[httpx.Response] = []

            async def send_fifth() -> None:
                request = client.build_request("POST", url, json=BODY)
                fifth.append(await client.send(request, stream=True))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_fifth)
                await trio.testing.wait_all_tasks_blocked()
                assert fake.request_count == 4  # waiting for a connection of its shard
                assert transport.in_flight == [3, 2]
                await first[0].aclose()
            with trio.fail_after(WAIT):
                await fake.wait_for_requests(5)
            stack.push_async_callback(fifth[0].aclose)
            assert fifth[0].status_code == 200
            assert transport.in_flight == [2, 2]
        assert fake.connections == 5


async def test_a_failed_or_cancelled_request_releases_its_slot() -> None:
    fake = FakeLLM(default=Reply(fault=Fault.HANG_BEFORE_HEADERS))
    async with pooled(fake, max_connections=4, shard_size=2) as (client, transport, url):
        with trio.move_on_after(WAIT) as waiting:
            async with trio.open_nursery() as nursery:

                async def send() -> None:
                    await client.send(client.build_request("POST", url, json=BODY), stream=True)

                nursery.start_soon(send)
                await fake.wait_for_requests(1)
                assert transport.in_flight == [1, 0]
                nursery.cancel_scope.cancel()
        assert not waiting.cancelled_caught
        assert transport.in_flight == [0, 0]

        # A refused connection: the listening socket of a closed server.
        with trio.socket.socket() as sock:
            await sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with pytest.raises(httpx.ConnectError):
            await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY)
        assert transport.in_flight == [0, 0]


def test_providers_load_the_trust_store_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shard of every provider uses one TLS context: the trust store is loaded once per
    process, not once per shard (about 50 ms of CPU each)."""
    from crush_trio.providers import make_provider
    from crush_trio.providers.http import Settings

    loads: list[ssl.SSLContext] = []
    create = ssl.create_default_context

    def counting(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        loads.append(create(*args, **kwargs))
        return loads[-1]

    monkeypatch.setattr(ssl, "create_default_context", counting)
    shared_ssl_context.cache_clear()
    try:
        for name in ("a", "b"):
            make_provider(
                name, Settings(type="openai-compat", base_url=f"https://{name}.invalid/v1")
            )
        assert len(loads) == 1
        assert loads[0] is shared_ssl_context()
    finally:
        shared_ssl_context.cache_clear()
