"""Read-before-edit: which files each session has viewed, and whether they changed since.

``edit``, ``multiedit`` and ``write`` over an existing file go ahead only when the same session
viewed that file (``view``, any part of it) and the file has not changed on disk since. A file is
identified by its real path; "not changed" means the same :class:`Snapshot` (device, inode, size,
modification and change times in nanoseconds): a rewrite, a rename over it, a ``touch`` or a
``chmod`` all count as a change, and the model is told to ``view`` it again.

The snapshot recorded by ``view`` is taken *before* the file is read, so a change during the read
makes the recorded snapshot stale and the next edit is refused rather than applied to text the
model never saw. After ``edit``, ``multiedit`` or ``write`` succeed, the snapshot of the file as
written is recorded, so the model may edit it again without viewing it.

Bounds: each session remembers at most :data:`TRACKER_MAX_FILES` files and the tracker at most
:data:`TRACKER_MAX_SESSIONS` sessions; the least recently used entry is forgotten first, which
only costs the model one more ``view``. All state is in memory (a restart forgets it, so the
model views again).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Final

import attrs

if TYPE_CHECKING:
    from pathlib import Path

__all__ = [
    "TRACKER_MAX_FILES",
    "TRACKER_MAX_SESSIONS",
    "FileTracker",
    "Snapshot",
    "refusal",
    "stat_snapshot",
]

#: Files remembered per session (least recently used forgotten first).
TRACKER_MAX_FILES: Final = 1024
#: Sessions remembered per tracker (one tracker per workspace).
TRACKER_MAX_SESSIONS: Final = 256


@attrs.frozen
class Snapshot:
    """What identifies one state of a file on disk."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Snapshot:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def stat_snapshot(path: Path) -> Snapshot | None:
    """The snapshot of ``path`` (following symlinks), or None when it cannot be stat'ed."""
    try:
        return Snapshot.of(os.stat(path))
    except OSError:
        return None


class FileTracker:
    """The files each session viewed, with their snapshot at the time (see the module docstring).

    Plain state, no I/O: callers pass the snapshots they took. Safe to share between the tool
    calls of one workspace (they all run on the event loop).
    """

    def __init__(
        self, *, max_files: int = TRACKER_MAX_FILES, max_sessions: int = TRACKER_MAX_SESSIONS
    ) -> None:
        self.max_files = max_files
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, OrderedDict[Path, Snapshot]] = OrderedDict()

    def record(self, session_id: str, path: Path, snapshot: Snapshot | None) -> None:
        """Remember that ``session_id`` saw ``path`` as ``snapshot`` (None: forget it)."""
        files = self._sessions.get(session_id)
        if files is None:
            if snapshot is None:
                return
            files = self._sessions[session_id] = OrderedDict()
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session_id)
        if snapshot is None:
            files.pop(path, None)
            return
        files[path] = snapshot
        files.move_to_end(path)
        while len(files) > self.max_files:
            files.popitem(last=False)

    def seen(self, session_id: str, path: Path) -> Snapshot | None:
        """The snapshot ``session_id`` last saw of ``path``, or None."""
        files = self._sessions.get(session_id)
        return None if files is None else files.get(path)

    def forget_session(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def __len__(self) -> int:
        return sum(len(files) for files in self._sessions.values())


def refusal(seen: Snapshot | None, now: Snapshot | None, shown: str, tool_name: str) -> str | None:
    """Why a file may not be changed, or None when the session saw it (``seen``) as it is
    ``now``; the caller raises the message as a tool error."""
    if seen is None:
        return (
            f"{tool_name} refused: {shown} exists and has not been read in this session; "
            "view it first (the view tool), then make the change"
        )
    if now != seen:
        return (
            f"{tool_name} refused: {shown} changed on disk since it was last viewed in this "
            "session; view it again to see its current content, then make the change"
        )
    return None
