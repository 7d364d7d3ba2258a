"""``agent``: run a task in a sub-agent, a child session with the read-only tools.

The child session (``parent_session_id`` set) runs under the calling run's ``run_id`` with the
tools whose ``read_only`` attribute is true (``ls``, ``view``, ``glob``, ``grep``, ...), each
under its usual permission rule, for at most ``options.agent_max_steps`` model steps. Its usage
is recorded on the child session and its cost is added to the parent session. The child's final
text is the result; a long search so stays out of the parent's context. Cancelling the parent's
run cancels the child. The call itself asks no permission: the child can only read.
"""

from __future__ import annotations

from typing import Any

import attrs

from .base import ToolBase, ToolContext, ToolError, ToolResult, ToolSpec

__all__ = ["AgentTool"]


@attrs.define
class AgentTool(ToolBase):
    """``agent``: delegate a read-only task to a sub-agent."""

    spec = ToolSpec(
        name="agent",
        description=(
            "Launch a sub-agent that works on a task with read-only tools (ls, view, glob, "
            "grep and the other read-only tools) in a session of its own, and return its final "
            "answer. Use it for searches and questions that need many file reads, to keep them "
            "out of this conversation. The sub-agent cannot change files or run commands and "
            "sees nothing of this conversation: say exactly what to look for and what to "
            "return."
        ),
        parameters={
            "type": "object",
            "properties": {
                "prompt": {
                    "type": "string",
                    "description": "The task for the sub-agent, with everything it needs to know.",
                }
            },
            "required": ["prompt"],
        },
    )

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        prompt: str = params["prompt"]
        if not prompt.strip():
            raise ToolError("parameter 'prompt' must not be empty: give the sub-agent its task")
        if ctx.subagent is None:
            raise ToolError("sub-agents are not available here; do the task with the tools")
        text = await ctx.subagent.run_subagent(
            parent_session_id=ctx.session_id,
            run_id=ctx.run_id,
            tool_call_id=ctx.tool_call_id,
            prompt=prompt,
        )
        return ToolResult(content=text.strip() or "(the sub-agent gave no answer)")
