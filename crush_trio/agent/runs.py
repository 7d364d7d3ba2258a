"""Run records: the in-memory book of live runs in front of the store.

A run record is created when a prompt is accepted (``queued`` or ``running``) and ends
``completed``, ``failed`` or ``cancelled``. Live runs are answered from memory (so ``GET runs/{id}``
is right the moment a prompt is accepted, before any disk write); every change marks the run dirty
and a writer task saves it. Terminal states are saved at once by the run's owner inside a shielded,
time-bounded scope (:meth:`RunBook.save_now`).
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Final

import trio

from ..wire import Run, RunStatus, check_run_transition, now

if TYPE_CHECKING:
    from ..store import Store

log = logging.getLogger(__name__)

#: Finished runs kept in memory after they were saved (older ones are read from the store).
RECENT_RUNS_KEPT: Final = 1000


class RunBook:
    """Live and recently finished runs of one workspace."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._runs: dict[str, Run] = {}
        self._recent: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._dirty: dict[str, Run] = {}
        self._wake = trio.Event()
        self._writes_in_flight = 0

    def known(self, run_id: str) -> bool:
        return run_id in self._runs

    def get(self, run_id: str) -> Run | None:
        return self._runs.get(run_id)

    def add(self, run: Run) -> None:
        self._runs[run.run_id] = run
        self._mark(run)

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
            self._writes_in_flight += 1
            try:
                await self._store.save_runs(batch)
            except BaseException:
                for run in batch:
                    self._dirty.setdefault(run.run_id, run)
                raise
            finally:
                self._writes_in_flight -= 1
            for run in batch:
                if run.status.terminal:
                    self._retire(run)

    def _retire(self, run: Run) -> None:
        self._recent[run.run_id] = None
        self._recent.move_to_end(run.run_id)
        while len(self._recent) > RECENT_RUNS_KEPT:
            old, _ = self._recent.popitem(last=False)
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
            except Exception:
                log.exception("saving run records failed; will retry on the next change")


async def save_run(store: Store, run: Run) -> None:
    """Insert or update one run record."""
    await store.save_run(run)
