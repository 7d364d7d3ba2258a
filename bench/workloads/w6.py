"""W6, soak: mixed load on one server for a long time; RSS over time and where memory grew.

One server process runs under :mod:`bench.traced_server` (``tracemalloc`` on). The load runs in
this process, against a fake model served here too (:class:`tests.fake_llm.FakeLLM`, whose reply
depends on a marker in the prompt):

* 3 workspaces (the last one is closed and reopened over and over by a client of its own, with a
  new client id each cycle) and 20 sessions, some deleted and replaced as the run goes;
* prompts over HTTP and over websocket commands: plain replies, provider failures before the
  stream (``[fail]``) and mid-stream (``[drop]``), tool calls that ask for permission
  (``[tool]``; a poller answers allow, allow for the session, or deny), cancels, summaries;
* 20 websocket and 10 SSE watchers that come (new client ids, or a resume with ``since`` /
  ``Last-Event-ID``), go, stall (stop reading for a while, which fills their queues and gets some
  disconnected as too slow) and resume.

RSS and open descriptors are sampled every ``interval``; ``tracemalloc`` is started half-way to
the baseline (minute 10 of a 60-minute run, a sixth of a shorter one), a snapshot is taken at the
baseline and at the end, and the top growth sites between them are printed (``file:line``, the
growth and the allocations' count, and the frames that called it).
Sizes: ``--soak-minutes`` (default 60), tiny in ``--smoke``.
"""

from __future__ import annotations

import collections
import math
import os
import random
import time
import tracemalloc
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import httpx
import orjson
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from tests.fake_llm import FakeLLM, Fault, RecordedRequest, Reply, ToolCall

from .. import charts
from ..procs import TOKEN, memory, server_process
from ..report import MB, Table, Target, WorkloadResult
from .common import Ctx, fake_config

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

#: RSS growth from the baseline to the end that still counts as a plateau (fraction).
W6_GROWTH_TARGET: Final = 0.10
#: Length of a full soak (seconds).
FULL_SOAK: Final = 3600.0
#: Growth sites printed.
TOP_SITES: Final = 15
#: Bound on one HTTP request of the load (seconds).
REQUEST_TIMEOUT: Final = 30.0
#: Markers in a prompt that choose the fake model's reply.
FAIL, DROP, TOOL = "[fail]", "[drop]", "[tool]"


@dataclass
class SoakPlan:
    """The soak's sizes (see :func:`plan`)."""

    seconds: float
    workspaces: int = 3
    sessions: int = 20
    ws_watchers: int = 20
    sse_watchers: int = 10
    prompters: int = 6
    #: Pause between two prompts of one prompter (seconds, at most).
    think: float = 1.0
    #: Longest stall of a watcher (seconds).
    stall_max: float = 15.0
    #: Longest stay of a watcher (seconds).
    stay_max: float = 30.0
    tokens: int = 60
    token_delay: float = 0.005
    interval: float = 10.0
    #: Server options of the soak (the defaults, or smaller replay buffers for a shortened run).
    server: dict[str, Any] | None = None

    @property
    def baseline_at(self) -> float:
        """When the baseline snapshot is taken: minute 10 of an hour, scaled."""
        return self.seconds / 6


