"""The ``todos`` tool: the model writes the session's todo list (its plan), which clients show.

Each call replaces the whole list (Crush's ``todos`` tool and OpenCode's ``todowrite`` work the
same way; the item shape is Crush's: ``content``, ``status``, ``active_form``). The list is saved
with the session and published as a ``session`` ``updated`` event, through the
:class:`TodoSink` the workspace gives the toolbox. It touches no file and no network, so it never
asks for permission.

Bounds: :data:`TODOS_MAX_ITEMS` items of at most :data:`TODO_MAX_CHARS` characters each.
"""

from __future__ import annotations

from typing import Any, Final

import attrs

from ..wire import Todo, TodoStatus
from .base import TodoSink, ToolBase, ToolContext, ToolError, ToolResult, ToolSpec

__all__ = ["TODOS_MAX_ITEMS", "TODO_MAX_CHARS", "TodoSink", "TodosTool", "parse_todos"]

#: ``todos``: most items in one list.
TODOS_MAX_ITEMS: Final = 100
#: ``todos``: longest ``content`` or ``active_form`` of one item, in characters.
TODO_MAX_CHARS: Final = 1000

_STATUSES: Final = tuple(s.value for s in TodoStatus)


def parse_todos(raw: list[Any]) -> list[Todo]:
    """The ``todos`` parameter, checked; a bad item is named by its number.

    Raises:
        ToolError: too many items, or an item that is not ``{content, status, active_form?}``.
    """
    if len(raw) > TODOS_MAX_ITEMS:
        raise ToolError(
            f"the todo list has {len(raw)} items, over the limit of {TODOS_MAX_ITEMS}; keep "
            "the list to the goals that matter"
        )
    todos: list[Todo] = []
    for number, item in enumerate(raw, start=1):
        where = f"todo {number}"
        if not isinstance(item, dict):
            raise ToolError(f"{where} must be an object with content and status")
        content, status = item.get("content"), item.get("status")
        active = item.get("active_form")
        if not isinstance(content, str) or not content.strip():
            raise ToolError(f"{where} needs a non-empty content string")
        if status not in _STATUSES:
            raise ToolError(f"{where} has status {status!r}; use one of {', '.join(_STATUSES)}")
        if active is not None and not isinstance(active, str):
            raise ToolError(f"{where}: active_form must be a string")
        for name, text in (("content", content), ("active_form", active or "")):
            if len(text) > TODO_MAX_CHARS:
                raise ToolError(
                    f"{where}: {name} is {len(text)} characters, over the limit of "
                    f"{TODO_MAX_CHARS}; say it in fewer words"
                )
        todos.append(Todo(content.strip(), TodoStatus(status), (active or "").strip()))
    return todos


@attrs.define
class TodosTool(ToolBase):
    """``todos``: replace the session's todo list."""

    spec = ToolSpec(
        name="todos",
        description=(
            "Write the session's todo list, which the user sees live. Use it for tasks of "
            "three or more steps: create the list first, mark one item in_progress at a time, "
            "mark it completed as soon as it is done, add items you discover. Each call "
            "replaces the whole list, so always send every item. Each item has 'content' (what "
            "to do, imperative: 'Add tests'), 'status' (pending, in_progress or completed) and "
            "optionally 'active_form' (present continuous, shown while in progress: 'Adding "
            f"tests'). At most {TODOS_MAX_ITEMS} items. Do not repeat the list in your reply."
        ),
        parameters={
            "type": "object",
            "properties": {
                "todos": {
                    "type": "array",
                    "description": "The complete, updated todo list, in order.",
                    "items": {
                        "type": "object",
                        "properties": {
                            "content": {
                                "type": "string",
                                "description": "What needs to be done (imperative form).",
                            },
                            "status": {
                                "type": "string",
                                "enum": list(_STATUSES),
                                "description": "pending, in_progress or completed.",
                            },
                            "active_form": {
                                "type": "string",
                                "description": "Present continuous form ('Running tests').",
                            },
                        },
                        "required": ["content", "status"],
                    },
                }
            },
            "required": ["todos"],
        },
    )

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        todos = parse_todos(params["todos"])
        if ctx.todos is None:
            raise ToolError("todos are not available here (no session store); go on without")
        session = await ctx.todos.set_todos(ctx.session_id, todos)
        if session is None:
            raise ToolError(f"session {ctx.session_id} no longer exists; the list was not saved")
        counts = {status: 0 for status in TodoStatus}
        for todo in todos:
            counts[todo.status] += 1
        return ToolResult(
            content=(
                f"Todo list updated ({len(todos)} items): {counts[TodoStatus.PENDING]} pending, "
                f"{counts[TodoStatus.IN_PROGRESS]} in progress, "
                f"{counts[TodoStatus.COMPLETED]} completed. Keep it current as you work."
            )
        )
