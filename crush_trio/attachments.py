"""Prompt attachments: checked and bounded when a prompt is accepted, stored as ``binary`` parts
of the user message, and shown to the model as images or as text (docs/protocol.md
"Attachments").

An attachment is an image (``image/png``, ``image/jpeg``, ``image/gif``, ``image/webp``, sent to
the model as an image) or a UTF-8 text file (sent as text, wrapped in a ``<file>`` element that
names it). Anything else is refused at accept time (400), so that a run never fails later on a
file the model cannot read.
"""

from __future__ import annotations

import base64
import binascii
import mimetypes
from pathlib import Path
from typing import Final

from .defaults import (
    DEFAULT_MAX_ATTACHMENT_BYTES,
    DEFAULT_MAX_ATTACHMENTS,
    DEFAULT_MAX_ATTACHMENTS_BYTES,
)
from .errors import BadRequest, TooLarge
from .wire import Attachment, BinaryPart

#: Image types both provider APIs take.
IMAGE_TYPES: Final = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})


def guess_mime_type(name: str, content: bytes) -> str:
    """The MIME type of a file from its name, else ``text/plain`` for UTF-8 content."""
    guessed, _ = mimetypes.guess_type(name)
    if guessed:
        return guessed
    try:
        content.decode("utf-8")
    except UnicodeDecodeError:
        return "application/octet-stream"
    return "text/plain"


def is_image(part: BinaryPart) -> bool:
    return part.mime_type in IMAGE_TYPES


def as_text(part: BinaryPart) -> str:
    """How a text attachment reaches the model: its content in a ``<file>`` element."""
    body = part.content().decode("utf-8", errors="replace")
    return f'<file path="{part.path}">\n{body}\n</file>'


def check_attachments(
    attachments: list[Attachment],
    *,
    max_each: int = DEFAULT_MAX_ATTACHMENT_BYTES,
    max_total: int = DEFAULT_MAX_ATTACHMENTS_BYTES,
    max_count: int = DEFAULT_MAX_ATTACHMENTS,
) -> list[BinaryPart]:
    """Decode and check a prompt's attachments; returns the parts to store.

    Raises:
        BadRequest: too many, content not base64, or a type that is neither an image nor UTF-8
            text.
        TooLarge: one is over ``server.max_attachment_bytes`` or all together are over
            ``server.max_attachments_bytes`` (decoded sizes).
    """
    if len(attachments) > max_count:
        raise BadRequest(
            f"{len(attachments)} attachments, the limit (server.max_attachments) is "
            f"{max_count}; send fewer files with this prompt"
        )
    parts: list[BinaryPart] = []
    total = 0
    for index, attachment in enumerate(attachments):
        where = f"attachments[{index}]"
        name = attachment.file_path or attachment.file_name
        if not name:
            raise BadRequest(f"{where} has no file_name; name the attached file")
        # The base64 text bounds the decoded size: refuse before decoding a huge one.
        if len(attachment.content) * 3 // 4 > max_each + 2:
            raise _too_large_one(where, name, len(attachment.content) * 3 // 4, max_each)
        try:
            content = base64.b64decode(attachment.content, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(
                f"{where}.content is not valid base64; send the file's bytes base64-encoded"
            ) from None
        if len(content) > max_each:
            raise _too_large_one(where, name, len(content), max_each)
        total += len(content)
        if total > max_total:
            raise TooLarge(
                f"attachments too large: together they pass {total} bytes, the limit "
                f"(server.max_attachments_bytes) is {max_total} bytes; send fewer or smaller files"
            )
        mime = (attachment.mime_type or guess_mime_type(name, content)).split(";")[0].strip()
        mime = mime.lower()
        if mime not in IMAGE_TYPES:
            try:
                content.decode("utf-8")
            except UnicodeDecodeError:
                raise BadRequest(
                    f"{where} ({name!r}, {mime}) is neither an image "
                    f"({', '.join(sorted(IMAGE_TYPES))}) nor UTF-8 text; the model cannot "
                    "read it"
                ) from None
            if not mime.startswith("text/"):
                mime = mime if mime.endswith(("json", "xml", "yaml", "toml")) else "text/plain"
        encoded = base64.b64encode(content).decode("ascii")
        parts.append(BinaryPart(path=name, mime_type=mime, data=encoded))
    return parts


def _too_large_one(where: str, name: str, size: int, limit: int) -> TooLarge:
    return TooLarge(
        f"attachment too large: {where} ({name!r}) is {size} bytes, the limit "
        f"(server.max_attachment_bytes) is {limit} bytes; send a smaller file"
    )


def attachment_from_file(path: str | Path) -> Attachment:
    """Read a local file into an :class:`Attachment` (used by ``crush-trio run --attach``)."""
    file = Path(path)
    content = file.read_bytes()
    return Attachment(
        file_name=file.name,
        mime_type=guess_mime_type(file.name, content),
        content=base64.b64encode(content).decode("ascii"),
        file_path=str(file),
    )
