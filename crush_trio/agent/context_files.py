"""Project context files: the instructions a project and its user leave for coding agents.

What is read, in this order (each file once, however many names lead to it):

1. the user's own files, ``AGENTS.md`` and ``CRUSH.md`` in the user config directory
   (``$XDG_CONFIG_HOME/crush-trio``);
2. the files Crush looks for in the workspace (:data:`DEFAULT_CONTEXT_PATHS`: ``AGENTS.md``,
   ``CRUSH.md``, ``CLAUDE.md``, ``GEMINI.md``, ``.cursorrules``,
   ``.github/copilot-instructions.md``, the ``.cursor/rules/`` directory, their ``.local``
   variants...);
3. ``options.context_paths``: files, or directories whose files are read in name order (relative
   paths start at the workspace; ``~`` and absolute paths come only from trusted files, see
   :mod:`crush_trio.config.trust`).

Bounds and refusals (each refusal is listed with its reason in ``GET .../agent``):

* a file is cut at ``options.context_max_file_bytes`` and all of them together at
  ``options.context_max_total_bytes``, with a note in the prompt; files past the total are
  skipped;
* only regular files: checked with ``stat`` before opening (a device is never opened), opened
  with ``O_NONBLOCK`` (a FIFO cannot block the open) and checked again with ``fstat``;
* in an untrusted workspace, a path that leads out of it through a symlink, and a file with other
  hard links (it may be a file from elsewhere), are refused: the repository decides what is in
  it, not what else on the machine the model gets to read;
* a directory gives at most :data:`MAX_DIRECTORY_FILES` files, :data:`MAX_DIRECTORY_DEPTH` deep;
  files with NUL bytes (binary) are skipped.

Everything here blocks on the file system: :class:`ContextFileCache` runs it in a worker thread.
Re-reading is cheap when nothing changed: each turn stats the candidates and compares their
signature (device, inode, size, times) with the last read's; only a change reads files again.

One check runs on the event loop instead, because a worker thread's round trip costs a turn far
more than the check itself when many turns start at once (the thread waits for the interpreter
at each of its system calls): :func:`quick_signature`, an ``lstat`` of each fixed name directly
in the workspace (already resolved for the turn) and the user config directory. It never follows
a symbolic link and never reads; where it cannot tell (a link, a directory, a configured path)
it says so, and the turn checks in the worker thread as before.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Final

import attrs
import trio

from ..defaults import BINARY_SNIFF_BYTES

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

#: Files and directories Crush reads from a workspace (its ``defaultContextPaths``), with the
#: ``.local`` variants of ``AGENTS.md`` and ``GEMINI.md`` added; a name ending in ``/`` is a
#: directory.
DEFAULT_CONTEXT_PATHS: Final[tuple[str, ...]] = (
    ".github/copilot-instructions.md",
    ".cursorrules",
    ".cursor/rules/",
    "CLAUDE.md",
    "CLAUDE.local.md",
    "GEMINI.md",
    "gemini.md",
    "GEMINI.local.md",
    "crush.md",
    "crush.local.md",
    "Crush.md",
    "Crush.local.md",
    "CRUSH.md",
    "CRUSH.local.md",
    "AGENTS.md",
    "agents.md",
    "Agents.md",
    "AGENTS.local.md",
)
#: The user's own context files, in the user config directory.
USER_CONTEXT_FILES: Final[tuple[str, ...]] = ("AGENTS.md", "CRUSH.md")
#: Files taken from one context directory at most (the rest are skipped, with a note).
MAX_DIRECTORY_FILES: Final = 100
#: Levels below a context directory that are searched.
MAX_DIRECTORY_DEPTH: Final = 8
#: Directory entries (files and subdirectories) looked at in one context directory at most, so
#: a huge tree costs little at each turn.
MAX_DIRECTORY_ENTRIES: Final = 2000

#: Reasons a file is skipped (``GET .../agent`` shows them).
NOT_FOUND: Final = "not found"
NOT_REGULAR: Final = "not a regular file"
OUTSIDE: Final = "a symlink leading outside the untrusted workspace"
HARD_LINKED: Final = "a file with other hard links in an untrusted workspace"
BINARY: Final = "a binary file"
TOTAL_REACHED: Final = "options.context_max_total_bytes reached"
TOO_MANY: Final = (
    f"more than {MAX_DIRECTORY_FILES} files or {MAX_DIRECTORY_ENTRIES} entries in the directory"
)
UNREADABLE: Final = "cannot be read"


@attrs.frozen
class ContextFile:
    """One file put in the prompt: its shown path, its text (cut when ``truncated``), and its
    size on disk in bytes."""

    path: str
    content: str
    size: int
    truncated: bool = False


@attrs.frozen
class SkippedFile:
    """A context file that is not in the prompt, and why."""

    path: str
    reason: str


@attrs.frozen
class ContextFiles:
    """What the last read found."""

    files: tuple[ContextFile, ...] = ()
    skipped: tuple[SkippedFile, ...] = ()


@attrs.frozen
class ContextSettings:
    """What decides which files are read and how much of them."""

    workspace: Path
    user_dir: Path | None
    trusted: bool
    context_paths: tuple[str, ...]
    max_file_bytes: int
    max_total_bytes: int


@attrs.frozen
class _Candidate:
    """A path to read: ``shown`` in the prompt, ``anchored`` when it comes from the workspace
    (so an untrusted workspace may not lead it elsewhere), ``explicit`` when a missing file is
    worth a note."""

    path: Path
    shown: str
    anchored: bool
    explicit: bool


# ---------------------------------------------------------------------------------------------
# Finding the candidates


def _shown(path: Path, workspace: Path) -> str:
    try:
        return path.relative_to(workspace).as_posix()
    except ValueError:
        return str(path)


def _expand(raw: str, workspace: Path) -> tuple[Path, bool]:
    """A ``context_paths`` entry as a path, and whether it is anchored in the workspace."""
    if raw.startswith("~"):
        return Path(raw).expanduser(), False
    path = Path(raw)
    if path.is_absolute():
        return path, False
    return workspace / path, True


def _walk(root: Path, shown: str, anchored: bool) -> Iterator[_Candidate | SkippedFile]:
    """The files of a context directory in name order, depth-first, bounded (symlinked
    directories are not followed; symlinked files are checked when read)."""
    count = 0
    looked = 0
    stack: list[tuple[Path, int]] = [(root, 0)]
    while stack:
        directory, depth = stack.pop()
        entries: list[os.DirEntry[str]] = []
        try:
            with os.scandir(directory) as listing:
                for entry in listing:
                    looked += 1
                    if looked > MAX_DIRECTORY_ENTRIES:
                        yield SkippedFile(shown, TOO_MANY)
                        return
                    entries.append(entry)
        except OSError:
            yield SkippedFile(shown, UNREADABLE)
            continue
        entries.sort(key=lambda e: e.name)
        subdirs: list[Path] = []
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if is_dir:
                if depth + 1 < MAX_DIRECTORY_DEPTH:
                    subdirs.append(Path(entry.path))
                continue
            count += 1
            if count > MAX_DIRECTORY_FILES:
                yield SkippedFile(shown, TOO_MANY)
                return
            path = Path(entry.path)
            rel = path.relative_to(root).as_posix()
            yield _Candidate(path, f"{shown.rstrip('/')}/{rel}", anchored, explicit=True)
        stack.extend((d, depth + 1) for d in reversed(subdirs))


def candidates(settings: ContextSettings) -> Iterator[_Candidate | SkippedFile]:
    """Every path to try, in prompt order (directories expanded)."""
    if settings.user_dir is not None:
        for name in USER_CONTEXT_FILES:
            path = settings.user_dir / name
            yield _Candidate(path, str(path), anchored=False, explicit=False)
    workspace = settings.workspace
    entries = [(p, False) for p in DEFAULT_CONTEXT_PATHS]
    entries += [(p, True) for p in settings.context_paths]
    for raw, explicit in entries:
        path, anchored = _expand(raw, workspace)
        shown = _shown(path, workspace) if anchored else raw
        try:
            st = os.stat(path)
        except OSError:
            if explicit:
                yield SkippedFile(shown, NOT_FOUND)
            continue
        if stat.S_ISDIR(st.st_mode):
            if anchored and not settings.trusted and not _inside(path, workspace):
                yield SkippedFile(shown, OUTSIDE)
                continue
            yield from _walk(path, shown, anchored)
        elif not raw.endswith("/"):
            yield _Candidate(path, shown, anchored, explicit)


def _inside(path: Path, workspace: Path) -> bool:
    real = Path(os.path.realpath(path))
    return real == workspace or workspace in real.parents


# ---------------------------------------------------------------------------------------------
# Signatures and reading


Signature = tuple[object, ...]


def quick_signature(settings: ContextSettings) -> Signature | None:
    """:func:`signature` where it can be had from ``lstat`` alone: every candidate is one of the
    fixed names (no ``options.context_paths``), and each is absent or a regular file. None when
    one is anything else (a symbolic link, a directory, a device, an error): then only
    :func:`signature` can tell.

    Blocking:
        Only ``lstat`` of names in two directories the caller has resolved (the workspace and
        the user config directory), and of the subdirectory of a nested name when it is a real
        directory; nothing behind a symbolic link (which could lead anywhere, a mount that
        hangs included) and nothing read. Cheap enough for the event loop.
    """
    if settings.context_paths:
        return None
    parts: list[object] = [settings]
    join = os.path.join
    if settings.user_dir is not None:
        user_dir = os.fspath(settings.user_dir)
        for name in USER_CONTEXT_FILES:
            if not _add_quick(parts, join(user_dir, name)):
                return None
    workspace = os.fspath(settings.workspace)
    subdirs: dict[str, bool] = {}  # a nested name's subdirectory: True when it is a directory
    for subdir, name in _QUICK_NAMES:
        if subdir:
            is_dir = subdirs.get(subdir)
            if is_dir is None:
                kind = _lstat_kind(join(workspace, subdir))
                if kind is None or kind not in (stat.S_IFDIR, 0):
                    return None
                is_dir = subdirs[subdir] = kind == stat.S_IFDIR
            if not is_dir:
                parts.append(None)
                continue
        if not _add_quick(parts, join(workspace, name)):
            return None
    return tuple(parts)


#: :data:`DEFAULT_CONTEXT_PATHS` as (subdirectory or "", name) for :func:`quick_signature`.
_QUICK_NAMES: Final = tuple(
    (os.path.dirname(name.rstrip("/")), name.rstrip("/")) for name in DEFAULT_CONTEXT_PATHS
)


def _add_quick(parts: list[object], path: str) -> bool:
    """Append ``path``'s ``lstat`` data (None when it is absent) to ``parts``; False when it is
    neither absent nor a regular file, or cannot be looked at."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parts.append(None)
        return True
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return False
    times = (st.st_mtime_ns, st.st_ctime_ns)
    parts.append((st.st_dev, st.st_ino, st.st_mode, st.st_size, *times, st.st_nlink))
    return True


