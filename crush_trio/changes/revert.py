"""Putting files back: atomic per-file writes and the revert journal.

Each file is restored by writing its stored bytes to a temporary file in the same directory,
``fsync``, then ``rename`` over the path (a symbolic link: a temporary link renamed over it; a file
the run created: ``unlink``). A file is therefore always either its old or its new self, whatever
stops the process. Parent directories are opened one component at a time with ``O_NOFOLLOW``, so
a path whose directory was replaced by a symbolic link is refused instead of followed out of the
workspace.

The journal (``<data>/snapshots/reverts/<revert_id>.json``) is written (``fsync`` + rename)
before the first file is touched, with state ``started``, and again at the end (``done`` or
``failed``). A journal still ``started`` when the workspace opens belongs to a revert that was
killed: :meth:`crush_trio.changes.service.ChangeLog.recover` then compares each file with its
old and new content and writes the outcome (``interrupted``, each file ``old``, ``new`` or
``other``).
"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import TYPE_CHECKING, Any, Final

import orjson

from .shadow import MODE_EXEC, MODE_LINK, Entry

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path

#: Prefix of the temporary files a revert writes next to the files it restores.
TEMP_PREFIX: Final = ".crush-revert-"


class UnsafePath(Exception):
    """A path that leaves the workspace or crosses a symbolic link to a directory."""


def temp_name(revert_id: str, index: int) -> str:
    return f"{TEMP_PREFIX}{revert_id[:20]}-{index}"


@contextlib.contextmanager
def _parent_fd(root: Path, rel: str, *, create: bool) -> Iterator[tuple[int, str]]:
    """An fd of ``rel``'s directory inside ``root`` (walked with ``O_NOFOLLOW``) and its name."""
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") for p in parts):
        raise UnsafePath(f"path {rel!r} is not a plain relative path")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(root, flags)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                nxt = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePath(f"{rel!r}: {part!r} is not a directory") from exc
                raise
            os.close(fd)
            fd = nxt
        yield fd, parts[-1]
    finally:
        os.close(fd)


def restore_file(
    root: Path, rel: str, target: Entry | None, read_blob: Callable[[str], bytes], tmp: str
) -> None:
    """Make ``root/rel`` hold ``target`` (None: remove it), atomically."""
    if target is None:
        try:
            with (
                _parent_fd(root, rel, create=False) as (fd, name),
                contextlib.suppress(FileNotFoundError),
            ):
                os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            return
        _prune_empty_dirs(root, rel)
        return
    data = read_blob(target.sha)
    with _parent_fd(root, rel, create=True) as (fd, name):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=fd)
        if target.mode == MODE_LINK:
            os.symlink(os.fsdecode(data), tmp, dir_fd=fd)
        else:
            mode = 0o755 if target.mode == MODE_EXEC else 0o644
            out = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                mode,
                dir_fd=fd,
            )
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(out, view) :]
                os.fchmod(out, mode)
                os.fsync(out)
            finally:
                os.close(out)
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        os.fsync(fd)


def remove_temp(root: Path, rel: str, tmp: str) -> None:
    """Remove a temporary file a killed revert may have left next to ``rel``."""
    with (
        contextlib.suppress(OSError, UnsafePath),
        _parent_fd(root, rel, create=False) as (fd, _name),
    ):
        os.unlink(tmp, dir_fd=fd)


def _prune_empty_dirs(root: Path, rel: str) -> None:
    """Remove the directories above ``rel`` that the removal left empty (not the root)."""
    parts = rel.split("/")[:-1]
    while parts:
        try:
            os.rmdir(root.joinpath(*parts))
        except OSError:
            return
        parts.pop()


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``path`` whole or not at all (temporary file, fsync, rename, fsync the directory)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as file:
        file.write(orjson.dumps(data))
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_json(path: Path) -> Any:
    return orjson.loads(path.read_bytes())
