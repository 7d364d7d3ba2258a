"""Model providers against real HTTP fake servers (tests/fake_llm.py).

Rules for these tests:

* Every fake server runs in the test's nursery on 127.0.0.1:0 and is stopped by cancelling it.
* Every wait is bounded by ``trio.fail_after`` on Trio's clock.
* Tests that move time use ``autojump_clock``. The clock jumps whenever all tasks are blocked,
  also while a loopback byte is in flight, so these tests only use timeouts that are meant to
  fire (or that are far beyond the jumps the test expects) and the fake server answers in-process
  without sleeping.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import itertools
import random
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, cast

import httpx
import hypothesis
import hypothesis.strategies as st
import pytest
import trio

from crush_trio.errors import ConfigError, ProviderError
from crush_trio.providers import (
    AnthropicProvider,
    EchoProvider,
    OpenAIProvider,
    Provider,
    Settings,
    make_provider,
)
from crush_trio.providers.anthropic import MessagesStreamParser
from crush_trio.providers.base import (
    Finished,
    ModelInfo,
    ModelRequest,
    ReasoningDelta,
    ReasoningDone,
    Retrying,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStart,
    ToolSpec,
    Usage,
)
from crush_trio.providers.http import SSEDecoder, SSEEvent, backoff_delay, parse_retry_after
from crush_trio.providers.openai import ChatStreamParser
from crush_trio.wire import (
    BinaryPart,
    FinishPart,
    FinishReason,
    Message,
    Part,
    ReasoningPart,
    Role,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)
from tests.fake_llm import FakeLLM, Fault, Reply, ToolCall, parse_stamps, strip_stamps

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, AsyncIterator

    from trio.testing import MockClock

#: Cap on every wait in a test (Trio seconds; with autojump_clock, virtual seconds).
TEST_TIMEOUT = 10
#: Cap for tests whose virtual clock runs through several retry sleeps or a long timeout.
LONG_TEST_TIMEOUT = 1000

MODEL = ModelInfo(id="test-model", name="Test Model", default_max_tokens=512)
TOOLS = [
    ToolSpec(
        name="view",
        description="Read a file",
        parameters={"type": "object", "properties": {"path": {"type": "string"}}},
    )
]


def message(role: Role, *parts: Part) -> Message:
    return Message(id=f"m-{role.value}", session_id="s1", role=role, parts=list(parts))


def user(text: str) -> Message:
    return message(Role.USER, TextPart(text))


def request(*messages: Message, system: str = "You are terse.", **kw: Any) -> ModelRequest:
    return ModelRequest(model=MODEL, system=system, messages=list(messages), **kw)


def open_stream(
    provider: Provider, req: ModelRequest
) -> contextlib.aclosing[AsyncGenerator[StreamEvent, None]]:
    """The stream as the agent loop uses it: an async generator under ``aclosing``."""
    return contextlib.aclosing(cast("AsyncGenerator[StreamEvent, None]", provider.stream(req)))


async def collect(provider: Provider, req: ModelRequest) -> list[StreamEvent]:
    async with open_stream(provider, req) as events:
        return [event async for event in events]


async def collect_until_error(
    provider: Provider, req: ModelRequest
) -> tuple[list[StreamEvent], ProviderError]:
    seen: list[StreamEvent] = []
    # Draining the stream is one step; it needs the loop.
    with pytest.raises(ProviderError) as info:  # noqa: PT012
        async with open_stream(provider, req) as events:
            async for event in events:
                seen.append(event)
    return seen, info.value


def text_of(events: list[StreamEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def fix_jitter(provider: Provider, value: float) -> Provider:
    """Make the provider's retry jitter deterministic: ``rand()`` always returns ``value``."""
    cast("Any", provider)._http.rand = lambda: value
    return provider


@contextlib.asynccontextmanager
async def serving(
    fake: FakeLLM, provider_type: str = "openai-compat", *, jitter: float = 1.0, **settings: Any
) -> AsyncIterator[Provider]:
    """Run ``fake`` in a nursery and yield a provider pointed at it; the retry jitter is fixed
    at ``jitter`` (1.0: the full exponential delay, the exact ``Retry-After`` plus 20%)."""
    async with trio.open_nursery() as nursery:
        url = await nursery.start(fake.serve)
        cfg = Settings(
            type=provider_type,
            base_url=url + "/v1",
            api_key="sk-test",
            extra_headers={"x-team": "blue"},
            **settings,
        )
        provider = fix_jitter(make_provider("local", cfg), jitter)
        try:
            yield provider
        finally:
            await provider.aclose()
            nursery.cancel_scope.cancel()


