"""permessage-deflate (RFC 7692) on the event websocket, for the server and the client library.

trio-websocket 0.12 negotiates no extension, and wsproto's own permessage-deflate inflates a
whole message before anyone can compare its size with a bound. :class:`BoundedDeflate` is the
extension both sides use: wsproto's parameter negotiation (the public ``offer``/``accept``/
``finalize`` of :class:`~wsproto.extensions.PerMessageDeflate`) with its own compression and
inflation on wsproto's public extension hooks, so that a compressed message that inflates past
the connection's size bound stops as it passes the bound (the connection closes with 1009, like
for an uncompressed one) instead of being inflated whole first. Offering and accepting it through
trio-websocket, which has no seam for extensions, is :mod:`crush_trio._compat.trio_websocket`'s
job; making hypercorn's websocket (the ``"asgi"`` transport) use it is
:func:`bound_hypercorn_deflate`'s, through :mod:`crush_trio._compat.hypercorn`.

The server compresses every frame per connection, with context takeover: an event is encoded once
for all clients (:attr:`crush_trio.broker.Event.ws_frame`), then deflated into each negotiating
client's own LZ77 window, where the envelope of the previous events (the keys, the message and
session ids) makes a ``message_delta`` cost about 20 bytes instead of about 230. Connections
whose compressed frames so far were the same events in the same order share one compressor (a
:class:`Lane`): the first of them to send an event compresses it in place, once, and the others
send the same bytes from the lane's log of its last frames; a connection that gets another
compressed event (an event dropped for it, other events replayed on resume) goes on with a new
compressor, alone or with the others that took the same turn. (The SSE gzip streams share their
compression with :class:`Cohort` states instead, which copy a state where connections part: a
gzip member cannot start a new compressor half-way.) A connection's own frames (``hello``,
``gap``, a command's ``reply``) go out uncompressed and leave it in step. A connection that
takes frames of several envelopes (``batch=1``) gets the events of each frame compressed
together as lines, with one flush (:meth:`BoundedDeflate.frame_lines`), in a :class:`LineLane`
of such connections: one whose frame holds whole groups another compressed sends their pieces
joined; one whose frame ends inside such a group leaves the lane. Compressing each
event once with ``server_no_context_takeover`` and sharing the compressed bytes keeps the
encode-once property but saves little on small events (measured on a recorded paced run: 22
bytes per reply character against 33 uncompressed and 3.3 with context takeover, at about 5 µs
per frame and client); docs/performance.md has the figures. The memory level is kept small
(:data:`SERVER_MEM_LEVEL`; with the 32 KiB window of :data:`SERVER_WINDOW_BITS`, about 140 KB of
zlib state per compression state: shared by a cohort, or one connection's own once it has left
it); connection frames go out uncompressed, so an idle client holds none.
"""

from __future__ import annotations

import collections
import weakref
import zlib
from typing import TYPE_CHECKING, Any, ClassVar, Final, Protocol

from wsproto.extensions import PerMessageDeflate
from wsproto.frame_protocol import CloseReason, FrameDecoder, FrameProtocol, Opcode, RsvBits

from ._compat.hypercorn import use_websocket_deflate
from ._compat.trio_websocket import BoundedExtension

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Sequence

    from .broker import Event

#: LZ77 window of a connection's compressor (bits; the window is ``2**bits`` bytes). A client's
#: ``server_max_window_bits`` lowers it further. 32 KiB: a snapshot of a message (or a
#: ``run_complete``) then points back at the previous one; connections that keep up share one
#: compressor (:class:`Cohort`), so the window costs per cohort, not per client.
SERVER_WINDOW_BITS: Final = 15
#: zlib memory level of a connection's compressor (1 to 9; its hash has ``2**(level+7)`` slots).
SERVER_MEM_LEVEL: Final = 4
#: zlib compression level of every compressor.
COMPRESS_LEVEL: Final = 6
#: Events whose frame is larger than this (bytes) go out uncompressed (a frame without RSV1,
#: which RFC 7692 allows on a connection that negotiated the extension): the shared frame,
#: so that one huge event costs one encoding, not one compression per client.
MAX_COMPRESSED_EVENT: Final = 64 * 1024

