"""What a webhook delivery sends and decides, without I/O: the body, the signature, how an answer
is judged and how long to wait before the next attempt (docs/webhooks.md).

Everything here is a plain function of its inputs (the time and the random draw are arguments),
so the rules are tested as tables without an event loop or a socket.
"""

from __future__ import annotations

import email.utils
import enum
import hashlib
import hmac
import math
import urllib.parse
from typing import Any, Final

import orjson

from ..wire import PermissionRequest, RunComplete, converter

#: The event name, in the body's ``event`` and in :data:`EVENT_HEADER`.
RUN_COMPLETE_EVENT: Final = "run_complete"
#: The event of a permission request waiting for an answer (only to endpoints that list it).
PERMISSION_REQUEST_EVENT: Final = "permission_request"
#: Characters of a permission request's ``description`` kept in a webhook body.
PERMISSION_DESCRIPTION_CHARS: Final = 1000
#: ``sha256=<hex HMAC-SHA256 of "<timestamp>.<body>" keyed with the endpoint's secret>``.
SIGNATURE_HEADER: Final = "X-Crush-Trio-Signature"
#: Unix time (seconds) at which this attempt was signed; part of the signed text.
TIMESTAMP_HEADER: Final = "X-Crush-Trio-Timestamp"
#: The delivery id, the same on every attempt of one delivery (receivers dedupe by it).
DELIVERY_HEADER: Final = "X-Crush-Trio-Delivery"
#: The event name (the body's ``event``: :data:`RUN_COMPLETE_EVENT` or
#: :data:`PERMISSION_REQUEST_EVENT`).
EVENT_HEADER: Final = "X-Crush-Trio-Event"
#: Which attempt of the delivery this is, from 1.
ATTEMPT_HEADER: Final = "X-Crush-Trio-Attempt"
#: Prefix of the signature header's value.
SIGNATURE_PREFIX: Final = "sha256="
#: Each backoff delay is its nominal value times a random factor in ``[1 - JITTER, 1]``, so
#: endpoints recovering together are not hit in lockstep, and each delay still exceeds the one
#: before it (the nominal value doubles).
JITTER: Final = 0.25
#: Characters of an endpoint's answer or error kept in the outbox and the log.
ERROR_TEXT_CHARS: Final = 300


class Verdict(enum.Enum):
    """What one attempt's answer means for the delivery."""

    #: 2xx: done.
    DELIVERED = "delivered"
    #: A connection error, a timeout, 408, 429 or 5xx: try again after a backoff delay.
    RETRY = "retry"
    #: Any other answer (other 4xx, 3xx: redirects are not followed, 1xx): give up now.
    FAILED = "failed"


def classify(status: int) -> Verdict:
    """The verdict on an HTTP answer with this status code."""
    if 200 <= status < 300:
        return Verdict.DELIVERED
    if status in (408, 429) or 500 <= status < 600:
        return Verdict.RETRY
    return Verdict.FAILED


def describe_status(status: int) -> str:
    """The error text of an answer that did not deliver."""
    if 300 <= status < 400:
        return f"HTTP {status}: a redirect, which is not followed; configure the URL it points to"
    return f"HTTP {status}"


def outcome_of(complete: RunComplete) -> str:
    """``completed``, ``failed`` or ``cancelled``: how the run ended."""
    if complete.cancelled:
        return "cancelled"
    if complete.error is not None:
        return "failed"
    return "completed"


def wanted(events: list[str], complete: RunComplete) -> bool:
    """Whether an endpoint whose ``events`` are these receives the end of this run."""
    return RUN_COMPLETE_EVENT in events or f"{RUN_COMPLETE_EVENT}.{outcome_of(complete)}" in events


def wants_permission_requests(events: list[str]) -> bool:
    """Whether an endpoint whose ``events`` are these receives permission requests."""
    return PERMISSION_REQUEST_EVENT in events


def build_permission_body(
    request: PermissionRequest,
    *,
    delivery_id: str,
    workspace_id: str,
    workspace_path: str,
    created_at: int,
    max_bytes: int,
) -> bytes:
    """The JSON body of a permission request's delivery: ``event``, ``delivery_id``,
    ``workspace_id``, ``workspace_path``, ``created_at``, the request under ``permission`` (as
    the ``permission_request`` event carries it) and ``params_truncated``.

    The description is cut to :data:`PERMISSION_DESCRIPTION_CHARS`; when the body is still over
    ``max_bytes`` (a large ``write``), ``params`` is left out and ``params_truncated`` is true:
    the receiver reads the whole request from ``GET .../permissions``.
    """
    permission: dict[str, Any] = converter.unstructure(request)
    permission["description"] = permission["description"][:PERMISSION_DESCRIPTION_CHARS]
    body: dict[str, Any] = {
        "event": PERMISSION_REQUEST_EVENT,
        "delivery_id": delivery_id,
        "workspace_id": workspace_id,
        "workspace_path": workspace_path,
        "created_at": created_at,
        "permission": permission,
        "params_truncated": False,
    }
    data = orjson.dumps(body)
    if len(data) > max_bytes:
        permission["params"] = {}
        body["params_truncated"] = True
        data = orjson.dumps(body)
    return data


