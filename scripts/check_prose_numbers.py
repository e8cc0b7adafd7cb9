"""Every number a notebook's prose quotes must be shown by that page's executed cells, and
every comparison word about a measurement must be computed.

The book's promise: each number in a sentence was printed (or glued: computed by a cell and
quoted with ``{glue:text}``) by the code above it, or is set in a visible code cell. This
check reads the executed notebooks of a book build (``_build/jupyter_execute/book/*.ipynb``)
and fails on a decimal number (``0.25``, ``1e-6``, ``97.5``) or a percentage (``45 %``) in a
markdown cell that nothing on the same page shows, unless ``ALLOWED`` lists it for that page
(definitions and constants: a rule's exponent, a worked exercise's arithmetic). Numbers
inside code spans, math, glue roles and link targets are not prose numbers.

The second rule: a comparison word about a measured result ("better", "faster", "a tie",
"costs more", "grew", ... : ``COMPARISONS``) must not be written into the prose, where it
would stay when a rebuild's numbers say otherwise; the page computes it from its numbers with
its own noise rule and glues it (``{glue:text}`fit_takeaway``` in chapter 7, the verdicts of
chapter 5's ``versus``), so the word is not in the markdown at all. A sentence that keeps such a
word is reported with its page, unless ``ALLOWED_COMPARISONS`` lists it for that page with why:
a definition, a statement of theory or of a constant, a result of another page, or a claim a
cell of the page asserts (the build then fails before the word could be wrong; the reason
quotes the assertion, and the check fails if no code cell of the page holds it). An entry that
matches no sentence fails too. Words inside code spans, math, glue and other roles and link
targets are not prose; the words live in the markdown, so ``tests/test_prose_numbers.py`` runs
this rule on the sources (``book/*.ipynb``) as well.

The third rule: the sentences of ``KNOWN_CONTRADICTIONS`` (each contradicted by its own page's
numbers when a reader found it, or machinery shown to readers) must not return, written or
glued. The Markdown pages (intro, API, appendix B, reference) are checked on their visible
text against the page-wide entries and ``MARKDOWN_MACHINERY`` (the project's CI, its test
commands, a run the reader cannot see: ``markdown_page_problems``), by
``tests/test_prose_numbers.py``.

The fourth rule: what only the build should see stays off the page: a code cell whose source
a reader can see (``source_seen``: a folded ``hide-input`` cell is seen, a ``remove-input`` or
``remove-cell`` one is not; the same rule for machinery and pragmas, while a number counts as
shown only in an unfolded source), or the output it shows,
that names build machinery (``MACHINERY``: "hidden cell", cell tags, the build's folders
and variables); a reference to a numbered section ("section 2", "sections 4
to 6") that no numbered heading of the page carries (another page's section, "chapter 7's
section 3", is not checked); and a value glued from a file rather than computed by the page's
code (``glued_from_files``: a glue whose value depends on something read with ``open``,
``json.load``, ``np.load`` or a function that reads a file), unless ``ALLOWED_FILE_GLUE``
lists it for that page with why; and a linter pragma (``PRAGMA``: ``noqa``, ``type: ignore``,
``pragma: no cover``, ``fmt: off``, ``yapf: disable``, ``pyre-ignore``, ...: a tool's
directive, not a comment about the tool) in a code cell readers see (``pragmas_shown``).
These read the sources too, so ``tests/test_prose_numbers.py`` runs them on ``book/*.ipynb``
without a build. The prose (markdown cells, and the Markdown pages
through ``markdown_page_problems``; not code, code spans or outputs, where Python's ``assert``
is at home) must not speak the tests' language: "asserted", "the assert(s)", "the cell asserts
that" (``ASSERT_WORDS``): it says what the page checks and shows.

The fifth rule: a glued number the prose quotes (``{glue:text}`key:fmt```, a value the page's
code computed) must also be printed by a visible output of the page, so that the reader sees
where it came from (a range quoted in a sentence and shown only in a figure was found by a
reader): ``unprinted_glue`` accepts a printed number that formats to the quoted text, or lies
within the rounding of a printed one (0.6 %). It needs the executed pages: the values are in
their outputs, or, in a Jupyter Book build (myst-nb removes glue outputs from the notebooks it
writes), in ``<page>.glue.json`` beside them (``read_executed``); a quoted key with no value
found either way fails (``unrecorded_glue``). ``GLUE_PRINT_PENDING`` lists pages that are being
rewritten.

The sixth rule reads the rendered pages (``--html``): no page may show a GitHub issue reference
(``owner/repo#123``, "issue #123"), an internal module path (``tensorflow.python.``,
``keras.src.``), a raw object repr (``<function f>``, ``<factory>``, ``object at 0x...``) or a
private name in a parameter list (``_errors (dict)``) or a linter pragma, and no page says
one sentence twice (``rendered_page_problems``).

The seventh rule reads the executed pages' glue (``executed_page_problems``): a glued value,
put in its sentence as readers see it, must not read as a degenerate or unfilled template
(``template_artefacts``: "all 2 epochs", "lower on 0", "0 of 2 seeds", "3 of 3", "1 seeds",
"0 times", a range ending at update 1 or at its own start, an empty string, braces, ``None``,
``nan``; only where the match touches a glued value); and sibling reordering controls
``CONTROL_SPREAD`` (100) times apart or more (glued as ``<name>_controls`` and quoted, or printed
after "reordering controls") need a glued explanation the prose quotes
(a ``*_controls_note`` that says a control jumped or diverged: ``unexplained_control_spread``).

The eighth rule holds what fresh readers found (``reader_finds``, on the sources and the
executed pages): a code constant's ALL_CAPS name, assigned by the page's code, in the prose
(``constant_names_in_prose``: readers get words and a value; a code span that sets it, a
fenced listing, environment variables and ``accumcore.__all__`` are not reported); a figure's
alt text or caption naming an element its code draws only under an ``if``
(``conditional_figure_elements``, a narrow heuristic: see there); and a vague magnitude
("orders of magnitude", "a hundredfold or more") in a sentence, written or glued, or a
caption, with no number in it (``vague_magnitudes``). ``READER_FINDS_PENDING`` lists the
problems of pages being rewritten; a stale entry fails the tests on the sources.

Usage: python scripts/check_prose_numbers.py [EXECUTED_DIR]   (exit 1 with one line per number
and one per uncomputed comparison); python scripts/check_prose_numbers.py --html HTML_DIR
"""

from __future__ import annotations

import ast
import html.parser
import json
import pathlib
import re
import sys

#: page (notebook stem) -> numbers its prose may quote without an output showing them, each
#: with why.
ALLOWED: dict[str, dict[str, str]] = {
    "07_memory_speed": {
        "95": "the confidence level of the paired ratios' interval (a definition)",
    },
    "03_model_fit": {
        "2,000": "exercise 1's question (a data size, not this page's)",
        "125": "exercise 1's worked arithmetic (2,000 / 16)",
    },
    "08_distributed_mixed_precision": {
        "60,000": "exercise 1's question (an epoch of all MNIST)",
        "1,875": "exercise 1's worked arithmetic (60,000 / 32)",
        "235": "exercise 1's worked arithmetic (1,875 / 8, rounded up)",
    },
    "05_lr_sweeps": {
        "0.5": "the square-root rule's exponent (a definition)",
        "1.5": "a learning rate to add to the grid (exercise 2)",
    },
}

_STRIP = [
    re.compile(r"\{glue:[a-z]+\}`[^`]*`"),  # glue roles (the value is computed)
    re.compile(r"\{[a-z]+\}`[^`]*`"),  # other roles ({doc}, {ref}, ...)
    re.compile(r"```.*?```", re.S),  # fenced blocks (code, admonitions are kept below)
    re.compile(r"`[^`]*`"),  # code spans
    re.compile(r"\$\$.*?\$\$", re.S),  # display math
    re.compile(r"\$[^$]*\$"),  # inline math
    re.compile(r"\]\([^)]*\)"),  # link targets
    re.compile(r"https?://\S+"),
]
_NUMBER = re.compile(r"(?<![\w.])(\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+|\d+(?= ?%))(?![\w])")


#: An admonition (an exercise's answer), its options line included: its body is prose.
_ADMONITION = re.compile(r"```\{admonition\}[^\n]*\n(?:[ \t]*:class:[^\n]*\n)?(.*?)```", re.S)


def prose(markdown: str) -> str:
    """The markdown without what is not prose (see the module docstring). Admonition bodies
    (exercise answers) are prose: their fences are unwrapped first."""
    text = _ADMONITION.sub(r"\1", markdown)
    for pattern in _STRIP:
        text = pattern.sub(" ", text)
    return text


#: Tags that keep a code cell's source off the page.
SOURCE_REMOVED = {"remove-cell", "remove-input"}
#: Tags that fold a code cell's source: on the page, shown only when a reader unfolds it.
SOURCE_FOLDED = {"hide-input"}


def source_seen(cell: dict, folded: bool = True) -> bool:
    """Whether a reader can see a code cell's source: not if ``remove-cell`` or
    ``remove-input`` (``SOURCE_REMOVED``) takes it off the page; a folded ``hide-input`` cell
    (``SOURCE_FOLDED``) counts as seen when ``folded`` is true.

    The one rule for every check that reads sources, with the one choice it leaves:
    ``folded=True`` for what must not be on the page at all (machinery, linter pragmas: a
    reader who unfolds the cell reads every line, so the book's folded setup cells and its
    QUICK switch are read and pass), ``folded=False`` for what must be shown to count (a number
    the prose quotes: one visible only on a click is not shown to a reader of the sentence).
    """
    tags = set(cell.get("metadata", {}).get("tags", []))
    hidden = SOURCE_REMOVED if folded else SOURCE_REMOVED | SOURCE_FOLDED
    return cell["cell_type"] == "code" and not tags & hidden


def shown(notebook: dict) -> str:
    """Every text an executed notebook shows or glues: streams, plain-text results, errors,
    and the source of its unfolded visible code cells (a constant set there is on the page;
    :func:`source_seen` with ``folded=False``)."""
    parts = []
    for cell in notebook["cells"]:
        if source_seen(cell, folded=False):
            parts.append("".join(cell["source"]))
        for output in cell.get("outputs", []):
            parts.append("".join(output.get("text", "")))
            for mime, value in output.get("data", {}).items():
                if "text" in mime or "record" in mime:
                    parts.append("".join(value) if isinstance(value, list) else str(value))
    return "\n".join(parts)


