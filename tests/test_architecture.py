"""The import rules of docs/architecture.md ("Import rules"), checked in CI.

The rules are import-linter contracts in ``pyproject.toml`` (``[tool.importlinter]``); the first
test runs ``lint-imports`` on this checkout and fails, naming the import, when one is broken. The
second shows that the contracts bite: a copy of the package with three wrong arrows fails them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
#: Bound on one ``lint-imports`` run (building the graph takes about a second).
LINT_TIMEOUT: Final = 120.0


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the ``crush_trio`` package under ``root``, with the contracts of
    ``root/pyproject.toml``."""
    command = Path(sys.executable).with_name("lint-imports")
    assert command.exists(), (
        f"{command} is missing: install the test extra (pip install -e '.[test]'), which "
        "brings import-linter"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [str(command), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=LINT_TIMEOUT,
        check=False,
    )


def test_the_import_rules_hold() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 5 kept, 0 broken." in result.stdout, result.stdout


def test_a_wrong_arrow_breaks_its_contract(tmp_path: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    package = tmp_path / "crush_trio"
    shutil.copytree(ROOT / "crush_trio", package, ignore=shutil.ignore_patterns("__pycache__"))
    # The kernel reaches for an event loop, the client for the server, and the store for the
    # agent, which already reaches the store: a cycle between siblings too.
    with (package / "core" / "holds.py").open("a") as f:
        f.write("\nimport trio as _trio\n")
    with (package / "client" / "events.py").open("a") as f:
        f.write("\nfrom ..server import settings as _settings\n")
    with (package / "store" / "rows.py").open("a") as f:
        f.write("\nfrom ..agent import runs as _runs\n")

    result = lint_imports(tmp_path)

    out = result.stdout
    assert result.returncode != 0, out
    assert "crush_trio.core is not allowed to import trio" in out, out
    assert "crush_trio.client is not allowed to import crush_trio.server" in out, out
    assert "crush_trio.store is not allowed to import crush_trio.agent" in out, out
    assert "No cycles are allowed in crush_trio." in out, out
    assert "Contracts: 1 kept, 4 broken." in out, out
