"""permessage-deflate (RFC 7692) on the event websocket, for the server and the client library.

trio-websocket 0.12 negotiates no extension, but wsproto underneath implements permessage-deflate.
:class:`DeflateConnection` is trio-websocket's connection with two additions: a client offers the
extension in its upgrade request, a server accepts it when (and only when) the client offered it;
and a compressed message that inflates past the connection's size bound closes it with 1009, like
an uncompressed one, instead of being inflated whole first.

The server compresses every frame per connection, with context takeover: an event is encoded once
for all clients (:attr:`crush_trio.broker.Event.ws_frame`), then deflated into each negotiating
client's own LZ77 window, where the envelope of the previous events (the keys, the message and
session ids) makes a ``message_delta`` cost about 20 bytes instead of about 230. Compressing each
event once with ``server_no_context_takeover`` and sharing the compressed bytes keeps the
encode-once property but saves little on small events (measured on a recorded paced run: 22
bytes per reply character against 33 uncompressed and 3.3 with context takeover, at about 5 µs
per frame and client); docs/performance.md has the figures. The window and memory level are kept
small (:data:`SERVER_WINDOW_BITS`, :data:`SERVER_MEM_LEVEL`: about 22 KB of zlib state per
compressing connection) because a server holds one compressor per connection; connection frames
go out uncompressed, so an idle client holds none.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any, Final

from trio_websocket import WebSocketConnection
from trio_websocket._impl import CloseReason as TrioCloseReason
from wsproto.connection import ConnectionState
from wsproto.events import AcceptConnection, CloseConnection, Request
from wsproto.extensions import Extension, PerMessageDeflate
from wsproto.frame_protocol import CloseReason, FrameDecoder, FrameProtocol, Opcode, RsvBits

from ._compat.wsproto import release_handshake

if TYPE_CHECKING:
    from .broker import Event

#: LZ77 window of a connection's compressor (bits; the window is ``2**bits`` bytes). A client's
#: ``server_max_window_bits`` lowers it further.
SERVER_WINDOW_BITS: Final = 11
#: zlib memory level of a connection's compressor (1 to 9; its hash has ``2**(level+7)`` slots).
SERVER_MEM_LEVEL: Final = 4
#: zlib compression level of every compressor.
COMPRESS_LEVEL: Final = 6
#: Events whose frame is larger than this (bytes) go out uncompressed (a frame without RSV1,
#: which RFC 7692 allows on a connection that negotiated the extension): the shared frame,
#: so that one huge event costs one encoding, not one compression per client.
MAX_COMPRESSED_EVENT: Final = 64 * 1024

#: Frames of one connection, not of the workspace (``hello``, ``gap``) go out uncompressed, so a
#: connection that only ever gets those (an idle client) never allocates a compressor.
UNCOMPRESSED_TYPES: Final = frozenset({"hello", "gap"})

#: Close reason of a compressed message that inflates past the connection's bound (1009).
TOO_BIG_REASON: Final = "Exceeded maximum message size: {} bytes (inflated)"

_SYNC_TAIL: Final = b"\x00\x00\xff\xff"


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


class BoundedDeflate(PerMessageDeflate):
    """wsproto's permessage-deflate with a bound on what one received message inflates to, and
    the server's per-connection frame compression (:meth:`frame`).

    Inflation is bounded as it happens: each chunk of a compressed message is inflated to at most
    the bytes left under ``max_message_size`` (plus one), and one byte more closes the connection
    with 1009 (:class:`DeflateConnection`). A deflate bomb therefore never takes more memory than
    the bound.
    """

    def __init__(self, max_message_size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: Bound on the inflated bytes of one received message.
        self.max_message_size = max_message_size
        #: Set when a received message inflated past the bound.
        self.overflowed = False
        self._inflated = 0

    # -- negotiation -----------------------------------------------------------------------------

    def accept(self, offer: str) -> bool | str | None:
        """Accept a client's offer; an offer whose parameters do not parse is declined (the
        connection goes on uncompressed)."""
        try:
            return super().accept(offer)
        except ValueError:
            return None

    # -- receiving -------------------------------------------------------------------------------

    def frame_inbound_payload_data(
        self, proto: FrameDecoder | FrameProtocol, data: bytes
    ) -> bytes | CloseReason:
        if not self._inbound_compressed or not self._inbound_is_compressible:
            return data
        return self._inflate(data)

    def frame_inbound_complete(
        self, proto: FrameDecoder | FrameProtocol, fin: bool
    ) -> bytes | CloseReason | None:
        if not fin:
            return None
        if not self._inbound_is_compressible or not self._inbound_compressed:
            self._inbound_compressed = None
            return None
        data = self._inflate(_SYNC_TAIL)
        self._inflated = 0
        no_takeover = (
            self.server_no_context_takeover if proto.client else self.client_no_context_takeover
        )
        if no_takeover:
            self._decompressor = None
        self._inbound_compressed = None
        return data

    def _inflate(self, data: bytes) -> bytes | CloseReason:
        if self.overflowed:
            return CloseReason.MESSAGE_TOO_BIG
        assert self._decompressor is not None
        room = self.max_message_size - self._inflated
        try:
            out = self._decompressor.decompress(data, room + 1)
        except zlib.error:
            return CloseReason.INVALID_FRAME_PAYLOAD_DATA
        self._inflated += len(out)
        if self._inflated > self.max_message_size or self._decompressor.unconsumed_tail:
            self.overflowed = True
            self._decompressor = None
            return CloseReason.MESSAGE_TOO_BIG
        return out

    # -- sending ---------------------------------------------------------------------------------

    def _new_compressor(self, client: bool) -> Any:
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
        if self._compressor is None and opcode in (Opcode.TEXT, Opcode.BINARY):
            self._compressor = self._new_compressor(proto.client)
        return super().frame_outbound(proto, opcode, rsv, data, fin)

    def frame(self, event: Event) -> bytes:
        """The server's frame of ``event`` on this connection: compressed into the connection's
        window (RSV1 set), or the shared uncompressed frame when it is larger than
        :data:`MAX_COMPRESSED_EVENT` or one of :data:`UNCOMPRESSED_TYPES`. The compressor is
        created on the first compressed frame."""
        shared = event.ws_frame
        if len(shared) > MAX_COMPRESSED_EVENT or event.type in UNCOMPRESSED_TYPES:
            return shared
        if self._compressor is None:
            self._compressor = self._new_compressor(False)
        compressor = self._compressor
        payload = memoryview(shared)[_header_size(len(shared)) :]
        data = compressor.compress(payload) + compressor.flush(zlib.Z_SYNC_FLUSH)
        if self.server_no_context_takeover:
            self._compressor = None
        return frame_header(0xC1, len(data) - 4) + data[:-4]  # FIN, RSV1, text


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
    ``max_message_size``. hypercorn looks the extension class up by name in its module at each
    handshake, so this replaces that name; it is process-wide, and the bound of the server
    started last applies (one server per process outside tests)."""
    from hypercorn.protocol import ws_stream

    HypercornDeflate.bound = max_message_size
    setattr(ws_stream, "PerMessageDeflate", HypercornDeflate)  # noqa: B010 (a module global)


