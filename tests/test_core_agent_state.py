"""The agent's run bookkeeping (crush_trio.core.agent_state) as tables, without an event loop.

Each case is a script of operations on one AgentState and what they answer; ``session`` reads
back (busy, active turn's run ids, queued run ids) after the script."""

from __future__ import annotations

from typing import Any

import pytest

from crush_trio.core.agent_state import Admission, AgentState, Turn
from crush_trio.errors import IllegalTransition


def _run(state: AgentState, turns: dict[str, Turn], op: tuple[Any, ...]) -> Any:
    """Apply one scripted operation; returns what the test compares."""
    match op:
        case ("accept", sid, rid):
            return _accept(state, turns, sid, rid, explicit=True)
        case ("accept_folding", sid, rid):
            return _accept(state, turns, sid, rid, explicit=False)
        case ("fold", sid):
            return [p.run_id for p in state.take_foldable(sid)]
        case ("cancel", sid):
            out = state.cancel(sid)
            return (out.turn.primary.run_id if out.turn else None, [p.run_id for p in out.dropped])
        case ("cancel_run", rid):
            out = state.cancel_run(rid)
            if out is None:
                return None
            return (out.turn.primary.run_id if out.turn else None, [p.run_id for p in out.dropped])
        case ("clear", sid):
            return [p.run_id for p in state.clear_queue(sid)]
        case ("finish", rid):
            nxt, dropped = state.finish_turn(turns[rid])
            if nxt is not None:
                turns[nxt.primary.run_id] = nxt
            return (nxt.primary.run_id if nxt else None, [p.run_id for p in dropped])
    raise AssertionError(op)


def _accept(
    state: AgentState, turns: dict[str, Turn], sid: str, rid: str, *, explicit: bool
) -> str:
    prompt, admission, turn = state.accept(sid, rid, f"text {rid}", explicit=explicit, size=3)
    assert (turn is not None) == (admission is Admission.RUN)
    if turn is not None:
        turns[rid] = turn
    return admission.value


def _session(state: AgentState, sid: str) -> tuple[bool, list[str], list[str]]:
    active = state._sessions[sid].active if sid in state._sessions else None
    return (
        state.is_busy(sid),
        [p.run_id for p in active.prompts] if active else [],
        [p.run_id for p in state.queued(sid)],
    )


#: (name, [(operation, expected answer)], expected session "s" afterwards)
CASES: list[tuple[str, list[tuple[tuple[Any, ...], Any]], tuple[bool, list[str], list[str]]]] = [
    ("idle session runs at once", [(("accept", "s", "r1"), "running")], (True, ["r1"], [])),
    (
        "busy session queues",
        [(("accept", "s", "r1"), "running"), (("accept", "s", "r2"), "queued")],
        (True, ["r1"], ["r2"]),
    ),
    (
        "finish starts the oldest queued prompt",
        [
            (("accept", "s", "r1"), "running"),
            (("accept", "s", "r2"), "queued"),
            (("accept", "s", "r3"), "queued"),
            (("finish", "r1"), ("r2", [])),
        ],
        (True, ["r2"], ["r3"]),
    ),
    (
        "finish of the last turn leaves the session idle",
        [(("accept", "s", "r1"), "running"), (("finish", "r1"), (None, []))],
        (False, [], []),
    ),
    (
        "prompts without run_id fold at the next step, explicit ones stay",
        [
            (("accept", "s", "r1"), "running"),
            (("accept_folding", "s", "f1"), "queued"),
            (("accept", "s", "r2"), "queued"),
            (("accept_folding", "s", "f2"), "queued"),
            (("fold", "s"), ["f1", "f2"]),
            (("fold", "s"), []),
        ],
        (True, ["r1", "f1", "f2"], ["r2"]),
    ),
    (
        "cancel stops the turn and drops the queue",
        [
            (("accept", "s", "r1"), "running"),
            (("accept", "s", "r2"), "queued"),
            (("cancel", "s"), ("r1", ["r2"])),
            (("fold", "s"), []),
        ],
        (True, ["r1"], []),
    ),
    (
        "a prompt accepted after a cancel runs normally",
        [
            (("accept", "s", "r1"), "running"),
            (("cancel", "s"), ("r1", [])),
            (("accept", "s", "r2"), "queued"),
            (("finish", "r1"), ("r2", [])),
        ],
        (True, ["r2"], []),
    ),
    ("cancel on an idle session changes nothing", [(("cancel", "s"), (None, []))], (False, [], [])),
    (
        "cancel_run of a queued prompt drops only it",
        [
            (("accept", "s", "r1"), "running"),
            (("accept", "s", "r2"), "queued"),
            (("accept", "s", "r3"), "queued"),
            (("cancel_run", "r2"), (None, ["r2"])),
        ],
        (True, ["r1"], ["r3"]),
    ),
    (
        "cancel_run of a folded prompt cancels its turn",
        [
            (("accept", "s", "r1"), "running"),
            (("accept_folding", "s", "f1"), "queued"),
            (("fold", "s"), ["f1"]),
            (("cancel_run", "f1"), ("r1", [])),
        ],
        (True, ["r1", "f1"], []),
    ),
    ("cancel_run of an unknown run", [(("cancel_run", "zz"), None)], (False, [], [])),
    (
        "clear drops the queue, the turn goes on",
        [
            (("accept", "s", "r1"), "running"),
            (("accept", "s", "r2"), "queued"),
            (("clear", "s"), ["r2"]),
        ],
        (True, ["r1"], []),
    ),
    ("clear on an unknown session", [(("clear", "s"), [])], (False, [], [])),
]


