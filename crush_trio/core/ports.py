"""The ports: what the kernel and the agent need from the adapters, as protocols.

The adapters implement them and import this module, never the other way round:

* :class:`WorkspaceStore`: a workspace's sessions, messages and run records
  (:class:`crush_trio.store.db.Store`, SQLite, the single-node default;
  :class:`crush_trio.cluster.pgstore.PgStore`, the cluster's PostgreSQL, every write fenced by the
  workspace's lease epoch), with :class:`PageQuery`, one page of a list;
* :class:`MessageStore`: the one call the message buffer (:mod:`crush_trio.store.messages`)
  makes of a store;
* :class:`EventLog`: where a workspace's encoded events are kept for resume (the cluster's Redis
  stream, :class:`crush_trio.eventlog.MemoryEventLog` for tests and the contract);
* :class:`Terminals`: the once-only terminal records of a cluster's runs, and
  :class:`ChangeHooks`: the snapshots around each turn (:class:`crush_trio.changes.ChangeLog`).

Where a workspace is served (this node, or another node of a cluster) is the port
:class:`crush_trio.core.placement.Placement`.

The store contract, beyond the signatures (``tests/test_store_contract.py`` runs the same tests
against both stores):

- Every write is one transaction: it lands whole or not at all.
- ``message_count`` of a session is kept by the store (a message inserted counts once, however
  often it is rewritten; a deleted one is subtracted); ``update_session`` never writes it.
- ``write_messages`` skips (and leaves out of its result) a message whose session no longer
  exists, so a late write cannot bring a deleted session's rows back.
- Deleting a session deletes its messages but keeps its run records.
- A run's prompt is written only when its record is created, never by an update.
- Listings are ordered: sessions most recently updated first; messages and runs oldest first,
  equal times in insertion order.
- ``session_exists`` and ``may_have_run`` answer from memory, without a database call
  (``may_have_run`` may say True for an unused id, never False for a used one).
- A call on a closed store raises :class:`~crush_trio.errors.StoreError`, as does a failure of
  the database; a store that lost its workspace to another node raises
  :class:`~crush_trio.errors.Fenced` on writes (PostgreSQL only).

The event log contract (``tests/test_eventlog_contract.py``): an event is a ``(seq, bytes)``
pair, ``seq`` the broker's sequence number (kept strictly increasing) and the bytes its encoding,
opaque to the log. A log belongs to one owner at a time, identified by an **epoch** (the
workspace lease's epoch, which grows with every change of owner): :meth:`EventLog.fence` claims it
for an epoch, and from then on appends made through a handle fenced with an older epoch raise
:class:`~crush_trio.errors.Fenced` and land nothing. Fencing is monotonic. A new owner fences
first, then continues numbering from :meth:`EventLog.last_seq`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from ..wire import Message, Run, RunComplete, RunStatus, Session, Todo

#: Items in a page when a paging parameter is given without ``limit``.
DEFAULT_PAGE: Final = 100


@attrs.frozen
class PageQuery:
    """One page of a list that grows without bound (sessions, messages, runs): at most
    ``limit`` items ``before`` or ``after`` the item with that id (the store's cursor rules are
    in :mod:`crush_trio.store.paging`), filtered by title ``query``, run ``statuses`` and
    ``session_id``."""

    limit: int = DEFAULT_PAGE
    before: str | None = None
    after: str | None = None
    query: str = ""
    statuses: tuple[str, ...] = ()
    session_id: str | None = None


class WorkspaceStore(Protocol):
    """Sessions, messages and run records of one workspace (see the module docstring)."""

    @property
    def closed(self) -> bool: ...

    async def aclose(self) -> None:
        """Stop using the database; later calls raise StoreError. Idempotent."""
        ...

    def session_exists(self, session_id: str) -> bool:
        """Whether the session exists (from memory)."""
        ...

    def may_have_run(self, run_id: str) -> bool:
        """False when no run with this id was ever stored (from memory); True means maybe."""
        ...

    # -- sessions

    async def create_session(self, session: Session) -> None:
        """Insert a session; StoreError if the id exists."""
        ...

    async def get_session(self, session_id: str) -> Session | None: ...

    async def list_sessions(self) -> list[Session]:
        """All sessions, most recently updated first."""
        ...

    async def update_session(self, session: Session) -> bool:
        """Store title, parent, token counts, cost and ``updated_at``; False: no such session."""
        ...

    async def record_step_usage(
        self, session_id: str, prompt_tokens: int, completion_tokens: int, cost: float
    ) -> Session | None:
        """Set the token counts, add ``cost``; the updated session, or None."""
        ...

    async def set_title(
        self, session_id: str, title: str, *, keep_existing: bool = False
    ) -> Session | None:
        """Set the title alone (``keep_existing``: only if it has none); the updated session,
        or None."""
        ...

    async def set_summary(
        self, session_id: str, message_id: str, completion_tokens: int, cost: float
    ) -> Session | None:
        """Point the session at its summary message; the updated session, or None."""
        ...

    async def set_todos(self, session_id: str, todos: list[Todo]) -> Session | None:
        """Replace the session's todo list; the updated session, or None."""
        ...

    async def delete_session(self, session_id: str) -> bool:
        """Delete a session and its messages (not its runs); False: no such session."""
        ...

    # -- messages

    async def get_message(self, message_id: str) -> Message | None: ...

    async def list_messages(self, session_id: str) -> list[Message]:
        """A session's messages, oldest first."""
        ...

    async def write_messages(self, messages: Iterable[Message]) -> set[str]:
        """Upsert in one transaction; the ids written (deleted sessions' rows are skipped)."""
        ...

    async def delete_message(self, message_id: str) -> bool:
        """Delete one message; False: no such message."""
        ...

    async def unfinished_assistant_messages(self) -> list[Message]:
        """Assistant messages with no finish part, oldest first."""
        ...

    # -- runs

    async def save_runs(self, runs: list[Run], prompts: Mapping[str, str] | None = None) -> None:
        """Insert or update run records in one transaction; ``prompts`` only on insert."""
        ...

    async def get_run(self, run_id: str) -> Run | None: ...

    async def get_run_prompt(self, run_id: str) -> str | None: ...

    async def list_runs(self, statuses: Iterable[RunStatus]) -> list[Run]:
        """Runs whose status is one of ``statuses``, oldest first."""
        ...

    # -- pages (crush_trio.store.paging; errors.CursorNotFound for a cursor naming nothing)

    async def page_sessions(self, page: PageQuery) -> list[Session]:
        """Sessions newest created first, ``before`` a session, titles holding ``query``."""
        ...

    async def page_messages(self, session_id: str, page: PageQuery) -> list[Message]:
        """A session's messages oldest first, ``after`` or ``before`` a message."""
        ...

    async def page_runs(self, page: PageQuery) -> list[Run]:
        """Runs newest first, ``before`` a run, filtered by ``statuses`` and ``session_id``."""
        ...


