"""Sub-agents: the ``agent`` tool's run of a task in a child session.

A sub-agent is a run of model steps like a turn's, with three differences:

* it runs in a new session whose ``parent_session_id`` is the calling session, inside the
  parent's tool call (so under the parent's ``run_id``, and cancelled with the parent's run:
  the cancel reaches it through the tool call's task), and its messages are published like any
  session's, each event naming the child session;
* it gets only the read-only tools (:meth:`crush_trio.tools.Toolbox.read_only`: no writes, no
  commands, no jobs, no MCP tools, no nested sub-agents), each under its usual permission rule,
  and at most ``options.agent_max_steps`` model steps;
* its usage is recorded on the child session, and its cost is added to the parent session when
  it ends (also when it fails or is cancelled: the tokens were spent).

Whatever ends it, its last assistant message is saved with a finish and a result for every
tool call (shielded, bounded by the save timeout), as a turn's is.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Final, Protocol

import attrs
import trio

from ..core import model as pb
from ..core.agent_state import Prompt, Turn
from ..errors import CrushError, unwrap_group
from ..tools.base import ToolError
from ..wire import EventKind, FinishReason, Session, new_id
from .steps import TurnProgress
from .summarize import step_cost
from .tool_step import StopTurn, run_tools

if TYPE_CHECKING:
    from ..broker import Broker
    from ..config import Config
    from ..core.ports import WorkspaceStore
    from ..store import MessageService
    from .provider_cache import ProviderCache
    from .steps import StepIO

log = logging.getLogger(__name__)


class SubagentHost(Protocol):
    """What a sub-agent needs of the agent whose tool call runs it
    (:class:`crush_trio.agent.runner.Agent`)."""

    store: WorkspaceStore
    messages: MessageService
    broker: Broker
    providers: ProviderCache
    steps: StepIO
    save_timeout: float

    @property
    def config(self) -> Config: ...

    @property
    def tools(self) -> Any: ...

    @property
    def closing(self) -> bool: ...

    def is_busy(self, session_id: str | None = None) -> bool: ...


SUBAGENT_SYSTEM_PROMPT: Final = (
    "You are a sub-agent of a coding agent, working in the user's project directory with "
    "read-only tools. Do the task you are given by reading files and searching; you cannot "
    "change files or run commands. Your final message is all the caller sees: answer the task "
    "completely and concisely, naming the files and lines that matter."
)
#: Longest session title taken from a sub-agent's task (characters).
SUBAGENT_TITLE_CHARS: Final = 60
#: What a cancelled sub-agent's last message says (as a cancelled turn's does).
SUBAGENT_CANCELED: Final = "Parent run canceled"


@attrs.define
class _Child:
    """A running sub-agent: its progress, its read-only tools, the parent's run and what its
    steps cost so far (added as soon as a step has streamed, also when it fails)."""

    progress: TurnProgress
    tools: Any
    run_id: str | None
    max_steps: int
    cost: float = 0.0


def _title(prompt: str) -> str:
    line = " ".join(prompt.split())
    if len(line) > SUBAGENT_TITLE_CHARS:
        line = line[: SUBAGENT_TITLE_CHARS - 1] + "…"
    return f"Sub-agent: {line}"


async def run_subagent(
    agent: SubagentHost,
    *,
    parent_session_id: str,
    run_id: str | None,
    tool_call_id: str,
    prompt: str,
) -> str:
    """Run ``prompt`` in a new child session of ``parent_session_id``; return its final text.

    Raises:
        ToolError: the workspace is closing, the parent session is gone, the model failed or
            the step bound was reached; the message says which.

    Cancellation:
        The child's last message is saved as cancelled and its cost added to the parent (in
        shielded scopes bounded by the save timeout), then ``trio.Cancelled`` propagates.
    """
    if agent.closing:
        raise ToolError("the workspace is closing; the sub-agent did not start")
    if not agent.store.session_exists(parent_session_id):
        raise ToolError(f"session {parent_session_id!r} is gone; the sub-agent did not start")
    tools = agent.tools.read_only() if hasattr(agent.tools, "read_only") else None
    provider_name, provider_cfg, entry = agent.config.resolve_model("large")
    child = Session(new_id(), title=_title(prompt), parent_session_id=parent_session_id)
    await agent.store.create_session(child)
    agent.broker.publish(child, EventKind.CREATED)

    turn = Turn(child.id, Prompt(child.id, run_id or "", prompt, 0, True))
    progress = TurnProgress(turn)
    progress.model, progress.provider, progress.model_entry = entry.id, provider_name, entry
    progress.first_token = True  # the parent run's metrics are not the child's
    run = _Child(progress, tools, run_id, agent.config.options.agent_max_steps)
    cancelled = False
    failure: BaseException | None = None
    provider = agent.providers.acquire(provider_name, provider_cfg)
    try:
        return await _steps(agent, run, provider)
    except BaseException as exc:
        cancelled = isinstance(exc, trio.Cancelled)
        failure = None if cancelled else unwrap_group(exc)
        if isinstance(failure, CrushError) and not isinstance(failure, ToolError):
            raise ToolError(f"the sub-agent failed: {failure.message}") from failure
        raise
    finally:
        agent.providers.release(provider)
        with trio.move_on_after(agent.save_timeout, shield=True):
            try:
                if progress.assistant is not None and (cancelled or failure is not None):
                    await agent.steps.end_interrupted(progress, error=failure, cancelled=cancelled)
                await agent.messages.flush_session(child.id)
                await _roll_up(agent, parent_session_id, child.id, run.cost)
            except Exception:
                log.exception("saving the end of sub-agent session %s failed", child.id)


async def _steps(agent: SubagentHost, run: _Child, provider: pb.Provider) -> str:
    """The child's model and tool steps, from its task to its answer."""
    progress, tools = run.progress, run.tools
    turn, entry = progress.turn, progress.model_entry
    child_id = turn.session_id
    await agent.steps.write_user_message(progress, turn.primary)
    for _step in range(run.max_steps):
        request = pb.ModelRequest(
            model=pb.ModelInfo(
                entry.id, entry.name, entry.context_window, entry.default_max_tokens
            ),
            system=SUBAGENT_SYSTEM_PROMPT,
            messages=list(progress.history),
            tools=tools.specs() if tools is not None else [],
            max_tokens=entry.default_max_tokens,
        )
        msg = await agent.steps.start_message(progress, child_id)
        progress.usage = None
        try:
            reason = await agent.steps.stream(provider, request, msg, progress)
        finally:
            if progress.usage is not None:
                run.cost += step_cost(progress.usage, entry)
        calls = msg.tool_calls()
        if reason is not FinishReason.TOOL_USE and not calls:
            return msg.text()
        try:
            await run_tools(
                tools=tools,
                messages=agent.messages,
                msg=msg,
                calls=calls,
                done=progress.results,
                history=progress.history,
                save_timeout=agent.save_timeout,
                run_id=run.run_id,
            )
        except StopTurn:
            await agent.steps.end_turn(msg)
            return (
                "the sub-agent stopped: the user denied one of its tool calls "
                f"(session {child_id}); do not retry it, ask the user how to proceed"
            )
    raise ToolError(
        f"the sub-agent stopped after {run.max_steps} steps (options.agent_max_steps) without an "
        "answer; give it a narrower task"
    )


async def _roll_up(agent: SubagentHost, parent_id: str, child_id: str, cost: float) -> None:
    """Add the child's cost to the parent session and publish both sessions."""
    store = agent.store
    child = await store.get_session(child_id)
    if child is not None:
        agent.broker.publish(child, EventKind.UPDATED)
    if cost <= 0:
        return
    parent = await store.get_session(parent_id)
    if parent is None:
        return
    # The parent's token counts are its own context (left as they are); only the cost adds up.
    updated = await store.record_step_usage(
        parent_id, parent.prompt_tokens, parent.completion_tokens, cost
    )
    if updated is not None:
        updated.is_busy = agent.is_busy(parent_id)
        agent.broker.publish(updated, EventKind.UPDATED)
