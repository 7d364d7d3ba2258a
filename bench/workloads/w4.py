"""W4, memory: idle websocket clients, a client that never reads, and a soak of short runs."""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, Final

import trio

from .. import charts
from ..procs import (
    Child,
    RssSampler,
    ServerProcess,
    child_process,
    memory,
    python,
    server_process,
)
from ..report import MB, Table, Target, WorkloadResult, mb, mean, ms
from .common import (
    Ctx,
    all_events,
    bare_url,
    broadcast,
    echo_config,
    fake_config,
    fast_stream,
    hold_workspace,
    pct,
    processes_for,
    split,
    words,
    workers,
)

if TYPE_CHECKING:
    from crush_trio.client import WorkspaceClient

# Targets (issue "Load benchmarks"): see docs/performance.md.
W4_IDLE_TARGET: Final = 20 * MB  # added by 1,000 idle websocket clients (20 KB each)
W4_STALL_RSS_TARGET: Final = 20 * MB
W4_STALL_DURATION_TARGET: Final = 0.10
W4_SOAK_GROWTH_TARGET: Final = 0.10


async def idle_rss(
    ctx: Ctx, name: str, pid: int, url: str, wid: str, clients: int
) -> tuple[int, int, int]:
    """RSS before and with ``clients`` idle websocket clients of workspace ``wid`` at ``url``;
    returns (before, with, failed)."""
    await trio.sleep(ctx.sizes.settle)
    before = memory(pid).rss
    procs = processes_for(clients)
    configs = [{"url": url, "wid": wid, "count": share} for share in split(clients, procs)]
    async with workers(ctx, "watch", configs, name) as ws:
        ready = await all_events(ws, "ready", 300)
        await trio.sleep(ctx.sizes.settle)
        after = memory(pid).rss
        await broadcast(ws, {"cmd": "quit"})
        await all_events(ws, "done", 60)
    return before, after, sum(r["failed"] for r in ready)


async def stall_run(
    ctx: Ctx,
    server: ServerProcess,
    ws: WorkspaceClient,
    text: str,
    name: str,
    *,
    stalled: bool,
    drain_after: float,
) -> dict[str, Any]:
    """One streaming run watched by a reading client, plus (when ``stalled``) one that never
    reads until the run is over."""
    session = await ws.create_session("bench")
    watched = {"url": server.url, "wid": ws.id}
    async with AsyncExitStack() as stack:
        (reader,) = await stack.enter_async_context(
            workers(ctx, "watch", [{**watched, "count": 1}], f"{name}-reader")
        )
        await reader.recv_event("ready", 60)
        staller: Child | None = None
        if stalled:
            (staller,) = await stack.enter_async_context(
                workers(ctx, "stall", [watched], f"{name}-stall")
            )
            await staller.recv_event("ready", 60)
        before = server.memory().rss
        sampler = RssSampler(server.pid)
        async with sampler.running():
            t0 = time.time()
            await ws.prompt(session.id, text)
            done = await reader.recv_event("done", ctx.sizes.phase_timeout)
        out: dict[str, Any] = {
            "duration": done["last_end"] - t0,
            "rss_before": before,
            "rss_peak": sampler.peak,
            "reader_frames": done["frames"],
            "reader_complete": done["run_complete"],
        }
        if staller is not None:
            await trio.sleep(drain_after)
            out["rss_after_stall"] = server.memory().rss
            await staller.send({"cmd": "drain", "timeout": 30})
            out["stalled"] = await staller.recv_event("done", 60)
        await reader.send({"cmd": "quit"})
    return out


async def w4(ctx: Ctx) -> WorkloadResult:
    result = WorkloadResult("W4", "Memory")
    raw: dict[str, Any] = {}
    await w4_idle(ctx, result, raw)
    await w4_stall(ctx, result, raw)
    await w4_soak(ctx, result, raw)
    result.raw = raw
    result.chart = lambda path: charts.w4(path, result.raw)
    return result


