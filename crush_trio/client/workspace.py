"""A workspace seen from the client: its HTTP operations, its prompts and its event stream.

:func:`open_workspace` (behind :meth:`Client.workspace <crush_trio.client.Client.workspace>`)
creates or joins the workspace, runs its :class:`~crush_trio.client.stream.EventStream` for the
``async with`` block (reader, resync and grant tasks: see :mod:`crush_trio.client.stream`), and
when the block ends closes the stream, fails the runs still pending with :class:`Conflict`
("workspace client closed") and releases the client's hold with
``DELETE /v1/workspaces/{id}?client_id=`` (bounded by :data:`~crush_trio.defaults.CLEANUP_TIMEOUT`).

While the stream is connected, :meth:`WorkspaceClient.prompt` sends its prompt as an
``agent.prompt`` command on that websocket (one frame, like the browser client, instead of an
HTTP request) and the reader hands the command's reply back to it. Without a connected stream it
posts over HTTP. A stream lost between the command and its reply is settled by the run's record
(``GET runs/{id}``), and by posting the prompt again when there is none: the run id the client
always sends makes that resend safe.
"""

from __future__ import annotations

import logging
import os
import uuid
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal

import trio
from trio_websocket import ConnectionRejected, HandshakeError, WebSocketConnection

from .. import wire
from ..defaults import CLEANUP_TIMEOUT
from ..wire import AcceptedPrompt, Run, RunStatus, Workspace
from .errors import BadRequest, CrushError, NotFound, Unreachable, single_errors
from .events import DEFAULT_MAILBOX_SIZE, Mailbox
from .resources import AgentRequests, SessionRequests, latest_session, resolve_session_prefix
from .runs import DEFAULT_RUN_TIMEOUT, RunHandle
from .stream import DEFAULT_RECONNECT_TIMEOUT, NOT_SENT, CommandLost, EventStream, StreamStats
from .subscription import Subscription
from .transport import (
    HELLO_TIMEOUT,
    MAX_REDIRECTS,
    open_stream_socket,
    stream_resource,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable, Sequence

    from .link import ServerLink

__all__ = ["WorkspaceClient", "latest_session", "open_workspace", "resolve_session_prefix"]

log = logging.getLogger(__name__)


@asynccontextmanager
async def open_workspace(
    client: ServerLink, path: str | os.PathLike[str], *, events: bool = True
) -> AsyncIterator[WorkspaceClient]:
    """Create (or join) the workspace of ``path`` and hold it for the block's duration.

    See :meth:`Client.workspace <crush_trio.client.Client.workspace>`, which calls it.
    """
    absolute = _absolute(path)
    data = await client.request(
        "POST", "/v1/workspaces", json={"path": absolute, "client_id": client.client_id}
    )
    info = wire.converter.structure(data, Workspace)
    ws = WorkspaceClient(
        client,
        info,
        mailbox_size=client.mailbox_size,
        reconnect_timeout=client.reconnect_timeout,
    )
    try:
        with single_errors():
            async with ws._stream.running(read=events):
                yield ws
    finally:
        ws._stream.close()
        with trio.move_on_after(CLEANUP_TIMEOUT, shield=True):
            try:
                await client.request(
                    "DELETE",
                    f"/v1/workspaces/{info.id}",
                    params={"client_id": client.client_id},
                    timeout=CLEANUP_TIMEOUT,
                )
            except CrushError as exc:
                log.debug("releasing workspace %s: %s", info.id, exc)


def _absolute(path: str | os.PathLike[str]) -> str:
    return os.path.abspath(os.fspath(path))


class WorkspaceClient(SessionRequests, AgentRequests):
    """One open workspace. Get it from ``async with client.workspace(path) as ws``.

    Its HTTP operations on sessions, history and the agent come from
    :class:`~.resources.SessionRequests` and :class:`~.resources.AgentRequests`; this class adds
    the prompts and the event stream.

    Attributes:
        info: the server's Workspace object (``id``, ``path``, ``data_dir``).
        stats: counters of the event stream.
    """

    def __init__(
        self,
        client: ServerLink,
        info: Workspace,
        *,
        mailbox_size: int = DEFAULT_MAILBOX_SIZE,
        reconnect_timeout: float = DEFAULT_RECONNECT_TIMEOUT,
    ) -> None:
        self.client = client
        self.info = info
        self.mailbox_size = mailbox_size
        self._stream = EventStream(
            workspace_id=info.id,
            path=info.path,
            server_url=client.url,
            records=self,
            # Looked up at each connect, so that a test can hold a reconnect.
            open_socket=lambda since: self._open_socket(since),
            reconnect_timeout=reconnect_timeout,
        )

    @property
    def stats(self) -> StreamStats:
        """Counters of the event stream."""
        return self._stream.stats

    @property
    def stream_error(self) -> CrushError | None:
        """The error of an event stream that is gone for good (``None`` until then)."""
        return self._stream.stream_error

    @property
    def closed(self) -> bool:
        """True once the workspace block has ended (or is ending)."""
        return self._stream.closed

    @property
    def reconnect_timeout(self) -> float:
        """How long a dropped event stream is retried before it is gone for good (seconds)."""
        return self._stream.reconnect_timeout

    @reconnect_timeout.setter
    def reconnect_timeout(self, value: float) -> None:
        self._stream.reconnect_timeout = value

    async def prompt(
        self,
        session_id: str,
        text: str,
        run_id: str | None = None,
        *,
        auto_approve: bool = False,
        model: str | None = None,
        attachments: Sequence[wire.Attachment] = (),
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
            model: the model for this prompt, ``provider/model``; ``None`` uses the
                workspace's ``models.large``.
            attachments: files sent with the prompt (see
                :func:`crush_trio.attachments.attachment_from_file`).

        Raises:
            BadRequest: empty prompt, unknown session, or a ``run_id`` already used.
            TooLarge: an attachment over the server's limits.
            Conflict: the workspace is closing.
            Unreachable: the server or its event stream is gone.
        """
        self._stream.check_open()
        run_id = run_id if run_id is not None else str(uuid.uuid4())
        if self._stream.is_pending(run_id):
            raise BadRequest(f"run_id {run_id!r} is already pending in this client; pick a new one")
        handle = RunHandle(
            self,
            session_id,
            run_id,
            text,
            feed=self._stream,
            auto_approve=auto_approve,
            mailbox_size=self.mailbox_size,
        )
        self._stream.track(handle)
        body: dict[str, Any] = {"session_id": session_id, "prompt": text, "run_id": run_id}
        if model is not None:
            body["model"] = model
        if attachments:
            body["attachments"] = [wire.unstructure(a) for a in attachments]
        try:
            handle.accepted = await self._send_prompt(body)
        except BaseException:
            self._stream.forget(handle)
            raise
        return handle

    async def _send_prompt(self, body: dict[str, Any]) -> AcceptedPrompt:
        """The stream's ``agent.prompt`` command when connected, else ``POST agent``."""
        try:
            result = await self._stream.command(
                "agent.prompt", body, timeout=self.client.request_timeout
            )
        except CommandLost:
            return await self._settle_prompt(body)
        if result is NOT_SENT:
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

    # -- raw events ------------------------------------------------------------------------------

    @asynccontextmanager
    async def subscribe(
        self,
        *,
        timeout: float | None = DEFAULT_RUN_TIMEOUT,  # noqa: ASYNC109
        types: Iterable[str] | None = None,
    ) -> AsyncIterator[Subscription]:
        """Every event of the workspace from now on, until the block ends.

        ``async for event in sub`` waits at most ``timeout`` seconds for each event (then raises
        :class:`Timeout`); :meth:`Subscription.next` and :meth:`Subscription.until` take their own.

        ``types``: only the events of these types (``"run_complete"``, ``"message"``...), and
        every ``gap``; the others never reach the subscription's mailbox, so a consumer that
        wants a few events does not wake for every streamed delta.

        Backpressure: as :class:`~crush_trio.client.events.Mailbox` (lossy events beyond its
        size are dropped and reported as a ``gap`` event).
        """
        self._stream.check_open()
        mailbox = Mailbox(self.mailbox_size)
        self._stream.add_feed(mailbox, None if types is None else frozenset(types))
        try:
            yield Subscription(self, mailbox, timeout)
        finally:
            self._stream.remove_feed(mailbox)
            mailbox.close()

    # -- the event stream ------------------------------------------------------------------------

    @asynccontextmanager
    async def _open_socket(self, since: int | None) -> AsyncIterator[WebSocketConnection]:
        """One websocket connection to the workspace's stream (TCP or a Unix socket), at the
        node that owns the workspace in a cluster (following 307 answers to it)."""
        client = self.client
        resource = stream_resource(
            self.id, client.client_id, since, deltas=client.deltas, batch=True
        )
        for hops in range(MAX_REDIRECTS + 1):
            stack = AsyncExitStack()
            try:
                conn = await stack.enter_async_context(
                    open_stream_socket(
                        client.ws_base_for(self.id),
                        client.unix_path,
                        resource,
                        client.auth_headers(),
                        timeout=HELLO_TIMEOUT,
                    )
                )
            except ConnectionRejected as exc:
                headers = {k.decode().lower(): v.decode() for k, v in exc.headers or ()}
                if hops < MAX_REDIRECTS and exc.status_code == 307 and "location" in headers:
                    client.moved(self.id, headers["location"])
                    continue
                if exc.status_code == 503 and (
                    client.forget_owner(self.id) or "retry-after" in headers
                ):
                    # The owner stops, or is gone and its lease not expired yet: retry later.
                    raise Unreachable(f"workspace {self.id}: {exc.body!r}") from exc
                raise
            except (OSError, HandshakeError, trio.TooSlowError):
                client.forget_owner(self.id)  # the owner is gone: ask the server next time
                raise
            async with stack:
                yield conn
            return

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
        return await self._stream.wait_reconnected(after, timeout=timeout)

    def drop_stream(self) -> None:
        """Close the current event-stream connection; the reader re-opens it with ``since``.

        Meant for tests and for a caller that suspects a stale connection.
        """
        self._stream.drop()
