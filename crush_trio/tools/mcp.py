"""MCP servers: their tools join the toolbox as ``mcp_<server>_<tool>`` (docs/mcp.md).

An :class:`McpManager` belongs to one workspace. ``await nursery.start(manager.run)`` starts every
configured server in parallel, each in a task of its own bounded by the server's ``timeout``, and
returns at once: the workspace does not wait for its MCP servers, and a prompt sent while one is
starting runs without its tools. Cancelling ``run`` stops every server (a stdio server's stdin is
closed, then it is terminated and killed; the SDK bounds each wait).

A server that fails to start, hangs at start or dies later is never fatal: its state becomes
``failed`` with the reason, a log line and an ``mcp`` agent event say so, and its tools leave the
toolbox. A server that says its tool list changed (``notifications/tools/list_changed``) is
listed again. There is no automatic restart; opening the workspace again (or a config reload that
changes the server's entry) starts it again.

States and their moves (:data:`MCP_MOVES`)::

    starting ─┬─> connected ─┬─> failed
              ├─> failed     └─> stopped
              └─> stopped
    disabled (never started)

Every call of an MCP tool asks for permission (action ``execute``) unless
``permissions.allowed_tools`` names the tool (``mcp_<server>_<tool>``). The result goes back to
the model: text as text, an image or audio block as a one-line note, an error result as an error.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import tempfile
from typing import IO, TYPE_CHECKING, Any, Final, TextIO, cast

import anyio
import attrs
import orjson
import trio

from ..config import MCP_NAME_UNSAFE, McpServerConfig
from ..core.model import ToolSpec
from ..errors import IllegalTransition, unwrap_group
from ..wire import McpServerInfo, McpState
from .base import ToolContext, ToolResult, ask_permission

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from pathlib import Path

    import httpx2

__all__ = [
    "MAX_MCP_RESULT_CHARS",
    "MCP_MOVES",
    "MCP_TOOL_PREFIX",
    "McpManager",
    "McpServer",
    "McpTool",
    "mcp_tool_name",
    "render_result",
]

log = logging.getLogger(__name__)

#: Prefix of the tools MCP servers offer.
MCP_TOOL_PREFIX: Final = "mcp_"
#: Longest tool name the model APIs accept.
MAX_TOOL_NAME: Final = 64
#: Characters of one MCP tool result sent to the model; the rest is cut with a note.
MAX_MCP_RESULT_CHARS: Final = 100_000
#: Bytes of a stdio server's stderr quoted in its error when it fails.
STDERR_TAIL_BYTES: Final = 2000
#: Bytes of a stdio server's stderr kept (in a temporary file) while it runs; past it the file is
#: cut back to its last :data:`STDERR_TAIL_BYTES` bytes.
STDERR_MAX_BYTES: Final = 1024 * 1024
#: How often a connected stdio server's stderr file is checked against :data:`STDERR_MAX_BYTES`.
STDERR_CHECK_INTERVAL: Final = 10.0

#: An http MCP server's connect, write and pool timeouts (seconds): the MCP SDK's own defaults.
MCP_HTTP_TIMEOUT: Final = 30.0
#: Longest silence on an http MCP server's response (seconds): a server may hold a response
#: stream open between messages (the MCP SDK's default).
MCP_HTTP_READ_TIMEOUT: Final = 300.0

#: Allowed state moves of one server.
MCP_MOVES: Final[Mapping[McpState, frozenset[McpState]]] = {
    McpState.STARTING: frozenset({McpState.CONNECTED, McpState.FAILED, McpState.STOPPED}),
    McpState.CONNECTED: frozenset({McpState.FAILED, McpState.STOPPED}),
    McpState.FAILED: frozenset({McpState.STOPPED}),
    McpState.STOPPED: frozenset(),
    McpState.DISABLED: frozenset(),
}


def mcp_tool_name(server: str, tool: str) -> str:
    """``mcp_<server>_<tool>`` with characters the model APIs refuse replaced by ``_``, cut to
    :data:`MAX_TOOL_NAME` characters (with a short hash so cut names stay distinct).

    The config refuses server names whose tools' names could meet (``fs`` and ``fs_read``);
    two tools that still get one name (``a.b`` and ``a_b``, a cut name) are both left out
    (:meth:`McpServer._make_tools`, :meth:`McpManager.tools`), never one run for the other.
    """
    name = MCP_NAME_UNSAFE.sub("_", f"{MCP_TOOL_PREFIX}{server}_{tool}")
    if len(name) > MAX_TOOL_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        name = f"{name[: MAX_TOOL_NAME - 9]}_{digest}"
    return name


def _cut(text: str) -> str:
    if len(text) <= MAX_MCP_RESULT_CHARS:
        return text
    return (
        text[:MAX_MCP_RESULT_CHARS]
        + f"\n[output cut at {MAX_MCP_RESULT_CHARS} characters of {len(text)}]"
    )


def render_result(server: str, tool: str, result: Any) -> ToolResult:
    """An MCP ``CallToolResult`` as the model reads it: text blocks as text, images and audio as
    a note, embedded text resources as text, links as their URI, structured content as JSON when
    there is nothing else; ``isError`` makes it an error result."""
    pieces: list[str] = []
    for block in result.content or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            pieces.append(block.text)
        elif kind in ("image", "audio"):
            size = len(block.data) * 3 // 4
            pieces.append(
                f"[{kind} result ({block.mime_type}, about {size} bytes) from {tool}; "
                "not shown to the model]"
            )
        elif kind == "resource":
            contents = block.resource
            text = getattr(contents, "text", None)
            if text is not None:
                pieces.append(text)
            else:
                pieces.append(f"[binary resource {contents.uri} ({contents.mime_type or '?'})]")
        elif kind == "resource_link":
            pieces.append(f"[resource {block.uri}]")
        else:
            pieces.append(f"[{kind or 'unknown'} content from {tool}]")
    if not pieces and getattr(result, "structured_content", None) is not None:
        pieces.append(orjson.dumps(result.structured_content).decode())
    text = "\n".join(pieces)
    if result.is_error:
        return ToolResult(
            content=_cut(f"MCP tool {tool} of server {server} failed: {text or 'no details'}"),
            is_error=True,
        )
    return ToolResult(content=_cut(text) if text else f"{tool} returned no content")


@attrs.define(eq=False)
class McpTool:
    """One tool of a connected MCP server, as the toolbox offers it."""

    spec: ToolSpec
    server: McpServer
    tool: str

    async def run(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Ask for permission, then call the tool on its server, bounded by ``ctx.timeout``."""
        await ask_permission(
            ctx,
            tool_name=self.spec.name,
            action="execute",
            description=f"call tool {self.tool!r} of MCP server {self.server.name!r}",
            params=params,
            path=ctx.workspace,
        )
        return await self.server.call(self.tool, params, ctx.timeout)


