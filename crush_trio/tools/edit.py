"""The ``edit`` and ``multiedit`` tools: replace exact text in a file.

``multiedit`` applies several replacements to one file in memory, in order, and writes the result
only when every one of them applied: all or none, behind one permission prompt.

Both refuse an existing file this session has not viewed, or that changed since it was viewed
(read-before-edit, :mod:`.tracker`): checked before asking, and again on the file actually opened
after the answer.

The edit is planned before the permission prompt (so the prompt can say how many occurrences it
replaces) and planned again on the file actually opened after the answer, which is written the
way ``write`` writes (:func:`~crush_trio.tools.write.open_for_write`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Final

import attrs

from .base import (
    ToolBase,
    ToolContext,
    ToolError,
    ToolResult,
    ToolSpec,
    ask_permission,
    check_viewed,
    run_blocking,
)
from .files import decode_text, number_lines, read_text_file, split_lines
from .paths import ResolvedPath, check_not_hidden, display_path, resolve_path
from .tracker import Snapshot, stat_snapshot
from .write import (
    check_opened_unchanged,
    check_write_target,
    open_for_write,
    outside_note,
    recheck_path,
    write_fd,
)

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

__all__ = [
    "EDIT_MAX_FILE_BYTES",
    "EDIT_SNIPPET_CONTEXT",
    "EDIT_SNIPPET_MAX_LINES",
    "MULTIEDIT_MAX_EDITS",
    "EditTool",
    "MultiEditTool",
]

#: ``edit``: largest file it edits, in bytes.
EDIT_MAX_FILE_BYTES: Final = 10 * 1024 * 1024
#: ``edit``: lines of context shown around the first replacement.
EDIT_SNIPPET_CONTEXT: Final = 3
#: ``edit``: most lines in the snippet of the result.
EDIT_SNIPPET_MAX_LINES: Final = 30
#: ``multiedit``: most edits in one call.
MULTIEDIT_MAX_EDITS: Final = 100


@attrs.define(frozen=True)
class _EditPlan:
    text: str
    count: int
    first_index: int
    new_string: str
    created: bool


@attrs.frozen
class _Replace:
    """One exact-match replacement: ``old`` (non-empty) by ``new``."""

    old: str
    new: str
    replace_all: bool = False


def _plan_edit(
    path: Path, shown: str, edits: list[_Replace], seen: Snapshot | None, tool_name: str
) -> _EditPlan:
    """Work out an edit without writing; raises :class:`ToolError` for what cannot be done.

    An ``edit`` with an empty ``old_string`` is one :class:`_Replace` with ``old == ""``.
    """
    if edits[0].old == "":
        if path.exists():
            raise ToolError(
                f"old_string is empty but {shown} already exists; give the exact text to "
                "replace, or use write to replace the whole file"
            )
        new = edits[0].new
        return _EditPlan(text=new, count=1, first_index=0, new_string=new, created=True)
    if not path.exists():
        raise ToolError(
            f"file not found: {shown}; to create it, use write or edit with an empty old_string"
        )
    check_viewed(seen, stat_snapshot(path), shown, tool_name)
    text = read_text_file(path, shown, EDIT_MAX_FILE_BYTES, tool_name)
    return _plan_replacements(text, shown, edits)


def _plan_replacements(text: str, shown: str, edits: list[_Replace]) -> _EditPlan:
    """Apply ``edits`` in order to ``text`` in memory (each to the result of the ones before);
    any edit that cannot apply fails the whole plan, naming the edit when there are several."""
    first: tuple[int, str] | None = None
    total = 0
    for number, edit in enumerate(edits, start=1):
        try:
            text, count, index, new = _replace(text, shown, edit.old, edit.new, edit.replace_all)
        except ToolError as exc:
            if len(edits) == 1:
                raise
            raise ToolError(
                f"edit {number} of {len(edits)}: {exc.message}; no edit was applied"
            ) from None
        total += count
        if first is None:
            first = (index, new)
    assert first is not None
    return _EditPlan(
        text=text, count=total, first_index=first[0], new_string=first[1], created=False
    )


def _replace(
    text: str, shown: str, old: str, new: str, replace_all: bool
) -> tuple[str, int, int, str]:
    """``text`` with ``old`` replaced; also the count, the first index and the replacement."""
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
    return updated, count, first, new


def _read_fd_text(fd: int, shown: str, tool_name: str) -> str:
    """The text of the open file ``fd``, with the size and binary checks of ``edit``."""
    chunks: list[bytes] = []
    size = 0
    while chunk := os.read(fd, 1024 * 1024):
        chunks.append(chunk)
        size += len(chunk)
        if size > EDIT_MAX_FILE_BYTES:
            raise ToolError(
                f"{shown} is over the {EDIT_MAX_FILE_BYTES} byte limit of {tool_name}; use bash "
                "with sed for large files"
            )
    return decode_text(b"".join(chunks), shown, tool_name)


def _apply_edit(
    ctx: ToolContext,
    raw: str,
    approved: ResolvedPath,
    shown: str,
    edits: list[_Replace],
    seen: Snapshot | None,
    tool_name: str,
) -> tuple[_EditPlan, Snapshot]:
    # Planned again after the permission answer, on the file actually opened: it must still be
    # the file the session viewed, unchanged (read-before-edit).
    recheck_path(ctx, raw, approved, shown)
    created = edits[0].old == ""
    fd = open_for_write(
        approved.path, shown, tool_name, new=created, may_create=created, read=not created
    )
    try:
        if created:
            new = edits[0].new
            plan = _EditPlan(text=new, count=1, first_index=0, new_string=new, created=True)
        else:
            check_opened_unchanged(fd, seen, shown, tool_name)
            plan = _plan_replacements(_read_fd_text(fd, shown, tool_name), shown, edits)
    except BaseException:
        os.close(fd)
        raise
    written = write_fd(fd, plan.text.encode("utf-8", errors="surrogateescape"))
    return plan, written


async def _edit_file(
    ctx: ToolContext,
    tool_name: str,
    raw: str,
    edits: list[_Replace],
    describe: Callable[[str, _EditPlan], str],
    params: dict[str, Any],
) -> tuple[str, _EditPlan]:
    """Plan, ask once (action ``write``), apply all of ``edits`` or none, record the result."""
    resolved = resolve_path(ctx, raw)
    shown = display_path(ctx, resolved.path)
    await check_not_hidden(ctx, tool_name, resolved.path)
    check_write_target(ctx, tool_name, resolved)
    seen = ctx.files.seen(ctx.session_id, resolved.path)
    plan = await run_blocking(
        ctx, tool_name, _plan_edit, resolved.path, shown, edits, seen, tool_name
    )
    await ask_permission(
        ctx,
        tool_name=tool_name,
        action="write",
        description=describe(shown, plan) + outside_note(ctx, resolved),
        # ``file_path`` too: Crush's permission dialog reads that key.
        params={"path": str(resolved.path), "file_path": str(resolved.path), **params},
        path=resolved.path,
    )
    try:
        plan, written = await run_blocking(
            ctx,
            tool_name,
            _apply_edit,
            ctx,
            raw,
            resolved,
            shown,
            edits,
            seen,
            tool_name,
            abandon=False,
        )
    except OSError as exc:
        raise ToolError(f"could not write {shown}: {exc.strerror or exc}") from exc
    ctx.files.record(ctx.session_id, resolved.path, written)
    return shown, plan


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

        def describe(shown: str, plan: _EditPlan) -> str:
            if plan.created:
                return f"Create {shown} ({len(new)} characters)"
            times = "occurrence" if plan.count == 1 else "occurrences"
            return f"Edit {shown}: replace {plan.count} {times} of old_string"

        shown, plan = await _edit_file(
            ctx,
            "edit",
            params["path"],
            [_Replace(old, new, replace_all)],
            describe,
            {"old_string": old, "new_string": new, "replace_all": replace_all},
        )
        if plan.created:
            return ToolResult(content=f"Created {shown}")
        times = "occurrence" if plan.count == 1 else "occurrences"
        head = f"Edited {shown}: replaced {plan.count} {times}. The first change now reads:"
        return ToolResult(content="\n".join([head, *_edit_snippet(plan)]))


@attrs.define
class MultiEditTool(ToolBase):
    """``multiedit``: several exact-match edits to one file, applied all or none."""

    spec = ToolSpec(
        name="multiedit",
        description=(
            "Make several exact-text replacements in one existing file in one call. The edits "
            "apply in order, each to the result of the ones before, and either all apply or "
            "none does (the file is left untouched if any old_string is not found, or is not "
            "unique without replace_all). Each old_string follows the rules of the edit tool. "
            "View the file first: a file not viewed in this session, or changed since, is "
            f"refused. At most {MULTIEDIT_MAX_EDITS} edits. Asks the user once for permission."
        ),
        parameters={
            "type": "object",
            "properties": {
                "path": {
                    "type": "string",
                    "description": "File to edit, relative to the workspace or absolute.",
                },
                "edits": {
                    "type": "array",
                    "description": "The replacements, applied in order.",
                    "items": {
                        "type": "object",
                        "properties": {
                            "old_string": {
                                "type": "string",
                                "description": "Exact text to replace (not empty).",
                            },
                            "new_string": {
                                "type": "string",
                                "description": "Text to put in its place.",
                            },
                            "replace_all": {
                                "type": "boolean",
                                "description": "Replace every occurrence (default false).",
                            },
                        },
                        "required": ["old_string", "new_string"],
                    },
                },
            },
            "required": ["path", "edits"],
        },
    )

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        edits = _parse_edits(params["edits"])
        n = len(edits)

        def describe(shown: str, plan: _EditPlan) -> str:
            times = "replacement" if plan.count == 1 else "replacements"
            return f"Edit {shown}: {n} edits, {plan.count} {times}"

        shown, plan = await _edit_file(
            ctx,
            "multiedit",
            params["path"],
            edits,
            describe,
            {
                "edits": [
                    {"old_string": e.old, "new_string": e.new, "replace_all": e.replace_all}
                    for e in edits
                ]
            },
        )
        times = "replacement" if plan.count == 1 else "replacements"
        head = (
            f"Edited {shown}: applied {n} edits ({plan.count} {times}). The first change now reads:"
        )
        return ToolResult(content="\n".join([head, *_edit_snippet(plan)]))


def _parse_edits(raw: list[Any]) -> list[_Replace]:
    """The ``edits`` parameter of ``multiedit``, checked; a bad item is named by its number."""
    if not raw:
        raise ToolError("parameter 'edits' of tool multiedit must hold at least one edit")
    if len(raw) > MULTIEDIT_MAX_EDITS:
        raise ToolError(
            f"parameter 'edits' of tool multiedit holds {len(raw)} edits, over the limit of "
            f"{MULTIEDIT_MAX_EDITS}; split them over several calls"
        )
    edits: list[_Replace] = []
    for number, item in enumerate(raw, start=1):
        where = f"edit {number} of multiedit"
        if not isinstance(item, dict):
            raise ToolError(f"{where} must be an object with old_string and new_string")
        old, new = item.get("old_string"), item.get("new_string")
        replace_all = item.get("replace_all")
        if not isinstance(old, str) or not isinstance(new, str):
            raise ToolError(f"{where} needs old_string and new_string, both strings")
        if replace_all is not None and not isinstance(replace_all, bool):
            raise ToolError(f"{where}: replace_all must be a boolean")
        if old == "":
            raise ToolError(
                f"{where} has an empty old_string; multiedit changes existing files (use write "
                "to create one)"
            )
        if old == new:
            raise ToolError(f"{where}: old_string and new_string are identical")
        edits.append(_Replace(old, new, bool(replace_all)))
    return edits
