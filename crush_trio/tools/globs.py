"""The glob dialect of ``glob`` and of ``grep``'s ``include``, compiled to regular expressions."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .base import ToolError

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["compile_glob", "glob_regex", "split_absolute_glob"]


def compile_glob(pattern: str) -> Callable[[str], bool]:
    """Compile a glob into a predicate over ``/``-separated paths relative to the search root.

    Syntax: ``*`` (within one path segment), ``**`` (any number of segments), ``?``, ``[abc]``,
    ``[!abc]``, ``{a,b}``. A pattern without ``/`` matches a file's name at any depth, as in
    ``.gitignore``; with ``/`` it matches the whole relative path.

    Raises:
        ToolError: the pattern is malformed.
    """
    regex, by_name = glob_regex(pattern)
    if by_name:
        return lambda rel: regex.fullmatch(rel.rsplit("/", 1)[-1]) is not None
    return lambda rel: regex.fullmatch(rel) is not None


def glob_regex(pattern: str) -> tuple[re.Pattern[str], bool]:
    """The regular expression of a glob (see :func:`compile_glob`) and whether it matches names
    only (no ``/`` in it)."""
    pattern = pattern.removeprefix("./")
    by_name = "/" not in pattern
    out: list[str] = []
    i, n, braces = 0, len(pattern), 0
    while i < n:
        c = pattern[i]
        if c == "*":
            if pattern.startswith("**", i):
                at_segment_start = i == 0 or pattern[i - 1] == "/"
                if at_segment_start and pattern.startswith("**/", i):
                    out.append("(?:.*/)?")
                    i += 3
                else:
                    out.append(".*")
                    i += 2
            else:
                out.append("[^/]*")
                i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] in "!^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                out.append(re.escape(c))
                i += 1
                continue
            body = pattern[i + 1 : j].replace("\\", "\\\\")
            if body[:1] in ("!", "^"):
                body = "^" + body[1:]
            out.append(f"[{body}]")
            i = j + 1
        elif c == "{":
            braces += 1
            out.append("(?:")
            i += 1
        elif c == "," and braces:
            out.append("|")
            i += 1
        elif c == "}" and braces:
            braces -= 1
            out.append(")")
            i += 1
        elif c == "\\" and i + 1 < n:
            out.append(re.escape(pattern[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    if braces:
        raise ToolError(f"invalid glob {pattern!r}: an opening '{{' has no closing '}}'")
    try:
        regex = re.compile("".join(out), re.DOTALL)
    except re.error as exc:
        raise ToolError(f"invalid glob {pattern!r}: {exc}") from exc
    return regex, by_name


def split_absolute_glob(pattern: str) -> tuple[str, str]:
    """Split an absolute glob into its literal leading directory and the rest."""
    parts = pattern.split("/")
    literal: list[str] = []
    for index, part in enumerate(parts[:-1]):
        if any(ch in part for ch in "*?[{"):
            return "/".join(literal) or "/", "/".join(parts[index:])
        literal.append(part)
    return "/".join(literal) or "/", parts[-1]
