"""``python -m bench``: run the load benchmarks and write their results.

Examples::

    python -m bench                      # every workload at full size (about 12 min on 2 cores)
    python -m bench --smoke              # every workload at tiny sizes (under a minute)
    python -m bench --only W1,W3         # some workloads
    python -m bench --soak-runs 2000     # a shorter W4 soak
    python -m bench --only W6            # the mixed-load soak (60 min; memory plateau)
    python -m bench --soak-minutes 15    # a shorter one
    python -m bench --only W7            # tool-heavy runs: server CPU per tool call

A full run without ``--only`` runs W1-W5 and W7; W6 runs when named or when ``--soak-minutes`` is
given. Results go to ``bench/results/`` (``--out``): ``W1.md`` ... ``W7.md`` with a PNG chart each,
``summary.md`` (every table and the targets) and ``results.json`` (raw figures). A smoke run
writes to a temporary directory unless ``--out`` is given. The exit code is 0 when every workload
ran (targets not met are reported, not failures), 1 when a workload failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from . import snapshots
from .client import COMPRESSION_ENV, DELTAS_ENV
from .procs import PROFILING, REPO_ROOT, raise_fd_limit
from .report import WorkloadResult, machine, machine_line, targets_table, write_results
from .workloads import DEFAULT_FULL, FULL, SMOKE, WORKLOADS, Ctx

if TYPE_CHECKING:
    from collections.abc import Sequence

DEFAULT_OUT = REPO_ROOT / "bench" / "results"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Load benchmarks of the crush_trio server.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks that all workloads run")
    p.add_argument("--only", default="", help="comma-separated workloads, e.g. W1,W3")
    p.add_argument("--out", type=Path, default=None, help="results directory")
    p.add_argument("--keep-workdir", action="store_true", help="keep server logs and data")
    p.add_argument(
        "--profile",
        action="store_true",
        help="record every server with py-spy into OUT/profiles/ (needs py-spy installed)",
    )
    p.add_argument(
        "--snapshots",
        action="store_true",
        help="clients ask for whole message snapshots, not deltas=1 (for comparison)",
    )
    p.add_argument(
        "--no-compression",
        action="store_true",
        help="watch clients do not offer permessage-deflate (uncompressed frames, for comparison)",
    )
    p.add_argument("--w1-levels", type=_ints, help="W1 concurrent sessions, e.g. 1,10,50,200")
    p.add_argument("--w1-min-runs", type=int, help="W1 runs measured per level (at least)")
    p.add_argument("--w2-runs", type=int, help="W2 concurrent runs")
    p.add_argument("--w2-rounds", type=int, help="W2 measured rounds (full: 5)")
    p.add_argument(
        "--w2-peer",
        action="store_true",
        help="W2: also run the rounds against OpenCode's server (installed with npm on first "
        "use) and report the CPU ratio",
    )
    p.add_argument("--w3-clients", type=_ints, help="W3 client counts, e.g. 10,100,1000")
    p.add_argument("--w3-updates", type=int, help="W3 tokens streamed by the run")
    p.add_argument("--w3-paced-clients", type=int, help="W3 paced fan-out: websocket clients")
    p.add_argument("--w3-paced-tokens", type=int, help="W3 paced fan-out: tokens of the run")
    p.add_argument(
        "--w3-paced-sse-clients", type=int, help="W3 paced fan-out over SSE: clients per mode"
    )
    p.add_argument(
        "--w3-paced-debounce-ms",
        type=int,
        help="W3 paced fan-out: the server's publish window (default: the server's, 33 ms)",
    )
    p.add_argument(
        "--w3-sse-gzip-only",
        action="store_true",
        help="W3 paced fan-out over SSE: only clients that ask for gzip (no plain ones)",
    )
    p.add_argument(
        "--w3-sse-keepalive",
        action="store_true",
        help="W3 paced fan-out over SSE: each client asks for its stream on a kept-alive "
        "connection, after another request (as Go's HTTP client reuses idle connections)",
    )
    p.add_argument("--w4-idle", type=int, help="W4 idle websocket clients")
    p.add_argument("--w4-updates", type=int, help="W4 tokens streamed by the stalled-client run")
    p.add_argument("--soak-runs", type=int, help="W4 soak runs (full: 10,000)")
    p.add_argument("--w5-seconds", type=float, help="W5 chaos duration in seconds")
    p.add_argument("--soak-minutes", type=float, help="W6 mixed-load soak length (full: 60)")
    p.add_argument("--w7-sessions", type=int, help="W7 concurrent tool-heavy runs (full: 10)")
    p.add_argument("--w7-tool-calls", type=int, help="W7 tool calls per run (full: 80)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = dataclasses.replace(SMOKE if args.smoke else FULL)
    overrides = {
        "w1_levels": args.w1_levels,
        "w1_min_runs": args.w1_min_runs,
        "w2_runs": args.w2_runs,
        "w2_rounds": args.w2_rounds,
        "w3_clients": args.w3_clients,
        "w3_updates": args.w3_updates,
        "w3_paced_clients": args.w3_paced_clients,
        "w3_paced_tokens": args.w3_paced_tokens,
        "w3_paced_sse_clients": args.w3_paced_sse_clients,
        "w3_paced_debounce_ms": args.w3_paced_debounce_ms,
        "w4_idle": args.w4_idle,
        "w4_updates": args.w4_updates,
        "soak_runs": args.soak_runs,
        "w5_seconds": args.w5_seconds,
        "soak_minutes": args.soak_minutes,
        "w7_sessions": args.w7_sessions,
        "w7_tool_calls": args.w7_tool_calls,
    }
    sizes = dataclasses.replace(sizes, **{k: v for k, v in overrides.items() if v is not None})
    if args.w3_sse_gzip_only:
        sizes = dataclasses.replace(sizes, w3_paced_sse_plain=False)
    if args.w3_sse_keepalive:
        sizes = dataclasses.replace(sizes, w3_paced_sse_keepalive=True)
    if args.w2_peer:
        sizes = dataclasses.replace(sizes, w2_peer=True)
    default = list(WORKLOADS) if args.smoke else list(DEFAULT_FULL)
    if args.soak_minutes is not None and "W6" not in default:
        default.append("W6")
    keys = [k.strip().upper() for k in args.only.split(",") if k.strip()] or default
    unknown = [k for k in keys if k not in WORKLOADS]
    if unknown:
        print(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}", file=sys.stderr)
        return 2
    if args.snapshots:
        os.environ[DELTAS_ENV] = "0"  # inherited by the client workers
    if args.no_compression:
        os.environ[COMPRESSION_ENV] = "0"
    raise_fd_limit()
    workdir = Path(tempfile.mkdtemp(prefix="crush-bench-"))
    out = args.out or (
        Path(tempfile.mkdtemp(prefix="crush-bench-smoke-")) if args.smoke else DEFAULT_OUT
    )
    command = "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:])
    if args.profile:
        if shutil.which("py-spy") is None and not (Path(sys.executable).parent / "py-spy").exists():
            print("--profile needs py-spy: pip install py-spy", file=sys.stderr)
            return 2
        PROFILING.directory = out / "profiles"
    info = machine()
    started = time.monotonic()

    def log(line: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {line}", flush=True)

    mode = "whole message snapshots" if args.snapshots else "message deltas"
    print(
        f"crush_trio benchmarks ({'smoke' if args.smoke else 'full'}): {', '.join(keys)}; "
        f"clients get {mode}" + (", uncompressed" if args.no_compression else "")
    )
    print(f"machine: {machine_line(info)}", flush=True)
    ctx = Ctx(sizes=sizes, workdir=workdir, log=log)
    results: list[WorkloadResult] = []
    failed: list[str] = []
    for key in keys:
        t0 = time.monotonic()
        try:
            result = trio.run(WORKLOADS[key], ctx)
        except Exception:
            failed.append(key)
            log(f"{key} FAILED:\n{traceback.format_exc()}")
            continue
        result.seconds = time.monotonic() - t0
        results.append(result)
        print("\n" + result.markdown() + "\n", flush=True)
    if results:
        print(targets_table(results).markdown(), flush=True)
        paths = write_results(out, results, info, command)
        print(f"\nresults: {', '.join(str(p) for p in paths)}", flush=True)
    if not args.only:  # the snapshot store's cost (docs/performance.md "Snapshots")
        print(
            "\n" + snapshots.report([200] if args.smoke else [1000, 20000], 1 if args.smoke else 5)
        )
    if PROFILING.directory is not None:
        print(f"profiles: {PROFILING.directory} (summarize with python -m bench.profile FILE)")
    if args.keep_workdir or failed:
        print(f"work directory (server logs, data): {workdir}", flush=True)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    log(f"done; {len(results)} workload(s) ran" + (f", FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