def event_of(body: bytes) -> str:
    """The event a delivery's body is about (its ``event`` key)."""
    try:
        event = orjson.loads(body).get("event")
    except (orjson.JSONDecodeError, AttributeError):
        return RUN_COMPLETE_EVENT
    return event if isinstance(event, str) else RUN_COMPLETE_EVENT


def build_body(
    complete: RunComplete,
    *,
    delivery_id: str,
    workspace_id: str,
    workspace_path: str,
    created_at: int,
    max_bytes: int,
) -> bytes:
    """The JSON body of a delivery: the ``run_complete`` payload's fields, plus ``event``,
    ``delivery_id``, ``workspace_id``, ``workspace_path``, ``outcome``, ``created_at`` (Unix
    seconds, the wire's time format) and ``text_truncated``.

    A body longer than ``max_bytes`` has its ``text`` cut (at a character boundary) so that it
    fits, and ``text_truncated`` is true; the whole text stays in the run record
    (``GET .../runs/{run_id}``).
    """
    payload: dict[str, Any] = converter.unstructure(complete)
    body: dict[str, Any] = {
        "event": RUN_COMPLETE_EVENT,
        "delivery_id": delivery_id,
        "workspace_id": workspace_id,
        "workspace_path": workspace_path,
        "outcome": outcome_of(complete),
        "created_at": created_at,
        **payload,
        "text_truncated": False,
    }
    text: str = body["text"]
    if len(text) <= max_bytes:  # else the text alone is too long: no need to encode it all
        data = orjson.dumps(body)
        if len(data) <= max_bytes:
            return data
    body["text"] = ""
    body["text_truncated"] = True
    overhead = len(orjson.dumps(body))
    room = max(max_bytes - overhead, 0)
    raw = text[:max_bytes].encode()  # a character is at least one byte
    # JSON escapes make some characters longer than their UTF-8 bytes: shrink in proportion
    # until it fits (once or twice).
    keep = room
    while True:
        cut = raw[:keep].decode(errors="ignore")
        body["text"] = cut
        data = orjson.dumps(body)
        if len(data) <= max_bytes or not cut:
            return data
        keep = min(keep - 1, keep * room // (len(data) - overhead))


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    """The signature header's value for ``body`` sent at ``timestamp`` (Unix seconds)."""
    mac = hmac.new(secret, b"%d." % timestamp + body, hashlib.sha256)
    return SIGNATURE_PREFIX + mac.hexdigest()


def verify(secret: bytes, timestamp: str, body: bytes, signature: str) -> bool:
    """What a receiver checks (docs/webhooks.md shows the same in a few lines)."""
    try:
        stamp = int(timestamp)
    except ValueError:
        return False
    return hmac.compare_digest(sign(secret, stamp, body), signature)


def headers(
    secret: bytes,
    *,
    body: bytes,
    delivery_id: str,
    attempt: int,
    timestamp: int,
    version: str,
    event: str = RUN_COMPLETE_EVENT,
) -> dict[str, str]:
    """The headers of one attempt."""
    return {
        "Content-Type": "application/json",
        "User-Agent": f"crush-trio/{version}",
        EVENT_HEADER: event,
        DELIVERY_HEADER: delivery_id,
        ATTEMPT_HEADER: str(attempt),
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: sign(secret, timestamp, body),
    }


def parse_retry_after(value: str | None, now: float) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (delta-seconds or an HTTP date), or None
    when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(when.timestamp() - now, 0.0)


def backoff_delay(
    attempts: int, *, base: float, cap: float, draw: float, retry_after: float | None = None
) -> float:
    """Seconds to wait after the ``attempts``-th failed attempt (from 1).

    Nominal ``base * 2**(attempts - 1)``, times a jitter factor in ``[1 - JITTER, 1]`` picked by
    ``draw`` (a number in ``[0, 1)``); at least ``retry_after`` when the endpoint sent one; at most
    ``cap``.
    """
    exponent = min(attempts - 1, 64)
    nominal = base * math.ldexp(1.0, exponent)
    delay = min(nominal, cap) * (1 - JITTER * draw)
    if retry_after is not None:
        delay = max(delay, retry_after)
    return min(delay, cap)


def display_url(url: str) -> str:
    """An endpoint as logs show it: scheme, host and port only (paths and queries of webhook
    URLs often carry tokens)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "?"
    if ":" in host:
        host = f"[{host}]"
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ""
    return f"{parts.scheme}://{host}{port}"


def short(text: str) -> str:
    """``text`` cut to :data:`ERROR_TEXT_CHARS` characters."""
    return text if len(text) <= ERROR_TEXT_CHARS else text[: ERROR_TEXT_CHARS - 1] + "…"
