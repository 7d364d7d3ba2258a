"""W7, tool calls: runs whose model makes many read-only tool calls; server CPU per tool call.

N concurrent sessions, one prompt each, in rounds (:func:`~.rounds.run_rounds`, as W1). The fake
model (``python -m bench.fake --tool-calls``) answers each of a run's first ``w7_tool_calls``
requests with one tool call, in turn ``view`` of a small file, ``grep`` of the workspace, ``ls``
and ``bash`` running ``cat`` of the file (a read-only command the sandbox runs without asking),
then a short text reply. The figures: the server process's CPU per tool call (its own, from
``/proc/<pid>/stat``, and apart from it the CPU of the commands it ran and waited for), tool
calls per second, and each tool's call latency as the clients see it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import trio

from crush_trio.tools.sandbox import SandboxStatus, probe

from .. import charts
from ..fake import TOOLS
from ..procs import server_process
from ..report import Table, Target, WorkloadResult, mb, ms, percentile
from .common import Ctx, fake_config, fake_model, hold_workspace
from .rounds import STALL_AFTER, LevelResult, run_rounds

if TYPE_CHECKING:
    from pathlib import Path

#: The file ``view`` and ``cat`` read (workspace-relative) and its lines.
#: Steps a W7 run may take beyond its tool calls (its final reply, and room to spare).
W7_EXTRA_STEPS: Final = 5
TOOL_FILE: Final = "notes.txt"
TOOL_FILE_LINES: Final = 50
PROMPT: Final = "Look around the workspace with your tools, then answer."


def _project(root: Path) -> Path:
    project = root / "project"
    project.mkdir(parents=True, exist_ok=True)
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(TOOL_FILE_LINES))
    (project / TOOL_FILE).write_text(text)
    return project


def _targets_and_notes(
    result: WorkloadResult, level: LevelResult, calls: int, seen: int, sandbox: SandboxStatus
) -> None:
    """W7's targets and notes (see :func:`w7`)."""
    result.targets += [
        Target(
            "every run completed",
            f"{level.completed}/{level.runs}",
            "all",
            level.runs > 0 and level.completed == level.runs,
        ),
        Target(
            "every tool call seen with a result that is not an error",
            f"{seen - level.tool_errors}/{calls}",
            "all",
            calls > 0 and seen == calls and level.tool_errors == 0,
        ),
    ]
    result.notes += [
        "tool calls = completed runs times tool calls per run; wall = first submit to last "
        "`run_complete`; server CPU = user+system time of the server process (all threads) over "
        "the same interval, from /proc/<pid>/stat, divided by the tool calls (so each call also "
        "carries its share of the run's prompt and final reply).",
        "commands' CPU = the children's time of the same file (cutime+cstime): the sandboxed "
        "`bash` commands the server waited for, with their own children.",
        "tool call latency = a client saw the assistant message with the call finished → it saw "
        "the tool message with the call's result (both over the event stream).",
        f"failed = runs refused or ended with an error, plus runs whose `run_complete` never "
        f"arrived within {STALL_AFTER:g} s of the last run's end.",
    ]
    if not sandbox.available:
        result.notes.append(f"no sandbox ({sandbox.reason}): bash was left out.")
    if level.errors:
        result.notes.append("errors: " + "; ".join(sorted(set(level.errors))[:5]))


async def w7(ctx: Ctx) -> WorkloadResult:
    s = ctx.sizes
    result = WorkloadResult("W7", "Tool calls")
    sandbox = await trio.to_thread.run_sync(probe)
    # Without the sandbox every bash command asks for permission, which no one here answers.
    tools = list(TOOLS) if sandbox.available else [t for t in TOOLS if t != "bash"]
    n = s.w7_sessions
    level = LevelResult("fake", n)
    root = ctx.dir("w7")
    project = _project(root)
    fake_args = ["--tokens", str(s.w7_tokens), "--tool-calls", str(s.w7_tool_calls)]
    fake_args += ["--tools", ",".join(tools), "--tool-file", TOOL_FILE]
    ctx.log(f"[W7] N={n}, {s.w7_tool_calls} tool calls per run ({', '.join(tools)})")
    async with (
        fake_model(ctx, "w7-fake", *fake_args) as fake_url,
        server_process(
            # Every tool call is a model step: the run needs more than that many steps.
            fake_config(fake_url, options={"max_steps": s.w7_tool_calls + W7_EXTRA_STEPS}),
            root,
        ) as server,
        hold_workspace(server, project),
    ):
        warm_up = None if s.smoke else PROMPT
        await run_rounds(ctx, server, project, level, PROMPT, rounds=s.w7_rounds, warm_up=warm_up)
    calls = level.completed * s.w7_tool_calls
    seen = sum(len(v) for v in level.tool_latency.values())
    cpu_per_call = level.cpu / calls if calls else float("nan")
    child_per_call = level.children_cpu / calls if calls else float("nan")
    calls_per_s = calls / level.wall if level.wall else float("nan")
    every = [x for v in level.tool_latency.values() for x in v]
    table = Table(
        f"N={n} concurrent runs, {s.w7_tool_calls} tool calls each, {s.w7_rounds} round(s)",
        [
            "runs",
            "tool calls",
            "wall",
            "tool calls/s",
            "server CPU/tool call",
            "commands' CPU/tool call",
            "server CPU/run",
            "peak RSS",
            "tool call p50",
            "tool call p95",
            "failed",
        ],
    )
    table.add(
        level.runs,
        calls,
        f"{level.wall:.2f} s",
        f"{calls_per_s:,.0f}",
        ms(cpu_per_call),
        ms(child_per_call),
        ms(level.cpu_per_run),
        mb(level.hwm),
        ms(percentile(every, 50)),
        ms(percentile(every, 95)),
        level.failed + level.missing,
    )
    per_tool = Table("Tool call latency by tool", ["tool", "calls", "p50", "p95", "max"])
    for tool in tools:
        values = level.tool_latency.get(tool, [])
        per_tool.add(
            tool,
            len(values),
            ms(percentile(values, 50)),
            ms(percentile(values, 95)),
            ms(max(values, default=float("nan"))),
        )
    result.tables += [table, per_tool]
    ctx.log(
        f"  {calls} tool calls in {level.wall:.2f} s, {ms(cpu_per_call)} server CPU per call, "
        f"p50 {ms(percentile(every, 50))}"
    )
    _targets_and_notes(result, level, calls, seen, sandbox)
    result.raw = {
        "n": n,
        "rounds": s.w7_rounds,
        "tools": tools,
        "tool_calls_per_run": s.w7_tool_calls,
        "runs": level.runs,
        "completed": level.completed,
        "tool_calls": calls,
        "tool_calls_seen": seen,
        "tool_errors": level.tool_errors,
        "wall": level.wall,
        "cpu": level.cpu,
        "children_cpu": level.children_cpu,
        "cpu_per_tool_call": cpu_per_call,
        "children_cpu_per_tool_call": child_per_call,
        "tool_calls_per_s": calls_per_s,
        "peak_rss": level.hwm,
        "tool_latency": level.tool_latency,
    }
    result.chart = lambda path: charts.w7(path, result.raw)
    return result
