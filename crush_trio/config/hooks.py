"""The converter hooks of the configuration's types.

The project's one converter (:data:`crush_trio.wire.converter`) structures the configuration
tree. Its generic error for a ``Literal`` is ``x not in literal typing.Literal[...]``; the hooks
here replace it, for the ``Literal`` types of the file, by one that lists the allowed values in
the file's own terms. :func:`register_config_hooks` installs them; ``crush_trio.config`` calls it
once, when the package is imported, before anything can structure a configuration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from .schema import (
    MCP_TYPES,
    PROVIDER_TYPES,
    WEBHOOK_EVENTS,
    McpType,
    ProviderType,
    WebhookEvent,
)

if TYPE_CHECKING:
    import cattrs

_PROVIDER_TYPE_HINT: Final[object] = ProviderType
_MCP_TYPE_HINT: Final[object] = McpType
_WEBHOOK_EVENT_HINT: Final[object] = WebhookEvent


def register_config_hooks(converter: cattrs.Converter) -> None:
    """Install on ``converter`` the structure hooks of the configuration's ``Literal`` types:
    ``providers.<name>.type``, ``mcp.<name>.type`` and ``webhooks[].events``."""
    converter.register_structure_hook_func(
        lambda t: t == _PROVIDER_TYPE_HINT, _structure_provider_type
    )
    converter.register_structure_hook_func(lambda t: t == _MCP_TYPE_HINT, _structure_mcp_type)
    converter.register_structure_hook_func(
        lambda t: t == _WEBHOOK_EVENT_HINT, _structure_webhook_event
    )


def _structure_provider_type(value: Any, _: Any) -> str:
    if not isinstance(value, str) or value not in PROVIDER_TYPES:
        allowed = ", ".join(repr(t) for t in PROVIDER_TYPES)
        raise ValueError(f"unknown provider type {value!r}; allowed types: {allowed}")
    return value


def _structure_mcp_type(value: Any, _: Any) -> str:
    if not isinstance(value, str) or value not in MCP_TYPES:
        allowed = ", ".join(repr(t) for t in MCP_TYPES)
        raise ValueError(f"unknown MCP server type {value!r}; allowed types: {allowed}")
    return value


def _structure_webhook_event(value: Any, _: Any) -> str:
    if not isinstance(value, str) or value not in WEBHOOK_EVENTS:
        allowed = ", ".join(repr(t) for t in WEBHOOK_EVENTS)
        raise ValueError(f"unknown webhook event {value!r}; allowed events: {allowed}")
    return value
