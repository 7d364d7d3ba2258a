"""A kept-alive connection routed again between two requests (:mod:`crush_trio.server.dispatch`):
an event stream or an event websocket asked for after other requests on the same connection
(Go's HTTP client reuses idle connections) is served as on a new connection, by the dispatcher's
handlers; requests pipelined behind an answer stay with hypercorn, and still get their answers.

Read with raw sockets, so that which server answered shows on the wire: the dispatcher's event
stream says ``connection: close`` (it ends the connection), the app's route does not.
"""

from __future__ import annotations

import base64
import logging
import os
import tempfile
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio
import trio.testing

from crush_trio.server.head import HEAD_LIMIT, HEAD_TIMEOUT
from crush_trio.server.serve import KEEP_ALIVE_TIMEOUT, serve

from .conftest import TOKEN, WAIT, Server, running_server, serve_options
from .test_connections import assert_healthy, reset
from .test_sse_direct import RawSse, data_of, typed


def request(server: Server, target: str, *extra: str) -> bytes:
    host = server.url.removeprefix("http://")
    lines = [f"GET {target} HTTP/1.1", f"Host: {host}", f"Authorization: Bearer {TOKEN}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def events_target(wid: str) -> str:
    return f"/v1/workspaces/{wid}/events?client_id={uuid.uuid4()}"


async def connect(server: Server) -> trio.SocketStream:
    address, port = server.url.removeprefix("http://").rsplit(":", 1)
    return await trio.open_tcp_stream(address, int(port))


async def read_next_head(raw: RawSse) -> None:
    """The head of the connection's next answer (and its body, when it has a length)."""
    raw.head = []
    with trio.fail_after(WAIT):
        await raw.read_head()


async def read_answer(raw: RawSse) -> Any:
    """One whole answer with a ``content-length`` body, as JSON; the connection stays usable."""
    await read_next_head(raw)
    assert raw.status == 200, raw.body
    assert raw.headers.get("connection") != "close"
    raw.buf = raw.buf[len(raw.body) :]
    return orjson.loads(raw.body)


async def after_one_answer(server: Server) -> tuple[trio.SocketStream, RawSse]:
    """A new connection that asked for the workspace list and read its answer."""
    stream = await connect(server)
    try:
        raw = RawSse(stream)
        await stream.send_all(request(server, "/v1/workspaces"))
        await read_answer(raw)
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return stream, raw


async def stream_after(
    server: Server, wid: str, first: list[bytes], *, gzip: bool = False
) -> tuple[RawSse, trio.SocketStream]:
    """A connection that sent the requests ``first`` one after another (each answered before
    the next is sent), then asks for the event stream; its answer's head read."""
    stream = await connect(server)
    try:
        raw = RawSse(stream)
        for each in first:
            await stream.send_all(each)
            await read_answer(raw)
        encoding = f"Accept-Encoding: {'gzip' if gzip else 'identity'}"
        await stream.send_all(request(server, events_target(wid), encoding))
        await read_next_head(raw)
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return raw, stream


@pytest.mark.parametrize("gzip", [False, True], ids=["plain", "gzip"])
async def test_an_event_stream_after_other_requests_is_the_dispatchers(
    server: Server, gzip: bool
) -> None:
    ws = await server.open_workspace()
    wid = ws["id"]
    asked = [request(server, f"/v1/workspaces/{wid}"), request(server, "/v1/workspaces")]
    raw, stream = await stream_after(server, wid, asked, gzip=gzip)
    async with stream:
        assert raw.status == 200
        assert raw.headers["connection"] == "close"  # the dispatcher's answer
        assert raw.headers["content-type"] == "text/event-stream"
        assert (raw.headers.get("content-encoding") == "gzip") is gzip
        hello = await raw.until(typed("hello"))
        assert data_of(hello)["payload"]["workspace_id"] == wid
        await server.create_session(wid, "over a kept-alive connection")
        await raw.until(lambda b: b"over a kept-alive connection" in b)


async def test_a_refused_event_stream_after_other_requests_gets_the_same_refusal(
    server: Server,
) -> None:
    ws = await server.open_workspace()
    stream, raw = await after_one_answer(server)
    async with stream:
        target = f"/v1/workspaces/{ws['id']}/events?client_id=not-a-uuid"
        await stream.send_all(request(server, target))
        await read_next_head(raw)
        assert raw.status == 400
        assert "client_id" in orjson.loads(raw.body)["message"]
        assert raw.headers["connection"] == "close"


async def test_a_head_split_across_reads_is_read_whole_before_it_is_routed(
    server: Server,
) -> None:
    ws = await server.open_workspace()
    stream, raw = await after_one_answer(server)
    async with stream:
        head = request(server, events_target(ws["id"]))
        for part in (head[:2], head[2:9], head[9:-3], head[-3:]):
            await stream.send_all(part)
            await trio.testing.wait_all_tasks_blocked()
        await read_next_head(raw)
        assert raw.status == 200
        assert raw.headers["connection"] == "close"
        await raw.until(typed("hello"))


async def test_requests_pipelined_behind_an_answer_stay_with_hypercorn(server: Server) -> None:
    """Sent in one write, the event stream's request is read while the first answer is in
    progress: hypercorn keeps the connection and serves it through the app's route."""
    ws = await server.open_workspace()
    wid = ws["id"]
    stream = await connect(server)
    async with stream:
        raw = RawSse(stream)
        await stream.send_all(
            request(server, f"/v1/workspaces/{wid}") + request(server, events_target(wid))
        )
        assert (await read_answer(raw))["id"] == wid
        await read_next_head(raw)
        assert raw.status == 200
        assert "connection" not in raw.headers  # the app's route
        await raw.until(typed("hello"))
        await server.create_session(wid, "pipelined")
        await raw.until(lambda b: b"pipelined" in b)


async def test_other_requests_on_a_kept_alive_connection_stay_with_hypercorn(
    server: Server,
) -> None:
    """A GET that is no event stream (and one whose head is too long for the dispatcher) is
    answered by the app on the same connection, which stays open for the next."""
    ws = await server.open_workspace()
    wid = ws["id"]
    stream = await connect(server)
    async with stream:
        raw = RawSse(stream)
        for _ in range(3):
            await stream.send_all(request(server, f"/v1/workspaces/{wid}"))
            assert (await read_answer(raw))["id"] == wid
        padding = f"X-Padding: {'a' * HEAD_LIMIT}"
        await stream.send_all(request(server, events_target(wid), padding))
        await read_next_head(raw)
        assert "connection" not in raw.headers or raw.headers["connection"] != "close"
        await raw.until(typed("hello"))  # hypercorn's limit is larger: the app's route


def websocket_upgrade(server: Server, wid: str) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return request(
        server,
        f"/v1/workspaces/{wid}/ws?client_id={uuid.uuid4()}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        f"Sec-WebSocket-Key: {key}",
        "Sec-WebSocket-Version: 13",
    )


async def handshake_head(server: Server, wid: str, first: list[bytes]) -> list[str]:
    """The header names of the websocket handshake's answer on a connection that sent
    ``first`` before it."""
    stream = await connect(server)
    async with stream:
        raw = RawSse(stream)
        for each in first:
            await stream.send_all(each)
            await read_answer(raw)
        await stream.send_all(websocket_upgrade(server, wid))
        with trio.fail_after(WAIT):
            while b"\r\n\r\n" not in raw.buf:
                await raw._fill()
        lines = raw.buf.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        assert lines[0].split(" ")[1] == "101", lines
        return sorted(line.partition(":")[0].lower() for line in lines[1:])


async def test_an_event_websocket_after_other_requests_is_the_dispatchers(
    server: Server,
) -> None:
    """The handshake's answer is trio-websocket's, the same as on a new connection."""
    ws = await server.open_workspace()
    wid = ws["id"]
    fresh = await handshake_head(server, wid, [])
    kept = await handshake_head(server, wid, [request(server, "/v1/workspaces")])
    assert kept == fresh


async def test_a_kept_alive_stream_ends_with_the_server(tmp_path: Path) -> None:
    """Shutdown ends a stream taken over from hypercorn like any other: the last chunk, then
    the connection closes."""
    async with running_server(tmp_path) as server:
        ws = await server.open_workspace()
        raw, stream = await stream_after(server, ws["id"], [request(server, "/v1/workspaces")])
        async with stream:
            await raw.until(typed("hello"))
            server.handle.stop()
            await raw.to_end()


async def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(
    server: Server, autojump_clock: Any
) -> None:
    """Each answer starts the timer again (two rests of 0.9 of it in a row keep the connection);
    after the last, the server closes the connection (EOF) when the timeout has passed."""
    stream = await connect(server)
    async with stream:
        raw = RawSse(stream)
        for rest in (KEEP_ALIVE_TIMEOUT * 0.9, KEEP_ALIVE_TIMEOUT * 0.9, None):
            await stream.send_all(request(server, "/v1/workspaces"))
            await read_answer(raw)
            if rest is not None:
                await trio.sleep(rest)  # the clock jumps
        answered = trio.current_time()
        with trio.fail_after(KEEP_ALIVE_TIMEOUT + WAIT):
            assert await stream.receive_some(65536) == b""
        assert KEEP_ALIVE_TIMEOUT <= trio.current_time() - answered < KEEP_ALIVE_TIMEOUT + 1


async def test_over_a_unix_socket_the_event_stream_is_the_dispatchers(tmp_path: Path) -> None:
    """Where Crush's client connects: a Unix socket (no token), the event stream asked for on a
    connection that served other requests, with gzip."""
    sock = Path(tempfile.mkdtemp(prefix="ct-")) / "s.sock"  # short: AF_UNIX paths are limited
    project = tmp_path / "project"
    project.mkdir()
    options = serve_options(tmp_path, host=f"unix:{sock}", port=None, token=None)
    async with trio.open_nursery() as nursery:
        handle = await nursery.start(partial(serve, options))
        stream = await trio.open_unix_socket(str(sock))
        async with stream:
            raw = RawSse(stream)
            body = orjson.dumps({"path": str(project), "client_id": str(uuid.uuid4())})
            await stream.send_all(
                b"POST /v1/workspaces HTTP/1.1\r\nHost: api.crush.localhost\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            wid = (await read_answer(raw))["id"]
            target = f"{events_target(wid)} HTTP/1.1\r\nHost: api.crush.localhost"
            await stream.send_all(f"GET {target}\r\nAccept-Encoding: gzip\r\n\r\n".encode())
            await read_next_head(raw)
            assert raw.status == 200
            assert raw.headers["connection"] == "close"
            assert raw.headers["content-encoding"] == "gzip"
            hello = await raw.until(typed("hello"))
            assert data_of(hello)["payload"]["workspace_id"] == wid
        handle.stop()


@pytest.mark.parametrize("sent", ["part of a head", "a whole head"])
async def test_shutdown_while_a_kept_alive_request_is_read_ends_the_connection(
    tmp_path: Path, sent: str
) -> None:
    """Cancellation between two requests: the server stopping while the reader holds the start
    of a next head (or a whole one, routed to the event stream) ends the connection well within
    the head's own timeout."""
    async with running_server(tmp_path) as server:
        ws = await server.open_workspace()
        stream, raw = await after_one_answer(server)
        async with stream:
            head = request(server, events_target(ws["id"]))
            await stream.send_all(head[:20] if sent == "part of a head" else head)
            await trio.testing.wait_all_tasks_blocked()
            server.handle.stop()
            with trio.fail_after(HEAD_TIMEOUT / 2):
                while await stream.receive_some(65536):
                    pass


async def test_a_kept_alive_head_with_a_non_ascii_host_gets_the_rules_400(server: Server) -> None:
    """The dispatcher declines a head it would refuse; hypercorn's rules refuse it the same."""
    ws = await server.open_workspace()
    stream, raw = await after_one_answer(server)
    async with stream:
        head = request(server, events_target(ws["id"])).replace(b"Host: ", b"Host: \xff", 1)
        await stream.send_all(head)
        await read_next_head(raw)
        assert raw.status == 400
        assert "header host holds bytes" in orjson.loads(raw.body)["message"].lower()
    await assert_healthy(server)


@pytest.mark.parametrize("cut", [3, 40])
async def test_a_client_that_resets_in_a_kept_alive_head_leaves_the_server_well(
    server: Server, caplog: pytest.LogCaptureFixture, cut: int
) -> None:
    caplog.set_level(logging.WARNING)
    ws = await server.open_workspace()
    stream, _ = await after_one_answer(server)
    await stream.send_all(request(server, events_target(ws["id"]))[:cut])
    await trio.testing.wait_all_tasks_blocked()
    reset(stream)
    await stream.aclose()
    await assert_healthy(server)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
