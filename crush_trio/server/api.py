"""Operations of the ``/v1`` API, shared by the HTTP routes and the websocket commands.

Each operation takes already-parsed input and returns a wire object (or plain JSON data); errors
are :class:`~crush_trio.errors.CrushError` subclasses that both transports map to the same status.
The operations of a workspace's configuration and models need the workspace alone, so they are
plain functions here; the rest are :class:`Api`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from ..attachments import check_attachments
from ..backend import catalog
from ..errors import BadRequest, Conflict, NotFound
from ..wire import (
    AcceptedPrompt,
    AgentInfo,
    AgentInitRequest,
    AgentMessage,
    BinaryPart,
    CatalogProvider,
    CreateSessionRequest,
    CurrentSessionRequest,
    GrantRequest,
    HistoryFile,
    Message,
    ModelChoice,
    Role,
    Run,
    SelectModelRequest,
    Session,
    SkipRequest,
    SkipState,
    TrustRequest,
    TrustResult,
    WorkspaceConfig,
    workspace_id_of,
)
from .security import request_target

if TYPE_CHECKING:
    from ..backend.registry import Backend
    from ..backend.workspace import Workspace

#: Crush's ``config.Scope`` numbers that ``POST .../config/model`` accepts (0 global,
#: 1 workspace); both apply to the workspace in memory.
SCOPES: Final = frozenset({0, 1})


def validate_workspace_path(raw_path: str) -> None:
    """Raise :class:`BadRequest` for a workspace path that cannot name a directory: one holding a
    NUL byte, or one starting with ``~`` (a path relative to a home directory is not absolute;
    PROTOCOL §3 asks for an absolute path, and the server does not expand it)."""
    if "\x00" in raw_path:
        raise BadRequest("path holds a NUL byte; send the absolute path of a project directory")
    if raw_path.startswith("~"):
        raise BadRequest(
            f"path {raw_path!r} is not absolute ('~' is not expanded); send the absolute path "
            "of a project directory, e.g. /home/me/project"
        )


# -- configuration and models -------------------------------------------------------------------
# Functions of the workspace alone: the configuration it runs with and the model catalog.


def workspace_config(ws: Workspace) -> WorkspaceConfig:
    """``GET .../config``: the configuration in use, in Crush's shape (no secrets)."""
    return catalog.workspace_config(ws.config, ws.data_dir)


def providers(ws: Workspace) -> list[CatalogProvider]:
    """``GET .../providers``: the providers and the models each offers."""
    return catalog.catalog(ws.config)


def select_model(ws: Workspace, body: SelectModelRequest) -> dict[str, Any]:
    """``POST .../config/model``: use a model for the large or small role from the next turn."""
    if body.scope not in SCOPES:
        raise BadRequest(
            f"scope {body.scope} is not one of Crush's scopes (0 global, 1 workspace); both "
            "apply to this workspace until it closes"
        )
    ws.check_open()
    ws.select_model(body.model_type, body.model)
    return {}


def default_small_model(ws: Workspace, provider_id: str | None) -> ModelChoice:
    """``GET .../agent/default-small-model``: the small model of a provider."""
    return catalog.default_small_model(ws.config, provider_id or "")


