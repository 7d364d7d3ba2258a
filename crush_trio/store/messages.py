"""The message service: throttled publishing and batched writes of streaming messages.

A streaming reply changes its message many times a second. Publishing and writing every delta
would flood clients and make the database the bottleneck, so :class:`MessageService` keeps only
the latest state of each message and

- **publishes** ``updated`` at most once per publish window (``debounce``,
  :data:`DEBOUNCE_SECONDS`; Crush's 33 ms). The window is a throttle with a leading edge: an
  update that comes after a quiet window, or a message's first after its ``created``, is
  published at once (so the first words of a reply are visible without waiting), later ones when
  the window since the last event ends. A window that ends within :data:`ALIGN_FRACTION` of a
  window after the one the flusher wakes for ends with it, so the streams fall into step and one
  wake publishes them all, inside the ``batch`` callback (the broker's, which gives each client
  one write for the lot); a window is shortened that way once when its stream joins, by at most
  that fraction;
- **paces the reads** of the model streams (:class:`ReadTick`): while a message streams, its
  stream reads its connection at the publish passes, several tokens a read, instead of once per
  token, and a pass publishes what its reads took in; where it can, the pass reads a stream's
  socket and takes plain text in itself, without waking the stream's task;
- **writes** the latest state of every pending message in one batch at most once per write
  window (``write_window``, :data:`WRITE_WINDOW_SECONDS`, never shorter than the publish window).
  Streaming state is published from memory before it is written; a crash can lose at most one
  write window of a partial reply, never a finished message.

What a window publishes: when every change since the message's last event was an append (the
caller passes the :class:`~crush_trio.wire.MessageDelta` of each) and a ``publish_delta`` callback
is set, one ``message_delta`` per part that grew, the appends to a part coalesced (the first
offset, the texts concatenated); otherwise one ``updated`` snapshot. Appends to different parts
are independent, so their deltas go out in the order the parts were first appended to in the
window (a part is created by its first delta, in index order).

Changes that end a phase are written and then published at once, because the next step depends
on them being stored:

- the message gained a finish part;
- the number of tool-call parts changed, or a tool call's ``finished`` flag flipped;
- a reasoning part got its ``finished_at``.

:meth:`MessageService.flush_all` drains everything and waits for any write in flight; it does not
need the flusher task, so it works at shutdown inside ``trio.move_on_after(T, shield=True)`` after
that task has been cancelled. Readers call :meth:`MessageService.flush_session` (or
``flush_all``) before listing messages, so a read never shows less than an event already sent.

Rules the state below keeps:

- ``_pending`` holds the latest unwritten state per id; ``_due`` the time its write window ends.
- ``_unpublished`` holds, per id whose latest state no event has shown yet, when it is due;
  ``_last_publish`` when each unfinished message's last event went out.
- Only one write runs at a time (``_write_lock``); it takes its batch out of ``_pending`` after
  acquiring the lock, so the newest state always wins. After the write it publishes the batch's
  unpublished states, so a terminal state is never published before it is stored.
- A write that could not start (cancelled while waiting, or failed) puts its batch back unless a
  newer state arrived or the message was forgotten in the meantime.
- :meth:`forget` and :meth:`delete_session_messages` drop pending state and wait for the write in
  flight, so nothing written afterwards can resurrect a deleted row. (The store also skips rows
  whose session is gone.)
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Final, NamedTuple

import trio

from ..core.ports import MessageStore as MessageStore  # noqa: TC001 (a re-export)
from ..defaults import DEFAULT_DEBOUNCE_MS, DEFAULT_MESSAGE_WRITE_MS
from ..errors import StoreError
from ..metrics import METRICS
from ..providers.body import ReadFold
from ..wire import EventKind, Message, MessageDelta, ReasoningPart, Role, ToolCallPart

logger = logging.getLogger(__name__)

#: Publish window for streaming updates of one message (seconds): at most one ``updated`` event
#: per message per window (Crush's 33 ms). Configured by ``options.debounce_ms``.
DEBOUNCE_SECONDS: Final = DEFAULT_DEBOUNCE_MS / 1000
#: A publish window that ends within this fraction of a window after another one ends with it.
ALIGN_FRACTION: Final = 0.5

#: Longest wait of a publish pass for the model streams it woke to take in what they read
#: (seconds); a stream that takes longer has its update published with the next pass.
READ_TICK_WAIT: Final = 0.005

#: Write window (seconds): pending streaming state is written to the store at most this long
#: after its first unwritten update, all pending messages in one transaction. Configured by
#: ``server.message_write_ms``. Terminal changes are written at once regardless.
WRITE_WINDOW_SECONDS: Final = DEFAULT_MESSAGE_WRITE_MS / 1000

#: After a failed background write, the flusher waits this long (seconds) before trying again, so
#: a broken disk produces a log line a second rather than thirty.
WRITE_RETRY_SECONDS: Final = 1.0


#: The publish callback: synchronous, never blocking (lossy delivery is the caller's business).
Publish = Callable[[Message, EventKind], object]
#: The delta publish callback: one append (coalesced) and the message's state after it.
PublishDelta = Callable[[MessageDelta, Message], object]


class _Coalesced:
    """The appends to one part since the message's last event: the first offset, the texts."""

    __slots__ = ("delta", "end", "texts")

    def __init__(self, delta: MessageDelta) -> None:
        self.delta = delta
        self.texts = [delta.text]
        self.end = delta.offset + len(delta.text)

    def joined(self) -> MessageDelta:
        delta = self.delta
        if len(self.texts) > 1:
            delta = MessageDelta(
                delta.message_id,
                delta.session_id,
                delta.part,
                delta.part_type,
                delta.offset,
                "".join(self.texts),
                delta.tool_call_id,
                delta.tool_name,
            )
        return delta


