"""The agent's boundary: ``bash`` in the OS sandbox, an honest read-only list, tool threads that
cannot starve the server.

The escape suite plants secrets in a temporary ``HOME`` (and provider keys and a token in the
server's environment) and tries every known trick to read them, to write outside the workspace
and to reach the network. With the sandbox, each attempt fails with a clear tool result (the
read-only shortcut refuses it, or the command fails inside the sandbox); the network works again
when the user grants it. With the sandbox turned off, every ``bash`` call asks.

What runs without a prompt must be harmless because of where it runs: every command shape the
read-only check approves runs with the network granted by the config and still reaches no
network and cannot write the workspace, and the hostile layouts the check once misread (globs
bash expands differently, git configs git reads differently, submodules, signature checks, the
server's own files and Unix socket) either ask or run no program.

The sandboxed tests are skipped only when ``bwrap`` cannot run here at all.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import pytest
import trio

from crush_trio import wire
from crush_trio.tools import (
    ToolContext,
    ToolError,
    ToolResult,
    call_tool,
    default_tools,
    is_read_only,
)
from crush_trio.tools import bash as bash_module
from crush_trio.tools import readonly as readonly_module
from crush_trio.tools import sandbox as sandbox_module
from crush_trio.tools.base import TOOL_THREAD_LIMIT, run_blocking, tool_thread_limiter
from crush_trio.tools.grep import GrepTool
from crush_trio.tools.sandbox import SANDBOX_HOME, Sandbox, probe, shell_env

if TYPE_CHECKING:
    from crush_trio.client import Client, WorkspaceClient
    from crush_trio.testing import CrushServer

SECRET = "TOP-SECRET-7f3a9c"
PROVIDER_KEY = "sk-provider-key-4b1d8e"
SERVER_TOKEN = "server-token-9e2c5a"

STATUS = probe()
needs_sandbox = pytest.mark.skipif(
    not STATUS.available, reason=f"bwrap cannot run here: {STATUS.reason}"
)


class Asker:
    """Records permission requests and answers them all alike."""

    def __init__(self, allow: bool) -> None:
        self.allow = allow
        self.requests: list[dict[str, Any]] = []

    async def request(self, **request: Any) -> bool:
        self.requests.append(request)
        await trio.lowlevel.checkpoint()
        return self.allow


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary HOME holding secrets; provider keys and a token in the environment."""
    home = tmp_path / "home"
    for rel in (".ssh/id_ed25519", ".aws/credentials", ".netrc", ".config/crush-trio/crush.json"):
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text(f"{SECRET}\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("OPENAI_API_KEY", PROVIDER_KEY)
    monkeypatch.setenv("ANTHROPIC_API_KEY", PROVIDER_KEY)
    monkeypatch.setenv("CRUSH_TRIO_TOKEN", SERVER_TOKEN)
    monkeypatch.setenv("BASH_ENV", str(home / ".ssh" / "id_ed25519"))
    return home


@pytest.fixture
def ws(tmp_path: Path, home: Path) -> Path:
    workspace = tmp_path / "ws"
    (workspace / ".crush").mkdir(parents=True)
    (workspace / ".crush" / "crush.db").write_text("history\n")
    (workspace / "hello.txt").write_text("hi there\n")
    # The tricks a hostile repository can carry:
    (workspace / "link").symlink_to(home / ".ssh" / "id_ed25519")
    (workspace / "sshdir").symlink_to(home / ".ssh")
    return workspace


def git_init(path: Path) -> None:
    """A real repository in ``path`` (git reads its own config for the read-only check)."""
    subprocess.run(["git", "init", "-q", str(path)], env=shell_env(), check=True)


def plant_hard_link(ws: Path, home: Path) -> None:
    """A second name of ~/.netrc inside the workspace. No mount can hide it (it is the same
    file), so only tests that expect the read-only check to refuse it plant it."""
    os.link(home / ".netrc", ws / "hardlink")


def make_ctx(ws: Path, asker: Asker, sandbox: Sandbox | None) -> ToolContext:
    return ToolContext(
        workspace=ws,
        data_dir=ws / ".crush",
        session_id="s1",
        tool_call_id="c1",
        permissions=asker,
        timeout=20.0,
        sandbox=sandbox,
    )


async def bash(ctx: ToolContext, command: str, **more: Any) -> ToolResult:
    with trio.fail_after(30):
        params = orjson.dumps({"command": command, **more}).decode()
        return await call_tool(default_tools(), "bash", params, ctx)


def sandbox(**kwargs: Any) -> Sandbox:
    assert STATUS.bwrap is not None
    return Sandbox(STATUS.bwrap, **kwargs)


def tricks(home: Path, outside: Path) -> dict[str, str]:
    """Commands that try to read the planted secrets or write outside the workspace."""
    key = home / ".ssh" / "id_ed25519"
    return {
        "braces": f"cat {{{key},hello.txt}}",
        "braces-proc-environ": "head -c 4000 {/proc/self/environ,}",
        "date-f": f"date -f {key}",
        "date-f-glued": f"date -uf{key}",
        "symlink": "cat link",
        "glob-through-symlink": "cat sshdir/*",
        "grep-R-following-symlinks": f"grep -R {SECRET[:6]} .",
        "hard-link": "cat hardlink",
        "absolute-path": f"cat {key}",
        "tilde": "cat ~/.ssh/id_ed25519",
        "proc-environ": "cat /proc/self/environ",
        "aws": f"cat {home}/.aws/credentials",
        "user-config": f"cat {home}/.config/crush-trio/crush.json",
        "env": "env",
        "write-outside": f"echo pwned > {outside}",
        "write-system": "touch /usr/pwned-by-crush-trio-test",
        "write-home": f"echo pwned >> {home}/.bashrc",
        "write-data-dir": "echo pwned > .crush/crush.db",
    }


def assert_no_leak(result: ToolResult) -> None:
    for secret in (SECRET, PROVIDER_KEY, SERVER_TOKEN):
        assert secret not in result.content, result.content


def assert_nothing_written(ws: Path, home: Path, outside: Path) -> None:
    assert not outside.exists()
    assert not (home / ".bashrc").exists()
    assert not Path("/usr/pwned-by-crush-trio-test").exists()
    assert (ws / ".crush" / "crush.db").read_text() == "history\n"


# ---------------------------------------------------------------------------------------------
# the escape suite, sandboxed


@needs_sandbox
@pytest.mark.slow
@pytest.mark.parametrize(
    "trick",
    sorted(tricks(Path("/h"), Path("/o"))),
)
async def test_escape_denied_by_the_user_runs_nothing(
    trick: str, ws: Path, home: Path, tmp_path: Path
) -> None:
    """None of the tricks passes as read-only: each asks, and a denial runs nothing."""
    outside = tmp_path / "outside.txt"
    plant_hard_link(ws, home)
    asker = Asker(allow=False)
    result = await bash(make_ctx(ws, asker, sandbox()), tricks(home, outside)[trick])
    assert len(asker.requests) == 1, asker.requests
    assert result.is_error
    assert result.stop_turn
    assert result.content.startswith("permission denied: ")
    assert_no_leak(result)
    assert_nothing_written(ws, home, outside)


@needs_sandbox
@pytest.mark.slow
@pytest.mark.parametrize(
    "trick",
    sorted(set(tricks(Path("/h"), Path("/o"))) - {"hard-link"}),
)
async def test_escape_allowed_by_the_user_still_fails_in_the_sandbox(
    trick: str, ws: Path, home: Path, tmp_path: Path
) -> None:
    """Even when the user allows the command, the sandbox keeps the secrets and the host safe.

    (A hard link is the same file under a second name, so no mount can hide it; it is left to
    the read-only check, which makes it ask, see the test above and docs/tools.md.)
    """
    outside = tmp_path / "outside.txt"
    asker = Asker(allow=True)
    result = await bash(make_ctx(ws, asker, sandbox()), tricks(home, outside)[trick])
    assert_no_leak(result)
    assert_nothing_written(ws, home, outside)
    # The environment tricks succeed but show a scrubbed environment; the write outside
    # succeeds into the sandbox's private /tmp (the test's directories are under /tmp), not the
    # host's, as assert_nothing_written proves.
    if trick not in ("env", "proc-environ", "braces-proc-environ", "write-outside"):
        # The command failed, and the result says why.
        assert "exit code: 0" not in result.content, result.content
        assert "note: the command ran in a sandbox" in result.content


@needs_sandbox
@pytest.mark.slow
async def test_environment_is_an_allow_list(ws: Path, home: Path) -> None:
    result = await bash(make_ctx(ws, Asker(allow=True), sandbox()), "env")
    names = {line.split("=", 1)[0] for line in result.content.splitlines() if "=" in line}
    assert "OPENAI_API_KEY" not in names
    assert "CRUSH_TRIO_TOKEN" not in names
    assert "BASH_ENV" not in names
    assert f"HOME={SANDBOX_HOME}\n" in result.content
    assert "PATH=" in result.content
    # The same allow-list applies without a sandbox.
    env = shell_env()
    assert "OPENAI_API_KEY" not in env
    assert "CRUSH_TRIO_TOKEN" not in env
    assert "BASH_ENV" not in env


@needs_sandbox
@pytest.mark.slow
async def test_workspace_is_writable_and_data_directory_is_read_only(ws: Path) -> None:
    asker = Asker(allow=True)
    result = await bash(make_ctx(ws, asker, sandbox()), "echo made > new.txt && cat new.txt")
    assert result.content.startswith("made\nexit code: 0")
    assert (ws / "new.txt").read_text() == "made\n"
    result = await bash(make_ctx(ws, asker, sandbox()), "touch .crush/x")
    assert "Read-only file system" in result.content
    assert not (ws / ".crush" / "x").exists()


@needs_sandbox
@pytest.mark.slow
async def test_secrets_inside_a_mounted_workspace_are_hidden(
    tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A workspace that is the home directory still does not show ~/.ssh or the deny list."""
    (home / "notes.txt").write_text("mine\n")
    (home / "private").mkdir()
    (home / "private" / "key").write_text(f"{SECRET}\n")
    box = sandbox(deny_read=("~/private",))
    asker = Asker(allow=True)
    ctx = make_ctx(home, asker, box)
    ctx.data_dir = tmp_path / "data"
    result = await bash(ctx, "cat notes.txt; cat .ssh/id_ed25519; cat private/key; ls -a .ssh")
    assert result.content.startswith("mine\n")
    assert_no_leak(result)


@needs_sandbox
@pytest.mark.slow
async def test_other_workspaces_data_directories_are_hidden(tmp_path: Path, home: Path) -> None:
    """The server's data directory and other open workspaces' data directories are hidden, even
    where they lie inside the workspace; the workspace's own stays readable (not writable)."""
    server_data = home / "server-data"
    for name in ("mine", "theirs"):
        (server_data / name).mkdir(parents=True)
        (server_data / name / "crush.db").write_text(f"{name}-{SECRET}\n")
    nested = home / "project" / ".crush"
    nested.mkdir(parents=True)
    (nested / "crush.db").write_text(f"nested-{SECRET}\n")
    box = sandbox(hidden=(server_data,), more_hidden=lambda: [nested, server_data / "mine"])
    ctx = make_ctx(home, Asker(allow=True), box)
    ctx.data_dir = server_data / "mine"
    result = await bash(
        ctx,
        f"cat {server_data}/mine/crush.db; cat {server_data}/theirs/crush.db; "
        "cat project/.crush/crush.db; echo x > project/.crush/crush.db; "
        f"echo x > {server_data}/mine/crush.db; ls -a {server_data}",
    )
    assert result.content.startswith(f"mine-{SECRET}\n")
    assert f"theirs-{SECRET}" not in result.content
    assert f"nested-{SECRET}" not in result.content
    assert (nested / "crush.db").read_text() == f"nested-{SECRET}\n"
    assert (server_data / "mine" / "crush.db").read_text() == f"mine-{SECRET}\n"


@needs_sandbox
@pytest.mark.slow
async def test_read_only_command_runs_without_asking_with_the_workspace_read_only(
    ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asker = Asker(allow=False)
    ctx = make_ctx(ws, asker, sandbox())
    result = await bash(ctx, "cat hello.txt")
    assert result.content == "hi there\nexit code: 0"
    assert asker.requests == []
    # Were the read-only check ever wrong, the command that ran without asking still could not
    # write: the workspace is mounted read-only for it.
    monkeypatch.setattr(
        bash_module, "read_only_argv", lambda command, workspace: ["bash", "-c", command]
    )
    result = await bash(ctx, "touch planted")
    assert asker.requests == []
    assert "Read-only file system" in result.content
    assert "the workspace was read-only" in result.content
    assert not (ws / "planted").exists()


@needs_sandbox
@pytest.mark.slow
async def test_git_repository_config_cannot_run_programs(ws: Path) -> None:
    await trio.run_process(["git", "init", "-q", str(ws)], env=shell_env())
    with (ws / ".git" / "config").open("a") as f:
        f.write(f'[core]\n\tfsmonitor = "touch {ws}/pwned; false"\n')
    asker = Asker(allow=False)
    result = await bash(make_ctx(ws, asker, sandbox()), "git status")
    assert len(asker.requests) == 1
    assert result.stop_turn
    # Allowed, git still runs with the monitor turned off.
    result = await bash(make_ctx(ws, Asker(allow=True), sandbox()), "git status")
    assert not (ws / "pwned").exists(), result.content


def _host_processes_with(marker: str) -> list[int]:
    """Live host processes whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        found_it = marker in cmdline
        if found_it and state != "Z":
            found.append(int(entry.name))
    return found


@needs_sandbox
@pytest.mark.slow
async def test_every_process_dies_with_the_call(ws: Path) -> None:
    ctx = make_ctx(ws, Asker(allow=True), sandbox())
    result = await bash(ctx, "sleep 987.25 & sleep 987.5 & echo started")
    assert result.content.startswith("started\nexit code: 0")
    assert _host_processes_with("sleep 987.") == []
    ctx.timeout = 1.0
    result = await bash(ctx, "sleep 986.25 & sleep 986.5")
    assert "timed out" in result.content
    assert _host_processes_with("sleep 986.") == []


@needs_sandbox
@pytest.mark.slow
async def test_cancel_ends_every_sandboxed_process(ws: Path) -> None:
    # The command reports through a FIFO in the workspace that it has started its processes.
    fifo = ws / "started"
    os.mkfifo(fifo)
    stream = trio.lowlevel.FdStream(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
    ctx = make_ctx(ws, Asker(allow=True), sandbox())
    returned: list[ToolResult] = []

    async def call() -> None:
        returned.append(await bash(ctx, "sleep 985.25 & sleep 985.5 & echo go > started; wait"))

    with trio.fail_after(15):
        async with stream, trio.open_nursery() as nursery:
            nursery.start_soon(call)
            assert await stream.receive_some() == b"go\n"
            # (A background job may still be between fork and exec here, so it is not counted.)
            assert _host_processes_with("sleep 985.")
            nursery.cancel_scope.cancel()
    assert returned == []
    assert _host_processes_with("sleep 985.") == []


@needs_sandbox
@pytest.mark.slow
async def test_network_is_off_until_the_user_grants_it(ws: Path) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    accepted = 0

    async def accept() -> None:
        nonlocal accepted
        while True:
            stream = await listeners[0].accept()
            accepted += 1
            await stream.aclose()

    command = f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept)
        asker = Asker(allow=True)
        result = await bash(make_ctx(ws, asker, sandbox()), command)
        assert "connected\n" not in result.content
        assert "Connection refused" in result.content
        assert "pass network=true to ask the user" in result.content
        assert asker.requests[-1]["params"]["network"] is False
        # The model asks for the network and the user allows it.
        result = await bash(make_ctx(ws, asker, sandbox()), command, network=True)
        assert result.content.startswith("connected\n"), result.content
        assert asker.requests[-1]["params"]["network"] is True
        assert "with network access" in asker.requests[-1]["description"]
        # Asking for the network asks even for a read-only command, and a denial runs nothing.
        denier = Asker(allow=False)
        result = await bash(make_ctx(ws, denier, sandbox()), "cat hello.txt", network=True)
        assert len(denier.requests) == 1
        assert result.stop_turn
        # The workspace's config grants it for every command.
        result = await bash(make_ctx(ws, asker, sandbox(network=True)), command)
        assert result.content.startswith("connected\n"), result.content
        nursery.cancel_scope.cancel()
    await listeners[0].aclose()
    assert accepted == 2


def test_sandbox_layout_resolver_and_deny_entries_around_the_workspace(
    tmp_path: Path, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the network, the resolver file is reachable even where /etc/resolv.conf links out of
    /etc; a deny entry that contains the workspace is not mounted over it."""
    target = tmp_path / "run" / "stub-resolv.conf"
    target.parent.mkdir()
    target.write_text("nameserver 127.0.0.53\n")
    link = tmp_path / "resolv.conf"
    link.symlink_to(target)
    monkeypatch.setattr(sandbox_module, "RESOLV_CONF", str(link))
    box = Sandbox("bwrap", deny_read=(str(tmp_path),))
    real_ws = Path(os.path.realpath(ws))
    offline = box.command(["true"], workspace=real_ws, data_dir=None, writable=True)
    online = box.command(["true"], workspace=real_ws, data_dir=None, writable=True, network=True)
    assert str(target) not in offline
    assert "--share-net" not in offline
    assert online[online.index(str(target)) - 1] == "--ro-bind"
    assert "--share-net" in online
    assert str(Path(os.path.realpath(tmp_path))) not in offline


# ---------------------------------------------------------------------------------------------
# the same suite without a sandbox


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    sorted({*tricks(Path("/h"), Path("/o")), "cat hello.txt", "ls", "git status", "pwd"}),
)
async def test_without_a_sandbox_every_bash_call_asks(
    command: str, ws: Path, home: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside.txt"
    plant_hard_link(ws, home)
    command = tricks(home, outside).get(command, command)
    asker = Asker(allow=False)
    result = await bash(make_ctx(ws, asker, None), command)
    [request] = asker.requests
    assert request["params"]["sandboxed"] is False
    assert "with no sandbox" in request["description"]
    assert result.stop_turn
    assert result.content.startswith("permission denied: ")
    assert_nothing_written(ws, home, outside)


@pytest.mark.slow
async def test_agent_info_reports_the_sandbox(
    crush_server: CrushServer, crush_workspace: WorkspaceClient
) -> None:
    info = await crush_workspace.agent_info()
    assert info.sandbox.active is STATUS.available
    assert info.sandbox.network is False
    if not STATUS.available:
        assert info.sandbox.reason == STATUS.reason
    workspace = crush_server.backend.workspaces[crush_workspace.id]
    assert (workspace.sandbox is not None) is STATUS.available


def test_a_failing_self_test_means_no_sandbox_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    broken = tmp_path / "bwrap"
    broken.write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n"
    )
    broken.chmod(0o755)
    monkeypatch.setattr(sandbox_module, "find_bwrap", lambda: str(broken))
    monkeypatch.setattr(sandbox_module, "_probed", None)
    with caplog.at_level("WARNING", logger="crush_trio.tools.sandbox"):
        status = probe()
        assert probe() is status  # tested once, reported once
    assert not status.available
    assert "failed its self-test (exit 1): bwrap: No permissions" in status.reason
    [record] = caplog.records
    assert "every bash command will ask for permission" in record.getMessage()


@pytest.mark.slow
@pytest.mark.parametrize("crush_config", [{"options": {"sandbox": {"enabled": False}}}])
async def test_sandbox_turned_off_by_config_is_reported(
    crush_server: CrushServer, crush_workspace: WorkspaceClient
) -> None:
    info = await crush_workspace.agent_info()
    assert info.sandbox == wire.SandboxInfo(
        active=False,
        network=False,
        reason="turned off by options.sandbox.enabled; every bash command asks",
    )


# ---------------------------------------------------------------------------------------------
# is_read_only does not lie


@pytest.mark.parametrize(
    ("command", "read_only"),
    [
        ("cat hello.txt", True),
        ("cat 'hello.txt'", True),
        ("cat *.txt", True),
        ("ls \\{a,b\\}", True),
        ("grep -rn 'a{2}' .", True),
        ("find . -name '*.py'", True),
        ("date +%s", True),
        ("cat {/etc/passwd,/etc/hostname}", False),
        ("cat {hello.txt,hello.txt}", False),
        ("head -c 4000 {/proc/self/environ,}", False),
        ("date -f /etc/passwd", False),
        ("date --file=/etc/passwd", False),
        ("date -uf/etc/passwd", False),
        ("date -r /etc/passwd", False),
        ("date --fil=/etc/passwd", False),
        ("grep --dereference-r x .", False),
        ("git diff --ext", False),
        ("rg --hostname=./x foo", False),
        ("wc --files0-from=hello.txt", False),
        ("cat -- link", False),
        ("cat -- -n hello.txt", True),
        ("cat link", False),
        ("cat sshdir/*", False),
        ("cat *", False),
        ("ls s*", False),
        ("cat hardlink", False),
        ("grep -R x .", False),
        ("grep -rR x .", False),
        ("grep --dereference-recursive x .", False),
        ("grep -f/etc/passwd hello.txt", False),
        ("rg --pre=./x foo", False),
        ("rg --hostname-bin=./x --hyperlink-format=default foo", False),
        ("rg -L foo", False),
        ("rg --follow foo", False),
        ("find -L . -name x", False),
        ("find . -follow", False),
        ("cat ~/.ssh/id_rsa", False),
        ("cat ~root/.ssh/id_rsa", False),
        ("wc --files0-from=~/list", False),
        ("echo a=~/x", False),
        ("echo '~'", True),
        ("git diff HEAD~1", True),
        ("cat x#y", True),
        ("cat (x)", False),
        ("echo 'unclosed", False),
        ("git diff --ext-diff", False),
        ("git -c core.pager=sh log", False),
    ],
)
def test_is_read_only_does_not_lie(command: str, read_only: bool, ws: Path, home: Path) -> None:
    plant_hard_link(ws, home)
    assert is_read_only(command, Path(os.path.realpath(ws))) is read_only


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        "cat a 'b c' \"d e\" f\\ g",
        "grep -n 'it'\\''s' \"say \\\"hi\\\"\" x\\\\y",
        "ls ''  \"\" a''b",
        "echo \"back\\slash\" 'back\\slash' back\\slash",
        "head\t-n 3\t\t'tab\there'",
    ],
)
async def test_words_are_split_as_bash_splits_them(command: str) -> None:
    words = readonly_module._split_words(command)
    assert words is not None
    done = await trio.run_process(
        ["bash", "-c", "printf '%s\\0' " + command.split(None, 1)[1]],
        capture_stdout=True,
    )
    assert [w.text for w in words[1:]] == done.stdout.decode().split("\0")[:-1]


