"""Path confinement: where a tool's path really points, and whether that is inside the workspace.

Rules:

* A relative path is relative to the workspace; ``~`` expands to the home directory.
* The path is resolved to its real path, following every symlink. For a path that does not exist
  yet, its nearest existing parent is resolved and the rest appended.
* It is *inside* when the real path is the workspace or below it. ``..`` escapes, absolute paths
  elsewhere and symlinks that lead out are all outside, and using them needs permission.
* The data directory is never written by a tool; the file tools refuse it before any prompt.
* The paths the ``bash`` sandbox hides (secret stores, the server's own files, other workspaces'
  data directories: :mod:`.hidden`) are refused by every file tool before any prompt, and the
  walkers of ``ls``, ``glob`` and ``grep`` skip them.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import attrs

from .base import ToolContext, ToolError, ask_permission, run_blocking
from .files import not_regular
from .hidden import is_hidden, resolve_hidden
from .sandbox import is_within

if TYPE_CHECKING:
    from collections.abc import Callable

T = TypeVar("T")

__all__ = [
    "ResolvedPath",
    "check_not_hidden",
    "check_not_hidden_then",
    "check_read",
    "check_writable",
    "display_path",
    "hidden_paths",
    "in_data_dir",
    "is_within",
    "resolve_path",
    "resolve_search_root",
    "search_root_then",
]


@attrs.define(frozen=True)
class ResolvedPath:
    """A tool path after resolution.

    Attributes:
        path: the real path (symlinks followed).
        inside: the real path is the workspace or below it.
    """

    path: Path
    inside: bool


def resolve_path(ctx: ToolContext, raw: str) -> ResolvedPath:
    """Resolve a path given by the model.

    Args:
        ctx: the call's context; relative paths start at ``ctx.workspace``.
        raw: the path as the model wrote it; empty means the workspace.

    Returns:
        The real path and whether it is inside the workspace.
    """
    candidate = Path(os.path.expanduser(raw)) if raw else ctx.workspace
    if not candidate.is_absolute():
        candidate = ctx.workspace / candidate
    # realpath follows every symlink it meets, dangling ones included, and keeps a missing tail
    # as written, which is the nearest existing parent resolved plus the rest.
    real = Path(os.path.realpath(candidate))
    return ResolvedPath(path=real, inside=is_within(real, ctx.workspace))


def in_data_dir(ctx: ToolContext, path: Path) -> bool:
    """Whether the real ``path`` is the data directory or inside it."""
    return is_within(path, ctx.data_dir)


def display_path(ctx: ToolContext, path: Path) -> str:
    """``path`` as tools show it: relative to the workspace when inside, else absolute."""
    if is_within(path, ctx.workspace):
        rel = path.relative_to(ctx.workspace).as_posix()
        return rel if rel != "." else "."
    return str(path)


async def hidden_paths(ctx: ToolContext, tool_name: str) -> tuple[Path, ...]:
    """The real paths hidden from this call's tools (the sandbox's hidden list, expanded)."""
    patterns = ctx.hidden.patterns()
    found: tuple[Path, ...] = await run_blocking(
        ctx, tool_name, resolve_hidden, patterns, ctx.workspace, ctx.data_dir
    )
    return found


async def check_not_hidden(ctx: ToolContext, tool_name: str, path: Path) -> tuple[Path, ...]:
    """Refuse a path the sandbox hides; no permission answer can override this.

    Returns:
        The hidden paths, for a walk below ``path`` to skip.

    Raises:
        ToolError: ``path`` (a real path) is hidden or below a hidden path.
    """
    hidden, _ = await check_not_hidden_then(ctx, tool_name, path, _nothing)
    return hidden


async def check_not_hidden_then(
    ctx: ToolContext, tool_name: str, path: Path, then: Callable[[tuple[Path, ...]], T]
) -> tuple[tuple[Path, ...], T]:
    """:func:`check_not_hidden`, then the blocking ``then(hidden)`` in the same worker thread
    when ``path`` is not hidden: one thread hop for both (each costs the server CPU).

    Returns:
        The hidden paths and what ``then`` returned.

    Raises:
        ToolError: ``path`` is hidden (``then`` did not run), or raised by ``then``.
    """
    patterns = ctx.hidden.patterns()
    workspace, data_dir = ctx.workspace, ctx.data_dir

    def work() -> tuple[tuple[Path, ...], T] | None:
        hidden = resolve_hidden(patterns, workspace, data_dir)
        return None if is_hidden(path, hidden) else (hidden, then(hidden))

    found: tuple[tuple[Path, ...], T] | None = await run_blocking(ctx, tool_name, work)
    if found is None:
        raise ToolError(
            f"{tool_name} refused: {path} is hidden from the agent's tools, as from its shell "
            "commands (a secret store such as ~/.ssh or ~/.aws, options.sandbox.deny_read, or "
            "the server's own files); no permission opens it. If the task needs something from "
            "it, ask the user to provide it"
        )
    return found


def _nothing(hidden: tuple[Path, ...]) -> None:
    return None


def _stat(path: Path) -> os.stat_result | None:
    """``path.stat()``, or None where ``path.exists()`` is false (the errors it ignores)."""
    try:
        return path.stat()
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP):
            return None
        raise


async def check_read(ctx: ToolContext, tool_name: str, resolved: ResolvedPath) -> None:
    """Ask for permission to read ``resolved`` when it is outside the workspace.

    Raises:
        PermissionDenied: the user denied it.

    Cancellation:
        ``trio.Cancelled`` while waiting for the answer propagates.
    """
    if resolved.inside:
        return
    await ask_permission(
        ctx,
        tool_name=tool_name,
        action="read",
        description=(
            f"{tool_name} wants to read {resolved.path}, which is outside the workspace "
            f"{ctx.workspace}"
        ),
        params={"path": str(resolved.path)},
        path=resolved.path,
    )


def check_writable(ctx: ToolContext, tool_name: str, resolved: ResolvedPath) -> None:
    """Refuse a write into the data directory; no permission answer can override this.

    Raises:
        ToolError: ``resolved`` is the data directory or inside it.
    """
    if in_data_dir(ctx, resolved.path):
        raise ToolError(
            f"{tool_name} refused: {resolved.path} is inside the server's data directory "
            f"{ctx.data_dir}, which tools never write; choose a path elsewhere in the workspace"
        )


async def resolve_search_root(
    ctx: ToolContext, tool_name: str, raw: str, *, want_dir: bool
) -> tuple[ResolvedPath, tuple[Path, ...]]:
    """Resolve the root of ``ls``/``glob``/``grep``, asking when it is outside the workspace.

    Returns:
        The root, and the hidden paths the walk below it skips.
    """
    return await search_root_then(ctx, tool_name, raw, want_dir=want_dir, then=_hidden_only)


async def search_root_then(
    ctx: ToolContext,
    tool_name: str,
    raw: str,
    *,
    want_dir: bool,
    then: Callable[[Path, tuple[Path, ...]], T],
) -> tuple[ResolvedPath, T]:
    """:func:`resolve_search_root`, then the blocking ``then(root, hidden)`` (the walk) in a
    worker thread. A root inside the workspace needs no prompt, so its checks and ``then``
    share one thread (each thread hop costs the server CPU); outside, the prompt comes between.

    Returns:
        The root, and what ``then`` returned.
    """
    resolved = resolve_path(ctx, raw)
    root = resolved.path
    if in_data_dir(ctx, root):
        raise ToolError(
            f"{tool_name} refused: {root} is inside the server's data directory "
            f"{ctx.data_dir}, which tools do not list or search"
        )

    def check(hidden: tuple[Path, ...]) -> tuple[Path, ...]:
        st = _stat(root)
        if st is None:
            raise ToolError(f"path not found: {display_path(ctx, root)}; use ls to see what exists")
        if want_dir and not stat.S_ISDIR(st.st_mode):
            raise ToolError(
                f"{display_path(ctx, root)} is a file, not a directory; use view to read it"
            )
        if not stat.S_ISDIR(st.st_mode) and not stat.S_ISREG(st.st_mode):
            raise not_regular(display_path(ctx, root), st.st_mode, tool_name)
        return hidden

    if resolved.inside:  # check_read would ask nothing
        _, walked = await check_not_hidden_then(
            ctx, tool_name, root, lambda hidden: then(root, check(hidden))
        )
        return resolved, walked
    hidden, _ = await check_not_hidden_then(ctx, tool_name, root, check)
    await check_read(ctx, tool_name, resolved)
    walked = await run_blocking(ctx, tool_name, then, root, hidden)
    return resolved, walked


def _hidden_only(root: Path, hidden: tuple[Path, ...]) -> tuple[Path, ...]:
    return hidden
