"""A publish pass takes a stream's plain text in itself (crush_trio/providers/body.py
``ReadFold``, crush_trio/store/messages.py ``ReadTick.take_in``).

The stages are pure: each either gives what the reader's own path would give for the same
bytes, leaving its state as that path leaves it, or declines and changes nothing, so the bytes
can still go up through the reader. The passes are driven on virtual time
(``autojump_clock``) over a socket pair and, end to end, over the OpenAI-compatible provider
against the fake model of tests/fake_llm.py, with the read watch the server runs.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from typing import TYPE_CHECKING, Any, cast

import hypothesis
import hypothesis.strategies as st
import orjson
import pytest
import trio
import trio.testing

from crush_trio.agent.steps import StepIO, TurnProgress
from crush_trio.errors import ProviderError
from crush_trio.providers.base import ReasoningDelta, TextDelta
from crush_trio.providers.body import (
    MAX_CHUNK_BYTES,
    READ_PACER,
    READ_WATCH_INTERVAL,
    ChunkedDecoder,
    ReadFold,
    read_watch,
)
from crush_trio.providers.http import SSEDecoder, SSEEvent
from crush_trio.providers.openai import ChatStreamParser
from crush_trio.providers.transport import Connection
from crush_trio.store import DEBOUNCE_SECONDS, MessageService
from crush_trio.wire import (
    EventKind,
    FinishReason,
    Message,
    ReasoningPart,
    TextPart,
    ToolCallPart,
)
from tests.fake_llm import FakeLLM, Fault, Reply, ToolCall
from tests.test_message_buffer import NEVER, TEST_TIMEOUT, FakeStore, Recorder, msg
from tests.test_metrics import snapshot
from tests.test_providers import request, serving, user
from tests.test_read_tick import append

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator

    from crush_trio.providers.base import Provider, StreamEvent
    from crush_trio.store.messages import ReadTick

#: Bound on the end-to-end streams (virtual seconds).
STREAM_TIMEOUT = 100


@pytest.fixture
def published() -> Recorder:
    return Recorder()


def chunked(payloads: list[bytes], *, upper: bool = False) -> bytes:
    return b"".join((b"%X" if upper else b"%x") % len(p) + b"\r\n" + p + b"\r\n" for p in payloads)


# ---------------------------------------------------------------------------------------------
# The stages, pure


payload_lists = st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=5)


@hypothesis.given(payloads=payload_lists, upper=st.booleans())
def test_whole_chunks_give_their_payload_and_leave_the_decoder_at_a_chunks_start(
    payloads: list[bytes], upper: bool
) -> None:
    data = chunked(payloads, upper=upper)
    decoder = ChunkedDecoder()
    assert decoder.take_whole(data) == b"".join(payloads) == ChunkedDecoder().feed(data)
    assert decoder.feed(data + b"0\r\n\r\n") == b"".join(payloads)
    assert decoder.done


@hypothesis.given(payloads=payload_lists)
def test_a_read_that_is_not_whole_chunks_is_declined_without_a_change(
    payloads: list[bytes],
) -> None:
    data = chunked(payloads)
    ends = set(itertools.accumulate(len(chunked([p])) for p in payloads))
    for cut in range(1, len(data)):
        decoder = ChunkedDecoder()
        taken = decoder.take_whole(data[:cut])
        if cut in ends:
            assert taken == ChunkedDecoder().feed(data[:cut])
        else:
            assert taken is None
        assert decoder.feed(data) == b"".join(payloads)  # as if nothing had been offered


@pytest.mark.parametrize(
    "data",
    [
        b"0\r\n\r\n",  # the last chunk: the body's end is the reader's
        b"3;ext=1\r\nabc\r\n",  # an extension
        b" 3\r\nabc\r\n",  # anything but bare hex digits
        b"3\r\nabcd\r\n",  # data not followed by CRLF
        b"%x\r\n" % (MAX_CHUNK_BYTES + 1),  # beyond the bound
        b"",
    ],
)
def test_chunks_the_reader_must_judge_are_declined(data: bytes) -> None:
    assert ChunkedDecoder().take_whole(data) is None


def test_a_decoder_inside_a_chunk_declines() -> None:
    decoder = ChunkedDecoder()
    assert decoder.feed(b"5\r\nab") == b"ab"
    assert decoder.take_whole(b"3\r\nxyz\r\n") is None
    assert decoder.feed(b"cde\r\n") == b"cde"


one_line = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=30
)


@hypothesis.given(lines=st.lists(one_line, min_size=1, max_size=4))
def test_whole_data_events_are_what_feed_gives(lines: list[str]) -> None:
    chunk = b"".join(b"data: " + line.encode() + b"\n\n" for line in lines)
    decoder = SSEDecoder()
    assert decoder.take_whole(chunk) == SSEDecoder().feed(chunk)
    assert decoder.feed(b"data: next\n\n") == [SSEEvent("message", "next")]


@pytest.mark.parametrize(
    ("pending", "chunk"),
    [
        (b"data: par", b"tial\n\n"),  # a line split across reads
        (b"", b"event: x\ndata: y\n\n"),  # a field the reader handles
        (b"", b"data:y\n\n"),  # no space after the colon
        (b"", b"data: a\ndata: b\n\n"),  # an event of two lines
        (b"", b"data: a\n"),  # no blank line yet
        (b"", b": comment\n\n"),
    ],
)
def test_events_the_reader_must_decode_are_declined(pending: bytes, chunk: bytes) -> None:
    decoder, reference = SSEDecoder(), SSEDecoder()
    assert decoder.feed(pending) == reference.feed(pending)
    assert decoder.take_whole(chunk) is None
    assert decoder.feed(chunk) == reference.feed(chunk)


def test_an_event_over_the_limit_is_left_to_the_reader_which_refuses_it() -> None:
    decoder = SSEDecoder(limit=10)
    chunk = b"data: " + b"x" * 10 + b"\n\n"
    assert decoder.take_whole(chunk) is None
    with pytest.raises(ValueError, match="larger than 10 bytes"):
        decoder.feed(chunk)


def sse(body: dict[str, Any]) -> SSEEvent:
    return SSEEvent("message", orjson.dumps(body).decode())


def choice(delta: dict[str, Any], finish: str | None = None) -> SSEEvent:
    return sse({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


#: Chunks of a Chat Completions stream: plain ones and every kind the reader must take.
CHUNKS = [
    choice({"content": "text "}),
    choice({"content": ""}),
    choice({"role": "assistant", "content": ""}),
    choice({"reasoning_content": "think "}),
    choice({"reasoning": "ponder "}),
    choice({"reasoning_content": "both ", "content": "at once "}),
    choice({"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "view"}}]}),
    choice({"tool_calls": [{"index": 0, "function": {"arguments": '{"p": 1}'}}]}),
    sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}),
    sse({"choices": [{"index": 1, "delta": {"content": "other choice "}}]}),
]


@hypothesis.given(
    picks=st.lists(st.integers(0, len(CHUNKS) - 1), max_size=12),
    groups=st.lists(st.integers(1, 3), min_size=12, max_size=12),
    finish=st.sampled_from([None, "stop", "tool_calls"]),
)
def test_plain_chunks_taken_in_give_what_feed_gives_and_others_are_left_as_they_were(
    picks: list[int], groups: list[int], finish: str | None
) -> None:
    """A stream taken in where possible and fed where not gives the same stream events, in
    the same order, and the same error if any, as one fed throughout, to its end."""
    events = [CHUNKS[i] for i in picks]
    if finish is not None:
        events.append(choice({}, finish))
    reference, mixed = ChatStreamParser("p"), ChatStreamParser("p")
    expected: list[StreamEvent] = []
    got: list[StreamEvent] = []
    rest, sizes = list(events), iter(groups)
    with outcome() as failed:
        for event in events:
            expected += reference.feed(event)
        expected += reference.end()
    with outcome() as mixed_failed:
        while rest:
            size = next(sizes, 1)
            group, rest = rest[:size], rest[size:]
            taken = mixed.take_plain(group)
            if taken is None:
                for event in group:
                    got += mixed.feed(event)
            else:
                assert taken, "a take that grows nothing is declined"
                # Only appends: what the stream's consumer can take in at a pass.
                assert all(isinstance(e, TextDelta | ReasoningDelta) for e in taken)
                got += taken
        got += mixed.end()
    assert got == expected
    assert mixed_failed == failed


@contextlib.contextmanager
def outcome() -> Iterator[list[str]]:
    """Record the provider error the block raised, if any."""
    failed: list[str] = []
    try:
        yield failed
    except ProviderError as exc:
        failed.append(str(exc))


@pytest.mark.parametrize(
    "data",
    [
        '{"oops": [1, 2',  # malformed: the reader raises the provider's error
        '"just a string"',
        '{"error": {"message": "overloaded"}}',
        "[DONE]",
    ],
)
def test_a_chunk_the_reader_must_judge_is_declined(data: str) -> None:
    parser = ChatStreamParser("p")
    assert parser.take_plain([SSEEvent("message", data)]) is None
    assert not parser.done


def test_a_finished_parser_takes_nothing() -> None:
    parser = ChatStreamParser("p")
    parser.feed(SSEEvent("message", "[DONE]"))
    assert parser.take_plain([choice({"content": "late"})]) is None


class Stages:
    """A fold's stages that record their calls; ``decline`` names the one that declines."""

    def __init__(self, decline: str = "", *, ready: bool = True) -> None:
        self.calls: list[str] = []
        self.taken: list[Any] = []
        self.fold = ReadFold()
        self.fold.body = lambda data: self._stage("body", data)
        self.fold.events = lambda data: self._stage("events", [data])
        self.fold.parse = lambda found: self._stage("parse", found)
        self.fold.ready = lambda: self._stage("ready", ready)
        self.fold.take = self.taken.extend
        self.decline = decline

    def _stage(self, name: str, value: Any) -> Any:
        self.calls.append(name)
        return None if name == self.decline else value


