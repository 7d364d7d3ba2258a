"""Running one shell command in its own process group, in the OS sandbox when there is one.

The command runs as ``bash -c COMMAND`` in a new session and so its own process group, with
stdin closed and stdout and stderr merged into one captured stream. When the command returns,
times out or is cancelled, the whole process group is ended (SIGTERM, then SIGKILL after
:data:`KILL_GRACE` seconds), so no process it started outlives the call, background ones
(``sleep 100 &``) included.
"""

from __future__ import annotations

import os
import signal
import subprocess
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Final

import attrs
import trio

from .sandbox import Sandbox, shell_env, spawn_args
from .threads import tool_thread_limiter

if TYPE_CHECKING:
    from .stream import OutputStreamer

__all__ = [
    "CLEANUP_MARGIN",
    "KILL_GRACE",
    "ShellOutcome",
    "deliver_cancel",
    "end_group",
    "render_output",
    "run_shell",
    "shell_argv",
    "start_shell",
]

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


def render_output(data: bytes, limit: int) -> tuple[str, int]:
    """``data`` as text within ``limit`` bytes (head and tail kept, the middle cut), and how
    many bytes were cut."""
    buffer = _OutputBuffer(max(limit, 2))
    buffer.add(data)
    return buffer.render()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_has_live_members(pgid: int) -> bool:
    """Whether a process group still has a member that is not a zombie.

    An orphaned zombie stays a member until init reaps it, and some container inits never do
    (or only later: the sandbox's first process is such a zombie after a command); where
    ``/proc`` exists, members are read from it so such zombies do not count. Each process's
    group is asked with ``getpgid`` (one system call) and only members' ``stat`` files are read:
    reading every process's file cost about 10 ms per check with a hundred processes running.
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
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            if os.getpgid(int(name)) != pgid:
                continue
        except ProcessLookupError:
            continue
        except OSError:
            pass  # not ours to ask: its stat file says
        try:
            stat = (proc / name / "stat").read_text()
        except OSError:
            continue
        # Format: "pid (comm) state ppid pgrp ..."; comm may contain spaces and parentheses.
        fields = stat.rpartition(")")[2].split()
        if len(fields) >= 3 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


async def end_group(pgid: int) -> bool:
    """End every process of group ``pgid``: SIGTERM, then SIGKILL after :data:`KILL_GRACE`.

    Returns:
        True when the group was seen with no live member (none left to end); False when it
        was sent SIGKILL, whose effect is not waited for.

    Cancellation:
        Call it under a shielded, bounded scope when cleaning up after a cancel.
    """
    limiter = tool_thread_limiter()
    if not await trio.to_thread.run_sync(_group_has_live_members, pgid, limiter=limiter):
        return True
    _signal_group(pgid, signal.SIGTERM)
    with trio.move_on_after(KILL_GRACE):
        # Polling is the only way: the OS gives no event for the exit of a process that is not
        # our child, and this wait is bounded by KILL_GRACE.
        while await trio.to_thread.run_sync(  # noqa: ASYNC110
            _group_has_live_members, pgid, limiter=limiter
        ):
            await trio.sleep(GROUP_POLL_INTERVAL)
        return True
    _signal_group(pgid, signal.SIGKILL)
    return False


async def deliver_cancel(process: trio.Process) -> None:
    """``trio.run_process``'s cancel hook: end the shell's whole group, not just the shell."""
    _signal_group(process.pid, signal.SIGTERM)
    await trio.sleep(KILL_GRACE)
    _signal_group(process.pid, signal.SIGKILL)


async def _collect(
    stream: trio.abc.ReceiveStream,
    into: _OutputBuffer,
    done: trio.Event,
    streamer: OutputStreamer | None = None,
) -> None:
    async with stream:
        async for chunk in stream:
            into.add(chunk)
            if streamer is not None:
                streamer.feed(chunk)
    done.set()


async def shell_argv(
    command: str,
    *,
    cwd: Path,
    sandbox: Sandbox | None,
    data_dir: Path | None,
    writable: bool,
    network: bool | None,
    prompt_free: bool = False,
) -> tuple[list[str], int | None]:
    """The command line of ``bash -c command``: inside ``sandbox``'s ``bwrap`` when given.

    Returns the argv and, in the sandbox, the descriptor that holds ``bwrap``'s layout
    (:func:`~crush_trio.tools.sandbox.spawn_args`): pass it to the child (``pass_fds``) and
    close it once the child has started (or if it never starts).

    Cancellation:
        Abandons the worker thread that checks the sandbox's paths.
    """
    argv = ["bash", "-c", command]
    if sandbox is None:
        return argv, None
    extra_hidden = tuple(sandbox.more_hidden()) if sandbox.more_hidden else ()
    layout: list[str] = await trio.to_thread.run_sync(
        partial(
            sandbox.command,
            argv,
            workspace=cwd,
            data_dir=data_dir,
            writable=writable,
            network=network,
            extra_hidden=extra_hidden,
            prompt_free=prompt_free,
        ),
        abandon_on_cancel=True,
        limiter=tool_thread_limiter(),
    )
    spawned, fd = spawn_args(layout)
    return spawned, fd


async def start_shell(
    nursery: trio.Nursery,
    command: str,
    *,
    cwd: Path,
    sandbox: Sandbox | None,
    data_dir: Path | None,
    writable: bool,
    network: bool | None,
    prompt_free: bool = False,
) -> trio.Process:
    """Start ``bash -c command`` (in ``sandbox`` when given, :func:`shell_argv`) as a task of
    ``nursery``: in its own process group, stdin closed, stdout and stderr on one pipe. Its
    cancel ends the whole group (:func:`deliver_cancel`).

    Cancellation:
        Before the process started: nothing is left running, and the sandbox's layout
        descriptor is closed.
    """
    argv, args_fd = await shell_argv(
        command,
        cwd=cwd,
        sandbox=sandbox,
        data_dir=data_dir,
        writable=writable,
        network=network,
        prompt_free=prompt_free,
    )
    try:
        process: trio.Process = await nursery.start(
            partial(
                trio.run_process,
                argv,
                cwd=cwd,
                env=shell_env(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                check=False,
                deliver_cancel=deliver_cancel,
                pass_fds=() if args_fd is None else (args_fd,),
            )
        )
    finally:
        if args_fd is not None:
            os.close(args_fd)  # the child has its own copy
    return process


async def run_shell(
    command: str,
    *,
    cwd: Path,
    time_limit: float,
    output_limit: int,
    sandbox: Sandbox | None = None,
    data_dir: Path | None = None,
    writable: bool = True,
    network: bool | None = None,
    prompt_free: bool = False,
    streamer: OutputStreamer | None = None,
) -> ShellOutcome:
    """Run ``bash -c command`` in ``cwd`` in its own process group, in ``sandbox`` if given.

    The command gets the environment of :func:`~crush_trio.tools.sandbox.shell_env` (an
    allow-list: no provider keys, no server token).

    Args:
        command: the shell command.
        cwd: its working directory (the workspace's real path when sandboxed).
        time_limit: seconds before the command is stopped.
        output_limit: bytes of merged output kept (half from the start, half from the end).
        sandbox: the OS sandbox to run in; None runs the command directly.
        data_dir: the workspace's data directory, read-only in the sandbox.
        writable: the workspace is writable in the sandbox.
        network: grant the network in the sandbox for this call (None: the sandbox's setting).
        prompt_free: the command runs without a prompt: in the sandbox, the workspace is
            read-only and there is no network whatever ``writable`` and ``network`` say
            (:meth:`~crush_trio.tools.sandbox.Sandbox.command`).
        streamer: gets every output chunk as it is read, to publish it while the command runs.

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
    # Set when the group was seen with no live member after the command returned: nothing can
    # fork into such a group, so the final clean-up would only find it empty again. (A process
    # that moved to another group of the command's session could move back, but it escaped the
    # clean-up when it moved away.)
    ended = False
    try:
        with trio.move_on_after(time_limit):
            async with trio.open_nursery() as nursery:
                process = await start_shell(
                    nursery,
                    command,
                    cwd=cwd,
                    sandbox=sandbox,
                    data_dir=data_dir,
                    writable=writable,
                    network=network,
                    prompt_free=prompt_free,
                )
                pgid = process.pid
                assert process.stdout is not None
                drained = trio.Event()
                nursery.start_soon(_collect, process.stdout, output, drained, streamer)
                if streamer is not None:
                    nursery.start_soon(streamer.run)
                exit_code = await process.wait()
                # A background process still holds the output pipe; end it so the pipe closes.
                ended = await end_group(pgid)
                with trio.move_on_after(OUTPUT_DRAIN_TIMEOUT):
                    await drained.wait()
                nursery.cancel_scope.cancel()
    finally:
        if streamer is not None:
            streamer.close()
        if pgid is not None and not ended:
            with trio.move_on_after(KILL_GRACE + CLEANUP_MARGIN, shield=True):
                await end_group(pgid)
    text, cut = output.render()
    return ShellOutcome(
        output=text, cut_bytes=cut, exit_code=exit_code, timed_out=exit_code is None
    )
