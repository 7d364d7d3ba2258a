"""Lifetimes: client holds and graces, slow clients, SIGTERM, restart and crash recovery.

What a client is told and reads back (a run cancelled by SIGTERM, records after a restart) goes
through the client library. The slow-client tests stay raw: they are about what the server does
with one socket that never reads, which a client library (it reconnects) would hide.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio
import trio.testing

from crush_trio.backend.registry import Backend
from crush_trio.backend.workspace import Workspace
from crush_trio.client import Event, connect
from crush_trio.config import ServerOptions
from crush_trio.core.holds import Holds, HoldState
from crush_trio.embedded import embedded
from crush_trio.errors import Fenced
from crush_trio.store import Store
from crush_trio.wire import FinishReason, Message, Role, Run, RunStatus, Session, TextPart

from .conftest import running_server, serve_options

#: Bound on a graceful shutdown with a stalled websocket client (docs/protocol.md "Bounds").
STALLED_SHUTDOWN_BOUND = 15.0
#: Bound on each wait of a test on a server subprocess: streaming, SIGTERM, exit (seconds).
SIGNAL_WAIT = 20.0


# -- holds as plain logic ---------------------------------------------------------------------


def test_holds_create_grace_detach_grace_and_release() -> None:
    holds = Holds(create_grace=30, detach_grace=10)
    holds.open("a", now=0)
    assert holds.clients["a"].phase is HoldState.PENDING
    assert holds.next_deadline() == 30
    assert holds.expire(29.9) == []
    assert holds.held
    holds.attach("a")
    assert holds.clients["a"].phase is HoldState.ATTACHED
    assert holds.next_deadline() is None
    holds.attach("a")
    holds.detach("a", now=40)
    assert holds.next_deadline() is None  # one stream is still open
    holds.detach("a", now=41)
    assert holds.clients["a"].phase is HoldState.DETACHED
    assert holds.next_deadline() == 51
    holds.attach("a")  # a quick reconnect keeps it
    holds.detach("a", now=60)
    assert holds.expire(69) == []
    assert holds.expire(70) == ["a"]
    assert not holds.held
    holds.open("b", now=0)
    holds.attach("b")
    holds.release("b")
    assert holds.held  # still streaming
    holds.detach("b", now=1)
    assert not holds.held  # released: gone at the last detach, no grace


# -- holds in a running backend, clock controlled ---------------------------------------------


async def test_create_and_detach_grace_expire(
    tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    project = tmp_path / "p"
    project.mkdir()
    backend = Backend(server=ServerOptions(), data_dir=tmp_path / "data", user_config_dir=tmp_path)
    async with backend.running():
        ws = await backend.open(str(project), str(uuid.uuid4()))
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(29)
        await trio.testing.wait_all_tasks_blocked()
        assert not ws.closing  # still inside the 30 s create grace
        client = str(uuid.uuid4())
        ws.attach(client)  # a second client streams
        mock_clock.jump(2)  # the creator's grace lapses; the streaming client holds it
        await trio.testing.wait_all_tasks_blocked()
        assert not ws.closing
        assert list(ws.holds.clients) == [client]
        ws.detach(client)
        await trio.testing.wait_all_tasks_blocked()
        mock_clock.jump(9)
        await trio.testing.wait_all_tasks_blocked()
        assert not ws.closing  # inside the 10 s detach grace
        mock_clock.jump(2)
        mock_clock.rate = 1  # let real time flow for the bounded wait below
        with trio.fail_after(10):
            await ws.closed.wait()
        with pytest.raises(Exception, match="not found"):
            backend.get(ws.id)


# -- slow clients -----------------------------------------------------------------------------


def stalled_websocket(url: str, path: str) -> socket.socket:
    """Open a websocket with a raw socket and never read from it again."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(
        (
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


async def test_client_that_never_reads_is_bounded_and_does_not_stall_others(tmp_path: Path) -> None:
    config = tmp_path / "crush.json"
    config.write_text(
        '{"server": {"client_queue_size": 64, "must_deliver_timeout": 0.5, "tcp_user_timeout_ms": 1000},'
        ' "options": {"debounce_ms": 1},'
        ' "providers": {"echo": {"type": "echo", "delay_ms": 1}},'
        ' "models": {"large": {"provider": "echo", "model": "echo"}}}'
    )
    async with running_server(tmp_path, config_file=config) as server:
        ws = await server.open_workspace()
        wid = ws["id"]
        session = await server.create_session(wid)
        token = server.token
        stalled = await trio.to_thread.run_sync(
            stalled_websocket,
            server.url,
            f"/v1/workspaces/{wid}/ws?client_id={uuid.uuid4()}&token={token}",
        )
        try:
            workspace = server.backend.get(wid)
            words = " ".join(f"w{i}" for i in range(3000))
            with trio.fail_after(30):
                async with server.websocket(wid) as reader:
                    await server.prompt(wid, session["id"], words, run_id="big")
                    complete, _ = await reader.run_complete("big")
            assert complete["text"] == words
            stats = workspace.broker.stats()
            assert stats["published"] > 1000  # thousands of updates streamed
            assert stats["dropped"] > 0  # the stalled client lost lossy events, counted
            stalled_streams = [c for c in workspace.broker.clients if c.dropped]
            for client in stalled_streams:
                assert client.peak_depth <= client.size  # its queue never grew past the bound
            # It either got its run_complete queued or was disconnected as too slow.
            killed = workspace.broker.killed
            assert killed in (0, 1)
            run = await server.run(wid, "big")
            assert run["status"] == "completed"
        finally:
            stalled.close()


# -- signals, restart, crash recovery (subprocess server) -------------------------------------


class ServerProcess:
    def __init__(self, tmp_path: Path, config: dict[str, Any]) -> None:
        self.tmp = tmp_path
        self.config_path = tmp_path / "server.json"
        self.config_path.write_text(orjson.dumps(config).decode())
        self.proc: trio.Process | None = None
        self.url = ""

    async def start(self, nursery: trio.Nursery) -> None:
        cmd = [
            sys.executable,
            "-m",
            "crush_trio",
            "serve",
            "--port",
            "0",
            "--token",
            "tok",
            "--data-dir",
            str(self.tmp / "data"),
            "--config",
            str(self.config_path),
            "--no-access-log",
        ]
        env = {**os.environ, "XDG_CONFIG_HOME": str(self.tmp / "xdg")}
        self.proc = await nursery.start(
            partial(
                trio.run_process,
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
                check=False,
            )
        )
        assert self.proc.stdout is not None
        line = b""
        with trio.fail_after(20):
            while not line.endswith(b"\n"):
                line += await self.proc.stdout.receive_some(1)
        assert line.startswith(b"crush-trio listening on http://")
        self.url = line.decode().split()[-1].split("/?")[0]

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.url, headers={"Authorization": "Bearer tok"}, timeout=10
        )

    async def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return await self.proc.wait()


