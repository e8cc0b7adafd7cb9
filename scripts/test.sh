#!/usr/bin/env bash
# Install everything and run every check: lint, the package, unit tests, the book (every
# notebook executed by its -W -n build on the pinned stack, then the prose and browser checks),
# the benchmark smoke test, the other stack of scripts/test-stacks.sh (Colab's, on Python 3.13,
# the declared minimum: its fast tests, then every notebook under nbval). Each notebook is
# executed once per stack. This is exactly what CI runs (.ci/run).
#
# Usage: bash scripts/test.sh                  every step (CI)
#        bash scripts/test.sh --only STEP[,STEP]  only those steps, e.g. --only book or
#                                              --only fast,slow (setup always runs)
# Steps: lint package fast slow book bench stacks. The order, for 2 cores:
#   1. lint, package, fast (pytest -n 2), then the stacks step's fast tests (pytest -n 2) and
#      its nbval (two notebooks at a time, pytest-xdist): one at a time, their output as it
#      comes;
#   2. the one-process steps, two at a time (longest first: book, slow, bench; the next
#      starts when one ends): each writes its own log, shown whole, its name first, when it
#      ends (a phase of one step runs as in 1).
# A failing step stops the run, with its name and its output; the other steps and every
# background job are ended (with their child processes). The wall and CPU time of every step
# that ran, setup (.venv/) included, is printed at the end; the background jobs (the other
# stack's venv, a browser) print theirs where the run waits for them.
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
# The background jobs' pids: each job is started in a process group of its own (`set -m`
# around the `&`: the group's id is the job's pid), ended on exit with everything in it.
background=()
# descendants PID: the pids of PID's children, grandchildren, ... (pip's, pytest's, Chromium's)
descendants() {
  local child
  for child in $(pgrep -P "$1" 2> /dev/null); do
    echo "$child"
    descendants "$child"
  done
}
# end_background: every background job's process group (which also holds the children that
# outlived a job's own shell), and any descendant that left the group (a new session), listed
# first and then ended together. `|| true`: errexit holds in the trap too, and the jobs have
# usually ended by then.
end_background() {
  local pid pids=()
  for pid in "${background[@]}"; do
    # shellcheck disable=SC2207  # pids are words
    pids+=($(descendants "$pid"))
  done
  for pid in "${background[@]}"; do kill -- "-$pid" 2> /dev/null || true; done
  if [ ${#pids[@]} -gt 0 ]; then kill "${pids[@]}" 2> /dev/null || true; fi
}
trap 'end_background; rm -rf "$ACCUMCORE_DIST"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# cpu_in FILE: sets $cpu to the CPU seconds (user + system) of the children line of `times`'
# output in FILE. children_cpu: sets $cpu to that of every child of this shell that has ended
# (bash reaps them as they end): a step's CPU time is the difference across it (a background
# job's counts where it ends). On a shared machine wall time moves with the other load; CPU
# time much less.
cpu_in() {
  local user sys total=0 part
  { read -r _ _; read -r user sys; } < "$1"
  for part in "$user" "$sys"; do  # e.g. 12m3.456s
    [[ $part =~ ^([0-9]+)m([0-9]+)\. ]] && total=$(( total + BASH_REMATCH[1] * 60 + BASH_REMATCH[2] ))
  done
  cpu=$total
}
children_cpu() {
  times > "$ACCUMCORE_DIST/times"
  cpu_in "$ACCUMCORE_DIST/times"
}
# mark: starts the clock of a step; record NAME [NOTE]: adds its wall and CPU seconds to the
# summary; add_summary NAME WALL CPU [NOTE]: the same for a step timed elsewhere.
add_summary() {
  summary+=("$(printf '%-17s %5d s   CPU %5d s%s' "$1" "$2" "$3" "${4:+   $4}")")
}
mark() { t=$(date +%s); children_cpu; cpu0=$cpu; }
record() {
  children_cpu
  add_summary "$1" "$(( $(date +%s) - t ))" "$(( cpu - cpu0 ))" "${2:-}"
}

# in_background LOG CMD...: CMD as a background job, its output and then its wall time in LOG;
# its pid is appended to $background.
in_background() {
  local log="$1"
  shift
  set -m  # a process group of its own (end_background)
  (
    started=$(date +%s) rc=0
    "$@" || rc=$?
    echo "== done in $(( $(date +%s) - started )) s (exit $rc)"
    exit "$rc"
  ) < /dev/null > "$log" 2>&1 &
  set +m
  background+=("$!")
}

# The other stacks' venvs (pip: downloads, unpacking, compiling) are made in the background from
# the start, beside .venv/'s setup (pip is mostly one process: two fill the 2 cores) and the
# first steps; the stacks step waits for them and shows their log. Their Pythons are found
# first: a missing one (Colab's 3.13) stops the run at once, with one line saying how to
# install it.
if selected stacks; then
  STACKS_PART=python bash scripts/test-stacks.sh
  stacks_log="$ACCUMCORE_DIST/stacks-setup.log"
  in_background "$stacks_log" env STACKS_SETUP_ONLY=1 bash scripts/test-stacks.sh
  stacks_setup=$!
fi

mark
echo "== setup (.venv/: scripts/setup.sh)"
source scripts/setup.sh
export ACCUMCORE_QUICK="${ACCUMCORE_QUICK:-1}"
record setup
# The pinned stack and its Python (Colab's leg prints its own: scripts/test-stacks.sh)
python -c "import sys; from importlib.metadata import version as v; print('== pinned stack' \
  ' (.venv/): Python', sys.version.split()[0], '(' + sys.executable + '), TensorFlow', \
  v('tensorflow-cpu'), '+ Keras', v('keras'), '+ keras-hub', v('keras-hub'))"

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

step_book() {  # every notebook executed by the -W -n build (pinned stack), prose and browser
  bash scripts/check-book.sh
}

step_bench() {  # quick mode: checks the outputs are well-formed, never a speed
  local out
  out="$(mktemp -d)"
  python benchmarks/run.py --quick --out "$out"
  python benchmarks/run.py --check "$out"
  rm -rf "$out"
}

# The stacks step in two parts (scripts/test-stacks.sh: Colab's stack on Python 3.13, the
# declared minimum), each on 2 processes, alone: its fast tests, then nbval over every notebook.
step_stacks_fast() { STACKS_PART=fast bash scripts/test-stacks.sh; }
step_stacks_nbval() { STACKS_PART=nbval bash scripts/test-stacks.sh; }

# label ID: the name a step (or part) is shown and summed up under.
label() {
  case "$1" in
    stacks_fast) echo "stacks (fast)" ;;
    stacks_nbval) echo "stacks (nbval)" ;;
    *) echo "$1" ;;
  esac
}

