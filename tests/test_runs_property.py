"""Property test: random interleavings of prompts, cancels, clears, disconnects and provider
failures, then a workspace shutdown; every accepted run ends exactly once and agrees with its
record.

The operations go through the project's client (``WorkspaceClient.prompt``, ``cancel``,
``clear_queue``), and every run handle must end with its run's own terminal. The
events are also read on a raw websocket in delta mode, which checks the wire itself: seqs without
holes across reconnects with ``since``, no gap, one ``run_complete`` per accepted run. A prompt without a
``run_id`` (folded into the active turn) is something the client never sends, so it goes out as
a plain HTTP request.

CI runs a fixed number of examples with a fixed seed (derandomized); set
``CRUSH_TRIO_PROPERTY_EXAMPLES`` for more on demand.
"""

from __future__ import annotations

import gc
import os
import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio_websocket import ConnectionClosed, open_websocket_url

from crush_trio import wire
from crush_trio.client import RunComplete, RunHandle
from crush_trio.embedded import embedded
from crush_trio.errors import ProviderError
from crush_trio.providers.scripted import ScriptedModel, Step
from crush_trio.store import Store
from crush_trio.wire import Role

from .conftest import MAX_FRAME, serve_options, ws_url

EXAMPLES = int(os.environ.get("CRUSH_TRIO_PROPERTY_EXAMPLES", "12"))

ops = st.lists(
    st.one_of(
        st.tuples(st.just("prompt"), st.integers(0, 1), st.booleans(), st.integers(1, 40)),
        st.tuples(st.just("cancel"), st.integers(0, 1)),
        st.tuples(st.just("clear"), st.integers(0, 1)),
        st.tuples(st.just("fail_next"), st.integers(0, 40)),
        st.tuples(st.just("reconnect")),
        st.tuples(st.just("pause"), st.integers(0, 30)),
    ),
    min_size=1,
    max_size=25,
)


# trio-websocket leaves sockets of connections closed by the server (or cancelled) to the garbage
# collector; they are collected at the end of this test, where that is expected.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(script=ops)
async def test_every_accepted_run_ends_exactly_once(
    tmp_path_factory: Any, script: list[Any]
) -> None:
    tmp_path: Path = tmp_path_factory.mktemp("prop")
    project = tmp_path / "project"
    project.mkdir()
    model = ScriptedModel()
    accepted: list[str] = []
    handles: list[RunHandle] = []
    frames: list[dict[str, Any]] = []
    options = serve_options(tmp_path, provider_factory=model)
    async with embedded(options) as client, client.workspace(project) as ws:
        assert client.server is not None
        wid = ws.id
        sessions = [(await ws.create_session()).id for _ in range(2)]
        cid = str(uuid.uuid4())
        last_seq = 0
        workspace = client.server.backend.get(wid)

        async def pump(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            nonlocal last_seq
            # Delta mode: a snapshot-mode client's resume may get a gap for a delta published
            # while no snapshot-mode client was connected (docs/protocol.md §6.6, "Replay").
            url = ws_url(client.base_url, wid, cid, since=last_seq, token=client.token)
            url += "&deltas=1"
            try:
                async with open_websocket_url(url, max_message_size=MAX_FRAME) as conn:
                    task_status.started()
                    while True:
                        frame = orjson.loads(await conn.get_message())
                        if frame["type"] == "gap":
                            raise AssertionError(f"unexpected gap {frame}")
                        if frame["type"] != "hello":
                            assert frame["seq"] == last_seq + 1, (frame["seq"], last_seq)
                            last_seq = frame["seq"]
                            frames.append(frame)
            except ConnectionClosed:
                return

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                reader = trio.CancelScope()
                reader_done = trio.Event()

                async def reading(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                    done = reader_done
                    try:
                        with reader:
                            await pump(task_status=task_status)
                    finally:
                        done.set()

                await nursery.start(reading)
                for op in script:
                    kind = op[0]
                    if kind == "prompt":
                        _, s, with_id, words = op
                        text = " ".join(f"w{i}" for i in range(words))
                        if with_id:
                            handle = await ws.prompt(sessions[s], text, f"run-{len(accepted)}")
                            handles.append(handle)
                            accepted.append(handle.run_id)
                        else:
                            r = await client.http.post(
                                f"/v1/workspaces/{wid}/agent",
                                json={"session_id": sessions[s], "prompt": text},
                            )
                            assert r.status_code == 202, r.text
                            accepted.append(r.json()["run_id"])
                    elif kind == "cancel":
                        await ws.cancel(sessions[op[1]])
                    elif kind == "clear":
                        await ws.clear_queue(sessions[op[1]])
                    elif kind == "fail_next":
                        model.add(
                            Step(
                                text=" ".join("x" * op[1]), error=ProviderError("injected failure")
                            )
                        )
                    elif kind == "reconnect":
                        # The old reader may already hold a frame it has not counted yet:
                        # the next cursor is only known once it has ended.
                        reader.cancel()
                        await reader_done.wait()
                        reader = trio.CancelScope()
                        reader_done = trio.Event()
                        await nursery.start(reading)
                    else:
                        for _ in range(op[1]):
                            await trio.lowlevel.checkpoint()
                workspace.request_shutdown()
                await workspace.closed.wait()
                # The stream drains its queued events, then closes with 1001.
                nursery.cancel_scope.deadline = trio.current_time() + 10

        completes: dict[str, list[dict[str, Any]]] = {}
        for frame in frames:
            if frame["type"] == "run_complete":
                payload = frame["payload"]["payload"]
                completes.setdefault(payload["run_id"], []).append(payload)
        assert set(completes) == set(accepted)
        assert all(len(v) == 1 for v in completes.values()), completes

        # The client's view: each run handle ended with its own run's terminal, as sent.
        for handle in handles:
            await handle.wait(10)
            wired = wire.converter.structure(completes[handle.run_id][0], RunComplete)
            assert handle.complete == wired, handle

        store = await Store.open(Path(ws.info.data_dir))
        try:
            for run_id in accepted:
                run = await store.get_run(run_id)
                assert run is not None
                done = completes[run_id][0]
                expected = (
                    "cancelled"
                    if done["cancelled"]
                    else ("failed" if done["error"] else "completed")
                )
                assert run.status.value == expected, (run, done)
                assert run.error == done["error"]
                assert run.message_id == done["message_id"]
            for sid in sessions:
                for msg in await store.list_messages(sid):
                    if msg.role is Role.ASSISTANT:
                        assert msg.finish() is not None, msg
        finally:
            await store.aclose()
        assert model.streams_open == 0
    gc.collect()
