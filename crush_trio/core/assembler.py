"""Folding a model step's provider events into its assistant message, as plain logic.

No I/O and no event loop: :class:`StepAssembler` takes the events of one provider stream
(:mod:`crush_trio.core.model`) and changes the message in place; the shell
(:mod:`crush_trio.agent.runner`) saves and publishes the message when :meth:`StepAssembler.feed`
says it changed, and performs the side effects of the events that do not touch the message
(usage is added to the session, a retry is announced).

Rules:

* text deltas grow one text part, reasoning deltas one reasoning part (each made at its first
  delta, in the order the parts started); ``ReasoningDone`` stamps the signature and end time;
* a tool call part is made at ``ToolCallStart`` (or at ``ToolCallDone`` for a call that never
  announced its start), grows with its argument deltas and is marked finished by ``ToolCallDone``;
* ``Retrying`` (the provider starts the step again) drops the text and reasoning streamed so far,
  keeping the tool call parts; the next change saves the reset message;
* :attr:`StepAssembler.append` tells whether the last change was an append (text, reasoning or a
  tool call's input grew; the shell publishes it as a ``message_delta``) or not (None: anything
  else, and the first change after a ``Retrying``, which the shell publishes whole);
* ``Finished`` records the finish reason; :meth:`StepAssembler.finish` appends it as a finish
  part, turned into ``tool_use`` when the message holds tool calls.
"""

from __future__ import annotations

import attrs
import orjson

from ..wire import (
    DeltaPartType,
    FinishPart,
    FinishReason,
    Message,
    MessageDelta,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    now,
)
from . import model as pb


@attrs.define
class StepAssembler:
    """The assistant message of one model step, built from the step's provider events."""

    msg: Message
    reason: FinishReason = FinishReason.END_TURN
    _text: TextPart | None = None
    _reasoning: ReasoningPart | None = None
    _calls: dict[str, ToolCallPart] = attrs.field(factory=dict)
    #: The last change as an append to one part (None: not an append; publish the message whole).
    append: MessageDelta | None = None
    _text_at: int = 0
    _reasoning_at: int = 0
    _call_at: dict[str, int] = attrs.field(factory=dict)
    _reset: bool = False  # a Retrying dropped parts: the next change is not an append

    def _delta(self, part: int, part_type: DeltaPartType, offset: int, text: str) -> None:
        msg = self.msg
        self.append = MessageDelta(msg.id, msg.session_id, part, part_type, offset, text)

    @property
    def appending(self) -> bool:
        """Whether the next text or reasoning delta is an append (:attr:`append` set); not
        right after a ``Retrying``, whose change is published whole."""
        return not self._reset

    def feed(self, event: pb.StreamEvent) -> bool:
        """Fold one event into the message. True: the message changed and should be saved
        (its ``updated_at`` is set; :attr:`append` says whether it was an append); False for
        ``Usage``, ``Retrying`` and ``Finished``."""
        msg = self.msg
        self.append = None
        match event:
            case pb.TextDelta(delta):
                if self._text is None:
                    self._text = TextPart("")
                    self._text_at = len(msg.parts)
                    msg.parts.append(self._text)
                offset = len(self._text.text)
                self._text.text += delta
                self._delta(self._text_at, DeltaPartType.TEXT, offset, delta)
            case pb.ReasoningDelta(delta):
                if self._reasoning is None:
                    self._reasoning = ReasoningPart(started_at=now())
                    self._reasoning_at = len(msg.parts)
                    msg.parts.append(self._reasoning)
                offset = len(self._reasoning.thinking)
                self._reasoning.thinking += delta
                self._delta(self._reasoning_at, DeltaPartType.REASONING, offset, delta)
            case pb.ReasoningDone(signature):
                if self._reasoning is not None:
                    self._reasoning.signature = signature
                    self._reasoning.finished_at = now()
            case pb.ToolCallStart(call_id, name):
                self._calls[call_id] = ToolCallPart(call_id, name)
                self._call_at[call_id] = len(msg.parts)
                msg.parts.append(self._calls[call_id])
            case pb.ToolCallDelta(call_id, arguments):
                if call_id in self._calls:
                    call = self._calls[call_id]
                    offset = len(call.input)
                    call.input += arguments
                    self._delta(self._call_at[call_id], DeltaPartType.TOOL_CALL, offset, arguments)
            case pb.ToolCallDone(call_id, name, input_json):
                part = self._calls.get(call_id)
                if part is None:
                    part = self._calls[call_id] = ToolCallPart(call_id, name)
                    self._call_at[call_id] = len(msg.parts)
                    msg.parts.append(part)
                part.input, part.finished = input_json, True
            case pb.Usage():
                return False
            case pb.Retrying():
                msg.parts = [p for p in msg.parts if isinstance(p, ToolCallPart)]
                self._call_at = {
                    p.id: i for i, p in enumerate(msg.parts) if isinstance(p, ToolCallPart)
                }
                self._text = self._reasoning = None
                self._reset = True
                return False
            case pb.Finished(finish_reason):
                self.reason = finish_reason
                return False
        if self._reset:
            self._reset = False
            self.append = None
        msg.updated_at = now()
        return True

    def finish(self) -> FinishReason:
        """The stream ended: append the finish part and return the step's finish reason."""
        if self.reason is not FinishReason.TOOL_USE and self.msg.tool_calls():
            self.reason = FinishReason.TOOL_USE
        self.msg.parts.append(FinishPart(self.reason))
        self.msg.updated_at = now()
        self.append = None
        return self.reason


def repair_tool_calls(msg: Message) -> None:
    """Make the message's tool calls valid for any provider: an unfinished call, or one whose
    input is not JSON, is marked finished with input ``{}``."""
    for call in msg.tool_calls():
        if not call.finished:
            call.finished = True
            call.input = "{}"
        else:
            try:
                orjson.loads(call.input or "{}")
            except orjson.JSONDecodeError:
                call.input = "{}"
