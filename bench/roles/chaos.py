"""The ``chaos`` role: random operations through the library and a raw connection that comes
and goes; every accepted run must get exactly one ``run_complete`` on each stream.
"""

from __future__ import annotations

import collections
import itertools
import random
import uuid
from typing import Any, Final

import orjson
import trio
from trio_websocket import ConnectionClosed

from crush_trio.client import (
    CrushError,
    EventSocket,
    RunHandle,
    Subscription,
    Timeout,
    Unreachable,
    WorkspaceClient,
    connect,
    open_event_socket,
)

from ..procs import TOKEN
from .common import (
    HTTP_TIMEOUT,
    RAW_QUEUE_SIZE,
    Io,
    describe,
)

#: Chaos: how long to keep listening after the last expected run_complete, for duplicates.
LATE_DUPLICATES: Final = 0.5


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
        ws.subscribe(timeout=None, types={"run_complete"}) as feed,
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
        assert command is not None
        assert command["cmd"] == "go"
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