class Api:
    """The operations over one server's backend: workspaces, sessions, the agent, runs,
    permissions and trust."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def workspace(self, workspace_id: str) -> Workspace:
        return self.backend.get(workspace_id)

    async def place(self, path: str, query: bytes, args: Any, method: str = "GET") -> None:
        """Send a request for a workspace to the node that serves it (the backend's
        :class:`~crush_trio.core.placement.Placement`). In a cluster, a workspace this node has
        not open is opened here when no live node owns it, else the request is answered
        ``Moved`` (307 to the owner, same path and query) or ``OwnerUnavailable`` (503); a
        single server serves every workspace itself, so the request goes on here."""
        wid = workspace_id_of(path)
        if wid is None:
            return
        backend = self.backend
        ws = backend.workspaces.get(wid)
        if ws is not None:
            if ws.closing:
                backend.placement.check_closing(wid)
            return
        target = request_target(path, query)
        client_id = args.get("client_id")
        # Releasing a hold on a workspace no node serves opens nothing (404 follows).
        releasing = method == "DELETE" and path.rstrip("/") == f"/v1/workspaces/{wid}"
        await backend.locate(
            wid, target, client_id if isinstance(client_id, str) else None, adopt=not releasing
        )

    async def open_workspace(self, raw_path: str, client_id: str) -> Workspace:
        """``POST /v1/workspaces``: the path is checked here, then the backend opens it."""
        validate_workspace_path(raw_path)
        return await self.backend.open(raw_path, client_id)

    def check_idle(self) -> None:
        """Raise :class:`Conflict` unless the server is idle as Crush means it: no open
        workspace, no workspace create pending (and so no run in progress)."""
        if self.backend.is_idle():
            return
        open_count = len(self.backend.list())
        raise Conflict(
            f"server not idle: {open_count} workspace(s) open or being opened; "
            "'shutdown_if_idle' stops the server only when no client holds a workspace "
            "(release them with DELETE /v1/workspaces/{id}?client_id=...) or use 'shutdown'"
        )

    # -- sessions -------------------------------------------------------------------------------

    async def create_session(self, ws: Workspace, body: CreateSessionRequest) -> Session:
        return ws.decorate(await ws.create_session(body.title))

    async def list_sessions(self, ws: Workspace) -> list[Session]:
        return [ws.decorate(s) for s in await ws.store.list_sessions()]

    async def get_session(
        self, ws: Workspace, session_id: str, *, in_body: bool = False
    ) -> Session:
        session = await ws.store.get_session(session_id)
        if session is None:
            error = BadRequest if in_body else NotFound
            raise error(
                f"session {session_id!r} not found in workspace {ws.id}; list sessions with "
                f"GET /v1/workspaces/{ws.id}/sessions"
            )
        return ws.decorate(session)

    async def rename_session(self, ws: Workspace, session_id: str, title: str) -> Session:
        if not title.strip():
            raise BadRequest("title is empty; send the new title in 'title'")
        session = await ws.rename_session(session_id, title.strip())
        if session is None:
            raise NotFound(f"session {session_id!r} not found in workspace {ws.id}")
        return session

    async def delete_session(self, ws: Workspace, session_id: str) -> dict[str, Any]:
        if not await ws.delete_session(session_id):
            raise NotFound(f"session {session_id!r} not found in workspace {ws.id}")
        return {}

    async def list_messages(
        self, ws: Workspace, session_id: str, *, in_body: bool = False
    ) -> list[Message]:
        await self.get_session(ws, session_id, in_body=in_body)
        await ws.messages.flush_session(session_id)
        return await ws.store.list_messages(session_id)

    # -- agent ----------------------------------------------------------------------------------

    def agent_info(self, ws: Workspace) -> AgentInfo:
        return AgentInfo(
            is_busy=ws.agent.is_busy(),
            is_ready=not ws.closing,
            model=catalog.model_info(ws.config),
            model_cfg=catalog.selection(ws.config, "large"),
            sandbox=ws.sandbox_info,
            mcp=ws.mcp.info(),
            jobs=ws.jobs.info(),
            context_files=ws.agent.context_info(),
        )

    def agent_init(self, ws: Workspace, body: AgentInitRequest) -> dict[str, Any]:
        """``POST .../agent/init`` (Crush's client calls it before anything else): the agent
        is ready once the workspace is open, so this only checks that it is."""
        ws.check_open()
        return {}

    def agent_update(self, ws: Workspace) -> dict[str, Any]:
        """``POST .../agent/update``: a model chosen with ``config/model`` already applies
        from the next turn on, so this only checks that the workspace is open."""
        ws.check_open()
        return {}

    async def set_current_session(
        self, ws: Workspace, client_id: str, body: CurrentSessionRequest
    ) -> dict[str, Any]:
        if body.session_id:
            await self.get_session(ws, body.session_id, in_body=True)
        ws.set_current_session(client_id, body.session_id)
        return {}

    async def session_history(self, ws: Workspace, session_id: str) -> list[HistoryFile]:
        """``GET .../sessions/{sid}/history``: the file versions the session wrote. No
        version is kept yet, so the list is empty (the shape is Crush's ``proto.File``)."""
        await self.get_session(ws, session_id)
        return []

    async def read_files(self, ws: Workspace, session_id: str) -> list[str]:
        """``GET .../sessions/{sid}/filetracker/files``: the files the session read. Reads are
        not tracked, so the list is empty."""
        await self.get_session(ws, session_id)
        return []

    async def user_messages(self, ws: Workspace, session_id: str | None = None) -> list[Message]:
        """The user messages of one session (or of every session, oldest session first)."""
        if session_id is not None:
            sessions = [session_id]
        else:
            sessions = [s.id for s in reversed(await ws.store.list_sessions())]
        out: list[Message] = []
        for sid in sessions:
            out += [m for m in await self.list_messages(ws, sid) if m.role is Role.USER]
        return out

    def skip_state(self, ws: Workspace) -> SkipState:
        return SkipState(skip=ws.permissions.skip)

    async def prompt(self, ws: Workspace, body: AgentMessage) -> AcceptedPrompt:
        """Accept a prompt and return once its run record is committed (the 202's promise)."""
        ws.check_open()
        parts = self._attachments(ws, body)
        return await ws.agent.submit(body.session_id, body.prompt, body.run_id, body.model, parts)

    async def accept_prompt(self, ws: Workspace, body: AgentMessage) -> AcceptedPrompt:
        """Accept a prompt; the caller answers after ``ws.agent.durable(run_id)`` returns."""
        ws.check_open()
        parts = self._attachments(ws, body)
        return await ws.agent.accept(body.session_id, body.prompt, body.run_id, body.model, parts)

    @staticmethod
    def _attachments(ws: Workspace, body: AgentMessage) -> list[BinaryPart]:
        if not body.attachments:
            return []
        return check_attachments(
            body.attachments,
            max_each=ws.server.max_attachment_bytes,
            max_total=ws.server.max_attachments_bytes,
            max_count=ws.server.max_attachments,
        )

    async def summarize(self, ws: Workspace, session_id: str, *, in_body: bool = False) -> Session:
        """``POST .../agent/sessions/{sid}/summarize``: 409 while the session is busy; returns
        the session once its summary is stored (``summary_message_id`` names it)."""
        await self.get_session(ws, session_id, in_body=in_body)
        ws.check_open()
        await ws.agent.summarize(session_id)
        return await self.get_session(ws, session_id, in_body=in_body)

    async def cancel(self, ws: Workspace, session_id: str) -> dict[str, Any]:
        ws.agent.cancel(session_id)
        return {}

    async def clear_queue(self, ws: Workspace, session_id: str) -> dict[str, Any]:
        ws.agent.clear_queue(session_id)
        return {}

    def queued_count(self, ws: Workspace, session_id: str) -> int:
        return len(ws.agent.queued_prompts(session_id))

    def queued_list(self, ws: Workspace, session_id: str) -> list[str]:
        return ws.agent.queued_prompts(session_id)

    async def get_run(self, ws: Workspace, run_id: str, *, in_body: bool = False) -> Run:
        run = ws.runs.get(run_id) or await ws.store.get_run(run_id)
        if run is None:
            error = BadRequest if in_body else NotFound
            raise error(f"run {run_id!r} not found in workspace {ws.id}")
        return run

    async def cancel_run(
        self, ws: Workspace, run_id: str, *, in_body: bool = False
    ) -> dict[str, Any]:
        await self.get_run(ws, run_id, in_body=in_body)
        return {"cancelled": ws.agent.cancel_run(run_id)}

    # -- permissions ----------------------------------------------------------------------------

    async def grant(self, ws: Workspace, body: GrantRequest) -> dict[str, Any]:
        resolved = await ws.permissions.grant(body.permission.id, body.action)
        return {"resolved": resolved}

    def pending_permissions(self, ws: Workspace) -> list[Any]:
        return ws.permissions.pending

    async def skip(self, ws: Workspace, body: SkipRequest) -> dict[str, Any]:
        ws.permissions.set_skip(body.skip)
        return {}

    # -- trust ----------------------------------------------------------------------------------

    async def trust(self, ws: Workspace, body: TrustRequest) -> TrustResult:
        change = await self.backend.set_trust(ws, body.trusted)
        return TrustResult(
            workspace=ws.info,
            file=str(change.file),
            changed=change.changed,
            still_trusted_by=list(change.still_trusted_by),
        )
