"""The read tools: ``ls``, ``view`` and ``glob`` (``grep`` is in :mod:`.grep`).

Each resolves its path first (:mod:`crush_trio.tools.paths`), asks for permission when it is
outside the workspace, and only then reads the disk, in a worker thread bounded by
``ctx.timeout``. The walkers behind ``ls`` and ``glob`` never follow symlinked directories, skip
the directories named in :data:`~crush_trio.tools.files.IGNORED_DIR_NAMES` below the listed root,
and never show the data directory.
"""

from __future__ import annotations

import os
import stat
import time
from collections import deque
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

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
from .files import IGNORED_DIR_NAMES, VIEW_MAX_LINE_CHARS, number_lines, read_text_file, split_lines
from .globs import compile_glob, split_absolute_glob
from .grep_worker import Chain, GitIgnore, walk_files
from .paths import (
    check_not_hidden,
    check_not_hidden_then,
    check_read,
    display_path,
    resolve_path,
    search_root_then,
)
from .tracker import Snapshot, stat_snapshot

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

__all__ = [
    "GLOB_MAX_RESULTS",
    "LS_DEFAULT_DEPTH",
    "LS_DEFAULT_LIMIT",
    "LS_MAX_DEPTH",
    "LS_MAX_LIMIT",
    "VIEW_DEFAULT_LIMIT",
    "VIEW_MAX_FILE_BYTES",
    "VIEW_MAX_LIMIT",
    "GlobTool",
    "LsTool",
    "ViewTool",
]

#: ``ls``: default and largest ``depth``.
LS_DEFAULT_DEPTH: Final = 2
LS_MAX_DEPTH: Final = 5
#: ``ls``: default and largest ``limit`` (entries listed).
LS_DEFAULT_LIMIT: Final = 500
LS_MAX_LIMIT: Final = 5000

#: ``view``: largest file it reads, in bytes.
VIEW_MAX_FILE_BYTES: Final = 5 * 1024 * 1024
#: ``view``: default and largest ``limit`` (lines shown).
VIEW_DEFAULT_LIMIT: Final = 2000
VIEW_MAX_LIMIT: Final = 2000

#: ``glob``: most paths returned.
GLOB_MAX_RESULTS: Final = 100


def _opt_int(params: dict[str, Any], key: str, default: int, maximum: int) -> int:
    value = params.get(key)
    if value is None:
        return default
    if value < 1:
        raise ToolError(f"parameter '{key}' must be at least 1, got {value}")
    return min(int(value), maximum)


def _deadline(seconds: float) -> float:
    """The walk's deadline: taken when it starts (after any prompt)."""
    return time.monotonic() + seconds


def _check_deadline(deadline: float, tool_name: str) -> None:
    if time.monotonic() > deadline:
        raise ToolError(f"{tool_name} timed out; narrow the path or pattern and try again")


def _walk_files(
    root: Path,
    *,
    data_dir: Path,
    skip_hidden: bool,
    deadline: float,
    tool_name: str,
    hidden: tuple[Path, ...] = (),
) -> Iterator[Path]:
    """Yield the regular files below ``root`` in path order (symlinks are not followed), without
    the ``hidden`` paths."""
    return walk_files(
        root,
        data_dir=data_dir,
        skip_hidden=skip_hidden,
        ignored=IGNORED_DIR_NAMES,
        check=partial(_check_deadline, deadline, tool_name),
        hidden=hidden,
    )


# ---------------------------------------------------------------------------------------------
# ls


def _list_tree(
    root: Path,
    data_dir: Path,
    depth: int,
    limit: int,
    deadline: float,
    hidden: tuple[Path, ...] = (),
) -> tuple[list[str], bool]:
    """Breadth-first listing (so a large first directory cannot hide the rest), shown as a tree."""
    children: dict[Path, list[tuple[str, Path | None]]] = {}
    rules = GitIgnore(root)
    queue: deque[tuple[Path, int, Chain]] = deque([(root, 1, rules.root_chain)])
    count = 0
    truncated = False
    hidden_set = frozenset(hidden)
    while queue and not truncated:
        _check_deadline(deadline, "ls")
        directory, level, chain = queue.popleft()
        listed: list[tuple[str, Path | None]] = []
        children[directory] = listed
        try:
            with os.scandir(directory) as it:
                found = sorted(it, key=lambda e: (not e.is_dir(follow_symlinks=False), e.name))
        except OSError as exc:
            listed.append((f"(unreadable: {exc.strerror})", None))
            continue
        for entry in found:
            if count >= limit:
                truncated = True
                break
            path = Path(entry.path)
            is_dir = entry.is_dir(follow_symlinks=False)
            if path in hidden_set:
                continue
            if chain and GitIgnore.ignored(chain, entry.path, is_dir):
                continue
            if entry.is_symlink():
                try:
                    target = os.readlink(entry.path)
                except OSError:
                    target = "?"
                listed.append((f"{entry.name} -> {target}", None))
            elif is_dir:
                if entry.name in IGNORED_DIR_NAMES or path == data_dir:
                    continue
                listed.append((f"{entry.name}/", path))
                if level < depth:
                    queue.append((path, level + 1, rules.enter(entry.path, chain)))
            else:
                listed.append((entry.name, None))
            count += 1

    lines = [f"{root}/"]

    def render(directory: Path, indent: int) -> None:
        for label, sub in children.get(directory, []):
            lines.append(f"{'  ' * indent}- {label}")
            if sub is not None:
                render(sub, indent + 1)

    render(root, 1)
    return lines, truncated