@pytest.mark.parametrize(
    "config",
    [
        "[core]\n\tfsmonitor = ./x\n",
        "[diff]\n\texternal = ./x\n",
        '[diff "bin"]\n\ttextconv = ./x\n',
        '[diff "bin"]\n\tcommand = ./x\n',
        '[filter "lfs"]\n\tclean = ./x\n',
        "[include]\n\tpath = ../x\n",
        '[includeIf "gitdir:/"]\n\tpath = ../x\n',
        "[log]\n\tshowSignature = true\n",
        "[gpg]\n\tprogram = ./x\n",
        "[core]\n\tpager = ./x\n",
        "[pager]\n\tlog = ./x\n",
        "[core]\n\tworktree = /etc\n",
        "[core] fsmonitor = ./x\n",
    ],
)
def test_git_with_a_repository_config_that_runs_programs_is_not_read_only(
    config: str, tmp_path: Path
) -> None:
    git_init(tmp_path)
    (tmp_path / ".git" / "config").write_text("[core]\n\tbare = false\n" + config)
    for command in ("git status", "git log", "git diff"):
        assert not is_read_only(command, tmp_path), (command, config)


def test_git_with_a_plain_repository_config_is_read_only(tmp_path: Path) -> None:
    git_init(tmp_path)
    (tmp_path / ".git" / "config").write_text(
        "[core]\n\trepositoryformatversion = 0\n\tfilemode = true\n\tbare = false\n"
        '[remote "origin"]\n\turl = https://example.com/filter-repo.git\n'
        '\tfetch = +refs/heads/*:refs/remotes/origin/*\n[branch "main"]\n\tremote = origin\n'
    )
    assert is_read_only("git status", tmp_path)
    # A .git file points to a repository elsewhere: not read-only.
    other = tmp_path / "linked"
    other.mkdir()
    (other / ".git").write_text(f"gitdir: {tmp_path / '.git'}\n")
    assert not is_read_only("git status", other)


