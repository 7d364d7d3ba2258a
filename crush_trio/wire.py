"""Wire types and the one configured converter.

Every object that crosses the wire (PROTOCOL §4) or comes from a request body is an attrs class
here, and every conversion goes through :data:`converter`, a cattrs orjson converter configured to
be strict about primitive types (``"5"`` is not an int, ``5`` is not a str) so that a wrong type
is a 400 naming the JSON path, never a silent coercion.

Message parts are stored and sent as ``{"type": ..., "data": {...}}`` wrappers, the same shape on
the wire and in the database.
"""

from __future__ import annotations

import base64
import enum
import time
import uuid
from typing import Any, Final, Literal, TypeVar

import attrs
import cattrs
import cattrs.gen
import orjson
from cattrs.preconf.orjson import make_converter

from .errors import BadRequest, IllegalTransition

T = TypeVar("T")

#: Longest client-chosen ``run_id`` (PROTOCOL §2).
MAX_RUN_ID_LENGTH: Final = 128


def now() -> int:
    """Current time as integer Unix seconds, the wire's time format."""
    return int(time.time())


#: The path prefix of every route of one workspace.
WORKSPACE_ROUTES: Final = "/v1/workspaces/"


def workspace_id_of(path: str) -> str | None:
    """The workspace id in a ``/v1/workspaces/{wid}...`` request path, else None."""
    if not path.startswith(WORKSPACE_ROUTES):
        return None
    return path[len(WORKSPACE_ROUTES) :].split("/", 1)[0] or None


def new_id() -> str:
    """A new server-made id (a UUID string)."""
    return str(uuid.uuid4())


# ---------------------------------------------------------------------------------------------
# Message parts


@attrs.define
class TextPart:
    text: str = ""


@attrs.define
class ReasoningPart:
    thinking: str = ""
    signature: str = ""
    started_at: int = 0
    finished_at: int = 0


@attrs.define
class ToolCallPart:
    id: str
    name: str
    input: str = ""
    finished: bool = False


@attrs.define
class ToolResultPart:
    tool_call_id: str
    name: str
    content: str
    is_error: bool = False


class FinishReason(enum.StrEnum):
    END_TURN = "end_turn"
    MAX_TOKENS = "max_tokens"
    TOOL_USE = "tool_use"
    CANCELED = "canceled"
    ERROR = "error"


@attrs.define
class FinishPart:
    reason: FinishReason
    time: int = attrs.field(factory=now)
    message: str = ""
    details: str = ""


@attrs.define
class BinaryPart:
    """A file attached to a user message (Crush's ``binary`` part): ``data`` is base64."""

    path: str
    mime_type: str
    data: str = ""

    def content(self) -> bytes:
        return base64.b64decode(self.data)


Part = TextPart | ReasoningPart | ToolCallPart | ToolResultPart | FinishPart | BinaryPart

PART_TAGS: Final[dict[type[Any], str]] = {
    TextPart: "text",
    ReasoningPart: "reasoning",
    ToolCallPart: "tool_call",
    ToolResultPart: "tool_result",
    FinishPart: "finish",
    BinaryPart: "binary",
}
PART_TYPES: Final[dict[str, type[Any]]] = {tag: cls for cls, tag in PART_TAGS.items()}


class Role(enum.StrEnum):
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"
    SYSTEM = "system"


# ---------------------------------------------------------------------------------------------
# Objects (PROTOCOL §4)


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


@attrs.define
class Message:
    id: str
    session_id: str
    role: Role
    parts: list[Part] = attrs.field(factory=list)
    model: str = ""
    provider: str = ""
    created_at: int = attrs.field(factory=now)
    updated_at: int = attrs.field(factory=now)
    #: A summary of the conversation before it (``sessions/{sid}/summarize``, auto-compaction).
    is_summary_message: bool = False

    def text(self) -> str:
        """The concatenated text parts: what a reader sees as the reply."""
        return "".join(p.text for p in self.parts if isinstance(p, TextPart))

    def finish(self) -> FinishPart | None:
        for part in self.parts:
            if isinstance(part, FinishPart):
                return part
        return None

    def tool_calls(self) -> list[ToolCallPart]:
        return [p for p in self.parts if isinstance(p, ToolCallPart)]


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
class RevertRequest:
    """``POST .../runs/{id}/revert``: ``force`` overwrites files changed after the run."""

    force: bool = False


