#!/usr/bin/env bash
# Build the book: install (scripts/setup.sh), execute every notebook listed in _toc.yml and
# write the HTML to _build/html. Runs the full edition unless ACCUMCORE_QUICK=1 is set
# (quick edition: small MNIST subsets, what CI uses).
#
# Progress: every notebook calls accumcore.lab.book.progress(), which appends a line to the
# file named by ACCUMCORE_PROGRESS ("chapter N: started", and in long chapters one line per
# finished run). This script sets that file and follows it, so the terminal shows which
# chapter is executing and how far it is, between Sphinx's own lines.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
if [ "${ACCUMCORE_QUICK:-0}" = "1" ]; then mode="quick (ACCUMCORE_QUICK=1)"; else mode="full"; fi
echo "== building the book in $mode mode"
start=$(date +%s)
rm -rf _build  # fresh: jupyter-cache would ignore ACCUMCORE_QUICK and reuse old outputs

progress_file=$(mktemp "${TMPDIR:-/tmp}/accumcore-progress.XXXXXX")
export ACCUMCORE_PROGRESS="$progress_file"
tail -n +1 -F "$progress_file" 2> /dev/null > >(sed -u 's/^/== progress /') &
follower=$!  # the tail process itself; its sed ends when tail does
cleanup() {
  kill "$follower" 2> /dev/null || true
  rm -f "$progress_file"
}
trap cleanup EXIT

export ACCUMCORE_BOOK_BUILD=1  # accumcore.lab.book.glue records for the prose
jupyter-book build . -W -n --keep-going
python scripts/check_prose_numbers.py _build/jupyter_execute/book  # numbers shown, comparisons computed
python scripts/check_prose_numbers.py --html _build/html  # no issue refs, internal paths, raw reprs, private params, repeats
sleep 1  # let the follower print the last progress line
echo "== book built in $(( $(date +%s) - start )) s ($mode mode)"
echo "== open $ROOT/_build/html/index.html"
