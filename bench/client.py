"""Client workers: the load generators, each in its own process.

``python -m bench.client ROLE`` reads its configuration as the first JSON line on stdin, then
commands (one JSON object per line); it writes events to stdout as JSON lines
(``{"event": "ready" | "progress" | "done" | "error", ...}``). Every role drives the server with
the project's client library, :mod:`crush_trio.client`. Roles:

* ``runs``: one library client (``connect`` → ``client.workspace(project)``) that creates
  sessions and submits one prompt per session on ``go`` (W1, W2) or a long series of short runs
  on ``soak`` (W4), following each run through its :class:`~crush_trio.client.RunHandle`. Its
  stream asks for ``message_delta`` events (the library's default), which it assembles. It
  measures submit → first visible text (the run's first ``message`` or ``message_delta`` event
  with text), submit →
  ``run_complete``, and (when the model stamps its tokens) token-to-client latency; a workspace
  subscription counts the ``run_complete`` events of every run, so a duplicate would show. For
  the runs' tool calls (W7) it measures each call's latency as a client sees it: the assistant
  message showing the call finished → the tool message showing its result.
* ``watch``: ``count`` raw event-stream connections (with ``deltas=1`` unless the config says
  ``"deltas": false``) that read until a ``run_complete`` frame (W3, and the reading client of
  W4) or stay idle until ``quit`` (W4's idle clients). They count frames and UTF-8 bytes.
* ``stall``: one raw event-stream connection that never reads until told to ``drain`` (W4).
* ``chaos``: a library client doing a bounded random mix of prompts, cancels, clears, stream
  drops and reads, plus one raw connection that comes and goes (W5); it checks that every
  accepted run gets exactly one ``run_complete`` on each of the two streams.

Why the fan-out and idle roles read raw frames: the library's workspace client decodes every
frame into wire objects (25-35 µs for a ``message`` event on this machine, against 0.2-4 µs to
look for a marker in its text) and routes it to run handles. W3 holds up to 1,000 connections
receiving over 100,000 frames across a few processes on the same 2 cores as the server, so
decoding would make the clients, not the server, what W3 measures; and the bare server W3 compares
against has no HTTP API, so no workspace client could use it. Those roles therefore open each
connection with the library's :func:`~crush_trio.client.open_event_socket` (the same address,
token and ``hello`` handshake) and count frames by their text.

Times are ``time.time()`` so that they compare across processes on one machine.
"""

from __future__ import annotations

import collections
import itertools
import os
import random
import sys
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
import trio
from trio_websocket import ConnectionClosed

from crush_trio.client import (
    CrushError,
    Event,
    EventSocket,
    RunHandle,
    Subscription,
    Timeout,
    Unreachable,
    WorkspaceClient,
    connect,
    open_event_socket,
)
from crush_trio.wire import Message, Role, ToolResultPart
from tests.fake_llm import STAMP_RE

from .procs import TOKEN, LineReader, raise_fd_limit

#: Websocket handshakes in flight at once per worker.
CONNECT_CONCURRENCY: Final = 64
#: Bound on opening one event-stream connection and receiving its hello (seconds); handshakes
#: queue behind :data:`CONNECT_CONCURRENCY`, so each is short, but 1,000 clients load the server.
CONNECT_TIMEOUT: Final = 60.0
#: Frames buffered per raw connection: one, so a client that stops reading stops reading its
#: socket (the stalled client of W4), as trio-websocket's default.
RAW_QUEUE_SIZE: Final = 1
#: Bound on the close handshakes of a watch worker's connections when it quits (seconds).
CLOSE_TIMEOUT: Final = 10.0
#: Bound on one HTTP request.
HTTP_TIMEOUT: Final = 30.0
#: The envelope of a ``run_complete`` / ``gap`` frame, as the server encodes it (no spaces).
RUN_COMPLETE_MARK: Final = '"type":"run_complete"'
GAP_MARK: Final = '"type":"gap"'
#: Chaos: how long to keep listening after the last expected run_complete, for duplicates.
LATE_DUPLICATES: Final = 0.5
#: Set to ``0`` (``python -m bench --snapshots``), the ``runs`` and ``watch`` workers open their
#: streams without ``deltas=1`` and get whole ``message`` snapshots, as a Crush client does.
DELTAS_ENV: Final = "CRUSH_BENCH_DELTAS"


def client_deltas() -> bool:
    """Whether the workers ask for ``message_delta`` events (see :data:`DELTAS_ENV`)."""
    return os.environ.get(DELTAS_ENV, "1") != "0"


#: Set to ``0`` (``python -m bench --no-compression``), the ``watch`` workers do not offer
#: permessage-deflate, so their frames travel uncompressed (as a client that does not offer it).
COMPRESSION_ENV: Final = "CRUSH_BENCH_COMPRESSION"


