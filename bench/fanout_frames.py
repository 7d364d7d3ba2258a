"""The compression of the fan-out alone: ``python -m bench.fanout_frames [--events 3000]``.

Every websocket client that negotiated permessage-deflate gets each event through
:meth:`crush_trio.wsdeflate.BoundedDeflate.frame`. This times that call, in one process with
nothing else, for a few numbers of connections that receive the same ``message_delta`` events
in the same order (W2 has two such clients, W3's paced fan-out a thousand), and for two
connections of which one misses every tenth event (a slow client's drops): CPU per event and
connection, and the bytes per event on the wire.
"""

from __future__ import annotations

import argparse
import time

import orjson

from crush_trio.broker import Event
from crush_trio.wsdeflate import BoundedDeflate

#: Connection counts measured (all in step).
COUNTS = (1, 2, 10, 1000)


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


if __name__ == "__main__":
    main()
