"""A workspace seen from the client: its HTTP operations and its one event stream.

Task ownership: :meth:`Client.workspace <crush_trio.client.Client.workspace>` opens a nursery
that lives as long as its ``async with`` block and holds

* the **reader** (:meth:`WorkspaceClient._stream`): the one task that reads the workspace's
  websocket. It decodes each frame and offers it to the run handles and subscriptions
  (never waiting on them: see :class:`~crush_trio.client.events.Mailbox`). When the connection
  drops it reconnects with ``since=<last seq>``, so the server replays what was missed; when the
  server answers with a ``gap`` instead (the replay no longer holds it), it asks the resync task
  to re-read state over HTTP.
* the **resync** task: re-reads ``GET runs/{id}`` (and the session's messages) for run handles
  that may have missed events, so a run that ended while the client was away still ends. When
  the stream cannot be re-opened at all (the server refuses it, or stays unreachable), the runs
  still pending are followed by their records alone: each ends with the outcome its record
  shows, and fails only when its record cannot be read either.
* short **grant** tasks that answer permission requests of runs sent with ``auto_approve``.

While the stream is connected, :meth:`WorkspaceClient.prompt` sends its prompt as an
``agent.prompt`` command on that websocket (one frame, like the browser client, instead of an
HTTP request) and the reader hands the command's reply back to it. Without a connected stream it
posts over HTTP. A stream lost between the command and its reply is settled by the run's record
(``GET runs/{id}``), and by posting the prompt again when there is none: the run id the client
always sends makes that resend safe.

Leaving the block cancels those tasks, fails the runs still pending with :class:`Conflict`
("workspace client closed"), and releases the client's hold with
``DELETE /v1/workspaces/{id}?client_id=`` (bounded by :data:`CLOSE_TIMEOUT`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final, Literal
from urllib.parse import urlencode

import attrs
import orjson
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
    open_websocket_url,
    wrap_client_stream,
)

from .. import wire
from ..wire import (
    AcceptedPrompt,
    AgentInfo,
    Message,
    Run,
    RunStatus,
    Session,
    Workspace,
)
from .errors import (
    AuthError,
    BadRequest,
    Conflict,
    CrushError,
    NotFound,
    Timeout,
    Unreachable,
    error_for_status,
)
from .events import DEFAULT_MAILBOX_SIZE, Event, Mailbox, decode_frame
from .runs import DEFAULT_RUN_TIMEOUT, RunHandle, deadline_after, deadline_scope

if TYPE_CHECKING:
    from .connection import Client

log = logging.getLogger(__name__)

#: Bound on opening the websocket and receiving its ``hello`` frame (seconds).
HELLO_TIMEOUT: Final = 10.0
#: A stream silent this long is probed with a websocket ping (seconds).
KEEPALIVE_INTERVAL: Final = 15.0
#: A ping unanswered this long means the connection is dead; it is dropped and re-opened.
PING_TIMEOUT: Final = 10.0
#: Default bound on re-establishing a dropped stream before pending runs fail (seconds).
DEFAULT_RECONNECT_TIMEOUT: Final = 30.0
#: First pause between reconnect attempts; it doubles up to :data:`RECONNECT_MAX_DELAY`.
RECONNECT_FIRST_DELAY: Final = 0.05
RECONNECT_MAX_DELAY: Final = 2.0
#: Pause before retrying a refetch that failed (seconds).
RESYNC_RETRY_DELAY: Final = 0.5
#: With no event stream, pending runs are followed by reading their records: first after this
#: pause, then doubling up to :data:`RUN_POLL_MAX_DELAY` (seconds).
RUN_POLL_FIRST_DELAY: Final = 0.1
RUN_POLL_MAX_DELAY: Final = 2.0
#: Bound on each cleanup step when the workspace block ends (seconds).
CLOSE_TIMEOUT: Final = 5.0
#: Largest event frame accepted (a message event carries a whole message).
MAX_EVENT_BYTES: Final = 64 * 1024 * 1024
#: Frames buffered inside the websocket library between the socket and the reader task.
WS_QUEUE_SIZE: Final = 64

#: Handshake statuses after which reconnecting cannot help.
_PERMANENT_STATUSES: Final = frozenset({400, 401, 403, 404, 409, 503})

GrantAction = Literal["allow", "allow_session", "deny"]

#: What :meth:`Subscription.until` and :meth:`Subscription.collect_until` test each event with.
EventPredicate = Callable[[Event], object]


@attrs.define
class _Command:
    """A websocket command waiting for its reply (``None`` when the stream ended first)."""

    done: trio.Event = attrs.Factory(trio.Event)
    reply: dict[str, Any] | None = None


class _CommandLost(Exception):
    """A command was sent on the stream, which ended (or went quiet) before the reply."""


#: What :meth:`WorkspaceClient._command` returns when no stream is connected (nothing sent).
_NOT_SENT: Final = object()


@attrs.define
class StreamStats:
    """Counters of one workspace's event stream (for tests, logs and benchmarks)."""

    connects: int = 0
    reconnects: int = 0
    drops: int = 0
    gaps: int = 0
    refetches: int = 0
    events: int = 0
    last_seq: int = 0


