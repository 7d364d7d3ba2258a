"""The kernel's floor under the fan-out: ``python -m bench.write_floor [--clients 250]``.

The paced fan-out (W3) writes one small frame per update to each client's TCP socket. This
measures what that write alone costs, without the server: one process accepts ``--clients``
loopback connections and writes a ``--bytes`` frame to each of them in turn, ``--rounds`` times
with a pause between rounds (the publish window), while a child process reads them all, as W3's
client processes do. Prints the writer's CPU time (user and system) per write: on loopback the
system part also carries the receiving side's TCP work, which the sender's call runs. Whatever
the server spends per client and frame above this is its own.
"""

from __future__ import annotations

import argparse
import os
import resource
import selectors
import socket
import time
from typing import Final

#: Pause between rounds (seconds): the server's default publish window.
ROUND_PAUSE: Final = 0.033
#: Bound on the reader's wait for data once the writer is done (seconds).
READ_IDLE: Final = 2.0


def _read_all(port: int, clients: int) -> None:
    """The child: open ``clients`` connections and read them until each is closed."""
    sel = selectors.DefaultSelector()
    for _ in range(clients):
        conn = socket.create_connection(("127.0.0.1", port))
        conn.setblocking(False)
        sel.register(conn, selectors.EVENT_READ)
    while sel.get_map():
        events = sel.select(READ_IDLE)
        if not events:
            break
        for key, _ in events:
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(1 << 16)
            except BlockingIOError:
                continue
            if not data:
                sel.unregister(sock)
                sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.write_floor", description=__doc__)
    parser.add_argument("--clients", type=int, default=250, help="connections written to")
    parser.add_argument("--rounds", type=int, default=200, help="frames written to each")
    parser.add_argument("--bytes", type=int, default=60, help="bytes of each frame")
    args = parser.parse_args()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(args.clients)
    port = server.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the reading child
        server.close()
        _read_all(port, args.clients)
        os._exit(0)
    conns = [server.accept()[0] for _ in range(args.clients)]
    for conn in conns:
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    fds = [conn.fileno() for conn in conns]
    frame = b"x" * args.bytes
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(args.rounds):
        for fd in fds:
            os.write(fd, frame)
        time.sleep(ROUND_PAUSE)
    after = resource.getrusage(resource.RUSAGE_SELF)
    for conn in conns:
        conn.close()
    os.waitpid(pid, 0)
    writes = args.clients * args.rounds
    user = (after.ru_utime - before.ru_utime) / writes * 1e6
    system = (after.ru_stime - before.ru_stime) / writes * 1e6
    print(
        f"{args.clients} connections x {args.rounds} writes of {args.bytes} bytes: "
        f"{user + system:.1f} µs of CPU per write (user {user:.1f}, system {system:.1f})"
    )


if __name__ == "__main__":
    main()
