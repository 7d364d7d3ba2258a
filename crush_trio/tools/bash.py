"""The ``bash`` tool: run one shell command in the workspace.

The command runs as ``bash -c COMMAND`` in the workspace directory, in a new session and so its
own process group, with stdin closed and stdout and stderr merged into one captured stream. When
the command returns, times out or is cancelled, the whole process group is ended (SIGTERM, then
SIGKILL after :data:`KILL_GRACE` seconds), so no process it started outlives the call, background
ones (``sleep 100 &``) included.

Permission: every command asks (action ``"execute"``) except one simple read-only command, see
:func:`is_read_only`. The shell is not a sandbox: an allowed command can do anything the server's
user can, which is why everything else asks.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
from functools import partial
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from .base import ToolContext, ToolError, ToolResult, ToolSpec, ask_permission, run_tool
from .paths import is_within

__all__ = [
    "GIT_READ_ONLY_SUBCOMMANDS",
    "KILL_GRACE",
    "READ_ONLY_COMMANDS",
    "BashTool",
    "ShellOutcome",
    "is_read_only",
    "run_shell",
]

#: Commands that run without asking when the whole command is one simple command (see
#: :func:`is_read_only`).
READ_ONLY_COMMANDS: Final = frozenset(
    {"ls", "pwd", "cat", "head", "tail", "wc", "grep", "rg", "find", "echo", "which", "date", "git"}
)
#: ``git`` subcommands that count as read-only.
GIT_READ_ONLY_SUBCOMMANDS: Final = frozenset({"status", "log", "diff"})
#: Characters that make a command more than one simple command (lists, pipes, redirections,
#: substitutions, background jobs, variables and multiple lines).
SHELL_SPECIAL_CHARS: Final = frozenset(";&|<>`$\n\r")
#: Options that make a read-only command write, delete or run something else.
UNSAFE_OPTIONS: Final = {
    "find": (
        "-exec",
        "-execdir",
        "-ok",
        "-okdir",
        "-delete",
        "-fprint",
        "-fprint0",
        "-fprintf",
        "-fls",
    ),
    "rg": ("--pre",),
    "git": ("--output", "--ext-diff", "--textconv"),
    "date": ("-s", "--set"),
}
#: Read-only commands whose arguments are never paths, so they are not checked for paths outside
#: the workspace.
NON_PATH_COMMANDS: Final = frozenset({"echo", "which", "date", "pwd"})

#: Seconds a process group gets between SIGTERM and SIGKILL.
KILL_GRACE: Final = 2.0
#: Seconds between checks that a process group has ended. No OS event reports the exit of a
#: process that is not our child (a background grandchild), so this one wait polls.
GROUP_POLL_INTERVAL: Final = 0.05
#: Seconds to wait for the output pipe to close once the process group has ended (a process that
#: left the group may still hold it).
OUTPUT_DRAIN_TIMEOUT: Final = 1.0
#: Extra seconds the shielded final clean-up may take beyond :data:`KILL_GRACE`.
CLEANUP_MARGIN: Final = 1.0


def _has_unsafe_option(name: str, args: list[str]) -> bool:
    for arg in args:
        for option in UNSAFE_OPTIONS.get(name, ()):
            if arg == option or arg.startswith(option + "="):
                return True
        if name == "git" and arg.startswith("--output"):
            return True
        if name == "date" and arg.startswith("-") and not arg.startswith("--") and "s" in arg:
            return True
    return False


def is_read_only(command: str, workspace: Path) -> bool:
    """Whether ``command`` runs without asking for permission.

    True only when the command is one simple command: no ``;``, ``&``, ``|``, ``<``, ``>``,
    backquote, ``$`` (substitutions and variables) or newline anywhere, not even quoted; its
    program is in :data:`READ_ONLY_COMMANDS` (``git`` only with a subcommand in
    :data:`GIT_READ_ONLY_SUBCOMMANDS`); it has none of the :data:`UNSAFE_OPTIONS`; and, except
    for ``echo``, ``which``, ``date`` and ``pwd``, no argument names a path outside the
    workspace.

    Args:
        command: the shell command.
        workspace: the workspace's real path.
    """
    if any(ch in SHELL_SPECIAL_CHARS for ch in command):
        return False
    try:
        words = shlex.split(command)
    except ValueError:
        return False
    if not words or words[0] not in READ_ONLY_COMMANDS:
        return False
    name, args = words[0], words[1:]
    if name == "git" and (not args or args[0] not in GIT_READ_ONLY_SUBCOMMANDS):
        return False
    if _has_unsafe_option(name, args):
        return False
    if name in NON_PATH_COMMANDS:
        return True
    for arg in args:
        value = arg.partition("=")[2] if arg.startswith("-") else arg
        if not value or value.startswith("-"):
            continue
        if value.startswith("~") or not _inside(workspace, value):
            return False
    return True


def _inside(workspace: Path, raw: str) -> bool:
    candidate = Path(raw) if os.path.isabs(raw) else workspace / raw
    return is_within(Path(os.path.realpath(candidate)), workspace)


# ---------------------------------------------------------------------------------------------
# running a command


@attrs.define
class ShellOutcome:
    """What a finished, timed-out or failed command left.

    Attributes:
        output: merged stdout and stderr, head and tail kept within the limit.
        cut_bytes: bytes cut from the middle of the output (0 when it all fit).
        exit_code: the shell's exit status; negative for a signal; None if it timed out.
        timed_out: the command was stopped at its timeout.
    """

    output: str
    cut_bytes: int
    exit_code: int | None
    timed_out: bool


@attrs.define
class _OutputBuffer:
    """Keeps the first and last bytes of a stream, counting what falls between."""

    limit: int
    head: bytearray = attrs.field(factory=bytearray)
    tail: bytearray = attrs.field(factory=bytearray)
    total: int = 0

    def add(self, chunk: bytes | bytearray) -> None:
        self.total += len(chunk)
        head_room = self.limit // 2 - len(self.head)
        if head_room > 0:
            self.head += chunk[:head_room]
            chunk = chunk[head_room:]
        if chunk:
            self.tail += chunk
            tail_limit = self.limit - self.limit // 2
            if len(self.tail) > tail_limit:
                del self.tail[: len(self.tail) - tail_limit]

    def render(self) -> tuple[str, int]:
        cut = self.total - len(self.head) - len(self.tail)
        head = self.head.decode("utf-8", errors="replace")
        tail = self.tail.decode("utf-8", errors="replace")
        if cut > 0:
            return f"{head}\n\n[... {cut} bytes of output cut from the middle ...]\n\n{tail}", cut
        return head + tail, 0


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_has_live_members(pgid: int) -> bool:
    """Whether a process group still has a member that is not a zombie.

    An orphaned zombie stays a member until init reaps it, and some container inits never do;
    where ``/proc`` exists, members are read from it so such zombies do not count.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Format: "pid (comm) state ppid pgrp ..."; comm may contain spaces and parentheses.
        fields = stat.rpartition(")")[2].split()
        if len(fields) >= 3 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