def variants(number: str) -> set[str]:
    """How an output may show ``number``: as written, and for a decimal without trailing
    zeros or rounded as Python's formats round it."""
    forms = {number}
    try:
        value = float(number)
    except ValueError:
        return forms
    if "e" not in number and "." in number:
        digits = len(number.split(".")[1])
        forms.add(f"{value:.{digits}f}")
    forms.add(f"{value:g}")
    return forms


#: A count a sentence quotes: an integer of three digits or more, or with thousands separators
#: ("168 samples", "5,120 images"; found unshown by a reader), not a year (1990-2039), a version,
#: an issue or a part of a larger token. Smaller integers (chapter numbers, "batch of 64") are
#: left to the reader.
_COUNT = re.compile(r"(?<![\w.,$^{#/-])(\d{1,3}(?:[, ]\d{3})+|\d{3,})(?![\w.]|[, ]\d)")
_YEAR = re.compile(r"(?:199|20[0-3])\d")


def _shows_count(count: str, outputs: str, bare: str) -> bool:
    """Whether ``outputs`` shows ``count`` (with or without its thousands separators)."""
    plain = count.replace(",", "").replace(" ", "")
    return count in outputs or bool(re.search(r"(?<!\d)" + plain + r"(?!\d)", bare))


#: A number written in math: ``$1.2 \\times 10^{-7}$`` or a power of two ``$2^{15}$`` (chapter
#: 1's float32 epsilon and chapter 6's loss scale were found so, shown by no output).
_MATH_SCIENTIFIC = re.compile(r"(\d+(?:\.\d+)?)\s*\\times\s*10\^\{?(-?\d+)\}?")
_MATH_POWER_OF_TWO = re.compile(r"(?<![\d.])2\^\{?(\d{2})\}?")
_MATH = re.compile(r"\$\$.*?\$\$|\$[^$]*\$", re.S)
#: A printed number within this relative distance shows a number written in math (which is
#: written rounded: "6 x 10^-5" for 6.1e-05).
MATH_ROUNDING = 0.05


def unshown_math_numbers(notebook: dict) -> list[str]:
    """The numbers written in the math of ``notebook``'s markdown (``_MATH_SCIENTIFIC``,
    ``_MATH_POWER_OF_TWO``) that no output or visible code of the page shows, as written."""
    outputs = shown(notebook)
    printed = [float(t.replace(",", "")) for t in _PRINTED_NUMBER.findall(outputs)]
    missing = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        for math in _MATH.findall(_ADMONITION.sub(r"\1", "".join(cell["source"]))):
            found = [(m.group(0), float(m.group(1)) * 10.0 ** int(m.group(2)))
                     for m in _MATH_SCIENTIFIC.finditer(math)]
            found += [(m.group(0), 2.0 ** int(m.group(1)))
                      for m in _MATH_POWER_OF_TWO.finditer(math)]
            for written, value in found:
                if not any(abs(p - value) <= MATH_ROUNDING * value for p in printed):
                    missing.append(written)
    return missing


def unshown_numbers(notebook: dict, allowed: dict[str, str]) -> list[str]:
    """The prose numbers of ``notebook`` that none of its outputs shows: decimals, percentages
    and counts (``_COUNT``), and numbers written in math (:func:`unshown_math_numbers`)."""
    outputs = shown(notebook)
    bare = re.sub(r"(?<=\d)[, _](?=\d{3}\b)", "", outputs)  # 5,120 / 24 576 / 30_000
    missing = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        text = prose("".join(cell["source"]))
        for number in _NUMBER.findall(text):
            if number in allowed or any(form in outputs for form in variants(number)):
                continue
            missing.append(number)
        for count in _COUNT.findall(text):
            if (count in allowed or _YEAR.fullmatch(count) or count in missing
                    or _shows_count(count, outputs, bare)):
                continue
            missing.append(count)
    return missing + [written for written in unshown_math_numbers(notebook)
                      if written not in allowed]


#: Comparison words about measured results (case-insensitive, whole words). A page computes
#: such a word from its numbers and its noise rule and glues it; written into the prose it is
#: reported, unless ``ALLOWED_COMPARISONS`` lists the sentence.
COMPARISONS = re.compile(r"\b(?:" + "|".join([
    r"better", r"worse", r"faster", r"slower", r"quicker", r"cheaper",
    r"ties?(?! threshold)", r"tied",  # a tie: a difference within the noise ("the tie
    # threshold" names the rule, not a verdict)
    r"costs?(?: \w+)? (?:more|less)",  # "costs more", "costs far more"
    r"grew", r"grows?", r"rose", r"rises?", r"fell", r"falls?(?! back)",  # not "falls back to"
    r"(?:larger|smaller|higher|lower|closer|farther|further) than",
    r"outperform\w*", r"beats?", r"beaten", r"wins?",
    r"improve[sd]?", r"match(?:es|ed)?", r"exceed(?:s|ed)?",
]) + r")\b", re.I)

#: page (notebook stem) -> {a fragment of a sentence, as written in the markdown: why its
#: comparison word is not computed}: a definition, theory, a constant, a result of another
#: page, or a claim the page asserts. Every entry must match a sentence with such a word (a
#: stale entry fails too); a reason with "asserted:" quotes the assertion in backticks, and
#: each quoted piece must be in a code cell of the page (the build fails before the word can be
#: wrong).
ALLOWED_COMPARISONS: dict[str, dict[str, str]] = {
    "08_distributed_mixed_precision": {
        "Exactly one window (its 128 samples) was skipped":
            "asserted: `assert c[\"windows_skipped\"] == 1`",
        "times fewer gradient transfers per sample": "theory: one all-reduce per window of K "
                                                     "micro-batches (the glued saving is K)",
    },
    "04_mnist_experiments": {
        "whose curves differ {glue:text}`test_gap_ratio` times more":
            "asserted: `assert far > 1e-2 and far > 10 * near`",
    },
    "01_eager_loop": {
        "It fell from": "asserted: `assert last < history.window_losses[0]`",
        "does exactly that in plain TensorFlow and matches": "asserted: `assert rel_20 <= 1e-4`",
    },
    "02_tf_function": {
        "whether that beats `function` depends": "states no result: the outcome depends on the "
                                                 "model and the hardware",
        "the weights match `train_on_batch` to float32": "asserted: `assert rel <= 1e-4`",
        "`window_step` matched `train_on_batch`": "asserted: `assert rel <= 1e-4`; "
                                                  "`assert rel_50 <= 1e-4`",
    },
    "05_lr_sweeps": {
        "a schedule that rises linearly": "defines the warm-up schedule",
        "in brackets the rates **tied** with it": "defines the table's brackets",
        "are a tie, not a winner and a loser": "defines the page's noise rule",
        "one tied rate per batch size": "defines the exponent's range",
        "with the budget, beyond ties:": "names the rule the glued list was computed with",
    },
    "06b_gaps": {  # rewritten by another change: these hold for its current sentences
        "the difference is larger than the dense update itself": "says what rel > 1 means (a "
            "definition); that both values exceed 1 is asserted only as > `BROKEN` (1e-2)",
    },
    "07_memory_speed": {
        "two more copies for Adam": "theory: Adam keeps two slots per weight",
        "an interval that contains 1 is a tie": "defines the page's noise rule",
    },
    "appendix_a_roundoff": {
        "amplify round-off faster": "theory: an exercise's answer about a run the page does "
                                    "not make",
    },
    "guide_alternatives": {
        "its memory does not grow with K (chapter 7)": "chapter 7's result, asserted there "
                                                       "(`accum_growth < 1.10`)",
    },
    "guide_cheatsheet": {
        "is reached exactly as": "asserted: `assert K * b == TARGET_BATCH`",
    },
    "guide_sample_weights": {
        "times further, because micro-batches with more total weight":
            "asserted: `gap_keras > 30 * max(gap_mw, control_mw)`",
        "a weight per class that grows with the digit": "defines the weights",
    },
    "masks_tokens": {
        "accumcore's default matches the large batch to":
            "asserted: `one_window[\"accumcore default\"] < EXACT`",
        "with `normalizer=valid_row_count` it matches it":
            "asserted: `hand_made[\"valid_row_count\"] < EXACT`",
    },
}

#: Comparison words that are comparisons only about a number: "below 1", "exactly as", "saved",
#: "more than" (positional "the table above" and "the function below" are not). A sentence that
#: quotes a measurement (holds a glued value) and uses one of them needs a computed verdict: a
#: glued phrase the page's code chose from its numbers (``VERDICT_GLUE``), or an entry of
#: ``ALLOWED_COMPARISONS`` saying why not (asserted, a definition, theory).
MEASURED_COMPARISONS = re.compile(
    r"\b(?:(?:below|above|under)(?= \d|\s*\0)|exactly|saved?|saves|cheaper"
    r"|(?:more|less|fewer)(?: than)?)\b", re.I)
#: A glued verdict: a value whose key names it as words chosen by the page's code.
VERDICT_GLUE = re.compile(r"\{glue:text\}`\w*(?:_words|_verdict|_takeaway|_answer|_summary)\b")


#: What is kept whole when prose is cut into sentences and left out of the word search.
_PROTECTED = [pattern for pattern in _STRIP if "```" not in pattern.pattern]
_SENTENCE_END = re.compile(
    r"\n\s*\n"  # a paragraph
    r"|\n(?=\s*(?:[*+-] |\d+\. |#|\|))"  # a list item, a heading, a table row
    r"|(?<=[.!?])(?<!e\.g\.)(?<!i\.e\.)(?<!\bvs\.)(?<!\bcf\.)\s+"  # a full stop, not "e.g."
)


def sentences(markdown: str) -> list[tuple[str, str]]:
    """The sentences of a markdown cell, each as (as written, its prose): the first with
    whitespace collapsed, the second without code, math, roles and link targets."""
    text = re.sub(r"```.*?```", "\n\n", _ADMONITION.sub(r"\1", markdown), flags=re.S)
    kept: list[str] = []

    def keep(match: re.Match) -> str:
        kept.append(match.group(0))
        return f"\0{len(kept) - 1}\0"

    for pattern in _PROTECTED:
        text = pattern.sub(keep, text)
    found = []
    for piece in _SENTENCE_END.split(text):
        words = " ".join(re.sub(r"\0\d+\0", " ", piece).split())
        if words:
            written = re.sub(r"\0(\d+)\0", lambda m: kept[int(m.group(1))], piece)
            found.append((" ".join(written.split()), words))
    return found


