"""The connection layer under the dispatcher (:mod:`.dispatch`): whole-frame writes, hypercorn's
connection with its close rules, and containment.

* :class:`PrefixedStream`: a socket stream with the bytes the dispatcher already read put back
  in front of it, whose every write is a whole frame (or the connection is aborted);
* :class:`HttpConnection`: hypercorn's connection with a close that is never lost, a lingering
  close, and a kept-alive connection handed back to the dispatcher between two requests;
* :class:`ConnectionRules`: the head rules for the requests hypercorn serves;
* :func:`contained`: whatever a peer sends, an exception ends that connection only, with one
  log line.

Why trio-websocket for the event websocket: hypercorn's websocket send path costs about three
times the CPU per message of a bare trio-websocket server, keeps five tasks per idle connection,
and writes inside a shielded scope that no timeout can interrupt (docs/performance.md).
trio-websocket's sends are cancellable, so a stalled client can be cut off by the broker at once.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import socket
import struct
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final

import h11
import orjson
import trio
from trio_websocket import ConnectionClosed

from .._compat.hypercorn import (
    MAX_RECV,
    Closed,
    HypercornConnection,
    RawData,
    Updated,
)
from .head import HEAD_LIMIT, HEAD_TIMEOUT, HeadError, check_headers
from .security import strip_web_prefix

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Sequence
    from types import TracebackType


log = logging.getLogger(__name__)

#: After the server has answered and sent EOF, how long it keeps reading (and discarding) what
#: the client still sends before closing the socket (seconds) ...
LINGER_TIMEOUT: Final = 2.0
#: ... and at most how many bytes it discards (a request body the answer made moot).
LINGER_BYTES: Final = 64 * 1024 * 1024
#: Bound on writing an error answer of the dispatcher, or the last bytes before a close (seconds).
SEND_TIMEOUT: Final = 2.0
#: Longest a connection's close may take: the wait for a write in progress, then the close.
CLOSE_BOUND: Final = SEND_TIMEOUT + 1.0
#: Longest one write of a response's bytes may take (seconds); a peer that takes nothing for
#: this long counts as gone and the connection is closed.
WRITE_TIMEOUT: Final = 30.0
#: A write cancelled part-way through (a timeout, shutdown, the end of its handler) still
#: finishes the frame it was writing within this bound (seconds), so that nothing is ever
#: written after a frame cut short; a frame not finished in time aborts the connection (reset).
FRAME_FINISH_TIMEOUT: Final = SEND_TIMEOUT
#: Longest the reader of a kept-alive connection waits, holding the start of a next request,
#: for hypercorn to end the answer before it and start its next cycle (seconds); then the
#: request goes to hypercorn.
CYCLE_TIMEOUT: Final = 1.0
#: How every request the dispatcher may take over from hypercorn begins.
_GET: Final = b"GET "
#: ``SO_LINGER`` on, with a zero timeout: closing the socket resets the connection and the
#: kernel discards what it has not sent.
_LINGER_RESET: Final = struct.pack("ii", 1, 0)

_WS_PATH: Final = re.compile(r"^/v1/workspaces/[^/]+/ws$")


def clear_user_timeout(sock: Any) -> None:
    """Take ``TCP_USER_TIMEOUT`` (inherited from the listening socket) off an event websocket.

    The event websocket has its own policy for slow clients, and its sends can be cancelled: lossy
    events are dropped (then a ``gap``), and a client that cannot take a must-deliver event within
    ``server.must_deliver_timeout`` is closed with 1013. The kernel's timeout, which also aborts a
    connection whose receive window stays closed that long, would cut off clients that are only
    slow (a busy process reading hundreds of connections) before that policy could apply.
    """
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 0)
        except OSError as exc:  # not a TCP socket (a test stream), or a closed one
            log.debug("could not clear TCP_USER_TIMEOUT: %s", exc)


class PrefixedStream(trio.abc.HalfCloseableStream):
    """A socket stream with bytes already read put back in front of it, whose writes are whole.

    A write is never cut short and followed by more bytes: every frame a caller hands it (one
    write is one frame, or several with their ends given to :meth:`send_frames`) is written whole,
    or the connection is aborted (:meth:`abort`: reset, the kernel discards what it has not sent,
    and nothing more is written). So a websocket close frame (or an HTTP response after a body) is
    only ever written at a frame boundary:

    * a write cancelled part-way through finishes the frame it was writing, shielded, within
      :data:`FRAME_FINISH_TIMEOUT` (or by :attr:`write_deadline` when one is set), then lets the
      cancellation through; a frame not finished by then aborts the connection;
    * once :meth:`limit_writes` set a deadline (a client disconnected as too slow), every write
      must end by then; one still going, or begun later, aborts the connection.

    An EOF or a close waits for a write in progress (a close at most :data:`SEND_TIMEOUT`, then it
    aborts) instead of failing with ``BusyResourceError`` or ending a frame cut short with a FIN.
    Writes themselves are serialized by their callers (hypercorn's and trio-websocket's send
    locks), so the write path costs no extra lock.
    """

    __slots__ = (
        "_open",
        "_pending",
        "_prefix",
        "_write_scope",
        "_writing",
        "aborted",
        "broken",
        "head",
        "socket",
        "transport",
        "write_deadline",
    )

    def __init__(self, stream: trio.SocketStream, prefix: bytes) -> None:
        self.transport = stream
        self.socket = stream.socket
        self._prefix = prefix
        self.head = prefix  # the request head as read (the websocket endpoint reads Host from it)
        self._writing: trio.Event | None = None
        #: Writes must be over by this time (trio clock); see :meth:`limit_writes`.
        self.write_deadline = math.inf
        self._write_scope: trio.CancelScope | None = None
        #: The connection was aborted: a frame could not be written whole in time.
        self.aborted = False
        #: A write failed: the peer reset or closed the connection.
        self.broken = False
        #: The rest of a frame that :meth:`write_nowait` began: the next write sends it first.
        self._pending: bytes | None = None
        #: Neither aborted, broken, half-closed nor given a write deadline: what
        #: :attr:`writable_now` needs besides no write in progress or pending.
        self._open = True

    def receive_some(self, max_bytes: int | None = None) -> Coroutine[Any, Any, bytes]:
        # Once the prefix is read, the socket stream's own coroutine: a connection idle in a
        # read (every event websocket) holds one coroutine frame less.
        if self._prefix:
            return self._receive_prefix(max_bytes)
        return self.transport.receive_some(max_bytes)

    async def _receive_prefix(self, max_bytes: int | None) -> bytes:
        size = len(self._prefix) if max_bytes is None else max_bytes
        data, self._prefix = self._prefix[:size], self._prefix[size:]
        await trio.lowlevel.checkpoint()
        return data

    def limit_writes(self, deadline: float) -> None:
        """Every write from now on (the one in progress included) must end by ``deadline``
        (trio clock); one that has not then aborts the connection. Only ever moves earlier."""
        self.write_deadline = min(self.write_deadline, deadline)
        self._open = False
        if self._write_scope is not None:
            self._write_scope.deadline = min(self._write_scope.deadline, self.write_deadline)

    def abort(self) -> None:
        """Reset the connection now: the kernel discards the bytes it has not sent yet (the rest
        of a frame cut short among them) and the peer gets no more bytes, only a reset. A task
        blocked on the socket wakes up with ``ClosedResourceError``."""
        if self.aborted:
            return
        self.aborted = True
        self._open = False
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        except OSError as exc:  # not a TCP socket, or a closed one: a plain close then
            log.debug("could not set SO_LINGER for a reset: %s", exc)
        self.socket.close()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Write ``data`` as one frame: whole, or the connection is aborted (see the class)."""
        await self.send_frames(data, None)

    @property
    def writable_now(self) -> bool:
        """:meth:`write_nowait` may be called: no write in progress, none pending, no deadline on
        the writes, the connection neither aborted, broken nor half-closed."""
        return self._open and self._writing is None and self._pending is None

    def write_nowait(self, data: bytes) -> bool:
        """Write the frame ``data`` without waiting, as far as the socket takes it now (only when
        :attr:`writable_now`; the caller serializes it with the other writes).

        Returns True when all of it was written. Else the rest is pending: the next write
        (:meth:`send_frames`, :meth:`send_all`, :meth:`send_eof`) sends it first, so frames stay
        whole and in order; an error of the socket is left for that write to report.
        """
        try:
            # Asked each time: a socket closed underneath answers -1 (EBADF), where a kept
            # number could by now be another connection's or file's.
            sent = os.write(self.socket.fileno(), data)
        except OSError:  # would block (EAGAIN), or the peer is gone: the next write finds out
            sent = 0
        if sent == len(data):
            return True
        self._pending = data[sent:]
        return False

    async def send_frames(
        self, data: bytes | bytearray | memoryview, ends: Sequence[int] | None
    ) -> None:
        """Write ``data``, frames that end at the offsets ``ends`` (ascending, the last one
        ``len(data)``; None: ``data`` is one frame).

        Cancellation: a frame already begun is finished first (see the class), then
        ``Cancelled`` goes through; frames not begun are not written.

        Raises:
            trio.BrokenResourceError: the peer reset or closed the connection, or it was
                aborted because the write did not end by :attr:`write_deadline`.
            trio.ClosedResourceError: the stream was closed (or aborted) already, or EOF sent.
        """
        await self._write_done()  # returns at once unless an EOF is being sent
        if self.aborted:
            raise trio.ClosedResourceError("the connection was aborted")
        if self.socket.did_shutdown_SHUT_WR:
            raise trio.ClosedResourceError("can't send data after sending EOF")
        self._writing = writing = trio.Event()
        pending = self._pending
        if pending is not None:  # the rest of a frame begun by write_nowait goes first
            self._pending = None
            head = len(pending)
            if ends is None:
                ends = (head, head + len(data)) if data else (head,)
            else:
                ends = (head, *(head + end for end in ends))
            data = pending + bytes(data)
        view = memoryview(data)
        sent = 0
        try:
            if not view:
                await trio.lowlevel.checkpoint()
                return
            with trio.CancelScope(deadline=self.write_deadline) as scope:
                self._write_scope = scope
                try:
                    while sent < len(view):
                        sent += await self._send_some(view[sent:])
                except trio.Cancelled:
                    # Cancelled from outside (or the deadline passed): finish the frame in
                    # flight so that whatever is written next starts at a frame boundary.
                    self._write_scope = None
                    await self._finish(view, sent, ends)
                    raise
            if scope.cancelled_caught:  # write_deadline passed before the write was over
                self.abort()
                raise trio.BrokenResourceError("write deadline passed: the connection was aborted")
        finally:
            self._write_scope = None
            self._writing = None
            writing.set()

    async def _finish(self, view: memoryview, sent: int, ends: Sequence[int] | None) -> None:
        """Write the rest of the frame that ``sent`` is in the middle of (nothing at a frame
        boundary), bounded; abort the connection when it does not go out in time."""
        if ends is None:
            end = len(view) if sent else 0
        else:
            end = next((e for e in ends if e >= sent), len(view))
        if end <= sent:
            return
        if math.isinf(self.write_deadline):
            bound = trio.current_time() + FRAME_FINISH_TIMEOUT
        else:
            bound = self.write_deadline
        with trio.CancelScope(shield=True, deadline=bound) as finishing:
            self._write_scope = finishing
            try:
                while sent < end:
                    sent += await self._send_some(view[sent:end])
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the peer is gone: nothing it could misread
            finally:
                self._write_scope = None
        if finishing.cancelled_caught:
            log.info(
                "aborting a connection from %s: a frame was not taken within its bound "
                "(%d of %d bytes written)",
                _peer(self.transport),
                sent,
                end,
            )
            self.abort()

    async def _send_some(self, view: memoryview) -> int:
        try:
            return await self.socket.send(view)
        except trio.ClosedResourceError:
            self.broken = True
            self._open = False
            raise
        except OSError as exc:
            self.broken = True
            self._open = False
            if exc.errno == errno.EBADF:
                raise trio.ClosedResourceError("the connection was closed") from None
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc

    async def _write_done(self) -> None:
        while self._writing is not None:
            await self._writing.wait()

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        self._open = False
        if self._pending is not None:
            await self.send_frames(b"", None)
        await self._write_done()
        self._writing = writing = trio.Event()
        try:
            await self.transport.send_eof()
        finally:
            self._writing = None
            writing.set()

    async def aclose(self) -> None:
        self._open = False
        with trio.move_on_after(SEND_TIMEOUT, shield=True):
            await self._write_done()
        if self._writing is not None or self._pending is not None:
            self.abort()  # a frame still going out: never end it cut short with a FIN
        await trio.aclose_forcefully(self.transport)


