"""Adapter: ``trio-websocket``'s connection with permessage-deflate negotiated and bounded.

trio-websocket 0.12 negotiates no websocket extension, and its wrappers of a stream
(``wrap_client_stream``, ``wrap_server_stream``) build their own ``WSConnection`` and
``WebSocketConnection``, so nothing public lets a caller add one. The event websocket's server
(:mod:`crush_trio.server.ws_trio`) and the client library (:mod:`crush_trio.client.transport`)
need permessage-deflate (:class:`crush_trio.wsdeflate.BoundedDeflate`), so this module is the one
place that relies on trio-websocket's internals:

* :class:`DeflateConnection` subclasses ``WebSocketConnection``: on a client it rewrites the
  upgrade request its constructor stores in ``_initial_request`` (the ``wsproto`` ``Request``
  the reader sends first) to offer the extension; on a server it replaces ``_accept(request,
  subprotocol, extra_headers)`` (called by ``WebSocketRequest.accept``) with one whose
  ``AcceptConnection`` carries the extension, so that wsproto negotiates it against the offer;
* it extends ``_handle_close_connection_event(event)``, the reader's handler of wsproto's
  ``CloseConnection``: when the extension stopped a received message that inflated past its
  bound, wsproto reports that as a ``CloseConnection`` with code 1009 while the connection is
  still ``OPEN`` (its public behaviour, verified by :func:`check`); the handler then does what
  trio-websocket's ``_handle_message_event`` does for an uncompressed message over the bound,
  with the same private names: it sets ``_close_reason``, sends the close frame with ``_send``,
  closes ``_recv_channel`` and clears ``_reader_running``, reading the state of ``_wsproto``;
* once a server's connection is open, its ``_open_handshake`` (set by then) and
  ``_for_testing_peer_closed_connection`` (which only trio-websocket's own tests wait for) are
  replaced by one event shared by every connection, already set (:data:`_SET`): all the library
  does with them is ``set()`` and ``wait()``, and an open connection holds two events fewer;
* :meth:`DeflateConnection.stop_reading` closes the connection's ``_recv_channel`` (as its
  ``_aclose`` does first), so that a wait in ``get_message`` ends; the reader's
  ``_handle_message_event`` ignores a closed channel;
* :attr:`DeflateConnection.send_lock` is the connection's ``_stream_lock``, the lock its
  ``_send`` (its only write to the stream) holds around ``send_all``: a server that also writes
  frames of its own to the stream takes the same lock, rather than one more per connection;
* :func:`wrap_client_stream` and :func:`wrap_server_stream` are trio-websocket's functions of
  the same names with that connection: they start its ``_reader_task`` in the caller's nursery
  and wait for ``_open_handshake`` (a client) or return ``_get_request()`` (a server).

Checked against trio-websocket :data:`CHECKED_AGAINST`, pinned exactly in ``pyproject.toml``
(with wsproto 1.3.2, whose public behaviour :func:`check` verifies too). :func:`check` runs when
this module is imported: it builds a client and a server connection (no I/O) and verifies every
name above, the signatures of the methods replaced or extended, that the reader and
``WebSocketRequest.accept`` still call them, and wsproto's report of an extension's failure; it
raises :class:`CompatError` naming what changed. An upgrade that breaks an assumption therefore
stops the server (and the client library) at import with that message, and
``tests/test_compat.py`` fails, instead of connections silently going uncompressed or a deflate
bomb being answered without a close frame. After an upgrade: re-read ``trio_websocket/_impl.py``,
adjust this module, and update :data:`CHECKED_AGAINST` and the pin together.
"""

from __future__ import annotations

import inspect
import re
from importlib import metadata
from typing import Any, Final

import trio
from trio_websocket import CloseReason, WebSocketConnection, WebSocketRequest
from wsproto import ConnectionType, WSConnection
from wsproto.connection import Connection, ConnectionState
from wsproto.events import AcceptConnection, CloseConnection, Request
from wsproto.extensions import Extension
from wsproto.frame_protocol import CloseReason as FrameCloseReason
from wsproto.frame_protocol import FrameDecoder, FrameProtocol

from . import CompatError
from .wsproto import release_handshake


class BoundedExtension(Extension):
    """A websocket extension that bounds inflation (:class:`crush_trio.wsdeflate.BoundedDeflate`
    is one): it says when a message inflated past its bound and why, so the connection closes
    with 1009."""

    #: Set once a message inflated past the bound (wsproto then stops parsing).
    overflowed: bool = False

    @property
    def too_big_reason(self) -> str:
        """The close reason sent with 1009."""
        raise NotImplementedError


