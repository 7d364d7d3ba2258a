"""W2's rounds against OpenCode's headless server, for the CPU ratio the W2 target is stated in.

``python -m bench.peer_opencode [--runs 50] [--rounds 3] [--tokens 200] [--delay-ms 20]``

The W2 target (docs/performance.md, "The fan-out at the machine's limit") is a ratio: our server's
CPU per run at most a tenth of OpenCode's *in the same run*, that is on the same machine in the
same state. This measures OpenCode's side with the same fake model (``python -m bench.fake``, the
same tokens, pace and stamps as W2), the same shape of work (rounds of ``--runs`` new sessions,
one prompt each, sent at once; one warm-up round first, unmeasured) and two clients reading every
event of the server, as W2's two client processes do. Run it alternated with
``python -m bench --only W2 --w2-rounds 3`` on an otherwise idle machine.

OpenCode (``opencode-ai`` on npm, :data:`VERSION`) is installed on first use with ``npm`` into
``--dir`` (default :data:`DEFAULT_DIR`); it needs Node.js and the npm registry, nothing else. The
server runs in a new project directory with a home of its own (no user configuration), with the
fake as its only provider (``@ai-sdk/openai-compatible``, which OpenCode fetches from npm on its
first start).

Printed per round and pooled: the server's CPU per run (its process; the CPU of any processes it
started, alive or reaped, beside it), submit → first visible text (the first text delta of the
session's reply on the event stream) and token sent by the model → seen on the event stream.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import httpx
import orjson
import trio

from .procs import (
    Child,
    child_process,
    children_cpu_seconds,
    cpu_seconds,
    python,
    tree_cpu_seconds,
)
from .report import percentile

if TYPE_CHECKING:
    from collections.abc import Callable

#: The OpenCode release measured (pinned so that figures compare across runs).
VERSION: Final = "1.18.33"
#: Where OpenCode is installed by default (outside the repository; kept between runs).
DEFAULT_DIR: Final = Path.home() / ".cache" / "crush-trio-bench" / f"opencode-{VERSION}"
#: Bound on ``npm install`` (seconds).
INSTALL_TIMEOUT: Final = 600.0
#: Bound on OpenCode's start, its first one included (it fetches its provider package then).
START_TIMEOUT: Final = 180.0
#: Bound on one round (seconds).
ROUND_TIMEOUT: Final = 300.0
#: Bound on one HTTP request of the driver (seconds).
REQUEST_TIMEOUT: Final = 60.0
#: Event-stream readers, as W2 has client processes.
READERS: Final = 2

STAMP_RE: Final = re.compile(r"\[t=(\d+\.\d+)\]")
READY: Final = "opencode server listening on "


# ---------------------------------------------------------------------------------------------
# Installing and starting OpenCode


def opencode_binary(directory: Path) -> Path | None:
    """The platform binary that ``npm install opencode-ai`` put under ``directory``."""
    found = sorted((directory / "node_modules").glob("opencode-*/bin/opencode"))
    plain = [p for p in found if "baseline" not in p.parent.parent.name]
    return (plain or found or [None])[0]


def install(directory: Path) -> Path:
    """OpenCode's binary, installed with npm first when it is not there yet."""
    binary = opencode_binary(directory)
    if binary is not None:
        return binary
    npm = shutil.which("npm")
    if npm is None:
        sys.exit("npm was not found: install Node.js (Debian: apt-get install nodejs npm)")
    directory.mkdir(parents=True, exist_ok=True)
    print(f"installing opencode-ai@{VERSION} into {directory} ...", flush=True)
    argv = [npm, "install", "--prefix", str(directory), "--no-audit", "--no-fund"]
    subprocess.run([*argv, f"opencode-ai@{VERSION}"], check=True, timeout=INSTALL_TIMEOUT)
    binary = opencode_binary(directory)
    if binary is None:
        sys.exit(f"npm installed opencode-ai but no binary for this platform is under {directory}")
    return binary