both_apis = pytest.mark.parametrize("provider_type", ["openai-compat", "anthropic"])


# ---------------------------------------------------------------------------------------------
# echo


async def test_echo_streams_last_user_message_exactly() -> None:
    text = "  Hello,\tworld \n\n  of  words  "
    provider = EchoProvider()
    history = [user("first prompt"), message(Role.ASSISTANT, TextPart("ok")), user(text)]
    with trio.fail_after(TEST_TIMEOUT):
        events = await collect(provider, request(*history, system="be brief"))
    deltas = [e.text for e in events if isinstance(e, TextDelta)]
    assert "".join(deltas) == text
    assert deltas == ["  Hello,\t", "world \n\n  ", "of  ", "words  "]
    assert events[-2:] == [
        Usage(prompt_tokens=2 + 2 + 1 + 4, completion_tokens=4),
        Finished(FinishReason.END_TURN),
    ]
    assert not any(isinstance(e, (ToolCallStart, ToolCallDone)) for e in events)


async def test_echo_without_user_message_finishes_empty() -> None:
    with trio.fail_after(TEST_TIMEOUT):
        events = await collect(EchoProvider(), request())
    assert events == [Usage(prompt_tokens=3, completion_tokens=0), Finished(FinishReason.END_TURN)]


async def test_echo_delay_between_words_uses_trio_clock(autojump_clock: MockClock) -> None:
    provider = make_provider("slow", Settings(type="echo", delay_ms=250))
    assert isinstance(provider, EchoProvider)
    times: list[float] = []
    start = trio.current_time()
    with trio.fail_after(TEST_TIMEOUT):
        async with open_stream(provider, request(user("a b c d"))) as events:
            async for event in events:
                if isinstance(event, TextDelta):
                    times.append(trio.current_time() - start)
    assert times == pytest.approx([0.0, 0.25, 0.5, 0.75])


# ---------------------------------------------------------------------------------------------
# SSE decoding and retry arithmetic (no I/O)

SSE_BODY = (
    b": comment\r\n"
    b'event: first\r\ndata: {"a": 1}\r\n\r\n'
    b"data: line one\ndata: line two\n\n"
    b"data:no-space\rid: 7\rretry: 10\r\r"
    b"data: caf\xc3\xa9\n\n"
    b"event: last\ndata: [DONE]"
)
SSE_EVENTS = [
    SSEEvent("first", '{"a": 1}'),
    SSEEvent("message", "line one\nline two"),
    SSEEvent("message", "no-space"),
    SSEEvent("message", "café"),
    SSEEvent("last", "[DONE]"),
]


@hypothesis.given(cuts=st.lists(st.integers(min_value=0, max_value=len(SSE_BODY)), max_size=12))
def test_sse_decoder_gives_the_same_events_for_any_chunking(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(SSE_BODY)]
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    for lo, hi in itertools.pairwise(bounds):
        events += decoder.feed(SSE_BODY[lo:hi])
    events += decoder.close()
    assert events == SSE_EVENTS


def test_sse_decoder_bounds_a_line_without_end() -> None:
    decoder = SSEDecoder(limit=100)
    with pytest.raises(ValueError, match="longer than 100 bytes"):
        decoder.feed(b"data: " + b"x" * 200)


