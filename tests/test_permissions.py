"""Tools and permissions through the real server: requests to every client, first answer wins,
deny ends the turn, session grants, skip, and cancels while waiting or inside a tool.

The server, client and model come from the pytest plugin; permission requests are read from run
handles (``RunHandle.next_permission_request``) or workspace subscriptions and answered with
``WorkspaceClient.grant``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import orjson
import pytest
import trio
import trio.testing

from crush_trio.client import Event, RunStatus, WorkspaceClient, connect
from crush_trio.providers.scripted import ScriptedModel, Step
from crush_trio.store import Store
from crush_trio.wire import (
    FinishReason,
    PermissionNotification,
    PermissionRequest,
    Role,
    ToolCallPart,
    ToolResultPart,
)

from .conftest import WAIT, completes_run, payloads

if TYPE_CHECKING:
    from collections.abc import Callable

    from crush_trio.testing import CrushServer


def is_type(event_type: str) -> Callable[[Event], bool]:
    return lambda e: e.type == event_type


async def test_two_clients_first_answer_wins(
    tmp_path: Path,
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
) -> None:
    ws = crush_workspace
    scripted_model.add(
        Step(tool_calls=[("write", {"path": "out.txt", "content": "hello"})]),
        Step(text="written"),
    )
    sid = (await ws.create_session()).id
    async with (
        connect(crush_server.url, crush_server.token) as second_client,
        second_client.workspace(ws.path) as other,
        other.subscribe(timeout=WAIT) as second,
        ws.subscribe(timeout=WAIT) as first,
    ):
        assert other.id == ws.id  # the same workspace, joined by another client
        handle = await ws.prompt(sid, "write it", run_id="w")
        asked = await first.until(is_type("permission_request"), WAIT)
        asked_second = await second.until(is_type("permission_request"), WAIT)
        assert asked.raw is not None
        assert asked_second.raw is not None
        assert asked.raw["payload"] == asked_second.raw["payload"]
        req: PermissionRequest = asked.payload
        # A tab opened later can still show it.
        pending = await ws.client.request("GET", f"/v1/workspaces/{ws.id}/permissions")
        assert pending == [asked.raw["payload"]["payload"]]
        assert req.tool_name == "write"
        assert req.session_id == sid
        assert req.path.endswith("out.txt")
        assert await ws.grant(req.id, "allow") is True
        assert await other.grant(req.id, "deny") is False  # late answer
        run = await handle.result(WAIT)
        seen = await first.collect_until(completes_run("w"), WAIT)
        note = (await second.until(is_type("permission_notification"), WAIT)).payload
    assert list(handle.permission_requests) == [req.id]
    assert run.text == "written"
    assert run.error is None
    notes: list[PermissionNotification] = payloads(seen, "permission_notification")
    assert len(notes) == 1
    assert notes[0].granted is True
    assert notes[0].denied is False
    assert note == notes[0]
    assert (tmp_path / "out.txt").exists() is False  # written inside the workspace, not tmp
    assert (Path(ws.path) / "out.txt").read_text() == "hello"


async def test_deny_ends_the_turn_with_a_clear_result(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    scripted_model.add(
        Step(tool_calls=[("bash", {"command": "touch made-by-bash"})]), Step(text="never")
    )
    sid = (await ws.create_session()).id
    handle = await ws.prompt(sid, "run it", run_id="d")
    asked = await handle.next_permission_request(WAIT)
    assert asked is not None
    assert asked.tool_name == "bash"
    assert await ws.grant(asked.id, "deny") is True
    assert await handle.next_permission_request(WAIT) is None  # asked once, then ended
    run = await handle.result(WAIT)
    assert run.status is RunStatus.COMPLETED
    assert run.error is None
    assert len(scripted_model.requests) == 1  # the turn ended at the denial
    result = (await ws.messages(sid))[-1].parts[0]
    assert isinstance(result, ToolResultPart)
    assert result.is_error is True
    assert "denied" in result.content
    assert not (Path(ws.path) / "made-by-bash").exists()


@pytest.mark.parametrize("crush_config", [{"options": {"permission_timeout": 30}}])
async def test_unanswered_request_times_out_and_the_record_says_why(
    autojump_clock: trio.testing.MockClock,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
) -> None:
    ws = crush_workspace
    scripted_model.add(
        Step(tool_calls=[("bash", {"command": "touch made-by-bash"})]), Step(text="never")
    )
    sid = (await ws.create_session()).id
    async with ws.subscribe(timeout=WAIT) as feed:
        handle = await ws.prompt(sid, "run it", run_id="t")
        asked = await handle.next_permission_request(WAIT)
        assert asked is not None
        assert asked.tool_name == "bash"
        started = trio.current_time()
        notified = await feed.until(is_type("permission_notification"), WAIT * 10)
        assert trio.current_time() - started >= 30  # not before options.permission_timeout
        assert notified.payload.id == asked.id
        assert notified.payload.denied is True
        run = await handle.result(WAIT, check=False)
    assert run.status is RunStatus.FAILED
    assert run.error is not None, run.error
    assert "options.permission_timeout" in run.error, run.error
    assert "30 s" in run.error
    assert "bash" in run.error
    assert len(scripted_model.requests) == 1  # the turn ended at the timeout
    results = [p for m in await ws.messages(sid) for p in m.parts if isinstance(p, ToolResultPart)]
    assert len(results) == 1
    assert "timed out" in results[0].content
    assert not (Path(ws.path) / "made-by-bash").exists()


async def test_allow_session_is_remembered_only_for_that_session(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    call = ("write", {"path": "same.txt", "content": "x"})
    scripted_model.add(
        Step(tool_calls=[call]),
        Step(text="a"),
        Step(tool_calls=[call]),
        Step(text="b"),
        # The other session views the file first: it exists now (read-before-edit).
        Step(tool_calls=[("view", {"path": "same.txt"})]),
        Step(tool_calls=[call]),
        Step(text="c"),
    )
    sid = (await ws.create_session()).id
    other = (await ws.create_session()).id
    async with ws.subscribe(timeout=WAIT) as feed:
        s1 = await ws.prompt(sid, "one", run_id="s1")
        asked = await feed.until(is_type("permission_request"), WAIT)
        assert await ws.grant(asked.payload.id, "allow_session")
        await s1.result(WAIT)
        s2 = await ws.prompt(sid, "two", run_id="s2")
        assert (await s2.result(WAIT)).text == "b"
        assert s2.permission_requests == {}  # not asked again in the same session
        s3 = await ws.prompt(other, "three", run_id="s3")
        asked_again = await feed.until(is_type("permission_request"), WAIT)
        assert asked_again.payload.session_id == other
        assert await ws.grant(asked_again.payload.id, "allow")
        await s3.result(WAIT)
    assert list(s3.permission_requests) == [asked_again.payload.id]


async def test_skip_approves_everything_in_the_workspace(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    scripted_model.add(
        Step(tool_calls=[("write", {"path": "f.txt", "content": "y"})]), Step(text="ok")
    )
    sid = (await ws.create_session()).id
    await ws.set_skip(True)
    async with ws.subscribe(timeout=WAIT) as feed:
        handle = await ws.prompt(sid, "go", run_id="k")
        assert (await handle.result(WAIT)).text == "ok"
        seen = await feed.collect_until(completes_run("k"), WAIT)
    assert payloads(seen, "permission_request") == []


async def test_cancel_while_a_permission_request_waits(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    scripted_model.add(
        Step(text="let me write", tool_calls=[("write", {"path": "p.txt", "content": "z"})])
    )
    sid = (await ws.create_session()).id
    async with ws.subscribe(timeout=WAIT) as feed:
        handle = await ws.prompt(sid, "go", run_id="pc")
        req = (await feed.until(is_type("permission_request"), WAIT)).payload
        await ws.cancel(sid)
        run = await handle.result(WAIT)
        assert run.status is RunStatus.CANCELLED
        assert run.error is None
        note = (await feed.until(is_type("permission_notification"), WAIT)).payload
    assert note.denied is True  # withdrawn, so every client can drop it
    assert not await ws.grant(req.id, "allow")
    tool = (await ws.messages(sid))[-1]
    assert tool.role is Role.TOOL
    result = tool.parts[0]
    assert isinstance(result, ToolResultPart)
    assert result.content == "Error: user cancelled assistant tool calling"


async def test_cancel_inside_a_tool_call_leaves_a_valid_history(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    scripted_model.add(Step(tool_calls=[("bash", {"command": "sleep 30"})]), Step(text="next turn"))
    sid = (await ws.create_session()).id
    await ws.set_skip(True)
    handle = await ws.prompt(sid, "slow tool", run_id="t1")
    # Wait until the tool call is stored as finished: the tool is running.
    async for event in handle.events(WAIT):
        if event.type == "message" and any(c.finished for c in event.payload.tool_calls()):
            break
    else:
        raise AssertionError("run t1 ended before its tool call was stored")
    await ws.cancel(sid)
    assert (await handle.result(WAIT)).status is RunStatus.CANCELLED
    assert (await ws.run(sid, "again", timeout=WAIT)).text == "next turn"
    history = scripted_model.requests[-1].messages
    calls = [
        p
        for m in history
        if m.role is Role.ASSISTANT
        for p in m.parts
        if isinstance(p, ToolCallPart)
    ]
    results = [
        p for m in history if m.role is Role.TOOL for p in m.parts if isinstance(p, ToolResultPart)
    ]
    assert [c.id for c in calls] == [r.tool_call_id for r in results]
    assert all(c.finished and orjson.loads(c.input) is not None for c in calls)
    assert results[0].is_error
    assert "cancelled" in results[0].content


async def test_workspace_shutdown_with_a_pending_permission_request(
    crush_server: CrushServer, crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    scripted_model.add(Step(tool_calls=[("write", {"path": "s.txt", "content": "z"})]))
    sid = (await ws.create_session()).id
    handle = await ws.prompt(sid, "go", run_id="sd")
    assert await handle.next_permission_request(WAIT) is not None
    workspace = crush_server.backend.get(ws.id)
    workspace.request_shutdown()
    await handle.wait(WAIT)
    assert handle.complete is not None
    assert handle.complete.cancelled is True
    assert handle.complete.error is None
    with trio.fail_after(WAIT):
        await workspace.closed.wait()
    store = await Store.open(workspace.data_dir)
    try:
        run = await store.get_run("sd")
        assert run is not None
        assert run.status is RunStatus.CANCELLED
        msgs = await store.list_messages(sid)
        finish = msgs[-2].finish()
        assert finish is not None
        assert finish.reason is FinishReason.CANCELED
        assert msgs[-1].role is Role.TOOL
        result = msgs[-1].parts[0]
        assert isinstance(result, ToolResultPart)
        assert result.content == "Error: user cancelled assistant tool calling"
    finally:
        await store.aclose()


async def test_allow_session_for_a_command_without_network_does_not_approve_it_with_network() -> (
    None
):
    from crush_trio.broker import Broker
    from crush_trio.permissions import PermissionService

    service = PermissionService(Broker(), allowed_tools=[])

    async def ask(network: bool, answer: str | None) -> bool:
        params = {"command": "make fetch", "network": network}
        result: list[bool] = []
        async with trio.open_nursery() as nursery:

            async def call() -> None:
                result.append(
                    await service.request(
                        session_id="s",
                        tool_call_id="c",
                        tool_name="bash",
                        action="execute",
                        description="run",
                        params=params,
                        path="/w",
                    )
                )

            nursery.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            if answer is None:  # expected to be pre-approved: nothing waits
                assert service.pending == []
            else:
                (pending,) = service.pending
                assert pending.params == params
                assert await service.grant(pending.id, answer)
        return result[0]

    with trio.fail_after(WAIT):
        assert await ask(False, "allow_session")
        assert await ask(False, None)  # the grant covers the same command without network
        assert service.pending == []
        # The same command with the network is a wider scope: it asks again.
        assert not await ask(True, "deny")
