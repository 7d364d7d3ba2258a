#!/usr/bin/env bash
# Make sure Debian's Chromium is installed for the browser end-to-end tests.
#
# Idempotent and quiet: does nothing when /usr/bin/chromium exists; otherwise installs the
# `chromium` package with apt-get (needs root, as on CI machines). Never fails the caller:
# when it cannot install, the browser tests skip and say why.
set -uo pipefail

if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-browser: apt-get not found; install chromium yourself to run the browser tests" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "ensure-browser: not root; install chromium yourself to run the browser tests" >&2
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
if $SUDO apt-get update -qq >"$log" 2>&1 \
    && $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >>"$log" 2>&1; then
    rm -f "$log"
    exit 0
fi
echo "ensure-browser: installing chromium failed; the browser tests will skip. Log:" >&2
tail -n 20 "$log" >&2
rm -f "$log"
exit 0
