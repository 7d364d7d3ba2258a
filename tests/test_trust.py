"""Workspace trust and permissions that mean what they say.

* An untrusted workspace's ``crush.json`` may choose models and tune harmless options; every
  other key is ignored with a warning that the log and the client both see. A trusted one is
  applied as written. Trust comes from the user file, ``crush-trio trust`` and
  ``POST /v1/workspaces/{wid}/trust``.
* Config files are read off the event loop, must be regular files, and are size-bounded.
* ``allow_session`` for ``bash`` approves that exact command again, not every command.
* ``write``/``edit`` open the approved path without following a symlink put there during the
  permission wait, and refuse hard-linked files.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest
import trio

from crush_trio.client import Event, WorkspaceClient
from crush_trio.providers.scripted import ScriptedModel, Step
from crush_trio.tools import ToolContext, call_tool, default_tools
from crush_trio.tools.base import ToolResult

from .conftest import WAIT

#: A code path that blocks on a FIFO is unblocked after this long (seconds), so that it fails
#: its assertions instead of hanging the test run.
FALLBACK_UNBLOCK = 3.0


async def unblock_fifo_writer_after(fifo: Path, delay: float) -> None:
    """After ``delay``, open ``fifo`` for reading: a writer blocked in ``open`` then goes on."""
    await trio.sleep(delay)
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    await trio.sleep(delay)
    os.close(fd)


def is_type(event_type: str) -> Callable[[Event], bool]:
    return lambda e: e.type == event_type


# ---------------------------------------------------------------------------------------------
# allow_session for bash is scoped to the exact command


async def test_allow_session_for_one_bash_command_does_not_approve_another(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    first = ("bash", {"command": "touch first.txt"})
    other = ("bash", {"command": "touch other.txt"})
    scripted_model.add(
        Step(tool_calls=[first]),
        Step(text="a"),
        Step(tool_calls=[first]),
        Step(text="b"),
        Step(tool_calls=[other]),
        Step(text="c"),
    )
    sid = (await ws.create_session()).id
    async with ws.subscribe(timeout=WAIT) as feed:
        r1 = await ws.prompt(sid, "one", run_id="r1")
        asked = await feed.until(is_type("permission_request"), WAIT)
        assert asked.payload.params["command"] == "touch first.txt"
        assert await ws.grant(asked.payload.id, "allow_session")
        await r1.result(WAIT)
        # The same command again in the same session: approved by the earlier answer.
        r2 = await ws.prompt(sid, "two", run_id="r2")
        assert (await r2.result(WAIT)).text == "b"
        assert r2.permission_requests == {}
        # Another command in the same session: asked again, and denied here.
        r3 = await ws.prompt(sid, "three", run_id="r3")
        asked_again = await feed.until(is_type("permission_request"), WAIT)
        assert asked_again.payload.params["command"] == "touch other.txt"
        assert await ws.grant(asked_again.payload.id, "deny")
        await r3.result(WAIT)
    assert (Path(ws.path) / "first.txt").exists()
    assert not (Path(ws.path) / "other.txt").exists()


# ---------------------------------------------------------------------------------------------
# write / edit: the approved path, opened without following symlinks; no hard links


@attrs.define
class HookAsker:
    """Allows every request, running ``during_wait`` first (what happens while the user thinks)."""

    during_wait: Callable[[], Any] | None = None
    requests: list[dict[str, Any]] = attrs.field(factory=list)

    async def request(self, **request: Any) -> bool:
        self.requests.append(request)
        if self.during_wait is not None:
            self.during_wait()
        await trio.lowlevel.checkpoint()
        return True


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """A workspace ``ws`` (with a ``sub`` directory) and a directory ``outside`` next to it."""
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    (ws / "sub").mkdir(parents=True)
    outside.mkdir()
    return ws, outside


def make_ctx(ws: Path, asker: HookAsker) -> ToolContext:
    return ToolContext(
        workspace=ws,
        data_dir=ws / ".crush",
        session_id="s1",
        tool_call_id="c1",
        permissions=asker,
        timeout=10.0,
    )


async def call(ctx: ToolContext, name: str, **params: Any) -> ToolResult:
    with trio.fail_after(WAIT):
        return await call_tool(default_tools(), name, orjson.dumps(params).decode(), ctx)


def swap_dir_for_symlink(directory: Path, target: Path) -> Callable[[], None]:
    def swap() -> None:
        for child in directory.iterdir():
            child.unlink()
        directory.rmdir()
        directory.symlink_to(target, target_is_directory=True)

    return swap


def swap_file_for_symlink(file: Path, target: Path) -> Callable[[], None]:
    def swap() -> None:
        file.unlink()
        file.symlink_to(target)

    return swap


async def test_write_refuses_a_directory_swapped_for_a_symlink_during_the_wait(
    layout: tuple[Path, Path],
) -> None:
    ws, outside = layout
    asker = HookAsker(during_wait=swap_dir_for_symlink(ws / "sub", outside))
    result = await call(make_ctx(ws, asker), "write", path="sub/new.txt", content="pwned")
    assert len(asker.requests) == 1
    assert result.is_error, result.content
    assert "while waiting for permission" in result.content
    assert not (outside / "new.txt").exists()


async def test_write_refuses_a_file_swapped_for_a_symlink_during_the_wait(
    layout: tuple[Path, Path],
) -> None:
    ws, outside = layout
    (ws / "notes.txt").write_text("old\n")
    secret = outside / "secret.txt"
    secret.write_text("keep me\n")
    asker = HookAsker(during_wait=swap_file_for_symlink(ws / "notes.txt", secret))
    result = await call(make_ctx(ws, asker), "write", path="notes.txt", content="pwned")
    assert result.is_error, result.content
    assert "while waiting for permission" in result.content
    assert secret.read_text() == "keep me\n"


async def test_edit_refuses_a_file_swapped_for_a_symlink_during_the_wait(
    layout: tuple[Path, Path],
) -> None:
    ws, outside = layout
    (ws / "sub" / "code.py").write_text("x = 1\n")
    secret = outside / "code.py"
    secret.write_text("x = 1\n")
    asker = HookAsker(during_wait=swap_dir_for_symlink(ws / "sub", outside))
    # The swap removes sub/code.py; the outside file has the same text, so a followed symlink
    # would edit it.
    secret_copy = secret.read_text()
    result = await call(
        make_ctx(ws, asker), "edit", path="sub/code.py", old_string="x = 1", new_string="x = 2"
    )
    assert result.is_error, result.content
    assert "while waiting for permission" in result.content
    assert secret.read_text() == secret_copy


async def test_write_and_edit_refuse_a_hard_linked_file_before_asking(
    layout: tuple[Path, Path],
) -> None:
    ws, outside = layout
    secret = outside / "secret.txt"
    secret.write_text("token = 1\n")
    os.link(secret, ws / "linked.txt")
    asker = HookAsker()
    ctx = make_ctx(ws, asker)
    wrote = await call(ctx, "write", path="linked.txt", content="pwned")
    edited = await call(ctx, "edit", path="linked.txt", old_string="1", new_string="2")
    for result in (wrote, edited):
        assert result.is_error, result.content
        assert "2 hard links" in result.content
    assert asker.requests == []  # refused before any prompt
    assert secret.read_text() == "token = 1\n"


async def test_write_refuses_a_hard_link_made_during_the_wait(layout: tuple[Path, Path]) -> None:
    ws, outside = layout
    target = ws / "plain.txt"
    target.write_text("old\n")
    asker = HookAsker(during_wait=lambda: os.link(target, outside / "alias.txt"))
    result = await call(make_ctx(ws, asker), "write", path="plain.txt", content="new\n")
    assert result.is_error, result.content
    assert "hard links" in result.content
    assert (outside / "alias.txt").read_text() == "old\n"


async def test_write_and_edit_still_work_through_symlinks_inside_the_workspace(
    layout: tuple[Path, Path],
) -> None:
    ws, _ = layout
    (ws / "real").mkdir()
    (ws / "alias").symlink_to(ws / "real", target_is_directory=True)
    ctx = make_ctx(ws, HookAsker())
    wrote = await call(ctx, "write", path="alias/deep/f.txt", content="a = 1\n")
    assert not wrote.is_error, wrote.content
    edited = await call(ctx, "edit", path="alias/deep/f.txt", old_string="1", new_string="2")
    assert not edited.is_error, edited.content
    assert (ws / "real" / "deep" / "f.txt").read_text() == "a = 2\n"


async def test_write_refuses_a_fifo_without_blocking(layout: tuple[Path, Path]) -> None:
    ws, _ = layout
    os.mkfifo(ws / "pipe")
    asker = HookAsker()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(unblock_fifo_writer_after, ws / "pipe", FALLBACK_UNBLOCK)
        result = await call(make_ctx(ws, asker), "write", path="pipe", content="x")
        nursery.cancel_scope.cancel()
    assert result.is_error, result.content
    assert "not a regular file" in result.content
    assert asker.requests == []


async def test_write_that_was_approved_as_a_new_file_does_not_overwrite_one_that_appeared(
    layout: tuple[Path, Path],
) -> None:
    ws, _ = layout
    late = ws / "late.txt"
    asker = HookAsker(during_wait=lambda: late.write_text("someone else's\n"))
    result = await call(make_ctx(ws, asker), "write", path="late.txt", content="mine\n")
    assert result.is_error, result.content
    assert "appeared" in result.content
    assert late.read_text() == "someone else's\n"
