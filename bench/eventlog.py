"""The Redis event log on its own: appends/s and latency per batch size, and a broker's
publish → client latency with and without the log: ``python -m bench.eventlog``.

It starts a throw-away ``redis-server`` on loopback (as the tests do, see ``tests/services.py``)
and prints a Markdown table. One process, one Trio loop: the figures are the cost of the log as
the broker's writer task sees it, not of a loaded server.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Final

import trio

from crush_trio.broker import Broker
from crush_trio.cluster.redislog import open_redis_logs
from crush_trio.wire import AgentEvent, EventKind

#: Events appended per batch size (each run appends this many events in total).
EVENTS: Final = 5000
#: Publish → client round trips measured per broker mode.
ROUND_TRIPS: Final = 2000
#: A typical streamed event's size (bytes): a ``message_delta`` carrying a few tokens.
EVENT_BYTES: Final = 200


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench_appends(url: str, events: int) -> list[str]:
    rows = ["| batch | appends/s | events/s | append p50 (ms) | append p99 (ms) | per event p50 (µs) |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    payload = b"x" * EVENT_BYTES
    async with open_redis_logs(url) as logs:
        for size in (1, 10, 100):
            log = logs.log(f"bench-{size}")
            await log.fence(1)
            seq = 0
            latencies: list[float] = []
            start = time.perf_counter()
            while seq < events:
                batch = [(seq + i + 1, payload) for i in range(size)]
                t0 = time.perf_counter()
                await log.append(batch)
                latencies.append(time.perf_counter() - t0)
                seq += size
            total = time.perf_counter() - start
            p50 = pct(latencies, 0.5)
            rows.append(
                f"| {size} | {len(latencies) / total:,.0f} | {seq / total:,.0f} | "
                f"{p50 * 1e3:.3f} | {pct(latencies, 0.99) * 1e3:.3f} | {p50 / size * 1e6:.1f} |"
            )
    return rows


async def round_trips(broker: Broker, n: int) -> list[float]:
    client, _ = broker.subscribe()
    out: list[float] = []
    for i in range(n):
        t0 = time.perf_counter()
        broker.publish(AgentEvent("info", message=f"event {i}"), EventKind.CREATED)
        await client.receive.receive()
        out.append(time.perf_counter() - t0)
    client.close()
    return out


async def burst(broker: Broker, n: int) -> float:
    """Publish ``n`` events at once; seconds until the client has the last."""
    client, _ = broker.subscribe()
    t0 = time.perf_counter()
    for i in range(n):
        broker.publish(AgentEvent("info", message=f"burst {i}"), EventKind.CREATED)
    for _ in range(n):
        await client.receive.receive()
    client.close()
    return time.perf_counter() - t0


async def bench_broker(url: str, n: int) -> list[str]:
    rows = ["| broker | publish→client p50 (µs) | p99 (µs) | burst of 1000: events/s |",
            "|---|---|---|---|"]  # fmt: skip
    embedded = Broker()
    lat = await round_trips(embedded, n)
    rate = 1000 / await burst(embedded, 1000)
    rows.append(f"| embedded (no log) | {pct(lat, 0.5) * 1e6:.0f} | {pct(lat, 0.99) * 1e6:.0f} | "
                f"{rate:,.0f} |")  # fmt: skip
    async with open_redis_logs(url) as logs, trio.open_nursery() as nursery:
        log = logs.log("bench-broker")
        await log.fence(1)
        broker = Broker(log=log, client_queue_size=4096)
        await nursery.start(broker.write_log)
        lat = await round_trips(broker, n)
        rate = 1000 / await burst(broker, 1000)
        rows.append(
            f"| Redis log | {pct(lat, 0.5) * 1e6:.0f} | {pct(lat, 0.99) * 1e6:.0f} | {rate:,.0f} |"
        )
        stats = broker.stats()
        rows.append(f"\n(Redis log: {stats['log_appended']} events in {stats['log_appends']} appends; "
                    f"mean {statistics.mean(lat) * 1e6:.0f} µs)")  # fmt: skip
        nursery.cancel_scope.cancel()
    return rows


async def main(url: str, events: int, n: int) -> None:
    for line in await bench_appends(url, events):
        print(line)
    print()
    for line in await bench_broker(url, n):
        print(line)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--redis-url", help="an existing Redis (default: start a throw-away one)")
    parser.add_argument("--events", type=int, default=EVENTS)
    parser.add_argument("--round-trips", type=int, default=ROUND_TRIPS)
    args = parser.parse_args()
    if args.redis_url:
        trio.run(main, args.redis_url, args.events, args.round_trips)
        return
    from tests.services import running_redis

    with running_redis() as server:
        trio.run(main, server.url, args.events, args.round_trips)


if __name__ == "__main__":
    cli()
