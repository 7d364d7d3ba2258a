"""The configuration tree: frozen attrs classes rooted at :class:`Config`, with a default for
every field (from :mod:`crush_trio.defaults`), and the vocabulary of the file (provider and MCP
server types, webhook events).

Field metadata mark the numbers the checks bound (:data:`POSITIVE_METADATA`,
:data:`CEILING_METADATA`, :data:`LOOSENS_METADATA`); :mod:`crush_trio.config.checks` and
:mod:`crush_trio.config.trust` read them.
"""

from __future__ import annotations

import re
from typing import Any, Final, Literal, TypeVar, get_args

import attrs

from ..defaults import (
    CEILING_BASH_OUTPUT_LIMIT,
    CEILING_CONTEXT_WINDOW,
    CEILING_DELAY_MS,
    CEILING_MAX_RETRIES,
    CEILING_MAX_STEPS,
    CEILING_MAX_TOKENS,
    CEILING_PROVIDER_TIMEOUT,
    CEILING_RETRY_DELAY,
    CEILING_SUMMARY_MAX_TOKENS,
    CEILING_TITLE_MAX_WORDS,
    CEILING_TOOL_TIMEOUT,
    DEFAULT_AGENT_MAX_STEPS,
    DEFAULT_BASH_OUTPUT_LIMIT,
    DEFAULT_CHUNK_TIMEOUT,
    DEFAULT_CLIENT_QUEUE_BYTES,
    DEFAULT_CLIENT_QUEUE_SIZE,
    DEFAULT_COMPACT_BUFFER,
    DEFAULT_COMPACT_LARGE_WINDOW,
    DEFAULT_COMPACT_RATIO,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_CONTEXT_MAX_FILE_BYTES,
    DEFAULT_CONTEXT_MAX_TOTAL_BYTES,
    DEFAULT_CONTEXT_WINDOW,
    DEFAULT_CREATE_GRACE,
    DEFAULT_DATA_DIRECTORY,
    DEFAULT_DATABASE_POOL,
    DEFAULT_DEBOUNCE_MS,
    DEFAULT_DETACH_GRACE,
    DEFAULT_ECHO_DELAY_MS,
    DEFAULT_FETCH_MAX_BYTES,
    DEFAULT_FETCH_MAX_REDIRECTS,
    DEFAULT_FETCH_TIMEOUT,
    DEFAULT_FIRST_BYTE_TIMEOUT,
    DEFAULT_JOB_BUFFER_BYTES,
    DEFAULT_LEASE_TTL,
    DEFAULT_MAX_ATTACHMENT_BYTES,
    DEFAULT_MAX_ATTACHMENTS,
    DEFAULT_MAX_ATTACHMENTS_BYTES,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_JOBS,
    DEFAULT_MAX_QUEUED_PROMPT_BYTES,
    DEFAULT_MAX_QUEUED_PROMPTS,
    DEFAULT_MAX_RETIRED_CLIENTS,
    DEFAULT_MAX_RETRIES,
    DEFAULT_MAX_STEPS,
    DEFAULT_MAX_WORKSPACES,
    DEFAULT_MCP_TIMEOUT,
    DEFAULT_MESSAGE_WRITE_MS,
    DEFAULT_MUST_DELIVER_TIMEOUT,
    DEFAULT_PERMISSION_TIMEOUT,
    DEFAULT_REPLAY_BUFFER,
    DEFAULT_REPLAY_BYTES,
    DEFAULT_RETIRED_CLIENT_TTL,
    DEFAULT_RETRY_AFTER,
    DEFAULT_RETRY_BASE_DELAY,
    DEFAULT_RETRY_MAX_DELAY,
    DEFAULT_SCAN_INTERVAL,
    DEFAULT_SHUTDOWN_GRACE,
    DEFAULT_SHUTDOWN_SAVE_TIMEOUT,
    DEFAULT_SSE_PING_INTERVAL,
    DEFAULT_SUMMARY_MAX_TOKENS,
    DEFAULT_TCP_USER_TIMEOUT_MS,
    DEFAULT_TITLE_MAX_WORDS,
    DEFAULT_TOOL_TIMEOUT,
    DEFAULT_WEBHOOK_BACKOFF_BASE,
    DEFAULT_WEBHOOK_BACKOFF_MAX,
    DEFAULT_WEBHOOK_CONCURRENCY,
    DEFAULT_WEBHOOK_FAILED_KEPT,
    DEFAULT_WEBHOOK_MAX_ATTEMPTS,
    DEFAULT_WEBHOOK_MAX_BODY_BYTES,
    DEFAULT_WEBHOOK_OUTBOX_BYTES,
    DEFAULT_WEBHOOK_OUTBOX_MAX,
    DEFAULT_WEBHOOK_TIMEOUT,
    DEFAULT_WS_PING_INTERVAL,
    FETCH_MAX_BYTES_CEILING,
    FETCH_MAX_REDIRECTS_CEILING,
    FETCH_TIMEOUT_CEILING,
)
from ..errors import ConfigError
from ..wire import converter
from .problems import PathParts, Problem

