"""The change log of one workspace: what each run changed, its diff, and undoing it.

Snapshots (:mod:`.shadow`) are taken when the workspace opens (:meth:`ChangeLog.warm`), before
a run's first tool call that may write (any tool not in :data:`READ_ONLY_TOOLS`: the run's
"before"), after each such call (then a lossy ``files_changed`` event names the files that call
changed), and when a run that made such a call ends (a background job it started may still have
written). Each run gets a *change record* (``<data>/snapshots/records/<run_id>.json``): its
session, the trees before and after it, and the per-file summary. A revert is recorded the same
way under its own id, so it can be shown and reverted too.

A run's record covers what changed from its first tool call that may write to its end: a file
the user edited after the run began but before that call is not the run's change. A run that
made no such call changed nothing: its record has no files, its before and after are both the
latest tree the change log knows (the warm-up snapshot or any later one), and it costs no git
command (a snapshot is taken only when no tree is known yet). Each tree a record names is kept by
a ref (``refs/crush/...``, so that a garbage collection would keep its objects; nothing here runs
one): the refs of one record are written by one git command, and a tree already kept since the
process started is not kept again.

A turn that folded several prompts runs them as one: every run of the turn gets the turn's
record. Runs of different sessions running at the same time share the workspace: a record holds
what changed in the workspace while its run ran, which includes a concurrent run's changes
(the per-file ``revert`` conflict check then names them).

Concurrency: one git operation at a time per workspace (a ``trio.Lock``), each in a worker
thread that is never abandoned (the shadow index must not be left half written); each git
command is bounded by :data:`~.shadow.GIT_TIMEOUT`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs
import trio

from ..errors import Conflict, NotFound, StoreError
from ..store.datadir import ensure_data_dir
from ..wire import Diff, FileChange, FilesChanged, RevertFile, RevertResult, new_id, now
from .revert import (
    UnsafePath,
    read_json,
    remove_temp,
    restore_file,
    temp_name,
    write_json_atomic,
)
from .shadow import EMPTY_TREE, MAX_FILE_BYTES, Entry, GitError, RawChange, ShadowRepo

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from pathlib import Path

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Bound on the unified diff text of one answer (bytes); longer diffs are cut and flagged.
MAX_DIFF_BYTES: Final = 1024 * 1024
#: Bound on the files listed in one diff, one ``files_changed`` event or one record.
MAX_DIFF_FILES: Final = 1000
#: Bound on the records (runs and reverts) a session diff walks (the latest ones).
MAX_SESSION_RECORDS: Final = 10_000
#: Bound on the paths named in a 409 conflict answer.
MAX_CONFLICT_FILES: Final = 200
#: Tools that never change files: no snapshot before or after them.
READ_ONLY_TOOLS: Final = frozenset(
    {"view", "ls", "glob", "grep", "fetch", "sourcegraph", "diagnostics", "todos", "job_output"}
)

#: Bound on the tree ids remembered as kept by a ref (the oldest are forgotten: kept again).
KEPT_TREES: Final = 1024

_KEY: Final = re.compile(r"[0-9a-f]{40}")


def _key(identifier: str) -> str:
    """The file and ref name of a run, revert or session id: ids come from clients (any text up
    to 128 characters), so they never name a file themselves."""
    return hashlib.sha256(identifier.encode("utf-8", "surrogatepass")).hexdigest()[:40]


_STATUS: Final = {"A": "added", "D": "deleted", "M": "modified", "T": "modified"}


@attrs.define
class ChangeRecord:
    """What one run (``kind="run"``) or revert (``kind="revert"``) changed."""

    id: str
    session_id: str
    kind: str
    before: str
    after: str
    created_at: int
    files: list[FileChange] = attrs.field(factory=list)
    truncated: bool = False
    #: A revert: the record it reverted.
    reverts: str | None = None


class RevertConflict(Conflict):
    """409 with the list of files changed after the run."""

    def __init__(self, message: str, files: list[str]) -> None:
        super().__init__(message)
        self.files = files


@attrs.define
class _Active:
    """A run (a turn) being tracked: ``before`` is None until its first tool call that may
    write; ``failed``: that snapshot failed, the run is not recorded."""

    run_ids: list[str]
    before: str | None = None
    last: str | None = None
    failed: bool = False
    #: Held while the before snapshot is taken, so parallel tool calls take one.
    lock: trio.Lock = attrs.field(factory=trio.Lock)


def display_path(path: str) -> str:
    """A path as JSON can carry it: bytes that are not UTF-8 (kept as surrogates by
    ``os.fsdecode``) become U+FFFD."""
    return os.fsencode(path).decode("utf-8", "replace")


def _real_path(item: dict[str, Any]) -> str:
    """The exact path of a journal entry (its bytes are kept in ``raw``)."""
    return os.fsdecode(bytes.fromhex(item["raw"])) if "raw" in item else str(item["path"])


def _file_changes(
    raw: Sequence[RawChange], stats: dict[str, tuple[int, int] | None]
) -> list[FileChange]:
    files = []
    for change in raw:
        counts = stats.get(change.path)
        files.append(
            FileChange(
                path=display_path(change.path),
                status=_STATUS.get(change.status, "modified"),
                added=counts[0] if counts else 0,
                removed=counts[1] if counts else 0,
                binary=change.path in stats and counts is None,
            )
        )
    return files


class ChangeLog:
    """Snapshots, records, diffs and reverts of one workspace (see the module docstring).

    Args:
        workspace: the project directory.
        data_dir: the workspace's data directory (the snapshots live in ``snapshots/`` there).
        publish: told each ``files_changed`` event (must return at once; lossy).
    """

    def __init__(
        self,
        workspace: Path,
        data_dir: Path,
        *,
        publish: Callable[[FilesChanged], None] = lambda _: None,
        max_file_bytes: int = MAX_FILE_BYTES,
    ) -> None:
        #: The data directory holding ``snapshots/``.
        self.data_dir = data_dir
        self.root = data_dir / "snapshots"
        self.workspace = workspace
        self.repo = ShadowRepo(
            workspace, self.root / "git", exclude=[data_dir], max_file_bytes=max_file_bytes
        )
        self._publish = publish
        self._lock = trio.Lock()
        self._active: dict[str, _Active] = {}
        #: The tree of the latest snapshot (None: none taken yet).
        self._latest: str | None = None
        #: Tree ids a ref keeps (set in worker threads under the lock; bounded, oldest first).
        self._kept: dict[str, None] = {}
        self._ready = False
        #: Set when the shadow database could not be made: changes are not tracked.
        self.error = ""

    # -- plumbing

    async def _thread(self, fn: Callable[[], T]) -> T:
        async with self._lock:
            return await trio.to_thread.run_sync(fn, abandon_on_cancel=False)

    async def _answer(self, fn: Callable[[], T]) -> T:
        """:meth:`_thread` for a request: a failure of git or of the disk is a StoreError
        naming it (500 with the reason), not a bug."""
        try:
            return await self._thread(fn)
        except (GitError, OSError) as exc:
            raise StoreError(
                f"the snapshot store of {self.workspace} failed: {exc}; see the server log"
            ) from exc

    def _snapshot_sync(self) -> str:
        """A snapshot (:meth:`ShadowRepo.snapshot`), remembered as the latest tree."""
        tree = self.repo.snapshot()
        self._latest = tree
        return tree

    def _keep_sync(self, refs: Sequence[tuple[str, str]]) -> None:
        """Keep the trees of ``refs`` (one git command), leaving out trees already kept."""
        wanted = [(ref, tree) for ref, tree in refs if tree not in self._kept]
        if not wanted:
            return
        self.repo.keep(wanted)
        for _ref, tree in wanted:
            self._kept[tree] = None
        while len(self._kept) > KEPT_TREES:
            del self._kept[next(iter(self._kept))]

    def _record_path(self, record_id: str) -> Path:
        return self.root / "records" / f"{_key(record_id)}.json"

    def _journal_path(self, revert_id: str) -> Path:
        return self.root / "reverts" / f"{_key(revert_id)}.json"

    # -- lifetime

    async def open(self) -> list[RevertResult]:
        """Create the shadow database and finish the journals of reverts a kill interrupted
        (returned). A failure is logged and leaves change tracking off (``error``)."""
        try:
            recovered = await self._thread(self._open_sync)
        except (GitError, OSError) as exc:
            self.error = f"change tracking is off: {exc}"
            log.error("workspace %s: %s", self.workspace, self.error)
            return []
        self._ready = True
        return recovered

    def _open_sync(self) -> list[RevertResult]:
        ensure_data_dir(self.data_dir)  # private, and ignored by the project's git
        self.repo.init()
        (self.root / "records").mkdir(exist_ok=True)
        (self.root / "reverts").mkdir(exist_ok=True)
        recovered = []
        for path in sorted((self.root / "reverts").glob("*.json")):
            try:
                journal = read_json(path)
            except (OSError, ValueError):
                log.warning("unreadable revert journal %s", path)
                continue
            if journal.get("state") == "started":
                recovered.append(self._finish_interrupted(journal))
        return recovered

    def _finish_interrupted(self, journal: dict[str, Any]) -> RevertResult:
        """Mark a revert killed mid-way: each file ``old``, ``new`` or ``other``."""
        revert_id = journal["revert_id"]
        for i, item in enumerate(journal["files"]):
            remove_temp(self.workspace, _real_path(item), temp_name(revert_id, i))
        current = self._snapshot_sync()
        now_entries = self.repo.entries(current, [_real_path(f) for f in journal["files"]])
        for item in journal["files"]:
            have = now_entries.get(_real_path(item))
            item["outcome"] = (
                "new"
                if _same(have, item["target"])
                else "old"
                if _same(have, item["was"])
                else "other"
            )
        journal["state"] = "interrupted"
        journal["error"] = "the server stopped during the revert; each file is old or new"
        journal["finished_at"] = now()
        self._write_record_sync(
            revert_id,
            journal["session_id"],
            "revert",
            journal["before"],
            current,
            journal["run_id"],
        )
        write_json_atomic(self._journal_path(revert_id), journal)
        log.warning("revert %s was interrupted; its outcome is recorded", revert_id)
        return _result(journal)

    async def warm(self) -> None:
        """Take a first snapshot when the workspace opens, so the first run does not wait for
        every file to be hashed (the run's own snapshot then only stats them), and keep its
        tree: a run that writes nothing records it with no git command."""
        if not self._ready:
            return

        def work() -> None:
            tree = self._snapshot_sync()
            self._keep_sync([(f"opened/{tree}", tree)])
            log.debug("workspace %s: first snapshot taken (tree %s)", self.workspace, tree)

        async with self._lock:
            try:
                # Hashing a large tree can take long: a closing workspace does not wait for it
                # but kills its git command (the next open clears the lock it may leave).
                await trio.to_thread.run_sync(work, abandon_on_cancel=True)
            except trio.Cancelled:
                self.repo.kill()
                raise
            except (GitError, OSError) as exc:
                log.warning("first snapshot of %s failed: %s", self.workspace, exc)

    # -- runs

    @property
    def enabled(self) -> bool:
        return self._ready

    async def begin_run(self, session_id: str, run_ids: list[str]) -> None:
        """Register a run's turn as active; no snapshot yet (see :meth:`before_tool`)."""
        if self._ready:
            self._active[session_id] = _Active(list(run_ids))

    async def before_tool(self, session_id: str, tool_name: str) -> None:
        """Before a tool call: the run's "before" snapshot, if the tool may write and the run
        has none yet. Parallel calls of one run take one; each waits for it."""
        active = self._active.get(session_id)
        if active is None or tool_name in READ_ONLY_TOOLS:
            return
        async with active.lock:
            if active.before is not None or active.failed:
                return
            try:
                tree = await self._thread(self._snapshot_sync)
            except (GitError, OSError) as exc:
                log.warning("snapshot before run %s failed: %s", active.run_ids[0], exc)
                active.failed = True
                return
            active.before = active.last = tree

    async def after_tool(self, session_id: str, tool_call_id: str, tool_name: str) -> None:
        """Snapshot after a tool call that may write; publish ``files_changed`` if it did."""
        active = self._active.get(session_id)
        if active is None or tool_name in READ_ONLY_TOOLS or active.last is None:
            return
        last = active.last

        def work() -> tuple[str, list[FileChange], bool]:
            tree = self._snapshot_sync()
            if tree == last:
                return tree, [], False
            raw = self.repo.changes(last, tree)
            stats = self.repo.numstat(last, tree)
            files = _file_changes(raw[:MAX_DIFF_FILES], stats)
            return tree, files, len(raw) > MAX_DIFF_FILES

        try:
            tree, files, truncated = await self._thread(work)
        except (GitError, OSError) as exc:
            log.warning("snapshot after tool call %s failed: %s", tool_call_id, exc)
            return
        active.last = tree
        if files:
            self._publish(
                FilesChanged(
                    session_id, active.run_ids[0], tool_call_id, tool_name, files, truncated
                )
            )

    async def end_run(self, session_id: str, run_ids: list[str]) -> dict[str, list[FileChange]]:
        """Write the record of a run's turn (every run of the turn, ``run_ids``, gets it); the
        files each run changed. A run that made a tool call that may write is snapshotted now;
        one that made none records the latest known tree as its before and after, with no git
        command when that tree is already kept."""
        active = self._active.pop(session_id, None)
        if active is None or active.failed:
            return {}
        active.run_ids.extend(r for r in run_ids if r not in active.run_ids)
        before = active.before
        latest = self._latest

        def write(tree_before: str, after: str, keep: bool) -> ChangeRecord:
            for run_id in active.run_ids[1:]:
                self._write_record_sync(
                    run_id, session_id, "run", tree_before, after, None, keep=keep
                )
            return self._write_record_sync(
                active.run_ids[0], session_id, "run", tree_before, after, None, keep=keep
            )

        def work() -> ChangeRecord:
            if before is not None:
                return write(before, self._snapshot_sync(), True)
            # Read under the lock: a warm-up snapshot that was running has finished.
            tree = self._latest if self._latest is not None else self._snapshot_sync()
            return write(tree, tree, True)

        try:
            if before is None and latest is not None and latest in self._kept:
                # Nothing to snapshot or keep: no git, so no need to wait for the lock.
                record = await trio.to_thread.run_sync(write, latest, latest, False)
            else:
                record = await self._thread(work)
        except Exception as exc:  # a failed snapshot must not fail the run's end
            log.warning("snapshot after run %s failed: %s", active.run_ids[0], exc)
            return {}
        return {run_id: record.files for run_id in active.run_ids}

    def _write_record_sync(
        self,
        record_id: str,
        session_id: str,
        kind: str,
        before: str,
        after: str,
        reverts: str | None,
        *,
        keep: bool = True,
    ) -> ChangeRecord:
        """Write a record (``keep``: keep its trees; False: they are known to be kept)."""
        raw = self.repo.changes(before, after) if before != after else []
        stats = self.repo.numstat(before, after) if raw else {}
        record = ChangeRecord(
            id=record_id,
            session_id=session_id,
            kind=kind,
            before=before,
            after=after,
            created_at=now(),
            files=_file_changes(raw[:MAX_DIFF_FILES], stats),
            truncated=len(raw) > MAX_DIFF_FILES,
            reverts=reverts,
        )
        if keep:
            key = _key(record_id)
            self._keep_sync([(f"changes/{key}/before", before), (f"changes/{key}/after", after)])
        from ..wire import unstructure

        write_json_atomic(self._record_path(record_id), unstructure(record))
        index = self.root / "sessions"
        index.mkdir(exist_ok=True)
        with open(index / _key(session_id), "a", encoding="utf-8") as file:
            file.write(_key(record_id) + "\n")
        return record

    # -- reading

    def _load_record(self, record_id: str) -> ChangeRecord | None:
        return self._load_record_file(self._record_path(record_id))

    def _load_record_file(self, path: Path) -> ChangeRecord | None:
        try:
            data = read_json(path)
        except (OSError, ValueError):
            return None
        from ..wire import structure

        return structure(data, ChangeRecord, what="change record")

    async def record(self, record_id: str) -> ChangeRecord | None:
        """The change record of a run or revert (None: none was written)."""
        if not self._ready:
            return None
        return await trio.to_thread.run_sync(self._load_record, record_id)

    def _require_ready(self) -> None:
        if not self._ready:
            raise Conflict(self.error or "change tracking is not ready for this workspace")

    async def run_diff(self, record_id: str) -> Diff:
        """The diff of one run (or revert)."""
        self._require_ready()
        record = await self.record(record_id)
        if record is None:
            raise NotFound(
                f"no changes recorded for run {record_id!r}: it has not run yet, or it ran "
                "before change tracking"
            )
        diff = await self._answer(lambda: self._diff_sync(record.before, record.after, None))
        diff.run_id = record_id
        diff.session_id = record.session_id
        return diff

    def _session_records(self, session_id: str) -> list[str]:
        """The keys of a session's records (runs and reverts), in the order they were written."""
        try:
            text = (self.root / "sessions" / _key(session_id)).read_text()
        except OSError:
            return []
        return list(dict.fromkeys(line for line in text.splitlines() if _KEY.fullmatch(line)))

    async def session_diff(self, session_id: str) -> Diff:
        """The combined diff of a session's runs and reverts: from before the first to after
        the last, limited to the files they changed."""
        self._require_ready()

        def work() -> Diff:
            ids = self._session_records(session_id)[-MAX_SESSION_RECORDS:]
            records = [
                r
                for key in ids
                if (r := self._load_record_file(self.root / "records" / f"{key}.json")) is not None
            ]
            if not records:
                return Diff([], "", session_id=session_id)
            paths: set[str] = set()
            for record in records:
                if record.before != record.after:
                    paths.update(c.path for c in self.repo.changes(record.before, record.after))
            diff = self._diff_sync(records[0].before, records[-1].after, sorted(paths))
            diff.session_id = session_id
            return diff

        return await self._answer(work)

    def _diff_sync(self, before: str, after: str, paths: Sequence[str] | None) -> Diff:
        if before == after or (paths is not None and not paths):
            return Diff([], "")
        raw = self.repo.changes(before, after)
        if paths is not None:
            wanted = set(paths)
            raw = [c for c in raw if c.path in wanted]
        stats = self.repo.numstat(before, after)
        files = _file_changes(raw[:MAX_DIFF_FILES], stats)
        names = [c.path for c in raw]
        spec = None if paths is None or len(names) > MAX_DIFF_FILES else names
        patch = self.repo.patch(before, after, spec, MAX_DIFF_BYTES)
        truncated = len(raw) > MAX_DIFF_FILES or len(patch) > MAX_DIFF_BYTES
        text = patch[:MAX_DIFF_BYTES].decode(errors="replace")
        return Diff(files, text, truncated)

    # -- reverts

    async def revert(self, record_id: str, *, force: bool = False) -> RevertResult:
        """Put back every file the run changed as it was before the run.

        Raises:
            NotFound: no record for ``record_id``.
            RevertConflict: a file changed after the run (and ``force`` is false).
        """
        self._require_ready()
        return await self._answer(lambda: self._revert_sync(record_id, force))

    def _revert_sync(self, record_id: str, force: bool) -> RevertResult:
        record = self._load_record(record_id)
        if record is None:
            raise NotFound(f"no changes recorded for run {record_id!r}; nothing to revert")
        current = self._snapshot_sync()
        changed = (
            self.repo.changes(record.before, record.after) if record.before != record.after else []
        )
        paths = [c.path for c in changed]
        later = (
            {c.path for c in self.repo.changes(record.after, current)}
            if current != record.after
            else set()
        )
        conflicts = sorted(display_path(p) for p in paths if p in later)
        if conflicts and not force:
            shown = conflicts[:MAX_CONFLICT_FILES]
            more = (
                f" (and {len(conflicts) - len(shown)} more)" if len(conflicts) > len(shown) else ""
            )
            raise RevertConflict(
                f"{len(conflicts)} file(s) changed after run {record_id}: "
                f"{', '.join(shown)}{more}; "
                'revert later runs first, or send {"force": true} to overwrite them',
                shown,
            )
        was = self.repo.entries(current, paths)
        revert_id = "revert-" + new_id()
        journal: dict[str, Any] = {
            "revert_id": revert_id,
            "run_id": record_id,
            "session_id": record.session_id,
            "state": "started",
            "forced": force,
            "conflicts": conflicts[:MAX_CONFLICT_FILES],
            "before": current,
            "created_at": now(),
            "finished_at": None,
            "error": "",
            "files": [
                {
                    "path": display_path(c.path),
                    "raw": os.fsencode(c.path).hex(),
                    "status": _STATUS.get(c.status, "modified"),
                    "target": _entry_json(c.old),
                    "was": _entry_json(was.get(c.path)),
                    "outcome": "",
                }
                for c in changed
            ],
        }
        write_json_atomic(self._journal_path(revert_id), journal)
        errors = []
        for i, change in enumerate(changed):
            item = journal["files"][i]
            try:
                restore_file(
                    self.workspace, change.path, change.old, self.repo.blob, temp_name(revert_id, i)
                )
                item["outcome"] = "new"
            except (OSError, UnsafePath, GitError) as exc:
                remove_temp(self.workspace, change.path, temp_name(revert_id, i))
                item["outcome"] = "old"
                errors.append(f"{display_path(change.path)}: {exc}")
        after = self._snapshot_sync()
        self._write_record_sync(revert_id, record.session_id, "revert", current, after, record_id)
        journal["state"] = "failed" if errors else "done"
        journal["error"] = "; ".join(errors)[:2000]
        journal["finished_at"] = now()
        write_json_atomic(self._journal_path(revert_id), journal)
        return _result(journal)

    async def revert_record(self, revert_id: str) -> RevertResult | None:
        """The journal of a revert (its outcome), or None."""
        if not self._ready:
            return None

        def load() -> RevertResult | None:
            try:
                return _result(read_json(self._journal_path(revert_id)))
            except (OSError, ValueError, KeyError):
                return None

        return await trio.to_thread.run_sync(load)


def _entry_json(entry: Entry | None) -> list[str] | None:
    return None if entry is None else [entry.mode, entry.sha]


def _same(entry: Entry | None, stored: list[str] | None) -> bool:
    if entry is None or stored is None:
        return entry is None and stored is None
    return [entry.mode, entry.sha] == stored


def _result(journal: dict[str, Any]) -> RevertResult:
    return RevertResult(
        revert_id=journal["revert_id"],
        run_id=journal["run_id"],
        session_id=journal["session_id"],
        state=journal["state"],
        forced=bool(journal.get("forced")),
        files=[RevertFile(f["path"], f["status"], f.get("outcome", "")) for f in journal["files"]],
        conflicts=list(journal.get("conflicts") or []),
        error=journal.get("error", ""),
        created_at=journal.get("created_at", 0),
        finished_at=journal.get("finished_at"),
    )


__all__ = [
    "EMPTY_TREE",
    "ChangeLog",
    "ChangeRecord",
    "Diff",
    "RevertConflict",
    "RevertFile",
    "RevertResult",
]