def _lstat_kind(path: str) -> int | None:
    """The file type bits of ``path`` (``lstat``), 0 when it does not exist, None on an error."""
    try:
        return stat.S_IFMT(os.lstat(path).st_mode)
    except FileNotFoundError:
        return 0
    except OSError:
        return None


def signature(settings: ContextSettings) -> Signature:
    """What the files look like now, without reading them: a change of any candidate's
    identity, size or times (or of the settings) changes it."""
    parts: list[object] = [settings]
    for item in candidates(settings):
        if isinstance(item, SkippedFile):
            parts.append(item)
            continue
        try:
            lst = os.lstat(item.path)
            st = os.stat(item.path)
        except OSError:
            parts.append((str(item.path), None))
            continue
        parts.append(
            (
                str(item.path),
                lst.st_ino,
                st.st_dev,
                st.st_ino,
                st.st_mode,
                st.st_size,
                st.st_mtime_ns,
                st.st_ctime_ns,
                st.st_nlink,
            )
        )
    return tuple(parts)


def _read_bounded(path: Path, limit: int) -> tuple[bytes, int] | str:
    """Up to ``limit`` bytes of a regular file and its size, or the reason it is refused."""
    try:
        st = os.stat(path)
    except OSError:
        return NOT_FOUND
    if not stat.S_ISREG(st.st_mode):
        return NOT_REGULAR  # never opened: opening a device can have effects
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return UNREADABLE
    try:
        fst = os.fstat(fd)
        if not stat.S_ISREG(fst.st_mode):
            return NOT_REGULAR  # swapped for a FIFO or a device after the stat
        chunks: list[bytes] = []
        left = limit
        while left > 0:
            chunk = os.read(fd, min(left, 64 * 1024))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), fst.st_size
    except OSError:
        return UNREADABLE
    finally:
        os.close(fd)