def opencode_config(fake_url: str) -> dict[str, Any]:
    """The project's ``opencode.json``: the fake model as the only provider and model."""
    model = {"name": "fake", "limit": {"context": 128_000, "output": 4096}}
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "fake": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Fake",
                "options": {"baseURL": fake_url, "apiKey": "unused"},
                "models": {"fake": model},
            }
        },
        "model": "fake/fake",
        "small_model": "fake/fake",
        "autoupdate": False,
        "share": "disabled",
    }


async def start_opencode(binary: Path, fake_url: str, workdir: Path) -> tuple[Child, str]:
    """Start ``opencode serve`` in a new project under ``workdir``; returns it and its URL."""
    project, home = workdir / "project", workdir / "home"
    project.mkdir(parents=True, exist_ok=True)
    home.mkdir(parents=True, exist_ok=True)
    (project / "opencode.json").write_bytes(orjson.dumps(opencode_config(fake_url)))
    env = {
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    }
    argv = [str(binary), "serve", "--port", "0", "--hostname", "127.0.0.1"]
    child = await Child.start("opencode", argv, log_dir=workdir, env=env, cwd=project)
    try:
        line = await child.expect(READY, within=START_TIMEOUT)
    except BaseException:
        await child.stop()
        raise
    return child, line[len(READY) :].strip()


def tree_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of ``pid`` itself, and of the processes under it (alive, or reaped by it)."""
    own = cpu_seconds(pid)
    return own, tree_cpu_seconds(pid) - own + children_cpu_seconds(pid)


# ---------------------------------------------------------------------------------------------
# The driver


@dataclass
class Round:
    """What one round measured."""

    runs: int
    cpu: float = 0.0
    below: float = 0.0
    wall: float = 0.0
    first_text: list[float] = field(default_factory=list)
    token_latency: list[float] = field(default_factory=list)


@dataclass
class Watch:
    """The sessions of the round in progress, as the event readers see them."""

    submitted: dict[str, float] = field(default_factory=dict)
    first_text: dict[str, float] = field(default_factory=dict)
    token_latency: list[float] = field(default_factory=list)
    idle: set[str] = field(default_factory=set)
    changed: trio.Event = field(default_factory=trio.Event)

    def on_event(self, event: dict[str, Any], now: float, count_tokens: bool) -> None:
        props = event.get("properties") or {}
        sid = props.get("sessionID")
        if sid not in self.submitted:
            return
        kind = event.get("type")
        if kind == "message.part.delta" and props.get("field") == "text":
            delta = props.get("delta") or ""
            if delta and sid not in self.first_text:
                self.first_text[sid] = now - self.submitted[sid]
            if count_tokens:
                self.token_latency += [now - float(s) for s in STAMP_RE.findall(delta)]
        elif kind == "session.idle" and sid in self.first_text:
            self.idle.add(sid)
            self.changed.set()
            self.changed = trio.Event()


async def read_events(client: httpx.AsyncClient, watch: Watch, count_tokens: bool) -> None:
    """Read the server's event stream for as long as the driver runs."""
    async with client.stream("GET", "/event", timeout=None) as response:
        response.raise_for_status()
        rest = b""
        async for chunk in response.aiter_bytes():
            now = time.time()
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                # Only the events the driver needs are decoded (the reader must keep up).
                if line.startswith(b"data: ") and (b'.delta"' in line or b'"session.idle"' in line):
                    watch.on_event(orjson.loads(line[6:]), now, count_tokens)


