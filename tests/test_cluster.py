"""Three real nodes on loopback, sharing a throw-away PostgreSQL and Redis (tests/services.py).

Each node is a ``crush-trio serve`` subprocess; the tests wait on what the nodes print (the
listening line), on the client library's run handles and reconnects, and on close frames, never
on the clock. What they check is in docs/cluster.md ("What fail-over guarantees").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs
import httpx
import orjson
import pytest
import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, open_websocket_url

from crush_trio.client import connect
from crush_trio.cluster.redislog import stream_key
from tests.fake_llm import FakeLLM, Reply, ToolCall
from tests.services import PostgresServer, RedisServer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

TOKEN: Final = "cluster-token"
#: The nodes' lease TTL (seconds): short, so that fail-over tests finish quickly.
LEASE_TTL: Final = 2.0
#: What the issue allows beyond the lease TTL for another node to take a dead owner's workspace.
TAKEOVER_SLACK: Final = 3.0
#: Bound on a node's start (imports, database schema, Redis) (seconds).
NODE_START: Final = 60.0
#: Bound on every other wait of these tests (seconds).
WAIT: Final = 30.0
#: A prompt the slow echo model streams for about ten seconds (one word every 50 ms).
LONG_PROMPT: Final = " ".join(f"w{i}" for i in range(200))

ROOT: Final = Path(__file__).resolve().parent.parent


@attrs.define
class Node:
    name: str
    process: trio.Process
    url: str = ""
    stderr: Path | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.stderr.read_text(errors="replace") if self.stderr else ""


@attrs.define
class Cluster:
    nodes: list[Node]
    dsn: str
    postgres: PostgresServer
    redis: RedisServer
    project: Path
    tmp: Path
    nursery: trio.Nursery
    #: A model that calls tools (provider ``tools``, ``tools/fake``); every node is configured
    #: with it beside the echo model.
    llm: FakeLLM

    def sql(self, query: str) -> list[list[str]]:
        dbname = self.dsn.rsplit("/", 1)[1]
        out = self.postgres.psql(query, dbname)
        return [line.split("|") for line in out.splitlines() if line]

    def log_events(self, workspace_id: str) -> list[dict[str, Any]]:
        """Every event in the workspace's Redis stream, decoded, in order."""
        raw = subprocess.run(
            ["redis-cli", "-p", str(self.redis.port), "--json", "XRANGE",
             stream_key(workspace_id), "-", "+"],
            check=True, capture_output=True, timeout=WAIT, text=True,
        ).stdout  # fmt: skip
        entries = json.loads(raw) if raw.strip() else []
        events = []
        for _id, fields in entries:
            values = dict(zip(fields[::2], fields[1::2], strict=True))
            (data,) = values.values()
            # A record is the envelope, then for a delta the snapshot form on a second line.
            events.append(orjson.loads(data.partition("\n")[0]))
        return events

    async def wait_for_event(
        self, workspace_id: str, event_type: str, run_id: str
    ) -> dict[str, Any]:
        """The log's event of ``event_type`` for run ``run_id``, once it is there (blocking
        reads of the Redis stream: the server's own signal, no polling)."""
        key = stream_key(workspace_id)
        last = "0-0"
        with trio.fail_after(WAIT), _show_log_on_failure(self, workspace_id):
            while True:
                command = [
                    "redis-cli", "-p", str(self.redis.port), "--json", "XREAD", "BLOCK",
                    str(int(WAIT * 1000)), "STREAMS", key, last,
                ]  # fmt: skip
                run = partial(
                    subprocess.run, command, check=True, capture_output=True, text=True,
                    timeout=WAIT + 5,
                )  # fmt: skip
                raw = (await trio.to_thread.run_sync(run, abandon_on_cancel=True)).stdout
                reply = json.loads(raw) if raw.strip() else None
                if not reply:
                    continue
                entries = reply[key] if isinstance(reply, dict) else reply[0][1]
                for entry_id, fields in entries:
                    last = entry_id
                    event = orjson.loads(fields[1].partition("\n")[0])  # the envelope line
                    if event["type"] == event_type and body(event).get("run_id") == run_id:
                        return body(event)


@contextlib.contextmanager
def _show_log_on_failure(cluster: Cluster, workspace_id: str) -> Iterator[None]:
    try:
        yield
    except BaseException:
        print("log:", [(e["seq"], e["type"]) for e in cluster.log_events(workspace_id)])
        raise


