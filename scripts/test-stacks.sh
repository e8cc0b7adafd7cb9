#!/usr/bin/env bash
# Extra CI legs: accumcore on the other TensorFlow/Keras stacks it supports (called by
# scripts/test.sh, whose main leg runs the pinned newest stack of requirements.txt). The stacks
# and what runs on each are listed for readers in book/reference/versions.md
# (tests/test_stacks.py checks that page, the README and `import accumcore` against LEGS below).
#
# Each leg has its own venv, created here on first use and reused while its pins are unchanged,
# with two pip runs: TF/Keras pinned with the test tools (one resolver run), then keras-hub with
# requirements-no-deps.txt's regex/tokenizers and accumcore itself, all `--no-deps`, so that pip
# never replaces the TF/Keras under test (checked before testing).
#
#   colab    tensorflow-cpu 2.20.0 + keras 3.13.2 + keras-hub 0.26.0: Colab's GPU runtime
#            (googlecolab/backend-info pip-freeze.gpu.txt, read 2026-08-19; Python 3.13 there,
#            3.11 here), also the declared minimum (the oldest stack `import accumcore`
#            accepts). The fast unit tests (pytest -m "not slow": all but the multi-process
#            and soak tests) here, and every notebook in quick mode: scripts/test.sh's book
#            step executes the book on this leg's Python (STACKS_PART=kernel).
#
# Usage: bash scripts/test-stacks.sh [LEG...]              (no argument: every leg, in order)
#        STACKS_SETUP_ONLY=1 bash scripts/test-stacks.sh   (create/refresh the venvs only, in
#                                                          parallel: scripts/test.sh runs this
#                                                          in the background)
#        STACKS_PART=kernel bash scripts/test-stacks.sh LEG  (a Jupyter kernel named python3
#                                                          on the leg's venv; prints the folder
#                                                          to put in JUPYTER_PATH, so that a
#                                                          book build executes the notebooks
#                                                          there: scripts/test.sh's book step)
set -euo pipefail
case "${STACKS_PART:-}" in
  ""|kernel) ;;
  *) echo "STACKS_PART must be kernel (or empty: the fast tests), not '$STACKS_PART'" >&2
     exit 2 ;;
esac
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
export ACCUMCORE_QUICK="${ACCUMCORE_QUICK:-1}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
export TF_ENABLE_ONEDNN_OPTS="${TF_ENABLE_ONEDNN_OPTS:-0}"
if [ -z "${ACCUMCORE_MNIST_PATH:-}" ] && [ -f "$ROOT/../shared/data/mnist.npz" ]; then
  export ACCUMCORE_MNIST_PATH="$ROOT/../shared/data/mnist.npz"
fi

# LEGS: name, venv, tensorflow-cpu, keras, keras-hub, what runs ("fast", or "fast+book": also
# the book's notebooks, executed by scripts/test.sh's book step on the leg's kernel).
LEGS=(
  "colab    .venv-colab   2.20.0 3.13.2 0.26.0 fast+book"
)

# Test tools, same pins as requirements.txt (no book builder, no linter: not run on these legs;
# ipykernel: the notebooks' kernel).
TOOLS=(
  "$(grep -E '^matplotlib==' requirements.txt)"
  "$(grep -E '^pytest==' requirements.txt)"
  "$(grep -E '^pytest-xdist==' requirements.txt | cut -d' ' -f1)"
  "$(grep -E '^hypothesis==' requirements.txt)"
  "$(grep -E '^ipykernel==' requirements.txt)"
)

# pip_in DIR ARGS...: `pip install -q ARGS` in the venv DIR; keeps pip's exit status, hides the
# registry-mirror notices ("... is ignored: it is neither a file nor a directory").
pip_in() {
  local dir="$1" rc=0
  shift
  "$dir/bin/python" -m pip install -q --disable-pip-version-check "$@" > "$dir/.pip.log" 2>&1 \
    || rc=$?
  grep -v "is ignored: it is neither a file nor a directory" "$dir/.pip.log" || true
  return "$rc"
}

# make_venv DIR TF KERAS HUB: the venv DIR with tensorflow-cpu==TF, keras==KERAS, TOOLS,
# keras-hub==HUB (--no-deps, with requirements-no-deps.txt's other pins), accumcore (editable).
make_venv() {
  local dir="$1" tf="$2" keras="$3" hub="$4" t
  local nodeps
  nodeps="keras-hub==$hub $(grep -E '^(regex|tokenizers)==' requirements-no-deps.txt | tr '\n' ' ')"
  local pins="tensorflow-cpu==$tf keras==$keras ${TOOLS[*]} $nodeps"
  # accumcore's editable install holds this checkout's path and pyproject.toml's metadata
  local stamp
  stamp="$pins; pyproject.toml $(sha256sum pyproject.toml | cut -c1-16); $ROOT"
  t=$(date +%s)
  if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.accumcore-pins" 2>/dev/null)" = "$stamp" ]; then
    echo "$dir: up to date ($pins)"
  else
    echo "$dir: installing $pins"
    rm -rf "$dir"
    "$PYTHON" -m venv "$dir"
    pip_in "$dir" "tensorflow-cpu==$tf" "keras==$keras" "${TOOLS[@]}"
    # shellcheck disable=SC2086  # $nodeps is a list of requirements
    pip_in "$dir" --no-deps $nodeps -e .
    echo "$stamp" > "$dir/.accumcore-pins"
  fi
  echo "$dir: venv ready in $(( $(date +%s) - t )) s"
}

