"""The row shape of sessions, messages and run records, shared by every SQL store.

The SQLite store (:mod:`crush_trio.store.db`) and the cluster's PostgreSQL store
(:mod:`crush_trio.cluster.pgstore`) keep the same columns in the same order: this module names
them and converts between the wire types and rows. Encoding runs on the calling (event loop)
side, so an object the caller keeps mutating is captured at the moment of the call; decoding
builds fresh objects (in the store's worker thread). A stored value that does not decode
raises :class:`~crush_trio.errors.StoreError`.
"""

from __future__ import annotations

from typing import Any, Final

from ..errors import StoreError
from ..wire import (
    Message,
    Role,
    Run,
    RunStatus,
    Session,
    Todo,
    parts_from_json,
    parts_to_json,
    todos_from_json,
    todos_to_json,
)

#: The stored columns of a session, in the order of :func:`session_row`.
SESSION_COLUMNS: Final = (
    "id, parent_session_id, title, message_count, prompt_tokens, completion_tokens, cost, "
    "created_at, updated_at, summary_message_id, todos"
)
#: The stored columns of a message, in the order of :func:`message_row`.
MESSAGE_COLUMNS: Final = (
    "id, session_id, role, parts, model, provider, created_at, updated_at, finished_at, "
    "is_summary_message"
)
#: The stored columns of a run record, in the order of :func:`run_row`.
RUN_COLUMNS: Final = "run_id, session_id, status, message_id, text, error, created_at, finished_at"

#: The stored values of one message, in the order of :data:`MESSAGE_COLUMNS`.
MessageRow = tuple[str, str, str, str, str, str, int, int, int | None, int]


def session_row(s: Session) -> tuple[Any, ...]:
    return (
        s.id,
        s.parent_session_id,
        s.title,
        s.message_count,
        s.prompt_tokens,
        s.completion_tokens,
        s.cost,
        s.created_at,
        s.updated_at,
        s.summary_message_id,
        todos_to_json(s.todos),
    )


def session_from_row(row: tuple[Any, ...]) -> Session:
    return Session(
        id=row[0],
        parent_session_id=row[1],
        title=row[2],
        message_count=row[3],
        prompt_tokens=row[4],
        completion_tokens=row[5],
        cost=float(row[6]),
        created_at=row[7],
        updated_at=row[8],
        summary_message_id=row[9],
        todos=_todos_from_row(row[0], row[10]),
    )


def _todos_from_row(session_id: str, raw: str) -> list[Todo]:
    try:
        return todos_from_json(raw)
    except Exception as exc:
        raise StoreError(
            f"session {session_id!r} has an unreadable stored todo list ({exc}); the database "
            "was written by an incompatible version or is damaged"
        ) from exc


def message_row(m: Message) -> MessageRow:
    finish = m.finish()
    return (
        m.id,
        m.session_id,
        m.role.value,
        parts_to_json(m.parts),
        m.model,
        m.provider,
        m.created_at,
        m.updated_at,
        finish.time if finish is not None else None,
        int(m.is_summary_message),
    )


def message_from_row(row: tuple[Any, ...]) -> Message:
    try:
        parts = parts_from_json(row[3])
        role = Role(row[2])
    except Exception as exc:
        raise StoreError(
            f"message {row[0]!r} has unreadable stored data ({exc}); the database was written "
            "by an incompatible version or is damaged"
        ) from exc
    return Message(
        id=row[0],
        session_id=row[1],
        role=role,
        parts=parts,
        model=row[4],
        provider=row[5],
        created_at=row[6],
        updated_at=row[7],
        is_summary_message=bool(row[9]),
    )


def run_row(r: Run) -> tuple[Any, ...]:
    return (
        r.run_id,
        r.session_id,
        r.status.value,
        r.message_id,
        r.text,
        r.error,
        r.created_at,
        r.finished_at,
    )


def run_from_row(row: tuple[Any, ...]) -> Run:
    try:
        status = RunStatus(row[2])
    except ValueError as exc:
        raise StoreError(
            f"run {row[0]!r} has unknown stored status {row[2]!r}; the database was written by "
            "an incompatible version or is damaged"
        ) from exc
    return Run(
        run_id=row[0],
        session_id=row[1],
        status=status,
        message_id=row[3],
        text=row[4],
        error=row[5],
        created_at=row[6],
        finished_at=row[7],
    )
