"""``python -m bench.provider_request``: the CPU of one model request's start and end, by transport.

Bursts of concurrent ``POST`` requests on kept-alive loopback connections, each answered at once
with a two-event chunked stream by a minimal server in the same process, read the way
:class:`~crush_trio.providers.http.HttpStreamer` reads them (the transport, then the body from
its connection where the transport allows it). Printed: process CPU per request for

- ``providers``: the providers' own transport (:class:`~crush_trio.providers.transport.Http11Transport`);
- ``httpx``: ``httpx``'s default transport (``httpcore``'s pool and ``h11``), the body read
  through ``httpx``;
- ``floor``: the request written and the response read by hand on a raw Trio stream (what no
  transport can go below).

The server's share (a few tens of µs per request) is in every figure.
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import TYPE_CHECKING, Final

import httpx
import trio

from crush_trio.providers.body import ChunkedDecoder
from crush_trio.providers.pool import shared_ssl_context
from crush_trio.providers.transport import Http11Transport, take_over

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

_EVENTS: Final = b'data: {"x":1}\n\ndata: [DONE]\n\n'
_RESPONSE: Final = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    + b"%x\r\n" % len(_EVENTS)
    + _EVENTS
    + b"\r\n0\r\n\r\n"
)
#: The request body: about the size of a first prompt's model request (system prompt, tools).
_PAYLOAD: Final = b'{"a":' + b"1" * 14000 + b"}"


async def _serve(stream: trio.SocketStream) -> None:
    buffer = b""
    try:
        while data := await stream.receive_some(65536):
            buffer += data
            while (end := buffer.find(b"\r\n\r\n")) >= 0:
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in buffer[:end].split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                if len(buffer) - end - 4 < length:
                    break
                buffer = buffer[end + 4 + length :]
                await stream.send_all(_RESPONSE)
    except trio.BrokenResourceError:
        pass


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _request(url: str) -> httpx.Request:
    return httpx.Request(
        "POST",
        url,
        headers={"content-type": "application/json", "authorization": "Bearer " + "x" * 40},
        content=_PAYLOAD,
        extensions={"timeout": {"connect": 5.0, "read": 60.0, "write": None, "pool": None}},
    )


async def _via(transport: httpx.AsyncBaseTransport, url: str) -> None:
    response = await transport.handle_async_request(_request(url))
    body = take_over(response, timeout=None)
    async for _ in body if body is not None else response.stream:  # type: ignore[union-attr]
        pass
    if body is not None:
        await body.aclose()
    await response.aclose()


def _floor(port: int, idle: list[trio.SocketStream]) -> Callable[[], Awaitable[None]]:
    request = _request(f"http://127.0.0.1:{port}/v1/chat/completions")
    head = b"".join(
        [b"POST /v1/chat/completions HTTP/1.1\r\n"]
        + [name + b": " + value + b"\r\n" for name, value in request.headers.raw]
        + [b"\r\n"]
    )

    async def one() -> None:
        stream = idle.pop() if idle else await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(head + _PAYLOAD)
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            buffer += await stream.receive_some(65536)
        decoder = ChunkedDecoder()
        decoder.feed(buffer.partition(b"\r\n\r\n")[2])
        while not decoder.done:
            decoder.feed(await stream.receive_some(65536))
        idle.append(stream)

    return one


async def _measure(one: Callable[[], Awaitable[None]], bursts: int, width: int) -> float:
    async def burst() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(width):
                nursery.start_soon(one)

    await burst()  # the connections are opened and kept
    start = _cpu()
    for _ in range(bursts):
        await burst()
    return (_cpu() - start) / (bursts * width)


async def _main(bursts: int, width: int) -> None:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, _serve, 0)
        port = listeners[0].socket.getsockname()[1]
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        ours = Http11Transport(
            ssl_context=shared_ssl_context(), max_connections=width, keepalive_expiry=60.0
        )
        theirs = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=width, max_keepalive_connections=width)
        )
        idle: list[trio.SocketStream] = []
        cases: dict[str, Callable[[], Awaitable[None]]] = {
            "providers": lambda: _via(ours, url),
            "httpx": lambda: _via(theirs, url),
            "floor": _floor(port, idle),
        }
        print(f"{bursts} bursts of {width} concurrent requests, kept-alive connections:")
        for name, one in cases.items():
            started = time.perf_counter()
            cpu = await _measure(one, bursts, width)
            wall = time.perf_counter() - started
            print(f"  {name:<10} {cpu * 1e6:7.1f} µs of CPU per request ({wall:.1f} s)")
        await ours.aclose()
        await theirs.aclose()
        for stream in idle:
            await stream.aclose()
        nursery.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", type=int, default=40, help="bursts measured (default 40)")
    parser.add_argument("--width", type=int, default=50, help="requests per burst (default 50)")
    args = parser.parse_args()
    trio.run(_main, args.bursts, args.width)


if __name__ == "__main__":
    main()
