"""Client workers: the load generators, each in its own process.

``python -m bench.client ROLE`` reads its configuration as the first JSON line on stdin, then
commands (one JSON object per line); it writes events to stdout as JSON lines
(``{"event": "ready" | "progress" | "done" | "error", ...}``). Roles:

* ``runs``: one websocket watching the workspace plus an httpx client; creates sessions, submits
  one prompt per session on ``go`` (W1, W2) or a long series of short runs on ``soak`` (W4), and
  measures submit → first visible text, submit → ``run_complete``, and (when the model stamps its
  tokens) token-to-client latency.
* ``watch``: ``count`` websocket clients that read until a ``run_complete`` frame (W3, and the
  reading client of W4) or stay idle until ``quit`` (W4's idle clients).
* ``stall``: one websocket client that never reads until told to ``drain`` (W4).
* ``chaos``: a bounded random mix of prompts, cancels, clears, disconnects and reads (W5),
  checking that every accepted run gets exactly one ``run_complete``.

Times are ``time.time()`` so that they compare across processes on one machine.
"""

from __future__ import annotations

import collections
import os
import random
import sys
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import httpx
import orjson
import trio
from trio_websocket import (
    ConnectionClosed,
    HandshakeError,
    WebSocketConnection,
    open_websocket_url,
)

from tests.fake_llm import STAMP_RE

from .procs import TOKEN, LineReader, raise_fd_limit

#: Largest websocket message a client accepts.
MAX_MESSAGE: Final = 16 * 1024 * 1024
#: Websocket handshakes in flight at once per worker.
CONNECT_CONCURRENCY: Final = 64
#: Bound on a websocket close handshake.
CLOSE_TIMEOUT: Final = 5.0
#: Bound on one HTTP request.
HTTP_TIMEOUT: Final = 30.0
#: The envelope of a ``run_complete`` / ``gap`` frame, as the server encodes it (no spaces).
RUN_COMPLETE_MARK: Final = '"type":"run_complete"'
GAP_MARK: Final = '"type":"gap"'
#: Chaos: how long to keep listening after the last expected run_complete, for duplicates.
LATE_DUPLICATES: Final = 0.5


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