@attrs.define
class LsTool(ToolBase):
    """``ls``: a tree listing of a directory."""

    #: Offered to sub-agents (``agent``): it only reads, under the usual permission rule.
    read_only = True
    spec = ToolSpec(
        name="ls",
        description=(
            "List files and directories as a tree. Use it to explore the project layout before "
            "reading files. Directories end with '/', symlinks show their target. Version-control "
            "and cache directories (.git, node_modules, __pycache__, .venv, ...), files the "
            "project's .gitignore files exclude and the server's "
            f"data directory are skipped. Lists {LS_DEFAULT_DEPTH} levels and at most "
            f"{LS_DEFAULT_LIMIT} entries by default; a truncated listing says so. Paths outside "
            "the workspace need the user's permission."
        ),
        parameters={
            "type": "object",
            "properties": {
                "path": {
                    "type": "string",
                    "description": "Directory to list, relative to the workspace or absolute "
                    "(default: the workspace root).",
                },
                "depth": {
                    "type": "integer",
                    "minimum": 1,
                    "description": f"Levels to descend (default {LS_DEFAULT_DEPTH}, at most "
                    f"{LS_MAX_DEPTH}).",
                },
                "limit": {
                    "type": "integer",
                    "minimum": 1,
                    "description": f"Most entries to list (default {LS_DEFAULT_LIMIT}, at most "
                    f"{LS_MAX_LIMIT}).",
                },
            },
            "required": [],
        },
    )

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        depth = _opt_int(params, "depth", LS_DEFAULT_DEPTH, LS_MAX_DEPTH)
        limit = _opt_int(params, "limit", LS_DEFAULT_LIMIT, LS_MAX_LIMIT)
        data_dir, timeout = ctx.data_dir, ctx.timeout

        def walk(root: Path, hidden: tuple[Path, ...]) -> tuple[list[str], bool]:
            return _list_tree(root, data_dir, depth, limit, _deadline(timeout), hidden)

        _, (lines, truncated) = await search_root_then(
            ctx, "ls", params.get("path") or "", want_dir=True, then=walk
        )
        if truncated:
            lines.append(
                f"(listing truncated at {limit} entries; list a subdirectory or use a smaller "
                "depth to see the rest)"
            )
        return ToolResult(content="\n".join(lines))


# ---------------------------------------------------------------------------------------------
# view


def _other_names(path: Path) -> int:
    """How many other hard links a regular file has (0 for anything else or on error)."""
    try:
        st = path.stat()
    except OSError:
        return 0
    return st.st_nlink - 1 if stat.S_ISREG(st.st_mode) else 0


def _snapshot_and_read(path: Path, shown: str) -> tuple[Snapshot | None, str]:
    """The file's read-before-edit snapshot, then its text. The snapshot is taken before the
    read, so a change during it makes the record stale and the next edit is refused
    (:mod:`.tracker`)."""
    before = stat_snapshot(path)
    return before, read_text_file(path, shown, VIEW_MAX_FILE_BYTES, "view")


