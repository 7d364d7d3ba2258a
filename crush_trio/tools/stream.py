"""Streaming a running command's output to clients as lossy ``tool_output`` events.

An :class:`OutputStreamer` takes the output chunks of one command (a ``bash`` call or a
background job) as they are read and publishes them through the workspace's broker, bounded in
rate and bytes: at most one event per :data:`TOOL_OUTPUT_INTERVAL` seconds, carrying at most
:data:`TOOL_OUTPUT_MAX_BYTES` bytes. Output beyond that within one interval is not published
(its size is counted in the next event's ``dropped``): the stream is a live view, never the
record. The record is the tool result (cut at ``options.bash_output_limit``) or the job's output
read with ``job_output``; a client that missed pieces re-reads those.

Memory: the streamer holds at most :data:`TOOL_OUTPUT_MAX_BYTES` bytes, however fast the command
writes. CPU: one encode per event, at most ten events a second per command.
"""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING, Final

import trio

from ..wire import ToolOutput

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["TOOL_OUTPUT_INTERVAL", "TOOL_OUTPUT_MAX_BYTES", "OutputStreamer"]

#: Shortest time between two ``tool_output`` events of one command (seconds).
TOOL_OUTPUT_INTERVAL: Final = 0.1
#: Most output bytes one ``tool_output`` event carries; more within one interval is dropped from
#: the stream (and counted in ``dropped``).
TOOL_OUTPUT_MAX_BYTES: Final = 16 * 1024


class OutputStreamer:
    """Publishes one command's output as bounded ``tool_output`` pieces.

    Args:
        publish: the broker's lossy publish (never blocks).
        session_id, tool_call_id, run_id, job_id: what the events name.

    Call :meth:`feed` with each chunk (synchronous, never blocks), run :meth:`run` in the
    command's nursery, and call :meth:`close` once the output ended (it publishes what is left).
    """

    def __init__(
        self,
        publish: Callable[[ToolOutput], object],
        *,
        session_id: str,
        tool_call_id: str,
        run_id: str | None = None,
        job_id: str | None = None,
    ) -> None:
        self._publish = publish
        self.session_id = session_id
        self.tool_call_id = tool_call_id
        self.run_id = run_id
        self.job_id = job_id
        #: Output bytes seen so far.
        self.total = 0
        #: Bytes not published (over the bound), in all.
        self.dropped_total = 0
        #: Events published.
        self.events = 0
        self._pending = bytearray()
        self._pending_offset = 0
        self._dropped = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._wake = trio.Event()
        self._closed = False

    @property
    def pending_bytes(self) -> int:
        """Bytes waiting for the next event (at most :data:`TOOL_OUTPUT_MAX_BYTES`)."""
        return len(self._pending)

    def feed(self, chunk: bytes | bytearray) -> None:
        """Take one chunk of output; what does not fit before the next event is dropped."""
        if self._closed or not chunk:
            return
        if not self._pending:
            self._pending_offset = self.total
        self.total += len(chunk)
        room = TOOL_OUTPUT_MAX_BYTES - len(self._pending)
        if room >= len(chunk):
            self._pending += chunk
        else:
            if room > 0:
                self._pending += chunk[:room]
            # Later bytes of this interval are skipped: the next piece starts after them.
            self._dropped += len(chunk) - max(room, 0)
            self.dropped_total += len(chunk) - max(room, 0)
        self._wake.set()

    def _flush(self, *, final: bool = False, exit_code: int | None = None) -> None:
        if not self._pending and not final:
            return
        text = self._decoder.decode(bytes(self._pending), final=final)
        offset = self._pending_offset
        dropped = self._dropped
        if dropped:
            # The text after a gap starts a new byte sequence.
            self._decoder.reset()
        self._pending.clear()
        self._dropped = 0
        self._pending_offset = self.total
        if not text and not final and not dropped:
            return
        self.events += 1
        self._publish(
            ToolOutput(
                session_id=self.session_id,
                tool_call_id=self.tool_call_id,
                offset=offset,
                text=text,
                run_id=self.run_id,
                job_id=self.job_id,
                dropped=dropped,
                done=final and self.job_id is not None,
                exit_code=exit_code,
            )
        )

    async def run(self) -> None:
        """Publish pending output at most once per :data:`TOOL_OUTPUT_INTERVAL`, until
        cancelled (the command's nursery cancels it when the output ended)."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            self._flush()
            await trio.sleep(TOOL_OUTPUT_INTERVAL)

    def close(self, *, exit_code: int | None = None) -> None:
        """The output ended: publish what is left (for a job: the last piece, ``done``)."""
        if self._closed:
            return
        self._closed = True
        if self.job_id is not None:
            self._flush(final=True, exit_code=exit_code)
        elif self._pending:
            self._flush()
