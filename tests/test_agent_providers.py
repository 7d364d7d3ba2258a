"""The agent loop against real providers: fake OpenAI-compatible and Anthropic servers on loopback,
driven through the real crush_trio server (streaming, tool loops, failures, titles).

The server needs a real provider configuration, so it is started with the client's
``embedded`` rather than the plugin's ``crush_server`` (whose model is always scripted).
"""

from __future__ import annotations

import base64
import collections
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import pytest
import trio

from crush_trio.client import RunStatus, WorkspaceClient
from crush_trio.embedded import embedded
from crush_trio.wire import Attachment, Role, ToolResultPart

from .conftest import WAIT, completes_run, payloads, serve_options
from .fake_llm import FakeLLM, Fault, RecordedRequest, Reply, ToolCall

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


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


@asynccontextmanager
async def fake_provider_workspace(
    tmp_path: Path, router: Router, api: str, **provider: Any
) -> AsyncIterator[tuple[FakeLLM, WorkspaceClient]]:
    """A fake model server, a crush_trio server configured to use it, and a workspace of it."""
    fake = FakeLLM(default=router)
    project = tmp_path / "project"
    project.mkdir()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(fake.serve)
        options = serve_options(tmp_path, config_file=_config(tmp_path, url, api, **provider))
        async with embedded(options) as client, client.workspace(project) as ws:
            yield fake, ws
        nursery.cancel_scope.cancel()


def titled(session_id: str, title: str) -> Any:
    """A predicate: the session event that gives ``session_id`` its ``title``."""
    return lambda e: e.type == "session" and e.payload.id == session_id and e.payload.title == title


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
    async with (
        fake_provider_workspace(tmp_path, router, api) as (fake, ws),
        ws.subscribe(timeout=WAIT) as feed,
    ):
        sid = (await ws.create_session()).id
        run = await ws.run(sid, "write hello.txt", timeout=20)
        assert run.text == "Done: the file says hi."
        assert run.error is None
        assert (Path(ws.path) / "hello.txt").read_text() == "hi"
        msgs = await ws.messages(sid)
        assert [m.role for m in msgs] == [
            Role.USER,
            Role.ASSISTANT,
            Role.TOOL,
            Role.ASSISTANT,
            Role.TOOL,
            Role.ASSISTANT,
        ]
        view_result = msgs[4].parts[0]
        assert isinstance(view_result, ToolResultPart)
        assert view_result.name == "view"
        assert "hi" in view_result.content
        # The third request carried the whole history, tool results included.
        model_requests = [
            r for r in fake.requests if "short title" not in orjson.dumps(r.body).decode()
        ]
        assert len(model_requests) == 3
        sent = orjson.dumps(model_requests[2].body).decode()
        assert "hello.txt" in sent
        assert "Let me write it." in sent
        # Titles come from the small model as background work, announced as a session update.
        await feed.until(titled(sid, "Fixing the parser"), WAIT)
        assert (await ws.session(sid)).title == "Fixing the parser"


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_an_attached_image_reaches_the_model_in_its_api_shape(
    tmp_path: Path, api: str
) -> None:
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n pixels").decode()
    router = Router(Reply(text="a picture"), Reply(text="still a picture"))
    async with fake_provider_workspace(tmp_path, router, api) as (fake, ws):
        sid = (await ws.create_session()).id
        attached = Attachment(file_name="shot.png", mime_type="image/png", content=png)
        handle = await ws.prompt(sid, "what is this?", attachments=[attached])
        run = await handle.result(20)
        assert run.text == "a picture"
        # A later prompt of the session sends the image again, with its history.
        await ws.run(sid, "and now?", timeout=20)
    model_requests = [
        r for r in fake.requests if "short title" not in orjson.dumps(r.body).decode()
    ]
    assert len(model_requests) == 2
    for request in model_requests:
        first = request.body["messages"][1 if api == "openai" else 0]
        if api == "openai":
            assert first == {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                ],
            }
        else:
            # The prompt cache marker sits on the last block of the last two turns only.
            image = {"type": "image", "source": {"type": "base64", "media_type": "image/png"}}
            image["source"]["data"] = png
            if request is model_requests[0]:
                image["cache_control"] = {"type": "ephemeral"}
            assert first == {
                "role": "user",
                "content": [{"type": "text", "text": "what is this?"}, image],
            }


