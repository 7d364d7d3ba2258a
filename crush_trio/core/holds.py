"""Client holds on a workspace, as plain logic (PROTOCOL §6 "Client holds").

A client keeps a workspace alive while it has an event stream open, during the *create grace*
after it created or opened the workspace (before its first stream), and during the *detach grace*
after its last stream closed (so a quick reconnect finds the same workspace). A client that
released its hold explicitly (``DELETE /v1/workspaces/{id}?client_id=``) goes away as soon as its
last stream closes. The shell (:class:`~crush_trio.backend.workspace.Workspace`) calls
:meth:`Holds.expire` when :meth:`Holds.next_deadline` passes.

States of one client: ``pending`` (create grace running) → ``attached`` (streams > 0) →
``detached`` (detach grace running) → gone; ``released`` ends it at the last detach.

Deadlines sit in a heap, so :meth:`Holds.expire` and :meth:`Holds.next_deadline` cost
O(log n) per expired or superseded deadline, not a scan of every client: a workspace that many
short-lived clients passed through stays as cheap as one that few did.
"""

from __future__ import annotations

import enum
import heapq

import attrs

from ..errors import IllegalTransition


class HoldState(enum.StrEnum):
    PENDING = "pending"
    ATTACHED = "attached"
    DETACHED = "detached"


#: Allowed phase moves of one client's hold (a second stream keeps it attached; a hold leaves
#: the table by being dropped: expired, released, or detached with no detach grace).
HOLD_TRANSITIONS: dict[HoldState, frozenset[HoldState]] = {
    HoldState.PENDING: frozenset({HoldState.ATTACHED}),
    HoldState.ATTACHED: frozenset({HoldState.ATTACHED, HoldState.DETACHED}),
    HoldState.DETACHED: frozenset({HoldState.ATTACHED}),
}


@attrs.define
class ClientHold:
    client_id: str
    streams: int = 0
    #: The session the client shows (``POST .../current-session``); ``""``: none.
    current_session: str = ""
    deadline: float | None = None
    released: bool = False
    phase: HoldState = HoldState.PENDING

    def move(self, new: HoldState) -> None:
        if new not in HOLD_TRANSITIONS[self.phase]:
            raise IllegalTransition(
                f"hold of client {self.client_id!r} cannot move from {self.phase} to {new}"
            )
        self.phase = new


class Holds:
    """The holds of every client on one workspace."""

    def __init__(self, *, create_grace: float, detach_grace: float) -> None:
        self.create_grace = create_grace
        self.detach_grace = detach_grace
        self.clients: dict[str, ClientHold] = {}
        #: (deadline, client_id); an entry whose hold is gone or has another deadline is stale
        #: and skipped when it comes to the top.
        self._deadlines: list[tuple[float, str]] = []

    def _set_deadline(self, hold: ClientHold, deadline: float | None) -> None:
        hold.deadline = deadline
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, hold.client_id))
            if len(self._deadlines) > 2 * len(self.clients) + 64:
                self._compact()

    def _compact(self) -> None:
        """Drop stale entries (a client that reconnects often pushes one per detach)."""
        self._deadlines = [
            (h.deadline, cid) for cid, h in self.clients.items() if h.deadline is not None
        ]
        heapq.heapify(self._deadlines)

    def _live(self, entry: tuple[float, str]) -> ClientHold | None:
        hold = self.clients.get(entry[1])
        if hold is None or hold.deadline != entry[0]:
            return None
        return hold

    def open(self, client_id: str, now: float) -> None:
        """The client created or opened the workspace: a hold with the create grace."""
        hold = self.clients.get(client_id)
        if hold is None:
            hold = self.clients[client_id] = ClientHold(client_id)
            self._set_deadline(hold, now + self.create_grace)
        elif hold.streams == 0:
            hold.released = False
            self._set_deadline(hold, max(hold.deadline or 0.0, now + self.create_grace))
        else:
            hold.released = False

    def attach(self, client_id: str) -> None:
        """A stream of the client opened (an unknown client gets a hold too)."""
        hold = self.clients.setdefault(client_id, ClientHold(client_id))
        hold.streams += 1
        hold.deadline = None
        hold.move(HoldState.ATTACHED)

    def detach(self, client_id: str, now: float) -> None:
        """A stream of the client closed; the last one starts the detach grace."""
        hold = self.clients.get(client_id)
        if hold is None or hold.streams == 0:
            return  # no stream of this client is open (a detach without an attach)
        hold.streams -= 1
        if hold.streams == 0:
            if hold.released or self.detach_grace <= 0:
                del self.clients[client_id]
            else:
                self._set_deadline(hold, now + self.detach_grace)
                hold.move(HoldState.DETACHED)

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
        gone = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            hold = self._live(entry)
            if hold is not None and hold.streams == 0:
                del self.clients[entry[1]]
                gone.append(entry[1])
        return gone

    def next_deadline(self) -> float | None:
        heap = self._deadlines
        while heap:
            hold = self._live(heap[0])
            if hold is not None and hold.streams == 0:
                return heap[0][0]
            heapq.heappop(heap)
        return None

    @property
    def held(self) -> bool:
        return bool(self.clients)