#: The appends since a message's last event, by part index; None: a change that was not an
#: append (the next event is a snapshot).
_Appends = dict[int, _Coalesced] | None


class Shape(NamedTuple):
    """The parts of a message's state whose change is terminal (see :func:`is_terminal_change`)."""

    finished: bool
    tool_calls: tuple[tuple[str, bool], ...]  # (id, finished) per tool-call part, in order
    reasoning_finished: int  # number of reasoning parts with a finished_at


def shape_of(message: Message) -> Shape:
    return Shape(
        finished=message.finish() is not None,
        tool_calls=tuple((p.id, p.finished) for p in message.parts if isinstance(p, ToolCallPart)),
        reasoning_finished=sum(
            1 for p in message.parts if isinstance(p, ReasoningPart) and p.finished_at
        ),
    )


_EMPTY_SHAPE: Final = Shape(finished=False, tool_calls=(), reasoning_finished=0)


def is_terminal_change(old: Shape | None, new: Shape) -> bool:
    """Whether going from ``old`` to ``new`` must be written at once rather than debounced.

    ``old`` is None for a message this service has not seen updated (it is compared with an empty
    message, so a first update that already carries a finish part or tool calls is terminal).
    """
    old = old or _EMPTY_SHAPE
    if new.finished and not old.finished:
        return True
    if len(new.tool_calls) != len(old.tool_calls):
        return True
    was_finished = dict(old.tool_calls)
    if any(tid in was_finished and was_finished[tid] != done for tid, done in new.tool_calls):
        return True
    return new.reasoning_finished > old.reasoning_finished


