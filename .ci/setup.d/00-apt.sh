#!/usr/bin/env bash
# Debian packages used by the tests: HDF5 command-line tools (h5dump in the format tests) and
# Chromium (the report screenshot test, tests/analysis/test_report_browser.py) and jemalloc
# (the ranks' allocator, hpcpar/launch/allocator.py). Without apt-get the commands must be
# there already; otherwise this fails (the tests that need them would fail later, less clearly).
set -euo pipefail
if command -v apt-get >/dev/null; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends hdf5-tools chromium libjemalloc2 >/dev/null
else
    .ci/require "hdf5-tools chromium libjemalloc2" \
        h5dump chromium libjemalloc.so.2
fi