@pytest.mark.parametrize("layout", ["gitdir-file", "commondir", "alternates"])
def test_git_with_a_repository_outside_the_workspace_is_not_read_only(
    layout: str, tmp_path: Path
) -> None:
    """A ``.git`` file, ``commondir`` or ``objects/info/alternates`` pointing to a repository
    elsewhere would make an approved ``git log -p`` read outside the workspace."""
    elsewhere = tmp_path / "elsewhere"
    git_init(elsewhere)
    ws = tmp_path / "ws"
    ws.mkdir()
    if layout == "gitdir-file":
        (ws / ".git").write_text(f"gitdir: {elsewhere / '.git'}\n")
    else:
        git_init(ws)
        if layout == "commondir":
            (ws / ".git" / "commondir").write_text(f"{elsewhere / '.git'}\n")
        else:
            (ws / ".git" / "objects" / "info" / "alternates").write_text(
                f"{elsewhere / '.git' / 'objects'}\n"
            )
    assert not is_read_only("git log -p", ws)
    # The same repository inside the workspace is fine.
    assert is_read_only("git log -p", elsewhere)


# ---------------------------------------------------------------------------------------------
# tool threads cannot starve the server


async def test_abandoned_tool_threads_leave_the_default_limiter_free(tmp_path: Path) -> None:
    """Tool work that never ends fills only the tools' own limiter; the store's threads (Trio's
    default limiter) stay available."""
    release = threading.Event()
    ctx = make_ctx(tmp_path, Asker(allow=True), None)
    ctx.timeout = 0.05
    timed_out = 0

    async def stuck_call() -> None:
        nonlocal timed_out
        try:
            await run_blocking(ctx, "view", release.wait)
        except ToolError:
            timed_out += 1

    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for _ in range(50):
                    nursery.start_soon(stuck_call)
        assert timed_out == 50
        # Every call timed out; their threads are still blocked and hold the tool limiter.
        assert tool_thread_limiter().borrowed_tokens == TOOL_THREAD_LIMIT
        started = time.monotonic()
        with trio.fail_after(1):
            assert await trio.to_thread.run_sync(lambda: 42) == 42
        assert time.monotonic() - started < 0.1
    finally:
        release.set()


