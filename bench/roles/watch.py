"""The raw event-stream readers: the ``watch`` role (many connections reading until
``run_complete``, or idle until ``quit``) and the ``stall`` role (one that stops reading).
"""

from __future__ import annotations

import collections
import time
from typing import Any

import orjson
import trio

from crush_trio.client import CrushError, EventSocket, open_event_socket

from ..procs import TOKEN
from .common import (
    CLOSE_TIMEOUT,
    CONNECT_CONCURRENCY,
    CONNECT_TIMEOUT,
    GAP_MARK,
    RAW_QUEUE_SIZE,
    RUN_COMPLETE_MARK,
    Io,
    client_compression,
    client_deltas,
)

# ---------------------------------------------------------------------------------------------
# watch: many raw connections reading until run_complete (or idle until quit)


class Watch:
    """The ``count`` connections of one watch worker, and what they counted."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.count = int(cfg["count"])
        self.url: str = cfg["url"]
        self.wid: str = cfg["wid"]
        self.record_path: str | None = cfg.get("record")
        self.deltas = bool(cfg.get("deltas", client_deltas()))
        self.compression = bool(cfg.get("compression", client_compression()))
        self.recorded: list[str] = []
        self.stats: collections.Counter[str] = collections.Counter()
        self.closes: collections.Counter[str] = collections.Counter()
        self.frames_per_conn: list[int] = []
        self.bytes_per_conn: list[int] = []
        self.wire_per_conn: list[int] = []
        self.end_times: list[float] = []
        self.ready = trio.Event()
        self.all_ended = trio.Event()
        self.finish = trio.Event()
        self.reading_scopes: list[trio.CancelScope] = []
        self.handshakes = trio.Semaphore(CONNECT_CONCURRENCY)

    def settled(self) -> None:
        stats = self.stats
        if stats["connected"] + stats["failed"] == self.count:
            self.ready.set()
        if stats["ended"] + stats["failed"] == self.count:
            self.all_ended.set()

    async def connection(self, index: int) -> None:
        stats = self.stats
        holding = True
        await self.handshakes.acquire()
        try:
            async with open_event_socket(
                self.url,
                self.wid,
                TOKEN,
                timeout=CONNECT_TIMEOUT,
                message_queue_size=RAW_QUEUE_SIZE,
                deltas=self.deltas,
                compression=self.compression,
            ) as sock:
                stats["compressed"] += sock.compressed
                self.handshakes.release()
                holding = False
                stats["connected"] += 1
                self.settled()
                with trio.CancelScope() as scope:
                    self.reading_scopes.append(scope)
                    await self.read(sock, index)
                await self.finish.wait()
        except (CrushError, OSError) as exc:
            if holding:
                stats["failed"] += 1
                self.closes[type(exc).__name__] += 1
                self.settled()
        finally:
            if holding:
                self.handshakes.release()

    async def read(self, sock: EventSocket, index: int) -> None:
        """Read one connection until its ``run_complete`` (or its close), counting its frames."""
        stats = self.stats
        frames = size = 0
        wire_start = sock.wire_bytes
        async for text in sock:
            frames += 1
            n = len(text.encode())
            size += n
            stats["bytes"] += n
            if index == 0 and self.record_path:
                self.recorded.append(text)
            if GAP_MARK in text:
                stats["gaps"] += 1
            if RUN_COMPLETE_MARK in text:
                stats["run_complete"] += 1
                self.end_times.append(time.time())
                break
        else:
            self.closes[str(sock.close_code)] += 1
        stats["frames"] += frames
        wire = sock.wire_bytes - wire_start
        stats["wire_bytes"] += wire
        self.frames_per_conn.append(frames)
        self.bytes_per_conn.append(size)
        self.wire_per_conn.append(wire)
        stats["ended"] += 1
        self.settled()

    async def commands(self, io: Io) -> None:
        while (command := await io.recv()) is not None:
            if command["cmd"] == "quit":
                break
        self.finish.set()

    async def until_ended_or_finished(self) -> None:
        async with trio.open_nursery() as waiter:

            async def wait_for(event: trio.Event) -> None:
                await event.wait()
                waiter.cancel_scope.cancel()

            waiter.start_soon(wait_for, self.all_ended)
            waiter.start_soon(wait_for, self.finish)

    def done(self) -> dict[str, Any]:
        """The fields of the ``done`` event."""
        stats = self.stats
        return {
            "frames": stats["frames"],
            "bytes": stats["bytes"],
            "wire_bytes": stats["wire_bytes"],
            # Every connection negotiated permessage-deflate (the offer alone is not enough).
            "compressed": stats["connected"] > 0 and stats["compressed"] == stats["connected"],
            "gaps": stats["gaps"],
            "run_complete": stats["run_complete"],
            "ended": stats["ended"],
            "failed": stats["failed"],
            "closes": dict(self.closes),
            "min_frames": min(self.frames_per_conn, default=0),
            "min_bytes": min(self.bytes_per_conn, default=0),
            "max_bytes": max(self.bytes_per_conn, default=0),
            "min_wire_bytes": min(self.wire_per_conn, default=0),
            "max_wire_bytes": max(self.wire_per_conn, default=0),
            "max_frames": max(self.frames_per_conn, default=0),
            "last_end": max(self.end_times, default=0.0),
        }


async def role_watch(io: Io, cfg: dict[str, Any]) -> None:
    watch = Watch(cfg)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.commands, io)
        async with trio.open_nursery() as conns:
            for index in range(watch.count):
                conns.start_soon(watch.connection, index)
            await watch.ready.wait()
            await io.send("ready", connected=watch.stats["connected"], failed=watch.stats["failed"])
            await watch.until_ended_or_finished()
            if watch.record_path:
                _write_json(watch.record_path, watch.recorded)
            await io.send("done", **watch.done())
            await watch.finish.wait()
            for scope in watch.reading_scopes:
                scope.cancel()
            conns.cancel_scope.deadline = trio.current_time() + CLOSE_TIMEOUT
        nursery.cancel_scope.cancel()


def _write_json(path: str, data: Any) -> None:
    with open(path, "wb") as f:
        f.write(orjson.dumps(data))


# ---------------------------------------------------------------------------------------------
# stall: a client that stops reading


async def role_stall(io: Io, cfg: dict[str, Any]) -> None:
    # One frame buffered: once it waits unread, the connection stops reading the socket, so the
    # server's sends back up into the kernel buffers.
    async with open_event_socket(
        cfg["url"], cfg["wid"], TOKEN, timeout=CONNECT_TIMEOUT, message_queue_size=RAW_QUEUE_SIZE
    ) as sock:
        await io.send("ready")
        command = await io.recv()
        assert command is not None
        assert command["cmd"] == "drain"
        frames = gaps = 0
        got_complete = False
        with trio.move_on_after(float(command["timeout"])):
            async for text in sock:
                frames += 1
                gaps += GAP_MARK in text
                if RUN_COMPLETE_MARK in text:
                    got_complete = True
                    break
        await io.send(
            "done",
            frames=frames,
            gaps=gaps,
            run_complete=got_complete,
            close_code=sock.close_code,
            close_reason=sock.close_reason,
        )
