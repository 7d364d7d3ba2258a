"""Summarize a py-spy profile of the server: ``python -m bench.profile FILE.txt [--top 40]``.

``python -m bench --profile`` records every server process it starts with
``py-spy record --format raw`` (collapsed stacks, one ``frame;frame;... count`` line each) next
to the server's log. This prints, for the main thread, the share of samples spent inside each
function (inclusive) and at the top of the stack (self), and a breakdown by layer of the server,
so a profile can be read without a flame-graph viewer.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Sequence

#: Layers of the server, matched against a frame's file, most specific first.
LAYERS: Final = (
    ("provider HTTP client (httpx/httpcore/h11)", ("httpx/", "httpcore/")),
    ("providers (SSE decode, parsing)", ("crush_trio/providers/",)),
    ("agent loop", ("crush_trio/agent/",)),
    ("store (sqlite calls, message buffer)", ("crush_trio/store/",)),
    ("broker (sequence, encode, fan-out)", ("crush_trio/broker/",)),
    (
        "event streams (websocket/SSE writers)",
        (
            "crush_trio/server/connection.py",
            "crush_trio/server/ws_trio.py",
            "crush_trio/server/ws_asgi.py",
            "crush_trio/server/sse.py",
            "crush_trio/server/commands.py",
        ),
    ),
    ("HTTP routes", ("crush_trio/server/app.py", "crush_trio/server/api.py")),
    ("quart / hypercorn / wsproto", ("quart", "hypercorn/", "wsproto/", "werkzeug/")),
)
IDLE_LEAF: Final = "WorkerThread._work ("
_LINE: Final = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
_FRAME: Final = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*)(?::\d+)?\)$")


def parse(path: Path) -> list[tuple[list[str], int]]:
    stacks = []
    for line in path.read_text().splitlines():
        match = _LINE.match(line)
        if match:
            stacks.append((match["stack"].split(";"), int(match["count"])))
    return stacks


def _key(frame: str) -> str:
    match = _FRAME.match(frame)
    return f"{match['func']} ({match['file']})" if match else frame


def layer_of(frames: list[str]) -> str:
    """The innermost server layer on the stack (what the time is spent for)."""
    for frame in reversed(frames):
        for name, patterns in LAYERS:
            if any(p in frame for p in patterns):
                return name
    return "trio scheduler / I/O wait / other"


def summarize(path: Path, top: int = 40) -> str:
    # A Trio worker thread waiting for its next job sits in a timed lock acquire, which py-spy
    # counts as busy; it is idle time, so it is left out.
    stacks = [(f, n) for f, n in parse(path) if f and not f[-1].startswith(IDLE_LEAF)]
    if any(f[0].startswith("thread (") for f, _ in stacks):  # recorded with --threads
        stacks = [(f[1:], n) for f, n in stacks if "MainThread" in f[0]]
    total = sum(n for _, n in stacks) or 1
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    layers: collections.Counter[str] = collections.Counter()
    for frames, n in stacks:
        seen = set()
        for frame in frames:
            key = _key(frame)
            if key not in seen:
                seen.add(key)
                inclusive[key] += n
        own[_key(frames[-1])] += n
        layers[layer_of(frames)] += n
    lines = [f"{path}: {total} samples", "", "By layer (innermost):"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in layers.most_common()]
    lines += ["", "Inclusive:"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in inclusive.most_common(top)]
    lines += ["", "Self:"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in own.most_common(top // 2)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("files", type=Path, nargs="+")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    for path in args.files:
        print(summarize(path, args.top))
        print()


if __name__ == "__main__":
    main()
