"""Run semantics through the real server: exactly one run_complete per run, queue, fold, cancel.

The server and client come from the pytest plugin (``crush_server``, ``crush_workspace``); its
``scripted_model`` holds a run at a chosen phase (before streaming, mid-stream) with gates until
the test releases it, so every interleaving here is deterministic. A workspace subscription sees
every event, so a test can check what no run handle would show: duplicates, order, foreign runs.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import orjson
import pytest
import trio
import trio.lowlevel

from crush_trio.client import (
    Conflict,
    NotFound,
    RunComplete,
    RunFailed,
    RunStatus,
    WorkspaceClient,
)
from crush_trio.embedded import embedded
from crush_trio.errors import BadRequest, ConfigError, ProviderError
from crush_trio.providers.scripted import Gate, ScriptedModel, Step
from crush_trio.wire import AgentEvent, FinishPart, FinishReason, Role, Run, TextPart

from .conftest import (
    WAIT,
    completes_run,
    event_socket,
    payloads,
    serve_options,
    ws_url,
)

if TYPE_CHECKING:
    from pathlib import Path

    from crush_trio.testing import CrushServer


def errors_of(events: list[Any]) -> list[AgentEvent]:
    return [e for e in payloads(events, "agent_event") if e.type == "error"]


async def test_provider_error_carries_run_and_session(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    scripted_model.add(Step(text="partial words", error=ProviderError("upstream exploded")))
    sid = (await ws.create_session()).id
    async with ws.subscribe(timeout=WAIT) as feed:
        handle = await ws.prompt(sid, "go", run_id="bad")
        with pytest.raises(RunFailed, match="upstream exploded"):
            await handle.result(WAIT)
        seen = await feed.collect_until(completes_run("bad"), WAIT)
    assert handle.complete is not None
    assert handle.complete.error == "upstream exploded"
    assert handle.complete.cancelled is False
    assert handle.complete.text == "partial words"
    # The error event, exactly as it went over the wire, and the run's own view of it.
    wire_errors = [
        e.to_json()["payload"]["payload"]
        for e in seen
        if e.type == "agent_event" and e.payload.type == "error"
    ]
    assert wire_errors == [
        {
            "type": "error",
            "session_id": sid,
            "run_id": "bad",
            "text": "upstream exploded",
            "error": "upstream exploded",
            "message": None,  # PROTOCOL's key; a message object or null, never text
        }
    ]
    assert handle.errors == errors_of(seen)
    run = await ws.get_run("bad")
    assert run.status is RunStatus.FAILED
    assert run.error == "upstream exploded"
    finish = (await ws.messages(sid))[-1].parts[-1]
    assert isinstance(finish, FinishPart)
    assert finish.reason is FinishReason.ERROR


async def test_foreign_run_failure_does_not_touch_ours(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    gate = Gate()
    scripted_model.add(
        Step(text="ours continues", gate_mid=gate), Step(error=ProviderError("theirs failed"))
    )
    sid = (await ws.create_session()).id
    other = (await ws.create_session()).id
    async with ws.subscribe(timeout=WAIT) as feed:
        ours = await ws.prompt(sid, "ours", run_id="ours")
        with trio.fail_after(WAIT):
            await gate.reached.wait()
        theirs = await ws.prompt(other, "theirs", run_id="theirs")
        with pytest.raises(RunFailed, match="theirs failed"):
            await theirs.result(WAIT)
        assert not ours.done
        gate.release()
        run = await ours.result(WAIT)
        seen = await feed.collect_until(completes_run("ours"), WAIT)
    assert run.error is None
    assert run.text == "ours continues"
    assert [e.run_id for e in errors_of(seen)] == ["theirs"]
    assert ours.errors == []
    assert [e.run_id for e in theirs.errors] == ["theirs"]


async def test_early_failure_gets_exactly_one_errored_terminal(tmp_path: Path) -> None:
    calls = 0

    def broken_factory(name: str, cfg: Any) -> Any:
        nonlocal calls
        calls += 1
        raise ConfigError("provider 'echo' could not be set up: missing api_key")

    project = tmp_path / "project"
    project.mkdir()
    options = serve_options(tmp_path, provider_factory=broken_factory)
    async with (
        embedded(options) as client,
        client.workspace(project) as ws,
        ws.subscribe(timeout=WAIT) as feed,
    ):
        sid = (await ws.create_session()).id
        first = await ws.prompt(sid, "first", run_id="early")
        with pytest.raises(RunFailed, match="could not be set up"):
            await first.result(WAIT)
        assert first.complete is not None
        assert first.complete.message_id is not None  # an errored assistant record exists
        # A second run proves the first got no late duplicate.
        second = await ws.prompt(sid, "second", run_id="early2")
        await second.wait(WAIT)
        seen = await feed.collect_until(completes_run("early2"), WAIT)
        assert [c.run_id for c in payloads(seen, "run_complete")].count("early") == 1
        assert (await ws.get_run("early")).status is RunStatus.FAILED
    assert calls >= 1


async def test_session_deleted_before_queued_run_starts(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    gate = Gate()
    scripted_model.add(Step(text="a", gate_before=gate))
    sid = (await ws.create_session()).id
    async with ws.subscribe(timeout=WAIT) as feed:
        handle = await ws.prompt(sid, "one", run_id="d1")
        with trio.fail_after(WAIT):
            await gate.reached.wait()
        await ws.delete_session(sid)
        gate.release()
        assert (await handle.result(WAIT)).status is RunStatus.CANCELLED
        seen = await feed.collect_until(completes_run("d1"), WAIT)
    assert handle.complete is not None
    assert handle.complete.cancelled is True
    assert handle.complete.error is None
    assert [c.run_id for c in payloads(seen, "run_complete")] == ["d1"]


async def test_cancel_mid_stream_saves_partial_reply(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    gate = Gate()
    scripted_model.add(Step(text="one two three four five six", gate_mid=gate))
    sid = (await ws.create_session()).id
    async with ws.subscribe(timeout=WAIT) as feed:
        handle = await ws.prompt(sid, "go", run_id="c1")
        with trio.fail_after(WAIT):
            await gate.reached.wait()
        await ws.cancel(sid)
        events = [event async for event in handle.events(WAIT)]
        seen = await feed.collect_until(completes_run("c1"), WAIT)
    terminal = events[-1]
    assert terminal.raw is not None
    assert terminal.raw["payload"]["payload"] == {
        "session_id": sid,
        "run_id": "c1",
        "message_id": terminal.payload.message_id,
        "text": "one two three",
        "error": None,
        "cancelled": True,
    }
    assert terminal.payload.message_id is not None
    assert errors_of(seen) == []
    assistant = (await ws.messages(sid))[-1]
    assert assistant.parts[0] == TextPart("one two three")
    finish = assistant.parts[-1]
    assert isinstance(finish, FinishPart)
    assert finish == FinishPart(
        FinishReason.CANCELED, finish.time, "User canceled request", details=""
    )
    run = await ws.get_run("c1")
    assert run.status is RunStatus.CANCELLED
    assert run.text == "one two three"
    assert scripted_model.streams_open == 0
    assert (await ws.session(sid)).is_busy is False


async def test_cancel_before_the_run_starts_streaming(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    gate = Gate()
    scripted_model.add(Step(text="never", gate_before=gate))
    sid = (await ws.create_session()).id
    handle = await ws.prompt(sid, "go", run_id="c0")
    with trio.fail_after(WAIT):
        await gate.reached.wait()
    await ws.cancel(sid)
    run = await handle.result(WAIT)
    assert run.status is RunStatus.CANCELLED
    assert run.text == ""
    assert handle.complete is not None
    assert handle.complete.cancelled is True
    msgs = await ws.messages(sid)
    assert [m.role for m in msgs] == [Role.USER, Role.ASSISTANT]
    finish = msgs[-1].finish()
    assert finish is not None
    assert finish.reason is FinishReason.CANCELED


async def test_cancel_during_dispatch_over_websocket(
    crush_server: CrushServer, crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    """Two websocket commands sent back to back (a wire-level test: the socket stays raw)."""
    ws = crush_workspace
    sid = (await ws.create_session()).id
    url = ws_url(crush_server.url, ws.id, str(uuid.uuid4()), token=crush_server.token)
    with trio.fail_after(WAIT):
        async with event_socket(url) as sock:
            await sock.recv()  # hello
            # Both commands go out back to back: the cancel lands before the turn starts or
            # while it opens the model stream (starting a turn makes no store round trip, so
            # which one is up to the scheduler); either way the run ends cancelled.
            await sock.conn.send_message(
                orjson.dumps(
                    {
                        "id": 1,
                        "method": "agent.prompt",
                        "params": {"session_id": sid, "prompt": "x", "run_id": "disp"},
                    }
                ).decode()
            )
            await sock.conn.send_message(
                orjson.dumps(
                    {"id": 2, "method": "agent.cancel", "params": {"session_id": sid}}
                ).decode()
            )
            complete, _ = await sock.run_complete("disp")
    assert complete["cancelled"] is True
    assert len(scripted_model.requests) <= 1
    assert (await ws.get_run("disp")).status is RunStatus.CANCELLED


async def test_idle_cancel_does_not_affect_the_next_prompt(
    crush_workspace: WorkspaceClient,
) -> None:
    ws = crush_workspace
    sid = (await ws.create_session()).id
    for _ in range(2):
        await ws.cancel(sid)
    run = await ws.run(sid, "after idle cancel", timeout=WAIT)
    assert run.status is RunStatus.COMPLETED
    assert run.text == "after idle cancel"


async def test_queued_run_id_prompts_run_as_their_own_turns_in_order(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    gate = Gate()
    scripted_model.add(Step(text="first reply", gate_mid=gate))
    sid = (await ws.create_session()).id
    async with ws.subscribe(timeout=WAIT) as feed:
        q1 = await ws.prompt(sid, "first", run_id="q1")
        assert q1.accepted is not None
        assert q1.accepted.status == "running"
        with trio.fail_after(WAIT):
            await gate.reached.wait()
        q2 = await ws.prompt(sid, "second", run_id="q2")
        q3 = await ws.prompt(sid, "third", run_id="q3")
        assert q2.accepted is not None
        assert q2.accepted.status == "queued"
        assert q3.accepted is not None
        assert q3.accepted.status == "queued"
        count = f"/v1/workspaces/{ws.id}/agent/sessions/{sid}/prompts/queued"
        assert await ws.client.request("GET", count) == 2
        assert await ws.queued(sid) == ["second", "third"]
        gate.release()
        runs = [await handle.result(WAIT) for handle in (q1, q2, q3)]
        seen = await feed.collect_until(completes_run("q3"), WAIT)
    completes: list[RunComplete] = payloads(seen, "run_complete")
    assert [c.run_id for c in completes] == ["q1", "q2", "q3"]
    assert [c.text for c in completes] == ["first reply", "second", "third"]
    assert [r.text for r in runs] == ["first reply", "second", "third"]
    assert len({c.message_id for c in completes}) == 3
    # Each queued prompt reached the model as its own turn.
    assert len(scripted_model.requests) == 3


async def test_prompt_without_run_id_is_folded_into_the_active_turn(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    """The client always sends a run_id; folding is what a prompt without one gets, so that
    prompt is sent with a plain HTTP request."""
    ws = crush_workspace
    gate = Gate()
    scripted_model.add(Step(text="working on it", gate_mid=gate), Step(text="folded answer"))
    sid = (await ws.create_session()).id
    async with ws.subscribe(timeout=WAIT) as feed:
        main = await ws.prompt(sid, "main task", run_id="main")
        with trio.fail_after(WAIT):
            await gate.reached.wait()
        r = await ws.client.http.post(
            f"/v1/workspaces/{ws.id}/agent", json={"session_id": sid, "prompt": "also this"}
        )
        assert r.status_code == 202, r.text
        folded = r.json()
        assert folded["status"] == "queued"
        assert folded["run_id"]
        gate.release()
        main_run = await main.result(WAIT)
        extra = (await feed.until(completes_run(folded["run_id"]), WAIT)).payload
    assert extra.message_id == main_run.message_id
    assert extra.text == main_run.text
    assert main_run.text == "folded answer"
    # The folded prompt is a user message inside the turn's next model request.
    second = scripted_model.requests[1]
    users = [m.text() for m in second.messages if m.role is Role.USER]
    assert users == ["main task", "also this"]
    assert len(scripted_model.requests) == 2
    assert (await ws.get_run(folded["run_id"])).status is RunStatus.COMPLETED


async def test_cancel_and_clear_drop_queued_prompts_with_cancelled_terminals(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    gate = Gate()
    scripted_model.add(Step(text="long", gate_mid=gate))
    sid = (await ws.create_session()).id
    a = await ws.prompt(sid, "first", run_id="a")
    with trio.fail_after(WAIT):
        await gate.reached.wait()
    b = await ws.prompt(sid, "to clear", run_id="b")
    await ws.clear_queue(sid)
    assert (await b.result(WAIT)).status is RunStatus.CANCELLED
    assert b.complete is not None
    assert b.complete.error is None
    assert await ws.queued(sid) == []
    c = await ws.prompt(sid, "to cancel", run_id="c")
    await ws.cancel(sid)
    for handle in (a, c):
        await handle.wait(WAIT)
        assert handle.complete is not None
        assert handle.complete.cancelled is True
    # Prompts accepted after the cancel run normally.
    d = await ws.run(sid, "after cancel", timeout=WAIT)
    assert d.status is RunStatus.COMPLETED
    assert d.text == "after cancel"
    assert len(scripted_model.requests) == 2  # b and c never reached the model
    for run_id, status in [
        ("a", RunStatus.CANCELLED),
        ("b", RunStatus.CANCELLED),
        ("c", RunStatus.CANCELLED),
        (d.run_id, RunStatus.COMPLETED),
    ]:
        assert (await ws.get_run(run_id)).status is status


async def test_prompt_to_closing_workspace_gets_409(
    crush_server: CrushServer, crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    gate = Gate()
    scripted_model.add(Step(text="slow", gate_before=gate))
    sid = (await ws.create_session()).id
    handle = await ws.prompt(sid, "x", run_id="z")
    with trio.fail_after(WAIT):
        await gate.reached.wait()
    workspace = crush_server.backend.get(ws.id)
    workspace.request_shutdown()
    with trio.fail_after(WAIT):
        while not workspace.closing:
            await trio.lowlevel.checkpoint()
    # Straight to the server (WorkspaceClient.prompt may already know the stream is gone).
    with pytest.raises((Conflict, NotFound)) as refused:
        await ws.client.request(
            "POST", f"/v1/workspaces/{ws.id}/agent", json={"session_id": sid, "prompt": "late"}
        )
    if isinstance(refused.value, Conflict):
        assert "closing" in str(refused.value)
    assert (await handle.result(WAIT)).status is RunStatus.CANCELLED


async def test_cancel_one_run_leaves_the_others(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    gate = Gate()
    scripted_model.add(Step(text="first reply", gate_mid=gate))
    sid = (await ws.create_session()).id
    async with ws.subscribe(timeout=WAIT) as feed:
        r1 = await ws.prompt(sid, "first", run_id="r1")
        with trio.fail_after(WAIT):
            await gate.reached.wait()
        r2 = await ws.prompt(sid, "second", run_id="r2")
        r3 = await ws.prompt(sid, "third", run_id="r3")
        assert await ws.cancel_run("r2") is True
        assert (await r2.result(WAIT)).status is RunStatus.CANCELLED
        assert await ws.cancel_run("r1") is True  # the running one
        first = await r1.result(WAIT)
        assert first.status is RunStatus.CANCELLED
        assert first.text == "first"
        third = await r3.result(WAIT)  # the queue goes on
        assert third.status is RunStatus.COMPLETED
        assert third.text == "third"
        assert await ws.cancel_run("r3") is False  # already finished: nothing to do
        with pytest.raises(NotFound):
            await ws.cancel_run("nope")
        seen = await feed.collect_until(completes_run("r3"), WAIT)
    assert [c.run_id for c in payloads(seen, "run_complete")] == ["r2", "r1", "r3"]


async def test_a_failing_store_cannot_lose_a_run_complete(
    crush_server: CrushServer, crush_workspace: WorkspaceClient
) -> None:
    """Regression: the final save used to build the terminal events, so a store that failed (or
    took longer than the save timeout) at the end of a run lost its run_complete."""
    from crush_trio.errors import StoreError

    ws = crush_workspace
    sid = (await ws.create_session()).id
    workspace = crush_server.backend.get(ws.id)

    save_runs = workspace.store.save_runs
    failed: list[str] = []

    async def broken_save(runs: list[Run], prompts: Any = None) -> None:
        # The new record commits (the prompt is accepted); the run's final save fails.
        if not failed and any(run.status.terminal for run in runs):
            failed.extend(run.run_id for run in runs)
            raise StoreError("disk on fire")
        await save_runs(runs, prompts)

    workspace.store.save_runs = broken_save  # type: ignore[method-assign]
    handle = await ws.prompt(sid, "still ends", run_id="s1")
    run = await handle.result(WAIT)
    assert run.status is RunStatus.COMPLETED
    assert handle.complete is not None
    assert handle.complete.text == "still ends"
    assert failed == ["s1"]
    # The workspace survived and keeps serving.
    handle2 = await ws.prompt(sid, "again", run_id="s2")
    assert (await handle2.result(WAIT)).text == "again"


async def test_a_store_failing_at_close_still_closes_the_workspace(
    crush_server: CrushServer, crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    """Regression: the close's last save of run records raised out of the workspace's cleanup,
    so its store was never closed and ``closed`` never set (the server's shutdown waits on it)."""
    from crush_trio.errors import StoreError

    ws = crush_workspace
    gate = Gate()
    scripted_model.add(Step(text="slow", gate_before=gate))
    sid = (await ws.create_session()).id
    await ws.prompt(sid, "x", run_id="z")
    with trio.fail_after(WAIT):
        await gate.reached.wait()
    workspace = crush_server.backend.get(ws.id)

    async def broken_save(runs: list[Run], prompts: Any = None) -> None:
        raise StoreError("disk on fire")

    async def broken_write(messages: Any) -> set[str]:
        raise StoreError("disk on fire")

    workspace.store.save_runs = broken_save  # type: ignore[method-assign]
    workspace.store.write_messages = broken_write  # type: ignore[method-assign]
    workspace.request_shutdown()
    with trio.fail_after(WAIT):
        await workspace.closed.wait()
    assert workspace.store.closed


async def test_the_same_run_id_sent_twice_at_once_is_accepted_once(
    crush_server: CrushServer, crush_workspace: WorkspaceClient
) -> None:
    """Both submissions pass the store's run-id check together (it is a thread hop); the first
    to accept wins, the other is refused, and only one run exists."""
    ws = crush_workspace
    sid = (await ws.create_session()).id
    agent = crush_server.backend.get(ws.id).agent
    outcomes: list[str] = []

    async def submit(text: str) -> None:
        try:
            await agent.submit(sid, text, "twice")
        except BadRequest as exc:
            outcomes.append(exc.message)
        else:
            outcomes.append("accepted")

    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit, "one")
            nursery.start_soon(submit, "two")
        run = await ws.get_run("twice")
    assert sorted(outcomes)[0] == "accepted"
    assert "already used" in sorted(outcomes)[1]
    assert run.run_id == "twice"


async def test_a_new_run_id_is_checked_without_a_store_call(
    crush_server: CrushServer, crush_workspace: WorkspaceClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = crush_workspace
    sid = (await ws.create_session()).id
    store = crush_server.backend.get(ws.id).store
    lookups: list[str] = []
    real = store.get_run

    async def spy(run_id: str) -> Any:
        lookups.append(run_id)
        return await real(run_id)

    monkeypatch.setattr(store, "get_run", spy)
    agent = crush_server.backend.get(ws.id).agent
    fresh = str(uuid.uuid4())
    await agent.submit(sid, "new id", fresh)
    assert lookups == []
    with pytest.raises(BadRequest, match="already used"):
        await agent.submit(sid, "same id", fresh)
    with trio.fail_after(WAIT):
        assert (await ws.get_run(fresh)).session_id == sid
