# crush_trio tasks. `just --list` shows them.

set shell := ["bash", "-euo", "pipefail", "-c"]

py := ".venv/bin/python"

# Run the server on the built-in echo model (or crush.json when present).
serve *ARGS:
    {{py}} -m crush_trio serve {{ARGS}}

# Run the whole test suite (CI runs exactly this). Installs ripgrep for the grep tool's tests,
# Chromium for the browser tests, and
# PostgreSQL and Redis for the cluster tests (which start their own throw-away instances), first.
test *ARGS:
    if [ -f scripts/ensure-tools.sh ]; then bash scripts/ensure-tools.sh; fi
    if [ -f scripts/ensure-browser.sh ]; then bash scripts/ensure-browser.sh; fi
    if [ -f scripts/ensure-services.sh ]; then bash scripts/ensure-services.sh; fi
    {{py}} -m pytest -q {{ARGS}}

# Lint (ruff, with the flake8-async rules) and check formatting of the package.
lint:
    .venv/bin/ruff check crush_trio tests bench
    .venv/bin/ruff format --check crush_trio

# Strict type check of the package.
typecheck:
    .venv/bin/mypy

# Wire fuzzing at length: fresh random inputs, EXAMPLES batches per kind (docs/testing.md).
fuzz EXAMPLES="2000" *ARGS:
    CRUSH_TRIO_FUZZ_EXAMPLES={{EXAMPLES}} {{py}} -m pytest -q -s -p no:cacheprovider tests/test_fuzz_wire.py {{ARGS}}

# Every benchmark workload at full size; results under bench/results/.
bench *ARGS:
    {{py}} -m bench {{ARGS}}

# Every benchmark at tiny sizes, so they cannot rot (part of the test suite too).
bench-smoke:
    {{py}} -m bench --smoke

# The HTTP API fuzzed at length by schemathesis against a live server (docs/operations.md).
fuzz-api EXAMPLES="200" *ARGS:
    CRUSH_TRIO_API_FUZZ_EXAMPLES={{EXAMPLES}} {{py}} -m pytest -q -p no:cacheprovider tests/test_openapi.py {{ARGS}}
