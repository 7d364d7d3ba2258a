"""Adapter: ``hypercorn``'s per-connection server for Trio, with its read loop and close as hooks.

The listener (:mod:`crush_trio.server.listener`) puts its own dispatcher in front of hypercorn
and serves each HTTP connection with hypercorn's ``hypercorn.trio.tcp_server.TCPServer``, changing
how a connection reads and closes (a close that is never lost and lingers; a reader that ends
when a write finds the peer gone). ``hypercorn``'s documented interface (``hypercorn.trio.serve``
and its ``Config``) has no seam for either, so this module is the one place that relies on its
internals:

* ``TCPServer._read_data()`` (the connection's read loop, called once by ``TCPServer.run``) and
  ``TCPServer._close()`` (called when the connection ends and on a ``Closed`` event the protocol
  sends) are private; :class:`HypercornConnection` maps them to the public hooks
  :meth:`~HypercornConnection.read_data` and :meth:`~HypercornConnection.close_connection`,
  which default to hypercorn's own behaviour;
* the HTTP/1.1 connection state behind a connection (``TCPServer.protocol``, hypercorn's
  ``ProtocolWrapper``; its ``protocol``, the ``H11Protocol``; its ``connection``, an
  ``h11.Connection``), read only through h11's public API by
  :meth:`HypercornConnection.cycle_state`, so that the listener can take a kept-alive
  connection back between two requests; when that chain is not there (HTTP/2, a websocket, a
  newer hypercorn) the answer is False and hypercorn keeps serving the connection;
* ``hypercorn.protocol.ws_stream.PerMessageDeflate``: the extension class hypercorn's websocket
  handshake (``Handshake.accept``) builds, by that module-level name, for every websocket it
  accepts. hypercorn has no setting for its websocket extensions, so
  :func:`use_websocket_deflate` replaces that name (process-wide) with a subclass of wsproto's
  ``PerMessageDeflate`` that bounds inflation (:class:`crush_trio.wsdeflate.HypercornDeflate`);
* the undocumented modules the listener builds a worker from: ``TCPServer`` and ``MAX_RECV``,
  ``Lifespan``, ``WorkerContext``, the ``RawData``, ``Closed`` and ``Updated`` events,
  ``ConnectionState`` and ``wrap_app`` (re-exported here, so the listener imports none of
  hypercorn's internals itself).

Checked against hypercorn :data:`CHECKED_AGAINST`, pinned exactly in ``pyproject.toml``.
:func:`check` runs when this module is imported and raises :class:`CompatError` naming what
changed (a method gone, a different signature, ``run`` no longer calling the hooks), so an
upgrade stops the server at start-up and fails ``tests/test_compat.py`` instead of silently
serving connections without the listener's close rules (or websockets that inflate a whole
message before checking its size).
"""

from __future__ import annotations

import inspect
import re
from importlib import metadata
from typing import Final, Literal

import h11
from wsproto.extensions import PerMessageDeflate

from . import CompatError

__all__ = [
    "CHECKED_AGAINST",
    "MAX_RECV",
    "Closed",
    "CompatError",
    "ConnectionState",
    "HypercornConnection",
    "Lifespan",
    "RawData",
    "Updated",
    "WorkerContext",
    "check",
    "use_websocket_deflate",
    "wrap_app",
]

#: The hypercorn version whose internals this module was checked against.
CHECKED_AGAINST: Final = {"hypercorn": "0.18.0"}

#: The private methods of ``TCPServer`` mapped to hooks: name and parameters (besides self).
_HOOKED: Final = {"_read_data": (), "_close": ()}
#: The module-level name hypercorn's websocket handshake builds its extension from.
_DEFLATE_NAME: Final = "PerMessageDeflate"
#: The attributes of a ``TCPServer`` the listener's hooks use.
_ATTRIBUTES: Final = ("app", "config", "context", "send_lock", "stream")


def _fail(what: str) -> CompatError:
    try:
        installed = metadata.version("hypercorn")
    except metadata.PackageNotFoundError:
        installed = "(not installed)"
    return CompatError(
        f"crush_trio._compat.hypercorn: {what}. Installed: hypercorn {installed}; this adapter "
        f"was checked against hypercorn {CHECKED_AGAINST['hypercorn']}. Install the version "
        "pinned in pyproject.toml, or update crush_trio/_compat/hypercorn.py for the new one."
    )


try:
    from hypercorn.events import Closed, RawData, Updated
    from hypercorn.protocol import ProtocolWrapper, ws_stream
    from hypercorn.protocol.h11 import H11Protocol
    from hypercorn.trio.lifespan import Lifespan
    from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.typing import ConnectionState
    from hypercorn.utils import wrap_app
except ImportError as exc:
    raise _fail(f"an internal module or name is gone ({exc})") from exc


