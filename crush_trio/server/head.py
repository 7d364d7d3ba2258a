"""The request head the dispatcher reads before handing a connection to hypercorn or to the
event websocket: bounded in size and time, and checked for what the parsers behind it would
choke on (each refusal is a :class:`HeadError` the dispatcher answers itself)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final

import trio

if TYPE_CHECKING:
    from collections.abc import Iterable

#: Longest request head read before dispatching (bytes); a longer head is answered 431.
HEAD_LIMIT: Final = 16 * 1024
#: How long a client may take to send its first request head (seconds); then 408.
HEAD_TIMEOUT: Final = 10.0
#: Method, target (visible ASCII) and version of a request line.
_REQUEST_LINE: Final = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+ [\x21-\x7e]+ HTTP/\d\.\d$")
#: Headers whose values wsproto, h11 or the app decode as ASCII/IDNA: printable ASCII only.
_CHECKED_HEADERS: Final = re.compile(rb"^(host|connection|upgrade|sec-websocket-[a-z0-9-]+)$", re.I)
_PRINTABLE: Final = re.compile(rb"^[\t\x20-\x7e]*$")


class HeadError(Exception):
    """A request head the dispatcher answers itself (400, 408 or 431) before closing."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_head(stream: trio.abc.ReceiveStream) -> bytes:
    """Read until the end of the first request head.

    Returns the bytes read (the head and whatever followed it in the same reads), or ``b""`` when
    the client closed before sending anything.

    Raises:
        HeadError: 431 past :data:`HEAD_LIMIT`, 408 after :data:`HEAD_TIMEOUT`. A head cut
            short by EOF is no error: the client is gone, and ``b""`` is returned.
    """
    data = b""
    with trio.move_on_after(HEAD_TIMEOUT) as waiting:
        while b"\r\n\r\n" not in data:
            if len(data) >= HEAD_LIMIT:
                raise HeadError(
                    431,
                    f"request head longer than {HEAD_LIMIT} bytes (HEAD_LIMIT); "
                    "send fewer or shorter headers",
                )
            chunk = await stream.receive_some(HEAD_LIMIT)
            if not chunk:
                return b""
            data += chunk
    if waiting.cancelled_caught:
        raise HeadError(
            408,
            f"request head not complete within {HEAD_TIMEOUT:g} s (HEAD_TIMEOUT); "
            "send the whole head at once",
        )
    if data.find(b"\r\n\r\n") + 4 > HEAD_LIMIT:
        raise HeadError(
            431,
            f"request head longer than {HEAD_LIMIT} bytes (HEAD_LIMIT); "
            "send fewer or shorter headers",
        )
    return data


def check_head(data: bytes) -> None:
    """Check a complete head before any library decodes it.

    Raises:
        HeadError: 400 when the request line is malformed, or a header breaks the rules of
            :func:`check_headers`.
    """
    lines = data[: data.find(b"\r\n\r\n")].split(b"\r\n")
    if not _REQUEST_LINE.match(lines[0]):
        raise HeadError(
            400,
            "malformed request line; send 'METHOD /path HTTP/1.1' in printable ASCII",
        )
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            headers.append((name.strip(), value))
    check_headers(headers)


def check_headers(headers: Iterable[tuple[bytes, bytes]]) -> None:
    """Check the headers that libraries decode as ASCII (see :func:`check_head`).

    Raises:
        HeadError: 400 naming the first of ``Host``, ``Connection``, ``Upgrade`` or
            ``Sec-WebSocket-*`` that holds bytes other than printable ASCII, or a ``Host`` that
            is not a valid host name.
    """
    for name, value in headers:
        if not _CHECKED_HEADERS.match(name):
            continue
        shown = name.decode("ascii", "replace")
        if not _PRINTABLE.match(value):
            raise HeadError(
                400,
                f"header {shown} holds bytes that are not printable ASCII; "
                "send it in ASCII (IDNA-encode host names)",
            )
        if name.lower() == b"host":
            try:  # what the URL router does with it
                value.strip().decode("ascii").lower().encode("idna")
            except UnicodeError:
                raise HeadError(
                    400,
                    f"header {shown} is not a valid host name (a label is empty or longer than "
                    "63 characters); send HOST[:PORT]",
                ) from None
