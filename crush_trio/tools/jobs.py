"""Background jobs: ``bash`` commands that run on after their call (``background: true``).

A job is a ``bash -c COMMAND`` started exactly as a foreground ``bash`` call is (same
permission rule, same sandbox, its own process group), but its task lives in the workspace's
:class:`JobManager` nursery, never in the tool call or a request handler, so the call returns at
once with the job's id. The model reads the job's new output with ``job_output`` and ends it with
``job_kill``; clients see its output live as ``tool_output`` events (with ``job_id``) and the
jobs in ``GET .../agent`` (field ``jobs``).

Bounds (``options.jobs``): at most ``max_jobs`` jobs at once (an ended job is evicted, oldest
first, to make room; a new job is refused when every one still runs), and at most
``buffer_bytes`` of unread output per job (older unread bytes are dropped and counted).

Every job's whole process group is ended (SIGTERM, then SIGKILL after
:data:`~crush_trio.tools.shell.KILL_GRACE`) when it is killed, when the workspace closes or the
server shuts down (the manager's nursery is cancelled), and, with ``options.jobs.kill_on_cancel``,
when the run that started it is cancelled. In the sandbox, ``bwrap --die-with-parent`` ends the
jobs if the server itself dies.
"""

from __future__ import annotations

import collections
import itertools
import logging
from functools import partial
from typing import TYPE_CHECKING, Final

import attrs
import trio

from ..config import JobsOptions
from ..defaults import DEFAULT_JOB_BUFFER_BYTES
from ..wire import JobInfo, JobState, ToolOutput, now
from .result import ToolError
from .shell import (
    CLEANUP_MARGIN,
    KILL_GRACE,
    OUTPUT_DRAIN_TIMEOUT,
    end_group,
    start_shell,
)
from .stream import OutputStreamer

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from pathlib import Path

    from .sandbox import Sandbox

__all__ = ["JOB_OUTPUT_MAX_WAIT", "Job", "JobManager"]

log = logging.getLogger(__name__)

#: Longest ``wait`` of one ``job_output`` call (seconds); the tool timeout bounds it too.
JOB_OUTPUT_MAX_WAIT: Final = 60.0


@attrs.define(eq=False)
class Job:
    """One background job and its unread output."""

    id: str
    command: str
    session_id: str
    run_id: str | None
    tool_call_id: str
    buffer_bytes: int
    state: JobState = JobState.RUNNING
    exit_code: int | None = None
    pgid: int | None = None
    started_at: int = attrs.field(factory=now)
    #: Bytes the job wrote in all.
    total: int = 0
    #: Unread output (at most ``buffer_bytes``).
    unread: bytearray = attrs.field(factory=bytearray)
    #: Unread bytes dropped because the buffer was full, since the last read.
    unread_dropped: int = 0
    ended: trio.Event = attrs.field(factory=trio.Event)
    #: Set when output arrives or the job ends; replaced after each read.
    changed: trio.Event = attrs.field(factory=trio.Event)
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)

    def add(self, chunk: bytes | bytearray) -> None:
        self.total += len(chunk)
        self.unread += chunk
        over = len(self.unread) - self.buffer_bytes
        if over > 0:
            del self.unread[:over]
            self.unread_dropped += over
        self.changed.set()

    def take(self) -> tuple[bytes, int]:
        """The unread output and how many unread bytes were dropped before it; both reset."""
        data, dropped = bytes(self.unread), self.unread_dropped
        self.unread.clear()
        self.unread_dropped = 0
        self.changed = trio.Event()
        return data, dropped

    def info(self) -> JobInfo:
        return JobInfo(
            id=self.id,
            command=self.command,
            session_id=self.session_id,
            run_id=self.run_id,
            tool_call_id=self.tool_call_id,
            state=self.state,
            exit_code=self.exit_code,
            started_at=self.started_at,
            output_bytes=self.total,
            unread_bytes=len(self.unread),
        )


