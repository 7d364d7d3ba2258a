"""Who may run a tool: pre-approvals, session grants, and asking every client of the workspace.

Order of checks for one request (docs/tools.md):

1. workspace-wide skip (``POST permissions/skip``) → allowed;
2. ``permissions.allowed_tools`` contains the tool, or ``tool:action`` → allowed;
3. an ``allow_session`` grant for the same session, tool, action and scope → allowed. The scope
   of a call that carries a ``command`` parameter (``bash``) is that exact command string, byte
   for byte, together with whether it runs with the network, so approving ``npm test`` for the
   session approves ``npm test`` again without the network and nothing else (the same command
   with ``network: true`` asks again); the scope of every other call is its real path
   (:func:`grant_scope`);
4. otherwise a must-deliver ``permission_request`` goes to every client and the tool waits until
   one answers (``POST permissions/grant`` or the websocket ``permissions.grant``), the optional
   ``options.permission_timeout`` passes (denied), or the run is cancelled. The first answer wins;
   later ones get ``resolved: false``. Each outcome is reported by one ``permission_notification``.

No lock is held while waiting, so other runs (and other requests) go on.
"""

from __future__ import annotations

import collections
import logging
import math
from typing import TYPE_CHECKING, Any, Final

import attrs
import trio

from .metrics import METRICS
from .wire import EventKind, PermissionNotification, PermissionRequest, new_id

if TYPE_CHECKING:
    from collections.abc import Callable

    from .broker import Broker

log = logging.getLogger(__name__)

#: Bound on publishing a notification from a cleanup path (seconds).
NOTIFY_TIMEOUT: Final = 5.0
#: Most ``allow_session`` grants a workspace keeps (sessions x tools x actions x scopes); past
#: it the oldest grant is forgotten, so its tool call asks again. A deleted session's grants go
#: at once (:meth:`PermissionService.forget_session`).
MAX_SESSION_GRANTS: Final = 4096


@attrs.define(eq=False)
class _Pending:
    request: PermissionRequest
    done: trio.Event = attrs.field(factory=trio.Event)
    resolved: bool = False
    allowed: bool = False


def grant_scope(tool_name: str, params: dict[str, Any], path: str) -> str:
    """What an ``allow_session`` answer approves besides the session, tool and action.

    A call with a ``command`` parameter (``bash``) is scoped to the exact command string and
    to whether it runs with the network: its ``path`` is always the workspace, so a path scope
    would approve every later command, and a grant given for a command without the network must
    not approve the same command with it. Every other call is scoped to its real path.
    """
    command = params.get("command")
    if isinstance(command, str):
        network = "network" if params.get("network") is True else "no-network"
        return f"command:{network}:{command}"
    return f"path:{path}"


