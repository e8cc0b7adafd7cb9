"""scripts/check_prose_numbers.py: a number in a notebook's prose must be shown on its page, and
a comparison word about a measurement must be computed (glued), not written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "check_prose_numbers", Path(__file__).resolve().parents[1] / "scripts" /
    "check_prose_numbers.py")
checker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checker)
BOOK = Path(__file__).resolve().parents[1] / "book"


def _page(markdown: str, output: str = "", code: str = "", tags: tuple = ()) -> dict:
    cell = {"cell_type": "code", "source": code, "metadata": {"tags": list(tags)},
            "outputs": [{"output_type": "stream", "text": output}]}
    return {"cells": [cell, {"cell_type": "markdown", "source": markdown, "metadata": {}}]}


def test_a_number_an_output_prints_passes():
    assert checker.unshown_numbers(_page("the gap is 0.25 here", "gap 0.25\n"), {}) == []


def test_a_number_no_output_shows_fails():
    assert checker.unshown_numbers(_page("the gap is 0.45 here", "gap 0.25\n"), {}) == ["0.45"]


def test_percentages_and_exponents_are_numbers_too():
    page = _page("it saved 45 % and 1e-6 of it", "nothing")
    assert checker.unshown_numbers(page, {}) == ["45", "1e-6"]


def test_a_count_no_output_shows_fails_and_a_printed_one_passes():
    """Round 1's "168 samples" and appendix A's "5,120 images": counts written, not printed."""
    page = _page("168 samples make 11 micro-batches; 5,120 images", "11 micro-batches\n")
    assert checker.unshown_numbers(page, {}) == ["168", "5,120"]
    printed = _page("168 samples make 11 micro-batches; 5,120 images",
                    "168 samples -> 11 micro-batches; 5120 images\n")
    assert checker.unshown_numbers(printed, {}) == []


def test_a_count_with_spaces_as_thousands_separators_is_one_count():
    page = _page("24 576 training samples, 10 000 held out", "24576 samples\n")
    assert checker.unshown_numbers(page, {}) == ["10 000"]


def test_a_number_written_in_math_needs_an_output_too():
    """Chapter 1's $1.2 \\times 10^{-7}$ and chapter 6's $2^{15}$, written and not printed."""
    page = _page("precision ($1.2 \\times 10^{-7}$), the scale $2^{15}$", "nothing\n")
    assert checker.unshown_numbers(page, {}) == ["1.2 \\times 10^{-7}", "2^{15}"]
    printed = _page("precision ($1.2 \\times 10^{-7}$), the scale $2^{15}$",
                    "eps 1.19e-07, scale 32768\n")
    assert checker.unshown_numbers(printed, {}) == []


def test_years_versions_issues_and_small_integers_are_not_counts():
    page = _page("Goyal et al., 2017; keras#20585; a batch of 64; 784-256-10", "")
    assert checker.unshown_numbers(page, {}) == ["784"]


def test_code_math_glue_and_links_are_not_prose():
    page = _page("`lr=0.25`, $0.5 x$, {glue:text}`gap:.2f`, [a](https://x.org/1.5) and "
                 "{doc}`v0.3`", "nothing")
    assert checker.unshown_numbers(page, {}) == []


def test_a_constant_set_in_a_visible_code_cell_is_shown_a_hidden_one_is_not():
    assert checker.unshown_numbers(_page("decay 0.8", code="rate = 0.8"), {}) == []
    hidden = _page("decay 0.8", code="rate = 0.8", tags=("remove-cell",))
    assert checker.unshown_numbers(hidden, {}) == ["0.8"]


def test_rounding_as_python_formats_counts_as_shown():
    assert checker.unshown_numbers(_page("about 0.50", "ratio 0.5\n"), {}) == []


def test_an_exercise_answer_is_prose_and_the_allow_list_admits_definitions():
    page = _page("```{admonition} Answer\n:class: dropdown\nslope 0.25\n```", "x")
    assert checker.unshown_numbers(page, {}) == ["0.25"]
    assert checker.unshown_numbers(page, {"0.25": "worked arithmetic"}) == []


def test_main_fails_with_one_line_per_number(tmp_path, capsys):
    (tmp_path / "page.ipynb").write_text(json.dumps(_page("a 0.45 b", "0.25")))
    assert checker.main([str(tmp_path)]) == 1
    assert "page: '0.45' in the prose, shown by no output" in capsys.readouterr().out
    (tmp_path / "page.ipynb").write_text(json.dumps(_page("a 0.25 b", "0.25")))
    assert checker.main([str(tmp_path)]) == 0


# ------------------------------------------------------------------ comparison words


def test_an_uncomputed_comparison_word_fails_with_its_sentence():
    page = _page("The data are MNIST. accumcore's fit is faster than Keras's, here.\n\n"
                 "* Adam and SGD tie.")
    assert checker.uncomputed_comparisons(page, {}) == [
        "'faster' in: accumcore's fit is faster than Keras's, here.",
        "'tie' in: * Adam and SGD tie.",
    ]


def test_a_glued_comparison_word_passes():
    page = _page("{glue:text}`fit_takeaway`: the fit ran at {glue:text}`ratio:.2f` x.",
                 code="glue('fit_takeaway', 'faster' if ratio > 1 else 'slower')",
                 tags=("remove-cell",))
    assert checker.uncomputed_comparisons(page, {}) == []


def test_words_in_code_math_roles_and_link_targets_are_not_prose():
    page = _page("`better_lr`, $a$ $\\text{faster}$, {doc}`the tie <tie>` and [x](grew.md): "
                 "nothing is compared; the threshold is the tie threshold.")
    assert checker.uncomputed_comparisons(page, {}) == []


def test_comparisons_in_an_exercise_answer_and_a_table_are_found():
    page = _page("```{admonition} Answer\n:class: dropdown\nThe loss fell.\n```\n\n"
                 "| a | b |\n|---|---|\n| one batch | costs far more |")
    assert checker.uncomputed_comparisons(page, {}) == [
        "'fell' in: The loss fell.", "'costs far more' in: | one batch | costs far more |"]


def test_the_allow_list_admits_a_definition_and_fails_when_stale():
    page = _page("Two accuracies closer than the threshold are a tie.")
    assert checker.uncomputed_comparisons(page, {"are a tie": "defines the noise rule"}) == []
    assert checker.uncomputed_comparisons(page, {"are a tie": "defines the noise rule",
                                                 "gone sentence": "a definition"}) == [
        "allowed comparison matches no sentence: 'gone sentence'"]


def test_an_asserted_allowance_needs_its_assertion_on_the_page():
    allowed = {"weights match": "asserted: `assert rel <= 1e-4`"}
    asserted = _page("The weights match to round-off.", code="assert rel <= 1e-4")
    assert checker.uncomputed_comparisons(asserted, allowed) == []
    unasserted = _page("The weights match to round-off.", code="print(rel)")
    assert checker.uncomputed_comparisons(unasserted, allowed) == [
        "allowed comparison 'weights match': no code cell holds 'assert rel <= 1e-4'"]


def test_main_fails_on_an_uncomputed_comparison(tmp_path, capsys):
    (tmp_path / "page.ipynb").write_text(json.dumps(_page("Batch 16 did better.", "x")))
    assert checker.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "page: 'better' in: Batch 16 did better." in out and "1 uncomputed comparisons" in out
    glued = _glued_page("Batch 16 {glue:text}`verdict`.", "x", {"verdict": "did as well"})
    (tmp_path / "page.ipynb").write_text(json.dumps(glued))
    assert checker.main([str(tmp_path)]) == 0


def test_every_page_of_the_book_computes_its_comparison_words():
    # The words live in the markdown, so the sources show them without a build.
    notebooks = sorted(BOOK.glob("*.ipynb"))
    assert len(notebooks) >= 8
    problems = [f"{path.stem}: {problem}" for path in notebooks
                for problem in checker.uncomputed_comparisons(
                    json.loads(path.read_text(encoding="utf-8")),
                    checker.ALLOWED_COMPARISONS.get(path.stem, {}))]
    assert not problems, "\n".join(problems)
    assert set(checker.ALLOWED_COMPARISONS) <= {path.stem for path in notebooks}


# ---------------------------------------------------------------------------- known contradictions
def test_a_known_contradiction_fails_written_or_glued():
    written = _page("## Speed\n\nEvery bar is below 1. A small batch ...")
    assert len(checker.known_contradictions("07_memory_speed", written)) == 1
    glued = {"cells": [{"cell_type": "code", "source": "", "metadata": {}, "outputs": [{
        "output_type": "display_data", "metadata": {"scrapbook": {"name": "mixed_words"}},
        "data": {"application/papermill.record/text/plain":
                 "'saved little or no memory (25 % more)'"}}]}]}
    assert len(checker.known_contradictions("guide_alternatives", glued)) == 1
    # a page-wide entry fires on any page; the same words pass on a page they do not concern
    assert checker.known_contradictions("04_x", _page("Tested in `tests/test_a.py`."))
    assert checker.known_contradictions("04_x", _page("Every bar is below 1.")) == []


def test_the_rewritten_sentences_pass():
    rewritten = _page("{glue:text}`bars_verdict`. A small batch", "15 of the 16 bars are "
                      "below 1; the other one is above 1 by less than the repeats' spread")
    assert checker.known_contradictions("07_memory_speed", rewritten) == []
    assert checker.known_contradictions("05_lr_sweeps", _page("exponent 0.32, 0.20 to 0.45 "
                                                              "over the ties")) == []
    assert checker.known_contradictions("05_lr_sweeps", _page("exponent 0.32 (0.32 to 0.32 "
                                                              "over the ties)")) != []


def test_main_fails_on_a_known_contradiction(tmp_path, capsys):
    page = _page("It saved 45 % of memory.", "45 %")
    (tmp_path / "guide_resume.ipynb").write_text(json.dumps(_page(
        "The run crashed in epoch 1 (counting from 0).")))
    (tmp_path / "04_x.ipynb").write_text(json.dumps(page))
    assert checker.main([str(tmp_path)]) == 1
    assert "guide_resume: known contradiction returned: 'counting from 0'" in \
        capsys.readouterr().out


def test_no_page_of_the_book_holds_a_known_contradiction():
    """The sources (markdown only: outputs exist after a build, where the build checks them)."""
    notebooks = sorted(BOOK.glob("*.ipynb"))
    problems = [f"{path.stem}: {problem}" for path in notebooks
                for problem in checker.known_contradictions(
                    path.stem, json.loads(path.read_text(encoding="utf-8")), outputs=False)]
    assert not problems, "\n".join(problems)
    # every page named in the list exists (a renamed page would silently escape it)
    assert {p.stem for p in notebooks} >= set(checker.KNOWN_CONTRADICTIONS) - {"*"}


# ---------------------------------------------------------------------------- measured comparisons
def test_a_comparison_about_a_glued_measurement_needs_a_computed_verdict():
    written = _page("It peaked at {glue:text}`peak:.1f` MiB and saved memory.")
    assert checker.uncomputed_comparisons(written, {}) == [
        "'saved' in: It peaked at {glue:text}`peak:.1f` MiB and saved memory."]
    below = _page("Every ratio, at most {glue:text}`worst:.2f`, is below 1.")
    assert len(checker.uncomputed_comparisons(below, {})) == 1
    exactly = _page("The loop made exactly {glue:text}`n` updates.")
    assert len(checker.uncomputed_comparisons(exactly, {})) == 1
    # the verdict glued from the numbers passes, and so does an allowed (asserted) sentence
    verdict = _page("It peaked at {glue:text}`peak:.1f` MiB: it {glue:text}`mixed_words`.")
    assert checker.uncomputed_comparisons(verdict, {}) == []
    asserted = _page("The loop made exactly {glue:text}`n` updates.", code="assert n == 3")
    assert checker.uncomputed_comparisons(
        asserted, {"The loop made exactly": "asserted: `assert n == 3`"}) == []


def test_positional_words_and_sentences_without_a_measurement_pass():
    assert checker.uncomputed_comparisons(_page(
        "The table above shows {glue:text}`n` runs; the figure below plots them."), {}) == []
    assert checker.uncomputed_comparisons(_page("The function below is exactly that loop."),
                                          {}) == []
    assert checker.uncomputed_comparisons(_page("It calls `apply` exactly once."), {}) == []


# ---------------------------------------------------------------------------- machinery, sections
def test_machinery_in_a_visible_code_cell_or_its_output_fails():
    shown = _page("text", code="x = load()  # hidden cell: where the page looks")
    assert checker.machinery_shown(shown) == [
        "machinery shown: 'x = load()  # hidden cell: where the page looks'"]
    printed = _page("text", output="wrote _build/jupyter_execute/book/x.ipynb\n")
    assert len(checker.machinery_shown(printed)) == 1
    # the same line in a removed cell, or an output the page hides, is not shown
    assert checker.machinery_shown(_page("text", code="# hidden cell", tags=("remove-cell",)))\
        == []
    assert checker.machinery_shown(_page("text", output="_build/x", code="run()",
                                         tags=("remove-output",))) == []
    assert checker.machinery_shown(_page("text", code="x = load()  # the committed run")) == []


def test_a_reference_to_a_section_the_page_lacks_fails():
    page = {"cells": [{"cell_type": "markdown", "metadata": {}, "source":
                       "## 1. BatchNorm\n\ntext\n\n## 3. Keras\n\n* Dropout: see (section 2).\n"
                       "* BatchNorm and Keras (sections 1 and 3), also sections 1 to 3."}]}
    assert checker.missing_sections(page) == [
        "section 2 cited, no heading '2.' on the page: * Dropout: see (section 2).",
        "section 2 cited, no heading '2.' on the page: * BatchNorm and Keras (sections 1 and "
        "3), also sections 1 to 3."]
    source = page["cells"][0]["source"]
    page["cells"][0]["source"] = source.replace("## 3.", "## 2. Dropout\n\n## 3.")
    assert checker.missing_sections(page) == []
    # another page's section is not this page's
    assert checker.missing_sections(_page("As chapter 7's section 3 shows.")) == []


def test_a_bare_section_number_of_another_part_fails_and_its_name_passes():
    """Round-14 reader D5: "(B.2 Pitfalls, gaps and masks: ...)" used an appendix's section
    number as a label."""
    bare = _page("A recipe trains on p (B.2 Pitfalls, gaps and masks).")
    assert checker.missing_sections(bare) == [
        "bare section number 'B.2' (name the section in words, or link it): A recipe trains "
        "on p (B.2 Pitfalls, gaps and masks)."]
    named = _page("A recipe trains on p (Appendix B, 'Pitfalls, gaps and masks'), e.g. 0.5.")
    assert checker.missing_sections(named) == []


def test_a_value_glued_from_a_file_fails_and_a_computed_one_passes():
    from_file = _page("It took {glue:text}`minutes`.", code=(
        "def committed():\n    with open('results.json') as f:\n        return json.load(f)\n"
        "results = committed()\nrows = results['rows']\nglue('minutes', rows[0] / 60)"))
    assert checker.glued_from_files(from_file, {}) == [
        "glued from a file, not computed on the page: 'minutes'"]
    assert checker.glued_from_files(from_file, {"minutes": "a date of the repository"}) == []
    computed = _page("It took {glue:text}`minutes`.", code=(
        "start = time.perf_counter()\ntrain()\nglue('minutes', (time.perf_counter() - start) "
        "/ 60)"))
    assert checker.glued_from_files(computed, {}) == []
    assert checker.glued_from_files(computed, {"minutes": "x"}) == [
        "allowed file glue matches no glue from a file: 'minutes'"]


def test_a_pending_page_fails_once_it_glues_nothing_from_a_file(monkeypatch):
    stem = "09_pending"
    monkeypatch.setitem(checker.FILE_GLUE_PENDING, stem, "reads a committed run")
    from_file = _page("It took {glue:text}`minutes`.", code=(
        "rows = json.load(open('run.json'))\nglue('minutes', rows[0] / 60)"))
    assert checker.page_problems(stem, from_file) == []  # pending: not reported yet
    assert checker.page_problems("09_other", from_file) == [
        "glued from a file, not computed on the page: 'minutes'"]
    computed = _page("It took {glue:text}`minutes`.", code="glue('minutes', 3)")
    assert checker.page_problems(stem, computed) == [
        "FILE_GLUE_PENDING lists the page, but it glues nothing from a file any more"]


def test_main_reports_machinery(tmp_path, capsys):
    (tmp_path / "page.ipynb").write_text(json.dumps(_page("a 0.25 b", "0.25",
                                                          code="x = 1  # hidden cell")))
    assert checker.main([str(tmp_path)]) == 1
    assert "page: machinery shown: 'x = 1  # hidden cell'" in capsys.readouterr().out


def test_no_page_of_the_book_shows_machinery_cites_a_missing_section_or_glues_a_file():
    """The sources (their outputs are checked in the build)."""
    notebooks = sorted(BOOK.glob("*.ipynb"))
    problems = [f"{path.stem}: {problem}" for path in notebooks
                for problem in checker.page_problems(
                    path.stem, json.loads(path.read_text(encoding="utf-8")))]
    assert not problems, "\n".join(problems)
    stems = {path.stem for path in notebooks}
    assert set(checker.ALLOWED_FILE_GLUE) | set(checker.FILE_GLUE_PENDING) <= stems
    assert set(checker.READER_FINDS_PENDING) <= stems
    stale = [problem for path in notebooks for problem in checker.stale_reader_finds_pending(
        path.stem, json.loads(path.read_text(encoding="utf-8")))]
    assert not stale, "\n".join(stale)


# ---------------------------------------------------------------------------- issue 48's review
REVIEWED = [  # (page, the sentence a reader found, the page's rewritten sentence)
    ("appendix_a_roundoff",
     "accumcore computes the same updates, so it drifts as the controls do.",
     "As for accumcore: {glue:text}`so_exercise_answer`."),
    ("04_mnist_experiments",
     "the accumulated weights are 1.3e-02 reference updates away from batch 64's (about 13,000 "
     "times the ~$10^{-6}$ of one window)",
     "the accumulated weights are 5.1e-03 (in units of batch 64's whole change) from batch "
     "64's, the reordering controls 5.1e-03 and 5.1e-03"),
    ("06_pitfalls", "The broken recipes land 0.18 to 3.39 large-batch updates away.",
     "The broken recipes end 0.27 to 2.54 times the large-batch run's whole change away."),
    ("05_lr_sweeps",
     "The gap is 1.2 times the control's, within the factor of 10 that round-off amplified by "
     "training spans: float round-off.",
     "The gap is {glue:text}`check_verdict`."),
    ("08_distributed_mixed_precision",
     "The difference is float16 round-off; accumulation itself adds nothing visible.",
     "The accumulated run is {glue:text}`mixed_verdict`."),
    ("guide_resume", "With `save_freq=\"epoch\"` both are exact (the library's tests check it).",
     "Resumed from the backup of the last completed epoch, both ended bit-identical."),
    ("04_x", "It drifted about 13,000 times the ~1e-6 of one window.",
     "It drifted as far as the reordering controls of the same run."),
    ("05_x", "The book's tests run this block.", "Chapter 1 runs this rule."),
]


def test_the_reviewed_sentences_fail_and_their_rewrites_pass():
    for stem, found, rewritten in REVIEWED:
        assert checker.known_contradictions(stem, _page(found)), (stem, found)
        assert checker.known_contradictions(stem, _page(rewritten)) == [], (stem, rewritten)


def test_a_deferral_to_the_tests_fails_on_any_page_written_or_glued():
    glued = {"cells": [{"cell_type": "code", "source": "", "metadata": {}, "outputs": [{
        "output_type": "display_data", "metadata": {"scrapbook": {"name": "x_words"}},
        "data": {"application/papermill.record/text/plain": "'the library's tests check it'"}}]}]}
    assert len(checker.known_contradictions("guide_x", glued)) == 1
    assert checker.known_contradictions("guide_x", _page("Exact (the book’s tests check it)."))
    assert checker.known_contradictions("guide_x", _page("The tests below check it.")) == []


def _visible_markdown(path: Path) -> str:
    """A Markdown page without its MyST comments (``% ...`` lines: not shown to readers)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("%"))


