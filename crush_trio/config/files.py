"""Finding and reading configuration files.

:func:`config_files` lists the files :func:`~crush_trio.config.load_config` reads: ``--config
FILE`` alone, or else the user file ``$XDG_CONFIG_HOME/crush-trio/crush.json`` with the
workspace's ``crush.json`` and then ``.crush.json``. :func:`read_json` reads one of them: a
regular file of at most :data:`CONFIG_MAX_BYTES` holding a JSON object.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import orjson

from ..errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Mapping

#: File name looked up in the user config directory and in a workspace.
CONFIG_FILE_NAME: Final = "crush.json"
#: Hidden variant in a workspace, merged over :data:`CONFIG_FILE_NAME`.
HIDDEN_CONFIG_FILE_NAME: Final = ".crush.json"
#: Directory under ``$XDG_CONFIG_HOME`` that holds the user file.
USER_CONFIG_SUBDIR: Final = "crush-trio"
#: Largest config file read, in bytes (1 MiB); a larger one is an error.
CONFIG_MAX_BYTES: Final = 1024 * 1024


def user_config_file(
    *, env: Mapping[str, str] | None = None, user_config_dir: Path | None = None
) -> Path:
    """The user file: ``user_config_dir/crush.json``, else under ``$XDG_CONFIG_HOME``."""
    if user_config_dir is not None:
        return user_config_dir / CONFIG_FILE_NAME
    env = os.environ if env is None else env
    xdg = env.get("XDG_CONFIG_HOME", "")
    # The XDG spec says to ignore a relative value.
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".config"
    return base / USER_CONFIG_SUBDIR / CONFIG_FILE_NAME


def config_files(
    *,
    config_file: Path | None,
    workspace: Path | None,
    env: Mapping[str, str] | None = None,
    user_config_dir: Path | None = None,
) -> list[Path]:
    """The files :func:`load_config` reads, in merge order (later wins); some may not exist."""
    if config_file is not None:
        return [config_file]
    files = [user_config_file(env=env, user_config_dir=user_config_dir)]
    if workspace is not None:
        files += [workspace / CONFIG_FILE_NAME, workspace / HIDDEN_CONFIG_FILE_NAME]
    return files


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, for messages (``a directory``...)."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _check_regular(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(
            f"{path}: is {file_kind(st.st_mode)}, not a regular file; a config file must be a "
            "regular file: replace it with one or remove it"
        )
    if st.st_size > CONFIG_MAX_BYTES:
        raise ConfigError(_too_large(path))


def _too_large(path: Path) -> str:
    return (
        f"{path}: larger than the {CONFIG_MAX_BYTES} byte limit of a config file "
        "(CONFIG_MAX_BYTES); a crush.json is a few kilobytes: remove what does not belong in it"
    )


def _read_bounded(path: Path) -> bytes:
    """The bytes of a regular file of at most :data:`CONFIG_MAX_BYTES`.

    The file is checked with ``stat`` before it is opened and with ``fstat`` after (it is
    opened with ``O_NONBLOCK``, so a FIFO swapped in between cannot block the open), and at most
    one byte over the limit is read.
    """
    _check_regular(path, os.stat(path))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _check_regular(path, os.fstat(fd))
        os.set_blocking(fd, True)
        chunks: list[bytes] = []
        size = 0
        while size <= CONFIG_MAX_BYTES and (chunk := os.read(fd, CONFIG_MAX_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > CONFIG_MAX_BYTES:
        raise ConfigError(_too_large(path))
    return b"".join(chunks)


def read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    """The JSON object in ``path``; None when it does not exist and is not ``required``.

    Raises:
        ConfigError: unreadable, not a regular file, too large, not JSON or not an object.
    """
    try:
        raw = _read_bounded(path)
    except FileNotFoundError:
        if required:
            raise ConfigError(
                f"{path}: config file not found; check the path given with --config"
            ) from None
        return None
    except OSError as exc:
        raise ConfigError(
            f"{path}: cannot read config file ({exc.strerror or exc}); "
            "make it a readable file or remove it"
        ) from None
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(
            f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}; "
            "fix the syntax"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: $: expected a JSON object, got {json_kind(data)}; "
            'make the file an object such as {"providers": {}}'
        )
    return data


def json_kind(value: Any) -> str:
    """The JSON name of ``value``'s type (``object``, ``array``...), for messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
