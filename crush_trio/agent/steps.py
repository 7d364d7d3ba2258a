"""What every turn, summary and sub-agent shares: its progress, its cancel scope and the I/O of
its model steps.

:class:`TurnProgress` records what a turn has written so far, so that whatever ends it, its final
save knows what to repair. :class:`StepIO` reads the history a model request carries, streams a
step into its assistant message (folded by the plain-logic
:class:`~crush_trio.core.assembler.StepAssembler`), and writes the user messages and the ends of
a stopped step. :class:`TurnScopes` holds the cancel scope of each running turn, for a cancel to
stop it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Final

import attrs
import trio

from ..config import Config
from ..core.agent_state import Prompt, Turn
from ..core.assembler import StepAssembler, repair_tool_calls
from ..errors import CrushError, bug_message
from ..providers import base as pb
from ..providers.body import READ_PACER
from ..wire import (
    AgentEvent,
    EventKind,
    FinishPart,
    FinishReason,
    Message,
    Role,
    TextPart,
    ToolResultPart,
    new_id,
    now,
)
from .summarize import history_from_summary, step_cost
from .tool_step import missing_results

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Iterator

    from ..broker import Broker
    from ..store import MessageService
    from ..store.protocol import WorkspaceStore

#: The finish message of a cancelled turn's last assistant message (Crush's).
CANCELED_MESSAGE: Final = "User canceled request"


def error_text(exc: BaseException) -> str:
    """What a run's record and its ``run_complete`` say about the error that ended it."""
    if isinstance(exc, CrushError):
        return exc.message
    return bug_message(exc, detail=True)


@attrs.define
class AgentSetup:
    """The configuration and tools of the turns started from now on (a running turn reads them
    at each step): replaced by :meth:`crush_trio.agent.runner.Agent.replace_config`."""

    config: Config
    #: The tools offered to the model (an object with ``specs()`` and ``call``), or None.
    tools: Any = None

    def tool_specs(self) -> list[Any]:
        return self.tools.specs() if self.tools is not None else []


@attrs.define
class TurnProgress:
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
    held: pb.Provider | None = None  # the provider the turn holds (released when it ends)


class TurnScopes:
    """The cancel scope of each running turn (by ``id(turn)``): what a cancel of the turn stops.

    A turn registered after its cancel (``turn.cancelled``) starts cancelled.
    """

    def __init__(self) -> None:
        self._scopes: dict[int, trio.CancelScope] = {}

    @contextlib.contextmanager
    def open(self, turn: Turn) -> Iterator[trio.CancelScope]:
        """A cancel scope for ``turn``'s work, registered while the block runs."""
        with trio.CancelScope() as scope:
            self._scopes[id(turn)] = scope
            if turn.cancelled:
                scope.cancel()
            try:
                yield scope
            finally:
                self._scopes.pop(id(turn), None)

    def cancel(self, turn: Turn) -> None:
        """Stop ``turn``'s work if it is running (it ends as its cancel mark says)."""
        scope = self._scopes.get(id(turn))
        if scope is not None:
            scope.cancel()


