"""The ``bash`` tool: run one shell command in the workspace.

The command runs as ``bash -c COMMAND`` in the workspace directory, in a new session and so its
own process group, with stdin closed and stdout and stderr merged into one captured stream. When
the command returns, times out or is cancelled, the whole process group is ended (SIGTERM, then
SIGKILL after :data:`KILL_GRACE` seconds), so no process it started outlives the call, background
ones (``sleep 100 &``) included.

On Linux the command runs in the OS sandbox of :mod:`crush_trio.tools.sandbox` (bubblewrap):
writes only inside the workspace and a private ``/tmp``, the user's secrets absent, no network
unless granted, a scrubbed environment. Every process dies with the call.

Permission (action ``"execute"``): in the sandbox, every command asks except one simple read-only
command (:func:`is_read_only`), which then runs with the workspace read-only too; a call that
asks for the network (``network: true``) asks unless ``options.sandbox.network`` grants it.
Without a sandbox (not Linux, no user namespaces, ``options.sandbox.enabled: false``) every
command asks, read-only or not, and runs with the server user's rights (but the same scrubbed
environment).
"""

from __future__ import annotations

import glob
import os
import signal
import stat
import subprocess
from functools import partial
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from .base import (
    ToolContext,
    ToolError,
    ToolResult,
    ToolSpec,
    ask_permission,
    run_blocking,
    run_tool,
    tool_thread_limiter,
)
from .paths import is_within
from .sandbox import Sandbox, shell_env

__all__ = [
    "GIT_READ_ONLY_SUBCOMMANDS",
    "KILL_GRACE",
    "READ_ONLY_COMMANDS",
    "BashTool",
    "ShellOutcome",
    "is_read_only",
    "run_shell",
]

#: Commands that may run without asking when the whole command is one simple command (see
#: :func:`is_read_only`).
READ_ONLY_COMMANDS: Final = frozenset(
    {"ls", "pwd", "cat", "head", "tail", "wc", "grep", "rg", "find", "echo", "which", "date", "git"}
)
#: ``git`` subcommands that count as read-only.
GIT_READ_ONLY_SUBCOMMANDS: Final = frozenset({"status", "log", "diff"})
#: Characters that make a command more than one simple command (lists, pipes, redirections,
#: substitutions, background jobs, variables and multiple lines), quoted or not.
SHELL_SPECIAL_CHARS: Final = frozenset(";&|<>`$\n\r")
#: Characters that, unquoted, make the shell expand a word (braces, extended globs) or start a
#: subshell: such a command is not read-only (nor is one with an unquoted word that starts with
#: ``#``, a comment, or an unquoted ``~`` that the shell expands, see :meth:`_Word.has_tilde`).
UNQUOTED_EXPANSION_CHARS: Final = frozenset("{}()!")
#: Unquoted glob characters: the shell expands them to names; each name must pass the checks.
GLOB_CHARS: Final = frozenset("*?[")
#: Most names one glob may expand to before the command stops counting as read-only.
GLOB_CHECK_LIMIT: Final = 1000
#: Options that make a read-only command write, delete, run something else, read a file named
#: elsewhere or follow symlinks out of the workspace.
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
        "-L",
        "-follow",
        "-files0-from",
    ),
    "rg": ("--pre", "--hostname-bin", "--follow", "--search-zip", "--pre-glob"),
    "grep": ("--dereference-recursive",),
    "git": ("--output", "--ext-diff", "--textconv", "--open-files-in-pager"),
    "date": ("-s", "--set", "-f", "--file", "-r", "--reference"),
    "wc": ("--files0-from",),
}
#: Single-letter options that are unsafe even when combined with others (``-rR``, ``-uf``).
UNSAFE_SHORT_LETTERS: Final = {"grep": "R", "rg": "Lz", "date": "sfr", "git": "O"}
#: Read-only commands whose arguments are never paths, so they are not checked for paths outside
#: the workspace.
NON_PATH_COMMANDS: Final = frozenset({"echo", "which", "date", "pwd"})
#: Bytes of a repository's config read to tell whether ``git`` would run programs it names.
GIT_CONFIG_MAX_BYTES: Final = 256 * 1024
#: Directories above the workspace searched for the repository ``git`` would use.
GIT_SEARCH_DEPTH: Final = 64
#: Repository config sections that make ``git status``/``log``/``diff`` run programs or read
#: other files.
GIT_UNSAFE_SECTIONS: Final = frozenset({"filter", "include", "includeif", "pager"})
#: Repository config keys (any section) that name programs or move the work tree.
GIT_UNSAFE_KEYS: Final = frozenset(
    {
        "fsmonitor",
        "external",
        "textconv",
        "showsignature",
        "worktree",
        "hookspath",
        "editor",
        "pager",
    }
)
#: Suffixes of config keys that name programs (``diff.<driver>.command``, ``gpg.program``...).
GIT_UNSAFE_KEY_SUFFIXES: Final = ("command", "program", "cmd", "hook", "askpass")


