"""Event brokers: sequencing, encoding once, replay, and per-client bounded delivery.

One :class:`Broker` per workspace. Publishing an event gives it the next ``seq``, encodes its
envelope **once** (the same ``str``/``bytes`` objects are shared by every client and the replay
buffer), stores it in a bounded replay buffer, and offers it to every :class:`ClientStream`.

Delivery classes (PROTOCOL §5):

* **lossy** (``session``, ``message``, ``agent_event``): :meth:`Broker.publish` is synchronous and
  never waits. A client whose queue is full misses the event; the miss is counted and the client
  gets a ``gap`` frame, in order, as soon as its queue has room again.
* **must-deliver** (``run_complete``, ``permission_*``): :meth:`Broker.publish_must_deliver` waits
  for room in every client's queue, all clients concurrently, for at most
  ``must_deliver_timeout`` seconds in total. A client that still has no room is disconnected
  (:attr:`ClientStream.killed` is set; the transport closes it with 1013 ``too slow``), never
  silently skipped. Replies to websocket commands wait the same way, under the same bound.

Each client's queue is bounded by events (``client_queue_size``) and by bytes of encoded frames
(``client_queue_bytes``); one item larger than the byte bound still fits into an empty queue. A
client whose queue stays full for ``must_deliver_timeout`` without taking anything is
disconnected too, even while nothing must be delivered (:meth:`Broker.watch_stalled`), so a
client that stops reading cannot pin its queue while the workspace is idle.

Message deltas (PROTOCOL §6): a streaming append is one change with one ``seq`` and two
encodings. :meth:`Broker.publish_delta` encodes the ``message_delta`` form for clients that asked
for deltas (``?deltas=1``) and the ``message`` ``updated`` snapshot form for the others, each once,
shared by every client of that mode. The snapshot form is encoded only while a snapshot-mode client
is connected; a snapshot-mode client that resumes across a change whose snapshot form was never
encoded gets a ``gap`` for it instead (these events are lossy; it re-reads the messages). The
replay buffer's byte bound counts both forms.

The broker never touches a socket: each transport runs one writer task per connection that drains
the client's queue (see ``server/connection.py``).

With an event log (cluster mode, :mod:`crush_trio.eventlog`), an event reaches clients only after
the log accepted it, so any ``seq`` a client saw can be replayed from any node. Publishing still
assigns the ``seq`` and encodes at once (and never blocks for lossy events), but queues the event
for :meth:`Broker.write_log`: one task that appends everything queued since its last append in one
batch (a publish window: the events published while the previous append was in flight), then puts
the batch into the replay buffer and offers it to the clients, in order. A must-deliver publish
returns once its event was appended and delivered. A resume from further back than the replay
buffer reads the log (:meth:`Broker.subscribe_resuming`). When the log refuses an append because
a newer owner fenced it (:class:`~crush_trio.eventlog.Fenced`), or stays unavailable for
``log_append_timeout``, nothing queued reaches anybody: every client is closed with 1012 (they
reconnect, with ``since``, to whichever node owns the workspace now), later publishes are
dropped, and ``on_log_lost`` tells the owner so the workspace stops. Without a log (embedded
mode) none of this runs: publishing fans out synchronously, as it always did.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Final

import attrs
import orjson
import trio

from . import wire
from .errors import WS_CLOSE_SERVICE_RESTART, WS_CLOSE_TRY_AGAIN_LATER, CrushError
from .eventlog import EventLog, EventLogError, Fenced
from .metrics import METRICS
from .wire import EventKind

log = logging.getLogger(__name__)

#: Default capacity of each client's queue (events). Full → lossy drops, must-deliver waits.
DEFAULT_CLIENT_QUEUE_SIZE: Final = 1024
#: Default bound on the bytes of encoded frames (events and command replies) in a client's queue.
DEFAULT_CLIENT_QUEUE_BYTES: Final = 8 * 1024 * 1024
#: Default number of events kept for resume by ``since`` / ``Last-Event-ID``.
DEFAULT_REPLAY_BUFFER: Final = 4096
#: Default bound on the bytes of encoded events in the replay buffer.
DEFAULT_REPLAY_BYTES: Final = 8 * 1024 * 1024
#: Default bound on how long a must-deliver publish waits for slow clients (seconds).
DEFAULT_MUST_DELIVER_TIMEOUT: Final = 2.0

#: Default bound on how long the log may refuse or delay one batch before the broker gives it up
#: (seconds; retried meanwhile).
DEFAULT_LOG_APPEND_TIMEOUT: Final = 10.0
#: Pause between two attempts of a failed append (seconds).
LOG_RETRY_DELAY: Final = 0.1
#: Most events one append carries (a longer queue is sent in several appends).
LOG_BATCH_MAX: Final = 1000
#: Events one log read asks for when a resume reaches back past the replay buffer.
LOG_READ_PAGE: Final = 1000

TOO_SLOW_REASON: Final = "too slow"
#: Close reasons (with 1012) of the clients of a broker whose log was lost: fenced by a newer
#: owner, or unavailable for ``log_append_timeout``. Clients reconnect and resume with ``since``.
LOG_FENCED_REASON: Final = "workspace moved to another node: event log fenced"
LOG_UNAVAILABLE_REASON: Final = "workspace moved to another node: event log unavailable"
#: Upper bound on the bytes of one ``gap`` frame (four integers and the envelope).
GAP_FRAME_BYTES: Final = 160


def utf8_len(text: str) -> int:
    """Bytes of ``text`` encoded as UTF-8 (without encoding it when it is ASCII)."""
    return len(text) if text.isascii() else len(text.encode())


class Event:
    """One published event, encoded once and shared by every client.

    ``text`` is the envelope JSON (a websocket text frame); :attr:`sse` is the SSE block, built on
    first use and cached. ``size`` is the UTF-8 length of ``text``: what the queue and replay
    byte bounds count.

    A ``message_delta`` event has ``is_delta`` set and carries the same change's ``message``
    snapshot form in ``snapshot`` (None when it was not encoded: no snapshot-mode client was
    connected when it was published).
    """

    __slots__ = (
        "_frame",
        "_sse",
        "is_delta",
        "must_deliver",
        "seq",
        "size",
        "snapshot",
        "text",
        "type",
    )

    def __init__(
        self, seq: int, type: str, text: str, must_deliver: bool, size: int | None = None
    ) -> None:
        self.seq = seq
        self.type = type
        self.text = text
        self.must_deliver = must_deliver
        self.size = utf8_len(text) if size is None else size
        self._sse: bytes | None = None
        self._frame: bytes | None = None
        self.is_delta = False
        self.snapshot: Event | None = None

    def form_for(self, deltas: bool) -> Event | None:
        """The form a client in this mode gets: None when it was not encoded (a gap)."""
        if self.is_delta and not deltas:
            return self.snapshot
        return self

    @property
    def ws_frame(self) -> bytes:
        """The websocket text frame (server to client: unmasked), built on first use."""
        if self._frame is None:
            self._frame = websocket_text_frame(self.text)
        return self._frame

    @property
    def sse(self) -> bytes:
        if self._sse is None:
            self._sse = f"id: {self.seq}\ndata: {self.text}\n\n".encode()
        return self._sse

    def __repr__(self) -> str:
        return f"<Event seq={self.seq} type={self.type}>"


def _replay_size(event: Event) -> int:
    """Bytes an event holds in the replay buffer: both forms of a delta change."""
    snapshot = event.snapshot
    return event.size if snapshot is None else event.size + snapshot.size


def log_record(event: Event) -> bytes:
    """An event as the log keeps it: its envelope, and for a delta change whose snapshot form was
    encoded, a newline and that form (compact JSON holds no raw newline)."""
    data = event.text.encode()
    snapshot = event.snapshot
    if snapshot is not None:
        data += b"\n" + snapshot.text.encode()
    return data


def event_from_log(seq: int, data: bytes) -> Event:
    """The :class:`Event` of a log record (see :func:`log_record`)."""
    text, _, snapshot = data.partition(b"\n")
    ptype = wire.PayloadType(orjson.loads(text)["type"])
    event = Event(seq, ptype.value, text.decode(), ptype.must_deliver, len(text))
    if ptype is wire.PayloadType.MESSAGE_DELTA:
        event.is_delta = True
        if snapshot:
            event.snapshot = Event(
                seq, wire.PayloadType.MESSAGE.value, snapshot.decode(), False, len(snapshot)
            )
    return event


def _widen(gap: Gap | None, first: int, last: int) -> Gap:
    """``gap`` extended by the missing seqs ``first..last`` (they follow it)."""
    if gap is None:
        return Gap(last - first + 1, first, last)
    gap.dropped += last - first + 1
    gap.to_seq = last
    return gap


def websocket_text_frame(text: str) -> bytes:
    """One final, unmasked text frame (RFC 6455 §5.2) carrying ``text``."""
    payload = text.encode()
    size = len(payload)
    if size < 126:
        header = bytes((0x81, size))
    elif size < 1 << 16:
        header = bytes((0x81, 126)) + size.to_bytes(2, "big")
    else:
        header = bytes((0x81, 127)) + size.to_bytes(8, "big")
    return header + payload


def connection_frame(seq: int, type: str, payload: dict[str, Any]) -> Event:
    """A frame of one connection (``hello``, ``gap``): it repeats the latest seq, takes none."""
    text = orjson.dumps({"seq": seq, "type": type, "payload": payload}).decode()
    return Event(seq, type, text, must_deliver=False)


@attrs.define
class Gap:
    """Events a client missed: ``dropped`` of them between ``from_seq`` and ``to_seq``."""

    dropped: int
    from_seq: int
    to_seq: int

    def extend(self, seq: int) -> None:
        self.dropped += 1
        self.to_seq = seq

    def frame(self, latest_seq: int) -> Event:
        return connection_frame(
            latest_seq,
            "gap",
            {"dropped": self.dropped, "from_seq": self.from_seq, "to_seq": self.to_seq},
        )


#: The items of every empty :class:`ClientQueue`: a shared deque that can hold nothing, so an
#: idle client holds no deque of its own (760 bytes each; a queue allocates one when an item
#: arrives and lets it go once drained). Only :meth:`ClientQueue.put_nowait` appends, and it
#: replaces this first.
_NO_ITEMS: Final[collections.deque[Event]] = collections.deque(maxlen=0)


class ClientQueue:
    """The receiving side of a client's queue, bounded by events and by bytes.

    Same interface as a trio memory receive channel (``receive``, ``receive_nowait``, ``async
    for``; :class:`trio.EndOfChannel` once closed and drained) so each transport's writer task
    drains it the same way.
    """

    __slots__ = (
        "_items",
        "_readers",
        "_room",
        "bytes",
        "closed",
        "full_since",
        "max_bytes",
        "size",
    )

    def __init__(self, size: int, max_bytes: int) -> None:
        # Allocated by the first put, released when drained (see :data:`_NO_ITEMS`).
        self._items: collections.deque[Event] = _NO_ITEMS
        self.size = size
        self.max_bytes = max_bytes
        self.bytes = 0
        self.closed = False
        #: When the queue became full, or last gave an item while full; None while not full.
        self.full_since: float | None = None
        self._readers = trio.lowlevel.ParkingLot()
        #: Producers waiting for room; made by the first that waits.
        self._room: trio.lowlevel.ParkingLot | None = None

    def __len__(self) -> int:
        return len(self._items)

    def fits(self, size: int) -> bool:
        """Room for one more item of ``size`` bytes (an empty queue takes any one item)."""
        items = self._items
        return not items or (len(items) < self.size and self.bytes + size <= self.max_bytes)

    def fits_two(self, first: int, second: int) -> bool:
        """Room for two more items, of ``first`` then ``second`` bytes."""
        items = self._items
        if not items:
            return True
        return len(items) + 2 <= self.size and self.bytes + first + second <= self.max_bytes

    @property
    def full(self) -> bool:
        return len(self._items) >= self.size or self.bytes >= self.max_bytes

    def put_nowait(self, event: Event) -> bool:
        if not self.fits(event.size):
            return False
        if self._items is _NO_ITEMS:
            self._items = collections.deque()
        self._items.append(event)
        self.bytes += event.size
        if self._readers:
            self._readers.unpark()
        return True

    async def wait_room(self, size: int) -> None:
        """Wait until an item of ``size`` bytes fits, or the queue closes."""
        while not self.closed and not self.fits(size):
            if self._room is None:
                self._room = trio.lowlevel.ParkingLot()
            await self._room.park()

    def clear(self) -> None:
        self._items = _NO_ITEMS
        self.bytes = 0

    def close(self) -> None:
        self.closed = True
        self._readers.unpark_all()
        if self._room is not None:
            self._room.unpark_all()

    def receive_nowait(self) -> Event:
        if self._items:
            event = self._items.popleft()
            if not self._items:
                self._items = _NO_ITEMS
            self.bytes -= event.size
            if self._room:
                self._room.unpark_all()
            if self.full_since is not None:  # the client makes progress: restart its bound
                self.full_since = trio.current_time() if self.full else None
            return event
        if self.closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    async def receive(self) -> Event:
        """The next item (a checkpoint, like a memory channel's; one reader at a time)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            event = self.receive_nowait()
        except trio.WouldBlock:
            pass
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return event
        while True:
            await self._readers.park()  # cancelled here: nothing was taken
            try:
                return self.receive_nowait()
            except trio.WouldBlock:
                continue

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None


class ClientStream:
    """One subscriber: a bounded queue of frames plus its drop accounting.

    Backpressure: the queue holds ``size`` events and ``max_bytes`` bytes. Lossy events are
    dropped and counted when it is full (a :class:`Gap` is recorded and queued as soon as there is
    room); must-deliver events and command replies wait for room up to the broker's bound, then
    the client is killed (``killed`` is set, ``kill_reason`` says why) and the transport closes it
    with 1013. The writer drains :attr:`receive`.
    """

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
        self.broker = broker
        self.client_id = client_id
        #: This transport's metrics (drops, gaps, kills, open streams).
        self.metrics = METRICS.transport(transport)
        #: Whether this client gets ``message_delta`` events (else their ``message`` snapshots).
        self.deltas = deltas
        self.receive = ClientQueue(size, max_bytes)
        self.size = size
        self.dropped = 0
        self.must_deliver_waits = 0
        self.peak_depth = 0
        self.peak_bytes = 0
        self._gap: Gap | None = None
        #: Serializes must-deliver waits; made by the first (:meth:`_must_deliver_lock`).
        self._md_lock: trio.Lock | None = None
        self._md_waiting = 0
        self.killed = trio.Event()
        self.kill_reason = ""
        self.kill_code = WS_CLOSE_TRY_AGAIN_LATER
        #: Called once when the client is killed (a transport cancels its writer with it).
        self.on_kill: Callable[[], object] | None = None
        self.closed = False

    # -- producer side (the broker) ------------------------------------------------------------

    def _depth(self) -> int:
        return len(self.receive)

    @property
    def full_since(self) -> float | None:
        """Since when the queue has been full without the client taking anything."""
        return self.receive.full_since

    def _mark_full(self) -> None:
        if self.receive.full_since is None and not self.closed:
            self.receive.full_since = trio.current_time()
            self.broker._stalled_client(self)

    def _push_nowait(self, event: Event) -> bool:
        if self.closed:
            return True  # the stream is going away; nothing more to deliver to it
        queue = self.receive
        if not queue.put_nowait(event):
            self._mark_full()
            return False
        depth = len(queue)
        if depth > self.peak_depth:
            self.peak_depth = depth
        if queue.bytes > self.peak_bytes:
            self.peak_bytes = queue.bytes
        if queue.full:
            self._mark_full()
        return True

    async def _push_waiting(self, event: Event) -> None:
        """Wait for room, then queue ``event`` (the caller bounds the wait)."""
        await self.receive.wait_room(event.size)
        if not self._push_nowait(event):  # pragma: no cover - room was just checked
            raise AssertionError("no room after waiting for room")

    def _flush_gap_nowait(self) -> bool:
        """Queue the pending gap frame if there is room; True when nothing is pending."""
        if self._gap is None:
            return True
        if self._push_nowait(self._gap.frame(self.broker.latest_seq)):
            self._gap = None
            self.metrics.gaps.inc()
            return True
        return False

    def offer(self, event: Event) -> None:
        """Offer a lossy event: queue it now or drop and count it.

        A delta change is queued in this client's form; one whose form was not encoded counts as
        a drop (the client gets a ``gap``).
        """
        if self.closed:
            return
        form = event.form_for(self.deltas) if event.is_delta else event
        if form is None:
            self._drop(event.seq)
            return
        event = form
        # While a must-deliver event waits for this client, later lossy events would overtake
        # it; drop them into the gap instead so the client sees events in seq order. A pending
        # gap goes out only with the event behind it, so gap frames cannot fill the queue.
        if (
            self._md_waiting == 0
            and (self._gap is None or self.receive.fits_two(GAP_FRAME_BYTES, event.size))
            and self._flush_gap_nowait()
            and self._push_nowait(event)
        ):
            return
        self._drop(event.seq)

    def _drop(self, seq: int) -> None:
        self.dropped += 1
        self.metrics.dropped.inc()
        self.broker.dropped += 1
        if self._gap is None:
            self._gap = Gap(1, seq, seq)
        else:
            self._gap.extend(seq)

    def try_deliver_nowait(self, event: Event) -> bool:
        if self.closed:
            return True
        if self._md_waiting:
            return False
        return self._flush_gap_nowait() and self._push_nowait(event)

    def reserve_delivery(self) -> None:
        """Hold lossy events back (into the gap) from now on, until a :meth:`deliver` with
        ``reserved`` queued the must-deliver event they would overtake."""
        self._md_waiting += 1
        self.must_deliver_waits += 1

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
                if self._gap is not None:
                    # Detach the gap before waiting: drops during the wait start a new one.
                    gap, self._gap = self._gap, None
                    await self._push_waiting(gap.frame(self.broker.latest_seq))
                    self.metrics.gaps.inc()
                await self._push_waiting(event)
        finally:
            self._md_waiting -= 1
            METRICS.must_deliver_wait.observe(trio.current_time() - started)
        if self._md_waiting == 0:
            self._flush_gap_nowait()  # lossy events dropped while it waited

    def _must_deliver_lock(self) -> trio.Lock:
        if self._md_lock is None:
            self._md_lock = trio.Lock()
        return self._md_lock

    async def send_reply(self, frame: Event) -> None:
        """Queue a command reply: waits for room (backpressure on the client's commands) for at
        most ``must_deliver_timeout``; a client that still has no room is killed (1013)."""
        if self.closed:
            return
        if self._md_waiting == 0 and self._flush_gap_nowait() and self._push_nowait(frame):
            await trio.lowlevel.checkpoint()
            return
        self._md_waiting += 1
        try:
            with trio.move_on_after(self.broker.must_deliver_timeout) as waited:
                async with self._must_deliver_lock():
                    await self._push_waiting(frame)
        finally:
            self._md_waiting -= 1
        if waited.cancelled_caught and not self.closed:
            self.broker.killed += 1
            self.kill(TOO_SLOW_REASON)
            return
        if self._md_waiting == 0:
            self._flush_gap_nowait()

    def kill(self, reason: str, code: int = WS_CLOSE_TRY_AGAIN_LATER) -> None:
        """Disconnect this client (by default: it could not take a must-deliver event in time);
        the transport closes it with ``code`` and ``reason``. What was queued is dropped."""
        if not self.killed.is_set():
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
                self._depth(),
                self.size,
                self.receive.bytes,
                self.receive.max_bytes,
            )
            self.killed.set()
        self.close()
        self.receive.clear()

    # -- consumer side (the transport's writer task) -------------------------------------------

    def after_receive(self) -> None:
        """Called by the writer after taking an event: there is room now for a pending gap."""
        if self._md_waiting == 0:
            self._flush_gap_nowait()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.receive.full_since = None
            self.receive.close()
            self.broker._unsubscribe(self)