@attrs.define
class ViewTool(ToolBase):
    """``view``: a text file's lines, numbered."""

    #: Offered to sub-agents (``agent``): it only reads, under the usual permission rule.
    read_only = True
    spec = ToolSpec(
        name="view",
        description=(
            "Read a text file. Lines come numbered as '     1|text' (the number and '|' are not "
            f"part of the file). Shows up to {VIEW_DEFAULT_LIMIT} lines from 'offset' (0-based); "
            "the result says how to read further. Lines longer than "
            f"{VIEW_MAX_LINE_CHARS} characters are cut. Files over {VIEW_MAX_FILE_BYTES} bytes "
            "and binary files are refused. Paths outside the workspace need the user's permission."
        ),
        parameters={
            "type": "object",
            "properties": {
                "path": {
                    "type": "string",
                    "description": "File to read, relative to the workspace or absolute.",
                },
                "offset": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "Line to start at, 0-based (default 0).",
                },
                "limit": {
                    "type": "integer",
                    "minimum": 1,
                    "description": f"Most lines to show (default and maximum {VIEW_MAX_LIMIT}).",
                },
            },
            "required": ["path"],
        },
    )

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        offset = int(params.get("offset") or 0)
        if offset < 0:
            raise ToolError(f"parameter 'offset' must be 0 or more, got {offset}")
        limit = _opt_int(params, "limit", VIEW_DEFAULT_LIMIT, VIEW_MAX_LIMIT)
        resolved = resolve_path(ctx, params["path"])
        shown = display_path(ctx, resolved.path)
        if resolved.inside:
            # No prompt to wait for before the links are counted: one thread for both checks.
            _, links = await check_not_hidden_then(
                ctx, "view", resolved.path, lambda _: _other_names(resolved.path)
            )
            if links:
                # A hard link is the same file as its other names, which may be outside.
                await ask_permission(
                    ctx,
                    tool_name="view",
                    action="read",
                    description=(
                        f"view wants to read {shown}, a file with {links} other name(s) (hard "
                        "links) that may be outside the workspace"
                    ),
                    params={"path": str(resolved.path)},
                    path=resolved.path,
                )
        else:
            await check_not_hidden(ctx, "view", resolved.path)
            await check_read(ctx, "view", resolved)
        before, text = await run_blocking(ctx, "view", _snapshot_and_read, resolved.path, shown)
        lines = split_lines(text)
        if lines and offset >= len(lines):
            raise ToolError(
                f"offset {offset} is past the end of {shown}, which has {len(lines)} lines"
            )
        ctx.files.record(ctx.session_id, resolved.path, before)
        if not lines:
            return ToolResult(content=f"({shown} is empty)")
        window = lines[offset : offset + limit]
        out = number_lines(window, offset)
        end = offset + len(window)
        if end < len(lines):
            out.append(
                f"(showing lines {offset + 1}-{end} of {len(lines)}; use offset={end} to read more)"
            )
        return ToolResult(content="\n".join(out))


# ---------------------------------------------------------------------------------------------
# glob


def _glob(
    root: Path,
    match: Callable[[str], bool],
    data_dir: Path,
    deadline: float,
    hidden: tuple[Path, ...] = (),
) -> list[tuple[float, Path]]:
    found: list[tuple[float, Path]] = []
    for path in _walk_files(
        root,
        data_dir=data_dir,
        skip_hidden=False,
        deadline=deadline,
        tool_name="glob",
        hidden=hidden,
    ):
        if match(path.relative_to(root).as_posix()):
            try:
                found.append((path.lstat().st_mtime, path))
            except OSError:
                continue
    found.sort(key=lambda item: (-item[0], item[1]))
    return found


@attrs.define
class GlobTool(ToolBase):
    """``glob``: files whose path matches a pattern, newest first."""

    #: Offered to sub-agents (``agent``): it only reads, under the usual permission rule.
    read_only = True
    spec = ToolSpec(
        name="glob",
        description=(
            "Find files by name pattern. Supports '*' (within a directory), '**' (any depth), "
            "'?', '[abc]' and '{a,b}'. A pattern without '/' matches file names at any depth "
            "(e.g. '*.py'); with '/' it matches the path relative to 'path' (e.g. "
            f"'src/**/*.ts'). Returns up to {GLOB_MAX_RESULTS} paths, most recently modified "
            "first. Version-control and cache directories, files the project's .gitignore files "
            "exclude and the server's data directory are skipped. Paths outside the workspace "
            "need the user's permission."
        ),
        parameters={
            "type": "object",
            "properties": {
                "pattern": {"type": "string", "description": "Glob pattern to match."},
                "path": {
                    "type": "string",
                    "description": "Directory to search (default: the workspace root).",
                },
            },
            "required": ["pattern"],
        },
    )

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        pattern: str = params["pattern"]
        raw_root: str = params.get("path") or ""
        if pattern.startswith("/"):
            raw_root, pattern = split_absolute_glob(pattern)
        if not pattern:
            raise ToolError("parameter 'pattern' must not be empty; try '**/*'")
        match = compile_glob(pattern)
        data_dir, timeout = ctx.data_dir, ctx.timeout

        def walk(root: Path, hidden: tuple[Path, ...]) -> list[tuple[float, Path]]:
            return _glob(root, match, data_dir, _deadline(timeout), hidden)

        _, found = await search_root_then(ctx, "glob", raw_root, want_dir=True, then=walk)
        if not found:
            return ToolResult(content=f"No files found matching {pattern!r}")
        lines = [display_path(ctx, path) for _, path in found[:GLOB_MAX_RESULTS]]
        if len(found) > GLOB_MAX_RESULTS:
            lines.append(
                f"(showing {GLOB_MAX_RESULTS} of {len(found)} matches, newest first; use a more "
                "specific pattern or path)"
            )
        return ToolResult(content="\n".join(lines))
