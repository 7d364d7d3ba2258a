"""Client workers: the load generators, each in its own process.

``python -m bench.client ROLE`` reads its configuration as the first JSON line on stdin, then
commands (one JSON object per line); it writes events to stdout as JSON lines
(``{"event": "ready" | "progress" | "done" | "error", ...}``). Every role drives the server with
the project's client library, :mod:`crush_trio.client`. Roles:

* ``runs``: one library client (``connect`` → ``client.workspace(project)``) that creates
  sessions and submits one prompt per session on ``go`` (W1, W2) or a long series of short runs
  on ``soak`` (W4), following each run through its :class:`~crush_trio.client.RunHandle`. Its
  stream asks for ``message_delta`` events (the library's default), which it assembles. It
  measures submit → first visible text (the run's first ``message`` or ``message_delta`` event
  with text), submit →
  ``run_complete``, and (when the model stamps its tokens) token-to-client latency; a workspace
  subscription counts the ``run_complete`` events of every run, so a duplicate would show. For
  the runs' tool calls (W7) it measures each call's latency as a client sees it: the assistant
  message showing the call finished → the tool message showing its result.
* ``watch``: ``count`` raw event-stream connections (with ``deltas=1`` unless the config says
  ``"deltas": false``) that read until a ``run_complete`` frame (W3, and the reading client of
  W4) or stay idle until ``quit`` (W4's idle clients). They count frames and UTF-8 bytes.
* ``stall``: one raw event-stream connection that never reads until told to ``drain`` (W4).
* ``chaos``: a library client doing a bounded random mix of prompts, cancels, clears, stream
  drops and reads, plus one raw connection that comes and goes (W5); it checks that every
  accepted run gets exactly one ``run_complete`` on each of the two streams.

Why the fan-out and idle roles read raw frames: the library's workspace client decodes every
frame into wire objects (25-35 µs for a ``message`` event on this machine, against 0.2-4 µs to
look for a marker in its text) and routes it to run handles. W3 holds up to 1,000 connections
receiving over 100,000 frames across a few processes on the same 2 cores as the server, so
decoding would make the clients, not the server, what W3 measures; and the bare server W3 compares
against has no HTTP API, so no workspace client could use it. Those roles therefore open each
connection with the library's :func:`~crush_trio.client.open_event_socket` (the same address,
token and ``hello`` handshake) and count frames by their text.

Times are ``time.time()`` so that they compare across processes on one machine. The roles live in
:mod:`bench.roles` (``runs``; ``watch`` and ``stall``, the raw readers; ``chaos``), with what they
share in :mod:`bench.roles.common`; this module is the entry point that picks one.
"""

from __future__ import annotations

import sys
import traceback
from typing import TYPE_CHECKING, Any, Final

import trio

from .procs import raise_fd_limit
from .roles.chaos import role_chaos
from .roles.common import (
    COMPRESSION_ENV,
    DELTAS_ENV,
    Io,
    client_compression,
    client_deltas,
)
from .roles.runs import role_runs
from .roles.watch import role_stall, role_watch

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = [
    "COMPRESSION_ENV",
    "DELTAS_ENV",
    "ROLES",
    "client_compression",
    "client_deltas",
    "main",
]

# ---------------------------------------------------------------------------------------------

ROLES: Final[dict[str, Callable[[Io, dict[str, Any]], Awaitable[None]]]] = {
    "runs": role_runs,
    "watch": role_watch,
    "stall": role_stall,
    "chaos": role_chaos,
}


async def _main(role: str) -> None:
    io = Io()
    cfg = await io.recv()
    if cfg is None:
        return
    try:
        await ROLES[role](io, cfg)
    except Exception:
        await io.send("error", message=traceback.format_exc()[-4000:])
        raise


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in ROLES:
        print(f"usage: python -m bench.client {{{','.join(ROLES)}}}", file=sys.stderr)
        sys.exit(2)
    raise_fd_limit()
    try:
        trio.run(_main, sys.argv[1])
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
