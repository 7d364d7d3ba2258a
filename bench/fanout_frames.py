"""The compression of the fan-out alone: ``python -m bench.fanout_frames [--events 3000]``.

Every websocket client that negotiated permessage-deflate gets each event through
:meth:`crush_trio.wsdeflate.BoundedDeflate.frame`. This times that call, in one process with
nothing else, for a few numbers of connections that receive the same ``message_delta`` events
in the same order (W2 has two such clients, W3's paced fan-out a thousand), and for two
connections of which one misses every tenth event (a slow client's drops): CPU per event and
connection, and the bytes per event on the wire. Then the same for connections that take
frames of several envelopes (``batch=1``, as the client library and the browser page ask):
the events of many streaming replies, a publish pass's worth per frame (W2: 50 replies, about
15 events a frame), through :meth:`~crush_trio.wsdeflate.BoundedDeflate.frame_group`.
"""

from __future__ import annotations

import argparse
import time

import orjson

from crush_trio.broker import BatchCache, Event, batch_groups
from crush_trio.wsdeflate import BoundedDeflate

#: Connection counts measured (all in step).
COUNTS = (1, 2, 10, 1000)
#: Replies streaming at once, and events a frame, of the batch connections measured (W2's).
BATCH_STREAMS = 50
BATCH_PER_FRAME = 15


def _events(count: int) -> list[Event]:
    events = []
    for n in range(count):
        payload = {
            "message_id": "0f9b3c1e-7d2a-4c55-9d0b-3f1a2b4c5d6e",
            "session_id": "7a1c2e3f-4b5d-4e6f-8a9b-0c1d2e3f4a5b",
            "part": 0,
            "offset": 4 * n,
            "text": f"t{n} ",
        }
        body = orjson.dumps({"seq": n + 1, "type": "message_delta", "payload": payload}).decode()
        events.append(Event(n + 1, "message_delta", body, False))
    return events


def _stream_events(count: int, streams: int) -> list[Event]:
    """``count`` deltas of ``streams`` replies streaming together, one of each in turn."""
    events = []
    for n in range(count):
        reply, step = n % streams, n // streams
        payload = {
            "message_id": f"0f9b3c1e-7d2a-4c55-9d0b-{reply:012d}",
            "session_id": f"7a1c2e3f-4b5d-4e6f-8a9b-{reply:012d}",
            "part": 0,
            "part_type": "text",
            "offset": 30 * step,
            # Two words of W2's fake model, each with its send time (microseconds vary).
            "text": f"t{2 * step} 1796609138.{n * 7919 % 999983:06d} t{2 * step + 1} "
            f"1796609138.{n * 104729 % 999983:06d} ",
        }
        envelope = {"seq": n + 1, "type": "message_delta", "payload": payload}
        body = orjson.dumps(envelope).decode()
        events.append(Event(n + 1, "message_delta", body, False))
    return events


def measure_batches(count: int, events: list[Event], per_frame: int) -> tuple[float, float]:
    """:func:`measure` for connections that take batches, ``per_frame`` events a frame."""
    conns = _connections(count)
    cache = BatchCache()
    sent = 0
    start = time.process_time()
    for at in range(0, len(events), per_frame):
        groups = batch_groups(events[at : at + per_frame])
        for i, conn in enumerate(conns):
            for group in groups:
                frame = conn.frame_group(group, cache.get)
                if i == 0:
                    sent += len(frame)
    cpu = time.process_time() - start
    return cpu / (len(events) * count), sent / len(events)


def _connections(count: int) -> list[BoundedDeflate]:
    conns = [BoundedDeflate(1 << 20) for _ in range(count)]
    for conn in conns:
        conn.accept("permessage-deflate")
    return conns


def measure(count: int, events: list[Event], drop_every: int = 0) -> tuple[float, float]:
    """CPU seconds per event and connection, and wire bytes per event of the first one."""
    conns = _connections(count)
    sent = 0
    start = time.process_time()
    for n, event in enumerate(events):
        for i, conn in enumerate(conns):
            if drop_every and i == 1 and n % drop_every == drop_every - 1:
                continue
            frame = conn.frame(event)
            if i == 0:
                sent += len(frame)
    cpu = time.process_time() - start
    return cpu / (len(events) * count), sent / len(events)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fanout_frames", description=__doc__)
    parser.add_argument("--events", type=int, default=3000)
    args = parser.parse_args(argv)
    events = _events(args.events)
    measure(2, events[:200])  # warm up
    for count in COUNTS:
        n = events if count < 100 else events[: max(200, args.events // 10)]
        per, size = measure(count, n)
        print(
            f"{count:5d} connections in step: {per * 1e6:6.2f} µs per event and connection, "
            f"{size:.1f} B per event"
        )
    per, size = measure(2, events, drop_every=10)
    print(
        f"    2 connections, one missing every 10th event: {per * 1e6:6.2f} µs per event and "
        f"connection, {size:.1f} B per event"
    )
    streamed = _stream_events(args.events * 2, BATCH_STREAMS)
    measure_batches(2, streamed[:300], BATCH_PER_FRAME)  # warm up
    for count, per_frame in ((2, 1), (2, BATCH_PER_FRAME), (10, BATCH_PER_FRAME)):
        per, size = measure_batches(count, streamed, per_frame)
        print(
            f"{count:5d} connections taking batches, {BATCH_STREAMS} replies, {per_frame:2d} "
            f"events a frame: {per * 1e6:6.2f} µs per event and connection, "
            f"{size:.1f} B per event"
        )


if __name__ == "__main__":
    main()
