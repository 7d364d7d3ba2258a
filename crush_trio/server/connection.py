"""One event-stream connection's lifecycle, the same for every transport.

A transport (:mod:`.ws_trio`, :mod:`.ws_asgi`) checks the upgrade with :func:`check_upgrade`,
answers it, and hands an :class:`EventSocket` to :func:`serve_connection`, which:

1. subscribes to the workspace's broker, takes the ``hello`` frame in the same tick (so its seq
   cannot move) and holds the workspace for the client (:func:`subscribed`; SSE does the same);
2. runs the **writer** on demand (:class:`OnDemandWriter`: the task that writes events and
   replies to the socket, started when frames are queued; it drains the client's bounded queue,
   several frames per write where the transport allows, and ends once the queue is empty). While
   no writer runs, a transport that can write without waiting (:attr:`EventSocket.send_now`)
   takes each new frame from the broker at once, in the publisher's task, and leaves the writer
   only what the socket did not take; so an idle connection holds no writer task;
3. runs the **reader** in the handler's task: every text frame is a command
   (:func:`~.commands.run_command`) whose reply waits for room in the same queue, so a client that
   floods commands without reading is slowed, then disconnected;
4. registers the connection with the server's :class:`~.keepalive.Keepalive` (where the
   transport does not ping by itself): a client sent nothing for ``server.ws_ping_interval`` is
   pinged, one that does not answer is disconnected;
5. ends the connection with the code :func:`close_code` chooses: the broker's when it killed the
   client (1013 ``too slow``, 1012 ``dropped``), 1001 when the workspace closes, else 1000.

The connection's tasks (writer, pings, replies that wait) run in a nursery the transport has open
anyway (trio-websocket's reader's), or in one of the connection's own.

The broker kills a client (:attr:`~crush_trio.broker.ClientStream.on_kill`) by bounding the
connection's writes (:meth:`EventSocket.limit_writes`, :data:`SLOW_CLOSE_TIMEOUT` from now) and
ending the connection (its writer, if one runs, is cancelled). The writer never leaves a frame
half-written: the frame in flight is finished, frames not begun are not sent, and the close frame
follows at that frame boundary. A client that reads again within the bound gets all that;
otherwise the connection is aborted (reset) and nothing more is written. How each such close
ended is counted (``crush_trio_slow_client_closes_total``).
"""

from __future__ import annotations

import contextvars
import math
from typing import TYPE_CHECKING, Any, Final, Protocol

import attrs
import trio

from .. import __version__, wire
from ..broker import TOO_SLOW_REASON, ClientStream, Event
from ..defaults import CLOSE_TIMEOUT
from ..errors import WS_CLOSE_GOING_AWAY, WS_CLOSE_NORMAL, BadRequest
from ..logs import set_log_context
from ..metrics import METRICS
from .commands import answer_command
from .security import check_request_host, check_request_origin, check_request_token, parse_seq

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence
    from types import TracebackType

    from ..backend.workspace import Workspace
    from .api import Api
    from .keepalive import Keepalive
    from .settings import Settings

#: A client disconnected as too slow (1013) or dropped (1012): how long it has, from then, to
#: take the rest of the frame in flight and the close frame before the connection is aborted
#: (reset, nothing more written; seconds).
SLOW_CLOSE_TIMEOUT: Final = 5.0
#: Close reason when the workspace closes under a connection.
WORKSPACE_CLOSED: Final = "workspace closed"


class PeerGone(Exception):
    """The client left while the writer was sending; the connection ends quietly."""


class EventSocket(Protocol):
    """What :func:`serve_connection` needs of a websocket transport."""

    #: Most queued frames written in one send (1: one frame per send).
    max_batch: int
    #: Set on every write to the client; the :class:`~.keepalive.Keepalive` reads and clears it
    #: (see :meth:`OnDemandWriter.sent_since`).
    sent: bool

    @property
    def send_now(self) -> Callable[[Sequence[Event]], int] | None:
        """Writes frames at once, in one write, without waiting, for the broker's direct
        write while no writer runs (:attr:`~crush_trio.broker.ClientStream.send_now`); None: the
        writer sends every frame."""

    async def send_frames(self, frames: Sequence[Event]) -> None:
        """Send these frames, in order; raise :class:`PeerGone` when the client has left."""

    async def ping(self) -> bool:
        """Ping the client; ``False`` when no pong came back in time (the connection is dead);
        raise :class:`PeerGone` when the client has left."""

    #: What :meth:`receive` raises once the client has left.
    left: tuple[type[Exception], ...]

    def stop_reading(self) -> None:
        """From now on :meth:`receive` returns ``None`` or raises one of :attr:`left` (a wait
        in it included); never blocks. Called to end a connection."""

    def receive(self) -> Awaitable[str | bytes | None]:
        """The next frame from the client; ``None``, or one of :attr:`left` raised, once it has
        left. (Not a coroutine of its own: the transport's, so an idle connection's handler
        waits one frame less deep.)"""

    async def close(self, code: int, reason: str) -> None:
        """Close the connection with ``code``; bounded, never raises."""

    def limit_writes(self, deadline: float) -> None:
        """Every write from now on must end by ``deadline`` (trio clock): the frame in flight
        and the close frame; one that has not then aborts the connection (nothing more is
        written). Synchronous: called from the broker's kill."""

    def ending(self) -> str:
        """How the connection's close went (after :meth:`close`): ``closed`` (everything written
        whole, the close frame last), ``aborted`` (a write did not end in time: reset) or
        ``gone`` (the client left or closed first)."""


