"""A workspace's HTTP operations, by resource: its sessions and their history, and its agent.

:class:`~crush_trio.client.workspace.WorkspaceClient` is made of these (it adds the prompts and
the event stream): :class:`SessionRequests` (sessions, messages, pages, run records, diffs,
reverts, forks, exports) and :class:`AgentRequests` (providers, the agent's state, summaries,
cancels, queued prompts, permission answers). Each call is one request through the workspace's
:class:`~crush_trio.client.Client`, its answer structured into the wire type.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import wire
from ..defaults import DEFAULT_PAGE
from ..wire import AgentInfo, CatalogProvider, Message, Run, Session, Workspace
from .errors import BadRequest, NotFound

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .link import ServerLink
    from .runs import GrantAction


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
            "(`crush-trio sessions`, or GET .../sessions) to find its id"
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


class WorkspaceRequests:
    """What every group of a workspace's requests shares: the client and the workspace."""

    #: The client the requests go through.
    client: ServerLink
    #: The server's Workspace object (``id``, ``path``, ``data_dir``).
    info: Workspace

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def path(self) -> str:
        return self.info.path

    def _url(self, tail: str) -> str:
        return f"/v1/workspaces/{self.id}{tail}"


class SessionRequests(WorkspaceRequests):
    """A workspace's sessions and their history (docs/client.md)."""

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

    # -- history: pages, diffs, reverts, forks, exports (docs/client.md) -------------------------

    async def sessions_page(
        self, *, limit: int | None = None, before: str | None = None, query: str = ""
    ) -> list[Session]:
        """One page of sessions, newest created first; pass the last id as ``before`` for the
        next page (each session comes once, whatever is created meanwhile)."""
        params = _params(limit=limit, before=before, q=query or None)
        params.setdefault("limit", str(DEFAULT_PAGE))
        data = await self.client.request("GET", self._url("/sessions"), params=params)
        return wire.converter.structure(data, list[Session])

    async def messages_page(
        self,
        session_id: str,
        *,
        limit: int | None = None,
        before: str | None = None,
        after: str | None = None,
    ) -> list[Message]:
        """One page of a session's messages, oldest first: ``after`` the last one read (new
        messages come in later pages), or the ``limit`` ones ``before`` a message."""
        params = _params(limit=limit, before=before, after=after)
        params.setdefault("limit", str(DEFAULT_PAGE))
        url = self._url(f"/sessions/{session_id}/messages")
        data = await self.client.request("GET", url, params=params)
        return wire.converter.structure(data, list[Message])

    async def runs(
        self,
        *,
        status: Sequence[str] = (),
        session_id: str | None = None,
        limit: int | None = None,
        before: str | None = None,
    ) -> list[Run]:
        """One page of run records, newest first, filtered by status and session."""
        params = _params(
            status=",".join(status) or None, session_id=session_id, limit=limit, before=before
        )
        data = await self.client.request("GET", self._url("/runs"), params=params)
        return wire.converter.structure(data, list[Run])

    async def run_diff(self, run_id: str) -> wire.Diff:
        """What one run (or revert) changed: files and unified diff."""
        data = await self.client.request("GET", self._url(f"/runs/{run_id}/diff"))
        return wire.converter.structure(data, wire.Diff)

    async def session_diff(self, session_id: str) -> wire.Diff:
        """What a session's runs changed, together."""
        data = await self.client.request("GET", self._url(f"/sessions/{session_id}/diff"))
        return wire.converter.structure(data, wire.Diff)

    async def revert_run(self, run_id: str, *, force: bool = False) -> wire.RevertResult:
        """Put back the files a run changed as they were before it.

        Raises:
            Conflict: a file changed after the run (the message names them; ``force`` then
                overwrites them), or the session has a run in progress.
        """
        data = await self.client.request(
            "POST", self._url(f"/runs/{run_id}/revert"), json={"force": force}
        )
        return wire.converter.structure(data, wire.RevertResult)

    async def fork_session(
        self, session_id: str, message_id: str, *, revert_files: bool = False
    ) -> wire.ForkResult:
        """A new session with the history up to ``message_id`` (``parent_session_id`` set)."""
        data = await self.client.request(
            "POST",
            self._url(f"/sessions/{session_id}/fork"),
            json={"message_id": message_id, "revert_files": revert_files},
        )
        return wire.converter.structure(data, wire.ForkResult)

    async def export_session(self, session_id: str) -> dict[str, Any]:
        """A session with its messages and runs as one JSON document (``format=json``)."""
        data = await self.client.request(
            "GET", self._url(f"/sessions/{session_id}/export"), params={"format": "json"}
        )
        return dict(data)


class AgentRequests(WorkspaceRequests):
    """A workspace's agent: its providers and state, summaries, cancels, queued prompts, and
    permission answers."""

    # -- agent -----------------------------------------------------------------------------------

    async def providers(self) -> list[CatalogProvider]:
        """The providers of the workspace's configuration and the models each offers
        (``GET .../providers``): what a prompt's ``model`` may name, as ``provider/model``."""
        data = await self.client.request("GET", self._url("/providers"))
        return wire.converter.structure(data, list[CatalogProvider])

    async def agent_info(self) -> AgentInfo:
        data = await self.client.request("GET", self._url("/agent"))
        return wire.converter.structure(data, AgentInfo)

    async def get_run(self, run_id: str) -> Run:
        data = await self.client.request("GET", self._url(f"/runs/{run_id}"))
        return wire.converter.structure(data, Run)

    async def summarize(self, session_id: str) -> Session:
        """Summarize the session now; returns it with ``summary_message_id`` naming the summary.

        Raises:
            Conflict: the session is busy (or the summary was cancelled).
            NotFound: no such session.
        """
        data = await self.client.request(
            "POST", self._url(f"/agent/sessions/{session_id}/summarize")
        )
        return wire.converter.structure(data, Session)

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


def _params(**values: Any) -> dict[str, str]:
    return {k: str(v) for k, v in values.items() if v is not None}
