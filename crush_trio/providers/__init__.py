"""Model providers: one module per API, behind the :class:`~.base.Provider` interface.

* :mod:`.base`: the interface and the stream events the agent loop consumes.
* :mod:`.http`: HTTP shared by the HTTP providers (SSE decoding, timeouts, retries, errors).
* :mod:`.echo`: the built-in offline ``echo`` model.
* :mod:`.openai`: ``openai`` and ``openai-compat`` (Chat Completions).
* :mod:`.anthropic`: ``anthropic`` (Messages API).

:func:`make_provider` builds a provider from its ``crush.json`` entry.
"""

from __future__ import annotations

from typing import Final

from ..errors import ConfigError
from .anthropic import AnthropicProvider
from .base import ModelInfo, ModelRequest, Provider, StreamEvent, ToolSpec
from .echo import EchoProvider
from .http import ProviderSettings, Settings
from .openai import OpenAIProvider

#: The accepted values of a provider's ``type``.
PROVIDER_TYPES: Final = ("openai-compat", "openai", "anthropic", "echo")

__all__ = [
    "PROVIDER_TYPES",
    "AnthropicProvider",
    "EchoProvider",
    "ModelInfo",
    "ModelRequest",
    "OpenAIProvider",
    "Provider",
    "ProviderSettings",
    "Settings",
    "StreamEvent",
    "ToolSpec",
    "make_provider",
]


def make_provider(name: str, cfg: ProviderSettings) -> Provider:
    """Build the provider ``name`` from its config entry.

    Args:
        name: the provider's key in ``crush.json`` (used in every error message).
        cfg: the entry: a ``ProviderConfig`` or any object with the same attributes.

    Raises:
        ConfigError: unknown ``type``, or an ``openai-compat`` provider without ``base_url``.
    """
    if cfg.type == "echo":
        return EchoProvider(name, delay_ms=cfg.delay_ms)
    if cfg.type in ("openai", "openai-compat"):
        return OpenAIProvider(name, cfg, type=cfg.type)
    if cfg.type == "anthropic":
        return AnthropicProvider(name, cfg)
    allowed = ", ".join(repr(t) for t in PROVIDER_TYPES)
    raise ConfigError(f"$.providers.{name}.type is {cfg.type!r}; use one of {allowed}")
