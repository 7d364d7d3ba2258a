"""A shadow git object database that snapshots a workspace without touching the user's ``.git``.

The database lives in the workspace's data directory (``<data>/snapshots/git``) and is driven with
the git command line: ``git --git-dir=<shadow> --work-tree=<workspace>``. A snapshot updates the
shadow index from the files that differ from it and writes a tree object; the tree's id names the
snapshot. The index keeps each file's stat data, so a snapshot of a tree in which nothing changed
only stats the files (``git ls-files --modified --others``) and re-writes no object: on 20,000
files that is one ``lstat`` each plus a cached ``write-tree`` (figures in docs/performance.md).

What is snapshotted: every file git would see in the workspace, honouring the workspace's own
``.gitignore`` files, minus regular files larger than ``max_file_bytes`` (:data:`MAX_FILE_BYTES`
by default) and anything that is not a regular file or a symbolic link (nested repositories,
FIFOs, sockets). The data directory has a ``.gitignore`` of ``*`` and is also excluded here.

Forced-safe git: the workspace is hostile input. Every command runs with ``GIT_CONFIG_NOSYSTEM``,
no global config (``GIT_CONFIG_GLOBAL=/dev/null``, ``HOME`` pointing into the shadow directory),
no system attributes, hooks pointed at ``/dev/null``, no fsmonitor, no external diff and no
textconv; the shadow ``info/attributes`` turns off every content filter and line-ending
conversion (``* -text -filter -ident -eol -working-tree-encoding``), so what is stored is the
file's bytes and no configured program ever runs. Restoring files never uses ``git checkout``:
:mod:`crush_trio.changes.revert` writes the stored bytes itself.

Everything here is blocking; :class:`crush_trio.changes.service.ChangeLog` calls it in a worker
thread, one operation at a time per workspace.
"""

from __future__ import annotations

import os
import stat
import subprocess
from typing import TYPE_CHECKING, Final

import attrs

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence
    from pathlib import Path

#: Regular files larger than this (bytes) are not snapshotted (``changes.max_file_bytes``).
MAX_FILE_BYTES: Final = 4 * 1024 * 1024
#: Bound on one git command (seconds): a command still running then is killed.
GIT_TIMEOUT: Final = 120.0
#: The id of git's empty tree (a snapshot of an empty workspace).
EMPTY_TREE: Final = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"

_ATTRIBUTES: Final = "* -text -filter -ident -eol -working-tree-encoding\n"
_CONFIG: Final = (
    "[core]\n"
    "\trepositoryformatversion = 0\n"
    "\tbare = false\n"
    "\tfilemode = true\n"
    "\tsymlinks = true\n"
    "\tautocrlf = false\n"
    "\tsafecrlf = false\n"
    "\tquotepath = false\n"
    "\thooksPath = /dev/null\n"
    "\tfsmonitor = false\n"
    "\tsplitIndex = false\n"
    "[gc]\n"
    "\tauto = 0\n"
    "[diff]\n"
    "\texternal =\n"
    "\trenames = false\n"
)
#: Options given on every command line, so even a config file changed behind our back cannot
#: turn on a hook, a monitor or an external program.
_SAFE_OPTIONS: Final = (
    "-c",
    "core.hooksPath=/dev/null",
    "-c",
    "core.fsmonitor=false",
    "-c",
    "core.autocrlf=false",
    "-c",
    "core.quotepath=false",
    "-c",
    "diff.external=",
    "-c",
    "gc.auto=0",
    "-c",
    "protocol.allow=never",
)

MODE_FILE: Final = "100644"
MODE_EXEC: Final = "100755"
MODE_LINK: Final = "120000"


class GitError(Exception):
    """A git command failed or ran past :data:`GIT_TIMEOUT`."""


@attrs.frozen
class Entry:
    """One file of a snapshot: its git mode (``100644``, ``100755``, ``120000``) and blob id."""

    mode: str
    sha: str


@attrs.frozen
class RawChange:
    """One path that differs between two snapshots (``status`` A, M, D or T)."""

    path: str
    status: str
    old: Entry | None
    new: Entry | None


