"""W3, fan-out: one run streaming to N websocket clients, against a bare trio-websocket server
pushing the same recorded frames to the same clients; and the paced fan-out: one run at a
realistic model speed watched by many clients, measured in bytes per client per character of the
reply and in server CPU."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import orjson

from .. import charts
from ..client import client_deltas
from ..procs import (
    child_process,
    cpu_seconds,
    python,
    server_process,
)
from ..report import Table, Target, WorkloadResult
from .common import (
    CLIENTS_PER_PROCESS,
    Ctx,
    all_events,
    bare_url,
    broadcast,
    fake_config,
    fake_model,
    fast_stream,
    hold_workspace,
    processes_for,
    rate,
    share,
    split,
    workers,
)
from .w3_sse import w3_paced_sse

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

# Targets: see docs/performance.md.
W3_RATIO_TARGET: Final = 0.50
#: Paced fan-out: bytes each client receives per character of the final reply, with
#: ``deltas=1`` and in snapshot mode (issue "Fan-out at the machine's limit").
PACED_BYTES_PER_CHAR_TARGET: Final = 2.0
PACED_SNAPSHOT_BYTES_PER_CHAR_TARGET: Final = 10.0
#: Paced fan-out: server CPU over the run, as a share of one core (deltas, snapshots).
PACED_CPU_TARGET: Final = 0.25
PACED_SNAPSHOT_CPU_TARGET: Final = 0.35
#: Paced fan-out with ``deltas=1``: server CPU per frame a client received (seconds).
PACED_CPU_PER_FRAME_TARGET: Final = 25e-6
#: Paced fan-out: updates reaching each client per second of the run, at least.
PACED_UPDATES_PER_SECOND_TARGET: Final = 10.0

#: How a recorded ``message``/``updated`` envelope continues after its ``seq`` field.
UPDATED_MESSAGE: Final = ',"type":"message","payload":{"type":"updated"'
#: How a recorded ``message_delta`` envelope continues after its ``seq`` field.
MESSAGE_DELTA: Final = ',"type":"message_delta"'


@dataclass
class FanOut:
    clients: int
    deliveries: int = 0
    cpu: float = 0.0
    wall: float = 0.0
    updates: int = 0
    frames: int = 0
    bytes: int = 0
    min_bytes: int = 0
    max_bytes: int = 0
    #: Bytes read from the sockets (frames as they travelled: compressed when negotiated).
    wire_bytes: int = 0
    min_wire_bytes: int = 0
    max_wire_bytes: int = 0
    compressed: bool = False
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
    compression: bool | None = None,
) -> FanOut:
    """Connect ``clients`` watchers of workspace ``wid`` at ``url`` over several processes, call
    ``start`` (async), and wait until every watcher saw ``run_complete`` (within ``within`` seconds,
    by default the phase timeout); ``measure`` reads the server's CPU seconds. ``compression``
    (None: the benchmark's default) says whether the watchers offer permessage-deflate."""
    procs = processes_for(clients)
    configs = [
        {
            "url": url,
            "wid": wid,
            "count": share,
            "record": str(record) if record and i == 0 else None,
            **({} if compression is None else {"compression": compression}),
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
        fan.bytes = sum(d["bytes"] for d in done)
        fan.min_bytes = min(d["min_bytes"] for d in done)
        fan.max_bytes = max(d["max_bytes"] for d in done)
        fan.wire_bytes = sum(d["wire_bytes"] for d in done)
        fan.min_wire_bytes = min(d["min_wire_bytes"] for d in done)
        fan.max_wire_bytes = max(d["max_wire_bytes"] for d in done)
        fan.compressed = all(d["compressed"] for d in done)
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
        "debounce off, so up to one update per token) to N websocket clients (`deltas=1`), "
        "against a bare trio-websocket server pushing the same recorded frames to the same "
        "clients",
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
    paced = await w3_paced(ctx, result)
    paced_sse = await w3_paced_sse(ctx, result) if s.w3_paced_sse_clients > 0 else None
    result.notes += [
        "Deliveries are websocket frames received by all clients from the prompt to the last "
        "client's `run_complete`; msgs/CPU-s divides them by the server process's CPU seconds "
        "over that interval (the run's own work: reading the model's stream, store writes, "
        "encoding, is included).",
        "The bare server replays exactly the frames the first client received from the real "
        "server (same count, same bytes) to the same number of clients from the same client "
        "processes. The clients ask for `deltas=1`, so each update is a `message_delta` event "
        "carrying only the appended text (a snapshot-mode client would get the whole message "
        "so far each time); when the server falls behind the model it coalesces tokens into "
        "fewer updates, so the update count drops as clients grow.",
        f"Clients are spread over one process per {CLIENTS_PER_PROCESS} clients.",
        "In the comparison with the bare server the clients do not offer permessage-deflate "
        "(the bare server negotiates none, so both push the same uncompressed frames); in the "
        "paced fan-out they do.",
    ]
    result.raw = {"levels": rows, "paced": paced, "paced_sse": paced_sse}
    result.chart = lambda path: charts.w3(path, result.raw)
    return result


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

        # No compression here: the bare server negotiates none, so both push the same frames.
        real = await watch_until_done(
            ctx, f"w3-{n}-watch", server.url, ws.id, n, start, server.cpu, record, compression=False
        )
    real.updates = sum(1 for frame in _read_frames(record) if _is_update(frame))
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
            compression=False,
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


def _is_update(frame: str) -> bool:
    """A streamed update of a message: a ``message_delta`` or a ``message`` ``updated``."""
    after_seq = frame.find(",")
    return frame.startswith(MESSAGE_DELTA, after_seq) or frame.startswith(
        UPDATED_MESSAGE, after_seq
    )


async def w3_paced(ctx: Ctx, result: WorkloadResult) -> dict[str, Any]:
    """The paced fan-out: one run of ``w3_paced_tokens`` tokens at ``w3_paced_delay_ms`` per
    token, default publish window, watched by ``w3_paced_clients`` raw websocket clients with
    ``deltas=1``. Reports bytes per client per character of the reply and the server's CPU as
    a share of one core from the prompt to the last client's ``run_complete``."""
    s = ctx.sizes
    n, tokens, delay = s.w3_paced_clients, s.w3_paced_tokens, s.w3_paced_delay_ms
    ctx.log(f"[W3] paced fan-out: {n} clients, {tokens} tokens at {delay:g} ms")
    fan, chars, kinds = await _paced_fan_out(ctx, n, tokens, delay, s.w3_paced_debounce_ms)
    per_char = fan.wire_bytes / n / chars if chars else float("nan")
    decoded_per_char = fan.bytes / n / chars if chars else float("nan")
    cpu_share = fan.cpu / fan.wall if fan.wall > 0 else float("nan")
    per_frame = fan.cpu / fan.deliveries if fan.deliveries else float("nan")
    updates_per_s = fan.deliveries / n / fan.wall if fan.wall > 0 else float("nan")
    wire = "permessage-deflate" if fan.compressed else "uncompressed"
    deltas = client_deltas()
    ctx.log(
        f"  {fan.wire_bytes / n:,.0f} bytes on the wire ({wire}; {fan.bytes / n:,.0f} decoded) "
        f"and {fan.deliveries / n:,.0f} frames per client for {chars:,} characters "
        f"({per_char:.2f} B/char on the wire, {decoded_per_char:.2f} decoded), server CPU "
        f"{fan.cpu:.2f} s over {fan.wall:.2f} s ({share(cpu_share)} of a core, "
        f"{per_frame * 1e6:.1f} µs per client-frame, {updates_per_s:.1f} updates a second per "
        f"client), run_complete {fan.complete}/{n}"
    )
    window = (
        "default publish window"
        if s.w3_paced_debounce_ms is None
        else f"publish window {s.w3_paced_debounce_ms:g} ms"
    )
    table = Table(
        f"Paced fan-out: one run of {tokens:,} tokens at {delay:g} ms per token (fake model, "
        f"{window}) watched by N websocket clients "
        + ("with `deltas=1`" if deltas else "in snapshot mode (`--snapshots`)")
        + f", {wire} on the wire",
        [
            "clients",
            "reply chars",
            "frames per client",
            "wire bytes per client",
            "wire bytes per reply char",
            "decoded bytes per client",
            "server CPU",
            "wall",
            "CPU share of one core",
            "CPU per client-frame",
            "updates a second per client",
            "gaps",
            "run_complete",
        ],
    )
    table.add(
        n,
        f"{chars:,}",
        f"{fan.deliveries / n:,.0f}",
        f"{fan.wire_bytes / n:,.0f} ({fan.min_wire_bytes:,} to {fan.max_wire_bytes:,})",
        f"{per_char:.2f}",
        f"{fan.bytes / n:,.0f} ({decoded_per_char:.2f} per char)",
        f"{fan.cpu:.2f} s",
        f"{fan.wall:.2f} s",
        share(cpu_share),
        f"{per_frame * 1e6:.1f} µs",
        f"{updates_per_s:.1f}",
        fan.gaps,
        f"{fan.complete}/{n}",
    )
    result.tables.append(table)
    result.notes.append(
        "Paced fan-out: bytes per reply character count what each client read from its socket "
        "from the prompt to its `run_complete` (frame headers included; compressed when the "
        "client offered permessage-deflate, as the benchmark's clients do unless "
        "`--no-compression`). One client's frames by type (count, decoded bytes): "
        + ", ".join(f"{k} {c:,} / {b:,} B" for k, (c, b) in sorted(kinds.items()))
    )
    result.targets += _paced_targets(
        n, per_char, cpu_share, per_frame, updates_per_s, fan.complete, deltas=deltas
    )
    return {
        "clients": n,
        "tokens": tokens,
        "delay_ms": delay,
        "reply_chars": chars,
        "frames": fan.deliveries,
        "bytes": fan.bytes,
        "wire_bytes": fan.wire_bytes,
        "compressed": fan.compressed,
        "bytes_per_client_char": per_char,
        "decoded_bytes_per_client_char": decoded_per_char,
        "server_cpu": fan.cpu,
        "wall": fan.wall,
        "cpu_share": cpu_share,
        "cpu_per_client_frame": per_frame,
        "updates_per_second": updates_per_s,
        "gaps": fan.gaps,
        "run_complete": fan.complete,
        "frame_kinds": kinds,
    }


def _paced_targets(
    n: int,
    per_char: float,
    cpu_share: float,
    per_frame: float,
    updates_per_s: float,
    complete: int,
    *,
    deltas: bool,
) -> list[Target]:
    """The paced fan-out's targets (docs/performance.md, "The fan-out at the machine's limit"):
    deltas and snapshot mode have their own bounds on bytes and CPU."""
    char_target = PACED_BYTES_PER_CHAR_TARGET if deltas else PACED_SNAPSHOT_BYTES_PER_CHAR_TARGET
    cpu_target = PACED_CPU_TARGET if deltas else PACED_SNAPSHOT_CPU_TARGET
    targets: list[Target] = []
    if deltas:
        targets.append(
            Target(
                f"paced fan-out: server CPU per client-frame, {n} clients",
                f"{per_frame * 1e6:.1f} µs",
                f"≤ {PACED_CPU_PER_FRAME_TARGET * 1e6:g} µs",
                per_frame <= PACED_CPU_PER_FRAME_TARGET,
            )
        )
    targets += [
        Target(
            f"paced fan-out: wire bytes per client per reply character, {n} clients",
            f"{per_char:.2f}",
            f"≤ {char_target:g}",
            per_char <= char_target,
        ),
        Target(
            f"paced fan-out: server CPU over the run, {n} clients",
            share(cpu_share),
            f"≤ {cpu_target:.0%} of one core",
            cpu_share <= cpu_target,
        ),
        Target(
            f"paced fan-out: updates reaching each client, {n} clients",
            f"{updates_per_s:.1f} a second",
            f"≥ {PACED_UPDATES_PER_SECOND_TARGET:g} a second",
            updates_per_s >= PACED_UPDATES_PER_SECOND_TARGET,
        ),
        Target(
            f"paced fan-out: every client got run_complete, {n} clients",
            f"{complete}/{n}",
            "all",
            complete == n,
        ),
    ]
    return targets


async def _paced_fan_out(
    ctx: Ctx, n: int, tokens: int, delay: float, debounce_ms: int | None
) -> tuple[FanOut, int, dict[str, list[int]]]:
    """Run the paced fan-out: its figures, the reply's characters and one client's frames by
    type (see :func:`w3_paced`); ``debounce_ms`` None leaves the server's publish window."""
    work = ctx.dir("w3-paced")
    handles: list[Any] = []
    fake = fake_model(ctx, "w3-paced-fake", "--tokens", str(tokens), "--delay-ms", f"{delay:g}")
    options = {} if debounce_ms is None else {"debounce_ms": debounce_ms}
    async with (
        fake as fake_url,
        server_process(fake_config(fake_url, options=options), work) as server,
        hold_workspace(server, work / "project") as ws,
    ):
        session = await ws.create_session("bench")

        async def start() -> None:
            handles.append(await ws.prompt(session.id, "Stream your tokens."))

        record = work / "frames.json"
        fan = await watch_until_done(
            ctx, "w3-paced-watch", server.url, ws.id, n, start, server.cpu, record
        )
        run = await ws.get_run(handles[0].run_id)
    kinds = _frame_kinds(_read_frames(record))
    ctx.log(f"  one client's frames by type (count, decoded bytes): {kinds}")
    return fan, len(run.text), kinds


def _frame_kinds(frames: list[str]) -> dict[str, list[int]]:
    """Frames of one client by event type: ``[count, UTF-8 bytes]``."""
    out: dict[str, list[int]] = {}
    for frame in frames:
        kind = str(orjson.loads(frame).get("type"))
        entry = out.setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += len(frame.encode())
    return out


def _read_frames(path: Path) -> list[str]:
    frames: list[str] = orjson.loads(path.read_bytes())
    return frames
