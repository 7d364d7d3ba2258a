"""The model of the benchmarks: the project's fake OpenAI-compatible server, as a process.

Every chat-completions request gets ``--tokens`` streamed tokens (``t0 ``, ``t1 ``, ..., or
``--token-text`` repeated), with
``--delay-ms`` between them and, with ``--stamp``, each token prefixed by its send time
(``time.time()``) so clients can measure token-to-client latency. For the chaos workload a
fraction of requests fail: ``--fail-rate`` of them get HTTP 500 before any token, ``--drop-rate``
of them lose the connection half-way through the stream.

With ``--tool-calls N`` (the tool-heavy workload) a run's first ``N`` requests each get one tool
call instead, the ``--tools`` in turn (``view`` and ``bash``'s ``cat`` read ``--tool-file``,
``grep`` searches the workspace, ``ls`` lists it), and only the request after the ``N``-th tool
result gets the tokens. The fake keeps no state: it counts the tool results after the last user
message of each request, so any number of runs may be in flight.

Usage::

    python -m bench.fake --port 0 --tokens 200 --delay-ms 0 [--stamp] [--fail-rate 0.1]
    python -m bench.fake --port 0 --tokens 20 --tool-calls 80 --tool-file notes.txt

prints ``fake-llm listening on http://127.0.0.1:PORT`` (flushed) once it accepts connections.
"""

from __future__ import annotations

import argparse
import gc
import random
from typing import TYPE_CHECKING, Any, Final

import orjson
import trio

from tests.fake_llm import (
    FakeLLM,
    Fault,
    RecordedRequest,
    Reply,
    ReplySource,
    ToolCall,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

#: The tools of ``--tool-calls``, in the order they are called.
TOOLS: Final = ("view", "grep", "ls", "bash")
#: How often the fake looks for a moment without a streaming reply to collect its garbage in
#: (seconds).
IDLE_COLLECT_POLL: Final = 0.05
#: The oldest generation's threshold while the fake serves: never reached, so its collections
#: happen only between replies (:func:`collect_when_idle`).
OLDEST_GENERATION_THRESHOLD: Final = 1_000_000


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


def tool_arguments(tool: str, path: str) -> dict[str, Any]:
    """The arguments of one read-only call of ``tool`` on the file ``path`` (workspace-relative);
    ``bash`` runs ``cat``, a command the sandbox runs without asking."""
    if tool == "view":
        return {"path": path}
    if tool == "grep":
        return {"pattern": "line"}
    if tool == "ls":
        return {}
    if tool == "bash":
        return {"command": f"cat {path}"}
    raise ValueError(f"no read-only call of {tool!r}; choose from {', '.join(TOOLS)}")


def tool_results_so_far(request: RecordedRequest) -> int:
    """Tool results after the request's last user message: the tool calls its run made."""
    count = 0
    for message in reversed((request.body or {}).get("messages") or []):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            break
        count += role == "tool"
    return count


def with_tool_calls(final: ReplySource, calls: int, tools: Sequence[str], path: str) -> ReplySource:
    """Reply to each of a run's first ``calls`` requests with one tool call (``tools`` in turn),
    then with ``final``."""
    arguments = [orjson.dumps(tool_arguments(tool, path)).decode() for tool in tools]

    def choose(request: RecordedRequest) -> Reply:
        done = tool_results_so_far(request)
        if done < calls:
            k = done % len(tools)
            return Reply(tool_calls=[ToolCall(tools[k], arguments[k], id=f"call_{done}")])
        return final if isinstance(final, Reply) else final(request)

    return choose


async def collect_when_idle(fake: FakeLLM) -> None:
    """Collect the oldest generation once after each stretch of requests, when no reply
    streams. The fake stands in for a model service on another machine, so a pause of its
    collector is not the server's: left automatic, a full collection (a scan of the fake's
    whole heap, 16-39 ms in W2 and growing over the rounds) fell at the start of a burst of
    requests, when 50 new requests' objects pushed the counts over the thresholds."""
    collected_at = fake.request_count
    while True:
        await trio.sleep(IDLE_COLLECT_POLL)
        if fake.streaming == 0 and fake.request_count != collected_at:
            collected_at = fake.request_count
            gc.collect()


def serve(fake: FakeLLM, host: str, port: int) -> None:
    """Serve ``fake`` until interrupted, printing the listening line first; the oldest
    generation of the collector is collected only between replies, and what start-up made is
    never scanned."""
    young, middle, _oldest = gc.get_threshold()
    gc.set_threshold(young, middle, OLDEST_GENERATION_THRESHOLD)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(fake.serve, host, port)
            # What start-up made (modules, the server) is never garbage: no collection scans it.
            gc.freeze()
            print(f"fake-llm listening on {url}", flush=True)
            nursery.start_soon(collect_when_idle, fake)

    try:
        trio.run(run)
    except KeyboardInterrupt:
        pass


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
    parser.add_argument("--tool-calls", type=int, default=0, help="tool calls per run")
    parser.add_argument("--tools", default=",".join(TOOLS), help="the tools called, in turn")
    parser.add_argument("--tool-file", default="notes.txt", help="the file view and cat read")
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
    if args.tool_calls > 0:
        tools = [t.strip() for t in args.tools.split(",") if t.strip()]
        default = with_tool_calls(default, args.tool_calls, tools, args.tool_file)
    serve(FakeLLM(default=default, record=False), args.host, args.port)


if __name__ == "__main__":
    main()