def test_a_fold_runs_its_stages_in_order_and_takes_what_they_give() -> None:
    stages = Stages()
    assert stages.fold.can_take()
    assert stages.fold.run(b"x")
    assert stages.calls == ["ready", "body", "events", "parse"]
    assert stages.taken == [b"x"]


@pytest.mark.parametrize("decline", ["body", "events", "parse"])
def test_a_stage_that_declines_stops_the_fold_before_the_take(decline: str) -> None:
    stages = Stages(decline)
    assert not stages.fold.run(b"x")
    assert stages.calls[-1] == decline
    assert stages.taken == []


def test_a_fold_not_ready_or_missing_a_stage_cannot_take() -> None:
    assert not Stages(ready=False).fold.can_take()
    for missing in ("body", "events", "parse", "take"):
        stages = Stages()
        setattr(stages.fold, missing, None)  # that layer has ended, or never ran
        assert not stages.fold.can_take()
        assert "ready" not in stages.calls or missing == "take"
        assert not stages.fold.run(b"x")
        assert stages.taken == []


# ---------------------------------------------------------------------------------------------
# The passes, over a socket pair


@contextlib.asynccontextmanager
async def paced_stream(
    published: Recorder,
) -> AsyncIterator[tuple[MessageService, Message, trio.socket.SocketType, list[bytes]]]:
    """A flusher, a streaming message, and a reader task reading a socket pair's left end as
    the connection's reader does, taking what it reads in itself; the stages take in bytes
    that do not start with ``!``. Yields the service, the message, the right end and the
    reads the reader task made."""
    service = MessageService(FakeStore(), published, write_window=NEVER)
    left, right = trio.socket.socketpair()
    connection = Connection(("http", "x", 80), trio.SocketStream(left), left.fileno())
    message = msg("m")
    reads: list[bytes] = []

    def take_in(texts: list[str]) -> None:
        for text in texts:
            old = message.text()
            message.parts = [TextPart(old + text)]
            service.append_nowait(message, append(old, text))

    pacer = service.read_pacer("m")
    pacer.fold.body = lambda data: data
    pacer.fold.events = lambda data: [data]
    pacer.fold.parse = lambda found: None if found[0][:1] == b"!" else [b.decode() for b in found]
    pacer.fold.ready = lambda: service.can_append("m")
    pacer.fold.take = take_in

    async def reader() -> None:
        while data := await connection.read():
            reads.append(data)
            old = message.text()
            message.parts = [TextPart(old + data.decode())]
            await service.update(message, append(old, data.decode()))
        reads.append(b"")

    token = READ_PACER.set(pacer)
    try:
        with trio.fail_after(TEST_TIMEOUT):
            async with trio.open_nursery() as nursery:
                await nursery.start(service.run)
                await service.create(message)
                nursery.start_soon(reader)
                await trio.testing.wait_all_tasks_blocked()
                await right.send(b"a")  # the first read waits for the socket
                await trio.testing.wait_all_tasks_blocked()
                assert reads == [b"a"]
                yield service, message, right, reads
                nursery.cancel_scope.cancel()
    finally:
        READ_PACER.reset(token)
        left.close()
        right.close()


