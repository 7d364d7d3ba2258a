"""Fake model servers for tests and benchmarks: OpenAI Chat Completions and Anthropic Messages.

A :class:`FakeLLM` is a real HTTP/1.1 server (plain Trio sockets and h11) on 127.0.0.1. The API
is chosen per request by the path: ``.../chat/completions`` answers like an OpenAI-compatible
server, ``.../messages`` like Anthropic; anything else is a 404. Each request takes the next
scripted :class:`Reply` (or the default one), and every request is recorded, so a test can
assert the exact history a provider sent.

In a test::

    fake = FakeLLM([Reply(text="hello there"), Reply(status=429, retry_after=2)])
    async with trio.open_nursery() as nursery:
        base_url = await nursery.start(fake.serve)   # "http://127.0.0.1:PORT"
        ...                                           # point a provider at base_url + "/v1"
        assert fake.requests[0].body["messages"][-1]["content"] == "hi"
        nursery.cancel_scope.cancel()

As a process, for benchmarks (every request gets ``--tokens`` tokens)::

    python -m tests.fake_llm --port 0 --tokens 200 --delay-ms 0 [--batch N] [--stamp]

prints ``fake-llm listening on http://127.0.0.1:PORT`` (flushed) once it accepts connections.

Rules for deterministic tests: token delays and hangs are Trio sleeps, so a ``MockClock`` drives
them; nothing here waits on the wall clock.
"""

from __future__ import annotations

import argparse
import collections
import enum
import re
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Final, Literal

import attrs
import h11
import orjson
import trio

if TYPE_CHECKING:
    import ssl

#: Bytes read from a socket per receive.
RECV_SIZE: Final = 64 * 1024
#: Largest request head h11 accepts.
MAX_HEAD_SIZE: Final = 64 * 1024
#: Prefix put before each text token when :attr:`Reply.stamp` is set: the send time.
STAMP_FORMAT: Final = "[t={:.6f}]"
STAMP_RE: Final = re.compile(r"\[t=(\d+\.\d+)\]")
_WORD: Final = re.compile(r"\s*\S+\s*")

Api = Literal["openai", "anthropic"]


class Fault(enum.Enum):
    """A scripted failure, applied after :attr:`Reply.fault_after` stream frames."""

    #: Read the request, then never answer (not even headers) until the client goes away.
    HANG_BEFORE_HEADERS = "hang_before_headers"
    #: Send the headers and ``fault_after`` frames, then stall until the client goes away.
    HANG = "hang"
    #: Send ``fault_after`` frames, then close the socket without ending the chunked body.
    DROP = "drop"
    #: Send ``fault_after`` frames, then a frame whose data is not JSON, then end the body.
    MALFORMED = "malformed"


@attrs.define
class ToolCall:
    """A tool call the fake model makes.

    Attributes:
        name: the tool name.
        arguments: the JSON text of the arguments, sent as ``chunks`` pieces.
        id: the call id; ``call_N`` / ``toolu_N`` when empty.
        chunks: how many stream frames carry the arguments. In OpenAI mode the id and the name
            come in two frames of their own before them, as a stress test for reassembly.
    """

    name: str
    arguments: str = "{}"
    id: str = ""
    chunks: int = 1