async def _end_group(pgid: int) -> None:
    """End every process of group ``pgid``: SIGTERM, then SIGKILL after :data:`KILL_GRACE`.

    Cancellation:
        Call it under a shielded, bounded scope when cleaning up after a cancel.
    """
    if not await trio.to_thread.run_sync(_group_has_live_members, pgid):
        return
    _signal_group(pgid, signal.SIGTERM)
    with trio.move_on_after(KILL_GRACE):
        # Polling is the only way: the OS gives no event for the exit of a process that is not
        # our child, and this wait is bounded by KILL_GRACE.
        while await trio.to_thread.run_sync(_group_has_live_members, pgid):  # noqa: ASYNC110
            await trio.sleep(GROUP_POLL_INTERVAL)
        return
    _signal_group(pgid, signal.SIGKILL)


async def _deliver_cancel(process: trio.Process) -> None:
    """``trio.run_process``'s cancel hook: end the shell's whole group, not just the shell."""
    _signal_group(process.pid, signal.SIGTERM)
    await trio.sleep(KILL_GRACE)
    _signal_group(process.pid, signal.SIGKILL)


async def _collect(stream: trio.abc.ReceiveStream, into: _OutputBuffer, done: trio.Event) -> None:
    async with stream:
        async for chunk in stream:
            into.add(chunk)
    done.set()


