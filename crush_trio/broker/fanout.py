"""The fan-out: one :class:`Broker` per workspace sequences, encodes once, keeps the replay buffer
and offers each event to every client's :class:`~.stream.ClientStream`, in embedded mode at once
and in cluster mode once the event log accepted it (see :mod:`crush_trio.broker`).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
from typing import TYPE_CHECKING, Any, Final

import trio

from .. import wire
from ..defaults import (
    DEFAULT_CLIENT_QUEUE_BYTES,
    DEFAULT_CLIENT_QUEUE_SIZE,
    DEFAULT_MUST_DELIVER_TIMEOUT,
    DEFAULT_REPLAY_BUFFER,
    DEFAULT_REPLAY_BYTES,
)
from ..errors import WS_CLOSE_SERVICE_RESTART, CrushError
from ..eventlog import EventLog, EventLogError, Fenced
from ..metrics import METRICS
from ..wire import EventKind
from .framing import (
    Event,
    Gap,
    connection_frame,
    encode_delta,
    encode_event,
    event_from_log,
    log_record,
    replay_cost,
    widen_gap,
)
from .stream import TOO_SLOW_REASON, ClientStream

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

log = logging.getLogger("crush_trio.broker")

#: Default bound on how long the log may refuse or delay one batch before the broker gives it up
#: (seconds; retried meanwhile).
DEFAULT_LOG_APPEND_TIMEOUT: Final = 10.0
#: Pause between two attempts of a failed append (seconds).
LOG_RETRY_DELAY: Final = 0.1
#: Most events one append carries (a longer queue is sent in several appends).
LOG_BATCH_MAX: Final = 1000
#: Events one log read asks for when a resume reaches back past the replay buffer.
LOG_READ_PAGE: Final = 1000

#: Close reasons (with 1012) of the clients of a broker whose log was lost: fenced by a newer
#: owner, or unavailable for ``log_append_timeout``. Clients reconnect and resume with ``since``.
LOG_FENCED_REASON: Final = "workspace moved to another node: event log fenced"
LOG_UNAVAILABLE_REASON: Final = "workspace moved to another node: event log unavailable"


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
        #: While :meth:`batched` is on, or a tick (:meth:`coalesce_ticks`): the clients holding
        #: frames for one write at its end.
        self.batch: list[ClientStream] | None = None
        #: Where :meth:`coalesce_ticks` waits for a tick to end; None while it does not run.
        self._ticks: trio.lowlevel.ParkingLot | None = None
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
        event = encode_event(self.seq, obj, kind)
        self._remember(event)
        return event

    def _remember(self, event: Event) -> None:
        """Keep ``event`` (both forms of a delta) for replay, within both bounds."""
        self.replay.append(event)
        self._replay_used += replay_cost(event)
        while self.replay and (
            len(self.replay) > self.replay_size or self._replay_used > self.replay_bytes
        ):
            self._replay_used -= replay_cost(self.replay.popleft())
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
        event = encode_delta(seq, delta)
        if self.snapshot_clients:
            event.snapshot = encode_event(seq, message, EventKind.UPDATED)
        else:
            self.snapshots_skipped += 1
        if self.log is not None:
            return self._queue_for_log(event)
        self._remember(event)
        for client in list(self.clients):
            client.offer(event)
        return event

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Publish the events of the block with as few writes as a client can take: a
        client written to directly gets its first frame at once and the rest in one write when
        the block ends (:meth:`ClientStream.release_held`). For a caller that publishes many
        events at one moment, such as the ends of many streams' publish windows.

        The block must not wait (no checkpoint): the frames held for a client would otherwise
        be overtaken by a write of another task. Nested blocks are one batch, and so is a block
        within a tick (:meth:`coalesce_ticks`): its frames go out when the tick ends.
        """
        if self.batch is not None:
            yield
            return
        self.batch = []
        try:
            yield
        finally:
            self._end_batch()

    @property
    def ticking(self) -> bool:
        """Whether :meth:`coalesce_ticks` runs (a workspace's broker, while it is open)."""
        return self._ticks is not None

    def open_tick(self) -> list[ClientStream] | None:
        """A client was just written to directly, outside any batch: the frames the event loop's
        other tasks publish to it before :meth:`coalesce_ticks` next runs (the loop's next round
        of tasks) are held for one write then. Returns the batch (None when the ticks are off:
        every frame is written at once)."""
        ticks = self._ticks
        if ticks is None:
            return None
        batch = self.batch = []
        ticks.unpark()
        return batch

    async def coalesce_ticks(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """End each tick (:meth:`open_tick`) in the event loop's round of tasks after the one
        that opened it: the frames held since a client's first are written in one write. Runs
        until cancelled, then ends the tick that is open and turns ticks off.

        Many tasks that each publish an event in one round of the loop (a burst of runs
        starting: each one's session, prompt and reply) then cost a client two writes, not one
        per event; a lone event is written at once as before.
        """
        ticks = self._ticks = trio.lowlevel.ParkingLot()
        task_status.started()
        try:
            while True:
                await ticks.park()
                self._end_batch()
        finally:
            self._ticks = None
            self._end_batch()

    def _end_batch(self) -> None:
        """End the batch or tick that is on: each client holding frames writes them."""
        batch, self.batch = self.batch, None
        for client in batch or ():
            client.release_held()

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
            return self._queue_for_log(encode_event(self._log_seq(), obj, kind))
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
            return await self._publish_logged(encode_event(self._log_seq(), obj, kind))
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

        A client written to directly gets the batch in one write (:meth:`batched`). A
        must-deliver event that a client has no room for is delivered by a task in
        ``deliveries`` (bounded by ``must_deliver_timeout``); the client holds later lossy
        events back into its gap meanwhile, so it still sees events in seq order.
        """
        with self.batched():  # one write per client for the batch
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
                missing = widen_gap(missing, expected, event.seq - 1)
            form = event.form_for(deltas) if event.is_delta else event
            expected = event.seq + 1
            if form is None:
                missing = widen_gap(missing, event.seq, event.seq)
                continue
            if missing is not None:
                yield missing.frame(latest)
                missing = None
            yield form
        if expected <= latest:
            missing = widen_gap(missing, expected, latest)
        if missing is not None:
            yield missing.frame(latest)

    def unsubscribe(self, stream: ClientStream) -> None:
        """Remove a client (its :meth:`ClientStream.close` does this)."""
        if stream in self.clients:
            self.clients.discard(stream)
            stream.metrics.streams.dec()
            if not stream.deltas:
                self.snapshot_clients -= 1
        self._stalled.discard(stream)

    def client_full(self, stream: ClientStream) -> None:
        """``stream``'s queue became full: :meth:`watch_stalled` keeps an eye on it."""
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
                deadline = client.stall_deadline(self.must_deliver_timeout)
                if deadline is None:
                    self._stalled.discard(client)
                elif deadline <= now:
                    self._stalled.discard(client)
                    self.killed += 1
                    client.kill(TOO_SLOW_REASON)
                else:
                    wake = min(wake, deadline)
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
            "queued_bytes": sum(c.bytes for c in self.clients),
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
