"""The client's errors: the server's hierarchy plus what only a client can run into.

Every error the client raises is a :class:`~crush_trio.errors.CrushError`, so one ``except``
catches them all. Errors the server reports keep its message (it names the object and the fix)
and map to the class of the server's table (:func:`error_for_status`); the classes below add what
happens on the client's side of the wire: the server cannot be reached, the token is refused, a
wait ran out of time, a run failed.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Final, NoReturn

import trio

from ..errors import (
    BadRequest,
    Conflict,
    CrushError,
    MisdirectedRequest,
    NotFound,
    ShuttingDown,
    TooLarge,
    UnsupportedMediaType,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ..wire import Run

__all__ = [
    "AuthError",
    "BadRequest",
    "Conflict",
    "CrushError",
    "MisdirectedRequest",
    "NotFound",
    "RedirectRefused",
    "RunFailed",
    "ShuttingDown",
    "Timeout",
    "TooLarge",
    "Unreachable",
    "UnsupportedMediaType",
    "error_for_status",
    "single_errors",
]


class AuthError(CrushError):
    """The server refused the token (401) or the request's origin (403)."""

    status = 401


class Unreachable(CrushError, ConnectionError):
    """The server could not be reached, or its event stream could not be re-established."""

    status = 503


class RedirectRefused(Unreachable):
    """The server redirected (307) to a node this client does not send its token to: a
    downgrade from https to plain http, or another scheme than the base URL's to a node not
    passed in ``connect(..., nodes=...)`` (docs/client.md, "A cluster of nodes")."""

    status = 502


class Timeout(CrushError, TimeoutError):
    """A wait ran out of time. The message names what was awaited and for how long."""

    status = 504


class RunFailed(CrushError):
    """A run ended ``failed``; :attr:`run` is its final record (``run.error`` says why)."""

    status = 502

    def __init__(self, message: str, run: Run) -> None:
        super().__init__(message)
        self.run = run


_BY_STATUS: Final[dict[int, type[CrushError]]] = {
    400: BadRequest,
    401: AuthError,
    403: AuthError,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    415: UnsupportedMediaType,
    421: MisdirectedRequest,
    503: ShuttingDown,
}


def error_for_status(status: int, message: str) -> CrushError:
    """The client-side error for an HTTP (or websocket reply) ``status`` and server message."""
    cls = _BY_STATUS.get(status, CrushError)
    return cls(message)


def _only_error(group: BaseExceptionGroup[Any]) -> BaseException | None:
    """The one exception a group stands for: its single leaf, or its single non-Cancelled leaf."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    if len(leaves) == 1:
        return leaves[0]
    real = [e for e in leaves if not isinstance(e, trio.Cancelled)]
    return real[0] if len(real) == 1 else None


def _reraise(exc: BaseException) -> NoReturn:
    context = exc.__context__
    try:
        raise exc
    finally:
        exc.__context__ = context
        del exc, context


@contextmanager
def single_errors() -> Iterator[None]:
    """Let one exception out of nurseries as itself, not inside an exception group."""
    try:
        yield
    except BaseExceptionGroup as group:
        only = _only_error(group)
        if only is None:
            raise
        _reraise(only)
