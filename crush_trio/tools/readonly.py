"""Which ``bash`` commands only read inside the workspace, and so may run without asking.

:func:`is_read_only` is a convenience, not the security boundary (the OS sandbox of
:mod:`crush_trio.tools.sandbox` is: such a command runs there with the workspace read-only), but
it never says True for a command that can read outside the workspace, write, or run another
program.
"""

from __future__ import annotations

import glob
import os
import stat
from pathlib import Path
from typing import Final, Literal

import attrs

from .paths import is_within

__all__ = [
    "GIT_READ_ONLY_SUBCOMMANDS",
    "READ_ONLY_COMMANDS",
    "is_read_only",
]

#: Commands that may run without asking when the whole command is one simple command (see
#: :func:`is_read_only`).
READ_ONLY_COMMANDS: Final = frozenset(
    {"ls", "pwd", "cat", "head", "tail", "wc", "grep", "rg", "find", "echo", "which", "date", "git"}
)
#: ``git`` subcommands that count as read-only.
GIT_READ_ONLY_SUBCOMMANDS: Final = frozenset({"status", "log", "diff"})
#: Characters that make a command more than one simple command (lists, pipes, redirections,
#: substitutions, background jobs, variables and multiple lines), quoted or not.
SHELL_SPECIAL_CHARS: Final = frozenset(";&|<>`$\n\r")
#: Characters that, unquoted, make the shell expand a word (braces, extended globs) or start a
#: subshell: such a command is not read-only (nor is one with an unquoted word that starts with
#: ``#``, a comment, or an unquoted ``~`` that the shell expands, see :meth:`_Word.has_tilde`).
UNQUOTED_EXPANSION_CHARS: Final = frozenset("{}()!")
#: Unquoted glob characters: the shell expands them to names; each name must pass the checks.
GLOB_CHARS: Final = frozenset("*?[")
#: Most names one glob may expand to before the command stops counting as read-only.
GLOB_CHECK_LIMIT: Final = 1000
#: Options that make a read-only command write, delete, run something else, read a file named
#: elsewhere or follow symlinks out of the workspace.
UNSAFE_OPTIONS: Final = {
    "find": (
        "-exec",
        "-execdir",
        "-ok",
        "-okdir",
        "-delete",
        "-fprint",
        "-fprint0",
        "-fprintf",
        "-fls",
        "-L",
        "-follow",
        "-files0-from",
    ),
    "rg": ("--pre", "--hostname-bin", "--follow", "--search-zip", "--pre-glob"),
    "grep": ("--dereference-recursive",),
    "git": ("--output", "--ext-diff", "--textconv", "--open-files-in-pager"),
    "date": ("-s", "--set", "-f", "--file", "-r", "--reference"),
    "wc": ("--files0-from",),
}
#: Single-letter options that are unsafe even when combined with others (``-rR``, ``-uf``).
UNSAFE_SHORT_LETTERS: Final = {"grep": "R", "rg": "Lz", "date": "sfr", "git": "O"}
#: Read-only commands whose arguments are never paths, so they are not checked for paths outside
#: the workspace.
NON_PATH_COMMANDS: Final = frozenset({"echo", "which", "date", "pwd"})
#: Bytes of a repository's config read to tell whether ``git`` would run programs it names.
GIT_CONFIG_MAX_BYTES: Final = 256 * 1024
#: Directories above the workspace searched for the repository ``git`` would use.
GIT_SEARCH_DEPTH: Final = 64
#: Repository config sections that make ``git status``/``log``/``diff`` run programs or read
#: other files.
GIT_UNSAFE_SECTIONS: Final = frozenset({"filter", "include", "includeif", "pager"})
#: Repository config keys (any section) that name programs or move the work tree.
GIT_UNSAFE_KEYS: Final = frozenset(
    {
        "fsmonitor",
        "external",
        "textconv",
        "showsignature",
        "worktree",
        "hookspath",
        "editor",
        "pager",
    }
)
#: Suffixes of config keys that name programs (``diff.<driver>.command``, ``gpg.program``...).
GIT_UNSAFE_KEY_SUFFIXES: Final = ("command", "program", "cmd", "hook", "askpass")


