"""Adapter: ``httpcore``'s HTTP/1.1 connection behind an ``httpx`` response, for the body reader.

:mod:`crush_trio.providers.body` reads an HTTP/1.1 response body from the socket itself and,
when it read the body whole, hands the connection back to ``httpcore``'s pool. Neither library
has a public seam for that, so this module is the one place that touches their private names:

* the wrappers between an ``httpx`` response stream and ``httpcore``'s connection:
  ``httpx._client.BoundAsyncStream._stream``,
  ``httpx._transports.default.AsyncResponseStream._httpcore_stream``,
  ``httpcore._async.connection_pool.PoolByteStream._stream`` and
  ``httpcore._async.http11.HTTP11ConnectionByteStream._connection``;
* the connection's ``h11`` state machine, ``AsyncHTTP11Connection._h11_state``: read to find
  the body bytes that arrived with the headers, and replaced by a state that finished one
  exchange (what ``h11`` reaches after a complete response) so that closing the response
  returns the connection to the pool instead of closing it.

Checked against the versions in :data:`CHECKED_AGAINST`, which ``pyproject.toml`` pins exactly.
:func:`check` runs when this module is imported: it builds each wrapper and a connection (no
I/O) and verifies that every private name holds what this module expects, raising
:class:`CompatError` naming what changed. An upgrade that breaks an assumption therefore stops
the server at start-up with that message, and ``tests/test_compat.py`` fails, instead of the
provider streams silently falling back to a slower reader (or leaking connections). After an
upgrade: re-read the named classes in the new versions, adjust this module, and update
:data:`CHECKED_AGAINST` and the pins together.
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING, Final

import h11
import httpcore

from . import CompatError

if TYPE_CHECKING:
    from collections.abc import Callable

#: The versions whose private names this module was checked against (pinned in pyproject.toml).
CHECKED_AGAINST: Final = {"httpx": "0.28.1", "httpcore": "1.0.9", "h11": "0.16.0"}

#: Most stream wrappers looked through to find ``httpcore``'s connection.
MAX_WRAPPERS: Final = 8


def _fail(what: str) -> CompatError:
    installed = ", ".join(f"{name} {_version(name)}" for name in CHECKED_AGAINST)
    checked = ", ".join(f"{name} {version}" for name, version in CHECKED_AGAINST.items())
    return CompatError(
        f"crush_trio._compat.httpcore: {what}. Installed: {installed}; this adapter was "
        f"checked against {checked}. Install the versions pinned in pyproject.toml, or update "
        "crush_trio/_compat/httpcore.py for the new ones."
    )


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "(not installed)"


try:
    from httpcore._async.connection_pool import PoolByteStream
    from httpcore._async.http11 import HTTP11ConnectionByteStream
    from httpx._client import BoundAsyncStream
    from httpx._transports.default import AsyncResponseStream
except ImportError as exc:
    raise _fail(f"a private stream wrapper is gone ({exc})") from exc


class Http11Exchange:
    """One request/response exchange on ``httpcore``'s HTTP/1.1 connection, its headers read."""

    def __init__(self, connection: httpcore.AsyncHTTP11Connection, state: h11.Connection) -> None:
        self._connection = connection
        self._state = state

    @property
    def at_body_start(self) -> bool:
        """Whether the request was sent whole and the response is at its body (nothing else
        read it yet): the body reader may take over."""
        return self._state.our_state is h11.DONE and self._state.their_state is h11.SEND_BODY

    @property
    def trailing_data(self) -> tuple[bytes, bool]:
        """The bytes received past the headers, and whether the peer closed its side."""
        data, closed = self._state.trailing_data
        return bytes(data), closed

    def mark_finished(self) -> None:
        """Record that the response body was read whole and nothing followed it: closing the
        response then returns the connection to the pool. Call it only at a message boundary."""
        self._connection._h11_state = finished_exchange()