class Broker:
    """Sequences, encodes and fans out one workspace's events.

    Args:
        replay_size: events kept for resume.
        replay_bytes: bytes of encoded events kept for resume (the older are evicted first).
        client_queue_size: capacity of each client's queue (events).
        client_queue_bytes: capacity of each client's queue (bytes of encoded frames).
        must_deliver_timeout: total bound on one must-deliver publish, on one command reply's
            wait, and on how long a client's queue may stay full without it taking anything.
        log: the event log events must reach before any client sees them (cluster mode); None
            (embedded mode): clients get events as they are published. With a log,
            :meth:`write_log` must run (it opens the log) before anything is published.
        log_append_timeout: how long the log may refuse or delay one batch (retried meanwhile)
            before the broker gives it up as lost.
        on_log_lost: called once with the exception when the log is lost (fenced by a newer
            owner, or unavailable for ``log_append_timeout``), after every client was closed.
    """

    def __init__(
        self,
        *,
        replay_size: int = DEFAULT_REPLAY_BUFFER,
        replay_bytes: int = DEFAULT_REPLAY_BYTES,
        client_queue_size: int = DEFAULT_CLIENT_QUEUE_SIZE,
        client_queue_bytes: int = DEFAULT_CLIENT_QUEUE_BYTES,
        must_deliver_timeout: float = DEFAULT_MUST_DELIVER_TIMEOUT,
        log: EventLog | None = None,
        log_append_timeout: float = DEFAULT_LOG_APPEND_TIMEOUT,
        on_log_lost: Callable[[CrushError], object] | None = None,
    ) -> None:
        self.seq = 0
        self.replay: collections.deque[Event] = collections.deque()
        self.replay_size = replay_size
        self.replay_bytes = replay_bytes
        self._replay_used = 0
        self.client_queue_size = client_queue_size
        self.client_queue_bytes = client_queue_bytes
        self.must_deliver_timeout = must_deliver_timeout
        self.clients: set[ClientStream] = set()
        #: Connected clients that get snapshots instead of deltas.
        self.snapshot_clients = 0
        #: Delta changes published without their snapshot form (no snapshot-mode client).
        self.snapshots_skipped = 0
        #: Clients whose queue is full, watched by :meth:`watch_stalled`.
        self._stalled: set[ClientStream] = set()
        self._stalled_changed = trio.Event()
        self.dropped = 0
        self.killed = 0
        self.published = 0
        self.closed = False
        # -- cluster mode: the event log -------------------------------------------------------
        self.log = log
        self.log_append_timeout = log_append_timeout
        self.on_log_lost = on_log_lost
        #: The seq of the newest event the log accepted (what clients may have seen).
        self.durable_seq = 0
        #: Why the log was lost (Fenced or EventLogError); None while it is usable.
        self.log_lost: CrushError | None = None
        self._log_open = False
        #: Events published and not yet handed to the log (the next publish window).
        self._pending: list[Event] = []
        #: The batch being appended (kept until it is delivered, so a close can finish it).
        self._inflight: list[Event] = []
        self._pending_lot = trio.lowlevel.ParkingLot()
        #: Must-deliver publishers waiting for their event to be appended and delivered.
        self._md_waiters: dict[int, trio.Event] = {}
        self._writer_scope: trio.CancelScope | None = None
        self._writer_done = trio.Event()
        #: Appends made and events they carried (cluster mode).
        self.log_appends = 0
        self.log_appended = 0

    @property
    def latest_seq(self) -> int:
        """The seq of the newest event clients may have seen (``hello`` and ``gap`` carry it)."""
        return self.seq if self.log is None else self.durable_seq

    def _encode(self, obj: Any, kind: EventKind) -> Event:
        self.seq += 1
        event = self._encode_at(self.seq, obj, kind)
        self._remember(event)
        return event

    def _encode_at(self, seq: int, obj: Any, kind: EventKind) -> Event:
        ptype = wire.PAYLOAD_TYPES[type(obj)]
        envelope = {
            "seq": seq,
            "type": ptype.value,
            "payload": {"type": kind.value, "payload": wire.converter.unstructure(obj)},
        }
        data = orjson.dumps(envelope)
        return Event(seq, ptype.value, data.decode(), ptype.must_deliver, len(data))

    def _remember(self, event: Event) -> None:
        """Keep ``event`` (both forms of a delta) for replay, within both bounds."""
        self.replay.append(event)
        self._replay_used += _replay_size(event)
        while self.replay and (
            len(self.replay) > self.replay_size or self._replay_used > self.replay_bytes
        ):
            self._replay_used -= _replay_size(self.replay.popleft())
        self.published += 1
        METRICS.published[event.type].inc()

    def publish_delta(self, delta: wire.MessageDelta, message: wire.Message) -> Event:
        """Publish an append to a streaming message (lossy; never blocks).

        One seq, two forms: ``message_delta`` for delta-mode clients and ``message`` ``updated``
        carrying ``message`` (its state after the append) for the others, encoded now only when
        a snapshot-mode client is connected.
        """
        if self.log is not None:
            seq = self._log_seq()
        else:
            self.seq += 1
            seq = self.seq
        payload = {
            "message_id": delta.message_id,
            "session_id": delta.session_id,
            "part": delta.part,
            "part_type": delta.part_type,
            "offset": delta.offset,
            "text": delta.text,
        }
        # Left out when empty, as the converter does (PROTOCOL §6.6).
        if delta.tool_call_id:
            payload["tool_call_id"] = delta.tool_call_id
        if delta.tool_name:
            payload["tool_name"] = delta.tool_name
        data = orjson.dumps(
            {
                "seq": seq,
                "type": "message_delta",
                "payload": {"type": "updated", "payload": payload},
            }
        )
        event = Event(seq, "message_delta", data.decode(), False, len(data))
        event.is_delta = True
        if self.snapshot_clients:
            event.snapshot = self._encode_at(seq, message, EventKind.UPDATED)
        else:
            self.snapshots_skipped += 1
        if self.log is not None:
            return self._queue_for_log(event)
        self._remember(event)
        for client in list(self.clients):
            client.offer(event)
        return event

    def publish(self, obj: Any, kind: EventKind = EventKind.UPDATED) -> Event:
        """Publish a lossy event. Never blocks.

        Raises:
            ValueError: ``obj`` is a must-deliver payload; use :meth:`publish_must_deliver`.
        """
        if wire.PAYLOAD_TYPES[type(obj)].must_deliver:
            raise ValueError(f"{type(obj).__name__} is must-deliver; use publish_must_deliver")
        if isinstance(obj, wire.MessageDelta):
            raise ValueError("a MessageDelta has two forms; use publish_delta")
        if self.log is not None:
            return self._queue_for_log(self._encode_at(self._log_seq(), obj, kind))
        event = self._encode(obj, kind)
        for client in list(self.clients):
            client.offer(event)
        return event

    async def publish_must_deliver(self, obj: Any, kind: EventKind = EventKind.UPDATED) -> Event:
        """Publish a must-deliver event to every client, bounded by ``must_deliver_timeout``.

        Backpressure: waits for room in each full client's channel, all clients concurrently, so
        one slow client costs at most the bound; clients still full then are killed (1013).

        Cancellation: if the caller is cancelled, clients not yet served are killed rather than
        left without the event; callers publish terminal events inside shielded, time-bounded
        scopes so this does not happen on the normal paths.

        With an event log it returns once the log accepted the event and it was delivered (or
        at once when the log was lost: the event reaches nobody). Cancelled while waiting, the
        event is still appended and delivered by :meth:`write_log`.
        """
        if self.log is not None:
            return await self._publish_logged(self._encode_at(self._log_seq(), obj, kind))
        event = self._encode(obj, kind)
        slow = [c for c in list(self.clients) if not c.try_deliver_nowait(event)]
        if slow:
            await self._deliver_slow(event, slow)
        return event

    async def _deliver_slow(
        self, event: Event, slow: list[ClientStream], *, reserved: bool = False
    ) -> None:
        served: set[ClientStream] = set()

        async def one(client: ClientStream) -> None:
            await client.deliver(event, reserved=reserved)
            served.add(client)

        try:
            with trio.move_on_after(self.must_deliver_timeout):
                async with trio.open_nursery() as nursery:
                    for client in slow:
                        nursery.start_soon(one, client)
        finally:
            for client in slow:
                if client not in served and not client.closed:
                    self.killed += 1
                    client.kill(TOO_SLOW_REASON)

    # -- cluster mode: the event log ----------------------------------------------------------

    def _log_seq(self) -> int:
        if not self._log_open:
            raise RuntimeError(
                "the event log is not open: start Broker.write_log before publishing"
            )
        self.seq += 1
        return self.seq

    def _queue_for_log(self, event: Event) -> Event:
        """Queue ``event`` for the writer (dropped once the log is lost: it reaches nobody)."""
        if self.log_lost is None:
            self._pending.append(event)
            self._pending_lot.unpark_all()
        return event

    async def _publish_logged(self, event: Event) -> Event:
        if self.log_lost is not None:
            return event
        done = self._md_waiters[event.seq] = trio.Event()
        self._queue_for_log(event)
        try:
            await done.wait()
        finally:
            self._md_waiters.pop(event.seq, None)
        return event

    async def write_log(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Open the log, then append every publish window's events and deliver them. Runs until
        cancelled or until the log is lost.

        Opening reads the log's :meth:`~crush_trio.eventlog.EventLog.last_seq` and continues
        numbering after it (a new owner fences the log first). Started means publishing may
        begin.

        Each append carries everything published since the previous one began (at most
        :data:`LOG_BATCH_MAX` events). An append that fails is retried every
        :data:`LOG_RETRY_DELAY` seconds for ``log_append_timeout``; a retry first re-reads
        ``last_seq()`` so that a batch whose reply was lost is not appended twice.

        Cancellation: a batch being appended stays queued; :meth:`aclose` finishes it.

        Raises:
            EventLogError: the log could not be opened (its message says why).
        """
        event_log = self.log
        if event_log is None:
            raise RuntimeError("this broker has no event log")
        last: int | None = None
        with trio.move_on_after(self.log_append_timeout):
            last = await event_log.last_seq()
        if last is None:
            raise EventLogError(
                f"the event log did not answer last_seq() within log_append_timeout "
                f"({self.log_append_timeout:g} s)"
            )
        self.seq = self.durable_seq = max(last, self.seq)
        self._log_open = True
        self._writer_done = trio.Event()
        try:
            with trio.CancelScope() as self._writer_scope:
                async with trio.open_nursery() as deliveries:
                    task_status.started()
                    while self.log_lost is None:
                        while not self._inflight and not self._pending:
                            await self._pending_lot.park()
                        if not self._inflight:
                            self._inflight = self._pending[:LOG_BATCH_MAX]
                            del self._pending[:LOG_BATCH_MAX]
                        try:
                            await self._append(self._inflight)
                        except (Fenced, EventLogError) as exc:
                            self._lose_log(exc)
                            break
                        batch, self._inflight = self._inflight, []
                        self._fan_out(batch, deliveries)
        finally:
            self._writer_done.set()

    async def _append(self, batch: list[Event]) -> None:
        """Append ``batch`` to the log, retrying for ``log_append_timeout``.

        Raises:
            Fenced: a newer owner fenced the log.
            EventLogError: the log did not accept the batch in time.
        """
        event_log = self.log
        assert event_log is not None
        records = [(event.seq, log_record(event)) for event in batch]
        deadline = trio.current_time() + self.log_append_timeout
        error: BaseException | None = None
        while True:
            with trio.move_on_at(deadline):
                try:
                    await event_log.append(records)
                except EventLogError as exc:
                    error = exc
                else:
                    self.log_appends += 1
                    self.log_appended += len(records)
                    return
                log.warning(
                    "event log append of seq %d..%d failed: %s (retrying)",
                    records[0][0],
                    records[-1][0],
                    error,
                )
                await trio.sleep(LOG_RETRY_DELAY)
                try:
                    last = await event_log.last_seq()
                except EventLogError as exc:
                    error = exc
                    continue
                records = [record for record in records if record[0] > last]
                if not records:  # the failed attempt had landed after all
                    self.log_appends += 1
                    self.log_appended += len(batch)
                    return
                continue
            raise EventLogError(
                f"the event log did not accept events {batch[0].seq}..{batch[-1].seq} within "
                f"log_append_timeout ({self.log_append_timeout:g} s): {error or 'no reply'}"
            )

    def _fan_out(self, batch: list[Event], deliveries: trio.Nursery) -> None:
        """The log accepted ``batch``: keep it for replay and offer it to every client, in order.

        A must-deliver event that a client has no room for is delivered by a task in
        ``deliveries`` (bounded by ``must_deliver_timeout``); the client holds later lossy
        events back into its gap meanwhile, so it still sees events in seq order.
        """
        for event in batch:
            self.durable_seq = event.seq
            self._remember(event)
            if event.must_deliver:
                slow = [c for c in list(self.clients) if not c.try_deliver_nowait(event)]
                done = self._md_waiters.pop(event.seq, None)
                if slow:
                    for client in slow:
                        client.reserve_delivery()
                    deliveries.start_soon(self._deliver_reserved, event, slow, done)
                elif done is not None:
                    done.set()
            else:
                for client in list(self.clients):
                    client.offer(event)

    async def _deliver_reserved(
        self, event: Event, slow: list[ClientStream], done: trio.Event | None
    ) -> None:
        try:
            await self._deliver_slow(event, slow, reserved=True)
        finally:
            if done is not None:
                done.set()

    def _lose_log(self, exc: CrushError) -> None:
        """The log is gone for this node: nothing queued reaches anybody, every client is closed
        (1012: reconnect with ``since``), and the owner is told."""
        if self.log_lost is not None:
            return
        self.log_lost = exc
        lost = len(self._pending) + len(self._inflight)
        self._pending = []
        self._inflight = []
        for done in self._md_waiters.values():
            done.set()
        self._md_waiters.clear()
        reason = LOG_FENCED_REASON if isinstance(exc, Fenced) else LOG_UNAVAILABLE_REASON
        closed = self.drop_all(reason, WS_CLOSE_SERVICE_RESTART)
        self.closed = True
        log.warning(
            "event log lost (%s): %d queued events dropped, %d clients closed", exc, lost, closed
        )
        if self.on_log_lost is not None:
            self.on_log_lost(exc)

    async def aclose(self) -> None:
        """Close every client stream; with a log, first stop the writer, then append and deliver
        what is still queued (a close that cannot reach the log drops it, as a kill would).

        The caller bounds this (the workspace's shielded close step)."""
        if self.log is not None and self._log_open and self.log_lost is None:
            if self._writer_scope is not None:
                self._writer_scope.cancel()
                await self._writer_done.wait()
            batch = self._inflight + self._pending
            self._inflight, self._pending = [], []
            if batch:
                try:
                    await self._append(batch)
                except (Fenced, EventLogError) as exc:
                    self._lose_log(exc)
                else:
                    async with trio.open_nursery() as deliveries:
                        self._fan_out(batch, deliveries)
        self.close()

    async def subscribe_resuming(
        self,
        *,
        since: int | None = None,
        client_id: str = "",
        deltas: bool = False,
        transport: str = "other",
    ) -> tuple[ClientStream, list[Event]]:
        """:meth:`subscribe`, reading the log for the events a resume needs that are older than
        the replay buffer (cluster mode; without a log this is :meth:`subscribe`).

        The read and the subscription happen so that nothing is missed or sent twice: the
        subscription is made in the same tick as the last read's check against the buffer. What
        the log no longer keeps, or cannot be read, is sent as a ``gap``.
        """
        older: list[Event] = []
        event_log = self.log
        if event_log is not None and since is not None and self.log_lost is None:
            after = since
            while after < self.durable_seq:
                oldest = self.replay[0].seq if self.replay else self.durable_seq + 1
                if after + 1 >= oldest:
                    break
                try:
                    records = await event_log.read(after, min(LOG_READ_PAGE, oldest - 1 - after))
                except EventLogError as exc:
                    # What could not be read is missing for this client: it gets a gap.
                    log.warning("resume from the event log after seq %d failed: %s", after, exc)
                    break
                # Only what the buffer lacks: past a hole (events the log trimmed) a read can
                # reach events the log holds that are not delivered yet.
                records = [record for record in records if record[0] < oldest]
                if not records:
                    break
                older.extend(event_from_log(seq, data) for seq, data in records)
                after = records[-1][0]
        return self.subscribe(
            since=since, client_id=client_id, deltas=deltas, transport=transport, older=older
        )

    def subscribe(
        self,
        *,
        since: int | None = None,
        client_id: str = "",
        deltas: bool = False,
        transport: str = "other",
        older: list[Event] | None = None,
    ) -> tuple[ClientStream, list[Event]]:
        """Add a client. Returns its stream and the frames to send first.

        The first frames are ``hello``, then (when resuming) a ``gap`` for events no longer in the
        replay buffer and the replayed events after ``since``, in order. Everything published
        after this call goes to the stream's channel, so nothing is missed or sent twice.
        ``deltas``: the client gets ``message_delta`` events, else their ``message`` snapshots.
        ``older``: events read from the log that precede the replay buffer (cluster mode).
        ``transport`` (``ws``, ``sse``, ``other``) labels the client's metrics.
        """
        if self.closed:
            raise trio.ClosedResourceError("broker is closed")
        stream = ClientStream(
            self,
            self.client_queue_size,
            client_id=client_id,
            max_bytes=self.client_queue_bytes,
            deltas=deltas,
            transport=transport,
        )
        self.clients.add(stream)
        stream.metrics.streams.inc()
        if not deltas:
            self.snapshot_clients += 1
        if self.log is not None:
            first = list(self._resume_frames_logged(since, older or [], deltas))
        else:
            first = list(self._resume_frames(since, deltas))
        if since is not None:
            stream.metrics.gaps.inc(sum(1 for frame in first if frame.type == "gap"))
        return stream, first

    def hello(self, workspace_id: str, version: str) -> Event:
        return connection_frame(
            self.latest_seq, "hello", {"workspace_id": workspace_id, "server_version": version}
        )

    def _resume_frames(self, since: int | None, deltas: bool = False) -> Iterable[Event]:
        if since is None or since == self.seq:
            return
        if since > self.seq:
            # A cursor from another server instance (seq restarts with the process): the client
            # cannot trust anything it holds, so it re-reads state.
            yield Gap(self.seq, 1 if self.seq else 0, self.seq).frame(self.seq)
            return
        oldest = self.replay[0].seq if self.replay else self.seq + 1
        if since + 1 < oldest:
            missing_to = oldest - 1
            yield Gap(missing_to - since, since + 1, missing_to).frame(self.seq)
        missing: Gap | None = None  # delta changes whose snapshot form was not encoded
        for event in self.replay:
            if event.seq <= since:
                continue
            form = event.form_for(deltas) if event.is_delta else event
            if form is None:
                if missing is None:
                    missing = Gap(1, event.seq, event.seq)
                else:
                    missing.extend(event.seq)
                continue
            if missing is not None:
                yield missing.frame(self.seq)
                missing = None
            yield form
        if missing is not None:
            yield missing.frame(self.seq)

    def _resume_frames_logged(
        self, since: int | None, older: list[Event], deltas: bool
    ) -> Iterable[Event]:
        """The resume frames in cluster mode: ``older`` (from the log) then the replay buffer,
        with one ``gap`` for each run of seqs that neither holds (or whose form was not
        encoded)."""
        latest = self.durable_seq
        if since is None or since == latest:
            return
        if since > latest:
            yield Gap(latest, 1 if latest else 0, latest).frame(latest)
            return
        after = older[-1].seq if older else since
        events = itertools.chain(older, (e for e in self.replay if e.seq > after))
        missing: Gap | None = None
        expected = since + 1
        for event in events:
            if event.seq < expected:
                continue
            if event.seq > expected:  # neither the log nor the buffer holds these
                missing = _widen(missing, expected, event.seq - 1)
            form = event.form_for(deltas) if event.is_delta else event
            expected = event.seq + 1
            if form is None:
                missing = _widen(missing, event.seq, event.seq)
                continue
            if missing is not None:
                yield missing.frame(latest)
                missing = None
            yield form
        if expected <= latest:
            missing = _widen(missing, expected, latest)
        if missing is not None:
            yield missing.frame(latest)

    def _unsubscribe(self, stream: ClientStream) -> None:
        if stream in self.clients:
            self.clients.discard(stream)
            stream.metrics.streams.dec()
            if not stream.deltas:
                self.snapshot_clients -= 1
        self._stalled.discard(stream)

    def _stalled_client(self, stream: ClientStream) -> None:
        self._stalled.add(stream)
        self._stalled_changed.set()

    async def watch_stalled(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Disconnect (1013 ``too slow``) every client whose queue has stayed full for
        ``must_deliver_timeout`` without the client taking anything. Runs until cancelled.

        Only clients that are full at the moment are looked at, so this costs nothing per
        connected client.
        """
        task_status.started()
        while True:
            now = trio.current_time()
            wake = math.inf
            for client in list(self._stalled):
                since = client.full_since
                if client.closed or since is None:
                    self._stalled.discard(client)
                elif since + self.must_deliver_timeout <= now:
                    self._stalled.discard(client)
                    self.killed += 1
                    client.kill(TOO_SLOW_REASON)
                else:
                    wake = min(wake, since + self.must_deliver_timeout)
            with trio.move_on_at(wake):
                await self._stalled_changed.wait()
            self._stalled_changed = trio.Event()

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = {
            "seq": self.seq,
            "clients": len(self.clients),
            "snapshot_clients": self.snapshot_clients,
            "snapshots_skipped": self.snapshots_skipped,
            "replay_events": len(self.replay),
            "replay_bytes": self._replay_used,
            "queued_bytes": sum(c.receive.bytes for c in self.clients),
            "published": self.published,
            "dropped": self.dropped,
            "killed": self.killed,
            "peak_depth": max((c.peak_depth for c in self.clients), default=0),
        }
        if self.log is not None:
            stats["durable_seq"] = self.durable_seq
            stats["log_pending"] = len(self._pending) + len(self._inflight)
            stats["log_appends"] = self.log_appends
            stats["log_appended"] = self.log_appended
            stats["log_lost"] = str(self.log_lost) if self.log_lost is not None else None
        return stats

    def drop_all(self, reason: str, code: int) -> int:
        """Disconnect every client (they may resume with ``since``); returns how many."""
        clients = list(self.clients)
        for client in clients:
            client.kill(reason, code)
        return len(clients)

    def close(self) -> None:
        """Close every client stream (their writers finish what is queued, then end)."""
        self.closed = True
        for client in list(self.clients):
            client.close()