def http_client(base_url: str, connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=base_url,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=HTTP_TIMEOUT,
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


def message_text(message: dict[str, Any]) -> str:
    return "".join(
        part["data"].get("text", "") for part in message["parts"] if part["type"] == "text"
    )


# ---------------------------------------------------------------------------------------------
# runs: submit prompts, watch their events


@dataclass
class RunTrack:
    """One submitted run, as this client saw it."""

    session_id: str
    run_id: str
    submitted: float = 0.0
    first_text: float | None = None
    completed: float | None = None
    completes: int = 0
    error: str | None = None
    cancelled: bool = False
    text: str = ""
    seen_stamps: int = 0
    done: trio.Event = field(default_factory=trio.Event)


class RunTracker:
    """Routes the workspace's frames to the runs this client submitted."""

    def __init__(self, stamp: bool) -> None:
        self.stamp = stamp
        self.by_session: dict[str, RunTrack] = {}
        self.by_run: dict[str, RunTrack] = {}
        self.frames = 0
        self.bytes = 0
        self.gaps = 0
        self.token_latencies: list[float] = []
        self.closed_reason = ""
        #: Set (and replaced) whenever one of the tracked runs ends.
        self.changed = trio.Event()

    def _ended(self, track: RunTrack) -> None:
        track.done.set()
        self.changed.set()
        self.changed = trio.Event()

    def add(self, track: RunTrack) -> None:
        if self.closed_reason:
            track.error = self.closed_reason
            track.done.set()
        self.by_session[track.session_id] = track
        self.by_run[track.run_id] = track

    def forget(self, track: RunTrack) -> None:
        self.by_run.pop(track.run_id, None)
        if self.by_session.get(track.session_id) is track:
            del self.by_session[track.session_id]

    def closed(self, why: str) -> None:
        self.closed_reason = why
        for track in self.by_run.values():
            if not track.done.is_set():
                track.error = why
                self._ended(track)

    def on_frame(self, raw: str) -> None:
        now = time.time()
        self.frames += 1
        self.bytes += len(raw)
        envelope = orjson.loads(raw)
        kind = envelope.get("type")
        if kind == "message":
            message = envelope["payload"]["payload"]
            track = self.by_session.get(message["session_id"])
            if track is None or track.completed is not None or message["role"] != "assistant":
                return
            text = message_text(message)
            if not text:
                return
            if track.first_text is None:
                track.first_text = now
            if self.stamp:
                stamps = STAMP_RE.findall(text)
                for stamp in stamps[track.seen_stamps :]:
                    self.token_latencies.append(now - float(stamp))
                track.seen_stamps = len(stamps)
        elif kind == "run_complete":
            complete = envelope["payload"]["payload"]
            track = self.by_run.get(complete["run_id"])
            if track is None:
                return
            track.completes += 1
            if track.completes == 1:
                track.completed = now
                track.error = complete.get("error")
                track.cancelled = bool(complete.get("cancelled"))
                track.text = complete.get("text") or ""
                self._ended(track)
        elif kind == "gap":
            self.gaps += 1


async def read_frames(ws: WebSocketConnection, tracker: RunTracker) -> None:
    """Feed every frame to the tracker; when the server closes the stream, fail the runs still
    waiting (their run_complete can no longer arrive on this socket)."""
    try:
        while True:
            raw = await ws.get_message()
            tracker.on_frame(raw if isinstance(raw, str) else raw.decode())
    except ConnectionClosed as exc:
        tracker.closed(f"event stream closed by the server: {exc.reason}")


async def submit(
    http: httpx.AsyncClient, wid: str, track: RunTrack, prompt: str, tracker: RunTracker
) -> None:
    """POST a prompt with the track's own run_id (so run_complete can never beat the reply)."""
    tracker.add(track)
    track.submitted = time.time()
    body = {"session_id": track.session_id, "run_id": track.run_id, "prompt": prompt}
    try:
        response = await http.post(f"/v1/workspaces/{wid}/agent", json=body)
    except httpx.HTTPError as exc:
        track.error = f"{type(exc).__name__}: {exc}"
        track.done.set()
        return
    if response.status_code != 202:
        track.error = f"HTTP {response.status_code}: {response.text[:200]}"
        track.done.set()


async def create_sessions(http: httpx.AsyncClient, wid: str, count: int) -> list[str]:
    ids: list[str] = []
    limiter = trio.CapacityLimiter(16)

    async def one() -> None:
        async with limiter:
            response = await http.post(f"/v1/workspaces/{wid}/sessions", json={"title": "bench"})
            response.raise_for_status()
            ids.append(response.json()["id"])

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
    return ids


def run_summary(tracks: list[RunTrack]) -> dict[str, Any]:
    done = [t for t in tracks if t.completed is not None]
    return {
        "runs": len(tracks),
        "completed": sum(1 for t in done if t.error is None and not t.cancelled),
        "failed": sum(1 for t in tracks if t.error is not None),
        "missing": sum(1 for t in tracks if t.completed is None and t.error is None),
        "duplicates": sum(max(0, t.completes - 1) for t in tracks),
        "errors": sorted({t.error for t in tracks if t.error})[:5],
        "started": min((t.submitted for t in tracks), default=0.0),
        "finished": max((t.completed for t in done if t.completed), default=0.0),
        "first_text": [t.first_text - t.submitted for t in tracks if t.first_text is not None],
        "latency": [t.completed - t.submitted for t in done if t.completed is not None],
        "tokens": sum(len(STAMP_RE.sub("", t.text).split()) for t in done),
    }


async def role_runs(io: Io, cfg: dict[str, Any]) -> None:
    wid = cfg["wid"]
    tracker = RunTracker(stamp=bool(cfg.get("stamp")))
    ws_url = f"{cfg['ws']}/v1/workspaces/{wid}/ws?client_id={uuid.uuid4()}&token={TOKEN}"
    sessions: list[str] = []
    async with (
        http_client(cfg["http"], int(cfg.get("connections", 100))) as http,
        open_websocket_url(
            ws_url, max_message_size=MAX_MESSAGE, disconnect_timeout=CLOSE_TIMEOUT
        ) as ws,
        trio.open_nursery() as nursery,
    ):
        await ws.get_message()  # hello
        nursery.start_soon(read_frames, ws, tracker)
        await io.send("ready")
        while (command := await io.recv()) is not None:
            name = command["cmd"]
            if name == "sessions":
                sessions = await create_sessions(http, wid, int(command["count"]))
                await io.send("sessions", count=len(sessions))
            elif name == "go":
                await go(io, http, wid, tracker, sessions, command)
            elif name == "soak":
                await soak(io, http, wid, tracker, command)
            elif name == "quit":
                break
        nursery.cancel_scope.cancel()


async def go(
    io: Io,
    http: httpx.AsyncClient,
    wid: str,
    tracker: RunTracker,
    sessions: list[str],
    command: dict[str, Any],
) -> None:
    """One prompt per session, all at once; report when every run has its run_complete."""
    tracks = [RunTrack(sid, str(uuid.uuid4())) for sid in sessions]
    frames0, gaps0 = tracker.frames, tracker.gaps
    tracker.token_latencies = []
    prompt = command["prompt"]
    stall = float(command.get("stall", command["timeout"]))
    with trio.move_on_after(float(command["timeout"])):
        async with trio.open_nursery() as nursery:
            for track in tracks:
                nursery.start_soon(submit, http, wid, track, prompt, tracker)
        # Give up early when no run ends for ``stall`` seconds: a run that lost its
        # run_complete would otherwise hold the whole phase until its timeout.
        while not all(track.done.is_set() for track in tracks):
            with trio.move_on_after(stall) as idle:
                await tracker.changed.wait()
            if idle.cancelled_caught:
                break
    summary = run_summary(tracks)
    for track in tracks:
        tracker.forget(track)
    await io.send(
        "done",
        frames=tracker.frames - frames0,
        gaps=tracker.gaps - gaps0,
        token_latency=tracker.token_latencies,
        **summary,
    )


async def soak(
    io: Io, http: httpx.AsyncClient, wid: str, tracker: RunTracker, command: dict[str, Any]
) -> None:
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

    async def loop() -> None:
        while state["submitted"] < total:
            (sid,) = await create_sessions(http, wid, 1)
            for _ in range(per_session):
                if state["submitted"] >= total:
                    return
                state["submitted"] += 1
                track = RunTrack(sid, str(uuid.uuid4()))
                await submit(http, wid, track, prompt, tracker)
                with trio.move_on_after(timeout):
                    await track.done.wait()
                if track.completed is None and track.error is None:
                    state["missing"] += 1
                elif track.error is not None:
                    state["failed"] += 1
                else:
                    latencies.append(track.completed - track.submitted)  # type: ignore[operator]
                state["duplicates"] += max(0, track.completes - 1)
                tracker.forget(track)
                state["done"] += 1
                if state["done"] % every == 0 or state["done"] == total:
                    await io.send("progress", done=state["done"], time=time.time())

    started = time.time()
    async with trio.open_nursery() as nursery:
        for _ in range(int(command["concurrency"])):
            nursery.start_soon(loop)
    await io.send("done", started=started, finished=time.time(), latency=latencies, **state)


# ---------------------------------------------------------------------------------------------
# watch: many clients reading until run_complete (or idle until quit)


async def role_watch(io: Io, cfg: dict[str, Any]) -> None:
    count = int(cfg["count"])
    template: str = cfg["url"]
    record_path: str | None = cfg.get("record")
    recorded: list[str] = []
    stats: collections.Counter[str] = collections.Counter()
    closes: collections.Counter[str] = collections.Counter()
    frames_per_conn: list[int] = []
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
        url = template.replace("{cid}", str(uuid.uuid4()))
        frames = 0
        holding = True
        await handshakes.acquire()
        try:
            async with open_websocket_url(
                url, max_message_size=MAX_MESSAGE, disconnect_timeout=CLOSE_TIMEOUT
            ) as ws:
                await ws.get_message()  # hello
                handshakes.release()
                holding = False
                stats["connected"] += 1
                settled()
                with trio.CancelScope() as scope:
                    reading_scopes.append(scope)
                    try:
                        while True:
                            raw = await ws.get_message()
                            text = raw if isinstance(raw, str) else raw.decode()
                            frames += 1
                            stats["bytes"] += len(text)
                            if index == 0 and record_path:
                                recorded.append(text)
                            if GAP_MARK in text:
                                stats["gaps"] += 1
                            if RUN_COMPLETE_MARK in text:
                                stats["run_complete"] += 1
                                end_times.append(time.time())
                                break
                    except ConnectionClosed as exc:
                        closes[str(exc.reason.code if exc.reason else None)] += 1
                    stats["frames"] += frames
                    frames_per_conn.append(frames)
                    stats["ended"] += 1
                    settled()
                await finish.wait()
        except (HandshakeError, OSError, ConnectionClosed) as exc:
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
                gaps=stats["gaps"],
                run_complete=stats["run_complete"],
                ended=stats["ended"],
                failed=stats["failed"],
                closes=dict(closes),
                min_frames=min(frames_per_conn, default=0),
                max_frames=max(frames_per_conn, default=0),
                last_end=max(end_times, default=0.0),
            )
            await finish.wait()
            for scope in reading_scopes:
                scope.cancel()
            conns.cancel_scope.deadline = trio.current_time() + CLOSE_TIMEOUT * 2
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------------------------------
# stall: a client that stops reading