_N = TypeVar("_N", int, float)

# ---------------------------------------------------------------------------------------------
# Names and vocabulary

#: Name of the built-in provider, usable without configuring it.
ECHO_PROVIDER: Final = "echo"
#: Model id of the built-in echo model.
ECHO_MODEL: Final = "echo"
#: What :func:`config_to_json` shows instead of a secret.
REDACTED: Final = "***"
ProviderType = Literal["openai-compat", "openai", "anthropic", "echo"]
#: The allowed values of a model's ``reasoning_effort`` (OpenAI's; empty: not sent).
ReasoningEffort = Literal["", "none", "minimal", "low", "medium", "high", "xhigh"]
#: The smallest Anthropic thinking budget the API accepts, in tokens.
MIN_THINKING_BUDGET: Final = 1024
#: The allowed values of ``providers.<name>.type``.
PROVIDER_TYPES: Final[tuple[str, ...]] = get_args(ProviderType)
#: What ``webhooks[].events`` may list: every run's end, or the runs of one outcome; and each
#: permission request that waits for an answer.
WebhookEvent = Literal[
    "run_complete",
    "run_complete.completed",
    "run_complete.failed",
    "run_complete.cancelled",
    "permission_request",
]
#: The allowed values of ``webhooks[].events``.
WEBHOOK_EVENTS: Final[tuple[str, ...]] = get_args(WebhookEvent)

# ---------------------------------------------------------------------------------------------
# Field metadata

#: Metadata of a number field that must be greater than 0 (every number is checked to be >= 0).
POSITIVE_METADATA: Final = "crush_trio.config.positive"
#: Metadata of a bound a workspace's file may set: the field of :class:`Ceilings` that caps it, or
#: a number, a hard ceiling no file can raise (None: no ceiling, as for ``permission_timeout``,
#: whose ``null`` means "wait until answered").
CEILING_METADATA: Final = "crush_trio.config.ceiling"
#: Metadata of such a bound: which way it loosens. ``"up"`` (the default): a larger value allows
#: more (more steps, more bytes, longer waits); ``"down"``: a smaller one does (a shorter publish
#: window sends more events, a smaller compaction margin keeps more context). An untrusted
#: workspace's file may only move a bound the other way (:mod:`crush_trio.config.trust`).
LOOSENS_METADATA: Final = "crush_trio.config.loosens"


def _positive(default: _N) -> _N:
    """A number field whose value must be greater than zero (zero would break the server)."""
    return attrs.field(default=default, metadata={POSITIVE_METADATA: True})


def _bound(default: _N, ceiling: str | None, *, positive: bool = True, loosens: str = "up") -> _N:
    """A bound a workspace's file may set: capped by ``ceilings.<ceiling>``, and only tightened
    by an untrusted workspace's file (see :data:`LOOSENS_METADATA`)."""
    return attrs.field(
        default=default,
        metadata={
            POSITIVE_METADATA: positive,
            CEILING_METADATA: ceiling,
            LOOSENS_METADATA: loosens,
        },
    )


# ---------------------------------------------------------------------------------------------
# The configuration tree


