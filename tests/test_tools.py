"""The coding tools: each tool's results and errors, path confinement, permission asks, and that
``bash`` leaves no process behind on return, timeout or cancel.

Rules: every wait is bounded by ``trio.fail_after``; subprocess tests run on the real clock (a
process's progress is not Trio time) and never sleep to wait for something, except in
:func:`wait_process_gone`, which must poll because the OS gives no event for the exit of a
process that is not our child.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest
import trio

from crush_trio.tools import (
    TOOLS_BY_NAME,
    BashTool,
    GrepTool,
    ResolvedPath,
    Toolbox,
    ToolContext,
    ToolResult,
    ToolSpec,
    call_tool,
    default_tools,
    is_read_only,
    resolve_path,
)
from crush_trio.tools import shell as shell_module
from crush_trio.tools.grep import GREP_MAX_MATCHES
from crush_trio.tools.read import GLOB_MAX_RESULTS, VIEW_MAX_FILE_BYTES

HAS_RG = shutil.which("rg") is not None


@attrs.define
class FakeAsker:
    """Records every permission request and answers ``allow``.

    ``watch`` is a path whose existence is recorded at each request, to prove the ask came before
    the side effect. With ``block`` set, a request waits until cancelled.
    """

    allow: bool = True
    block: bool = False
    watch: Path | None = None
    requests: list[dict[str, Any]] = attrs.field(factory=list)
    existed_at_ask: list[bool] = attrs.field(factory=list)
    asked: trio.Event = attrs.field(factory=trio.Event)

    async def request(
        self,
        *,
        session_id: str,
        tool_call_id: str,
        tool_name: str,
        action: str,
        description: str,
        params: dict[str, Any],
        path: str,
    ) -> bool:
        self.requests.append(
            {
                "session_id": session_id,
                "tool_call_id": tool_call_id,
                "tool_name": tool_name,
                "action": action,
                "description": description,
                "params": params,
                "path": path,
            }
        )
        if self.watch is not None:
            self.existed_at_ask.append(self.watch.exists())
        self.asked.set()
        if self.block:
            await trio.sleep_forever()
        await trio.lowlevel.checkpoint()
        return self.allow


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    workspace = tmp_path / "ws"
    (workspace / ".crush").mkdir(parents=True)
    (workspace / ".crush" / "crush.db").write_text("secret-needle\n")
    return workspace


@pytest.fixture
def asker() -> FakeAsker:
    return FakeAsker()


@pytest.fixture
def ctx(ws: Path, asker: FakeAsker) -> ToolContext:
    return ToolContext(
        workspace=ws,
        data_dir=ws / ".crush",
        session_id="s1",
        tool_call_id="c1",
        permissions=asker,
        timeout=10.0,
        bash_output_limit=30_000,
    )


async def run(
    ctx: ToolContext, name: str, params: dict[str, Any] | None = None, /, **more: Any
) -> ToolResult:
    """Call a default tool with ``params`` (and/or keyword parameters) as the model would."""
    with trio.fail_after(20):
        return await call_tool(
            default_tools(), name, orjson.dumps({**(params or {}), **more}).decode(), ctx
        )


# ---------------------------------------------------------------------------------------------
# call_tool


async def test_call_tool_invalid_json_is_an_error_result(ctx: ToolContext) -> None:
    result = await call_tool(default_tools(), "view", '{"path": ', ctx)
    assert result.is_error
    assert result.content.startswith("invalid JSON input for tool view: ")


async def test_call_tool_unknown_tool_lists_the_tools(ctx: ToolContext) -> None:
    result = await call_tool(TOOLS_BY_NAME, "delete_everything", "{}", ctx)
    assert result.is_error
    assert "unknown tool 'delete_everything'" in result.content
    for name in ("bash", "edit", "glob", "grep", "ls", "view", "write"):
        assert name in result.content


async def test_call_tool_missing_and_mistyped_params_name_the_parameter(ctx: ToolContext) -> None:
    missing = await call_tool(default_tools(), "edit", '{"path": "a.txt"}', ctx)
    assert missing.is_error
    assert "missing required parameter 'old_string' for tool edit" in missing.content
    mistyped = await call_tool(default_tools(), "view", '{"path": "a", "limit": "10"}', ctx)
    assert mistyped.is_error
    assert "parameter 'limit' of tool view must be an integer, got a string" in mistyped.content
    not_object = await call_tool(default_tools(), "ls", "[1]", ctx)
    assert not_object.is_error
    assert "must be a JSON object" in not_object.content
    below = await call_tool(default_tools(), "ls", '{"depth": 0}', ctx)
    assert below.is_error
    assert "'depth'" in below.content


async def test_call_tool_empty_input_and_null_optionals_are_accepted(
    ctx: ToolContext, ws: Path
) -> None:
    (ws / "a.txt").write_text("x\n")
    assert not (await call_tool(default_tools(), "ls", "", ctx)).is_error
    result = await call_tool(default_tools(), "ls", '{"path": null, "depth": null}', ctx)
    assert "a.txt" in result.content


@attrs.define
class ExplodingTool:
    spec = ToolSpec("boom", "fails", {"type": "object", "properties": {}})

    async def run(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        raise RuntimeError("kaboom")


@attrs.define
class ForeverTool:
    spec = ToolSpec("forever", "never returns", {"type": "object", "properties": {}})

    async def run(self, params: dict[str, Any], ctx: ToolContext) -> ToolResult:
        await trio.sleep_forever()
        raise AssertionError("unreachable")


async def test_call_tool_turns_exceptions_into_error_results(ctx: ToolContext) -> None:
    result = await call_tool([ExplodingTool()], "boom", "{}", ctx)
    assert result.is_error
    assert "tool boom failed: RuntimeError: kaboom" in result.content


async def test_call_tool_lets_cancellation_propagate(
    ctx: ToolContext, autojump_clock: trio.testing.MockClock
) -> None:
    with trio.move_on_after(1) as scope:
        await call_tool([ForeverTool()], "forever", "{}", ctx)
    assert scope.cancelled_caught


async def test_toolbox_binds_the_context(ws: Path, asker: FakeAsker) -> None:
    box = Toolbox(workspace=ws, data_dir=ws / ".crush", permissions=asker)
    assert [spec.name for spec in box.specs()] == [t.spec.name for t in default_tools()]
    with trio.fail_after(10):
        result = await box.call(
            "write", '{"path": "n.txt", "content": "x"}', session_id="s9", tool_call_id="c9"
        )
    assert not result.is_error
    assert asker.requests[0]["session_id"] == "s9"
    assert asker.requests[0]["tool_call_id"] == "c9"


def test_every_spec_is_an_object_schema_with_described_parameters() -> None:
    for tool in default_tools():
        schema = tool.spec.parameters
        assert schema["type"] == "object"
        assert tool.spec.description
        for name, prop in schema["properties"].items():
            assert prop.get("description"), (tool.spec.name, name)
        assert set(schema.get("required", [])) <= set(schema["properties"])


# ---------------------------------------------------------------------------------------------
# confinement


def test_resolve_path_inside_escape_absolute_and_symlinks(ctx: ToolContext, tmp_path: Path) -> None:
    ws = ctx.workspace
    outside = tmp_path / "outside"
    outside.mkdir()
    (ws / "src").mkdir()
    (ws / "out_link").symlink_to(outside)
    (ws / "dangling").symlink_to(outside / "later.txt")
    (ws / "in_link").symlink_to(ws / "src")

    assert resolve_path(ctx, "src/a.py") == ResolvedPath(ws / "src" / "a.py", True)
    assert resolve_path(ctx, "").path == ws
    assert resolve_path(ctx, "new/dir/file.txt").inside
    assert not resolve_path(ctx, "../outside/x").inside
    assert not resolve_path(ctx, "src/../../outside").inside
    assert not resolve_path(ctx, str(outside / "x")).inside
    assert resolve_path(ctx, str(ws / "src")).inside
    link = resolve_path(ctx, "out_link/new.txt")
    assert (link.path, link.inside) == (outside / "new.txt", False)
    assert not resolve_path(ctx, "dangling").inside
    assert resolve_path(ctx, "in_link/x").inside


async def test_view_outside_workspace_asks_to_read(
    ctx: ToolContext, asker: FakeAsker, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("outside text\n")
    result = await run(ctx, "view", path="../secret.txt")
    assert "outside text" in result.content
    [request] = asker.requests
    assert request["action"] == "read"
    assert request["tool_name"] == "view"
    assert request["path"] == str(secret)
    assert request["session_id"] == "s1"
    assert request["tool_call_id"] == "c1"


async def test_denied_read_outside_stops_the_turn(
    ctx: ToolContext, asker: FakeAsker, tmp_path: Path
) -> None:
    asker.allow = False
    secret = tmp_path / "secret.txt"
    secret.write_text("outside text\n")
    result = await run(ctx, "view", path=str(secret))
    assert result.is_error
    assert result.stop_turn
    assert result.content.startswith("permission denied: ")
    assert "outside text" not in result.content


async def test_symlink_out_of_the_workspace_asks(
    ctx: ToolContext, asker: FakeAsker, ws: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "f.txt").write_text("hi\n")
    (ws / "link").symlink_to(outside)
    listing = await run(ctx, "ls", path="link")
    assert "f.txt" in listing.content
    viewed = await run(ctx, "view", path="link/f.txt")
    assert "hi" in viewed.content
    assert [r["action"] for r in asker.requests] == ["read", "read"]
    assert asker.requests[1]["path"] == str(outside / "f.txt")


async def test_read_inside_the_workspace_never_asks(
    ctx: ToolContext, asker: FakeAsker, ws: Path
) -> None:
    (ws / "a.py").write_text("print('x')\n")
    for name, params in [
        ("ls", {}),
        ("view", {"path": "a.py"}),
        ("glob", {"pattern": "*.py"}),
        ("grep", {"pattern": "print"}),
    ]:
        assert not (await run(ctx, name, **params)).is_error
    assert asker.requests == []


async def test_data_dir_is_never_written_and_never_asks(
    ctx: ToolContext, asker: FakeAsker, ws: Path
) -> None:
    (ws / "to_data").symlink_to(ws / ".crush")
    for name, params in [
        ("write", {"path": ".crush/x.txt", "content": "x"}),
        ("write", {"path": "to_data/x.txt", "content": "x"}),
        ("edit", {"path": ".crush/crush.db", "old_string": "secret", "new_string": "s"}),
        ("edit", {"path": ".crush/new.txt", "old_string": "", "new_string": "s"}),
    ]:
        result = await run(ctx, name, **params)
        assert result.is_error
        assert not result.stop_turn
        assert "data directory" in result.content
    assert asker.requests == []
    assert sorted(p.name for p in (ws / ".crush").iterdir()) == ["crush.db"]
    assert (ws / ".crush" / "crush.db").read_text() == "secret-needle\n"


async def test_data_dir_is_hidden_from_ls_glob_and_grep(ctx: ToolContext, ws: Path) -> None:
    (ws / "visible.txt").write_text("secret-needle\n")
    listing = await run(ctx, "ls")
    assert ".crush" not in listing.content
    found = await run(ctx, "glob", pattern="**/*")
    assert "crush.db" not in found.content
    grep = await run(ctx, "grep", pattern="secret-needle")
    assert grep.content == "visible.txt:1:secret-needle"
    refused = await run(ctx, "ls", path=".crush")
    assert refused.is_error
    assert "data directory" in refused.content


# ---------------------------------------------------------------------------------------------
# ls


async def test_ls_lists_a_tree_and_skips_git(ctx: ToolContext, ws: Path) -> None:
    (ws / "src" / "pkg").mkdir(parents=True)
    (ws / "src" / "pkg" / "deep.py").write_text("")
    (ws / "src" / "main.py").write_text("")
    (ws / ".git").mkdir()
    (ws / ".git" / "HEAD").write_text("")
    (ws / "README.md").write_text("")
    result = await run(ctx, "ls")
    assert result.content.splitlines() == [
        f"{ws}/",
        "  - src/",
        "    - pkg/",
        "    - main.py",
        "  - README.md",
    ]
    deeper = await run(ctx, "ls", depth=3)
    assert "      - deep.py" in deeper.content.splitlines()
    capped = await run(ctx, "ls", depth=99)
    assert "deep.py" in capped.content


async def test_ls_notes_truncation(ctx: ToolContext, ws: Path) -> None:
    for i in range(30):
        (ws / f"f{i:02}.txt").write_text("")
    result = await run(ctx, "ls", limit=10)
    lines = result.content.splitlines()
    assert len([line for line in lines if line.startswith("  - ")]) == 10
    assert "truncated at 10 entries" in lines[-1]


async def test_ls_errors(ctx: ToolContext, ws: Path) -> None:
    (ws / "file.txt").write_text("")
    missing = await run(ctx, "ls", path="nope")
    assert missing.is_error
    assert "path not found: nope" in missing.content
    not_dir = await run(ctx, "ls", path="file.txt")
    assert not_dir.is_error
    assert "use view" in not_dir.content


# ---------------------------------------------------------------------------------------------
# view


async def test_view_numbers_lines_and_pages(ctx: ToolContext, ws: Path) -> None:
    (ws / "a.txt").write_text("".join(f"line {i}\n" for i in range(1, 11)))
    result = await run(ctx, "view", path="a.txt")
    assert result.content.splitlines()[0] == "     1|line 1"
    assert result.content.splitlines()[-1] == "    10|line 10"
    page = await run(ctx, "view", path="a.txt", offset=2, limit=3)
    assert page.content.splitlines() == [
        "     3|line 3",
        "     4|line 4",
        "     5|line 5",
        "(showing lines 3-5 of 10; use offset=5 to read more)",
    ]
    past = await run(ctx, "view", path="a.txt", offset=10)
    assert past.is_error
    assert "past the end" in past.content


async def test_view_cuts_long_lines(ctx: ToolContext, ws: Path) -> None:
    (ws / "long.txt").write_text("x" * 5000 + "\n")
    result = await run(ctx, "view", path="long.txt")
    assert result.content == "     1|" + "x" * 2000 + " [line truncated]"


async def test_view_refuses_binary_large_missing_and_directories(
    ctx: ToolContext, ws: Path
) -> None:
    (ws / "img.bin").write_bytes(b"\x89PNG\r\n\x00\x00data")
    binary = await run(ctx, "view", path="img.bin")
    assert binary.is_error
    assert "binary" in binary.content
    with (ws / "big.txt").open("wb") as f:
        f.truncate(VIEW_MAX_FILE_BYTES + 1)
    big = await run(ctx, "view", path="big.txt")
    assert big.is_error
    assert "over the" in big.content
    assert "grep" in big.content
    missing = await run(ctx, "view", path="nope.txt")
    assert missing.is_error
    assert "file not found: nope.txt" in missing.content
    (ws / "d").mkdir()
    directory = await run(ctx, "view", path="d")
    assert directory.is_error
    assert "is a directory" in directory.content
    (ws / "empty.txt").write_text("")
    assert (await run(ctx, "view", path="empty.txt")).content == "(empty.txt is empty)"


# ---------------------------------------------------------------------------------------------
# glob


async def test_glob_sorts_newest_first(ctx: ToolContext, ws: Path) -> None:
    (ws / "src").mkdir()
    for i, name in enumerate(["old.py", "src/mid.py", "new.py", "notes.md"]):
        path = ws / name
        path.write_text("")
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
    result = await run(ctx, "glob", pattern="*.py")
    assert result.content.splitlines() == ["new.py", "src/mid.py", "old.py"]
    scoped = await run(ctx, "glob", pattern="src/*.py")
    assert scoped.content == "src/mid.py"
    braces = await run(ctx, "glob", pattern="**/*.{md,py}", path="src")
    assert braces.content == "src/mid.py"
    absolute = await run(ctx, "glob", pattern=f"{ws}/src/**/*.py")
    assert absolute.content == "src/mid.py"
    none = await run(ctx, "glob", pattern="*.rs")
    assert not none.is_error
    assert "No files found" in none.content


async def test_glob_caps_results_with_a_note(ctx: ToolContext, ws: Path) -> None:
    for i in range(GLOB_MAX_RESULTS + 5):
        (ws / f"f{i}.txt").write_text("")
    lines = (await run(ctx, "glob", pattern="*.txt")).content.splitlines()
    assert len(lines) == GLOB_MAX_RESULTS + 1
    assert lines[-1].startswith(f"(showing {GLOB_MAX_RESULTS} of {GLOB_MAX_RESULTS + 5} matches")


# ---------------------------------------------------------------------------------------------
# grep


GREP_MODES = [
    pytest.param(True, id="rg", marks=pytest.mark.skipif(not HAS_RG, reason="rg not on PATH")),
    pytest.param(False, id="python"),
]


async def grep(ctx: ToolContext, use_rg: bool, **params: Any) -> ToolResult:
    with trio.fail_after(20):
        return await call_tool(
            [GrepTool(use_rg=use_rg)], "grep", orjson.dumps(params).decode(), ctx
        )


def ignored_project(ws: Path) -> None:
    """A repository whose .gitignore files (root and nested, with negations) hide some files."""
    (ws / ".git").mkdir()
    (ws / ".gitignore").write_text("*.log\nbuild/\n!keep.log\n")
    (ws / "src" / "deep").mkdir(parents=True)
    (ws / "src" / ".gitignore").write_text("gen.py\n!special.log\n")
    (ws / "build").mkdir()
    for name in [
        "app.log",
        "keep.log",
        "build/out.txt",
        "src/main.py",
        "src/gen.py",
        "src/other.log",
        "src/special.log",
        "src/deep/gen.py",
        "src/deep/ok.txt",
    ]:
        (ws / name).write_text("needle\n")


#: What the .gitignore files above leave visible, relative to the workspace.
VISIBLE = ["keep.log", "src/deep/ok.txt", "src/main.py", "src/special.log"]


@pytest.mark.parametrize("use_rg", GREP_MODES)
async def test_gitignore_is_honoured_alike_by_ls_glob_and_grep(
    ctx: ToolContext, ws: Path, use_rg: bool
) -> None:
    ignored_project(ws)
    found = await run(ctx, "glob", pattern="**/*.{log,py,txt}")
    assert sorted(found.content.splitlines()) == VISIBLE
    searched = await grep(ctx, use_rg, pattern="needle")
    assert sorted(line.split(":")[0] for line in searched.content.splitlines()) == VISIBLE
    # From a subdirectory, the root's rules still apply (parents up to the repository root).
    sub = await grep(ctx, use_rg, pattern="needle", path="src")
    assert sorted(line.split(":")[0] for line in sub.content.splitlines()) == [
        "src/deep/ok.txt",
        "src/main.py",
        "src/special.log",
    ]
    listing = (await run(ctx, "ls", depth=3)).content
    for name in ["app.log", "build/", "gen.py", "other.log", "out.txt"]:
        assert f"- {name}" not in listing, (name, listing)
    for name in ["keep.log", "main.py", "special.log", "ok.txt", "deep/"]:
        assert f"- {name}" in listing, (name, listing)


def test_each_gitignore_is_parsed_once_until_it_changes(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pathspec

    from crush_trio.tools import grep_worker

    ignored_project(ws)
    parsed: list[int] = []
    original = pathspec.GitIgnoreSpec.from_lines

    def counting(lines: Any) -> Any:
        parsed.append(1)
        return original(lines)

    monkeypatch.setattr(pathspec.GitIgnoreSpec, "from_lines", counting)
    grep_worker._spec_cache.clear()

    def walk() -> list[str]:
        files = grep_worker.walk_files(
            ws, data_dir=ws / ".crush", skip_hidden=True, ignored={".git"}, check=lambda: None
        )
        return sorted(p.relative_to(ws).as_posix() for p in files)

    assert walk() == VISIBLE
    assert len(parsed) == 2  # the root's and src's
    assert walk() == VISIBLE
    assert len(parsed) == 2
    (ws / "src" / ".gitignore").write_text("gen.py\nspecial.log\n# changed\n")
    assert "src/special.log" not in walk()
    assert len(parsed) == 3
    unfiltered = grep_worker.walk_files(
        ws,
        data_dir=ws / ".crush",
        skip_hidden=True,
        ignored={".git"},
        check=lambda: None,
        gitignore=False,
    )
    assert len(list(unfiltered)) == 9


@pytest.mark.parametrize("use_rg", GREP_MODES)
async def test_grep_finds_lines_with_include_filter(
    ctx: ToolContext, ws: Path, use_rg: bool
) -> None:
    (ws / "src" / "sub").mkdir(parents=True)
    (ws / "src" / "a.py").write_text("import os\ndef handler_one():\n    pass\n")
    (ws / "src" / "sub" / "b.ts").write_text("function handler_two() {}\n")
    (ws / "bin.dat").write_bytes(b"handler_bin\x00\x01")
    result = await grep(ctx, use_rg, pattern=r"handler_\w+")
    assert result.content.splitlines() == [
        "src/a.py:2:def handler_one():",
        "src/sub/b.ts:1:function handler_two() {}",
    ]
    only_py = await grep(ctx, use_rg, pattern="handler", include="*.py")
    assert only_py.content == "src/a.py:2:def handler_one():"
    anchored = await grep(ctx, use_rg, pattern="handler", include="src/**/*.ts")
    assert anchored.content == "src/sub/b.ts:1:function handler_two() {}"
    in_dir = await grep(ctx, use_rg, pattern="handler", path="src/sub")
    assert in_dir.content == "src/sub/b.ts:1:function handler_two() {}"
    one_file = await grep(ctx, use_rg, pattern="os", path="src/a.py")
    assert one_file.content == "src/a.py:1:import os"
    none = await grep(ctx, use_rg, pattern="zzz_absent")
    assert not none.is_error
    assert "No matches found" in none.content


@pytest.mark.parametrize("use_rg", GREP_MODES)
async def test_grep_caps_matches_with_a_note(ctx: ToolContext, ws: Path, use_rg: bool) -> None:
    (ws / "many.txt").write_text("hit\n" * (GREP_MAX_MATCHES + 50))
    lines = (await grep(ctx, use_rg, pattern="hit")).content.splitlines()
    assert len(lines) == GREP_MAX_MATCHES + 1
    assert lines[0] == "many.txt:1:hit"
    assert lines[-1].startswith(f"(showing the first {GREP_MAX_MATCHES} matches")


@pytest.mark.parametrize("use_rg", GREP_MODES)
async def test_grep_invalid_regex_is_an_error(ctx: ToolContext, ws: Path, use_rg: bool) -> None:
    (ws / "a.txt").write_text("x\n")
    result = await grep(ctx, use_rg, pattern="(unclosed")
    assert result.is_error
    assert "grep failed" in result.content or "invalid regular expression" in result.content


@pytest.mark.skipif(not HAS_RG, reason="rg not on PATH")
async def test_grep_fallback_forced_by_environment(
    ctx: ToolContext, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Python's re has look-ahead and ripgrep's default engine does not: that tells them apart
    # (they agree on which files they search).
    (ws / "found.txt").write_text("needle\n")
    assert (await grep(ctx, True, pattern="ne(?=edle)")).is_error
    monkeypatch.setenv("CRUSH_TRIO_GREP_NO_RG", "1")
    assert (await grep(ctx, True, pattern="ne(?=edle)")).content == "found.txt:1:needle"


# ---------------------------------------------------------------------------------------------
# write


async def test_write_creates_with_parents_after_asking(
    ctx: ToolContext, asker: FakeAsker, ws: Path
) -> None:
    target = ws / "new" / "dir" / "f.txt"
    asker.watch = target
    result = await run(ctx, "write", path="new/dir/f.txt", content="hello\r\nworld")
    assert not result.is_error
    assert result.content == "Created new/dir/f.txt (12 bytes)"
    assert target.read_bytes() == b"hello\r\nworld"
    [request] = asker.requests
    assert request["action"] == "write"
    assert request["tool_name"] == "write"
    assert request["params"] == {
        "path": str(target),
        "file_path": str(target),  # the key Crush's permission dialog reads
        "content": "hello\r\nworld",
    }
    assert "Create new/dir/f.txt" in request["description"]
    assert asker.existed_at_ask == [False]
    again = await run(ctx, "write", path="new/dir/f.txt", content="bye")
    assert again.content.startswith("Overwrote")
    assert target.read_text() == "bye"


async def test_write_denied_writes_nothing_and_stops_the_turn(
    ctx: ToolContext, asker: FakeAsker, ws: Path
) -> None:
    asker.allow = False
    result = await run(ctx, "write", path="f.txt", content="x")
    assert result.is_error
    assert result.stop_turn
    assert result.content.startswith("permission denied: ")
    assert not (ws / "f.txt").exists()


async def test_write_outside_asks_once_naming_the_outside_path(
    ctx: ToolContext, asker: FakeAsker, tmp_path: Path
) -> None:
    result = await run(ctx, "write", path="../escaped.txt", content="x")
    assert not result.is_error
    [request] = asker.requests
    assert request["path"] == str(tmp_path / "escaped.txt")
    assert "outside the workspace" in request["description"]


async def test_write_to_a_directory_is_refused_before_asking(
    ctx: ToolContext, asker: FakeAsker, ws: Path
) -> None:
    (ws / "d").mkdir()
    result = await run(ctx, "write", path="d", content="x")
    assert result.is_error
    assert "is a directory" in result.content
    assert asker.requests == []


async def test_cancel_while_waiting_for_permission_writes_nothing(
    ctx: ToolContext, asker: FakeAsker, ws: Path
) -> None:
    asker.block = True
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, ctx, "write", {"path": "f.txt", "content": "x"})
            await asker.asked.wait()
            nursery.cancel_scope.cancel()
    assert not (ws / "f.txt").exists()


# ---------------------------------------------------------------------------------------------
# edit


async def test_edit_replaces_a_unique_string(ctx: ToolContext, asker: FakeAsker, ws: Path) -> None:
    (ws / "a.py").write_text("def f():\n    return 1\n")
    await run(ctx, "view", path="a.py")
    result = await run(ctx, "edit", path="a.py", old_string="return 1", new_string="return 2")
    assert not result.is_error
    assert result.content.splitlines() == [
        "Edited a.py: replaced 1 occurrence. The first change now reads:",
        "     1|def f():",
        "     2|    return 2",
    ]
    assert (ws / "a.py").read_text() == "def f():\n    return 2\n"
    [request] = asker.requests
    assert request["action"] == "write"
    assert request["tool_name"] == "edit"
    assert request["params"]["old_string"] == "return 1"


async def test_edit_errors_name_the_file_and_the_fix(
    ctx: ToolContext, asker: FakeAsker, ws: Path
) -> None:
    (ws / "a.txt").write_text("x = 1\nx = 1\n")
    await run(ctx, "view", path="a.txt")
    missing = await run(ctx, "edit", path="a.txt", old_string="y = 1", new_string="y = 2")
    assert missing.is_error
    assert missing.content == "old_string not found in a.txt; view the file and copy the exact text"
    several = await run(ctx, "edit", path="a.txt", old_string="x = 1", new_string="x = 2")
    assert several.is_error
    assert several.content == (
        "old_string appears 2 times in a.txt; add surrounding lines to make it unique or set "
        "replace_all"
    )
    same = await run(ctx, "edit", path="a.txt", old_string="x", new_string="x")
    assert same.is_error
    assert "identical" in same.content
    no_file = await run(ctx, "edit", path="nope.txt", old_string="a", new_string="b")
    assert no_file.is_error
    assert "file not found: nope.txt" in no_file.content
    exists = await run(ctx, "edit", path="a.txt", old_string="", new_string="b")
    assert exists.is_error
    assert "already exists" in exists.content
    assert asker.requests == []
    assert (ws / "a.txt").read_text() == "x = 1\nx = 1\n"
    replaced = await run(
        ctx, "edit", path="a.txt", old_string="x = 1", new_string="x = 2", replace_all=True
    )
    assert "replaced 2 occurrences" in replaced.content
    assert (ws / "a.txt").read_text() == "x = 2\nx = 2\n"


async def test_edit_with_empty_old_string_creates_a_missing_file(
    ctx: ToolContext, asker: FakeAsker, ws: Path
) -> None:
    asker.watch = ws / "pkg" / "new.py"
    result = await run(ctx, "edit", path="pkg/new.py", old_string="", new_string="x = 1\n")
    assert result.content == "Created pkg/new.py"
    assert (ws / "pkg" / "new.py").read_text() == "x = 1\n"
    assert asker.existed_at_ask == [False]


async def test_edit_matches_crlf_files(ctx: ToolContext, ws: Path) -> None:
    (ws / "w.txt").write_bytes(b"one\r\ntwo\r\nthree\r\n")
    await run(ctx, "view", path="w.txt")
    result = await run(ctx, "edit", path="w.txt", old_string="one\ntwo", new_string="1\n2")
    assert not result.is_error
    assert (ws / "w.txt").read_bytes() == b"1\r\n2\r\nthree\r\n"


async def test_edit_denied_leaves_the_file(ctx: ToolContext, asker: FakeAsker, ws: Path) -> None:
    asker.allow = False
    (ws / "a.txt").write_text("keep\n")
    await run(ctx, "view", path="a.txt")
    result = await run(ctx, "edit", path="a.txt", old_string="keep", new_string="lose")
    assert result.is_error
    assert result.stop_turn
    assert (ws / "a.txt").read_text() == "keep\n"


# ---------------------------------------------------------------------------------------------
# bash


@pytest.mark.parametrize(
    ("command", "read_only"),
    [
        ("ls -la", True),
        ("pwd", True),
        ("cat README.md", True),
        ("git status", True),
        ("git log --oneline -5", True),
        ("grep -rn foo src", True),
        ("find . -name '*.py'", True),
        ("echo hello", True),
        ("date +%s", True),
        ("git push", False),
        ("git -C /etc status", False),
        ("git diff --output=x", False),
        ("rm -rf build", False),
        ("ls; rm x", False),
        ("ls && rm x", False),
        ("cat a | sh", False),
        ("echo hi > f", False),
        ("echo `rm x`", False),
        ("echo $(rm x)", False),
        ("sleep 1 &", False),
        ("find . -delete", False),
        ("find . -exec rm {} +", False),
        ("rg --pre sh foo", False),
        ("date -s 2020-01-01", False),
        ("cat ../secret", False),
        ("cat /etc/passwd", False),
        ("ls ~", False),
        ("cat 'unclosed", False),
        ("", False),
    ],
)
def test_is_read_only(command: str, read_only: bool, tmp_path: Path) -> None:
    assert is_read_only(command, tmp_path) is read_only


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # An exited orphan stays a zombie until init reaps it, and some container inits never do;
    # a zombie runs nothing, so it counts as gone.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


async def wait_process_gone(pid: int) -> None:
    """Wait (bounded) for ``pid`` to be gone.

    A pidfd (Linux) becomes readable when its process exits, also for a process that is not our
    child, so this waits for the event rather than polling.
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        with trio.fail_after(5):
            await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)
    assert not process_alive(pid)


