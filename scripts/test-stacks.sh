#!/usr/bin/env bash
# Extra CI legs: accumcore on the other TensorFlow/Keras stacks it supports (called at the end of
# scripts/test.sh, whose main leg runs the pinned newest stack of requirements.txt).
#
# Each leg has its own venv (.venv-tf219), created here on first use and reused while its pins
# are unchanged. TF/Keras are installed first, pinned, with the test tools; then accumcore with
# `--no-deps`, so that pip never replaces the TF/Keras under test (checked before testing).
#
#   colab  tensorflow-cpu 2.19.0 + keras 3.10.0: Colab's runtime and accumcore's declared
#          minimum. The fast unit tests (pytest -m "not slow": all but the multi-process and
#          soak tests) and every notebook in quick mode under nbval (--nbval-lax). With
#          keras-hub 0.21.1 (the newest that allows Keras 3.10; 0.26+ needs 3.13), installed
#          --no-deps with the rest of requirements-no-deps.txt (see there why).
#
# Usage: bash scripts/test-stacks.sh [colab]            (no argument: every leg)
#        STACKS_SETUP_ONLY=1 bash scripts/test-stacks.sh   (create/refresh the venvs only)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
export ACCUMCORE_QUICK="${ACCUMCORE_QUICK:-1}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
export TF_ENABLE_ONEDNN_OPTS="${TF_ENABLE_ONEDNN_OPTS:-0}"
if [ -z "${ACCUMCORE_MNIST_PATH:-}" ] && [ -f "$ROOT/../shared/data/mnist.npz" ]; then
  export ACCUMCORE_MNIST_PATH="$ROOT/../shared/data/mnist.npz"
fi

# Test tools, same pins as requirements.txt (no book builder, no linter: not run on these legs).
TOOLS=(
  "$(grep -E '^matplotlib==' requirements.txt)"
  "$(grep -E '^pytest==' requirements.txt)"
  "$(grep -E '^pytest-xdist==' requirements.txt | cut -d' ' -f1)"
  "$(grep -E '^hypothesis==' requirements.txt)"
  "$(grep -E '^nbval==' requirements.txt)"
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
# keras-hub==HUB (--no-deps, with requirements-no-deps.txt's other pins), accumcore.
make_venv() {
  local dir="$1" tf="$2" keras="$3" hub="$4"
  local nodeps
  nodeps="keras-hub==$hub $(grep -E '^(regex|tokenizers)==' requirements-no-deps.txt | tr '\n' ' ')"
  local pins="tensorflow-cpu==$tf keras==$keras ${TOOLS[*]} $nodeps"
  if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.accumcore-pins" 2>/dev/null)" = "$pins" ]; then
    echo "$dir: up to date ($pins)"
  else
    echo "$dir: installing $pins"
    rm -rf "$dir"
    "$PYTHON" -m venv "$dir"
    pip_in "$dir" "tensorflow-cpu==$tf" "keras==$keras" "${TOOLS[@]}"
    # shellcheck disable=SC2086  # $nodeps is a list of requirements
    pip_in "$dir" --no-deps $nodeps
    echo "$pins" > "$dir/.accumcore-pins"
  fi
  pip_in "$dir" --no-deps -e .
  # The leg must test the stack it names: fail if pip (or anything) replaced TF or Keras.
  "$dir/bin/python" - "$tf" "$keras" <<'EOF'
import sys

import keras
import keras_hub
import tensorflow as tf

import accumcore

want = (sys.argv[1], sys.argv[2])
found = (tf.__version__, keras.__version__)
if found != want:
    sys.exit(f"stack mismatch: want TF {want[0]} + Keras {want[1]}, found {found}")
print(f"stack: TensorFlow {found[0]} + Keras {found[1]}, keras-hub {keras_hub.__version__}, "
      f"accumcore {accumcore.__version__}")
EOF
}

# run_leg NAME DIR TF KERAS HUB NOTEBOOKS(0/1)
run_leg() {
  local name="$1" dir="$2" tf="$3" keras="$4" hub="$5" notebooks="$6" t
  t=$(date +%s)
  echo "== stack leg '$name': tensorflow-cpu $tf + keras $keras ($dir)"
  make_venv "$dir" "$tf" "$keras" "$hub"
  [ "${STACKS_SETUP_ONLY:-0}" = 1 ] && return 0
  echo "== [$name] pytest -m 'not slow' (fast unit tests)"
  PATH="$ROOT/$dir/bin:$PATH" "$dir/bin/python" -m pytest tests -q -p no:cacheprovider \
    -m "not slow" -n 2
  if [ "$notebooks" = 1 ]; then
    echo "== [$name] nbval over book/ (ACCUMCORE_QUICK=$ACCUMCORE_QUICK)"
    # --nbval-current-env: the notebooks' kernel is this venv's Python, not the main .venv's.
    PATH="$ROOT/$dir/bin:$PATH" "$dir/bin/python" -m pytest --nbval-lax --nbval-current-env \
      -p no:cacheprovider -q book/
  fi
  echo "== stack leg '$name' passed in $(( $(date +%s) - t )) s"
}

legs=("$@")
[ ${#legs[@]} -eq 0 ] && legs=(colab)
for leg in "${legs[@]}"; do
  case "$leg" in
    colab) run_leg colab .venv-tf219 2.19.0 3.10.0 0.21.1 1 ;;
    *) echo "unknown leg '$leg' (use: colab)" >&2; exit 2 ;;
  esac
done
