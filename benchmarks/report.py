"""Write the Markdown reports and the PNG plots from ``results.json`` files (no measuring).

``python benchmarks/run.py --report`` regenerates, from the committed JSON, every plot and two
pages: ``benchmarks/RESULTS.md`` (:func:`write_report`), the maintainers' report with every
target and whether it is met, and ``benchmarks/READER.md`` (:func:`write_reader_page`), the
results as the book's Reference shows them (method, tables, plots and what they mean; no
targets).
"""

from __future__ import annotations

import json
import os
import re
import statistics
from collections.abc import Sequence
from typing import Any

from accumcore.lab import benchmarking as bm

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(HERE, "results")
TOP_REPORT = os.path.join(HERE, "RESULTS.md")
#: The reader's page: what ``book/reference/benchmarks.md`` includes.
READER_PAGE = os.path.join(HERE, "READER.md")


def _fmt(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def _mib(value: float | None) -> str:
    return "—" if value is None else f"{value / 2**20:.1f}"


def write_plots(results: dict[str, Any], out_dir: str) -> list[str]:
    """Save ``throughput_<model>.png``, ``ratios.png`` and ``memory.png``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []

    def save(name: str, draw, figsize: tuple[float, float]) -> None:
        fig, ax = plt.subplots(figsize=figsize)
        draw(ax)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110, bbox_inches="tight")  # the legends sit outside the axes
        plt.close(fig)
        paths.append(path)

    models = list(dict.fromkeys(r["model"] for r in results["throughput"]))
    for model in models:
        save(f"throughput_{model}.png", lambda ax, m=model: bm.plot_throughput(results, m, ax),
             (13, 12))
    if results["throughput"]:
        save("ratios.png", lambda ax: bm.plot_ratios(results, ax), (10, 7))
    if bm.memory_table(results):
        save("memory.png", lambda ax: bm.plot_memory(results, ax), (8, 5))
    return paths


def _set(values: Sequence[Any]) -> str:
    """``values`` in set notation, ``{16, 64}``: the values run, not an interval."""
    return "{" + ", ".join(str(v) for v in values) + "}"


def _run_heading(results: dict[str, Any]) -> str:
    """The reader's heading of one run: the machine in words and the device measured."""
    device, m = results["device"], results["machine"]
    if device.upper().startswith("GPU"):
        gpus = ", ".join(g.get("device_name", g["name"]) for g in m.get("gpus", []))
        return f"Results on {gpus or 'a GPU'} (`{device}`)"
    return f"Results on a {m.get('cpus_usable')}-core CPU (`{device}`)"


def _model_words(kind: str, filters: Sequence[int]) -> str:
    """Model ``kind`` as the benchmarks build it (:func:`accumcore.lab.benchmarking.build_model`,
    conv ``filters``), layer by layer, e.g. ``"input 784 → Dense 256 relu → … → Dense 10
    softmax"``: read from the built model, so the page cannot drift from the code."""
    model = bm.build_model(kind, filters=tuple(filters))
    parts = ["input " + "×".join(str(d) for d in model.input_shape[1:])]
    for layer in model.layers:
        config = layer.get_config()
        name = type(layer).__name__
        if name == "InputLayer":
            continue
        if name == "Dense":
            parts.append(f"Dense {config['units']} {config['activation']}")
        elif name == "Conv2D":
            parts.append(f"Conv2D {config['filters']} "
                         + "×".join(str(k) for k in config["kernel_size"]))
        elif name == "MaxPooling2D":
            parts.append("max-pool " + "×".join(str(k) for k in config["pool_size"]))
        elif name == "Activation":
            parts.append(str(config["activation"]))
        else:
            parts.append(name)
    return " → ".join(parts)


def _machine_section(results: dict[str, Any]) -> list[str]:
    m = results["machine"]
    s = results["settings"]
    gpus = ", ".join(g.get("device_name", g["name"]) for g in m.get("gpus", [])) or "none"
    load = m.get("load_average") or []
    load_end = m.get("load_average_end") or []
    return [
        "| | |", "|---|---|",
        f"| device measured | `{results['device']}` |",
        f"| CPU | {m.get('cpu_model')} ({m.get('cpus_usable')} usable of {m.get('cpu_count')} "
        "cores) |",
        f"| memory | {m.get('memory_gib')} GiB |",
        f"| GPUs | {gpus} |",
        f"| software | Python {m['python']}, TensorFlow {m['tensorflow']}, Keras {m['keras']}, "
        f"NumPy {m['numpy']}, accumcore {m['accumcore']} |",
        f"| platform | {m['platform']} |",
        f"| load average (1, 5, 15 min) at start / end | "
        f"{', '.join(f'{v:.1f}' for v in load)} / {', '.join(f'{v:.1f}' for v in load_end)} |",
        f"| run | {results['created']}{' (a quick smoke test)' if s['quick'] else ''}, "
        f"data: {'MNIST' if s['data'] == 'mnist' else s['data']} |",
        f"| throughput settings | models {', '.join(s['models'])}; "
        f"b ∈ {_set(s['micro_batches'])}; K ∈ {_set(s['accum_steps'])}; "
        f"median of {s['repeats']} interleaved repeats; "
        f"steps_per_execution={s['steps_per_execution']}; Adam(1e-3) |",
        "| models | " + "; ".join(
            f"{kind}: {_model_words(kind, s['conv_filters'])}"
            for kind in s["models"] if kind in bm.INPUT_SHAPES) + " |",
        f"| memory settings | conv net filters {s['memory_filters']}, b={s['memory_micro_batch']},"
        f" K ∈ {_set(s['memory_accum_steps'])}, one fresh subprocess each |",
    ]


def _summary_section(results: dict[str, Any]) -> list[str]:
    """The run in one table: each ratio's range over the cells (what book chapter 7 quotes)."""
    lines = ["Each ratio over the (model, b, K) cells of this run; the sections below hold the "
             "cells, the targets and what each ratio means.", "",
             "| ratio | cells | lowest | median | highest | target | cells at or above it |",
             "|---|---|---|---|---|---|---|"]
    for row in bm.ratio_summary(results):
        target = "—" if row["target"] is None else f"≥ {row['target']:g}"
        met = "—" if row["met"] is None else f"{row['met']} of {row['cells']}"
        lines.append(f"| {row['label']} | {row['cells']} | {_fmt(row['low'])} | "
                     f"{_fmt(row['median'])} | {_fmt(row['high'])} | {target} | {met} |")
    targeted = [r for r in results.get("ops") or [] if r["target"]]
    if targeted:
        ratios = [r["ratio"] for r in targeted]
        met = sum(r <= bm.OPS_RATIO_TARGET for r in ratios)
        lines.append(f"| graph operations / minimal accumulator's (entry points) | "
                     f"{len(ratios)} | {_fmt(min(ratios))} | {_fmt(statistics.median(ratios))} | "
                     f"{_fmt(max(ratios))} | ≤ {bm.OPS_RATIO_TARGET:g} | {met} of {len(ratios)} "
                     "(at or below) |")
    table = bm.memory_table(results)
    plain = table.get("plain", {})
    if len(plain) > 1:
        ks = sorted(plain)
        growth = _fmt(plain[ks[-1]] / plain[ks[0]])
        lines.append(f"| peak memory, plain batch of K·b: K={ks[-1]} / K={ks[0]} | 1 | "
                     f"{growth} | {growth} | {growth} | — | — |")
    for method, peaks in table.items():
        if method != "plain" and len(peaks) > 1:
            flat = _fmt(max(peaks.values()) / min(peaks.values()), 3)
            ok = max(peaks.values()) / min(peaks.values()) <= bm.MEMORY_RATIO_TARGET
            lines.append(f"| peak memory, {bm.MEMORY_METHODS.get(method, method)}: max/min "
                         f"over K | 1 | {flat} | {flat} | {flat} | ≤ {bm.MEMORY_RATIO_TARGET:g} | "
                         f"{int(ok)} of 1 (at or below) |")
    return lines


def _targets_section(results: dict[str, Any]) -> list[str]:
    rows = bm.evaluate_targets(results)
    judged = [r for r in rows if r["met"] is not None]
    met = sum(1 for r in judged if r["met"])
    lines = [f"**{met} of {len(judged)} checks met.**", "",
             "| target | cell / method | value | threshold | met | note |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r["met"] is None:
            verdict = "(reported)"
        elif r["met"]:
            verdict = "yes"
        else:
            t, v = r["threshold"], r["value"]
            higher_is_better = "ops" not in r["target"] and (
                "vs" in r["target"] or "fit" in r["target"])
            gap = (1 - v / t) if higher_is_better else (v / t - 1)
            verdict = f"**no** (missed by {100 * gap:.1f} %)"
        digits = 0 if "traces" in r["target"] else 3
        lines.append(f"| {r['target']} | {r['cell']} | {_fmt(r['value'], digits)} | "
                     f"{_fmt(r['threshold'], digits) if r['threshold'] is not None else '—'} | "
                     f"{verdict} | {r['note']} |")
    return lines


def _lean_section(results: dict[str, Any]) -> list[str]:
    """Issue 19's targets (:func:`accumcore.lab.benchmarking.lean_targets`)."""
    rows = bm.lean_targets(results)
    if not rows:
        return ["(not measured)"]
    met = sum(r["met"] for r in rows)
    lines = [f"**{met} of {len(rows)} checks met.** Speed ratios are decided on the best-of-"
             f"{(results.get('settings') or {}).get('repeats', 'N')} ratio (fastest interleaved "
             "repeat over fastest; interference only ever slows a run), the ratio of the medians "
             "beside it; the headline cell (mlp b=16 K=4) must reach the first threshold, every "
             "other cell 0.95. Sizes are of `accumcore/` without `lab/`: classes and functions "
             "by line span (docstrings included), code lines without docstrings, comments or "
             "blank lines. What the once-per-window NaN/Inf check (which Keras does not have) "
             "costs: the table after this one (and, at steps_per_execution 1 and 32, `python "
             "benchmarks/nonfinite_cost.py`); graph operations: the ops table below.",
             "",
             "| target | cell | value (best of N) | median ratio | threshold | met |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        integer = isinstance(r["best"], int)
        value = str(r["best"]) if integer else _fmt(r["best"], r.get("digits", 3))
        bound = f"{'≤' if r.get('at_most') else '≥'} {r['threshold']:g}"
        lines.append(f"| {r['target']} | {r['cell']} | {value} | {_fmt(r['median'], 3)} | "
                     f"{bound} | {'yes' if r['met'] else '**no**'} |")
    files = (results.get("code") or {}).get("files")
    if files:
        lines += ["", "Library code lines by module (the target of 2,652 was set before issue "
                  "18 added `denominators.py`): " + ", ".join(
                      f"`{name.split('/')[-1]}` {n:,}" for name, n in files.items()) + "."]
    return lines + _check_cost_lines(results) + _paired_cost_lines(results.get(
        "nonfinite_cost"))


#: ``python benchmarks/nonfinite_cost.py --out`` 's file in a results directory, if run there.
NONFINITE_COST_FILE = "nonfinite_cost.json"
#: ``python benchmarks/accumulate_lm.py --out`` 's file in a results directory, if run there.
ACCUMULATE_LM_FILE = "accumulate_lm.json"
#: ``python benchmarks/profile_step.py --out`` 's file in a results directory, if run there.
PROFILE_STEP_FILE = "profile_step.json"


def accumulate_lm_lines(record: dict[str, Any] | None) -> list[str]:
    """``benchmarks/accumulate_lm.py``'s figure: ``accumulate``'s ``fit`` over Keras's own
    accumulation on a tiny KerasHub causal LM, paired per round, with its 95 % interval."""
    if not record:
        return []
    c, p = record["config"], record["throughput_ratio_paired"]
    verdict = "met" if p["median"] >= record["target"] else "**missed**"
    return [f"`accumcore.accumulate` on a KerasHub `GPT2CausalLM` ({c['layers']} layers, "
            f"{c['hidden']} wide, {c['sequences']} sequences of {c['length']} tokens, b="
            f"{c['micro_batch']}, K={c['accum_steps']}, Adam with an `ExponentialDecay` "
            f"schedule; Keras {c['keras']}, KerasHub {c['keras_hub']}), against the same "
            "model with Keras's `gradient_accumulation_steps`: `python benchmarks/"
            f"accumulate_lm.py --rounds {c['rounds']}`. Each round fits one epoch with each, "
            "in alternating order.", "",
            "| throughput, accumulate / Keras | paired median [95 % interval] | best of N "
            "| target | |",
            "|---|---|---|---|---|",
            f"| fit | {bm.ratio_text(p)} | "
            f"{record['throughput_ratio_best_of_n']:.3f} | ≥ {record['target']:g} | {verdict} |"]


#: ``python benchmarks/split_fit.py --out`` 's file in a results directory, if run there.
SPLIT_FIT_FILE = "split_fit.json"
def split_fit_lines(record: dict[str, Any] | None) -> list[str]:
    """``benchmarks/split_fit.py``'s figures: ``fit`` with ``micro_batch_size`` (the batch of B
    split inside the step) over each reference, paired per round with the 95 % interval, the
    target and its verdict (met when the interval's lower end reaches it); and the peak
    memory against plain ``fit`` at b plus the batch's inputs."""
    if not record:
        return []
    lines = ["Same updates from the same samples in every configuration (B = 64 = 4 x 16 for "
             "the MLP and the conv net, 32 = 4 x 8 for the KerasHub GPT-2; `_jit`: every "
             "configuration compiled with `jit_compile=True`, as Keras compiles on a GPU): "
             f"`python benchmarks/split_fit.py --models mlp conv lm --jit --rounds "
             f"{record['rounds']}` "
             f"(TensorFlow {record['tensorflow']}, Keras {record['keras']}; load average "
             f"{record['load_average'][0][0]:.1f} at the start, "
             f"{record['load_average'][-1][0]:.1f} at the end). Each round fits one epoch "
             "of every configuration in a rotating order.", "",
             "| model | throughput of split fit over | paired median [95 % interval] | target "
             "| |", "|---|---|---|---|---|"]
    words = {"met": "met", "missed": "**missed**", "undecided": "not shown (interval spans it)",
             None: ""}
    for r in bm.split_fit_rows(record):
        target = "" if r["target"] is None else f"≥ {r['target']:g}"
        lines.append(f"| {r['model']} | {bm.SPLIT_FIT_REFERENCES[r['reference']]} | "
                     f"{bm.ratio_text(r)} | {target} | "
                     f"{words[r['verdict']]} |")
    if any(r["reference"] == "plain_B" for r in bm.split_fit_rows(record)):
        lines += ["", "Why below plain `fit` at B: the same passes cost more per sample on "
                  "micro-batches of b than on B (the Summary's rows 'plain fit at b / plain fit "
                  "at B' and 'floor split into K micro-batches / the same passes unsplit'), and "
                  "the window adds its bookkeeping once per update (adding each micro-batch's "
                  "gradient, the close's NaN/Inf check, emptying the accumulators). Accumulate "
                  "when B does not fit; when it fits, train at B."]
    xla = record.get("xla_loop")
    if xla:
        lines += ["", "Why `conv_jit` is slow: under XLA on this CPU, the conv net's gradient for "
                  f"one micro-batch of 64 took {xla['conv_in_loop_ms']:.1f} ms inside a "
                  f"one-iteration `tf.while_loop` against {xla['conv_direct_ms']:.1f} ms "
                  f"compiled directly ({xla['conv_in_loop_ms'] / xla['conv_direct_ms']:.1f} x; "
                  f"the MLP's: {xla['mlp_in_loop_ms']:.2f} against {xla['mlp_direct_ms']:.2f} "
                  "ms). The split step runs its micro-batches in such a loop; Keras compiles "
                  "with XLA by default only on a GPU."]
    memory = record.get("memory")
    if memory:
        s = memory["settings"]
        lines += ["", f"Peak memory (conv net, filters {tuple(s['filters'])}, one step in a "
                  f"fresh process): split fit at B = {s['batch']}, b = {s['micro']} "
                  f"{memory['split']['peak_bytes'] / 2**20:.1f} MiB; plain fit at b "
                  f"{memory['plain_b']['peak_bytes'] / 2**20:.1f} MiB plus the batch's inputs: "
                  f"ratio {memory['ratio_to_plain_b_plus_input']:.3f} (target ≤ 1.05: "
                  f"{'met' if memory['ratio_to_plain_b_plus_input'] <= 1.05 else '**missed**'})."]
    return lines


#: Issue 32's targets: AccumModel.fit against Keras's accumulation (paired median, and the
#: interval's lower end), the graph loop against the minimal accumulator, library code lines.
RULE_FIT_TARGET, RULE_FIT_LOW, RULE_GRAPH_TARGET, RULE_CODE_LINES = 1.0, 0.95, 0.95, 2900


def _rule_targets_lines(results: dict[str, Any]) -> list[str]:
    """Issue 32's targets, met or missed, from ``nonfinite_cost.json`` (paired fit ratios at
    steps_per_execution 1 and 32), the breakdown (graph loop over the minimal accumulator,
    paired per round) and the library's code lines now; the check's measured share beside."""
    record, rows = results.get("nonfinite_cost"), []

    def verdict(ok: bool) -> str:
        return "met" if ok else "**missed**"

    for spe, kinds in (record or {}).get("by_spe", {}).items():
        p, q = kinds["accumcore"]["paired"], kinds["accumcore_unchecked"]["paired"]
        ok = p["median"] >= RULE_FIT_TARGET and p["low"] >= RULE_FIT_LOW
        extra = ""
        if "accumcore_skip_micro_batch" in kinds:
            skip = kinds["accumcore_skip_micro_batch"]["paired"]
            extra = f"; skip_micro_batch {bm.ratio_text(skip)}"
        rows.append(f"| AccumModel.fit / Keras, steps_per_execution={spe} | {bm.ratio_text(p)} "
                    f"(best of N {kinds['accumcore']['best']:.3f}) | >= {RULE_FIT_TARGET:g}, "
                    f"low >= {RULE_FIT_LOW:g} | {verdict(ok)} | without the check "
                    f"{bm.ratio_text(q)}{extra} |")
    by = {(r["model"], r["variant"]): r for r in results.get("breakdown") or []}
    for model in dict.fromkeys(m for m, _ in by):
        if (model, "optimizer") not in by or (model, "accumcore") not in by:
            continue
        minimal = by[(model, "optimizer")]["seconds"]
        p = bm.paired_ratio(minimal, by[(model, "accumcore")]["seconds"])
        q = bm.paired_ratio(minimal, by[(model, "accumcore_unchecked")]["seconds"]) \
            if (model, "accumcore_unchecked") in by else None
        rows.append(f"| graph loop / minimal accumulator, {model} | {bm.ratio_text(p)} | >= "
                    f"{RULE_GRAPH_TARGET:g} | {verdict(p['median'] >= RULE_GRAPH_TARGET)} | "
                    f"without the check {bm.ratio_text(q) if q else 'n/a'} |")
    lines = bm.code_size()["code_lines"][0]
    rows.append(f"| library code lines (`accumcore/` without `lab/`) | {lines:,} | <= "
                f"{RULE_CODE_LINES:,} | {verdict(lines <= RULE_CODE_LINES)} | measured now |")
    if not rows:
        return ["(not measured)"]
    return ["Paired per-round ratios (median [95 % interval]) from `benchmarks/nonfinite_cost.py` "
            "and the breakdown; the last column is what each figure would be without the "
            "once-per-window NaN/Inf check (a diagnostic), so the difference is the check's share "
            "of a miss.", "", "| target | measured | target | | beside |",
            "|---|---|---|---|---|", *rows, *profile_step_lines(results.get("profile_step"))]


def profile_step_lines(record: dict[str, Any] | None) -> list[str]:
    """Where the fit ratio's gap lies, from ``benchmarks/profile_step.py --out``: the median span
    of a micro-step by its position in the window, Keras's accumulation beside ``AccumModel``'s
    (position K-1 closes the window: the optimizer step in both)."""
    if not record:
        return []
    kinds = record["kinds"]
    keras_spans = kinds["keras_ga"]["span_by_position_us"]
    ours_spans = kinds["accumcore"]["span_by_position_us"]
    positions = sorted(keras_spans, key=int)
    last = positions[-1]
    extra = {p: ours_spans[p] - keras_spans[p] for p in positions}
    rows = [f"| {p}{' (closes the window)' if p == last else ''} | {keras_spans[p]:.0f} | "
            f"{ours_spans[p]:.0f} | {extra[p]:+.0f} |" for p in positions]
    inner = [extra[p] for p in positions if p != last]
    rounds = record.get("rounds", 1)
    return ["", f"Where the gap lies: `python benchmarks/profile_step.py --spe "
            f"{record['steps_per_execution']} --samples {record['samples']} --rounds {rounds}` "
            f"({record['created']}; TensorFlow {record['tensorflow']}, Keras {record['keras']}) "
            f"profiles {rounds} epoch{'s' if rounds > 1 else ''} of each `fit` (alternating) "
            "and cuts each into micro-steps at the first layer's forward matmul; the median "
            "span of a micro-step (µs) by its position in the window of "
            f"K={record['accum_steps']}, the median over the epochs:", "",
            "| position | Keras gradient_accumulation_steps | AccumModel | difference |",
            "|---|---|---|---|", *rows, "",
            f"Over one window AccumModel's micro-steps took {sum(extra.values()):+.0f} µs "
            f"against Keras's: {extra[last]:+.0f} µs in the micro-step that "
            f"closes the window and {sum(inner):+.0f} µs in the {len(inner)} that do not. The "
            "profiler adds a cost to every operation it records, so a step with more "
            "operations looks slower under it than it runs: this locates the difference (the "
            "window's close), and the paired ratios above measure it."]


def _paired_cost_lines(record: dict[str, Any] | None) -> list[str]:
    """``benchmarks/nonfinite_cost.py``'s figures: ``AccumModel.fit`` over Keras's accumulation
    with and without the check, as paired per-round ratios with their 95 % intervals."""
    if not record:
        return []
    samples = _nonfinite_cost_samples(record)
    lines = ["", f"The same two ratios for `AccumModel.fit`, measured apart by `python benchmarks/"
             f"nonfinite_cost.py --rounds {record['rounds']}` ({record['created']}; MLP, "
             f"b={record['micro_batch']}, K={record['accum_steps']}, {samples:,} synthetic samples "
             "per epoch): every round fits one epoch with each model back to "
             "back, so each round's ratio compares runs that shared the machine's state; the "
             "median of those ratios, with its 95 % bootstrap interval, beside the best-of-N "
             "ratio.", ""]
    return lines + _paired_cost_table(record)


def _nonfinite_cost_samples(record: dict[str, Any]) -> int:
    """Samples per epoch of ``nonfinite_cost.py``'s run (its rate times its time)."""
    keras_ga = next(iter(record["by_spe"].values()))["keras_ga"]
    return round(keras_ga["samples_per_s"] * min(keras_ga["seconds"]))


def _paired_cost_table(record: dict[str, Any]) -> list[str]:
    """The table of :func:`_paired_cost_lines` (RESULTS.md) and of the reader's page."""
    shown = [k for k in ("accumcore", "accumcore_unchecked", "accumcore_skip_micro_batch")
             if k in next(iter(record["by_spe"].values()))]
    titles = {"accumcore": "AccumModel.fit / Keras", "accumcore_unchecked": "without the check",
              "accumcore_skip_micro_batch": '`nonfinite="skip_micro_batch"`'}
    lines = ["| steps_per_execution | " + " | ".join(
                 f"{titles[k]}: paired [95 % interval] | best of {record['rounds']}"
                 for k in shown) + " |",
             "|---|" + "---|---|" * len(shown)]
    for spe, kinds in record["by_spe"].items():
        cells = []
        for kind in shown:
            p = kinds[kind]["paired"]
            cells += [bm.ratio_text(p), _fmt(kinds[kind]["best"], 3)]
        lines.append(f"| {spe} | " + " | ".join(cells) + " |")
    return lines


def _check_cost_lines(results: dict[str, Any]) -> list[str]:
    """Why the speed targets are missed, measured: the breakdown with and without the check."""
    rows = bm.check_cost(results)
    if not any(r["graph_unchecked"] or r["fit_unchecked"] for r in rows):
        return []
    lines = ["", "What the NaN/Inf check costs, measured in the breakdown below (the same "
             "process, the variants interleaved; best-of-N throughput ratios): each accumcore "
             "path as shipped and traced without the check (`nonfinite=UNCHECKED` in "
             "`benchmarks/suite.py`, a diagnostic only). The gap the check leaves is the part "
             "of each missed speed target that the issue's \"with the non-finite check kept\" "
             "does not allow removing.", "",
             "| cell | graph loop / minimal | without the check | AccumModel.fit / Keras "
             "| without the check |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cell']} | {_fmt(r['graph'], 3)} | {_fmt(r['graph_unchecked'], 3)} "
                     f"| {_fmt(r['fit'], 3)} | {_fmt(r['fit_unchecked'], 3)} |")
    return lines


def _throughput_section(results: dict[str, Any], plot_prefix: str) -> list[str]:
    return _throughput_tables(results, plot_prefix) + _ratios_table(results, plot_prefix)


def _throughput_tables(results: dict[str, Any], plot_prefix: str | None) -> list[str]:
    """Per model: the samples/s of every configuration and cell, its plot (not with
    ``plot_prefix=None``: the reader's page, where the table says it all), what failed."""
    lines: list[str] = []
    for model in dict.fromkeys(r["model"] for r in results["throughput"]):
        headers, rows = bm.throughput_table(results, model)
        lines += [f"#### {model}", "", bm.markdown_table(headers, rows), ""]
        if plot_prefix is not None:
            lines += [f"![throughput {model}]({plot_prefix}throughput_{model}.png)", ""]
        errors = [r for r in results["throughput"] if r["model"] == model and r.get("error")]
        for r in errors:
            lines.append(f"- `{r['config']}` (b={r['micro_batch']}, K={r['accum_steps']}) "
                         f"failed: {r['error']}")
        reasons = dict.fromkeys(r["skipped"] for r in results["throughput"]
                                if r["model"] == model and r.get("skipped"))
        for reason in reasons:
            configs = sorted({r["config"] for r in results["throughput"]
                              if r["model"] == model and r.get("skipped") == reason})
            lines.append(f"- skipped {', '.join(f'`{c}`' for c in configs)}: {reason}.")
        if errors or reasons:
            lines.append("")
    return lines


def _ratios_table(results: dict[str, Any], plot_prefix: str) -> list[str]:
    spe = results["settings"].get("large_steps_per_execution")
    lines = ["#### Ratios", "",
              f"| cell | (4)/(3) | (4)/(3) at spe={spe} | each compiled / minimal (9) | "
              "best of (5)/(6) | its / floor (8) | each compiled / its floor "
              "| best accumcore | / plain fit at B (2) | (2)/(1) | floor split / unsplit "
              "| fit XLA / fit |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in bm.throughput_ratios(results):
        per = ", ".join(f"{c} {_fmt(v)}" for c, v in row["per_floor"].items())
        per_min = ", ".join(f"{c} {_fmt(v)}" for c, v in row.get("per_minimal", {}).items())
        lines.append(
            f"| {row['model']} b={row['micro_batch']} K={row['accum_steps']} | "
            f"{_fmt(row['fit_vs_keras'])} | {_fmt(row.get('fit_vs_keras_spe'))} | {per_min} | "
            f"{row['best_compiled']} | {_fmt(row['vs_floor'])} | "
            f"{per} | {row['best_accum']} | {_fmt(row['vs_large_batch'])} | "
            f"{_fmt(row['large_vs_small'])} | {_fmt(row['split_price'])} | "
            f"{_fmt(row.get('fit_xla_vs_fit'))} |")
    lines += ["", f"![ratios]({plot_prefix}ratios.png)", ""]
    return lines


#: A dotted call in a label (``AccumTrainer.fit(mode='graph')``): code on the reader's page.
_CALL = re.compile(r"(?<!`)\b([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+\([^)]*\))")


def _breakdown_section(results: dict[str, Any], spread: bool = False) -> list[str]:
    """The breakdown table; ``spread``: as the reader's page prints it, with a ± column (half
    the range of the repeats, in % of the median) and calls in the labels as code."""
    recs = results.get("breakdown") or []
    if not recs:
        return ["(not measured)"]
    lines = [
        "Where the time of an accumulated micro-batch goes: each variant adds one ingredient "
        "of accumulation to the one before, all as a whole epoch in one `tf.function` (like "
        "`mode=\"graph\"` and the floor (8)). The row that adds Adam once per window is the "
        "minimal correct accumulator (9) as one whole-epoch function, with no checks; "
        "from it to `accumcore` is accumcore's own bookkeeping (NaN/Inf checks, "
        "further counters, window hooks, per-micro-batch loss records), split in two by a row "
        "with the same loop traced without its NaN/Inf check. The last three rows are "
        "`model.fit` "
        "(one epoch, not one `tf.function`): Keras's own accumulation and `AccumModel` with "
        "and without the check.", "",
        "| model | variant | samples/s | ms per micro-batch | added ms |"
        + (" ± % |" if spread else ""),
        "|---|---|---|---|---|" + ("---|" if spread else "")]
    for model in dict.fromkeys(r["model"] for r in recs):
        prev = None
        for r in (r for r in recs if r["model"] == model):
            ms = r.get("ms_per_micro_batch")
            reference = r.get("reference", r["variant"] == "adam_each")
            added = "" if prev is None or ms is None or reference else f"{ms - prev:+.3f}"
            noise = (f" {50 * r['spread']:.0f} |" if r.get("spread") is not None else " — |"
                     ) if spread else ""
            label = _CALL.sub(r"`\1`", r["label"]) if spread else r["label"]
            lines.append(f"| {model} b={r['micro_batch']} K={r['accum_steps']} | "
                         f"{label} | {_rate(r['median'])} | {_fmt(ms, 3)} | {added} |" + noise)
            if not reference:
                prev = ms
    return lines


def _ops_section(results: dict[str, Any]) -> list[str]:
    recs = results.get("ops") or []
    if not recs:
        return ["(not measured)"]
    lines = [
        "A figure that does not depend on machine noise: the graph operations of each entry "
        "point's traced function, against the minimal correct accumulator "
        "(`benchmarks/minimal.py`) traced the same way, Adam(1e-3). Counted by "
        "`accumcore.lab.benchmarking.graph_op_count`: the nodes of the traced GraphDef plus "
        "the nodes of every function in its library (both branches of every `tf.cond`, the "
        "condition and body of every while loop, nested `tf.function`s), before Grappler's "
        "optimisations. `train_step`s are traced in a `tf.function` of their own for one batch; "
        "the epoch and window functions hold one traced micro-step inside their loop.", "",
        "| model | entry point | ops | minimal accumulator | its ops | ratio | ≤ 1.5 |",
        "|---|---|---|---|---|---|---|"]
    for r in recs:
        verdict = ("yes" if r["ratio"] <= bm.OPS_RATIO_TARGET else "**no**") if r["target"] \
            else "(reference)"
        lines.append(f"| {r['model']} | {r['entry']} | {r['ops']} | "
                     f"{bm.MINIMAL_VARIANTS[r['variant']]} | {r['minimal_ops']} | "
                     f"{r['ratio']:.2f} | {verdict} |")
    lines.append("")
    for r in recs:
        extra = r.get("extra_op_types")
        if r["target"] and extra:
            top = ", ".join(f"{t} {n:+d}" for t, n in list(extra.items())[:10])
            lines.append(f"- {r['model']} {r['entry']}, op types added over the minimal "
                         f"(largest first): {top}")
    return lines


_MEMORY_NOTE = (
    "`window_step` receives the whole batch of K·b samples and slices it inside the graph, "
    "so it holds K·b inputs; the loop and "
    "`AccumModel` receive one micro-batch at a time. On CPU, TensorFlow's convolution "
    "kernels allocate scratch buffers of fixed size, so even plain batch b peaks far above "
    "its activations. Peaks of one configuration can differ by a few MiB from run to run "
    "(thread scheduling changes which buffers are alive at the same time; window_step at "
    "K=16 peaked at 67.9 and 71.0 MiB in two runs of the same code during development).")
#: The reader's page shows one run and no activation sizes: it says how the inputs are held,
#: that each peak was measured once, and gives no cause it does not measure.
_READER_MEMORY_NOTE = (
    "`window_step` receives the whole batch of K·b samples and slices it inside the graph, "
    "so it holds K·b inputs; the loop and `AccumModel` receive one micro-batch at a time. "
    "Each peak was measured once, in a fresh process: this run repeats none of them, so it "
    "shows no spread for them, and why even plain batch b peaks where it does (the "
    "convolution kernels' working buffers, for instance) is not measured here.")


def _memory_section(results: dict[str, Any], plot_prefix: str) -> list[str]:
    table = bm.memory_table(results)
    if not table:
        return ["(not measured)"]
    ks = sorted({k for peaks in table.values() for k in peaks})
    weights = next((r["weights_bytes"] for r in results["memory"] if r.get("weights_bytes")),
                   None)
    budget = bm.memory_budget(results)
    b = results["memory"][0]["micro_batch"]
    lines = [f"Peak allocator memory in MiB (`get_memory_info('{results['device']}')['peak']`)"
             f", micro-batch b={b}; plain trains one batch of K·b. One copy of the trainable "
             f"weights: {_mib(weights)} MiB; target for accumulation: ≤ {_mib(budget)} MiB "
             "(1.05 × (plain b + weights)).", "",
             "| method | " + " | ".join(f"K={k}" for k in ks) + " |",
             "|---|" + "---|" * len(ks)]
    for method, peaks in table.items():
        lines.append(f"| {bm.MEMORY_METHODS.get(method, method)} | "
                     + " | ".join(_mib(peaks.get(k)) for k in ks) + " |")
    for r in results["memory"]:
        if r.get("error"):
            lines.append(f"\n- {r['method']} K={r['accum_steps']} failed: {r['error']}")
    lines += [
        "", f"![memory]({plot_prefix}memory.png)", "",
        _MEMORY_NOTE, ""]
    return lines


def _tracing_section(results: dict[str, Any]) -> list[str]:
    if not results["tracing"]:
        return ["(not measured)"]
    first = results["tracing"][0]
    lines = [f"MLP, {first['samples']} samples, micro-batch {first['micro_batch']}, "
             f"K={first['accum_steps']} (the last micro-batch and the last window are ragged), "
             "3 epochs.", "",
             "| compiled function | traces per epoch | total | ≤ 2, none after epoch 1 |",
             "|---|---|---|---|"]
    for r in results["tracing"]:
        lines.append(f"| {r['entry']} | {r['per_epoch']} | {r['total']} | "
                     f"{'yes' if bm.traced_in_first_epoch_only(r) else '**no**'} |")
    return lines


def _probe_section(results: dict[str, Any], inputs: str | None = None,
                   plan: str | None = None, limit_setting: str = " (`TF_CPU_BFC_MEM_LIMIT_IN_MB`)"
                   ) -> list[str]:
    """The probe's table between its first and last sentence.

    Args:
        results: the suite's results; its ``"probe"`` record is read.
        inputs: the clause after the memory said, from its ``,`` or ``:`` on (default
            ": target B=<B>").
        plan: the closing sentence (default: the largest fitting b, K, b and the effective
            batch as the record holds them).
        limit_setting: what follows the CPU limit in MiB (default: the setting that sets it).
    """
    p = results.get("probe")
    if not p:
        return ["Not run in this mode (the search logic is unit-tested in "
                "`tests/test_memory.py` with an injected predicate)."]
    if p.get("error"):
        return [f"Failed: {p['error']}"]
    where = (f"the CPU allocator limited to {p['cpu_limit_mb']} MiB{limit_setting} plays the "
             "device memory" if p.get("cpu_limit_mb") else f"the whole memory of `{p['device']}`")
    inputs = f": target B={p['target_batch_size']}" if inputs is None else inputs
    seconds = p.get("probe_seconds") or [None] * len(p["probes"])
    cells = [(str(b), "yes" if ok else "no", "" if t is None else f"{t:.1f}")
             for (b, ok), t in zip(p["probes"], seconds, strict=True)]
    return [
        f"`accumcore.memory.plan_accumulation` on the conv net (filters {p['filters']}), "
        f"{where}{inputs}. The probes, in the order they ran (no: ResourceExhaustedError):",
        "",
        "| probe | " + " | ".join(str(i) for i in range(1, len(cells) + 1)) + " |",
        "| --- |" + " --- |" * len(cells),
        *("| " + name + " | " + " | ".join(c[j] for c in cells) + " |"
          for j, name in enumerate(("micro-batch b", "fits", "seconds"))),
        "",
        plan if plan is not None else (
            f"Largest micro-batch that fits: **{p['max_micro_batch']}**, so K={p['accum_steps']} "
            f"micro-batches of {p['micro_batch_size']} (effective batch "
            f"{p['effective_batch_size']})."),
    ]


def _explanation(results: dict[str, Any]) -> list[str]:
    ratios = bm.throughput_ratios(results)
    if not ratios:
        return []
    targets = bm.evaluate_targets(results)

    def span(key: str) -> str:
        vals = [r[key] for r in ratios if r[key] is not None]
        return f"{min(vals):.2f}–{max(vals):.2f}" if vals else "—"

    def met(name: str) -> str:
        judged = [t for t in targets if t["target"] == name and t["met"] is not None]
        return f"met in {sum(t['met'] for t in judged)} of {len(judged)} cells"

    spreads = sorted(r["spread"] for r in results["throughput"] if r.get("spread") is not None)
    noise = spreads[len(spreads) // 2] if spreads else None
    return [
        "**Reading the ratios.** The typical spread of one configuration's repeats in this run "
        f"was {_fmt(100 * noise if noise is not None else None, 0)} % of its median (max − min"
        "): ratios closer to their target than that are within the noise of this machine.",
        "",
        f"*(4)/(3)*, `AccumModel.fit` over `fit` with Keras's `gradient_accumulation_steps`, "
        f"same `steps_per_execution`, ranged over {span('fit_vs_keras')} (target ≥ 1: "
        f"{met('(4)/(3) fit vs Keras accumulation')}). Both run one forward+backward pass "
        "per `train_step` and add the "
        "gradients into accumulators. accumcore also computes the micro-batch weight, checks "
        "each window's gradients for NaN/Inf once and keeps a sample-weighted loss tracker "
        "(the non-finite flag is read on the host once per epoch, not per step); in return it "
        "is exact for ragged windows, where Keras's mean of K micro-batch means is not.",
        "",
        f"*(4)/(3) at steps_per_execution={results['settings'].get('large_steps_per_execution')}*"
        f" ranged over {span('fit_vs_keras_spe')} (target ≥ 1: "
        f"{met('(4)/(3) fit vs Keras accumulation, large steps_per_execution')}): with "
        "many steps per execution "
        "the per-step host costs of `fit` (callbacks, the Python loop, one function call per "
        "batch) are shared by 32 steps, so what is left is the traced step itself, whose "
        "graph operations are compared in *Graph operations* below. `AccumModel.fit` with "
        f"`jit_compile=True` ran at {span('fit_xla_vs_fit')} x the speed without.",
        "",
        f"*Best compiled AccumTrainer over the minimal accumulator (9)* ranged over "
        f"{span('vs_minimal')} (target ≥ 0.95: "
        f"{met('best compiled AccumTrainer vs minimal accumulator (9)')}). The minimal "
        "accumulator "
        "(`benchmarks/minimal.py`) is the least code that is still exact: the gradient of the "
        "summed loss added into accumulators, the weight and a counter advanced, one `tf.cond` "
        "that divides once and applies. It pays the whole price of accumulating and nothing "
        "else, so this ratio is accumcore's own machinery (weights of sample-weighted batches, "
        "non-finite checks, counters, window hooks, loss records), compiled the same way "
        "(each of (5)/(6) against the minimal variant compiled like it).",
        "",
        f"*Best of (5)/(6) over the floor (8)* ranged over {span('vs_floor')} (target ≥ 0.95: "
        f"{met('best of (5)/(6) vs floor (8)')}). The floor runs the same K "
        "forward+backward passes, "
        "compiled the same way, without adding the gradients into accumulators, without the "
        "finiteness checks and without the optimizer update once per window; the gap is the "
        "whole cost of accumulating. Those costs are O(weights) per micro-batch, against "
        "O(b × weights) for the passes, so they should weigh most on the MLP at b = 16 (few "
        "operations per weight) and least on the conv net.",
        "",
        f"*Best accumcore over plain `fit` at B (2)* ranged over {span('vs_large_batch')}. "
        "What splitting costs by itself: the bare passes split into K micro-batches "
        "(`floor_window`) ran at " + span("split_price") + " of the same passes unsplit, one "
        "pass of B per call (`floor_B`), with no accumulation involved. A small batch gives "
        "each kernel less parallel work and reuses each weight fewer times, and every "
        "micro-batch pays the fixed per-step costs (op dispatch, the input pipeline, Python "
        "calls in the loops) K times per update instead of once. Accumulation is for when B "
        "does not fit; when it does, the plain large batch is normally faster.",
    ]


def _load_run(result_dir: str) -> dict[str, Any]:
    """``results.json`` of ``result_dir`` with the separately measured files beside it."""
    results = bm.load_results(os.path.join(result_dir, "results.json"))
    for key, file in (("nonfinite_cost", NONFINITE_COST_FILE),
                      ("accumulate_lm", ACCUMULATE_LM_FILE),
                      ("split_fit", SPLIT_FIT_FILE),
                      ("profile_step", PROFILE_STEP_FILE)):
        if os.path.isfile(os.path.join(result_dir, file)):
            with open(os.path.join(result_dir, file), encoding="utf-8") as f:
                results[key] = json.load(f)
    return results


def _image_prefix(result_dir: str, md_dir: str) -> str:
    """What an image link in a page written to ``md_dir`` puts before a plot's file name."""
    prefix = os.path.relpath(result_dir, md_dir).replace(os.sep, "/") + "/"
    return "" if prefix == "./" else prefix


def render(result_dirs: Sequence[str], md_dir: str) -> str:
    """The Markdown report for ``result_dirs`` (each holding a ``results.json``).

    Image links are relative to ``md_dir`` (where the Markdown file is written).
    """
    lines = [
        "# accumcore benchmarks",
        "",
        "<!-- Generated by `python benchmarks/run.py` (or `--report`) from results/*/"
        "results.json; do not edit by hand. -->",
        "",
        "Reproduce every figure with one command from the repository root: "
        "`python benchmarks/run.py` (full suite, writes `benchmarks/results/<cpu|gpu>/` and "
        "this file), `python benchmarks/run.py --quick --out DIR` (smoke test), "
        "`python benchmarks/run.py --report` (re-render this file and the plots from the "
        "JSON), `bash benchmarks/gpu.sh` (the GPU run). Method: docstrings of "
        "`accumcore/lab/benchmarking.py` and `benchmarks/suite.py`; discussion: book "
        "chapter 7.",
        "",
    ]
    devices = []
    for d in result_dirs:
        results = bm.load_results(os.path.join(d, "results.json"))
        devices.append(results["device"])
    if not any(dev.upper().startswith("GPU") for dev in devices):
        lines += [
            "> **No GPU results yet.** No GPU machine was available when these were measured. "
            "Absolute times only count on a GPU; the CPU figures below come from a small CPU "
            "machine (see its description; a load average above its core count means that other "
            "jobs shared it), so their absolute values are low and noisy. Ratios measured within "
            "one run (interleaved) are more reliable, and the memory and tracing figures do not "
            "depend on the load. `bash benchmarks/gpu.sh` on a machine with a GPU build of "
            "TensorFlow adds `results/gpu/`.",
            "",
        ]
    for d in result_dirs:
        results = _load_run(d)
        name = os.path.basename(os.path.normpath(d))
        prefix = _image_prefix(d, md_dir)
        lines += [f"## {name}: `{results['device']}`", "", "### Machine", ""]
        lines += _machine_section(results) + ["", "### Summary", ""]
        if results["throughput"]:
            lines += _summary_section(results)
        else:
            lines += ["(no throughput measured)"]
        lines += ["", "### Targets", ""]
        lines += _targets_section(results) + ["", "### A step as lean as Keras's (issue 19)",
                                              ""]
        lines += _lean_section(results) + [""]
        lines += ["### The rule resolved once (issue 32)", ""] + _rule_targets_lines(results)
        lines += [""]
        if results.get("accumulate_lm"):
            lines += ["### A pretrained model's fit: `accumulate` against Keras's accumulation",
                      ""] + accumulate_lm_lines(results["accumulate_lm"]) + [""]
        if results.get("split_fit"):
            lines += ["### The recipe's batch in fit: `micro_batch_size` (issue 40)", ""]
            lines += split_fit_lines(results["split_fit"]) + [""]
        lines += ["### Throughput (samples/s)", "",
                  "Median of the interleaved repeats (± half the range over the repeats, in % "
                  "of the median).", ""]
        if results["throughput"]:
            lines += _throughput_section(results, prefix) + _explanation(results) + [""]
        else:
            lines += ["(not measured)", ""]
        lines += ["### Graph operations", ""] + _ops_section(results) + [""]
        lines += ["### Where the time goes", ""] + _breakdown_section(results) + [""]
        lines += ["### Peak memory", ""] + _memory_section(results, prefix)
        lines += ["", "### Tracing", ""] + _tracing_section(results)
        lines += ["", "### Largest micro-batch probe", ""] + _probe_section(results) + [""]
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------- the reader's page
#: Words the reader's page never contains: the targets, their verdicts, the issues that set
#: them and the maintainers' own measures (unit-test seconds, code lines) stay in RESULTS.md.
#: ``tests/test_benchmark_reader.py`` checks the committed page and a fake run against it.
READER_FORBIDDEN = ("target", "missed", "issue", "checks met", "met in", "threshold",
                    "unit tests", "code lines", "tests/", "**no**", "minimal.py",
                    "--rounds", "TF_CPU_BFC", "during development", "while sizing", "![ratios]",
                    "![memory]")


def _span(values: Sequence[float | None], digits: int = 2) -> str:
    vals = [v for v in values if v is not None]
    if not vals:
        return "—"
    low, high = _fmt(min(vals), digits), _fmt(max(vals), digits)
    return low if low == high else f"{low}–{high}"


def _reader_summary(results: dict[str, Any]) -> list[str]:
    """The run in one table, and what each ratio means."""
    lines = ["Each ratio over the (model, b, K) cells of the run: the numbers (1)-(9) are the "
             "configurations of the throughput tables below.", "",
             "| ratio | cells | lowest | median | highest |", "|---|---|---|---|---|"]
    xla_models = sorted({r["model"].upper() for r in bm.throughput_ratios(results)
                         if r.get("fit_xla_vs_fit") is not None})
    window = _window_xla_ratios(results)
    for row in bm.ratio_summary(results):
        label = _with_spe(row["label"], results)
        if row["key"] == "fit_xla_vs_fit":
            label += f" ({', '.join(xla_models)} only)"
        lines.append(f"| {label} | {row['cells']} | {_fmt(row['low'])} | "
                     f"{_fmt(row['median'])} | {_fmt(row['high'])} |")
        if row["key"] == "fit_xla_vs_fit" and window:
            lines.append(f"| `window_step` with XLA / without ({', '.join(xla_models)} only) | "
                         f"{len(window)} | {_fmt(min(window))} | "
                         f"{_fmt(statistics.median(window))} | {_fmt(max(window))} |")
    entries = [r for r in results.get("ops") or [] if r["target"]]
    if entries:
        ratios = [r["ratio"] for r in entries]
        lines.append(f"| graph operations / minimal accumulator's (entry points) | "
                     f"{len(ratios)} | {_fmt(min(ratios))} | {_fmt(statistics.median(ratios))} "
                     f"| {_fmt(max(ratios))} |")
    table = bm.memory_table(results)
    plain = table.get("plain", {})
    if len(plain) > 1:
        ks = sorted(plain)
        growth = _fmt(plain[ks[-1]] / plain[ks[0]])
        lines.append(f"| peak memory, plain batch of K·b: K={ks[-1]} / K={ks[0]} | 1 | "
                     f"{growth} | {growth} | {growth} |")
    for method, peaks in table.items():
        if method != "plain" and len(peaks) > 1:
            flat = _fmt(max(peaks.values()) / min(peaks.values()), 3)
            lines.append(f"| peak memory, {bm.MEMORY_METHODS.get(method, method)}: max/min "
                         f"over K | 1 | {flat} | {flat} | {flat} |")
    return lines + [""] + _reader_explanation(results, window)


def _with_spe(text: str, results: dict[str, Any]) -> str:
    """``text`` with "the large steps_per_execution" said as the run's number."""
    spe = results["settings"].get("large_steps_per_execution")
    if spe is None:
        return text
    return (text.replace("at the large steps_per_execution", f"at steps_per_execution={spe}")
            .replace("large steps_per_execution", f"steps_per_execution={spe}"))


def _window_xla_by_cell(results: dict[str, Any]) -> dict[tuple[Any, ...], float]:
    """``window_step``'s throughput with XLA over without, keyed by (model, b, K), for every
    cell where both were timed."""
    by_cell: dict[tuple[Any, ...], dict[str, float]] = {}
    for r in results["throughput"]:
        if r.get("config") in ("window", "window_xla") and r.get("median"):
            cell = (r["model"], r["micro_batch"], r["accum_steps"])
            by_cell.setdefault(cell, {})[r["config"]] = r["median"]
    return {cell: c["window_xla"] / c["window"] for cell, c in by_cell.items()
            if "window" in c and "window_xla" in c}


def _window_xla_ratios(results: dict[str, Any]) -> list[float]:
    """``window_step``'s throughput with XLA over without, one per (model, b, K) cell where
    both were timed (:func:`_window_xla_by_cell`'s values)."""
    return list(_window_xla_by_cell(results).values())


def _reader_cell_ratios(results: dict[str, Any]) -> list[str]:
    """The two per-cell ratios the summary's sentences count cells of and the plot does not
    show: the bare passes split over unsplit, and ``window_step`` with XLA over without (a
    Markdown table, one row per (model, b, K) cell; empty when there is no cell)."""
    ratios = bm.throughput_ratios(results)
    if not ratios:
        return []
    window = _window_xla_by_cell(results)
    lines = ["Two more ratios of the summary for each cell: the bare passes split into K "
             "micro-batches over the same passes unsplit, and `window_step` with XLA over "
             "without (— where XLA was not timed).", "",
             "| model | b | K | split over unsplit | `window_step`: XLA over without |",
             "| --- | --- | --- | --- | --- |"]
    for r in ratios:
        cell = (r["model"], r["micro_batch"], r["accum_steps"])
        lines.append(f"| {cell[0]} | {cell[1]} | {cell[2]} | {_fmt(r.get('split_price'))} | "
                     f"{_fmt(window.get(cell))} |")
    return lines + [""]


def _window_xla_sentence(ratios: list[float]) -> str:
    """``window_step`` with XLA over without (:func:`_window_xla_ratios`), per cell where both
    were timed: the span and in how many cells XLA was the slower (a leading space; empty
    when none was timed)."""
    if not ratios:
        return ""
    slower = sum(q < 1 for q in ratios)
    return (f" `window_step` with XLA ran at {_span(ratios)} times its speed without, "
            f"below 1 in {slower} of the {len(ratios)} cells where both were timed.")


def _reader_explanation(results: dict[str, Any], window: list[float]) -> list[str]:
    """What each ratio of the summary means; ``window`` is :func:`_window_xla_ratios`."""
    ratios = bm.throughput_ratios(results)
    if not ratios:
        return []

    def span(key: str) -> str:
        return _span([r.get(key) for r in ratios])

    spreads = [50 * r["spread"] for r in results["throughput"] if r.get("spread") is not None]
    spe = results["settings"].get("large_steps_per_execution")
    return [
        "**What the ratios mean.** The throughput tables below give each configuration's "
        "spread over its repeats (± half their range, in % of the median): "
        f"±{_span(spreads, 0)} % in this run. A ratio of two figures is uncertain by about "
        "the sum of their spreads: ratios that differ by less are within the noise of this "
        "machine.",
        "",
        f"* *(4)/(3)*, `AccumModel.fit` over `fit` with Keras's `gradient_accumulation_steps`: "
        f"{span('fit_vs_keras')} at `steps_per_execution=1`, {span('fit_vs_keras_spe')} at "
        f"`steps_per_execution={spe}`. Both run one forward and backward pass per "
        "`train_step` and add the gradients into accumulators; accumcore also weighs each "
        "micro-batch, checks each window's gradients for NaN/Inf once and keeps a "
        "sample-weighted loss, and in return is "
        "exact for ragged windows, where Keras's mean of K micro-batch means is not (measured "
        "in chapter 6b's section 3). With "
        f"`jit_compile=True` `AccumModel.fit` ran at {span('fit_xla_vs_fit')} times its speed "
        "without." + _window_xla_sentence(window),
        f"* *Fastest compiled AccumTrainer path over the minimal accumulator (9) compiled the "
        "same way*: "
        f"{span('vs_minimal')}. The minimal accumulator is the least "
        "code that is still exact (the gradient of the summed loss added into accumulators, "
        "one `tf.cond` that divides once and applies), so this ratio is the price of "
        "accumcore's own bookkeeping, compiled the same way.",
        f"* *Fastest of (5)/(6) over the floor (8) compiled the same way* (whole-epoch for "
        f"whole-epoch, per window for `window_step`): {span('vs_floor')}. The floor runs the "
        "same K forward and backward passes without accumulators, checks or optimizer, so the "
        "gap is the whole cost of accumulating: O(weights) per micro-batch against O(b × "
        "weights) for the passes, heaviest on the MLP at b = 16 and lightest on the conv net.",
        f"* *Fastest accumcore path over plain `fit` at B (2)*: {span('vs_large_batch')}.",
        _split_sentence(results, ratios),
    ]


def _split_sentence(results: dict[str, Any], ratios: list[dict[str, Any]]) -> str:
    """What the bare passes split into K micro-batches ran at, per model, and the noisiest
    measurement behind the highest ratio."""
    per_model = []
    for model in dict.fromkeys(r["model"] for r in ratios):
        values = [r["split_price"] for r in ratios
                  if r["model"] == model and r.get("split_price") is not None]
        if values:
            side = ("below 1 in every cell" if max(values) < 1 else
                    "at or above 1 in every cell" if min(values) >= 1 else "on both sides of 1")
            per_model.append(f"{_span(values)} on the {model} ({side})")
    if not per_model:
        return ""
    text = ("* *The bare passes split into K micro-batches over the same passes unsplit* "
            "(floor (8) per window over one pass at B, no accumulation at all): "
            + "; ".join(per_model) + ".")
    best = max((r for r in ratios if r.get("split_price") is not None),
               key=lambda r: r["split_price"])
    unsplit = next((r for r in results["throughput"] if r["model"] == best["model"]
                    and r["micro_batch"] == best["micro_batch"]
                    and r["accum_steps"] == best["accum_steps"] and r["config"] == "floor_B"
                    and r.get("spread") is not None), None)
    if unsplit is not None and 50 * unsplit["spread"] >= max(
            50 * r["spread"] for r in results["throughput"] if r.get("spread") is not None):
        text += (f" The highest, {_fmt(best['split_price'])} ({best['model']}, b="
                 f"{best['micro_batch']}, K={best['accum_steps']}), rests on the run's noisiest "
                 f"figure, the unsplit passes' {_rate(unsplit['median'])} (±"
                 f"{50 * unsplit['spread']:.0f} %).")
    return text + (" Where splitting costs, a small batch gives each kernel less parallel "
                   "work and every micro-batch pays the fixed per-step costs; where B fits, "
                   "measure both on your device.")


def _reader_ratios_plot(plot_prefix: str) -> list[str]:
    """The per-cell ratios as a plot (RESULTS.md has them as a table)."""
    return ["#### Ratios per cell", "",
            "Three ratios of the summary above for each (model, b, K) cell: (4)/(3), the "
            "fastest of (5)/(6) over its floor (8) compiled the same way, and the fastest "
            "accumcore path over plain fit at B (2); the dashed line marks 1, as fast. Which "
            "configuration was the "
            "fastest in a cell is in the throughput table above.", "",
            f"![Each ratio of the summary for every (model, b, K) cell, against a dashed line "
            f"at 1]({plot_prefix}ratios.png)", ""]


def _reader_ops(results: dict[str, Any]) -> list[str]:
    recs = results.get("ops") or []
    if not recs:
        return ["(not measured)"]
    lines = [
        "The graph operations of each entry point's traced function (nested functions and "
        "both branches of every `tf.cond` included, before Grappler's optimisations), against "
        "the minimal accumulator traced the same way, Adam(1e-3): a count that does not "
        "depend on the machine's load.", "",
        "| model | entry point | ops | minimal accumulator's | ratio |",
        "|---|---|---|---|---|"]
    for r in recs:
        lines.append(f"| {r['model']} | {_code_entry(r['entry'])} | {r['ops']} | "
                     f"{r['minimal_ops']} | {r['ratio']:.2f} |")
    ours = [r["ratio"] for r in recs if r["target"]]
    keras_ga = [r["ratio"] for r in recs if not r["target"] and "gradient_accumulation" in
                r["entry"]]
    if ours:
        sentence = (f"accumcore's traced functions hold {_span(ours)} times the minimal "
                    "accumulator's operations (the extra ones weigh each micro-batch, count "
                    "its samples, check each window for NaN/Inf and hold the path a "
                    "non-finite window takes; both branches of every `tf.cond` are counted, "
                    "whichever runs)")
        if keras_ga:
            sentence += f", Keras's own accumulating `train_step` {_span(keras_ga)} times"
        lines += ["", sentence + "."]
    return lines


def _breakdown_noise_sentence(rows: list[dict[str, Any]]) -> str:
    """What the *added ms* column means, with the spread of this run's own timings (± half
    their range over the repeats, in % of the median), which no column of the table prints."""
    spreads = [50 * r["spread"] for r in rows if r.get("spread") is not None]
    repeats = sorted({len(r["seconds"]) for r in rows if r.get("seconds")})
    if not spreads:
        return ("The *added ms* column is what each ingredient costs per micro-batch; the "
                "table prints no spread, so a step smaller than the timings' noise, a negative "
                "one included, says nothing.")
    said = f"medians of {repeats[0]} repeats" if len(repeats) == 1 else "medians of repeats"
    return ("The *added ms* column is what each ingredient costs per micro-batch. Its times "
            f"are {said} that spread by ±{_span(spreads, 0)} % in this run (the ± column: half "
            "their range, in % of the median): a step smaller than that, a negative one "
            "included, is within the noise of this run.")


def _separate_run(created: str | None) -> str:
    """How a section measured apart from the throughput run names its run."""
    return f"measured in a separate run ({created})" if created else "measured in a separate run"


def _interval(p: dict[str, float]) -> str:
    """A paired median with its interval, as the table prints it."""
    return f"{p['median']:.3f} [{p['low']:.3f}, {p['high']:.3f}]"


def _compare_columns(record: dict[str, Any], first: str, second: str,
                     said: str) -> list[tuple[str, str, str]]:
    """Per steps_per_execution (in the record's order) where both columns ran: the setting,
    its medians as ``said`` formats them (keys ``spe``, ``a``, ``b``: the two intervals), and
    whether the paired intervals of ``first`` and ``second`` ``"overlap"``, lie ``"apart"``
    (``first`` wholly below) or apart the other way (``"opposite"``)."""
    rows = []
    for spe, kinds in record["by_spe"].items():
        if first not in kinds or second not in kinds:
            continue
        a, b = kinds[first]["paired"], kinds[second]["paired"]
        kind = ("apart" if a["high"] < b["low"] else "opposite" if b["high"] < a["low"]
                else "overlap")
        rows.append((str(spe), said.format(spe=spe, a=_interval(a), b=_interval(b)), kind))
    return rows


def _settings(items: list[str]) -> str:
    """'at steps_per_execution X' for one setting, 'at steps_per_execution X and Y' for more."""
    return "at steps_per_execution " + " and ".join(items)


def _paired_verdicts(rows: list[tuple[str, str, str]], intro: str,
                     words: dict[str, str]) -> list[str]:
    """``intro`` followed by the medians of every setting of ``rows`` (from
    :func:`_compare_columns`), then one sentence per kind of result (in ``words``' order)
    naming the settings that had it."""
    if not rows:
        return []
    return [intro + "; ".join(text for _, text, _ in rows) + "."] + [
        _settings([spe for spe, _, k in rows if k == kind]).capitalize() + " " + verdict
        for kind, verdict in words.items() if any(k == kind for _, _, k in rows)]


def _check_cost_sentence(record: dict[str, Any]) -> str:
    """What the paired columns say about the NaN/Inf checks, per steps_per_execution: first
    the once-per-window check (the first two columns), then checking every micro-batch (the
    last column against the first), each as the medians with their intervals, then one
    verdict per kind of setting: a cost where the intervals are apart, the noise where they
    overlap (whichever median is lower), no cost where they are apart the other way."""
    window = _compare_columns(record, "accumcore", "accumcore_unchecked",
                              "{spe}: {a} with the check, {b} without")
    micro = _compare_columns(record, "accumcore_skip_micro_batch", "accumcore",
                             "{spe}: {a} checking every micro-batch, {b} once per window")
    sentences = _paired_verdicts(window, "The first two paired columns compare the "
                                 "once-per-window check with none, at steps_per_execution ", {
        "overlap": "the two intervals overlap: the check's cost is within the noise of this "
                   "run, and the difference of the medians says nothing about it.",
        "apart": "the intervals are apart: the difference is what the once-per-window check "
                 "costs.",
        "opposite": "the intervals are apart the other way: the run without the check was "
                    "the slower one, so these runs show no cost of the check there."})
    sentences += _paired_verdicts(micro, "The last paired column checks every micro-batch, "
                                  "against the first, at steps_per_execution ", {
        "apart": "the intervals are apart: checking every micro-batch cost measurably more "
                 "than checking each window once.",
        "overlap": "they overlap: the difference is within the noise of this run.",
        "opposite": "the intervals are apart the other way: these runs show no extra cost of "
                    "checking every micro-batch there."})
    return " ".join(sentences)


def _reader_nonfinite_cost(record: dict[str, Any] | None) -> list[str]:
    if not record:
        return []
    return [f"`AccumModel.fit` over `fit` with Keras's accumulation, as shipped and traced "
            f"without its NaN/Inf check (which Keras does not have), "
            f"{_separate_run(record.get('created'))}: {record['rounds']} rounds "
            f"(MLP, b={record['micro_batch']}, K={record['accum_steps']}, "
            f"{_nonfinite_cost_samples(record):,} synthetic samples per epoch). Every round fits "
            "one epoch with each model back to back; the table gives the median "
            "of the per-round ratios with its 95 % bootstrap interval, and the ratio of the "
            f"fastest of each model's {record['rounds']} runs (best of {record['rounds']}). "
            "The last column checks every micro-batch "
            "(`nonfinite=\"skip_micro_batch\"`).", ""] + _paired_cost_table(record) + [
            "", _check_cost_sentence(record), ""]


def _interval_sentence(p: dict[str, float]) -> str:
    """What a paired interval decides, in a reader's words."""
    if p["low"] <= 1 <= p["high"]:
        lopsided = (p["high"] - p["median"]) > 3 * (p["median"] - p["low"])
        return ("The interval holds 1: this run does not tell the two apart"
                + (", and it reaches much further above the median than below it, a sign that "
                   "the rounds varied a lot" if lopsided else "") + ".")
    return ("The whole interval lies below 1: `accumulate` was slower in this run."
            if p["high"] < 1 else "The whole interval lies above 1: `accumulate` was faster "
            "in this run.")


def _reader_accumulate_lm(record: dict[str, Any] | None) -> list[str]:
    if not record:
        return []
    c, p = record["config"], record["throughput_ratio_paired"]
    return [f"`accumcore.accumulate` on a KerasHub `GPT2CausalLM` ({c['layers']} layers, "
            f"{c['hidden']} wide, {c['sequences']} sequences of {c['length']} tokens, b="
            f"{c['micro_batch']}, K={c['accum_steps']}, Adam with an `ExponentialDecay` "
            f"schedule; Keras {c['keras']}, KerasHub {c['keras_hub']}), against the same "
            f"model with Keras's `gradient_accumulation_steps`, {c['rounds']} rounds, "
            f"{_separate_run(record.get('created'))}. Each round fits one epoch with each, "
            "in alternating order.", "",
            "| throughput, accumulate / Keras | paired median [95 % interval] | best of "
            f"{c['rounds']} |",
            "|---|---|---|",
            f"| fit | {bm.ratio_text(p)} | "
            f"{record['throughput_ratio_best_of_n']:.3f} |", "", _interval_sentence(p), ""]


def _reader_memory(results: dict[str, Any], plot_prefix: str) -> list[str]:
    table = bm.memory_table(results)
    if not table:
        return ["(not measured)"]
    ks = sorted({k for peaks in table.values() for k in peaks})
    weights = next((r["weights_bytes"] for r in results["memory"] if r.get("weights_bytes")),
                   None)
    b, filters = results["memory"][0]["micro_batch"], results["memory"][0].get("filters")
    other = results.get("settings", {}).get("conv_filters")
    model = (f" of the convolutional network with filters {tuple(filters)}"
             + (f", not the throughput tables' {tuple(other)}"
                if other and list(other) != list(filters) else "") if filters else "")
    lines = [f"Peak allocator memory in MiB (`get_memory_info('{results['device']}')['peak']`)"
             f"{model}; micro-batch b={b}; plain trains one batch of K·b."
             + (" The last row is the accumulators' size: one copy of the trainable weights."
                if weights else ""), "",
             "| method | " + " | ".join(f"K={k}" for k in ks) + " |",
             "|---|" + "---|" * len(ks)]
    for method, peaks in table.items():
        lines.append(f"| {bm.MEMORY_METHODS.get(method, method)} | "
                     + " | ".join(_mib(peaks.get(k)) for k in ks) + " |")
    if weights:
        lines.append(f"| {WEIGHTS_ROW} | " + " | ".join(_mib(weights) for _ in ks) + " |")
    for r in results["memory"]:
        if r.get("error"):
            lines.append(f"\n- {r['method']} K={r['accum_steps']} failed: {r['error']}")
    lines += ["", f"![Peak memory in MiB against K, for plain training at B = K·b and each way "
              f"to accumulate]({plot_prefix}memory.png)", ""]
    plain = table.get("plain", {})
    flat = [max(p.values()) / min(p.values()) for m, p in table.items()
            if m != "plain" and len(p) > 1]
    note = _READER_MEMORY_NOTE
    if len(plain) > 1 and flat:
        lo, hi = min(plain), max(plain)
        lines += [f"Plain training at B = K·b grew {plain[hi] / plain[lo]:.1f} times from K={lo} "
                  f"to K={hi}; accumulating K micro-batches of b stayed within "
                  f"{100 * (max(flat) - 1):.1f} % of its lowest peak at every K. That is the "
                  "design, not a cause this run measures: only one micro-batch's activations "
                  "are live at a time, and the accumulators (one copy of the weights, the last "
                  "row) are allocated once. " + note, ""]
    else:
        lines += [note, ""]
    return lines + _same_peaks(table, ks)


def _same_peaks(table: dict[str, dict[int, int]], ks: list[int]) -> list[str]:
    """A sentence naming the methods whose peaks the table prints equal at every K: their
    lines coincide in the figure (one hides the other)."""
    by_peaks: dict[tuple[str, ...], list[str]] = {}
    for method, peaks in table.items():
        if all(peaks.get(k) is None for k in ks):
            continue  # not measured: no line in the figure
        by_peaks.setdefault(tuple(_mib(peaks.get(k)) for k in ks), []).append(
            bm.MEMORY_METHODS.get(method, method))
    same = [names for names in by_peaks.values() if len(names) > 1]
    return [f"In the figure, the lines of {' and '.join(f'*{n}*' for n in names)} coincide "
            "(one hides the other): the table gives them the same peak at every K."
            for names in same] + ([""] if same else [])


_ENTRY_CODE = re.compile(r"^(\w+(?:\.\w+)+(?:\([^)]*\))?)(.*)$")


def _code_entry(entry: str) -> str:
    """An entry point's name with its leading code as Markdown code (``AccumTrainer.fit(mode=
    'function')`` keeps straight quotes in the book), the words after it as they are."""
    match = _ENTRY_CODE.match(entry)
    return f"`{match.group(1)}`{match.group(2)}" if match else entry


def _reader_tracing(results: dict[str, Any]) -> list[str]:
    if not results["tracing"]:
        return ["(not measured)"]
    first = results["tracing"][0]
    lines = [f"MLP, {first['samples']} samples, micro-batch {first['micro_batch']}, "
             f"K={first['accum_steps']} (the last micro-batch and the last window are ragged), "
             "3 epochs.", "",
             "| compiled function | traces per epoch | total |", "|---|---|---|"]
    for r in results["tracing"]:
        lines.append(f"| {_code_entry(r['entry'])} | {r['per_epoch']} | {r['total']} |")
    later = sum(sum(r["per_epoch"][1:]) for r in results["tracing"])
    lines += ["", "Every function was traced in the first epoch only, so the ragged last "
              "micro-batch and window cost no retracing; `window_step` traces once per window "
              "shape (full and ragged)." if later == 0 else
              f"{later} traces came after the first epoch: a function was retraced."]
    return lines


#: The peak-memory table's last row on the reader's page: the size the accumulators add.
WEIGHTS_ROW = "one copy of the trainable weights (not a peak)"


def _reader_probe(results: dict[str, Any]) -> list[str]:
    """:func:`_probe_section` for a reader: the search's inputs (B, the first size probed,
    ``multiple_of``) said, and the plan's K and b derived from B and the largest fitting b."""
    p = results.get("probe")
    if not p:
        return ["Not run in this mode."]
    if p.get("error"):
        return _probe_section(results, limit_setting="")
    settings = results.get("settings", {})
    start, step = settings.get("probe_start"), settings.get("probe_multiple_of")
    inputs = (f", for updates of B={p['target_batch_size']}, probing multiples of {step} "
              f"from {start}" if start and step else f", for updates of B={p['target_batch_size']}")
    big, best, k, b = (p["target_batch_size"], p["max_micro_batch"], p["accum_steps"],
                       p["micro_batch_size"])
    plan = (f"the fewest micro-batches whose size divides B and is at most {best}: K={k} of "
            f"b = {big} / {k} = {b} samples" if k * b == big else
            f"K={k} micro-batches of {b} ({k * b} samples per update)")
    return _probe_section(results, inputs, f"Largest micro-batch that fits: **{best}**. "
                          f"For B={big} the plan takes {plan}.", limit_setting="")


def _reader_throughput_tables(results: dict[str, Any]) -> list[str]:
    """:func:`_throughput_tables` without plots, each model's skipped configurations said
    for a reader (the suite's own reasons, with its internal names, stay in RESULTS.md)."""
    lines = []
    for line in _throughput_tables(results, None):
        if not line.startswith("- skipped "):
            lines.append(_with_spe(line, results))
        elif "_xla" in line:
            lines.append("- Not timed on a CPU: this model's configurations compiled with XLA "
                         "(`jit_compile=True`); XLA is timed for the MLP only, and how XLA "
                         "does on this convolutional network is not measured here.")
        else:
            lines.append("- Some configurations of this model were not timed in this run.")
    return lines


def _folded(title: str, lines: list[str]) -> list[str]:
    """``lines`` in a dropdown box of the book (MyST), closed until the reader opens it; a
    heading among them becomes a bold line (MyST allows no heading inside a directive)."""
    body = [f"**{line[5:]}**" if line.startswith("#### ") else line for line in lines]
    return [f"````{{admonition}} {title}", ":class: dropdown", "", *body, "````", ""]


def _fold_tables(lines: list[str], title: str) -> list[str]:
    """``lines`` with their Markdown table (the rows starting with ``|``) folded."""
    rows = [line for line in lines if line.startswith("|")]
    if not rows:
        return lines
    first = lines.index(rows[0])
    return lines[:first] + _folded(title, rows) + lines[first + len(rows):]


def _part_run(results: dict[str, Any], part: str) -> list[str]:
    """A line naming the run of ``part`` when it was measured apart from the run the machine
    table dates (``run.py --merge`` records each part's date in ``part_created``)."""
    created = (results.get("part_created") or {}).get(part)
    if not results.get(part) or not created or created == results.get("created"):
        return []
    return [f"This section was {_separate_run(created)}, on the same machine.", ""]


#: Rows of the machine table that describe the run, not the machine (RESULTS.md keeps them).
_READER_MACHINE_SKIP = ("| platform |", "| load average")


def render_reader_page(result_dirs: Sequence[str], md_dir: str) -> str:
    """The reader's page for ``result_dirs``: what the book's Reference shows.

    The same measurements as :func:`render`, with what each table means and without the
    targets, their verdicts, the unit tests' time or the code's size (RESULTS.md has those;
    :data:`READER_FORBIDDEN`). Image links are relative to ``md_dir``.
    """
    lines = ["# Results", "",
             "<!-- Generated by run.py (or `run.py --report`) from results/*/results.json for "
             "the book's benchmark page; the maintainers' report is RESULTS.md. Do not edit "
             "by hand. -->", ""]
    for d in result_dirs:
        results = _load_run(d)
        prefix = _image_prefix(d, md_dir)
        lines += [f"## {_run_heading(results)}", "", "### Machine", ""]
        spe = (f"steps_per_execution={results['settings'].get('steps_per_execution')}",
               f"steps_per_execution={results['settings'].get('steps_per_execution')} ("
               f"{results['settings'].get('large_steps_per_execution')} in the rows that say so)")
        lines += [line.replace(*spe) if line.startswith("| throughput settings") else line
                  for line in _machine_section(results)
                  if not line.startswith(_READER_MACHINE_SKIP)] + [""]
        lines += [f"The tables below come from the run of {results['created']}, except where a "
                  "section names another run.", ""]
        if results["throughput"]:
            lines += ["### Summary", ""] + _reader_summary(results) + [""]
            lines += ["### Throughput (samples/s)", "",
                      "Median of the interleaved repeats (± half the range over the repeats, in "
                      "% of the median); the summary above gives their ratios.", ""]
            lines += _folded("Every configuration's throughput, per model and cell",
                             _reader_throughput_tables(results))
            lines += _reader_ratios_plot(prefix) + _reader_cell_ratios(results)
        lines += ["### Graph operations", ""] + _fold_tables(
            _reader_ops(results), "The operations of each entry point measured") + [""]
        lines += ["### Where the time goes", ""] + _part_run(results, "breakdown") + _fold_tables(
            _breakdown_section(results, spread=True), "Every ingredient's time, per model")
        if results.get("breakdown"):
            lines += ["", _breakdown_noise_sentence(results["breakdown"])]
        lines += [""]
        if results.get("nonfinite_cost"):
            lines += ["### What the NaN/Inf check costs", ""]
            lines += _reader_nonfinite_cost(results["nonfinite_cost"])
        if results.get("accumulate_lm"):
            lines += ["### A pretrained model's fit: `accumulate` against Keras's accumulation",
                      ""] + _reader_accumulate_lm(results["accumulate_lm"])
        lines += ["### Peak memory", ""] + _reader_memory(results, prefix)
        lines += ["### Tracing", ""] + _reader_tracing(results) + [""]
        lines += ["### Largest micro-batch probe", ""] + _reader_probe(results) + [""]
    return "\n".join(lines).rstrip() + "\n"


#: A count of targets met ("5 of 8 cells", "22 of 51 checks").
_MET_COUNT = re.compile(r"\b\d+ of \d+ (?:checks|cells)\b", re.IGNORECASE)


def reader_page_problems(text: str) -> list[str]:
    """The words of :data:`READER_FORBIDDEN` that ``text`` contains (case-insensitive), and
    any count of targets met."""
    lower = text.lower()
    problems = [f"the reader's page contains {word!r}" for word in READER_FORBIDDEN
                if word.lower() in lower]
    return problems + [f"the reader's page contains {m.group(0)!r}"
                       for m in _MET_COUNT.finditer(text)]


def write_reader_page(result_dirs: Sequence[str], md_path: str = READER_PAGE) -> str:
    """Write :func:`render_reader_page` (plots: :func:`write_report`); return its path."""
    result_dirs = [d for d in result_dirs if os.path.isfile(os.path.join(d, "results.json"))]
    if not result_dirs:
        raise FileNotFoundError("No results.json found: run `python benchmarks/run.py` first.")
    text = render_reader_page(result_dirs, os.path.dirname(os.path.abspath(md_path)))
    problems = reader_page_problems(text)
    if problems:
        raise ValueError("; ".join(problems))
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(text)
    return md_path


def write_report(result_dirs: Sequence[str], md_path: str, *, plots: bool = True) -> str:
    """Render the plots (into each result dir) and the Markdown report; return its path."""
    result_dirs = [d for d in result_dirs if os.path.isfile(os.path.join(d, "results.json"))]
    if not result_dirs:
        raise FileNotFoundError("No results.json found: run `python benchmarks/run.py` first.")
    if plots:
        for d in result_dirs:
            write_plots(bm.load_results(os.path.join(d, "results.json")), d)
    text = render(result_dirs, os.path.dirname(os.path.abspath(md_path)))
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(text)
    return md_path


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_REQUIRED_HEADINGS = ("### Machine", "### Summary", "### Targets", "### Throughput",
                      "### Graph operations",
                      "### Where the time goes",
                      "### Peak memory", "### Tracing")


def validate_outputs(out_dir: str, *, allow_errors: bool = False) -> list[str]:
    """Problems with the outputs of one run in ``out_dir`` (an empty list: well-formed).

    Checks that ``results.json`` loads with the current schema and holds positive throughput
    medians, memory peaks and trace counts for what the settings asked for; that
    ``RESULTS.md`` has every section and links only to images that exist; and that every
    PNG is a real, non-trivial PNG image. Never checks a speed.
    """
    problems: list[str] = []
    path = os.path.join(out_dir, "results.json")
    try:
        results = bm.load_results(path)
    except (OSError, ValueError) as err:
        return [f"results.json: {err}"]
    s = results["settings"]
    expected_cells = {(m, b, k) for m in s["models"] for b in s["micro_batches"]
                      for k in s["accum_steps"]}
    if results["throughput"]:
        got_cells = set(bm.throughput_cells(results))
        if got_cells != expected_cells:
            problems.append(f"throughput cells {sorted(got_cells)} != settings "
                            f"{sorted(expected_cells)}")
        for rec in results["throughput"]:
            where = f"throughput {rec['model']} b={rec['micro_batch']} {rec['config']}"
            if rec.get("error"):
                if not allow_errors:
                    problems.append(f"{where} failed: {rec['error']}")
                continue
            if rec.get("skipped"):
                continue
            rates = rec.get("samples_per_s") or []
            if len(rates) != s["repeats"] or not all(r > 0 and r == r for r in rates):
                problems.append(f"{where}: expected {s['repeats']} positive rates, got {rates}")
            if not (rec.get("median") or 0) > 0:
                problems.append(f"{where}: no positive median")
    for rec in results["memory"]:
        if rec.get("error"):
            if not allow_errors:
                problems.append(f"memory {rec['method']} K={rec['accum_steps']}: {rec['error']}")
        elif not (rec.get("peak_bytes") or 0) > 0:
            problems.append(f"memory {rec['method']} K={rec['accum_steps']}: no positive peak")
    for rec in results.get("breakdown") or []:
        if not rec.get("error") and not (rec.get("median") or 0) > 0:
            problems.append(f"breakdown {rec['model']} {rec['variant']}: no positive median")
        elif rec.get("error") and not allow_errors:
            problems.append(f"breakdown {rec['model']} {rec['variant']} failed: {rec['error']}")
    if results.get("ops") and s.get("ops_models"):
        got = {r["model"] for r in results.get("ops") or []}
        if got != set(s["ops_models"]):
            problems.append(f"ops counted for models {sorted(got)}, settings ask for "
                            f"{sorted(s['ops_models'])}")
        for rec in results.get("ops") or []:
            if not (rec.get("ops", 0) > 0 and rec.get("minimal_ops", 0) > 0):
                problems.append(f"ops {rec['model']} {rec['entry']}: no positive count")
    tests = results.get("unit_tests")
    if tests is not None:
        if tests.get("error"):
            problems.append(f"unit_tests: {tests['error']}")
        elif not (tests.get("seconds", 0) > 0 and tests.get("passed", 0) > 0):
            problems.append(f"unit_tests: no positive duration and pass count in {tests}")
        elif (tests.get("failed") or tests.get("errors")) and not allow_errors:
            problems.append(f"unit_tests: {tests['failed']} failed, {tests['errors']} errors")
    for rec in results["tracing"]:
        if not (isinstance(rec.get("total"), int) and len(rec.get("per_epoch", [])) == 3):
            problems.append(f"tracing {rec.get('entry')}: malformed {rec}")
    if not isinstance(results.get("targets"), list) or not results["targets"]:
        problems.append("results.json has no target checks")
    md = os.path.join(out_dir, "RESULTS.md")
    try:
        with open(md, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        problems.append(f"RESULTS.md: {err}")
        text = ""
    for heading in _REQUIRED_HEADINGS:
        if text and heading not in text:
            problems.append(f"RESULTS.md lacks the section {heading!r}")
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        if not os.path.isfile(os.path.join(out_dir, link)):
            problems.append(f"RESULTS.md links to a missing image {link}")
    pngs = [n for n in os.listdir(out_dir) if n.endswith(".png")]
    if not pngs and (results["throughput"] or results["memory"]):
        problems.append("no PNG plots written")
    for name in pngs:
        with open(os.path.join(out_dir, name), "rb") as f:
            head = f.read(24)
        size = os.path.getsize(os.path.join(out_dir, name))
        if not head.startswith(_PNG_SIGNATURE) or size < 2000:
            problems.append(f"{name} is not a real PNG plot ({size} bytes)")
        else:
            width = int.from_bytes(head[16:20], "big")
            height = int.from_bytes(head[20:24], "big")
            if width < 200 or height < 200:
                problems.append(f"{name} is only {width}x{height} pixels")
    return problems


def default_result_dirs() -> list[str]:
    """``benchmarks/results/cpu`` then ``gpu`` (then any other), those that exist."""
    if not os.path.isdir(RESULTS_DIR):
        return []
    names = sorted(os.listdir(RESULTS_DIR), key=lambda n: (n != "cpu", n != "gpu", n))
    return [os.path.join(RESULTS_DIR, n) for n in names
            if os.path.isfile(os.path.join(RESULTS_DIR, n, "results.json"))]
