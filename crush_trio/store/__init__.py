"""The embedded store: one SQLite database per workspace, and the message write buffer.

- :mod:`.db` — :class:`Store`, the database (sessions, messages, run records), all calls run in
  a worker thread.
- :mod:`.messages` — :class:`MessageService`, which debounces streaming message updates in front
  of the store and publishes ``created``/``updated`` events.
"""

from .db import DB_FILENAME, MIGRATIONS, SCHEMA_VERSION, Store
from .messages import DEBOUNCE_SECONDS, MessageService, MessageStore, Publish

__all__ = [
    "DB_FILENAME",
    "DEBOUNCE_SECONDS",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "MessageService",
    "MessageStore",
    "Publish",
    "Store",
]