def finished_exchange() -> h11.Connection:
    """A client ``h11`` state that has sent one request and received one complete response
    (built with ``h11``'s public API)."""
    state = h11.Connection(
        our_role=h11.CLIENT,
        max_incomplete_event_size=httpcore.AsyncHTTP11Connection.MAX_INCOMPLETE_EVENT_SIZE,
    )
    state.send(h11.Request(method="GET", target="/", headers=[("host", "-")]))
    state.send(h11.EndOfMessage())
    state.receive_data(b"HTTP/1.1 204 No Content\r\n\r\n")
    state.next_event()
    state.next_event()
    return state


def http11_exchange(
    stream: object, unwrap: Callable[[object], object | None] = lambda _: None
) -> Http11Exchange | None:
    """The exchange behind an ``httpx`` response stream, or None when the stream is not
    ``httpcore``'s HTTP/1.1 connection stream (another transport, HTTP/2).

    Args:
        stream: ``response.stream``.
        unwrap: the inner stream of one of the caller's own wrappers (a custom transport's
            response stream), or None for any other object.
    """
    core: object = stream
    for _ in range(MAX_WRAPPERS):
        if isinstance(core, HTTP11ConnectionByteStream):
            break
        inner = unwrap(core)
        if inner is not None:
            core = inner
        elif isinstance(core, PoolByteStream | BoundAsyncStream):
            core = core._stream
        elif isinstance(core, AsyncResponseStream):
            core = core._httpcore_stream
        else:
            return None
    if not isinstance(core, HTTP11ConnectionByteStream):
        return None
    connection = core._connection
    if not isinstance(connection, httpcore.AsyncHTTP11Connection):
        return None
    state = getattr(connection, "_h11_state", None)
    if not isinstance(state, h11.Connection):
        raise _fail(f"AsyncHTTP11Connection._h11_state is {type(state).__name__}, not h11's")
    return Http11Exchange(connection, state)


class _Probe(httpcore.AsyncNetworkStream):
    """A network stream that is never used: lets :func:`check` build a connection."""

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        raise NotImplementedError

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        raise NotImplementedError

    async def aclose(self) -> None:
        pass


def check() -> None:
    """Verify every private name this module uses (no I/O).

    Raises:
        CompatError: a name is gone or holds something else, naming it and the versions.
    """
    marker = object()
    try:
        connection = httpcore.AsyncHTTP11Connection(
            origin=httpcore.Origin(b"http", b"example.invalid", 80), stream=_Probe()
        )
        probes: list[tuple[str, object, str]] = [
            ("PoolByteStream._stream", PoolByteStream(marker, None, None), "_stream"),  # type: ignore[arg-type]
            (
                "HTTP11ConnectionByteStream._connection",
                HTTP11ConnectionByteStream(connection, None),  # type: ignore[arg-type]
                "_connection",
            ),
            (
                "httpx BoundAsyncStream._stream",
                BoundAsyncStream(marker, None, 0.0),  # type: ignore[arg-type]
                "_stream",
            ),
            (
                "httpx AsyncResponseStream._httpcore_stream",
                AsyncResponseStream(marker),  # type: ignore[arg-type]
                "_httpcore_stream",
            ),
        ]
    except Exception as exc:
        raise _fail(f"building a private stream wrapper failed ({exc!r})") from exc
    for name, wrapper, attribute in probes:
        expected = connection if attribute == "_connection" else marker
        if getattr(wrapper, attribute, None) is not expected:
            raise _fail(f"{name} no longer holds the wrapped object")
    state = getattr(connection, "_h11_state", None)
    if not isinstance(state, h11.Connection) or state.our_role is not h11.CLIENT:
        raise _fail("AsyncHTTP11Connection._h11_state is no longer a client h11.Connection")
    if not isinstance(httpcore.AsyncHTTP11Connection.MAX_INCOMPLETE_EVENT_SIZE, int):
        raise _fail("AsyncHTTP11Connection.MAX_INCOMPLETE_EVENT_SIZE is no longer an int")
    finished = finished_exchange()
    if finished.our_state is not h11.DONE or finished.their_state is not h11.DONE:
        raise _fail("h11 no longer reaches DONE/DONE after a complete exchange")


check()