# run_step ID: the step in the foreground, its output as it comes; a failure ends the run.
run_step() {
  local rc
  echo "== step '$(label "$1")'"
  mark
  # A subshell with errexit, outside any `if` (where bash would ignore errexit): the first
  # failing command fails the step.
  set +e
  (set -e; "step_$1")
  rc=$?
  set -e
  if [ "$rc" -ne 0 ]; then
    echo "== step '$(label "$1")' FAILED (exit $rc) after $(( $(date +%s) - t )) s" >&2
    exit "$rc"
  fi
  record "$(label "$1")"
}

# start_step ID: the step as a background job, its output in its own log; when it ends, it
# writes its exit status, wall seconds and `times` (the CPU of its processes) beside the log.
start_step() {
  local out="$ACCUMCORE_DIST/step-$1"
  set -m  # a process group of its own (end_background)
  (
    started=$(date +%s)
    set +e
    (set -e; "step_$1")
    rc=$?
    times > "$out.times"
    echo "$rc $(( $(date +%s) - started ))" > "$out.status"
    exit "$rc"
  ) < /dev/null > "$out.log" 2>&1 &
  set +m
  background+=("$!")
  step_of[$!]="$1"
  echo "== step '$(label "$1")' started (its output follows when it ends)"
}

# run_two_at_a_time ID...: the steps, two at a time in the order given (the next starts when
# one ends); each one's log is shown whole when it ends, its name first. A failure ends the run
# (the trap ends the other step).
declare -A step_of=()
run_two_at_a_time() {
  local queue=("$@") running=() pid p id rc wall left
  if [ ${#queue[@]} -eq 1 ]; then run_step "${queue[0]}"; return; fi
  local phase=$SECONDS
  while [ ${#queue[@]} -gt 0 ] || [ ${#running[@]} -gt 0 ]; do
    while [ ${#running[@]} -lt 2 ] && [ ${#queue[@]} -gt 0 ]; do
      start_step "${queue[0]}"
      running+=("$!")
      queue=("${queue[@]:1}")
    done
    rc=0
    wait -n -p pid "${running[@]}" || rc=$?
    id="${step_of[$pid]}"
    left=()
    for p in "${running[@]}"; do
      if [ "$p" != "$pid" ]; then left+=("$p"); fi
    done
    running=("${left[@]}")
    # the step's own status and wall time (none where it was killed: wait's status then)
    if [ -f "$ACCUMCORE_DIST/step-$id.status" ]; then
      read -r rc wall < "$ACCUMCORE_DIST/step-$id.status"
    else
      wall=$(( SECONDS - phase ))
      if [ "$rc" -eq 0 ]; then rc=1; fi
    fi
    echo "== step '$(label "$id")' (ran beside other steps), its output:"
    cat "$ACCUMCORE_DIST/step-$id.log"
    if [ "$rc" -ne 0 ]; then
      echo "== step '$(label "$id")' FAILED (exit $rc) after $wall s" >&2
      exit "$rc"
    fi
    cpu=0
    if [ -f "$ACCUMCORE_DIST/step-$id.times" ]; then cpu_in "$ACCUMCORE_DIST/step-$id.times"; fi
    add_summary "$(label "$id")" "$wall" "$cpu" "(two at a time)"
    echo "== step '$(label "$id")' passed in $wall s"
  done
  summary+=("   the steps marked (two at a time) took $(( SECONDS - phase )) s together")
}

# 1. one at a time. The background jobs are this shell's children: waited for here, not in a
# step's subshell. A failed one is redone by the step itself (the browser check installs,
# test-stacks.sh remakes a venv whose pins file is missing), with its own message.
for step in lint package fast; do
  if selected "$step"; then run_step "$step"; fi
done
if selected stacks; then
  mark
  wait_for "stack venv" "$stacks_setup" "$stacks_log" || true
  record "(waited: venv)"
  run_step stacks_fast
  run_step stacks_nbval
fi
# 2. the one-process steps, two at a time, longest first
if selected book; then
  mark
  wait_for "browser installation" "$browser_setup" "$browser_log" || true
  record "(waited: browser)"
fi
queue=()
for step in book slow bench; do
  if selected "$step"; then queue+=("$step"); fi
done
if [ ${#queue[@]} -gt 0 ]; then run_two_at_a_time "${queue[@]}"; fi

children_cpu
echo "== time per step (wall; CPU of its processes, a background job's where it ends)"
printf '   %s\n' "${summary[@]}"
echo "== all checks passed in $(( $(date +%s) - start )) s (CPU $cpu s)"
