"""The ``anthropic`` provider: the Messages API, streamed.

``POST {base_url}/messages`` with ``x-api-key``, ``anthropic-version: 2023-06-01`` and
``stream: true``. :func:`to_anthropic_messages` converts the history (tool calls become
``tool_use`` blocks of the assistant turn, tool results ``tool_result`` blocks of a user turn,
consecutive turns of the same role are merged, reasoning with a signature is sent back as a
``thinking`` block), and :class:`MessagesStreamParser` turns the streamed events into stream
events without doing any I/O. HTTP, retries and timeouts live in
:mod:`crush_trio.providers.http`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Final

import attrs
import orjson

from ..attachments import as_text, is_image
from ..errors import ProviderError
from ..wire import (
    BinaryPart,
    FinishReason,
    Message,
    ReasoningPart,
    Role,
    TextPart,
    ToolCallPart,
    ToolResultPart,
)
from .base import (
    Finished,
    ModelRequest,
    ReasoningDelta,
    ReasoningDone,
    Retrying,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
    ToolCallDone,
    ToolCallStart,
    ToolSpec,
    Usage,
)
from .http import HttpStreamer, ProviderSettings, SSEEvent, parse_json_event, quote

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

#: Where the ``anthropic`` type points when ``base_url`` is not set.
DEFAULT_ANTHROPIC_BASE_URL: Final = "https://api.anthropic.com/v1"
#: The API version header sent with every request.
ANTHROPIC_VERSION: Final = "2023-06-01"
#: ``max_tokens`` is required by the Messages API; used when neither the request nor the model
#: entry (``default_max_tokens``) sets it.
DEFAULT_MAX_TOKENS: Final = 4096
#: The prompt-cache marker put on the system prompt and the conversation's last blocks.
CACHE_CONTROL: Final = {"type": "ephemeral"}
#: Turns at the end of the conversation whose last block carries :data:`CACHE_CONTROL` (with
#: the system prompt's, 3 of the 4 breakpoints the API allows per request).
CACHED_TAIL_TURNS: Final = 2
#: Blocks that may not carry ``cache_control``.
_UNCACHEABLE_BLOCKS: Final = frozenset({"thinking", "redacted_thinking"})

_STOP_REASONS: Final = {
    "end_turn": FinishReason.END_TURN,
    "stop_sequence": FinishReason.END_TURN,
    "max_tokens": FinishReason.MAX_TOKENS,
    "tool_use": FinishReason.TOOL_USE,
}


# ---------------------------------------------------------------------------------------------
# Request building, without I/O


def to_anthropic_messages(messages: list[Message]) -> tuple[list[str], list[dict[str, Any]]]:
    """Convert the history to Messages API turns.

    Returns:
        The text of any ``system`` messages (to append to the system prompt) and the turns.
        Assistant parts keep their order (thinking, text, ``tool_use``); tool results go first in
        their user turn, as the API requires; empty text blocks and empty turns are dropped, and
        consecutive turns of one role are merged into one.
    """
    system: list[str] = []
    turns: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if not blocks:
            return
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})

    for message in messages:
        if message.role is Role.SYSTEM:
            if text := message.text():
                system.append(text)
        elif message.role is Role.ASSISTANT:
            blocks: list[dict[str, Any]] = []
            for part in message.parts:
                if isinstance(part, ReasoningPart) and part.signature and part.thinking:
                    blocks.append(
                        {"type": "thinking", "thinking": part.thinking, "signature": part.signature}
                    )
                elif isinstance(part, TextPart) and part.text:
                    blocks.append({"type": "text", "text": part.text})
                elif isinstance(part, ToolCallPart):
                    blocks.append(
                        {
                            "type": "tool_use",
                            "id": part.id,
                            "name": part.name,
                            "input": _json_object(part.input),
                        }
                    )
            add("assistant", blocks)
        else:
            results: list[dict[str, Any]] = []
            texts: list[dict[str, Any]] = []
            for part in message.parts:
                if isinstance(part, ToolResultPart):
                    block: dict[str, Any] = {
                        "type": "tool_result",
                        "tool_use_id": part.tool_call_id,
                        "content": part.content,
                    }
                    if part.is_error:
                        block["is_error"] = True
                    results.append(block)
                elif isinstance(part, TextPart) and part.text:
                    texts.append({"type": "text", "text": part.text})
                elif isinstance(part, BinaryPart):
                    texts.append(_attachment_block(part))
            add("user", results + texts)
    return system, turns


def _attachment_block(part: BinaryPart) -> dict[str, Any]:
    """An attachment as a Messages API block: an ``image`` block, or text for a text file."""
    if is_image(part):
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": part.mime_type, "data": part.data},
        }
    return {"type": "text", "text": as_text(part)}


def to_anthropic_tools(tools: list[ToolSpec]) -> list[dict[str, Any]]:
    return [
        {"name": tool.name, "description": tool.description, "input_schema": tool.parameters}
        for tool in tools
    ]


def build_messages_body(request: ModelRequest) -> dict[str, Any]:
    """The JSON body of a streamed Messages API request.

    Prompt caching: the system prompt and the last cacheable block of each of the last
    :data:`CACHED_TAIL_TURNS` turns carry ``cache_control`` (the cache covers the request up to
    each marked block, tools included, so the next step of a session reads its whole prefix from
    the cache). Extended thinking: ``thinking`` is sent only when the model's entry sets
    ``thinking_budget``; ``max_tokens`` is then raised above the budget where needed, as the API
    requires.
    """
    extra_system, turns = to_anthropic_messages(request.messages)
    system = "\n\n".join(s for s in [request.system, *extra_system] if s)
    max_tokens = request.max_tokens or request.model.default_max_tokens or DEFAULT_MAX_TOKENS
    body: dict[str, Any] = {
        "model": request.model.id,
        "max_tokens": max_tokens,
        "messages": turns,
        "stream": True,
    }
    if system:
        body["system"] = [{"type": "text", "text": system, "cache_control": dict(CACHE_CONTROL)}]
    _mark_cached_tail(turns)
    if request.tools:
        body["tools"] = to_anthropic_tools(request.tools)
    budget = request.model.thinking_budget
    if budget > 0:
        body["thinking"] = {"type": "enabled", "budget_tokens": budget}
        if max_tokens <= budget:
            body["max_tokens"] = budget + max_tokens
    return body


def _mark_cached_tail(turns: list[dict[str, Any]]) -> None:
    """Put ``cache_control`` on the last block that may carry it in each of the last
    :data:`CACHED_TAIL_TURNS` turns (the turns are built here, so nothing else is changed)."""
    for turn in turns[-CACHED_TAIL_TURNS:]:
        for block in reversed(turn["content"]):
            if block.get("type") not in _UNCACHEABLE_BLOCKS:
                block["cache_control"] = dict(CACHE_CONTROL)
                break


def _json_object(text: str) -> Any:
    """A tool call's stored input as the JSON object the API expects (``{}`` if unusable)."""
    try:
        value = orjson.loads(text) if text.strip() else {}
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


