"""``python -m bench.traced_server DIR serve ...``: the server with ``tracemalloc`` started and
snapshots taken when asked.

The soak (W6, :mod:`bench.workloads.w6`) runs the server through this module. A thread watches
``DIR`` for request files: ``start.request`` starts ``tracemalloc`` (:data:`FRAMES` frames per
allocation) and is answered with ``start.done``; ``NAME.request`` dumps a snapshot to
``NAME.snap`` (written under a temporary name, then renamed, so a reader never sees half a file),
with ``NAME.json`` beside it: the traced bytes and the memory of ``tracemalloc`` itself.
Everything after ``DIR`` is the ``crush_trio`` command line.

Tracing slows every allocation several times (the server took 55 s instead of 7 s to start on a
loaded 2-core machine), so it is started only when the soak asks, a while before its baseline
snapshot: long enough that buffers which turn over (replay buffers, queues) were refilled with
traced objects by then, so that they do not count as growth. An RSS measured with tracing on
includes the traces themselves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import sys
import threading
import time
import tracemalloc
from os import environ
from pathlib import Path
from typing import Final

#: Frames kept per traced allocation (enough to see who called a library's allocation);
#: ``CRUSH_BENCH_TRACE_FRAMES`` sets another depth.
FRAMES: Final = int(environ.get("CRUSH_BENCH_TRACE_FRAMES", "3"))
#: How often the request thread looks for requests (seconds).
POLL: Final = 0.2


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_stats() -> dict[str, int]:
    """glibc's view of the heap over all its arenas (empty where ``mallinfo2`` is missing):
    bytes in use (``in_use``: small blocks plus mmapped ones), bytes free inside the arenas
    (``free``: held by the allocator, counted in RSS once touched) and the threads alive
    (each may have its own arena)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return {}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {
        "in_use": info.uordblks + info.hblkhd,
        "free": info.fordblks,
        "arena": info.arena,
        "threads": _threads(),
    }


def _threads() -> int:
    """Threads of this process, counted by the kernel (trio's worker threads included)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return -1


def watch(directory: Path) -> None:
    """Answer the requests in ``directory`` (runs forever)."""
    while True:
        for request in sorted(directory.glob("*.request")):
            name = request.stem
            if name == "start":
                tracemalloc.start(FRAMES)
                (directory / "start.done").touch()
            else:
                if not tracemalloc.is_tracing():
                    tracemalloc.start(FRAMES)
                snapshot = tracemalloc.take_snapshot()
                traced, _ = tracemalloc.get_traced_memory()
                own = tracemalloc.get_tracemalloc_memory()  # the traces themselves
                (directory / f"{name}.json").write_text(
                    json.dumps({"traced": traced, "tracemalloc": own, "malloc": malloc_stats()})
                )
                partial = directory / f"{name}.snap.partial"
                snapshot.dump(str(partial))
                partial.rename(directory / f"{name}.snap")
            request.unlink()
        time.sleep(POLL)


def main() -> int:
    directory = Path(sys.argv[1])
    directory.mkdir(parents=True, exist_ok=True)
    from crush_trio.cli import main as crush_main

    threading.Thread(target=watch, args=(directory,), name="snapshots", daemon=True).start()
    return crush_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
