"""Write latency of one write window (a batch of messages) on the two workspace stores.

Usage::

    python -m bench.store_batch [--batch 50] [--rounds 200] [--workspaces 30]

Starts a throw-away PostgreSQL server (as the tests do, :mod:`tests.services`) and an SQLite
store in a temporary directory, then times ``write_messages`` of ``--batch`` streaming assistant
messages (about 2 KiB of text each; the first round inserts them, later rounds update them, as
the message buffer's flushes do): first one workspace alone, then ``--workspaces`` workspaces
writing their batches at once through one node's pool. Prints a Markdown table (milliseconds).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from crush_trio.cluster.pg import Lease, PgCluster
from crush_trio.cluster.pgstore import PgStore
from crush_trio.store.db import Store
from crush_trio.wire import Message, Role, Session, TextPart
from tests.services import running_postgres

if TYPE_CHECKING:
    from crush_trio.store.protocol import WorkspaceStore

TEXT = "The quick brown fox jumps over the lazy dog. " * 45  # about 2 KiB


def batch_of(session_id: str, size: int, round_: int) -> list[Message]:
    return [
        Message(
            id=f"{session_id}-m{i}",
            session_id=session_id,
            role=Role.ASSISTANT,
            parts=[TextPart(f"{round_} {TEXT}")],
            created_at=i,
        )
        for i in range(size)
    ]


async def time_rounds(
    stores: list[WorkspaceStore], size: int, rounds: int
) -> tuple[list[float], float]:
    """Per-batch latencies (ms) of every store, every round, and the wall time (s)."""
    for i, store in enumerate(stores):
        await store.create_session(Session(id=f"s{i}"))
    latencies: list[float] = []

    async def one(i: int, store: WorkspaceStore, round_: int) -> None:
        batch = batch_of(f"s{i}", size, round_)
        start = time.perf_counter()
        await store.write_messages(batch)
        latencies.append((time.perf_counter() - start) * 1000)

    begin = time.perf_counter()
    for round_ in range(rounds):
        async with trio.open_nursery() as nursery:
            for i, store in enumerate(stores):
                nursery.start_soon(one, i, store, round_)
    return latencies, time.perf_counter() - begin


def row(name: str, latencies: list[float], wall: float, batches: int) -> str:
    q = statistics.quantiles(latencies, n=100)
    return (
        f"| {name} | {statistics.median(latencies):.2f} | {q[94]:.2f} | {q[98]:.2f} | "
        f"{max(latencies):.2f} | {batches / wall:.0f} |"
    )


async def main(size: int, rounds: int, workspaces: int) -> None:
    lines = [
        f"Write window of {size} messages (~2 KiB each), {rounds} rounds",
        "",
        "| store | p50 ms | p95 ms | p99 ms | max ms | batches/s |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp, running_postgres() as server:
        sqlite_stores = [await Store.open(Path(tmp) / f"w{i}") for i in range(workspaces)]
        cluster = await PgCluster.open(server.dsn())
        pg_stores: list[WorkspaceStore] = []
        for i in range(workspaces):
            lease = await cluster.claim_workspace(f"/w{i}", "bench", 600)
            assert isinstance(lease, Lease)
            pg_stores.append(await PgStore.open(cluster, lease.workspace_id, lease.epoch))
        cases: list[tuple[str, list[WorkspaceStore]]] = [
            ("SQLite, 1 workspace", sqlite_stores[:1]),
            ("PostgreSQL, 1 workspace", pg_stores[:1]),
            (f"SQLite, {workspaces - 1} workspaces at once", sqlite_stores[1:]),
            (f"PostgreSQL, {workspaces - 1} workspaces at once", pg_stores[1:]),
        ]
        for name, stores in cases:
            latencies, wall = await time_rounds(stores, size, rounds)
            lines.append(row(name, latencies, wall, len(latencies)))
        for store in sqlite_stores:
            await store.aclose()
        await cluster.aclose()
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--workspaces", type=int, default=30)
    args = parser.parse_args()
    trio.run(main, args.batch, args.rounds, args.workspaces + 1)
