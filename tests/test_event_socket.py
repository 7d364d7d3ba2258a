"""The client's raw access to the server (``open_event_socket``, ``workspace(events=False)``,
``connect(max_connections=)``) against a real server (the plugin's fixtures).

Rules as in ``test_client.py``: every wait is bounded by ``trio.fail_after``; order comes from
gates of the scripted model and from frames, never from sleeping.
"""

from __future__ import annotations

import random
import uuid
from functools import partial
from typing import TYPE_CHECKING

import orjson
import pytest
import trio

from crush_trio.client import (
    AuthError,
    Client,
    NotFound,
    RunStatus,
    WorkspaceClient,
    connect,
    open_event_socket,
)
from crush_trio.providers.scripted import ScriptedModel, Step

if TYPE_CHECKING:
    from crush_trio.testing import CrushServer

#: Cap on every test's waits (seconds).
CAP = 20


async def frames_until_run_complete(sock: object, run_id: str) -> list[dict[str, object]]:
    frames = []
    async for text in sock:  # type: ignore[attr-defined]
        frame = orjson.loads(text)
        frames.append(frame)
        if frame["type"] == "run_complete" and frame["payload"]["payload"]["run_id"] == run_id:
            return frames
    raise AssertionError(f"the stream closed before run {run_id}'s run_complete")


