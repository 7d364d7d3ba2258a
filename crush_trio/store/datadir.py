"""Creating a workspace's data directory: private to the user and ignored by git.

The directory holds the database of every session (prompts, replies, tool output), so each
directory this creates is mode ``0700``, and the data directory gets a ``.gitignore`` holding
``*`` (as Crush does for ``.crush``), so that a project's history is never committed by accident.
Directories that already exist keep their mode: the user chose it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

#: Mode of every directory created for the data directory (owner only).
DATA_DIR_MODE: Final = 0o700
#: What the data directory's ``.gitignore`` holds: everything in it.
GITIGNORE_TEXT: Final = "*\n"


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
