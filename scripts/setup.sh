#!/usr/bin/env bash
# Create .venv (if missing) and install the pinned toolchain plus accumcore (editable).
# Sourced by scripts/build-book.sh and scripts/test.sh; safe to run again (fast when up to date).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
# pip_q ARGS...: `pip install -q ARGS` in .venv, without the registry-mirror notices.
pip_q() {
  local rc=0
  .venv/bin/python -m pip install -q --disable-pip-version-check "$@" > .venv/.pip.log 2>&1 \
    || rc=$?
  grep -v "is ignored: it is neither a file nor a directory" .venv/.pip.log || true
  return "$rc"
}
# Two pip runs, one resolver run: the pinned toolchain (requirements.txt), then what must not
# bring its own requirements (requirements-no-deps.txt: see there) and accumcore (editable, one
# wheel build). Skipped while the requirement files, pyproject.toml and this checkout's path
# are those of the last setup that completed (.venv/.accumcore-setup).
stamp="$(cat requirements.txt requirements-no-deps.txt pyproject.toml | sha256sum | cut -c1-16) $ROOT"
if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.accumcore-setup 2>/dev/null)" != "$stamp" ]; then
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  rm -f .venv/.accumcore-setup
  pip_q -r requirements.txt
  pip_q --no-deps -r requirements-no-deps.txt -e .
  .venv/bin/python -c "import accumcore" >/dev/null 2>&1 || {
    echo "setup: accumcore does not import after installation" >&2; exit 1; }
  echo "$stamp" > .venv/.accumcore-setup
fi

# Quiet TensorFlow's C++ logs (both variables are needed to hide the oneDNN line).
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
export TF_ENABLE_ONEDNN_OPTS="${TF_ENABLE_ONEDNN_OPTS:-0}"
# Offline machines: MNIST from the shared copy when Keras cannot download it.
if [ -z "${ACCUMCORE_MNIST_PATH:-}" ] && [ -f "$ROOT/../shared/data/mnist.npz" ]; then
  export ACCUMCORE_MNIST_PATH="$ROOT/../shared/data/mnist.npz"
fi
export PATH="$ROOT/.venv/bin:$PATH"