@attrs.define
class Reply:
    """One scripted response.

    Attributes:
        text: the reply text; a string is split into words (whitespace kept), a sequence is sent
            as given, one frame per token.
        reasoning: reasoning tokens, sent before the text.
        signature: the thinking block's signature (Anthropic mode), sent as one delta.
        tool_calls: tool calls, sent after the text.
        finish: ``end_turn``, ``max_tokens`` or ``tool_use`` (mapped to each API's names), or a
            raw API value; by default ``tool_use`` when there are tool calls, else ``end_turn``.
        usage: ``(prompt_tokens, completion_tokens)``; by default ``(body bytes // 4, frames)``.
        cache: ``(read, written)`` prompt-cache tokens: Anthropic's ``cache_read_input_tokens``
            and ``cache_creation_input_tokens`` (beside ``input_tokens``, which counts the
            uncached ones), OpenAI's ``prompt_tokens_details.cached_tokens`` (the read ones,
            counted in ``prompt_tokens``).
        token_delay: seconds (Trio's clock) slept before each write after the first.
        batch: stream frames per socket write (1: one write per frame, like a real model;
            more: less server CPU for throughput benchmarks).
        stamp: prefix each text token with its send time (``STAMP_FORMAT``, ``time.time()``).
        status: the HTTP status; anything but 200 sends an error body with ``error``.
        retry_after: a ``Retry-After`` header value in seconds (with a non-200 status).
        error: the error message of a non-200 reply.
        fault: a scripted failure, applied after ``fault_after`` frames.
        gzip: compress the stream (``content-encoding: gzip``, flushed after every frame) even
            though the client asked for ``identity``, as some proxies do.
    """

    text: str | Sequence[str] = ""
    reasoning: Sequence[str] = ()
    signature: str = ""
    tool_calls: Sequence[ToolCall] = ()
    finish: str = ""
    usage: tuple[int, int] | None = None
    cache: tuple[int, int] = (0, 0)
    token_delay: float = 0.0
    batch: int = 1
    stamp: bool = False
    status: int = 200
    retry_after: float | None = None
    error: str = "scripted error"
    fault: Fault | None = None
    fault_after: int = 0
    gzip: bool = False

    def tokens(self) -> list[str]:
        if isinstance(self.text, str):
            return _WORD.findall(self.text) or ([self.text] if self.text else [])
        return list(self.text)