def test_backoff_is_exponential_capped_and_honours_retry_after() -> None:
    cfg = Settings(retry_base_delay=1.0, retry_max_delay=5.0)
    top, bottom = (lambda: 1.0), (lambda: 0.0)
    assert [backoff_delay(cfg, n, None, top) for n in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert [backoff_delay(cfg, n, None, bottom) for n in range(5)] == [0.5, 1.0, 2.0, 2.5, 2.5]
    assert backoff_delay(cfg, 0, 3.5, bottom) == 3.5
    assert backoff_delay(cfg, 0, 2.0, top) == pytest.approx(2.4)
    assert backoff_delay(cfg, 0, 120.0, top) == 5.0
    assert parse_retry_after(httpx.Headers({"Retry-After": "7"})) == 7.0
    assert parse_retry_after(httpx.Headers({"retry-after-ms": "1500"})) == 1.5
    assert (
        parse_retry_after(httpx.Headers({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})) is None
    )


def test_retry_jitter_spreads_clients_that_failed_together() -> None:
    """Clients that hit a 429 at the same moment wait different times (seeded, so repeatable)."""
    cfg = Settings(retry_base_delay=1.0, retry_max_delay=30.0)
    rng = random.Random(18)
    backoffs = [backoff_delay(cfg, 2, None, rng.random) for _ in range(50)]
    assert all(2.0 <= d <= 4.0 for d in backoffs)
    assert len({round(d, 6) for d in backoffs}) == 50
    told = [backoff_delay(cfg, 0, 7.0, rng.random) for _ in range(50)]
    assert all(7.0 <= d <= 7.0 * 1.2 for d in told)
    assert max(told) - min(told) > 0.7
    # The default source is random, not a constant.
    fresh = make_provider("local", Settings(base_url="http://127.0.0.1:9/v1"))
    assert cast("Any", fresh)._http.rand is random.random


# ---------------------------------------------------------------------------------------------
# Streaming against the fake servers


async def test_openai_streams_text_and_usage_and_sends_the_documented_request() -> None:
    fake = FakeLLM([Reply(text="Hello there, world", usage=(42, 3))])
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake) as provider:
            events = await collect(provider, request(user("hi"), tools=TOOLS))
    assert [e for e in events if isinstance(e, TextDelta)] == [
        TextDelta("Hello "),
        TextDelta("there, "),
        TextDelta("world"),
    ]
    assert events[-2:] == [Usage(42, 3), Finished(FinishReason.END_TURN)]
    [sent] = fake.requests
    assert sent.path == "/v1/chat/completions"
    assert sent.headers["authorization"] == "Bearer sk-test"
    assert sent.headers["x-team"] == "blue"
    assert sent.body == {
        "model": "test-model",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "hi"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 512,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "view",
                    "description": "Read a file",
                    "parameters": TOOLS[0].parameters,
                },
            }
        ],
    }


async def test_anthropic_streams_text_and_usage_and_sends_the_documented_request() -> None:
    fake = FakeLLM([Reply(text="Hello there", usage=(30, 2))])
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake, "anthropic") as provider:
            events = await collect(provider, request(user("hi"), tools=TOOLS, max_tokens=99))
    assert text_of(events) == "Hello there"
    assert events[-2:] == [Usage(30, 2), Finished(FinishReason.END_TURN)]
    [sent] = fake.requests
    assert sent.path == "/v1/messages"
    assert sent.headers["x-api-key"] == "sk-test"
    assert sent.headers["anthropic-version"] == "2023-06-01"
    assert sent.headers["x-team"] == "blue"
    assert sent.body == {
        "model": "test-model",
        "max_tokens": 99,
        "system": [
            {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}
        ],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            }
        ],
        "stream": True,
        "tools": [
            {"name": "view", "description": "Read a file", "input_schema": TOOLS[0].parameters}
        ],
    }


@both_apis
async def test_tool_calls_split_over_many_chunks_are_reassembled(provider_type: str) -> None:
    args_a = '{"path": "src/main.py", "lines": [1, 2, 3], "note": "caf\\u00e9 \\"q\\""}'
    args_b = '{"path": "README.md"}'
    fake = FakeLLM(
        [
            Reply(
                text="Let me look.",
                tool_calls=[
                    ToolCall("view", args_a, id="call_a", chunks=17),
                    ToolCall("view", args_b, id="call_b", chunks=5),
                ],
            )
        ]
    )
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake, provider_type) as provider:
            events = await collect(provider, request(user("read both"), tools=TOOLS))
    calls = [e for e in events if isinstance(e, (ToolCallStart, ToolCallDelta, ToolCallDone))]
    starts = [e for e in calls if isinstance(e, ToolCallStart)]
    assert starts == [ToolCallStart("call_a", "view"), ToolCallStart("call_b", "view")]
    for call_id, args in (("call_a", args_a), ("call_b", args_b)):
        deltas = [e for e in calls if isinstance(e, ToolCallDelta) and e.id == call_id]
        assert len(deltas) > 1
        assert "".join(d.arguments for d in deltas) == args
        assert ToolCallDone(call_id, "view", args) in calls
        # Start comes before the deltas, which come before Done.
        order = [i for i, e in enumerate(calls) if getattr(e, "id", None) == call_id]
        assert isinstance(calls[order[0]], ToolCallStart)
        assert isinstance(calls[order[-1]], ToolCallDone)
    assert text_of(events) == "Let me look."
    assert events[-1] == Finished(FinishReason.TOOL_USE)