@attrs.frozen
class Subscription:
    """What a client asked of its event stream (the query of the websocket or SSE request)."""

    client_id: str
    #: Resume after this seq (``since``, or SSE's ``Last-Event-ID``); None: from now.
    since: int | None = None
    #: ``deltas=1``: streaming appends as ``message_delta`` events, else ``message`` snapshots.
    deltas: bool = False
    #: ``batch=1`` (websocket): the client takes frames that carry several envelopes (one per
    #: line); without it, one envelope per frame.
    batch: bool = False


def parse_flag(name: str, value: str | None, meaning: str, otherwise: str) -> bool:
    """A ``0``/``1`` query parameter (absent or empty: ``0``).

    Raises:
        BadRequest: any other value; the message names the parameter and what each value means.
    """
    if value is None or value in ("", "0"):
        return False
    if value == "1":
        return True
    raise BadRequest(f"{name} must be 1 ({meaning}) or 0 ({otherwise}), got {value!r}")


def parse_deltas(value: str | None) -> bool:
    """The ``deltas`` query parameter: ``1`` asks for ``message_delta`` events, absent or ``0``
    for ``message`` snapshots (PROTOCOL §6).

    Raises:
        BadRequest: any other value.
    """
    return parse_flag("deltas", value, "message_delta events", "snapshots")


def parse_subscription(args: Any, last_event_id: str | None = None) -> Subscription:
    """The event stream a request asks for: ``client_id``, ``since`` (or ``Last-Event-ID``,
    which wins), ``deltas`` and ``batch``, from its query ``args``.

    Raises:
        BadRequest: a malformed value; the message names the parameter.
    """
    client_id = wire.validate_client_id(args.get("client_id"))
    if last_event_id:
        since = parse_seq(last_event_id, "Last-Event-ID")
    else:
        since = parse_seq(args.get("since"), "since")
    batch = parse_flag(
        "batch", args.get("batch"), "frames of several envelopes", "one envelope per frame"
    )
    return Subscription(client_id, since, parse_deltas(args.get("deltas")), batch)


def check_upgrade(
    settings: Settings,
    api: Api,
    wid: str,
    headers: Any,
    args: Any,
    cookies: Any,
    scheme: str,
) -> tuple[Workspace, Subscription]:
    """Check a websocket upgrade: host, token, origin, workspace, ``client_id``, ``since``,
    ``deltas``.

    Returns ``(workspace, subscription)``; raises the :class:`~crush_trio.errors.CrushError`
    whose status the upgrade is refused with (PROTOCOL §5).
    """
    check_request_host(settings, headers)
    check_request_token(settings, headers, args, cookies)
    check_request_origin(settings, headers, scheme)
    ws = api.workspace(wid)
    sub = parse_subscription(args)
    ws.check_open()
    return ws, sub


def subscribed(ws: Workspace, sub: Subscription, transport: str = "ws") -> Subscribed:
    """Subscribe ``sub.client_id`` to the workspace's events and hold the workspace for it.

    Yields ``(stream, hello, first)``: the client's queue, the ``hello`` frame and the frames
    that resume after ``sub.since`` (in cluster mode read from the event log when they are older
    than the replay buffer). On the way out the stream is closed and the hold dropped.
    ``transport`` (``ws``, ``sse``) labels the stream's metrics.
    """
    return Subscribed(ws, sub, transport)