def _cut_note(shown: str, size: int, kept: int, key: str) -> str:
    return (
        f"\n[... {shown} is {size} bytes; only its first {kept} bytes are shown "
        f"(options.{key}) ...]"
    )


def read_context_files(settings: ContextSettings) -> ContextFiles:
    """Read every context file within the bounds (see the module docstring).

    Blocking:
        Reads the file system; call it in a thread.
    """
    files: list[ContextFile] = []
    skipped: list[SkippedFile] = []
    seen: set[tuple[int, int]] = set()
    total_left = settings.max_total_bytes
    for item in candidates(settings):
        if isinstance(item, SkippedFile):
            skipped.append(item)
            continue
        if item.anchored and not settings.trusted and not _inside(item.path, settings.workspace):
            skipped.append(SkippedFile(item.shown, OUTSIDE))
            continue
        try:
            st = os.stat(item.path)
        except OSError:
            if item.explicit:
                skipped.append(SkippedFile(item.shown, NOT_FOUND))
            continue
        key = (st.st_dev, st.st_ino)
        if key in seen:
            continue  # the same file under another name (case-insensitive file systems)
        seen.add(key)
        if not stat.S_ISREG(st.st_mode):
            skipped.append(SkippedFile(item.shown, NOT_REGULAR))
            continue
        if item.anchored and not settings.trusted and st.st_nlink > 1:
            skipped.append(SkippedFile(item.shown, HARD_LINKED))
            continue
        if total_left <= 0:
            skipped.append(SkippedFile(item.shown, TOTAL_REACHED))
            continue
        limit = min(settings.max_file_bytes, total_left)
        result = _read_bounded(item.path, limit + 1)
        if isinstance(result, str):
            skipped.append(SkippedFile(item.shown, result))
            continue
        data, size = result
        if b"\0" in data[:BINARY_SNIFF_BYTES]:
            skipped.append(SkippedFile(item.shown, BINARY))
            continue
        truncated = len(data) > limit
        data = data[:limit]
        text = data.decode("utf-8", "replace")
        if truncated:
            # Cut where the bytes were cut, without a broken character at the end.
            text = data.decode("utf-8", "ignore") if text.endswith("\ufffd") else text
            which = (
                "context_max_file_bytes"
                if limit == settings.max_file_bytes
                else "context_max_total_bytes"
            )
            text += _cut_note(item.shown, max(size, len(data) + 1), limit, which)
        total_left -= len(data)
        files.append(ContextFile(item.shown, text, size, truncated))
    return ContextFiles(tuple(files), tuple(skipped))