def uncomputed_comparisons(notebook: dict, allowed: dict[str, str]) -> list[str]:
    """The comparison words written (not glued) in ``notebook``'s prose, one line each
    (``'word' in: sentence``), and the problems of its ``allowed`` entries."""
    code = "\n".join("".join(cell["source"]) for cell in notebook["cells"]
                     if cell["cell_type"] == "code")
    problems, used = [], set()
    for cell in notebook["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        for written, words in sentences("".join(cell["source"])):
            found = [m.group(0) for m in COMPARISONS.finditer(words)]
            if "{glue:" in written and not VERDICT_GLUE.search(written):
                found += [m.group(0) for m in MEASURED_COMPARISONS.finditer(
                    re.sub(r"\{glue:[a-z]+\}`[^`]*`", "\0", written))]
            if not found:
                continue
            entries = [fragment for fragment in allowed if " ".join(fragment.split()) in written]
            if entries:
                used.update(entries)
                continue
            problems.append(f"{', '.join(repr(w) for w in found)} in: {written}")
    for fragment, reason in allowed.items():
        if fragment not in used:
            problems.append(f"allowed comparison matches no sentence: {fragment!r}")
        for assertion in re.findall(r"`([^`]+)`", reason) if "asserted:" in reason else []:
            if assertion not in code:
                problems.append(f"allowed comparison {fragment!r}: no code cell holds "
                                f"{assertion!r}")
    return problems


#: What no page may show, in its sources (``KNOWN_CONTRADICTIONS["*"]``) or built
#: (``RENDERED``): regular expression, case-insensitive -> why.
NEVER_SHOWN: dict[str, str] = {
    r"(?<![\w/.-])[\w-]+/[\w.-]+#\d+\b|\b(?:issue|pr|pull request) #?\d+\b"
    r"|github\.com/[\w.-]+/[\w.-]+/(?:issues|pull)/\d+":
        "a GitHub issue reference: say what the limitation is",
    r"\btensorflow\.python\.|\bkeras\.src\.|\baccumcore[./]_impl\b":
        "an internal module path (readers import `tf.`, `keras.` and `accumcore.` names)",
    r"\bthis build\b|\bbuild machine\b|\bthe build['’]s (?:device|machine)\b":
        "the book's build named to readers: say what ran (a CPU without internet access)",
}


#: Sentences a reader of the full edition found contradicted by the numbers printed on their
#: own page, or machinery shown to readers (issue 42): page (notebook stem, or "*" for every
#: page) -> {regular expression, case-insensitive, over the page's prose with whitespace
#: collapsed, glued text included: what was wrong}. Each was rewritten so that its verdict is
#: computed; the build fails if one returns, by hand or from a glue cell.
KNOWN_CONTRADICTIONS: dict[str, dict[str, str]] = {
    "02_tf_function": {
        r"why does the first epoch of `?function`? and `?graph`? take longer":
            "its own table showed graph's first epoch shorter than its last (4.69 s, 5.19 s)",
    },
    "07_memory_speed": {
        r"every bar is below 1": "a bar (conv, b = 64, K = 8) stood above 1, and takeaway 2 "
                                 "quoted 0.43 to 1.03 x",
        r"one batch of b is faster than k micro-batches": "takeaway 2 said splitting B does "
                                                          "not always cost throughput",
        r"fit costs more than keras's own accumulation":
            "beside 'every cell within the repeats' spread of 1, a tie'",
        r"every cell within the repeats' spread of 1, a tie": "beside a takeaway saying "
                                                              "accumcore's fit costs more",
        r"run of \d{4}-\d\d-\d\d|load average": "run metadata: RESULTS.md keeps it",
    },
    "guide_alternatives": {
        r"saved little or no memory \(\d+ % more\)": "it used more memory than float32 "
                                                      "(78.2 against 59.3 MiB)",
    },
    "appendix_a_roundoff": {
        r"exactly in the only sense float32 allows, \*?within a factor":
            "said 'exactly' under a printed {'raw 0-255': False, ...} for 'inside the range "
            "of the controls'",
        r"so it drifts as the controls do": "exercise 1's answer, under a printed "
                                            "{'raw 0-255': False, ...}: accumcore had ended "
                                            "outside the controls' range on raw pixels",
    },
    "04_mnist_experiments": {
        r"reference updates away": "a whole run's rel (in units of batch 64's whole change) "
                                   "read as a count of updates",
        r"of one window\)": "compared the whole run's 1.3e-02 with one window's ~1e-6 "
                            "('about 13,000 times'); the page compares it with reordering "
                            "controls over the same run",
    },
    "06_pitfalls": {
        r"large-batch updates away": "rel over problems of up to 9 windows, in units of their "
                                     "whole change, read as 'large-batch updates' (0.18 to "
                                     "3.39)",
    },
    "08_distributed_mixed_precision": {
        r"accumulation itself adds nothing visible": "no float16 control on the page: the "
                                                     "reordering controls are shown now",
    },
    "03b_fine_tuning": {
        r"on a t4 the activations are what runs out of memory":
            "nothing measured it: the model that ran had 91,008 parameters, on a CPU",
        r"generate\(\): '[^']*\ufffd": "bytes decoded as text (replacement characters)",
    },
    "05_lr_sweeps": {
        r"nats: float round-off": "after 96 updates, with no control run on the page",
        r"within the factor of 10 that round-off amplified by training spans":
            "one control and no band shown: the page runs three and compares with their range",
        r"(-?\d\.\d\d) to \1 over the ties": "a range of one value, as a template writes it",
    },
    "01_eager_loop": {
        r"keras's download failed|came from a local copy": "the build's data source, shown to "
                                                            "readers",
    },
    "guide_resume": {r"counting from 0": "epochs are counted from 1 for readers"},
    "*": {
        **NEVER_SHOWN,
        r"at the end of epoch 0\b|in epoch 0\b": "an epoch counted from 0 shown to readers",
        r"tested in `?tests/": "a test citation on a reader's page (CONTRIBUTING keeps them)",
        r"\ba test (?:holds|measures|asserts|checks)\b|\bthe tests (?:inject|crash|assert|"
        r"check)\w*": "cites a test instead of showing the fact (a reference page states it, a "
                      "chapter computes it)",
        r"\bscripts/[\w-]+\.(?:py|sh)\b|\.ci/run\b": "the project's build scripts named to "
                                                        "readers",
        r"(?<![\d.])1(?:\.0+)? times (?:the|as)\b": "a ratio rounded to 1 said as '1 times the "
                                                 "smaller' (chapter 4): say what it means",
        r"\bsupported until\b": "a support promise (the versions page listed one under 'Not "
                                "supported')",
        r"\b(?:library|book|project)['’]s (?:own )?tests\b"
        r"|\b(?:library|book|project)['’]s test (?:suite|command)\b":
            "defers to the tests instead of showing: the page shows the fact with a computation, "
            "or drops it",
        r"\btested (?:on|with) (?:CPU|GPU|an?\b|\d|`)": "where the project tested a row ('tested "
                                                       "on CPU'), instead of what the library "
                                                       "does",
        r"\btests/\w+\.py\b": "a test file named to readers",
        r"`_(?!_)[a-z]\w*`": "a private name (Keras's `_maybe_symbolic_build`, a dataclass's "
                            "`_errors`): readers cannot call it",
        r"times the ~?\S+ of one (?:window|update)\b": "a whole run's distance measured in "
                                                      "one window's round-off (chapter 4's "
                                                      "'13,000 times the ~10^-6 of one "
                                                      "window'): compare it with a control "
                                                      "run of the same length",
    },
}


#: What a Markdown page (the intro, the API page, appendix B, the reference pages) must not say
#: beyond ``KNOWN_CONTRADICTIONS["*"]``: these pages state what the library does, so the
#: project's CI, its benchmark run and its development are not theirs to report.
MARKDOWN_MACHINERY: dict[str, str] = {
    r"(?-i:\bCI\b)": "the project's CI named on a page that states what the library does",
    r"\bcommitted run\b|\bduring development\b|\bwhile sizing\b": "a run the reader cannot "
                                                                   "see",
    r"\(for tests\b|\bthe benchmark smoke test\b": "the project's tests as a reason",
    r"--dry-run\b|--nbval\b|\bpytest\b": "the project's test commands",
}


def markdown_page_problems(markdown: str) -> list[str]:
    """The page-wide ``KNOWN_CONTRADICTIONS``, ``MARKDOWN_MACHINERY``, ``ASSERT_WORDS`` and
    vague magnitudes with no number (:func:`vague_magnitudes`) found in a Markdown page's
    visible text (its MyST ``%`` comments removed by the caller), one line each."""
    page = {"cells": [{"cell_type": "markdown", "source": markdown}]}
    text = page_text(page, outputs=False)
    return known_contradictions("*", page, outputs=False) + [
        f"machinery on a Markdown page: {match.group(0)!r} ({why})"
        for pattern, why in MARKDOWN_MACHINERY.items()
        for match in [re.search(pattern, text, re.I)] if match] + assert_words(markdown) + (
        keywords_in_prose(markdown) + vague_magnitudes(page))


def page_text(notebook: dict, outputs: bool = True) -> str:
    """The page as a reader sees it, whitespace collapsed: its markdown, and (``outputs``) the
    text its code cells print and glue (a removed cell's glue records too: the prose shows
    them), but not the other outputs the page removes (``OUTPUT_HIDDEN``, and stderr under
    ``remove-stderr``)."""
    parts = []
    for cell in notebook["cells"]:
        tags = set(cell.get("metadata", {}).get("tags", []))
        if cell["cell_type"] == "markdown":
            parts.append("".join(cell["source"]))
            continue
        for output in cell.get("outputs", []) if outputs else []:
            if _shown(output, tags) or "scrapbook" in output.get("metadata", {}):
                parts.append(_output_text(output))
    return " ".join(" ".join(parts).split())


def _shown(output: dict, tags: set[str]) -> bool:
    """Whether a code cell's output (its cell tagged ``tags``) is on the built page."""
    if OUTPUT_HIDDEN & tags:
        return False
    return not ("remove-stderr" in tags and output.get("name") == "stderr")


def _output_text(output: dict) -> str:
    """An output's printed text, plain-text value and glued plain text, joined."""
    text = output.get("text") or ""
    data = output.get("data", {})
    text += "".join(data.get("text/plain", "")) + "".join(
        data.get("application/papermill.record/text/plain", ""))
    return text if isinstance(text, str) else "".join(text)


def known_contradictions(stem: str, notebook: dict, outputs: bool = True) -> list[str]:
    """The entries of ``KNOWN_CONTRADICTIONS`` (for ``stem`` and for every page) found on the
    page, one line each: what returned and why it was wrong."""
    text = page_text(notebook, outputs)
    entries = {**KNOWN_CONTRADICTIONS.get("*", {}), **KNOWN_CONTRADICTIONS.get(stem, {})}
    return [f"known contradiction returned: {match.group(0)!r} ({why})"
            for pattern, why in entries.items()
            for match in [re.search(pattern, text, re.I)] if match]


# ---------------------------------------------------------------------------- machinery
#: Build machinery a reader must not see in a visible code cell or its output.
MACHINERY = re.compile(
    r"hidden cell|\b(?:remove-(?:cell|input|output|stderr)|hide-input)\b"
    r"|ACCUMCORE_BOOK_BUILD|jupyter_execute|\b_build/", re.I)
#: Tags that keep a cell's output off the page.
OUTPUT_HIDDEN = {"remove-cell", "remove-output"}
def machinery_shown(notebook: dict) -> list[str]:
    """The lines of code cells a reader can see (:func:`source_seen`), and of the outputs the
    page shows, that name build machinery (``MACHINERY``), one problem each."""
    problems = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        tags = set(cell.get("metadata", {}).get("tags", []))
        texts = ["".join(cell["source"])] if source_seen(cell) else []
        if not tags & OUTPUT_HIDDEN:
            texts += ["".join(output.get("text", "")) for output in cell.get("outputs", [])]
        problems += [f"machinery shown: {line.strip()!r}" for text in texts
                     for line in text.splitlines() if MACHINERY.search(line)]
    return problems


#: A linter's pragma in a code line's comment: ``noqa``, ``type: ignore``, ``pragma: no cover``,
#: ``fmt: off``, ``pylint: disable=``, ``ruff: noqa``, ``isort: skip``, ``mypy: ignore-errors``,
#: ``pyright: ignore``, ``yapf: disable``, ``pyre-ignore``/``pyre-fixme``, ``pytype:
#: disable=``, ``nosec``: the project's tooling, not the lesson. Each tool's name counts only
#: with one of its directives after it, so that a comment about the tool ("# ruff: the linter
#: the project uses") is a comment.
PRAGMA = re.compile(
    r"#\s*(?:noqa\b|type:\s*ignore\b|pragma:\s*no\s*(?:cover|branch)\b"
    r"|(?:fmt|yapf):\s*(?:on|off|skip|disable|enable)\b"
    r"|(?:pylint|pytype):\s*(?:disable|enable|skip-file)\b"
    r"|(?:ruff|flake8):\s*noqa\b|isort:\s*(?:skip|skip_file|off|on)\b"
    r"|mypy:\s*(?:ignore-errors\b|(?:disable|enable)-error-code\b|strict\b|[\w-]+\s*=)"
    r"|pyright:\s*(?:ignore\b|basic\b|strict\b|standard\b|report\w+\s*=)"
    r"|pyre-(?:ignore|fixme|strict|unsafe)\b|nosec\b)", re.I)


def pragmas_shown(notebook: dict) -> list[str]:
    """The lines of code cells a reader can see (:func:`source_seen`: unfolded ``hide-input``
    cells included) that carry a linter pragma (``PRAGMA``), one problem each."""
    return [f"machinery shown: a linter pragma in code readers see: {line.strip()!r}"
            for cell in notebook["cells"] if source_seen(cell)
            for line in "".join(cell["source"]).splitlines() if PRAGMA.search(line)]


_SECTION_REFERENCE = re.compile(
    r"(?<!'s )\bsections? (\d+(?:(?:,| and| to|-) ?\d+)*)", re.I)
_NUMBERED_HEADING = re.compile(r"^#{2,4} (\d+)\.", re.M)
#: A bare section number of another part ("B.2", "A.3"): a label the reader cannot follow.
_BARE_SECTION_NUMBER = re.compile(r"(?<![\w.])[A-Z]\.\d+(?![\w.])")


def missing_sections(notebook: dict) -> list[str]:
    """The references to a numbered section of this page ("section 2", "sections 4 to 6") whose
    number no heading of the page carries, and bare section numbers of another part ("B.2"),
    one problem each with its sentence."""
    markdown = ["".join(cell["source"]) for cell in notebook["cells"]
                if cell["cell_type"] == "markdown"]
    numbers = {int(n) for text in markdown for n in _NUMBERED_HEADING.findall(text)}
    problems = []
    for text in markdown:
        for written, words in sentences(text):
            for match in _SECTION_REFERENCE.finditer(words):
                cited: set[int] = set()
                for first, last in re.findall(r"(\d+)(?: to |-)(\d+)", match.group(1)):
                    cited.update(range(int(first), int(last) + 1))
                cited.update(int(n) for n in re.findall(r"\d+", match.group(1)))
                problems += [f"section {n} cited, no heading '{n}.' on the page: {written}"
                             for n in sorted(cited - numbers)]
            problems += [f"bare section number '{label}' (name the section in words, or "
                         f"link it): {written}"
                         for label in _BARE_SECTION_NUMBER.findall(words)]
    return problems


#: Calls that read a file: a value computed from their result came from the file.
FILE_READERS = {"open", "load", "loads", "read_text", "read_bytes", "read_csv", "read_json",
                "urlopen"}
#: page (notebook stem) -> {glue name: why it may be glued from a file}.
ALLOWED_FILE_GLUE: dict[str, dict[str, str]] = {}


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def _reads(node: ast.AST, readers: set[str], tainted: set[str]) -> bool:
    """Whether ``node`` calls a reader or uses a name computed from one."""
    return any(
        (isinstance(sub, ast.Call) and _called_name(sub) in readers)
        or (isinstance(sub, ast.Name) and sub.id in tainted)
        for sub in ast.walk(node))


def _trees(notebook: dict) -> list[ast.Module]:
    trees = []
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            try:
                trees.append(ast.parse("".join(cell["source"])))
            except SyntaxError:  # a cell magic: not Python
                continue
    return trees


def glued_from_files(notebook: dict, allowed: dict[str, str]) -> list[str]:
    """The glue calls whose value depends on a file read (``FILE_READERS``, a function of the
    page that calls one, or a name assigned from either), one problem each, unless
    ``allowed`` names the glue; and the entries of ``allowed`` that match no such glue."""
    trees = _trees(notebook)
    readers, tainted = set(FILE_READERS), set()
    changed = True
    while changed:  # to a fixed point: a reader's result read by another name, and so on
        size = len(readers) + len(tainted)
        for node in (n for tree in trees for n in ast.walk(tree)):
            if isinstance(node, ast.FunctionDef) and _reads(node, readers, tainted):
                readers.add(node.name)
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For))
                       else [])
            value = node.iter if isinstance(node, ast.For) else getattr(node, "value", None)
            if targets and value is not None and _reads(value, readers, tainted):
                tainted.update(name.id for target in targets for name in ast.walk(target)
                               if isinstance(name, ast.Name))
        changed = len(readers) + len(tainted) > size
    problems, used = [], set()
    for node in (n for tree in trees for n in ast.walk(tree)):
        if not (isinstance(node, ast.Call) and _called_name(node) == "glue" and node.args):
            continue
        key = node.args[0].value if isinstance(node.args[0], ast.Constant) else "?"
        if any(_reads(arg, readers, tainted) for arg in node.args[1:]):
            if key in allowed:
                used.add(key)
            else:
                problems.append(f"glued from a file, not computed on the page: {key!r}")
    problems += [f"allowed file glue matches no glue from a file: {key!r}"
                 for key in allowed if key not in used]
    return problems


