"""The read tick (crush_trio/store/messages.py ``ReadTick``): a streaming message's model stream
reads at the publish passes, and a pass publishes what its reads took in, in one batch.

Virtual time (``autojump_clock``) and the in-memory store of tests/test_message_buffer.py; a
"reader" here is a task that calls the pacer as the connection's reader does
(crush_trio/providers/transport.py ``Connection.read``) and takes in a token after each wait.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from crush_trio.store import DEBOUNCE_SECONDS, MessageService
from crush_trio.store.messages import READ_TICK_WAIT
from crush_trio.wire import EventKind, MessageDelta, TextPart
from tests.test_message_buffer import NEVER, TEST_TIMEOUT, Batches, FakeStore, Recorder, msg


def append(message_text: str, text: str) -> MessageDelta:
    return MessageDelta(
        session_id="s",
        message_id="m",
        part=0,
        part_type="text",
        offset=len(message_text),
        text=text,
    )


async def grow(service: MessageService, message: object, text: str) -> None:
    """Append ``text`` to the message's text part, as a streamed token does."""
    assert hasattr(message, "parts")
    old = message.text()  # type: ignore[attr-defined]
    message.parts = [TextPart(old + text)]  # type: ignore[attr-defined]
    await service.update(message, append(old, text))  # type: ignore[arg-type]


@pytest.fixture
def published() -> Recorder:
    return Recorder()


async def test_a_streaming_reader_reads_at_the_passes_and_each_pass_publishes_its_read(
    autojump_clock: trio.testing.MockClock, published: Recorder
) -> None:
    batches = Batches(published)
    service = MessageService(FakeStore(), published, write_window=NEVER, batch=batches)
    woke: list[float] = []
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            start = trio.current_time()
            message = msg("m")
            await service.create(message)
            await grow(service, message, "a")  # a window after its create: out at once
            pacer = service.read_pacer("m")
            assert not await pacer.before_read()  # the first read waits for its socket

            async def reader() -> None:
                for token in "bcd":
                    assert await pacer.before_read()  # waited for a pass
                    woke.append(trio.current_time() - start)
                    await grow(service, message, token)
                await pacer.before_read()  # back: the pass need not wait

            nursery.start_soon(reader)
            await trio.sleep(4 * DEBOUNCE_SECONDS)
            nursery.cancel_scope.cancel()
    assert woke == pytest.approx([DEBOUNCE_SECONDS * n for n in (1, 2, 3)], abs=1e-6)
    texts = [text for kind, _, text in published.events if kind is EventKind.UPDATED]
    assert texts[-3:] == ["ab", "abc", "abcd"]
    # Each pass published its reader's token in its batch, at the pass.
    assert [ids for _, ids in batches.batches] == [["m"], ["m"], ["m"]]
    assert [at - start for at, _ in batches.batches] == pytest.approx(woke, abs=1e-6)


async def test_a_pass_waits_for_a_slow_reader_at_most_the_bound(
    autojump_clock: trio.testing.MockClock, published: Recorder
) -> None:
    batches = Batches(published)
    service = MessageService(FakeStore(), published, write_window=NEVER, batch=batches)
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            start = trio.current_time()
            slow, quick = msg("slow"), msg("quick")
            for message in (slow, quick):
                await service.create(message)
                message.parts = [TextPart("w")]
                await service.update(message)  # published at once: the window starts
                message.parts = [TextPart("a")]
                await service.update(message)
            slow_pacer, quick_pacer = service.read_pacer("slow"), service.read_pacer("quick")
            for pacer in (slow_pacer, quick_pacer):
                assert not await pacer.before_read()  # the first read waits for its socket

            async def slow_reader() -> None:
                assert await slow_pacer.before_read()
                await trio.sleep(1.0)  # its read takes long (a write it waits for)
                slow.parts = [TextPart("ab")]
                await service.update(slow)
                await slow_pacer.before_read()

            async def quick_reader() -> None:
                assert await quick_pacer.before_read()
                quick.parts = [TextPart("ab")]
                await service.update(quick)
                await quick_pacer.before_read()

            nursery.start_soon(slow_reader)
            nursery.start_soon(quick_reader)
            await trio.sleep(DEBOUNCE_SECONDS + READ_TICK_WAIT + 0.001)
            # The pass gave up on the slow reader after the bound: it published what was held
            # ("a" of both) and the quick reader's read, not the slow one's.
            at, ids = batches.batches[-1]
            assert at - start == pytest.approx(DEBOUNCE_SECONDS + READ_TICK_WAIT, abs=1e-6)
            assert sorted(ids) == ["quick", "slow"]
            assert [(mid, text) for _, mid, text in published.events[-2:]] in (
                [("slow", "a"), ("quick", "ab")],
                [("quick", "ab"), ("slow", "a")],
            )
            await trio.sleep(2.0)
            nursery.cancel_scope.cancel()
    # The slow reader's late update went out on its own later, once.
    slow_updates = [
        text for kind, mid, text in published.events if mid == "slow" and kind is EventKind.UPDATED
    ]
    assert slow_updates == ["w", "a", "ab"]


