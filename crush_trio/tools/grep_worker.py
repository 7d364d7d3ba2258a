"""The Python search behind the ``grep`` tool when ripgrep is missing, run in a child process.

A Python regular expression can backtrack for hours (``(a+)+$`` on a long line of ``a``), and a
thread running it cannot be stopped. This module is therefore run as a script in its own process
(``python -I grep_worker.py``), which the ``grep`` tool kills at its timeout; nothing is left
behind and no worker thread of the server is held.

It imports nothing from the package (running it must not load the server), so the ``grep`` tool
and the other walkers share :func:`walk_files` and :class:`GitIgnore` from here. The only library
it needs, ``pathspec``, is found through the ``sys_path`` the tool passes in the job (the child
runs isolated, without site-packages).

Ignored files (docs/tools.md "Ignored files"): ``ls``, ``glob`` and this search skip what the
project's ``.gitignore`` files exclude, as ripgrep does: the ``.gitignore`` of every directory
walked, and of its parents up to the repository root (the nearest directory holding ``.git``); a
deeper file's rules win over a shallower one's, ``!pattern`` re-includes, and a directory that is
excluded is not entered. Each directory's ``.gitignore`` is parsed once and kept in a bounded cache
keyed by its path, size and modification time.

Protocol: one JSON object on stdin (:func:`main` lists its keys); one JSON array per match on
stdout (``[path, line number, text]``), then a last line ``{"more": bool}``.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Collection, Iterator

__all__ = ["GitIgnore", "open_regular", "walk_files"]

#: Parsed ``.gitignore`` files kept per process (keyed by path, size and mtime).
GITIGNORE_CACHE_ENTRIES = 1024
#: A ``.gitignore`` larger than this is not read (its directory is walked as if it had none).
GITIGNORE_MAX_BYTES = 1024 * 1024

#: The rules in force in one directory: (directory, compiled spec) from shallowest to deepest.
Chain = tuple[tuple[str, Any], ...]

_spec_cache: OrderedDict[tuple[str, int, int], Any] = OrderedDict()


def _load_spec(directory: str) -> Any | None:
    """The compiled ``.gitignore`` of ``directory``, or None when it has none (cached)."""
    path = os.path.join(directory, ".gitignore")
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size > GITIGNORE_MAX_BYTES:
        return None
    key = (path, st.st_size, st.st_mtime_ns)
    spec = _spec_cache.get(key)
    if spec is not None:
        _spec_cache.move_to_end(key)
        return spec
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            lines = file.read().splitlines()
    except OSError:
        return None
    import pathspec

    spec = pathspec.GitIgnoreSpec.from_lines(lines)
    _spec_cache[key] = spec
    while len(_spec_cache) > GITIGNORE_CACHE_ENTRIES:
        _spec_cache.popitem(last=False)
    return spec


class GitIgnore:
    """Which paths below a root the project's ``.gitignore`` files exclude."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)
        # Parents of the root up to the repository root contribute their rules too.
        parents: list[str] = []
        current = os.path.dirname(self.root)
        probe = self.root
        in_repo = os.path.exists(os.path.join(probe, ".git"))
        while not in_repo and current != probe:
            parents.append(current)
            if os.path.exists(os.path.join(current, ".git")):
                in_repo = True
                break
            probe, current = current, os.path.dirname(current)
        chain: Chain = ()
        if in_repo:
            for directory in reversed(parents):
                chain = self.enter(directory, chain)
        self.root_chain = self.enter(self.root, chain)

    @staticmethod
    def enter(directory: str, chain: Chain, has_file: bool | None = None) -> Chain:
        """The rules in force inside ``directory``, whose parent's rules are ``chain``.

        ``has_file``: whether the directory holds a ``.gitignore`` (when the caller already
        listed it), to skip a ``stat``.
        """
        if has_file is False:
            return chain
        spec = _load_spec(directory)
        return chain if spec is None else (*chain, (directory, spec))

    @staticmethod
    def ignored(chain: Chain, path: str, is_dir: bool) -> bool:
        """Whether ``path`` (absolute) is excluded by the rules in force in its directory."""
        for directory, spec in reversed(chain):
            # ``path`` lies below ``directory`` (both come from the walk), so slicing suffices.
            cut = len(directory) if directory.endswith(os.sep) else len(directory) + 1
            rel = path[cut:].replace(os.sep, "/")
            if is_dir:
                rel += "/"
            result = spec.check_file(rel).include
            if result is not None:
                return bool(result)
        return False


