"""One workspace: a project directory with its store, broker, agent and nursery.

Task ownership (see docs/architecture.md)::

    Backend nursery
      └─ Workspace.serve                      one per open workspace
           ├─ background nursery              message flusher, run-record writer, titles,
           │                                  MCP servers (tools/mcp.py, one task each),
           │                                  background jobs (tools/jobs.py, one task each)
           │    └─ runs nursery               session drivers (one per busy session)
           └─ hold watcher (inline)           ends serve when nothing holds the workspace

Shutdown (PROTOCOL §6), in order: refuse new prompts (409 ``workspace closing``); cancel every
session's work; wait for every run task to return (bounded by ``shutdown_grace``, then cancelled);
save final state (buffered messages, run records) inside ``trio.move_on_after(save_timeout,
shield=True)``; close the event streams; close the store.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import signal
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from .. import wire
from ..agent.prompt import SystemPrompts
from ..agent.runner import Agent
from ..agent.runs import RunBook
from ..broker import Broker
from ..changes import ChangeLog
from ..changes.tracking import TrackedTools
from ..core.holds import Holds
from ..core.lifecycle import WorkspaceState, check_workspace_move
from ..errors import WS_CLOSE_SERVICE_RESTART, BadRequest, Conflict, Fenced
from ..logs import set_log_context
from ..permissions import PermissionService
from ..providers import make_provider
from ..store import MessageService, Store
from ..tools import FileTracker, JobManager, Toolbox
from ..tools.hidden import HiddenPaths
from ..tools.mcp import McpManager
from ..tools.sandbox import Sandbox, SandboxStatus
from ..tools.sandbox import probe as sandbox_probe
from ..wire import (
    AgentEvent,
    EventKind,
    FilesChanged,
    McpServerInfo,
    McpState,
    Message,
    ModelChoice,
    PermissionRequest,
    Run,
    RunComplete,
    SandboxInfo,
    Session,
    new_id,
)
from ..wire import Workspace as WorkspaceInfo
from . import catalog
from .recovery import RECOVERY_SCAN_EVENTS as RECOVERY_SCAN_EVENTS  # re-exported
from .recovery import STOPPED_RUN_ERROR as STOPPED_RUN_ERROR  # re-exported
from .recovery import STOPPED_TOOL_RESULT as STOPPED_TOOL_RESULT  # re-exported
from .recovery import Recovery

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable

    from ..config import Config, ServerOptions

log = logging.getLogger(__name__)

#: Test-only fault injection (never set in production): with ``die-after-terminal-record`` a
#: cluster node kills itself right after committing a run's terminal record, before the log
#: append, as a crash in that window would.
FAULT_ENV = "CRUSH_TRIO_DEBUG_FAULT"
FAULT_AFTER_TERMINAL_RECORD = "die-after-terminal-record"

#: The agent info's sandbox ``reason`` when the config turns the sandbox off.
SANDBOX_OFF_REASON = "turned off by options.sandbox.enabled; every bash command asks"


def data_dir_for(path: Path, config: Config, server_data_dir: Path | None) -> Path:
    """Where a workspace keeps its database: ``<data-dir>/<name>-<hash>`` when the server has
    ``--data-dir``, else ``options.data_directory`` inside the project (default ``.crush``)."""
    if server_data_dir is not None:
        digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
        return server_data_dir / f"{path.name or 'root'}-{digest}"
    data = Path(config.options.data_directory).expanduser()
    return data if data.is_absolute() else path / data


class Workspace:
    """A project directory served to clients. Create with :meth:`serve` via ``nursery.start``."""

    def __init__(
        self,
        *,
        path: Path,
        config: Config,
        server: ServerOptions,
        data_dir: Path,
        version: str,
        provider_factory: Any = None,
        trusted: bool = False,
        warnings: tuple[str, ...] = (),
        sandbox_hidden: tuple[Path, ...] = (),
        sandbox_more_hidden: Callable[[], Iterable[Path]] | None = None,
        on_run_complete: Callable[[Workspace, RunComplete], None] | None = None,
        on_permission_request: Callable[[Workspace, PermissionRequest], None] | None = None,
        workspace_id: str | None = None,
        store_factory: Callable[[Path], Awaitable[Any]] | None = None,
        event_log: Any = None,
        user_context_dir: Path | None = None,
        changes_dir: Path | None = None,
    ) -> None:
        self.id = workspace_id or new_id()
        #: The user config directory, home of the user's own context files (docs/providers.md).
        self.user_context_dir = user_context_dir
        #: Told each run's end before its run_complete is published (the server's webhooks).
        self.on_run_complete = on_run_complete
        #: Opens the store from the data directory: SQLite (default), or a cluster's
        #: PostgreSQL store fenced by the lease's epoch.
        self.store_factory: Callable[[Path], Awaitable[Any]] = store_factory or Store.open
        #: The broker's event log: None for the in-memory ring, or a cluster's Redis stream.
        self.event_log = event_log
        #: Set when a cluster lease was lost: the workspace stops without writing anything more.
        self.fenced = False
        #: Told when the event log finds the lease gone (a cluster's placement, which marks the
        #: lease lost, logs it and stops the workspace); None: stop the workspace directly.
        self.lease_lost_hook: Callable[[str], None] | None = None
        self.path = path
        self.config = config
        #: Models chosen with ``POST .../config/model``, kept over a reloaded configuration.
        self.model_choices: dict[catalog.Role, ModelChoice] = {}
        self.trusted = trusted
        self.warnings = list(warnings)
        self.server = server
        self.data_dir = data_dir
        self.version = version
        self.provider_factory = provider_factory or make_provider
        #: Directories the bash sandbox hides (the server's data and config directories).
        self.sandbox_hidden = sandbox_hidden
        #: Called before each bash command: the data directories of the other open workspaces.
        self.sandbox_more_hidden = sandbox_more_hidden
        #: The bash sandbox, set when the workspace opens (None: none, every command asks).
        self.sandbox: Sandbox | None = None
        self.sandbox_info = SandboxInfo(reason="the workspace is not open yet")
        self._sandbox_status: SandboxStatus | None = None
        self.state = WorkspaceState.STARTING
        self.holds = Holds(create_grace=server.create_grace, detach_grace=server.detach_grace)
        broker_options: dict[str, Any] = {}
        if event_log is not None:  # cluster mode: events reach clients through the log
            broker_options = {"log": event_log, "on_log_lost": self._log_lost}
        self.broker = Broker(
            replay_size=server.replay_buffer,
            replay_bytes=server.replay_bytes,
            client_queue_size=server.client_queue_size,
            client_queue_bytes=server.client_queue_bytes,
            must_deliver_timeout=server.must_deliver_timeout,
            **broker_options,
        )
        self._changed = trio.Event()
        self._stop = trio.Event()
        self.closed = trio.Event()
        self.store: Store
        self.messages: MessageService
        self.runs: RunBook
        self.agent: Agent
        #: Snapshots, diffs and reverts of what runs change (opened when the workspace opens).
        #: ``changes_dir``: where they live when not in ``data_dir`` (a cluster's shared one).
        self.changes = ChangeLog(path, changes_dir or data_dir, publish=self._publish_files_changed)
        #: The MCP servers of the config's ``mcp`` section, started when the workspace opens.
        self.mcp = McpManager(config.mcp, cwd=path, on_change=self._mcp_changed)
        #: Background jobs of ``bash`` (docs/tools.md); ended when the workspace closes.
        self.jobs = JobManager(publish=self.broker.publish, options=config.options.jobs)
        #: The files each session viewed (read-before-edit); kept across config reloads.
        self.files = FileTracker()
        self.permissions = PermissionService(
            self.broker,
            allowed_tools=list(config.permissions.allowed_tools),
            timeout=config.options.permission_timeout,
        )
        if on_permission_request is not None:
            self.permissions.on_request = partial(on_permission_request, self)

    @property
    def info(self) -> WorkspaceInfo:
        return WorkspaceInfo(
            self.id,
            str(self.path),
            str(self.data_dir),
            self.trusted,
            list(self.warnings),
            catalog.workspace_config(self.config, self.data_dir),
        )

    def select_model(self, role: catalog.Role, choice: ModelChoice) -> None:
        """Use ``choice`` for ``role`` from the next turn on, until the workspace closes (and
        across a reload of its configuration while the model is still there).

        Raises:
            BadRequest: the provider or model is not one of the configuration's.
        """
        self._use_config(catalog.with_model(self.config, role, choice))
        self.model_choices[role] = choice

    def _use_config(self, config: Config) -> None:
        self.config = config
        if hasattr(self, "agent"):
            self.agent.replace_config(config, self.agent.tools)

    def set_current_session(self, client_id: str, session_id: str) -> None:
        """Record the session a client shows (``""``: none).

        Raises:
            Conflict: the client has no event stream open on this workspace.
        """
        hold = self.holds.clients.get(client_id)
        if hold is None or hold.streams == 0:
            raise Conflict(
                f"client not attached: client {client_id} has no event stream open on workspace "
                f"{self.id}; open GET /v1/workspaces/{self.id}/events?client_id=... first"
            )
        hold.current_session = session_id

    def apply_config(
        self, config: Config, *, data_dir: Path, trusted: bool, warnings: tuple[str, ...]
    ) -> None:
        """Use a reloaded configuration (after the workspace's trust changed) from the next
        tool call and model turn on; a running turn finishes with what it started with. The
        data directory stays where it is until the workspace is opened again."""
        self.trusted = trusted
        self.warnings = list(warnings)
        if data_dir != self.data_dir:
            self.warnings.append(
                "options.data_directory changed: it applies when the workspace is next opened"
            )
        for role, choice in list(self.model_choices.items()):
            try:
                config = catalog.with_model(config, role, choice)
            except BadRequest:
                del self.model_choices[role]  # the reloaded configuration no longer has it
        self.config = config
        self.permissions.allowed_tools = frozenset(config.permissions.allowed_tools)
        self.permissions.timeout = config.options.permission_timeout
        self.mcp.reconfigure(config.mcp)
        if hasattr(self, "agent"):
            self.agent.replace_config(config, self._tracked_tools())

    def _move(self, new: WorkspaceState) -> None:
        check_workspace_move(self.id, self.state, new)
        self.state = new

    @property
    def closing(self) -> bool:
        return self.state in (WorkspaceState.CLOSING, WorkspaceState.CLOSED)

    def check_open(self) -> None:
        if self.closing:
            raise Conflict(
                f"workspace closing: {self.path} is shutting down; open it again with "
                "POST /v1/workspaces and retry"
            )

    # -- holds ----------------------------------------------------------------------------------

    def poke(self) -> None:
        """Something that keeps the workspace alive changed: re-check the holds."""
        self._changed.set()

    def open_hold(self, client_id: str) -> None:
        self.holds.open(client_id, trio.current_time())
        self.poke()

    def attach(self, client_id: str) -> None:
        self.holds.attach(client_id)
        self.poke()

    def detach(self, client_id: str) -> None:
        self.holds.detach(client_id, trio.current_time())
        self.poke()

    def release(self, client_id: str) -> None:
        self.holds.release(client_id)
        self.poke()

    def request_shutdown(self) -> None:
        self._stop.set()
        self.poke()

    def _log_lost(self, exc: Exception) -> None:
        """The broker lost the event log (a newer owner fenced it, or Redis stayed unreachable):
        its clients are closed already; stop the workspace without writing."""
        reason = f"event log lost: {exc}"
        if self.lease_lost_hook is not None:
            self.lease_lost_hook(reason)
        else:
            self.lose_lease(reason)

    def lose_lease(self, reason: str) -> None:
        """Another node owns the workspace now: close the event streams (1012: reconnect, the
        new owner resumes them) and stop at once, without writing (the writes would be fenced
        anyway)."""
        self.fenced = True
        self.broker.drop_all(f"workspace moved to another node: {reason}", WS_CLOSE_SERVICE_RESTART)
        self.request_shutdown()

    # -- lifetime -------------------------------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[Workspace] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Open the store and serve until nothing holds the workspace or shutdown is requested."""
        set_log_context(workspace_id=self.id)  # this task's records and its children's
        await self._set_up_sandbox()
        self.store = await self.store_factory(self.data_dir)
        save_timeout = self.server.shutdown_save_timeout
        self.messages = MessageService(
            self.store,
            self._publish_message,
            debounce=self.config.options.debounce_ms / 1000,
            write_window=self.server.message_write_ms / 1000,
            publish_delta=self.broker.publish_delta,
            batch=self.broker.batched,
        )
        self.runs = RunBook(self.store)
        prompts = SystemPrompts(self, user_dir=self.user_context_dir)
        await self.changes.open()
        agent: Agent | None = None
        try:
            async with trio.open_nursery() as background:
                if self.event_log is not None:
                    await background.start(self.broker.write_log)  # before anything publishes
                await background.start(self.messages.run)
                await background.start(self.runs.writer)
                await background.start(self.broker.watch_stalled)
                await background.start(self.broker.coalesce_ticks)
                await background.start(self.mcp.run)
                # Cancelled with the background nursery below: every job's process group ends.
                await background.start(self.jobs.run)
                background.start_soon(self.changes.warm)
                async with trio.open_nursery() as runs:
                    self.agent = agent = Agent(
                        store=self.store,
                        messages=self.messages,
                        broker=self.broker,
                        runs=self.runs,
                        config=self.config,
                        runs_nursery=runs,
                        background_nursery=background,
                        save_timeout=save_timeout,
                        provider_factory=self.provider_factory,
                        tools=self._tracked_tools(),
                        on_idle=self.poke,
                        max_queued_prompts=self.server.max_queued_prompts,
                        max_queued_prompt_bytes=self.server.max_queued_prompt_bytes,
                        on_complete=self._run_completed,
                        changes=self.changes,
                        terminals=(
                            None
                            if self.event_log is None
                            else LoggedTerminals(self.store, self.broker)
                        ),
                        prompts=prompts,
                    )
                    await self._read_context_files(prompts)
                    await Recovery(self.store, self.broker, self.event_log).run()
                    self._move(WorkspaceState.OPEN)
                    task_status.started(self)
                    await self._watch_holds()
                    self._move(WorkspaceState.CLOSING)
                    log.info("workspace %s (%s) shutting down", self.id, self.path)
                    self.agent.begin_shutdown()
                    # Deadline first, then cancel: drivers finish their cancelled turns and
                    # publish terminals; anything still running after the grace is cancelled.
                    grace = 0.0 if self.fenced else self.server.shutdown_grace
                    runs.cancel_scope.deadline = trio.current_time() + grace
                background.cancel_scope.cancel()
        finally:
            if self.state is not WorkspaceState.CLOSING:
                self.state = WorkspaceState.CLOSING
            # Each step is shielded and bounded, and a failing store cannot stop the close: the
            # records and messages it could not save are ended by the next start's recovery, as
            # after a kill.
            if not self.fenced:  # a fenced workspace's writes belong to the new owner
                await self._close_step("writing messages", self.messages.flush_all, save_timeout)
                await self._close_step("saving run records", self.runs.save_now, save_timeout)
            self.runs.fail_pending_inserts("the workspace closed before the run record was saved")
            if agent is not None:
                await self._close_step("closing providers", agent.aclose, save_timeout)
            if self.event_log is not None and not self.fenced:
                await self._close_step(
                    "appending the last events", self.broker.aclose, save_timeout
                )
            self.broker.close()
            await self._close_step("closing the store", self.store.aclose, save_timeout)
            self.state = WorkspaceState.CLOSED
            self.closed.set()
            log.info("workspace %s closed", self.id)

    def _run_completed(self, complete: RunComplete) -> None:
        if self.on_run_complete is not None:
            self.on_run_complete(self, complete)

    def _mcp_changed(self, info: McpServerInfo) -> None:
        """Tell the clients that an MCP server's state changed (an ``mcp`` agent event)."""
        detail = f": {info.error}" if info.state is McpState.FAILED and info.error else ""
        message = f"MCP server {info.name!r} {info.state.value}{detail}"
        if info.state is McpState.CONNECTED:
            message += f" ({len(info.tools)} tools)"
        self.broker.publish(
            AgentEvent("mcp", text=message, error=info.error, mcp=info), EventKind.CREATED
        )

    def _publish_files_changed(self, event: FilesChanged) -> None:
        self.broker.publish(event, EventKind.CREATED)

    def _publish_message(self, message: Message, kind: EventKind) -> None:
        self.broker.publish(message, kind)

    async def _read_context_files(self, prompts: SystemPrompts) -> None:
        """Read the context files once at opening, so ``GET .../agent`` lists them before the
        first turn (a failure is logged; the turns read them again)."""
        try:
            await prompts.context_files()
        except Exception:
            log.exception("workspace %s: reading the context files failed", self.id)

    async def _set_up_sandbox(self) -> None:
        """Test (once per process) whether a sandbox can run; :meth:`_make_tools` then builds it
        from the current config."""
        self._sandbox_status = await trio.to_thread.run_sync(sandbox_probe)

    def _configure_sandbox(self) -> None:
        """Set :attr:`sandbox` and :attr:`sandbox_info` from ``options.sandbox`` (again after a
        config reload) and the probe's answer."""
        settings = self.config.options.sandbox
        status = self._sandbox_status
        if not settings.enabled:
            off = SandboxInfo(reason=SANDBOX_OFF_REASON)
            if self.sandbox_info != off:
                log.warning("workspace %s: bash sandbox turned off by its config", self.path)
            self.sandbox = None
            self.sandbox_info = off
        elif status is None or status.bwrap is None:
            self.sandbox = None
            self.sandbox_info = SandboxInfo(
                reason=status.reason if status is not None else "the sandbox was not tested yet"
            )
        else:
            self.sandbox = Sandbox(
                bwrap=status.bwrap,
                network=settings.network,
                deny_read=tuple(settings.deny_read),
                read_only_paths=tuple(settings.read_only_paths),
                hidden=self.sandbox_hidden,
                more_hidden=self.sandbox_more_hidden,
            )
            self.sandbox_info = SandboxInfo(active=True, network=settings.network)

    def _tracked_tools(self) -> TrackedTools:
        """The tools, with a snapshot after each call that may write (``files_changed``)."""
        return TrackedTools(self._make_tools(), self.changes)

    def _make_tools(self) -> Toolbox:
        options = self.config.options
        self._configure_sandbox()
        self.jobs.configure(options.jobs)
        return Toolbox(
            workspace=self.path,
            data_dir=self.data_dir,
            permissions=self.permissions,
            timeout=options.tool_timeout,
            bash_output_limit=options.bash_output_limit,
            sandbox=self.sandbox,
            hidden=(
                HiddenPaths.of(self.sandbox)
                if self.sandbox is not None
                else HiddenPaths(
                    tuple(options.sandbox.deny_read),
                    self.sandbox_hidden,
                    self.sandbox_more_hidden,
                )
            ),
            mcp=self.mcp,
            publish=self.broker.publish,
            jobs=self.jobs,
            files=self.files,
            fetch=options.fetch,
            todos=self,
        )

    async def _watch_holds(self) -> None:
        while not self._stop.is_set():
            self.holds.expire(trio.current_time())
            if not self.holds.held and self.agent.state.pending_count() == 0:
                return
            deadline = self.holds.next_deadline()
            with trio.move_on_at(deadline if deadline is not None else math.inf):
                await self._changed.wait()
            self._changed = trio.Event()

    async def _close_step(
        self, what: str, step: Callable[[], Awaitable[None]], within: float
    ) -> None:
        with trio.move_on_after(within, shield=True):
            try:
                await step()
            except Fenced as exc:  # a newer owner has the workspace: said in one line
                log.warning("workspace %s: %s at close refused: %s", self.id, what, exc)
            except Exception:
                log.exception("workspace %s: %s at close failed", self.id, what)

    # -- sessions -------------------------------------------------------------------------------

    async def create_session(self, title: str = "") -> Session:
        self.check_open()
        session = Session(new_id(), title=title)
        await self.store.create_session(session)
        self.broker.publish(session, EventKind.CREATED)
        return session

    async def rename_session(self, session_id: str, title: str) -> Session | None:
        # The title alone: a running turn's usage may be recorded at the same moment.
        session = await self.store.set_title(session_id, title)
        if session is None:
            return None
        self.decorate(session)
        self.broker.publish(session, EventKind.UPDATED)
        return session

    async def set_todos(self, session_id: str, todos: list[wire.Todo]) -> Session | None:
        """Save a session's todo list (the ``todos`` tool) and publish the session (lossy
        ``session`` ``updated``); None when the session does not exist."""
        session = await self.store.set_todos(session_id, todos)
        if session is None:
            return None
        self.decorate(session)
        self.broker.publish(session, EventKind.UPDATED)
        return session

    def decorate(self, session: Session) -> Session:
        session.is_busy = self.agent.is_busy(session.id)
        return session

    async def delete_session(self, session_id: str) -> bool:
        self.agent.cancel(session_id)
        await self.messages.delete_session_messages(session_id)
        session = await self.store.get_session(session_id)
        if session is None:
            return False
        await self.store.delete_session(session_id)
        self.files.forget_session(session_id)
        self.permissions.forget_session(session_id)
        self.broker.publish(session, EventKind.DELETED)
        return True


class LoggedTerminals:
    """A cluster's once-only terminal records for the agent (``core.ports.Terminals``): a
    run's ``run_complete`` is recorded with its final status before it is published, and marked
    logged once the event log holds it, so a node that takes the workspace over publishes
    exactly the ones that never reached the log."""

    def __init__(self, store: Any, broker: Broker) -> None:
        self.store = store
        self.broker = broker

    async def record(self, run: Run, complete: RunComplete) -> bool:
        if not run.status.terminal:
            return True
        recorded: bool = await self.store.record_terminal(run, wire.dumps(complete))
        if recorded and os.environ.get(FAULT_ENV) == FAULT_AFTER_TERMINAL_RECORD:
            # Test hook: die between the terminal commit and the log append.
            os.kill(os.getpid(), signal.SIGKILL)
        return recorded

    async def logged(self, run_id: str, event: Any) -> None:
        if self.broker.log_lost is None and event.seq <= self.broker.durable_seq:
            await self.store.mark_logged([run_id])