def resolve_session_prefix(sessions: list[Session], prefix: str) -> Session:
    """The session whose id is ``prefix`` or starts with it (a unique prefix is enough).

    Raises:
        NotFound: no session matches.
        BadRequest: several sessions match; the message lists them.
    """
    exact = [s for s in sessions if s.id == prefix]
    if exact:
        return exact[0]
    matches = [s for s in sessions if prefix and s.id.startswith(prefix)]
    if not matches:
        raise NotFound(
            f"no session id starts with {prefix!r}; list the sessions of this workspace "
            "to find its id"
        )
    if len(matches) > 1:
        ids = ", ".join(s.id for s in matches[:5])
        raise BadRequest(
            f"session prefix {prefix!r} matches {len(matches)} sessions ({ids}); "
            "give more characters"
        )
    return matches[0]


def latest_session(sessions: list[Session]) -> Session | None:
    """The most recently updated session (``None`` when there are none)."""
    if not sessions:
        return None
    return max(sessions, key=lambda s: (s.updated_at, s.created_at))


def rejection_error(where: str, exc: ConnectionRejected) -> CrushError:
    """The library's error for a refused event-stream upgrade, with the server's message."""
    body = exc.body or b""
    try:
        message = str(orjson.loads(body).get("message", ""))
    except (orjson.JSONDecodeError, AttributeError):
        message = body.decode(errors="replace")
    message = message or f"status {exc.status_code}"
    if exc.status_code in (401, 403):
        return AuthError(f"{where} refused the connection: {message}")
    if exc.status_code == 404:
        return NotFound(f"{where} is gone: {message}")
    if exc.status_code == 409:
        return Conflict(f"{where} refused the connection: {message}")
    return Unreachable(f"{where} refused the connection: {message}")


@asynccontextmanager
async def open_stream_socket(
    ws_base: str,
    unix_path: str | None,
    resource: str,
    headers: list[tuple[bytes, bytes]],
    *,
    timeout: float,  # noqa: ASYNC109
    message_queue_size: int = WS_QUEUE_SIZE,
    max_message_size: int = MAX_EVENT_BYTES,
) -> AsyncIterator[WebSocketConnection]:
    """One websocket connection to ``resource`` (``/v1/...``): at ``ws_base`` over TCP, or over
    the Unix socket ``unix_path`` when it is set. Leaving the block closes it (bounded by
    :data:`CLOSE_TIMEOUT`)."""
    if unix_path is None:
        async with open_websocket_url(
            ws_base + resource,
            extra_headers=headers,
            message_queue_size=message_queue_size,
            max_message_size=max_message_size,
            connect_timeout=timeout,
            disconnect_timeout=CLOSE_TIMEOUT,
        ) as conn:
            yield conn
        return
    async with trio.open_nursery() as nursery:
        with trio.fail_after(timeout):
            stream = await trio.open_unix_socket(unix_path)
            conn = await wrap_client_stream(
                nursery,
                stream,
                "localhost",
                resource,
                extra_headers=headers,
                message_queue_size=message_queue_size,
                max_message_size=max_message_size,
            )
        try:
            yield conn
        finally:
            with trio.move_on_after(CLOSE_TIMEOUT):
                await conn.aclose()
            nursery.cancel_scope.cancel()


