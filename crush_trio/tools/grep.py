"""The ``grep`` tool and its two engines: ripgrep when it is on ``PATH``, else Python's ``re``
in a child process (:mod:`.grep_worker`), which the timeout can kill."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any, Final

import attrs
import orjson
import pathspec
import trio

from . import grep_worker
from .base import ToolBase, ToolContext, ToolError, ToolResult, ToolSpec
from .files import BINARY_SNIFF_BYTES, IGNORED_DIR_NAMES
from .globs import compile_glob, glob_regex
from .hidden import is_hidden
from .paths import display_path, in_data_dir, search_root_then

__all__ = [
    "GREP_MAX_FILE_BYTES",
    "GREP_MAX_LINE_CHARS",
    "GREP_MAX_MATCHES",
    "GREP_MAX_STDERR_BYTES",
    "GrepTool",
]

#: ``grep``: most matching lines returned.
#: Where the search child (run without site-packages) finds ``pathspec`` for ``.gitignore``.
PATHSPEC_SYS_PATH: Final = str(Path(pathspec.__file__).resolve().parent.parent)
GREP_MAX_MATCHES: Final = 100
#: ``grep``: longer matching lines are cut to this many characters.
GREP_MAX_LINE_CHARS: Final = 500
#: ``grep`` (Python search): larger files are skipped.
GREP_MAX_FILE_BYTES: Final = 10 * 1024 * 1024
#: ``grep`` (ripgrep): most bytes of its stderr kept for an error message.
GREP_MAX_STDERR_BYTES: Final = 4096


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
    hidden: tuple[Path, ...],
) -> tuple[list[_Match], bool]:
    """Search with Python's ``re`` in a child process (:mod:`.grep_worker`).

    A regular expression that backtracks for ever cannot be stopped in a thread; the child is
    killed when the call's timeout cancels this.
    """
    include_regex, by_name = glob_regex(include) if include else (None, False)
    job = {
        "root": str(root),
        "pattern": pattern,
        "include": include_regex.pattern if include_regex is not None else None,
        "include_by_name": by_name,
        "data_dir": str(ctx.data_dir),
        "hidden": [str(p) for p in hidden],
        "ignored": sorted(IGNORED_DIR_NAMES),
        "sys_path": [PATHSPEC_SYS_PATH],
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


def _hidden_and_is_dir(root: Path, hidden: tuple[Path, ...]) -> tuple[tuple[Path, ...], bool]:
    return hidden, root.is_dir()


async def _grep_rg(
    rg: str,
    root: Path,
    is_dir: bool,
    pattern: str,
    include: str | None,
    ctx: ToolContext,
    hidden: tuple[Path, ...],
) -> tuple[list[_Match], bool]:
    """Search with ripgrep, reading its output until enough matches have come.

    Cancellation:
        ripgrep is ended by ``trio.run_process`` (SIGTERM) when the search is cancelled or has
        found enough.
    """
    command = [
        rg,
        "--no-config",
        # The other tools' notion of ignored files: .gitignore files, in a repository or not,
        # and no other ignore files (docs/tools.md "Ignored files").
        "--no-require-git",
        "--no-ignore-dot",
        "--no-ignore-global",
        "--no-ignore-exclude",
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
        assert proc.stdout is not None
        assert proc.stderr is not None
        nursery.start_soon(_drain, proc.stderr, errors, GREP_MAX_STDERR_BYTES)
        pending = b""
        # A file's matches come together (sorted by path): its path is built and checked once.
        last_name: bytes | None = None
        path: Path | None = None  # None: the file is not shown
        async with proc.stdout:
            async for chunk in proc.stdout:
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    name, _, rest = line.partition(b"\0")
                    number, _, text = rest.partition(b":")
                    if name != last_name:
                        last_name = name
                        path = base / os.fsdecode(name).removeprefix("./")
                        if in_data_dir(ctx, path) or is_hidden(path, hidden):
                            path = None
                    if path is None or not number.isdigit():
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
class GrepTool(ToolBase):
    """``grep``: lines matching a regular expression.

    Attributes:
        use_rg: search with ripgrep (``rg``) when it is on ``PATH``; False forces the Python
            search (used by tests; the environment variable ``CRUSH_TRIO_GREP_NO_RG=1`` does the
            same).
    """

    use_rg: bool = True

    #: Offered to sub-agents (``agent``): it only reads, under the usual permission rule.
    read_only = True
    spec = ToolSpec(
        name="grep",
        description=(
            "Search file contents with a regular expression (ripgrep/Python syntax, e.g. "
            "'def \\w+_handler', 'TODO|FIXME'). Returns 'file:line:text' for up to "
            f"{GREP_MAX_MATCHES} matching lines, sorted by path. Hidden files, binary files, "
            "version-control and cache directories, files the project's .gitignore files exclude "
            "and the server's data directory are skipped. Use 'include' to "
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
        # Whether the root is a directory is asked in the same thread as the root's checks.
        root, (hidden, is_dir) = await search_root_then(
            ctx, "grep", params.get("path") or "", want_dir=False, then=_hidden_and_is_dir
        )
        with trio.move_on_after(ctx.timeout):
            if rg is not None:
                matches, more = await _grep_rg(rg, root.path, is_dir, pattern, include, ctx, hidden)
            else:
                matches, more = await _grep_python(root.path, pattern, include, ctx, hidden)
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
