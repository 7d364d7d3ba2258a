"""The client side of the token path, alone: N concurrent model streams through the provider.

``python -m bench.token_path URL [N] [--raw] [--rounds R]`` streams one reply per task from an
OpenAI-compatible server (start ``python -m bench.fake --port P --tokens 200 --delay-ms 20``
first; URL is ``http://127.0.0.1:P/v1``) through :class:`~crush_trio.providers.openai.OpenAIProvider`
and :class:`~crush_trio.core.assembler.StepAssembler`, and prints the process's CPU seconds
spent streaming. ``--raw`` reads the same replies from a bare Trio socket with a minimal HTTP/1.1
chunked reader instead of the HTTP client (SSE decoding, parsing and assembly unchanged): the
floor under the HTTP client, for comparison only. ``--rounds R`` runs R rounds of N and prints
the CPU per stream of the rounds after the first, on kept-alive connections (with ``--tokens 2``
mostly the cost of starting a model request). Time the whole process from outside
(``/usr/bin/time -v``), alternating the two commands, on a shared machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from urllib.parse import urlsplit

import orjson
import trio

from crush_trio.core.assembler import StepAssembler
from crush_trio.providers import base as pb
from crush_trio.providers.body import read_watch
from crush_trio.providers.http import Settings, SSEDecoder
from crush_trio.providers.openai import ChatStreamParser, OpenAIProvider, build_chat_body
from crush_trio.wire import Message, Role


def _request() -> pb.ModelRequest:
    return pb.ModelRequest(pb.ModelInfo("fake"), "system", [])


async def _via_provider(provider: OpenAIProvider, i: int) -> int:
    assembler = StepAssembler(Message(f"m{i}", "s", Role.ASSISTANT, []))
    async for event in provider.stream(_request()):
        assembler.feed(event)
    return len(assembler.msg.text())


async def _via_socket(url: str, i: int) -> int:
    parts = urlsplit(url)
    body = orjson.dumps(build_chat_body(_request()))
    stream = await trio.open_tcp_stream(parts.hostname or "127.0.0.1", parts.port or 80)
    head = (
        f"POST {parts.path}/chat/completions HTTP/1.1\r\nhost: {parts.netloc}\r\n"
        "content-type: application/json\r\naccept: text/event-stream\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    await stream.send_all(head.encode() + body)
    buffer = b""
    while b"\r\n\r\n" not in buffer:
        buffer += await stream.receive_some(65536)
    buffer = buffer.split(b"\r\n\r\n", 1)[1]
    decoder, parser = SSEDecoder(), ChatStreamParser("raw")
    assembler = StepAssembler(Message(f"m{i}", "s", Role.ASSISTANT, []))
    while True:
        while (eol := buffer.find(b"\r\n")) >= 0:
            size = int(buffer[:eol], 16)
            if size == 0:
                await stream.aclose()
                return len(assembler.msg.text())
            if len(buffer) < eol + size + 4:
                break
            data, buffer = buffer[eol + 2 : eol + 2 + size], buffer[eol + size + 4 :]
            for sse in decoder.feed(data):
                for event in parser.feed(sse):
                    assembler.feed(event)
        more = await stream.receive_some(65536)
        if not more:
            raise RuntimeError("the server closed the connection mid-body")
        buffer += more


async def _main(url: str, n: int, raw: bool, rounds: int) -> None:
    # The server reads every provider stream under one read watch (its stall timeout), not a
    # cancel scope per read: measure the same path.
    async with read_watch():
        await _rounds(url, n, raw, rounds)


async def _rounds(url: str, n: int, raw: bool, rounds: int) -> None:
    provider = OpenAIProvider("fake", Settings(base_url=url))
    warm: list[float] = []
    for r in range(rounds):
        lengths: list[int] = []

        async def one(i: int, lengths: list[int] = lengths) -> None:
            lengths.append(await (_via_socket(url, i) if raw else _via_provider(provider, i)))

        start = time.process_time()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        spent = time.process_time() - start
        if r:
            warm.append(spent)
        print(
            f"round {r + 1}: {n} streams, {sum(lengths)} characters, {spent:.3f} CPU s streaming",
            file=sys.stderr,
        )
    await provider.aclose()
    if warm:
        per = sum(warm) / len(warm) / n
        print(f"warm rounds: {per * 1e3:.3f} ms of CPU per stream", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.token_path", description=__doc__)
    parser.add_argument("url")
    parser.add_argument("n", type=int, nargs="?", default=50)
    parser.add_argument("--raw", action="store_true")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of N streams; rounds after the first reuse the kept-alive connections",
    )
    args = parser.parse_args()
    trio.run(_main, args.url, args.n, args.raw, args.rounds)


if __name__ == "__main__":
    main()
