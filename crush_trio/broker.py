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
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Final

import attrs
import orjson
import trio

from . import wire
from .errors import WS_CLOSE_TRY_AGAIN_LATER
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

TOO_SLOW_REASON: Final = "too slow"
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
        self._items: collections.deque[Event] = collections.deque()
        self.size = size
        self.max_bytes = max_bytes
        self.bytes = 0
        self.closed = False
        #: When the queue became full, or last gave an item while full; None while not full.
        self.full_since: float | None = None
        self._readers = trio.lowlevel.ParkingLot()
        self._room = trio.lowlevel.ParkingLot()

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
        self._items.append(event)
        self.bytes += event.size
        if self._readers:
            self._readers.unpark()
        return True

    async def wait_room(self, size: int) -> None:
        """Wait until an item of ``size`` bytes fits, or the queue closes."""
        while not self.closed and not self.fits(size):
            await self._room.park()

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0

    def close(self) -> None:
        self.closed = True
        self._readers.unpark_all()
        self._room.unpark_all()

    def receive_nowait(self) -> Event:
        if self._items:
            event = self._items.popleft()
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
        self._md_lock = trio.Lock()
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
        if self._push_nowait(self._gap.frame(self.broker.seq)):
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

    async def deliver(self, event: Event) -> None:
        """Wait for room for a must-deliver event (the caller bounds the wait).

        Cancellation: if cancelled while waiting the event was not queued; the caller then kills
        this client.
        """
        self._md_waiting += 1
        self.must_deliver_waits += 1
        started = trio.current_time()
        try:
            async with self._md_lock:
                if self._gap is not None:
                    # Detach the gap before waiting: drops during the wait start a new one.
                    gap, self._gap = self._gap, None
                    await self._push_waiting(gap.frame(self.broker.seq))
                    self.metrics.gaps.inc()
                await self._push_waiting(event)
        finally:
            self._md_waiting -= 1
            METRICS.must_deliver_wait.observe(trio.current_time() - started)
        if self._md_waiting == 0:
            self._flush_gap_nowait()  # lossy events dropped while it waited

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
                async with self._md_lock:
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
    """

    def __init__(
        self,
        *,
        replay_size: int = DEFAULT_REPLAY_BUFFER,
        replay_bytes: int = DEFAULT_REPLAY_BYTES,
        client_queue_size: int = DEFAULT_CLIENT_QUEUE_SIZE,
        client_queue_bytes: int = DEFAULT_CLIENT_QUEUE_BYTES,
        must_deliver_timeout: float = DEFAULT_MUST_DELIVER_TIMEOUT,
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
        """
        event = self._encode(obj, kind)
        slow = [c for c in list(self.clients) if not c.try_deliver_nowait(event)]
        if slow:
            await self._deliver_slow(event, slow)
        return event

    async def _deliver_slow(self, event: Event, slow: list[ClientStream]) -> None:
        served: set[ClientStream] = set()

        async def one(client: ClientStream) -> None:
            await client.deliver(event)
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

    def subscribe(
        self,
        *,
        since: int | None = None,
        client_id: str = "",
        deltas: bool = False,
        transport: str = "other",
    ) -> tuple[ClientStream, list[Event]]:
        """Add a client. Returns its stream and the frames to send first.

        The first frames are ``hello``, then (when resuming) a ``gap`` for events no longer in the
        replay buffer and the replayed events after ``since``, in order. Everything published
        after this call goes to the stream's channel, so nothing is missed or sent twice.
        ``deltas``: the client gets ``message_delta`` events, else their ``message`` snapshots.
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
        first = list(self._resume_frames(since, deltas))
        if since is not None:
            stream.metrics.gaps.inc(sum(1 for frame in first if frame.type == "gap"))
        return stream, first

    def hello(self, workspace_id: str, version: str) -> Event:
        return connection_frame(
            self.seq, "hello", {"workspace_id": workspace_id, "server_version": version}
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
        return {
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
