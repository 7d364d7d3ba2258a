"""Placement: which node of a cluster serves which workspace (docs/cluster.md).

A node (:class:`ClusterPlacement`, which keeps the kernel's
:class:`~crush_trio.core.placement.Placement` port) registers itself in PostgreSQL, owns the
workspaces whose lease it holds, renews those leases every ``cluster.renew_interval`` seconds,
and scans every ``cluster.scan_interval`` seconds for expired leases of workspaces that still
have queued or running runs, which it claims and recovers. A node that asks for a workspace
another node owns gets :class:`~crush_trio.errors.Moved` (HTTP 307 to the owner); one whose
owner stopped renewing but whose lease has not expired yet gets
:class:`~crush_trio.errors.OwnerUnavailable` (HTTP 503 with ``Retry-After``).

Task ownership::

    ClusterPlacement.running (entered by serve around Backend.running)
      ├─ heartbeat + renew loop     one renewal per owned lease, every renew interval
      └─ scanner                    claims expired leases with work, opens those workspaces

A lease that cannot be renewed (another node took it, or a write was fenced) stops its
workspace at once without writing anything more: its streams close with 1012 and the new owner's
log and database refuse whatever the old epoch still tries.
"""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final

import attrs
import trio

from ..core.placement import Placement, Seat, WorkspaceHost
from ..errors import (
    ConfigError,
    CrushError,
    Fenced,
    Moved,
    NotFound,
    OwnerUnavailable,
)

if TYPE_CHECKING:
    from pathlib import Path

    from ..config import ClusterOptions
    from ..core.ports import WorkspaceStore

log = logging.getLogger(__name__)

#: Bound on the lease releases of a node that stops (seconds).
RELEASE_TIMEOUT: Final = 5.0


def default_node_id(url: str) -> str:
    """A node id from the host name and the listening port."""
    port = url.rsplit(":", 1)[-1].strip("/")
    return f"{socket.gethostname()}-{port}"


@attrs.define
class Owned:
    """A workspace this node holds the lease of."""

    lease: Any
    #: Called once when the lease is lost (renewal refused, or a write fenced).
    on_lost: Callable[[str], None]
    lost: bool = False


