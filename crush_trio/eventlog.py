"""Event logs: where a workspace's encoded events are kept so that any ``seq`` a client saw can be
replayed, here or on another node.

:class:`~crush_trio.core.ports.EventLog` is the port the broker writes through when a log is
configured (cluster mode); it, :data:`EventRecord`, :class:`~crush_trio.errors.Fenced` and
:class:`~crush_trio.errors.EventLogError` are re-exported here. An event is a ``(seq, bytes)``
pair: ``seq`` is the broker's sequence number (1, 2, ...; a log keeps them strictly increasing)
and the bytes are the event's encoding, opaque to the log.

Two implementations:

* :class:`MemoryEventLog`: a bounded ring in memory (by events and by bytes, the oldest evicted
  first), the same semantics as the broker's own replay buffer. It serves tests and the contract;
  the embedded single-node server does not use a log at all (its broker keeps its ring itself).
* ``crush_trio.cluster.redislog.RedisEventLog``: one Redis stream per workspace (cluster mode).

Ownership and fencing: a log belongs to one owner at a time, identified by an **epoch** (the
workspace lease's epoch, which grows with every change of owner). :meth:`EventLog.fence` claims the
log for an epoch; from then on appends made through a handle fenced with an older epoch raise
:class:`Fenced` and land nothing. Fencing is monotonic: fencing with an epoch older than the
current one raises :class:`Fenced` too. A new owner fences first, then continues numbering from
:meth:`EventLog.last_seq`.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Final

import trio

from .core.ports import EventLog as EventLog
from .core.ports import EventRecord as EventRecord  # noqa: TC001 (a re-export)
from .errors import EventLogError as EventLogError
from .errors import Fenced as Fenced

if TYPE_CHECKING:
    from collections.abc import Sequence

#: Default number of events an event log keeps for resume.
DEFAULT_LOG_MAX_EVENTS: Final = 100_000
#: Default bound on the bytes of encoded events :class:`MemoryEventLog` keeps.
DEFAULT_LOG_MAX_BYTES: Final = 64 * 1024 * 1024


def check_batch(batch: Sequence[EventRecord], last: int) -> None:
    """Check that ``batch``'s seqs increase and start above ``last``.

    Raises:
        EventLogError: they do not.
    """
    for seq, _ in batch:
        if seq <= last:
            raise EventLogError(
                f"event log append out of order: seq {seq} is not above {last}; "
                "a new owner continues from last_seq()"
            )
        last = seq


class _Ring:
    """The shared contents of one in-memory log (every handle of it sees the same ring)."""

    __slots__ = ("bytes", "epoch", "events", "last", "max_bytes", "max_events")

    def __init__(self, max_events: int, max_bytes: int) -> None:
        self.events: collections.deque[EventRecord] = collections.deque()
        self.bytes = 0
        self.last = 0
        self.epoch = 0
        self.max_events = max_events
        self.max_bytes = max_bytes


class MemoryEventLog:
    """An :class:`EventLog` in memory: a ring bounded by events and by bytes.

    The oldest events are evicted first once either bound is passed (the newest event is always
    kept, even when it alone is over the byte bound). :meth:`handle` gives another handle on the
    same ring, as another node would open the same Redis stream; each handle has its own epoch.

    Args:
        max_events: events kept.
        max_bytes: bytes of encoded events kept.
    """

    def __init__(
        self, max_events: int = DEFAULT_LOG_MAX_EVENTS, max_bytes: int = DEFAULT_LOG_MAX_BYTES
    ) -> None:
        if max_events < 1 or max_bytes < 1:
            raise ValueError("an event log keeps at least one event and one byte")
        self._ring = _Ring(max_events, max_bytes)
        #: The epoch this handle was fenced with (0: never fenced).
        self.epoch = 0

    def handle(self) -> MemoryEventLog:
        """Another handle on the same log (with its own epoch, 0 until fenced)."""
        other = MemoryEventLog.__new__(MemoryEventLog)
        other._ring = self._ring
        other.epoch = 0
        return other

    def _check_epoch(self) -> None:
        ring = self._ring
        if ring.epoch != self.epoch:
            raise Fenced(
                f"event log fenced: epoch {ring.epoch} owns it, this writer has epoch "
                f"{self.epoch}; the workspace must stop on this node"
            )

    async def append(self, batch: Sequence[EventRecord]) -> None:
        await trio.lowlevel.checkpoint()  # like a remote log: other tasks run meanwhile
        ring = self._ring
        self._check_epoch()
        check_batch(batch, ring.last)
        events = ring.events
        for record in batch:
            events.append(record)
            ring.bytes += len(record[1])
        if batch:
            ring.last = batch[-1][0]
        while len(events) > 1 and (len(events) > ring.max_events or ring.bytes > ring.max_bytes):
            ring.bytes -= len(events.popleft()[1])

    async def read(self, after_seq: int, limit: int) -> list[EventRecord]:
        await trio.lowlevel.checkpoint()
        out: list[EventRecord] = []
        if limit <= 0:
            return out
        for record in self._ring.events:
            if record[0] > after_seq:
                out.append(record)
                if len(out) >= limit:
                    break
        return out

    async def last_seq(self) -> int:
        await trio.lowlevel.checkpoint()
        return self._ring.last

    async def first_seq(self) -> int:
        await trio.lowlevel.checkpoint()
        events = self._ring.events
        return events[0][0] if events else self._ring.last + 1

    async def fence(self, epoch: int) -> None:
        await trio.lowlevel.checkpoint()
        ring = self._ring
        if epoch < ring.epoch:
            raise Fenced(
                f"event log fence refused: epoch {ring.epoch} owns it, {epoch} is older; "
                "the workspace belongs to another node"
            )
        ring.epoch = epoch
        self.epoch = epoch

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()
