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
                    json.dumps({"traced": traced, "tracemalloc": own})
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
