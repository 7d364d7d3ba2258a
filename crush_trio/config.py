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
   parent), its files may set only the allow-listed keys (``UNTRUSTED_*`` below: models and
   harmless options); every other key is ignored with a warning (:class:`LoadedConfig`).
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
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import re
import secrets
import stat
import threading
import types
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final, Literal, TypeVar, Union, get_args, get_origin

import attrs
import cattrs
import orjson

from .errors import ConfigError
from .wire import converter

logger: Final = logging.getLogger("crush_trio.config")

_N = TypeVar("_N", int, float)

# ---------------------------------------------------------------------------------------------
# Names and defaults

#: File name looked up in the user config directory and in a workspace.
CONFIG_FILE_NAME: Final = "crush.json"
#: Hidden variant in a workspace, merged over :data:`CONFIG_FILE_NAME`.
HIDDEN_CONFIG_FILE_NAME: Final = ".crush.json"
#: Directory under ``$XDG_CONFIG_HOME`` that holds the user file.
USER_CONFIG_SUBDIR: Final = "crush-trio"
#: Name of the built-in provider, usable without configuring it.
ECHO_PROVIDER: Final = "echo"
#: Model id of the built-in echo model.
ECHO_MODEL: Final = "echo"
#: What :func:`config_to_json` shows instead of a secret.
REDACTED: Final = "***"
#: Top-level keys accepted silently although they configure nothing (editors' schema hint).
IGNORED_TOP_LEVEL_KEYS: Final = frozenset({"$schema"})
#: Largest config file read, in bytes (1 MiB); a larger one is an error.
CONFIG_MAX_BYTES: Final = 1024 * 1024

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

ProviderType = Literal["openai-compat", "openai", "anthropic", "echo"]
#: The allowed values of a model's ``reasoning_effort`` (OpenAI's; empty: not sent).
ReasoningEffort = Literal["", "none", "minimal", "low", "medium", "high", "xhigh"]
#: The smallest Anthropic thinking budget the API accepts, in tokens.
MIN_THINKING_BUDGET: Final = 1024
#: The allowed values of ``providers.<name>.type``.
PROVIDER_TYPES: Final[tuple[str, ...]] = get_args(ProviderType)

# Providers (seconds unless named otherwise).
#: Echo provider: delay per streamed word, in milliseconds.
DEFAULT_ECHO_DELAY_MS: Final = 0.0
#: Longest wait to open a connection to a provider.
DEFAULT_CONNECT_TIMEOUT: Final = 10.0
#: Longest wait from sending a request to the first byte of the reply.
DEFAULT_FIRST_BYTE_TIMEOUT: Final = 60.0
#: Longest silence between two chunks of a streamed reply.
DEFAULT_CHUNK_TIMEOUT: Final = 60.0
#: Retries of a retryable provider failure before the run fails.
DEFAULT_MAX_RETRIES: Final = 3
#: First retry delay; it doubles on each retry.
DEFAULT_RETRY_BASE_DELAY: Final = 1.0
#: Cap on one retry delay.
DEFAULT_RETRY_MAX_DELAY: Final = 30.0

# Workspace and agent options.
#: Per-workspace data directory, relative to the workspace.
DEFAULT_DATA_DIRECTORY: Final = ".crush"
#: Most model calls in one run before it stops.
DEFAULT_MAX_STEPS: Final = 50
#: Publish window for streamed message updates (at most one ``message`` event per message per
#: window), in milliseconds.
DEFAULT_DEBOUNCE_MS: Final = 33.0
#: Longest generated session title, in words.
DEFAULT_TITLE_MAX_WORDS: Final = 8
#: Longest wait for a permission answer; ``None`` waits until the run is cancelled.
DEFAULT_PERMISSION_TIMEOUT: Final[float | None] = None
#: Longest run of one tool call, in seconds (``ToolContext.timeout``): the longest a tool may
#: work once it has permission; a ``bash`` command may ask for less, never more. Waiting for a
#: permission answer does not count.
DEFAULT_TOOL_TIMEOUT: Final = 120.0
#: Bytes of ``bash`` output kept in a tool result (``ToolContext.bash_output_limit``); the head
#: and tail are kept, the middle is cut.
DEFAULT_BASH_OUTPUT_LIMIT: Final = 30_000
#: Bytes of one project context file (``AGENTS.md``, ``CRUSH.md``, ``options.context_paths``...)
#: put in the system prompt; a longer file is cut there, with a note.
DEFAULT_CONTEXT_MAX_FILE_BYTES: Final = 32 * 1024
#: Bytes of all context files together; past it files are cut or skipped, with a note.
DEFAULT_CONTEXT_MAX_TOTAL_BYTES: Final = 128 * 1024

