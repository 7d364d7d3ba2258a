"""Summaries, auto-compaction, per-prompt models and cost, through the real server.

The scripted model logs every request (``scripted_model.requests``; summary requests also in
``summary_requests``), so the tests check what history reached the model after a summary. Its
steps report the usage a test gives them, which drives auto-compaction and cost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
import pytest
import trio

from crush_trio.agent.summarize import CONTINUE_NOTE, should_compact, step_cost
from crush_trio.client import BadRequest, Conflict, RunFailed, RunStatus, WorkspaceClient
from crush_trio.config import ModelEntry, Options
from crush_trio.errors import ProviderError
from crush_trio.providers.anthropic import MessagesStreamParser
from crush_trio.providers.base import Usage
from crush_trio.providers.http import SSEEvent
from crush_trio.providers.openai import ChatStreamParser
from crush_trio.providers.scripted import Gate, ScriptedModel, Step
from crush_trio.wire import Role

from .conftest import WAIT, completes_run, payloads, running_server
from .test_run_cmd import run_cli

if TYPE_CHECKING:
    from pathlib import Path

    from crush_trio.testing import CrushServer

#: The configured model's window: compaction when at most 20% (200 tokens) remain.
WINDOW = 1000
PRICES = {
    "cost_per_1m_in": 3.0,
    "cost_per_1m_out": 15.0,
    "cost_per_1m_in_cached": 3.75,
    "cost_per_1m_out_cached": 0.3,
}


@pytest.fixture
def crush_config() -> dict[str, Any]:
    return {
        "providers": {
            "m": {
                "type": "echo",
                "models": [
                    {"id": "main", "context_window": WINDOW, **PRICES},
                    {"id": "other", "context_window": 100_000},
                ],
            }
        },
        "models": {"large": {"provider": "m", "model": "main"}},
    }


def summary_events(events: list[Any]) -> list[Any]:
    return [e for e in payloads(events, "agent_event") if e.type == "summarize"]


async def test_summarize_is_409_while_busy_then_stores_a_summary_the_next_request_starts_from(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    sid = (await ws.create_session()).id
    scripted_model.add(Step("reply one"))
    await (await ws.prompt(sid, "first prompt")).result(WAIT)

    gate = Gate()
    scripted_model.add(Step("reply two", gate_before=gate))
    second = await ws.prompt(sid, "second prompt")
    with trio.fail_after(WAIT):
        await gate.reached.wait()
    with pytest.raises(Conflict, match="session busy"):
        await ws.summarize(sid)
    gate.release()
    await second.result(WAIT)

    scripted_model.add(Step("SUMMARY: asked twice, answered twice"))
    async with ws.subscribe(timeout=WAIT) as feed:
        session = await ws.summarize(sid)
        seen = await feed.collect_until(
            lambda e: e.type == "agent_event" and e.payload.type == "summarize" and e.payload.done,
            WAIT,
        )
    assert [e.progress for e in summary_events(seen)] == [
        "Starting summarization...",
        "Generating summary...",
        "Summary complete",
    ]
    assert session.summary_message_id is not None
    assert not session.is_busy
    # The summary request saw the whole conversation, with no tools.
    (asked,) = scripted_model.summary_requests
    assert [m.text() for m in asked.messages][:4] == [
        "first prompt",
        "reply one",
        "second prompt",
        "reply two",
    ]
    assert asked.tools == []
    # The full history stays readable, with the summary at its end.
    messages = await ws.messages(sid)
    summary = messages[-1]
    assert summary.id == session.summary_message_id
    assert summary.is_summary_message
    assert summary.role is Role.ASSISTANT
    assert summary.text() == "SUMMARY: asked twice, answered twice"
    assert [m.text() for m in messages[:2]] == ["first prompt", "reply one"]
    assert not any(m.is_summary_message for m in messages[:-1])

    scripted_model.add(Step("reply three"))
    await (await ws.prompt(sid, "third prompt")).result(WAIT)
    sent = scripted_model.requests[-1].messages
    assert [(m.role, m.text()) for m in sent] == [
        (Role.USER, "SUMMARY: asked twice, answered twice"),
        (Role.USER, "third prompt"),
    ]
    assert (await ws.session(sid)).summary_message_id == summary.id


async def test_summarize_of_an_unknown_or_empty_session(crush_workspace: WorkspaceClient) -> None:
    ws = crush_workspace
    from crush_trio.client import NotFound

    with pytest.raises(NotFound):
        await ws.summarize("no-such-session")
    sid = (await ws.create_session()).id
    with pytest.raises(BadRequest, match="no messages"):
        await ws.summarize(sid)


async def test_auto_compaction_goes_on_under_the_same_run_with_one_run_complete(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    sid = (await ws.create_session()).id
    scripted_model.add(
        # 850 of 1000 tokens used: 150 remain, under 20% of the window.
        Step("looking", tool_calls=[("ls", {})], usage=Usage(840, 10)),
        Step("the summary of the work so far"),
        Step("all done"),
    )
    async with ws.subscribe(timeout=WAIT) as feed:
        handle = await ws.prompt(sid, "list the files", run_id="compacted")
        run = await handle.result(WAIT)
        seen = await feed.collect_until(completes_run("compacted"), WAIT)
    assert run.status is RunStatus.COMPLETED
    assert run.text == "all done"
    assert len(scripted_model.summary_requests) == 1
    assert [c.run_id for c in payloads(seen, "run_complete")] == ["compacted"]
    events = summary_events(seen)
    assert {e.run_id for e in events} == {"compacted"}
    assert events[-1].done
    # The step after the summary starts from it and carries the request on.
    after = scripted_model.requests[-1].messages
    assert len(after) == 1
    assert after[0].role is Role.USER
    assert after[0].text() == "the summary of the work so far" + CONTINUE_NOTE + "list the files"
    # The summary saw the tool's result.
    assert any(m.role is Role.TOOL for m in scripted_model.summary_requests[0].messages)
    session = await ws.session(sid)
    messages = await ws.messages(sid)
    (summary,) = [m for m in messages if m.is_summary_message]
    assert session.summary_message_id == summary.id
    assert messages[-1].text() == "all done"
    assert messages[0].text() == "list the files"


def test_no_compaction_below_the_threshold_or_when_turned_off() -> None:
    options = Options()
    assert should_compact(800, 1000, options)
    assert not should_compact(799, 1000, options)
    # Windows over 200,000 tokens: at most 20,000 left.
    assert should_compact(180_001, 200_001, options)
    assert not should_compact(180_000, 200_001, options)
    assert not should_compact(900, 1000, Options(auto_compact=False))
    assert not should_compact(900, 1000, Options(disable_auto_summarize=True))


async def test_cancel_during_the_summary_cancels_the_run_and_stores_no_summary(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    sid = (await ws.create_session()).id
    gate = Gate()
    scripted_model.add(
        Step("looking", tool_calls=[("ls", {})], usage=Usage(900, 10)),
        Step("a summary never finished", gate_mid=gate),
    )
    async with ws.subscribe(timeout=WAIT) as feed:
        handle = await ws.prompt(sid, "go", run_id="cut")
        with trio.fail_after(WAIT):
            await gate.reached.wait()
        await ws.cancel(sid)
        await handle.wait(WAIT)
        seen = await feed.collect_until(completes_run("cut"), WAIT)
    assert handle.complete is not None
    assert handle.complete.cancelled
    assert [c.run_id for c in payloads(seen, "run_complete")] == ["cut"]
    assert summary_events(seen)[-1].progress == "Summary cancelled"
    assert (await ws.get_run("cut")).status is RunStatus.CANCELLED
    assert not any(m.is_summary_message for m in await ws.messages(sid))
    assert (await ws.session(sid)).summary_message_id is None
    gate.release()


async def test_a_failing_summary_fails_the_run_with_the_error_on_its_run_id(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    sid = (await ws.create_session()).id
    scripted_model.add(
        Step("looking", tool_calls=[("ls", {})], usage=Usage(900, 10)),
        Step("half a sum", error=ProviderError("summary exploded")),
    )
    async with ws.subscribe(timeout=WAIT) as feed:
        handle = await ws.prompt(sid, "go", run_id="broken")
        with pytest.raises(RunFailed, match="summary exploded"):
            await handle.result(WAIT)
        seen = await feed.collect_until(completes_run("broken"), WAIT)
    completes = payloads(seen, "run_complete")
    assert [(c.run_id, c.error) for c in completes] == [("broken", "summary exploded")]
    errors = [e for e in payloads(seen, "agent_event") if e.type == "error"]
    assert [(e.run_id, e.error) for e in errors] == [("broken", "summary exploded")]
    assert summary_events(seen)[-1].progress == "Summary failed"
    assert (await ws.get_run("broken")).status is RunStatus.FAILED
    assert not any(m.is_summary_message for m in await ws.messages(sid))
    assert (await ws.session(sid)).summary_message_id is None


async def test_a_prompt_can_name_its_model(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    sid = (await ws.create_session()).id
    scripted_model.add(Step("from the other model"), Step("from the main model"))
    await (await ws.prompt(sid, "one", model="m/other")).result(WAIT)
    assert scripted_model.requests[-1].model.id == "other"
    await (await ws.prompt(sid, "two")).result(WAIT)
    assert scripted_model.requests[-1].model.id == "main"
    replies = [m for m in await ws.messages(sid) if m.role is Role.ASSISTANT]
    assert [(m.provider, m.model) for m in replies] == [("m", "other"), ("m", "main")]
    with pytest.raises(BadRequest, match="missing"):
        await ws.prompt(sid, "three", model="m/missing")
    with pytest.raises(BadRequest, match="names no configured model"):
        await ws.prompt(sid, "four", model="nowhere")


async def test_session_cost_and_tokens_come_from_usage_and_prices(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    sid = (await ws.create_session()).id
    usage = Usage(100, 50, cache_read_tokens=40, cache_write_tokens=20)
    scripted_model.add(Step("one", usage=usage), Step("two", usage=usage))
    await (await ws.prompt(sid, "a")).result(WAIT)
    await (await ws.prompt(sid, "b")).result(WAIT)
    one = (40 * 3.0 + 20 * 3.75 + 40 * 0.3 + 50 * 15.0) / 1e6
    assert step_cost(usage, ModelEntry("main", **PRICES)) == pytest.approx(one)
    session = await ws.session(sid)
    assert session.cost == pytest.approx(2 * one)
    # The token counts are the last step's: the context in use.
    assert (session.prompt_tokens, session.completion_tokens) == (100, 50)


# ---------------------------------------------------------------------------------------------
# Usage as each API reports it, cached tokens included


def test_openai_usage_carries_cached_prompt_tokens() -> None:
    parser = ChatStreamParser("p")
    chunk = {
        "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": 1200,
            "completion_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 1024},
        },
    }
    events = parser.feed(SSEEvent(data=orjson.dumps(chunk).decode()))
    events += parser.feed(SSEEvent(data="[DONE]"))
    assert Usage(1200, 7, cache_read_tokens=1024) in events


def test_anthropic_usage_carries_cache_reads_and_writes() -> None:
    parser = MessagesStreamParser("p")
    start = {
        "type": "message_start",
        "message": {
            "usage": {
                "input_tokens": 10,
                "cache_creation_input_tokens": 300,
                "cache_read_input_tokens": 2000,
                "output_tokens": 1,
            }
        },
    }
    delta = {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn"},
        "usage": {"output_tokens": 42},
    }
    events: list[Any] = []
    for data in (start, delta, {"type": "message_stop"}):
        events += parser.feed(SSEEvent(data=orjson.dumps(data).decode()))
    assert Usage(2310, 42, cache_read_tokens=2000, cache_write_tokens=300) in events


# ---------------------------------------------------------------------------------------------
# The websocket command


async def test_summarize_command_does_not_hold_up_later_commands_and_prompts_queue_behind_it(
    tmp_path: Path,
) -> None:
    model = ScriptedModel()
    gate = Gate()
    model.add(Step("first reply"), Step("the summary", gate_before=gate), Step("after"))
    async with running_server(tmp_path, provider_factory=model) as server:
        wid = (await server.open_workspace())["id"]
        with trio.fail_after(WAIT):
            async with server.websocket(wid) as sock:
                await sock.recv()
                sid = (await sock.command("sessions.create"))["result"]["id"]
                await sock.command("agent.prompt", session_id=sid, prompt="hi", run_id="r1")
                await sock.run_complete("r1")
                await sock.conn.send_message(
                    orjson.dumps(
                        {"id": "sum", "method": "sessions.summarize", "params": {"session_id": sid}}
                    ).decode()
                )
                await gate.reached.wait()
                # Answered while the summary runs: the session is busy, the prompt queues.
                again = await sock.command("sessions.summarize", session_id=sid)
                assert (again["ok"], again["status"]) == (False, 409)
                queued = await sock.command(
                    "agent.prompt", session_id=sid, prompt="next", run_id="r2"
                )
                assert queued["result"]["status"] == "queued"
                gate.release()
                frames = await sock.until(lambda f: f.get("id") == "sum")
                reply = frames[-1]
                assert reply["ok"] is True
                summary_id = reply["result"]["summary_message_id"]
                assert summary_id is not None
                await sock.run_complete("r2")
        sent = model.requests[-1].messages
        assert [(m.role, m.text()) for m in sent] == [
            (Role.USER, "the summary"),
            (Role.USER, "next"),
        ]
        unknown = await sock_free_command(server, wid)
        assert unknown == 400


async def sock_free_command(server: Any, wid: str) -> int:
    async with server.websocket(wid) as sock:
        await sock.recv()
        reply = await sock.command("sessions.summarize", session_id="nope")
        return int(reply["status"])


# ---------------------------------------------------------------------------------------------
# crush-trio run


async def test_run_m_selects_the_model_and_prints_no_summary(
    crush_server: CrushServer, scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    project = crush_server.project()
    scripted_model.add(
        Step("looking ", tool_calls=[("ls", {})], usage=Usage(900, 10)),
        Step("SUMMARY TEXT"),
        Step("the answer"),
    )
    done = await run_cli("-m", "m/main", "go", tmp_path=tmp_path, server=crush_server, cwd=project)
    assert done.code == 0, done.err
    assert "SUMMARY" not in done.out
    assert done.out.endswith("the answer\n")
    assert len(scripted_model.summary_requests) == 1
    scripted_model.add(Step("other says hi"))
    done = await run_cli("-m", "m/other", "hi", tmp_path=tmp_path, server=crush_server, cwd=project)
    assert (done.code, done.out) == (0, "other says hi\n"), done.err
    assert scripted_model.requests[-1].model.id == "other"


# ---------------------------------------------------------------------------------------------
# The schema


async def test_a_version_2_database_gains_the_summary_columns(tmp_path: Path) -> None:
    import sqlite3

    from crush_trio.store.db import DB_FILENAME, MIGRATIONS, Store

    path = tmp_path / DB_FILENAME
    conn = sqlite3.connect(path, isolation_level=None)
    for version, script in enumerate(MIGRATIONS[:2], start=1):
        conn.executescript(f"BEGIN;\n{script}\nPRAGMA user_version = {version};\nCOMMIT;")
    conn.execute(
        "INSERT INTO sessions (id, title, created_at, updated_at) VALUES ('old', 't', 1, 1)"
    )
    conn.execute(
        "INSERT INTO messages (id, session_id, role, parts, created_at, updated_at) "
        "VALUES ('m', 'old', 'user', '[]', 1, 1)"
    )
    conn.close()
    store = await Store.open(tmp_path)
    try:
        session = await store.get_session("old")
        assert session is not None
        assert session.summary_message_id is None
        (message,) = await store.list_messages("old")
        assert message.is_summary_message is False
        updated = await store.set_summary("old", "m", 12, 0.5)
        assert updated is not None
        assert (updated.summary_message_id, updated.completion_tokens, updated.cost) == (
            "m",
            12,
            0.5,
        )
    finally:
        await store.aclose()


async def test_cancel_stops_a_requested_summary_and_stores_nothing(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    sid = (await ws.create_session()).id
    await (await ws.prompt(sid, "hello")).result(WAIT)
    gate = Gate()
    scripted_model.add(Step("a partial summary", gate_mid=gate))
    outcome: list[BaseException] = []

    async def summarize() -> None:
        try:
            await ws.summarize(sid)
        except Conflict as exc:
            outcome.append(exc)

    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(summarize)
            await gate.reached.wait()
            assert (await ws.session(sid)).is_busy
            await ws.cancel(sid)
    gate.release()
    assert len(outcome) == 1
    assert "cancelled" in str(outcome[0])
    assert not any(m.is_summary_message for m in await ws.messages(sid))
    assert (await ws.session(sid)).summary_message_id is None
    # The session is usable again at once.
    scripted_model.add(Step("still here"))
    assert (await (await ws.prompt(sid, "again")).result(WAIT)).text == "still here"
