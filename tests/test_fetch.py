"""The ``fetch`` tool against local test servers.

The servers listen on ``127.0.0.2`` (loopback): fetch refuses loopback by default, so the tests
that fetch successfully list ``127.0.0.2/32`` in ``options.fetch.allow_private`` (the opt-in a
user sets for a private network) and the refusal tests leave it off or point elsewhere
(``127.0.0.1``, ``169.254.169.254``). Host names are mapped to addresses by a resolver the test
owns, so no test depends on the machine's DNS.

Every wait is bounded (``trio.fail_after``); the never-answering server runs on the autojump
clock.
"""

from __future__ import annotations

import gzip
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import orjson
import pytest
import trio

from crush_trio.config import (
    FETCH_MAX_BYTES_CEILING,
    FetchOptions,
    LoadedConfig,
    load_config_report,
)
from crush_trio.errors import ConfigError
from crush_trio.testing import ScriptedModel, Step
from crush_trio.tools import FetchTool, ToolContext, ToolResult, call_tool
from crush_trio.tools.fetch import AddressPolicy
from crush_trio.wire import ToolResultPart

from .test_tools import FakeAsker

if TYPE_CHECKING:
    from pathlib import Path

    from crush_trio.client import WorkspaceClient

WAIT = 10.0
TEST_HOST = "127.0.0.2"
ALLOW_TEST_HOST = FetchOptions(allow_private=[f"{TEST_HOST}/32"])

DOCS_HTML = b"""<!DOCTYPE html><html><head><title>Nurseries</title>
<script>window.tracker = "gtag-secret";</script><style>p{color:red}</style></head>
<body><nav><a href="/">Home</a></nav><main>
<h1>Tasks let you do multiple things at once</h1>
<p>Use <code>trio.open_nursery()</code>, see <a href="https://example.org/post">the post</a>.</p>
<table><tr><th>Parameter</th><th>Type</th></tr><tr><td>name</td><td>str</td></tr></table>
<pre><code class="language-python">async with trio.open_nursery() as n:
    n.start_soon(child)</code></pre>
<ul><li>one</li><li>two</li></ul></main></body></html>"""

Handler = Callable[[trio.SocketStream, bytes], Awaitable[None]]


@attrs.define
class CannedServer:
    """A tiny HTTP/1.1 server: one canned handler per request path."""

    host: str
    routes: dict[str, Handler]
    port: int = 0
    requests: list[bytes] = attrs.field(factory=list)
    connections: int = 0
    sent: int = 0

    @property
    def base(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        head = b""
        async with stream:
            while b"\r\n\r\n" not in head and len(head) < 65536:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                head += chunk
            self.requests.append(head)
            path = head.split(b" ", 2)[1].decode()
            handler = self.routes.get(path, not_found)
            try:
                await handler(stream, head)
            except trio.BrokenResourceError:
                pass  # the client stopped reading (the body bound)


async def respond(
    stream: trio.SocketStream,
    status: str,
    headers: dict[str, str],
    body: bytes = b"",
) -> None:
    lines = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode() + body)


async def not_found(stream: trio.SocketStream, head: bytes) -> None:
    await respond(stream, "404 Not Found", {"Content-Type": "text/plain"}, b"nope")


def page(body: bytes, content_type: str = "text/html; charset=utf-8") -> Handler:
    async def handler(stream: trio.SocketStream, head: bytes) -> None:
        await respond(stream, "200 OK", {"Content-Type": content_type}, body)

    return handler


def redirect(location: str, status: str = "302 Found") -> Handler:
    async def handler(stream: trio.SocketStream, head: bytes) -> None:
        await respond(stream, status, {"Location": location})

    return handler


@asynccontextmanager
async def serving(host: str = TEST_HOST, **routes: Handler) -> AsyncIterator[CannedServer]:
    server = CannedServer(host, {f"/{k.replace('_', '-')}": v for k, v in routes.items()})
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, server.handle, 0, host=host))
        server.port = listeners[0].socket.getsockname()[1]
        yield server
        nursery.cancel_scope.cancel()


