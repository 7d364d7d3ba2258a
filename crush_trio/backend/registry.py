"""The backend: every open workspace, keyed by real path, and the server's lifetime.

:class:`Backend` owns the nursery in which each :class:`Workspace` serves. It dedups workspaces
by resolved real path (a symlink opens the same workspace), tracks retired clients, and shuts
everything down in stages: refuse new workspaces (503), shut every workspace down, return.
"""

from __future__ import annotations

import collections
import logging
import os
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from ..config import (
    Config,
    LoadedConfig,
    ServerOptions,
    TrustChange,
    WebhookConfig,
    load_config_report,
    set_workspace_trust,
    user_config_file,
)
from ..core.placement import LocalPlacement, Placement, Seat
from ..errors import (
    BadRequest,
    ConfigError,
    Conflict,
    CrushError,
    Fenced,
    NotFound,
    ShuttingDown,
    TooManyRequests,
)
from ..metrics import METRICS
from ..providers.body import read_watch
from ..webhooks import Endpoint, Webhooks, outbox_path
from ..wire import PermissionRequest, RunComplete, validate_client_id
from .workspace import Workspace, data_dir_for

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator, Sequence

log = logging.getLogger(__name__)


class Backend:
    """Every workspace of one server.

    Args:
        server: the server's bounds (``server`` section of the config).
        config_file: ``--config FILE``: when given, the only config file for every workspace.
        data_dir: ``--data-dir``: when given, workspace databases live under it.
        version: the server version reported in ``hello`` frames.
        webhooks: the server's own webhook endpoints (its config's ``webhooks``), POSTed at the
            end of every workspace's runs (docs/webhooks.md).
        outbox: the webhook outbox to use (default: one in ``data_dir``, else in
            :func:`~crush_trio.webhooks.default_outbox_dir`).
        placement: which node serves each workspace (default: :class:`LocalPlacement`, every
            workspace here; a cluster node's in cluster mode, docs/cluster.md).
        secret_paths: more paths the server was started with that no sandboxed command may
            see: the ``--token-file`` and the Unix socket it listens on.
    """

    def _sandbox_hidden(self) -> tuple[Path, ...]:
        """Every path the server was started with, hidden from sandboxed bash commands: its
        data and user config directories, ``--config`` file, webhook outbox (its directory, with
        the database's side files) and secret files, ``--token-file`` and Unix socket."""
        config_dir = user_config_file(user_config_dir=self.user_config_dir).parent
        paths = [p for p in (self.data_dir, config_dir, self.config_file) if p is not None]
        paths.append(self.webhooks.path.parent)
        paths += _secret_files(self.webhook_endpoints)
        paths += self.secret_paths
        return tuple(paths)

    def _more_hidden(self) -> list[Path]:
        """The data directories of the open workspaces (each hides the others' from bash), a
        cluster's snapshot directories, and the webhook secret files their configurations name."""
        paths = [ws.data_dir for ws in self.workspaces.values()]
        paths += [ws.changes.data_dir for ws in self.workspaces.values()]  # a cluster's snapshots
        for ws in self.workspaces.values():
            paths += _secret_files(ws.config.webhooks)
        return list(dict.fromkeys(paths))

    def __init__(
        self,
        *,
        server: ServerOptions,
        config_file: Path | None = None,
        data_dir: Path | None = None,
        version: str = "",
        user_config_dir: Path | None = None,
        provider_factory: Any = None,
        webhooks: Sequence[WebhookConfig] = (),
        outbox: Webhooks | None = None,
        placement: Placement | None = None,
        secret_paths: Sequence[Path] = (),
    ) -> None:
        self.server = server
        self.secret_paths = tuple(secret_paths)
        #: Which node serves each workspace: this one (a single server), or a cluster node's
        #: placement (docs/cluster.md).
        self.placement: Placement = placement or LocalPlacement()
        self.config_file = config_file
        self.data_dir = data_dir
        self.version = version
        self.user_config_dir = user_config_dir
        self.provider_factory = provider_factory
        self.workspaces: dict[str, Workspace] = {}
        self._by_path: dict[Path, Workspace] = {}
        self._opening: dict[Path, trio.Event] = {}
        #: Retired client id → when it is forgotten; oldest first (the TTL is the same for all).
        self._retired: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.shutting_down = False
        #: Set when :meth:`running` has ended: every workspace is closed (tests wait on it).
        self.stopped = trio.Event()
        self._nursery: trio.Nursery | None = None
        #: The server's own webhook endpoints (its config's ``webhooks``): every workspace's.
        self.webhook_endpoints = list(webhooks)
        #: The webhook outbox (docs/webhooks.md), run in the backend's nursery.
        self.webhooks = outbox or Webhooks(
            server,
            outbox_path(data_dir),
            resolve=self._webhook_secret,
            version=version,
            save_timeout=server.shutdown_save_timeout,
        )

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Backend]:
        """Own the workspaces' nursery for the duration of the block; shut down on exit. The
        providers' read watch (one task timing their stream reads) runs around it."""
        async with read_watch(), trio.open_nursery() as nursery:
            await nursery.start(self.webhooks.run)
            self._nursery = nursery
            try:
                yield self
            finally:
                with trio.move_on_after(self.shutdown_bound(), shield=True):
                    await self.shutdown()
                nursery.cancel_scope.cancel()
        self.stopped.set()

    def shutdown_bound(self) -> float:
        """Upper bound on a full shutdown: the run grace plus the final saves, with slack."""
        return self.server.shutdown_grace + 4 * self.server.shutdown_save_timeout + 5

    # -- workspaces -----------------------------------------------------------------------------

    def get(self, workspace_id: str) -> Workspace:
        ws = self.workspaces.get(workspace_id)
        if ws is None:
            raise NotFound(
                f"workspace {workspace_id!r} not found; open it with POST /v1/workspaces "
                "(workspaces close when no client holds them)"
            )
        return ws

    def list(self) -> list[Workspace]:
        return [ws for ws in self.workspaces.values() if not ws.closing]

    async def open(self, raw_path: str, client_id: str) -> Workspace:
        """Open (or join) the workspace of a directory and give ``client_id`` a hold on it.

        In a cluster the node takes the workspace's lease first; when another node owns it,
        :class:`~crush_trio.errors.Moved` (307) or ``OwnerUnavailable`` (503).
        """
        validate_client_id(client_id)
        if self.is_retired(client_id):
            raise Conflict(f"client {client_id} was retired; use a new client_id")
        return await self._open(self._resolve(raw_path), client_id)

    async def locate(
        self, workspace_id: str, target: str, client_id: str | None, *, adopt: bool = True
    ) -> Workspace | None:
        """The workspace ``workspace_id`` when this node has it open; else, in a cluster, open it
        here when no live node holds its lease (for ``client_id``'s hold, or a hold of the
        create grace; with ``adopt`` False: None), or raise ``Moved`` / ``OwnerUnavailable``
        / ``NotFound``; on a single server, None (nothing is open elsewhere)."""
        ws = self.workspaces.get(workspace_id)
        if ws is not None:
            return ws
        path = await self.placement.locate(workspace_id, target)
        if path is None or not adopt:
            return None
        holder = client_id if client_id and not self.is_retired(client_id) else None
        # Without a client of its own, the request's hold is the node's: it lasts the create
        # grace, so the clients that follow find the workspace open.
        return await self._open(Path(path), holder or self.placement.hold_id)

    async def adopt(self, path: str) -> Workspace:
        """Open a workspace whose owner stopped while it had runs, to recover them."""
        return await self._open(Path(path), None)

    async def _open(self, path: Path, client_id: str | None) -> Workspace:
        if self.shutting_down or self._nursery is None:
            raise ShuttingDown("server shutting down: retry against a new server")
        while True:
            ws = self._by_path.get(path)
            if ws is not None and not ws.closing:
                if client_id is not None:
                    ws.open_hold(client_id)
                return ws
            if ws is not None:
                await ws.closed.wait()  # a closing workspace finishes before it reopens
                continue
            pending = self._opening.get(path)
            if pending is None:
                break
            await pending.wait()
        limit = self.server.max_workspaces
        if len(self.workspaces) + len(self._opening) >= limit:
            raise TooManyRequests(
                f"{limit} workspaces are open, the most this server allows "
                "(server.max_workspaces); retry when one has closed (a workspace closes when no "
                "client holds it) or raise server.max_workspaces in the server's config"
            )
        done = self._opening[path] = trio.Event()
        seat: Seat | None = None  # claimed and not yet handed to a serving workspace
        try:
            seat = await self.placement.claim(str(path))
            loaded = await self._load_config(path)
            data_dir = data_dir_for(path, loaded.config, self.data_dir)
            if self.data_dir is None and not loaded.trusted:
                await trio.to_thread.run_sync(
                    _check_data_dir_inside, path, data_dir, loaded.config.options.data_directory
                )
            # In a cluster each node has its own --data-dir, but a workspace's snapshots must
            # be found by whichever node owns it next: they live in the project's own data
            # directory, on the file system the nodes share.
            changes_dir = None
            if seat.shared_snapshots:
                changes_dir = data_dir_for(path, loaded.config, None)
                if not loaded.trusted:
                    await trio.to_thread.run_sync(
                        _check_data_dir_inside,
                        path,
                        changes_dir,
                        loaded.config.options.data_directory,
                    )
            ws = Workspace(
                path=path,
                config=loaded.config,
                server=self.server,
                data_dir=data_dir,
                changes_dir=changes_dir,
                version=self.version,
                provider_factory=self.provider_factory,
                trusted=loaded.trusted,
                warnings=loaded.warnings,
                sandbox_hidden=self._sandbox_hidden(),
                sandbox_more_hidden=self._more_hidden,
                on_run_complete=self._run_completed,
                on_permission_request=self._permission_requested,
                user_context_dir=user_config_file(user_config_dir=self.user_config_dir).parent,
                workspace_id=seat.workspace_id,
                store_factory=seat.store_factory,
                event_log=seat.event_log,
            )
            if self.shutting_down:
                raise ShuttingDown("server shutting down: retry against a new server")
            if client_id is not None:
                ws.open_hold(client_id)  # before it serves, so the hold watcher sees it
            self.placement.hold(seat, ws.lose_lease)
            ws.lease_lost_hook = partial(self.placement.lose, ws.id)
            try:
                await self._nursery.start(self._serve_workspace, ws)
            except CrushError:
                raise
            except OSError as exc:
                raise BadRequest(
                    f"cannot open the data directory {ws.data_dir}: {exc.strerror or exc}; "
                    "check its permissions or set options.data_directory"
                ) from exc
            self._register(ws)
            seat = None
            return ws
        finally:
            del self._opening[path]
            done.set()
            if seat is not None:
                await self.placement.release(seat.workspace_id)

    async def _load_config(self, path: Path) -> LoadedConfig:
        """The workspace's configuration, read in a worker thread (files may be slow or odd)."""
        try:
            return await trio.to_thread.run_sync(
                partial(
                    load_config_report,
                    config_file=self.config_file,
                    workspace=path,
                    user_config_dir=self.user_config_dir,
                ),
                abandon_on_cancel=True,
            )
        except ConfigError as exc:
            raise BadRequest(f"the workspace's configuration is invalid: {exc}") from None

    async def set_trust(self, ws: Workspace, trusted: bool) -> TrustChange:
        """Mark the workspace trusted (or not) in the user's config file, then reload its
        configuration so the change applies from the next turn on.

        Raises:
            Conflict: the server reads only ``--config FILE``, so workspace files are never read.
            BadRequest: the user file cannot be read or written, or the reloaded configuration is
                invalid (the trust change is kept; fix the file named in the message).
        """
        if self.config_file is not None:
            raise Conflict(
                f"the server reads only --config {self.config_file}; workspace config files are "
                "not read, so trusting a workspace changes nothing. Restart the server without "
                "--config to use workspace files"
            )
        ws.check_open()
        try:
            change = await trio.to_thread.run_sync(
                partial(set_workspace_trust, ws.path, trusted, user_config_dir=self.user_config_dir)
            )
        except ConfigError as exc:
            raise BadRequest(f"cannot change the workspace's trust: {exc}") from None
        loaded = await self._load_config(ws.path)
        ws.apply_config(
            loaded.config,
            data_dir=data_dir_for(ws.path, loaded.config, self.data_dir),
            trusted=loaded.trusted,
            warnings=loaded.warnings,
        )
        log.info(
            "workspace %s (%s) is now %s",
            ws.id,
            ws.path,
            "trusted" if change.trusted else "untrusted",
        )
        return change

    # -- webhooks -------------------------------------------------------------------------------

    def _endpoints(self, config: Config, workspace: Path) -> tuple[Endpoint, ...]:
        """The endpoints a run of this workspace is POSTed to: the server's own, then those of
        the workspace's configuration not among them (by URL). An untrusted workspace's own
        file cannot add any: ``webhooks`` is not on its allow-list."""
        found: dict[str, Endpoint] = {}
        for hooks, scope in ((self.webhook_endpoints, ""), (config.webhooks, str(workspace))):
            for hook in hooks:
                if hook.url not in found:
                    found[hook.url] = Endpoint(
                        hook.url, hook.secret.encode(), tuple(hook.events), scope
                    )
        return tuple(found.values())

    def _run_completed(self, ws: Workspace, complete: RunComplete) -> None:
        endpoints = self._endpoints(ws.config, ws.path)
        if endpoints:
            self.webhooks.enqueue(
                complete,
                workspace_id=ws.id,
                workspace_path=str(ws.path),
                endpoints=endpoints,
            )

    def _permission_requested(self, ws: Workspace, request: PermissionRequest) -> None:
        endpoints = self._endpoints(ws.config, ws.path)
        if endpoints:
            self.webhooks.enqueue_permission(
                request,
                workspace_id=ws.id,
                workspace_path=str(ws.path),
                endpoints=endpoints,
            )

    async def _webhook_secret(self, scope: str, url: str) -> bytes | None:
        """The secret of a delivery's endpoint, from the configuration as it is now (a
        delivery loaded after a restart): the server's endpoints, or its workspace's
        configuration (read again when the workspace is not open)."""
        hooks: Sequence[WebhookConfig] = self.webhook_endpoints
        if scope:
            path = Path(scope)
            ws = self._by_path.get(path)
            if ws is not None:
                hooks = [*hooks, *ws.config.webhooks]
            else:
                try:
                    loaded = await self._load_config(path)
                except CrushError as exc:
                    log.warning("webhook endpoint of %s: %s", scope, exc)
                    return None
                hooks = [*hooks, *loaded.config.webhooks]
        for hook in hooks:
            if hook.url == url:
                return hook.secret.encode()
        return None

    async def _serve_workspace(
        self, ws: Workspace, *, task_status: trio.TaskStatus[Workspace] = trio.TASK_STATUS_IGNORED
    ) -> None:
        METRICS.workspaces_open.inc()
        try:
            await ws.serve(task_status=task_status)
        except Exception as exc:
            fenced = _only_fenced(exc)
            if fenced is not None and ws.state.value != "starting":
                # Another node took the workspace over; its writes here were refused.
                log.warning("workspace %s (%s) stopped: %s", ws.id, ws.path, fenced)
                return
            log.exception("workspace %s (%s) crashed", ws.id, ws.path)
            if ws.state.value == "starting":
                raise
        finally:
            METRICS.workspaces_open.dec()
            if self.workspaces.get(ws.id) is ws:
                del self.workspaces[ws.id]
            if self._by_path.get(ws.path) is ws:
                del self._by_path[ws.path]
            await self.placement.release(ws.id)

    def _register(self, ws: Workspace) -> None:
        self.workspaces[ws.id] = ws
        self._by_path[ws.path] = ws

    @staticmethod
    def _resolve(raw_path: str) -> Path:
        if not raw_path:
            raise BadRequest("path is required: the absolute path of a project directory")
        path = Path(raw_path).expanduser()
        if not path.is_absolute():
            raise BadRequest(f"path {raw_path!r} is not absolute; send an absolute directory path")
        try:
            real = path.resolve(strict=True)
        except (OSError, RuntimeError):
            raise BadRequest(
                f"path {raw_path!r} does not exist; create the directory first"
            ) from None
        if not real.is_dir():
            raise BadRequest(f"path {raw_path!r} is not a directory; open a project directory")
        if not os.access(real, os.R_OK | os.X_OK):
            raise BadRequest(f"path {raw_path!r} is not readable by the server")
        return real

    def release(self, workspace_id: str, client_id: str) -> None:
        validate_client_id(client_id)
        self.get(workspace_id).release(client_id)

    def retire(self, client_id: str) -> None:
        """Release every hold of the client; later opens from it get 409.

        A retired id is remembered for ``server.retired_client_ttl`` seconds, and at most
        ``server.max_retired_clients`` of them (the oldest are forgotten first).
        """
        validate_client_id(client_id)
        now = trio.current_time()
        self._expire_retired(now)
        retired = self._retired
        retired.pop(client_id, None)
        if self.server.max_retired_clients > 0:
            retired[client_id] = now + self.server.retired_client_ttl
            while len(retired) > self.server.max_retired_clients:
                retired.popitem(last=False)
        for ws in list(self.workspaces.values()):
            ws.holds.clients.pop(client_id, None)
            ws.poke()

    def is_retired(self, client_id: str) -> bool:
        self._expire_retired(trio.current_time())
        return client_id in self._retired

    def _expire_retired(self, now: float) -> None:
        retired = self._retired
        while retired:
            oldest, until = next(iter(retired.items()))
            if until > now:
                return
            del retired[oldest]

    def is_idle(self) -> bool:
        """Idle as in Crush: no open workspace and no create pending (a busy run keeps its
        workspace from being idle even while it closes)."""
        return not self._opening and not any(
            not ws.closing or ws.agent.is_busy() for ws in self.workspaces.values()
        )

    async def shutdown(self) -> None:
        """Refuse new workspaces (503), shut every workspace down, and wait for them."""
        self.shutting_down = True
        self.placement.stopping = True
        workspaces = list(self.workspaces.values())
        for ws in workspaces:
            ws.request_shutdown()
        for ws in workspaces:
            await ws.closed.wait()


