"""The reader's benchmark page (``benchmarks/READER.md``, which the book's Reference includes):
the measurements and what they mean, without the maintainers' targets and verdicts.

``benchmarks/RESULTS.md`` keeps every target, met or missed, the unit tests' time and the code's
size; the reader's page is rendered from the same JSON by ``report.render_reader_page`` and
must hold none of ``report.READER_FORBIDDEN``.
"""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from test_benchmarks import fake_results

from accumcore.lab import benchmarking as bm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import report  # noqa: E402


def _full_fake_run(out) -> str:
    """A fake run with everything RESULTS.md judges: targets, unit tests, code sizes, the
    paired non-finite cost and the language-model fit."""
    results = fake_results()
    results["unit_tests"] = {"passed": 607, "failed": 0, "errors": 0, "skipped": 0,
                             "seconds": 213.8}
    results["code"] = {"largest_class": [299, "accumcore/_impl/state.py:AccumulationState"],
                       "longest_function": [59, "accumcore/_impl/trainer.py:fit"],
                       "code_lines": [3126, "24 files"], "files": {"accumcore/_impl/state.py": 161}}
    results["targets"] = bm.evaluate_targets(results)
    out.mkdir()
    (out / "results.json").write_text(json.dumps(results))
    paired = {kind: {"best": best, "samples_per_s": 2048.0, "seconds": [2.5, 2.0],
                     "paired": {"median": med, "low": med - 0.02, "high": med + 0.01,
                                "rounds": 41}}
              for kind, best, med in (("keras_ga", 1.0, 1.0), ("accumcore", 0.95, 0.912),
                                      ("accumcore_unchecked", 1.01, 0.987))}
    (out / report.NONFINITE_COST_FILE).write_text(json.dumps(
        {"created": "2026-12-03T22:40:00", "rounds": 41, "micro_batch": 16, "accum_steps": 4,
         "by_spe": {"1": paired}}))
    (out / report.ACCUMULATE_LM_FILE).write_text(json.dumps(
        {"config": {"layers": 2, "hidden": 64, "sequences": 512, "length": 64, "micro_batch": 8,
                    "accum_steps": 4, "keras": "3.15.1", "keras_hub": "0.32.0", "rounds": 21},
         "throughput_ratio_paired": {"median": 0.9, "low": 0.85, "high": 0.95},
         "throughput_ratio_best_of_n": 0.93, "target": 0.97}))
    report.write_report([str(out)], str(out / "RESULTS.md"))
    return str(out)


def test_reader_page_has_the_tables_and_none_of_the_targets(tmp_path):
    out = _full_fake_run(tmp_path / "run")
    maintainers = open(os.path.join(out, "RESULTS.md"), encoding="utf-8").read()
    # the same run's maintainers' report holds what the reader's page must not
    for fragment in ("### Targets", "checks met", "missed by", "(issue 19)",
                     "fast unit tests (seconds)", "Library code lines", "| ≥ 0.97 | **missed** |"):
        assert fragment in maintainers, fragment
    path = report.write_reader_page([out], os.path.join(out, "READER.md"))
    text = open(path, encoding="utf-8").read()
    assert report.reader_page_problems(text) == []
    for fragment in ("### Summary", "**What the ratios mean.**",
                     "| (4)/(3): AccumModel.fit / fit with Keras's accumulation, "
                     "steps_per_execution=1 | 1 | 1.12 | 1.12 | 1.12 |",
                     "| (4) accumcore AccumModel.fit | 90 (±0 %) |", "#### Ratios per cell",
                     "against a dashed line at 1](ratios.png)",
                     "| mlp | `AccumTrainer.window_step` | 700 | 450 | 1.56 |",
                     "| 1 | 0.912 [0.892, 0.922] | 0.950 | 0.987 [0.967, 0.997] | 1.010 |",
                     "| fit | 0.900 [0.850, 0.950] | 0.930 |",
                     "each way to accumulate](memory.png)",
                     "| retracer | [2, 1, 0] | 3 |", "1 traces came after the first epoch"):
        assert fragment in text, fragment
    for word in ("target", "missed", "issue", "unit tests", "code lines", "**no**", "checks met",
                 "minimal.py", "--rounds", "![ratios]", "![memory]"):
        assert word not in text.lower(), word
    assert "![throughput" not in text  # the samples/s tables say it all: the page stays short
    # the per-cell ratios: a plot on the reader's page, a table in the maintainers' report
    per_cell_row = "| mlp b=16 K=4 | 1.12 | 0.95 | 1.06 with (5) whole epoch |"
    assert per_cell_row not in text
    assert "| mlp b=16 K=4 | 1.12 | 0.95 |" in maintainers