@attrs.define
class RecordedRequest:
    """A request as the fake received it; ``body`` is the parsed JSON (None if not JSON)."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    api: Api | None


ReplySource = Reply | Callable[[RecordedRequest], Reply]


class FakeLLM:
    """A scriptable fake model server.

    Args:
        replies: replies for the next requests, in order (any API).
        default: the reply once the script is empty: a :class:`Reply`, or a function of the
            request. Without one, a request past the script gets a 400 naming the problem.
        record: keep every request in :attr:`requests` (turn off for long benchmarks).

    Attributes:
        requests: the recorded requests, in arrival order.
        request_count: requests received (also when not recording).
        disconnected: set when a client disconnects before its response was complete.
        disconnects: how many times that happened.
        connections: TCP connections accepted (shows whether clients reuse connections).
        streaming: replies being streamed now.

    Cancellation: cancel the nursery that runs :meth:`serve` to stop the server and every
    connection.
    """

    def __init__(
        self,
        replies: Iterable[Reply] = (),
        *,
        default: ReplySource | None = None,
        record: bool = True,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.replies: collections.deque[Reply] = collections.deque(replies)
        #: Serve over TLS with this server context (the base URL is then ``https://``).
        self.ssl_context = ssl_context
        self.default = default
        self.record = record
        self.requests: list[RecordedRequest] = []
        self.request_count = 0
        self.disconnected = trio.Event()
        self.disconnects = 0
        self.connections = 0
        self.streaming = 0
        self.base_url = ""
        self._changed = trio.Event()

    def push(self, *replies: Reply) -> None:
        """Append replies to the script."""
        self.replies.extend(replies)

    async def wait_for_requests(self, count: int) -> None:
        """Return once ``count`` requests have arrived (bound it with ``trio.fail_after``)."""
        while self.request_count < count:
            await self._changed.wait()

    async def wait_for_disconnects(self, count: int) -> None:
        """Return once ``count`` clients have disconnected mid-response."""
        while self.disconnects < count:
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until cancelled; ``nursery.start`` returns the base URL ``http://HOST:PORT``.

        Every connection runs in a nursery owned by this task.
        """
        tcp = await trio.open_tcp_listeners(port, host=host)
        bound_host, bound_port = tcp[0].socket.getsockname()[:2]
        scheme = "http" if self.ssl_context is None else "https"
        self.base_url = f"{scheme}://{bound_host}:{bound_port}"
        listeners: list[trio.abc.Listener[Any]] = list(tcp)
        if self.ssl_context is not None:
            listeners = [trio.SSLListener(listener, self.ssl_context) for listener in tcp]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._connection, listeners)
            task_status.started(self.base_url)

    # --- one connection ----------------------------------------------------------------------

    async def _connection(self, stream: trio.abc.Stream) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_SIZE)
        try:
            while True:
                request = await self._read_request(conn, stream)
                if request is None:
                    return
                if not await self._respond(conn, stream, request):
                    return
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            await trio.aclose_forcefully(stream)

    async def _read_request(
        self, conn: h11.Connection, stream: trio.abc.Stream
    ) -> RecordedRequest | None:
        head: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(RECV_SIZE))
            elif isinstance(event, h11.Request):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                path = head.target.decode("latin-1")
                try:
                    parsed: Any = orjson.loads(body) if body else None
                except orjson.JSONDecodeError:
                    parsed = None
                api: Api | None = None
                if path.endswith("/chat/completions"):
                    api = "openai"
                elif path.endswith("/messages"):
                    api = "anthropic"
                return RecordedRequest(
                    method=head.method.decode("ascii"),
                    path=path,
                    headers={k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers},
                    body=parsed,
                    api=api,
                )
            else:  # ConnectionClosed or PAUSED: the client is gone or misbehaving
                return None

    def _next_reply(self, request: RecordedRequest) -> Reply | None:
        if self.replies:
            return self.replies.popleft()
        if isinstance(self.default, Reply):
            return self.default
        if self.default is not None:
            return self.default(request)
        return None

    async def _respond(
        self, conn: h11.Connection, stream: trio.abc.Stream, request: RecordedRequest
    ) -> bool:
        """Answer one request; False when the connection must close."""
        self.request_count += 1
        if self.record:
            self.requests.append(request)
        self._notify()
        if request.api is None or request.method != "POST":
            await self._send_simple(conn, stream, 404, {"error": {"message": "no such endpoint"}})
            return True
        reply = self._next_reply(request)
        if reply is None:
            message = f"fake-llm has no scripted reply for request {self.request_count}"
            await self._send_simple(conn, stream, 400, _error_body(request.api, 400, message))
            return True
        if reply.status != 200 and reply.fault is None:
            headers = []
            if reply.retry_after is not None:
                headers.append(("retry-after", f"{reply.retry_after:g}"))
            body = _error_body(request.api, reply.status, reply.error)
            await self._send_simple(conn, stream, reply.status, body, headers)
            return True
        return await self._stream(conn, stream, request, reply)

    async def _send_simple(
        self,
        conn: h11.Connection,
        stream: trio.abc.Stream,
        status: int,
        body: Any,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        data = orjson.dumps(body)
        head = [
            ("content-type", "application/json"),
            ("content-length", str(len(data))),
            *(headers or []),
        ]
        out = conn.send(h11.Response(status_code=status, headers=head))
        out += conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage())
        await stream.send_all(out)

    async def _stream(
        self,
        conn: h11.Connection,
        stream: trio.abc.Stream,
        request: RecordedRequest,
        reply: Reply,
    ) -> bool:
        """Stream the reply while a sibling task watches for the client going away."""
        assert request.api is not None
        frames = (_openai_frames if request.api == "openai" else _anthropic_frames)(reply, request)
        state = {"complete": False, "gone": False}

        async def watch(cancel: trio.CancelScope) -> None:
            # Reads are needed to notice a disconnect while we stall; any bytes of a next
            # request on this connection are kept for h11.
            try:
                while True:
                    data = await stream.receive_some(RECV_SIZE)
                    if not data:
                        break
                    conn.receive_data(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            if not state["complete"]:
                state["gone"] = True
                cancel.cancel()

        self.streaming += 1
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, nursery.cancel_scope)
                try:
                    keep = await self._send_frames(conn, stream, reply, frames, state)
                except trio.BrokenResourceError:
                    state["gone"] = True
                    keep = False
                nursery.cancel_scope.cancel()
        finally:
            self.streaming -= 1
        if state["gone"]:
            self.disconnects += 1
            self.disconnected.set()
            self._notify()
            return False
        return keep

    async def _send_frames(
        self,
        conn: h11.Connection,
        stream: trio.abc.Stream,
        reply: Reply,
        frames: list[bytes | Callable[[], bytes]],
        state: dict[str, bool],
    ) -> bool:
        fault = reply.fault
        if fault is Fault.HANG_BEFORE_HEADERS:
            await trio.sleep_forever()
        head = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
        compressor = zlib.compressobj(wbits=31) if reply.gzip else None  # 31: gzip framing
        if compressor is not None:
            head.append(("content-encoding", "gzip"))
        await stream.send_all(conn.send(h11.Response(status_code=200, headers=head)))
        pending = bytearray()
        writes = 0

        async def flush() -> None:
            nonlocal pending, writes
            data, pending = bytes(pending), bytearray()
            writes += 1
            await stream.send_all(data)

        batch = max(1, reply.batch)
        for index, frame in enumerate(frames):
            if not pending and writes and reply.token_delay > 0:
                # The pause comes before the next write's frames are built, so that a stamp
                # (``Reply.stamp``) is the time its frame is sent, not a token delay earlier.
                await trio.sleep(reply.token_delay)
            if index == reply.fault_after and fault is not None:
                if pending:
                    await flush()
                if fault is Fault.HANG:
                    await trio.sleep_forever()
                if fault is Fault.DROP:
                    state["complete"] = True  # our own close is not a client disconnect
                    await trio.aclose_forcefully(stream)
                    return False
                if fault is Fault.MALFORMED:
                    pending += conn.send(h11.Data(data=b'data: {"oops": [1, 2\n\n'))
            data = frame() if callable(frame) else frame
            if compressor is not None:
                last = index == len(frames) - 1
                data = compressor.compress(data) + compressor.flush(
                    zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH
                )
            pending += conn.send(h11.Data(data=data))
            if index == len(frames) - 1:
                pending += conn.send(h11.EndOfMessage())
                state["complete"] = True
                await flush()
            elif (index + 1) % batch == 0:
                await flush()
        return True


