"""Wire fuzzing: random and mutated bytes against a live server over real TCP.

The server runs in its own process (``tests/fuzz_server.py``), so that a crash shows as what it
is, the process gone, and its memory and descriptors are its own. Each hypothesis example is a
batch of connections. Each connection sends bytes (in random pieces) and then ends one of four
ways:

* ``fin``: half-close and read; the server must close within :data:`ANSWER_BOUND`;
* ``probe``: send ``GET /v1/health`` on the same connection (only after complete, well-framed
  requests); the server must answer it, or close, within :data:`ANSWER_BOUND`;
* ``reset``: ``SO_LINGER`` 0 and close (a TCP reset), at any point of the exchange;
* ``close``: close without reading.

Any answer or close is correct, whatever the status, except a 5xx (or a websocket reply that says
"this is a bug"). After each batch: ``/v1/health`` answers 200 within :data:`HEALTH_BOUND`; the
server's live tasks go back to their idle count within :data:`LEAK_BOUND` (the failure lists
every live task and where it waits); its open descriptors are back at their idle count; its RSS
has grown by less than :data:`RSS_GROWTH_BOUND` since the first batch.

A failure marks the server for a restart, so that hypothesis shrinks each failing input against a
fresh server. CI runs a fixed number of examples with a fixed seed; ``just fuzz`` sets
``CRUSH_TRIO_FUZZ_EXAMPLES`` for a long random run (docs/testing.md, "Wire fuzzing").
"""

from __future__ import annotations

import itertools
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs
import pytest
import trio
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

if TYPE_CHECKING:
    from collections.abc import Iterator

#: ``CRUSH_TRIO_FUZZ_SHRINK=0`` reports the first failing batch as found, without shrinking it.
PHASES: Final = (
    [Phase.explicit, Phase.generate]
    if os.environ.get("CRUSH_TRIO_FUZZ_SHRINK") == "0"
    else [Phase.explicit, Phase.generate, Phase.shrink]
)
ROOT: Final = Path(__file__).resolve().parent.parent

#: Examples per test in the bounded run; ``CRUSH_TRIO_FUZZ_EXAMPLES`` overrides (``just fuzz``).
EXAMPLES: Final = int(os.environ.get("CRUSH_TRIO_FUZZ_EXAMPLES", "0"))
#: A long run draws fresh random inputs; the bounded run is the same on every CI run.
LONG_RUN: Final = EXAMPLES > 0

VERBOSE: Final = os.environ.get("CRUSH_TRIO_FUZZ_VERBOSE") == "1"
#: A complete exchange (after a half-close, or a health request on the same connection) is
#: answered or closed within this many seconds.
ANSWER_BOUND: Final = 5.0
#: How long one send may block (a server that answered early need not read the rest).
SEND_BOUND: Final = 2.0
#: ``/v1/health`` on a new connection answers 200 within this many seconds after each batch.
HEALTH_BOUND: Final = 5.0
#: Every task a batch started ends within this many seconds of the batch's last close. Above the
#: server's own bounds on a connection whose peer has gone (hypercorn's 5 s keep-alive timeout; a
#: closing connection lingers up to 2 s plus a 2 s send bound), below the holds the known-issue
#: flags describe (10 s, 30 s).
LEAK_BOUND: Final = 8.0
#: The server's RSS may grow by at most this much over a whole test module run (bytes).
RSS_GROWTH_BOUND: Final = 96 * 1024 * 1024
#: Known issue, counted instead of failed while True (fixed: False): an event-websocket upgrade
#: that trio-websocket's handshake refuses (e.g. ``Sec-WebSocket-Version: 12``, or a header byte
#: flipped past the head checks) kept its handler task waiting for a handshake that never comes
#: until the endpoint's handshake timeout (10 s), although the peer was gone.
#: ``test_a_refused_upgrade_frees_its_task_at_once`` guards it.
KNOWN_HANDSHAKE_HOLD: Final = False
#: Known issue, avoided while True (fixed: False): a client that sends a request and then all or
#: part of another in the same write, and leaves at once without reading (close or reset), left its
#: connection's task alive in ``HttpConnection`` for 30 s to more than 50 s (timing-dependent).
#: While True, ``pipelined_conn`` ends its connections with a half-close only;
#: ``test_pipelined_requests_then_close_free_their_task`` guards it.
KNOWN_PIPELINED_CLOSE_HOLD: Final = False
#: How long such a hold may last (the endpoint's handshake timeout and a margin).
HANDSHAKE_HOLD_BOUND: Final = 15.0
#: Bound on starting the server process and on each of its commands (seconds).
STARTUP_BOUND: Final = 60.0

HEALTH_REQUEST: Final = b"GET /v1/health HTTP/1.1\r\nHost: {host}\r\n\r\n"
HEALTH_BODY: Final = b'{"status":"ok"}'
#: A 5xx answer is a failure, except 501: HTTP's answer to a transfer coding the server does not
#: implement (RFC 9112 §6.1), which is what h11 sends for ``Transfer-Encoding: gzip, chunked``.
_STATUS_5XX: Final = re.compile(rb"(?:^|\n)HTTP/1\.[01] (5(?!01)\d\d)")
_BUG: Final = b"this is a bug"


# -- the server process -----------------------------------------------------------------------


