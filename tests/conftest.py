"""Shared test helpers.

Tests of what a client does (open a workspace, create sessions, prompt, wait for a run, read its
events, answer permissions) use the project's own client, :mod:`crush_trio.client`, and its
pytest plugin, :mod:`crush_trio.testing` (``crush_server``, ``crush_client``,
``crush_workspace``, ``scripted_model``). When a test needs a server the plugin cannot give (a
real provider configuration, a provider factory that fails), it starts one with
``crush_trio.embedded.embedded(serve_options(tmp_path, ...))``.

What else is here exists for tests that check the wire itself, which a client library
deliberately hides: exact frames and their seq numbers, gap frames, close codes, refusals,
websocket commands and malformed frames, SSE parity, exact HTTP status codes.
:func:`running_server` and :class:`Server` give those tests a server and raw HTTP calls that
assert the status code; :class:`EventSocket` is a raw websocket that keeps every frame.
"""

from __future__ import annotations

import uuid
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Final

import attrs
import httpx
import orjson
import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from crush_trio.server.serve import ServeOptions, ServerHandle, serve
from tests.services import pg_dsn, postgres_server, redis_server, redis_url  # noqa: F401 (fixtures)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from pathlib import Path

    from crush_trio.client import Event

TOKEN: Final = "test-token"
#: Bound on each wait of a test on a run or an event (seconds).
WAIT: Final = 10.0
#: Largest frame the raw websocket accepts (a message event carries a whole message).
MAX_FRAME: Final = 64 * 1024 * 1024


def serve_options(tmp_path: Path, **overrides: Any) -> ServeOptions:
    """Options of a test server: loopback port 0, data and user config under ``tmp_path``."""
    options = ServeOptions(
        host="127.0.0.1",
        port=0,
        data_dir=tmp_path / "data",
        token=TOKEN,
        user_config_dir=tmp_path / "user-config",
        access_log=False,
    )
    return attrs.evolve(options, **overrides)


# -- client-side helpers ----------------------------------------------------------------------


def completes_run(run_id: str) -> Callable[[Event], bool]:
    """A predicate for ``Subscription.until``/``collect_until``: the ``run_complete`` event of
    run ``run_id``."""

    def run_complete_of(event: Event) -> bool:
        return event.type == "run_complete" and event.payload.run_id == run_id

    run_complete_of.__qualname__ = f"run_complete_of({run_id!r})"
    return run_complete_of


def payloads(events: list[Event], event_type: str) -> list[Any]:
    """The payloads of the events of one type, in order."""
    return [e.payload for e in events if e.type == event_type]


# -- raw protocol helpers ---------------------------------------------------------------------


def ws_url(
    base_url: str,
    wid: str,
    client_id: str,
    since: int | None = None,
    token: str | None = TOKEN,
) -> str:
    """The event-stream URL of a workspace, with the token in the query unless ``None``."""
    url = base_url.replace("http://", "ws://") + f"/v1/workspaces/{wid}/ws?client_id={client_id}"
    if token is not None:
        url += f"&token={token}"
    if since is not None:
        url += f"&since={since}"
    return url


@asynccontextmanager
async def event_socket(url: str) -> AsyncIterator[EventSocket]:
    """A raw websocket on ``url`` (see :func:`ws_url`)."""
    async with open_websocket_url(url, max_message_size=MAX_FRAME) as conn:
        yield EventSocket(conn)


class Server:
    """A running server with raw HTTP helpers that assert the exact status of each answer.

    For wire-level tests only; tests of client behaviour use :mod:`crush_trio.client`.
    """

    def __init__(self, handle: ServerHandle, tmp: Path) -> None:
        self.handle = handle
        self.url = handle.url
        self.token = handle.token
        self.tmp = tmp
        self.http = httpx.AsyncClient(
            base_url=self.url,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
        )

    @property
    def backend(self) -> Any:
        return self.handle.backend

    def ws_url(self, wid: str, client_id: str, since: int | None = None, token: bool = True) -> str:
        return ws_url(self.url, wid, client_id, since, self.token if token else None)

    async def open_workspace(
        self, path: Path | None = None, client_id: str | None = None
    ) -> dict[str, Any]:
        if path is None:
            path = self.tmp / f"project-{uuid.uuid4().hex[:6]}"
            path.mkdir()
        r = await self.http.post(
            "/v1/workspaces", json={"path": str(path), "client_id": client_id or str(uuid.uuid4())}
        )
        assert r.status_code == 200, r.text
        return dict(r.json())

    async def create_session(self, wid: str, title: str = "") -> dict[str, Any]:
        r = await self.http.post(f"/v1/workspaces/{wid}/sessions", json={"title": title})
        assert r.status_code == 200, r.text
        return dict(r.json())

    async def prompt(
        self, wid: str, sid: str, text: str, run_id: str | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"session_id": sid, "prompt": text}
        if run_id is not None:
            body["run_id"] = run_id
        r = await self.http.post(f"/v1/workspaces/{wid}/agent", json=body)
        assert r.status_code == 202, r.text
        return dict(r.json())

    async def run(self, wid: str, run_id: str) -> dict[str, Any]:
        r = await self.http.get(f"/v1/workspaces/{wid}/runs/{run_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    async def messages(self, wid: str, sid: str) -> list[dict[str, Any]]:
        r = await self.http.get(f"/v1/workspaces/{wid}/sessions/{sid}/messages")
        assert r.status_code == 200, r.text
        return list(r.json())

    def websocket(
        self, wid: str, client_id: str | None = None, since: int | None = None
    ) -> AbstractAsyncContextManager[EventSocket]:
        """A raw :class:`EventSocket` on the workspace's stream (an async context manager)."""
        return event_socket(self.ws_url(wid, client_id or str(uuid.uuid4()), since))


class EventSocket:
    """A raw websocket that keeps every frame and tells events from command replies.

    For wire-level tests only (frames, seqs, commands); a client follows runs with
    :class:`crush_trio.client.RunHandle`.
    """

    def __init__(self, conn: WebSocketConnection) -> None:
        self.conn = conn
        self._next_id = 0
        self.pending: list[dict[str, Any]] = []

    async def recv(self) -> dict[str, Any]:
        if self.pending:
            return self.pending.pop(0)
        return dict(orjson.loads(await self.conn.get_message()))

    async def command(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        cid = self._next_id
        await self.conn.send_message(
            orjson.dumps({"id": cid, "method": method, "params": params}).decode()
        )
        while True:
            frame = dict(orjson.loads(await self.conn.get_message()))
            if frame.get("type") == "reply" and frame.get("id") == cid:
                return frame
            self.pending.append(frame)

    async def until(self, pred: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        """Frames up to and including the first that matches ``pred``."""
        seen = []
        while True:
            frame = await self.recv()
            seen.append(frame)
            if pred(frame):
                return seen

    async def run_complete(self, run_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        frames = await self.until(
            lambda f: f["type"] == "run_complete" and f["payload"]["payload"]["run_id"] == run_id
        )
        return frames[-1]["payload"]["payload"], frames


@asynccontextmanager
async def running_server(tmp_path: Path, **overrides: Any) -> AsyncIterator[Server]:
    """A server in the caller's trio run for wire-level tests (see the module docstring)."""
    async with trio.open_nursery() as nursery:
        handle: ServerHandle = await nursery.start(
            partial(serve, serve_options(tmp_path, **overrides))
        )
        server = Server(handle, tmp_path)
        try:
            yield server
        finally:
            await server.http.aclose()
            handle.stop()


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    async with running_server(tmp_path) as srv:
        yield srv