async def test_a_pass_takes_plain_bytes_in_and_the_reader_goes_on_waiting(
    autojump_clock: trio.testing.MockClock, published: Recorder
) -> None:
    async with paced_stream(published) as (service, message, right, reads):
        start = trio.current_time()  # "a" went out at once: the next pass is a window on
        for n, token in enumerate("bcd", start=1):
            await right.send(token.encode())
            await trio.sleep_until(start + (n + 0.5) * DEBOUNCE_SECONDS)
        assert reads == [b"a"]  # the reader task was never woken
        assert message.text() == "abcd"
        assert service.reads_taken == 3
        texts = [text for kind, _, text in published.events if kind is EventKind.UPDATED]
        assert texts == ["a", "ab", "abc", "abcd"]  # each pass published what it took in

        await right.send(b"!end")  # not plain: the reader gets exactly what the pass read
        await trio.sleep(DEBOUNCE_SECONDS)
        assert reads == [b"a", b"!end"]
        assert message.text() == "abcd!end"
        assert service.reads_taken == 3


async def test_the_connections_end_read_by_a_pass_reaches_the_reader(
    autojump_clock: trio.testing.MockClock, published: Recorder
) -> None:
    async with paced_stream(published) as (service, _message, right, reads):
        await right.send(b"b")
        await trio.sleep(1.5 * DEBOUNCE_SECONDS)
        right.close()
        await trio.sleep(DEBOUNCE_SECONDS)
        assert reads == [b"a", b""]
        assert service.reads_taken == 1


