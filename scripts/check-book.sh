#!/usr/bin/env bash
# Book checks, run by scripts/test.sh after the unit tests (quick mode by default):
#   (a) nbval: every notebook in book/ executes without error (their cells assert each claim);
#   (b) a clean `jupyter-book build` of whatever _toc.yml lists, warnings as errors (-W -n);
#   (c) headless Chromium opens every built page: page exists, images load, MathJax renders
#       (offline, vendored), Colab launch links are right (scripts/browser_check.py; it uses
#       an installed Chromium or Chrome, and skips only with ACCUMCORE_SKIP_BROWSER=1 outside CI).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
export ACCUMCORE_QUICK="${ACCUMCORE_QUICK:-1}"
total=$(date +%s)

echo "== book (a): nbval over book/ (ACCUMCORE_QUICK=$ACCUMCORE_QUICK)"
t=$(date +%s)
python -m pytest --nbval-lax -p no:cacheprovider -q book/
echo "== book (a) passed in $(( $(date +%s) - t )) s"

echo "== book (b): clean jupyter-book build -W -n"
t=$(date +%s)
rm -rf _build
jupyter-book build . -W -n --keep-going
echo "== book (b) passed in $(( $(date +%s) - t )) s"

echo "== book (c): browser test (headless Chromium)"
t=$(date +%s)
# An existing Chromium/Chrome (PATH, or $ACCUMCORE_CHROMIUM / $ACCUMCORE_CHROMEDRIVER) is used;
# Debian's is installed with apt-get only where that works (root); otherwise one line says how
# to install one, or to skip this step locally with ACCUMCORE_SKIP_BROWSER=1 (never in CI).
python scripts/browser_check.py --install-missing
echo "== book (c) passed in $(( $(date +%s) - t )) s"

echo "== book checks passed in $(( $(date +%s) - total )) s"
