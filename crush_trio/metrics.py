"""The server's Prometheus metrics (docs/operations.md names each one and what to alert on).

One process-wide registry, separate from prometheus-client's default one so that importing the
package registers nothing globally. Every family lives on `METRICS`; code that counts something
imports it and calls the family directly (`METRICS.runs_completed.labels(outcome="done").inc()`).
A counter increment costs about a microsecond, which is why the hot paths count per publish window
or per event, never per byte.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["CONTENT_TYPE", "METRICS", "Metrics", "render"]

#: The Content-Type of `render()`'s output (Prometheus text format 0.0.4).
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Bucket edges, in seconds.
_RUN_SECONDS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_LATENCY_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    """Every metric family of the server, registered on its own `CollectorRegistry`."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "crush_trio_"
        # Runs.
        self.runs_accepted = Counter(p + "runs_accepted", "Prompts accepted (202)", registry=r)
        self.runs_finished = Counter(
            p + "runs_finished",
            "Runs that reached a terminal state, by outcome (done, failed, cancelled) and reason",
            ["outcome", "reason"],
            registry=r,
        )
        self.run_duration = Histogram(
            p + "run_duration_seconds",
            "Time from a run's start to its terminal state",
            buckets=_RUN_SECONDS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            p + "time_to_first_token_seconds",
            "Time from a run's start to the first streamed text",
            buckets=_LATENCY_SECONDS,
            registry=r,
        )
        self.queued_prompts = Gauge(
            p + "queued_prompts", "Prompts waiting in session queues", registry=r
        )
        # Events and clients.
        self.events_published = Counter(
            p + "events_published", "Events published by brokers, by type", ["type"], registry=r
        )
        self.events_dropped = Counter(
            p + "events_dropped",
            "Lossy events dropped for a client whose channel was full, by transport",
            ["transport"],
            registry=r,
        )
        self.gaps_sent = Counter(
            p + "gaps_sent", "gap events sent to clients, by transport", ["transport"], registry=r
        )
        self.clients_killed = Counter(
            p + "clients_killed_slow",
            "Clients disconnected because they could not take a must-deliver event, by transport",
            ["transport"],
            registry=r,
        )
        self.client_streams = Gauge(
            p + "client_streams",
            "Open client event streams, by transport",
            ["transport"],
            registry=r,
        )
        self.must_deliver_wait = Histogram(
            p + "must_deliver_wait_seconds",
            "Time a must-deliver event waited for room in a client's channel",
            buckets=_LATENCY_SECONDS,
            registry=r,
        )
        # Providers.
        self.provider_requests = Counter(
            p + "provider_requests", "Requests to LLM providers", ["provider"], registry=r
        )
        self.provider_errors = Counter(
            p + "provider_errors",
            "Failed LLM provider requests, by kind",
            ["provider", "kind"],
            registry=r,
        )
        self.provider_retries = Counter(
            p + "provider_retries", "Retried provider requests", ["provider"], registry=r
        )
        self.provider_latency = Histogram(
            p + "provider_latency_seconds",
            "Time from a provider request to its response headers",
            ["provider"],
            buckets=_LATENCY_SECONDS,
            registry=r,
        )
        # Store.
        self.store_write_latency = Histogram(
            p + "store_write_seconds",
            "Time of one store write transaction",
            buckets=_LATENCY_SECONDS,
            registry=r,
        )
        self.store_batch_size = Histogram(
            p + "store_batch_size",
            "Writes committed per store transaction",
            buckets=_BATCH_SIZES,
            registry=r,
        )
        # Workspaces, tools, permissions.
        self.workspaces_open = Gauge(p + "workspaces_open", "Open workspaces", registry=r)
        self.tool_calls = Counter(
            p + "tool_calls",
            "Tool calls, by tool and outcome (ok, error, denied, cancelled)",
            ["tool", "outcome"],
            registry=r,
        )
        self.permission_waits = Histogram(
            p + "permission_wait_seconds",
            "Time a tool call waited for a permission answer",
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


#: The process's metrics.
METRICS = Metrics()


def render(metrics: Metrics = METRICS) -> bytes:
    """The Prometheus text exposition of `metrics`."""
    return generate_latest(metrics.registry)
