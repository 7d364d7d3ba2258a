"""Serving: the listening socket, hypercorn, and the staged shutdown of the whole server.

:func:`serve` is what ``crush-trio serve`` runs, and what tests start with ``nursery.start``: it
reports a :class:`ServerHandle` (URL, token, backend) once the socket is listening.

Shutdown (signal, ``POST /v1/control`` or :meth:`ServerHandle.stop`): the backend refuses new
workspaces (503) and shuts every workspace down, which closes their event streams from the app
(websocket close 1001) — only then is hypercorn told to stop, so it never has to cut open
websockets itself.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import stat
from functools import partial
from pathlib import Path
from typing import Any, Final

import attrs
import trio
from hypercorn.config import Config as HypercornConfig

from .. import __version__
from .._compat.hypercorn import wrap_app
from ..backend.registry import Backend
from ..config import Config, ServerOptions, load_config
from ..core.placement import LocalPlacement, Placement
from ..defaults import DEFAULT_HOST, DEFAULT_PORT
from ..errors import ConfigError
from ..providers.pool import warm_ssl_context
from ..tools.sandbox import probe as sandbox_probe
from ..wsdeflate import bound_hypercorn_deflate
from .api import Api
from .app import create_app
from .dispatch import WsHandler, serve_dispatching
from .keepalive import keepalive_timer
from .listener import ConnectionRules
from .metrics_http import metrics_socket, metrics_url, serve_metrics
from .security import HostPolicy
from .settings import Settings
from .sse_listener import serve_event_stream
from .ws_trio import serve_event_websocket

log = logging.getLogger(__name__)

#: Seconds hypercorn waits for open connections after the app has closed its streams (its
#: websocket ping tasks outlive their connection by up to one ping interval; nothing else is left).
HYPERCORN_GRACE: Final = 0.5
#: Seconds a kept-alive HTTP connection may sit idle between two requests before the server
#: closes it (hypercorn's keep-alive timeout).
KEEP_ALIVE_TIMEOUT: Final = 5.0
LISTEN_BACKLOG: Final = 1024


@attrs.define
class ServeOptions:
    """The flags of ``crush-trio serve`` (PROTOCOL §1)."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    data_dir: Path | None = None
    config_file: Path | None = None
    token: str | None = None
    #: ``--token-file``: where ``token`` was read from (hidden from sandboxed commands).
    token_file: Path | None = None
    allow_origins: list[str] = attrs.field(factory=list)
    #: ``--allow-host``: host names served besides loopback and ``server.allowed_hosts``.
    allow_hosts: list[str] = attrs.field(factory=list)
    user_config_dir: Path | None = None
    access_log: bool = True
    #: ``--metrics-port``: serve ``/metrics`` without the token on this loopback port (0: any
    #: free one); None: ``server.metrics_port`` decides.
    metrics_port: int | None = None
    #: Builds a provider from (name, ProviderConfig); tests and embedders plug scripted models in.
    provider_factory: Any = None
    #: ``--cluster-*`` flags: fields of the config's ``cluster`` section they replace.
    cluster: dict[str, Any] = attrs.field(factory=dict)


@attrs.define
class ServerHandle:
    """A running server, as reported to ``nursery.start``."""

    url: str
    token: str
    backend: Backend
    config: Config
    _stop: trio.Event
    #: ``http://127.0.0.1:PORT/metrics`` when the metrics port is open.
    metrics_url: str | None = None

    @property
    def listening_line(self) -> str:
        if self.url.startswith("unix:"):
            return f"crush-trio listening on {self.url}"
        return f"crush-trio listening on {self.url}/?token={self.token}"

    def stop(self) -> None:
        """Begin the staged shutdown; :func:`serve` returns when it is done."""
        self._stop.set()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def make_socket(host: str, port: int, *, tcp_user_timeout_ms: int) -> socket.socket:
    """Create the listening socket ourselves, so that the port is known (``--port 0``) and the
    kernel can break connections whose reader stalled (``TCP_USER_TIMEOUT``, inherited by every
    accepted socket)."""
    if host.startswith("unix:"):
        path = host[len("unix:") :]
        try:
            if stat.S_ISSOCK(os.stat(path).st_mode):
                os.unlink(path)  # a stale socket of an earlier server
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        os.chmod(path, 0o600)
    else:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if tcp_user_timeout_ms > 0 and hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, tcp_user_timeout_ms)
        sock.bind(address)
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


def _url_of(sock: socket.socket, host: str) -> str:
    if sock.family == socket.AF_UNIX:
        return f"unix:{sock.getsockname()}"
    addr, port = sock.getsockname()[:2]
    shown = f"[{addr}]" if sock.family == socket.AF_INET6 else addr
    return f"http://{shown}:{port}"


