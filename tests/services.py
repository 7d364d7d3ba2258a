"""Throw-away PostgreSQL and Redis servers for the cluster tests.

Each test session starts at most one of each, on a free loopback port, in a temporary directory
that is removed afterwards; nothing touches a system-wide instance. The binaries come from
Debian's `postgresql` and `redis-server` packages, which `scripts/ensure-services.sh` installs
(`just test` runs it). Where they are missing, the tests that need them skip and say why.

Fixtures:
    postgres_server: the session's server (`PostgresServer`).
    pg_dsn: a fresh, empty database on it for one test (a DSN string).
    redis_server: the session's server (`RedisServer`).
    redis_url: the session's Redis, flushed before the test (a ``redis://`` URL).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

#: Bound on a server's start and stop.
START_TIMEOUT = 60.0
_INSTALL_HINT = "run scripts/ensure-services.sh (as root) or install Debian's {}"


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _postgres_bindir() -> Path | None:
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4])
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def _as_postgres_user() -> list[str]:
    """The command prefix that runs a PostgreSQL binary: PostgreSQL refuses to run as root."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("running as root and there is no 'postgres' user to run PostgreSQL as")
    return ["runuser", "-u", "postgres", "--"]


@attrs.frozen
class PostgresServer:
    port: int
    bindir: Path
    datadir: Path

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def psql(self, sql: str, dbname: str = "postgres") -> str:
        out = subprocess.run(
            [str(self.bindir / "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
             "-d", self.dsn(dbname), "-c", sql],
            check=True, capture_output=True, text=True, timeout=START_TIMEOUT,
        )  # fmt: skip
        return out.stdout


@contextlib.contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    bindir = _postgres_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL is not installed: " + _INSTALL_HINT.format("postgresql"))
    prefix = _as_postgres_user()
    root = Path(tempfile.mkdtemp(prefix="crush-trio-pg-"))
    try:
        if prefix:
            shutil.chown(root, "postgres", "postgres")
        datadir = root / "data"
        subprocess.run(
            [*prefix, str(bindir / "initdb"), "-D", str(datadir), "-U", "postgres",
             "--auth=trust", "-E", "UTF8", "--no-sync", "--no-instructions"],
            check=True, capture_output=True, timeout=START_TIMEOUT,
        )  # fmt: skip
        port = free_port()
        options = (
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        subprocess.run(
            [*prefix, str(bindir / "pg_ctl"), "-D", str(datadir), "-o", options, "-l",
             str(root / "log"), "-w", "-t", str(int(START_TIMEOUT)), "start"],
            check=True, capture_output=True, timeout=START_TIMEOUT + 5,
        )  # fmt: skip
        try:
            yield PostgresServer(port, bindir, datadir)
        finally:
            subprocess.run(
                [*prefix, str(bindir / "pg_ctl"), "-D", str(datadir), "-m", "immediate", "-w", "stop"],
                capture_output=True, timeout=START_TIMEOUT,
            )  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


@attrs.frozen
class RedisServer:
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self, *args: str) -> bytes:
        """Run one command with redis-cli (for test set-up, not for the code under test)."""
        out = subprocess.run(
            ["redis-cli", "-p", str(self.port), *args],
            check=True, capture_output=True, timeout=START_TIMEOUT,
        )  # fmt: skip
        return out.stdout


@contextlib.contextmanager
def running_redis() -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed: " + _INSTALL_HINT.format("redis-server"))
    root = Path(tempfile.mkdtemp(prefix="crush-trio-redis-"))
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(root), "--daemonize", "no", "--loglevel", "notice"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        # Redis prints this line once it accepts connections; readline is bounded by the kill
        # below (a server that dies ends the stream).
        with _kill_after(process, START_TIMEOUT):
            for line in process.stdout:
                if b"Ready to accept connections" in line:
                    break
            else:
                pytest.fail(f"redis-server exited with {process.wait()} before it was ready")
        # Keep reading its log so that a full pipe never blocks the server.
        threading.Thread(target=process.stdout.read, daemon=True).start()
        yield RedisServer(port, process)
    finally:
        process.kill()
        process.wait(timeout=START_TIMEOUT)
        if process.stdout is not None:
            process.stdout.close()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def _kill_after(process: subprocess.Popen[bytes], seconds: float) -> Iterator[None]:
    timer = threading.Timer(seconds, process.kill)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    with running_postgres() as server:
        yield server


_databases = iter(range(1, 1_000_000))


@pytest.fixture
def pg_dsn(postgres_server: PostgresServer) -> Iterator[str]:
    name = f"test_{os.getpid()}_{next(_databases)}"
    postgres_server.psql(f"CREATE DATABASE {name}")
    try:
        yield postgres_server.dsn(name)
    finally:
        postgres_server.psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    redis_server.command("FLUSHALL")
    return redis_server.url
