"""Configuration: a subset of Crush's ``crush.json`` format (PROTOCOL §7).

A configuration is a tree of frozen attrs classes, rooted at :class:`Config`, with a default for
every field: an empty file (``{}``), a missing file and ``Config()`` are all valid and give the
built-in ``echo`` model.

Loading goes in stages, each of which reports every problem it finds with the file and the JSON
path (``/p/crush.json: $.providers.local.type: ...``) before giving up:

1. **Lookup** (:func:`config_files`): ``--config FILE`` alone, or else the user file
   ``$XDG_CONFIG_HOME/crush-trio/crush.json`` with the workspace's ``crush.json`` and then
   ``.crush.json`` merged over it. Objects merge key by key, later files win, lists are replaced.
   The merge remembers which file set which key, so an error names the file to edit. Files must
   be regular files of at most :data:`CONFIG_MAX_BYTES`.
   **Workspace trust**: unless ``trusted_workspaces`` in the user file lists the workspace (or a
   parent), its files may set only the allow-listed keys (``UNTRUSTED_*``: models and harmless
   options); every other key is ignored with a warning (:class:`LoadedConfig`).
2. **Shape**: every object, map and list is where the classes expect one, and unknown keys are
   logged (one warning each, naming the path) and ignored, so a full Crush file works unchanged.
3. **Types**: the project's one converter (:data:`crush_trio.wire.converter`) structures the tree;
   it is strict, so ``"5"`` is not an int.
4. **Meaning**: numbers are within their bounds, ``$VAR``/``${VAR}`` in ``api_key``, ``base_url``
   and ``extra_headers`` expand from the environment (only in values a trusted file set), and
   ``models.large``/``models.small`` name a configured provider and model
   (:meth:`Config.resolve_model`).

Every failure is a :class:`~crush_trio.errors.ConfigError` whose message names the file, the path
and the fix.

The package, by concern:

* :mod:`.schema`: the classes, the file's vocabulary and model resolution; the defaults they
  take come from :mod:`crush_trio.defaults` (re-exported here);
* :mod:`.problems`: JSON paths, problems and the file that set each key;
* :mod:`.files`: finding and reading the files;
* :mod:`.trust`: what an untrusted workspace's file may set, and the user's trust list;
* :mod:`.checks`: stages 2 to 4;
* :mod:`.loading`: :func:`load_config_report`, which runs the stages;
* :mod:`.hooks`: the converter hooks of the configuration's types, installed by
  :func:`~crush_trio.config.hooks.register_config_hooks` once, below.
"""

from __future__ import annotations

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
from ..wire import converter
from .checks import (
    IGNORED_TOP_LEVEL_KEYS,
    WEBHOOK_SECRET_FILE_MAX_BYTES,
)
from .files import (
    CONFIG_FILE_NAME,
    CONFIG_MAX_BYTES,
    HIDDEN_CONFIG_FILE_NAME,
    USER_CONFIG_SUBDIR,
    config_files,
    user_config_file,
)
from .hooks import register_config_hooks
from .loading import (
    LoadedConfig,
    load_config,
    load_config_report,
    logger,
)
from .problems import (
    PathParts,
    format_path,
)
from .schema import (
    CEILING_METADATA,
    ECHO_MODEL,
    ECHO_PROVIDER,
    LOOSENS_METADATA,
    MCP_NAME_UNSAFE,
    MCP_TYPES,
    MIN_THINKING_BUDGET,
    POSITIVE_METADATA,
    PROVIDER_TYPES,
    REDACTED,
    WEBHOOK_EVENTS,
    Ceilings,
    ClusterOptions,
    Config,
    FetchOptions,
    JobsOptions,
    McpServerConfig,
    McpType,
    ModelEntry,
    Models,
    Options,
    Permissions,
    ProviderConfig,
    ProviderType,
    ReasoningEffort,
    SandboxOptions,
    SelectedModel,
    ServerOptions,
    WebhookConfig,
    WebhookEvent,
    builtin_echo,
    config_to_json,
)
from .trust import (
    UNTRUSTED_FETCH_LOWER_ONLY,
    UNTRUSTED_NEW_PROVIDER_TYPES,
    UNTRUSTED_OPTION_KEYS,
    UNTRUSTED_PROVIDER_KEYS,
    UNTRUSTED_TOP_LEVEL_KEYS,
    USER_ONLY_KEYS,
    TrustChange,
    is_trusted,
    set_workspace_trust,
)

