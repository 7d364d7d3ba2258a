"""What the agent and the backend need from a workspace's database.

:class:`WorkspaceStore` is the contract; two implementations keep it:

- :class:`crush_trio.store.db.Store`: the embedded SQLite database of one workspace (the
  single-node default);
- :class:`crush_trio.cluster.pgstore.PgStore`: the workspace's rows in the cluster's shared
  PostgreSQL database, every write fenced by the workspace's lease epoch.

The same tests run against both (``tests/test_store_contract.py``). The contract, beyond the
signatures:

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
  :class:`~crush_trio.cluster.pg.Fenced` on writes (PostgreSQL only).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from ..wire import Message, Run, RunStatus, Session, Todo
from .paging import PageQuery

if TYPE_CHECKING:
    from .db import Store


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

    # -- pages (crush_trio.store.paging; CursorNotFound for a cursor naming nothing)

    async def page_sessions(self, page: PageQuery) -> list[Session]:
        """Sessions newest created first, ``before`` a session, titles holding ``query``."""
        ...

    async def page_messages(self, session_id: str, page: PageQuery) -> list[Message]:
        """A session's messages oldest first, ``after`` or ``before`` a message."""
        ...

    async def page_runs(self, page: PageQuery) -> list[Run]:
        """Runs newest first, ``before`` a run, filtered by ``statuses`` and ``session_id``."""
        ...


if TYPE_CHECKING:

    def _sqlite_store_keeps_the_contract(store: Store) -> WorkspaceStore:
        return store