def test_reader_page_folds_the_long_tables_and_keeps_run_metadata_off(tmp_path):
    """The full tables (throughput, graph operations, the time's breakdown) are folded, with
    no heading inside a fold; the summary, the plots and the sentences stay open."""
    out = _full_fake_run(tmp_path / "run")
    text = open(report.write_reader_page([out], os.path.join(out, "READER.md")),
                encoding="utf-8").read()
    folds = text.split("````{admonition}")[1:]
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        measured_breakdown = bool(json.load(f).get("breakdown"))
    assert len(folds) == 2 + measured_breakdown  # throughput, operations (, breakdown)
    bodies = [fold.split("\n````\n")[0] for fold in folds]
    assert "| (4) accumcore AccumModel.fit | 90 (±0 %) |" in bodies[0]
    assert "| mlp | `AccumTrainer.window_step` | 700 | 450 | 1.56 |" in bodies[1]
    assert all(":class: dropdown" in body and "\n#" not in body for body in bodies)
    open_text = text.split("````{admonition}")[0] + "".join(
        fold.split("\n````\n")[1] for fold in folds)
    assert "### Summary" in open_text and "dashed line at 1](ratios.png)" in open_text
    assert "| platform |" not in text and "load average" not in text


@pytest.mark.parametrize("line", [
    "**22 of 51 checks met.**",
    "| (4)/(3) | mlp b=16 K=4 | 0.838 | 1.000 | **no** (missed by 16.2 %) |",
    "### A step as lean as Keras's (issue 19)",
    "| ratio | lowest | target | cells at or above it |",
    "| fast unit tests (seconds) | 610 passed | 214.3 |",
    "Library code lines by module: `state.py` 161.",
    "ranged over 0.83–1.03 (met in 1 of 8 cells)",
    "its graph operations: `tests/test_hot_path.py`",
    "| graph ops | 1.14 | ≤ 1.5 threshold |",
    "| ratio | 5 of 8 cells |",
])
def test_each_kind_of_maintainers_line_is_caught(line, tmp_path, monkeypatch):
    assert report.reader_page_problems(f"# Results\n\n{line}\n")
    out = _full_fake_run(tmp_path / "run")
    rendered = report.render_reader_page
    monkeypatch.setattr(report, "render_reader_page",
                        lambda dirs, md_dir: rendered(dirs, md_dir) + line + "\n")
    with pytest.raises(ValueError, match="the reader's page contains"):
        report.write_reader_page([out], os.path.join(out, "READER.md"))
    assert not os.path.exists(os.path.join(out, "READER.md"))  # nothing written


def test_committed_reader_page_is_rendered_from_the_committed_json():
    """``python benchmarks/run.py --report`` was run after the last change of the JSON or of
    the renderer, and what it wrote is clean."""
    with open(report.READER_PAGE, encoding="utf-8") as f:
        committed = f.read()
    rendered = report.render_reader_page(report.default_result_dirs(),
                                         os.path.dirname(report.READER_PAGE))
    assert committed == rendered, "benchmarks/READER.md is stale: run benchmarks/run.py --report"
    assert report.reader_page_problems(committed) == []
    assert "### Peak memory" in committed
    assert "dashed line at 1](results/cpu/ratios.png)" in committed


def test_the_book_page_includes_the_reader_page_and_states_no_targets():
    with open(os.path.join(ROOT, "book", "reference", "benchmarks.md"), encoding="utf-8") as f:
        page = f.read()
    assert "```{include} ../../benchmarks/READER.md" in page
    assert "{include} ../../benchmarks/RESULTS.md" not in page
    assert report.reader_page_problems(page) == []


