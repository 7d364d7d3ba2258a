"""gzip SSE streams compressed once per cohort (:mod:`crush_trio.server.sse_gzip`): streams that
were sent the same blocks share their compressed bytes; one that diverges (a ping of its own, a
late join) goes on alone and still decodes to exactly its own blocks, trailer included."""

from __future__ import annotations

import zlib

from crush_trio.server.sse import SSE_PING
from crush_trio.server.sse_gzip import (
    GZIP_KEEP_BEHIND,
    LAST_CHUNK,
    GzipStream,
    first_gzip_state,
    http_chunk,
)


def unchunk(data: bytes) -> bytes:
    """The payload of one HTTP chunk (exactly one, nothing around it)."""
    size, _, rest = data.partition(b"\r\n")
    payload = rest[: int(size, 16)]
    assert rest[len(payload) :] == b"\r\n"
    return payload


class Reader:
    """A client's streaming inflater: every chunk must inflate at once to whole blocks."""

    def __init__(self) -> None:
        self.inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self.blocks: list[bytes] = []

    def feed(self, chunk: bytes) -> None:
        text = self.inflater.decompress(unchunk(chunk))
        assert text.endswith(b"\n\n"), text  # nothing held back in the compressor
        self.blocks.append(text)

    def end(self, trailer: bytes) -> None:
        assert self.inflater.decompress(unchunk(trailer)) == b""
        assert self.inflater.eof  # the gzip trailer checked the CRC-32 and the length
        assert self.inflater.unused_data == b""


def block(n: int) -> bytes:
    return f'id: {n}\ndata: {{"seq":{n},"type":"message","text":"{"word " * n}"}}\n\n'.encode()


def test_streams_in_step_share_their_compressed_bytes() -> None:
    streams = [GzipStream() for _ in range(5)]
    readers = [Reader() for _ in streams]
    blocks = [block(n) for n in range(20)]
    for b in blocks:
        chunks = [s.chunk(b) for s in streams]
        assert all(c is chunks[0] for c in chunks)  # compressed once, the same bytes for all
        for reader, chunk in zip(readers, chunks, strict=True):
            reader.feed(chunk)
    for s, reader in zip(streams, readers, strict=True):
        reader.end(s.finish())
        assert reader.blocks == blocks


def test_equal_blocks_that_are_different_objects_share_a_branch() -> None:
    a, b = GzipStream(), GzipStream()
    hello = block(0)
    assert a.chunk(hello) is b.chunk(bytes(bytearray(hello)))  # two hellos of the same seq


def test_a_stream_that_diverges_decodes_its_own_blocks() -> None:
    keeps, pings, late = GzipStream(), GzipStream(), GzipStream()
    got = {name: Reader() for name in ("keeps", "pings", "late")}
    sent: dict[str, list[bytes]] = {name: [] for name in got}

    def send(name: str, stream: GzipStream, data: bytes) -> bytes:
        chunk = stream.chunk(data)
        got[name].feed(chunk)
        sent[name].append(data)
        return chunk

    for n in range(3):
        assert send("keeps", keeps, block(n)) is send("pings", pings, block(n))
    send("pings", pings, SSE_PING)  # at its own time
    send("late", late, block(100))  # another hello
    for n in range(3, 10):
        ka = send("keeps", keeps, block(n))
        kb = send("pings", pings, block(n))
        assert ka is not kb  # other states now: compressed for each
        send("late", late, block(n))
    for name, stream in (("keeps", keeps), ("pings", pings), ("late", late)):
        got[name].end(stream.finish())
        assert got[name].blocks == sent[name]


def test_a_stream_alone_compresses_in_place_and_leaves_the_others_intact() -> None:
    a, b = GzipStream(), GzipStream()
    ra, rb = Reader(), Reader()
    ra.feed(a.chunk(block(1)))
    rb.feed(b.chunk(block(1)))
    b.release()  # b left (its client went away): a is alone at its state
    ra.feed(a.chunk(block(2)))
    c = GzipStream()
    rc = Reader()
    rc.feed(c.chunk(block(1)))  # a newcomer follows the branch a left behind: not a's state
    rc.feed(c.chunk(block(3)))
    ra.end(a.finish())
    rc.end(c.finish())
    assert ra.blocks == [block(1), block(2)]
    assert rc.blocks == [block(1), block(3)]


def test_a_stream_that_sent_nothing_finishes_as_an_empty_gzip_member() -> None:
    reader = Reader()
    reader.end(GzipStream().finish())
    assert first_gzip_state().members == 0  # nobody holds the first state


def test_http_chunk_framing() -> None:
    assert http_chunk(b"hello") == b"5\r\nhello\r\n"
    assert http_chunk(b"x" * 26) == b"1a\r\n" + b"x" * 26 + b"\r\n"
    assert http_chunk(b"") == b""  # never the last chunk by mistake
    assert LAST_CHUNK == b"0\r\n\r\n"


def test_a_stream_behind_its_cohort_still_shares_its_compression() -> None:
    """A stream whose writer is busy compresses its blocks later: up to ``GZIP_KEEP_BEHIND``
    blocks behind the others it still finds their states, and gets their very bytes."""
    ahead, behind = GzipStream(), GzipStream()
    ra, rb = Reader(), Reader()
    hello = block(0)
    ra.feed(ahead.chunk(hello))
    rb.feed(behind.chunk(hello))
    blocks = [block(n) for n in range(1, 40)]
    sent = {}
    lag = GZIP_KEEP_BEHIND - 1
    for n, b in enumerate(blocks):
        sent[n] = ahead.chunk(b)
        ra.feed(sent[n])
        if n >= lag:  # the second stream takes its blocks lag blocks later
            chunk = behind.chunk(blocks[n - lag])
            assert chunk is sent[n - lag]
            rb.feed(chunk)
    for n in range(len(blocks) - lag, len(blocks)):
        chunk = behind.chunk(blocks[n])
        assert chunk is sent[n]
        rb.feed(chunk)
    ra.end(ahead.finish())
    rb.end(behind.finish())
    assert ra.blocks == rb.blocks == [hello, *blocks]


def test_a_stream_too_far_behind_goes_on_alone_and_decodes() -> None:
    ahead, behind = GzipStream(), GzipStream()
    ra, rb = Reader(), Reader()
    blocks = [block(n) for n in range(3 * GZIP_KEEP_BEHIND)]
    for b in blocks:
        ra.feed(ahead.chunk(b))
    for b in blocks:  # everything later than the states kept behind
        rb.feed(behind.chunk(b))
    ra.end(ahead.finish())
    rb.end(behind.finish())
    assert ra.blocks == rb.blocks == blocks