class McpServer:
    """One configured MCP server: its state, its tools and its connection."""

    def __init__(
        self,
        name: str,
        config: McpServerConfig,
        *,
        cwd: Path,
        on_change: Callable[[McpServer], None],
    ) -> None:
        self.name = name
        self.config = config
        self.cwd = cwd
        self._on_change = on_change
        self.state = McpState.DISABLED if config.disabled else McpState.STARTING
        self.error = ""
        self.tools: list[McpTool] = []
        self.pid: int | None = None
        self._session: Any = None
        self._scope: trio.CancelScope | None = None
        #: Set by :meth:`stop`: a cancel is a stop, not a start timeout.
        self._stopping = False
        self.done = trio.Event()

    @property
    def info(self) -> McpServerInfo:
        return McpServerInfo(
            name=self.name,
            type=self.config.type,
            state=self.state,
            error=self.error,
            tools=[t.spec.name for t in self.tools],
        )

    def _move(self, new: McpState, error: str = "") -> None:
        if new not in MCP_MOVES[self.state]:
            raise IllegalTransition(
                f"MCP server {self.name!r}: cannot move from {self.state.value} to {new.value}"
            )
        self.state = new
        self.error = error
        if new is not McpState.CONNECTED:
            self.tools = []
            self._session = None
        if new is McpState.FAILED:
            log.warning("MCP server %r failed: %s", self.name, error)
        else:
            log.info("MCP server %r: %s", self.name, new.value)
        self._on_change(self)

    def stop(self) -> None:
        """Stop the server (its task winds the connection down)."""
        self._stopping = True
        if self._scope is not None:
            self._scope.cancel()

    async def call(self, tool: str, params: dict[str, Any], limit: float) -> ToolResult:
        """Call ``tool`` with ``params``; every failure becomes an error result."""
        from mcp import MCPError

        session = self._session
        if session is None or self.state is not McpState.CONNECTED:
            return ToolResult(
                content=f"MCP server {self.name!r} is {self.state.value}"
                + (f" ({self.error})" if self.error else "")
                + f"; its tool {tool} cannot be called now",
                is_error=True,
            )
        try:
            with trio.move_on_after(limit):
                result = await session.call_tool(tool, params)
                return render_result(self.name, tool, result)
        except MCPError as exc:
            return ToolResult(
                content=f"MCP tool {tool} of server {self.name!r} failed: {exc}", is_error=True
            )
        return ToolResult(
            content=f"MCP tool {tool} of server {self.name!r} did not answer within {limit:g} s "
            "(options.tool_timeout)",
            is_error=True,
        )

    async def serve(self) -> None:
        """Start the server, serve its tools until it dies or is stopped, then wind it down."""
        if self.state is McpState.DISABLED:
            self.done.set()
            return
        errlog: IO[str] | None = None
        try:
            with trio.CancelScope() as scope:
                self._scope = scope
                scope.deadline = trio.current_time() + self.config.timeout
                try:
                    if self.config.type == "stdio":
                        errlog = tempfile.TemporaryFile(  # noqa: SIM115 - closed in finally
                            "w+", encoding="utf-8", errors="replace"
                        )
                    await self._connect_and_serve(scope, errlog)
                except Exception as exc:
                    if self.state is not McpState.FAILED:
                        self._move(McpState.FAILED, self._describe(exc, errlog))
                    return
            if scope.cancelled_caught and self.state is McpState.STARTING and not self._stopping:
                self._move(
                    McpState.FAILED,
                    f"did not start within {self.config.timeout:g} s "
                    f"(mcp.{self.name}.timeout){self._stderr_tail(errlog)}; check its "
                    "command or url, or raise the timeout",
                )
        finally:
            # A failed server stays failed (with its reason); the others end stopped.
            if self.state in (McpState.STARTING, McpState.CONNECTED):
                self._move(McpState.STOPPED)
            if errlog is not None:
                errlog.close()
            self.done.set()

    def _describe(self, exc: Exception, errlog: IO[str] | None) -> str:
        inner = unwrap_group(exc)
        text = f"{type(inner).__name__}: {inner}"
        if isinstance(inner, OSError) and self.config.type == "stdio":
            text = f"cannot run {self.config.command!r}: {inner.strerror or inner}"
        elif "Connection closed" in str(inner):
            when = "at start" if self.state is McpState.STARTING else "while connected"
            text = f"the server closed the connection {when}"
        return text + self._stderr_tail(errlog)

    @staticmethod
    def _stderr_tail(errlog: IO[str] | None) -> str:
        if errlog is None:
            return ""
        try:
            errlog.flush()
            size = errlog.seek(0, 2)
            errlog.seek(max(0, size - STDERR_TAIL_BYTES))
            tail = errlog.read().strip()
        except (OSError, ValueError):
            return ""
        return f"; its stderr ends with: {tail}" if tail else ""

    async def _connect_and_serve(self, scope: trio.CancelScope, errlog: IO[str] | None) -> None:
        from mcp import ClientSession
        from mcp.types import ToolListChangedNotification

        closed = False
        relist = False
        wake = trio.Event()

        def on_close() -> None:
            nonlocal closed
            closed = True
            wake.set()

        async def on_message(message: Any) -> None:
            nonlocal relist
            if isinstance(message, ToolListChangedNotification):
                relist = True
                wake.set()

        async with contextlib.AsyncExitStack() as stack:
            read, write = await stack.enter_async_context(self._transport(errlog))
            session = await stack.enter_async_context(
                ClientSession(_WatchedStream(read, on_close), write, message_handler=on_message)
            )
            await session.initialize()
            listing = await session.list_tools()
            scope.deadline = math.inf
            self._session = session
            self.tools = self._make_tools(listing.tools)
            self._move(McpState.CONNECTED)
            while not closed:
                with trio.move_on_after(STDERR_CHECK_INTERVAL):
                    await wake.wait()
                wake = trio.Event()
                if relist and not closed:
                    relist = False
                    await self._relist(session)
                _bound_stderr(errlog)
            self._move(McpState.FAILED, "the server closed the connection while connected")

    async def _relist(self, session: Any) -> None:
        """Take the server's tool list again (it said it changed), bounded by its timeout."""
        with trio.move_on_after(self.config.timeout):
            try:
                listing = await session.list_tools()
            except Exception as exc:
                log.warning("MCP server %r: listing its tools again failed: %s", self.name, exc)
                return
            self.tools = self._make_tools(listing.tools)
            log.info("MCP server %r: its tools changed (%d now)", self.name, len(self.tools))
            self._on_change(self)

    def _transport(self, errlog: IO[str] | None) -> Any:
        from mcp import StdioServerParameters, stdio_client
        from mcp.client.sse import sse_client
        from mcp.client.streamable_http import streamable_http_client

        config = self.config
        if config.type == "stdio":
            assert errlog is not None
            params = StdioServerParameters(
                command=config.command, args=list(config.args), env=dict(config.env), cwd=self.cwd
            )
            return stdio_client(params, errlog=cast("TextIO", errlog))
        if config.type == "sse":
            return sse_client(config.url, headers=dict(config.headers))

        @contextlib.asynccontextmanager
        async def http() -> Any:
            async with (
                mcp_http_client(config.headers) as client,
                streamable_http_client(config.url, http_client=client) as streams,
            ):
                yield streams

        return http()

    def _make_tools(self, listed: list[Any]) -> list[McpTool]:
        """The tools to offer; tools whose names meet (``a.b`` and ``a_b``) are all left out,
        with an error line, so that no call or grant for one reaches the other."""
        tools: list[McpTool] = []
        offered = [t for t in listed if t.name not in self.config.disabled_tools]
        owners: dict[str, list[str]] = {}
        for tool in offered:
            owners.setdefault(mcp_tool_name(self.name, tool.name), []).append(tool.name)
        for tool in offered:
            name = mcp_tool_name(self.name, tool.name)
            if len(owners[name]) > 1:
                log.error(
                    "MCP server %r: tools %s all have the name %s; all are left out (rename "
                    "them in the server, or list all but one in disabled_tools)",
                    self.name,
                    ", ".join(map(repr, owners[name])),
                    name,
                )
                continue
            schema = dict(tool.input_schema or {})
            schema.setdefault("type", "object")
            spec = ToolSpec(
                name, tool.description or f"{tool.name} (MCP server {self.name})", schema
            )
            tools.append(McpTool(spec, self, tool.name))
        return tools


