"""Streamed ``bash`` output and background jobs at the tool level: ``tool_output`` pieces while a
command runs, ``bash`` with ``background``, ``job_output``, ``job_kill``, the jobs' bounds, and
that no process of a job outlives a kill, the manager's close or a cancel at each phase.

Rules as in tests/test_tools.py: every wait is bounded by ``trio.fail_after``; subprocess tests
run on the real clock; commands report their pids through files written before the test looks
(the test waits for the job's output, written after them), and a process's end is awaited with
a pidfd (:func:`tests.test_tools.wait_process_gone`).
"""

from __future__ import annotations

import itertools
import os
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest
import trio

from crush_trio.config import JobsOptions
from crush_trio.tools import (
    JobManager,
    OutputStreamer,
    ToolContext,
    ToolResult,
    call_tool,
    default_tools,
)
from crush_trio.tools import jobs as jobs_module
from crush_trio.tools.stream import TOOL_OUTPUT_INTERVAL, TOOL_OUTPUT_MAX_BYTES
from crush_trio.wire import JobState, ToolOutput

from .test_tools import FakeAsker, process_alive, wait_process_gone

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

pytestmark = pytest.mark.slow

WAIT = 15.0


@asynccontextmanager
async def job_manager(
    published: list[ToolOutput] | None = None, **options: Any
) -> AsyncIterator[JobManager]:
    """A running :class:`JobManager` (its jobs end when the block exits)."""
    sink = published if published is not None else []
    manager = JobManager(publish=sink.append, options=JobsOptions(**options))
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        try:
            yield manager
        finally:
            nursery.cancel_scope.cancel()


def make_ctx(ws: Path, asker: FakeAsker, **more: Any) -> ToolContext:
    (ws / ".crush").mkdir(parents=True, exist_ok=True)
    return ToolContext(
        workspace=ws,
        data_dir=ws / ".crush",
        session_id="s1",
        tool_call_id="c1",
        permissions=asker,
        timeout=10.0,
        bash_output_limit=30_000,
        run_id="r1",
        **more,
    )


async def call(ctx: ToolContext, name: str, **params: Any) -> ToolResult:
    import orjson

    with trio.fail_after(WAIT):
        return await call_tool(default_tools(), name, orjson.dumps(params).decode(), ctx)


async def wait_output(
    manager: JobManager, job_id: str, needle: bytes, session_id: str = "s1"
) -> None:
    """Wait (event-driven, bounded) until the job's unread output holds ``needle``."""
    job = manager.get(job_id, session_id)
    with trio.fail_after(WAIT):
        while needle not in job.unread:
            if job.state is not JobState.RUNNING:
                raise AssertionError(f"job ended without {needle!r}: {bytes(job.unread)!r}")
            changed = job.changed
            await changed.wait()
            if needle not in job.unread:
                job.changed = trio.Event()  # the test's own wait: a fresh event for the next


def pids(ws: Path, *names: str) -> list[int]:
    return [int((ws / name).read_text().split()[0]) for name in names]


# -- streamed output ------------------------------------------------------------------------