def test_no_markdown_page_of_the_book_holds_a_page_wide_contradiction():
    """The Markdown pages (intro, API, appendix B, reference) are not notebooks: the page-wide
    entries ("the library's tests", a test citation, ...) are checked on their visible text."""
    pages = sorted(BOOK.rglob("*.md"))
    assert len(pages) >= 8
    problems = [f"{path.relative_to(BOOK)}: {problem}" for path in pages
                for problem in checker.markdown_page_problems(_visible_markdown(path))]
    assert not problems, "\n".join(problems)


def test_a_markdown_page_s_comment_is_not_shown_its_text_is(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n% Tested in `tests/test_x.py`.\n\nIt is exact.\n")
    shown = {"cells": [{"cell_type": "markdown", "source": _visible_markdown(page)}]}
    assert checker.known_contradictions("*", shown, outputs=False) == []
    page.write_text("# A page\n\nIt is exact (the library's tests check it).\n")
    shown = {"cells": [{"cell_type": "markdown", "source": _visible_markdown(page)}]}
    assert len(checker.known_contradictions("*", shown, outputs=False)) == 1


# ---------------------------------------------------------------------------- glued numbers
def _glued_page(markdown: str, printed: str, glued: dict, tags: tuple = ()) -> dict:
    """An executed page: a visible cell printing ``printed``, a removed cell gluing
    ``glued`` (as ``accumcore.lab.book.glue`` records it), then the markdown."""
    records = [{"output_type": "display_data", "metadata": {"scrapbook": {"name": key}},
                "data": {"application/papermill.record/text/plain": repr(value)}}
               for key, value in glued.items()]
    return {"cells": [
        {"cell_type": "code", "source": "", "metadata": {"tags": list(tags)},
         "outputs": [{"output_type": "stream", "text": printed}]},
        {"cell_type": "code", "source": "", "metadata": {"tags": ["remove-cell"]},
         "outputs": records},
        {"cell_type": "markdown", "source": markdown, "metadata": {}}]}


def test_a_glued_range_shown_only_in_a_figure_fails():
    """Masks and tokens' 'from 2.32 to 1.42' (issue 48): the figure drew it, nothing printed."""
    page = _glued_page("The loss falls from {glue:text}`first:.2f` to {glue:text}`last:.2f`.",
                       "rel 6.9e-06 to 1.4e-05\n", {"first": 2.3150265, "last": 1.4203})
    assert checker.unprinted_glue(page) == ["glued number printed by no output: first = 2.32",
                                            "glued number printed by no output: last = 1.42"]


def test_a_glued_number_printed_in_any_rounding_passes():
    page = _glued_page("From {glue:text}`first:.2f` to {glue:text}`last:.1e`, "
                       "{glue:text}`n` runs, {glue:text}`verdict`.",
                       "training loss 2.315 before, 1.42e-03 after; 1,000 runs\n",
                       {"first": 2.3150265, "last": 0.0014203, "n": 1000, "verdict": "a tie"})
    assert checker.unprinted_glue(page) == []


def _markdown_glued_page(markdown: str, printed: str, key: str, value: str) -> dict:
    """An executed page whose removed cell glues ``value`` as Markdown (``{glue:md}``)."""
    page = _glued_page(markdown, printed, {})
    page["cells"][1]["outputs"] = [{
        "output_type": "display_data", "metadata": {"scrapbook": {"name": key}},
        "data": {"application/papermill.record/text/markdown": value,
                 "application/papermill.record/text/plain": "<Markdown object>"}}]
    return page


def test_a_number_in_glued_markdown_that_no_output_prints_fails():
    """Chapter 7's answer glued as Markdown (code in backticks) quotes ratios: each must be
    printed on the page, as a ``{glue:text}`` number must."""
    page = _markdown_glued_page("The fastest: {glue:md}`answer`.", "fit 0.97 x\n", "answer",
                                "`fit` at 0.97 x plain, `AccumTrainer` at 0.88 x")
    assert checker.unprinted_markdown_glue(page) == [
        "number in glued Markdown printed by no output: answer: 0.88"]
    shown = _markdown_glued_page("The fastest: {glue:md}`answer`.", "fit 0.97, trainer 0.878\n",
                                 "answer", "`fit` at 0.97 x plain, `AccumTrainer` at 0.88 x")
    assert checker.unprinted_markdown_glue(shown) == []


def test_a_number_printed_by_a_hidden_output_does_not_count():
    page = _glued_page("From {glue:text}`first:.2f`.", "loss 2.32\n", {"first": 2.3150265},
                       tags=("remove-output",))
    assert len(checker.unprinted_glue(page)) == 1


def test_a_pending_page_is_not_reported_until_it_prints_everything(tmp_path, capsys,
                                                                     monkeypatch):
    stem = "07_memory_speed"
    monkeypatch.setitem(checker.GLUE_PRINT_PENDING, stem, "being rewritten")
    unprinted = _glued_page("From {glue:text}`first:.2f`.", "x\n", {"first": 2.3150265})
    assert checker.executed_page_problems(stem, unprinted) == []
    printed = _glued_page("From {glue:text}`first:.2f`.", "2.32\n", {"first": 2.3150265})
    assert checker.executed_page_problems(stem, printed) == [
        "GLUE_PRINT_PENDING lists the page, but it prints every glued number now"]
    (tmp_path / "masks_tokens.ipynb").write_text(json.dumps(unprinted))
    assert checker.main([str(tmp_path)]) == 1
    assert "masks_tokens: glued number printed by no output: first = 2.32" in \
        capsys.readouterr().out


def test_glued_text_with_markup_fails_and_plain_text_passes():
    marked = _glued_page("b was {glue:text}`b_how`.", "b 4\n", {"b_how": "given as `b=4`"})
    assert checker.markup_in_glue(marked) == [
        "glued text 'b_how' holds markup readers see as is: 'given as `b=4`'"]
    plain = _glued_page("b was {glue:text}`b_how`.", "b 4\n", {"b_how": "given as b=4"})
    assert checker.markup_in_glue(plain) == []


def _build_page(tmp_path: Path, markdown: str, printed: str, glued: dict) -> None:
    """A page as a Jupyter Book build leaves it: myst-nb writes the executed notebook without
    its glue outputs (and without the removed cells) and the values to ``page.glue.json``."""
    page = {"cells": [
        {"cell_type": "code", "source": "", "metadata": {},
         "outputs": [{"output_type": "stream", "text": printed}]},
        {"cell_type": "markdown", "source": markdown, "metadata": {}}]}
    (tmp_path / "page.ipynb").write_text(json.dumps(page))
    glue = {key: {"output_type": "display_data", "data": {"text/plain": repr(value)},
                  "metadata": {"scrapbook": {"name": key,
                                             "mime_prefix": checker.GLUE_PREFIX}}}
            for key, value in glued.items()}
    (tmp_path / "page.glue.json").write_text(json.dumps(glue))


def test_a_build_s_glue_file_is_read_an_unprinted_glue_fails(tmp_path, capsys):
    _build_page(tmp_path, "The loss was {glue:text}`last:.2f` at the end.", "x\n", {"last": 1.4203})
    assert checker.main([str(tmp_path)]) == 1
    assert "page: glued number printed by no output: last = 1.42" in capsys.readouterr().out


def test_a_build_s_glue_file_with_the_number_printed_passes(tmp_path, capsys):
    _build_page(tmp_path, "The loss was {glue:text}`last:.2f` at the end.", "loss 1.420\n",
                {"last": 1.4203})
    assert checker.main([str(tmp_path)]) == 0, capsys.readouterr().out


def test_a_build_s_glued_markup_and_known_contradiction_fail(tmp_path, capsys):
    _build_page(tmp_path, "b was {glue:text}`b_how`; {glue:text}`why`.", "b 4\n",
                {"b_how": "given as `b=4`", "why": "the library's tests check it"})
    assert checker.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "glued text 'b_how' holds markup" in out
    assert "known contradiction returned: \"library's tests\"" in out


def test_a_quoted_glue_with_no_recorded_value_fails(tmp_path, capsys):
    """Without the glue file (or records) the glue rules would see nothing and pass blind."""
    _build_page(tmp_path, "The loss was {glue:text}`last:.2f` at the end.", "loss 1.420\n", {})
    assert checker.main([str(tmp_path)]) == 1
    assert "glue 'last' quoted, but no value of it recorded" in capsys.readouterr().out


@pytest.mark.parametrize("written, rewritten", [
    ("Each row gives the error; a test holds every row.", "Each row gives the error."),
    ("The tests inject NaN into one micro-batch.", "NaN put into one micro-batch is skipped."),
    ("TF 2.19 (supported until 2026-12, issue 41).", "TF 2.19 (supported by earlier releases)."),
    ("It goes through `accumcore/_impl/compat.py`.", "It is handled in one place."),
    ("CI (`bash scripts/test.sh`, what `.ci/run` runs) tests two stacks.", "CI tests two stacks."),
    ("below both controls (1 times the smaller)", "below both controls (2.1e-3 against 2.2e-3)"),
    ("Keras's fit fails there (keras-team/keras#20585).", "Keras's fit fails there."),
    ("a `keras.src.models.Sequential` is built", "a `keras.Sequential` is built"),
    ("the preset could not be loaded: this build has no kagglehub package",
     "the preset could not be downloaded: this page ran without internet access"),
    ("(the build machine has no internet)", "(this page ran without internet access)"),
    ("rows which the library's own tests check", "rows no chapter runs"),
    ("The project's test command runs every notebook on it.",
     "The package is known to run on this stack."),
    ("see https://github.com/keras-team/keras/issues/20585", "Keras's fit fails there."),
    ("the book's tests check it", "the book's test set has 10,000 images"),
])
def test_machinery_on_a_reference_page_fails_and_its_rewrite_passes(written, rewritten):
    """The round-1 read of the reference pages: test citations, issue numbers, internal
    modules, build scripts and a support promise under "Not supported"."""
    def page(text):
        return {"cells": [{"cell_type": "markdown", "source": text}]}

    assert checker.known_contradictions("*", page(written), outputs=False)
    assert checker.known_contradictions("*", page(rewritten), outputs=False) == []


@pytest.mark.parametrize("written, rewritten", [
    ("exact, a ragged last micro-batch included (tested on CPU, at `steps_per_execution` 1 "
     "and 4)", "exact, a ragged last micro-batch included, at any `steps_per_execution`"),
    ("pooled across replicas; tested with `MirroredStrategy` over 2 logical CPU devices",
     "pooled across replicas, with `fit` and with `AccumTrainer`'s loop"),
    ("(TensorFlow 2.21, measured by tests/test_resume.py) the seed's state",
     "(on the supported TensorFlow versions) the seed's state"),
    ("Building the model (`_maybe_symbolic_build`), Keras raises", "Keras raises"),
    ("The minimum is the oldest stack CI runs.", "The minimum is Colab's runtime."),
    ("this page holds the tables of its committed run", "this page holds the tables of one run"),
    ("window_step peaked at 67.9 and 71.0 MiB in two runs during development",
     "peaks can differ by a few MiB from run to run"),
    ("Number of batches skipped so far (for tests and logs).",
     "Number of batches turned into no-ops so far."),
    ("every notebook as a test under nbval (`pytest --nbval-lax`)",
     "every notebook of the book runs on it"),
])
def test_machinery_on_a_markdown_page_fails_and_its_rewrite_passes(written, rewritten):
    """The round-2 read of the reference pages, the intro, the API page and appendix B."""
    assert checker.markdown_page_problems(written), written
    assert checker.markdown_page_problems(rewritten) == [], rewritten


def test_ci_is_machinery_as_a_word_only():
    assert checker.markdown_page_problems("CI tests two stacks.")
    assert checker.markdown_page_problems("A specific choice (ci, CIFAR) passes.") == []


# ---------------------------------------------------------------------------- rendered pages
def _html(body: str) -> str:
    """A built page: navigation outside the article (never checked), ``body`` inside it."""
    return ('<html><body><nav><p>The book’s helpers: accumcore.lab.</p></nav>'
            f'<main><article class="bd-article">{body}</article></main>'
            '<script>var a = "keras.src.x";</script></body></html>')


@pytest.mark.parametrize("bad, good", [
    ("<p>a Keras bug, reported in keras-team/keras#20585.</p>",
     "<p>a known Keras limitation: its fit fails under the strategy.</p>"),
    ("<p>See issue #123 for the details.</p>", "<p>See the limits below for the details.</p>"),
    ("<p>Issue 49 asked for it.</p>", "<p>The book asked for it in chapter 2.</p>"),
    ("<p>Fixed by PR #12.</p>", "<p>Fixed in Keras 3.6.</p>"),
    ("<p>from accumcore._impl.rule import step</p>", "<p>from accumcore import AccumModel</p>"),
    ("<p>&lt;function &lt;lambda&gt; at 0x7f3a2c1b&gt;</p>", "<p>a lambda</p>"),
    ("<p>&lt;bound method Layer.call of ...&gt;</p>", "<p>the layer's call</p>"),
    ('<dl><dt>nonfinite: str | tensorflow.python.framework.tensor.Tensor</dt></dl>',
     "<dl><dt>nonfinite: str | tf.Tensor</dt></dl>"),
    ("<pre>from keras.src.layers import Dense</pre>", "<pre>from keras.layers import Dense</pre>"),
    ("<dl><dt>LoopHistory(micro_losses=&lt;factory&gt;)</dt></dl>",
     "<dl><dt>LoopHistory(micro_losses=[])</dt></dl>"),
    ("<dl><dt>run(build_model=&lt;function mlp&gt;)</dt></dl>",
     "<dl><dt>run(build_model=mlp)</dt></dl>"),
    ("<p>&lt;Dense object at 0x7f3a2c1b&gt;</p>", "<p>a Dense layer</p>"),
    ("<dl><dd><ul><li><p><strong>_errors</strong> (<em>dict</em>) – the errors</p></li></ul>"
     "</dd></dl>",
     "<dl><dd><ul><li><p><strong>errors</strong> (<em>dict</em>) – the errors</p></li></ul>"
     "</dd></dl>"),
    ("<p>The run ends bit for bit where it stopped.</p><p>Then it goes on. The run ends bit for "
     "bit where it stopped.</p>",
     "<p>The run ends bit for bit where it stopped.</p><p>The resumed run ends there too.</p>"),
    ('<p>The helpers are documented in <a href="b.html">Appendix B. The book’s helpers: '
     'accumcore.lab</a>. The book’s helpers: accumcore.lab.</p>',
     '<p>The book’s helpers are documented in <a href="b.html">Appendix B</a>.</p>'),
])
def test_a_rendered_page_fails_on_what_a_reader_found_and_passes_without_it(bad, good):
    assert checker.rendered_page_problems(_html(bad)), bad
    assert checker.rendered_page_problems(_html(good)) == [], good


def test_repeats_in_tables_api_entries_and_code_are_the_pages_own():
    row = "<tr><td>(2) plain fit at B = K*b of the run</td></tr>"
    entry = "<dd><p>Returns whether an optimizer update was applied.</p></dd>"
    page = (f"<table>{row}</table><table>{row}</table><dl>{entry}{entry}</dl>"
            "<pre>x = 1 and x = 2 and x = 3\nx = 1 and x = 2 and x = 3</pre>"
            "<p>A sentence that wraps\nover a source line break. Another sentence is here "
            "in the paragraph.</p>")
    assert checker.rendered_page_problems(_html(page)) == []


def test_main_html_reports_each_page(tmp_path, capsys):
    (tmp_path / "book" / "reference").mkdir(parents=True)
    (tmp_path / "book" / "reference" / "devices.html").write_text(
        _html("<p>reported in keras-team/keras#20585</p>"), encoding="utf-8")
    (tmp_path / "book" / "intro.html").write_text(_html("<p>Fine.</p>"), encoding="utf-8")
    assert checker.main(["--html", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "reference/devices.html: a GitHub issue reference" in out
    assert "intro.html" not in out.replace("2 pages", "")
    (tmp_path / "book" / "reference" / "devices.html").write_text(
        _html("<p>a known Keras limitation</p>"), encoding="utf-8")
    assert checker.main(["--html", str(tmp_path)]) == 0


@pytest.mark.parametrize("tags, flagged", [([], True), (["remove-output"], False),
                                           (["remove-cell"], False)])
def test_an_output_the_page_removes_is_not_read_as_shown(tags, flagged):
    """A `fit` history's repr (`<keras.src.callbacks.history.History ...>`) in a cell whose
    output the page removes is not on the page; printed, it is machinery."""
    page = {"cells": [{"cell_type": "code", "source": "model.fit(x, y)", "metadata": {"tags": tags},
                       "outputs": [{"output_type": "execute_result", "data": {
                           "text/plain": "<keras.src.callbacks.history.History at 0x7f>"}}]}]}
    assert bool(checker.known_contradictions("03_model_fit", page)) is flagged


@pytest.mark.parametrize("text, flagged", [
    ("<p>See <a href='08.html'>Chapter 8, 8. Several devices and mixed precision</a>.</p>", True),
    ("<p>See <a href='08.html'>8. Several devices and mixed precision</a>.</p>", False),
    ("<p>Chapter 8, section 8. Several devices</p>", False),
    ("<p>See Chapter 6b, <a href='06b.html'>6b. Gaps</a>.</p>", True),
    ("<p>See chapter 8 (<a href='08.html'>8. Several devices</a>).</p>", True),
])
def test_a_chapter_number_said_twice_on_a_rendered_page(text, flagged):
    """A hand-written "Chapter 8," before a link whose title carries the number ("8. Several
    devices ...", "6b. Gaps ...")."""
    problems = checker.rendered_page_problems(f"<html><body>{text}</body></html>")
    assert any("number said twice" in p for p in problems) is flagged, problems


@pytest.mark.parametrize("tags, flagged", [([], True), (["remove-stderr"], False)])
def test_stderr_the_page_removes_is_not_read_as_shown(tags, flagged):
    """TensorFlow's deprecation notices name ``tensorflow.python`` modules on stderr; under
    ``remove-stderr`` the page does not show them."""
    page = {"cells": [{"cell_type": "code", "source": "x", "metadata": {"tags": tags},
                       "outputs": [{"output_type": "stream", "name": "stderr", "text":
                                    "(from tensorflow.python.ops.x) is deprecated"}]}]}
    assert bool(checker.known_contradictions("01_eager_loop", page)) is flagged


@pytest.mark.parametrize("written, rewritten", [
    ("within float32 round-off (the book's rule, asserted on the page)",
     "within float32 round-off (the book's rule: the page checks it and stops if not)"),
    ("The assert below checks both runs.", "The cell below checks both runs and stops if not."),
    ("the cell asserts that both gaps are below 0.01", "the cell checks that both gaps are small"),
])
def test_the_tests_vocabulary_in_prose_fails_and_its_rewrite_passes(written, rewritten):
    """The tests' vocabulary ("asserted", "the assert") in prose is flagged; its rewrite in a
    reader's words ("the cell checks ... and stops if not") is not. Code is not prose."""
    assert checker.markdown_page_problems(written), written
    assert checker.markdown_page_problems(rewritten) == [], rewritten
    assert checker.page_problems("09_x", _page(written)), written
    assert checker.page_problems("09_x", _page(rewritten)) == [], rewritten


def test_python_s_assert_in_code_and_outputs_is_not_prose():
    code = "```python\nassert gap < 1e-3  # the assert stops the page\n```\nIt is exact."
    assert checker.markdown_page_problems(code) == []
    assert checker.markdown_page_problems("The `assert` statement is Python's.") == []
    page = _page("It is exact.", output="asserted: the assert held", code="assert ok")
    assert checker.page_problems("09_x", page) == []


# ---------------------------------------------------------------------------- linter pragmas
@pytest.mark.parametrize("tags, flagged", [((), True), (("hide-input",), True),
                                           (("remove-input",), False), (("remove-cell",), False)])
def test_a_linter_pragma_in_code_readers_see_is_machinery(tags, flagged):
    """Chapter 3's folded cell showed `# noqa: E731` to a reader who unfolded it: a
    ``hide-input`` cell is seen; a removed source is not."""
    page = _page("text", code='controls_text = lambda cs: " and ".join(cs)  # noqa: E731',
                 tags=tags)
    assert bool(checker.pragmas_shown(page)) is flagged
    assert bool(checker.page_problems("09_x", page)) is flagged


@pytest.mark.parametrize("tags, shown", [((), True), (("hide-input",), False),
                                         (("remove-input",), False), (("remove-cell",), False)])
def test_a_number_in_folded_code_is_not_shown_but_folded_machinery_is_seen(tags, shown):
    """One rule (``source_seen``) with one choice: a folded ``hide-input`` source is seen for
    machinery and pragmas (a click unfolds every line), but a number in it is not shown to the
    reader of the sentence that quotes it."""
    cell = {"cell_type": "code", "source": "GAP = 0.45  # hidden cell", "metadata": {
        "tags": list(tags)}, "outputs": []}
    assert checker.source_seen(cell, folded=False) is shown
    assert checker.source_seen(cell, folded=True) is (tags in ((), ("hide-input",)))
    page = {"cells": [cell, {"cell_type": "markdown", "source": "The gap is 0.45 here.",
                             "metadata": {}}]}
    assert (checker.unshown_numbers(page, {}) == []) is shown
    assert ("0.45" in checker.shown(page)) is shown
    assert ("0.45" in checker._printed(page)) is shown
    assert bool(checker.machinery_shown(page)) is (tags in ((), ("hide-input",)))


@pytest.mark.parametrize("tags, seen", [((), True), (("hide-input",), True),
                                        (("remove-input",), False), (("remove-cell",), False)])
def test_machinery_and_pragmas_share_one_rule_for_a_seen_source(tags, seen):
    """A folded ``hide-input`` cell is seen by both rules (a reader unfolds it); a removed
    source by neither."""
    cell = {"cell_type": "code", "source": "", "metadata": {"tags": list(tags)}}
    assert checker.source_seen(cell) is seen
    machinery = _page("text", code="x = 1  # hidden cell", tags=tags)
    pragma = _page("text", code="x = 1  # noqa: F841", tags=tags)
    assert bool(checker.machinery_shown(machinery)) is seen
    assert bool(checker.pragmas_shown(pragma)) is seen


@pytest.mark.parametrize("line, flagged", [
    ("import os  # noqa", True), ("x = f()  # type: ignore[attr-defined]", True),
    ("if x:  # pragma: no cover", True), ("# fmt: off", True),
    ("y = g()  # pylint: disable=invalid-name", True),
    ("def controls_text(cs):", False), ("# the type: a float", False),
    ("x = 1  # fmt is the format", False), ("# no QA needed: it is exact", False),
    ("# yapf: disable", True), ("x = f()  # pyre-ignore[16]", True), ("# pyre-fixme[6]", True),
    ("x = f()  # pytype: disable=attribute-error", True), ("# ruff: noqa: F401", True),
    ("import a  # isort: skip", True), ("# mypy: ignore-errors", True),
    ("# mypy: disable-error-code=attr-defined", True), ("x.y  # pyright: ignore", True),
    ("# flake8: noqa", True),
    ("# ruff: the linter the project uses, run on the library", False),
    ("# mypy: a type checker; it is not run here", False), ("# pyre: a checker", False),
    ("# isort sorts the imports", False), ("# pylint: a linter", False),
])
def test_each_kind_of_pragma_is_found_and_plain_comments_pass(line, flagged):
    assert bool(checker.pragmas_shown(_page("text", code=line))) is flagged, line


def test_a_rendered_page_showing_a_pragma_fails():
    assert checker.rendered_page_problems(_html("<pre>f = lambda c: c  # noqa: E731</pre>"))
    assert checker.rendered_page_problems(_html("<pre>def f(c):\n    return c</pre>")) == []


# ---------------------------------------------------------------------------- glued templates
@pytest.mark.parametrize("markdown, bad, good", [
    ("It used all {glue:text}`n` epochs.", {"n": 2}, {"n": 5}),  # "all 2": both
    ("It ran on {glue:text}`n` seeds.", {"n": 1}, {"n": 3}),
    ("The gap grew up to update {glue:text}`k`.", {"k": 1}, {"k": 37}),
    ("It is {glue:text}`ratio_words` the control.", {"ratio_words": "0 times"},
     {"ratio_words": "10 times"}),
    ("Stock BN: {glue:text}`counts`.",  # chapter 6b's counts, quick edition
     {"counts": "scored higher beyond the tie threshold on 0 of 2 seeds, tied on 1 and lower "
                "on 1"},
     {"counts": "scored higher beyond the tie threshold on none of the 2 seeds, tied on 1 and "
                "lower on 1"}),
    ("Stock BN: {glue:text}`counts`.",  # chapter 6b's counts, full edition
     {"counts": "tied on 2 and lower on 0: higher on 3 of 3 seeds"},
     {"counts": "tied on 2 and never lower: higher on every seed"}),
    ("It ended {glue:text}`verdict`.", {"verdict": ""}, {"verdict": "a tie"}),
    ("It ended {glue:text}`verdict`.", {"verdict": "{ratio:.2f} times"},
     {"verdict": "2.1 times"}),
    ("The rate: {glue:text}`rate`.", {"rate": None}, {"rate": "None of the rates trained"}),
    ("The gap: {glue:text}`gap:.2f`.", {"gap": float("nan")}, {"gap": 0.25}),
    ("The exponent spans {glue:text}`span`.", {"span": "0.32 to 0.32"},
     {"span": "-0.32 to 0.32"}),
    ("The gaps {glue:text}`span`.", {"span": "ranged from +0.20 to +0.20 points"},
     {"span": "ranged from -0.20 to +0.20 points"}),
    ("The gaps {glue:text}`span`.", {"span": "ranged from -0.20 to -0.20 points"},
     {"span": "were -0.20 points on every seed"}),
])
def test_glued_text_that_reads_as_a_degenerate_template_fails(markdown, bad, good):
    """What fresh readers found glued: "all 2 epochs", "lower on 0", "0 of 2 seeds", a range
    ending at update 1, "1 seeds", an empty verdict, braces, None, nan."""
    assert checker.template_artefacts(_glued_page(markdown, "x\n", bad)), bad
    assert checker.template_artefacts(_glued_page(markdown, "x\n", good)) == [], good


def test_a_template_artefact_is_reported_only_where_a_glued_value_is():
    """Written prose is the author's own ("all 2" in a sentence no glue fills)."""
    page = _glued_page("Both of the 2 layers, all 2 of them: {glue:text}`n` runs.", "x\n",
                       {"n": 3})
    assert checker.template_artefacts(page) == []


@pytest.mark.parametrize("glued", [
    "in 0.5 s, on 0.25 of the data", "10 times the control, 1 run, 11 runs, 1,000 runs",
    "all 20 seeds, all 3 of them", "up to update 12, through epoch 1.5", "from 1 to 10",
    "see {doc}`chapter 3 <03_model_fit>`", "NaN in one micro-batch, Inf in another",
    "on 1 of 3 seeds, 12 of 13", "centred on 0, spread 0.2", "the weights at epoch 5 of 5",
    "set to 0 in 0.5 s", "1 second, 0.5 seconds, 10 seconds", "0.1 to 0.2 to 0.3",
])
def test_glued_text_that_only_resembles_a_template_passes(glued):
    page = _glued_page("It was {glue:text}`words`.", "x\n", {"words": glued})
    assert checker.template_artefacts(page) == [], glued


@pytest.mark.parametrize("markdown, glued, flagged", [
    ("{glue:text}`words`.", "None diverged", False),  # a sentence's first word
    ("{glue:text}`words`.", "None of the runs, none diverged", False),
    ("Seeds: {glue:text}`words`.", "None of them trained", False),  # a clause's first word
    ("{glue:text}`words`.", "Epoch 5 of 5 ended the run", False),  # a position, capitalised
    ("It ran {glue:text}`words`.", "after None updates", True),  # the review's two strings
    ("{glue:text}`words`.", "None times the larger control", True),
    ("It was {glue:text}`words`.", "None times the larger control", True),
    ("It was {glue:text}`words`.", "None diverged", True),  # not at a clause's start
    ("{glue:text}`words`.", "None runs diverged", True),  # a counted noun
    ("It set {glue:text}`words`.", "lr=None", True),
    ("{glue:text}`words`.", "All 2 epochs ran", True),  # capitalised, still 'both'
    ("{glue:text}`words`.", "Up to update 1 it held", True),
    ("{glue:text}`words`.", "3 of 3 seeds agreed", True),
])
def test_none_is_a_word_only_at_a_clause_s_start_and_capitals_read_as_lowercase(
        markdown, glued, flagged):
    """``None`` is the word only where a clause starts, before a word that is no counted noun
    ("None diverged", "None of them"); mid-clause or before "updates"/"times" it is Python's
    None. A sentence's capitalised first word ("Epoch 5 of 5", "All 2") reads as its lowercase
    form does."""
    page = _glued_page(markdown, "x\n", {"words": glued})
    assert bool(checker.template_artefacts(page)) is flagged, glued


@pytest.mark.parametrize("glued, flagged", [
    ("0.1 to 0.2 to 0.2", True),  # an equal pair after an unequal one
    ("0.2 to 0.2 to 0.3", True),
    ("0.1 to 0.2 to 0.3", False),
])
def test_a_range_to_itself_is_found_after_another_range(glued, flagged):
    page = _glued_page("The rates went {glue:text}`words`.", "x\n", {"words": glued})
    problems = checker.template_artefacts(page)
    assert any("a range from a value to itself" in p for p in problems) is flagged, problems
    if flagged:
        assert any("'0.2 to 0.2'" in p for p in problems), problems


@pytest.mark.parametrize("filled, unfilled", [
    # inline math: LaTeX braces are no format field; the real field is found once
    ("below $10^{-3}$, the $\\frac{1}{K}$ share", "below {bound:.0e}, the $\\frac{1}{K}$ share"),
    # ``$$...$$`` is one block of math: read as ``$`` pairs, its LaTeX braces were fields
    ("the share $$\\frac{1}{K}$$ of it", "the share $$\\frac{1}{K}$$ of {n}"),
])
def test_latex_braces_in_glued_markdown_are_no_format_field(filled, unfilled):
    page = _markdown_glued_page("It is {glue:md}`bound`.", "x\n", "bound", filled)
    assert checker.template_artefacts(page) == []
    page = _markdown_glued_page("It is {glue:md}`bound`.", "x\n", "bound", unfilled)
    assert len(checker.template_artefacts(page)) == 1  # the field, once


@pytest.mark.parametrize("glued, why", [
    ("0.10 to 0.1", "a range from a value to itself"),  # float-equal, written differently
    ("+0.2 to 0.20 points", "a range from a value to itself"),
    ("higher on 0 seeds", "a count of zero"), ("0 runs diverged", "a count of zero"),
    ("done in 1 seconds", "one with a plural noun"), ("lr None and b 16", "Python's None"),
])
def test_degenerate_templates_the_first_rules_missed_fail(glued, why):
    """Template artefacts the first version of the rules let through: float-equal ranges
    written differently, a zero count before its noun, "1 seconds", None before "and"."""
    page = _glued_page("It was {glue:text}`words`.", "x\n", {"words": glued})
    problems = checker.template_artefacts(page)
    assert any(why in problem for problem in problems), (glued, problems)


def test_main_reports_a_build_s_template_artefact(tmp_path, capsys):
    _build_page(tmp_path, "It used {glue:text}`stop_text`.", "x\n",
                {"stop_text": "all 2 epochs"})
    assert checker.main([str(tmp_path)]) == 1
    assert "template artefact in glued text ('all 2' is 'both'" in capsys.readouterr().out
    _build_page(tmp_path, "It used {glue:text}`stop_text`.", "x\n", {"stop_text": "both epochs"})
    assert checker.main([str(tmp_path)]) == 0


# ---------------------------------------------------------------------------- control spread
_JUMPED = ("the reversed control jumped in one update, likely because a sum in another order "
           "differs in its last bits and a ReLU's derivative is a step")


@pytest.mark.parametrize("controls, note, flagged", [
    ("1.8e-02 and 8.4e-07", None, True),  # chapter 3's weighted run, full edition
    ("1.8e-02 and 8.4e-07", _JUMPED, False),
    ("1.8e-02 and 8.4e-07", "no control jumped tenfold in one update", True),
    ("1.8e-02 and 8.4e-07", "neither control jumped tenfold in one update", True),
    ("1.8e-02 and 8.4e-07", "the controls did not jump", True),
    ("1.8e-02 and 8.4e-07",  # chapter 3's note when no control moved: it names no jump
     "both runs' controls stayed near their first updates' size", True),
    ("1.8e-02 and 8.4e-07", "the weighted run's reversed control diverged gradually, a "
     "hundredfold or more without a tenfold jump in any one update", False),
    ("1.8e-02 and 8.4e-07", "no control of the unweighted run moved; the weighted run's "
     "reversed control jumped tenfold in one update", False),
    ("1.8e-02 and 8.4e-07",  # the note a reader found beside them: it explains no spread
     "the largest shows how far a reordering alone moved plain Keras in this run", True),
    ("7.6e-07 and 8.2e-07", None, False),
    ("8.4e-05 and 8.4e-07", None, True),  # exactly 100 times
    ("0.0e+00 and 0.0e+00", None, False),  # both bit for bit: no spread
    ("2.0e-07 and 0.0e+00", None, True),  # one bit for bit, the other not
])
def test_glued_sibling_controls_far_apart_need_a_glued_explanation(controls, note, flagged):
    glued = {"weighted_controls": controls, **({"controls_note": note} if note else {})}
    markdown = "Its controls {glue:text}`weighted_controls`." + (
        " Per update, {glue:text}`controls_note`." if note else "")
    problems = checker.unexplained_control_spread(_glued_page(markdown, "x\n", glued))
    assert bool(problems) is flagged, problems


@pytest.mark.parametrize("printed, tags, flagged", [
    ("reordering controls: reversed 1.52e-05, shuffled 1.66e-03; larger control: 1.8\n", (),
     True),
    ("reordering controls: reversed 1.52e-05, shuffled 1.66e-05; larger control: 1.8\n", (),
     False),
    ("reordering controls 7.6e-07 and 8.2e-07: 4.1e-05 times the larger\n", (), False),
    ("reordering controls vs batch 64: reversed rel = 1.27e-02, shuffled rel = 1.38e-06\n",
     (), True),
    ("reordering controls vs batch 64: reversed rel = 1.27e-02, shuffled rel = 1.38e-06\n",
     ("remove-output",), False),
])
def test_printed_sibling_controls_far_apart_need_a_glued_explanation(printed, tags, flagged):
    """A printed pair after "reordering controls", up to its clause's end (the ratio after
    ': ' is not a control); an output the page hides is not read."""
    page = _glued_page("It ends as the controls do.", printed, {}, tags=tags)
    assert bool(checker.unexplained_control_spread(page)) is flagged
    explained = _glued_page("It ends as the controls do; {glue:text}`controls_note`.", printed,
                            {"controls_note": _JUMPED}, tags=tags)
    assert checker.unexplained_control_spread(explained) == []


# ---------------------------------------------------------------------------- reader finds
def _code_and_prose(code: str, markdown: str, tags: tuple = ()) -> dict:
    return _page(markdown, code=code, tags=tags)


@pytest.mark.parametrize("markdown, flagged", [
    ("Each mode trains for `EPOCHS` epochs.", True),  # chapter 2
    ("It compiles it with a fresh `SGD(LEARNING_RATE)`.", True),  # chapter 4
    ("The warm-up lasts one epoch (`WARMUP_RUN`).", True),  # chapter 5
    ("It trains for EPOCHS epochs.", True),  # not in backticks either
    ("Each mode trains for {glue:text}`epochs` epochs.", False),
    ("Each mode trains for 3 epochs, at a learning rate of 0.05.", False),
    ("Rerun the sweep with `EPOCHS = 10`: the budget grows.", False),  # which line to edit
    ("```python\nmodel.fit(x, y, epochs=EPOCHS)\n```\nIt trains.", False),  # a listing
    ("The batch $B$ is $K$ micro-batches; MNIST has ten digits.", False),  # not assigned
    ("Set `ACCUMCORE_QUICK=1` or flip QUICK_NOTE.", False),  # assigned nowhere on the page
])
def test_a_code_constant_s_name_in_the_prose_fails(markdown, flagged):
    """Readers get words and a value, not the variable: an ALL_CAPS name the page's code
    assigns, in the prose, in backticks or not."""
    code = "EPOCHS = 3\nLEARNING_RATE = 0.05\nWARMUP_RUN = 1\nK, B = 4, 64\nprint(EPOCHS)"
    problems = checker.constant_names_in_prose(_code_and_prose(code, markdown))
    assert bool(problems) is flagged, problems
    assert bool(checker.page_problems("09_x", _code_and_prose(code, markdown))) is flagged


def test_the_quick_switch_and_library_exports_are_not_code_constants():
    """The book's QUICK switch (a visible ``QUICK = False`` and the removed cell reading
    ``ACCUMCORE_QUICK``) is code; prose naming it is reported like any constant, but the
    switch's cells themselves are not prose. A name in ``accumcore.__all__`` is API."""
    switch = {"cells": [
        {"cell_type": "code", "source": "QUICK = False  # True: a faster, smaller run",
         "metadata": {}, "outputs": []},
        {"cell_type": "code", "source": 'import os\nQUICK = QUICK or os.environ.get('
         '"ACCUMCORE_QUICK") == "1"', "metadata": {"tags": ["remove-cell"]}, "outputs": []},
        {"cell_type": "markdown", "source": "The run takes a minute.", "metadata": {}}]}
    assert checker.page_problems("09_x", switch) == []
    exports = sorted(checker._library_exports())
    assert "AccumModel" in exports
    page = _code_and_prose("\n".join(f"{name} = 1" for name in exports if name.isupper())
                           + "\nMY_RATE = 1", "It uses MY_RATE and every export.")
    assert checker.page_constants(page) == {"MY_RATE"}


_FLOOR_CELL = '''ax = plot(gaps)
if zeros:  # the floor marks something only where a gap is drawn on it
    ax.axhline(floor, color="grey", linestyle=":", label=f"floor {floor:g} nats")
plt.show()'''


@pytest.mark.parametrize("code, alt, flagged", [
    (_FLOOR_CELL, "Line chart: each run's distance, with a dotted line at the floor.", True),
    (_FLOOR_CELL, "Line chart: each run's distance; a dotted floor line if a gap is 0.", False),
    (_FLOOR_CELL, "Line chart: each run's distance from the batch-64 curve.", False),
    (_FLOOR_CELL.replace("if zeros:", "if True:").replace("    ax.axhline", "    pass\nax.axhline"),
     "Line chart: each run's distance, with a dotted line at the floor.", False),
    ("ax.plot(x, y, label='loss')\nif best:\n    ax.scatter(b, a, label='best rate')\n",
     "Line chart: the loss, the best rates marked.", True),
    ("ax.plot(x, y, label='loss')\nif best:\n    ax.scatter(b, a, label='best rate')\n",
     "Line chart: the loss against the samples seen.", False),
    # the label's first word is a stop-word: its name is "floor", not "the"
    ("if zeros:\n    ax.axhline(y0, label='the floor')\n",
     "Line chart: the distances, with a dotted line at the floor.", True),
    ("if zeros:\n    ax.axhline(y0, label='the floor')\n",
     "Line chart: the distance of the runs from the reference.", False),
    # drawn in both branches, or also unconditionally: always drawn
    ("if zeros:\n    ax.axhline(y0, label='floor')\nelse:\n    ax.axhline(y1, label='floor')\n",
     "Line chart: the distances, with a dotted line at the floor.", False),
    ("if a:\n    ax.axhline(y0, label='floor')\nelif b:\n    ax.axhline(y1, label='floor')\n"
     "else:\n    ax.axhline(y2, label='floor')\n",
     "Line chart: the distances, with a dotted line at the floor.", False),
    ("if a:\n    ax.axhline(y0, label='floor')\nelif b:\n    ax.axhline(y1, label='floor')\n",
     "Line chart: the distances, with a dotted line at the floor.", True),  # no else
    ("ax.axhline(y0, label='floor')\nif zeros:\n    ax.axhline(y1, label='floor', lw=2)\n",
     "Line chart: the distances, with a dotted line at the floor.", False),
])
def test_a_figure_text_naming_a_conditionally_drawn_element_fails(code, alt, flagged):
    """Chapter 4's alt text promised "a dotted line at the floor", which its code draws only
    under ``if zeros:``."""
    page = {"cells": [{"cell_type": "code", "source": code, "outputs": [],
                       "metadata": {"tags": ["hide-input"],
                                    "mystnb": {"image": {"alt": alt}}}}]}
    problems = checker.conditional_figure_elements(page)
    assert bool(problems) is flagged, problems
    caption = {"cells": [{**page["cells"][0], "metadata": {
        "mystnb": {"figure": {"caption": alt}, "image": {"alt": "A chart."}}}}]}
    assert bool(checker.conditional_figure_elements(caption)) is flagged


@pytest.mark.parametrize("markdown, glued, flagged", [
    ("The controls grew by orders of magnitude.", {}, True),
    ("The controls grew by orders of magnitude (from 1e-07 to 3e-04).", {}, False),
    ("The control diverged a hundredfold or more.", {}, True),
    ("The control diverged ten times or more, to {glue:text}`ratio:.0f` times.",
     {"ratio": 312.0}, False),
    ("Per update, {glue:text}`controls_note`.",  # chapter 3's glued note
     {"controls_note": "the reversed control diverged gradually, a hundredfold or more "
                       "without a tenfold jump in any one update"}, True),
    ("Per update, {glue:text}`controls_note`.",
     {"controls_note": "the reversed control diverged gradually, 312 times over the run, "
                       "without a tenfold jump in any one update"}, False),
    ("Per update, {glue:text}`controls_note`.",  # a number in the same sentence
     {"controls_note": "it grew a hundredfold or more (from 1.2e-07 to 4.0e-05)"}, False),
    ("It is an order of magnitude slower.", {}, True),
    ("It is ten times faster or more.", {}, False),  # 'or more' about no magnitude word
    ("As in chapter 3, the controls grew by orders of magnitude.", {}, True),  # no factor
    ("As in section 2, it grew a hundredfold or more (312 times).", {}, False),
    ("In float64 it shrinks by orders of magnitude.", {}, False),  # a digit in a word counts
])
def test_a_vague_magnitude_with_no_number_in_its_sentence_fails(markdown, glued, flagged):
    page = _glued_page(markdown, "x\n", glued)
    problems = checker.vague_magnitudes(page)
    assert bool(problems) is flagged, problems


def test_a_vague_magnitude_in_a_caption_fails_and_an_unrecorded_glue_may_be_a_number():
    """Appendix A's caption ("grow from round-off by orders of magnitude"); on the sources a
    glue's value is unknown, so a sentence quoting one is left to the executed page."""
    page = {"cells": [{"cell_type": "code", "source": "plot()", "outputs": [], "metadata": {
        "mystnb": {"figure": {"caption": "Red: the controls grow by orders of magnitude."}}}}]}
    assert checker.vague_magnitudes(page)
    source = _page("It grew by orders of magnitude, {glue:text}`factor_words`.")
    assert checker.vague_magnitudes(source) == []
    executed = _glued_page("It grew by orders of magnitude, {glue:text}`factor_words`.", "x\n",
                           {"factor_words": "more than the controls"})
    assert checker.vague_magnitudes(executed)


def test_a_vague_magnitude_on_a_markdown_page_fails():
    assert checker.markdown_page_problems("The error grows by orders of magnitude.")
    assert checker.markdown_page_problems("The error grows 300-fold (orders of magnitude).") \
        == []


def test_a_pending_reader_find_is_not_reported_until_it_is_gone(monkeypatch):
    page = _code_and_prose("EPOCHS = 3", "It trains for `EPOCHS` epochs.")
    monkeypatch.setitem(checker.READER_FINDS_PENDING, "09_x", {"'EPOCHS'": "being rewritten"})
    assert checker.reader_finds("09_x", page) == []
    assert checker.reader_finds("09_y", page)
    rewritten = _code_and_prose("EPOCHS = 3", "It trains for 3 epochs.")
    assert checker.reader_finds("09_x", rewritten) == []  # an executed page is not held up
    assert checker.stale_reader_finds_pending("09_x", rewritten) == [
        "READER_FINDS_PENDING entry matches no problem of the page: \"'EPOCHS'\""]
    assert checker.stale_reader_finds_pending("09_x", page) == []


@pytest.mark.parametrize(("written", "rewritten"), [
    ('Every micro-batch is checked with nonfinite="skip_micro_batch".',
     'Every micro-batch is checked with `nonfinite="skip_micro_batch"`.'),
    ("| steps_per_execution | nonfinite=\u201dskip_micro_batch\u201d: paired |",
     '| steps_per_execution | `nonfinite="skip_micro_batch"`: paired |'),
    ("Run it with mode='graph' for long runs.", "Run it with `mode='graph'` for long runs."),
])
def test_a_keyword_argument_written_as_prose_fails_and_in_code_passes(written, rewritten):
    """Round-16 reader D7: a keyword argument with a quoted value outside a code span has its
    quotes turned curly on the page (a syntax error when pasted); in a code span it stays."""
    assert checker.keywords_in_prose(written), written
    assert checker.markdown_page_problems(written), written
    assert checker.page_problems("09_x", _page(written)), written
    assert checker.keywords_in_prose(rewritten) == [], rewritten
    assert checker.markdown_page_problems(rewritten) == [], rewritten
    assert checker.page_problems("09_x", _page(rewritten)) == [], rewritten
    assert checker.keywords_in_prose('A quote "as is" = "plain" in prose passes.') == []


def test_no_page_of_the_book_writes_a_keyword_argument_as_prose():
    """The book's Markdown pages, its notebooks' markdown and the benchmark page it includes
    (``benchmarks/READER.md``, a table row per line) hold no keyword argument outside code."""
    problems = [f"{path.relative_to(BOOK)}: {problem}" for path in sorted(BOOK.rglob("*.md"))
                for problem in checker.keywords_in_prose(_visible_markdown(path))]
    for path in sorted(BOOK.rglob("*.ipynb")):
        notebook = json.loads(path.read_text(encoding="utf-8"))
        problems += [f"{path.name}: {problem}" for cell in notebook["cells"]
                     if cell["cell_type"] == "markdown"
                     for problem in checker.keywords_in_prose("".join(cell["source"]))]
    reader = BOOK.parent / "benchmarks" / "READER.md"
    problems += [f"READER.md: {problem}"
                 for line in reader.read_text(encoding="utf-8").splitlines()
                 for problem in checker.keywords_in_prose(line)]
    assert not problems, "\n".join(problems)