class MessageService:
    """Creates messages and buffers their streaming updates in front of the store.

    The owner starts :meth:`run` in its nursery with ``await nursery.start(service.run)`` and,
    when shutting down, cancels it and then calls :meth:`flush_all` inside
    ``trio.move_on_after(T, shield=True)`` before closing the store.

    Attributes:
        peak_pending: The most messages that were pending (unwritten) at once.
        flush_count: Batch writes made to the store (each one transaction).
        publish_count: ``updated`` and ``message_delta`` events published.
        write_errors: Background writes that failed (logged and retried).

    Backpressure:
        None is needed: pending state is one entry per message id (the latest state replaces the
        previous one), so memory is bounded by the number of messages being streamed.
    """

    def __init__(
        self,
        store: MessageStore,
        publish: Publish,
        *,
        debounce: float = DEBOUNCE_SECONDS,
        write_window: float = WRITE_WINDOW_SECONDS,
        publish_delta: PublishDelta | None = None,
        batch: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
    ) -> None:
        for name, value in (("debounce", debounce), ("write_window", write_window)):
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        self._store = store
        self._publish = publish
        self._publish_delta = publish_delta
        #: Wraps the publishes of one moment (the windows that end together, a written batch):
        #: the broker's :meth:`~crush_trio.broker.Broker.batched`, so a client gets them in one
        #: write.
        self._batch = batch
        self._appends: dict[str, _Appends] = {}  # id -> appends since its last event
        self._debounce = debounce
        self._write_window = max(write_window, debounce)
        self._pending: dict[str, Message] = {}
        self._due: dict[str, float] = {}  # id -> trio time its window ends; insertion = due order
        self._inflight: dict[str, Message] = {}  # the batch being written, minus forgotten ids
        self._unpublished: dict[str, tuple[float, Message]] = {}  # id -> (due, latest state)
        self._last_publish: dict[str, float] = {}  # id -> trio time of its last event
        self._shapes: dict[str, tuple[str, Shape]] = {}  # id -> (session_id, last updated shape)
        self._write_lock = trio.Lock()
        self._wakeup = trio.Event()
        #: When the flusher's wait ends (inf: no deadline; -inf: it is not waiting, and looks
        #: at every deadline before it waits again). A new deadline wakes it only if earlier.
        self._sleep_until = -math.inf
        self._running = False
        # The read tick: the model streams that wait for the pass that publishes their message,
        # by message id; how many the current pass woke that have not taken in their read yet,
        # and the pass's number.
        self._readers: dict[str, trio.lowlevel.ParkingLot] = {}
        # The waiting streams whose bytes a pass may read and take in itself (ReadTick.take_in).
        self._takers: dict[str, ReadTick] = {}
        #: Reads a pass took in without waking their stream (for the benchmarks and tests).
        self.reads_taken = 0
        self._reading = 0
        self._collecting = False
        self._readers_back = trio.Event()
        self._pass = 0
        self.peak_pending = 0
        self.flush_count = 0
        self.publish_count = 0
        self.write_errors = 0

    @property
    def pending_count(self) -> int:
        """Messages whose latest state is not written yet."""
        return len(self._pending)

    # -- the flusher ---------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write each pending message when its debounce window ends; runs until cancelled.

        Signals ``task_status.started()`` at once. A failed write (StoreError) is logged, its
        state stays pending, and the task waits :data:`WRITE_RETRY_SECONDS` before going on.

        Cancellation:
            Ends the task. A write whose database work has started finishes and is published
            first; one still waiting for its turn is put back. Unwritten state stays pending for
            :meth:`flush_all`.
        """
        if self._running:
            raise RuntimeError("MessageService.run is already running; start it once per service")
        self._running = True
        try:
            task_status.started()
            while True:
                deadline = self._next_deadline()
                if deadline is None:
                    self._wakeup = trio.Event()
                    self._sleep_until = math.inf
                    try:
                        await self._wakeup.wait()
                    finally:
                        self._sleep_until = -math.inf
                    continue
                if deadline > trio.current_time():
                    # A new deadline may come before this one (a publish after a quiet window).
                    self._wakeup = trio.Event()
                    self._sleep_until = deadline
                    try:
                        with trio.move_on_at(deadline):
                            await self._wakeup.wait()
                    finally:
                        self._sleep_until = -math.inf
                    continue
                # The pass publishes what the streams it woke took in (the same horizon).
                now = trio.current_time()
                await self._wake_readers(now)
                self._publish_due(now)
                now = trio.current_time()
                if not any(due <= now for due in self._due.values()):
                    continue
                # One batch for everything pending, not one per message: with many streams the
                # writes (one thread hop each) would otherwise queue up and delay each other.
                due = list(self._pending)
                try:
                    await self._write(due)
                except StoreError as exc:
                    self.write_errors += 1
                    logger.error("writing %d buffered message(s) failed: %s", len(due), exc)
                    await trio.sleep(WRITE_RETRY_SECONDS)
        finally:
            self._running = False
            for lot in self._readers.values():  # no pass will wake them: they read now
                lot.unpark_all()
            self._readers.clear()
            self._takers.clear()

    # -- the API -------------------------------------------------------------------------------

    async def create(self, message: Message) -> None:
        """Publish ``created`` now; the row is inserted with the next batch (within the window,
        or at once by the next terminal change, :meth:`flush` or :meth:`flush_all`).

        Batches keep creation order, so rows are inserted in the order messages were created.
        Starting a turn therefore costs no database round trip of its own.
        """
        # The cancel check comes first: a cancelled create must not leave a message behind
        # that its caller never learned about. (No schedule point: a turn's start runs to its
        # model request in one step of its task.)
        await trio.lowlevel.checkpoint_if_cancelled()
        # Only assistant messages stream; others are complete when created, and tracking them
        # would grow with every turn.
        # Its ``created`` starts no publish window: the reply's first words go out as they come.
        if message.role is Role.ASSISTANT and message.finish() is None:
            self._shapes[message.id] = (message.session_id, shape_of(message))
        self._appends.pop(message.id, None)
        self._add_pending(message)
        self._publish(message, EventKind.CREATED)

    async def update(self, message: Message, append: MessageDelta | None = None) -> None:
        """Record the latest state of a message; publish it within the publish window (at once
        after a quiet window) and write it within the write window.

        ``append``: this change only appended ``append.text`` to one part (it is published as a
        ``message_delta`` when every change in the window was an append); None for any other
        change (the window publishes a snapshot).

        This is async because a terminal change (see :func:`is_terminal_change`) is written and
        published before it returns; any other update returns at once, without a checkpoint.
        The service keeps a reference to ``message``; the row is encoded when it is written, so a
        caller may keep mutating the same object between updates.

        Cancellation:
            A terminal write that had not started stays pending (the flusher or :meth:`flush_all`
            writes it); one that had started completes and is published first.
        """
        mid = message.id
        old = self._shapes.get(mid)
        if append is not None and old is not None:
            self._append(message, append)
            return
        shape = shape_of(message)
        terminal = is_terminal_change(old[1] if old else None, shape)
        if shape.finished:
            self._shapes.pop(mid, None)  # a finished message needs no baseline; keep memory flat
        else:
            self._shapes[mid] = (message.session_id, shape)
        self._add_pending(message)
        if terminal or append is None or self._publish_delta is None:
            self._appends[mid] = None
        else:
            self._add_append(mid, append)
        if terminal:
            # Published only after its write (never from memory: due at infinity); everything
            # pending goes with it, so rows keep their creation order.
            self._unpublished[mid] = (math.inf, message)
            await self._write(None)
            return
        self._schedule_publish(message)

    async def flush(self, message_id: str) -> None:
        """Write ``message_id`` now, with everything else pending (rows keep their creation
        order, so a message is never inserted before one created earlier); wait for any write
        in flight.

        Raises:
            StoreError: the write failed (the state stays pending).
        """
        if message_id in self._pending:
            await self._write(None)
        else:
            await self._wait_for_write()

    async def flush_all(self) -> None:
        """Write every pending message in one transaction and publish each; wait for any write
        in flight first.

        After it returns the store holds the latest state of every message passed to
        :meth:`update` before the call (except forgotten ones and those whose session is gone).
        Independent of the flusher task: safe to call after it was cancelled.

        Raises:
            StoreError: the write failed (the state stays pending).

        Cancellation:
            Cancelled before its write starts, the state stays pending; once the write has started
            it completes and is published, and ``Cancelled`` is raised afterwards. Never a torn or
            half-published batch. At shutdown call it inside
            ``trio.move_on_after(T, shield=True)``.
        """
        await self._write(None)

    async def flush_session(self, session_id: str) -> None:
        """Make the store hold the latest state of ``session_id``'s messages before a listing.

        Like :meth:`flush_all` (everything pending is written, rows keep their creation order)
        when one of the session's messages is pending; waits for the write in flight when one of
        them is being written; otherwise returns without touching the store, so starting a turn
        costs no write while other sessions stream.

        Raises:
            StoreError: the write failed (the state stays pending).
        """
        if any(m.session_id == session_id for m in self._pending.values()):
            await self._write(None)
        elif any(m.session_id == session_id for m in self._inflight.values()):
            await self._wait_for_write()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()

    async def forget(self, message_id: str) -> None:
        """Drop a message's pending state and wait for the write in flight.

        Call it before deleting the message's row so no later write can bring the row back.
        """
        self._drop(lambda m: m.id == message_id, [message_id])
        await self._wait_for_write()

    async def delete_session_messages(self, session_id: str) -> None:
        """Drop the pending state of a session's messages and wait for the write in flight.

        Call it when deleting the session (before or after the store's ``delete_session``; the
        store also skips writes for a deleted session). Publishes nothing: the deletion of the
        session is the event.
        """
        ids = [mid for mid, (sid, _) in self._shapes.items() if sid == session_id]
        self._drop(lambda m: m.session_id == session_id, ids)
        await self._wait_for_write()

    def can_append(self, message_id: str) -> bool:
        """Whether :meth:`append_nowait` takes an append to the message (its shape is known:
        it was created here and is not finished)."""
        return message_id in self._shapes

    def append_nowait(self, message: Message, append: MessageDelta) -> None:
        """:meth:`update` for an append to a message :meth:`can_append` takes, from code that
        cannot wait (a publish pass taking a stream's read in); the same effect, no checkpoint.

        Raises:
            ValueError: the message's shape is not known (ask :meth:`can_append` first).
        """
        if message.id not in self._shapes:
            raise ValueError(f"message {message.id!r} is not streaming here: use update()")
        self._append(message, append)

    def _append(self, message: Message, append: MessageDelta) -> None:
        # An append grows one part's text: the message's shape is unchanged, so the change
        # is not terminal and the baseline stays (no walk over the parts per chunk).
        mid = message.id
        self._add_pending(message)
        if self._publish_delta is None:
            self._appends[mid] = None
        else:
            self._add_append(mid, append)
        self._schedule_publish(message)

    def read_pacer(self, message_id: str) -> ReadTick:
        """The read tick of the model stream that streams into ``message_id``, for its body
        reader (:data:`crush_trio.providers.body.READ_PACER`); see :class:`ReadTick`."""
        return ReadTick(self, message_id)

    # -- internals -----------------------------------------------------------------------------

    def _streaming(self, message_id: str) -> bool:
        """Whether the message's next update will wait for a publish pass: one is held, or the
        last was published less than a window ago."""
        entry = self._unpublished.get(message_id)
        if entry is not None:
            return entry[0] != math.inf
        last = self._last_publish.get(message_id)
        return last is not None and trio.current_time() - last < self._debounce

    def _reader_due(self, message_id: str) -> float:
        """When the pass that publishes the message's next update comes: its held update's
        due time, else a window after its last event."""
        entry = self._unpublished.get(message_id)
        if entry is not None:
            return entry[0]
        return self._last_publish.get(message_id, -math.inf) + self._debounce

    async def _park_reader(self, message_id: str, taker: ReadTick | None = None) -> int:
        """Wait for the pass that publishes the message's next update (woken by it); its
        number. ``taker``: the passes may take the stream's reads in themselves meanwhile."""
        if self._reader_due(message_id) < self._sleep_until:
            self._wakeup.set()
        lot = self._readers.get(message_id)
        if lot is None:
            lot = self._readers[message_id] = trio.lowlevel.ParkingLot()
        if taker is not None:
            self._takers[message_id] = taker
        try:
            await lot.park()
        finally:
            if not lot and self._readers.get(message_id) is lot:
                del self._readers[message_id]  # cancelled while it waited
                self._takers.pop(message_id, None)
        return self._pass

    async def _wake_readers(self, now: float) -> None:
        """Take in the reads of the streams whose message this pass publishes (the same
        horizon as :meth:`_publish_due`) where the pass can (:meth:`ReadTick.take_in`); wake
        the others and give them up to :data:`READ_TICK_WAIT` to read and take in what arrived,
        so that this pass publishes it."""
        self._pass += 1
        if not self._readers:
            return
        horizon = now + self._debounce * ALIGN_FRACTION
        woken = taken = 0
        self._collecting = True  # what the pass takes in itself is published by it too
        try:
            for mid in [mid for mid in self._readers if self._reader_due(mid) <= horizon]:
                lot = self._readers[mid]
                taker = self._takers.get(mid)
                if taker is not None and lot and taker.take_in():
                    taken += 1
                    continue  # taken in: the stream goes on waiting, for the next pass
                del self._readers[mid]
                self._takers.pop(mid, None)
                woken += len(lot.unpark_all())
        finally:
            self._collecting = bool(woken)
            if taken:
                self.reads_taken += taken
                METRICS.provider_reads_taken.inc(taken)
        if not woken:
            return
        self._reading = woken
        self._readers_back = trio.Event()
        try:
            with trio.move_on_after(READ_TICK_WAIT):
                await self._readers_back.wait()
        finally:
            self._collecting = False
            self._reading = 0

    def _reader_back(self, woken: int) -> None:
        if woken == self._pass and self._reading > 0:
            self._reading -= 1
            if self._reading == 0:
                self._readers_back.set()

    def _schedule_publish(self, message: Message) -> None:
        mid = message.id
        entry = self._unpublished.get(mid)
        if entry is not None:
            self._unpublished[mid] = (entry[0], message)
            return
        now = trio.current_time()
        last = self._last_publish.get(mid)
        if last is None or now - last >= self._debounce:
            if self._collecting:  # a pass is taking in reads: it publishes them together
                self._unpublished[mid] = (now, message)
                return
            self._published(message, now)  # leading edge: nothing was shown for a window
            return
        due = last + self._debounce
        self._unpublished[mid] = (due, message)
        if due < self._sleep_until:
            self._wakeup.set()

    def _add_append(self, mid: str, append: MessageDelta) -> None:
        if mid not in self._appends:
            self._appends[mid] = {append.part: _Coalesced(append)}
            return
        appends = self._appends[mid]
        if appends is None:
            return  # a snapshot is due anyway
        pending = appends.get(append.part)
        if pending is None:
            appends[append.part] = _Coalesced(append)
        elif pending.end == append.offset and pending.delta.part_type == append.part_type:
            pending.texts.append(append.text)
            pending.end += len(append.text)
        else:  # not contiguous: the caller changed the part some other way
            self._appends[mid] = None

    def _published(self, message: Message, now: float) -> None:
        self._unpublished.pop(message.id, None)
        if message.id in self._shapes:
            self._last_publish[message.id] = now
        else:  # finished: no more windows to keep
            self._last_publish.pop(message.id, None)
        appends = self._appends.pop(message.id, None)
        if appends and self._publish_delta is not None:
            for pending in appends.values():
                self.publish_count += 1
                self._publish_delta(pending.joined(), message)
            return
        self.publish_count += 1
        self._publish(message, EventKind.UPDATED)

    def _publish_due(self, now: float) -> None:
        # Windows that end soon are ended now too, so the streams' windows fall into step and
        # one wake publishes many (each stream's next window starts now).
        horizon = now + self._debounce * ALIGN_FRACTION
        due = [message for when, message in self._unpublished.values() if when <= horizon]
        with self._batch():
            for message in due:
                self._published(message, now)

    def _next_deadline(self) -> float | None:
        # Write windows all have the same length, so the earliest is the first entry.
        deadline = next(iter(self._due.values()), None)
        if self._readers:  # streams wait for the pass that publishes their message
            tick = min(self._reader_due(mid) for mid in self._readers)
            deadline = tick if deadline is None else min(deadline, tick)
        if self._unpublished:
            publish = min(due for due, _ in self._unpublished.values())
            deadline = publish if deadline is None else min(deadline, publish)
        return deadline

    def _add_pending(self, message: Message) -> None:
        self._pending[message.id] = message
        if message.id not in self._due:
            due = self._due[message.id] = trio.current_time() + self._write_window
            if due < self._sleep_until:
                self._wakeup.set()
        self.peak_pending = max(self.peak_pending, len(self._pending))

    def _drop(self, match: Callable[[Message], bool], ids: Iterable[str]) -> None:
        for table in (self._pending, self._inflight):
            for mid in [mid for mid, m in table.items() if match(m)]:
                del table[mid]
        for mid in [mid for mid, (_, m) in self._unpublished.items() if match(m)]:
            del self._unpublished[mid]
        for mid in [mid for mid in self._appends if mid not in self._unpublished]:
            del self._appends[mid]
        for mid in ids:
            self._shapes.pop(mid, None)
            self._last_publish.pop(mid, None)
            self._appends.pop(mid, None)
        for mid in [mid for mid in self._due if mid not in self._pending]:
            del self._due[mid]

    async def _wait_for_write(self) -> None:
        async with self._write_lock:
            pass

    async def _write(self, ids: list[str] | None) -> None:
        """Write the pending state of ``ids`` (None: all) as one batch, then publish it."""
        async with self._write_lock:
            # Take the batch only now, so it is the newest state.
            if ids is None:
                ids = list(self._pending)
            batch: list[Message] = []
            for mid in ids:
                message = self._pending.pop(mid, None)
                self._due.pop(mid, None)
                if message is not None:
                    batch.append(message)
            if not batch:
                return
            self._inflight = {m.id: m for m in batch}
            try:
                try:
                    written = await self._store.write_messages(batch)
                except BaseException:
                    self._restore()
                    raise
                self.flush_count += 1
                now = trio.current_time()
                with self._batch():
                    for message in batch:
                        # Publish what no event has shown yet; skip rows the store did not
                        # write (session gone) and messages forgotten while the write ran.
                        if (
                            message.id in self._unpublished
                            and message.id in written
                            and message.id in self._inflight
                        ):
                            self._published(message, now)
            finally:
                self._inflight = {}

    def _restore(self) -> None:
        """Put an unwritten batch back, unless newer state arrived or it was forgotten."""
        for mid, message in self._inflight.items():
            if mid not in self._pending:
                self._add_pending(message)


class ReadTick:
    """When a model stream reads its connection: at the publish passes while it streams.

    A paced reply's tokens arrive one by one, each a wake of the event loop, an ``epoll``
    re-arm and a read; yet what a client sees changes only at the publish passes, at most one a
    window (:data:`DEBOUNCE_SECONDS`). While the message streams (an update is held for a
    pass, or one went out less than a window ago) its stream waits for the next pass instead
    of for its socket (:meth:`before_read`); the pass wakes every waiting stream at once, gives
    them up to :data:`READ_TICK_WAIT` to read what arrived meanwhile (several tokens in one
    read) and take it in, then publishes. A read that finds nothing (the model paused) makes
    the next wait one for the socket (:meth:`read_empty`), as does a quiet message and the
    stream's first read. Nothing is read later than it would be published anyway.

    A pass need not wake the stream at all: when the stream's reader can be read without
    waiting (a plain socket) and its layers have set their stages of :attr:`fold`, the pass
    reads the socket itself and takes what arrived in through them (:meth:`take_in`), and the
    reader goes on waiting. It wakes the reader for everything else, with what it read
    (:meth:`taken`): nothing, the connection's end, an error, or bytes that are not plain text
    whole in their read (a step's end, a tool call, usage, a chunk split across reads).

    The stream's consumer makes one per stream and calls :meth:`close` when the stream ends.
    """

    __slots__ = ("_id", "_read_now", "_service", "_skip", "_taken", "_woken", "fold")

    def __init__(self, service: MessageService, message_id: str) -> None:
        self._service = service
        self._id = message_id
        self._woken: int | None = None
        # The first read waits for the socket: the reply's first words go out as they come.
        self._skip = True
        self._read_now: Callable[[], bytes] | None = None
        self._taken: bytes | Exception | None = None
        #: The stages through which a pass takes this stream's reads in itself.
        self.fold = ReadFold()

    async def before_read(self, read_now: Callable[[], bytes] | None = None) -> bool:
        """Called before each read of the connection: waits for the next publish pass while
        the message streams. True: it waited (the data is likely there, read before waiting
        for the socket). ``read_now``: the passes may read the connection meanwhile (see the
        class)."""
        service = self._service
        self.close()
        self._taken = None
        if self._skip:
            self._skip = False
            return False
        if not service._running or not service._streaming(self._id):
            return False
        self._read_now = read_now
        try:
            self._woken = await service._park_reader(self._id, self if read_now else None)
        finally:
            self._read_now = None
        return True

    def taken(self) -> bytes | Exception | None:
        """What the pass that woke the stream read and did not take in: bytes, ``b""`` (the
        connection's end) or the read's error; None: nothing (read the socket)."""
        taken, self._taken = self._taken, None
        return taken

    def take_in(self) -> bool:
        """Called by a pass in place of waking the stream: read its socket and take what
        arrived in through :attr:`fold`. True: taken in, the stream goes on waiting; False:
        wake it (:meth:`taken` holds what was read)."""
        read_now = self._read_now
        if read_now is None or not self.fold.can_take():
            return False  # the reader reads its socket itself
        try:
            data = read_now()
        except BlockingIOError:
            return False  # the model paused: the stream reads again, then waits for its socket
        except OSError as exc:
            self._taken = exc
            return False
        if not data:
            self._taken = data
            return False
        try:
            if self.fold.run(data):
                return True
        except Exception as exc:  # a stage failed: the stream reports it as its read's error
            self._taken = exc
            return False
        self._taken = data
        return False

    def read_empty(self) -> None:
        """The read after a pass found nothing: the next one waits for the socket."""
        self._skip = True

    def close(self) -> None:
        """This stream took in its read (or ended): the pass that woke it need not wait."""
        if self._woken is not None:
            self._service._reader_back(self._woken)
            self._woken = None
