"""The client library on a real server with ``message_delta`` events (``deltas=1``) and without.

* The text the library assembles from deltas equals the message the server stored.
* A client that asks for snapshots only (``deltas=False``, as a Crush client) gets no delta and
  prints the same reply.
* A client away for 10 s during a reply paced at 50 tokens/s resumes with ``since``: the server
  replays the deltas it missed, so there is no ``gap`` and no re-read.
* A delta dropped on the way (the stream's frame lost) is detected by its offset, the message is
  re-read over HTTP, and the assembly continues from there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import trio

from crush_trio.client import Event, RunHandle, Transcript, WorkspaceClient, connect
from crush_trio.providers.scripted import Gate, ScriptedModel, Step
from crush_trio.wire import Message, ReasoningPart, Role, TextPart

from .test_client import held_reconnect

if TYPE_CHECKING:
    from crush_trio.testing import CrushServer

#: Cap on every test's waits (seconds).
CAP = 30


def printed(events: list[Event], *, finish: bool = True) -> str:
    """What ``crush-trio run`` prints for these events (deltas and snapshots alike)."""
    transcript = Transcript()
    out = ""
    for event in events:
        message = event.message
        if message is not None:
            out += transcript.update(message)
        elif event.type == "run_complete" and finish:
            out += transcript.finish(event.payload.message_id, event.payload.text)
    return out


def streamed(message: Message) -> list[tuple[str, str]]:
    """The streamed fields of a message's parts (reasoning and text), in order."""
    out = []
    for part in message.parts:
        if isinstance(part, TextPart):
            out.append(("text", part.text))
        elif isinstance(part, ReasoningPart):
            out.append(("reasoning", part.thinking))
    return out


async def collect(handle: RunHandle) -> list[Event]:
    return [event async for event in handle.events(timeout=CAP)]


@pytest.mark.parametrize("deltas", [True, False])
async def test_assembled_text_equals_the_stored_message(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    deltas: bool,
) -> None:
    reply = " ".join(f"wörd{i} 😀" for i in range(120))
    scripted_model.add(Step(reply, reasoning="thinking it over", token_delay=0.001))
    with trio.fail_after(CAP):
        async with (
            connect(crush_server.url, crush_server.token, deltas=deltas) as client,
            client.workspace(crush_workspace.path) as ws,
        ):
            session = await ws.create_session()
            handle = await ws.prompt(session.id, "stream please")
            events = await collect(handle)
            stored = [m for m in await ws.messages(session.id) if m.role is Role.ASSISTANT]
    (final,) = stored
    delta_events = [e for e in events if e.type == "message_delta"]
    if deltas:
        assert ws.stats.deltas == len(delta_events) > 0
        assert ws.stats.deltas_missing == 0
        assert ws.stats.rereads == 0
        # Every delta leads to a prefix of the stored message, field by field (the appends
        # still pending when the reply finished come with the final snapshot).
        for event in delta_events:
            assert event.message is not None
            assert event.message.id == final.id
            for (kind, have), (kind_final, whole) in zip(
                streamed(event.message), streamed(final), strict=False
            ):
                assert kind == kind_final
                assert whole.startswith(have)
        last = delta_events[-1].message
        assert last is not None
        assert len(last.text()) > len(final.text()) // 2
        # A delta event carries only the appended text, not the message.
        raw = delta_events[-1].raw
        assert raw is not None
        assert "parts" not in str(raw)
    else:
        assert ws.stats.deltas == 0
        assert not delta_events
    assert handle.messages[final.id] == final
    assert printed(events, finish=False) == reply
    assert printed(events) == reply == final.text()


def kill_streams(server: CrushServer, workspace_id: str, client_id: str) -> None:
    broker = server.backend.get(workspace_id).broker
    for stream in list(broker.clients):
        if stream.client_id == client_id:
            stream.kill("dropped by the test")


#: A reply paced at 50 tokens/s that lasts longer than the client's absence.
PACED_TOKENS = 750
PACED_DELAY = 0.02
AWAY = 10.0


async def test_away_for_ten_seconds_during_a_paced_reply_resumes_without_gap(
    autojump_clock: trio.testing.MockClock,
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
) -> None:
    ws = crush_workspace
    reply = " ".join(f"t{i}" for i in range(PACED_TOKENS))
    started = Gate()
    scripted_model.add(Step(reply, token_delay=PACED_DELAY, gate_before=started))
    session = await ws.create_session()
    with trio.fail_after(PACED_TOKENS * PACED_DELAY + 60):
        handle = await ws.prompt(session.id, "a long paced answer")
        await started.reached.wait()
        events: list[Event] = []
        stream = handle.events(timeout=None)
        started.release()
        async for event in stream:  # the reply is on its way
            events.append(event)
            message = event.message
            if event.type == "message_delta" and message is not None and len(message.text()) > 100:
                break
        async with held_reconnect(ws) as (reconnecting, allow):
            kill_streams(crush_server, ws.id, ws.client.client_id)
            await reconnecting.wait()
            away_from = trio.current_time()
            await trio.sleep(AWAY)
            deltas_before, batches_before = ws.stats.deltas, ws.stats.batches
            allow.set()
            events += [event async for event in stream]
        run = await handle.result(CAP)
    assert trio.current_time() - away_from < PACED_TOKENS * PACED_DELAY  # away mid-reply
    assert ws.stats.reconnects == 1
    assert ws.stats.gaps == 0
    assert not any(e.type == "gap" for e in events)
    assert ws.stats.deltas_missing == 0
    assert ws.stats.rereads == 0
    # The deltas published while away were replayed after `since`, then the reply went on live.
    assert ws.stats.deltas - deltas_before > AWAY / 0.033 / 2
    # The replay came in frames of several envelopes (batch=1), each envelope applied in order.
    assert ws.stats.batches > batches_before
    assert printed(events, finish=False) == reply == run.text


async def test_a_lost_delta_is_detected_and_the_message_re_read(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
) -> None:
    """A delta frame lost between the server and the library (as if its queue had overflowed
    without telling) shows as an offset beyond the assembled text; the library re-reads the
    session's messages and the reply still prints whole, live."""
    ws = crush_workspace
    reply = " ".join(f"w{i}" for i in range(60))
    gate = Gate()
    scripted_model.add(Step(reply, gate_mid=gate, token_delay=0.002))
    stream = ws._stream
    original = stream._handle_frame
    lost: list[Any] = []

    def lossy(frame: Any) -> None:
        if (
            not lost
            and isinstance(frame, dict)
            and frame.get("type") == "message_delta"
            and frame["payload"]["payload"]["offset"] > 0
        ):
            lost.append(frame)
            stream.stats.on_event(frame["seq"])  # seen, but never applied
            return
        original(frame)

    stream._handle_frame = lossy  # type: ignore[method-assign]
    session = await ws.create_session()
    with trio.fail_after(CAP):
        handle = await ws.prompt(session.id, "lose one")
        await gate.reached.wait()
        gate.release()
        events = await collect(handle)
    assert lost
    assert ws.stats.deltas_missing >= 1
    assert ws.stats.rereads >= 1
    assert printed(events, finish=False) == reply
