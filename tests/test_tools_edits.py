"""``multiedit`` and read-before-edit: edits apply all or none, and ``edit``, ``multiedit`` and
``write`` over an existing file need this session to have viewed it, unchanged since.

Every wait is bounded (``run`` uses ``trio.fail_after``).
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

from crush_trio.tools import FileTracker, ToolContext, ToolResult, call_tool, default_tools
from crush_trio.tools.edit import MULTIEDIT_MAX_EDITS
from crush_trio.tools.tracker import Snapshot

from .test_tools import FakeAsker


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    workspace = tmp_path / "ws"
    (workspace / ".crush").mkdir(parents=True)
    return workspace


@pytest.fixture
def asker() -> FakeAsker:
    return FakeAsker()


def make_ctx(ws: Path, asker: Any, files: FileTracker, session_id: str = "s1") -> ToolContext:
    return ToolContext(
        workspace=ws,
        data_dir=ws / ".crush",
        session_id=session_id,
        tool_call_id="c1",
        permissions=asker,
        timeout=10.0,
        files=files,
    )


@pytest.fixture
def files() -> FileTracker:
    return FileTracker()


@pytest.fixture
def ctx(ws: Path, asker: FakeAsker, files: FileTracker) -> ToolContext:
    return make_ctx(ws, asker, files)


async def run(ctx: ToolContext, name: str, **params: Any) -> ToolResult:
    with trio.fail_after(20):
        return await call_tool(default_tools(), name, orjson.dumps(params).decode(), ctx)


def touch_later(path: Path) -> None:
    """Change ``path``'s modification time without changing its content or size."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


# ---------------------------------------------------------------------------------------------
# read-before-edit


@pytest.mark.parametrize(
    ("tool", "params"),
    [
        ("edit", {"old_string": "x = 1", "new_string": "x = 2"}),
        ("multiedit", {"edits": [{"old_string": "x = 1", "new_string": "x = 2"}]}),
        ("write", {"content": "x = 2\n"}),
    ],
)
async def test_change_without_view_is_refused_before_asking(
    ctx: ToolContext, asker: FakeAsker, ws: Path, tool: str, params: dict[str, Any]
) -> None:
    (ws / "a.py").write_text("x = 1\n")
    result = await run(ctx, tool, path="a.py", **params)
    assert result.is_error
    assert not result.stop_turn
    assert result.content == (
        f"{tool} refused: a.py exists and has not been read in this session; view it first "
        "(the view tool), then make the change"
    )
    assert asker.requests == []
    assert (ws / "a.py").read_text() == "x = 1\n"


@pytest.mark.parametrize(
    ("tool", "params"),
    [
        ("edit", {"old_string": "x = 1", "new_string": "x = 2"}),
        ("multiedit", {"edits": [{"old_string": "x = 1", "new_string": "x = 2"}]}),
        ("write", {"content": "x = 2\n"}),
    ],
)
async def test_view_then_external_change_then_change_is_refused(
    ctx: ToolContext, asker: FakeAsker, ws: Path, tool: str, params: dict[str, Any]
) -> None:
    (ws / "a.py").write_text("x = 1\n")
    assert not (await run(ctx, "view", path="a.py")).is_error
    (ws / "a.py").write_text("x = 1\ny = 3\n")  # someone else changed it
    result = await run(ctx, tool, path="a.py", **params)
    assert result.is_error
    assert "a.py changed on disk since it was last viewed in this session; view it again" in (
        result.content
    )
    assert asker.requests == []
    assert (ws / "a.py").read_text() == "x = 1\ny = 3\n"
    # Viewing again makes it editable.
    assert not (await run(ctx, "view", path="a.py")).is_error
    assert not (await run(ctx, tool, path="a.py", **params)).is_error


async def test_same_size_change_is_seen_by_its_times(ctx: ToolContext, ws: Path) -> None:
    (ws / "a.py").write_text("x = 1\n")
    await run(ctx, "view", path="a.py")
    (ws / "a.py").write_text("x = 9\n")
    touch_later(ws / "a.py")
    result = await run(ctx, "edit", path="a.py", old_string="x = 9", new_string="x = 2")
    assert result.is_error
    assert "changed on disk" in result.content