@attrs.frozen
class _Word:
    """One shell word: its text after quote removal, and which characters were unquoted."""

    text: str
    unquoted: tuple[bool, ...]

    def has_unquoted(self, chars: frozenset[str]) -> bool:
        return any(q and c in chars for c, q in zip(self.text, self.unquoted, strict=True))

    def has_tilde(self) -> bool:
        """An unquoted ``~`` that bash expands: at the start, or after ``=`` or ``:`` (as in
        ``a=~/x``). ``HEAD~1`` is left alone, as bash leaves it."""
        for index, (c, q) in enumerate(zip(self.text, self.unquoted, strict=True)):
            if c == "~" and q and (index == 0 or self.text[index - 1] in "=:"):
                return True
        return False

    def glob_pattern(self) -> str:
        """The word as a :mod:`glob` pattern: quoted characters escaped."""
        return "".join(
            c if q else glob.escape(c) for c, q in zip(self.text, self.unquoted, strict=True)
        )


def _split_words(command: str) -> list[_Word] | None:
    """Split ``command`` into words as bash does (quotes and backslashes), or None if a quote is
    not closed. Called only on commands without ``$``, backquotes or newlines."""
    words: list[_Word] = []
    text: list[str] = []
    flags: list[bool] = []
    in_word = False
    i, n = 0, len(command)
    while i < n:
        c = command[i]
        if c in " \t":
            if in_word:
                words.append(_Word("".join(text), tuple(flags)))
                text, flags, in_word = [], [], False
            i += 1
            continue
        in_word = True
        if c == "\\":
            if i + 1 >= n:
                return None
            text.append(command[i + 1])
            flags.append(False)
            i += 2
        elif c == "'":
            end = command.find("'", i + 1)
            if end < 0:
                return None
            text.extend(command[i + 1 : end])
            flags.extend([False] * (end - i - 1))
            i = end + 1
        elif c == '"':
            i += 1
            while True:
                if i >= n:
                    return None
                c = command[i]
                if c == '"':
                    i += 1
                    break
                if c == "\\" and i + 1 < n and command[i + 1] in '"\\':
                    c = command[i + 1]
                    i += 1
                text.append(c)
                flags.append(False)
                i += 1
        else:
            text.append(c)
            flags.append(True)
            i += 1
    if in_word:
        words.append(_Word("".join(text), tuple(flags)))
    return words


def _has_unsafe_option(name: str, args: list[str]) -> bool:
    letters = UNSAFE_SHORT_LETTERS.get(name, "")
    unsafe = UNSAFE_OPTIONS.get(name, ())
    for arg in args:
        if arg == "--":
            break  # operands follow
        for option in unsafe:
            if arg == option or arg.startswith(option + "="):
                return True
        if arg.startswith("--") and len(arg) > 2:
            # GNU tools and git accept any unambiguous prefix of a long option (--fil=F).
            given = arg[2:].split("=", 1)[0]
            if any(o.startswith("--") and o[2:].startswith(given) for o in unsafe):
                return True
        if name == "git" and arg.startswith("--output"):
            return True
        if arg.startswith("-") and not arg.startswith("--"):
            if name != "find" and any(letter in arg[1:] for letter in letters):
                return True
            # A value glued to a short option ("-f/etc/x") would escape the path check.
            if "/" in arg or "~" in arg:
                return True
    return False


