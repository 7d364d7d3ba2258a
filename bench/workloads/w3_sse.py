"""W3, the paced fan-out over SSE: the run of :func:`~.w3.w3_paced` watched by SSE clients in
snapshot mode, as Crush's client reads its events, with and without gzip.

Go's HTTP client asks for gzip and inflates it on its own, so a Crush client gets the gzip stream
(one compressor per stream, flushed per event): each ``message`` snapshot compresses against the
previous one. Measured in bytes on the wire per client per character of the reply, like the
websocket figure (it depends on the stream's content, not on the load, so a few clients do), and
in the server's CPU over the run (``--w3-sse-gzip-only`` leaves the plain streams out, so that it
is the gzip streams' alone).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Final

from ..procs import child_process, python, server_process
from ..report import Table, Target, WorkloadResult
from .common import Ctx, fake_config, fake_model, hold_workspace

#: SSE gzip, snapshot mode: bytes each client receives per character of the final reply.
SSE_GZIP_BYTES_PER_CHAR_TARGET: Final = 10.0
#: Bound on the SSE watchers connecting (seconds).
READY_TIMEOUT: Final = 120.0


async def w3_paced_sse(ctx: Ctx, result: WorkloadResult) -> dict[str, Any]:
    """One paced run (``w3_paced_tokens`` at ``w3_paced_delay_ms``) watched by
    ``w3_paced_sse_clients`` SSE clients asking for gzip and as many that do not."""
    s = ctx.sizes
    n, tokens, delay = s.w3_paced_sse_clients, s.w3_paced_tokens, s.w3_paced_delay_ms
    modes = ("gzip", "plain") if s.w3_paced_sse_plain else ("gzip",)
    kept = ", each after a GET on its kept-alive connection" if s.w3_paced_sse_keepalive else ""
    ctx.log(
        f"[W3] paced fan-out over SSE: {len(modes)} x {n} clients ({', '.join(modes)}), "
        f"{tokens} tokens at {delay:g} ms{kept}"
    )
    work = ctx.dir("w3-paced-sse")
    fake = fake_model(ctx, "w3-sse-fake", "--tokens", str(tokens), "--delay-ms", f"{delay:g}")
    argv = python("-m", "bench.sse_watch")
    async with (
        fake as fake_url,
        server_process(fake_config(fake_url), work) as server,
        hold_workspace(server, work / "project") as ws,
        contextlib.AsyncExitStack() as stack,
    ):
        children = {
            mode: (await stack.enter_async_context(child_process(f"w3-sse-{mode}", argv, work)))[0]
            for mode in modes
        }
        session = await ws.create_session("bench")
        for mode, child in children.items():
            gzip = mode == "gzip"
            await child.send(
                {
                    "url": server.url,
                    "wid": ws.id,
                    "count": n,
                    "gzip": gzip,
                    "keep_alive": s.w3_paced_sse_keepalive,
                }
            )
            ready = await child.recv_event("ready", READY_TIMEOUT)
            if ready["failed"] or ready["gzip"] != (n if gzip else 0):
                raise RuntimeError(f"SSE watchers (gzip={gzip}): {ready}")
            ctx.log(
                f"  SSE {mode}: {ready['closing']}/{n} streams served on the socket by the "
                "dispatcher (their answer says connection: close), the rest by the app's route"
            )
        cpu0, t0 = server.cpu(), time.monotonic()
        handle = await ws.prompt(session.id, "Stream your tokens.")
        done = {
            mode: await child.recv_event("done", s.phase_timeout)
            for mode, child in children.items()
        }
        cpu, wall = server.cpu() - cpu0, time.monotonic() - t0
        for child in children.values():
            await child.send({"cmd": "quit"})
        run = await ws.get_run(handle.run_id)
    ctx.log(
        f"  server CPU {cpu:.2f} s over {wall:.2f} s ({cpu / wall:.0%} of a core) for "
        f"{len(modes)} x {n} SSE clients"
    )
    chars = len(run.text)
    rows = {mode: _row(d, n, chars) for mode, d in done.items()}
    for mode, row in rows.items():
        ctx.log(
            f"  SSE {mode}: {row['frames_per_client']:,.0f} blocks and "
            f"{row['wire_bytes_per_client']:,.0f} bytes on the wire per client for {chars:,} "
            f"characters: {row['bytes_per_char']:.2f} B/char ({row['decoded_per_char']:.2f} "
            f"decoded), run_complete {row['run_complete']}/{n}, gaps {row['gaps']}"
        )
    result.tables.append(_table(rows, n, chars, tokens, delay))
    result.notes.append(
        f"Paced fan-out over SSE: server CPU {cpu:.2f} s over {wall:.2f} s "
        f"({cpu / wall:.0%} of a core) for {' and '.join(modes)} streams, {n} each."
    )
    gzip_per_char = rows["gzip"]["bytes_per_char"]
    result.targets.append(
        Target(
            "paced fan-out over SSE, snapshot mode, gzip: wire bytes per client per reply char",
            f"{gzip_per_char:.2f}",
            f"≤ {SSE_GZIP_BYTES_PER_CHAR_TARGET:g}",
            gzip_per_char <= SSE_GZIP_BYTES_PER_CHAR_TARGET,
        )
    )
    return {
        "clients": n,
        "tokens": tokens,
        "delay_ms": delay,
        "reply_chars": chars,
        "server_cpu": cpu,
        "wall": wall,
        "cpu_share": cpu / wall if wall > 0 else float("nan"),
        **rows,
    }


def _table(rows: dict[str, dict[str, Any]], n: int, chars: int, tokens: int, delay: float) -> Table:
    """The SSE table: one row per kind of stream."""
    table = Table(
        f"Paced fan-out over SSE: one run of {tokens:,} tokens at {delay:g} ms per token watched "
        f"by {n} SSE clients in snapshot mode (as Crush's client) asking for gzip"
        + (f", and {n} that do not" if len(rows) > 1 else ""),
        [
            "stream",
            "reply chars",
            "blocks per client",
            "wire bytes per client",
            "wire bytes per reply char",
            "decoded bytes per reply char",
            "gaps",
            "run_complete",
        ],
    )
    for mode, row in rows.items():
        table.add(
            "gzip (`Accept-Encoding: gzip`)" if mode == "gzip" else "plain",
            f"{chars:,}",
            f"{row['frames_per_client']:,.0f}",
            f"{row['wire_bytes_per_client']:,.0f}",
            f"{row['bytes_per_char']:.2f}",
            f"{row['decoded_per_char']:.2f}",
            row["gaps"],
            f"{row['run_complete']}/{n}",
        )
    return table


def _row(done: dict[str, Any], n: int, chars: int) -> dict[str, Any]:
    per = float(chars * n) if chars else float("nan")
    return {
        "frames_per_client": done["frames"] / n,
        "wire_bytes_per_client": done["wire_bytes"] / n,
        "bytes_per_char": done["wire_bytes"] / per,
        "decoded_per_char": done["bytes"] / per,
        "gaps": done["gaps"],
        "run_complete": done["run_complete"],
    }