def _write_json(path: str, data: Any) -> None:
    with open(path, "wb") as f:
        f.write(orjson.dumps(data))


async def role_stall(io: Io, cfg: dict[str, Any]) -> None:
    # message_queue_size=1: once one message waits unread, the connection's reader stops
    # reading the socket, so the server's sends back up into the kernel buffers.
    async with open_websocket_url(
        cfg["url"], max_message_size=MAX_MESSAGE, message_queue_size=1, disconnect_timeout=2
    ) as ws:
        await ws.get_message()  # hello
        await io.send("ready")
        command = await io.recv()
        assert command is not None and command["cmd"] == "drain"
        frames = gaps = 0
        got_complete = False
        close_code: int | None = None
        close_reason = ""
        try:
            with trio.move_on_after(float(command["timeout"])):
                while True:
                    raw = await ws.get_message()
                    text = raw if isinstance(raw, str) else raw.decode()
                    frames += 1
                    gaps += GAP_MARK in text
                    if RUN_COMPLETE_MARK in text:
                        got_complete = True
                        break
        except ConnectionClosed as exc:
            if exc.reason is not None:
                close_code, close_reason = exc.reason.code, exc.reason.reason or ""
        await io.send(
            "done",
            frames=frames,
            gaps=gaps,
            run_complete=got_complete,
            close_code=close_code,
            close_reason=close_reason,
        )