async def w4_idle(ctx: Ctx, result: WorkloadResult, raw: dict[str, Any]) -> None:
    """RSS added by idle websocket clients, against a bare trio-websocket server."""
    s = ctx.sizes
    ctx.log(f"[W4] RSS with {s.w4_idle} idle websocket clients")
    idle = Table(
        f"RSS with 0 and {s.w4_idle:,} idle websocket clients",
        ["server", "RSS, 0 clients", f"RSS, {s.w4_idle:,} clients", "added", "per client"],
    )
    work = ctx.dir("w4-idle")
    async with (
        server_process(echo_config(), work) as server,
        hold_workspace(server, work / "project") as ws,
    ):
        before, after, failed = await idle_rss(
            ctx, "w4-idle", server.pid, server.url, ws.id, s.w4_idle
        )
    if failed:
        result.notes.append(f"{failed} idle clients failed to connect to the server")
    added = after - before
    idle.add("crush-trio", mb(before), mb(after), mb(added), f"{added / s.w4_idle / 1024:.1f} KB")
    raw["idle"] = {"clients": s.w4_idle, "before": before, "after": after, "added": added}
    async with child_process(
        "w4-bare", python("-m", "bench.bare", "--port", "0"), work, "bare-ws listening on "
    ) as (bare, line):
        b_before, b_after, _ = await idle_rss(
            ctx, "w4-bare-idle", bare.pid, bare_url(line), "bare", s.w4_idle
        )
    b_added = b_after - b_before
    idle.add(
        "bare trio-websocket (reference)",
        mb(b_before),
        mb(b_after),
        mb(b_added),
        f"{b_added / s.w4_idle / 1024:.1f} KB",
    )
    raw["idle_bare"] = {"before": b_before, "after": b_after, "added": b_added}
    result.tables.append(idle)
    scaled = added * 1000 / s.w4_idle
    result.targets.append(
        Target(
            "1,000 idle clients add" + (" (scaled)" if s.w4_idle != 1000 else ""),
            mb(scaled),
            f"≤ {W4_IDLE_TARGET / MB:g} MB",
            scaled <= W4_IDLE_TARGET,
        )
    )


async def w4_stall(ctx: Ctx, result: WorkloadResult, raw: dict[str, Any]) -> None:
    """A client that never reads during a streaming run: the server's RSS and the run's duration."""
    s = ctx.sizes
    ctx.log(f"[W4] a stalled client during a {s.w4_updates}-token run")
    # The defaults of the server (must-deliver 2 s, TCP_USER_TIMEOUT 2 s); shorter in smoke mode.
    scale = 0.25 if s.smoke else 1.0
    server_opts = {"must_deliver_timeout": 2.0 * scale, "tcp_user_timeout_ms": int(2000 * scale)}
    drain_after = server_opts["must_deliver_timeout"] + server_opts["tcp_user_timeout_ms"] / 1000
    work = ctx.dir("w4-stall")
    runs = {}
    async with (
        fast_stream(ctx, "w4-fake", s.w4_updates, s.w4_delay_ms) as fake_url,
        server_process(
            fake_config(fake_url, options={"debounce_ms": 0}, server=server_opts), work
        ) as server,
        hold_workspace(server, work / "project") as ws,
    ):
        plan = [("A", False), ("B", True), ("A2", False)]
        if s.w4_warmup:
            plan.insert(0, ("warm-up", False))
        for label, stalled in plan:
            ctx.log(f"  run {label}" + (" (with a stalled client)" if stalled else ""))
            runs[label] = await stall_run(
                ctx,
                server,
                ws,
                "Stream your tokens.",
                f"w4-{label}",
                stalled=stalled,
                drain_after=drain_after + ctx.sizes.settle,
            )
        stall_warnings = [line for line in server.warning_lines() if "too slow" in line]
    base = mean([runs["A"]["duration"], runs["A2"]["duration"]])
    b = runs["B"]
    change = b["duration"] / base - 1
    stall_rss = b["rss_peak"] - max(runs["A"]["rss_peak"], runs["A2"]["rss_peak"])
    st = b["stalled"]
    if st["run_complete"]:
        ending = "got run_complete"
    elif st["close_code"] is not None:
        ending = f"closed {st['close_code']} {st['close_reason']!r}".strip()
    else:
        ending = "nothing after the frames it had"
    stall = Table(
        "A run streaming to one reading client, without (A, A2) and with (B) a client that "
        "never reads",
        ["run", "duration", "RSS before", "peak RSS", "reader frames"],
    )
    for label in ("A", "B", "A2"):
        r = runs[label]
        stall.add(
            label,
            f"{r['duration']:.2f} s",
            mb(r["rss_before"]),
            mb(r["rss_peak"]),
            r["reader_frames"],
        )
    result.tables.append(stall)
    result.notes.append(
        f"The stalled client, drained after the run: {st['frames']} frames ({st['gaps']} gap), "
        f"then {ending}. Server log: {len(stall_warnings)} 'too slow' disconnect(s)."
    )
    result.targets += [
        Target(
            "stalled client adds (peak RSS, B - A)",
            mb(stall_rss),
            "≤ 20 MB",
            stall_rss <= W4_STALL_RSS_TARGET,
        ),
        Target(
            "stalled client changes the run's duration",
            pct(change),
            "≤ ±10%",
            abs(change) <= W4_STALL_DURATION_TARGET,
        ),
    ]
    raw["stall"] = {
        "runs": runs,
        "duration_change": change,
        "stall_rss": stall_rss,
        "ending": ending,
        "warnings": stall_warnings[:5],
    }


