"""Every size of the benchmark, with the full and the smoke presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


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
    #: The paced fan-out of W3: one run of ``w3_paced_tokens`` tokens at ``w3_paced_delay_ms``
    #: per token (the default publish window) watched by ``w3_paced_clients`` clients.
    w3_paced_clients: int
    w3_paced_tokens: int
    w3_paced_delay_ms: float
    #: ... and watched over SSE, in snapshot mode, by this many clients that ask for gzip and as
    #: many that do not (0: not measured).
    w3_paced_sse_clients: int
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
    #: W6: length of the mixed-load soak (minutes).
    soak_minutes: float
    #: W7: concurrent tool-heavy runs per round, measured rounds, tool calls per run and tokens
    #: of each run's final reply.
    w7_sessions: int
    w7_rounds: int
    w7_tool_calls: int
    w7_tokens: int
    #: Bound on one measured phase (seconds); a hung phase fails the workload. The paced fan-out
    #: to 5,000 clients takes about 320 s on a 2-core machine: its 20 client processes read 5
    #: million frames.
    phase_timeout: float = 600.0
    #: Settling time before an idle RSS reading (seconds).
    settle: float = 2.0
    #: W4: a warm-up run before the measured ones.
    w4_warmup: bool = True
    #: W3's paced fan-out over SSE: also as many plain (uncompressed) clients as gzip ones.
    w3_paced_sse_plain: bool = True
    #: W3's paced fan-out over SSE: each stream asked for on a kept-alive connection after a
    #: ``GET`` of the workspace (Go's HTTP client reuses idle connections).
    w3_paced_sse_keepalive: bool = False
    #: W3's paced fan-out: the server's publish window (``options.debounce_ms``); None leaves the
    #: server's default (33 ms, Crush's), so about 30 updates a second reach each client. 100
    #: gives the 10 updates a second that the fan-out's targets are held to at least.
    w3_paced_debounce_ms: int | None = None
    #: W2: also run its rounds against OpenCode's server (:mod:`bench.peer_opencode`, npm) and
    #: report the ratio of the CPU per run, the form W2's CPU target is stated in.
    w2_peer: bool = False
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
    w3_paced_clients=1000,
    w3_paced_tokens=1000,
    w3_paced_delay_ms=20.0,
    w3_paced_sse_clients=20,
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
    soak_minutes=60.0,
    w7_sessions=10,
    w7_rounds=3,
    w7_tool_calls=80,
    w7_tokens=20,
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
    w3_paced_clients=5,
    w3_paced_tokens=60,
    w3_paced_delay_ms=20.0,
    w3_paced_sse_clients=2,
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
    soak_minutes=0.25,
    w7_sessions=2,
    w7_rounds=1,
    w7_tool_calls=8,
    w7_tokens=5,
    phase_timeout=60.0,
    settle=0.3,
    w4_warmup=False,
    smoke=True,
)