def test_reader_page_says_what_each_paired_table_decides_and_which_run_it_comes_from(tmp_path):
    """The reader found a cost attributed to the check where removing it made fit slower
    (overlapping intervals), a lopsided interval left unexplained, a noise figure no table
    gives, and tables of another run presented as the page's one run."""
    out = _full_fake_run(tmp_path / "run")
    text = open(report.write_reader_page([out], os.path.join(out, "READER.md")),
                encoding="utf-8").read()
    # the fake run's intervals are apart: a cost; overlapping ones: the noise
    assert "the intervals are apart: the difference is what the once-per-window check" in text
    overlapping = {"by_spe": {"1": {
        "accumcore": {"paired": {"median": 0.966, "low": 0.923, "high": 0.989}},
        "accumcore_unchecked": {"paired": {"median": 0.933, "low": 0.911, "high": 0.988}}}}}
    sentence = report._check_cost_sentence(overlapping)
    assert "overlap: the check's cost is within the noise" in sentence
    assert "1: 0.966 [0.923, 0.989] with the check, 0.933 [0.911, 0.988] without." in sentence
    # overlapping intervals are the noise whichever median is lower: no sign read into them
    assert "opposite sign" not in sentence and "median is lower" not in sentence
    # one rule for both settings (round-13 reader D9): both overlap, one verdict for both
    both = {"by_spe": {"1": overlapping["by_spe"]["1"], "32": {
        "accumcore": {"paired": {"median": 0.954, "low": 0.930, "high": 0.969}},
        "accumcore_unchecked": {"paired": {"median": 0.959, "low": 0.926, "high": 0.987}}}}}
    sentence = report._check_cost_sentence(both)
    assert ("1: 0.966 [0.923, 0.989] with the check, 0.933 [0.911, 0.988] without; 32: 0.954 "
            "[0.930, 0.969] with the check, 0.959 [0.926, 0.987] without. At "
            "steps_per_execution 1 and 32 the two intervals overlap: the check's cost is within "
            "the noise") in sentence
    assert "opposite" not in sentence
    assert "costs" not in sentence
    # apart the other way: never "overlap", never a cost
    reversed_apart = {"by_spe": {"1": {
        "accumcore": {"paired": {"median": 0.99, "low": 0.98, "high": 1.0}},
        "accumcore_unchecked": {"paired": {"median": 0.93, "low": 0.92, "high": 0.94}}}}}
    sentence = report._check_cost_sentence(reversed_apart)
    assert "apart the other way: the run without the check was the slower one" in sentence
    assert "overlap" not in sentence and "costs" not in sentence
    # a paired interval in a reader's words
    assert "does not tell the two apart" in report._interval_sentence(
        {"median": 0.977, "low": 0.956, "high": 1.427})
    assert "varied a lot" in report._interval_sentence(
        {"median": 0.977, "low": 0.956, "high": 1.427})
    assert "varied" not in report._interval_sentence({"median": 1.0, "low": 0.98, "high": 1.03})
    assert "was slower" in report._interval_sentence({"median": 0.9, "low": 0.85, "high": 0.95})
    assert "The whole interval lies below 1" in text  # the fake LM ratio, 0.900 [0.850, 0.950]
    # separate runs named; the noise as the tables' own ± figures
    assert "measured in a separate run (2026-12-03T22:40:00)" in text
    assert "spread over its repeats (± half their range, in % of the median): ±" in text
    assert "of their median (max − min)" not in text


