"""Event framing: each event is encoded once, and every client and the replay buffer share the
bytes.

:class:`Event` holds one envelope's JSON text and builds its websocket and SSE frames on first
use; :func:`encode_event` and :func:`encode_delta` make them from wire objects,
:func:`connection_frame` makes the frames of one connection (``hello``, ``gap``) and
:func:`log_record` / :func:`event_from_log` are an event's form in the event log. Nothing here
does I/O or knows about clients.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Final

import attrs
import orjson

from .. import wire

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..wire import EventKind

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


def encode_event(seq: int, obj: Any, kind: EventKind) -> Event:
    """The event ``seq`` carrying wire object ``obj``: its envelope encoded once."""
    ptype = wire.PAYLOAD_TYPES[type(obj)]
    envelope = {
        "seq": seq,
        "type": ptype.value,
        "payload": {"type": kind.value, "payload": wire.converter.unstructure(obj)},
    }
    data = orjson.dumps(envelope)
    return Event(seq, ptype.value, data.decode(), ptype.must_deliver, len(data))


def encode_delta(seq: int, delta: wire.MessageDelta) -> Event:
    """The ``message_delta`` form of change ``seq`` (its ``snapshot`` form is set by the caller).

    Built by hand rather than through the converter: a streaming reply publishes one per token.
    """
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
    return event


def replay_cost(event: Event) -> int:
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


#: The type of a batch frame's :class:`Event` (never a payload type: it names no event).
BATCH: Final = "batch"
#: Most bytes of envelopes in one batch frame (``batch=1``, docs/protocol.md §6.1); an event
#: this large or larger goes in a frame of its own.
MAX_BATCH_BYTES: Final = 32 * 1024
#: Batch frames remembered (:class:`BatchCache`), so that the connections sent the same events
#: together get one shared frame.
BATCH_CACHE_SIZE: Final = 32
#: Frames never batched: a connection's own (``hello`` first and alone; a ``gap`` or a command's
#: ``reply`` differ from one connection to the next).
UNBATCHED_TYPES: Final = frozenset({"hello", "gap", "reply", "flush"})


def batch_text(events: Sequence[Event]) -> str:
    """The text of a frame carrying ``events`` for a connection that takes batches: each
    envelope followed by a newline (compact JSON holds no raw newline)."""
    return "\n".join([event.text for event in events]) + "\n"


class BatchCache:
    """Batch frames by the events they carry, the most recent :data:`BATCH_CACHE_SIZE`.

    The connections of a publish pass are sent the same events one after the other: the first
    builds the batch and the others get the same :class:`Event`, whose frame is then built once
    (and, for connections without context takeover, compressed once: it is keyed by the object).
    """

    __slots__ = ("_batches", "size")

    def __init__(self, size: int = BATCH_CACHE_SIZE) -> None:
        self.size = size
        self._batches: collections.OrderedDict[tuple[Event, ...], Event] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._batches)

    def get(self, events: tuple[Event, ...]) -> Event:
        """The batch frame of ``events`` (two or more, in order): :func:`batch_text`."""
        batches = self._batches
        batch = batches.get(events)
        if batch is not None:
            batches.move_to_end(events)
            return batch
        text = batch_text(events)
        size = sum(event.size for event in events) + len(events)
        must_deliver = any(event.must_deliver for event in events)
        batch = Event(events[-1].seq, BATCH, text, must_deliver, size)
        batches[events] = batch
        if len(batches) > self.size:
            batches.popitem(last=False)
        return batch


def batch_groups(events: Sequence[Event], max_bytes: int = MAX_BATCH_BYTES) -> list[list[Event]]:
    """``events`` grouped into the frames of a connection that takes batches (``batch=1``):
    each run of consecutive events that fits in ``max_bytes`` is one group; an event of
    :data:`UNBATCHED_TYPES` and an event of ``max_bytes`` or more are a group of their own. The
    order is kept."""
    groups: list[list[Event]] = []
    run: list[Event] = []
    run_bytes = 0
    for event in events:
        cost = event.size + 1
        if event.type in UNBATCHED_TYPES or cost > max_bytes:
            if run:
                groups.append(run)
                run, run_bytes = [], 0
            groups.append([event])
            continue
        if run_bytes + cost > max_bytes:
            groups.append(run)
            run, run_bytes = [], 0
        run.append(event)
        run_bytes += cost
    if run:
        groups.append(run)
    return groups


def batch_frames(
    events: Sequence[Event], cache: BatchCache, max_bytes: int = MAX_BATCH_BYTES
) -> list[Event]:
    """The uncompressed frames of :func:`batch_groups`: a group of one is its event's own
    frame, a larger one its :class:`BatchCache` frame."""
    return [
        group[0] if len(group) == 1 else cache.get(tuple(group))
        for group in batch_groups(events, max_bytes)
    ]


#: A queue item that carries no event: the client's transport wrote the start of a frame at once
#: (see :meth:`~crush_trio.broker.stream.ClientStream.send_now`) and holds the rest, which its
#: writer sends, for this item, before anything else. A writer that gets it sends no frame of it.
FLUSH: Final = Event(0, "flush", "", False, 0)


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


def widen_gap(gap: Gap | None, first: int, last: int) -> Gap:
    """``gap`` extended by the missing seqs ``first..last`` (they follow it)."""
    if gap is None:
        return Gap(last - first + 1, first, last)
    gap.dropped += last - first + 1
    gap.to_seq = last
    return gap