@attrs.frozen
class ModelEntry:
    """One model a provider offers; ``0`` means unknown / the provider's default.

    Prices are in dollars per million tokens (Crush's keys): ``cost_per_1m_in`` for input
    tokens not served from the prompt cache, ``cost_per_1m_out`` for output tokens,
    ``cost_per_1m_in_cached`` for tokens written to the prompt cache and
    ``cost_per_1m_out_cached`` for tokens read from it (as Crush's model catalog fills them).
    """

    id: str
    name: str = ""
    context_window: int = _bound(0, "context_window", positive=False)
    default_max_tokens: int = _bound(0, "max_tokens", positive=False)
    cost_per_1m_in: float = 0.0
    cost_per_1m_out: float = 0.0
    cost_per_1m_in_cached: float = 0.0
    cost_per_1m_out_cached: float = 0.0
    #: OpenAI-compatible types: the request's ``reasoning_effort`` (empty: not sent).
    reasoning_effort: ReasoningEffort = ""
    #: Anthropic: ``thinking: {type: enabled, budget_tokens}`` with this budget (0: not sent;
    #: at least :data:`MIN_THINKING_BUDGET` otherwise).
    thinking_budget: int = 0


@attrs.frozen
class ProviderConfig:
    """One entry of ``providers``: how to reach a model API, and its bounds."""

    type: ProviderType
    base_url: str = ""
    api_key: str = ""
    models: list[ModelEntry] = attrs.field(factory=list)
    extra_headers: dict[str, str] = attrs.field(factory=dict)
    #: Echo only: delay per streamed word, in milliseconds.
    #: A pause of the built-in fake model, not a bound on work: capped, never tightened.
    delay_ms: float = attrs.field(
        default=DEFAULT_ECHO_DELAY_MS, metadata={CEILING_METADATA: "delay_ms"}
    )
    connect_timeout: float = _bound(DEFAULT_CONNECT_TIMEOUT, "provider_timeout")
    first_byte_timeout: float = _bound(DEFAULT_FIRST_BYTE_TIMEOUT, "provider_timeout")
    chunk_timeout: float = _bound(DEFAULT_CHUNK_TIMEOUT, "provider_timeout")
    max_retries: int = _bound(DEFAULT_MAX_RETRIES, "max_retries", positive=False)
    retry_base_delay: float = _bound(DEFAULT_RETRY_BASE_DELAY, "retry_delay", positive=False)
    retry_max_delay: float = _bound(DEFAULT_RETRY_MAX_DELAY, "retry_delay", positive=False)

    def find_model(self, model_id: str) -> ModelEntry | None:
        """The entry of ``models`` with this id, or ``None``."""
        for entry in self.models:
            if entry.id == model_id:
                return entry
        return None


@attrs.frozen
class SelectedModel:
    """``models.large`` / ``models.small``: a provider name and one of its model ids."""

    provider: str
    model: str
    #: Overrides the model's ``default_max_tokens`` when non-zero.
    max_tokens: int = _bound(0, "max_tokens", positive=False)


@attrs.frozen
class Models:
    """The model chosen for each role; ``small`` falls back to ``large``."""

    large: SelectedModel | None = None
    small: SelectedModel | None = None


@attrs.frozen
class SandboxOptions:
    """``options.sandbox``: the OS sandbox ``bash`` commands run in (docs/tools.md, Security
    model). Only the user's config (or a trusted workspace's) should loosen it."""

    #: False runs commands without a sandbox; every ``bash`` command then asks for permission.
    enabled: bool = True
    #: Commands get the network without asking (otherwise a call's ``network`` request asks).
    network: bool = False
    #: Paths hidden from commands besides the built-in secret stores (``~`` and globs allowed).
    deny_read: list[str] = attrs.field(factory=list)
    #: Extra paths commands may read (toolchains outside ``/usr``, ``/opt``...).
    read_only_paths: list[str] = attrs.field(factory=list)


