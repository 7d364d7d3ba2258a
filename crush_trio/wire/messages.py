"""Messages and their parts (PROTOCOL §4 "Message").

Message parts are stored and sent as ``{"type": ..., "data": {...}}`` wrappers, the same shape on
the wire and in the database (:data:`PART_TAGS` names each part's tag; the converter in
:mod:`.convert` writes and reads the wrappers).
"""

from __future__ import annotations

import base64
import enum
from typing import Any, Final

import attrs

from .ids import now


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