async def test_bash_output_streams_while_the_command_runs(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    fifo = ws / "gate"
    os.mkfifo(fifo)
    published: list[ToolOutput] = []
    first = trio.Event()

    def publish(piece: ToolOutput) -> None:
        published.append(piece)
        if "line1" in piece.text:
            first.set()

    ctx = make_ctx(ws, FakeAsker(), publish=publish)
    results: list[ToolResult] = []
    gate = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # the command blocks until "go" arrives
    try:
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                results.append(
                    await call(ctx, "bash", command="echo line1; read x < gate; echo line2")
                )

            nursery.start_soon(run)
            with trio.fail_after(WAIT):
                await first.wait()
            assert results == []  # seen by clients before the command ended
            os.write(gate, b"go\n")
    finally:
        os.close(gate)
    (result,) = results
    assert result.content == "line1\nline2\nexit code: 0"
    streamed = "".join(p.text for p in published)
    assert streamed == "line1\nline2\n"
    assert all(
        (p.session_id, p.tool_call_id, p.run_id, p.job_id) == ("s1", "c1", "r1", None)
        for p in published
    )
    # Offsets are byte positions: each piece starts where the previous one (and its drop) ended.
    position = 0
    for piece in published:
        assert piece.offset == position
        position += len(piece.text.encode()) + piece.dropped


def test_the_streamer_holds_and_publishes_a_bounded_amount_of_a_flood() -> None:
    published: list[ToolOutput] = []
    streamer = OutputStreamer(published.append, session_id="s", tool_call_id="c")
    chunk = b"x" * 65536
    for _ in range(1600):  # 100 MiB within one interval
        streamer.feed(chunk)
        assert streamer.pending_bytes <= TOOL_OUTPUT_MAX_BYTES
    streamer.close()
    (piece,) = published
    assert len(piece.text) == TOOL_OUTPUT_MAX_BYTES
    assert piece.offset == 0
    assert piece.dropped == 1600 * 65536 - TOOL_OUTPUT_MAX_BYTES
    assert streamer.total == 1600 * 65536


async def test_the_streamer_publishes_at_most_once_per_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    published: list[tuple[float, ToolOutput]] = []
    streamer = OutputStreamer(
        lambda p: published.append((trio.current_time(), p)), session_id="s", tool_call_id="c"
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(streamer.run)
        for i in range(100):
            streamer.feed(f"{i}\n".encode())
            await trio.sleep(0.01)  # virtual time (autojump_clock)
        nursery.cancel_scope.cancel()
    streamer.close()
    times = [t for t, _ in published]
    assert all(b - a >= TOOL_OUTPUT_INTERVAL - 1e-9 for a, b in itertools.pairwise(times))
    assert len(published) <= 100 * 0.01 / TOOL_OUTPUT_INTERVAL + 2
    text = "".join(p.text for _, p in published)
    assert text == "".join(f"{i}\n" for i in range(100))  # nothing dropped at this rate


async def test_cancel_while_output_streams_ends_the_command_and_its_children(
    tmp_path: Path,
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    ticking = trio.Event()

    def publish(piece: ToolOutput) -> None:
        if "tick" in piece.text:
            ticking.set()

    ctx = make_ctx(ws, FakeAsker(), publish=publish)
    command = "echo $$ > shell.pid; sleep 300 & echo $! > child.pid; while true; do echo tick; sleep 0.05; done"
    returned: list[ToolResult] = []
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                returned.append(
                    await call_tool(default_tools(), "bash", _json(command=command), ctx)
                )

            nursery.start_soon(run)
            await ticking.wait()
            nursery.cancel_scope.cancel()
    assert returned == []
    for pid in pids(ws, "shell.pid", "child.pid"):
        await wait_process_gone(pid)


def _json(**params: Any) -> str:
    import orjson

    return orjson.dumps(params).decode()


# -- background jobs ------------------------------------------------------------------------

JOB = "echo $$ > shell.pid; sleep 300 & echo $! > child.pid; echo started; wait"


async def test_a_job_outlives_its_call_job_output_reads_it_and_job_kill_ends_its_tree(
    tmp_path: Path,
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    published: list[ToolOutput] = []
    async with job_manager(published) as manager:
        ctx = make_ctx(ws, FakeAsker(), jobs=manager, publish=published.append)
        result = await call(ctx, "bash", command=JOB, background=True)
        assert not result.is_error
        assert "started background job job-1" in result.content
        await wait_output(manager, "job-1", b"started")
        shell_pid, child_pid = pids(ws, "shell.pid", "child.pid")
        assert process_alive(shell_pid)
        assert process_alive(child_pid)  # the call returned

        read = await call(ctx, "job_output", job_id="job-1")
        assert read.content == "started\njob job-1 is still running"
        again = await call(ctx, "job_output", job_id="job-1")
        assert again.content == "(no new output)\njob job-1 is still running"
        (info,) = manager.info()
        assert (info.id, info.state, info.run_id, info.session_id) == (
            "job-1",
            JobState.RUNNING,
            "r1",
            "s1",
        )
        assert info.output_bytes == len("started\n")
        assert info.unread_bytes == 0

        killed = await call(ctx, "job_kill", job_id="job-1")
        assert killed.content == "killed job job-1"
        await wait_process_gone(shell_pid)
        await wait_process_gone(child_pid)
        assert manager.info()[0].state is JobState.KILLED
        after = await call(ctx, "job_output", job_id="job-1")
        assert after.content == "(no new output)\njob job-1 was killed"
    # Streamed with the job's id, ending with a last piece marked done.
    assert {p.job_id for p in published} == {"job-1"}
    assert "".join(p.text for p in published) == "started\n"
    assert published[-1].done
    assert published[-1].exit_code is None


async def test_closing_the_manager_ends_every_job_tree(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    async with job_manager() as manager:
        ctx = make_ctx(ws, FakeAsker(), jobs=manager)
        await call(ctx, "bash", command=JOB, background=True)
        await wait_output(manager, "job-1", b"started")
        shell_pid, child_pid = pids(ws, "shell.pid", "child.pid")
    assert manager.closed
    assert manager.info()[0].state is JobState.KILLED
    assert not process_alive(shell_pid)
    assert not process_alive(child_pid)


async def test_job_output_waits_for_the_end_and_reports_the_exit_code(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    async with job_manager() as manager:
        ctx = make_ctx(ws, FakeAsker(), jobs=manager)
        await call(ctx, "bash", command="echo one; echo two; exit 3", background=True)
        result = await call(ctx, "job_output", job_id="job-1", wait=10)
        assert result.content == "one\ntwo\njob job-1 exited with code 3"


async def test_unread_output_is_bounded_and_the_drop_is_reported(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    async with job_manager(buffer_bytes=100) as manager:
        ctx = make_ctx(ws, FakeAsker(), jobs=manager)
        await call(ctx, "bash", command="head -c 1000 /dev/zero | tr '\\0' x", background=True)
        result = await call(ctx, "job_output", job_id="job-1", wait=10)
    lines = result.content.split("\n")
    assert lines[0].startswith("[900 earlier bytes of output were dropped")
    assert lines[1] == "x" * 100
    assert lines[2] == "job job-1 exited with code 0"


async def test_the_number_of_jobs_is_bounded(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    async with job_manager(max_jobs=2) as manager:
        ctx = make_ctx(ws, FakeAsker(), jobs=manager)
        for _ in range(2):
            assert not (await call(ctx, "bash", command="sleep 300", background=True)).is_error
        refused = await call(ctx, "bash", command="sleep 300", background=True)
        assert refused.is_error
        assert "options.jobs.max_jobs" in refused.content
        assert len(manager.info()) == 2
        await call(ctx, "job_kill", job_id="job-1")
        # An ended job makes room (it is evicted, oldest first).
        third = await call(ctx, "bash", command="sleep 300", background=True)
        assert "job-3" in third.content
        assert [j.id for j in manager.info()] == ["job-2", "job-3"]


async def test_jobs_of_other_sessions_are_not_reachable(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    async with job_manager() as manager:
        ctx = make_ctx(ws, FakeAsker(), jobs=manager)
        await call(ctx, "bash", command="sleep 300", background=True)
        other = make_ctx(ws, FakeAsker(), jobs=manager)
        other.session_id = "s2"
        result = await call(other, "job_kill", job_id="job-1")
        assert result.is_error
        assert "no background job 'job-1'" in result.content
        assert manager.info()[0].state is JobState.RUNNING


async def test_a_background_command_asks_like_a_foreground_one_and_a_denial_starts_nothing(
    tmp_path: Path,
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    asker = FakeAsker(allow=False)
    async with job_manager() as manager:
        ctx = make_ctx(ws, asker, jobs=manager)
        result = await call(ctx, "bash", command="touch made", background=True)
        assert result.is_error
        assert result.stop_turn
        (request,) = asker.requests
        assert request["params"]["background"] is True
        assert request["description"].startswith("Start a background job")
        assert manager.info() == []
    assert not (ws / "made").exists()


async def test_cancel_while_asking_for_a_job_starts_nothing(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    asker = FakeAsker(block=True)
    async with job_manager() as manager:
        ctx = make_ctx(ws, asker, jobs=manager)
        with trio.move_on_after(WAIT) as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    call_tool,
                    default_tools(),
                    "bash",
                    _json(command="touch made", background=True),
                    ctx,
                )
                await asker.asked.wait()
                nursery.cancel_scope.cancel()
        assert not scope.cancelled_caught
        assert manager.info() == []
    assert not (ws / "made").exists()


async def test_cancel_while_a_job_starts_leaves_no_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    starting = trio.Event()
    real_start = jobs_module.start_shell

    async def slow_start(*args: Any, **kwargs: Any) -> Any:
        starting.set()
        await trio.sleep_forever()
        return await real_start(*args, **kwargs)  # pragma: no cover

    monkeypatch.setattr(jobs_module, "start_shell", slow_start)
    async with job_manager() as manager:
        ctx = make_ctx(ws, FakeAsker(), jobs=manager)
        returned: list[ToolResult] = []
        with trio.fail_after(WAIT):
            async with trio.open_nursery() as nursery:

                async def run() -> None:
                    returned.append(
                        await call_tool(
                            default_tools(),
                            "bash",
                            _json(command="touch made", background=True),
                            ctx,
                        )
                    )

                nursery.start_soon(run)
                await starting.wait()
                nursery.cancel_scope.cancel()
        assert returned == []
        assert manager.info() == []
        # The manager still starts jobs afterwards.
        monkeypatch.setattr(jobs_module, "start_shell", real_start)
        await call(ctx, "bash", command="echo later", background=True)
        assert (await call(ctx, "job_output", job_id="job-2", wait=10)).content.startswith("later")
    assert not (ws / "made").exists()


@pytest.mark.parametrize("kill_on_cancel", [True, False])
async def test_cancel_of_the_run_kills_its_jobs_only_when_configured(
    tmp_path: Path, kill_on_cancel: bool
) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    async with job_manager(kill_on_cancel=kill_on_cancel) as manager:
        ctx = make_ctx(ws, FakeAsker(), jobs=manager)
        await call(ctx, "bash", command=JOB, background=True)
        await wait_output(manager, "job-1", b"started")
        shell_pid, child_pid = pids(ws, "shell.pid", "child.pid")
        assert manager.cancel_runs(["other-run"]) == []
        stopped = manager.cancel_runs(["r1"])
        if kill_on_cancel:
            assert [j.id for j in stopped] == ["job-1"]
            await wait_process_gone(shell_pid)
            await wait_process_gone(child_pid)
            with trio.fail_after(WAIT):
                await manager.get("job-1", "s1").ended.wait()
            assert manager.info()[0].state is JobState.KILLED
        else:
            assert stopped == []
            assert process_alive(shell_pid)
            assert process_alive(child_pid)
    assert not process_alive(shell_pid)
    assert not process_alive(child_pid)


def test_polling_a_job_is_not_a_repeated_call_loop() -> None:
    from crush_trio.agent.tool_step import REPEATED_TOOL_CALL_LIMIT, RepeatedCalls
    from crush_trio.errors import ProviderError
    from crush_trio.wire import ToolCallPart

    poll = [ToolCallPart("c", "job_output", '{"job_id": "job-1", "wait": 30}')]
    repeated = RepeatedCalls()
    for _ in range(REPEATED_TOOL_CALL_LIMIT * 2):
        repeated.check(poll)
    same = [ToolCallPart("c", "bash", '{"command": "ls"}')]
    # The last of the calls raises; the loop stays inside (an earlier one must not).
    with pytest.raises(ProviderError, match="repeated the same tool call"):  # noqa: PT012
        for _ in range(REPEATED_TOOL_CALL_LIMIT):
            repeated.check(same)
