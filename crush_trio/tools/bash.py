"""The ``bash`` tool: run one shell command in the workspace.

The command runs as ``bash -c COMMAND`` in the workspace directory, in its own process group,
with stdin closed and stdout and stderr merged (:func:`~crush_trio.tools.shell.run_shell`). When
the command returns, times out or is cancelled, the whole process group is ended, so no process
it started outlives the call, background ones (``sleep 100 &``) included.

On Linux the command runs in the OS sandbox of :mod:`crush_trio.tools.sandbox` (bubblewrap):
writes only inside the workspace and a private ``/tmp``, the user's secrets absent, no network
unless granted, a scrubbed environment. Every process dies with the call.

Permission (action ``"execute"``): in the sandbox, every command asks except one simple read-only
command (:func:`~crush_trio.tools.readonly.read_only_argv`) that does not ask for the network.
Such a command runs without a prompt, so it runs ``prompt_free``: the words the classifier
checked (quoted again, globs already expanded), in the sandbox with the workspace read-only and
no network whatever ``options.sandbox.network`` says. It is harmless because of where it runs,
even when the classifier is wrong about it. A call that asks for the network (``network: true``)
asks unless ``options.sandbox.network`` grants it. Without a sandbox (not Linux, no user
namespaces, ``options.sandbox.enabled: false``) every command asks, read-only or not, and runs
with the server user's rights (but the same scrubbed environment).
"""

from __future__ import annotations

import signal
from typing import Any

import attrs

from .base import (
    ToolBase,
    ToolContext,
    ToolError,
    ToolResult,
    ToolSpec,
    ask_permission,
    run_blocking,
)
from .readonly import read_only_argv, read_only_command
from .shell import ShellOutcome, run_shell
from .stream import OutputStreamer

__all__ = ["BashTool"]


def _status_line(outcome: ShellOutcome, timeout: float, max_timeout: float) -> str:
    if outcome.timed_out:
        return (
            f"command timed out after {timeout:g} s and was stopped, with every process it "
            f"started; the output so far is above. Pass a longer timeout (at most "
            f"{max_timeout:g} s) or make the command finish sooner"
        )
    assert outcome.exit_code is not None
    if outcome.exit_code < 0:
        try:
            name = signal.Signals(-outcome.exit_code).name
        except ValueError:
            name = str(-outcome.exit_code)
        return f"killed by signal {name}"
    return f"exit code: {outcome.exit_code}"


def _sandbox_note(*, writable: bool, network: bool) -> str:
    parts = [
        "note: the command ran in a sandbox: only the workspace, /tmp (private to this call) and "
        "the system directories exist; HOME is a fresh empty directory"
    ]
    if not writable:
        parts.append(
            "the workspace was read-only because the command ran without asking; a command "
            "that writes asks the user first"
        )
    else:
        parts.append("writes outside the workspace and /tmp fail")
    if not network:
        parts.append("there is no network: pass network=true to ask the user for it")
    return "; ".join(parts)


async def _start_job(
    ctx: ToolContext, command: str, *, read_only: bool, network: bool | None
) -> ToolResult:
    """Start ``command`` (already allowed) as a background job of ``ctx.jobs``."""
    if ctx.jobs is None:
        raise ToolError(
            "background jobs are not available here; run the command without background=true"
        )
    job = await ctx.jobs.start(
        command,
        cwd=ctx.workspace,
        session_id=ctx.session_id,
        run_id=ctx.run_id,
        tool_call_id=ctx.tool_call_id,
        sandbox=ctx.sandbox,
        data_dir=ctx.data_dir,
        writable=not read_only,
        network=network,
        prompt_free=read_only,
    )
    return ToolResult(
        content=(
            f"started background job {job.id}: {command}\n"
            f"Read its output with job_output (job_id {job.id!r}, wait up to N seconds for it "
            "to end) and stop it with job_kill. It is stopped when the workspace closes."
        )
    )


