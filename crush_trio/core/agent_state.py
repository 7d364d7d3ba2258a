"""The agent's run bookkeeping as plain logic: accept sequence, busy, queue, folding, cancel.

No I/O and no event loop here: inputs in, decisions out, so every rule can be tested directly.
The shell (:mod:`crush_trio.agent.runner`) performs what these decisions say.

Rules (PROTOCOL §3 "Agent", docs/protocol.md "Run lifecycle"):

1. Every accepted prompt gets a number from one increasing **accept sequence** (per workspace).
2. A prompt for an **idle** session starts a :class:`Turn` at once (status ``running``).
3. A prompt for a **busy** session is queued (status ``queued``):

   * with a client-chosen ``run_id`` (``explicit``) it stays queued and later runs as its own turn;
   * without one it is **folded** into the active turn at that turn's next step boundary
     (:meth:`AgentState.take_foldable`) and ends with that turn.
4. **Cancel** on a session with work raises the session's cancel mark to the current accept
   sequence: the active turn is cancelled and every queued prompt (all of which were accepted up to
   now) is dropped. Prompts accepted later have a higher number and run normally. Cancel on an
   idle session changes nothing.
5. When a turn ends, the next queued prompt (oldest first) starts the next turn; prompts covered by
   the cancel mark never start.
"""

from __future__ import annotations

import collections
import enum
from typing import TYPE_CHECKING, Any

import attrs

from ..errors import IllegalTransition

if TYPE_CHECKING:
    from collections.abc import Iterable


class Admission(enum.StrEnum):
    """What happened to an accepted prompt."""

    RUN = "running"
    QUEUE = "queued"


@attrs.define(eq=False)
class Prompt:
    """One accepted prompt and the run it belongs to."""

    session_id: str
    run_id: str
    text: str
    accept_seq: int
    explicit: bool
    #: UTF-8 size of ``text`` (counted against the session's queue bound while it waits).
    size: int = 0
    #: Parts stored after the text in the user message (attachments, as ``BinaryPart``).
    parts: tuple[Any, ...] = ()


@attrs.define(eq=False)
class Turn:
    """One agent turn: its primary prompt plus prompts folded into it."""

    session_id: str
    primary: Prompt
    folded: list[Prompt] = attrs.field(factory=list)
    cancelled: bool = False

    @property
    def prompts(self) -> list[Prompt]:
        return [self.primary, *self.folded]


@attrs.define
class CancelOutcome:
    """What a cancel covered: the turn to stop (if any) and the queued prompts dropped."""

    turn: Turn | None
    dropped: list[Prompt]


class _Queue(collections.deque[Prompt]):
    """A session's queued prompts, with the sum of their sizes kept up to date."""

    def __init__(self, prompts: Iterable[Prompt] = ()) -> None:
        super().__init__()
        self.size = 0
        self.extend(prompts)

    def append(self, prompt: Prompt) -> None:
        super().append(prompt)
        self.size += prompt.size

    def extend(self, prompts: Iterable[Prompt]) -> None:
        for prompt in prompts:
            self.append(prompt)

    def popleft(self) -> Prompt:
        prompt = super().popleft()
        self.size -= prompt.size
        return prompt

    def remove(self, prompt: Prompt) -> None:
        super().remove(prompt)
        self.size -= prompt.size

    def clear(self) -> None:
        super().clear()
        self.size = 0


@attrs.define
class _Session:
    active: Turn | None = None
    queue: _Queue = attrs.field(factory=_Queue)
    cancel_mark: int = 0

    @property
    def idle(self) -> bool:
        return self.active is None and not self.queue


