"""W2, latency: first visible text and token latency of concurrent runs at a paced model."""

from __future__ import annotations

from typing import Final

from .. import charts, peer_opencode
from ..procs import (
    server_process,
)
from ..report import Table, Target, WorkloadResult, mb, ms, percentile
from .common import (
    Ctx,
    fake_config,
    fake_model,
    hold_workspace,
)
from .rounds import LevelResult, run_rounds

# Target (issue "Load benchmarks"): see docs/performance.md.
W2_FIRST_TEXT_P50_TARGET: Final = 0.100  # seconds
#: Server CPU per run at most this share of OpenCode's in the same run (``--w2-peer``).
W2_PEER_CPU_RATIO_TARGET: Final = 0.1
#: Token sent by the model → visible to a client, p99 (issue "Fan-out at the machine's limit").
W2_TOKEN_P99_TARGET: Final = 0.050  # seconds


async def w2(ctx: Ctx) -> WorkloadResult:
    s = ctx.sizes
    result = WorkloadResult("W2", "Latency")
    ctx.log(
        f"[W2] {s.w2_rounds} rounds of {s.w2_runs} runs at {s.w2_delay_ms:g} ms/token, "
        f"{s.w2_tokens} tokens"
    )
    args = ("--tokens", str(s.w2_tokens), "--delay-ms", f"{s.w2_delay_ms:g}", "--stamp")
    level = LevelResult("fake", s.w2_runs)
    project = ctx.dir("w2") / "project"
    async with (
        fake_model(ctx, "w2-fake", *args) as fake_url,
        server_process(fake_config(fake_url), ctx.dir("w2")) as server,
        hold_workspace(server, project),
    ):
        token_latency = await run_rounds(
            ctx,
            server,
            project,
            level,
            "Reply with your tokens.",
            rounds=s.w2_rounds,
            stamp=True,
            warm_up="Warm up.",
        )
    first, lat = level.first_text, token_latency
    round_p50 = [percentile(r, 50) for r in level.round_first_text]
    table = Table(
        f"N={s.w2_runs} concurrent runs, {s.w2_tokens} tokens at {s.w2_delay_ms:g} ms/token, "
        f"{s.w2_rounds} rounds (the percentiles pool every round's runs)",
        ["measure", "samples", "p50", "p95", "p99", "max"],
    )
    rows = [
        ("submit → first visible text", first),
        ("of which: submit → the model sent its first token", level.first_token_sent),
        ("token sent by the model → visible to the client", lat),
        ("submit → run_complete", level.latency),
    ]
    for label, values in rows:
        quantiles = [ms(percentile(values, q)) for q in (50, 95, 99)]
        table.add(label, len(values), *quantiles, ms(max(values, default=float("nan"))))
    result.tables.append(table)
    p50, token_p99 = percentile(first, 50), percentile(lat, 99)
    result.targets += [
        Target("first visible text p50", ms(p50), "≤ 100 ms", p50 <= W2_FIRST_TEXT_P50_TARGET),
        Target("token → visible p99", ms(token_p99), "≤ 50 ms", token_p99 <= W2_TOKEN_P99_TARGET),
        Target(
            "every run completed",
            f"{level.completed}/{level.runs}",
            "all",
            level.completed == level.runs,
        ),
    ]
    result.notes += [
        "Each round sends one prompt to each of N new sessions at once and waits for every "
        "run_complete; first visible text p50 of each round: "
        + ", ".join(ms(x) for x in round_p50)
        + ". On a machine where the server shares its cores with the fake model and the "
        "clients, one round's p50 depends on how the cores are shared at the burst; pooling "
        "the rounds steadies the figure.",
        "The fake model stamps each token with its send time (time.time()); a client takes the "
        "latency of a token when the first `message` event containing it arrives. Streamed "
        "message updates are coalesced for up to `options.debounce_ms` (33 ms by default), "
        "which bounds how fresh a token can be.",
        "The first text is the model's first token: 'submit → the model sent its first token' "
        "is the part before the model sent it (the prompt reaching the server, the run's start, "
        "the model request and the fake model's answer, whose first text token follows its "
        "headers by the token delay); the rest is its way back to the client.",
        f"Server CPU per run at this pace: {ms(level.cpu_per_run)}; peak RSS {mb(level.hwm)}; "
        f"gap frames (lossy events dropped for a full client queue): {level.gaps}.",
        f"The server's write calls per run: {level.writes_per_run:.0f} (its sockets and files, "
        f"every thread); its loop slept and was woken {level.sleeps_per_run:.0f} times per run; "
        f"its publish passes took {level.per_run(level.reads_taken):.0f} reads of each reply in "
        "themselves (without waking the reply's stream task).",
        f"The client processes' CPU per run: {ms(level.clients_cpu_per_run)} "
        "(the client library following each run, and the benchmark's bookkeeping); they share "
        "the machine's cores with the server and the fake model.",
    ]
    if s.w2_peer:
        await _against_opencode(ctx, result, level.cpu_per_run)
    result.raw = {
        "first_text": first,
        "first_token_sent": level.first_token_sent,
        "token_latency": lat,
        "run_latency": level.latency,
        "first_text_p50": p50,
        "round_first_text_p50": round_p50,
        "token_p50": percentile(lat, 50),
        "token_p99": percentile(lat, 99),
        "cpu_per_run": level.cpu_per_run,
        "clients_cpu_per_run": level.clients_cpu_per_run,
    }
    result.chart = lambda path: charts.w2(path, result.raw)
    return result


async def _against_opencode(ctx: Ctx, result: WorkloadResult, ours: float) -> None:
    """The same rounds against OpenCode's server, right after ours (``--w2-peer``)."""
    s = ctx.sizes
    ctx.log(f"[W2] the same rounds against OpenCode {peer_opencode.VERSION}")
    theirs = await peer_opencode.measure(
        runs=s.w2_runs, rounds=s.w2_rounds, tokens=s.w2_tokens, delay_ms=s.w2_delay_ms, log=ctx.log
    )
    per_run = theirs.cpu / theirs.runs
    ratio = ours / per_run
    result.targets.append(
        Target(
            "server CPU per run / OpenCode's (same run)",
            f"{ms(ours)} / {ms(per_run)} = {ratio:.3f}",
            f"≤ {W2_PEER_CPU_RATIO_TARGET:g}",
            ratio <= W2_PEER_CPU_RATIO_TARGET,
        )
    )
    result.notes.append(
        f"OpenCode {peer_opencode.VERSION} on the same rounds (python -m bench.peer_opencode): "
        f"{ms(per_run)} of CPU per run, first text p50 "
        f"{ms(percentile(theirs.first_text, 50))}, token p99 "
        f"{ms(percentile(theirs.token_latency, 99))}."
    )