def client_compression() -> bool:
    """Whether the ``watch`` workers offer permessage-deflate (see :data:`COMPRESSION_ENV`)."""
    return os.environ.get(COMPRESSION_ENV, "1") != "0"


# ---------------------------------------------------------------------------------------------
# The line protocol with the orchestrator


class Io:
    """JSON lines: commands from stdin, events to stdout (one writer at a time)."""

    def __init__(self) -> None:
        self._in = LineReader(trio.lowlevel.FdStream(os.dup(0)))
        self._out = trio.lowlevel.FdStream(os.dup(1))
        self._lock = trio.Lock()

    async def recv(self) -> dict[str, Any] | None:
        line = await self._in.readline()
        if line is None:
            return None
        command: dict[str, Any] = orjson.loads(line)
        return command

    async def send(self, event: str, **fields: Any) -> None:
        async with self._lock:
            await self._out.send_all(orjson.dumps({"event": event, **fields}) + b"\n")


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------------------------
# runs: submit prompts, follow their runs


@dataclass
class RunTrack:
    """One submitted run, as this client saw it."""

    run_id: str = ""
    submitted: float = 0.0
    first_text: float | None = None
    #: When the model sent the run's first token (its stamp), with a stamping model.
    first_token_sent: float | None = None
    completed: float | None = None
    error: str | None = None
    cancelled: bool = False
    text: str = ""
    #: Characters of the reply text already searched for stamps.
    seen_chars: int = 0
    #: Tool calls seen finished: call id → (tool name, when it was seen).
    tool_calls: dict[str, tuple[str, float]] = field(default_factory=dict)
    #: Ids of the tool calls whose result was seen.
    tool_results: set[str] = field(default_factory=set)


