"""The system prompt of a turn: the template, the tools' advice, the environment, context files.

The text lives in ``templates/system.md`` (the agent's role and rules, then ``${tools}``,
``${env}`` and ``${context}``) and ``templates/tools.md`` (advice per built-in tool, one
``## name`` section each), filled with :class:`string.Template`: the template holds no logic,
and what varies is built here.

* The tools section lists the tools on offer at the turn (built-in and MCP), each with its
  advice, so a new tool appears without editing the template.
* The ``<env>`` block: working directory, platform, date, git repository (branch and a bounded
  ``git status``, see :func:`git_snapshot`), the sandbox's rules as they apply now, the model.
* The project context files (:mod:`crush_trio.agent.context_files`), each under a
  ``<file path="...">`` header.

The git snapshot is taken at a session's first turn (in this process) and kept for the session,
so the prompt, and Anthropic's prompt cache, stay the same from turn to turn; the context files
and the sandbox are read at each turn. A workspace in which git found no repository is not asked
again while nothing changed where git looks for one (:func:`repository_search_key`).
"""

from __future__ import annotations

import collections
import datetime
import functools
import importlib.resources
import os
import shutil
import stat
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Final, Protocol

import attrs
import trio

from ..tools.readonly import git_repository_state
from ..tools.sandbox import shell_env
from ..wire import SandboxInfo
from .context_files import ContextFileCache, ContextFiles, settings_for

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ..config import Config
    from ..core.model import ToolSpec

#: Longest ``git status`` run for the environment block, in seconds.
GIT_STATUS_TIMEOUT: Final = 5.0
#: Bytes of ``git status`` output read; the rest is cut (and git stopped).
GIT_STATUS_MAX_BYTES: Final = 8 * 1024
#: Lines of ``git status`` shown in the prompt.
GIT_STATUS_MAX_LINES: Final = 40
#: Longest wait for a killed git to exit (it cannot ignore SIGKILL; this bounds a shielded wait).
GIT_KILL_WAIT: Final = 2.0
#: Sessions whose git snapshot is remembered (the oldest is forgotten first).
GIT_SNAPSHOTS_KEPT: Final = 256
#: What git looks at in each directory when it searches for a repository: a ``.git`` entry, and
#: the markers of a bare repository.
GIT_SEARCHED_NAMES: Final = (".git", "HEAD", "objects", "refs", "commondir")
#: A stat changed this recently (seconds) may hide a later change in the same clock tick.
GIT_SEARCH_RACY_SECONDS: Final = 2.0

#: Environment forced on the ``git status`` run, over the scrubbed one ``bash`` gets: no system
#: or global config (the repository's own config is checked first, see :func:`git_snapshot`),
#: no network transport, no lazy fetch of a partial clone, no lock or index write, no prompt.
GIT_SAFE_ENV: Final = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_ATTR_NOSYSTEM": "1",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_OPTIONAL_LOCKS": "0",
    "GIT_NO_LAZY_FETCH": "1",
    "GIT_ALLOW_PROTOCOL": "none",
    "GIT_PAGER": "cat",
    "LC_ALL": "C",
}
#: The ``git status`` command: settings forced on the command line (no file-system monitor,
#: hooks, submodule summaries or signature checks), submodules ignored (git would run in them
#: with their own config), no rename detection (status then reads no file contents).
GIT_STATUS_COMMAND: Final = (
    "git",
    "-c",
    "core.fsmonitor=false",
    "-c",
    "core.hooksPath=" + os.devnull,
    "-c",
    "log.showSignature=false",
    "-c",
    "status.submoduleSummary=false",
    "--no-optional-locks",
    "--no-pager",
    "status",
    "--porcelain=v1",
    "--branch",
    "--untracked-files=normal",
    "--ignore-submodules=all",
    "--no-renames",
)

_TEMPLATES: Final = "templates"
#: How ``git status --branch`` names the branch of a repository without commits.
_NO_COMMITS: Final = "No commits yet on "


@functools.cache
def _template(name: str) -> str:
    return (importlib.resources.files(__package__) / _TEMPLATES / name).read_text("utf-8")