class ServerProcess:
    """The fuzzed server: started, checked after each batch, restarted after a failure."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}
        self.idle_tasks = 0
        self.idle_fds = 0
        self.first_rss = 0
        self.peak_rss = 0
        self.dirty = False
        self.starts = 0
        self.batches = 0
        self.connections = 0
        self.handshake_holds = 0
        self.peak_growth = 0
        self.rss_seen = 0
        self.log_path = tmp / "server-0.log"

    # process control

    def start(self) -> None:
        self.starts += 1
        root = self.tmp / f"server-{self.starts}"
        root.mkdir()
        self.log_path = root / "server.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.fuzz_server", str(root)],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
            )
        self.info = self._read_line(STARTUP_BOUND)
        self.address = ("127.0.0.1", int(self.info["url"].rsplit(":", 1)[1]))
        self.host = f"127.0.0.1:{self.address[1]}"
        # One health request first, so that the idle counts include whatever it warms up.
        trio.run(self._health)
        settled = self.command({"cmd": "settle", "timeout": STARTUP_BOUND})
        self.idle_tasks = settled["tasks"]
        self.idle_tree = settled["tree"]
        self.idle_fd_targets = self.fd_targets()
        self.idle_fds = len(self.idle_fd_targets)
        self.first_rss = self.peak_rss = 0
        self.dirty = False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        assert proc.stdin is not None
        try:
            proc.stdin.close()
            proc.wait(STARTUP_BOUND)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait(STARTUP_BOUND)
        finally:
            if proc.stdout is not None:
                proc.stdout.close()

    def ensure(self) -> None:
        if self.proc is None or self.proc.poll() is not None or self.dirty:
            self.stop()
            self.start()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def _read_line(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            raise AssertionError(
                f"the server process did not answer within {timeout}s "
                f"(exit code {self.proc.poll()}); its log ends with:\n{self.log_tail()}"
            )
        return dict(json.loads(line))

    def command(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc is not None
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        return self._read_line(STARTUP_BOUND)

    # measurements

    def fds(self) -> int:
        return len(self.fd_targets())

    def fd_targets(self) -> list[str]:
        assert self.proc is not None
        targets = []
        for fd in os.listdir(f"/proc/{self.proc.pid}/fd"):
            try:
                targets.append(os.readlink(f"/proc/{self.proc.pid}/fd/{fd}"))
            except OSError:  # closed meanwhile
                pass
        return targets

    def rss(self) -> int:
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    async def _health(self) -> None:
        request = HEALTH_REQUEST.replace(b"{host}", self.host.encode())
        request = request.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
        data = b""
        with trio.move_on_after(HEALTH_BOUND):
            stream = await trio.open_tcp_stream(*self.address)
            async with stream:
                await stream.send_all(request)
                while HEALTH_BODY not in data:
                    chunk = await stream.receive_some()
                    if not chunk:
                        break
                    data += chunk
        if not data.startswith(b"HTTP/1.1 200") or HEALTH_BODY not in data:
            raise AssertionError(
                f"/v1/health did not answer 200 within {HEALTH_BOUND}s (got {data[:200]!r})"
            )

    # one batch

    def run_batch(self, batch: list[Conn]) -> None:
        """Send ``batch`` and check the server afterwards; raises AssertionError on a failure."""
        self.ensure()
        self.batches += 1
        self.connections += len(batch)
        try:
            self._run_batch(batch)
        except BaseException:
            self.dirty = True
            raise

    def _run_batch(self, batch: list[Conn], *, known: bool = True) -> None:
        assert self.proc is not None
        context = {
            b"{host}": self.host.encode(),
            b"{wid}": str(self.info["wid"]).encode(),
            b"{token}": str(self.info["token"]).encode(),
        }
        failures: list[str] = []

        async def run_all() -> None:
            for index, conn in enumerate(batch):
                started = trio.current_time()
                problem = await exchange(self.address, conn, context)
                if VERBOSE and trio.current_time() - started > 1:
                    print(f"slow ({trio.current_time() - started:.1f}s): {conn!r}"[:400])
                if problem:
                    failures.append(f"connection {index} ({conn.end}): {problem}")
            try:
                await self._health()
            except (AssertionError, OSError) as exc:
                failures.append(str(exc))

        trio.run(run_all)
        if self.proc.poll() is not None:
            failures.append(
                f"the server process exited (code {self.proc.returncode}); "
                f"its log ends with:\n{self.log_tail()}"
            )
            raise AssertionError("\n".join(failures))
        quiet = self.command(
            {"cmd": "quiesce", "max_tasks": self.idle_tasks, "timeout": LEAK_BOUND}
        )
        if (
            not quiet["ok"]
            and known
            and KNOWN_HANDSHAKE_HOLD
            and _only_handshake_holds(quiet, self.idle_tasks)
        ):
            # Known: see KNOWN_HANDSHAKE_HOLD. Bounded by the handshake timeout; counted, not failed.
            self.handshake_holds += 1
            quiet = self.command(
                {"cmd": "quiesce", "max_tasks": self.idle_tasks, "timeout": HANDSHAKE_HOLD_BOUND}
            )
        if not quiet["ok"]:
            tree = "\n".join(quiet["tree"])
            failures.append(
                f"{quiet['tasks'] - self.idle_tasks} task(s) still alive {LEAK_BOUND}s after "
                f"the batch (idle: {self.idle_tasks}); live tasks:\n{tree}"
            )
        elif quiet["tasks"] < self.idle_tasks:
            # A task of the idle server ended (a workspace closed?): a leak could hide in its place.
            gone = [_task_name(t) for t in self.idle_tree]
            for line in quiet["tree"]:
                if _task_name(line) in gone:
                    gone.remove(_task_name(line))
            failures.append(f"task(s) of the idle server ended during the batch: {gone}")
        else:
            targets = self.fd_targets()
            if len(targets) > self.idle_fds:
                extra = [
                    _describe_socket(t) for t in sorted(set(targets) - set(self.idle_fd_targets))
                ]
                failures.append(
                    f"{len(targets) - self.idle_fds} descriptor(s) left open "
                    f"(idle: {self.idle_fds}; new: {extra}; server port {self.address[1]}); "
                    f"open sockets: {quiet['sockets']}"
                )
        rss = self.rss()
        if not self.first_rss:
            self.first_rss = rss
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_growth = max(self.peak_growth, rss - self.first_rss)
        self.rss_seen = self.rss_seen or rss
        if rss - self.first_rss > RSS_GROWTH_BOUND:
            failures.append(
                f"RSS grew by {(rss - self.first_rss) >> 20} MiB (bound "
                f"{RSS_GROWTH_BOUND >> 20} MiB)"
            )
        if failures:
            raise AssertionError("\n".join(failures))

    def summary(self) -> str:
        return (
            f"{self.batches} batches, {self.connections} connections, {self.starts} server "
            f"start(s), {self.handshake_holds} known handshake hold(s), RSS at the first batch "
            f"{self.rss_seen / 2**20:.1f} MiB, largest growth within one server "
            f"{self.peak_growth / 2**20:.1f} MiB"
        )


_TCP_STATES: Final = {
    "01": "ESTABLISHED",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "0A": "LISTEN",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "09": "LAST_ACK",
    "0B": "CLOSING",
}


def _describe_socket(target: str) -> str:
    """``socket:[inode]`` with its TCP state and ports, from ``/proc/net/tcp``."""
    match = re.fullmatch(r"socket:\[(\d+)\]", target)
    if not match:
        return target
    try:
        with open("/proc/net/tcp") as table:
            for row in table.read().splitlines()[1:]:
                fields = row.split()
                if fields[9] == match.group(1):
                    local = int(fields[1].split(":")[1], 16)
                    remote = int(fields[2].split(":")[1], 16)
                    return f"{target} {_TCP_STATES.get(fields[3], fields[3])} {local}->{remote}"
    except OSError:
        pass
    return target


def _task_name(line: str) -> str:
    return line.split(" <- ")[0].strip()


def _only_handshake_holds(quiet: dict[str, Any], idle_tasks: int) -> bool:
    """Whether every task above the idle count waits for a websocket handshake proposal."""
    holds = sum("_run_handler <- wait_value@_impl.py" in line for line in quiet["tree"])
    return holds > 0 and quiet["tasks"] - idle_tasks <= holds


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("fuzz"))
    proc.start()
    try:
        yield proc
    finally:
        print(f"\nwire fuzzing: {proc.summary()}")
        proc.stop()


# -- one connection ---------------------------------------------------------------------------


@attrs.frozen(repr=False)
class Conn:
    """One connection: ``data`` (placeholders ``{host}``, ``{wid}``, ``{token}`` filled in at run
    time, then ``mutations`` applied), sent in pieces cut at ``cuts`` (fractions of the length).

    ``wait_first``: after the first piece, wait for the server's first bytes before the rest (an
    upgrade, then frames). ``end``: ``fin``, ``probe``, ``reset`` or ``close`` (module docstring).
    """

    data: bytes
    end: str = "fin"
    cuts: tuple[float, ...] = ()
    mutations: tuple[tuple[str, float, int], ...] = ()
    wait_first: bool = False
    first_len: int = 0

    def __repr__(self) -> str:
        data = repr(self.data)
        if len(self.data) > 600:
            data = f"{self.data[:300]!r} + <{len(self.data) - 400} bytes> + {self.data[-100:]!r}"
        return (
            f"Conn(data={data}, end={self.end!r}, cuts={self.cuts!r}, "
            f"mutations={self.mutations!r}, wait_first={self.wait_first!r}, "
            f"first_len={self.first_len!r})"
        )

    def first_len_in(self, context: dict[bytes, bytes]) -> int:
        """Where the first part (``first_len`` bytes of ``data``) ends once rendered."""
        first_len = self.first_len
        for key, value in context.items():
            first_len += self.data[: self.first_len].count(key) * (len(value) - len(key))
        return first_len

    def render(self, context: dict[bytes, bytes]) -> list[bytes]:
        data = self.data
        for key, value in context.items():
            data = data.replace(key, value)
        first_len = self.first_len_in(context)
        data = mutate(data, self.mutations)
        points = sorted({int(c * len(data)) for c in self.cuts} | {0, len(data)})
        if self.wait_first and 0 < first_len < len(data):
            points = sorted(set(points) | {first_len})
        return [data[a:b] for a, b in itertools.pairwise(points) if b > a] or [b""]


def mutate(data: bytes, mutations: tuple[tuple[str, float, int], ...]) -> bytes:
    """``data`` with byte flips, inserts, deletes and truncations at fractions of its length."""
    buf = bytearray(data)
    for kind, where, byte in mutations:
        pos = int(where * len(buf))
        if kind == "flip" and buf:
            buf[min(pos, len(buf) - 1)] ^= byte or 0x80
        elif kind == "insert":
            buf.insert(pos, byte)
        elif kind == "delete" and buf:
            del buf[min(pos, len(buf) - 1)]
        elif kind == "truncate":
            del buf[pos:]
    return bytes(buf)


async def exchange(address: tuple[str, int], conn: Conn, context: dict[bytes, bytes]) -> str:
    """Run one connection; returns what went wrong, or ``""``."""
    chunks = conn.render(context)
    received = bytearray()
    first_bytes = trio.Event()
    closed = trio.Event()
    answered = trio.Event()
    with trio.fail_after(ANSWER_BOUND * 4):
        stream = await trio.open_tcp_stream(*address)

    async def reader() -> None:
        try:
            while True:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                received.extend(chunk)
                first_bytes.set()
                if conn.end == "probe" and received.endswith(HEALTH_BODY):
                    answered.set()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        closed.set()

    problem = ""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        sent_all = True
        sent = 0
        wait_at = min(conn.first_len_in(context), sum(map(len, chunks)))
        for chunk in chunks:
            with trio.move_on_after(SEND_BOUND) as sending:
                try:
                    await stream.send_all(chunk)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    sent_all = False
                    break
            if sending.cancelled_caught:
                sent_all = False
                break
            sent += len(chunk)
            if conn.wait_first and sent == wait_at:
                with trio.move_on_after(ANSWER_BOUND):
                    await first_bytes.wait()
        if conn.end == "reset":
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif conn.end == "fin" and not closed.is_set():
            try:
                await stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            with trio.move_on_after(ANSWER_BOUND):
                await closed.wait()
            if not closed.is_set():
                problem = (
                    f"no close within {ANSWER_BOUND}s of the client's half-close "
                    f"(received {bytes(received[:300])!r})"
                )
        elif conn.end == "probe" and sent_all and not closed.is_set():
            probe = HEALTH_REQUEST.replace(b"{host}", context[b"{host}"])
            try:
                await stream.send_all(probe)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            with trio.move_on_after(ANSWER_BOUND):
                async with trio.open_nursery() as waiting:
                    for event in (answered, closed):
                        waiting.start_soon(_set_then_cancel, event, waiting.cancel_scope)
            if not (answered.is_set() or closed.is_set()):
                problem = (
                    f"the health request that followed on the same connection got no answer "
                    f"and no close within {ANSWER_BOUND}s (received {bytes(received[:300])!r})"
                )
        nursery.cancel_scope.cancel()
    await stream.aclose()
    statuses = _STATUS_5XX.findall(received)
    if statuses:
        problem += f" answered {statuses[0].decode()}: {bytes(received[:600])!r}"
    elif _BUG in received:
        problem += f" reported a bug: {bytes(received[:600])!r}"
    return problem.strip()


async def _set_then_cancel(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


# -- what to send -----------------------------------------------------------------------------

BAD_VALUES: Final = [
    b"",
    b" ",
    b"\xff",
    b"h\xffst",
    b"\x80\x81",
    "héllo".encode(),
    "例え.jp".encode(),
    b"\xc3\x28",
    b"\x00",
    b"a\x00b",
    b"xn--zz",
    b"xn--",
    b"a" * 64 + b".com",
    b"..",
    b"localhost.",
    b"[::1",
    b"[::1]:99999",
    b"127.0.0.1:-1",
    b"evil.example",
    b"a" * 9000,
    b"upgrade, \xff",
    b"websocket\xff",
    b"dGhlIHNhbXBsZSBub25jZQ==\xff",
    b"=",
    b"\t\t",
    b"-1",
    b"18446744073709551616",
    b"1e3",
    b"1_000",
    "٣".encode(),
]

CONTENT_LENGTHS: Final = [
    b"-1",
    b"abc",
    b"99999999999999999999",
    b"5000000",
    b" 3",
    b"0x10",
    b"1,1",
    b"",
    b"4194305",
]
CHUNKED_BODIES: Final = [
    b"zz\r\nxx\r\n0\r\n\r\n",
    b"ffffffffffffffff\r\nab\r\n",
    b"5;ext=\xff\r\nhello\r\n0\r\n\r\n",
    b"5\r\nhelloXX0\r\n\r\n",
    b"-1\r\n\r\n",
    b"0\r\nTrailer: \xff\r\n\r\n",
    b"2\r\n{}\r\n",
    b"\r\n\r\n",
]


def _head(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], version: bytes = b"HTTP/1.1"
) -> bytes:
    lines = [method + b" " + target + b" " + version]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n"


AUTH: Final = (b"Authorization", b"Bearer {token}")
JSON: Final = (b"Content-Type", b"application/json")


def ws_upgrade(client_id: str, query: bytes = b"") -> bytes:
    return _head(
        b"GET",
        b"/v1/workspaces/{wid}/ws?client_id=" + client_id.encode() + b"&token={token}" + query,
        [
            (b"Host", b"{host}"),
            (b"Upgrade", b"websocket"),
            (b"Connection", b"Upgrade"),
            (b"Sec-WebSocket-Key", b"dGhlIHNhbXBsZSBub25jZQ=="),
            (b"Sec-WebSocket-Version", b"13"),
        ],
    )


def sse_request(client_id: str, last_event_id: bytes | None, query: bytes = b"") -> bytes:
    headers = [(b"Host", b"{host}"), AUTH, (b"Accept", b"text/event-stream")]
    if last_event_id is not None:
        headers.append((b"Last-Event-ID", last_event_id))
    target = b"/v1/workspaces/{wid}/events?client_id=" + client_id.encode() + query
    return _head(b"GET", target, headers)


def _post(target: bytes, body: bytes, *, auth: bool = True) -> tuple[bytes, bytes]:
    headers = [(b"Host", b"{host}"), JSON, (b"Content-Length", str(len(body)).encode())]
    if auth:
        headers.insert(1, AUTH)
    return _head(b"POST", target, headers), body


# Well-framed requests: (head, body). Every route family, with and without a token; none of them
# opens a workspace or stops the server.
REQUESTS: Final = [
    (_head(b"GET", b"/v1/health", [(b"Host", b"{host}")]), b""),
    (_head(b"GET", b"/v1/version", [(b"Host", b"{host}"), AUTH]), b""),
    (_head(b"GET", b"/v1/workspaces", [(b"Host", b"{host}"), AUTH]), b""),
    (_head(b"GET", b"/v1/workspaces/{wid}", [(b"Host", b"{host}"), AUTH]), b""),
    (_head(b"GET", b"/v1/workspaces/{wid}/sessions", [(b"Host", b"{host}"), AUTH]), b""),
    (_head(b"GET", b"/v1/workspaces/{wid}/agent", [(b"Host", b"{host}")]), b""),
    (_head(b"GET", b"/v1/workspaces/nope/runs/r1", [(b"Host", b"{host}"), AUTH]), b""),
    (_head(b"GET", b"/", [(b"Host", b"{host}")]), b""),
    (_head(b"GET", b"/static/../x", [(b"Host", b"{host}")]), b""),
    (_head(b"GET", b"/v1/health", [(b"Host", b"{host}")], b"HTTP/1.0"), b""),
    (_head(b"GET", b"/v1/health", [(b"Host", b"{host}"), (b"Connection", b"close")]), b""),
    (_head(b"HEAD", b"/v1/health", [(b"Host", b"{host}")]), b""),
    (_head(b"OPTIONS", b"*", [(b"Host", b"{host}")]), b""),
    (
        _head(
            b"DELETE",
            b"/v1/workspaces/{wid}?client_id=not-the-holder",
            [(b"Host", b"{host}"), AUTH],
        ),
        b"",
    ),
    _post(b"/v1/workspaces", b'{"path": "relative/dir", "client_id": "c1"}'),
    _post(b"/v1/workspaces", b'{"path": "/nonexistent-fuzz/dir", "client_id": "c1"}'),
    _post(b"/v1/workspaces", b'{"path": 5}'),
    _post(b"/v1/workspaces/{wid}/sessions", b'{"title": "fuzz"}'),
    _post(b"/v1/workspaces/{wid}/agent", b'{"session_id": "nope", "prompt": "hi"}'),
    _post(b"/v1/workspaces/{wid}/agent/sessions/nope/cancel", b"{}"),
    _post(b"/v1/workspaces/{wid}/agent/sessions/nope/prompts/clear", b"{}"),
    _post(b"/v1/workspaces/{wid}/permissions/grant", b'{"id": "x", "decision": "allow"}'),
    _post(b"/v1/control", b'{"command": "nope"}'),
    _post(b"/v1/control", b'{"command": "shutdown"}', auth=False),
    _post(b"/v1/workspaces/nope/sessions", b"x" * 3000),
    _post(b"/v1/workspaces/{wid}/sessions", b"[" * 5000),
    _post(b"/v1/nope", b'{"a": 1}'),
]


@st.composite
def well_framed(draw: st.DrawFn) -> bytes:
    """A complete request; sometimes with a value of a non-framing header replaced."""
    head, body = draw(st.sampled_from(REQUESTS))
    if draw(st.booleans()):
        name = draw(
            st.sampled_from(
                [
                    b"Host",
                    b"Connection",
                    b"Origin",
                    b"Cookie",
                    b"Authorization",
                    b"Accept",
                    b"Content-Type",
                    b"Expect",
                ]
            )
        )
        value = draw(st.sampled_from(BAD_VALUES))
        head = _set_header(head, name, value)
    return head + body


def _set_header(head: bytes, name: bytes, value: bytes) -> bytes:
    lines = head[:-4].split(b"\r\n")
    kept = [line for line in lines[1:] if not line.lower().startswith(name.lower() + b":")]
    return b"\r\n".join([lines[0], *kept, name + b": " + value]) + b"\r\n\r\n"


@st.composite
def mangled_request(draw: st.DrawFn) -> bytes:
    """A request (or upgrade) with a structural defect."""
    seed = draw(st.sampled_from(["plain", "ws", "sse"]))
    if seed == "plain":
        head, body = draw(st.sampled_from(REQUESTS))
    elif seed == "ws":
        head, body = ws_upgrade(str(uuid.UUID(int=draw(st.integers(0, 3))))), b""
    else:
        head, body = sse_request("c-sse", draw(st.sampled_from([None, b"0", b"abc"]))), b""
    kind = draw(
        st.sampled_from(
            [
                "value",
                "huge",
                "many",
                "duplicate",
                "request_line",
                "content_length",
                "chunked",
                "bare_lf",
                "fold",
            ]
        )
    )
    if kind == "value":
        name = draw(
            st.sampled_from(
                [
                    b"Host",
                    b"Connection",
                    b"Upgrade",
                    b"Sec-WebSocket-Key",
                    b"Sec-WebSocket-Version",
                    b"Origin",
                    b"Last-Event-ID",
                    b"Authorization",
                    b"Cookie",
                    b"Transfer-Encoding",
                ]
            )
        )
        head = _set_header(head, name, draw(st.sampled_from(BAD_VALUES)))
    elif kind == "huge":
        size = draw(st.sampled_from([1000, 15_000, 17_000, 70_000]))
        head = _set_header(head, b"X-Big", b"v" * size)
    elif kind == "many":
        count = draw(st.sampled_from([100, 1000]))
        extra = b"".join(b"X-H%d: v\r\n" % i for i in range(count))
        head = head[:-2] + extra + b"\r\n"
    elif kind == "duplicate":
        name = draw(
            st.sampled_from(
                [b"Host", b"Content-Length", b"Upgrade", b"Sec-WebSocket-Key", b"Transfer-Encoding"]
            )
        )
        head = (
            head[:-2] + name + b": " + draw(st.sampled_from([*BAD_VALUES[:8], b"7"])) + b"\r\n\r\n"
        )
    elif kind == "request_line":
        line, rest = head.split(b"\r\n", 1)
        method, target, version = line.split(b" ")
        part = draw(st.integers(0, 3))
        if part == 0:
            method = draw(
                st.sampled_from([b"G\xffT", b"", b"GET GET", b"get", b"BREW", b"CONNECT"])
            )
        elif part == 1:
            target = draw(
                st.sampled_from(
                    [
                        b"",
                        b"*",
                        b"http://x/v1/health",
                        b"/%",
                        b"/\xff",
                        b"/v1/workspaces/%2e%2e/ws",
                        b"/" + b"a" * 20_000,
                        b"/v1/workspaces/{wid}/ws?token={token}&client_id=%ff",
                    ]
                )
            )
        elif part == 2:
            version = draw(
                st.sampled_from(
                    [b"HTTP/2.0", b"HTTP/1.1x", b"", b"http/1.1", b"HTTP/0.9", b"HTTP/1.1 extra"]
                )
            )
        else:
            line = draw(st.sampled_from([b"", b"\xff\xfe", b"GET", b"\r\n"]))
            head = line + b"\r\n" + rest
        if part < 3:
            head = method + b" " + target + b" " + version + b"\r\n" + rest
    elif kind == "content_length":
        head = _set_header(head, b"Content-Length", draw(st.sampled_from(CONTENT_LENGTHS)))
    elif kind == "chunked":
        head = _set_header(
            head,
            b"Transfer-Encoding",
            draw(
                st.sampled_from([b"chunked", b"gzip, chunked", b"chunked, identity", b"xchunked"])
            ),
        )
        body = draw(st.sampled_from(CHUNKED_BODIES))
    elif kind == "bare_lf":
        head = head.replace(b"\r\n", b"\n")
    else:
        head = head[:-2] + b" folded continuation\r\n\r\n"
    return head + body


mutations = st.lists(
    st.tuples(
        st.sampled_from(["flip", "insert", "delete", "truncate"]),
        st.floats(0, 1),
        st.sampled_from([0x00, 0x0A, 0x0D, 0x20, 0x3A, 0x7F, 0x80, 0xFF]) | st.integers(0, 255),
    ),
    max_size=4,
).map(tuple)
cuts = st.lists(st.floats(0, 1), max_size=4).map(tuple)


@st.composite
def head_conn(draw: st.DrawFn) -> Conn:
    """Mutated request heads: well-framed ones (the only ones that may be followed by a probe),
    structurally broken ones, then random byte flips, inserts, deletes and truncations."""
    if draw(st.booleans()):
        data = draw(well_framed())
        muts = draw(mutations)
        ends = ["fin", "reset", "close"] + (["probe"] if not muts else [])
    else:
        data = draw(mangled_request())
        muts = draw(mutations)
        ends = ["fin", "reset", "close"]
    return Conn(data, draw(st.sampled_from(ends)), draw(cuts), muts)


@st.composite
def pipelined_conn(draw: st.DrawFn) -> Conn:
    """Several requests in one write (or cut anywhere), possibly truncated or reset mid-way."""
    requests = draw(st.lists(well_framed(), min_size=2, max_size=5))
    data = b"".join(requests)
    # See KNOWN_PIPELINED_CLOSE_HOLD: while it is True, these connections end with a half-close.
    leave = ["fin"] if KNOWN_PIPELINED_CLOSE_HOLD else ["fin", "reset", "close"]
    if draw(st.booleans()):
        truncate_at = draw(st.floats(0, 1))
        return Conn(data, draw(st.sampled_from(leave)), draw(cuts), (("truncate", truncate_at, 0),))
    return Conn(data, draw(st.sampled_from([*leave, "probe"])), draw(cuts))


# -- websocket frames

WS_METHODS: Final = [
    "sessions.list",
    "sessions.create",
    "messages.list",
    "runs.get",
    "agent.cancel",
    "agent.prompt",
    "nope",
    "",
]


def ws_frame(
    opcode: int,
    payload: bytes,
    *,
    fin: bool = True,
    rsv: int = 0,
    masked: bool = True,
    length: int | None = None,
    key: bytes = b"\x37\xfa\x21\x3d",
) -> bytes:
    n = len(payload) if length is None else length
    b0 = (0x80 if fin else 0) | (rsv << 4) | (opcode & 0x0F)
    mask_bit = 0x80 if masked else 0
    if n < 126:
        head = bytes([b0, mask_bit | n])
    elif n < 65536:
        head = bytes([b0, mask_bit | 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([b0, mask_bit | 127]) + (n & (2**64 - 1)).to_bytes(8, "big")
    if masked:
        head += key
        payload = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
    return head + payload


@st.composite
def ws_payload(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(st.binary(max_size=200))
    if kind == 1:
        params = draw(
            st.dictionaries(
                st.sampled_from(["session_id", "run_id", "prompt", "title", "id"]),
                st.one_of(st.text(max_size=20), st.integers(), st.none()),
                max_size=3,
            )
        )
        command = {
            "id": draw(st.one_of(st.integers(), st.text(max_size=5), st.none())),
            "method": draw(st.sampled_from(WS_METHODS)),
            "params": params,
        }
        if draw(st.booleans()):
            del command["id"]
        return json.dumps(command).encode()
    if kind == 2:
        return draw(
            st.sampled_from(
                [
                    b"{}",
                    b"[]",
                    b"null",
                    b'{"id": 1}',
                    b'{"method": 5}',
                    b"\xff\xfe",
                    b'{"id":1,"method":"sessions.list","params":[]}',
                ]
            )
        )
    return draw(st.text(max_size=100)).encode()


@st.composite
def ws_frame_bytes(draw: st.DrawFn) -> bytes:
    kind = draw(
        st.sampled_from(
            [
                "text",
                "binary",
                "ping",
                "pong",
                "close",
                "bad_opcode",
                "fragments",
                "oversized",
                "continuation",
            ]
        )
    )
    masked = draw(st.booleans()) if draw(st.integers(0, 4)) == 0 else True
    rsv = draw(st.sampled_from([0, 0, 0, 1, 4, 7]))
    if kind == "text":
        return ws_frame(1, draw(ws_payload()), masked=masked, rsv=rsv)
    if kind == "binary":
        return ws_frame(2, draw(st.binary(max_size=300)), masked=masked, rsv=rsv)
    if kind in ("ping", "pong"):
        size = draw(st.sampled_from([0, 10, 125, 126, 200]))
        return ws_frame(
            9 if kind == "ping" else 10, b"p" * size, masked=masked, fin=draw(st.booleans())
        )
    if kind == "close":
        code = draw(
            st.sampled_from(
                [1000, 1001, 1002, 1005, 1006, 1015, 999, 0, 2999, 3000, 4999, 5000, 65535]
            )
        )
        reason = draw(
            st.sampled_from([b"", b"bye", b"\xff\xfe", b"\xc3\x28", b"r" * 130, "é".encode()])
        )
        payload = draw(st.sampled_from([code.to_bytes(2, "big") + reason, b"\x03", b""]))
        return ws_frame(8, payload, masked=masked)
    if kind == "bad_opcode":
        return ws_frame(
            draw(st.sampled_from([3, 4, 5, 6, 7, 11, 12, 13, 14, 15])), b"x", masked=masked
        )
    if kind == "fragments":
        text = draw(ws_payload())
        parts = [text[: len(text) // 2], text[len(text) // 2 :]]
        middle = draw(
            st.sampled_from(
                [
                    b"",
                    ws_frame(9, b"mid"),
                    ws_frame(1, b"interleaved"),
                    ws_frame(2, b"x", fin=False),
                ]
            )
        )
        return ws_frame(1, parts[0], fin=False) + middle + ws_frame(0, parts[1])
    if kind == "continuation":
        return ws_frame(0, draw(st.binary(max_size=20)), fin=draw(st.booleans()))
    claimed = draw(
        st.sampled_from([126, 65535, 65536, 4 * 1024 * 1024 + 1, 2**31, 2**63 - 1, 2**64 - 1])
    )
    return ws_frame(draw(st.sampled_from([1, 2, 9])), b"y" * 64, length=claimed)


@st.composite
def ws_conn(draw: st.DrawFn) -> Conn:
    """A websocket upgrade (sometimes with odd query values), then random or mutated frames."""
    query = draw(
        st.sampled_from(
            [
                b"",
                b"&since=0",
                b"&since=-1",
                b"&since=abc",
                b"&since=99999999999999999999",
                b"&since=%ff",
            ]
        )
    )
    head = ws_upgrade(str(uuid.UUID(int=draw(st.integers(0, 3)))), query)
    frames = b"".join(draw(st.lists(ws_frame_bytes(), min_size=1, max_size=6)))
    # Byte mutations hit only the frames: a mutated head is the business of test_mutated_heads.
    frames = mutate(frames, draw(mutations) if draw(st.booleans()) else ())
    end = draw(st.sampled_from(["fin", "reset", "close"]))
    return Conn(head + frames, end, draw(cuts), wait_first=draw(st.booleans()), first_len=len(head))


@st.composite
def sse_conn(draw: st.DrawFn) -> Conn:
    """SSE reconnects: the same or a new client id, odd ``Last-Event-ID`` and ``since``."""
    last = draw(
        st.sampled_from(
            [
                None,
                b"",
                b"0",
                b"1",
                b"-1",
                b"99999999999999999999",
                b"1e3",
                b" 5",
                b"\xff",
                b"abc",
                b"1" * 5000,
                b"0x10",
                b"+3",
                b"1_000",
                "٣".encode(),
                b"\x00",
            ]
        )
    )
    query = draw(
        st.sampled_from(
            [b"", b"&since=2", b"&since=", b"&since=-5", b"&since=%00", b"&client_id=second"]
        )
    )
    client_id = draw(st.sampled_from(["sse-a", "sse-b", "", "x" * 300, "%ff"]))
    end = draw(st.sampled_from(["fin", "reset", "close"]))
    return Conn(
        sse_request(client_id, last, query), end, draw(cuts), wait_first=True, first_len=10**9
    )


@st.composite
def reset_conn(draw: st.DrawFn) -> Conn:
    """A reset at a chosen phase: mid-head, mid-body, after an upgrade, mid-frame."""
    phase = draw(
        st.sampled_from(["mid_head", "mid_body", "after_upgrade", "mid_frame", "after_answer"])
    )
    if phase == "mid_head":
        head, body = draw(st.sampled_from(REQUESTS))
        return Conn(
            head + body,
            "reset",
            (),
            (("truncate", draw(st.floats(0.01, 0.99)) * len(head) / max(1, len(head + body)), 0),),
        )
    if phase == "mid_body":
        head = _head(
            b"POST",
            b"/v1/workspaces/{wid}/sessions",
            [(b"Host", b"{host}"), AUTH, JSON, (b"Content-Length", b"100000")],
        )
        return Conn(head + b"{" * draw(st.integers(0, 50_000)), "reset", draw(cuts))
    head = ws_upgrade(str(uuid.UUID(int=draw(st.integers(0, 3)))))
    if phase == "after_upgrade":
        return Conn(head, "reset", wait_first=True, first_len=len(head))
    if phase == "mid_frame":
        frame = ws_frame(1, b'{"id":1,"method":"sessions.list","params":{}}' * 10)
        cut = draw(st.integers(1, len(frame) - 1))
        return Conn(head + frame[:cut], "reset", wait_first=True, first_len=len(head))
    head, body = draw(st.sampled_from(REQUESTS[:6]))
    return Conn(head + body, "reset", wait_first=True, first_len=10**9)


random_conn = st.builds(
    Conn, st.binary(max_size=2000), st.sampled_from(["fin", "reset", "close"]), cuts
)


def fuzz_settings(examples: int) -> Any:
    return settings(
        max_examples=EXAMPLES or examples,
        derandomize=not LONG_RUN,
        deadline=None,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
        print_blob=LONG_RUN,
        phases=PHASES,
    )


def batches(conn: st.SearchStrategy[Conn], max_size: int = 6) -> st.SearchStrategy[list[Conn]]:
    return st.lists(conn, min_size=1, max_size=max_size)


@fuzz_settings(25)
@given(batch=batches(head_conn()))
def test_mutated_request_heads(server: ServerProcess, batch: list[Conn]) -> None:
    server.run_batch(batch)


@fuzz_settings(10)
@given(batch=batches(random_conn))
def test_random_bytes(server: ServerProcess, batch: list[Conn]) -> None:
    server.run_batch(batch)


@fuzz_settings(25)
@given(batch=batches(ws_conn(), 4))
def test_websocket_frames(server: ServerProcess, batch: list[Conn]) -> None:
    server.run_batch(batch)


@fuzz_settings(10)
@given(batch=batches(sse_conn(), 4))
def test_sse_reconnects(server: ServerProcess, batch: list[Conn]) -> None:
    server.run_batch(batch)


@fuzz_settings(12)
@given(batch=batches(pipelined_conn(), 4))
def test_pipelined_and_truncated_requests(server: ServerProcess, batch: list[Conn]) -> None:
    server.run_batch(batch)


@fuzz_settings(12)
@given(batch=batches(reset_conn()))
def test_resets_at_every_phase(server: ServerProcess, batch: list[Conn]) -> None:
    server.run_batch(batch)


def test_a_refused_upgrade_frees_its_task_at_once(server: ServerProcess) -> None:
    """An upgrade that the websocket handshake refuses, from a client that then leaves, leaves no
    task behind for longer than :data:`LEAK_BOUND`."""
    head = _set_header(ws_upgrade(str(uuid.uuid4())), b"Sec-WebSocket-Version", b"12")
    server.ensure()
    try:
        server._run_batch([Conn(head, "fin")], known=False)
    except AssertionError:
        server.dirty = True
        raise


def test_pipelined_requests_then_close_free_their_task(server: ServerProcess) -> None:
    """Two pipelined requests from a client that closes without reading leave no task behind for
    longer than :data:`LEAK_BOUND`."""
    server.ensure()
    try:
        server._run_batch([Conn(HEALTH_REQUEST * 2, "close")])
    except AssertionError:
        server.dirty = True
        raise


def test_the_harness_sees_a_crash(server: ServerProcess) -> None:
    """A server that dies during a batch is reported as such (the harness is not blind)."""
    server.ensure()
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(STARTUP_BOUND)
    with pytest.raises(AssertionError, match="exited"):
        server._run_batch([])
    server.dirty = True
