"""Durable acceptance and the bounds on queued prompts (docs/protocol.md "Durability of an
accepted prompt", "Bounds on queued prompts").

The fast tests run a real server in the test's trio run (the ``crush_server`` plugin fixture) and
hold the run-record writer at a gate, so the order "commit, then 202" is checked without timing.
The kill -9 loop (marked slow) starts the real server as a subprocess and kills it at random
moments, then checks after each restart that every run answered 202 has a terminal record.
"""

from __future__ import annotations

import collections
import functools
import gc
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import tracemalloc
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import httpx
import orjson
import pytest
import trio
import trio.testing

from crush_trio.agent.runs import RECENT_RUNS_BYTES, RECENT_RUNS_KEPT
from crush_trio.backend.workspace import STOPPED_RUN_ERROR, data_dir_for
from crush_trio.config import Config
from crush_trio.providers.scripted import Gate, ScriptedModel, Step
from crush_trio.store import Store
from crush_trio.store.db import DB_FILENAME, MIGRATIONS
from crush_trio.wire import (
    FinishPart,
    FinishReason,
    Message,
    Role,
    Run,
    RunStatus,
    Session,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)

from .conftest import WAIT, completes_run, event_socket, ws_url
from .fake_llm import FakeLLM, RecordedRequest, Reply, ToolCall

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from crush_trio.client import WorkspaceClient
    from crush_trio.testing import CrushServer

REPO: Final = Path(__file__).resolve().parent.parent


def _http(server: CrushServer) -> httpx.AsyncClient:
    # httpx sends Host: 127.0.0.1:<port> from the base URL; json= sets the content type.
    return httpx.AsyncClient(
        base_url=server.url,
        headers={"Authorization": f"Bearer {server.token}"},
        timeout=WAIT,
    )


def _db_rows(path: Path, run_ids: list[str]) -> dict[str, tuple[str, str]]:
    """``run_id -> (status, prompt)`` read by a separate connection (what a restart would see)."""
    conn = sqlite3.connect(path)
    try:
        marks = ", ".join("?" * len(run_ids))
        rows = conn.execute(
            f"SELECT run_id, status, prompt FROM runs WHERE run_id IN ({marks})", run_ids
        ).fetchall()
    finally:
        conn.close()
    return {r[0]: (r[1], r[2]) for r in rows}