# check_stack DIR TF KERAS HUB: fail unless the venv holds exactly the stack the leg names.
check_stack() {
  "$1/bin/python" - "$2" "$3" "$4" <<'EOF'
import sys

import keras
import keras_hub
import tensorflow as tf

import accumcore

want = tuple(sys.argv[1:4])
found = (tf.__version__, keras.__version__, keras_hub.__version__)
if found != want:
    sys.exit(f"stack mismatch: want TF {want[0]} + Keras {want[1]} + keras-hub {want[2]}, "
             f"found {found}")
print(f"stack: TensorFlow {found[0]} + Keras {found[1]} + keras-hub {found[2]}, "
      f"accumcore {accumcore.__version__}, Python {sys.version.split()[0]}")
EOF
}

# run_leg NAME DIR TF KERAS HUB WHAT: the leg's fast unit tests
run_leg() {
  local name="$1" dir="$2" tf="$3" keras="$4" hub="$5" what="$6" t
  t=$(date +%s)
  echo "== stack leg '$name': tensorflow-cpu $tf + keras $keras + keras-hub $hub ($dir): $what"
  make_venv "$dir" "$tf" "$keras" "$hub"
  check_stack "$dir" "$tf" "$keras" "$hub"
  echo "== [$name] pytest -m 'not slow' (fast unit tests)"
  PATH="$ROOT/$dir/bin:$PATH" "$dir/bin/python" -m pytest tests -q -p no:cacheprovider \
    -m "not slow" -n 2
  echo "== stack leg '$name' passed in $(( $(date +%s) - t )) s"
}

# leg_kernel NAME DIR TF KERAS HUB WHAT: a kernelspec "python3" running the leg's Python (the
# notebooks name python3), in a folder of its own; prints the folder for JUPYTER_PATH (searched
# before the main .venv's kernels). Messages go to stderr.
leg_kernel() {
  local name="$1" dir="$2" tf="$3" keras="$4" hub="$5" what="$6"
  if [ "$what" != fast+book ]; then
    echo "stack leg '$name' runs no notebooks (LEGS: $what)" >&2
    return 2
  fi
  make_venv "$dir" "$tf" "$keras" "$hub" >&2
  check_stack "$dir" "$tf" "$keras" "$hub" >&2
  rm -rf "${dir:?}/book-kernel"
  # (ipykernel warns that the folder is not on Jupyter's default path: JUPYTER_PATH adds it)
  "$dir/bin/python" -m ipykernel install --prefix "$ROOT/$dir/book-kernel" --name python3 \
    --display-name "Python 3 ($name stack)" > "$dir/.kernel.log" 2>&1 \
    || { cat "$dir/.kernel.log" >&2; return 1; }
  echo "$ROOT/$dir/book-kernel/share/jupyter"
}

names=()
for leg in "${LEGS[@]}"; do
  read -r name _ <<< "$leg"
  names+=("$name")
done
wanted=("$@")
[ ${#wanted[@]} -eq 0 ] && wanted=("${names[@]}")
selected=()
for want in "${wanted[@]}"; do
  found=""
  for leg in "${LEGS[@]}"; do
    read -r name _ <<< "$leg"
    [ "$name" = "$want" ] && found="$leg"
  done
  [ -n "$found" ] || { echo "unknown leg '$want' (use: ${names[*]})" >&2; exit 2; }
  selected+=("$found")
done

if [ "${STACKS_SETUP_ONLY:-0}" = 1 ]; then
  # Every venv at once: pip is mostly one process unpacking and compiling, so two fill 2 cores.
  pids=()
  for leg in "${selected[@]}"; do
    read -r name dir tf keras hub _ <<< "$leg"
    (make_venv "$dir" "$tf" "$keras" "$hub" 2>&1 | sed "s/^/[$name] /") &
    pids+=($!)
  done
  rc=0
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  exit "$rc"
fi
if [ "${STACKS_PART:-}" = kernel ]; then
  [ ${#selected[@]} -eq 1 ] || { echo "STACKS_PART=kernel takes one leg" >&2; exit 2; }
  # shellcheck disable=SC2086  # the leg's fields
  leg_kernel ${selected[0]}
  exit
fi
for leg in "${selected[@]}"; do
  # shellcheck disable=SC2086  # the leg's fields
  run_leg $leg
done
