"""The agent shell: runs turns that :mod:`crush_trio.core.agent_state` decides on.

Provider events are folded into the step's message by the plain-logic
:class:`~crush_trio.core.assembler.StepAssembler`; this module saves, publishes and runs tools.
Session titles: :mod:`crush_trio.agent.titles`.

Ownership: every turn runs in a *session driver* task started in the workspace's runs nursery
(never in a request handler). A driver runs its session's turns one after another until the
session's queue is empty. Title generation and dropped-prompt terminals run in the workspace's
background nursery.

Exactly-once terminals: every accepted run ends through :meth:`Agent._publish_complete`, which
publishes its ``run_complete`` (must-deliver) only the first time it is called for that run.
Whatever ends a turn (completion, a provider failure, a cancel, workspace shutdown, a bug) passes
through the turn's ``finally`` block, whose saves run inside
``trio.move_on_after(save_timeout, shield=True)``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs
import trio

from .. import wire
from ..config import DEFAULT_MAX_QUEUED_PROMPT_BYTES, DEFAULT_MAX_QUEUED_PROMPTS
from ..core import model as pb
from ..core.agent_state import AgentState, CancelOutcome, Prompt, Turn
from ..core.assembler import StepAssembler, repair_tool_calls
from ..core.ports import ChangeHooks as ChangeHooks
from ..core.ports import Terminals as Terminals
from ..errors import (
    BadRequest,
    ConfigError,
    Conflict,
    CrushError,
    Fenced,
    NotFound,
    PermissionTimeout,
    ProviderError,
    StoreError,
    TooManyRequests,
    bug_message,
    unwrap_group,
)
from ..errors import SessionGone as SessionGone
from ..logs import current_context, log_context
from ..metrics import METRICS, run_reason
from ..wire import (
    AgentEvent,
    EventKind,
    FinishPart,
    FinishReason,
    Message,
    Role,
    Run,
    RunComplete,
    RunStatus,
    TextPart,
    ToolResultPart,
    new_id,
    now,
)
from .context_files import ContextFiles
from .prompt import SystemPrompts, render_system_prompt
from .runs import RunBook
from .summarize import (
    context_window,
    history_from_summary,
    should_compact,
    step_cost,
    summary_request,
)
from .titles import Titles
from .tool_step import RepeatedCalls, StopTurn, missing_results, run_tools

if TYPE_CHECKING:
    from ..broker import Broker
    from ..config import Config
    from ..core.ports import WorkspaceStore
    from ..store import MessageService

log = logging.getLogger(__name__)

CANCELED_MESSAGE: Final = "User canceled request"


@attrs.define
class _TurnProgress:
    """What a turn has written so far, so the final save knows what to repair."""

    turn: Turn
    user_written: set[str] = attrs.field(factory=set)  # run_ids whose user message exists
    assistant: Message | None = None
    results: set[str] = attrs.field(factory=set)  # tool_call ids that have a result
    model: str = ""
    provider: str = ""
    assistant_unsaved: bool = False
    history: list[Message] = attrs.field(factory=list)  # what the next model step is sent
    usage: pb.Usage | None = None  # the last step's, as the provider reported it
    model_entry: Any = None  # the ModelEntry the turn uses (prices, context window)
    first_token: bool = False  # the turn's first streamed content was seen (metrics)


@attrs.define
class _SummaryWaiter:
    """A summary asked for by ``POST .../summarize``: what its request handler waits for."""

    done: trio.Event = attrs.field(factory=trio.Event)
    message: Message | None = None
    error: BaseException | None = None


#: Progress texts of ``summarize`` agent events (Crush's).
SUMMARY_STARTING: Final = "Starting summarization..."
SUMMARY_GENERATING: Final = "Generating summary..."
SUMMARY_DONE: Final = "Summary complete"
SUMMARY_FAILED: Final = "Summary failed"
SUMMARY_CANCELLED: Final = "Summary cancelled"


ProviderFactory = Callable[[str, Any], pb.Provider]


class Agent:
    """Turns for every session of one workspace.

    Args:
        store, messages, broker, runs: the workspace's services.
        config: the workspace's configuration (models, options).
        runs_nursery: where session drivers run (cancelled first at shutdown).
        background_nursery: titles and other work not bound to a run.
        save_timeout: bound on each shielded final save (seconds).
        tools: the tools offered to the model (an object with ``specs()`` and ``call``) or None.
        max_queued_prompts, max_queued_prompt_bytes: the bound on each session's queue
            (``server.max_queued_prompts``, ``server.max_queued_prompt_bytes``).
    """

    def __init__(
        self,
        *,
        store: WorkspaceStore,
        messages: MessageService,
        broker: Broker,
        runs: RunBook,
        config: Config,
        runs_nursery: trio.Nursery,
        background_nursery: trio.Nursery,
        save_timeout: float,
        provider_factory: ProviderFactory,
        tools: Any = None,
        on_idle: Callable[[], None] = lambda: None,
        max_queued_prompts: int = DEFAULT_MAX_QUEUED_PROMPTS,
        max_queued_prompt_bytes: int = DEFAULT_MAX_QUEUED_PROMPT_BYTES,
        on_complete: Callable[[RunComplete], None] = lambda _: None,
        terminals: Terminals | None = None,
        prompts: SystemPrompts | None = None,
        changes: ChangeHooks | None = None,
    ) -> None:
        self.store = store
        #: Builds each turn's system prompt (None: the template without environment or context
        #: files).
        self.prompts = prompts
        #: Snapshots before and after each turn (the workspace's change log), or None.
        self.changes = changes
        #: Told each run's end, once, just before its run_complete is published (webhooks); it
        #: must return at once.
        self._on_complete = on_complete
        #: In a cluster: the once-only record of each run's terminal event (None: embedded).
        self.terminals = terminals
        self.messages = messages
        self.broker = broker
        #: The log ids of the task that made the agent (its workspace's), for its turns' logs.
        self._log_ids = current_context()
        self.runs = runs
        self.config = config
        self.state = AgentState()
        METRICS.track_queue(self.state)
        self._runs_nursery = runs_nursery
        self._bg = background_nursery
        self.save_timeout = save_timeout
        self._provider_factory = provider_factory
        self._providers: dict[str, pb.Provider] = {}
        self._replaced_providers: list[pb.Provider] = []
        self.tools = tools
        self._bind_tools(tools)
        self._scopes: dict[int, trio.CancelScope] = {}
        #: Runs accepted and not yet ended: a run_complete is published only for a run still in
        #: here, and the run leaves it then (exactly once; memory bounded by the live runs).
        self._live: set[str] = set()
        #: When each live run was accepted (trio clock), for the run metrics.
        self._accepted_at: dict[str, float] = {}
        #: The model a prompt named (``AgentMessage.model``), by run id, until its turn ends.
        self._prompt_models: dict[str, str] = {}
        #: Turns that are a summary asked for by a client (by ``id(turn)``).
        self._summary_turns: dict[int, _SummaryWaiter] = {}
        self._on_idle = on_idle
        self.closing = False
        self.max_queued_prompts = max_queued_prompts
        self.max_queued_prompt_bytes = max_queued_prompt_bytes
        self.titles = Titles(
            store=store,
            broker=broker,
            config=config,
            provider_for=self._provider,
            is_busy=self.state.is_busy,
            save_timeout=save_timeout,
        )

    # -- public operations (called from request handlers: synchronous decisions only) ----------

    def replace_config(self, config: Config, tools: Any) -> None:
        """Use ``config`` and ``tools`` for turns started from now on (providers are set up
        again from the new configuration)."""
        self.config = config
        self.tools = tools
        self._bind_tools(tools)
        # A running turn may still use them: they are closed with the others at shutdown.
        self._replaced_providers += self._providers.values()
        self._providers = {}

    def _bind_tools(self, tools: Any) -> None:
        """Let ``tools`` run ``agent`` calls through this agent (a toolbox with a ``subagent``
        slot; other tool objects are left as they are)."""
        if tools is not None and hasattr(tools, "subagent"):
            tools.subagent = self

    async def run_subagent(
        self, *, parent_session_id: str, run_id: str | None, tool_call_id: str, prompt: str
    ) -> str:
        """Run an ``agent`` tool call (see :func:`crush_trio.agent.subagent.run_subagent`)."""
        from .subagent import run_subagent

        return await run_subagent(
            self,
            parent_session_id=parent_session_id,
            run_id=run_id,
            tool_call_id=tool_call_id,
            prompt=prompt,
        )

    def model_info(self) -> dict[str, Any]:
        name, provider, model = self.config.resolve_model("large")
        return {"provider": name, "type": provider.type, "model": model.id}

    def is_busy(self, session_id: str | None = None) -> bool:
        if session_id is None:
            return bool(self.state.busy_sessions())
        return self.state.is_busy(session_id)

    async def submit(
        self,
        session_id: str,
        text: str,
        run_id: str | None,
        model: str | None = None,
        attachments: Sequence[wire.BinaryPart] = (),
    ) -> wire.AcceptedPrompt:
        """Accept a prompt; returns the run's id and status once its record is durable.

        The decision is taken at once (the run may start streaming right away); the return waits
        for the transaction that stores the run's record with its prompt, shared with every other
        run accepted meanwhile (docs/protocol.md "Durability of an accepted prompt").

        Raises:
            Conflict: the workspace is closing.
            BadRequest: empty prompt, unknown session, or a ``run_id`` already used.
            TooManyRequests: the session's queue is full (``server.max_queued_prompts`` or
                ``server.max_queued_prompt_bytes``).
            StoreError: the record could not be stored; the run is cancelled, nothing was
                accepted.
        """
        accepted = await self.accept(session_id, text, run_id, model, attachments)
        await self.durable(accepted.run_id)
        return accepted

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

    async def accept(
        self,
        session_id: str,
        text: str,
        run_id: str | None,
        model: str | None = None,
        attachments: Sequence[wire.BinaryPart] = (),
    ) -> wire.AcceptedPrompt:
        """Take the decision on a prompt (PROTOCOL §3); its record is not durable yet (see
        :meth:`submit` and :meth:`RunBook.wait_inserted`). ``model`` (``provider/model``) is
        the model for this prompt's turn instead of ``models.large``."""
        if self.closing:
            raise Conflict("workspace closing: it is shutting down; open it again and resend")
        if not text.strip() and not attachments:
            raise BadRequest("prompt is empty; send the text for the agent in 'prompt'")
        if model is not None:
            try:
                self.config.resolve_named_model(model)
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
            raise Conflict("workspace closing: it is shutting down; open it again and resend")
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
        self._live.add(prompt.run_id)
        self._accepted_at[prompt.run_id] = trio.current_time()
        METRICS.runs_accepted.inc()
        if model is not None:
            self._prompt_models[prompt.run_id] = model
        if turn is not None:
            self._publish_busy(session_id)
            self._runs_nursery.start_soon(self._drive, turn, name=f"session-{session_id}")
        return wire.AcceptedPrompt(prompt.run_id, session_id, admission.value)  # type: ignore[arg-type]

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

    async def summarize(self, session_id: str) -> Message:
        """Summarize the session now (``POST .../summarize``); returns the stored summary.

        The summary runs as a turn of its own in the session's driver, so prompts sent meanwhile
        queue behind it and a cancel of the session stops it.

        Raises:
            Conflict: the workspace is closing, the session is busy (a run or a summary in
                progress, or prompts queued), or the summary was cancelled.
            NotFound: no such session.
            BadRequest: the session has no messages.
            ProviderError: the model failed (nothing was stored).
        """
        if self.closing:
            raise Conflict("workspace closing: it is shutting down; open it again and resend")
        if not self.store.session_exists(session_id):
            raise NotFound(f"session {session_id!r} does not exist in this workspace")
        if not await self.messages_for(session_id):
            raise BadRequest(f"session {session_id!r} has no messages to summarize")
        if self.closing:
            raise Conflict("workspace closing: it is shutting down; open it again and resend")
        if self.state.would_queue(session_id):
            raise Conflict(
                f"session busy: session {session_id!r} has a run in progress or queued; "
                "summarize it once it is idle, or cancel it first"
            )
        _prompt, _admission, turn = self.state.accept(session_id, new_id(), "", explicit=True)
        assert turn is not None  # the session was idle
        waiter = _SummaryWaiter()
        self._summary_turns[id(turn)] = waiter
        self._publish_busy(session_id)
        self._runs_nursery.start_soon(self._drive, turn, name=f"session-{session_id}")
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
            scope = self._scopes.get(id(outcome.turn))
            if scope is not None:
                scope.cancel()
        if outcome.dropped:
            (nursery or self._bg).start_soon(self._complete_dropped, outcome.dropped)

    def clear_queue(self, session_id: str) -> None:
        dropped = self.state.clear_queue(session_id)
        if dropped:
            self._bg.start_soon(self._complete_dropped, dropped)

    def queued_prompts(self, session_id: str) -> list[str]:
        return [p.text for p in self.state.queued(session_id)]

    def begin_shutdown(self) -> None:
        """Refuse new prompts and cancel every session's work (PROTOCOL §6)."""
        self.closing = True
        for outcome in self.state.cancel_all():
            self._apply(outcome, self._runs_nursery)

    async def aclose(self) -> None:
        for provider in [*self._providers.values(), *self._replaced_providers]:
            with trio.move_on_after(self.save_timeout, shield=True):
                await provider.aclose()
        self._providers.clear()
        self._replaced_providers.clear()

    # -- drivers --------------------------------------------------------------------------------

    async def _drive(self, turn: Turn | None) -> None:
        while turn is not None:
            # Log records of the turn (tools, providers, saves) name its session and run.
            ids = {**self._log_ids, "session_id": turn.session_id, "run_id": turn.primary.run_id}
            with log_context(**ids):
                completes = await self._run_turn(turn)
            next_turn, dropped = self.state.finish_turn(turn)
            if next_turn is None:
                self._publish_busy(turn.session_id)
            await self._publish_completes(completes)
            if dropped:
                await self._complete_dropped(dropped)
            turn = next_turn
            if turn is None and not self.state.busy_sessions():
                self._on_idle()

    async def _complete_dropped(self, dropped: list[Prompt]) -> None:
        """Queued prompts dropped by a cancel, a clear or shutdown: cancelled terminals."""
        completes = []
        reason = "shutdown" if self.closing else "cancel"
        for prompt in dropped:
            self._prompt_models.pop(prompt.run_id, None)
            self._count_end(prompt.run_id, RunStatus.CANCELLED, reason)
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
        await self._publish_completes(completes)
        if not self.state.busy_sessions():
            self._on_idle()

    async def _publish_completes(self, completes: list[RunComplete]) -> None:
        """Publish terminals in a shielded scope bounded by the save timeout plus one
        must-deliver timeout per terminal."""
        bound = self.save_timeout + self.broker.must_deliver_timeout * len(completes)
        with trio.move_on_after(bound, shield=True):
            for complete in completes:
                await self._publish_complete(complete)

    async def _publish_complete(self, complete: RunComplete) -> None:
        if complete.run_id not in self._live:
            return
        self._live.discard(complete.run_id)
        if self.terminals is not None:
            run = self.runs.get(complete.run_id)
            if run is not None and not await self.terminals.record(run, complete):
                return  # another node ended the run (it recovered it after this one lost its lease)
        try:
            self._on_complete(complete)
        except Exception:
            log.exception("the run-end hook failed for run %s", complete.run_id)
        event = await self.broker.publish_must_deliver(complete, EventKind.CREATED)
        if self.terminals is not None:
            await self.terminals.logged(complete.run_id, event)

    def _publish_busy(self, session_id: str) -> None:
        self._bg.start_soon(self._publish_session, session_id)

    async def _publish_session(self, session_id: str) -> None:
        session = await self.store.get_session(session_id)
        if session is not None:
            session.is_busy = self.state.is_busy(session_id)
            self.broker.publish(session, EventKind.UPDATED)

    # -- one turn -------------------------------------------------------------------------------

    async def _run_turn(self, turn: Turn) -> list[RunComplete]:
        """Run ``turn`` to its end and save its final state; returns its terminal events.

        Cancellation: a user cancel ends the turn cancelled and returns normally; a cancel from
        outside (workspace shutdown) saves the same final state and then propagates.
        """
        waiter = self._summary_turns.pop(id(turn), None)
        if waiter is not None:
            await self._run_summary_turn(turn, waiter)
            return []
        progress = _TurnProgress(turn)
        error: BaseException | None = None
        cancelled = False
        try:
            with trio.CancelScope() as scope:
                self._scopes[id(turn)] = scope
                if turn.cancelled:
                    scope.cancel()
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
            self._scopes.pop(id(turn), None)
            if cancelled:
                self._cancel_jobs(turn)
            # The terminals are decided in memory first, so that a slow or failing store can
            # delay or lose a save but never a run's run_complete.
            completes = self._decide(progress, error=error, cancelled=cancelled)
            if self.changes is not None:
                # Not abandoned on cancel: the snapshot's git commands are bounded themselves.
                with trio.move_on_after(self.save_timeout, shield=True):
                    await self.changes.end_run(turn.session_id, [p.run_id for p in turn.prompts])
            with trio.move_on_after(self.save_timeout, shield=True):
                try:
                    await self._save_final(progress, error=error, cancelled=cancelled)
                except Fenced as exc:  # another node owns the workspace: expected, one line
                    log.warning("the end of run %s was not saved: %s", turn.primary.run_id, exc)
                except Exception:
                    log.exception("saving the end of run %s failed", turn.primary.run_id)
        return completes

    def _cancel_jobs(self, turn: Turn) -> None:
        """A cancelled turn: its runs' background jobs end too when ``options.jobs
        .kill_on_cancel`` says so (see :meth:`JobManager.cancel_runs`)."""
        jobs = getattr(self.tools, "jobs", None)
        if jobs is not None:
            jobs.cancel_runs(p.run_id for p in turn.prompts)

    def _decide(
        self, progress: _TurnProgress, *, error: BaseException | None, cancelled: bool
    ) -> list[RunComplete]:
        """How the turn ended, in memory: run records move to their final status and the
        terminal events are built. A failed or cancelled turn gets an assistant message (created
        here, saved by :meth:`_save_final`) so every run_complete names one."""
        turn = progress.turn
        error_text = _error_text(error) if error is not None and not cancelled else None
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
        reason = run_reason(error, cancelled=cancelled, closing=self.closing)
        for prompt in turn.prompts:
            self._prompt_models.pop(prompt.run_id, None)
            self._count_end(prompt.run_id, status, reason)
            run = self.runs.get(prompt.run_id)
            if run is not None and not run.status.terminal:
                self.runs.set_status(
                    run, status, message_id=message_id, text=text, error=error_text
                )
            completes.append(
                RunComplete(turn.session_id, prompt.run_id, message_id, text, error_text, cancelled)
            )
        if error_text is not None:
            for prompt in turn.prompts:
                self.broker.publish(
                    AgentEvent(
                        "error",
                        session_id=turn.session_id,
                        run_id=prompt.run_id,
                        text=error_text,
                        error=error_text,
                    ),
                    EventKind.CREATED,
                )
        return completes

    def _count_end(self, run_id: str, status: RunStatus, reason: str) -> None:
        """The run metrics of a run's end (once: its acceptance time is taken)."""
        started = self._accepted_at.pop(run_id, None)
        if started is not None:
            METRICS.run_finished(trio.current_time() - started, status.value, reason)

    def _first_token(self, progress: _TurnProgress) -> None:
        progress.first_token = True
        started = self._accepted_at.get(progress.turn.primary.run_id)
        if started is not None:
            METRICS.time_to_first_token.observe(trio.current_time() - started)

    async def _save_final(
        self, progress: _TurnProgress, *, error: BaseException | None, cancelled: bool
    ) -> None:
        """The shielded final save of a turn: repair the history, flush, save run records."""
        turn = progress.turn
        session_alive = self.store.session_exists(turn.session_id)
        if session_alive and (cancelled or error is not None):
            for prompt in turn.prompts:
                if prompt.run_id not in progress.user_written:
                    await self._write_user_message(progress, prompt)
            msg = progress.assistant
            assert msg is not None  # made by _decide
            if progress.assistant_unsaved:
                await self.messages.create(msg)
                progress.assistant_unsaved = False
            repair_tool_calls(msg)
            # The turn ended here: whatever finish the step had (tool_use while its tools ran)
            # gives way to the one that says how the turn ended.
            msg.parts = [p for p in msg.parts if not isinstance(p, FinishPart)]
            if cancelled:
                msg.parts.append(FinishPart(FinishReason.CANCELED, message=CANCELED_MESSAGE))
            else:
                msg.parts.append(
                    FinishPart(FinishReason.ERROR, message=_error_text(error) if error else "")
                )
            msg.updated_at = now()
            await self.messages.update(msg)
            await self._write_missing_results(progress, cancelled=cancelled)
        await self.messages.flush_all()
        await self.runs.save_now()

    async def _write_user_message(self, progress: _TurnProgress, prompt: Prompt) -> None:
        msg = Message(
            new_id(), prompt.session_id, Role.USER, [TextPart(prompt.text), *prompt.parts]
        )
        await self.messages.create(msg)
        progress.history.append(msg)
        progress.user_written.add(prompt.run_id)

    async def _write_missing_results(self, progress: _TurnProgress, *, cancelled: bool) -> None:
        msg = progress.assistant
        if msg is None:
            return
        parts = missing_results(msg, progress.results, cancelled=cancelled)
        if not parts:
            return
        await self.messages.create(Message(new_id(), msg.session_id, Role.TOOL, parts))
        progress.results.update(p.tool_call_id for p in parts if isinstance(p, ToolResultPart))

    async def _turn_body(self, progress: _TurnProgress) -> None:
        turn = progress.turn
        sid = turn.session_id
        for prompt in turn.prompts:
            self._mark_running(prompt)
        if not self.store.session_exists(sid):
            raise SessionGone(f"session {sid!r} was deleted before its run could start")
        provider_name, provider_cfg, model_entry = self._turn_model(turn)
        provider = self._provider(provider_name, provider_cfg)
        progress.model, progress.provider = model_entry.id, provider_name
        progress.model_entry = model_entry
        # The history is read once; this turn's own messages are appended as they are made (no
        # other turn runs on this session meanwhile), so later steps need no database round trip.
        progress.history = await self.model_history(sid)
        first_prompt = not any(m.role is Role.USER for m in progress.history)
        await self._write_user_message(progress, turn.primary)
        if first_prompt:
            # The title reads the session and keeps a title the client already set.
            self._bg.start_soon(self.titles.generate, sid, turn.primary.text)

        options = self.config.options
        max_tokens = model_entry.default_max_tokens
        system = await self._system_prompt(sid, provider_name, model_entry)
        repeated = RepeatedCalls()
        for _step in range(options.max_steps):
            for prompt in self.state.take_foldable(sid):
                self._mark_running(prompt)
                await self._write_user_message(progress, prompt)
            request = pb.ModelRequest(
                model=pb.ModelInfo(
                    model_entry.id,
                    model_entry.name,
                    model_entry.context_window,
                    model_entry.default_max_tokens,
                    reasoning_effort=model_entry.reasoning_effort,
                    thinking_budget=model_entry.thinking_budget,
                ),
                system=system,
                messages=list(progress.history),
                tools=self.tools.specs() if self.tools is not None else [],
                max_tokens=max_tokens,
            )
            msg = Message(new_id(), sid, Role.ASSISTANT, model=model_entry.id)
            msg.provider = provider_name
            progress.assistant = msg  # before the create: a cancel in between still repairs it
            progress.results = set()
            await self.messages.create(msg)
            progress.history.append(msg)
            reason = await self._stream_step(provider, request, msg, progress)
            calls = msg.tool_calls()
            if reason is FinishReason.TOOL_USE or calls:
                repeated.check(calls)
                try:
                    await run_tools(
                        tools=self.tools,
                        messages=self.messages,
                        msg=msg,
                        calls=calls,
                        done=progress.results,
                        history=progress.history,
                        save_timeout=self.save_timeout,
                        run_id=turn.primary.run_id,
                    )
                except StopTurn as stop:
                    # A denied permission ends the turn; the tool result says why. One nobody
                    # answered in time also fails the run, so its record says why it ended.
                    msg.parts = [p for p in msg.parts if not isinstance(p, FinishPart)]
                    msg.parts.append(FinishPart(FinishReason.END_TURN))
                    await self.messages.update(msg)
                    if stop.error is not None:
                        raise PermissionTimeout(stop.error) from None
                    return
                more = True
            else:
                # Fold the prompts that arrived during this step into a next step.
                more = any(not p.explicit for p in self.state.queued(sid))
            await self._compact_if_full(progress, provider, more=more)
            if more:
                continue
            return
        raise ProviderError(
            f"the agent stopped after {options.max_steps} steps (options.max_steps); "
            "raise the limit or split the task"
        )

    # -- models, usage and summaries ------------------------------------------------------------

    async def _system_prompt(self, session_id: str, provider_name: str, entry: Any) -> str:
        """The turn's system prompt (the same for each of its steps, so the provider's prompt
        cache holds across them)."""
        tools = self.tools.specs() if self.tools is not None else []
        model = f"{provider_name}/{entry.id}" + (f" ({entry.name})" if entry.name else "")
        if self.prompts is None:
            return render_system_prompt(tools, None, ContextFiles())
        return await self.prompts.build(session_id, tools, model)

    def context_info(self) -> wire.ContextFilesInfo:
        """The context files of the last turn (or of the workspace's opening)."""
        current = self.prompts.context.current if self.prompts is not None else ContextFiles()
        return wire.ContextFilesInfo(
            loaded=[
                wire.ContextFileInfo(f.path, f.size, truncated=f.truncated) for f in current.files
            ],
            skipped=[wire.SkippedContextFile(f.path, f.reason) for f in current.skipped],
        )

    def _turn_model(self, turn: Turn) -> tuple[str, Any, Any]:
        """The provider name, provider config and model entry of a turn: the model its prompt
        named, else ``models.large``."""
        spec = self._prompt_models.get(turn.primary.run_id)
        if spec is not None:
            return self.config.resolve_named_model(spec)
        return self.config.resolve_model("large")

    async def model_history(self, session_id: str) -> list[Message]:
        """What a model request of the session carries: from its summary on, if it has one
        (the stored history stays whole)."""
        messages = await self.messages_for(session_id)
        if not any(m.is_summary_message for m in messages):
            return messages
        session = await self.store.get_session(session_id)
        return history_from_summary(messages, session.summary_message_id if session else None)

    async def _on_usage(self, msg: Message, usage: pb.Usage, progress: _TurnProgress) -> None:
        """A step's usage: the session's token counts become the step's and its cost is added
        (a summary's usage is recorded when the summary is stored)."""
        progress.usage = usage
        if msg.is_summary_message:
            return
        cost = step_cost(usage, progress.model_entry) if progress.model_entry else 0.0
        await self.store.record_step_usage(
            msg.session_id, usage.prompt_tokens, usage.completion_tokens, cost
        )

    async def _compact_if_full(
        self, progress: _TurnProgress, provider: pb.Provider, *, more: bool
    ) -> None:
        """After a step: summarize when the context is nearly full (Crush's rule, see
        :func:`~crush_trio.agent.summarize.should_compact`); a turn with ``more`` steps to go
        goes on from the summary under the same run."""
        usage, entry = progress.usage, progress.model_entry
        if usage is None or entry is None:
            return
        used = usage.prompt_tokens + usage.completion_tokens
        if not should_compact(
            used, context_window(entry, self.config.options), self.config.options
        ):
            return
        summary = await self._summarize(progress, provider, list(progress.history))
        progress.usage = None
        request = "\n\n".join(p.text for p in progress.turn.prompts) if more else ""
        progress.history = history_from_summary([summary], summary.id, continue_with=request)

    async def _run_summary_turn(self, turn: Turn, waiter: _SummaryWaiter) -> None:
        """A summary a client asked for, as a turn of the session (no run record, no
        run_complete: the request's answer is its result)."""
        progress = _TurnProgress(turn)
        try:
            with trio.CancelScope() as scope:
                self._scopes[id(turn)] = scope
                if turn.cancelled:
                    scope.cancel()
                name, cfg, entry = self.config.resolve_model("large")
                provider = self._provider(name, cfg)
                progress.model, progress.provider, progress.model_entry = entry.id, name, entry
                history = await self.model_history(turn.session_id)
                waiter.message = await self._summarize(progress, provider, history)
            if scope.cancelled_caught or turn.cancelled:
                waiter.message = None
                waiter.error = Conflict(
                    f"the summary of session {turn.session_id!r} was cancelled; nothing was stored"
                )
        except Exception as exc:
            error = unwrap_group(exc)
            if not isinstance(error, CrushError):
                log.exception("summary of session %s failed with a bug", turn.session_id)
                error = ProviderError(_error_text(error))
            waiter.error = error
        finally:
            self._scopes.pop(id(turn), None)
            if waiter.message is None and waiter.error is None:
                waiter.error = Conflict("workspace closing: the summary was stopped")
            waiter.done.set()

    async def _summarize(
        self, progress: _TurnProgress, provider: pb.Provider, history: list[Message]
    ) -> Message:
        """Ask the model for a summary of ``history``, store it as a summary message and point
        the session at it. Visible as ``summarize`` agent events and the message's events.

        On failure or cancel the partial summary message is deleted (a ``deleted`` event) and
        the session keeps its previous summary; the error propagates.
        """
        turn, entry = progress.turn, progress.model_entry
        sid = turn.session_id
        # A run's compaction names the run; a summary a client asked for has no run.
        run_id = turn.primary.run_id if self.runs.get(turn.primary.run_id) else None
        self._summary_event(sid, run_id, SUMMARY_STARTING)
        msg = Message(new_id(), sid, Role.ASSISTANT, model=entry.id, is_summary_message=True)
        msg.provider = progress.provider
        request = summary_request(
            pb.ModelInfo(entry.id, entry.name, entry.context_window, entry.default_max_tokens),
            history,
            sid,
            self.config.options.summary_max_tokens,
        )
        created = False
        try:
            await self.messages.create(msg)
            created = True
            self._summary_event(sid, run_id, SUMMARY_GENERATING)
            progress.usage = None
            await self._stream_step(provider, request, msg, progress)
            if not msg.text().strip():
                raise ProviderError(
                    f"provider {progress.provider!r} returned an empty summary; try again or "
                    "use another model"
                )
            await self.messages.flush(msg.id)
            usage = progress.usage or pb.Usage()
            session = await self.store.set_summary(
                sid, msg.id, usage.completion_tokens, step_cost(usage, entry)
            )
        except BaseException as exc:
            cancelled = isinstance(exc, trio.Cancelled) or turn.cancelled
            with trio.move_on_after(self.save_timeout, shield=True):
                if created:
                    try:
                        await self.messages.forget(msg.id)
                        await self.store.delete_message(msg.id)
                        self.broker.publish(msg, EventKind.DELETED)
                    except Exception:
                        log.exception("removing the failed summary %s failed", msg.id)
            error = "" if cancelled else _error_text(unwrap_group(exc))
            self._summary_event(
                sid, run_id, SUMMARY_CANCELLED if cancelled else SUMMARY_FAILED, error=error
            )
            raise
        if session is not None:
            session.is_busy = self.state.is_busy(sid)
            self.broker.publish(session, EventKind.UPDATED)
        self._summary_event(sid, run_id, SUMMARY_DONE)
        return msg

    def _summary_event(
        self, session_id: str, run_id: str | None, progress: str, *, error: str = ""
    ) -> None:
        done = progress not in (SUMMARY_STARTING, SUMMARY_GENERATING)
        self.broker.publish(
            AgentEvent(
                "summarize",
                session_id=session_id,
                run_id=run_id,
                text=error or progress,
                error=error,
                progress=progress,
                done=done,
            ),
            EventKind.CREATED,
        )

    def _mark_running(self, prompt: Prompt) -> None:
        run = self.runs.get(prompt.run_id)
        if run is not None and run.status is RunStatus.QUEUED:
            self.runs.set_status(run, RunStatus.RUNNING)

    async def messages_for(self, session_id: str) -> list[Message]:
        await self.messages.flush_session(session_id)
        return await self.store.list_messages(session_id)

    def _provider(self, name: str, cfg: Any) -> pb.Provider:
        provider = self._providers.get(name)
        if provider is None:
            try:
                provider = self._provider_factory(name, cfg)
            except CrushError:
                raise
            except Exception as exc:
                raise ConfigError(f"provider {name!r} could not be set up: {exc}") from exc
            self._providers[name] = provider
        return provider

    async def _stream_step(
        self,
        provider: pb.Provider,
        request: pb.ModelRequest,
        msg: Message,
        progress: _TurnProgress,
    ) -> FinishReason:
        assembler = StepAssembler(msg)
        stream = provider.stream(request)
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for event in stream:
                if assembler.feed(event):
                    if not progress.first_token:
                        self._first_token(progress)
                    await self.messages.update(msg, assembler.append)
                elif isinstance(event, pb.Usage):
                    await self._on_usage(msg, event, progress)
                elif isinstance(event, pb.Retrying):
                    self.broker.publish(
                        AgentEvent(
                            "retry",
                            session_id=msg.session_id,
                            run_id=progress.turn.primary.run_id,
                            text=f"retry {event.attempt} in {event.delay:.1f}s: {event.reason}",
                        ),
                        EventKind.CREATED,
                    )
        reason = assembler.finish()
        await self.messages.update(msg)
        return reason


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, CrushError):
        return exc.message
    return bug_message(exc, detail=True)
