"""The load benchmarks at tiny sizes (``python -m bench --smoke``), so they cannot rot.

One subprocess runs every workload against real server processes; the test checks that it exits
0, printed every workload's tables and the targets, wrote a Markdown file and a chart per
workload, and that the chaos workload found every accepted run ended by exactly one
``run_complete`` (the one target that is a correctness guarantee rather than a speed).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Final

import orjson
import pytest
import trio
import trio.testing

REPO: Final = Path(__file__).resolve().parent.parent
#: Bound on the whole smoke run: about two and a half minutes on 2 idle cores (seven workloads,
#: W3 with its SSE runs), longer under load.
SMOKE_TIMEOUT: Final = 420.0
WORKLOADS: Final = {
    "W1": "Throughput",
    "W2": "Latency",
    "W3": "Fan-out",
    "W4": "Memory",
    "W5": "Chaos",
    "W6": "Soak",
    "W7": "Tool calls",
}


@pytest.mark.slow
async def test_bench_smoke_runs_every_workload(tmp_path: Path) -> None:
    with trio.fail_after(SMOKE_TIMEOUT):
        result = await trio.run_process(
            [sys.executable, "-m", "bench", "--smoke", "--out", str(tmp_path)],
            cwd=REPO,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out = result.stdout.decode()
    assert result.returncode == 0, out[-4000:] + result.stderr.decode()[-4000:]
    for key, title in WORKLOADS.items():
        assert f"## {key}: {title}" in out, f"{key} printed no table"
        assert (tmp_path / f"{key}.md").read_text().count("|---") >= 2
        assert (tmp_path / f"{key}.png").stat().st_size > 0
    assert "| workload | target | measured | limit | verdict |" in out
    assert "## Snapshots" in out
    assert "| files | first snapshot |" in out
    raw = orjson.loads((tmp_path / "results.json").read_bytes())
    assert set(raw["workloads"]) == set(WORKLOADS)
    assert raw["targets"]
    assert all(isinstance(t["met"], bool) for t in raw["targets"])
    # The paced fan-out of W3: every watcher got its run_complete, and its figures were taken.
    paced = raw["workloads"]["W3"]["paced"]
    assert paced["run_complete"] == paced["clients"] > 0, paced
    assert paced["reply_chars"] > 0
    assert paced["bytes_per_client_char"] > 0
    assert paced["frame_kinds"].get("message_delta", [0])[0] > 0, paced  # the clients asked
    # The watchers offered permessage-deflate: their sockets carried fewer bytes than the text.
    assert paced["compressed"], paced
    assert 0 < paced["wire_bytes"] < paced["bytes"], paced
    # The soak sampled the server's memory and compared two tracemalloc snapshots.
    soak = raw["workloads"]["W6"]
    assert len(soak["samples"]) >= 3, soak
    assert all(s["rss"] > 0 for s in soak["samples"]), soak
    assert soak["sites"], soak
    assert soak["traced"][1] > 0, soak
    assert soak["counts"].get("prompt http", 0) > 0, soak["counts"]
    # The tool-heavy runs: every run made its tool calls, each seen with a result that is not an
    # error, and the server's CPU per call was taken.
    tools = raw["workloads"]["W7"]
    assert tools["completed"] == tools["runs"] > 0, tools
    assert tools["tool_calls"] == tools["runs"] * tools["tool_calls_per_run"] > 0, tools
    assert tools["tool_calls_seen"] == tools["tool_calls"], tools
    assert tools["tool_errors"] == 0, tools
    assert set(tools["tool_latency"]) == set(tools["tools"])
    assert tools["cpu_per_tool_call"] > 0
    chaos = raw["workloads"]["W5"]["totals"]
    assert chaos["accepted"] > 0
    assert chaos["missing"] == 0, chaos
    assert chaos["duplicated"] == 0, chaos


async def test_the_fake_model_collects_garbage_only_when_no_reply_streams(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The benchmarks' model stands in for a service on another machine: its collector's full
    scans wait for a moment without a streaming reply, one after each stretch of requests."""
    from bench.fake import IDLE_COLLECT_POLL, collect_when_idle

    from .fake_llm import FakeLLM

    collections: list[float] = []
    monkeypatch.setattr("bench.fake.gc.collect", lambda: collections.append(trio.current_time()))
    fake = FakeLLM(record=False)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect_when_idle, fake)
            await trio.sleep(10 * IDLE_COLLECT_POLL)
            assert collections == []  # no request yet: nothing to collect
            fake.request_count, fake.streaming = 50, 50  # a burst, streaming
            await trio.sleep(10 * IDLE_COLLECT_POLL)
            assert collections == []
            fake.streaming = 0  # every reply ended
            ended = trio.current_time()
            await trio.sleep(10 * IDLE_COLLECT_POLL)
            assert len(collections) == 1
            assert collections[0] - ended <= IDLE_COLLECT_POLL
            nursery.cancel_scope.cancel()