@attrs.frozen
class _Word:
    """One shell word: its text after quote removal, and which characters were unquoted."""

    text: str
    unquoted: tuple[bool, ...]

    def has_unquoted(self, chars: frozenset[str]) -> bool:
        return any(q and c in chars for c, q in zip(self.text, self.unquoted, strict=True))

    def has_tilde(self) -> bool:
        """An unquoted ``~`` that bash expands: at the start, or after ``=`` or ``:`` (as in
        ``a=~/x``). ``HEAD~1`` is left alone, as bash leaves it."""
        for index, (c, q) in enumerate(zip(self.text, self.unquoted, strict=True)):
            if c == "~" and q and (index == 0 or self.text[index - 1] in "=:"):
                return True
        return False

    def glob_pattern(self) -> str:
        """The word as a :mod:`glob` pattern: quoted characters escaped."""
        return "".join(
            c if q else glob.escape(c) for c, q in zip(self.text, self.unquoted, strict=True)
        )


def _split_words(command: str) -> list[_Word] | None:
    """Split ``command`` into words as bash does (quotes and backslashes), or None if a quote is
    not closed. Called only on commands without ``$``, backquotes or newlines."""
    words: list[_Word] = []
    text: list[str] = []
    flags: list[bool] = []
    in_word = False
    i, n = 0, len(command)
    while i < n:
        c = command[i]
        if c in " \t":
            if in_word:
                words.append(_Word("".join(text), tuple(flags)))
                text, flags, in_word = [], [], False
            i += 1
            continue
        in_word = True
        if c == "\\":
            if i + 1 >= n:
                return None
            text.append(command[i + 1])
            flags.append(False)
            i += 2
        elif c == "'":
            end = command.find("'", i + 1)
            if end < 0:
                return None
            text.extend(command[i + 1 : end])
            flags.extend([False] * (end - i - 1))
            i = end + 1
        elif c == '"':
            i += 1
            while True:
                if i >= n:
                    return None
                c = command[i]
                if c == '"':
                    i += 1
                    break
                if c == "\\" and i + 1 < n and command[i + 1] in '"\\':
                    c = command[i + 1]
                    i += 1
                text.append(c)
                flags.append(False)
                i += 1
        else:
            text.append(c)
            flags.append(True)
            i += 1
    if in_word:
        words.append(_Word("".join(text), tuple(flags)))
    return words


def _has_unsafe_option(name: str, args: list[str]) -> bool:
    letters = UNSAFE_SHORT_LETTERS.get(name, "")
    unsafe = UNSAFE_OPTIONS.get(name, ())
    for arg in args:
        if arg == "--":
            break  # operands follow
        for option in unsafe:
            if arg == option or arg.startswith(option + "="):
                return True
        if arg.startswith("--") and len(arg) > 2:
            # GNU tools and git accept any unambiguous prefix of a long option (--fil=F).
            given = arg[2:].split("=", 1)[0]
            if any(o.startswith("--") and o[2:].startswith(given) for o in unsafe):
                return True
        if name == "git" and arg.startswith("--output"):
            return True
        if arg.startswith("-") and not arg.startswith("--"):
            if name != "find" and any(letter in arg[1:] for letter in letters):
                return True
            # A value glued to a short option ("-f/etc/x") would escape the path check.
            if "/" in arg or "~" in arg:
                return True
    return False