def client_deflate(max_message_size: int) -> BoundedDeflate:
    """A client's offer: the server's window no larger than :data:`SERVER_WINDOW_BITS` (what this
    server uses anyway; it keeps the client's inflater at 2 KiB of window, not 32), received
    messages bounded by ``max_message_size``."""
    return BoundedDeflate(max_message_size, server_max_window_bits=SERVER_WINDOW_BITS)


class DeflateConnection(WebSocketConnection):
    """A trio-websocket connection that negotiates permessage-deflate through ``deflate``
    (None: no extension, exactly trio-websocket's behaviour).

    A client offers it in its upgrade request; a server accepts it only when the client offered
    it (:attr:`compressing` tells afterwards). Built by :mod:`crush_trio.server.ws_trio` and
    :func:`crush_trio.client.transport.open_stream_socket`, since trio-websocket's own
    constructors take no extension.
    """

    def __init__(self, *args: Any, deflate: BoundedDeflate | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deflate = deflate
        request = self._initial_request
        if deflate is not None and request is not None:
            self._initial_request = Request(
                host=request.host,
                target=request.target,
                extensions=[deflate],
                extra_headers=request.extra_headers,
                subprotocols=request.subprotocols,
            )

    @property
    def compressing(self) -> bool:
        """Whether permessage-deflate was negotiated."""
        return self.deflate is not None and self.deflate.enabled()

    async def _accept(
        self, request: Request, subprotocol: str | None, extra_headers: list[tuple[bytes, bytes]]
    ) -> None:
        # trio-websocket's accept, with the extension (wsproto negotiates it against the offer).
        self._subprotocol = subprotocol
        self._path = request.target
        extensions: list[Extension] = [self.deflate] if self.deflate is not None else []
        await self._send(
            AcceptConnection(
                subprotocol=subprotocol, extra_headers=extra_headers, extensions=extensions
            )
        )
        release_handshake(self._wsproto)  # an open connection keeps nothing of its upgrade
        self._open_handshake.set()

    async def _handle_close_connection_event(self, event: CloseConnection) -> None:
        deflate = self.deflate
        if (
            deflate is not None
            and deflate.overflowed
            and self._wsproto.state == ConnectionState.OPEN
        ):
            # Not the peer's close: wsproto stopped parsing at a message that inflated past the
            # bound. Close with 1009 as trio-websocket does for an uncompressed one.
            reason = TOO_BIG_REASON.format(deflate.max_message_size)
            self._close_reason = TrioCloseReason(1009, reason)
            await self._send(CloseConnection(code=1009, reason=reason))
            await self._recv_channel.aclose()
            self._reader_running = False
            return
        await super()._handle_close_connection_event(event)
