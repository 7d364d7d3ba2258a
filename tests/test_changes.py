"""What runs change: snapshots, diffs, undo by run, forks and paged history (docs/protocol.md
"Changes" and "Paging").

The runs are real: the scripted model asks for ``bash`` commands that a real server runs in the
project directory, and the shadow snapshot store is real git. The kill -9 loop (marked slow)
runs a revert in a child process and kills it at random moments.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Final

import httpx
import orjson
import pytest
import trio

from crush_trio.changes import ChangeLog
from crush_trio.changes.shadow import MAX_FILE_BYTES
from crush_trio.client import Conflict, WorkspaceClient
from crush_trio.providers.scripted import Gate, ScriptedModel, Step
from crush_trio.wire import RunStatus

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from crush_trio.testing import CrushServer

#: Bound on each test's waits (seconds).
CAP: Final = 30.0
REPO: Final = Path(__file__).resolve().parent.parent


def tree_state(root: Path, *, skip: tuple[str, ...] = ()) -> dict[str, tuple[str, bytes, int]]:
    """Every file and link under ``root``: kind, bytes (or link target) and permission bits."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = [
            d for d in dirnames if os.path.normpath(os.path.join(rel_dir, d)) not in skip
        ]
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if rel in skip:
                continue
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                state[rel] = ("link", os.readlink(path).encode(), 0)
            else:
                state[rel] = ("file", Path(path).read_bytes(), stat.S_IMODE(st.st_mode))
    return state


def bash(command: str) -> Step:
    return Step(tool_calls=[("bash", {"command": command})])


async def run_bash(model: ScriptedModel, ws: WorkspaceClient, session_id: str, command: str) -> str:
    """One run whose turn runs ``command`` with bash; its run id."""
    model.add(bash(command), Step("done"))
    run = await ws.run(session_id, "change files", auto_approve=True, timeout=CAP)
    assert run.status is RunStatus.COMPLETED, run
    return run.run_id


@pytest.fixture
async def http(crush_server: CrushServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        base_url=crush_server.url,
        headers={"Authorization": f"Bearer {crush_server.token}"},
        timeout=CAP,
    ) as client:
        yield client


