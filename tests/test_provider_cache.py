"""The agent's provider cache: a provider replaced by a new configuration is closed as soon as
nothing holds it, so a workspace whose model or trust changes many times keeps a bounded number
of providers (and their connection pools) open."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import trio
import trio.testing

from crush_trio.agent.provider_cache import ProviderCache
from crush_trio.errors import ConfigError
from crush_trio.providers.scripted import Gate, ScriptedModel, Step
from tests.conftest import WAIT
from tests.test_models import CONFIG

if TYPE_CHECKING:
    from crush_trio.client import WorkspaceClient


class FakeProvider:
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = 0

    async def aclose(self) -> None:
        self.closed += 1


def cache() -> tuple[ProviderCache, list[FakeProvider], list[FakeProvider]]:
    made: list[FakeProvider] = []
    closing: list[FakeProvider] = []

    def factory(name: str, cfg: Any) -> Any:
        made.append(FakeProvider(name))
        return made[-1]

    return ProviderCache(factory, close_soon=closing.append), made, closing


def test_a_name_is_set_up_once_and_shared_by_its_holders() -> None:
    providers, made, closing = cache()
    a = providers.acquire("local", None)
    b = providers.acquire("local", None)
    c = providers.acquire("other", None)
    assert a is b
    assert a is not c
    assert len(made) == 2
    assert len(providers) == 2
    for p in (a, b, c):
        providers.release(p)
    assert closing == []
    assert len(providers) == 2  # current providers stay open for reuse


def test_a_replaced_provider_nobody_holds_is_closed_at_once() -> None:
    providers, made, closing = cache()
    providers.release(providers.acquire("local", None))
    providers.retire()
    assert closing == made
    assert len(providers) == 0
    fresh = providers.acquire("local", None)
    assert fresh is not made[0]
    assert len(made) == 2


def test_a_replaced_provider_is_closed_when_its_last_holder_releases_it() -> None:
    providers, made, closing = cache()
    turn = providers.acquire("local", None)
    title = providers.acquire("local", None)
    providers.retire()
    assert closing == []
    assert len(providers) == 1
    providers.release(turn)
    assert closing == []  # the title still uses it
    providers.release(title)
    assert closing == [turn]
    assert len(providers) == 0
    providers.release(turn)  # a stray release changes nothing
    assert closing == [turn]


def test_many_replacements_keep_only_the_held_providers_open() -> None:
    providers, made, closing = cache()
    held = providers.acquire("local", None)
    for _ in range(100):
        providers.release(providers.acquire("local", None))
        providers.retire()
    assert len(made) == 100
    assert len(closing) == 99
    assert len(providers) == 1
    providers.release(held)
    assert len(closing) == 100
    assert len(providers) == 0


def test_a_provider_that_cannot_be_set_up_is_a_config_error() -> None:
    def factory(name: str, cfg: Any) -> Any:
        raise ValueError("no such endpoint")

    providers = ProviderCache(factory, close_soon=lambda p: None)
    with pytest.raises(ConfigError, match="provider 'local' could not be set up: no such"):
        providers.acquire("local", None)
    assert len(providers) == 0


async def test_aclose_closes_current_and_held_replaced_providers() -> None:
    providers, made, closing = cache()
    old = providers.acquire("local", None)
    providers.retire()
    new = providers.acquire("local", None)
    await providers.aclose(1.0)
    assert (old.closed, new.closed) == (1, 1)
    assert len(providers) == 0


@pytest.fixture
def crush_config() -> dict[str, Any]:
    return CONFIG


async def test_model_switches_close_each_replaced_provider_after_its_turn(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    """A client that switches models many times leaves one provider open, not one per switch;
    the provider a running turn uses stays open until that turn ends."""
    ws = crush_workspace
    url = f"/v1/workspaces/{ws.id}/config/model"
    session = await ws.create_session()
    choices = [{"provider": "local", "model": m} for m in ("small-1", "big-1")]
    gate = Gate()
    scripted_model.add(Step("a reply that waits", gate_mid=gate))
    with trio.fail_after(WAIT):
        run = await ws.prompt(session.id, "go")
        await gate.reached.wait()
        for i in range(40):
            body = {"scope": 1, "model_type": "large", "model": choices[i % 2]}
            await ws.client.request("POST", url, json=body)
        await trio.testing.wait_all_tasks_blocked()
        # Only the provider of the running turn (and of the title, the same one) is open.
        assert scripted_model.providers_made - scripted_model.providers_closed == 1
        gate.release()
        assert (await run.result(WAIT)).text == "a reply that waits"
        await trio.testing.wait_all_tasks_blocked()
        assert scripted_model.providers_made == scripted_model.providers_closed == 1
        await (await ws.prompt(session.id, "again")).result(WAIT)
    assert scripted_model.providers_made - scripted_model.providers_closed == 1
