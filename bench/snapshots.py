"""Cost of a workspace snapshot (the shadow git store of :mod:`crush_trio.changes.shadow`).

Usage::

    python -m bench.snapshots [--files 1000,20000] [--rounds 5]

For each size, builds a tree of that many files (about 1 KiB each, 100 per directory) in a
temporary directory and times, with the same code the server runs:

- the first snapshot (every file hashed into the shadow database);
- a snapshot when nothing changed (the index's stat data answers: no file is read);
- a snapshot after 10 files were modified, one added and one deleted, and the diff of it;
- a snapshot after 10% of the files were modified.

Prints a Markdown table (milliseconds, median of ``--rounds``). ``python -m bench --smoke`` runs it
at a tiny size so it cannot rot.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from crush_trio.changes.shadow import ShadowRepo

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

PER_DIR = 100
BODY = ("x" * 63 + "\n") * 16  # 1 KiB


def build(root: Path, files: int) -> list[Path]:
    paths = []
    for i in range(files):
        directory = root / f"d{i // PER_DIR:04}"
        if i % PER_DIR == 0:
            directory.mkdir(parents=True)
        path = directory / f"f{i:06}.txt"
        path.write_text(f"{i}\n{BODY}")
        paths.append(path)
    return paths


def _time(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


def measure(files: int, rounds: int) -> dict[str, float]:
    """Milliseconds of each snapshot kind for a tree of ``files`` files."""
    tmp = Path(tempfile.mkdtemp(prefix="crush-snap-bench-"))
    try:
        root = tmp / "ws"
        paths = build(root, files)
        repo = ShadowRepo(root, tmp / "shadow")
        repo.init()
        first = _time(repo.snapshot)
        unchanged = [_time(repo.snapshot) for _ in range(rounds)]
        small, diffs = [], []
        for r in range(rounds):
            before = repo.snapshot()
            for path in paths[r * 10 : r * 10 + 10]:
                path.write_text(f"changed {r}\n{BODY}")
            (root / f"new{r}.txt").write_text("new\n")
            (root / f"new{r - 1}.txt").unlink(missing_ok=True)
            small.append(_time(repo.snapshot))
            after = repo.snapshot()
            diffs.append(_time(lambda b=before, a=after: repo.patch(b, a, None, 1 << 20)))
        big = []
        step = max(1, files // 10)
        for r in range(rounds):
            for path in paths[r % 10 :: 10][:step]:
                path.write_text(f"big change {r}\n{BODY}")
            big.append(_time(repo.snapshot))
        return {
            "files": files,
            "first": first,
            "unchanged": statistics.median(unchanged),
            "small_change": statistics.median(small),
            "diff": statistics.median(diffs),
            "tenth_changed": statistics.median(big),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def table(rows: Sequence[dict[str, float]]) -> str:
    lines = [
        "## Snapshots",
        "",
        "| files | first snapshot | no change | 10 changed +1 -1 | its diff | 10% changed |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['files']:,.0f} | {row['first']:.0f} ms | {row['unchanged']:.0f} ms | "
            f"{row['small_change']:.0f} ms | {row['diff']:.0f} ms | "
            f"{row['tenth_changed']:.0f} ms |"
        )
    return "\n".join(lines)


def report(sizes: Sequence[int], rounds: int) -> str:
    return table([measure(n, rounds) for n in sizes])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.snapshots", description=__doc__)
    parser.add_argument("--files", default="1000,20000", help="tree sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per measure (median)")
    parser.add_argument("--smoke", action="store_true", help="one tiny tree, one round")
    args = parser.parse_args(argv)
    sizes = [200] if args.smoke else [int(x) for x in args.files.split(",") if x.strip()]
    print(report(sizes, 1 if args.smoke else args.rounds), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