#: Pages still built on a committed file, each with the change that moves its numbers onto the
#: page: their glues from files are not reported, and the entry fails once none is left.
FILE_GLUE_PENDING: dict[str, str] = {}


# ---------------------------------------------------------------------------- glued numbers
#: myst-nb's (and papermill's) prefix of a glued value's hidden display keys.
GLUE_PREFIX = "application/papermill.record/"
_GLUE_ROLE = re.compile(r"\{glue:text\}`(\w+)(?::([^`]*))?`")
_PRINTED_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?", re.I)
#: A printed number within this relative distance of a glued one shows it (a value printed
#: with 3 digits and glued with 2, or rounded twice).
PRINTED_ROUNDING = 6e-3


def glue_records(notebook: dict) -> dict[str, tuple[object, str]]:
    """The values an executed page glued, by key, each as (value, text): the one reader of the
    glue records (``GLUE_PREFIX``) every rule uses. Glued Markdown (quoted with ``{glue:md}``)
    is its Markdown both times; any other value is its repr read back (``None`` when it cannot
    be: an object's repr), and its text is what ``{glue:text}`` shows: a string without its
    quotes, anything else its repr (``None``, ``nan``)."""
    records = {}
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []):
            name = output.get("metadata", {}).get("scrapbook", {}).get("name")
            data = output.get("data", {})
            markdown, plain = (data.get(GLUE_PREFIX + "text/markdown"),
                               data.get(GLUE_PREFIX + "text/plain"))
            if not name or (markdown is None and plain is None):
                continue
            if markdown is not None:
                records[name] = ("".join(markdown),) * 2
                continue
            raw = "".join(plain)
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = None
            records[name] = (value, value if isinstance(value, str) else raw)
    return records


def _glued_values(notebook: dict) -> dict[str, object]:
    """The values an executed page glued, by key (:func:`glue_records`)."""
    return {key: value for key, (value, _) in glue_records(notebook).items()}