@both_apis
async def test_reasoning_deltas_come_before_text_and_are_closed(provider_type: str) -> None:
    fake = FakeLLM([Reply(reasoning=["Think", "ing..."], signature="sig-123", text="Answer")])
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake, provider_type) as provider:
            events = await collect(provider, request(user("why?")))
    kinds = [e for e in events if isinstance(e, (ReasoningDelta, ReasoningDone, TextDelta))]
    signature = "sig-123" if provider_type == "anthropic" else ""
    assert kinds == [
        ReasoningDelta("Think"),
        ReasoningDelta("ing..."),
        ReasoningDone(signature=signature),
        TextDelta("Answer"),
    ]


@both_apis
async def test_max_tokens_finish_is_reported(provider_type: str) -> None:
    fake = FakeLLM([Reply(text="cut short", finish="max_tokens")])
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake, provider_type) as provider:
            events = await collect(provider, request(user("go on")))
    assert events[-1] == Finished(FinishReason.MAX_TOKENS)


async def test_stamped_tokens_carry_send_times() -> None:
    fake = FakeLLM([Reply(text="a b c", stamp=True)])
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake) as provider:
            events = await collect(provider, request(user("x")))
    assert strip_stamps(text_of(events)) == "a b c"
    stamps = parse_stamps(text_of(events))
    assert len(stamps) == 3
    assert stamps == sorted(stamps)


async def test_a_stamp_is_the_time_its_token_was_sent_after_the_pause() -> None:
    """A paced token's stamp is taken when it is written, not a token delay before: the token
    latencies the benchmarks derive from stamps would otherwise include the pause."""
    delay = 0.2
    fake = FakeLLM([Reply(text="a b c", stamp=True, token_delay=delay)])
    lags: list[float] = []
    with trio.fail_after(LONG_TEST_TIMEOUT):
        async with serving(fake) as provider, open_stream(provider, request(user("x"))) as events:
            async for event in events:
                if isinstance(event, TextDelta) and (stamps := parse_stamps(event.text)):
                    lags.append(time.time() - stamps[-1])
    assert len(lags) == 3
    assert all(lag < delay for lag in lags), lags


@both_apis
async def test_token_delay_paces_the_stream(provider_type: str, autojump_clock: MockClock) -> None:
    fake = FakeLLM([Reply(text="a b c", token_delay=0.5)])
    arrivals: list[float] = []
    with trio.fail_after(LONG_TEST_TIMEOUT):
        async with serving(fake, provider_type) as provider:
            start = trio.current_time()
            async with open_stream(provider, request(user("x"))) as events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        arrivals.append(trio.current_time() - start)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert gaps == pytest.approx([0.5, 0.5])


@both_apis
async def test_batched_frames_stream_the_same_reply(provider_type: str) -> None:
    tokens = [f"w{i} " for i in range(50)]
    fake = FakeLLM(
        [Reply(text=tokens, batch=8, tool_calls=[ToolCall("view", '{"a": 1}', chunks=3)])]
    )
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake, provider_type) as provider:
            events = await collect(provider, request(user("x")))
    assert text_of(events) == "".join(tokens)
    assert [e.input for e in events if isinstance(e, ToolCallDone)] == ['{"a": 1}']
    assert events[-1] == Finished(FinishReason.TOOL_USE)