@pytest.mark.slow
async def test_fifo_views_leave_the_server_answering(
    crush_client: Client, crush_workspace: WorkspaceClient
) -> None:
    workspace = Path(crush_workspace.path)
    for i in range(50):
        os.mkfifo(workspace / f"fifo{i}")
    ctx = make_ctx(workspace, Asker(allow=True), None)
    results: list[ToolResult] = []

    async def view(i: int) -> None:
        params = orjson.dumps({"path": f"fifo{i}"}).decode()
        results.append(await call_tool(default_tools(), "view", params, ctx))

    # Before the fix each view opened its FIFO and blocked a thread of Trio's default limiter for
    # good (40 of them), and the store, which runs in those threads, stopped answering.
    ctx.timeout = 1.0
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for i in range(50):
                nursery.start_soon(view, i)
    assert len(results) == 50
    assert all(r.is_error and "is a FIFO, not a regular file" in r.content for r in results)
    # A full garbage collection of a large test process can pause for longer than the bound
    # measured here; it is done before, so that only the server's answer is timed.
    gc.collect()
    started = time.monotonic()
    with trio.fail_after(1):
        assert await crush_client.request("GET", "/v1/health") == {"status": "ok"}
    assert time.monotonic() - started < 0.1
    # The store still answers: a new session is created and listed.
    with trio.fail_after(1):
        session = await crush_workspace.create_session("after fifos")
        assert session.id in {s.id for s in await crush_workspace.sessions()}