async def start_node(cluster: Cluster, name: str, **env_vars: str) -> Node:
    """Start one node and wait for its listening line."""
    stderr = cluster.tmp / f"{name}.log"
    args = [
        sys.executable, "-m", "crush_trio", "serve", "--host", "127.0.0.1", "--port", "0",
        "--token", TOKEN, "--config", str(cluster.tmp / "crush.json"),
        "--data-dir", str(cluster.tmp / f"data-{name}"), "--no-access-log",
        "--cluster-database-url", cluster.dsn, "--cluster-redis-url", cluster.redis.url,
        "--cluster-node-id", name, "--cluster-lease-ttl", str(LEASE_TTL),
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "XDG_CONFIG_HOME": str(cluster.tmp / "xdg"),
        **env_vars,
    }
    with stderr.open("wb") as err:
        process = await trio.lowlevel.open_process(
            args, stdout=subprocess.PIPE, stderr=err, env=env
        )
    node = Node(name, process, stderr=stderr)
    assert process.stdout is not None
    buffer = b""
    with trio.fail_after(NODE_START):
        while b"crush-trio listening on" not in buffer:
            chunk = await process.stdout.receive_some()
            if not chunk:
                pytest.fail(f"node {name} exited before it listened:\n{node.log()}")
            buffer += chunk
    line = buffer.decode().split("crush-trio listening on ", 1)[1].split()[0]
    node.url = line.split("/?", 1)[0]

    async def drain() -> None:
        assert process.stdout is not None
        while await process.stdout.receive_some():
            pass

    cluster.nursery.start_soon(drain)
    return node


@pytest.fixture
async def cluster(
    tmp_path: Path, pg_dsn: str, postgres_server: PostgresServer, redis_server: RedisServer
) -> AsyncIterator[Cluster]:
    redis_server.command("FLUSHALL")
    project = tmp_path / "project"
    project.mkdir()
    llm = FakeLLM(default=Reply("done"), record=False)
    async with trio.open_nursery() as nursery:
        llm_url = await nursery.start(llm.serve)
        config = {
            "providers": {
                "slow": {"type": "echo", "delay_ms": 50, "models": [{"id": "echo"}]},
                "tools": {
                    "type": "openai-compat",
                    "base_url": f"{llm_url}/v1",
                    "api_key": "x",
                    "models": [{"id": "fake"}],
                },
            },
            "models": {"large": {"provider": "slow", "model": "echo"}},
            "permissions": {"allowed_tools": ["bash"]},
        }
        (tmp_path / "crush.json").write_text(json.dumps(config))
        c = Cluster([], pg_dsn, postgres_server, redis_server, project, tmp_path, nursery, llm)
        try:
            async with trio.open_nursery() as starting:
                for name in ("node-a", "node-b", "node-c"):
                    starting.start_soon(_append_node, c, name)
            c.nodes.sort(key=lambda n: n.name)
            yield c
        finally:
            for node in c.nodes:
                if node.process.returncode is None:
                    node.process.send_signal(signal.SIGCONT)
                    node.process.kill()
            with trio.move_on_after(WAIT, shield=True):
                for node in c.nodes:
                    await node.process.wait()
            for node in c.nodes:  # shown by pytest when the test failed
                print(f"---- {node.name} ----\n{node.log()[-6000:]}")
            nursery.cancel_scope.cancel()


async def _append_node(cluster: Cluster, name: str) -> None:
    cluster.nodes.append(await start_node(cluster, name))


async def hold_on(node: Node, project: Path) -> str:
    """Open the project's workspace on ``node`` (which then owns it) for a client that keeps no
    stream; returns the workspace id."""
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        response = await http.post(
            node.url + "/v1/workspaces",
            json={"path": str(project), "client_id": str(uuid.uuid4())},
            timeout=WAIT,
        )
    assert response.status_code == 200, response.text
    wid: str = response.json()["id"]
    return wid


def body(event: dict[str, Any]) -> dict[str, Any]:
    """An event's object (the envelope's ``payload`` holds the change kind and the object)."""
    inner: dict[str, Any] = event["payload"]["payload"]
    return inner


