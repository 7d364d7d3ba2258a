"""One keepalive timer for every event websocket of the server.

A websocket client that has been sent nothing for ``server.ws_ping_interval`` seconds is pinged,
and one whose pong does not come back within
:data:`~crush_trio.server.ws_trio.PONG_TIMEOUT` is disconnected (closed with 1000, as a client
that left). Rather than a timeout in every connection (a task and its cancel scopes parked for
the connection's life), the connections register with one :class:`Keepalive` per server, whose
single task looks at all of them :data:`TICKS_PER_INTERVAL` times per interval: a connection
that wrote something since the last look starts a new quiet period, one that stayed quiet for the
interval is pinged, in a task of its own that lasts until the pong (the connection's
:meth:`Pinged.ping_soon`). So a client is pinged after ``interval`` to ``interval * (1 + 1 /
TICKS_PER_INTERVAL)`` seconds of silence, and again each interval while it stays silent.

Started by :func:`~.serve.serve` around the dispatcher (:func:`keepalive_timer`), and handed to
:func:`~.ws_trio.serve_event_websocket`.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Final, Protocol

import trio

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

#: Looks at the connections per ping interval: the silence before a ping may exceed the interval
#: by up to ``1 / TICKS_PER_INTERVAL`` of it.
TICKS_PER_INTERVAL: Final = 10


class Pinged(Protocol):
    """A connection as the keepalive sees it (:class:`~.connection.OnDemandWriter`)."""

    def sent_since(self) -> bool:
        """Whether anything was written to the client since the last call."""

    def ping_soon(self) -> None:
        """Ping the client (and disconnect it without a pong) in a task of the connection's;
        never blocks, and does nothing while a ping is on."""


class Keepalive:
    """The server's keepalive timer (see the module's docstring).

    Args:
        interval: seconds of silence before a connection is pinged; 0 pings nobody.
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        #: Each registered connection, with the time its quiet period began (trio clock).
        self._quiet_since: dict[Pinged, float] = {}

    def __len__(self) -> int:
        return len(self._quiet_since)

    def add(self, conn: Pinged) -> None:
        """Watch ``conn`` from now on (its quiet period begins now)."""
        if self.interval > 0:
            self._quiet_since[conn] = trio.current_time()

    def discard(self, conn: Pinged) -> None:
        """Stop watching ``conn`` (its connection is over)."""
        self._quiet_since.pop(conn, None)

    def tick(self, now: float) -> int:
        """One look at every connection: ping those quiet for the interval; returns how many."""
        quiet_since = self._quiet_since
        due = now - self.interval
        pinged = 0
        for conn, since in quiet_since.items():
            if conn.sent_since():
                quiet_since[conn] = now
            elif since <= due:
                quiet_since[conn] = now  # the next ping an interval later, as after a pong
                conn.ping_soon()
                pinged += 1
        return pinged

    async def run(self) -> None:
        """Look at the connections :data:`TICKS_PER_INTERVAL` times per interval, forever."""
        if self.interval <= 0:
            await trio.sleep_forever()
        period = self.interval / TICKS_PER_INTERVAL
        while True:
            await trio.sleep(period)
            self.tick(trio.current_time())


@asynccontextmanager
async def keepalive_timer(interval: float) -> AsyncIterator[Keepalive]:
    """The server's :class:`Keepalive`, its task running for the block's duration.

    Cancellation: leaving the block cancels the timer's task (the connections' pings run in
    their own nurseries).
    """
    keepalive = Keepalive(interval)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(keepalive.run)
        try:
            yield keepalive
        finally:
            nursery.cancel_scope.cancel()
