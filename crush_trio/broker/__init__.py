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

Each client's queue (its :class:`~.outbox.Outbox`) is bounded by events (``client_queue_size``)
and by bytes of encoded frames (``client_queue_bytes``); one item larger than the byte bound still
fits into an empty queue. A client whose queue stays full for ``must_deliver_timeout`` without
taking anything is disconnected too, even while nothing must be delivered
(:meth:`Broker.watch_stalled`), so a client that stops reading cannot pin its queue while the
workspace is idle.

Message deltas (PROTOCOL §6): a streaming append is one change with one ``seq`` and two
encodings. :meth:`Broker.publish_delta` encodes the ``message_delta`` form for clients that asked
for deltas (``?deltas=1``) and the ``message`` ``updated`` snapshot form for the others, each once,
shared by every client of that mode. The snapshot form is encoded only while a snapshot-mode client
is connected; a snapshot-mode client that resumes across a change whose snapshot form was never
encoded gets a ``gap`` for it instead (these events are lossy; it re-reads the messages). The
replay buffer's byte bound counts both forms.

The broker never touches a socket: each transport runs one writer task per connection that drains
the client's queue (see ``server/connection.py``).

Where an event goes, module by module:

* :mod:`.framing` — :class:`Event`: the envelope encoded once, its websocket and SSE frames, the
  ``hello`` and ``gap`` frames, the batch frames of a connection that takes them
  (:func:`batch_frames`), an event's log record. No I/O.
* :mod:`.outbox` — :class:`~.outbox.Outbox`: one client's bounded queue and its rules (queue,
  drop into a gap, wait for room, too slow) as plain logic, with no event loop.
* :mod:`.stream` — :class:`ClientStream`: the Trio shell around an outbox (waits for room under
  the bound, the kill, metrics) and :class:`ClientQueue`, the writer's end of the handoff.
* :mod:`.fanout` — :class:`Broker`: sequencing, the replay buffer, the fan-out loop and, in
  cluster mode, the event-log writer.

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

import logging

from .fanout import (
    DEFAULT_LOG_APPEND_TIMEOUT,
    LOG_BATCH_MAX,
    LOG_FENCED_REASON,
    LOG_READ_PAGE,
    LOG_RETRY_DELAY,
    LOG_UNAVAILABLE_REASON,
    Broker,
)
from .framing import (
    FLUSH,
    GAP_FRAME_BYTES,
    MAX_BATCH_BYTES,
    UNBATCHED_TYPES,
    BatchCache,
    Event,
    Gap,
    batch_frames,
    batch_groups,
    batch_text,
    connection_frame,
    encode_delta,
    encode_event,
    event_from_log,
    log_record,
    replay_cost,
    utf8_len,
    websocket_text_frame,
    widen_gap,
)
from .outbox import Outbox
from .stream import (
    NOT_SENT,
    SENT,
    SENT_IN_PART,
    TOO_SLOW_REASON,
    ClientQueue,
    ClientStream,
)

#: The logger of every module of the broker (their records say ``crush_trio.broker``).
log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_LOG_APPEND_TIMEOUT",
    "FLUSH",
    "GAP_FRAME_BYTES",
    "LOG_BATCH_MAX",
    "LOG_FENCED_REASON",
    "LOG_READ_PAGE",
    "LOG_RETRY_DELAY",
    "LOG_UNAVAILABLE_REASON",
    "MAX_BATCH_BYTES",
    "NOT_SENT",
    "SENT",
    "SENT_IN_PART",
    "TOO_SLOW_REASON",
    "UNBATCHED_TYPES",
    "BatchCache",
    "Broker",
    "ClientQueue",
    "ClientStream",
    "Event",
    "Gap",
    "Outbox",
    "batch_frames",
    "batch_groups",
    "batch_text",
    "connection_frame",
    "encode_delta",
    "encode_event",
    "event_from_log",
    "log",
    "log_record",
    "replay_cost",
    "utf8_len",
    "websocket_text_frame",
    "widen_gap",
]
