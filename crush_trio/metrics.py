"""The server's Prometheus metrics (docs/operations.md names each one and what to alert on).

One process-wide registry, separate from prometheus-client's default one so that importing the
package registers nothing globally. Every family lives on `METRICS`; code that counts something
imports it and calls the family, or a child bound to its labels beforehand
(`METRICS.transport("ws").dropped.inc()`).

Cost: an increment of a bound child is well under a microsecond, a label lookup a few times that,
which is why the hot paths count per event or per publish window (never per byte) and take
children bound once: per transport (:meth:`Metrics.transport`), per provider
(:meth:`Metrics.provider`), per event type (:attr:`Metrics.published`). Gauges that are a sum
over live objects (queued prompts) are computed when scraped, so they cost nothing in between.

Exposition (:func:`render`) leaves out the ``_created`` samples prometheus-client adds to every
counter and histogram: Prometheus does not need them, and they double the output.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Final, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from .errors import ConfigError, CrushError, ProviderError, SessionGone, StoreError

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence

    from prometheus_client.metrics_core import Metric

__all__ = [
    "CONTENT_TYPE",
    "METRICS",
    "Metrics",
    "ProviderMetrics",
    "TransportMetrics",
    "render",
]

#: The Content-Type of `render()`'s output: Prometheus text format 0.0.4, which every Prometheus
#: version reads (the names here are plain ASCII, so nothing needs format 1.0.0's escaping).
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

#: The prefix of every family's name.
_PREFIX: Final = "crush_trio_"
# Bucket edges, in seconds.
_RUN_SECONDS: Final = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_LATENCY_SECONDS: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
)
_BATCH_SIZES: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256)

#: Transports of client event streams; ``other`` is an in-process subscriber (tests, benchmarks).
TRANSPORTS: Final = ("ws", "sse", "other")
#: Distinct ``tool`` label values kept; calls of further tool names count as ``other`` (the model
#: chooses the name, so the label set must be bounded).
MAX_TOOL_LABELS: Final = 128
#: Distinct ``provider`` label values kept; further provider names (a workspace's config names
#: them) count as ``other``.
MAX_PROVIDER_LABELS: Final = 64
#: The ``tool`` label of a call naming a tool that is not offered.
UNKNOWN_TOOL: Final = "unknown"


class _Queued(Protocol):
    def queued_count(self) -> int: ...


class TransportMetrics:
    """The children of one transport's event-stream families, bound once."""

    __slots__ = ("dropped", "gaps", "killed", "streams")

    def __init__(self, metrics: Metrics, transport: str) -> None:
        self.dropped = metrics.events_dropped.labels(transport=transport)
        self.gaps = metrics.gaps_sent.labels(transport=transport)
        self.killed = metrics.clients_killed.labels(transport=transport)
        self.streams = metrics.client_streams.labels(transport=transport)


class ProviderMetrics:
    """The children of one provider's families, bound once (errors are bound when they
    happen: they are rare and their ``kind`` varies)."""

    __slots__ = ("_errors", "_name", "latency", "requests", "retries")

    def __init__(self, metrics: Metrics, provider: str) -> None:
        self._name = provider
        self._errors = metrics.provider_errors
        self.requests = metrics.provider_requests.labels(provider=provider)
        self.retries = metrics.provider_retries.labels(provider=provider)
        self.latency = metrics.provider_latency.labels(provider=provider)

    def error(self, kind: str) -> None:
        """Count a failed request of this provider (``kind``: see docs/operations.md)."""
        self._errors.labels(provider=self._name, kind=kind).inc()


class _Children(dict[str, Any]):
    """A family's children by the value of its one label, bound on first use."""

    def __init__(self, family: Counter) -> None:
        super().__init__()
        self._family = family

    def __missing__(self, key: str) -> Any:
        child = self[key] = self._family.labels(key)
        return child