def test_the_check_cost_sentences_list_the_medians_then_one_verdict_per_kind_of_setting():
    """Round-14 reader D13: the medians and the verdict were one fused sentence, and the
    per-micro-batch check's column, measured, was never discussed. Now: the medians, then one
    sentence per verdict; the same for checking every micro-batch against the first column."""
    def kinds(checked, unchecked, micro=None):
        out = {"accumcore": {"paired": dict(zip(("median", "low", "high"), checked))},
               "accumcore_unchecked": {"paired": dict(zip(("median", "low", "high"),
                                                         unchecked))}}
        if micro:
            out["accumcore_skip_micro_batch"] = {
                "paired": dict(zip(("median", "low", "high"), micro))}
        return out
    record = {"by_spe": {"1": kinds((0.96, 0.92, 0.99), (0.95, 0.91, 0.98)),  # overlap
                         "8": kinds((0.90, 0.89, 0.91), (0.97, 0.96, 0.98)),  # a cost
                         "16": kinds((0.99, 0.98, 1.0), (0.93, 0.92, 0.94))}}  # opposite
    sentence = report._check_cost_sentence(record)
    assert sentence.startswith("The first two paired columns compare the once-per-window check "
                               "with none, at steps_per_execution 1: 0.960 [0.920, 0.990] with "
                               "the check")
    assert ("At steps_per_execution 1 the two intervals overlap: the check's cost is within "
            "the noise of this run, and the difference of the medians says nothing about it."
            ) in sentence
    assert ("At steps_per_execution 8 the intervals are apart: the difference is what the "
            "once-per-window check costs.") in sentence
    assert ("At steps_per_execution 16 the intervals are apart the other way: the run without "
            "the check was the slower one, so these runs show no cost of the check there."
            ) in sentence
    assert "micro-batch" not in sentence  # no third column, nothing said about it
    assert sentence.count("..") == 0 and sentence.endswith("there.")
    # the third column against the first: the rounds-14 run's figures
    run = {"by_spe": {"1": kinds((0.966, 0.923, 0.989), (0.933, 0.911, 0.988),
                                 (0.910, 0.875, 0.931)),
                      "32": kinds((0.954, 0.930, 0.969), (0.959, 0.926, 0.987),
                                  (0.876, 0.857, 0.920))}}
    sentence = report._check_cost_sentence(run)
    assert ("32: 0.876 [0.857, 0.920] checking every micro-batch, 0.954 [0.930, 0.969] once "
            "per window.") in sentence
    assert ("At steps_per_execution 32 the intervals are apart: checking every micro-batch cost "
            "measurably more than checking each window once.") in sentence
    assert "At steps_per_execution 1 they overlap: the difference is within the noise" in sentence
    only_one = {"by_spe": {"1": {"accumcore": record["by_spe"]["1"]["accumcore"]}}}
    assert report._check_cost_sentence(only_one) == ""
    assert report._check_cost_sentence({"by_spe": {}}) == ""


def test_the_reader_page_gives_the_breakdown_spread_window_step_xla_and_the_memory_design():
    """Round-14 reader A4, D12, A3: "a negative step is smaller than the noise" with no spread
    of that run printed; XLA's slower window_step never mentioned beside "XLA ran at
    1.05-1.20 times"; a flat memory curve explained by the accumulators' 0.2 MiB."""
    rows = [{"spread": 0.12, "seconds": [1.0] * 21}, {"spread": 0.56, "seconds": [1.0] * 21}]
    sentence = report._breakdown_noise_sentence(rows)
    assert "medians of 21 repeats that spread by ±6–28 % in this run" in sentence
    assert "smaller than the noise of this machine" not in sentence
    results = {"throughput": [
        {"model": "mlp", "micro_batch": 16, "accum_steps": 4, "config": c, "median": m}
        for c, m in (("window", 100.0), ("window_xla", 50.0))] + [
        {"model": "mlp", "micro_batch": 16, "accum_steps": 8, "config": c, "median": m}
        for c, m in (("window", 100.0), ("window_xla", 110.0))] + [
        {"model": "conv", "micro_batch": 16, "accum_steps": 4, "config": "window_xla",
         "median": None}]}
    assert report._window_xla_sentence(report._window_xla_ratios(results)) == (
        " `window_step` with XLA ran at 0.50–1.10 times its speed without, below 1 in 1 of the "
        "2 cells where both were timed.")
    assert report._window_xla_sentence(report._window_xla_ratios({"throughput": []})) == ""
    with open(report.READER_PAGE, encoding="utf-8") as f:
        page = f.read()
    assert "`window_step` with XLA ran at" in page
    assert "because the accumulators (one copy of the weights) are allocated once" not in page
    assert "only one micro-batch's activations are live at a time" in page


def test_a_part_measured_in_another_run_is_dated_on_the_reader_page(tmp_path):
    out = _full_fake_run(tmp_path / "run")
    path = os.path.join(out, "results.json")
    with open(path, encoding="utf-8") as f:
        results = json.load(f)
    dated = "This section was measured in a separate run (2026-12-01T00:00:00)"
    results["breakdown"] = [{"model": "mlp", "micro_batch": 16, "accum_steps": 4,
                             "variant": "floor", "label": "the floor", "median": 4e4,
                             "ms_per_micro_batch": 0.4}]
    for part_created, shown in (({"breakdown": "2026-12-01T00:00:00"}, True),
                                ({"breakdown": results["created"]}, False), ({}, False)):
        results["part_created"] = part_created
        with open(path, "w", encoding="utf-8") as f:
            json.dump(results, f)
        text = report.render_reader_page([out], out)
        assert (dated in text) == shown, part_created
        assert f"The tables below come from the run of {results['created']}" in text


