#!/usr/bin/env bash
# Run the benchmark suite on a GPU and write benchmarks/results/gpu/ (JSON + plots), then
# re-render benchmarks/RESULTS.md and READER.md with the CPU and GPU results side by side.
#
# Needs a Python with a GPU build of TensorFlow >= 2.16 (Keras 3) and matplotlib, e.g.
#   pip install "tensorflow[and-cuda]==2.21.0" matplotlib && pip install -e .
# (a Colab GPU runtime has both; note that the project's .venv holds tensorflow-cpu, so this
# script uses $PYTHON, default `python3`, not .venv). No network is needed: the data are
# synthetic unless DATA=mnist (then MNIST must load: Keras download or ACCUMCORE_MNIST_PATH).
#
# Usage, from anywhere:
#   bash benchmarks/gpu.sh                         # everything (about 10-15 min)
#   bash benchmarks/gpu.sh tracing,memory,probe    # only these parts ...
#   bash benchmarks/gpu.sh throughput,breakdown    # ... then the rest: parts run as separate
#                                                  # processes and merge into one results.json
# Environment: PYTHON (interpreter), DATA (synthetic|mnist), PROBE_TARGET (target batch of the
# largest-micro-batch probe, default 1048576 samples: far beyond what any GPU holds for this
# conv net, so the probe finds the real limit).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
PARTS="${1:-tracing,ops,memory,probe,throughput,breakdown}"
OUT=benchmarks/results/gpu
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"

"$PY" - <<'EOF'
import sys
import tensorflow as tf
gpus = tf.config.list_physical_devices("GPU")
if not gpus:
    sys.exit("benchmarks/gpu.sh: TensorFlow sees no GPU (install a GPU build of TensorFlow).")
print(f"TensorFlow {tf.__version__} sees {len(gpus)} GPU(s):",
      [tf.config.experimental.get_device_details(g).get("device_name", g.name) for g in gpus])
EOF
"$PY" -c "import accumcore" || { echo "accumcore is not importable: pip install -e ." >&2; exit 1; }
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv || true

mkdir -p "$OUT"
for part in ${PARTS//,/ }; do
  echo "== gpu benchmarks: $part"
  # One process per part (a fresh GPU context each), merged into $OUT/results.json.
  "$PY" benchmarks/run.py --device GPU:0 --only "$part" --out "$OUT" --merge \
    --data "${DATA:-synthetic}" --probe-target "${PROBE_TARGET:-1048576}" \
    --probe-start 1024 --probe-multiple-of 1024
done
"$PY" benchmarks/run.py --check "$OUT" --allow-errors
"$PY" benchmarks/run.py --report   # benchmarks/RESULTS.md, READER.md from results/cpu and gpu
echo "== done: $OUT, benchmarks/RESULTS.md and benchmarks/READER.md (commit them together)"
