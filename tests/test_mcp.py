"""MCP servers through the real server: a stdio server written with the SDK (tests/mcp_server.py)
offers its tools as ``mcp_<server>_<tool>``; calls ask for permission (unless allowed) and their
results reach the history; a server that exits or hangs at start, or dies later, is reported in
the agent info and by ``mcp`` agent events and the workspace works without it; closing the
workspace leaves no server process behind.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import orjson
import pytest
import trio

from crush_trio.client import Event, RunStatus, WorkspaceClient
from crush_trio.config import load_config_report
from crush_trio.providers.scripted import ScriptedModel, Step
from crush_trio.tools.mcp import MAX_TOOL_NAME, mcp_tool_name, render_result
from crush_trio.wire import AgentInfo, McpState, ToolResultPart

from .conftest import WAIT

if TYPE_CHECKING:
    from crush_trio.client.subscription import Subscription
    from crush_trio.testing import CrushServer

pytestmark = pytest.mark.slow

SERVER: Final = str(Path(__file__).with_name("mcp_server.py"))
#: Starting a Python MCP server (importing the SDK) takes seconds on a loaded machine.
START_WAIT: Final = 90.0
#: The start timeout of the server that hangs.
HANG_TIMEOUT: Final = 1.0


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _is_mcp(event: Event) -> bool:
    return event.type == "agent_event" and getattr(event.payload, "type", "") == "mcp"


async def _wait_states(
    ws: WorkspaceClient, feed: Subscription, want: dict[str, McpState]
) -> AgentInfo:
    """The agent info once every named server is in the wanted state (woken by mcp events)."""
    with trio.fail_after(START_WAIT):
        while True:
            info = await ws.agent_info()
            states = {s.name: s.state for s in info.mcp}
            if all(states.get(name) is state for name, state in want.items()):
                return info
            await feed.until(_is_mcp, START_WAIT)


@pytest.fixture
def crush_config(tmp_path: Path) -> dict[str, Any]:
    return {
        "mcp": {
            "test": {
                "type": "stdio",
                "command": sys.executable,
                "args": [SERVER, "serve", str(tmp_path / "test.pid")],
                "timeout": START_WAIT,
                "disabled_tools": ["fail"],
            },
            "broken": {"command": sys.executable, "args": [SERVER, "exit"]},
            "stuck": {
                "command": sys.executable,
                "args": [SERVER, "hang", str(tmp_path / "stuck.pid")],
                "timeout": HANG_TIMEOUT,
            },
            "off": {"command": "does-not-matter", "disabled": True},
            "missing": {"command": str(tmp_path / "no-such-server")},
        },
        "permissions": {"allowed_tools": ["mcp_test_die", "mcp_test_grow:execute"]},
    }


async def test_tools_of_an_mcp_server_ask_and_answer(
    tmp_path: Path,
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
) -> None:
    ws = crush_workspace
    async with ws.subscribe(timeout=START_WAIT) as feed:
        info = await _wait_states(
            ws,
            feed,
            {
                "test": McpState.CONNECTED,
                "broken": McpState.FAILED,
                "stuck": McpState.FAILED,
                "off": McpState.DISABLED,
                "missing": McpState.FAILED,
            },
        )
    servers = {s.name: s for s in info.mcp}
    assert [s.name for s in info.mcp] == ["broken", "missing", "off", "stuck", "test"]
    assert servers["missing"].error.startswith("cannot run ")
    assert "No such file or directory" in servers["missing"].error
    assert servers["test"].tools == [
        "mcp_test_add",
        "mcp_test_picture",
        "mcp_test_grow",
        "mcp_test_die",
    ]
    assert servers["test"].error == ""
    assert "closed the connection at start" in servers["broken"].error
    assert "bad configuration, giving up" in servers["broken"].error  # its stderr
    assert "did not start within 1 s (mcp.stuck.timeout)" in servers["stuck"].error
    stuck_pid = int((tmp_path / "stuck.pid").read_text())
    assert _pid_gone(stuck_pid)  # a server that hung at start was stopped

    scripted_model.add(
        Step(tool_calls=[("mcp_test_add", {"a": 2, "b": 40})]),
        Step(tool_calls=[("mcp_test_picture", {})]),
        Step(tool_calls=[("mcp_test_fail", {"reason": "x"})]),
        Step(text="done"),
    )
    sid = (await ws.create_session()).id
    handle = await ws.prompt(sid, "add them", run_id="m1")
    asked = await handle.next_permission_request(WAIT)
    assert asked is not None
    assert asked.tool_name == "mcp_test_add"
    assert asked.action == "execute"
    assert asked.params == {"a": 2, "b": 40}
    assert "'add' of MCP server 'test'" in asked.description
    assert await ws.grant(asked.id, "allow")
    asked = await handle.next_permission_request(WAIT)
    assert asked is not None
    assert asked.tool_name == "mcp_test_picture"
    assert await ws.grant(asked.id, "allow")
    run = await handle.result(WAIT)
    assert run.status is RunStatus.COMPLETED
    assert run.text == "done"

    # The model saw the tools with their JSON schemas (the disabled one left out).
    offered = {t.name: t for t in scripted_model.requests[0].tools}
    assert "mcp_test_fail" not in offered
    add = offered["mcp_test_add"]
    assert add.description == "Add two integers."
    assert add.parameters["required"] == ["a", "b"]
    assert add.parameters["properties"]["a"]["type"] == "integer"
    results = [p for m in await ws.messages(sid) for p in m.parts if isinstance(p, ToolResultPart)]
    assert [r.content for r in results[:1]] == ["42"]
    assert not results[0].is_error
    assert results[1].content.startswith("[image result (image/png, about ")
    assert "not shown to the model" in results[1].content
    assert not results[1].is_error
    assert results[2].is_error
    assert "unknown tool 'mcp_test_fail'" in results[2].content

    # Closing the workspace stops the server: its process is gone.
    test_pid = int((tmp_path / "test.pid").read_text())
    assert not _pid_gone(test_pid)
    workspace = crush_server.backend.get(ws.id)
    workspace.request_shutdown()
    with trio.fail_after(WAIT):
        await workspace.closed.wait()
    assert _pid_gone(test_pid)
    assert {s.name: s.state for s in workspace.mcp.info()} == {
        "broken": McpState.FAILED,
        "missing": McpState.FAILED,
        "off": McpState.DISABLED,
        "stuck": McpState.FAILED,
        "test": McpState.STOPPED,
    }


async def test_a_server_that_dies_is_reported_and_the_workspace_goes_on(
    tmp_path: Path, crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    scripted_model.add(
        Step(tool_calls=[("mcp_test_grow", {})]),
        Step(text="grown"),
        Step(tool_calls=[("mcp_test_die", {})]),
        Step(text="after"),
    )
    async with ws.subscribe(timeout=START_WAIT) as feed:
        await _wait_states(ws, feed, {"test": McpState.CONNECTED})
        sid = (await ws.create_session()).id
        # The server says its tool list changed: the new tool joins the toolbox.
        handle = await ws.prompt(sid, "grow", run_id="g1")
        assert (await handle.result(WAIT)).text == "grown"
        assert handle.permission_requests == {}  # allowed as "mcp_test_grow:execute"
        grown = await feed.until(
            lambda e: _is_mcp(e) and "mcp_test_extra" in e.payload.mcp.tools, WAIT
        )
        assert grown.payload.mcp.state is McpState.CONNECTED
        handle = await ws.prompt(sid, "die", run_id="d1")
        run = await handle.result(WAIT)
        # permissions.allowed_tools names it: no permission asked.
        assert handle.permission_requests == {}
        assert run.status is RunStatus.COMPLETED
        assert run.text == "after"
        failed = await feed.until(
            lambda e: (
                _is_mcp(e)
                and e.payload.mcp.state is McpState.FAILED
                and e.payload.mcp.name == "test"
            ),
            WAIT,
        )
    event = failed.payload
    assert event.error == "the server closed the connection while connected"
    assert event.text.startswith("MCP server 'test' failed")
    assert failed.raw is not None
    assert failed.raw["payload"]["payload"]["mcp"]["state"] == "failed"
    info = {s.name: s for s in (await ws.agent_info()).mcp}
    assert info["test"].state is McpState.FAILED
    assert info["test"].tools == []
    results = [p for m in await ws.messages(sid) for p in m.parts if isinstance(p, ToolResultPart)]
    assert [r.content for r in results] == ["grown", "exiting"]
    # The workspace goes on without it; its tools are no longer offered.
    handle = await ws.prompt(sid, "still there?", run_id="d2")
    assert (await handle.result(WAIT)).status is RunStatus.COMPLETED
    assert "mcp_test_add" not in {t.name for t in scripted_model.requests[-1].tools}
    assert _pid_gone(int((tmp_path / "test.pid").read_text()))


def test_tool_names_are_safe_for_the_model_apis() -> None:
    assert mcp_tool_name("github", "create_issue") == "mcp_github_create_issue"
    assert mcp_tool_name("my server", "a.b/c") == "mcp_my_server_a_b_c"
    long_a = mcp_tool_name("s", "x" * 100 + "a")
    long_b = mcp_tool_name("s", "x" * 100 + "b")
    assert len(long_a) == MAX_TOOL_NAME
    assert long_a != long_b


def test_results_text_images_and_errors() -> None:
    from mcp.types import CallToolResult, ImageContent, TextContent

    ok = CallToolResult(
        content=[
            TextContent(type="text", text="one"),
            ImageContent(type="image", data="AAAA", mime_type="image/png"),
        ]
    )
    rendered = render_result("s", "t", ok)
    assert not rendered.is_error
    assert rendered.content.splitlines()[0] == "one"
    assert "[image result (image/png, about 3 bytes) from t" in rendered.content
    failed = render_result(
        "s", "t", CallToolResult(content=[TextContent(type="text", text="no")], is_error=True)
    )
    assert failed.is_error
    assert failed.content == "MCP tool t of server s failed: no"
    structured = render_result("s", "t", CallToolResult(content=[], structured_content={"n": 1}))
    assert structured.content == '{"n":1}'


def test_only_a_trusted_workspace_may_define_mcp_servers(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    user = tmp_path / "user"
    user.mkdir()
    server = {"mcp": {"evil": {"command": "sh", "args": ["-c", "touch pwned"]}}}
    (project / "crush.json").write_bytes(orjson.dumps(server))
    env: dict[str, str] = {}
    loaded = load_config_report(config_file=None, workspace=project, env=env, user_config_dir=user)
    assert loaded.config.mcp == {}
    assert any("$.mcp" in w and "untrusted" in w for w in loaded.warnings)
    (user / "crush.json").write_bytes(orjson.dumps({"trusted_workspaces": [str(project)]}))
    loaded = load_config_report(config_file=None, workspace=project, env=env, user_config_dir=user)
    assert loaded.config.mcp["evil"].command == "sh"


def test_an_mcp_entry_needs_what_its_type_needs(tmp_path: Path) -> None:
    from crush_trio.errors import ConfigError

    file = tmp_path / "crush.json"
    file.write_bytes(orjson.dumps({"mcp": {"a": {"type": "http"}, "b": {"type": "stdio"}}}))
    with pytest.raises(ConfigError) as err:
        load_config_report(config_file=file, workspace=None, env={})
    assert "$.mcp.a.url: an http MCP server needs a url" in err.value.message
    assert "$.mcp.b.command: a stdio MCP server needs a command" in err.value.message


@pytest.mark.parametrize("crush_config", [{}])
async def test_servers_of_a_workspace_start_once_it_is_trusted(
    tmp_path: Path, crush_server: CrushServer, crush_client: Any
) -> None:
    project = crush_server.project()
    pid_file = tmp_path / "project.pid"
    entry = {
        "command": sys.executable,
        "args": [SERVER, "serve", str(pid_file)],
        "timeout": START_WAIT,
    }
    (project / "crush.json").write_bytes(orjson.dumps({"mcp": {"proj": entry}}))
    async with crush_client.workspace(project) as ws:
        assert (await ws.agent_info()).mcp == []  # untrusted: its mcp section is ignored
        assert any("$.mcp" in w for w in ws.info.warnings)
        assert not pid_file.exists()
        async with ws.subscribe(timeout=START_WAIT) as feed:
            await ws.client.request("POST", f"/v1/workspaces/{ws.id}/trust", json={"trusted": True})
            info = await _wait_states(ws, feed, {"proj": McpState.CONNECTED})
        assert "mcp_proj_add" in info.mcp[0].tools
        pid = int(pid_file.read_text())
        workspace = crush_server.backend.get(ws.id)
        workspace.request_shutdown()
        with trio.fail_after(WAIT):
            await workspace.closed.wait()
    assert _pid_gone(pid)


async def test_an_http_server_with_headers() -> None:
    import socket
    import subprocess

    from crush_trio.config import McpServerConfig
    from crush_trio.tools.mcp import McpManager

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = await trio.lowlevel.open_process(
        [sys.executable, SERVER, "http", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    listening = trio.Event()

    async def read_log() -> None:  # until it says it listens, then drain it
        assert process.stderr is not None
        seen = b""
        async for chunk in process.stderr:
            seen = (seen + chunk)[-4096:]
            if b"Uvicorn running on" in seen:
                listening.set()

    seen: list[McpState] = []
    changed = trio.Event()

    def on_change(info: Any) -> None:
        seen.append(info.state)
        changed.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_log)
            with trio.fail_after(START_WAIT):
                await listening.wait()
            config = McpServerConfig(
                type="http", url=f"http://127.0.0.1:{port}/mcp", headers={"X-Token": "t"}
            )
            manager = McpManager({"web": config}, cwd=Path.cwd(), on_change=on_change)
            async with trio.open_nursery() as servers:
                await servers.start(manager.run)
                server = manager.servers["web"]
                with trio.fail_after(START_WAIT):
                    while server.state is McpState.STARTING:
                        changed = trio.Event()
                        await changed.wait()
                assert server.state is McpState.CONNECTED, server.error
                assert [t.spec.name for t in manager.tools()][:1] == ["mcp_web_add"]
                result = await server.call("add", {"a": 1, "b": 2}, WAIT)
                assert result.content == "3"
                assert not result.is_error
                servers.cancel_scope.cancel()
            assert seen == [McpState.STARTING, McpState.CONNECTED, McpState.STOPPED]
            nursery.cancel_scope.cancel()
    finally:
        process.terminate()
        with trio.move_on_after(WAIT):
            await process.wait()


def test_a_servers_stderr_file_stays_bounded() -> None:
    import subprocess
    import tempfile

    from crush_trio.tools import mcp

    script = (
        "import sys\n"
        "sys.stderr.write('x' * (2 * 1024 * 1024) + 'LAST')\n"
        "sys.stderr.flush()\n"
        "sys.stdin.readline()\n"
        "sys.stderr.write('NEXT')\n"
    )
    with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as errlog:
        child = subprocess.Popen(
            [sys.executable, "-c", script], stdin=subprocess.PIPE, stderr=errlog, text=True
        )
        try:
            import time

            deadline = time.monotonic() + WAIT
            while errlog.seek(0, 2) < 2 * 1024 * 1024 + 4:  # the child writes 2 MiB at once
                assert time.monotonic() < deadline, "the child did not write its stderr"
                assert child.poll() is None
            mcp._bound_stderr(errlog)
            assert errlog.seek(0, 2) == mcp.STDERR_TAIL_BYTES
            assert child.stdin is not None
            child.communicate("\n", timeout=WAIT)
        finally:
            child.kill()
        errlog.seek(0)
        text = errlog.read()
    # The child's next write lands after the kept tail (the file offset is shared).
    assert text.endswith("xLASTNEXT")
    assert len(text) == mcp.STDERR_TAIL_BYTES + 4


def test_servers_whose_tool_names_could_meet_are_refused(tmp_path: Path) -> None:
    """``fs``/``read_file`` and ``fs_read``/``file`` would both be ``mcp_fs_read_file``, and one
    would run under a grant given for the other."""
    from crush_trio.errors import ConfigError

    file = tmp_path / "crush.json"
    for pair in (("fs", "fs_read"), ("a.b", "a_b")):
        servers = {name: {"command": "true"} for name in pair}
        file.write_bytes(orjson.dumps({"mcp": servers}))
        with pytest.raises(ConfigError) as err:
            load_config_report(config_file=file, workspace=None, env={})
        assert f"$.mcp.{pair[1]}: the tools of MCP servers" in err.value.message
        assert repr(pair[0]) in err.value.message
        assert repr(pair[1]) in err.value.message
    file.write_bytes(orjson.dumps({"mcp": {"fs": {"command": "true"}, "fsx": {"command": "t"}}}))
    assert set(load_config_report(config_file=file, workspace=None, env={}).config.mcp) == {
        "fs",
        "fsx",
    }


def test_tools_whose_names_meet_are_all_left_out() -> None:
    from mcp.types import Tool

    from crush_trio.config import McpServerConfig
    from crush_trio.tools.mcp import McpManager, McpServer

    def listed(*names: str) -> list[Tool]:
        return [Tool(name=n, input_schema={"type": "object"}) for n in names]

    manager = McpManager({}, cwd=Path("."))

    def server(name: str, *tools: str) -> McpServer:
        made = McpServer(name, McpServerConfig(command="x"), cwd=Path("."), on_change=print)
        made.tools = made._make_tools(listed(*tools))
        manager.servers[name] = made
        return made

    # Within one server: a.b and a_b get one name; neither is offered.
    one = server("s", "a.b", "a_b", "c")
    assert [t.spec.name for t in one.tools] == ["mcp_s_c"]
    # Across servers (the issue's case, should a config reach the manager unchecked): the name
    # is left out for both, so neither runs under a grant given for the other.
    server("fs", "read_file", "list")
    server("fs_read", "file")
    names = [t.spec.name for t in manager.tools()]
    assert "mcp_fs_read_file" not in names
    assert names == ["mcp_fs_list", "mcp_s_c"]


async def test_the_http_client_of_an_mcp_server_sends_its_headers_with_the_named_timeouts() -> None:
    import httpx2

    from crush_trio.tools import mcp

    async with mcp.mcp_http_client({"X-Token": "t"}) as client:
        assert client.headers["x-token"] == "t"
        assert client.timeout == httpx2.Timeout(
            mcp.MCP_HTTP_TIMEOUT, read=mcp.MCP_HTTP_READ_TIMEOUT
        )
        # The SDK's transport follows redirects itself, within the server's origin only.
        assert not client.follow_redirects
