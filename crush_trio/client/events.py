"""Decoded event-stream frames and the bounded mailboxes that hand them to readers.

One websocket per workspace carries envelopes ``{"seq", "type", "payload": {"type", "payload"}}``
(PROTOCOL §5). :func:`decode_frame` turns one into an :class:`Event` whose ``payload`` is the wire
object (:class:`~crush_trio.wire.Message`, :class:`~crush_trio.wire.RunComplete`, ...), structured
with the project's one converter. The client also makes events of its own, with ``seq=None`` and
``raw=None``: a ``gap`` when events were missed, and ``message`` snapshots re-read over HTTP.

A :class:`Mailbox` sits between the client's one reader task and each consumer (a run handle or a
workspace subscription), so a consumer that stops reading never stalls the reader.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Final

import attrs
import trio

from .. import wire

log = logging.getLogger(__name__)

#: Lossy events buffered per consumer; when full, further lossy events are dropped and counted.
DEFAULT_MAILBOX_SIZE: Final = 1024

_CLASSES: Final[dict[str, type[Any]]] = {
    ptype.value: cls for cls, ptype in wire.PAYLOAD_TYPES.items()
}

#: The event type of an append to a streaming message (a connection opened with ``deltas=1``).
MESSAGE_DELTA: Final = "message_delta"

#: Frames of one connection (not workspace events): they take no seq of their own.
CONNECTION_FRAMES: Final = frozenset({"hello", "gap"})


@attrs.frozen
class Gap:
    """Events this consumer did not get: ``dropped`` of them, ``from_seq``..``to_seq`` when known
    (``None`` for drops inside the client, whose seqs are not tracked)."""

    dropped: int
    from_seq: int | None = None
    to_seq: int | None = None


@attrs.frozen
class Event:
    """One event of a workspace, as a consumer sees it.

    Attributes:
        type: the payload type (``message``, ``message_delta``, ``run_complete``, ...) or
            ``gap``.
        payload: the wire object (a :class:`Gap` for ``gap``, a
            :class:`~crush_trio.wire.MessageDelta` for ``message_delta``).
        seq: the event's sequence number; ``None`` for events the client made itself.
        kind: ``created``, ``updated`` or ``deleted``.
        raw: the envelope exactly as received (``None`` for events the client made itself).
        assembled: for ``message_delta``, the whole message with this delta applied (the
            workspace's event stream fills it in; see :attr:`message`).
    """

    type: str
    payload: Any
    seq: int | None = None
    kind: str = "updated"
    raw: dict[str, Any] | None = None
    assembled: wire.Message | None = None

    @property
    def must_deliver(self) -> bool:
        return self.type in _MUST_DELIVER

    @property
    def message(self) -> wire.Message | None:
        """The message as it stands after this event: the payload of a ``message`` event, the
        assembled message of a ``message_delta``; ``None`` for other events."""
        if self.type == MESSAGE_DELTA:
            return self.assembled
        if self.type == "message":
            payload: wire.Message = self.payload
            return payload
        return None

    @property
    def delta(self) -> wire.MessageDelta | None:
        """The append of a ``message_delta`` event (``None`` for other events)."""
        return self.payload if self.type == MESSAGE_DELTA else None

    def to_json(self) -> dict[str, Any]:
        """The envelope: as received, or in the same shape for the client's own events."""
        if self.raw is not None:
            return self.raw
        payload = attrs.asdict(self.payload) if isinstance(self.payload, Gap) else None
        if payload is None:
            payload = wire.converter.unstructure(self.payload)
        return {
            "seq": self.seq,
            "type": self.type,
            "payload": {"type": self.kind, "payload": payload},
        }


_MUST_DELIVER: Final = frozenset(p.value for p in wire.MUST_DELIVER)


def decode_frame(frame: Any) -> Event | None:
    """The :class:`Event` of one received frame, or ``None`` for frames that are not events
    (``hello``, command replies) or cannot be read (logged and skipped: one bad frame must not
    end the stream)."""
    if not isinstance(frame, dict):
        log.warning("ignoring an event frame that is not an object: %r", frame)
        return None
    ftype = frame.get("type")
    seq = frame.get("seq")
    body = frame.get("payload")
    if ftype == "gap" and isinstance(body, dict):
        return Event(
            "gap",
            Gap(int(body.get("dropped", 0)), body.get("from_seq"), body.get("to_seq")),
            seq if isinstance(seq, int) else None,
            raw=frame,
        )
    if not isinstance(ftype, str) or ftype not in _CLASSES:
        return None  # hello, reply, error and payload types this client does not know
    if not isinstance(seq, int) or not isinstance(body, dict):
        log.warning("ignoring a malformed %s event frame", ftype)
        return None
    try:
        payload = wire.converter.structure(body.get("payload"), _CLASSES[ftype])
    except Exception as exc:
        log.warning("ignoring a %s event (seq %d): %s", ftype, seq, wire.describe_error(exc))
        return None
    kind = body.get("type")
    return Event(ftype, payload, seq, kind if isinstance(kind, str) else "updated", frame)


class Mailbox:
    """A single consumer's queue of events.

    Backpressure: the producer (the reader task) never waits. Lossy events (``message``,
    ``message_delta``, ``session``, ``agent_event``) beyond ``size`` are dropped and counted, and
    the consumer gets a ``gap`` event (``seq=None``) before the next event that fits.
    Must-deliver events (``run_complete``, ``permission_*``) are always queued: there are few of
    them (one terminal and the permission requests of the consumer's own runs), so they cannot
    grow without bound while the lossy part is capped.
    """

    def __init__(self, size: int = DEFAULT_MAILBOX_SIZE) -> None:
        self.size = size
        self._items: collections.deque[Event] = collections.deque()
        self._lossy = 0
        self.dropped = 0
        self._pending_drops = 0
        self._wakeup = trio.Event()
        self.closed = False

    def put(self, event: Event) -> None:
        """Queue ``event`` (dropping it when it is lossy and the mailbox is full)."""
        if self.closed:
            return
        if not event.must_deliver and event.type != "gap":
            if self._lossy >= self.size:
                self.dropped += 1
                self._pending_drops += 1
                return
            if self._pending_drops:
                self._items.append(Event("gap", Gap(self._pending_drops)))
                self._pending_drops = 0
            self._lossy += 1
        self._items.append(event)
        self._wakeup.set()

    def close(self) -> None:
        """No more events; :meth:`get` returns ``None`` once the queue is drained."""
        self.closed = True
        self._wakeup.set()

    def get_nowait(self) -> Event | None:
        if not self._items:
            return None
        event = self._items.popleft()
        if not event.must_deliver and event.type != "gap":
            self._lossy -= 1
        return event

    async def get(self) -> Event | None:
        """The next event, or ``None`` when the mailbox is closed and drained.

        Cancellation: safe; nothing is taken from the queue unless it is returned.
        """
        while True:
            event = self.get_nowait()
            if event is not None:
                return event
            if self.closed:
                if self._pending_drops:
                    drops, self._pending_drops = self._pending_drops, 0
                    return Event("gap", Gap(drops))
                return None
            self._wakeup = trio.Event()
            await self._wakeup.wait()
