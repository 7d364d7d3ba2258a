"""Run semantics through the real server: exactly one run_complete per run, queue, fold, cancel.

The model is a :class:`ScriptedModel` whose gates hold a run at a chosen phase (before streaming,
mid-stream) until the test releases it, so every interleaving here is deterministic.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import trio
import trio.lowlevel
from trio_websocket import ConnectionClosed, open_websocket_url

from crush_trio.errors import ConfigError, ProviderError
from crush_trio.providers.scripted import Gate, ScriptedModel, Step
from crush_trio.wire import Role, TextPart

from .conftest import Server, running_server


class Collector:
    """Every frame of one websocket, gathered by a background task."""

    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []
        self._changed = trio.Event()
        self.closed: Any = None

    async def pump(self, conn: Any) -> None:
        try:
            while True:
                self.frames.append(orjson.loads(await conn.get_message()))
                self._changed.set()
                self._changed = trio.Event()
        except ConnectionClosed as exc:
            self.closed = exc.reason

    async def wait_for(
        self, pred: Callable[[list[dict[str, Any]]], bool], timeout: float = 10
    ) -> None:
        with trio.fail_after(timeout):
            while not pred(self.frames):
                await self._changed.wait()

    def completes(self, run_id: str | None = None) -> list[dict[str, Any]]:
        return [
            f["payload"]["payload"]
            for f in self.frames
            if f["type"] == "run_complete"
            and (run_id is None or f["payload"]["payload"]["run_id"] == run_id)
        ]

    async def complete(self, run_id: str) -> dict[str, Any]:
        await self.wait_for(lambda _: bool(self.completes(run_id)))
        return self.completes(run_id)[0]

    def errors(self) -> list[dict[str, Any]]:
        return [
            f["payload"]["payload"]
            for f in self.frames
            if f["type"] == "agent_event" and f["payload"]["payload"]["type"] == "error"
        ]


@asynccontextmanager
async def harness(
    tmp_path: Path, model: ScriptedModel | Any
) -> AsyncIterator[tuple[Server, str, str, Collector]]:
    """A server with ``model``, one workspace, one session and a collecting websocket."""
    async with running_server(tmp_path, provider_factory=model) as server:
        ws = await server.open_workspace()
        session = await server.create_session(ws["id"])
        collector = Collector()
        url = server.ws_url(ws["id"], str(uuid.uuid4()))
        async with open_websocket_url(url) as conn, trio.open_nursery() as nursery:
            nursery.start_soon(collector.pump, conn)
            await collector.wait_for(lambda f: bool(f))  # hello
            yield server, ws["id"], session["id"], collector
            nursery.cancel_scope.cancel()


async def test_provider_error_carries_run_and_session(tmp_path: Path) -> None:
    model = ScriptedModel([Step(text="partial words", error=ProviderError("upstream exploded"))])
    async with harness(tmp_path, model) as (server, wid, sid, events):
        await server.prompt(wid, sid, "go", run_id="bad")
        complete = await events.complete("bad")
        assert complete["error"] == "upstream exploded" and complete["cancelled"] is False
        assert complete["text"] == "partial words"
        errors = events.errors()
        assert errors == [
            {
                "type": "error",
                "session_id": sid,
                "run_id": "bad",
                "message": "upstream exploded",
                "error": "upstream exploded",
            }
        ]
        run = await server.run(wid, "bad")
        assert run["status"] == "failed" and run["error"] == "upstream exploded"
        msgs = await server.messages(wid, sid)
        finish = msgs[-1]["parts"][-1]
        assert finish["type"] == "finish" and finish["data"]["reason"] == "error"


async def test_foreign_run_failure_does_not_touch_ours(tmp_path: Path) -> None:
    gate = Gate()
    model = ScriptedModel(
        [Step(text="ours continues", gate_mid=gate), Step(error=ProviderError("theirs failed"))]
    )
    async with harness(tmp_path, model) as (server, wid, sid, events):
        other = await server.create_session(wid)
        await server.prompt(wid, sid, "ours", run_id="ours")
        with trio.fail_after(5):
            await gate.reached.wait()
        await server.prompt(wid, other["id"], "theirs", run_id="theirs")
        theirs = await events.complete("theirs")
        assert theirs["error"] == "theirs failed"
        gate.release()
        ours = await events.complete("ours")
        assert ours["error"] is None and ours["text"] == "ours continues"
        assert [e["run_id"] for e in events.errors()] == ["theirs"]


async def test_early_failure_gets_exactly_one_errored_terminal(tmp_path: Path) -> None:
    calls = 0

    def broken_factory(name: str, cfg: Any) -> Any:
        nonlocal calls
        calls += 1
        raise ConfigError("provider 'echo' could not be set up: missing api_key")

    async with harness(tmp_path, broken_factory) as (server, wid, sid, events):
        await server.prompt(wid, sid, "first", run_id="early")
        complete = await events.complete("early")
        assert "could not be set up" in complete["error"]
        assert complete["message_id"] is not None  # an errored assistant record exists
        # A second run proves the first got no late duplicate.
        await server.prompt(wid, sid, "second", run_id="early2")
        await events.complete("early2")
        assert len(events.completes("early")) == 1
        assert (await server.run(wid, "early"))["status"] == "failed"
        assert calls >= 1


async def test_session_deleted_before_queued_run_starts(tmp_path: Path) -> None:
    gate = Gate()
    model = ScriptedModel([Step(text="a", gate_before=gate)])
    async with harness(tmp_path, model) as (server, wid, sid, events):
        await server.prompt(wid, sid, "one", run_id="d1")
        with trio.fail_after(5):
            await gate.reached.wait()
        r = await server.http.delete(f"/v1/workspaces/{wid}/sessions/{sid}")
        assert r.status_code == 200
        gate.release()
        complete = await events.complete("d1")
        assert complete["cancelled"] is True and complete["error"] is None
        assert len(events.completes("d1")) == 1


async def test_cancel_mid_stream_saves_partial_reply(tmp_path: Path) -> None:
    gate = Gate()
    model = ScriptedModel([Step(text="one two three four five six", gate_mid=gate)])
    async with harness(tmp_path, model) as (server, wid, sid, events):
        await server.prompt(wid, sid, "go", run_id="c1")
        with trio.fail_after(5):
            await gate.reached.wait()
        r = await server.http.post(f"/v1/workspaces/{wid}/agent/sessions/{sid}/cancel")
        assert r.status_code == 200
        complete = await events.complete("c1")
        assert complete == {
            "session_id": sid,
            "run_id": "c1",
            "message_id": complete["message_id"],
            "text": "one two three",
            "error": None,
            "cancelled": True,
        }
        assert events.errors() == []
        msgs = await server.messages(wid, sid)
        assistant = msgs[-1]
        assert assistant["parts"][0]["data"]["text"] == "one two three"
        assert assistant["parts"][-1]["data"] == {
            "reason": "canceled",
            "time": assistant["parts"][-1]["data"]["time"],
            "message": "User canceled request",
            "details": "",
        }
        run = await server.run(wid, "c1")
        assert run["status"] == "cancelled" and run["text"] == "one two three"
        assert model.streams_open == 0
        session = (await server.http.get(f"/v1/workspaces/{wid}/sessions/{sid}")).json()
        assert session["is_busy"] is False


async def test_cancel_before_the_run_starts_streaming(tmp_path: Path) -> None:
    gate = Gate()
    model = ScriptedModel([Step(text="never", gate_before=gate)])
    async with harness(tmp_path, model) as (server, wid, sid, events):
        await server.prompt(wid, sid, "go", run_id="c0")
        with trio.fail_after(5):
            await gate.reached.wait()
        await server.http.post(f"/v1/workspaces/{wid}/agent/sessions/{sid}/cancel")
        complete = await events.complete("c0")
        assert complete["cancelled"] is True and complete["text"] == ""
        msgs = await server.messages(wid, sid)
        assert [m["role"] for m in msgs] == ["user", "assistant"]
        assert msgs[-1]["parts"][-1]["data"]["reason"] == "canceled"


async def test_cancel_during_dispatch_over_websocket(tmp_path: Path) -> None:
    model = ScriptedModel()
    async with running_server(tmp_path, provider_factory=model) as server:
        ws = await server.open_workspace()
        session = await server.create_session(ws["id"])
        async with server.websocket(ws["id"]) as sock:
            await sock.recv()
            # Both commands go out back to back: the cancel arrives before the turn can run.
            await sock.conn.send_message(
                orjson.dumps(
                    {
                        "id": 1,
                        "method": "agent.prompt",
                        "params": {"session_id": session["id"], "prompt": "x", "run_id": "disp"},
                    }
                ).decode()
            )
            await sock.conn.send_message(
                orjson.dumps(
                    {"id": 2, "method": "agent.cancel", "params": {"session_id": session["id"]}}
                ).decode()
            )
            with trio.fail_after(10):
                complete, _ = await sock.run_complete("disp")
        assert complete["cancelled"] is True
        assert model.requests == []  # the model never saw it
        assert (await server.run(ws["id"], "disp"))["status"] == "cancelled"


async def test_idle_cancel_does_not_affect_the_next_prompt(tmp_path: Path) -> None:
    async with harness(tmp_path, ScriptedModel()) as (server, wid, sid, events):
        for _ in range(2):
            r = await server.http.post(f"/v1/workspaces/{wid}/agent/sessions/{sid}/cancel")
            assert r.status_code == 200
        await server.prompt(wid, sid, "after idle cancel", run_id="ok")
        complete = await events.complete("ok")
        assert complete["cancelled"] is False and complete["text"] == "after idle cancel"


async def test_queued_run_id_prompts_run_as_their_own_turns_in_order(tmp_path: Path) -> None:
    gate = Gate()
    model = ScriptedModel([Step(text="first reply", gate_mid=gate)])
    async with harness(tmp_path, model) as (server, wid, sid, events):
        assert (await server.prompt(wid, sid, "first", run_id="q1"))["status"] == "running"
        with trio.fail_after(5):
            await gate.reached.wait()
        assert (await server.prompt(wid, sid, "second", run_id="q2"))["status"] == "queued"
        assert (await server.prompt(wid, sid, "third", run_id="q3"))["status"] == "queued"
        base = f"/v1/workspaces/{wid}/agent/sessions/{sid}/prompts"
        assert (await server.http.get(f"{base}/queued")).json() == 2
        assert (await server.http.get(f"{base}/list")).json() == ["second", "third"]
        gate.release()
        await events.wait_for(lambda _: len(events.completes()) == 3)
        completes = events.completes()
        assert [c["run_id"] for c in completes] == ["q1", "q2", "q3"]
        assert [c["text"] for c in completes] == ["first reply", "second", "third"]
        assert len({c["message_id"] for c in completes}) == 3
        # Each queued prompt reached the model as its own turn.
        assert len(model.requests) == 3


async def test_prompt_without_run_id_is_folded_into_the_active_turn(tmp_path: Path) -> None:
    gate = Gate()
    model = ScriptedModel([Step(text="working on it", gate_mid=gate), Step(text="folded answer")])
    async with harness(tmp_path, model) as (server, wid, sid, events):
        await server.prompt(wid, sid, "main task", run_id="main")
        with trio.fail_after(5):
            await gate.reached.wait()
        folded = await server.prompt(wid, sid, "also this")
        assert folded["status"] == "queued" and folded["run_id"]
        gate.release()
        main = await events.complete("main")
        extra = await events.complete(folded["run_id"])
        assert extra["message_id"] == main["message_id"] and extra["text"] == main["text"]
        assert main["text"] == "folded answer"
        # The folded prompt is a user message inside the turn's next model request.
        second = model.requests[1]
        users = [
            "".join(p.text for p in m.parts if isinstance(p, TextPart))
            for m in second.messages
            if m.role is Role.USER
        ]
        assert users == ["main task", "also this"]
        assert len(model.requests) == 2
        assert (await server.run(wid, folded["run_id"]))["status"] == "completed"


async def test_cancel_and_clear_drop_queued_prompts_with_cancelled_terminals(
    tmp_path: Path,
) -> None:
    gate = Gate()
    model = ScriptedModel([Step(text="long", gate_mid=gate)])
    async with harness(tmp_path, model) as (server, wid, sid, events):
        await server.prompt(wid, sid, "first", run_id="a")
        with trio.fail_after(5):
            await gate.reached.wait()
        await server.prompt(wid, sid, "to clear", run_id="b")
        r = await server.http.post(f"/v1/workspaces/{wid}/agent/sessions/{sid}/prompts/clear")
        assert r.status_code == 200
        b = await events.complete("b")
        assert b["cancelled"] is True and b["error"] is None
        assert (
            await server.http.get(f"/v1/workspaces/{wid}/agent/sessions/{sid}/prompts/queued")
        ).json() == 0
        await server.prompt(wid, sid, "to cancel", run_id="c")
        await server.http.post(f"/v1/workspaces/{wid}/agent/sessions/{sid}/cancel")
        a = await events.complete("a")
        c = await events.complete("c")
        assert a["cancelled"] and c["cancelled"]
        # Prompts accepted after the cancel run normally.
        await server.prompt(wid, sid, "after cancel", run_id="d")
        d = await events.complete("d")
        assert d["cancelled"] is False and d["text"] == "after cancel"
        assert len(model.requests) == 2  # b and c never reached the model
        for run_id, status in [
            ("a", "cancelled"),
            ("b", "cancelled"),
            ("c", "cancelled"),
            ("d", "completed"),
        ]:
            assert (await server.run(wid, run_id))["status"] == status


async def test_prompt_to_closing_workspace_gets_409(tmp_path: Path) -> None:
    gate = Gate()
    model = ScriptedModel([Step(text="slow", gate_before=gate)])
    async with harness(tmp_path, model) as (server, wid, sid, events):
        await server.prompt(wid, sid, "x", run_id="z")
        with trio.fail_after(5):
            await gate.reached.wait()
        ws = server.backend.get(wid)
        ws.request_shutdown()
        with trio.fail_after(5):
            while not ws.closing:
                await trio.lowlevel.checkpoint()
        r = await server.http.post(
            f"/v1/workspaces/{wid}/agent", json={"session_id": sid, "prompt": "late"}
        )
        assert r.status_code in (404, 409)
        if r.status_code == 409:
            assert "closing" in r.json()["message"]
        complete = await events.complete("z")
        assert complete["cancelled"] is True


async def test_cancel_one_run_leaves_the_others(tmp_path: Path) -> None:
    gate = Gate()
    model = ScriptedModel([Step(text="first reply", gate_mid=gate)])
    async with harness(tmp_path, model) as (server, wid, sid, events):
        await server.prompt(wid, sid, "first", run_id="r1")
        with trio.fail_after(5):
            await gate.reached.wait()
        await server.prompt(wid, sid, "second", run_id="r2")
        await server.prompt(wid, sid, "third", run_id="r3")
        r = await server.http.post(f"/v1/workspaces/{wid}/runs/r2/cancel")
        assert r.status_code == 200 and r.json() == {"cancelled": True}
        assert (await events.complete("r2"))["cancelled"] is True
        r = await server.http.post(f"/v1/workspaces/{wid}/runs/r1/cancel")  # the running one
        assert r.json() == {"cancelled": True}
        r1 = await events.complete("r1")
        assert r1["cancelled"] is True and r1["text"] == "first"
        r3 = await events.complete("r3")  # the queue goes on
        assert r3["cancelled"] is False and r3["text"] == "third"
        r = await server.http.post(f"/v1/workspaces/{wid}/runs/r3/cancel")
        assert r.json() == {"cancelled": False}  # already finished: nothing to do
        r = await server.http.post(f"/v1/workspaces/{wid}/runs/nope/cancel")
        assert r.status_code == 404
        assert [c["run_id"] for c in events.completes()] == ["r2", "r1", "r3"]
