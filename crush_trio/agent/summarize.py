"""Summaries of a session: the request, the history that starts from one, cost and compaction.

Plain functions; :mod:`crush_trio.agent.compaction` streams the request, stores the message
and points the session at it.

* :func:`summary_request` asks the model to summarize the history it is given (tools off).
* :func:`history_from_summary` is what later model requests get: the summary (sent as a user
  message, as Crush does) and every message after it. The stored history is untouched.
* :func:`should_compact` is Crush's rule: compact when the context left after a step is at most
  ``compact_buffer_tokens`` (windows over ``compact_large_window``) or at most
  ``compact_ratio`` of the window.
* :func:`step_cost` prices one step's usage with the model's ``cost_per_1m_*`` keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import attrs

from ..core import model as pb
from ..wire import Message, Role, TextPart, new_id

if TYPE_CHECKING:
    from ..config import ModelEntry, Options

SUMMARY_SYSTEM_PROMPT: Final = (
    "You summarize a conversation between a user and a coding agent so that the agent can go "
    "on from the summary alone, without the conversation. Write a detailed summary: what the "
    "user asked for, what was done so far (files read and changed, commands run and what they "
    "showed), decisions taken and why, what is still to do and the next step. Keep file paths, "
    "names and error messages exact. Reply with the summary only."
)

SUMMARY_USER_PROMPT: Final = (
    "Summarize the conversation above as instructed, so that the work can continue from the "
    "summary alone."
)

#: Added to the summary when a turn goes on after an automatic compaction.
CONTINUE_NOTE: Final = (
    "\n\nThe conversation was summarized above because it grew too long for the context "
    "window. Continue the work from where it stopped; the user's request was:\n\n"
)


def summary_request(
    model: pb.ModelInfo, history: list[Message], session_id: str, max_tokens: int
) -> pb.ModelRequest:
    """The model request that asks for a summary of ``history`` (no tools offered)."""
    ask = Message(new_id(), session_id, Role.USER, [TextPart(SUMMARY_USER_PROMPT)])
    return pb.ModelRequest(
        model=model,
        system=SUMMARY_SYSTEM_PROMPT,
        messages=[*history, ask],
        tools=[],
        max_tokens=max_tokens,
        purpose=pb.RequestPurpose.SUMMARY,
    )


def history_from_summary(
    messages: list[Message], summary_message_id: str | None, *, continue_with: str = ""
) -> list[Message]:
    """The history to send the model: everything when the session has no summary, else the
    summary as a user message (``continue_with`` appended after :data:`CONTINUE_NOTE`) and the
    messages after it. The messages given are not changed."""
    if summary_message_id is None:
        return list(messages)
    index = next((i for i, m in enumerate(messages) if m.id == summary_message_id), None)
    if index is None:
        return list(messages)
    summary = messages[index]
    text = summary.text()
    if continue_with:
        text += CONTINUE_NOTE + continue_with
    as_user = attrs.evolve(summary, role=Role.USER, parts=[TextPart(text)])
    return [as_user, *messages[index + 1 :]]


def context_window(entry: ModelEntry, options: Options) -> int:
    """The model's context window, or ``options.default_context_window`` when unknown."""
    return entry.context_window or options.default_context_window


def should_compact(used_tokens: int, window: int, options: Options) -> bool:
    """Crush's rule: whether a session using ``used_tokens`` of ``window`` must be summarized
    before its next model step (always False when auto-compaction is off)."""
    if not options.auto_compact or options.disable_auto_summarize or used_tokens <= 0:
        return False
    remaining = window - used_tokens
    if window > options.compact_large_window:
        threshold = float(options.compact_buffer_tokens)
    else:
        threshold = window * options.compact_ratio
    return remaining <= threshold


def step_cost(usage: pb.Usage, entry: ModelEntry) -> float:
    """Dollars for one step: uncached input at ``cost_per_1m_in``, cache writes at
    ``cost_per_1m_in_cached``, cache reads at ``cost_per_1m_out_cached``, output at
    ``cost_per_1m_out``."""
    cached = usage.cache_read_tokens + usage.cache_write_tokens
    uncached = max(usage.prompt_tokens - cached, 0)
    cost = (
        uncached * entry.cost_per_1m_in
        + usage.cache_write_tokens * entry.cost_per_1m_in_cached
        + usage.cache_read_tokens * entry.cost_per_1m_out_cached
        + usage.completion_tokens * entry.cost_per_1m_out
    ) / 1_000_000
    return max(cost, 0.0)
