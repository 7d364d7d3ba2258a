"""The tools' worker threads: a limiter of their own, one per Trio run."""

from __future__ import annotations

from typing import Final

import trio

#: Worker threads tool calls may use at once, in a limiter of their own: a call that times out
#: leaves its thread behind until the blocking work ends, and those threads must never take the
#: threads the rest of the server (the store) runs in, which use Trio's default limiter.
TOOL_THREAD_LIMIT: Final = 16

_tool_threads: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("tool_threads")


def tool_thread_limiter() -> trio.CapacityLimiter:
    """The limiter of the tools' worker threads (:data:`TOOL_THREAD_LIMIT`), one per Trio run."""
    try:
        return _tool_threads.get()
    except LookupError:
        limiter = trio.CapacityLimiter(TOOL_THREAD_LIMIT)
        _tool_threads.set(limiter)
        return limiter