#: Frames of one connection, not of the workspace (``hello``, ``gap``, a command's ``reply``) go
#: out uncompressed, so a connection that only ever gets those (an idle client) never allocates
#: a compressor, and one that sends commands stays in step with its cohort: a reply compressed
#: into its window would leave it alone at its own state, with a compression of every event
#: after it for itself (and its own ~140 KB of zlib state).
UNCOMPRESSED_TYPES: Final = frozenset({"hello", "gap", "reply"})

#: Close reason of a compressed message that inflates past the connection's bound (1009).
TOO_BIG_REASON: Final = "Exceeded maximum message size: {} bytes (inflated)"

#: Most branches one shared compressor state remembers (connections that got different events
#: after it); a connection whose event is not among them compresses it from a copy of its own.
#: Also the most lanes remembered by their first event (:func:`_start_lane`), per window.
MAX_BRANCHES: Final = 4
#: Frames a websocket compression lane keeps, newest last (:class:`Lane`): a connection up to
#: that many events behind its lane's compressor still sends the lane's bytes.
LANE_LOG: Final = 64
#: ... and at most about this many bytes of them (each event's uncompressed frame, which the log
#: keeps alive, and its compressed one): large snapshots keep fewer.
LANE_LOG_BYTES: Final = 512 * 1024

_SYNC_TAIL: Final = b"\x00\x00\xff\xff"
#: The opcodes whose frames carry message data (compressible; RFC 7692 §6).
_DATA_OPCODES: Final = frozenset({Opcode.TEXT, Opcode.BINARY, Opcode.CONTINUATION})


def frame_header(opcode_byte: int, size: int) -> bytes:
    """The header of one final, unmasked frame (RFC 6455 §5.2)."""
    if size < 126:
        return bytes((opcode_byte, size))
    if size < 1 << 16:
        return bytes((opcode_byte, 126)) + size.to_bytes(2, "big")
    return bytes((opcode_byte, 127)) + size.to_bytes(8, "big")


def _header_size(frame_size: int) -> int:
    """Header bytes of an unmasked frame of ``frame_size`` bytes in all."""
    if frame_size - 2 < 126:
        return 2
    if frame_size - 4 < 1 << 16:
        return 4
    return 10


class Deflater(Protocol):
    """A zlib compressor (what :func:`zlib.compressobj` returns)."""

    def compress(self, data: bytes | memoryview, /) -> bytes: ...

    def flush(self, mode: int = ..., /) -> bytes: ...

    def copy(self) -> Deflater: ...


class Inflater(Protocol):
    """A zlib decompressor (what :func:`zlib.decompressobj` returns)."""

    @property
    def unconsumed_tail(self) -> bytes: ...

    def decompress(self, data: bytes, /, max_length: int = ...) -> bytes: ...