async def test_a_read_that_found_nothing_makes_the_next_wait_one_for_the_socket(
    autojump_clock: trio.testing.MockClock, published: Recorder
) -> None:
    service = MessageService(FakeStore(), published, write_window=NEVER)
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            message = msg("m")
            await service.create(message)
            await grow(service, message, "a")
            pacer = service.read_pacer("m")
            assert not await pacer.before_read()  # the first read waits for its socket
            assert await pacer.before_read()
            pacer.read_empty()  # the model paused
            before = trio.current_time()
            assert not await pacer.before_read()  # no wait: the reader waits for its socket
            assert trio.current_time() == before
            await grow(service, message, "b")  # data came: streaming again
            assert await pacer.before_read()
            nursery.cancel_scope.cancel()


async def test_a_quiet_message_or_a_stopped_flusher_never_makes_a_reader_wait(
    autojump_clock: trio.testing.MockClock, published: Recorder
) -> None:
    service = MessageService(FakeStore(), published, write_window=NEVER)
    message = msg("m")
    pacer = service.read_pacer("m")
    flusher = trio.CancelScope()

    async def run_flusher(task_status: trio.TaskStatus[None]) -> None:
        with flusher:
            await service.run(task_status=task_status)

    read = trio.Event()

    async def reader() -> None:
        assert await pacer.before_read()  # released when the flusher stops
        read.set()

    with trio.fail_after(TEST_TIMEOUT):
        assert not await pacer.before_read()  # the first read waits for its socket
        await service.create(message)
        message.parts = [TextPart("a")]
        await service.update(message)  # its first words: the next read would wait for a pass
        assert not await pacer.before_read()  # but no flusher runs
        async with trio.open_nursery() as nursery:
            await nursery.start(run_flusher)
            await trio.sleep(2 * DEBOUNCE_SECONDS)
            assert not await pacer.before_read()  # nothing shown for a window: quiet
            await grow(service, message, "a")
            nursery.start_soon(reader)
            await trio.sleep(DEBOUNCE_SECONDS / 4)
            assert not read.is_set()  # waiting for the next pass
            stopped = trio.current_time()
            flusher.cancel()
            await read.wait()
            assert trio.current_time() == stopped  # at once, not at a pass


async def test_a_new_message_is_read_as_data_comes_until_its_first_words_are_out(
    autojump_clock: trio.testing.MockClock, published: Recorder
) -> None:
    """A message's ``created`` starts no window: the reads before its first words wait for the
    socket, not for a pass, and those words go out at once; then it streams at the passes."""
    service = MessageService(FakeStore(), published, write_window=NEVER)
    message = msg("m")
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            await service.create(message)
            pacer = service.read_pacer("m")
            created = trio.current_time()
            assert not await pacer.before_read()  # the first read (the reply's head chunk)
            assert not await pacer.before_read()  # no words yet: the socket again
            assert trio.current_time() == created
            await grow(service, message, "a")
            assert published.events[-1] == (EventKind.UPDATED, "m", "a")  # at once
            assert await pacer.before_read()  # streaming now: the next pass
            assert trio.current_time() == pytest.approx(created + DEBOUNCE_SECONDS)
            pacer.close()
            nursery.cancel_scope.cancel()


async def test_a_reader_cancelled_while_waiting_is_not_waited_for(
    autojump_clock: trio.testing.MockClock, published: Recorder
) -> None:
    batches = Batches(published)
    service = MessageService(FakeStore(), published, write_window=NEVER, batch=batches)
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            start = trio.current_time()
            message = msg("m")
            await service.create(message)
            await grow(service, message, "a")
            pacer = service.read_pacer("m")
            assert not await pacer.before_read()  # the first read waits for its socket
            with trio.move_on_after(DEBOUNCE_SECONDS / 2) as scope:
                await pacer.before_read()
            assert scope.cancelled_caught
            await grow(service, message, "b")  # held for the window's end
            await trio.sleep(DEBOUNCE_SECONDS)
            nursery.cancel_scope.cancel()
    # The pass at the window's end published at once: no reader was counted.
    assert batches.batches == [(pytest.approx(start + DEBOUNCE_SECONDS, abs=1e-6), ["m"])]


async def test_a_pass_wakes_only_the_streams_whose_message_it_publishes(
    autojump_clock: trio.testing.MockClock, published: Recorder
) -> None:
    """Two messages whose windows end more than half a window apart: the pass at the end of
    one's window does not wake the other's stream (which would find nothing to read)."""
    service = MessageService(FakeStore(), published, write_window=NEVER)
    woke: dict[str, list[float]] = {"a": [], "b": []}
    with trio.fail_after(TEST_TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            start = trio.current_time()
            for mid, at in (("a", 0.0), ("b", 0.6 * DEBOUNCE_SECONDS)):
                await trio.sleep_until(start + at)
                message = msg(mid)
                await service.create(message)  # its window starts now
                message.parts = [TextPart("x")]
                await service.update(message)  # held for the window's end
                pacer = service.read_pacer(mid)
                assert not await pacer.before_read()  # the first read waits for its socket

                async def reader(mid: str = mid, pacer: object = pacer) -> None:
                    assert await pacer.before_read()  # type: ignore[attr-defined]
                    woke[mid].append(trio.current_time() - start)
                    pacer.close()  # type: ignore[attr-defined]

                nursery.start_soon(reader)
            await trio.sleep(2 * DEBOUNCE_SECONDS)
            nursery.cancel_scope.cancel()
    assert woke["a"] == [pytest.approx(DEBOUNCE_SECONDS, abs=1e-6)]
    assert woke["b"] == [pytest.approx(1.6 * DEBOUNCE_SECONDS, abs=1e-6)]