async def test_500_exhausting_retries_ends_in_one_errored_run_complete(tmp_path: Path) -> None:
    router = Router(*[Reply(status=500, error="upstream down")] * 5)
    async with (
        fake_provider_workspace(
            tmp_path, router, "openai", max_retries=2, retry_base_delay=0.01, retry_max_delay=0.02
        ) as (fake, ws),
        ws.subscribe(timeout=WAIT) as feed,
    ):
        sid = (await ws.create_session()).id
        failed = await ws.run(sid, "hi", timeout=WAIT, check=False)
        assert failed.status is RunStatus.FAILED
        assert failed.error is not None
        assert "500" in failed.error or "upstream down" in failed.error
        seen = await feed.collect_until(completes_run(failed.run_id), WAIT)
        retries = [e for e in payloads(seen, "agent_event") if e.type == "retry"]
        assert len(retries) == 2
        after = await ws.run(sid, "again", timeout=WAIT, check=False)
        seen += await feed.collect_until(completes_run(after.run_id), WAIT)
        assert [c.run_id for c in payloads(seen, "run_complete")].count(failed.run_id) == 1


async def test_401_fails_at_once_with_the_api_key_hint(tmp_path: Path) -> None:
    router = Router(Reply(status=401, error="bad key"))
    async with fake_provider_workspace(tmp_path, router, "openai") as (fake, ws):
        sid = (await ws.create_session()).id
        run = await ws.run(sid, "hi", timeout=WAIT, check=False)
        assert run.status is RunStatus.FAILED
        assert run.error is not None
        assert "check the api_key for provider 'fake'" in run.error


async def test_cancel_mid_stream_closes_the_upstream_connection_and_keeps_the_title(
    tmp_path: Path,
) -> None:
    router = Router(Reply(text=" ".join(["tok"] * 400), token_delay=0.01))
    async with (
        fake_provider_workspace(tmp_path, router, "openai") as (fake, ws),
        ws.subscribe(timeout=WAIT) as feed,
    ):
        sid = (await ws.create_session()).id
        handle = await ws.prompt(sid, "stream a lot", run_id="cx")
        async for event in handle.events(WAIT):
            # A message snapshot, or the message a message_delta leads to.
            if event.message is not None and "tok tok" in event.message.text():
                break
        else:
            raise AssertionError("run cx ended before it streamed")
        await ws.cancel(sid)
        run = await handle.result(WAIT)
        assert run.status is RunStatus.CANCELLED
        assert run.text.startswith("tok")
        with trio.fail_after(WAIT):
            await fake.wait_for_disconnects(1)
        await feed.until(titled(sid, "Fixing the parser"), WAIT)
        assert (await ws.session(sid)).title == "Fixing the parser"


class StepsBeforeRequest(trio.abc.Instrument):
    """Counts the steps the task ``name`` takes while ``fake`` has had ``seen`` requests."""

    def __init__(self, name: str, fake: FakeLLM, seen: int) -> None:
        self.name = name
        self.fake = fake
        self.seen = seen
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name == self.name and self.fake.request_count == self.seen:
            self.steps += 1


async def test_a_turn_sends_its_model_request_in_the_first_step_of_its_task(
    tmp_path: Path,
) -> None:
    """A turn's start (its history, its messages, its system prompt, the request's write) has
    no schedule point, so the prompts of a burst reach the model in the order they were
    accepted, none waiting for a round of every other task first."""
    async with fake_provider_workspace(tmp_path, Router(), "openai") as (fake, ws):
        warm = (await ws.create_session("warm")).id  # titled: no title request
        await ws.run(warm, "warm up", timeout=WAIT)  # context files read, connection pooled
        sid = (await ws.create_session("measured")).id
        seen = fake.request_count
        steps = StepsBeforeRequest(f"session-{sid}", fake, seen)
        trio.lowlevel.add_instrument(steps)
        try:
            run = await ws.run(sid, "hello", timeout=WAIT)
        finally:
            trio.lowlevel.remove_instrument(steps)
        assert run.text == "(no script)"
        assert fake.request_count == seen + 1
        assert fake.connections == 1  # the warm-up's connection, kept alive
        assert steps.steps == 1


async def test_malformed_chunk_ends_the_run_with_a_clear_error(tmp_path: Path) -> None:
    router = Router(Reply(text="a b c d", fault=Fault.MALFORMED, fault_after=2))
    async with fake_provider_workspace(tmp_path, router, "openai") as (fake, ws):
        sid = (await ws.create_session()).id
        run = await ws.run(sid, "hi", timeout=WAIT, check=False)
        assert run.status is RunStatus.FAILED
        assert run.error is not None
        assert "malformed" in run.error


# ---------------------------------------------------------------------------------------------
# Prompt caching, cached-token usage and reasoning options

EPHEMERAL = {"type": "ephemeral"}
#: Dollars per million tokens: uncached input, output, cache writes, cache reads.
PRICED = {
    "id": "m1",
    "cost_per_1m_in": 3.0,
    "cost_per_1m_out": 15.0,
    "cost_per_1m_in_cached": 3.75,
    "cost_per_1m_out_cached": 0.3,
}


