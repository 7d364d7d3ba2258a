"""Which ``bash`` commands only read inside the workspace, and so may run without asking.

:func:`read_only_argv` is a convenience, not the security boundary. The OS sandbox of
:mod:`crush_trio.tools.sandbox` is: a command it approves runs there ``prompt_free``, with the
workspace read-only, no network whatever ``options.sandbox.network`` says, and none of the
server's secrets or sockets present, so even a program it should not have approved can only
read what the sandbox shows. It still never approves a command that it knows can read outside
the workspace, write, or run another program, and what it approves is what runs: the words it
checked (globs expanded by it, not by bash), quoted again, and for ``git`` with settings that
keep programs named by the repository from running (:data:`GIT_FORCED_CONFIG`).
"""

from __future__ import annotations

import glob
import os
import selectors
import shlex
import stat
import subprocess
import time
from pathlib import Path
from typing import Final, Literal

import attrs

from .paths import is_within
from .sandbox import shell_env

__all__ = [
    "GIT_FORCED_CONFIG",
    "GIT_READ_ONLY_SUBCOMMANDS",
    "READ_ONLY_COMMANDS",
    "is_read_only",
    "read_only_argv",
    "read_only_command",
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
#: An unquoted ``[`` is refused outright: bash's bracket expressions (``[[:punct:]]``, ``[^a]``)
#: do not mean what Python's :mod:`glob` makes of them, so the names checked would not be the
#: names run (:data:`UNQUOTED_REFUSED_CHARS`).
GLOB_CHARS: Final = frozenset("*?")
#: Characters that, unquoted, make a command not read-only (see :data:`GLOB_CHARS`).
UNQUOTED_REFUSED_CHARS: Final = frozenset("[")
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
    "git": (
        "--output",
        "--ext-diff",
        "--textconv",
        "--open-files-in-pager",
        "--show-signature",
        "--ignore-submodules",
        "--submodule",
        "--recurse-submodules",
    ),
    "date": ("-s", "--set", "-f", "--file", "-r", "--reference"),
    "wc": ("--files0-from",),
}
#: Single-letter options that are unsafe even when combined with others (``-rR``, ``-uf``).
UNSAFE_SHORT_LETTERS: Final = {"grep": "R", "rg": "Lz", "date": "sfr", "git": "O"}
#: Read-only commands whose arguments are never paths, so they are not checked for paths outside
#: the workspace.
NON_PATH_COMMANDS: Final = frozenset({"echo", "which", "date", "pwd"})
#: Bytes of output of each ``git`` the check runs (``rev-parse``, ``config --list``) to find
#: the repository and the programs its config names; beyond it the command is not read-only.
GIT_CONFIG_MAX_BYTES: Final = 256 * 1024
#: Seconds each ``git`` the check runs may take before the command counts as not read-only.
GIT_CONFIG_TIMEOUT: Final = 5.0
#: Repository config sections that make ``git status``/``log``/``diff`` run programs or read
#: other files.
GIT_UNSAFE_SECTIONS: Final = frozenset({"filter", "include", "includeif", "pager"})
#: Repository config variables (any section) that name programs or move the work tree.
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
        "gitproxy",
    }
)
#: Suffixes of config variables that name programs (``diff.<driver>.command``,
#: ``gpg.program``...).
GIT_UNSAFE_KEY_SUFFIXES: Final = ("command", "program", "cmd", "hook", "askpass")
#: Settings every approved ``git`` command runs with (``git -c``, before the subcommand):
#: whatever the repository's config says, no file-system monitor, hook, pager, signature check
#: (``gpg`` is never started) or submodule summary.
GIT_FORCED_CONFIG: Final = (
    "core.fsmonitor=false",
    "core.hooksPath=/dev/null",
    "core.pager=cat",
    "diff.submodule=short",
    "log.showSignature=false",
    "status.submoduleSummary=false",
    "gpg.program=false",
    "gpg.ssh.program=false",
    "gpg.x509.program=false",
)
#: Options every approved ``git`` subcommand gets after its name: no textconv or external diff
#: program, and no look into submodules (whose own configs were not checked).
GIT_FORCED_OPTIONS: Final = {
    "status": ("--ignore-submodules",),
    "log": ("--no-textconv", "--no-ext-diff", "--ignore-submodules"),
    "diff": ("--no-textconv", "--no-ext-diff", "--ignore-submodules"),
}


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