async def test_view_asks_before_reading_a_hard_linked_file(ws: Path, home: Path) -> None:
    plant_hard_link(ws, home)
    asker = Asker(allow=False)
    ctx = make_ctx(ws, asker, None)
    with trio.fail_after(5):
        result = await call_tool(default_tools(), "view", '{"path": "hardlink"}', ctx)
        plain = await call_tool(default_tools(), "view", '{"path": "hello.txt"}', ctx)
    [request] = asker.requests
    assert "1 other name(s) (hard links)" in request["description"]
    assert result.stop_turn
    assert SECRET not in result.content
    assert plain.content == "     1|hi there"


@pytest.mark.parametrize("use_rg", [False, True])
async def test_grep_refuses_a_fifo(tmp_path: Path, use_rg: bool) -> None:
    os.mkfifo(tmp_path / "fifo")
    ctx = make_ctx(tmp_path, Asker(allow=True), None)
    with trio.fail_after(5):
        result = await call_tool(
            [GrepTool(use_rg=use_rg)], "grep", '{"pattern": "x", "path": "fifo"}', ctx
        )
    assert result.is_error
    assert "fifo is a FIFO, not a regular file; grep reads" in result.content


async def test_view_refuses_devices(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, Asker(allow=True), None)
    params = orjson.dumps({"path": "/dev/zero"}).decode()
    with trio.fail_after(5):
        result = await call_tool(default_tools(), "view", params, ctx)
    assert result.is_error
    assert "is a device, not a regular file" in result.content