class Cohort:
    """One compressor state shared by every connection that got the same compressed frames, in
    the same order, since it began (with the same window).

    Transport-neutral: a branch is keyed by any hashable ``key`` (an :class:`~crush_trio.broker.
    Event` here; the SSE block's bytes for the gzip event stream, :mod:`crush_trio.server.
    sse_gzip`), and a subclass says how one unit is compressed and framed (:meth:`_compress`).

    :meth:`send` is the frame of an event after this state and the state after it: computed once
    (from a copy of this state's compressor, which stays as it is for the connections still
    here) and remembered as a branch, so that the other connections here get the same bytes and
    the same next state. A branch holds its next state weakly: a state lives as long as some
    connection is at it, and a connection that arrives at a branch whose state has gone (every
    connection there moved on) computes its own. So connections that keep up move together and
    cost one compression per event; one that falls behind ends up alone, as with a compressor of
    its own.

    A subclass may keep the last :attr:`KEEP_BEHIND` states of a lineage (the states that grew
    from one first branch) alive after their connections moved on, so that one up to that many
    units behind (its writer busy, its socket full) still finds its next state and stays in the
    cohort; a connection alone at its state then compresses in place only once no other has
    followed it for that many units (:class:`Lineage`).
    """

    #: States of a lineage kept alive behind its connections (0: none, every branch is weak).
    KEEP_BEHIND: ClassVar[int] = 0

    __slots__ = (
        "__weakref__",
        "branches",
        "deflater",
        "first",
        "lineage",
        "members",
        "pos",
        "private",
        "takeover",
    )

    def __init__(self, deflater: Deflater, *, takeover: bool = True, first: bool = False) -> None:
        self.deflater = deflater
        #: False: every frame is compressed from this state (``server_no_context_takeover``),
        #: which then stays the state after it.
        self.takeover = takeover
        #: A first state (:func:`first_state`): shared by every new connection, never private.
        self.first = first
        #: Connections at this state (:meth:`BoundedDeflate.frame` and ``release`` count them).
        self.members = 0
        #: Only one connection is here and no other can arrive: it compresses in place.
        self.private = False
        #: Key -> (its frame after this state, the state after it); at most MAX_BRANCHES.
        self.branches: dict[Hashable, tuple[bytes, weakref.ref[Cohort]]] = {}
        #: The lineage this state belongs to (None: :attr:`KEEP_BEHIND` is 0, or a first state).
        self.lineage: Lineage | None = None
        #: Units sent in the lineage before this state.
        self.pos = 0

    def send(self, event: Hashable, shared: bytes) -> tuple[bytes, Cohort]:
        """The compressed frame (for a websocket: RSV1 set) of ``event``, whose uncompressed
        frame is ``shared``, after this state; and the state after it (this one, changed in
        place, when it is private). ``event`` is the branch's key: two calls with equal keys
        must have equal ``shared``."""
        if self.private:
            return self._compress(self.deflater, shared), self
        branches = self.branches
        branch = branches.get(event)
        lineage = self.lineage
        if branch is not None:
            after = branch[1]()
            if after is not None and not after.private:
                if lineage is not None:
                    lineage.joined = after.pos  # another connection follows this line
                return branch[0], after
        if (
            self.members == 1
            and self.takeover
            and not self.first
            and (lineage is None or self.pos - lineage.joined > self.KEEP_BEHIND)
        ):
            # Alone here: no copy; whoever was behind finds this state gone (private).
            self.private = True
            branches.clear()
            if lineage is not None:
                lineage.recent.clear()  # nobody followed within KEEP_BEHIND units
            return self._compress(self.deflater, shared), self
        deflater = self.deflater.copy()
        frame = self._compress(deflater, shared)
        after = self
        if self.takeover:
            after = type(self)(deflater)
            if self.KEEP_BEHIND:
                if lineage is None:  # a first branch: a new lineage
                    lineage = Lineage(self.KEEP_BEHIND)
                after.lineage = lineage
                after.pos = self.pos + 1
                lineage.recent.append(after)
        if len(branches) >= MAX_BRANCHES:
            del branches[next(iter(branches))]  # the oldest
        branches[event] = (frame, weakref.ref(after))
        return frame, after

    @staticmethod
    def _compress(deflater: Deflater, shared: bytes) -> bytes:
        """One frame compressed after ``deflater``'s state (which it advances): here a
        permessage-deflate text frame from the uncompressed frame ``shared``."""
        data = deflater.compress(memoryview(shared)[_header_size(len(shared)) :])
        data += deflater.flush(zlib.Z_SYNC_FLUSH)
        return frame_header(0xC1, len(data) - 4) + data[:-4]  # FIN, RSV1, text