@functools.cache
def tool_advice() -> dict[str, str]:
    """The advice of ``templates/tools.md``, by tool name."""
    advice: dict[str, str] = {}
    name = None
    for line in _template("tools.md").splitlines():
        if line.startswith("## "):
            name = line[3:].strip()
            advice[name] = ""
        elif name is not None and line.strip():
            advice[name] = f"{advice[name]} {line.strip()}".strip()
    return advice


def tools_section(specs: Sequence[ToolSpec]) -> str:
    """One line per tool on offer: its advice, or the first line of its own description."""
    if not specs:
        return "No tools are on offer in this conversation: answer from what you know."
    advice = tool_advice()
    lines = []
    for spec in specs:
        text = advice.get(spec.name) or (spec.description.strip().splitlines() or [""])[0]
        lines.append(f"- `{spec.name}`: {text}".rstrip(": "))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The environment


@attrs.frozen
class GitSnapshot:
    """What the environment block says about git: whether the workspace is in a repository,
    its branch line and its status lines, or why the status is not shown."""

    repository: bool = False
    branch: str = ""
    status: tuple[str, ...] = ()
    note: str = ""


async def git_snapshot(path: Path, *, within: float = GIT_STATUS_TIMEOUT) -> GitSnapshot:
    """The workspace's git state, read with ``git status`` under forced-safe settings.

    The repository's config is checked first (:func:`~crush_trio.tools.readonly.
    git_repository_state`): one that names a program (fsmonitor, filters, textconv, external
    diff...) or includes another file is not run at all. Output is read up to
    :data:`GIT_STATUS_MAX_BYTES`; the run is stopped after ``within`` seconds.

    Cancellation: the git process is killed.
    """
    if shutil.which("git") is None:
        if not any((d / ".git").exists() for d in (path, *path.parents)):
            return GitSnapshot()
        return GitSnapshot(
            True, note="status not read: git could not run (No such file or directory)"
        )
    state = await trio.to_thread.run_sync(git_repository_state, path)
    if state == "none":
        return GitSnapshot()
    if state == "unsafe":
        return GitSnapshot(
            True,
            note="status not read: the repository's git config names programs or includes "
            "other files (or .git is a link or a file); run git status yourself if you need it",
        )
    try:
        output, code, stopped = await _run_git_status(path, within)
    except OSError as exc:  # no git on PATH, or it cannot be started
        return GitSnapshot(True, note=f"status not read: git could not run ({exc.strerror})")
    if stopped:
        return GitSnapshot(True, note=f"status not read: git status took over {within:g} s")
    cut = len(output) > GIT_STATUS_MAX_BYTES
    lines = output[:GIT_STATUS_MAX_BYTES].decode("utf-8", "replace").splitlines()
    if cut:
        lines = lines[:-1]  # the last line may be cut in the middle
    elif code != 0:
        return GitSnapshot(True, note=f"status not read: git status exited with {code}")
    branch = ""
    if lines and lines[0].startswith("## "):
        branch = lines.pop(0)[3:]
        if branch.startswith(_NO_COMMITS):
            branch = branch.removeprefix(_NO_COMMITS) + ", no commits yet"
    more = len(lines) > GIT_STATUS_MAX_LINES or cut
    status = tuple(lines[:GIT_STATUS_MAX_LINES])
    return GitSnapshot(True, branch, status, "more changes not shown" if more else "")


