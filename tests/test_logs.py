"""``--log-format json``: one object per line, ids where they apply, the token never logged."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import orjson
import pytest
import trio

from crush_trio.client import RunFailed, WorkspaceClient, open_event_socket
from crush_trio.logs import ContextFilter, JsonFormatter, configure_logging, log_context
from crush_trio.providers.scripted import ScriptedModel, Step

from .conftest import WAIT

if TYPE_CHECKING:
    from crush_trio.testing import CrushServer

TOKEN = "s3cret-log-token"


def _record(msg: str, *args: Any, **extra: Any) -> logging.LogRecord:
    logger = logging.getLogger("crush_trio.test")
    return logger.makeRecord(
        logger.name, logging.WARNING, __file__, 1, msg, args, None, extra=extra
    )


def test_a_record_is_one_json_line_with_its_fields() -> None:
    line = JsonFormatter().format(_record("run %s\nfailed", "r1", run_id="r1", session_id="s1"))
    assert "\n" not in line
    data = orjson.loads(line)
    assert data["level"] == "WARNING"
    assert data["logger"] == "crush_trio.test"
    assert data["message"] == "run r1\nfailed"
    assert data["run_id"] == "r1"
    assert data["session_id"] == "s1"
    assert "workspace_id" not in data
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", data["time"])


def test_context_ids_apply_inside_the_block_and_in_child_tasks() -> None:
    formatter = JsonFormatter()
    seen: list[dict[str, Any]] = []

    async def child() -> None:
        seen.append(orjson.loads(formatter.format(_record("in a task"))))

    async def main() -> None:
        with log_context(workspace_id="w1", session_id="s1"):
            seen.append(orjson.loads(formatter.format(_record("inside", run_id="r9"))))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(child)
        seen.append(orjson.loads(formatter.format(_record("outside"))))

    trio.run(main)
    assert seen[0] | {"time": 0} == {
        "time": 0,
        "level": "WARNING",
        "logger": "crush_trio.test",
        "message": "inside",
        "workspace_id": "w1",
        "session_id": "s1",
        "run_id": "r9",
    }
    assert seen[1]["workspace_id"] == "w1"
    assert "run_id" not in seen[1]
    assert "workspace_id" not in seen[2]


def test_exceptions_stay_on_one_line() -> None:
    stream = io.StringIO()
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    try:
        configure_logging("INFO", "json", stream)
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("crush_trio.x").exception("it broke")
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    data = orjson.loads(lines[0])
    assert data["message"] == "it broke"
    assert "RuntimeError: boom" in data["exception"]


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="not one of text, json"):
        configure_logging("INFO", "xml")


@pytest.mark.slow
def test_served_json_logs_carry_ids_and_never_the_token(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "cfg"), "HOME": str(tmp_path)}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    cmd = [sys.executable, "-m", "crush_trio", "serve", "--port", "0", "--token", TOKEN]
    cmd += ["--data-dir", str(tmp_path / "data"), "--log-format", "json"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        match = re.search(r"(http://[^/]+)/", proc.stdout.readline())
        assert match
        base = match.group(1)
        with httpx.Client(timeout=10) as client:
            got = client.get(f"{base}/v1/workspaces/w-404/sessions/s-404?token={TOKEN}")
            assert got.status_code == 404
            # A URL-encoded parameter name authenticates too, and is redacted as well.
            got = client.get(f"{base}/v1/workspaces/w-2/runs/r-2?%74oken={TOKEN}&x=1")
            assert got.status_code == 404
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert TOKEN not in err
    records = [orjson.loads(line) for line in err.splitlines() if line.strip()]
    assert records, "nothing was logged"
    for record in records:
        assert {"time", "level", "logger", "message"} <= set(record), record
    access = [r for r in records if r["logger"] == "crush_trio.access"]
    assert len(access) == 2
    first, second = access
    assert first["workspace_id"] == "w-404"
    assert first["session_id"] == "s-404"
    assert first["status"] == 404
    assert first["method"] == "GET"
    assert first["target"] == "/v1/workspaces/w-404/sessions/s-404?token=[redacted]"
    assert second["workspace_id"] == "w-2"
    assert second["run_id"] == "r-2"
    assert "[redacted]" in second["target"]
    assert "x=1" in second["target"]


async def test_a_turn_logs_with_its_workspace_session_and_run(
    crush_workspace: WorkspaceClient,
    scripted_model: ScriptedModel,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.handler.addFilter(ContextFilter())
    ws = crush_workspace
    scripted_model.add(Step(text="partial", error=RuntimeError("a bug in the model")))
    sid = (await ws.create_session()).id
    handle = await ws.prompt(sid, "go", run_id="bug-run")
    with pytest.raises(RunFailed):
        await handle.result(WAIT)
    bugs = [r for r in caplog.records if "failed with a bug" in r.getMessage()]
    assert bugs, [r.getMessage() for r in caplog.records]
    data = orjson.loads(JsonFormatter().format(bugs[0]))
    assert data["run_id"] == "bug-run"
    assert data["session_id"] == sid
    assert data["workspace_id"] == ws.id
    assert "a bug in the model" in data["exception"]


async def test_an_event_websocket_logs_with_its_workspace(
    crush_server: CrushServer, crush_workspace: WorkspaceClient
) -> None:
    """The records of an event stream's connection, to its last line (the socket closed), carry
    the workspace's id."""
    closed = trio.Event()
    records: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("event websocket from") and message.endswith("closed"):
                records.append(record)
                closed.set()

    handler = Catch(logging.DEBUG)
    handler.addFilter(ContextFilter())
    logger = logging.getLogger("crush_trio.server.listener")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        async with open_event_socket(crush_server.url, crush_workspace.id, crush_server.token):
            pass
        with trio.fail_after(WAIT):
            await closed.wait()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    data = orjson.loads(JsonFormatter().format(records[0]))
    assert data["workspace_id"] == crush_workspace.id
