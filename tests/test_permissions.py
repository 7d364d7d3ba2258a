"""Tools and permissions through the real server: requests to every client, first answer wins,
deny ends the turn, session grants, skip, and cancels while waiting or inside a tool."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import orjson
import trio
from trio_websocket import open_websocket_url

from crush_trio.providers.scripted import ScriptedModel, Step
from crush_trio.wire import Role, ToolCallPart, ToolResultPart

from .test_runs import Collector, harness


def _requests(events: Collector) -> list[dict[str, Any]]:
    return [f["payload"]["payload"] for f in events.frames if f["type"] == "permission_request"]


def _notes(events: Collector) -> list[dict[str, Any]]:
    return [
        f["payload"]["payload"] for f in events.frames if f["type"] == "permission_notification"
    ]


async def _grant(server: Any, wid: str, pid: str, action: str) -> bool:
    r = await server.http.post(
        f"/v1/workspaces/{wid}/permissions/grant",
        json={"permission": {"id": pid}, "action": action},
    )
    assert r.status_code == 200, r.text
    return bool(r.json()["resolved"])


async def test_two_clients_first_answer_wins(tmp_path: Path) -> None:
    model = ScriptedModel(
        [
            Step(tool_calls=[("write", {"path": "out.txt", "content": "hello"})]),
            Step(text="written"),
        ]
    )
    async with harness(tmp_path, model) as (server, wid, sid, events):
        second = Collector()
        async with (
            open_websocket_url(server.ws_url(wid, str(uuid.uuid4()))) as conn,
            trio.open_nursery() as n,
        ):
            n.start_soon(second.pump, conn)
            await second.wait_for(lambda f: bool(f))
            await server.prompt(wid, sid, "write it", run_id="w")
            await events.wait_for(lambda _: bool(_requests(events)))
            await second.wait_for(lambda _: bool(_requests(second)))
            req = _requests(events)[0]
            assert req == _requests(second)[0]
            pending = (await server.http.get(f"/v1/workspaces/{wid}/permissions")).json()
            assert pending == [req]  # a tab opened later can still show it
            assert (
                req["tool_name"] == "write"
                and req["session_id"] == sid
                and req["path"].endswith("out.txt")
            )
            assert await _grant(server, wid, req["id"], "allow") is True
            assert await _grant(server, wid, req["id"], "deny") is False  # late answer
            complete = await events.complete("w")
            await second.wait_for(lambda _: bool(_notes(second)))
            n.cancel_scope.cancel()
        assert complete["text"] == "written" and complete["error"] is None
        notes = _notes(events)
        assert len(notes) == 1 and notes[0]["granted"] is True and notes[0]["denied"] is False
        assert (server.tmp / "out.txt").exists() is False  # written inside the workspace, not tmp
        ws_path = Path((await server.http.get(f"/v1/workspaces/{wid}")).json()["path"])
        assert (ws_path / "out.txt").read_text() == "hello"


async def test_deny_ends_the_turn_with_a_clear_result(tmp_path: Path) -> None:
    model = ScriptedModel(
        [Step(tool_calls=[("bash", {"command": "touch made-by-bash"})]), Step(text="never")]
    )
    async with harness(tmp_path, model) as (server, wid, sid, events):
        await server.prompt(wid, sid, "run it", run_id="d")
        await events.wait_for(lambda _: bool(_requests(events)))
        assert await _grant(server, wid, _requests(events)[0]["id"], "deny")
        complete = await events.complete("d")
        assert complete["error"] is None and complete["cancelled"] is False
        assert len(model.requests) == 1  # the turn ended at the denial
        msgs = await server.messages(wid, sid)
        result = msgs[-1]["parts"][0]
        assert result["type"] == "tool_result" and result["data"]["is_error"] is True
        assert "denied" in result["data"]["content"]
        ws_path = Path((await server.http.get(f"/v1/workspaces/{wid}")).json()["path"])
        assert not (ws_path / "made-by-bash").exists()


async def test_allow_session_is_remembered_only_for_that_session(tmp_path: Path) -> None:
    call = ("write", {"path": "same.txt", "content": "x"})
    model = ScriptedModel(
        [
            Step(tool_calls=[call]),
            Step(text="a"),
            Step(tool_calls=[call]),
            Step(text="b"),
            Step(tool_calls=[call]),
            Step(text="c"),
        ]
    )
    async with harness(tmp_path, model) as (server, wid, sid, events):
        await server.prompt(wid, sid, "one", run_id="s1")
        await events.wait_for(lambda _: len(_requests(events)) == 1)
        assert await _grant(server, wid, _requests(events)[0]["id"], "allow_session")
        await events.complete("s1")
        await server.prompt(wid, sid, "two", run_id="s2")
        assert (await events.complete("s2"))["text"] == "b"
        assert len(_requests(events)) == 1  # not asked again in the same session
        other = (await server.create_session(wid))["id"]
        await server.prompt(wid, other, "three", run_id="s3")
        await events.wait_for(lambda _: len(_requests(events)) == 2)
        assert _requests(events)[1]["session_id"] == other
        assert await _grant(server, wid, _requests(events)[1]["id"], "allow")
        await events.complete("s3")


async def test_skip_approves_everything_in_the_workspace(tmp_path: Path) -> None:
    model = ScriptedModel(
        [Step(tool_calls=[("write", {"path": "f.txt", "content": "y"})]), Step(text="ok")]
    )
    async with harness(tmp_path, model) as (server, wid, sid, events):
        r = await server.http.post(f"/v1/workspaces/{wid}/permissions/skip", json={"skip": True})
        assert r.status_code == 200
        await server.prompt(wid, sid, "go", run_id="k")
        assert (await events.complete("k"))["text"] == "ok"
        assert _requests(events) == []


async def test_cancel_while_a_permission_request_waits(tmp_path: Path) -> None:
    model = ScriptedModel(
        [Step(text="let me write", tool_calls=[("write", {"path": "p.txt", "content": "z"})])]
    )
    async with harness(tmp_path, model) as (server, wid, sid, events):
        await server.prompt(wid, sid, "go", run_id="pc")
        await events.wait_for(lambda _: bool(_requests(events)))
        await server.http.post(f"/v1/workspaces/{wid}/agent/sessions/{sid}/cancel")
        complete = await events.complete("pc")
        assert complete["cancelled"] is True and complete["error"] is None
        await events.wait_for(lambda _: bool(_notes(events)))
        assert _notes(events)[0]["denied"] is True  # withdrawn, so every client can drop it
        assert not await _grant(server, wid, _requests(events)[0]["id"], "allow")
        msgs = await server.messages(wid, sid)
        tool = msgs[-1]
        assert tool["role"] == "tool"
        assert tool["parts"][0]["data"]["content"] == "Error: user cancelled assistant tool calling"


async def test_cancel_inside_a_tool_call_leaves_a_valid_history(tmp_path: Path) -> None:
    model = ScriptedModel(
        [Step(tool_calls=[("bash", {"command": "sleep 30"})]), Step(text="next turn")]
    )
    async with harness(tmp_path, model) as (server, wid, sid, events):
        await server.http.post(f"/v1/workspaces/{wid}/permissions/skip", json={"skip": True})
        await server.prompt(wid, sid, "slow tool", run_id="t1")
        with trio.fail_after(10):
            while True:  # wait until the tool call is stored as finished (the tool is running)
                msgs = [f["payload"]["payload"] for f in events.frames if f["type"] == "message"]
                if any(
                    p["type"] == "tool_call" and p["data"]["finished"]
                    for m in msgs
                    for p in m["parts"]
                ):
                    break
                await events.wait_for(lambda f, n=len(events.frames): len(f) > n)
        await server.http.post(f"/v1/workspaces/{wid}/agent/sessions/{sid}/cancel")
        assert (await events.complete("t1"))["cancelled"] is True
        await server.prompt(wid, sid, "again", run_id="t2")
        assert (await events.complete("t2"))["text"] == "next turn"
        history = model.requests[-1].messages
        calls = [
            p
            for m in history
            if m.role is Role.ASSISTANT
            for p in m.parts
            if isinstance(p, ToolCallPart)
        ]
        results = [
            p
            for m in history
            if m.role is Role.TOOL
            for p in m.parts
            if isinstance(p, ToolResultPart)
        ]
        assert [c.id for c in calls] == [r.tool_call_id for r in results]
        assert all(c.finished and orjson.loads(c.input) is not None for c in calls)
        assert results[0].is_error and "cancelled" in results[0].content


async def test_workspace_shutdown_with_a_pending_permission_request(tmp_path: Path) -> None:
    model = ScriptedModel([Step(tool_calls=[("write", {"path": "s.txt", "content": "z"})])])
    async with harness(tmp_path, model) as (server, wid, sid, events):
        await server.prompt(wid, sid, "go", run_id="sd")
        await events.wait_for(lambda _: bool(_requests(events)))
        workspace = server.backend.get(wid)
        data_dir = workspace.data_dir
        workspace.request_shutdown()
        complete = await events.complete("sd")
        assert complete["cancelled"] is True and complete["error"] is None
        with trio.fail_after(10):
            await workspace.closed.wait()
    from crush_trio.store import Store

    store = await Store.open(data_dir)
    try:
        run = await store.get_run("sd")
        assert run is not None and run.status.value == "cancelled"
        msgs = await store.list_messages(sid)
        assert msgs[-2].finish() is not None and msgs[-2].finish().reason.value == "canceled"  # type: ignore[union-attr]
        assert msgs[-1].role is Role.TOOL
        assert msgs[-1].parts[0].content == "Error: user cancelled assistant tool calling"  # type: ignore[union-attr]
    finally:
        await store.aclose()
