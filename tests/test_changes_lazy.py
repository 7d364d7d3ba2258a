"""When the change log runs git: a run's "before" snapshot is taken at its first tool call that may
write, a run that makes none costs no git command, and kept trees are not kept again
(docs/protocol.md "Changes").

The change log and its shadow store are real (real git); the tool calls go through the real
:class:`~crush_trio.changes.tracking.TrackedTools` around a toolbox of the test's own, except in
the last test, which runs real turns on a real server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import pytest
import trio

from crush_trio.changes import ChangeLog
from crush_trio.changes.shadow import ShadowRepo
from crush_trio.changes.tracking import TrackedTools
from crush_trio.providers.scripted import ScriptedModel, Step
from crush_trio.tools import ToolResult
from crush_trio.wire import RunStatus

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from crush_trio.client import WorkspaceClient
    from crush_trio.testing import CrushServer

#: Bound on each test's waits (seconds).
CAP: Final = 30.0


class GitCalls:
    """Counts the git commands of every :class:`ShadowRepo` (by their first argument)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.commands: list[str] = []
        real = ShadowRepo.git

        def counted(repo: ShadowRepo, *args: str, **kw: Any) -> bytes:
            self.commands.append(args[0])
            return real(repo, *args, **kw)

        monkeypatch.setattr(ShadowRepo, "git", counted)

    def since(self, mark: int) -> list[str]:
        return self.commands[mark:]


@pytest.fixture
def git_calls(monkeypatch: pytest.MonkeyPatch) -> GitCalls:
    return GitCalls(monkeypatch)


class Toolbox:
    """Tools that run a function of the test (``actions[name]``), then answer "ok"."""

    def __init__(self, actions: dict[str, Callable[[], Any]]) -> None:
        self.actions = actions

    async def call(self, name: str, input_json: str, **kw: Any) -> ToolResult:
        result = self.actions[name]()
        if hasattr(result, "__await__"):
            await result
        return ToolResult(content="ok")


@pytest.fixture
async def workspace(tmp_path: Path) -> tuple[Path, ChangeLog]:
    root = tmp_path / "ws"
    root.mkdir()
    (root / "a.txt").write_text("a0\n")
    log = ChangeLog(root, tmp_path / "data")
    with trio.fail_after(CAP):
        await log.open()
        await log.warm()
    return root, log


async def test_a_run_with_no_tool_call_runs_no_git_and_records_no_files(
    workspace: tuple[Path, ChangeLog], git_calls: GitCalls
) -> None:
    _root, log = workspace
    mark = len(git_calls.commands)
    with trio.fail_after(CAP):
        await log.begin_run("s", ["r1"])
        files = await log.end_run("s", ["r1"])
        record = await log.record("r1")
        diff = await log.run_diff("r1")
    assert git_calls.since(mark) == []
    assert files == {"r1": []}
    assert record is not None
    assert record.files == []
    assert record.before == record.after
    assert diff.files == []
    assert diff.diff == ""


async def test_a_run_of_read_only_tools_runs_no_git(
    workspace: tuple[Path, ChangeLog], git_calls: GitCalls
) -> None:
    root, log = workspace
    tools = TrackedTools(Toolbox({"view": lambda: None, "grep": lambda: None}), log)
    mark = len(git_calls.commands)
    with trio.fail_after(CAP):
        await log.begin_run("s", ["r1"])
        await tools.call("view", "{}", session_id="s", tool_call_id="c1")
        await tools.call("grep", "{}", session_id="s", tool_call_id="c2")
        await log.end_run("s", ["r1"])
        record = await log.record("r1")
    assert git_calls.since(mark) == []
    assert record is not None
    assert record.files == []


async def test_a_writing_tool_call_is_recorded_diffed_and_reverted_with_one_ref_command(
    workspace: tuple[Path, ChangeLog], git_calls: GitCalls
) -> None:
    root, log = workspace
    tools = TrackedTools(Toolbox({"write": lambda: (root / "a.txt").write_text("a1\n")}), log)
    mark = len(git_calls.commands)
    with trio.fail_after(CAP):
        await log.begin_run("s", ["r1"])
        await tools.call("write", "{}", session_id="s", tool_call_id="c1")
        files = await log.end_run("s", ["r1"])
        diff = await log.run_diff("r1")
    assert [f.path for f in files["r1"]] == ["a.txt"]
    assert [(f.path, f.status) for f in diff.files] == [("a.txt", "modified")]
    assert "-a0" in diff.diff
    assert "+a1" in diff.diff
    # Both refs of the record in one command; the "before" tree was kept when it was warm.
    assert git_calls.since(mark).count("update-ref") == 1
    with trio.fail_after(CAP):
        result = await log.revert("r1")
    assert result.state == "done"
    assert (root / "a.txt").read_text() == "a0\n"
    # The trees of a later run that wrote nothing are kept already: no ref command at all.
    mark = len(git_calls.commands)
    with trio.fail_after(CAP):
        await log.begin_run("s", ["r2"])
        await tools.call("write", "{}", session_id="s", tool_call_id="c2")
        (root / "a.txt").write_text("a0\n")  # back as it was: the same trees as the revert's
        await log.end_run("s", ["r2"])
    assert "update-ref" not in git_calls.since(mark)


