"""The client's assembly of streaming messages from ``message_delta`` events (no I/O, no loop).

A final message is cut into random chunks (the deltas a server would send, coalesced or not),
some delivered twice, some dropped; the assembled message must equal the final one whenever every
byte arrived, and a dropped delta must be detected (``apply`` returns ``None``) and repaired by a
re-read plus the deltas held meanwhile.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from crush_trio.client.deltas import Assembler, apply_delta
from crush_trio.client.events import decode_frame
from crush_trio.client.transcript import Transcript
from crush_trio.wire import (
    DeltaPartType,
    FinishPart,
    FinishReason,
    Message,
    MessageDelta,
    ReasoningPart,
    Role,
    TextPart,
    ToolCallPart,
)

MID, SID = "m1", "s1"
TEXT, REASONING, TOOL_CALL = DeltaPartType

# Code points of several widths in UTF-8 and UTF-16 (offsets count code points).
texts = st.text(alphabet=st.sampled_from("ab é€😀\n#*"), min_size=0, max_size=60)


def empty() -> Message:
    return Message(MID, SID, Role.ASSISTANT, [], created_at=1, updated_at=1)


@st.composite
def final_messages(draw: Any) -> Message:
    """A finished-looking assistant message: reasoning, text and tool-call parts."""
    parts: list[Any] = []
    for kind in draw(st.lists(st.sampled_from(["text", "reasoning", "tool_call"]), max_size=4)):
        body = draw(texts)
        if kind == "text":
            parts.append(TextPart(body))
        elif kind == "reasoning":
            parts.append(ReasoningPart(thinking=body))
        else:
            parts.append(ToolCallPart(f"call{len(parts)}", "bash", body))
    return Message(MID, SID, Role.ASSISTANT, parts, created_at=1, updated_at=1)


FIELD = {TextPart: (TEXT, "text"), ReasoningPart: (REASONING, "thinking")}


def chunked(final: Message, cuts: Any) -> list[MessageDelta]:
    """The deltas that build ``final`` from an empty message, each part cut at random points."""
    out: list[MessageDelta] = []
    for index, part in enumerate(final.parts):
        if isinstance(part, ToolCallPart):
            kind, body, call = TOOL_CALL, part.input, (part.id, part.name)
        else:
            kind, field = FIELD[type(part)]
            body, call = getattr(part, field), ("", "")
        points = sorted({0, len(body), *cuts(len(body))})
        if len(points) == 1:
            points = [0, 0]  # an empty part is created by one empty delta
        for a, b in itertools.pairwise(points):
            first = a == 0
            out.append(
                MessageDelta(
                    MID,
                    SID,
                    index,
                    kind,
                    a,
                    body[a:b],
                    call[0] if first else "",
                    call[1] if first else "",
                )
            )
    return out


@st.composite
def deltas_of(draw: Any, final: Message) -> list[MessageDelta]:
    def cuts(n: int) -> list[int]:
        return draw(st.lists(st.integers(0, n), max_size=8)) if n else []

    return chunked(final, cuts)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.data())
def test_random_chunkings_assemble_the_final_message(data: st.DataObject) -> None:
    final = data.draw(final_messages())
    deltas = data.draw(deltas_of(final))
    # Replays repeat deltas already applied (e.g. after a reconnect with since): harmless.
    repeats = data.draw(st.lists(st.integers(0, max(0, len(deltas) - 1)), max_size=5))
    stream: list[MessageDelta] = []
    for i, delta in enumerate(deltas):
        stream.append(delta)
        if i in repeats:
            stream.append(delta)
    asm = Assembler()
    asm.snapshot(empty())
    transcript = Transcript()
    printed = ""
    for delta in stream:
        message = asm.apply(delta)
        assert message is not None, delta
        printed += transcript.update(message)
    assembled = asm.get(MID)
    assert assembled is not None
    assert assembled.parts == final.parts
    assert printed == final.text()
    assert not asm.missing


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.data())
def test_a_dropped_delta_is_detected_and_a_reread_plus_held_deltas_converge(
    data: st.DataObject,
) -> None:
    final = data.draw(final_messages())
    deltas = data.draw(deltas_of(final))
    if not deltas:
        return
    lost = data.draw(st.integers(0, len(deltas) - 1))
    # The re-read answers with the message as the server had it somewhere at or after the lost
    # delta (a read never shows less than an event already sent).
    reread_at = data.draw(st.integers(lost + 1, len(deltas)))
    asm = Assembler()
    asm.snapshot(empty())
    for delta in deltas[:lost]:
        assert asm.apply(delta) is not None
    detected = False
    for delta in deltas[lost + 1 : reread_at]:
        if asm.apply(delta) is None:
            detected = True
            assert asm.missing == {MID: SID}
    # A later delta of the same part always shows the hole (its offset is beyond what the
    # client has); the lost tail of a part followed by a new part shows by the seq gap only.
    same_part_later = any(
        d.part == deltas[lost].part and d.text for d in deltas[lost + 1 : reread_at]
    )
    if same_part_later and deltas[lost].text:
        assert detected
    server = empty()
    for delta in deltas[:reread_at]:
        applied = apply_delta(server, delta)
        assert applied is not None
        server = applied
    asm.refetched(server)
    for delta in deltas[reread_at:]:
        assert asm.apply(delta) is not None
    assembled = asm.get(MID)
    assert assembled is not None
    assert assembled.parts == final.parts
    assert not asm.missing


def test_offset_beyond_what_the_client_has_is_missing_text() -> None:
    asm = Assembler()
    asm.snapshot(empty())
    assert asm.apply(MessageDelta(MID, SID, 0, TEXT, 0, "Hello")) is not None
    assert asm.apply(MessageDelta(MID, SID, 0, TEXT, 7, "world")) is None
    assert asm.missing == {MID: SID}
    # Later deltas are held too, in order, until the re-read.
    assert asm.apply(MessageDelta(MID, SID, 0, TEXT, 12, "!")) is None
    reread = attrs.evolve(empty(), parts=[TextPart("Hello, wor")])
    message = asm.refetched(reread)
    assert message.text() == "Hello, world!"
    assert not asm.missing


def test_a_snapshot_supersedes_what_was_assembled() -> None:
    asm = Assembler()
    asm.snapshot(empty())
    asm.apply(MessageDelta(MID, SID, 0, TEXT, 0, "draft"))
    retry = attrs.evolve(empty(), parts=[TextPart("Other")])
    assert asm.snapshot(retry).text() == "Other"
    assert asm.apply(MessageDelta(MID, SID, 0, TEXT, 5, " text")).text() == "Other text"  # type: ignore[union-attr]


def test_a_snapshot_drops_the_deltas_held_before_it() -> None:
    """Held deltas came before the snapshot on the stream; after a provider retry took the text
    back, applying them would bring the old text back."""
    asm = Assembler()
    asm.snapshot(empty())
    asm.apply(MessageDelta(MID, SID, 0, TEXT, 0, "Old"))
    assert asm.apply(MessageDelta(MID, SID, 0, TEXT, 10, "lost")) is None
    retry = attrs.evolve(empty(), parts=[TextPart("New")])
    assert asm.snapshot(retry).text() == "New"
    assert not asm.missing
    assert asm.apply(MessageDelta(MID, SID, 0, TEXT, 3, " text")).text() == "New text"  # type: ignore[union-attr]


def test_a_stale_reread_does_not_take_back_text() -> None:
    asm = Assembler()
    asm.snapshot(empty())
    asm.apply(MessageDelta(MID, SID, 0, TEXT, 0, "Hello world"))
    stale = attrs.evolve(empty(), parts=[TextPart("Hello")])
    assert asm.refetched(stale).text() == "Hello world"


def test_deltas_of_unknown_messages_and_parts_are_missing() -> None:
    asm = Assembler()
    assert asm.apply(MessageDelta("other", SID, 0, TEXT, 0, "x")) is None
    assert asm.missing == {"other": SID}
    asm.snapshot(empty())
    # A part two beyond the end, a new part not starting at 0, a part of another type.
    assert asm.apply(MessageDelta(MID, SID, 1, TEXT, 0, "x")) is None
    asm = Assembler()
    asm.snapshot(empty())
    assert asm.apply(MessageDelta(MID, SID, 0, TEXT, 3, "x")) is None
    asm = Assembler()
    asm.snapshot(attrs.evolve(empty(), parts=[TextPart("a")]))
    assert asm.apply(MessageDelta(MID, SID, 0, REASONING, 1, "x")) is None


def test_a_new_tool_call_part_carries_its_id_and_name() -> None:
    asm = Assembler()
    asm.snapshot(empty())
    message = asm.apply(MessageDelta(MID, SID, 0, TOOL_CALL, 0, '{"cmd"', "call1", "bash"))
    assert message is not None
    assert message.parts == [ToolCallPart("call1", "bash", '{"cmd"')]


def test_finished_messages_are_forgotten_and_the_count_is_bounded() -> None:
    asm = Assembler(max_messages=3)
    for i in range(5):
        asm.snapshot(Message(f"m{i}", SID, Role.ASSISTANT, [TextPart("x")]))
    assert len(asm) == 3
    assert asm.get("m0") is None
    assert asm.get("m4") is not None
    finished = Message(
        "m4", SID, Role.ASSISTANT, [TextPart("x"), FinishPart(FinishReason.END_TURN)]
    )
    asm.snapshot(finished)
    assert asm.get("m4") is None
    # Only assistant messages stream: a user message is not kept.
    asm.snapshot(Message("u1", SID, Role.USER, [TextPart("prompt")]))
    assert asm.get("u1") is None
    asm.forget_session(SID)
    assert len(asm) == 0


def test_decode_delta_frames() -> None:
    frame: dict[str, Any] = {
        "seq": 7,
        "type": "message_delta",
        "payload": {
            "type": "updated",
            "payload": {
                "message_id": MID,
                "session_id": SID,
                "part": 0,
                "part_type": "text",
                "offset": 12,
                "text": "world",
                "tool_call_id": "",
                "tool_name": "",
            },
        },
    }
    event = decode_frame(frame)
    assert event is not None
    assert event.type == "message_delta"
    assert event.seq == 7
    assert event.payload == MessageDelta(MID, SID, 0, TEXT, 12, "world")
    assert event.to_json() is frame
    for bad in ({"offset": "3"}, {"text": None}):
        body = {**frame["payload"]["payload"], **bad}
        assert decode_frame({**frame, "payload": {"type": "updated", "payload": body}}) is None
    asm = Assembler()
    asm.snapshot(attrs.evolve(empty(), parts=[TextPart("a")]))
    # A part type this client does not know is never applied: the message is re-read.
    unknown = {**frame["payload"]["payload"], "message_id": MID, "part_type": "image"}
    event = decode_frame({**frame, "payload": {"type": "updated", "payload": unknown}})
    assert event is None or asm.apply(event.payload) is None
    # A negative index or offset never decodes (it would index parts from the end).
    for bad in ({"part": -1}, {"offset": -1}):
        body = {**frame["payload"]["payload"], **bad}
        assert decode_frame({**frame, "payload": {"type": "updated", "payload": body}}) is None
