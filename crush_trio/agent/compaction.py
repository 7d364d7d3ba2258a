"""Summaries of a session: compaction when a turn's context is nearly full, and the summaries a
client asks for (``POST .../summarize``).

The request and the stored message are built by :mod:`crush_trio.agent.summarize` (plain
functions); this module streams the summary, stores it, points the session at it and publishes
its progress as ``summarize`` agent events. A summary a client asks for runs as a turn of its
own in the session's driver (see :class:`crush_trio.agent.turns.TurnLoop`), so prompts sent
meanwhile queue behind it and a cancel of the session stops it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final

import attrs
import trio

from ..errors import Conflict, CrushError, ProviderError, unwrap_group
from ..providers import base as pb
from ..wire import AgentEvent, EventKind, Message, Role, new_id
from .steps import TurnProgress, error_text
from .summarize import (
    context_window,
    history_from_summary,
    should_compact,
    step_cost,
    summary_request,
)

if TYPE_CHECKING:
    from ..broker import Broker
    from ..core.agent_state import AgentState, Turn
    from ..store import MessageService
    from ..store.protocol import WorkspaceStore
    from .provider_cache import ProviderCache
    from .runs import RunBook
    from .steps import AgentSetup, StepIO, TurnScopes

log = logging.getLogger(__name__)

#: Progress texts of ``summarize`` agent events (Crush's).
SUMMARY_STARTING: Final = "Starting summarization..."
SUMMARY_GENERATING: Final = "Generating summary..."
SUMMARY_DONE: Final = "Summary complete"
SUMMARY_FAILED: Final = "Summary failed"
SUMMARY_CANCELLED: Final = "Summary cancelled"


@attrs.define
class SummaryWaiter:
    """A summary asked for by ``POST .../summarize``: what its request handler waits for."""

    done: trio.Event = attrs.field(factory=trio.Event)
    message: Message | None = None
    error: BaseException | None = None


class Compaction:
    """Summarizes sessions for the agent's turns.

    Args:
        setup: the configuration (models, ``options``) of the turns started from now on.
        store, messages, broker, runs: the workspace's services.
        state: the agent's run bookkeeping (a session's busy flag when it is published).
        providers: the workspace's providers (a requested summary holds one while it runs).
        steps: streams the summary step.
        scopes: the cancel scope of a requested summary (a cancel of its session stops it).
        save_timeout: bound on removing a failed summary (seconds).
    """

    def __init__(
        self,
        *,
        setup: AgentSetup,
        store: WorkspaceStore,
        messages: MessageService,
        broker: Broker,
        runs: RunBook,
        state: AgentState,
        providers: ProviderCache,
        steps: StepIO,
        scopes: TurnScopes,
        save_timeout: float,
    ) -> None:
        self.setup = setup
        self.store = store
        self.messages = messages
        self.broker = broker
        self.runs = runs
        self.state = state
        self.providers = providers
        self.steps = steps
        self.scopes = scopes
        self.save_timeout = save_timeout
        #: Turns that are a summary asked for by a client (by ``id(turn)``).
        self._requested: dict[int, SummaryWaiter] = {}

    def request(self, turn: Turn) -> SummaryWaiter:
        """Make ``turn`` (accepted for an idle session) a summary asked for by a client."""
        waiter = self._requested[id(turn)] = SummaryWaiter()
        return waiter

    def take_request(self, turn: Turn) -> SummaryWaiter | None:
        """The waiter of ``turn`` if it is a requested summary (once)."""
        return self._requested.pop(id(turn), None)

    async def run_requested(self, turn: Turn, waiter: SummaryWaiter) -> None:
        """A summary a client asked for, as a turn of the session (no run record, no
        run_complete: the request's answer is its result)."""
        progress = TurnProgress(turn)
        try:
            with self.scopes.open(turn) as scope:
                name, cfg, entry = self.setup.config.resolve_model("large")
                provider = progress.held = self.providers.acquire(name, cfg)
                progress.model, progress.provider, progress.model_entry = entry.id, name, entry
                history = await self.steps.model_history(turn.session_id)
                waiter.message = await self.summarize(progress, provider, history)
            if scope.cancelled_caught or turn.cancelled:
                waiter.message = None
                waiter.error = Conflict(
                    f"the summary of session {turn.session_id!r} was cancelled; nothing was stored"
                )
        except Exception as exc:
            error = unwrap_group(exc)
            if not isinstance(error, CrushError):
                log.exception("summary of session %s failed with a bug", turn.session_id)
                error = ProviderError(error_text(error))
            waiter.error = error
        finally:
            if progress.held is not None:
                self.providers.release(progress.held)
            if waiter.message is None and waiter.error is None:
                waiter.error = Conflict("workspace closing: the summary was stopped")
            waiter.done.set()

    async def compact_if_full(
        self, progress: TurnProgress, provider: pb.Provider, *, more: bool
    ) -> None:
        """After a step: summarize when the context is nearly full (Crush's rule, see
        :func:`~crush_trio.agent.summarize.should_compact`); a turn with ``more`` steps to go
        goes on from the summary under the same run."""
        usage, entry = progress.usage, progress.model_entry
        if usage is None or entry is None:
            return
        used = usage.prompt_tokens + usage.completion_tokens
        options = self.setup.config.options
        if not should_compact(used, context_window(entry, options), options):
            return
        summary = await self.summarize(progress, provider, list(progress.history))
        progress.usage = None
        request = "\n\n".join(p.text for p in progress.turn.prompts) if more else ""
        progress.history = history_from_summary([summary], summary.id, continue_with=request)

    async def summarize(
        self, progress: TurnProgress, provider: pb.Provider, history: list[Message]
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
        self._event(sid, run_id, SUMMARY_STARTING)
        msg = Message(new_id(), sid, Role.ASSISTANT, model=entry.id, is_summary_message=True)
        msg.provider = progress.provider
        request = summary_request(
            pb.ModelInfo(entry.id, entry.name, entry.context_window, entry.default_max_tokens),
            history,
            sid,
            self.setup.config.options.summary_max_tokens,
        )
        created = False
        try:
            await self.messages.create(msg)
            created = True
            self._event(sid, run_id, SUMMARY_GENERATING)
            progress.usage = None
            await self.steps.stream(provider, request, msg, progress)
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
                    await self._remove(msg)
            error = "" if cancelled else error_text(unwrap_group(exc))
            self._event(
                sid, run_id, SUMMARY_CANCELLED if cancelled else SUMMARY_FAILED, error=error
            )
            raise
        if session is not None:
            session.is_busy = self.state.is_busy(sid)
            self.broker.publish(session, EventKind.UPDATED)
        self._event(sid, run_id, SUMMARY_DONE)
        return msg

    async def _remove(self, msg: Message) -> None:
        """Delete a failed summary message (the session keeps its previous summary)."""
        try:
            await self.messages.forget(msg.id)
            await self.store.delete_message(msg.id)
            self.broker.publish(msg, EventKind.DELETED)
        except Exception:
            log.exception("removing the failed summary %s failed", msg.id)

    def _event(
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
