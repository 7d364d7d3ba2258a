"""W1, throughput: N concurrent sessions, one prompt each, at the fake and the echo model."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Final

from .. import charts
from ..procs import (
    server_process,
)
from ..report import MB, Table, Target, WorkloadResult, mb, ms, percentile
from .common import (
    Ctx,
    echo_config,
    fake_config,
    fake_model,
    hold_workspace,
    words,
)
from .rounds import STALL_AFTER, LevelResult, run_rounds

if TYPE_CHECKING:
    from .sizes import Sizes

# Targets (issue "Load benchmarks"): see docs/performance.md.
W1_TARGET_LEVEL: Final = 50
W1_CPU_PER_RUN_TARGET: Final = 0.040  # seconds of server CPU per 200-token run
W1_PEAK_RSS_TARGET: Final = 200 * MB


async def w1(ctx: Ctx) -> WorkloadResult:
    s = ctx.sizes
    result = WorkloadResult("W1", "Throughput")
    table = Table(
        f"N concurrent sessions, one prompt each, {s.w1_tokens}-token replies at 0 ms/token",
        [
            "model",
            "N",
            "runs",
            "wall",
            "runs/s",
            "tokens/s to clients",
            "server CPU/run",
            "peak RSS",
            "events/run",
            "first text p50",
            "run p50",
            "failed",
        ],
    )
    levels: list[LevelResult] = []
    async with fake_model(ctx, "w1-fake", "--tokens", str(s.w1_tokens)) as fake_url:
        for mode in s.w1_modes:
            for n in s.w1_levels:
                ctx.log(f"[W1] {mode} model, N={n}")
                config = fake_config(fake_url) if mode == "fake" else echo_config(0)
                text = "Reply with your tokens." if mode == "fake" else words(s.w1_tokens)
                level = LevelResult(mode, n)
                project = ctx.dir(f"w1-{mode}-{n}") / "project"
                async with (
                    server_process(config, ctx.dir(f"w1-{mode}-{n}")) as server,
                    hold_workspace(server, project),
                ):
                    rounds = max(1, math.ceil(s.w1_min_runs / n))
                    await run_rounds(ctx, server, project, level, text, rounds=rounds)
                levels.append(level)
                table.add(
                    mode,
                    n,
                    level.runs,
                    f"{level.wall:.2f} s",
                    f"{level.runs_per_s:.1f}",
                    f"{level.tokens / level.wall:,.0f}" if level.wall else "n/a",
                    ms(level.cpu_per_run),
                    mb(level.hwm),
                    f"{level.events / level.runs:.1f}" if level.runs else "n/a",
                    ms(percentile(level.first_text, 50)),
                    ms(percentile(level.latency, 50)),
                    level.failed + level.missing,
                )
                ctx.log(
                    f"  {level.runs} runs in {level.wall:.2f} s, "
                    f"{ms(level.cpu_per_run)} CPU/run, peak RSS {mb(level.hwm)}"
                )
    result.tables.append(table)
    _report(result, levels, s)
    result.chart = lambda path: charts.w1(path, result.raw)
    return result


def _report(result: WorkloadResult, levels: list[LevelResult], s: Sizes) -> None:
    """W1's targets, notes and raw figures, from its levels."""
    fake_levels = [lv for lv in levels if lv.mode == s.w1_modes[0]]
    at = next((lv for lv in fake_levels if lv.n == W1_TARGET_LEVEL), fake_levels[-1])
    where = f"{at.mode} model, N={at.n}"
    result.targets += [
        Target(
            f"server CPU per run ({where})",
            ms(at.cpu_per_run),
            "≤ 40 ms",
            at.cpu_per_run <= W1_CPU_PER_RUN_TARGET,
        ),
        Target(f"peak RSS ({where})", mb(at.hwm), "≤ 200 MB", at.hwm <= W1_PEAK_RSS_TARGET),
        Target(
            "every run completed",
            f"{sum(lv.completed for lv in levels)}/{sum(lv.runs for lv in levels)}",
            "all",
            all(lv.completed == lv.runs for lv in levels),
        ),
    ]
    result.notes += [
        "wall = first submit to last `run_complete`; server CPU = user+system time of the server "
        "process (all threads) over the same interval, from /proc/<pid>/stat.",
        "events/run = websocket frames one watching client received per run (all events of the "
        "workspace); sessions are created with a title, so no title request is made.",
        f"N≤10 uses one client process, larger N two; rounds of N runs repeat until at least "
        f"{s.w1_min_runs} runs were measured.",
    ]
    result.notes.append(
        "failed = runs refused or ended with an error, plus runs whose `run_complete` never "
        f"arrived (the phase gives up {STALL_AFTER:g} s after the last run ended): "
        + ", ".join(f"{lv.mode} N={lv.n}: {lv.missing} missing" for lv in levels if lv.missing)
        if any(lv.missing for lv in levels)
        else "failed = runs refused or ended with an error, plus runs whose `run_complete` "
        "never arrived (none)."
    )
    if any(lv.errors for lv in levels):
        result.notes.append(
            "errors: " + "; ".join(sorted({e for lv in levels for e in lv.errors})[:5])
        )
    result.raw = {
        "levels": [
            {
                "mode": lv.mode,
                "n": lv.n,
                "runs": lv.runs,
                "completed": lv.completed,
                "missing": lv.missing,
                "wall": lv.wall,
                "runs_per_s": lv.runs_per_s,
                "tokens_per_s": lv.tokens / lv.wall if lv.wall else None,
                "cpu_per_run": lv.cpu_per_run,
                "peak_rss": lv.hwm,
                "events_per_run": lv.events / lv.runs if lv.runs else None,
                "first_text_p50": percentile(lv.first_text, 50),
                "latency_p50": percentile(lv.latency, 50),
            }
            for lv in levels
        ]
    }