class Metrics:
    """Every metric family of the server, registered on its own `CollectorRegistry`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # The standard process_* families (CPU seconds, resident memory, open descriptors).
        ProcessCollector(registry=self.registry)
        # Declared in the order of the exposition.
        self._declare_runs()
        self._declare_streams()
        self._declare_providers()
        self._declare_store()
        self._declare_workspaces()
        self._declare_webhooks()

    # -- families ------------------------------------------------------------------------------

    def _counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(_PREFIX + name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(_PREFIX + name, doc, labels, registry=self.registry)

    def _histogram(
        self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        return Histogram(_PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

    def _declare_runs(self) -> None:
        self.runs_accepted = self._counter("runs_accepted", "Prompts accepted (each one is a run)")
        self.runs_finished = self._counter(
            "runs_finished",
            "Runs that reached a terminal state, by outcome (completed, failed, cancelled) "
            "and reason",
            ["outcome", "reason"],
        )
        self.run_duration = self._histogram(
            "run_duration_seconds",
            "Time from a run's acceptance to its terminal state (queue wait included)",
            _RUN_SECONDS,
        )
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds",
            "Time from a run's acceptance to the first streamed content of its reply",
            _LATENCY_SECONDS,
        )
        self.queued_prompts = self._gauge("queued_prompts", "Prompts waiting in session queues")
        self._queues: weakref.WeakSet[Any] = weakref.WeakSet()
        self.queued_prompts.set_function(self._queued_total)

    def _declare_streams(self) -> None:
        """Events and clients."""
        self.events_published = self._counter(
            "events_published", "Events published by brokers, by type", ["type"]
        )
        #: ``events_published`` children by event type.
        self.published = _Children(self.events_published)
        self.events_dropped = self._counter(
            "events_dropped",
            "Lossy events dropped for a client whose queue was full, by transport",
            ["transport"],
        )
        self.gaps_sent = self._counter(
            "gaps_sent", "gap frames queued for clients, by transport", ["transport"]
        )
        self.clients_killed = self._counter(
            "clients_killed_slow",
            "Clients disconnected as too slow (1013): a must-deliver event or command reply "
            "found no room in time, or their queue stayed full; by transport",
            ["transport"],
        )
        self.client_streams = self._gauge(
            "client_streams", "Open client event streams, by transport", ["transport"]
        )
        self.slow_client_closes = self._counter(
            "slow_client_closes",
            "Websockets disconnected as too slow, by how the close ended: closed (the frame in "
            "flight, then the close frame 1013, written whole), aborted (not taken within "
            "SLOW_CLOSE_TIMEOUT: reset, nothing more written), gone (the client left first)",
            ["outcome"],
        )
        self.must_deliver_wait = self._histogram(
            "must_deliver_wait_seconds",
            "Time a must-deliver event waited for room in a full client queue (only events "
            "that had to wait)",
            _LATENCY_SECONDS,
        )
        self._transports = {t: TransportMetrics(self, t) for t in TRANSPORTS}

    def _declare_providers(self) -> None:
        self.provider_requests = self._counter(
            "provider_requests",
            "HTTP requests to LLM providers (each retry is one more)",
            ["provider"],
        )
        self.provider_errors = self._counter(
            "provider_errors",
            "Failed LLM provider requests, by kind (connect, timeout, rate_limited, auth, "
            "http_4xx, http_5xx, http, broken, protocol, config)",
            ["provider", "kind"],
        )
        self.provider_retries = self._counter(
            "provider_retries", "Retried provider requests", ["provider"]
        )
        self.provider_reads_taken = self._counter(
            "provider_reads_taken",
            "Reads of streaming model replies that a publish pass took in itself, without "
            "waking the stream's task",
        )
        self.provider_latency = self._histogram(
            "provider_latency_seconds",
            "Time from sending a provider request to its response headers",
            _LATENCY_SECONDS,
            ["provider"],
        )
        self._providers: dict[str, ProviderMetrics] = {}

    def _declare_store(self) -> None:
        self.store_write_latency = self._histogram(
            "store_write_seconds",
            "Time of one committed store write transaction (messages, run records, sessions)",
            _LATENCY_SECONDS,
        )
        self.store_batch_size = self._histogram(
            "store_batch_size",
            "Rows written per store transaction, by kind (messages, runs)",
            _BATCH_SIZES,
            ["kind"],
        )

    def _declare_workspaces(self) -> None:
        """Workspaces, tools, permissions."""
        self.workspaces_open = self._gauge(
            "workspaces_open", "Open workspaces (starting ones included)"
        )
        self.tool_calls = self._counter(
            "tool_calls",
            "Tool calls, by tool and outcome (ok, error, denied, cancelled)",
            ["tool", "outcome"],
        )
        self._tool_names: set[str] = set()
        self.permission_waits = self._histogram(
            "permission_wait_seconds",
            "Time a tool call waited for a permission answer, by outcome (allowed, denied, "
            "timeout, cancelled)",
            _RUN_SECONDS,
            ["outcome"],
        )
        self.permissions_pending = self._gauge(
            "permissions_pending", "Permission requests waiting for an answer"
        )

    def _declare_webhooks(self) -> None:
        """Run-completion webhooks."""
        self.webhook_deliveries = self._counter(
            "webhook_deliveries",
            "Webhook delivery attempts, by outcome (delivered, failed, retry, dropped)",
            ["outcome"],
        )
        self.webhook_pending = self._gauge(
            "webhook_pending", "Webhook deliveries waiting in outboxes"
        )
        self.webhook_latency = self._histogram(
            "webhook_latency_seconds", "Time of one webhook POST", _LATENCY_SECONDS
        )

    # -- bound children -------------------------------------------------------------------------

    def transport(self, transport: str) -> TransportMetrics:
        """The bound children of ``transport`` (one of :data:`TRANSPORTS`, else ``other``)."""
        return self._transports.get(transport) or self._transports["other"]

    def provider(self, name: str) -> ProviderMetrics:
        """The bound children of the provider called ``name`` in the configuration; names past
        :data:`MAX_PROVIDER_LABELS` share the children of ``other``."""
        bound = self._providers.get(name)
        if bound is None:
            if len(self._providers) >= MAX_PROVIDER_LABELS:
                name = "other"
                bound = self._providers.get(name)
                if bound is not None:
                    return bound
            bound = self._providers[name] = ProviderMetrics(self, name)
        return bound

    # -- what other modules report ----------------------------------------------------------

    def track_queue(self, source: _Queued) -> None:
        """Count ``source.queued_count()`` in ``queued_prompts`` while ``source`` lives."""
        self._queues.add(source)

    def _queued_total(self) -> float:
        return float(sum(source.queued_count() for source in list(self._queues)))

    def run_finished(self, seconds: float, outcome: str, reason: str) -> None:
        """A run reached its terminal state ``seconds`` after it was accepted."""
        self.runs_finished.labels(outcome=outcome, reason=reason).inc()
        self.run_duration.observe(seconds)

    def tool_called(self, tool: str, outcome: str) -> None:
        """Count one tool call; tool names past :data:`MAX_TOOL_LABELS` count as ``other``."""
        if tool not in self._tool_names:
            if len(self._tool_names) >= MAX_TOOL_LABELS:
                tool = "other"
            else:
                self._tool_names.add(tool)
        self.tool_calls.labels(tool=tool, outcome=outcome).inc()


def run_reason(error: BaseException | None, *, cancelled: bool, closing: bool) -> str:
    """The ``reason`` label of a finished run: ``closing`` is set when the server or workspace
    was shutting down.

    completed: ``ok``; cancelled: ``shutdown`` or ``cancel``; failed: ``provider``, ``store``,
    ``config``, ``session_deleted``, ``bug`` (an unexpected exception) or the error class's name.
    """
    if cancelled:
        return "shutdown" if closing else "cancel"
    if error is None:
        return "ok"
    if isinstance(error, ProviderError):
        return "provider"
    if isinstance(error, StoreError):
        return "store"
    if isinstance(error, ConfigError):
        return "config"
    if isinstance(error, SessionGone):
        return "session_deleted"
    if isinstance(error, CrushError):
        return type(error).__name__.lower()
    return "bug"


def status_kind(status: int) -> str:
    """The ``kind`` of a provider error from a non-2xx HTTP status."""
    if status == 429:
        return "rate_limited"
    if status in (401, 403):
        return "auth"
    return "http_5xx" if status >= 500 else "http_4xx"


#: The process's metrics.
METRICS = Metrics()


class _WithoutCreated:
    """A registry view whose families leave out their ``_created`` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


def render(metrics: Metrics = METRICS) -> bytes:
    """The Prometheus text exposition of `metrics`."""
    return generate_latest(_WithoutCreated(metrics.registry))


def sample_names(text: str) -> Iterator[str]:
    """Every sample name an exposition of these families may hold (``_total``, ``_bucket``,
    ``_sum``, ``_count`` included), from the ``# TYPE`` lines of ``text``: what a query may
    name even before a labelled family has its first child."""
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            if kind == "histogram":
                yield from (name + "_bucket", name + "_sum", name + "_count")
            elif kind == "counter" and not name.endswith("_total"):
                yield name + "_total"
            else:
                yield name
