"""Placement: which node serves a workspace, as the backend and the server ask it.

:class:`Placement` is the port; two implementations keep it:

* :class:`LocalPlacement`, the null object of a single server: every workspace is served here. A
  claim gives the workspace a new id and the defaults (the SQLite store in its data directory,
  the broker's own replay ring, snapshots in its data directory); no lease is held, renewed or
  lost, and no request is sent elsewhere.
* ``crush_trio.cluster.placement.ClusterPlacement``, one node of a cluster (docs/cluster.md):
  a claim takes the workspace's lease in PostgreSQL and binds the workspace to the cluster's
  store and its Redis event log at the lease's epoch; a request for a workspace another node
  owns is answered with :class:`~crush_trio.errors.Moved` or
  :class:`~crush_trio.errors.OwnerUnavailable`.

So the single-node code paths are the cluster's with nothing to do: the backend and the server
never ask whether they run in a cluster.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

import attrs

from ..wire import new_id
from .ports import EventLog, WorkspaceStore

#: The client id of the holds a single server would take for a request that names no client
#: (it never does: :meth:`LocalPlacement.locate` opens nothing).
LOCAL_HOLD_ID: Final = str(uuid.uuid5(uuid.NAMESPACE_URL, "crush-trio-node:local"))


@attrs.frozen
class Seat:
    """What a claim gives the workspace about to open at a path: its id and where its records
    and events live."""

    workspace_id: str
    #: Opens the workspace's store (argument: its data directory); None: the SQLite store there.
    store_factory: Callable[[Path], Awaitable[WorkspaceStore]] | None = None
    #: The broker's event log; None: the broker keeps its own replay ring.
    event_log: EventLog | None = None
    #: Snapshots live in the project's own data directory, where whichever node owns the
    #: workspace next finds them, rather than under the server's ``--data-dir``.
    shared_snapshots: bool = False
    #: The lease behind the seat (a cluster's; None on a single server).
    lease: Any = None


class WorkspaceHost(Protocol):
    """The node's workspaces as a placement sees them (the backend keeps this)."""

    @property
    def shutting_down(self) -> bool: ...

    @property
    def workspaces(self) -> Mapping[str, object]:
        """The workspaces open on this node, by id."""
        ...

    async def adopt(self, path: str) -> object:
        """Open the workspace at ``path`` here to recover what its stopped owner left."""
        ...


class Placement(Protocol):
    """Which node serves a workspace (see the module docstring).

    Attributes:
        hold_id: the client id of the holds this node takes on a workspace it opens for a request
            that names no client.
        stopping: set when the server begins to shut down: nothing more is adopted.
    """

    hold_id: str
    stopping: bool

    def running(self, host: WorkspaceHost) -> AbstractAsyncContextManager[object]:
        """Take part in the placement for the block (a cluster node: register, renew its leases
        and recover the workspaces of dead nodes in the background)."""
        ...

    async def claim(self, path: str) -> Seat:
        """Take the workspace at ``path`` (a real path) for this node, about to open it.

        Raises:
            Moved: another live node owns it.
            OwnerUnavailable: its owner stopped renewing its lease, which has not expired yet.
        """
        ...

    def hold(self, seat: Seat, on_lost: Callable[[str], None]) -> None:
        """The workspace of ``seat`` serves here; ``on_lost(reason)`` stops it once its lease
        is lost."""
        ...

    async def release(self, workspace_id: str) -> None:
        """The workspace closed here (or never opened): another node may take it at once."""
        ...

    def lose(self, workspace_id: str, reason: str) -> None:
        """The workspace's lease is gone: stop it without writing anything more."""
        ...

    async def locate(self, workspace_id: str, target: str) -> str | None:
        """Where a request (``target``: its path and query) for a workspace that is not open
        here goes: the workspace's path when it should open here, or None when nothing is to
        be opened (the request is answered here).

        Raises:
            Moved: another live node owns it.
            OwnerUnavailable: its owner stopped renewing its lease.
            NotFound: the cluster does not know the workspace.
        """
        ...

    def check_closing(self, workspace_id: str) -> None:
        """A request names a workspace that is closing on this node.

        Raises:
            OwnerUnavailable: in a cluster, where another node takes the workspace over once it
                has closed (retry then); a single server raises nothing (the request is answered
                here, 409 while the workspace closes).
        """
        ...


class LocalPlacement:
    """The placement of a single server: every workspace is served here (the null object of
    :class:`Placement`)."""

    def __init__(self) -> None:
        self.hold_id = LOCAL_HOLD_ID
        self.stopping = False

    @asynccontextmanager
    async def running(self, host: WorkspaceHost) -> AsyncIterator[LocalPlacement]:
        """Nothing runs in the background of a single server."""
        yield self

    async def claim(self, path: str) -> Seat:
        """A new id and the defaults: nothing to take from anyone."""
        return Seat(new_id())

    def hold(self, seat: Seat, on_lost: Callable[[str], None]) -> None:
        """No lease to hold: a single server's workspaces are never lost."""

    async def release(self, workspace_id: str) -> None:
        """No lease to release."""

    def lose(self, workspace_id: str, reason: str) -> None:
        """No lease to lose."""

    async def locate(self, workspace_id: str, target: str) -> str | None:
        """No other node: a workspace not open here is not open anywhere (404)."""
        return None

    def check_closing(self, workspace_id: str) -> None:
        """Nowhere else to send it: the request is answered here."""


if TYPE_CHECKING:

    def _local_placement_keeps_the_port(placement: LocalPlacement) -> Placement:
        return placement