def _printed(notebook: dict) -> str:
    """What a page's visible code cells print (glue records excluded) and their unfolded
    sources (:func:`source_seen` with ``folded=False``)."""
    parts = []
    for cell in notebook["cells"]:
        tags = set(cell.get("metadata", {}).get("tags", []))
        if cell["cell_type"] != "code" or "remove-cell" in tags:
            continue
        if source_seen(cell, folded=False):
            parts.append("".join(cell["source"]))
        if tags & OUTPUT_HIDDEN:
            continue
        for output in cell.get("outputs", []):
            if output.get("metadata", {}).get("scrapbook"):
                continue
            parts.append("".join(output.get("text", "")))
            parts.append("".join(output.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def _shows(printed_numbers: list[str], value: float, quoted: str, fmt: str) -> bool:
    for token in printed_numbers:
        number = float(token.replace(",", ""))
        try:
            if format(number, fmt) == quoted:
                return True
        except ValueError:
            pass
        if value and abs(number - value) <= PRINTED_ROUNDING * abs(value):
            return True
    return False


def unprinted_glue(notebook: dict) -> list[str]:
    """The glued numbers an executed page's prose quotes that no visible output prints, one
    problem each (``key = the quoted text``)."""
    values, printed = _glued_values(notebook), _printed(notebook)
    numbers = _PRINTED_NUMBER.findall(printed)
    problems = []
    for key, fmt in quoted_glue(notebook, _GLUE_ROLE):
        value = values.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        quoted = format(value, fmt)
        if not (quoted in printed or _shows(numbers, value, quoted, fmt)):
            problems.append(f"glued number printed by no output: {key} = {quoted}")
    return list(dict.fromkeys(problems))


def quoted_glue(notebook: dict, role: re.Pattern) -> list:
    """Every match of ``role`` (a glue role's pattern) in the page's Markdown cells, in order:
    the glued values its prose quotes."""
    return [match for cell in notebook["cells"] if cell["cell_type"] == "markdown"
            for match in role.findall("".join(cell["source"]))]


#: Pages whose glued numbers are not all printed yet, each with the change that prints them:
#: their problems are not reported, and the entry fails once the page has none.
GLUE_PRINT_PENDING: dict[str, str] = {}


def markup_in_glue(notebook: dict) -> list[str]:
    """Glued text that holds Markdown markup (a backtick): ``{glue:text}`` inserts it as plain
    text, so readers see the backticks (chapter 7's "fastest" answer, 3b's b, found so)."""
    problems = []
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []):
            name = output.get("metadata", {}).get("scrapbook", {}).get("name")
            value = "".join(output.get("data", {}).get(
                "application/papermill.record/text/plain", ""))
            if name and "`" in value:
                problems.append(f"glued text {name!r} holds markup readers see as is: {value}")
    return problems


def executed_page_problems(stem: str, notebook: dict) -> list[str]:
    """The problems only an executed page shows: glued numbers that no output prints, glued
    text with markup in it or read as a degenerate template, sibling reordering controls far
    apart with no explanation."""
    problems = (unprinted_glue(notebook) + unprinted_markdown_glue(notebook)
                + markup_in_glue(notebook))
    if stem in GLUE_PRINT_PENDING:
        problems = [] if problems else [
            "GLUE_PRINT_PENDING lists the page, but it prints every glued number now"]
    return problems + template_artefacts(notebook) + unexplained_control_spread(notebook)


def with_build_glue(notebook: dict, glue: dict) -> dict:
    """``notebook`` with the glue records of a Jupyter Book build put back.

    myst-nb takes every glue output out of the executed notebook it writes to
    ``_build/jupyter_execute`` (and drops the ``remove-cell`` cells that made them); it keeps
    the values beside it, in ``<page>.glue.json`` (key -> the output, its mime prefix removed).
    This adds them back as one removed cell of records, as the kernel wrote them, so that the
    rules reading glue records (unprinted glue, markup in glue, glued known contradictions)
    see a build's values.
    """
    records = []
    for key, output in glue.items():
        data = {GLUE_PREFIX + mime: value for mime, value in output.get("data", {}).items()}
        records.append({"output_type": "display_data", "data": data,
                        "metadata": {"scrapbook": {"name": key, "mime_prefix": GLUE_PREFIX}}})
    cell = {"cell_type": "code", "source": "", "metadata": {"tags": ["remove-cell"]},
            "outputs": records}
    return {**notebook, "cells": [*notebook["cells"], cell]}


_GLUE_MD_ROLE = re.compile(r"\{glue:md\}`(\w+)`")


def unprinted_markdown_glue(notebook: dict) -> list[str]:
    """The numbers inside glued Markdown (``{glue:md}`key```) that no visible output of the
    page prints, one problem each (``key: number``)."""
    values, printed = _glued_values(notebook), _printed(notebook)
    numbers = _PRINTED_NUMBER.findall(printed)
    problems = []
    for key in quoted_glue(notebook, _GLUE_MD_ROLE):
        value = values.get(key)
        for token in _PRINTED_NUMBER.findall(value) if isinstance(value, str) else []:
            number = float(token.replace(",", ""))
            if not (token in numbers or _shows(numbers, number, token, "")):
                problems.append(f"number in glued Markdown printed by no output: {key}: {token}")
    return list(dict.fromkeys(problems))


def unrecorded_glue(notebook: dict) -> list[str]:
    """The glue keys an executed page's prose quotes with no value recorded for the check (in
    its outputs or in the build's ``.glue.json``): the check cannot see what such a key
    shows, so it fails rather than pass blind."""
    recorded = set(_glued_values(notebook))
    return list(dict.fromkeys(
        f"glue {key!r} quoted, but no value of it recorded for this check"
        for key, _ in quoted_glue(notebook, _GLUE_ROLE) if key not in recorded))


# ---------------------------------------------------------------------------- glued templates
#: Nouns a page counts: after "1" they take the singular ("1 runs" is a template's plural).
_COUNTED = (r"(?:runs|seeds|updates|windows|epochs|steps|times|samples|batches|micro-batches"
            r"|controls|rates|points|bars|cases|replicas|devices|images|rows|tokens|repeats"
            r"|rounds|sizes|layers|weights|digits|pages|seconds|minutes|hours|parameters"
            r"|labels|classes|sequences|examples|iterations|checkpoints|columns)")
#: Words before "on 0" / "in 0" that make the 0 a count ("lower on 0", "tied in 0"); "centred
#: on 0" and "set to 0" are a value.
_COUNTING = (r"(?:higher|lower|better|worse|faster|slower|larger|smaller|tied|ties|won|wins"
             r"|lost|loses|diverged|failed|passed|ahead|behind|exact|equal|above|below)")
#: Position nouns: "epoch 5 of 5" (or "Epoch 5 of 5", a sentence's first word) is the last
#: epoch, not a template's "3 of 3".
_POSITIONS = ("epoch", "update", "step", "window", "batch", "page", "part", "round", "seed",
              "run", "chapter", "row", "column", "figure", "exercise", "cell")
#: What may come right before a clause's first word: ``None`` at the sentence's start or after
#: one of these may be the word ("None diverged", "Seeds: None of them trained").
_CLAUSE_START = "\\s:;(\"\u201c\u2014\u2013*>#-"
#: ``None`` as a word: at a clause's start, before "of" or a lowercase word that is no counted
#: noun (``_COUNTED``, "times" included), "and" or "or" ("None diverged", "None of the rates").
#: Anywhere else ("after None updates", "lr=None"), or before a counted noun ("None times the
#: control"), it is Python's.
_NONE = (rf"(?<=[^{_CLAUSE_START}] )None\b|(?<=[=<>/\[{{,])None\b"
         r"|\bNone\b(?! (?:of\b|(?!(?:and|or)\b|" + _COUNTED + r"\b)[a-z]{2,}))")
#: What glued text shows when a template was filled with a degenerate value, or not at all:
#: regular expression (case-sensitive: "NaN" and "None of" are words; a sentence's first word
#: is capitalised, so "All 2", "Epoch 5 of 5" and "Up to update 1" are read as their lowercase
#: forms) -> why. Matched on the page's sentences with the glued values in place, math
#: (``$$...$$`` first, then ``$...$``) blanked out (a LaTeX brace is no format field), and
#: reported only where the match touches a glued value (a written sentence is the author's
#: own). A pattern with the groups ``lo`` and ``hi`` is a
#: range, reported only when the two are the same number ("0.10 to 0.1"); its ``hi`` is
#: read in a lookahead, so that one range's end may start the next ("0.1 to 0.2 to 0.2").
TEMPLATE_ARTEFACTS: dict[str, str] = {
    r"\{(?![a-z][\w:-]*\}`)|(?<![a-z])\}(?!`)":  # a MyST role in glued Markdown is no field
        "a brace: a format field left unfilled",
    _NONE: "Python's None where a value or a word belongs",
    r"(?<![\w.])-?(?:nan|inf)(?!\w|\.\d)": "a float that is no number (nan, inf)",
    r"(?<![\w.,+-])0(?:\.0+)? times\b": "'0 times': say what it means (never, none, equal)",
    r"\b" + _COUNTING + r" (?:on|in) 0(?=[,;:)]|\.(?!\d)|$| and\b| or\b)"
    r"|(?<![\w.,+-])0 of \d|(?<![\w.,+-])0 " + _COUNTED + r"\b":
        "a count of zero ('lower on 0', '0 of 3 seeds', 'on 0 seeds'): say 'none' or leave "
        "the clause out",
    r"(?<![\w.,+-])1 " + _COUNTED + r"\b": "one with a plural noun ('1 runs', '1 seconds')",
    r"\b[Aa]ll [012](?!\w|[.,]\d)": "'all 2' is 'both' ('all 1', 'all 0' are no 'all')",
    "".join(f"(?<!{form} )" for noun in _POSITIONS for form in (noun, noun.capitalize()))
    + r"(?<![\w.,+-])(\d+) of \1(?!\w|[.,]\d)": "'3 of 3': say 'all 3' or 'every'",
    r"\b(?:[Uu]p to|[Tt]hrough|[Uu]ntil|(?:[Oo]ver|[Ff]or|[Ii]n) the first) "
    r"(?:update|window|epoch|step|seed|batch)(?:es|s)? 1(?!\w|[.,]\d)":
        "a range that ends at 1 ('up to update 1'): say what happened at 1",
    r"(?<![\w.+-])(?P<lo>[-+]?\d+(?:[.,]\d+)*(?:e[-+]?\d+)?) to "
    r"(?=(?P<hi>[-+]?\d+(?:[.,]\d+)*(?:e[-+]?\d+)?)(?!\w|[.,]\d))":
        "a range from a value to itself",
}
_GLUE_ANY_ROLE = re.compile(r"\{glue:(?:text|md)\}`(\w+)(?::([^`]*))?`")


def glued_texts(notebook: dict) -> dict[str, str]:
    """The text each glued value shows where the prose quotes it (:func:`glue_records`)."""
    return {key: text for key, (_, text) in glue_records(notebook).items()}


def _filled(written: str, texts: dict[str, str], values: dict) -> tuple[str, list]:
    """``written`` (a sentence) with each quoted glue replaced by what it shows, and the
    (start, end, key) spans of the glued values in the result (a number in its format)."""
    filled, spans, at = [], [], 0
    for match in _GLUE_ANY_ROLE.finditer(written):
        key, fmt = match.group(1), match.group(2)
        text, value = texts.get(key, ""), values.get(key)
        if fmt and isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                text = format(value, fmt)
            except ValueError:
                pass
        filled.append(written[at:match.start()])
        start = sum(len(part) for part in filled)
        filled.append(text)
        spans.append((start, start + len(text), key))
        at = match.end()
    filled.append(written[at:])
    return "".join(filled), spans


def _same_number(lo: str, hi: str) -> bool:
    """Whether two written numbers ("0.10", "+0.1", "1,000") are the same value."""
    try:
        return float(lo.replace(",", "")) == float(hi.replace(",", ""))
    except ValueError:
        return lo == hi


def template_artefacts(notebook: dict) -> list[str]:
    """Glued text the prose quotes that reads as an unfilled or degenerate template
    (``TEMPLATE_ARTEFACTS``; an empty glued string too), one problem each with the sentence
    as readers see it."""
    records = glue_records(notebook)
    texts = {key: text for key, (_, text) in records.items()}
    values = {key: value for key, (value, _) in records.items()}
    problems = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        for written, _ in sentences("".join(cell["source"])):
            filled, spans = _filled(written, texts, values)
            problems += [f"glued text {key!r} is empty: {written}" for _, _, key in spans
                         if key in texts and not texts[key].strip()]
            blanked = _MATH.sub(lambda m: " " * len(m.group(0)), filled)  # $$...$$ first
            for pattern, why in TEMPLATE_ARTEFACTS.items():
                for match in re.finditer(pattern, blanked):
                    groups = match.groupdict()
                    if "lo" in groups and not _same_number(groups["lo"], groups["hi"]):
                        continue
                    stop = match.end("hi") if "hi" in groups else match.end()
                    if any(start < stop and match.start() < end
                           or start == end == stop for start, end, _ in spans):
                        problems.append(f"template artefact in glued text ({why}): "
                                        f"{filled[match.start():stop]!r} in: {filled}")
    return list(dict.fromkeys(problems))


# ---------------------------------------------------------------------------- control spread
#: Two reordering controls of one comparison this many times apart or more need a printed
#: explanation: they measure the same round-off, so such a spread is a jump in one of them.
CONTROL_SPREAD = 100
_SCIENTIFIC = re.compile(r"(?<![\w.])\d+(?:\.\d+)?e[-+]?\d+(?![\w.])", re.I)
#: A glued pair of controls ("7.6e-07 and 8.2e-07"): its key ends in ``controls``.
_CONTROLS_KEY = re.compile(r"(?:^|_)controls$")
#: A glued explanation of the controls (``controls_note``, ``weighted_controls_note``), quoted
#: by the prose. It explains a spread if it says, affirmatively, that a control jumped or
#: diverged (:func:`_says_a_control_moved`: "the reversed control jumped in one update",
#: "... diverged gradually"); "no control jumped", "neither control jumped", "did not jump" or
#: a note on what the largest control shows explain no spread between them.
_CONTROLS_NOTE_KEY = re.compile(r"(?:^|_)controls?_(?:note|why)$")
_MOVED = re.compile(r"\b(?:jumped|diverged)\b", re.I)
_NEGATION = re.compile(r"\b(?:no|not|neither|nor|never|none)\b", re.I)


def _says_a_control_moved(note: str) -> bool:
    """Whether ``note`` says a control jumped or diverged, with no negation in the clause
    before the verb (up to the previous ';' or ':')."""
    for verb in _MOVED.finditer(note):
        clause = re.split(r"[;:]", note[:verb.start()])[-1]
        if not _NEGATION.search(clause):
            return True
    return False


def _printed_control_pairs(notebook: dict) -> list[tuple[str, list[float]]]:
    """The controls a visible output prints after "reordering controls", in scientific
    notation, up to the end of the clause (a ';' or ': ' after the first number)."""
    pairs = []
    for line in _outputs_shown(notebook).splitlines():
        for match in re.finditer(r"\breordering controls\b", line, re.I):
            rest, numbers, last = line[match.end():], [], 0
            for number in _SCIENTIFIC.finditer(rest):
                if numbers and re.search(r";|: ", rest[last:number.start()]):
                    break
                numbers.append(float(number.group(0)))
                last = number.end()
            if len(numbers) >= 2:
                pairs.append((line.strip(), numbers))
    return pairs


def _outputs_shown(notebook: dict) -> str:
    """The text of the outputs a page shows (not its sources, not its glue records)."""
    return "\n".join(_output_text(output) for cell in notebook["cells"]
                     if cell["cell_type"] == "code"
                     for output in cell.get("outputs", [])
                     if "scrapbook" not in output.get("metadata", {})
                     and _shown(output, set(cell.get("metadata", {}).get("tags", []))))


def unexplained_control_spread(notebook: dict) -> list[str]:
    """Sibling reordering controls ``CONTROL_SPREAD`` times apart or more (glued as
    ``<name>_controls`` and quoted, or printed after "reordering controls") on a page whose
    prose quotes no glued explanation (a ``*_controls_note`` that says a control jumped or
    diverged), one problem per pair."""
    texts = glued_texts(notebook)
    quoted = {key for key, _ in quoted_glue(notebook, _GLUE_ANY_ROLE)}
    pairs = [(f"{key}: {texts[key]}", [float(n) for n in _SCIENTIFIC.findall(texts[key])])
             for key in sorted(quoted & set(texts)) if _CONTROLS_KEY.search(key)]
    pairs = [pair for pair in pairs + _printed_control_pairs(notebook) if len(pair[1]) >= 2]
    if any(_CONTROLS_NOTE_KEY.search(key) and _says_a_control_moved(texts.get(key, ""))
           for key in quoted):
        return []
    return list(dict.fromkeys(
        f"reordering controls {CONTROL_SPREAD} times apart or more, no explanation of the jump "
        f"glued (a quoted *_controls_note): {where}" for where, numbers in pairs
        if 0 < max(numbers) >= CONTROL_SPREAD * min(numbers)))

def read_executed(path: pathlib.Path) -> dict:
    """An executed page, with the glue values its build kept beside it, if any."""
    notebook = json.loads(path.read_text(encoding="utf-8"))
    glue_path = path.with_name(path.stem + ".glue.json")
    if glue_path.exists():
        notebook = with_build_glue(notebook, json.loads(glue_path.read_text(encoding="utf-8")))
    return notebook


def page_problems(stem: str, notebook: dict) -> list[str]:
    """The fourth rule's problems of one page (sources or executed)."""
    from_files = glued_from_files(notebook, ALLOWED_FILE_GLUE.get(stem, {}))
    if stem in FILE_GLUE_PENDING:
        from_files = [] if from_files else [
            "FILE_GLUE_PENDING lists the page, but it glues nothing from a file any more"]
    return (machinery_shown(notebook) + pragmas_shown(notebook) + missing_sections(notebook)
            + from_files + notebook_assert_words(notebook) + reader_finds(stem, notebook))


# ---------------------------------------------------------------------------- reader finds
#: What a code constant's name looks like: ALL_CAPS, two characters or more, two letters or
#: more (``EPOCHS``, ``LEARNING_RATE``, ``WARMUP_RUN``; not ``K`` or ``B``, the book's math).
_CONSTANT = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*")
#: A code span that sets a constant (```MAX_MICRO_BATCH = 16```): an exercise telling the
#: reader which line to edit and to what value, so both the name and the value are there.
_SETTING_SPAN = re.compile(r"`\s*[A-Z][A-Z0-9_]*\s*=\s*[^`=]+`")
_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _library_exports() -> set[str]:
    """``accumcore.__all__``, read from the package's ``__init__.py`` without importing it
    (TensorFlow is not needed to check prose): API a reader uses may be named."""
    try:
        tree = ast.parse((_ROOT / "accumcore" / "__init__.py").read_text(encoding="utf-8"))
    except OSError:
        return set()
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                                                 for t in node.targets)):
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:
                return set()
    return set()


