"""Ids, times and paths of the wire (PROTOCOL §2): server-made ids, client-chosen ids and their
checks, the wire's time format, the workspace routes' prefix."""

from __future__ import annotations

import time
import uuid
from typing import Final

from ..errors import BadRequest

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
