"""The model of the benchmarks: the project's fake OpenAI-compatible server, as a process.

Every chat-completions request gets ``--tokens`` streamed tokens (``t0 ``, ``t1 ``, ..., or
``--token-text`` repeated), with
``--delay-ms`` between them and, with ``--stamp``, each token prefixed by its send time
(``time.time()``) so clients can measure token-to-client latency. For the chaos workload a
fraction of requests fail: ``--fail-rate`` of them get HTTP 500 before any token, ``--drop-rate``
of them lose the connection half-way through the stream.

Usage::

    python -m bench.fake --port 0 --tokens 200 --delay-ms 0 [--stamp] [--fail-rate 0.1]

prints ``fake-llm listening on http://127.0.0.1:PORT`` (flushed) once it accepts connections.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence

from tests.fake_llm import FakeLLM, Fault, RecordedRequest, Reply, ReplySource, run_standalone


def make_default(
    tokens: int,
    delay_ms: float,
    *,
    stamp: bool = False,
    fail_rate: float = 0.0,
    drop_rate: float = 0.0,
    seed: int = 0,
    token_text: str = "",
) -> ReplySource:
    """The fake's default reply: always the same one, or a function choosing per request."""
    text = [token_text or f"t{i} " for i in range(tokens)]
    ok = Reply(text=text, token_delay=delay_ms / 1000, stamp=stamp)
    if fail_rate <= 0 and drop_rate <= 0:
        return ok
    rng = random.Random(seed)
    failed = Reply(status=500, error="injected failure (bench chaos)")
    dropped = Reply(
        text=text,
        token_delay=delay_ms / 1000,
        stamp=stamp,
        fault=Fault.DROP,
        fault_after=max(1, tokens // 2),
    )

    def choose(_request: RecordedRequest) -> Reply:
        x = rng.random()
        if x < fail_rate:
            return failed
        if x < fail_rate + drop_rate:
            return dropped
        return ok

    return choose


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fake", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--stamp", action="store_true")
    parser.add_argument("--token-text", default="", help="every token is this text")
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--drop-rate", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    default = make_default(
        args.tokens,
        args.delay_ms,
        stamp=args.stamp,
        fail_rate=args.fail_rate,
        drop_rate=args.drop_rate,
        seed=args.seed,
        token_text=args.token_text,
    )
    run_standalone(FakeLLM(default=default, record=False), args.host, args.port)


if __name__ == "__main__":
    main()
