"""Log set-up for ``crush-trio serve``: plain text lines, or one JSON object per line.

``--log-format json`` writes each record as one line ``{"time", "level", "logger", "message",
...}`` plus ``workspace_id``, ``session_id`` and ``run_id`` where they apply. Those ids come
from the record itself (``log.info(..., extra={"run_id": ...})``) or, when the record has none,
from the context variables set with :func:`log_context` (the HTTP app sets them per request from
the path; trio tasks inherit them from the task that started them).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import logging
import sys
from typing import TYPE_CHECKING, Any, Final, TextIO

import orjson

if TYPE_CHECKING:
    from collections.abc import Iterator

#: The id fields a JSON line may carry, in this order.
CONTEXT_FIELDS: Final = ("workspace_id", "session_id", "run_id")
#: Extra fields of access-log records (``crush_trio.access``) copied into JSON lines.
ACCESS_FIELDS: Final = ("method", "target", "status", "duration_ms")
LOG_FORMATS: Final = ("text", "json")
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_context: Final[dict[str, contextvars.ContextVar[str | None]]] = {
    name: contextvars.ContextVar(f"crush_trio_log_{name}", default=None) for name in CONTEXT_FIELDS
}


@contextlib.contextmanager
def log_context(**ids: str | None) -> Iterator[None]:
    """Within the block (and in tasks started from it), log records carry these ids."""
    tokens = []
    for name, value in ids.items():
        if name not in _context:
            raise TypeError(f"unknown log context field {name!r}; use one of {CONTEXT_FIELDS}")
        tokens.append((_context[name], _context[name].set(value)))
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def set_log_context(**ids: str | None) -> None:
    """Set ids for the rest of the current task (a request handler's own context)."""
    for name, value in ids.items():
        _context[name].set(value)


def current_context() -> dict[str, str]:
    return {name: value for name, var in _context.items() if (value := var.get()) is not None}


class ContextFilter(logging.Filter):
    """Stamps the context ids onto each record as it is emitted (in the logging task), so a
    handler that formats later still has them; ids given with ``extra=`` win."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in current_context().items():
            if getattr(record, name, None) is None:
                setattr(record, name, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines inside values are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        data: dict[str, Any] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        ambient = current_context()
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None) or ambient.get(name)
            if value is not None:
                data[name] = value
        for name in ACCESS_FIELDS:
            if hasattr(record, name):
                data[name] = getattr(record, name)
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            data["exception"] = record.exc_text
        if record.stack_info:
            data["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(data, default=str).decode()


def configure_logging(level: str = "INFO", fmt: str = "text", stream: TextIO | None = None) -> None:
    """Send every log record to ``stream`` (stderr) as text lines or JSON lines.

    Raises:
        ValueError: ``fmt`` is not one of :data:`LOG_FORMATS`.
    """
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, str(level).upper(), logging.INFO))