def seed(root: Path) -> None:
    (root / "keep.txt").write_text("unchanged\n")
    (root / "edit.txt").write_text("one\ntwo\nthree\n")
    (root / "gone.txt").write_text("to be deleted\n")
    (root / "tool.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(root / "tool.sh", 0o755)
    (root / "lib").mkdir()
    (root / "lib" / "old.bin").write_bytes(bytes(range(256)) * 4)


async def test_a_runs_diff_lists_every_change_and_revert_restores_the_tree_byte_for_byte(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    ws = crush_workspace
    root = Path(ws.path)
    seed(root)
    before = tree_state(root)
    session = await ws.create_session()
    command = (
        "printf 'one\\nTWO\\nthree\\nfour\\n' > edit.txt && rm gone.txt && "
        "mkdir -p new/deep && printf 'fresh\\n' > new/deep/made.txt && "
        "printf '\\000\\001\\002\\377' > new/blob.bin && chmod 644 tool.sh && "
        "printf 'x' >> lib/old.bin && chmod 755 keep.txt"
    )
    with trio.fail_after(CAP):
        run_id = await run_bash(scripted_model, ws, session.id, command)
        diff = await ws.run_diff(run_id)
        run = await ws.get_run(run_id)
    after = tree_state(root)
    assert after != before
    by_path = {f.path: f for f in diff.files}
    assert set(by_path) == {
        "edit.txt",
        "gone.txt",
        "new/deep/made.txt",
        "new/blob.bin",
        "tool.sh",
        "lib/old.bin",
        "keep.txt",
    }
    assert by_path["edit.txt"].status == "modified"
    assert (by_path["edit.txt"].added, by_path["edit.txt"].removed) == (2, 1)
    assert by_path["gone.txt"].status == "deleted"
    assert by_path["new/deep/made.txt"].status == "added"
    assert by_path["new/blob.bin"].binary
    assert by_path["lib/old.bin"].binary
    assert "Binary files" in diff.diff
    assert "\x00" not in diff.diff
    assert "+TWO" in diff.diff
    assert "-two" in diff.diff
    assert "old mode 100755" in diff.diff
    assert "new mode 100644" in diff.diff
    assert not diff.truncated
    assert {f.path for f in run.files} == set(by_path)  # the run record's summary

    with trio.fail_after(CAP):
        result = await ws.revert_run(run_id)
    assert result.state == "done"
    assert {f.path for f in result.files} == set(by_path)
    assert all(f.outcome == "new" for f in result.files)
    assert tree_state(root) == before
    assert not (root / "new").exists()  # directories the run made are gone with their files

    # The revert is recorded and can be reverted in turn: back to the run's result.
    with trio.fail_after(CAP):
        undo = await ws.revert_run(result.revert_id)
        revert_diff = await ws.run_diff(result.revert_id)
    assert undo.state == "done"
    assert {f.path for f in revert_diff.files} == set(by_path)
    assert tree_state(root) == after


async def test_reverting_the_first_of_two_runs_keeps_the_seconds_changes(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    root = Path(ws.path)
    (root / "a.txt").write_text("a0\n")
    (root / "b.txt").write_text("b0\n")
    session = await ws.create_session()
    with trio.fail_after(CAP):
        first = await run_bash(scripted_model, ws, session.id, "echo a1 > a.txt && echo c > c.txt")
        second = await run_bash(scripted_model, ws, session.id, "echo b1 > b.txt")
        result = await ws.revert_run(first)
        session_diff = await ws.session_diff(session.id)
    assert result.state == "done"
    assert (root / "a.txt").read_text() == "a0\n"
    assert not (root / "c.txt").exists()
    assert (root / "b.txt").read_text() == "b1\n"  # the second run's change stays
    assert second != first
    # The session's diff covers its runs and the revert: only b.txt differs in the end.
    assert [f.path for f in session_diff.files] == ["b.txt"]


async def test_a_file_changed_after_the_run_is_a_409_naming_it_until_forced(
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    http: httpx.AsyncClient,
) -> None:
    ws = crush_workspace
    root = Path(ws.path)
    (root / "a.txt").write_text("a0\n")
    (root / "b.txt").write_text("b0\n")
    session = await ws.create_session()
    with trio.fail_after(CAP):
        run_id = await run_bash(scripted_model, ws, session.id, "echo a1 > a.txt; echo b1 > b.txt")
    (root / "a.txt").write_text("the user's edit\n")
    url = f"/v1/workspaces/{ws.id}/runs/{run_id}/revert"
    with trio.fail_after(CAP):
        refused = await http.post(url, json={})
    assert refused.status_code == 409, refused.text
    assert refused.json()["files"] == ["a.txt"]
    assert "a.txt" in refused.json()["message"]
    assert "force" in refused.json()["message"]
    assert (root / "a.txt").read_text() == "the user's edit\n"  # nothing was touched
    assert (root / "b.txt").read_text() == "b1\n"
    with trio.fail_after(CAP), pytest.raises(Conflict, match=r"a\.txt"):
        await ws.revert_run(run_id)
    with trio.fail_after(CAP):
        forced = await ws.revert_run(run_id, force=True)
    assert forced.state == "done"
    assert forced.forced
    assert forced.conflicts == ["a.txt"]
    assert (root / "a.txt").read_text() == "a0\n"
    assert (root / "b.txt").read_text() == "b0\n"
    with trio.fail_after(CAP):
        record = (await http.get(f"/v1/workspaces/{ws.id}/reverts/{forced.revert_id}")).json()
    assert record["state"] == "done"
    assert record["run_id"] == run_id


async def test_revert_is_refused_while_a_run_is_active_in_the_session(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    gate = Gate()
    with trio.fail_after(CAP):
        done = await run_bash(scripted_model, ws, session.id, "echo x > x.txt")
        scripted_model.add(Step("slow", gate_before=gate))
        handle = await ws.prompt(session.id, "hold")
        await gate.reached.wait()
        with pytest.raises(Conflict, match="run in progress"):
            await ws.revert_run(done)
        with pytest.raises(Conflict, match="still"):
            await ws.revert_run(handle.run_id)
        gate.release()
        await handle.result(CAP)
        assert (await ws.revert_run(done)).state == "done"
    assert not (Path(ws.path) / "x.txt").exists()


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(cwd)}
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout


def git_state(root: Path) -> dict[str, str]:
    """Hashes of the user's index, HEAD and every ref file."""
    result = {}
    dot = root / ".git"
    for path in [dot / "index", dot / "HEAD", dot / "packed-refs", *sorted(dot.glob("refs/**/*"))]:
        if path.is_file():
            result[str(path.relative_to(dot))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return result


async def test_ignored_and_oversized_files_are_not_snapshotted_and_the_users_git_is_untouched(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel, crush_server: CrushServer
) -> None:
    ws = crush_workspace
    root = Path(ws.path)
    git(root, "init", "-q")
    (root / ".gitignore").write_text("*.log\nbuild/\n")
    (root / "tracked.txt").write_text("v1\n")
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    (root / "staged.txt").write_text("staged\n")
    git(root, "add", "staged.txt")
    before = git_state(root)
    session = await ws.create_session()
    big = MAX_FILE_BYTES + 1
    command = (
        f"echo v2 > tracked.txt && echo noise > run.log && mkdir -p build && echo o > build/o.txt"
        f" && head -c {big} /dev/zero > huge.bin && echo small > small.txt"
    )
    with trio.fail_after(CAP):
        run_id = await run_bash(scripted_model, ws, session.id, command)
        diff = await ws.run_diff(run_id)
    assert sorted(f.path for f in diff.files) == ["small.txt", "tracked.txt"]
    changes = crush_server.backend.get(ws.id).changes
    record = await changes.record(run_id)
    listed = changes.repo.git("ls-tree", "-r", "--name-only", record.after).decode().split()
    assert "huge.bin" not in listed
    assert "run.log" not in listed
    assert "build/o.txt" not in listed
    assert not any(p.startswith(".git/") for p in listed)
    with trio.fail_after(CAP):
        await ws.revert_run(run_id)
    assert (root / "tracked.txt").read_text() == "v1\n"
    assert not (root / "small.txt").exists()
    assert (root / "huge.bin").stat().st_size == big  # never snapshotted: left alone
    assert (root / "run.log").exists()
    assert git_state(root) == before
    assert git(root, "diff", "--cached", "--name-only") == "staged.txt\n"


async def test_files_changed_event_names_the_files_of_a_tool_call(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    scripted_model.add(bash("echo 1 > one.txt"), bash("ls"), Step("done"))
    with trio.fail_after(CAP):
        async with ws.subscribe(timeout=CAP) as sub:
            handle = await ws.prompt(session.id, "write", auto_approve=True)
            event = await sub.until(lambda e: e.type == "files_changed")
            await handle.result(CAP)
    assert event.payload.run_id == handle.run_id
    assert [(f.path, f.status, f.added) for f in event.payload.files] == [("one.txt", "added", 1)]
    assert event.payload.tool_name == "bash"


async def test_fork_copies_the_history_up_to_the_message_and_can_revert_later_runs(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    root = Path(ws.path)
    session = await ws.create_session("work")
    with trio.fail_after(CAP):
        first = await run_bash(scripted_model, ws, session.id, "echo 1 > one.txt")
        await run_bash(scripted_model, ws, session.id, "echo 2 > two.txt")
        messages = await ws.messages(session.id)
        first_run = await ws.get_run(first)
        cut = next(i for i, m in enumerate(messages) if m.id == first_run.message_id)
        plain = await ws.fork_session(session.id, first_run.message_id)
    assert plain.session.parent_session_id == session.id
    assert plain.messages == cut + 1
    with trio.fail_after(CAP):
        copied = await ws.messages(plain.session.id)
    assert [(m.role, m.parts) for m in copied] == [(m.role, m.parts) for m in messages[: cut + 1]]
    assert (root / "two.txt").exists()  # files were not touched
    with trio.fail_after(CAP):
        reverted = await ws.fork_session(session.id, first_run.message_id, revert_files=True)
    assert [r.run_id for r in reverted.reverts] != []
    assert (root / "one.txt").exists()
    assert not (root / "two.txt").exists()
    with trio.fail_after(CAP), pytest.raises(Exception, match="not in session"):
        await ws.fork_session(session.id, "no-such-message")


async def test_paging_returns_every_item_once_while_new_items_arrive(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    ws = crush_workspace
    with trio.fail_after(CAP):
        made = [(await ws.create_session(f"s{i}")).id for i in range(23)]
        seen: list[str] = []
        before = None
        while True:
            page = await ws.sessions_page(limit=5, before=before)
            if not page:
                break
            seen += [s.id for s in page]
            before = page[-1].id
            made.append((await ws.create_session("arrived meanwhile")).id)  # lands on page one
        assert len(seen) == len(set(seen))
        assert set(made[:23]) <= set(seen)
        found = await ws.sessions_page(limit=50, query="S1")
        assert {s.title for s in found} == {"s1"} | {f"s1{i}" for i in range(10)}

        # Messages: page forward with ``after`` while runs add messages at the end.
        session = await ws.create_session()
        for i in range(3):
            await ws.run(session.id, f"hello {i}", timeout=CAP)
        got: list[str] = []
        after = None
        for i in range(20):
            page_m = await ws.messages_page(session.id, limit=2, after=after)
            if not page_m:
                break
            got += [m.id for m in page_m]
            after = page_m[-1].id
            if i < 2:
                await ws.run(session.id, f"more {i}", timeout=CAP)
        every = [m.id for m in await ws.messages(session.id)]
        assert got == every  # each once, in order, the new ones included
        back = await ws.messages_page(session.id, limit=3, before=every[-1])
        assert [m.id for m in back] == every[-4:-1]

        # Runs: newest first, filtered, cursor by run id.
        runs = await ws.runs(session_id=session.id, limit=2)
        older = await ws.runs(session_id=session.id, limit=10, before=runs[-1].run_id)
        all_ids = [r.run_id for r in runs + older]
        assert len(all_ids) == 5 == len(set(all_ids))
        assert await ws.runs(status=["failed"], session_id=session.id) == []
        export = await ws.export_session(session.id)
        assert [m["id"] for m in export["messages"]] == every


async def test_bad_paging_parameters_are_400_naming_them(
    crush_workspace: WorkspaceClient, http: httpx.AsyncClient
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    base = f"/v1/workspaces/{ws.id}"
    with trio.fail_after(CAP):
        for url, words in [
            (f"{base}/sessions?limit=0", "limit"),
            (f"{base}/sessions?before=nope", "nope"),
            (f"{base}/runs?status=bogus", "bogus"),
            (f"{base}/sessions/{session.id}/messages?before=a&after=b", "not both"),
            (f"{base}/sessions/{session.id}/export?format=pdf", "pdf"),
        ]:
            answer = await http.get(url)
            assert answer.status_code == 400, (url, answer.text)
            assert words in answer.json()["message"]
        md = await http.get(f"{base}/sessions/{session.id}/export?format=markdown")
    assert md.status_code == 200
    assert md.headers["content-type"].startswith("text/markdown")


# ---------------------------------------------------------------------------------------------
# kill -9 during a revert

_CHILD: Final = """
import sys, trio
from pathlib import Path
from crush_trio.changes import ChangeLog

async def main():
    log = ChangeLog(Path(sys.argv[1]), Path(sys.argv[2]))
    await log.open()
    print("reverting", flush=True)
    await log.revert(sys.argv[3])
    print("reverted", flush=True)

trio.run(main)
"""


@pytest.mark.slow
async def test_kill_9_during_a_revert_leaves_each_file_old_or_new_and_says_which(
    tmp_path: Path,
) -> None:
    """A child process reverts a run of 150 files and is killed at a random moment; the next
    open finds each file whole (old or new) and records which."""
    rng = random.Random(29)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    outcomes: set[str] = set()
    for round_ in range(6):
        root = tmp_path / f"ws{round_}"
        data = tmp_path / f"data{round_}"
        root.mkdir()
        old = {f"f{i:03}.txt": (f"old {i}\n" * 2000).encode() for i in range(150)}
        new = {name: body.replace(b"old", b"new") for name, body in old.items()}
        for name, body in old.items():
            (root / name).write_bytes(body)
        log = ChangeLog(root, data)
        with trio.fail_after(CAP):
            await log.open()
            await log.begin_run("s", ["run"])
            await log.before_tool("s", "write")  # the run's writes come from a tool call
            for name, body in new.items():
                (root / name).write_bytes(body)
            await log.end_run("s", ["run"])
        child = await trio.lowlevel.open_process(
            [sys.executable, "-c", _CHILD, str(root), str(data), "run"],
            env=env,
            stdout=subprocess.PIPE,
        )
        assert child.stdout is not None
        with trio.fail_after(CAP):
            said = b""
            while not said.endswith(b"\n"):
                chunk = await child.stdout.receive_some()
                assert chunk, "the child ended before it started the revert"
                said += chunk
        assert said == b"reverting\n"
        await trio.sleep(rng.uniform(0.0, 0.6))  # a random moment of the revert
        child.send_signal(signal.SIGKILL)
        with trio.fail_after(CAP):
            await child.wait()
        await child.stdout.aclose()

        reopened = ChangeLog(root, data)
        with trio.fail_after(CAP):
            recovered = await reopened.open()
        leftovers = [p.name for p in root.iterdir() if p.name.startswith(".crush-revert-")]
        assert leftovers == []
        journals = list((data / "snapshots" / "reverts").glob("*.json"))
        for name in old:
            assert (root / name).read_bytes() in (old[name], new[name]), name
        if not journals:
            assert all((root / n).read_bytes() == new[n] for n in new)  # not started
            outcomes.add("not started")
            continue
        (journal_path,) = journals
        journal = orjson.loads(journal_path.read_bytes())
        assert journal["state"] in ("done", "interrupted")
        outcomes.add(journal["state"])
        by_path = {f["path"]: f["outcome"] for f in journal["files"]}
        for name in old:
            have = (root / name).read_bytes()
            assert by_path[name] == ("new" if have == old[name] else "old"), name
        if journal["state"] == "interrupted":
            assert [r.revert_id for r in recovered] == [journal["revert_id"]]
            # The interrupted revert is recorded and can itself be reverted.
            with trio.fail_after(CAP):
                await reopened.revert(journal["revert_id"])
            assert all((root / n).read_bytes() == new[n] for n in new)
    assert outcomes  # at least one round ran


def test_shadow_snapshot_sees_a_nested_repository_as_nothing(tmp_path: Path) -> None:
    """A nested repository is left out (never added as a gitlink or walked)."""
    from crush_trio.changes.shadow import ShadowRepo

    root = tmp_path / "ws"
    (root / "inner").mkdir(parents=True)
    git(root / "inner", "init", "-q")
    (root / "inner" / "x.txt").write_text("x")
    (root / "top.txt").write_text("t")
    repo = ShadowRepo(root, tmp_path / "shadow")
    repo.init()
    tree = repo.snapshot()
    assert repo.git("ls-tree", "-r", "--name-only", tree).decode().split() == ["top.txt"]
    assert repo.snapshot() == tree  # no change: same tree
    shutil.rmtree(root / "inner")
    assert repo.snapshot() == tree


async def test_odd_names_and_ids_neither_break_a_record_nor_leave_the_data_directory(
    tmp_path: Path,
) -> None:
    """A file name that is not UTF-8, a symbolic link, and a client's run id that looks like a
    path: the diff names them (undecodable bytes as U+FFFD), the revert restores them, and no
    file is written outside the data directory."""
    root, data = tmp_path / "ws", tmp_path / "data"
    root.mkdir()
    odd = os.fsdecode(b"caf\xe9.txt")
    (root / odd).write_text("v1\n")
    log = ChangeLog(root, data)
    run_id = "../../escape\nme"
    with trio.fail_after(CAP):
        await log.open()
        await log.begin_run("s/../x", [run_id])
        await log.before_tool("s/../x", "bash")
        (root / odd).write_text("v2\n")
        os.symlink("target-elsewhere", root / "link")
        await log.end_run("s/../x", [run_id])
        diff = await log.run_diff(run_id)
        assert sorted(f.path for f in diff.files) == ["caf\ufffd.txt", "link"]
        orjson.dumps([f.path for f in diff.files])  # JSON can carry them
        session = await log.session_diff("s/../x")
        assert len(session.files) == 2
        result = await log.revert(run_id)
    assert result.state == "done"
    assert (root / odd).read_text() == "v1\n"
    assert not (root / "link").is_symlink()
    assert not (tmp_path / "escape\nme.json").exists()
    assert {p.parent.name for p in data.rglob("*.json")} <= {"records", "reverts"}


async def test_a_revert_never_writes_through_a_directory_replaced_by_a_link(
    tmp_path: Path,
) -> None:
    root, data, outside = tmp_path / "ws", tmp_path / "data", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "sub" / "f.txt").write_text("v1\n")
    log = ChangeLog(root, data)
    with trio.fail_after(CAP):
        await log.open()
        await log.begin_run("s", ["r"])
        await log.before_tool("s", "edit")
        (root / "sub" / "f.txt").write_text("v2\n")
        await log.end_run("s", ["r"])
    shutil.rmtree(root / "sub")
    os.symlink(outside, root / "sub")  # the directory is now a link out of the workspace
    with trio.fail_after(CAP):
        result = await log.revert("r", force=True)
    assert result.state == "failed"
    assert "not a directory" in result.error
    assert [f.outcome for f in result.files] == ["old"]
    assert list(outside.iterdir()) == []


async def test_a_fork_past_the_summary_points_at_its_own_copy_of_it(
    crush_workspace: WorkspaceClient,
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    with trio.fail_after(CAP):
        await ws.run(session.id, "hello", timeout=CAP)
        summarized = await ws.summarize(session.id)
        assert summarized.summary_message_id is not None
        last = (await ws.messages(session.id))[-1]
        fork = await ws.fork_session(session.id, last.id)
        copied = await ws.messages(fork.session.id)
    assert fork.session.summary_message_id not in (None, summarized.summary_message_id)
    assert fork.session.summary_message_id in {m.id for m in copied}
    assert [m.is_summary_message for m in copied] == [
        m.is_summary_message for m in await ws.messages(session.id)
    ]


async def test_a_cancelled_run_still_records_what_it_changed(
    crush_workspace: WorkspaceClient, scripted_model: ScriptedModel
) -> None:
    """Cancelled between two model steps (after a tool call changed a file): the run's end
    snapshot is still taken, so its diff and revert work."""
    ws = crush_workspace
    session = await ws.create_session()
    gate = Gate()
    scripted_model.add(bash("echo 1 > one.txt"), Step("never", gate_before=gate))
    with trio.fail_after(CAP):
        handle = await ws.prompt(session.id, "write then wait", auto_approve=True)
        await gate.reached.wait()
        await handle.cancel()
        run = await handle.result(CAP, check=False)
        assert run.status is RunStatus.CANCELLED
        diff = await ws.run_diff(run.run_id)
        assert [f.path for f in diff.files] == ["one.txt"]
        assert [f.path for f in (await ws.get_run(run.run_id)).files] == ["one.txt"]
        await ws.revert_run(run.run_id)
    assert not (Path(ws.path) / "one.txt").exists()
    gate.release()


async def test_a_call_that_wrote_nothing_takes_no_snapshot() -> None:
    """A prompt-free ``bash`` command ran with the workspace read-only (its result says
    ``wrote_nothing``): the tracked toolbox skips the snapshot after it, and takes one after any
    other call."""
    from crush_trio.changes.tracking import TrackedTools
    from crush_trio.tools import ToolResult

    snapshots: list[str] = []

    class Inner:
        async def call(self, name: str, input_json: str, **kw: object) -> ToolResult:
            return ToolResult(content="ok", wrote_nothing=name == "read-only bash")

    class Log:
        async def before_tool(self, session_id: str, tool_name: str) -> None:
            pass

        async def after_tool(self, session_id: str, tool_call_id: str, tool_name: str) -> None:
            snapshots.append(tool_name)

    tracked = TrackedTools(Inner(), Log())  # type: ignore[arg-type]
    await tracked.call("read-only bash", "{}", session_id="s", tool_call_id="c1", run_id="r")
    await tracked.call("bash", "{}", session_id="s", tool_call_id="c2", run_id="r")
    assert snapshots == ["bash"]
