"""``crush-trio run`` as a subprocess, against a real server in the test's trio run.

The server is the plugin's ``crush_server`` (scripted model), so a test decides what the model
says and holds a run at a gate while it drops the CLI's stream, publishes foreign events or sends
SIGINT. Every wait is bounded with ``trio.fail_after`` around the process's output.
"""

from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import subprocess
import sys
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import orjson
import pytest
import trio

from crush_trio.client import Client, RunStatus, WorkspaceClient, connect
from crush_trio.errors import ProviderError
from crush_trio.providers.scripted import Gate, ScriptedModel, Step
from crush_trio.run_cmd import UsageError, add_run_parser, build_options
from crush_trio.wire import AgentEvent, BinaryPart, EventKind

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from crush_trio.testing import CrushServer

pytestmark = pytest.mark.slow

#: Cap on one CLI process, start-up included (seconds).
CAP = 60


def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRUSH_TRIO_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")  # no user config leaks in
    env["PYTHONUNBUFFERED"] = "1"
    return env


@attrs.define
class Cli:
    """A running ``crush-trio run`` process with its output collected as it arrives."""

    process: trio.Process
    stdout: bytes = b""
    stderr: bytes = b""
    changed: trio.Event = attrs.field(factory=trio.Event)
    code: int | None = None

    @property
    def out(self) -> str:
        return self.stdout.decode()

    @property
    def err(self) -> str:
        return self.stderr.decode()

    async def output_contains(self, text: str, *, stream: str = "stdout") -> None:
        while text.encode() not in getattr(self, stream):
            if self.code is not None:
                raise AssertionError(f"process exited {self.code} before printing {text!r}")
            self.changed = trio.Event()
            await self.changed.wait()

    def send_signal(self, sig: int) -> None:
        self.process.send_signal(sig)


@asynccontextmanager
async def cli(
    *args: str, tmp_path: Path, server: CrushServer | None, cwd: Path | None = None
) -> AsyncIterator[Cli]:
    """Start ``crush-trio run ARGS``; the block ends once the process has exited."""
    cmd = [sys.executable, "-m", "crush_trio", "run"]
    if server is not None:
        cmd += ["--server", server.url, "--token", server.token]
    cmd += list(args)
    with trio.fail_after(CAP):
        process = await trio.lowlevel.open_process(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=cli_env(tmp_path),
            cwd=str(cwd or tmp_path),
        )
        running = Cli(process)

        async def pump(stream: Any, name: str) -> None:
            async for chunk in stream:
                setattr(running, name, getattr(running, name) + chunk)
                running.changed.set()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, process.stdout, "stdout")
                nursery.start_soon(pump, process.stderr, "stderr")
                yield running
            running.code = await process.wait()
            running.changed.set()
        finally:
            if process.returncode is None:
                process.kill()
                with trio.move_on_after(5, shield=True):
                    await process.wait()


async def run_cli(
    *args: str, tmp_path: Path, server: CrushServer | None, cwd: Path | None = None
) -> Cli:
    async with cli(*args, tmp_path=tmp_path, server=server, cwd=cwd) as running:
        pass
    return running


def session_line(err: str) -> str:
    return next(line for line in err.splitlines() if line.startswith("session: "))[9:]


# ---------------------------------------------------------------------------------------------
# Output and exit codes