async def test_an_edit_by_hand_before_the_first_writing_call_is_not_the_runs(
    workspace: tuple[Path, ChangeLog],
) -> None:
    root, log = workspace
    tools = TrackedTools(
        Toolbox({"view": lambda: None, "edit": lambda: (root / "tool.txt").write_text("t\n")}),
        log,
    )
    with trio.fail_after(CAP):
        await log.begin_run("s", ["r1"])
        (root / "hand.txt").write_text("by hand\n")
        await tools.call("view", "{}", session_id="s", tool_call_id="c1")
        (root / "a.txt").write_text("also by hand\n")
        await tools.call("edit", "{}", session_id="s", tool_call_id="c2")
        await log.end_run("s", ["r1"])
        record = await log.record("r1")
        await log.revert("r1")
    assert record is not None
    assert [f.path for f in record.files] == ["tool.txt"]
    assert not (root / "tool.txt").exists()
    assert (root / "hand.txt").exists()
    assert (root / "a.txt").read_text() == "also by hand\n"


async def test_parallel_writing_calls_of_one_run_take_one_before_snapshot(
    workspace: tuple[Path, ChangeLog], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, log = workspace
    snapshots: list[int] = []
    real = ShadowRepo.snapshot

    def counted(repo: ShadowRepo) -> str:
        snapshots.append(1)
        return real(repo)

    monkeypatch.setattr(ShadowRepo, "snapshot", counted)
    started = [trio.Event(), trio.Event()]
    release = trio.Event()

    def writer(i: int) -> Callable[[], Any]:
        async def act() -> None:
            started[i].set()
            await release.wait()
            (root / f"w{i}.txt").write_text(f"{i}\n")

        return act

    tools = TrackedTools(Toolbox({"bash": writer(0), "write": writer(1)}), log)
    with trio.fail_after(CAP):
        await log.begin_run("s", ["r1"])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: tools.call("bash", "{}", session_id="s", tool_call_id="c1"))
            nursery.start_soon(lambda: tools.call("write", "{}", session_id="s", tool_call_id="c2"))
            await started[0].wait()
            await started[1].wait()
            assert len(snapshots) == 1  # both calls run after the one before snapshot
            release.set()
        await log.end_run("s", ["r1"])
        record = await log.record("r1")
    assert len(snapshots) == 1 + 2 + 1  # before, after each call, the end
    assert record is not None
    assert sorted(f.path for f in record.files) == ["w0.txt", "w1.txt"]


async def test_a_run_that_wrote_nothing_before_any_snapshot_takes_one(
    tmp_path: Path, git_calls: GitCalls
) -> None:
    """No tree is known yet (no warm-up snapshot): the run's end takes a snapshot as before."""
    root = tmp_path / "ws"
    root.mkdir()
    (root / "a.txt").write_text("a\n")
    log = ChangeLog(root, tmp_path / "data")
    with trio.fail_after(CAP):
        await log.open()
        mark = len(git_calls.commands)
        await log.begin_run("s", ["r1"])
        await log.end_run("s", ["r1"])
        record = await log.record("r1")
    assert "write-tree" in git_calls.since(mark)
    assert git_calls.since(mark).count("update-ref") == 1
    assert record is not None
    assert record.files == []
    assert record.before == record.after
    listed = log.repo.git("ls-tree", "-r", "--name-only", record.after).decode().split()
    assert listed == ["a.txt"]
    refs = log.repo.git("for-each-ref", "--format=%(objectname)", "refs/crush/").decode()
    assert set(refs.split()) == {record.after}


# ---------------------------------------------------------------------------------------------
# Real turns


async def test_a_turn_with_no_tool_call_runs_no_shadow_git(
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    crush_server: CrushServer,
    git_calls: GitCalls,
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    with trio.fail_after(CAP):
        # The first run's end waits for the workspace's warm-up snapshot (it holds the lock).
        await ws.run(session.id, "hello", timeout=CAP)
        mark = len(git_calls.commands)
        scripted_model.add(Step("just text"))
        run = await ws.run(session.id, "again", timeout=CAP)
        scripted_model.add(Step(tool_calls=[("ls", {})]), Step("looked"))
        looked = await ws.run(session.id, "look", timeout=CAP)
        diff = await ws.run_diff(run.run_id)
    assert run.status is RunStatus.COMPLETED
    assert looked.status is RunStatus.COMPLETED
    assert git_calls.since(mark) == []
    assert diff.files == []
    assert (await ws.get_run(looked.run_id)).files == []
