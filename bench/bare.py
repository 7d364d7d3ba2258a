"""The ceiling for the fan-out workload: a bare ``trio_websocket`` server pushing pre-encoded frames.

It does nothing but what a websocket fan-out must do: accept, send a ``hello`` frame, and once it
reads ``go`` on stdin, send every frame of ``--frames`` (a JSON list of strings, recorded from the
real server's run) to every connected client, in order. No broker, no store, no HTTP framework:
the difference between its messages per CPU-second and the real server's is what the server's
layers cost.

Usage::

    python -m bench.bare --port 0 [--frames FILE]

prints ``bare-ws listening on ws://127.0.0.1:PORT`` (flushed), then waits for ``go`` lines.
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Final

import orjson
import trio
from trio_websocket import ConnectionClosed, WebSocketRequest, serve_websocket

from .procs import LineReader, raise_fd_limit

if TYPE_CHECKING:
    from collections.abc import Sequence

#: Largest frame accepted from a client (they send none).
MAX_MESSAGE: Final = 16 * 1024 * 1024
HELLO: Final = '{"seq":0,"type":"hello","payload":{"workspace_id":"bare","server_version":"0"}}'


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bare", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--frames", type=Path, default=None)
    args = parser.parse_args(argv)
    raise_fd_limit()
    frames: list[str] = orjson.loads(args.frames.read_bytes()) if args.frames else []
    go = trio.Event()

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        try:
            await ws.send_message(HELLO)
            await go.wait()
            for frame in frames:
                await ws.send_message(frame)
            while True:  # until the client closes
                await ws.get_message()
        except ConnectionClosed:
            pass

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(
                partial(
                    serve_websocket,
                    handler,
                    args.host,
                    args.port,
                    None,
                    max_message_size=MAX_MESSAGE,
                )
            )
            print(f"bare-ws listening on ws://{args.host}:{server.port}", flush=True)
            stdin = LineReader(trio.lowlevel.FdStream(os.dup(0)))
            while (line := await stdin.readline()) is not None:
                if line.strip() == b"go":
                    go.set()
            nursery.cancel_scope.cancel()

    try:
        trio.run(run)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
