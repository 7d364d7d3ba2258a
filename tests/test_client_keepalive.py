"""The client library's keep-alive on its event stream, on a real server (virtual time).

* A stream silent for ``KEEPALIVE_INTERVAL`` since its last frame is pinged; a frame in the
  meantime moves the ping to ``KEEPALIVE_INTERVAL`` after that frame.
* A ping unanswered for ``PING_TIMEOUT`` drops the connection, and the stream is re-opened.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import pytest
import trio
from trio_websocket import WebSocketConnection

from crush_trio.client.stream import KEEPALIVE_INTERVAL, PING_TIMEOUT

if TYPE_CHECKING:
    from trio.testing import MockClock

    from crush_trio.client import WorkspaceClient

#: Cap on every test's waits (virtual seconds).
CAP: Final = 120.0


class Pings:
    """Records when the client pings its stream (the server's pings of its side, in the same
    process, are not counted); ``answer=False``: the client's next ping never gets its pong
    (it waits until cancelled)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.times: list[float] = []
        self.answer = True
        ping = WebSocketConnection.ping

        async def recorded(conn: WebSocketConnection, payload: bytes | None = None) -> None:
            if not conn.is_client:
                await ping(conn, payload)
                return
            self.times.append(trio.current_time())
            if not self.answer:
                self.answer = True
                await trio.sleep_forever()
            await ping(conn, payload)

        monkeypatch.setattr(WebSocketConnection, "ping", recorded)


async def frame_now(ws: WorkspaceClient) -> float:
    """Make the server send the stream a frame; returns when the client got it."""
    async with ws.subscribe(types={"session"}) as feed:
        await ws.create_session()
        await feed.next(timeout=5)
    return trio.current_time()


async def test_a_silent_stream_is_pinged_an_interval_after_its_last_frame(
    crush_workspace: WorkspaceClient, autojump_clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = crush_workspace
    pings = Pings(monkeypatch)
    with trio.fail_after(CAP):
        heard = await frame_now(ws)
        await trio.sleep_until(heard + KEEPALIVE_INTERVAL - 1)
        assert pings.times == []
        await trio.sleep_until(heard + KEEPALIVE_INTERVAL + 1)
        assert pings.times == [pytest.approx(heard + KEEPALIVE_INTERVAL, abs=0.1)]
        # A frame after the ping: the next ping is an interval after that frame.
        await trio.sleep(KEEPALIVE_INTERVAL * 2 / 3)
        heard = await frame_now(ws)
        await trio.sleep_until(heard + KEEPALIVE_INTERVAL + 1)
        assert pings.times[1:] == [pytest.approx(heard + KEEPALIVE_INTERVAL, abs=0.1)]
    assert ws.stats.reconnects == 0


async def test_an_unanswered_ping_drops_the_stream_and_it_is_reopened(
    crush_workspace: WorkspaceClient, autojump_clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = crush_workspace
    pings = Pings(monkeypatch)
    pings.answer = False
    with trio.fail_after(CAP):
        reconnects = ws.stats.reconnects
        heard = await frame_now(ws)
        await ws.wait_reconnected(reconnects)
        assert trio.current_time() >= heard + KEEPALIVE_INTERVAL + PING_TIMEOUT
        assert len(pings.times) == 1
        await frame_now(ws)  # the re-opened stream carries events
