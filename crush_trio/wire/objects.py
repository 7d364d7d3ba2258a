"""The objects of the API (PROTOCOL §4) besides messages: workspaces and their config, sessions
and todos, runs and the changes they made, the agent's info and notices, permission requests."""

from __future__ import annotations

import enum
from typing import Any, Final, Literal

import attrs

from ..errors import IllegalTransition
from .ids import now
from .messages import Message


@attrs.define
class CatalogModel:
    """One model a provider offers, in the shape of Crush's model catalog (``catwalk.Model``).

    Prices are dollars per million tokens; ``0`` means unknown (or free). ``context_window`` and
    ``default_max_tokens`` of ``0`` mean the server's defaults apply.
    """

    id: str
    name: str = ""
    cost_per_1m_in: float = 0.0
    cost_per_1m_out: float = 0.0
    cost_per_1m_in_cached: float = 0.0
    cost_per_1m_out_cached: float = 0.0
    context_window: int = 0
    default_max_tokens: int = 0


@attrs.define
class CatalogProvider:
    """A provider and its models, as ``GET .../providers`` lists them (Crush's
    ``catwalk.Provider``). No key or header is ever part of it."""

    id: str
    name: str
    type: str
    api_endpoint: str = ""
    default_large_model_id: str = ""
    default_small_model_id: str = ""
    models: list[CatalogModel] = attrs.field(factory=list)


@attrs.define
class ModelChoice:
    """A provider and one of its models (Crush's ``config.SelectedModel``)."""

    provider: str
    model: str


@attrs.define
class ConfigProvider:
    """A provider in a workspace's ``config`` (Crush's ``config.ProviderConfig``), never with
    its key or headers."""

    id: str
    name: str
    type: str
    base_url: str = ""
    models: list[CatalogModel] = attrs.field(factory=list)


@attrs.define
class TuiOptions:
    """``options.tui``: present (and empty) because Crush's terminal client reads it."""


@attrs.define
class ConfigOptions:
    """``options`` of a workspace's ``config``: the settings a client may show."""

    data_directory: str = ""
    context_paths: list[str] = attrs.field(factory=list)
    disable_auto_summarize: bool = False
    tui: TuiOptions = attrs.field(factory=TuiOptions)


@attrs.define
class ConfigPermissions:
    """``permissions`` of a workspace's ``config``: the tools that never ask."""

    allowed_tools: list[str] = attrs.field(factory=list)


@attrs.define
class WorkspaceConfig:
    """The configuration a workspace uses, in Crush's ``config.Config`` shape (the parts a
    client reads): the usable providers with their models, the models chosen for the ``large``
    and ``small`` roles, options and permissions. No key, header or environment value."""

    models: dict[str, ModelChoice] = attrs.field(factory=dict)
    providers: dict[str, ConfigProvider] = attrs.field(factory=dict)
    options: ConfigOptions = attrs.field(factory=ConfigOptions)
    permissions: ConfigPermissions = attrs.field(factory=ConfigPermissions)


@attrs.define
class Workspace:
    id: str
    path: str
    data_dir: str
    #: The workspace's own config files are applied in full (``trusted_workspaces``).
    trusted: bool = False
    #: Config keys ignored (untrusted workspace, unknown key) and other config warnings.
    warnings: list[str] = attrs.field(factory=list)
    #: The configuration in use, in Crush's shape (``None`` only while it cannot be told).
    config: WorkspaceConfig | None = None


class TodoStatus(enum.StrEnum):
    """Where one item of a session's todo list stands (Crush's and OpenCode's values)."""

    PENDING = "pending"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"


@attrs.define
class Todo:
    """One item of a session's todo list, as the model wrote it with the ``todos`` tool (Crush's
    shape: ``content`` in the imperative, ``active_form`` in the present continuous)."""

    content: str
    status: TodoStatus = TodoStatus.PENDING
    active_form: str = ""


@attrs.define
class Session:
    id: str
    title: str = ""
    parent_session_id: str | None = None
    message_count: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0
    created_at: int = attrs.field(factory=now)
    updated_at: int = attrs.field(factory=now)
    is_busy: bool = False
    #: The summary message later model requests start from (``None``: the whole history).
    summary_message_id: str | None = None
    #: The session's todo list (the ``todos`` tool), in the model's order.
    todos: list[Todo] = attrs.field(factory=list)


class RunStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED)


#: Allowed run status moves; anything else is a bug (see :func:`check_run_transition`).
RUN_TRANSITIONS: Final[dict[RunStatus, frozenset[RunStatus]]] = {
    RunStatus.QUEUED: frozenset(
        {RunStatus.RUNNING, RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED}
    ),
    RunStatus.RUNNING: frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED}),
    RunStatus.COMPLETED: frozenset(),
    RunStatus.FAILED: frozenset(),
    RunStatus.CANCELLED: frozenset(),
}


def check_run_transition(run_id: str, old: RunStatus, new: RunStatus) -> None:
    if new not in RUN_TRANSITIONS[old]:
        raise IllegalTransition(f"run {run_id!r} cannot move from {old.value} to {new.value}")


@attrs.define
class FileChange:
    """One file a run (or a revert) changed: ``status`` is ``added``, ``modified`` or ``deleted``;
    ``binary`` files have no line counts (docs/protocol.md "Changes")."""

    path: str
    status: str
    added: int = 0
    removed: int = 0
    binary: bool = False


@attrs.define
class Run:
    run_id: str
    session_id: str
    status: RunStatus = RunStatus.QUEUED
    message_id: str | None = None
    text: str = ""
    error: str | None = None
    created_at: int = attrs.field(factory=now)
    finished_at: int | None = None
    #: The files the run changed (from its change record; empty while it runs).
    files: list[FileChange] = attrs.field(factory=list)


@attrs.define
class RunComplete:
    session_id: str
    run_id: str
    message_id: str | None = None
    text: str = ""
    error: str | None = None
    cancelled: bool = False


class McpState(enum.StrEnum):
    """Where one MCP server is (docs/mcp.md); the moves are in :mod:`crush_trio.tools.mcp`."""

    DISABLED = "disabled"
    STARTING = "starting"
    CONNECTED = "connected"
    FAILED = "failed"
    STOPPED = "stopped"


@attrs.define
class FilesChanged:
    """Lossy event after a tool call that changed files in the workspace."""

    session_id: str
    run_id: str
    tool_call_id: str = ""
    tool_name: str = ""
    files: list[FileChange] = attrs.field(factory=list)
    truncated: bool = False


@attrs.define
class Diff:
    """``GET .../diff``: the files changed and the unified diff (``truncated``: cut to the
    bounds :data:`crush_trio.changes.service.MAX_DIFF_FILES` / ``MAX_DIFF_BYTES``)."""

    files: list[FileChange]
    diff: str
    truncated: bool = False
    run_id: str | None = None
    session_id: str | None = None


@attrs.define
class RevertFile:
    """One file of a revert: ``outcome`` is ``new`` (restored), ``old`` (left as it was, the
    revert stopped before it) or ``other`` (neither: changed meanwhile)."""

    path: str
    status: str
    outcome: str = ""


@attrs.define
class RevertResult:
    """``POST .../runs/{id}/revert``: ``state`` is ``done``, ``failed`` or (after a restart)
    ``interrupted``; ``revert_id`` is the revert's own record (revert it to undo the revert)."""

    revert_id: str
    run_id: str
    session_id: str
    state: str
    forced: bool
    files: list[RevertFile]
    conflicts: list[str] = attrs.field(factory=list)
    error: str = ""
    created_at: int = 0
    finished_at: int | None = None


@attrs.define
class ForkResult:
    """``POST .../fork``: the new session, the messages copied and the reverts made."""

    session: Session
    messages: int
    reverts: list[RevertResult] = attrs.field(factory=list)


@attrs.define
class McpServerInfo:
    """One MCP server in the agent info and in ``mcp`` agent events.

    ``tools`` are the names offered to the model (``mcp_<server>_<tool>``); ``error`` says why a
    ``failed`` server failed (it did not start, or it died later).
    """

    name: str
    type: str = "stdio"
    state: McpState = McpState.STARTING
    error: str = ""
    tools: list[str] = attrs.field(factory=list)


