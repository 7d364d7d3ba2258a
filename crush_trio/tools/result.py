"""What a tool call returns to the model (:class:`ToolResult`), and the error a tool raises for a
failure the model can act on (:class:`ToolError`), which the tools' ``run`` wrapper turns into an
error result.
"""

from __future__ import annotations

import attrs

from ..errors import CrushError


@attrs.define
class ToolResult:
    """What a tool call returns to the model.

    Attributes:
        content: the text the model reads.
        is_error: the call failed; ``content`` says why and what to do instead.
        stop_turn: the user denied a permission; the agent loop ends the turn after this result.
        fail_run: with ``stop_turn``: nobody answered the permission request in time; the run
            ends failed, with ``content`` as its error.
        wrote_nothing: the call could not have changed the workspace (a prompt-free ``bash``
            command ran with it mounted read-only), so no snapshot is taken after it.
    """

    content: str
    is_error: bool = False
    stop_turn: bool = False
    fail_run: bool = False
    wrote_nothing: bool = False


class ToolError(CrushError):
    """A tool call failed in a way the model can act on; the message says how."""

    status = 400
    stop_turn: bool = False
    fail_run: bool = False

    def result(self) -> ToolResult:
        """The error result the model reads."""
        return ToolResult(
            content=self.message,
            is_error=True,
            stop_turn=self.stop_turn,
            fail_run=self.fail_run,
        )


class PermissionDenied(ToolError):
    """The user denied a permission: the call did nothing and the turn ends."""

    stop_turn = True


class PermissionTimedOut(PermissionDenied):
    """Nobody answered a permission request in time: the call did nothing and the run fails."""

    fail_run = True