def repository_search_key(path: Path, *, follow: bool = True) -> tuple[object, ...] | None:
    """The stat of every place git looks for a repository from ``path``: each of
    :data:`GIT_SEARCHED_NAMES` in ``path`` and in each of its parents (and, for a symbolic link,
    its target). None when one changed within :data:`GIT_SEARCH_RACY_SECONDS` or cannot be
    read: then it cannot say that nothing changed.

    ``follow`` False: None also when a place is a symbolic link (its target is not looked at).

    Blocking:
        Stats files; call it in a thread. With ``follow`` False it is only ``lstat`` of names in
        the directories of ``path``'s resolved path, nothing behind a link: cheap enough for the
        event loop, which resolves that path anyway.
    """
    key: list[object] = []
    recent = time.time_ns() - int(GIT_SEARCH_RACY_SECONDS * 1e9)
    directory = os.path.realpath(path)
    while True:
        for name in GIT_SEARCHED_NAMES:
            place = os.path.join(directory, name)
            try:
                found = [os.lstat(place)]
                if stat.S_ISLNK(found[0].st_mode):
                    if not follow:
                        return None
                    found.append(os.stat(place))
            except (FileNotFoundError, NotADirectoryError):
                key.append(None)
                continue
            except OSError:
                return None
            for st in found:
                if max(st.st_mtime_ns, st.st_ctime_ns) > recent:
                    return None
                key.append(
                    (st.st_ino, st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                )
        parent = os.path.dirname(directory)
        if parent == directory:
            return tuple(key)
        directory = parent


async def _run_git_status(path: Path, within: float) -> tuple[bytes, int | None, bool]:
    """Run :data:`GIT_STATUS_COMMAND`: its output (at most one byte over the bound), its exit
    code, and whether it was stopped at ``within`` seconds.

    Raises:
        OSError: git could not be started.

    Cancellation: git is killed and reaped before the cancellation propagates.
    """
    process = await trio.lowlevel.open_process(
        GIT_STATUS_COMMAND,
        cwd=path,
        env={**shell_env(), **GIT_SAFE_ENV},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    chunks: list[bytes] = []
    code: int | None = None
    try:
        with trio.move_on_after(within) as scope:
            size = 0
            while size <= GIT_STATUS_MAX_BYTES:
                chunk = await process.stdout.receive_some(GIT_STATUS_MAX_BYTES + 1 - size)
                if not chunk:
                    break
                chunks.append(bytes(chunk))
                size += len(chunk)
            if size <= GIT_STATUS_MAX_BYTES:
                code = await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
        with trio.move_on_after(GIT_KILL_WAIT, shield=True):
            await process.wait()  # reaped, also when this is cancelled
        await process.stdout.aclose()
    return b"".join(chunks), code, scope.cancelled_caught


def git_lines(git: GitSnapshot) -> list[str]:
    if not git.repository:
        return ["Git repository: no"]
    lines = ["Git repository: yes" + (f" (branch {git.branch})" if git.branch else "")]
    if git.status or git.note:
        lines.append("Git status at the session's first prompt (may be outdated since):")
        lines += [f"  {line}" for line in git.status]
        if git.note:
            lines.append(f"  ({git.note})")
    elif git.branch:
        lines.append("Git status at the session's first prompt: clean")
    return lines


def sandbox_lines(sandbox: SandboxInfo, workspace: Path, data_dir: Path | None) -> list[str]:
    """The rules ``bash`` commands run under now (docs/tools.md, Security model)."""
    if not sandbox.active:
        return [
            f"Sandbox: none ({sandbox.reason or 'not available'}). Every bash command asks the "
            "user for permission first, and once allowed it can read and change anything the "
            "user's account can: be careful."
        ]
    lines = [
        "Sandbox: bash commands run in an OS sandbox. The workspace is writable for commands "
        "the user approved and read-only for commands that ran without asking. /tmp is private "
        "to each command and emptied after it; HOME is an empty directory; files outside the "
        "workspace, /tmp and the system directories are absent; the user's credentials are "
        "hidden.",
    ]
    if data_dir is not None and (data_dir == workspace or workspace in data_dir.parents):
        lines.append(f"Read-only for commands: {data_dir} (the agent's own data).")
    if sandbox.network:
        lines.append("Network: on for every command.")
    else:
        lines.append(
            "Network: off. A command that needs it (a download, a package install) must be "
            "called with network: true, which asks the user."
        )
    return lines


@attrs.frozen
class Environment:
    """What the ``<env>`` block says."""

    working_dir: Path
    platform: str
    date: datetime.date
    git: GitSnapshot
    sandbox: SandboxInfo
    data_dir: Path | None
    model: str

    def render(self) -> str:
        lines = [
            f"Working directory: {self.working_dir}",
            f"Platform: {self.platform}",
            f"Today's date: {self.date.isoformat()}",
            *git_lines(self.git),
            *sandbox_lines(self.sandbox, self.working_dir, self.data_dir),
            f"Model: {self.model}",
        ]
        return "\n".join(lines)


def context_section(context: ContextFiles) -> str:
    if not context.files:
        return ""
    parts = [
        "",
        "<project_context>",
        "Instructions from the project's and the user's context files. Follow them: they say "
        "how this project is built, tested and written.",
    ]
    for file in context.files:
        parts += [f'<file path="{file.path}">', file.content.rstrip("\n"), "</file>"]
    parts.append("</project_context>")
    return "\n".join(parts)


def render_system_prompt(
    tools: Sequence[ToolSpec], env: Environment | None, context: ContextFiles
) -> str:
    """The whole system prompt (``env`` None: an environment line saying it is unknown)."""
    return (
        string.Template(_template("system.md"))
        .substitute(
            tools=tools_section(tools),
            env=env.render() if env is not None else "Environment: not known.",
            context=context_section(context),
        )
        .rstrip("\n")
    )


# ---------------------------------------------------------------------------------------------
# Per workspace


class PromptSource(Protocol):
    """What the system prompt reads from its workspace at each turn."""

    path: Path
    trusted: bool
    data_dir: Path
    config: Config

    @property
    def sandbox_info(self) -> SandboxInfo: ...


class SystemPrompts:
    """Builds the system prompt of a workspace's turns (see the module docstring).

    Args:
        source: the workspace (path, trust, sandbox, config: read at each turn).
        user_dir: the user config directory, home of the user's own context files.
        today: the date (tests may fix it).
    """

    def __init__(
        self,
        source: PromptSource,
        *,
        user_dir: Path | None,
        today: Callable[[], datetime.date] = datetime.date.today,
    ) -> None:
        self.source = source
        self.user_dir = user_dir
        self.today = today
        self.context = ContextFileCache()
        self._git: collections.OrderedDict[str, GitSnapshot] = collections.OrderedDict()
        #: :func:`repository_search_key` when git last found no repository (None: it did).
        self._no_repository: tuple[object, ...] | None = None

    async def context_files(self) -> ContextFiles:
        """The context files as they are now (read again only after a change)."""
        src = self.source
        options = src.config.options
        return await self.context.load(
            settings_for(
                src.path,
                self.user_dir,
                src.trusted,
                options.context_paths,
                options.context_max_file_bytes,
                options.context_max_total_bytes,
            )
        )

    async def _git_for(self, session_id: str) -> GitSnapshot:
        snapshot = self._git.get(session_id)
        if snapshot is None:
            snapshot = await self._read_git()
            self._git[session_id] = snapshot
            while len(self._git) > GIT_SNAPSHOTS_KEPT:
                self._git.popitem(last=False)
        else:
            self._git.move_to_end(session_id)
        return snapshot

    async def _read_git(self) -> GitSnapshot:
        """:func:`git_snapshot`, except that where git found no repository it is not run again
        while every place it looks is unchanged: a few stats instead of a git process (on the
        event loop when no place is a symbolic link, else in a worker thread)."""
        path = self.source.path
        key = repository_search_key(path, follow=False)
        if key is None:
            key = await trio.to_thread.run_sync(repository_search_key, path)
        if key is not None and key == self._no_repository:
            return GitSnapshot()
        snapshot = await git_snapshot(path)
        self._no_repository = None if snapshot.repository else key
        return snapshot

    async def build(self, session_id: str, tools: Sequence[ToolSpec], model: str) -> str:
        """The system prompt for a turn of ``session_id`` using ``model`` with ``tools``."""
        context = await self.context_files()
        src = self.source
        env = Environment(
            working_dir=src.path,
            platform=sys.platform,
            date=self.today(),
            git=await self._git_for(session_id),
            sandbox=src.sandbox_info,
            data_dir=src.data_dir,
            model=model,
        )
        return render_system_prompt(tools, env, context)