class ContextFileCache:
    """The context files of one workspace, read again only when they changed.

    :meth:`load` compares the candidates' :func:`quick_signature` with the one taken before the
    last read, on the event loop; when that cannot tell, or differs, it compares their
    :func:`signature` in a worker thread and reads the files again only when that changed.
    """

    def __init__(self) -> None:
        #: One load at a time (turns of several sessions may start together).
        self._lock = threading.Lock()
        self._signature: Signature | None = None
        #: The quick signature taken before the last read, and what that read found (one
        #: attribute: the event loop reads it while a thread may be replacing it).
        self._known: tuple[Signature | None, ContextFiles] = (None, ContextFiles())
        self.reads = 0
        #: Loads answered in a worker thread (the others were answered by the quick check).
        self.thread_loads = 0

    @property
    def current(self) -> ContextFiles:
        """What the last read found."""
        return self._known[1]

    def _load_sync(self, settings: ContextSettings) -> ContextFiles:
        with self._lock:
            self.thread_loads += 1
            # Taken before the signature and the read: a change after it makes the next quick
            # check differ, so the next turn reads again.
            quick = quick_signature(settings)
            sig = signature(settings)
            current = self.current
            if sig != self._signature:
                current = read_context_files(settings)
                self._signature = sig
                self.reads += 1
            self._known = (quick, current)
            return current

    async def load(self, settings: ContextSettings) -> ContextFiles:
        """The files as they are now (read again only after a change).

        Cancellation: returns at once (a file system that hangs cannot hold a cancelled turn
        or a closing workspace); the thread finishes its read in the background, and the next
        load waits for it.
        """
        quick, known = self._known
        if quick is not None and quick_signature(settings) == quick:
            await trio.lowlevel.checkpoint_if_cancelled()
            return known
        return await trio.to_thread.run_sync(self._load_sync, settings, abandon_on_cancel=True)


def settings_for(
    workspace: Path,
    user_dir: Path | None,
    trusted: bool,
    context_paths: Sequence[str],
    max_file_bytes: int,
    max_total_bytes: int,
) -> ContextSettings:
    return ContextSettings(
        workspace=Path(os.path.realpath(workspace)),
        user_dir=user_dir,
        trusted=trusted,
        context_paths=tuple(context_paths),
        max_file_bytes=max_file_bytes,
        max_total_bytes=max_total_bytes,
    )