@attrs.define
class ForkRequest:
    """``POST .../sessions/{sid}/fork``: the history up to ``message_id`` (inclusive);
    ``revert_files`` also reverts the files the later runs of the session changed."""

    message_id: str
    revert_files: bool = False


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


# ---------------------------------------------------------------------------------------------
# Request bodies


@attrs.define
class CreateWorkspaceRequest:
    path: str
    client_id: str


@attrs.define
class CreateSessionRequest:
    title: str = ""


@attrs.define
class UpdateSessionRequest:
    title: str


@attrs.define
class Attachment:
    """A file sent with a prompt (Crush's ``message.Attachment``): ``content`` is base64."""

    file_name: str = ""
    mime_type: str = ""
    content: str = ""
    file_path: str = ""


@attrs.define
class AgentMessage:
    session_id: str
    prompt: str
    run_id: str | None = None
    #: The model for this prompt, ``provider/model`` (or a model id that one provider lists);
    #: ``None`` uses ``models.large``.
    model: str | None = None
    attachments: list[Attachment] = attrs.field(factory=list)


@attrs.define
class SessionRef:
    session_id: str


@attrs.define
class RunRef:
    run_id: str


@attrs.define
class PermissionRef:
    id: str


@attrs.define
class GrantRequest:
    permission: PermissionRef
    action: Literal["allow", "allow_session", "deny"]


@attrs.define
class SkipRequest:
    skip: bool


@attrs.define
class TrustRequest:
    """``POST /v1/workspaces/{wid}/trust``: trust the workspace's own config files, or stop."""

    trusted: bool = True


@attrs.define
class TrustResult:
    """The answer of ``POST /v1/workspaces/{wid}/trust``."""

    #: The workspace after the change (its ``trusted`` and ``warnings`` reloaded).
    workspace: Workspace
    #: The user config file that holds ``trusted_workspaces``.
    file: str
    #: Whether the file changed (False: it already said so).
    changed: bool
    #: Entries that still trust the workspace (its parents) after ``"trusted": false``.
    still_trusted_by: list[str] = attrs.field(factory=list)


@attrs.define
class HistoryFile:
    """One version of a file a session changed (Crush's ``proto.File``)."""

    id: str
    session_id: str
    path: str
    content: str = ""
    version: int = 0
    created_at: int = 0
    updated_at: int = 0


@attrs.define
class AgentInitRequest:
    """``POST .../agent/init``: Crush's client says whether a person is at the terminal."""

    interactive: bool = False


@attrs.define
class CurrentSessionRequest:
    """``POST .../current-session``: the session a client shows (``""``: none)."""

    session_id: str = ""


@attrs.define
class SelectModelRequest:
    """``POST .../config/model``: use ``model`` for the ``large`` or ``small`` role.

    ``scope`` is Crush's ``config.Scope`` (a number: 0 global, 1 workspace); both apply to this
    workspace until it closes, and nothing is written to a file.
    """

    model_type: Literal["large", "small"]
    model: ModelChoice
    scope: int = 1


@attrs.define
class SkipState:
    """``GET .../permissions/skip``: whether every permission request is approved."""

    skip: bool


@attrs.define
class NeedsInit:
    """``GET .../project/needs-init``."""

    needs_init: bool = False


@attrs.define
class ControlRequest:
    command: Literal["shutdown", "shutdown_if_idle"]


@attrs.define
class WsCommand:
    method: str
    id: Any = None
    params: dict[str, Any] = attrs.field(factory=dict)


