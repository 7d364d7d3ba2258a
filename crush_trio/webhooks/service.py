"""Run-completion webhooks: the server's outbox and the tasks that deliver it (docs/webhooks.md).

Task ownership::

    Backend nursery
      └─ Webhooks.run                 one per server
           ├─ writer                  saves the outbox's changes to webhooks.db (worker thread)
           └─ one task per delivery   waits for its row to be saved, then POSTs, backs off, retries

**Enqueueing never waits.** :meth:`Webhooks.enqueue` is synchronous: it builds the body, appends
the delivery to the in-memory outbox, marks it for the writer and starts its task, then returns.
The run's ``run_complete`` is published to the event streams right after, whatever the
endpoints do. A delivery's first POST waits for its row to be committed, so a restart never loses
a delivery that could have been attempted.

**Bounds.** At most ``server.webhook_outbox_max`` deliveries, and
``server.webhook_outbox_bytes`` bytes of their bodies, are pending (the outbox keeps them in
memory as well as in the file); enqueueing one more drops the oldest pending delivery
(counted in ``webhook_deliveries{outcome="dropped"}`` and logged): a receiver that has been down
for long gets the most recent run ends. At most ``server.webhook_concurrency`` POSTs are in
flight; each is bounded by ``server.webhook_timeout``; the answer's body is never read (a huge
body costs nothing); redirects are not followed.

**Retries.** A connection error, a timeout, 408, 429 and 5xx are retried after
:func:`~crush_trio.webhooks.policy.backoff_delay` (exponential, with jitter, at least the
``Retry-After`` an endpoint sent, at most ``server.webhook_backoff_max``), up to
``server.webhook_max_attempts`` POSTs; then, or at once for any other answer, the delivery is
``failed`` and kept in the file for inspection (at most ``server.webhook_failed_kept``).

**Shutdown.** When :meth:`Webhooks.run` is cancelled (after every workspace closed, so the last
runs' ends are enqueued), in-flight POSTs are cancelled and stay pending, and the outbox's
changes are saved inside ``trio.move_on_after(save_timeout, shield=True)``. The next start loads
the pending deliveries and resumes them (receivers dedupe by delivery id: delivery is at least
once).
"""

from __future__ import annotations

import collections
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Final

import attrs
import httpx
import trio

from ..defaults import DEFAULT_SHUTDOWN_SAVE_TIMEOUT
from ..errors import StoreError
from ..metrics import METRICS
from ..providers.pool import shared_ssl_context
from ..wire import PermissionRequest, RunComplete, new_id, now
from . import policy
from .outbox import OUTBOX_FILENAME, Delivery, OutboxFile, Status
from .policy import Verdict

if TYPE_CHECKING:
    from ..config import ServerOptions

log = logging.getLogger(__name__)

#: Finds the secret of a delivery's endpoint from its scope and URL (None: no longer configured).
Resolver = Callable[[str, str], Awaitable[bytes | None]]
#: The error of a delivery whose endpoint is gone from the configuration.
UNCONFIGURED_ERROR: Final = (
    "the endpoint is no longer in the configuration (or its workspace is no longer trusted), so "
    "there is no secret to sign with"
)


@attrs.frozen
class Endpoint:
    """A configured endpoint, as the outbox uses it."""

    url: str
    secret: bytes = attrs.field(repr=False)
    events: tuple[str, ...] = (policy.RUN_COMPLETE_EVENT,)
    #: ``""``: the server's own; else the path of the workspace whose configuration lists it.
    scope: str = ""


def default_outbox_dir(env: dict[str, str] | None = None) -> Path:
    """Where the outbox lives when the server has no ``--data-dir``:
    ``$XDG_STATE_HOME/crush-trio`` (default ``~/.local/state/crush-trio``)."""
    env = dict(os.environ) if env is None else env
    state = env.get("XDG_STATE_HOME", "")
    base = Path(state) if state and Path(state).is_absolute() else Path.home() / ".local" / "state"
    return base / "crush-trio"


