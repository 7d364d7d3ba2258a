"""One subscriber's stream: the Trio shell around its :class:`~.outbox.Outbox`.

:class:`ClientStream` is the broker's handle on a client: the outbox decides (queue, drop into a
gap, wait, too slow) and this adds the waits for room under the broker's bound, the kill that
disconnects a slow client, and the metrics.

The **handoff** to the client's writer task is the outbox's deque (filled by
:meth:`~.outbox.Outbox.put_nowait`, emptied by :meth:`~.outbox.Outbox.take`), the hook that wakes
the writer (:meth:`ClientStream._wake_writer`) and :class:`ClientQueue`, the end the writer
drains: the only code between a queued frame and the transport's writer task.

The **direct write**: while a client's writer is idle (it holds no frame taken from the queue
and not yet written), a transport that can write without waiting (:attr:`ClientStream.send_now`,
set only while its writer is idle) gets each new frame at once, in the publisher's task, so a
client that keeps up costs no task switch per frame. What the socket does not take at once stays
with the transport, and a :data:`~.framing.FLUSH` item wakes the writer to send it before
anything else. Within a batch of publishes (:meth:`.fanout.Broker.batched`), a client's first
frame goes out at once and the rest are held for one write at the batch's end
(:meth:`ClientStream.release_held`).

A **writer on demand**: a transport whose writer task exists only while there is something to
write (:attr:`ClientStream.start_writer`) is called when an item goes into the empty queue and
no writer waits for it, and when the stream closes (so its writer sees the end), instead of
keeping a task parked on the queue for the connection's life.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Final, Protocol

import trio

from ..defaults import DEFAULT_CLIENT_QUEUE_BYTES
from ..errors import WS_CLOSE_TRY_AGAIN_LATER
from ..metrics import METRICS
from .framing import FLUSH, Event, Gap
from .outbox import Outbox

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence

log = logging.getLogger("crush_trio.broker")

TOO_SLOW_REASON: Final = "too slow"

#: What :attr:`ClientStream.send_now` answers: it did not take the frame (queue it) ...
NOT_SENT: Final = 0
#: ... it wrote the whole frame ...
SENT: Final = 1
#: ... or it took the frame but wrote only part of it: the rest is held by the transport, and
#: the writer must send it (a :data:`~.framing.FLUSH` item) before anything else.
SENT_IN_PART: Final = 2


class Broker(Protocol):
    """What a client's stream needs of its workspace's fan-out (:class:`.fanout.Broker`): the
    shared counters, the must-deliver bound, the latest sequence number for a gap, and the calls
    that report a full queue and a client that leaves."""

    dropped: int
    killed: int
    must_deliver_timeout: float
    #: While a batch of publishes is on (:meth:`.fanout.Broker.batched`, or a tick): the
    #: clients holding frames for one write at its end; None otherwise.
    batch: list[ClientStream] | None

    @property
    def latest_seq(self) -> int: ...

    def open_tick(self) -> list[ClientStream] | None: ...

    def client_full(self, client: ClientStream) -> None: ...

    def unsubscribe(self, client: ClientStream) -> None: ...


class ClientQueue:
    """The writer's end of a client's queue: what the transport's writer task drains.

    Same interface as a trio memory receive channel (``receive``, ``receive_nowait``, ``async
    for``; :class:`trio.EndOfChannel` once closed and drained) so each transport's writer task
    drains it the same way. One reader at a time.
    """

    __slots__ = ("_stream",)

    def __init__(self, stream: ClientStream) -> None:
        self._stream = stream

    def __len__(self) -> int:
        return len(self._stream.items)

    @property
    def bytes(self) -> int:
        """Bytes of the queued frames."""
        return self._stream.bytes

    @property
    def size(self) -> int:
        return self._stream.size

    @property
    def max_bytes(self) -> int:
        return self._stream.max_bytes

    @property
    def closed(self) -> bool:
        return self._stream.closed

    @property
    def full(self) -> bool:
        return self._stream.full

    def receive_nowait(self) -> Event:
        stream = self._stream
        event = stream.take()
        if event is not None:
            return event
        if stream.closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    async def receive(self) -> Event:
        """The next item (a checkpoint, like a memory channel's; one reader at a time).

        The item is taken after the last checkpoint, never before one: a writer must not hold
        an item across a yield, because the queue looks empty meanwhile and the broker's direct
        write (:attr:`ClientStream.send_now`, which a transport such as SSE leaves set while its
        writer waits here) would send the next frame ahead of it.
        """
        await trio.lowlevel.checkpoint()  # cancelled here: nothing was taken
        while True:
            try:
                return self.receive_nowait()
            except trio.WouldBlock:
                await self._stream.readers().park()  # cancelled here: nothing was taken

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None


class ClientStream(Outbox):
    """One subscriber: a bounded queue of frames plus its drop accounting.

    Backpressure: the queue holds ``size`` events and ``max_bytes`` bytes. Lossy events are
    dropped and counted when it is full (a :class:`~.framing.Gap` is recorded and queued as soon
    as there is room); must-deliver events and command replies wait for room up to the broker's
    bound, then the client is killed (``killed`` is set, ``kill_reason`` says why) and the
    transport closes it with 1013. The writer drains :attr:`receive`.
    """

    __slots__ = (
        "_held",
        "_killed",
        "_md_lock",
        "_readers",
        "_room",
        "broker",
        "client_id",
        "kill_code",
        "kill_reason",
        "metrics",
        "on_kill",
        "receive",
        "send_now",
        "start_writer",
    )

    def __init__(
        self,
        broker: Broker,
        size: int,
        *,
        client_id: str = "",
        max_bytes: int = DEFAULT_CLIENT_QUEUE_BYTES,
        deltas: bool = False,
        transport: str = "other",
    ) -> None:
        super().__init__(size, max_bytes, deltas=deltas, clock=trio.current_time)
        self.broker = broker
        self.client_id = client_id
        #: This transport's metrics (drops, gaps, kills, open streams).
        self.metrics = METRICS.transport(transport)
        #: A writer waiting on the empty queue; made by the first that waits (:meth:`readers`:
        #: a writer on demand never waits, see :attr:`start_writer`).
        self._readers: trio.lowlevel.ParkingLot | None = None
        #: Producers waiting for room; made by the first that waits.
        self._room: trio.lowlevel.ParkingLot | None = None
        #: The writer's end of the queue.
        self.receive = ClientQueue(self)
        #: Serializes must-deliver waits; made by the first (:meth:`_must_deliver_lock`).
        self._md_lock: trio.Lock | None = None
        #: :attr:`killed`, once asked for or set (an idle client holds no event).
        self._killed: trio.Event | None = None
        self.kill_reason = ""
        self.kill_code = WS_CLOSE_TRY_AGAIN_LATER
        #: Called once when the client is killed (a transport cancels its writer with it).
        self.on_kill: Callable[[], object] | None = None
        #: Set by a transport that can write frames without waiting, only while its writer is
        #: idle (holds no frame taken from the queue and not yet written): called with each frame
        #: for the empty queue (or with the frames a batch held, :meth:`release_held`) to write
        #: in one write; answers :data:`NOT_SENT`, :data:`SENT` or :data:`SENT_IN_PART`
        #: (never raises, never blocks).
        self.send_now: Callable[[Sequence[Event]], int] | None = None
        #: Set by a transport whose writer runs on demand: called (never blocks) when an item goes
        #: into the empty queue while no writer waits on it, and when the stream closes; starts
        #: the writer unless it runs already.
        self.start_writer: Callable[[], object] | None = None
        #: Frames held for one write at the end of a batch (:meth:`release_held`); None when
        #: none is on for this client.
        self._held: list[Event] | None = None

    @property
    def killed(self) -> trio.Event:
        """Set once the client is killed (:meth:`kill`); the transport then closes it with
        :attr:`kill_code` and :attr:`kill_reason`."""
        killed = self._killed
        if killed is None:
            killed = self._killed = trio.Event()
        return killed

    @property
    def is_killed(self) -> bool:
        """:attr:`killed` is set (without making the event)."""
        killed = self._killed
        return killed is not None and killed.is_set()

    def readers(self) -> trio.lowlevel.ParkingLot:
        """Where a writer waits for the empty queue (made by the first that waits)."""
        readers = self._readers
        if readers is None:
            readers = self._readers = trio.lowlevel.ParkingLot()
        return readers

    # -- the handoff: write at once, or wake the writer --------------------------------------

    def _send_now(self, item: Event) -> bool:
        send_now = self.send_now
        # Set only while the writer is idle: it holds no frame taken from the queue and not yet
        # written, which this one would overtake.
        if send_now is None:
            return False
        held = self._held
        if held is not None:  # a batch's first frame went out whole: the rest go at its end
            if item.type != "reply":
                held.append(item)
                return True
            # A command's reply: what was held before it goes now, then the reply. The frames of
            # a connection that takes batches are split at its replies; written now, before the
            # other connections' frames of the batch, this connection's split frames are the ones
            # compressed first, and the others' frames join their compressed pieces
            # (BoundedDeflate.frame_lines) rather than this one leaving their compressor.
            self.release_held()
            if self.items:  # the socket did not take them all: the reply is queued behind them
                return False
            return self._send_now(item)
        done = send_now((item,))
        if done == NOT_SENT:
            return False
        if done == SENT_IN_PART:
            self.items = collections.deque((FLUSH,))
            self._wake_writer()
            return True
        broker = self.broker
        batch = broker.batch if broker.batch is not None else broker.open_tick()
        if batch is not None:
            self._held = []
            batch.append(self)
        return True

    def release_held(self) -> None:
        """A batch of publishes ended (:meth:`.fanout.Broker.batched`, or a tick of the loop,
        :meth:`.fanout.Broker.coalesce_ticks`): write the frames held since its first, in one
        write. The socket usually takes them at once (its first frame went out whole a moment
        ago); if it does not, they are queued in order for the writer (an overshoot of the
        queue's bounds by at most one batch: what the loop's tasks published in one round)."""
        held, self._held = self._held, None
        if not held or self.closed:
            return
        send_now = self.send_now
        done = NOT_SENT if send_now is None else send_now(held)
        if done == SENT:
            return
        # Nothing was queued meanwhile: every frame since the first was held.
        if done == SENT_IN_PART:
            self.items = collections.deque((FLUSH,))
        else:
            self.items = collections.deque(held)
            self.bytes += sum(item.size for item in held)
        self._wake_writer()

    def _wake_writer(self) -> None:
        readers = self._readers
        if readers:
            readers.unpark()
        elif self.start_writer is not None:
            self.start_writer()

    def _room_made(self) -> None:
        if self._room is not None:
            self._room.unpark_all()

    # -- the outbox's other hooks -------------------------------------------------------------

    def _stalled(self) -> None:
        self.broker.client_full(self)

    def _dropped_one(self) -> None:
        self.metrics.dropped.inc()
        self.broker.dropped += 1

    def _gap_sent(self) -> None:
        self.metrics.gaps.inc()

    def _gap_frame(self, gap: Gap) -> Event:
        return gap.frame(self.broker.latest_seq)

    # -- waits for room -----------------------------------------------------------------------

    async def _put_waiting(self, item: Event) -> None:
        """Wait for room (or the close), then queue ``item`` (the caller bounds the wait)."""
        while not self.closed and not self.fits(item.size):
            if self._room is None:
                self._room = trio.lowlevel.ParkingLot()
            await self._room.park()
        if not self.put_nowait(item):  # pragma: no cover - room was just checked
            raise AssertionError("no room after waiting for room")

    def _must_deliver_lock(self) -> trio.Lock:
        if self._md_lock is None:
            self._md_lock = trio.Lock()
        return self._md_lock

    async def deliver(self, event: Event, *, reserved: bool = False) -> None:
        """Wait for room for a must-deliver event (the caller bounds the wait).

        ``reserved``: :meth:`reserve_delivery` was called for this event already.

        Cancellation: if cancelled while waiting the event was not queued; the caller then kills
        this client.
        """
        if not reserved:
            self.reserve_delivery()
        started = trio.current_time()
        try:
            async with self._must_deliver_lock():
                gap = self.gap
                if gap is not None:
                    # Detach the gap before waiting: drops during the wait start a new one.
                    self.gap = None
                    await self._put_waiting(self._gap_frame(gap))
                    self.gaps += 1
                    self._gap_sent()
                await self._put_waiting(event)
        finally:
            self.release_delivery()
            METRICS.must_deliver_wait.observe(trio.current_time() - started)
        self.after_receive()  # lossy events dropped while it waited

    async def send_reply(self, frame: Event) -> None:
        """Queue a command reply: waits for room (backpressure on the client's commands) for at
        most ``must_deliver_timeout``; a client that still has no room is killed (1013)."""
        if self.closed:
            return
        if self.try_deliver_nowait(frame):
            await trio.lowlevel.checkpoint()
            return
        self.reserve_delivery(must_deliver=False)
        try:
            with trio.move_on_after(self.broker.must_deliver_timeout) as waited:
                async with self._must_deliver_lock():
                    await self._put_waiting(frame)
        finally:
            self.release_delivery()
        if waited.cancelled_caught and not self.closed:
            self.broker.killed += 1
            self.kill(TOO_SLOW_REASON)
            return
        self.after_receive()

    # -- the end ------------------------------------------------------------------------------

    def kill(self, reason: str, code: int = WS_CLOSE_TRY_AGAIN_LATER) -> None:
        """Disconnect this client (by default: it could not take a must-deliver event in time);
        the transport closes it with ``code`` and ``reason``. What was queued is dropped."""
        if not self.is_killed:
            self.kill_reason = reason
            self.kill_code = code
            if reason == TOO_SLOW_REASON:
                self.metrics.killed.inc()
            on_kill, self.on_kill = self.on_kill, None
            if on_kill is not None:
                on_kill()
            log.warning(
                "disconnecting client %s: %s (queue %d/%d events, %d/%d bytes)",
                self.client_id or "?",
                reason,
                len(self.items),
                self.size,
                self.bytes,
                self.max_bytes,
            )
            self.killed.set()
        self.close()
        self.clear()

    def close(self) -> None:
        """End the stream: the writer finishes what is queued, then gets
        :class:`trio.EndOfChannel`."""
        if not self.closed:
            super().close()
            if self._readers:
                self._readers.unpark_all()
            elif self.start_writer is not None:
                self.start_writer()  # the writer on demand sees the end
            if self._room is not None:
                self._room.unpark_all()
            self.broker.unsubscribe(self)
