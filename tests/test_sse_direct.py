"""The SSE event stream served on the socket by the dispatcher (:mod:`crush_trio.server.
sse_listener`): the same answer as the app's route (head, body, refusals), resuming with
``Last-Event-ID``, pings on an idle stream, every gzip chunk inflatable at once, the direct write
and the writer in step, and every way a stream ends: the client leaving, a slow client (gap, then
disconnected), the workspace shutting down (gzip trailer, last chunk), cancellation.

Read with a raw socket that parses the chunked body and inflates it chunk by chunk, so that what
travelled is checked, not what a client library makes of it.
"""

from __future__ import annotations

import contextlib
import uuid
import zlib
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import orjson
import pytest
import trio
import trio.testing

from crush_trio.broker import SENT, SENT_IN_PART, ClientStream, Event
from crush_trio.metrics import METRICS
from crush_trio.providers.scripted import ScriptedModel, Step
from crush_trio.server import dispatch, listener, sse_listener
from crush_trio.server.sse_listener import SseSocket
from crush_trio.testing import TEST_TOKEN

from .conftest import TOKEN, WAIT, Server, running_server
from .test_direct_write import HalfWrites
from .test_slow_close import REPLY as SLOW_REPLY
from .test_slow_close import RESUME_DELAY, TOKEN_DELAY, small_buffered_socket
from .test_slow_close import _config as slow_close_config
from .test_ws_deflate import CAP, REPLY, reply_step

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence
    from pathlib import Path

    from crush_trio.client import WorkspaceClient
    from crush_trio.testing import CrushServer


class RawSse:
    """One raw SSE connection: the head, then the chunked body, inflated chunk by chunk when
    gzip (each chunk must inflate at once to whole blocks)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = b""
        self.status = 0
        self.head: list[tuple[str, str]] = []
        self.body = b""  # a refusal's body
        self.inflater: Any = None
        self.blocks: list[bytes] = []
        self.ended = False  # the last chunk arrived

    @property
    def headers(self) -> dict[str, str]:
        return {name: value for name, value in self.head}

    async def _fill(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            raise EOFError(f"connection closed; buffered {self.buf[:80]!r}")
        self.buf += data

    async def read_head(self) -> None:
        while b"\r\n\r\n" not in self.buf:
            await self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split(" ")[1])
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self.head.append((name.strip().lower(), value.strip()))
        if self.headers.get("content-encoding") == "gzip":
            self.inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        if "content-length" in self.headers:
            size = int(self.headers["content-length"])
            while len(self.buf) < size:
                await self._fill()
            self.body = self.buf[:size]

    async def next_chunk(self) -> bytes | None:
        """The next chunk's payload; None for the last chunk."""
        while b"\r\n" not in self.buf:
            await self._fill()
        size_line, rest = self.buf.split(b"\r\n", 1)
        size = int(size_line, 16)
        while len(rest) < size + 2:
            await self._fill()
            rest = self.buf.split(b"\r\n", 1)[1]
        assert rest[size : size + 2] == b"\r\n"
        self.buf = rest[size + 2 :]
        return payload if (payload := rest[:size]) or size else None

    async def next_blocks(self) -> list[bytes]:
        chunk = await self.next_chunk()
        if chunk is None:
            self.ended = True
            return []
        if self.inflater is not None:
            text = self.inflater.decompress(chunk)
            if not text:
                assert self.inflater.eof, "a chunk that inflates to nothing must be the trailer"
                return []
            assert text.endswith(b"\n\n"), text  # the whole block, nothing held back
        else:
            text = chunk
        got = [b + b"\n\n" for b in text.split(b"\n\n") if b]
        self.blocks.extend(got)
        return got

    async def until(self, pred: Callable[[bytes], bool], wait: float = WAIT) -> bytes:
        with trio.fail_after(wait):
            while True:
                for b in await self.next_blocks():
                    if pred(b):
                        return b
                if self.ended:
                    raise AssertionError(f"the stream ended; got {self.blocks}")

    async def to_end(self) -> None:
        with trio.fail_after(WAIT):
            while not self.ended:
                await self.next_blocks()
            if self.inflater is not None:
                assert self.inflater.eof  # the gzip trailer came, its CRC-32 matched
            while True:  # then the server closes the connection
                try:
                    await self._fill()
                except EOFError:
                    break
        assert self.buf == b""


