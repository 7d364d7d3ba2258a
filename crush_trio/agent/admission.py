"""Admission: the decisions request handlers ask the agent for (PROTOCOL §3).

Accept or refuse a prompt and start or queue its run, ask for a summary, cancel a session or a
run, clear a queue, shut down. Each decision is taken synchronously on the rules of
:class:`~crush_trio.core.agent_state.AgentState` (plain logic): a client that disconnects right
after sending cannot tear a decision apart from the start of its run. What a decision starts
runs elsewhere: turns in their session's driver (:class:`~crush_trio.agent.turns.TurnLoop`),
the terminals of dropped prompts in a nursery (:class:`~crush_trio.agent.terminals.RunEnds`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import wire
from ..defaults import DEFAULT_MAX_QUEUED_PROMPT_BYTES, DEFAULT_MAX_QUEUED_PROMPTS
from ..errors import BadRequest, ConfigError, Conflict, NotFound, StoreError, TooManyRequests
from ..wire import Message, Run, RunStatus, new_id

if TYPE_CHECKING:
    from collections.abc import Sequence

    import trio

    from ..core.agent_state import AgentState, CancelOutcome
    from ..store.protocol import WorkspaceStore
    from .compaction import Compaction
    from .runs import RunBook
    from .steps import AgentSetup, StepIO, TurnScopes
    from .terminals import LiveRuns, RunEnds
    from .turns import TurnLoop

#: What a prompt or summary sent to a closing workspace is told.
CLOSING_MESSAGE = "workspace closing: it is shutting down; open it again and resend"


class Admission:
    """Accepts, queues, cancels and refuses the prompts of one workspace's sessions.

    Args:
        setup: the configuration (a prompt's named model is checked against it).
        state: the agent's run bookkeeping (the rules of every decision).
        store, runs: the workspace's store and run records.
        steps: reads a session's messages (a summary needs some).
        live, scopes, turns, ends, compaction: the agent's other parts.
        runs_nursery: where shutdown ends dropped prompts (cancelled last).
        background_nursery: where a cancel or a clear ends dropped prompts.
        max_queued_prompts, max_queued_prompt_bytes: the bound on each session's queue
            (``server.max_queued_prompts``, ``server.max_queued_prompt_bytes``).
    """

    def __init__(
        self,
        *,
        setup: AgentSetup,
        state: AgentState,
        store: WorkspaceStore,
        runs: RunBook,
        steps: StepIO,
        live: LiveRuns,
        scopes: TurnScopes,
        turns: TurnLoop,
        ends: RunEnds,
        compaction: Compaction,
        runs_nursery: trio.Nursery,
        background_nursery: trio.Nursery,
        max_queued_prompts: int = DEFAULT_MAX_QUEUED_PROMPTS,
        max_queued_prompt_bytes: int = DEFAULT_MAX_QUEUED_PROMPT_BYTES,
    ) -> None:
        self.setup = setup
        self.state = state
        self.store = store
        self.runs = runs
        self.steps = steps
        self.live = live
        self.scopes = scopes
        self.turns = turns
        self.ends = ends
        self.compaction = compaction
        self._runs_nursery = runs_nursery
        self._bg = background_nursery
        self.max_queued_prompts = max_queued_prompts
        self.max_queued_prompt_bytes = max_queued_prompt_bytes
        #: Set by :meth:`begin_shutdown`: new prompts and summaries are refused.
        self.closing = False

    async def accept(
        self,
        session_id: str,
        text: str,
        run_id: str | None,
        model: str | None = None,
        attachments: Sequence[wire.BinaryPart] = (),
    ) -> wire.AcceptedPrompt:
        """Take the decision on a prompt (see :meth:`crush_trio.agent.runner.Agent.accept`)."""
        if self.closing:
            raise Conflict(CLOSING_MESSAGE)
        if not text.strip() and not attachments:
            raise BadRequest("prompt is empty; send the text for the agent in 'prompt'")
        if model is not None:
            try:
                self.setup.config.resolve_named_model(model)
            except ConfigError as exc:
                raise BadRequest(f"model: {exc.message}") from None
        wire.validate_run_id(run_id)
        if not self.store.session_exists(session_id):
            raise BadRequest(
                f"session {session_id!r} does not exist in this workspace; create it with "
                "POST /v1/workspaces/{id}/sessions"
            )
        if run_id is not None and (
            self.runs.known(run_id)
            or (self.store.may_have_run(run_id) and await self.store.get_run(run_id))
        ):
            raise BadRequest(f"run_id {run_id!r} was already used; pick a new one")
        # Everything below is synchronous: the decision and the task start cannot be torn apart
        # by a client that disconnects right after sending.
        if self.closing:
            raise Conflict(CLOSING_MESSAGE)
        if run_id is not None and self.runs.known(run_id):
            # The same run_id sent twice at once (a client resending over another connection):
            # both passed the store check above while it ran; the first to get here wins.
            raise BadRequest(f"run_id {run_id!r} was already used; pick a new one")
        size = len(text.encode()) + sum(len(part.data) for part in attachments)
        if self.state.would_queue(session_id):
            self._check_queue_bound(session_id, size)
        explicit = run_id is not None
        prompt, admission, turn = self.state.accept(
            session_id,
            run_id or new_id(),
            text,
            explicit=explicit,
            size=size,
            parts=tuple(attachments),
        )
        self.runs.add(Run(prompt.run_id, session_id, RunStatus(admission.value)), text)
        self.live.accept(prompt.run_id, model)
        if turn is not None:
            self.turns.start(turn)
        return wire.AcceptedPrompt(prompt.run_id, session_id, admission.value)

    def _check_queue_bound(self, session_id: str, size: int) -> None:
        count, queued_bytes = self.state.queue_size(session_id)
        if count + 1 > self.max_queued_prompts:
            raise TooManyRequests(
                f"session {session_id!r} already has {count} queued prompts, the limit "
                f"(server.max_queued_prompts) is {self.max_queued_prompts}; wait for a run to "
                "end, or cancel or clear the queue, then send it again"
            )
        if queued_bytes + size > self.max_queued_prompt_bytes:
            raise TooManyRequests(
                f"session {session_id!r} has {queued_bytes} bytes of queued prompts; this "
                f"{size}-byte prompt would pass the limit (server.max_queued_prompt_bytes) of "
                f"{self.max_queued_prompt_bytes} bytes; wait for a run to end, or cancel or clear "
                "the queue, then send it again"
            )

    async def durable(self, run_id: str) -> None:
        """Return once the record of a run accepted by :meth:`accept` is committed.

        Raises:
            StoreError: it could not be stored; the run is cancelled (nothing was accepted).
        """
        try:
            await self.runs.wait_inserted(run_id)
        except StoreError:
            self.cancel_run(run_id)
            raise

    async def summarize(self, session_id: str) -> Message:
        """Summarize the session now (see :meth:`crush_trio.agent.runner.Agent.summarize`)."""
        if self.closing:
            raise Conflict(CLOSING_MESSAGE)
        if not self.store.session_exists(session_id):
            raise NotFound(f"session {session_id!r} does not exist in this workspace")
        if not await self.steps.messages_for(session_id):
            raise BadRequest(f"session {session_id!r} has no messages to summarize")
        if self.closing:
            raise Conflict(CLOSING_MESSAGE)
        if self.state.would_queue(session_id):
            raise Conflict(
                f"session busy: session {session_id!r} has a run in progress or queued; "
                "summarize it once it is idle, or cancel it first"
            )
        _prompt, _admission, turn = self.state.accept(session_id, new_id(), "", explicit=True)
        assert turn is not None  # the session was idle
        waiter = self.compaction.request(turn)
        self.turns.start(turn)
        await waiter.done.wait()
        if waiter.error is not None:
            raise waiter.error
        assert waiter.message is not None
        return waiter.message

    def cancel(self, session_id: str) -> None:
        """Cancel the session's active turn and drop its queue; a no-op when idle."""
        self._apply(self.state.cancel(session_id))

    def cancel_run(self, run_id: str) -> bool:
        """Cancel one live run (see :meth:`AgentState.cancel_run`); False when it is not live."""
        outcome = self.state.cancel_run(run_id)
        if outcome is None:
            return False
        self._apply(outcome)
        return True

    def _apply(self, outcome: CancelOutcome, nursery: trio.Nursery | None = None) -> None:
        """Stop the turn a cancel covered and end its dropped prompts (in ``nursery``, by
        default the background one)."""
        if outcome.turn is not None:
            self.scopes.cancel(outcome.turn)
        if outcome.dropped:
            (nursery or self._bg).start_soon(self.ends.complete_dropped, outcome.dropped)

    def clear_queue(self, session_id: str) -> None:
        dropped = self.state.clear_queue(session_id)
        if dropped:
            self._bg.start_soon(self.ends.complete_dropped, dropped)

    def queued_prompts(self, session_id: str) -> list[str]:
        return [p.text for p in self.state.queued(session_id)]

    def begin_shutdown(self) -> None:
        """Refuse new prompts and cancel every session's work (PROTOCOL §6)."""
        self.closing = True
        for outcome in self.state.cancel_all():
            self._apply(outcome, self._runs_nursery)
