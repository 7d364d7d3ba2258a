"""What a workspace's configuration offers, in Crush's shapes: providers, models, selections.

Clients choose a model from this (the ``crush-trio models`` command, Crush's ``crush run -m``,
a model picker): ``GET .../providers`` lists :func:`catalog`, the workspace object's ``config``
is :func:`workspace_config`, and ``POST .../config/model`` goes through :func:`with_model`.

The provider list is the one :meth:`Config.resolve_named_model` accepts: every configured
provider, plus the built-in ``echo`` one when it is not configured. A provider that lists no
models accepts any model id; it shows the ones ``models.large``/``small`` name for it (and
``echo`` for an echo provider), so a client can still pick them. Keys, headers and
environment values are never part of any of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Literal

import attrs

from ..agent.summarize import context_window
from ..config import (
    ECHO_MODEL,
    ECHO_PROVIDER,
    Config,
    ModelEntry,
    ProviderConfig,
    SelectedModel,
)
from ..errors import BadRequest, ConfigError, NotFound
from ..wire import (
    CatalogModel,
    CatalogProvider,
    ConfigOptions,
    ConfigPermissions,
    ConfigProvider,
    ModelChoice,
    WorkspaceConfig,
)

if TYPE_CHECKING:
    from pathlib import Path

Role = Literal["large", "small"]
ROLES: Final[tuple[Role, ...]] = ("large", "small")


def providers_of(config: Config) -> dict[str, ProviderConfig]:
    """The providers a prompt may name, in the config's order (``echo`` last when built in)."""
    providers = dict(config.providers)
    if ECHO_PROVIDER not in providers:
        providers[ECHO_PROVIDER] = ProviderConfig(type="echo")
    return providers


def _selected(config: Config, role: Role) -> SelectedModel | None:
    if role == "small" and config.models.small is not None:
        return config.models.small
    return config.models.large


def _entries(config: Config, name: str, provider: ProviderConfig) -> list[ModelEntry]:
    if provider.models:
        return list(provider.models)
    ids: list[str] = []
    if provider.type == "echo":
        ids.append(ECHO_MODEL)
    for role in ROLES:
        selected = _selected(config, role)
        if selected is not None and selected.provider == name and selected.model not in ids:
            ids.append(selected.model)
    return [ModelEntry(id=i) for i in ids]


def catalog_model(entry: ModelEntry, config: Config) -> CatalogModel:
    """A model entry as clients see it: the context window the server applies (its
    ``options.default_context_window`` when the entry says none) and its prices."""
    return CatalogModel(
        id=entry.id,
        name=entry.name or entry.id,
        cost_per_1m_in=entry.cost_per_1m_in,
        cost_per_1m_out=entry.cost_per_1m_out,
        cost_per_1m_in_cached=entry.cost_per_1m_in_cached,
        cost_per_1m_out_cached=entry.cost_per_1m_out_cached,
        context_window=context_window(entry, config.options),
        default_max_tokens=entry.default_max_tokens,
    )


def _default_id(config: Config, name: str, role: Role, models: list[ModelEntry]) -> str:
    selected = _selected(config, role)
    if selected is not None and selected.provider == name:
        return selected.model
    return models[0].id if models else ""


def catalog(config: Config) -> list[CatalogProvider]:
    """``GET .../providers``: each usable provider with its models (Crush's catalog shape)."""
    out = []
    for name, provider in providers_of(config).items():
        entries = _entries(config, name, provider)
        out.append(
            CatalogProvider(
                id=name,
                name=name,
                type=provider.type,
                api_endpoint=provider.base_url,
                default_large_model_id=_default_id(config, name, "large", entries),
                default_small_model_id=_default_id(config, name, "small", entries),
                models=[catalog_model(e, config) for e in entries],
            )
        )
    return out


def selection(config: Config, role: Role) -> ModelChoice | None:
    """The model ``role`` uses (``small`` falls back to ``large``), or ``None`` when the
    configuration names none that resolves."""
    try:
        name, _, entry = config.resolve_model(role)
    except ConfigError:
        return None
    return ModelChoice(provider=name, model=entry.id)


def workspace_config(config: Config, data_dir: Path) -> WorkspaceConfig:
    """The workspace object's ``config``: Crush's ``config.Config`` shape, without secrets."""
    models: dict[str, ModelChoice] = {}
    for role in ROLES:
        choice = selection(config, role)
        if choice is not None:
            models[role] = choice
    providers = {
        p.id: ConfigProvider(
            id=p.id, name=p.name, type=p.type, base_url=p.api_endpoint, models=p.models
        )
        for p in catalog(config)
    }
    options = config.options
    return WorkspaceConfig(
        models=models,
        providers=providers,
        options=ConfigOptions(
            data_directory=str(data_dir),
            context_paths=list(options.context_paths),
            disable_auto_summarize=options.disable_auto_summarize,
        ),
        permissions=ConfigPermissions(allowed_tools=list(config.permissions.allowed_tools)),
    )


def model_info(config: Config) -> dict[str, Any]:
    """The agent's ``model``: the ``large`` model's provider, type and id, plus Crush's catalog
    fields (``catwalk.Model``)."""
    name, provider, entry = config.resolve_model("large")
    fields = attrs.asdict(catalog_model(entry, config))
    return {"provider": name, "type": provider.type, "model": entry.id, **fields}


def default_small_model(config: Config, provider_id: str) -> ModelChoice:
    """``GET .../agent/default-small-model?provider_id=``: the model the provider's
    ``small`` role would use (see :func:`catalog`).

    Raises:
        BadRequest: no ``provider_id``.
        NotFound: the provider is neither configured nor built in.
    """
    if not provider_id:
        raise BadRequest("provider_id is required: pass a provider id as ?provider_id=")
    for provider in catalog(config):
        if provider.id == provider_id:
            if not provider.default_small_model_id:
                raise NotFound(
                    f"provider {provider_id!r} lists no models; add one under "
                    f"$.providers.{provider_id}.models or name one in $.models.small"
                )
            return ModelChoice(provider=provider_id, model=provider.default_small_model_id)
    known = ", ".join(repr(p) for p in providers_of(config))
    raise NotFound(f"no provider {provider_id!r}; the providers are {known}")


def with_model(config: Config, role: Role, choice: ModelChoice) -> Config:
    """``config`` with ``models.<role>`` set to ``choice`` (its ``max_tokens`` kept when the
    selection names the same model).

    Raises:
        BadRequest: the provider or model is not one ``GET .../providers`` lists.
    """
    try:
        config.resolve_named_model(f"{choice.provider}/{choice.model}")
    except ConfigError as exc:
        raise BadRequest(f"model: {exc.message}") from None
    if choice.provider not in providers_of(config) or not choice.model:
        raise BadRequest(f"model: no provider {choice.provider!r}; see GET .../providers")
    old = config.models.large if role == "large" else config.models.small
    keep = old.max_tokens if old is not None and old.model == choice.model else 0
    selected = SelectedModel(provider=choice.provider, model=choice.model, max_tokens=keep)
    models = attrs.evolve(config.models, **{role: selected})
    return attrs.evolve(config, models=models)