#: Most model calls of one ``agent`` tool call (a sub-agent's run in its child session).
DEFAULT_AGENT_MAX_STEPS: Final = 25
# Background jobs (``bash`` with ``background: true``; docs/tools.md).
#: Jobs a workspace keeps at once (running, plus ended ones not yet evicted); a new job beyond
#: the bound evicts the oldest ended job, and is refused when all of them still run.
DEFAULT_MAX_JOBS: Final = 8
#: Bytes of a job's output not yet read by ``job_output`` that are kept (the oldest are dropped,
#: and counted, beyond it).
DEFAULT_JOB_BUFFER_BYTES: Final = 256 * 1024

# The fetch tool (docs/tools.md, "fetch"). Each bound has a hard ceiling no config can raise,
# and an untrusted workspace's file may only lower it (below the user's value).
#: Largest body read, in bytes (after content decoding); the rest is not read.
DEFAULT_FETCH_MAX_BYTES: Final = 5 * 1024 * 1024
FETCH_MAX_BYTES_CEILING: Final = 50 * 1024 * 1024
#: Longest whole fetch (every redirect hop, connect, headers and body), in seconds.
DEFAULT_FETCH_TIMEOUT: Final = 30.0
FETCH_TIMEOUT_CEILING: Final = 120.0
#: Most redirects followed.
DEFAULT_FETCH_MAX_REDIRECTS: Final = 5
FETCH_MAX_REDIRECTS_CEILING: Final = 20

# Summaries and auto-compaction (Crush's thresholds).
#: Context window assumed for a model whose entry gives none (``context_window`` 0), in tokens.
DEFAULT_CONTEXT_WINDOW: Final = 128_000
#: Windows larger than this many tokens compact when at most :data:`DEFAULT_COMPACT_BUFFER`
#: tokens remain; smaller ones when at most :data:`DEFAULT_COMPACT_RATIO` of the window remains.
DEFAULT_COMPACT_LARGE_WINDOW: Final = 200_000
#: Remaining tokens that trigger compaction of a large window.
DEFAULT_COMPACT_BUFFER: Final = 20_000
#: Remaining fraction of the window that triggers compaction of a smaller window.
DEFAULT_COMPACT_RATIO: Final = 0.2
#: Longest summary a summarize request asks the model for, in tokens.
DEFAULT_SUMMARY_MAX_TOKENS: Final = 4096
# MCP servers.
#: Longest wait for one MCP server to start (spawn or connect, initialize, list its tools), in
#: seconds, unless its ``timeout`` says otherwise (Crush's default).
DEFAULT_MCP_TIMEOUT: Final = 15.0

