"""The root of ``ls``, ``glob`` and ``grep``: its checks come before any prompt, and the walk
only after the user allowed a root outside the workspace.

Inside the workspace the checks and the walk share one worker thread; outside, the prompt comes
between them. Both orders are checked here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
import pytest
import trio

from crush_trio.tools import ToolContext, ToolResult, call_tool, default_tools

if TYPE_CHECKING:
    from pathlib import Path

SEARCHES: list[tuple[str, dict[str, Any]]] = [
    ("ls", {}),
    ("glob", {"pattern": "**/*"}),
    ("grep", {"pattern": "needle"}),
]


class Asker:
    def __init__(self, allow: bool) -> None:
        self.allow = allow
        self.paths: list[str] = []

    async def request(self, **request: Any) -> bool:
        self.paths.append(request["path"])
        await trio.lowlevel.checkpoint()
        return self.allow


def make_ctx(ws: Path, asker: Asker) -> ToolContext:
    return ToolContext(
        workspace=ws,
        data_dir=ws / ".crush",
        session_id="s1",
        tool_call_id="c1",
        permissions=asker,
        timeout=10.0,
    )


async def run(ctx: ToolContext, name: str, params: dict[str, Any]) -> ToolResult:
    with trio.fail_after(20):
        return await call_tool(default_tools(), name, orjson.dumps(params).decode(), ctx)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    workspace = tmp_path / "ws"
    (workspace / ".crush").mkdir(parents=True)
    (workspace / "inside.txt").write_text("needle inside\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "out.txt").write_text("needle outside\n")
    return workspace


@pytest.mark.parametrize(("name", "params"), SEARCHES)
async def test_inside_the_root_is_walked_without_asking(
    ws: Path, name: str, params: dict[str, Any]
) -> None:
    asker = Asker(allow=False)
    result = await run(make_ctx(ws, asker), name, params)
    assert not result.is_error
    assert "inside.txt" in result.content
    assert asker.paths == []


@pytest.mark.parametrize(("name", "params"), SEARCHES)
@pytest.mark.parametrize("allow", [True, False])
async def test_an_outside_root_is_walked_only_once_allowed(
    ws: Path, name: str, params: dict[str, Any], allow: bool
) -> None:
    asker = Asker(allow=allow)
    result = await run(make_ctx(ws, asker), name, {**params, "path": "../outside"})
    assert asker.paths == [str(ws.parent / "outside")]
    if allow:
        assert not result.is_error
        assert "out.txt" in result.content
    else:
        assert result.is_error
        assert result.content.startswith("permission denied: ")
        assert "out.txt" not in result.content


@pytest.mark.parametrize(("name", "params"), SEARCHES)
async def test_a_missing_outside_root_is_an_error_before_any_prompt(
    ws: Path, name: str, params: dict[str, Any]
) -> None:
    asker = Asker(allow=True)
    result = await run(make_ctx(ws, asker), name, {**params, "path": "../missing"})
    assert result.is_error
    assert "path not found" in result.content
    assert asker.paths == []


@pytest.mark.parametrize("name", ["ls", "glob"])
async def test_a_file_as_the_root_of_a_listing_is_an_error_before_any_prompt(
    ws: Path, name: str
) -> None:
    asker = Asker(allow=True)
    params = {"pattern": "*"} if name == "glob" else {}
    result = await run(make_ctx(ws, asker), name, {**params, "path": "../outside/out.txt"})
    assert result.is_error
    assert "is a file, not a directory" in result.content
    assert asker.paths == []


async def test_grep_searches_one_file_as_its_root(ws: Path) -> None:
    asker = Asker(allow=True)
    result = await run(make_ctx(ws, asker), "grep", {"pattern": "needle", "path": "inside.txt"})
    assert result.content == "inside.txt:1:needle inside"
    outside = await run(
        make_ctx(ws, asker), "grep", {"pattern": "needle", "path": "../outside/out.txt"}
    )
    assert outside.content.endswith("out.txt:1:needle outside")
    assert asker.paths == [str(ws.parent / "outside" / "out.txt")]