# ---------------------------------------------------------------------------------------------
# Events (PROTOCOL §5)


class DeltaPartType(enum.StrEnum):
    """The part a :class:`MessageDelta` appends to, and which of its fields grows."""

    TEXT = "text"  # TextPart.text
    REASONING = "reasoning"  # ReasoningPart.thinking
    TOOL_CALL = "tool_call"  # ToolCallPart.input


@attrs.define
class MessageDelta:
    """An append to one part of a streaming message (the ``message_delta`` event, PROTOCOL §6).

    ``offset`` is the length of the part's field before this append, in Unicode code points
    (``len(str)``). A delta whose ``part`` equals the number of parts creates the part
    (``offset`` 0); one that creates a tool call part carries ``tool_call_id`` and ``tool_name``.
    """

    message_id: str
    session_id: str
    part: int = attrs.field(validator=attrs.validators.ge(0))
    part_type: DeltaPartType
    offset: int = attrs.field(validator=attrs.validators.ge(0))
    text: str
    tool_call_id: str = ""
    tool_name: str = ""


def _delta_field(part: Part, part_type: DeltaPartType) -> str | None:
    if part_type == DeltaPartType.TEXT and isinstance(part, TextPart):
        return "text"
    if part_type == DeltaPartType.REASONING and isinstance(part, ReasoningPart):
        return "thinking"
    if part_type == DeltaPartType.TOOL_CALL and isinstance(part, ToolCallPart):
        return "input"
    return None


def apply_delta(message: Message, delta: MessageDelta) -> bool:
    """Apply ``delta`` to ``message`` in place, as a client does.

    Returns False when the message lacks text before the delta (``offset`` beyond the part's
    length, a part index beyond the next new one, or a part of another type): the caller re-reads
    the message. Text the message already holds is skipped (``offset`` below its length).
    """
    parts = message.parts
    if delta.part == len(parts):
        if delta.offset != 0:
            return False
        new: Part
        if delta.part_type == DeltaPartType.TEXT:
            new = TextPart("")
        elif delta.part_type == DeltaPartType.REASONING:
            new = ReasoningPart()
        else:
            new = ToolCallPart(delta.tool_call_id, delta.tool_name)
        parts.append(new)
    elif not 0 <= delta.part < len(parts):
        return False
    part = parts[delta.part]
    field = _delta_field(part, delta.part_type)
    if field is None:
        return False
    have: str = getattr(part, field)
    if delta.offset > len(have):
        return False
    setattr(part, field, have + delta.text[len(have) - delta.offset :])
    return True


@attrs.define
class ToolOutput:
    """A piece of the output of a running ``bash`` command or background job (the lossy
    ``tool_output`` event, docs/protocol.md §6.2).

    ``offset`` is the number of output bytes before ``text`` (the stream position, counted in
    bytes of the command's output); ``dropped`` is how many bytes right after ``text`` were not
    published because the stream's rate bound was reached (the next piece's ``offset`` is past
    them). A client that missed pieces (a ``gap``, a
    ``dropped`` count, an ``offset`` past what it has) reads the tool result once it is final,
    or the job's output with ``job_output``. ``done`` marks the last piece of a background job
    (with its ``exit_code``); a foreground command's end is its tool result message.
    """

    session_id: str
    tool_call_id: str
    offset: int
    text: str
    run_id: str | None = None
    job_id: str | None = None
    dropped: int = 0
    done: bool = False
    exit_code: int | None = None


class EventKind(enum.StrEnum):
    """The inner ``payload.type`` of an envelope."""

    CREATED = "created"
    UPDATED = "updated"
    DELETED = "deleted"


class PayloadType(enum.StrEnum):
    SESSION = "session"
    MESSAGE = "message"
    MESSAGE_DELTA = "message_delta"
    AGENT_EVENT = "agent_event"
    RUN_COMPLETE = "run_complete"
    PERMISSION_REQUEST = "permission_request"
    PERMISSION_NOTIFICATION = "permission_notification"
    TOOL_OUTPUT = "tool_output"
    FILES_CHANGED = "files_changed"

    @property
    def must_deliver(self) -> bool:
        return self in MUST_DELIVER