class ClusterPlacement:
    """One node of a cluster.

    Args:
        options: the ``cluster`` section (with ``database_url`` set).
        url: the URL the server listens on (advertised unless ``advertise_url`` is set).
    """

    def __init__(self, options: ClusterOptions, url: str) -> None:
        if not options.database_url:
            raise ConfigError("cluster.database_url is required to run as a node of a cluster")
        if not options.redis_url:
            raise ConfigError(
                "cluster.redis_url is required with cluster.database_url: the workspaces' event "
                "logs live in Redis (--cluster-redis-url redis://HOST:PORT/0)"
            )
        self.options = options
        self.url = (options.advertise_url or url).rstrip("/")
        self.node_id = options.node_id or default_node_id(self.url)
        #: The client id of the holds this node takes on a workspace it opens for a request
        #: that names no client (they last ``server.create_grace``).
        self.hold_id = str(uuid.uuid5(uuid.NAMESPACE_URL, f"crush-trio-node:{self.node_id}"))
        self.cluster: Any = None
        #: The node's Redis client and the workspaces' logs on it.
        self.logs: Any = None
        #: Workspace id → its lease and what to do when it is lost.
        self.owned: dict[str, Owned] = {}
        self.backend: WorkspaceHost | None = None
        self.stopping = False

    # -- lifetime ----------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self, backend: WorkspaceHost) -> AsyncIterator[ClusterPlacement]:
        """Connect, register the node, renew and scan in the background for the block."""
        from .pg import PgCluster
        from .redislog import open_redis_logs

        self.backend = backend
        self.cluster = await PgCluster.open(
            self.options.database_url, pool_size=self.options.database_pool
        )
        try:
            async with open_redis_logs(self.options.redis_url) as logs:
                self.logs = logs
                await self.cluster.register_node(self.node_id, self.url)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._renew_loop)
                    nursery.start_soon(self._scan_loop)
                    try:
                        yield self
                    finally:
                        nursery.cancel_scope.cancel()
        finally:
            with trio.move_on_after(RELEASE_TIMEOUT, shield=True):
                await self.cluster.aclose()

    # -- claims ------------------------------------------------------------------------------

    async def claim(self, path: str) -> Seat:
        """Take the lease of the workspace at ``path`` (a real path): the workspace opens with
        the cluster's store and event log, both fenced at the lease's epoch, and keeps its
        snapshots in the project's own data directory (on the file system the nodes share).

        Raises :class:`Moved` when a live node owns it, and :class:`OwnerUnavailable` when its
        owner stopped renewing.
        """
        lease = await self._take_lease(path)
        self.owned[lease.workspace_id] = Owned(lease, lambda reason: None)
        try:
            event_log = await self.open_log(lease)
        except BaseException:
            await self.release(lease.workspace_id)
            raise

        async def open_store(data_dir: Path) -> WorkspaceStore:
            return await self.open_store(lease)

        return Seat(
            lease.workspace_id,
            store_factory=open_store,
            event_log=event_log,
            shared_snapshots=True,
            lease=lease,
        )

    async def _take_lease(self, path: str, request_path: str = "/v1/workspaces") -> Any:
        from .pg import Held

        got = await self.cluster.claim_workspace(path, self.node_id, self.options.lease_ttl)
        if isinstance(got, Held):
            raise self._elsewhere(got.owner_node, got.owner_url, got.expires_in, request_path)
        return got

    def _elsewhere(
        self, owner: str | None, owner_url: str | None, expires_in: float, target: str
    ) -> CrushError:
        """The answer for a workspace another node holds: move there, or wait for its lease."""
        ttl = self.options.lease_ttl
        stale = expires_in < ttl - 2 * self.options.renew_every
        if owner_url is None or stale or owner_url.rstrip("/") == self.url:
            return OwnerUnavailable(
                f"the node {owner} that owns this workspace stopped renewing its lease; another "
                f"node takes it over within {expires_in:.1f} s: retry then",
                retry_after=max(expires_in, self.options.retry_after),
            )
        return Moved(
            f"node {owner} owns this workspace: send the request to {owner_url}",
            owner_url.rstrip("/") + target,
        )

    async def locate(self, workspace_id: str, target: str) -> str:
        """Where a request for a workspace this node has not open must go.

        Returns the workspace's path when nobody holds a live lease (the caller opens it here);
        raises :class:`Moved`, :class:`OwnerUnavailable`, or :class:`NotFound` for an id the
        cluster does not know.
        """
        row = await self.cluster.workspace_owner(workspace_id)
        if row is None:
            raise NotFound(
                f"workspace {workspace_id!r} not found in the cluster; open it with "
                "POST /v1/workspaces"
            )
        if row.owner_node and row.owner_node != self.node_id and row.expires_in > 0:
            raise self._elsewhere(row.owner_node, row.owner_url, row.expires_in, target)
        return str(row.path)

    def check_closing(self, workspace_id: str) -> None:
        """A workspace closing on this node moves to another node once closed: ask again then."""
        raise OwnerUnavailable(
            f"workspace {workspace_id} is closing on this node; retry, another node takes it",
            retry_after=self.options.retry_after,
        )

    def hold(self, seat: Seat, on_lost: Callable[[str], None]) -> None:
        self.owned[seat.workspace_id] = Owned(seat.lease, on_lost)

    async def open_store(self, lease: Any) -> WorkspaceStore:
        """The workspace's store: PostgreSQL, every write fenced by the lease's epoch."""
        from .pgstore import PgStore

        return await PgStore.open(self.cluster, lease.workspace_id, lease.epoch)

    async def open_log(self, lease: Any) -> Any:
        """The workspace's event log in Redis, fenced for the lease's epoch first (an older
        owner's appends fail from then on)."""
        event_log = self.logs.log(lease.workspace_id)
        await event_log.fence(lease.epoch)
        return event_log

    async def release(self, workspace_id: str) -> None:
        """The workspace closed here: let another node take it at once (not after a lost
        lease: it is not ours to release)."""
        owned = self.owned.pop(workspace_id, None)
        if owned is None or owned.lost:
            return
        with trio.move_on_after(RELEASE_TIMEOUT, shield=True):
            try:
                await self.cluster.release(owned.lease)
            except Exception:
                log.exception("releasing the lease of workspace %s failed", workspace_id)

    def lose(self, workspace_id: str, reason: str) -> None:
        """The lease of ``workspace_id`` is gone: stop the workspace without writing."""
        owned = self.owned.get(workspace_id)
        if owned is None or owned.lost:
            return
        owned.lost = True
        log.warning("workspace %s: lease lost (%s); stopping it", workspace_id, reason)
        owned.on_lost(reason)

    # -- background --------------------------------------------------------------------------

    async def _renew_loop(self) -> None:
        every = self.options.renew_every
        while True:
            await trio.sleep(every)
            try:
                await self.cluster.heartbeat(self.node_id)
            except Exception:
                log.exception("node heartbeat failed")
            for wid, owned in list(self.owned.items()):
                if owned.lost:
                    continue
                try:
                    kept = await self.cluster.renew(owned.lease)
                except Fenced:
                    kept = False
                except Exception:
                    log.exception("renewing the lease of workspace %s failed", wid)
                    continue
                if not kept:
                    self.lose(wid, "another node owns the workspace now")

    async def _scan_loop(self) -> None:
        while True:
            await trio.sleep(self.options.scan_interval)
            try:
                await self.scan()
            except Exception:
                log.exception("scanning for workspaces to recover failed")

    async def scan(self) -> None:
        """Claim and open every workspace whose lease expired while it had runs to finish."""
        backend = self.backend
        if backend is None or self.stopping or backend.shutting_down:
            return
        for workspace_id, path in await self.cluster.expired_with_work():
            if workspace_id in backend.workspaces:
                continue
            try:
                await backend.adopt(path)
            except CrushError as exc:
                log.info("not recovering workspace %s (%s): %s", workspace_id, path, exc)


if TYPE_CHECKING:

    def _cluster_placement_keeps_the_port(node: ClusterPlacement) -> Placement:
        return node