async def one_round(
    client: httpx.AsyncClient, watch: Watch, pid: int, runs: int, prompt: str
) -> Round:
    sessions = []
    for _ in range(runs):
        response = await client.post("/session", json={})
        response.raise_for_status()
        sessions.append(response.json()["id"])
    watch.submitted, watch.first_text, watch.idle = {}, {}, set()
    watch.token_latency = []
    body = {"parts": [{"type": "text", "text": prompt}]}
    result = Round(runs)
    cpu0, below0 = tree_cpu(pid)
    t0 = time.time()

    async def submit(sid: str) -> None:
        watch.submitted[sid] = time.time()
        response = await client.post(f"/session/{sid}/prompt_async", json=body)
        response.raise_for_status()

    async with trio.open_nursery() as nursery:
        for sid in sessions:
            nursery.start_soon(submit, sid)
    with trio.fail_after(ROUND_TIMEOUT):
        while len(watch.idle) < runs:
            await watch.changed.wait()
    result.wall = time.time() - t0
    cpu1, below1 = tree_cpu(pid)
    result.cpu, result.below = cpu1 - cpu0, below1 - below0
    result.first_text = list(watch.first_text.values())
    result.token_latency = list(watch.token_latency)
    return result


async def measure(
    *,
    runs: int,
    rounds: int,
    tokens: int,
    delay_ms: float,
    directory: Path = DEFAULT_DIR,
    log: Callable[[str], None] = print,
) -> Round:
    """W2's rounds against OpenCode (see the module doc); returns the rounds pooled."""
    binary = install(directory)
    workdir = Path(tempfile.mkdtemp(prefix="peer-opencode-"))
    fake_argv = python("-m", "bench.fake", "--port", "0", "--tokens", str(tokens))
    fake_argv += ["--delay-ms", f"{delay_ms:g}", "--stamp"]
    measured: list[Round] = []
    async with child_process("fake", fake_argv, workdir, "fake-llm listening on ") as (_, line):
        fake_url = line.split(" on ", 1)[1].strip()
        server, url = await start_opencode(binary, fake_url, workdir)
        try:
            limits = httpx.Limits(max_connections=runs + 8)
            async with (
                httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT, limits=limits) as client,
                trio.open_nursery() as nursery,
            ):
                watch = Watch()
                for n in range(READERS):
                    nursery.start_soon(read_events, client, watch, n == 0)
                await one_round(client, watch, server.pid, runs, "Warm up.")
                for r in range(rounds):
                    done = await one_round(
                        client, watch, server.pid, runs, "Reply with your tokens."
                    )
                    measured.append(done)
                    log(f"OpenCode round {r + 1}/{rounds}: {_line(done)}")
                nursery.cancel_scope.cancel()
        finally:
            # Killed: under this load it takes longer than the benchmark's stop bound to end
            # on SIGTERM, and nothing of its state is kept.
            await server.stop(signal.SIGKILL)
    log(f"(OpenCode's logs: {workdir})")
    return pooled(measured)


def pooled(rounds: list[Round]) -> Round:
    """Several rounds as one."""
    total = Round(sum(r.runs for r in rounds))
    for r in rounds:
        total.cpu += r.cpu
        total.below += r.below
        total.wall += r.wall
        total.first_text += r.first_text
        total.token_latency += r.token_latency
    return total


def _ms(x: float) -> str:
    return f"{x * 1000:.1f} ms"


def _line(r: Round) -> str:
    return (
        f"CPU per run {_ms(r.cpu / r.runs)} (processes it started: {_ms(r.below / r.runs)}), "
        f"first text p50 {_ms(percentile(r.first_text, 50))}, "
        f"token p99 {_ms(percentile(r.token_latency, 99))}, wall {r.wall:.1f} s"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.peer_opencode", description=__doc__)
    parser.add_argument("--runs", type=int, default=50, help="concurrent runs per round")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where OpenCode is installed")
    args = parser.parse_args(argv)
    print(
        f"OpenCode {VERSION}: {args.rounds} rounds of {args.runs} runs, {args.tokens} tokens at "
        f"{args.delay_ms:g} ms/token; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    total = trio.run(
        partial(
            measure,
            runs=args.runs,
            rounds=args.rounds,
            tokens=args.tokens,
            delay_ms=args.delay_ms,
            directory=args.dir,
            log=lambda line: print(line, flush=True),
        )
    )
    print(f"pooled: {_line(total)}")
    print(f"the driver's own CPU: {time.process_time():.1f} s over {total.wall:.1f} s of rounds")


if __name__ == "__main__":
    main()
