"""What the agent changed in a workspace: snapshots, per-run diffs and undo by run.

* :mod:`.shadow` — the snapshot store: a git object database of our own in the data directory,
  never the user's ``.git`` (blocking; run in a worker thread).
* :mod:`.revert` — atomic per-file restores and the revert journal.
* :mod:`.service` — :class:`ChangeLog`, the workspace's trio-facing service: records, diffs,
  reverts and the ``files_changed`` event.
"""

from .service import ChangeLog, ChangeRecord, RevertConflict

__all__ = ["ChangeLog", "ChangeRecord", "RevertConflict"]