@attrs.define
class BashTool(ToolBase):
    """``bash``: run a shell command in the workspace."""

    spec = ToolSpec(
        name="bash",
        description=(
            "Run a shell command with bash in the workspace directory and return its combined "
            "stdout and stderr and its exit code. Stdin is closed, so interactive commands get "
            "end-of-file. Processes the command starts in the background are stopped when it "
            "returns. Long output keeps its beginning and end with the middle cut. On Linux the "
            "command runs in a sandbox: it can write only inside the workspace and /tmp (private "
            "to the call), sees system directories read-only, has a fresh HOME and no network "
            "unless you pass network=true (which asks the user) or the workspace allows it. "
            "Commands ask the user for permission, except, in the sandbox, one simple read-only "
            "command (ls, pwd, cat, head, tail, wc, grep, rg, find, echo, which, date, git "
            "status/log/diff) with no operators, pipes, redirections, variables or braces and no "
            "paths outside the workspace. Prefer the view, ls, glob and grep tools for reading "
            "files."
        ),
        parameters={
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command to run."},
                "timeout": {
                    "type": "number",
                    "exclusiveMinimum": 0,
                    "description": "Seconds before the command is stopped (default and maximum: "
                    "the server's tool timeout).",
                },
                "network": {
                    "type": "boolean",
                    "description": "The command needs the network (downloads, package installs); "
                    "asks the user unless the workspace allows network access.",
                },
                "background": {
                    "type": "boolean",
                    "description": "Start the command as a background job and return its id at "
                    "once (for servers, watchers, long builds); read its output with job_output "
                    "and stop it with job_kill. It runs until it ends, is killed or the "
                    "workspace closes; the timeout does not apply.",
                },
            },
            "required": ["command"],
        },
    )

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        command: str = params["command"]
        if not command.strip():
            raise ToolError("parameter 'command' must not be empty")
        requested = params.get("timeout")
        if requested is not None and requested <= 0:
            raise ToolError(f"parameter 'timeout' must be more than 0 seconds, got {requested}")
        timeout = ctx.timeout if requested is None else min(float(requested), ctx.timeout)
        workdir = ctx.workspace
        sandbox = ctx.sandbox
        wants_network = bool(params.get("network") or False)
        background = bool(params.get("background") or False)
        asks_network = sandbox is not None and wants_network and not sandbox.network
        # A call that wants the network is never prompt-free: it runs as the user allows it.
        approved: list[str] | None = None
        if sandbox is not None and not wants_network:
            approved = await run_blocking(ctx, "bash", read_only_argv, command, workdir)
        read_only = approved is not None
        if approved is not None:
            command = read_only_command(approved)  # the words checked, and nothing else
        else:
            if sandbox is None:
                where = (
                    "with no sandbox: it can read, change and send anything your user account can"
                )
            else:
                net = "with network access" if asks_network or sandbox.network else "no network"
                where = f"in the sandbox (writes only inside the workspace, {net})"
            await ask_permission(
                ctx,
                tool_name="bash",
                action="execute",
                description=(
                    f"{'Start a background job' if background else 'Run a shell command'} in "
                    f"{workdir} {where}: {command}"
                ),
                params={
                    "command": command,
                    "workdir": str(workdir),
                    "working_dir": str(workdir),  # the key Crush's permission dialog reads
                    "timeout": timeout,
                    "sandboxed": sandbox is not None,
                    "network": sandbox is None or sandbox.network or asks_network,
                    "background": background,
                },
                path=workdir,
            )
        if background:
            return await _start_job(
                ctx, command, read_only=read_only, network=True if asks_network else None
            )
        streamer = (
            OutputStreamer(
                ctx.publish,
                session_id=ctx.session_id,
                tool_call_id=ctx.tool_call_id,
                run_id=ctx.run_id,
            )
            if ctx.publish is not None
            else None
        )
        outcome = await run_shell(
            command,
            cwd=workdir,
            time_limit=timeout,
            output_limit=ctx.bash_output_limit,
            sandbox=sandbox,
            data_dir=ctx.data_dir,
            writable=not read_only,
            network=True if asks_network else None,
            prompt_free=read_only,
            streamer=streamer,
        )
        body = outcome.output.rstrip("\n") or "(no output)"
        status = _status_line(outcome, timeout, ctx.timeout)
        if sandbox is not None and outcome.exit_code != 0:
            status += "\n" + _sandbox_note(
                writable=not read_only, network=not read_only and (sandbox.network or asks_network)
            )
        # A prompt-free command ran with the workspace read-only: it changed nothing there.
        return ToolResult(
            content=f"{body}\n{status}", is_error=outcome.timed_out, wrote_nothing=read_only
        )