@attrs.define
class AgentEvent:
    """A notice of the agent: ``error``, ``retry``, ``summarize`` or ``mcp`` (``type``).

    ``text`` says what happened for a person to read. ``message`` is a message object or ``null``
    (PROTOCOL §5 names the key; Crush's clients decode it as a message, and a string there made
    them drop the whole event): this server sends ``null``, and its text is in ``text``.
    """

    type: str
    session_id: str | None = None
    run_id: str | None = None
    text: str = ""
    error: str = ""
    message: Message | None = None
    #: ``summarize`` events: what the summary is doing now (``starting``, ``generating``, ...).
    progress: str | None = None
    #: ``summarize`` events: the summary ended (stored, failed or cancelled).
    done: bool | None = None
    #: Only on ``mcp`` events (left out of the JSON otherwise): the server whose state changed.
    mcp: McpServerInfo | None = None


@attrs.define
class PermissionRequest:
    id: str
    session_id: str
    tool_call_id: str
    tool_name: str
    description: str = ""
    action: str = ""
    params: dict[str, Any] = attrs.field(factory=dict)
    path: str = ""


@attrs.define
class PermissionNotification:
    tool_call_id: str
    granted: bool = False
    denied: bool = False
    id: str = ""


@attrs.define
class SandboxInfo:
    """Whether ``bash`` commands run in the OS sandbox (docs/tools.md, Security model).

    ``active`` false means every ``bash`` command asks for permission; ``reason`` says why there
    is no sandbox. ``network`` is whether sandboxed commands get the network without asking.
    """

    active: bool = False
    network: bool = False
    reason: str = ""


class JobState(enum.StrEnum):
    """Where a background job is (docs/tools.md, ``bash`` with ``background``)."""

    RUNNING = "running"
    EXITED = "exited"
    KILLED = "killed"


@attrs.define
class JobInfo:
    """One background job in the agent info (``GET .../agent``, field ``jobs``).

    ``exit_code`` is the shell's status once the job exited (negative: a signal); ``output_bytes``
    counts every byte it wrote, ``unread_bytes`` those ``job_output`` has not returned yet (the
    buffer keeps at most ``options.jobs.buffer_bytes`` of them).
    """

    id: str
    command: str
    session_id: str
    run_id: str | None = None
    tool_call_id: str = ""
    state: JobState = JobState.RUNNING
    exit_code: int | None = None
    started_at: int = attrs.field(factory=now)
    output_bytes: int = 0
    unread_bytes: int = 0


@attrs.define
class ContextFileInfo:
    """A project context file in the system prompt: its path (relative to the workspace when
    inside it), its size on disk in bytes, and whether it was cut at a bound."""

    path: str
    bytes: int
    truncated: bool = False


@attrs.define
class SkippedContextFile:
    """A context file left out of the system prompt, and why."""

    path: str
    reason: str


@attrs.define
class ContextFilesInfo:
    """The project context files of the system prompt (docs/providers.md)."""

    loaded: list[ContextFileInfo] = attrs.field(factory=list)
    skipped: list[SkippedContextFile] = attrs.field(factory=list)


@attrs.define
class AgentInfo:
    is_busy: bool
    is_ready: bool
    #: The ``large`` model: ``provider``, ``type`` and ``model`` (its id), plus Crush's catalog
    #: fields (``id``, ``name``, ``context_window``, ``default_max_tokens``, prices).
    model: dict[str, Any]
    #: The ``large`` model as Crush's ``model_cfg`` names it.
    model_cfg: ModelChoice | None = None
    sandbox: SandboxInfo = attrs.field(factory=SandboxInfo)
    #: The workspace's MCP servers, by name order (docs/mcp.md).
    mcp: list[McpServerInfo] = attrs.field(factory=list)
    #: The workspace's background jobs, oldest first (running ones and the last ended ones).
    jobs: list[JobInfo] = attrs.field(factory=list)
    #: The project context files in the system prompt, as the last turn read them.
    context_files: ContextFilesInfo = attrs.field(factory=ContextFilesInfo)


@attrs.define
class AcceptedPrompt:
    run_id: str
    session_id: str
    status: Literal["running", "queued"]
