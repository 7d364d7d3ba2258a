"""The processes of a benchmark and what ``/proc`` says about them.

Everything under test runs as its own OS process, so that its CPU time and memory can be read
from ``/proc/<pid>`` without counting the load generators:

* :class:`ServerProcess`: ``python -m crush_trio serve`` on an ephemeral loopback port;
* :class:`Child` for the fake model (``python -m bench.fake``), the bare websocket server
  (``python -m bench.bare``) and the client workers (``python -m bench.client ROLE``).

Children speak JSON lines: the orchestrator writes commands to a child's stdin and reads events
from its stdout (see :mod:`bench.client`). Every wait on a child is bounded.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

import httpx
import orjson
import trio

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

#: Kernel clock ticks per second (the unit of utime/stime in /proc/<pid>/stat).
CLK_TCK: Final = os.sysconf("SC_CLK_TCK")
#: The repository root: children run with it as their working directory.
REPO_ROOT: Final = Path(__file__).resolve().parent.parent
#: Longest wait for a child to print its first line (imports included).
STARTUP_TIMEOUT: Final = 60.0
#: Longest wait for a child to exit after SIGTERM before it is killed.
STOP_TIMEOUT: Final = 30.0
#: The token every benchmarked server runs with.
TOKEN: Final = "bench-token"
#: Longest wait for one scrape of the server's metrics (seconds).
METRICS_TIMEOUT: Final = 10.0
#: Bytes read from a child's stdout per receive.
READ_SIZE: Final = 64 * 1024
#: Interval of the RSS sampler (seconds).
RSS_SAMPLE_INTERVAL: Final = 0.05
#: py-spy samples per second when profiling (``python -m bench --profile``).
PROFILE_RATE: Final = 100


@dataclass
class Profiling:
    """Where py-spy profiles of the servers go; ``directory`` None means no profiling."""

    directory: Path | None = None


#: Set by ``python -m bench --profile``: every server process is recorded by py-spy.
PROFILING: Final = Profiling()


# ---------------------------------------------------------------------------------------------
# /proc


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        data = f.read()
    # The command name (field 2) may contain spaces; the fields after it are plain numbers.
    fields = data[data.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and of every live process below it (a process gone meanwhile
    counts for nothing)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                data = f.read()
        except OSError:
            continue
        ppid = int(data[data.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        one = todo.pop()
        try:
            total += cpu_seconds(one)
        except OSError:
            continue
        todo += children.get(one, [])
    return total


def loop_counts(pid: int) -> tuple[int, int]:
    """The process's write calls (``syscw`` of ``/proc/<pid>/io``: every thread, every file and
    socket) and its main thread's voluntary context switches (``/proc/<pid>/status``: for a Trio
    server, how often its loop went to sleep and was woken)."""
    with open(f"/proc/{pid}/io", encoding="ascii") as f:
        writes = next(int(line.split()[1]) for line in f if line.startswith("syscw:"))
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        sleeps = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt"))
    return writes, sleeps


def children_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of the process's children it has waited for (``cutime`` and
    ``cstime``: the commands the server ran, with their own children), in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        data = f.read()
    fields = data[data.rindex(")") + 2 :].split()
    return (int(fields[13]) + int(fields[14])) / CLK_TCK


@dataclass(frozen=True)
class Memory:
    """Resident memory of a process, in bytes: now (``VmRSS``) and its peak (``VmHWM``)."""

    rss: int
    hwm: int


def memory(pid: int) -> Memory:
    """The ``VmRSS`` and ``VmHWM`` lines of ``/proc/<pid>/status``."""
    values: dict[str, int] = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    return Memory(values.get("VmRSS", 0), values.get("VmHWM", 0))


def raise_fd_limit() -> int:
    """Raise this process's open-file limit to its hard limit; returns the new soft limit.

    Children inherit it, so calling this in the orchestrator covers the server too.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