class Runs:
    """The runs of one library workspace client, and what they measured."""

    def __init__(self, ws: WorkspaceClient, stamp: bool) -> None:
        self.ws = ws
        self.stamp = stamp
        self.token_latencies: list[float] = []
        #: Tool name → latencies of its calls (see :meth:`on_tool_results`).
        self.tool_latencies: dict[str, list[float]] = collections.defaultdict(list)
        #: Tool results that were errors.
        self.tool_errors = 0
        #: run_complete events per run id, from a subscription to the whole workspace.
        self.completes: collections.Counter[str] = collections.Counter()
        #: Set (and replaced) whenever one of the runs ends.
        self.changed = trio.Event()

    def frames(self) -> int:
        """Frames the workspace's stream delivered so far (events and gaps)."""
        return self.ws.stats.events + self.ws.stats.gaps

    async def count_completes(self, feed: Subscription) -> None:
        try:
            async for event in feed:
                if event.type == "run_complete":
                    self.completes[event.payload.run_id] += 1
        except CrushError:
            pass  # the stream is gone for good: the runs still pending fail with its error

    def _ended(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def run(self, session_id: str, prompt: str, track: RunTrack) -> None:
        """Submit one prompt and follow its run to the end."""
        track.submitted = time.time()
        try:
            handle = await self.ws.prompt(session_id, prompt)
        except CrushError as exc:
            track.error = describe(exc)
            self._ended()
            return
        track.run_id = handle.run_id
        try:
            await self.follow(handle, track)
        finally:
            self._ended()

    async def follow(self, handle: RunHandle, track: RunTrack) -> None:
        try:
            async for event in handle.events(timeout=None):
                self.on_event(event, track, time.time())
        except CrushError as exc:
            track.error = describe(exc)

    def on_event(self, event: Event, track: RunTrack, now: float) -> None:
        message = event.message  # a snapshot, or the message a delta leads to
        if message is not None:
            if message.role is Role.TOOL:
                self.on_tool_results(message, track, now)
                return
            if message.role is not Role.ASSISTANT:
                return
            for call in message.tool_calls():
                if call.finished and call.id not in track.tool_calls:
                    track.tool_calls[call.id] = (call.name, now)
            text = message.text()
            if not text:
                return
            if track.first_text is None:
                track.first_text = now
            if self.stamp:
                # The text only grows, by whole tokens: only its new tail has new stamps.
                stamps = STAMP_RE.findall(text, track.seen_chars)
                if stamps and track.first_token_sent is None:
                    track.first_token_sent = float(stamps[0])
                for stamp in stamps:
                    self.token_latencies.append(now - float(stamp))
                track.seen_chars = len(text)
        elif event.type == "run_complete":
            complete = event.payload
            track.completed = now
            track.error = complete.error
            track.cancelled = complete.cancelled
            track.text = complete.text

    def on_tool_results(self, message: Message, track: RunTrack, now: float) -> None:
        """Each tool call's latency, once: its call seen finished → its result seen."""
        for part in message.parts:
            if not isinstance(part, ToolResultPart) or part.tool_call_id in track.tool_results:
                continue
            seen = track.tool_calls.get(part.tool_call_id)
            if seen is None:
                continue  # the call was not seen (the stream dropped it): no latency
            track.tool_results.add(part.tool_call_id)
            self.tool_latencies[seen[0]].append(now - seen[1])
            self.tool_errors += part.is_error

    async def create_sessions(self, count: int) -> list[str]:
        ids: list[str] = []
        limiter = trio.CapacityLimiter(16)

        async def one() -> None:
            async with limiter:
                ids.append((await self.ws.create_session("bench")).id)

        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(one)
        return ids

    def summary(self, tracks: list[RunTrack]) -> dict[str, Any]:
        done = [t for t in tracks if t.completed is not None]
        return {
            "runs": len(tracks),
            "completed": sum(1 for t in done if t.error is None and not t.cancelled),
            "failed": sum(1 for t in tracks if t.error is not None),
            "missing": sum(1 for t in tracks if t.completed is None and t.error is None),
            "duplicates": sum(max(0, self.completes[t.run_id] - 1) for t in tracks if t.run_id),
            "errors": sorted({t.error for t in tracks if t.error})[:5],
            "started": min((t.submitted for t in tracks), default=0.0),
            "finished": max((t.completed for t in done if t.completed), default=0.0),
            "first_text": [t.first_text - t.submitted for t in tracks if t.first_text is not None],
            "first_token_sent": [
                t.first_token_sent - t.submitted for t in tracks if t.first_token_sent is not None
            ],
            "latency": [t.completed - t.submitted for t in done if t.completed is not None],
            "tokens": sum(len(STAMP_RE.sub("", t.text).split()) for t in done),
        }

    async def go(self, io: Io, sessions: list[str], command: dict[str, Any]) -> None:
        """One prompt per session, all at once; report when every run has its run_complete."""
        tracks = [RunTrack() for _ in sessions]
        frames0, gaps0, drops0 = self.frames(), self.ws.stats.gaps, self.ws.stats.drops
        self.token_latencies = []
        self.tool_latencies.clear()
        self.tool_errors = 0
        prompt = command["prompt"]
        stall = float(command.get("stall", command["timeout"]))
        with trio.move_on_after(float(command["timeout"])):
            async with trio.open_nursery() as nursery:
                for session_id, track in zip(sessions, tracks, strict=True):
                    nursery.start_soon(self.run, session_id, prompt, track)
                # Give up early when no run ends for ``stall`` seconds: a run that lost its
                # run_complete would otherwise hold the whole phase until its timeout.
                while not all(t.completed is not None or t.error is not None for t in tracks):
                    with trio.move_on_after(stall) as idle:
                        await self.changed.wait()
                    if idle.cancelled_caught:
                        nursery.cancel_scope.cancel()
                        break
        await io.send(
            "done",
            frames=self.frames() - frames0,
            gaps=self.ws.stats.gaps - gaps0,
            drops=self.ws.stats.drops - drops0,
            token_latency=self.token_latencies,
            tool_latency=dict(self.tool_latencies),
            tool_errors=self.tool_errors,
            **self.summary(tracks),
        )

    async def soak(self, io: Io, command: dict[str, Any]) -> None:
        """``runs`` short runs, ``concurrency`` sessions at a time, a new session every
        ``per_session`` runs (so no history grows without bound); progress every
        ``progress_every`` runs."""
        total = int(command["runs"])
        per_session = int(command["per_session"])
        every = max(1, int(command["progress_every"]))
        timeout = float(command["timeout"])
        prompt = command["prompt"]
        state = {"submitted": 0, "done": 0, "failed": 0, "missing": 0, "duplicates": 0}
        latencies: list[float] = []
        run_ids: list[str] = []

        async def one_run(session_id: str) -> None:
            track = RunTrack()
            with trio.move_on_after(timeout):
                await self.run(session_id, prompt, track)
            run_ids.append(track.run_id)
            if track.error is not None:
                state["failed"] += 1
            elif track.completed is None:
                state["missing"] += 1
            else:
                latencies.append(track.completed - track.submitted)

        async def loop() -> None:
            while state["submitted"] < total:
                (session_id,) = await self.create_sessions(1)
                for _ in range(per_session):
                    if state["submitted"] >= total:
                        return
                    state["submitted"] += 1
                    await one_run(session_id)
                    state["done"] += 1
                    if state["done"] % every == 0 or state["done"] == total:
                        await io.send("progress", done=state["done"], time=time.time())

        started = time.time()
        async with trio.open_nursery() as nursery:
            for _ in range(int(command["concurrency"])):
                nursery.start_soon(loop)
        state["duplicates"] = sum(max(0, self.completes[r] - 1) for r in run_ids)
        await io.send("done", started=started, finished=time.time(), latency=latencies, **state)


async def role_runs(io: Io, cfg: dict[str, Any]) -> None:
    sessions: list[str] = []
    async with (
        connect(
            cfg["url"],
            TOKEN,
            request_timeout=HTTP_TIMEOUT,
            max_connections=int(cfg.get("connections", 100)),
            deltas=client_deltas(),
        ) as client,
        client.workspace(cfg["project"]) as ws,
        ws.subscribe(timeout=None) as feed,
        trio.open_nursery() as nursery,
    ):
        runs = Runs(ws, stamp=bool(cfg.get("stamp")))
        nursery.start_soon(runs.count_completes, feed)
        await io.send("ready")
        while (command := await io.recv()) is not None:
            name = command["cmd"]
            if name == "sessions":
                sessions = await runs.create_sessions(int(command["count"]))
                await io.send("sessions", count=len(sessions))
            elif name == "go":
                await runs.go(io, sessions, command)
            elif name == "soak":
                await runs.soak(io, command)
            elif name == "quit":
                break
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------------------------
# watch: many raw connections reading until run_complete (or idle until quit)


async def role_watch(io: Io, cfg: dict[str, Any]) -> None:
    count = int(cfg["count"])
    url: str = cfg["url"]
    wid: str = cfg["wid"]
    record_path: str | None = cfg.get("record")
    deltas = bool(cfg.get("deltas", client_deltas()))
    compression = bool(cfg.get("compression", client_compression()))
    recorded: list[str] = []
    stats: collections.Counter[str] = collections.Counter()
    closes: collections.Counter[str] = collections.Counter()
    frames_per_conn: list[int] = []
    bytes_per_conn: list[int] = []
    wire_per_conn: list[int] = []
    end_times: list[float] = []
    ready = trio.Event()
    all_ended = trio.Event()
    finish = trio.Event()
    reading_scopes: list[trio.CancelScope] = []
    handshakes = trio.Semaphore(CONNECT_CONCURRENCY)

    def settled() -> None:
        if stats["connected"] + stats["failed"] == count:
            ready.set()
        if stats["ended"] + stats["failed"] == count:
            all_ended.set()

    async def connection(index: int) -> None:
        frames = size = 0
        holding = True
        await handshakes.acquire()
        try:
            async with open_event_socket(
                url,
                wid,
                TOKEN,
                timeout=CONNECT_TIMEOUT,
                message_queue_size=RAW_QUEUE_SIZE,
                deltas=deltas,
                compression=compression,
            ) as sock:
                wire_start = sock.wire_bytes
                stats["compressed"] += sock.compressed
                handshakes.release()
                holding = False
                stats["connected"] += 1
                settled()
                with trio.CancelScope() as scope:
                    reading_scopes.append(scope)
                    async for text in sock:
                        frames += 1
                        n = len(text.encode())
                        size += n
                        stats["bytes"] += n
                        if index == 0 and record_path:
                            recorded.append(text)
                        if GAP_MARK in text:
                            stats["gaps"] += 1
                        if RUN_COMPLETE_MARK in text:
                            stats["run_complete"] += 1
                            end_times.append(time.time())
                            break
                    else:
                        closes[str(sock.close_code)] += 1
                    stats["frames"] += frames
                    wire = sock.wire_bytes - wire_start
                    stats["wire_bytes"] += wire
                    frames_per_conn.append(frames)
                    bytes_per_conn.append(size)
                    wire_per_conn.append(wire)
                    stats["ended"] += 1
                    settled()
                await finish.wait()
        except (CrushError, OSError) as exc:
            if holding:
                stats["failed"] += 1
                closes[type(exc).__name__] += 1
                settled()
        finally:
            if holding:
                handshakes.release()

    async def commands() -> None:
        while (command := await io.recv()) is not None:
            if command["cmd"] == "quit":
                break
        finish.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(commands)
        async with trio.open_nursery() as conns:
            for index in range(count):
                conns.start_soon(connection, index)
            await ready.wait()
            await io.send("ready", connected=stats["connected"], failed=stats["failed"])
            async with trio.open_nursery() as waiter:

                async def wait_for(event: trio.Event) -> None:
                    await event.wait()
                    waiter.cancel_scope.cancel()

                waiter.start_soon(wait_for, all_ended)
                waiter.start_soon(wait_for, finish)
            if record_path:
                _write_json(record_path, recorded)
            await io.send(
                "done",
                frames=stats["frames"],
                bytes=stats["bytes"],
                wire_bytes=stats["wire_bytes"],
                # Every connection negotiated permessage-deflate (the offer alone is not enough).
                compressed=stats["connected"] > 0 and stats["compressed"] == stats["connected"],
                gaps=stats["gaps"],
                run_complete=stats["run_complete"],
                ended=stats["ended"],
                failed=stats["failed"],
                closes=dict(closes),
                min_frames=min(frames_per_conn, default=0),
                min_bytes=min(bytes_per_conn, default=0),
                max_bytes=max(bytes_per_conn, default=0),
                min_wire_bytes=min(wire_per_conn, default=0),
                max_wire_bytes=max(wire_per_conn, default=0),
                max_frames=max(frames_per_conn, default=0),
                last_end=max(end_times, default=0.0),
            )
            await finish.wait()
            for scope in reading_scopes:
                scope.cancel()
            conns.cancel_scope.deadline = trio.current_time() + CLOSE_TIMEOUT
        nursery.cancel_scope.cancel()


def _write_json(path: str, data: Any) -> None:
    with open(path, "wb") as f:
        f.write(orjson.dumps(data))


# ---------------------------------------------------------------------------------------------
# stall: a client that stops reading


async def role_stall(io: Io, cfg: dict[str, Any]) -> None:
    # One frame buffered: once it waits unread, the connection stops reading the socket, so the
    # server's sends back up into the kernel buffers.
    async with open_event_socket(
        cfg["url"], cfg["wid"], TOKEN, timeout=CONNECT_TIMEOUT, message_queue_size=RAW_QUEUE_SIZE
    ) as sock:
        await io.send("ready")
        command = await io.recv()
        assert command is not None and command["cmd"] == "drain"
        frames = gaps = 0
        got_complete = False
        with trio.move_on_after(float(command["timeout"])):
            async for text in sock:
                frames += 1
                gaps += GAP_MARK in text
                if RUN_COMPLETE_MARK in text:
                    got_complete = True
                    break
        await io.send(
            "done",
            frames=frames,
            gaps=gaps,
            run_complete=got_complete,
            close_code=sock.close_code,
            close_reason=sock.close_reason,
        )


# ---------------------------------------------------------------------------------------------
# chaos


#: Relative weights of the chaos operations.
CHAOS_WEIGHTS: Final = {
    "prompt": 30,  # the library's prompt (its own run_id: queued when the session is busy)
    "prompt_fold": 15,  # no run_id (folded into the active turn when busy): raw, see Chaos
    "prompt_ws": 10,  # the websocket command agent.prompt, on the raw connection
    "prompt_abort": 5,  # the library's prompt, abandoned by the client after a few milliseconds
    "cancel": 6,
    "clear": 3,
    "disconnect": 5,  # the raw connection: a close handshake, or cut without one
    "drop_stream": 3,  # the library's stream: dropped, re-opened by the library with since
    "read": 8,
}


def outcome(cancelled: bool, error: str | None) -> str:
    if cancelled:
        return "cancelled"
    return "failed" if error else "completed"


class Chaos:
    """One chaos client: the library's workspace client doing random operations, and a raw
    event-stream connection that comes and goes.

    The library drives everything it can express: prompts (with its own ``run_id``, or
    abandoned mid-request), cancels, queue clears, reads, dropping its stream (it re-opens it
    with ``since``), and following each of its runs through a :class:`RunHandle`. The raw
    connection, opened with the library's :func:`open_event_socket`, does what the library
    deliberately does not: it sends the websocket command ``agent.prompt`` (the library prompts
    over HTTP only), it is cut without a close handshake (the library always closes politely),
    and it counts every ``run_complete`` frame as received, before any de-duplication. A prompt
    without ``run_id`` goes through :meth:`Client.request <crush_trio.client.Client.request>`,
    because the library always sends one (so that its prompt is never folded into another turn),
    and folding is what that operation exercises.

    The invariant is checked on both streams: every accepted run has exactly one
    ``run_complete`` frame on the raw connection and exactly one ``run_complete`` event on the
    library's stream; the run handles must end with the same outcome.
    """

    def __init__(self, cfg: dict[str, Any], ws: WorkspaceClient, followers: trio.Nursery) -> None:
        self.cfg = cfg
        self.ws = ws
        self.client = ws.client
        self.followers = followers
        self.sessions: list[str] = []
        self.accepted: set[str] = set()
        self.uncertain: set[str] = set()
        self.ops: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[str] = collections.Counter()
        #: Every run_complete frame on the raw connection, per run id, and the outcome it gave.
        self.completes: collections.Counter[str] = collections.Counter()
        self.outcome_of: dict[str, str] = {}
        #: run_complete events on the library's stream, per run id.
        self.library_completes: collections.Counter[str] = collections.Counter()
        #: Runs sent with the library's prompt: how their handles ended (None while pending).
        self.handle_outcome: dict[str, str | None] = {}
        self.ws_stats: collections.Counter[str] = collections.Counter()
        # The raw connection.
        self.raw_client_id = str(uuid.uuid4())
        self.last_seq: int | None = None
        self.raw: EventSocket | None = None
        self.connected = trio.Event()
        self.read_scope: trio.CancelScope | None = None
        self.conn_scope: trio.CancelScope | None = None
        self.replies: dict[str, tuple[trio.Event, list[dict[str, Any]]]] = {}
        self.stop_raw = False
        #: Set (and replaced) whenever a run_complete arrives or a handle ends.
        self.completed = trio.Event()

    def _changed(self) -> None:
        self.completed.set()
        self.completed = trio.Event()

    # -- the library's stream ------------------------------------------------------------------

    async def count_library(self, feed: Subscription) -> None:
        try:
            async for event in feed:
                if event.type == "run_complete":
                    self.library_completes[event.payload.run_id] += 1
                    self._changed()
        except CrushError:
            pass  # the stream is gone for good (reported as stream_lost): runs lack its events

    def follow(self, handle: RunHandle) -> None:
        self.accepted.add(handle.run_id)
        self.handle_outcome[handle.run_id] = None
        self.followers.start_soon(self._follow, handle)

    async def _follow(self, handle: RunHandle) -> None:
        try:
            await handle.wait(timeout=None)
        finally:
            complete = handle.complete
            self.handle_outcome[handle.run_id] = (
                outcome(complete.cancelled, complete.error) if complete is not None else "lost"
            )
            self._changed()

    # -- the raw connection --------------------------------------------------------------------

    def on_frame(self, raw: str) -> None:
        envelope = orjson.loads(raw)
        kind = envelope.get("type")
        if kind == "reply":
            waiter = self.replies.pop(str(envelope.get("id")), None)
            if waiter is not None:
                waiter[1].append(envelope)
                waiter[0].set()
            return
        if kind == "error" or kind == "hello":
            self.ws_stats[kind] += 1
            return
        seq = int(envelope["seq"])
        if kind == "gap":
            self.ws_stats["gaps"] += 1
            to_seq = int(envelope["payload"]["to_seq"])
            if self.last_seq is None or to_seq > self.last_seq:
                self.last_seq = to_seq
            return
        self.ws_stats["events"] += 1
        if self.last_seq is not None and seq <= self.last_seq:
            self.ws_stats["seq_regressions"] += 1
        else:
            self.last_seq = seq
        if kind == "run_complete":
            complete = envelope["payload"]["payload"]
            run_id = complete["run_id"]
            self.completes[run_id] += 1
            self.outcome_of[run_id] = outcome(
                bool(complete.get("cancelled")), complete.get("error")
            )
            self._changed()

    async def keep_raw(self) -> None:
        """Hold the raw connection open, re-opening it (with ``since``) whenever it goes away."""
        rng = random.Random(self.cfg["seed"] + 7)
        while not self.stop_raw:
            try:
                with trio.CancelScope() as conn_scope:
                    self.conn_scope = conn_scope
                    async with open_event_socket(
                        self.client.url,
                        self.ws.id,
                        self.client.token,
                        client_id=self.raw_client_id,
                        since=self.last_seq,
                        message_queue_size=RAW_QUEUE_SIZE,
                    ) as sock:
                        if self.last_seq is None:
                            self.last_seq = int(sock.hello["seq"])
                        self.raw = sock
                        self.connected.set()
                        self.ws_stats["connects"] += 1
                        with trio.CancelScope() as read_scope:
                            self.read_scope = read_scope
                            async for text in sock:
                                self.on_frame(text)
                        if sock.closed:
                            self.ws_stats[f"closed_by_server_{sock.close_code}"] += 1
            except (CrushError, OSError) as exc:
                self.ws_stats[f"open_failed_{type(exc).__name__}"] += 1
            finally:
                self.raw = None
                self.read_scope = self.conn_scope = None
                self.connected = trio.Event()
                for event, _ in self.replies.values():
                    event.set()  # no reply will come on this connection
                self.replies.clear()
            if not self.stop_raw:
                await trio.sleep(rng.uniform(0, float(self.cfg["reconnect_max"])))

    def disconnect(self, rng: random.Random) -> None:
        if rng.random() < 0.5:
            if self.read_scope is not None:  # a normal close handshake
                self.read_scope.cancel()
                self.ops["disconnect_clean"] += 1
        elif self.conn_scope is not None:  # cut it: the close handshake is cancelled too
            self.conn_scope.cancel()
            self.ops["disconnect_abrupt"] += 1

    async def prompt_ws(self, session_id: str, text: str) -> None:
        sock = self.raw
        if sock is None:
            return
        run_id, request_id = str(uuid.uuid4()), str(uuid.uuid4())
        self.uncertain.add(run_id)
        event, box = trio.Event(), list[dict[str, Any]]()
        self.replies[request_id] = (event, box)
        params = {"session_id": session_id, "run_id": run_id, "prompt": text}
        try:
            await sock.connection.send_message(
                orjson.dumps(
                    {"id": request_id, "method": "agent.prompt", "params": params}
                ).decode()
            )
        except ConnectionClosed:
            self.replies.pop(request_id, None)
            return
        with trio.move_on_after(HTTP_TIMEOUT):
            await event.wait()
        if box:
            reply = box[0]
            if reply.get("ok"):
                self.accepted.add(reply["result"]["run_id"])
            else:
                self.rejected[f"ws_{reply.get('status')}"] += 1
            self.uncertain.discard(run_id)

    # -- operations ----------------------------------------------------------------------------

    def prompt_text(self, rng: random.Random) -> str:
        return " ".join(f"word{rng.randrange(1000)}" for _ in range(rng.randint(1, 12)))

    def refused(self, exc: CrushError, run_id: str | None) -> None:
        """The server answered a prompt with an error; an error of this side is re-raised (the
        prompt may have arrived, so its run stays uncertain)."""
        if isinstance(exc, Unreachable | Timeout):
            raise exc
        self.rejected[str(exc.status)] += 1
        if run_id is not None:
            self.uncertain.discard(run_id)

    async def prompt(self, session_id: str, text: str) -> None:
        run_id = str(uuid.uuid4())
        self.uncertain.add(run_id)
        try:
            handle = await self.ws.prompt(session_id, text, run_id)
        except CrushError as exc:
            self.refused(exc, run_id)
        else:
            self.uncertain.discard(run_id)
            self.follow(handle)

    async def operate(self, op: str, rng: random.Random) -> None:
        sid = rng.choice(self.sessions)
        if op == "prompt":
            await self.prompt(sid, self.prompt_text(rng))
        elif op == "prompt_fold":
            body = {"session_id": sid, "prompt": self.prompt_text(rng)}
            try:
                accepted = await self.client.request(
                    "POST", f"/v1/workspaces/{self.ws.id}/agent", json=body
                )
            except CrushError as exc:
                self.refused(exc, None)
            else:
                self.accepted.add(accepted["run_id"])
        elif op == "prompt_abort":
            with trio.move_on_after(rng.uniform(0, 0.01)):
                await self.prompt(sid, self.prompt_text(rng))
        elif op == "prompt_ws":
            await self.prompt_ws(sid, self.prompt_text(rng))
        elif op == "cancel":
            await self.ws.cancel(sid)
        elif op == "clear":
            await self.ws.clear_queue(sid)
        elif op == "disconnect":
            self.disconnect(rng)
        elif op == "drop_stream":
            self.ws.drop_stream()
        elif op == "read":
            choice = rng.randrange(3)
            if choice == 0:
                await self.ws.messages(sid)
            elif choice == 1 and self.accepted:
                await self.ws.get_run(rng.choice(sorted(self.accepted)))
            else:
                await self.ws.queued(sid)

    async def actor(self, index: int, until: float) -> None:
        rng = random.Random(self.cfg["seed"] * 1000 + index)
        ops, weights = zip(*CHAOS_WEIGHTS.items(), strict=True)
        think = float(self.cfg["think_max"])
        while trio.current_time() < until:
            op = rng.choices(ops, weights)[0]
            self.ops[op] += 1
            try:
                await self.operate(op, rng)
            except CrushError as exc:
                self.ops[f"error_{type(exc).__name__}"] += 1
            await trio.sleep(rng.uniform(0, think))

    # -- the end -------------------------------------------------------------------------------

    async def resolve_uncertain(self) -> int:
        """Ask the server about runs whose prompt reply never came; returns how many existed."""
        found = 0
        for run_id in sorted(self.uncertain):
            try:
                await self.ws.get_run(run_id)
            except CrushError:
                continue
            self.accepted.add(run_id)
            found += 1
        return found

    def settled_run(self, run_id: str) -> bool:
        return bool(self.completes[run_id] and self.library_completes[run_id])

    def settled(self) -> bool:
        every_complete = all(self.settled_run(r) for r in self.accepted)
        return every_complete and None not in self.handle_outcome.values()

    async def settle(self, within: float) -> None:
        """Wait (at most ``within`` seconds) until every accepted run has its run_complete on
        both streams and every run handle has ended."""
        with trio.move_on_after(within):
            while not self.settled():
                await self.completed.wait()
        await trio.sleep(LATE_DUPLICATES)

    def totals(self) -> dict[str, Any]:
        raw, library = self.completes, self.library_completes
        handles = list(self.handle_outcome.values())
        return {
            "accepted": len(self.accepted),
            "exactly_once": sum(1 for r in self.accepted if raw[r] == 1 and library[r] == 1),
            "missing": sum(1 for r in self.accepted if raw[r] == 0 or library[r] == 0),
            "duplicated": sum(1 for r in self.accepted if raw[r] > 1 or library[r] > 1),
            "foreign_completes": sum(n for r, n in raw.items() if r not in self.accepted),
            "outcomes": dict(
                collections.Counter(
                    self.outcome_of[r] for r in self.accepted if r in self.outcome_of
                )
            ),
            "library": {
                "handles": len(handles),
                "handles_ended": sum(1 for o in handles if o is not None),
                "handles_lost": sum(1 for o in handles if o == "lost"),
                "handle_mismatches": sum(
                    1
                    for r, o in self.handle_outcome.items()
                    if o is not None and o != "lost" and o != self.outcome_of.get(r, o)
                ),
            },
        }

    async def missing_report(self) -> list[dict[str, Any]]:
        """The first runs lacking a run_complete on a stream, with what the server says."""
        out: list[dict[str, Any]] = []
        lacking = (r for r in sorted(self.accepted) if not self.settled_run(r))
        for run_id in itertools.islice(lacking, 20):
            raw, library = self.completes[run_id], self.library_completes[run_id]
            try:
                status = (await self.ws.get_run(run_id)).status.value
            except CrushError as exc:
                status = describe(exc)
            out.append({"run_id": run_id, "raw": raw, "library": library, "status": status})
        return out


async def role_chaos(io: Io, cfg: dict[str, Any]) -> None:
    async with (
        connect(cfg["url"], TOKEN, request_timeout=HTTP_TIMEOUT, max_connections=64) as client,
        client.workspace(cfg["project"]) as ws,
        ws.subscribe(timeout=None) as feed,
        trio.open_nursery() as nursery,
    ):
        chaos = Chaos(cfg, ws, nursery)
        nursery.start_soon(chaos.count_library, feed)
        for _ in range(int(cfg["sessions"])):
            chaos.sessions.append((await ws.create_session("bench")).id)
        nursery.start_soon(chaos.keep_raw)
        with trio.fail_after(30):
            await chaos.connected.wait()
        await io.send("ready")
        command = await io.recv()
        assert command is not None and command["cmd"] == "go"
        until = trio.current_time() + float(cfg["seconds"])
        async with trio.open_nursery() as actors:
            for index in range(int(cfg["actors"])):
                actors.start_soon(chaos.actor, index, until)
        # Stop disconnecting; make sure the raw connection is open while the last runs end.
        with trio.move_on_after(30):
            await chaos.connected.wait()
        found = await chaos.resolve_uncertain()
        await chaos.settle(float(cfg["settle_timeout"]))
        totals = chaos.totals()
        library = totals.pop("library")
        stats = ws.stats
        await io.send(
            "done",
            **totals,
            uncertain_found=found,
            uncertain_absent=len(chaos.uncertain) - found,
            ops=dict(chaos.ops),
            rejected=dict(chaos.rejected),
            ws=dict(chaos.ws_stats),
            library={
                **library,
                "connects": stats.connects,
                "reconnects": stats.reconnects,
                "drops": stats.drops,
                "gaps": stats.gaps,
                "refetches": stats.refetches,
                "events": stats.events,
                "stream_lost": int(ws.stream_error is not None),
            },
            missing_runs=await chaos.missing_report(),
        )
        chaos.stop_raw = True
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------------------------

ROLES: Final[dict[str, Callable[[Io, dict[str, Any]], Awaitable[None]]]] = {
    "runs": role_runs,
    "watch": role_watch,
    "stall": role_stall,
    "chaos": role_chaos,
}


async def _main(role: str) -> None:
    io = Io()
    cfg = await io.recv()
    if cfg is None:
        return
    try:
        await ROLES[role](io, cfg)
    except Exception:
        await io.send("error", message=traceback.format_exc()[-4000:])
        raise


def main() -> None:
    if len(sys.argv) != 2 or sys.argv[1] not in ROLES:
        print(f"usage: python -m bench.client {{{','.join(ROLES)}}}", file=sys.stderr)
        sys.exit(2)
    raise_fd_limit()
    try:
        trio.run(_main, sys.argv[1])
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
