#!/usr/bin/env bash
# Make sure PostgreSQL and Redis server binaries are installed for the cluster tests.
#
# The tests start their own throw-away instances (tests/services.py); this script only installs
# Debian's `postgresql` and `redis-server` packages when their binaries are missing. Idempotent
# and quiet; never fails the caller: when it cannot install, the cluster tests skip and say why.
# The embedded single-node server needs neither.
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
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-services: apt-get not found; install ${need[*]} yourself to run the cluster tests" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "ensure-services: not root; install ${need[*]} yourself to run the cluster tests" >&2
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
# policy-rc.d 101: the packages must not start system-wide services; the tests start their own.
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ] && [ "$(id -u)" -eq 0 ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
fi
if $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >"$log" 2>&1 \
    || { $SUDO apt-get update -qq >>"$log" 2>&1 \
        && $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >>"$log" 2>&1; }; then
    rm -f "$log"
else
    echo "ensure-services: installing ${need[*]} failed; the cluster tests will skip. Log:" >&2
    tail -n 20 "$log" >&2
    rm -f "$log"
fi
if [ "$made_policy" -eq 1 ]; then
    rm -f "$policy"
fi
exit 0