def page_constants(notebook: dict) -> set[str]:
    """The ALL_CAPS names (``_CONSTANT``) the page's code cells assign (any cell, removed ones
    too: the name is the page's own either way), without the library's exports."""
    names = {node.id for tree in _trees(notebook) for node in ast.walk(tree)
             if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
             and _CONSTANT.fullmatch(node.id) and len(re.findall("[A-Z]", node.id)) >= 2}
    return names - _library_exports()


def constant_names_in_prose(notebook: dict) -> list[str]:
    """A code constant's name in the prose (reader find: "for `EPOCHS` epochs", "a fresh
    `SGD(LEARNING_RATE)`", "`WARMUP_RUN`"): an ALL_CAPS name the page's code assigns
    (:func:`page_constants`), in a Markdown cell's text or code spans, one problem per name
    and sentence. Readers get words and the value, not the variable. Not read: fenced code
    blocks (a listing is code), math, roles, link targets, and a code span that sets the
    constant (``_SETTING_SPAN``: ```MAX_MICRO_BATCH = 16``` in an exercise says which line to
    edit, value included). Environment variables (``ACCUMCORE_QUICK``) are strings in the
    code, not assigned names, so the QUICK switch's cells are not the prose's business; names
    the library exports (``accumcore.__all__``) are API a reader uses, and Keras's or
    TensorFlow's constants are not assigned by a page, so neither is reported."""
    names = page_constants(notebook)
    if not names:
        return []
    pattern = re.compile(r"(?<![\w.])(" + "|".join(sorted(names, key=len, reverse=True))
                         + r")(?!\w)")
    strip = [pattern_ for pattern_ in _STRIP if "`[^`]*`" != pattern_.pattern]
    problems = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        for written, _ in sentences("".join(cell["source"])):
            text = _SETTING_SPAN.sub(" ", written)
            for strip_ in strip:
                text = strip_.sub(" ", text)
            for name in dict.fromkeys(pattern.findall(text)):
                problems.append(f"a code constant's name in the prose: {name!r} (say what it "
                                f"is, in words, with its value): {written}")
    return problems


