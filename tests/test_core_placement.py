"""The placement port: a single server's null object and what a cluster node answers instead.

:class:`~crush_trio.core.placement.LocalPlacement` must leave every single-node path as it was
before the port existed: a claim takes nothing from anyone, nothing is held, lost, located or
refused. The cluster node's answers are checked without a database.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from crush_trio.cluster.placement import ClusterPlacement
from crush_trio.config import ClusterOptions
from crush_trio.core.placement import LOCAL_HOLD_ID, LocalPlacement, Seat
from crush_trio.errors import OwnerUnavailable
from crush_trio.server.security import response_headers

if TYPE_CHECKING:
    from collections.abc import Mapping


class NoWorkspaces:
    """A :class:`~crush_trio.core.placement.WorkspaceHost` with nothing open."""

    shutting_down = False

    @property
    def workspaces(self) -> Mapping[str, object]:
        return {}

    async def adopt(self, path: str) -> object:
        raise AssertionError("a single server adopts nothing")


async def test_a_single_server_claims_every_workspace_for_itself_with_the_defaults() -> None:
    placement = LocalPlacement()
    first, second = await placement.claim("/p"), await placement.claim("/p")
    # A new id each time; the SQLite store in the data directory, the broker's own ring and the
    # snapshots beside the store: a Workspace's defaults.
    assert first.workspace_id != second.workspace_id
    assert first == Seat(first.workspace_id)
    assert (first.store_factory, first.event_log, first.shared_snapshots, first.lease) == (
        None,
        None,
        False,
        None,
    )


async def test_a_single_server_holds_loses_locates_and_refuses_nothing() -> None:
    placement = LocalPlacement()
    lost: list[str] = []
    async with placement.running(NoWorkspaces()) as running:
        assert running is placement
        seat = await placement.claim("/p")
        placement.hold(seat, lost.append)
        placement.lose(seat.workspace_id, "renewal refused")
        assert lost == []  # no lease, so none is lost
        # A workspace not open here is open nowhere: the request is answered here (404).
        assert await placement.locate("w", "/v1/workspaces/w/agent") is None
        placement.check_closing("w")  # answered here: 409 while it closes
        await placement.release(seat.workspace_id)
    assert placement.hold_id == LOCAL_HOLD_ID
    assert not placement.stopping


def cluster_node() -> ClusterPlacement:
    return ClusterPlacement(
        ClusterOptions(database_url="postgresql:///x", redis_url="redis://r/0", retry_after=4.5),
        "http://127.0.0.1:7001",
    )


def test_a_cluster_node_sends_a_request_for_a_workspace_closing_there_elsewhere() -> None:
    with pytest.raises(OwnerUnavailable) as info:
        cluster_node().check_closing("w")
    assert info.value.status == 503
    assert "w is closing on this node" in info.value.message
    assert response_headers(info.value) == {"Retry-After": "5"}


def test_a_cluster_node_stops_a_held_workspace_once_when_its_lease_is_lost() -> None:
    node = cluster_node()
    lost: list[str] = []
    node.hold(Seat("w", lease=object()), lost.append)
    node.lose("w", "another node owns the workspace now")
    node.lose("w", "again")
    assert lost == ["another node owns the workspace now"]
    node.lose("unknown", "nothing held")
    assert lost == ["another node owns the workspace now"]
