"""The agent loop against real providers: fake OpenAI-compatible and Anthropic servers on loopback,
driven through the real crush_trio server (streaming, tool loops, failures, titles)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio

from .fake_llm import FakeLLM, Fault, RecordedRequest, Reply, ToolCall
from .test_runs import Collector, harness


class Router:
    """Title requests get a fixed title; every other request takes the next scripted reply."""

    def __init__(self, *replies: Reply) -> None:
        self.replies = collections.deque(replies)
        self.title_requests = 0

    def __call__(self, request: RecordedRequest) -> Reply:
        body = request.body or {}
        text = orjson.dumps(body).decode()
        if "short title" in text:
            self.title_requests += 1
            return Reply(text="Fixing the parser")
        return self.replies.popleft() if self.replies else Reply(text="(no script)")


def _config(tmp_path: Path, url: str, api: str, **provider: Any) -> Path:
    kind = "anthropic" if api == "anthropic" else "openai-compat"
    config = {
        "providers": {
            "fake": {
                "type": kind,
                "base_url": url + "/v1",
                "api_key": "k",
                "models": [{"id": "m1"}],
                **provider,
            }
        },
        "models": {
            "large": {"provider": "fake", "model": "m1"},
            "small": {"provider": "fake", "model": "m1"},
        },
        "permissions": {"allowed_tools": ["view", "ls", "write"]},
    }
    path = tmp_path / "crush.json"
    path.write_bytes(orjson.dumps(config))
    return path


async def _with_fake(
    tmp_path: Path, router: Router, api: str, nursery: trio.Nursery, **provider: Any
) -> tuple[FakeLLM, Path]:
    fake = FakeLLM(default=router)
    url = await nursery.start(fake.serve)
    return fake, _config(tmp_path, url, api, **provider)


async def _server_with(tmp_path: Path, config: Path) -> Any:
    from .conftest import running_server

    return running_server(tmp_path, config_file=config)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_multi_step_tool_loop_streams_and_stores(tmp_path: Path, api: str) -> None:
    router = Router(
        Reply(
            text="Let me write it.",
            tool_calls=[ToolCall("write", '{"path": "hello.txt", "content": "hi"}', chunks=7)],
        ),
        Reply(tool_calls=[ToolCall("view", '{"path": "hello.txt"}', chunks=3)]),
        Reply(text="Done: the file says hi."),
    )
    async with trio.open_nursery() as nursery:
        fake, config = await _with_fake(tmp_path, router, api, nursery)
        async with await _server_with(tmp_path, config) as server:
            ws = await server.open_workspace()
            wid = ws["id"]
            session = await server.create_session(wid)
            async with server.websocket(wid) as sock:
                await server.prompt(wid, session["id"], "write hello.txt", run_id="loop")
                with trio.fail_after(20):
                    complete, frames = await sock.run_complete("loop")
            assert complete["text"] == "Done: the file says hi." and complete["error"] is None
            assert (Path(ws["path"]) / "hello.txt").read_text() == "hi"
            msgs = await server.messages(wid, session["id"])
            assert [m["role"] for m in msgs] == [
                "user",
                "assistant",
                "tool",
                "assistant",
                "tool",
                "assistant",
            ]
            view_result = msgs[4]["parts"][0]["data"]
            assert view_result["name"] == "view" and "hi" in view_result["content"]
            # The third request carried the whole history, tool results included.
            model_requests = [
                r for r in fake.requests if "short title" not in orjson.dumps(r.body).decode()
            ]
            assert len(model_requests) == 3
            sent = orjson.dumps(model_requests[2].body).decode()
            assert "hello.txt" in sent and "Let me write it." in sent
            # Titles come from the small model as background work.
            with trio.fail_after(10):
                while (
                    await server.http.get(f"/v1/workspaces/{wid}/sessions/{session['id']}")
                ).json()["title"] != "Fixing the parser":
                    await sock_wait(server, wid)
        nursery.cancel_scope.cancel()


async def sock_wait(server: Any, wid: str) -> None:
    """Wait for the next event of the workspace (bounded by the caller)."""
    async with server.websocket(wid, since=None) as sock:
        await sock.recv()  # hello
        await sock.recv()


async def test_500_exhausting_retries_ends_in_one_errored_run_complete(tmp_path: Path) -> None:
    router = Router(*[Reply(status=500, error="upstream down")] * 5)
    async with trio.open_nursery() as nursery:
        fake, config = await _with_fake(
            tmp_path,
            router,
            "openai",
            nursery,
            max_retries=2,
            retry_base_delay=0.01,
            retry_max_delay=0.02,
        )
        async with (
            await _server_with(tmp_path, config) as server,
            harness_from(server) as (wid, sid, events),
        ):
            await server.prompt(wid, sid, "hi", run_id="e500")
            complete = await events.complete("e500")
            assert "500" in complete["error"] or "upstream down" in complete["error"]
            retries = [
                f
                for f in events.frames
                if f["type"] == "agent_event" and f["payload"]["payload"]["type"] == "retry"
            ]
            assert len(retries) == 2
            await server.prompt(wid, sid, "again", run_id="after")
            await events.complete("after")
            assert len(events.completes("e500")) == 1
        nursery.cancel_scope.cancel()


async def test_401_fails_at_once_with_the_api_key_hint(tmp_path: Path) -> None:
    router = Router(Reply(status=401, error="bad key"))
    async with trio.open_nursery() as nursery:
        fake, config = await _with_fake(tmp_path, router, "openai", nursery)
        async with (
            await _server_with(tmp_path, config) as server,
            harness_from(server) as (wid, sid, events),
        ):
            await server.prompt(wid, sid, "hi", run_id="e401")
            complete = await events.complete("e401")
            assert "check the api_key for provider 'fake'" in complete["error"]
        nursery.cancel_scope.cancel()


async def test_cancel_mid_stream_closes_the_upstream_connection_and_keeps_the_title(
    tmp_path: Path,
) -> None:
    router = Router(Reply(text=" ".join(["tok"] * 400), token_delay=0.01))
    async with trio.open_nursery() as nursery:
        fake, config = await _with_fake(tmp_path, router, "openai", nursery)
        async with (
            await _server_with(tmp_path, config) as server,
            harness_from(server) as (wid, sid, events),
        ):
            await server.prompt(wid, sid, "stream a lot", run_id="cx")
            await events.wait_for(
                lambda fr: any(
                    f["type"] == "message" and "tok tok" in orjson.dumps(f).decode() for f in fr
                )
            )
            await server.http.post(f"/v1/workspaces/{wid}/agent/sessions/{sid}/cancel")
            complete = await events.complete("cx")
            assert complete["cancelled"] is True and complete["text"].startswith("tok")
            with trio.fail_after(10):
                await fake.wait_for_disconnects(1)
            with trio.fail_after(10):
                while (await server.http.get(f"/v1/workspaces/{wid}/sessions/{sid}")).json()[
                    "title"
                ] != "Fixing the parser":
                    await events.wait_for(lambda f, n=len(events.frames): len(f) > n)
        nursery.cancel_scope.cancel()


async def test_malformed_chunk_ends_the_run_with_a_clear_error(tmp_path: Path) -> None:
    router = Router(Reply(text="a b c d", fault=Fault.MALFORMED, fault_after=2))
    async with trio.open_nursery() as nursery:
        fake, config = await _with_fake(tmp_path, router, "openai", nursery)
        async with (
            await _server_with(tmp_path, config) as server,
            harness_from(server) as (wid, sid, events),
        ):
            await server.prompt(wid, sid, "hi", run_id="bad")
            complete = await events.complete("bad")
            assert "malformed" in complete["error"]
        nursery.cancel_scope.cancel()


def harness_from(server: Any) -> Any:
    """A workspace, a session and a collecting websocket on an already running server."""
    from contextlib import asynccontextmanager

    from trio_websocket import open_websocket_url

    @asynccontextmanager
    async def cm() -> Any:
        import uuid

        ws = await server.open_workspace()
        session = await server.create_session(ws["id"])
        collector = Collector()
        async with (
            open_websocket_url(server.ws_url(ws["id"], str(uuid.uuid4()))) as conn,
            trio.open_nursery() as n,
        ):
            n.start_soon(collector.pump, conn)
            await collector.wait_for(lambda f: bool(f))
            yield ws["id"], session["id"], collector
            n.cancel_scope.cancel()

    return cm()


_ = harness  # the scripted-model harness lives in test_runs
