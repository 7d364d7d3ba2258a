"""The error hierarchy, arranged by what the caller can do about each error.

Every error the server reports to a client is a :class:`CrushError`. Each class carries the HTTP
status it maps to (the table of PROTOCOL §2) and, where it ends a websocket, the close code. The
message always names the object at fault and what to do next. Provider, sqlite and socket errors are
translated into these at the boundary where they occur.

Every layer raises the classes of this one module (the cluster's :class:`Moved` and
:class:`OwnerUnavailable`, the store's and the event log's :class:`Fenced`, the agent's
:class:`SessionGone`...), so a caller recognises an error by its class without importing the layer
that raised it. The exceptions that stay inside one module (a tool's ``ToolError``, which carries
the tool's result; the client library's own hierarchy in ``crush_trio.client.errors``) are not
here.
"""

from __future__ import annotations

from typing import ClassVar, Final

# Websocket close codes the server sends (PROTOCOL §5). A frame over ``server.max_body_bytes``
# is closed with 1009 by the websocket library itself.
#: The client left, or the server ended the stream with nothing wrong.
WS_CLOSE_NORMAL: Final = 1000
#: The workspace (or the server) is closing.
WS_CLOSE_GOING_AWAY: Final = 1001
#: Streams dropped on purpose (the debug route): reconnect with ``since``.
WS_CLOSE_SERVICE_RESTART: Final = 1012
#: The client could not take a must-deliver event in time (``too slow``).
WS_CLOSE_TRY_AGAIN_LATER: Final = 1013


class CrushError(Exception):
    """Base class of every error the server reports; ``status`` is the HTTP status."""

    status: ClassVar[int] = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class BadRequest(CrushError):
    """The input was malformed or refers to something that does not exist (400)."""

    status = 400


class Unauthorized(CrushError):
    """The token was missing or wrong (401)."""

    status = 401


class Forbidden(CrushError):
    """The request came from a foreign origin (403)."""

    status = 403


class NotFound(CrushError):
    """An id in the path names nothing (404)."""

    status = 404


class Conflict(CrushError):
    """The target cannot take this now: workspace closing, client retired, server busy (409)."""

    status = 409


class UnsupportedMediaType(CrushError):
    """A JSON route was called with a body whose ``Content-Type`` is not JSON (415)."""

    status = 415


class TooManyRequests(CrushError):
    """A configured bound on queued or open things is reached; the message names the config key
    (429)."""

    status = 429


class MisdirectedRequest(CrushError):
    """The request's ``Host`` is not a name this server answers to (421)."""

    status = 421


class TooLarge(CrushError):
    """A request body or websocket frame exceeds the configured limit (413, close 1009)."""

    status = 413


class ShuttingDown(CrushError):
    """The server is shutting down; retry against a new server (503)."""

    status = 503


class Moved(CrushError):
    """Another node of the cluster owns the workspace: answered 307 with ``Location`` set to the
    same request at the owner."""

    status: ClassVar[int] = 307

    def __init__(self, message: str, location: str) -> None:
        super().__init__(message)
        self.location = location


class OwnerUnavailable(CrushError):
    """The node that owns the workspace stopped renewing its lease, which has not expired yet
    (503 + ``Retry-After``); another node takes the workspace over then."""

    status: ClassVar[int] = 503

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class SessionGone(CrushError):
    """The session of an accepted prompt was deleted before its run could start (400)."""

    status = 400


class ConfigError(CrushError):
    """The configuration is invalid; the message names the JSON path and the fix."""

    status = 500


class PermissionTimeout(CrushError):
    """A permission request went unanswered for ``options.permission_timeout``: the run that
    asked ends failed with this message (its record says why)."""

    status = 504


class ProviderError(CrushError):
    """A model provider failed; the message says which provider and what to check."""

    status = 502

    def __init__(self, message: str, *, retryable: bool = False, details: str = "") -> None:
        super().__init__(message)
        self.retryable = retryable
        self.details = details


class StoreError(CrushError):
    """The embedded database failed; this is a bug or a broken disk (500)."""

    status = 500


class Fenced(CrushError):
    """A newer owner (a newer lease epoch) holds the workspace: this node may no longer write.

    Raised by an event log's append (or fence) and by a cluster store's write made with an epoch
    older than the current one. Nothing of the refused write landed. The workspace must stop on
    this node; its clients reconnect and find the new owner.
    """

    status = 409


class EventLogError(CrushError):
    """The event log refused a write for a reason other than fencing (a seq out of order, a bad
    batch); the message says which."""

    status = 500


class CursorNotFound(Exception):
    """The ``before``/``after`` id of a page request names no item of the list (the routes
    answer 400)."""


class IllegalTransition(RuntimeError):
    """A state machine was asked for a move its table does not allow; always a bug in the
    caller (agent bookkeeping, run records, workspace lifecycle)."""


def unwrap_group(exc: BaseException) -> BaseException:
    """The single exception inside nested one-member exception groups (what a user should see);
    a group of several is returned as it is."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def bug_message(exc: BaseException, *, detail: bool = False) -> str:
    """The text shown for an unexpected exception: its type (and with ``detail`` its message),
    and that it is a bug to report."""
    what = f"{type(exc).__name__}: {exc}" if detail else type(exc).__name__
    return f"internal error ({what}); this is a bug, please report it"
