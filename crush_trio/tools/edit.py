"""The ``edit`` tool: replace exact text in a file.

The edit is planned before the permission prompt (so the prompt can say how many occurrences it
replaces) and planned again on the file actually opened after the answer, which is written the
way ``write`` writes (:func:`~crush_trio.tools.write.open_for_write`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Final

import attrs

from .base import (
    ToolBase,
    ToolContext,
    ToolError,
    ToolResult,
    ToolSpec,
    ask_permission,
    run_blocking,
)
from .files import decode_text, number_lines, read_text_file, split_lines
from .paths import ResolvedPath, check_not_hidden, display_path, resolve_path
from .write import check_write_target, open_for_write, outside_note, recheck_path, write_fd

__all__ = ["EDIT_MAX_FILE_BYTES", "EDIT_SNIPPET_CONTEXT", "EDIT_SNIPPET_MAX_LINES", "EditTool"]

#: ``edit``: largest file it edits, in bytes.
EDIT_MAX_FILE_BYTES: Final = 10 * 1024 * 1024
#: ``edit``: lines of context shown around the first replacement.
EDIT_SNIPPET_CONTEXT: Final = 3
#: ``edit``: most lines in the snippet of the result.
EDIT_SNIPPET_MAX_LINES: Final = 30


@attrs.define(frozen=True)
class _EditPlan:
    text: str
    count: int
    first_index: int
    new_string: str
    created: bool


def _plan_edit(path: Path, shown: str, old: str, new: str, replace_all: bool) -> _EditPlan:
    """Work out an edit without writing; raises :class:`ToolError` for what cannot be done."""
    if old == "":
        if path.exists():
            raise ToolError(
                f"old_string is empty but {shown} already exists; give the exact text to "
                "replace, or use write to replace the whole file"
            )
        return _EditPlan(text=new, count=1, first_index=0, new_string=new, created=True)
    if not path.exists():
        raise ToolError(
            f"file not found: {shown}; to create it, use write or edit with an empty old_string"
        )
    text = read_text_file(path, shown, EDIT_MAX_FILE_BYTES, "edit")
    return _plan_replacement(text, shown, old, new, replace_all)


def _plan_replacement(text: str, shown: str, old: str, new: str, replace_all: bool) -> _EditPlan:
    count = text.count(old)
    if count == 0 and "\r\n" in text and "\n" in old and "\r\n" not in old:
        # The file uses CRLF line ends and the model wrote LF ones: match in the file's style.
        old = old.replace("\n", "\r\n")
        new = new.replace("\r\n", "\n").replace("\n", "\r\n")
        count = text.count(old)
    if count == 0:
        raise ToolError(f"old_string not found in {shown}; view the file and copy the exact text")
    if count > 1 and not replace_all:
        raise ToolError(
            f"old_string appears {count} times in {shown}; add surrounding lines to make it "
            "unique or set replace_all"
        )
    first = text.index(old)
    updated = text.replace(old, new) if replace_all else text.replace(old, new, 1)
    return _EditPlan(text=updated, count=count, first_index=first, new_string=new, created=False)


def _read_fd_text(fd: int, shown: str) -> str:
    """The text of the open file ``fd``, with the size and binary checks of ``edit``."""
    chunks: list[bytes] = []
    size = 0
    while chunk := os.read(fd, 1024 * 1024):
        chunks.append(chunk)
        size += len(chunk)
        if size > EDIT_MAX_FILE_BYTES:
            raise ToolError(
                f"{shown} is over the {EDIT_MAX_FILE_BYTES} byte limit of edit; use bash with "
                "sed for large files"
            )
    return decode_text(b"".join(chunks), shown, "edit")


def _apply_edit(
    ctx: ToolContext,
    raw: str,
    approved: ResolvedPath,
    shown: str,
    old: str,
    new: str,
    replace_all: bool,
) -> _EditPlan:
    # Planned again after the permission answer, on the file actually opened: it may have changed
    # while the user thought.
    recheck_path(ctx, raw, approved, shown)
    created = old == ""
    fd = open_for_write(
        approved.path, shown, "edit", new=created, may_create=created, read=not created
    )
    try:
        if created:
            plan = _EditPlan(text=new, count=1, first_index=0, new_string=new, created=True)
        else:
            plan = _plan_replacement(_read_fd_text(fd, shown), shown, old, new, replace_all)
    except BaseException:
        os.close(fd)
        raise
    write_fd(fd, plan.text.encode("utf-8", errors="surrogateescape"))
    return plan


def _edit_snippet(plan: _EditPlan) -> list[str]:
    lines = split_lines(plan.text)
    first_line = plan.text.count("\n", 0, plan.first_index)
    start = max(0, first_line - EDIT_SNIPPET_CONTEXT)
    end = first_line + plan.new_string.count("\n") + 1 + EDIT_SNIPPET_CONTEXT
    end = min(end, start + EDIT_SNIPPET_MAX_LINES, len(lines))
    return number_lines(lines[start:end], start)


@attrs.define
class EditTool(ToolBase):
    """``edit``: replace an exact string in a file."""

    spec = ToolSpec(
        name="edit",
        description=(
            "Replace exact text in a file. 'old_string' must match the file exactly (whitespace "
            "and indentation included, without the line-number prefix view shows) and must be "
            "unique unless replace_all is true; include surrounding lines to make it unique. An "
            "empty old_string creates a new file containing new_string. Always asks the user for "
            "permission. The server's data directory cannot be written."
        ),
        parameters={
            "type": "object",
            "properties": {
                "path": {
                    "type": "string",
                    "description": "File to edit, relative to the workspace or absolute.",
                },
                "old_string": {"type": "string", "description": "Exact text to replace."},
                "new_string": {"type": "string", "description": "Text to put in its place."},
                "replace_all": {
                    "type": "boolean",
                    "description": "Replace every occurrence (default false).",
                },
            },
            "required": ["path", "old_string", "new_string"],
        },
    )

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        old: str = params["old_string"]
        new: str = params["new_string"]
        replace_all = bool(params.get("replace_all") or False)
        if old == new:
            raise ToolError("old_string and new_string are identical; there is nothing to change")
        resolved = resolve_path(ctx, params["path"])
        shown = display_path(ctx, resolved.path)
        await check_not_hidden(ctx, "edit", resolved.path)
        check_write_target(ctx, "edit", resolved)
        plan = await run_blocking(
            ctx, "edit", _plan_edit, resolved.path, shown, old, new, replace_all
        )
        if plan.created:
            description = f"Create {shown} ({len(new)} characters)"
        else:
            times = "occurrence" if plan.count == 1 else "occurrences"
            description = f"Edit {shown}: replace {plan.count} {times} of old_string"
        await ask_permission(
            ctx,
            tool_name="edit",
            action="write",
            description=description + outside_note(ctx, resolved),
            # ``file_path`` too: Crush's permission dialog reads that key.
            params={
                "path": str(resolved.path),
                "file_path": str(resolved.path),
                "old_string": old,
                "new_string": new,
                "replace_all": replace_all,
            },
            path=resolved.path,
        )
        try:
            plan = await run_blocking(
                ctx,
                "edit",
                _apply_edit,
                ctx,
                params["path"],
                resolved,
                shown,
                old,
                new,
                replace_all,
                abandon=False,
            )
        except OSError as exc:
            raise ToolError(f"could not write {shown}: {exc.strerror or exc}") from exc
        if plan.created:
            return ToolResult(content=f"Created {shown}")
        times = "occurrence" if plan.count == 1 else "occurrences"
        head = f"Edited {shown}: replaced {plan.count} {times}. The first change now reads:"
        return ToolResult(content="\n".join([head, *_edit_snippet(plan)]))
