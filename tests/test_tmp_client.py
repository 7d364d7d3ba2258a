from __future__ import annotations
import trio
from trio.testing import MockClock
from crush_trio.client import WorkspaceClient
from crush_trio.providers.scripted import ScriptedModel, Step, Gate

async def test_scratch(crush_workspace: WorkspaceClient, scripted_model: ScriptedModel, autojump_clock: MockClock) -> None:
    s = await crush_workspace.create_session()
    for i in range(20):
        run = await crush_workspace.run(s.id, f"hello {i}", timeout=5)
        assert run.text == f"hello {i}"
    gate = Gate()
    scripted_model.add(Step("a b c d", gate_mid=gate))
    h = await crush_workspace.prompt(s.id, "x")
    t = trio.current_time()
    await h.result(timeout=100)
