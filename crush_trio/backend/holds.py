"""Client holds on a workspace, as plain logic (PROTOCOL §6 "Client holds").

A client keeps a workspace alive while it has an event stream open, during the *create grace*
after it created or opened the workspace (before its first stream), and during the *detach grace*
after its last stream closed (so a quick reconnect finds the same workspace). A client that
released its hold explicitly (``DELETE /v1/workspaces/{id}?client_id=``) goes away as soon as its
last stream closes. The shell (:class:`~crush_trio.backend.workspace.Workspace`) calls
:meth:`Holds.expire` when :meth:`Holds.next_deadline` passes.

States of one client: ``pending`` (create grace running) → ``attached`` (streams > 0) →
``detached`` (detach grace running) → gone; ``released`` ends it at the last detach.
"""

from __future__ import annotations

import enum

import attrs


class HoldState(enum.StrEnum):
    PENDING = "pending"
    ATTACHED = "attached"
    DETACHED = "detached"


@attrs.define
class ClientHold:
    client_id: str
    streams: int = 0
    deadline: float | None = None
    released: bool = False
    phase: HoldState = HoldState.PENDING


class Holds:
    """The holds of every client on one workspace."""

    def __init__(self, *, create_grace: float, detach_grace: float) -> None:
        self.create_grace = create_grace
        self.detach_grace = detach_grace
        self.clients: dict[str, ClientHold] = {}

    def open(self, client_id: str, now: float) -> None:
        """The client created or opened the workspace: a hold with the create grace."""
        hold = self.clients.get(client_id)
        if hold is None:
            self.clients[client_id] = ClientHold(client_id, deadline=now + self.create_grace)
        elif hold.streams == 0:
            hold.released = False
            hold.deadline = max(hold.deadline or 0.0, now + self.create_grace)
        else:
            hold.released = False

    def attach(self, client_id: str) -> None:
        """A stream of the client opened (an unknown client gets a hold too)."""
        hold = self.clients.setdefault(client_id, ClientHold(client_id))
        hold.streams += 1
        hold.deadline = None
        hold.phase = HoldState.ATTACHED

    def detach(self, client_id: str, now: float) -> None:
        """A stream of the client closed; the last one starts the detach grace."""
        hold = self.clients.get(client_id)
        if hold is None:
            return
        hold.streams = max(0, hold.streams - 1)
        if hold.streams == 0:
            if hold.released or self.detach_grace <= 0:
                del self.clients[client_id]
            else:
                hold.deadline = now + self.detach_grace
                hold.phase = HoldState.DETACHED

    def release(self, client_id: str) -> bool:
        """The client let go. Returns False when it held nothing here."""
        hold = self.clients.get(client_id)
        if hold is None:
            return False
        if hold.streams > 0:
            hold.released = True
        else:
            del self.clients[client_id]
        return True

    def expire(self, now: float) -> list[str]:
        """Drop holds whose grace has passed; returns their client ids."""
        gone = [
            cid
            for cid, hold in self.clients.items()
            if hold.streams == 0 and hold.deadline is not None and hold.deadline <= now
        ]
        for cid in gone:
            del self.clients[cid]
        return gone

    def next_deadline(self) -> float | None:
        deadlines = [h.deadline for h in self.clients.values() if h.deadline is not None]
        return min(deadlines) if deadlines else None

    @property
    def held(self) -> bool:
        return bool(self.clients)
