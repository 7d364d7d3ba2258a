"""gzip for the event stream over SSE, compressed once per cohort of streams.

A gzip SSE stream (``Content-Encoding: gzip``, :mod:`.sse`) is one deflate stream per client:
each SSE block is compressed into the stream's window and flushed at once (``Z_SYNC_FLUSH``), so
that the client can inflate it whole before the next one. Streams that were sent the same blocks
in the same order since they began have the same compressor state, byte for byte (the gzip
header, the window, the running CRC-32 and length of the trailer included), so they share it: a
:class:`GzipCohort` (a :class:`crush_trio.wsdeflate.Cohort` whose unit is an HTTP chunk of the
compressed block) compresses each block once, and every other stream at that state sends the
same bytes. A stream that gets another block (a ping at its own time, a ``gap``, resumed events,
a late join with another ``hello``) goes on from a copy of the state, alone or with the streams
that took the same turn; one that is alone compresses in place, like a compressor of its own.

Branches are keyed by the block's bytes (an event's SSE block is encoded once and shared, so
the key is usually the same object; two ``hello`` blocks of the same seq are equal bytes and
share their branch too). The compressor's parameters are :mod:`.sse`'s ``GZIP_*`` constants.

A stream whose writer is behind (its socket was full, its blocks queued) compresses them later
than the others: each lineage keeps its last :data:`GZIP_KEEP_BEHIND` states alive, so that such
a stream still finds the states its cohort went through and goes on sharing them; only one that
nobody followed for that many blocks compresses in place. Without it, a stream that fell one
block behind found its next state gone, went on alone, and every such stream cost a compression
per block (the profile of a run whose clients fell behind: 57% in zlib).

Memory: a state is about 140 KB of zlib state (32 KiB window, memory level 4), one per cohort
and up to :data:`GZIP_KEEP_BEHIND` more behind it; a stream holds a reference to its state and
nothing else.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Final

from ..wsdeflate import Cohort
from .sse import GZIP_LEVEL, GZIP_MEM_LEVEL, GZIP_WINDOW_BITS

if TYPE_CHECKING:
    from ..wsdeflate import Deflater

#: ``wbits`` that makes zlib write a gzip header and trailer around the deflate stream.
GZIP_WBITS: Final = 16 + GZIP_WINDOW_BITS
#: Blocks a stream may fall behind its cohort and still share its compression (the states kept
#: alive per lineage: up to about 136 KB of zlib state each).
GZIP_KEEP_BEHIND: Final = 16
#: The chunk that ends a chunked HTTP body (no trailer fields).
LAST_CHUNK: Final = b"0\r\n\r\n"


def http_chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked HTTP/1.1 body (RFC 9112 §7.1); empty data is no
    chunk at all (an empty chunk would end the body)."""
    if not data:
        return b""
    return b"%x\r\n%b\r\n" % (len(data), data)


class GzipCohort(Cohort):
    """A gzip compressor state shared by the SSE streams that were sent the same blocks: each
    unit is the HTTP chunk of one block compressed and sync-flushed.

    A stream whose writer fell behind (its socket full, the blocks queued) compresses its blocks
    later than the others: :data:`KEEP_BEHIND` states of its lineage stay alive so that it still
    finds its next state, and stays in the cohort, up to that many blocks behind.
    """

    KEEP_BEHIND = GZIP_KEEP_BEHIND

    __slots__ = ()

    @staticmethod
    def _compress(deflater: Deflater, shared: bytes) -> bytes:
        return http_chunk(deflater.compress(shared) + deflater.flush(zlib.Z_SYNC_FLUSH))


#: The state every gzip stream starts from (created with the first stream).
_FIRST: list[GzipCohort] = []


def first_gzip_state() -> GzipCohort:
    """The shared initial state of every gzip SSE stream (nothing written yet, not even the
    gzip header)."""
    if not _FIRST:
        deflater = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, GZIP_WBITS, GZIP_MEM_LEVEL)
        _FIRST.append(GzipCohort(deflater, first=True))
    return _FIRST[0]


class GzipStream:
    """One SSE stream's gzip compression: where it is among the shared states.

    :meth:`chunk` is the next block's chunk on the wire; :meth:`finish` the gzip trailer's.
    :meth:`release` (or :meth:`finish`) leaves the state, so that a cohort of one compresses in
    place.
    """

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state: Cohort | None = None

    def chunk(self, block: bytes) -> bytes:
        """The HTTP chunk of ``block`` compressed after everything this stream sent so far
        (inflatable at once, up to the block's end)."""
        state = self._state
        if state is None:
            state = self._state = first_gzip_state()
            state.members += 1
        data, after = state.send(block, block)
        if after is not state:
            state.members -= 1
            after.members += 1
            self._state = after
        return data

    def finish(self) -> bytes:
        """The HTTP chunk of the end of the gzip member (its last block and trailer: CRC-32 and
        length of everything sent); the stream leaves its state."""
        state = self._state
        if state is None:
            state = first_gzip_state()  # nothing sent: a header, an empty block, the trailer
        deflater = state.deflater if state.private else state.deflater.copy()
        self.release()
        return http_chunk(deflater.flush(zlib.Z_FINISH))

    def release(self) -> None:
        """Leave the shared state (the stream ends, or was cut off)."""
        state, self._state = self._state, None
        if state is not None:
            state.members -= 1
