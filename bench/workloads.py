"""The five workloads (W1-W5), run by the orchestrator process.

Each workload starts a fresh server (``python -m crush_trio serve``) per measured configuration,
drives it from client worker processes (:mod:`bench.client`), reads the server's CPU time and
memory from ``/proc``, and returns a :class:`~bench.report.WorkloadResult` with its tables,
targets and chart.

The orchestrator talks to the server with the client library too (:func:`hold_workspace`): it
opens each workspace, and in W3 and W4 creates the session and sends the prompt that the
watching workers measure.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final

import orjson
import trio

from crush_trio.client import WorkspaceClient, connect

from . import charts
from .procs import (
    TOKEN,
    Child,
    RssSampler,
    ServerProcess,
    child_process,
    cpu_seconds,
    memory,
    python,
    server_process,
)
from .report import MB, Table, Target, WorkloadResult, mb, mean, ms, percentile

# Targets (issue "Load benchmarks"): see docs/performance.md.
W1_TARGET_LEVEL: Final = 50
W1_CPU_PER_RUN_TARGET: Final = 0.040  # seconds of server CPU per 200-token run
W1_PEAK_RSS_TARGET: Final = 200 * MB
W2_FIRST_TEXT_P50_TARGET: Final = 0.100  # seconds
W3_RATIO_TARGET: Final = 0.50
W4_IDLE_TARGET: Final = 40 * MB  # added by 1,000 idle websocket clients
W4_STALL_RSS_TARGET: Final = 20 * MB
W4_STALL_DURATION_TARGET: Final = 0.10
W4_SOAK_GROWTH_TARGET: Final = 0.10

#: Server bounds of every benchmarked server: the creating client's hold never lapses, so the
#: workspace lives for the whole measurement whatever the clients do.
BASE_SERVER: Final = {"create_grace": 86400.0}
#: How a recorded ``message``/``updated`` envelope continues after its ``seq`` field.
UPDATED_MESSAGE: Final = ',"type":"message","payload":{"type":"updated"'
#: A phase of runs gives up when no run has ended for this long (seconds).
STALL_AFTER: Final = 30.0
#: Websocket clients per client process in the fan-out and idle workloads.
CLIENTS_PER_PROCESS: Final = 250
#: Bound on one request of the orchestrator to the server (seconds).
REQUEST_TIMEOUT: Final = 60.0


@dataclass
class Sizes:
    """Every size of the benchmark; :data:`FULL` and :data:`SMOKE` are the presets."""

    w1_levels: list[int]
    w1_min_runs: int
    w1_tokens: int
    w1_modes: list[str]
    w2_runs: int
    #: Measured rounds of ``w2_runs`` concurrent runs; the percentiles pool every round's runs.
    w2_rounds: int
    w2_tokens: int
    w2_delay_ms: float
    w3_clients: list[int]
    w3_updates: int
    w3_delay_ms: float
    w4_idle: int
    w4_updates: int
    w4_delay_ms: float
    soak_runs: int
    soak_concurrency: int
    soak_per_session: int
    w5_seconds: float
    w5_workers: int
    w5_sessions: int
    w5_actors: int
    #: Bound on one measured phase (seconds); a hung phase fails the workload.
    phase_timeout: float = 180.0
    #: Settling time before an idle RSS reading (seconds).
    settle: float = 2.0
    #: W4: a warm-up run before the measured ones.
    w4_warmup: bool = True
    smoke: bool = False


FULL: Final = Sizes(
    w1_levels=[1, 10, 50, 200],
    w1_min_runs=100,
    w1_tokens=200,
    w1_modes=["fake", "echo"],
    w2_runs=50,
    w2_rounds=5,
    w2_tokens=200,
    w2_delay_ms=20.0,
    w3_clients=[10, 100, 1000],
    w3_updates=5000,
    w3_delay_ms=1.0,
    w4_idle=1000,
    w4_updates=5000,
    w4_delay_ms=1.0,
    soak_runs=10_000,
    soak_concurrency=8,
    soak_per_session=10,
    w5_seconds=60.0,
    w5_workers=2,
    w5_sessions=4,
    w5_actors=6,
)

SMOKE: Final = Sizes(
    w1_levels=[2],
    w1_min_runs=2,
    w1_tokens=20,
    w1_modes=["fake", "echo"],
    w2_runs=3,
    w2_rounds=2,
    w2_tokens=10,
    w2_delay_ms=20.0,
    w3_clients=[3],
    w3_updates=50,
    w3_delay_ms=1.0,
    w4_idle=10,
    w4_updates=100,
    w4_delay_ms=1.0,
    soak_runs=20,
    soak_concurrency=2,
    soak_per_session=5,
    w5_seconds=3.0,
    w5_workers=1,
    w5_sessions=2,
    w5_actors=3,
    phase_timeout=60.0,
    settle=0.3,
    w4_warmup=False,
    smoke=True,
)


@dataclass
class Ctx:
    """What every workload gets: sizes, a scratch directory and a progress printer."""

    sizes: Sizes
    workdir: Path
    log: Callable[[str], None]
    scratch: list[Path] = field(default_factory=list)

    def dir(self, name: str) -> Path:
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=True)
        return path


# ---------------------------------------------------------------------------------------------
# Building blocks


def fake_config(
    base_url: str,
    *,
    server: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    provider: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A crush.json pointing both models at the fake model server."""
    return {
        "providers": {
            "fake": {
                "type": "openai-compat",
                "base_url": f"{base_url}/v1",
                "api_key": "x",
                "models": [{"id": "fake"}],
                **(provider or {}),
            }
        },
        "models": {
            "large": {"provider": "fake", "model": "fake"},
            "small": {"provider": "fake", "model": "fake"},
        },
        "options": options or {},
        "server": {**BASE_SERVER, **(server or {})},
    }


