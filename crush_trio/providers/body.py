"""A streaming reader of HTTP/1.1 response bodies, for provider event streams.

The body of a model's reply is read from its connection, one socket read per payload, without
``httpx``'s stream layers:

* :class:`ChunkedDecoder` and :class:`LengthDecoder` are pure logic, bytes in and payload bytes
  out, tested with every chunking.
* :class:`SocketBody` is an async iterator of payload bytes that reads the connection (a plain
  TCP connection from its socket directly, a TLS one through its Trio stream). One socket read
  gives at most one payload, however many chunks it held.
* :func:`crush_trio.providers.transport.take_over` decides whether it applies: a response of the
  providers' own transport (:mod:`crush_trio.providers.transport`) whose body is not compressed.
  Anything else (a compressed body, another transport) is read through ``httpx``.

Handing the connection back: when :class:`SocketBody` read the whole body and nothing followed
it, :meth:`SocketBody.aclose` marks the response's stream finished, and closing the response
then returns the connection to the pool. When the body was not read to its end, the server
asked to close, or it sent bytes past the end of the body, nothing is marked and closing the
response closes the connection.

Read timeouts: a read of a plain TCP socket is timed by the read watch of :func:`read_watch`, one
task in the nursery of whoever runs the providers (the server's backend), instead of a cancel
scope per read. Where no watch runs, each read has its own cancel scope (same errors, more CPU).

Reads at the publish passes: a stream's consumer may pace its reads (:class:`ReadPacer`); while
a reply streams its reader then waits for the pass that publishes the reply, and the pass reads
the socket itself and takes plain text in through the stages of :class:`ReadFold`, waking the
reader only for what needs it (see :class:`crush_trio.store.messages.ReadTick`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from typing import TYPE_CHECKING, Any, Final, Protocol

import trio

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable


#: Bytes asked of the socket per read.
READ_SIZE: Final = 64 * 1024
#: Largest chunk size accepted in a chunked body; a larger one is a protocol error (the data of
#: a chunk is passed on as it arrives, so this bounds a server's claims, not memory).
MAX_CHUNK_BYTES: Final = 16 * 1024 * 1024
#: Longest chunk-size line (with its extensions) or trailer line, in bytes.
MAX_CHUNK_LINE_BYTES: Final = 4 * 1024
#: Most bytes of trailer fields after the last chunk.
MAX_TRAILER_BYTES: Final = 64 * 1024

#: How often the read watch looks for provider reads past their timeout (seconds): a stalled
#: read is reported between ``chunk_timeout`` and ``chunk_timeout`` plus this after it began.
READ_WATCH_INTERVAL: Final = 0.25

_HEX: Final = re.compile(rb"[0-9A-Fa-f]{1,16}")

_SIZE, _DATA, _CRLF, _TRAILER, _DONE = range(5)


class BodyError(Exception):
    """The body is malformed (bad chunk framing, a bound exceeded)."""


class IncompleteBody(Exception):
    """The connection ended (or broke) before the body did."""


class BodyTimeout(Exception):
    """Nothing arrived for the read timeout."""


class ChunkedDecoder:
    """Decoder of a ``transfer-encoding: chunked`` body (RFC 9112 section 7.1).

    :meth:`feed` returns the payload bytes its input completed or continued (the data of a chunk
    is passed on as it arrives, never held back until the chunk is whole). Chunk extensions are
    ignored, trailer fields are read and dropped. After the last chunk and the trailers
    :attr:`done` is true and :attr:`extra` holds any bytes that followed.

    Raises:
        BodyError: a chunk size that is not hexadecimal or exceeds :data:`MAX_CHUNK_BYTES`, chunk
            data not followed by CRLF, or a line or the trailers beyond their bounds.
    """

    def __init__(self) -> None:
        self._state = _SIZE
        self._remaining = 0
        self._buffer = b""
        self._trailer_bytes = 0
        self.extra = b""

    @property
    def done(self) -> bool:
        return self._state == _DONE

    def feed(self, data: bytes) -> bytes:
        if self._state == _DONE:
            self.extra += data
            return b""
        buf = self._buffer + data if self._buffer else data
        size = len(buf)
        pos = 0
        out: list[bytes] = []
        state = self._state
        while True:
            if state == _DATA:
                take = min(self._remaining, size - pos)
                if take:
                    out.append(buf[pos : pos + take])
                    pos += take
                    self._remaining -= take
                if self._remaining:
                    break
                state = _CRLF
            if state == _CRLF:
                if size - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise BodyError(
                        f"chunk data is not followed by CRLF (got {bytes(buf[pos : pos + 2])!r})"
                    )
                pos += 2
                state = _SIZE
            if state == _SIZE:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if size - pos > MAX_CHUNK_LINE_BYTES:
                        raise BodyError(
                            f"a chunk-size line is longer than MAX_CHUNK_LINE_BYTES="
                            f"{MAX_CHUNK_LINE_BYTES}"
                        )
                    break
                line = buf[pos:eol]
                pos = eol + 2
                chunk = _chunk_size(line)
                if chunk:
                    self._remaining = chunk
                    state = _DATA
                    continue
                state = _TRAILER
            if state == _TRAILER:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if size - pos > MAX_CHUNK_LINE_BYTES:
                        raise BodyError(
                            f"a trailer line is longer than MAX_CHUNK_LINE_BYTES="
                            f"{MAX_CHUNK_LINE_BYTES}"
                        )
                    break
                if eol == pos:
                    pos += 2
                    state = _DONE
                    self.extra = buf[pos:]
                    pos = size
                    break
                self._trailer_bytes += eol - pos + 2
                if self._trailer_bytes > MAX_TRAILER_BYTES:
                    raise BodyError(
                        f"the trailer fields exceed MAX_TRAILER_BYTES={MAX_TRAILER_BYTES}"
                    )
                pos = eol + 2
                continue
            break
        self._state = state
        self._buffer = buf[pos:] if pos < size else b""
        if not out:
            return b""
        return out[0] if len(out) == 1 else b"".join(out)

    def take_whole(self, data: bytes) -> bytes | None:
        """The payload of ``data`` when it is whole chunks (each a size line without extensions,
        its data and CRLF; none of them the last) and the decoder is at a chunk's start: what
        :meth:`feed` would return, the decoder left as it is (at a chunk's start). None when it
        is anything else; nothing changed then, and :meth:`feed` takes the same bytes."""
        if self._state != _SIZE or self._buffer or not data:
            return None
        size = len(data)
        pos = 0
        out: list[bytes] = []
        while pos < size:
            eol = data.find(b"\r\n", pos, pos + 18)
            if eol < 0 or _HEX.fullmatch(data, pos, eol) is None:
                return None
            length = int(data[pos:eol], 16)
            start = eol + 2
            end = start + length
            if not 0 < length <= MAX_CHUNK_BYTES or data[end : end + 2] != b"\r\n":
                return None
            out.append(data[start:end])
            pos = end + 2
        return out[0] if len(out) == 1 else b"".join(out)

    def eof(self) -> None:
        """The connection ended: fine after the last chunk, else :class:`IncompleteBody`."""
        if self._state == _DONE:
            return
        if self._state == _DATA:
            raise IncompleteBody(
                f"the connection closed with {self._remaining} bytes of a chunk unread"
            )
        raise IncompleteBody("the connection closed before the last chunk of the body")


def _chunk_size(line: bytes) -> int:
    digits = line.split(b";", 1)[0].strip(b" \t")
    if _HEX.fullmatch(digits) is None:
        raise BodyError(f"malformed chunk size line {bytes(line[:64])!r}")
    size = int(digits, 16)
    if size > MAX_CHUNK_BYTES:
        raise BodyError(f"a chunk of {size} bytes exceeds MAX_CHUNK_BYTES={MAX_CHUNK_BYTES}")
    return size


class LengthDecoder:
    """Decoder of an identity body: ``content-length`` bytes, or (``length=None``) every byte
    until the connection ends. Bytes past the length are kept in :attr:`extra`."""

    def __init__(self, length: int | None) -> None:
        self._remaining = length
        self.extra = b""

    @property
    def done(self) -> bool:
        return self._remaining == 0

    def feed(self, data: bytes) -> bytes:
        remaining = self._remaining
        if remaining is None:
            return data
        if len(data) <= remaining:
            self._remaining = remaining - len(data)
            return data
        self._remaining = 0
        self.extra += data[remaining:]
        return data[:remaining]

    def eof(self) -> None:
        if self._remaining:
            raise IncompleteBody(
                f"the connection closed with {self._remaining} bytes of the body unread"
            )
        self._remaining = 0


Decoder = ChunkedDecoder | LengthDecoder


class ReadFold:
    """The synchronous stages through which a publish pass takes in a paced read's bytes
    itself, without waking the stream's reader task (see :class:`ReadPacer`).

    Each layer of a model stream sets its stage while it runs and clears it when it ends:
    :attr:`body` (the body's framing: the bytes read, to payload), :attr:`events` (the event
    stream: payload, to events), :attr:`parse` (the provider's parser: events, to stream
    events) and, from the stream's consumer, :attr:`ready` and :attr:`take`. A stage returns
    None when it cannot take its input in without its task (a boundary, bytes split across
    reads, an event that is not a plain text delta, anything unusual); a stage that returned
    None changed nothing, so the same bytes then go up through the reader task as if it had
    read them. :attr:`parse` commits its parser's state only when it gives a result, and
    :attr:`take` is called only then and takes everything; :attr:`ready` is asked before the
    socket is read (:meth:`can_take`).
    """

    __slots__ = ("body", "events", "parse", "ready", "take")

    def __init__(self) -> None:
        self.body: Callable[[bytes], bytes | None] | None = None
        self.events: Callable[[bytes], list[Any] | None] | None = None
        self.parse: Callable[[list[Any]], list[Any] | None] | None = None
        self.ready: Callable[[], bool] | None = None
        self.take: Callable[[list[Any]], None] | None = None

    def can_take(self) -> bool:
        """Whether every stage is set and the consumer is ready: only then is it worth reading
        the stream's socket for :meth:`run`."""
        ready = self.ready
        if ready is None or self.body is None or self.events is None or self.parse is None:
            return False
        return self.take is not None and ready()

    def run(self, data: bytes) -> bool:
        """Take ``data`` (bytes read from the stream's connection, after :meth:`can_take`) in
        through every stage. False: a stage could not, or one is missing; nothing changed."""
        body, events, parse, take = self.body, self.events, self.parse, self.take
        if body is None or events is None or parse is None or take is None:
            return False
        payload = body(data)
        if payload is None:
            return False
        found = events(payload)
        if found is None:
            return False
        parsed = parse(found)
        if parsed is None:
            return False
        take(parsed)
        return True


class ReadPacer(Protocol):
    """When the reads of one model stream are worth making (the consumer's, who knows when what
    it reads is shown: :class:`crush_trio.store.messages.ReadTick`)."""

    #: The stages through which a pass may take the stream's bytes in itself.
    fold: ReadFold

    async def before_read(self, read_now: Callable[[], bytes] | None = None) -> bool:
        """Wait until a read is worth making; True when it waited (read before waiting for the
        socket: the data is likely there). ``read_now``: reads the connection without waiting
        (raises :class:`BlockingIOError` when nothing is there), for a pass that takes the
        bytes in through :attr:`fold` while the reader keeps waiting; after a wait,
        :meth:`taken` tells what such a read got that :attr:`fold` did not take."""
        ...

    def taken(self) -> bytes | Exception | None:
        """What the pass that ended the wait read for this stream and did not take in (bytes,
        ``b""`` at the connection's end, or the read's error); None: read it yourself."""
        ...

    def read_empty(self) -> None:
        """The read after a wait found nothing."""
        ...


#: The pacer of the provider stream the current task consumes (None: read as data arrives).
#: Set by the consumer around its iteration; the connection's reads consult it.
READ_PACER: Final[contextvars.ContextVar[ReadPacer | None]] = contextvars.ContextVar(
    "crush_trio_read_pacer", default=None
)


class Finishable(Protocol):
    """What :class:`SocketBody` tells when it read the body whole (the response's stream)."""

    def mark_finished(self) -> None: ...


class SocketBody:
    """The payload of one response body, read from its connection: ``async for data in body``.

    Args:
        read: reads up to :data:`READ_SIZE` bytes from the connection (``b""`` at its end).
        decoder: the body's framing.
        first: bytes of the body that arrived with the headers.
        timeout: longest wait for one read (seconds); ``None``: the caller times the reads.
            With ``fd`` (the connection's socket) the reads are timed by the read watch of
            :func:`read_watch` when one runs, else by a cancel scope per read.
        connection: the exchange, marked finished at :meth:`aclose` when reusable.
        reusable: whether the connection may carry another request after this body.

    Raises (from iteration):
        BodyError: the body is malformed.
        IncompleteBody: the connection ended or broke before the body did.
        BodyTimeout: nothing arrived for ``timeout``.
    """

    def __init__(
        self,
        read: Callable[[], Awaitable[bytes]],
        decoder: Decoder,
        first: bytes,
        *,
        timeout: float | None,
        connection: Finishable | None = None,
        reusable: bool = False,
        fd: int | None = None,
    ) -> None:
        self._read = read
        self._fd = fd
        self._deadline = math.inf
        self._timed_out = False
        self._unwatched = False
        self._watch: _ReadWatch | None = None
        self._decoder = decoder
        self._pending = first
        self._timeout = timeout
        self._connection = connection
        self._reusable = reusable
        self._ended = False
        pacer = READ_PACER.get()
        self._fold = pacer.fold if pacer is not None and fd is not None else None
        if self._fold is not None:
            self._fold.body = self._take_whole

    def __aiter__(self) -> SocketBody:
        return self

    async def __anext__(self) -> bytes:
        decoder = self._decoder
        while True:
            if self._pending:
                data, self._pending = self._pending, b""
            elif decoder.done or self._ended:
                raise StopAsyncIteration
            else:
                data = await self._receive()
                if not data:
                    self._ended = True
                    decoder.eof()
                    raise StopAsyncIteration
            payload = decoder.feed(data)
            if payload:
                return payload

    async def _receive(self) -> bytes:
        if self._timeout is None:
            return await self._read()
        watch = _current_watch() if self._fd is not None else None
        if watch is None:
            with trio.move_on_after(self._timeout):
                return await self._read()
            raise self._timeout_error()
        self._deadline = trio.current_time() + self._timeout
        self._timed_out = False
        watch.add(self)
        try:
            return await self._read()
        except IncompleteBody:
            if self._timed_out:
                raise self._timeout_error() from None
            if self._unwatched:
                raise IncompleteBody(
                    "the read was ended: the provider read watch stopped (the server is "
                    "shutting down)"
                ) from None
            raise
        finally:
            if self._watch is not None:
                self._watch.reads.discard(self)
                self._watch = None

    def _timeout_error(self) -> BodyTimeout:
        return BodyTimeout(f"nothing arrived for {self._timeout:g}s")

    def _expire(self) -> None:
        """Called by the read watch: end the pending read (it raises :class:`BodyTimeout`)."""
        self._timed_out = True
        self._interrupt()

    def _interrupt(self) -> None:
        """End the pending read: it raises :class:`IncompleteBody` (or the timeout)."""
        if self._fd is not None:
            with contextlib.suppress(OSError, ValueError):
                trio.lowlevel.notify_closing(self._fd)

    def _take_whole(self, data: bytes) -> bytes | None:
        """The body stage of the stream's :class:`ReadFold`: the payload of ``data`` read by a
        publish pass while this body's read waits, when it is whole chunks (the read's deadline
        then starts again, as a read's would). None when the body has bytes pending or is not
        chunked, and when its read is not timed by the read watch: a cancel scope around the
        read (its own, or its caller's when it has no timeout) cannot be moved by a pass."""
        decoder = self._decoder
        if self._pending or self._ended or self._watch is None or self._timeout is None:
            return None
        if not isinstance(decoder, ChunkedDecoder):
            return None
        payload = decoder.take_whole(data)
        if payload is not None:
            self._deadline = trio.current_time() + self._timeout
        return payload

    @property
    def complete(self) -> bool:
        """Whether the whole body was read and nothing followed it."""
        return self._decoder.done and not self._decoder.extra and not self._pending

    async def aclose(self) -> None:
        """Mark the connection reusable when the body was read whole (see the module doc); the
        caller then closes the response, which hands the connection back or closes it."""
        if self._fold is not None and self._fold.body == self._take_whole:
            self._fold.body = None
        self._fold = None
        connection, self._connection = self._connection, None
        if connection is not None and self._reusable and self.complete and not self._ended:
            connection.mark_finished()


class _ReadWatch:
    """Times out the stalled reads of every :class:`SocketBody` of one Trio run, with one task.

    A cancel scope per read cost about as much as the rest of reading a paced chunk. Instead,
    a read records its deadline and joins :attr:`reads` while it waits; the watch looks every
    :data:`READ_WATCH_INTERVAL` seconds (only while some read waits) and ends a read past its
    deadline with ``trio.lowlevel.notify_closing`` on its socket, so the read raises and reports
    :class:`BodyTimeout`. The connection is then closed with the response, as after any error.
    """

    def __init__(self) -> None:
        self.reads: set[SocketBody] = set()
        self._wake = trio.Event()

    def add(self, body: SocketBody) -> None:
        if not self.reads:
            self._wake.set()
        self.reads.add(body)
        body._watch = self

    async def run(self) -> None:
        while True:
            if not self.reads:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            await trio.sleep(READ_WATCH_INTERVAL)
            now = trio.current_time()
            for body in [body for body in self.reads if body._deadline <= now]:
                body._expire()


#: The read watches running in this Trio run, newest last; reads join the newest.
_READ_WATCHES: Final = trio.lowlevel.RunVar[list[_ReadWatch]]("crush_trio_read_watches")


def _watches() -> list[_ReadWatch]:
    try:
        return _READ_WATCHES.get()
    except LookupError:
        watches: list[_ReadWatch] = []
        _READ_WATCHES.set(watches)
        return watches


def _current_watch() -> _ReadWatch | None:
    try:
        watches = _READ_WATCHES.get()
    except LookupError:
        return None
    return watches[-1] if watches else None


@contextlib.asynccontextmanager
async def read_watch() -> AsyncIterator[None]:
    """Run a read watch (see :class:`_ReadWatch`) for the block, as a task of a nursery the
    block owns; the server's backend enters it for its lifetime. Reads started while it runs
    join it (the newest, when several run, as with several nodes in one process). When the
    block ends, its waiting reads move to another running watch, or, where none runs, are
    ended (they raise :class:`IncompleteBody` saying so); later reads time themselves."""
    watch = _ReadWatch()
    watches = _watches()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run, name="crush_trio provider read watch")
        watches.append(watch)
        try:
            yield
        finally:
            watches.remove(watch)
            nursery.cancel_scope.cancel()
            successor = watches[-1] if watches else None
            for body in list(watch.reads):
                watch.reads.discard(body)
                if successor is not None:
                    successor.add(body)
                else:
                    body._unwatched = True
                    body._interrupt()