def _read_bounded(
    argv: list[str], cwd: Path, limit: int, timeout: float
) -> tuple[int, bytes] | None:
    """The exit status and stdout of ``argv`` when it exits within ``timeout`` seconds having
    written at most ``limit`` bytes; None otherwise (the process is killed)."""
    # The environment of a sandboxed command without its GIT_CONFIG_* settings (git would list
    # them); no user config either, as in the sandbox.
    env = {k: v for k, v in shell_env(home="/nonexistent").items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL="/dev/null")
    try:
        process = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
    except OSError:
        return None
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    out = bytearray()
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    return None
                chunk = os.read(process.stdout.fileno(), 65536)
                if not chunk:
                    break
                out += chunk
                if len(out) > limit:
                    return None
        code = process.wait(max(deadline - time.monotonic(), 0.001))
    except subprocess.TimeoutExpired:
        return None
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stdout.close()
    return code, bytes(out)


def git_repository_state(workspace: Path) -> Literal["none", "safe", "unsafe"]:
    """Whether ``git`` finds a repository from ``workspace``, and whether it is safe to run git
    there: the repository lies inside the workspace and its config names no program git could
    run and includes nothing.

    Git finds the repository and parses its config itself (``git rev-parse``, ``git config
    --list``), so the repository found (a bare one, a ``.git`` file, ``commondir``,
    ``config.worktree``) and the way each line reads (a byte-order mark, ``]`` inside a quoted
    subsection) are git's, not a second parser's. The system and user configs are left out, as
    in the sandbox. Its git directory, common directory and object store must be inside the
    workspace: a ``.git`` file, ``commondir`` or ``objects/info/alternates`` pointing elsewhere
    would make an approved command read a repository outside it. ``"none"``: git finds no
    repository (git then only reports the error).

    Blocking:
        Runs git; call it in a thread.
    """
    found = _read_bounded(
        ["git", "rev-parse", "--path-format=absolute", "--git-dir", "--git-common-dir"],
        workspace,
        GIT_CONFIG_MAX_BYTES,
        GIT_CONFIG_TIMEOUT,
    )
    if found is None:
        return "unsafe"
    code, out = found
    if code != 0:
        return "none"  # no repository here: git in the sandbox finds none either
    dirs = [Path(os.path.realpath(os.fsdecode(line))) for line in out.splitlines() if line]
    if len(dirs) != 2 or not all(is_within(d, workspace) for d in dirs):
        return "unsafe"
    info = dirs[1] / "objects" / "info"
    if os.path.lexists(info / "alternates") or os.path.lexists(info / "http-alternates"):
        return "unsafe"
    listing = _read_bounded(
        ["git", "config", "--list", "--no-includes", "-z"],
        workspace,
        GIT_CONFIG_MAX_BYTES,
        GIT_CONFIG_TIMEOUT,
    )
    if listing is None or listing[0] != 0:
        return "unsafe"
    for entry in listing[1].split(b"\0"):
        name = entry.partition(b"\n")[0].decode("utf-8", "replace").lower()
        if not name:
            continue
        section, _, rest = name.partition(".")
        variable = rest.rpartition(".")[2]
        if section in GIT_UNSAFE_SECTIONS:
            return "unsafe"
        if variable in GIT_UNSAFE_KEYS or variable.endswith(GIT_UNSAFE_KEY_SUFFIXES):
            return "unsafe"
    return "safe"


def _git_repository_is_safe(workspace: Path) -> bool:
    """Whether running git in ``workspace`` is safe (:func:`git_repository_state`)."""
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
    """The names an unquoted glob expands to, sorted (itself when nothing matches, as in bash);
    None when there are more than :data:`GLOB_CHECK_LIMIT`."""
    pattern = word.glob_pattern()
    names: list[str] = []
    for name in glob.iglob(pattern, root_dir=workspace):
        names.append(name)
        if len(names) > GLOB_CHECK_LIMIT:
            return None
    return sorted(names) or [word.text]


