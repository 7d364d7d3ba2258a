"""The turn loop: session drivers run the turns :mod:`crush_trio.core.agent_state` decides on.

Ownership: every turn runs in a *session driver* task started in the workspace's runs nursery
(never in a request handler). A driver runs its session's turns one after another until the
session's queue is empty.

A turn is a loop of steps: a model step (streamed into an assistant message by
:class:`~crush_trio.agent.steps.StepIO`), then, when the model asked for them, a tool step
(:func:`~crush_trio.agent.tool_step.run_tools`), then compaction when the context is nearly full
(:class:`~crush_trio.agent.compaction.Compaction`). Prompts sent meanwhile without a ``run_id``
are folded in at each step boundary.

Whatever ends a turn (completion, a provider failure, a cancel, workspace shutdown, a bug) passes
through the turn's ``finally`` block: its terminals are decided in memory
(:class:`~crush_trio.agent.terminals.RunEnds`), then its saves run inside
``trio.move_on_after(save_timeout, shield=True)``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from ..core import model as pb
from ..errors import (
    CrushError,
    Fenced,
    PermissionTimeout,
    ProviderError,
    SessionGone,
    unwrap_group,
)
from ..logs import log_context
from ..wire import EventKind, FinishReason, Message, Role, RunComplete, RunStatus, ToolCallPart
from .context_files import ContextFiles
from .prompt import render_system_prompt
from .steps import TurnProgress
from .tool_step import RepeatedCalls, StopTurn, run_tools

if TYPE_CHECKING:
    from ..broker import Broker
    from ..core.agent_state import AgentState, Prompt, Turn
    from ..core.ports import ChangeHooks
    from ..store import MessageService
    from ..store.protocol import WorkspaceStore
    from .compaction import Compaction
    from .prompt import SystemPrompts
    from .provider_cache import ProviderCache
    from .runs import RunBook
    from .steps import AgentSetup, StepIO, TurnScopes
    from .terminals import LiveRuns, RunEnds
    from .titles import Titles

log = logging.getLogger(__name__)


class TurnLoop:
    """Runs the turns of every session of one workspace.

    Args:
        setup: the configuration and tools (read at each step).
        state: the agent's run bookkeeping.
        store, messages, broker, runs: the workspace's services.
        providers, titles, prompts: the providers, session titles, system prompts.
        changes: the change log (a run registered at its turn's start, recorded at its end), or
            None.
        steps, scopes, live, ends, compaction: the agent's other parts.
        runs_nursery: where session drivers run (cancelled first at shutdown).
        background_nursery: titles and session updates.
        save_timeout: bound on each shielded final save (seconds).
        log_ids: the log ids of the workspace, for its turns' logs.
    """

    def __init__(
        self,
        *,
        setup: AgentSetup,
        state: AgentState,
        store: WorkspaceStore,
        messages: MessageService,
        broker: Broker,
        runs: RunBook,
        providers: ProviderCache,
        titles: Titles,
        prompts: SystemPrompts | None,
        changes: ChangeHooks | None,
        steps: StepIO,
        scopes: TurnScopes,
        live: LiveRuns,
        ends: RunEnds,
        compaction: Compaction,
        runs_nursery: trio.Nursery,
        background_nursery: trio.Nursery,
        save_timeout: float,
        log_ids: dict[str, str],
    ) -> None:
        self.setup = setup
        self.state = state
        self.store = store
        self.messages = messages
        self.broker = broker
        self.runs = runs
        self.providers = providers
        self.titles = titles
        self.prompts = prompts
        self.changes = changes
        self.steps = steps
        self.scopes = scopes
        self.live = live
        self.ends = ends
        self.compaction = compaction
        self._runs_nursery = runs_nursery
        self._bg = background_nursery
        self.save_timeout = save_timeout
        self._log_ids = log_ids

    # -- drivers --------------------------------------------------------------------------------

    def start(self, turn: Turn) -> None:
        """Start the driver of ``turn``'s session (it was idle) and publish the session busy."""
        self.publish_busy(turn.session_id)
        self._runs_nursery.start_soon(self._drive, turn, name=f"session-{turn.session_id}")

    def publish_busy(self, session_id: str) -> None:
        """Publish the session with its busy flag as it is when the update is sent."""
        self._bg.start_soon(self._publish_session, session_id)

    async def _publish_session(self, session_id: str) -> None:
        session = await self.store.get_session(session_id)
        if session is not None:
            session.is_busy = self.state.is_busy(session_id)
            self.broker.publish(session, EventKind.UPDATED)

    async def _drive(self, turn: Turn | None) -> None:
        while turn is not None:
            # Log records of the turn (tools, providers, saves) name its session and run.
            ids = {**self._log_ids, "session_id": turn.session_id, "run_id": turn.primary.run_id}
            with log_context(**ids):
                completes = await self._run_turn(turn)
            next_turn, dropped = self.state.finish_turn(turn)
            if next_turn is None:
                self.publish_busy(turn.session_id)
            await self.ends.publish(completes)
            if dropped:
                await self.ends.complete_dropped(dropped)
            turn = next_turn
            if turn is None:
                self.ends.idle_check()

    # -- one turn -------------------------------------------------------------------------------

    async def _run_turn(self, turn: Turn) -> list[RunComplete]:
        """Run ``turn`` to its end and save its final state; returns its terminal events.

        Cancellation: a user cancel ends the turn cancelled and returns normally; a cancel from
        outside (workspace shutdown) saves the same final state and then propagates.
        """
        waiter = self.compaction.take_request(turn)
        if waiter is not None:
            await self.compaction.run_requested(turn, waiter)
            return []
        progress = TurnProgress(turn)
        error: BaseException | None = None
        cancelled = False
        try:
            with self.scopes.open(turn) as scope:
                if self.changes is not None:
                    await self.changes.begin_run(turn.session_id, [turn.primary.run_id])
                await self._turn_body(progress)
            cancelled = scope.cancelled_caught or turn.cancelled
        except trio.Cancelled:
            cancelled = True
            raise
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            error = unwrap_group(exc)
            if turn.cancelled:
                cancelled, error = True, None
            elif not isinstance(error, CrushError):
                log.exception("turn of run %s failed with a bug", turn.primary.run_id)
        finally:
            completes = await self._end_turn(progress, error=error, cancelled=cancelled)
        return completes

    async def _end_turn(
        self, progress: TurnProgress, *, error: BaseException | None, cancelled: bool
    ) -> list[RunComplete]:
        """Release what the turn held, decide its terminals, then save its end (each save
        shielded and bounded by the save timeout)."""
        turn = progress.turn
        if progress.held is not None:
            self.providers.release(progress.held)
        if cancelled:
            self._cancel_jobs(turn)
        # The terminals are decided in memory first, so that a slow or failing store can delay
        # or lose a save but never a run's run_complete.
        completes = self.ends.decide(progress, error=error, cancelled=cancelled)
        if self.changes is not None:
            # Not abandoned on cancel: the snapshot's git commands are bounded themselves.
            with trio.move_on_after(self.save_timeout, shield=True):
                await self.changes.end_run(turn.session_id, [p.run_id for p in turn.prompts])
        with trio.move_on_after(self.save_timeout, shield=True):
            try:
                await self.ends.save_final(progress, error=error, cancelled=cancelled)
            except Fenced as exc:  # another node owns the workspace: expected, one line
                log.warning("the end of run %s was not saved: %s", turn.primary.run_id, exc)
            except Exception:
                log.exception("saving the end of run %s failed", turn.primary.run_id)
        return completes

    def _cancel_jobs(self, turn: Turn) -> None:
        """A cancelled turn: its runs' background jobs end too when ``options.jobs
        .kill_on_cancel`` says so (see :meth:`JobManager.cancel_runs`)."""
        jobs = getattr(self.setup.tools, "jobs", None)
        if jobs is not None:
            jobs.cancel_runs(p.run_id for p in turn.prompts)

    async def _turn_body(self, progress: TurnProgress) -> None:
        sid = progress.turn.session_id
        provider = await self._begin(progress)
        options = self.setup.config.options
        system = await self._system_prompt(sid, progress.provider, progress.model_entry)
        repeated = RepeatedCalls()
        for _step in range(options.max_steps):
            for prompt in self.state.take_foldable(sid):
                self._mark_running(prompt)
                await self.steps.write_user_message(progress, prompt)
            msg, reason = await self._model_step(progress, provider, system)
            calls = msg.tool_calls()
            if reason is FinishReason.TOOL_USE or calls:
                repeated.check(calls)
                if not await self._tool_step(progress, msg, calls):
                    return
                more = True
            else:
                # Fold the prompts that arrived during this step into a next step.
                more = any(not p.explicit for p in self.state.queued(sid))
            await self.compaction.compact_if_full(progress, provider, more=more)
            if more:
                continue
            return
        raise ProviderError(
            f"the agent stopped after {options.max_steps} steps (options.max_steps); "
            "raise the limit or split the task"
        )

    async def _begin(self, progress: TurnProgress) -> pb.Provider:
        """Start the turn: its runs are running, it holds its model's provider, its history is
        read and its prompt written. Returns the provider."""
        turn = progress.turn
        sid = turn.session_id
        for prompt in turn.prompts:
            self._mark_running(prompt)
        if not self.store.session_exists(sid):
            raise SessionGone(f"session {sid!r} was deleted before its run could start")
        provider_name, provider_cfg, model_entry = self._turn_model(turn)
        provider = progress.held = self.providers.acquire(provider_name, provider_cfg)
        progress.model, progress.provider = model_entry.id, provider_name
        progress.model_entry = model_entry
        # The history is read once; this turn's own messages are appended as they are made (no
        # other turn runs on this session meanwhile), so later steps need no database round trip.
        progress.history = await self.steps.model_history(sid)
        first_prompt = not any(m.role is Role.USER for m in progress.history)
        await self.steps.write_user_message(progress, turn.primary)
        if first_prompt:
            # The title reads the session and keeps a title the client already set.
            self._bg.start_soon(self.titles.generate, sid, turn.primary.text)
        return provider

    async def _model_step(
        self, progress: TurnProgress, provider: pb.Provider, system: str
    ) -> tuple[Message, FinishReason]:
        """Stream one model step into a new assistant message; returns it and its finish."""
        entry = progress.model_entry
        request = pb.ModelRequest(
            model=pb.ModelInfo(
                entry.id,
                entry.name,
                entry.context_window,
                entry.default_max_tokens,
                reasoning_effort=entry.reasoning_effort,
                thinking_budget=entry.thinking_budget,
            ),
            system=system,
            messages=list(progress.history),
            tools=self.setup.tool_specs(),
            max_tokens=entry.default_max_tokens,
        )
        msg = await self.steps.start_message(progress, progress.turn.session_id)
        return msg, await self.steps.stream(provider, request, msg, progress)

    async def _tool_step(
        self, progress: TurnProgress, msg: Message, calls: list[ToolCallPart]
    ) -> bool:
        """Run the step's tool calls; False when a result ended the turn.

        Raises:
            PermissionTimeout: nobody answered a permission request in time.
        """
        try:
            await run_tools(
                tools=self.setup.tools,
                messages=self.messages,
                msg=msg,
                calls=calls,
                done=progress.results,
                history=progress.history,
                save_timeout=self.save_timeout,
                run_id=progress.turn.primary.run_id,
            )
        except StopTurn as stop:
            # A denied permission ends the turn; the tool result says why. One nobody answered
            # in time also fails the run, so its record says why it ended.
            await self.steps.end_turn(msg)
            if stop.error is not None:
                raise PermissionTimeout(stop.error) from None
            return False
        return True

    # -- models and prompts ---------------------------------------------------------------------

    async def _system_prompt(self, session_id: str, provider_name: str, entry: Any) -> str:
        """The turn's system prompt (the same for each of its steps, so the provider's prompt
        cache holds across them)."""
        tools = self.setup.tool_specs()
        model = f"{provider_name}/{entry.id}" + (f" ({entry.name})" if entry.name else "")
        if self.prompts is None:
            return render_system_prompt(tools, None, ContextFiles())
        return await self.prompts.build(session_id, tools, model)

    def _turn_model(self, turn: Turn) -> tuple[str, Any, Any]:
        """The provider name, provider config and model entry of a turn: the model its prompt
        named, else ``models.large``."""
        spec = self.live.model(turn.primary.run_id)
        if spec is not None:
            return self.setup.config.resolve_named_model(spec)
        return self.setup.config.resolve_model("large")

    def _mark_running(self, prompt: Prompt) -> None:
        run = self.runs.get(prompt.run_id)
        if run is not None and run.status is RunStatus.QUEUED:
            self.runs.set_status(run, RunStatus.RUNNING)