def test_the_split_sentence_per_model_flags_the_noisiest_figure():
    """The reader found '0.59–1.86 … every micro-batch pays the fixed per-step costs' while
    every conv cell was faster split, and the 1.86 rested on a ±47 % figure: the sentence gives
    each model's span and side of 1, and names the figure behind the highest ratio when it is
    the run's noisiest (synthetic results: the spans and the noisiest cell known here)."""
    ratios = [{"model": "mlp", "micro_batch": 16, "accum_steps": 4, "split_price": 0.6},
              {"model": "mlp", "micro_batch": 32, "accum_steps": 2, "split_price": 0.8},
              {"model": "conv", "micro_batch": 16, "accum_steps": 4, "split_price": 1.9},
              {"model": "conv", "micro_batch": 32, "accum_steps": 2, "split_price": 1.05}]
    floor = {"model": "conv", "micro_batch": 16, "accum_steps": 4, "config": "floor_B",
             "median": 3384.0, "spread": 0.94}
    quiet = dict(floor, micro_batch=32, accum_steps=2, median=5000.0, spread=0.1)
    text = report._split_sentence({"throughput": [floor, quiet]}, ratios)
    assert "on the mlp (below 1 in every cell)" in text
    assert "on the conv (at or above 1 in every cell)" in text
    assert "rests on the run's noisiest figure" in text and "(±47 %)" in text
    assert "b=16, K=4" in text
    calm = report._split_sentence({"throughput": [dict(floor, spread=0.05), quiet]}, ratios)
    assert "noisiest" not in calm  # the figure behind 1.9 is not the noisiest: not named


def test_the_reader_page_names_the_large_steps_per_execution_and_equal_peaks():
    """The reader found "at steps_per_execution=32" in the prose but "large
    steps_per_execution" in every table, and two lines of the memory figure on top of each
    other with nothing saying so."""
    results = {"settings": {"large_steps_per_execution": 32}}
    assert report._with_spe("(4)/(3) at the large steps_per_execution", results) \
        == "(4)/(3) at steps_per_execution=32"
    assert report._with_spe("(4) AccumModel.fit, large steps_per_execution", results) \
        == "(4) AccumModel.fit, steps_per_execution=32"
    mib = 2 ** 20
    table = {"plain": {1: 10 * mib, 2: 20 * mib}, "loop": {1: 5 * mib, 2: 5 * mib},
             "model": {1: 5 * mib, 2: 5 * mib}, "window": {1: 5 * mib, 2: 6 * mib}}
    (said, _) = report._same_peaks(table, [1, 2])
    assert "*loop* and *model* coincide" in said and "window" not in said
    assert report._same_peaks({"a": {1: mib}, "b": {1: 2 * mib}}, [1]) == []
    # methods not measured draw no line: they coincide with nothing
    assert report._same_peaks({"a": {1: None}, "b": {1: None}, "c": {1: mib}}, [1]) == []
    assert report._with_spe("at the large steps_per_execution", {"settings": {}}) == (
        "at the large steps_per_execution")
    with open(report.READER_PAGE, encoding="utf-8") as f:
        committed = f.read()
    assert "large steps_per_execution" not in committed and "best of N" not in committed


def test_the_memory_table_shows_the_weights_and_the_probe_its_inputs_and_arithmetic(tmp_path):
    """The reader found the size of the weights in no table, and K=16, b=256 and the probe's
    multiple_of in no table: the weights are a row of the memory table, and the probe's
    sentence gives B, the first size, multiple_of and the division that gives K and b."""
    out = _full_fake_run(tmp_path / "run")
    path = os.path.join(out, "results.json")
    with open(path, encoding="utf-8") as f:
        results = json.load(f)
    results["settings"].update(probe_start=32, probe_multiple_of=32)
    results["probe"] = {"target_batch_size": 4096, "max_micro_batch": 320, "accum_steps": 16,
                        "micro_batch_size": 256, "effective_batch_size": 4096,
                        "probes": [[32, True], [512, False], [320, True]],
                        "probe_seconds": [0.5, 9.0, 0.6], "filters": [32, 64], "error": None,
                        "device": "CPU:0", "cpu_limit_mb": 160}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f)
    text = report.render_reader_page([out], out)
    ks = len({r["accum_steps"] for r in results["memory"]})
    assert f"| {report.WEIGHTS_ROW} |" + " 1.0 |" * ks in text  # fake weights: 1 MiB
    assert "One copy of the trainable weights:" not in text
    assert "for updates of B=4096, probing multiples of 32 from 32." in text
    assert ("Largest micro-batch that fits: **320**. For B=4096 the plan takes the fewest "
            "micro-batches whose size divides B and is at most 320: K=16 of b = 4096 / 16 = "
            "256 samples.") in text
    assert "TF_CPU_BFC_MEM_LIMIT_IN_MB" not in text
    for r in results["memory"]:
        r["weights_bytes"] = None
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f)
    unweighed = report.render_reader_page([out], out)
    assert report.WEIGHTS_ROW not in unweighed and "The last row is" not in unweighed