def plan(seconds: float, smoke: bool) -> SoakPlan:
    if smoke:
        return SoakPlan(
            server={"replay_buffer": 256},
            seconds=seconds,
            sessions=4,
            ws_watchers=3,
            sse_watchers=2,
            prompters=2,
            think=0.3,
            stall_max=1.0,
            stay_max=2.0,
            tokens=10,
            interval=1.0,
        )
    p = SoakPlan(seconds=seconds, interval=max(2.0, min(30.0, seconds / 120)))
    if seconds < FULL_SOAK:
        # A shortened run cannot wait an hour for the replay buffers (4096 events each) to fill
        # at this load: a quarter of them fills before its baseline.
        p.server = {"replay_buffer": 1024, "replay_bytes": 2 * MB}
    return p


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def fake_reply(p: SoakPlan) -> Any:
    """The fake model's reply to each request, chosen by the marker in the last user message."""
    rng = random.Random(6)

    def reply(request: RecordedRequest) -> Reply:
        messages = (request.body or {}).get("messages") or [{}]
        last = messages[-1]
        tokens = [f"s{i} " for i in range(rng.randint(p.tokens // 2, p.tokens * 2))]
        if last.get("role") == "tool":
            return Reply(text="done with the tool ", token_delay=p.token_delay)
        text = _text(last)
        if FAIL in text:
            return Reply(status=500, error="soak: injected failure")
        if DROP in text:
            return Reply(
                text=tokens,
                token_delay=p.token_delay,
                fault=Fault.DROP,
                fault_after=len(tokens) // 2,
            )
        if TOOL in text:
            args = {"path": f"soak/{uuid.uuid4().hex[:8]}.txt", "content": "soak\n"}
            return Reply(tool_calls=[ToolCall("write", orjson.dumps(args).decode())])
        return Reply(text=tokens, token_delay=p.token_delay)

    return reply


class Load:
    """The soak's clients and what they counted."""

    def __init__(self, p: SoakPlan, url: str, projects: list[Path]) -> None:
        self.p = p
        self.url = url
        self.projects = projects
        self.counts: collections.Counter[str] = collections.Counter()
        self.wids: list[str] = []
        #: The client that holds each workspace open (client ids are UUIDs).
        self.holders = [str(uuid.uuid4()) for _ in projects]
        self.sessions: list[list[str]] = []
        self.http = httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=REQUEST_TIMEOUT
        )

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] += n

    def failed(self, where: str, exc: BaseException) -> None:
        self.count(f"error {where}: {type(exc).__name__}")

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        r = await self.http.request(method, path, **kwargs)
        self.count(f"http {r.status_code // 100}xx")
        return r

    async def open(self, index: int, client_id: str) -> str:
        r = await self.request(
            "POST",
            "/v1/workspaces",
            json={"path": str(self.projects[index]), "client_id": client_id},
        )
        r.raise_for_status()
        return str(r.json()["id"])

    async def new_session(self, wid: str) -> str:
        r = await self.request("POST", f"/v1/workspaces/{wid}/sessions", json={"title": "soak"})
        r.raise_for_status()
        return str(r.json()["id"])

    async def setup(self) -> None:
        per = max(1, self.p.sessions // self.p.workspaces)
        for index in range(self.p.workspaces):
            wid = await self.open(index, self.holders[index])
            self.wids.append(wid)
            self.sessions.append([await self.new_session(wid) for _ in range(per)])

    # -- actors ----------------------------------------------------------------------------------

    async def prompter(self, seed: int) -> None:
        rng = random.Random(seed)
        n = 0
        while True:
            n += 1
            index = rng.randrange(self.p.workspaces)
            wid, sid = self.wids[index], rng.choice(self.sessions[index])
            kind = rng.choices(
                ["plain", "fail", "drop", "tool", "cancel", "summary", "session"],
                [50, 8, 7, 10, 12, 5, 8],
            )[0]
            try:
                if kind == "summary":
                    await self.request(
                        "POST", f"/v1/workspaces/{wid}/agent/sessions/{sid}/summarize"
                    )
                elif kind == "session":  # a new session replaces the oldest one
                    self.sessions[index].append(await self.new_session(wid))
                    old = self.sessions[index].pop(0)
                    await self.request("DELETE", f"/v1/workspaces/{wid}/sessions/{old}")
                else:
                    marker = {"fail": FAIL, "drop": DROP, "tool": TOOL}.get(kind, "")
                    prompt = f"soak prompt {seed}.{n} {marker}"
                    run_id = await self.prompt(wid, sid, prompt, over_ws=rng.random() < 0.3)
                    if kind == "cancel" and run_id:
                        await trio.sleep(rng.uniform(0, 0.2))
                        await self.request("POST", f"/v1/workspaces/{wid}/runs/{run_id}/cancel")
                self.count(f"op {kind}")
            except (httpx.HTTPError, ConnectionClosed, OSError, KeyError) as exc:
                self.failed("prompter", exc)
            await trio.sleep(rng.uniform(0, self.p.think))

    async def prompt(self, wid: str, sid: str, prompt: str, *, over_ws: bool) -> str | None:
        body = {"session_id": sid, "prompt": prompt}
        if not over_ws:
            r = await self.request("POST", f"/v1/workspaces/{wid}/agent", json=body)
            self.count("prompt http")
            return str(r.json().get("run_id")) if r.status_code == 202 else None
        url = self.ws_url(wid, str(uuid.uuid4()))
        with trio.fail_after(REQUEST_TIMEOUT):
            async with open_websocket_url(url, max_message_size=64 * MB) as conn:
                command = {"id": 1, "method": "agent.prompt", "params": body}
                await conn.send_message(orjson.dumps(command).decode())
                while True:
                    frame = orjson.loads(await conn.get_message())
                    if frame.get("type") == "reply" and frame.get("id") == 1:
                        break
        self.count("prompt ws")
        result = frame.get("result") or {}
        return str(result["run_id"]) if isinstance(result, dict) and "run_id" in result else None

    def ws_url(
        self, wid: str, client_id: str, since: int | None = None, deltas: bool = False
    ) -> str:
        url = self.url.replace("http://", "ws://") + f"/v1/workspaces/{wid}/ws"
        url += f"?client_id={client_id}&token={TOKEN}"
        if since is not None:
            url += f"&since={since}"
        return url + ("&deltas=1" if deltas else "")

    async def answer_permissions(self) -> None:
        """Answer every pending permission request (allow, allow for the session, or deny)."""
        rng = random.Random(99)
        while True:
            for wid in list(self.wids):
                try:
                    r = await self.request("GET", f"/v1/workspaces/{wid}/permissions")
                    if r.status_code != 200:
                        continue
                    for pending in r.json():
                        action = rng.choice(["allow", "allow_session", "deny"])
                        grant = {"permission": {"id": pending["id"]}, "action": action}
                        await self.request(
                            "POST", f"/v1/workspaces/{wid}/permissions/grant", json=grant
                        )
                        self.count(f"permission {action}")
                except (httpx.HTTPError, OSError, KeyError, TypeError) as exc:
                    self.failed("permissions", exc)
            await trio.sleep(0.3)

    async def ws_watcher(self, seed: int) -> None:
        rng = random.Random(1000 + seed)
        client_id, since = str(uuid.uuid4()), None
        while True:
            index = rng.randrange(self.p.workspaces)
            if rng.random() < 0.5:  # a new client; else the same one resumes where it was
                client_id, since = str(uuid.uuid4()), None
            url = self.ws_url(self.wids[index], client_id, since, deltas=rng.random() < 0.5)
            try:
                async with open_websocket_url(url, max_message_size=64 * MB) as conn:
                    self.count("ws connect")
                    with trio.move_on_after(rng.uniform(0.5, self.p.stay_max)) as stay:
                        while True:
                            frame = orjson.loads(await conn.get_message())
                            since = frame.get("seq", since)
                            self.count("ws frames")
                            if rng.random() < 0.002:  # stop reading for a while, then resume
                                self.count("ws stall")
                                pause = rng.uniform(self.p.stall_max / 5, self.p.stall_max)
                                stay.deadline += pause
                                await trio.sleep(pause)
            except ConnectionClosed as exc:
                self.count(f"ws closed {exc.reason.code}")
            except (OSError, trio.BrokenResourceError, httpx.HTTPError) as exc:
                self.failed("ws watcher", exc)
            await trio.sleep(rng.uniform(0, 1))

    async def sse_watcher(self, seed: int) -> None:
        rng = random.Random(2000 + seed)
        client_id, last = str(uuid.uuid4()), None
        while True:
            index = rng.randrange(self.p.workspaces)
            if rng.random() < 0.5:
                client_id, last = str(uuid.uuid4()), None
            headers = {"Last-Event-ID": last} if last else {}
            params = {"client_id": client_id}
            if rng.random() < 0.5:
                params["deltas"] = "1"
            try:
                with trio.move_on_after(rng.uniform(0.5, self.p.stay_max)) as stay:
                    async with self.http.stream(
                        "GET",
                        f"/v1/workspaces/{self.wids[index]}/events",
                        params=params,
                        headers=headers,
                        timeout=httpx.Timeout(REQUEST_TIMEOUT, read=None),
                    ) as response:
                        self.count(f"sse {response.status_code}")
                        async with aclosing(response.aiter_lines()) as lines:
                            async for line in lines:
                                if line.startswith("id: "):
                                    last = line[4:]
                                    self.count("sse events")
                                    if rng.random() < 0.002:
                                        self.count("sse stall")
                                        pause = rng.uniform(self.p.stall_max / 5, self.p.stall_max)
                                        stay.deadline += pause
                                        await trio.sleep(pause)
            except (httpx.HTTPError, OSError) as exc:
                self.failed("sse watcher", exc)
            await trio.sleep(rng.uniform(0, 1))

    async def churn(self) -> None:
        """Close the last workspace and open it again, with a new client each cycle."""
        index = self.p.workspaces - 1
        cycle = 0
        while True:
            cycle += 1
            client_id = str(uuid.uuid4())  # a new client each cycle
            try:
                wid = await self.open(index, client_id)
                await self.request(
                    "DELETE", f"/v1/workspaces/{wid}", params={"client_id": self.holders[index]}
                )
                await trio.sleep(random.uniform(0.5, 3))
                await self.request(
                    "DELETE", f"/v1/workspaces/{wid}", params={"client_id": client_id}
                )
                # Until it has closed (its watchers detach first); another process: polled.
                with trio.move_on_after(REQUEST_TIMEOUT):
                    while True:
                        r = await self.request("GET", f"/v1/workspaces/{wid}")
                        if r.status_code != 200:
                            self.count("workspace closed")
                            break
                        await trio.sleep(0.2)
                new = await self.open(index, self.holders[index])
                self.wids[index] = new
                if new != wid:
                    self.sessions[index] = [
                        await self.new_session(new) for _ in self.sessions[index]
                    ]
                self.count("workspace reopen")
            except (httpx.HTTPError, OSError, KeyError) as exc:
                self.failed("churn", exc)
            await trio.sleep(random.uniform(1, 4))


@asynccontextmanager
async def fake_model(p: SoakPlan) -> AsyncIterator[str]:
    fake = FakeLLM(default=fake_reply(p), record=False)
    async with trio.open_nursery() as nursery:
        url = await nursery.start(fake.serve)
        try:
            yield str(url)
        finally:
            nursery.cancel_scope.cancel()


async def _snapshot(directory: Path, name: str, within: float = 120.0) -> tracemalloc.Snapshot:
    (directory / f"{name}.request").touch()
    path = directory / f"{name}.snap"
    with trio.fail_after(within):  # written by the server process: polled
        while True:
            if path.exists():
                break
            await trio.sleep(0.2)
    return await trio.to_thread.run_sync(tracemalloc.Snapshot.load, str(path))


def growth_sites(base: tracemalloc.Snapshot, end: tracemalloc.Snapshot) -> list[dict[str, Any]]:
    """The top growth sites by ``file:line`` (the innermost frame), largest growth first, with
    the outer frames of the biggest allocation path of each."""
    ignore = [
        tracemalloc.Filter(False, tracemalloc.__file__),
        tracemalloc.Filter(False, "<frozen *>"),
    ]
    base, end = base.filter_traces(ignore), end.filter_traces(ignore)
    stacks: dict[tuple[str, int], list[str]] = {}
    for stat in end.compare_to(base, "traceback")[: TOP_SITES * 20]:
        frame = stat.traceback[-1] if stat.traceback else None
        key = (frame.filename, frame.lineno) if frame else ("?", 0)
        stacks.setdefault(key, [f"{_short(f.filename)}:{f.lineno}" for f in stat.traceback])
    sites = []
    for stat in end.compare_to(base, "lineno")[:TOP_SITES]:
        frame = stat.traceback[0]
        sites.append(
            {
                "site": f"{_short(frame.filename)}:{frame.lineno}",
                "growth": stat.size_diff,
                "size": stat.size,
                "count_growth": stat.count_diff,
                "stack": stacks.get((frame.filename, frame.lineno), []),
            }
        )
    return sites


def _short(filename: str) -> str:
    for marker in ("site-packages/", "crush_trio/", "lib/python3"):
        at = filename.find(marker)
        if at >= 0:
            return filename[at:] if marker != "site-packages/" else filename[at + len(marker) :]
    return filename


def _tracing_memory(directory: Path, name: str) -> int:
    """The memory ``tracemalloc`` itself held when snapshot ``name`` was taken (0: unknown)."""
    try:
        return int(orjson.loads((directory / f"{name}.json").read_bytes())["tracemalloc"])
    except (OSError, ValueError, KeyError):
        return 0


def _malloc(directory: Path, name: str) -> dict[str, int]:
    """glibc's heap figures when snapshot ``name`` was taken (:func:`bench.traced_server.
    malloc_stats`; empty: unknown)."""
    try:
        return dict(orjson.loads((directory / f"{name}.json").read_bytes()).get("malloc", {}))
    except (OSError, ValueError):
        return {}


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


async def w6(ctx: Ctx) -> WorkloadResult:
    s = ctx.sizes
    p = plan(s.soak_minutes * 60, s.smoke)
    result = WorkloadResult("W6", "Soak")
    ctx.log(f"[W6] soak for {p.seconds / 60:g} min (baseline snapshot at {p.baseline_at:.0f} s)")
    work = ctx.dir("w6")
    snaps = work / "snapshots"
    soak = await _soak(ctx, p, work, snaps)
    samples, base, end, base_taken = soak.samples, soak.base, soak.end, soak.base_taken
    load, errors = soak.load, soak.errors
    sites = growth_sites(base, end)
    traced = (
        sum(st.size for st in base.statistics("filename")),
        sum(st.size for st in end.statistics("filename")),
    )
    # The first sample after the baseline snapshot: taking it leaves the server's allocator
    # holding more memory, which is not growth of the server's own structures.
    at_base = next((rss for t, rss, _ in samples if t >= base_taken), samples[-1][1])
    final = samples[-1][1]
    growth = (final - at_base) / at_base if at_base else math.nan
    at_half = next(rss for t, rss, _ in samples if t >= p.seconds / 2) if samples else 0
    half_growth = (final - at_half) / at_half if at_half else math.nan
    rss_table = Table(
        f"RSS of the server over {p.seconds / 60:g} min of mixed load (tracemalloc on)",
        ["minute", "RSS (MiB)", "open fds"],
    )
    step = max(1, len(samples) // 12)
    for t, rss, fds in [*samples[::step], samples[-1]]:
        rss_table.add(f"{t / 60:.1f}", f"{rss / MB:.1f}", fds)
    sites_table = Table(
        f"Top growth sites between the baseline ({p.baseline_at / 60:.1f} min) and the end",
        ["site", "growth (KiB)", "held at the end (KiB)", "allocations +/-", "called from"],
    )
    for site in sites:
        sites_table.add(
            site["site"],
            f"{site['growth'] / 1024:+.1f}",
            f"{site['size'] / 1024:.1f}",
            f"{site['count_growth']:+d}",
            " < ".join(reversed(site["stack"][:-1])) or "",
        )
    counts = Table("Load", ["what", "count"])
    for key, value in sorted(load.counts.items()):
        counts.add(key, value)
    result.tables += [rss_table, sites_table, counts]
    result.targets.append(
        Target(
            "RSS growth from the baseline to the end (a plateau)",
            f"{growth:+.1%}",
            f"{W6_GROWTH_TARGET:+.0%}",
            growth <= W6_GROWTH_TARGET,
        )
    )
    result.notes.append(
        f"RSS {at_base / MB:.1f} MiB at the baseline, {at_half / MB:.1f} MiB half-way, "
        f"{final / MB:.1f} MiB at the end (under load, before the last snapshot): "
        f"{half_growth:+.1%} over the second half"
    )
    own = [_tracing_memory(snaps, name) for name in ("base", "end")]
    result.notes.append(
        f"memory of tracemalloc itself (its traces, part of RSS): {own[0] / MB:.1f} MiB at the "
        f"baseline, {own[1] / MB:.1f} MiB at the end"
    )
    heaps = [_malloc(snaps, name) for name in ("base", "end")]
    if all(heaps):
        result.notes.append(
            "malloc (all arenas; includes the traced heap and what Python's allocator and SQLite "
            f"hold): in use {heaps[0]['in_use'] / MB:.1f} -> {heaps[1]['in_use'] / MB:.1f} MiB, "
            f"free inside the arenas {heaps[0]['free'] / MB:.1f} -> {heaps[1]['free'] / MB:.1f} "
            f"MiB, threads {heaps[0]['threads']} -> {heaps[1]['threads']}"
        )
    result.notes.append(
        f"traced Python heap: {traced[0] / MB:.1f} MiB at the baseline, {traced[1] / MB:.1f} MiB "
        f"at the end; server errors in the log: {len(errors)}"
    )
    result.raw = {
        "seconds": p.seconds,
        "baseline_at": p.baseline_at,
        "samples": [{"t": t, "rss": rss, "fds": fds} for t, rss, fds in samples],
        "growth": growth,
        "growth_second_half": half_growth,
        "server": p.server or {},
        "sites": sites,
        "traced": traced,
        "tracemalloc_memory": own,
        "malloc": heaps,
        "counts": dict(load.counts),
        "errors": errors[:20],
    }
    result.chart = lambda path: charts.w6(path, result.raw)
    return result


@dataclass
class Soaked:
    """What the soak left: the server's memory samples ``(seconds, RSS, open fds)``, the
    baseline and end snapshots, when the baseline was taken, the load and the server's errors."""

    samples: list[tuple[float, int, int]]
    base: tracemalloc.Snapshot
    end: tracemalloc.Snapshot
    base_taken: float
    load: Load
    errors: list[str]


async def _soak(ctx: Ctx, p: SoakPlan, work: Path, snaps: Path) -> Soaked:
    """Run the soak of plan ``p``, sampling the server's memory and taking its snapshots."""
    projects = [work / f"project-{i}" for i in range(p.workspaces)]
    for project in projects:
        project.mkdir(parents=True, exist_ok=True)
    samples: list[tuple[float, int, int]] = []
    async with fake_model(p) as fake_url:
        config = fake_config(fake_url, provider={"max_retries": 0}, server=p.server)
        launcher = ("-m", "bench.traced_server", str(snaps))
        async with server_process(config, work, launcher=launcher) as server:
            load = Load(p, server.url, projects)
            started = time.monotonic()
            await load.setup()
            base: tracemalloc.Snapshot | None = None
            tracing = False
            base_taken = p.baseline_at
            async with trio.open_nursery() as nursery:
                for i in range(p.prompters):
                    nursery.start_soon(load.prompter, i)
                for i in range(p.ws_watchers):
                    nursery.start_soon(load.ws_watcher, i)
                for i in range(p.sse_watchers):
                    nursery.start_soon(load.sse_watcher, i)
                nursery.start_soon(load.answer_permissions)
                nursery.start_soon(load.churn)
                while (elapsed := time.monotonic() - started) < p.seconds:
                    rss = memory(server.pid).rss
                    samples.append((elapsed, rss, _fds(server.pid)))
                    ctx.log(
                        f"[W6] {elapsed / 60:5.1f} min  RSS {rss / MB:6.1f} MiB  "
                        f"fds {samples[-1][2]}  runs {load.counts['prompt http'] + load.counts['prompt ws']}"
                    )
                    if not tracing and elapsed >= p.baseline_at / 2:
                        (snaps / "start.request").touch()  # see bench.traced_server
                        tracing = True
                        ctx.log(f"[W6] tracemalloc started at {elapsed:.0f} s")
                    if base is None and elapsed >= p.baseline_at:
                        base = await _snapshot(snaps, "base")
                        base_taken = time.monotonic() - started
                        ctx.log(f"[W6] baseline snapshot at {elapsed:.0f} s")
                    await trio.sleep(min(p.interval, max(0.1, p.seconds - elapsed)))
                # The last sample under load, before the snapshot (taking it costs memory).
                samples.append(
                    (time.monotonic() - started, memory(server.pid).rss, _fds(server.pid))
                )
                nursery.cancel_scope.cancel()
            end = await _snapshot(snaps, "end")
            if base is None:
                base = end
            await load.http.aclose()
        errors = server.error_lines()
    return Soaked(samples, base, end, base_taken, load, errors)