class Lineage:
    """The states that grew from one first branch (see :attr:`Cohort.KEEP_BEHIND`): the last of
    them, held alive, and where a second connection last followed."""

    __slots__ = ("joined", "recent")

    def __init__(self, keep: int) -> None:
        #: The newest states, oldest first (held alive for the connections behind).
        self.recent: collections.deque[Cohort] = collections.deque(maxlen=keep + 1)
        #: :attr:`Cohort.pos` of the last state a connection reached by an existing branch.
        self.joined = 0


class Lane:
    """One websocket compressor shared by the connections that were sent the same compressed
    events in the same order, advanced in place, with the frames of its last :data:`LANE_LOG`
    events.

    A connection is at a position in a lane (:meth:`BoundedDeflate.frame`). One at the lane's
    head compresses its event in place and logs the frame; one behind it, whose event is the
    one the lane logged at its position, sends the logged bytes; any other (it missed an
    event, got one of its own, or fell further behind than the log) starts a lane of its own
    from a new compressor. A new compressor is valid at any point of a connection: it points
    back at nothing the client's window does not hold, and RFC 7692 lets a sender reference
    as little of the window as it likes. So the connections that keep together cost one
    compression per event and no copy of the compressor, which :class:`Cohort` pays for each
    event that more than one connection at a state receives (a copy of about 140 KB of zlib
    state costs several times a small event's compression).
    """

    __slots__ = ("__weakref__", "deflater", "frames", "head", "keys", "logged_bytes", "sizes")

    def __init__(self, window_bits: int) -> None:
        self.deflater: Deflater = zlib.compressobj(
            COMPRESS_LEVEL, zlib.DEFLATED, -window_bits, SERVER_MEM_LEVEL
        )
        #: Events compressed so far.
        self.head = 0
        #: The last events compressed (compared by identity: one object per published event)
        #: and their frames.
        self.keys: collections.deque[object] = collections.deque()
        self.frames: collections.deque[bytes] = collections.deque()
        #: Bytes of each logged event (uncompressed and compressed frames), and their sum.
        self.sizes: collections.deque[int] = collections.deque()
        self.logged_bytes = 0

    def add(self, event: object, shared: bytes) -> bytes:
        """Compress ``event`` (uncompressed frame ``shared``) at the head; its frame."""
        frame = Cohort._compress(self.deflater, shared)
        return self._log(event, frame, len(shared) + len(frame))

    def _log(self, event: object, frame: bytes, size: int) -> bytes:
        self.keys.append(event)
        self.frames.append(frame)
        self.sizes.append(size)
        self.logged_bytes += size
        while len(self.keys) > LANE_LOG or (
            self.logged_bytes > LANE_LOG_BYTES and len(self.keys) > 1
        ):
            self.keys.popleft()
            self.frames.popleft()
            self.logged_bytes -= self.sizes.popleft()
        self.head += 1
        return frame

    def logged(self, pos: int, event: object) -> bytes | None:
        """The frame this lane sent as its event number ``pos`` when that was ``event`` and
        the frame is still logged; else None."""
        back = self.head - pos
        if 0 < back <= len(self.keys) and self.keys[-back] is event:
            return self.frames[-back]
        return None


#: Lanes by the event they started with, newest last, per window bits: connections whose first
#: compressed event (on connecting, or after leaving their lane) is the same share a lane.
_LANE_STARTS: dict[int, collections.OrderedDict[Hashable, weakref.ref[Lane]]] = {}


def _start_lane(event: Event, shared: bytes, window_bits: int) -> tuple[Lane, bytes]:
    """A lane whose first event is ``event``, and its frame: one that started with it and
    still logs it, else a new one."""
    starts = _LANE_STARTS.setdefault(window_bits, collections.OrderedDict())
    ref = starts.get(event)
    lane = ref() if ref is not None else None
    if lane is not None:
        frame = lane.logged(0, event)
        if frame is not None:
            return lane, frame
    lane = Lane(window_bits)
    frame = lane.add(event, shared)
    _remember_start(starts, event, lane)
    return lane, frame


