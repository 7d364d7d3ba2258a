"""A trio client for crush_trio servers.

Layers, from the socket up:

* :mod:`.connection`: :func:`connect` and :class:`Client` (HTTP, errors). A server started in
  this process and a client of it: :func:`crush_trio.embedded.embedded` (the client library
  never imports the server).
* :mod:`.transport`: opening one websocket to a workspace's event stream, up to its ``hello``.
* :mod:`.stream`: :class:`~.stream.EventStream`, a workspace's one event stream: the reader task,
  reconnect with ``since``, websocket commands, refetch after a ``gap``.
* :mod:`.workspace`: :class:`WorkspaceClient`, one open workspace: its HTTP operations, its
  prompts, and the lifecycle of its event stream.
* :mod:`.resources`: the workspace's HTTP operations by resource (sessions and their history,
  the agent), which :class:`WorkspaceClient` is made of.
* :mod:`.runs`: :class:`RunHandle`, one prompt's events and final record, with the rules that
  tell a run's own events from everyone else's; it asks the stream for I/O through
  :class:`~.runs.RunFeed`.
* :mod:`.subscription`: :class:`Subscription`, every event of a workspace.
* :mod:`.events`: decoded events and the bounded mailboxes between the reader and consumers.
* :mod:`.eventsocket`: :func:`open_event_socket`, one raw connection to a workspace's event
  stream (frames as text, not decoded), for callers that want the stream as the server sends it.
* :mod:`.transcript`: printing a streamed reply without loss or repetition.
* :mod:`.errors`: the error classes.

Every wait takes a ``timeout`` argument (seconds; ``None`` waits as long as it takes) and raises
:class:`Timeout`, whose message names what was awaited, rather than relying on the caller's
cancel scope alone.

Example::

    async with connect("http://127.0.0.1:7433", token) as client:
        async with client.workspace("/path/to/project") as ws:
            session = await ws.create_session()
            handle = await ws.prompt(session.id, "hello")
            run = await handle.result(timeout=60)
            print(run.text)
"""

from __future__ import annotations

from ..wire import Message, PermissionRequest, Run, RunComplete, RunStatus, Session, Workspace
from .connection import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_REQUEST_TIMEOUT,
    Client,
    connect,
    parse_server_url,
)
from .errors import (
    AuthError,
    BadRequest,
    Conflict,
    CrushError,
    NotFound,
    RedirectRefused,
    RunFailed,
    ShuttingDown,
    Timeout,
    TooLarge,
    Unreachable,
)
from .events import DEFAULT_MAILBOX_SIZE, Event, Gap
from .eventsocket import EventSocket, open_event_socket
from .runs import DEFAULT_RUN_TIMEOUT, RunEvents, RunHandle, is_own_agent_event
from .stream import DEFAULT_RECONNECT_TIMEOUT, StreamStats
from .subscription import Subscription
from .transcript import Transcript
from .workspace import WorkspaceClient, latest_session, resolve_session_prefix

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_MAILBOX_SIZE",
    "DEFAULT_RECONNECT_TIMEOUT",
    "DEFAULT_REQUEST_TIMEOUT",
    "DEFAULT_RUN_TIMEOUT",
    "AuthError",
    "BadRequest",
    "Client",
    "Conflict",
    "CrushError",
    "Event",
    "EventSocket",
    "Gap",
    "Message",
    "NotFound",
    "PermissionRequest",
    "RedirectRefused",
    "Run",
    "RunComplete",
    "RunEvents",
    "RunFailed",
    "RunHandle",
    "RunStatus",
    "Session",
    "ShuttingDown",
    "StreamStats",
    "Subscription",
    "Timeout",
    "TooLarge",
    "Transcript",
    "Unreachable",
    "Workspace",
    "WorkspaceClient",
    "connect",
    "is_own_agent_event",
    "latest_session",
    "open_event_socket",
    "parse_server_url",
    "resolve_session_prefix",
]
