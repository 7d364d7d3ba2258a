"""What the client library's parts need of the connection to the server: a protocol, so that
the workspace client and its request groups do not import the connection that holds them."""

from __future__ import annotations

from typing import Any, Protocol


class ServerLink(Protocol):
    """What a workspace client needs of its connection to the server
    (:class:`~crush_trio.client.Client` keeps it)."""

    @property
    def url(self) -> str:
        """The server's base URL (``unix:/path`` on a Unix socket)."""
        ...

    @property
    def client_id(self) -> str: ...

    @property
    def unix_path(self) -> str | None: ...

    @property
    def request_timeout(self) -> float: ...

    @property
    def reconnect_timeout(self) -> float: ...

    @property
    def mailbox_size(self) -> int: ...

    @property
    def deltas(self) -> bool:
        """Whether event streams ask for ``message_delta`` events."""
        ...

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> Any:
        """One API request; the decoded JSON answer."""
        ...

    def ws_base_for(self, workspace_id: str) -> str:
        """The websocket base URL that serves ``workspace_id``."""
        ...

    def moved(self, workspace_id: str | None, location: str) -> None:
        """Remember that ``workspace_id`` is served at the origin of ``location``."""
        ...

    def forget_owner(self, workspace_id: str) -> bool:
        """Send ``workspace_id``'s requests to the server again; True when an owner was known."""
        ...

    def auth_headers(self) -> list[tuple[bytes, bytes]]:
        """The websocket handshake's ``Authorization`` header."""
        ...