def test_the_book_page_says_which_entry_points_it_measures_and_how_to_rerun_each_part():
    """The reader found "measured on every entry point" though the recommended one
    (``accumulate(model, micro_batch_size=b)`` with ``fit`` at B) is measured in chapter 7 only,
    configuration (4) not saying whether it runs ``fit`` at b or at B, and "scripts of their
    own" named nowhere."""
    with open(os.path.join(ROOT, "book", "reference", "benchmarks.md"), encoding="utf-8") as f:
        page = f.read()
    assert "every entry point" not in page
    assert "`accumulate(model, micro_batch_size=b)` with `fit(batch_size=B)` is measured in\n" \
        "{doc}`chapter 7 <../07_memory_speed>`" in page
    assert "(4) `AccumModel.fit` with `accum_steps=K` (`fit` at b" in page
    # the one command a reader runs, and where its tables go (round-13 reader C1: no command,
    # only "suite / contributing guide" talk); the separate runs' commands are in the guide
    # the page links, with no maintainer flags on the page
    reproduce = page.split("## Reproduce", 1)[1]
    assert "pip install -r requirements.txt -e . && python benchmarks/run.py\n" in reproduce
    # round-16 reader C1: a GPU's install line and command are on the page, not only in the guide
    assert ('pip install "tensorflow[and-cuda]==2.21.0" keras==3.15.1 matplotlib -e . && '
            "bash benchmarks/gpu.sh\n") in reproduce
    # round-14 reader C1: the build's output file is not named to readers
    assert "READER.md" not in reproduce
    assert "writes these tables for it" in reproduce
    # round-17 reader C1: the separate runs' commands are on the page, in a code block, not
    # behind a link to the maintainers' CONTRIBUTING.md; command-line flags stay out of the
    # prose (round 14), so the prose outside the code blocks has none
    assert "CONTRIBUTING" not in reproduce and "contributing guide" not in reproduce
    blocks = re.findall(r"```bash\n(.*?)```", reproduce, re.S)
    prose = re.sub(r"```bash\n.*?```", "", reproduce, flags=re.S)
    assert blocks and "--" not in prose and "suite" not in reproduce
    commands = "".join(blocks)
    for script in ("run.py --only breakdown --merge", "nonfinite_cost.py", "accumulate_lm.py",
                   "run.py --report"):
        assert f"python benchmarks/{script}" in commands, script
        assert os.path.isfile(os.path.join(ROOT, "benchmarks", script.split()[0])), script
    with open(report.READER_PAGE, encoding="utf-8") as f:
        assert "every entry point" not in f.read()


def test_the_reader_page_claims_no_speed_or_memory_cause_it_does_not_measure(tmp_path):
    """Round-13 reader A3, A4, A5: no speed verdict on XLA's convolutions (never timed), no
    cause or run-to-run spread of memory peaks (each measured once), and the ratios figure is
    not said to name configurations it does not name."""
    out = _full_fake_run(tmp_path / "run")
    text = open(report.write_reader_page([out], os.path.join(out, "READER.md")),
                encoding="utf-8").read()
    for claim in ("far slower", "scratch buffers", "far above its activations",
                  "from run to run", "each with the fastest configuration it names"):
        assert claim not in text, claim
    assert "Each peak was measured once, in a fresh process" in text
    results = fake_results()
    xla_rows = [r for r in results["throughput"] if r["config"].endswith("_xla")]
    assert xla_rows
    for r in xla_rows:
        r["skipped"] = "XLA on CPU convolutions"
    lines = report._reader_throughput_tables(results)
    xla = [line for line in lines if line.startswith("- ") and "XLA" in line]
    assert xla and all("far slower" not in line and "not measured here" in line for line in xla)


