"""One line per notebook from nbval's JUnit XML: its cells passed, failed or skipped, and its time.

nbval reports every cell as a test (``book/NAME.ipynb::Cell 3``); pytest-xdist prints them as
dots. This reads the ``--junitxml`` file of that run and prints each notebook as one result,
the longest first, so the log shows which notebook failed and how long each took (the order
``scripts/test-stacks.sh`` runs them in, its ``NBVAL_FIRST``, comes from these times).

Usage: python scripts/nbval_summary.py NBVAL.xml
Exit status: 1 if a cell of any notebook failed (or the file holds no cell), else 0.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def per_notebook(path: str) -> dict[str, dict[str, float]]:
    """``{notebook: {"passed": n, "failed": n, "skipped": n, "seconds": s}}`` from the XML.

    A test case's ``classname`` is the notebook's path with dots for slashes
    (``book.01_eager_loop.ipynb``; the notebooks' names hold no dots); its ``time`` is in
    seconds.
    """
    results: dict[str, dict[str, float]] = defaultdict(
        lambda: {"passed": 0, "failed": 0, "skipped": 0, "seconds": 0.0})
    for case in ET.parse(path).iter("testcase"):
        folder, _, stem = case.get("classname", "?").removesuffix(".ipynb").rpartition(".")
        counts = results[f"{folder.replace('.', '/')}/{stem}.ipynb"]
        counts["seconds"] += float(case.get("time", 0))
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return dict(results)


def main(path: str) -> int:
    results = per_notebook(path)
    for notebook, counts in sorted(results.items(), key=lambda item: -item[1]["seconds"]):
        status = "FAILED" if counts["failed"] else "passed"
        print(f"   nbval {status}: {notebook}: {counts['passed']:.0f} cells passed, "
              f"{counts['failed']:.0f} failed, {counts['skipped']:.0f} skipped, "
              f"{counts['seconds']:.0f} s")
    total = sum(counts["seconds"] for counts in results.values())
    failed = [name for name, counts in results.items() if counts["failed"]]
    print(f"   nbval: {len(results)} notebooks, {len(failed)} failed, {total:.0f} s of cells")
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
