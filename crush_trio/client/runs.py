"""Run handles: one prompt's events and its final record.

:meth:`WorkspaceClient.prompt <crush_trio.client.WorkspaceClient.prompt>` registers a
:class:`RunHandle` *before* it sends the prompt, so no event of the run can be missed, then the
workspace's event stream offers it every event of the workspace. The handle keeps only those that
belong to its run, by these rules (the same as ``crush-trio run``'s):

* ``run_complete`` ends the run when its ``run_id`` is the handle's. Another run's
  ``run_complete`` never does, whatever its session.
* ``agent_event``: when it has a ``run_id``, only if it is ours; without one, only if its
  ``session_id`` is ours; with neither, never. Error events that pass are kept in
  :attr:`RunHandle.errors`.
* ``message`` events (and ``message_delta`` events, each with the whole message it leads to in
  :attr:`Event.message <crush_trio.client.Event.message>`) carry no run id. The turn of this run
  begins with its own user message (the prompt text, unchanged), so the handle takes the
  session's messages from the first user message equal to its prompt until its
  ``run_complete``; earlier messages belong to turns queued before it. If a ``run_complete`` of
  another run names a message the handle took, the handle was wrong (an identical prompt of
  another client ran first) and starts over.
* ``permission_request`` is ours when its ``tool_call_id`` is a tool call of one of our turn's
  assistant messages (the tool call is stored and published before its tool asks). One that
  matches nothing yet is held back and the session's messages are re-read over HTTP (the
  ``message`` event with the call may have been dropped); it is passed on once it matches. So
  ``auto_approve`` never answers another run's request, even in the same session.

The logic here is synchronous; the workspace's event stream does the I/O it asks for (refetches,
grants) through the small protocol :class:`RunFeed`.
"""

from __future__ import annotations

import collections
import math
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

import attrs
import trio

from ..wire import (
    AcceptedPrompt,
    AgentEvent,
    Message,
    PermissionNotification,
    PermissionRequest,
    Role,
    Run,
    RunComplete,
    RunStatus,
    now,
)
from .errors import CrushError, RunFailed, Timeout
from .events import DEFAULT_MAILBOX_SIZE, MESSAGE_DELTA, Event, Mailbox

if TYPE_CHECKING:
    from collections.abc import Iterator

#: Default bound on waiting for a run's end or its next event (seconds).
DEFAULT_RUN_TIMEOUT: Final = 600.0

GrantAction = Literal["allow", "allow_session", "deny"]


class RunRecords(Protocol):
    """What a run handle asks of its workspace over HTTP
    (:class:`~crush_trio.client.WorkspaceClient` keeps it)."""

    async def get_run(self, run_id: str) -> Run:
        """The run's record."""
        ...

    async def cancel_run(self, run_id: str) -> bool:
        """Cancel the run; False when it had ended already."""
        ...


class RunFeed(Protocol):
    """What a run handle asks of the event stream that offers it events
    (:class:`~crush_trio.client.stream.EventStream`). Each call returns at once."""

    def resync(self, handle: RunHandle, *, messages: bool) -> None:
        """Re-read the run's record (and its session's messages) over HTTP: events may be lost."""

    def grant_soon(self, permission_id: str, action: GrantAction) -> None:
        """Answer a permission request of the run (``auto_approve``)."""

    def forget(self, handle: RunHandle) -> None:
        """The run has ended: offer it no more events."""


@attrs.frozen
class Route:
    """Which run handles an event can concern (see :func:`route_of`): the handle of ``run_id``,
    else the handles of ``session_id``, else (both None) every handle."""

    run_id: str | None = None
    session_id: str | None = None


#: The route of an event every handle is offered (``gap``, ``permission_notification``).
EVERY_HANDLE: Final = Route()


def route_of(event: Event) -> Route | None:
    """The handles :meth:`RunHandle.offer` may keep ``event`` for, by the rules in the module
    docstring; None when no handle keeps it. The event stream offers an event only to these, so
    an event costs the handles of its session, not every run the client follows."""
    payload = event.payload
    kind = event.type
    if kind == "message" or kind == MESSAGE_DELTA:
        message = event.message
        return None if message is None else Route(session_id=message.session_id)
    if kind == "run_complete" or kind == "permission_request":
        return Route(session_id=payload.session_id)
    if kind == "agent_event":
        if payload.run_id:
            return Route(run_id=payload.run_id)
        return Route(session_id=payload.session_id) if payload.session_id else None
    if kind == "gap" or kind == "permission_notification":
        return EVERY_HANDLE
    return None


