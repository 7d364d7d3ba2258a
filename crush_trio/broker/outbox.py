"""One client's queue and its delivery rules, as plain logic.

No I/O and no event loop here: the broker offers events, the client's writer takes them, and
:class:`Outbox` decides what happens to each and keeps the counts, so every rule can be tested
as a table of moves. The shell (:class:`~crush_trio.broker.stream.ClientStream`, a subclass)
adds what needs Trio: waking the writer, waiting for room, the time bounds, closing the
connection, metrics.

Rules (PROTOCOL §5):

1. The queue is bounded by items (``size``) and by bytes of encoded frames (``max_bytes``); an
   empty queue takes any one item, however large.
2. A **lossy** event (:meth:`Outbox.offer`) is queued at once or **dropped**: a drop is counted
   and widens the client's pending :class:`~crush_trio.broker.framing.Gap`.
3. The pending gap is queued as one ``gap`` frame just before the next lossy event that fits
   together with it (so gap frames alone never fill the queue), before a must-deliver event, or
   as soon as the writer takes something.
4. A **delta** change is offered in the client's form (``message_delta``, or its ``message``
   snapshot); a form that was not encoded counts as a drop.
5. A **must-deliver** event (:meth:`Outbox.try_deliver_nowait`) is queued at once behind the
   pending gap, or the shell must **wait** for room (:meth:`Outbox.reserve_delivery`). While a
   wait is on, every lossy event is held back into the gap, so the client still sees events in
   seq order.
6. A queue that is **full**, or that refuses an item, starts the **stall clock**
   (:attr:`Outbox.full_since`). Each item the writer takes while the queue is still full
   restarts it; one that leaves room stops it. A client whose clock has run for the bound is
   **too slow** (:meth:`Outbox.overdue`) and is disconnected, as is one whose must-deliver wait
   outlasts the bound (that wait is the shell's).
7. A **closed** outbox takes nothing more (offers are ignored, must-deliver counts as done);
   what is queued can still be taken, until a kill clears it.
8. An item for an **empty** queue may be **sent at once** by the shell
   (:meth:`Outbox._send_now`: the transport writes it without waiting, while the client's writer
   is idle) and is then never queued; order is kept, since nothing is queued before it.

Cost: :meth:`Outbox.offer` runs for every client on every published event, so its common path
makes no call besides :meth:`Outbox.put_nowait`; the shell's hooks (``_send_now``,
``_wake_writer``, ``_stalled``, ``_dropped_one``, ``_gap_sent``, ``_room_made``) run only on the
transition that needs them.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Final

from .framing import GAP_FRAME_BYTES, Event, Gap

if TYPE_CHECKING:
    from collections.abc import Callable

#: The items of every empty :class:`Outbox`: a shared deque that can hold nothing, so an idle
#: client holds no deque of its own (760 bytes each; an outbox allocates one when an item arrives
#: and lets it go once drained). Only :meth:`Outbox.put_nowait` appends, and it replaces this
#: first.
NO_ITEMS: Final[collections.deque[Event]] = collections.deque(maxlen=0)


class Outbox:
    """One client's bounded queue of frames, with its drop, gap and stall rules.

    Args:
        size: most items queued at once.
        max_bytes: most bytes of encoded frames queued at once (one larger item still fits into
            an empty queue).
        deltas: the client gets ``message_delta`` events, else their ``message`` snapshots.
        clock: the current time (seconds); read only when the stall clock starts or restarts.
    """

    __slots__ = (
        "bytes",
        "clock",
        "closed",
        "deltas",
        "dropped",
        "full_since",
        "gap",
        "gaps",
        "holding",
        "items",
        "max_bytes",
        "must_deliver_waits",
        "peak_bytes",
        "peak_depth",
        "size",
    )

    def __init__(
        self, size: int, max_bytes: int, *, deltas: bool = False, clock: Callable[[], float]
    ) -> None:
        #: The queued frames, oldest first (the writer takes from the left).
        # Allocated by the first put, released when drained (see :data:`NO_ITEMS`).
        self.items: collections.deque[Event] = NO_ITEMS
        self.size = size
        self.max_bytes = max_bytes
        #: Bytes of the queued frames.
        self.bytes = 0
        self.deltas = deltas
        self.clock = clock
        self.closed = False
        #: When the stall clock started (the queue became full, or the writer last took an item
        #: while it stayed full); None while the queue has room.
        self.full_since: float | None = None
        #: Lossy events dropped since the last ``gap`` frame was queued.
        self.gap: Gap | None = None
        #: Waits for room that hold lossy events back (must-deliver events, command replies).
        self.holding = 0
        #: Lossy events dropped for this client.
        self.dropped = 0
        #: ``gap`` frames queued.
        self.gaps = 0
        #: Must-deliver events that had to wait for room.
        self.must_deliver_waits = 0
        #: Most items and most bytes queued at once.
        self.peak_depth = 0
        self.peak_bytes = 0

    # -- the bounds ---------------------------------------------------------------------------

    def fits(self, size: int) -> bool:
        """Room for one more item of ``size`` bytes (an empty queue takes any one item)."""
        items = self.items
        return not items or (len(items) < self.size and self.bytes + size <= self.max_bytes)

    def fits_two(self, first: int, second: int) -> bool:
        """Room for two more items, of ``first`` then ``second`` bytes."""
        items = self.items
        if not items:
            return True
        return len(items) + 2 <= self.size and self.bytes + first + second <= self.max_bytes

    @property
    def full(self) -> bool:
        return len(self.items) >= self.size or self.bytes >= self.max_bytes

    def stall_deadline(self, bound: float) -> float | None:
        """When this client becomes too slow unless its writer takes something; None while its
        queue has room (or it is closed)."""
        since = self.full_since
        if since is None or self.closed:
            return None
        return since + bound

    def overdue(self, now: float, bound: float) -> bool:
        """Too slow: the queue has stayed full for ``bound`` seconds without the writer taking
        anything."""
        deadline = self.stall_deadline(bound)
        return deadline is not None and deadline <= now

    # -- the broker's side --------------------------------------------------------------------

    def put_nowait(self, item: Event) -> bool:
        """Queue ``item`` if it fits. False: no room (the stall clock starts). A closed outbox
        takes nothing and answers True: there is nothing more to deliver to it."""
        if self.closed:
            return True
        items = self.items
        size = item.size
        depth = len(items)
        if depth and (depth >= self.size or self.bytes + size > self.max_bytes):
            self._mark_full()
            return False
        if not depth and self._send_now(item):
            return True
        items = self.items  # the direct write may have queued frames it held (ClientStream)
        depth = len(items)
        if items is NO_ITEMS:
            items = self.items = collections.deque()
        items.append(item)
        depth += 1
        total = self.bytes = self.bytes + size
        if depth == 1:
            self._wake_writer()  # only an empty queue can have its writer waiting
        if depth > self.peak_depth:
            self.peak_depth = depth
        if total > self.peak_bytes:
            self.peak_bytes = total
        if depth >= self.size or total >= self.max_bytes:
            self._mark_full()
        return True

    def offer(self, event: Event) -> bool:
        """Offer a lossy event: True when it (in this client's form) was queued; False when it
        was dropped and counted into the gap, or the outbox is closed."""
        if self.closed:
            return False
        form = event.snapshot if event.is_delta and not self.deltas else event
        # While a must-deliver event waits for this client, later lossy events would overtake
        # it; drop them into the gap instead. A pending gap goes out only with the event behind
        # it, so gap frames cannot fill the queue.
        if (
            form is not None
            and self.holding == 0
            and (
                self.gap is None or (self.fits_two(GAP_FRAME_BYTES, form.size) and self.flush_gap())
            )
            and self.put_nowait(form)
        ):
            return True
        self.dropped += 1
        seq = event.seq
        gap = self.gap
        if gap is None:
            self.gap = Gap(1, seq, seq)
        else:
            gap.dropped += 1
            gap.to_seq = seq
        self._dropped_one()
        return False

    def flush_gap(self) -> bool:
        """Queue the pending gap frame if it fits; True when no gap is pending any more."""
        gap = self.gap
        if gap is None:
            return True
        if self.put_nowait(self._gap_frame(gap)):
            self.gap = None
            self.gaps += 1
            self._gap_sent()
            return True
        return False

    def try_deliver_nowait(self, event: Event) -> bool:
        """Queue a must-deliver event (or a command reply) now, behind the pending gap. False:
        no room, the caller must wait for it (see :meth:`reserve_delivery`)."""
        if self.closed:
            return True
        if self.holding:
            return False
        return self.flush_gap() and self.put_nowait(event)

    def reserve_delivery(self, *, must_deliver: bool = True) -> None:
        """A wait for room begins: hold lossy events back (into the gap) until
        :meth:`release_delivery`. ``must_deliver``: count it as a must-deliver wait (a command
        reply's wait is not)."""
        self.holding += 1
        if must_deliver:
            self.must_deliver_waits += 1

    def release_delivery(self) -> None:
        """A wait for room ended (its item queued, or given up)."""
        self.holding -= 1

    def close(self) -> None:
        """Take nothing more; the stall clock stops."""
        self.closed = True
        self.full_since = None

    def clear(self) -> None:
        """Drop everything queued (a killed client gets none of it)."""
        self.items = NO_ITEMS
        self.bytes = 0

    # -- the writer's side --------------------------------------------------------------------

    def take(self) -> Event | None:
        """The oldest queued item, or None when the queue is empty. Taking restarts the stall
        clock of a queue that is still full and stops it otherwise."""
        items = self.items
        if not items:
            return None
        item = items.popleft()
        if not items:
            self.items = NO_ITEMS
        self.bytes -= item.size
        if self.holding:
            self._room_made()
        if self.full_since is not None:  # the client makes progress: restart its bound
            full = len(items) >= self.size or self.bytes >= self.max_bytes
            self.full_since = self.clock() if full else None
        return item

    def after_receive(self) -> None:
        """The writer took something, or a wait for room ended: queue the pending gap now,
        unless lossy events are still held back."""
        if self.holding == 0:
            self.flush_gap()

    # -- the shell's hooks (no-ops here) ------------------------------------------------------

    def _mark_full(self) -> None:
        if self.full_since is None and not self.closed:
            self.full_since = self.clock()
            self._stalled()

    def _gap_frame(self, gap: Gap) -> Event:
        """The ``gap`` frame for ``gap`` (the shell stamps the broker's latest seq)."""
        return gap.frame(gap.to_seq)

    def _send_now(self, item: Event) -> bool:
        """The queue is empty: send ``item`` now, without queueing it, if the shell can (True);
        False: queue it."""
        return False

    def _wake_writer(self) -> None:
        """An item went into the empty queue: a waiting writer can take it."""

    def _room_made(self) -> None:
        """The writer took an item while a wait for room is on."""

    def _stalled(self) -> None:
        """The stall clock started."""

    def _dropped_one(self) -> None:
        """A lossy event was dropped."""

    def _gap_sent(self) -> None:
        """A ``gap`` frame was queued."""
