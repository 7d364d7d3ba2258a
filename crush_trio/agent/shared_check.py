"""A blocking check that concurrent callers share: one worker thread for a burst of turns.

Each turn starts by asking the file system whether the workspace changed (the context files'
signature, the places git looks for a repository). Fifty turns that start together asked fifty
times, one worker thread each, queued behind each other's stats and the GIL: under such a burst a
check cost a turn 10-15 ms before its model request went out.

:class:`SharedCheck` runs at most one check at a time. A caller waits for the next check that
starts after it arrived, so its answer is never older than its question; every caller that
arrives while a check runs shares the one that starts when it ends. A burst of fifty turns then
runs two or three checks instead of fifty.

The thread is not owned by any caller (``trio.lowlevel.start_thread_soon``): a caller that is
cancelled stops waiting at once (a file system that hangs cannot hold a cancelled turn or a
closing workspace), and the check finishes in the background for the callers still waiting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar

import trio

if TYPE_CHECKING:
    from collections.abc import Callable

    import outcome

T = TypeVar("T")
A = TypeVar("A")


class _Run(Generic[A, T]):
    """One check: its argument, and its outcome once the thread delivered it."""

    __slots__ = ("arg", "done", "error", "value")

    def __init__(self, arg: A) -> None:
        self.arg = arg
        self.done = trio.Event()
        self.value: T | None = None
        self.error: BaseException | None = None


class SharedCheck(Generic[A, T]):
    """``fn(arg)`` run in a worker thread on behalf of every caller waiting for it (see the
    module's docstring). Callers that pass an argument unequal to the waiting run's get a run of
    their own, after it."""

    def __init__(self, fn: Callable[[A], T]) -> None:
        self._fn = fn
        self._running: _Run[A, T] | None = None
        #: The run that starts when the running one ends; callers that arrive now share it.
        self._next: _Run[A, T] | None = None
        #: Runs started (tests and metrics).
        self.runs = 0

    async def __call__(self, arg: A) -> T:
        """``fn(arg)`` as computed by a run that started after this call.

        Raises:
            Whatever ``fn`` raised in that run.
        """
        run = self._next
        if run is None or run.arg != arg:
            run = _Run(arg)
            if self._running is None:
                self._start(run)
            elif self._next is None:
                self._next = run
            else:  # another argument is waiting: this one goes on its own, after the running one
                await self._running.done.wait()
                return await self(arg)
        await run.done.wait()
        if run.error is not None:
            raise run.error
        return run.value  # type: ignore[return-value]  # set with done, unless error is

    def _start(self, run: _Run[A, T]) -> None:
        self._running = run
        self.runs += 1
        token = trio.lowlevel.current_trio_token()

        def deliver(result: outcome.Outcome[T]) -> None:
            try:
                token.run_sync_soon(self._finished, run, result)
            except trio.RunFinishedError:
                pass  # the event loop ended first: nobody is waiting any more

        trio.lowlevel.start_thread_soon(lambda: self._fn(run.arg), deliver, name="shared check")

    def _finished(self, run: _Run[A, T], result: outcome.Outcome[T]) -> None:
        try:  # unwrapped once, here: each caller gets the value or raises the error
            run.value = result.unwrap()
        except BaseException as exc:  # the check's own error, for its callers
            run.error = exc
        run.done.set()
        self._running = None
        waiting, self._next = self._next, None
        if waiting is not None:
            self._start(waiting)