def test_the_reader_page_prints_what_its_sentences_quote_and_code_with_straight_quotes():
    """Round-15 reader c B1, B2, D8, A4: window_step's XLA ratios only in a sentence; the
    breakdown's ±6–28 % in no column; ``mode='function'`` curled by the book outside code; "its
    floor (8)" without saying which; exactness claimed without the page that measures it."""
    with open(report.READER_PAGE, encoding="utf-8") as f:
        page = f.read()
    assert "| `window_step` with XLA / without (MLP only) | 4 | 0.44 | 0.77 | 1.05 |" in page
    assert "| model | variant | samples/s | ms per micro-batch | added ms | ± % |" in page
    assert "| forward+backward only (the floor) | 6,503 | 2.460 |  | 28 |" in page
    outside_code = "".join(page.split("`")[::2])
    assert "mode='" not in outside_code and 'mode="' not in outside_code
    assert "| fastest of (5)/(6) / its floor (8) compiled the same way |" in page
    assert "(measured in chapter 6b's section 3)" in page
    assert report._code_entry("AccumTrainer.fit(mode='graph') epoch") == (
        "`AccumTrainer.fit(mode='graph')` epoch")


def test_reader_page_says_the_machine_and_the_values_run():
    """The run's heading names the machine, not the run's folder key; the b and K run read
    as sets, not as intervals; the floor's label says how it was compiled by itself; the
    keyword setting of a table header is code (no curly quotes)."""
    with open(report.READER_PAGE, encoding="utf-8") as f:
        page = f.read()
    assert "## cpu:" not in page
    assert re.search(r"^## Results on a \d+-core CPU \(`CPU:0`\)$", page, re.MULTILINE)
    assert "∈ [" not in page and "b ∈ {" in page and "K ∈ {" in page
    assert "| fastest of (5)/(6) / its floor (8) compiled the same way |" in page
    assert '| `nonfinite="skip_micro_batch"`: paired' in page
    assert report._run_heading({"device": "GPU:0", "machine": {
        "gpus": [{"name": "/physical_device:GPU:0", "device_name": "Tesla T4"}]}}) == (
        "Results on Tesla T4 (`GPU:0`)")


def test_the_reader_page_prints_every_cell_ratio_its_summary_counts_cells_of():
    """Round-17 reader B1: "0.59–0.82 on the mlp (below 1 in every cell)" and "below 1 in 3 of
    the 4 cells" for window_step's XLA could only be checked by dividing throughput figures:
    the page prints both ratios per (model, b, K) cell, "—" where XLA was not timed."""
    def row(model: str, k: int, config: str, median: float) -> dict:
        return {"model": model, "micro_batch": 16, "accum_steps": k, "config": config,
                "median": median}
    results = {"throughput": [row("mlp", 4, "floor_window", 80.0), row("mlp", 4, "floor_B", 100.0),
                              row("mlp", 4, "window", 100.0), row("mlp", 4, "window_xla", 50.0),
                              row("conv", 4, "floor_window", 150.0),
                              row("conv", 4, "floor_B", 100.0)]}
    table = report._reader_cell_ratios(results)
    assert "| mlp | 16 | 4 | 0.80 | 0.50 |" in table
    assert "| conv | 16 | 4 | 1.50 | — |" in table
    assert report._reader_cell_ratios({"throughput": []}) == []
    with open(report.READER_PAGE, encoding="utf-8") as f:
        page = f.read()
    assert "| model | b | K | split over unsplit | `window_step`: XLA over without |" in page


def test_reader_page_names_each_models_layers_from_the_code(tmp_path):
    """The machine table has a models row read from the built models (reader 18 D5): the
    MLP's widths, and the conv net's layers with the run's own conv filters."""
    out = _full_fake_run(tmp_path / "run")
    text = report.render_reader_page([out], out)
    row = next(line for line in text.splitlines() if line.startswith("| models |"))
    assert "mlp: input 784 → Dense 256 relu → Dense 256 relu → Dense 10 softmax" in row
    assert report._model_words("conv", (8, 24)) == (
        "input 28×28×1 → Conv2D 8 3×3 → relu → max-pool 2×2 → Conv2D 24 3×3 → relu → "
        "max-pool 2×2 → Flatten → Dense 10 softmax")
