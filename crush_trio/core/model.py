"""The model vocabulary: what the agent asks a model provider and what the provider answers.

A provider turns a :class:`ModelRequest` (system prompt, the session's history as wire
:class:`~crush_trio.wire.Message` objects, tool specs) into a stream of :data:`StreamEvent`
values. Each provider type (``echo``, ``openai``/``openai-compat``, ``anthropic``, in
:mod:`crush_trio.providers`) implements :class:`Provider`; the agent loop never sees HTTP. These
types are plain data and import no I/O library, so the plain-logic cores
(:mod:`crush_trio.core.assembler`) and the agent speak them without the providers' HTTP stack.

Cancellation: ``stream`` is an async generator used under ``contextlib.aclosing``; cancelling the
consumer closes the generator, which must close its HTTP response within one checkpoint.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from ..wire import FinishReason, Message

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


@attrs.define(frozen=True)
class ToolSpec:
    """A tool as the model sees it: name, description and JSON-schema parameters."""

    name: str
    description: str
    parameters: dict[str, Any]


@attrs.define(frozen=True)
class ModelInfo:
    """One configured model of a provider."""

    id: str
    name: str = ""
    context_window: int = 0
    default_max_tokens: int = 0
    #: Sent as ``reasoning_effort`` by the OpenAI-compatible types when set.
    reasoning_effort: str = ""
    #: Sent as Anthropic's ``thinking`` budget when non-zero.
    thinking_budget: int = 0


class RequestPurpose(enum.Enum):
    """What a model request is for: a turn's step (also a sub-agent's), a session title, or a
    session summary. Providers send the same request whatever its purpose; fakes and metrics
    tell them apart by it."""

    TURN = "turn"
    TITLE = "title"
    SUMMARY = "summary"


@attrs.define
class ModelRequest:
    model: ModelInfo
    system: str
    messages: list[Message]
    tools: list[ToolSpec] = attrs.field(factory=list)
    max_tokens: int = 0
    purpose: RequestPurpose = RequestPurpose.TURN


# --- stream events -------------------------------------------------------------------------


@attrs.define(frozen=True)
class TextDelta:
    text: str


@attrs.define(frozen=True)
class ReasoningDelta:
    text: str


@attrs.define(frozen=True)
class ReasoningDone:
    signature: str = ""


@attrs.define(frozen=True)
class ToolCallStart:
    id: str
    name: str


@attrs.define(frozen=True)
class ToolCallDelta:
    id: str
    arguments: str


@attrs.define(frozen=True)
class ToolCallDone:
    """A complete tool call; ``input`` is the JSON text of the arguments."""

    id: str
    name: str
    input: str


@attrs.define(frozen=True)
class Usage:
    """What one model step used, as the API reported it.

    ``prompt_tokens`` counts every input token (the context sent), cached ones included;
    ``cache_read_tokens`` of them were read from the provider's prompt cache and
    ``cache_write_tokens`` written to it (both 0 where the API reports no caching).
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0


@attrs.define(frozen=True)
class Retrying:
    """The provider is retrying after a transient failure (shown to clients as an agent_event)."""

    attempt: int
    delay: float
    reason: str


@attrs.define(frozen=True)
class Finished:
    reason: FinishReason


StreamEvent = (
    TextDelta
    | ReasoningDelta
    | ReasoningDone
    | ToolCallStart
    | ToolCallDelta
    | ToolCallDone
    | Usage
    | Retrying
    | Finished
)


class Provider(Protocol):
    """A model provider. ``name`` is the provider's key in ``crush.json``."""

    name: str
    type: str

    def stream(self, request: ModelRequest) -> AsyncIterator[StreamEvent]:
        """Stream one model step.

        Raises:
            ProviderError: the provider failed; the message names the provider and the fix.
        """
        ...

    async def aclose(self) -> None: ...