__all__ = [
    "CEILING_BASH_OUTPUT_LIMIT",
    "CEILING_CONTEXT_WINDOW",
    "CEILING_DELAY_MS",
    "CEILING_MAX_RETRIES",
    "CEILING_MAX_STEPS",
    "CEILING_MAX_TOKENS",
    "CEILING_METADATA",
    "CEILING_PROVIDER_TIMEOUT",
    "CEILING_RETRY_DELAY",
    "CEILING_SUMMARY_MAX_TOKENS",
    "CEILING_TITLE_MAX_WORDS",
    "CEILING_TOOL_TIMEOUT",
    "CONFIG_FILE_NAME",
    "CONFIG_MAX_BYTES",
    "DEFAULT_AGENT_MAX_STEPS",
    "DEFAULT_BASH_OUTPUT_LIMIT",
    "DEFAULT_CHUNK_TIMEOUT",
    "DEFAULT_CLIENT_QUEUE_BYTES",
    "DEFAULT_CLIENT_QUEUE_SIZE",
    "DEFAULT_COMPACT_BUFFER",
    "DEFAULT_COMPACT_LARGE_WINDOW",
    "DEFAULT_COMPACT_RATIO",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_CONTEXT_MAX_FILE_BYTES",
    "DEFAULT_CONTEXT_MAX_TOTAL_BYTES",
    "DEFAULT_CONTEXT_WINDOW",
    "DEFAULT_CREATE_GRACE",
    "DEFAULT_DATABASE_POOL",
    "DEFAULT_DATA_DIRECTORY",
    "DEFAULT_DEBOUNCE_MS",
    "DEFAULT_DETACH_GRACE",
    "DEFAULT_ECHO_DELAY_MS",
    "DEFAULT_FETCH_MAX_BYTES",
    "DEFAULT_FETCH_MAX_REDIRECTS",
    "DEFAULT_FETCH_TIMEOUT",
    "DEFAULT_FIRST_BYTE_TIMEOUT",
    "DEFAULT_JOB_BUFFER_BYTES",
    "DEFAULT_LEASE_TTL",
    "DEFAULT_MAX_ATTACHMENTS",
    "DEFAULT_MAX_ATTACHMENTS_BYTES",
    "DEFAULT_MAX_ATTACHMENT_BYTES",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_JOBS",
    "DEFAULT_MAX_QUEUED_PROMPTS",
    "DEFAULT_MAX_QUEUED_PROMPT_BYTES",
    "DEFAULT_MAX_RETIRED_CLIENTS",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_MAX_STEPS",
    "DEFAULT_MAX_WORKSPACES",
    "DEFAULT_MCP_TIMEOUT",
    "DEFAULT_MESSAGE_WRITE_MS",
    "DEFAULT_MUST_DELIVER_TIMEOUT",
    "DEFAULT_PERMISSION_TIMEOUT",
    "DEFAULT_REPLAY_BUFFER",
    "DEFAULT_REPLAY_BYTES",
    "DEFAULT_RETIRED_CLIENT_TTL",
    "DEFAULT_RETRY_AFTER",
    "DEFAULT_RETRY_BASE_DELAY",
    "DEFAULT_RETRY_MAX_DELAY",
    "DEFAULT_SCAN_INTERVAL",
    "DEFAULT_SHUTDOWN_GRACE",
    "DEFAULT_SHUTDOWN_SAVE_TIMEOUT",
    "DEFAULT_SSE_PING_INTERVAL",
    "DEFAULT_SUMMARY_MAX_TOKENS",
    "DEFAULT_TCP_USER_TIMEOUT_MS",
    "DEFAULT_TITLE_MAX_WORDS",
    "DEFAULT_TOOL_TIMEOUT",
    "DEFAULT_WEBHOOK_BACKOFF_BASE",
    "DEFAULT_WEBHOOK_BACKOFF_MAX",
    "DEFAULT_WEBHOOK_CONCURRENCY",
    "DEFAULT_WEBHOOK_FAILED_KEPT",
    "DEFAULT_WEBHOOK_MAX_ATTEMPTS",
    "DEFAULT_WEBHOOK_MAX_BODY_BYTES",
    "DEFAULT_WEBHOOK_OUTBOX_BYTES",
    "DEFAULT_WEBHOOK_OUTBOX_MAX",
    "DEFAULT_WEBHOOK_TIMEOUT",
    "DEFAULT_WS_PING_INTERVAL",
    "ECHO_MODEL",
    "ECHO_PROVIDER",
    "FETCH_MAX_BYTES_CEILING",
    "FETCH_MAX_REDIRECTS_CEILING",
    "FETCH_TIMEOUT_CEILING",
    "HIDDEN_CONFIG_FILE_NAME",
    "IGNORED_TOP_LEVEL_KEYS",
    "LOOSENS_METADATA",
    "MCP_NAME_UNSAFE",
    "MCP_TYPES",
    "MIN_THINKING_BUDGET",
    "POSITIVE_METADATA",
    "PROVIDER_TYPES",
    "REDACTED",
    "UNTRUSTED_FETCH_LOWER_ONLY",
    "UNTRUSTED_NEW_PROVIDER_TYPES",
    "UNTRUSTED_OPTION_KEYS",
    "UNTRUSTED_PROVIDER_KEYS",
    "UNTRUSTED_TOP_LEVEL_KEYS",
    "USER_CONFIG_SUBDIR",
    "USER_ONLY_KEYS",
    "WEBHOOK_EVENTS",
    "WEBHOOK_SECRET_FILE_MAX_BYTES",
    "Ceilings",
    "ClusterOptions",
    "Config",
    "FetchOptions",
    "JobsOptions",
    "LoadedConfig",
    "McpServerConfig",
    "McpType",
    "ModelEntry",
    "Models",
    "Options",
    "PathParts",
    "Permissions",
    "ProviderConfig",
    "ProviderType",
    "ReasoningEffort",
    "SandboxOptions",
    "SelectedModel",
    "ServerOptions",
    "TrustChange",
    "WebhookConfig",
    "WebhookEvent",
    "builtin_echo",
    "config_files",
    "config_to_json",
    "format_path",
    "is_trusted",
    "load_config",
    "load_config_report",
    "logger",
    "set_workspace_trust",
    "user_config_file",
]

# The one place the configuration's hooks join the shared converter: before any configuration
# can be structured, since every module that structures one imports this package first.
register_config_hooks(converter)