class HypercornConnection(TCPServer):
    """hypercorn's connection server with its read loop and close as overridable hooks.

    Construct it as ``TCPServer`` (``app, config, context, state, stream``) and await it.
    """

    async def _read_data(self) -> None:
        await self.read_data()

    async def _close(self) -> None:
        await self.close_connection()

    async def read_data(self) -> None:
        """Read the connection until it ends, feeding the protocol (hypercorn's own loop)."""
        await super()._read_data()

    async def close_connection(self) -> None:
        """Send EOF and close the stream (hypercorn's own close)."""
        await super()._close()

    def cycle_state(self) -> Literal["idle", "answering", "busy"]:
        """Where an HTTP/1.1 connection is between two requests, from h11's states:

        * ``"idle"``: at rest, the last answer sent in full, no byte of a next request taken in
          (both states ``IDLE``, nothing in h11's buffer);
        * ``"answering"``: the request read to its end, nothing of a next one taken in, its
          answer not ended yet or hypercorn's next cycle not started yet (it starts once the
          answer has ended and the application's task is done, then hypercorn sends
          ``Updated(idle=True)``). A client that has the whole body of a ``content-length``
          answer may send its next request before the answer's end has been recorded;
        * ``"busy"``: anything else: a request being read, HTTP/2, a websocket, the protocol
          not set up yet, or the chain of attributes this reads not there.
        """
        wrapper = getattr(self, "protocol", None)
        connection = getattr(getattr(wrapper, "protocol", None), "connection", None)
        if type(connection) is not h11.Connection or connection.trailing_data != (b"", False):
            return "busy"
        ours, theirs = connection.our_state, connection.their_state
        if ours is h11.IDLE and theirs is h11.IDLE:
            return "idle"
        if theirs is h11.DONE and ours in (h11.SEND_RESPONSE, h11.SEND_BODY, h11.DONE):
            return "answering"
        return "busy"


def use_websocket_deflate(extension: type[PerMessageDeflate]) -> None:
    """Make every websocket hypercorn accepts from now on negotiate permessage-deflate with
    ``extension`` (built with no arguments, like wsproto's) instead of wsproto's own class.

    Process-wide: hypercorn looks the class up by its name in ``hypercorn.protocol.ws_stream``
    at each handshake, and this replaces that name.
    """
    setattr(ws_stream, _DEFLATE_NAME, extension)


def check() -> None:
    """Verify the internals this module relies on (no I/O).

    Raises:
        CompatError: a hooked method is gone, is no longer a coroutine function, takes other
            parameters or is no longer called by ``TCPServer.run``/``protocol_send``; a
            connection lacks an attribute the listener uses; or the websocket handshake no
            longer builds its extension from ``ws_stream.PerMessageDeflate``.
    """
    for name, parameters in _HOOKED.items():
        method = getattr(TCPServer, name, None)
        if method is None or not inspect.iscoroutinefunction(method):
            raise _fail(f"TCPServer.{name} is gone or no longer a coroutine function")
        params = tuple(inspect.signature(method).parameters)[1:]
        if params != parameters:
            raise _fail(f"TCPServer.{name} now takes {params}, not {parameters}")
    try:
        run = inspect.getsource(TCPServer.run)
        send = inspect.getsource(TCPServer.protocol_send)
    except (OSError, TypeError) as exc:
        raise _fail(f"the source of TCPServer cannot be read ({exc})") from exc
    if "self._read_data()" not in run or "self._close()" not in run:
        raise _fail("TCPServer.run no longer calls self._read_data() and self._close()")
    if "self._close()" not in send:
        raise _fail("TCPServer.protocol_send no longer calls self._close() on Closed")
    init = tuple(inspect.signature(TCPServer.__init__).parameters)[1:]
    if init != ("app", "config", "context", "state", "stream"):
        raise _fail(f"TCPServer() now takes {init}")
    source = inspect.getsource(TCPServer.__init__)
    missing = [name for name in _ATTRIBUTES if f"self.{name} =" not in source]
    if missing:
        raise _fail(f"TCPServer no longer sets {', '.join(missing)}")
    for owner, attribute in ((ProtocolWrapper, "protocol"), (H11Protocol, "connection")):
        try:
            init_source = inspect.getsource(owner.__init__)
        except (OSError, TypeError) as exc:
            raise _fail(f"the source of {owner.__name__} cannot be read ({exc})") from exc
        if not re.search(rf"self\.{attribute}\b[^=\n]*=", init_source):
            raise _fail(f"{owner.__name__} no longer sets self.{attribute}")
    if not isinstance(MAX_RECV, int) or MAX_RECV <= 0:
        raise _fail("hypercorn.trio.tcp_server.MAX_RECV is no longer a positive int")
    deflate = getattr(ws_stream, _DEFLATE_NAME, None)
    if not (isinstance(deflate, type) and issubclass(deflate, PerMessageDeflate)):
        raise _fail(f"hypercorn.protocol.ws_stream.{_DEFLATE_NAME} is no longer wsproto's class")
    handshake = getattr(ws_stream, "Handshake", None)
    try:
        accept = inspect.getsource(handshake.accept)  # type: ignore[union-attr]
    except (AttributeError, OSError, TypeError) as exc:
        raise _fail(f"ws_stream.Handshake.accept cannot be read ({exc})") from exc
    if f"[{_DEFLATE_NAME}()]" not in accept:
        raise _fail(
            f"ws_stream.Handshake.accept no longer builds its extension as {_DEFLATE_NAME}()"
        )


check()
