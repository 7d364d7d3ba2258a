"""The environment block's git snapshot where git finds no repository: a new session does not run
git again while nothing changed where git looks for one (docs/providers.md)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import trio

from crush_trio.agent import prompt
from crush_trio.agent.prompt import GitSnapshot, repository_search_key

if TYPE_CHECKING:
    import pytest

    from crush_trio.client import WorkspaceClient
    from crush_trio.providers.scripted import ScriptedModel

#: Bound on each test's waits (seconds).
CAP: Final = 20


async def test_a_workspace_without_a_repository_is_searched_by_stat_until_one_appears(
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ws = crush_workspace
    project = Path(ws.path)
    calls: list[Path] = []
    real = prompt.git_snapshot

    async def counted(path: Path, **kw: Any) -> GitSnapshot:
        calls.append(path)
        return await real(path, **kw)

    monkeypatch.setattr(prompt, "git_snapshot", counted)
    with trio.fail_after(CAP):
        for text in ("one", "two", "three"):
            session = await ws.create_session()
            await ws.run(session.id, text, timeout=CAP)
        assert len(calls) == 1  # the first new session asked git; the others only stat
        assert "Git repository: no" in scripted_model.requests[-1].system
        await trio.run_process(["git", "init", "-q", "-b", "trunk", str(project)])
        session = await ws.create_session()
        await ws.run(session.id, "four", timeout=CAP)
    assert len(calls) == 2
    assert "Git repository: yes (branch trunk" in scripted_model.requests[-1].system


def test_the_search_key_changes_with_every_place_git_looks(tmp_path: Path) -> None:
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    old = 1_000_000_000  # 2001: far from "recent"
    first = repository_search_key(work)
    assert first is not None
    assert first == repository_search_key(work)
    for place in (work / ".git", tmp_path / "a" / "HEAD", tmp_path / "objects"):
        place.write_text("x")
        assert repository_search_key(work) is None  # changed just now: not trusted
        os.utime(place, ns=(old, old))
        # The change time cannot be set back: still too recent, so never equal to ``first``.
        assert repository_search_key(work) != first
        place.unlink()
    assert repository_search_key(work) == first
    # Without following links (the event loop's check): the same key, or None at a link.
    assert repository_search_key(work, follow=False) == first
    (tmp_path / "elsewhere").mkdir()
    (work / ".git").symlink_to(tmp_path / "elsewhere")
    assert repository_search_key(work, follow=False) is None