__all__ = [
    "CHECKED_AGAINST",
    "CompatError",
    "DeflateConnection",
    "check",
    "wrap_client_stream",
    "wrap_server_stream",
]

#: The trio-websocket version whose internals this module was checked against.
CHECKED_AGAINST: Final = {"trio-websocket": "0.12.2"}

#: The private methods of ``WebSocketConnection`` used here: parameters (besides self).
_METHODS: Final = {
    "_accept": ("request", "subprotocol", "extra_headers"),
    "_handle_close_connection_event": ("event",),
    "_send": ("event",),
    "_reader_task": (),
    "_get_request": (),
    "_handle_message_event": ("event",),
}


#: The events an open server connection no longer needs its own of: one for all, already set.
_SET: Final = trio.Event()
_SET.set()
#: Those events, and the only things trio-websocket does with them.
_SHARED_EVENTS: Final = {
    "_open_handshake": (".set()", ".wait()", " = trio.Event()"),
    "_for_testing_peer_closed_connection": (".set()", " = trio.Event()"),
}


def _fail(what: str) -> CompatError:
    try:
        installed = metadata.version("trio-websocket")
    except metadata.PackageNotFoundError:
        installed = "(not installed)"
    return CompatError(
        f"crush_trio._compat.trio_websocket: {what}. Installed: trio-websocket {installed}; "
        f"this adapter was checked against trio-websocket {CHECKED_AGAINST['trio-websocket']}. "
        "Install the version pinned in pyproject.toml, or update "
        "crush_trio/_compat/trio_websocket.py for the new one."
    )


class DeflateConnection(WebSocketConnection):
    """A trio-websocket connection that negotiates permessage-deflate through ``deflate``
    (None: no extension, exactly trio-websocket's behaviour).

    A client offers it in its upgrade request; a server accepts it only when the client offered
    it (:attr:`compressing` tells afterwards). A received message that inflates past the
    extension's bound closes the connection with 1009 and the extension's reason, as
    trio-websocket closes one whose uncompressed size is over ``max_message_size``. Built by
    :func:`wrap_client_stream` and :func:`wrap_server_stream`.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        ws_connection: WSConnection,
        *,
        deflate: BoundedExtension | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(stream, ws_connection, **kwargs)
        #: The extension offered or accepted, or None.
        self.deflate = deflate
        request = self._initial_request
        if deflate is not None and request is not None:
            self._initial_request = Request(
                host=request.host,
                target=request.target,
                extensions=[deflate],
                extra_headers=request.extra_headers,
                subprotocols=request.subprotocols,
            )

    @property
    def send_lock(self) -> trio.StrictFIFOLock:
        """The lock every write of this connection to its stream holds (pings, pongs, close,
        messages): a caller that writes to the stream itself holds it too, so that its writes
        and the connection's never interleave."""
        lock: trio.StrictFIFOLock = self._stream_lock
        return lock

    def stop_reading(self) -> None:
        """Stop handing messages over: ``get_message()``, a wait in it included, raises
        ``ConnectionClosed`` from now on, and the reader drops what still arrives (what
        trio-websocket's own close does first, without the close frame, which ``aclose()``
        still sends). Never blocks."""
        self._recv_channel.close()

    @property
    def compressing(self) -> bool:
        """Whether permessage-deflate was negotiated."""
        return self.deflate is not None and self.deflate.enabled()

    async def _accept(
        self, request: Request, subprotocol: str | None, extra_headers: list[tuple[bytes, bytes]]
    ) -> None:
        # trio-websocket's accept, with the extension (wsproto negotiates it against the offer).
        self._subprotocol = subprotocol
        self._path = request.target
        extensions: list[Extension] = [self.deflate] if self.deflate is not None else []
        await self._send(
            AcceptConnection(
                subprotocol=subprotocol, extra_headers=extra_headers, extensions=extensions
            )
        )
        release_handshake(self._wsproto)  # an open connection keeps nothing of its upgrade
        self._open_handshake.set()
        # Only ever set and waited for (see _check_events): one shared event, already set.
        self._open_handshake = self._for_testing_peer_closed_connection = _SET

    async def _handle_close_connection_event(self, event: CloseConnection) -> None:
        deflate = self.deflate
        if (
            deflate is not None
            and deflate.overflowed
            and self._wsproto.state == ConnectionState.OPEN
        ):
            # Not the peer's close: wsproto stopped parsing at a message that inflated past the
            # bound. Close with 1009 as trio-websocket does for an uncompressed one.
            reason = deflate.too_big_reason
            self._close_reason = CloseReason(1009, reason)
            await self._send(CloseConnection(code=1009, reason=reason))
            await self._recv_channel.aclose()
            self._reader_running = False
            return
        await super()._handle_close_connection_event(event)


