"""The ``openai`` and ``openai-compat`` providers: the Chat Completions API, streamed.

``POST {base_url}/chat/completions`` with ``stream: true`` and
``stream_options: {include_usage: true}``. The history is converted to chat messages (assistant
messages carry ``tool_calls``; each tool result is a ``tool`` message) by
:func:`to_chat_messages`, and the streamed chunks are turned into stream events by
:class:`ChatStreamParser`, which is plain logic without I/O. HTTP, retries and timeouts live in
:mod:`crush_trio.providers.http`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Final

import attrs
import orjson

from ..attachments import as_text, is_image
from ..errors import ConfigError, ProviderError
from ..wire import BinaryPart, FinishReason, Message, Role, ToolResultPart
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
from .body import READ_PACER
from .http import HttpStreamer, ProviderSettings, SSEEvent, parse_json_event, quote

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

#: Where the ``openai`` type points when ``base_url`` is not set.
DEFAULT_OPENAI_BASE_URL: Final = "https://api.openai.com/v1"
#: The stream's last event.
DONE_MARKER: Final = "[DONE]"
#: Longest event data that :func:`_is_done` strips to compare with :data:`DONE_MARKER`.
MAX_DONE_CHARS: Final = 64

_FINISH_REASONS: Final = {
    "stop": FinishReason.END_TURN,
    "length": FinishReason.MAX_TOKENS,
    "tool_calls": FinishReason.TOOL_USE,
    "function_call": FinishReason.TOOL_USE,
}


# ---------------------------------------------------------------------------------------------
# Request building, without I/O


def to_chat_messages(system: str, messages: list[Message]) -> list[dict[str, Any]]:
    """Convert the system prompt and the history to Chat Completions messages.

    Assistant text and tool calls become one ``assistant`` message with ``tool_calls``; every
    tool result becomes a ``tool`` message; reasoning is not sent back. Assistant messages with
    neither text nor tool calls (a reply cancelled before any output) are skipped, since the API
    rejects them.
    """
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system})
    for message in messages:
        if message.role is Role.ASSISTANT:
            text = message.text()
            calls = message.tool_calls()
            if not text and not calls:
                continue
            entry: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                entry["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.input or "{}"},
                    }
                    for call in calls
                ]
            out.append(entry)
        elif message.role is Role.SYSTEM:
            if text := message.text():
                out.append({"role": "system", "content": text})
        else:
            for part in message.parts:
                if isinstance(part, ToolResultPart):
                    out.append(
                        {"role": "tool", "tool_call_id": part.tool_call_id, "content": part.content}
                    )
            files = [part for part in message.parts if isinstance(part, BinaryPart)]
            if message.role is Role.USER and files:
                content: list[dict[str, Any]] = []
                if text := message.text():
                    content.append({"type": "text", "text": text})
                content.extend(_attachment_part(part) for part in files)
                out.append({"role": "user", "content": content})
            elif message.role is Role.USER and (text := message.text()):
                out.append({"role": "user", "content": text})
    return out


def _attachment_part(part: BinaryPart) -> dict[str, Any]:
    """An attachment as a content part: ``image_url`` with a data URL, or text for a text file."""
    if is_image(part):
        url = f"data:{part.mime_type};base64,{part.data}"
        return {"type": "image_url", "image_url": {"url": url}}
    return {"type": "text", "text": as_text(part)}


def to_chat_tools(tools: list[ToolSpec]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.parameters,
            },
        }
        for tool in tools
    ]


def build_chat_body(request: ModelRequest) -> dict[str, Any]:
    """The JSON body of a streamed Chat Completions request (``reasoning_effort`` only when the
    model's entry sets it)."""
    body: dict[str, Any] = {
        "model": request.model.id,
        "messages": to_chat_messages(request.system, request.messages),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    max_tokens = request.max_tokens or request.model.default_max_tokens
    if max_tokens > 0:
        body["max_tokens"] = max_tokens
    if request.tools:
        body["tools"] = to_chat_tools(request.tools)
    if request.model.reasoning_effort:
        body["reasoning_effort"] = request.model.reasoning_effort
    return body


# ---------------------------------------------------------------------------------------------
# Stream parsing, without I/O


@attrs.define
class _PendingCall:
    index: int
    id: str = ""
    name: str = ""
    arguments: list[str] = attrs.field(factory=list)
    started: bool = False


class ChatStreamParser:
    """Turns Chat Completions stream events into :data:`StreamEvent` values.

    Tool calls are assembled per ``index``: the id, the name and the argument fragments may
    arrive in separate chunks. ``ToolCallStart`` is emitted once the id and the name are known
    (argument text seen before that is emitted right after it), ``ToolCallDelta`` for each later
    fragment, and ``ToolCallDone`` with the validated arguments when the choice finishes.
    ``reasoning_content`` / ``reasoning`` deltas become ``ReasoningDelta``, closed by
    ``ReasoningDone`` when text or a tool call starts. Usage is emitted once, before
    ``Finished``, from the last usage the server sent.

    Args:
        provider: the provider's name, for error messages.
    """

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self.done = False
        self._calls: dict[int, _PendingCall] = {}
        self._completed = False
        self._finish_reason = ""
        self._reasoning_open = False
        self._usage: Usage | None = None

    def feed(self, event: SSEEvent) -> list[StreamEvent]:
        """Handle one SSE event and return the stream events it produced.

        Raises:
            ProviderError: a malformed chunk, an error reported mid-stream, invalid tool call
                arguments, or a reply stopped by the provider's content filter.
        """
        if self.done:
            return []
        data = event.data.strip()
        if data == DONE_MARKER:
            return self._finish()
        chunk = parse_json_event(self.provider, data)
        if not isinstance(chunk, dict):
            raise ProviderError(
                f"provider {self.provider!r} sent a malformed stream chunk: {quote(data)} "
                "(expected a JSON object)"
            )
        error = chunk.get("error")
        if error:
            message = error.get("message") if isinstance(error, dict) else error
            raise ProviderError(
                f"provider {self.provider!r} reported an error mid-stream: {quote(str(message))}",
                retryable=True,
            )
        out: list[StreamEvent] = []
        self._chunk(chunk, out)
        return out

    def take_plain(self, events: list[SSEEvent]) -> list[StreamEvent] | None:
        """The stream events of ``events`` when each is a plain chunk: text or reasoning that
        continues the reply (no finish, no tool call, no error, no reasoning closed by text);
        what :meth:`feed` would return for them, one after the other. None when one is
        anything else (malformed too), or when none carries text; the parser is unchanged
        then, and :meth:`feed` takes the same events (and raises where it must)."""
        if self.done:
            return None
        reasoning_open = self._reasoning_open
        grows = False
        chunks: list[dict[str, Any]] = []
        for event in events:
            try:
                chunk = orjson.loads(event.data)
            except orjson.JSONDecodeError:
                return None
            if not isinstance(chunk, dict) or chunk.get("error"):
                return None
            choices = chunk.get("choices")
            for choice in choices if isinstance(choices, list) else ():
                if not isinstance(choice, dict) or _int(choice.get("index")) != 0:
                    continue
                reason = choice.get("finish_reason")
                if isinstance(reason, str) and reason:
                    return None
                delta = choice.get("delta")
                if not isinstance(delta, dict):
                    continue
                if delta.get("tool_calls"):
                    return None
                reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                if isinstance(reasoning, str) and reasoning:
                    reasoning_open = grows = True
                content = delta.get("content")
                if isinstance(content, str) and content:
                    if reasoning_open:
                        return None  # text closes the reasoning: a change the reader makes
                    grows = True
            chunks.append(chunk)
        if not grows:
            return None
        out: list[StreamEvent] = []
        for chunk in chunks:
            self._chunk(chunk, out)
        return out

    def _chunk(self, chunk: dict[str, Any], out: list[StreamEvent]) -> None:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details")
            cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
            self._usage = Usage(
                prompt_tokens=_int(usage.get("prompt_tokens")),
                completion_tokens=_int(usage.get("completion_tokens")),
                cache_read_tokens=cached,
            )
        choices = chunk.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict) and _int(choice.get("index")) == 0:
                    self._choice(choice, out)

    def end(self) -> list[StreamEvent]:
        """The body ended: finish the reply, or fail if it never finished.

        Raises:
            ProviderError: the stream ended before a ``finish_reason`` or ``[DONE]``.
        """
        if self.done:
            return []
        if not self._finish_reason:
            raise ProviderError(
                f"provider {self.provider!r} ended the stream before the reply finished "
                "(no finish_reason and no [DONE]); the server may have crashed or cut the "
                "connection",
                retryable=True,
            )
        return self._finish()

    def _choice(self, choice: dict[str, Any], out: list[StreamEvent]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                self._reasoning_open = True
                out.append(ReasoningDelta(reasoning))
            content = delta.get("content")
            if isinstance(content, str) and content:
                self._close_reasoning(out)
                out.append(TextDelta(content))
            tool_calls = delta.get("tool_calls")
            if isinstance(tool_calls, list):
                for call in tool_calls:
                    if isinstance(call, dict):
                        self._close_reasoning(out)
                        self._tool_delta(call, out)
        reason = choice.get("finish_reason")
        if isinstance(reason, str) and reason:
            self._finish_reason = reason
            self._close_reasoning(out)
            self._complete_calls(out)

    def _tool_delta(self, delta: dict[str, Any], out: list[StreamEvent]) -> None:
        call_id = delta.get("id")
        index = delta.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            # Some servers omit the index: a new id starts a call, anything else continues one.
            known = any(c.id == call_id for c in self._calls.values())
            continues = bool(self._calls) and (not call_id or known)
            index = max(self._calls) if continues else len(self._calls)
        call = self._calls.get(index)
        if call is None:
            call = self._calls[index] = _PendingCall(index)
        if isinstance(call_id, str) and call_id and not call.id:
            call.id = call_id
        function = delta.get("function")
        if isinstance(function, dict):
            name = function.get("name")
            if isinstance(name, str) and name and not call.name:
                call.name = name
            arguments = function.get("arguments")
            if isinstance(arguments, dict):
                arguments = orjson.dumps(arguments).decode()
            if isinstance(arguments, str) and arguments:
                call.arguments.append(arguments)
                if call.started:
                    out.append(ToolCallDelta(call.id, arguments))
        if not call.started and call.id and call.name:
            self._start(call, out)

    def _start(self, call: _PendingCall, out: list[StreamEvent]) -> None:
        call.started = True
        out.append(ToolCallStart(call.id, call.name))
        if call.arguments:
            out.append(ToolCallDelta(call.id, "".join(call.arguments)))

    def _complete_calls(self, out: list[StreamEvent]) -> None:
        if self._completed:
            return
        self._completed = True
        for index in sorted(self._calls):
            call = self._calls[index]
            if not call.started:
                if not call.name:
                    raise ProviderError(
                        f"provider {self.provider!r} sent tool call #{index} without a name; "
                        "the server's tool-call support may be broken"
                    )
                call.id = call.id or f"call_{index}"
                self._start(call, out)
            arguments = "".join(call.arguments).strip() or "{}"
            try:
                orjson.loads(arguments)
            except orjson.JSONDecodeError as exc:
                raise ProviderError(
                    f"model returned invalid JSON arguments for tool call {call.id!r} "
                    f"({call.name}) from provider {self.provider!r}: {quote(arguments)} ({exc})",
                    retryable=True,
                ) from exc
            out.append(ToolCallDone(call.id, call.name, arguments))

    def _close_reasoning(self, out: list[StreamEvent]) -> None:
        if self._reasoning_open:
            self._reasoning_open = False
            out.append(ReasoningDone())

    def _finish(self) -> list[StreamEvent]:
        self.done = True
        out: list[StreamEvent] = []
        self._close_reasoning(out)
        self._complete_calls(out)
        if self._finish_reason == "content_filter":
            raise ProviderError(
                f"provider {self.provider!r} stopped the reply with its content filter; "
                "rephrase the prompt"
            )
        if self._usage is not None:
            out.append(self._usage)
        if self._finish_reason == "length":
            reason = FinishReason.MAX_TOKENS
        elif self._calls:
            reason = FinishReason.TOOL_USE
        else:
            reason = _FINISH_REASONS.get(self._finish_reason, FinishReason.END_TURN)
            if reason is FinishReason.TOOL_USE:
                reason = FinishReason.END_TURN  # "tool_calls" without any call: nothing to run
        out.append(Finished(reason))
        return out


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _is_done(event: SSEEvent) -> bool:
    data = event.data
    # Only a short event can be the marker: a chunk's data is not copied to strip it.
    return len(data) <= MAX_DONE_CHARS and data.strip() == DONE_MARKER


# ---------------------------------------------------------------------------------------------
# The provider


class OpenAIProvider:
    """A Chat Completions provider (``type`` ``openai`` or ``openai-compat``).

    Args:
        name: the provider's name in ``crush.json``.
        settings: the provider's config (``base_url``, ``api_key``, headers, timeouts, retries).
        type: ``"openai"`` (``base_url`` defaults to :data:`DEFAULT_OPENAI_BASE_URL`) or
            ``"openai-compat"`` (``base_url`` required).

    Raises:
        ConfigError: an ``openai-compat`` provider without ``base_url``.

    Cancellation: see :meth:`stream`.
    """

    def __init__(
        self, name: str, settings: ProviderSettings, *, type: str = "openai-compat"
    ) -> None:
        self.name = name
        self.type = type
        base_url = settings.base_url or (DEFAULT_OPENAI_BASE_URL if type == "openai" else "")
        if not base_url:
            raise ConfigError(
                f"$.providers.{name}.base_url is required for type {type!r}: set it to the "
                "server's API root, e.g. http://127.0.0.1:11434/v1"
            )
        self.url = base_url.rstrip("/") + "/chat/completions"
        headers = {"authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self._http = HttpStreamer(name, settings, headers=headers)

    async def stream(self, request: ModelRequest) -> AsyncIterator[StreamEvent]:
        """Stream one model step: text, reasoning, tool calls, usage, then ``Finished``.

        Raises:
            ProviderError: see :class:`~crush_trio.providers.http.HttpStreamer` and
                :class:`ChatStreamParser`.

        Cancellation: closing or cancelling the generator closes the HTTP response.
        """
        parser = ChatStreamParser(self.name)
        body = build_chat_body(request)
        events = self._http.stream_sse(self.url, body, is_final=_is_done)
        pacer = READ_PACER.get()
        fold = pacer.fold if pacer is not None else None
        if fold is not None:  # a publish pass may take plain text in without this task
            fold.parse = parser.take_plain
        try:
            async with contextlib.aclosing(events):
                async for item in events:
                    if isinstance(item, Retrying):
                        yield item
                        continue
                    for event in parser.feed(item):
                        yield event
        finally:
            if fold is not None:
                fold.parse = None
        for event in parser.end():
            yield event

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._http.aclose()
