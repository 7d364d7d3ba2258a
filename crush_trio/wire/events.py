"""Events (PROTOCOL §5): the payloads only events carry, the envelope's kinds and payload types,
and which payload types must be delivered."""

from __future__ import annotations

import enum
from typing import Any, Final

import attrs

from .messages import Message, Part, ReasoningPart, TextPart, ToolCallPart
from .objects import (
    AgentEvent,
    FilesChanged,
    PermissionNotification,
    PermissionRequest,
    RunComplete,
    Session,
)


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
    Neither ``part`` nor ``offset`` is negative: the converter refuses such a delta
    (:mod:`crush_trio.wire.convert`), and :func:`apply_delta` does not apply one.
    """

    message_id: str
    session_id: str
    part: int
    part_type: DeltaPartType
    offset: int
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
    if delta.offset < 0:
        return False
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