def make_ctx(tmp_path: Path, asker: Any, fetch: FetchOptions = ALLOW_TEST_HOST) -> ToolContext:
    ws = tmp_path / "ws"
    (ws / ".crush").mkdir(parents=True, exist_ok=True)
    return ToolContext(
        workspace=ws,
        data_dir=ws / ".crush",
        session_id="s1",
        tool_call_id="c1",
        permissions=asker,
        timeout=60.0,
        fetch=fetch,
    )


async def fetch(ctx: ToolContext, tool: FetchTool | None = None, **params: Any) -> ToolResult:
    with trio.fail_after(WAIT):
        return await call_tool([tool or FetchTool()], "fetch", orjson.dumps(params).decode(), ctx)


def mapped(names: dict[str, list[str]]) -> Callable[[str, int], Awaitable[list[str]]]:
    """A resolver that knows only ``names`` (and passes IP literals through)."""

    async def resolve(host: str, port: int) -> list[str]:
        await trio.lowlevel.checkpoint()
        return names.get(host, [host])

    return resolve


# ---------------------------------------------------------------------------------------------
# Content


async def test_html_becomes_markdown_and_the_fetch_asks_first(tmp_path: Path) -> None:
    asker = FakeAsker()
    async with serving(docs=page(DOCS_HTML)) as server:
        result = await fetch(make_ctx(tmp_path, asker), url=f"{server.base}/docs")
    assert not result.is_error, result.content
    text = result.content
    assert text.startswith(f"Fetched {server.base}/docs (text/html, HTTP 200)")
    assert "# Tasks let you do multiple things at once" in text
    assert "[the post](https://example.org/post)" in text
    assert "| Parameter | Type |" in text.replace("  ", " ") or "| Parameter" in text
    assert "```python" in text
    assert "n.start_soon(child)" in text
    assert "- one" in text
    assert "gtag-secret" not in text
    assert "color:red" not in text
    [request] = asker.requests
    assert request["tool_name"] == "fetch"
    assert request["action"] == "fetch"
    assert request["path"] == f"{server.base}/docs"
    assert request["params"] == {"url": f"{server.base}/docs", "format": "markdown"}


async def test_text_and_html_formats(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, FakeAsker())
    async with serving(docs=page(DOCS_HTML), data=page(b'{"a": 1}', "application/json")) as server:
        plain = await fetch(ctx, url=f"{server.base}/docs", format="text")
        raw = await fetch(ctx, url=f"{server.base}/docs", format="html")
        data = await fetch(ctx, url=f"{server.base}/data")
        bad = await fetch(ctx, url=f"{server.base}/docs", format="pdf")
    assert "Tasks let you do multiple things at once" in plain.content
    assert "# Tasks" not in plain.content
    assert "](https" not in plain.content
    assert "<h1>Tasks let you do multiple things at once</h1>" in raw.content
    assert data.content.endswith('{"a": 1}')
    assert bad.is_error
    assert "must be one of markdown, text, html" in bad.content


async def test_binary_and_error_statuses_are_error_results(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, FakeAsker())
    async with serving(img=page(b"\x89PNG\r\n\x00\x00", "image/png")) as server:
        img = await fetch(ctx, url=f"{server.base}/img")
        missing = await fetch(ctx, url=f"{server.base}/missing")
    assert img.is_error
    assert "is image/png, not text" in img.content
    assert missing.is_error
    assert "the server answered HTTP 404" in missing.content


async def test_the_host_header_is_the_urls_while_the_connection_goes_to_the_checked_address(
    tmp_path: Path,
) -> None:
    tool = FetchTool(resolver=mapped({"docs.test": [TEST_HOST]}))
    async with serving(docs=page(DOCS_HTML)) as server:
        result = await fetch(
            make_ctx(tmp_path, FakeAsker()), tool, url=f"http://docs.test:{server.port}/docs"
        )
    assert not result.is_error, result.content
    assert f"Host: docs.test:{server.port}\r\n".encode() in server.requests[0]