async def test_view_then_edit_works_and_a_second_edit_needs_no_view(
    ctx: ToolContext, asker: FakeAsker, ws: Path
) -> None:
    (ws / "a.py").write_text("x = 1\ny = 1\n")
    await run(ctx, "view", path="a.py", limit=1)  # any part of the file counts
    first = await run(ctx, "edit", path="a.py", old_string="x = 1", new_string="x = 2")
    assert not first.is_error, first.content
    # The tool's own write is recorded: the file is as the session left it.
    second = await run(ctx, "edit", path="a.py", old_string="y = 1", new_string="y = 2")
    assert not second.is_error, second.content
    assert (ws / "a.py").read_text() == "x = 2\ny = 2\n"
    assert len(asker.requests) == 2


async def test_a_view_by_another_session_does_not_count(
    ws: Path, asker: FakeAsker, files: FileTracker
) -> None:
    (ws / "a.py").write_text("x = 1\n")
    await run(make_ctx(ws, asker, files, "other"), "view", path="a.py")
    result = await run(
        make_ctx(ws, asker, files, "s1"), "edit", path="a.py", old_string="x", new_string="y"
    )
    assert result.is_error
    assert "has not been read in this session" in result.content


@attrs.define
class ChangingAsker:
    """Allows every request, after running ``change`` while the user "thinks"."""

    change: Callable[[], None]
    asked: int = 0

    async def request(self, **_: Any) -> bool:
        self.asked += 1
        self.change()
        await trio.lowlevel.checkpoint()
        return True


@pytest.mark.parametrize(
    ("tool", "params"),
    [
        ("edit", {"old_string": "x = 1", "new_string": "x = 2"}),
        ("multiedit", {"edits": [{"old_string": "x = 1", "new_string": "x = 2"}]}),
        ("write", {"content": "x = 2\n"}),
    ],
)
async def test_change_during_the_permission_wait_is_refused_on_the_opened_file(
    ws: Path, files: FileTracker, tool: str, params: dict[str, Any]
) -> None:
    target = ws / "a.py"
    target.write_text("x = 1\n")
    asker = ChangingAsker(lambda: target.write_text("x = 1\n# theirs\n"))
    ctx = make_ctx(ws, asker, files)
    await run(ctx, "view", path="a.py")
    result = await run(ctx, tool, path="a.py", **params)
    assert asker.asked == 1
    assert result.is_error
    assert "changed on disk" in result.content
    assert target.read_text() == "x = 1\n# theirs\n"


async def test_new_files_need_no_view(ctx: ToolContext, ws: Path) -> None:
    assert not (await run(ctx, "write", path="n.txt", content="a\n")).is_error
    created = await run(ctx, "edit", path="m.txt", old_string="", new_string="b\n")
    assert not created.is_error
    # And both are now known as written: editing them needs no view.
    assert not (await run(ctx, "edit", path="n.txt", old_string="a", new_string="c")).is_error
    assert not (await run(ctx, "write", path="m.txt", content="d\n")).is_error


def test_tracker_is_bounded_per_session_and_in_sessions() -> None:
    tracker = FileTracker(max_files=3, max_sessions=2)
    snap = Snapshot(1, 2, 3, 4, 5)
    for i in range(5):
        tracker.record("s1", Path(f"/f{i}"), snap)
    assert len(tracker) == 3
    assert tracker.seen("s1", Path("/f0")) is None
    assert tracker.seen("s1", Path("/f4")) == snap
    tracker.record("s2", Path("/a"), snap)
    tracker.record("s3", Path("/a"), snap)
    assert tracker.seen("s1", Path("/f4")) is None  # least recently used session forgotten
    assert tracker.seen("s3", Path("/a")) == snap
    tracker.forget_session("s3")  # a deleted session
    assert tracker.seen("s3", Path("/a")) is None


# ---------------------------------------------------------------------------------------------
# multiedit


