#!/usr/bin/env bash
# Build the book: install (scripts/setup.sh), execute every notebook listed in _toc.yml and
# write the HTML to _build/html. Runs the full experiments unless ACCUMCORE_QUICK=1 is set
# (quick mode: small MNIST subsets, what CI uses).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
if [ "${ACCUMCORE_QUICK:-0}" = "1" ]; then mode="quick (ACCUMCORE_QUICK=1)"; else mode="full"; fi
echo "== building the book in $mode mode"
start=$(date +%s)
rm -rf _build  # fresh: jupyter-cache would ignore ACCUMCORE_QUICK and reuse old outputs
jupyter-book build . -W -n --keep-going
echo "== book built in $(( $(date +%s) - start )) s ($mode mode)"
echo "== open $ROOT/_build/html/index.html"
