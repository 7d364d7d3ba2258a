"""The ``runs`` role: one library workspace client submitting prompts and following their runs."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from crush_trio.client import (
    CrushError,
    Event,
    RunHandle,
    Subscription,
    WorkspaceClient,
    connect,
)
from crush_trio.wire import Message, Role, ToolResultPart
from tests.fake_llm import STAMP_RE

from ..procs import TOKEN
from .common import (
    HTTP_TIMEOUT,
    Io,
    client_deltas,
    describe,
)


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
        ws.subscribe(timeout=None, types={"run_complete"}) as feed,
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