class PermissionService:
    """The permission state of one workspace.

    Args:
        broker: where requests and notifications are published (must-deliver).
        allowed_tools: ``permissions.allowed_tools`` from the config.
        timeout: ``options.permission_timeout``: seconds before an unanswered request is denied
            (None: wait until answered or cancelled).
    """

    def __init__(
        self, broker: Broker, *, allowed_tools: list[str], timeout: float | None = None
    ) -> None:
        self.broker = broker
        self.allowed_tools = frozenset(allowed_tools)
        self.timeout = timeout
        self.skip = False
        #: ``allow_session`` answers: (session, tool, action, :func:`grant_scope`), oldest first,
        #: at most :data:`MAX_SESSION_GRANTS`.
        self._grants: collections.OrderedDict[tuple[str, str, str, str], None] = (
            collections.OrderedDict()
        )
        self._pending: dict[str, _Pending] = {}
        #: Told of each request once it is published (the server's ``permission_request``
        #: webhooks); synchronous, and an error in it is logged, never raised.
        self.on_request: Callable[[PermissionRequest], None] | None = None

    def set_skip(self, skip: bool) -> None:
        self.skip = skip

    @property
    def grants(self) -> int:
        """How many ``allow_session`` grants are kept."""
        return len(self._grants)

    def forget_session(self, session_id: str) -> None:
        """Drop the ``allow_session`` grants of a deleted session."""
        for key in [key for key in self._grants if key[0] == session_id]:
            del self._grants[key]

    @property
    def pending(self) -> list[PermissionRequest]:
        return [p.request for p in self._pending.values()]

    def _pre_approved(self, session_id: str, tool_name: str, action: str, scope: str) -> bool:
        return (
            self.skip
            or tool_name in self.allowed_tools
            or f"{tool_name}:{action}" in self.allowed_tools
            or (session_id, tool_name, action, scope) in self._grants
        )

    async def request(
        self,
        *,
        session_id: str,
        tool_call_id: str,
        tool_name: str,
        action: str,
        description: str,
        params: dict[str, Any],
        path: str,
    ) -> bool:
        """Ask whether the tool call may run. True: allowed.

        Raises:
            TimeoutError: ``options.permission_timeout`` passed with no answer (the request is
                reported as denied to every client first).

        Cancellation: a cancelled run stops waiting; the request is withdrawn and reported as
        denied so every client can drop it.
        """
        if self._pre_approved(session_id, tool_name, action, grant_scope(tool_name, params, path)):
            return True
        request = PermissionRequest(
            id=new_id(),
            session_id=session_id,
            tool_call_id=tool_call_id,
            tool_name=tool_name,
            description=description,
            action=action,
            params=params,
            path=path,
        )
        pending = _Pending(request)
        self._pending[request.id] = pending
        METRICS.permissions_pending.inc()
        started, outcome = trio.current_time(), "cancelled"
        try:
            await self.broker.publish_must_deliver(request, EventKind.CREATED)
            if self.on_request is not None:
                try:
                    self.on_request(request)
                except Exception:
                    log.exception("telling of permission request %s failed", request.id)
            limit = self.timeout if self.timeout is not None else math.inf
            with trio.move_on_after(limit):
                await pending.done.wait()
            outcome = "allowed" if pending.allowed else "denied"
            if not pending.resolved:
                log.info("permission request %s timed out; denied", request.id)
                pending.resolved, outcome = True, "timeout"
                await self._notify(pending)
                raise TimeoutError(
                    f"nobody answered the request to {action} with {tool_name} within "
                    f"{self.timeout:g} s (options.permission_timeout)"
                )
            return pending.allowed
        finally:
            self._pending.pop(request.id, None)
            METRICS.permissions_pending.dec()
            METRICS.permission_waits.labels(outcome).observe(trio.current_time() - started)
            if not pending.resolved:
                pending.resolved = True
                with trio.move_on_after(NOTIFY_TIMEOUT, shield=True):
                    await self._notify(pending)

    async def grant(self, permission_id: str, action: str) -> bool:
        """Answer a request; returns False when it was already answered or is unknown."""
        pending = self._pending.get(permission_id)
        if pending is None or pending.resolved:
            return False
        pending.resolved = True
        pending.allowed = action in ("allow", "allow_session")
        if action == "allow_session":
            req = pending.request
            scope = grant_scope(req.tool_name, req.params, req.path)
            self._grants[(req.session_id, req.tool_name, req.action, scope)] = None
            self._grants.move_to_end((req.session_id, req.tool_name, req.action, scope))
            while len(self._grants) > MAX_SESSION_GRANTS:
                self._grants.popitem(last=False)
        pending.done.set()
        await self._notify(pending)
        return True

    async def _notify(self, pending: _Pending) -> None:
        await self.broker.publish_must_deliver(
            PermissionNotification(
                tool_call_id=pending.request.tool_call_id,
                granted=pending.allowed,
                denied=not pending.allowed,
                id=pending.request.id,
            ),
            EventKind.CREATED,
        )
