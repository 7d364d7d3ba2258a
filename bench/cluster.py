"""The cluster workload: three nodes on one PostgreSQL and one Redis against a single node.

``python -m bench.cluster [--runs 150] [--workspaces 30] [--out bench/results/cluster.md]``
starts a throw-away PostgreSQL and Redis (as the tests do, tests/services.py), then:

1. single node: one ``crush-trio serve`` (SQLite, in-memory event ring); ``--runs`` concurrent
   runs spread over ``--workspaces`` workspaces (one session per run); runs/s and server CPU
   seconds per run;
2. cluster: three nodes sharing the database and Redis, the workspaces opened round-robin
   through the three nodes (each node owns a third); the same load; runs/s and CPU per run
   (nodes, and nodes + PostgreSQL + Redis);
3. fail-over under load: the same load with runs that stream for several seconds; once every
   run has streamed, the node that owns the most workspaces is killed (SIGKILL). Reported: the
   time from the kill until the last run of its workspaces has its ``run_complete`` (they end
   ``failed``), and runs lost: accepted runs that never got a ``run_complete`` or a terminal
   record (must be 0).

The client is this process (the project's client library, one connection per node). CPU is read
from ``/proc`` before and after each measured phase. Results are printed and written as
Markdown to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs
import trio

from bench.procs import cpu_seconds, tree_cpu_seconds
from crush_trio.client import Client, connect
from crush_trio.client.runs import RunHandle

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from crush_trio.client.workspace import WorkspaceClient

REPO: Final = Path(__file__).resolve().parent.parent
TOKEN: Final = "bench-cluster"
LEASE_TTL: Final = 3.0
#: Bound on one node's start, and on each phase's runs (seconds).
START_TIMEOUT: Final = 60.0
PHASE_TIMEOUT: Final = 300.0
#: The throughput phases' prompt (20 words at 5 ms: a short run) and the fail-over phase's
#: (120 words at 50 ms: six seconds of streaming).
SHORT_PROMPT: Final = " ".join(f"w{i}" for i in range(20))
LONG_PROMPT: Final = " ".join(f"w{i}" for i in range(120))


@attrs.define
class Node:
    name: str
    process: trio.Process
    url: str


def _config(delay_ms: float) -> dict[str, Any]:
    return {
        "providers": {"slow": {"type": "echo", "delay_ms": delay_ms, "models": [{"id": "echo"}]}},
        "models": {"large": {"provider": "slow", "model": "echo"}},
    }


async def start_node(
    nursery: trio.Nursery, workdir: Path, name: str, config: Path, cluster: Sequence[str]
) -> Node:
    args = [
        sys.executable, "-m", "crush_trio", "serve", "--host", "127.0.0.1", "--port", "0",
        "--token", TOKEN, "--config", str(config), "--data-dir", str(workdir / f"data-{name}"),
        "--no-access-log", "--log-level", "WARNING", *cluster,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_CONFIG_HOME": str(workdir / "xdg")}
    with (workdir / f"{name}.log").open("ab") as err:
        process = await trio.lowlevel.open_process(
            args, stdout=subprocess.PIPE, stderr=err, env=env
        )
    assert process.stdout is not None
    buffer = b""
    with trio.fail_after(START_TIMEOUT):
        while b"crush-trio listening on" not in buffer:
            chunk = await process.stdout.receive_some()
            if not chunk:
                raise RuntimeError(f"node {name} exited; see {workdir / f'{name}.log'}")
            buffer += chunk
    url = buffer.decode().split("crush-trio listening on ", 1)[1].split("/?", 1)[0]

    async def drain() -> None:
        assert process.stdout is not None
        while await process.stdout.receive_some():
            pass

    nursery.start_soon(drain)
    return Node(name, process, url)


@attrs.define
class Load:
    handles: list[RunHandle] = attrs.field(factory=list)
    by_workspace: dict[str, list[RunHandle]] = attrs.field(factory=dict)
    seconds: float = 0.0


@asynccontextmanager
async def workspaces(
    clients: list[Client], projects: list[Path]
) -> AsyncIterator[list[WorkspaceClient]]:
    """Every project's workspace, owned round-robin by the nodes: workspace ``i`` is opened first
    through node ``i`` (which so owns it), without events; the client that works in it enters
    through the next node, which sends it on to the owner (a client whose entry node survives
    the owner, as behind a load balancer)."""
    async with AsyncExitStack() as stack:
        opened = []
        n = len(clients)
        for i, project in enumerate(projects):
            if n > 1:
                await stack.enter_async_context(clients[i % n].workspace(project, events=False))
            opened.append(await stack.enter_async_context(clients[(i + 1) % n].workspace(project)))
        yield opened


async def run_load(opened: list[WorkspaceClient], runs: int, prompt: str) -> Load:
    """``runs`` prompts, each in its own session, spread over the workspaces, all at once;
    returns when each has ended."""
    load = Load()
    sessions = []
    for i in range(runs):
        ws = opened[i % len(opened)]
        sessions.append((ws, await ws.create_session()))
    started = time.perf_counter()

    async def send(ws: WorkspaceClient, session_id: str) -> None:
        handle = await ws.prompt(session_id, prompt)
        load.handles.append(handle)
        load.by_workspace.setdefault(ws.id, []).append(handle)

    async with trio.open_nursery() as nursery:
        for ws, session in sessions:
            nursery.start_soon(send, ws, session.id)
    with trio.fail_after(PHASE_TIMEOUT):
        for handle in load.handles:
            await handle.wait(timeout=None)
    load.seconds = time.perf_counter() - started
    return load


async def throughput(
    name: str,
    nodes: list[Node],
    projects: list[Path],
    runs: int,
    service_pids: Sequence[int] = (),
) -> dict[str, Any]:
    async with AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(connect(n.url, TOKEN, max_connections=200))
            for n in nodes
        ]
        async with workspaces(clients, projects) as opened:
            cpu0 = sum(cpu_seconds(n.process.pid) for n in nodes)
            svc0 = sum(tree_cpu_seconds(pid) for pid in service_pids)
            load = await run_load(opened, runs, SHORT_PROMPT)
            cpu = sum(cpu_seconds(n.process.pid) for n in nodes) - cpu0
            svc = sum(tree_cpu_seconds(pid) for pid in service_pids) - svc0
    failed = [h.run_id for h in load.handles if h.complete is None or h.complete.error]
    return {
        "setup": name,
        "runs": runs,
        "seconds": round(load.seconds, 2),
        "runs_per_s": round(runs / load.seconds, 1),
        "node_cpu_ms_per_run": round(1000 * cpu / runs, 2),
        "services_cpu_ms_per_run": round(1000 * svc / runs, 2),
        "failed": len(failed),
    }


def run_completes_in_log(redis_port: int, workspace_id: str) -> list[str]:
    """The run ids of the ``run_complete`` events in a workspace's Redis stream, in order."""
    from crush_trio.cluster.redislog import stream_key

    raw = subprocess.run(
        ["redis-cli", "-p", str(redis_port), "--json", "XRANGE", stream_key(workspace_id), "-",
         "+"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    found = []
    for _id, fields in json.loads(raw) if raw.strip() else []:
        event = json.loads(fields[1])
        if event["type"] == "run_complete":
            found.append(event["payload"]["payload"]["run_id"])
    return found


async def failover(
    nodes: list[Node], projects: list[Path], runs: int, redis_port: int
) -> dict[str, Any]:
    async with AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                connect(n.url, TOKEN, max_connections=200, reconnect_timeout=60)
            )
            for n in nodes
        ]
        async with workspaces(clients, projects) as opened:
            owners = {ws.id: clients[i % len(clients)].base_url for i, ws in enumerate(opened)}
            counts: dict[str, int] = {}
            for url in owners.values():
                counts[url] = counts.get(url, 0) + 1
            victim_url = max(counts, key=lambda u: counts[u])
            victim = next(n for n in nodes if n.url == victim_url)
            load = Load()
            sessions = [
                (opened[i % len(opened)], await opened[i % len(opened)].create_session())
                for i in range(runs)
            ]

            async def send(ws: WorkspaceClient, session_id: str) -> None:
                handle = await ws.prompt(session_id, LONG_PROMPT)
                load.handles.append(handle)
                load.by_workspace.setdefault(ws.id, []).append(handle)

            async with trio.open_nursery() as nursery:
                for ws, session in sessions:
                    nursery.start_soon(send, ws, session.id)
            with trio.fail_after(PHASE_TIMEOUT):
                for handle in load.handles:  # every run is streaming
                    async for _ in handle.events():
                        break
            victim.process.kill()
            killed = time.perf_counter()
            affected = [h for wid, hs in load.by_workspace.items() if owners[wid] == victim_url
                        for h in hs]  # fmt: skip
            last = 0.0
            with trio.fail_after(PHASE_TIMEOUT):
                for handle in affected:
                    await handle.wait(timeout=None)
                    last = max(last, time.perf_counter() - killed)
                for handle in load.handles:
                    await handle.wait(timeout=None)
            lost = 0
            for handle in load.handles:
                record = await handle.workspace.get_run(handle.run_id)
                if handle.complete is None or not record.status.terminal:
                    lost += 1
            workspaces_moved = sum(1 for url in owners.values() if url == victim_url)
    completes: dict[str, int] = {}
    for wid in load.by_workspace:
        for run_id in run_completes_in_log(redis_port, wid):
            completes[run_id] = completes.get(run_id, 0) + 1
    not_once = sum(1 for h in load.handles if completes.get(h.run_id) != 1)
    return {
        "runs": runs,
        "workspaces_on_killed_node": workspaces_moved,
        "runs_on_killed_node": len(affected),
        "lease_ttl_s": LEASE_TTL,
        "failover_s": round(last, 2),
        "runs_lost": lost,
        "runs_without_exactly_one_run_complete_in_the_log": not_once,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from tests.services import running_postgres, running_redis

    workdir = Path(tempfile.mkdtemp(prefix="crush-trio-bench-cluster-"))
    projects = []
    for i in range(args.workspaces):
        project = workdir / "projects" / f"p{i:02d}"
        project.mkdir(parents=True)
        projects.append(project)
    fast = workdir / "fast.json"
    fast.write_text(json.dumps(_config(5)))
    slow = workdir / "slow.json"
    slow.write_text(json.dumps(_config(50)))
    results: dict[str, Any] = {"runs": args.runs, "workspaces": args.workspaces}
    with running_postgres() as pg, running_redis() as redis:
        postmaster = int((pg.datadir / "postmaster.pid").read_text().split()[0])
        services = [postmaster, redis.process.pid]
        async with trio.open_nursery() as nursery:
            single = await start_node(nursery, workdir, "single", fast, [])
            results["single"] = await throughput("single node", [single], projects, args.runs)
            single.process.send_signal(signal.SIGTERM)
            await single.process.wait()
            for phase, config in (("cluster", fast), ("failover", slow)):
                pg.psql(f"CREATE DATABASE {phase}")
                redis.command("FLUSHALL")
                flags = [
                    "--cluster-database-url", pg.dsn(phase), "--cluster-redis-url", redis.url,
                    "--cluster-lease-ttl", str(LEASE_TTL),
                ]  # fmt: skip
                nodes = [
                    await start_node(
                        nursery, workdir, f"{phase}-{n}", config, [*flags, "--cluster-node-id", n]
                    )
                    for n in ("a", "b", "c")
                ]
                if phase == "cluster":
                    results["cluster"] = await throughput(
                        "3 nodes", nodes, projects, args.runs, services
                    )
                else:
                    results["failover"] = await failover(nodes, projects, args.runs, redis.port)
                for node in nodes:
                    if node.process.returncode is None:
                        node.process.send_signal(signal.SIGTERM)
                for node in nodes:
                    await node.process.wait()
            nursery.cancel_scope.cancel()
    results["workdir"] = str(workdir)
    return results


def report(results: dict[str, Any]) -> str:
    single, cluster, fo = results["single"], results["cluster"], results["failover"]
    lines = [
        "# Cluster workload",
        "",
        f"{results['runs']} concurrent runs over {results['workspaces']} workspaces, one session "
        "per run, echo model (20 words, 5 ms apart); client in the same machine (2 cores "
        "shared by everything).",
        "",
        "| setup | runs/s | node CPU ms/run | PostgreSQL + Redis CPU ms/run | failed |",
        "|---|---|---|---|---|",
    ]
    for row in (single, cluster):
        lines.append(
            f"| {row['setup']} | {row['runs_per_s']} | {row['node_cpu_ms_per_run']} | "
            f"{row['services_cpu_ms_per_run']} | {row['failed']} |"
        )
    lines += [
        "",
        f"Fail-over under load (runs of 120 words, 50 ms apart; lease TTL {fo['lease_ttl_s']} s):"
        f" kill -9 of the node owning {fo['workspaces_on_killed_node']} workspaces with "
        f"{fo['runs_on_killed_node']} runs streaming; the last of them had its `run_complete` "
        f"{fo['failover_s']} s after the kill; runs lost: {fo['runs_lost']} of {fo['runs']}; "
        "runs without exactly one `run_complete` in the log: "
        f"{fo['runs_without_exactly_one_run_complete_in_the_log']}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__)
    p.add_argument("--runs", type=int, default=150)
    p.add_argument("--workspaces", type=int, default=30)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cluster.md")
    args = p.parse_args(argv)
    results = trio.run(main_async, args)
    text = report(results)
    print(text)
    print(json.dumps(results, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