def read_only_argv(command: str, workspace: Path) -> list[str] | None:
    """The words to run when ``command`` only reads inside the workspace, so it may run without
    asking; None when it must ask.

    This is a convenience, not the security boundary: the command runs ``prompt_free`` in the OS
    sandbox (workspace read-only, no network, no server secret or socket present), so a command
    approved wrongly still cannot write, send or act for the user. It approves only when:

    * the command is one simple command: no ``;``, ``&``, ``|``, ``<``, ``>``, backquote, ``$``
      or newline anywhere, not even quoted; no unquoted brace, bracket, tilde, parenthesis or
      ``!``, and no comment (brace expansion such as ``cat {/etc/passwd,x}`` reads any file);
    * its program is in :data:`READ_ONLY_COMMANDS` (``git`` only with a subcommand in
      :data:`GIT_READ_ONLY_SUBCOMMANDS`, and only when the repository git finds lies inside the
      workspace and git's own reading of its config finds no program and no include:
      ``core.fsmonitor``, ``diff.external``, textconv, filters...);
    * it has none of the :data:`UNSAFE_OPTIONS` (``date -f``, ``grep -R``, ``rg --pre``,
      ``find -L``, ``git log --show-signature``...), no ``git`` format asks for a signature
      (``%G``), and no value glued to a short option holds a path;
    * no name an unquoted ``*`` or ``?`` expands to starts with ``-`` (a file named
      ``--pre=sh`` would be an option);
    * except for ``echo``, ``which``, ``date`` and ``pwd``, every argument that names a path,
      and every name a glob expands to, is inside the workspace once symlinks are followed, and
      is not a file with other hard links.

    The words returned are those checked: globs expanded here (so bash expands nothing), and for
    ``git``, :data:`GIT_FORCED_CONFIG` before the subcommand and :data:`GIT_FORCED_OPTIONS`
    after it. Run them as ``shlex.join(words)``.

    Args:
        command: the shell command.
        workspace: the workspace's real path.

    Blocking:
        Reads the file system (paths, globs) and runs ``git config`` for ``git``; call it in a
        thread.
    """
    if any(ch in SHELL_SPECIAL_CHARS for ch in command):
        return None
    words = _split_words(command)
    if not words or any(w.has_unquoted(UNQUOTED_EXPANSION_CHARS) for w in words):
        return None
    if any(w.has_unquoted(UNQUOTED_REFUSED_CHARS) for w in words):
        return None
    if any(w.has_tilde() for w in words):
        return None
    if any(w.text.startswith("#") and w.unquoted[0] for w in words):
        return None  # a comment: the shell would not run what follows as written
    if words[0].has_unquoted(GLOB_CHARS) or words[0].text not in READ_ONLY_COMMANDS:
        return None
    name = words[0].text
    args: list[str] = []
    for word in words[1:]:
        if word.has_unquoted(GLOB_CHARS):
            expanded = _expand_glob(workspace, word)
            if expanded is None:
                return None
            for item in expanded:
                if item != word.text and item.startswith("-"):
                    return None  # a file name that would be read as an option
                if not _path_is_safe(workspace, item):
                    return None
            args.extend(expanded)
        else:
            args.append(word.text)
    if name == "git" and (not args or args[0] not in GIT_READ_ONLY_SUBCOMMANDS):
        return None
    if _has_unsafe_option(name, args):
        return None
    if name == "git" and any("%G" in arg for arg in args):
        return None  # a format placeholder that verifies a signature (runs gpg)
    if name == "git" and not _git_repository_is_safe(workspace):
        return None
    if name not in NON_PATH_COMMANDS:
        operands = False
        for arg in args:
            if arg == "--" and not operands:
                operands = True
                continue
            value = arg.partition("=")[2] if arg.startswith("-") and not operands else arg
            if not value or (value.startswith("-") and not operands):
                continue
            if value.startswith("~") or not _path_is_safe(workspace, value):
                return None
    if name == "git":
        forced = [word for setting in GIT_FORCED_CONFIG for word in ("-c", setting)]
        return [name, *forced, args[0], *GIT_FORCED_OPTIONS[args[0]], *args[1:]]
    return [name, *args]


def is_read_only(command: str, workspace: Path) -> bool:
    """Whether :func:`read_only_argv` approves ``command`` (see there).

    Blocking:
        As :func:`read_only_argv`; call it in a thread.
    """
    return read_only_argv(command, workspace) is not None


def read_only_command(argv: list[str]) -> str:
    """The shell command that runs exactly the words of :func:`read_only_argv`."""
    return shlex.join(argv)
