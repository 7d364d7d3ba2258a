#!/usr/bin/env bash
# Make sure the programs the tool tests drive are installed: ripgrep (the grep tool's fast path).
#
# Idempotent and quiet: does nothing when `rg` is on PATH; otherwise installs Debian's `ripgrep`
# with scripts/apt-install.sh. Never fails the caller: when it cannot install, those tests skip
# and say why.
set -uo pipefail

if command -v rg >/dev/null 2>&1; then
    exit 0
fi
exec bash "$(dirname "$0")/apt-install.sh" "the ripgrep tests" ripgrep