async def test_a_pass_that_reads_nothing_wakes_the_reader_to_wait_for_its_socket(
    autojump_clock: trio.testing.MockClock, published: Recorder
) -> None:
    async with paced_stream(published) as (service, message, right, reads):
        await trio.sleep(1.5 * DEBOUNCE_SECONDS)  # the model paused past a pass
        assert reads == [b"a"]
        await right.send(b"z")  # the reader, waiting for its socket, reads it at once
        await trio.testing.wait_all_tasks_blocked()
        assert reads == [b"a", b"z"]
        assert message.text() == "az"
        assert service.reads_taken == 0


@contextlib.asynccontextmanager
async def waiting_reader(
    published: Recorder, **stages: Any
) -> AsyncIterator[tuple[MessageService, ReadTick, trio.socket.SocketType, trio.socket.SocketType]]:
    """A flusher and a streaming message whose stream's pacer has ``stages``; yields the
    service, the pacer (its first read made) and a socket pair (the reader's end, the
    model's end)."""
    service = MessageService(FakeStore(), published, write_window=NEVER)
    left, right = trio.socket.socketpair()
    message = msg("m")
    pacer = service.read_pacer("m")
    for name, stage in stages.items():
        setattr(pacer.fold, name, stage)
    try:
        with trio.fail_after(TEST_TIMEOUT):
            async with trio.open_nursery() as nursery:
                await nursery.start(service.run)
                await service.create(message)
                await service.update(message, None)  # published: the message streams
                assert not await pacer.before_read()  # the first read waits for the socket
                yield service, pacer, left, right
                nursery.cancel_scope.cancel()
    finally:
        left.close()
        right.close()


def reading(sock: trio.socket.SocketType) -> Callable[[], bytes]:
    """A stream's ``read_now``: the socket without waiting."""
    return lambda: os.read(sock.fileno(), 64)


