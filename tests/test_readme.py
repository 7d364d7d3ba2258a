"""The README's shell blocks run as written, against a server started as the README says.

Every block fenced as ``sh`` is run by bash (``-euo pipefail``) in a fresh directory holding a
``.venv`` link to this environment, as a user who followed the set-up would have it. Two things
are pasted in the way the README tells a user to paste them: the token of the server's listening
line (``CRUSH_TRIO_TOKEN=...``) and its address (``127.0.0.1:7433``: the test's server listens on
a free port instead). Blocks fenced ``sh setup`` create the environment these tests run in; they
are checked for syntax, and ``.ci/run`` must run the test command among them. Blocks fenced
``sh crush`` need Crush's own Go client, which is not installed here; tests/test_crush_go_client.py
replays what it sends.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import orjson
import pytest
import trio

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
#: Bound on the server's start and on each block (seconds).
CAP = 60
FENCE = re.compile(r"^```(sh(?: setup| crush)?)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(kind: str) -> list[str]:
    return [body for info, body in FENCE.findall(README.read_text()) if info == kind]


def user_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CRUSH_TRIO_", "VIRTUAL_ENV"))}
    env["XDG_CONFIG_HOME"] = str(home / "xdg")  # no user config of the machine leaks in
    env["HOME"] = str(home)
    return env


def test_setup_blocks_are_the_ci_commands() -> None:
    setup = blocks("sh setup")
    assert len(setup) == 2, "the README gives two set-up commands: serve, and the test suite"
    for block in blocks("sh crush"):
        assert "crush-trio serve" in block
    serve, test = (" ".join(b.split()) for b in setup)
    assert "crush-trio serve" in serve
    ci = " ".join((ROOT / ".ci" / "run").read_text().split())
    assert test in ci, ".ci/run must run exactly the README's test command"


async def test_setup_blocks_parse() -> None:
    for block in blocks("sh setup"):
        with trio.fail_after(CAP):
            await trio.run_process(["bash", "-n", "-c", block])


async def test_quick_start_runs_as_written(tmp_path: Path) -> None:
    """Each ``sh`` block, in order, in a directory set up as the README's set-up leaves it."""
    quick = blocks("sh")
    assert len(quick) >= 2, "the Quick start has shell blocks"
    work = tmp_path / "project"
    work.mkdir()
    (work / ".venv").symlink_to(sys.prefix)
    (work / "main.py").write_text("print('hello')\n")
    env = user_env(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text("quickstart-token-1234\n")
    async with trio.open_nursery() as nursery:
        server = await trio.lowlevel.open_process(
            [
                *(sys.executable, "-m", "crush_trio", "serve", "--port", "0"),
                *("--token-file", str(token_file), "--no-access-log"),
            ],
            cwd=work,
            env=env,
            stdout=-1,
            stderr=-1,
        )
        try:
            assert server.stdout is not None
            line = b""
            with trio.fail_after(CAP):
                while b"\n" not in line:
                    chunk = await server.stdout.receive_some()
                    assert chunk, "serve exited before its listening line"
                    line += chunk
            found = re.search(r"http://(127\.0\.0\.1:\d+)/\?token=(\S+)", line.decode())
            assert found, line
            address, token = found.groups()
            outputs = []
            for block in quick:
                pasted = block.replace("127.0.0.1:7433", address).replace(
                    "CRUSH_TRIO_TOKEN=...", f"CRUSH_TRIO_TOKEN={token}"
                )
                with trio.fail_after(CAP):
                    done = await trio.run_process(
                        ["bash", "-euo", "pipefail", "-c", pasted],
                        cwd=work,
                        env=env,
                        capture_stdout=True,
                        capture_stderr=True,
                        check=False,
                    )
                assert done.returncode == 0, (block, done.stdout, done.stderr)
                outputs.append(done.stdout.decode())
        finally:
            server.terminate()
            with trio.fail_after(CAP):
                assert await server.wait() == 0
            nursery.cancel_scope.cancel()
    first, second = outputs[0], outputs[1]
    assert first.strip() == "hello world"  # the echo model says the prompt back
    assert second.startswith("explain main.py\n")
    lines = second.splitlines()
    # Both runs wrote to this directory's data directory: the embedded server's and the real one's.
    assert re.match(
        r"[0-9a-f-]{36}  \d{4}-\d\d-\d\d \d\d:\d\d +2 msgs  explain main\.py$", lines[1]
    )
    assert lines[2].endswith("  hello world")
    workspace = orjson.loads(lines[3])
    assert workspace["path"] == str(work)
    assert workspace["trusted"] is False
