"""Streamed command output and background jobs through the real server: ``tool_output`` events
reach a client while ``bash`` runs, a 100 MB flood keeps the server's memory bounded and health
fast, jobs are listed in ``GET .../agent``, and a workspace's close and a run's cancel (when
configured) end a job's whole process tree.

Commands are held at a chosen point by a FIFO in the workspace (the test writes to it), never by
sleeping; pids are checked with pidfds (:func:`tests.test_tools.wait_process_gone`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import trio

from crush_trio.client import Event, RunStatus, WorkspaceClient
from crush_trio.providers.scripted import Gate, ScriptedModel, Step
from crush_trio.tools.stream import TOOL_OUTPUT_INTERVAL, TOOL_OUTPUT_MAX_BYTES
from crush_trio.wire import JobState, ToolOutput, ToolResultPart

from .conftest import WAIT
from .test_jobs import wait_output
from .test_tools import process_alive, wait_process_gone

if TYPE_CHECKING:
    from crush_trio.testing import CrushServer

pytestmark = pytest.mark.slow

#: Without the sandbox, pids the commands write are the server's view of them (no PID
#: namespace), so the test can check them.
NO_SANDBOX = {"sandbox": {"enabled": False}}


@pytest.fixture
def crush_config() -> dict[str, Any]:
    return {"permissions": {"allowed_tools": ["bash"]}, "options": NO_SANDBOX}


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def tool_outputs(events: list[Event]) -> list[ToolOutput]:
    return [e.payload for e in events if e.type == "tool_output"]


async def test_a_client_sees_lines_before_the_command_ends(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    fifo = Path(ws.path) / "gate"
    os.mkfifo(fifo)
    command = "for i in 1 2 3; do echo line$i; sleep 0.1; done; read x < gate; echo end"
    scripted_model.add(Step(tool_calls=[("bash", {"command": command})]), Step("done"))
    sid = (await ws.create_session()).id
    gate = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        async with ws.subscribe(timeout=WAIT) as feed:
            handle = await ws.prompt(sid, "run it", run_id="s1")
            seen: list[Event] = []
            with trio.fail_after(WAIT):
                while "line3" not in "".join(p.text for p in tool_outputs(seen)):
                    seen.append(await feed.until(lambda e: e.type == "tool_output", WAIT))
            # Three lines arrived, a tenth of a second apart, while the command still runs.
            assert (await ws.get_run("s1")).status is RunStatus.RUNNING
            pieces = tool_outputs(seen)
            assert len(pieces) >= 2  # streamed as it came, not in one piece at the end
            assert {(p.session_id, p.run_id) for p in pieces} == {(sid, "s1")}
            os.write(gate, b"go\n")
            run = await handle.result(WAIT)
    finally:
        os.close(gate)
    assert run.status is RunStatus.COMPLETED
    assert run.text == "done"
    # The model (and a client that missed pieces) reads the whole output in the tool result.
    (result,) = [
        p for m in await ws.messages(sid) for p in m.parts if isinstance(p, ToolResultPart)
    ]
    assert result.content == "line1\nline2\nline3\nend\nexit code: 0"
    assert {p.tool_call_id for p in pieces} == {result.tool_call_id}


async def test_a_flood_of_output_keeps_memory_bounded_and_health_fast(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
) -> None:
    ws = crush_workspace
    size = 100_000_000
    command = f"head -c {size} /dev/zero | tr '\\0' x; echo; echo END"
    scripted_model.add(Step(tool_calls=[("bash", {"command": command})]), Step("done"))
    sid = (await ws.create_session()).id
    before = rss_bytes()
    peak = before
    latencies: list[float] = []
    pieces: list[ToolOutput] = []
    async with (
        httpx.AsyncClient(base_url=crush_server.url, timeout=WAIT) as http,
        ws.subscribe(timeout=WAIT) as feed,
    ):
        started = time.monotonic()
        handle = await ws.prompt(sid, "flood", run_id="f1")
        first = await feed.until(lambda e: e.type == "tool_output", WAIT)
        pieces.append(first.payload)
        with trio.fail_after(120):
            while not handle.done:
                t0 = time.monotonic()
                answer = await http.get("/v1/health")
                latencies.append(time.monotonic() - t0)
                assert answer.status_code == 200
                peak = max(peak, rss_bytes())
        elapsed = time.monotonic() - started
        events = await feed.collect_until(lambda e: e.type == "run_complete", WAIT)
        pieces += tool_outputs(events)
    run = await handle.result(WAIT)
    assert run.status is RunStatus.COMPLETED
    assert latencies
    assert max(latencies) < 1.0, f"health answered in up to {max(latencies):.3f} s"
    # Nothing holds the flood: the process grew by far less than the 100 MB it passed on.
    assert peak - before < 40_000_000, f"RSS grew by {(peak - before) / 1e6:.1f} MB"
    # The stream is bounded in rate and bytes: at most one piece per interval, each bounded.
    assert all(len(p.text.encode()) <= TOOL_OUTPUT_MAX_BYTES for p in pieces)
    assert len(pieces) <= elapsed / TOOL_OUTPUT_INTERVAL + 2
    assert sum(p.dropped for p in pieces) > 0
    # The model gets the output cut at the documented bound, with its end.
    (result,) = [
        p for m in await ws.messages(sid) for p in m.parts if isinstance(p, ToolResultPart)
    ]
    assert len(result.content) < 30_000 + 200
    assert "bytes of output cut from the middle" in result.content
    assert result.content.endswith("END\nexit code: 0")


JOB = "echo $$ > shell.pid; sleep 300 & echo $! > child.pid; echo started; wait"


async def test_jobs_are_listed_and_the_workspace_close_ends_their_tree(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
) -> None:
    ws = crush_workspace
    scripted_model.add(
        Step(tool_calls=[("bash", {"command": JOB, "background": True})]),
        Step(tool_calls=[("job_output", {"job_id": "job-1", "wait": 0})]),
        Step("left it running"),
    )
    sid = (await ws.create_session()).id
    async with ws.subscribe(timeout=WAIT) as feed:
        handle = await ws.prompt(sid, "start it", run_id="j1")
        piece = await feed.until(
            lambda e: e.type == "tool_output" and "started" in e.payload.text, WAIT
        )
        run = await handle.result(WAIT)
    assert run.status is RunStatus.COMPLETED
    assert piece.payload.job_id == "job-1"
    assert piece.payload.session_id == sid
    results = [p for m in await ws.messages(sid) for p in m.parts if isinstance(p, ToolResultPart)]
    assert "started background job job-1" in results[0].content
    shell_pid, child_pid = (
        int((Path(ws.path) / name).read_text()) for name in ("shell.pid", "child.pid")
    )
    # The job outlived its call and the run.
    assert process_alive(shell_pid)
    assert process_alive(child_pid)
    (job,) = (await ws.agent_info()).jobs
    assert (job.id, job.state, job.session_id, job.run_id) == ("job-1", JobState.RUNNING, sid, "j1")
    assert job.command == JOB

    workspace = crush_server.backend.get(ws.id)
    workspace.request_shutdown()
    with trio.fail_after(WAIT):
        await workspace.closed.wait()
    await wait_process_gone(shell_pid)
    await wait_process_gone(child_pid)


@pytest.mark.parametrize(
    "crush_config",
    [
        {
            "permissions": {"allowed_tools": ["bash"]},
            "options": {**NO_SANDBOX, "jobs": {"kill_on_cancel": kill}},
        }
        for kill in (True, False)
    ],
    ids=["kill_on_cancel", "keep_on_cancel"],
)
async def test_cancelling_the_run_ends_its_jobs_when_configured(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel, crush_config: dict[str, Any]
) -> None:
    ws = crush_workspace
    kill_on_cancel = crush_config["options"]["jobs"]["kill_on_cancel"]
    gate = Gate()
    scripted_model.add(
        Step(tool_calls=[("bash", {"command": JOB, "background": True})]),
        Step("waiting", gate_before=gate),
    )
    sid = (await ws.create_session()).id
    async with ws.subscribe(timeout=WAIT) as feed:
        handle = await ws.prompt(sid, "start and wait", run_id="k1")
        # "started" is written after the pid files.
        await feed.until(lambda e: e.type == "tool_output" and "started" in e.payload.text, WAIT)
    with trio.fail_after(WAIT):
        await gate.reached.wait()
    project = Path(ws.path)
    shell_pid, child_pid = (
        int((project / name).read_text()) for name in ("shell.pid", "child.pid")
    )
    assert process_alive(shell_pid)
    assert process_alive(child_pid)
    assert await ws.cancel_run("k1")
    run = await handle.result(WAIT)
    assert run.status is RunStatus.CANCELLED
    gate.release()
    if kill_on_cancel:
        await wait_process_gone(shell_pid)
        await wait_process_gone(child_pid)
    else:
        assert process_alive(shell_pid)
        assert process_alive(child_pid)
        assert (await ws.agent_info()).jobs[0].state is JobState.RUNNING


async def test_server_shutdown_ends_every_job_tree(tmp_path: Path) -> None:
    import orjson

    from .conftest import running_server

    model = ScriptedModel(
        [Step(tool_calls=[("bash", {"command": JOB, "background": True})]), Step("started")]
    )
    config = tmp_path / "crush.json"
    config.write_bytes(
        orjson.dumps({"permissions": {"allowed_tools": ["bash"]}, "options": NO_SANDBOX})
    )
    project = tmp_path / "project"
    project.mkdir()
    with trio.fail_after(3 * WAIT):
        async with running_server(tmp_path, config_file=config, provider_factory=model) as srv:
            wid = (await srv.open_workspace(project))["id"]
            sid = (await srv.create_session(wid))["id"]
            async with srv.websocket(wid) as socket:
                await srv.prompt(wid, sid, "start it", run_id="x1")
                await socket.run_complete("x1")
            (job,) = (await srv.http.get(f"/v1/workspaces/{wid}/agent")).json()["jobs"]
            assert job["state"] == "running"
            # The job writes its pids before its first output.
            workspace = srv.backend.get(wid)
            await wait_output(workspace.jobs, "job-1", b"started", sid)
            shell_pid, child_pid = (
                int((project / name).read_text()) for name in ("shell.pid", "child.pid")
            )
            assert process_alive(shell_pid)
            assert process_alive(child_pid)
        # running_server stopped the server: every workspace closed, every job tree ended.
        assert workspace.closed.is_set()
    assert not process_alive(shell_pid)
    assert not process_alive(child_pid)
