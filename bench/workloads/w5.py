"""W5, chaos: random prompts, cancels, clears, disconnects and provider failures; every accepted
run must end with exactly one ``run_complete``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import charts
from ..procs import (
    server_process,
)
from ..report import Table, Target, WorkloadResult
from .common import (
    Ctx,
    all_events,
    broadcast,
    fake_config,
    fake_model,
    hold_workspace,
    workers,
)

if TYPE_CHECKING:
    from .sizes import Sizes


async def w5(ctx: Ctx) -> WorkloadResult:
    s = ctx.sizes
    result = WorkloadResult("W5", "Chaos")
    ctx.log(f"[W5] chaos for {s.w5_seconds:g} s")
    done, cpu, exit_code, errors = await _chaos(ctx)
    total, ops, outcomes, rejected, wsstats, library = _sum_workers(done)
    result.tables += _tables(s, total, outcomes, ops, rejected, wsstats, library, errors, exit_code)
    ok = total["missing"] == 0 and total["duplicated"] == 0
    result.targets += [
        Target(
            "runs without exactly one run_complete",
            str(total["missing"] + total["duplicated"]),
            "0",
            ok,
        ),
        Target("errors logged by the server", str(len(errors)), "0", not errors),
    ]
    result.notes += [
        "The fake model fails 15% of requests with HTTP 500 and drops 5% mid-stream; the provider "
        "has `max_retries: 0`. Prompts aborted by the client mid-request, or sent over a "
        "websocket that closed before the reply, count as accepted when GET /runs/{id} finds "
        f"them ({total['uncertain_found']} did).",
        "Each client process checks every accepted run on two streams: the `run_complete` frames "
        "of a raw connection that is closed or cut and resumed with `since` (websocket rows), "
        "and the `run_complete` events of the client library's own stream, which the library "
        "re-opens with `since` after `drop_stream` (client library rows). A run counts once "
        "only with exactly one on each.",
        f"The client library's run handles (prompts sent with its `prompt`): "
        f"{library.get('handles_ended', 0)} of {library.get('handles', 0)} ended, "
        f"{library.get('handle_mismatches', 0)} with another outcome than the raw `run_complete`, "
        f"{library.get('handles_lost', 0)} lost.",
        f"Server CPU over the chaos: {cpu:.1f} s.",
    ]
    missing_runs = [m for d in done for m in d["missing_runs"]]
    if missing_runs:
        result.notes.append(f"runs without run_complete (first ones): {missing_runs[:5]}")
    if errors:
        result.notes.append("server errors (first ones): " + " | ".join(errors[:5]))
    result.raw = {
        "totals": total,
        "outcomes": outcomes,
        "ops": ops,
        "rejected": rejected,
        "ws": wsstats,
        "library": library,
        "errors": errors[:20],
        "exit_code": exit_code,
        "per_worker": done,
    }
    result.chart = lambda path: charts.w5(path, result.raw)
    return result


async def _chaos(ctx: Ctx) -> tuple[list[dict[str, Any]], float, int | None, list[str]]:
    """Run the chaos: each worker's ``done`` event, the server's CPU seconds over it, the
    server's exit code and the errors it logged."""
    s = ctx.sizes
    work = ctx.dir("w5")
    args = ("--tokens", "30", "--delay-ms", "5", "--fail-rate", "0.15", "--drop-rate", "0.05")
    config_kwargs: dict[str, Any] = {"provider": {"max_retries": 0}}
    async with fake_model(ctx, "w5-fake", *args) as fake_url:
        async with server_process(fake_config(fake_url, **config_kwargs), work) as server:
            project = work / "project"
            configs = [
                {
                    "url": server.url,
                    "project": str(project),
                    "seconds": s.w5_seconds,
                    "seed": 1 + i,
                    "sessions": s.w5_sessions,
                    "actors": s.w5_actors,
                    "think_max": 0.2,
                    "reconnect_max": 0.3,
                    "settle_timeout": 60,
                }
                for i in range(s.w5_workers)
            ]
            async with (
                hold_workspace(server, project),
                workers(ctx, "chaos", configs, "w5-chaos") as ws,
            ):
                await all_events(ws, "ready", 60)
                cpu0 = server.cpu()
                await broadcast(ws, {"cmd": "go"})
                done = await all_events(ws, "done", s.w5_seconds + 180)
                cpu = server.cpu() - cpu0
        exit_code = server.child.process.returncode
        errors = server.error_lines()
    return done, cpu, exit_code, errors


def _sum_workers(
    done: list[dict[str, Any]],
) -> tuple[
    dict[str, int], dict[str, int], dict[str, int], dict[str, int], dict[str, int], dict[str, int]
]:
    """The workers' figures added up: totals, operations, outcomes, refusals, websocket and
    client library counts."""
    total = {
        key: sum(d[key] for d in done)
        for key in ("accepted", "exactly_once", "missing", "duplicated", "uncertain_found")
    }
    ops: dict[str, int] = {}
    outcomes: dict[str, int] = {}
    rejected: dict[str, int] = {}
    wsstats: dict[str, int] = {}
    library: dict[str, int] = {}
    for d in done:
        for target, src in (
            (ops, d["ops"]),
            (outcomes, d["outcomes"]),
            (rejected, d["rejected"]),
            (wsstats, d["ws"]),
            (library, d["library"]),
        ):
            for k, v in src.items():
                target[k] = target.get(k, 0) + v
    return total, ops, outcomes, rejected, wsstats, library


def _tables(
    s: Sizes,
    total: dict[str, int],
    outcomes: dict[str, int],
    ops: dict[str, int],
    rejected: dict[str, int],
    wsstats: dict[str, int],
    library: dict[str, int],
    errors: list[str],
    exit_code: int | None,
) -> list[Table]:
    """W5's tables: the runs and their ``run_complete`` events, and the operations."""
    table = Table(
        f"{s.w5_seconds:g} s of random prompts, cancels, clears, disconnects and provider "
        f"failures ({s.w5_workers} client processes x {s.w5_actors} actors, "
        f"{s.w5_sessions} sessions each)",
        [
            "runs accepted",
            "exactly one run_complete",
            "none",
            "more than one",
            "completed / failed / cancelled",
            "server errors logged",
            "server exit code",
        ],
    )
    table.add(
        total["accepted"],
        total["exactly_once"],
        total["missing"],
        total["duplicated"],
        f"{outcomes.get('completed', 0)} / {outcomes.get('failed', 0)} / "
        f"{outcomes.get('cancelled', 0)}",
        len(errors),
        exit_code,
    )
    op_table = Table("Operations", ["operation", "count"])
    for k in sorted(ops):
        op_table.add(k, ops[k])
    for k in sorted(rejected):
        op_table.add(f"refused: {k}", rejected[k])
    for k in sorted(wsstats):
        op_table.add(f"websocket: {k}", wsstats[k])
    for k in sorted(library):
        op_table.add(f"client library: {k}", library[k])
    return [table, op_table]