@pytest.mark.slow
async def test_python_grep_with_a_catastrophic_regex_is_stopped(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a" * 64 + "b\n")
    ctx = make_ctx(tmp_path, Asker(allow=True), None)
    ctx.timeout = 1.0
    params = orjson.dumps({"pattern": "(a+)+$"}).decode()
    started = time.monotonic()
    with trio.fail_after(10):
        result = await call_tool([GrepTool(use_rg=False)], "grep", params, ctx)
    assert result.is_error
    assert "grep timed out after 1 s and was stopped" in result.content
    assert time.monotonic() - started < 8
    assert _host_processes_with("grep_worker.py") == []


# ---------------------------------------------------------------------------------------------
# what runs without a prompt is harmless because of where it runs


def test_glob_names_that_bash_would_read_as_options_are_not_read_only(tmp_path: Path) -> None:
    """A file named ``--pre=sh``: bash expands ``[[:punct:]]*`` and ``[^a]*`` to it (Python's
    glob does not understand either), and rg would run sh on every file."""
    (tmp_path / "--pre=sh").write_text("")
    (tmp_path / "a.txt").write_text("echo hi\n")
    for command in ("rg . [[:punct:]]*", "rg . [^a]*", "rg . *", "grep -r x ?-pre=sh", "cat *"):
        assert not is_read_only(command, tmp_path), command
    # The words approved are the words run: the glob is expanded by the check, not by bash.
    assert readonly_module.read_only_argv("cat *.txt", tmp_path) == ["cat", "a.txt"]
    assert readonly_module.read_only_argv("cat '[x]'", tmp_path) == ["cat", "[x]"]


@needs_sandbox
@pytest.mark.slow
@pytest.mark.parametrize("command", ["rg . [[:punct:]]*", "rg . [^a]*", "ls [[:punct:]]*"])
async def test_bracket_globs_ask(command: str, ws: Path) -> None:
    (ws / "--pre=sh").write_text("")
    asker = Asker(allow=False)
    result = await bash(make_ctx(ws, asker, sandbox()), command)
    assert len(asker.requests) == 1
    assert result.stop_turn


#: What a program the repository names prints when git runs it.
GIT_RAN = "GIT-RAN-A-PROGRAM-5d2e"


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        env=shell_env(),
        check=True,
        capture_output=True,
    )


