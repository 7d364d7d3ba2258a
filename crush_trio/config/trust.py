"""Workspace trust: what an untrusted workspace's own config file may set.

Unless ``trusted_workspaces`` in the user's file lists the workspace (or a parent), its files may
set only the allow-listed keys (``UNTRUSTED_*`` below: models and harmless options), and of the
bounds among them only values that tighten what the user's file (or the default) sets: a bound
marked with :data:`~crush_trio.config.schema.LOOSENS_METADATA` may move only the other way, and
every bound stays under its ceiling (:class:`~crush_trio.config.schema.Ceilings`, which only the
user's file may set). Every other key is ignored with a warning. :func:`filter_project` applies
these rules to one file; :func:`set_workspace_trust` edits the user's list.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs
import orjson

from ..defaults import DEFAULT_FETCH_MAX_BYTES, DEFAULT_FETCH_MAX_REDIRECTS, DEFAULT_FETCH_TIMEOUT
from ..errors import ConfigError
from .files import read_json, user_config_file
from .problems import PathParts, format_path
from .schema import LOOSENS_METADATA, Options, ProviderConfig

if TYPE_CHECKING:
    from collections.abc import Mapping

# What an untrusted workspace's config file may set (an allow-list: every other key is ignored
# with a warning, so keys added later are refused until someone decides they are harmless).
#: Top-level keys an untrusted workspace may set as a whole.
UNTRUSTED_TOP_LEVEL_KEYS: Final = frozenset({"$schema", "models"})
#: Keys of ``options`` an untrusted workspace may set (``data_directory`` only inside itself).
UNTRUSTED_OPTION_KEYS: Final = frozenset(
    {
        "data_directory",
        "max_steps",
        "debounce_ms",
        "title_max_words",
        "permission_timeout",
        "tool_timeout",
        "bash_output_limit",
        "context_paths",
        "auto_compact",
        "disable_auto_summarize",
        "compact_large_window",
        "compact_buffer_tokens",
        "compact_ratio",
        "default_context_window",
        "summary_max_tokens",
        "agent_max_steps",
    }
)
#: Keys of a provider entry an untrusted workspace may set: the model list and the bounds, never
#: where requests go or what credentials they carry (``type``, ``base_url``, ``api_key``,
#: ``extra_headers``).
UNTRUSTED_PROVIDER_KEYS: Final = frozenset(
    {
        "models",
        "delay_ms",
        "connect_timeout",
        "first_byte_timeout",
        "chunk_timeout",
        "max_retries",
        "retry_base_delay",
        "retry_max_delay",
    }
)
#: Provider types an untrusted workspace may define anew (they send nothing anywhere).
UNTRUSTED_NEW_PROVIDER_TYPES: Final = frozenset({"echo"})
#: Keys only the user's own file (or ``--config``) may set, trusted workspace or not.
USER_ONLY_KEYS: Final = frozenset({"trusted_workspaces", "cluster", "ceilings"})


def trust_entries(user_data: Mapping[str, Any] | None) -> list[str]:
    """The well-formed entries of ``trusted_workspaces`` in the user's own file (a malformed
    value is reported by the shape check later)."""
    value = (user_data or {}).get("trusted_workspaces")
    if not isinstance(value, list):
        return []
    return [entry for entry in value if isinstance(entry, str)]


def _real(raw: str) -> Path | None:
    path = Path(raw).expanduser()
    return Path(os.path.realpath(path)) if path.is_absolute() else None


def is_trusted(workspace: Path, entries: list[str]) -> bool:
    """Whether ``workspace`` (a real path) is an entry of ``trusted_workspaces`` or below one.

    Entries are absolute paths (``~`` expands); symlinks in them are resolved; relative entries
    trust nothing.
    """
    for entry in entries:
        real = _real(entry)
        if real is not None and (workspace == real or real in workspace.parents):
            return True
    return False


def _untrusted_reason(path: PathParts) -> str:
    return (
        f"ignored: an untrusted workspace may not set {format_path(path)}; mark the workspace "
        "trusted (crush-trio trust DIR, the web page's Trust button, or trusted_workspaces in "
        "the user's crush.json) to apply it"
    )


def filter_project(
    data: dict[str, Any],
    *,
    trusted: bool,
    workspace: Path,
    known_providers: set[str],
    base: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], list[tuple[PathParts, str]]]:
    """What a workspace's own config file may set: everything when trusted, else the allow-list
    (:data:`UNTRUSTED_TOP_LEVEL_KEYS`, :data:`UNTRUSTED_OPTION_KEYS`,
    :data:`UNTRUSTED_PROVIDER_KEYS`, new providers of :data:`UNTRUSTED_NEW_PROVIDER_TYPES`),
    and of the bounds on it only values that tighten what ``base`` (the files merged before
    this one) or the default sets (:func:`_loosens`).

    Returns the kept tree and each ignored path with the reason.
    """
    base = base or {}
    dropped: list[tuple[PathParts, str]] = []
    kept: dict[str, Any] = {}
    for key, value in data.items():
        path: PathParts = (key,)
        if key in USER_ONLY_KEYS:
            dropped.append(
                (path, f"ignored: only the user's own crush.json may set {format_path(path)}")
            )
        elif trusted or key in UNTRUSTED_TOP_LEVEL_KEYS:
            kept[key] = value
        elif key == "options" and isinstance(value, dict):
            kept[key] = _filter_options(value, workspace, _mapping(base.get(key)), dropped)
        elif key == "providers" and isinstance(value, dict):
            kept[key] = _filter_providers(value, known_providers, _mapping(base.get(key)), dropped)
        else:
            dropped.append((path, _untrusted_reason(path)))
    if not trusted:
        _drop_selections_of_ignored_providers(kept, known_providers, dropped)
    return kept, dropped


def _drop_selections_of_ignored_providers(
    kept: dict[str, Any], known: set[str], dropped: list[tuple[PathParts, str]]
) -> None:
    """A model selection naming a provider this file defined but may not: ignored too (it would
    otherwise fail as an unknown provider, hiding the reason)."""
    models = kept.get("models")
    if not isinstance(models, dict):
        return
    providers = kept.get("providers")
    defined = known | (set(providers) if isinstance(providers, dict) else set())
    ignored = {p[1] for p, _ in dropped if len(p) == 2 and p[0] == "providers"}
    for role in ("large", "small"):
        selection = models.get(role)
        if not isinstance(selection, dict):
            continue
        name = selection.get("provider")
        if name in ignored and name not in defined:
            del models[role]
            where: PathParts = ("models", role)
            dropped.append(
                (
                    where,
                    f"ignored: it names provider {name!r}, which an untrusted workspace may not "
                    "define; mark the workspace trusted to use it",
                )
            )


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> float | None:
    """A JSON number as a float (``null`` is infinity: no bound), or None for anything else."""
    if value is None:
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _loosens(cls: type, key: str, value: Any, base: Mapping[str, Any]) -> str | None:
    """Why an untrusted workspace's ``value`` for the bound ``cls.key`` is ignored, or None.

    The value may only tighten the bound: be no larger (or, for a bound marked
    ``loosens="down"``, no smaller) than the value the files merged before it set, or the
    default. A key that is not a bound, or a value of the wrong type (reported by the shape
    check), passes.
    """
    field = attrs.fields_dict(cls).get(key)
    if field is None or LOOSENS_METADATA not in field.metadata:
        return None
    new = _number(value)
    old = _number(base.get(key, field.default))
    if old is None:
        old = _number(field.default)
    if new is None or old is None:
        return None
    if field.metadata[LOOSENS_METADATA] == "down":
        if new >= old:
            return None
        direction = "lower"
    elif new <= old:
        return None
    else:
        direction = "higher"
    shown = "null" if old == math.inf else base.get(key, field.default)
    return (
        f"ignored: {value!r} is {direction} than {shown!r}, the value the user's crush.json "
        "(or the default) sets, and an untrusted workspace may only tighten a bound; mark the "
        "workspace trusted, or set it in the user's crush.json"
    )


def _filter_options(
    options: dict[str, Any],
    workspace: Path,
    base: Mapping[str, Any],
    dropped: list[tuple[PathParts, str]],
) -> dict[str, Any]:
    kept: dict[str, Any] = {}
    for key, value in options.items():
        path: PathParts = ("options", key)
        if key == "fetch" and isinstance(value, dict):
            fetch = base.get("fetch")
            kept[key] = _filter_fetch(value, fetch if isinstance(fetch, dict) else {}, dropped)
        elif key not in UNTRUSTED_OPTION_KEYS:
            dropped.append((path, _untrusted_reason(path)))
        elif key == "context_paths" and isinstance(value, list):
            kept[key] = _filter_context_paths(value, workspace, dropped)
        elif (why := _loosens(Options, key, value, base)) is not None:
            dropped.append((path, why))
        elif key == "data_directory" and isinstance(value, str) and not _inside(workspace, value):
            dropped.append(
                (
                    path,
                    f"ignored: {value!r} is outside the workspace, and an untrusted workspace may "
                    "put its data directory only inside itself; use a relative path such as "
                    '".crush", or mark the workspace trusted',
                )
            )
        else:
            kept[key] = value
    return kept


def _filter_context_paths(
    paths: list[Any], workspace: Path, dropped: list[tuple[PathParts, str]]
) -> list[Any]:
    """An untrusted workspace's ``context_paths``: only entries inside the workspace (the rest
    would put files from elsewhere, another project's or the user's secrets, in the prompt)."""
    kept: list[Any] = []
    for index, raw in enumerate(paths):
        if isinstance(raw, str) and not _inside_or_is(workspace, raw):
            dropped.append(
                (
                    ("options", "context_paths", index),
                    f"ignored: {raw!r} is outside the workspace, and an untrusted workspace may "
                    "name context files only inside itself; use a relative path, or mark the "
                    "workspace trusted",
                )
            )
        else:
            kept.append(raw)
    return kept


def _inside_or_is(workspace: Path, raw: str) -> bool:
    """Like :func:`_inside`, the workspace itself allowed too."""
    if not raw or raw.startswith("~") or Path(raw).is_absolute():
        return False
    real = Path(os.path.realpath(workspace / raw))
    return real == workspace or workspace in real.parents


#: ``options.fetch`` keys an untrusted workspace may set, each only to a value no higher than
#: the one in force (the user's, else the default).
UNTRUSTED_FETCH_LOWER_ONLY: Final = {
    "max_bytes": DEFAULT_FETCH_MAX_BYTES,
    "timeout": DEFAULT_FETCH_TIMEOUT,
    "max_redirects": DEFAULT_FETCH_MAX_REDIRECTS,
}


def _filter_fetch(
    fetch: dict[str, Any], current: Mapping[str, Any], dropped: list[tuple[PathParts, str]]
) -> dict[str, Any]:
    """What an untrusted workspace may set of ``options.fetch``: lower bounds only."""
    kept: dict[str, Any] = {}
    for key, value in fetch.items():
        path: PathParts = ("options", "fetch", key)
        default = UNTRUSTED_FETCH_LOWER_ONLY.get(key)
        if default is None:
            dropped.append((path, _untrusted_reason(path)))
            continue
        limit = current.get(key, default)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and isinstance(limit, (int, float)) and value > limit:
            dropped.append(
                (
                    path,
                    f"ignored: an untrusted workspace may only lower {format_path(path)} "
                    f"(now {limit}), not raise it to {value}; mark the workspace trusted to "
                    "raise it",
                )
            )
            continue
        kept[key] = value  # a value of the wrong type is reported by the shape check
    return kept


def _inside(workspace: Path, raw: str) -> bool:
    """Whether ``raw`` (relative to ``workspace``) names the workspace or a path below it, with
    every symlink on the way resolved."""
    if not raw or raw.startswith("~") or Path(raw).is_absolute():
        return False
    real = Path(os.path.realpath(workspace / raw))
    return real != workspace and workspace in real.parents


def _filter_providers(
    providers: dict[str, Any],
    known: set[str],
    base: Mapping[str, Any],
    dropped: list[tuple[PathParts, str]],
) -> dict[str, Any]:
    kept: dict[str, Any] = {}
    for name, entry in providers.items():
        path: PathParts = ("providers", name)
        if not isinstance(entry, dict):
            kept[name] = entry  # the shape check reports it
            continue
        if name not in known and entry.get("type") not in UNTRUSTED_NEW_PROVIDER_TYPES:
            dropped.append(
                (
                    path,
                    f"ignored: an untrusted workspace may define only providers of type "
                    f"{', '.join(sorted(UNTRUSTED_NEW_PROVIDER_TYPES))} (others send requests "
                    "where the file says); mark the workspace trusted to apply it",
                )
            )
            continue
        allowed = UNTRUSTED_PROVIDER_KEYS if name in known else UNTRUSTED_PROVIDER_KEYS | {"type"}
        base_entry = _mapping(base.get(name)) if name in known else {}
        kept_entry: dict[str, Any] = {}
        for key, value in entry.items():
            if key not in allowed:
                dropped.append(((*path, key), _untrusted_reason((*path, key))))
            elif (why := _loosens(ProviderConfig, key, value, base_entry)) is not None:
                dropped.append(((*path, key), why))
            else:
                kept_entry[key] = value
        kept[name] = kept_entry
    return kept


@attrs.frozen
class TrustChange:
    """What :func:`set_workspace_trust` did.

    Attributes:
        file: the user file written.
        trusted: whether the workspace is trusted now.
        changed: whether the file changed.
        still_trusted_by: when untrusting, the entries (parents of the workspace) that keep it
            trusted; remove them from the file to untrust it.
    """

    file: Path
    trusted: bool
    changed: bool
    still_trusted_by: tuple[str, ...] = ()


def set_workspace_trust(
    workspace: Path,
    trusted: bool,
    *,
    env: Mapping[str, str] | None = None,
    user_config_dir: Path | None = None,
) -> TrustChange:
    """Add ``workspace`` to (or remove it from) ``trusted_workspaces`` of the user's file.

    The rest of the file is kept as it is (its formatting is not: it is written back indented).
    A missing file or directory is created (mode 0600 / 0700); the new file replaces the old
    one atomically. Blocking: call it from a worker thread in async code.

    Raises:
        ConfigError: ``workspace`` is not an existing directory, or the user file cannot be read
            (invalid JSON, not a regular file, ...) or written; nothing was changed.
    """
    real = Path(os.path.realpath(workspace.expanduser()))
    if not real.is_dir():
        raise ConfigError(f"{workspace}: not a directory; give the workspace's directory")
    with _USER_FILE_LOCK:  # one read-modify-write at a time in this process
        return _set_trust(real, trusted, env=env, user_config_dir=user_config_dir)


def _set_trust(
    real: Path, trusted: bool, *, env: Mapping[str, str] | None, user_config_dir: Path | None
) -> TrustChange:
    file = user_config_file(env=env, user_config_dir=user_config_dir)
    target = Path(os.path.realpath(file))  # write through a symlinked dotfile, not over it
    data = read_json(target, required=False) or {}
    entries = data.get("trusted_workspaces", [])
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise ConfigError(
            f"{file}: $.trusted_workspaces: expected an array of directory paths; fix it first"
        )
    if trusted:
        changed = not any(_real(e) == real for e in entries)
        if changed:
            entries = [*entries, str(real)]
    else:
        kept = [e for e in entries if _real(e) != real]
        changed = len(kept) != len(entries)
        entries = kept
    if changed:
        data["trusted_workspaces"] = entries
        _write_user_file(target, data)
    now = is_trusted(real, entries)
    parents = tuple(e for e in entries if now and _real(e) != real and is_trusted(real, [e]))
    return TrustChange(file=file, trusted=now, changed=changed, still_trusted_by=parents)


_USER_FILE_LOCK: Final = threading.Lock()


def _write_user_file(target: Path, data: dict[str, Any]) -> None:
    body = orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n"
    temp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with open(fd, "wb", closefd=True) as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, target)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise ConfigError(
            f"{target}: cannot write the user config file ({exc.strerror or exc}); check the "
            "permissions of its directory"
        ) from None
