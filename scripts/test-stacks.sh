#!/usr/bin/env bash
# Extra CI legs: accumcore on the other TensorFlow/Keras stacks it supports (called by
# scripts/test.sh, whose main leg runs the pinned newest stack of requirements.txt on the
# machine's python3). The stacks and what runs on each are listed for readers in
# book/reference/versions.md (tests/test_stacks.py checks that page, the README, `import
# accumcore` and pyproject.toml against LEGS below).
#
# Each leg has its own venv on the leg's Python, created here on first use and reused while its
# pins and Python are unchanged, with two pip runs: TF/Keras pinned with the test tools (one
# resolver run), then keras-hub with requirements-no-deps.txt's regex/tokenizers and accumcore
# itself, all `--no-deps`, so that pip never replaces the TF/Keras under test (checked before
# testing, with the Python the leg runs).
#
#   colab    Python 3.13, tensorflow-cpu 2.20.0 + keras 3.13.2 + keras-hub 0.26.0: Colab's GPU
#            runtime (googlecolab/backend-info pip-freeze.gpu.txt, read 2026-08-19; Python
#            3.13 there since August 2026), also the declared minimum (the oldest stack
#            `import accumcore` accepts). The fast unit tests (pytest -m "not slow": all but
#            the multi-process and soak tests), then every notebook of the quick edition under
#            nbval (--nbval-lax: a cell that raises fails; each notebook's cells are one work
#            unit, two notebooks at a time with pytest-xdist).
#
# The leg's Python is found as on a contributor's machine: `pythonX.Y` on PATH (where it runs:
# pyenv's shim only runs for an active version), else pyenv's (`pyenv prefix X.Y`); with
# neither, one line says how to install it.
#
# Usage: bash scripts/test-stacks.sh [LEG...]              (no argument: every leg, in order)
#        STACKS_PART=fast|nbval bash scripts/test-stacks.sh [LEG...]  (one part of each leg:
#                                                          scripts/test.sh runs them as steps
#                                                          of their own)
#        STACKS_PART=python bash scripts/test-stacks.sh    (each leg's Python interpreter, or
#                                                          the one line saying how to install
#                                                          it: scripts/test.sh checks first)
#        STACKS_SETUP_ONLY=1 bash scripts/test-stacks.sh   (create/refresh the venvs only, in
#                                                          parallel: scripts/test.sh runs this
#                                                          in the background)
# One notebook on Colab's stack, as the nbval part runs it (CONTRIBUTING.md):
#        ACCUMCORE_QUICK=1 .venv-colab/bin/python -m pytest --nbval-lax --nbval-current-env \
#          -p no:cacheprovider book/01_eager_loop.ipynb
set -euo pipefail
case "${STACKS_PART:-}" in
  ""|fast|nbval|python) ;;
  *) echo "STACKS_PART must be fast, nbval or python (or empty: fast and nbval), not" \
       "'$STACKS_PART'" >&2
     exit 2 ;;
esac
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export ACCUMCORE_QUICK="${ACCUMCORE_QUICK:-1}"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
export TF_ENABLE_ONEDNN_OPTS="${TF_ENABLE_ONEDNN_OPTS:-0}"
if [ -z "${ACCUMCORE_MNIST_PATH:-}" ] && [ -f "$ROOT/../shared/data/mnist.npz" ]; then
  export ACCUMCORE_MNIST_PATH="$ROOT/../shared/data/mnist.npz"
fi

# LEGS: name, venv, Python (X.Y), tensorflow-cpu, keras, keras-hub, what runs ("fast", or
# "fast+nbval": also every notebook under nbval).
LEGS=(
  "colab    .venv-colab   3.13 2.20.0 3.13.2 0.26.0 fast+nbval"
)

# The nbval part runs these notebooks first (the longest in the quick edition), then every other
# notebook of book/, so that the two workers end together; a name missing from book/ fails.
NBVAL_FIRST=(masks_tokens 05_lr_sweeps 03b_fine_tuning 08_distributed_mixed_precision
             appendix_a_roundoff 06b_gaps 02_tf_function)