def is_own_agent_event(event: AgentEvent, run_id: str, session_id: str) -> bool:
    """The filtering rule for ``agent_event`` (issue "its own run only")."""
    if event.run_id:
        return event.run_id == run_id
    if event.session_id:
        return event.session_id == session_id
    return False


def status_of(complete: RunComplete) -> RunStatus:
    if complete.cancelled:
        return RunStatus.CANCELLED
    if complete.error:
        return RunStatus.FAILED
    return RunStatus.COMPLETED


def complete_of(run: Run) -> RunComplete:
    """The ``run_complete`` a terminal run record stands for."""
    return RunComplete(
        run.session_id,
        run.run_id,
        run.message_id,
        run.text,
        run.error,
        cancelled=run.status is RunStatus.CANCELLED,
    )


@contextmanager
def deadline_scope(deadline: float, describe: Any) -> Iterator[None]:
    """``trio.fail_at`` raising our :class:`Timeout` with the message ``describe()`` returns.

    Without a deadline (``math.inf``) no cancel scope is made: waits without a timeout are the
    common case when following events, and a scope costs more than taking an event that is
    already queued.
    """
    if deadline == math.inf:
        yield
        return
    try:
        with trio.fail_at(deadline):
            yield
    except trio.TooSlowError:
        raise Timeout(describe()) from None


def deadline_after(timeout: float | None) -> float:
    return math.inf if timeout is None else trio.current_time() + timeout