def _hostile_repository(ws: Path, layout: str) -> None:
    """A repository in ``ws`` whose config, as git reads it, makes ``git log -p`` and
    ``git diff`` run ``./conv.sh`` (a textconv driver), hidden from a line-by-line reading."""
    conv = ws / "conv.sh"
    # git reads the subsection "x]y" and then the variable on the same line.
    textconv = '[diff "x]y"] textconv = ./conv.sh\n' if layout == "bracket" else ""
    driver = "x]y" if layout == "bracket" else "x"
    hostile = f'[diff "{driver}"]\n\ttextconv = ./conv.sh\n'
    if layout == "bare":
        _git(ws.parent, "init", "-q", "--bare", str(ws))
        work = ws.parent / "work"
        _git(ws.parent, "clone", "-q", str(ws), str(work))
        (work / "a.txt").write_text("one\n")
        (work / ".gitattributes").write_text("*.txt diff=x\n")
        _git(work, "add", ".")
        _git(work, "commit", "-qm", "one")
        (work / "a.txt").write_text("two\n")
        _git(work, "commit", "-qam", "two")
        _git(work, "push", "-q", "origin", "HEAD")
        (ws / "info").mkdir(exist_ok=True)
        (ws / "info" / "attributes").write_text("*.txt diff=x\n")
        with (ws / "config").open("a") as f:
            f.write(hostile)
    else:
        git_init(ws)
        (ws / "a.txt").write_text("one\n")
        (ws / ".gitattributes").write_text(f"*.txt diff={driver}\n")
        _git(ws, "add", "a.txt", ".gitattributes")
        _git(ws, "commit", "-qm", "one")
        (ws / "a.txt").write_text("two\n")
        _git(ws, "commit", "-qam", "two")
        (ws / "a.txt").write_text("three\n")
        config = ws / ".git" / "config"
        if layout == "bom-include":
            (ws / ".git" / "extra").write_text(hostile)
            config.write_bytes(b"\xef\xbb\xbf[include]\n\tpath = extra\n" + config.read_bytes())
        elif layout == "bracket":
            with config.open("a") as f:
                f.write(textconv)
        elif layout == "commondir":
            common = ws / "common"
            shutil.copytree(ws / ".git", common, symlinks=True)
            with (common / "config").open("a") as f:
                f.write(hostile)
            (ws / ".git" / "commondir").write_text("../common\n")
    conv.write_text(f'#!/bin/sh\necho {GIT_RAN}\ncat "$1"\n')
    conv.chmod(0o755)


@needs_sandbox
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["bom-include", "bracket", "commondir", "bare"])
@pytest.mark.parametrize("command", ["git log -p", "git diff HEAD~1 HEAD"])
async def test_git_config_that_git_reads_differently_runs_no_program(
    layout: str, command: str, tmp_path: Path
) -> None:
    """Git parses the config for the check: a byte-order mark before ``[include]``, ``]``
    inside a quoted subsection, ``.git/commondir`` and a bare repository as the workspace each
    make the command ask; allowed, git still runs no textconv program."""
    ws = tmp_path / "ws"
    ws.mkdir()
    await trio.to_thread.run_sync(_hostile_repository, ws, layout)
    # git itself runs the program here (the layout is real):
    plain = await trio.run_process(
        command.split(), cwd=ws, env=shell_env(), capture_stdout=True, check=False
    )
    assert GIT_RAN in plain.stdout.decode(), plain
    asker = Asker(allow=False)
    result = await bash(make_ctx(ws, asker, sandbox()), command)
    assert len(asker.requests) == 1, result.content
    assert result.stop_turn, result.content
    assert GIT_RAN not in result.content


def _repository_with_a_submodule(ws: Path) -> None:
    """``ws`` holds a repository whose submodule ``sub`` runs ``./conv.sh`` as a textconv
    driver, and whose own config shows submodule diffs."""
    sub = ws / "sub"
    sub.mkdir(parents=True)
    git_init(sub)
    (sub / "a.txt").write_text("one\n")
    (sub / ".gitattributes").write_text("*.txt diff=x\n")
    _git(sub, "add", ".")
    _git(sub, "commit", "-qm", "one")
    git_init(ws)
    _git(ws, "add", "sub")
    _git(ws, "commit", "-qm", "sub")
    (sub / "a.txt").write_text("two\n")
    _git(sub, "commit", "-qam", "two")
    with (sub / ".git" / "config").open("a") as f:
        f.write('[diff "x"]\n\ttextconv = ./conv.sh\n')
    with (ws / ".git" / "config").open("a") as f:
        f.write("[diff]\n\tsubmodule = diff\n")
    (sub / "conv.sh").write_text(f'#!/bin/sh\necho {GIT_RAN}\ncat "$1"\n')
    (sub / "conv.sh").chmod(0o755)


@needs_sandbox
@pytest.mark.slow
async def test_git_does_not_look_into_an_embedded_repository(tmp_path: Path) -> None:
    """An embedded repository (a submodule) has its own config, which the check does not read:
    approved ``git diff`` and ``git status`` never look into it (``diff.submodule=diff`` in the
    outer config would run the inner one's textconv)."""
    ws = tmp_path / "ws"
    await trio.to_thread.run_sync(_repository_with_a_submodule, ws)
    plain = await trio.run_process(
        ["git", "diff"], cwd=ws, env=shell_env(), capture_stdout=True, check=False
    )
    assert GIT_RAN in plain.stdout.decode(), plain
    asker = Asker(allow=False)
    for command in ("git diff", "git status", "git log -p"):
        result = await bash(make_ctx(ws, asker, sandbox()), command)
        assert asker.requests == [], command
        assert GIT_RAN not in result.content, (command, result.content)


@needs_sandbox
@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        "git log --show-signature",
        "git log --show-sig",
        "git log --format=%G?",
        "git log --pretty=tformat:%GS",
        "git diff --ignore-submodules=none",
        "git diff --submodule=diff",
    ],
)
async def test_git_signature_checks_and_submodules_ask(command: str, ws: Path) -> None:
    """Checking a signature runs gpg; looking into a submodule reads a config not checked."""
    git_init(ws)
    asker = Asker(allow=False)
    result = await bash(make_ctx(ws, asker, sandbox()), command)
    assert len(asker.requests) == 1
    assert result.stop_turn


#: Programs that stand in for the read-only ones in :func:`test_prompt_free_commands_reach_
#: nothing`: each reports whether the network and a write into the workspace work, as a
#: program the classifier was wrong about would try.
_FAKE_PROGRAM = """#!/bin/bash
# (the read-only check runs git config and git rev-parse outside the sandbox: the real git)
case "$(basename "$0") $1" in "git config"|"git rev-parse") exec {git} "$@";; esac
if (exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null; then echo NET-OPEN; else echo NET-CLOSED; fi
if touch planted-by-$(basename "$0") 2>/dev/null; then echo WS-WRITABLE; else echo WS-READONLY; fi
"""

