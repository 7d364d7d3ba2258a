"""Rounds of concurrent one-prompt sessions, measured from client worker processes (W1, W2)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from ..procs import cpu_seconds
from .common import (
    Ctx,
    all_events,
    broadcast,
    split,
    workers,
)

if TYPE_CHECKING:
    from pathlib import Path

    from ..procs import (
        ServerProcess,
    )

#: The server's count of reply reads its publish passes took in (docs/providers.md).
READS_TAKEN: Final = "crush_trio_provider_reads_taken_total"
#: A phase of runs gives up when no run has ended for this long (seconds).
STALL_AFTER: Final = 30.0


@dataclass
class LevelResult:
    mode: str
    n: int
    runs: int = 0
    completed: int = 0
    failed: int = 0
    missing: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    #: CPU of the commands the server ran and waited for (``bash``'s sandboxes).
    children_cpu: float = 0.0
    #: CPU of the client worker processes over the measured rounds (they share the cores).
    clients_cpu: float = 0.0
    #: The server's write calls, and its loop's sleeps, over the measured rounds
    #: (:func:`~bench.procs.loop_counts`).
    server_writes: int = 0
    server_sleeps: int = 0
    #: Reads of streaming replies the server's publish passes took in themselves
    #: (``crush_trio_provider_reads_taken_total`` over the measured rounds).
    reads_taken: int = 0
    tokens: int = 0
    events: int = 0
    hwm: int = 0
    gaps: int = 0
    first_text: list[float] = field(default_factory=list)
    #: Each measured round's first-text samples, in round order.
    round_first_text: list[list[float]] = field(default_factory=list)
    #: Submit → the model sent the run's first token (with a stamping model).
    first_token_sent: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    #: Tool name → latencies of its calls (call seen finished → result seen, by the clients).
    tool_latency: dict[str, list[float]] = field(default_factory=dict)
    tool_errors: int = 0

    @property
    def runs_per_s(self) -> float:
        return self.runs / self.wall if self.wall else float("nan")

    def per_run(self, total: float) -> float:
        """``total`` over the measured runs (NaN before any run)."""
        return total / self.runs if self.runs else float("nan")

    @property
    def cpu_per_run(self) -> float:
        return self.per_run(self.cpu)

    @property
    def clients_cpu_per_run(self) -> float:
        return self.per_run(self.clients_cpu)

    @property
    def writes_per_run(self) -> float:
        return self.per_run(self.server_writes)

    @property
    def sleeps_per_run(self) -> float:
        return self.per_run(self.server_sleeps)


async def run_rounds(
    ctx: Ctx,
    server: ServerProcess,
    project: Path,
    level: LevelResult,
    prompt_text: str,
    *,
    rounds: int,
    stamp: bool = False,
    warm_up: str | None = None,
) -> list[float]:
    """Run ``rounds`` rounds of ``level.n`` concurrent one-prompt sessions; returns the token
    latencies (when stamped). With ``warm_up``, one round of that prompt goes first, unmeasured,
    in the same client processes: it warms the server (provider client, connection pool, code
    paths) and the clients (connections, the client library's decoders)."""
    procs = 1 if level.n <= 10 else 2
    shares = split(level.n, procs)
    cfg = {
        "url": server.url,
        "project": str(project),
        "stamp": stamp,
        "connections": max(shares) + 8,
    }
    token_latency: list[float] = []
    async with workers(ctx, "runs", [cfg] * procs, f"w-{level.mode}-{level.n}") as ws:

        async def one_round(
            text: str, *, measured: bool = True
        ) -> tuple[list[dict[str, Any]], float, float, float]:
            """The workers' ``done`` events, the server's CPU seconds, the start time and the
            CPU seconds of the server's children."""
            for child, share in zip(ws, shares, strict=True):
                await child.send({"cmd": "sessions", "count": share})
            await all_events(ws, "sessions", 120)
            clients0 = sum(cpu_seconds(child.pid) for child in ws)
            # Scraped before the counts: the scrape is not the rounds' CPU or writes.
            taken0 = await server.metric(READS_TAKEN) if measured else 0.0
            counts0 = server.loop_counts()
            cpu0, t0, child0 = server.cpu(), time.time(), server.children_cpu()
            command = {
                "cmd": "go",
                "prompt": text,
                "timeout": ctx.sizes.phase_timeout,
                "stall": STALL_AFTER,
            }
            await broadcast(ws, command)
            done = await all_events(ws, "done", ctx.sizes.phase_timeout + 30)
            cpu, children = server.cpu() - cpu0, server.children_cpu() - child0
            if measured:
                level.clients_cpu += sum(cpu_seconds(child.pid) for child in ws) - clients0
                writes, sleeps = server.loop_counts()
                level.server_writes += writes - counts0[0]
                level.server_sleeps += sleeps - counts0[1]
                level.reads_taken += int(await server.metric(READS_TAKEN) - taken0)
            return done, cpu, t0, children

        await all_events(ws, "ready", 60)
        if warm_up is not None:
            await one_round(warm_up, measured=False)
        for r in range(rounds):
            done, cpu, t0, children_cpu = await one_round(prompt_text)
            level.cpu += cpu
            level.children_cpu += children_cpu
            level.wall += max(d["finished"] for d in done) - t0
            level.events += done[0]["frames"]
            level.round_first_text.append([x for d in done for x in d["first_text"]])
            for d in done:
                level.runs += d["runs"]
                level.completed += d["completed"]
                level.failed += d["failed"]
                level.missing += d["missing"]
                level.tokens += d["tokens"]
                level.gaps += d["gaps"]
                level.first_text += d["first_text"]
                level.first_token_sent += d.get("first_token_sent", [])
                level.latency += d["latency"]
                level.errors += d["errors"]
                level.tool_errors += d.get("tool_errors", 0)
                for tool, latencies in d.get("tool_latency", {}).items():
                    level.tool_latency.setdefault(tool, []).extend(latencies)
                token_latency += d["token_latency"]
                if d["drops"]:
                    level.errors.append(
                        f"the event stream dropped {d['drops']} time(s) (the client library "
                        "re-opened it with since)"
                    )
            if rounds > 1 and (r + 1) % max(1, rounds // 5) == 0:
                ctx.log(f"  round {r + 1}/{rounds}")
        await broadcast(ws, {"cmd": "quit"})
    level.hwm = server.memory().hwm
    return token_latency
