"""The coding tools the model can call, and the one entry point the agent loop uses.

Layers, from the bottom:

* :mod:`.base` — the interface: :class:`ToolResult`, :class:`ToolContext`, :class:`Tool` and the
  :class:`PermissionAsker` the permission service implements.
* :mod:`.paths` — confinement: resolving a path and telling whether it stays in the workspace.
* :mod:`.files` and :mod:`.globs` — reading text files safely; the glob dialect.
* :mod:`.read` — ``ls``, ``view``, ``glob``; :mod:`.grep` — ``grep`` (with :mod:`.grep_worker`).
* :mod:`.write` — ``write``, and opening for writing without following symlinks;
  :mod:`.edit` — ``edit``.
* :mod:`.bash` — ``bash``, built on :mod:`.readonly` (which commands may run without asking),
  :mod:`.shell` (running a command in its own process group) and :mod:`.sandbox`.
* :mod:`.stream` — ``tool_output`` events of a running command; :mod:`.jobs` — background
  jobs (``bash`` with ``background``), read and ended by :mod:`.job_tools` (``job_output``,
  ``job_kill``); :mod:`.agent_tool` — ``agent``, a sub-agent with the read-only tools.
* this module — :func:`default_tools` and :func:`call_tool`, which parses the model's JSON input,
  checks it against the tool's parameter schema, runs the tool and turns every failure into an
  error result the model can read. See ``docs/tools.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import attrs
import orjson

from ..config import FetchOptions
from ..wire import ToolOutput
from .agent_tool import AgentTool
from .base import (
    DEFAULT_BASH_OUTPUT_LIMIT,
    DEFAULT_TOOL_TIMEOUT,
    PermissionAsker,
    PermissionDenied,
    SubAgentRunner,
    TodoSink,
    Tool,
    ToolContext,
    ToolError,
    ToolResult,
    ToolSpec,
)
from .bash import BashTool
from .edit import EditTool, MultiEditTool
from .fetch import FetchTool
from .grep import GrepTool
from .hidden import HiddenPaths
from .job_tools import JobKillTool, JobOutputTool
from .jobs import JobManager
from .mcp import McpManager
from .paths import ResolvedPath, resolve_path
from .read import GlobTool, LsTool, ViewTool
from .readonly import is_read_only
from .sandbox import Sandbox
from .stream import OutputStreamer
from .todos import TodosTool
from .tracker import FileTracker
from .write import WriteTool

__all__ = [
    "DEFAULT_BASH_OUTPUT_LIMIT",
    "DEFAULT_TOOL_TIMEOUT",
    "TOOLS_BY_NAME",
    "AgentTool",
    "BashTool",
    "EditTool",
    "FetchTool",
    "FileTracker",
    "GlobTool",
    "GrepTool",
    "JobKillTool",
    "JobManager",
    "JobOutputTool",
    "LsTool",
    "MultiEditTool",
    "OutputStreamer",
    "PermissionAsker",
    "PermissionDenied",
    "ResolvedPath",
    "TodoSink",
    "TodosTool",
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolResult",
    "ToolSpec",
    "Toolbox",
    "ViewTool",
    "WriteTool",
    "call_tool",
    "check_params",
    "default_tools",
    "is_read_only",
    "read_only_tools",
    "resolve_path",
    "tool_specs",
]

logger = logging.getLogger(__name__)


def default_tools() -> list[Tool]:
    """A fresh list of the built-in tools, in the order they are offered to the model."""
    return [
        LsTool(),
        ViewTool(),
        GlobTool(),
        GrepTool(),
        WriteTool(),
        EditTool(),
        BashTool(),
        # fetch, todos, multiedit
        FetchTool(),
        TodosTool(),
        MultiEditTool(),
        # Streamed output, background jobs and sub-agents (docs/tools.md).
        JobOutputTool(),
        JobKillTool(),
        AgentTool(),
    ]


def read_only_tools(tools: Iterable[Tool]) -> list[Tool]:
    """The tools of ``tools`` whose ``read_only`` attribute is true (what a sub-agent gets);
    a tool without the attribute is not read-only."""
    return [tool for tool in tools if getattr(tool, "read_only", False) is True]


#: The built-in tools by name (read-only mapping).
TOOLS_BY_NAME: Final[Mapping[str, Tool]] = MappingProxyType(
    {tool.spec.name: tool for tool in default_tools()}
)


def tool_specs(tools: Iterable[Tool]) -> list[ToolSpec]:
    """The specs of ``tools``, for a :class:`~crush_trio.core.model.ModelRequest`."""
    return [tool.spec for tool in tools]


_JSON_TYPE_NAMES: Final = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "a boolean",
    "object": "an object",
    "array": "an array",
}


def _json_type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _coerce(expected: str | None, value: Any) -> tuple[bool, Any]:
    """Whether ``value`` has JSON-schema type ``expected``; integral floats count as integers."""
    if expected is None:
        return True, value
    if expected == "string":
        return isinstance(value, str), value
    if expected == "boolean":
        return isinstance(value, bool), value
    if expected == "integer":
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
        return isinstance(value, int) and not isinstance(value, bool), value
    if expected == "number":
        return isinstance(value, int | float) and not isinstance(value, bool), value
    if expected == "object":
        return isinstance(value, dict), value
    if expected == "array":
        return isinstance(value, list), value
    return True, value


def check_params(spec: ToolSpec, params: dict[str, Any]) -> dict[str, Any]:
    """Check ``params`` against ``spec.parameters`` (required keys, types, minimums).

    Optional parameters given as ``null`` are dropped; unknown parameters are kept and ignored by
    the tool.

    Returns:
        The parameters to pass to the tool.

    Raises:
        ToolError: a parameter is missing or has the wrong type or value; the message names it.
    """
    schema = spec.parameters
    properties: dict[str, Any] = schema.get("properties", {})
    required: list[str] = schema.get("required", [])
    checked = {k: v for k, v in params.items() if v is not None or k in required}
    for key in required:
        if key not in checked:
            names = ", ".join(properties) or "none"
            raise ToolError(
                f"missing required parameter '{key}' for tool {spec.name} (its parameters: {names})"
            )
    for key, value in list(checked.items()):
        prop = properties.get(key)
        if prop is None:
            continue
        expected = prop.get("type")
        ok, value = _coerce(expected, value)
        if not ok:
            raise ToolError(
                f"parameter '{key}' of tool {spec.name} must be "
                f"{_JSON_TYPE_NAMES.get(expected, expected)}, got {_json_type_of(value)}"
            )
        minimum = prop.get("minimum")
        if minimum is not None and value < minimum:
            raise ToolError(
                f"parameter '{key}' of tool {spec.name} must be at least {minimum}, got {value}"
            )
        above = prop.get("exclusiveMinimum")
        if above is not None and value <= above:
            raise ToolError(
                f"parameter '{key}' of tool {spec.name} must be more than {above}, got {value}"
            )
        checked[key] = value
    return checked


async def call_tool(
    tools: Iterable[Tool] | Mapping[str, Tool],
    name: str,
    input_json: str,
    ctx: ToolContext,
) -> ToolResult:
    """Run the tool call ``name(input_json)`` and return its result; never raises an error.

    Args:
        tools: the tools on offer, as a list or by name.
        name: the tool the model called.
        input_json: the model's arguments as JSON text (empty text means ``{}``).
        ctx: the call's context.

    Returns:
        The tool's result, or an error result for an unknown tool, invalid JSON, a missing or
        wrongly typed parameter, or an exception inside the tool. A denied permission gives an
        error result with ``stop_turn`` set.

    Cancellation:
        ``trio.Cancelled`` (and any other ``BaseException``) propagates; the tool has ended its
        subprocesses by then.
    """
    by_name = tools if isinstance(tools, Mapping) else {tool.spec.name: tool for tool in tools}
    tool = by_name.get(name)
    if tool is None:
        available = ", ".join(sorted(by_name)) or "none"
        return ToolResult(
            content=f"unknown tool {name!r}; the available tools are: {available}", is_error=True
        )
    try:
        params = orjson.loads(input_json.strip() or "{}")
    except orjson.JSONDecodeError as exc:
        return ToolResult(content=f"invalid JSON input for tool {name}: {exc}", is_error=True)
    if not isinstance(params, dict):
        return ToolResult(
            content=f"input for tool {name} must be a JSON object, got {_json_type_of(params)}",
            is_error=True,
        )
    try:
        checked = check_params(tool.spec, params)
        return await tool.run(checked, ctx)
    except ToolError as exc:
        return exc.result()
    except Exception as exc:
        logger.exception(
            "tool %s failed (session %s, call %s)", name, ctx.session_id, ctx.tool_call_id
        )
        return ToolResult(content=f"tool {name} failed: {type(exc).__name__}: {exc}", is_error=True)


@attrs.define
class Toolbox:
    """The tools of one workspace, bound to its paths, permissions and limits.

    This is the object the agent loop holds: :meth:`specs` for the model request and :meth:`call`
    for each tool call.

    Attributes:
        workspace: the workspace directory.
        data_dir: the server's data directory.
        permissions: asks the workspace's clients.
        tools: the tools on offer (default: :func:`default_tools`).
        timeout: the tool timeout in seconds.
        bash_output_limit: bytes of ``bash`` output kept.
        sandbox: the OS sandbox ``bash`` runs in; None: none, every ``bash`` command asks.
    """

    workspace: Path
    data_dir: Path
    permissions: PermissionAsker
    tools: list[Tool] = attrs.field(factory=default_tools)
    timeout: float = DEFAULT_TOOL_TIMEOUT
    bash_output_limit: int = DEFAULT_BASH_OUTPUT_LIMIT
    sandbox: Sandbox | None = None
    #: The paths the sandbox hides, which the file tools refuse and skip too (:mod:`.hidden`).
    hidden: HiddenPaths = attrs.field(factory=HiddenPaths)
    #: The workspace's MCP servers; the tools of those connected join :attr:`tools` at each
    #: model step (docs/mcp.md).
    mcp: McpManager | None = None
    #: Publishes lossy events (``tool_output``) to the workspace's clients; None: not streamed.
    publish: Callable[[ToolOutput], object] | None = None
    #: The workspace's background jobs; None: ``bash`` cannot start any.
    jobs: JobManager | None = None
    #: Runs ``agent`` calls (the agent loop sets it); None: no sub-agents.
    subagent: SubAgentRunner | None = None

    def read_only(self) -> Toolbox:
        """This toolbox with only the read-only tools (no MCP tools, jobs or sub-agents): a
        sub-agent's."""
        return attrs.evolve(
            self, tools=read_only_tools(self.tools), mcp=None, jobs=None, subagent=None
        )

    #: The files each session viewed (read-before-edit); the workspace passes its own so that
    #: a toolbox rebuilt after a config change keeps it.
    files: FileTracker = attrs.field(factory=FileTracker)
    #: ``options.fetch``: the bounds of ``fetch`` and the private networks it may reach.
    fetch: FetchOptions = attrs.field(factory=FetchOptions)
    #: Where ``todos`` saves and publishes a session's list (the workspace).
    todos: TodoSink | None = None

    def offered(self) -> list[Tool]:
        """The tools on offer now: the built-in ones, then those of connected MCP servers."""
        if self.mcp is None:
            return self.tools
        return [*self.tools, *self.mcp.tools()]

    def specs(self) -> list[ToolSpec]:
        """The specs of the tools, for the model request."""
        return tool_specs(self.offered())

    async def call(
        self,
        name: str,
        input_json: str,
        *,
        session_id: str,
        tool_call_id: str,
        run_id: str | None = None,
    ) -> ToolResult:
        """Run one tool call (see :func:`call_tool`).

        Cancellation:
            ``trio.Cancelled`` propagates after the tool has ended its subprocesses.
        """
        ctx = ToolContext(
            workspace=self.workspace,
            data_dir=self.data_dir,
            session_id=session_id,
            tool_call_id=tool_call_id,
            permissions=self.permissions,
            timeout=self.timeout,
            bash_output_limit=self.bash_output_limit,
            sandbox=self.sandbox,
            run_id=run_id,
            publish=self.publish,
            jobs=self.jobs,
            subagent=self.subagent,
            hidden=self.hidden,
            files=self.files,
            fetch=self.fetch,
            todos=self.todos,
        )
        return await call_tool(self.offered(), name, input_json, ctx)