def _git_config_is_safe(path: Path) -> bool:
    """Whether a repository config names no program git could run and includes nothing."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size > GIT_CONFIG_MAX_BYTES:
        return False
    try:
        with open(path, "rb") as f:
            text = f.read(GIT_CONFIG_MAX_BYTES).decode("utf-8", "replace")
    except OSError:
        return False
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line[1:].split("]", 1)[0].strip().split()[0].split(".")[0].lower()
            if section.strip('"') in GIT_UNSAFE_SECTIONS:
                return False
            line = line.split("]", 1)[1].strip() if "]" in line else ""
            if not line:
                continue
        key = line.split("=", 1)[0].strip().lower()
        if key in GIT_UNSAFE_KEYS or key.endswith(GIT_UNSAFE_KEY_SUFFIXES):
            return False
    return True


def git_repository_state(workspace: Path) -> Literal["none", "safe", "unsafe"]:
    """Whether ``git`` finds a repository from ``workspace``, and whether its config runs nothing.

    ``"none"``: no ``.git`` in the workspace or above it. ``"unsafe"``: the config names a
    program or includes a file, or ``.git`` is a file or a symlink (a linked work tree or
    submodule points elsewhere: not checked, so not safe), or the search went too deep.

    Blocking:
        Reads the file system; call it in a thread.
    """
    directory = workspace
    for _ in range(GIT_SEARCH_DEPTH):
        dot_git = directory / ".git"
        if os.path.lexists(dot_git):
            if os.path.islink(dot_git) or not os.path.isdir(dot_git):
                return "unsafe"
            safe = _git_config_is_safe(dot_git / "config") and _git_config_is_safe(
                dot_git / "config.worktree"
            )
            return "safe" if safe else "unsafe"
        if directory.parent == directory:
            return "none"
        directory = directory.parent
    return "unsafe"


def _git_repository_is_safe(workspace: Path) -> bool:
    """Whether the repository ``git`` would use in ``workspace`` has a config that runs nothing
    (no repository at all is safe: git then only reports the error)."""
    return git_repository_state(workspace) != "unsafe"


def _path_is_safe(workspace: Path, raw: str) -> bool:
    """Inside the workspace once symlinks are followed, and not a file with other hard links."""
    candidate = Path(raw) if os.path.isabs(raw) else workspace / raw
    real = Path(os.path.realpath(candidate))
    if not is_within(real, workspace):
        return False
    try:
        st = os.stat(real)
    except OSError:
        return True
    # A hard link is the same file under another name, which may be outside the workspace.
    return not (stat.S_ISREG(st.st_mode) and st.st_nlink > 1)


def _expand_glob(workspace: Path, word: _Word) -> list[str] | None:
    """The names an unquoted glob expands to (itself when nothing matches, as in bash); None
    when there are more than :data:`GLOB_CHECK_LIMIT`."""
    pattern = word.glob_pattern()
    names: list[str] = []
    for name in glob.iglob(pattern, root_dir=workspace):
        names.append(name)
        if len(names) > GLOB_CHECK_LIMIT:
            return None
    return names or [word.text]


def is_read_only(command: str, workspace: Path) -> bool:
    """Whether ``command`` only reads inside the workspace, so it may run without asking.

    This is a convenience, not the security boundary (the OS sandbox is: such a command runs
    there with the workspace read-only), but it never says True for a command that can read
    outside the workspace, write, or run another program. True only when:

    * the command is one simple command: no ``;``, ``&``, ``|``, ``<``, ``>``, backquote, ``$``
      or newline anywhere, not even quoted; no unquoted brace, tilde, parenthesis or ``!``, and
      no comment (brace expansion such as ``cat {/etc/passwd,x}`` reads any file);
    * its program is in :data:`READ_ONLY_COMMANDS` (``git`` only with a subcommand in
      :data:`GIT_READ_ONLY_SUBCOMMANDS`, and only when the repository's config names no program
      and includes no file: ``core.fsmonitor``, ``diff.external``, textconv, filters...);
    * it has none of the :data:`UNSAFE_OPTIONS` (``date -f``, ``grep -R``, ``rg --pre``,
      ``find -L``...), and no value glued to a short option holds a path;
    * except for ``echo``, ``which``, ``date`` and ``pwd``, every argument that names a path,
      and every name an unquoted glob expands to, is inside the workspace once symlinks are
      followed, and is not a file with other hard links.

    Args:
        command: the shell command.
        workspace: the workspace's real path.

    Blocking:
        Reads the file system (paths, globs, the repository's config); call it in a thread.
    """
    if any(ch in SHELL_SPECIAL_CHARS for ch in command):
        return False
    words = _split_words(command)
    if not words or any(w.has_unquoted(UNQUOTED_EXPANSION_CHARS) for w in words):
        return False
    if any(w.has_tilde() for w in words):
        return False
    if any(w.text.startswith("#") and w.unquoted[0] for w in words):
        return False  # a comment: the shell would not run what follows as written
    if words[0].has_unquoted(GLOB_CHARS) or words[0].text not in READ_ONLY_COMMANDS:
        return False
    name = words[0].text
    args: list[str] = []
    for word in words[1:]:
        if word.has_unquoted(GLOB_CHARS):
            expanded = _expand_glob(workspace, word)
            if expanded is None:
                return False
            for item in expanded:
                if not _path_is_safe(workspace, item):
                    return False
            args.extend(expanded)
        else:
            args.append(word.text)
    if name == "git" and (not args or args[0] not in GIT_READ_ONLY_SUBCOMMANDS):
        return False
    if _has_unsafe_option(name, args):
        return False
    if name == "git" and not _git_repository_is_safe(workspace):
        return False
    if name in NON_PATH_COMMANDS:
        return True
    operands = False
    for arg in args:
        if arg == "--" and not operands:
            operands = True
            continue
        value = arg.partition("=")[2] if arg.startswith("-") and not operands else arg
        if not value or (value.startswith("-") and not operands):
            continue
        if value.startswith("~") or not _path_is_safe(workspace, value):
            return False
    return True