@pytest.mark.slow
async def test_bash_without_a_sandbox_asks_even_for_a_read_only_command(
    ctx: ToolContext, asker: FakeAsker, ws: Path
) -> None:
    # ctx has no sandbox; tests/test_sandbox.py covers the sandboxed tool.
    (ws / "hello.txt").write_text("hi there\n")
    result = await run(ctx, "bash", command="cat hello.txt")
    assert result.content == "hi there\nexit code: 0"
    assert not result.is_error
    [request] = asker.requests
    assert request["params"]["sandboxed"] is False
    assert "with no sandbox" in request["description"]


@pytest.mark.slow
async def test_bash_write_command_asks_before_running(
    ctx: ToolContext, asker: FakeAsker, ws: Path
) -> None:
    asker.watch = ws / "made"
    result = await run(ctx, "bash", command="touch made && echo done; exit 3")
    assert result.content == "done\nexit code: 3"
    assert not result.is_error
    [request] = asker.requests
    assert request["action"] == "execute"
    assert request["tool_name"] == "bash"
    assert request["params"]["command"] == "touch made && echo done; exit 3"
    assert request["path"] == str(ws)
    assert asker.existed_at_ask == [False]
    assert (ws / "made").exists()


@pytest.mark.slow
async def test_bash_denied_runs_nothing_and_stops_the_turn(
    ctx: ToolContext, asker: FakeAsker, ws: Path
) -> None:
    asker.allow = False
    result = await run(ctx, "bash", command="touch made")
    assert result.is_error
    assert result.stop_turn
    assert result.content.startswith("permission denied: ")
    assert not (ws / "made").exists()


