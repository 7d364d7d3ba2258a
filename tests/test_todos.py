"""The ``todos`` tool: the model's plan, saved with the session, live at every client, kept
across a restart, returned by ``GET .../sessions/{sid}``.

Every wait is bounded (``trio.fail_after`` / ``WAIT``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
import pytest
import trio

from crush_trio.providers.scripted import ScriptedModel, Step
from crush_trio.tools import ToolContext, call_tool, default_tools
from crush_trio.tools.todos import TODO_MAX_CHARS, TODOS_MAX_ITEMS
from crush_trio.wire import Session, Todo, TodoStatus

from .conftest import WAIT, running_server
from .test_tools import FakeAsker

if TYPE_CHECKING:
    from pathlib import Path

PLAN = [
    {"content": "Find the bug", "status": "in_progress", "active_form": "Finding the bug"},
    {"content": "Fix it", "status": "pending", "active_form": "Fixing it"},
    {"content": "Add a test", "status": "pending"},
]
DONE = [
    {"content": "Find the bug", "status": "completed", "active_form": "Finding the bug"},
    {"content": "Fix it", "status": "in_progress", "active_form": "Fixing it"},
    {"content": "Add a test", "status": "pending"},
]


def as_wire(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"active_form": "", **item} for item in items]


# ---------------------------------------------------------------------------------------------
# The tool alone


class RecordingSink:
    def __init__(self) -> None:
        self.saved: list[tuple[str, list[Todo]]] = []

    async def set_todos(self, session_id: str, todos: list[Todo]) -> Session | None:
        await trio.lowlevel.checkpoint()
        self.saved.append((session_id, todos))
        return Session(id=session_id, todos=todos) if session_id == "s1" else None


def make_ctx(tmp_path: Path, sink: RecordingSink | None, session_id: str = "s1") -> ToolContext:
    return ToolContext(
        workspace=tmp_path,
        data_dir=tmp_path / ".crush",
        session_id=session_id,
        tool_call_id="c1",
        permissions=FakeAsker(),
        todos=sink,
    )


async def todos(ctx: ToolContext, items: Any) -> Any:
    with trio.fail_after(WAIT):
        return await call_tool(
            default_tools(), "todos", orjson.dumps({"todos": items}).decode(), ctx
        )


async def test_todos_saves_the_whole_list_without_asking(tmp_path: Path) -> None:
    sink = RecordingSink()
    ctx = make_ctx(tmp_path, sink)
    result = await todos(ctx, PLAN)
    assert not result.is_error, result.content
    assert result.content.startswith("Todo list updated (3 items): 2 pending, 1 in progress")
    [(sid, saved)] = sink.saved
    assert sid == "s1"
    assert saved == [
        Todo("Find the bug", TodoStatus.IN_PROGRESS, "Finding the bug"),
        Todo("Fix it", TodoStatus.PENDING, "Fixing it"),
        Todo("Add a test", TodoStatus.PENDING, ""),
    ]
    assert ctx.permissions.requests == []  # type: ignore[attr-defined]
    assert not (await todos(ctx, [])).is_error  # an empty list clears it
    assert sink.saved[-1] == ("s1", [])


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([{"content": "x", "status": "done"}], "todo 1 has status 'done'; use one of pending"),
        ([{"status": "pending"}], "todo 1 needs a non-empty content string"),
        (["x"], "todo 1 must be an object"),
        ([{"content": "x", "status": "pending", "active_form": 3}], "active_form must be a string"),
        (
            [{"content": "x" * (TODO_MAX_CHARS + 1), "status": "pending"}],
            f"over the limit of {TODO_MAX_CHARS}",
        ),
        (
            [{"content": "x", "status": "pending"}] * (TODOS_MAX_ITEMS + 1),
            f"over the limit of {TODOS_MAX_ITEMS}",
        ),
    ],
)
async def test_bad_lists_are_refused_and_nothing_is_saved(
    tmp_path: Path, items: Any, message: str
) -> None:
    sink = RecordingSink()
    result = await todos(make_ctx(tmp_path, sink), items)
    assert result.is_error, result.content
    assert message in result.content, result.content
    assert sink.saved == []


async def test_a_deleted_session_or_no_store_is_an_error_result(tmp_path: Path) -> None:
    gone = await todos(make_ctx(tmp_path, RecordingSink(), "gone"), PLAN)
    assert gone.is_error
    assert "session gone no longer exists" in gone.content
    nowhere = await todos(make_ctx(tmp_path, None), PLAN)
    assert nowhere.is_error
    assert "not available" in nowhere.content


# ---------------------------------------------------------------------------------------------
# Through the server: two clients, GET, restart


def session_updates(frames: list[dict[str, Any]], sid: str) -> list[list[dict[str, Any]]]:
    """The todo lists of the ``session`` events of ``sid``, without repeats."""
    lists: list[list[dict[str, Any]]] = []
    for frame in frames:
        if frame["type"] != "session":
            continue
        session = frame["payload"]["payload"]
        if session["id"] == sid and (not lists or lists[-1] != session["todos"]):
            lists.append(session["todos"])
    return lists


async def test_two_clients_see_the_list_update_live_and_it_survives_a_restart(
    tmp_path: Path,
) -> None:
    model = ScriptedModel()
    model.add(
        Step(tool_calls=[("todos", {"todos": PLAN})]),
        Step(tool_calls=[("todos", {"todos": DONE})]),
        Step(text="on it"),
    )
    project = tmp_path / "project"
    project.mkdir()
    async with running_server(tmp_path, provider_factory=model) as server:
        wid = (await server.open_workspace(project))["id"]
        sid = (await server.create_session(wid))["id"]
        assert (await server.http.get(f"/v1/workspaces/{wid}/sessions/{sid}")).json()["todos"] == []
        with trio.fail_after(WAIT):
            async with server.websocket(wid) as first, server.websocket(wid) as second:
                await server.prompt(wid, sid, "fix the bug", run_id="t1")
                _, seen_first = await first.run_complete("t1")
                _, seen_second = await second.run_complete("t1")
        for seen in (seen_first, seen_second):
            lists = session_updates(seen, sid)
            assert as_wire(PLAN) in lists, lists
            assert as_wire(DONE) in lists, lists
            assert lists.index(as_wire(PLAN)) < lists.index(as_wire(DONE))
        got = await server.http.get(f"/v1/workspaces/{wid}/sessions/{sid}")
        assert got.status_code == 200
        assert got.json()["todos"] == as_wire(DONE)
        listed = await server.http.get(f"/v1/workspaces/{wid}/sessions")
        assert [s["todos"] for s in listed.json() if s["id"] == sid] == [as_wire(DONE)]

    async with running_server(tmp_path, provider_factory=ScriptedModel()) as again:
        wid = (await again.open_workspace(project))["id"]
        got = await again.http.get(f"/v1/workspaces/{wid}/sessions/{sid}")
        assert got.status_code == 200, got.text
        assert got.json()["todos"] == as_wire(DONE)
