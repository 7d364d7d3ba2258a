"""Where an idle websocket client's memory goes: ``python -m bench.idle_memory``.

Runs the server under :mod:`bench.traced_server`, opens ``--clients`` idle event websockets (the
``watch`` workers of W4: permessage-deflate offered, ``deltas=1``, unless told otherwise) and
prints:

* the RSS the clients add, per client, measured with tracing off, as W4 measures it (the first
  generation of clients after start; a second generation then reuses the memory the first one
  freed, so its figure is near zero unless something leaks);
* the traced Python memory ``--traced-clients`` idle clients add, per client, and the
  allocation sites that hold it: a ``tracemalloc`` snapshot before they connect and one after,
  compared by allocating line, and by the innermost ``crush_trio`` frame that led to the
  allocation (which part of the server made it).

Tracing keeps :data:`TRACE_FRAMES` frames per allocation (``CRUSH_BENCH_TRACE_FRAMES``) and
slows the server several times, hence fewer clients in that phase. The traced figure is below
the RSS one: the RSS also holds the allocator's slack and memory that ``tracemalloc`` does not
see (C libraries' own allocations); the kernel's socket buffers are in neither.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import tracemalloc
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Final

import trio

from .client import COMPRESSION_ENV, DELTAS_ENV
from .procs import Child, memory, raise_fd_limit, server_process
from .workloads.common import (
    Ctx,
    all_events,
    broadcast,
    echo_config,
    hold_workspace,
    processes_for,
    split,
    workers,
)
from .workloads.sizes import FULL

#: Settling time before each reading (seconds).
SETTLE: Final = 3.0
#: Longest wait for the traced server to answer a snapshot request (seconds).
SNAPSHOT_TIMEOUT: Final = 300.0
#: Longest wait for the clients of one generation to connect (seconds).
CONNECT_TIMEOUT: Final = 300.0
#: Traced clients connected at a time (one worker process each).
BATCH: Final = 25
#: Allocation sites printed per grouping.
TOP: Final = 20
#: Frames per traced allocation, unless ``CRUSH_BENCH_TRACE_FRAMES`` says otherwise.
TRACE_FRAMES: Final = 25
#: Path fragments stripped from the file names printed.
_PREFIXES: Final = ("site-packages/", "python3.11/", "lib/python3.12/")


async def _request(directory: Path, name: str) -> Path:
    """Ask the traced server for ``name`` (``start``, or a snapshot); bounded."""
    (directory / f"{name}.request").touch()
    done = directory / ("start.done" if name == "start" else f"{name}.snap")
    with trio.fail_after(SNAPSHOT_TIMEOUT):
        while not done.exists():  # noqa: ASYNC110 (a file another process writes)
            await trio.sleep(0.1)
    return done


def _where(frame: tracemalloc.Frame) -> str:
    name = frame.filename
    for prefix in _PREFIXES:
        if prefix in name:
            name = name.split(prefix, 1)[1]
    if "crush_trio/" in name:
        name = "crush_trio/" + name.split("crush_trio/", 1)[1]
    return f"{name}:{frame.lineno}"


def report(before: Path, after: Path, clients: int) -> list[str]:
    """The traced memory ``clients`` connections added, by line and by ``crush_trio`` site."""
    old = tracemalloc.Snapshot.load(str(before))
    new = tracemalloc.Snapshot.load(str(after))
    stats = new.compare_to(old, "traceback")
    total = sum(s.size_diff for s in stats)
    by_line: collections.Counter[str] = collections.Counter()
    by_site: collections.Counter[str] = collections.Counter()
    for stat in stats:
        frames = list(stat.traceback)[::-1]  # innermost first
        by_line[_where(frames[0])] += stat.size_diff
        ours = next((f for f in frames if "crush_trio" in f.filename), None)
        by_site[_where(ours) if ours else "(no crush_trio frame)"] += stat.size_diff
    lines = [
        f"traced Python memory added by {clients} idle clients: {total / 1e6:.2f} MB, "
        f"{total / clients / 1024:.1f} KB per client"
    ]
    for title, counter in (("allocating line", by_line), ("innermost crush_trio frame", by_site)):
        lines.append(f"  by {title} (bytes per client):")
        lines += [f"    {size / clients:7.0f}  {where}" for where, size in counter.most_common(TOP)]
    return lines


async def generation(ctx: Ctx, pid: int, configs: list[dict[str, object]], name: str) -> str:
    """Connect one generation of idle clients; the RSS they add."""
    clients = sum(int(str(c["count"])) for c in configs)
    await trio.sleep(SETTLE)
    rss0 = memory(pid).rss
    async with workers(ctx, "watch", configs, name) as children:
        ready = await all_events(children, "ready", CONNECT_TIMEOUT)
        failed = sum(r["failed"] for r in ready)
        await trio.sleep(SETTLE)
        rss1 = memory(pid).rss
        await broadcast(children, {"cmd": "quit"})
        await all_events(children, "done", 60)
    added = rss1 - rss0
    return (
        f"RSS {rss0 / 1e6:.1f} MB -> {rss1 / 1e6:.1f} MB with {clients:,} idle clients "
        f"({failed} failed to connect): +{added / 1e6:.1f} MB, "
        f"{added / clients / 1024:.1f} KB per client"
    )


async def measure(clients: int, traced_clients: int, work: Path) -> list[str]:
    ctx = Ctx(sizes=FULL, workdir=work, log=print)
    traces = work / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    launcher = ("-m", "bench.traced_server", str(traces))
    out: list[str] = []
    async with (
        server_process(echo_config(), work, launcher=launcher) as server,
        hold_workspace(server, work / "project") as ws,
    ):

        def configs(n: int) -> list[dict[str, object]]:
            shares = split(n, processes_for(n))
            return [{"url": server.url, "wid": ws.id, "count": share} for share in shares]

        labels = ("first generation (the W4 figure)", "second generation") if clients else ()
        for label in labels:
            line = f"{label}: {await generation(ctx, server.pid, configs(clients), label[:6])}"
            print(line, flush=True)
            out.append(line)
        if traced_clients <= 0:
            return out
        await _request(traces, "start")
        await trio.sleep(SETTLE)
        before = await _request(traces, "before")
        connected = 0
        async with AsyncExitStack() as stack:
            # A traced server is slow: a few clients at a time, so that none times out.
            children: list[Child] = []
            for index, share in enumerate(split(traced_clients, -(-traced_clients // BATCH))):
                config = {"url": server.url, "wid": ws.id, "count": share}
                batch = await stack.enter_async_context(
                    workers(ctx, "watch", [config], f"traced-{index}")
                )
                (ready,) = await all_events(batch, "ready", CONNECT_TIMEOUT)
                connected += ready["connected"]
                children += batch
            await trio.sleep(SETTLE)
            after = await _request(traces, "after")
            await broadcast(children, {"cmd": "quit"})
            await all_events(children, "done", 60)
    out.append(f"traced: {connected} of {traced_clients} clients connected")
    out += report(before, after, max(1, connected))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.idle_memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--clients", type=int, default=1000, help="idle clients for the RSS figure (0: none)"
    )
    p.add_argument(
        "--traced-clients", type=int, default=200, help="idle clients traced (0: no tracing)"
    )
    p.add_argument("--no-compression", action="store_true", help="clients offer no deflate")
    p.add_argument("--snapshots", action="store_true", help="clients ask for no deltas")
    p.add_argument("--keep", type=Path, help="work here and keep it (logs, snapshots)")
    args = p.parse_args(argv)
    if args.no_compression:
        os.environ[COMPRESSION_ENV] = "0"
    if args.snapshots:
        os.environ[DELTAS_ENV] = "0"
    os.environ.setdefault("CRUSH_BENCH_TRACE_FRAMES", str(TRACE_FRAMES))
    raise_fd_limit()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        lines = trio.run(measure, args.clients, args.traced_clients, args.keep)
    else:
        with tempfile.TemporaryDirectory(prefix="crush-idle-") as tmp:
            lines = trio.run(measure, args.clients, args.traced_clients, Path(tmp))
    print("\n".join(line for line in lines if not line.startswith(("first", "second"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
