"""A blocking check shared by concurrent callers (crush_trio/agent/shared_check.py)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Final

import pytest
import trio
import trio.testing

from crush_trio.agent.context_files import ContextFileCache, settings_for
from crush_trio.agent.shared_check import SharedCheck

if TYPE_CHECKING:
    from pathlib import Path

#: Bound on every wait of these tests (seconds).
CAP: Final = 10.0


class CheckFailed(Exception):
    pass


class Gated:
    """A blocking check that counts its runs and waits for the test's go before answering."""

    def __init__(self) -> None:
        self.started = 0
        self.go = threading.Event()
        self.fail = False

    def __call__(self, arg: str) -> tuple[str, int]:
        self.started += 1
        number = self.started
        if not self.go.wait(CAP):
            raise TimeoutError("the test never let the check answer")
        if self.fail:
            raise CheckFailed(f"check {number} failed")
        return arg, number


async def test_callers_that_arrive_while_a_check_runs_share_the_next_one() -> None:
    gated = Gated()
    check = SharedCheck(gated)
    results: dict[str, tuple[str, int]] = {}

    async def ask(name: str) -> None:
        results[name] = await check("x")

    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "first")
            await trio.testing.wait_all_tasks_blocked()
            for name in ("second", "third", "fourth"):
                nursery.start_soon(ask, name)
            await trio.testing.wait_all_tasks_blocked()
            assert check.runs == 1  # the others wait for a check that starts after they came
            gated.go.set()
    assert results == {
        "first": ("x", 1),
        "second": ("x", 2),
        "third": ("x", 2),
        "fourth": ("x", 2),
    }
    assert check.runs == 2


async def test_a_cancelled_caller_stops_waiting_and_the_others_still_get_the_answer() -> None:
    gated = Gated()
    check = SharedCheck(gated)
    answers: list[tuple[str, int]] = []
    scope = trio.CancelScope()
    returned = trio.Event()

    async def cancelled_ask() -> None:
        with scope:
            await check("x")
        returned.set()

    async def ask() -> None:
        answers.append(await check("x"))

    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancelled_ask)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask)
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()
            await returned.wait()  # while its check still blocks in the thread
            assert not gated.go.is_set()
            gated.go.set()
    assert scope.cancelled_caught
    assert answers == [("x", 2)]


async def test_a_failed_check_raises_in_every_caller_of_that_run() -> None:
    gated = Gated()
    gated.fail = True
    check = SharedCheck(gated)
    errors: list[str] = []

    async def ask() -> None:
        with pytest.raises(CheckFailed) as info:
            await check("x")
        errors.append(str(info.value))

    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask)
            nursery.start_soon(ask)
            await trio.testing.wait_all_tasks_blocked()
            gated.go.set()
    assert sorted(errors) == ["check 1 failed", "check 2 failed", "check 2 failed"]


async def test_another_argument_gets_a_run_of_its_own() -> None:
    gated = Gated()
    check = SharedCheck(gated)
    results: dict[str, tuple[str, int]] = {}

    async def ask(name: str, arg: str) -> None:
        results[name] = await check(arg)

    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "a1", "a")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask, "a2", "a")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask, "b", "b")
            await trio.testing.wait_all_tasks_blocked()
            gated.go.set()
    assert results["a1"] == ("a", 1)
    assert results["a2"] == ("a", 2)
    assert results["b"] == ("b", 3)


async def test_turns_that_start_together_check_the_context_files_a_few_times(
    tmp_path: Path,
) -> None:
    (tmp_path / "AGENTS.md").write_text("rules")
    cache = ContextFileCache()
    settings = settings_for(tmp_path, None, False, [], 64 * 1024, 256 * 1024)
    loaded = []

    async def turn() -> None:
        loaded.append(await cache.load(settings))

    with trio.fail_after(CAP):
        async with trio.open_nursery() as nursery:
            for _ in range(50):
                nursery.start_soon(turn)
    assert len(loaded) == 50
    assert all(f.files[0].content == "rules" for f in loaded)
    assert cache.reads == 1
    assert cache.checks <= 2