@attrs.frozen
class JobsOptions:
    """``options.jobs``: background jobs of ``bash`` (docs/tools.md)."""

    #: See :data:`DEFAULT_MAX_JOBS`.
    max_jobs: int = _positive(DEFAULT_MAX_JOBS)
    #: See :data:`DEFAULT_JOB_BUFFER_BYTES`.
    buffer_bytes: int = _positive(DEFAULT_JOB_BUFFER_BYTES)
    #: Cancelling a run also kills the background jobs it started (otherwise they go on until
    #: they end, ``job_kill`` or the workspace closes).
    kill_on_cancel: bool = False


@attrs.frozen
class FetchOptions:
    """``options.fetch``: the bounds of the ``fetch`` tool and the private networks it may reach
    (docs/tools.md). The numbers are capped by hard ceilings (``FETCH_*_CEILING``); an untrusted
    workspace's file may only lower them and may not set ``allow_private``."""

    max_bytes: int = attrs.field(
        default=DEFAULT_FETCH_MAX_BYTES,
        metadata={POSITIVE_METADATA: True, CEILING_METADATA: FETCH_MAX_BYTES_CEILING},
    )
    timeout: float = attrs.field(
        default=DEFAULT_FETCH_TIMEOUT,
        metadata={POSITIVE_METADATA: True, CEILING_METADATA: FETCH_TIMEOUT_CEILING},
    )
    max_redirects: int = attrs.field(
        default=DEFAULT_FETCH_MAX_REDIRECTS,
        metadata={CEILING_METADATA: FETCH_MAX_REDIRECTS_CEILING},
    )
    #: Networks (CIDR such as ``10.0.0.0/8``, or single addresses) fetch may reach although
    #: they are loopback, private, link-local or this machine's own; default none.
    allow_private: list[str] = attrs.field(factory=list)


@attrs.frozen
class Options:
    """Workspace and agent options."""

    data_directory: str = DEFAULT_DATA_DIRECTORY
    max_steps: int = _bound(DEFAULT_MAX_STEPS, "max_steps")
    debounce_ms: float = _bound(DEFAULT_DEBOUNCE_MS, "delay_ms", positive=False, loosens="down")
    title_max_words: int = _bound(DEFAULT_TITLE_MAX_WORDS, "title_max_words")
    #: ``None`` (wait until answered) counts as the loosest value.
    permission_timeout: float | None = attrs.field(
        default=DEFAULT_PERMISSION_TIMEOUT,
        metadata={POSITIVE_METADATA: True, LOOSENS_METADATA: "up"},
    )
    tool_timeout: float = _bound(DEFAULT_TOOL_TIMEOUT, "tool_timeout")
    bash_output_limit: int = _bound(DEFAULT_BASH_OUTPUT_LIMIT, "bash_output_limit")
    #: More context files and directories for the system prompt (docs/providers.md): relative
    #: to the workspace, or absolute / ``~`` (not from an untrusted workspace's file).
    context_paths: list[str] = attrs.field(factory=list)
    #: See :data:`DEFAULT_CONTEXT_MAX_FILE_BYTES` and :data:`DEFAULT_CONTEXT_MAX_TOTAL_BYTES`.
    context_max_file_bytes: int = _positive(DEFAULT_CONTEXT_MAX_FILE_BYTES)
    context_max_total_bytes: int = _positive(DEFAULT_CONTEXT_MAX_TOTAL_BYTES)
    sandbox: SandboxOptions = attrs.field(factory=SandboxOptions)
    fetch: FetchOptions = attrs.field(factory=FetchOptions)
    #: Summarize the session before the next model step when the context is nearly full.
    auto_compact: bool = True
    #: Crush's spelling of ``auto_compact: false`` (either one turns it off).
    disable_auto_summarize: bool = False
    #: See :data:`DEFAULT_COMPACT_LARGE_WINDOW`, :data:`DEFAULT_COMPACT_BUFFER` and
    #: :data:`DEFAULT_COMPACT_RATIO`.
    compact_large_window: int = _bound(
        DEFAULT_COMPACT_LARGE_WINDOW, "context_window", loosens="down"
    )
    compact_buffer_tokens: int = _bound(
        DEFAULT_COMPACT_BUFFER, "context_window", positive=False, loosens="down"
    )
    compact_ratio: float = _bound(DEFAULT_COMPACT_RATIO, None, positive=False, loosens="down")
    #: Context window of a model whose entry does not give one.
    default_context_window: int = _bound(DEFAULT_CONTEXT_WINDOW, "context_window")
    summary_max_tokens: int = _bound(DEFAULT_SUMMARY_MAX_TOKENS, "summary_max_tokens")
    #: See :data:`DEFAULT_AGENT_MAX_STEPS`.
    agent_max_steps: int = _bound(DEFAULT_AGENT_MAX_STEPS, "max_steps")
    jobs: JobsOptions = attrs.field(factory=JobsOptions)