def _remember_start(
    starts: collections.OrderedDict[Hashable, weakref.ref[Any]], event: Event, lane: object
) -> None:
    starts[event] = weakref.ref(lane)
    starts.move_to_end(event)
    while len(starts) > MAX_BRANCHES:
        starts.popitem(last=False)


class LineLane:
    """One websocket compressor shared by the connections that take batches (``batch=1``) and
    were sent the same events in the same order, with the pieces of its last :data:`LANE_LOG`
    groups (:meth:`BoundedDeflate.frame_lines`).

    The connection at the lane's head compresses the events of its frame as one piece: their
    lines (each envelope and a newline) and one sync flush. A flush per event would cost about
    twice the CPU and a third more bytes (each flush ends a deflate block, and each block
    starts its codes anew). A connection behind the head sends the logged pieces of the groups
    at its position, several in one frame when its frame holds them all (pieces end on a byte
    boundary, so they join). One whose frame ends inside a logged group (its events came in
    other frames) cannot use that piece and starts a lane of its own, as does one that missed
    an event or got one of its own: a new compressor is valid at any point of a connection.
    """

    __slots__ = ("__weakref__", "deflater", "groups", "head", "logged_bytes", "starts")

    def __init__(self, window_bits: int) -> None:
        self.deflater: Deflater = zlib.compressobj(
            COMPRESS_LEVEL, zlib.DEFLATED, -window_bits, SERVER_MEM_LEVEL
        )
        #: Events compressed so far.
        self.head = 0
        #: The logged groups by the position of their first event: their events (compared by
        #: identity: one object per published event) and their piece.
        self.starts: dict[int, tuple[tuple[Event, ...], bytes]] = {}
        #: The logged groups' positions and bytes (their lines and piece), oldest first.
        self.groups: collections.deque[tuple[int, int]] = collections.deque()
        self.logged_bytes = 0

    def add(self, events: Sequence[Event]) -> bytes:
        """Compress ``events`` as one group at the head; its piece, ending with the flush."""
        data = "".join([event.text + "\n" for event in events]).encode()
        piece = self.deflater.compress(data) + self.deflater.flush(zlib.Z_SYNC_FLUSH)
        start = self.head
        self.starts[start] = (tuple(events), piece)
        size = len(data) + len(piece)
        self.groups.append((start, size))
        self.logged_bytes += size
        self.head = start + len(events)
        while len(self.groups) > LANE_LOG or (
            self.logged_bytes > LANE_LOG_BYTES and len(self.groups) > 1
        ):
            old, old_size = self.groups.popleft()
            del self.starts[old]
            self.logged_bytes -= old_size
        return piece

    def logged(self, pos: int, events: Sequence[Event], i: int) -> tuple[bytes, int] | None:
        """The piece of the group logged at ``pos`` and its length in events, when it is the
        next events of ``events`` from index ``i`` on; else None."""
        entry = self.starts.get(pos)
        if entry is None:
            return None
        group, piece = entry
        n = len(group)
        if n > len(events) - i:
            return None
        for k in range(n):
            if group[k] is not events[i + k]:
                return None
        return piece, n


#: Line lanes by the event they started with, per window bits (as :data:`_LANE_STARTS`).
_LINE_LANE_STARTS: dict[int, collections.OrderedDict[Hashable, weakref.ref[LineLane]]] = {}


def _start_line_lane(
    events: Sequence[Event], i: int, window_bits: int
) -> tuple[LineLane, bytes, int]:
    """A line lane whose first events are ``events[i:]``: one that started with them and still
    logs its first group, else a new one; with the piece of its first group and the group's
    length in events."""
    starts = _LINE_LANE_STARTS.setdefault(window_bits, collections.OrderedDict())
    first = events[i]
    ref = starts.get(first)
    lane = ref() if ref is not None else None
    if lane is not None:
        hit = lane.logged(0, events, i)
        if hit is not None:
            return lane, *hit
    lane = LineLane(window_bits)
    piece = lane.add(events[i:] if i else events)
    _remember_start(starts, first, lane)
    return lane, piece, len(events) - i


