"""Reading text files: the checks ``view`` and ``edit`` share, and the names the walkers skip.

A file is read only when it is a regular file (a FIFO or device could block for ever), below a
size limit and not binary (no NUL byte in its first :data:`BINARY_SNIFF_BYTES`).
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING, Final

from ..defaults import BINARY_SNIFF_BYTES
from .base import ToolError

if TYPE_CHECKING:
    from pathlib import Path

__all__ = [
    "BINARY_SNIFF_BYTES",
    "IGNORED_DIR_NAMES",
    "VIEW_MAX_LINE_CHARS",
    "decode_text",
    "not_regular",
    "number_lines",
    "read_text_file",
    "split_lines",
]

#: Directory names the walkers do not descend into (unless the listed root itself is one).
IGNORED_DIR_NAMES: Final = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        "__pycache__",
        "node_modules",
        ".venv",
        ".mypy_cache",
        ".ruff_cache",
        ".pytest_cache",
    }
)

#: ``view`` (and the snippet ``edit`` returns): longer lines are cut to this many characters.
VIEW_MAX_LINE_CHARS: Final = 2000


def not_regular(shown: str, mode: int, tool_name: str) -> ToolError:
    kind = (
        "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "not a regular file"
    )
    return ToolError(f"{shown} is {kind}, not a regular file; {tool_name} reads regular files only")


def read_text_file(path: Path, shown: str, max_bytes: int, tool_name: str) -> str:
    """Read a text file, refusing directories, FIFOs, devices, large files and binary files.

    A FIFO or device is refused before it is opened (opening or reading one can block forever);
    the open itself does not block either (``O_NONBLOCK``), in case one was put in the file's
    place after the check.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ToolError(f"file not found: {shown}; use ls or glob to find the right path")
    except OSError as exc:
        raise ToolError(f"could not read {shown}: {exc.strerror or exc}") from exc
    if stat.S_ISDIR(st.st_mode):
        raise ToolError(f"{shown} is a directory; use ls to list it")
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(shown, st.st_mode, tool_name)
    if st.st_size > max_bytes:
        raise ToolError(
            f"{shown} is {st.st_size} bytes, over the {max_bytes} byte limit of {tool_name}; "
            "use grep to find the part you need, or bash with head/tail/sed"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ToolError(f"could not read {shown}: {exc.strerror or exc}") from exc
    with open(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(shown, mode, tool_name)
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise ToolError(f"could not read {shown}: {exc.strerror or exc}") from exc
    if len(data) > max_bytes:
        raise ToolError(
            f"{shown} grew over the {max_bytes} byte limit of {tool_name} while it was read; "
            "use grep to find the part you need, or bash with head/tail/sed"
        )
    return decode_text(data, shown, tool_name)


def decode_text(data: bytes, shown: str, tool_name: str) -> str:
    """The text of a file's bytes, refusing a binary file (a NUL byte in its first
    :data:`BINARY_SNIFF_BYTES`); undecodable bytes are kept as surrogate escapes."""
    if b"\0" in data[:BINARY_SNIFF_BYTES]:
        raise ToolError(
            f"{shown} looks like a binary file (it contains NUL bytes); {tool_name} works on "
            "text files only"
        )
    return data.decode("utf-8", errors="surrogateescape")


def split_lines(text: str) -> list[str]:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def number_lines(lines: list[str], first: int) -> list[str]:
    out = []
    for number, line in enumerate(lines, start=first + 1):
        shown = line.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")
        if len(shown) > VIEW_MAX_LINE_CHARS:
            shown = shown[:VIEW_MAX_LINE_CHARS] + " [line truncated]"
        out.append(f"{number:6d}|{shown}")
    return out