def identity(value: Any) -> Any:
    return value


async def test_a_stage_that_fails_fails_its_stream_and_the_passes_go_on(
    autojump_clock: trio.testing.MockClock, published: Recorder
) -> None:
    def broken(found: list[bytes]) -> None:
        raise RuntimeError("stage broke")

    async with waiting_reader(
        published, body=identity, events=identity, parse=broken, ready=lambda: True, take=print
    ) as (service, pacer, left, right):
        await right.send(b"b")
        assert await pacer.before_read(reading(left))  # woken by the pass, with the error
        failed = pacer.taken()
        assert isinstance(failed, RuntimeError)
        assert str(failed) == "stage broke"
        other = msg("o")
        await service.create(other)
        await trio.sleep(DEBOUNCE_SECONDS)
        other.parts = [TextPart("still published")]
        await service.update(other)
        await trio.sleep(DEBOUNCE_SECONDS)
    assert published.events[-1] == (EventKind.UPDATED, "o", "still published")


async def test_a_reader_cancelled_while_it_waits_leaves_its_bytes_unread(
    autojump_clock: trio.testing.MockClock, published: Recorder
) -> None:
    def never(found: list[bytes]) -> None:
        pytest.fail("nothing may be taken in for a cancelled read")

    async with waiting_reader(
        published, body=identity, events=identity, parse=identity, ready=lambda: True, take=never
    ) as (service, pacer, left, right):
        with trio.move_on_after(DEBOUNCE_SECONDS / 2):
            await pacer.before_read(reading(left))
        await right.send(b"kept")
        await trio.sleep(2 * DEBOUNCE_SECONDS)
        assert service.reads_taken == 0
        assert await left.recv(64) == b"kept"


async def test_a_stream_whose_fold_cannot_take_is_woken_to_read_itself(
    autojump_clock: trio.testing.MockClock, published: Recorder
) -> None:
    """A stream without a parse stage (a provider that has none) is not read by the pass: its
    reader reads what arrived itself."""
    async with waiting_reader(
        published, body=identity, events=identity, ready=lambda: True, take=print
    ) as (service, pacer, left, right):
        await right.send(b"b")
        assert await pacer.before_read(reading(left))
        assert pacer.taken() is None  # nothing read for it
        assert os.read(left.fileno(), 64) == b"b"
        assert service.reads_taken == 0


# ---------------------------------------------------------------------------------------------
# End to end: a model step over the provider, its passes taking its text in


class UsageStore:
    async def record_step_usage(self, *args: object) -> None:
        return None


class Broker:
    def publish(self, *args: object) -> None:
        return None


@contextlib.asynccontextmanager
async def stepping(
    fake: FakeLLM, published: Recorder, **settings: Any
) -> AsyncIterator[tuple[Provider, MessageService, StepIO, FakeLLM]]:
    async with serving(fake, **settings) as provider, read_watch(), trio.open_nursery() as nursery:
        service = MessageService(FakeStore(), published, write_window=NEVER)
        await nursery.start(service.run)
        io = StepIO(
            messages=service,
            store=cast("Any", UsageStore()),
            broker=cast("Any", Broker()),
            on_first_token=lambda progress: setattr(progress, "first_token", True),
        )
        yield provider, service, io, fake
        nursery.cancel_scope.cancel()


async def step(io: StepIO, provider: Provider, message: Message) -> FinishReason:
    await io.messages.create(message)
    progress = TurnProgress(turn=cast("Any", None))
    return await io.stream(provider, request(user("hi")), message, progress)


TOKENS = [f"t{i} " for i in range(40)]
READS_TAKEN = "crush_trio_provider_reads_taken_total"


