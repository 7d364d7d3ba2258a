"""Shared fixtures: a real server on an ephemeral loopback port inside the test's nursery."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from crush_trio.server.serve import ServeOptions, ServerHandle, serve

TOKEN = "test-token"


class Server:
    """A running test server with small helpers for its HTTP API and streams."""

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
        url = (
            self.url.replace("http://", "ws://") + f"/v1/workspaces/{wid}/ws?client_id={client_id}"
        )
        if token:
            url += f"&token={self.token}"
        if since is not None:
            url += f"&since={since}"
        return url

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

    @asynccontextmanager
    async def websocket(
        self, wid: str, client_id: str | None = None, since: int | None = None
    ) -> AsyncIterator[EventSocket]:
        async with open_websocket_url(
            self.ws_url(wid, client_id or str(uuid.uuid4()), since),
            max_message_size=64 * 1024 * 1024,
        ) as conn:
            yield EventSocket(conn)


class EventSocket:
    """A websocket client that separates events from command replies."""

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
    options = ServeOptions(
        host="127.0.0.1",
        port=0,
        data_dir=tmp_path / "data",
        token=TOKEN,
        user_config_dir=tmp_path / "user-config",
        access_log=False,
    )
    for key, value in overrides.items():
        setattr(options, key, value)
    async with trio.open_nursery() as nursery:
        handle: ServerHandle = await nursery.start(partial(serve, options))
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