def walk_files(
    root: Path,
    *,
    data_dir: Path,
    skip_hidden: bool,
    ignored: Collection[str],
    check: Callable[[], None],
    gitignore: bool = True,
    hidden: Collection[Path] = (),
) -> Iterator[Path]:
    """Yield the regular files below ``root`` in path order (symlinks are not followed).

    Directories named in ``ignored`` and ``data_dir`` are not entered, nor are files and
    directories the ``.gitignore`` files exclude (unless ``gitignore`` is false); ``hidden``
    paths (real paths: what the sandbox hides) are neither entered nor yielded; ``check`` runs
    before each entry (it raises to stop the walk at a deadline).
    """
    hidden = frozenset(hidden)
    stack: list[tuple[Iterator[os.DirEntry[str]], Chain]] = []
    rules = GitIgnore(root) if gitignore else None

    def entries(
        directory: str, chain: Chain, *, top: bool = False
    ) -> tuple[Iterator[os.DirEntry[str]], Chain]:
        try:
            with os.scandir(directory) as it:
                found = sorted(it, key=lambda e: e.name)
        except OSError:
            return iter(()), chain
        if rules is not None and not top:
            has_file = any(e.name == ".gitignore" for e in found)
            chain = rules.enter(directory, chain, has_file)
        return iter(found), chain

    # The root's own rules and its parents' make the root chain.
    stack.append(entries(str(root), rules.root_chain if rules else (), top=True))
    while stack:
        check()
        it, chain = stack[-1]
        entry = next(it, None)
        if entry is None:
            stack.pop()
            continue
        if skip_hidden and entry.name.startswith("."):
            continue
        if hidden and Path(entry.path) in hidden:
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                if entry.name in ignored or Path(entry.path) == data_dir:
                    continue
                if chain and GitIgnore.ignored(chain, entry.path, True):
                    continue
                stack.append(entries(entry.path, chain))
            elif entry.is_file(follow_symlinks=False):
                if chain and GitIgnore.ignored(chain, entry.path, False):
                    continue
                yield Path(entry.path)
        except OSError:
            continue


def open_regular(path: Path) -> int | None:
    """Open ``path`` for reading without blocking, or None if it is not a regular file now.

    ``O_NONBLOCK`` keeps a FIFO put in a file's place from blocking the open; the ``fstat``
    after it refuses the FIFO or device.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _search(job: dict[str, object]) -> None:
    root = Path(str(job["root"]))
    regex = re.compile(str(job["pattern"]))
    include_source = job.get("include")
    include = re.compile(str(include_source), re.DOTALL) if include_source else None
    by_name = bool(job.get("include_by_name"))
    max_matches = int(job["max_matches"])  # type: ignore[call-overload]
    max_file_bytes = int(job["max_file_bytes"])  # type: ignore[call-overload]
    sniff = int(job["sniff_bytes"])  # type: ignore[call-overload]
    # A little over the limit, so the caller still sees that the line was cut.
    keep = int(job["max_line_chars"]) + 2  # type: ignore[call-overload]
    ignored = {str(name) for name in job["ignored"]}  # type: ignore[attr-defined]
    # The child runs without site-packages: the tool names where ``pathspec`` lives.
    sys.path.extend(str(entry) for entry in job.get("sys_path") or [])  # type: ignore[attr-defined]
    out = sys.stdout
    if root.is_file():
        files: Iterator[Path] = iter([root])
        base = root.parent
    else:
        files = walk_files(
            root,
            data_dir=Path(str(job["data_dir"])),
            skip_hidden=True,
            ignored=ignored,
            check=lambda: None,
            hidden=[Path(str(p)) for p in job.get("hidden") or []],  # type: ignore[attr-defined]
        )
        base = root
    count = 0
    for path in files:
        rel = path.relative_to(base).as_posix()
        if include is not None:
            subject = rel.rsplit("/", 1)[-1] if by_name else rel
            if include.fullmatch(subject) is None:
                continue
        fd = open_regular(path)
        if fd is None:
            continue
        with open(fd, "rb") as f:
            try:
                if os.fstat(fd).st_size > max_file_bytes or b"\0" in f.read(sniff):
                    continue
                f.seek(0)
                for number, raw in enumerate(f, start=1):
                    line = raw.decode("utf-8", errors="replace")
                    if regex.search(line):
                        if count == max_matches:
                            out.write(json.dumps({"more": True}) + "\n")
                            return
                        out.write(json.dumps([str(path), number, line[:keep]]) + "\n")
                        count += 1
            except OSError:
                continue
    out.write(json.dumps({"more": False}) + "\n")


def main() -> None:
    """Read the job from stdin and search.

    Job keys: ``root``, ``pattern``, ``include`` (regex source or null), ``include_by_name``,
    ``data_dir``, ``ignored`` (directory names), ``max_matches``, ``max_file_bytes``,
    ``sniff_bytes``, ``max_line_chars``.
    """
    job = json.loads(sys.stdin.read())
    _search(job)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
