"""The tool set as the agent sees it, with snapshots around each tool call that may write."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .service import ChangeLog


class TrackedTools:
    """Wraps a workspace's :class:`~crush_trio.tools.Toolbox`: :meth:`call` lets the change log
    take the run's "before" snapshot (at its first tool call that may write), runs the tool, then
    lets the change log snapshot the workspace (which publishes ``files_changed`` when the call
    changed files). Every other attribute is the toolbox's."""

    def __init__(self, inner: Any, changes: ChangeLog) -> None:
        self.inner = inner
        self.changes = changes

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def subagent(self) -> Any:
        """The toolbox's sub-agent runner (set by the agent on the toolbox itself)."""
        return self.inner.subagent

    @subagent.setter
    def subagent(self, runner: Any) -> None:
        self.inner.subagent = runner

    def specs(self) -> Any:
        return self.inner.specs()

    async def call(
        self, name: str, input_json: str, *, session_id: str, tool_call_id: str, **more: Any
    ) -> Any:
        """Run one tool call, with the run's before snapshot first if it has none, then
        snapshot.

        Cancellation: a cancelled call is not snapshotted here; the run's end snapshot sees what
        it changed.
        """
        await self.changes.before_tool(session_id, name)
        result = await self.inner.call(
            name, input_json, session_id=session_id, tool_call_id=tool_call_id, **more
        )
        if not getattr(result, "wrote_nothing", False):
            await self.changes.after_tool(session_id, tool_call_id, name)
        return result
