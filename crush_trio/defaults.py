"""Every default value of the server, in one place.

Two kinds of values live here:

* the default of every configuration key (``crush.json``, PROTOCOL §10) and the hard ceilings a
  workspace's file may not raise; :mod:`crush_trio.config` builds its schema from them, and the
  components that take the same setting as an argument (the broker, the provider client, the
  message service...) use them as their own defaults, so a component built without a
  configuration behaves like one built from an empty ``crush.json``;
* the fixed bounds that more than one module needs (a fixed bound used by one module only stays
  beside its code, where docs/protocol.md §11 names it).

The module imports nothing but :mod:`typing`, so every layer, the innermost included, may use it.
"""

from __future__ import annotations

from typing import Final

# ---------------------------------------------------------------------------------------------
# Fixed values shared by several modules

#: Address the server listens on unless ``--host`` says otherwise (loopback only).
DEFAULT_HOST: Final = "127.0.0.1"
#: Port the server listens on unless ``--port`` says otherwise.
DEFAULT_PORT: Final = 7433
#: Bound on sending a websocket close frame (or a refusal) to a client, in seconds.
CLOSE_TIMEOUT: Final = 2.0
#: Bound on one cleanup step that waits on a peer, in seconds: closing a provider's response
#: (shielded), closing a client's websocket connection or workspace block, closing the cluster's
#: database pool (connections still busy after it are dropped).
CLEANUP_TIMEOUT: Final = 5.0
#: How long SQLite waits for a lock held by another connection before failing with "database is
#: locked", in milliseconds (the store's database and the webhook outbox). In this process the
#: lock passes between the store's two connections, each holding it for one short transaction;
#: another process on the same file can hold it too.
SQLITE_BUSY_TIMEOUT_MS: Final = 5_000
#: Bytes at the start of a file or body looked at for a NUL byte: one there makes it binary
#: (context files, ``view``/``grep``/``edit``, ``fetch``).
BINARY_SNIFF_BYTES: Final = 8192
#: Items of one page of sessions, messages or runs when the request gives no ``limit`` (the
#: server's answer and the client's request alike).
DEFAULT_PAGE: Final = 100

# ---------------------------------------------------------------------------------------------
# Configuration defaults (``crush.json``; seconds unless named otherwise)

# Providers.
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
