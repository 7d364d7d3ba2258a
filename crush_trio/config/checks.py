"""Checking a merged configuration tree and structuring it (loading stages 2 to 4).

:func:`structure_config` takes the tree the files merged into and returns the
:class:`~crush_trio.config.schema.Config`:

2. **Shape**: every object, map and list is where the classes expect one; unknown keys are
   collected as warnings (one each, naming the path) and ignored.
3. **Types**: the project's one converter structures the tree; it is strict, so ``"5"`` is not
   an int.
4. **Meaning**: numbers are within their bounds and ceilings; ``$VAR``/``${VAR}`` expand (only
   in values a trusted file set); MCP servers, webhooks and ``options.fetch.allow_private`` are
   complete and well-formed; ``models.large``/``models.small`` name a configured model.

Each stage reports every problem it finds before giving up.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import stat
import types
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final, Literal, Union, get_args, get_origin

import attrs
import cattrs

from ..wire import converter
from .files import file_kind, json_kind
from .problems import Origins, PathParts, Problem, format_path, raise_problems
from .schema import (
    CEILING_METADATA,
    MCP_NAME_UNSAFE,
    MIN_THINKING_BUDGET,
    POSITIVE_METADATA,
    Ceilings,
    Config,
    McpServerConfig,
    ModelEntry,
    ProviderConfig,
    WebhookConfig,
    resolve_role_model,
)

#: Top-level keys accepted silently although they configure nothing (editors' schema hint).
IGNORED_TOP_LEVEL_KEYS: Final = frozenset({"$schema"})
#: Largest ``secret_file`` of a webhook endpoint, in bytes.
WEBHOOK_SECRET_FILE_MAX_BYTES: Final = 4096


def structure_config(
    merged: dict[str, Any],
    origins: Origins,
    env: Mapping[str, str],
    trusted_sources: set[Path],
    warnings: list[str],
) -> Config:
    """Check ``merged`` (the files' merged tree) and structure it (see the module docstring).

    Args:
        merged: the tree the files merged into.
        origins: which file set each key, to name it in messages.
        env: the variables ``$VAR`` expands from.
        trusted_sources: the files whose values may expand ``$VAR``.
        warnings: unknown keys and values not expanded are appended to it.

    Raises:
        ConfigError: one line per problem, naming the file, the JSON path and the fix.
    """
    problems: list[Problem] = []
    unknown: list[PathParts] = []
    _check_shape(merged, Config, (), problems, unknown)
    for path_parts in unknown:
        warnings.append(
            f"{origins.source_of(path_parts)}: {format_path(path_parts)}: unknown key ignored"
        )
    raise_problems(problems, origins)

    try:
        config = converter.structure(merged, Config)
    except Exception as exc:
        raise_problems(list(_structuring_problems(exc)), origins)
        raise  # pragma: no cover - every converter error yields at least one problem

    _check_bounds(config, (), problems)
    raise_problems(problems, origins)

    expander = _Expander(env, origins, trusted_sources, warnings)
    config = attrs.evolve(
        config,
        providers={
            name: expander.provider(name, provider) for name, provider in config.providers.items()
        },
        mcp={name: _expand_mcp(expander, name, server) for name, server in config.mcp.items()},
    )
    _check_mcp(config, problems)
    _check_fetch(config, problems)
    config = _load_webhooks(expander, config, problems)

    roles: list[Literal["large", "small"]] = ["large"]
    if config.models.small is not None:
        roles.append("small")
    for role in roles:
        try:
            resolve_role_model(config, role)
        except Problem as problem:
            problems.append(problem)
    raise_problems(problems, origins)
    return config


# ---------------------------------------------------------------------------------------------
# Shape check and unknown keys


def _check_shape(
    value: Any,
    hint: Any,
    path: PathParts,
    problems: list[Problem],
    unknown: list[PathParts],
) -> None:
    """Check that objects, maps and lists sit where ``hint`` expects them; collect unknown keys.

    Leaves (strings, numbers, literals) are left to the converter. This runs first because the
    converter would turn a string into a list of characters or fail on ``.items()`` of a list.
    """
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in get_args(hint):
            return
        members = [a for a in get_args(hint) if a is not type(None)]
        if len(members) == 1:
            _check_shape(value, members[0], path, problems, unknown)
        return
    if attrs.has(hint):
        if not isinstance(value, dict):
            problems.append(Problem(path, f"expected an object, got {json_kind(value)}"))
            return
        fields = {f.name: f for f in attrs.fields(attrs.resolve_types(hint))}
        for key, item in value.items():
            field = fields.get(key)
            if field is None:
                if not (path == () and key in IGNORED_TOP_LEVEL_KEYS):
                    unknown.append((*path, key))
                continue
            _check_shape(item, field.type, (*path, key), problems, unknown)
        return
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(Problem(path, f"expected an object, got {json_kind(value)}"))
            return
        _, value_hint = get_args(hint)
        for key, item in value.items():
            _check_shape(item, value_hint, (*path, key), problems, unknown)
        return
    if origin is list:
        if not isinstance(value, list):
            problems.append(Problem(path, f"expected an array, got {json_kind(value)}"))
            return
        (item_hint,) = get_args(hint)
        for index, item in enumerate(value):
            _check_shape(item, item_hint, (*path, index), problems, unknown)


# ---------------------------------------------------------------------------------------------
# Structuring errors


def _structuring_problems(exc: BaseException, path: PathParts = ()) -> Iterator[Problem]:
    """Flatten a cattrs error tree into problems with JSON paths (like ``transform_error``)."""
    if isinstance(exc, (cattrs.ClassValidationError, cattrs.IterableValidationError)):
        with_notes, without = exc.group_exceptions()
        for sub, note in with_notes:
            if isinstance(note, cattrs.AttributeValidationNote):
                sub_path: PathParts = (*path, note.name)
            else:
                sub_path = (*path, note.index)
            yield from _structuring_problems(sub, sub_path)
        for sub in without:
            yield from _structuring_problems(sub, path)
    elif isinstance(exc, KeyError):
        yield Problem(path, "required key missing; add it to the file")
    else:
        yield Problem(path, f"{exc}; fix the value in the file")


# ---------------------------------------------------------------------------------------------
# Checks after structuring


def _check_bounds(
    obj: Any, path: PathParts, problems: list[Problem], ceilings: Ceilings | None = None
) -> None:
    """Every number is finite and >= 0; fields marked positive must be > 0; a bound with a
    ceiling is at most ``ceilings.<name>`` (``ceilings`` defaults to ``obj.ceilings``)."""
    if ceilings is None:
        ceilings = obj.ceilings if isinstance(obj, Config) else Ceilings()
    for field in attrs.fields(type(obj)):
        value = getattr(obj, field.name)
        here = (*path, field.name)
        ceiling_name = field.metadata.get(CEILING_METADATA)
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            if not math.isfinite(value):
                problems.append(Problem(here, "must be a finite number; fix the value"))
            elif field.metadata.get(POSITIVE_METADATA) and value <= 0:
                problems.append(
                    Problem(here, f"must be greater than 0, got {value}; fix the value")
                )
            elif value < 0:
                problems.append(Problem(here, f"must not be negative, got {value}; fix the value"))
            elif isinstance(ceiling_name, str) and value > (
                ceiling := getattr(ceilings, ceiling_name)
            ):
                problems.append(
                    Problem(
                        here,
                        f"{value} is above its ceiling {ceiling} (ceilings.{ceiling_name}); lower "
                        "the value, or raise the ceiling in the user's crush.json",
                    )
                )
            elif isinstance(ceiling_name, (int, float)) and value > ceiling_name:
                problems.append(
                    Problem(here, f"must be at most {ceiling_name} (a hard limit), got {value}")
                )
        elif attrs.has(type(value)):
            _check_bounds(value, here, problems, ceilings)
        if isinstance(obj, ModelEntry) and field.name == "thinking_budget":
            if 0 < value < MIN_THINKING_BUDGET:
                problems.append(
                    Problem(
                        here,
                        f"must be 0 (no extended thinking) or at least {MIN_THINKING_BUDGET} "
                        f"tokens (Anthropic's minimum), got {value}; fix the value",
                    )
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                if attrs.has(type(item)):
                    _check_bounds(item, (*here, key), problems, ceilings)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if attrs.has(type(item)):
                    _check_bounds(item, (*here, index), problems, ceilings)


_ENV_REF: Final = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


@attrs.define
class _Expander:
    """Expands ``$VAR``/``${VAR}`` in values that a trusted file set, and collects warnings."""

    env: Mapping[str, str]
    origins: Origins
    trusted_sources: set[Path]
    warnings: list[str]

    def expand(self, text: str, path: PathParts) -> str:
        """Expand ``$VAR`` and ``${VAR}``; an unset variable becomes "" and is logged.

        A value from an untrusted workspace's file is kept as written: such a file cannot read
        the server's environment (the keys that expand are not on its allow-list either).
        """
        source = self.origins.source_of(path)
        if not _ENV_REF.search(text):
            return text
        if source not in self.trusted_sources:
            self.warnings.append(
                f"{source}: {format_path(path)}: environment variables are not expanded in an "
                "untrusted workspace's file; the value is used as written"
            )
            return text

        def replace(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(2)
            value = self.env.get(name)
            if value is None:
                self.warnings.append(
                    f"{source}: {format_path(path)}: environment variable {name} is not set; "
                    "it expands to an empty string"
                )
                return ""
            return value

        return _ENV_REF.sub(replace, text)

    def provider(self, name: str, provider: ProviderConfig) -> ProviderConfig:
        base: PathParts = ("providers", name)
        return attrs.evolve(
            provider,
            api_key=self.expand(provider.api_key, (*base, "api_key")),
            base_url=self.expand(provider.base_url, (*base, "base_url")),
            extra_headers={
                header: self.expand(value, (*base, "extra_headers", header))
                for header, value in provider.extra_headers.items()
            },
        )


def _expand_mcp(expander: _Expander, name: str, server: McpServerConfig) -> McpServerConfig:
    """``$VAR`` in an MCP server's command, args, env, url and headers (trusted files only)."""
    base: PathParts = ("mcp", name)
    return attrs.evolve(
        server,
        command=expander.expand(server.command, (*base, "command")),
        args=[expander.expand(a, (*base, "args", i)) for i, a in enumerate(server.args)],
        env={k: expander.expand(v, (*base, "env", k)) for k, v in server.env.items()},
        url=expander.expand(server.url, (*base, "url")),
        headers={k: expander.expand(v, (*base, "headers", k)) for k, v in server.headers.items()},
    )


def _check_mcp(config: Config, problems: list[Problem]) -> None:
    """Each MCP server has what its type needs, and no two servers' tools can have the same
    name: ``mcp_<server>_<tool>`` of servers ``fs`` and ``fs_read`` are both
    ``mcp_fs_read_file`` for ``fs``'s ``read_file`` and ``fs_read``'s ``file``, and one would
    run under a grant given to the other."""
    heads = sorted((MCP_NAME_UNSAFE.sub("_", name) + "_", name) for name in config.mcp)
    for index, (head, name) in enumerate(heads):
        for other_head, other in heads[index + 1 :]:
            if not other_head.startswith(head):
                continue
            tail = other_head[len(head) :]
            example = (
                f"mcp_{head}{tail}tool is {name!r}'s {tail}tool and {other!r}'s tool"
                if tail
                else f"mcp_{head}tool is a tool of both"
            )
            problems.append(
                Problem(
                    ("mcp", other),
                    f"the tools of MCP servers {name!r} and {other!r} can have the same name "
                    f"({example}); rename one so that neither name, with '_' for characters "
                    "other than letters, digits and '-', followed by '_' starts the other",
                )
            )
    for name, server in config.mcp.items():
        if server.disabled:
            continue
        if server.type == "stdio" and not server.command:
            problems.append(
                Problem(("mcp", name, "command"), "a stdio MCP server needs a command; set it")
            )
        elif server.type != "stdio" and not server.url:
            problems.append(
                Problem(("mcp", name, "url"), f"an {server.type} MCP server needs a url; set it")
            )


def _load_webhooks(expander: _Expander, config: Config, problems: list[Problem]) -> Config:
    """``$VAR`` in each webhook's ``secret`` (trusted files only), ``secret_file`` read, and
    each endpoint checked: an http(s) URL with a host, exactly one way to give the secret."""
    hooks: list[WebhookConfig] = []
    for index, hook in enumerate(config.webhooks):
        base: PathParts = ("webhooks", index)
        before = len(problems)
        url = urllib.parse.urlsplit(hook.url)
        if url.scheme not in ("http", "https") or not url.hostname:
            problems.append(
                Problem(
                    (*base, "url"),
                    "must be an http:// or https:// URL with a host; fix the value",
                )
            )
        if not hook.events:
            problems.append(
                Problem(
                    (*base, "events"),
                    'is empty, so the endpoint would receive nothing; list "run_complete" or '
                    "remove the endpoint",
                )
            )
        secret = expander.expand(hook.secret, (*base, "secret"))
        if hook.secret and hook.secret_file:
            problems.append(
                Problem(base, "set secret or secret_file, not both; remove one of them")
            )
        elif hook.secret_file:
            try:
                secret = _read_secret_file(hook.secret_file)
            except Problem as problem:
                problems.append(Problem((*base, "secret_file"), problem.message))
        if not secret and len(problems) == before:
            problems.append(
                Problem(
                    (*base, "secret"),
                    'a webhook needs a secret to sign its requests: set secret ("$VAR" reads '
                    "an environment variable) or secret_file",
                )
            )
        hooks.append(attrs.evolve(hook, secret=secret))
    return attrs.evolve(config, webhooks=hooks)


def _read_secret_file(raw: str) -> str:
    """The secret held by a webhook's ``secret_file``, surrounding whitespace removed."""
    path = Path(raw).expanduser()
    if not path.is_absolute():
        raise Problem((), "must be an absolute path (~ expands); fix the value")
    try:
        # Opened without blocking and checked on the open file: a FIFO (or a file swapped for
        # one after a check) can never hang the server's start.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Problem((), f"{path} is {file_kind(st.st_mode)}; name a regular file")
            data = os.read(fd, WEBHOOK_SECRET_FILE_MAX_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) > WEBHOOK_SECRET_FILE_MAX_BYTES:
            raise Problem(
                (),
                f"{path} is larger than {WEBHOOK_SECRET_FILE_MAX_BYTES} bytes "
                "(WEBHOOK_SECRET_FILE_MAX_BYTES); a secret file holds one secret",
            )
    except OSError as exc:
        raise Problem(
            (), f"cannot read {path} ({exc.strerror or exc}); make it a readable file"
        ) from None
    try:
        secret = data.decode().strip()
    except UnicodeDecodeError:
        raise Problem((), f"{path} is not UTF-8 text; write the secret as text") from None
    if not secret:
        raise Problem((), f"{path} is empty; write the secret into it")
    return secret


def _check_fetch(config: Config, problems: list[Problem]) -> None:
    """Each ``options.fetch.allow_private`` entry is a network or an address."""
    for index, entry in enumerate(config.options.fetch.allow_private):
        try:
            ipaddress.ip_network(entry.strip(), strict=False)
        except ValueError:
            problems.append(
                Problem(
                    ("options", "fetch", "allow_private", index),
                    f"{entry!r} is not a network or an address; write one such as "
                    '"10.0.0.0/8" or "192.168.1.20"',
                )
            )
