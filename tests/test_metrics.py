"""Prometheus metrics (docs/operations.md): what a run, a cancel, a failure, a tool call, a
permission, a slow client, a provider and the store move, where the metrics are served (with the
token at ``/metrics``, without it on the loopback metrics port), and the Grafana dashboard's
queries against the families that exist.

The registry is process-wide, so every test compares values before and after what it does.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import pytest
import trio
import trio.testing

from crush_trio.broker import Broker
from crush_trio.cli import build_parser
from crush_trio.client import RunFailed, RunStatus, WorkspaceClient
from crush_trio.errors import ConfigError, ProviderError
from crush_trio.metrics import METRICS, render, sample_names
from crush_trio.providers.scripted import Gate, ScriptedModel, Step
from crush_trio.server.metrics_http import (
    METRICS_MAX_CONNECTIONS,
    METRICS_MAX_HEAD_BYTES,
    METRICS_READ_TIMEOUT,
    metrics_socket,
)
from crush_trio.server.openapi import document
from crush_trio.server.serve import serve
from crush_trio.wire import AgentEvent, EventKind, RunComplete
from tests.fake_llm import FakeLLM, Reply
from tests.test_bounds import _raw_websocket, big
from tests.test_providers import collect, collect_until_error, request, serving, user

from .conftest import TOKEN, WAIT, running_server, serve_options

if TYPE_CHECKING:
    from crush_trio.testing import CrushServer

DASHBOARD = Path(__file__).parent.parent / "docs" / "grafana-dashboard.json"


def value(name: str, **labels: str) -> float:
    """The current value of one sample (0 when the child does not exist yet)."""
    return METRICS.registry.get_sample_value(name, labels) or 0.0


class Snapshot:
    """Sample values at one moment; :meth:`delta` gives how far one moved since."""

    def __init__(self) -> None:
        self._before: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def delta(self, name: str, labels: dict[str, str] | None = None, **more: str) -> float:
        labels = {**(labels or {}), **more}
        key = (name, tuple(sorted(labels.items())))
        return value(name, **labels) - self._before[key]

    def take(self, *samples: tuple[str, dict[str, str]]) -> Snapshot:
        for name, labels in samples:
            self._before[(name, tuple(sorted(labels.items())))] = value(name, **labels)
        return self


def snapshot(*names: str | tuple[str, dict[str, str]]) -> Snapshot:
    return Snapshot().take(*[(n, {}) if isinstance(n, str) else n for n in names])


def parse(text: str) -> dict[str, float]:
    """``name{labels}`` → value, from an exposition."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, number = line.rpartition(" ")
            out[key] = float(number)
    return out


# -- runs ----------------------------------------------------------------------------------------