@pytest.mark.parametrize(("name", "script", "after"), CASES, ids=[c[0] for c in CASES])
def test_agent_state_table(name: str, script: list[Any], after: Any) -> None:
    state = AgentState()
    turns: dict[str, Turn] = {}
    for op, expected in script:
        assert _run(state, turns, op) == expected, op
    assert _session(state, "s") == after


def test_accept_sequence_counts_every_prompt_of_every_session() -> None:
    state = AgentState()
    seqs = [
        state.accept(sid, f"r{i}", "t", explicit=True)[0].accept_seq for i, sid in enumerate("aab")
    ]
    assert seqs == [1, 2, 3]
    assert state.accept_seq == 3
    assert sorted(state.busy_sessions()) == ["a", "b"]
    assert state.pending_count() == 3


def test_queue_size_counts_prompts_and_bytes() -> None:
    state = AgentState()
    assert not state.would_queue("s")
    assert state.queue_size("s") == (0, 0)
    state.accept("s", "r1", "one", explicit=True, size=3)
    assert state.would_queue("s")
    state.accept("s", "r2", "two", explicit=True, size=5)
    state.accept("s", "r3", "three", explicit=False, size=7)
    assert state.queue_size("s") == (2, 12)
    state.take_foldable("s")
    assert state.queue_size("s") == (1, 5)
    state.cancel_run("r2")
    assert state.queue_size("s") == (0, 0)


@pytest.mark.parametrize(
    "op",
    [("fold", "s"), ("finish", "stale")],
    ids=["fold without an active turn", "finish of a turn that is not active"],
)
def test_illegal_moves_raise(op: tuple[str, str]) -> None:
    state = AgentState()
    _, _, turn = state.accept("other", "stale", "t", explicit=True)
    assert turn is not None
    state.finish_turn(turn)
    with pytest.raises(IllegalTransition):
        _run(state, {"stale": turn}, op)


def test_cancel_all_covers_every_session() -> None:
    state = AgentState()
    state.accept("a", "r1", "t", explicit=True)
    state.accept("a", "r2", "t", explicit=True)
    state.accept("b", "r3", "t", explicit=True)
    outcomes = state.cancel_all()
    assert sorted(
        (o.turn.primary.run_id, [p.run_id for p in o.dropped]) for o in outcomes if o.turn
    ) == [
        ("r1", ["r2"]),
        ("r3", []),
    ]
