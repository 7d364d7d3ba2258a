"""Connecting to a server: :func:`connect` and :class:`Client` (a server started in this process
is :func:`crush_trio.embedded.embedded`, which connects with :func:`connect`).

A :class:`Client` is one HTTP connection pool (httpx) plus one ``client_id`` (a UUID the server
uses to count this client's holds on workspaces). Every request is bounded by the client's
request timeout; transport failures become :class:`Unreachable`, timeouts :class:`Timeout`, and
error answers the class of the server's status table with the server's message.
"""

from __future__ import annotations

import logging
import uuid
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import parse_qs, urlsplit

import httpx
import orjson
import trio

from .. import wire
from ..wire import Workspace, workspace_id_of
from .errors import (
    AuthError,
    RedirectRefused,
    Timeout,
    Unreachable,
    error_for_status,
    single_errors,
)
from .events import DEFAULT_MAILBOX_SIZE
from .stream import DEFAULT_RECONNECT_TIMEOUT
from .transport import MAX_REDIRECTS, bearer_headers, websocket_base
from .workspace import WorkspaceClient, open_workspace

if TYPE_CHECKING:
    import os
    from collections.abc import AsyncIterator, Iterable

log = logging.getLogger(__name__)

#: Default bound on one HTTP request, from connecting to the last byte of the answer (seconds).
DEFAULT_REQUEST_TIMEOUT: Final = 30.0
#: Default bound on opening a TCP connection to the server (seconds).
DEFAULT_CONNECT_TIMEOUT: Final = 10.0
#: Longest pause honoured from one ``Retry-After`` (a cluster node whose owner is unreachable);
#: the request's own timeout bounds the sum (seconds).
MAX_RETRY_AFTER: Final = 5.0
#: Seconds an idle pooled connection is reused at most: below the server's keep-alive timeout
#: (5 s, docs/protocol.md), so a request never goes out on a connection the server is closing
#: at that moment (which fails it with "Server disconnected without sending a response").
KEEPALIVE_EXPIRY: Final = 4.0


def parse_server_url(url: str, token: str | None = None) -> tuple[str, str | None, str | None]:
    """Split a server address into ``(base_url, token, unix_path)``.

    Accepts ``http://host:port``, the line ``crush-trio serve`` prints
    (``http://host:port/?token=T``, whose token is used when ``token`` is ``None``) and
    ``unix:/path/to.sock``.

    Raises:
        ValueError: the address is not one of those forms.
    """
    url = url.strip()
    if url.startswith("unix:"):
        path = url[len("unix:") :]
        if not path:
            raise ValueError("a unix: server address needs a socket path, e.g. unix:/tmp/c.sock")
        return "http://localhost", token, path
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"server address {url!r} is not an http(s) URL; use http://HOST:PORT as printed "
            "by 'crush-trio serve'"
        )
    if token is None:
        found = parse_qs(parts.query).get("token")
        if found:
            token = found[0]
    return f"{parts.scheme}://{parts.netloc}", token, None


