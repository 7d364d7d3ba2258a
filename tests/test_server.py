"""HTTP, SSE and websocket behaviour of the real server on an ephemeral port (PROTOCOL §1–§5).

What a client sees (run records, messages, several clients, workspace dedup, renames) is tested
with the project's client library and the plugin's fixtures (``crush_server``,
``crush_workspace``). Exact status codes, frames and their seqs, refusals, close codes,
websocket commands and SSE parity are tested with the raw helpers of ``conftest``.
"""

from __future__ import annotations

import gc
import socket
import uuid
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

import crush_trio
from crush_trio import wire
from crush_trio.client import (
    BadRequest,
    Client,
    NotFound,
    RunStatus,
    WorkspaceClient,
    connect,
)
from crush_trio.providers.scripted import Gate, ScriptedModel, Step
from crush_trio.server.listener import clear_user_timeout
from crush_trio.server.serve import make_socket
from crush_trio.wire import FinishPart, FinishReason, TextPart

from .conftest import TOKEN, WAIT, Server, completes_run, running_server

if TYPE_CHECKING:
    from pathlib import Path

    from crush_trio.testing import CrushServer

# trio-websocket leaves the socket of a connection the server closed to the garbage collector;
# collect it inside the test that caused it, where the warning is expected.
server_close_leaks_socket = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnraisableExceptionWarning"
)


async def expect_rejected(
    url: str, status: int, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Attempt a websocket upgrade with a raw HTTP request and check the refusal status."""
    http_url = url.replace("ws://", "http://")
    upgrade = {
        "Connection": "Upgrade",
        "Upgrade": "websocket",
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
    }
    for name, value in headers or []:
        upgrade[name.decode()] = value.decode()
    async with httpx.AsyncClient(timeout=5) as client:
        r = await client.get(http_url, headers=upgrade)
    assert r.status_code == status, r.text
    assert r.json()["message"]


def _payload(frame: dict[str, Any]) -> Any:
    return frame["payload"]["payload"]


async def _sse_frames(
    server: Server, wid: str, stop: Any, *, last_event_id: int | None = None
) -> list[dict[str, Any]]:
    """Read SSE frames until ``stop(frame)`` is true."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    frames: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        async with client.stream(
            "GET",
            f"/v1/workspaces/{wid}/events",
            params={"client_id": str(uuid.uuid4())},
            headers=headers,
        ) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            seq_line = None
            async for line in response.aiter_lines():
                if line.startswith("id: "):
                    seq_line = int(line[4:])
                elif line.startswith("data: "):
                    frame = orjson.loads(line[6:])
                    if frame["type"] not in ("hello", "gap"):
                        assert seq_line == frame["seq"]
                    frames.append(frame)
                    if stop(frame):
                        return frames


# -- authentication and origins ---------------------------------------------------------------


