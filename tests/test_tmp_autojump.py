from __future__ import annotations
import math
import pytest
import trio
from trio.testing import MockClock
from .conftest import Server

@pytest.fixture
def hold(monkeypatch, autojump_clock):
    orig = trio.to_thread.run_sync
    state = {"n": 0, "saved": 0.0}
    async def run_sync(*args, **kw):
        clock = autojump_clock
        state["n"] += 1
        if state["n"] == 1:
            state["saved"] = clock.autojump_threshold
            clock.autojump_threshold = math.inf
        try:
            return await orig(*args, **kw)
        finally:
            state["n"] -= 1
            if state["n"] == 0:
                clock.autojump_threshold = state["saved"]
    monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)

async def test_aj(hold, server: Server, autojump_clock: MockClock) -> None:
    ws = await server.open_workspace()
    session = await server.create_session(ws["id"])
    t0 = trio.current_time()
    with trio.fail_after(5):
        async with server.websocket(ws["id"]) as sock:
            await sock.recv()
            for i in range(30):
                await server.prompt(ws["id"], session["id"], f"hello there world {i}", run_id=f"r{i}")
                complete, _ = await sock.run_complete(f"r{i}")
    print("elapsed virtual", trio.current_time() - t0)