# ---------------------------------------------------------------------------------------------
# chaos


#: Relative weights of the chaos operations.
CHAOS_WEIGHTS: Final = {
    "prompt": 30,  # HTTP, with a run_id (queued when the session is busy)
    "prompt_fold": 15,  # HTTP, without a run_id (folded into the active turn when busy)
    "prompt_ws": 10,  # the websocket command agent.prompt
    "prompt_abort": 5,  # HTTP with a run_id, the client gives up after a few milliseconds
    "cancel": 6,
    "clear": 3,
    "disconnect": 5,
    "read": 8,
}


class Chaos:
    """One chaos client: a websocket that comes and goes, and actors doing random operations."""

    def __init__(self, cfg: dict[str, Any], http: httpx.AsyncClient) -> None:
        self.cfg = cfg
        self.http = http
        self.wid: str = cfg["wid"]
        self.client_id = str(uuid.uuid4())
        self.sessions: list[str] = []
        self.accepted: set[str] = set()
        self.uncertain: set[str] = set()
        self.completes: collections.Counter[str] = collections.Counter()
        self.outcome_of: dict[str, str] = {}
        self.ops: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[str] = collections.Counter()
        self.ws_stats: collections.Counter[str] = collections.Counter()
        self.last_seq: int | None = None
        self.ws: WebSocketConnection | None = None
        self.connected = trio.Event()
        self.read_scope: trio.CancelScope | None = None
        self.conn_scope: trio.CancelScope | None = None
        self.replies: dict[str, tuple[trio.Event, list[dict[str, Any]]]] = {}
        self.stop_ws = False
        #: Set (and replaced) whenever a run_complete arrives.
        self.completed = trio.Event()

    # -- the websocket ---------------------------------------------------------------------------

    def ws_url(self) -> str:
        url = (
            f"{self.cfg['ws']}/v1/workspaces/{self.wid}/ws?client_id={self.client_id}&token={TOKEN}"
        )
        if self.last_seq is not None:
            url += f"&since={self.last_seq}"
        return url

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
            if complete.get("cancelled"):
                self.outcome_of[run_id] = "cancelled"
            elif complete.get("error"):
                self.outcome_of[run_id] = "failed"
            else:
                self.outcome_of[run_id] = "completed"
            self.completed.set()
            self.completed = trio.Event()

    async def keep_connected(self) -> None:
        """Hold a websocket open, reconnecting (with ``since``) whenever it goes away."""
        rng = random.Random(self.cfg["seed"] + 7)
        while not self.stop_ws:
            try:
                with trio.CancelScope() as conn_scope:
                    self.conn_scope = conn_scope
                    async with open_websocket_url(
                        self.ws_url(),
                        max_message_size=MAX_MESSAGE,
                        connect_timeout=10,
                        disconnect_timeout=2,
                    ) as ws:
                        hello = orjson.loads(await ws.get_message())
                        if self.last_seq is None:
                            self.last_seq = int(hello["seq"])
                        self.ws = ws
                        self.connected.set()
                        self.ws_stats["connects"] += 1
                        with trio.CancelScope() as read_scope:
                            self.read_scope = read_scope
                            while True:
                                raw = await ws.get_message()
                                self.on_frame(raw if isinstance(raw, str) else raw.decode())
            except (ConnectionClosed, HandshakeError, OSError) as exc:
                self.ws_stats[f"closed_{type(exc).__name__}"] += 1
            finally:
                self.ws = None
                self.read_scope = self.conn_scope = None
                self.connected = trio.Event()
                for event, _ in self.replies.values():
                    event.set()  # no reply will come on this connection
                self.replies.clear()
            if not self.stop_ws:
                await trio.sleep(rng.uniform(0, float(self.cfg["reconnect_max"])))

    def disconnect(self, rng: random.Random) -> None:
        if rng.random() < 0.5:
            if self.read_scope is not None:  # a normal close handshake
                self.read_scope.cancel()
                self.ops["disconnect_clean"] += 1
        elif self.conn_scope is not None:  # cut it: the close handshake is cancelled too
            self.conn_scope.cancel()
            self.ops["disconnect_abrupt"] += 1

    # -- operations ----------------------------------------------------------------------------

    def prompt_text(self, rng: random.Random) -> str:
        return " ".join(f"word{rng.randrange(1000)}" for _ in range(rng.randint(1, 12)))

    def _result(self, run_id: str | None, response: httpx.Response) -> None:
        if response.status_code == 202:
            self.accepted.add(response.json()["run_id"])
        else:
            self.rejected[str(response.status_code)] += 1
        if run_id is not None:
            self.uncertain.discard(run_id)

    async def operate(self, op: str, rng: random.Random) -> None:
        sid = rng.choice(self.sessions)
        base = f"/v1/workspaces/{self.wid}"
        if op == "prompt":
            run_id = str(uuid.uuid4())
            self.uncertain.add(run_id)
            body = {"session_id": sid, "run_id": run_id, "prompt": self.prompt_text(rng)}
            self._result(run_id, await self.http.post(f"{base}/agent", json=body))
        elif op == "prompt_fold":
            body = {"session_id": sid, "prompt": self.prompt_text(rng)}
            self._result(None, await self.http.post(f"{base}/agent", json=body))
        elif op == "prompt_abort":
            run_id = str(uuid.uuid4())
            self.uncertain.add(run_id)
            body = {"session_id": sid, "run_id": run_id, "prompt": self.prompt_text(rng)}
            with trio.move_on_after(rng.uniform(0, 0.01)):
                self._result(run_id, await self.http.post(f"{base}/agent", json=body))
        elif op == "prompt_ws":
            ws = self.ws
            if ws is None:
                return
            run_id, request_id = str(uuid.uuid4()), str(uuid.uuid4())
            self.uncertain.add(run_id)
            event, box = trio.Event(), list[dict[str, Any]]()
            self.replies[request_id] = (event, box)
            params = {"session_id": sid, "run_id": run_id, "prompt": self.prompt_text(rng)}
            try:
                await ws.send_message(
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
        elif op == "cancel":
            await self.http.post(f"{base}/agent/sessions/{sid}/cancel")
        elif op == "clear":
            await self.http.post(f"{base}/agent/sessions/{sid}/prompts/clear")
        elif op == "disconnect":
            self.disconnect(rng)
        elif op == "read":
            choice = rng.randrange(3)
            if choice == 0:
                await self.http.get(f"{base}/sessions/{sid}/messages")
            elif choice == 1 and self.accepted:
                run_id = rng.choice(sorted(self.accepted))
                await self.http.get(f"{base}/runs/{run_id}")
            else:
                await self.http.get(f"{base}/agent/sessions/{sid}/prompts/queued")

    async def actor(self, index: int, until: float) -> None:
        rng = random.Random(self.cfg["seed"] * 1000 + index)
        ops, weights = zip(*CHAOS_WEIGHTS.items(), strict=True)
        think = float(self.cfg["think_max"])
        while trio.current_time() < until:
            op = rng.choices(ops, weights)[0]
            self.ops[op] += 1
            try:
                await self.operate(op, rng)
            except httpx.HTTPError as exc:
                self.ops[f"http_error_{type(exc).__name__}"] += 1
            await trio.sleep(rng.uniform(0, think))

    # -- the end -------------------------------------------------------------------------------

    async def resolve_uncertain(self) -> int:
        """Ask the server about runs whose prompt reply never came; returns how many existed."""
        found = 0
        for run_id in sorted(self.uncertain):
            response = await self.http.get(f"/v1/workspaces/{self.wid}/runs/{run_id}")
            if response.status_code == 200:
                self.accepted.add(run_id)
                found += 1
        return found

    async def settle(self, within: float) -> None:
        """Wait (at most ``within`` seconds) until every accepted run has its run_complete."""
        with trio.move_on_after(within):
            while any(self.completes[r] == 0 for r in self.accepted):
                await self.completed.wait()
        await trio.sleep(LATE_DUPLICATES)

    async def missing_report(self) -> list[dict[str, Any]]:
        out = []
        for run_id in sorted(r for r in self.accepted if self.completes[r] == 0)[:20]:
            response = await self.http.get(f"/v1/workspaces/{self.wid}/runs/{run_id}")
            status = response.json().get("status") if response.status_code == 200 else None
            out.append({"run_id": run_id, "http": response.status_code, "status": status})
        return out


async def role_chaos(io: Io, cfg: dict[str, Any]) -> None:
    async with http_client(cfg["http"], 64) as http, trio.open_nursery() as nursery:
        chaos = Chaos(cfg, http)
        chaos.sessions = await create_sessions(http, chaos.wid, int(cfg["sessions"]))
        nursery.start_soon(chaos.keep_connected)
        with trio.fail_after(30):
            await chaos.connected.wait()
        await io.send("ready")
        command = await io.recv()
        assert command is not None and command["cmd"] == "go"
        until = trio.current_time() + float(cfg["seconds"])
        async with trio.open_nursery() as actors:
            for index in range(int(cfg["actors"])):
                actors.start_soon(chaos.actor, index, until)
        # Stop disconnecting; make sure a socket is open while the last runs end.
        with trio.move_on_after(30):
            await chaos.connected.wait()
        found = await chaos.resolve_uncertain()
        await chaos.settle(float(cfg["settle_timeout"]))
        exactly_once = sum(1 for r in chaos.accepted if chaos.completes[r] == 1)
        await io.send(
            "done",
            accepted=len(chaos.accepted),
            exactly_once=exactly_once,
            missing=sum(1 for r in chaos.accepted if chaos.completes[r] == 0),
            duplicated=sum(1 for r in chaos.accepted if chaos.completes[r] > 1),
            uncertain_found=found,
            uncertain_absent=len(chaos.uncertain) - found,
            foreign_completes=sum(n for r, n in chaos.completes.items() if r not in chaos.accepted),
            outcomes=dict(
                collections.Counter(
                    chaos.outcome_of[r] for r in chaos.accepted if r in chaos.outcome_of
                )
            ),
            ops=dict(chaos.ops),
            rejected=dict(chaos.rejected),
            ws=dict(chaos.ws_stats),
            missing_runs=await chaos.missing_report(),
        )
        chaos.stop_ws = True
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