@pytest.mark.slow
async def test_bash_merges_stderr_and_runs_in_the_workspace(ctx: ToolContext, ws: Path) -> None:
    result = await run(ctx, "bash", command="pwd; echo oops >&2")
    assert result.content == f"{ws}\noops\nexit code: 0"


@pytest.mark.slow
async def test_bash_caps_output_keeping_head_and_tail(ctx: ToolContext) -> None:
    ctx.bash_output_limit = 1000
    result = await run(ctx, "bash", command="seq 1 100000")
    assert result.content.startswith("1\n2\n3\n")
    assert result.content.endswith("99999\n100000\nexit code: 0")
    match = re.search(
        r"\[\.\.\. (\d+) bytes of output cut from the middle \.\.\.\]", result.content
    )
    assert match is not None
    total = len("".join(f"{i}\n" for i in range(1, 100001)))
    assert int(match.group(1)) == total - 1000
    assert len(result.content) < 1200


@pytest.mark.slow
async def test_bash_timeout_kills_the_whole_group(ctx: ToolContext) -> None:
    # The tool timeout (1 s) caps the longer timeout the call asks for.
    ctx.timeout = 1.0
    result = await run(ctx, "bash", command="echo $$; sleep 100 & echo $!; wait", timeout=60)
    assert result.is_error
    assert not result.stop_turn
    assert "command timed out after 1 s" in result.content
    shell_pid, sleep_pid = (int(word) for word in result.content.split()[:2])
    await wait_process_gone(shell_pid)
    await wait_process_gone(sleep_pid)