# ---------------------------------------------------------------------------------------------
# Frames


_OPENAI_FINISH: Final = {"end_turn": "stop", "max_tokens": "length", "tool_use": "tool_calls"}


def _finish(reply: Reply, names: dict[str, str]) -> str:
    finish = reply.finish or ("tool_use" if reply.tool_calls else "end_turn")
    return names.get(finish, finish)


def _usage(reply: Reply, request: RecordedRequest, frames: int) -> tuple[int, int]:
    if reply.usage is not None:
        return reply.usage
    raw = orjson.dumps(request.body) if request.body is not None else b""
    return len(raw) // 4, frames


def _sse(data: Any, event: str | None = None) -> bytes:
    payload = data if isinstance(data, bytes) else orjson.dumps(data)
    prefix = b"event: " + event.encode() + b"\n" if event else b""
    return prefix + b"data: " + payload + b"\n\n"


def _stamper(token: str, build: Callable[[str], bytes]) -> Callable[[], bytes]:
    return lambda: build(STAMP_FORMAT.format(time.time()) + token)


def _split(text: str, pieces: int) -> list[str]:
    pieces = max(1, min(pieces, len(text) or 1))
    size = -(-len(text) // pieces) if text else 0
    return [text[i : i + size] for i in range(0, len(text), size)] if size else [""]


def _model(request: RecordedRequest) -> str:
    body = request.body
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else "fake-model"


def _openai_frames(reply: Reply, request: RecordedRequest) -> list[bytes | Callable[[], bytes]]:
    model = _model(request)
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _sse(
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
        )

    frames: list[bytes | Callable[[], bytes]] = [chunk({"role": "assistant", "content": ""})]
    frames += [chunk({"reasoning_content": token}) for token in reply.reasoning]
    for token in reply.tokens():
        if reply.stamp:
            frames.append(_stamper(token, lambda text: chunk({"content": text})))
        else:
            frames.append(chunk({"content": token}))
    for n, call in enumerate(reply.tool_calls):
        call_id = call.id or f"call_{n}"
        frames.append(chunk({"tool_calls": [{"index": n, "id": call_id, "type": "function"}]}))
        frames.append(chunk({"tool_calls": [{"index": n, "function": {"name": call.name}}]}))
        for piece in _split(call.arguments, call.chunks):
            frames.append(chunk({"tool_calls": [{"index": n, "function": {"arguments": piece}}]}))
    frames.append(chunk({}, _finish(reply, _OPENAI_FINISH)))
    prompt, completion = _usage(reply, request, len(frames))
    usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    usage["total_tokens"] = prompt + completion
    if reply.cache[0]:
        usage["prompt_tokens_details"] = {"cached_tokens": reply.cache[0]}
    last = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "choices": []}
    frames.append(_sse({**last, "usage": usage}))
    frames.append(_sse(b"[DONE]"))
    return frames


