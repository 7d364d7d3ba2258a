"""The tool step of a turn: run the tool calls of an assistant message and save their results.

Every tool call of a saved assistant message gets a result, whatever ends the turn: the calls
run in order and their results are saved together in one tool message (in a shielded,
time-bounded scope, so a cancel between two calls still saves the results so far); calls a turn
left without a result get :func:`missing_results` in the turn's final save. A result that asks to
stop the turn (a permission denial) skips the remaining calls and raises :class:`StopTurn`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import attrs
import orjson
import trio

from ..errors import ProviderError
from ..metrics import METRICS
from ..wire import Message, Part, Role, ToolCallPart, ToolResultPart, new_id

if TYPE_CHECKING:
    from ..store import MessageService

CANCELED_TOOL_RESULT: Final = "Error: user cancelled assistant tool calling"
FAILED_TOOL_RESULT: Final = "There was an error while executing the tool"
#: The same tool call (name and input) this many times in a row ends the turn.
REPEATED_TOOL_CALL_LIMIT: Final = 5
#: Tools whose same call repeated is progress, not a loop: reading a background job's new output
#: (each call returns what came since the last one, and waits at most ``JOB_OUTPUT_MAX_WAIT``).
#: A step that calls only these is not counted; ``options.max_steps`` still bounds the turn.
POLLING_TOOLS: Final = frozenset({"job_output"})


class StopTurn(Exception):
    """A tool result asked to end the turn (a permission denial).

    Attributes:
        error: set when the run must end failed with it (a permission request nobody answered).
    """

    def __init__(self, error: str | None = None) -> None:
        super().__init__(error)
        self.error = error


@attrs.define
class RepeatedCalls:
    """Ends a turn whose model asks for the same tool calls step after step."""

    limit: int = REPEATED_TOOL_CALL_LIMIT
    _seen: list[str] = attrs.field(factory=list)

    def check(self, calls: list[ToolCallPart]) -> None:
        """Record a step's calls.

        Raises:
            ProviderError: the last ``limit`` steps asked for the same calls.
        """
        if calls and all(c.name in POLLING_TOOLS for c in calls):
            return
        self._seen.append(orjson.dumps([[c.name, c.input] for c in calls]).decode())
        if len(self._seen) >= self.limit and len(set(self._seen[-self.limit :])) == 1:
            raise ProviderError(
                f"the model repeated the same tool call {self.limit} times in a row; stopped "
                "the turn to avoid a loop"
            )


def missing_results(msg: Message, done: set[str], *, cancelled: bool) -> list[Part]:
    """Error results for the message's tool calls that have none (ids not in ``done``)."""
    content = CANCELED_TOOL_RESULT if cancelled else FAILED_TOOL_RESULT
    return [
        ToolResultPart(c.id, c.name, content, is_error=True)
        for c in msg.tool_calls()
        if c.id not in done
    ]


def _outcome(result: Any) -> str:
    """The ``outcome`` label of a tool call's result (ok, error, denied)."""
    if getattr(result, "stop_turn", False):
        return "denied"
    return "error" if result.is_error else "ok"


async def run_tools(
    *,
    tools: Any,
    messages: MessageService,
    msg: Message,
    calls: list[ToolCallPart],
    done: set[str],
    history: list[Message],
    save_timeout: float,
    run_id: str | None = None,
) -> None:
    """Run ``calls`` of ``msg`` with ``tools`` (None: none available) and save their results;
    each call's id is added to ``done`` and the tool message to ``history``. ``run_id`` is the
    run the calls belong to (streamed output and background jobs name it).

    Raises:
        StopTurn: a result asked to end the turn (the calls after it are skipped).
    """
    results: list[Part] = []
    tool_msg = Message(new_id(), msg.session_id, Role.TOOL, results)
    stop = False
    fail: str | None = None
    try:
        for call in calls:
            if stop or tools is None:
                content = (
                    "tool call skipped: the turn was stopped"
                    if stop
                    else f"no tools are available; cannot run {call.name!r}"
                )
                results.append(ToolResultPart(call.id, call.name, content, is_error=True))
                done.add(call.id)
                continue
            outcome = "cancelled"
            try:
                result = await tools.call(
                    call.name,
                    call.input,
                    session_id=msg.session_id,
                    tool_call_id=call.id,
                    run_id=run_id,
                )
                outcome = _outcome(result)
            finally:
                METRICS.tool_called(call.name, outcome)
            results.append(
                ToolResultPart(call.id, call.name, result.content, is_error=result.is_error)
            )
            done.add(call.id)
            stop = stop or bool(getattr(result, "stop_turn", False))
            if getattr(result, "fail_run", False) and fail is None:
                fail = result.content
    finally:
        if results:
            with trio.move_on_after(save_timeout, shield=True):
                await messages.create(tool_msg)
            history.append(tool_msg)
    if stop:
        raise StopTurn(fail)