@pytest.mark.slow
async def test_bash_background_process_does_not_outlive_the_command(ctx: ToolContext) -> None:
    result = await run(ctx, "bash", command="sleep 100 & echo $!")
    assert result.content.endswith("exit code: 0")
    await wait_process_gone(int(result.content.split()[0]))


@pytest.mark.slow
async def test_bash_cancel_during_a_long_command_leaves_no_process(
    ctx: ToolContext, tmp_path: Path
) -> None:
    # The command reports its pids through a FIFO, so the test knows they exist before cancelling.
    # Opened read-write, the FIFO always has a writer, so reading blocks until the pids arrive.
    fifo = tmp_path / "pids"
    os.mkfifo(fifo)
    stream = trio.lowlevel.FdStream(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
    command = f"sleep 30 & echo $$ $! > {fifo}; wait"
    data = b""
    returned: list[ToolResult] = []

    async def call() -> None:
        returned.append(await run(ctx, "bash", command=command))

    with trio.fail_after(15):
        async with stream, trio.open_nursery() as nursery:
            nursery.start_soon(call)
            while not data.endswith(b"\n"):
                data += await stream.receive_some()
            nursery.cancel_scope.cancel()
    assert returned == [], "the cancel must propagate, not become a result"
    shell_pid, sleep_pid = (int(word) for word in data.split())
    await wait_process_gone(shell_pid)
    await wait_process_gone(sleep_pid)


@pytest.mark.slow
async def test_bash_group_ignoring_sigterm_gets_sigkill(
    ctx: ToolContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A short grace keeps the test quick; the escalation is the same at any grace.
    monkeypatch.setattr(shell_module, "KILL_GRACE", 0.2)
    ctx.timeout = 0.5
    command = "trap '' TERM; echo $$; sleep 100 & echo $!; wait"
    result = await run(ctx, "bash", command=command)
    assert "timed out" in result.content
    shell_pid, sleep_pid = (int(word) for word in result.content.split()[:2])
    await wait_process_gone(shell_pid)
    await wait_process_gone(sleep_pid)


@pytest.mark.slow
async def test_bash_empty_command_is_an_error(ctx: ToolContext) -> None:
    result = await run(ctx, "bash", command="   ")
    assert result.is_error
    assert "must not be empty" in result.content


def test_bash_tool_is_registered() -> None:
    assert isinstance(TOOLS_BY_NAME["bash"], BashTool)


# ---------------------------------------------------------------------------------------------
# The sandbox's hidden list applies to the file tools


@pytest.fixture
def home_ws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home directory holding secret stores, used as the workspace."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("PRIVATE-KEY-needle\n")
    (home / ".aws").mkdir()
    (home / ".aws" / "credentials").write_text("aws-needle\n")
    (home / ".config" / "crush-trio").mkdir(parents=True)
    (home / ".config" / "crush-trio" / "crush.json").write_text('{"api_key": "cfg-needle"}\n')
    (home / "vault").mkdir()
    (home / "vault" / "token.txt").write_text("vault-needle\n")
    (home / "server-files").mkdir()
    (home / "server-files" / "token").write_text("server-needle\n")
    (home / "notes.txt").write_text("plain-needle\n")
    monkeypatch.setenv("HOME", str(home))
    return home


async def test_file_tools_apply_the_sandboxs_hidden_list(home_ws: Path, asker: FakeAsker) -> None:
    from crush_trio.tools.hidden import HiddenPaths

    ctx = ToolContext(
        workspace=home_ws,
        data_dir=home_ws / ".crush",
        session_id="s1",
        tool_call_id="c1",
        permissions=asker,
        timeout=10.0,
        hidden=HiddenPaths(deny_read=("~/vault",), hidden=(home_ws / "server-files",)),
    )
    for path in (
        ".ssh/id_ed25519",
        "~/.aws/credentials",
        str(home_ws / ".config/crush-trio/crush.json"),
        "vault/token.txt",
        "server-files/token",
    ):
        result = await run(ctx, "view", path=path)
        assert result.is_error, path
        assert "hidden from the agent's tools" in result.content, path
        assert "needle" not in result.content
    for name, params in [
        ("grep", {"pattern": "needle", "path": ".ssh"}),
        ("grep", {"pattern": "needle", "path": "vault"}),
        ("ls", {"path": ".aws"}),
        ("glob", {"pattern": "*", "path": "server-files"}),
        ("write", {"path": ".ssh/authorized_keys", "content": "ssh-ed25519 AAAA attacker"}),
        ("edit", {"path": "vault/token.txt", "old_string": "vault", "new_string": "x"}),
    ]:
        result = await run(ctx, name, **params)
        assert result.is_error, name
        assert "hidden from the agent's tools" in result.content, name
    assert asker.requests == []  # refused before any prompt: no answer can open them
    assert not (home_ws / ".ssh" / "authorized_keys").exists()
    # Walks from the workspace skip them.
    grep = await run(ctx, "grep", pattern="needle")
    assert grep.content == "notes.txt:1:plain-needle"
    found = await run(ctx, "glob", pattern="**/*")
    assert found.content.splitlines() == ["notes.txt"]
    listing = await run(ctx, "ls")
    for name in (".ssh", ".aws", "vault", "server-files", "crush-trio"):
        assert name not in listing.content
    assert "notes.txt" in listing.content


async def test_a_workspace_holding_the_servers_config_cannot_view_it(
    crush_server: Any, scripted_model: Any
) -> None:
    from crush_trio.client import connect
    from crush_trio.providers.scripted import Step
    from crush_trio.wire import ToolResultPart

    user_config = crush_server.root / "user-config" / "crush.json"
    user_config.parent.mkdir(parents=True, exist_ok=True)
    user_config.write_text(
        '{"providers": {"p": {"type": "echo", "api_key": "user-config-needle"}}}'
    )
    scripted_model.add(
        Step(tool_calls=[("view", {"path": "user-config/crush.json"})]), Step(text="done")
    )
    with trio.fail_after(20):
        async with (
            connect(crush_server.url, crush_server.token) as client,
            client.workspace(crush_server.root) as ws,
        ):
            sid = (await ws.create_session()).id
            await ws.set_skip(True)  # even with every prompt approved
            assert (await ws.run(sid, "read the config", timeout=10)).text == "done"
            result = (await ws.messages(sid))[-2].parts[0]
    assert isinstance(result, ToolResultPart)
    assert result.is_error
    assert "hidden from the agent's tools" in result.content
    assert "needle" not in result.content
