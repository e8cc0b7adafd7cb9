#!/usr/bin/env bash
# Install everything and run every check: lint, the package, unit tests, the book (every
# notebook executed by its -W -n build, then a browser check), the benchmark smoke test, the
# Colab stack (fast tests + nbval over every notebook). This is exactly what CI runs (.ci/run).
#
# Usage: bash scripts/test.sh                  every step, in order (CI)
#        bash scripts/test.sh --only STEP[,STEP]  only those steps, e.g. --only book or
#                                              --only fast,slow (setup always runs)
# Steps: lint package fast slow book bench stacks. A failing step stops the run; its name is
# printed with its output. The time of every step that ran is printed at the end.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
export ACCUMCORE_QUICK="${ACCUMCORE_QUICK:-1}"
STEPS=(lint package fast slow book bench stacks)

only=""
if [ "${1:-}" = "--only" ]; then
  only="${2:?--only needs a step name: ${STEPS[*]}}"
  for step in ${only//,/ }; do
    [[ " ${STEPS[*]} " == *" $step "* ]] || { echo "unknown step '$step' (${STEPS[*]})" >&2; exit 2; }
  done
elif [ $# -gt 0 ]; then
  echo "usage: bash scripts/test.sh [--only STEP[,STEP]]  (steps: ${STEPS[*]})" >&2
  exit 2
fi

step_lint() {
  ruff check accumcore tests benchmarks scripts
  # the GitHub Pages workflow (.github/workflows/)
  actionlint -color=false .github/workflows/*.yml
}

# sdist + wheel, built once by the package step; tests/test_packaging.py (slow) installs this
# wheel (it builds its own where the folder is empty: --only slow)
ACCUMCORE_DIST="$(mktemp -d)"
export ACCUMCORE_DIST
trap 'rm -rf "$ACCUMCORE_DIST"' EXIT

step_package() {  # metadata checked
  python -m build --outdir "$ACCUMCORE_DIST" . > "$ACCUMCORE_DIST/build.log" 2>&1 \
    || { cat "$ACCUMCORE_DIST/build.log"; return 1; }
  rm "$ACCUMCORE_DIST/build.log"
  twine check --strict "$ACCUMCORE_DIST"/*.whl "$ACCUMCORE_DIST"/*.tar.gz
}

step_fast() {  # the fast unit tests on 2 processes (pytest-xdist)
  python -m pytest tests -q -p no:cacheprovider -m "not slow" -n 2
}

step_slow() {  # multi-process, soak and packaging tests, one at a time
  python -m pytest tests -q -p no:cacheprovider -m slow
}

step_book() {  # every notebook executed by the -W -n build, then the browser check
  bash scripts/check-book.sh
}

step_bench() {  # quick mode: checks the outputs are well-formed, never a speed
  local out
  out="$(mktemp -d)"
  python benchmarks/run.py --quick --out "$out"
  python benchmarks/run.py --check "$out"
  rm -rf "$out"
}

step_stacks() {  # Colab's TF 2.19 + Keras 3.10: fast unit tests + nbval
  cat "$stacks_log"  # its venv, made in the background meanwhile (waited for below)
  bash scripts/test-stacks.sh
}

start=$(date +%s)
summary=()
# The Colab stack's venv (a minute of pip, mostly downloads and unpacking) is made in the
# background while the first steps run; step_stacks waits for it and shows its log.
if [ -z "$only" ] || [[ ",$only," == *",stacks,"* ]]; then
  stacks_log="$ACCUMCORE_DIST.stacks-setup.log"
  STACKS_SETUP_ONLY=1 bash scripts/test-stacks.sh > "$stacks_log" 2>&1 &
  stacks_setup=$!
  # (`|| true`: errexit holds in the trap too, and the setup has usually ended by then)
  trap 'kill "$stacks_setup" 2> /dev/null || true; rm -rf "$ACCUMCORE_DIST" "$stacks_log"' EXIT
fi
for step in "${STEPS[@]}"; do
  if [ -n "$only" ] && [[ ",$only," != *",$step,"* ]]; then
    continue
  fi
  echo "== step '$step'"
  t=$(date +%s)
  if [ "$step" = stacks ]; then
    wait "$stacks_setup" || echo "== the background setup of the Colab stack failed: retried" >&2
  fi
  # A subshell with errexit, outside any `if` (where bash would ignore errexit): the first
  # failing command fails the step.
  set +e
  (set -e; "step_$step")
  rc=$?
  set -e
  if [ "$rc" -ne 0 ]; then
    echo "== step '$step' FAILED (exit $rc) after $(( $(date +%s) - t )) s" >&2
    exit "$rc"
  fi
  summary+=("$(printf '%-8s %5d s' "$step" "$(( $(date +%s) - t ))")")
done

echo "== time per step"
printf '   %s\n' "${summary[@]}"
echo "== all checks passed in $(( $(date +%s) - start )) s"
