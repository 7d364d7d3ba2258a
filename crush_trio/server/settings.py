"""What the HTTP shell needs to know about how it is served (built by :func:`~.serve.serve`)."""

from __future__ import annotations

import attrs

from ..defaults import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_SSE_PING_INTERVAL,
    DEFAULT_WS_PING_INTERVAL,
)
from .security import HostPolicy, new_web_prefix


@attrs.define
class Settings:
    """What the app and the event-stream transports need to know about how they are served."""

    token: str
    allow_origins: list[str] = attrs.field(factory=list)
    unix: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    sse_ping_interval: float = DEFAULT_SSE_PING_INTERVAL
    #: Idle time after which the trio-websocket transport pings a client (0: never).
    ws_ping_interval: float = DEFAULT_WS_PING_INTERVAL
    #: Host names served (loopback, ``server.allowed_hosts``, ``--allow-host``, the bind address).
    hosts: HostPolicy = attrs.field(factory=HostPolicy)
    #: The web page's path prefix (new at every start): the page, its files and its API calls
    #: are served under it too, and the token cookie is scoped to it (:func:`new_web_prefix`).
    web_prefix: str = attrs.field(factory=new_web_prefix)
