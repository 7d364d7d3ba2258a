"""Connection handling: what a hostile or unlucky peer can do to one connection, and that it
cannot reach further (docs/protocol.md "Connection handling").

Every test runs a real server on a free port and talks to it with raw trio sockets (or httpx where
a client library's connection reuse is the point). Raw requests send a loopback ``Host`` and
``Content-Type: application/json`` with JSON bodies, as a browser-safe client would.
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import socket
import statistics
import struct
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio
import trio.testing
import trio_websocket
from trio_websocket import ConnectionClosed, open_websocket_url

from crush_trio.server import dispatch, ws_trio
from crush_trio.server import head as request_head
from crush_trio.server.head import HEAD_LIMIT
from crush_trio.server.listener import contained
from crush_trio.server.routes import events as app_module

from .conftest import TOKEN, WAIT, Server, running_server

if TYPE_CHECKING:
    from collections.abc import Iterator

#: Connections held open with a partial head in the slowloris test.
SLOWLORIS_CONNECTIONS = 2000
#: Health checks measured while they are held.
HEALTH_SAMPLES = 50


def port_of(server: Server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def host(server: Server) -> bytes:
    return f"127.0.0.1:{port_of(server)}".encode()


def upgrade_head(server: Server, path: bytes, **replace: bytes) -> bytes:
    """A websocket upgrade head to ``path``; ``replace`` swaps header values (``Sec_WebSocket_Key``
    for ``Sec-WebSocket-Key``)."""
    headers = {
        "Host": host(server),
        "Upgrade": b"websocket",
        "Connection": b"Upgrade",
        "Sec-WebSocket-Key": b"dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version": b"13",
    }
    for name, value in replace.items():
        headers[name.replace("_", "-")] = value
    lines = [b"GET " + path + b" HTTP/1.1"] + [k.encode() + b": " + v for k, v in headers.items()]
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def exchange(server: Server, data: bytes) -> bytes:
    """Send ``data`` on a new connection and read until the server closes it (bounded)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port_of(server))
    async with stream:
        await stream.send_all(data)
        received = b""
        with trio.fail_after(WAIT):
            while chunk := await stream.receive_some(65536):
                received += chunk
        return received


