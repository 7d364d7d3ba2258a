"""Where a configuration is wrong: JSON paths, problems and the file that set each key.

Every check of :mod:`crush_trio.config` reports a :class:`Problem` at a JSON path
(``$.providers.local.type``); :func:`raise_problems` turns them into one
:class:`~crush_trio.errors.ConfigError`, each line naming the file that set the key
(:class:`Origins`), the path and the fix.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

import attrs
import orjson

from ..errors import ConfigError

#: A JSON path as keys and indexes: ``("providers", "local", "models", 0)``.
PathParts = tuple[str | int, ...]

_PLAIN_KEY: Final = re.compile(r"[A-Za-z0-9_-]+")


def format_path(parts: PathParts) -> str:
    """``("providers", "local", "models", 0)`` -> ``$.providers.local.models[0]``."""
    out = ["$"]
    for part in parts:
        if isinstance(part, int):
            out.append(f"[{part}]")
        elif _PLAIN_KEY.fullmatch(part):
            out.append(f".{part}")
        else:
            out.append(f"[{orjson.dumps(part).decode()}]")
    return "".join(out)


class Problem(Exception):
    """One thing wrong at one path; ``message`` already says how to fix it."""

    def __init__(self, path: PathParts, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message

    def describe(self, origins: Origins | None = None) -> str:
        where = format_path(self.path)
        source = origins.source_of(self.path) if origins is not None else None
        return f"{source}: {where}: {self.message}" if source else f"{where}: {self.message}"


def raise_problems(problems: list[Problem], origins: Origins) -> None:
    """Raise one ConfigError for ``problems``, one line each, if there are any."""
    if problems:
        raise ConfigError("\n".join(p.describe(origins) for p in problems))


@attrs.define
class Origins:
    """Which file last set each key of the merged tree, to name the file in messages."""

    by_path: dict[PathParts, Path] = attrs.field(factory=dict)

    def set(self, path: PathParts, source: Path, *, replace: bool) -> None:
        if replace:
            # The whole subtree now comes from ``source``.
            n = len(path)
            for stale in [p for p in self.by_path if p[:n] == path]:
                del self.by_path[stale]
        self.by_path[path] = source

    def source_of(self, path: PathParts) -> Path | None:
        for n in range(len(path), -1, -1):
            found = self.by_path.get(path[:n])
            if found is not None:
                return found
        return None
