#!/usr/bin/env bash
# Create .venv (if missing) and install the pinned toolchain plus accumcore (editable).
# Sourced by scripts/build-book.sh and scripts/test.sh; safe to run again (fast when up to date).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps \
  -r requirements-no-deps.txt 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e . 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
.venv/bin/python -c "import accumcore" >/dev/null 2>&1 || {
  echo "setup: accumcore does not import after installation" >&2; exit 1; }

# Quiet TensorFlow's C++ logs (both variables are needed to hide the oneDNN line).
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
export TF_ENABLE_ONEDNN_OPTS="${TF_ENABLE_ONEDNN_OPTS:-0}"
# Offline machines: MNIST from the shared copy when Keras cannot download it.
if [ -z "${ACCUMCORE_MNIST_PATH:-}" ] && [ -f "$ROOT/../shared/data/mnist.npz" ]; then
  export ACCUMCORE_MNIST_PATH="$ROOT/../shared/data/mnist.npz"
fi
export PATH="$ROOT/.venv/bin:$PATH"
