"""One address for HTTP and the event websocket: a connection dispatcher in front of hypercorn.

Each accepted connection's request head is read first and checked (see :func:`check_head`): a
head that is too long, too slow, malformed, or carries non-ASCII bytes in a header that a library
decodes later gets its error status here and the connection is closed. An upgrade to the event
websocket (``GET /v1/workspaces/{wid}/ws`` with ``Upgrade: websocket``) is then served by
trio-websocket directly (:mod:`crush_trio.server.ws_trio`), and a first ``GET
/v1/workspaces/{wid}/events`` by the SSE handler (:mod:`crush_trio.server.sse_listener`);
everything else, including event streams asked for on a reused keep-alive connection, goes to
hypercorn (:class:`HttpConnection`)
with the bytes already read put back in front of the stream.

Every connection runs inside :func:`contained`: whatever a peer sends, an exception ends that
connection only, with one log line.

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
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from contextvars import ContextVar
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import h11
import orjson
import trio
from trio_websocket import ConnectionClosed

from .._compat.hypercorn import (
    MAX_RECV,
    Closed,
    ConnectionState,
    HypercornConnection,
    Lifespan,
    RawData,
    WorkerContext,
)
from .head import HeadError, check_head, check_headers, read_head
from .peers import sandboxed_peer
from .security import strip_web_prefix

if TYPE_CHECKING:
    from types import TracebackType

    from hypercorn.config import Config as HypercornConfig

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
#: ``SO_LINGER`` on, with a zero timeout: closing the socket resets the connection and the
#: kernel discards what it has not sent.
_LINGER_RESET: Final = struct.pack("ii", 1, 0)

_WS_REQUEST: Final = re.compile(rb"^GET /v1/workspaces/[^/?\s]+/ws(?:\?[^\s]*)? HTTP/1\.1\r\n")
_WS_PATH: Final = re.compile(r"^/v1/workspaces/[^/]+/ws$")
_UPGRADE: Final = re.compile(rb"(?im)^upgrade:[ \t]*websocket[ \t]*\r?$")
_SSE_REQUEST: Final = re.compile(
    rb"^GET /v1/workspaces/[^/?%\s]+/events(?:\?[^\s]*)? HTTP/1\.1\r\n"
)
#: Headers that make a request more than a plain GET (a body, an upgrade, an expectation).
_NOT_PLAIN_GET: Final = re.compile(
    rb"(?im)^(?:transfer-encoding|upgrade|expect)[ \t]*:|^content-length[ \t]*:[ \t]*0*[1-9]"
)


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
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._eof_sent = False
        self._reader: trio.lowlevel.Task | None = None
        self._reader_done = trio.Event()
        self._reading = trio.CancelScope()

    async def read_data(self) -> None:
        self._reader = trio.lowlevel.current_task()
        try:
            with self._reading:
                await self._read_until_closed()
            if self._reading.cancelled_caught:  # a write found the peer gone (protocol_send)
                await self.protocol.handle(Closed())  # also ends a request read meanwhile
        finally:
            self._reader_done.set()

    async def protocol_send(self, event: Any) -> None:
        """hypercorn's send, except that a write failing because the peer has gone also ends the
        reader.

        With pipelined requests the reader waits (h11 paused) until the answer in progress has
        been written. When that write fails (the peer closed or reset), hypercorn closes the
        request's stream, which then never reports its end, so the reader would wait for a next
        cycle that never comes (observed: 30 s to more than 50 s). The peer is gone: nothing
        more can be read or answered, so the reader ends at once.
        """
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
        while not self._eof_sent:
            try:
                with trio.fail_after(self.config.read_timeout or math.inf):
                    data = await self.stream.receive_some(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                break
            await self.protocol.handle(RawData(data=bytes(data)))
            if not data:
                break
        else:
            await self._linger()
            return
        await self.protocol.handle(Closed())

    async def _linger(self) -> None:
        await discard_until_eof(self.stream)

    async def close_connection(self) -> None:
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


def strip_head_prefix(head: bytes, web_prefix: str) -> bytes:
    """``head`` (a checked request head and what followed it) with the web page's path prefix
    taken off the request target (see :func:`~.security.strip_web_prefix`)."""
    if not web_prefix:
        return head
    line_end = head.find(b"\r\n")
    method, target, version = head[:line_end].split(b" ", 2)
    path, sep, query = target.partition(b"?")
    stripped = strip_web_prefix(path.decode("ascii"), web_prefix)
    if stripped is None:
        return head
    target = stripped.encode("ascii") + sep + query
    return b" ".join((method, target, version)) + head[line_end:]


def is_event_websocket(head: bytes) -> bool:
    end = head.find(b"\r\n\r\n")
    return end >= 0 and bool(_WS_REQUEST.match(head)) and bool(_UPGRADE.search(head[:end]))


def is_event_stream(head: bytes) -> bool:
    """A plain HTTP/1.1 ``GET /v1/workspaces/{wid}/events`` (no body, no upgrade)."""
    end = head.find(b"\r\n\r\n")
    return end >= 0 and bool(_SSE_REQUEST.match(head)) and not _NOT_PLAIN_GET.search(head[:end])


WsHandler = Callable[[PrefixedStream], Awaitable[None]]


async def serve_dispatching(
    app: Any,
    config: HypercornConfig,
    sock: Any,
    ws_handler: WsHandler | None,
    *,
    shutdown_trigger: Callable[[], Awaitable[Any]],
    web_prefix: str = "",
    sse_handler: WsHandler | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` with hypercorn and the event websocket with ``ws_handler`` on ``sock``
    (``None``: every connection goes to hypercorn), and a first ``GET .../events`` with
    ``sse_handler`` (:func:`is_event_stream`; ``None``: hypercorn serves it). A first request
    under ``web_prefix`` (the web page's path prefix) is served as the path below it;
    :class:`ConnectionRules` does the same for later requests on a kept-alive connection.

    Mirrors hypercorn's own trio worker (lifespan, then connections, then a graceful deadline
    after ``shutdown_trigger`` returns) with the dispatcher in front of each connection.
    """
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(app, config, lifespan_state)
    context = WorkerContext(None)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    # A Unix socket needs no token, so no sandboxed command may connect to it (peers.py).
    unix = sock.family == socket.AF_UNIX

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as connections:

            async def handle(stream: trio.SocketStream) -> None:
                async with contained(stream):
                    refused = sandboxed_peer(stream.socket) if unix else None
                    if refused is not None:
                        log.warning("refused a Unix-socket connection: %s", refused)
                        await answer_error(stream, HeadError(403, refused))
                        return
                    try:
                        head = await read_head(stream)
                        if not head:
                            return
                        check_head(head)
                        head = strip_head_prefix(head, web_prefix)
                    except HeadError as exc:
                        await answer_error(stream, exc)
                        return
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        return
                    wrapped = PrefixedStream(stream, head)
                    event_websocket = ws_handler is not None and is_event_websocket(head)
                    event_stream = sse_handler is not None and is_event_stream(head)
                    del head  # the stream holds it as long as it is needed
                    if ws_handler is not None and event_websocket:
                        clear_user_timeout(stream.socket)
                        async with contained(wrapped, "event websocket"):
                            await ws_handler(wrapped)
                    elif sse_handler is not None and event_stream:
                        clear_user_timeout(stream.socket)  # as for the event websocket
                        async with contained(wrapped, "event stream"):
                            await sse_handler(wrapped)
                    else:
                        CONNECTION_STREAM.set(wrapped)  # this task's, and hypercorn's under it
                        # TCPServer is typed for SSL streams but takes any stream with a .socket.
                        await HttpConnection(
                            app,
                            config,
                            context,
                            ConnectionState(lifespan_state.copy()),
                            wrapped,
                        )

            task_status.started()
            async with trio.open_nursery() as accepting:
                accepting.start_soon(
                    partial(trio.serve_listeners, handle, [listener], handler_nursery=connections)
                )
                await shutdown_trigger()
                accepting.cancel_scope.cancel()
            await context.terminated.set()
            connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