class MessageStore(Protocol):
    """What the message buffer (:class:`~crush_trio.store.MessageService`) needs from the
    database; every :class:`WorkspaceStore` is one."""

    async def write_messages(self, messages: Iterable[Message]) -> set[str]:
        """Upsert in one transaction; skip (and leave out of the result) deleted sessions."""
        ...


#: One event as a log keeps it: ``(seq, encoded bytes)``.
EventRecord = tuple[int, bytes]


@runtime_checkable
class EventLog(Protocol):
    """One workspace's event log (see the module docstring)."""

    async def append(self, batch: Sequence[EventRecord]) -> None:
        """Append ``batch`` (``(seq, bytes)`` pairs, seqs increasing and above
        :meth:`last_seq`) atomically: all of it or none.

        Raises:
            Fenced: a newer epoch owns the log; nothing was appended.
            EventLogError: a seq is not above the last one.
        """
        ...

    async def read(self, after_seq: int, limit: int) -> list[EventRecord]:
        """Up to ``limit`` kept events with a seq above ``after_seq``, in order."""
        ...

    async def last_seq(self) -> int:
        """The seq of the newest event appended (0 when none)."""
        ...

    async def first_seq(self) -> int:
        """The seq of the oldest event kept (``last_seq() + 1`` when none is kept)."""
        ...

    async def fence(self, epoch: int) -> None:
        """Claim the log for ``epoch``: appends through handles fenced with an older epoch fail
        from now on. Claiming again with the current epoch is allowed.

        Raises:
            Fenced: the log already belongs to a newer epoch.
        """
        ...

    async def aclose(self) -> None:
        """Release this handle's resources (the log's contents stay)."""
        ...


class Terminals(Protocol):
    """The once-only terminal record of a cluster's runs (see ``Workspace``): ``record`` stores
    the run's terminal event with its final status (False: already recorded, do not publish);
    ``logged`` notes that the event log holds the published event."""

    async def record(self, run: Run, complete: RunComplete) -> bool: ...

    async def logged(self, run_id: str, event: Any) -> None: ...


class ChangeHooks(Protocol):
    """The workspace's change log (:class:`crush_trio.changes.ChangeLog`): a turn's runs are
    registered when it starts (no snapshot: the first tool call that may write takes it) and
    their record, what each of them changed, is written when it ends."""

    async def begin_run(self, session_id: str, run_ids: list[str]) -> None: ...

    async def end_run(self, session_id: str, run_ids: list[str]) -> dict[str, Any]: ...