def _secret_files(hooks: Sequence[WebhookConfig]) -> list[Path]:
    """The ``secret_file`` of each webhook endpoint that has one (absolute, ``~`` expanded)."""
    paths = [Path(hook.secret_file).expanduser() for hook in hooks if hook.secret_file]
    return [p for p in paths if p.is_absolute()]


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _only_fenced(exc: BaseException) -> Fenced | None:
    """The first ``Fenced`` when ``exc`` is one, or a group of nothing but ``Fenced`` (and the
    cancellations it caused); None otherwise."""
    leaves = list(_leaves(exc))
    fenced = [e for e in leaves if isinstance(e, Fenced)]
    if fenced and all(isinstance(e, (Fenced, trio.Cancelled)) for e in leaves):
        return fenced[0]
    return None


def _check_data_dir_inside(path: Path, data_dir: Path, configured: str) -> None:
    """An untrusted workspace's relative data directory must really be inside it: a repository
    could ship ``.crush`` as a symlink to another project's data directory. (An absolute one can
    only come from the user's own file.)"""
    if os.path.isabs(os.path.expanduser(configured)):
        return
    real = Path(os.path.realpath(data_dir))
    if real == path or path not in real.parents:
        raise BadRequest(
            f"the workspace's data directory {data_dir} leads to {real}, outside the workspace "
            "(a symlink?); remove it, or mark the workspace trusted (crush-trio trust DIR) if "
            "that is intended"
        )