async def serve(
    options: ServeOptions, *, task_status: trio.TaskStatus[ServerHandle] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run the server until it is stopped; reports a :class:`ServerHandle` once listening.

    Raises:
        ConfigError: the configuration file is invalid, or ``--token ""`` on a non-loopback host.
    """
    config = load_config(
        config_file=options.config_file, workspace=None, user_config_dir=options.user_config_dir
    )
    unix = options.host.startswith("unix:")
    token = options.token if options.token is not None else secrets.token_urlsafe(24)
    if token == "" and not unix and not is_loopback(options.host):
        raise ConfigError(
            f"--token '' disables authentication and is refused on {options.host}; "
            "use a loopback host or give a token"
        )
    server_opts = config.server
    sock = make_socket(
        options.host, options.port, tcp_user_timeout_ms=server_opts.tcp_user_timeout_ms
    )
    url = _url_of(sock, options.host)
    port = options.metrics_port if options.metrics_port is not None else server_opts.metrics_port
    try:
        msock = metrics_socket(port) if port is not None else None
    except BaseException:
        sock.close()
        raise
    try:
        placement = _placement(options, config, url)
    except ConfigError:
        _close_sockets(sock, msock)
        raise
    backend = _backend(options, config, placement, url)
    settings = _settings(options, config, token)
    stop = trio.Event()
    api = Api(backend)
    app = create_app(api, settings, on_shutdown=stop.set)
    hconfig = _hypercorn_config(config)
    logging.getLogger("crush_trio.access").disabled = not options.access_log
    try:
        async with (
            placement.running(backend),
            backend.running(),
            keepalive_timer(server_opts.ws_ping_interval) as keepalive,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(trio.to_thread.run_sync, warm_ssl_context)
            # The bash sandbox's one self-test, so its outcome is logged at startup.
            nursery.start_soon(partial(trio.to_thread.run_sync, sandbox_probe))
            http_stop = trio.Event()
            wrapped = wrap_app(
                ConnectionRules(app, settings.web_prefix), hconfig.wsgi_max_body_size, "asgi"
            )
            ws_handler: WsHandler | None = None
            if server_opts.ws_transport == "trio-websocket":
                ws_handler = partial(
                    serve_event_websocket, api=api, settings=settings, keepalive=keepalive
                )
            # Every transport goes through the dispatcher: head checks and containment.
            await nursery.start(
                partial(
                    serve_dispatching,
                    wrapped,
                    hconfig,
                    sock,
                    ws_handler,
                    shutdown_trigger=http_stop.wait,
                    web_prefix=settings.web_prefix,
                    sse_handler=_sse_handler(api, settings, server_opts),
                )
            )
            murl = None
            if msock is not None:
                await nursery.start(partial(serve_metrics, msock, shutdown_trigger=http_stop.wait))
                murl = metrics_url(msock)
                log.info("metrics without the token at %s", murl)
            task_status.started(ServerHandle(url, token, backend, config, stop, murl))
            await stop.wait()
            log.info("shutting down")
            with trio.move_on_after(backend.shutdown_bound()):
                await backend.shutdown()
            http_stop.set()
    finally:
        sock.close()
        if msock is not None:
            msock.close()
        if unix:
            try:
                os.unlink(url[len("unix:") :])
            except OSError:
                pass


def _hypercorn_config(config: Config) -> HypercornConfig:
    """hypercorn's configuration: no access log of its own, its grace, and the server's bounds
    on websockets and bodies."""
    server_opts = config.server
    hconfig = HypercornConfig()
    hconfig.accesslog = None
    hconfig.errorlog = logging.getLogger("crush_trio.http")
    hconfig.graceful_timeout = HYPERCORN_GRACE
    hconfig.keep_alive_timeout = KEEP_ALIVE_TIMEOUT
    hconfig.websocket_ping_interval = server_opts.ws_ping_interval or None
    hconfig.websocket_max_message_size = server_opts.max_body_bytes
    bound_hypercorn_deflate(server_opts.max_body_bytes)
    hconfig.wsgi_max_body_size = server_opts.max_body_bytes
    hconfig.include_server_header = False
    return hconfig


def _placement(options: ServeOptions, config: Config, url: str) -> Placement:
    """This node's placement when the cluster is on (``cluster`` with the ``--cluster-*`` flags
    applied), else the single server's :class:`LocalPlacement`.

    Raises:
        ConfigError: a ``--cluster-*`` flag names no field, or the cluster section is invalid.
    """
    cluster_opts = config.cluster
    if options.cluster:
        try:
            cluster_opts = attrs.evolve(cluster_opts, **options.cluster)
        except TypeError as exc:
            raise ConfigError(f"bad --cluster flag: {exc}") from None
    if not cluster_opts.enabled:
        return LocalPlacement()
    from ..cluster.placement import ClusterPlacement

    return ClusterPlacement(cluster_opts, url)


def _backend(options: ServeOptions, config: Config, placement: Placement, url: str) -> Backend:
    """The backend serving the workspaces; the token file and the unix socket are secrets that
    sandboxed commands may not read."""
    unix = options.host.startswith("unix:")
    return Backend(
        server=config.server,
        config_file=options.config_file,
        data_dir=options.data_dir,
        version=__version__,
        user_config_dir=options.user_config_dir,
        provider_factory=options.provider_factory,
        webhooks=config.webhooks,
        placement=placement,
        secret_paths=[
            p
            for p in (options.token_file, Path(url[len("unix:") :]) if unix else None)
            if p is not None
        ],
    )


def _settings(options: ServeOptions, config: Config, token: str) -> Settings:
    """What the app and the event-stream transports know about how they are served."""
    server_opts = config.server
    return Settings(
        token=token,
        allow_origins=[*server_opts.allow_origins, *options.allow_origins],
        unix=options.host.startswith("unix:"),
        max_body_bytes=server_opts.max_body_bytes,
        sse_ping_interval=server_opts.sse_ping_interval,
        ws_ping_interval=server_opts.ws_ping_interval,
        hosts=HostPolicy([*server_opts.allowed_hosts, *options.allow_hosts], bind=options.host),
    )


def _sse_handler(api: Api, settings: Settings, server_opts: ServerOptions) -> WsHandler | None:
    """The dispatcher's handler of the SSE event stream, served on the socket as the event
    websocket is (``server.ws_transport: "trio-websocket"``, TCP or Unix socket); ``None``:
    hypercorn serves it through the app's route (:mod:`.sse`)."""
    if server_opts.ws_transport != "trio-websocket":
        return None
    return partial(serve_event_stream, api=api, settings=settings)


def _close_sockets(*socks: socket.socket | None) -> None:
    for s in socks:
        if s is not None:
            s.close()
