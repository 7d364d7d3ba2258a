"""What waking from idle costs on this machine: ``python -m bench.wake_cost [--seconds 3]``.

A server that streams paced tokens is idle most of the time and wakes up many times a second (a
token arrives, a publish window ends). This measures, with nothing of the server, the CPU time
that one such wake is charged: a loop that sleeps ``d`` and wakes, for a few ``d``, once with the
bare system call (``time.sleep``) and once through Trio's run loop (``trio.sleep``), and the same
Trio loop when it never sleeps (``trio.sleep(0)``: the loop's own cost per turn).

On the 2-core virtual machine of docs/performance.md the figure for a real sleep moved with the
host: 419 µs per ``trio.sleep(0.02)`` wake at one time, 789 µs half an hour later and 383-523 µs
after that, with nothing else running, while the loop that never sleeps stayed at 4 µs per turn.
CPU figures of workloads that idle between short bursts (W2's paced runs) move with it; run this
beside them and quote it with their figures.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Final

import trio

if TYPE_CHECKING:
    from collections.abc import Callable

#: The sleeps measured (seconds): from a busy stream's gaps to a paced token's.
DELAYS: Final = (0.001, 0.005, 0.020)


def _per_wake(seconds: float, delay: float, sleep: Callable[[float], None]) -> float:
    """CPU seconds per wake of a loop of ``sleep(delay)`` run for about ``seconds``."""
    count = max(1, int(seconds / delay)) if delay else 20_000
    start = time.process_time()
    for _ in range(count):
        sleep(delay)
    return (time.process_time() - start) / count


def _trio_per_wake(seconds: float, delay: float) -> float:
    count = max(1, int(seconds / delay)) if delay else 20_000

    async def loop() -> float:
        start = time.process_time()
        for _ in range(count):
            await trio.sleep(delay)
        return (time.process_time() - start) / count

    return trio.run(loop)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.wake_cost", description=__doc__)
    parser.add_argument("--seconds", type=float, default=3.0, help="time per measured loop")
    args = parser.parse_args(argv)
    print(f"Trio's loop, never sleeping: {_trio_per_wake(args.seconds, 0) * 1e6:.1f} µs per turn")
    for delay in DELAYS:
        bare = _per_wake(args.seconds, delay, time.sleep)
        in_trio = _trio_per_wake(args.seconds, delay)
        print(
            f"sleep {delay * 1000:g} ms: {bare * 1e6:.1f} µs of CPU per wake (time.sleep), "
            f"{in_trio * 1e6:.1f} µs (trio.sleep)"
        )


if __name__ == "__main__":
    main()
