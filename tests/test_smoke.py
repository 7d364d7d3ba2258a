"""The shortest path through everything: the plugin's server, the client, one run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from crush_trio.client import Client, RunComplete, RunStatus
from crush_trio.wire import AcceptedPrompt, Role

from .conftest import WAIT

if TYPE_CHECKING:
    from crush_trio.testing import CrushServer


async def test_happy_path_through_the_client(
    crush_server: CrushServer, crush_client: Client
) -> None:
    assert await crush_client.request("GET", "/v1/health") == {"status": "ok"}
    async with crush_client.workspace(crush_server.project()) as ws:
        assert ws.stats.connects == 1  # the event stream is open and said hello
        session = await ws.create_session()
        handle = await ws.prompt(session.id, "hello there world", run_id="r1")
        assert handle.accepted == AcceptedPrompt("r1", session.id, "running")
        events = [event async for event in handle.events(WAIT)]
        run = await handle.result(WAIT)
        msgs = await ws.messages(session.id)
    assert [e.type for e in events][-1] == "run_complete"
    assert "message" in {e.type for e in events}
    assert handle.complete == RunComplete(session.id, "r1", run.message_id, "hello there world")
    assert run.status is RunStatus.COMPLETED
    assert run.text == "hello there world"
    assert [m.role for m in msgs] == [Role.USER, Role.ASSISTANT]
    assert msgs[-1].id == run.message_id
