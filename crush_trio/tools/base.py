"""The tool interface: what a tool is, what it gets to run, and what it returns.

A tool is an object with a :class:`~crush_trio.core.model.ToolSpec` (name, description and
JSON-schema parameters, sent to the model) and an async ``run(params, ctx)`` that returns a
:class:`ToolResult`. The agent loop calls tools through :func:`crush_trio.tools.call_tool`, which
parses and checks the model's JSON input first.

Everything a call needs comes in a :class:`ToolContext`: the workspace (the only tree tools may
touch without asking), the server's data directory (never writable by tools), the ids of the
session and tool call, the :class:`PermissionAsker` that asks the workspace's clients, and the
tool timeout and output limits.

Permission rules (the permission service implements :class:`PermissionAsker`):

* writing (``write``, ``edit``) always asks, with action ``"write"``;
* ``bash`` asks with action ``"execute"`` unless it runs in the OS sandbox and the command is one
  simple read-only command (see :mod:`.readonly` and :mod:`.sandbox`);
* any path outside the workspace asks, read tools included (action ``"read"``);
* a path inside the data directory is never written, whatever the answer would be;
* a denial ends the turn: the result has ``is_error`` and ``stop_turn`` set.

Every ask happens before the tool has any side effect.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

import attrs
import trio

from ..config import FetchOptions
from ..core.model import ToolSpec
from ..defaults import DEFAULT_BASH_OUTPUT_LIMIT, DEFAULT_TOOL_TIMEOUT
from ..wire import Session, Todo, ToolOutput
from .hidden import HiddenPaths
from .jobs import JobManager
from .result import PermissionDenied as PermissionDenied
from .result import PermissionTimedOut as PermissionTimedOut
from .result import ToolError as ToolError
from .result import ToolResult as ToolResult
from .sandbox import Sandbox
from .threads import TOOL_THREAD_LIMIT as TOOL_THREAD_LIMIT
from .threads import tool_thread_limiter as tool_thread_limiter
from .tracker import FileTracker, Snapshot, refusal

__all__ = [
    "DEFAULT_BASH_OUTPUT_LIMIT",
    "DEFAULT_TOOL_TIMEOUT",
    "PermissionAsker",
    "PermissionDenied",
    "SubAgentRunner",
    "TodoSink",
    "Tool",
    "ToolBase",
    "ToolContext",
    "ToolError",
    "ToolResult",
    "ToolSpec",
    "ask_permission",
    "check_viewed",
    "run_blocking",
    "tool_thread_limiter",
]


class PermissionAsker(Protocol):
    """Asks the workspace's clients whether a tool call may go ahead.

    The permission service implements this: it applies the workspace's skip mode, the config's
    ``permissions.allowed_tools``, session auto-approval and earlier ``allow_session`` grants,
    and otherwise publishes a ``permission_request`` and waits for the first answer.
    """

    async def request(
        self,
        *,
        session_id: str,
        tool_call_id: str,
        tool_name: str,
        action: str,
        description: str,
        params: dict[str, Any],
        path: str,
    ) -> bool:
        """Ask for permission and wait for the answer.

        Args:
            session_id: the session whose run makes the call.
            tool_call_id: the model's id of the tool call.
            tool_name: the tool's name (``write``, ``bash``, ...).
            action: ``"read"``, ``"write"`` or ``"execute"``.
            description: one line a person can judge the request by.
            params: the details a client shows (path, command, content, ...).
            path: the file or directory the call touches (for ``bash``: the workspace).

        Returns:
            True if the call is allowed, False if it was denied.

        Raises:
            TimeoutError: nobody answered within the configured time (the message says so).

        Cancellation:
            Raises ``trio.Cancelled`` if the run is cancelled while waiting; the request is then
            withdrawn.
        """
        ...


class SubAgentRunner(Protocol):
    """Runs a task in a child session with the read-only tools (the ``agent`` tool); the agent
    loop implements it."""

    async def run_subagent(
        self, *, parent_session_id: str, run_id: str | None, tool_call_id: str, prompt: str
    ) -> str:
        """Run ``prompt`` in a new child session of ``parent_session_id``; return its final text.

        Raises:
            ToolError: the sub-agent could not run or failed; the message says why.

        Cancellation:
            Cancelling stops the child's run; its messages are saved as cancelled first.
        """
        ...


def _real_path(value: str | os.PathLike[str]) -> Path:
    return Path(os.path.realpath(value))


@attrs.define
class ToolContext:
    """Everything one tool call may use.

    Attributes:
        workspace: the workspace directory (stored as its real path); relative paths start here
            and paths outside it need permission.
        data_dir: the server's data directory (stored as its real path); tools never write there
            and ``ls``/``glob``/``grep`` do not show it.
        session_id: the session whose run makes the call.
        tool_call_id: the model's id of this tool call.
        permissions: asks the workspace's clients for permission.
        timeout: seconds a tool may work once allowed (:data:`DEFAULT_TOOL_TIMEOUT`).
        bash_output_limit: bytes of ``bash`` output kept (:data:`DEFAULT_BASH_OUTPUT_LIMIT`).
        sandbox: how ``bash`` commands are confined; None when no OS sandbox is available (or
            it is turned off), and then every ``bash`` command asks for permission.
        run_id: the run whose turn makes the call (None outside a run).
        publish: publishes a lossy event to the workspace's clients (``tool_output`` pieces of
            a running command); None: nothing is streamed.
        jobs: the workspace's background jobs (``bash`` with ``background``, ``job_output``,
            ``job_kill``); None: no background jobs here.
        subagent: runs the ``agent`` tool's child session; None: no sub-agents here.
        hidden: the paths the sandbox hides, which the file tools refuse and skip too (with or
            without a sandbox; :mod:`.hidden`).
        files: the files each session viewed (read-before-edit, :mod:`.tracker`); the
            workspace's one tracker, shared by all its calls.
        fetch: the bounds of ``fetch`` and the private networks it may reach
            (``options.fetch``).
        todos: where the ``todos`` tool saves the session's list (None: nowhere, the tool
            says so).
    """

    workspace: Path = attrs.field(converter=_real_path)
    data_dir: Path = attrs.field(converter=_real_path)
    session_id: str
    tool_call_id: str
    permissions: PermissionAsker
    timeout: float = DEFAULT_TOOL_TIMEOUT
    bash_output_limit: int = DEFAULT_BASH_OUTPUT_LIMIT
    sandbox: Sandbox | None = None
    run_id: str | None = None
    publish: Callable[[ToolOutput], object] | None = None
    jobs: JobManager | None = None
    subagent: SubAgentRunner | None = None
    hidden: HiddenPaths = attrs.field(factory=HiddenPaths)
    files: FileTracker = attrs.field(factory=FileTracker)
    fetch: FetchOptions = attrs.field(factory=FetchOptions)
    todos: TodoSink | None = None


def check_viewed(seen: Snapshot | None, now: Snapshot | None, shown: str, tool_name: str) -> None:
    """Read-before-edit: refuse to change an existing file unless this session viewed it
    (``seen``, from ``ctx.files``) and it is unchanged since (``now``); see :mod:`.tracker`.

    Raises:
        ToolError: never viewed in this session, or changed since.
    """
    why = refusal(seen, now, shown, tool_name)
    if why is not None:
        raise ToolError(why)


class TodoSink(Protocol):
    """Where a session's todo list is saved and published (the workspace implements it; the
    ``todos`` tool calls it)."""

    async def set_todos(self, session_id: str, todos: list[Todo]) -> Session | None:
        """Save and publish the list; the updated session, or None when it does not exist.

        Cancellation:
            ``trio.Cancelled`` propagates; the list may or may not have been saved.
        """
        ...


class Tool(Protocol):
    """A tool the model can call."""

    spec: ToolSpec

    async def run(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Run one call with already-checked ``params``.

        Expected failures (missing file, no match, denied permission) come back as error results;
        :func:`crush_trio.tools.call_tool` also turns unexpected exceptions into error results.

        Cancellation:
            Cancelling stops the work; subprocesses are ended before ``trio.Cancelled``
            propagates.
        """
        ...