@attrs.frozen
class Ceilings:
    """Hard ceilings of the bounds a workspace's file may set (top-level ``ceilings``, an
    addition; only the user's own file or ``--config`` may set it). A value above its ceiling,
    from any file, is an error naming both keys; an untrusted workspace's file may besides only
    tighten a bound, never loosen it."""

    max_steps: int = _positive(CEILING_MAX_STEPS)
    title_max_words: int = _positive(CEILING_TITLE_MAX_WORDS)
    tool_timeout: float = _positive(CEILING_TOOL_TIMEOUT)
    bash_output_limit: int = _positive(CEILING_BASH_OUTPUT_LIMIT)
    summary_max_tokens: int = _positive(CEILING_SUMMARY_MAX_TOKENS)
    context_window: int = _positive(CEILING_CONTEXT_WINDOW)
    max_tokens: int = _positive(CEILING_MAX_TOKENS)
    delay_ms: float = _positive(CEILING_DELAY_MS)
    provider_timeout: float = _positive(CEILING_PROVIDER_TIMEOUT)
    max_retries: int = _positive(CEILING_MAX_RETRIES)
    retry_delay: float = _positive(CEILING_RETRY_DELAY)


@attrs.frozen
class Permissions:
    """Tools that run without asking."""

    allowed_tools: list[str] = attrs.field(factory=list)


#: Characters of an MCP server's or tool's name that its tools' names (``mcp_<server>_<tool>``)
#: replace by ``_`` (the model APIs accept only these others).
MCP_NAME_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_-]")

McpType = Literal["stdio", "http", "sse"]
#: The allowed values of ``mcp.<name>.type``.
MCP_TYPES: Final[tuple[str, ...]] = get_args(McpType)


@attrs.frozen
class McpServerConfig:
    """One entry of ``mcp`` (Crush's shape): an MCP server whose tools join the toolbox.

    ``stdio`` runs ``command`` with ``args`` in the workspace (environment: the SDK's safe
    default variables plus ``env``); ``http`` (streamable HTTP) and ``sse`` connect to ``url``
    with ``headers``. Only the user's file or a trusted workspace's may define servers.
    """

    type: McpType = "stdio"
    command: str = ""
    args: list[str] = attrs.field(factory=list)
    env: dict[str, str] = attrs.field(factory=dict)
    url: str = ""
    headers: dict[str, str] = attrs.field(factory=dict)
    #: Not started; listed as ``disabled``.
    disabled: bool = False
    #: Tools of this server (its own names) not offered to the model.
    disabled_tools: list[str] = attrs.field(factory=list)
    #: Seconds the server has to start (:data:`DEFAULT_MCP_TIMEOUT`).
    timeout: float = _positive(DEFAULT_MCP_TIMEOUT)


@attrs.frozen
class WebhookConfig:
    """One entry of ``webhooks``: an endpoint that receives a signed POST for every run's end
    (docs/webhooks.md). Only the user's file, ``--config`` or a trusted workspace's file may
    list endpoints.

    After loading, :attr:`secret` holds the effective secret (``$VAR`` expanded, or the contents
    of ``secret_file``); it is left out of ``repr`` and redacted by :func:`config_to_json`.
    """

    url: str
    secret: str = attrs.field(default="", repr=False)
    #: A file holding the secret (absolute, ``~`` expands; surrounding whitespace is removed).
    secret_file: str = ""
    #: Which run ends are POSTed (default: every one).
    events: list[WebhookEvent] = attrs.field(factory=lambda: ["run_complete"])


