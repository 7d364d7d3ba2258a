"""Building blocks of the workloads: the context every workload gets, server configs, the fake
model, the orchestrator's hold on a workspace, client worker processes and number formats.

The orchestrator talks to the server with the client library too (:func:`hold_workspace`): it
opens each workspace, and in W3 and W4 creates the session and sends the prompt that the
watching workers measure.
"""

from __future__ import annotations

import math
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from crush_trio.client import WorkspaceClient, connect

from ..procs import (
    TOKEN,
    Child,
    ServerProcess,
    child_process,
    python,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Sequence
    from pathlib import Path

    from .sizes import Sizes

#: Server bounds of every benchmarked server: the creating client's hold never lapses, so the
#: workspace lives for the whole measurement whatever the clients do.
BASE_SERVER: Final = {"create_grace": 86400.0}
#: Websocket clients per client process in the fan-out and idle workloads.
CLIENTS_PER_PROCESS: Final = 250
#: Bound on one request of the orchestrator to the server (seconds).
REQUEST_TIMEOUT: Final = 60.0


@dataclass
class Ctx:
    """What every workload gets: sizes, a scratch directory and a progress printer."""

    sizes: Sizes
    workdir: Path
    log: Callable[[str], None]
    scratch: list[Path] = field(default_factory=list)

    def dir(self, name: str) -> Path:
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=True)
        return path


def fake_config(
    base_url: str,
    *,
    server: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    provider: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A crush.json pointing both models at the fake model server."""
    return {
        "providers": {
            "fake": {
                "type": "openai-compat",
                "base_url": f"{base_url}/v1",
                "api_key": "x",
                "models": [{"id": "fake"}],
                **(provider or {}),
            }
        },
        "models": {
            "large": {"provider": "fake", "model": "fake"},
            "small": {"provider": "fake", "model": "fake"},
        },
        "options": options or {},
        "server": {**BASE_SERVER, **(server or {})},
    }


def echo_config(
    delay_ms: float = 0.0,
    *,
    server: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A crush.json using the built-in echo model (replies with the prompt's words)."""
    return {
        "providers": {"echo": {"type": "echo", "delay_ms": delay_ms}},
        "models": {"large": {"provider": "echo", "model": "echo"}},
        "options": options or {},
        "server": {**BASE_SERVER, **(server or {})},
    }


def words(count: int, word: str | None = None) -> str:
    """A prompt the echo model answers with ``count`` tokens: ``w0 w1 ...``, or ``word``
    repeated (the smallest growth of a streamed message per token)."""
    return " ".join(word if word is not None else f"w{i}" for i in range(count))


@asynccontextmanager
async def fake_model(ctx: Ctx, name: str, *args: str) -> AsyncIterator[str]:
    """Run ``python -m bench.fake ARGS``; yields its base URL."""
    argv = python("-m", "bench.fake", "--port", "0", *args)
    async with child_process(name, argv, ctx.dir(name), "fake-llm listening on ") as (_, line):
        yield line.split(" on ", 1)[1].strip()


@asynccontextmanager
async def hold_workspace(server: ServerProcess, project: Path) -> AsyncIterator[WorkspaceClient]:
    """Open the workspace of ``project`` with the client library and hold it for the block.

    The hold keeps the workspace alive between generations of client processes (the server's
    create grace is a day, :data:`BASE_SERVER`). It is opened without an event stream
    (``events=False``): the orchestrator only sends work, and a stream of its own would be one
    more client receiving every event, which W3 and W4 would measure.
    """
    _mkdir(project)
    async with (
        connect(server.url, TOKEN, request_timeout=REQUEST_TIMEOUT) as client,
        client.workspace(project, events=False) as ws,
    ):
        yield ws


@asynccontextmanager
async def workers(
    ctx: Ctx, role: str, configs: Sequence[dict[str, Any]], name: str
) -> AsyncIterator[list[Child]]:
    """Start one ``bench.client ROLE`` process per config; they are stopped on exit."""
    async with AsyncExitStack() as stack:
        children: list[Child] = []
        for index, cfg in enumerate(configs):
            child = await Child.start(
                f"{name}-{index}", python("-m", "bench.client", role), log_dir=ctx.dir(name)
            )
            stack.push_async_callback(child.stop)
            await child.send(cfg)
            children.append(child)
        yield children


async def all_events(children: Sequence[Child], name: str, within: float) -> list[dict[str, Any]]:
    """The next ``name`` event of every child, in order (each within ``within`` seconds)."""
    return [await child.recv_event(name, within) for child in children]


def _mkdir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)


async def broadcast(children: Sequence[Child], command: dict[str, Any]) -> None:
    for child in children:
        await child.send(command)


def split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def bare_url(line: str) -> str:
    """The address of the bare server from its ``listening on ws://HOST:PORT`` line, in the form
    the client library takes (``http://HOST:PORT``); it accepts any workspace path."""
    return "http://" + line.split(" on ", 1)[1].strip().removeprefix("ws://")


def processes_for(clients: int) -> int:
    return max(1, math.ceil(clients / CLIENTS_PER_PROCESS))


def rate(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:,.0f}"


def share(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.0%}"


def pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def fast_stream(ctx: Ctx, name: str, tokens: int, delay_ms: float) -> Any:
    """A fake model streaming ``tokens`` tokens of ``x `` (the smallest growth of a message per
    update) with ``delay_ms`` between them."""
    return fake_model(
        ctx, name, "--tokens", str(tokens), "--delay-ms", f"{delay_ms:g}", "--token-text", "x "
    )