@both_apis
async def test_compressed_stream_is_decoded_although_identity_was_asked(
    provider_type: str,
) -> None:
    """The body is read raw only when it is not encoded; a proxy that gzips it still works."""
    tokens = [f"w{i} " for i in range(30)]
    fake = FakeLLM([Reply(text=tokens, gzip=True), Reply(text=tokens)])
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake, provider_type) as provider:
            compressed = await collect(provider, request(user("x")))
            plain = await collect(provider, request(user("x")))
    assert text_of(compressed) == text_of(plain) == "".join(tokens)
    assert compressed[-1] == plain[-1] == Finished(FinishReason.END_TURN)
    assert [r.headers.get("accept-encoding") for r in fake.requests] == ["identity"] * 2


@both_apis
async def test_sequential_requests_reuse_one_connection(provider_type: str) -> None:
    fake = FakeLLM(default=Reply(text="again"))
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake, provider_type) as provider:
            for _ in range(3):
                assert text_of(await collect(provider, request(user("x")))) == "again"
    assert fake.connections == 1


async def test_a_burst_of_streams_keeps_its_connections_for_the_next_burst() -> None:
    """Every connection of a burst stays alive (httpx keeps only 20 by default)."""
    streams = 30
    # Two tokens 50 ms apart, so that the streams of a burst overlap.
    fake = FakeLLM(default=Reply(text="burst now", token_delay=0.05))
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake) as provider:

            async def one(texts: list[str]) -> None:
                texts.append(text_of(await collect(provider, request(user("x")))))

            for _ in range(2):
                texts: list[str] = []
                async with trio.open_nursery() as nursery:
                    for _ in range(streams):
                        nursery.start_soon(one, texts)
                assert texts == ["burst now"] * streams
    assert fake.connections == streams


# ---------------------------------------------------------------------------------------------
# History conversion

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n fake image").decode()
ATTACHED = message(
    Role.USER,
    TextPart("What is in these?"),
    BinaryPart(path="shot.png", mime_type="image/png", data=PNG),
    BinaryPart(path="notes.txt", mime_type="text/plain", data=base64.b64encode(b"hello").decode()),
)


async def test_openai_sends_an_image_as_an_image_url_part_and_a_text_file_as_text() -> None:
    fake = FakeLLM([Reply(text="a cat")])
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake) as provider:
            await collect(provider, request(ATTACHED))
    assert fake.requests[0].body["messages"][1] == {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in these?"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
            {"type": "text", "text": '<file path="notes.txt">\nhello\n</file>'},
        ],
    }


async def test_anthropic_sends_an_image_as_an_image_block_and_a_text_file_as_text() -> None:
    fake = FakeLLM([Reply(text="a cat")])
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake, "anthropic") as provider:
            await collect(provider, request(ATTACHED))
    assert fake.requests[0].body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in these?"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": PNG},
                },
                {
                    "type": "text",
                    "text": '<file path="notes.txt">\nhello\n</file>',
                    "cache_control": {"type": "ephemeral"},
                },
            ],
        }
    ]


HISTORY = [
    user("Read a.txt and b.txt"),
    message(
        Role.ASSISTANT,
        ReasoningPart(thinking="I should read both.", signature="sig-1"),
        TextPart("Reading."),
        ToolCallPart(id="call_1", name="view", input='{"path": "a.txt"}', finished=True),
        ToolCallPart(id="call_2", name="view", input="", finished=True),
        FinishPart(reason=FinishReason.TOOL_USE),
    ),
    message(
        Role.TOOL,
        ToolResultPart(tool_call_id="call_1", name="view", content="alpha"),
        ToolResultPart(tool_call_id="call_2", name="view", content="no such file", is_error=True),
    ),
    user("And now?"),
    message(Role.ASSISTANT, FinishPart(reason=FinishReason.CANCELED)),
    user("Go on"),
]


async def test_openai_history_with_tool_calls_and_results() -> None:
    fake = FakeLLM([Reply(text="done")])
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake) as provider:
            await collect(provider, request(*HISTORY, tools=TOOLS))
    assert fake.requests[0].body["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Read a.txt and b.txt"},
        {
            "role": "assistant",
            "content": "Reading.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "view", "arguments": '{"path": "a.txt"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "view", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "alpha"},
        {"role": "tool", "tool_call_id": "call_2", "content": "no such file"},
        {"role": "user", "content": "And now?"},
        {"role": "user", "content": "Go on"},
    ]