# Server bounds.
#: Largest request body and websocket frame, in bytes (4 MiB).
DEFAULT_MAX_BODY_BYTES: Final = 4 * 1024 * 1024
#: Longest wait to hand a must-deliver event to a slow client before disconnecting it.
DEFAULT_MUST_DELIVER_TIMEOUT: Final = 2.0
#: Events buffered per client stream.
DEFAULT_CLIENT_QUEUE_SIZE: Final = 1024
#: Events kept per workspace for replay on reconnect.
DEFAULT_REPLAY_BUFFER: Final = 4096
#: Bytes of encoded events the replay buffer may hold (every message event carries the whole
#: message, so a count alone would not bound memory).
DEFAULT_REPLAY_BYTES: Final = 8 * 1024 * 1024
#: Time a creating client has to open its first stream.
DEFAULT_CREATE_GRACE: Final = 30.0
#: Time a workspace stays after a client's last stream closes.
DEFAULT_DETACH_GRACE: Final = 10.0
#: Write window for streamed message state, in milliseconds: pending state of every streaming
#: message is written in one transaction at most this long after it changed (terminal changes
#: are written at once). A crash can lose at most this much of a partial reply.
DEFAULT_MESSAGE_WRITE_MS: Final = 250.0
#: Longest shielded final save of a workspace at shutdown.
DEFAULT_SHUTDOWN_SAVE_TIMEOUT: Final = 5.0
#: Time given to work at server shutdown before it is cancelled.
DEFAULT_SHUTDOWN_GRACE: Final = 10.0
#: Interval of SSE keep-alive comments.
DEFAULT_SSE_PING_INTERVAL: Final = 15.0
#: Interval of websocket pings.
DEFAULT_WS_PING_INTERVAL: Final = 20.0
#: ``TCP_USER_TIMEOUT`` on accepted sockets, in milliseconds (0 leaves the OS default).
DEFAULT_TCP_USER_TIMEOUT_MS: Final = 2000
#: Bytes of encoded frames (events and command replies) buffered per client stream.
DEFAULT_CLIENT_QUEUE_BYTES: Final = 8 * 1024 * 1024
#: Workspaces open at once on one server (opening one more answers 429).
DEFAULT_MAX_WORKSPACES: Final = 64
#: How long a retired client id stays refused (seconds).
DEFAULT_RETIRED_CLIENT_TTL: Final = 3600.0
#: Retired client ids remembered at once (the oldest are forgotten first).
DEFAULT_MAX_RETIRED_CLIENTS: Final = 10_000

# Run-completion webhooks (docs/webhooks.md).
#: Deliveries waiting in the server's outbox; when it is full the oldest pending one is dropped.
DEFAULT_WEBHOOK_OUTBOX_MAX: Final = 1000
#: Bytes of the bodies of the pending deliveries (held in memory as well as in the file); past
#: it the oldest pending ones are dropped.
DEFAULT_WEBHOOK_OUTBOX_BYTES: Final = 32 * 1024 * 1024
#: Failed deliveries kept in the outbox file for inspection (the oldest are removed first).
DEFAULT_WEBHOOK_FAILED_KEPT: Final = 1000
#: POSTs of one delivery before it is marked failed.
DEFAULT_WEBHOOK_MAX_ATTEMPTS: Final = 10
#: Delay before the second attempt, in seconds; it doubles for each later one.
DEFAULT_WEBHOOK_BACKOFF_BASE: Final = 1.0
#: Cap on the delay between two attempts (and on an honoured ``Retry-After``), in seconds.
DEFAULT_WEBHOOK_BACKOFF_MAX: Final = 300.0
#: Longest one POST may take, connecting and the answer's headers included, in seconds.
DEFAULT_WEBHOOK_TIMEOUT: Final = 10.0
#: POSTs in flight at once, over every endpoint.
DEFAULT_WEBHOOK_CONCURRENCY: Final = 4
#: Largest body POSTed; a longer run text is cut to fit (``text_truncated``), in bytes.
DEFAULT_WEBHOOK_MAX_BODY_BYTES: Final = 256 * 1024
#: Largest ``secret_file`` of a webhook endpoint, in bytes.
WEBHOOK_SECRET_FILE_MAX_BYTES: Final = 4096
#: What ``webhooks[].events`` may list: every run's end, or the runs of one outcome; and each
#: permission request that waits for an answer.
WebhookEvent = Literal[
    "run_complete",
    "run_complete.completed",
    "run_complete.failed",
    "run_complete.cancelled",
    "permission_request",
]

