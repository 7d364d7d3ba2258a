"""``python -m bench.sse_watch``: SSE watchers of the paced fan-out (W3), in their own process.

Speaks the line protocol of :mod:`bench.client` (the configuration as the first JSON line on
stdin, then commands; events on stdout). It opens ``count`` SSE streams of workspace ``wid`` the
way Crush's client does: no ``deltas`` (whole ``message`` snapshots) unless the configuration
says ``"deltas": true``, and ``Accept-Encoding: gzip`` as Go's HTTP client sends it (``"gzip":
false``: ``identity``). It reads each body raw, as it travelled (compressed when the server
answered ``Content-Encoding: gzip``), inflates it here, and counts bytes on the wire, decoded
bytes and SSE blocks until the stream's ``run_complete``. With ``"keep_alive": true`` each stream
is asked for on a connection of its own that first answered a ``GET`` of the workspace (the
connection kept alive, as Go's HTTP client reuses idle ones).

Events: ``ready`` (every stream got its ``hello``; ``connected``, ``failed``, ``gzip``: how many
answered gzip, ``closing``: how many answered ``Connection: close``, the dispatcher's answer) and ``done`` (``wire_bytes``, ``bytes``, ``frames``, ``gaps``, ``run_complete``,
``last_end``), then it waits for ``quit``.
"""

from __future__ import annotations

import collections
import contextlib
import time
import traceback
import uuid
import zlib
from typing import Any, Final

import httpx
import trio

from .procs import TOKEN, raise_fd_limit
from .roles.common import GAP_MARK, RUN_COMPLETE_MARK, Io

#: Bound on connecting one stream and reading its ``hello`` (seconds).
CONNECT_TIMEOUT: Final = 60.0
#: Streams opened at once.
CONNECT_CONCURRENCY: Final = 32
_HELLO: Final = b'"type":"hello"'
_RUN_COMPLETE: Final = RUN_COMPLETE_MARK.encode()
_GAP: Final = GAP_MARK.encode()


async def watch(io: Io, cfg: dict[str, Any]) -> None:
    count = int(cfg["count"])
    params = {"deltas": "1"} if cfg.get("deltas") else {}
    encoding = "gzip" if cfg.get("gzip", True) else "identity"
    stats: collections.Counter[str] = collections.Counter()
    end_times: list[float] = []
    ready, all_ended, finish = trio.Event(), trio.Event(), trio.Event()
    opening = trio.Semaphore(CONNECT_CONCURRENCY)

    def settled() -> None:
        if stats["connected"] + stats["failed"] == count:
            ready.set()
        if stats["ended"] + stats["failed"] == count:
            all_ended.set()

    async def stream(shared: httpx.AsyncClient) -> None:
        holding = [True]  # the opening slot, released at the stream's hello
        await opening.acquire()
        try:
            async with contextlib.AsyncExitStack() as stack:
                client = shared
                if cfg.get("keep_alive"):
                    client = await stack.enter_async_context(_one_connection(cfg["url"]))
                    (await client.get(f"/v1/workspaces/{cfg['wid']}")).raise_for_status()
                await read_stream(client, holding)
            stats["ended"] += 1
            settled()
        except (httpx.HTTPError, OSError):
            if holding[0]:
                stats["failed"] += 1
                settled()
        finally:
            if holding[0]:
                opening.release()

    async def read_stream(client: httpx.AsyncClient, holding: list[bool]) -> None:
        async with client.stream(
            "GET",
            f"/v1/workspaces/{cfg['wid']}/events",
            params={"client_id": str(uuid.uuid4()), **params},
            headers={"Accept-Encoding": encoding},
        ) as response:
            response.raise_for_status()
            gzipped = response.headers.get("content-encoding") == "gzip"
            inflater = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzipped else None
            buffer = b""
            async for chunk in response.aiter_raw():
                stats["wire_bytes"] += len(chunk)
                data = inflater.decompress(chunk) if inflater is not None else chunk
                stats["bytes"] += len(data)
                buffer += data
                *blocks, buffer = buffer.split(b"\n\n")
                stats["frames"] += len(blocks)
                if holding[0] and any(_HELLO in b for b in blocks):
                    holding[0] = False
                    opening.release()
                    stats["connected"] += 1
                    stats["gzip"] += gzipped
                    stats["closing"] += response.headers.get("connection") == "close"
                    settled()
                stats["gaps"] += sum(_GAP in b for b in blocks)
                if any(_RUN_COMPLETE in b for b in blocks):
                    stats["run_complete"] += 1
                    end_times.append(time.time())
                    break

    async def commands() -> None:
        while (command := await io.recv()) is not None:
            if command["cmd"] == "quit":
                break
        finish.set()

    limits = httpx.Limits(max_connections=count + 1, max_keepalive_connections=0)
    timeout = httpx.Timeout(CONNECT_TIMEOUT, read=None)
    async with (
        httpx.AsyncClient(
            base_url=cfg["url"],
            headers={"Authorization": f"Bearer {TOKEN}"},
            limits=limits,
            timeout=timeout,
        ) as client,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(commands)
        async with trio.open_nursery() as streams:
            for _ in range(count):
                streams.start_soon(stream, client)
            await ready.wait()
            await io.send(
                "ready",
                connected=stats["connected"],
                failed=stats["failed"],
                gzip=stats["gzip"],
                closing=stats["closing"],
            )
            await _first_of(all_ended, finish)
            await _send_done(io, stats, end_times)
            streams.cancel_scope.cancel()
        await finish.wait()
        nursery.cancel_scope.cancel()


def _one_connection(url: str) -> httpx.AsyncClient:
    """A client of its own for one stream: one connection, kept alive between requests."""
    return httpx.AsyncClient(
        base_url=url,
        headers={"Authorization": f"Bearer {TOKEN}"},
        limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
        timeout=httpx.Timeout(CONNECT_TIMEOUT, read=None),
    )


async def _first_of(*events: trio.Event) -> None:
    """Wait until any of ``events`` is set."""
    async with trio.open_nursery() as waiter:

        async def wait_for(event: trio.Event) -> None:
            await event.wait()
            waiter.cancel_scope.cancel()

        for event in events:
            waiter.start_soon(wait_for, event)


async def _send_done(io: Io, stats: collections.Counter[str], end_times: list[float]) -> None:
    """Report what the streams read to the orchestrator."""
    await io.send(
        "done",
        wire_bytes=stats["wire_bytes"],
        bytes=stats["bytes"],
        frames=stats["frames"],
        gaps=stats["gaps"],
        run_complete=stats["run_complete"],
        last_end=max(end_times, default=0.0),
    )


async def _main() -> None:
    io = Io()
    cfg = await io.recv()
    if cfg is None:
        return
    try:
        await watch(io, cfg)
    except Exception:
        await io.send("error", message=traceback.format_exc()[-4000:])
        raise


def main() -> None:
    raise_fd_limit()
    try:
        trio.run(_main)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