def _bound_stderr(errlog: IO[str] | None) -> None:
    """Cut a server's stderr file back to its tail once it passes :data:`STDERR_MAX_BYTES`. The
    server shares the file offset, so its next writes land after the kept tail."""
    if errlog is None:
        return
    try:
        size = errlog.seek(0, 2)
        if size <= STDERR_MAX_BYTES:
            return
        errlog.seek(size - STDERR_TAIL_BYTES)
        tail = errlog.read()
        errlog.seek(0)
        errlog.truncate()
        errlog.write(tail)
        errlog.flush()
    except (OSError, ValueError):
        log.debug("could not cut an MCP server's stderr file", exc_info=True)


class _WatchedStream:
    """The transport's read stream, calling ``on_close`` when it ends (the server went away)."""

    def __init__(self, inner: Any, on_close: Callable[[], None]) -> None:
        self._inner = inner
        self._on_close = on_close

    async def receive(self) -> Any:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._on_close()
            raise

    def __aiter__(self) -> _WatchedStream:
        return self

    async def __anext__(self) -> Any:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def __aenter__(self) -> _WatchedStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class McpManager:
    """The MCP servers of one workspace (see the module docstring).

    Args:
        configs: the config's ``mcp`` section.
        cwd: where stdio servers run (the workspace).
        on_change: called with a server's info each time its state changes.
    """

    def __init__(
        self,
        configs: Mapping[str, McpServerConfig],
        *,
        cwd: Path,
        on_change: Callable[[McpServerInfo], None] = lambda info: None,
    ) -> None:
        self.cwd = cwd
        self._on_change = on_change
        self.servers: dict[str, McpServer] = {}
        self._configs = dict(configs)
        self._nursery: trio.Nursery | None = None
        #: Tool names offered by several servers, already logged.
        self._reported: set[str] = set()

    def _changed(self, server: McpServer) -> None:
        if self.servers.get(server.name) is server:
            self._on_change(server.info)

    def info(self) -> list[McpServerInfo]:
        """Every server's state, by name."""
        return [self.servers[name].info for name in sorted(self.servers)]

    def tools(self) -> list[McpTool]:
        """The tools of the connected servers, by server name. A name two servers offer (the
        config refuses server names that allow it; a cut name could still meet) is left out for
        both, with an error line: neither may run under a grant given for the other."""
        tools = [t for name in sorted(self.servers) for t in self.servers[name].tools]
        count: dict[str, int] = {}
        for tool in tools:
            count[tool.spec.name] = count.get(tool.spec.name, 0) + 1
        clashes = {name for name, n in count.items() if n > 1}
        if not clashes:
            return tools
        for name in sorted(clashes - self._reported):
            log.error(
                "MCP tool name %s is offered by several servers (%s); left out for all of them",
                name,
                ", ".join(repr(t.server.name) for t in tools if t.spec.name == name),
            )
        self._reported = clashes
        return [t for t in tools if t.spec.name not in clashes]

    def _start(self, name: str, config: McpServerConfig) -> None:
        assert self._nursery is not None
        server = McpServer(name, config, cwd=self.cwd, on_change=self._changed)
        self.servers[name] = server
        self._on_change(server.info)
        self._nursery.start_soon(self._guarded, server, name=f"mcp server {name}")

    @staticmethod
    async def _guarded(server: McpServer) -> None:
        """Run one server; whatever it raises is reported, never fatal to the workspace."""
        try:
            await server.serve()
        except Exception as exc:
            log.exception("MCP server %r: unexpected failure", server.name)
            if server.state is not McpState.FAILED:
                server.state = McpState.FAILED
                server.error = f"internal error: {type(exc).__name__}: {exc}"
                server.tools = []
                server._on_change(server)
            server.done.set()

    async def run(
        self, *, task_status: trio.TaskStatus[McpManager] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Start every server in parallel and keep them until cancelled; then stop them all."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for name, config in sorted(self._configs.items()):
                self._start(name, config)
            task_status.started(self)
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
                for server in self.servers.values():
                    server.stop()

    def reconfigure(self, configs: Mapping[str, McpServerConfig]) -> None:
        """Use a reloaded ``mcp`` section: servers removed or changed stop, new or changed ones
        start; the others go on as they are."""
        self._configs = dict(configs)
        if self._nursery is None:
            return
        for name in sorted(set(self.servers) | set(configs)):
            old = self.servers.get(name)
            new = configs.get(name)
            if old is not None and new == old.config:
                continue
            if old is not None:
                old.stop()
                del self.servers[name]
                if new is None:
                    self._on_change(attrs.evolve(old.info, state=McpState.STOPPED, tools=[]))
            if new is not None:
                self._start(name, new)


def mcp_http_client(headers: Mapping[str, str]) -> httpx2.AsyncClient:
    """The HTTP client of one http MCP server: ``headers`` on every request,
    :data:`MCP_HTTP_TIMEOUT` to connect, write and wait for the pool, and
    :data:`MCP_HTTP_READ_TIMEOUT` between reads. Redirects are left to the SDK's transport,
    which follows them only within the server's origin (the client's ``follow_redirects`` is
    not consulted). The MCP SDK takes an ``httpx2`` client (its HTTP library)."""
    import httpx2

    return httpx2.AsyncClient(
        headers=dict(headers),
        timeout=httpx2.Timeout(MCP_HTTP_TIMEOUT, read=MCP_HTTP_READ_TIMEOUT),
    )