def data_of(block: bytes) -> dict[str, Any]:
    return orjson.loads(block.split(b"data: ", 1)[1])  # type: ignore[no-any-return]


def typed(kind: str) -> Callable[[bytes], bool]:
    return lambda b: b.startswith(b"id: ") and data_of(b)["type"] == kind


@asynccontextmanager
async def open_sse(
    url: str,
    wid: str,
    *,
    gzip: bool = False,
    query: str | None = None,
    headers: dict[str, str] | None = None,
    token: str | None = TOKEN,
    prefix: str = "",
) -> AsyncIterator[RawSse]:
    host = url.removeprefix("http://")
    address, port = host.rsplit(":", 1)
    if query is None:
        query = f"client_id={uuid.uuid4()}"
    lines = [f"GET {prefix}/v1/workspaces/{wid}/events?{query} HTTP/1.1", f"Host: {host}"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    lines.append(f"Accept-Encoding: {'gzip' if gzip else 'identity'}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    stream = await trio.open_tcp_stream(address, int(port))
    async with stream:
        await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode())
        raw = RawSse(stream)
        with trio.fail_after(WAIT):
            await raw.read_head()
        yield raw


@asynccontextmanager
async def app_route_server(tmp_path: Path) -> AsyncIterator[Server]:
    """A server whose event streams are the app's routes (``ws_transport: "asgi"``)."""
    config = tmp_path / "asgi.json"
    config.write_text('{"server": {"ws_transport": "asgi"}}')
    async with running_server(tmp_path / "asgi", config_file=config) as server:
        yield server


def without_ids(block: bytes) -> tuple[str, Any]:
    data = data_of(block)
    payload = data["payload"]
    if data["type"] == "hello":
        return "hello", payload["server_version"]
    return data["type"], payload["payload"]["title"]


# -- the same answer as the app's route -------------------------------------------------------


@pytest.mark.parametrize("gzip", [False, True], ids=["plain", "gzip"])
async def test_head_and_body_match_the_app_route(
    server: Server, tmp_path: Path, gzip: bool
) -> None:
    (tmp_path / "asgi").mkdir()
    got = {}
    async with app_route_server(tmp_path) as app_server:
        for name, srv in (("direct", server), ("app", app_server)):
            ws = await srv.open_workspace()
            async with open_sse(srv.url, ws["id"], gzip=gzip) as raw:
                await raw.until(typed("hello"))
                await srv.create_session(ws["id"], "the same title")
                await raw.until(lambda b: b"the same title" in b)
                head = [(k, v) for k, v in raw.head if k not in ("date", "connection")]
                got[name] = (raw.status, head, [without_ids(b) for b in raw.blocks])
                connection = raw.headers.get("connection")
            assert (connection == "close") is (name == "direct")  # the stream ends the connection
    assert got["direct"] == got["app"]
    assert got["direct"][2] == [("hello", got["direct"][2][0][1]), ("session", "the same title")]


async def test_refusals_match_the_app_route(server: Server, tmp_path: Path) -> None:
    (tmp_path / "asgi").mkdir()
    good = f"client_id={uuid.uuid4()}"
    cases: list[tuple[dict[str, Any], int]] = [
        ({"token": None}, 401),
        ({"token": "wrong"}, 401),
        ({"headers": {"Origin": "http://evil.example"}}, 403),
        ({"wid": "no-such-workspace"}, 404),
        ({"query": f"{good}&since=-1"}, 400),
        ({"query": f"{good}&since=soon"}, 400),
        ({"query": f"{good}&deltas=2"}, 400),
        ({"query": "client_id=not-a-uuid"}, 400),
        ({"query": ""}, 400),
        ({"headers": {"Last-Event-ID": "x"}}, 400),
    ]
    answers: dict[str, list[tuple[int, str, str]]] = {}
    async with app_route_server(tmp_path) as app_server:
        for name, srv in (("direct", server), ("app", app_server)):
            ws = await srv.open_workspace()
            port = srv.url.rsplit(":", 1)[1]
            answers[name] = []
            for case, status in cases:
                case = dict(case)
                wid = case.pop("wid", ws["id"])
                async with open_sse(srv.url, wid, **case) as raw:
                    assert raw.status == status, (case, raw.body)
                    message = orjson.loads(raw.body)["message"].replace(port, "PORT")
                    answers[name].append((raw.status, raw.headers["content-type"], message))
                    if name == "direct":
                        assert raw.headers["connection"] == "close"
    assert answers["direct"] == answers["app"]


async def test_a_token_in_the_query_or_the_cookie_is_accepted(server: Server) -> None:
    ws = await server.open_workspace()
    port = server.url.rsplit(":", 1)[1]
    query = f"client_id={uuid.uuid4()}&token={TOKEN}"
    async with open_sse(server.url, ws["id"], query=query, token=None) as raw:
        assert raw.status == 200
        await raw.until(typed("hello"))
    cookie = {"Cookie": f"crush_trio_token_{port}={TOKEN}"}
    async with open_sse(server.url, ws["id"], headers=cookie, token=None) as raw:
        assert raw.status == 200
        await raw.until(typed("hello"))


async def test_the_web_pages_prefix_and_its_cookie_are_served(server: Server) -> None:
    """The browser's page asks under its path prefix, with the token in the cookie scoped to it."""
    ws = await server.open_workspace()
    answer = await server.http.get("/", params={"token": TOKEN}, follow_redirects=False)
    prefix = answer.headers["location"].partition("/?")[0].removesuffix("/")
    assert prefix.startswith("/w-")
    port = server.url.rsplit(":", 1)[1]
    cookie = {"Cookie": f"crush_trio_token_{port}={TOKEN}"}
    async with open_sse(server.url, ws["id"], headers=cookie, token=None, prefix=prefix) as raw:
        assert raw.status == 200
        assert raw.headers["connection"] == "close"  # the dispatcher's answer
        await raw.until(typed("hello"))


@pytest.mark.parametrize("gzip", [False, True], ids=["plain", "gzip"])
async def test_last_event_id_resumes_after_it(server: Server, gzip: bool) -> None:
    ws = await server.open_workspace()
    async with open_sse(server.url, ws["id"]) as first:
        await first.until(typed("hello"))
        for n in range(3):
            await server.create_session(ws["id"], f"resumed {n}")
        await first.until(lambda b: b"resumed 2" in b)
    seqs = [data_of(b)["seq"] for b in first.blocks[1:]]
    resume = {"Last-Event-ID": str(seqs[0])}
    async with open_sse(server.url, ws["id"], gzip=gzip, headers=resume) as raw:
        await raw.until(lambda b: b"resumed 2" in b)
    assert [without_ids(b)[0] for b in raw.blocks] == ["hello", "session", "session"]
    assert raw.blocks[1:] == first.blocks[2:]  # the same blocks, byte for byte


# -- pings --------------------------------------------------------------------------------------


async def test_an_idle_stream_gets_a_ping_within_the_interval(
    crush_server: CrushServer, crush_workspace: WorkspaceClient, autojump_clock: Any
) -> None:
    interval = crush_server.handle.config.server.sse_ping_interval
    async with open_sse(crush_server.url, crush_workspace.id, gzip=True, token=TEST_TOKEN) as raw:
        await raw.until(typed("hello"))
        last = trio.current_time()
        for _ in range(3):
            await raw.until(lambda b: b == b": ping\n\n", interval + 1)
            now = trio.current_time()
            assert interval / 2 - 0.1 <= now - last <= interval + 0.1
            last = now


# -- a paced reply: direct writes, writes in part, gzip chunks ---------------------------------


async def watch_reply(
    server: CrushServer, ws: WorkspaceClient, model: ScriptedModel, replies: int = 1
) -> dict[str, list[bytes]]:
    """``replies`` paced replies at once (one session each), watched by a plain and two gzip
    raw clients: the blocks each got after ``hello``."""
    sessions = [await ws.create_session() for _ in range(replies)]
    for _ in sessions:
        model.add(reply_step())
    got = {}
    with trio.fail_after(CAP):
        async with (
            open_sse(server.url, ws.id, token=TEST_TOKEN) as plain,
            open_sse(server.url, ws.id, gzip=True, token=TEST_TOKEN) as zipped,
            open_sse(server.url, ws.id, gzip=True, token=TEST_TOKEN) as zipped2,
        ):
            for raw in (plain, zipped, zipped2):
                await raw.until(typed("hello"))
            handles = [await ws.prompt(session.id, "stream a reply") for session in sessions]
            for name, raw in (("plain", plain), ("gzip", zipped), ("gzip2", zipped2)):
                while sum(map(typed("run_complete"), raw.blocks)) < replies:
                    assert not raw.ended, raw.blocks
                    await raw.next_blocks()
                got[name] = [b for b in raw.blocks if b.startswith(b"id: ") and b"hello" not in b]
            for handle in handles:
                await handle.wait(CAP)
    complete = data_of(got["plain"][-1])["payload"]["payload"]
    assert complete["text"] == REPLY
    assert sum(data_of(b)["type"] == "message" for b in got["plain"]) >= 3 * replies
    return got


class CountedSends:
    """Counts what :meth:`SseSocket.send_now` answered, by answer."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.answers: dict[int, int] = {}
        #: Direct writes by the number of blocks each wrote.
        self.blocks: dict[int, int] = {}
        send_now = SseSocket.send_now

        def counted(sock: SseSocket, events: Sequence[Event]) -> int:
            answer = send_now(sock, events)
            self.answers[answer] = self.answers.get(answer, 0) + 1
            self.blocks[len(events)] = self.blocks.get(len(events), 0) + 1
            return answer

        monkeypatch.setattr(SseSocket, "send_now", counted)


async def test_a_paced_reply_goes_out_directly_the_same_plain_and_gzip(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sends = CountedSends(monkeypatch)
    got = await watch_reply(crush_server, crush_workspace, scripted_model)
    assert got["gzip"] == got["plain"] == got["gzip2"]
    assert sends.answers.get(SENT, 0) >= 9  # idle writers between tokens: direct writes
    assert sends.answers.get(SENT_IN_PART, 0) == 0


async def test_blocks_written_in_part_are_finished_by_the_writer_in_order(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sends = CountedSends(monkeypatch)
    monkeypatch.setattr(listener, "os", HalfWrites())
    got = await watch_reply(crush_server, crush_workspace, scripted_model)
    assert got["gzip"] == got["plain"] == got["gzip2"]
    assert sends.answers.get(SENT_IN_PART, 0) >= 9
    assert sends.answers.get(SENT, 0) == 0


async def test_replies_in_step_go_out_several_blocks_per_write_the_same_plain_and_gzip(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three replies at once: their publish windows fall into step, and the rest of a window's
    blocks after its first go out in one write, chunk by chunk (gzip: each block flushed)."""
    sends = CountedSends(monkeypatch)
    got = await watch_reply(crush_server, crush_workspace, scripted_model, replies=3)
    assert got["gzip"] == got["plain"] == got["gzip2"]
    ids = [int(b.split(b"\n", 1)[0][4:]) for b in got["plain"]]
    assert ids == sorted(set(ids))
    assert sum(n for size, n in sends.blocks.items() if size > 1) >= 2


async def test_replies_in_step_to_streams_with_little_room_are_finished_in_order(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three replies at once, every write taken only in half: the writer finishes each chunk
    begun directly and sends the rest of the window's blocks after it, whole and in order."""
    sends = CountedSends(monkeypatch)
    monkeypatch.setattr(listener, "os", HalfWrites())
    got = await watch_reply(crush_server, crush_workspace, scripted_model, replies=3)
    assert got["gzip"] == got["plain"] == got["gzip2"]
    ids = [int(b.split(b"\n", 1)[0][4:]) for b in got["plain"]]
    assert ids == sorted(set(ids))
    assert sends.answers.get(SENT_IN_PART, 0) >= 9
    assert sends.answers.get(SENT, 0) == 0


# -- how a stream ends --------------------------------------------------------------------------


def subscribers(server: Server, wid: str) -> int:
    return len(server.backend.get(wid).broker.clients)


async def settle_until(pred: Callable[[], bool]) -> None:
    with trio.fail_after(WAIT):
        while not pred():
            await trio.testing.wait_all_tasks_blocked(0.01)


async def test_a_client_leaving_mid_stream_ends_its_subscription(server: Server) -> None:
    ws = await server.open_workspace()
    before = subscribers(server, ws["id"])
    async with open_sse(server.url, ws["id"], gzip=True) as raw:
        await raw.until(typed("hello"))
        await server.create_session(ws["id"], "seen")
        await raw.until(lambda b: b"seen" in b)
        assert subscribers(server, ws["id"]) == before + 1
    await settle_until(lambda: subscribers(server, ws["id"]) == before)
    await server.create_session(ws["id"], "nobody watches")  # nothing written to a closed socket


@pytest.mark.parametrize("gzip", [False, True], ids=["plain", "gzip"])
async def test_a_server_shutting_down_ends_the_stream_with_its_trailer(
    server: Server, gzip: bool
) -> None:
    ws = await server.open_workspace()
    async with open_sse(server.url, ws["id"], gzip=gzip) as raw:
        await raw.until(typed("hello"))
        await server.create_session(ws["id"], "before the end")
        await raw.until(lambda b: b"before the end" in b)
        server.handle.stop()  # the server shuts down: its workspaces close their streams
        await raw.to_end()


async def test_a_dropped_stream_ends_cleanly(server: Server) -> None:
    ws = await server.open_workspace()
    async with open_sse(server.url, ws["id"], gzip=True) as raw:
        await raw.until(typed("hello"))
        server.backend.get(ws["id"]).broker.drop_all("test: stream ends", 1012)
        await raw.to_end()


def _slow_closes(outcome: str) -> float:
    value = METRICS.registry.get_sample_value(
        "crush_trio_slow_client_closes_total", {"outcome": outcome}
    )
    return value or 0.0


async def slow_sse(server: Server, wid: str, client_id: str, *, gzip: bool) -> RawSse:
    """An SSE stream on a raw socket with a small receive buffer, once ``hello`` came."""
    host = server.url.removeprefix("http://")
    address, port = host.rsplit(":", 1)
    sock = small_buffered_socket()
    await sock.connect((address, int(port)))
    raw = RawSse(trio.SocketStream(sock))
    await raw.stream.send_all(
        (
            f"GET /v1/workspaces/{wid}/events?client_id={client_id} HTTP/1.1\r\nHost: {host}\r\n"
            f"Authorization: Bearer {TOKEN}\r\nAccept-Encoding: {'gzip' if gzip else 'identity'}"
            "\r\n\r\n"
        ).encode()
    )
    with trio.fail_after(WAIT):
        await raw.read_head()
    await raw.until(typed("hello"))
    return raw


def drop_seen(monkeypatch: pytest.MonkeyPatch, stream: ClientStream) -> trio.Event:
    """An event set once the broker has dropped an event for ``stream`` (its queue was full)."""
    dropped = trio.Event()
    drop_one = ClientStream._dropped_one

    def counted_drop(self: ClientStream) -> None:
        drop_one(self)
        if self is stream:
            dropped.set()

    monkeypatch.setattr(ClientStream, "_dropped_one", counted_drop)
    return dropped


@pytest.mark.parametrize("gzip", [False, True], ids=["plain", "gzip"])
async def test_a_slow_client_gets_a_gap_then_is_disconnected_at_a_chunk_boundary(
    tmp_path: Path, gzip: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed_before = _slow_closes("closed")
    # Snapshot mode: every ``message`` block carries the reply so far (up to 400 KB here).
    reply = SLOW_REPLY[: 200 * 2000]
    model = ScriptedModel([Step(reply, token_delay=TOKEN_DELAY) for _ in range(2)])
    config = slow_close_config(tmp_path, "trio-websocket")
    async with running_server(tmp_path, config_file=config, provider_factory=model) as server:
        wid = (await server.open_workspace())["id"]
        broker = server.backend.get(wid).broker
        sid = (await server.create_session(wid))["id"]
        # A client that pauses (busy elsewhere) until an event was dropped for it, less than
        # the bound: the drops are reported by a gap, and it gets the rest of the run.
        client_id = str(uuid.uuid4())
        raw = await slow_sse(server, wid, client_id, gzip=gzip)
        async with raw.stream:
            (stream,) = [c for c in broker.clients if c.client_id == client_id]
            dropped = drop_seen(monkeypatch, stream)
            run = await server.prompt(wid, sid, "a long reply")
            with trio.fail_after(WAIT):
                await dropped.wait()
            done = run["run_id"].encode()
            await raw.until(lambda b: b"run_complete" in b and done in b, WAIT * 3)
        assert any(typed("gap")(b) for b in raw.blocks)
        # A client that stops reading: disconnected as too slow; what it then reads ends at a
        # chunk boundary (each chunk inflated whole), with the end of the body when it was
        # written whole.
        client_id = str(uuid.uuid4())
        raw = await slow_sse(server, wid, client_id, gzip=gzip)
        async with raw.stream:
            (stream,) = [c for c in broker.clients if c.client_id == client_id]
            await server.prompt(wid, sid, "another long reply")
            with trio.fail_after(WAIT * 2):
                await stream.killed.wait()
            await trio.sleep(RESUME_DELAY)
            with trio.fail_after(WAIT * 2):
                try:
                    while not raw.ended:
                        await raw.next_blocks()
                except EOFError:
                    assert raw.buf == b"", "a chunk cut short"
                else:
                    await raw.to_end()
        assert stream.kill_reason == "too slow"
    assert _slow_closes("closed") - closed_before == 1


async def test_the_server_stops_promptly_under_a_client_that_stopped_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shutdown ends every stream: a client that reads nothing holds it up no longer than the
    bounds of the end of its body (the chunk in flight, then the trailer)."""
    model = ScriptedModel([Step(SLOW_REPLY[: 200 * 2000], token_delay=TOKEN_DELAY)])
    config = slow_close_config(tmp_path, "trio-websocket")
    async with contextlib.AsyncExitStack() as streams:
        with trio.fail_after(WAIT * 2):
            async with running_server(
                tmp_path, config_file=config, provider_factory=model
            ) as server:
                wid = (await server.open_workspace())["id"]
                sid = (await server.create_session(wid))["id"]
                client_id = str(uuid.uuid4())
                raw = await slow_sse(server, wid, client_id, gzip=True)
                await streams.enter_async_context(raw.stream)  # open until the server is gone
                (stream,) = [
                    c for c in server.backend.get(wid).broker.clients if c.client_id == client_id
                ]
                dropped = drop_seen(monkeypatch, stream)
                await server.prompt(wid, sid, "a long reply")
                await dropped.wait()  # its socket and its queue are full
                server.handle.stop()


async def test_cancelled_while_the_request_is_checked_leaves_nothing(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = await server.open_workspace()
    before = subscribers(server, ws["id"])
    reached, release = trio.Event(), trio.Event()
    check = sse_listener.check_request

    async def held(*args: Any) -> Any:
        reached.set()
        await release.wait()
        return await check(*args)

    monkeypatch.setattr(sse_listener, "check_request", held)
    host = server.url.removeprefix("http://")
    address, port = host.rsplit(":", 1)
    stream = await trio.open_tcp_stream(address, int(port))
    async with stream:
        await stream.send_all(
            f"GET /v1/workspaces/{ws['id']}/events?client_id={uuid.uuid4()} HTTP/1.1\r\n"
            f"Host: {host}\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
        )
        with trio.fail_after(WAIT):
            await reached.wait()
    release.set()  # the client left meanwhile: the stream starts and ends at once
    await settle_until(lambda: subscribers(server, ws["id"]) == before)


def test_the_dispatcher_takes_only_plain_first_gets_of_events() -> None:
    def head(line: str, *headers: str) -> bytes:
        return "\r\n".join([line, "Host: x", *headers, "", ""]).encode()

    events = "GET /v1/workspaces/abc/events?client_id=1 HTTP/1.1"
    assert dispatch.is_event_stream(head(events))
    assert dispatch.is_event_stream(head("GET /v1/workspaces/abc/events HTTP/1.1"))
    assert dispatch.is_event_stream(head(events, "Content-Length: 0"))
    assert not dispatch.is_event_stream(head(events, "Content-Length: 5"))
    assert not dispatch.is_event_stream(head(events, "Transfer-Encoding: chunked"))
    assert not dispatch.is_event_stream(head(events, "Upgrade: websocket"))
    assert not dispatch.is_event_stream(head(events.replace("1.1", "1.0")))
    assert not dispatch.is_event_stream(head(events.replace("GET", "POST")))
    assert not dispatch.is_event_stream(head("GET /v1/workspaces/a%2Fb/events HTTP/1.1"))
    assert not dispatch.is_event_stream(head("GET /v1/workspaces/abc/events/x HTTP/1.1"))
