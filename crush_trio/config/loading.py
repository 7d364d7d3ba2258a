"""Loading the configuration: find the files, read and merge them, then check and structure
the result.

1. **Lookup** (:func:`~crush_trio.config.files.config_files`): ``--config FILE`` alone, or else
   the user file ``$XDG_CONFIG_HOME/crush-trio/crush.json`` with the workspace's ``crush.json``
   and then ``.crush.json`` merged over it. Objects merge key by key, later files win, lists are
   replaced. The merge remembers which file set which key, so an error names the file to edit.
   A workspace's files pass the trust filter first (:mod:`crush_trio.config.trust`).
2. to 4. **Shape, types, meaning**: :func:`~crush_trio.config.checks.structure_config`.

Every failure is a :class:`~crush_trio.errors.ConfigError` whose message names the file, the path
and the fix; every key ignored is a warning of the :class:`LoadedConfig`, also logged.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs

from ..errors import ConfigError
from .checks import structure_config
from .files import config_files, read_json
from .problems import Origins, PathParts, format_path
from .schema import Config
from .trust import filter_project, is_trusted, trust_entries

if TYPE_CHECKING:
    from collections.abc import Mapping

#: The package's logger (``crush_trio.config``): one warning per key ignored.
logger: Final = logging.getLogger("crush_trio.config")


@attrs.frozen
class LoadedConfig:
    """A configuration with what loading it found worth telling the user.

    Attributes:
        config: the configuration.
        trusted: the workspace is trusted (``trusted_workspaces`` of the user's file), so its
            own files were applied in full; False without a workspace.
        warnings: one line per key ignored (unknown, or not allowed from an untrusted workspace)
            or value not expanded, naming the file, the JSON path and what to do. They are
            logged too.
    """

    config: Config
    trusted: bool = False
    warnings: tuple[str, ...] = ()


def load_config(
    *,
    config_file: Path | None,
    workspace: Path | None,
    env: Mapping[str, str] | None = None,
    user_config_dir: Path | None = None,
) -> Config:
    """Find, merge, check and structure the configuration (see :func:`load_config_report`)."""
    return load_config_report(
        config_file=config_file, workspace=workspace, env=env, user_config_dir=user_config_dir
    ).config


def load_config_report(
    *,
    config_file: Path | None,
    workspace: Path | None,
    env: Mapping[str, str] | None = None,
    user_config_dir: Path | None = None,
) -> LoadedConfig:
    """Find, merge, check and structure the configuration (see the module docstring).

    Blocking (it reads files): call it from a worker thread in async code.

    Args:
        config_file: ``--config FILE``; when given, only this file is read and it must exist.
        workspace: The workspace directory (a real path) whose ``crush.json`` and
            ``.crush.json`` merge over the user file; ``None`` reads the user file only. Unless
            the user file's ``trusted_workspaces`` trusts it, only the keys on the untrusted
            allow-list are taken from its files; the others are ignored with a warning.
        env: Variables for ``$VAR`` expansion and ``XDG_CONFIG_HOME``; default ``os.environ``.
        user_config_dir: Replaces ``$XDG_CONFIG_HOME/crush-trio`` as the user file's directory.

    Raises:
        ConfigError: unreadable, non-regular or too large file, invalid JSON, wrong shape or
            type, out-of-bounds number, or a model selection that names nothing; the message
            names the file, the JSON path and the fix (one line per problem).
    """
    env = os.environ if env is None else env
    if workspace is not None:
        workspace = Path(os.path.realpath(workspace))
    files = config_files(
        config_file=config_file, workspace=workspace, env=env, user_config_dir=user_config_dir
    )
    merged: dict[str, Any] = {}
    origins = Origins()
    loaded: list[Path] = []
    warnings: list[str] = []
    trusted_sources: set[Path] = set()
    trusted = False
    for index, path in enumerate(files):
        data = read_json(path, required=config_file is not None)
        if index == 0:
            # --config FILE or the user's own file: trusted by definition.
            trusted_sources.add(path)
            if workspace is not None:
                trusted = is_trusted(workspace, trust_entries(data))
        elif data is not None:
            assert workspace is not None
            providers = merged.get("providers")
            known = set(providers) if isinstance(providers, dict) else set()
            data, dropped = filter_project(
                data, trusted=trusted, workspace=workspace, known_providers=known, base=merged
            )
            warnings += [f"{path}: {format_path(where)}: {why}" for where, why in dropped]
            if trusted:
                trusted_sources.add(path)
        if data is not None:
            _merge_into(merged, data, path, origins)
            loaded.append(path)
    logger.debug("config files read: %s", ", ".join(map(str, loaded)) or "none (defaults)")

    try:
        return _finish_loading(merged, origins, env, trusted, trusted_sources, warnings)
    except ConfigError as exc:
        if not warnings:
            raise
        # What was ignored may be why the rest is wrong: say it with the error.
        raise ConfigError("\n".join([exc.message, *warnings])) from None


def _finish_loading(
    merged: dict[str, Any],
    origins: Origins,
    env: Mapping[str, str],
    trusted: bool,
    trusted_sources: set[Path],
    warnings: list[str],
) -> LoadedConfig:
    config = structure_config(merged, origins, env, trusted_sources, warnings)
    for line in warnings:
        logger.warning("%s", line)
    return LoadedConfig(config=config, trusted=trusted, warnings=tuple(warnings))


def _merge_into(
    base: dict[str, Any],
    over: Mapping[str, Any],
    source: Path,
    origins: Origins,
    prefix: PathParts = (),
) -> None:
    """Deep-merge ``over`` into ``base``: objects merge, anything else (lists too) replaces."""
    for key, value in over.items():
        path = (*prefix, key)
        current = base.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            # Not recorded: the keys inside keep the file that set each of them (a value's
            # origin decides whether ``$VAR`` in it expands).
            _merge_into(current, value, source, origins, path)
        else:
            base[key] = value
            origins.set(path, source, replace=True)
