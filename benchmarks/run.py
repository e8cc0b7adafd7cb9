"""Run the accumcore benchmarks and write JSON, Markdown and PNG plots.

Usage (from the repository root, with the project's virtual environment):

    python benchmarks/run.py                 # full suite -> benchmarks/results/<cpu|gpu>/,
                                             #   then re-renders benchmarks/RESULTS.md and
                                             #   benchmarks/READER.md (the book's page)
    python benchmarks/run.py --quick --out DIR   # smoke test (tiny sizes), everything in DIR
    python benchmarks/run.py --report        # re-render RESULTS.md, READER.md and the plots
                                             #   from the JSON
    python benchmarks/run.py --only memory,tracing --out DIR
    python benchmarks/run.py --check DIR     # exit 1 unless DIR holds well-formed outputs

What is measured and how: see the docstrings of `accumcore/lab/benchmarking.py` (the
vocabulary and the analysis) and `benchmarks/suite.py` (the measuring).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402
import suite  # noqa: E402

from accumcore.lab import benchmarking as bm  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke-test sizes: checks the pipeline, the numbers mean nothing")
    p.add_argument("--out", help="output directory (default: benchmarks/results/<cpu|gpu>)")
    p.add_argument("--only", help="comma-separated subset of " + ",".join(bm.EXPERIMENTS))
    p.add_argument("--device", help="CPU:0 or GPU:0 (default: GPU:0 when there is one)")
    p.add_argument("--data", choices=("mnist", "synthetic"),
                   help="input data (default: mnist in full mode, synthetic in quick mode)")
    p.add_argument("--repeats", type=int, help="timed repeats per configuration")
    p.add_argument("--probe-target", type=int, help="target batch of the micro-batch probe")
    p.add_argument("--probe-start", type=int, help="first micro-batch size probed")
    p.add_argument("--probe-multiple-of", type=int, help="probe only multiples of this")
    p.add_argument("--merge", action="store_true",
                   help="keep the other experiments of an existing results.json in the output "
                        "directory and replace only those run now (to run parts separately)")
    p.add_argument("--no-probe", action="store_true", help="skip the real micro-batch probe")
    p.add_argument("--check", metavar="DIR",
                   help="only validate the outputs in DIR (never a speed); exit 1 on problems")
    p.add_argument("--allow-errors", action="store_true",
                   help="with --check: accept configurations that failed (reported in the JSON)")
    p.add_argument("--report", action="store_true",
                   help="only re-render RESULTS.md, READER.md and the plots from existing "
                        "results.json")
    return p.parse_args(argv)


def merge(old: dict, new: dict, only: list[str] | None) -> dict:
    """``old`` with the experiments in ``only`` (all if None) replaced by ``new`` 's."""
    parts = only or list(bm.EXPERIMENTS)
    merged = dict(old)
    for part in parts:
        merged[part] = new.get(part)
    merged["code"] = new["code"]  # the source's sizes now, whatever was re-run
    merged["machine"] = new["machine"]
    merged["created"] = new["created"]
    merged["duration_s"] = old.get("duration_s", 0.0) + new["duration_s"]
    merged["merged_parts"] = sorted(set(old.get("merged_parts", [])) | set(parts))
    # each part's own run, so that the pages can say which run a table comes from
    # (a part of ``old`` with no date of its own was measured by ``old`` 's run)
    old_dates = {part: old["created"] for part in bm.EXPERIMENTS
                 if old.get(part) is not None and "created" in old}
    merged["part_created"] = {**old_dates, **old.get("part_created", {}),
                              **{part: new["created"] for part in parts}}
    merged["targets"] = bm.evaluate_targets(merged)
    return merged


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check:
        problems = report.validate_outputs(args.check, allow_errors=args.allow_errors)
        for problem in problems:
            print("benchmark output problem:", problem, file=sys.stderr)
        print(f"checked {args.check}: " + ("OK" if not problems else f"{len(problems)} problems"))
        return 1 if problems else 0
    if args.report:
        dirs = [args.out] if args.out else report.default_result_dirs()
        for d in dirs:  # each run's own page (and plots)
            print("wrote", report.write_report([d], os.path.join(d, "RESULTS.md")))
        if not args.out:  # the combined pages: the maintainers' report and the book's
            print("wrote", report.write_report(dirs, report.TOP_REPORT, plots=False))
            print("wrote", report.write_reader_page(dirs))
        return 0
    overrides = {k: v for k, v in {
        "device": args.device, "data": args.data, "repeats": args.repeats,
        "probe_target": args.probe_target, "probe_start": args.probe_start,
        "probe_multiple_of": args.probe_multiple_of,
    }.items() if v is not None}
    if args.no_probe:
        overrides["probe"] = False
    settings = (suite.SuiteSettings.quick_preset(**overrides) if args.quick
                else suite.SuiteSettings.full(**overrides))
    device = settings.resolved_device()
    out = args.out or os.path.join(report.RESULTS_DIR, "gpu" if device.startswith("GPU")
                                   else "cpu")
    os.makedirs(out, exist_ok=True)
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    print(f"accumcore benchmarks: {'quick' if settings.quick else 'full'} mode on {device}, "
          f"output in {out}", flush=True)
    start = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {msg}", flush=True)

    results = suite.run_suite(settings, only=only, progress=progress)
    path = os.path.join(out, "results.json")
    if args.merge and os.path.isfile(path):
        results = merge(bm.load_results(path), results, only)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    print("wrote", path)
    md = report.write_report([out], os.path.join(out, "RESULTS.md"))
    print("wrote", md)
    if os.path.dirname(os.path.abspath(out)) == os.path.abspath(report.RESULTS_DIR):
        # A run into benchmarks/results/<name>: re-render the combined RESULTS.md and READER.md.
        md = report.write_report(report.default_result_dirs(), report.TOP_REPORT, plots=False)
        print("wrote", md)
        print("wrote", report.write_reader_page(report.default_result_dirs()))
    judged = [t for t in results["targets"] if t["met"] is not None]
    print(f"targets met: {sum(t['met'] for t in judged)} of {len(judged)}; "
          f"total {results['duration_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