def run_completes(events: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for event in events:
        if event["type"] == "run_complete":
            run_id = body(event)["run_id"]
            counts[run_id] = counts.get(run_id, 0) + 1
    return counts


async def test_a_killed_owner_is_replaced_and_every_run_ends_once(cluster: Cluster) -> None:
    a, _b, c = cluster.nodes
    wid = await hold_on(a, cluster.project)
    async with (
        connect(c.url, TOKEN, reconnect_timeout=WAIT) as client,
        client.workspace(cluster.project) as ws,
    ):
        assert ws.id == wid
        assert client.owners[wid] == a.url  # node C redirected the client to the owner
        first = await ws.create_session()
        second = await ws.create_session()
        # One streaming run and two queued behind it in one session, one more in the other.
        handles = [await ws.prompt(first.id, LONG_PROMPT) for _ in range(3)]
        handles.append(await ws.prompt(second.id, LONG_PROMPT))
        assert [str(h.accepted.status) for h in handles if h.accepted] == [
            "running", "queued", "queued", "running",
        ]  # fmt: skip
        with trio.fail_after(WAIT):
            async for _ in handles[0].events():
                break  # the run is streaming
        seen = ws.stats.last_seq
        a.process.kill()
        killed_at = trio.current_time()
        # The server's side: another node ends every run in the log.
        for handle in handles:
            await cluster.wait_for_event(wid, "run_complete", handle.run_id)
        ended = trio.current_time() - killed_at
        # The client's side: its stream follows the workspace and every handle ends.
        for handle in handles:
            await handle.wait(timeout=WAIT)
        runs = [await ws.get_run(h.run_id) for h in handles]
        assert ws.stats.gaps == 0
        assert ws.stats.last_seq > seen
    assert ended <= LEASE_TTL + TAKEOVER_SLACK, f"fail-over took {ended:.1f} s"
    assert {r.status.value for r in runs} == {"failed"}
    counts = run_completes(cluster.log_events(wid))
    assert counts == {h.run_id: 1 for h in handles}
    owner = cluster.sql(
        f"SELECT owner_node, epoch FROM cluster_workspaces WHERE workspace_id = '{wid}'"
    )
    assert owner[0][0] != "node-a"
    assert int(owner[0][1]) > 1
    terminals = cluster.sql(f"SELECT run_id FROM run_terminals WHERE workspace_id = '{wid}'")
    assert sorted(r[0] for r in terminals) == sorted(h.run_id for h in handles)


async def test_a_crash_between_the_terminal_commit_and_the_log_append(cluster: Cluster) -> None:
    """The owner dies right after committing a finished run's terminal record: the node that
    takes over appends that run_complete (the run's real outcome) exactly once."""
    d = await start_node(cluster, "node-d", CRUSH_TRIO_DEBUG_FAULT="die-after-terminal-record")
    cluster.nodes.append(d)
    wid = await hold_on(d, cluster.project)
    async with (
        connect(cluster.nodes[2].url, TOKEN, reconnect_timeout=WAIT) as client,
        client.workspace(cluster.project, events=False) as ws,
    ):
        session = await ws.create_session()
        handle = await ws.prompt(session.id, "short reply")
        complete = await cluster.wait_for_event(wid, "run_complete", handle.run_id)
        assert complete["error"] is None
        assert complete["text"] == "short reply"
        run = await ws.get_run(handle.run_id)
    with trio.fail_after(WAIT):
        assert await d.process.wait() == -signal.SIGKILL
    assert str(run.status) == "completed"
    assert run_completes(cluster.log_events(wid)) == {handle.run_id: 1}
    logged = cluster.sql(f"SELECT logged FROM run_terminals WHERE workspace_id = '{wid}'")
    assert logged == [["t"]]


async def test_a_client_resumes_on_the_new_owner_with_no_gap(cluster: Cluster) -> None:
    a, b, c = cluster.nodes
    wid = await hold_on(a, cluster.project)
    async with (
        connect(c.url, TOKEN, reconnect_timeout=WAIT) as client,
        client.workspace(cluster.project) as ws,
    ):
        session = await ws.create_session()
        handle = await ws.prompt(session.id, LONG_PROMPT)
        with trio.fail_after(WAIT):
            async for _ in handle.events():
                break
        since = ws.stats.last_seq
        a.process.kill()
        await handle.wait(timeout=WAIT)
    # A fresh raw stream at node B, from S: it is sent on to the owner and replays S+1... in
    # order, with no gap frame. (In delta mode, as the client library reads: a snapshot-mode
    # resume gets a gap by design for a delta published while no snapshot-mode client was
    # connected, docs/protocol.md §6.6, such as the reply's first words on node A.)
    frames = await read_stream(b.url, wid, since, until_type="run_complete")
    seqs = [f["seq"] for f in frames]
    assert seqs == list(range(since + 1, since + 1 + len(seqs)))
    assert "gap" not in {f["type"] for f in frames}


async def test_a_run_is_reverted_on_the_new_owner_after_fail_over(cluster: Cluster) -> None:
    """The run's change record lives in the project's data directory (shared), its run record in
    PostgreSQL: the node that takes over a killed owner's workspace reverts the run. The run
    changes the files with a tool call (a run's record starts at its first tool call that may
    write)."""
    a, _b, c = cluster.nodes
    wid = await hold_on(a, cluster.project)
    target = cluster.project / "notes.txt"
    target.write_text("before the run\n")
    command = "printf 'changed by the run\\n' > notes.txt && echo new > made.txt"
    cluster.llm.push(
        Reply(tool_calls=[ToolCall("bash", json.dumps({"command": command}))]),
        Reply("done"),
    )
    async with (
        connect(c.url, TOKEN, reconnect_timeout=WAIT) as client,
        client.workspace(cluster.project) as ws,
    ):
        session = await ws.create_session()
        handle = await ws.prompt(session.id, "change the notes", model="tools/fake")
        await handle.wait(timeout=WAIT)
        assert target.read_text() == "changed by the run\n"
        diff = await ws.run_diff(handle.run_id)
        assert sorted(f.path for f in diff.files) == ["made.txt", "notes.txt"]
        # A run in flight when the owner dies: its run_complete in the log says another node
        # took the workspace over.
        other = await ws.create_session()
        pending = await ws.prompt(other.id, LONG_PROMPT)
        a.process.kill()
        await cluster.wait_for_event(wid, "run_complete", pending.run_id)
        with trio.fail_after(WAIT):
            result = await ws.revert_run(handle.run_id)
        assert client.owners.get(wid) != a.url  # answered by the new owner
    assert result.state == "done"
    assert target.read_text() == "before the run\n"
    assert not (cluster.project / "made.txt").exists()
    assert (cluster.project / ".crush" / ".gitignore").read_text() == "*\n"


async def read_stream(
    url: str, wid: str, since: int, *, until_type: str, hops: int = 5
) -> list[dict[str, Any]]:
    """The frames after ``hello`` of a raw event stream in delta mode from ``since`` up to the
    first of type ``until_type``, following 307s to the owner."""
    base = url.replace("http://", "ws://")
    resource = (
        f"/v1/workspaces/{wid}/ws?client_id={uuid.uuid4()}&since={since}&token={TOKEN}&deltas=1"
    )
    with trio.fail_after(WAIT):
        while True:
            try:
                async with open_websocket_url(base + resource) as conn:
                    hello = orjson.loads(await conn.get_message())
                    assert hello["type"] == "hello"
                    frames = []
                    while True:
                        frame = orjson.loads(await conn.get_message())
                        frames.append(frame)
                        if frame["type"] == until_type:
                            return frames
            except ConnectionRejected as exc:
                headers = {k.decode().lower(): v.decode() for k, v in exc.headers or ()}
                if exc.status_code == 307 and hops:
                    hops -= 1
                    base = headers["location"].split("/v1/", 1)[0].replace("http://", "ws://")
                    continue
                raise


async def test_a_paused_owner_is_fenced_and_closes_its_streams(cluster: Cluster) -> None:
    a, b, _c = cluster.nodes
    wid = await hold_on(a, cluster.project)
    direct = a.url.replace("http://", "ws://") + (
        f"/v1/workspaces/{wid}/ws?client_id={uuid.uuid4()}&token={TOKEN}"
    )
    async with (
        connect(a.url, TOKEN) as at_a,
        at_a.workspace(cluster.project, events=False) as ws_a,
        open_websocket_url(direct) as old_stream,
    ):
        session = await ws_a.create_session()
        accepted = await ws_a.prompt(session.id, LONG_PROMPT)
        with trio.fail_after(WAIT):
            while True:  # until the reply streams
                frame = orjson.loads(await old_stream.get_message())
                if frame["type"] == "message" and body(frame).get("role") == "assistant":
                    break
        a.process.send_signal(signal.SIGSTOP)
        # B or C takes the workspace once the lease expired and ends the run: its run_complete
        # lands in the log.
        complete = await cluster.wait_for_event(wid, "run_complete", accepted.run_id)
        assert complete["error"]
        async with (
            connect(b.url, TOKEN) as at_b,
            at_b.workspace(cluster.project, events=False) as ws_b,
        ):
            messages_before = await ws_b.messages(session.id)
            log_before = cluster.log_events(wid)
            a.process.send_signal(signal.SIGCONT)
            # The woken owner finds its lease gone and closes its streams.
            with trio.fail_after(WAIT):
                try:
                    while True:
                        await old_stream.get_message()
                except ConnectionClosed as exc:
                    # The close is awaited in a loop, which pytest.raises cannot hold.
                    assert exc.reason.code in (1001, 1012)  # noqa: PT017
            # Nothing it wrote after waking landed: the database and the log are as the new
            # owner left them.
            assert await ws_b.messages(session.id) == messages_before
            assert cluster.log_events(wid) == log_before
            run = await ws_b.get_run(accepted.run_id)
            assert str(run.status) == "failed"
    # The stop is told in a line or two, not as a crash.
    assert "lease lost" in a.log()
    assert "Traceback" not in a.log()
    assert "crashed" not in a.log()


async def test_sigterm_hands_the_workspace_over_in_about_a_second(cluster: Cluster) -> None:
    a, _b, c = cluster.nodes
    wid = await hold_on(a, cluster.project)
    async with (
        connect(c.url, TOKEN, reconnect_timeout=WAIT) as client,
        client.workspace(cluster.project) as ws,
    ):
        assert client.owners[wid] == a.url
        session = await ws.create_session()
        reconnects = ws.stats.reconnects
        a.process.send_signal(signal.SIGTERM)
        stopped_at = trio.current_time()
        await ws.wait_reconnected(reconnects, timeout=WAIT)
        took = trio.current_time() - stopped_at
        run = await ws.run(session.id, "hello there", timeout=WAIT)
        assert run.status.value == "completed"
        assert client.owners.get(wid) != a.url
    with trio.fail_after(WAIT):
        assert await a.process.wait() == 0
    print(f"hand-over took {took:.2f} s")
    assert took < LEASE_TTL, f"hand-over took {took:.2f} s"


async def test_crush_trio_run_follows_the_redirect_to_the_owner(cluster: Cluster) -> None:
    a, _b, c = cluster.nodes
    await hold_on(a, cluster.project)
    result = await trio.run_process(
        [sys.executable, "-m", "crush_trio", "run", "--server", c.url, "--token", TOKEN,
         "--workspace", str(cluster.project), "--quiet", "--timeout", str(WAIT), "hi", "there"],
        capture_stdout=True, capture_stderr=True, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().strip() == "hi there"


async def test_two_nodes_opening_one_path_at_once_get_one_owner(cluster: Cluster) -> None:
    a, b, _c = cluster.nodes
    ids: list[str] = []

    async def open_on(node: Node) -> None:
        async with connect(node.url, TOKEN) as client:
            data = await client.request(
                "POST",
                "/v1/workspaces",
                json={"path": str(cluster.project), "client_id": client.client_id},
            )
            ids.append(data["id"])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(open_on, a)
        nursery.start_soon(open_on, b)
    assert len(set(ids)) == 1
    listed = []
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for node in cluster.nodes:
            response = await http.get(node.url + "/v1/workspaces", timeout=WAIT)
            listed += [node.name for w in response.json() if w["id"] == ids[0]]
    assert len(listed) == 1
    rows = cluster.sql("SELECT workspace_id, owner_node FROM cluster_workspaces")
    assert len(rows) == 1
    assert rows[0][1] in ("node-a", "node-b")


# -- configuration (no services needed) ---------------------------------------------------------


def test_the_cluster_section_comes_from_the_users_file_only(tmp_path: Path) -> None:
    from crush_trio.config import load_config_report

    user = tmp_path / "user"
    user.mkdir()
    (user / "crush.json").write_text(
        json.dumps({"cluster": {"database_url": "postgresql:///crush", "lease_ttl": 4}})
    )
    project = tmp_path / "project"
    project.mkdir()
    (project / "crush.json").write_text(
        json.dumps({"cluster": {"database_url": "postgresql://evil/db"}})
    )
    loaded = load_config_report(config_file=None, workspace=project, user_config_dir=user)
    assert loaded.config.cluster.database_url == "postgresql:///crush"
    assert loaded.config.cluster.enabled
    assert loaded.config.cluster.renew_every == pytest.approx(4 / 3)
    assert any("cluster" in w and "only the user's own" in w for w in loaded.warnings)


def test_serve_flags_fill_the_cluster_section() -> None:
    from crush_trio.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "--cluster-database-url", "postgresql:///x", "--cluster-redis-url",
         "redis://r/0", "--cluster-node-id", "n1", "--cluster-lease-ttl", "3"]
    )  # fmt: skip
    assert (args.cluster_database_url, args.cluster_redis_url) == ("postgresql:///x", "redis://r/0")
    assert (args.cluster_node_id, args.cluster_lease_ttl) == ("n1", 3.0)


