"""The event log on Redis Streams: one stream per workspace (cluster mode).

Keys (the ``{...}`` hash tag keeps a workspace's keys in one slot of a Redis Cluster):

* ``crush_trio:ws:{<workspace_id>}:events``: the stream. Each entry's id is ``<seq>-0``, so the
  stream id *is* the event's ``seq``; the entry has one field, ``e``, the encoded event.
* ``crush_trio:ws:{<workspace_id>}:epoch``: the epoch of the workspace's current owner.

An append is one Lua script call per batch: it checks the epoch key against the writer's epoch
and only then ``XADD``s every event (``MAXLEN ~ max_events``: the replay bound, trimmed in whole
stream nodes so at least ``max_events`` are kept). Redis runs a script atomically, so an append
either lands whole or, fenced, lands nothing; a fence (``SET`` of a newer epoch) cannot fall
between the check and the writes. Resume reads with ``XRANGE``.

coredis is anyio-native and so runs on Trio directly. Its client owns a task group, entered by
``async with``: :func:`open_redis_logs` opens one client per node and hands out a
:class:`RedisEventLog` per workspace on it.

Only cluster mode imports this module (coredis is in the ``cluster`` extra).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Final

import coredis
import coredis.exceptions
from coredis.retry import NoRetryPolicy

from ..errors import EventLogError, Fenced, unwrap_group
from ..eventlog import DEFAULT_LOG_MAX_EVENTS, check_batch

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from ..core.ports import EventRecord

#: Bound on connecting to Redis (seconds).
REDIS_CONNECT_TIMEOUT: Final = 5.0
#: Bound on one Redis command's reply (seconds).
REDIS_COMMAND_TIMEOUT: Final = 5.0
#: The stream entry's field that holds the encoded event.
EVENT_FIELD: Final = b"e"

# KEYS[1] stream, KEYS[2] epoch key; ARGV[1] writer's epoch, ARGV[2] MAXLEN, then id, data pairs.
_APPEND = """
local current = tonumber(redis.call('GET', KEYS[2]) or '0')
if current ~= tonumber(ARGV[1]) then
  return redis.error_reply('FENCED ' .. current)
end
for i = 3, #ARGV, 2 do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], ARGV[i], 'e', ARGV[i + 1])
end
return current
"""

# KEYS[1] epoch key; ARGV[1] the new epoch. Monotonic: an older epoch is refused.
_FENCE = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if tonumber(ARGV[1]) < current then
  return redis.error_reply('FENCED ' .. current)
end
redis.call('SET', KEYS[1], ARGV[1])
return current
"""


def stream_key(workspace_id: str) -> str:
    return f"crush_trio:ws:{{{workspace_id}}}:events"


def epoch_key(workspace_id: str) -> str:
    return f"crush_trio:ws:{{{workspace_id}}}:epoch"


def _fenced_epoch(exc: coredis.exceptions.ResponseError) -> int | None:
    """The owner's epoch when ``exc`` is a script's fencing refusal, else None."""
    text = str(exc)
    if text.startswith("FENCED "):
        return int(text.split()[1])
    return None


def _seq(identifier: Any) -> int:
    """The seq of a stream id ``b"<seq>-0"``."""
    raw = identifier.decode() if isinstance(identifier, bytes) else str(identifier)
    return int(raw.partition("-")[0])


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


class RedisEventLogs:
    """One node's Redis client and the per-workspace logs on it (see :func:`open_redis_logs`).

    Args:
        client: an entered coredis client (bytes replies).
        url: the Redis URL, for error messages.
        max_events: events each workspace's stream keeps (approximately: at least this many).
    """

    def __init__(
        self, client: coredis.Redis[bytes], url: str, max_events: int = DEFAULT_LOG_MAX_EVENTS
    ) -> None:
        self.client = client
        self.url = url
        self.max_events = max_events
        self.append_script = client.register_script(_APPEND)
        self.fence_script = client.register_script(_FENCE)

    def log(self, workspace_id: str) -> RedisEventLog:
        """A handle on ``workspace_id``'s log (epoch 0 until :meth:`RedisEventLog.fence`)."""
        return RedisEventLog(self, workspace_id)