def echo_config(
    delay_ms: float = 0.0,
    *,
    server: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A crush.json using the built-in echo model (replies with the prompt's words)."""
    return {
        "providers": {"echo": {"type": "echo", "delay_ms": delay_ms}},
        "models": {"large": {"provider": "echo", "model": "echo"}},
        "options": options or {},
        "server": {**BASE_SERVER, **(server or {})},
    }


def words(count: int, word: str | None = None) -> str:
    """A prompt the echo model answers with ``count`` tokens: ``w0 w1 ...``, or ``word``
    repeated (the smallest growth of a streamed message per token)."""
    return " ".join(word if word is not None else f"w{i}" for i in range(count))


@asynccontextmanager
async def fake_model(ctx: Ctx, name: str, *args: str) -> AsyncIterator[str]:
    """Run ``python -m bench.fake ARGS``; yields its base URL."""
    argv = python("-m", "bench.fake", "--port", "0", *args)
    async with child_process(name, argv, ctx.dir(name), "fake-llm listening on ") as (_, line):
        yield line.split(" on ", 1)[1].strip()


@asynccontextmanager
async def hold_workspace(server: ServerProcess, project: Path) -> AsyncIterator[WorkspaceClient]:
    """Open the workspace of ``project`` with the client library and hold it for the block.

    The hold keeps the workspace alive between generations of client processes (the server's
    create grace is a day, :data:`BASE_SERVER`). It is opened without an event stream
    (``events=False``): the orchestrator only sends work, and a stream of its own would be one
    more client receiving every event, which W3 and W4 would measure.
    """
    _mkdir(project)
    async with (
        connect(server.url, TOKEN, request_timeout=REQUEST_TIMEOUT) as client,
        client.workspace(project, events=False) as ws,
    ):
        yield ws


@asynccontextmanager
async def workers(
    ctx: Ctx, role: str, configs: Sequence[dict[str, Any]], name: str
) -> AsyncIterator[list[Child]]:
    """Start one ``bench.client ROLE`` process per config; they are stopped on exit."""
    async with AsyncExitStack() as stack:
        children: list[Child] = []
        for index, cfg in enumerate(configs):
            child = await Child.start(
                f"{name}-{index}", python("-m", "bench.client", role), log_dir=ctx.dir(name)
            )
            stack.push_async_callback(child.stop)
            await child.send(cfg)
            children.append(child)
        yield children


async def all_events(children: Sequence[Child], name: str, within: float) -> list[dict[str, Any]]:
    """The next ``name`` event of every child, in order (each within ``within`` seconds)."""
    return [await child.recv_event(name, within) for child in children]


def _mkdir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)


async def broadcast(children: Sequence[Child], command: dict[str, Any]) -> None:
    for child in children:
        await child.send(command)


def split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def bare_url(line: str) -> str:
    """The address of the bare server from its ``listening on ws://HOST:PORT`` line, in the form
    the client library takes (``http://HOST:PORT``); it accepts any workspace path."""
    return "http://" + line.split(" on ", 1)[1].strip().removeprefix("ws://")


def processes_for(clients: int) -> int:
    return max(1, math.ceil(clients / CLIENTS_PER_PROCESS))


def rate(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:,.0f}"


def share(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.0%}"


def pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


# ---------------------------------------------------------------------------------------------
# W1: throughput


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

    @property
    def runs_per_s(self) -> float:
        return self.runs / self.wall if self.wall else float("nan")

    @property
    def cpu_per_run(self) -> float:
        return self.cpu / self.runs if self.runs else float("nan")


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

        async def one_round(text: str) -> tuple[list[dict[str, Any]], float, float]:
            """The workers' ``done`` events, the server's CPU seconds and the start time."""
            for child, share in zip(ws, shares, strict=True):
                await child.send({"cmd": "sessions", "count": share})
            await all_events(ws, "sessions", 120)
            cpu0, t0 = server.cpu(), time.time()
            command = {
                "cmd": "go",
                "prompt": text,
                "timeout": ctx.sizes.phase_timeout,
                "stall": STALL_AFTER,
            }
            await broadcast(ws, command)
            done = await all_events(ws, "done", ctx.sizes.phase_timeout + 30)
            return done, server.cpu() - cpu0, t0

        await all_events(ws, "ready", 60)
        if warm_up is not None:
            await one_round(warm_up)
        for r in range(rounds):
            done, cpu, t0 = await one_round(prompt_text)
            level.cpu += cpu
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
    result.chart = lambda path: charts.w1(path, result.raw)
    return result


# ---------------------------------------------------------------------------------------------
# W2: latency


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
    p50 = percentile(first, 50)
    result.targets += [
        Target("first visible text p50", ms(p50), "≤ 100 ms", p50 <= W2_FIRST_TEXT_P50_TARGET),
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
    ]
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
    }
    result.chart = lambda path: charts.w2(path, result.raw)
    return result