async def test_anthropic_history_merges_turns_and_keeps_signed_thinking() -> None:
    """Also: only the last block of each of the last two turns carries the cache marker (the
    first turn's does not)."""
    fake = FakeLLM([Reply(text="done")])
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake, "anthropic") as provider:
            await collect(provider, request(*HISTORY, tools=TOOLS))
    assert fake.requests[0].body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Read a.txt and b.txt"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "I should read both.", "signature": "sig-1"},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "call_1", "name": "view", "input": {"path": "a.txt"}},
                {
                    "type": "tool_use",
                    "id": "call_2",
                    "name": "view",
                    "input": {},
                    "cache_control": {"type": "ephemeral"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "alpha"},
                {
                    "type": "tool_result",
                    "tool_use_id": "call_2",
                    "content": "no such file",
                    "is_error": True,
                },
                {"type": "text", "text": "And now?"},
                {"type": "text", "text": "Go on", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]


# ---------------------------------------------------------------------------------------------
# Retries and errors


@both_apis
async def test_rate_limit_is_retried_after_retry_after(
    provider_type: str, autojump_clock: MockClock
) -> None:
    fake = FakeLLM(
        [Reply(status=429, retry_after=7, error="slow down"), Reply(text="finally")],
    )
    with trio.fail_after(LONG_TEST_TIMEOUT):
        async with serving(fake, provider_type, jitter=0.0) as provider:
            start = trio.current_time()
            events = await collect(provider, request(user("hi")))
            elapsed = trio.current_time() - start
    retrying = [e for e in events if isinstance(e, Retrying)]
    assert retrying == [Retrying(attempt=1, delay=7.0, reason="HTTP 429: slow down")]
    assert events[0] == retrying[0]
    assert text_of(events) == "finally"
    assert 7.0 <= elapsed < 8.0
    assert len(fake.requests) == 2


async def test_server_errors_exhaust_retries_with_capped_backoff(
    autojump_clock: MockClock,
) -> None:
    fake = FakeLLM([Reply(status=500, error="boom")] * 5)
    with trio.fail_after(LONG_TEST_TIMEOUT):
        async with serving(fake, retry_base_delay=2.0, retry_max_delay=5.0) as provider:
            seen, error = await collect_until_error(provider, request(user("hi")))
    assert [e.delay for e in seen if isinstance(e, Retrying)] == [2.0, 4.0, 5.0]
    assert [e.attempt for e in seen if isinstance(e, Retrying)] == [1, 2, 3]
    assert "provider 'local' kept failing (500: boom) after 3 retries" in str(error)
    assert error.retryable
    assert len(fake.requests) == 4


@both_apis
@pytest.mark.parametrize("status", [401, 403])
async def test_rejected_credentials_fail_at_once_with_the_api_key_hint(
    provider_type: str, status: int
) -> None:
    fake = FakeLLM([Reply(status=status, error="invalid x-api-key"), Reply(text="unused")])
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake, provider_type) as provider:
            seen, error = await collect_until_error(provider, request(user("hi")))
    assert str(error) == (
        f"provider 'local' rejected the request ({status}): check the api_key for provider 'local'"
    )
    assert error.details == "invalid x-api-key"
    assert seen == []
    assert len(fake.requests) == 1


async def test_other_client_errors_report_the_body_message() -> None:
    fake = FakeLLM([Reply(status=400, error="model 'nope' does not exist")])
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake) as provider:
            _, error = await collect_until_error(provider, request(user("hi")))
    assert str(error) == "provider 'local' refused the request (400): model 'nope' does not exist"
    assert len(fake.requests) == 1


async def test_unreachable_server_is_retried_then_reported(autojump_clock: MockClock) -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    provider = fix_jitter(
        make_provider("local", Settings(base_url=f"http://127.0.0.1:{port}/v1", max_retries=2)),
        1.0,
    )
    try:
        with trio.fail_after(LONG_TEST_TIMEOUT):
            seen, error = await collect_until_error(provider, request(user("hi")))
    finally:
        await provider.aclose()
    assert [e.delay for e in seen if isinstance(e, Retrying)] == [1.0, 2.0]
    assert all(e.reason.startswith("connection failed") for e in seen if isinstance(e, Retrying))
    assert str(error).startswith(
        f"could not connect to provider 'local' at http://127.0.0.1:{port}"
    )


