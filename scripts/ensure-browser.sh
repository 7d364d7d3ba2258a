#!/usr/bin/env bash
# Make sure Debian's Chromium is installed for the browser end-to-end tests.
#
# Idempotent and quiet: does nothing when /usr/bin/chromium exists; otherwise installs the
# `chromium` package with apt-get (scripts/apt-install.sh: needs root, as on CI machines). Never
# fails the caller: when it cannot install, the browser tests skip and say why.
set -uo pipefail

if [ -x /usr/bin/chromium ]; then
    exit 0
fi
exec bash "$(dirname "$0")/apt-install.sh" "the browser tests" chromium fonts-dejavu-core