async def test_prints_the_reply_exactly(
    crush_server: CrushServer, scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    project = crush_server.project()
    reply = "Hello from the model.\nSecond line, with  two spaces."
    scripted_model.add(Step(reply))
    done = await run_cli("say", "hello", tmp_path=tmp_path, server=crush_server, cwd=project)
    assert (done.code, done.out) == (0, reply + "\n"), done.err
    uuid.UUID(session_line(done.err))
    assert scripted_model.requests[-1].messages[-1].text() == "say hello"


async def test_diff_prints_the_files_and_the_diff_of_the_run(
    crush_server: CrushServer, scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    project = crush_server.project()
    (project / "a.txt").write_text("old\n")
    scripted_model.add(
        Step(tool_calls=[("bash", {"command": "echo new > a.txt && echo b > b.txt"})]),
        Step("changed"),
    )
    done = await run_cli(
        "--yolo", "--diff", "change", tmp_path=tmp_path, server=crush_server, cwd=project
    )
    assert done.code == 0, done.err
    assert done.out.startswith("changed\n")
    assert "-old\n+new\n" in done.out
    assert "+++ b/b.txt" in done.out
    assert "files changed: 2" in done.err
    assert "modified a.txt (+1 -1)" in done.err
    assert "added    b.txt (+1 -0)" in done.err


async def test_attach_sends_files_with_the_prompt_to_the_model(
    crush_server: CrushServer, scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    project = crush_server.project()
    png = b"\x89PNG\r\n\x1a\n not really a picture"
    (project / "shot.png").write_bytes(png)
    (project / "notes.md").write_text("# notes\n")
    scripted_model.add(Step("seen"))
    done = await run_cli(
        "--attach",
        "shot.png",
        "--attach",
        "notes.md",
        "what is this?",
        tmp_path=tmp_path,
        server=crush_server,
        cwd=project,
    )
    assert (done.code, done.out) == (0, "seen\n"), done.err
    sent = scripted_model.requests[-1].messages[-1]
    assert sent.text() == "what is this?"
    files = [p for p in sent.parts if isinstance(p, BinaryPart)]
    assert [(p.path, p.mime_type, p.content()) for p in files] == [
        ("shot.png", "image/png", png),
        ("notes.md", "text/markdown", b"# notes\n"),
    ]
    missing = await run_cli(
        "--attach", "nope.png", "x", tmp_path=tmp_path, server=crush_server, cwd=project
    )
    assert missing.code == 2
    assert "--attach nope.png: cannot read it" in missing.err
    (project / "big.txt").write_bytes(b"x" * (2 * 1024 * 1024 + 1))
    big = await run_cli(
        "--attach", "big.txt", "x", tmp_path=tmp_path, server=crush_server, cwd=project
    )
    assert big.code == 1, big.err
    assert "server.max_attachment_bytes" in big.err, big.err


async def test_provider_failure_exits_1_with_the_message(
    crush_server: CrushServer, scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    scripted_model.add(Step("partial", error=ProviderError("the provider is down")))
    done = await run_cli("x", tmp_path=tmp_path, server=crush_server, cwd=crush_server.project())
    assert done.code == 1
    assert "agent run failed: the provider is down" in done.err
    assert done.out == "partial\n"


async def test_json_lines_end_with_the_run_record(
    crush_server: CrushServer, scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    reply = "json reply, in a few paced words"
    scripted_model.add(Step(reply, token_delay=0.05))
    done = await run_cli(
        "--format", "json", "q", tmp_path=tmp_path, server=crush_server, cwd=crush_server.project()
    )
    assert done.code == 0, done.err
    lines = [orjson.loads(line) for line in done.out.splitlines()]
    record = lines[-1]
    assert record["status"] == "completed"
    assert record["text"] == reply
    events = lines[:-1]
    assert all({"seq", "type", "payload"} <= set(e) for e in events)
    assert events[-1]["type"] == "run_complete"
    assert events[-1]["payload"]["payload"]["run_id"] == record["run_id"]
    # The reply streams as message_delta events (the command asks for deltas=1).
    assert {e["type"] for e in events} == {"message", "message_delta", "run_complete"}
    deltas = [e["payload"]["payload"] for e in events if e["type"] == "message_delta"]
    assert all(d["text"] in reply and "parts" not in d for d in deltas)
    uuid.UUID(record["run_id"])


async def test_text_streams_from_deltas_while_the_run_is_parked(
    crush_server: CrushServer, scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    gate = Gate()
    reply = "first half of it, then the second half"
    scripted_model.add(Step(reply, gate_mid=gate))
    project = crush_server.project()
    async with cli("q", tmp_path=tmp_path, server=crush_server, cwd=project) as running:
        await running.output_contains("first half of it,")
        assert "second" not in running.out
        gate.release()
    assert running.code == 0, running.err
    assert running.out == reply + "\n"


async def test_unreachable_server_or_bad_token_exits_3(
    crush_server: CrushServer, tmp_path: Path
) -> None:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()
    done = await run_cli(
        "--server", f"http://127.0.0.1:{port}", "hi", tmp_path=tmp_path, server=None
    )
    assert done.code == 3
    assert "cannot reach" in done.err
    done = await run_cli(
        "--server", crush_server.url, "--token", "wrong", "hi", tmp_path=tmp_path, server=None
    )
    assert done.code == 3
    assert "token" in done.err


async def test_usage_errors_exit_2(crush_server: CrushServer, tmp_path: Path) -> None:
    done = await run_cli(tmp_path=tmp_path, server=crush_server)
    assert done.code == 2
    assert "no prompt" in done.err
    done = await run_cli(
        "-s",
        "no-such-session",
        "hi",
        tmp_path=tmp_path,
        server=crush_server,
        cwd=crush_server.project(),
    )
    assert done.code == 2
    assert "no session id starts with" in done.err
    assert "crush-trio sessions" in done.err  # says how to list them
    project = crush_server.project()
    done = await run_cli(
        "-m", "nope/none", "hi", tmp_path=tmp_path, server=crush_server, cwd=project
    )
    assert done.code == 2
    assert "names no configured model" in done.err
    assert "model: model" not in done.err, done.err
    async with connect(crush_server.url, crush_server.token) as client:
        async with client.workspace(project) as ws:
            assert await ws.sessions() == [], "a refused --model leaves no empty session behind"
    done = await run_cli("--json", "hi", tmp_path=tmp_path, server=crush_server)
    assert done.code == 2
    assert "unknown flag --json; did you mean --format json?" in done.err
    assert done.err.startswith("usage: crush-trio run"), done.err


async def test_failed_run_without_output_prints_nothing_to_stdout(
    crush_server: CrushServer, scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    scripted_model.add(Step(error=ProviderError("the provider is down")))
    done = await run_cli("x", tmp_path=tmp_path, server=crush_server, cwd=crush_server.project())
    assert done.code == 1
    assert "the provider is down" in done.err
    assert done.out == ""


async def test_sessions_lists_the_workspace_newest_first(
    crush_server: CrushServer, scripted_model: ScriptedModel, tmp_path: Path
) -> None:
    scripted_model.add(Step("one"))
    project = crush_server.project()
    first = await run_cli("first", tmp_path=tmp_path, server=crush_server, cwd=project)
    sid = session_line(first.err)
    with trio.fail_after(CAP):
        listed = await trio.run_process(
            [
                *(sys.executable, "-m", "crush_trio", "sessions", "--format", "json"),
                *("--server", crush_server.url, "--token", crush_server.token),
            ],
            cwd=project,
            env=cli_env(tmp_path),
            capture_stdout=True,
            capture_stderr=True,
        )
    rows = [orjson.loads(line) for line in listed.stdout.decode().splitlines()]
    assert [row["id"] for row in rows][:1] == [sid]
    assert rows[0]["message_count"] == 2
    with trio.fail_after(CAP):
        text = await trio.run_process(
            [
                *(sys.executable, "-m", "crush_trio", "sessions"),
                *("--server", crush_server.url, "--token", crush_server.token),
            ],
            cwd=project,
            env=cli_env(tmp_path),
            capture_stdout=True,
        )
    assert text.stdout.decode().splitlines()[0].startswith(f"{sid}  ")


def test_help_reads_as_a_manual() -> None:
    from crush_trio.cli import build_parser

    parser = build_parser()
    top = parser.format_help()
    for developer_word in ("PROTOCOL", "argparse", "``", "positional arguments:\n  {"):
        assert developer_word not in top, developer_word
    for command in ("serve", "run", "sessions", "trust"):
        assert f"crush-trio {command}" in top
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])


def test_serve_help_names_its_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from crush_trio.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 127.0.0.1)" in text
    assert "(default: 7433)" in text


def test_busy_port_names_the_port_and_the_flag(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "crush_trio", "serve", "--port", str(port)],
            env=cli_env(tmp_path),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=CAP,
            check=False,
        )
    assert done.returncode == 1
    assert f"127.0.0.1:{port}" in done.stderr, done.stderr
    assert "--port" in done.stderr, done.stderr


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_run_parser(parser.add_subparsers())
    return parser.parse_args(["run", *argv])


class _Stdin:
    def __init__(self, text: str, tty: bool = False) -> None:
        self.text, self.tty = text, tty

    def isatty(self) -> bool:
        return self.tty

    def read(self) -> str:
        return self.text


def test_build_options_validates_flags_and_assembles_the_prompt(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    opts = build_options(_parse("fix", "it"), _Stdin("error log\n"), env)
    assert opts.prompt == "error log\n\nfix it"
    assert opts.server is None
    assert build_options(_parse("x"), _Stdin("ignored", tty=True), env).prompt == "x"
    assert build_options(_parse(), _Stdin("only stdin\n"), env).prompt == "only stdin"
    opts = build_options(
        _parse("x"), None, {"CRUSH_TRIO_SERVER": "http://h:1", "CRUSH_TRIO_TOKEN": "t"}
    )
    assert (opts.server, opts.token) == ("http://h:1", "t")
    assert build_options(_parse("x"), None, {"CRUSH_TRIO_TOKEN": "t"}).token is None
    bad = [
        ([], "no prompt"),
        (["-s", "a", "-C", "x"], "--session and --continue"),
        (["-m", "justmodel", "x"], "provider/model"),
        (["--timeout", "0", "x"], "positive"),
        (["--token", "t", "x"], "--token needs --server"),
        (["--server", "localhost:7433", "x"], "not an http"),
        (["--workspace", str(tmp_path / "missing"), "x"], "not a directory"),
    ]
    for argv, message in bad:
        with pytest.raises(UsageError, match=message):
            build_options(_parse(*argv), _Stdin(""), env)


# ---------------------------------------------------------------------------------------------
# Sessions


async def test_continue_and_session_prefix_reuse_the_session(
    crush_server: CrushServer, crush_client: Client, tmp_path: Path
) -> None:
    project = crush_server.project()
    first = await run_cli("one", tmp_path=tmp_path, server=crush_server, cwd=project)
    assert (first.code, first.out) == (0, "one\n")
    sid = session_line(first.err)
    again = await run_cli("-C", "two", tmp_path=tmp_path, server=crush_server, cwd=project)
    assert (again.code, again.out) == (0, "two\n")
    assert session_line(again.err) == sid
    by_prefix = await run_cli(
        "-s", sid[:8], "three", tmp_path=tmp_path, server=crush_server, cwd=project
    )
    assert (by_prefix.code, by_prefix.out) == (0, "three\n")
    assert session_line(by_prefix.err) == sid
    async with crush_client.workspace(project) as ws:
        texts = [m.text() for m in await ws.messages(sid)]
        assert texts == ["one", "one", "two", "two", "three", "three"]
        assert len(await ws.sessions()) == 1


# ---------------------------------------------------------------------------------------------
# Only its own run counts


async def test_foreign_errors_and_runs_do_not_change_the_outcome(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    tmp_path: Path,
) -> None:
    ws = crush_workspace
    ours = await ws.create_session()
    other = await ws.create_session()
    gate = Gate()
    reply = "our words arrive in full"
    scripted_model.add(Step(reply, gate_mid=gate), Step(error=ProviderError("foreign failure")))
    broker = crush_server.backend.get(ws.id).broker
    async with cli(
        "-s", ours.id, "ours", tmp_path=tmp_path, server=crush_server, cwd=Path(ws.path)
    ) as running:
        await gate.reached.wait()
        # An error of another run in our session, one with no session, a foreign run failing.
        broker.publish(
            AgentEvent("error", ours.id, "someone-else", "not yours", "not yours"),
            EventKind.CREATED,
        )
        broker.publish(AgentEvent("error", None, None, "nobody's", "nobody's"), EventKind.CREATED)
        broker.publish(
            AgentEvent("error", other.id, None, "other session", "other session"), EventKind.CREATED
        )
        foreign = await ws.prompt(other.id, "theirs")
        assert (await foreign.result(CAP, check=False)).status is RunStatus.FAILED
        gate.release()
    assert (running.code, running.out) == (0, reply + "\n"), running.err
    assert "agent run failed" not in running.err


@pytest.mark.parametrize("foreign_fails", [True, False])
async def test_run_queued_behind_a_foreign_run_in_the_same_session(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    tmp_path: Path,
    foreign_fails: bool,
) -> None:
    """The foreign run's text, error and run_complete in our session are not ours."""
    ws = crush_workspace
    session = await ws.create_session()
    gate = Gate()
    error = ProviderError("foreign failure") if foreign_fails else None
    scripted_model.add(Step("foreign text", gate_mid=gate, error=error), Step("our text"))
    foreign = await ws.prompt(session.id, "foreign prompt")
    await gate.reached.wait()
    agent = crush_server.backend.get(ws.id).agent
    submitted = trio.Event()
    original = agent.accept

    async def accept(*args: Any, **kwargs: Any) -> Any:
        accepted = await original(*args, **kwargs)
        submitted.set()
        return accepted

    agent.accept = accept
    async with cli(
        "-s", session.id, "our prompt", tmp_path=tmp_path, server=crush_server, cwd=Path(ws.path)
    ) as running:
        await submitted.wait()  # ours is queued behind the foreign run
        gate.release()
        await foreign.result(CAP, check=False)
    assert (running.code, running.out) == (0, "our text\n"), running.err


# ---------------------------------------------------------------------------------------------
# Never hang: dropped streams, interrupts, timeouts


async def test_dropped_event_stream_mid_run_still_prints_everything(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    tmp_path: Path,
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    gate = Gate()
    reply = "w1 w2 w3 w4 w5 w6 w7 w8"
    scripted_model.add(Step(reply, gate_mid=gate))
    broker = crush_server.backend.get(ws.id).broker
    async with cli(
        "-s", session.id, "go", tmp_path=tmp_path, server=crush_server, cwd=Path(ws.path)
    ) as running:
        await gate.reached.wait()
        theirs = [c for c in broker.clients if c.client_id != ws.client.client_id]
        assert len(theirs) == 1
        theirs[0].kill("dropped by the test")
        gate.release()
    assert (running.code, running.out) == (0, reply + "\n"), running.err


async def test_sigint_cancels_the_run_and_exits_130(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    tmp_path: Path,
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    gate = Gate()
    scripted_model.add(Step("first half and the second half", gate_mid=gate))
    async with cli(
        "--format",
        "json",
        "-s",
        session.id,
        "long",
        tmp_path=tmp_path,
        server=crush_server,
        cwd=Path(ws.path),
    ) as running:
        await gate.reached.wait()
        # Streamed before the interrupt (JSON lines: the words may come in several deltas).
        await running.output_contains("half")
        running.send_signal(signal.SIGINT)
    assert running.code == 130, running.err
    record = orjson.loads(running.out.splitlines()[-1])
    assert record["status"] == "cancelled"
    assert (await ws.get_run(record["run_id"])).status is RunStatus.CANCELLED


async def test_timeout_cancels_the_run_and_exits_1(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    tmp_path: Path,
) -> None:
    ws = crush_workspace
    session = await ws.create_session()
    scripted_model.add(Step("never finished", gate_before=Gate()))
    done = await run_cli(
        "--timeout",
        "3",
        "--format",
        "json",
        "-s",
        session.id,
        "slow",
        tmp_path=tmp_path,
        server=crush_server,
        cwd=Path(ws.path),
    )
    assert done.code == 1
    assert "--timeout 3" in done.err
    record = orjson.loads(done.out.splitlines()[-1])
    assert record["status"] == "cancelled"


# ---------------------------------------------------------------------------------------------
# --yolo


async def test_yolo_runs_its_tool_while_another_session_still_asks(
    crush_server: CrushServer,
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    tmp_path: Path,
) -> None:
    """--yolo answers its own run's permission requests (never workspace-wide): its tool runs
    without anyone granting it, while a run of another session still waits for an answer."""
    ws = crush_workspace
    project = Path(ws.path)
    ours = await ws.create_session()
    other = await ws.create_session()
    scripted_model.add(
        Step("other", tool_calls=[("bash", {"command": "touch other-was-here"})]),
        Step("mine", tool_calls=[("bash", {"command": "touch yolo-was-here"})]),
        Step("all done"),
    )
    permissions = crush_server.backend.get(ws.id).permissions
    with trio.fail_after(CAP):
        async with ws.subscribe() as feed:
            theirs = await ws.prompt(other.id, "other run")
            asked = await feed.until(
                lambda e: e.type == "permission_request" and e.payload.session_id == other.id
            )
            done = await run_cli(
                "--yolo",
                "-s",
                ours.id,
                "make a file",
                tmp_path=tmp_path,
                server=crush_server,
                cwd=project,
            )
            assert (done.code, done.out) == (0, "mine\nall done\n"), done.err
            assert (project / "yolo-was-here").exists()
            assert [r.id for r in permissions.pending] == [asked.payload.id]
            assert permissions.skip is False
            assert await ws.grant(asked.payload.id, "deny")
            await theirs.result(CAP, check=False)
    assert not (project / "other-was-here").exists()


# ---------------------------------------------------------------------------------------------
# Embedded mode


def run_statuses(project: Path) -> list[str]:
    with sqlite3.connect(project / ".crush" / "crush.db") as db:
        return [row[0] for row in db.execute("SELECT status FROM runs")]


async def test_embedded_mode_echoes_and_saves_its_state(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    done = await run_cli("hello", "embedded", "world", tmp_path=tmp_path, server=None, cwd=project)
    assert (done.code, done.out) == (0, "hello embedded world\n"), done.err
    assert run_statuses(project) == ["completed"]


async def test_embedded_mode_sigint_saves_the_cancelled_run(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    config = {
        "providers": {"echo": {"type": "echo", "delay_ms": 200}},
        "models": {"large": {"provider": "echo", "model": "echo"}},
    }
    (project / "crush.json").write_bytes(orjson.dumps(config))
    words = " ".join(f"word{n}" for n in range(60))
    async with cli(words, tmp_path=tmp_path, server=None, cwd=project) as running:
        await running.output_contains("word1 ")
        running.send_signal(signal.SIGINT)
    assert running.code == 130, running.err
    assert running.out.startswith("word0 word1")
    assert run_statuses(project) == ["cancelled"]
