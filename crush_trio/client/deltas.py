"""Assembling streaming messages from ``message_delta`` events (plain logic, no I/O).

The payload of a ``message_delta`` event is :class:`~crush_trio.wire.MessageDelta`.

A client that opens its event stream with ``deltas=1`` (PROTOCOL §5, "Message deltas") gets a
streaming message as a ``message`` ``created`` snapshot, then ``message_delta`` events that each
append text to one part (``part``, ``part_type``, ``offset``: the field's length before the
append, in code points) and whole ``message`` snapshots for every change that is not an append.
A server that ignores ``deltas=1`` sends snapshots only; the :class:`Assembler` handles both.

The :class:`Assembler` keeps the latest state of each message that is still streaming and turns
every delta into the whole message as it now stands:

* a snapshot (a ``message`` event) supersedes everything assembled for its message, and any
  delta held for it;
* a delta whose ``offset`` is at most what the client has applies only the part of its text the
  client lacks (nothing when it is already covered);
* a delta the client cannot apply (an ``offset`` beyond what it has, a part it does not have, a
  message it never saw) means text is missing: :meth:`Assembler.apply` returns ``None``, the
  delta is held, and the caller re-reads the message over HTTP and hands it to
  :meth:`Assembler.refetched`, which takes it and then applies the held deltas on top of it (the
  deltas that arrived while the re-read was on its way).

Only assistant messages are kept (no other role streams), each until it carries a finish part
(no delta follows it), and at most
:data:`MAX_ASSEMBLED_MESSAGES` are kept: a delta of a forgotten message is treated as missing
text and re-read.
"""

from __future__ import annotations

import collections
from typing import Any, Final

import attrs

from ..wire import Message, MessageDelta, Part, ReasoningPart, Role, TextPart, ToolCallPart

#: Streaming messages whose state is kept; beyond it the least recently changed is forgotten.
MAX_ASSEMBLED_MESSAGES: Final = 256
#: Deltas held per message while its re-read is on its way; beyond it the oldest are dropped
#: (the re-read then shows them, or the next delta asks for another re-read).
MAX_HELD_DELTAS: Final = 4096

#: The field each ``part_type`` appends to.
PART_FIELDS: Final = {"text": "text", "reasoning": "thinking", "tool_call": "input"}
_PART_CLASSES: Final[dict[str, type[Any]]] = {
    "text": TextPart,
    "reasoning": ReasoningPart,
    "tool_call": ToolCallPart,
}


_FIELDS: dict[type[Any], tuple[str, ...]] = {}


def _replace(obj: Any, name: str, value: Any) -> Any:
    """``attrs.evolve(obj, name=value)`` for the wire's plain classes (every field positional),
    about four times cheaper: it runs once per delta."""
    cls = type(obj)
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(a.name for a in attrs.fields(cls))
    return cls(*[value if n == name else getattr(obj, n) for n in names])


def apply_delta(message: Message, delta: MessageDelta) -> Message | None:
    """``message`` with ``delta`` applied: a new :class:`Message` (``message`` itself when the
    delta's text is already covered), or ``None`` when text before the delta is missing (or the
    delta does not fit the message's parts).

    Unlike :func:`crush_trio.wire.apply_delta` it never changes ``message``, whose earlier
    versions may still wait in a consumer's mailbox."""
    parts = message.parts
    field = PART_FIELDS.get(delta.part_type)
    if field is None or delta.part < 0 or delta.offset < 0:
        return None
    if delta.part == len(parts):
        if delta.offset != 0:
            return None
        cls = _PART_CLASSES[delta.part_type]
        if cls is ToolCallPart:
            new: Part = ToolCallPart(delta.tool_call_id, delta.tool_name, delta.text)
        else:
            new = cls(**{field: delta.text})
        extended: Message = _replace(message, "parts", [*parts, new])
        return extended
    if delta.part > len(parts):
        return None
    part = parts[delta.part]
    if not isinstance(part, _PART_CLASSES[delta.part_type]):
        return None
    have: str = getattr(part, field)
    if delta.offset > len(have):
        return None
    if delta.offset + len(delta.text) <= len(have):
        return message
    appended = delta.text[len(have) - delta.offset :]
    changed = list(parts)
    changed[delta.part] = _replace(part, field, have + appended)
    result: Message = _replace(message, "parts", changed)
    return result


