"""``job_output`` and ``job_kill``: read and end the background jobs ``bash`` started.

Neither asks for permission: they act only on jobs of the calling session, which the user
allowed when ``bash`` started them. See :mod:`crush_trio.tools.jobs`.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from ..wire import JobState
from .base import ToolBase, ToolContext, ToolError, ToolResult, ToolSpec
from .jobs import JOB_OUTPUT_MAX_WAIT, Job, JobManager
from .shell import render_output

__all__ = ["JobKillTool", "JobOutputTool"]


def _jobs(ctx: ToolContext) -> JobManager:
    if ctx.jobs is None:
        raise ToolError("background jobs are not available here")
    return ctx.jobs


def _job_status(job: Job) -> str:
    if job.state is JobState.RUNNING:
        return f"job {job.id} is still running"
    if job.state is JobState.KILLED:
        return f"job {job.id} was killed"
    return f"job {job.id} exited with code {job.exit_code}"


@attrs.define
class JobOutputTool(ToolBase):
    """``job_output``: the new output of a background job."""

    spec = ToolSpec(
        name="job_output",
        description=(
            "Read the output a background job (started with bash and background=true) wrote "
            "since the last job_output call, and whether it still runs. With wait, first wait "
            "up to that many seconds for the job to end (it returns as soon as it ends). Long "
            "output keeps its beginning and end with the middle cut."
        ),
        parameters={
            "type": "object",
            "properties": {
                "job_id": {"type": "string", "description": "The job's id (job-N)."},
                "wait": {
                    "type": "number",
                    "minimum": 0,
                    "description": f"Seconds to wait for the job to end first (default 0, at "
                    f"most {JOB_OUTPUT_MAX_WAIT:g} and the tool timeout).",
                },
            },
            "required": ["job_id"],
        },
    )

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        job = _jobs(ctx).get(params["job_id"], ctx.session_id)
        wait = min(float(params.get("wait") or 0.0), JOB_OUTPUT_MAX_WAIT, ctx.timeout)
        if wait > 0:
            with trio.move_on_after(wait):
                await job.ended.wait()
        data, dropped = job.take()
        text, _cut = render_output(data, ctx.bash_output_limit)
        lines = []
        if dropped:
            lines.append(
                f"[{dropped} earlier bytes of output were dropped: more than "
                f"{job.buffer_bytes} unread bytes (options.jobs.buffer_bytes); read sooner]"
            )
        lines.append(text.rstrip("\n") or "(no new output)")
        lines.append(_job_status(job))
        return ToolResult(content="\n".join(lines))


@attrs.define
class JobKillTool(ToolBase):
    """``job_kill``: end a background job and every process it started."""

    spec = ToolSpec(
        name="job_kill",
        description=(
            "Stop a background job (started with bash and background=true) and every process "
            "it started, and return its unread output."
        ),
        parameters={
            "type": "object",
            "properties": {"job_id": {"type": "string", "description": "The job's id (job-N)."}},
            "required": ["job_id"],
        },
    )

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        jobs = _jobs(ctx)
        job = jobs.get(params["job_id"], ctx.session_id)
        was_running = job.state is JobState.RUNNING
        if was_running:
            await jobs.kill(job)
        data, _dropped = job.take()
        text, _cut = render_output(data, ctx.bash_output_limit)
        head = f"killed job {job.id}" if was_running else _job_status(job)
        body = text.rstrip("\n")
        return ToolResult(content=f"{head}\n{body}" if body else head)