async def w4_soak(ctx: Ctx, result: WorkloadResult, raw: dict[str, Any]) -> None:
    """Many short runs: RSS growth after warm-up."""
    s = ctx.sizes
    ctx.log(f"[W4] soak: {s.soak_runs:,} short runs")
    work = ctx.dir("w4-soak")
    progress: list[tuple[int, int]] = []
    project = work / "project"
    async with server_process(echo_config(), work) as server, hold_workspace(server, project):
        cfg = {"url": server.url, "project": str(project), "connections": 32}
        async with workers(ctx, "runs", [cfg], "w4-soak") as (soaker,):
            await soaker.recv_event("ready", 60)
            every = max(1, s.soak_runs // 50)
            cpu0 = server.cpu()
            progress.append((0, server.memory().rss))
            await soaker.send(
                {
                    "cmd": "soak",
                    "runs": s.soak_runs,
                    "concurrency": s.soak_concurrency,
                    "per_session": s.soak_per_session,
                    "prompt": words(20),
                    "progress_every": every,
                    "timeout": 60,
                }
            )
            while True:
                event = await soaker.recv(300)
                if event["event"] == "progress":
                    progress.append((event["done"], server.memory().rss))
                    if event["done"] % max(1, s.soak_runs // 10) < every:
                        ctx.log(f"  {event['done']:,} runs, RSS {mb(progress[-1][1])}")
                elif event["event"] == "done":
                    soak_done = event
                    break
            cpu = server.cpu() - cpu0
            await soaker.send({"cmd": "quit"})
        hwm = server.memory().hwm
    warm_at = max(1, s.soak_runs // 10)
    warm = next((rss for done, rss in progress if done >= warm_at), progress[-1][1])
    end = progress[-1][1]
    growth = (end - warm) / warm
    wall = soak_done["finished"] - soak_done["started"]
    soak = Table(
        f"Soak: {s.soak_runs:,} short runs (echo, 20 words), {s.soak_concurrency} sessions at a "
        f"time, a new session every {s.soak_per_session} runs",
        [
            "runs",
            "failed/missing",
            "runs/s",
            "CPU/run",
            "RSS at start",
            f"RSS after {warm_at:,} runs",
            "RSS at end",
            "growth",
            "peak RSS",
        ],
    )
    soak.add(
        soak_done["done"],
        soak_done["failed"] + soak_done["missing"],
        f"{soak_done['done'] / wall:.0f}",
        ms(cpu / max(1, soak_done["done"])),
        mb(progress[0][1]),
        mb(warm),
        mb(end),
        pct(growth),
        mb(hwm),
    )
    result.tables.append(soak)
    result.targets += [
        Target(
            "soak RSS growth after warm-up", pct(growth), "≤ 10%", growth <= W4_SOAK_GROWTH_TARGET
        ),
        Target(
            "soak: every run completed",
            f"{soak_done['done'] - soak_done['failed'] - soak_done['missing']}/{s.soak_runs}",
            "all",
            soak_done["failed"] + soak_done["missing"] + soak_done["duplicates"] == 0,
        ),
    ]
    raw["soak"] = {
        "runs": s.soak_runs,
        "progress": progress,
        "warm": warm,
        "end": end,
        "growth": growth,
        "runs_per_s": soak_done["done"] / wall,
        "cpu_per_run": cpu / max(1, soak_done["done"]),
    }