# Bounds on queued prompts (per session).
#: Prompts one session may have waiting in its queue (a busy session's later prompts).
DEFAULT_MAX_QUEUED_PROMPTS: Final = 256
#: UTF-8 bytes of prompt text one session may have waiting in its queue (16 MiB).
DEFAULT_MAX_QUEUED_PROMPT_BYTES: Final = 16 * 1024 * 1024

# Bounds on prompt attachments (decoded bytes; base64 on the wire is 4/3 of that, and the whole
# body must also fit in ``server.max_body_bytes``).
#: Largest single attachment (2 MiB).
DEFAULT_MAX_ATTACHMENT_BYTES: Final = 2 * 1024 * 1024
#: Largest sum of one prompt's attachments (3 MiB: 4 MiB of base64, which with the rest of the
#: body needs ``server.max_body_bytes`` raised too; at the default body limit about 2.9 MiB fit).
DEFAULT_MAX_ATTACHMENTS_BYTES: Final = 3 * 1024 * 1024
#: Attachments one prompt may carry.
DEFAULT_MAX_ATTACHMENTS: Final = 16

# The ``cluster`` section (docs/cluster.md); every field also has a ``serve`` flag.
#: Seconds a workspace lease lasts without a renewal; another node may take the workspace then.
DEFAULT_LEASE_TTL: Final = 10.0
#: Seconds between two scans for expired leases of workspaces that still have runs to recover.
DEFAULT_SCAN_INTERVAL: Final = 1.0
#: Seconds a non-owner tells a client to wait (``Retry-After``) at the least, while the lease of
#: an owner that stopped answering has not expired.
DEFAULT_RETRY_AFTER: Final = 1.0
#: Connections one node keeps open to the database.
DEFAULT_DATABASE_POOL: Final = 8

# Hard ceilings of the bounds a workspace's file may set (top-level ``ceilings``, user's file or
# ``--config`` only). No file may set a bound above its ceiling.
#: ``options.max_steps``.
CEILING_MAX_STEPS: Final = 1000
#: ``options.title_max_words``.
CEILING_TITLE_MAX_WORDS: Final = 64
#: ``options.tool_timeout``, seconds (1 hour).
CEILING_TOOL_TIMEOUT: Final = 3600.0
#: ``options.bash_output_limit``, bytes (1 MiB): one tool result is held in memory, stored and
#: sent to the model and every client.
CEILING_BASH_OUTPUT_LIMIT: Final = 1024 * 1024
#: ``options.summary_max_tokens``.
CEILING_SUMMARY_MAX_TOKENS: Final = 128_000
#: ``options.default_context_window``, ``options.compact_large_window`` and a model entry's
#: ``context_window``, tokens.
CEILING_CONTEXT_WINDOW: Final = 10_000_000
#: A model entry's ``default_max_tokens`` and ``models.<role>.max_tokens``.
CEILING_MAX_TOKENS: Final = 1_000_000
#: ``options.debounce_ms`` and a provider's ``delay_ms``, milliseconds (1 minute).
CEILING_DELAY_MS: Final = 60_000.0
#: A provider's ``connect_timeout``, ``first_byte_timeout`` and ``chunk_timeout``, seconds
#: (1 hour).
CEILING_PROVIDER_TIMEOUT: Final = 3600.0
#: A provider's ``max_retries``.
CEILING_MAX_RETRIES: Final = 20
#: A provider's ``retry_base_delay`` and ``retry_max_delay``, seconds (1 hour).
CEILING_RETRY_DELAY: Final = 3600.0

# A number field is checked to be >= 0; these metadata mark the ones that must be > 0.
_POSITIVE: Final = "crush_trio.config.positive"
#: Metadata of a bound a workspace's file may set: the field of :class:`Ceilings` that caps it, or
#: a number, a hard ceiling no file can raise (None: no ceiling, as for ``permission_timeout``,
#: whose ``null`` means "wait until answered").
_CEILING: Final = "crush_trio.config.ceiling"
#: Metadata of such a bound: which way it loosens. ``"up"`` (the default): a larger value allows
#: more (more steps, more bytes, longer waits); ``"down"``: a smaller one does (a shorter publish
#: window sends more events, a smaller compaction margin keeps more context). An untrusted
#: workspace's file may only move a bound the other way (:func:`_loosens`).
_LOOSENS: Final = "crush_trio.config.loosens"


