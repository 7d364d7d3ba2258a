"""The client library against a real server (the plugin's fixtures), plus its plain logic.

Rules: every wait is bounded by the client's own timeouts or ``trio.fail_after``; order comes
from gates of the scripted model and from events, never from sleeping. Streams are dropped from
the server's side (``ClientStream.kill``, what a too-slow client gets) or the client's
(``WorkspaceClient.drop_stream``).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import ssl
import subprocess
import sys
import tempfile
import uuid
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import pytest
import trio

from crush_trio.client import (
    AuthError,
    BadRequest,
    Client,
    Conflict,
    Event,
    Gap,
    NotFound,
    RunFailed,
    RunHandle,
    RunStatus,
    Subscription,
    Timeout,
    Transcript,
    Unreachable,
    WorkspaceClient,
    connect,
    latest_session,
    parse_server_url,
    resolve_session_prefix,
)
from crush_trio.client.events import Mailbox
from crush_trio.embedded import embedded
from crush_trio.errors import Conflict as ServerConflict
from crush_trio.errors import ProviderError
from crush_trio.providers.scripted import Gate, ScriptedModel, Step
from crush_trio.server.api import Api
from crush_trio.server.serve import ServeOptions
from crush_trio.wire import (
    AgentEvent,
    EventKind,
    Message,
    PermissionRequest,
    Role,
    Session,
    TextPart,
)

from .conftest import completes_run

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from trio.testing import MockClock
    from trio_websocket import WebSocketConnection

    from crush_trio.testing import CrushServer

#: Cap on every test's waits (seconds).
CAP = 20


def kill_streams(server: CrushServer, workspace_id: str, client_id: str) -> int:
    """Disconnect a client's event streams from the server's side (close code 1013)."""
    broker = server.backend.get(workspace_id).broker
    killed = 0
    for stream in list(broker.clients):
        if stream.client_id == client_id:
            stream.kill("dropped by the test")
            killed += 1
    return killed


async def collect(handle: Any, timeout: float = CAP) -> list[Event]:
    return [event async for event in handle.events(timeout=timeout)]


def printed(events: list[Event]) -> str:
    """What a terminal shows for these events (the way ``crush-trio run`` prints them)."""
    transcript = Transcript()
    out = ""
    for event in events:
        if event.message is not None:  # a message snapshot or the message a delta leads to
            out += transcript.update(event.message)
        elif event.type == "run_complete":
            out += transcript.finish(event.payload.message_id, event.payload.text)
    return out


# ---------------------------------------------------------------------------------------------
# A full run


async def test_full_run_events_result_and_history(crush_workspace: WorkspaceClient) -> None:
    ws = crush_workspace
    session = await ws.create_session("first")
    with trio.fail_after(CAP):
        handle = await ws.prompt(session.id, "hello there world")
        assert handle.accepted is not None
        assert handle.accepted.status == "running"
        events = await collect(handle)
        run = await handle.result(CAP)
    assert events[-1].type == "run_complete"
    assert events[-1].seq is not None
    assert [e.seq for e in events] == sorted(e.seq for e in events if e.seq is not None)
    # The reply streams as snapshots and (the client asks for deltas=1) message_delta events.
    assert {"message", "run_complete"} <= {e.type for e in events}
    assert {e.type for e in events} <= {"message", "message_delta", "run_complete"}
    assert printed(events) == "hello there world"
    assert run.status is RunStatus.COMPLETED
    assert run.text == "hello there world"
    assert run.run_id == handle.run_id
    uuid.UUID(run.run_id)  # minted by the client
    history = await ws.messages(session.id)
    assert [m.role for m in history] == [Role.USER, Role.ASSISTANT]
    assert run.message_id == history[1].id
    assert handle.done
    assert handle.text == "hello there world"
    assert ws.stats.reconnects == 0
    assert ws.stats.gaps == 0


async def test_run_convenience_and_sessions(crush_workspace: WorkspaceClient) -> None:
    ws = crush_workspace
    a = await ws.create_session("a")
    b = await ws.create_session("b")
    with trio.fail_after(CAP):
        run = await ws.run(b.id, "second session")
    assert run.text == "second session"
    sessions = await ws.sessions()
    assert {s.id for s in sessions} == {a.id, b.id}
    assert (await ws.resolve_session(b.id[:12])).id == b.id
    assert (await ws.session(a.id)).title == "a"
    with pytest.raises(NotFound):
        await ws.session(str(uuid.uuid4()))
    with pytest.raises(BadRequest, match="session"):
        await ws.prompt(str(uuid.uuid4()), "to nowhere")
    info = await ws.agent_info()
    assert info.is_ready


def record_requests(ws: WorkspaceClient, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every HTTP request the workspace client makes from now on, as ``"METHOD /path"``."""
    seen: list[str] = []
    real = ws.client.request

    async def spy(method: str, url: str, **kwargs: Any) -> Any:
        seen.append(f"{method} {url}")
        return await real(method, url, **kwargs)

    monkeypatch.setattr(ws.client, "request", spy)
    return seen


