"""Run records: the in-memory book of live runs in front of the store.

A run record is created when a prompt is accepted (``queued`` or ``running``) and ends
``completed``, ``failed`` or ``cancelled``. Live runs are answered from memory (so ``GET runs/{id}``
is right the moment a prompt is accepted); every change marks the run dirty and a writer task saves
it. Terminal states are saved at once by the run's owner inside a shielded, time-bounded scope
(:meth:`RunBook.save_now`).

Durable acceptance (docs/protocol.md "Durability of an accepted prompt"): a new run's record and
its prompt text are inserted by the same writer, and :meth:`RunBook.wait_inserted` returns once
that transaction committed; the request handler answers 202 only then. Every run made dirty
while a transaction is in flight goes into the next one, so a burst of prompts shares a few
commits (group commit) instead of one each.

Memory: the prompt text is held only until its insert commits (the agent's queue keeps its own
copy while the run waits). Finished runs stay in memory after their final save, for quick
``GET runs/{id}`` answers, up to :data:`RECENT_RUNS_KEPT` runs and :data:`RECENT_RUNS_BYTES` bytes
of text; older ones are read from the store.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Final

import attrs
import trio

from ..errors import Fenced, StoreError
from ..wire import Run, RunStatus, check_run_transition, now

if TYPE_CHECKING:
    from ..core.ports import WorkspaceStore

log = logging.getLogger(__name__)

#: Finished runs kept in memory after they were saved (older ones are read from the store).
RECENT_RUNS_KEPT: Final = 1000
#: Bound on the text (reply and error, UTF-8 bytes) of the finished runs kept in memory.
RECENT_RUNS_BYTES: Final = 8 * 1024 * 1024


@attrs.define(eq=False)
class _Insert:
    """A new run waiting for the commit of its record: set when committed (or when it failed)."""

    prompt: str
    done: trio.Event = attrs.field(factory=trio.Event)
    error: BaseException | None = None


def _text_bytes(run: Run) -> int:
    return len(run.text.encode()) + len((run.error or "").encode())


class RunBook:
    """Live and recently finished runs of one workspace."""

    def __init__(self, store: WorkspaceStore) -> None:
        self._store = store
        self._runs: dict[str, Run] = {}
        #: Finished, saved runs still in memory, oldest first, with their text's size.
        self._recent: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._recent_bytes = 0
        self._dirty: dict[str, Run] = {}
        #: New runs whose record is not committed yet (their prompt text is held here until then).
        self._inserts: dict[str, _Insert] = {}
        self._wake = trio.Event()
        #: Transactions that saved run records (tests and benchmarks read it).
        self.commits = 0

    def known(self, run_id: str) -> bool:
        return run_id in self._runs

    def get(self, run_id: str) -> Run | None:
        return self._runs.get(run_id)

    def add(self, run: Run, prompt: str = "") -> None:
        """A newly accepted run: its record (with ``prompt``) goes into the next transaction;
        :meth:`wait_inserted` tells when it committed."""
        self._runs[run.run_id] = run
        self._inserts[run.run_id] = _Insert(prompt)
        self._mark(run)

    async def wait_inserted(self, run_id: str) -> None:
        """Return once the record of ``run_id`` (added with :meth:`add`) is committed.

        Raises:
            StoreError: the transaction that carried it failed (the writer retries it later).
        """
        insert = self._inserts.get(run_id)
        if insert is None:
            await trio.lowlevel.checkpoint()
            return
        await insert.done.wait()
        if insert.error is not None:
            raise StoreError(
                f"run {run_id!r} could not be saved ({insert.error}); the prompt was not "
                "accepted: send it again (if this repeats, check the data directory's disk)"
            ) from insert.error

    def fail_pending_inserts(self, why: str) -> None:
        """The store is going away: every handler still waiting for a record's commit gets an
        error (no 202) instead of waiting forever."""
        for insert in self._inserts.values():
            if not insert.done.is_set():
                insert.error = StoreError(why)
                insert.done.set()
        self._inserts.clear()

    @property
    def inserts_pending(self) -> int:
        """New runs whose record is not committed yet."""
        return len(self._inserts)

    def set_status(
        self,
        run: Run,
        status: RunStatus,
        *,
        message_id: str | None = None,
        text: str | None = None,
        error: str | None = None,
    ) -> None:
        """Move ``run`` to ``status`` (checked against the allowed transitions)."""
        if status is not run.status:
            check_run_transition(run.run_id, run.status, status)
            run.status = status
        if message_id is not None:
            run.message_id = message_id
        if text is not None:
            run.text = text
        if error is not None:
            run.error = error
        if status.terminal:
            run.finished_at = now()
        self._mark(run)

    def _mark(self, run: Run) -> None:
        self._dirty[run.run_id] = run
        self._wake.set()

    async def save_now(self) -> None:
        """Write every dirty run now (callers shield this with a timeout when it is final)."""
        while self._dirty:
            batch = list(self._dirty.values())
            self._dirty.clear()
            inserts = {r.run_id: i for r in batch if (i := self._inserts.get(r.run_id))}
            prompts = {run_id: insert.prompt for run_id, insert in inserts.items()}
            try:
                await self._store.save_runs(batch, prompts)
            except BaseException as exc:
                for run in batch:
                    self._dirty.setdefault(run.run_id, run)
                if isinstance(exc, trio.Cancelled):
                    self._wake.set()  # a caller gave up (timeout): the writer takes over
                else:
                    # The waiting handlers answer with an error (no 202); the records stay
                    # dirty and are retried with the next change.
                    for insert in inserts.values():
                        if not insert.done.is_set():
                            insert.error = exc
                            insert.done.set()
                raise
            self.commits += 1
            for run_id, insert in inserts.items():
                if self._inserts.get(run_id) is insert:
                    del self._inserts[run_id]
                insert.done.set()
            for run in batch:
                if run.status.terminal:
                    self._retire(run)

    def _retire(self, run: Run) -> None:
        size = _text_bytes(run)
        self._recent_bytes += size - self._recent.pop(run.run_id, 0)
        self._recent[run.run_id] = size
        while self._recent and (
            len(self._recent) > RECENT_RUNS_KEPT or self._recent_bytes > RECENT_RUNS_BYTES
        ):
            old, old_size = self._recent.popitem(last=False)
            self._recent_bytes -= old_size
            stale = self._runs.get(old)
            if stale is not None and stale.status.terminal and old not in self._dirty:
                del self._runs[old]

    async def writer(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Save dirty runs as they change. Runs until cancelled; :meth:`save_now` finishes up."""
        task_status.started()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            try:
                await self.save_now()
            except trio.Cancelled:
                raise
            except Fenced as exc:  # another node owns the workspace, which is stopping
                log.warning("run records not saved: %s", exc)
            except Exception:
                log.exception("saving run records failed; will retry on the next change")
