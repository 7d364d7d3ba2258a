"""Memory bounds a client cannot get past (docs/protocol.md "Bounds"): each client's queue by
bytes as well as events (command replies included), a stalled client disconnected while the
workspace is idle, replay bytes counted as bytes, workspaces per server, retired client ids, and
per-client state that leaves with the client (holds, sockets, memory)."""

from __future__ import annotations

import base64
import gc
import math
import os
import socket
import struct
import subprocess
import sys
import time
import uuid
from functools import partial
from pathlib import Path

import httpx
import orjson
import pytest
import trio
import trio.testing

from crush_trio import permissions
from crush_trio.backend.registry import Backend
from crush_trio.broker import Broker, ClientStream, Event
from crush_trio.config import ServerOptions
from crush_trio.core.holds import Holds
from crush_trio.metrics import MAX_PROVIDER_LABELS, Metrics
from crush_trio.permissions import PermissionService
from crush_trio.wire import AgentEvent, EventKind, RunComplete

from .conftest import WAIT, running_server

# -- the client queue ---------------------------------------------------------------------------


def big(n: int, size: int) -> AgentEvent:
    return AgentEvent("info", text=f"{n} " + "x" * size)


def drain(stream: ClientStream) -> list[Event]:
    out = []
    while True:
        try:
            out.append(stream.receive.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return out
        stream.after_receive()


def reply(size: int) -> Event:
    return Event(-1, "reply", orjson.dumps({"type": "reply", "data": "r" * size}).decode(), False)


async def test_client_queue_is_bounded_by_bytes_as_well_as_events() -> None:
    broker = Broker(client_queue_size=1000, client_queue_bytes=10_000)
    slow, _ = broker.subscribe()
    for n in range(20):
        broker.publish(big(n, 1000))
    queued = slow.receive.bytes
    assert queued <= 10_000
    assert len(slow.receive) < 20  # far below the 1000-event bound
    assert slow.dropped == 20 - len(slow.receive)
    assert slow.peak_bytes <= 10_000
    frames = drain(slow)
    assert [f.type for f in frames][-1] == "gap"  # the drops are reported once there is room
    gap = orjson.loads(frames[-1].text)["payload"]
    assert gap["dropped"] == slow.dropped
    assert gap["to_seq"] == 20
    assert slow.receive.bytes == 0


async def test_one_item_larger_than_the_byte_bound_fits_an_empty_queue() -> None:
    broker = Broker(client_queue_bytes=100)
    stream, _ = broker.subscribe()
    broker.publish(big(0, 500))
    broker.publish(big(1, 10))  # behind an oversized item: no room
    assert [f.type for f in drain(stream)] == ["agent_event", "gap"]


async def test_replies_wait_for_room_then_a_client_that_does_not_read_is_disconnected(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = Broker(client_queue_size=1000, client_queue_bytes=10_000, must_deliver_timeout=2.0)
    stream, _ = broker.subscribe(client_id="reader-gone")
    started = trio.current_time()
    with trio.fail_after(WAIT):
        for _ in range(1100):  # each ~1 KB; the queue takes ten of them
            await stream.send_reply(reply(1000))
            if stream.killed.is_set():
                break
    assert stream.killed.is_set()
    assert stream.kill_code == 1013
    assert stream.kill_reason == "too slow"
    assert trio.current_time() - started == pytest.approx(2.0)
    assert stream.peak_bytes <= 10_000
    assert broker.killed == 1
    assert stream not in broker.clients
    assert stream.receive.bytes == 0  # what was queued is freed


async def test_a_waiting_reply_is_queued_once_the_client_takes_something(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = Broker(client_queue_bytes=3000, must_deliver_timeout=5.0)
    stream, _ = broker.subscribe()
    await stream.send_reply(reply(2000))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.send_reply, reply(2000))
        await trio.sleep(1)
        assert len(stream.receive) == 1  # the second reply waits for room
        broker.publish(big(0, 10))  # an event offered meanwhile is dropped, not put in front
        drain(stream)
    assert [f.type for f in drain(stream)] == ["reply", "gap"]
    assert not stream.killed.is_set()


async def test_a_full_client_of_an_idle_workspace_is_disconnected_after_the_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = Broker(client_queue_size=4, must_deliver_timeout=2.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(broker.watch_stalled)
        stalled, _ = broker.subscribe(client_id="stalled")
        reading, _ = broker.subscribe(client_id="reading")
        started = trio.current_time()
        for n in range(4):
            broker.publish(big(n, 10))  # then nothing more is published: the workspace is idle
        await trio.sleep(1.5)
        drain(reading)
        for n in range(4):
            broker.publish(big(n, 10))
        with trio.fail_after(WAIT):
            await stalled.killed.wait()
        assert trio.current_time() - started == pytest.approx(2.0)
        assert stalled.kill_reason == "too slow"
        assert broker.killed == 1
        # "reading" took events 1.5 s in, which restarted its bound: it is full again, and is
        # disconnected 2 s after that unless it reads.
        await trio.sleep(1.0)
        assert not reading.killed.is_set()
        drain(reading)
        await trio.sleep(5.0)
        assert not reading.killed.is_set()  # not full any more: no bound runs
        nursery.cancel_scope.cancel()


async def test_a_must_deliver_event_after_the_bytes_bound_waits_then_kills(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = Broker(client_queue_size=1000, client_queue_bytes=2000, must_deliver_timeout=2.0)
    slow, _ = broker.subscribe()
    broker.publish(big(0, 600))
    # Room for another 1,000 events but not for 1,500 more bytes: the event waits, then the
    # client that never makes room is disconnected.
    started = trio.current_time()
    await broker.publish_must_deliver(RunComplete("s", "r" * 1500), EventKind.CREATED)
    assert trio.current_time() - started == pytest.approx(2.0)
    assert slow.killed.is_set()
    assert broker.killed == 1


# -- replay bytes -------------------------------------------------------------------------------


async def test_replay_bytes_count_utf8_bytes_not_characters() -> None:
    broker = Broker(replay_bytes=4000)
    for n in range(50):
        broker.publish(AgentEvent("info", text="\U0001f600" * 100 + str(n)))  # 4 bytes each
    assert sum(len(e.text.encode()) for e in broker.replay) <= 4000
    assert all(e.size == len(e.text.encode()) for e in broker.replay)
    assert broker.stats()["replay_bytes"] == sum(e.size for e in broker.replay)


# -- workspaces per server, retired client ids -------------------------------------------------


async def test_workspaces_per_server_are_bounded_with_429_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "crush.json"
    config.write_text(orjson.dumps({"server": {"max_workspaces": 2}}).decode())
    async with running_server(tmp_path, config_file=config) as server:
        first = await server.open_workspace()
        await server.open_workspace()
        third = tmp_path / "third"
        third.mkdir()
        r = await server.http.post(
            "/v1/workspaces", json={"path": str(third), "client_id": str(uuid.uuid4())}
        )
        assert r.status_code == 429, r.text
        assert "server.max_workspaces" in r.json()["message"]
        # Joining a workspace that is already open is not a new one.
        again = await server.open_workspace(Path(first["path"]))
        assert again["id"] == first["id"]


async def test_retired_client_ids_expire_after_the_ttl(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = Backend(server=ServerOptions(retired_client_ttl=60.0))
    client = str(uuid.uuid4())
    backend.retire(client)
    assert backend.is_retired(client)
    await trio.sleep(59)
    assert backend.is_retired(client)
    await trio.sleep(2)
    assert not backend.is_retired(client)
    assert len(backend._retired) == 0


async def test_retired_client_ids_are_capped_oldest_forgotten_first() -> None:
    backend = Backend(server=ServerOptions(max_retired_clients=100))
    ids = [str(uuid.uuid4()) for _ in range(1000)]
    for client in ids:
        backend.retire(client)
    assert len(backend._retired) == 100
    assert not backend.is_retired(ids[0])
    assert backend.is_retired(ids[-1])
    assert all(backend.is_retired(c) for c in ids[-100:])


async def test_a_retired_client_is_refused_over_http_with_409(tmp_path: Path) -> None:
    async with running_server(tmp_path) as server:
        client = str(uuid.uuid4())
        r = await server.http.delete(f"/v1/clients/{client}")
        assert r.status_code == 200, r.text
        project = tmp_path / "p"
        project.mkdir()
        r = await server.http.post(
            "/v1/workspaces", json={"path": str(project), "client_id": client}
        )
        assert r.status_code == 409
        assert "retired" in r.json()["message"]


# -- holds: no scan of every client --------------------------------------------------------------


def _churn(holds: Holds, now: float, rounds: int, repeats: int = 5) -> float:
    """The quickest of ``repeats`` timings of ``rounds`` attach/detach/expire cycles, with the
    garbage collector off: a collection's pause is not the cost being compared."""
    best = math.inf
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            started = time.perf_counter()
            for n in range(rounds):
                client = f"churn-{n}"
                holds.attach(client)
                holds.detach(client, now)
                holds.expire(now)
                holds.next_deadline()
            best = min(best, time.perf_counter() - started)
    finally:
        if enabled:
            gc.enable()
    return best


def test_hold_deadlines_do_not_scan_every_client() -> None:
    """A workspace that thousands of short-lived clients passed through (each in its detach
    grace) costs per attach/detach what one with a few clients costs."""
    few = Holds(create_grace=30, detach_grace=10)
    many = Holds(create_grace=30, detach_grace=10)
    for n in range(20_000):
        many.attach(f"gone-{n}")
        many.detach(f"gone-{n}", float(n) / 1000)
    small = _churn(few, 1.0, 300)
    large = _churn(many, 1.0, 300)
    assert large < max(20 * small, 0.05), (small, large)
    # Every gone client still leaves when its grace ends.
    assert len(many.expire(100.0)) == 20_300
    assert not many.held
    assert many.next_deadline() is None


def test_a_client_that_reconnects_often_leaves_a_bounded_deadline_heap() -> None:
    holds = Holds(create_grace=30, detach_grace=10)
    for n in range(10_000):
        holds.attach("flappy")
        holds.detach("flappy", float(n))
    assert len(holds._deadlines) <= 2 * len(holds.clients) + 64
    assert holds.next_deadline() == 9999.0 + 10


# -- a command-reply flood over a real websocket -----------------------------------------------


@pytest.mark.parametrize("transport", ["trio-websocket", "asgi"])
async def test_a_client_that_floods_commands_and_never_reads_is_disconnected(
    tmp_path: Path, transport: str
) -> None:
    """Many ``messages.list`` replies of a large session, never read: the client's queue holds at
    most ``client_queue_bytes``, then the client is disconnected (1013)."""
    config = tmp_path / "crush.json"
    server_options = {
        "client_queue_bytes": 1024 * 1024,
        "must_deliver_timeout": 0.5,
        "detach_grace": 0,
        "ws_transport": transport,
    }
    config.write_text(orjson.dumps({"server": server_options}).decode())
    async with running_server(tmp_path, config_file=config) as server:
        info = await server.open_workspace()
        wid = info["id"]
        sid = (await server.create_session(wid))["id"]
        ws = server.backend.get(wid)
        watcher, _ = ws.broker.subscribe(client_id="run-watcher")
        run = await server.prompt(wid, sid, "word " * 10_000)  # echoed: ~100 KB of messages
        with trio.fail_after(WAIT):
            async for event in watcher.receive:  # until the run's messages are stored
                if event.type == "run_complete":
                    break
        watcher.close()
        assert run["run_id"]
        async with trio.open_nursery() as nursery:
            flooder = str(uuid.uuid4())
            sock = await _raw_websocket(server.url, wid, flooder, server.token)
            (stream,) = [c for c in ws.broker.clients if c.client_id == flooder]
            command = orjson.dumps(
                {"id": 1, "method": "messages.list", "params": {"session_id": sid}}
            )

            async def flood() -> None:
                frame = _masked_text_frame(command)
                for _ in range(1100):
                    await sock.send(frame)

            nursery.start_soon(flood)
            with trio.fail_after(WAIT):
                await stream.killed.wait()
            nursery.cancel_scope.cancel()
        sock.close()
        assert stream.kill_code == 1013
        assert stream.kill_reason == "too slow"
        # Several replies were queued, never more bytes than the bound.
        assert stream.peak_depth > 1
        assert stream.peak_bytes <= 1024 * 1024
        assert stream.receive.bytes == 0
        assert (await server.http.get("/v1/health")).status_code == 200


async def test_a_stalled_websocket_of_an_idle_workspace_is_disconnected(tmp_path: Path) -> None:
    """Nothing must be delivered (no run, no permission): the client that stopped reading is
    still disconnected once its queue has been full for ``must_deliver_timeout``."""
    config = tmp_path / "crush.json"
    server_options = {"client_queue_bytes": 1024 * 1024, "must_deliver_timeout": 0.5}
    config.write_text(orjson.dumps({"server": server_options}).decode())
    async with running_server(tmp_path, config_file=config) as server:
        wid = (await server.open_workspace())["id"]
        ws = server.backend.get(wid)
        client = str(uuid.uuid4())
        sock = await _raw_websocket(server.url, wid, client, server.token)
        (stream,) = [c for c in ws.broker.clients if c.client_id == client]
        full_since: list[float] = []

        async def keep_full() -> None:
            # The writer may still move a frame into the kernel's buffers after the queue first
            # filled, which restarts the client's bound: refill whenever that happens.
            n = 0
            while True:
                if stream.full_since is None:
                    ws.broker.publish(big(n, 64 * 1024))
                    n += 1
                else:
                    if not full_since or full_since[-1] != stream.full_since:
                        full_since.append(stream.full_since)
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_full)
            with trio.fail_after(WAIT):
                await stream.killed.wait()
            nursery.cancel_scope.cancel()
        assert full_since
        assert trio.current_time() - full_since[-1] >= 0.5
        assert stream.kill_code == 1013
        assert stream.kill_reason == "too slow"
        sock.close()
        assert not ws.closing  # the workspace itself is untouched


async def _raw_websocket(url: str, wid: str, client_id: str, token: str) -> trio.socket.SocketType:
    """An upgraded websocket as a bare socket (frames are read only when the test wants)."""
    host, port = url.removeprefix("http://").split(":")
    sock = trio.socket.socket()
    await sock.connect((host, int(port)))
    key = base64.b64encode(os.urandom(16)).decode()
    head = (
        f"GET /v1/workspaces/{wid}/ws?client_id={client_id}&token={token} HTTP/1.1\r\n"
        f"Host: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    await sock.send(head.encode())
    data = b""
    with trio.fail_after(WAIT):
        while b"\r\n\r\n" not in data:
            chunk = await sock.recv(65536)
            assert chunk, "the server closed the connection during the upgrade"
            data += chunk
    assert data.startswith(b"HTTP/1.1 101"), data[:200]
    with trio.fail_after(WAIT):  # the hello frame: the server has subscribed the client
        while not data.partition(b"\r\n\r\n")[2]:
            chunk = await sock.recv(65536)
            assert chunk, "the server closed the connection before hello"
            data += chunk
    return sock


def _masked_text_frame(payload: bytes) -> bytes:
    mask = os.urandom(4)
    size = len(payload)
    if size < 126:
        header = bytes((0x81, 0x80 | size))
    elif size < 1 << 16:
        header = bytes((0x81, 0x80 | 126)) + size.to_bytes(2, "big")
    else:
        header = bytes((0x81, 0x80 | 127)) + size.to_bytes(8, "big")
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


# -- per-client state leaves: aborted connections, measured in a server process ----------------

#: Connections per round, and rounds after the warm-up one.
CONNECTIONS = 500
ROUNDS = 3
#: Tolerances: resident memory may move by this much from its level after the warm-up round.
RSS_TOLERANCE_MB = 3.0


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _connect_and_abort(port: int, wid: str, limit: trio.Semaphore) -> None:
    async with limit:
        sock = await _raw_websocket(f"http://127.0.0.1:{port}", wid, str(uuid.uuid4()), "tok")
        # hello arrived; now the connection is reset: no close frame, no FIN.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


#: The server's DEBUG line once it has closed an event websocket's socket (listener.contained).
CLOSED_MARK = b"crush_trio.server.listener: event websocket from "
#: The server command: ``crush_trio serve`` with only the listener's logger at DEBUG, so that it
#: reports each closed connection on stderr and nothing else is logged below ERROR.
SERVE_WITH_CLOSE_LINES = (
    "import logging, sys; from crush_trio.cli import main; "
    "logging.getLogger('crush_trio.server.listener').setLevel(logging.DEBUG); "
    "logging.getLogger('crush_trio.changes.service').setLevel(logging.DEBUG); "
    "sys.exit(main(sys.argv[1:]))"
)
#: The change log's line once its first snapshot of a workspace is taken (its git commands
#: and their pipes are gone).
WARMED_MARK = b"first snapshot taken"


class ClosedConnections:
    """Counts the server's ``event websocket from ... closed`` lines as they arrive on stderr,
    and notes the change log's first snapshot (:data:`WARMED_MARK`)."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = trio.Event()
        self.warmed = trio.Event()

    async def read(self, stderr: trio.abc.ReceiveStream) -> None:
        pending = b""
        async for chunk in stderr:
            *lines, pending = (pending + chunk).split(b"\n")
            if any(WARMED_MARK in line for line in lines):
                self.warmed.set()
            closed = sum(1 for line in lines if CLOSED_MARK in line and line.endswith(b" closed"))
            if closed:
                self.count += closed
                self._changed.set()
                self._changed = trio.Event()

    async def wait_for(self, total: int) -> None:
        """Until the server has closed ``total`` event websockets in all (bounded)."""
        with trio.fail_after(WAIT):
            while self.count < total:
                await self._changed.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
async def test_aborted_websockets_leave_rss_and_descriptors_at_their_baseline(
    tmp_path: Path,
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    config = {
        "providers": {"echo": {"type": "echo", "delay_ms": 5}},
        "models": {"large": {"provider": "echo", "model": "echo"}},
        "server": {"detach_grace": 0.2},
    }
    (tmp_path / "server.json").write_text(orjson.dumps(config).decode())
    cmd = [
        sys.executable,
        "-c",
        SERVE_WITH_CLOSE_LINES,
        "serve",
        "--port",
        "0",
        "--token",
        "tok",
        "--data-dir",
        str(tmp_path / "data"),
        "--config",
        str(tmp_path / "server.json"),
        "--no-access-log",
        "--log-level",
        "ERROR",
    ]
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    closes = ClosedConnections()
    async with trio.open_nursery() as nursery:
        proc: trio.Process = await nursery.start(
            partial(
                trio.run_process,
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                check=False,
            )
        )
        try:
            assert proc.stdout is not None
            assert proc.stderr is not None
            nursery.start_soon(closes.read, proc.stderr)
            line = b""
            with trio.fail_after(20):
                while not line.endswith(b"\n"):
                    line += await proc.stdout.receive_some(1)
            url = line.decode().split()[-1].split("/?")[0]
            port = int(url.rsplit(":", 1)[1])
            await _rounds_keep_baseline(url, port, project, proc.pid, closes)
        finally:
            proc.terminate()
            with trio.move_on_after(WAIT):
                await proc.wait()
            proc.kill()


async def _rounds_keep_baseline(
    url: str, port: int, project: Path, pid: int, closes: ClosedConnections
) -> None:
    headers = {"Authorization": "Bearer tok"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=WAIT) as http:
        r = await http.post(
            "/v1/workspaces", json={"path": str(project), "client_id": str(uuid.uuid4())}
        )
        assert r.status_code == 200, r.text
        wid = r.json()["id"]
        r = await http.post(f"/v1/workspaces/{wid}/sessions", json={"title": "streaming"})
        sid = r.json()["id"]
        words = " ".join(f"w{n}" for n in range(20_000))  # streams for the whole test
        r = await http.post(
            f"/v1/workspaces/{wid}/agent", json={"session_id": sid, "prompt": words}
        )
        assert r.status_code == 202, r.text
        # The workspace's first snapshot runs git (subprocesses and their pipes) in the
        # background from its open, and the turn's user message is written as it starts: the
        # baseline is taken once both are done.
        with trio.fail_after(WAIT):
            while not (await http.get(f"/v1/workspaces/{wid}/sessions/{sid}/messages")).json():
                pass
            await closes.warmed.wait()
        limit = trio.Semaphore(50)
        fds_before = _fds(pid)

        rounds = 0

        async def one_round() -> int:
            """One round of aborted connections; the server's descriptors once it has closed
            every one of them (it closes an aborted socket when it notices the reset)."""
            nonlocal rounds
            async with trio.open_nursery() as nursery:
                for _ in range(CONNECTIONS):
                    nursery.start_soon(_connect_and_abort, port, wid, limit)
            assert (await http.get("/v1/health")).status_code == 200
            rounds += 1
            await closes.wait_for(rounds * CONNECTIONS)
            return _fds(pid)

        fds_base = await one_round()  # warm-up: the allocator's arenas, the first-use caches
        rss_base = _rss_mb(pid)
        samples = []
        for _ in range(ROUNDS):
            fds = await one_round()
            samples.append((_rss_mb(pid), fds))
        print(f"fds {fds_before} -> {fds_base}; rss base {rss_base:.1f} MB; rounds {samples}")
        assert fds_base == fds_before
        assert all(fds == fds_base for _, fds in samples), samples
        assert max(rss for rss, _ in samples) <= rss_base + RSS_TOLERANCE_MB, (rss_base, samples)
        r = await http.post(f"/v1/workspaces/{wid}/agent/sessions/{sid}/cancel", json={})
        assert r.status_code == 200, r.text


# -- structures that grow with sessions and configs: each one bounded --------------------------


async def _grant_for_session(
    service: PermissionService, session_id: str, path: str, action: str = "allow_session"
) -> bool:
    """One tool call of ``session_id`` writing ``path``, answered with ``action``; returns
    whether it had to ask (False: an earlier grant covered it)."""
    asked = False
    async with trio.open_nursery() as nursery:

        async def answer() -> None:
            nonlocal asked
            with trio.fail_after(WAIT):
                while not service.pending:
                    await trio.testing.wait_all_tasks_blocked()
            asked = True
            assert await service.grant(service.pending[0].id, action)

        nursery.start_soon(answer)
        allowed = await service.request(
            session_id=session_id,
            tool_call_id=f"call-{path}",
            tool_name="write",
            action="write",
            description="",
            params={"path": path},
            path=path,
        )
        assert allowed
        nursery.cancel_scope.cancel()
    return asked


async def test_session_grants_are_bounded_oldest_forgotten_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(permissions, "MAX_SESSION_GRANTS", 8)
    service = PermissionService(Broker(), allowed_tools=[])
    for i in range(12):  # twelve sessions, one grant each
        assert await _grant_for_session(service, f"s{i}", f"/w/f{i}")
    assert service.grants == 8
    assert not await _grant_for_session(service, "s11", "/w/f11")  # the newest is kept
    assert await _grant_for_session(service, "s0", "/w/f0")  # the oldest asks again


async def test_a_deleted_sessions_grants_are_forgotten() -> None:
    service = PermissionService(Broker(), allowed_tools=[])
    for i in range(5):
        assert await _grant_for_session(service, "gone", f"/w/f{i}")
    assert await _grant_for_session(service, "kept", "/w/f0")
    service.forget_session("gone")
    assert service.grants == 1
    assert await _grant_for_session(service, "gone", "/w/f1")


def test_provider_label_values_are_bounded() -> None:
    metrics = Metrics()
    for i in range(MAX_PROVIDER_LABELS + 20):
        metrics.provider(f"provider-{i}").requests.inc()
    assert len(metrics._providers) == MAX_PROVIDER_LABELS + 1  # the kept names and "other"
    labels = {
        s.labels["provider"]
        for s in metrics.provider_requests.collect()[0].samples
        if s.name.endswith("_total")
    }
    assert len(labels) == MAX_PROVIDER_LABELS + 1
    assert "other" in labels
    assert metrics.provider("provider-0") is metrics._providers["provider-0"]  # kept names stay