def _positive(default: _N) -> _N:
    """A number field whose value must be greater than zero (zero would break the server)."""
    return attrs.field(default=default, metadata={_POSITIVE: True})


def _bound(default: _N, ceiling: str | None, *, positive: bool = True, loosens: str = "up") -> _N:
    """A bound a workspace's file may set: capped by ``ceilings.<ceiling>``, and only tightened
    by an untrusted workspace's file (see :data:`_LOOSENS`)."""
    return attrs.field(
        default=default,
        metadata={_POSITIVE: positive, _CEILING: ceiling, _LOOSENS: loosens},
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
    delay_ms: float = attrs.field(default=DEFAULT_ECHO_DELAY_MS, metadata={_CEILING: "delay_ms"})
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
        metadata={_POSITIVE: True, _CEILING: FETCH_MAX_BYTES_CEILING},
    )
    timeout: float = attrs.field(
        default=DEFAULT_FETCH_TIMEOUT, metadata={_POSITIVE: True, _CEILING: FETCH_TIMEOUT_CEILING}
    )
    max_redirects: int = attrs.field(
        default=DEFAULT_FETCH_MAX_REDIRECTS, metadata={_CEILING: FETCH_MAX_REDIRECTS_CEILING}
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
        default=DEFAULT_PERMISSION_TIMEOUT, metadata={_POSITIVE: True, _LOOSENS: "up"}
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
            return _resolve_model(self, role)
        except _Problem as problem:
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


# ---------------------------------------------------------------------------------------------
# Converter hook

_PROVIDER_TYPE_HINT: Final[object] = ProviderType


def _structure_provider_type(value: Any, _: Any) -> str:
    if not isinstance(value, str) or value not in PROVIDER_TYPES:
        allowed = ", ".join(repr(t) for t in PROVIDER_TYPES)
        raise ValueError(f"unknown provider type {value!r}; allowed types: {allowed}")
    return value


# The converter's generic Literal error is "x not in literal typing.Literal[...]"; this one lists
# the allowed types in the file's own terms.
converter.register_structure_hook_func(lambda t: t == _PROVIDER_TYPE_HINT, _structure_provider_type)


_MCP_TYPE_HINT: Final[object] = McpType


def _structure_mcp_type(value: Any, _: Any) -> str:
    if not isinstance(value, str) or value not in MCP_TYPES:
        allowed = ", ".join(repr(t) for t in MCP_TYPES)
        raise ValueError(f"unknown MCP server type {value!r}; allowed types: {allowed}")
    return value


converter.register_structure_hook_func(lambda t: t == _MCP_TYPE_HINT, _structure_mcp_type)


_WEBHOOK_EVENT_HINT: Final[object] = WebhookEvent
#: The allowed values of ``webhooks[].events``.
WEBHOOK_EVENTS: Final[tuple[str, ...]] = get_args(WebhookEvent)


def _structure_webhook_event(value: Any, _: Any) -> str:
    if not isinstance(value, str) or value not in WEBHOOK_EVENTS:
        allowed = ", ".join(repr(t) for t in WEBHOOK_EVENTS)
        raise ValueError(f"unknown webhook event {value!r}; allowed events: {allowed}")
    return value


converter.register_structure_hook_func(lambda t: t == _WEBHOOK_EVENT_HINT, _structure_webhook_event)


# ---------------------------------------------------------------------------------------------
# Problems and paths

PathParts = tuple[str | int, ...]

_PLAIN_KEY: Final = re.compile(r"[A-Za-z0-9_-]+")


def format_path(parts: PathParts) -> str:
    """``("providers", "local", "models", 0)`` -> ``$.providers.local.models[0]``."""
    out = ["$"]
    for part in parts:
        if isinstance(part, int):
            out.append(f"[{part}]")
        elif _PLAIN_KEY.fullmatch(part):
            out.append(f".{part}")
        else:
            out.append(f"[{orjson.dumps(part).decode()}]")
    return "".join(out)


class _Problem(Exception):
    """One thing wrong at one path; ``message`` already says how to fix it."""

    def __init__(self, path: PathParts, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message

    def describe(self, origins: _Origins | None = None) -> str:
        where = format_path(self.path)
        source = origins.source_of(self.path) if origins is not None else None
        return f"{source}: {where}: {self.message}" if source else f"{where}: {self.message}"


def _raise_problems(problems: list[_Problem], origins: _Origins) -> None:
    if problems:
        raise ConfigError("\n".join(p.describe(origins) for p in problems))


@attrs.define
class _Origins:
    """Which file last set each key of the merged tree, to name the file in messages."""

    by_path: dict[PathParts, Path] = attrs.field(factory=dict)

    def set(self, path: PathParts, source: Path, *, replace: bool) -> None:
        if replace:
            # The whole subtree now comes from ``source``.
            n = len(path)
            for stale in [p for p in self.by_path if p[:n] == path]:
                del self.by_path[stale]
        self.by_path[path] = source

    def source_of(self, path: PathParts) -> Path | None:
        for n in range(len(path), -1, -1):
            found = self.by_path.get(path[:n])
            if found is not None:
                return found
        return None


# ---------------------------------------------------------------------------------------------
# Lookup, reading and merging


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


def _file_kind(mode: int) -> str:
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
            f"{path}: is {_file_kind(st.st_mode)}, not a regular file; a config file must be a "
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


def _read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
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
            f"{path}: $: expected a JSON object, got {_json_kind(data)}; "
            'make the file an object such as {"providers": {}}'
        )
    return data


def _merge_into(
    base: dict[str, Any],
    over: Mapping[str, Any],
    source: Path,
    origins: _Origins,
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


# ---------------------------------------------------------------------------------------------
# Workspace trust


def _trust_entries(user_data: Mapping[str, Any] | None) -> list[str]:
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


def _filter_project(
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
    if field is None or _LOOSENS not in field.metadata:
        return None
    new = _number(value)
    old = _number(base.get(key, field.default))
    if old is None:
        old = _number(field.default)
    if new is None or old is None:
        return None
    if field.metadata[_LOOSENS] == "down":
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


# ---------------------------------------------------------------------------------------------
# Shape check and unknown keys


def _json_kind(value: Any) -> str:
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


def _check_shape(
    value: Any,
    hint: Any,
    path: PathParts,
    problems: list[_Problem],
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
            problems.append(_Problem(path, f"expected an object, got {_json_kind(value)}"))
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
            problems.append(_Problem(path, f"expected an object, got {_json_kind(value)}"))
            return
        _, value_hint = get_args(hint)
        for key, item in value.items():
            _check_shape(item, value_hint, (*path, key), problems, unknown)
        return
    if origin is list:
        if not isinstance(value, list):
            problems.append(_Problem(path, f"expected an array, got {_json_kind(value)}"))
            return
        (item_hint,) = get_args(hint)
        for index, item in enumerate(value):
            _check_shape(item, item_hint, (*path, index), problems, unknown)


# ---------------------------------------------------------------------------------------------
# Structuring errors


def _structuring_problems(exc: BaseException, path: PathParts = ()) -> Iterator[_Problem]:
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
        yield _Problem(path, "required key missing; add it to the file")
    else:
        yield _Problem(path, f"{exc}; fix the value in the file")


# ---------------------------------------------------------------------------------------------
# Checks after structuring


def _check_bounds(
    obj: Any, path: PathParts, problems: list[_Problem], ceilings: Ceilings | None = None
) -> None:
    """Every number is finite and >= 0; fields marked positive must be > 0; a bound with a
    ceiling is at most ``ceilings.<name>`` (``ceilings`` defaults to ``obj.ceilings``)."""
    if ceilings is None:
        ceilings = obj.ceilings if isinstance(obj, Config) else Ceilings()
    for field in attrs.fields(type(obj)):
        value = getattr(obj, field.name)
        here = (*path, field.name)
        ceiling_name = field.metadata.get(_CEILING)
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            if not math.isfinite(value):
                problems.append(_Problem(here, "must be a finite number; fix the value"))
            elif field.metadata.get(_POSITIVE) and value <= 0:
                problems.append(
                    _Problem(here, f"must be greater than 0, got {value}; fix the value")
                )
            elif value < 0:
                problems.append(_Problem(here, f"must not be negative, got {value}; fix the value"))
            elif isinstance(ceiling_name, str) and value > (
                ceiling := getattr(ceilings, ceiling_name)
            ):
                problems.append(
                    _Problem(
                        here,
                        f"{value} is above its ceiling {ceiling} (ceilings.{ceiling_name}); lower "
                        "the value, or raise the ceiling in the user's crush.json",
                    )
                )
            elif isinstance(ceiling_name, (int, float)) and value > ceiling_name:
                problems.append(
                    _Problem(here, f"must be at most {ceiling_name} (a hard limit), got {value}")
                )
        elif attrs.has(type(value)):
            _check_bounds(value, here, problems, ceilings)
        if isinstance(obj, ModelEntry) and field.name == "thinking_budget":
            if 0 < value < MIN_THINKING_BUDGET:
                problems.append(
                    _Problem(
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
    origins: _Origins
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


def _check_mcp(config: Config, problems: list[_Problem]) -> None:
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
                _Problem(
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
                _Problem(("mcp", name, "command"), "a stdio MCP server needs a command; set it")
            )
        elif server.type != "stdio" and not server.url:
            problems.append(
                _Problem(("mcp", name, "url"), f"an {server.type} MCP server needs a url; set it")
            )


def _load_webhooks(expander: _Expander, config: Config, problems: list[_Problem]) -> Config:
    """``$VAR`` in each webhook's ``secret`` (trusted files only), ``secret_file`` read, and
    each endpoint checked: an http(s) URL with a host, exactly one way to give the secret."""
    hooks: list[WebhookConfig] = []
    for index, hook in enumerate(config.webhooks):
        base: PathParts = ("webhooks", index)
        before = len(problems)
        url = urllib.parse.urlsplit(hook.url)
        if url.scheme not in ("http", "https") or not url.hostname:
            problems.append(
                _Problem(
                    (*base, "url"),
                    "must be an http:// or https:// URL with a host; fix the value",
                )
            )
        if not hook.events:
            problems.append(
                _Problem(
                    (*base, "events"),
                    'is empty, so the endpoint would receive nothing; list "run_complete" or '
                    "remove the endpoint",
                )
            )
        secret = expander.expand(hook.secret, (*base, "secret"))
        if hook.secret and hook.secret_file:
            problems.append(
                _Problem(base, "set secret or secret_file, not both; remove one of them")
            )
        elif hook.secret_file:
            try:
                secret = _read_secret_file(hook.secret_file)
            except _Problem as problem:
                problems.append(_Problem((*base, "secret_file"), problem.message))
        if not secret and len(problems) == before:
            problems.append(
                _Problem(
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
        raise _Problem((), "must be an absolute path (~ expands); fix the value")
    try:
        # Opened without blocking and checked on the open file: a FIFO (or a file swapped for
        # one after a check) can never hang the server's start.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _Problem((), f"{path} is {_file_kind(st.st_mode)}; name a regular file")
            data = os.read(fd, WEBHOOK_SECRET_FILE_MAX_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) > WEBHOOK_SECRET_FILE_MAX_BYTES:
            raise _Problem(
                (),
                f"{path} is larger than {WEBHOOK_SECRET_FILE_MAX_BYTES} bytes "
                "(WEBHOOK_SECRET_FILE_MAX_BYTES); a secret file holds one secret",
            )
    except OSError as exc:
        raise _Problem(
            (), f"cannot read {path} ({exc.strerror or exc}); make it a readable file"
        ) from None
    try:
        secret = data.decode().strip()
    except UnicodeDecodeError:
        raise _Problem((), f"{path} is not UTF-8 text; write the secret as text") from None
    if not secret:
        raise _Problem((), f"{path} is empty; write the secret into it")
    return secret


def _resolve_model(
    config: Config, role: Literal["large", "small"]
) -> tuple[str, ProviderConfig, ModelEntry]:
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
        raise _Problem(
            ("providers", name, "models"),
            f"provider {name!r} lists no models and $.models.large is not set; "
            "add a model to this list or set $.models.large",
        )

    name = selected.provider
    found = config.providers.get(name)
    if found is None:
        if name != ECHO_PROVIDER:
            choices = ", ".join(repr(p) for p in [*config.providers, ECHO_PROVIDER])
            raise _Problem(
                (*where, "provider"),
                f"unknown provider {name!r}; use one of {choices} or add it under $.providers",
            )
        found = ProviderConfig(type="echo")
    provider = found
    if not selected.model:
        raise _Problem((*where, "model"), "model is empty; set it to a model id")
    entry = provider.find_model(selected.model)
    if entry is None:
        if provider.models:
            known = ", ".join(repr(m.id) for m in provider.models)
            raise _Problem(
                (*where, "model"),
                f"model {selected.model!r} is not in $.providers.{name}.models ({known}); "
                "use one of them or add it to that list",
            )
        entry = ModelEntry(id=selected.model)
    if selected.max_tokens:
        entry = attrs.evolve(entry, default_max_tokens=selected.max_tokens)
    return name, provider, entry


# ---------------------------------------------------------------------------------------------
# Public entry points


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
    origins = _Origins()
    loaded: list[Path] = []
    warnings: list[str] = []
    trusted_sources: set[Path] = set()
    trusted = False
    for index, path in enumerate(files):
        data = _read_json(path, required=config_file is not None)
        if index == 0:
            # --config FILE or the user's own file: trusted by definition.
            trusted_sources.add(path)
            if workspace is not None:
                trusted = is_trusted(workspace, _trust_entries(data))
        elif data is not None:
            assert workspace is not None
            providers = merged.get("providers")
            known = set(providers) if isinstance(providers, dict) else set()
            data, dropped = _filter_project(
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
    origins: _Origins,
    env: Mapping[str, str],
    trusted: bool,
    trusted_sources: set[Path],
    warnings: list[str],
) -> LoadedConfig:
    problems: list[_Problem] = []
    unknown: list[PathParts] = []
    _check_shape(merged, Config, (), problems, unknown)
    for path_parts in unknown:
        warnings.append(
            f"{origins.source_of(path_parts)}: {format_path(path_parts)}: unknown key ignored"
        )
    _raise_problems(problems, origins)

    try:
        config = converter.structure(merged, Config)
    except Exception as exc:
        _raise_problems(list(_structuring_problems(exc)), origins)
        raise  # pragma: no cover - every converter error yields at least one problem

    _check_bounds(config, (), problems)
    _raise_problems(problems, origins)

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
            _resolve_model(config, role)
        except _Problem as problem:
            problems.append(problem)
    _raise_problems(problems, origins)
    for line in warnings:
        logger.warning("%s", line)
    return LoadedConfig(config=config, trusted=trusted, warnings=tuple(warnings))


def _check_fetch(config: Config, problems: list[_Problem]) -> None:
    """Each ``options.fetch.allow_private`` entry is a network or an address."""
    for index, entry in enumerate(config.options.fetch.allow_private):
        try:
            ipaddress.ip_network(entry.strip(), strict=False)
        except ValueError:
            problems.append(
                _Problem(
                    ("options", "fetch", "allow_private", index),
                    f"{entry!r} is not a network or an address; write one such as "
                    '"10.0.0.0/8" or "192.168.1.20"',
                )
            )


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
    data = _read_json(target, required=False) or {}
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