@attrs.frozen
class ServerOptions:
    """The server's bounds (top-level key ``server``, an addition to the Crush format)."""

    #: Also the websocket frame limit.
    max_body_bytes: int = _positive(DEFAULT_MAX_BODY_BYTES)
    must_deliver_timeout: float = _positive(DEFAULT_MUST_DELIVER_TIMEOUT)
    client_queue_size: int = _positive(DEFAULT_CLIENT_QUEUE_SIZE)
    replay_buffer: int = DEFAULT_REPLAY_BUFFER
    replay_bytes: int = _positive(DEFAULT_REPLAY_BYTES)
    #: Who serves the event websocket: trio-websocket directly (default; cheaper per message and
    #: per connection, sends can be cut off) or the HTTP framework's own websocket route.
    ws_transport: Literal["trio-websocket", "asgi"] = "trio-websocket"
    create_grace: float = DEFAULT_CREATE_GRACE
    detach_grace: float = DEFAULT_DETACH_GRACE
    shutdown_save_timeout: float = _positive(DEFAULT_SHUTDOWN_SAVE_TIMEOUT)
    message_write_ms: float = DEFAULT_MESSAGE_WRITE_MS
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    sse_ping_interval: float = _positive(DEFAULT_SSE_PING_INTERVAL)
    ws_ping_interval: float = _positive(DEFAULT_WS_PING_INTERVAL)
    tcp_user_timeout_ms: int = DEFAULT_TCP_USER_TIMEOUT_MS
    allow_origins: list[str] = attrs.field(factory=list)
    #: Host names (``Host`` header, port ignored) served besides loopback ones; others get 421.
    allowed_hosts: list[str] = attrs.field(factory=list)
    # Memory bounds per client and per server.
    client_queue_bytes: int = _positive(DEFAULT_CLIENT_QUEUE_BYTES)
    max_workspaces: int = _positive(DEFAULT_MAX_WORKSPACES)
    retired_client_ttl: float = DEFAULT_RETIRED_CLIENT_TTL
    max_retired_clients: int = DEFAULT_MAX_RETIRED_CLIENTS
    # Bounds on queued prompts, per session (429 past either).
    max_queued_prompts: int = _positive(DEFAULT_MAX_QUEUED_PROMPTS)
    max_queued_prompt_bytes: int = _positive(DEFAULT_MAX_QUEUED_PROMPT_BYTES)
    # Bounds on one prompt's attachments (413 past either size, 400 past the count).
    max_attachment_bytes: int = _positive(DEFAULT_MAX_ATTACHMENT_BYTES)
    max_attachments_bytes: int = _positive(DEFAULT_MAX_ATTACHMENTS_BYTES)
    max_attachments: int = _positive(DEFAULT_MAX_ATTACHMENTS)
    # Run-completion webhooks: the outbox and its deliveries (docs/webhooks.md).
    webhook_outbox_max: int = _positive(DEFAULT_WEBHOOK_OUTBOX_MAX)
    webhook_outbox_bytes: int = _positive(DEFAULT_WEBHOOK_OUTBOX_BYTES)
    webhook_failed_kept: int = DEFAULT_WEBHOOK_FAILED_KEPT
    webhook_max_attempts: int = _positive(DEFAULT_WEBHOOK_MAX_ATTEMPTS)
    webhook_backoff_base: float = DEFAULT_WEBHOOK_BACKOFF_BASE
    webhook_backoff_max: float = DEFAULT_WEBHOOK_BACKOFF_MAX
    webhook_timeout: float = _positive(DEFAULT_WEBHOOK_TIMEOUT)
    webhook_concurrency: int = _positive(DEFAULT_WEBHOOK_CONCURRENCY)
    webhook_max_body_bytes: int = _positive(DEFAULT_WEBHOOK_MAX_BODY_BYTES)
    #: Serve ``/metrics`` without the token on this port of 127.0.0.1 (0: any free one);
    #: None (the default): only ``/metrics`` with the token on the main address.
    metrics_port: int | None = None


