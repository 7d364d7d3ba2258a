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
from collections.abc import Iterable, Iterator
from typing import Any, Final, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

from .errors import ConfigError, CrushError, ProviderError, SessionGone, StoreError

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
        r = self.registry = CollectorRegistry(auto_describe=True)
        # The standard process_* families (CPU seconds, resident memory, open descriptors).
        ProcessCollector(registry=r)
        p = "crush_trio_"
        # Runs.
        self.runs_accepted = Counter(
            p + "runs_accepted", "Prompts accepted (each one is a run)", registry=r
        )
        self.runs_finished = Counter(
            p + "runs_finished",
            "Runs that reached a terminal state, by outcome (completed, failed, cancelled) "
            "and reason",
            ["outcome", "reason"],
            registry=r,
        )
        self.run_duration = Histogram(
            p + "run_duration_seconds",
            "Time from a run's acceptance to its terminal state (queue wait included)",
            buckets=_RUN_SECONDS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            p + "time_to_first_token_seconds",
            "Time from a run's acceptance to the first streamed content of its reply",
            buckets=_LATENCY_SECONDS,
            registry=r,
        )
        self.queued_prompts = Gauge(
            p + "queued_prompts", "Prompts waiting in session queues", registry=r
        )
        self._queues: weakref.WeakSet[Any] = weakref.WeakSet()
        self.queued_prompts.set_function(self._queued_total)
        # Events and clients.
        self.events_published = Counter(
            p + "events_published", "Events published by brokers, by type", ["type"], registry=r
        )
        #: ``events_published`` children by event type.
        self.published = _Children(self.events_published)
        self.events_dropped = Counter(
            p + "events_dropped",
            "Lossy events dropped for a client whose queue was full, by transport",
            ["transport"],
            registry=r,
        )
        self.gaps_sent = Counter(
            p + "gaps_sent",
            "gap frames queued for clients, by transport",
            ["transport"],
            registry=r,
        )
        self.clients_killed = Counter(
            p + "clients_killed_slow",
            "Clients disconnected as too slow (1013): a must-deliver event or command reply "
            "found no room in time, or their queue stayed full; by transport",
            ["transport"],
            registry=r,
        )
        self.client_streams = Gauge(
            p + "client_streams",
            "Open client event streams, by transport",
            ["transport"],
            registry=r,
        )
        self.slow_client_closes = Counter(
            p + "slow_client_closes",
            "Websockets disconnected as too slow, by how the close ended: closed (the frame in "
            "flight, then the close frame 1013, written whole), aborted (not taken within "
            "SLOW_CLOSE_TIMEOUT: reset, nothing more written), gone (the client left first)",
            ["outcome"],
            registry=r,
        )
        self.must_deliver_wait = Histogram(
            p + "must_deliver_wait_seconds",
            "Time a must-deliver event waited for room in a full client queue (only events "
            "that had to wait)",
            buckets=_LATENCY_SECONDS,
            registry=r,
        )
        self._transports = {t: TransportMetrics(self, t) for t in TRANSPORTS}
        # Providers.
        self.provider_requests = Counter(
            p + "provider_requests",
            "HTTP requests to LLM providers (each retry is one more)",
            ["provider"],
            registry=r,
        )
        self.provider_errors = Counter(
            p + "provider_errors",
            "Failed LLM provider requests, by kind (connect, timeout, rate_limited, auth, "
            "http_4xx, http_5xx, http, broken, protocol, config)",
            ["provider", "kind"],
            registry=r,
        )
        self.provider_retries = Counter(
            p + "provider_retries", "Retried provider requests", ["provider"], registry=r
        )
        self.provider_latency = Histogram(
            p + "provider_latency_seconds",
            "Time from sending a provider request to its response headers",
            ["provider"],
            buckets=_LATENCY_SECONDS,
            registry=r,
        )
        self._providers: dict[str, ProviderMetrics] = {}
        # Store.
        self.store_write_latency = Histogram(
            p + "store_write_seconds",
            "Time of one committed store write transaction (messages, run records, sessions)",
            buckets=_LATENCY_SECONDS,
            registry=r,
        )
        self.store_batch_size = Histogram(
            p + "store_batch_size",
            "Rows written per store transaction, by kind (messages, runs)",
            ["kind"],
            buckets=_BATCH_SIZES,
            registry=r,
        )
        # Workspaces, tools, permissions.
        self.workspaces_open = Gauge(
            p + "workspaces_open", "Open workspaces (starting ones included)", registry=r
        )
        self.tool_calls = Counter(
            p + "tool_calls",
            "Tool calls, by tool and outcome (ok, error, denied, cancelled)",
            ["tool", "outcome"],
            registry=r,
        )
        self._tool_names: set[str] = set()
        self.permission_waits = Histogram(
            p + "permission_wait_seconds",
            "Time a tool call waited for a permission answer, by outcome (allowed, denied, "
            "timeout, cancelled)",
            ["outcome"],
            buckets=_RUN_SECONDS,
            registry=r,
        )
        self.permissions_pending = Gauge(
            p + "permissions_pending", "Permission requests waiting for an answer", registry=r
        )
        # Run-completion webhooks.
        self.webhook_deliveries = Counter(
            p + "webhook_deliveries",
            "Webhook delivery attempts, by outcome (delivered, failed, retry, dropped)",
            ["outcome"],
            registry=r,
        )
        self.webhook_pending = Gauge(
            p + "webhook_pending", "Webhook deliveries waiting in outboxes", registry=r
        )
        self.webhook_latency = Histogram(
            p + "webhook_latency_seconds",
            "Time of one webhook POST",
            buckets=_LATENCY_SECONDS,
            registry=r,
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
    return generate_latest(_WithoutCreated(metrics.registry))  # type: ignore[arg-type]


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