# ---------------------------------------------------------------------------------------------
# Stream parsing, without I/O


@attrs.define
class _Block:
    kind: str
    id: str = ""
    name: str = ""
    parts: list[str] = attrs.field(factory=list)
    signature: str = ""


class MessagesStreamParser:
    """Turns Messages API stream events into :data:`StreamEvent` values.

    ``tool_use`` blocks give ``ToolCallStart`` at ``content_block_start``, a ``ToolCallDelta``
    per ``input_json_delta`` and ``ToolCallDone`` (the validated JSON, ``{}`` when empty) at
    ``content_block_stop``; ``thinking`` blocks give ``ReasoningDelta`` and, at their stop,
    ``ReasoningDone`` with the accumulated signature. ``message_stop`` yields ``Usage`` and
    ``Finished``; ``ping`` and unknown events are ignored.

    Args:
        provider: the provider's name, for error messages.
    """

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self.done = False
        self._blocks: dict[int, _Block] = {}
        self._input_tokens = 0
        self._output_tokens = 0
        self._cache_read = 0
        self._cache_write = 0
        self._stop_reason = ""
        self._tool_calls = 0

    def feed(self, event: SSEEvent) -> list[StreamEvent]:
        """Handle one SSE event and return the stream events it produced.

        Raises:
            ProviderError: a malformed chunk, an ``error`` event, or invalid tool input.
        """
        if self.done:
            return []
        data = parse_json_event(self.provider, event.data)
        if not isinstance(data, dict):
            raise ProviderError(
                f"provider {self.provider!r} sent a malformed stream chunk: "
                f"{quote(event.data)} (expected a JSON object)"
            )
        kind = data.get("type") or event.event
        out: list[StreamEvent] = []
        if kind == "message_start":
            message = data.get("message")
            if isinstance(message, dict):
                self._usage(message.get("usage"))
        elif kind == "content_block_start":
            self._block_start(data, out)
        elif kind == "content_block_delta":
            self._block_delta(data, out)
        elif kind == "content_block_stop":
            self._block_stop(_int(data.get("index")), out)
        elif kind == "message_delta":
            delta = data.get("delta")
            if isinstance(delta, dict) and isinstance(delta.get("stop_reason"), str):
                self._stop_reason = delta["stop_reason"]
            self._usage(data.get("usage"))
        elif kind == "message_stop":
            return self._finish()
        elif kind == "error":
            error = data.get("error")
            error_type, message = "error", ""
            if isinstance(error, dict):
                error_type = str(error.get("type") or error_type)
                message = str(error.get("message") or "")
            raise ProviderError(
                f"provider {self.provider!r} reported {error_type} mid-stream: "
                f"{quote(message) or '(no message)'}",
                retryable=error_type in ("overloaded_error", "api_error", "rate_limit_error"),
            )
        return out

    def end(self) -> list[StreamEvent]:
        """The body ended: fail unless ``message_stop`` was seen.

        Raises:
            ProviderError: the stream ended before ``message_stop``.
        """
        if self.done:
            return []
        raise ProviderError(
            f"provider {self.provider!r} ended the stream before message_stop; the server may "
            "have crashed or cut the connection",
            retryable=True,
        )

    def _usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        if "input_tokens" in usage:
            self._cache_read = _int(usage.get("cache_read_input_tokens"))
            self._cache_write = _int(usage.get("cache_creation_input_tokens"))
            self._input_tokens = (
                _int(usage.get("input_tokens")) + self._cache_write + self._cache_read
            )
        if "output_tokens" in usage:
            self._output_tokens = _int(usage.get("output_tokens"))

    def _block_start(self, data: dict[str, Any], out: list[StreamEvent]) -> None:
        index = _int(data.get("index"))
        block = data.get("content_block")
        if not isinstance(block, dict):
            return
        kind = str(block.get("type") or "")
        if kind == "text":
            self._blocks[index] = _Block("text")
            if isinstance(text := block.get("text"), str) and text:
                out.append(TextDelta(text))
        elif kind == "thinking":
            self._blocks[index] = _Block("thinking")
            if isinstance(thinking := block.get("thinking"), str) and thinking:
                out.append(ReasoningDelta(thinking))
        elif kind == "tool_use":
            call_id, name = str(block.get("id") or ""), str(block.get("name") or "")
            call = _Block("tool_use", id=call_id, name=name)
            if not call.id or not call.name:
                raise ProviderError(
                    f"provider {self.provider!r} started a tool_use block without an id or a name"
                )
            initial = block.get("input")
            if isinstance(initial, dict) and initial:
                # Deltas normally carry the input; a proxy may send it whole here instead.
                call.parts.append(orjson.dumps(initial).decode())
            self._blocks[index] = call
            out.append(ToolCallStart(call.id, call.name))
            if call.parts:
                out.append(ToolCallDelta(call.id, call.parts[0]))
        else:
            self._blocks[index] = _Block(kind)  # redacted_thinking and others: not shown

    def _block_delta(self, data: dict[str, Any], out: list[StreamEvent]) -> None:
        index = _int(data.get("index"))
        delta = data.get("delta")
        if not isinstance(delta, dict):
            return
        kind = delta.get("type")
        block = self._blocks.get(index)
        if kind == "text_delta":
            if isinstance(text := delta.get("text"), str) and text:
                out.append(TextDelta(text))
        elif kind == "thinking_delta":
            if isinstance(thinking := delta.get("thinking"), str) and thinking:
                out.append(ReasoningDelta(thinking))
        elif kind == "signature_delta":
            if block is not None and isinstance(signature := delta.get("signature"), str):
                block.signature += signature
        elif kind == "input_json_delta":
            if block is None or block.kind != "tool_use":
                raise ProviderError(
                    f"provider {self.provider!r} sent tool input for content block {index}, "
                    "which is not a tool_use block"
                )
            if isinstance(partial := delta.get("partial_json"), str) and partial:
                block.parts.append(partial)
                out.append(ToolCallDelta(block.id, partial))

    def _block_stop(self, index: int, out: list[StreamEvent]) -> None:
        block = self._blocks.pop(index, None)
        if block is None:
            return
        if block.kind == "thinking":
            out.append(ReasoningDone(signature=block.signature))
        elif block.kind == "tool_use":
            arguments = "".join(block.parts).strip() or "{}"
            try:
                orjson.loads(arguments)
            except orjson.JSONDecodeError as exc:
                raise ProviderError(
                    f"model returned invalid JSON arguments for tool call {block.id!r} "
                    f"({block.name}) from provider {self.provider!r}: {quote(arguments)} ({exc})",
                    retryable=True,
                ) from exc
            self._tool_calls += 1
            out.append(ToolCallDone(block.id, block.name, arguments))

    def _finish(self) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        for index in sorted(self._blocks):
            self._block_stop(index, out)
        self.done = True
        out.append(
            Usage(
                prompt_tokens=self._input_tokens,
                completion_tokens=self._output_tokens,
                cache_read_tokens=self._cache_read,
                cache_write_tokens=self._cache_write,
            )
        )
        if self._stop_reason == "max_tokens":
            reason = FinishReason.MAX_TOKENS
        elif self._tool_calls:
            reason = FinishReason.TOOL_USE
        else:
            reason = _STOP_REASONS.get(self._stop_reason, FinishReason.END_TURN)
            if reason is FinishReason.TOOL_USE:
                reason = FinishReason.END_TURN  # "tool_use" without any call: nothing to run
        out.append(Finished(reason))
        return out


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _is_done(event: SSEEvent) -> bool:
    return event.event == "message_stop"


