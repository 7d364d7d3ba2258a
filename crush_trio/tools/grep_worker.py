"""The Python search behind the ``grep`` tool when ripgrep is missing, run in a child process.

A Python regular expression can backtrack for hours (``(a+)+$`` on a long line of ``a``), and a
thread running it cannot be stopped. This module is therefore run as a script in its own process
(``python -I grep_worker.py``), which the ``grep`` tool kills at its timeout; nothing is left
behind and no worker thread of the server is held.

It imports nothing from the package (running it must not load the server), so the ``grep`` tool
and the other walkers share :func:`walk_files` from here.

Protocol: one JSON object on stdin (:func:`main` lists its keys); one JSON array per match on
stdout (``[path, line number, text]``), then a last line ``{"more": bool}``.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

__all__ = ["open_regular", "walk_files"]


def walk_files(
    root: Path,
    *,
    data_dir: Path,
    skip_hidden: bool,
    ignored: Collection[str],
    check: Callable[[], None],
) -> Iterator[Path]:
    """Yield the regular files below ``root`` in path order (symlinks are not followed).

    Directories named in ``ignored`` and ``data_dir`` are not entered; ``check`` runs before each
    entry (it raises to stop the walk at a deadline).
    """
    stack: list[Iterator[os.DirEntry[str]]] = []

    def entries(directory: str) -> Iterator[os.DirEntry[str]]:
        try:
            with os.scandir(directory) as it:
                found = sorted(it, key=lambda e: e.name)
        except OSError:
            return iter(())
        return iter(found)

    stack.append(entries(str(root)))
    while stack:
        check()
        entry = next(stack[-1], None)
        if entry is None:
            stack.pop()
            continue
        if skip_hidden and entry.name.startswith("."):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                if entry.name in ignored or Path(entry.path) == data_dir:
                    continue
                stack.append(entries(entry.path))
            elif entry.is_file(follow_symlinks=False):
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