# Test tools, same pins as requirements.txt (no book builder, no linter: not run on these legs;
# nbval and ipykernel: the notebooks under pytest).
TOOLS=(
  "$(grep -E '^matplotlib==' requirements.txt)"
  "$(grep -E '^pytest==' requirements.txt)"
  "$(grep -E '^pytest-xdist==' requirements.txt | cut -d' ' -f1)"
  "$(grep -E '^hypothesis==' requirements.txt)"
  "$(grep -E '^nbval==' requirements.txt | cut -d' ' -f1)"
  "$(grep -E '^ipykernel==' requirements.txt)"
)

# find_python X.Y FOR: prints the path of a Python X.Y interpreter (`pythonX.Y` on PATH where it
# runs, else pyenv's); with neither, fails with one line, naming FOR, saying how to install it.
find_python() {
  local version="$1" for="$2" found prefix
  found="$(command -v "python$version" 2> /dev/null || true)"
  if [ -n "$found" ] && "$found" -c "" > /dev/null 2>&1; then
    echo "$found"
    return
  fi
  prefix="$(pyenv prefix "$version" 2> /dev/null || true)"
  if [ -n "$prefix" ] && [ -x "$prefix/bin/python$version" ]; then
    echo "$prefix/bin/python$version"
    return
  fi
  echo "no Python $version for $for (neither python$version on PATH nor pyenv's): install it," \
    "e.g. \`pyenv install $version\` or your system's python$version package (apt-get install" \
    "python$version, brew install python@$version), then run again" >&2
  return 1
}

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

# make_venv DIR PY TF KERAS HUB: the venv DIR on Python PY (X.Y) with tensorflow-cpu==TF,
# keras==KERAS, TOOLS, keras-hub==HUB and tensorflow-text (--no-deps, with
# requirements-no-deps.txt's other pins), accumcore (editable).
make_venv() {
  local dir="$1" py="$2" tf="$3" keras="$4" hub="$5" t python
  local nodeps
  nodeps="keras-hub==$hub $(grep -E '^(regex|tokenizers)==' requirements-no-deps.txt | tr '\n' ' ')"
  # tensorflow-text of the leg's TF minor (Colab's list: 2.20.1 beside TF 2.20.0): KerasHub
  # 0.26's GPT-2 tokenizer needs it (chapter 3b); --no-deps, as its `tensorflow` requirement
  # would bring the full TF wheel beside tensorflow-cpu
  nodeps+=" tensorflow-text~=${tf%.*}.0"
  local pins="tensorflow-cpu==$tf keras==$keras ${TOOLS[*]} $nodeps"
  # accumcore's editable install holds this checkout's path and pyproject.toml's metadata
  local stamp
  stamp="Python $py; $pins; pyproject.toml $(sha256sum pyproject.toml | cut -c1-16); $ROOT"
  t=$(date +%s)
  if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.accumcore-pins" 2>/dev/null)" = "$stamp" ]; then
    echo "$dir: up to date (Python $py, $pins)"
  else
    python="$(find_python "$py" "$dir")"
    echo "$dir: installing $pins on $python ($("$python" -V 2>&1))"
    rm -rf "$dir"
    "$python" -m venv "$dir"
    pip_in "$dir" "tensorflow-cpu==$tf" "keras==$keras" "${TOOLS[@]}"
    # shellcheck disable=SC2086  # $nodeps is a list of requirements
    pip_in "$dir" --no-deps $nodeps -e .
    echo "$stamp" > "$dir/.accumcore-pins"
  fi
  echo "$dir: venv ready in $(( $(date +%s) - t )) s"
}

# check_stack DIR PY TF KERAS HUB: fail unless the venv holds exactly the stack the leg names, on
# Python PY; prints the stack and the Python.
check_stack() {
  "$1/bin/python" - "$2" "$3" "$4" "$5" <<'EOF'
import sys

import keras
import keras_hub
import tensorflow as tf

import accumcore

python = "{}.{}".format(*sys.version_info[:2])
want = tuple(sys.argv[1:5])
found = (python, tf.__version__, keras.__version__, keras_hub.__version__)
if found != want:
    sys.exit(f"stack mismatch: want Python {want[0]}, TF {want[1]} + Keras {want[2]} + keras-hub "
             f"{want[3]}, found {found}")
print(f"stack: Python {sys.version.split()[0]} ({sys.executable}), TensorFlow {found[1]} + "
      f"Keras {found[2]} + keras-hub {found[3]}, accumcore {accumcore.__version__}")
EOF
}