class Subscribed:
    """The async context manager of :func:`subscribed`.

    A slotted class rather than an ``asynccontextmanager`` generator: every open event stream
    holds one for its whole life, and this one is three references, not a suspended generator
    with its frame and the wrapper's dictionary.
    """

    __slots__ = ("stream", "sub", "transport", "ws")

    def __init__(self, ws: Workspace, sub: Subscription, transport: str) -> None:
        self.ws = ws
        self.sub = sub
        self.transport = transport
        self.stream: ClientStream | None = None

    async def __aenter__(self) -> tuple[ClientStream, Event, list[Event]]:
        ws, sub = self.ws, self.sub
        stream, first = await ws.broker.subscribe_resuming(
            since=sub.since, client_id=sub.client_id, deltas=sub.deltas, transport=self.transport
        )
        hello = ws.broker.hello(ws.id, __version__)  # same tick as subscribe: seq cannot move
        ws.attach(sub.client_id)
        self.stream = stream
        return stream, hello, first

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self.stream is not None
        self.stream.close()
        self.ws.detach(self.sub.client_id)


def close_bound(write_deadline: float) -> float:
    """How long a close may take (seconds): :data:`CLOSE_TIMEOUT`, or longer when the writes
    have a deadline (a killed client: its close frame may go out until then)."""
    if math.isinf(write_deadline):
        return CLOSE_TIMEOUT
    return max(CLOSE_TIMEOUT, write_deadline - trio.current_time())


def close_code(stream: ClientStream, ws: Workspace) -> tuple[int, str]:
    """The code and reason a finished connection is closed with."""
    if stream.is_killed:
        return stream.kill_code, stream.kill_reason
    if ws.closing:
        return WS_CLOSE_GOING_AWAY, WORKSPACE_CLOSED
    return WS_CLOSE_NORMAL, ""


