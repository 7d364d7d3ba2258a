"""How runs end: each accepted run's terminal decided, saved and published exactly once.

:class:`LiveRuns` keeps the runs accepted and not yet ended (when each was accepted, the model
its prompt named) and lets a run's ``run_complete`` through only the first time. :class:`RunEnds`
decides a turn's terminals in memory first, so that a slow or failing store can delay or lose a
save but never a run's ``run_complete``; then saves the turn's final state and publishes the
terminals, each in a shielded scope bounded by the save timeout. Queued prompts dropped by a
cancel, a clear or shutdown end here too, cancelled.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from ..metrics import METRICS, run_reason
from ..wire import AgentEvent, EventKind, Message, Role, RunComplete, RunStatus, new_id
from .steps import error_text

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..broker import Broker
    from ..core.agent_state import AgentState, Prompt
    from ..core.ports import Terminals
    from ..store import MessageService
    from ..store.protocol import WorkspaceStore
    from .runs import RunBook
    from .steps import StepIO, TurnProgress

log = logging.getLogger(__name__)


class LiveRuns:
    """Runs accepted and not yet ended (memory bounded by the live runs).

    A run's ``run_complete`` is published only while the run is live, and the run leaves then
    (:meth:`take_terminal`); its metrics end once (:meth:`ended`).
    """

    def __init__(self) -> None:
        self._live: set[str] = set()
        #: When each live run was accepted (trio clock), for the run metrics.
        self._accepted_at: dict[str, float] = {}
        #: The model a prompt named (``AgentMessage.model``), by run id, until its turn ends.
        self._models: dict[str, str] = {}

    def accept(self, run_id: str, model: str | None) -> None:
        self._live.add(run_id)
        self._accepted_at[run_id] = trio.current_time()
        METRICS.runs_accepted.inc()
        if model is not None:
            self._models[run_id] = model

    def model(self, run_id: str) -> str | None:
        """The model the run's prompt named (``provider/model``), if any."""
        return self._models.get(run_id)

    def first_token(self, progress: TurnProgress) -> None:
        """A turn streamed its first content: the time to first token of its run."""
        progress.first_token = True
        started = self._accepted_at.get(progress.turn.primary.run_id)
        if started is not None:
            METRICS.time_to_first_token.observe(trio.current_time() - started)

    def ended(self, run_id: str, status: RunStatus, reason: str) -> None:
        """The run's end is decided: its run metrics (once: its acceptance time is taken)."""
        self._models.pop(run_id, None)
        started = self._accepted_at.pop(run_id, None)
        if started is not None:
            METRICS.run_finished(trio.current_time() - started, status.value, reason)

    def take_terminal(self, run_id: str) -> bool:
        """Whether the run's ``run_complete`` is still to be published (True only once)."""
        if run_id not in self._live:
            return False
        self._live.discard(run_id)
        return True


