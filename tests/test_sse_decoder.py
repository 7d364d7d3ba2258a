"""The event-stream decoder of the providers (:class:`~crush_trio.providers.http.SSEDecoder`),
no I/O: whatever the chunking, the same events; and the chunks a model streams (one event, one
``data:`` line, whole in its chunk) decoded like any other."""

from __future__ import annotations

import itertools

import hypothesis
import hypothesis.strategies as st
import pytest

from crush_trio.providers.http import SSEDecoder, SSEEvent

# Data without line breaks (a line break ends a line), some of it not UTF-8.
_DATA = st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
_EVENT = st.tuples(
    st.sampled_from([None, b"update"]),
    st.lists(_DATA, min_size=1, max_size=3),
    st.sampled_from([b"\n", b"\r\n", b"\r"]),
    st.booleans(),  # "data: x" or "data:x"
)


def _encode(name: bytes | None, lines: list[bytes], end: bytes, space: bool) -> bytes:
    head = b"event: " + name + end if name is not None else b""
    sep = b"data: " if space else b"data:"
    return head + b"".join(sep + line + end for line in lines) + end


def _expected(name: bytes | None, lines: list[bytes], space: bool) -> SSEEvent:
    texts = [line.decode("utf-8", errors="replace") for line in lines]
    if not space:  # "data:x": a leading space of the value itself is taken off
        texts = [t[1:] if t.startswith(" ") else t for t in texts]
    return SSEEvent(name.decode() if name is not None else "message", "\n".join(texts))


@hypothesis.given(
    events=st.lists(_EVENT, min_size=1, max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
    at_events=st.booleans(),
)
def test_any_chunking_gives_the_events_in_order(
    events: list[tuple[bytes | None, list[bytes], bytes, bool]], cuts: list[int], at_events: bool
) -> None:
    """Cut anywhere, or at the events' ends (where a model's chunks end): the same events."""
    blocks = [_encode(*e) for e in events]
    body = b"".join(blocks)
    bounds = {0, len(body), *(c for c in cuts if c <= len(body))}
    if at_events:
        end = 0
        for block in blocks:
            end += len(block)
            bounds.add(end)
    decoder = SSEDecoder()
    got: list[SSEEvent] = []
    ordered = sorted(bounds)
    for lo, hi in itertools.pairwise(ordered):
        got += decoder.feed(body[lo:hi])
    got += decoder.close()
    assert got == [_expected(name, lines, space) for name, lines, _, space in events]


def test_a_models_chunk_is_one_event_and_the_limit_holds() -> None:
    decoder = SSEDecoder(limit=30)
    assert decoder.feed(b'data: {"a": "caf\xc3\xa9"}\n\n') == [SSEEvent("message", '{"a": "café"}')]
    # A name given before the chunk still names its event.
    assert decoder.feed(b"event: ping\n") == []
    assert decoder.feed(b"data: x\n\n") == [SSEEvent("ping", "x")]
    # So does data pending from an earlier chunk.
    assert decoder.feed(b"data: a\n") == []
    assert decoder.feed(b"data: b\n\n") == [SSEEvent("message", "a\nb")]
    with pytest.raises(ValueError, match="larger than 30 bytes"):
        decoder.feed(b"data: " + b"x" * 40 + b"\n\n")