def _git_config_is_safe(path: Path) -> bool:
    """Whether a repository config names no program git could run and includes nothing."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size > GIT_CONFIG_MAX_BYTES:
        return False
    try:
        with open(path, "rb") as f:
            text = f.read(GIT_CONFIG_MAX_BYTES).decode("utf-8", "replace")
    except OSError:
        return False
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line[1:].split("]", 1)[0].strip().split()[0].split(".")[0].lower()
            if section.strip('"') in GIT_UNSAFE_SECTIONS:
                return False
            line = line.split("]", 1)[1].strip() if "]" in line else ""
            if not line:
                continue
        key = line.split("=", 1)[0].strip().lower()
        if key in GIT_UNSAFE_KEYS or key.endswith(GIT_UNSAFE_KEY_SUFFIXES):
            return False
    return True


def _git_repository_is_safe(workspace: Path) -> bool:
    """Whether the repository ``git`` would use in ``workspace`` has a config that runs nothing.

    A ``.git`` that is a file (a linked work tree or submodule) points elsewhere: not checked,
    so not safe. No repository at all is safe (git then only reports the error).
    """
    directory = workspace
    for _ in range(GIT_SEARCH_DEPTH):
        dot_git = directory / ".git"
        if os.path.lexists(dot_git):
            if os.path.islink(dot_git) or not os.path.isdir(dot_git):
                return False
            return _git_config_is_safe(dot_git / "config") and _git_config_is_safe(
                dot_git / "config.worktree"
            )
        if directory.parent == directory:
            return True
        directory = directory.parent
    return False


def _path_is_safe(workspace: Path, raw: str) -> bool:
    """Inside the workspace once symlinks are followed, and not a file with other hard links."""
    candidate = Path(raw) if os.path.isabs(raw) else workspace / raw
    real = Path(os.path.realpath(candidate))
    if not is_within(real, workspace):
        return False
    try:
        st = os.stat(real)
    except OSError:
        return True
    # A hard link is the same file under another name, which may be outside the workspace.
    return not (stat.S_ISREG(st.st_mode) and st.st_nlink > 1)


def _expand_glob(workspace: Path, word: _Word) -> list[str] | None:
    """The names an unquoted glob expands to (itself when nothing matches, as in bash); None
    when there are more than :data:`GLOB_CHECK_LIMIT`."""
    pattern = word.glob_pattern()
    names: list[str] = []
    for name in glob.iglob(pattern, root_dir=workspace):
        names.append(name)
        if len(names) > GLOB_CHECK_LIMIT:
            return None
    return names or [word.text]


def is_read_only(command: str, workspace: Path) -> bool:
    """Whether ``command`` only reads inside the workspace, so it may run without asking.

    This is a convenience, not the security boundary (the OS sandbox is: such a command runs
    there with the workspace read-only), but it never says True for a command that can read
    outside the workspace, write, or run another program. True only when:

    * the command is one simple command: no ``;``, ``&``, ``|``, ``<``, ``>``, backquote, ``$``
      or newline anywhere, not even quoted; no unquoted brace, tilde, parenthesis or ``!``, and
      no comment (brace expansion such as ``cat {/etc/passwd,x}`` reads any file);
    * its program is in :data:`READ_ONLY_COMMANDS` (``git`` only with a subcommand in
      :data:`GIT_READ_ONLY_SUBCOMMANDS`, and only when the repository's config names no program
      and includes no file: ``core.fsmonitor``, ``diff.external``, textconv, filters...);
    * it has none of the :data:`UNSAFE_OPTIONS` (``date -f``, ``grep -R``, ``rg --pre``,
      ``find -L``...), and no value glued to a short option holds a path;
    * except for ``echo``, ``which``, ``date`` and ``pwd``, every argument that names a path,
      and every name an unquoted glob expands to, is inside the workspace once symlinks are
      followed, and is not a file with other hard links.

    Args:
        command: the shell command.
        workspace: the workspace's real path.

    Blocking:
        Reads the file system (paths, globs, the repository's config); call it in a thread.
    """
    if any(ch in SHELL_SPECIAL_CHARS for ch in command):
        return False
    words = _split_words(command)
    if not words or any(w.has_unquoted(UNQUOTED_EXPANSION_CHARS) for w in words):
        return False
    if any(w.has_tilde() for w in words):
        return False
    if any(w.text.startswith("#") and w.unquoted[0] for w in words):
        return False  # a comment: the shell would not run what follows as written
    if words[0].has_unquoted(GLOB_CHARS) or words[0].text not in READ_ONLY_COMMANDS:
        return False
    name = words[0].text
    args: list[str] = []
    for word in words[1:]:
        if word.has_unquoted(GLOB_CHARS):
            expanded = _expand_glob(workspace, word)
            if expanded is None:
                return False
            for item in expanded:
                if not _path_is_safe(workspace, item):
                    return False
            args.extend(expanded)
        else:
            args.append(word.text)
    if name == "git" and (not args or args[0] not in GIT_READ_ONLY_SUBCOMMANDS):
        return False
    if _has_unsafe_option(name, args):
        return False
    if name == "git" and not _git_repository_is_safe(workspace):
        return False
    if name in NON_PATH_COMMANDS:
        return True
    operands = False
    for arg in args:
        if arg == "--" and not operands:
            operands = True
            continue
        value = arg.partition("=")[2] if arg.startswith("-") and not operands else arg
        if not value or (value.startswith("-") and not operands):
            continue
        if value.startswith("~") or not _path_is_safe(workspace, value):
            return False
    return True


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
    limiter = tool_thread_limiter()
    if not await trio.to_thread.run_sync(_group_has_live_members, pgid, limiter=limiter):
        return
    _signal_group(pgid, signal.SIGTERM)
    with trio.move_on_after(KILL_GRACE):
        # Polling is the only way: the OS gives no event for the exit of a process that is not
        # our child, and this wait is bounded by KILL_GRACE.
        while await trio.to_thread.run_sync(  # noqa: ASYNC110
            _group_has_live_members, pgid, limiter=limiter
        ):
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

    Returns:
        The output and how the command ended. When the command returns, its process group is
        ended too, so background processes it started do not outlive it.

    Cancellation:
        The process group gets SIGTERM, then SIGKILL after :data:`KILL_GRACE`; the final clean-up
        is shielded for at most ``KILL_GRACE + CLEANUP_MARGIN`` seconds, then ``trio.Cancelled``
        propagates.
    """
    output = _OutputBuffer(max(output_limit, 2))
    argv = ["bash", "-c", command]
    pgid: int | None = None
    exit_code: int | None = None
    try:
        with trio.move_on_after(time_limit):
            if sandbox is not None:
                extra_hidden = tuple(sandbox.more_hidden()) if sandbox.more_hidden else ()
                argv = await trio.to_thread.run_sync(
                    partial(
                        sandbox.command,
                        argv,
                        workspace=cwd,
                        data_dir=data_dir,
                        writable=writable,
                        network=network,
                        extra_hidden=extra_hidden,
                    ),
                    abandon_on_cancel=True,
                    limiter=tool_thread_limiter(),
                )
            async with trio.open_nursery() as nursery:
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


@attrs.define
class BashTool:
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
        sandbox = ctx.sandbox
        wants_network = bool(params.get("network") or False)
        asks_network = sandbox is not None and wants_network and not sandbox.network
        read_only = (
            sandbox is not None
            and not asks_network
            and await run_blocking(ctx, "bash", is_read_only, command, workdir)
        )
        if not read_only:
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
                description=f"Run a shell command in {workdir} {where}: {command}",
                params={
                    "command": command,
                    "workdir": str(workdir),
                    "timeout": timeout,
                    "sandboxed": sandbox is not None,
                    "network": sandbox is None or sandbox.network or asks_network,
                },
                path=workdir,
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
        )
        body = outcome.output.rstrip("\n") or "(no output)"
        status = _status_line(outcome, timeout, ctx.timeout)
        if sandbox is not None and outcome.exit_code != 0:
            status += "\n" + _sandbox_note(
                writable=not read_only, network=sandbox.network or asks_network
            )
        return ToolResult(content=f"{body}\n{status}", is_error=outcome.timed_out)