class WorkspaceClient:
    """One open workspace. Get it from ``async with client.workspace(path) as ws``.

    Attributes:
        info: the server's Workspace object (``id``, ``path``, ``data_dir``).
        stats: counters of the event stream.
    """

    def __init__(
        self,
        client: Client,
        info: Workspace,
        *,
        mailbox_size: int = DEFAULT_MAILBOX_SIZE,
        reconnect_timeout: float = DEFAULT_RECONNECT_TIMEOUT,
    ) -> None:
        self.client = client
        self.info = info
        self.mailbox_size = mailbox_size
        self.reconnect_timeout = reconnect_timeout
        self.stats = StreamStats()
        self._runs: dict[str, RunHandle] = {}
        self._feeds: set[Mailbox] = set()
        self._resync: dict[RunHandle, bool] = {}
        self._resync_wakeup = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._conn_scope: trio.CancelScope | None = None
        self._stream_done = trio.Event()
        self._stream_changed = trio.Event()
        self._conn: WebSocketConnection | None = None  # the stream, while it is connected
        self._commands: dict[int, _Command] = {}  # sent on the stream, waiting for a reply
        self._command_ids = 0
        self.stream_error: CrushError | None = None
        self.closed = False

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def path(self) -> str:
        return self.info.path

    def _url(self, tail: str) -> str:
        return f"/v1/workspaces/{self.id}{tail}"

    # -- sessions and messages -------------------------------------------------------------------

    async def create_session(self, title: str = "") -> Session:
        data = await self.client.request("POST", self._url("/sessions"), json={"title": title})
        return wire.converter.structure(data, Session)

    async def sessions(self) -> list[Session]:
        data = await self.client.request("GET", self._url("/sessions"))
        return wire.converter.structure(data, list[Session])

    async def session(self, session_id: str) -> Session:
        data = await self.client.request("GET", self._url(f"/sessions/{session_id}"))
        return wire.converter.structure(data, Session)

    async def delete_session(self, session_id: str) -> None:
        await self.client.request("DELETE", self._url(f"/sessions/{session_id}"))

    async def rename_session(self, session_id: str, title: str) -> Session:
        """Give a session a new title (``PATCH sessions/{id}``); every client of the workspace
        gets a ``session`` ``updated`` event.

        Raises:
            BadRequest: the title is empty.
            NotFound: no such session.
        """
        data = await self.client.request(
            "PATCH", self._url(f"/sessions/{session_id}"), json={"title": title}
        )
        return wire.converter.structure(data, Session)

    async def resolve_session(self, prefix: str) -> Session:
        """The session with this id or unique id prefix (see :func:`resolve_session_prefix`)."""
        return resolve_session_prefix(await self.sessions(), prefix)

    async def latest_session(self) -> Session | None:
        """The most recently updated session, or ``None``."""
        return latest_session(await self.sessions())

    async def messages(self, session_id: str) -> list[Message]:
        data = await self.client.request("GET", self._url(f"/sessions/{session_id}/messages"))
        return wire.converter.structure(data, list[Message])

    # -- agent -----------------------------------------------------------------------------------

    async def agent_info(self) -> AgentInfo:
        data = await self.client.request("GET", self._url("/agent"))
        return wire.converter.structure(data, AgentInfo)

    async def prompt(
        self,
        session_id: str,
        text: str,
        run_id: str | None = None,
        *,
        auto_approve: bool = False,
    ) -> RunHandle:
        """Send a prompt to a session; returns the handle of its run once the server accepted it.

        The handle is subscribed before the prompt is sent, so it sees every event of the run.

        Args:
            session_id: the session to prompt.
            text: the prompt, sent unchanged.
            run_id: the run's id; a new UUID when ``None``. (The client always sends one, so a
                prompt to a busy session is queued as its own turn, never folded into another.)
            auto_approve: answer this run's own permission requests with ``allow``, never
                another run's and never workspace-wide.

        Raises:
            BadRequest: empty prompt, unknown session, or a ``run_id`` already used.
            Conflict: the workspace is closing.
            Unreachable: the server or its event stream is gone.
        """
        self._check_open()
        run_id = run_id if run_id is not None else str(uuid.uuid4())
        if run_id in self._runs:
            raise BadRequest(f"run_id {run_id!r} is already pending in this client; pick a new one")
        handle = RunHandle(
            self,
            session_id,
            run_id,
            text,
            auto_approve=auto_approve,
            mailbox_size=self.mailbox_size,
        )
        self._runs[run_id] = handle
        body = {"session_id": session_id, "prompt": text, "run_id": run_id}
        try:
            handle.accepted = await self._send_prompt(body)
        except BaseException:
            self._runs.pop(run_id, None)
            raise
        return handle

    async def _send_prompt(self, body: dict[str, Any]) -> AcceptedPrompt:
        """The stream's ``agent.prompt`` command when connected, else ``POST agent``."""
        try:
            result = await self._command("agent.prompt", body)
        except _CommandLost:
            return await self._settle_prompt(body)
        if result is _NOT_SENT:
            return await self._post_prompt(body)
        return wire.converter.structure(result, AcceptedPrompt)

    async def _post_prompt(self, body: dict[str, Any]) -> AcceptedPrompt:
        data = await self.client.request("POST", self._url("/agent"), json=body)
        return wire.converter.structure(data, AcceptedPrompt)

    async def _settle_prompt(self, body: dict[str, Any]) -> AcceptedPrompt:
        """The stream ended after a prompt was sent and before its reply: the run's record says
        whether the server accepted it; without one, the prompt is posted again (the same
        run id, so it cannot run twice)."""
        run_id = body["run_id"]
        try:
            run = await self.get_run(run_id)
        except NotFound:
            try:
                return await self._post_prompt(body)
            except BadRequest as refused:  # "already used": the first one got there after all
                try:
                    run = await self.get_run(run_id)
                except NotFound:
                    raise refused from None
        status: Literal["running", "queued"] = (
            "queued" if run.status is RunStatus.QUEUED else "running"
        )
        return AcceptedPrompt(run.run_id, run.session_id, status)

    async def _command(self, method: str, params: dict[str, Any]) -> Any:
        """Run a websocket command on the workspace's stream (PROTOCOL §5) and return its
        result; :data:`_NOT_SENT` when no stream is connected.

        Raises:
            CrushError: the server's refusal (the class of its status).
            _CommandLost: the stream ended, or the reply did not come within the client's
                request timeout, after the command was sent: it may or may not have run.
        """
        conn = self._conn
        if conn is None or conn.closed is not None:
            await trio.lowlevel.checkpoint()
            return _NOT_SENT
        self._command_ids += 1
        command_id = self._command_ids
        pending = _Command()
        self._commands[command_id] = pending
        frame = orjson.dumps({"id": command_id, "method": method, "params": params}).decode()
        try:
            try:
                await conn.send_message(frame)
            except ConnectionClosed:
                raise _CommandLost() from None  # the frame may have gone out before the close
            with trio.move_on_after(self.client.request_timeout):
                await pending.done.wait()
        finally:
            del self._commands[command_id]
        reply = pending.reply
        if reply is None:
            raise _CommandLost()
        if reply.get("ok"):
            return reply.get("result")
        status = reply.get("status")
        raise error_for_status(
            status if isinstance(status, int) else 500, str(reply.get("message", ""))
        )

    def _command_replied(self, frame: dict[str, Any]) -> None:
        pending = self._commands.get(frame.get("id"))  # type: ignore[arg-type]
        if pending is not None and not pending.done.is_set():
            pending.reply = frame
            pending.done.set()

    def _commands_lost(self) -> None:
        for pending in self._commands.values():
            pending.done.set()  # no reply: _CommandLost

    async def run(
        self,
        session_id: str,
        text: str,
        *,
        timeout: float | None = DEFAULT_RUN_TIMEOUT,  # noqa: ASYNC109
        check: bool = True,
        auto_approve: bool = False,
    ) -> Run:
        """Send a prompt and wait for its run's final record (see :meth:`RunHandle.result`)."""
        handle = await self.prompt(session_id, text, auto_approve=auto_approve)
        return await handle.result(timeout, check=check)

    async def get_run(self, run_id: str) -> Run:
        data = await self.client.request("GET", self._url(f"/runs/{run_id}"))
        return wire.converter.structure(data, Run)

    async def cancel(self, session_id: str) -> None:
        """Cancel the session's active turn and drop its queued prompts (idempotent)."""
        await self.client.request("POST", self._url(f"/agent/sessions/{session_id}/cancel"))

    async def cancel_run(self, run_id: str) -> bool:
        """Cancel one run: drop it from its queue or stop the turn it belongs to; the session's
        other queued prompts go on. False when the run had already ended."""
        data = await self.client.request("POST", self._url(f"/runs/{run_id}/cancel"))
        return bool(data["cancelled"])

    async def clear_queue(self, session_id: str) -> None:
        """Drop the session's queued prompts (each gets a cancelled ``run_complete``)."""
        await self.client.request("POST", self._url(f"/agent/sessions/{session_id}/prompts/clear"))

    async def queued(self, session_id: str) -> list[str]:
        """The texts of the session's queued prompts."""
        data = await self.client.request(
            "GET", self._url(f"/agent/sessions/{session_id}/prompts/list")
        )
        return wire.converter.structure(data, list[str])

    # -- permissions -----------------------------------------------------------------------------

    async def grant(self, permission_id: str, action: GrantAction = "allow") -> bool:
        """Answer a permission request; True when this answer was the one that counted."""
        data = await self.client.request(
            "POST",
            self._url("/permissions/grant"),
            json={"permission": {"id": permission_id}, "action": action},
        )
        return bool(data.get("resolved")) if isinstance(data, dict) else False

    async def set_skip(self, skip: bool) -> None:
        """Workspace-wide auto-approve of every permission request (use with care)."""
        await self.client.request("POST", self._url("/permissions/skip"), json={"skip": skip})

    # -- raw events ------------------------------------------------------------------------------

    @asynccontextmanager
    async def subscribe(
        self,
        *,
        timeout: float | None = DEFAULT_RUN_TIMEOUT,  # noqa: ASYNC109
    ) -> AsyncIterator[Subscription]:
        """Every event of the workspace from now on, until the block ends.

        ``async for event in sub`` waits at most ``timeout`` seconds for each event (then raises
        :class:`Timeout`); :meth:`Subscription.next` and :meth:`Subscription.until` take their own.

        Backpressure: as :class:`~crush_trio.client.events.Mailbox` (lossy events beyond its
        size are dropped and reported as a ``gap`` event).
        """
        self._check_open()
        mailbox = Mailbox(self.mailbox_size)
        self._feeds.add(mailbox)
        try:
            yield Subscription(self, mailbox, timeout)
        finally:
            self._feeds.discard(mailbox)
            mailbox.close()

    # -- the stream ------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise Conflict(f"workspace client for {self.path} is closed; open the workspace again")
        if self.stream_error is not None:
            raise self.stream_error

    def _ws_url(self, since: int | None) -> str:
        query: dict[str, Any] = {"client_id": self.client.client_id}
        if since is not None:
            query["since"] = since
        return f"{self.client.ws_base}/v1/workspaces/{self.id}/ws?{urlencode(query)}"

    @asynccontextmanager
    async def _open_socket(self, since: int | None) -> AsyncIterator[WebSocketConnection]:
        """One websocket connection to the workspace's stream (TCP or a Unix socket)."""
        url = self._ws_url(since)
        async with open_stream_socket(
            self.client.ws_base,
            self.client.unix_path,
            url[url.index("/v1/") :],
            self.client.auth_headers(),
            timeout=HELLO_TIMEOUT,
        ) as conn:
            yield conn

    async def _stream(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The reader task (see the module docstring); reports started after the first hello.

        Raises (before started): Unreachable, AuthError, NotFound, Timeout for the first connect.
        """
        try:
            await self._stream_loop(task_status)
        finally:
            self._stream_done.set()
            self._stream_news()

    async def _stream_loop(self, task_status: trio.TaskStatus[None]) -> None:
        first = True
        lost_at: float | None = None
        delay = RECONNECT_FIRST_DELAY
        while not self.closed:
            since = None if first else self.stats.last_seq
            why: BaseException | str
            try:
                async with self._open_socket(since) as conn:
                    with trio.fail_after(HELLO_TIMEOUT):
                        hello = orjson.loads(await conn.get_message())
                    if not isinstance(hello, dict) or hello.get("type") != "hello":
                        raise Unreachable(
                            f"the event stream of workspace {self.id} did not "
                            "start with a hello frame; is this a crush_trio server?"
                        )
                    self.stats.connects += 1
                    if first:
                        self.stats.last_seq = int(hello.get("seq", 0))
                        first = False
                        task_status.started()
                    else:
                        self.stats.reconnects += 1
                        # A server whose sequence restarted sends a gap; follow its numbering.
                        self.stats.last_seq = min(self.stats.last_seq, int(hello.get("seq", 0)))
                        self._stream_news()
                    lost_at, delay = None, RECONNECT_FIRST_DELAY
                    self._conn = conn
                    try:
                        with trio.CancelScope() as scope:
                            self._conn_scope = scope
                            why = await self._read(conn)
                    finally:
                        self._conn = None
                        self._commands_lost()
                    self._conn_scope = None
                    if scope.cancelled_caught:
                        why = "dropped by this client"
            except (
                ConnectionClosed,
                HandshakeError,
                OSError,
                trio.BrokenResourceError,
                trio.TooSlowError,
                orjson.JSONDecodeError,
                CrushError,
            ) as exc:
                self._conn_scope = None
                if first:
                    error = exc if isinstance(exc, CrushError) else self._stream_failure(exc)
                    raise error from exc
                why = exc
            if self.closed:
                return
            self.stats.drops += 1
            now = trio.current_time()
            if lost_at is None:
                lost_at = now
                log.info("event stream of workspace %s lost (%s); reconnecting", self.id, why)
            permanent = isinstance(why, ConnectionRejected) and (
                why.status_code in _PERMANENT_STATUSES
            )
            if permanent or now - lost_at >= self.reconnect_timeout:
                self._fail_stream(why if isinstance(why, CrushError) else self._stream_failure(why))
                return
            await trio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX_DELAY)

    def _stream_failure(self, exc: BaseException | str) -> CrushError:
        where = f"the event stream of workspace {self.id} at {self.client.url}"
        if isinstance(exc, ConnectionRejected):
            return rejection_error(where, exc)
        if isinstance(exc, trio.TooSlowError):
            return Timeout(f"{where} did not answer within {HELLO_TIMEOUT:g} s")
        what = exc if isinstance(exc, str) else f"{exc.__class__.__name__}: {exc}"
        return Unreachable(
            f"lost {where} ({what}) and could not re-open it within "
            f"{self.reconnect_timeout:g} s; check that the server is running"
        )

    async def _read(self, conn: WebSocketConnection) -> str:
        """Read frames until the connection ends; returns why it ended.

        The connection's end is handled here, inside its ``async with`` block, so that the
        websocket library closes it cleanly.
        """
        while True:
            try:
                with trio.move_on_after(KEEPALIVE_INTERVAL) as idle:
                    raw = await conn.get_message()
                if idle.cancelled_caught:
                    with trio.move_on_after(PING_TIMEOUT) as ping:
                        await conn.ping()
                    if ping.cancelled_caught:
                        return f"no answer to a keep-alive ping within {PING_TIMEOUT:g} s"
                    continue
            except ConnectionClosed as exc:
                reason = exc.reason
                if reason is None:
                    return "connection closed"
                return f"closed with code {reason.code} {reason.reason or reason.name}"
            try:
                frame = orjson.loads(raw)
            except orjson.JSONDecodeError:
                log.warning("ignoring an event frame that is not JSON")
                continue
            self._handle_frame(frame)

    def _handle_frame(self, frame: Any) -> None:
        if isinstance(frame, dict) and frame.get("type") == "reply":
            self._command_replied(frame)
            return
        event = decode_frame(frame)
        if event is None:
            return
        if event.type == "gap":
            self.stats.gaps += 1
            for mailbox in self._feeds:
                mailbox.put(event)
            for handle in list(self._runs.values()):
                handle.offer(event)
                self._schedule_resync(handle, messages=True)
            return
        assert event.seq is not None
        if event.seq <= self.stats.last_seq:
            return  # already seen (a replay overlapping what arrived before the drop)
        self.stats.last_seq = event.seq
        self.stats.events += 1
        for mailbox in self._feeds:
            mailbox.put(event)
        for handle in list(self._runs.values()):
            handle.offer(event)

    def _stream_news(self) -> None:
        """Wake :meth:`wait_reconnected`: the stream was re-opened, or is gone for good."""
        self._stream_changed.set()
        self._stream_changed = trio.Event()

    def _fail_stream(self, error: CrushError) -> None:
        """The stream is gone for good. Subscriptions end with ``error``; runs still pending do
        not: the resync task follows them by their records (``GET runs/{id}``), so a run that
        ended, or ends later, still gets its outcome."""
        self.stream_error = error
        log.warning("%s; following the pending runs over HTTP", error)
        for mailbox in self._feeds:
            mailbox.close()
        for handle in list(self._runs.values()):
            self._schedule_resync(handle, messages=True)
        self._stream_news()

    def _record_lost(self, handle: RunHandle, exc: CrushError) -> CrushError:
        """The error of a pending run whose stream is gone and whose record cannot be read."""
        assert self.stream_error is not None
        return type(self.stream_error)(
            f"{self.stream_error.message}; run {handle.run_id!r} could not be followed over "
            f"HTTP either ({exc.message})"
        )

    async def wait_reconnected(
        self,
        after: int | None = None,
        *,
        timeout: float | None = DEFAULT_RECONNECT_TIMEOUT,  # noqa: ASYNC109
    ) -> int:
        """Wait until the event stream has been re-opened after a drop.

        Returns once ``stats.reconnects`` is greater than ``after`` (default: its value when
        called), i.e. the server has answered a reconnect with its ``hello``; the events it
        replays follow. To be sure not to miss a reconnect that completes before the wait begins
        (a drop from the server's side), read ``ws.stats.reconnects`` before causing the drop and
        pass it as ``after``.

        Returns:
            ``stats.reconnects``, to pass as ``after`` to the next wait.

        Raises:
            Timeout: the stream was not re-opened within ``timeout`` seconds.
            Unreachable, NotFound, Conflict, AuthError: the stream is gone for good (the
                server refused it or stayed unreachable); the error is ``stream_error``.
            Conflict: the workspace client was closed.
        """
        target = self.stats.reconnects if after is None else after

        def describe() -> str:
            return (
                f"the event stream of workspace {self.id} was not re-opened within {timeout:g} s "
                f"({self.stats.reconnects} reconnect(s) and {self.stats.drops} drop(s) so far, "
                f"last seq {self.stats.last_seq}); is the server at {self.client.url} up?"
            )

        with deadline_scope(deadline_after(timeout), describe):
            while self.stats.reconnects <= target:
                self._check_open()
                await self._stream_changed.wait()
        return self.stats.reconnects

    def drop_stream(self) -> None:
        """Close the current event-stream connection; the reader re-opens it with ``since``.

        Meant for tests and for a caller that suspects a stale connection.
        """
        if self._conn_scope is not None:
            self._conn_scope.cancel()

    # -- work the run handles ask for ------------------------------------------------------------

    def _forget(self, handle: RunHandle) -> None:
        if self._runs.get(handle.run_id) is handle:
            del self._runs[handle.run_id]
        self._resync.pop(handle, None)

    def _schedule_resync(self, handle: RunHandle, *, messages: bool) -> None:
        if handle.done:
            return
        self._resync[handle] = self._resync.get(handle, False) or messages
        self._resync_wakeup.set()

    def _schedule_grant(self, permission_id: str, action: GrantAction) -> None:
        if self._nursery is not None and not self.closed:
            self._nursery.start_soon(self._grant_quietly, permission_id, action)

    async def _grant_quietly(self, permission_id: str, action: GrantAction) -> None:
        try:
            await self.grant(permission_id, action)
        except CrushError as exc:
            log.warning("could not answer permission request %s: %s", permission_id, exc)

    async def _resync_worker(self) -> None:
        """Re-read runs (and messages) of handles that may have missed events.

        With no event stream left (:meth:`_fail_stream`), every pending run is re-read at a
        growing interval (:data:`RUN_POLL_FIRST_DELAY` to :data:`RUN_POLL_MAX_DELAY`) until its
        record shows its end; a record that cannot be read then fails the run.
        """
        poll_delay = RUN_POLL_FIRST_DELAY
        while True:
            await self._resync_wakeup.wait()
            self._resync_wakeup = trio.Event()
            batch, self._resync = self._resync, {}
            failed = False
            for handle, with_messages in batch.items():
                if handle.done:
                    continue
                try:
                    run = await self.get_run(handle.run_id)
                    self.stats.refetches += 1
                    handle.refetched_run(run)
                    if with_messages and not handle.done:
                        handle.refetched_messages(await self.messages(handle.session_id))
                except CrushError as exc:
                    if self.stream_error is not None:
                        handle.fail(self._record_lost(handle, exc))
                    elif not isinstance(exc, NotFound):  # not known yet: its events will tell
                        log.info("refetching run %s failed (%s); will retry", handle.run_id, exc)
                        self._resync[handle] = self._resync.get(handle, False) or with_messages
                        failed = True
            if self.stream_error is not None:
                for handle in list(self._runs.values()):
                    self._resync.setdefault(handle, False)
                if self._resync:
                    await trio.sleep(poll_delay)
                    poll_delay = min(poll_delay * 2, RUN_POLL_MAX_DELAY)
                    self._resync_wakeup.set()
            elif failed:
                await trio.sleep(RESYNC_RETRY_DELAY)
                self._resync_wakeup.set()

    async def _close_stream(self) -> None:
        """Close the event stream politely (a websocket close handshake), bounded."""
        self.closed = True
        self.drop_stream()
        with trio.move_on_after(CLOSE_TIMEOUT):
            await self._stream_done.wait()

    def _close(self) -> None:
        self.closed = True
        error = Conflict(f"workspace client for {self.path} was closed before the run ended")
        for handle in list(self._runs.values()):
            handle.fail(error)
        for mailbox in self._feeds:
            mailbox.close()
        self._stream_news()


class Subscription:
    """The events of a workspace, from :meth:`WorkspaceClient.subscribe`."""

    def __init__(self, workspace: WorkspaceClient, mailbox: Mailbox, timeout: float | None) -> None:
        self._workspace = workspace
        self._mailbox = mailbox
        self._timeout = timeout

    @property
    def dropped(self) -> int:
        return self._mailbox.dropped

    async def next(self, timeout: float | None = DEFAULT_RUN_TIMEOUT) -> Event:  # noqa: ASYNC109
        """The next event.

        Raises:
            Timeout: none arrived within ``timeout`` seconds.
            Unreachable: the stream is gone for good (or the subscription ended).
        """
        event = await self._get(timeout)
        if event is None:
            raise self._ended()
        return event

    def _ended(self) -> CrushError:
        return self._workspace.stream_error or Unreachable(
            f"the subscription to workspace {self._workspace.id} has ended"
        )

    async def _get(self, timeout: float | None) -> Event | None:  # noqa: ASYNC109
        with deadline_scope(
            deadline_after(timeout),
            lambda: f"no event of workspace {self._workspace.id} within {timeout:g} s",
        ):
            return await self._mailbox.get()

    async def until(
        self,
        predicate: EventPredicate,
        timeout: float | None = DEFAULT_RUN_TIMEOUT,  # noqa: ASYNC109
    ) -> Event:
        """The first event for which ``predicate(event)`` is true; the events before it are
        consumed and dropped (:meth:`collect_until` keeps them).

        Raises:
            Timeout: no event matched within ``timeout`` seconds (for the whole wait).
            Unreachable: the stream is gone for good (or the subscription ended).
        """
        return (await self._collect(predicate, timeout, keep=False))[-1]

    async def collect_until(
        self,
        predicate: EventPredicate,
        timeout: float | None = DEFAULT_RUN_TIMEOUT,  # noqa: ASYNC109
    ) -> list[Event]:
        """Every event up to and including the first for which ``predicate(event)`` is true, in
        the order received (the events that do not match are kept, not skipped).

        Raises:
            Timeout: no event matched within ``timeout`` seconds (for the whole wait); the events
                received until then are consumed.
            Unreachable: the stream is gone for good (or the subscription ended).
        """
        return await self._collect(predicate, timeout, keep=True)

    async def _collect(
        self,
        predicate: EventPredicate,
        timeout: float | None,  # noqa: ASYNC109
        *,
        keep: bool,
    ) -> list[Event]:
        seen: list[Event] = []
        others = 0

        def describe() -> str:
            return (
                f"no event of workspace {self._workspace.id} matched {_describe(predicate)} "
                f"within {timeout:g} s ({others} other event(s) received)"
            )

        with deadline_scope(deadline_after(timeout), describe):
            while True:
                event = await self._mailbox.get()
                if event is None:
                    raise self._ended()
                matched = predicate(event)
                if keep or matched:
                    seen.append(event)
                if matched:
                    return seen
                others += 1

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Event:
        event = await self._get(self._timeout)
        if event is None:
            if self._workspace.stream_error is not None:
                raise self._workspace.stream_error
            raise StopAsyncIteration
        return event


def _describe(predicate: EventPredicate) -> str:
    """How a Timeout names the predicate that was awaited: its name, or where a lambda is."""
    name = getattr(predicate, "__qualname__", None) or repr(predicate)
    code = getattr(predicate, "__code__", None)
    if name.endswith("<lambda>") and code is not None:
        return f"the predicate at {code.co_filename}:{code.co_firstlineno}"
    return name
