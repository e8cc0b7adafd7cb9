#!/usr/bin/env bash
# Install everything and run every check: lint, the package, unit tests, the book (every
# notebook executed by its -W -n build, then a browser check), the benchmark smoke test, the
# other stacks of scripts/test-stacks.sh (Colab's: fast tests + nbval over every notebook; the
# declared minimum: fast tests). This is exactly what CI runs (.ci/run).
#
# Usage: bash scripts/test.sh                  every step, in order (CI)
#        bash scripts/test.sh --only STEP[,STEP]  only those steps, e.g. --only book or
#                                              --only fast,slow (setup always runs)
# Steps: lint package fast slow book bench stacks. A failing step stops the run; its name is
# printed with its output. The wall and CPU time of every step that ran, setup (.venv/)
# included, is printed at the end; the background jobs (the other stacks' venvs, a browser)
# print theirs where a step waits for them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
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
selected() { [ -z "$only" ] || [[ ",$only," == *",$1,"* ]]; }

start=$(date +%s)
summary=()
# sdist + wheel, built once by the package step; tests/test_packaging.py (slow) installs this
# wheel and tests/test_colab_install.py (every stack) installs it as the notebooks do on Colab
# (both build their own where the folder is empty: --only fast)
ACCUMCORE_DIST="$(mktemp -d)"
export ACCUMCORE_DIST
background=()  # the background jobs' pids, ended on exit
# (`|| true`: errexit holds in the trap too, and the jobs have usually ended by then)
trap 'for pid in "${background[@]}"; do kill "$pid" 2> /dev/null || true; done
      rm -rf "$ACCUMCORE_DIST"' EXIT

# children_cpu: sets $cpu to the CPU seconds (user + system) of every child of this shell that
# has ended and been waited for: a step's CPU time is the difference across it (a background
# job's counts where it is waited for). On a shared machine wall time moves with the other
# load; CPU time much less.
children_cpu() {
  local user sys total=0 part
  times > "$ACCUMCORE_DIST/times"
  { read -r _ _; read -r user sys; } < "$ACCUMCORE_DIST/times"
  for part in "$user" "$sys"; do  # e.g. 12m3.456s
    [[ $part =~ ^([0-9]+)m([0-9]+)\. ]] && total=$(( total + BASH_REMATCH[1] * 60 + BASH_REMATCH[2] ))
  done
  cpu=$total
}
# mark: starts the clock of a step; record NAME: adds its wall and CPU seconds to the summary.
mark() { t=$(date +%s); children_cpu; cpu0=$cpu; }
record() {
  children_cpu
  summary+=("$(printf '%-8s %5d s   CPU %5d s' "$1" "$(( $(date +%s) - t ))" "$(( cpu - cpu0 ))")")
}

# in_background LOG CMD...: CMD as a background job, its output and then its wall time in LOG;
# its pid is appended to $background.
in_background() {
  local log="$1"
  shift
  (
    started=$(date +%s) rc=0
    "$@" || rc=$?
    echo "== done in $(( $(date +%s) - started )) s (exit $rc)"
    exit "$rc"
  ) > "$log" 2>&1 &
  background+=("$!")
}

# The other stacks' venvs (pip: downloads, unpacking, compiling) are made in the background from
# the start, beside .venv/'s setup (pip is mostly one process: two fill the 2 cores) and the
# first steps; step_stacks waits for them and shows their log.
if selected stacks; then
  stacks_log="$ACCUMCORE_DIST/stacks-setup.log"
  in_background "$stacks_log" env STACKS_SETUP_ONLY=1 bash scripts/test-stacks.sh
  stacks_setup=$!
fi

mark
echo "== setup (.venv/: scripts/setup.sh)"
source scripts/setup.sh
export ACCUMCORE_QUICK="${ACCUMCORE_QUICK:-1}"
record setup

# A browser for the book step's browser check, installed (apt-get, where none is found) in the
# background while the unit tests run; step_book waits for it.
if selected book; then
  browser_log="$ACCUMCORE_DIST/browser-setup.log"
  in_background "$browser_log" python scripts/browser_check.py --install-only
  browser_setup=$!
fi

# wait_for NAME PID LOG: wait for a background job, show its log and how long the step waited.
wait_for() {
  local rc=0
  wait "$2" || rc=$?
  echo "== background $1 (the step waited $(( $(date +%s) - t )) s):"
  cat "$3"
  return "$rc"
}

step_lint() {
  ruff check accumcore tests benchmarks scripts
  # the GitHub Pages workflow (.github/workflows/)
  actionlint -color=false .github/workflows/*.yml
}

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

step_stacks() {  # scripts/test-stacks.sh: Colab's stack (fast tests + nbval), the minimum (fast)
  bash scripts/test-stacks.sh
}

for step in "${STEPS[@]}"; do
  selected "$step" || continue
  echo "== step '$step'"
  mark
  # The background jobs are this shell's children: waited for here, not in the step's subshell.
  # A failed one is redone by the step itself (the browser check installs, test-stacks.sh
  # remakes a venv whose pins file is missing), with its own message.
  if [ "$step" = book ]; then
    wait_for "browser installation" "$browser_setup" "$browser_log" || true
  elif [ "$step" = stacks ]; then
    wait_for "stack venvs" "$stacks_setup" "$stacks_log" || true
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
  record "$step"
done

children_cpu
echo "== time per step (wall; CPU of its processes, a background job's where it is waited for)"
printf '   %s\n' "${summary[@]}"
echo "== all checks passed in $(( $(date +%s) - start )) s (CPU $cpu s)"