class Assembler:
    """The latest state of each streaming message, from snapshots and deltas (see the module
    docstring).

    Attributes:
        missing: ids of messages with text missing, whose re-read is awaited, and their session.
        applied, covered, held: counters of deltas applied, already covered, and held.
    """

    def __init__(
        self,
        max_messages: int = MAX_ASSEMBLED_MESSAGES,
        max_held: int = MAX_HELD_DELTAS,
    ) -> None:
        self.max_messages = max_messages
        self.max_held = max_held
        self._messages: collections.OrderedDict[str, Message] = collections.OrderedDict()
        self._held: dict[str, collections.deque[MessageDelta]] = {}
        self.missing: dict[str, str] = {}
        self.applied = 0
        self.covered = 0
        self.held = 0

    def __len__(self) -> int:
        return len(self._messages)

    def get(self, message_id: str) -> Message | None:
        """The assembled state of a message (``None`` for one not streaming here)."""
        return self._messages.get(message_id)

    def sessions(self) -> set[str]:
        """Sessions with a streaming message (or missing text): what a ``gap`` makes re-read."""
        out = {m.session_id for m in self._messages.values()}
        out.update(self.missing.values())
        return out

    def _keep(self, message: Message) -> None:
        if message.finish() is not None or message.role is not Role.ASSISTANT:
            self._messages.pop(message.id, None)
            return
        self._messages[message.id] = message
        self._messages.move_to_end(message.id)
        while len(self._messages) > self.max_messages:
            self._messages.popitem(last=False)

    def snapshot(self, message: Message) -> Message:
        """A ``message`` event: it supersedes what was assembled, and the deltas held for a
        re-read too (they came before it on the stream, so it holds their text, or a provider
        retry took it back). Returns the message."""
        self._held.pop(message.id, None)
        self.missing.pop(message.id, None)
        self._keep(message)
        return message

    def _take(self, message: Message) -> Message:
        held = self._held.pop(message.id, None)
        self.missing.pop(message.id, None)
        while held:
            applied = apply_delta(message, held[0])
            if applied is None:
                # Still missing: keep this delta and the later ones for the next re-read.
                self._held[message.id] = held
                self.missing[message.id] = message.session_id
                break
            held.popleft()
            message = applied
        self._keep(message)
        return message

    def refetched(self, message: Message) -> Message:
        """A message read over HTTP. It is taken when text of it was missing, or when it is not
        older than what was assembled (a re-read must not take back text already shown);
        returns the message as it now stands."""
        current = self._messages.get(message.id)
        if message.id in self.missing or current is None or not is_older(message, current):
            return self._take(message)
        return current

    def apply(self, delta: MessageDelta) -> Message | None:
        """Apply one delta; the message as it now stands, or ``None`` when text is missing (the
        delta is held and :attr:`missing` names the message: re-read it)."""
        current = self._messages.get(delta.message_id)
        if current is not None and delta.message_id not in self.missing:
            result = apply_delta(current, delta)
            if result is not None:
                if result is current:
                    self.covered += 1
                else:
                    self.applied += 1
                    self._keep(result)
                return result
        self._hold(delta)
        return None

    def _hold(self, delta: MessageDelta) -> None:
        self.held += 1
        self.missing[delta.message_id] = delta.session_id
        held = self._held.setdefault(delta.message_id, collections.deque())
        held.append(delta)
        if len(held) > self.max_held:
            held.popleft()

    def forget(self, message_id: str) -> None:
        """Drop a message (and its held deltas)."""
        self._messages.pop(message_id, None)
        self._held.pop(message_id, None)
        self.missing.pop(message_id, None)

    def forget_session(self, session_id: str) -> None:
        """Drop every message of a session (its messages were deleted)."""
        for mid in [m.id for m in self._messages.values() if m.session_id == session_id]:
            del self._messages[mid]
        for mid in [mid for mid, sid in self.missing.items() if sid == session_id]:
            del self.missing[mid]
            self._held.pop(mid, None)


def _progress(message: Message) -> tuple[int, int, int]:
    """How far a message has streamed: (finished, parts, streamed code points)."""
    size = 0
    for part in message.parts:
        if isinstance(part, TextPart):
            size += len(part.text)
        elif isinstance(part, ReasoningPart):
            size += len(part.thinking)
        elif isinstance(part, ToolCallPart):
            size += len(part.input)
    return (message.finish() is not None, len(message.parts), size)


def is_older(candidate: Message, current: Message) -> bool:
    """True when ``candidate`` shows less of the message than ``current`` (a stale read)."""
    return _progress(candidate) < _progress(current)
