"""Tables, targets and the files a benchmark run writes.

A workload returns a :class:`WorkloadResult`: Markdown tables, targets marked met / not met, the
raw figures (kept in ``results.json``) and a chart. :func:`write_results` puts one Markdown file
and one PNG per workload under the output directory, plus ``summary.md`` and ``results.json``.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from .procs import REPO_ROOT

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

MB = 1024 * 1024


@dataclass
class Table:
    """A Markdown table with a title."""

    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        lines = [f"**{self.title}**", "", "| " + " | ".join(self.headers) + " |"]
        lines.append("|" + "|".join("---" for _ in self.headers) + "|")
        lines.extend("| " + " | ".join(row) + " |" for row in self.rows)
        return "\n".join(lines)


@dataclass
class Target:
    """A target of the workload, with the measured value and whether it was met."""

    name: str
    measured: str
    limit: str
    met: bool

    @property
    def verdict(self) -> str:
        return "met" if self.met else "NOT MET"


@dataclass
class WorkloadResult:
    key: str  # "W1"
    title: str
    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    chart: Callable[[Path], None] | None = None
    seconds: float = 0.0

    def markdown(self) -> str:
        parts = [f"## {self.key}: {self.title}", ""]
        for table in self.tables:
            parts += [table.markdown(), ""]
        if self.targets:
            targets = Table("Targets", ["target", "measured", "limit", "verdict"])
            for t in self.targets:
                targets.add(t.name, t.measured, t.limit, t.verdict)
            parts += [targets.markdown(), ""]
        parts += [f"- {note}" for note in self.notes]
        if self.notes:
            parts.append("")
        parts.append(f"_{self.key} took {self.seconds:.0f} s._")
        return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# Numbers


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0-100), linear between closest ranks; NaN when empty."""
    if not values:
        return float("nan")
    data = sorted(values)
    if len(data) == 1:
        return data[0]
    k = (len(data) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


def ms(seconds: float) -> str:
    return "n/a" if seconds != seconds else f"{seconds * 1000:.1f} ms"


def mb(nbytes: float) -> str:
    return f"{nbytes / MB:.1f} MB"


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


# ---------------------------------------------------------------------------------------------
# Machine and files


def machine() -> dict[str, str]:
    """What the figures were measured on."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    return {
        "nproc": str(len(os.sched_getaffinity(0))),
        "cpu": model,
        "memory": mem,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit or "unknown",
    }


def machine_line(info: dict[str, str]) -> str:
    return (
        f"{info['date']}, commit {info['commit']}: {info['nproc']} CPUs ({info['cpu']}), "
        f"{info['memory']} RAM, Python {info['python']}, Linux {info['kernel']}"
    )


def write_results(
    out: Path, results: list[WorkloadResult], info: dict[str, str], command: str
) -> list[Path]:
    """Write ``Wn.md``, ``Wn.png``, ``summary.md`` and ``results.json``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for result in results:
        md = out / f"{result.key}.md"
        md.write_text(f"# {result.key}\n\n{machine_line(info)}\n\n{result.markdown()}\n")
        written.append(md)
        if result.chart is not None:
            png = out / f"{result.key}.png"
            result.chart(png)
            written.append(png)
    summary = out / "summary.md"
    lines = [
        "# Benchmark results",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine_line(info)}",
        "",
        targets_table(results).markdown(),
        "",
    ]
    for result in results:
        lines += [result.markdown(), ""]
    summary.write_text("\n".join(lines))
    written.append(summary)
    raw = out / "results.json"
    raw.write_bytes(
        orjson.dumps(
            {
                "machine": info,
                "command": command,
                "workloads": {r.key: r.raw for r in results},
                "targets": [{"workload": r.key, **t.__dict__} for r in results for t in r.targets],
            },
            option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY,
        )
    )
    written.append(raw)
    return written


def targets_table(results: list[WorkloadResult]) -> Table:
    table = Table("Targets", ["workload", "target", "measured", "limit", "verdict"])
    for result in results:
        for t in result.targets:
            table.add(result.key, t.name, t.measured, t.limit, t.verdict)
    return table