class RunHandle:
    """One prompt sent to a session: its events, its result, and control over it.

    Do not create one yourself; :meth:`WorkspaceClient.prompt` returns it.

    Attributes:
        run_id, session_id, prompt: what was sent.
        accepted: the server's answer (``status`` is ``running`` or ``queued``).
        auto_approve: answer this run's permission requests with ``allow``.
        messages: the messages of this run's turn seen so far, latest version of each.
        errors: error ``agent_event`` payloads that belong to this run.
        complete: the ``run_complete`` (or the one its refetched record stands for).
    """

    def __init__(
        self,
        workspace: RunRecords,
        session_id: str,
        run_id: str,
        prompt: str,
        *,
        feed: RunFeed,
        auto_approve: bool = False,
        mailbox_size: int = DEFAULT_MAILBOX_SIZE,
    ) -> None:
        self.workspace = workspace
        self._feed = feed
        self.session_id = session_id
        self.run_id = run_id
        self.prompt = prompt
        self.auto_approve = auto_approve
        self.accepted: AcceptedPrompt | None = None
        self.started = False
        self.messages: dict[str, Message] = {}
        self.errors: list[AgentEvent] = []
        self.permission_requests: dict[str, PermissionRequest] = {}
        self._asked: collections.deque[PermissionRequest] = collections.deque()
        self._asked_wakeup = trio.Event()
        self.complete: RunComplete | None = None
        self.events_received = 0
        self._unconfirmed: list[Event] = []
        self._record: Run | None = None
        self._record_final = False
        self._terminal: Event | None = None
        self._failure: CrushError | None = None
        self._mailbox = Mailbox(mailbox_size)
        self._done = trio.Event()
        self._events_taken = False

    def __repr__(self) -> str:
        return f"<RunHandle run_id={self.run_id!r} session_id={self.session_id!r} {self.status}>"

    # -- state ----------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once the run ended (or its stream was lost for good)."""
        return self._done.is_set()

    @property
    def status(self) -> str:
        """The last status this client knows: ``queued``/``running`` until the run ends."""
        if self.complete is not None:
            return status_of(self.complete).value
        if self._failure is not None:
            return "unknown (event stream lost)"
        if self.started:
            return "running"
        return self.accepted.status if self.accepted is not None else "sending"

    @property
    def text(self) -> str:
        """The reply: the final text once done, else the newest assistant message's text."""
        if self.complete is not None:
            return self.complete.text
        for msg in reversed(list(self.messages.values())):
            if msg.role is Role.ASSISTANT:
                return msg.text()
        return ""

    def _describe_wait(self, what: str, timeout: float | None) -> str:
        return (
            f"run {self.run_id!r} (session {self.session_id}) did not {what} within "
            f"{timeout:g} s: its last known status is {self.status}, {self.events_received} of "
            f"its events were received. The run goes on on the server: wait longer, or cancel it "
            f"with RunHandle.cancel()"
        )

    # -- routing (called by the event stream's reader task; never blocks) -------------------------

    def offer(self, event: Event) -> None:
        """Take ``event`` if it belongs to this run (see the module docstring). The event
        stream offers an event only to the handles of its :func:`route_of`; this method keeps
        the whole rule, so offering it to any other handle changes nothing."""
        if self.done:
            return
        payload = event.payload
        if event.type == "run_complete":
            assert isinstance(payload, RunComplete)
            if payload.run_id == self.run_id:
                self._finish(event, payload)
            elif payload.session_id == self.session_id and payload.message_id in self.messages:
                # Another run's turn was taken for ours (it began with an identical prompt).
                self.messages.clear()
                self.started = False
        elif event.type == "agent_event":
            assert isinstance(payload, AgentEvent)
            if is_own_agent_event(payload, self.run_id, self.session_id):
                if payload.type == "error":
                    self.errors.append(payload)
                self._deliver(event)
        elif event.type == "message" or event.type == MESSAGE_DELTA:
            message = event.message
            if message is not None and message.session_id == self.session_id:
                self._offer_message(event, message)
        elif event.type == "permission_request":
            assert isinstance(payload, PermissionRequest)
            if payload.session_id == self.session_id:
                if payload.tool_call_id in self._own_tool_calls():
                    self._accept_permission(event, payload)
                else:
                    self._unconfirmed.append(event)
                    self._feed.resync(self, messages=True)
        elif event.type == "permission_notification":
            assert isinstance(payload, PermissionNotification)
            if any(
                r.tool_call_id == payload.tool_call_id for r in self.permission_requests.values()
            ):
                self._deliver(event)
        elif event.type == "gap":
            self._deliver(event)

    def _offer_message(self, event: Event, msg: Message) -> None:
        if not self.started:
            if msg.role is Role.USER and msg.text() == self.prompt:
                self.started = True
            else:
                return
        self.messages[msg.id] = msg
        self._deliver(event)
        if self._unconfirmed and msg.tool_calls():
            self._match_permissions()

    def _own_tool_calls(self) -> set[str]:
        return {
            call.id
            for msg in self.messages.values()
            if msg.role is Role.ASSISTANT
            for call in msg.tool_calls()
        }

    def _match_permissions(self) -> None:
        """Pass on held-back permission requests that turned out to be ours."""
        calls = self._own_tool_calls()
        waiting, self._unconfirmed = self._unconfirmed, []
        for event in waiting:
            assert isinstance(event.payload, PermissionRequest)
            if event.payload.tool_call_id in calls:
                self._accept_permission(event, event.payload)
            else:
                self._unconfirmed.append(event)

    def _accept_permission(self, event: Event, request: PermissionRequest) -> None:
        self.permission_requests[request.id] = request
        self._asked.append(request)
        self._asked_wakeup.set()
        self._deliver(event)
        if self.auto_approve:
            self._feed.grant_soon(request.id, "allow")

    def _deliver(self, event: Event) -> None:
        self.events_received += 1
        self._mailbox.put(event)

    def _finish(self, event: Event, complete: RunComplete) -> None:
        self.complete = complete
        self._terminal = event
        self._record = Run(
            complete.run_id,
            complete.session_id,
            status_of(complete),
            complete.message_id,
            complete.text,
            complete.error,
            finished_at=now(),
        )
        self.events_received += 1
        self._mailbox.close()
        self._done.set()
        self._asked_wakeup.set()
        self._feed.forget(self)

    # -- refetched state (called by the event stream's resync task) -------------------------------

    def refetched_run(self, run: Run) -> None:
        """The run record read over HTTP after events may have been missed."""
        if self.done:
            return
        if run.status.terminal:
            self._finish(Event("run_complete", complete_of(run), None, "created"), complete_of(run))
            self._record, self._record_final = run, True

    def refetched_messages(self, history: list[Message]) -> None:
        """The session's messages read over HTTP: pass on what of our turn was missed."""
        if self.done:
            return
        start = None
        for index in range(len(history) - 1, -1, -1):
            msg = history[index]
            if msg.role is Role.USER and msg.text() == self.prompt:
                start = index
                break
        if start is None:
            return
        self.started = True
        for msg in history[start:]:
            old = self.messages.get(msg.id)
            if old is None or _newer(old, msg):
                self.messages[msg.id] = msg
                self._deliver(Event("message", msg, None, "updated"))
        if self._unconfirmed:
            self._match_permissions()

    def fail(self, error: CrushError) -> None:
        """The event stream is gone for good: every wait on this run raises ``error``."""
        if self.done:
            return
        self._failure = error
        self._mailbox.close()
        self._done.set()
        self._asked_wakeup.set()
        self._feed.forget(self)

    # -- consumer API ----------------------------------------------------------------------------

    def events(self, timeout: float | None = DEFAULT_RUN_TIMEOUT) -> RunEvents:
        """Iterate this run's events: ``async for event in handle.events(): ...``.

        The last event is the run's ``run_complete`` (``seq`` is ``None`` when it was rebuilt
        from the run record after missed events). Iterate once: the events are consumed.

        Args:
            timeout: bound on the whole iteration (seconds); ``None`` waits as long as it takes.

        Raises:
            Timeout: the run did not end in time.
            Unreachable: the event stream was lost and could not be re-established.
        """
        if self._events_taken:
            raise RuntimeError(f"events of run {self.run_id!r} are already being iterated")
        self._events_taken = True
        return RunEvents(self, timeout)

    async def wait(self, timeout: float | None = DEFAULT_RUN_TIMEOUT) -> None:  # noqa: ASYNC109
        """Wait until the run has ended (or its stream was lost).

        Raises:
            Timeout: it did not end within ``timeout`` seconds.
        """
        with deadline_scope(deadline_after(timeout), lambda: self._describe_wait("end", timeout)):
            await self._done.wait()

    async def next_permission_request(
        self,
        timeout: float | None = DEFAULT_RUN_TIMEOUT,  # noqa: ASYNC109
    ) -> PermissionRequest | None:
        """The next permission request of this run, to answer with
        :meth:`WorkspaceClient.grant`; ``None`` once the run has ended and every request it made
        has been returned.

        Only this run's own requests are returned (see the module docstring), each once, in the
        order they were asked; :attr:`permission_requests` keeps all of them. This does not
        consume :meth:`events`: a request is seen by both.

        Raises:
            Timeout: the run neither asked nor ended within ``timeout`` seconds.
            Unreachable: the event stream was lost and the run could not be followed.
        """
        with deadline_scope(
            deadline_after(timeout),
            lambda: self._describe_wait("ask for permission or end", timeout),
        ):
            while not self._asked:
                if self.done:
                    if self._failure is not None:
                        raise self._failure
                    return None
                self._asked_wakeup = trio.Event()
                await self._asked_wakeup.wait()
        return self._asked.popleft()

    async def result(
        self,
        timeout: float | None = DEFAULT_RUN_TIMEOUT,  # noqa: ASYNC109
        *,
        check: bool = True,
    ) -> Run:
        """The run's final record, once it has ended.

        A cancelled run is a result, not an error (``status == "cancelled"``).

        Args:
            timeout: bound on the wait, including the final ``GET runs/{id}`` (seconds).
            check: raise :class:`RunFailed` for a failed run (else return its record).

        Raises:
            Timeout: the run did not end in time.
            RunFailed: the run failed (``check=True``); ``exc.run`` is the record.
            Unreachable: the event stream was lost and could not be re-established.
        """
        deadline = deadline_after(timeout)
        await self.wait(timeout)
        if self._failure is not None:
            raise self._failure
        assert self._record is not None
        if not self._record_final:
            remaining = max(0.0, deadline - trio.current_time())
            with trio.move_on_after(remaining):
                try:
                    record = await self.workspace.get_run(self.run_id)
                except CrushError:
                    pass  # keep the record built from run_complete
                else:
                    if record.status.terminal:
                        self._record, self._record_final = record, True
        run = self._record
        if check and run.status is RunStatus.FAILED:
            raise RunFailed(f"run {run.run_id!r} failed: {run.error}", run)
        return run

    async def cancel(self) -> None:
        """Ask the server to cancel this run (it then ends with a cancelled ``run_complete``).

        Only this run is cancelled (``POST runs/{run_id}/cancel``): dropped from the queue if it
        is waiting, or its turn stopped if it runs; other prompts of the session go on. A run that
        already ended is left alone.
        """
        if self.done:
            return
        await self.workspace.cancel_run(self.run_id)


def _newer(old: Message, new: Message) -> bool:
    if len(new.parts) != len(old.parts):
        return len(new.parts) > len(old.parts)
    if new.finish() is not None and old.finish() is None:
        return True
    old_text, new_text = old.text(), new.text()
    return len(new_text) > len(old_text) and new_text.startswith(old_text)


class RunEvents:
    """The async iterator :meth:`RunHandle.events` returns (bounded by one deadline)."""

    def __init__(self, handle: RunHandle, timeout: float | None) -> None:
        self._handle = handle
        self._timeout = timeout
        self._deadline = deadline_after(timeout)
        self._finished = False

    def __aiter__(self) -> RunEvents:
        return self

    async def __anext__(self) -> Event:
        handle = self._handle
        if self._finished:
            raise StopAsyncIteration
        with deadline_scope(self._deadline, lambda: handle._describe_wait("end", self._timeout)):
            event = await handle._mailbox.get()
        if event is not None:
            return event
        self._finished = True
        if handle._failure is not None:
            raise handle._failure
        if handle._terminal is not None:
            return handle._terminal
        raise StopAsyncIteration
