"""The agent's providers: set up on first use, shared by the turns, titles and sub-agents of a
workspace, and closed as soon as nothing holds one that a configuration change replaced.

A provider owns a connection pool, so a workspace whose trust or configuration changes many times
must not keep every earlier generation open until it closes: the cache holds the current providers
plus the replaced ones still in use, and no more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

from ..errors import ConfigError, CrushError
from ..providers import base as pb

log = logging.getLogger(__name__)

#: Makes a provider from its name and configuration (``Agent``'s ``provider_factory``).
ProviderFactory = Callable[[str, Any], pb.Provider]


class ProviderCache:
    """Providers by name, with a hold count on each one handed out.

    ``acquire`` hands out the current provider of a name (setting it up on first use) and
    ``release`` gives it back; ``retire`` (a new configuration) drops the current providers, and
    each one is closed in ``close_soon``'s nursery once its last holder releases it (at once when
    nobody holds it). ``aclose`` closes every provider, current and retired.
    """

    def __init__(
        self,
        factory: ProviderFactory,
        *,
        close_soon: Callable[[pb.Provider], None],
    ) -> None:
        self._factory = factory
        self._close_soon = close_soon
        self._current: dict[str, pb.Provider] = {}
        #: Holds by ``id(provider)``, for providers handed out and not yet released.
        self._holds: dict[int, int] = {}
        #: Replaced providers that are still held, by ``id(provider)``.
        self._retired: dict[int, pb.Provider] = {}

    def __len__(self) -> int:
        """Open providers: the current ones plus the replaced ones still held."""
        return len(self._current) + len(self._retired)

    def acquire(self, name: str, cfg: Any) -> pb.Provider:
        """The provider of ``name`` (set up now if it is new), held until :meth:`release`."""
        provider = self._current.get(name)
        if provider is None:
            try:
                provider = self._factory(name, cfg)
            except CrushError:
                raise
            except Exception as exc:
                raise ConfigError(f"provider {name!r} could not be set up: {exc}") from exc
            self._current[name] = provider
        key = id(provider)
        self._holds[key] = self._holds.get(key, 0) + 1
        return provider

    def release(self, provider: pb.Provider) -> None:
        """Give back one hold on ``provider``; a replaced provider with no holds left is
        closed."""
        key = id(provider)
        holds = self._holds.get(key, 0) - 1
        if holds > 0:
            self._holds[key] = holds
            return
        self._holds.pop(key, None)
        retired = self._retired.pop(key, None)
        if retired is not None:
            self._close_soon(retired)

    def retire(self) -> None:
        """Use new providers from now on; the current ones close when their holders are done."""
        current, self._current = self._current, {}
        for provider in current.values():
            if id(provider) in self._holds:
                self._retired[id(provider)] = provider
            else:
                self._close_soon(provider)

    async def aclose(self, within: float) -> None:
        """Close every provider, each within ``within`` seconds (shielded: this runs at
        shutdown)."""
        providers = [*self._current.values(), *self._retired.values()]
        self._current.clear()
        self._retired.clear()
        self._holds.clear()
        for provider in providers:
            await close_provider(provider, within)


async def close_provider(provider: pb.Provider, within: float) -> None:
    """Close ``provider`` within ``within`` seconds, shielded; a failure is logged."""
    with trio.move_on_after(within, shield=True):
        try:
            await provider.aclose()
        except Exception:
            log.exception("closing a replaced provider failed")