class StepIO:
    """The message I/O of model steps, shared by turns, summaries and sub-agents.

    Args:
        messages, store, broker: the workspace's services.
        on_first_token: told the first time a turn's step streams content (run metrics).
    """

    def __init__(
        self,
        *,
        messages: MessageService,
        store: WorkspaceStore,
        broker: Broker,
        on_first_token: Callable[[TurnProgress], None],
    ) -> None:
        self.messages = messages
        self.store = store
        self.broker = broker
        self.on_first_token = on_first_token

    async def messages_for(self, session_id: str) -> list[Message]:
        """The session's stored messages, with the buffered ones written first."""
        await self.messages.flush_session(session_id)
        return await self.store.list_messages(session_id)

    async def model_history(self, session_id: str) -> list[Message]:
        """What a model request of the session carries: from its summary on, if it has one
        (the stored history stays whole)."""
        messages = await self.messages_for(session_id)
        if not any(m.is_summary_message for m in messages):
            return messages
        session = await self.store.get_session(session_id)
        return history_from_summary(messages, session.summary_message_id if session else None)

    async def start_message(self, progress: TurnProgress, session_id: str) -> Message:
        """Create the assistant message of a new step (the turn's model and provider) and add
        it to the history the next step is sent."""
        msg = Message(new_id(), session_id, Role.ASSISTANT, model=progress.model)
        msg.provider = progress.provider
        progress.assistant = msg  # before the create: a cancel in between still repairs it
        progress.results = set()
        await self.messages.create(msg)
        progress.history.append(msg)
        return msg

    async def stream(
        self,
        provider: pb.Provider,
        request: pb.ModelRequest,
        msg: Message,
        progress: TurnProgress,
    ) -> FinishReason:
        """Stream one model step into ``msg``; returns how the model finished it.

        Content is saved (and published) as it arrives, usage is recorded on the session, and a
        provider's retry is published as a ``retry`` agent event.
        """
        assembler = StepAssembler(msg)
        stream = provider.stream(request)
        # The stream's reads wait for the message's publish passes while it streams.
        pacer = self.messages.read_pacer(msg.id)
        # A publish pass may take plain text in itself, without this task (ReadTick).
        pacer.fold.ready = lambda: (
            progress.first_token and assembler.appending and self.messages.can_append(msg.id)
        )
        pacer.fold.take = functools.partial(self._take_plain, assembler, msg)
        paced = READ_PACER.set(pacer)
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                await self._consume(stream, assembler, msg, progress)
        finally:
            READ_PACER.reset(paced)
            pacer.close()
        reason = assembler.finish()
        await self.messages.update(msg)
        return reason

    async def _consume(
        self,
        stream: AsyncIterator[pb.StreamEvent],
        assembler: StepAssembler,
        msg: Message,
        progress: TurnProgress,
    ) -> None:
        async for event in stream:
            if assembler.feed(event):
                if not progress.first_token:
                    self.on_first_token(progress)
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

    def _take_plain(
        self, assembler: StepAssembler, msg: Message, events: list[pb.StreamEvent]
    ) -> None:
        """Fold plain text taken in by a publish pass into the message, as :meth:`_consume`
        does (the pass asked the fold's ``ready`` first)."""
        for event in events:
            assembler.feed(event)
            if assembler.append is None:  # ``ready`` asked ``appending``: never here
                raise RuntimeError("plain text taken in by a publish pass was not an append")
            self.messages.append_nowait(msg, assembler.append)

    async def _on_usage(self, msg: Message, usage: pb.Usage, progress: TurnProgress) -> None:
        """A step's usage: the session's token counts become the step's and its cost is added
        (a summary's usage is recorded when the summary is stored)."""
        progress.usage = usage
        if msg.is_summary_message:
            return
        cost = step_cost(usage, progress.model_entry) if progress.model_entry else 0.0
        await self.store.record_step_usage(
            msg.session_id, usage.prompt_tokens, usage.completion_tokens, cost
        )

    async def write_user_message(self, progress: TurnProgress, prompt: Prompt) -> None:
        msg = Message(
            new_id(), prompt.session_id, Role.USER, [TextPart(prompt.text), *prompt.parts]
        )
        await self.messages.create(msg)
        progress.history.append(msg)
        progress.user_written.add(prompt.run_id)

    async def end_turn(self, msg: Message) -> None:
        """A tool result stopped the turn (a permission denial): the step's message ends the
        turn instead of asking for more tool calls."""
        msg.parts = [p for p in msg.parts if not isinstance(p, FinishPart)]
        msg.parts.append(FinishPart(FinishReason.END_TURN))
        await self.messages.update(msg)

    async def end_interrupted(
        self, progress: TurnProgress, *, error: BaseException | None, cancelled: bool
    ) -> None:
        """The last assistant message of a turn a cancel or an error ended: its tool calls are
        repaired, it finishes ``canceled`` or ``error``, and every tool call it left without a
        result gets one."""
        msg = progress.assistant
        assert msg is not None
        repair_tool_calls(msg)
        # The turn ended here: whatever finish the step had (tool_use while its tools ran)
        # gives way to the one that says how the turn ended.
        msg.parts = [p for p in msg.parts if not isinstance(p, FinishPart)]
        if cancelled:
            msg.parts.append(FinishPart(FinishReason.CANCELED, message=CANCELED_MESSAGE))
        else:
            msg.parts.append(
                FinishPart(FinishReason.ERROR, message=error_text(error) if error else "")
            )
        msg.updated_at = now()
        await self.messages.update(msg)
        await self.write_missing_results(progress, cancelled=cancelled)

    async def write_missing_results(self, progress: TurnProgress, *, cancelled: bool) -> None:
        """A result for each tool call of the last assistant message that has none."""
        msg = progress.assistant
        if msg is None:
            return
        parts = missing_results(msg, progress.results, cancelled=cancelled)
        if not parts:
            return
        await self.messages.create(Message(new_id(), msg.session_id, Role.TOOL, parts))
        progress.results.update(p.tool_call_id for p in parts if isinstance(p, ToolResultPart))