def agent_requests(fake: FakeLLM) -> list[RecordedRequest]:
    return [r for r in fake.requests if "short title" not in orjson.dumps(r.body).decode()]


def cache_marks(body: dict[str, Any]) -> list[tuple[int, int]]:
    """(turn, block) of every message block that carries cache_control."""
    return [
        (i, j)
        for i, turn in enumerate(body["messages"])
        for j, block in enumerate(turn["content"])
        if "cache_control" in block
    ]


async def test_anthropic_requests_cache_the_prompt_and_cached_tokens_are_counted(
    tmp_path: Path,
) -> None:
    router = Router(
        Reply(text="I will look.", tool_calls=[ToolCall("ls", "{}")], usage=(100, 10)),
        Reply(text="first done", usage=(40, 5), cache=(1000, 500)),
        Reply(text="second done", usage=(20, 4), cache=(1500, 100)),
    )
    with trio.fail_after(WAIT * 3):
        async with fake_provider_workspace(tmp_path, router, "anthropic", models=[PRICED]) as (
            fake,
            ws,
        ):
            sid = (await ws.create_session()).id
            await ws.run(sid, "list the files", timeout=20)
            await ws.run(sid, "thanks", timeout=20)
            session = await ws.session(sid)
    first, after_tool, second = agent_requests(fake)
    for request in (first, after_tool, second):
        [system] = request.body["system"]
        assert system["cache_control"] == EPHEMERAL
        assert system["text"].startswith("You are a coding agent")
        assert "thinking" not in request.body  # no thinking_budget configured
    # The last block of each of the last two turns: the tool call and its result, then the
    # previous answer and the new prompt.
    assert cache_marks(first.body) == [(0, 0)]
    assert [t["role"] for t in after_tool.body["messages"]] == ["user", "assistant", "user"]
    assert cache_marks(after_tool.body) == [(1, 1), (2, 0)]
    assert after_tool.body["messages"][1]["content"][1]["type"] == "tool_use"
    assert cache_marks(second.body) == [(3, 0), (4, 0)]
    # The session's context is the last step's input, cached tokens included.
    assert session.prompt_tokens == 20 + 1500 + 100
    assert session.completion_tokens == 4
    # Uncached input at cost_per_1m_in, writes at cost_per_1m_in_cached, reads at
    # cost_per_1m_out_cached, output at cost_per_1m_out.
    steps = [
        100 * 3.0 + 10 * 15.0,
        40 * 3.0 + 500 * 3.75 + 1000 * 0.3 + 5 * 15.0,
        20 * 3.0 + 100 * 3.75 + 1500 * 0.3 + 4 * 15.0,
    ]
    assert session.cost == pytest.approx(sum(steps) / 1_000_000)


async def test_openai_cached_tokens_are_priced_as_cache_reads(tmp_path: Path) -> None:
    router = Router(Reply(text="ok", usage=(1200, 10), cache=(1000, 0)))
    with trio.fail_after(WAIT * 2):
        async with fake_provider_workspace(tmp_path, router, "openai", models=[PRICED]) as (
            fake,
            ws,
        ):
            sid = (await ws.create_session()).id
            await ws.run(sid, "hi", timeout=20)
            session = await ws.session(sid)
    assert session.prompt_tokens == 1200
    assert session.cost == pytest.approx((200 * 3.0 + 1000 * 0.3 + 10 * 15.0) / 1_000_000)
    [request] = agent_requests(fake)
    assert "reasoning_effort" not in request.body


@pytest.mark.parametrize("api", ["openai", "anthropic"])
async def test_reasoning_options_are_sent_only_when_the_model_asks_for_them(
    tmp_path: Path, api: str
) -> None:
    entry = {"id": "m1", "reasoning_effort": "high", "thinking_budget": 2048}
    router = Router(Reply(reasoning=["hmm"], signature="sig", text="thought"))
    with trio.fail_after(WAIT * 2):
        async with fake_provider_workspace(
            tmp_path, router, api, models=[entry, {"id": "plain"}]
        ) as (fake, ws):
            sid = (await ws.create_session()).id
            await ws.run(sid, "think", timeout=20)
            plain = (await ws.create_session()).id
            await (await ws.prompt(plain, "quick", model="fake/plain")).result(20)
    configured, unconfigured = agent_requests(fake)
    assert unconfigured.body["model"] == "plain"
    assert "reasoning_effort" not in unconfigured.body
    assert "thinking" not in unconfigured.body
    if api == "openai":
        assert configured.body["reasoning_effort"] == "high"
        assert "thinking" not in configured.body
    else:
        assert configured.body["thinking"] == {"type": "enabled", "budget_tokens": 2048}
        assert configured.body["max_tokens"] > 2048
        assert "reasoning_effort" not in configured.body