def _origin(url: str) -> str | None:
    """``scheme://host[:port]`` of an absolute http(s) URL (lower case), else None."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        return None
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}"


def redirect_refusal(base_url: str, target: str, nodes: frozenset[str]) -> str | None:
    """Why a redirect from the server at ``base_url`` to the origin ``target`` may not be
    followed with the token, or None when it may.

    The rule (docs/client.md): never from https to plain http; otherwise to a node of ``nodes``
    (the cluster's base URLs the caller configured) or to one with the base URL's scheme.
    """
    base_scheme = urlsplit(base_url).scheme.lower()
    scheme = urlsplit(target).scheme.lower()
    if base_scheme == "https" and scheme != "https":
        return "a downgrade from https to plain http, which would send the token in clear text"
    if target in nodes or scheme == base_scheme:
        return None
    return (
        f"a node with another scheme than {base_url} that is not one of the configured cluster "
        "nodes; pass it in connect(..., nodes=[...]) to follow it"
    )


class Client:
    """A connection to one server. Get it from :func:`connect` or
    :func:`crush_trio.embedded.embedded`.

    Attributes:
        url: the server's base URL (``http://host:port``, or ``unix:/path``).
        token: the token sent with every request (``None`` when the server needs none).
        client_id: this client's UUID (its holds on workspaces are counted under it).
        server: the in-process server's handle (``crush_trio.server.serve.ServerHandle``), for
            a client from :func:`crush_trio.embedded.embedded`; None otherwise.
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        url: str,
        token: str | None,
        unix_path: str | None = None,
        client_id: str | None = None,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        reconnect_timeout: float = DEFAULT_RECONNECT_TIMEOUT,
        mailbox_size: int = DEFAULT_MAILBOX_SIZE,
        deltas: bool = True,
        nodes: frozenset[str] = frozenset(),
    ) -> None:
        self.http = http
        self.base_url = url
        self.url = f"unix:{unix_path}" if unix_path is not None else url
        self.ws_base = websocket_base(url)
        self.token = token
        self.unix_path = unix_path
        self.client_id = client_id or str(uuid.uuid4())
        self.request_timeout = request_timeout
        self.reconnect_timeout = reconnect_timeout
        self.mailbox_size = mailbox_size
        self.deltas = deltas
        self.server: Any = None
        #: Workspace id → the base URL of the cluster node that owns it (learnt from 307s).
        self.owners: dict[str, str] = {}
        #: Base URLs of the cluster's nodes a redirect may lead to besides those with the base
        #: URL's scheme (:func:`redirect_refusal`).
        self.nodes = nodes

    def base_for(self, workspace_id: str) -> str:
        """The base URL that serves ``workspace_id``: its owner in a cluster, else the server."""
        return self.owners.get(workspace_id, self.base_url)

    def ws_base_for(self, workspace_id: str) -> str:
        return (
            websocket_base(self.base_for(workspace_id)) if self.unix_path is None else self.ws_base
        )

    def check_redirect(self, location: str) -> None:
        """Refuse a redirect the token may not follow (:func:`redirect_refusal`); a relative
        ``location`` stays on the same server.

        Raises:
            RedirectRefused: the target is a downgrade to plain http, or of another scheme and
                not a configured node.
        """
        target = _origin(location)
        if target is None or self.unix_path is not None:
            return
        why = redirect_refusal(self.base_url, target, self.nodes)
        if why is not None:
            raise RedirectRefused(
                f"the server at {self.url} redirected to {target}, which this client does not "
                f"follow with its token: {why}"
            )

    def moved(self, workspace_id: str | None, location: str) -> None:
        """Remember that ``workspace_id`` is served at the origin of ``location``.

        Raises:
            RedirectRefused: the token may not follow the redirect (:meth:`check_redirect`).
        """
        self.check_redirect(location)
        parts = urlsplit(location)
        if workspace_id and parts.scheme and parts.netloc:
            base = f"{parts.scheme}://{parts.netloc}"
            if base == self.base_url:
                self.owners.pop(workspace_id, None)
            else:
                self.owners[workspace_id] = base

    def forget_owner(self, workspace_id: str) -> bool:
        """Send ``workspace_id``'s requests to the server again (its owner did not answer);
        True when an owner was known."""
        return self.owners.pop(workspace_id, None) is not None

    def auth_headers(self) -> list[tuple[bytes, bytes]]:
        """The websocket handshake's ``Authorization`` header (none without a token)."""
        return bearer_headers(self.token)

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any:
        """One API request; returns the decoded JSON answer (``None`` for an empty body).

        Raises:
            Unreachable: the server could not be reached or broke the connection.
            Timeout: no complete answer within ``timeout`` (default: the request timeout).
            CrushError: the server answered with an error (the class of its status, e.g.
                :class:`NotFound`, :class:`Conflict`, :class:`AuthError`).
        """
        limit = self.request_timeout if timeout is None else timeout
        wid = workspace_id_of(path)
        give_up = trio.current_time() + limit
        location: str | None = None
        for hops in range(MAX_REDIRECTS + 1):
            owner = self.owners.get(wid) if wid is not None else None
            url = location or (owner + path if owner is not None else path)
            location = None
            try:
                response = await self.http.request(
                    method,
                    url,
                    content=orjson.dumps(json) if json is not None else None,
                    headers={"Content-Type": "application/json"} if json is not None else None,
                    params=params,
                    timeout=limit,
                )
            except httpx.TimeoutException as exc:
                raise Timeout(
                    f"{method} {path} got no answer from the server at {self.url} within "
                    f"{limit:g} s; the server may be overloaded"
                ) from exc
            except httpx.TransportError as exc:
                if wid is not None and self.forget_owner(wid) and hops < MAX_REDIRECTS:
                    continue  # the owner is gone: ask the server we know where it is now
                raise Unreachable(
                    f"cannot reach the server at {owner or self.url} ({exc.__class__.__name__}: "
                    f"{exc}); check the address and that the server is running"
                ) from exc
            if hops == MAX_REDIRECTS:
                break
            status = response.status_code
            if status == 307 and "location" in response.headers:
                location = response.headers["location"]
                self.moved(wid, location)  # raises when the token may not follow it
                if wid is not None:
                    location = None  # the owner's base is remembered: the path is rebuilt
                elif not location.startswith(("http://", "https://")):
                    break  # nothing this client can follow
                continue
            if status == 503 and owner is not None:
                self.forget_owner(wid or "")  # a node that stops: ask the server again
                continue
            if status == 503 and "retry-after" in response.headers:
                pause = _retry_after(response.headers["retry-after"])
                if trio.current_time() + pause >= give_up:
                    break
                await trio.sleep(pause)
                continue
            break
        if (
            method == "POST"
            and path == "/v1/workspaces"
            and response.status_code < 300
            and str(response.url).split("/v1/")[0] != self.base_url
        ):
            found = orjson.loads(response.content).get("id")
            if isinstance(found, str):
                self.moved(found, str(response.url))
        if response.status_code == 307:
            # Redirected more than MAX_REDIRECTS times (owners changing hands): not an answer.
            raise Unreachable(
                f"{method} {path}: the workspace's owner kept moving ({MAX_REDIRECTS} redirects); "
                "retry in a moment"
            )
        body = response.content
        data: Any = None
        if body:
            try:
                data = orjson.loads(body)
            except orjson.JSONDecodeError:
                data = None
        if response.status_code >= 400:
            message = data.get("message") if isinstance(data, dict) else None
            if not isinstance(message, str) or not message:
                message = f"{method} {path} failed with status {response.status_code}"
            raise error_for_status(response.status_code, message)
        return data

    async def version(self) -> str:
        data = await self.request("GET", "/v1/version")
        return str(data.get("version", "")) if isinstance(data, dict) else ""

    async def workspaces(self) -> list[Workspace]:
        data = await self.request("GET", "/v1/workspaces")
        return wire.converter.structure(data, list[Workspace])

    async def control(self, command: str) -> None:
        """``POST /v1/control`` (``shutdown`` or ``shutdown_if_idle``)."""
        await self.request("POST", "/v1/control", json={"command": command})

    @asynccontextmanager
    async def workspace(
        self, path: str | os.PathLike[str], *, events: bool = True
    ) -> AsyncIterator[WorkspaceClient]:
        """Open (or join) the workspace of a project directory for the block's duration.

        Creates the workspace with this client's ``client_id``, opens its event stream at once
        (well within the server's create grace), and on leaving closes the stream and releases
        the hold (``DELETE /v1/workspaces/{id}?client_id=``).

        Args:
            path: the project directory (made absolute on this side).
            events: open the event stream (the default). With ``False`` the workspace is held
                and used over HTTP only, for a client that sends work and leaves the watching to
                others (a load generator whose watchers are other connections): nothing reads
                events, so subscriptions get none and run handles never end before the block
                does; follow a run with :meth:`WorkspaceClient.get_run` instead. The hold then
                lasts the server's create grace (``server.create_grace``, 30 s by default)
                unless a stream opens under the same ``client_id``.

        Raises:
            BadRequest: the path is not an existing directory.
            ShuttingDown: the server is shutting down.
            Unreachable, AuthError: the server or its event stream cannot be reached.
        """
        async with open_workspace(self, path, events=events) as ws:
            yield ws


