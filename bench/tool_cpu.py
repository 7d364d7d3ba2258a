"""CPU per call of W7's tools, in one process: ``python -m bench.tool_cpu [--calls 150]``.

Runs W7's four calls (``view`` of a 50-line file, ``grep`` with 50 matches, ``ls``, ``bash``
running ``cat``) through a :class:`~crush_trio.tools.Toolbox` with the sandbox (when ``bwrap``
runs here), the hidden list of a server with a data directory and a config file, and a
``tool_output`` publisher that drops every event; each tool ``--calls`` times after five
unmeasured calls. Prints the process's CPU time (all threads) per call and, apart, the CPU of the
commands it ran and waited for. No server, client or model: the tool path alone, so a change to
it can be measured on a loaded machine without W7's noise: run it in two checkouts in turn
(copy ``bench/`` into the older one, as for W7).
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path
from typing import Any, Final

import attrs
import orjson
import trio

from crush_trio.tools import Toolbox
from crush_trio.tools.sandbox import Sandbox, probe

from .fake import TOOLS, tool_arguments
from .workloads.w7 import TOOL_FILE, TOOL_FILE_LINES

#: Unmeasured calls of each tool first (threads started, caches warm).
WARM_UP_CALLS: Final = 5


class _Allow:
    """Allows every permission request (none is expected: W7's calls run without one)."""

    async def request(self, **_: Any) -> bool:
        await trio.lowlevel.checkpoint()
        return True


def _toolbox(root: Path) -> Toolbox:
    workspace = root / "project"
    data = root / "server-data"
    (data / "workspace").mkdir(parents=True)
    workspace.mkdir()
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(TOOL_FILE_LINES))
    (workspace / TOOL_FILE).write_text(text)
    config = root / "server.crush.json"
    config.write_text("{}")
    status = probe()
    sandbox = (
        Sandbox(bwrap=status.bwrap, hidden=(data, config), more_hidden=lambda: ())
        if status.bwrap is not None
        else None
    )
    more: dict[str, Any] = {"publish": lambda event: None}
    try:
        from crush_trio.tools.hidden import HiddenPaths
    except ImportError:  # an older checkout, before the file tools applied the hidden list
        pass
    else:
        more["hidden"] = HiddenPaths.of(sandbox) if sandbox is not None else HiddenPaths()
    # Older toolboxes lack some fields: this file may be copied into an older checkout to
    # compare the two.
    fields = {field.name for field in attrs.fields(Toolbox)}
    return Toolbox(
        workspace=workspace,
        data_dir=data / "workspace",
        permissions=_Allow(),
        sandbox=sandbox,
        **{key: value for key, value in more.items() if key in fields},
    )


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def measure(calls: int) -> dict[str, tuple[float, float]]:
    """Each tool's CPU per call in seconds: the process's own, and its commands'."""
    out: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="crush-tool-cpu-") as tmp:
        toolbox = _toolbox(Path(tmp))
        tools = TOOLS if toolbox.sandbox is not None else tuple(t for t in TOOLS if t != "bash")
        for tool in tools:
            arguments = orjson.dumps(tool_arguments(tool, TOOL_FILE)).decode()
            for i in range(WARM_UP_CALLS + calls):
                if i == WARM_UP_CALLS:
                    cpu, children = time.process_time(), _children_cpu()
                result = await toolbox.call(
                    tool, arguments, session_id="s", tool_call_id=f"call-{i}"
                )
                if result.is_error:
                    raise RuntimeError(f"{tool} failed: {result.content}")
            out[tool] = (
                (time.process_time() - cpu) / calls,
                (_children_cpu() - children) / calls,
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=150, help="measured calls of each tool")
    args = parser.parse_args()
    figures = trio.run(measure, args.calls)
    for tool, (own, children) in figures.items():
        print(f"{tool:5} {own * 1000:7.2f} ms  (commands {children * 1000:.2f} ms)")
    mean = sum(own for own, _ in figures.values()) / len(figures)
    print(f"mean  {mean * 1000:7.2f} ms")


if __name__ == "__main__":
    main()