#: The stream of the connection a task serves (set by the dispatcher for hypercorn's tasks, so
#: that the event websocket of the ``asgi`` transport can bound its writes).
CONNECTION_STREAM: ContextVar[PrefixedStream | None] = ContextVar(
    "crush_trio_connection_stream", default=None
)


async def answer_error(stream: trio.abc.HalfCloseableStream, error: HeadError) -> None:
    """Write the dispatcher's own error answer (the connection is closed afterwards)."""
    body = orjson.dumps({"message": error.message})
    reason = {
        400: "Bad Request",
        403: "Forbidden",
        408: "Request Timeout",
        431: "Request Header Fields Too Large",
    }
    head = (
        f"HTTP/1.1 {error.status} {reason.get(error.status, '')}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode()
    await answer_and_linger(stream, head + body, SEND_TIMEOUT)


async def answer_and_linger(
    stream: trio.abc.HalfCloseableStream, answer: bytes, write_within: float
) -> None:
    """Write a whole answer and EOF within ``write_within`` seconds, then discard what the client
    still sends until it closes (:func:`discard_until_eof`): the answer is not lost to a reset."""
    with trio.move_on_after(write_within):
        try:
            await stream.send_all(answer)
            await stream.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return
    await discard_until_eof(stream)


async def discard_until_eof(stream: trio.abc.ReceiveStream) -> None:
    """The lingering part of a close: read and drop what the client still sends (after our
    answer and EOF) until its EOF, :data:`LINGER_TIMEOUT` or :data:`LINGER_BYTES`, so that closing
    with unread data does not make the kernel reset the connection before the client has read
    the answer."""
    discarded = 0
    with trio.move_on_after(LINGER_TIMEOUT):
        while discarded <= LINGER_BYTES:
            try:
                data = await stream.receive_some(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return
            if not data:
                return
            discarded += len(data)


def _peer(stream: Any) -> str:
    try:
        peer = stream.socket.getpeername()
    except (OSError, AttributeError):
        return "?"
    if isinstance(peer, tuple):
        return f"{peer[0]}:{peer[1]}"
    return str(peer) or "unix socket"


def _describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, or of the first leaf of a group."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


#: Exceptions that belong to the server's lifetime, not to one connection: never contained.
_LIFETIME: Final = (trio.Cancelled, KeyboardInterrupt, SystemExit, GeneratorExit)
#: What a peer that left or broke the protocol makes the libraries raise: logged at DEBUG only,
#: so that a peer cannot fill the log.
_PEER_GONE: Final = (
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    ConnectionError,
    ConnectionClosed,
    h11.ProtocolError,
)


def _only_peer_gone(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_peer_gone(e) for e in exc.exceptions)
    return isinstance(exc, _PEER_GONE)


def _log_contained(what: str, peer: str, exc: BaseException) -> None:
    level = logging.DEBUG if _only_peer_gone(exc) else logging.WARNING
    log.log(level, "%s from %s closed after an error: %s", what, peer, _describe(exc))


def contained(stream: trio.abc.AsyncResource, what: str = "connection") -> Contained:
    """Run one connection's handler: any exception it raises closes ``stream`` and is logged in
    one line (WARNING; DEBUG when it only says that the peer left or broke the protocol); only
    cancellation and interpreter exits propagate (they belong to the server's lifetime). The
    stream is always closed on the way out, then a DEBUG line ``<what> from <peer> closed`` says
    so (what a test waits for before it counts the server's descriptors)."""
    return Contained(stream, what)


class Contained:
    """The async context manager of :func:`contained`.

    A class rather than an ``asynccontextmanager`` generator: every open connection holds one
    (an event websocket two) for its whole life, and this one is a slotted object of three
    references instead of a suspended generator, its frame and the wrapper's dictionary.
    """

    __slots__ = ("peer", "stream", "what")

    def __init__(self, stream: trio.abc.AsyncResource, what: str) -> None:
        self.stream = stream
        self.what = what
        self.peer = _peer(stream)

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        try:
            if exc is None:
                return False
            if isinstance(exc, Exception):  # ExceptionGroup included
                _log_contained(self.what, self.peer, exc)
                return True
            if isinstance(exc, BaseExceptionGroup):
                lifetime, rest = exc.split(_LIFETIME)
                if rest is not None:
                    _log_contained(self.what, self.peer, rest)
                if lifetime is not None:
                    raise lifetime from None
                return True
            return False
        finally:
            with trio.move_on_after(CLOSE_BOUND, shield=True):
                try:
                    await self.stream.aclose()
                except Exception as close_exc:
                    log.debug("closing a connection failed: %s", close_exc)
            log.debug("%s from %s closed", self.what, self.peer)


class HttpConnection(HypercornConnection):
    """hypercorn's connection with a close that is never lost and a lingering close (its read
    loop and close are hooks of :class:`~crush_trio._compat.hypercorn.HypercornConnection`).

    hypercorn closes a connection (``Connection: close``, HTTP/1.0, a response sent before the
    request body was read) from inside the application's task, where a cancellation at the close's
    first checkpoint used to leave the socket open (the client waiting for EOF forever, the socket
    in CLOSE-WAIT after the client left). Here the close is shielded and bounded, and it lingers:
    after EOF is sent, what the client still sends (a body the answer made moot) is read and
    discarded for up to :data:`LINGER_TIMEOUT`, so the kernel does not reset the connection
    before the client has read the answer.

    A kept-alive connection can be taken back between two requests: when the next request's
    head (read whole, within the dispatcher's bounds) starts while hypercorn is at rest
    (:meth:`_at_rest`) and ``take_over`` claims it (returns the bytes to serve it from),
    hypercorn's part ends without a write or a close, and :attr:`handed_back` holds those bytes
    for the dispatcher. Anything else (a request begun during an answer, one ``take_over``
    declines) goes to hypercorn as before.
    """

    def __init__(
        self, *args: Any, take_over: Callable[[bytes], bytes | None] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._eof_sent = False
        self._reader: trio.lowlevel.Task | None = None
        self._reader_done = trio.Event()
        self._reading = trio.CancelScope()
        self._take_over = take_over
        #: Set when hypercorn starts its next request cycle (see :meth:`_at_rest`).
        self._rested = trio.Event()
        #: The next request that ``take_over`` claimed (its head, and what followed it): the
        #: connection was left open for the dispatcher to serve it.
        self.handed_back: bytes | None = None
        #: When the connection, at rest between two requests, is closed (trio clock; inf while
        #: a request is served): the reader's own timer, see :meth:`protocol_send`.
        self._idle_deadline = math.inf
        #: The scope of the reader's wait for more bytes, and when that wait ends at the latest
        #: besides the idle timer (``read_timeout``).
        self._read_scope: trio.CancelScope | None = None
        self._read_limit = math.inf

    async def read_data(self) -> None:
        self._reader = trio.lowlevel.current_task()
        # The idle timer is the reader's own (see protocol_send): stop the one hypercorn started.
        await super().protocol_send(Updated(idle=False))
        self._set_idle_deadline(trio.current_time() + self.config.keep_alive_timeout)
        try:
            with self._reading:
                await self._read_until_closed()
            if self._reading.cancelled_caught:  # a write found the peer gone (protocol_send)
                await self.protocol.handle(Closed())  # also ends a request read meanwhile
        finally:
            self._reader_done.set()

    def _set_idle_deadline(self, deadline: float) -> None:
        self._idle_deadline = deadline
        if self._read_scope is not None:
            self._read_scope.deadline = min(deadline, self._read_limit)

    async def protocol_send(self, event: Any) -> None:
        """hypercorn's send, except that a write failing because the peer has gone also ends the
        reader.

        With pipelined requests the reader waits (h11 paused) until the answer in progress has
        been written. When that write fails (the peer closed or reset), hypercorn closes the
        request's stream, which then never reports its end, so the reader would wait for a next
        cycle that never comes (observed: 30 s to more than 50 s). The peer is gone: nothing
        more can be read or answered, so the reader ends at once.
        """
        if isinstance(event, Updated):
            # The idle timer is a deadline on the reader's wait, not hypercorn's task per
            # request: that task's restart comes from the application's task, which the
            # framework cancels as the answer ends, so it was lost (an idle kept-alive
            # connection never closed), and a task per request costs more than a deadline.
            if event.idle:  # h11 is in its next cycle already
                self._rested.set()
                self._set_idle_deadline(trio.current_time() + self.config.keep_alive_timeout)
            else:
                self._set_idle_deadline(math.inf)
            return
        if not isinstance(event, RawData):
            await super().protocol_send(event)
            return
        async with self.send_lock:
            try:
                with trio.move_on_after(WRITE_TIMEOUT, shield=True) as writing:
                    await self.stream.send_all(event.data)
                gone = writing.cancelled_caught  # a peer that takes nothing counts as gone
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                gone = True
            if gone:
                self._reading.cancel()
                await self.protocol.handle(Closed())

    async def _read_until_closed(self) -> None:
        read_timeout = self.config.read_timeout or math.inf
        while not self._eof_sent:
            self._read_limit = trio.current_time() + read_timeout
            data: bytes | bytearray = b""
            try:
                deadline = min(self._idle_deadline, self._read_limit)
                with trio.CancelScope(deadline=deadline) as waiting:
                    self._read_scope = waiting
                    data = await self.stream.receive_some(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                break
            finally:
                self._read_scope = None
            if waiting.cancelled_caught:  # idle past keep_alive_timeout, or read_timeout
                break
            if data and _GET.startswith(data[:4]) and self._take_over and await self._at_rest():
                data, still_open = await self._rest_of_head(bytes(data))
                claimed = self._take_over(data) if still_open else None
                if claimed is not None:
                    self.handed_back = claimed
                    return
                await self.protocol.handle(RawData(data=data))
                if still_open:
                    continue
                break
            await self.protocol.handle(RawData(data=bytes(data)))
            if not data:
                break
        else:
            await self._linger()
            return
        await self.protocol.handle(Closed())

    async def _at_rest(self) -> bool:
        """Whether hypercorn is at rest between two requests (see :meth:`cycle_state`); while it
        is still ending the answer to the request before, waits for its next cycle (up to
        :data:`CYCLE_TIMEOUT`; hypercorn would not read the next request before then either)."""
        state = self.cycle_state()
        if state == "answering":
            with trio.move_on_after(CYCLE_TIMEOUT):
                while (state := self.cycle_state()) == "answering":
                    self._rested = trio.Event()
                    await self._rested.wait()
        return state == "idle"

    async def _rest_of_head(self, data: bytes) -> tuple[bytes, bool]:
        """``data`` and what follows it up to the end of its request head, within the
        dispatcher's bounds (:data:`~.head.HEAD_LIMIT`, :data:`~.head.HEAD_TIMEOUT`; a head
        not whole by then is left to hypercorn's rules), and whether the client is still
        there (False: it closed, or the connection broke)."""
        with trio.move_on_after(HEAD_TIMEOUT):
            while b"\r\n\r\n" not in data and len(data) < HEAD_LIMIT:
                try:
                    more = await self.stream.receive_some(MAX_RECV)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    return data, False
                if not more:
                    return data, False
                data += more
        return data, True

    async def _linger(self) -> None:
        await discard_until_eof(self.stream)

    async def close_connection(self) -> None:
        if self.handed_back is not None:
            return  # the dispatcher serves the connection on
        with trio.move_on_after(CLOSE_BOUND + LINGER_TIMEOUT + SEND_TIMEOUT, shield=True):
            if not self._eof_sent:
                self._eof_sent = True
                with trio.move_on_after(SEND_TIMEOUT):
                    try:
                        await self.stream.send_eof()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
            # The reader lingers (it is the task that may read); wait for it, except when the
            # server is shutting down (then the close is immediate).
            if self._reader not in (None, trio.lowlevel.current_task()):
                with trio.move_on_after(LINGER_TIMEOUT + SEND_TIMEOUT) as waiting:
                    if not self.context.terminated.is_set():
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(_set_when, self.context.terminated, waiting)
                            await self._reader_done.wait()
                            nursery.cancel_scope.cancel()
        await trio.aclose_forcefully(self.stream)


async def _set_when(event: Any, scope: trio.CancelScope) -> None:
    """Cancel ``scope`` once ``event`` (an awaitable-``wait()`` event) is set."""
    await event.wait()
    scope.cancel()


class ConnectionRules:
    """ASGI middleware in front of the app, for every request hypercorn serves (the first of a
    connection was checked by the dispatcher; later ones on a keep-alive connection were not):

    * the head rules of :func:`check_headers` (400, or a refused websocket upgrade with 400);
    * a response that starts before the request body was read to its end says
      ``Connection: close`` (the connection then closes with a lingering close), so that a client
      never sends its next request behind a body the server did not read.
    """

    def __init__(self, app: Any, web_prefix: str = "") -> None:
        self.app = app
        self.web_prefix = web_prefix

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            stripped = strip_web_prefix(scope["path"], self.web_prefix)
            if stripped is not None:
                # The web page's path prefix (the token cookie's Path): served as the path below.
                scope = {**scope, "path": stripped, "raw_path": stripped.encode("latin-1")}
            try:
                check_headers((name, value) for name, value in scope["headers"])
                if scope["type"] == "websocket" and not _WS_PATH.match(scope["path"]):
                    raise HeadError(
                        404,
                        f"no websocket at {scope['path']}; "
                        "the event websocket is /v1/workspaces/{wid}/ws",
                    )
            except HeadError as exc:
                await _refuse(scope, send, exc)
                return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        read = not _has_body(scope["headers"])

        async def receive_tracked() -> Any:
            nonlocal read
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                read = True
            return message

        async def send_marked(message: Any) -> None:
            if message["type"] == "http.response.start" and not read:
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"
                ]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive_tracked, send_marked)


async def _refuse(scope: Any, send: Any, error: HeadError) -> None:
    body = orjson.dumps({"message": error.message})
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if scope["type"] == "http":
        headers.append((b"connection", b"close"))
        prefix = "http.response"
    else:
        prefix = "websocket.http.response"
    try:
        await send({"type": f"{prefix}.start", "status": error.status, "headers": headers})
        await send({"type": f"{prefix}.body", "body": body})
    except _PEER_GONE as exc:  # the connection broke before the refusal could be written
        log.debug("refusal (%d) not sent: %s", error.status, _describe(exc))


def _has_body(headers: Any) -> bool:
    for name, value in headers:
        name = name.lower()
        if name == b"transfer-encoding":
            return True
        if name == b"content-length" and value.strip() not in (b"0", b""):
            return True
    return False
