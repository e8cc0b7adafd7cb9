#!/usr/bin/env bash
# Book checks, run by scripts/test.sh after the unit tests (quick mode by default):
#   (a) every notebook in book/ is listed in _toc.yml, so that (b) executes all of them;
#   (b) a clean `jupyter-book build` of whatever _toc.yml lists, warnings as errors (-W -n):
#       it executes every notebook top to bottom, and a cell that raises fails the build
#       (allow_errors: false, nb_execution_raise_on_error; the cells assert each claim). The
#       kernel is Jupyter's "python3": the main .venv's (the pinned stack, as in the README's
#       main command; or the one JUPYTER_PATH names first); its Python and stack are printed
#       first (Colab's stack runs every notebook under nbval: scripts/test-stacks.sh);
#   (b') every number a notebook's prose quotes is printed, glued or set in a visible cell of
#       that page, and every comparison word about a measurement ("faster", "a tie", "grew")
#       is computed and glued, not written (scripts/check_prose_numbers.py over the build's
#       executed notebooks; its ALLOWED_COMPARISONS lists definitions and asserted claims);
#   (c) headless Chromium opens every built page: page exists, images load, MathJax renders
#       (offline, vendored), Colab launch links are right (scripts/browser_check.py; it uses
#       an installed Chromium or Chrome, and skips only with ACCUMCORE_SKIP_BROWSER=1 outside CI).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
export ACCUMCORE_QUICK="${ACCUMCORE_QUICK:-1}"
total=$(date +%s)

echo "== book (a): every notebook in book/ is in _toc.yml"
python - <<'EOF'
import pathlib
import sys

toc = pathlib.Path("_toc.yml").read_text()
missing = [p.stem for p in sorted(pathlib.Path("book").glob("*.ipynb"))
           if f"file: book/{p.stem}\n" not in toc]
if missing:
    sys.exit(f"notebooks not in _toc.yml (the build would not execute them): {missing}")
EOF

echo "== book (b): clean jupyter-book build -W -n"
python - <<'EOF'
import subprocess

from jupyter_client.kernelspec import KernelSpecManager

python = KernelSpecManager().get_kernel_spec("python3").argv[0]
code = ("import sys; from importlib.metadata import version as v; "
        "print(sys.executable, '(Python', sys.version.split()[0] + '):', "
        "'TensorFlow', v('tensorflow-cpu'), '+ Keras', v('keras'), '+ keras-hub', v('keras-hub'))")
print("   the notebooks' kernel:", subprocess.run([python, "-c", code], check=True,
                                                 capture_output=True, text=True).stdout.strip())
EOF
export ACCUMCORE_BOOK_BUILD=1  # accumcore.lab.book.glue: record for the prose without myst-nb
t=$(date +%s)
rm -rf _build
jupyter-book build . -W -n --keep-going
echo "== book (b) passed in $(( $(date +%s) - t )) s"

echo "== book (b'): every number in a notebook's prose is shown on its page, every comparison computed"
python scripts/check_prose_numbers.py _build/jupyter_execute/book
python scripts/check_prose_numbers.py --html _build/html  # no issue refs, internal paths, raw reprs, private params, repeats

echo "== book (c): browser test (headless Chromium)"
t=$(date +%s)
# An existing Chromium/Chrome (PATH, or $ACCUMCORE_CHROMIUM / $ACCUMCORE_CHROMEDRIVER) is used;
# Debian's is installed with apt-get only where that works (root); otherwise one line says how
# to install one, or to skip this step locally with ACCUMCORE_SKIP_BROWSER=1 (never in CI).
python scripts/browser_check.py --install-missing
echo "== book (c) passed in $(( $(date +%s) - t )) s"

echo "== book checks passed in $(( $(date +%s) - total )) s"
