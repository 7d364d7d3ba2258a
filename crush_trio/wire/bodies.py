"""Request bodies: what clients send to the routes and over the websocket."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from .objects import ModelChoice, Workspace


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