# ---------------------------------------------------------------------------------------------
# W3: fan-out


@dataclass
class FanOut:
    clients: int
    deliveries: int = 0
    cpu: float = 0.0
    wall: float = 0.0
    updates: int = 0
    frames: int = 0
    gaps: int = 0
    complete: int = 0
    closes: dict[str, int] = field(default_factory=dict)

    @property
    def per_cpu(self) -> float:
        """NaN when the CPU time was too short to measure (under one clock tick)."""
        return self.deliveries / self.cpu if self.cpu > 0 else float("nan")


async def watch_until_done(
    ctx: Ctx,
    name: str,
    url: str,
    wid: str,
    clients: int,
    start: Callable[[], Any],
    measure: Callable[[], float],
    record: Path | None = None,
    within: float | None = None,
) -> FanOut:
    """Connect ``clients`` watchers of workspace ``wid`` at ``url`` over several processes, call
    ``start`` (async), and wait until every watcher saw ``run_complete`` (within ``within`` seconds,
    by default the phase timeout); ``measure`` reads the server's CPU seconds."""
    procs = processes_for(clients)
    configs = [
        {
            "url": url,
            "wid": wid,
            "count": share,
            "record": str(record) if record and i == 0 else None,
        }
        for i, share in enumerate(split(clients, procs))
    ]
    fan = FanOut(clients)
    async with workers(ctx, "watch", configs, name) as ws:
        ready = await all_events(ws, "ready", 300)
        failed = sum(r["failed"] for r in ready)
        if failed:
            raise RuntimeError(f"{name}: {failed} of {clients} websocket clients failed to connect")
        cpu0, t0 = measure(), time.time()
        await start()
        done = await all_events(ws, "done", within or ctx.sizes.phase_timeout)
        fan.cpu = measure() - cpu0
        fan.wall = max(d["last_end"] for d in done) - t0
        fan.deliveries = sum(d["frames"] for d in done)
        fan.gaps = sum(d["gaps"] for d in done)
        fan.complete = sum(d["run_complete"] for d in done)
        for d in done:
            for code, n in d["closes"].items():
                fan.closes[code] = fan.closes.get(code, 0) + n
        await broadcast(ws, {"cmd": "quit"})
    return fan


