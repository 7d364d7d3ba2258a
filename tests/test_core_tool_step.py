"""The plain parts of the tool step (repeated-call guard, missing results), without a loop."""

from __future__ import annotations

import pytest

from crush_trio.agent.tool_step import (
    CANCELED_TOOL_RESULT,
    FAILED_TOOL_RESULT,
    RepeatedCalls,
    missing_results,
)
from crush_trio.errors import ProviderError
from crush_trio.wire import Message, Role, ToolCallPart, ToolResultPart


def _calls(*specs: tuple[str, str]) -> list[ToolCallPart]:
    return [
        ToolCallPart(f"c{i}", name, args, finished=True) for i, (name, args) in enumerate(specs)
    ]


@pytest.mark.parametrize(
    ("steps", "stops_at"),
    [
        ([[("ls", "{}")]] * 3, None),  # under the limit
        ([[("ls", "{}")]] * 3 + [[("view", "{}")]] + [[("ls", "{}")]] * 2, None),  # broken run
        ([[("ls", "{}")]] * 2 + [[("ls", '{"a":1}')]] * 3, None),  # same name, other input
        ([[("ls", "{}")]] * 3, 3),  # limit 3 reached at the third step
        ([[("ls", "{}"), ("view", "{}")]] * 4, 3),  # the whole set of calls repeats
    ],
)
def test_repeated_calls(steps: list[list[tuple[str, str]]], stops_at: int | None) -> None:
    guard = RepeatedCalls(limit=3) if stops_at is not None else RepeatedCalls()
    for index, step in enumerate(steps, 1):
        if index == stops_at:
            with pytest.raises(ProviderError, match="repeated the same tool call 3 times"):
                guard.check(_calls(*step))
            return
        guard.check(_calls(*step))
    assert stops_at is None


@pytest.mark.parametrize(
    ("done", "cancelled", "expected"),
    [
        (set(), True, [("c0", CANCELED_TOOL_RESULT), ("c1", CANCELED_TOOL_RESULT)]),
        ({"c0"}, False, [("c1", FAILED_TOOL_RESULT)]),
        ({"c0", "c1"}, True, []),
    ],
)
def test_missing_results(done: set[str], cancelled: bool, expected: list[tuple[str, str]]) -> None:
    msg = Message("m", "s", Role.ASSISTANT, list(_calls(("ls", "{}"), ("view", "{}"))))
    parts = missing_results(msg, done, cancelled=cancelled)
    assert all(isinstance(p, ToolResultPart) and p.is_error for p in parts)
    assert [(p.tool_call_id, p.content) for p in parts if isinstance(p, ToolResultPart)] == expected
