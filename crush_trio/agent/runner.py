"""The agent: turns for every session of one workspace, as the plain logic of
:mod:`crush_trio.core.agent_state` decides them.

:class:`Agent` is the face the request handlers, the workspace and the tools see; it wires four
parts that each own one concern, with their dependencies passed explicitly:

* :mod:`~crush_trio.agent.admission`: the synchronous decisions request handlers call (accept
  or refuse a prompt, queue bounds, cancel, clear, shutdown);
* :mod:`~crush_trio.agent.turns`: the session drivers and the turn loop (model steps, tool
  steps, the turn's ``finally``);
* :mod:`~crush_trio.agent.terminals`: deciding and publishing each run's ``run_complete``
  exactly once, final saves, the terminals of dropped prompts;
* :mod:`~crush_trio.agent.compaction`: summaries, automatic and asked for.

They share :mod:`~crush_trio.agent.steps` (a turn's progress, its cancel scope, the message I/O
of a model step). Session titles: :mod:`crush_trio.agent.titles`; sub-agents:
:mod:`crush_trio.agent.subagent`.

Ownership: every turn runs in a *session driver* task started in the workspace's runs nursery
(never in a request handler). Title generation and dropped-prompt terminals run in the
workspace's background nursery.

Exactly-once terminals: every accepted run ends through
:meth:`~crush_trio.agent.terminals.RunEnds.publish`, which publishes its ``run_complete``
(must-deliver) only the first time it is called for that run. Whatever ends a turn passes
through the turn's ``finally`` block, whose saves run inside
``trio.move_on_after(save_timeout, shield=True)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import wire
from ..core.agent_state import AgentState
from ..core.ports import ChangeHooks, Terminals
from ..defaults import DEFAULT_MAX_QUEUED_PROMPT_BYTES, DEFAULT_MAX_QUEUED_PROMPTS
from ..errors import SessionGone
from ..logs import current_context
from ..metrics import METRICS
from .admission import Admission
from .compaction import (
    SUMMARY_CANCELLED,
    SUMMARY_DONE,
    SUMMARY_FAILED,
    SUMMARY_GENERATING,
    SUMMARY_STARTING,
    Compaction,
    SummaryWaiter,
)
from .context_files import ContextFiles
from .provider_cache import ProviderCache, ProviderFactory, close_provider
from .steps import CANCELED_MESSAGE, AgentSetup, StepIO, TurnProgress, TurnScopes, error_text
from .terminals import LiveRuns, RunEnds
from .titles import Titles
from .turns import TurnLoop

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import trio

    from ..broker import Broker
    from ..config import Config
    from ..core.ports import WorkspaceStore
    from ..providers import base as pb
    from ..store import MessageService
    from ..wire import Message, RunComplete
    from .prompt import SystemPrompts
    from .runs import RunBook

__all__ = [
    "CANCELED_MESSAGE",
    "SUMMARY_CANCELLED",
    "SUMMARY_DONE",
    "SUMMARY_FAILED",
    "SUMMARY_GENERATING",
    "SUMMARY_STARTING",
    "Agent",
    "AgentSetup",
    "ChangeHooks",
    "ProviderFactory",
    "SessionGone",
    "SummaryWaiter",
    "Terminals",
    "TurnProgress",
    "error_text",
]


class Agent:
    """Turns for every session of one workspace.

    Args:
        store, messages, broker, runs: the workspace's services.
        config: the workspace's configuration (models, options).
        runs_nursery: where session drivers run (cancelled first at shutdown).
        background_nursery: titles and other work not bound to a run.
        save_timeout: bound on each shielded final save (seconds).
        tools: the tools offered to the model (an object with ``specs()`` and ``call``) or None.
        on_idle: told when no session is busy any more.
        max_queued_prompts, max_queued_prompt_bytes: the bound on each session's queue
            (``server.max_queued_prompts``, ``server.max_queued_prompt_bytes``).
        on_complete: told each run's end, once, just before its run_complete is published
            (webhooks); it must return at once.
        terminals: in a cluster, the once-only record of each run's terminal event (None:
            embedded).
        prompts: builds each turn's system prompt (None: the template without environment or
            context files).
        changes: snapshots before and after each turn (the workspace's change log), or None.
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
        self.messages = messages
        self.broker = broker
        self.runs = runs
        self.prompts = prompts
        self.changes = changes
        self.terminals = terminals
        self.save_timeout = save_timeout
        self.state = AgentState()
        METRICS.track_queue(self.state)
        self._bg = background_nursery
        #: The configuration and tools of turns started from now on.
        self.setup = AgentSetup(config, tools)
        self._bind_tools(tools)
        #: The workspace's providers; a replaced one is closed when its last user is done.
        self.providers = ProviderCache(provider_factory, close_soon=self._close_provider_soon)
        self.titles = Titles(
            store=store,
            broker=broker,
            config=config,
            providers=self.providers,
            is_busy=self.state.is_busy,
            save_timeout=save_timeout,
        )
        self._assemble(
            runs_nursery=runs_nursery,
            on_idle=on_idle,
            on_complete=on_complete,
            max_queued_prompts=max_queued_prompts,
            max_queued_prompt_bytes=max_queued_prompt_bytes,
        )

    def _assemble(
        self,
        *,
        runs_nursery: trio.Nursery,
        on_idle: Callable[[], None],
        on_complete: Callable[[RunComplete], None],
        max_queued_prompts: int,
        max_queued_prompt_bytes: int,
    ) -> None:
        """Make the agent's parts, each given what it uses."""
        store, messages, broker, runs = self.store, self.messages, self.broker, self.runs
        save_timeout = self.save_timeout
        self.live = LiveRuns()
        self.scopes = TurnScopes()
        #: The message I/O of model steps (turns, summaries and sub-agents).
        self.steps = StepIO(
            messages=messages, store=store, broker=broker, on_first_token=self.live.first_token
        )
        self.ends = RunEnds(
            store=store,
            messages=messages,
            broker=broker,
            runs=runs,
            steps=self.steps,
            live=self.live,
            state=self.state,
            save_timeout=save_timeout,
            closing=lambda: self.closing,
            on_idle=on_idle,
            on_complete=on_complete,
            terminals=self.terminals,
        )
        self.compaction = Compaction(
            setup=self.setup,
            store=store,
            messages=messages,
            broker=broker,
            runs=runs,
            state=self.state,
            providers=self.providers,
            steps=self.steps,
            scopes=self.scopes,
            save_timeout=save_timeout,
        )
        self.turns = TurnLoop(
            setup=self.setup,
            state=self.state,
            store=store,
            messages=messages,
            broker=broker,
            runs=runs,
            providers=self.providers,
            titles=self.titles,
            prompts=self.prompts,
            changes=self.changes,
            steps=self.steps,
            scopes=self.scopes,
            live=self.live,
            ends=self.ends,
            compaction=self.compaction,
            runs_nursery=runs_nursery,
            background_nursery=self._bg,
            save_timeout=save_timeout,
            # The log ids of the task that made the agent (its workspace's), for its turns' logs.
            log_ids=current_context(),
        )
        self.admission = Admission(
            setup=self.setup,
            state=self.state,
            store=store,
            runs=runs,
            steps=self.steps,
            live=self.live,
            scopes=self.scopes,
            turns=self.turns,
            ends=self.ends,
            compaction=self.compaction,
            runs_nursery=runs_nursery,
            background_nursery=self._bg,
            max_queued_prompts=max_queued_prompts,
            max_queued_prompt_bytes=max_queued_prompt_bytes,
        )

    # -- configuration ---------------------------------------------------------------------------

    @property
    def config(self) -> Config:
        return self.setup.config

    @property
    def tools(self) -> Any:
        return self.setup.tools

    def replace_config(self, config: Config, tools: Any) -> None:
        """Use ``config`` and ``tools`` for turns started from now on (providers are set up
        again from the new configuration)."""
        self.setup.config = config
        self.setup.tools = tools
        self._bind_tools(tools)
        # A running turn may still use them: each closes when its last user releases it.
        self.providers.retire()

    def _close_provider_soon(self, provider: pb.Provider) -> None:
        self._bg.start_soon(close_provider, provider, self.save_timeout)

    def _bind_tools(self, tools: Any) -> None:
        """Let ``tools`` run ``agent`` calls through this agent (a toolbox with a ``subagent``
        slot; other tool objects are left as they are)."""
        if tools is not None and hasattr(tools, "subagent"):
            tools.subagent = self

    def model_info(self) -> dict[str, Any]:
        name, provider, model = self.config.resolve_model("large")
        return {"provider": name, "type": provider.type, "model": model.id}

    def context_info(self) -> wire.ContextFilesInfo:
        """The context files of the last turn (or of the workspace's opening)."""
        current = self.prompts.context.current if self.prompts is not None else ContextFiles()
        return wire.ContextFilesInfo(
            loaded=[
                wire.ContextFileInfo(f.path, f.size, truncated=f.truncated) for f in current.files
            ],
            skipped=[wire.SkippedContextFile(f.path, f.reason) for f in current.skipped],
        )

    # -- public operations (called from request handlers: synchronous decisions only) ----------

    @property
    def closing(self) -> bool:
        """Whether the workspace is shutting down (new prompts are refused)."""
        return self.admission.closing

    @property
    def max_queued_prompts(self) -> int:
        return self.admission.max_queued_prompts

    @max_queued_prompts.setter
    def max_queued_prompts(self, value: int) -> None:
        self.admission.max_queued_prompts = value

    @property
    def max_queued_prompt_bytes(self) -> int:
        return self.admission.max_queued_prompt_bytes

    @max_queued_prompt_bytes.setter
    def max_queued_prompt_bytes(self, value: int) -> None:
        self.admission.max_queued_prompt_bytes = value

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
        await self.admission.durable(run_id)

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
        return await self.admission.accept(session_id, text, run_id, model, attachments)

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
        return await self.admission.summarize(session_id)

    def cancel(self, session_id: str) -> None:
        """Cancel the session's active turn and drop its queue; a no-op when idle."""
        self.admission.cancel(session_id)

    def cancel_run(self, run_id: str) -> bool:
        """Cancel one live run (see :meth:`AgentState.cancel_run`); False when it is not live."""
        return self.admission.cancel_run(run_id)

    def clear_queue(self, session_id: str) -> None:
        self.admission.clear_queue(session_id)

    def queued_prompts(self, session_id: str) -> list[str]:
        return self.admission.queued_prompts(session_id)

    def begin_shutdown(self) -> None:
        """Refuse new prompts and cancel every session's work (PROTOCOL §6)."""
        self.admission.begin_shutdown()

    async def aclose(self) -> None:
        await self.providers.aclose(self.save_timeout)

    # -- history and sub-agents ------------------------------------------------------------------

    async def model_history(self, session_id: str) -> list[Message]:
        """What a model request of the session carries: from its summary on, if it has one
        (the stored history stays whole)."""
        return await self.steps.model_history(session_id)

    async def messages_for(self, session_id: str) -> list[Message]:
        return await self.steps.messages_for(session_id)

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