async def w3(ctx: Ctx) -> WorkloadResult:
    s = ctx.sizes
    result = WorkloadResult("W3", "Fan-out")
    table = Table(
        f"One run streaming {s.w3_updates:,} tokens (fake model, {s.w3_delay_ms:g} ms per token, "
        "debounce off, so up to one update per token) to N websocket clients, against a bare "
        "trio-websocket server pushing the same recorded frames to the same clients",
        [
            "clients",
            "client procs",
            "updates published",
            "server: deliveries",
            "server: msgs/CPU-s",
            "server: wall",
            "gaps",
            "bare: msgs/CPU-s",
            "bare: wall",
            "ratio",
        ],
    )
    rows: list[dict[str, Any]] = []
    stream = fast_stream(ctx, "w3-fake", s.w3_updates, s.w3_delay_ms)
    async with stream as fake_url:
        for n in s.w3_clients:
            rows.append(await w3_level(ctx, n, fake_url, result, table))
    result.tables.append(table)
    result.notes += [
        "Deliveries are websocket frames received by all clients from the prompt to the last "
        "client's `run_complete`; msgs/CPU-s divides them by the server process's CPU seconds "
        "over that interval (the run's own work: reading the model's stream, store writes, "
        "encoding, is included).",
        "The bare server replays exactly the frames the first client received from the real "
        "server (same count, same bytes) to the same number of clients from the same client "
        "processes. Each `message` event carries the whole message so far (here up to "
        f"{2 * s.w3_updates:,} characters of text); when the server falls behind the model it "
        "coalesces tokens into fewer updates, so the update count drops as clients grow.",
        f"Clients are spread over one process per {CLIENTS_PER_PROCESS} clients.",
    ]
    result.raw = {"levels": rows}
    result.chart = lambda path: charts.w3(path, result.raw)
    return result


def fast_stream(ctx: Ctx, name: str, tokens: int, delay_ms: float) -> Any:
    """A fake model streaming ``tokens`` tokens of ``x `` (the smallest growth of a message per
    update) with ``delay_ms`` between them."""
    return fake_model(
        ctx, name, "--tokens", str(tokens), "--delay-ms", f"{delay_ms:g}", "--token-text", "x "
    )