def _retry_after(value: str) -> float:
    """The pause a ``Retry-After`` header asks for (seconds), bounded by
    :data:`MAX_RETRY_AFTER`; an HTTP date or junk counts as one second."""
    try:
        return min(max(float(value), 0.0), MAX_RETRY_AFTER)
    except ValueError:
        return 1.0


@asynccontextmanager
async def connect(
    url: str,
    token: str | None = None,
    *,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    reconnect_timeout: float = DEFAULT_RECONNECT_TIMEOUT,
    mailbox_size: int = DEFAULT_MAILBOX_SIZE,
    client_id: str | None = None,
    max_connections: int | None = None,
    deltas: bool = True,
    nodes: Iterable[str] = (),
) -> AsyncIterator[Client]:
    """Connect to a running server; checks the address and the token before it yields.

    Args:
        url: ``http://host:port`` (a ``?token=`` in it is used when ``token`` is ``None``) or
            ``unix:/path/to.sock``.
        token: the server's token.
        request_timeout: bound on each HTTP request (seconds).
        connect_timeout: bound on opening a connection (seconds).
        reconnect_timeout: how long a dropped event stream is retried before pending runs fail.
        mailbox_size: lossy events buffered per run handle or subscription.
        client_id: a UUID to use instead of a new one.
        max_connections: the most HTTP connections open to the server at once, all of which are
            kept alive between requests; by default httpx's (100, of which 20 are kept alive).
            Raise it for a client that sends many requests at once, so that each burst does not
            open fresh connections.
        deltas: open event streams with ``deltas=1``: a streaming message arrives as
            ``message_delta`` events, which the client assembles (``False``: whole ``message``
            snapshots only, as a Crush client gets them).
        nodes: base URLs of a cluster's nodes a 307 may send this client (and its token) to
            besides those with ``url``'s scheme, e.g. an ``https://`` node of a cluster reached
            at an ``http://`` address. A redirect from https to plain http is never followed.

    Raises:
        ValueError: ``url`` or an entry of ``nodes`` is not a server address.
        Unreachable: nothing answers at ``url``.
        AuthError: the server refused the token.
    """
    base, token, unix_path = parse_server_url(url, token)
    node_bases = frozenset(parse_server_url(node)[0].lower() for node in nodes)
    timeout = httpx.Timeout(request_timeout, connect=connect_timeout)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # Certificates are only loaded when an https:// server can be reached: httpx's default TLS
    # setup reads the CA bundle, which costs about a second at start-up for a client that never
    # uses TLS. A redirect from an http:// server to an https:// one is followed only to a
    # configured node, so no https request goes out unverified.
    verify = any(b.startswith("https://") for b in (base, *node_bases))
    # By default httpx's own sizes: 100 connections, of which 20 stay alive.
    most, alive = (100, 20) if max_connections is None else (max_connections, max_connections)
    limits = httpx.Limits(
        max_connections=most, max_keepalive_connections=alive, keepalive_expiry=KEEPALIVE_EXPIRY
    )
    transport = None
    if unix_path is not None:
        transport = httpx.AsyncHTTPTransport(uds=unix_path, verify=False, limits=limits)
    with single_errors():
        async with httpx.AsyncClient(
            base_url=base,
            headers=headers,
            timeout=timeout,
            transport=transport,
            verify=verify,
            limits=limits,
        ) as http:
            client = Client(
                http,
                url=base,
                token=token,
                unix_path=unix_path,
                client_id=client_id,
                request_timeout=request_timeout,
                reconnect_timeout=reconnect_timeout,
                mailbox_size=mailbox_size,
                deltas=deltas,
                nodes=node_bases,
            )
            try:
                await client.version()
            except AuthError as exc:
                raise AuthError(
                    f"the server at {client.url} refused the token: {exc.message}"
                ) from None
            yield client