class _HeldWriter:
    """Holds every run-record transaction of a store until released."""

    def __init__(self, store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reached = trio.Event()
        self.release = trio.Event()
        original = store.save_runs

        async def held(runs: list[Run], prompts: Any = None) -> None:
            self.reached.set()
            await self.release.wait()
            await original(runs, prompts)

        monkeypatch.setattr(store, "save_runs", held)


# ---------------------------------------------------------------------------------------------
# 202 after commit


async def test_http_202_waits_for_the_commit_of_the_run_and_its_prompt(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ws = crush_workspace
    sid = (await ws.create_session()).id
    workspace = crush_server.backend.get(ws.id)
    writer = _HeldWriter(workspace.store, monkeypatch)
    answers: list[httpx.Response] = []
    async with _http(crush_server) as http:

        async def post() -> None:
            body = {"session_id": sid, "prompt": "keep me", "run_id": "held-http"}
            answers.append(await http.post(f"/v1/workspaces/{ws.id}/agent", json=body))

        with trio.fail_after(WAIT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post)
                await writer.reached.wait()
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                # Accepted in memory (the run streams meanwhile), but not yet answered.
                assert workspace.runs.known("held-http")
                assert answers == []
                assert _db_rows(workspace.store.path, ["held-http"]) == {}
                writer.release.set()
        assert answers[0].status_code == 202, answers[0].text
        assert _db_rows(workspace.store.path, ["held-http"])["held-http"][1] == "keep me"


async def test_websocket_prompt_reply_waits_for_the_commit(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reply to agent.prompt waits for the commit; the connection's next commands are
    answered meanwhile."""
    ws = crush_workspace
    sid = (await ws.create_session()).id
    workspace = crush_server.backend.get(ws.id)
    writer = _HeldWriter(workspace.store, monkeypatch)
    url = ws_url(crush_server.url, ws.id, str(uuid.uuid4()), token=crush_server.token)

    def is_reply(request_id: int) -> Callable[[dict[str, Any]], bool]:
        return lambda f: f.get("type") == "reply" and f.get("id") == request_id

    with trio.fail_after(WAIT):
        async with event_socket(url) as sock:
            params = {"session_id": sid, "prompt": "keep me too", "run_id": "held-ws"}
            for request_id, method, body in (
                (1, "agent.prompt", params),
                (2, "runs.get", {"run_id": "held-ws"}),
            ):
                frame = {"id": request_id, "method": method, "params": body}
                await sock.conn.send_message(orjson.dumps(frame).decode())
            seen = await sock.until(is_reply(2))
            assert seen[-1]["ok"]
            assert seen[-1]["result"]["status"] == "running"
            await writer.reached.wait()
            assert not [f for f in seen if is_reply(1)(f)]
            assert _db_rows(workspace.store.path, ["held-ws"]) == {}
            writer.release.set()
            prompt_reply = (await sock.until(is_reply(1)))[-1]
    assert prompt_reply["ok"] is True, prompt_reply
    assert _db_rows(workspace.store.path, ["held-ws"])["held-ws"][1] == "keep me too"


async def test_a_burst_of_prompts_shares_its_commits(
    crush_server: CrushServer, crush_workspace: WorkspaceClient
) -> None:
    """50 prompts accepted at once are made durable by a few transactions, not 50."""
    ws = crush_workspace
    sids = [(await ws.create_session()).id for _ in range(50)]
    workspace = crush_server.backend.get(ws.id)
    before = workspace.runs.commits
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            for i, sid in enumerate(sids):
                nursery.start_soon(workspace.agent.submit, sid, f"burst {i}", f"burst-{i}")
    commits = workspace.runs.commits - before
    assert commits <= 3, f"{commits} commits for 50 prompts"
    rows = _db_rows(workspace.store.path, [f"burst-{i}" for i in range(50)])
    assert {rows[f"burst-{i}"][1] for i in range(50)} == {f"burst {i}" for i in range(50)}


async def test_a_failed_commit_answers_an_error_and_accepts_nothing(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ws = crush_workspace
    sid = (await ws.create_session()).id
    workspace = crush_server.backend.get(ws.id)
    original = workspace.store.save_runs
    failed = trio.Event()

    async def broken(runs: list[Run], prompts: Any = None) -> None:
        if not failed.is_set() and prompts:
            failed.set()
            raise sqlite3.OperationalError("disk I/O error")
        await original(runs, prompts)

    monkeypatch.setattr(workspace.store, "save_runs", broken)
    async with _http(crush_server) as http:
        r = await http.post(
            f"/v1/workspaces/{ws.id}/agent",
            json={"session_id": sid, "prompt": "lost?", "run_id": "unsaved"},
        )
    assert r.status_code == 500, r.text
    assert "could not be saved" in r.json()["message"]
    assert "send it again" in r.json()["message"]


# ---------------------------------------------------------------------------------------------
# Recovery


async def test_recovery_fails_every_accepted_run_and_repairs_the_history(
    crush_server: CrushServer, crush_client: Any
) -> None:
    """What a killed process leaves (runs running and queued, a reply mid-stream with a tool
    call half sent, a tool that was running) is ended when the workspace opens again."""
    project = crush_server.project()
    data_dir = data_dir_for(project.resolve(), Config(), crush_server.root / "data")
    store = await Store.open(data_dir)
    try:
        await store.create_session(Session("s1"))
        await store.create_session(Session("s2"))
        await store.save_runs(
            [Run("r-running", "s1", RunStatus.RUNNING), Run("r-queued", "s1", RunStatus.QUEUED)],
            {"r-running": "first", "r-queued": "second"},
        )
        await store.save_runs([Run("r-tool", "s2", RunStatus.RUNNING)], {"r-tool": "third"})
        streaming = Message("m1", "s1", Role.ASSISTANT, [TextPart("half a re")])
        streaming.parts.append(ToolCallPart("c1", "bash", '{"comm'))
        tool_use = Message(
            "m2", "s2", Role.ASSISTANT, [ToolCallPart("c2", "bash", "{}", finished=True)]
        )
        tool_use.parts.append(FinishPart(FinishReason.TOOL_USE))
        await store.write_messages([streaming, tool_use])
    finally:
        await store.aclose()

    async with crush_client.workspace(project) as ws:
        for run_id in ("r-running", "r-queued", "r-tool"):
            run = await ws.get_run(run_id)
            assert run.status is RunStatus.FAILED
            assert run.error == STOPPED_RUN_ERROR
        s1 = await ws.messages("s1")
        s2 = await ws.messages("s2")
    finish = s1[0].finish()
    assert finish is not None
    assert finish.reason is FinishReason.ERROR
    assert s1[0].tool_calls()[0].input == "{}"
    assert s1[0].tool_calls()[0].finished
    # Both sessions' tool calls got an error result right after their message.
    for history, call_id in ((s1, "c1"), (s2, "c2")):
        assert [m.role for m in history] == [Role.ASSISTANT, Role.TOOL]
        result = history[1].parts[0]
        assert isinstance(result, ToolResultPart)
        assert result.tool_call_id == call_id
        assert result.is_error


# ---------------------------------------------------------------------------------------------
# Bounds on queued prompts


@pytest.fixture
def crush_config() -> dict[str, Any]:
    return {"server": {"max_queued_prompts": 3, "max_queued_prompt_bytes": 1000}}


@asynccontextmanager
async def _busy_session(
    ws: WorkspaceClient, scripted_model: ScriptedModel
) -> AsyncIterator[tuple[str, Gate]]:
    """A session whose turn is parked before streaming (released on exit)."""
    gate = Gate()
    scripted_model.add(Step(text="done", gate_before=gate))
    sid = (await ws.create_session()).id
    handle = await ws.prompt(sid, "hold the session", run_id=f"busy-{sid}")
    with trio.fail_after(WAIT):
        await gate.reached.wait()
    try:
        yield sid, gate
    finally:
        await ws.cancel(sid)
        gate.release()
        await handle.wait(WAIT)


async def test_queue_bound_by_count_answers_429_naming_the_key(
    crush_server: CrushServer, crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    async with _busy_session(ws, scripted_model) as (sid, _gate), _http(crush_server) as http:
        url = f"/v1/workspaces/{ws.id}/agent"
        for i in range(3):
            r = await http.post(url, json={"session_id": sid, "prompt": f"q{i}", "run_id": f"q{i}"})
            assert r.status_code == 202, r.text
        r = await http.post(url, json={"session_id": sid, "prompt": "one more", "run_id": "q3"})
        assert r.status_code == 429, r.text
        message = r.json()["message"]
        assert "server.max_queued_prompts" in message
        assert " 3" in message
        # Refused means no run: the id is free and nothing was queued.
        assert (await http.get(f"/v1/workspaces/{ws.id}/runs/q3")).status_code == 404
        listed = await http.get(f"/v1/workspaces/{ws.id}/agent/sessions/{sid}/prompts/list")
        assert listed.json() == ["q0", "q1", "q2"]
        # Over the websocket the same refusal.
        sock_url = ws_url(crush_server.url, ws.id, str(uuid.uuid4()), token=crush_server.token)
        with trio.fail_after(WAIT):
            async with event_socket(sock_url) as sock:
                reply = await sock.command("agent.prompt", session_id=sid, prompt="ws one more")
        assert reply["ok"] is False
        assert reply["status"] == 429
        assert "server.max_queued_prompts" in reply["message"]
        # A session's bound is its own: another idle session still takes prompts.
        other = (await ws.create_session()).id
        r = await http.post(url, json={"session_id": other, "prompt": "elsewhere"})
        assert r.status_code == 202, r.text


async def test_queue_bound_by_bytes_answers_429_naming_the_key(
    crush_server: CrushServer, crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    async with _busy_session(ws, scripted_model) as (sid, _gate), _http(crush_server) as http:
        url = f"/v1/workspaces/{ws.id}/agent"
        r = await http.post(url, json={"session_id": sid, "prompt": "é" * 400})  # 800 bytes
        assert r.status_code == 202, r.text
        r = await http.post(url, json={"session_id": sid, "prompt": "x" * 201})
        assert r.status_code == 429, r.text
        message = r.json()["message"]
        assert "server.max_queued_prompt_bytes" in message
        assert "1000" in message
        r = await http.post(url, json={"session_id": sid, "prompt": "x" * 200})
        assert r.status_code == 202, r.text
        listed = await http.get(f"/v1/workspaces/{ws.id}/agent/sessions/{sid}/prompts/list")
        assert len(listed.content) < 2000
        # Clearing the queue frees the bound.
        clear = f"/v1/workspaces/{ws.id}/agent/sessions/{sid}/prompts/clear"
        assert (await http.post(clear, json={})).status_code == 200
        r = await http.post(url, json={"session_id": sid, "prompt": "x" * 900})
        assert r.status_code == 202, r.text


# ---------------------------------------------------------------------------------------------
# Memory of finished runs


async def test_cancelled_queued_prompts_do_not_stay_in_memory(
    crush_server: CrushServer, crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    """Queued prompts cancelled leave no prompt text behind in the run book."""
    ws = crush_workspace
    workspace = crush_server.backend.get(ws.id)
    workspace.agent.max_queued_prompts = 100
    workspace.agent.max_queued_prompt_bytes = 64 * 1024 * 1024
    async with _busy_session(ws, scripted_model) as (sid, _gate):
        tracemalloc.start()
        try:
            base, _ = tracemalloc.get_traced_memory()
            for i in range(40):
                await workspace.agent.submit(sid, f"{i}" + "p" * 256 * 1024, f"big-{i}")
            queued, _ = tracemalloc.get_traced_memory()
            async with ws.subscribe(timeout=WAIT) as feed:
                await ws.cancel(sid)
                await feed.collect_until(completes_run("big-39"), WAIT)
            with trio.fail_after(WAIT):
                await workspace.runs.save_now()
            gc.collect()
            after, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert queued - base > 10 * 1024 * 1024  # the queue held the prompts
    assert after - base < 2 * 1024 * 1024, f"{(after - base) / 1e6:.1f} MB kept after cancel"
    assert workspace.runs.inserts_pending == 0


def test_finished_runs_kept_in_memory_are_bounded_by_bytes() -> None:
    from crush_trio.agent.runs import RunBook

    book = RunBook(store=None)  # type: ignore[arg-type]
    size = RECENT_RUNS_BYTES // 10
    for i in range(50):
        run = Run(f"r{i}", "s", RunStatus.COMPLETED, text="t" * size)
        book._runs[run.run_id] = run
        book._retire(run)
    kept = [i for i in range(50) if book.known(f"r{i}")]
    assert kept == list(range(40, 50))  # the newest ten fit in the byte bound
    assert len(kept) <= RECENT_RUNS_KEPT


# ---------------------------------------------------------------------------------------------
# Kill -9 loop


#: Kills of the loop test (each followed by a restart and the checks).
KILLS: Final = 20
#: Bound on the whole loop (seconds).
LOOP_TIMEOUT: Final = 180.0
#: Bound on a server start (seconds).
START_TIMEOUT: Final = 20.0
TOKEN: Final = "kill-test-token"
PHASES: Final = ("accept", "stream", "tool", "queue", "shutdown")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Proc:
    """The server as a child process on a fixed port and data directory."""

    def __init__(self, tmp: Path, port: int) -> None:
        self.tmp = tmp
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: trio.Process | None = None

    async def start(self, nursery: trio.Nursery) -> None:
        cmd = [
            sys.executable,
            "-m",
            "crush_trio",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(self.tmp / "data"),
            "--token",
            TOKEN,
            "--config",
            str(self.tmp / "crush.json"),
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CONFIG_HOME": str(self.tmp / "xdg")}
        self.proc = await nursery.start(
            functools.partial(
                trio.run_process,
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                check=False,
            )
        )
        # The server prints its listening line once it accepts connections.
        assert self.proc.stdout is not None
        out = self.proc.stdout
        seen = b""
        with trio.fail_after(START_TIMEOUT):
            while b"crush-trio listening on" not in seen:
                chunk = await out.receive_some()
                if not chunk:
                    raise AssertionError(f"the server exited while starting: {seen!r}")
                seen += chunk
        nursery.start_soon(_drain, out)

    async def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        with trio.fail_after(START_TIMEOUT):
            await self.proc.wait()

    async def terminate(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        with trio.fail_after(START_TIMEOUT):
            await self.proc.wait()


def _headers(port: int) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {TOKEN}",
        "Host": f"127.0.0.1:{port}",
        "Content-Type": "application/json",
    }


async def _post(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> httpx.Response:
    return await http.post(url, content=orjson.dumps(body))


async def _open_workspace(http: httpx.AsyncClient, project: Path) -> str:
    """Open the project (a restarted server recovers the killed run's leftovers here)."""
    r = await _post(http, "/v1/workspaces", {"path": str(project), "client_id": str(uuid.uuid4())})
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


async def _one_round(
    proc: _Proc, wid: str, phase: str, rng: random.Random, accepted: set[str]
) -> None:
    """Drive traffic of ``phase`` and kill the server at a random moment (the traffic goes on
    until the kill cuts it)."""
    async with httpx.AsyncClient(base_url=proc.url, headers=_headers(proc.port), timeout=5) as http:
        r = await _post(http, f"/v1/workspaces/{wid}/sessions", {"title": phase})
        assert r.status_code == 200, r.text
        sid = r.json()["id"]
        text = {"tool": "use the tool please"}.get(phase, f"{phase} prompt")

        # accept and queue: the kill follows a random 202 at once (the moment a run used to be
        # lost); the other phases: a random moment.
        right_after = phase in ("accept", "queue")
        kill_after = rng.randint(1, 30)
        kill_now = trio.Event()

        async def prompter(n: int) -> None:
            for _ in range(n):
                run_id = uuid.uuid4().hex
                try:
                    r = await _post(
                        http,
                        f"/v1/workspaces/{wid}/agent",
                        {"session_id": sid, "prompt": text, "run_id": run_id},
                    )
                except httpx.TransportError:
                    return  # killed
                if r.status_code == 202:
                    accepted.add(run_id)
                    if right_after and len(accepted) - before >= kill_after:
                        kill_now.set()

        before = len(accepted)
        async with trio.open_nursery() as nursery:
            for _ in range(3 if right_after else 1):
                nursery.start_soon(prompter, 20 if right_after else 2)
            if phase == "shutdown":
                await trio.sleep(rng.uniform(0.0, 0.15))  # a random moment
                nursery.start_soon(_post_quietly, http, "/v1/control", {"command": "shutdown"})
            with trio.move_on_after(WAIT if right_after else rng.uniform(0.05, 0.8)):
                await kill_now.wait()
            await proc.kill()
            nursery.cancel_scope.cancel()


async def _post_quietly(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
    try:
        await _post(http, url, body)
    except httpx.TransportError:
        pass


def _fake_reply(request: RecordedRequest) -> Reply:
    """A tool call for a prompt asking for one, else a text streamed over about 0.4 s."""
    last = request.body.get("messages", [{}])[-1]
    if last.get("role") == "user" and "use the tool" in str(last.get("content")):
        return Reply(tool_calls=[ToolCall("bash", orjson.dumps({"command": "sleep 0.3"}).decode())])
    return Reply(text=[f"t{i} " for i in range(40)], token_delay=0.01)


def _check_db(data_dir: Path, accepted: set[str]) -> None:
    dbs = list(data_dir.glob(f"*/{DB_FILENAME}"))
    assert len(dbs) == 1, dbs
    conn = sqlite3.connect(dbs[0])
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        rows = dict(conn.execute("SELECT run_id, status FROM runs").fetchall())
        missing = accepted - rows.keys()
        assert not missing, f"{len(missing)} runs answered 202 have no record"
        live = {r for r in accepted if rows[r] in ("queued", "running")}
        assert not live, f"{len(live)} accepted runs were not ended after the restart"
        unfinished = conn.execute(
            "SELECT count(*) FROM messages WHERE role = 'assistant' AND finished_at IS NULL"
        ).fetchone()[0]
        assert unfinished == 0
        # Every tool call has a result, so the history stays valid for any provider.
        history = conn.execute("SELECT session_id, role, parts FROM messages ORDER BY rowid")
        calls: collections.Counter[tuple[str, str]] = collections.Counter()
        results: collections.Counter[tuple[str, str]] = collections.Counter()
        for session_id, role, parts in history:
            for part in orjson.loads(parts):
                if part["type"] == "tool_call":
                    calls[session_id, part["data"]["id"]] += 1
                elif part["type"] == "tool_result" and role == "tool":
                    results[session_id, part["data"]["tool_call_id"]] += 1
        unanswered = calls - results
        assert not unanswered, f"tool calls without a result: {unanswered}"
    finally:
        conn.close()


@pytest.mark.slow
async def test_kill_9_loop_loses_no_accepted_run(tmp_path: Path) -> None:
    """Kill -9 at random moments of bursts of prompts, streams, tool calls, queues and
    shutdowns; after each restart every run answered 202 has a terminal record."""
    project = tmp_path / "project"
    project.mkdir()
    proc = _Proc(tmp_path, _free_port())
    rng = random.Random(int.from_bytes(os.urandom(4)))
    accepted: set[str] = set()
    fake = FakeLLM(default=_fake_reply, record=False)
    with trio.fail_after(LOOP_TIMEOUT):
        async with trio.open_nursery() as nursery:
            fake_url = await nursery.start(fake.serve)
            config = {
                "providers": {
                    "fake": {
                        "type": "openai-compat",
                        "base_url": f"{fake_url}/v1",
                        "api_key": "x",
                        "models": [{"id": "fake"}],
                    }
                },
                "models": {
                    "large": {"provider": "fake", "model": "fake"},
                    "small": {"provider": "fake", "model": "fake"},
                },
                "permissions": {"allowed_tools": ["bash"]},
                "server": {"shutdown_grace": 0.5},
            }
            (tmp_path / "crush.json").write_bytes(orjson.dumps(config))
            for kill in range(KILLS):
                await proc.start(nursery)
                async with httpx.AsyncClient(
                    base_url=proc.url, headers=_headers(proc.port), timeout=5
                ) as http:
                    wid = await _open_workspace(http, project)
                if kill:
                    _check_db(tmp_path / "data", accepted)
                await _one_round(proc, wid, PHASES[kill % len(PHASES)], rng, accepted)
            await proc.start(nursery)
            async with httpx.AsyncClient(
                base_url=proc.url, headers=_headers(proc.port), timeout=5
            ) as http:
                await _open_workspace(http, project)
            _check_db(tmp_path / "data", accepted)
            await proc.terminate()
            nursery.cancel_scope.cancel()
    assert len(accepted) > KILLS


async def test_a_version_1_database_gets_the_prompt_column(tmp_path: Path) -> None:
    conn = sqlite3.connect(tmp_path / DB_FILENAME)
    conn.executescript(f"BEGIN;\n{MIGRATIONS[0]}\nPRAGMA user_version = 1;\nCOMMIT;")
    conn.execute(
        "INSERT INTO runs (run_id, session_id, status, created_at) VALUES ('old', 's', 'running', 1)"
    )
    conn.commit()
    conn.close()
    store = await Store.open(tmp_path)
    try:
        assert await store.get_run_prompt("old") == ""
        await store.save_runs([Run("new", "s", RunStatus.QUEUED)], {"new": "the prompt"})
        # An update never touches the prompt.
        await store.save_runs([Run("new", "s", RunStatus.CANCELLED)], {"new": "other"})
        assert await store.get_run_prompt("new") == "the prompt"
        assert [r.run_id for r in await store.list_runs({RunStatus.RUNNING})] == ["old"]
    finally:
        await store.aclose()


async def _drain(stream: trio.abc.ReceiveStream) -> None:
    """Read a server's stdout to its end, so that its pipe never fills."""
    while await stream.receive_some():
        pass