# ---------------------------------------------------------------------------------------------
# The provider


class AnthropicProvider:
    """A Messages API provider (``type`` ``anthropic``).

    Args:
        name: the provider's name in ``crush.json``.
        settings: the provider's config; ``base_url`` defaults to
            :data:`DEFAULT_ANTHROPIC_BASE_URL`.

    Cancellation: see :meth:`stream`.
    """

    type: str = "anthropic"

    def __init__(self, name: str, settings: ProviderSettings) -> None:
        self.name = name
        base_url = settings.base_url or DEFAULT_ANTHROPIC_BASE_URL
        self.url = base_url.rstrip("/") + "/messages"
        headers = {"anthropic-version": ANTHROPIC_VERSION}
        if settings.api_key:
            headers["x-api-key"] = settings.api_key
        self._http = HttpStreamer(name, settings, headers=headers)

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamEvent]:
        """Stream one model step: text, thinking, tool calls, usage, then ``Finished``.

        Raises:
            ProviderError: see :class:`~crush_trio.providers.http.HttpStreamer` and
                :class:`MessagesStreamParser`.

        Cancellation: closing or cancelling the generator closes the HTTP response.
        """
        parser = MessagesStreamParser(self.name)
        body = build_messages_body(request)
        events = self._http.stream_sse(self.url, body, is_final=_is_done)
        async with contextlib.aclosing(events):
            async for item in events:
                if isinstance(item, Retrying):
                    yield item
                    continue
                for event in parser.feed(item):
                    yield event
        for event in parser.end():
            yield event

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._http.aclose()