@contextlib.asynccontextmanager
async def open_redis_logs(
    url: str, *, max_events: int = DEFAULT_LOG_MAX_EVENTS
) -> AsyncIterator[RedisEventLogs]:
    """Connect to Redis at ``url`` (``redis://host:port/db``) for the lifetime of the block.

    Raises:
        EventLogError: Redis cannot be reached; the message names the URL.
    """
    if max_events < 1:
        raise ValueError("an event log keeps at least one event")
    client: coredis.Redis[bytes] = coredis.Redis.from_url(
        url,
        connect_timeout=REDIS_CONNECT_TIMEOUT,
        stream_timeout=REDIS_COMMAND_TIMEOUT,
        # An append whose reply was lost must not be sent again blindly: the broker's writer
        # re-reads last_seq() and sends only what did not land.
        retry_policy=NoRetryPolicy(),
    )
    try:
        async with client:
            try:
                await client.ping()
            except (coredis.exceptions.RedisError, TimeoutError, OSError) as exc:
                raise EventLogError(
                    f"cannot reach Redis at {url}: {exc}; check cluster.redis_url"
                ) from exc
            yield RedisEventLogs(client, url, max_events)
    except BaseExceptionGroup as group:
        # The client's task group wraps whatever crosses it; callers get the one exception.
        inner = unwrap_group(group)
        if inner is group:
            raise
        raise inner from None


class RedisEventLog:
    """One workspace's :class:`~crush_trio.core.ports.EventLog` on a Redis stream."""

    def __init__(self, logs: RedisEventLogs, workspace_id: str) -> None:
        self._logs = logs
        self._client = logs.client
        self.workspace_id = workspace_id
        self.stream = stream_key(workspace_id)
        self.epoch_key = epoch_key(workspace_id)
        #: The epoch this handle was fenced with (0: never fenced).
        self.epoch = 0

    def _error(self, what: str, exc: BaseException) -> EventLogError:
        return EventLogError(
            f"event log of workspace {self.workspace_id}: {what} failed on Redis at "
            f"{self._logs.url}: {exc}"
        )

    async def append(self, batch: Sequence[EventRecord]) -> None:
        check_batch(batch, 0)
        if not batch:
            return
        args: list[Any] = [self.epoch, self._logs.max_events]
        for seq, data in batch:
            args.append(b"%d-0" % seq)
            args.append(data)
        try:
            await self._logs.append_script(keys=[self.stream, self.epoch_key], args=args)
        except coredis.exceptions.ResponseError as exc:
            owner = _fenced_epoch(exc)
            if owner is not None:
                raise Fenced(
                    f"event log of workspace {self.workspace_id} fenced: epoch {owner} owns it, "
                    f"this writer has epoch {self.epoch}; the workspace must stop on this node"
                ) from None
            if "equal or smaller" in str(exc):
                raise EventLogError(
                    f"event log append out of order: seq {batch[0][0]} is not above the last "
                    f"one of workspace {self.workspace_id}; a new owner continues from last_seq()"
                ) from exc
            raise self._error("append", exc) from exc
        except (coredis.exceptions.RedisError, TimeoutError, OSError) as exc:
            raise self._error("append", exc) from exc

    async def read(self, after_seq: int, limit: int) -> list[EventRecord]:
        if limit <= 0:
            return []
        try:
            entries = await self._client.xrange(
                self.stream, b"%d-1" % after_seq if after_seq > 0 else b"-", b"+", count=limit
            )
        except (coredis.exceptions.RedisError, TimeoutError, OSError) as exc:
            raise self._error("read", exc) from exc
        return [
            (_seq(entry.identifier), _bytes(entry.field_values[EVENT_FIELD])) for entry in entries
        ]

    async def _edge(self, newest: bool) -> int | None:
        try:
            if newest:
                entries = await self._client.xrevrange(self.stream, count=1)
            else:
                entries = await self._client.xrange(self.stream, count=1)
        except (coredis.exceptions.RedisError, TimeoutError, OSError) as exc:
            raise self._error("reading the stream's ends", exc) from exc
        return _seq(entries[0].identifier) if entries else None

    async def last_seq(self) -> int:
        return await self._edge(newest=True) or 0

    async def first_seq(self) -> int:
        first = await self._edge(newest=False)
        if first is not None:
            return first
        return await self.last_seq() + 1

    async def fence(self, epoch: int) -> None:
        try:
            await self._logs.fence_script(keys=[self.epoch_key], args=[epoch])
        except coredis.exceptions.ResponseError as exc:
            owner = _fenced_epoch(exc)
            if owner is not None:
                raise Fenced(
                    f"event log fence of workspace {self.workspace_id} refused: epoch {owner} "
                    f"owns it, {epoch} is older; the workspace belongs to another node"
                ) from None
            raise self._error("fence", exc) from exc
        except (coredis.exceptions.RedisError, TimeoutError, OSError) as exc:
            raise self._error("fence", exc) from exc
        self.epoch = epoch

    async def aclose(self) -> None:
        """Nothing to release: the client belongs to :func:`open_redis_logs`."""
        return None
