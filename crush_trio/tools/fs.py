"""File tools: ``ls``, ``view``, ``glob``, ``grep`` (read) and ``write``, ``edit`` (write).

Each tool checks its input and paths first (:mod:`crush_trio.tools.paths`), asks for permission
where the rules say so (outside the workspace for every tool, always for ``write`` and ``edit``),
and only then touches the disk. Blocking file-system work runs in a worker thread bounded by
``ctx.timeout``.

The walkers behind ``ls``, ``glob`` and the Python ``grep`` never follow symlinked directories,
skip the directories named in :data:`IGNORED_DIR_NAMES` below the listed root, and never show the
data directory.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, Final

import attrs
import orjson
import trio

from . import grep_worker
from .base import (
    ToolContext,
    ToolError,
    ToolResult,
    ToolSpec,
    ask_permission,
    run_blocking,
    run_tool,
)
from .grep_worker import walk_files
from .paths import (
    ResolvedPath,
    check_read,
    check_writable,
    display_path,
    in_data_dir,
    resolve_path,
)

__all__ = [
    "IGNORED_DIR_NAMES",
    "EditTool",
    "GlobTool",
    "GrepTool",
    "LsTool",
    "ViewTool",
    "WriteTool",
    "compile_glob",
]

#: Directory names the walkers do not descend into (unless the listed root itself is one).
IGNORED_DIR_NAMES: Final = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        "__pycache__",
        "node_modules",
        ".venv",
        ".mypy_cache",
        ".ruff_cache",
        ".pytest_cache",
    }
)

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
#: ``view``: longer lines are cut to this many characters.
VIEW_MAX_LINE_CHARS: Final = 2000

#: Bytes read from the start of a file to tell binary (a NUL byte) from text.
BINARY_SNIFF_BYTES: Final = 8192

#: ``glob``: most paths returned.
GLOB_MAX_RESULTS: Final = 100

#: ``grep``: most matching lines returned.
GREP_MAX_MATCHES: Final = 100
#: ``grep``: longer matching lines are cut to this many characters.
GREP_MAX_LINE_CHARS: Final = 500
#: ``grep`` (Python search): larger files are skipped.
GREP_MAX_FILE_BYTES: Final = 10 * 1024 * 1024
#: ``grep`` (ripgrep): most bytes of its stderr kept for an error message.
GREP_MAX_STDERR_BYTES: Final = 4096

#: ``edit``: largest file it edits, in bytes.
EDIT_MAX_FILE_BYTES: Final = 10 * 1024 * 1024
#: ``edit``: lines of context shown around the first replacement.
EDIT_SNIPPET_CONTEXT: Final = 3
#: ``edit``: most lines in the snippet of the result.
EDIT_SNIPPET_MAX_LINES: Final = 30


# ---------------------------------------------------------------------------------------------
# shared helpers


def _opt_int(params: dict[str, Any], key: str, default: int, maximum: int) -> int:
    value = params.get(key)
    if value is None:
        return default
    if value < 1:
        raise ToolError(f"parameter '{key}' must be at least 1, got {value}")
    return min(int(value), maximum)


def _deadline(ctx: ToolContext) -> float:
    return time.monotonic() + ctx.timeout


def _check_deadline(deadline: float, tool_name: str) -> None:
    if time.monotonic() > deadline:
        raise ToolError(f"{tool_name} timed out; narrow the path or pattern and try again")


def _is_binary(head: bytes) -> bool:
    return b"\0" in head


def _walk_files(
    root: Path,
    *,
    data_dir: Path,
    skip_hidden: bool,
    deadline: float,
    tool_name: str,
) -> Iterator[Path]:
    """Yield the regular files below ``root`` in path order (symlinks are not followed)."""
    return walk_files(
        root,
        data_dir=data_dir,
        skip_hidden=skip_hidden,
        ignored=IGNORED_DIR_NAMES,
        check=partial(_check_deadline, deadline, tool_name),
    )


def compile_glob(pattern: str) -> Callable[[str], bool]:
    """Compile a glob into a predicate over ``/``-separated paths relative to the search root.

    Syntax: ``*`` (within one path segment), ``**`` (any number of segments), ``?``, ``[abc]``,
    ``[!abc]``, ``{a,b}``. A pattern without ``/`` matches a file's name at any depth, as in
    ``.gitignore``; with ``/`` it matches the whole relative path.

    Raises:
        ToolError: the pattern is malformed.
    """
    regex, by_name = _glob_regex(pattern)
    if by_name:
        return lambda rel: regex.fullmatch(rel.rsplit("/", 1)[-1]) is not None
    return lambda rel: regex.fullmatch(rel) is not None


def _glob_regex(pattern: str) -> tuple[re.Pattern[str], bool]:
    """The regular expression of a glob (see :func:`compile_glob`) and whether it matches names
    only (no ``/`` in it)."""
    pattern = pattern.removeprefix("./")
    by_name = "/" not in pattern
    out: list[str] = []
    i, n, braces = 0, len(pattern), 0
    while i < n:
        c = pattern[i]
        if c == "*":
            if pattern.startswith("**", i):
                at_segment_start = i == 0 or pattern[i - 1] == "/"
                if at_segment_start and pattern.startswith("**/", i):
                    out.append("(?:.*/)?")
                    i += 3
                else:
                    out.append(".*")
                    i += 2
            else:
                out.append("[^/]*")
                i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] in "!^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                out.append(re.escape(c))
                i += 1
                continue
            body = pattern[i + 1 : j].replace("\\", "\\\\")
            if body[:1] in ("!", "^"):
                body = "^" + body[1:]
            out.append(f"[{body}]")
            i = j + 1
        elif c == "{":
            braces += 1
            out.append("(?:")
            i += 1
        elif c == "," and braces:
            out.append("|")
            i += 1
        elif c == "}" and braces:
            braces -= 1
            out.append(")")
            i += 1
        elif c == "\\" and i + 1 < n:
            out.append(re.escape(pattern[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    if braces:
        raise ToolError(f"invalid glob {pattern!r}: an opening '{{' has no closing '}}'")
    try:
        regex = re.compile("".join(out), re.DOTALL)
    except re.error as exc:
        raise ToolError(f"invalid glob {pattern!r}: {exc}") from exc
    return regex, by_name


def _split_absolute_glob(pattern: str) -> tuple[str, str]:
    """Split an absolute glob into its literal leading directory and the rest."""
    parts = pattern.split("/")
    literal: list[str] = []
    for index, part in enumerate(parts[:-1]):
        if any(ch in part for ch in "*?[{"):
            return "/".join(literal) or "/", "/".join(parts[index:])
        literal.append(part)
    return "/".join(literal) or "/", parts[-1]


async def _resolve_search_root(
    ctx: ToolContext, tool_name: str, raw: str, *, want_dir: bool
) -> ResolvedPath:
    """Resolve the root of ``ls``/``glob``/``grep``, asking when it is outside the workspace."""
    resolved = resolve_path(ctx, raw)
    if in_data_dir(ctx, resolved.path):
        raise ToolError(
            f"{tool_name} refused: {resolved.path} is inside the server's data directory "
            f"{ctx.data_dir}, which tools do not list or search"
        )
    if not resolved.path.exists():
        raise ToolError(
            f"path not found: {display_path(ctx, resolved.path)}; use ls to see what exists"
        )
    if want_dir and not resolved.path.is_dir():
        raise ToolError(
            f"{display_path(ctx, resolved.path)} is a file, not a directory; use view to read it"
        )
    if not resolved.path.is_dir() and not resolved.path.is_file():
        mode = resolved.path.stat().st_mode
        raise _not_regular(display_path(ctx, resolved.path), mode, tool_name)
    await check_read(ctx, tool_name, resolved)
    return resolved


# ---------------------------------------------------------------------------------------------
# ls


def _list_tree(
    root: Path, data_dir: Path, depth: int, limit: int, deadline: float
) -> tuple[list[str], bool]:
    """Breadth-first listing (so a large first directory cannot hide the rest), shown as a tree."""
    children: dict[Path, list[tuple[str, Path | None]]] = {}
    queue: deque[tuple[Path, int]] = deque([(root, 1)])
    count = 0
    truncated = False
    while queue and not truncated:
        _check_deadline(deadline, "ls")
        directory, level = queue.popleft()
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
            if entry.is_symlink():
                try:
                    target = os.readlink(entry.path)
                except OSError:
                    target = "?"
                listed.append((f"{entry.name} -> {target}", None))
            elif entry.is_dir(follow_symlinks=False):
                if entry.name in IGNORED_DIR_NAMES or path == data_dir:
                    continue
                listed.append((f"{entry.name}/", path))
                if level < depth:
                    queue.append((path, level + 1))
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
class LsTool:
    """``ls``: a tree listing of a directory."""

    spec = ToolSpec(
        name="ls",
        description=(
            "List files and directories as a tree. Use it to explore the project layout before "
            "reading files. Directories end with '/', symlinks show their target. Version-control "
            "and cache directories (.git, node_modules, __pycache__, .venv, ...) and the server's "
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

    async def run(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return await run_tool(self, params, ctx)

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        depth = _opt_int(params, "depth", LS_DEFAULT_DEPTH, LS_MAX_DEPTH)
        limit = _opt_int(params, "limit", LS_DEFAULT_LIMIT, LS_MAX_LIMIT)
        root = await _resolve_search_root(ctx, "ls", params.get("path") or "", want_dir=True)
        lines, truncated = await run_blocking(
            ctx, "ls", _list_tree, root.path, ctx.data_dir, depth, limit, _deadline(ctx)
        )
        if truncated:
            lines.append(
                f"(listing truncated at {limit} entries; list a subdirectory or use a smaller "
                "depth to see the rest)"
            )
        return ToolResult(content="\n".join(lines))


# ---------------------------------------------------------------------------------------------
# view


def _not_regular(shown: str, mode: int, tool_name: str) -> ToolError:
    kind = (
        "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a regular file"
    )
    return ToolError(f"{shown} is {kind}, not a regular file; {tool_name} reads regular files only")


def _read_text_file(path: Path, shown: str, max_bytes: int, tool_name: str) -> str:
    """Read a text file, refusing directories, FIFOs, devices, large files and binary files.

    A FIFO or device is refused before it is opened (opening or reading one can block forever);
    the open itself does not block either (``O_NONBLOCK``), in case one was put in the file's
    place after the check.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ToolError(f"file not found: {shown}; use ls or glob to find the right path")
    except OSError as exc:
        raise ToolError(f"could not read {shown}: {exc.strerror or exc}") from exc
    if stat.S_ISDIR(st.st_mode):
        raise ToolError(f"{shown} is a directory; use ls to list it")
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(shown, st.st_mode, tool_name)
    if st.st_size > max_bytes:
        raise ToolError(
            f"{shown} is {st.st_size} bytes, over the {max_bytes} byte limit of {tool_name}; "
            "use grep to find the part you need, or bash with head/tail/sed"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ToolError(f"could not read {shown}: {exc.strerror or exc}") from exc
    with open(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(shown, mode, tool_name)
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise ToolError(f"could not read {shown}: {exc.strerror or exc}") from exc
    if len(data) > max_bytes:
        raise ToolError(
            f"{shown} grew over the {max_bytes} byte limit of {tool_name} while it was read; "
            "use grep to find the part you need, or bash with head/tail/sed"
        )
    if _is_binary(data[:BINARY_SNIFF_BYTES]):
        raise ToolError(
            f"{shown} looks like a binary file (it contains NUL bytes); {tool_name} works on "
            "text files only"
        )
    return data.decode("utf-8", errors="surrogateescape")


def _other_names(path: Path) -> int:
    """How many other hard links a regular file has (0 for anything else or on error)."""
    try:
        st = path.stat()
    except OSError:
        return 0
    return st.st_nlink - 1 if stat.S_ISREG(st.st_mode) else 0


def _split_lines(text: str) -> list[str]:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def _number_lines(lines: list[str], first: int) -> list[str]:
    out = []
    for number, line in enumerate(lines, start=first + 1):
        shown = line.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")
        if len(shown) > VIEW_MAX_LINE_CHARS:
            shown = shown[:VIEW_MAX_LINE_CHARS] + " [line truncated]"
        out.append(f"{number:6d}|{shown}")
    return out


@attrs.define
class ViewTool:
    """``view``: a text file's lines, numbered."""

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

    async def run(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return await run_tool(self, params, ctx)

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        offset = int(params.get("offset") or 0)
        if offset < 0:
            raise ToolError(f"parameter 'offset' must be 0 or more, got {offset}")
        limit = _opt_int(params, "limit", VIEW_DEFAULT_LIMIT, VIEW_MAX_LIMIT)
        resolved = resolve_path(ctx, params["path"])
        shown = display_path(ctx, resolved.path)
        await check_read(ctx, "view", resolved)
        if resolved.inside:
            links = await run_blocking(ctx, "view", _other_names, resolved.path)
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
        text = await run_blocking(
            ctx, "view", _read_text_file, resolved.path, shown, VIEW_MAX_FILE_BYTES, "view"
        )
        lines = _split_lines(text)
        if not lines:
            return ToolResult(content=f"({shown} is empty)")
        if offset >= len(lines):
            raise ToolError(
                f"offset {offset} is past the end of {shown}, which has {len(lines)} lines"
            )
        window = lines[offset : offset + limit]
        out = _number_lines(window, offset)
        end = offset + len(window)
        if end < len(lines):
            out.append(
                f"(showing lines {offset + 1}-{end} of {len(lines)}; use offset={end} to read more)"
            )
        return ToolResult(content="\n".join(out))


# ---------------------------------------------------------------------------------------------
# glob


def _glob(
    root: Path, match: Callable[[str], bool], data_dir: Path, deadline: float
) -> list[tuple[float, Path]]:
    found: list[tuple[float, Path]] = []
    for path in _walk_files(
        root, data_dir=data_dir, skip_hidden=False, deadline=deadline, tool_name="glob"
    ):
        if match(path.relative_to(root).as_posix()):
            try:
                found.append((path.lstat().st_mtime, path))
            except OSError:
                continue
    found.sort(key=lambda item: (-item[0], item[1]))
    return found


@attrs.define
class GlobTool:
    """``glob``: files whose path matches a pattern, newest first."""

    spec = ToolSpec(
        name="glob",
        description=(
            "Find files by name pattern. Supports '*' (within a directory), '**' (any depth), "
            "'?', '[abc]' and '{a,b}'. A pattern without '/' matches file names at any depth "
            "(e.g. '*.py'); with '/' it matches the path relative to 'path' (e.g. "
            f"'src/**/*.ts'). Returns up to {GLOB_MAX_RESULTS} paths, most recently modified "
            "first. Version-control and cache directories and the server's data directory are "
            "skipped. Paths outside the workspace need the user's permission."
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

    async def run(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return await run_tool(self, params, ctx)

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        pattern: str = params["pattern"]
        raw_root: str = params.get("path") or ""
        if pattern.startswith("/"):
            raw_root, pattern = _split_absolute_glob(pattern)
        if not pattern:
            raise ToolError("parameter 'pattern' must not be empty; try '**/*'")
        match = compile_glob(pattern)
        root = await _resolve_search_root(ctx, "glob", raw_root, want_dir=True)
        found = await run_blocking(
            ctx, "glob", _glob, root.path, match, ctx.data_dir, _deadline(ctx)
        )
        if not found:
            return ToolResult(content=f"No files found matching {pattern!r}")
        lines = [display_path(ctx, path) for _, path in found[:GLOB_MAX_RESULTS]]
        if len(found) > GLOB_MAX_RESULTS:
            lines.append(
                f"(showing {GLOB_MAX_RESULTS} of {len(found)} matches, newest first; use a more "
                "specific pattern or path)"
            )
        return ToolResult(content="\n".join(lines))


# ---------------------------------------------------------------------------------------------
# grep


@attrs.define(frozen=True)
class _Match:
    path: Path
    line: int
    text: str


def _cut_line(text: str) -> str:
    text = text.rstrip("\r\n")
    if len(text) > GREP_MAX_LINE_CHARS:
        return text[:GREP_MAX_LINE_CHARS] + " [line truncated]"
    return text


async def _grep_python(
    root: Path,
    pattern: str,
    include: str | None,
    ctx: ToolContext,
) -> tuple[list[_Match], bool]:
    """Search with Python's ``re`` in a child process (:mod:`.grep_worker`).

    A regular expression that backtracks for ever cannot be stopped in a thread; the child is
    killed when the call's timeout cancels this.
    """
    include_regex, by_name = _glob_regex(include) if include else (None, False)
    job = {
        "root": str(root),
        "pattern": pattern,
        "include": include_regex.pattern if include_regex is not None else None,
        "include_by_name": by_name,
        "data_dir": str(ctx.data_dir),
        "ignored": sorted(IGNORED_DIR_NAMES),
        "max_matches": GREP_MAX_MATCHES,
        "max_file_bytes": GREP_MAX_FILE_BYTES,
        "sniff_bytes": BINARY_SNIFF_BYTES,
        "max_line_chars": GREP_MAX_LINE_CHARS,
    }
    command = [sys.executable, "-I", "-S", str(Path(grep_worker.__file__))]
    result = await trio.run_process(
        command,
        stdin=orjson.dumps(job),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    matches: list[_Match] = []
    more = None
    for line in result.stdout.splitlines():
        item = orjson.loads(line)
        if isinstance(item, dict):
            more = bool(item["more"])
        else:
            path, number, text = item
            matches.append(_Match(Path(path), int(number), _cut_line(text)))
    if more is None:
        message = result.stderr.decode("utf-8", "replace").strip().splitlines()
        raise ToolError(f"grep failed: {message[-1] if message else 'the search process died'}")
    return matches, more


async def _drain(stream: trio.abc.ReceiveStream, into: bytearray, limit: int) -> None:
    """Read ``stream`` to its end, keeping its first ``limit`` bytes."""
    async with stream:
        async for chunk in stream:
            if len(into) < limit:
                into += chunk[: limit - len(into)]


async def _grep_rg(
    rg: str,
    root: Path,
    pattern: str,
    include: str | None,
    ctx: ToolContext,
) -> tuple[list[_Match], bool]:
    """Search with ripgrep, reading its output until enough matches have come.

    Cancellation:
        ripgrep is ended by ``trio.run_process`` (SIGTERM) when the search is cancelled or has
        found enough.
    """
    command = [
        rg,
        "--no-config",
        "--line-number",
        "--no-heading",
        "--with-filename",
        "--null",
        "--color",
        "never",
        "--sort",
        "path",
        "--max-columns",
        str(GREP_MAX_LINE_CHARS),
        "--max-columns-preview",
        "--regexp",
        pattern,
    ]
    if include:
        command += ["--glob", include]
    # ripgrep anchors globs that contain '/' at its working directory, so it runs in the search
    # root (or the searched file's directory) and searches that by a relative name.
    is_dir = await trio.Path(root).is_dir()
    base, target = (root, ".") if is_dir else (root.parent, root.name)
    command += ["--", target]
    matches: list[_Match] = []
    more = False
    errors = bytearray()
    async with trio.open_nursery() as nursery:
        proc: trio.Process = await nursery.start(
            partial(
                trio.run_process,
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                check=False,
                cwd=base,
            )
        )
        assert proc.stdout is not None and proc.stderr is not None
        nursery.start_soon(_drain, proc.stderr, errors, GREP_MAX_STDERR_BYTES)
        pending = b""
        async with proc.stdout:
            async for chunk in proc.stdout:
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    name, _, rest = line.partition(b"\0")
                    number, _, text = rest.partition(b":")
                    path = base / os.fsdecode(name).removeprefix("./")
                    if in_data_dir(ctx, path) or not number.isdigit():
                        continue
                    if len(matches) == GREP_MAX_MATCHES:
                        more = True
                        break
                    matches.append(
                        _Match(path, int(number), _cut_line(text.decode("utf-8", "replace")))
                    )
                if more:
                    break
        if more:
            nursery.cancel_scope.cancel()
    if not more and proc.returncode == 2 and not matches:
        message = errors.decode("utf-8", "replace").strip() or "ripgrep failed"
        raise ToolError(f"grep failed: {message}")
    return matches, more


@attrs.define
class GrepTool:
    """``grep``: lines matching a regular expression.

    Attributes:
        use_rg: search with ripgrep (``rg``) when it is on ``PATH``; False forces the Python
            search (used by tests; the environment variable ``CRUSH_TRIO_GREP_NO_RG=1`` does the
            same).
    """

    use_rg: bool = True

    spec = ToolSpec(
        name="grep",
        description=(
            "Search file contents with a regular expression (ripgrep/Python syntax, e.g. "
            "'def \\w+_handler', 'TODO|FIXME'). Returns 'file:line:text' for up to "
            f"{GREP_MAX_MATCHES} matching lines, sorted by path. Hidden files, binary files, "
            "version-control and cache directories and the server's data directory are skipped; "
            "files listed in .gitignore are skipped when ripgrep is available. Use 'include' to "
            "limit the files searched (e.g. '*.py', 'src/**/*.{ts,tsx}'). Paths outside the "
            "workspace need the user's permission."
        ),
        parameters={
            "type": "object",
            "properties": {
                "pattern": {"type": "string", "description": "Regular expression to search for."},
                "path": {
                    "type": "string",
                    "description": "File or directory to search (default: the workspace root).",
                },
                "include": {
                    "type": "string",
                    "description": "Glob of the files to search, e.g. '*.py'.",
                },
            },
            "required": ["pattern"],
        },
    )

    def _rg(self) -> str | None:
        if not self.use_rg or os.environ.get("CRUSH_TRIO_GREP_NO_RG") == "1":
            return None
        return shutil.which("rg")

    async def run(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return await run_tool(self, params, ctx)

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        pattern: str = params["pattern"]
        if not pattern:
            raise ToolError("parameter 'pattern' must not be empty")
        include: str | None = params.get("include") or None
        rg = self._rg()
        if rg is None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ToolError(f"invalid regular expression {pattern!r}: {exc}") from exc
        if include:
            compile_glob(include)  # a malformed include is an error before any search
        root = await _resolve_search_root(ctx, "grep", params.get("path") or "", want_dir=False)
        with trio.move_on_after(ctx.timeout):
            if rg is not None:
                matches, more = await _grep_rg(rg, root.path, pattern, include, ctx)
            else:
                matches, more = await _grep_python(root.path, pattern, include, ctx)
            return self._render(ctx, matches, more, pattern)
        raise ToolError(
            f"grep timed out after {ctx.timeout:g} s and was stopped; narrow the path, pattern "
            "or include, or simplify the pattern (nested repetition such as '(a+)+' can take "
            "for ever)"
        )

    @staticmethod
    def _render(ctx: ToolContext, matches: list[_Match], more: bool, pattern: str) -> ToolResult:
        if not matches:
            return ToolResult(content=f"No matches found for {pattern!r}")
        lines = [f"{display_path(ctx, m.path)}:{m.line}:{m.text}" for m in matches]
        if more:
            lines.append(
                f"(showing the first {GREP_MAX_MATCHES} matches; narrow the pattern, path or "
                "include to see the rest)"
            )
        return ToolResult(content="\n".join(lines))


# ---------------------------------------------------------------------------------------------
# write


#: Flags of the directories opened on the way to a written file: never through a symlink, and
#: (where the OS has ``O_PATH``) without needing read permission on them.
_DIR_OPEN_FLAGS: Final = (
    getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
)


def _refuse_changed(shown: str, why: str) -> ToolError:
    return ToolError(
        f"refused to write {shown}: {why} while waiting for permission; nothing was written. "
        "Look at the path again (ls) and make the call again if it is still wanted"
    )


def _open_parent(path: Path, shown: str, *, create: bool) -> int:
    """Open the directory of the real ``path`` one component at a time from ``/``.

    Every component is opened relative to the one before (``dir_fd``) with ``O_NOFOLLOW``, so a
    symlink put anywhere on the approved path after it was resolved is refused instead of
    followed. Missing directories are created when ``create`` is true.
    """
    fd = os.open("/", _DIR_OPEN_FLAGS)
    try:
        for name in path.parent.parts[1:]:
            try:
                try:
                    child = os.open(name, _DIR_OPEN_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, 0o777, dir_fd=fd)
                    child = os.open(name, _DIR_OPEN_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refuse_changed(
                        shown, f"the directory {name!r} on its path became a symlink or a file"
                    ) from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_single_link(st: os.stat_result, shown: str, tool_name: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ToolError(
            f"{tool_name} refused: {shown} is not a regular file (a FIFO, socket or device); "
            "give the path of a regular file"
        )
    if st.st_nlink > 1:
        raise ToolError(
            f"{tool_name} refused: {shown} has {st.st_nlink} hard links, and its other names may "
            "lie outside the workspace; copy it to a new file (or remove the other links) first"
        )


def _open_for_write(
    path: Path, shown: str, tool_name: str, *, new: bool, may_create: bool, read: bool
) -> int:
    """Open the approved real ``path`` for writing without following any symlink.

    Args:
        new: the file was approved as new: create it with ``O_CREAT|O_EXCL``, so a file that
            appeared during the wait is not overwritten.
        may_create: create the file (and missing parent directories) when it is missing
            (``write`` re-creates a file removed during the wait; ``edit`` of an existing file
            does not).
        read: open it for reading too (``edit``).

    Raises:
        ToolError: a symlink, a non-regular file or a hard-linked file is in the way, or the
            file is gone.
    """
    access = os.O_RDWR if read else os.O_WRONLY
    flags = access | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    if new:
        flags |= os.O_CREAT | os.O_EXCL
    elif may_create:
        flags |= os.O_CREAT
    try:
        parent = _open_parent(path, shown, create=new or may_create)
        try:
            fd = os.open(path.name, flags, 0o666, dir_fd=parent)
        finally:
            os.close(parent)
    except FileExistsError:
        raise _refuse_changed(shown, "the file appeared") from None
    except FileNotFoundError:
        raise _refuse_changed(shown, "the file was removed") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse_changed(shown, "the file became a symlink") from None
        if exc.errno == errno.ENXIO:
            raise ToolError(
                f"{tool_name} refused: {shown} is a FIFO, not a regular file; give the path of a "
                "regular file"
            ) from None
        raise
    try:
        _check_single_link(os.fstat(fd), shown, tool_name)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_fd(fd: int, data: bytes) -> None:
    """Replace the whole content of the open file ``fd`` with ``data``, then close it."""
    try:
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _recheck(ctx: ToolContext, raw: str, approved: ResolvedPath, shown: str) -> None:
    """After the permission wait: the model's path must still lead where it was approved."""
    now = resolve_path(ctx, raw)
    if now.path != approved.path:
        raise _refuse_changed(shown, f"its path now leads to {now.path}")


def _write_file(
    ctx: ToolContext, raw: str, approved: ResolvedPath, shown: str, content: str, exists: bool
) -> None:
    _recheck(ctx, raw, approved, shown)
    fd = _open_for_write(approved.path, shown, "write", new=not exists, may_create=True, read=False)
    _write_fd(fd, content.encode("utf-8", errors="surrogateescape"))


def _check_write_target(ctx: ToolContext, tool_name: str, resolved: ResolvedPath) -> bool:
    """Refuse data-dir, directory, non-regular and hard-linked targets; return whether the file
    exists. The same checks run again on the opened file after the permission answer."""
    check_writable(ctx, tool_name, resolved)
    shown = display_path(ctx, resolved.path)
    try:
        st = os.lstat(resolved.path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise ToolError(f"cannot write {shown}: {exc.strerror or exc}") from exc
    if stat.S_ISDIR(st.st_mode):
        raise ToolError(f"{shown} is a directory; give the path of a file")
    _check_single_link(st, shown, tool_name)
    return True


def _outside_note(ctx: ToolContext, resolved: ResolvedPath) -> str:
    return "" if resolved.inside else f" (outside the workspace {ctx.workspace})"


@attrs.define
class WriteTool:
    """``write``: create or overwrite a file."""

    spec = ToolSpec(
        name="write",
        description=(
            "Create a file, or replace a file's whole content. Missing parent directories are "
            "created. Prefer edit to change part of an existing file. Always asks the user for "
            "permission. The server's data directory cannot be written."
        ),
        parameters={
            "type": "object",
            "properties": {
                "path": {
                    "type": "string",
                    "description": "File to write, relative to the workspace or absolute.",
                },
                "content": {"type": "string", "description": "The complete new content."},
            },
            "required": ["path", "content"],
        },
    )

    async def run(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return await run_tool(self, params, ctx)

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        content: str = params["content"]
        resolved = resolve_path(ctx, params["path"])
        shown = display_path(ctx, resolved.path)
        exists = _check_write_target(ctx, "write", resolved)
        size = len(content.encode("utf-8", errors="surrogateescape"))
        verb = "Overwrite" if exists else "Create"
        await ask_permission(
            ctx,
            tool_name="write",
            action="write",
            description=f"{verb} {shown} ({size} bytes){_outside_note(ctx, resolved)}",
            params={"path": str(resolved.path), "content": content},
            path=resolved.path,
        )
        try:
            await run_blocking(
                ctx,
                "write",
                _write_file,
                ctx,
                params["path"],
                resolved,
                shown,
                content,
                exists,
                abandon=False,
            )
        except OSError as exc:
            raise ToolError(f"could not write {shown}: {exc.strerror or exc}") from exc
        done = "Overwrote" if exists else "Created"
        return ToolResult(content=f"{done} {shown} ({size} bytes)")


# ---------------------------------------------------------------------------------------------
# edit


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
    text = _read_text_file(path, shown, EDIT_MAX_FILE_BYTES, "edit")
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
    data = b"".join(chunks)
    if _is_binary(data[:BINARY_SNIFF_BYTES]):
        raise ToolError(
            f"{shown} looks like a binary file (it contains NUL bytes); edit works on text files "
            "only"
        )
    return data.decode("utf-8", errors="surrogateescape")


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
    _recheck(ctx, raw, approved, shown)
    created = old == ""
    fd = _open_for_write(
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
    _write_fd(fd, plan.text.encode("utf-8", errors="surrogateescape"))
    return plan


def _edit_snippet(plan: _EditPlan) -> list[str]:
    lines = _split_lines(plan.text)
    first_line = plan.text.count("\n", 0, plan.first_index)
    start = max(0, first_line - EDIT_SNIPPET_CONTEXT)
    end = first_line + plan.new_string.count("\n") + 1 + EDIT_SNIPPET_CONTEXT
    end = min(end, start + EDIT_SNIPPET_MAX_LINES, len(lines))
    return _number_lines(lines[start:end], start)


@attrs.define
class EditTool:
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

    async def run(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        return await run_tool(self, params, ctx)

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        old: str = params["old_string"]
        new: str = params["new_string"]
        replace_all = bool(params.get("replace_all") or False)
        if old == new:
            raise ToolError("old_string and new_string are identical; there is nothing to change")
        resolved = resolve_path(ctx, params["path"])
        shown = display_path(ctx, resolved.path)
        _check_write_target(ctx, "edit", resolved)
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
            description=description + _outside_note(ctx, resolved),
            params={
                "path": str(resolved.path),
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
