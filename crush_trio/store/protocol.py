"""The store contract, :class:`~crush_trio.core.ports.WorkspaceStore`, re-exported where the
stores live.

The contract is a port of the kernel (:mod:`crush_trio.core.ports`): the agent and the backend
depend on it, and both stores keep it (:class:`crush_trio.store.db.Store`, SQLite;
:class:`crush_trio.cluster.pgstore.PgStore`, PostgreSQL).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.ports import WorkspaceStore as WorkspaceStore  # noqa: TC001 (a re-export)

if TYPE_CHECKING:
    from .db import Store

    def _sqlite_store_keeps_the_contract(store: Store) -> WorkspaceStore:
        return store
