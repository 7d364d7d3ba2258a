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
from typing import TYPE_CHECKING, Final

import trio

from ..core import model as pb
from ..core.agent_state import Prompt, Turn
from ..core.assembler import repair_tool_calls
from ..errors import CrushError, unwrap_group
from ..tools.base import ToolError
from ..wire import (
    EventKind,
    FinishPart,
    FinishReason,
    Message,
    Role,
    Session,
    TextPart,
    new_id,
    now,
)
from .summarize import step_cost
from .tool_step import StopTurn, run_tools

if TYPE_CHECKING:
    from .runner import Agent

log = logging.getLogger(__name__)

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


def _title(prompt: str) -> str:
    line = " ".join(prompt.split())
    if len(line) > SUBAGENT_TITLE_CHARS:
        line = line[: SUBAGENT_TITLE_CHARS - 1] + "…"
    return f"Sub-agent: {line}"


async def run_subagent(
    agent: Agent, *, parent_session_id: str, run_id: str | None, tool_call_id: str, prompt: str
) -> str:
    """Run ``prompt`` in a new child session of ``parent_session_id``; return its final text.

    Raises:
        ToolError: the workspace is closing, the parent session is gone, the model failed or
            the step bound was reached; the message says which.

    Cancellation:
        The child's last message is saved as cancelled and its cost added to the parent (in
        shielded scopes bounded by the save timeout), then ``trio.Cancelled`` propagates.
    """
    from .runner import CANCELED_MESSAGE, _error_text, _TurnProgress

    if agent.closing:
        raise ToolError("the workspace is closing; the sub-agent did not start")
    if not agent.store.session_exists(parent_session_id):
        raise ToolError(f"session {parent_session_id!r} is gone; the sub-agent did not start")
    tools = agent.tools.read_only() if hasattr(agent.tools, "read_only") else None
    provider_name, provider_cfg, entry = agent.config.resolve_model("large")
    provider = agent._provider(provider_name, provider_cfg)
    child = Session(new_id(), title=_title(prompt), parent_session_id=parent_session_id)
    await agent.store.create_session(child)
    agent.broker.publish(child, EventKind.CREATED)

    turn = Turn(child.id, Prompt(child.id, run_id or "", prompt, 0, True))
    progress = _TurnProgress(turn)
    progress.model, progress.provider, progress.model_entry = entry.id, provider_name, entry
    progress.first_token = True  # the parent run's metrics are not the child's
    cost = 0.0
    steps = agent.config.options.agent_max_steps
    cancelled = False
    failure: BaseException | None = None
    try:
        user = Message(new_id(), child.id, Role.USER, [TextPart(prompt)])
        await agent.messages.create(user)
        progress.history.append(user)
        for _step in range(steps):
            request = pb.ModelRequest(
                model=pb.ModelInfo(
                    entry.id, entry.name, entry.context_window, entry.default_max_tokens
                ),
                system=SUBAGENT_SYSTEM_PROMPT,
                messages=list(progress.history),
                tools=tools.specs() if tools is not None else [],
                max_tokens=entry.default_max_tokens,
            )
            msg = Message(new_id(), child.id, Role.ASSISTANT, model=entry.id)
            msg.provider = provider_name
            progress.assistant = msg
            progress.results = set()
            await agent.messages.create(msg)
            progress.history.append(msg)
            progress.usage = None
            try:
                reason = await agent._stream_step(provider, request, msg, progress)
            finally:
                if progress.usage is not None:
                    cost += step_cost(progress.usage, entry)
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
                    run_id=run_id,
                )
            except StopTurn:
                msg.parts = [p for p in msg.parts if not isinstance(p, FinishPart)]
                msg.parts.append(FinishPart(FinishReason.END_TURN))
                await agent.messages.update(msg)
                return (
                    "the sub-agent stopped: the user denied one of its tool calls "
                    f"(session {child.id}); do not retry it, ask the user how to proceed"
                )
        raise ToolError(
            f"the sub-agent stopped after {steps} steps (options.agent_max_steps) without an "
            "answer; give it a narrower task"
        )
    except BaseException as exc:
        cancelled = isinstance(exc, trio.Cancelled)
        failure = None if cancelled else unwrap_group(exc)
        if isinstance(failure, CrushError) and not isinstance(failure, ToolError):
            raise ToolError(f"the sub-agent failed: {failure.message}") from failure
        raise
    finally:
        with trio.move_on_after(agent.save_timeout, shield=True):
            try:
                msg_last = progress.assistant
                if msg_last is not None and (cancelled or failure is not None):
                    repair_tool_calls(msg_last)
                    msg_last.parts = [p for p in msg_last.parts if not isinstance(p, FinishPart)]
                    if cancelled:
                        msg_last.parts.append(
                            FinishPart(FinishReason.CANCELED, message=CANCELED_MESSAGE)
                        )
                    else:
                        assert failure is not None
                        msg_last.parts.append(
                            FinishPart(FinishReason.ERROR, message=_error_text(failure))
                        )
                    msg_last.updated_at = now()
                    await agent.messages.update(msg_last)
                    await agent._write_missing_results(progress, cancelled=cancelled)
                await agent.messages.flush_session(child.id)
                await _roll_up(agent, parent_session_id, child.id, cost)
            except Exception:
                log.exception("saving the end of sub-agent session %s failed", child.id)


async def _roll_up(agent: Agent, parent_id: str, child_id: str, cost: float) -> None:
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
