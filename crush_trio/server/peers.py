"""Who is on the other end of a Unix-socket connection: never a sandboxed command.

A Unix socket needs no token (its file mode, ``0600``, admits only the server's user), and every
``bash`` command runs as that same user. The sandbox hides the socket's path from commands, and
this check holds even where a command could reach the socket anyway (a path the hidden list
missed, a hard link): a peer in another PID or user namespace than the server's is refused.
Every sandboxed command is in new ones (``bwrap --unshare-all``), and a process in a PID
namespace that is not the server's or below it is reported with PID 0, which is refused too.
A client in a container therefore connects over TCP, with the token.

Linux only (``SO_PEERCRED`` and ``/proc``); elsewhere there is no sandbox and every peer of the
server's user is accepted.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
from typing import Any, Final

__all__ = ["NAMESPACES", "sandboxed_peer"]

#: The namespaces a Unix-socket peer must share with the server.
NAMESPACES: Final = ("pid", "user")

_UCRED: Final = struct.Struct("3i")


#: ``SO_PEERPIDFD`` (Linux 6.5): a pidfd of the peer, so its PID cannot be reused unseen.
SO_PEERPIDFD: Final = getattr(socket, "SO_PEERPIDFD", 77)


def _namespace(pid: int | str, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def _same_namespaces(pid: int) -> bool:
    return all(_namespace(pid, kind) == _namespace("self", kind) for kind in NAMESPACES)


def _pidfd_verdict(sock: Any) -> bool | None:
    """Whether the peer shares the server's namespaces, read through a pidfd of the peer (so a
    peer that exits and whose PID is reused meanwhile is never mistaken for another process);
    None when the kernel has no ``SO_PEERPIDFD``."""
    try:
        pidfd = struct.unpack("i", sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, 4))[0]
    except OSError:
        return None
    try:
        with open(f"/proc/self/fdinfo/{pidfd}", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        pid = int(fields.get("Pid", "-1").strip())
        if pid <= 0 or not _same_namespaces(pid):
            return False
        # Still the same process: its PID was not reused while its namespaces were read.
        signal.pidfd_send_signal(pidfd, 0)
        return True
    except (OSError, ValueError):
        return False
    finally:
        os.close(pidfd)


def sandboxed_peer(sock: Any) -> str | None:
    """Why the peer of the connected Unix socket ``sock`` is refused, or None to accept it.

    Refused: a peer in another PID or user namespace than the server's (a sandboxed command),
    and, on Linux, a peer whose namespaces cannot be read (fail closed).
    """
    if not sys.platform.startswith("linux") or not hasattr(socket, "SO_PEERCRED"):
        return None
    refused = (
        "connections to this Unix socket from another PID or user namespace (such as a "
        "sandboxed command) are refused; connect from the server's own namespaces, or over TCP "
        "with the token"
    )
    verdict = _pidfd_verdict(sock)
    if verdict is not None:
        return None if verdict else refused
    try:
        pid, _uid, _gid = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        if pid <= 0 or not _same_namespaces(pid):
            return refused
    except OSError:
        return refused
    return None