# ---------------------------------------------------------------------------------------------
# Addresses: refused by default, on every hop and on the address connected


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("file:///etc/passwd", "has scheme file; fetch reads http and https URLs only"),
        ("ftp://example.org/x", "has scheme ftp"),
        ("http://127.0.0.1:9/", "127.0.0.1 is a loopback address"),
        ("http://localhost:9/", "localhost is a loopback address"),
        ("http://169.254.169.254/latest/meta-data/", "a link-local address"),
        ("http://10.1.2.3/", "10.1.2.3 is a private address"),
        ("http://[::1]:9/", "::1 is a loopback address"),
        ("http://[::ffff:127.0.0.1]/", "is a loopback address"),
        ("http://0.0.0.0:9/", "the unspecified address"),
        ("http://user:pw@example.org/", "carries a user name or password"),
    ],
)
async def test_refused_urls_are_refused_before_asking(tmp_path: Path, url: str, why: str) -> None:
    asker = FakeAsker()
    result = await fetch(make_ctx(tmp_path, asker, FetchOptions()), url=url)
    assert result.is_error
    assert not result.stop_turn
    assert why in result.content, result.content
    assert asker.requests == []


async def test_the_test_server_is_refused_without_the_opt_in(tmp_path: Path) -> None:
    async with serving(docs=page(DOCS_HTML)) as server:
        result = await fetch(
            make_ctx(tmp_path, FakeAsker(), FetchOptions()), url=f"{server.base}/docs"
        )
    assert result.is_error
    assert "127.0.0.2 is a loopback address" in result.content
    assert "options.fetch.allow_private" in result.content
    assert server.connections == 0


async def test_redirect_to_loopback_is_refused(tmp_path: Path) -> None:
    async with serving("127.0.0.1", secret=page(b"internal admin page")) as internal:
        async with serving(hop=redirect(f"{internal.base}/secret")) as server:
            result = await fetch(make_ctx(tmp_path, FakeAsker()), url=f"{server.base}/hop")
    assert result.is_error
    assert f"fetch refused: {internal.base}/secret: 127.0.0.1 is a loopback address" in (
        result.content
    )
    assert internal.connections == 0
    assert "internal admin page" not in result.content


async def test_redirect_to_the_metadata_service_is_refused(tmp_path: Path) -> None:
    async with serving(hop=redirect("http://169.254.169.254/latest/meta-data/")) as server:
        result = await fetch(make_ctx(tmp_path, FakeAsker()), url=f"{server.base}/hop")
    assert result.is_error
    assert "169.254.169.254 is a link-local address (such as the cloud metadata service)" in (
        result.content
    )


async def test_a_name_resolving_to_loopback_is_refused_at_connect(tmp_path: Path) -> None:
    # The name passes the URL check (it is not an address); the address it resolves to does not.
    tool = FetchTool(resolver=mapped({"rebind.test": ["127.0.0.1"]}))
    asker = FakeAsker()
    async with serving("127.0.0.1", x=page(b"loopback service")) as internal:
        result = await fetch(
            make_ctx(tmp_path, asker), tool, url=f"http://rebind.test:{internal.port}/x"
        )
    assert result.is_error
    assert "rebind.test resolves to 127.0.0.1, which is a loopback address" in result.content
    assert internal.connections == 0
    assert len(asker.requests) == 1  # asked for the URL; refused before any connection


async def test_a_name_with_one_private_address_among_public_ones_is_refused(
    tmp_path: Path,
) -> None:
    tool = FetchTool(resolver=mapped({"mixed.test": ["93.184.216.34", "10.0.0.5"]}))
    result = await fetch(make_ctx(tmp_path, FakeAsker()), tool, url="http://mixed.test/")
    assert result.is_error
    assert "mixed.test resolves to 10.0.0.5, which is a private" in result.content


async def test_redirect_to_the_same_name_rebound_to_loopback_is_refused(tmp_path: Path) -> None:
    """Each connection resolves the name once and checks what it connects to: a second lookup
    that answers loopback (DNS rebinding) is refused."""
    answers = [[TEST_HOST], ["127.0.0.1"]]

    async def rebinding(host: str, port: int) -> list[str]:
        await trio.lowlevel.checkpoint()
        return answers.pop(0) if host == "flip.test" else [host]

    async with serving() as server:
        server.routes["/hop"] = redirect(f"http://flip.test:{server.port}/hop2")
        result = await fetch(
            make_ctx(tmp_path, FakeAsker()),
            FetchTool(resolver=rebinding),
            url=f"http://flip.test:{server.port}/hop",
        )
    assert result.is_error
    assert "flip.test resolves to 127.0.0.1, which is a loopback address" in result.content
    assert server.connections == 1