class ToolBase:
    """The ``run`` of the tools of this package: ``execute``, with a :class:`ToolError` turned into
    an error result, so an expected failure can be raised from any helper and still reach the
    model as a result."""

    __slots__ = ()

    #: Whether the tool only reads (under the usual permission rule): the read-only tools are
    #: those a sub-agent (``agent``) gets. A tool without this attribute counts as not read-only.
    read_only: ClassVar[bool] = False

    async def run(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Run one call (see :meth:`Tool.run`)."""
        try:
            return await self.execute(params, ctx)
        except ToolError as exc:
            return exc.result()

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """The tool's work; raises :class:`ToolError` for a failure the model can act on."""
        raise NotImplementedError


async def ask_permission(
    ctx: ToolContext,
    *,
    tool_name: str,
    action: str,
    description: str,
    params: dict[str, Any],
    path: Path | str,
) -> None:
    """Ask ``ctx.permissions`` and raise :class:`PermissionDenied` on a denial.

    ``path`` is what the call touches: a real path, or a URL (``fetch``).

    Cancellation:
        ``trio.Cancelled`` from the asker propagates unchanged.
    """
    try:
        allowed = await ctx.permissions.request(
            session_id=ctx.session_id,
            tool_call_id=ctx.tool_call_id,
            tool_name=tool_name,
            action=action,
            description=description,
            params=params,
            path=str(path),
        )
    except TimeoutError as exc:
        raise PermissionTimedOut(
            f"permission request timed out: {exc}; {tool_name} was not run and the run was stopped"
        ) from None
    if not allowed:
        raise PermissionDenied(
            f"permission denied: the user did not allow {tool_name} to {action} {path}; "
            "do not retry this call, ask the user how to proceed"
        )


async def run_blocking(
    ctx: ToolContext, tool_name: str, fn: Any, *args: Any, abandon: bool = True
) -> Any:
    """Run blocking file-system work in a thread, bounded by ``ctx.timeout``.

    Args:
        ctx: the call's context (for the timeout).
        tool_name: named in the timeout message.
        fn: the blocking function; ``args`` are passed to it.
        abandon: leave the thread behind on cancel or timeout. True for read-only work (its
            result is simply discarded); False for writes, so a cancelled call never leaves a
            write running behind the caller's back.

    The thread comes from :func:`tool_thread_limiter`, never from the limiter the store uses.

    Raises:
        ToolError: the work took longer than ``ctx.timeout``.

    Cancellation:
        With ``abandon`` the call returns at once and the thread's result is discarded; without
        it the call waits for the (short) write to finish first.
    """
    with trio.move_on_after(ctx.timeout):
        return await trio.to_thread.run_sync(
            fn, *args, abandon_on_cancel=abandon, limiter=tool_thread_limiter()
        )
    raise ToolError(
        f"{tool_name} timed out after {ctx.timeout:g} s; narrow the path or pattern and try again"
    )
