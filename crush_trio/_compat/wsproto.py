"""Adapter: ``wsproto``'s opening handshake, released once a server connection is open.

A ``wsproto.WSConnection`` keeps its ``H11Handshake`` (``WSConnection.handshake``) for its whole
life: the ``h11`` connection that parsed the upgrade request, that request's headers and an
empty event queue, about 2.5 KB per connection that nothing reads once the connection is open.
An event websocket server holds one per idle client, so :func:`release_handshake` replaces it
with :data:`RELEASED`, an object whose ``events()`` yields nothing.

What this relies on (public names, undocumented behaviour): once ``WSConnection.connection`` is
set (the server sent ``AcceptConnection``), ``WSConnection.send``, ``receive_data`` and
``state`` use only the connection, and ``events`` asks the handshake for its pending events
first and then the connection. Checked against :data:`CHECKED_AGAINST` (pinned exactly in
``pyproject.toml``); :func:`check` runs when this module is imported: it opens a client and a
server connection against each other (no I/O), releases the server's handshake and exchanges
messages both ways, raising :class:`~crush_trio._compat.CompatError` naming what changed. After
an upgrade: re-read ``wsproto/__init__.py``, adjust this module, and update
:data:`CHECKED_AGAINST` and the pin together.
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, Final

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import AcceptConnection, Event, Request, TextMessage

from . import CompatError

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["CHECKED_AGAINST", "RELEASED", "check", "release_handshake"]

#: The versions whose behaviour this module was checked against (pinned in pyproject.toml).
CHECKED_AGAINST: Final = {"wsproto": "1.3.2"}


class ReleasedHandshake:
    """What stands in for a finished opening handshake: no pending events, no state."""

    __slots__ = ()

    def events(self) -> Iterator[Event]:
        return iter(())


#: The one stand-in every released connection shares.
RELEASED: Final = ReleasedHandshake()


def release_handshake(connection: WSConnection) -> bool:
    """Drop ``connection``'s opening handshake if the connection is open (``True`` then).

    Call it after the server sent ``AcceptConnection``; before that (or on a connection whose
    handshake is still running) it does nothing and returns ``False``.
    """
    if connection.connection is None or connection.state is not ConnectionState.OPEN:
        return False
    connection.handshake = RELEASED  # type: ignore[assignment]
    return True


def _fail(what: str) -> CompatError:
    installed = ", ".join(f"{name} {_version(name)}" for name in CHECKED_AGAINST)
    checked = ", ".join(f"{name} {version}" for name, version in CHECKED_AGAINST.items())
    return CompatError(
        f"crush_trio._compat.wsproto: {what}. Installed: {installed}; this adapter was "
        f"checked against {checked}. Install the versions pinned in pyproject.toml, or update "
        "crush_trio/_compat/wsproto.py for the new version."
    )


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def check() -> None:
    """Verify that a server connection whose handshake was released still works both ways.

    Raises:
        CompatError: naming what no longer holds.
    """
    client = WSConnection(ConnectionType.CLIENT)
    server = WSConnection(ConnectionType.SERVER)
    if not hasattr(server, "handshake") or not hasattr(server, "connection"):
        raise _fail("WSConnection has no 'handshake' or 'connection' attribute")
    if release_handshake(server):
        raise _fail("a connection still in its handshake counted as open")
    server.receive_data(client.send(Request(host="example.com", target="/")))
    requests = [e for e in server.events() if isinstance(e, Request)]
    if len(requests) != 1:
        raise _fail("the server did not report the client's upgrade request")
    accept = server.send(AcceptConnection())
    if not release_handshake(server):
        raise _fail("an accepted connection is not open, or has no 'connection'")
    client.receive_data(accept)
    if not any(isinstance(e, AcceptConnection) for e in client.events()):
        raise _fail("the client did not see the server's accept")
    try:
        server.receive_data(client.send(TextMessage(data="ping")))
        got = [e.data for e in server.events() if isinstance(e, TextMessage)]
        client.receive_data(server.send(TextMessage(data="pong")))
        sent = [e.data for e in client.events() if isinstance(e, TextMessage)]
        state = server.state
    except Exception as exc:
        raise _fail(f"a released connection failed ({type(exc).__name__}: {exc})") from exc
    if got != ["ping"] or sent != ["pong"] or state is not ConnectionState.OPEN:
        raise _fail(f"a released connection exchanged {got} / {sent}, state {state}")


check()
