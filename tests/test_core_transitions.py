"""The state tables, checked move by move without an event loop (as h11 tests its state machine):
every (from, to) pair of each table is either allowed or raises IllegalTransition."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import pytest

from crush_trio.core.holds import HOLD_TRANSITIONS, ClientHold, Holds, HoldState
from crush_trio.core.lifecycle import WORKSPACE_TRANSITIONS, WorkspaceState, check_workspace_move
from crush_trio.errors import IllegalTransition
from crush_trio.wire import RUN_TRANSITIONS, RunStatus, check_run_transition

if TYPE_CHECKING:
    from collections.abc import Callable

Q, R, C, F, X = (
    RunStatus.QUEUED,
    RunStatus.RUNNING,
    RunStatus.COMPLETED,
    RunStatus.FAILED,
    RunStatus.CANCELLED,
)
#: The run status moves the protocol allows (docs/protocol.md "Run lifecycle").
RUN_ALLOWED = {(Q, R), (Q, C), (Q, F), (Q, X), (R, C), (R, F), (R, X)}

WS = WorkspaceState
WORKSPACE_ALLOWED = {
    (WS.STARTING, WS.OPEN),
    (WS.STARTING, WS.CLOSING),
    (WS.OPEN, WS.CLOSING),
    (WS.CLOSING, WS.CLOSED),
}

P, A, D = HoldState.PENDING, HoldState.ATTACHED, HoldState.DETACHED
HOLD_ALLOWED = {(P, A), (A, A), (A, D), (D, A)}


def test_tables_cover_every_state() -> None:
    assert set(RUN_TRANSITIONS) == set(RunStatus)
    assert set(WORKSPACE_TRANSITIONS) == set(WorkspaceState)
    assert set(HOLD_TRANSITIONS) == set(HoldState)


def _check_hold(hold_id: str, old: HoldState, new: HoldState) -> None:
    hold = ClientHold(hold_id, phase=old)
    try:
        hold.move(new)
    finally:
        assert hold.phase is (new if (old, new) in HOLD_ALLOWED else old)


#: (table name, states, allowed moves, the check, what the error names)
TABLES: list[tuple[str, Any, set[Any], Callable[[str, Any, Any], None], str]] = [
    ("run", RunStatus, RUN_ALLOWED, check_run_transition, "run 'x' cannot move from"),
    ("workspace", WorkspaceState, WORKSPACE_ALLOWED, check_workspace_move, "workspace x cannot"),
    ("hold", HoldState, HOLD_ALLOWED, _check_hold, "hold of client 'x' cannot move from"),
]
MOVES = [
    pytest.param(check, old, new, (old, new) in allowed, error, id=f"{name}-{old}-{new}")
    for name, states, allowed, check, error in TABLES
    for old, new in itertools.product(states, repeat=2)
]


@pytest.mark.parametrize(("check", "old", "new", "allowed", "error"), MOVES)
def test_transition(check: Any, old: Any, new: Any, allowed: bool, error: str) -> None:
    if allowed:
        check("x", old, new)
    else:
        with pytest.raises(IllegalTransition, match=error):
            check("x", old, new)


def test_terminal_run_statuses_are_those_no_move_leaves() -> None:
    assert all(status.terminal == (not RUN_TRANSITIONS[status]) for status in RunStatus)


# -- holds: event sequences and what they leave -------------------------------------------------

#: (events, expected): each event is (operation, client, now); expected maps each client still
#: held to (phase, streams, deadline), and ``next`` is Holds.next_deadline() afterwards.
HOLD_CASES: list[tuple[str, list[tuple[str, str, float]], dict[str, object]]] = [
    ("open: create grace", [("open", "a", 0)], {"a": (P, 0, 30), "next": 30}),
    ("attach clears the deadline", [("open", "a", 0), ("attach", "a", 1)], {"a": (A, 1, None)}),
    ("attach without open", [("attach", "a", 0)], {"a": (A, 1, None), "next": None}),
    (
        "last detach: detach grace",
        [("open", "a", 0), ("attach", "a", 1), ("attach", "a", 2), ("detach", "a", 3)],
        {"a": (A, 1, None), "next": None},
    ),
    (
        "detach grace from the last detach",
        [("attach", "a", 0), ("attach", "a", 0), ("detach", "a", 3), ("detach", "a", 5)],
        {"a": (D, 0, 15), "next": 15},
    ),
    (
        "reconnect in the grace",
        [("attach", "a", 0), ("detach", "a", 1), ("attach", "a", 2)],
        {"a": (A, 1, None), "next": None},
    ),
    ("expired create grace", [("open", "a", 0), ("expire", "", 30)], {"next": None}),
    ("not expired yet", [("open", "a", 0), ("expire", "", 29.9)], {"a": (P, 0, 30)}),
    (
        "expired detach grace",
        [("attach", "a", 0), ("detach", "a", 1), ("expire", "", 11)],
        {"next": None},
    ),
    (
        "attached holds never expire",
        [("open", "a", 0), ("attach", "a", 1), ("expire", "", 1000)],
        {"a": (A, 1, None)},
    ),
    ("release with no stream", [("open", "a", 0), ("release", "a", 1)], {"next": None}),
    (
        "release while streaming: gone at the last detach",
        [("attach", "a", 0), ("release", "a", 1), ("detach", "a", 2)],
        {"next": None},
    ),
    (
        "open again while released and streaming: kept",
        [("attach", "a", 0), ("release", "a", 1), ("open", "a", 2), ("detach", "a", 3)],
        {"a": (D, 0, 13)},
    ),
    (
        "open again while detached: the later deadline",
        [("attach", "a", 0), ("detach", "a", 1), ("open", "a", 2)],
        {"a": (D, 0, 32), "next": 32},
    ),
    ("detach of an unknown client", [("detach", "z", 0)], {"next": None}),
    (
        "detach without a stream is ignored",
        [("open", "a", 0), ("detach", "a", 5)],
        {"a": (P, 0, 30), "next": 30},
    ),
    (
        "next deadline is the earliest live one",
        [("open", "a", 0), ("open", "b", 5), ("attach", "a", 6)],
        {"a": (A, 1, None), "b": (P, 0, 35), "next": 35},
    ),
]


@pytest.mark.parametrize(("name", "events", "expected"), HOLD_CASES, ids=[c[0] for c in HOLD_CASES])
def test_holds_table(name: str, events: list[tuple[str, str, float]], expected: dict) -> None:
    holds = Holds(create_grace=30, detach_grace=10)
    for op, client, now in events:
        if op == "open":
            holds.open(client, now)
        elif op == "attach":
            holds.attach(client)
        elif op == "detach":
            holds.detach(client, now)
        elif op == "release":
            holds.release(client)
        else:
            holds.expire(now)
    want = {k: v for k, v in expected.items() if k != "next"}
    got = {cid: (h.phase, h.streams, h.deadline) for cid, h in holds.clients.items()}
    assert got == want
    assert holds.held == bool(want)
    if "next" in expected:
        assert holds.next_deadline() == expected["next"]


def test_holds_expire_returns_the_clients_it_dropped() -> None:
    holds = Holds(create_grace=30, detach_grace=10)
    holds.open("a", 0)
    holds.open("b", 10)
    holds.attach("c")
    holds.detach("c", 20)
    assert holds.expire(30) == ["a", "c"]
    assert list(holds.clients) == ["b"]
    assert holds.release("a") is False
    assert holds.release("b") is True
    assert not holds.held
