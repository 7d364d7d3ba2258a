"""The providers' HTTP/1.1 transport (crush_trio/providers/transport.py): its pool, its requests
and TLS, against a real fake server.

Each test runs tests/fake_llm.py in its nursery on 127.0.0.1:0 (over TLS with a test authority
from ``trustme`` where it says so) and sends requests through an ``httpx.AsyncClient`` over an
:class:`Http11Transport`, as the providers do. Malformed and hostile servers:
tests/test_provider_transport_hostile.py.
"""

from __future__ import annotations

import contextlib
import ssl
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio
import trio.testing
import trustme

from crush_trio.providers.body import READ_PACER
from crush_trio.providers.pool import shared_ssl_context
from crush_trio.providers.transport import (
    ONE_SEND_BYTES,
    Connection,
    Http11Transport,
    parse_head,
    request_head,
)
from tests.fake_llm import FakeLLM, Fault, Reply

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

#: Bound on every wait of these tests (seconds; real sockets on loopback).
WAIT = 10.0
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@contextlib.asynccontextmanager
async def pooled(
    fake: FakeLLM, *, max_connections: int, ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[httpx.AsyncClient, Http11Transport, str]]:
    async with trio.open_nursery() as nursery:
        url = await nursery.start(fake.serve)
        transport = Http11Transport(
            ssl_context=ssl_context or shared_ssl_context(),
            max_connections=max_connections,
            keepalive_expiry=30.0,
        )
        async with httpx.AsyncClient(transport=transport) as client:
            yield client, transport, url + "/v1/chat/completions"
        nursery.cancel_scope.cancel()


def test_the_connection_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_connections must be at least 1"):
        Http11Transport(ssl_context=shared_ssl_context(), max_connections=0, keepalive_expiry=1)


def test_a_request_head_is_the_request_line_and_the_headers() -> None:
    request = httpx.Request("POST", "http://h:8/v1/x?q=1", headers={"x-a": "b"}, content=b"{}")
    head = request_head(request)
    assert head.startswith(b"POST /v1/x?q=1 HTTP/1.1\r\n")
    assert b"\r\nhost: h:8\r\n" in head.lower()
    assert b"\r\nx-a: b\r\n" in head
    assert b"\r\ncontent-length: 2\r\n" in head.lower()
    assert head.endswith(b"\r\n\r\n")


def test_a_response_head_is_parsed_with_lower_case_names() -> None:
    head = parse_head(b"HTTP/1.1 429 Too Many\r\nRetry-After: 3\r\nX-A:  b \r\nx-a: c")
    assert (head.minor, head.status, head.reason) == (1, 429, b"Too Many")
    assert head.values(b"x-a") == [b"b", b"c"]
    assert head.values(b"retry-after") == [b"3"]
    assert parse_head(b"HTTP/1.0 200").reason == b""


async def test_finished_replies_reuse_their_connections() -> None:
    fake = FakeLLM(default=Reply(text="one two"))
    async with pooled(fake, max_connections=4) as (client, transport, url):
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
        assert transport.open_connections == 4
        assert transport.idle_connections == 4


async def test_the_connection_limit_holds_and_a_closed_response_frees_a_place() -> None:
    fake = FakeLLM(default=Reply(text="a b", fault=Fault.HANG, fault_after=1))
    async with pooled(fake, max_connections=4) as (client, transport, url):
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
                assert fake.request_count == 4  # waiting for a connection
                assert transport.open_connections == 4
                await first[0].aclose()  # not read whole: its connection is closed
            with trio.fail_after(WAIT):
                await fake.wait_for_requests(5)
            stack.push_async_callback(fifth[0].aclose)
            assert fifth[0].status_code == 200
            assert transport.open_connections == 4
        assert fake.connections == 5
        assert transport.open_connections == 0


async def test_a_failed_or_cancelled_request_frees_its_place() -> None:
    fake = FakeLLM(default=Reply(fault=Fault.HANG_BEFORE_HEADERS))
    async with pooled(fake, max_connections=1) as (client, transport, url):
        for _ in range(2):  # the second would wait forever for a leaked place
            with trio.move_on_after(WAIT) as waiting:
                async with trio.open_nursery() as nursery:

                    async def send() -> None:
                        await client.send(client.build_request("POST", url, json=BODY), stream=True)

                    nursery.start_soon(send)
                    await fake.wait_for_requests(fake.request_count + 1)
                    assert transport.open_connections == 1
                    nursery.cancel_scope.cancel()
            assert not waiting.cancelled_caught
            assert transport.open_connections == 0

        # A refused connection: the listening socket of a closed server.
        with trio.socket.socket() as sock:
            await sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        with pytest.raises(httpx.ConnectError):
            await client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=BODY)
        assert transport.open_connections == 0


async def test_another_origins_idle_connection_is_closed_to_make_room() -> None:
    one, two = FakeLLM(default=Reply(text="x")), FakeLLM(default=Reply(text="y"))
    async with pooled(one, max_connections=1) as (client, transport, url):
        async with trio.open_nursery() as nursery:
            other = await nursery.start(two.serve) + "/v1/chat/completions"
            assert (await client.post(url, json=BODY)).status_code == 200
            assert transport.idle_connections == 1
            with trio.fail_after(WAIT):
                assert (await client.post(other, json=BODY)).status_code == 200
            assert (transport.open_connections, transport.idle_connections) == (1, 1)
            nursery.cancel_scope.cancel()