async def test_a_cluster_without_redis_is_refused_with_the_flag_to_use(tmp_path: Path) -> None:
    from crush_trio.errors import ConfigError
    from crush_trio.server.serve import ServeOptions, serve

    options = ServeOptions(
        port=0, token=TOKEN, user_config_dir=tmp_path, cluster={"database_url": "postgresql:///x"}
    )
    with pytest.raises(ConfigError, match="--cluster-redis-url"):
        await serve(options)


def test_a_stale_owner_is_answered_503_with_retry_after_a_live_one_307() -> None:
    from crush_trio.cluster.placement import ClusterPlacement as Placement
    from crush_trio.config import ClusterOptions
    from crush_trio.errors import Moved, OwnerUnavailable
    from crush_trio.server.security import response_headers

    node = Placement(
        ClusterOptions(database_url="postgresql:///x", redis_url="redis://r/0", lease_ttl=9),
        "http://127.0.0.1:7001",
    )
    # Renewed a moment ago (a renewal every 3 s keeps at least 6 s left): send the client there.
    live = node._elsewhere("b", "http://127.0.0.1:7002", 8.5, "/v1/workspaces/w/agent?x=1")
    assert isinstance(live, Moved)
    assert response_headers(live) == {"Location": "http://127.0.0.1:7002/v1/workspaces/w/agent?x=1"}
    # Two renewals missed: the owner is gone; wait for the lease to run out.
    stale = node._elsewhere("b", "http://127.0.0.1:7002", 2.2, "/v1/workspaces/w")
    assert isinstance(stale, OwnerUnavailable)
    assert response_headers(stale) == {"Retry-After": "3"}
    assert stale.status == 503
    assert "2.2 s" in stale.message
    # An owner that never registered its URL cannot be redirected to.
    assert isinstance(node._elsewhere("b", None, 8.5, "/v1/workspaces"), OwnerUnavailable)


def test_a_redirect_target_is_ascii_whatever_the_request_held() -> None:
    """A decoded path with non-ASCII text or an escaped CR LF, and raw query bytes outside the URL
    alphabet, are percent-encoded for ``Location``; escapes the query already had are kept."""
    from crush_trio.server.security import request_target

    assert (
        request_target("/v1/workspaces/w/agent", b"x=1&y=%20") == "/v1/workspaces/w/agent?x=1&y=%20"
    )
    target = request_target("/v1/workspaces/w/sessions/\u2713\r\nSet-Cookie: a", b"q=\xff\r\n")
    assert target == "/v1/workspaces/w/sessions/%E2%9C%93%0D%0ASet-Cookie:%20a?q=%FF%0D%0A"
    assert target.isascii()


def test_a_node_whose_database_is_unreachable_exits_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from crush_trio.cli import main
    from tests.services import free_port

    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/crush"
    (tmp_path / "none.json").write_text("{}")
    code = main(
        ["serve", "--port", "0", "--token", TOKEN, "--config", str(tmp_path / "none.json"),
         "--cluster-database-url", dead, "--cluster-redis-url", "redis://127.0.0.1:1/0"]
    )  # fmt: skip
    assert code == 1
    assert "cluster database" in capsys.readouterr().err