def _shell_env() -> dict[str, str]:
    env = dict(os.environ)
    # No pager or credential prompt can wait for a terminal that is not there.
    env.update({"PAGER": "cat", "GIT_PAGER": "cat", "GIT_TERMINAL_PROMPT": "0"})
    return env


async def run_shell(
    command: str, *, cwd: Path, time_limit: float, output_limit: int
) -> ShellOutcome:
    """Run ``bash -c command`` in ``cwd`` in its own process group.

    Args:
        command: the shell command.
        cwd: its working directory.
        time_limit: seconds before the command is stopped.
        output_limit: bytes of merged output kept (half from the start, half from the end).

    Returns:
        The output and how the command ended. When the command returns, its process group is
        ended too, so background processes it started do not outlive it.

    Cancellation:
        The process group gets SIGTERM, then SIGKILL after :data:`KILL_GRACE`; the final clean-up
        is shielded for at most ``KILL_GRACE + CLEANUP_MARGIN`` seconds, then ``trio.Cancelled``
        propagates.
    """
    output = _OutputBuffer(max(output_limit, 2))
    pgid: int | None = None
    exit_code: int | None = None
    try:
        with trio.move_on_after(time_limit):
            async with trio.open_nursery() as nursery:
                process: trio.Process = await nursery.start(
                    partial(
                        trio.run_process,
                        ["bash", "-c", command],
                        cwd=cwd,
                        env=_shell_env(),
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        check=False,
                        deliver_cancel=_deliver_cancel,
                    )
                )
                pgid = process.pid
                assert process.stdout is not None
                drained = trio.Event()
                nursery.start_soon(_collect, process.stdout, output, drained)
                exit_code = await process.wait()
                # A background process still holds the output pipe; end it so the pipe closes.
                await _end_group(pgid)
                with trio.move_on_after(OUTPUT_DRAIN_TIMEOUT):
                    await drained.wait()
                nursery.cancel_scope.cancel()
    finally:
        if pgid is not None:
            with trio.move_on_after(KILL_GRACE + CLEANUP_MARGIN, shield=True):
                await _end_group(pgid)
    text, cut = output.render()
    return ShellOutcome(
        output=text, cut_bytes=cut, exit_code=exit_code, timed_out=exit_code is None
    )


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


@attrs.define
class BashTool:
    """``bash``: run a shell command in the workspace."""

    spec = ToolSpec(
        name="bash",
        description=(
            "Run a shell command with bash in the workspace directory and return its combined "
            "stdout and stderr and its exit code. Stdin is closed, so interactive commands get "
            "end-of-file. Processes the command starts in the background are stopped when it "
            "returns. Long output keeps its beginning and end with the middle cut. Commands ask "
            "the user for permission, except one simple read-only command (ls, pwd, cat, head, "
            "tail, wc, grep, rg, find, echo, which, date, git status/log/diff) with no "
            "operators, pipes, redirections or variables and no paths outside the workspace. "
            "Prefer the view, ls, glob and grep tools for reading files."
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
            },
            "required": ["command"],
        },
    )

    async def run(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return await run_tool(self, params, ctx)

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        command: str = params["command"]
        if not command.strip():
            raise ToolError("parameter 'command' must not be empty")
        requested = params.get("timeout")
        if requested is not None and requested <= 0:
            raise ToolError(f"parameter 'timeout' must be more than 0 seconds, got {requested}")
        timeout = ctx.timeout if requested is None else min(float(requested), ctx.timeout)
        workdir = ctx.workspace
        if not is_read_only(command, ctx.workspace):
            await ask_permission(
                ctx,
                tool_name="bash",
                action="execute",
                description=f"Run a shell command in {workdir}: {command}",
                params={"command": command, "workdir": str(workdir), "timeout": timeout},
                path=workdir,
            )
        outcome = await run_shell(
            command, cwd=workdir, time_limit=timeout, output_limit=ctx.bash_output_limit
        )
        body = outcome.output.rstrip("\n") or "(no output)"
        status = _status_line(outcome, timeout, ctx.timeout)
        return ToolResult(content=f"{body}\n{status}", is_error=outcome.timed_out)
