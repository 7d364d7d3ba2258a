"""The system prompt a turn sends: the template's sections, the environment, and the project's
and the user's context files, as the scripted model's request log shows them."""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio

from crush_trio.agent import context_files
from crush_trio.agent.context_files import (
    HARD_LINKED,
    NOT_REGULAR,
    OUTSIDE,
    ContextFileCache,
    ContextSettings,
    quick_signature,
    read_context_files,
    settings_for,
)
from crush_trio.agent.prompt import git_snapshot
from crush_trio.client import Client, RunStatus, WorkspaceClient

if TYPE_CHECKING:
    from crush_trio.providers.scripted import ScriptedModel
    from crush_trio.testing import CrushServer

#: Bound on each test's waits (seconds).
CAP = 20


async def system_of(ws: WorkspaceClient, model: ScriptedModel, text: str = "hi") -> str:
    """Run one prompt in a new session and return the system prompt its request carried."""
    session = await ws.create_session()
    before = len(model.requests)
    await ws.run(session.id, text, timeout=CAP)
    return model.requests[before].system


def file_block(path: str, content: str) -> str:
    return f'<file path="{path}">\n{content}\n</file>'


async def test_the_template_sections_and_the_environment_reach_the_model(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    with trio.fail_after(CAP):
        system = await system_of(crush_workspace, scripted_model)
        info = await crush_workspace.agent_info()
    request = scripted_model.requests[-1]
    assert system.startswith("You are a coding agent")
    for section in ("<rules>", "</rules>", "<tools>", "</tools>", "<env>", "</env>"):
        assert system.count(section) == 1
    assert "Read before you edit" in system
    assert "Search before you guess" in system
    assert "Keep changes minimal" in system
    assert "run the project's own tests" in system
    # One line per tool on offer, generated from the tools the request carries.
    tools = system.split("<tools>")[1].split("</tools>")[0].strip().splitlines()
    assert [line.split("`")[1] for line in tools] == [spec.name for spec in request.tools]
    assert {"view", "edit", "grep", "bash"} <= {spec.name for spec in request.tools}
    env = system.split("<env>")[1].split("</env>")[0]
    assert f"Working directory: {crush_workspace.path}\n" in env
    assert "Platform: linux" in env
    assert f"Today's date: {datetime.date.today().isoformat()}" in env
    assert "Git repository: no" in env
    if info.sandbox.active:
        assert "Network: off" in env
        assert "read-only for commands that ran without asking" in env
    else:
        assert "Sandbox: none" in env
        assert "asks the user for permission" in env
    assert "Model: echo/echo" in env
    assert "<project_context>" not in system  # no context file in an empty project


async def test_agents_md_reaches_the_prompt_and_a_change_reaches_the_next_one(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    agents = Path(crush_workspace.path) / "AGENTS.md"
    agents.write_text("Run the tests with `just test`.\n")
    with trio.fail_after(CAP):
        first = await system_of(crush_workspace, scripted_model)
        agents.write_text("Run the tests with `make check` before you report.\n")
        second = await system_of(crush_workspace, scripted_model)
        info = await crush_workspace.agent_info()
    assert file_block("AGENTS.md", "Run the tests with `just test`.") in first
    assert file_block("AGENTS.md", "Run the tests with `make check` before you report.") in second
    assert "just test" not in second
    [loaded] = info.context_files.loaded
    assert (loaded.path, loaded.bytes, loaded.truncated) == (
        "AGENTS.md",
        agents.stat().st_size,
        False,
    )


async def test_crush_and_claude_files_and_the_users_own_are_read(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
) -> None:
    project = Path(crush_workspace.path)
    (project / "CRUSH.md").write_text("crush rules")
    (project / "CLAUDE.local.md").write_text("local claude rules")
    (project / ".github").mkdir()
    (project / ".github" / "copilot-instructions.md").write_text("copilot rules")
    user_file = crush_server.root / "user-config" / "AGENTS.md"
    user_file.parent.mkdir(parents=True, exist_ok=True)
    user_file.write_text("the user's own rules")
    with trio.fail_after(CAP):
        system = await system_of(crush_workspace, scripted_model)
    assert file_block(str(user_file), "the user's own rules") in system
    assert file_block("CRUSH.md", "crush rules") in system
    assert file_block("CLAUDE.local.md", "local claude rules") in system
    assert file_block(".github/copilot-instructions.md", "copilot rules") in system
    # The user's file first, then the project's in Crush's order.
    order = [system.index(s) for s in ("the user's own", "copilot", "local claude", "crush rules")]
    assert order == sorted(order)


class TestContextPathsAndBounds:
    @pytest.fixture
    def crush_config(self) -> dict[str, Any]:
        return {
            "options": {
                "context_paths": ["docs/agent", "NOTES.txt", "missing.md"],
                "context_max_file_bytes": 100,
                "context_max_total_bytes": 250,
            }
        }

    async def test_a_context_paths_directory_and_file_are_read_and_cut_at_the_bounds(
        self, crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
    ) -> None:
        project = Path(crush_workspace.path)
        (project / "docs" / "agent" / "sub").mkdir(parents=True)
        (project / "docs" / "agent" / "a.md").write_text("style: short functions")
        (project / "docs" / "agent" / "sub" / "b.md").write_text("tests: pytest -q")
        (project / "AGENTS.md").write_text("x" * 300)
        (project / "NOTES.txt").write_text("y" * 90)
        with trio.fail_after(CAP):
            system = await system_of(crush_workspace, scripted_model)
            info = await crush_workspace.agent_info()
        # AGENTS.md is cut at the per-file bound, with a note naming the key.
        assert (
            '<file path="AGENTS.md">\n' + "x" * 100 + "\n[... AGENTS.md is 300 bytes; only its "
            "first 100 bytes are shown (options.context_max_file_bytes) ...]\n</file>"
        ) in system
        assert "x" * 101 not in system
        assert file_block("docs/agent/a.md", "style: short functions") in system
        assert file_block("docs/agent/sub/b.md", "tests: pytest -q") in system
        # 100 + 22 + 16 bytes used: NOTES.txt gets the 112 left of the total and fits whole.
        assert file_block("NOTES.txt", "y" * 90) in system
        loaded = {f.path: (f.bytes, f.truncated) for f in info.context_files.loaded}
        assert loaded == {
            "AGENTS.md": (300, True),
            "docs/agent/a.md": (22, False),
            "docs/agent/sub/b.md": (16, False),
            "NOTES.txt": (90, False),
        }
        skipped = {f.path: f.reason for f in info.context_files.skipped}
        assert skipped == {"missing.md": "not found"}

    async def test_the_total_bound_cuts_then_skips(
        self, crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
    ) -> None:
        project = Path(crush_workspace.path)
        (project / "docs" / "agent").mkdir(parents=True)
        (project / "CLAUDE.md").write_text("c" * 100)
        (project / "CRUSH.md").write_text("r" * 100)
        (project / "AGENTS.md").write_text("a" * 100)
        (project / "docs" / "agent" / "z.md").write_text("never shown")
        with trio.fail_after(CAP):
            system = await system_of(crush_workspace, scripted_model)
            info = await crush_workspace.agent_info()
        assert "c" * 100 in system
        assert "r" * 100 in system
        assert "a" * 50 + "\n[... AGENTS.md is 100 bytes; only its first 50 bytes" in system
        assert "(options.context_max_total_bytes)" in system
        assert "never shown" not in system
        skipped = {f.path: f.reason for f in info.context_files.skipped}
        assert skipped["docs/agent/z.md"] == "options.context_max_total_bytes reached"


async def test_a_fifo_named_agents_md_is_refused_without_hanging(
    crush_client: Client, crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    project = Path(crush_workspace.path)
    os.mkfifo(project / "AGENTS.md")
    (project / "CRUSH.md").write_text("still read")
    with trio.fail_after(CAP):
        system = await system_of(crush_workspace, scripted_model)
        info = await crush_workspace.agent_info()
    with trio.fail_after(2):
        assert await crush_client.request("GET", "/v1/health", timeout=2) is not None
    assert '<file path="AGENTS.md">' not in system
    assert file_block("CRUSH.md", "still read") in system
    skipped = {f.path: f.reason for f in info.context_files.skipped}
    assert skipped == {"AGENTS.md": NOT_REGULAR}


async def test_a_symlink_out_of_an_untrusted_workspace_is_refused(
    crush_server: CrushServer, crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    secret = crush_server.root / "secret.txt"
    secret.write_text("SECRET-TOKEN")
    project = Path(crush_workspace.path)
    (crush_server.root / "rules").mkdir()
    (crush_server.root / "rules" / "r.md").write_text("SECRET-TOKEN in a directory")
    (project / "CLAUDE.md").symlink_to(secret)
    (project / ".cursor").symlink_to(crush_server.root)  # .cursor/rules/ leads out too
    with trio.fail_after(CAP):
        system = await system_of(crush_workspace, scripted_model)
        info = await crush_workspace.agent_info()
    assert "SECRET-TOKEN" not in system
    skipped = {f.path: f.reason for f in info.context_files.skipped}
    assert skipped == {".cursor/rules": OUTSIDE, "CLAUDE.md": OUTSIDE}


# ---------------------------------------------------------------------------------------------
# The loader and git, without a server


def settings(workspace: Path, *, trusted: bool = False) -> ContextSettings:
    return settings_for(workspace, None, trusted, (), 1000, 10_000)


def test_trust_lets_a_workspace_link_out_and_hard_links_are_refused_untrusted(
    tmp_path: Path,
) -> None:
    project, outside = tmp_path / "p", tmp_path / "o"
    project.mkdir()
    outside.mkdir()
    (outside / "rules.md").write_text("outside rules")
    (project / "CLAUDE.md").symlink_to(outside / "rules.md")
    os.link(outside / "rules.md", project / "AGENTS.md")
    untrusted = read_context_files(settings(project))
    assert untrusted.files == ()
    assert {(s.path, s.reason) for s in untrusted.skipped} == {
        ("CLAUDE.md", OUTSIDE),
        ("AGENTS.md", HARD_LINKED),
    }
    trusted = read_context_files(settings(project, trusted=True))
    # One file under two names: read once.
    assert [(f.path, f.content) for f in trusted.files] == [("CLAUDE.md", "outside rules")]


async def test_unchanged_files_are_not_read_again(tmp_path: Path) -> None:
    (tmp_path / "AGENTS.md").write_text("one")
    cache = ContextFileCache()
    with trio.fail_after(CAP):
        first = await cache.load(settings(tmp_path))
        again = await cache.load(settings(tmp_path))
        assert cache.reads == 1
        assert again is first
        (tmp_path / "CRUSH.md").write_text("two")  # a new file is a change
        third = await cache.load(settings(tmp_path))
    assert cache.reads == 2
    assert [f.path for f in third.files] == ["CRUSH.md", "AGENTS.md"]


async def test_unchanged_plain_files_are_checked_without_a_worker_thread(tmp_path: Path) -> None:
    """A turn whose context files are plain files (or absent) checks them on the event loop
    with ``lstat`` alone; any change, even one that keeps the size, is still seen."""
    agents = tmp_path / "AGENTS.md"
    agents.write_text("one")
    (tmp_path / ".github").mkdir()
    (tmp_path / ".github" / "copilot-instructions.md").write_text("two")
    cache = ContextFileCache()
    with trio.fail_after(CAP):
        first = await cache.load(settings(tmp_path))
        assert (cache.thread_loads, cache.reads) == (1, 1)
        for _ in range(3):
            assert await cache.load(settings(tmp_path)) is first
        assert (cache.thread_loads, cache.reads) == (1, 1)
        agents.write_text("uno")  # the same size
        changed = await cache.load(settings(tmp_path))
        assert (cache.thread_loads, cache.reads) == (2, 2)
        assert [f.content for f in changed.files] == ["two", "uno"]
        agents.unlink()
        agents.symlink_to(tmp_path / ".github" / "copilot-instructions.md")
        for _ in range(2):  # a link cannot be checked on the loop: every load asks the thread
            linked = await cache.load(settings(tmp_path, trusted=True))
        assert (cache.thread_loads, cache.reads) == (4, 3)
        assert [f.content for f in linked.files] == ["two"]  # one file under two names


async def test_a_change_during_a_read_is_seen_by_the_next_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agents = tmp_path / "AGENTS.md"
    agents.write_text("one")
    real = context_files.read_context_files

    def read_then_edit(settings: ContextSettings) -> Any:
        found = real(settings)
        agents.write_text("two")  # after the read, before the turn uses it
        return found

    cache = ContextFileCache()
    with trio.fail_after(CAP):
        monkeypatch.setattr(context_files, "read_context_files", read_then_edit)
        assert [f.content for f in (await cache.load(settings(tmp_path))).files] == ["one"]
        monkeypatch.setattr(context_files, "read_context_files", real)
        assert [f.content for f in (await cache.load(settings(tmp_path))).files] == ["two"]


def test_the_quick_check_never_looks_behind_a_link_or_into_a_directory(tmp_path: Path) -> None:
    project, outside = tmp_path / "p", tmp_path / "o"
    project.mkdir()
    (outside / "rules").mkdir(parents=True)
    (outside / "copilot-instructions.md").write_text("outside")
    assert quick_signature(settings(project)) is not None
    (project / ".github").symlink_to(outside)  # a nested name's directory is a link
    assert quick_signature(settings(project)) is None
    (project / ".github").unlink()
    (project / ".cursor").mkdir()
    (project / ".cursor" / "rules").mkdir()  # a directory of rules is walked in the thread
    assert quick_signature(settings(project)) is None
    (project / ".cursor" / "rules").rmdir()
    assert quick_signature(settings(project)) is not None
    configured = settings_for(project, None, False, ("notes/",), 1000, 10_000)
    assert quick_signature(configured) is None  # configured paths may be anywhere
    (project / "AGENTS.md").write_text("plain")
    plain = quick_signature(settings(project))
    assert plain is not None
    os.link(project / "AGENTS.md", outside / "other-name")  # now a file with another link
    assert quick_signature(settings(project)) not in (None, plain)
    (project / "AGENTS.md").unlink()
    os.mkfifo(project / "AGENTS.md")  # never opened here: the thread's read refuses it
    assert quick_signature(settings(project)) is None


async def test_a_fifo_named_like_a_context_file_is_refused_without_blocking(
    tmp_path: Path,
) -> None:
    os.mkfifo(tmp_path / "AGENTS.md")
    cache = ContextFileCache()
    with trio.fail_after(CAP):
        for _ in range(2):
            found = await cache.load(settings(tmp_path))
    assert found.files == ()
    assert cache.thread_loads == 2  # the quick check cannot tell: the thread checks each time


async def git(cwd: Path, *args: str) -> None:
    await trio.run_process(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=cwd
    )


async def test_git_status_is_summarized_and_a_repository_that_runs_programs_is_not_run(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    with trio.fail_after(CAP):
        await git(repo, "init", "-q", "-b", "main")
        (repo / "kept.py").write_text("a = 1\n")
        await git(repo, "add", "kept.py")
        await git(repo, "commit", "-q", "-m", "first")
        (repo / "kept.py").write_text("a = 2\n")
        (repo / "new.py").write_text("")
        snapshot = await git_snapshot(repo)
        assert snapshot.repository
        assert snapshot.branch == "main"
        assert snapshot.status == (" M kept.py", "?? new.py")
        # A repository whose config names a program: git is not run at all.
        marker = tmp_path / "ran"
        with (repo / ".git" / "config").open("a") as config:
            config.write(f"[core]\n\tfsmonitor = touch {marker}\n")
        unsafe = await git_snapshot(repo)
    assert unsafe.repository
    assert unsafe.status == ()
    assert "status not read" in unsafe.note
    assert not marker.exists()


async def test_a_git_repository_shows_in_the_env_block(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    project = Path(crush_workspace.path)
    with trio.fail_after(CAP):
        await git(project, "init", "-q", "-b", "trunk")
        (project / "x.txt").write_text("x")
        system = await system_of(crush_workspace, scripted_model)
    assert "Git repository: yes (branch trunk, no commits yet)" in system
    assert "  ?? x.txt" in system


def fake_git(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> Path:
    """A repository, and a ``git`` first on PATH whose ``status`` runs ``script`` (sh); every
    other git command (the safety check's ``rev-parse`` and ``config``) is the real git's."""
    real = shutil.which("git")
    assert real is not None
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run([real, "init", "-q", str(repo)], check=True, timeout=CAP)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    git_path = bin_dir / "git"
    git_path.write_text(
        f'#!/bin/sh\ncase " $* " in *" status "*) ;; *) exec {real} "$@" ;; esac\n{script}\n'
    )
    git_path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return repo


async def test_a_git_status_that_hangs_is_stopped_at_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_file = tmp_path / "pid"
    repo = fake_git(tmp_path, monkeypatch, f"echo $$ > {pid_file}\nexec sleep 100")
    with trio.fail_after(CAP):
        snapshot = await git_snapshot(repo, within=2)
    assert snapshot.repository
    assert snapshot.note == "status not read: git status took over 2 s"
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # stopped and reaped


async def test_a_git_status_that_never_ends_its_output_is_cut_at_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = fake_git(tmp_path, monkeypatch, "echo '## main'\nexec yes ' M endless.txt'")
    with trio.fail_after(CAP):
        snapshot = await git_snapshot(repo)
    assert snapshot.branch == "main"
    assert snapshot.status == (" M endless.txt",) * 40
    assert snapshot.note == "more changes not shown"


async def test_cancelling_a_run_while_its_git_status_runs_stops_git(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
) -> None:
    """The git status of a turn's first prompt runs before the model is called: a cancel then
    ends the run cancelled, kills git, and the model is never called."""
    started = tmp_path / "started"
    os.mkfifo(started)
    real = shutil.which("git")
    assert real is not None
    with trio.fail_after(CAP):
        await trio.run_process([real, "init", "-q", crush_workspace.path])
    fake_git(tmp_path, monkeypatch, f"echo $$ > {started}\nexec sleep 100")
    session = await crush_workspace.create_session()
    with trio.fail_after(CAP):
        handle = await crush_workspace.prompt(session.id, "hi")
        # Blocks until git has started and written its pid (a FIFO: no polling).
        pid = int(await trio.to_thread.run_sync(started.read_text, abandon_on_cancel=True))
        await crush_workspace.cancel(session.id)
        run = await handle.result(CAP, check=False)
    assert run.status is RunStatus.CANCELLED
    assert scripted_model.requests == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_without_git_the_prompt_says_the_status_was_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "repo" / ".git").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with trio.fail_after(CAP):
        snapshot = await git_snapshot(tmp_path / "repo")
    assert snapshot.repository
    assert snapshot.note == "status not read: git could not run (No such file or directory)"