#: Drawing calls (matplotlib's ``Axes`` methods) whose element a caption or alt text may name.
DRAW_CALLS = {"axhline", "axvline", "axhspan", "axvspan", "hlines", "vlines", "plot",
              "semilogy", "semilogx", "loglog", "scatter", "fill_between", "bar", "barh",
              "errorbar", "step", "text", "annotate"}
#: Lines and spans, whose position argument names what they mark (``ax.axhline(floor)``).
_MARKS = {"axhline", "axvline", "axhspan", "axvspan", "hlines", "vlines"}
#: Words that make a caption's clause conditional ("a dotted line at the floor, if a gap is 0").
_CONDITIONAL = re.compile(r"\b(?:if|when|whenever|unless|only where)\b", re.I)


def _figure_texts(cell: dict) -> list[str]:
    """A code cell's figure alt text and caption (myst-nb's ``mystnb`` metadata)."""
    meta = cell.get("metadata", {}).get("mystnb", {})
    return [text for text in (meta.get("image", {}).get("alt"),
                              meta.get("figure", {}).get("caption")) if isinstance(text, str)]


#: Words of a label that name no element ("the floor", "each seed's run"): a label's name is
#: its first word of three letters or more that is none of these.
_LABEL_STOP_WORDS = {"the", "one", "two", "all", "per", "and", "each", "every", "any", "both",
                     "its", "their", "this", "that", "these", "those", "for", "with", "from",
                     "after", "before", "over", "under", "not", "only", "some", "other"}


def _element_names(call: ast.Call) -> set[str]:
    """What a drawing call's element is called: the first content word (three letters or
    more, not in ``_LABEL_STOP_WORDS``) of its ``label=``'s written text, and for a line or
    span, the name of the variable it marks."""
    names = set()
    for keyword in call.keywords:
        if keyword.arg != "label":
            continue
        value = keyword.value
        parts = value.values if isinstance(value, ast.JoinedStr) else [value]
        text = "".join(part.value for part in parts
                       if isinstance(part, ast.Constant) and isinstance(part.value, str))
        names.update([word for word in re.findall(r"[A-Za-z]{3,}", text)
                      if word.lower() not in _LABEL_STOP_WORDS][:1])
    if _called_name(call) in _MARKS:
        names.update(arg.id.replace("_", " ") for arg in call.args[:1]
                     if isinstance(arg, ast.Name) and len(arg.id) >= 3)
    return {name.lower() for name in names}


def conditional_figure_elements(notebook: dict) -> list[str]:
    """A figure's alt text or caption naming an element its code draws only under an ``if``
    (reader find: chapter 4's alt text promised "a dotted line at the floor", drawn by
    ``ax.axhline(floor, ..., label="floor ...")`` under ``if zeros:``; a run without exact
    zeros shows no such line). The heuristic, narrow on purpose: in a cell with alt text or a
    caption, a drawing call (``DRAW_CALLS``) in the body or ``else`` of an ``if`` statement is
    named by its label's first content word and, for a line or span, by its position variable
    (:func:`_element_names`); an element drawn in both branches of an ``if`` (its body and its
    ``else``, ``elif`` chains included) or by a call outside every ``if`` is always drawn, and
    not reported. The caption names it if it holds that word, whole, singular or
    plural, in a clause with no conditional word (``_CONDITIONAL``: "if", "when", "unless",
    ...). Not seen: conditional expressions (``label=... if x else None``), elements drawn by a
    helper function that decides for itself, loops over a possibly empty list."""
    problems = []
    for cell in notebook["cells"]:
        texts = _figure_texts(cell) if cell["cell_type"] == "code" else []
        if not texts:
            continue
        try:
            tree = ast.parse("".join(cell["source"]))
        except SyntaxError:
            continue
        names = set()
        for branch in (n for n in ast.walk(tree) if isinstance(n, ast.If)):
            body, orelse = _drawn(branch.body), _drawn(branch.orelse)
            names |= body ^ orelse  # drawn in both branches: drawn either way
        names -= _drawn(tree.body, unconditional=True)
        for text in texts:
            for clause in re.split(r"[.;:]\s", text):
                if _CONDITIONAL.search(clause):
                    continue
                for name in sorted(names):
                    if re.search(r"\b" + re.escape(name) + r"s?\b", clause, re.I):
                        problems.append(f"a figure's text names {name!r}, which its code draws "
                                        f"only under an 'if' (say when it is drawn, or draw it "
                                        f"always): {text}")
    return list(dict.fromkeys(problems))


def _drawn(statements: list, unconditional: bool = False) -> set[str]:
    """The element names (:func:`_element_names`) of the drawing calls in ``statements``;
    with ``unconditional``, only those outside every ``if`` statement."""
    names, todo = set(), list(statements)
    while todo:
        node = todo.pop()
        if unconditional and isinstance(node, ast.If):
            continue
        if isinstance(node, ast.Call) and _called_name(node) in DRAW_CALLS:
            names |= _element_names(node)
        todo.extend(ast.iter_child_nodes(node))
    return names


#: A vague magnitude: "orders of magnitude", "a hundredfold or more", "ten times or more",
#: "a factor of ten or more". Said with no number beside it, the reader cannot tell 10 from
#: 10,000; the page can print the factor.
VAGUE_MAGNITUDE = re.compile(
    r"\borders? of magnitude\b|\b(?:an? )?(?:\w+fold|times|hundreds?|thousands?|millions?"
    r"|factor of \w+)\s+or\s+(?:more|over|above|greater|larger)\b", re.I)


#: A number in a sentence that can say how large a magnitude is: a digit that does not number
#: a part of the book or of a run ("in chapter 3", "section 2", "exercise 1", "figure 4"):
#: such a number says nothing about a factor. A digit in a word ("float64") still counts: a
#: narrower rule (a factor beside the phrase) would need the sentence's grammar.
_MAGNITUDE_NUMBER = re.compile(
    r"(?<!\bchapter )(?<!\bchapters )(?<!\bsection )(?<!\bsections )(?<!\bexercise )"
    r"(?<!\bfigure )(?<!\bappendix )(?<!\bpart )(?<!\bpage )(?<!\btable )(?<!\bstep )"
    r"(?<![\d.,])\d", re.I)


def vague_magnitudes(notebook: dict) -> list[str]:
    """A vague magnitude (``VAGUE_MAGNITUDE``) in a sentence with no number in it, as readers
    see it: written or glued into the prose (the glued values in place), or in a figure's alt
    text or caption, one problem each. A number is a digit anywhere in the sentence (code spans
    and math included) that numbers no chapter, section, exercise, figure, ... of the book
    (``_MAGNITUDE_NUMBER``: "in chapter 3" says no factor); on the sources a quoted glue
    whose value is not recorded may hold one, so it counts as a number there (the executed
    page, with its values, decides)."""
    records = glue_records(notebook)
    texts = {key: text for key, (_, text) in records.items()}
    values = {key: value for key, (value, _) in records.items()}
    found = []
    for cell in notebook["cells"]:
        if cell["cell_type"] == "markdown":
            for written, _ in sentences("".join(cell["source"])):
                unknown = any(m.group(1) not in texts for m in _GLUE_ANY_ROLE.finditer(written))
                filled, _ = _filled(written, texts, values)
                filled = re.sub(r"\{[a-z]+\}`([^`]*)`", r"\1", filled)  # other roles' text
                found.append((filled, unknown))
        elif cell["cell_type"] == "code":
            found += [(sentence, False) for text in _figure_texts(cell)
                      for sentence in re.split(r"(?<=[.!?])\s+", text)]
    return list(dict.fromkeys(
        f"a vague magnitude with no number in its sentence ({match.group(0)!r}: say the factor "
        f"the page prints): {sentence}"
        for sentence, unknown in found
        if not unknown and not _MAGNITUDE_NUMBER.search(sentence)
        for match in VAGUE_MAGNITUDE.finditer(sentence)))


#: page (notebook stem) -> {a fragment of a problem of :func:`reader_finds`: why it is not
#: reported yet}: pages being rewritten for the reader finds. A listed fragment that matches no
#: problem of its page is stale (:func:`stale_reader_finds_pending`): the tests on the sources
#: fail on it, so that it is removed, but an executed page does not (a page rewritten on
#: another branch is not held up by this list).
READER_FINDS_PENDING: dict[str, dict[str, str]] = {
}


def _reader_find_problems(notebook: dict) -> list[str]:
    return (constant_names_in_prose(notebook) + conditional_figure_elements(notebook)
            + vague_magnitudes(notebook))


def reader_finds(stem: str, notebook: dict) -> list[str]:
    """The eighth rule's problems of one page (sources or executed): code constants' names in
    the prose, figure texts naming conditionally drawn elements, vague magnitudes with no
    number; less those ``READER_FINDS_PENDING`` lists for the page."""
    pending = READER_FINDS_PENDING.get(stem, {})
    return [problem for problem in _reader_find_problems(notebook)
            if not any(fragment in problem for fragment in pending)]


def stale_reader_finds_pending(stem: str, notebook: dict) -> list[str]:
    """The ``READER_FINDS_PENDING`` entries of a page that match none of its problems."""
    problems = _reader_find_problems(notebook)
    return [f"READER_FINDS_PENDING entry matches no problem of the page: {fragment!r}"
            for fragment in READER_FINDS_PENDING.get(stem, {})
            if not any(fragment in problem for problem in problems)]