@both_apis
async def test_connection_dropped_mid_stream_is_a_provider_error(provider_type: str) -> None:
    fake = FakeLLM([Reply(text="one two three four", fault=Fault.DROP, fault_after=4)])
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake, provider_type) as provider:
            seen, error = await collect_until_error(provider, request(user("hi")))
    assert text_of(seen)  # some text arrived first; no retry after content
    assert "closed the connection mid-stream" in str(error)
    assert len(fake.requests) == 1


@both_apis
async def test_malformed_chunk_is_a_provider_error(provider_type: str) -> None:
    fake = FakeLLM([Reply(text="one two three", fault=Fault.MALFORMED, fault_after=2)])
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake, provider_type) as provider:
            _, error = await collect_until_error(provider, request(user("hi")))
    assert str(error).startswith("provider 'local' sent a malformed stream chunk: {\"oops\"")


@both_apis
async def test_invalid_tool_arguments_are_a_provider_error(provider_type: str) -> None:
    fake = FakeLLM([Reply(tool_calls=[ToolCall("view", '{"path": ', id="call_x", chunks=2)])])
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake, provider_type) as provider:
            _, error = await collect_until_error(provider, request(user("hi")))
    assert str(error).startswith("model returned invalid JSON arguments for tool call 'call_x'")


@both_apis
async def test_first_byte_timeout(provider_type: str, autojump_clock: MockClock) -> None:
    fake = FakeLLM([Reply(fault=Fault.HANG_BEFORE_HEADERS)])
    with trio.fail_after(LONG_TEST_TIMEOUT):
        async with serving(fake, provider_type, first_byte_timeout=45) as provider:
            start = trio.current_time()
            _, error = await collect_until_error(provider, request(user("hi")))
            assert trio.current_time() - start == pytest.approx(45)
            await fake.wait_for_disconnects(1)
    assert "sent no response within first_byte_timeout=45s" in str(error)
    assert len(fake.requests) == 1  # timeouts are not retried


@both_apis
@pytest.mark.parametrize("first_byte_timeout", [60.0, 20.0], ids=["own-scope", "read-timeout"])
async def test_chunk_timeout(
    provider_type: str, first_byte_timeout: float, autojump_clock: MockClock
) -> None:
    """Timed per chunk on Trio's clock (chunk_timeout < first_byte_timeout) or by the HTTP
    client's per-read timeout (chunk_timeout >= first_byte_timeout): the same error."""
    fake = FakeLLM([Reply(text="a b c d", fault=Fault.HANG, fault_after=4)])
    with trio.fail_after(LONG_TEST_TIMEOUT):
        async with serving(
            fake, provider_type, chunk_timeout=20, first_byte_timeout=first_byte_timeout
        ) as provider:
            seen, error = await collect_until_error(provider, request(user("hi")))
            await fake.wait_for_disconnects(1)
    assert text_of(seen)
    assert "stalled mid-stream: nothing for chunk_timeout=20s" in str(error)


# ---------------------------------------------------------------------------------------------
# Cancellation


@both_apis
async def test_cancel_mid_stream_closes_the_upstream_connection(provider_type: str) -> None:
    fake = FakeLLM([Reply(text="a b c d e", fault=Fault.HANG, fault_after=4)])
    seen: list[StreamEvent] = []
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake, provider_type) as provider:
            with trio.CancelScope() as scope:
                async with open_stream(provider, request(user("x"))) as events:
                    async for event in events:
                        seen.append(event)
                        if isinstance(event, TextDelta):
                            await trio.testing.wait_all_tasks_blocked()
                            scope.cancel()
            assert scope.cancelled_caught
            await fake.disconnected.wait()
    assert fake.disconnects == 1
    # Events already decoded from one read may still be delivered before the cancel lands.
    assert text_of(seen) in ("a ", "a b ", "a b c ")