class RunEnds:
    """Decides, saves and publishes the ends of runs.

    Args:
        store, messages, broker, runs: the workspace's services.
        steps: the message I/O a final save repairs the history with.
        live: the live runs.
        state: the agent's run bookkeeping (to tell when no session is busy).
        save_timeout: bound on each shielded save (seconds).
        closing: whether the workspace is shutting down (the metrics' end reason).
        on_idle: told when no session is busy any more.
        on_complete: told each run's end, once, just before its run_complete is published.
        terminals: in a cluster, the once-only record of each run's terminal event.
    """

    def __init__(
        self,
        *,
        store: WorkspaceStore,
        messages: MessageService,
        broker: Broker,
        runs: RunBook,
        steps: StepIO,
        live: LiveRuns,
        state: AgentState,
        save_timeout: float,
        closing: Callable[[], bool],
        on_idle: Callable[[], None],
        on_complete: Callable[[RunComplete], None],
        terminals: Terminals | None,
    ) -> None:
        self.store = store
        self.messages = messages
        self.broker = broker
        self.runs = runs
        self.steps = steps
        self.live = live
        self.state = state
        self.save_timeout = save_timeout
        self.closing = closing
        self.on_idle = on_idle
        self.on_complete = on_complete
        self.terminals = terminals

    def idle_check(self) -> None:
        """Tell ``on_idle`` when no session is busy."""
        if not self.state.busy_sessions():
            self.on_idle()

    def decide(
        self, progress: TurnProgress, *, error: BaseException | None, cancelled: bool
    ) -> list[RunComplete]:
        """How the turn ended, in memory: run records move to their final status and the
        terminal events are built. A failed or cancelled turn gets an assistant message (created
        here, saved by :meth:`save_final`) so every run_complete names one."""
        turn = progress.turn
        text_of_error = error_text(error) if error is not None and not cancelled else None
        if (cancelled or error is not None) and progress.assistant is None:
            msg = Message(new_id(), turn.session_id, Role.ASSISTANT)
            msg.model, msg.provider = progress.model, progress.provider
            progress.assistant = msg
            progress.assistant_unsaved = True
        if cancelled:
            status = RunStatus.CANCELLED
        elif error is not None:
            status = RunStatus.FAILED
        else:
            status = RunStatus.COMPLETED
        message_id = progress.assistant.id if progress.assistant else None
        text = progress.assistant.text() if progress.assistant else ""
        completes = []
        reason = run_reason(error, cancelled=cancelled, closing=self.closing())
        for prompt in turn.prompts:
            self.live.ended(prompt.run_id, status, reason)
            run = self.runs.get(prompt.run_id)
            if run is not None and not run.status.terminal:
                self.runs.set_status(
                    run, status, message_id=message_id, text=text, error=text_of_error
                )
            completes.append(
                RunComplete(
                    turn.session_id, prompt.run_id, message_id, text, text_of_error, cancelled
                )
            )
        if text_of_error is not None:
            for prompt in turn.prompts:
                self.broker.publish(
                    AgentEvent(
                        "error",
                        session_id=turn.session_id,
                        run_id=prompt.run_id,
                        text=text_of_error,
                        error=text_of_error,
                    ),
                    EventKind.CREATED,
                )
        return completes

    async def save_final(
        self, progress: TurnProgress, *, error: BaseException | None, cancelled: bool
    ) -> None:
        """The final save of a turn (the caller shields and bounds it): repair the history,
        flush, save run records."""
        turn = progress.turn
        session_alive = self.store.session_exists(turn.session_id)
        if session_alive and (cancelled or error is not None):
            for prompt in turn.prompts:
                if prompt.run_id not in progress.user_written:
                    await self.steps.write_user_message(progress, prompt)
            msg = progress.assistant
            assert msg is not None  # made by decide
            if progress.assistant_unsaved:
                await self.messages.create(msg)
                progress.assistant_unsaved = False
            await self.steps.end_interrupted(progress, error=error, cancelled=cancelled)
        await self.messages.flush_all()
        await self.runs.save_now()

    async def complete_dropped(self, dropped: list[Prompt]) -> None:
        """Queued prompts dropped by a cancel, a clear or shutdown: cancelled terminals."""
        completes = []
        reason = "shutdown" if self.closing() else "cancel"
        for prompt in dropped:
            self.live.ended(prompt.run_id, RunStatus.CANCELLED, reason)
            run = self.runs.get(prompt.run_id)
            if run is not None and not run.status.terminal:
                self.runs.set_status(run, RunStatus.CANCELLED)
            completes.append(
                RunComplete(prompt.session_id, prompt.run_id, None, "", None, cancelled=True)
            )
        with trio.move_on_after(self.save_timeout, shield=True):
            try:
                await self.runs.save_now()
            except Exception:
                log.exception("saving %d dropped runs failed", len(dropped))
        await self.publish(completes)
        self.idle_check()

    async def publish(self, completes: list[RunComplete]) -> None:
        """Publish terminals in a shielded scope bounded by the save timeout plus one
        must-deliver timeout per terminal."""
        bound = self.save_timeout + self.broker.must_deliver_timeout * len(completes)
        with trio.move_on_after(bound, shield=True):
            for complete in completes:
                await self._publish_one(complete)

    async def _publish_one(self, complete: RunComplete) -> None:
        if not self.live.take_terminal(complete.run_id):
            return
        if self.terminals is not None:
            run = self.runs.get(complete.run_id)
            if run is not None and not await self.terminals.record(run, complete):
                return  # another node ended the run (it recovered it after this one lost its lease)
        try:
            self.on_complete(complete)
        except Exception:
            log.exception("the run-end hook failed for run %s", complete.run_id)
        event = await self.broker.publish_must_deliver(complete, EventKind.CREATED)
        if self.terminals is not None:
            await self.terminals.logged(complete.run_id, event)
