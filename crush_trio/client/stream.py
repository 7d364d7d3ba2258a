"""A workspace's one event stream: read, reconnect, command replies, resync.

Task ownership: :meth:`EventStream.running` opens a nursery that lives as long as its
``async with`` block (the workspace's, see :func:`~crush_trio.client.workspace.open_workspace`)
and holds

* the **reader** (:meth:`EventStream._reader`): the one task that reads the workspace's
  websocket (opened with ``deltas=1`` unless the client says otherwise, and ``batch=1``: the
  events the server writes together come in one frame, one envelope per line). It decodes
  each frame, assembles ``message_delta`` events into whole messages
  (:class:`~.deltas.Assembler`; a delta that shows missing text is held and its session's
  messages re-read) and offers each event to the run handles and subscriptions (never waiting
  on them: see :class:`~crush_trio.client.events.Mailbox`). When the connection
  drops it reconnects with ``since=<last seq>``, so the server replays what was missed; when the
  server answers with a ``gap`` instead (the replay no longer holds it), it asks the resync task
  to re-read state over HTTP.
* the **resync** task: re-reads ``GET runs/{id}`` (and the session's messages) for run handles
  that may have missed events, so a run that ended while the client was away still ends, and the
  messages of sessions whose streaming text is missing (after a ``gap``, or a delta whose offset
  is beyond the text the client has), merging them with what was assembled. When
  the stream cannot be re-opened at all (the server refuses it, or stays unreachable), the runs
  still pending are followed by their records alone: each ends with the outcome its record
  shows, and fails only when its record cannot be read either.
* short **grant** tasks that answer permission requests of runs sent with ``auto_approve``.

While connected, :meth:`EventStream.command` sends a websocket command (PROTOCOL §5) and the
reader hands its reply back.

Run handles speak to the stream through :class:`~crush_trio.client.runs.RunFeed`
(:meth:`EventStream.resync`, :meth:`EventStream.grant_soon`, :meth:`EventStream.forget`); the
stream reads records over HTTP through :class:`RecordSource` (the workspace client).

Leaving the block cancels those tasks and fails the runs still pending with :class:`Conflict`
("workspace client closed").
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, Final, Protocol

import attrs
import orjson
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
)

from ..defaults import CLEANUP_TIMEOUT
from ..wire import Role
from .deltas import Assembler
from .errors import Conflict, CrushError, NotFound, Timeout, Unreachable, error_for_status
from .events import MESSAGE_DELTA, Event, Mailbox, decode_frame
from .runs import GrantAction, RunHandle, deadline_after, deadline_scope, route_of
from .transport import HELLO_TIMEOUT, receive_hello, rejection_error

if TYPE_CHECKING:
    from ..wire import Message, Run

log = logging.getLogger(__name__)

#: A stream silent this long is probed with a websocket ping (seconds).
KEEPALIVE_INTERVAL: Final = 15.0
#: A ping unanswered this long means the connection is dead; it is dropped and re-opened.
PING_TIMEOUT: Final = 10.0
#: Default bound on re-establishing a dropped stream before pending runs fail (seconds).
DEFAULT_RECONNECT_TIMEOUT: Final = 30.0
#: First pause between reconnect attempts; it doubles up to :data:`RECONNECT_MAX_DELAY`.
RECONNECT_FIRST_DELAY: Final = 0.05
RECONNECT_MAX_DELAY: Final = 2.0
#: Pause before retrying a refetch that failed (seconds).
RESYNC_RETRY_DELAY: Final = 0.5
#: With no event stream, pending runs are followed by reading their records: first after this
#: pause, then doubling up to :data:`RUN_POLL_MAX_DELAY` (seconds).
RUN_POLL_FIRST_DELAY: Final = 0.1
RUN_POLL_MAX_DELAY: Final = 2.0

#: Handshake statuses after which reconnecting cannot help.
PERMANENT_STATUSES: Final = frozenset({400, 401, 403, 404, 409, 503})

#: Opens one websocket connection to the stream, resuming after ``since`` when it is set.
SocketOpener = Callable[[int | None], AbstractAsyncContextManager[WebSocketConnection]]


class RecordSource(Protocol):
    """What the stream reads over HTTP: run records and messages, and permission answers."""

    async def get_run(self, run_id: str) -> Run: ...

    async def messages(self, session_id: str) -> list[Message]: ...

    async def grant(self, permission_id: str, action: GrantAction = "allow") -> bool: ...


@attrs.define
class StreamStats:
    """Counters of one workspace's event stream (for tests, logs and benchmarks).

    :meth:`on_hello` and :meth:`on_event` are the stream's sequence rules, without I/O.
    """

    connects: int = 0
    reconnects: int = 0
    drops: int = 0
    gaps: int = 0
    refetches: int = 0
    events: int = 0
    last_seq: int = 0
    #: ``message_delta`` events received, and those that could not be applied (text missing).
    deltas: int = 0
    deltas_missing: int = 0
    #: Re-reads of a session's messages made to recover missing text.
    rereads: int = 0
    #: Frames that carried several envelopes (``batch=1``).
    batches: int = 0

    def on_hello(self, seq: int, *, first: bool) -> None:
        """A connection said ``hello`` with the workspace's latest ``seq``.

        The first connection starts from it; a reconnect resumes from the last event seen, or
        from ``seq`` when that is lower: a server whose sequence restarted sends a gap, and the
        stream follows its numbering.
        """
        self.connects += 1
        if first:
            self.last_seq = seq
        else:
            self.reconnects += 1
            self.last_seq = min(self.last_seq, seq)

    def on_event(self, seq: int) -> bool:
        """Count the event ``seq``; False for one already seen (a replay overlapping what
        arrived before a drop), which is not passed on."""
        if seq <= self.last_seq:
            return False
        self.last_seq = seq
        self.events += 1
        return True


@attrs.define
class _Command:
    """A websocket command waiting for its reply (``None`` when the stream ended first)."""

    done: trio.Event = attrs.Factory(trio.Event)
    reply: dict[str, Any] | None = None


class CommandLost(Exception):
    """A command was sent on the stream, which ended (or went quiet) before the reply."""


#: What :meth:`EventStream.command` returns when no stream is connected (nothing sent).
NOT_SENT: Final = object()


class EventStream:
    """The event stream of one workspace client, and the tasks that serve it.

    Attributes:
        stats: counters of the stream.
        stream_error: the error of a stream that is gone for good (``None`` until then).
        closed: True once the workspace block has ended (or is ending).
        reconnect_timeout: how long a dropped stream is retried before it is gone for good.
    """

    def __init__(
        self,
        *,
        workspace_id: str,
        path: str,
        server_url: str,
        records: RecordSource,
        open_socket: SocketOpener,
        reconnect_timeout: float = DEFAULT_RECONNECT_TIMEOUT,
    ) -> None:
        self.workspace_id = workspace_id
        self.path = path
        self.server_url = server_url
        self.reconnect_timeout = reconnect_timeout
        self.stats = StreamStats()
        self.stream_error: CrushError | None = None
        self.closed = False
        self._records = records
        self._open_socket = open_socket
        self._runs: dict[str, RunHandle] = {}
        #: The same handles by session: an event is offered to its session's (:func:`route_of`).
        self._sessions: dict[str, dict[str, RunHandle]] = {}
        #: Subscriptions' mailboxes, each with the event types it takes (None: every type).
        self._feeds: dict[Mailbox, frozenset[str] | None] = {}
        self._resync: dict[RunHandle, bool] = {}
        self._resync_wakeup = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._conn_scope: trio.CancelScope | None = None
        self._stream_done = trio.Event()
        self._stream_changed = trio.Event()
        self._conn: WebSocketConnection | None = None  # while it is connected
        self._commands: dict[int, _Command] = {}  # sent on the stream, waiting for a reply
        self._command_ids = 0
        #: The streaming messages of the workspace, assembled from snapshots and deltas.
        self.assembler = Assembler()
        self._reread: set[str] = set()  # sessions whose messages must be re-read

    # -- lifecycle -------------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self, *, read: bool = True) -> AsyncIterator[None]:
        """Serve the stream for the block's duration (see the module docstring).

        With ``read`` the reader and resync tasks run, and the block starts once the first
        ``hello`` has arrived; without it only permission grants can run. Leaving the block
        closes the connection politely (a close handshake, bounded by
        :data:`~crush_trio.defaults.CLEANUP_TIMEOUT`), fails the pending runs and ends the
        subscriptions.

        Raises:
            Unreachable, AuthError, NotFound, Conflict, Timeout: the first connect failed.
        """
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if read:
                    await nursery.start(self._reader)
                    nursery.start_soon(self._resync_worker)
                try:
                    yield
                finally:
                    try:
                        if read:
                            await self._close_politely()
                    finally:
                        self.close()
                        nursery.cancel_scope.cancel()
        finally:
            self.close()

    def check_open(self) -> None:
        """Raise when no more work can be started on this stream.

        Raises:
            Conflict: the workspace client is closed.
            CrushError: the stream is gone for good (its :attr:`stream_error`).
        """
        if self.closed:
            raise Conflict(f"workspace client for {self.path} is closed; open the workspace again")
        if self.stream_error is not None:
            raise self.stream_error

    def drop(self) -> None:
        """Close the current connection; the reader re-opens it with ``since``."""
        if self._conn_scope is not None:
            self._conn_scope.cancel()

    async def _close_politely(self) -> None:
        """Close the connection with a websocket close handshake, bounded."""
        self.closed = True
        self.drop()
        with trio.move_on_after(CLEANUP_TIMEOUT):
            await self._stream_done.wait()

    def close(self) -> None:
        """The workspace block ended: pending runs fail, subscriptions end."""
        self.closed = True
        error = Conflict(f"workspace client for {self.path} was closed before the run ended")
        for handle in list(self._runs.values()):
            handle.fail(error)
        for mailbox in self._feeds:
            mailbox.close()
        self._stream_news()

    # -- consumers -------------------------------------------------------------------------------

    def is_pending(self, run_id: str) -> bool:
        """True while a run handle with this id is registered."""
        return run_id in self._runs

    def track(self, handle: RunHandle) -> None:
        """Offer every event from now on to ``handle``, until it ends or :meth:`forget`."""
        self._runs[handle.run_id] = handle
        self._sessions.setdefault(handle.session_id, {})[handle.run_id] = handle

    def add_feed(self, mailbox: Mailbox, types: frozenset[str] | None = None) -> None:
        """Put every event from now on into ``mailbox`` (closed when the stream ends); with
        ``types``, only the events of those types, and every ``gap``."""
        self._feeds[mailbox] = types

    def remove_feed(self, mailbox: Mailbox) -> None:
        self._feeds.pop(mailbox, None)

    # -- the run handles' protocol (RunFeed) -----------------------------------------------------

    def forget(self, handle: RunHandle) -> None:
        """Stop offering events to ``handle`` and drop its pending refetch."""
        if self._runs.get(handle.run_id) is handle:
            del self._runs[handle.run_id]
        same = self._sessions.get(handle.session_id)
        if same is not None and same.get(handle.run_id) is handle:
            del same[handle.run_id]
            if not same:
                del self._sessions[handle.session_id]
        self._resync.pop(handle, None)

    def resync(self, handle: RunHandle, *, messages: bool) -> None:
        """Ask the resync task to re-read ``handle``'s run (and its session's messages)."""
        if handle.done:
            return
        self._resync[handle] = self._resync.get(handle, False) or messages
        self._resync_wakeup.set()

    def grant_soon(self, permission_id: str, action: GrantAction) -> None:
        """Answer a permission request in a task of its own (failures are logged)."""
        if self._nursery is not None and not self.closed:
            self._nursery.start_soon(self._grant_quietly, permission_id, action)

    async def _grant_quietly(self, permission_id: str, action: GrantAction) -> None:
        try:
            await self._records.grant(permission_id, action)
        except CrushError as exc:
            log.warning("could not answer permission request %s: %s", permission_id, exc)

    # -- commands --------------------------------------------------------------------------------

    async def command(
        self,
        method: str,
        params: dict[str, Any],
        *,
        timeout: float,  # noqa: ASYNC109
    ) -> Any:
        """Run a websocket command on the stream (PROTOCOL §5) and return its result;
        :data:`NOT_SENT` when no stream is connected.

        Raises:
            CrushError: the server's refusal (the class of its status).
            CommandLost: the stream ended, or the reply did not come within ``timeout``
                seconds, after the command was sent: it may or may not have run.
        """
        conn = self._conn
        if conn is None or conn.closed is not None:
            await trio.lowlevel.checkpoint()
            return NOT_SENT
        self._command_ids += 1
        command_id = self._command_ids
        pending = _Command()
        self._commands[command_id] = pending
        frame = orjson.dumps({"id": command_id, "method": method, "params": params}).decode()
        try:
            try:
                await conn.send_message(frame)
            except ConnectionClosed:
                raise CommandLost() from None  # the frame may have gone out before the close
            with trio.move_on_after(timeout):
                await pending.done.wait()
        finally:
            del self._commands[command_id]
        reply = pending.reply
        if reply is None:
            raise CommandLost()
        if reply.get("ok"):
            return reply.get("result")
        status = reply.get("status")
        raise error_for_status(
            status if isinstance(status, int) else 500, str(reply.get("message", ""))
        )

    def _command_replied(self, frame: dict[str, Any]) -> None:
        pending = self._commands.get(frame.get("id"))  # type: ignore[arg-type]
        if pending is not None and not pending.done.is_set():
            pending.reply = frame
            pending.done.set()

    def _commands_lost(self) -> None:
        for pending in self._commands.values():
            pending.done.set()  # no reply: CommandLost

    # -- reconnects ------------------------------------------------------------------------------

    async def wait_reconnected(
        self,
        after: int | None = None,
        *,
        timeout: float | None = DEFAULT_RECONNECT_TIMEOUT,  # noqa: ASYNC109
    ) -> int:
        """Wait until ``stats.reconnects`` is greater than ``after`` (default: its value now).

        See :meth:`WorkspaceClient.wait_reconnected
        <crush_trio.client.WorkspaceClient.wait_reconnected>`.
        """
        target = self.stats.reconnects if after is None else after

        def describe() -> str:
            return (
                f"the event stream of workspace {self.workspace_id} was not re-opened within "
                f"{timeout:g} s ({self.stats.reconnects} reconnect(s) and {self.stats.drops} "
                f"drop(s) so far, last seq {self.stats.last_seq}); is the server at "
                f"{self.server_url} up?"
            )

        with deadline_scope(deadline_after(timeout), describe):
            while self.stats.reconnects <= target:
                self.check_open()
                await self._stream_changed.wait()
        return self.stats.reconnects

    def _stream_news(self) -> None:
        """Wake :meth:`wait_reconnected`: the stream was re-opened, or is gone for good."""
        self._stream_changed.set()
        self._stream_changed = trio.Event()

    # -- the reader ------------------------------------------------------------------------------

    async def _reader(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The reader task (see the module docstring); reports started after the first hello.

        Raises (before started): Unreachable, AuthError, NotFound, Timeout for the first connect.
        """
        try:
            await self._reader_loop(task_status)
        finally:
            self._stream_done.set()
            self._stream_news()

    async def _reader_loop(self, task_status: trio.TaskStatus[None]) -> None:
        first = True
        lost_at: float | None = None
        delay = RECONNECT_FIRST_DELAY
        where = f"the event stream of workspace {self.workspace_id}"
        while not self.closed:
            since = None if first else self.stats.last_seq
            why: BaseException | str
            try:
                async with self._open_socket(since) as conn:
                    hello = await receive_hello(conn, where, HELLO_TIMEOUT)
                    self.stats.on_hello(int(hello.get("seq", 0)), first=first)
                    if first:
                        first = False
                        task_status.started()
                    else:
                        self._stream_news()
                    lost_at, delay = None, RECONNECT_FIRST_DELAY
                    self._conn = conn
                    try:
                        with trio.CancelScope() as scope:
                            self._conn_scope = scope
                            why = await self._read(conn)
                    finally:
                        self._conn = None
                        self._commands_lost()
                    self._conn_scope = None
                    if scope.cancelled_caught:
                        why = "dropped by this client"
            except (
                ConnectionClosed,
                HandshakeError,
                OSError,
                trio.BrokenResourceError,
                trio.TooSlowError,
                orjson.JSONDecodeError,
                CrushError,
            ) as exc:
                self._conn_scope = None
                if first:
                    error = exc if isinstance(exc, CrushError) else self._stream_failure(exc)
                    raise error from exc
                why = exc
            if self.closed:
                return
            self.stats.drops += 1
            now = trio.current_time()
            if lost_at is None:
                lost_at = now
                log.info(
                    "event stream of workspace %s lost (%s); reconnecting", self.workspace_id, why
                )
            permanent = isinstance(why, ConnectionRejected) and (
                why.status_code in PERMANENT_STATUSES
            )
            if permanent or now - lost_at >= self.reconnect_timeout:
                self._fail_stream(why if isinstance(why, CrushError) else self._stream_failure(why))
                return
            await trio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_DELAY)

    def _stream_failure(self, exc: BaseException | str) -> CrushError:
        where = f"the event stream of workspace {self.workspace_id} at {self.server_url}"
        if isinstance(exc, ConnectionRejected):
            return rejection_error(where, exc)
        if isinstance(exc, trio.TooSlowError):
            return Timeout(f"{where} did not answer within {HELLO_TIMEOUT:g} s")
        what = exc if isinstance(exc, str) else f"{exc.__class__.__name__}: {exc}"
        return Unreachable(
            f"lost {where} ({what}) and could not re-open it within "
            f"{self.reconnect_timeout:g} s; check that the server is running"
        )

    async def _read(self, conn: WebSocketConnection) -> str:
        """Read frames until the connection ends; returns why it ended.

        A connection silent for :data:`KEEPALIVE_INTERVAL` since its last frame is pinged. The
        silence is timed from each frame's arrival without a cancel scope per frame: the one
        scope's deadline is moved on only when it fires.

        The connection's end is handled here, inside its ``async with`` block, so that the
        websocket library closes it cleanly.
        """
        heard = trio.current_time()
        while True:
            try:
                with trio.CancelScope(deadline=heard + KEEPALIVE_INTERVAL):
                    while True:
                        raw = await conn.get_message()
                        heard = trio.current_time()
                        self._handle_text(raw)
                if trio.current_time() < heard + KEEPALIVE_INTERVAL:
                    continue  # a frame came meanwhile: time the silence from it
                with trio.move_on_after(PING_TIMEOUT) as ping:
                    await conn.ping()
                if ping.cancelled_caught:
                    return f"no answer to a keep-alive ping within {PING_TIMEOUT:g} s"
                heard = trio.current_time()
            except ConnectionClosed as exc:
                reason = exc.reason
                if reason is None:
                    return "connection closed"
                return f"closed with code {reason.code} {reason.reason or reason.name}"

    def _handle_text(self, raw: str | bytes) -> None:
        """One websocket frame: one envelope, or (``batch=1``) several, one per line."""
        lines: list[str] | list[bytes] = (
            raw.split("\n") if isinstance(raw, str) else raw.split(b"\n")
        )
        envelopes = [line for line in lines if line]
        if len(envelopes) > 1:
            self.stats.batches += 1
        for line in envelopes:
            try:
                frame = orjson.loads(line)
            except orjson.JSONDecodeError:
                log.warning("ignoring an event frame that is not JSON")
                continue
            self._handle_frame(frame)

    def _handle_frame(self, frame: Any) -> None:
        if isinstance(frame, dict) and frame.get("type") == "reply":
            self._command_replied(frame)
            return
        event = decode_frame(frame)
        if event is None:
            return
        if event.type == "gap":
            self.stats.gaps += 1
            for mailbox in self._feeds:
                mailbox.put(event)
            for handle in list(self._runs.values()):
                handle.offer(event)
                self.resync(handle, messages=True)
            # Deltas and snapshots of streaming messages may be among the missed events.
            for session_id in self.assembler.sessions():
                self.reread(session_id)
            return
        assert event.seq is not None
        if not self.stats.on_event(event.seq):
            return
        if event.type == MESSAGE_DELTA:
            self.stats.deltas += 1
            message = self.assembler.apply(event.payload)
            if message is None:
                # Text is missing: the delta is held; the re-read brings the message.
                self.stats.deltas_missing += 1
                self.reread(event.payload.session_id)
                return
            event = Event(event.type, event.payload, event.seq, event.kind, event.raw, message)
        elif event.type == "message":
            if event.kind == "deleted":
                self.assembler.forget(event.payload.id)
            else:
                message = self.assembler.snapshot(event.payload)
                if message is not event.payload:
                    event = attrs.evolve(event, payload=message)
        elif event.type == "session" and event.kind == "deleted":
            self.assembler.forget_session(event.payload.id)
        self._dispatch(event)

    def _dispatch(self, event: Event) -> None:
        for mailbox, types in self._feeds.items():
            if types is None or event.type in types:
                mailbox.put(event)
        route = route_of(event)
        if route is None:
            return
        if route.run_id is not None:
            handle = self._runs.get(route.run_id)
            handles = [] if handle is None else [handle]
        elif route.session_id is not None:
            handles = list(self._sessions.get(route.session_id, {}).values())
        else:
            handles = list(self._runs.values())
        for handle in handles:
            handle.offer(event)

    def reread(self, session_id: str) -> None:
        """Ask the resync task to re-read a session's messages (text of one is missing)."""
        self._reread.add(session_id)
        self._resync_wakeup.set()

    def _merges(self, msg: Message) -> bool:
        assembler = self.assembler
        return (
            msg.id in assembler.missing
            or assembler.get(msg.id) is not None
            or (msg.role is Role.ASSISTANT and msg.finish() is None)
        )

    def merge_reread(self, history: list[Message]) -> list[Message]:
        """Messages read over HTTP, merged with what the stream assembled: a message with
        missing text takes the read (and the deltas held meanwhile), a streaming one keeps
        what it has when the read is older."""
        return [self.assembler.refetched(m) if self._merges(m) else m for m in history]

    async def _reread_session(self, session_id: str) -> list[Message]:
        """Re-read a session's messages, merge them with what the stream assembled and pass on
        the streaming messages that changed; returns the merged history.

        Raises:
            CrushError: the read failed (:class:`NotFound`: the session is gone).
        """
        self._reread.discard(session_id)
        try:
            history = await self._records.messages(session_id)
        except NotFound:
            self.assembler.forget_session(session_id)
            raise
        self.stats.rereads += 1
        assembler = self.assembler
        read_ids = {m.id for m in history}
        for mid, sid in list(assembler.missing.items()):
            if sid == session_id and mid not in read_ids:
                assembler.forget(mid)  # deleted, or never stored: nothing to wait for
        before = {m.id: assembler.get(m.id) for m in history if self._merges(m)}
        merged = self.merge_reread(history)
        for msg in merged:
            if msg.id in before and before[msg.id] is not msg:
                self._dispatch(Event("message", msg, None, "updated"))
        if any(sid == session_id for sid in assembler.missing.values()):
            self._reread.add(session_id)  # the read did not cover every held delta: again
        return merged

    async def _reread_sessions(self) -> bool:
        """Re-read the sessions :meth:`reread` named; False when one must be read again."""
        for session_id in list(self._reread):
            try:
                await self._reread_session(session_id)
            except NotFound:
                continue
            except CrushError as exc:
                log.info("re-reading messages of session %s failed (%s)", session_id, exc)
                self._reread.add(session_id)
        return not self._reread

    def _fail_stream(self, error: CrushError) -> None:
        """The stream is gone for good. Subscriptions end with ``error``; runs still pending do
        not: the resync task follows them by their records (``GET runs/{id}``), so a run that
        ended, or ends later, still gets its outcome."""
        self.stream_error = error
        log.warning("%s; following the pending runs over HTTP", error)
        for mailbox in self._feeds:
            mailbox.close()
        for handle in list(self._runs.values()):
            self.resync(handle, messages=True)
        self._stream_news()

    # -- the resync task -------------------------------------------------------------------------

    def _record_lost(self, handle: RunHandle, exc: CrushError) -> CrushError:
        """The error of a pending run whose stream is gone and whose record cannot be read."""
        assert self.stream_error is not None
        return type(self.stream_error)(
            f"{self.stream_error.message}; run {handle.run_id!r} could not be followed over "
            f"HTTP either ({exc.message})"
        )

    async def _resync_worker(self) -> None:
        """Re-read runs (and messages) of handles that may have missed events.

        With no event stream left (:meth:`_fail_stream`), every pending run is re-read at a
        growing interval (:data:`RUN_POLL_FIRST_DELAY` to :data:`RUN_POLL_MAX_DELAY`) until its
        record shows its end; a record that cannot be read then fails the run.
        """
        poll_delay = RUN_POLL_FIRST_DELAY
        while True:
            await self._resync_wakeup.wait()
            self._resync_wakeup = trio.Event()
            batch, self._resync = self._resync, {}
            failed = False
            for handle, with_messages in batch.items():
                if handle.done:
                    continue
                try:
                    run = await self._records.get_run(handle.run_id)
                    self.stats.refetches += 1
                    handle.refetched_run(run)
                    if with_messages and not handle.done:
                        handle.refetched_messages(await self._reread_session(handle.session_id))
                except CrushError as exc:
                    if self.stream_error is not None:
                        handle.fail(self._record_lost(handle, exc))
                    elif not isinstance(exc, NotFound):  # not known yet: its events will tell
                        log.info("refetching run %s failed (%s); will retry", handle.run_id, exc)
                        self._resync[handle] = self._resync.get(handle, False) or with_messages
                        failed = True
            if self._reread and not await self._reread_sessions():
                failed = True
            if self.stream_error is not None:
                for handle in list(self._runs.values()):
                    self._resync.setdefault(handle, False)
                if self._resync:
                    await trio.sleep(poll_delay)
                    poll_delay = min(poll_delay * 2, RUN_POLL_MAX_DELAY)
                    self._resync_wakeup.set()
            elif failed:
                await trio.sleep(RESYNC_RETRY_DELAY)
                self._resync_wakeup.set()
