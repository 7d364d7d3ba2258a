"""What the file tools never show: the paths the ``bash`` sandbox hides.

The sandbox hides the user's secret stores (:data:`~.sandbox.DEFAULT_DENY_READ`),
``options.sandbox.deny_read``, the server's own files (the paths the workspace hands it as
``hidden``: data and config directories and whatever else the server was started with) and the
other open workspaces' data directories. ``view``, ``ls``, ``glob``, ``grep``, ``write`` and
``edit`` apply the same list, with or without a working sandbox: a hidden path is refused before
any prompt (no answer can open it), and the walkers skip it. Otherwise a workspace that is the
home directory would let ``view ~/.ssh/id_ed25519`` run unasked.

As in the sandbox, a hidden path that is the workspace or holds it is not applied (it would hide
the workspace itself), and the workspace's own data directory stays visible.
"""

from __future__ import annotations

import functools
import glob
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import attrs

from .sandbox import DEFAULT_DENY_READ, Sandbox, is_within

__all__ = ["HiddenPaths", "is_hidden"]


@attrs.frozen
class HiddenPaths:
    """The hidden list of one workspace, as the sandbox builds it.

    Attributes:
        deny_read: ``options.sandbox.deny_read`` (``~`` and globs allowed).
        hidden: the server's own paths the sandbox hides.
        more_hidden: called (on the event loop) for more: the other open workspaces' data
            directories.
    """

    deny_read: tuple[str, ...] = ()
    hidden: tuple[Path, ...] = ()
    more_hidden: Callable[[], Iterable[Path]] | None = None

    @classmethod
    def of(cls, sandbox: Sandbox) -> HiddenPaths:
        """The list ``sandbox`` hides."""
        return cls(sandbox.deny_read, sandbox.hidden, sandbox.more_hidden)

    def patterns(self) -> tuple[str, ...]:
        """Every entry, unexpanded. Call on the event loop (it asks :attr:`more_hidden`)."""
        more = tuple(self.more_hidden()) if self.more_hidden is not None else ()
        return (*DEFAULT_DENY_READ, *self.deny_read, *map(str, (*self.hidden, *more)))


def resolve_hidden(patterns: Iterable[str], workspace: Path, data_dir: Path) -> tuple[Path, ...]:
    """The real paths of the entries that exist (``~`` and globs expanded), without those that
    hold the workspace and the workspace's own data directory.

    Blocking: call it in a worker thread.
    """
    found: set[Path] = set()
    home = os.environ.get("HOME")
    for raw in patterns:
        expanded, magic = _expand(raw, home)
        matches = glob.glob(expanded) if magic else (expanded,)
        for match in matches:
            if not os.path.lexists(match):
                continue
            real = Path(os.path.realpath(match))
            if is_within(workspace, real) or is_within(real, data_dir):
                continue
            found.add(real)
    return tuple(sorted(found))


@functools.lru_cache(maxsize=256)
def _expand(raw: str, home: str | None) -> tuple[str, bool]:
    """``raw`` with ``~`` expanded, and whether it is a glob. Text only (``home`` is ``$HOME``,
    which ``~`` follows), so it is kept: every file tool call resolves the list again."""
    expanded = os.path.expanduser(raw)
    return expanded, glob.has_magic(expanded)


def is_hidden(path: Path, hidden: Iterable[Path]) -> bool:
    """Whether the real ``path`` is a hidden path or below one."""
    return any(is_within(path, entry) for entry in hidden)
