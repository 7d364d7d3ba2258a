"""A server inside this process and a client of it: :func:`embedded`.

This module sits above both :mod:`crush_trio.client` and :mod:`crush_trio.server`: the client
library never imports the server (a client of a remote server does not need the server's code),
and the server never imports the client. ``crush-trio run`` without ``--server``, the pytest
plugin's fixtures and tests use it.
"""

from __future__ import annotations

import secrets
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .client.connection import Client, connect
from .client.errors import single_errors
from .server.serve import ServeOptions, ServerHandle, serve

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

__all__ = ["embedded"]


@asynccontextmanager
async def embedded(
    options: ServeOptions | None = None, **connect_options: Any
) -> AsyncIterator[Client]:
    """Start a server inside this process on an ephemeral loopback port and connect to it.

    The server runs in this block's nursery; leaving the block stops it gracefully (runs are
    cancelled, final state is saved) and waits for it to finish. The client's ``server``
    attribute is the server's :class:`~crush_trio.server.serve.ServerHandle`.

    Args:
        options: server options; ``host`` and ``port`` are replaced by ``127.0.0.1`` and ``0``,
            and a random token is used when none is given.
        connect_options: passed to :func:`~crush_trio.client.connect`.
    """
    opts = attrs.evolve(options) if options is not None else ServeOptions(access_log=False)
    opts.host, opts.port = "127.0.0.1", 0
    if opts.token is None:
        opts.token = secrets.token_urlsafe(24)
    with single_errors():
        async with trio.open_nursery() as nursery:
            handle: ServerHandle = await nursery.start(partial(serve, opts))
            try:
                async with connect(handle.url, handle.token, **connect_options) as client:
                    client.server = handle
                    yield client
            finally:
                handle.stop()
