"""The ``agent`` tool through the real server: a child session with the read-only tools, under
the parent's run, cancelled with it, its cost added to the parent.

The scripted model serves the parent's and the child's steps from one script, in the order the
server asks for them (the child's steps run inside the parent's tool call).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from crush_trio.client import RunStatus, WorkspaceClient
from crush_trio.providers import base as pb
from crush_trio.providers.scripted import Gate, ScriptedModel, Step
from crush_trio.tools import default_tools, read_only_tools
from crush_trio.wire import FinishReason, Role, ToolResultPart

from .conftest import WAIT, completes_run, payloads

PRICES = {"cost_per_1m_in": 3.0, "cost_per_1m_out": 15.0}


@pytest.fixture
def crush_config() -> dict[str, Any]:
    return {
        "providers": {"m": {"type": "echo", "models": [{"id": "main", **PRICES}]}},
        "models": {"large": {"provider": "m", "model": "main"}},
        "options": {"agent_max_steps": 3},
    }


def step_cost(prompt_tokens: int, completion_tokens: int) -> float:
    return (prompt_tokens * PRICES["cost_per_1m_in"] + completion_tokens * 15.0) / 1_000_000


def test_the_read_only_tools_are_those_marked_read_only() -> None:
    names = [t.spec.name for t in read_only_tools(default_tools())]
    assert names == ["ls", "view", "glob", "grep", "fetch"]  # fetch asks, as for its parent


async def test_child_session_reads_cannot_write_and_its_answer_and_cost_reach_the_parent(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    (Path(ws.path) / "notes.txt").write_text("the answer is 42\n")
    scripted_model.add(
        # Parent: delegate.
        Step(
            tool_calls=[("agent", {"prompt": "find the answer"})],
            usage=pb.Usage(100, 10),
        ),
        # Child: try to write (not offered), read, answer.
        Step(
            tool_calls=[
                ("write", {"path": "evil.txt", "content": "x"}),
                ("bash", {"command": "touch evil2.txt"}),
                ("view", {"path": "notes.txt"}),
            ],
            usage=pb.Usage(1000, 20),
        ),
        Step("It is 42.", usage=pb.Usage(2000, 30)),
        # Parent: finish with the child's answer in its history.
        Step("The sub-agent says 42.", usage=pb.Usage(300, 5)),
    )
    sid = (await ws.create_session()).id
    async with ws.subscribe(timeout=WAIT) as feed:
        handle = await ws.prompt(sid, "what is the answer?", run_id="p1")
        run = await handle.result(WAIT)
        seen = await feed.collect_until(completes_run("p1"), WAIT)
    assert run.status is RunStatus.COMPLETED
    assert run.text == "The sub-agent says 42."

    # The child got only the read-only tools and never wrote.
    child_request = scripted_model.requests[1]
    assert sorted(t.name for t in child_request.tools) == ["fetch", "glob", "grep", "ls", "view"]
    assert not (Path(ws.path) / "evil.txt").exists()
    assert not (Path(ws.path) / "evil2.txt").exists()

    sessions = {s.id: s for s in await ws.sessions()}
    (child,) = [s for s in sessions.values() if s.parent_session_id == sid]
    child_messages = await ws.messages(child.id)
    results = [p for m in child_messages for p in m.parts if isinstance(p, ToolResultPart)]
    by_name = {r.name: r for r in results}
    assert by_name["write"].is_error
    assert "unknown tool 'write'" in by_name["write"].content
    assert by_name["bash"].is_error
    assert "unknown tool 'bash'" in by_name["bash"].content
    assert not by_name["view"].is_error
    assert "the answer is 42" in by_name["view"].content
    assert child_messages[0].role is Role.USER
    assert child_messages[0].text() == "find the answer"

    # The parent model got the child's final text as the tool result.
    parent_results = [
        p
        for m in await ws.messages(sid)
        for p in m.parts
        if isinstance(p, ToolResultPart) and p.name == "agent"
    ]
    assert [r.content for r in parent_results] == ["It is 42."]
    assert not parent_results[0].is_error

    # Cost rolls up: the parent's total holds its own steps and the child's.
    parent = sessions[sid]
    child_cost = step_cost(1000, 20) + step_cost(2000, 30)
    assert child.cost == pytest.approx(child_cost)
    assert parent.cost == pytest.approx(step_cost(100, 10) + step_cost(300, 5) + child_cost)
    # The parent's token counts are its own context, not the child's.
    assert (parent.prompt_tokens, parent.completion_tokens) == (300, 5)

    # Events say which session they belong to: the child's messages carry the child's id.
    child_ids = {m.id for m in child_messages}
    assert child_ids
    snapshots = [m for m in payloads(seen, "message") if m.id in child_ids]
    deltas = [d for d in payloads(seen, "message_delta") if d.message_id in child_ids]
    assert {m.session_id for m in snapshots} == {child.id}
    assert {d.session_id for d in deltas} <= {child.id}
    created = [s for s in payloads(seen, "session") if s.id == child.id]
    assert created
    assert created[0].parent_session_id == sid


async def test_cancelling_the_parent_run_cancels_the_child(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    gate = Gate()
    scripted_model.add(
        Step(tool_calls=[("agent", {"prompt": "search forever"})]),
        Step("child never finishes this", gate_mid=gate),
    )
    sid = (await ws.create_session()).id
    handle = await ws.prompt(sid, "go", run_id="c1")
    with trio.fail_after(WAIT):
        await gate.reached.wait()
    assert scripted_model.streams_open == 1  # the child's step, mid-stream
    assert await ws.cancel_run("c1")
    run = await handle.result(WAIT)
    assert run.status is RunStatus.CANCELLED
    assert scripted_model.streams_open == 0  # the child's stream was closed by the cancel
    assert len(scripted_model.requests) == 2  # nothing ran after the cancel
    (child,) = [s for s in await ws.sessions() if s.parent_session_id == sid]
    last = (await ws.messages(child.id))[-1]
    finish = last.finish()
    assert last.role is Role.ASSISTANT
    assert finish is not None
    assert finish.reason is FinishReason.CANCELED
    # The parent's agent call has a cancelled result, so the history stays valid.
    results = [p for m in await ws.messages(sid) for p in m.parts if isinstance(p, ToolResultPart)]
    assert [r.name for r in results] == ["agent"]
    assert results[0].is_error


async def test_the_child_stops_at_its_own_step_bound(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    loop = [Step(tool_calls=[("ls", {"path": f"d{i}"})]) for i in range(3)]
    scripted_model.add(
        Step(tool_calls=[("agent", {"prompt": "list everything"})]), *loop, Step("gave up")
    )
    sid = (await ws.create_session()).id
    run = await (await ws.prompt(sid, "go", run_id="b1")).result(WAIT)
    assert run.status is RunStatus.COMPLETED
    assert run.text == "gave up"
    (result,) = [
        p
        for m in await ws.messages(sid)
        for p in m.parts
        if isinstance(p, ToolResultPart) and p.name == "agent"
    ]
    assert result.is_error
    assert "options.agent_max_steps" in result.content