class RssSampler:
    """Samples a process's ``VmRSS`` every :data:`RSS_SAMPLE_INTERVAL` seconds while open.

    Attributes:
        peak: the largest sample (bytes).
        samples: ``(seconds since start, rss bytes)`` pairs.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self.samples: list[tuple[float, int]] = []

    def sample(self) -> int:
        rss = memory(self.pid).rss
        self.peak = max(self.peak, rss)
        return rss

    @asynccontextmanager
    async def running(self) -> AsyncIterator[RssSampler]:
        """Sample in a task owned by this context; the last sample is taken on exit."""
        start = trio.current_time()
        async with trio.open_nursery() as nursery:

            async def loop() -> None:
                while True:
                    self.samples.append((trio.current_time() - start, self.sample()))
                    await trio.sleep(RSS_SAMPLE_INTERVAL)

            nursery.start_soon(loop)
            try:
                yield self
            finally:
                nursery.cancel_scope.cancel()
        self.samples.append((trio.current_time() - start, self.sample()))


# ---------------------------------------------------------------------------------------------
# Lines over pipes


class LineReader:
    """Reads ``\\n``-terminated lines from a Trio receive stream."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def readline(self) -> bytes | None:
        """The next line without its newline, or ``None`` at end of stream."""
        while True:
            index = self.buffer.find(b"\n")
            if index >= 0:
                line = bytes(self.buffer[:index])
                del self.buffer[: index + 1]
                return line
            data = await self.stream.receive_some(READ_SIZE)
            if not data:
                if self.buffer:
                    line = bytes(self.buffer)
                    self.buffer.clear()
                    return line
                return None
            self.buffer += data


class ChildError(RuntimeError):
    """A child process failed to start, exited early, or broke the line protocol."""


