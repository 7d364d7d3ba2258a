"""The ``write`` tool, and opening an approved path for writing without following symlinks.

A write always asks first (action ``"write"``). The approved path is checked again after the
answer: it must still resolve to the same real path, and the file is opened one directory at a
time with ``O_NOFOLLOW`` (:func:`open_for_write`), so a symlink or hard link put in the way while
the user thought is refused instead of followed. ``edit`` (:mod:`.edit`) writes the same way.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
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
from .paths import ResolvedPath, check_not_hidden, check_writable, display_path, resolve_path
from .tracker import Snapshot, stat_snapshot

if TYPE_CHECKING:
    from pathlib import Path

__all__ = [
    "WriteTool",
    "check_opened_unchanged",
    "check_write_target",
    "open_for_write",
    "outside_note",
    "recheck_path",
    "write_fd",
]


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


def open_for_write(
    path: Path, shown: str, tool_name: str, *, new: bool, may_create: bool, read: bool
) -> int:
    """Open the approved real ``path`` for writing without following any symlink.

    Args:
        new: the file was approved as new: create it with ``O_CREAT|O_EXCL``, so a file that
            appeared during the wait is not overwritten.
        may_create: create the file (and missing parent directories) when it is missing.
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


def write_fd(fd: int, data: bytes) -> Snapshot:
    """Replace the whole content of the open file ``fd`` with ``data``, then close it.

    Returns:
        The file's snapshot as written (recorded for read-before-edit).
    """
    try:
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        return Snapshot.of(os.fstat(fd))
    finally:
        os.close(fd)


def check_opened_unchanged(fd: int, seen: Snapshot | None, shown: str, tool_name: str) -> None:
    """Read-before-edit on the file actually opened after the permission wait: it must still be
    the file the session viewed, unchanged (the caller closes ``fd`` on an error)."""
    check_viewed(seen, Snapshot.of(os.fstat(fd)), shown, tool_name)


def recheck_path(ctx: ToolContext, raw: str, approved: ResolvedPath, shown: str) -> None:
    """After the permission wait: the model's path must still lead where it was approved."""
    now = resolve_path(ctx, raw)
    if now.path != approved.path:
        raise _refuse_changed(shown, f"its path now leads to {now.path}")


def _write_file(
    ctx: ToolContext,
    raw: str,
    approved: ResolvedPath,
    shown: str,
    content: str,
    exists: bool,
    seen: Snapshot | None,
) -> Snapshot:
    recheck_path(ctx, raw, approved, shown)
    # An existing file removed during the wait is not re-created: it changed since it was viewed.
    fd = open_for_write(approved.path, shown, "write", new=not exists, may_create=False, read=False)
    if exists:
        try:
            check_opened_unchanged(fd, seen, shown, "write")
        except BaseException:
            os.close(fd)
            raise
    return write_fd(fd, content.encode("utf-8", errors="surrogateescape"))


def _check_viewed_now(path: Path, seen: Snapshot | None, shown: str, tool_name: str) -> None:
    check_viewed(seen, stat_snapshot(path), shown, tool_name)


def check_write_target(ctx: ToolContext, tool_name: str, resolved: ResolvedPath) -> bool:
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


def outside_note(ctx: ToolContext, resolved: ResolvedPath) -> str:
    return "" if resolved.inside else f" (outside the workspace {ctx.workspace})"


@attrs.define
class WriteTool(ToolBase):
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

    async def execute(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        content: str = params["content"]
        resolved = resolve_path(ctx, params["path"])
        shown = display_path(ctx, resolved.path)
        await check_not_hidden(ctx, "write", resolved.path)
        exists = check_write_target(ctx, "write", resolved)
        seen = ctx.files.seen(ctx.session_id, resolved.path)
        if exists:
            await run_blocking(ctx, "write", _check_viewed_now, resolved.path, seen, shown, "write")
        size = len(content.encode("utf-8", errors="surrogateescape"))
        verb = "Overwrite" if exists else "Create"
        await ask_permission(
            ctx,
            tool_name="write",
            action="write",
            description=f"{verb} {shown} ({size} bytes){outside_note(ctx, resolved)}",
            # ``file_path`` too: Crush's permission dialog reads that key.
            params={
                "path": str(resolved.path),
                "file_path": str(resolved.path),
                "content": content,
            },
            path=resolved.path,
        )
        try:
            written = await run_blocking(
                ctx,
                "write",
                _write_file,
                ctx,
                params["path"],
                resolved,
                shown,
                content,
                exists,
                seen,
                abandon=False,
            )
        except OSError as exc:
            raise ToolError(f"could not write {shown}: {exc.strerror or exc}") from exc
        ctx.files.record(ctx.session_id, resolved.path, written)
        done = "Overwrote" if exists else "Created"
        return ToolResult(content=f"{done} {shown} ({size} bytes)")