async def wrap_client_stream(
    nursery: trio.Nursery,
    stream: trio.abc.Stream,
    host: str,
    resource: str,
    *,
    extra_headers: list[tuple[bytes, bytes]],
    message_queue_size: int,
    max_message_size: int,
    deflate: BoundedExtension | None,
) -> DeflateConnection:
    """trio-websocket's ``wrap_client_stream`` with a connection that offers ``deflate`` (None:
    no extension): the upgrade over ``stream``, its reader running in ``nursery``.

    Raises: what trio-websocket's raises (``ConnectionRejected`` from the reader, in
    ``nursery``, when the server refuses the upgrade).
    """
    conn = DeflateConnection(
        stream,
        WSConnection(ConnectionType.CLIENT),
        host=host,
        path=resource,
        client_extra_headers=extra_headers,
        message_queue_size=message_queue_size,
        max_message_size=max_message_size,
        deflate=deflate,
    )
    nursery.start_soon(conn._reader_task)
    await conn._open_handshake.wait()
    return conn


async def wrap_server_stream(
    nursery: trio.Nursery,
    stream: trio.abc.Stream,
    *,
    message_queue_size: int,
    max_message_size: int,
    deflate: BoundedExtension | None,
) -> WebSocketRequest:
    """trio-websocket's ``wrap_server_stream`` with a connection that accepts ``deflate`` when
    the client offers it: the upgrade request read from ``stream``, the reader running in
    ``nursery``. Its ``accept()`` returns a :class:`DeflateConnection`."""
    conn = DeflateConnection(
        stream,
        WSConnection(ConnectionType.SERVER),
        message_queue_size=message_queue_size,
        max_message_size=max_message_size,
        deflate=deflate,
    )
    nursery.start_soon(conn._reader_task)
    request: WebSocketRequest = await conn._get_request()
    return request


# -- the check -------------------------------------------------------------------------------------


class _Probe(Extension):
    """An extension that stops every received data frame as too big (for :func:`check`)."""

    name = "x-crush-probe"

    def enabled(self) -> bool:
        return True

    def offer(self) -> bool:
        return True

    def frame_inbound_payload_data(
        self, proto: FrameDecoder | FrameProtocol, data: bytes
    ) -> bytes | FrameCloseReason:
        return FrameCloseReason.MESSAGE_TOO_BIG


class _Unused(trio.abc.Stream):
    """A stream that is never used: lets :func:`check` build connections."""

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        raise NotImplementedError

    async def wait_send_all_might_not_block(self) -> None:
        raise NotImplementedError

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        raise NotImplementedError

    async def aclose(self) -> None:
        pass


def _check_methods() -> None:
    for name, parameters in _METHODS.items():
        method = getattr(WebSocketConnection, name, None)
        if method is None or not inspect.iscoroutinefunction(method):
            raise _fail(f"WebSocketConnection.{name} is gone or no longer a coroutine function")
        params = tuple(inspect.signature(method).parameters)[1:]
        if params != parameters:
            raise _fail(f"WebSocketConnection.{name} now takes {params}, not {parameters}")
    try:
        reader = inspect.getsource(WebSocketConnection._reader_task)
        accept = inspect.getsource(WebSocketRequest.accept)
    except (OSError, TypeError) as exc:
        raise _fail(f"the source of trio-websocket cannot be read ({exc})") from exc
    if "CloseConnection: self._handle_close_connection_event" not in reader:
        raise _fail("the reader no longer hands CloseConnection to _handle_close_connection_event")
    if "self._send(self._initial_request)" not in reader:
        raise _fail("the reader no longer sends _initial_request first")
    if "self._connection._accept(" not in accept:
        raise _fail("WebSocketRequest.accept no longer calls the connection's _accept")
    try:
        connection = inspect.getsource(WebSocketConnection)
        send = inspect.getsource(WebSocketConnection._send)
    except (OSError, TypeError) as exc:
        raise _fail(f"the source of trio-websocket cannot be read ({exc})") from exc
    _check_events()
    messages = inspect.getsource(WebSocketConnection._handle_message_event)
    if not re.search(
        r"await self\._send_channel\.send\(msg\)\s*except \(trio\.ClosedResourceError, "
        r"trio\.BrokenResourceError\):",
        messages,
    ):
        raise _fail("the reader no longer ignores a closed message channel")
    if connection.count("self._stream.send_all(") != 1 or not re.search(
        r"async with self\._stream_lock:(\n.*){0,4}await self\._stream\.send_all\(", send
    ):
        raise _fail("the connection no longer writes its stream only in _send, under _stream_lock")