class JobManager:
    """The background jobs of one workspace, in a nursery of their own.

    Run :meth:`run` with ``nursery.start`` in the workspace's background nursery; cancelling it
    (workspace close, server shutdown) ends every job's process group before it returns.

    Args:
        publish: the broker's lossy publish, for ``tool_output`` events (None: not streamed).
        options: ``options.jobs`` (:meth:`configure` changes them later).
    """

    def __init__(
        self,
        *,
        publish: Callable[[ToolOutput], object] | None = None,
        options: JobsOptions | None = None,
    ) -> None:
        self.publish = publish
        self.options = options or JobsOptions()
        self._jobs: collections.OrderedDict[str, Job] = collections.OrderedDict()
        self._ids = itertools.count(1)
        self._nursery: trio.Nursery | None = None
        self.closed = False

    def configure(self, options: JobsOptions) -> None:
        """Use ``options`` for jobs started from now on (and for later cancels)."""
        self.options = options

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the jobs' nursery until cancelled; every job is ended before this returns."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self.closed = True

    def get(self, job_id: str, session_id: str) -> Job:
        """The job ``job_id`` of ``session_id``.

        Raises:
            ToolError: there is no such job in this session; the message lists those there are.
        """
        job = self._jobs.get(job_id)
        if job is None or job.session_id != session_id:
            ids = [j.id for j in self._jobs.values() if j.session_id == session_id]
            known = ", ".join(ids) if ids else "none"
            raise ToolError(
                f"no background job {job_id!r} in this session (its jobs: {known}); start one "
                "with bash and background=true"
            )
        return job

    def info(self) -> list[JobInfo]:
        """Every job kept, oldest first."""
        return [job.info() for job in self._jobs.values()]

    def running(self) -> list[Job]:
        return [job for job in self._jobs.values() if job.state is JobState.RUNNING]

    def _make_room(self) -> None:
        limit = self.options.max_jobs
        while len(self._jobs) >= limit:
            ended = next((j for j in self._jobs.values() if j.state is not JobState.RUNNING), None)
            if ended is None:
                raise ToolError(
                    f"{len(self._jobs)} background jobs are running, the limit "
                    f"(options.jobs.max_jobs) is {limit}; end one with job_kill or wait for one "
                    "to finish (job_output with wait), then start this one"
                )
            del self._jobs[ended.id]

    async def start(
        self,
        command: str,
        *,
        cwd: Path,
        session_id: str,
        run_id: str | None,
        tool_call_id: str,
        sandbox: Sandbox | None,
        data_dir: Path | None,
        writable: bool,
        network: bool | None,
        prompt_free: bool = False,
    ) -> Job:
        """Start ``command`` as a background job; return once its process runs.

        Raises:
            ToolError: the workspace is closing, or :attr:`options` ``max_jobs`` jobs run.

        Cancellation:
            A cancel before the process started ends it (with its group) and propagates.
        """
        if self._nursery is None:
            raise ToolError("background jobs are not available: the workspace is closing")
        self._make_room()
        job = Job(
            id=f"job-{next(self._ids)}",
            command=command,
            session_id=session_id,
            run_id=run_id,
            tool_call_id=tool_call_id,
            buffer_bytes=max(self.options.buffer_bytes or DEFAULT_JOB_BUFFER_BYTES, 1),
        )
        self._jobs[job.id] = job
        try:
            started: Job = await self._nursery.start(
                partial(
                    self._run_job,
                    job,
                    cwd=cwd,
                    sandbox=sandbox,
                    data_dir=data_dir,
                    writable=writable,
                    network=network,
                    prompt_free=prompt_free,
                )
            )
        except BaseException:
            self._jobs.pop(job.id, None)
            raise
        return started

    async def _run_job(
        self,
        job: Job,
        *,
        cwd: Path,
        sandbox: Sandbox | None,
        data_dir: Path | None,
        writable: bool,
        network: bool | None,
        prompt_free: bool = False,
        task_status: trio.TaskStatus[Job] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        streamer = (
            OutputStreamer(
                self.publish,
                session_id=job.session_id,
                tool_call_id=job.tool_call_id,
                run_id=job.run_id,
                job_id=job.id,
            )
            if self.publish is not None
            else None
        )
        killed = False
        try:
            with job.scope:
                async with trio.open_nursery() as nursery:
                    process = await start_shell(
                        nursery,
                        job.command,
                        cwd=cwd,
                        sandbox=sandbox,
                        data_dir=data_dir,
                        writable=writable,
                        network=network,
                        prompt_free=prompt_free,
                    )
                    job.pgid = process.pid
                    assert process.stdout is not None
                    task_status.started(job)
                    drained = trio.Event()
                    nursery.start_soon(self._collect, process.stdout, job, streamer, drained)
                    if streamer is not None:
                        nursery.start_soon(streamer.run)
                    job.exit_code = await process.wait()
                    # Processes the job left in its group end with it, as for a bash call.
                    await end_group(process.pid)
                    with trio.move_on_after(OUTPUT_DRAIN_TIMEOUT):
                        await drained.wait()
                    nursery.cancel_scope.cancel()
            killed = job.scope.cancelled_caught
        finally:
            if job.pgid is not None:
                with trio.move_on_after(KILL_GRACE + CLEANUP_MARGIN, shield=True):
                    await end_group(job.pgid)
            if killed or job.exit_code is None:
                job.state = JobState.KILLED
            else:
                job.state = JobState.EXITED
            if streamer is not None:
                streamer.close(exit_code=job.exit_code)
            job.ended.set()
            job.changed.set()

    @staticmethod
    async def _collect(
        stream: trio.abc.ReceiveStream,
        job: Job,
        streamer: OutputStreamer | None,
        drained: trio.Event,
    ) -> None:
        async with stream:
            async for chunk in stream:
                job.add(chunk)
                if streamer is not None:
                    streamer.feed(chunk)
        drained.set()

    async def kill(self, job: Job) -> None:
        """End ``job``'s whole process group and wait until it ended (bounded by the kill
        grace plus a margin)."""
        job.scope.cancel()
        with trio.move_on_after(KILL_GRACE + 2 * CLEANUP_MARGIN):
            await job.ended.wait()

    def cancel_runs(self, run_ids: Iterable[str]) -> list[Job]:
        """The runs ``run_ids`` were cancelled: with ``kill_on_cancel``, kill the jobs they
        started (their tasks end the process groups). Returns the jobs told to stop."""
        if not self.options.kill_on_cancel:
            return []
        runs = set(run_ids)
        stopped = [job for job in self.running() if job.run_id in runs]
        for job in stopped:
            job.scope.cancel()
        return stopped