@both_apis
async def test_closing_the_stream_early_closes_the_upstream_connection(provider_type: str) -> None:
    fake = FakeLLM([Reply(text="a b c d e", fault=Fault.HANG, fault_after=4)])
    with trio.fail_after(TEST_TIMEOUT):
        async with serving(fake, provider_type) as provider:
            async with open_stream(provider, request(user("x"))) as events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        break
            await fake.disconnected.wait()
    assert fake.disconnects == 1


# ---------------------------------------------------------------------------------------------
# Parsers without I/O: events a fake server does not script


def test_anthropic_error_event_is_a_provider_error() -> None:
    parser = MessagesStreamParser("claude")
    parser.feed(SSEEvent("message_start", '{"type": "message_start", "message": {}}'))
    with pytest.raises(
        ProviderError, match="reported overloaded_error mid-stream: Overloaded"
    ) as info:
        parser.feed(
            SSEEvent(
                "error",
                '{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}',
            )
        )
    assert info.value.retryable


def test_openai_stream_without_finish_is_a_provider_error() -> None:
    parser = ChatStreamParser("local")
    events = parser.feed(SSEEvent(data='{"choices": [{"index": 0, "delta": {"content": "hi"}}]}'))
    assert events == [TextDelta("hi")]
    with pytest.raises(ProviderError, match="ended the stream before the reply finished"):
        parser.end()


def test_openai_tool_call_without_index_or_early_id() -> None:
    parser = ChatStreamParser("local")
    chunks = [
        '{"choices": [{"delta": {"tool_calls": [{"function": {"arguments": "{\\"a\\""}}]}}]}',
        '{"choices": [{"delta": {"tool_calls": [{"function": {"name": "grep"}}]}}]}',
        '{"choices": [{"delta": {"tool_calls": [{"function": {"arguments": ": 1}"}}]}}]}',
        '{"choices": [{"delta": {}, "finish_reason": "stop"}]}',
        "[DONE]",
    ]
    events = [e for data in chunks for e in parser.feed(SSEEvent(data=data))]
    assert events == [
        ToolCallStart("call_0", "grep"),
        ToolCallDelta("call_0", '{"a": 1}'),
        ToolCallDone("call_0", "grep", '{"a": 1}'),
        Finished(FinishReason.TOOL_USE),
    ]


# ---------------------------------------------------------------------------------------------
# make_provider


def test_make_provider_builds_each_type() -> None:
    assert isinstance(make_provider("e", Settings(type="echo")), EchoProvider)
    openai = make_provider("oa", Settings(type="openai"))
    assert isinstance(openai, OpenAIProvider)
    assert openai.url == "https://api.openai.com/v1/chat/completions"
    assert openai.type == "openai"
    compat = make_provider("c", Settings(type="openai-compat", base_url="http://h:1/v1/"))
    assert isinstance(compat, OpenAIProvider)
    assert compat.url == "http://h:1/v1/chat/completions"
    claude = make_provider("a", Settings(type="anthropic"))
    assert isinstance(claude, AnthropicProvider)
    assert claude.url == "https://api.anthropic.com/v1/messages"


def test_make_provider_rejects_bad_config() -> None:
    with pytest.raises(ConfigError, match=r"\$\.providers\.x\.type is 'gemini'; use one of"):
        make_provider("x", Settings(type="gemini"))
    with pytest.raises(ConfigError, match=r"\$\.providers\.local\.base_url is required"):
        make_provider("local", Settings(type="openai-compat"))


# ---------------------------------------------------------------------------------------------
# The fake server as a process (benchmarks start it this way)


@pytest.mark.slow
async def test_fake_llm_runs_as_a_process() -> None:
    command = [sys.executable, "-m", "tests.fake_llm", "--port", "0", "--tokens", "5"]
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(
            functools.partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
        try:
            with trio.fail_after(TEST_TIMEOUT):
                assert process.stdout is not None
                line = b""
                while not line.endswith(b"\n"):
                    line += await process.stdout.receive_some(1)
                prefix = "fake-llm listening on "
                text = line.decode().strip()
                assert text.startswith(prefix + "http://127.0.0.1:")
                provider = make_provider("bench", Settings(base_url=text[len(prefix) :]))
                try:
                    events = await collect(provider, request(user("x")))
                finally:
                    await provider.aclose()
            assert text_of(events) == "t0 t1 t2 t3 t4 "
        finally:
            process.terminate()