async def test_raw_frames_of_a_run_and_resume_with_since(
    crush_server: CrushServer, crush_workspace: WorkspaceClient
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    with trio.fail_after(CAP):
        async with open_event_socket(crush_server.url, ws.id, crush_server.token) as sock:
            assert sock.hello["type"] == "hello"
            first_seq = sock.hello["seq"]
            handle = await ws.prompt(session.id, "raw frames please")
            frames = await frames_until_run_complete(sock, handle.run_id)
            await handle.wait(CAP)
        assert sock.closed is False  # this side closed it, with a close handshake
        seqs = [f["seq"] for f in frames]
        assert seqs == sorted(seqs)
        assert seqs[0] > first_seq
        assert frames[-1]["payload"]["payload"]["text"] == "raw frames please"
        # The frames are the server's own envelopes: the library's stream saw the same ones.
        assert ws.stats.last_seq >= seqs[-1]

        # Resuming after the first frame replays the rest, in order.
        async with open_event_socket(
            crush_server.url, ws.id, crush_server.token, since=seqs[0]
        ) as again:
            replayed = await frames_until_run_complete(again, handle.run_id)
        assert [f["seq"] for f in replayed] == seqs[1:]


async def test_raw_socket_reports_the_servers_close(
    crush_server: CrushServer, crush_workspace: WorkspaceClient
) -> None:
    client_id = str(uuid.uuid4())
    with trio.fail_after(CAP):
        async with open_event_socket(
            crush_server.url, crush_workspace.id, crush_server.token, client_id=client_id
        ) as sock:
            assert sock.client_id == client_id
            broker = crush_server.backend.get(crush_workspace.id).broker
            (stream,) = [s for s in broker.clients if s.client_id == client_id]
            stream.kill("dropped by the test")
            assert [frame async for frame in sock] == []
    assert sock.closed
    assert sock.close_code == 1013
    assert "dropped by the test" in sock.close_reason


async def test_raw_socket_open_errors(
    crush_server: CrushServer, crush_workspace: WorkspaceClient
) -> None:
    with trio.fail_after(CAP):
        with pytest.raises(NotFound, match="event stream of workspace"):
            async with open_event_socket(crush_server.url, "no-such-workspace", crush_server.token):
                pass  # pragma: no cover
        with pytest.raises(AuthError, match="refused the connection"):
            async with open_event_socket(crush_server.url, crush_workspace.id, "wrong-token"):
                pass  # pragma: no cover
        # The URL the server prints carries the token.
        url = f"{crush_server.url}/?token={crush_server.token}"
        async with open_event_socket(url, crush_workspace.id) as sock:
            assert sock.hello["type"] == "hello"


async def test_workspace_without_events_holds_it_and_sends_work(
    crush_server: CrushServer, crush_client: Client, scripted_model: ScriptedModel
) -> None:
    """``events=False``: no stream, a create-grace hold, HTTP operations work; another client
    watches the run."""
    project = crush_server.project()
    scripted_model.add(Step("watched elsewhere"))
    with trio.fail_after(CAP):
        async with crush_client.workspace(project, events=False) as quiet:
            server_ws = crush_server.backend.get(quiet.id)
            hold = server_ws.holds.clients[crush_client.client_id]
            assert hold.streams == 0
            assert hold.deadline is not None
            assert not server_ws.broker.clients
            session = await quiet.create_session("quiet")
            async with (
                connect(crush_server.url, crush_server.token) as other,
                other.workspace(project) as watcher,
                watcher.subscribe(timeout=CAP) as feed,
            ):
                assert watcher.id == quiet.id
                handle = await quiet.prompt(session.id, "sent without a stream")
                assert handle.accepted is not None
                done = await feed.until(
                    lambda e: e.type == "run_complete" and e.payload.run_id == handle.run_id
                )
            assert done.payload.text == "watched elsewhere"
            assert (await quiet.get_run(handle.run_id)).status is RunStatus.COMPLETED
            assert not handle.done  # nothing follows it on this client
        await server_ws.closed.wait()  # its hold was released when the block ended


async def test_max_connections_keeps_every_connection_alive() -> None:
    """``max_connections=N``: N requests at once get N connections, and every one stays open for
    the next burst (httpx keeps only 20 alive by default). A tiny HTTP server answers a burst
    only once all its requests are in, so the burst needs N connections."""
    size = 30
    accepted = requests = 0
    waiting: list[trio.SocketStream] = []

    async def serve_connection(stream: trio.SocketStream) -> None:
        nonlocal accepted, requests
        accepted += 1
        body = b'{"version":"test"}'
        answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                data = await stream.receive_some()
                if not data:
                    return
                buffer += data
            buffer = buffer.split(b"\r\n\r\n", 1)[1]
            requests += 1
            waiting.append(stream)
            if len(waiting) == size or requests == 1:  # the first one is connect()'s check
                for other in waiting:
                    await other.send_all(answer)
                waiting.clear()

    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            (listener,) = await nursery.start(
                partial(trio.serve_tcp, serve_connection, 0, host="127.0.0.1")
            )
            url = f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
            async with connect(url, "t", max_connections=size) as client:

                async def burst() -> None:
                    async with trio.open_nursery() as requests:
                        for _ in range(size):
                            requests.start_soon(client.version)

                await burst()
                assert accepted == size
                await burst()
                assert accepted == size  # no connection was closed and re-opened
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("crush_config", [{"options": {"debounce_ms": 0}}])
@pytest.mark.parametrize("deltas", [True, False])
async def test_resuming_again_and_again_while_runs_stream_sees_each_seq_once(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    deltas: bool,
) -> None:
    """A client that leaves after a few frames and comes back with ``since`` each time, while
    two runs stream an update per word, gets every seq exactly once, in order, and both
    ``run_complete`` events (in snapshot mode some updates come as a ``gap`` in their place,
    PROTOCOL §6.6)."""
    ws = crush_workspace
    sessions = [await ws.create_session() for _ in range(2)]
    for _ in sessions:
        words = " ".join(f"w{i}" for i in range(150))
        scripted_model.add(Step(text=words, token_delay=0.001))
    rng = random.Random(31)
    seqs: list[int] = []
    completes: list[str] = []
    connections = 0
    open_socket = partial(open_event_socket, crush_server.url, ws.id, crush_server.token)
    with trio.fail_after(CAP):
        async with open_socket(deltas=deltas) as sock:
            since = sock.hello["seq"]
        handles = [await ws.prompt(s.id, "stream") for s in sessions]
        while len(completes) < len(handles):
            connections += 1
            async with open_socket(since=since, deltas=deltas) as sock:
                for _ in range(rng.randint(1, 6)):
                    text = await sock.receive()
                    assert text is not None, "the server closed the stream"
                    frame = orjson.loads(text)
                    if frame["type"] == "gap":
                        # Only in snapshot mode: a streaming update published while no
                        # snapshot-mode client was connected has no snapshot form to replay.
                        assert not deltas, frame
                        gap = frame["payload"]
                        assert gap["from_seq"] == since + 1, (gap, since)
                        seqs += range(gap["from_seq"], gap["to_seq"] + 1)
                        since = gap["to_seq"]
                        continue
                    assert frame["seq"] == since + 1, (frame["seq"], since)
                    since = frame["seq"]
                    seqs.append(since)
                    if frame["type"] == "run_complete":
                        completes.append(frame["payload"]["payload"]["run_id"])
                        if len(completes) == len(handles):
                            break
        for handle in handles:
            await handle.wait(CAP)
    assert sorted(completes) == sorted(h.run_id for h in handles)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert connections > 20  # the runs streamed across many reconnects
