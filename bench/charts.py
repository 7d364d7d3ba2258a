"""One matplotlib chart per workload, drawn from the workload's raw figures (Agg backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from pathlib import Path

MB = 1024 * 1024


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def w1(path: Path, raw: dict[str, Any]) -> None:
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 4))
    modes = sorted({lv["mode"] for lv in raw["levels"]})
    for mode in modes:
        levels = [lv for lv in raw["levels"] if lv["mode"] == mode]
        n = [lv["n"] for lv in levels]
        ax1.plot(n, [lv["runs_per_s"] for lv in levels], marker="o", label=mode)
        ax2.plot(n, [lv["cpu_per_run"] * 1000 for lv in levels], marker="o", label=mode)
        ax3.plot(n, [lv["peak_rss"] / MB for lv in levels], marker="o", label=mode)
    ax1.set(title="Runs per second", xlabel="concurrent sessions N", xscale="log")
    ax2.set(title="Server CPU per run (ms)", xlabel="concurrent sessions N", xscale="log")
    ax2.axhline(40, color="red", linestyle="--", linewidth=1, label="target")
    ax3.set(title="Peak RSS (MB)", xlabel="concurrent sessions N", xscale="log")
    ax3.axhline(200, color="red", linestyle="--", linewidth=1, label="target")
    for ax in (ax1, ax2, ax3):
        ax.legend()
        ax.grid(alpha=0.3)
    _save(fig, path)


def w2(path: Path, raw: dict[str, Any]) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in (
        (ax1, "first_text", "Submit → first visible text"),
        (ax2, "token_latency", "Token → client"),
    ):
        values = sorted(v * 1000 for v in raw[key])
        if values:
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.plot(values, ys)
        ax.set(title=title, xlabel="ms", ylabel="fraction of samples (CDF)")
        ax.grid(alpha=0.3)
    ax1.axvline(100, color="red", linestyle="--", linewidth=1, label="p50 target")
    ax1.legend()
    _save(fig, path)


def w3(path: Path, raw: dict[str, Any]) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    levels = raw["levels"]
    xs = range(len(levels))
    width = 0.38
    ax.bar(
        [x - width / 2 for x in xs],
        [lv["server_per_cpu"] for lv in levels],
        width,
        label="crush-trio server",
    )
    ax.bar(
        [x + width / 2 for x in xs],
        [lv["bare_per_cpu"] for lv in levels],
        width,
        label="bare trio-websocket (ceiling)",
    )
    for x, lv in zip(xs, levels, strict=True):
        ax.annotate(
            f"{lv['ratio']:.0%}",
            (x - width / 2, lv["server_per_cpu"]),
            ha="center",
            va="bottom",
        )
    ax.set_xticks(list(xs), [f"{lv['clients']} clients" for lv in levels])
    ax.set(title="Delivered messages per server CPU-second", ylabel="msgs / CPU-s")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    _save(fig, path)


def w4(path: Path, raw: dict[str, Any]) -> None:
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4))
    idle, bare = raw["idle"], raw["idle_bare"]
    ax1.bar(
        ["server\n0 clients", f"server\n{idle['clients']} clients", "bare\n0", "bare\nidle"],
        [idle["before"] / MB, idle["after"] / MB, bare["before"] / MB, bare["after"] / MB],
        color=["tab:blue", "tab:blue", "tab:gray", "tab:gray"],
    )
    ax1.set(title="RSS with idle websocket clients (MB)")
    runs = raw["stall"]["runs"]
    labels = ["A", "B (stalled)", "A2"]
    keys = ["A", "B", "A2"]
    ax2.bar(labels, [runs[k]["duration"] for k in keys], color=["tab:blue", "tab:red", "tab:blue"])
    ax2.set(title="Run duration with a stalled client (s)")
    soak = raw["soak"]
    ax3.plot([d for d, _ in soak["progress"]], [r / MB for _, r in soak["progress"]], marker=".")
    ax3.set(title="Soak: RSS (MB) vs runs completed", xlabel="runs")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    _save(fig, path)


def w5(path: Path, raw: dict[str, Any]) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    totals = raw["totals"]
    ax1.bar(
        ["accepted", "exactly once", "none", "more than once"],
        [totals["accepted"], totals["exactly_once"], totals["missing"], totals["duplicated"]],
        color=["tab:blue", "tab:green", "tab:red", "tab:red"],
    )
    ax1.set(title="Runs and their run_complete events")
    ops = raw["ops"]
    names = sorted(ops)
    ax2.barh(names, [ops[n] for n in names])
    ax2.set(title="Chaos operations")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    _save(fig, path)


def w6(path: Path, raw: dict[str, Any]) -> None:
    fig, ax = plt.subplots(figsize=(9, 4))
    samples = raw["samples"]
    ax.plot([s["t"] / 60 for s in samples], [s["rss"] / MB for s in samples], label="RSS")
    ax.axvline(raw["baseline_at"] / 60, color="grey", linestyle="--", linewidth=1, label="baseline")
    ax.set(title="Soak: server RSS (MiB)", xlabel="minutes", ylim=(0, None))
    ax.legend()
    ax.grid(alpha=0.3)
    _save(fig, path)


def w7(path: Path, raw: dict[str, Any]) -> None:
    fig, ax = plt.subplots(figsize=(9, 4))
    for tool in raw["tools"]:
        values = sorted(v * 1000 for v in raw["tool_latency"].get(tool, []))
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=tool)
    ax.set(
        title="Tool call → its result, as a client sees it",
        xlabel="ms",
        ylabel="fraction of calls (CDF)",
    )
    ax.legend()
    ax.grid(alpha=0.3)
    _save(fig, path)