async def test_prompt_goes_over_the_connected_stream_else_over_http(
    crush_client: Client, crush_server: CrushServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with crush_client.workspace(crush_server.project()) as ws:
        sid = (await ws.create_session()).id
        seen = record_requests(ws, monkeypatch)
        with trio.fail_after(CAP):
            handle = await ws.prompt(sid, "over the stream")
            run = await handle.result(CAP)
        assert run.status is RunStatus.COMPLETED
        assert run.text == "over the stream"
        assert handle.accepted is not None
        assert handle.accepted.run_id == run.run_id
        assert not [r for r in seen if r.startswith("POST")]  # one websocket frame instead

    async with crush_client.workspace(crush_server.project(), events=False) as quiet:
        sid = (await quiet.create_session()).id
        seen = record_requests(quiet, monkeypatch)
        with trio.fail_after(CAP):
            handle = await quiet.prompt(sid, "over HTTP")
        assert seen == [f"POST /v1/workspaces/{quiet.id}/agent"]
        assert (await quiet.get_run(handle.run_id)).session_id == sid


async def test_prompt_whose_reply_is_lost_is_settled_by_the_runs_record(
    crush_workspace: WorkspaceClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server accepts the prompt, but the stream drops before its reply arrives."""
    ws = crush_workspace
    sid = (await ws.create_session()).id
    accepted: list[str] = []
    real = Api.accept_prompt

    async def accept_then_lose_the_stream(self: Api, workspace: Any, body: Any) -> Any:
        result = await real(self, workspace, body)
        accepted.append(body.run_id)
        ws.drop_stream()  # before the reply is sent
        return result

    monkeypatch.setattr(Api, "accept_prompt", accept_then_lose_the_stream)
    seen = record_requests(ws, monkeypatch)
    with trio.fail_after(CAP):
        handle = await ws.prompt(sid, "lost reply")
        run = await handle.result(CAP)
    assert accepted == [handle.run_id]  # sent once, not again
    assert f"GET /v1/workspaces/{ws.id}/runs/{handle.run_id}" in seen
    assert not [r for r in seen if r.startswith("POST")]
    assert run.status is RunStatus.COMPLETED
    assert run.text == "lost reply"


async def test_prompt_lost_before_the_server_took_it_is_posted_again(
    crush_workspace: WorkspaceClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = crush_workspace
    sid = (await ws.create_session()).id
    lost: list[str] = []
    real = Api.accept_prompt

    async def lose_the_first(self: Api, workspace: Any, body: Any) -> Any:
        if not lost:
            lost.append(body.run_id)
            ws.drop_stream()
            await trio.lowlevel.checkpoint()
            raise ServerConflict("this reply never reaches the client")
        return await real(self, workspace, body)

    monkeypatch.setattr(Api, "accept_prompt", lose_the_first)
    seen = record_requests(ws, monkeypatch)
    with trio.fail_after(CAP):
        handle = await ws.prompt(sid, "sent twice, run once")
        run = await handle.result(CAP)
    assert lost == [handle.run_id]
    runs_url = f"/v1/workspaces/{ws.id}/runs/{handle.run_id}"
    assert seen[:2] == [f"GET {runs_url}", f"POST /v1/workspaces/{ws.id}/agent"]
    assert run.status is RunStatus.COMPLETED
    assert run.text == "sent twice, run once"


async def test_queued_run_ignores_the_turn_before_it(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    """A run queued behind another run of its session takes only its own turn's messages, and
    the other run's run_complete does not end it."""
    ws = crush_workspace
    session = await ws.create_session()
    gate = Gate()
    scripted_model.add(Step("words of the first run", gate_mid=gate), Step("our own reply"))
    with trio.fail_after(CAP):
        first = await ws.prompt(session.id, "first")
        await gate.reached.wait()
        ours = await ws.prompt(session.id, "second")
        assert ours.accepted is not None
        assert ours.accepted.status == "queued"
        gate.release()
        events = await collect(ours)
        assert (await first.result(CAP)).text == "words of the first run"
    assert printed(events) == "our own reply"
    assert events[-1].payload.run_id == ours.run_id
    assert all("first" not in m.text() for m in ours.messages.values() if m.role is Role.ASSISTANT)


async def test_collect_until_keeps_every_event_before_the_match(
    crush_workspace: WorkspaceClient,
) -> None:
    """Events that do not match are kept, in order; the ones after the match stay queued."""
    ws = crush_workspace
    session = await ws.create_session()
    async with ws.subscribe(timeout=CAP) as feed:
        first = await ws.prompt(session.id, "one two three")
        await first.wait(CAP)
        second = await ws.prompt(session.id, "four five")
        seen = await feed.collect_until(completes_run(first.run_id), CAP)
        rest = await feed.collect_until(completes_run(second.run_id), CAP)
    assert seen[-1].type == "run_complete"
    assert seen[-1].payload.run_id == first.run_id
    assert [e.type for e in seen].count("run_complete") == 1
    assert "message" in {e.type for e in seen}
    assert printed(seen) == "one two three"
    assert printed(rest) == "four five"
    seqs = [e.seq for e in seen + rest]
    assert None not in seqs
    first_seq = seqs[0]
    assert first_seq is not None
    assert seqs == list(range(first_seq, first_seq + len(seqs)))  # none skipped, none twice


async def test_a_subscription_to_some_types_gets_only_those(
    crush_workspace: WorkspaceClient,
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    async with (
        ws.subscribe(timeout=CAP) as everything,
        ws.subscribe(timeout=CAP, types={"run_complete"}) as ends,
    ):
        runs = [await ws.prompt(session.id, text) for text in ("one two", "three four")]
        for run in runs:
            await run.wait(CAP)
        seen = await everything.collect_until(completes_run(runs[-1].run_id), CAP)
        got = [await ends.next(CAP) for _ in runs]
    assert "message" in {e.type for e in seen}
    assert [e.type for e in got] == ["run_complete", "run_complete"]
    assert [e.payload.run_id for e in got] == [r.run_id for r in runs]
    assert [e.seq for e in got] == [e.seq for e in seen if e.type == "run_complete"]


# ---------------------------------------------------------------------------------------------
# Dropped streams


@pytest.mark.parametrize("side", ["server", "client"])
async def test_reconnect_mid_run_loses_and_doubles_nothing(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    side: str,
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    reply = "one two three four five six seven eight"
    gate = Gate()
    scripted_model.add(Step(reply, gate_mid=gate))
    with trio.fail_after(CAP):
        handle = await ws.prompt(session.id, "count")
        await gate.reached.wait()
        before = ws.stats.reconnects
        if side == "server":
            assert kill_streams(crush_server, ws.id, ws.client.client_id) == 1
        else:
            ws.drop_stream()
        assert await ws.wait_reconnected(before, timeout=CAP) == 1
        gate.release()  # the rest of the run arrives on the new connection
        events = await collect(handle)
        run = await handle.result(CAP)
    assert ws.stats.reconnects == 1
    assert ws.stats.drops == 1
    assert printed(events) == reply
    assert run.text == reply
    seqs = [e.seq for e in events if e.seq is not None]
    assert seqs == sorted(set(seqs))  # nothing delivered twice


@asynccontextmanager
async def held_reconnect(ws: WorkspaceClient) -> AsyncIterator[tuple[trio.Event, trio.Event]]:
    """Make the next reconnect of ``ws`` wait: yields (reconnecting, allow)."""
    reconnecting, allow = trio.Event(), trio.Event()
    original = ws._open_socket

    @asynccontextmanager
    async def held(since: int | None) -> AsyncIterator[WebSocketConnection]:
        reconnecting.set()
        await allow.wait()
        async with original(since) as conn:
            yield conn

    ws._open_socket = held  # type: ignore[method-assign]
    try:
        yield reconnecting, allow
    finally:
        ws._open_socket = original  # type: ignore[method-assign]
        allow.set()


@asynccontextmanager
async def parked_run(
    server: CrushServer, ws: WorkspaceClient, model: ScriptedModel, reply: str, prompt: str
) -> AsyncIterator[tuple[Session, RunHandle, Gate, WorkspaceClient, Subscription]]:
    """A run of ``ws`` parked mid-reply, watched by a second client of the same workspace:
    yields (session, handle, gate, watcher, the watcher's feed). ``gate.release()`` lets the run
    finish."""
    session = await ws.create_session()
    gate = Gate()
    model.add(Step(reply, gate_mid=gate))
    async with connect(server.url, server.token) as other:
        async with other.workspace(ws.path) as watcher, watcher.subscribe() as feed:
            handle = await ws.prompt(session.id, prompt)
            await gate.reached.wait()
            yield session, handle, gate, watcher, feed


@pytest.mark.parametrize("crush_config", [{"server": {"replay_buffer": 2}}])
@pytest.mark.parametrize("ended_while_away", [True, False])
async def test_replay_exhausted_state_is_refetched(
    crush_server: CrushServer,
    crush_client: Client,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    ended_while_away: bool,
) -> None:
    """The client is away while more events than the replay buffer holds are published: it gets
    a gap and re-reads its run (and the session's messages) over HTTP."""
    ws = crush_workspace
    reply = "alpha beta gamma delta epsilon zeta"
    with trio.fail_after(CAP):
        async with parked_run(crush_server, ws, scripted_model, reply, "greek") as parked:
            _, handle, gate, watcher, feed = parked
            async with held_reconnect(ws) as (reconnecting, allow):
                kill_streams(crush_server, ws.id, ws.client.client_id)
                await reconnecting.wait()
                if ended_while_away:
                    gate.release()
                    await feed.until(completes_run(handle.run_id))
                for n in range(3):  # push everything of interest out of the replay buffer
                    await watcher.create_session(f"filler {n}")
                allow.set()
                events = []
                stream = handle.events(CAP)
                if not ended_while_away:
                    async for event in stream:  # back, and told about the gap
                        events.append(event)
                        if event.type == "gap":
                            break
                    gate.release()  # the rest of the run arrives live
                events += [event async for event in stream]
                run = await handle.result(CAP)
    assert ws.stats.gaps == 1
    assert ws.stats.refetches >= 1
    assert any(e.type == "gap" for e in events)
    assert run.status is RunStatus.COMPLETED
    assert run.text == reply
    assert printed(events) == reply
    if ended_while_away:
        assert events[-1].type == "run_complete"
        assert events[-1].seq is None
        assert handle.complete is not None
        assert handle.complete.text == reply


def refuse_streams(server: CrushServer, workspace_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the server refuse new event streams of a workspace with its real 409 ("workspace
    closing"), while its HTTP routes (``GET runs/{id}``) keep answering."""

    def closing() -> None:
        raise Conflict("workspace closing: refused by the test")

    monkeypatch.setattr(server.backend.get(workspace_id), "check_open", closing)


@pytest.mark.parametrize("ended_while_away", [True, False])
async def test_refused_reconnect_follows_pending_runs_by_their_records(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    monkeypatch: pytest.MonkeyPatch,
    ended_while_away: bool,
) -> None:
    """A reconnect refused for good (409) ends the stream, not the pending runs: each is followed
    with ``GET runs/{id}`` and ends with its real outcome (it used to fail with the 409)."""
    ws = crush_workspace
    reply = "finished without a stream"
    with trio.fail_after(CAP):
        async with parked_run(crush_server, ws, scripted_model, reply, "keep going") as parked:
            session, handle, gate, watcher, feed = parked
            async with held_reconnect(ws) as (reconnecting, allow):
                ws.drop_stream()
                await reconnecting.wait()
                refuse_streams(crush_server, ws.id, monkeypatch)
                if ended_while_away:
                    gate.release()
                    await feed.until(completes_run(handle.run_id))
                allow.set()
                with pytest.raises(Conflict, match="workspace closing"):
                    await ws.wait_reconnected(timeout=CAP)
            assert ws.stream_error is not None
            with pytest.raises(Conflict, match="workspace closing"):
                await ws.prompt(session.id, "no stream, no new runs")
            if not ended_while_away:
                assert not handle.done  # still followed, not failed
                gate.release()
            events = await collect(handle)
            run = await handle.result(CAP)
    assert run.status is RunStatus.COMPLETED
    assert run.text == reply
    assert events[-1].type == "run_complete"
    assert events[-1].seq is None
    assert printed(events) == reply
    assert ws.stats.refetches >= 1
    assert ws.stats.reconnects == 0


async def test_refused_reconnect_fails_runs_whose_record_is_gone(
    crush_server: CrushServer, crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    """When the workspace is gone on the server, the reconnect gets 404 and so does the run's
    record: the run fails with NotFound at once, naming the run, rather than waiting."""
    ws = crush_workspace
    session = await ws.create_session()
    gate = Gate()
    scripted_model.add(Step("never finished", gate_before=gate))
    with trio.fail_after(CAP):
        handle = await ws.prompt(session.id, "doomed")
        await gate.reached.wait()
        server_ws = crush_server.backend.get(ws.id)
        async with held_reconnect(ws) as (reconnecting, allow):
            ws.drop_stream()
            await reconnecting.wait()
            server_ws.request_shutdown()  # the run is cancelled while the client is away
            await server_ws.closed.wait()
            allow.set()
            with pytest.raises(NotFound, match="is gone"):
                await ws.wait_reconnected(timeout=CAP)
        with pytest.raises(NotFound, match=f"run '{handle.run_id}' could not be followed"):
            await handle.result(CAP)


# ---------------------------------------------------------------------------------------------
# Cancelled and failed runs, timeouts


async def test_cancelled_run_is_a_result(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    gate = Gate()
    scripted_model.add(Step("never said", gate_before=gate))
    with trio.fail_after(CAP):
        handle = await ws.prompt(session.id, "stop me")
        await gate.reached.wait()
        await handle.cancel()
        events = await collect(handle)
        run = await handle.result(CAP)
    assert run.status is RunStatus.CANCELLED
    assert events[-1].type == "run_complete"
    assert events[-1].payload.cancelled
    assert handle.errors == []


async def test_cancelling_a_queued_run_leaves_the_running_one_alone(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    gate = Gate()
    scripted_model.add(Step("the running run's words", gate_mid=gate))
    with trio.fail_after(CAP):
        running = await ws.prompt(session.id, "first")
        await gate.reached.wait()
        queued = await ws.prompt(session.id, "second")
        await queued.cancel()
        assert (await queued.result(CAP)).status is RunStatus.CANCELLED
        assert not running.done
        gate.release()
        run = await running.result(CAP)
    assert run.status is RunStatus.COMPLETED
    assert run.text == "the running run's words"


async def test_failed_run_raises_run_failed(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    scripted_model.add(Step("half a rep", error=ProviderError("the model fell over")))
    with trio.fail_after(CAP):
        handle = await ws.prompt(session.id, "fail please")
        with pytest.raises(RunFailed, match="the model fell over") as caught:
            await handle.result(CAP)
        record = await handle.result(CAP, check=False)
    assert caught.value.run.status is RunStatus.FAILED
    assert record.status is RunStatus.FAILED
    assert record.error == "the model fell over"
    assert [e.text for e in handle.errors] == ["the model fell over"]


async def test_waits_raise_our_timeout(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel, autojump_clock: MockClock
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    gate = Gate()
    scripted_model.add(Step("held", gate_before=gate))
    handle = await ws.prompt(session.id, "wait for me")
    with trio.fail_after(CAP):
        await gate.reached.wait()
    start = trio.current_time()
    with pytest.raises(Timeout, match="did not end within 30 s") as caught:
        await handle.result(30)
    assert isinstance(caught.value, TimeoutError)
    assert trio.current_time() - start == pytest.approx(30)
    with pytest.raises(Timeout):
        await collect(handle, timeout=5)
    async with ws.subscribe() as feed:
        with pytest.raises(Timeout, match="no event"):
            await feed.next(timeout=5)

        def never(event: Event) -> bool:
            return False

        with pytest.raises(Timeout, match=r"matched test_waits_raise.*never within 5 s"):
            await feed.collect_until(never, timeout=5)
        with pytest.raises(Timeout, match=r"matched the predicate at .*test_client.py:\d+"):
            await feed.until(lambda e: False, timeout=5)
    with pytest.raises(Timeout, match="did not ask for permission or end within 5 s"):
        await handle.next_permission_request(timeout=5)
    with pytest.raises(Timeout, match="was not re-opened within 5 s"):
        await ws.wait_reconnected(timeout=5)  # nothing dropped it
    gate.release()
    with trio.fail_after(CAP):
        assert (await handle.result(CAP)).text == "held"


async def test_autojump_clock_runs_a_whole_conversation(
    crush_workspace: WorkspaceClient, autojump_clock: MockClock
) -> None:
    """With the plugin's clock hold, database calls do not let virtual time leap."""
    ws = crush_workspace
    session = await ws.create_session()
    start = trio.current_time()
    for n in range(5):
        run = await ws.run(session.id, f"turn {n}", timeout=1)
        assert run.text == f"turn {n}"
    assert trio.current_time() - start < 1


# ---------------------------------------------------------------------------------------------
# Permissions (answered from the client: per run, never workspace-wide)


async def test_auto_approve_answers_only_its_own_runs_requests(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A permission request is this run's only when its tool call is in this run's turn: not a
    request of the run before it in the same session, nor one of another session."""
    ws = crush_workspace
    ours = await ws.create_session()
    other = await ws.create_session()
    granted: list[str] = []
    answered = trio.Event()

    async def grant(permission_id: str, action: str = "allow") -> bool:
        granted.append(f"{permission_id}:{action}")
        answered.set()
        return True

    monkeypatch.setattr(ws, "grant", grant)
    broker = crush_server.backend.get(ws.id).broker
    gate_first, gate_tool = Gate(), Gate()
    scripted_model.add(
        Step("first", gate_mid=gate_first),
        Step("let me look", tool_calls=[("bash", {"command": "ls"})]),
        Step("done", gate_before=gate_tool),
    )

    def request(pid: str, session_id: str, call_id: str) -> PermissionRequest:
        return PermissionRequest(pid, session_id, call_id, "bash", "run a command")

    with trio.fail_after(CAP):
        first = await ws.prompt(ours.id, "first run")  # not auto-approved
        await gate_first.reached.wait()
        handle = await ws.prompt(ours.id, "our run", auto_approve=True)
        assert handle.accepted is not None
        assert handle.accepted.status == "queued"
        # While our run waits, a request in our session belongs to the first run.
        await broker.publish_must_deliver(
            request("p-first", ours.id, "call-of-first"), EventKind.CREATED
        )
        gate_first.release()
        await first.result(CAP)
        await gate_tool.reached.wait()  # our turn has made its tool call
        history = await ws.messages(ours.id)
        call_id = next(c.id for m in history for c in m.tool_calls())
        await broker.publish_must_deliver(request("p-other", other.id, call_id), EventKind.CREATED)
        await broker.publish_must_deliver(request("p-ours", ours.id, call_id), EventKind.CREATED)
        await answered.wait()
        gate_tool.release()
        await handle.result(CAP)
    assert granted == ["p-ours:allow"]
    assert list(handle.permission_requests) == ["p-ours"]


async def test_next_permission_request_returns_only_its_own_runs_requests(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    """Two runs ask at the same time; each handle gives its own request to answer, and None once
    its run has ended."""
    ws = crush_workspace
    first = await ws.create_session()
    second = await ws.create_session()
    scripted_model.add(
        Step(tool_calls=[("write", {"path": "a.txt", "content": "a"})]),
        Step(tool_calls=[("write", {"path": "b.txt", "content": "b"})]),
        Step("a written"),
        Step("b written"),
    )
    with trio.fail_after(CAP):
        a = await ws.prompt(first.id, "write a")
        asked_a = await a.next_permission_request(CAP)
        b = await ws.prompt(second.id, "write b")
        asked_b = await b.next_permission_request(CAP)
        assert asked_a is not None
        assert asked_b is not None
        assert asked_a.session_id == first.id
        assert asked_a.path.endswith("a.txt")
        assert asked_b.session_id == second.id
        assert asked_b.path.endswith("b.txt")
        assert await ws.grant(asked_a.id) is True
        assert (await a.result(CAP)).text == "a written"
        assert await a.next_permission_request(CAP) is None  # never b's request
        assert not b.done
        assert await ws.grant(asked_b.id, "deny") is True
        assert (await b.result(CAP)).status is RunStatus.COMPLETED
        assert await b.next_permission_request(CAP) is None
    assert list(a.permission_requests) == [asked_a.id]
    assert list(b.permission_requests) == [asked_b.id]
    assert (Path(ws.path) / "a.txt").read_text() == "a"
    assert not (Path(ws.path) / "b.txt").exists()


# ---------------------------------------------------------------------------------------------
# Connecting


async def test_connect_errors(crush_server: CrushServer) -> None:
    with trio.fail_after(CAP):
        with pytest.raises(AuthError, match="refused the token"):
            async with connect(crush_server.url, "wrong-token"):
                pass  # pragma: no cover
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        listener.close()  # nothing listens there now
        with pytest.raises(Unreachable, match="cannot reach"):
            async with connect(f"http://127.0.0.1:{port}", "t"):
                pass  # pragma: no cover
        with pytest.raises(ValueError, match="not an http"):
            async with connect("ftp://example", "t"):
                pass  # pragma: no cover
        # The URL the server prints carries the token.
        async with connect(f"{crush_server.url}/?token={crush_server.token}") as client:
            assert await client.version()


async def test_missing_workspace_directory_is_bad_request(crush_client: Client) -> None:
    with pytest.raises(BadRequest, match="does not exist"):
        async with crush_client.workspace("/nonexistent/crush-trio-test"):
            pass  # pragma: no cover


async def test_workspace_hold_is_released_on_close(
    crush_server: CrushServer, crush_client: Client
) -> None:
    project = crush_server.project()
    with trio.fail_after(CAP):
        async with crush_client.workspace(project) as ws:
            server_ws = crush_server.backend.get(ws.id)
            assert crush_client.client_id in server_ws.holds.clients
        await server_ws.closed.wait()  # nothing else held it, so it shut down
    assert [w for w in await crush_client.workspaces() if w.id == ws.id] == []


async def test_embedded_server_starts_and_stops(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    options = ServeOptions(
        data_dir=tmp_path / "data", user_config_dir=tmp_path / "config", access_log=False
    )
    with trio.fail_after(CAP):
        async with embedded(options) as client:
            assert client.server is not None
            assert client.url.startswith("http://127.0.0.1:")
            async with client.workspace(project) as ws:
                session = await ws.create_session()
                assert (await ws.run(session.id, "in process")).text == "in process"
            backend = client.server.backend
    assert backend.stopped.is_set()


async def test_unix_socket_server(tmp_path: Path) -> None:
    """``unix:/path`` addresses: HTTP and the event stream over a Unix socket (no token)."""
    from functools import partial

    from crush_trio.server.serve import serve

    sock = Path(tempfile.mkdtemp(prefix="ct-")) / "s.sock"  # short: AF_UNIX paths are limited
    project = tmp_path / "project"
    project.mkdir()
    options = ServeOptions(
        host=f"unix:{sock}",
        data_dir=tmp_path / "data",
        user_config_dir=tmp_path / "config",
        access_log=False,
    )
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            handle = await nursery.start(partial(serve, options))
            async with connect(handle.url) as client, client.workspace(project) as ws:
                session = await ws.create_session()
                assert (await ws.run(session.id, "over a unix socket")).text == "over a unix socket"
                ws.drop_stream()
                assert await ws.wait_reconnected(timeout=CAP) == 1
                assert (await ws.run(session.id, "and again")).text == "and again"
                assert ws.stats.drops == 1
            handle.stop()


# ---------------------------------------------------------------------------------------------
# The documentation's examples

DOCS = Path(__file__).resolve().parent.parent / "docs"


def python_blocks(markdown: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown.read_text(), re.S)


@pytest.mark.slow
async def test_docs_examples_run(crush_server: CrushServer, tmp_path: Path) -> None:
    """Every Python block of docs/client.md is a complete program; run each one."""
    blocks = python_blocks(DOCS / "client.md")
    assert len(blocks) >= 4
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRUSH_TRIO_")}
    env |= {
        "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
        "CRUSH_TRIO_SERVER": crush_server.url,
        "CRUSH_TRIO_TOKEN": crush_server.token,
    }
    outputs = []
    for number, code in enumerate(blocks, 1):
        with trio.fail_after(60):
            done = await trio.run_process(
                [sys.executable, "-c", code],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env=env,
                cwd=tmp_path,
            )
        assert done.returncode == 0, f"example {number} of docs/client.md failed:\n" + (
            done.stderr.decode()
        )
        outputs.append(done.stdout.decode())
    assert outputs[0].splitlines()[-1] == "completed hello from the client"
    assert outputs[1].splitlines()[0] == "one prompt, one answer"
    assert outputs[2].splitlines() == ["asked: write notes.txt", "written"]


# ---------------------------------------------------------------------------------------------
# Plain logic


def test_parse_server_url() -> None:
    assert parse_server_url("http://127.0.0.1:7433") == ("http://127.0.0.1:7433", None, None)
    assert parse_server_url("http://h:1/?token=abc") == ("http://h:1", "abc", None)
    assert parse_server_url("http://h:1/?token=abc", "given") == ("http://h:1", "given", None)
    assert parse_server_url("unix:/tmp/s.sock") == ("http://localhost", None, "/tmp/s.sock")
    with pytest.raises(ValueError, match="is not an http"):
        parse_server_url("127.0.0.1:7433")


def test_session_prefix_resolution() -> None:
    sessions = [
        Session("aaaa-1111", updated_at=5),
        Session("aaaa-2222", updated_at=9),
        Session("bbbb-3333", updated_at=7),
    ]
    assert resolve_session_prefix(sessions, "b").id == "bbbb-3333"
    assert resolve_session_prefix(sessions, "aaaa-2").id == "aaaa-2222"
    assert resolve_session_prefix(sessions, "aaaa-1111").id == "aaaa-1111"
    with pytest.raises(BadRequest, match="matches 2 sessions"):
        resolve_session_prefix(sessions, "aaaa")
    with pytest.raises(NotFound):
        resolve_session_prefix(sessions, "c")
    with pytest.raises(NotFound):
        resolve_session_prefix(sessions, "")
    latest = latest_session(sessions)
    assert latest is not None
    assert latest.id == "aaaa-2222"
    assert latest_session([]) is None


def _assistant(mid: str, text: str) -> Message:
    return Message(mid, "s", Role.ASSISTANT, [TextPart(text)])


def test_transcript_prints_each_character_once() -> None:
    t = Transcript()
    assert t.update(_assistant("m1", "Hel")) == "Hel"
    assert t.update(_assistant("m1", "Hello")) == "lo"
    assert t.update(_assistant("m1", "Hel")) == ""  # an older snapshot
    assert t.update(Message("u", "s", Role.USER, [TextPart("prompt")])) == ""
    assert t.update(_assistant("m2", "Next step")) == "\nNext step"  # a new step, new line
    assert t.finish("m2", "Next step done") == " done"
    assert t.output == "Hello\nNext step done"


def test_transcript_finishes_from_run_complete_after_drops() -> None:
    t = Transcript()
    assert t.finish("m1", "all of it") == "all of it"  # no message event arrived at all
    t = Transcript()
    t.update(_assistant("m1", "retried"))
    assert t.update(_assistant("m1", "other text")) == ""  # the reply restarted: stop streaming
    assert t.finish("m1", "other text") == "\nother text"


def test_mailbox_drops_lossy_events_and_reports_a_gap() -> None:
    box = Mailbox(size=2)
    for n in range(4):
        box.put(Event("message", n, seq=n + 1))
    box.put(Event("run_complete", "end", seq=5))  # must-deliver: never dropped
    taken = [box.get_nowait() for _ in range(3)]
    assert [e.seq for e in taken if e is not None] == [1, 2, 5]
    box.put(Event("message", 9, seq=6))
    gap = box.get_nowait()
    assert gap is not None
    assert gap.type == "gap"
    assert gap.payload == Gap(2)
    assert box.dropped == 2


def test_own_agent_event_rule() -> None:
    from crush_trio.client import is_own_agent_event

    assert is_own_agent_event(AgentEvent("error", "s1", "r1"), "r1", "s1")
    assert not is_own_agent_event(AgentEvent("error", "s1", "r2"), "r1", "s1")
    assert is_own_agent_event(AgentEvent("error", "s1", None), "r1", "s1")
    assert not is_own_agent_event(AgentEvent("error", "s2", None), "r1", "s1")
    assert not is_own_agent_event(AgentEvent("error", None, None), "r1", "s1")


def test_timeout_is_a_timeout_error() -> None:
    assert issubclass(Timeout, TimeoutError)
    assert str(Timeout("what was awaited")) == "what was awaited"
    assert math.isfinite(CAP)


# ---------------------------------------------------------------------------------------------
# Redirects: the token follows a 307 only to a node it may go to, and TLS is always verified


@attrs.define
class StubNode:
    """A plain HTTP/1.1 (or TLS) listener on 127.0.0.1 that records each request's head and
    answers ``/v1/version`` (and, without ``redirect_to``, every path) with 200 and every other
    path with a 307 to ``redirect_to`` + the path. One request per connection."""

    redirect_to: str = ""
    heads: list[str] = attrs.field(factory=list)
    port: int = 0

    async def handle(self, stream: trio.abc.Stream) -> None:
        head = b""
        try:
            while b"\r\n\r\n" not in head and len(head) < 65536:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                head += chunk
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return  # a TLS handshake the client refused
        text = head.decode("latin-1")
        self.heads.append(text)
        path = text.split(" ", 2)[1]
        if path == "/v1/version" or not self.redirect_to:
            body = b'{"version": "stub"}'
            answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        else:
            body = b""
            location = f"{self.redirect_to}{path}".encode()
            answer = b"HTTP/1.1 307 Temporary Redirect\r\nLocation: " + location + b"\r\n"
        answer += b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(answer)
            await stream.aclose()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def start_stub(nursery: trio.Nursery, node: StubNode, ssl_context: Any = None) -> StubNode:
    if ssl_context is None:
        listeners = await nursery.start(partial(trio.serve_tcp, node.handle, 0, host="127.0.0.1"))
    else:
        listeners = await nursery.start(
            partial(trio.serve_ssl_over_tcp, node.handle, 0, ssl_context, host="127.0.0.1")
        )
    sock = listeners[0].socket if ssl_context is None else listeners[0].transport_listener.socket
    node.port = sock.getsockname()[1]
    return node


def self_signed_context(tmp_path: Path) -> ssl.SSLContext:
    """A server TLS context with a self-signed certificate for 127.0.0.1 (no CA trusts it)."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


async def test_a_redirect_to_another_host_with_the_same_scheme_carries_the_token() -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            owner = await start_stub(nursery, StubNode())
            first = await start_stub(nursery, StubNode(redirect_to=owner.url))
            async with connect(first.url, "tok") as client:
                assert await client.request("GET", "/v1/workspaces/w1/sessions")
                assert client.owners["w1"] == owner.url
            nursery.cancel_scope.cancel()
    assert any("authorization: bearer tok" in h.lower() for h in owner.heads)


async def test_a_redirect_from_https_to_plain_http_is_refused() -> None:
    # The rule itself (no TLS server needed): a downgrade is refused, configured or not.
    from crush_trio.client.connection import redirect_refusal

    assert "downgrade" in (redirect_refusal("https://a:1", "http://b:2", frozenset()) or "")
    nodes = frozenset({"http://b:2"})
    assert "downgrade" in (redirect_refusal("https://a:1", "http://b:2", nodes) or "")
    assert redirect_refusal("https://a:1", "https://b:2", frozenset()) is None
    assert redirect_refusal("http://a:1", "http://b:2", frozenset()) is None
    assert redirect_refusal("http://a:1", "https://b:2", frozenset()) is not None
    assert redirect_refusal("http://a:1", "https://b:2", frozenset({"https://b:2"})) is None


async def test_a_redirect_to_another_scheme_is_not_followed_with_the_token() -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            elsewhere = await start_stub(nursery, StubNode())
            target = f"https://127.0.0.1:{elsewhere.port}"
            first = await start_stub(nursery, StubNode(redirect_to=target))
            async with connect(first.url, "tok") as client:
                # RedirectRefused, an Unreachable
                with pytest.raises(Unreachable, match="does not follow with its token"):
                    await client.request("GET", "/v1/workspaces/w1/sessions")
                with pytest.raises(Unreachable, match="does not follow with its token"):
                    await client.request("GET", "/v1/somewhere")  # no workspace in the path
                assert client.owners == {}
            nursery.cancel_scope.cancel()
    assert elsewhere.heads == []  # nothing was sent there


async def test_a_configured_https_node_is_verified_even_from_an_http_base(
    tmp_path: Path,
) -> None:
    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            tls = await start_stub(nursery, StubNode(), self_signed_context(tmp_path))
            target = f"https://127.0.0.1:{tls.port}"
            first = await start_stub(nursery, StubNode(redirect_to=target))
            async with connect(first.url, "tok", nodes=[target]) as client:
                with pytest.raises(Unreachable, match="cannot reach"):
                    await client.request("GET", "/v1/workspaces/w1/sessions")
            nursery.cancel_scope.cancel()
    assert tls.heads == []  # the handshake failed: the token never went out