class OnDemandWriter:
    """A connection's writer (the only task that writes its events and replies), started on
    demand: it runs only while the client has frames to send.

    While it does not run, the broker writes each frame for the empty queue at once
    (:attr:`~crush_trio.broker.ClientStream.send_now`, where the transport can); a frame queued
    (one the socket would not take at once, or the rest of one it took in part: a
    :data:`~crush_trio.broker.FLUSH` item) starts the writer in the connection's nursery
    (:attr:`~crush_trio.broker.ClientStream.start_writer`). It writes ``hello`` and the resumed
    frames first, then drains the queue, :attr:`EventSocket.max_batch` frames per write, and ends
    once the queue is empty (the direct write takes over again), or ends the connection when the
    queue has ended (the workspace closed) or the client is gone. So an idle connection holds no
    writer task.

    It is also the connection as the server's :class:`~.keepalive.Keepalive` sees it: a client
    that was sent nothing for a ping interval is pinged (:meth:`ping_soon`), and one whose pong
    does not come back is disconnected.

    Cancellation: :meth:`end` ends the connection (the client left, was killed or did not answer
    a ping, the workspace closed): the handler stops reading commands
    (:meth:`EventSocket.stop_reading`), and the command it runs, the writer and the ping are
    cancelled; a write in progress finishes the frame in flight first
    (:class:`~.listener.PrefixedStream`), and the close frame, which waits for the connection's
    send lock, follows it.
    """

    __slots__ = (
        "_context",
        "_first",
        "_nursery",
        "_pinging",
        "_send_now",
        "_writing",
        "commanding",
        "sock",
        "stream",
    )

    def __init__(
        self,
        sock: EventSocket,
        stream: ClientStream,
        nursery: trio.Nursery,
        first: list[Event],
    ) -> None:
        self.sock = sock
        self.stream = stream
        self._nursery = nursery
        #: The scope of the command the handler runs (None: it waits for the next one).
        self.commanding: trio.CancelScope | None = None
        #: ``hello`` and the resumed frames, until the first writer has sent them.
        self._first: list[Event] | None = first
        #: The transport's direct write (set on the stream while the writer is idle).
        self._send_now = sock.send_now
        #: The running writer's scope, and the ping's (None: none runs).
        self._writing: trio.CancelScope | None = None
        self._pinging: trio.CancelScope | None = None
        #: The connection's context (its log context; quart's ``websocket`` for the asgi
        #: transport): a task starts in a copy of its starter's, which is often a publisher.
        self._context = contextvars.copy_context()
        stream.send_now = None  # nothing goes out before the first frames
        stream.start_writer = self.start
        stream.on_kill = self._on_kill
        self.start()

    def start(self) -> None:
        """Start the writer, unless it runs already (never blocks)."""
        if self._writing is None:
            self._writing = trio.CancelScope()
            self.stream.send_now = None  # it would overtake the frames the writer holds
            self._context.run(self._nursery.start_soon, self._write)

    def stop(self) -> None:
        """The connection is over: start nothing more, write nothing more directly."""
        stream = self.stream
        stream.start_writer = None
        stream.send_now = None

    def end(self) -> None:
        """End the connection (it is then closed with :func:`close_code`'s code)."""
        self.stop()
        self.sock.stop_reading()
        for scope in (self.commanding, self._writing, self._pinging):
            if scope is not None:
                scope.cancel()

    def _on_kill(self) -> None:
        # Never cut the frame in flight: it, then the close frame, get the bound.
        self.sock.limit_writes(trio.current_time() + SLOW_CLOSE_TIMEOUT)
        self.end()

    async def _write(self) -> None:
        scope = self._writing
        assert scope is not None
        try:
            with scope:
                if not await self._drain():
                    self.end()
                    return
        except PeerGone:
            self.end()
            return
        if not scope.cancel_called:
            # Drained: idle again, the broker writes directly (no checkpoint since the queue
            # was found empty, so nothing came in between).
            self._writing = None
            if self.stream.start_writer is not None:
                self.stream.send_now = self._send_now

    async def _drain(self) -> bool:
        """Write the first frames, then the queue until it is empty (True) or has ended, or
        the client was killed (False)."""
        sock, stream = self.sock, self.stream
        receive_nowait = stream.receive.receive_nowait
        first, self._first = self._first, None
        if first is not None:
            await sock.send_frames(first)
        while True:
            try:
                frames = [receive_nowait()]
            except trio.WouldBlock:
                return True
            except trio.EndOfChannel:  # the workspace closed, after everything queued
                return False
            if stream.is_killed:
                return False  # disconnected by the broker: close now, skip what is queued
            # Whatever else is already queued goes out in the same write.
            while len(frames) < sock.max_batch:
                try:
                    frames.append(receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            await sock.send_frames(frames)
            stream.after_receive()

    def ping_soon(self) -> None:
        """Ping the client in a task of the connection's own, unless a ping is on already (for
        the :class:`~.keepalive.Keepalive`; never blocks)."""
        if self._pinging is None and self.stream.start_writer is not None:
            self._pinging = trio.CancelScope()
            self._context.run(self._nursery.start_soon, self._ping)

    async def _ping(self) -> None:
        scope = self._pinging
        assert scope is not None
        answered = True
        with scope:
            try:
                answered = await self.sock.ping()
            except PeerGone:
                answered = False
        self._pinging = None
        if not answered:
            self.end()

    def sent_since(self) -> bool:
        """Whether anything was written to the client since the last call (the keepalive's
        question)."""
        sock = self.sock
        sent, sock.sent = sock.sent, False
        return sent


async def serve_connection(
    sock: EventSocket,
    ws: Workspace,
    sub: Subscription,
    api: Api,
    keepalive: Keepalive | None = None,
    nursery: trio.Nursery | None = None,
) -> None:
    """Serve one accepted websocket until the client leaves, is killed, does not answer a ping
    (``keepalive``: the server's timer, None when the transport pings by itself) or the
    workspace closes; then close it (see the module's docstring).

    ``nursery``: where the connection's tasks run (the writer, pings, command replies), one the
    transport has open for the connection anyway (and cancels once this returns: replies still
    pending then are dropped); None: a nursery of its own.
    """
    if nursery is None:
        async with trio.open_nursery() as own:
            await serve_connection(sock, ws, sub, api, keepalive, own)
            own.cancel_scope.cancel()
        return
    set_log_context(workspace_id=ws.id)  # this connection's records, to its close line
    if ws.closing:  # the workspace began closing while the upgrade was answered
        await sock.close(WS_CLOSE_GOING_AWAY, WORKSPACE_CLOSED)
        return
    client: ClientStream | None = None
    try:
        async with subscribed(ws, sub) as (stream, hello, first):
            client = stream
            writer = OnDemandWriter(sock, stream, nursery, [hello, *first])
            del hello, first
            if keepalive is not None:
                keepalive.add(writer)
            try:
                # The reader, in the handler's own task. Its wait is the transport's own
                # coroutine, in no scope of ours: an idle connection holds nothing more.
                receive, left = sock.receive, sock.left
                while True:
                    try:
                        raw = await receive()
                    except left:
                        break
                    if raw is None:
                        break
                    with trio.CancelScope() as writer.commanding:
                        await answer_command(raw, ws, api, stream, nursery)
                    writer.commanding = None
                writer.end()  # the client left, or the connection was ended
            finally:
                writer.stop()
                if keepalive is not None:
                    keepalive.discard(writer)
        await sock.close(*close_code(stream, ws))
    finally:
        if client is not None:
            client.on_kill = None  # no reference cycle (stream, writer) outlives the connection
            if client.kill_reason == TOO_SLOW_REASON:
                METRICS.slow_client_closes.labels(outcome=sock.ending()).inc()