# ---------------------------------------------------------------------------- assert words
#: The tests' vocabulary in a reader's prose ("asserted", "the assert(s)", "the cell asserts
#: that"): a page says what it checks and shows ("the cell checks that ... and stops if not").
#: Matched in prose only (:func:`prose`): Python's ``assert`` in code is not.
ASSERT_WORDS = re.compile(
    r"\basserted\b|\b(?:the|an?|each|every|its|their|this|these|that|one|two|three) "
    r"assert(?:s|ions?)?\b|\basserts? (?:that|it|them|this|both|each|every)\b", re.I)


def assert_words(markdown: str) -> list[str]:
    """The ``ASSERT_WORDS`` in ``markdown``'s prose, one problem each."""
    text = " ".join(prose(markdown).split())
    return [f"the tests' vocabulary in the prose: {match.group(0)!r} (say what the page "
            "checks and shows: 'the cell checks that ... and stops if not')"
            for match in ASSERT_WORDS.finditer(text)]


#: A keyword argument with a quoted value written as prose (``nonfinite="skip_micro_batch"``
#: outside a code span): the page's typography turns its quotes curly, so pasted into code it
#: is a syntax error (round-16 reader D7). Straight or already curly quotes, single or double.
_QUOTES = "\"'\u201c\u201d\u2018\u2019"
KEYWORD_IN_PROSE = re.compile(
    rf"(?<![\w.])[A-Za-z_]\w*\s?=\s?[{_QUOTES}][^\s{_QUOTES}]+[{_QUOTES}]")


def keywords_in_prose(markdown: str) -> list[str]:
    """The ``KEYWORD_IN_PROSE`` matches in ``markdown``'s prose, one problem each."""
    text = " ".join(prose(markdown).split())
    return [f"a keyword argument written as prose: {match.group(0)!r} (its quotes turn curly: "
            "put it in a code span)" for match in KEYWORD_IN_PROSE.finditer(text)]


def notebook_assert_words(notebook: dict) -> list[str]:
    """:func:`assert_words` and :func:`keywords_in_prose` of a notebook's markdown cells."""
    texts = ["".join(cell["source"]) for cell in notebook["cells"]
             if cell["cell_type"] == "markdown"]
    return [problem for text in texts
            for problem in assert_words(text) + keywords_in_prose(text)]


# ---------------------------------------------------------------------------- rendered pages
#: What no rendered page may show, anywhere on it (code and signatures included): each kind
#: was found by a reader on a built page (the API page, appendix B, the reference pages).
RENDERED: dict[str, str] = {
    **NEVER_SHOWN,
    r"<(?:function|bound method|class|built-in) |<factory>|\bat 0x[0-9a-f]+":
        "a raw object repr in a signature or text: write what it is",
    r"(?<![\w.])_[a-z]\w* \(": "a private name in a rendered parameter list: readers cannot "
                                "pass it",
    PRAGMA.pattern: "a linter pragma in code readers see (a folded cell unfolds): the "
                    "project's tooling, not the lesson",
    r"\bchapter (\d+[a-z]?)[,:(]? \(?\1\. ":
        "a chapter's number said twice (a hand-written 'Chapter N,' before a link whose title "
        "starts 'N.')",
}
#: A sentence this long (in words) said twice on one page is a repeat, not a refrain.
REPEAT_MIN_WORDS = 6


class _VisibleText(html.parser.HTMLParser):
    """The text of a built page's article (``<article class="bd-article">``, or the whole
    body without one), scripts and styles left out; ``prose`` keeps only its paragraphs
    outside tables, code blocks and API entries (``<dl>``), where repeats are a page's own."""

    _SKIP = {"script", "style"}
    _NOT_PROSE = {"pre", "table", "dl"}
    _BLOCKS = {"p", "li", "dt", "dd", "td", "th", "h1", "h2", "h3", "h4", "h5", "h6", "pre",
               "div", "tr", "table", "section", "br", "figcaption", "caption"}

    def __init__(self) -> None:
        super().__init__()
        self.all: list[tuple[bool, str]] = []
        self.prose: list[tuple[bool, str]] = []
        self._open = {"skip": 0, "not_prose": 0, "p": 0, "article": 0}
        self.has_article = False

    def handle_starttag(self, tag, attrs) -> None:
        if tag == "article" and "bd-article" in (dict(attrs).get("class") or ""):
            self._open["article"], self.has_article = 1, True
        elif tag == "article" and self._open["article"]:
            self._open["article"] += 1
        self._count(tag, +1)
        if tag in self._BLOCKS:
            self._text("\n")

    def handle_endtag(self, tag) -> None:
        if tag == "article" and self._open["article"]:
            self._open["article"] -= 1
        self._count(tag, -1)
        if tag in self._BLOCKS:
            self._text("\n")

    def _count(self, tag: str, step: int) -> None:
        for key, tags in (("skip", self._SKIP), ("not_prose", self._NOT_PROSE), ("p", {"p"})):
            if tag in tags:
                self._open[key] = max(0, self._open[key] + step)

    def handle_data(self, data) -> None:
        if not self._open["skip"]:  # a line break inside a paragraph is a space
            self._text(data if self._open["not_prose"] else data.replace("\n", " "))

    def _text(self, data: str) -> None:
        inside = bool(self._open["article"])
        self.all.append((inside, data))
        if data == "\n" or (self._open["p"] and not self._open["not_prose"]):
            self.prose.append((inside, data))


def rendered_text(page_html: str) -> tuple[str, str]:
    """A built page's visible text (its article if it has one): all of it, and its
    paragraphs' prose (:class:`_VisibleText`), block elements separated by newlines."""
    parser = _VisibleText()
    parser.feed(page_html)

    def join(parts: list) -> str:
        return "".join(t for inside, t in parts if inside or not parser.has_article)

    return join(parser.all), join(parser.prose)


_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z`*(\"])|\n+")


def _opening(sentence: str, words: int = 4) -> tuple[str, ...]:
    return tuple(re.sub(r"\W", "", w).lower() for w in sentence.split()[:words])


def repeated_sentences(prose: str) -> list[str]:
    """The sentences of ``prose`` said twice: one of ``REPEAT_MIN_WORDS`` words or more said
    again verbatim, or a sentence that opens with the same four words as the one before it
    (a link whose title repeats the sentence it ends: "The book's helpers (`accumcore.lab`)
    are documented in Appendix B. The book's helpers: `accumcore.lab`."), once each."""
    seen, repeated, before = set(), [], None
    for sentence in _SENTENCE.split(prose):
        sentence = " ".join(sentence.split())
        if not sentence:
            continue
        opening = _opening(sentence)
        if before is not None and len(opening) == 4 and opening == _opening(before):
            repeated.append(f"{before} {sentence}")
        before = sentence
        if len(sentence.split()) < REPEAT_MIN_WORDS:
            continue
        if sentence in seen and sentence not in repeated:
            repeated.append(sentence)
        seen.add(sentence)
    return repeated


def rendered_page_problems(page_html: str) -> list[str]:
    """What a built HTML page shows that no page may (``RENDERED``, anywhere on it) and the
    sentences it repeats verbatim, one line each."""
    text, prose = rendered_text(page_html)
    flat = " ".join(text.split())
    problems = [f"{why}: {match.group(0)!r}"
                for pattern, why in RENDERED.items()
                for match in re.finditer(pattern, flat, re.IGNORECASE)]
    return problems + [f"a sentence said twice on the page: {s!r}"
                       for s in repeated_sentences(prose)]


def main_html(folder: pathlib.Path) -> int:
    """``--html DIR``: :func:`rendered_page_problems` of every page of a built book
    (``DIR/book/**/*.html``, or ``DIR/**/*.html``); exit 1 on any."""
    book = folder / "book" if (folder / "book").is_dir() else folder
    pages = sorted(book.rglob("*.html"))
    if not pages:
        print(f"check_prose_numbers: no HTML pages in {folder}", file=sys.stderr)
        return 1
    problems = [f"{page.relative_to(book)}: {problem}" for page in pages
                for problem in rendered_page_problems(page.read_text(encoding="utf-8"))]
    for line in problems:
        print(line)
    print(f"check_prose_numbers --html: {len(pages)} pages, {len(problems)} problems (issue "
          "references, internal module paths, raw reprs, private parameters, linter pragmas, "
          "repeated sentences)")
    return 1 if problems else 0


USAGE = """usage: check_prose_numbers.py [EXECUTED_DIR]
       check_prose_numbers.py --html HTML_DIR

EXECUTED_DIR: the executed notebooks of a build (default _build/jupyter_execute/book).
--html HTML_DIR: the rendered pages of a build (e.g. _build/html): issue references, internal
module paths, raw object reprs, private parameter names, linter pragmas and sentences said twice."""


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv and argv[0] == "--html":
        if len(argv) != 2:
            print(USAGE, file=sys.stderr)
            return 2
        return main_html(pathlib.Path(argv[1]))
    folder = pathlib.Path(argv[0] if argv else "_build/jupyter_execute/book")
    notebooks = sorted(folder.glob("*.ipynb"))
    if not notebooks:
        print(f"check_prose_numbers: no executed notebooks in {folder}", file=sys.stderr)
        return 1
    failures, compared = [], []
    for path in notebooks:
        notebook = read_executed(path)
        for number in unshown_numbers(notebook, ALLOWED.get(path.stem, {})):
            failures.append(f"{path.stem}: '{number}' in the prose, shown by no output")
        for problem in uncomputed_comparisons(notebook, ALLOWED_COMPARISONS.get(path.stem, {})):
            compared.append(f"{path.stem}: {problem}")
        for problem in known_contradictions(path.stem, notebook):
            compared.append(f"{path.stem}: {problem}")
        for problem in page_problems(path.stem, notebook) + executed_page_problems(
                path.stem, notebook) + unrecorded_glue(notebook):
            compared.append(f"{path.stem}: {problem}")
    for line in failures + compared:
        print(line)
    print(f"check_prose_numbers: {len(notebooks)} pages, {len(failures)} unshown numbers, "
          f"{len(compared)} uncomputed comparisons, known contradictions, machinery, missing "
          "sections, values glued from files, glued numbers not printed, glued template "
          "artefacts, unexplained control spreads, constants named in the prose, conditional "
          "figure elements or vague magnitudes")
    return 1 if failures or compared else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