#: The state every connection's compression starts from, by window bits and context takeover.
_FIRST_STATES: dict[tuple[int, bool], Cohort] = {}


def first_state(window_bits: int, *, takeover: bool = True) -> Cohort:
    """The shared initial compressor state of a connection whose window is ``window_bits``
    (``takeover`` False: ``server_no_context_takeover``, every frame starts from it)."""
    state = _FIRST_STATES.get((window_bits, takeover))
    if state is None:
        deflater = zlib.compressobj(COMPRESS_LEVEL, zlib.DEFLATED, -window_bits, SERVER_MEM_LEVEL)
        state = Cohort(deflater, takeover=takeover, first=True)
        _FIRST_STATES[window_bits, takeover] = state
    return state


class BoundedDeflate(PerMessageDeflate, BoundedExtension):
    """permessage-deflate with a bound on what one received message inflates to, and the
    server's per-connection frame compression (:meth:`frame`).

    The parameters are negotiated by wsproto's :class:`~wsproto.extensions.PerMessageDeflate`
    (its public ``offer``, ``accept``, ``finalize`` and window and takeover attributes); the
    frames are compressed and inflated here, on wsproto's public extension hooks, with this
    class's own zlib objects.

    Inflation is bounded as it happens: each chunk of a compressed message is inflated to at most
    the bytes left under ``max_message_size`` (plus one), and one byte more closes the connection
    with 1009 (:mod:`crush_trio._compat.trio_websocket`). A deflate bomb therefore never takes
    more memory than the bound.
    """

    def __init__(self, max_message_size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: Bound on the inflated bytes of one received message.
        self.max_message_size = max_message_size
        #: Set when a received message inflated past the bound (the connection then closes with
        #: 1009 and :attr:`too_big_reason`).
        self.overflowed = False
        self._inflated = 0
        #: The connection's zlib compressor of wsproto's path (:meth:`frame_outbound`), created
        #: with its first compressed frame.
        self._deflater: Deflater | None = None
        #: Where the server's compression of this connection is (:meth:`frame`): with context
        #: takeover its lane and its position in it, else the state shared by every frame; None
        #: before the first.
        self._lane: Lane | None = None
        #: ... or, for a connection that takes batches, its line lane (:meth:`frame_lines`).
        self._line_lane: LineLane | None = None
        self._pos = 0
        self._cohort: Cohort | None = None
        #: The connection's zlib decompressor, created with its first compressed message.
        self._inflater: Inflater | None = None
        #: Whether the frame being received carries message data.
        self._frame_is_data = False
        #: Whether the message being received is compressed (None between messages: only the
        #: first frame of a message says, with RSV1).
        self._message_compressed: bool | None = None

    @property
    def too_big_reason(self) -> str:
        """The close reason of a message that inflated past the bound."""
        return TOO_BIG_REASON.format(self.max_message_size)

    # -- negotiation -----------------------------------------------------------------------------

    def accept(self, offer: str) -> bool | str | None:
        """Accept a client's offer; an offer whose parameters do not parse is declined (the
        connection goes on uncompressed)."""
        try:
            return super().accept(offer)
        except ValueError:
            return None

    # -- receiving -------------------------------------------------------------------------------

    def frame_inbound_header(
        self,
        proto: FrameDecoder | FrameProtocol,
        opcode: Opcode,
        rsv: RsvBits,
        payload_length: int,
    ) -> CloseReason | RsvBits:
        if rsv.rsv1 and (opcode.iscontrol() or opcode is Opcode.CONTINUATION):
            return CloseReason.PROTOCOL_ERROR
        self._frame_is_data = opcode in _DATA_OPCODES
        if self._message_compressed is None:
            self._message_compressed = rsv.rsv1
            if rsv.rsv1 and self._inflater is None:
                bits = self.server_max_window_bits if proto.client else self.client_max_window_bits
                self._inflater = zlib.decompressobj(-bits)
        return RsvBits(True, False, False)

    def frame_inbound_payload_data(
        self, proto: FrameDecoder | FrameProtocol, data: bytes
    ) -> bytes | CloseReason:
        if not self._message_compressed or not self._frame_is_data:
            return data
        return self._inflate(data)

    def frame_inbound_complete(
        self, proto: FrameDecoder | FrameProtocol, fin: bool
    ) -> bytes | CloseReason | None:
        if not fin:
            return None
        if not self._frame_is_data or not self._message_compressed:
            self._message_compressed = None
            return None
        data = self._inflate(_SYNC_TAIL)
        self._inflated = 0
        no_takeover = (
            self.server_no_context_takeover if proto.client else self.client_no_context_takeover
        )
        if no_takeover:
            self._inflater = None
        self._message_compressed = None
        return data

    def _inflate(self, data: bytes) -> bytes | CloseReason:
        if self.overflowed:
            return CloseReason.MESSAGE_TOO_BIG
        inflater = self._inflater
        assert inflater is not None
        room = self.max_message_size - self._inflated
        try:
            out = inflater.decompress(data, room + 1)
        except zlib.error:
            return CloseReason.INVALID_FRAME_PAYLOAD_DATA
        self._inflated += len(out)
        if self._inflated > self.max_message_size or inflater.unconsumed_tail:
            self.overflowed = True
            self._inflater = None
            return CloseReason.MESSAGE_TOO_BIG
        return out

    # -- sending ---------------------------------------------------------------------------------

    def _new_compressor(self, client: bool) -> Deflater:
        bits = self.client_max_window_bits if client else self.server_max_window_bits
        return zlib.compressobj(
            COMPRESS_LEVEL, zlib.DEFLATED, -min(bits, SERVER_WINDOW_BITS), SERVER_MEM_LEVEL
        )

    def frame_outbound(
        self,
        proto: FrameDecoder | FrameProtocol,
        opcode: Opcode,
        rsv: RsvBits,
        data: bytes,
        fin: bool,
    ) -> tuple[RsvBits, bytes]:
        if opcode not in _DATA_OPCODES:
            return rsv, data
        if opcode is not Opcode.CONTINUATION:
            rsv = RsvBits(True, rsv.rsv2, rsv.rsv3)
        if self._deflater is None:
            self._deflater = self._new_compressor(proto.client)
        deflater = self._deflater
        out = deflater.compress(data)
        if fin:
            out = (out + deflater.flush(zlib.Z_SYNC_FLUSH))[:-4]
            no_takeover = (
                self.client_no_context_takeover if proto.client else self.server_no_context_takeover
            )
            if no_takeover:
                self._deflater = None
        return rsv, out

    def frame(self, event: Event) -> bytes:
        """The server's frame of ``event`` on this connection: compressed into the connection's
        window (RSV1 set), or the shared uncompressed frame when it is larger than
        :data:`MAX_COMPRESSED_EVENT` or one of :data:`UNCOMPRESSED_TYPES`. The compression
        is shared with the connections that got the same frames: a :class:`Lane` with context
        takeover, else the one state every frame starts from (:class:`Cohort`)."""
        shared = event.ws_frame
        if len(shared) > MAX_COMPRESSED_EVENT or event.type in UNCOMPRESSED_TYPES:
            return shared
        if not self.server_no_context_takeover:
            lane, pos = self._lane, self._pos
            if lane is not None:
                self._pos = pos + 1
                if pos == lane.head:
                    return lane.add(event, shared)
                frame = lane.logged(pos, event)
                if frame is not None:
                    return frame
            bits = min(self.server_max_window_bits, SERVER_WINDOW_BITS)
            self._lane, frame = _start_lane(event, shared, bits)
            self._pos = 1
            return frame
        cohort = self._cohort
        if cohort is None:
            cohort = self._cohort = first_state(
                min(self.server_max_window_bits, SERVER_WINDOW_BITS), takeover=False
            )
            cohort.members += 1
        frame, after = cohort.send(event, shared)
        if after is not cohort:
            cohort.members -= 1
            after.members += 1
            self._cohort = after
        return frame

    def frame_lines(self, events: Sequence[Event]) -> bytes:
        """One compressed message carrying ``events`` as lines (each envelope and a newline),
        for a connection that takes batches (``batch=1``) with context takeover.

        The events are compressed into the connection's :class:`LineLane` as one group with
        one sync flush, or sent as the pieces the lane logged for them when another connection
        compressed them first; the message is the pieces joined (the last flush's tail taken
        off, RFC 7692 §7.2.1). Every compressed event of such a connection goes through here,
        a lone one too."""
        pieces = []
        i, n = 0, len(events)
        while i < n:
            lane, pos = self._line_lane, self._pos
            if lane is not None:
                if pos == lane.head:
                    pieces.append(lane.add(events[i:] if i else events))
                    self._pos = lane.head
                    break
                hit = lane.logged(pos, events, i)
                if hit is not None:
                    piece, k = hit
                    pieces.append(piece)
                    self._pos = pos + k
                    i += k
                    continue
            bits = min(self.server_max_window_bits, SERVER_WINDOW_BITS)
            self._line_lane, piece, k = _start_line_lane(events, i, bits)
            pieces.append(piece)
            self._pos = k
            i += k
        data = b"".join(pieces)[:-4]
        return frame_header(0xC1, len(data)) + data  # FIN, RSV1, text

    def frame_group(
        self, group: Sequence[Event], batch: Callable[[tuple[Event, ...]], Event]
    ) -> bytes:
        """The frame of a group of events (:func:`~crush_trio.broker.batch_groups`) on a
        connection that takes batches: a connection's own frame or a too large event as
        :meth:`frame` sends it; else the group's lines (:meth:`frame_lines`), or, without
        context takeover, its batch frame (``batch``: the shared one) compressed as
        :meth:`frame` does."""
        first = group[0]
        if len(group) == 1 and (
            first.type in UNCOMPRESSED_TYPES or first.size + 1 > MAX_COMPRESSED_EVENT
        ):
            return self.frame(first)
        if self.server_no_context_takeover:
            return self.frame(first if len(group) == 1 else batch(tuple(group)))
        return self.frame_lines(group)

    def release(self) -> None:
        """The connection is over: it leaves its compression state (:meth:`frame`)."""
        self._lane = None
        self._line_lane = None
        cohort, self._cohort = self._cohort, None
        if cohort is not None:
            cohort.members -= 1


class HypercornDeflate(BoundedDeflate):
    """The bounded inflater for hypercorn's websocket (the ``"asgi"`` transport).

    hypercorn negotiates wsproto's permessage-deflate, which inflates a whole message before
    hypercorn compares its size with ``websocket_max_message_size``: a small deflate bomb would
    take gigabytes first. :func:`bound_hypercorn_deflate` makes hypercorn build this class
    instead, so an inflated message past :attr:`bound` closes with 1009 as it inflates.
    """

    #: Bound on one inflated message (``server.max_body_bytes`` of the server started last).
    bound: int = 4 * 1024 * 1024

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(self.bound, **kwargs)


def bound_hypercorn_deflate(max_message_size: int) -> None:
    """Make hypercorn's websocket handshake offer :class:`HypercornDeflate`, bounded by
    ``max_message_size``. hypercorn has no setting for its websocket extensions, so this goes
    through its adapter (:func:`crush_trio._compat.hypercorn.use_websocket_deflate`); it is
    process-wide, and the bound of the server started last applies (one server per process
    outside tests)."""
    HypercornDeflate.bound = max_message_size
    use_websocket_deflate(HypercornDeflate)


def client_deflate(max_message_size: int) -> BoundedDeflate:
    """A client's offer: the server's window no larger than :data:`SERVER_WINDOW_BITS` (what this
    server uses anyway), received messages bounded by ``max_message_size``."""
    return BoundedDeflate(max_message_size, server_max_window_bits=SERVER_WINDOW_BITS)
