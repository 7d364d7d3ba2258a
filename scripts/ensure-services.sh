#!/usr/bin/env bash
# Make sure PostgreSQL and Redis server binaries are installed for the cluster tests.
#
# The tests start their own throw-away instances (tests/services.py); this script only installs
# Debian's `postgresql` and `redis-server` packages when their binaries are missing
# (scripts/apt-install.sh: needs root, as on CI machines). Idempotent and quiet; never fails the
# caller: when it cannot install, the cluster tests skip and say why. The embedded single-node
# server needs neither.
set -uo pipefail

need=()
if ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null && ! command -v initdb >/dev/null 2>&1; then
    need+=(postgresql)
fi
if ! command -v redis-server >/dev/null 2>&1; then
    need+=(redis-server)
fi
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
exec bash "$(dirname "$0")/apt-install.sh" "the cluster tests" "${need[@]}"