class Child:
    """A child process with piped stdin/stdout and stderr written to a log file.

    Cancellation: :meth:`stop` (SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT`) runs its wait
    inside ``trio.move_on_after(..., shield=True)`` so a cancelled benchmark still reaps it.
    """

    def __init__(
        self, name: str, process: trio.Process, log_path: Path, log_file: IO[bytes]
    ) -> None:
        self.name = name
        self.process = process
        self.log_path = log_path
        self._log_file = log_file
        assert process.stdout is not None
        self._reader = LineReader(process.stdout)

    @property
    def pid(self) -> int:
        return self.process.pid

    @classmethod
    async def start(
        cls,
        name: str,
        argv: Sequence[str],
        *,
        log_dir: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> Child:
        """Start ``argv`` in ``cwd`` (default: the repository root); stderr goes to
        ``log_dir/name.log``."""
        log_path = log_dir / f"{name}.log"
        log_file = _open_log(log_path)
        process = await trio.lowlevel.open_process(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_file,
            cwd=cwd or REPO_ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        return cls(name, process, log_path, log_file)

    async def readline(self, within: float) -> str:
        """The next line of stdout; raises :class:`ChildError` at EOF or after ``within``
        seconds."""
        with trio.move_on_after(within):
            line = await self._reader.readline()
            if line is None:
                raise ChildError(f"{self.name} exited; see {self.log_path}\n{self.log_tail()}")
            return line.decode()
        raise ChildError(f"{self.name} said nothing for {within:.0f} s; see {self.log_path}")

    async def expect(self, prefix: str, within: float = STARTUP_TIMEOUT) -> str:
        """Read lines until one starts with ``prefix``; returns it."""
        with trio.fail_after(within):
            while True:
                line = await self.readline(within)
                if line.startswith(prefix):
                    return line

    async def recv(self, within: float) -> dict[str, Any]:
        """The next JSON event from the child (see :mod:`bench.client`)."""
        line = await self.readline(within)
        try:
            event: dict[str, Any] = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ChildError(f"{self.name} printed a non-JSON line: {line[:200]!r}") from exc
        if event.get("event") == "error":
            raise ChildError(f"{self.name} failed: {event.get('message')}")
        return event

    async def recv_event(self, name: str, within: float) -> dict[str, Any]:
        """Skip events until one named ``name`` arrives."""
        with trio.fail_after(within):
            while True:
                event = await self.recv(within)
                if event.get("event") == name:
                    return event

    async def send(self, command: dict[str, Any]) -> None:
        """Write one JSON command line to the child's stdin."""
        assert self.process.stdin is not None
        try:
            await self.process.stdin.send_all(orjson.dumps(command) + b"\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ChildError(f"{self.name} is gone; see {self.log_path}") from exc

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def stop(self, sig: int = signal.SIGTERM) -> int | None:
        """Signal the child and reap it; returns its exit code."""
        with trio.CancelScope(shield=True):
            if self.process.returncode is None:
                try:
                    self.process.send_signal(sig)
                except ProcessLookupError:
                    pass
                with trio.move_on_after(STOP_TIMEOUT):
                    await self.process.wait()
            if self.process.returncode is None:
                # Its own bound: one shared with the wait above would have expired with it,
                # and a child that ignores ``sig`` would outlive the benchmark.
                self.process.kill()
                with trio.move_on_after(STOP_TIMEOUT):
                    await self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                with trio.move_on_after(1, shield=True):
                    await stream.aclose()
        self._log_file.close()
        return self.process.returncode


def _open_log(path: Path) -> IO[bytes]:
    return open(path, "ab")


def _write_config(workdir: Path, name: str, config: dict[str, Any]) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"{name}.crush.json"
    path.write_bytes(orjson.dumps(config, option=orjson.OPT_INDENT_2))
    return path


def python(*args: str) -> list[str]:
    """An argv running this interpreter."""
    return [sys.executable, *args]


# ---------------------------------------------------------------------------------------------
# The server under test


@dataclass
class ServerProcess:
    """A running ``crush-trio serve``: its child, base URL and files."""

    child: Child
    url: str
    workdir: Path

    @property
    def pid(self) -> int:
        return self.child.pid

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def children_cpu(self) -> float:
        return children_cpu_seconds(self.pid)

    def loop_counts(self) -> tuple[int, int]:
        return loop_counts(self.pid)

    async def metric(self, name: str) -> float:
        """The value of the server's unlabelled metric ``name`` (``GET /metrics`` with the
        token); 0 when it has no sample yet."""
        async with httpx.AsyncClient(timeout=METRICS_TIMEOUT) as client:
            response = await client.get(
                f"{self.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}
            )
        response.raise_for_status()
        for line in response.text.splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return float(value)
        return 0.0

    def memory(self) -> Memory:
        return memory(self.pid)

    def error_lines(self) -> list[str]:
        """Lines of the server's log at level ERROR or CRITICAL, and traceback headers."""
        text = self.child.log_path.read_text(errors="replace")
        return [
            line
            for line in text.splitlines()
            if " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback")
        ]

    def warning_lines(self) -> list[str]:
        text = self.child.log_path.read_text(errors="replace")
        return [line for line in text.splitlines() if " WARNING " in line]


@asynccontextmanager
async def server_process(
    config: dict[str, Any],
    workdir: Path,
    name: str = "server",
    launcher: Sequence[str] = ("-m", "crush_trio"),
) -> AsyncIterator[ServerProcess]:
    """Run the server with ``config`` (a ``crush.json`` as a dict) until the block ends.

    ``launcher``: the interpreter arguments before ``serve`` (another module may wrap the server,
    e.g. :mod:`bench.traced_server`). The server gets SIGTERM on exit (a graceful shutdown) and
    is killed if it does not exit within :data:`STOP_TIMEOUT`.
    """
    config_path = _write_config(workdir, name, config)
    data_dir = workdir / f"{name}-data"
    argv = python(
        *launcher,
        "serve",
        "--port",
        "0",
        "--data-dir",
        str(data_dir),
        "--config",
        str(config_path),
        "--token",
        TOKEN,
        "--no-access-log",
    )
    child = await Child.start(name, argv, log_dir=workdir)
    spy: Child | None = None
    try:
        line = await child.expect("crush-trio listening on ")
        url = line.split(" on ", 1)[1].split("/?", 1)[0]
        if PROFILING.directory is not None:
            spy = await start_profiler(child.pid, PROFILING.directory / f"{workdir.name}.txt")
        yield ServerProcess(child, url, workdir)
    finally:
        if spy is not None:
            await spy.stop(signal.SIGINT)  # py-spy writes its file on SIGINT
        await child.stop()


async def start_profiler(pid: int, out: Path) -> Child:
    """Record ``pid`` with py-spy (collapsed stacks, ``--nonblocking`` so the server is never
    paused); summarize the file with ``python -m bench.profile``."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [exe, "record", "--pid", str(pid), "--format", "raw", "--rate", str(PROFILE_RATE)]
    argv += ["--nonblocking", "--output", str(out)]
    return await Child.start(f"py-spy-{out.stem}", argv, log_dir=out.parent)


@asynccontextmanager
async def child_process(
    name: str, argv: Sequence[str], workdir: Path, ready_prefix: str | None = None
) -> AsyncIterator[tuple[Child, str]]:
    """Run a child until the block ends; yields it and its first line starting with
    ``ready_prefix`` (empty when there is none to wait for)."""
    child = await Child.start(name, argv, log_dir=workdir)
    try:
        line = await child.expect(ready_prefix) if ready_prefix else ""
        yield child, line
    finally:
        await child.stop()
