"""The step assembler (crush_trio.core.assembler) as tables: provider events in, message parts
and save decisions out, without an event loop."""

from __future__ import annotations

from typing import Any

import pytest

from crush_trio.core.assembler import StepAssembler, repair_tool_calls
from crush_trio.providers import base as pb
from crush_trio.wire import (
    FinishPart,
    FinishReason,
    Message,
    ReasoningPart,
    Role,
    TextPart,
    ToolCallPart,
)


def _summary(msg: Message) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for part in msg.parts:
        if isinstance(part, TextPart):
            out.append(("text", part.text))
        elif isinstance(part, ReasoningPart):
            out.append(("reasoning", part.thinking, part.signature, part.finished_at is not None))
        elif isinstance(part, ToolCallPart):
            out.append(("call", part.id, part.name, part.input, part.finished))
        elif isinstance(part, FinishPart):
            out.append(("finish", part.reason))
    return out


#: (name, events, saves (feed's answer per event), parts after finish())
CASES: list[tuple[str, list[Any], list[bool], list[tuple[Any, ...]]]] = [
    (
        "text deltas grow one part",
        [pb.TextDelta("Hel"), pb.TextDelta("lo"), pb.Finished(FinishReason.END_TURN)],
        [True, True, False],
        [("text", "Hello"), ("finish", FinishReason.END_TURN)],
    ),
    (
        "reasoning before text, signed",
        [
            pb.ReasoningDelta("think"),
            pb.ReasoningDelta("ing"),
            pb.ReasoningDone("sig"),
            pb.TextDelta("answer"),
        ],
        [True, True, True, True],
        [
            ("reasoning", "thinking", "sig", True),
            ("text", "answer"),
            ("finish", FinishReason.END_TURN),
        ],
    ),
    (
        "reasoning done without reasoning changes nothing but is saved",
        [pb.ReasoningDone("sig")],
        [True],
        [("finish", FinishReason.END_TURN)],
    ),
    (
        "a tool call streamed in pieces",
        [
            pb.ToolCallStart("c1", "view"),
            pb.ToolCallDelta("c1", '{"path":'),
            pb.ToolCallDelta("c1", '"a"}'),
            pb.ToolCallDone("c1", "view", '{"path":"a"}'),
            pb.Finished(FinishReason.TOOL_USE),
        ],
        [True, True, True, True, False],
        [("call", "c1", "view", '{"path":"a"}', True), ("finish", FinishReason.TOOL_USE)],
    ),
    (
        "a call done without a start is made at its end",
        [pb.ToolCallDone("c2", "ls", "{}")],
        [True],
        [("call", "c2", "ls", "{}", True), ("finish", FinishReason.TOOL_USE)],
    ),
    (
        "a delta for an unknown call is ignored",
        [pb.ToolCallDelta("nope", "{}"), pb.TextDelta("x")],
        [True, True],
        [("text", "x"), ("finish", FinishReason.END_TURN)],
    ),
    (
        "tool calls make the finish tool_use",
        [pb.ToolCallStart("c1", "ls"), pb.Finished(FinishReason.END_TURN)],
        [True, False],
        [("call", "c1", "ls", "", False), ("finish", FinishReason.TOOL_USE)],
    ),
    (
        "usage is not a message change",
        [pb.Usage(10, 5), pb.TextDelta("x")],
        [False, True],
        [("text", "x"), ("finish", FinishReason.END_TURN)],
    ),
    (
        "a retry drops text and reasoning, keeps calls, and starts new parts",
        [
            pb.ReasoningDelta("r"),
            pb.TextDelta("lost"),
            pb.ToolCallStart("c1", "ls"),
            pb.Retrying(1, 0.5, "overloaded"),
            pb.TextDelta("kept"),
        ],
        [True, True, True, False, True],
        [("call", "c1", "ls", "", False), ("text", "kept"), ("finish", FinishReason.TOOL_USE)],
    ),
    (
        "the last finish reason wins",
        [pb.Finished(FinishReason.MAX_TOKENS)],
        [False],
        [("finish", FinishReason.MAX_TOKENS)],
    ),
]


@pytest.mark.parametrize(("name", "events", "saves", "parts"), CASES, ids=[c[0] for c in CASES])
def test_assembler_table(name: str, events: list[Any], saves: list[bool], parts: list[Any]) -> None:
    msg = Message("m1", "s", Role.ASSISTANT)
    assembler = StepAssembler(msg)
    answers = []
    for event in events:
        before = msg.updated_at
        changed = assembler.feed(event)
        answers.append(changed)
        if not changed:
            assert msg.updated_at == before
    assert answers == saves
    reason = assembler.finish()
    assert _summary(msg) == parts
    assert reason is parts[-1][1]


@pytest.mark.parametrize(
    ("finished", "given", "expected"),
    [
        (False, '{"path":', "{}"),  # unfinished: reset
        (True, '{"path":', "{}"),  # finished but not JSON: reset
        (True, '{"path":"a"}', '{"path":"a"}'),  # valid: kept
        (True, "", ""),  # empty counts as {}
    ],
)
def test_repair_tool_calls(finished: bool, given: str, expected: str) -> None:
    call = ToolCallPart("c1", "view", given, finished=finished)
    msg = Message("m1", "s", Role.ASSISTANT, [call])
    repair_tool_calls(msg)
    assert call.input == expected
    assert call.finished