async def test_multiedit_applies_edits_in_order_with_one_permission(
    ctx: ToolContext, asker: FakeAsker, ws: Path
) -> None:
    (ws / "a.py").write_text("def f():\n    return 1\n\nname = 'old'\n")
    await run(ctx, "view", path="a.py")
    result = await run(
        ctx,
        "multiedit",
        path="a.py",
        edits=[
            {"old_string": "return 1", "new_string": "return 2"},
            {"old_string": "return 2", "new_string": "return 3"},  # sees the edit before it
            {"old_string": "'old'", "new_string": "'new'"},
        ],
    )
    assert not result.is_error, result.content
    assert result.content.splitlines()[0] == (
        "Edited a.py: applied 3 edits (3 replacements). The first change now reads:"
    )
    assert (ws / "a.py").read_text() == "def f():\n    return 3\n\nname = 'new'\n"
    [request] = asker.requests
    assert request["tool_name"] == "multiedit"
    assert request["action"] == "write"
    assert len(request["params"]["edits"]) == 3


async def test_multiedit_with_one_non_matching_edit_leaves_the_file_untouched(
    ctx: ToolContext, asker: FakeAsker, ws: Path
) -> None:
    original = "a = 1\nb = 2\nc = 3\n"
    (ws / "a.py").write_text(original)
    await run(ctx, "view", path="a.py")
    before = (ws / "a.py").stat().st_mtime_ns
    result = await run(
        ctx,
        "multiedit",
        path="a.py",
        edits=[
            {"old_string": "a = 1", "new_string": "a = 10"},
            {"old_string": "zzz", "new_string": "y"},
            {"old_string": "c = 3", "new_string": "c = 30"},
        ],
    )
    assert result.is_error
    assert result.content == (
        "edit 2 of 3: old_string not found in a.py; view the file and copy the exact text; "
        "no edit was applied"
    )
    assert asker.requests == []
    assert (ws / "a.py").read_text() == original
    assert (ws / "a.py").stat().st_mtime_ns == before


async def test_multiedit_ambiguous_edit_and_bad_items_are_named(ctx: ToolContext, ws: Path) -> None:
    (ws / "a.py").write_text("x\nx\n")
    await run(ctx, "view", path="a.py")
    ambiguous = await run(
        ctx, "multiedit", path="a.py", edits=[{"old_string": "x", "new_string": "y"}]
    )
    assert ambiguous.is_error
    assert "appears 2 times" in ambiguous.content
    every = await run(
        ctx,
        "multiedit",
        path="a.py",
        edits=[{"old_string": "x", "new_string": "y", "replace_all": True}],
    )
    assert not every.is_error
    assert (ws / "a.py").read_text() == "y\ny\n"
    for edits, message in [
        ([], "at least one edit"),
        (["x"], "edit 1 of multiedit must be an object"),
        ([{"old_string": "y"}], "edit 1 of multiedit needs old_string and new_string"),
        ([{"old_string": "", "new_string": "z"}], "empty old_string"),
        ([{"old_string": "y", "new_string": "y"}], "identical"),
        (
            [{"old_string": "y", "new_string": "z"}] * (MULTIEDIT_MAX_EDITS + 1),
            f"over the limit of {MULTIEDIT_MAX_EDITS}",
        ),
    ]:
        result = await run(ctx, "multiedit", path="a.py", edits=edits)
        assert result.is_error, (edits, result.content)
        assert message in result.content, (edits, result.content)
    assert (ws / "a.py").read_text() == "y\ny\n"


async def test_multiedit_denied_leaves_the_file(
    ctx: ToolContext, asker: FakeAsker, ws: Path
) -> None:
    (ws / "a.py").write_text("keep\n")
    await run(ctx, "view", path="a.py")
    asker.allow = False
    result = await run(
        ctx, "multiedit", path="a.py", edits=[{"old_string": "keep", "new_string": "lose"}]
    )
    assert result.is_error
    assert result.stop_turn
    assert (ws / "a.py").read_text() == "keep\n"


async def test_multiedit_of_a_missing_file_says_how_to_create_it(ctx: ToolContext) -> None:
    result = await run(
        ctx, "multiedit", path="nope.py", edits=[{"old_string": "a", "new_string": "b"}]
    )
    assert result.is_error
    assert "file not found: nope.py" in result.content