def _anthropic_frames(reply: Reply, request: RecordedRequest) -> list[bytes | Callable[[], bytes]]:
    model = _model(request)
    frames: list[bytes | Callable[[], bytes]] = []
    index = 0

    def event(name: str, data: dict[str, Any]) -> bytes:
        return _sse({"type": name, **data}, name)

    def block(content: dict[str, Any], deltas: list[bytes | Callable[[], bytes]]) -> None:
        nonlocal index
        frames.append(event("content_block_start", {"index": index, "content_block": content}))
        frames.extend(deltas)
        frames.append(event("content_block_stop", {"index": index}))
        index += 1

    def delta(data: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": index, "delta": data})

    if reply.reasoning or reply.signature:
        deltas: list[bytes | Callable[[], bytes]] = [
            delta({"type": "thinking_delta", "thinking": token}) for token in reply.reasoning
        ]
        if reply.signature:
            deltas.append(delta({"type": "signature_delta", "signature": reply.signature}))
        block({"type": "thinking", "thinking": ""}, deltas)
    tokens = reply.tokens()
    if tokens:
        text_deltas: list[bytes | Callable[[], bytes]] = []
        for token in tokens:
            if reply.stamp:
                text_deltas.append(
                    _stamper(token, lambda text: delta({"type": "text_delta", "text": text}))
                )
            else:
                text_deltas.append(delta({"type": "text_delta", "text": token}))
        block({"type": "text", "text": ""}, text_deltas)
    for n, call in enumerate(reply.tool_calls):
        call_id = call.id or f"toolu_{n}"
        pieces = ["", *_split(call.arguments, call.chunks)]
        block(
            {"type": "tool_use", "id": call_id, "name": call.name, "input": {}},
            [delta({"type": "input_json_delta", "partial_json": piece}) for piece in pieces],
        )
    prompt, completion = _usage(reply, request, len(frames))
    start: dict[str, Any] = {
        "id": "msg_fake",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "usage": {"input_tokens": prompt, "output_tokens": 1},
    }
    if reply.cache != (0, 0):
        start["usage"]["cache_read_input_tokens"] = reply.cache[0]
        start["usage"]["cache_creation_input_tokens"] = reply.cache[1]
    finish = _finish(reply, {})
    return [
        event("message_start", {"message": start}),
        event("ping", {}),
        *frames,
        event(
            "message_delta",
            {
                "delta": {"stop_reason": finish, "stop_sequence": None},
                "usage": {"output_tokens": completion},
            },
        ),
        event("message_stop", {}),
    ]


def _error_body(api: Api | None, status: int, message: str) -> dict[str, Any]:
    if api == "anthropic":
        kind = {429: "rate_limit_error", 401: "authentication_error", 529: "overloaded_error"}
        return {
            "type": "error",
            "error": {"type": kind.get(status, "api_error"), "message": message},
        }
    return {"error": {"message": message, "type": "fake_error", "code": status}}


def parse_stamps(text: str) -> list[float]:
    """The send times stamped into a reply's text by :attr:`Reply.stamp`."""
    return [float(match) for match in STAMP_RE.findall(text)]


def strip_stamps(text: str) -> str:
    """The reply text without its stamps."""
    return STAMP_RE.sub("", text)


# ---------------------------------------------------------------------------------------------
# Standalone process


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fake_llm",
        description="A fake OpenAI-compatible and Anthropic model server for benchmarks.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=200, help="text tokens per reply")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="pause between tokens")
    parser.add_argument("--batch", type=int, default=1, help="stream frames per socket write")
    parser.add_argument("--stamp", action="store_true", help="prefix tokens with send times")
    args = parser.parse_args(argv)
    reply = Reply(
        text=[f"t{i} " for i in range(args.tokens)],
        token_delay=args.delay_ms / 1000,
        batch=args.batch,
        stamp=args.stamp,
    )
    run_standalone(FakeLLM(default=reply, record=False), args.host, args.port)


def run_standalone(fake: FakeLLM, host: str, port: int) -> None:
    """Serve ``fake`` in this process until interrupted, printing the listening line first."""

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(fake.serve, host, port)
            print(f"fake-llm listening on {url}", flush=True)

    try:
        trio.run(run)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
