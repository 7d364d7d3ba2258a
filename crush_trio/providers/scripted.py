"""A scripted model for tests: replies, tool calls, errors, and gates that hold a run at a phase.

A :class:`ScriptedModel` is a provider factory (pass it as ``provider_factory``): every provider it
makes shares its script. Each model step takes the next :class:`Step` from the script (or, when
the script is empty, echoes the last user message like the built-in echo model) and records the
:class:`~crush_trio.providers.base.ModelRequest` it was given, so a test can assert exactly what
history reached the model.

Gates make phases deterministic: a step with ``gate_before`` stops before streaming anything, one
with ``gate_mid`` stops after the first half of its text, until the test calls
:meth:`Gate.release`. :meth:`Gate.reached` tells the test the run is parked there.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import attrs
import orjson
import trio

from ..errors import ProviderError
from ..wire import FinishReason, Role, TextPart
from . import base as pb

if TYPE_CHECKING:
    from collections.abc import AsyncIterator


class Gate:
    """A point where a scripted step waits until the test releases it."""

    def __init__(self) -> None:
        self.reached = trio.Event()
        self._open = trio.Event()

    def release(self) -> None:
        self._open.set()

    async def passthrough(self) -> None:
        self.reached.set()
        await self._open.wait()


@attrs.define
class Step:
    """One scripted model step.

    Attributes:
        text: streamed word by word (whitespace kept, so the reply equals ``text``).
        tool_calls: ``(name, arguments)`` pairs; the step then finishes with ``tool_use``.
        error: raised after ``text`` was streamed (a provider failure mid-stream when text is
            non-empty, before any output otherwise).
        gate_before / gate_mid: see the module docstring.
        reasoning: streamed as reasoning before the text.
        token_delay: pause before each word of ``text`` after the first (seconds), like a model
            that streams at a steady pace.
        usage: the step's reported usage as ``Usage`` (default: 10 prompt tokens and one
            completion token per word).
    """

    text: str = ""
    tool_calls: list[tuple[str, dict[str, Any]]] = attrs.field(factory=list)
    error: Exception | None = None
    gate_before: Gate | None = None
    gate_mid: Gate | None = None
    reasoning: str = ""
    token_delay: float = 0.0
    usage: pb.Usage | None = None


def _words(text: str) -> list[str]:
    out: list[str] = []
    current = ""
    for ch in text:
        if ch.isspace() and current and not current[-1].isspace():
            out.append(current)
            current = ""
        current += ch
    if current:
        out.append(current)
    return out


class ScriptedModel:
    """The shared script of every provider it makes (see the module docstring)."""

    def __init__(self, steps: list[Step] | None = None) -> None:
        self.steps: collections.deque[Step] = collections.deque(steps or [])
        self.requests: list[pb.ModelRequest] = []
        self.title_requests: list[pb.ModelRequest] = []
        #: Requests for a session summary (also in ``requests``, in order).
        self.summary_requests: list[pb.ModelRequest] = []
        self.streams_open = 0
        self.step_started = trio.Event()
        #: Providers made and closed (a workspace closes the ones a new configuration replaced).
        self.providers_made = 0
        self.providers_closed = 0

    def add(self, *steps: Step) -> None:
        self.steps.extend(steps)

    def __call__(self, name: str, cfg: Any) -> pb.Provider:
        self.providers_made += 1
        return _ScriptedProvider(self, name)

    async def stream(self, request: pb.ModelRequest) -> AsyncIterator[pb.StreamEvent]:
        if request.purpose is pb.RequestPurpose.TITLE:
            self.title_requests.append(request)
            yield pb.TextDelta("Scripted title")
            yield pb.Finished(FinishReason.END_TURN)
            return
        self.requests.append(request)
        if request.purpose is pb.RequestPurpose.SUMMARY:
            self.summary_requests.append(request)
        self.step_started.set()
        self.step_started = trio.Event()
        step = self.steps.popleft() if self.steps else None
        if step is None:
            last = next((m for m in reversed(request.messages) if m.role is Role.USER), None)
            text = "".join(p.text for p in last.parts if isinstance(p, TextPart)) if last else ""
            step = Step(text=text)
        self.streams_open += 1
        try:
            if step.gate_before is not None:
                await step.gate_before.passthrough()
            await trio.lowlevel.checkpoint()
            if step.reasoning:
                yield pb.ReasoningDelta(step.reasoning)
                yield pb.ReasoningDone("sig")
            words = _words(step.text)
            half = len(words) // 2
            for i, word in enumerate(words):
                if i == half and step.gate_mid is not None:
                    await step.gate_mid.passthrough()
                if i and step.token_delay:
                    await trio.sleep(step.token_delay)
                yield pb.TextDelta(word)
                await trio.lowlevel.checkpoint()
            if not words and step.gate_mid is not None:
                await step.gate_mid.passthrough()
            if step.error is not None:
                raise step.error
            for i, (name, args) in enumerate(step.tool_calls):
                call_id = f"call_{len(self.requests)}_{i}"
                yield pb.ToolCallStart(call_id, name)
                yield pb.ToolCallDone(call_id, name, orjson.dumps(args).decode())
            yield step.usage if step.usage is not None else pb.Usage(10, len(words))
            yield pb.Finished(FinishReason.TOOL_USE if step.tool_calls else FinishReason.END_TURN)
        finally:
            self.streams_open -= 1


class _ScriptedProvider:
    type = "scripted"

    def __init__(self, model: ScriptedModel, name: str) -> None:
        self.model = model
        self.name = name

    def stream(self, request: pb.ModelRequest) -> AsyncIterator[pb.StreamEvent]:
        return self.model.stream(request)

    async def aclose(self) -> None:
        self.model.providers_closed += 1


def provider_failure(message: str = "scripted provider failure") -> ProviderError:
    return ProviderError(message)
