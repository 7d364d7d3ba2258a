"""The workspace lifecycle as a table (PROTOCOL §6): ``starting`` → ``open`` → ``closing`` →
``closed``; a workspace whose start fails goes from ``starting`` straight to ``closing``."""

from __future__ import annotations

import enum
from typing import Final

from ..errors import IllegalTransition


class WorkspaceState(enum.StrEnum):
    STARTING = "starting"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


#: Allowed workspace state moves; anything else is a bug (see :func:`check_workspace_move`).
WORKSPACE_TRANSITIONS: Final[dict[WorkspaceState, frozenset[WorkspaceState]]] = {
    WorkspaceState.STARTING: frozenset({WorkspaceState.OPEN, WorkspaceState.CLOSING}),
    WorkspaceState.OPEN: frozenset({WorkspaceState.CLOSING}),
    WorkspaceState.CLOSING: frozenset({WorkspaceState.CLOSED}),
    WorkspaceState.CLOSED: frozenset(),
}


def check_workspace_move(workspace_id: str, old: WorkspaceState, new: WorkspaceState) -> None:
    """Raises :class:`~crush_trio.errors.IllegalTransition` unless the table allows the move."""
    if new not in WORKSPACE_TRANSITIONS[old]:
        raise IllegalTransition(f"workspace {workspace_id} cannot move from {old} to {new}")
