"""What the client workers share: the line protocol with the orchestrator, the bounds of
their connections, and the markers they look for in raw frames.
"""

from __future__ import annotations

import os
from typing import Any, Final

import orjson
import trio

from ..procs import LineReader

#: Websocket handshakes in flight at once per worker.
CONNECT_CONCURRENCY: Final = 64
#: Bound on opening one event-stream connection and receiving its hello (seconds); handshakes
#: queue behind :data:`CONNECT_CONCURRENCY`, so each is short, but 1,000 clients load the server.
CONNECT_TIMEOUT: Final = 60.0
#: Frames buffered per raw connection: one, so a client that stops reading stops reading its
#: socket (the stalled client of W4), as trio-websocket's default.
RAW_QUEUE_SIZE: Final = 1
#: Bound on the close handshakes of a watch worker's connections when it quits (seconds).
CLOSE_TIMEOUT: Final = 10.0
#: Bound on one HTTP request.
HTTP_TIMEOUT: Final = 30.0
#: The envelope of a ``run_complete`` / ``gap`` frame, as the server encodes it (no spaces).
RUN_COMPLETE_MARK: Final = '"type":"run_complete"'
GAP_MARK: Final = '"type":"gap"'
#: Set to ``0`` (``python -m bench --snapshots``), the ``runs`` and ``watch`` workers open their
#: streams without ``deltas=1`` and get whole ``message`` snapshots, as a Crush client does.
DELTAS_ENV: Final = "CRUSH_BENCH_DELTAS"


def client_deltas() -> bool:
    """Whether the workers ask for ``message_delta`` events (see :data:`DELTAS_ENV`)."""
    return os.environ.get(DELTAS_ENV, "1") != "0"


#: Set to ``0`` (``python -m bench --no-compression``), the ``watch`` workers do not offer
#: permessage-deflate, so their frames travel uncompressed (as a client that does not offer it).
COMPRESSION_ENV: Final = "CRUSH_BENCH_COMPRESSION"


def client_compression() -> bool:
    """Whether the ``watch`` workers offer permessage-deflate (see :data:`COMPRESSION_ENV`)."""
    return os.environ.get(COMPRESSION_ENV, "1") != "0"


# ---------------------------------------------------------------------------------------------
# The line protocol with the orchestrator


class Io:
    """JSON lines: commands from stdin, events to stdout (one writer at a time)."""

    def __init__(self) -> None:
        self._in = LineReader(trio.lowlevel.FdStream(os.dup(0)))
        self._out = trio.lowlevel.FdStream(os.dup(1))
        self._lock = trio.Lock()

    async def recv(self) -> dict[str, Any] | None:
        line = await self._in.readline()
        if line is None:
            return None
        command: dict[str, Any] = orjson.loads(line)
        return command

    async def send(self, event: str, **fields: Any) -> None:
        async with self._lock:
            await self._out.send_all(orjson.dumps({"event": event, **fields}) + b"\n")


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
