#!/usr/bin/env bash
# Install Debian packages that tests need, for scripts/ensure-*.sh.
#
# Usage: apt-install.sh WHAT PACKAGE...   (WHAT names the tests that need them, for messages)
# Needs root or password-less sudo, and apt-get. Never fails the caller: when it cannot install,
# it says why on stderr and the tests that need the packages skip and say why too. The packages
# must not start system-wide services (policy-rc.d answers 101 while they install); the tests
# start their own throw-away instances.
set -uo pipefail

what=$1
shift
if ! command -v apt-get >/dev/null 2>&1; then
    echo "apt-install: apt-get not found; install $* yourself to run $what" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "apt-install: not root; install $* yourself to run $what" >&2
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
policy=/usr/sbin/policy-rc.d
made_policy=0
if [ ! -e "$policy" ] && [ "$(id -u)" -eq 0 ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
fi
log=$(mktemp)
if $SUDO apt-get install -y -qq --no-install-recommends "$@" >"$log" 2>&1 \
    || { $SUDO apt-get update -qq >>"$log" 2>&1 \
        && $SUDO apt-get install -y -qq --no-install-recommends "$@" >>"$log" 2>&1; }; then
    :
else
    echo "apt-install: installing $* failed; $what will skip. Log:" >&2
    tail -n 20 "$log" >&2
fi
rm -f "$log"
if [ "$made_policy" -eq 1 ]; then
    rm -f "$policy"
fi
exit 0
