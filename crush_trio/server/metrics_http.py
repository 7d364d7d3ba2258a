"""The metrics port: ``GET /metrics`` without the token, on a loopback address only.

``server.metrics_port`` (or ``crush-trio serve --metrics-port N``) opens it, for a Prometheus
scraper running on the same machine (or a sidecar sharing its network namespace) that should not
hold the API token. It listens on :data:`METRICS_HOST` whatever ``--host`` is, answers nothing
but the metrics, and only to a loopback ``Host`` header (a web page that re-binds a DNS name to
127.0.0.1 gets 421), so it tells nothing to anyone who could not read the process anyway.

A deliberately small HTTP/1.1 server on h11 (already a dependency of hypercorn): one request per
connection, every phase bounded (:data:`METRICS_READ_TIMEOUT`, :data:`METRICS_WRITE_TIMEOUT`,
:data:`METRICS_MAX_HEAD_BYTES`), at most :data:`METRICS_MAX_CONNECTIONS` connections served at
once. When they are all taken, a new connection closes the oldest one that has not sent its
request yet, so idle connections cannot hold the port (each read bound is per connection: eight
silent ones would otherwise keep every scrape out for :data:`METRICS_READ_TIMEOUT`); only when
all of them are writing answers does it wait (in the kernel's backlog), at most
:data:`METRICS_WRITE_TIMEOUT`. A failure while serving one connection is logged and never
reaches the server.
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING, Final

import attrs
import h11
import trio

from ..errors import ConfigError
from ..metrics import CONTENT_TYPE, render
from .security import HostPolicy

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

#: The only address the metrics port listens on.
METRICS_HOST: Final = "127.0.0.1"
#: Bound on reading one scrape request's head (seconds).
METRICS_READ_TIMEOUT: Final = 5.0
#: Bound on writing one answer (seconds).
METRICS_WRITE_TIMEOUT: Final = 10.0
#: Largest request head read (bytes); a larger one is answered 431.
METRICS_MAX_HEAD_BYTES: Final = 8 * 1024
#: Connections served at once.
METRICS_MAX_CONNECTIONS: Final = 8
_BACKLOG: Final = 64
_PATH: Final = b"/metrics"


def metrics_socket(port: int) -> socket.socket:
    """The listening socket of the metrics port (``port`` 0: a free one).

    Raises:
        ConfigError: ``port`` is out of range or cannot be bound; the message names the key.
    """
    if not 0 <= port <= 65535:
        raise ConfigError(
            f"server.metrics_port (--metrics-port) must be a TCP port from 0 to 65535, got "
            f"{port}; leave it out to serve metrics only at /metrics with the token"
        )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((METRICS_HOST, port))
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"server.metrics_port (--metrics-port) {port}: cannot listen on {METRICS_HOST}:"
            f"{port} ({exc.strerror or exc}); pick a free port, or 0 for any"
        ) from None
    sock.setblocking(False)
    return sock


@attrs.define(eq=False)
class _Scrape:
    """One connection being served: its cancel scope, and whether it is still waiting for its
    request (only those are closed to make room)."""

    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    reading: bool = True


def metrics_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}/metrics"


async def serve_metrics(
    sock: socket.socket,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]],
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer scrapes on ``sock`` until ``shutdown_trigger()`` returns; reports once listening.

    Cancellation: stopping cancels the connections being served (a scrape is read-only).
    """
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    hosts = HostPolicy()
    limiter = trio.CapacityLimiter(METRICS_MAX_CONNECTIONS)
    #: The connections being served, oldest first.
    serving: dict[_Scrape, None] = {}
    async with trio.open_nursery() as nursery:

        async def accept_loop() -> None:
            while True:
                stream = await listener.accept()
                scrape = _Scrape()
                try:
                    if limiter.available_tokens == 0:
                        idle = next(
                            (s for s in serving if s.reading and not s.scope.cancel_called),
                            None,
                        )
                        if idle is not None:
                            log.debug("metrics port full: closing its oldest idle connection")
                            idle.scope.cancel()
                    await limiter.acquire_on_behalf_of(scrape)
                except BaseException:
                    await trio.aclose_forcefully(stream)
                    raise
                serving[scrape] = None
                nursery.start_soon(_serve_one, stream, hosts, limiter, scrape, serving)

        nursery.start_soon(accept_loop)
        task_status.started()
        await shutdown_trigger()
        nursery.cancel_scope.cancel()
    await listener.aclose()


async def _serve_one(
    stream: trio.SocketStream,
    hosts: HostPolicy,
    limiter: trio.CapacityLimiter,
    scrape: _Scrape,
    serving: dict[_Scrape, None],
) -> None:
    try:
        with scrape.scope:  # cancelled to make room while it still waits for its request
            async with stream:
                conn = h11.Connection(h11.SERVER, max_incomplete_event_size=METRICS_MAX_HEAD_BYTES)
                status, body = 408, b"request head not received in time\n"
                with trio.move_on_after(METRICS_READ_TIMEOUT):
                    status, body = await _answer(stream, conn, hosts)
                scrape.reading = False
                with trio.move_on_after(METRICS_WRITE_TIMEOUT):
                    await stream.send_all(_response(conn, status, body))
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
        pass  # the scraper left, or its request left nothing to answer
    except Exception:
        log.exception("serving a scrape of the metrics port failed")
    finally:
        del serving[scrape]
        limiter.release_on_behalf_of(scrape)


async def _answer(
    stream: trio.SocketStream, conn: h11.Connection, hosts: HostPolicy
) -> tuple[int, bytes]:
    """Read one request and decide the answer: the status and the body."""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            return exc.error_status_hint, f"malformed request: {exc}\n".encode()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(METRICS_MAX_HEAD_BYTES)
            conn.receive_data(data)
            if not data and conn.their_state is not h11.DONE:
                raise trio.BrokenResourceError("the scraper closed the connection")
            continue
        if isinstance(event, h11.Request):
            break
        raise trio.BrokenResourceError("the scraper closed the connection")
    host = dict(event.headers).get(b"host")
    if host is not None and not hosts.allows(host.decode("latin-1")):
        return 421, b"this port answers loopback host names only (localhost, 127.0.0.1)\n"
    if event.target.split(b"?", 1)[0] != _PATH:
        return 404, b"the metrics port serves GET /metrics only\n"
    if event.method not in (b"GET", b"HEAD"):
        return 405, b"the metrics port serves GET /metrics only\n"
    return 200, render() if event.method == b"GET" else b""


def _response(conn: h11.Connection, status: int, body: bytes) -> bytes:
    content_type = CONTENT_TYPE if status == 200 else "text/plain; charset=utf-8"
    headers = [
        ("content-type", content_type),
        ("content-length", str(len(body))),
        ("connection", "close"),
    ]
    if status == 405:
        headers.append(("allow", "GET, HEAD"))
    if conn.our_state is not h11.SEND_RESPONSE:
        # The request was malformed or incomplete: h11 will not frame an answer on this
        # connection; write a plain one.
        head = f"HTTP/1.1 {status} {_reason(status)}\r\n" + "".join(
            f"{name}: {value}\r\n" for name, value in headers
        )
        return head.encode("latin-1") + b"\r\n" + body
    data = conn.send(h11.Response(status_code=status, headers=headers)) or b""
    data += conn.send(h11.Data(data=body)) or b""
    data += conn.send(h11.EndOfMessage()) or b""
    return data


_REASONS: Final = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    421: "Misdirected Request",
    431: "Request Header Fields Too Large",
}


def _reason(status: int) -> str:
    return _REASONS.get(status, "Error")
