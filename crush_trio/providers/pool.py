"""The providers' shared TLS context.

Building a TLS context loads the trust store, about 50 ms of CPU: every provider's transport
(:class:`~crush_trio.providers.transport.Http11Transport`) and the webhooks use the one context
of :func:`shared_ssl_context`, built in a worker thread when the server starts.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    import ssl

log = logging.getLogger(__name__)


@functools.cache
def shared_ssl_context() -> ssl.SSLContext:
    """The process's TLS context for model providers: certificate verification on, the trust
    store from the environment as ``httpx`` reads it (``SSL_CERT_FILE``, ``SSL_CERT_DIR``) or
    ``certifi``. Built on first use and kept; call it from a thread to keep the load off the
    event loop (the server does so at start-up)."""
    return httpx.create_ssl_context()


def warm_ssl_context() -> None:
    """Build :func:`shared_ssl_context` ahead of the first model request (run it in a thread).
    A failure is only logged here: the first provider set up reports it with its own error."""
    try:
        shared_ssl_context()
    except Exception as exc:
        log.warning("building the providers' TLS context failed: %s", exc)
