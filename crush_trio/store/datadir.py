"""Creating a workspace's data directory: private to the user and ignored by git.

The directory holds the database of every session (prompts, replies, tool output), so each
directory this creates is mode ``0700``, and the data directory gets a ``.gitignore`` holding
``*`` (as Crush does for ``.crush``), so that a project's history is never committed by accident.
Directories that already exist keep their mode: the user chose it. The database files the
server creates in it (a workspace's ``crush.db``, the webhook outbox) are created ``0600``
whatever the umask (:func:`create_private_file`); SQLite gives their ``-wal`` and ``-shm`` files
the database file's mode.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from pathlib import Path

log = logging.getLogger(__name__)

#: Mode of every directory created for the data directory (owner only).
DATA_DIR_MODE: Final = 0o700
#: Mode of the database files the server creates (owner read and write only).
PRIVATE_FILE_MODE: Final = 0o600
#: What the data directory's ``.gitignore`` holds: everything in it.
GITIGNORE_TEXT: Final = "*\n"


def create_private_file(path: Path) -> None:
    """Create ``path`` empty with mode :data:`PRIVATE_FILE_MODE` unless it exists (an empty
    file is a new SQLite database; SQLite then creates its ``-wal`` and ``-shm`` files with the
    same mode). An existing file keeps its mode.

    Raises:
        OSError: the file cannot be created (a symlink in its place included).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, PRIVATE_FILE_MODE)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, PRIVATE_FILE_MODE)  # exactly 0600, whatever the umask removed
    finally:
        os.close(fd)


def ensure_data_dir(path: Path) -> None:
    """Create ``path`` (and any missing parent) with mode ``0700``, and write
    ``path/.gitignore`` (``*``) if it has none.

    Raises:
        OSError: a directory cannot be created.
    """
    missing: list[Path] = []
    current = path
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=DATA_DIR_MODE)
        except FileExistsError:
            continue  # made meanwhile by another workspace opening
        os.chmod(directory, DATA_DIR_MODE)  # the umask may have removed owner bits
    ignore = path / ".gitignore"
    if ignore.exists():
        return
    try:
        with open(ignore, "x", encoding="utf-8") as file:
            file.write(GITIGNORE_TEXT)
    except FileExistsError:
        pass
    except OSError as exc:
        log.warning("cannot write %s: %s", ignore, exc.strerror or exc)