def _check_events() -> None:
    try:
        source = inspect.getsource(inspect.getmodule(WebSocketConnection))  # type: ignore[arg-type]
    except (OSError, TypeError) as exc:
        raise _fail(f"the source of trio-websocket cannot be read ({exc})") from exc
    for name, uses in _SHARED_EVENTS.items():
        found = re.findall(rf"\.{name}\b(.{{0,16}})", source)
        if not found or any(not use.startswith(uses) for use in found):
            raise _fail(f"WebSocketConnection.{name} is now used otherwise than {uses}")


def _check_connection(conn: WebSocketConnection, ws: WSConnection) -> None:
    if getattr(conn, "_wsproto", None) is not ws:
        raise _fail("WebSocketConnection._wsproto no longer holds the wsproto connection")
    if getattr(conn, "_close_reason", False) is not None:
        raise _fail("WebSocketConnection._close_reason no longer starts as None")
    if getattr(conn, "_reader_running", None) is not True:
        raise _fail("WebSocketConnection._reader_running no longer starts as True")
    if not isinstance(getattr(conn, "_recv_channel", None), trio.MemoryReceiveChannel):
        raise _fail("WebSocketConnection._recv_channel is no longer a memory receive channel")
    if not isinstance(getattr(conn, "_stream_lock", None), trio.StrictFIFOLock):
        raise _fail("WebSocketConnection._stream_lock is no longer a trio.StrictFIFOLock")
    if not isinstance(getattr(conn, "_open_handshake", None), trio.Event):
        raise _fail("WebSocketConnection._open_handshake is no longer a trio.Event")


def _check_wsproto_reports_an_extension_failure() -> None:
    """What :class:`DeflateConnection` relies on from wsproto (public behaviour): a message an
    extension refuses comes out as a ``CloseConnection`` with its code, the state still OPEN."""
    conn = Connection(ConnectionType.SERVER, extensions=[_Probe()])
    conn.receive_data(bytes((0x81, 0x81)) + b"\0\0\0\0x")  # one masked text frame, "x"
    events = list(conn.events())
    codes = [e.code for e in events if isinstance(e, CloseConnection)]
    if codes != [1009] or conn.state is not ConnectionState.OPEN:
        raise _fail(
            f"wsproto now reports an extension's MESSAGE_TOO_BIG as {events!r} in state "
            f"{conn.state!r}, not one CloseConnection(1009) in state OPEN"
        )


def check() -> None:
    """Verify every internal this module relies on (no I/O).

    Raises:
        CompatError: a method is gone, is no longer a coroutine function, takes other parameters
            or is no longer called where this module expects; a connection no longer holds
            one of the attributes used; or wsproto reports an extension's failure otherwise.
    """
    _check_methods()
    client_ws = WSConnection(ConnectionType.CLIENT)
    try:
        client = WebSocketConnection(
            _Unused(),
            client_ws,
            host="example.invalid",
            path="/",
            client_extra_headers=[],
            message_queue_size=1,
            max_message_size=1,
        )
        server_ws = WSConnection(ConnectionType.SERVER)
        server = WebSocketConnection(_Unused(), server_ws, message_queue_size=1, max_message_size=1)
    except Exception as exc:
        raise _fail(f"building a WebSocketConnection failed ({exc!r})") from exc
    request = getattr(client, "_initial_request", None)
    if not isinstance(request, Request) or request.target != "/":
        raise _fail("WebSocketConnection._initial_request no longer holds the client's Request")
    if getattr(server, "_initial_request", False) is not None:
        raise _fail("WebSocketConnection._initial_request is no longer None on a server")
    _check_connection(client, client_ws)
    _check_connection(server, server_ws)
    _check_wsproto_reports_an_extension_failure()


check()
