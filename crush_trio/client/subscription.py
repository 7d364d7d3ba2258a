"""Subscriptions: every event of a workspace, from :meth:`WorkspaceClient.subscribe
<crush_trio.client.WorkspaceClient.subscribe>`.

A subscription reads its own :class:`~crush_trio.client.events.Mailbox`, which the workspace's
event stream fills; it ends when the ``subscribe`` block ends, or with the stream's error when
the stream is gone for good.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .errors import CrushError, Unreachable
from .events import Event, Mailbox
from .runs import DEFAULT_RUN_TIMEOUT, deadline_after, deadline_scope

#: What :meth:`Subscription.until` and :meth:`Subscription.collect_until` test each event with.
EventPredicate = Callable[[Event], object]


class StreamState(Protocol):
    """What a subscription reads of its workspace
    (:class:`~crush_trio.client.WorkspaceClient` keeps it)."""

    @property
    def id(self) -> str:
        """The workspace's id."""
        ...

    @property
    def stream_error(self) -> CrushError | None:
        """Why the workspace's event stream ended for good (None: it has not)."""
        ...


class Subscription:
    """The events of a workspace, from :meth:`WorkspaceClient.subscribe`."""

    def __init__(self, workspace: StreamState, mailbox: Mailbox, timeout: float | None) -> None:
        self._workspace = workspace
        self._mailbox = mailbox
        self._timeout = timeout

    @property
    def dropped(self) -> int:
        return self._mailbox.dropped

    async def next(self, timeout: float | None = DEFAULT_RUN_TIMEOUT) -> Event:  # noqa: ASYNC109
        """The next event.

        Raises:
            Timeout: none arrived within ``timeout`` seconds.
            Unreachable: the stream is gone for good (or the subscription ended).
        """
        event = await self._get(timeout)
        if event is None:
            raise self._ended()
        return event

    def _ended(self) -> CrushError:
        return self._workspace.stream_error or Unreachable(
            f"the subscription to workspace {self._workspace.id} has ended"
        )

    async def _get(self, timeout: float | None) -> Event | None:  # noqa: ASYNC109
        with deadline_scope(
            deadline_after(timeout),
            lambda: f"no event of workspace {self._workspace.id} within {timeout:g} s",
        ):
            return await self._mailbox.get()

    async def until(
        self,
        predicate: EventPredicate,
        timeout: float | None = DEFAULT_RUN_TIMEOUT,  # noqa: ASYNC109
    ) -> Event:
        """The first event for which ``predicate(event)`` is true; the events before it are
        consumed and dropped (:meth:`collect_until` keeps them).

        Raises:
            Timeout: no event matched within ``timeout`` seconds (for the whole wait).
            Unreachable: the stream is gone for good (or the subscription ended).
        """
        return (await self._collect(predicate, timeout, keep=False))[-1]

    async def collect_until(
        self,
        predicate: EventPredicate,
        timeout: float | None = DEFAULT_RUN_TIMEOUT,  # noqa: ASYNC109
    ) -> list[Event]:
        """Every event up to and including the first for which ``predicate(event)`` is true, in
        the order received (the events that do not match are kept, not skipped).

        Raises:
            Timeout: no event matched within ``timeout`` seconds (for the whole wait); the events
                received until then are consumed.
            Unreachable: the stream is gone for good (or the subscription ended).
        """
        return await self._collect(predicate, timeout, keep=True)

    async def _collect(
        self,
        predicate: EventPredicate,
        timeout: float | None,  # noqa: ASYNC109
        *,
        keep: bool,
    ) -> list[Event]:
        seen: list[Event] = []
        others = 0

        def describe() -> str:
            return (
                f"no event of workspace {self._workspace.id} matched {_describe(predicate)} "
                f"within {timeout:g} s ({others} other event(s) received)"
            )

        with deadline_scope(deadline_after(timeout), describe):
            while True:
                event = await self._mailbox.get()
                if event is None:
                    raise self._ended()
                matched = predicate(event)
                if keep or matched:
                    seen.append(event)
                if matched:
                    return seen
                others += 1

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Event:
        event = await self._get(self._timeout)
        if event is None:
            if self._workspace.stream_error is not None:
                raise self._workspace.stream_error
            raise StopAsyncIteration
        return event


def _describe(predicate: EventPredicate) -> str:
    """How a Timeout names the predicate that was awaited: its name, or where a lambda is."""
    name = getattr(predicate, "__qualname__", None) or repr(predicate)
    code = getattr(predicate, "__code__", None)
    if name.endswith("<lambda>") and code is not None:
        return f"the predicate at {code.co_filename}:{code.co_firstlineno}"
    return name