async def test_a_paced_step_streams_whole_with_its_text_taken_in_by_the_passes(
    autojump_clock: trio.testing.MockClock, published: Recorder
) -> None:
    reply = Reply(
        text=TOKENS,
        reasoning=[f"r{i} " for i in range(12)],
        tool_calls=[ToolCall("view", '{"path": "a.txt"}', chunks=4)],
        token_delay=0.01,
    )
    message = msg("m")
    taken = snapshot(READS_TAKEN)
    with trio.fail_after(STREAM_TIMEOUT):
        async with stepping(FakeLLM([reply]), published) as (provider, service, io, _fake):
            reason = await step(io, provider, message)
    assert reason is FinishReason.TOOL_USE
    assert taken.delta(READS_TAKEN) == service.reads_taken  # what operators see
    reasoning, text, call, _finished = message.parts
    assert isinstance(reasoning, ReasoningPart)
    assert reasoning.thinking == "".join(reply.reasoning)
    assert reasoning.finished_at  # closed by the reader when the text began
    assert text == TextPart("".join(TOKENS))
    assert isinstance(call, ToolCallPart)
    assert (call.name, call.input, call.finished) == ("view", '{"path": "a.txt"}', True)
    assert service.reads_taken >= 10  # most of the 52 paced tokens came in at passes
    texts = [t for kind, _, t in published.events if kind is EventKind.UPDATED]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))


async def test_a_stream_that_stalls_after_passes_took_it_in_times_out_from_its_last_bytes(
    autojump_clock: trio.testing.MockClock, published: Recorder
) -> None:
    """The passes took 0.59 s of tokens in while the reader waited, longer than the chunk
    timeout: each take starts the read's deadline again, so the stall is reported a timeout
    after the last bytes, not after the read began."""
    reply = Reply(text=TOKENS * 2, token_delay=0.01, fault=Fault.HANG, fault_after=60)
    message = msg("m")
    with trio.fail_after(STREAM_TIMEOUT):
        async with stepping(
            FakeLLM([reply]), published, chunk_timeout=0.3, first_byte_timeout=0.3
        ) as (provider, service, io, _fake):
            start = trio.current_time()
            with pytest.raises(ProviderError, match="stalled mid-stream"):
                await step(io, provider, message)
            elapsed = trio.current_time() - start
    assert message.text() == "".join((TOKENS * 2)[:59])
    assert service.reads_taken >= 5
    assert 0.59 + 0.3 <= elapsed <= 0.59 + 0.3 + READ_WATCH_INTERVAL + 2 * DEBOUNCE_SECONDS


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        (Fault.DROP, "closed the connection mid-stream"),
        (Fault.MALFORMED, "malformed stream chunk"),
    ],
)
async def test_a_stream_that_breaks_after_passes_took_it_in_fails_and_keeps_its_text(
    autojump_clock: trio.testing.MockClock, published: Recorder, fault: Fault, error: str
) -> None:
    reply = Reply(text=TOKENS, token_delay=0.01, fault=fault, fault_after=30)
    message = msg("m")
    with trio.fail_after(STREAM_TIMEOUT):
        async with stepping(FakeLLM([reply]), published) as (provider, service, io, _fake):
            with pytest.raises(ProviderError, match=error):
                await step(io, provider, message)
    assert message.text() == "".join(TOKENS[:29])
    assert service.reads_taken > 0


async def test_a_step_cancelled_while_passes_take_it_in_closes_its_connection(
    autojump_clock: trio.testing.MockClock, published: Recorder
) -> None:
    reply = Reply(text=TOKENS * 5, token_delay=0.01)
    message = msg("m")
    with trio.fail_after(STREAM_TIMEOUT):
        async with stepping(FakeLLM([reply]), published) as (provider, service, io, fake):
            with trio.move_on_after(0.5):
                await step(io, provider, message)
            taken = service.reads_taken
            await fake.wait_for_disconnects(1)
            await trio.sleep(5 * DEBOUNCE_SECONDS)
            assert service.reads_taken == taken  # nothing taken in after the cancel
    assert taken > 0
    full = "".join(TOKENS * 5)
    assert 0 < len(message.text()) < len(full)
    assert full.startswith(message.text())


async def test_an_append_without_a_wait_is_refused_for_a_message_not_streaming_here(
    published: Recorder,
) -> None:
    service = MessageService(FakeStore(), published, write_window=NEVER)
    message = msg("m", TextPart("x"))
    assert not service.can_append("m")
    with pytest.raises(ValueError, match="'m' is not streaming here: use update"):
        service.append_nowait(message, append("", "x"))
    await service.create(message)
    assert service.can_append("m")