class Webhooks:
    """The server's webhook outbox and deliveries. Run it with :meth:`run` via ``nursery.start``.

    Args:
        options: the server's bounds (the ``webhook_*`` keys).
        path: the outbox file (:data:`~crush_trio.webhooks.outbox.OUTBOX_FILENAME` in the
            server's data directory).
        resolve: finds an endpoint's secret again for a delivery loaded after a restart.
        version: the server version, in ``User-Agent``.
        save_timeout: bound on the final save at shutdown.
        sleep: waits between attempts (tests record the delays instead of waiting).
        draw: the jitter's random number in ``[0, 1)``.
        wall: the Unix time (stored next-attempt times and signature timestamps).
        transport: the HTTP transport (tests only).
    """

    def __init__(
        self,
        options: ServerOptions,
        path: Path,
        *,
        resolve: Resolver,
        version: str = "",
        save_timeout: float = DEFAULT_SHUTDOWN_SAVE_TIMEOUT,
        sleep: Callable[[float], Awaitable[None]] = trio.sleep,
        draw: Callable[[], float] = random.random,
        wall: Callable[[], float] = time.time,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.options = options
        self.path = path
        self._resolve = resolve
        self._version = version
        self._save_timeout = save_timeout
        self._sleep = sleep
        self._draw = draw
        self._wall = wall
        self._transport = transport
        #: Pending deliveries, oldest first, and the bytes of their bodies.
        self._pending: collections.OrderedDict[str, Delivery] = collections.OrderedDict()
        self._pending_bytes = 0
        #: The cancel scope of each delivery's task.
        self._scopes: dict[str, trio.CancelScope] = {}
        #: Changes for the writer: a delivery's new state, or None to delete its row.
        self._dirty: dict[str, Delivery | None] = {}
        #: Set when the row of a new delivery is committed (or the write failed).
        self._saved: dict[str, trio.Event] = {}
        self._wake = trio.Event()
        self._limiter = trio.CapacityLimiter(options.webhook_concurrency)
        self._nursery: trio.Nursery | None = None
        self._file: OutboxFile | None = None
        self._client: httpx.AsyncClient | None = None
        #: Counts since start, by outcome (tests and logs read them).
        self.delivered = 0
        self.failed = 0
        self.retried = 0
        self.dropped = 0
        #: POSTs made (every outcome).
        self.attempts = 0
        #: Saves of the outbox file that committed.
        self.saves = 0
        self._changed = trio.Event()

    @property
    def pending(self) -> list[Delivery]:
        """The pending deliveries, oldest first."""
        return list(self._pending.values())

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` is true. It is checked again after every attempt's
        outcome, drop and save (for tests and tools that watch the outbox; bound the wait)."""
        while not predicate():
            await self._changed.wait()

    def _note(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- enqueueing (synchronous, never waits) --------------------------------------------------

    def enqueue(
        self,
        complete: RunComplete,
        *,
        workspace_id: str,
        workspace_path: str,
        endpoints: Iterable[Endpoint],
    ) -> list[str]:
        """Queue the end of a run for every endpoint that wants it; returns the delivery ids.

        Synchronous and quick: the POSTs happen in the deliveries' own tasks. When the outbox
        is full the oldest pending delivery is dropped (counted and logged).
        """
        return self._enqueue_each(
            endpoints,
            lambda events: policy.wanted(events, complete),
            partial(
                policy.build_body,
                complete,
                workspace_id=workspace_id,
                workspace_path=workspace_path,
                max_bytes=self.options.webhook_max_body_bytes,
            ),
        )

    def enqueue_permission(
        self,
        request: PermissionRequest,
        *,
        workspace_id: str,
        workspace_path: str,
        endpoints: Iterable[Endpoint],
    ) -> list[str]:
        """Queue a permission request for every endpoint that lists ``permission_request``;
        returns the delivery ids. Synchronous and quick, like :meth:`enqueue`."""
        return self._enqueue_each(
            endpoints,
            policy.wants_permission_requests,
            partial(
                policy.build_permission_body,
                request,
                workspace_id=workspace_id,
                workspace_path=workspace_path,
                max_bytes=self.options.webhook_max_body_bytes,
            ),
        )

    def _enqueue_each(
        self,
        endpoints: Iterable[Endpoint],
        wants: Callable[[list[str]], bool],
        build: Callable[..., bytes],
    ) -> list[str]:
        """One delivery for each endpoint whose ``events`` it ``wants``, its body made by
        ``build(delivery_id=, created_at=)``; returns the ids of those queued."""
        made: list[str] = []
        for endpoint in endpoints:
            if not wants(list(endpoint.events)):
                continue
            delivery_id = new_id()
            body = build(delivery_id=delivery_id, created_at=now())
            if self._enqueue_body(endpoint, delivery_id, body):
                made.append(delivery_id)
        return made

    def _enqueue_body(self, endpoint: Endpoint, delivery_id: str, body: bytes) -> bool:
        """Add one delivery of ``body`` to ``endpoint``; False when it was dropped at once."""
        created = self._wall()
        delivery = Delivery(
            id=delivery_id,
            url=endpoint.url,
            scope=endpoint.scope,
            body=body,
            created_at=created,
            next_at=created,
            secret=endpoint.secret,
        )
        if self._nursery is None:
            self._count_dropped(delivery, "the server is shutting down")
            return False
        self._make_room(len(body))
        self._saved[delivery.id] = trio.Event()
        self._add(delivery)
        self._mark(delivery)
        return True

    def _make_room(self, size: int) -> None:
        """Drop the oldest pending deliveries until one more of ``size`` bytes fits."""
        limit, limit_bytes = self.options.webhook_outbox_max, self.options.webhook_outbox_bytes
        while self._pending and (
            len(self._pending) >= limit or self._pending_bytes + size > limit_bytes
        ):
            _, oldest = self._pending.popitem(last=False)
            self._pending_bytes -= len(oldest.body)
            METRICS.webhook_pending.dec()
            scope = self._scopes.pop(oldest.id, None)
            if scope is not None:
                scope.cancel()
            self._saved.pop(oldest.id, None)
            self._dirty[oldest.id] = None
            self._wake.set()
            self._count_dropped(
                oldest,
                f"the outbox is full ({limit} deliveries or {limit_bytes} bytes pending: "
                "server.webhook_outbox_max, server.webhook_outbox_bytes)",
            )

    def _count_dropped(self, delivery: Delivery, why: str) -> None:
        self.dropped += 1
        METRICS.webhook_deliveries.labels(outcome="dropped").inc()
        self._note()
        log.warning(
            "webhook delivery %s to %s dropped: %s",
            delivery.id,
            policy.display_url(delivery.url),
            why,
        )

    def _add(self, delivery: Delivery) -> None:
        assert self._nursery is not None
        self._pending[delivery.id] = delivery
        self._pending_bytes += len(delivery.body)
        METRICS.webhook_pending.inc()
        # The scope exists from now on, so a drop before the task runs cancels it too.
        scope = self._scopes[delivery.id] = trio.CancelScope()
        self._nursery.start_soon(self._deliver, delivery, scope)

    def _mark(self, delivery: Delivery | None, delivery_id: str = "") -> None:
        key = delivery.id if delivery is not None else delivery_id
        self._dirty[key] = delivery
        self._wake.set()

    # -- lifetime -------------------------------------------------------------------------------

    async def run(
        self, *, task_status: trio.TaskStatus[Webhooks] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Load the pending deliveries of an earlier run, then deliver until cancelled.

        Cancellation: in-flight POSTs are cancelled and stay pending; the outbox's changes are
        saved inside ``trio.move_on_after(save_timeout, shield=True)`` and the file is closed.
        """
        loaded: list[Delivery] = []
        try:
            if await trio.to_thread.run_sync(os.path.lexists, self.path):
                self._file = await OutboxFile.open(self.path)
                loaded = await self._file.pending()
        except (StoreError, OSError) as exc:
            log.error("webhook outbox: %s; pending deliveries are not resumed", exc)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self._writer)
                for delivery in loaded:
                    self._make_room(len(delivery.body))
                    self._add(delivery)
                if loaded:
                    log.info("webhook outbox: resuming %d pending deliveries", len(loaded))
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            self._nursery = None
            with trio.move_on_after(self._save_timeout, shield=True):
                try:
                    await self._flush()
                except Exception as exc:
                    log.error("webhook outbox: the final save failed: %s", exc)
                if self._client is not None:
                    await self._client.aclose()
                if self._file is not None:
                    await self._file.aclose()
            METRICS.webhook_pending.dec(len(self._pending))
            self._pending.clear()

    # -- the writer -----------------------------------------------------------------------------

    async def _writer(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Save the outbox's changes as they come, a batch per transaction."""
        task_status.started()
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            try:
                await self._flush()
            except StoreError as exc:
                # Deliveries go on from memory; the changes stay marked and are written with
                # the next change. A stop before then loses them.
                log.error("webhook outbox: saving failed: %s; deliveries go on from memory", exc)
                for event in self._saved.values():
                    event.set()
                self._saved.clear()

    async def _flush(self) -> None:
        while self._dirty:
            batch, self._dirty = self._dirty, {}
            saves = [d.row() for d in batch.values() if d is not None]
            deletes = [key for key, d in batch.items() if d is None]
            try:
                if self._file is None:
                    self._file = await OutboxFile.open(self.path)
                await self._file.write(saves, deletes, failed_kept=self.options.webhook_failed_kept)
            except BaseException:
                for key, delivery in batch.items():
                    self._dirty.setdefault(key, delivery)
                raise
            self.saves += 1
            for key in batch:
                event = self._saved.pop(key, None)
                if event is not None:
                    event.set()
            self._note()

    # -- one delivery ---------------------------------------------------------------------------

    async def _deliver(self, delivery: Delivery, scope: trio.CancelScope) -> None:
        with scope:
            try:
                saved = self._saved.get(delivery.id)
                if saved is not None:
                    await saved.wait()
                # At most one backoff: a wall clock set back since the time was stored must
                # not hold a delivery for longer.
                wait = min(delivery.next_at - self._wall(), self.options.webhook_backoff_max)
                if wait > 0:
                    await self._sleep(wait)
                while True:
                    async with self._limiter:
                        verdict, error, retry_after = await self._attempt(delivery)
                    if verdict is Verdict.DELIVERED:
                        self._finish(delivery)
                        return
                    if (
                        verdict is Verdict.FAILED
                        or delivery.attempts >= self.options.webhook_max_attempts
                    ):
                        self._fail(delivery, error)
                        return
                    delay = policy.backoff_delay(
                        delivery.attempts,
                        base=self.options.webhook_backoff_base,
                        cap=self.options.webhook_backoff_max,
                        draw=self._draw(),
                        retry_after=retry_after,
                    )
                    delivery.next_at = self._wall() + delay
                    delivery.last_error = error
                    self._mark(delivery)
                    self.retried += 1
                    METRICS.webhook_deliveries.labels(outcome="retry").inc()
                    self._note()
                    log.info(
                        "webhook delivery %s to %s: attempt %d failed (%s); next in %.3g s",
                        delivery.id,
                        policy.display_url(delivery.url),
                        delivery.attempts,
                        error,
                        delay,
                    )
                    await self._sleep(delay)
            except Exception as exc:
                log.exception("webhook delivery %s failed with a bug", delivery.id)
                self._fail(delivery, policy.short(f"internal error: {exc!r}"))
            finally:
                if self._scopes.get(delivery.id) is scope:
                    del self._scopes[delivery.id]

    async def _attempt(self, delivery: Delivery) -> tuple[Verdict, str, float | None]:
        """One POST. Returns the verdict, the error text (empty when delivered) and the wait the
        endpoint asked for (``Retry-After``)."""
        secret = delivery.secret
        if secret is None:
            secret = await self._resolve(delivery.scope, delivery.url)
            if secret is None:
                return Verdict.FAILED, UNCONFIGURED_ERROR, None
            delivery.secret = secret
        client = await self._http()
        attempt = delivery.attempts + 1
        stamp = int(self._wall())
        headers = policy.headers(
            secret,
            body=delivery.body,
            delivery_id=delivery.id,
            attempt=attempt,
            timestamp=stamp,
            version=self._version,
            event=policy.event_of(delivery.body),
        )
        timeout = self.options.webhook_timeout
        started = trio.current_time()
        try:
            with trio.fail_after(timeout):
                async with client.stream(
                    "POST", delivery.url, content=delivery.body, headers=headers
                ) as response:
                    # The body is not read: an endpoint's answer is its status code.
                    status = response.status_code
                    retry_after = policy.parse_retry_after(
                        response.headers.get("retry-after"), self._wall()
                    )
        except trio.TooSlowError:
            verdict, error, retry_after = (
                Verdict.RETRY,
                f"no answer within {timeout:g} s (server.webhook_timeout)",
                None,
            )
        except httpx.TimeoutException:
            verdict, error, retry_after = (
                Verdict.RETRY,
                f"no answer within {timeout:g} s (server.webhook_timeout)",
                None,
            )
        except httpx.HTTPError as exc:
            text = str(exc).replace(delivery.url, policy.display_url(delivery.url))
            verdict, error, retry_after = (
                Verdict.RETRY,
                policy.short(f"{type(exc).__name__}: {text}" if text else type(exc).__name__),
                None,
            )
        else:
            verdict = policy.classify(status)
            error = "" if verdict is Verdict.DELIVERED else policy.describe_status(status)
        METRICS.webhook_latency.observe(trio.current_time() - started)
        delivery.attempts = attempt
        self.attempts += 1
        return verdict, error, retry_after

    async def _http(self) -> httpx.AsyncClient:
        """The HTTP client, made on the first attempt (a server with no endpoint never loads
        the TLS trust store for it)."""
        if self._client is None:
            ssl_context = await trio.to_thread.run_sync(shared_ssl_context)
            if self._client is None:
                self._client = httpx.AsyncClient(
                    follow_redirects=False,
                    verify=ssl_context,
                    timeout=httpx.Timeout(self.options.webhook_timeout),
                    limits=httpx.Limits(max_connections=self.options.webhook_concurrency),
                    transport=self._transport,
                )
        return self._client

    def _finish(self, delivery: Delivery) -> None:
        self._forget(delivery)
        self._mark(None, delivery.id)
        self.delivered += 1
        METRICS.webhook_deliveries.labels(outcome="delivered").inc()
        self._note()
        log.debug(
            "webhook delivery %s to %s delivered (attempt %d)",
            delivery.id,
            policy.display_url(delivery.url),
            delivery.attempts,
        )

    def _fail(self, delivery: Delivery, error: str) -> None:
        self._forget(delivery)
        delivery.status = Status.FAILED
        delivery.last_error = error
        self._mark(delivery)
        self.failed += 1
        METRICS.webhook_deliveries.labels(outcome="failed").inc()
        self._note()
        log.warning(
            "webhook delivery %s to %s failed after %d attempts: %s",
            delivery.id,
            policy.display_url(delivery.url),
            delivery.attempts,
            error,
        )

    def _forget(self, delivery: Delivery) -> None:
        if self._pending.pop(delivery.id, None) is not None:
            self._pending_bytes -= len(delivery.body)
            METRICS.webhook_pending.dec()


def outbox_path(data_dir: Path | None) -> Path:
    """The outbox file of a server with this ``--data-dir`` (None: :func:`default_outbox_dir`)."""
    return (data_dir if data_dir is not None else default_outbox_dir()) / OUTBOX_FILENAME