def status_of(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1."), answer[:200]
    return int(answer.split(b" ", 2)[1])


def body_of(answer: bytes) -> dict[str, Any]:
    return dict(json.loads(answer.split(b"\r\n\r\n", 1)[1]))


async def assert_healthy(server: Server) -> None:
    with trio.fail_after(WAIT):
        r = await server.http.get("/v1/health")
    assert r.status_code == 200


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def reset(stream: trio.SocketStream) -> None:
    """Make the next close of ``stream`` a reset (RST) instead of an orderly FIN."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


#: A connection whose peer has left ends within this many seconds (its task freed): well below
#: the endpoint's handshake timeout and hypercorn's timeouts, which must not be what ends it.
CONNECTION_END_BOUND = 3.0


@contextlib.contextmanager
def watch_connection_ends(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[int, trio.Event]]:
    """Events set when the server's handler of a connection ends, by the client's local port
    (create the event before connecting)."""
    ended: dict[int, trio.Event] = {}
    real_contained = dispatch.contained

    @contextlib.asynccontextmanager
    async def contained_watched(stream: Any, what: str = "connection") -> Any:
        try:
            port = stream.socket.getpeername()[1]
        except (OSError, AttributeError):
            port = None
        try:
            async with real_contained(stream, what):
                yield
        finally:
            if what == "connection" and port in ended:
                ended[port].set()

    monkeypatch.setattr(dispatch, "contained", contained_watched)
    yield ended


async def leave(server: Server, data: bytes, how: str, ended: dict[int, trio.Event]) -> float:
    """Send ``data`` on a new connection and leave (``fin``: half-close, then read the answer;
    ``close`` or ``reset``: without reading); return how long the server's handler of that
    connection took to end from then."""
    stream = await trio.open_tcp_stream("127.0.0.1", port_of(server))
    async with stream:
        done = ended[stream.socket.getsockname()[1]] = trio.Event()
        await stream.send_all(data)
        start = trio.current_time()
        if how == "fin":
            await stream.send_eof()
        if how == "reset":
            reset(stream)
        if how != "fin":
            await stream.aclose()
        with trio.fail_after(WAIT):
            await done.wait()
        return trio.current_time() - start


# -- head checks ------------------------------------------------------------------------------


async def test_non_ascii_host_on_a_websocket_upgrade_is_400_and_the_server_stays_up(
    server: Server,
) -> None:
    head = upgrade_head(server, b"/v1/workspaces/x/ws", Host=b"127.0.0.1\xff")
    answer = await exchange(server, head)
    assert status_of(answer) == 400
    assert "Host" in body_of(answer)["message"]
    await assert_healthy(server)


@pytest.mark.parametrize(
    "header", ["Connection", "Upgrade", "Sec_WebSocket_Key", "Sec_WebSocket_Version"]
)
async def test_non_ascii_in_handshake_headers_is_400(server: Server, header: str) -> None:
    head = upgrade_head(server, b"/v1/workspaces/x/ws", **{header: b"\xc3\xa9t\xe9"})
    answer = await exchange(server, head)
    assert status_of(answer) == 400
    assert header.replace("_", "-") in body_of(answer)["message"]
    await assert_healthy(server)


@pytest.mark.parametrize("upgrade", [False, True], ids=["http", "websocket"])
async def test_non_ascii_host_on_a_later_request_of_a_connection_is_400(
    server: Server, upgrade: bool
) -> None:
    first = b"GET /v1/health HTTP/1.1\r\nHost: " + host(server) + b"\r\n\r\n"
    if upgrade:
        path = f"/v1/workspaces/x/ws?token={TOKEN}".encode()
        second = upgrade_head(server, path, Host=b"127.0.0.1\xff")
    else:
        second = b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\xff\r\n\r\n"
    stream = await trio.open_tcp_stream("127.0.0.1", port_of(server))
    async with stream:
        await stream.send_all(first + second)
        answer = b""
        with trio.fail_after(WAIT):
            while answer.count(b"HTTP/1.1 ") < 2 or not answer.endswith(b"}"):
                chunk = await stream.receive_some(65536)
                assert chunk, answer
                answer += chunk
    assert b"HTTP/1.1 400 " in answer
    assert b"not printable ASCII" in answer
    await assert_healthy(server)


@pytest.mark.parametrize("bad_host", [b"127..0.0.1", b"." + b"a" * 64 + b".example"])
async def test_a_host_the_router_cannot_encode_is_400(
    server: Server, bad_host: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    first = b"GET /v1/health HTTP/1.1\r\nHost: " + host(server) + b"\r\n\r\n"
    later = b"GET /v1/health HTTP/1.1\r\nHost: " + bad_host + b"\r\n\r\n"
    for head in (later, first + later):  # first of a connection, and later on one
        answer = await exchange(server, head)
        assert b"HTTP/1.1 400 " in answer
        assert b"not a valid host name" in answer
    assert warnings_of(caplog) == []


async def test_a_websocket_upgrade_to_another_path_is_404_without_errors(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    answer = await exchange(server, upgrade_head(server, f"/v1/health?token={TOKEN}".encode()))
    assert status_of(answer) == 404
    assert "/v1/workspaces/{wid}/ws" in body_of(answer)["message"]
    assert warnings_of(caplog) == []


@pytest.mark.parametrize(
    "line", [b"GET /v1/health", b"GET /v1/h\xffealth HTTP/1.1", b"\x16\x03\x01 / HTTP/1.1"]
)
async def test_a_malformed_request_line_is_400(server: Server, line: bytes) -> None:
    answer = await exchange(server, line + b"\r\nHost: " + host(server) + b"\r\n\r\n")
    assert status_of(answer) == 400
    assert "request line" in body_of(answer)["message"]


async def test_a_head_longer_than_the_limit_is_431(server: Server) -> None:
    filler = b"X-Filler: " + b"a" * 1000 + b"\r\n"
    head = b"GET /v1/health HTTP/1.1\r\nHost: " + host(server) + b"\r\n"
    head += filler * (HEAD_LIMIT // len(filler) + 2) + b"\r\n"
    answer = await exchange(server, head)
    assert status_of(answer) == 431
    assert "HEAD_LIMIT" in body_of(answer)["message"]
    await assert_healthy(server)


async def test_a_head_that_does_not_complete_in_time_is_408(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(request_head, "HEAD_TIMEOUT", 0.2)
    answer = await exchange(server, b"GET /v1/health HTTP/1.1\r\nHost: ")
    assert status_of(answer) == 408
    assert "HEAD_TIMEOUT" in body_of(answer)["message"]


async def test_the_asgi_transport_goes_through_the_head_checks(tmp_path: Path) -> None:
    config = tmp_path / "crush.json"
    config.write_text(json.dumps({"server": {"ws_transport": "asgi"}}))
    async with running_server(tmp_path, config_file=config) as server:
        head = upgrade_head(server, b"/v1/workspaces/x/ws", Host=b"127.0.0.1\xff")
        assert status_of(await exchange(server, head)) == 400
        await assert_healthy(server)


# -- containment ------------------------------------------------------------------------------


async def test_an_exception_in_a_connection_closes_it_with_one_warning(
    server: Server, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken_handshake(*args: Any, **kwargs: Any) -> Any:
        raise UnicodeDecodeError("ascii", b"\xff", 0, 1, "a library choked on the handshake")

    monkeypatch.setattr(ws_trio, "wrap_server_stream", broken_handshake)
    caplog.set_level(logging.WARNING)
    answer = await exchange(server, upgrade_head(server, b"/v1/workspaces/x/ws"))
    assert answer == b""  # closed, nothing written
    await assert_healthy(server)
    records = warnings_of(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    assert "UnicodeDecodeError" in records[0].getMessage()
    assert records[0].exc_info is None  # one line, no traceback


async def test_contained_lets_cancellation_through() -> None:
    left, right = trio.testing.memory_stream_pair()
    with trio.CancelScope() as scope:
        async with contained(right):
            scope.cancel()
            await trio.sleep_forever()
    assert scope.cancelled_caught
    with pytest.raises(trio.ClosedResourceError):
        await right.send_all(b"x")  # closed on the way out all the same


@pytest.mark.parametrize("step", ["reject", "accept"])
async def test_a_client_that_resets_during_the_upgrade_answer_ends_only_its_connection(
    server: Server,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    step: str,
) -> None:
    original = getattr(trio_websocket.WebSocketRequest, step)

    async def reset_while_writing(self: Any, *args: Any, **kwargs: Any) -> Any:
        socket_stream = self._connection._stream.transport  # the PrefixedStream's socket
        reset(socket_stream)
        await socket_stream.aclose()
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(trio_websocket.WebSocketRequest, step, reset_while_writing)
    caplog.set_level(logging.WARNING)
    ws = await server.open_workspace()
    path = f"/v1/workspaces/{ws['id']}/ws?client_id={uuid.uuid4()}"
    if step == "accept":
        path += f"&token={TOKEN}"  # accepted; without the token: refused with 401
    stream = await trio.open_tcp_stream("127.0.0.1", port_of(server))
    async with stream:
        await stream.send_all(upgrade_head(server, path.encode()))
        with trio.fail_after(WAIT), contextlib.suppress(trio.BrokenResourceError):
            while await stream.receive_some(65536):
                pass  # until the reset (or EOF)
    await assert_healthy(server)
    assert warnings_of(caplog) == []


@pytest.mark.parametrize("how", ["fin", "close", "reset"])
@pytest.mark.parametrize(
    ("header", "value", "status"),
    [("Sec-WebSocket-Version", b"12", 426), ("Connection", b"keep-alive", 400)],
)
async def test_a_refused_upgrade_frees_its_connection_at_once(
    server: Server,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
    header: str,
    value: bytes,
    status: int,
) -> None:
    path = f"/v1/workspaces/{uuid.uuid4()}/ws?client_id={uuid.uuid4()}&token={TOKEN}".encode()
    head = upgrade_head(server, path, **{header.replace("-", "_"): value})
    with watch_connection_ends(monkeypatch) as ended:
        took = await leave(server, head, how, ended)
    assert took < CONNECTION_END_BOUND < ws_trio.HANDSHAKE_TIMEOUT
    answer = await exchange(server, head)  # the refusal itself, to a client that reads it
    assert status_of(answer) == status
    if status == 426:
        assert b"\r\nsec-websocket-version: 13\r\n" in answer.lower()
    await assert_healthy(server)


async def test_a_workspace_closing_during_the_upgrade_closes_the_websocket_with_1001(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    opener = str(uuid.uuid4())
    info = await server.open_workspace(client_id=opener)
    ws = server.backend.get(info["id"])
    original = trio_websocket.WebSocketRequest.accept

    async def accept_then_close(self: Any, *args: Any, **kwargs: Any) -> Any:
        conn = await original(self, *args, **kwargs)
        server.backend.release(ws.id, opener)
        with trio.fail_after(WAIT):
            await ws.closed.wait()
        return conn

    monkeypatch.setattr(trio_websocket.WebSocketRequest, "accept", accept_then_close)
    with trio.fail_after(WAIT):
        async with open_websocket_url(server.ws_url(ws.id, str(uuid.uuid4()))) as conn:
            with pytest.raises(ConnectionClosed) as closed:
                await conn.get_message()
    assert closed.value.reason is not None
    assert closed.value.reason.code == 1001
    await assert_healthy(server)


# -- keep-alive and close ---------------------------------------------------------------------


def _unread_body_routes(wid: str, sid: str) -> Iterator[tuple[str, str, int, bool]]:
    """(method, path, status, with token) of answers the server gives without reading the body."""
    yield "POST", "/v1/workspaces/nope/agent/sessions/s/cancel", 404, True
    yield "POST", f"/v1/workspaces/{wid}/agent/sessions/{sid}/cancel", 200, True
    yield "POST", f"/v1/workspaces/{wid}/agent/sessions/{sid}/prompts/clear", 200, True
    yield "POST", "/v1/nothing-here", 404, True
    yield "POST", "/v1/health", 405, True
    yield "POST", f"/v1/workspaces/{wid}/agent/sessions/{sid}/cancel", 401, False


async def test_an_answer_sent_before_the_body_was_read_leaves_the_client_working(
    server: Server,
) -> None:
    info = await server.open_workspace()
    session = await server.create_session(info["id"])
    body = b'{"pad": "' + b"x" * 1_000_000 + b'"}'
    for method, path, status, with_token in _unread_body_routes(info["id"], session["id"]):
        headers = {"Content-Type": "application/json"}
        if with_token:
            headers["Authorization"] = f"Bearer {TOKEN}"
        async with httpx.AsyncClient(base_url=server.url, timeout=WAIT) as client:
            for _ in range(3):
                r = await client.request(method, path, content=body, headers=headers)
                assert r.status_code == status, (path, r.text)
                health = await client.get("/v1/health")
                assert health.status_code == 200, path


async def test_no_socket_is_left_in_close_wait_after_an_early_answer(server: Server) -> None:
    port = port_of(server)
    for _ in range(5):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        head = (
            b"POST /v1/nothing-here HTTP/1.1\r\nHost: " + host(server) + b"\r\n"
            b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
        )
        await stream.send_all(head + b"x" * 100_000)
        answer = b""
        with trio.fail_after(WAIT):
            while b"\r\n\r\n" not in answer:
                answer += await stream.receive_some(65536)
        assert status_of(answer) == 404
        assert b"connection: close" in answer.lower()
        await stream.aclose()  # the rest of the body never comes
    with trio.fail_after(WAIT):
        while _close_wait_sockets(port):
            # The kernel's state: nothing in trio to wait on, so poll it between quiet moments.
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)


def _close_wait_sockets(port: int) -> int:
    """Sockets of this host in CLOSE-WAIT whose local port is ``port`` (Linux /proc)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "08":
                count += 1
    return count


@pytest.mark.parametrize(
    "request_head",
    [
        b"GET /v1/health HTTP/1.0\r\nHost: {host}\r\n\r\n",
        b"GET /v1/health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n",
        b"GET /v1/health HTTP/1.1\r\nHost: {host}\r\n\r\n"
        b"GET /v1/health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n",
    ],
    ids=["http-1.0", "connection-close", "pipelined-then-close"],
)
async def test_connection_close_is_honoured(server: Server, request_head: bytes) -> None:
    answer = await exchange(server, request_head.replace(b"{host}", host(server)))
    assert answer.count(b"HTTP/1.1 200") == request_head.count(b"GET ")


async def test_a_413_then_close_logs_no_busy_resource_error(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    head = (
        b"POST /v1/workspaces HTTP/1.1\r\nHost: " + host(server) + b"\r\n"
        b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: 5000000\r\n\r\n"
    )
    for _ in range(20):
        stream = await trio.open_tcp_stream("127.0.0.1", port_of(server))
        await stream.send_all(head)
        with trio.fail_after(WAIT):
            answer = await stream.receive_some(65536)
        assert status_of(answer) == 413
        await stream.aclose()
    await assert_healthy(server)
    await trio.testing.wait_all_tasks_blocked(cushion=0.2)
    assert [r.getMessage() for r in warnings_of(caplog)] == []


@pytest.mark.parametrize("how", ["close", "reset"])
@pytest.mark.parametrize("second", ["whole", "partial"])
async def test_pipelined_requests_from_a_client_that_leaves_free_their_connection(
    server: Server, monkeypatch: pytest.MonkeyPatch, how: str, second: str
) -> None:
    health = b"GET /v1/health HTTP/1.1\r\nHost: " + host(server) + b"\r\n\r\n"
    follow = health if second == "whole" else b"POST /v1/control HTTP/1.1\r\nHost: h\r\nCont"
    with watch_connection_ends(monkeypatch) as ended:
        for _ in range(3):  # the hold depended on timing: a few tries
            took = await leave(server, health + follow, how, ended)
            assert took < CONNECTION_END_BOUND
    await assert_healthy(server)


# -- event streams ----------------------------------------------------------------------------


async def test_an_sse_stream_that_never_starts_leaves_no_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The app's route (``ws_transport: "asgi"``; also what serves an event stream pipelined
    behind another answer)."""
    real_serve_sse = app_module.serve_sse  # type: ignore[attr-defined]

    async def fails_before_the_body(*args: Any) -> Any:
        await real_serve_sse(*args)
        raise ConnectionResetError("the client left before the body started")

    monkeypatch.setattr(app_module, "serve_sse", fails_before_the_body)
    config = tmp_path / "asgi.json"
    config.write_text('{"server": {"ws_transport": "asgi"}}')
    async with running_server(tmp_path, config_file=config) as server:
        opener = str(uuid.uuid4())
        info = await server.open_workspace(client_id=opener)
        r = await server.http.get(
            f"/v1/workspaces/{info['id']}/events", params={"client_id": str(uuid.uuid4())}
        )
        assert r.status_code == 500
        ws = server.backend.get(info["id"])
        server.backend.release(ws.id, opener)
        with trio.fail_after(WAIT):
            await ws.closed.wait()


# -- slowloris --------------------------------------------------------------------------------


@pytest.mark.slow
async def test_idle_half_open_connections_leave_health_fast(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * SLOWLORIS_CONNECTIONS + 500  # both ends live in this process
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {needed}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    monkeypatch.setattr(request_head, "HEAD_TIMEOUT", 120.0)  # they stay for the whole measurement
    port = port_of(server)
    partial_head = b"GET /v1/health HTTP/1.1\r\nHost: " + host(server) + b"\r\nX-Slow: "
    held: list[trio.SocketStream] = []
    health = b"GET /v1/health HTTP/1.1\r\nHost: " + host(server) + b"\r\nConnection: close\r\n\r\n"
    try:
        with trio.fail_after(120):
            for _ in range(SLOWLORIS_CONNECTIONS):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                held.append(stream)
                await stream.send_all(partial_head)
            await trio.testing.wait_all_tasks_blocked(cushion=0.1)
            latencies = []
            for _ in range(HEALTH_SAMPLES):
                start = trio.current_time()
                answer = await exchange(server, health)
                latencies.append(trio.current_time() - start)
                assert status_of(answer) == 200
    finally:
        for stream in held:
            reset(stream)
            await stream.aclose()
    median = statistics.median(latencies)
    print(
        f"health with {SLOWLORIS_CONNECTIONS} half-open connections: "
        f"median {median * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms"
    )
    assert median < 0.1
