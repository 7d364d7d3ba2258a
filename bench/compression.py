"""``python -m bench.compression FRAMES.json``: what permessage-deflate makes of a recorded stream.

``FRAMES.json`` is one client's frames as the W3 watchers record them (``frames.json`` in the
work directory of ``python -m bench --only W3 --keep-workdir``). For each way of compressing the
event websocket it prints the bytes on the wire (frame headers included), per character of the
reply, and the zlib time per frame of one connection:

* uncompressed (what a client that does not offer permessage-deflate gets);
* shared, ``server_no_context_takeover``: each event compressed once, alone, the same bytes for
  every client (keeps the server's encode-once property);
* per connection with context takeover, at several window sizes and memory levels (what the
  server does, :mod:`crush_trio.wsdeflate`), with the zlib state each connection then holds.
"""

from __future__ import annotations

import sys
import time
import tracemalloc
import zlib
from pathlib import Path
from typing import Any

import orjson

from crush_trio.wsdeflate import COMPRESS_LEVEL, SERVER_MEM_LEVEL, SERVER_WINDOW_BITS

#: (window bits, memory level) of the per-connection variants measured.
VARIANTS = [(15, 8), (13, 5), (12, 4), (SERVER_WINDOW_BITS, SERVER_MEM_LEVEL), (10, 3)]


def _wire(payload_len: int) -> int:
    return payload_len + (2 if payload_len < 126 else 4 if payload_len < 1 << 16 else 10)


def _state_bytes(bits: int, mem_level: int) -> int:
    tracemalloc.start()
    comp = zlib.compressobj(COMPRESS_LEVEL, zlib.DEFLATED, -bits, mem_level)
    comp.compress(b"x")
    comp.flush(zlib.Z_SYNC_FLUSH)
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return size


#: Timed passes over the frames; the fastest counts (the machine may be shared).
PASSES = 5


def _shared(frames: list[bytes]) -> int:
    total = 0
    for f in frames:
        comp = zlib.compressobj(COMPRESS_LEVEL, zlib.DEFLATED, -15)
        total += _wire(len(comp.compress(f) + comp.flush(zlib.Z_SYNC_FLUSH)) - 4)
    return total


def _per_connection(frames: list[bytes], bits: int, mem_level: int) -> int:
    comp = zlib.compressobj(COMPRESS_LEVEL, zlib.DEFLATED, -bits, mem_level)
    total = 0
    for f in frames:
        total += _wire(len(comp.compress(f) + comp.flush(zlib.Z_SYNC_FLUSH)) - 4)
    return total


def _timed(run: Any, frames: list[bytes], *args: Any) -> tuple[int, float]:
    """Bytes on the wire and the fastest pass's µs per frame."""
    best = float("inf")
    total = 0
    for _ in range(PASSES):
        start = time.perf_counter()
        total = run(frames, *args)
        best = min(best, time.perf_counter() - start)
    return total, best / len(frames) * 1e6


def measure(frames: list[bytes], chars: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    plain = sum(_wire(len(f)) for f in frames)
    rows.append({"variant": "uncompressed", "bytes": plain, "us_per_frame": 0.0, "state": 0})
    total, us = _timed(_shared, frames)
    rows.append(
        {
            "variant": "shared, server_no_context_takeover (µs: once per event)",
            "bytes": total,
            "us_per_frame": us,
            "state": 0,
        }
    )
    for bits, mem_level in VARIANTS:
        total, us = _timed(_per_connection, frames, bits, mem_level)
        rows.append(
            {
                "variant": f"per connection, window 2^{bits}, memory level {mem_level}"
                + (" (the server's)" if (bits, mem_level) == VARIANTS[3] else ""),
                "bytes": total,
                "us_per_frame": us,
                "state": _state_bytes(bits, mem_level),
            }
        )
    for row in rows:
        row["per_char"] = row["bytes"] / chars
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    texts: list[str] = orjson.loads(Path(argv[1]).read_bytes())
    frames = [t.encode() for t in texts]
    chars = 0
    for t in texts:
        if '"type":"run_complete"' in t:
            chars = len(orjson.loads(t)["payload"]["payload"]["text"])
    if not chars:
        print("no run_complete frame: cannot tell the reply's length", file=sys.stderr)
        return 1
    print(f"{len(frames)} frames, reply of {chars:,} characters\n")
    print(
        "| variant | bytes on the wire | per reply char | zlib µs per frame and client | "
        "zlib state per connection |"
    )
    print("|---|---|---|---|---|")
    for r in measure(frames, chars):
        state = f"{r['state'] / 1024:.0f} KiB" if r["state"] else ""
        print(
            f"| {r['variant']} | {r['bytes']:,} | {r['per_char']:.2f} | "
            f"{r['us_per_frame']:.1f} | {state} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