async def test_a_closed_transport_closes_its_idle_connections_and_refuses_requests() -> None:
    fake = FakeLLM(default=Reply(text="one"))
    async with pooled(fake, max_connections=2) as (client, transport, url):
        assert (await client.post(url, json=BODY)).status_code == 200
        await transport.aclose()
        assert (transport.open_connections, transport.idle_connections) == (0, 0)
        with pytest.raises(httpx.ConnectError, match="closed"):
            await client.post(url, json=BODY)


@pytest.fixture(scope="module")
def authority() -> trustme.CA:
    return trustme.CA()


async def test_https_requests_verify_the_server_and_reuse_the_connection(
    authority: trustme.CA,
) -> None:
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1").configure_cert(server_context)
    client_context = ssl.create_default_context()
    authority.configure_trust(client_context)
    fake = FakeLLM(default=Reply(text="over tls"), ssl_context=server_context)
    async with pooled(fake, max_connections=2, ssl_context=client_context) as (
        client,
        transport,
        url,
    ):
        url = url.replace("http://", "https://")
        for _ in range(3):
            response = await client.post(url, json=BODY)
            assert response.status_code == 200
            assert b"over" in response.content
        assert fake.connections == 1
        assert transport.idle_connections == 1

        # A client that does not trust the authority refuses the server.
        strict = Http11Transport(
            ssl_context=ssl.create_default_context(), max_connections=1, keepalive_expiry=1
        )
        async with httpx.AsyncClient(transport=strict) as untrusting:
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await untrusting.post(url, json=BODY)
        assert strict.open_connections == 0


def test_providers_load_the_trust_store_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every provider uses one TLS context: the trust store is loaded once per process (about
    50 ms of CPU each time)."""
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


class FakePacer:
    """A read pacer that releases each wait when told, and records the empty reads."""

    def __init__(self) -> None:
        self.release = trio.Event()
        self.waits = 0
        self.empty = 0

    async def before_read(self, read_now: object = None) -> bool:
        self.waits += 1
        await self.release.wait()
        self.release = trio.Event()
        return True

    def taken(self) -> None:
        return None

    def read_empty(self) -> None:
        self.empty += 1


async def test_a_paced_read_reads_first_after_its_wait_and_waits_for_data_when_empty() -> None:
    """After the pacer's wait the connection is read at once (what arrived meanwhile, in one
    read); a read that finds nothing is told to the pacer and waits for the socket."""
    left, right = trio.socket.socketpair()
    connection = Connection(("http", "x", 80), trio.SocketStream(left), left.fileno())
    pacer = FakePacer()
    token = READ_PACER.set(pacer)
    try:
        with trio.fail_after(WAIT):
            async with trio.open_nursery() as nursery:
                got: list[bytes] = []

                async def read() -> None:
                    got.append(await connection.read())

                nursery.start_soon(read)
                await trio.testing.wait_all_tasks_blocked()
                await right.send(b"t1 ")
                await right.send(b"t2 ")
                await trio.testing.wait_all_tasks_blocked()
                assert got == []  # the pacer holds the read, however much arrived
                pacer.release.set()
            assert got == [b"t1 t2 "]
            assert pacer.empty == 0

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                await trio.testing.wait_all_tasks_blocked()
                pacer.release.set()  # nothing has arrived: the read waits for the socket
                await trio.testing.wait_all_tasks_blocked()
                assert pacer.empty == 1
                assert got == [b"t1 t2 "]
                await right.send(b"t3 ")
            assert got == [b"t1 t2 ", b"t3 "]
            assert pacer.waits == 2
    finally:
        READ_PACER.reset(token)
        left.close()
        right.close()


async def test_a_response_head_is_read_without_waiting_for_the_pacer() -> None:
    fake = FakeLLM(default=Reply(text="one"))
    pacer = FakePacer()  # never released: a paced read would hang
    async with pooled(fake, max_connections=1) as (client, transport, url):
        token = READ_PACER.set(pacer)
        try:
            with trio.fail_after(WAIT):
                response = await client.send(
                    client.build_request("POST", url, json=BODY), stream=True
                )
                assert response.status_code == 200
                await response.aclose()
        finally:
            READ_PACER.reset(token)
        assert pacer.waits == 0


@pytest.mark.parametrize("size", [10, ONE_SEND_BYTES - 200, ONE_SEND_BYTES + 1, 300_000])
async def test_a_request_body_of_any_size_arrives_whole(size: int) -> None:
    """Small bodies go out in one send with their head, large ones after it; one larger than
    the socket takes at once goes out in part directly, the rest as the socket drains."""
    fake = FakeLLM(default=Reply(text="ok"))
    body = {**BODY, "messages": [{"role": "user", "content": "x" * size}]}
    async with pooled(fake, max_connections=1) as (client, _transport, url):
        with trio.fail_after(WAIT):
            assert (await client.post(url, json=body)).status_code == 200
    assert fake.requests[-1].body == body