async def test_auth_none_wrong_header_query(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url) as anon:
        r = await anon.get("/v1/workspaces")
        assert r.status_code == 401
        assert "token" in r.json()["message"]
        r = await anon.get("/v1/workspaces", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        assert "wrong token" in r.json()["message"]
        r = await anon.get("/v1/workspaces", params={"token": "nope"})
        assert r.status_code == 401
        r = await anon.get("/v1/workspaces", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200
        assert r.json() == []
        r = await anon.get("/v1/workspaces", params={"token": TOKEN})
        assert r.status_code == 200
        # health needs no token and reveals nothing else
        r = await anon.get("/v1/health")
        assert r.status_code == 200
        assert r.json() == {"status": "ok"}


async def test_websocket_upgrade_refused_without_token(server: Server) -> None:
    ws = await server.open_workspace()
    await expect_rejected(server.ws_url(ws["id"], str(uuid.uuid4()), token=False), 401)
    await expect_rejected(
        server.ws_url(ws["id"], str(uuid.uuid4()), token=False) + "&token=bad", 401
    )


async def test_browser_token_url_sets_cookie_and_redirects(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.url) as browser:
        r = await browser.get("/", params={"token": TOKEN, "x": "1"})
        assert r.status_code == 303
        prefix, _, query = r.headers["location"].partition("/?")
        assert query == "x=1"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
        assert TOKEN in cookie
        r = await browser.get(f"{prefix}/v1/workspaces")  # the cookie jar now authenticates
        assert r.status_code == 200


async def test_foreign_origin_refused(server: Server) -> None:
    ws = await server.open_workspace()
    url = server.ws_url(ws["id"], str(uuid.uuid4()))
    await expect_rejected(url, 403, [(b"Origin", b"http://evil.example")])
    r = await server.http.get(
        f"/v1/workspaces/{ws['id']}/events",
        params={"client_id": str(uuid.uuid4())},
        headers={"Origin": "http://evil.example"},
    )
    assert r.status_code == 403
    assert "origin" in r.json()["message"]
    # The server's own origin is accepted.
    host = server.url.removeprefix("http://")
    with trio.fail_after(5):
        async with open_websocket_url(
            url, extra_headers=[(b"Origin", f"http://{host}".encode())]
        ) as c:
            hello = orjson.loads(await c.get_message())
            assert hello["type"] == "hello"


async def test_websocket_refusals_name_the_problem(server: Server) -> None:
    ws = await server.open_workspace()
    base = server.url.replace("http://", "ws://")
    cases = [
        (f"{base}/v1/workspaces/{ws['id']}/ws?client_id=not-a-uuid&token={TOKEN}", 400),
        (f"{base}/v1/workspaces/nope/ws?client_id={uuid.uuid4()}&token={TOKEN}", 404),
    ]
    for url, status in cases:
        await expect_rejected(url, status)


# -- workspaces -------------------------------------------------------------------------------


async def test_workspace_dedup_by_path_and_symlink(
    crush_server: CrushServer, crush_client: Client, tmp_path: Path
) -> None:
    project = crush_server.project("proj")
    link = tmp_path / "link"
    link.symlink_to(project)
    async with (
        crush_client.workspace(project) as a,
        crush_client.workspace(project) as b,
        crush_client.workspace(link) as c,
    ):
        assert a.id == b.id == c.id
        assert a.info == b.info == c.info  # the path is the resolved one, also through the link
        assert a.path == str(project.resolve())
        assert [w.id for w in await crush_client.workspaces()] == [a.id]
        one = await crush_client.request("GET", f"/v1/workspaces/{a.id}")
        assert one == {
            "id": a.id,
            "path": a.path,
            "data_dir": a.info.data_dir,
            "trusted": False,
            "warnings": [],
            "config": wire.unstructure(a.info.config),
        }
        # Crush's config shape: the built-in echo model, the data directory, no secrets.
        assert one["config"]["models"]["large"] == {"provider": "echo", "model": "echo"}
        assert one["config"]["options"]["data_directory"] == a.info.data_dir
        assert list(one["config"]["providers"]) == ["echo"]


async def test_workspace_bad_paths(server: Server, tmp_path: Path) -> None:
    f = tmp_path / "file.txt"
    f.write_text("x")
    cid = str(uuid.uuid4())
    for path, words in [
        (str(f), "not a directory"),
        (str(tmp_path / "missing"), "does not exist"),
        ("relative/dir", "not absolute"),
    ]:
        r = await server.http.post("/v1/workspaces", json={"path": path, "client_id": cid})
        assert r.status_code == 400, r.text
        assert words in r.json()["message"]
    r = await server.http.post("/v1/workspaces", json={"path": str(tmp_path), "client_id": "x"})
    assert r.status_code == 400
    assert "UUID" in r.json()["message"]
    r = await server.http.get("/v1/workspaces/unknown")
    assert r.status_code == 404


# -- runs over websocket and SSE --------------------------------------------------------------


async def test_websocket_and_sse_see_identical_event_sequences(server: Server) -> None:
    ws = await server.open_workspace()
    wid = ws["id"]
    session = await server.create_session(wid)
    sse_frames: list[dict[str, Any]] = []
    with trio.fail_after(10):
        async with server.websocket(wid) as sock, trio.open_nursery() as nursery:
            sse_ready = trio.Event()

            async def read_sse() -> None:
                def stop(frame: dict[str, Any]) -> bool:
                    if frame["type"] == "hello":
                        sse_ready.set()
                    return frame["type"] == "run_complete"

                sse_frames.extend(await _sse_frames(server, wid, stop))

            hello = await sock.recv()
            nursery.start_soon(read_sse)
            await sse_ready.wait()
            await server.prompt(wid, session["id"], "one two three four", run_id="run-ws-sse")
            complete, ws_frames = await sock.run_complete("run-ws-sse")
    assert complete["text"] == "one two three four"
    ws_events = [f for f in ws_frames if f["type"] != "hello"]
    sse_events = [f for f in sse_frames if f["type"] != "hello"]
    assert ws_events == sse_events
    seqs = [f["seq"] for f in ws_events]
    assert seqs == list(range(hello["seq"] + 1, hello["seq"] + 1 + len(seqs)))
    types = [f["type"] for f in ws_events]
    assert types[-1] == "run_complete"
    assert "message" in types


async def test_run_record_and_messages(crush_workspace: WorkspaceClient) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    handle = await ws.prompt(session.id, "stored reply", run_id="rec")
    await handle.wait(WAIT)
    complete = handle.complete
    assert complete is not None
    run = await ws.get_run("rec")
    assert run.run_id == "rec"
    assert run.session_id == session.id
    assert run.status is RunStatus.COMPLETED
    assert run.text == "stored reply"
    assert run.message_id == complete.message_id
    assert run.error is None
    assert run.finished_at is not None
    assert run.finished_at >= run.created_at
    msgs = await ws.messages(session.id)
    assistant = msgs[-1]
    assert assistant.id == complete.message_id
    assert assistant.parts[0] == TextPart("stored reply")
    finish = assistant.parts[-1]
    assert isinstance(finish, FinishPart)
    assert finish.reason is FinishReason.END_TURN
    # The same answers as JSON: the shapes of PROTOCOL §4, which a shared converter would hide.
    raw_run = await ws.client.request("GET", f"/v1/workspaces/{ws.id}/runs/rec")
    assert raw_run["status"] == "completed"
    assert raw_run["message_id"] == complete.message_id
    raw_parts = (
        await ws.client.request("GET", f"/v1/workspaces/{ws.id}/sessions/{session.id}/messages")
    )[-1]["parts"]
    assert raw_parts[0] == {"type": "text", "data": {"text": "stored reply"}}
    assert raw_parts[-1]["type"] == "finish"
    assert raw_parts[-1]["data"]["reason"] == "end_turn"
    with pytest.raises(NotFound):
        await ws.get_run("missing")
    stored = await ws.session(session.id)
    assert stored.message_count == 2
    assert stored.is_busy is False


async def test_prompt_completes_after_its_http_connection_closes(
    crush_server: CrushServer, crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    """The run belongs to the workspace, not to the HTTP request that sent the prompt."""
    ws = crush_workspace
    session = await ws.create_session()
    gate = Gate()
    scripted_model.add(Step("detached run", gate_mid=gate))
    async with ws.subscribe(timeout=WAIT) as feed:
        # A one-shot raw HTTP client: its connection is closed once the prompt is accepted.
        async with httpx.AsyncClient(
            base_url=crush_server.url, headers={"Authorization": f"Bearer {crush_server.token}"}
        ) as one_shot:
            r = await one_shot.post(
                f"/v1/workspaces/{ws.id}/agent",
                json={"session_id": session.id, "prompt": "go on without me"},
            )
            assert r.status_code == 202
            run_id = r.json()["run_id"]  # made by the server
        with trio.fail_after(WAIT):
            await gate.reached.wait()  # parked mid-reply, its HTTP connection gone
        assert (await ws.get_run(run_id)).status is RunStatus.RUNNING
        gate.release()
        done = await feed.until(completes_run(run_id), WAIT)
    assert done.payload.text == "detached run"
    assert done.payload.error is None
    run = await ws.get_run(run_id)
    assert run.status is RunStatus.COMPLETED
    assert run.text == "detached run"


async def test_two_clients_both_receive_run_complete(
    crush_server: CrushServer, crush_workspace: WorkspaceClient
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    async with (
        connect(crush_server.url, crush_server.token) as second_client,
        second_client.workspace(ws.path) as other,
        ws.subscribe(timeout=WAIT) as a,
        other.subscribe(timeout=WAIT) as b,
    ):
        assert other.id == ws.id
        assert second_client.client_id != ws.client.client_id
        handle = await ws.prompt(session.id, "for both", run_id="both")
        seen_a = await a.collect_until(completes_run("both"), WAIT)
        seen_b = await b.collect_until(completes_run("both"), WAIT)
        assert (await handle.result(WAIT)).text == "for both"
    assert seen_a[-1].payload.text == "for both"
    assert [e.raw for e in seen_a] == [e.raw for e in seen_b]  # the same events, the same frames
    assert [e.type for e in seen_a].count("run_complete") == 1


async def test_websocket_commands(server: Server) -> None:
    ws = await server.open_workspace()
    wid = ws["id"]
    with trio.fail_after(10):
        async with server.websocket(wid) as sock:
            await sock.recv()
            reply = await sock.command("sessions.create", title="via ws")
            assert reply["ok"] is True
            sid = reply["result"]["id"]
            reply = await sock.command(
                "agent.prompt", session_id=sid, prompt="over the socket", run_id="wsr"
            )
            assert reply["ok"]
            assert reply["result"]["status"] == "running"
            complete, _ = await sock.run_complete("wsr")
            assert complete["text"] == "over the socket"
            reply = await sock.command("runs.get", run_id="wsr")
            assert reply["result"]["status"] == "completed"
            reply = await sock.command("messages.list", session_id=sid)
            assert [m["role"] for m in reply["result"]] == ["user", "assistant"]
            reply = await sock.command("sessions.list")
            assert [s["id"] for s in reply["result"]] == [sid]
            # errors: unknown method 404, unknown session in params 400, wrong type 400
            reply = await sock.command("no.such")
            assert reply["ok"] is False
            assert reply["status"] == 404
            reply = await sock.command("messages.list", session_id="nope")
            assert reply["status"] == 400
            reply = await sock.command("agent.prompt", session_id=sid, prompt=5)
            assert reply["status"] == 400
            assert "$.prompt" in reply["message"]
            reply = await sock.command("runs.get", run_id="nope")
            assert reply["status"] == 400
            # malformed and binary frames: error frames, socket stays open
            await sock.conn.send_message("{not json")
            frame = (await sock.until(lambda f: f["type"] == "error"))[-1]
            assert frame["type"] == "error"
            assert "JSON" in frame["message"]
            await sock.conn.send_message(b"\x00\x01")
            frame = (await sock.until(lambda f: f["type"] == "error"))[-1]
            assert frame["type"] == "error"
            assert "binary" in frame["message"]
            reply = await sock.command("agent.cancel", session_id=sid)
            assert reply["ok"] is True


# -- resume and gaps --------------------------------------------------------------------------


async def test_resume_replays_missed_events_in_order(server: Server) -> None:
    ws = await server.open_workspace()
    wid = ws["id"]
    session = await server.create_session(wid)
    cid = str(uuid.uuid4())
    with trio.fail_after(10):
        async with server.websocket(wid, client_id=cid) as sock:
            hello = await sock.recv()
            last_seen = hello["seq"]
        # Disconnected: a run happens meanwhile, watched by another client in snapshot mode
        # (with none connected, the snapshot form of a delta is not encoded, and a resume in
        # snapshot mode would get a gap for it).
        async with server.websocket(wid) as watcher:
            await watcher.recv()  # hello
            await server.prompt(wid, session["id"], "while you were away", run_id="away")
            await watcher.run_complete("away")
        async with server.websocket(wid, client_id=cid, since=last_seen) as sock:
            hello2 = await sock.recv()
            assert hello2["type"] == "hello"
            frames = await sock.until(lambda f: f["type"] == "run_complete")
    seqs = [f["seq"] for f in frames]
    assert seqs == list(range(last_seen + 1, last_seen + 1 + len(seqs)))
    assert _payload(frames[-1])["text"] == "while you were away"
    assert all(f["type"] != "gap" for f in frames)


async def test_resume_beyond_replay_buffer_gets_gap(tmp_path: Path) -> None:
    config = tmp_path / "crush.json"
    config.write_text('{"server": {"replay_buffer": 3}}')
    async with running_server(tmp_path, config_file=config) as server:
        ws = await server.open_workspace()
        wid = ws["id"]
        session = await server.create_session(wid)
        with trio.fail_after(10):
            async with server.websocket(wid) as watcher:
                hello = await watcher.recv()
                await server.prompt(wid, session["id"], "a b c d e f g h", run_id="long")
                await watcher.run_complete("long")
            async with server.websocket(wid, since=hello["seq"]) as sock:
                await sock.recv()  # hello
                gap = await sock.recv()
                assert gap["type"] == "gap"
                assert gap["payload"]["from_seq"] == hello["seq"] + 1
                assert gap["payload"]["dropped"] == gap["payload"]["to_seq"] - hello["seq"]
                rest = await sock.until(lambda f: f["type"] == "run_complete")
                seqs = [f["seq"] for f in rest]
                assert seqs == list(range(gap["payload"]["to_seq"] + 1, seqs[-1] + 1))
                assert 1 <= len(rest) <= 3


# -- bad input --------------------------------------------------------------------------------


async def test_bad_input_gets_clear_errors_and_server_keeps_serving(server: Server) -> None:
    ws = await server.open_workspace()
    wid = ws["id"]
    session = await server.create_session(wid)
    sid = session["id"]
    cases: list[tuple[str, str, Any, int, str]] = [
        ("POST", f"/v1/workspaces/{wid}/agent", b"{not json", 400, "not valid JSON"),
        ("POST", f"/v1/workspaces/{wid}/agent", {"session_id": sid, "prompt": 3}, 400, "$.prompt"),
        ("POST", f"/v1/workspaces/{wid}/agent", {"session_id": sid, "prompt": "  "}, 400, "empty"),
        ("POST", f"/v1/workspaces/{wid}/agent", {"prompt": "x"}, 400, "$.session_id"),
        (
            "POST",
            f"/v1/workspaces/{wid}/agent",
            {"session_id": "nope", "prompt": "x"},
            400,
            "does not exist",
        ),
        (
            "POST",
            f"/v1/workspaces/{wid}/agent",
            {"session_id": sid, "prompt": "x", "run_id": ""},
            400,
            "run_id",
        ),
        ("POST", f"/v1/workspaces/{wid}/agent", [1, 2], 400, "JSON object"),
        ("GET", f"/v1/workspaces/{wid}/sessions/nope", None, 404, "not found"),
        ("GET", "/v1/nowhere", None, 404, "no route"),
        ("POST", "/v1/control", {"command": "explode"}, 400, "$.command"),
        ("DELETE", f"/v1/workspaces/{wid}", None, 400, "client_id"),
    ]
    for method, url, body, status, words in cases:
        content = (
            body if isinstance(body, bytes) else (orjson.dumps(body) if body is not None else None)
        )
        r = await server.http.request(
            method, url, content=content, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == status, (url, body, r.text)
        assert words in r.json()["message"], (words, r.json())
    big = b'{"title": "' + b"x" * (4 * 1024 * 1024 + 10) + b'"}'
    r = await server.http.post(
        f"/v1/workspaces/{wid}/sessions",
        content=big,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 413
    assert "too large" in r.json()["message"]
    # Still serving, and the session is intact.
    with trio.fail_after(10):
        async with server.websocket(wid) as sock:
            await server.prompt(wid, sid, "still here", run_id="after-bad")
            complete, _ = await sock.run_complete("after-bad")
    assert complete["text"] == "still here"


@server_close_leaks_socket
async def test_oversized_websocket_frame_closes_with_1009(server: Server) -> None:
    ws = await server.open_workspace()
    with trio.fail_after(10):
        async with server.websocket(ws["id"]) as sock:
            await sock.recv()
            await sock.conn.send_message("x" * (4 * 1024 * 1024 + 1))
            with pytest.raises(ConnectionClosed) as info:
                await sock.conn.get_message()
            assert info.value.reason.code == 1009
            del info
        gc.collect()
        gc.collect()
        # the server keeps serving
        r = await server.http.get(f"/v1/workspaces/{ws['id']}")
        assert r.status_code == 200


async def test_duplicate_run_id_is_refused(server: Server) -> None:
    ws = await server.open_workspace()
    session = await server.create_session(ws["id"])
    await server.prompt(ws["id"], session["id"], "first", run_id="dup")
    r = await server.http.post(
        f"/v1/workspaces/{ws['id']}/agent",
        json={"session_id": session["id"], "prompt": "again", "run_id": "dup"},
    )
    assert r.status_code == 400
    assert "already used" in r.json()["message"]


async def test_version_and_agent_info(
    crush_client: Client, crush_workspace: WorkspaceClient
) -> None:
    assert await crush_client.version() == crush_trio.__version__
    info = await crush_workspace.agent_info()
    assert info.is_busy is False
    assert info.is_ready is True
    assert info.model["provider"] == "echo"


async def test_control_shutdown_if_idle_and_retire(server: Server) -> None:
    cid = str(uuid.uuid4())
    ws = server.backend.get((await server.open_workspace(client_id=cid))["id"])
    r = await server.http.delete(f"/v1/clients/{cid}")
    assert r.status_code == 200
    r = await server.http.post("/v1/workspaces", json={"path": str(server.tmp), "client_id": cid})
    assert r.status_code == 409
    assert "retired" in r.json()["message"]
    with trio.fail_after(WAIT):  # the retired client's workspace closes: the server is idle
        await ws.closed.wait()
    r = await server.http.post("/v1/control", json={"command": "shutdown_if_idle"})
    assert r.status_code == 200
    with trio.fail_after(10):
        await server.backend.stopped.wait()


async def test_rename_session_publishes_an_update(crush_workspace: WorkspaceClient) -> None:
    ws = crush_workspace
    session = await ws.create_session("old")
    async with ws.subscribe(timeout=WAIT) as feed:
        renamed = await ws.rename_session(session.id, "new name")
        update = await feed.until(lambda e: e.type == "session", WAIT)
    assert renamed.id == session.id
    assert renamed.title == "new name"
    assert renamed.is_busy is False
    assert update.kind == "updated"
    assert update.payload.id == session.id
    assert update.payload.title == "new name"
    assert (await ws.session(session.id)).title == "new name"  # stored
    with pytest.raises(BadRequest, match="title"):
        await ws.rename_session(session.id, " ")
    with pytest.raises(NotFound):
        await ws.rename_session("nope", "x")


async def test_framework_websocket_route_still_serves_events(tmp_path: Path) -> None:
    """``server.ws_transport: "asgi"`` serves the same contract through the HTTP framework."""
    config = tmp_path / "crush.json"
    config.write_text('{"server": {"ws_transport": "asgi"}}')
    async with running_server(tmp_path, config_file=config) as server:
        ws = await server.open_workspace()
        session = await server.create_session(ws["id"])
        with trio.fail_after(10):
            async with server.websocket(ws["id"]) as sock:
                assert (await sock.recv())["type"] == "hello"
                reply = await sock.command("sessions.list")
                assert reply["ok"]
                assert [s["id"] for s in reply["result"]] == [session["id"]]
                await server.prompt(ws["id"], session["id"], "via the framework", run_id="asgi")
                complete, _ = await sock.run_complete("asgi")
        assert complete["text"] == "via the framework"


def test_event_websocket_connections_drop_the_kernel_user_timeout() -> None:
    """The listening socket's TCP_USER_TIMEOUT is inherited by every connection; the event
    websocket takes it off (its own slow-client policy applies instead)."""
    if not hasattr(socket, "TCP_USER_TIMEOUT"):
        pytest.skip("no TCP_USER_TIMEOUT on this platform")
    listener = make_socket("127.0.0.1", 0, tcp_user_timeout_ms=2000)
    try:
        client = socket.create_connection(listener.getsockname()[:2])
        accepted, _ = listener.accept()
        with client, accepted:
            opt = (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
            assert accepted.getsockopt(*opt) == 2000  # what HTTP connections keep
            clear_user_timeout(accepted)
            assert accepted.getsockopt(*opt) == 0
    finally:
        listener.close()
