"""A server process for the wire fuzzer (``tests/test_fuzz_wire.py``).

Run as ``python -m tests.fuzz_server DIR``: starts the server on ``127.0.0.1`` port 0 with its
data under ``DIR``, opens one workspace (held, as if by an open event stream, by a client id
nobody else knows, so no fuzzed request can release it), and prints one JSON line:
``{"url", "token", "wid", "pid"}``.

It then answers commands, one JSON object per line on stdin, with one JSON line on stdout:

``{"cmd": "settle", "timeout": T}``
    Waits until no task of the server has run for a moment and no worker thread runs (or ``T``
    seconds), then reports the number of live tasks (the baseline of an idle server).
``{"cmd": "quiesce", "max_tasks": N, "timeout": T}``
    Waits until at most ``N`` tasks are alive, or ``T`` seconds. Reports ``tasks``, ``ok``, and
    when not ok, ``tree``: every live task with where it waits. Collects garbage first, so that
    a socket kept only by a reference cycle does not count as an open descriptor.

Live tasks are counted by a :class:`trio.abc.Instrument` (spawned minus exited), so waiting for
them to end is driven by their exits, not by polling. The process exits when stdin closes, or
with the server if the server stops (a crash shows as the process ending with its traceback on
stderr).
"""

from __future__ import annotations

import gc
import json
import os
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

import trio
import trio.testing

from crush_trio.server.serve import ServeOptions, ServerHandle, serve

TOKEN = "fuzz-token"


class TaskCounter(trio.abc.Instrument):
    """Counts live tasks and wakes a waiter whenever one exits."""

    def __init__(self) -> None:
        self.live = 0
        self.changed: trio.Event | None = None
        self.token: trio.lowlevel.TrioToken | None = None

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.live += 1

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        self.live -= 1
        changed = self.changed
        if changed is not None and self.token is not None:
            # Instrument hooks run inside the scheduler: hand the wake-up to the run loop.
            try:
                self.token.run_sync_soon(changed.set)
            except trio.RunFinishedError:
                pass

    async def wait_at_most(self, max_tasks: int) -> None:
        while self.live > max_tasks:
            self.changed = trio.Event()
            await self.changed.wait()


def _where(task: trio.lowlevel.Task) -> str:
    frames = [
        f"{f.f_code.co_name}@{Path(f.f_code.co_filename).name}:{n}"
        for f, n in task.iter_await_frames()
    ]
    return f"{task.name} <- " + " > ".join(frames[-4:])


def task_tree() -> list[str]:
    lines: list[str] = []

    def walk(task: trio.lowlevel.Task, depth: int) -> None:
        lines.append("  " * depth + _where(task))
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child, depth + 1)

    walk(trio.lowlevel.current_root_task(), 0)
    return lines


def _owners(obj: object, depth: int = 4, mine: set[int] | None = None) -> list[str]:
    """Chains of the objects that refer to ``obj`` (innermost first), ``depth`` levels up."""
    mine = set() if mine is None else mine
    if depth == 0:
        return []
    refs = gc.get_referrers(obj)
    mine.add(id(refs))
    chains: list[str] = []
    for ref in refs:
        if id(ref) in mine or (isinstance(ref, list) and len(ref) > 1000):
            continue
        if type(ref).__name__ == "frame":
            code = ref.f_code
            chains.append(f"frame {code.co_name}@{Path(code.co_filename).name}:{ref.f_lineno}")
            continue
        above = [] if isinstance(ref, type) else _owners(ref, depth - 1, mine)
        name = type(ref).__qualname__
        if above:
            chains.extend(f"{name} < {a}" for a in above[:3])
        else:
            chains.append(name)
    return chains[:6]


def open_sockets() -> list[str]:
    """Every open socket object of the process, with what refers to it."""
    found = []
    objects = gc.get_objects()
    for obj in objects:
        if isinstance(obj, socket.socket) and obj.fileno() >= 0:
            try:
                peer = obj.getpeername()
            except OSError:
                peer = None
            owners = _owners(obj, mine={id(objects), id(found)})
            found.append(f"fd {obj.fileno()} {obj.getsockname()} -> {peer} held by {owners}")
    return found


async def commands(counter: TaskCounter, handle: ServerHandle) -> None:
    stdin = trio.lowlevel.FdStream(os.dup(0))
    buffer = b""
    while True:
        chunk = await stdin.receive_some()
        if not chunk:
            handle.stop()
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request = json.loads(line)
            reply: dict[str, Any] = {}
            if request["cmd"] == "settle":
                # Idle means every task blocked and no worker thread running (the start-up's
                # SSL warm-up runs in one for a while): a transient task in the baseline would
                # hide a leaked one later.
                with trio.move_on_after(request["timeout"]):
                    while True:
                        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
                        if not any(t.name == "trio.to_thread.run_sync" for t in _all_tasks()):
                            break
                        counter.changed = trio.Event()
                        await counter.changed.wait()
                gc.collect()
                reply = {"tasks": counter.live, "tree": task_tree()}
            elif request["cmd"] == "quiesce":
                with trio.move_on_after(request["timeout"]):
                    await counter.wait_at_most(request["max_tasks"])
                gc.collect()
                ok = counter.live <= request["max_tasks"]
                reply = {"tasks": counter.live, "ok": ok, "sockets": open_sockets()}
                reply["tree"] = task_tree()
            print(json.dumps(reply), flush=True)


async def main(root: Path) -> None:
    counter = TaskCounter()
    trio.lowlevel.add_instrument(counter)
    counter.token = trio.lowlevel.current_trio_token()
    # Tasks alive before the instrument was added: the root task, the system tasks and this one.
    counter.live = len(_all_tasks())
    options = ServeOptions(
        host="127.0.0.1",
        port=0,
        data_dir=root / "data",
        token=TOKEN,
        user_config_dir=root / "user-config",
        access_log=False,
    )
    project = root / "project"
    project.mkdir(exist_ok=True)
    async with trio.open_nursery() as nursery:
        handle: ServerHandle = await nursery.start(serve, options)
        holder = str(uuid.uuid4())
        ws = await handle.backend.open(str(project), holder)
        # Held as if by an open event stream, so that the create grace never closes it.
        ws.attach(holder)
        print(
            json.dumps(
                {"url": handle.url, "token": handle.token, "wid": ws.id, "pid": os.getpid()}
            ),
            flush=True,
        )
        await commands(counter, handle)


def _all_tasks() -> list[trio.lowlevel.Task]:
    found: list[trio.lowlevel.Task] = []

    def walk(task: trio.lowlevel.Task) -> None:
        found.append(task)
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child)

    walk(trio.lowlevel.current_root_task())
    return found


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]))