def streamed_text(event: Event) -> int:
    """How much assistant text a ``message`` or ``message_delta`` event leads to (0 for any other
    event)."""
    message = event.message
    if message is None or message.role is not Role.ASSISTANT:
        return 0
    return len(message.text())


async def _open(client: httpx.AsyncClient, project: Path) -> tuple[str, str]:
    r = await client.post(
        "/v1/workspaces", json={"path": str(project), "client_id": str(uuid.uuid4())}
    )
    assert r.status_code == 200, r.text
    return r.json()["id"], str(uuid.uuid4())


@pytest.mark.slow
async def test_sigterm_during_run_exits_0_and_restart_finds_the_partial_reply(
    tmp_path: Path,
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    config = {
        "providers": {"echo": {"type": "echo", "delay_ms": 50}},
        "models": {"large": {"provider": "echo", "model": "echo"}},
    }
    words = " ".join(f"word{i}" for i in range(200))
    async with trio.open_nursery() as nursery:
        server = ServerProcess(tmp_path, config)
        await server.start(nursery)
        async with connect(server.url, "tok") as client, client.workspace(project) as ws:
            sid = (await ws.create_session()).id
            handle = await ws.prompt(sid, words, run_id="sig")
            async for event in handle.events(SIGNAL_WAIT):  # until some text has streamed
                if streamed_text(event) > 30:
                    break
            else:
                raise AssertionError("run sig ended before any text streamed")
            with trio.fail_after(SIGNAL_WAIT):
                assert await server.stop() == 0
            # The server told this client that the run was cancelled before it went away.
            await handle.wait(SIGNAL_WAIT)
            assert handle.complete is not None
            assert handle.complete.cancelled is True
        restarted = ServerProcess(tmp_path, config)
        await restarted.start(nursery)
        async with connect(restarted.url, "tok") as client, client.workspace(project) as ws:
            run = await ws.get_run("sig")
            assert run.status is RunStatus.CANCELLED
            assistant = (await ws.messages(sid))[-1]
            text = assistant.text()
            assert len(text) > 30
            assert words.startswith(text)
            assert text != words
            assert run.text == text
            finish = assistant.finish()
            assert finish is not None
            assert finish.reason is FinishReason.CANCELED
            with trio.fail_after(SIGNAL_WAIT):
                assert await restarted.stop() == 0


@pytest.mark.slow
async def test_sigterm_with_a_stalled_websocket_client_exits_within_bound(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    config = {
        "providers": {"echo": {"type": "echo", "delay_ms": 1}},
        "models": {"large": {"provider": "echo", "model": "echo"}},
        "server": {"tcp_user_timeout_ms": 2000},
    }
    async with trio.open_nursery() as nursery:
        server = ServerProcess(tmp_path, config)
        await server.start(nursery)
        async with server.client() as client:
            wid, cid = await _open(client, project)
            sid = (await client.post(f"/v1/workspaces/{wid}/sessions", json={})).json()["id"]
            stalled = await trio.to_thread.run_sync(
                stalled_websocket, server.url, f"/v1/workspaces/{wid}/ws?client_id={cid}&token=tok"
            )
            try:
                words = " ".join(["padding-" * 20] * 3000)
                r = await client.post(
                    f"/v1/workspaces/{wid}/agent", json={"session_id": sid, "prompt": words}
                )
                assert r.status_code == 202
                assert r.json()["status"] == "running"  # streaming into the stalled socket
                started = trio.current_time()
                with trio.fail_after(STALLED_SHUTDOWN_BOUND):
                    assert await server.stop() == 0
                assert trio.current_time() - started < STALLED_SHUTDOWN_BOUND
            finally:
                stalled.close()


async def test_runs_left_running_by_a_killed_server_are_marked_failed(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    # Leave behind what a killed process would: a running run and an unfinished reply.
    async with embedded(serve_options(tmp_path)) as client, client.workspace(project) as ws:
        data_dir = Path(ws.info.data_dir)
    store = await Store.open(data_dir)
    session = Session("s-crash", title="t")
    await store.create_session(session)
    await store.write_messages(
        [
            Message("m-user", "s-crash", Role.USER, [TextPart("hi")]),
            Message("m-asst", "s-crash", Role.ASSISTANT, [TextPart("half a rep")]),
        ]
    )
    await store.save_runs(
        [Run("crashed", "s-crash", RunStatus.RUNNING), Run("waiting", "s-crash", RunStatus.QUEUED)]
    )
    await store.aclose()
    async with embedded(serve_options(tmp_path)) as client, client.workspace(project) as ws:
        for run_id in ("crashed", "waiting"):
            run = await ws.get_run(run_id)
            assert run.status is RunStatus.FAILED
            assert run.error == "server stopped before the run finished"
        msgs = await ws.messages("s-crash")
    finish = msgs[-1].finish()
    assert finish is not None
    assert finish.reason is FinishReason.ERROR
    assert msgs[-1].parts[0] == TextPart("half a rep")


async def test_a_close_step_a_newer_owner_refuses_is_told_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A node whose workspace was taken over finds its last writes refused at close (Fenced):
    each is one warning line, not a traceback; any other failure keeps its traceback."""
    workspace = object.__new__(Workspace)  # _close_step needs only the id
    workspace.id = "w-fenced"

    async def fenced() -> None:
        raise Fenced("workspace 'w-fenced' is no longer owned by this node")

    async def broken() -> None:
        raise RuntimeError("disk on fire")

    with caplog.at_level(logging.WARNING, logger="crush_trio.backend.workspace"):
        await workspace._close_step("saving run records", fenced, 1.0)
        await workspace._close_step("writing messages", broken, 1.0)
    refused, failed = caplog.records
    assert (refused.levelno, refused.exc_info) == (logging.WARNING, None)
    assert "saving run records at close refused" in refused.getMessage()
    assert "no longer owned" in refused.getMessage()
    assert failed.levelno == logging.ERROR
    assert failed.exc_info is not None