@attrs.frozen
class ClusterOptions:
    """Running as one node of a cluster (top-level key ``cluster``, user's file or ``--config``
    only; docs/cluster.md). Without ``database_url`` the server is a single node (SQLite and the
    in-memory event ring), and the rest of the section is ignored."""

    #: This node's id, unique in the cluster (default: the host name and the port).
    node_id: str = ""
    #: The URL other nodes redirect clients to (default: the URL the server listens on).
    advertise_url: str = ""
    #: PostgreSQL DSN (``postgresql://user@host:port/db``): sessions, runs, leases, nodes.
    database_url: str = ""
    #: Redis URL (``redis://host:port/0``): the workspaces' event logs.
    redis_url: str = ""
    lease_ttl: float = _positive(DEFAULT_LEASE_TTL)
    #: Seconds between lease renewals; 0 means a third of ``lease_ttl``.
    renew_interval: float = 0.0
    scan_interval: float = _positive(DEFAULT_SCAN_INTERVAL)
    retry_after: float = _positive(DEFAULT_RETRY_AFTER)
    database_pool: int = _positive(DEFAULT_DATABASE_POOL)

    @property
    def enabled(self) -> bool:
        return bool(self.database_url)

    @property
    def renew_every(self) -> float:
        return self.renew_interval or self.lease_ttl / 3


@attrs.frozen
class Config:
    """The whole configuration; ``Config()`` is the all-defaults one (built-in echo model)."""

    providers: dict[str, ProviderConfig] = attrs.field(factory=dict)
    models: Models = attrs.field(factory=Models)
    options: Options = attrs.field(factory=Options)
    permissions: Permissions = attrs.field(factory=Permissions)
    server: ServerOptions = attrs.field(factory=ServerOptions)
    #: Running as a node of a cluster (docs/cluster.md); off unless ``database_url`` is set.
    cluster: ClusterOptions = attrs.field(factory=ClusterOptions)
    #: MCP servers by name (docs/mcp.md).
    mcp: dict[str, McpServerConfig] = attrs.field(factory=dict)
    #: Workspace directories whose own config files are applied in full (each entry and every
    #: directory below it); read from the user's file only.
    trusted_workspaces: list[str] = attrs.field(factory=list)
    #: Endpoints POSTed at every run's end (docs/webhooks.md): the server's own (user file or
    #: ``--config``) apply to every workspace; a trusted workspace's file replaces the list for
    #: that workspace, added to the server's.
    webhooks: list[WebhookConfig] = attrs.field(factory=list)
    #: Hard ceilings of the bounds a workspace's file may set (user's file only).
    ceilings: Ceilings = attrs.field(factory=Ceilings)

    def resolve_model(
        self, role: Literal["large", "small"]
    ) -> tuple[str, ProviderConfig, ModelEntry]:
        """The provider name, provider config and model entry to use for ``role``.

        Rules: ``small`` falls back to ``large``. With no selection and no provider, the built-in
        echo model. With no selection but providers, the first provider's first model (model
        ``echo`` for an echo-type provider that lists none). A selected
        provider named ``echo`` that is not configured is the built-in one. When the provider
        lists no models, any model id is accepted. A non-zero ``max_tokens`` of the selection
        replaces the entry's ``default_max_tokens``.

        Raises:
            ConfigError: the selection names an unknown provider or model, or the first provider
                has no models; the message names the JSON path and the fix.
        """
        try:
            return resolve_role_model(self, role)
        except Problem as problem:
            raise ConfigError(problem.describe()) from None

    def resolve_named_model(self, spec: str) -> tuple[str, ProviderConfig, ModelEntry]:
        """The provider and model a prompt names: ``provider/model``, or a model id that
        exactly one configured provider lists.

        Raises:
            ConfigError: the name matches no configured model (or several); the message lists
                what there is.
        """
        return _resolve_named_model(self, spec)