async def w3_level(
    ctx: Ctx, n: int, fake_url: str, result: WorkloadResult, table: Table
) -> dict[str, Any]:
    """One client count: the real server, then the bare ceiling with the recorded frames."""
    ctx.log(f"[W3] {n} clients: server")
    config = fake_config(fake_url, options={"debounce_ms": 0})
    work = ctx.dir(f"w3-{n}")
    record = work / "frames.json"
    async with (
        server_process(config, work) as server,
        hold_workspace(server, work / "project") as ws,
    ):
        session = await ws.create_session("bench")

        async def start() -> None:
            await ws.prompt(session.id, "Stream your tokens.")

        real = await watch_until_done(
            ctx, f"w3-{n}-watch", server.url, ws.id, n, start, server.cpu, record
        )
    real.updates = sum(
        1 for frame in _read_frames(record) if frame.startswith(UPDATED_MESSAGE, frame.find(","))
    )
    ctx.log(
        f"  {real.deliveries:,} deliveries, {rate(real.per_cpu)} msgs/CPU-s, "
        f"run_complete {real.complete}/{n}, closes {real.closes or 'none'}; bare ceiling"
    )
    argv = python("-m", "bench.bare", "--port", "0", "--frames", str(record))
    async with child_process(f"w3-{n}-bare", argv, work, "bare-ws listening on ") as (bare, line):

        async def go() -> None:
            assert bare.process.stdin is not None
            await bare.process.stdin.send_all(b"go\n")

        # The bare server sends every recorded frame as fast as the clients read them: as many
        # bytes as the real run moved, which at 1,000 clients can take longer than a phase.
        ceiling = await watch_until_done(
            ctx,
            f"w3-{n}-bare-watch",
            bare_url(line),
            "bare",
            n,
            go,
            partial(cpu_seconds, bare.pid),
            within=max(ctx.sizes.phase_timeout, BARE_TIMEOUT_FACTOR * real.wall),
        )
    ratio = real.per_cpu / ceiling.per_cpu if ceiling.per_cpu else float("nan")
    ctx.log(f"  bare {rate(ceiling.per_cpu)} msgs/CPU-s, ratio {share(ratio)}")
    table.add(
        n,
        processes_for(n),
        f"{real.updates:,}",
        f"{real.deliveries:,}",
        rate(real.per_cpu),
        f"{real.wall:.2f} s",
        real.gaps,
        rate(ceiling.per_cpu),
        f"{ceiling.wall:.2f} s",
        share(ratio),
    )
    result.targets.append(
        Target(
            f"msgs per CPU-second vs bare ceiling, {n} clients",
            share(ratio),
            "≥ 50%",
            ratio >= W3_RATIO_TARGET,
        )
    )
    result.targets.append(
        Target(
            f"every client got run_complete, {n} clients",
            f"{real.complete}/{n}",
            "all",
            real.complete == n,
        )
    )
    return {
        "clients": n,
        "updates": real.updates,
        "deliveries": real.deliveries,
        "server_cpu": real.cpu,
        "server_per_cpu": real.per_cpu,
        "server_wall": real.wall,
        "gaps": real.gaps,
        "closes": real.closes,
        "run_complete": real.complete,
        "bare_deliveries": ceiling.deliveries,
        "bare_cpu": ceiling.cpu,
        "bare_per_cpu": ceiling.per_cpu,
        "bare_wall": ceiling.wall,
        "ratio": ratio,
    }


#: The bare ceiling of W3 gets this many times the real server's wall time (at least a phase).
BARE_TIMEOUT_FACTOR: Final = 6.0


def _read_frames(path: Path) -> list[str]:
    frames: list[str] = orjson.loads(path.read_bytes())
    return frames


# ---------------------------------------------------------------------------------------------
# W4: memory


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
    s = ctx.sizes
    result = WorkloadResult("W4", "Memory")
    raw: dict[str, Any] = {}

    # -- idle clients ---------------------------------------------------------------------------
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
            "≤ 40 MB",
            scaled <= W4_IDLE_TARGET,
        )
    )

    # -- a stalled client -----------------------------------------------------------------------
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

    # -- soak -----------------------------------------------------------------------------------
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
    result.raw = raw
    result.chart = lambda path: charts.w4(path, result.raw)
    return result


# ---------------------------------------------------------------------------------------------
# W5: chaos


async def w5(ctx: Ctx) -> WorkloadResult:
    s = ctx.sizes
    result = WorkloadResult("W5", "Chaos")
    ctx.log(f"[W5] chaos for {s.w5_seconds:g} s")
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
    result.tables.append(table)
    op_table = Table("Operations", ["operation", "count"])
    for k in sorted(ops):
        op_table.add(k, ops[k])
    for k in sorted(rejected):
        op_table.add(f"refused: {k}", rejected[k])
    for k in sorted(wsstats):
        op_table.add(f"websocket: {k}", wsstats[k])
    for k in sorted(library):
        op_table.add(f"client library: {k}", library[k])
    result.tables.append(op_table)
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


WORKLOADS: Final = {"W1": w1, "W2": w2, "W3": w3, "W4": w4, "W5": w5}
