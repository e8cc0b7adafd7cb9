#!/usr/bin/env bash
# Install everything and run every check: lint, the package, unit tests, notebooks, book build,
# browser test, benchmark smoke test, the Colab stack.
# This is exactly what CI runs (.ci/run).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
export ACCUMCORE_QUICK="${ACCUMCORE_QUICK:-1}"
start=$(date +%s)

echo "== ruff"
ruff check accumcore tests benchmarks scripts

echo "== actionlint: the GitHub Pages workflow (.github/workflows/)"
actionlint -color=false .github/workflows/*.yml

echo "== package: python -m build (sdist + wheel), twine check"
dist="$(mktemp -d)"
trap 'rm -rf "$dist"' EXIT
python -m build --outdir "$dist" . > "$dist/build.log" 2>&1 || { cat "$dist/build.log"; exit 1; }
twine check --strict "$dist"/*.whl "$dist"/*.tar.gz
export ACCUMCORE_DIST="$dist"  # tests/test_packaging.py installs this wheel into a fresh venv

echo "== pytest: fast unit tests, 2 processes (pytest-xdist)"
python -m pytest tests -q -p no:cacheprovider -m "not slow" -n 2
echo "== pytest: slow tests (multi-process, soak), one at a time"
python -m pytest tests -q -p no:cacheprovider -m slow

bash scripts/check-book.sh  # book: nbval over book/, clean build with -W -n, browser test

echo "== benchmarks smoke test (quick mode: checks the outputs are well-formed, never a speed)"
bench_out="$(mktemp -d)"
python benchmarks/run.py --quick --out "$bench_out"
python benchmarks/run.py --check "$bench_out"
rm -rf "$bench_out"

bash scripts/test-stacks.sh  # Colab's TF 2.19 + Keras 3.10: fast unit tests + nbval

echo "== all checks passed in $(( $(date +%s) - start )) s"