def _resolve_named_model(config: Config, spec: str) -> tuple[str, ProviderConfig, ModelEntry]:
    spec = spec.strip()
    providers = dict(config.providers)
    if ECHO_PROVIDER not in providers:
        providers[ECHO_PROVIDER] = ProviderConfig(type="echo")
    name, sep, model_id = spec.partition("/")
    if sep and name in providers and model_id:
        provider = providers[name]
        entry = provider.find_model(model_id)
        if entry is None:
            if provider.models:
                known = ", ".join(repr(m.id) for m in provider.models)
                raise ConfigError(
                    f"model {model_id!r} is not in $.providers.{name}.models ({known}); "
                    "name one of them or add it to that list"
                )
            entry = ModelEntry(id=model_id)
        return name, provider, entry
    found = [(n, p, e) for n, p in providers.items() for e in p.models if e.id == spec]
    if len(found) == 1:
        return found[0]
    choices = ", ".join(
        f"{n}/{e.id}" if p.models else f"{n}/<any model id>"
        for n, p in providers.items()
        for e in (p.models or [ModelEntry(id="")])
    )
    if found:
        raise ConfigError(
            f"model {spec!r} is listed by several providers; name one as provider/model ({choices})"
        )
    raise ConfigError(
        f"model {spec!r} names no configured model; use provider/model (configured: {choices})"
    )


def builtin_echo() -> tuple[str, ProviderConfig, ModelEntry]:
    """The built-in echo provider and model, as :meth:`Config.resolve_model` returns them."""
    return ECHO_PROVIDER, ProviderConfig(type="echo"), ModelEntry(id=ECHO_MODEL)


def resolve_role_model(
    config: Config, role: Literal["large", "small"]
) -> tuple[str, ProviderConfig, ModelEntry]:
    """:meth:`Config.resolve_model`, raising a :class:`Problem` at the JSON path to fix."""
    selected = config.models.large if role == "large" else config.models.small
    where: PathParts = ("models", role)
    if selected is None and role == "small":
        selected, where = config.models.large, ("models", "large")
    if selected is None:
        if not config.providers:
            return builtin_echo()
        name, provider = next(iter(config.providers.items()))
        if provider.models:
            return name, provider, provider.models[0]
        if provider.type == "echo":
            return name, provider, ModelEntry(id=ECHO_MODEL)
        raise Problem(
            ("providers", name, "models"),
            f"provider {name!r} lists no models and $.models.large is not set; "
            "add a model to this list or set $.models.large",
        )

    name = selected.provider
    found = config.providers.get(name)
    if found is None:
        if name != ECHO_PROVIDER:
            choices = ", ".join(repr(p) for p in [*config.providers, ECHO_PROVIDER])
            raise Problem(
                (*where, "provider"),
                f"unknown provider {name!r}; use one of {choices} or add it under $.providers",
            )
        found = ProviderConfig(type="echo")
    provider = found
    if not selected.model:
        raise Problem((*where, "model"), "model is empty; set it to a model id")
    entry = provider.find_model(selected.model)
    if entry is None:
        if provider.models:
            known = ", ".join(repr(m.id) for m in provider.models)
            raise Problem(
                (*where, "model"),
                f"model {selected.model!r} is not in $.providers.{name}.models ({known}); "
                "use one of them or add it to that list",
            )
        entry = ModelEntry(id=selected.model)
    if selected.max_tokens:
        entry = attrs.evolve(entry, default_max_tokens=selected.max_tokens)
    return name, provider, entry


def config_to_json(config: Config) -> dict[str, Any]:
    """The configuration as JSON data for display, with secrets redacted.

    ``api_key``, every ``extra_headers`` value (they often carry tokens) and each webhook's
    ``secret`` become ``"***"`` when non-empty.
    """
    data: dict[str, Any] = converter.unstructure(config)
    for provider in data["providers"].values():
        if provider["api_key"]:
            provider["api_key"] = REDACTED
        provider["extra_headers"] = {
            header: REDACTED if value else value
            for header, value in provider["extra_headers"].items()
        }
    for server in data["mcp"].values():
        for secret in ("env", "headers"):
            server[secret] = {k: REDACTED if v else v for k, v in server[secret].items()}
    for hook in data["webhooks"]:
        if hook["secret"]:
            hook["secret"] = REDACTED
    for url in ("database_url", "redis_url"):  # a DSN may carry a password
        if data["cluster"][url]:
            data["cluster"][url] = REDACTED
    return data