MUST_DELIVER: Final = frozenset(
    {
        PayloadType.RUN_COMPLETE,
        PayloadType.PERMISSION_REQUEST,
        PayloadType.PERMISSION_NOTIFICATION,
    }
)

PAYLOAD_TYPES: Final[dict[type[Any], PayloadType]] = {
    Session: PayloadType.SESSION,
    Message: PayloadType.MESSAGE,
    MessageDelta: PayloadType.MESSAGE_DELTA,
    AgentEvent: PayloadType.AGENT_EVENT,
    RunComplete: PayloadType.RUN_COMPLETE,
    PermissionRequest: PayloadType.PERMISSION_REQUEST,
    PermissionNotification: PayloadType.PERMISSION_NOTIFICATION,
    ToolOutput: PayloadType.TOOL_OUTPUT,
    FilesChanged: PayloadType.FILES_CHANGED,
}


# ---------------------------------------------------------------------------------------------
# The converter


def _strict(kind: type[Any], *, exclude: tuple[type[Any], ...] = ()) -> Any:
    def structure(value: Any, _: Any) -> Any:
        if not isinstance(value, kind) or isinstance(value, exclude):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    return structure


def _structure_float(value: Any, _: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected number, got {type(value).__name__}")
    return float(value)


def _structure_enum(value: Any, cls: type[enum.Enum]) -> Any:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{value!r} is not one of {allowed}") from None


def _make_converter() -> cattrs.Converter:
    conv = make_converter(forbid_extra_keys=False)
    conv.register_structure_hook(str, _strict(str))
    conv.register_structure_hook(int, _strict(int, exclude=(bool,)))
    conv.register_structure_hook(bool, _strict(bool))
    conv.register_structure_hook(float, _structure_float)
    # Our enums subclass str; name each one so the strict str hook above does not take them.
    for enum_cls in (
        FinishReason,
        Role,
        RunStatus,
        DeltaPartType,
        EventKind,
        PayloadType,
        McpState,
        JobState,
        TodoStatus,
    ):
        conv.register_structure_hook(enum_cls, _structure_enum)

    def unstructure_part(part: Any) -> dict[str, Any]:
        return {"type": PART_TAGS[type(part)], "data": conv.unstructure(part, type(part))}

    def structure_part(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise TypeError(f"expected a part object, got {type(value).__name__}")
        tag = value.get("type")
        cls = PART_TYPES.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise ValueError(f"unknown part type {tag!r}; expected one of {sorted(PART_TYPES)}")
        return conv.structure(value.get("data") or {}, cls)

    for cls in PART_TAGS:
        conv.register_unstructure_hook(cls, _attrs_unstructure(conv, cls))
    # ``progress`` and ``done`` belong to ``summarize`` events only, ``mcp`` to ``mcp`` events:
    # each is left out of the other events.
    from cattrs.gen import make_dict_unstructure_fn, override

    conv.register_unstructure_hook(
        AgentEvent,
        make_dict_unstructure_fn(
            AgentEvent,
            conv,
            progress=override(omit_if_default=True),
            done=override(omit_if_default=True),
            mcp=override(omit_if_default=True),
        ),
    )
    # A delta that does not create a tool call part leaves these two out (PROTOCOL §6.6): every
    # delta would otherwise carry them empty. A missing key structures as "".
    conv.register_unstructure_hook(
        MessageDelta,
        make_dict_unstructure_fn(
            MessageDelta,
            conv,
            tool_call_id=override(omit_if_default=True),
            tool_name=override(omit_if_default=True),
        ),
    )
    # A job's last piece says so with its exit code; other pieces leave both out.
    conv.register_unstructure_hook(
        ToolOutput,
        make_dict_unstructure_fn(
            ToolOutput,
            conv,
            job_id=override(omit_if_default=True),
            dropped=override(omit_if_default=True),
            done=override(omit_if_default=True),
            exit_code=override(omit_if_default=True),
        ),
    )
    conv.register_unstructure_hook_func(
        lambda t: t is Part,
        lambda part: unstructure_part(part),  # type: ignore[comparison-overlap]
    )
    conv.register_structure_hook_func(
        lambda t: t is Part,  # type: ignore[comparison-overlap]
        structure_part,
    )
    return conv


def _attrs_unstructure(conv: cattrs.Converter, cls: type[Any]) -> Any:
    from cattrs.gen import make_dict_unstructure_fn

    return make_dict_unstructure_fn(cls, conv)


converter: Final = _make_converter()


def dumps(obj: Any) -> bytes:
    """Encode a wire object (or plain data) as JSON bytes."""
    return orjson.dumps(converter.unstructure(obj))


def unstructure(obj: Any) -> Any:
    """A wire object as plain JSON-ready data (the one converter's view of it)."""
    return converter.unstructure(obj)


def parts_to_json(parts: list[Part]) -> str:
    return orjson.dumps([converter.unstructure(p, Part) for p in parts]).decode()


def parts_from_json(raw: str) -> list[Part]:
    return converter.structure(orjson.loads(raw), list[Part])


def todos_to_json(todos: list[Todo]) -> str:
    return orjson.dumps([converter.unstructure(t, Todo) for t in todos]).decode()


def todos_from_json(raw: str) -> list[Todo]:
    return converter.structure(orjson.loads(raw), list[Todo])


def describe_error(exc: BaseException, root: str = "$") -> str:
    """Turn a cattrs structuring error into ``$.path: problem`` lines."""
    if isinstance(exc, (cattrs.ClassValidationError, cattrs.IterableValidationError)):
        messages = cattrs.transform_error(exc, path=root, format_exception=_format_exception)
        return "; ".join(messages)
    return f"{root}: {exc}"


def _format_exception(exc: BaseException, type_: Any) -> str:
    """cattrs' wording, except that a validator's own message (which names the field and the
    rule, such as ``'offset' must be >= 0: -3``) is kept instead of a bare "invalid value"."""
    if type(exc) is ValueError and exc.args:
        return f"invalid value ({exc})"
    return cattrs.v.format_exception(exc, type_)


def structure(data: Any, cls: type[T], *, what: str = "request body") -> T:
    """Structure ``data`` into ``cls``, raising :class:`BadRequest` with JSON paths on failure."""
    if not isinstance(data, dict) and attrs.has(cls):
        raise BadRequest(
            f"{what} must be a JSON object, got {type(data).__name__}; "
            "send a JSON object as described in docs/protocol.md"
        )
    try:
        return converter.structure(data, cls)
    except Exception as exc:
        raise BadRequest(f"invalid {what}: {describe_error(exc)}") from None


def loads_body(raw: bytes | str, cls: type[T], *, what: str = "request body") -> T:
    """Parse JSON text and structure it, with 400-class errors that say what to fix."""
    try:
        data = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"{what} is not valid JSON ({exc}); send a JSON object") from None
    return structure(data, cls, what=what)


def validate_client_id(value: str | None) -> str:
    """``client_id`` must be a UUID (PROTOCOL §2)."""
    if not value:
        raise BadRequest("client_id is required: pass a UUID as ?client_id= (or in the body)")
    try:
        uuid.UUID(value)
    except ValueError:
        raise BadRequest(f"client_id {value!r} is not a UUID; generate one with uuid4") from None
    return value


def validate_run_id(value: str | None) -> str | None:
    if value is None:
        return None
    if not value or len(value) > MAX_RUN_ID_LENGTH:
        raise BadRequest(
            f"run_id must be a non-empty string of at most {MAX_RUN_ID_LENGTH} characters"
        )
    return value