async def test_a_run_moves_the_run_event_and_store_metrics(
    crush_server: CrushServer, crush_workspace: WorkspaceClient
) -> None:
    ws = crush_workspace
    completed = ("crush_trio_runs_finished_total", {"outcome": "completed", "reason": "ok"})
    published = ("crush_trio_events_published_total", {"type": "run_complete"})
    messages = ("crush_trio_store_batch_size_count", {"kind": "messages"})
    runs = ("crush_trio_store_batch_size_count", {"kind": "runs"})
    snap = snapshot(
        "crush_trio_runs_accepted_total",
        completed,
        "crush_trio_run_duration_seconds_count",
        "crush_trio_time_to_first_token_seconds_count",
        published,
        messages,
        runs,
        "crush_trio_store_write_seconds_count",
    )
    assert value("crush_trio_workspaces_open") >= 1
    sid = (await ws.create_session()).id
    run = await (await ws.prompt(sid, "hello metrics")).result(WAIT)
    assert run.status is RunStatus.COMPLETED
    assert run.text == "hello metrics"
    assert snap.delta("crush_trio_runs_accepted_total") == 1
    assert snap.delta(*completed) == 1
    assert snap.delta("crush_trio_run_duration_seconds_count") == 1
    assert snap.delta("crush_trio_time_to_first_token_seconds_count") == 1
    assert snap.delta(*published) == 1
    assert snap.delta(*messages) >= 1  # the user message and the reply were written
    assert snap.delta(*runs) >= 1  # the run record was committed
    assert snap.delta("crush_trio_store_write_seconds_count") >= 2
    # The same figures at /metrics, with the token.
    async with httpx.AsyncClient(base_url=crush_server.url) as http:
        r = await http.get("/metrics", headers={"Authorization": f"Bearer {crush_server.token}"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    served = parse(r.text)
    assert served["crush_trio_runs_accepted_total"] == value("crush_trio_runs_accepted_total")
    assert not any(key.split("{")[0].endswith("_created") for key in served)


async def test_a_cancelled_run_and_its_dropped_queue_count_as_cancelled(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    gate = Gate()
    scripted_model.add(Step(text="never", gate_before=gate))
    cancelled = ("crush_trio_runs_finished_total", {"outcome": "cancelled", "reason": "cancel"})
    snap = snapshot(
        cancelled,
        "crush_trio_run_duration_seconds_count",
        "crush_trio_time_to_first_token_seconds_count",
    )
    queued_before = value("crush_trio_queued_prompts")
    sid = (await ws.create_session()).id
    first = await ws.prompt(sid, "go", run_id="m-c1")
    with trio.fail_after(WAIT):
        await gate.reached.wait()
    second = await ws.prompt(sid, "and then", run_id="m-c2")  # waits behind the first
    assert value("crush_trio_queued_prompts") == queued_before + 1
    await ws.cancel(sid)
    assert (await first.result(WAIT)).status is RunStatus.CANCELLED
    assert (await second.result(WAIT)).status is RunStatus.CANCELLED
    assert value("crush_trio_queued_prompts") == queued_before
    assert snap.delta(*cancelled) == 2
    assert snap.delta("crush_trio_run_duration_seconds_count") == 2
    assert snap.delta("crush_trio_time_to_first_token_seconds_count") == 0  # nothing streamed


async def test_a_failed_run_counts_by_reason(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    scripted_model.add(Step(text="partial", error=ProviderError("upstream exploded")))
    failed = ("crush_trio_runs_finished_total", {"outcome": "failed", "reason": "provider"})
    snap = snapshot(failed)
    sid = (await ws.create_session()).id
    with pytest.raises(RunFailed, match="upstream exploded"):
        await (await ws.prompt(sid, "go")).result(WAIT)
    assert snap.delta(*failed) == 1


# -- tools and permissions -----------------------------------------------------------------------


async def test_tool_calls_count_by_tool_and_outcome(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    (Path(ws.path) / "here.txt").write_text("present\n")
    scripted_model.add(
        Step(tool_calls=[("view", {"path": "here.txt"}), ("view", {"path": "missing.txt"})]),
        Step(tool_calls=[("write", {"path": "new.txt", "content": "x"})]),
        Step("never reached: the denial ends the turn"),
    )
    ok = ("crush_trio_tool_calls_total", {"tool": "view", "outcome": "ok"})
    error = ("crush_trio_tool_calls_total", {"tool": "view", "outcome": "error"})
    denied = ("crush_trio_tool_calls_total", {"tool": "write", "outcome": "denied"})
    waited = ("crush_trio_permission_wait_seconds_count", {"outcome": "denied"})
    snap = snapshot(ok, error, denied, waited)
    pending_before = value("crush_trio_permissions_pending")
    sid = (await ws.create_session()).id
    with trio.fail_after(WAIT):
        handle = await ws.prompt(sid, "look, then write")
        asked = await handle.next_permission_request(WAIT)
        assert asked is not None
        assert asked.tool_name == "write"
        assert value("crush_trio_permissions_pending") == pending_before + 1
        assert await ws.grant(asked.id, "deny") is True
        run = await handle.result(WAIT)
    assert run.status is RunStatus.COMPLETED
    assert value("crush_trio_permissions_pending") == pending_before
    assert snap.delta(*ok) == 1
    assert snap.delta(*error) == 1
    assert snap.delta(*denied) == 1
    assert snap.delta(*waited) == 1


# -- event streams -------------------------------------------------------------------------------


async def test_drops_gaps_must_deliver_waits_and_kills_count_by_transport(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broker = Broker(client_queue_size=1, must_deliver_timeout=2.0)
    labels = {"transport": "sse"}
    snap = snapshot(
        ("crush_trio_events_dropped_total", labels),
        ("crush_trio_gaps_sent_total", labels),
        ("crush_trio_clients_killed_slow_total", labels),
        ("crush_trio_client_streams", labels),
        "crush_trio_must_deliver_wait_seconds_count",
    )
    slow, _ = broker.subscribe(transport="sse")
    assert snap.delta("crush_trio_client_streams", **labels) == 1
    for n in range(3):
        broker.publish(AgentEvent("info", text=f"event {n}"), EventKind.CREATED)
    assert snap.delta("crush_trio_events_dropped_total", **labels) == 2
    slow.receive.receive_nowait()
    slow.after_receive()  # room: the gap goes out
    assert snap.delta("crush_trio_gaps_sent_total", **labels) == 1
    # The gap fills the queue; nobody reads: the run_complete waits, then the client is killed.
    await broker.publish_must_deliver(RunComplete("s", "r1"), EventKind.CREATED)
    assert slow.killed.is_set()
    assert snap.delta("crush_trio_clients_killed_slow_total", **labels) == 1
    assert snap.delta("crush_trio_must_deliver_wait_seconds_count") == 1
    assert snap.delta("crush_trio_client_streams", **labels) == 0


async def test_a_websocket_killed_as_too_slow_is_counted(tmp_path: Path) -> None:
    config = tmp_path / "crush.json"
    bounds = {"client_queue_bytes": 1024 * 1024, "must_deliver_timeout": 0.5}
    config.write_text(orjson.dumps({"server": bounds}).decode())
    killed = ("crush_trio_clients_killed_slow_total", {"transport": "ws"})
    streams = ("crush_trio_client_streams", {"transport": "ws"})
    snap = snapshot(killed, streams)
    async with running_server(tmp_path, config_file=config) as server:
        wid = (await server.open_workspace())["id"]
        ws = server.backend.get(wid)
        client = str(uuid.uuid4())
        sock = await _raw_websocket(server.url, wid, client, server.token)
        (stream,) = [c for c in ws.broker.clients if c.client_id == client]
        assert snap.delta(*streams) == 1

        async def keep_full() -> None:
            n = 0
            while True:
                if stream.full_since is None:
                    ws.broker.publish(big(n, 64 * 1024))
                    n += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_full)
            with trio.fail_after(WAIT):
                await stream.killed.wait()
            nursery.cancel_scope.cancel()
        sock.close()
        assert stream.kill_reason == "too slow"
        assert snap.delta(*killed) == 1
    assert snap.delta(*streams) == 0


# -- providers -----------------------------------------------------------------------------------


async def test_provider_requests_retries_errors_and_latency(
    autojump_clock: trio.testing.MockClock,
) -> None:
    p = {"provider": "local"}
    snap = snapshot(
        ("crush_trio_provider_requests_total", p),
        ("crush_trio_provider_retries_total", p),
        ("crush_trio_provider_errors_total", {**p, "kind": "rate_limited"}),
        ("crush_trio_provider_errors_total", {**p, "kind": "auth"}),
        ("crush_trio_provider_latency_seconds_count", p),
    )
    fake = FakeLLM([Reply(status=429, retry_after=1, error="slow down"), Reply(text="finally")])
    with trio.fail_after(100):
        async with serving(fake, jitter=0.0) as provider:
            await collect(provider, request(user("hi")))
    assert snap.delta("crush_trio_provider_requests_total", **p) == 2
    assert snap.delta("crush_trio_provider_retries_total", **p) == 1
    assert snap.delta("crush_trio_provider_errors_total", **p, kind="rate_limited") == 1
    assert snap.delta("crush_trio_provider_latency_seconds_count", **p) == 2
    fake = FakeLLM([Reply(status=401, error="bad key")])
    with trio.fail_after(100):
        async with serving(fake) as provider:
            await collect_until_error(provider, request(user("hi")))
    assert snap.delta("crush_trio_provider_errors_total", **p, kind="auth") == 1


# -- where they are served -----------------------------------------------------------------------


async def test_metrics_need_the_token_and_the_loopback_port_serves_them_without(
    tmp_path: Path,
) -> None:
    async with running_server(tmp_path, metrics_port=0) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=WAIT) as anon:
            r = await anon.get("/metrics")
            assert r.status_code == 401
            assert "token" in r.json()["message"]
            r = await anon.get("/metrics", params={"token": TOKEN})
            assert r.status_code == 200
            assert "crush_trio_runs_accepted_total" in r.text
        url = server.handle.metrics_url
        assert url is not None
        assert url.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient(timeout=WAIT) as scraper:
            before = parse((await scraper.get(url)).text)
            # A run of the built-in echo model, followed on the event websocket.
            wid = (await server.open_workspace())["id"]
            sid = (await server.create_session(wid))["id"]
            async with server.websocket(wid) as events:
                await server.prompt(wid, sid, "echo me", run_id="m-echo")
                with trio.fail_after(WAIT):
                    complete, _ = await events.run_complete("m-echo")
                r = await scraper.get(url)
            assert complete["text"] == "echo me"
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
            after = parse(r.text)
            accepted = "crush_trio_runs_accepted_total"
            done = 'crush_trio_runs_finished_total{outcome="completed",reason="ok"}'
            assert after[accepted] - before[accepted] == 1
            assert after[done] - before.get(done, 0) == 1
            assert after['crush_trio_client_streams{transport="ws"}'] >= 1
            # A page whose DNS name was re-bound to 127.0.0.1 is refused.
            r = await scraper.get(url, headers={"Host": "attacker.example"})
            assert r.status_code == 421
            r = await scraper.get(url.replace("/metrics", "/v1/workspaces"))
            assert r.status_code == 404
            r = await scraper.post(url)
            assert r.status_code == 405
            assert r.headers["allow"] == "GET, HEAD"
        # A malformed request gets an answer, and the port keeps serving.
        host, port = url.removeprefix("http://").split("/")[0].split(":")
        with trio.fail_after(WAIT):
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                await stream.send_all(b"NOT HTTP\r\n\r\n")
                answer = b""
                while chunk := await stream.receive_some(4096):
                    answer += chunk
        assert answer.startswith(b"HTTP/1.1 400")
        async with httpx.AsyncClient(timeout=WAIT) as scraper:
            assert (await scraper.get(url)).status_code == 200


async def _exchange(host: str, port: int, data: bytes, *, reset: bool = False) -> bytes:
    """Send ``data`` on a new connection, then half-close it (or reset it), and read the answer."""
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(data)
        if reset:
            stream.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return b""
        await stream.send_eof()
        answer = b""
        while chunk := await stream.receive_some(4096):
            answer += chunk
        return answer


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"GET /metrics HTTP/1.1\r\nX-Fill: " + b"a" * (METRICS_MAX_HEAD_BYTES + 1), b"431"),
        (b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\xff\xfe\r\n\r\n", b"4"),
        (b"GET /metrics HTTP/1.1\r\nHost: \x00\r\n\r\n", b"4"),
        (b"GET /metr", b""),  # truncated, then closed
        (b"\xff" * 1000 + b"\r\n\r\n", b"400"),
        (
            b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 99\r\n\r\nab",
            b"200",
        ),  # body unread
    ],
    ids=["oversized-head", "non-ascii-host", "nul-host", "truncated", "binary", "short-body"],
)
async def test_the_metrics_port_survives_hostile_bytes(
    tmp_path: Path, data: bytes, status: bytes
) -> None:
    """Each hostile request gets a 4xx (or the connection just ends; a GET's body is never
    read), a reset at any point ends
    only its connection, and the port keeps serving scrapes."""
    async with running_server(tmp_path, metrics_port=0) as server:
        url = server.handle.metrics_url
        assert url is not None
        host, port = url.removeprefix("http://").split("/")[0].split(":")
        with trio.fail_after(WAIT):
            answer = await _exchange(host, int(port), data)
            if status:
                assert answer.startswith(b"HTTP/1.1 " + status), answer[:80]
            else:
                assert not answer.startswith(b"HTTP/1.1 200"), answer[:80]
            for cut in (1, len(data) // 2, len(data)):
                await _exchange(host, int(port), data[:cut], reset=True)
            async with httpx.AsyncClient(timeout=WAIT) as scraper:
                assert (await scraper.get(url)).status_code == 200


async def test_the_metrics_port_comes_from_the_config_key(tmp_path: Path) -> None:
    config = tmp_path / "crush.json"
    config.write_text(orjson.dumps({"server": {"metrics_port": 0}}).decode())
    async with running_server(tmp_path, config_file=config) as server:
        assert server.handle.metrics_url is not None
    async with running_server(tmp_path) as server:
        assert server.handle.metrics_url is None  # off by default


async def test_a_bad_metrics_port_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"server\.metrics_port .* 0 to 65535, got 70000"):
        metrics_socket(70000)
    taken = metrics_socket(0)
    try:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"metrics_port .*{port}: cannot listen"):
            with trio.fail_after(WAIT):
                await serve(serve_options(tmp_path, metrics_port=port))
    finally:
        taken.close()


def test_the_serve_flag_sets_the_metrics_port() -> None:
    args = build_parser().parse_args(["serve", "--metrics-port", "9464"])
    assert args.metrics_port == 9464
    assert build_parser().parse_args(["serve"]).metrics_port is None


def test_the_openapi_document_lists_metrics_as_text() -> None:
    operation = document()["paths"]["/metrics"]["get"]
    assert "text/plain" in operation["responses"]["200"]["content"]


# -- the dashboard -------------------------------------------------------------------------------


def _expressions(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for v in node.values() for e in _expressions(v)]
    if isinstance(node, list):
        return [e for v in node for e in _expressions(v)]
    return []


def test_every_metric_the_dashboard_queries_exists() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = dashboard["templating"]["list"]
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in variables)
    expressions = _expressions(dashboard["panels"])
    assert len(expressions) >= 10
    known = set(sample_names(render().decode()))
    assert "process_cpu_seconds_total" in known
    used = {
        name for expr in expressions for name in re.findall(r"(?:crush_trio|process)_\w+", expr)
    }
    assert used - known == set()
    # Every family is on the dashboard (the webhook ones included).
    families = {
        re.sub(r"_(bucket|sum|count)$", "", name) for name in known if "_bucket" in name
    } | {name for name in known if not re.search(r"_(bucket|sum|count)$", name)}
    shown = {re.sub(r"_(bucket|sum|count)$", "", name) for name in used}
    assert {f for f in families if f.startswith("crush_trio_")} - shown == set()
    for panel in dashboard["panels"]:
        if panel.get("type") != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


async def test_idle_connections_do_not_keep_scrapes_off_the_metrics_port(tmp_path: Path) -> None:
    """Each connection's read is bounded (METRICS_READ_TIMEOUT), so METRICS_MAX_CONNECTIONS
    silent ones used to hold every slot for that long; a new connection now closes the oldest
    one that has not sent its request."""
    async with running_server(tmp_path, metrics_port=0) as server:
        url = server.handle.metrics_url
        assert url is not None
        host, port = url.removeprefix("http://").split("/")[0].split(":")
        idle = []
        try:
            with trio.fail_after(WAIT):
                for _ in range(2 * METRICS_MAX_CONNECTIONS):
                    idle.append(await trio.open_tcp_stream(host, int(port)))
            # Well inside the read bound of the idle ones: the scrape is not kept waiting.
            with trio.fail_after(METRICS_READ_TIMEOUT / 2):
                async with httpx.AsyncClient(timeout=WAIT) as scraper:
                    for _ in range(3):
                        assert (await scraper.get(url)).status_code == 200
            # The oldest idle connections were closed to make room.
            with trio.fail_after(WAIT):
                assert await idle[0].receive_some(1) == b""
        finally:
            for stream in idle:
                await stream.aclose()