class AgentState:
    """Run bookkeeping for every session of one workspace."""

    def __init__(self) -> None:
        self.accept_seq = 0
        self._sessions: dict[str, _Session] = {}

    def _session(self, session_id: str) -> _Session:
        state = self._sessions.get(session_id)
        if state is None:
            state = self._sessions[session_id] = _Session()
        return state

    def _forget_if_idle(self, session_id: str) -> None:
        state = self._sessions.get(session_id)
        if state is not None and state.idle:
            del self._sessions[session_id]

    # -- queries --------------------------------------------------------------------------------

    def is_busy(self, session_id: str) -> bool:
        state = self._sessions.get(session_id)
        return state is not None and state.active is not None

    def queued(self, session_id: str) -> list[Prompt]:
        state = self._sessions.get(session_id)
        return list(state.queue) if state else []

    def queue_size(self, session_id: str) -> tuple[int, int]:
        """How many prompts the session has queued, and their total size."""
        state = self._sessions.get(session_id)
        return (len(state.queue), state.queue.size) if state else (0, 0)

    def would_queue(self, session_id: str) -> bool:
        """Whether a prompt accepted now would wait in the queue (the session is busy)."""
        state = self._sessions.get(session_id)
        return state is not None and not state.idle

    def busy_sessions(self) -> list[str]:
        return [sid for sid, s in self._sessions.items() if s.active is not None]

    def queued_count(self) -> int:
        """Prompts waiting in every session's queue."""
        return sum(len(s.queue) for s in self._sessions.values())

    def pending_count(self) -> int:
        """Runs that are running or queued (they hold the workspace open)."""
        return sum(
            (len(s.active.prompts) if s.active else 0) + len(s.queue)
            for s in self._sessions.values()
        )

    # -- transitions ----------------------------------------------------------------------------

    def accept(
        self,
        session_id: str,
        run_id: str,
        text: str,
        *,
        explicit: bool,
        size: int = 0,
        parts: tuple[Any, ...] = (),
    ) -> tuple[Prompt, Admission, Turn | None]:
        """Accept a prompt. Returns it, whether it runs or is queued, and the new turn if any."""
        self.accept_seq += 1
        prompt = Prompt(session_id, run_id, text, self.accept_seq, explicit, size, parts)
        state = self._session(session_id)
        if state.active is None and not state.queue:
            state.active = Turn(session_id, prompt)
            return prompt, Admission.RUN, state.active
        state.queue.append(prompt)
        return prompt, Admission.QUEUE, None

    def take_foldable(self, session_id: str) -> list[Prompt]:
        """At a step boundary: move queued prompts without a client ``run_id`` into the turn."""
        state = self._sessions.get(session_id)
        if state is None or state.active is None:
            raise IllegalTransition(f"session {session_id!r} has no active turn to fold into")
        if state.active.cancelled:
            return []
        folded = [p for p in state.queue if not p.explicit]
        if folded:
            state.queue = _Queue(p for p in state.queue if p.explicit)
            state.active.folded.extend(folded)
        return folded

    def cancel(self, session_id: str) -> CancelOutcome:
        """Cancel the active turn and drop the queue; a no-op on an idle session."""
        state = self._sessions.get(session_id)
        if state is None or state.idle:
            return CancelOutcome(None, [])
        state.cancel_mark = max(state.cancel_mark, self.accept_seq)
        turn = state.active
        if turn is not None:
            turn.cancelled = True
        dropped = list(state.queue)
        state.queue.clear()
        return CancelOutcome(turn, dropped)

    def cancel_run(self, run_id: str) -> CancelOutcome | None:
        """Cancel one run: drop it from its queue, or cancel the turn it belongs to (that turn's
        folded prompts end with it). Other queued prompts are untouched. None: not live."""
        for state in self._sessions.values():
            for prompt in state.queue:
                if prompt.run_id == run_id:
                    state.queue.remove(prompt)
                    return CancelOutcome(None, [prompt])
            turn = state.active
            if turn is not None and any(p.run_id == run_id for p in turn.prompts):
                turn.cancelled = True
                return CancelOutcome(turn, [])
        return None

    def clear_queue(self, session_id: str) -> list[Prompt]:
        """Drop every queued prompt of the session (the active turn goes on)."""
        state = self._sessions.get(session_id)
        if state is None:
            return []
        dropped = list(state.queue)
        state.queue.clear()
        self._forget_if_idle(session_id)
        return dropped

    def finish_turn(self, turn: Turn) -> tuple[Turn | None, list[Prompt]]:
        """End ``turn``. Returns the next turn to run (or None: the session is idle) and any
        queued prompts the cancel mark covers, which are dropped without running."""
        state = self._sessions.get(turn.session_id)
        if state is None or state.active is not turn:
            raise IllegalTransition(
                f"turn of run {turn.primary.run_id!r} is not the active turn of session "
                f"{turn.session_id!r}"
            )
        state.active = None
        dropped: list[Prompt] = []
        while state.queue and state.queue[0].accept_seq <= state.cancel_mark:
            dropped.append(state.queue.popleft())
        if not state.queue:
            self._forget_if_idle(turn.session_id)
            return None, dropped
        state.active = Turn(turn.session_id, state.queue.popleft())
        return state.active, dropped

    def cancel_all(self) -> list[CancelOutcome]:
        """Workspace shutdown: cancel every session's work."""
        return [self.cancel(sid) for sid in list(self._sessions)]
