"""Websocket commands answer as their HTTP routes do, on both websocket transports (PROTOCOL §5).

The commands and the routes share one set of operations; these tests pin the places where the
two once disagreed.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest
import trio

from .conftest import WAIT, running_server

if TYPE_CHECKING:
    from pathlib import Path


@pytest.mark.parametrize("transport", ["trio-websocket", "asgi"])
async def test_cancel_of_an_unknown_session_is_a_no_op_on_both_paths(
    tmp_path: Path, transport: str
) -> None:
    config = tmp_path / "crush.json"
    config.write_text(json.dumps({"server": {"ws_transport": transport}}))
    async with running_server(tmp_path, config_file=config) as server:
        wid = (await server.open_workspace())["id"]
        r = await server.http.post(f"/v1/workspaces/{wid}/agent/sessions/nope/cancel")
        assert (r.status_code, r.json()) == (200, {})
        with trio.fail_after(WAIT):
            async with server.websocket(wid) as sock:
                await sock.recv()
                reply = await sock.command("agent.cancel", session_id="nope")
                assert reply["ok"] is True
                assert reply["result"] == {}
                # clear_queue checks the session on both paths (404 in the path, 400 in params)
                reply = await sock.command("agent.clear_queue", session_id="nope")
                assert reply["ok"] is False
                assert reply["status"] == 400
        r = await server.http.post(f"/v1/workspaces/{wid}/agent/sessions/nope/prompts/clear")
        assert r.status_code == 404