def test_own_address_is_refused_even_when_public() -> None:
    policy = AddressPolicy(is_own=lambda ip: str(ip) == "93.184.216.34")
    assert policy.refusal("93.184.216.34") == "an address of this machine"
    assert policy.refusal("93.184.216.35") is None
    assert AddressPolicy().refusal("100.64.0.1") == "a private address"  # shared (CGNAT)
    assert AddressPolicy().refusal("224.0.0.1") == "a multicast address"
    assert AddressPolicy().refusal("64:ff9b::7f00:1") == "a loopback address (this machine)"
    allow = AddressPolicy.from_options(FetchOptions(allow_private=["10.0.0.0/8"]))
    assert allow.refusal("10.9.9.9") is None
    assert allow.refusal("127.0.0.1") is not None


# ---------------------------------------------------------------------------------------------
# Redirects


async def test_same_origin_redirects_are_followed_and_other_origins_ask_again(
    tmp_path: Path,
) -> None:
    asker = FakeAsker()
    tool = FetchTool(resolver=mapped({"other.test": [TEST_HOST]}))
    async with serving(a=redirect("/b", "301 Moved Permanently"), docs=page(DOCS_HTML)) as server:
        server.routes["/b"] = redirect(f"http://other.test:{server.port}/docs", "307 Temporary")
        result = await fetch(make_ctx(tmp_path, asker), tool, url=f"{server.base}/a")
    assert not result.is_error, result.content
    assert result.content.startswith(f"Fetched http://other.test:{server.port}/docs")
    assert [r["path"] for r in asker.requests] == [
        f"{server.base}/a",
        f"http://other.test:{server.port}/docs",
    ]
    assert "redirected from" in asker.requests[1]["description"]


async def test_a_denied_redirect_stops_the_fetch(tmp_path: Path) -> None:
    @attrs.define
    class FirstOnly(FakeAsker):
        async def request(self, **kw: Any) -> bool:
            await super().request(**kw)
            return len(self.requests) == 1

    asker = FirstOnly()
    tool = FetchTool(resolver=mapped({"other.test": [TEST_HOST]}))
    async with serving(docs=page(DOCS_HTML)) as server:
        server.routes["/a"] = redirect(f"http://other.test:{server.port}/docs")
        result = await fetch(make_ctx(tmp_path, asker), tool, url=f"{server.base}/a")
    assert result.is_error
    assert result.stop_turn
    assert "permission denied" in result.content
    assert len(server.requests) == 1


async def test_too_many_redirects(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, FakeAsker(), FetchOptions(allow_private=[TEST_HOST], max_redirects=2))
    async with serving(loop=redirect("/loop")) as server:
        result = await fetch(ctx, url=f"{server.base}/loop")
    assert result.is_error
    assert "more than 2 redirects (options.fetch.max_redirects)" in result.content
    assert len(server.requests) == 3


# ---------------------------------------------------------------------------------------------
# Bounds


BIG = 50 * 1024 * 1024
CHUNK = 64 * 1024


async def huge(stream: trio.SocketStream, head: bytes, server: CannedServer) -> None:
    header = (
        f"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {BIG}\r\n\r\n"
    ).encode()
    await stream.send_all(header)
    block = b"x" * CHUNK
    while server.sent < BIG:
        await stream.send_all(block)
        server.sent += CHUNK


async def test_a_50_mb_body_is_cut_at_the_bound_with_memory_bounded(tmp_path: Path) -> None:
    limit = 1024 * 1024
    ctx = make_ctx(tmp_path, FakeAsker(), FetchOptions(allow_private=[TEST_HOST], max_bytes=limit))
    async with serving() as server:
        server.routes["/big"] = partial(huge, server=server)
        tracemalloc.start()
        try:
            result = await fetch(ctx, url=f"{server.base}/big")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert not result.is_error, result.content[:200]
    assert f"(the body was cut at {limit} bytes, options.fetch.max_bytes" in result.content
    assert result.content.count("x") <= limit + 10
    assert peak < 12 * limit, f"peak {peak} bytes while fetching a {BIG} byte body"
    assert server.sent < BIG // 2  # the client stopped reading; the server could not send it all