# nbval_notebooks: book/'s notebooks, NBVAL_FIRST's first (in that order), then the others.
nbval_notebooks() {
  local name path
  for name in "${NBVAL_FIRST[@]}"; do
    [ -f "book/$name.ipynb" ] || { echo "NBVAL_FIRST: no book/$name.ipynb" >&2; return 1; }
    echo "book/$name.ipynb"
  done
  for path in book/*.ipynb; do
    name="$(basename "$path" .ipynb)"
    [[ " ${NBVAL_FIRST[*]} " == *" $name "* ]] || echo "$path"
  done
}

# run_leg NAME DIR PY TF KERAS HUB WHAT: the leg's parts ($STACKS_PART: fast, nbval; empty: all)
run_leg() {
  local name="$1" dir="$2" py="$3" tf="$4" keras="$5" hub="$6" what="$7" part="${STACKS_PART:-}"
  local t list notebooks rc=0
  t=$(date +%s)
  echo "== stack leg '$name': Python $py, tensorflow-cpu $tf + keras $keras + keras-hub $hub" \
    "($dir): $what"
  make_venv "$dir" "$py" "$tf" "$keras" "$hub"
  check_stack "$dir" "$py" "$tf" "$keras" "$hub"
  if [ "$part" != nbval ]; then
    echo "== [$name] pytest -m 'not slow' (fast unit tests)"
    PATH="$ROOT/$dir/bin:$PATH" "$dir/bin/python" -m pytest tests -q -p no:cacheprovider \
      -m "not slow" -n 2
  fi
  if [ "$what" = fast+nbval ] && [ "$part" != fast ]; then
    list="$(nbval_notebooks)"
    mapfile -t notebooks <<< "$list"
    echo "== [$name] nbval: ${#notebooks[@]} notebooks (ACCUMCORE_QUICK=$ACCUMCORE_QUICK)," \
      "two at a time"
    # --nbval-current-env: the kernel is this venv's Python, not a kernelspec's. --dist
    # loadfile: a notebook's cells stay on one worker, in order; --no-loadscope-reorder: the
    # notebooks are handed out in the order given (xdist would sort them by their number of
    # cells), the next one to the worker that is finishing. No ACCUMCORE_BOOK_BUILD: glue
    # records nothing, as on Colab. The summary (one line per notebook) also after a failure.
    rm -f "$dir/nbval.xml"
    env -u ACCUMCORE_BOOK_BUILD PATH="$ROOT/$dir/bin:$PATH" "$dir/bin/python" -m pytest \
      --nbval-lax --nbval-current-env -p no:cacheprovider -q -n 2 --dist loadfile \
      --no-loadscope-reorder --junitxml "$dir/nbval.xml" "${notebooks[@]}" || rc=$?
    if [ -f "$dir/nbval.xml" ]; then
      "$dir/bin/python" scripts/nbval_summary.py "$dir/nbval.xml" || [ "$rc" -ne 0 ] || rc=1
    fi
    [ "$rc" -eq 0 ] || { echo "== [$name] nbval FAILED (exit $rc)"; return "$rc"; }
  fi
  echo "== stack leg '$name'${part:+ ($part)} passed in $(( $(date +%s) - t )) s"
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

if [ "${STACKS_PART:-}" = python ]; then
  for leg in "${selected[@]}"; do
    read -r name dir py _ <<< "$leg"
    interpreter="$(find_python "$py" "stack leg '$name' ($dir)")"
    echo "stack leg '$name': Python $py: $interpreter"
  done
  exit
fi
if [ "${STACKS_SETUP_ONLY:-0}" = 1 ]; then
  # Every venv at once: pip is mostly one process unpacking and compiling, so two fill 2 cores.
  pids=()
  for leg in "${selected[@]}"; do
    read -r name dir py tf keras hub _ <<< "$leg"
    (make_venv "$dir" "$py" "$tf" "$keras" "$hub" 2>&1 | sed "s/^/[$name] /") &
    pids+=($!)
  done
  rc=0
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  exit "$rc"
fi
for leg in "${selected[@]}"; do
  # shellcheck disable=SC2086  # the leg's fields
  run_leg $leg
done