class ShadowRepo:
    """The snapshots of one workspace (blocking; see the module docstring).

    Args:
        workspace: the project directory.
        git_dir: where the shadow database lives (created by :meth:`init`).
        exclude: paths inside the workspace that are never snapshotted (the data directory).
        max_file_bytes: regular files larger than this are left out.
    """

    def __init__(
        self,
        workspace: Path,
        git_dir: Path,
        *,
        exclude: Iterable[Path] = (),
        max_file_bytes: int = MAX_FILE_BYTES,
        timeout: float = GIT_TIMEOUT,
    ) -> None:
        self.workspace = workspace
        self.git_dir = git_dir
        self.max_file_bytes = max_file_bytes
        self.timeout = timeout
        self._exclude = [p for p in exclude]
        self._env = self._make_env()
        #: The git command running now (one at a time: the change log serializes them).
        self._running: subprocess.Popen[bytes] | None = None
        #: Set by :meth:`kill`: every later command fails at once.
        self._killed = False

    def kill(self) -> None:
        """Stop the running command and refuse later ones (the workspace is closing); callable
        from any thread."""
        self._killed = True
        proc = self._running
        if proc is not None:
            proc.kill()

    def _make_env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("GIT_") and k not in ("HOME", "XDG_CONFIG_HOME")
        }
        env.update(
            GIT_DIR=str(self.git_dir),
            GIT_WORK_TREE=str(self.workspace),
            GIT_CONFIG_NOSYSTEM="1",
            GIT_CONFIG_GLOBAL=os.devnull,
            GIT_ATTR_NOSYSTEM="1",
            GIT_TERMINAL_PROMPT="0",
            GIT_NO_REPLACE_OBJECTS="1",
            HOME=str(self.git_dir),
            XDG_CONFIG_HOME=str(self.git_dir),
            LC_ALL="C",
        )
        return env

    # -- plumbing

    def git(self, *args: str, stdin: bytes | None = None, max_output: int | None = None) -> bytes:
        """Run one git command; its stdout (cut at ``max_output`` bytes when given).

        Raises:
            GitError: it exited non-zero or ran past the timeout.
        """
        cmd = ["git", *_SAFE_OPTIONS, *args]
        if self._killed:
            raise GitError("the snapshot store is closing")
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self._env,
                cwd=self.workspace,
            )
        except OSError as exc:
            raise GitError(f"cannot run git: {exc}") from exc
        self._running = proc
        try:
            return self._finish(proc, args, stdin, max_output)
        finally:
            self._running = None

    def _finish(
        self,
        proc: subprocess.Popen[bytes],
        args: Sequence[str],
        stdin: bytes | None,
        max_output: int | None,
    ) -> bytes:
        if max_output is None:
            try:
                out, err = proc.communicate(stdin, timeout=self.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise GitError(f"git {args[0]} ran past {self.timeout:.0f}s") from None
        else:
            assert proc.stdout is not None
            assert stdin is None
            out = proc.stdout.read(max_output + 1)
            proc.kill() if len(out) > max_output else None
            try:
                _, err = proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise GitError(f"git {args[0]} ran past {self.timeout:.0f}s") from None
            if len(out) > max_output:
                return out
        if proc.returncode != 0:
            detail = err.decode(errors="replace").strip()[:500]
            raise GitError(f"git {args[0]} failed ({proc.returncode}): {detail}")
        return out

    def init(self) -> None:
        """Create the shadow database if missing, (re)write its safe config, and clear a lock
        a killed process left behind (this process is the database's only user)."""
        self.git_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not (self.git_dir / "objects").is_dir():
            env = {k: v for k, v in self._env.items() if k not in ("GIT_DIR", "GIT_WORK_TREE")}
            try:
                subprocess.run(
                    ["git", *_SAFE_OPTIONS, "init", "-q", "--bare", str(self.git_dir)],
                    env=env,
                    check=True,
                    capture_output=True,
                    timeout=self.timeout,
                )
            except (OSError, subprocess.SubprocessError) as exc:
                raise GitError(f"cannot create the snapshot database: {exc}") from exc
        (self.git_dir / "config").write_text(_CONFIG)
        hooks = self.git_dir / "hooks"
        if hooks.is_dir():
            for sample in hooks.iterdir():
                sample.unlink(missing_ok=True)
        info = self.git_dir / "info"
        info.mkdir(exist_ok=True)
        (info / "attributes").write_text(_ATTRIBUTES)
        excludes = [".git/\n"]
        for path in self._exclude:
            try:
                rel = path.resolve().relative_to(self.workspace.resolve())
            except ValueError:
                continue
            if rel.parts:
                excludes.append("/" + rel.as_posix() + "/\n")
        (info / "exclude").write_text("".join(excludes))
        (self.git_dir / "index.lock").unlink(missing_ok=True)

    # -- snapshots

    def snapshot(self) -> str:
        """Bring the shadow index up to date with the workspace; the tree id of the result."""
        listed = self.git(
            "ls-files", "-z", "--others", "--modified", "--deleted", "--exclude-standard"
        )
        update: list[bytes] = []
        drop: list[bytes] = []
        seen: set[bytes] = set()
        root = os.fsencode(self.workspace)
        linked: dict[bytes, bool] = {}
        for raw in listed.split(b"\0"):
            if not raw or raw in seen or raw.endswith(b"/"):
                continue  # a nested repository is listed as "dir/": never snapshotted
            seen.add(raw)
            if _beyond_link(root, raw, linked):
                drop.append(raw)  # its directory is now a link: git would refuse it
                continue
            try:
                st = os.lstat(os.path.join(root, raw))
            except OSError:
                drop.append(raw)  # gone (or unreadable): out of the index
                continue
            if stat.S_ISLNK(st.st_mode) or (
                stat.S_ISREG(st.st_mode) and st.st_size <= self.max_file_bytes
            ):
                update.append(raw)
            else:
                drop.append(raw)  # oversized or not a file: not snapshotted
        if update:
            # --replace: a path whose directory became a file or a link (or the reverse).
            self.git("update-index", "--add", "--replace", "-z", "--stdin", stdin=_z(update))
        if drop:
            self.git("update-index", "--force-remove", "-z", "--stdin", stdin=_z(drop))
        return self.git("write-tree").decode().strip()

    def keep(self, refs: Iterable[tuple[str, str]]) -> None:
        """Point each ``refs/crush/<ref>`` at its tree so their objects are kept: one git
        command for all of them (``ref`` names are plain: no spaces, no newlines)."""
        lines = b"".join(f"update refs/crush/{ref} {tree}\n".encode() for ref, tree in refs)
        if lines:
            self.git("update-ref", "--stdin", stdin=lines)

    def has_object(self, sha: str) -> bool:
        try:
            self.git("cat-file", "-e", sha)
        except GitError:
            return False
        return True

    # -- reading snapshots

    def changes(self, old: str, new: str, paths: Sequence[str] | None = None) -> list[RawChange]:
        """The paths that differ between two trees (no rename detection)."""
        args = ["diff-tree", "-r", "-z", "--no-renames", "--raw", old, new]
        if paths is not None:
            if not paths:
                return []
            args += ["--", *(":(literal)" + p for p in paths)]
        out = self.git(*args)
        fields = out.split(b"\0")
        result = []
        i = 0
        while i + 1 < len(fields):
            meta = fields[i].decode()
            path = os.fsdecode(fields[i + 1])
            i += 2
            if not meta.startswith(":"):
                continue
            old_mode, new_mode, old_sha, new_sha, status = meta[1:].split(" ")
            result.append(
                RawChange(
                    path,
                    status[:1],
                    None if old_mode == "000000" else Entry(old_mode, old_sha),
                    None if new_mode == "000000" else Entry(new_mode, new_sha),
                )
            )
        return result

    def numstat(self, old: str, new: str) -> dict[str, tuple[int, int] | None]:
        """Lines added and removed per changed path (None: a binary file)."""
        out = self.git("diff-tree", "-r", "-z", "--no-renames", "--numstat", old, new)
        result: dict[str, tuple[int, int] | None] = {}
        for record in out.split(b"\0"):
            if not record:
                continue
            added, removed, path = record.split(b"\t", 2)
            key = os.fsdecode(path)
            result[key] = None if added == b"-" else (int(added), int(removed))
        return result

    def patch(self, old: str, new: str, paths: Sequence[str] | None, max_bytes: int) -> bytes:
        """The unified diff between two trees, at most ``max_bytes + 1`` bytes (more: cut)."""
        args = [
            "diff-tree",
            "-r",
            "-p",
            "--no-renames",
            "--no-ext-diff",
            "--no-textconv",
            "--no-color",
            old,
            new,
        ]
        if paths is not None:
            if not paths:
                return b""
            args += ["--", *(":(literal)" + p for p in paths)]
        return self.git(*args, max_output=max_bytes)

    def entries(self, tree: str, paths: Iterable[str]) -> dict[str, Entry]:
        """The entries of ``paths`` in ``tree`` (paths absent from it are left out)."""
        wanted = set(paths)
        if not wanted:
            return {}
        out = self.git("ls-tree", "-r", "-z", "--full-tree", tree)
        result = {}
        for record in out.split(b"\0"):
            if not record:
                continue
            meta, path = record.split(b"\t", 1)
            key = os.fsdecode(path)
            if key in wanted:
                mode, _kind, sha = meta.decode().split(" ")
                result[key] = Entry(mode, sha)
        return result

    def blob(self, sha: str) -> bytes:
        return self.git("cat-file", "blob", sha)


def _beyond_link(root: bytes, raw: bytes, cache: dict[bytes, bool]) -> bool:
    """Whether a directory on the way to ``raw`` is a symbolic link (or not a directory)."""
    parts = raw.split(b"/")[:-1]
    prefix = b""
    for part in parts:
        prefix = prefix + b"/" + part if prefix else part
        found = cache.get(prefix)
        if found is None:
            try:
                mode = os.lstat(os.path.join(root, prefix)).st_mode
                found = not stat.S_ISDIR(mode)
            except OSError:
                found = False  # missing: the file is simply gone
            cache[prefix] = found
        if found:
            return True
    return False


def _z(paths: Sequence[bytes]) -> bytes:
    return b"".join(p + b"\0" for p in paths)