async def test_a_compressed_bomb_is_decoded_in_bounded_steps(tmp_path: Path) -> None:
    limit = 1024 * 1024
    body = gzip.compress(b"a" * (64 * 1024 * 1024), compresslevel=9)
    assert len(body) < 200_000  # 64 MiB once inflated
    ctx = make_ctx(tmp_path, FakeAsker(), FetchOptions(allow_private=[TEST_HOST], max_bytes=limit))

    async def gz(stream: trio.SocketStream, head: bytes) -> None:
        await respond(
            stream, "200 OK", {"Content-Type": "text/plain", "Content-Encoding": "gzip"}, body
        )

    async with serving(gz=gz) as server:
        tracemalloc.start()
        try:
            result = await fetch(ctx, url=f"{server.base}/gz")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert not result.is_error, result.content[:200]
    assert "cut at" in result.content
    assert peak < 12 * limit


async def test_a_server_that_never_answers_times_out(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    ctx = make_ctx(tmp_path, FakeAsker(), FetchOptions(allow_private=[TEST_HOST], timeout=5))

    async def silent(stream: trio.SocketStream, head: bytes) -> None:
        await trio.sleep_forever()

    async with serving(silent=silent) as server:
        with trio.fail_after(60):
            started = trio.current_time()
            result = await call_tool(
                [FetchTool()], "fetch", orjson.dumps({"url": f"{server.base}/silent"}).decode(), ctx
            )
            took = trio.current_time() - started
    assert result.is_error
    assert "timed out after 5 s (options.fetch.timeout)" in result.content
    assert 5 <= took < 6


async def test_cancel_while_fetching_propagates(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, FakeAsker())
    reached = trio.Event()

    async def stall(stream: trio.SocketStream, head: bytes) -> None:
        reached.set()
        await trio.sleep_forever()

    async with serving(stall=stall) as server:
        with trio.fail_after(WAIT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(fetch, ctx, url=f"{server.base}/stall"))
                await reached.wait()
                nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------------------------
# Through the agent: the permission request and a denial


async def test_a_denied_fetch_reaches_the_model_as_a_denied_result(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    url = "https://docs.example.org/guide"
    scripted_model.add(Step(tool_calls=[("fetch", {"url": url})]), Step(text="unused"))
    sid = (await ws.create_session()).id
    async with ws.subscribe(timeout=WAIT) as feed:
        run = await ws.prompt(sid, "read the guide", run_id="f")
        asked = await feed.until(lambda e: e.type == "permission_request", WAIT)
        assert asked.payload.tool_name == "fetch"
        assert asked.payload.action == "fetch"
        assert asked.payload.params == {"url": url, "format": "markdown"}
        assert asked.payload.path == url
        assert await ws.grant(asked.payload.id, "deny")
        await run.result(WAIT)
    results = [p for m in await ws.messages(sid) for p in m.parts if isinstance(p, ToolResultPart)]
    [result] = results
    assert result.name == "fetch"
    assert result.is_error
    assert result.content.startswith("permission denied: the user did not allow fetch to fetch")
    assert len(scripted_model.requests) == 1  # the turn ended at the denial


# ---------------------------------------------------------------------------------------------
# Configuration: ceilings, and an untrusted workspace may only lower the bounds


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(data))
    return path


def load_fetch(tmp_path: Path, user: dict[str, Any], project: dict[str, Any]) -> LoadedConfig:
    write_json(tmp_path / "user" / "crush.json", user)
    write_json(tmp_path / "ws" / "crush.json", project)
    return load_config_report(
        config_file=None, workspace=tmp_path / "ws", env={}, user_config_dir=tmp_path / "user"
    )


def test_an_untrusted_workspace_may_lower_the_fetch_bounds_but_not_raise_them(
    tmp_path: Path,
) -> None:
    loaded = load_fetch(
        tmp_path,
        {"options": {"fetch": {"max_bytes": 2_000_000, "allow_private": ["10.0.0.0/8"]}}},
        {
            "options": {
                "fetch": {
                    "max_bytes": 1_000_000,  # lower: kept
                    "timeout": 90,  # above the default 30: ignored
                    "max_redirects": 1,  # lower: kept
                    "allow_private": ["0.0.0.0/0"],  # never from an untrusted file
                }
            }
        },
    )
    fetch_options = loaded.config.options.fetch
    assert fetch_options.max_bytes == 1_000_000
    assert fetch_options.timeout == 30.0
    assert fetch_options.max_redirects == 1
    assert fetch_options.allow_private == ["10.0.0.0/8"]
    warnings = "\n".join(loaded.warnings)
    assert "may only lower $.options.fetch.timeout (now 30.0), not raise it to 90" in warnings
    assert "$.options.fetch.allow_private" in warnings

    raised = load_fetch(
        tmp_path,
        {"options": {"fetch": {"max_bytes": 2_000_000}}},
        {"options": {"fetch": {"max_bytes": 3_000_000}}},
    )
    assert raised.config.options.fetch.max_bytes == 2_000_000


def test_fetch_bounds_have_hard_ceilings_and_networks_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as over:
        load_fetch(tmp_path, {"options": {"fetch": {"max_bytes": FETCH_MAX_BYTES_CEILING + 1}}}, {})
    assert f"must be at most {FETCH_MAX_BYTES_CEILING} (a hard limit)" in over.value.message
    with pytest.raises(ConfigError) as bad:
        load_fetch(tmp_path, {"options": {"fetch": {"allow_private": ["10.0.0.0/33"]}}}, {})
    assert "$.options.fetch.allow_private[0]" in bad.value.message
    assert "is not a network or an address" in bad.value.message


@pytest.mark.parametrize(
    "crush_config",
    [
        {
            "permissions": {"allowed_tools": ["fetch"]},
            "options": {"fetch": {"allow_private": [f"{TEST_HOST}/32"], "max_bytes": 4096}},
        }
    ],
)
async def test_allowed_tools_lets_fetch_run_without_asking_with_the_configured_bounds(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    async with serving(docs=page(DOCS_HTML + b"<p>" + b"y" * 10_000 + b"</p>")) as server:
        scripted_model.add(
            Step(tool_calls=[("fetch", {"url": f"{server.base}/docs"})]), Step(text="read it")
        )
        sid = (await ws.create_session()).id
        run = await ws.prompt(sid, "read the docs", run_id="a")
        assert (await run.result(WAIT)).text == "read it"
        assert run.permission_requests == {}
    [result] = [p for m in await ws.messages(sid) for p in m.parts if isinstance(p, ToolResultPart)]
    assert not result.is_error, result.content
    assert "# Tasks let you do multiple things at once" in result.content
    assert "(the body was cut at 4096 bytes, options.fetch.max_bytes" in result.content


async def test_waiting_for_a_redirects_permission_does_not_count_against_the_timeout(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    @attrs.define
    class SlowToAnswer(FakeAsker):
        async def request(self, **kw: Any) -> bool:
            if self.requests:
                await trio.sleep(100)  # the user thinks for longer than options.fetch.timeout
            return await super().request(**kw)

    ctx = make_ctx(
        tmp_path, SlowToAnswer(), FetchOptions(allow_private=[f"{TEST_HOST}/32"], timeout=5)
    )
    tool = FetchTool(resolver=mapped({"other.test": [TEST_HOST]}))
    # Plain text: no conversion thread, whose wait the autojump clock would skip past.
    async with serving(docs=page(b"the guide", "text/plain")) as server:
        server.routes["/a"] = redirect(f"http://other.test:{server.port}/docs")
        with trio.fail_after(300):
            result = await call_tool(
                [tool], "fetch", orjson.dumps({"url": f"{server.base}/a"}).decode(), ctx
            )
    assert not result.is_error, result.content
    assert result.content.endswith("the guide")
