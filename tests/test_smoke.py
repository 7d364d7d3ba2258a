from __future__ import annotations

import trio

from .conftest import Server


async def test_happy_path_over_websocket(server: Server) -> None:
    r = await server.http.get("/v1/health")
    assert r.json() == {"status": "ok"}
    ws = await server.open_workspace()
    session = await server.create_session(ws["id"])
    with trio.fail_after(10):
        async with server.websocket(ws["id"]) as sock:
            hello = await sock.recv()
            assert hello["type"] == "hello"
            accepted = await server.prompt(
                ws["id"], session["id"], "hello there world", run_id="r1"
            )
            assert accepted == {"run_id": "r1", "session_id": session["id"], "status": "running"}
            complete, _frames = await sock.run_complete("r1")
    assert complete["text"] == "hello there world"
    assert complete["error"] is None and complete["cancelled"] is False
    run = await server.run(ws["id"], "r1")
    assert run["status"] == "completed"
    msgs = await server.messages(ws["id"], session["id"])
    assert [m["role"] for m in msgs] == ["user", "assistant"]