#: Every shape of command the read-only classifier approves (``echo`` and ``pwd`` are bash
#: builtins, so no program of the workspace's choosing runs for them).
PROMPT_FREE_SHAPES = (
    "ls",
    "ls -la .",
    "cat hello.txt",
    "cat *.txt",
    "head -n 1 hello.txt",
    "tail -n 1 hello.txt",
    "wc -l hello.txt",
    "grep -rn hi .",
    "rg hi",
    "find . -name '*.txt'",
    "which git",
    "date +%s",
    "git status",
    "git log -p",
    "git diff HEAD",
)


@needs_sandbox
@pytest.mark.slow
async def test_prompt_free_commands_reach_nothing(
    ws: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every command shape that runs without a prompt, with ``options.sandbox.network: true``:
    whatever the program does, it reaches no network and cannot write the workspace."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    accepted = 0

    async def accept() -> None:
        nonlocal accepted
        while True:
            stream = await listeners[0].accept()
            accepted += 1
            await stream.aclose()

    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir()
    git = shutil.which("git")
    assert git is not None
    for name in sorted(readonly_module.READ_ONLY_COMMANDS):
        program = fake_bin / name
        program.write_text(_FAKE_PROGRAM.format(git=git, port=port))
        program.chmod(0o755)
    git_init(ws)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    box = sandbox(network=True, read_only_paths=(str(fake_bin),))
    asker = Asker(allow=False)
    # The same program reaches the network when the user allowed the command:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept)
        allowed = await bash(make_ctx(ws, Asker(allow=True), box), f"{fake_bin}/cat x")
        assert allowed.content.startswith("NET-OPEN\nWS-WRITABLE\n"), allowed.content
        (ws / "planted-by-cat").unlink()
        for command in PROMPT_FREE_SHAPES:
            result = await bash(make_ctx(ws, asker, box), command)
            assert asker.requests == [], command
            assert result.content.startswith("NET-CLOSED\nWS-READONLY\n"), (command, result)
        nursery.cancel_scope.cancel()
    await listeners[0].aclose()
    assert accepted == 1
    assert not [name for name in os.listdir(ws) if name.startswith("planted-by-")]


@needs_sandbox
@pytest.mark.slow
async def test_proc_1_cmdline_shows_no_hidden_path(ws: Path, home: Path) -> None:
    """The sandbox's first process is a fork of bwrap: its command line must not list what is
    hidden."""
    hidden = ws / "hidden-dir-3b9f"
    hidden.mkdir()
    box = sandbox(hidden=(hidden,), deny_read=("~/private-4c1a",))
    (home / "private-4c1a").write_text("x\n")
    result = await bash(make_ctx(ws, Asker(allow=True), box), "cat /proc/1/cmdline; echo")
    assert "bwrap" in result.content, result.content
    assert "bash" in result.content, result.content
    assert "hidden-dir-3b9f" not in result.content
    assert "private-4c1a" not in result.content
    assert ".ssh" not in result.content


_SKIP_SCRIPT = """import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
body = b'{{"skip": true}}'
s.sendall(
    b"POST /v1/workspaces/{wid}/permissions/skip HTTP/1.1\\r\\nHost: localhost\\r\\n"
    b"Content-Type: application/json\\r\\nContent-Length: %d\\r\\n\\r\\n%s" % (len(body), body)
)
print(s.recv(4096).decode(errors="replace"))
"""


@needs_sandbox
@pytest.mark.slow
async def test_server_secrets_and_socket_are_out_of_reach(tmp_path: Path, home: Path) -> None:
    """A server on a Unix socket in the workspace (the home directory), with its --config file,
    --token-file and a webhook secret file there too: a command the user allowed reads none of
    them, and cannot turn on skip mode through the socket."""
    from .conftest import running_server

    (home / "hook-secret").write_text(f"{SECRET}\n")
    config = home / "server.json"
    config.write_bytes(
        orjson.dumps(
            {
                "webhooks": [
                    {
                        "url": "http://127.0.0.1:9/hook-e8a1",
                        "secret_file": str(home / "hook-secret"),
                    }
                ]
            }
        )
    )
    (home / "token").write_text(f"{SERVER_TOKEN}\n")
    sock = home / "crush.sock"
    async with running_server(
        tmp_path,
        host=f"unix:{sock}",
        config_file=config,
        token=SERVER_TOKEN,
        token_file=home / "token",
    ) as server:
        backend = server.backend
        with trio.fail_after(10):
            ws = await backend.open(str(home), str(uuid.uuid4()))
        assert ws.sandbox is not None
        (home / "skip.py").write_text(_SKIP_SCRIPT.format(wid=ws.id))
        ctx = make_ctx(home, Asker(allow=True), ws.sandbox)
        ctx.data_dir = ws.data_dir
        result = await bash(
            ctx,
            f"cat server.json token hook-secret; ls -la crush.sock; python3 skip.py {sock}",
        )
        assert "hook-e8a1" not in result.content
        assert_no_leak(result)
        assert "HTTP/1.1 200" not in result.content
        assert ws.permissions.skip is False
        # Were the socket's path visible (a hidden list that missed it), a peer inside the
        # sandbox is refused all the same.
        bare = sandbox()
        ctx = make_ctx(home, Asker(allow=True), bare)
        ctx.data_dir = ws.data_dir
        result = await bash(ctx, f"python3 skip.py {sock}")
        assert "HTTP/1.1 403 Forbidden" in result.content, result.content
        assert "another PID or user namespace" in result.content
        assert ws.permissions.skip is False
