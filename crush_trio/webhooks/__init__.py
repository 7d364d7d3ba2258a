"""Run-completion webhooks (docs/webhooks.md).

- :mod:`.policy` — the body, signature and headers of a delivery, how an answer is judged, the
  backoff delays: plain functions, no I/O.
- :mod:`.outbox` — :class:`OutboxFile`, the pending and failed deliveries in their own SQLite
  file in the server's data directory (worker threads).
- :mod:`.service` — :class:`Webhooks`, the server's outbox in memory, its writer and the tasks
  that deliver it.
"""

from .outbox import OUTBOX_FILENAME, Delivery, OutboxFile, Status
from .service import Endpoint, Webhooks, default_outbox_dir, outbox_path

__all__ = [
    "OUTBOX_FILENAME",
    "Delivery",
    "Endpoint",
    "OutboxFile",
    "Status",
    "Webhooks",
    "default_outbox_dir",
    "outbox_path",
]
